# colibri/pyx/linear.pxi: linear, y (T, R) = x (T, C) @ W.T (+ bias), on the row kernel or a
# GEMM path (f32 activations: csrc/gemm.h; int8 / int16 codes: csrc/igemm.h).

cdef void _linear_rows(const Wmat *w, Py_ssize_t expert, const float *x, Py_ssize_t n,
                       const float *xsum, Act a, const float *bias, float *y,
                       Py_ssize_t y_stride, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of W (expert `expert`) against the n tokens of x (n, C), xsum (n, C/G)
    (or, when w.iact, their quantized rows a): y[t, r] = W[r] . x[t] (+ bias[r]), y with
    row stride y_stride.
    Token blocks outside, rows inside: the tile of rows is reused by every block from cache."""
    if w.gemm_scratch != NULL and n >= _gemm_min_for(w):
        if w.iact:
            _linear_rows_igemm(w, expert, n, a, bias, y, y_stride, r0, r1)
        else:
            _linear_rows_gemm(w, expert, x, n, bias, y, y_stride, r0, r1)
        return
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef Py_ssize_t C = w.cols, ss = w.xsum_cols, t0, r, t
    cdef int nt
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < w.block else w.block
        if w.iact:                                    # the whole tile in one call
            w.idot(base + r0 * w.row_stride, w.row_stride, r1 - r0, C, w.group,
                   a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                   y + t0 * y_stride + r0, y_stride)
        else:
            w.dot(base + r0 * w.row_stride, w.row_stride, r1 - r0, C, w.group, x + t0 * C, C,
                  xsum + t0 * ss, ss, nt, y + t0 * y_stride + r0, y_stride)
        if bias != NULL:
            for r in range(r0, r1):
                for t in range(nt):
                    y[(t0 + t) * y_stride + r] += bias[r]
        t0 += nt


cdef void _linear_rows_gemm(const Wmat *w, Py_ssize_t expert, const float *x, Py_ssize_t n,
                            const float *bias, float *y, Py_ssize_t y_stride, Py_ssize_t r0,
                            Py_ssize_t r1) noexcept nogil:
    """_linear_rows on the GEMM path: passes of up to COLIBRI_GEMM_NB tokens (of near-equal
    size), each over the panels of COLIBRI_GEMM_NR rows (see csrc/gemm.h): a pass's x is read
    from cache by every panel of the tile; each panel is decoded once per pass."""
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef float *panel = w.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef Py_ssize_t C = w.cols, rs = w.row_stride, p, t0, t1, s, ns, r, t
    cdef int nr
    ns = (n + COLIBRI_GEMM_NB - 1) // COLIBRI_GEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_GEMM_NR else COLIBRI_GEMM_NR
            w.gemm(base + p * rs, rs, nr, C, w.group, x + t0 * C, C, t1 - t0,
                   y + t0 * y_stride + p, y_stride, panel)
            p += nr
    if bias != NULL:
        for t in range(n):
            for r in range(r0, r1):
                y[t * y_stride + r] += bias[r]


cdef void _linear_rows_igemm(const Wmat *w, Py_ssize_t expert, Py_ssize_t n, Act a,
                             const float *bias, float *y, Py_ssize_t y_stride, Py_ssize_t r0,
                             Py_ssize_t r1) noexcept nogil:
    """_linear_rows on the integer GEMM path (int8 / int16 codes a, csrc/igemm.h): passes of
    up to COLIBRI_IGEMM_NB tokens (of near-equal size), each over the panels of
    COLIBRI_IGEMM_NR rows; each panel is decoded once per pass."""
    cdef const uint8_t *base = w.base + expert * w.expert_stride
    cdef float *scratch = w.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef Py_ssize_t C = w.cols, rs = w.row_stride, p, t0, t1, s, ns, r, t
    cdef int nr
    ns = (n + COLIBRI_IGEMM_NB - 1) // COLIBRI_IGEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_IGEMM_NR else COLIBRI_IGEMM_NR
            w.igemm(base + p * rs, rs, nr, C, w.group, a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds,
                    a.s + t0 * a.ds, a.ds, t1 - t0, y + t0 * y_stride + p, y_stride, scratch)
            p += nr
    if bias != NULL:
        for t in range(n):
            for r in range(r0, r1):
                y[t * y_stride + r] += bias[r]


cdef void _group_sums_serial(const float *x, Py_ssize_t n, Py_ssize_t cols, Py_ssize_t group,
                             float *xsum) noexcept nogil:
    """xsum (n, C/G) = per-group sums of the n rows of x (n, C); C adds per row, serial."""
    cdef Py_ssize_t i
    for i in range(n):
        colibri_group_sums(x + i * cols, cols, group, xsum + i * (cols // group))


ctypedef struct LinearJob:
    # one linear call on the pool: work item i = rows i*tr .. (i+1)*tr of the matrix
    const Wmat *m
    Py_ssize_t expert, T, R, tr
    const float *x
    const float *xs
    Act a
    const float *bias
    float *y


cdef void _linear_task(void *ctx, Py_ssize_t i) noexcept nogil:
    cdef const LinearJob *j = <const LinearJob *>ctx
    cdef Py_ssize_t r1 = (i + 1) * j.tr
    if r1 > j.R:
        r1 = j.R
    _linear_rows(j.m, j.expert, j.x, j.T, j.xs, j.a, j.bias, j.y, j.R, i * j.tr, r1)


def linear(const float[:, ::1] x, w, bias, float[:, ::1] out, Py_ssize_t expert, int threads,
           activations="f32"):
    """out (T, R) = x (T, C) @ W[expert].T (+ bias (R,)); x float32, w a WeightRef."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat m
    keep = _load(w, "w", &m, act)
    cdef Py_ssize_t T = x.shape[0], R = m.rows, C = m.cols
    if x.shape[1] != C:
        raise ValueError(f"x has {x.shape[1]} columns, the weight has cols {C}")
    if out.shape[0] != T or out.shape[1] != R:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {R})")
    if not 0 <= expert < m.n_experts:
        raise ValueError(f"expert {expert} out of range for a weight of {m.n_experts} experts")
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if bias is not None:
        bv = bias
        if bv.shape[0] != R:
            raise ValueError(f"bias has {bv.shape[0]} elements, expected rows {R}")
        bp = &bv[0]
    if T == 0:
        return
    cdef const char *x0 = <const char *>&x[0, 0]
    cdef const char *o0 = <const char *>&out[0, 0]
    if x0 < o0 + 4 * T * R and o0 < x0 + 4 * T * C:      # both C-contiguous: byte ranges
        raise ValueError("out must not overlap x (linear reads every row of x while writing)")
    _linear_run(&x[0, 0], T, &m, bp, &out[0, 0], expert, threads)


