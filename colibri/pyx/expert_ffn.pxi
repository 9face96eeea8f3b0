# colibri/pyx/expert_ffn.pxi: the expert FFN, per expert h = silu(x W_gate.T) * (x W_up.T),
# y = h W_down.T, combined per token in k order (expert_ffn); and the dense swiglu.

cdef enum:
    GATEUP_ROWS = 64            # idot gate/up rows per kernel call (then the SiLU product)

cdef void _gateup_rows(const Wmat *g, const Wmat *u, Py_ssize_t e, const float *x,
                       Py_ssize_t xs, Py_ssize_t n, const float *xsg, Py_ssize_t ssg,
                       const float *xsu, Py_ssize_t ssu, Act a, float *h, Py_ssize_t r0,
                       Py_ssize_t r1) noexcept nogil:
    """h[t, r] = silu(W_gate[e][r] . x[t]) * (W_up[e][r] . x[t]) for r in r0..r1, t < n;
    x (n, D) with row stride xs (0: every token is the same row), xsg / xsu the group sums
    of x for gate / up with row strides ssg / ssu, a the quantized x (for a matrix with
    .iact), h (n, I). Gate and up rows are read in the same pass over a token block."""
    if g.gemm_scratch != NULL and n >= _gemm_min and not g.iact and not u.iact:
        _gateup_rows_gemm(g, u, e, x, xs, n, h, r0, r1)
        return
    if g.gemm_scratch != NULL and g.iact and u.iact and n >= _gemm_min_for(g):
        _gateup_rows_igemm(g, u, e, n, a, h, r0, r1)
        return
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef Py_ssize_t D = g.cols, I = g.rows, t0, r, t, rb, re
    cdef float ub[GATEUP_ROWS * COLIBRI_SM_MAX_NT]     # the widest row-kernel pass
    cdef float *ht
    cdef int nt, block = g.block if g.block < u.block else u.block
    t0 = 0
    while t0 < n:
        nt = <int>(n - t0) if n - t0 < block else block
        # blocks of GATEUP_ROWS rows: gate into h, up into ub, then the SiLU product
        rb = r0
        while rb < r1:
            re = rb + GATEUP_ROWS if rb + GATEUP_ROWS < r1 else r1
            if g.iact and u.iact:
                # both on the idot path: the block's gate rows in one call, then its up rows
                # (the f32 bodies measured slower so: their rows stay interleaved, below)
                g.idot(bg + rb * g.row_stride, g.row_stride, re - rb, D, g.group,
                       a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                       h + t0 * I + rb, I)
                u.idot(bu + rb * u.row_stride, u.row_stride, re - rb, D, u.group,
                       a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, nt,
                       ub, GATEUP_ROWS)
            else:
                for r in range(rb, re):
                    if g.iact:
                        g.idot(bg + r * g.row_stride, g.row_stride, 1, D, g.group,
                               a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds,
                               nt, h + t0 * I + r, I)
                    else:
                        g.dot(bg + r * g.row_stride, g.row_stride, 1, D, g.group, x + t0 * xs,
                              xs, xsg + t0 * ssg, ssg, nt, h + t0 * I + r, I)
                    if u.iact:
                        u.idot(bu + r * u.row_stride, u.row_stride, 1, D, u.group,
                               a.q + t0 * a.qs, a.qs, a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds,
                               nt, ub + (r - rb), GATEUP_ROWS)
                    else:
                        u.dot(bu + r * u.row_stride, u.row_stride, 1, D, u.group, x + t0 * xs,
                              xs, xsu + t0 * ssu, ssu, nt, ub + (r - rb), GATEUP_ROWS)
            for t in range(nt):
                colibri_silu_mul(_isa, h + (t0 + t) * I + rb, ub + t * GATEUP_ROWS, re - rb)
            rb = re
        t0 += nt


