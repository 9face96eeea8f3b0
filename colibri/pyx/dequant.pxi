# colibri/pyx/dequant.pxi: dequantize, a test and debugging helper (the kernels never build a
# dequantized matrix).

ctypedef struct DequantJob:
    const Wmat *m
    const uint8_t *base
    float *out


cdef void _dequant_task(void *ctx, Py_ssize_t r) noexcept nogil:
    cdef const DequantJob *j = <const DequantJob *>ctx
    colibri_decode_row(j.m.fmt, j.base + r * j.m.row_stride, j.m.cols, j.m.group,
                       j.out + r * j.m.cols)


def dequantize(w, Py_ssize_t expert, int threads):
    """float32 (R, C): the matrix of expert `expert`, decoded with the scalar path."""
    _check_threads(threads)
    cdef Wmat m
    keep = _load(w, "w", &m)
    if not 0 <= expert < m.n_experts:
        raise ValueError(f"expert {expert} out of range for a weight of {m.n_experts} experts")
    out = np.empty((m.rows, m.cols), dtype=np.float32)
    cdef float[:, ::1] ov = out
    cdef DequantJob job
    job.m, job.base, job.out = &m, m.base + expert * m.expert_stride, &ov[0, 0]
    with nogil:
        colibri_pool_run(threads, _dequant_task, &job, m.rows)
    return out