cdef _linear_run(const float *x, Py_ssize_t T, const Wmat *w, const float *bp, float *out,
                 Py_ssize_t expert, int threads):
    """linear's work once its arguments are checked: x (T, C) and out (T, R) C-contiguous,
    T >= 1, not overlapping; w is copied (the call sets the copy's GEMM scratch)."""
    cdef Py_ssize_t nbytes = _linear_bytes(T, w, threads)
    scratch = _take(nbytes) if nbytes > 0 else None
    cdef char *base = _base(scratch) if nbytes > 0 else NULL
    try:
        with nogil:
            _linear_core(x, T, w, bp, out, expert, threads, base)
    finally:
        if scratch is not None:
            _give(scratch)


cdef inline Py_ssize_t _linear_gemm_bytes(Py_ssize_t T, const Wmat *w, int threads,
                                          int *nth) noexcept nogil:
    """The team of linear's call (into nth) and the bytes of its GEMM scratch (0: the row
    kernel)."""
    nth[0] = _team(<double>w.rows * w.row_stride * T, threads)
    return _gemm_bytes(T, nth[0], _gemm_min_for(w))


cdef Py_ssize_t _linear_bytes(Py_ssize_t T, const Wmat *w, int threads) noexcept nogil:
    """Bytes of scratch _linear_core needs from a 64-aligned base (0: none), for the current
    knobs (the team and the GEMM crossover)."""
    cdef int nth
    cdef Py_ssize_t gbytes = _linear_gemm_bytes(T, w, threads, &nth)
    cdef Py_ssize_t xbytes = 0 if gbytes else T * w.xsum_cols * 4     # GEMM: no sums
    if w.iact:
        return _act_bytes(T, w.cols, w.wide) + 64 + gbytes
    if xbytes > 0 or gbytes > 0:
        return xbytes + 64 + gbytes
    return 0


cdef void _linear_core(const float *x, Py_ssize_t T, const Wmat *w, const float *bp,
                       float *out, Py_ssize_t expert, int threads, char *scratch) noexcept nogil:
    """_linear_run's work on scratch (_linear_bytes(T, w, threads) bytes, 64-aligned): the
    activations quantized (int8 / int16) or their group sums (q4), then the row tiles on the
    pool. The linear call of the compiled decode step (decode_layer.pxi) too."""
    cdef Wmat m = w[0]
    cdef Py_ssize_t R = m.rows, C = m.cols
    cdef int nth
    cdef Py_ssize_t gbytes = _linear_gemm_bytes(T, &m, threads, &nth)
    cdef Py_ssize_t panel_rows = COLIBRI_IGEMM_NR if m.iact else COLIBRI_GEMM_NR
    cdef Py_ssize_t tr = _tile_rows(R, _GEMM_TILE_ROW_BYTES if gbytes else m.row_stride, nth,
                                    panel_rows if gbytes else 1,
                                    not gbytes and T <= COLIBRI_MAX_NT)
    cdef Py_ssize_t n_tiles = (R + tr - 1) // tr
    cdef LinearJob job
    cdef float *xs = NULL
    cdef Act a
    cdef char *cur = scratch
    a.q, a.d, a.s, a.qs, a.ds, a.isa, a.wide = NULL, NULL, NULL, 0, 0, 0, 0
    cdef Py_ssize_t xbytes = 0 if gbytes else T * m.xsum_cols * 4     # GEMM: no sums
    if m.iact:
        _carve_act(&cur, &a, T, C, m.wide)
        if gbytes > 0:
            m.gemm_scratch = <float *>_carve(&cur, gbytes)
    elif xbytes > 0 or gbytes > 0:
        xs = <float *>_carve(&cur, xbytes)
        if gbytes > 0:
            m.gemm_scratch = <float *>_carve(&cur, gbytes)
    if m.iact:
        _quantize_serial(x, T, C, &a)
    elif xbytes > 0:
        _group_sums_serial(x, T, C, m.group, xs)
    # (one thread: the pool runs the tiles in order on this thread)
    job.m, job.expert, job.x, job.T, job.xs, job.a = &m, expert, x, T, xs, a
    job.bias, job.y, job.R, job.tr = bp, out, R, tr
    colibri_pool_run(nth, _linear_task, &job, n_tiles)