cdef void _gateup_rows_gemm(const Wmat *g, const Wmat *u, Py_ssize_t e, const float *x,
                            Py_ssize_t xs, Py_ssize_t n, float *h, Py_ssize_t r0,
                            Py_ssize_t r1) noexcept nogil:
    """_gateup_rows on the GEMM path: per pass of up to COLIBRI_GEMM_NB tokens and panel of
    COLIBRI_GEMM_NR rows, gate into h, up into the thread's NB x NR tile, then
    h = silu(h) * up."""
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef float *panel = g.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef float *up = panel + (COLIBRI_GEMM_SCRATCH - COLIBRI_GEMM_NB * COLIBRI_GEMM_NR)
    cdef Py_ssize_t D = g.cols, I = g.rows, p, t0, t1, s, ns, t, i
    cdef float *ht
    cdef int nr
    ns = (n + COLIBRI_GEMM_NB - 1) // COLIBRI_GEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_GEMM_NR else COLIBRI_GEMM_NR
            g.gemm(bg + p * g.row_stride, g.row_stride, nr, D, g.group, x + t0 * xs, xs,
                   t1 - t0, h + t0 * I + p, I, panel)
            u.gemm(bu + p * u.row_stride, u.row_stride, nr, D, u.group, x + t0 * xs, xs,
                   t1 - t0, up, COLIBRI_GEMM_NR, panel)
            for t in range(t1 - t0):
                colibri_silu_mul(_isa, h + (t0 + t) * I + p, up + t * COLIBRI_GEMM_NR, nr)
            p += nr


