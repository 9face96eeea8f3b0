# colibri/pyx/attention.pxi: decode attention, one token's query heads over a KV cache
# slice (csrc/attend.h), the cache float32, float16 or bf16 (uint16 bits).

ctypedef struct AttendJob:
    # work item g = the G query heads of kv head g
    const float *q
    const void *k
    const void *v
    float *out
    float *s                    # G * n floats of score scratch per thread
    Py_ssize_t hs, rs, n
    int G, Dh, isa, fmt
    float scale
    const float *sinks          # H floats (per query head) or NULL: attention sinks


cdef _attend_run(int fmt, const float *q, const void *k, const void *v, float *out,
                 Py_ssize_t hs, Py_ssize_t rs, Py_ssize_t n, Py_ssize_t H, Py_ssize_t Hkv,
                 Py_ssize_t Dh, float scale, int threads, str name,
                 const float *sinks=NULL):
    """The attention of H query heads q (H, Dh) over n keys / values of Hkv heads of storage
    format fmt (COLIBRI_F32 / F16 / BF16; head h at element h * hs of k, position j at
    + j * rs; v the same) into out (H, Dh), on the pool, one work item per kv head (checked
    arguments); sinks: H floats, a sink logit per query head (csrc/attend.h), or NULL."""
    cdef int nth = _attend_team(Hkv, n, Dh, threads)
    cdef float *scratch = <float *>malloc(4 * nth * n * (H // Hkv))
    if scratch == NULL:
        raise MemoryError(f"{name}: no memory for {nth} x {n} scores")
    try:
        with nogil:
            _attend_core(fmt, q, k, v, out, hs, rs, n, H, Hkv, Dh, scale, nth, scratch, sinks)
    finally:
        free(scratch)


cdef inline int _attend_team(Py_ssize_t Hkv, Py_ssize_t n, Py_ssize_t Dh,
                             int threads) noexcept nogil:
    """The threads of an attention over n positions of Hkv heads (at most one per kv head);
    its score scratch is nth * n * G floats."""
    cdef int nth = _team(<double>8 * Hkv * n * Dh, threads)
    if nth > Hkv:
        nth = <int>Hkv
    return nth


cdef void _attend_core(int fmt, const float *q, const void *k, const void *v, float *out,
                       Py_ssize_t hs, Py_ssize_t rs, Py_ssize_t n, Py_ssize_t H,
                       Py_ssize_t Hkv, Py_ssize_t Dh, float scale, int nth,
                       float *scratch, const float *sinks=NULL) noexcept nogil:
    """_attend_run's work on nth = _attend_team(...) threads, scratch nth * n * (H / Hkv)
    floats; the attention of the compiled decode step (decode_layer.pxi) too. sinks: as
    _attend_run's."""
    cdef AttendJob job
    job.q, job.k, job.v, job.out, job.s = q, k, v, out, scratch
    job.hs, job.rs, job.n = hs, rs, n
    job.G, job.Dh, job.isa, job.fmt, job.scale = <int>(H // Hkv), <int>Dh, _isa, fmt, scale
    job.sinks = sinks
    colibri_pool_run(nth, _attend_task, &job, Hkv)


cdef void _attend_task(void *ctx, Py_ssize_t g) noexcept nogil:
    cdef const AttendJob *j = <const AttendJob *>ctx
    colibri_attend_sinks(j.isa, j.fmt, j.q, j.G, j.Dh, j.k, j.v, j.hs, j.rs, j.n, j.scale,
                         j.sinks, j.s + colibri_worker_num() * j.n * j.G, j.out,
                         <int>(g * j.G), <int>((g + 1) * j.G))


# The storage formats of a cache plane, by NumPy dtype (bf16 travels as its uint16 bits).
_KV_FORMATS = {np.dtype(np.float32): COLIBRI_F32, np.dtype(np.float16): COLIBRI_F16,
               np.dtype(np.uint16): COLIBRI_BF16}


def attend_decode(const float[:, ::1] q, k, v, float scale, float[:, ::1] out, int threads):
    """out (H, Dh) = softmax(scale * q k^T) v per head; q (H, Dh) float32, k and v
    (Hkv, n, Dh) ndarrays of one storage dtype, float32, float16 or uint16 (bf16 bits) (rows
    contiguous, heads and positions strided), H a multiple of Hkv."""
    _check_threads(threads)
    if not isinstance(k, np.ndarray) or not isinstance(v, np.ndarray):
        raise TypeError("attend_decode: k and v must be NumPy arrays")
    fmt = _KV_FORMATS.get(k.dtype)
    if fmt is None or v.dtype != k.dtype or not k.dtype.isnative:
        raise ValueError(f"attend_decode: k and v must both be float32, float16 or uint16 "
                         f"(bf16 bits), found {k.dtype} and {v.dtype}")
    if k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"attend_decode: k {k.shape} and v {v.shape} must be (Hkv, n, Dh)")
    cdef Py_ssize_t H = q.shape[0], Dh = q.shape[1], Hkv = k.shape[0], n = k.shape[1]
    cdef Py_ssize_t es = k.dtype.itemsize
    if k.shape[2] != Dh or v.shape[0] != Hkv or v.shape[1] != n or v.shape[2] != Dh:
        raise ValueError(f"attend_decode: k ({k.shape[0]}, {k.shape[1]}, {k.shape[2]}) and v "
                         f"({v.shape[0]}, {v.shape[1]}, {v.shape[2]}) must both be "
                         f"(Hkv, n, {Dh}) for q of shape ({H}, {Dh})")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"attend_decode: {H} query heads are not a multiple of {Hkv} kv heads")
    if n < 1:
        raise ValueError("attend_decode: no position to attend to (n = 0)")
    if out.shape[0] != H or out.shape[1] != Dh:
        raise ValueError(f"attend_decode: out has shape ({out.shape[0]}, {out.shape[1]}), "
                         f"expected ({H}, {Dh})")
    if (k.strides[1] != v.strides[1] or k.strides[0] != v.strides[0] or k.strides[2] != es
            or v.strides[2] != es or k.strides[1] % es or k.strides[0] % es
            or not k.flags.aligned or not v.flags.aligned):
        raise ValueError("attend_decode: k and v must have the same strides, rows contiguous")
    cdef const char *q0 = <const char *>&q[0, 0]
    cdef const char *o0 = <const char *>&out[0, 0]
    if q0 < o0 + 4 * H * Dh and o0 < q0 + 4 * H * Dh:
        raise ValueError("attend_decode: out must not overlap q")
    if Dh == 0:
        return
    _attend_run(<int>fmt, &q[0, 0], colibri_array_data(k), colibri_array_data(v), &out[0, 0],
                k.strides[0] // es, k.strides[1] // es, n, H, Hkv, Dh, scale, threads,
                "attend_decode")


def kv_widen(src, out):
    """out (N, C) float32 C-contiguous = src (N, C) widened exactly; src float16 or uint16
    (bf16 bits), native order, aligned, rows strided (C contiguous elements each)."""
    if not isinstance(src, np.ndarray) or src.dtype not in (np.dtype(np.float16),
                                                              np.dtype(np.uint16)):
        raise ValueError(f"kv_widen: src must be a float16 or uint16 (bf16) array, found "
                         f"{getattr(src, 'dtype', type(src).__name__)}")
    cdef Py_ssize_t od[2]
    cdef float *o0 = _f32(out, "out", 2, True, od)
    if (src.ndim != 2 or not src.dtype.isnative or not src.flags.aligned
            or (src.shape[1] > 1 and src.strides[1] != 2) or src.strides[0] < 0
            or src.strides[0] % 2):
        raise ValueError(f"kv_widen: src must be 2-D with contiguous rows, found shape "
                         f"{src.shape} strides {src.strides}")
    if od[0] != src.shape[0] or od[1] != src.shape[1]:
        raise ValueError(f"kv_widen: out has shape ({od[0]}, {od[1]}), expected {src.shape}")
    if od[0] == 0 or od[1] == 0:
        return
    cdef int fmt = COLIBRI_F16 if src.dtype == np.float16 else COLIBRI_BF16
    cdef const void *s0 = colibri_array_data(src)
    cdef Py_ssize_t rb = src.strides[0], rows = od[0], cols = od[1]
    with nogil:
        colibri_kv_widen(_isa, fmt, s0, rb, rows, cols, o0)
