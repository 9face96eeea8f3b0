# colibri/pyx/bandwidth.pxi: the memory read kernel (read_sum).

ctypedef struct ReadJob:
    const uint8_t *p
    Py_ssize_t n, part
    int isa
    uint64_t sums[COLIBRI_POOL_MAX_THREADS]


cdef void _read_task(void *ctx, Py_ssize_t i) noexcept nogil:
    cdef ReadJob *j = <ReadJob *>ctx
    cdef Py_ssize_t lo = i * j.part, hi = lo + j.part
    if hi > j.n:
        hi = j.n
    j.sums[i] = colibri_read_sum(j.isa, j.p + lo, <size_t>(hi - lo))


def read_sum(const uint8_t[::1] buf, int threads):
    """Sum of buf as u64 words (wrapping), each thread streaming one contiguous part."""
    _check_threads(threads)
    cdef Py_ssize_t n = buf.shape[0], i
    cdef uint64_t total = 0
    cdef ReadJob job
    if n == 0:
        return 0
    cdef Py_ssize_t part = (n + threads - 1) // threads
    part = (part + 4095) // 4096 * 4096                # page-aligned parts
    cdef Py_ssize_t nparts = (n + part - 1) // part    # <= threads
    job.p, job.n, job.part, job.isa = &buf[0], n, part, _isa
    with nogil:
        colibri_pool_run(threads, _read_task, &job, nparts)
    for i in range(nparts):
        total += job.sums[i]
    return int(total)