cdef void _gateup_rows_igemm(const Wmat *g, const Wmat *u, Py_ssize_t e, Py_ssize_t n, Act a,
                             float *h, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """_gateup_rows on the integer GEMM path (int8 / int16 codes a, csrc/igemm.h): per pass
    of up to COLIBRI_IGEMM_NB tokens and panel of COLIBRI_IGEMM_NR rows, gate into h, up into
    the thread's NB x NR tile (the end of its scratch), then h = silu(h) * up."""
    cdef const uint8_t *bg = g.base + e * g.expert_stride
    cdef const uint8_t *bu = u.base + e * u.expert_stride
    cdef float *scratch = g.gemm_scratch + colibri_worker_num() * COLIBRI_GEMM_SCRATCH
    cdef float *up = scratch + (COLIBRI_GEMM_SCRATCH - COLIBRI_IGEMM_NB * COLIBRI_IGEMM_NR)
    cdef Py_ssize_t D = g.cols, I = g.rows, p, t0, t1, s, ns, t
    cdef int nr
    ns = (n + COLIBRI_IGEMM_NB - 1) // COLIBRI_IGEMM_NB
    for s in range(ns):
        t0 = s * n // ns
        t1 = (s + 1) * n // ns
        p = r0
        while p < r1:
            nr = <int>(r1 - p) if r1 - p < COLIBRI_IGEMM_NR else COLIBRI_IGEMM_NR
            g.igemm(bg + p * g.row_stride, g.row_stride, nr, D, g.group, a.q + t0 * a.qs, a.qs,
                    a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, t1 - t0, h + t0 * I + p, I, scratch)
            u.igemm(bu + p * u.row_stride, u.row_stride, nr, D, u.group, a.q + t0 * a.qs, a.qs,
                    a.d + t0 * a.ds, a.s + t0 * a.ds, a.ds, t1 - t0, up, COLIBRI_IGEMM_NR,
                    scratch)
            for t in range(t1 - t0):
                colibri_silu_mul(_isa, h + (t0 + t) * I + p, up + t * COLIBRI_IGEMM_NR, nr)
            p += nr


cdef int _load_ffn(w_gate, w_up, w_down, Wmat *g, Wmat *u, Wmat *d, list keep,
                   int act) except -1:
    keep.append(_load(w_gate, "w_gate", g, act))
    keep.append(_load(w_up, "w_up", u, act))
    keep.append(_load(w_down, "w_down", d, act))
    if (u.rows != g.rows or u.cols != g.cols or d.rows != g.cols or d.cols != g.rows
            or u.n_experts != g.n_experts or d.n_experts != g.n_experts):
        raise ValueError(
            f"FFN weights disagree: w_gate ({g.n_experts} x {g.rows} x {g.cols}), w_up "
            f"({u.n_experts} x {u.rows} x {u.cols}), w_down ({d.n_experts} x {d.rows} x "
            f"{d.cols}); expected (E, I, D), (E, I, D), (E, D, I)")
    return 0


ctypedef struct Ffn:
    # everything the work items of one expert_ffn call share; positions p index the
    # (token, k) slots grouped by expert: expert e owns positions offsets[e]..offsets[e+1]
    Wmat g, u, d
    Py_ssize_t T, K, D, I
    const float *x              # (T, D) the input
    float *xg                   # (TK, D) gathered input rows, or x itself when T == 1
    Py_ssize_t xg_stride        # D, or 0 when T == 1 (every position reads x[0])
    float *xsg                  # group sums of the gathered rows for w_gate (q4), (TK, D/Gg)
    float *xsu                  # ... for w_up
    Py_ssize_t ssg, ssu         # their row strides (0 when T == 1)
    float *h                    # (TK, I) activations
    float *xsd                  # (TK, I/Gd) group sums of h for w_down (q4)
    float *og                   # (TK, D) expert outputs
    bint qx                     # gate or up runs the idot path: quantize the gathered rows
    Act ax                      # (rows_x, D) quantized input (row stride 0 when T == 1)
    Act ah                      # (TK, I) quantized h, when w_down runs the idot path
    const int64_t *offsets      # (E+1,)
    const int32_t *slots        # (TK,) position -> slot t*K + k
    const int64_t *pos          # (TK,) slot -> position
    const int32_t *active       # (n_active,) experts with tokens, ascending
    Py_ssize_t n_active
    Py_ssize_t tr_gu, nt_gu     # gate/up work item: rows tr_gu of one active expert
    Py_ssize_t tr_dn            # down work item: rows tr_dn of every active expert
    const float *weights        # (T, K)
    float *y                    # (T, D)


cdef void _ffn_gather(const Ffn *f, Py_ssize_t p) noexcept nogil:
    """Position p: copy its token's x row, and the group sums of it for gate / up (q4)."""
    cdef const float *src = f.x + (f.slots[p] // f.K) * f.D
    cdef float *dst = f.xg + p * f.D
    cdef Py_ssize_t c
    for c in range(f.D):
        dst[c] = src[c]
    if f.g.xsum_cols > 0:
        colibri_group_sums(dst, f.D, f.g.group, f.xsg + p * f.ssg)
    if f.u.xsum_cols > 0:
        colibri_group_sums(dst, f.D, f.u.group, f.xsu + p * f.ssu)
    if f.qx:
        colibri_quantize_row(f.ax.isa, f.ax.wide, dst, f.D, f.ax.q + p * f.ax.qs, f.ax.d + p * f.ax.ds,
                             f.ax.s + p * f.ax.ds, f.ax.ds)


cdef void _ffn_gateup(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of gate and up of one active expert (_ffn_gateup_rows)."""
    cdef Py_ssize_t r0 = (it % f.nt_gu) * f.tr_gu, r1 = r0 + f.tr_gu
    if r1 > f.I:
        r1 = f.I
    _ffn_gateup_rows(f, f.active[it // f.nt_gu], r0, r1)


cdef void _ffn_gateup_rows(const Ffn *f, Py_ssize_t e, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of gate and up of expert e, for all its tokens; then the group sums (q4)
    or the quantized blocks (idot path) of the new h columns for w_down (r0, r1: whole groups /
    blocks of 32)."""
    cdef Py_ssize_t p0 = f.offsets[e], n_e = f.offsets[e + 1] - f.offsets[e], p
    cdef Py_ssize_t Gd = f.d.group, sd = f.d.xsum_cols
    _gateup_rows(&f.g, &f.u, e, f.xg + p0 * f.xg_stride, f.xg_stride, n_e,
                 f.xsg + p0 * f.ssg, f.ssg, f.xsu + p0 * f.ssu, f.ssu, _act_at(&f.ax, p0),
                 f.h + p0 * f.I, r0, r1)
    if sd > 0:
        for p in range(p0, p0 + n_e):
            colibri_group_sums(f.h + p * f.I + r0, r1 - r0, Gd, f.xsd + p * sd + r0 // Gd)
    if f.d.iact:
        for p in range(p0, p0 + n_e):
            colibri_quantize_act(f.ah.isa, f.ah.wide, f.h + p * f.I, r0 // 32, r1 // 32,
                                 f.ah.q + p * f.ah.qs, f.ah.d + p * f.ah.ds, f.ah.s + p * f.ah.ds)


cdef void _ffn_down(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of w_down of every active expert, for their tokens; then
    y[t, r0:r1] = sum_k weights[t, k] * og[pos[t*K + k], r0:r1], in k order."""
    cdef Py_ssize_t r0 = it * f.tr_dn, r1 = r0 + f.tr_dn, j
    if r1 > f.D:
        r1 = f.D
    for j in range(f.n_active):
        _ffn_down_rows(f, f.active[j], r0, r1)
    _ffn_combine(f, r0, r1)


cdef inline void _ffn_down_rows(const Ffn *f, Py_ssize_t e, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1 of w_down of expert e, for its tokens, into their og rows."""
    cdef Py_ssize_t p0 = f.offsets[e]
    _linear_rows(&f.d, e, f.h + p0 * f.I, f.offsets[e + 1] - p0, f.xsd + p0 * f.d.xsum_cols,
                 _act_at(&f.ah, p0), NULL, f.og + p0 * f.D, f.D, r0, r1)


cdef void _ffn_combine(const Ffn *f, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """y[t, r0:r1] = sum_k weights[t, k] * og[pos[t*K + k], r0:r1], in k order."""
    cdef Py_ssize_t t, k, c
    cdef float wk
    cdef float *yt
    cdef const float *ot
    for t in range(f.T):
        yt = f.y + t * f.D
        for c in range(r0, r1):
            yt[c] = 0.0
        for k in range(f.K):
            wk = f.weights[t * f.K + k]
            ot = f.og + f.pos[t * f.K + k] * f.D
            for c in range(r0, r1):
                yt[c] = yt[c] + wk * ot[c]


cdef void _ffn_expert(const Ffn *f, Py_ssize_t it) noexcept nogil:
    """Work item it of the whole-expert schedule: all of active expert it (gate and up, then
    w_down into its og rows). The same row-kernel calls as the gate/up and down items, so the
    same bits."""
    cdef Py_ssize_t e = f.active[it]
    _ffn_gateup_rows(f, e, 0, f.I)
    _ffn_down_rows(f, e, 0, f.D)


cdef void _ffn_expert_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_expert(<const Ffn *>f, it)


cdef void _ffn_gather_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_gather(<const Ffn *>f, it)


cdef void _ffn_gateup_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_gateup(<const Ffn *>f, it)


cdef void _ffn_down_task(void *f, Py_ssize_t it) noexcept nogil:
    _ffn_down(<const Ffn *>f, it)


cdef void _ffn_run(Ffn *f, Py_ssize_t n_gather, Py_ssize_t n_gu, Py_ssize_t n_dn,
                   int nth) noexcept nogil:
    """The three stages, one pool job each (a job returns when all its items are done)."""
    colibri_pool_run(nth, _ffn_gather_task, f, n_gather)
    colibri_pool_run(nth, _ffn_gateup_task, f, n_gu)
    colibri_pool_run(nth, _ffn_down_task, f, n_dn)


cdef void _ffn_run_experts(Ffn *f, int nth) noexcept nogil:
    """Decode schedule: one job of whole experts (f.n_active items, a multiple of nth, so the
    threads get equal shares), then the combine on this thread. One stage boundary instead
    of two, and no thread waits at the gate/up -> down boundary for the slowest tile."""
    colibri_pool_run(nth, _ffn_expert_task, f, f.n_active)
    _ffn_combine(f, 0, f.D)


cdef _ffn(const float[:, ::1] x, const int32_t[:, ::1] ids, const float[:, ::1] weights,
          Wmat *g, Wmat *u, Wmat *d, float[:, ::1] out, int threads):
    """out (T, D) = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) (checked arguments)."""
    cdef Py_ssize_t T = x.shape[0], K = ids.shape[1]
    buf = _take(_ffn_bytes(T, K, g, u, d, threads))
    cdef char *base = _base(buf)
    try:
        with nogil:
            _ffn_core(&x[0, 0], &ids[0, 0], &weights[0, 0], T, K, g, u, d, &out[0, 0],
                      threads, base)
    finally:
        _give(buf)


cdef inline Py_ssize_t _gcd(Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef Py_ssize_t t
    while b:
        t = a % b
        a = b
        b = t
    return a


cdef inline Py_ssize_t _ffn_gemm_min(const Wmat *g, const Wmat *u, const Wmat *d) noexcept nogil:
    """The fewest tokens of one expert from which any of its matrices takes a GEMM path
    (f32 activations: csrc/gemm.h; int8 / int16 codes: csrc/igemm.h), gate / up only with
    one on each kind (they share the row-kernel pass)."""
    cdef Py_ssize_t n_min = _gemm_min_for(d)
    if g.iact == u.iact and _gemm_min_for(g) < n_min:
        n_min = _gemm_min_for(g)
    return n_min


cdef inline Py_ssize_t _ffn_gemm_bytes(Py_ssize_t TK, const Wmat *g, const Wmat *u,
                                       const Wmat *d, int threads, int *nth_gemm) noexcept nogil:
    """The team of an expert_ffn call by its positions TK (into nth_gemm) and the bytes of
    its GEMM scratch (0: the row kernels), for TK tokens on one expert at most."""
    cdef Py_ssize_t I = g.rows, D = g.cols
    cdef Py_ssize_t bytes_gu = I * (g.row_stride + u.row_stride), bytes_dn = D * d.row_stride
    # the team size _ffn_run will use (work = weight bytes x positions, summed over experts)
    nth_gemm[0] = _team(<double>(bytes_gu + bytes_dn) * TK, threads)
    return _gemm_bytes(TK, nth_gemm[0], _ffn_gemm_min(g, u, d))


cdef Py_ssize_t _ffn_bytes(Py_ssize_t T, Py_ssize_t K, const Wmat *g, const Wmat *u,
                           const Wmat *d, int threads) noexcept nogil:
    """Bytes of scratch _ffn_core needs from a 64-aligned base, for the current knobs."""
    cdef Py_ssize_t E = g.n_experts, D = g.cols, I = g.rows, TK = T * K
    cdef int nth_gemm
    cdef Py_ssize_t gbytes = _ffn_gemm_bytes(TK, g, u, d, threads, &nth_gemm)
    cdef Py_ssize_t sg = g.xsum_cols, su = u.xsum_cols, sd = d.xsum_cols
    cdef bint one = T == 1, qx = g.iact or u.iact
    cdef Py_ssize_t rows_x = 1 if one else TK
    return (8 * (E + 1) + 8 * E + 4 * TK + 8 * TK + 4 * E
            + 4 * rows_x * (0 if one else D) + 4 * rows_x * (sg + su)
            + 4 * TK * (I + sd + D) + 9 * 64 + gbytes
            + (_act_bytes(rows_x, D, g.wide or u.wide) if qx else 0)
            + (_act_bytes(TK, I, d.wide) if d.iact else 0))


cdef void _ffn_core(const float *x, const int32_t *ids, const float *weights, Py_ssize_t T,
                    Py_ssize_t K, const Wmat *g, const Wmat *u, const Wmat *d, float *out,
                    int threads, char *cur) noexcept nogil:
    """_ffn's work on scratch cur (_ffn_bytes(T, K, g, u, d, threads) bytes, 64-aligned):
    x (T, D), ids (T, K) in range, weights (T, K), out (T, D), all C-contiguous. The expert
    FFN of the compiled decode step (decode_layer.pxi) too."""
    cdef Ffn f
    cdef Py_ssize_t D = g.cols, E = g.n_experts
    cdef Py_ssize_t I = g.rows, TK = T * K, p, e, n_active = 0, e_tokens
    cdef double work = 0.0
    cdef Py_ssize_t max_tokens = 0               # of any expert
    cdef bint one = T == 1, one_pass
    cdef Py_ssize_t bytes_gu = I * (g.row_stride + u.row_stride), bytes_dn = D * d.row_stride
    cdef int nth_gemm
    cdef Py_ssize_t gbytes = _ffn_gemm_bytes(TK, g, u, d, threads, &nth_gemm)
    cdef bint gemm_gu = g.iact == u.iact, gemm_dn = True
    cdef Py_ssize_t nr_gu = COLIBRI_IGEMM_NR if g.iact else COLIBRI_GEMM_NR
    f.g, f.u, f.d = g[0], u[0], d[0]
    f.T, f.K, f.D, f.I = T, K, D, I
    cdef Py_ssize_t sg = g.xsum_cols, su = u.xsum_cols, sd = d.xsum_cols
    cdef Py_ssize_t rows_x = 1 if one else TK
    cdef bint qx = g.iact or u.iact
    cdef int64_t *offsets = <int64_t *>_carve(&cur, 8 * (E + 1))
    cdef int64_t *cursor = <int64_t *>_carve(&cur, 8 * E)
    cdef int32_t *slots = <int32_t *>_carve(&cur, 4 * TK)
    cdef int64_t *pos = <int64_t *>_carve(&cur, 8 * TK)
    cdef int32_t *active = <int32_t *>_carve(&cur, 4 * E)
    cdef float *xg = <float *>_carve(&cur, 0 if one else 4 * TK * D)
    f.xsg = <float *>_carve(&cur, 4 * rows_x * sg)
    f.xsu = <float *>_carve(&cur, 4 * rows_x * su)
    f.h = <float *>_carve(&cur, 4 * TK * I)
    f.xsd = <float *>_carve(&cur, 4 * TK * sd)
    f.og = <float *>_carve(&cur, 4 * TK * D)
    if gbytes > 0:                               # one scratch, shared by the three matrices
        f.g.gemm_scratch = <float *>_carve(&cur, gbytes)
        f.u.gemm_scratch = f.g.gemm_scratch
        f.d.gemm_scratch = f.g.gemm_scratch
    f.qx = qx
    f.ax.q, f.ax.d, f.ax.s, f.ax.qs, f.ax.ds, f.ax.isa, f.ax.wide = NULL, NULL, NULL, 0, 0, 0, 0
    f.ah = f.ax
    if qx:
        _carve_act(&cur, &f.ax, rows_x, D, g.wide or u.wide)
    if d.iact:
        _carve_act(&cur, &f.ah, TK, I, d.wide)
    f.x = x
    f.weights = weights
    f.y = out
    cdef Py_ssize_t n_gather, n_gu, n_dn
    cdef int nth
    # GEMM path: tiles of whole panels, w_down's of GEMM_TILE_PANELS panels (the row-kernel
    # tiles of w_down, a few rows of every active expert, would stream each h once per row or
    # two; here once per tile)
    cdef Py_ssize_t align_gu = d.group if sd > 0 else (32 if d.iact else 1), align_dn = 1
    _count_sort(ids, TK, E, offsets, slots, cursor)
    for p in range(TK):
        pos[slots[p]] = p
    for e in range(E):
        e_tokens = offsets[e + 1] - offsets[e]
        if e_tokens > 0:
            if e_tokens > max_tokens:
                max_tokens = e_tokens
            active[n_active] = <int32_t>e
            n_active += 1
            work += <double>(bytes_gu + bytes_dn) * e_tokens
    nth = _team(work, threads)
    if gbytes > 0 and nth > nth_gemm:    # (equal: work == (bytes_gu + bytes_dn) TK)
        nth = nth_gemm
    # the tiles are a GEMM path's only when some expert has the tokens to take one: the
    # scratch is sized before routing, by TK, but a call whose experts all stay under the
    # crossover (T tokens spread over E experts: a short prefill, a batched or speculative
    # step, top-8 decode) runs the row kernels, so it takes row-kernel tiles (the speed of
    # this alone was not measured apart from the crossover's, docs/performance.md change 35)
    if gbytes > 0 and max_tokens < _ffn_gemm_min(g, u, d):
        gbytes = 0
    if gbytes > 0 and gemm_gu:
        align_gu = align_gu * nr_gu // _gcd(align_gu, nr_gu)
    if gbytes > 0 and gemm_dn:
        align_dn = COLIBRI_IGEMM_NR if d.iact else COLIBRI_GEMM_NR
    f.offsets, f.slots, f.pos, f.active, f.n_active = offsets, slots, pos, active, n_active
    if one:                              # decode: every position reads x[0]
        f.xg, f.xg_stride, f.ssg, f.ssu = <float *>f.x, 0, 0, 0
        if sg > 0:
            colibri_group_sums(f.x, D, g.group, f.xsg)
        if su > 0:
            colibri_group_sums(f.x, D, u.group, f.xsu)
        if qx:
            _quantize_serial(f.x, 1, D, &f.ax)
            f.ax.qs, f.ax.ds = 0, 0
        n_gather = 0
    else:
        f.xg, f.xg_stride, f.ssg, f.ssu = xg, D, sg, su
        n_gather = TK
    if d.iact:                           # the padding of h's packed rows
        for p in range(TK):
            colibri_quantize_pad(f.ah.wide, I, f.ah.q + p * f.ah.qs, f.ah.d + p * f.ah.ds,
                                 f.ah.s + p * f.ah.ds, f.ah.ds)
    # gate/up tiles are whole groups of w_down's input (q4: group sums) or whole
    # 32-blocks (idot path), so each item can sum / quantize the h columns it made
    one_pass = max_tokens <= COLIBRI_MAX_NT       # each expert's tokens in one pass
    f.tr_gu = _tile_rows(I, g.row_stride + u.row_stride, nth, align_gu, one_pass)
    f.nt_gu = (I + f.tr_gu - 1) // f.tr_gu
    # down tiles: sized by one expert's rows (each expert's token passes reuse its
    # part of the tile from cache); never below 16 rows, so that the combine reads
    # whole lines of og and y (it walks every token's K rows of the tile)
    f.tr_dn = _tile_rows(D, _GEMM_TILE_ROW_BYTES if gbytes and gemm_dn
                         else d.row_stride,
                         nth, align_dn, one_pass)
    if f.tr_dn < 16 and D >= 16 * 4 * nth:
        f.tr_dn = 16
    n_gu = n_active * f.nt_gu
    n_dn = (D + f.tr_dn - 1) // f.tr_dn
    if one and n_active % nth == 0:          # decode, experts shared out evenly
        _ffn_run_experts(&f, nth)
    else:
        _ffn_run(&f, n_gather, n_gu, n_dn, nth)


def expert_ffn(const float[:, ::1] x, const int32_t[:, ::1] ids, const float[:, ::1] weights,
               w_gate, w_up, w_down, float[:, ::1] out, int threads, activations="f32"):
    """out (T, D) = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]); out may be x itself."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep, act)
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1]
    cdef Py_ssize_t E = g.n_experts
    if D != g.cols:
        raise ValueError(f"x has {D} columns, the experts' hidden size is {g.cols}")
    if ids.shape[0] != T or K < 1:
        raise ValueError(f"ids has shape ({ids.shape[0]}, {K}), expected ({T}, K >= 1)")
    if weights.shape[0] != T or weights.shape[1] != K:
        raise ValueError(f"weights has shape ({weights.shape[0]}, {weights.shape[1]}), "
                         f"expected ({T}, {K})")
    if out.shape[0] != T or out.shape[1] != D:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {D})")
    _check_ids(np.asarray(ids), E)
    if T == 0:
        return
    _ffn(x, ids, weights, &g, &u, &d, out, threads)


def swiglu(const float[:, ::1] x, w_gate, w_up, w_down, float[:, ::1] out, int threads,
           activations="f32"):
    """out (T, D) = W_down @ (silu(W_gate @ x) * (W_up @ x)) per token; one dense FFN (the
    expert FFN with every token on its single expert at weight 1, which is exact)."""
    _check_threads(threads)
    cdef int act = _activations(activations)
    cdef Wmat g, u, d
    keep = []
    _load_ffn(w_gate, w_up, w_down, &g, &u, &d, keep, act)
    if g.n_experts != 1:
        raise ValueError(f"swiglu takes single matrices, found n_experts {g.n_experts}")
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1]
    if D != g.cols:
        raise ValueError(f"x has {D} columns, the FFN's hidden size is {g.cols}")
    if out.shape[0] != T or out.shape[1] != D:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected ({T}, {D})")
    if T == 0:
        return
    _ffn(x, np.zeros((T, 1), dtype=np.int32), np.ones((T, 1), dtype=np.float32), &g, &u, &d,
         out, threads)
