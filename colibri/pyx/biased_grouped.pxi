# colibri/pyx/biased_grouped.pxi: T > 1 token rows (prefill, the ragged step of several
# sequences) of GPT-OSS's biased / swigluoai experts grouped by expert in one nogil call
# (PreparedBiasedGrouped; BiasedExperts.reference's bits); the one-token call and the
# shared declarations are biased_experts.pxi's, included before it.

cdef extern from "csrc/biased_experts.h" nogil:
    int colibri_bx_exp_ready()
    void colibri_bx_swigluoai(float *g, float *u, Py_ssize_t n, float alpha, float limit)
    void colibri_bx_silu_mul(const float *g, float *u, Py_ssize_t n)
    void colibri_bx_weighted_add(float *y, const float *o, float w, Py_ssize_t n)


cdef enum:
    # an expert with at least this many tokens runs an MXFP4 matrix on f32 activations (the
    # f32 GEMM path) when the model's are int16 and the integer GEMM does not take that
    # many: the int16 row kernel decodes each weight block again per 3 tokens
    # (docs/performance.md changes 27, 31: on the avx2 path, 2880 x 2880, 1 thread, from 8
    # tokens the f32 GEMM is the faster; avx512vnni takes the integer GEMM from 4)
    MXFP4_F32_TOKENS = 8


cdef inline bint _mx_f32(const Wmat *m, Py_ssize_t n) noexcept nogil:
    """Matrix m (loaded for the call's activations) runs n tokens on f32 activations."""
    return m.fmt == COLIBRI_MXFP4 and m.wide and n >= MXFP4_F32_TOKENS and n < _gemm_min_for(m)


def mxfp4_f32_activations(w, activations, Py_ssize_t n):
    """True when the biased experts run matrix w (a WeightRef) for an expert of n tokens on
    f32 activations instead of `activations` (int16 MXFP4, MXFP4_F32_TOKENS or more tokens,
    fewer than the integer GEMM's crossover on this ISA path): BiasedExperts.reference asks
    this, the grouped call decides the same way."""
    cdef Wmat m
    keep = _load(w, "w", &m, _activations(activations))
    return bool(_mx_f32(&m, n))


ctypedef struct GroupedJob:
    # one grouped call; positions p index the (token, k) slots grouped by expert id: expert e
    # owns positions offsets[e]..offsets[e+1], its slots in ascending (t, k) order
    const Wmat *g
    const Wmat *u
    const Wmat *d
    const Wmat *gf              # the same matrices for f32 activations (_mx_f32)
    const Wmat *uf
    const Wmat *df
    const float *bg             # (E, I) biases or NULL
    const float *bu
    const float *bd             # (E, D) or NULL
    Py_ssize_t T, K, D, I
    const float *x              # (T, D)
    float *xg                   # (TK, D) the gathered rows
    float *xsg                  # (TK, D/Gg) their group sums for gate (q4, f32 activations)
    float *xsu                  # ... for up
    Act ax                      # (TK, D) quantized (gate / up on the idot path)
    float *hg                   # (TK, I) gate + bias (then clamped)
    float *h                    # (TK, I) up + bias, then the activation
    float *xsd                  # (TK, I/Gd) group sums of h for down (q4)
    Act ah                      # (TK, I) h quantized (down on the idot path)
    float *og                   # (TK, D) expert outputs + bias
    const int64_t *offsets      # (E+1,)
    const int32_t *slots        # (TK,) position -> slot t*K + k
    const int64_t *tpos         # (TK,) token t's positions at t*K.., ascending
    const int32_t *active       # (n_active,) the experts with slots, ascending
    const int32_t *srow         # (E,) each expert's stack row (its id, or its arena slot)
    Py_ssize_t n_active, tr_gu, nt_gu, tr_dn, nt_dn
    const float *weights        # (T, K)
    float *y                    # (T, D)
    bint qx
    int swiglu_oai
    float alpha, limit


cdef void _grouped_gather_task(void *ctx, Py_ssize_t p) noexcept nogil:
    """Position p: its token's x row, its group sums (q4) or quantized codes; h's padding."""
    cdef const GroupedJob *j = <const GroupedJob *>ctx
    cdef const float *src = j.x + (j.slots[p] // j.K) * j.D
    cdef float *dst = j.xg + p * j.D
    cdef Py_ssize_t c
    for c in range(j.D):
        dst[c] = src[c]
    if j.g.xsum_cols > 0:
        colibri_group_sums(dst, j.D, j.g.group, j.xsg + p * j.g.xsum_cols)
    if j.u.xsum_cols > 0:
        colibri_group_sums(dst, j.D, j.u.group, j.xsu + p * j.u.xsum_cols)
    if j.qx:
        colibri_quantize_row(j.ax.isa, j.ax.wide, dst, j.D, j.ax.q + p * j.ax.qs,
                             j.ax.d + p * j.ax.ds, j.ax.s + p * j.ax.ds, j.ax.ds)
    if j.d.iact:
        colibri_quantize_pad(j.ah.wide, j.I, j.ah.q + p * j.ah.qs, j.ah.d + p * j.ah.ds,
                             j.ah.s + p * j.ah.ds, j.ah.ds)


cdef void _grouped_gateup_task(void *ctx, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of gate and up (+ biases) of active expert it / nt_gu for
    all its positions, the activation of those columns of h, then their group sums (q4) or
    quantized blocks for down (r0, r1: whole groups / blocks)."""
    cdef const GroupedJob *j = <const GroupedJob *>ctx
    cdef Py_ssize_t e = j.active[it // j.nt_gu], I = j.I, D = j.D
    cdef Py_ssize_t r0 = (it % j.nt_gu) * j.tr_gu, r1 = r0 + j.tr_gu
    cdef Py_ssize_t p0 = j.offsets[e], n = j.offsets[e + 1] - p0, w = j.srow[e], p
    cdef Py_ssize_t sd = j.d.xsum_cols
    if r1 > I:
        r1 = I
    _linear_rows(j.gf if _mx_f32(j.g, n) else j.g, w, j.xg + p0 * D, n,
                 j.xsg + p0 * j.g.xsum_cols, _act_at(&j.ax, p0),
                 NULL if j.bg == NULL else j.bg + e * I, j.hg + p0 * I, I, r0, r1)
    _linear_rows(j.uf if _mx_f32(j.u, n) else j.u, w, j.xg + p0 * D, n,
                 j.xsu + p0 * j.u.xsum_cols, _act_at(&j.ax, p0),
                 NULL if j.bu == NULL else j.bu + e * I, j.h + p0 * I, I, r0, r1)
    for p in range(p0, p0 + n):
        if j.swiglu_oai:
            colibri_bx_swigluoai(j.hg + p * I + r0, j.h + p * I + r0, r1 - r0, j.alpha, j.limit)
        else:
            colibri_bx_silu_mul(j.hg + p * I + r0, j.h + p * I + r0, r1 - r0)
        if sd > 0:
            colibri_group_sums(j.h + p * I + r0, r1 - r0, j.d.group,
                               j.xsd + p * sd + r0 // j.d.group)
        if j.d.iact:
            colibri_quantize_act(j.ah.isa, j.ah.wide, j.h + p * I, r0 // 32, r1 // 32,
                                 j.ah.q + p * j.ah.qs, j.ah.d + p * j.ah.ds,
                                 j.ah.s + p * j.ah.ds)


cdef void _grouped_down_task(void *ctx, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of down (+ bias) of active expert it / nt_dn for all its
    positions (the expert's h rows stay in cache across its tiles)."""
    cdef const GroupedJob *j = <const GroupedJob *>ctx
    cdef Py_ssize_t e = j.active[it // j.nt_dn], D = j.D, I = j.I
    cdef Py_ssize_t r0 = (it % j.nt_dn) * j.tr_dn, r1 = r0 + j.tr_dn, p0 = j.offsets[e]
    cdef Py_ssize_t n = j.offsets[e + 1] - p0
    if r1 > D:
        r1 = D
    _linear_rows(j.df if _mx_f32(j.d, n) else j.d, j.srow[e], j.h + p0 * I, n,
                 j.xsd + p0 * j.d.xsum_cols, _act_at(&j.ah, p0),
                 NULL if j.bd == NULL else j.bd + e * D, j.og + p0 * D, D, r0, r1)


cdef void _grouped_combine_task(void *ctx, Py_ssize_t t) noexcept nogil:
    """Token t: y[t] = the sum of w * og over its positions in ascending order (ascending
    expert id, a repeated id in k order: BiasedExperts.reference's order of the sums)."""
    cdef const GroupedJob *j = <const GroupedJob *>ctx
    cdef Py_ssize_t D = j.D, k, c, p
    cdef float *yt = j.y + t * D
    for c in range(D):
        yt[c] = 0.0
    for k in range(j.K):
        p = j.tpos[t * j.K + k]
        colibri_bx_weighted_add(yt, j.og + p * D, j.weights[j.slots[p]], D)


cdef class PreparedBiasedGrouped:
    """BiasedExperts over T token rows in one call (nogil, on the pool): `p(x, ids, weights,
    out)` with x (T, D), ids int32 (T, K), weights (T, K), out (T, D) float32 C-contiguous
    (out may be x): BiasedExperts.reference's result, bit for bit. The (token, k) slots are
    grouped by expert id once; per expert with slots, its gate and up rows over its tokens
    (each matrix's path by that count, as a prepared linear of it: row kernel, or a GEMM
    path from its crossover) with their biases, the activation (NumPy's operations, NumPy's
    exp: csrc/biased_experts.h), then its down rows with their bias; each token's outputs
    weighted and added in ascending expert order. Stacks and biases as
    PreparedBiasedExperts; over an arena `p(x, ids, weights, out, slots)` reads expert
    ids[t, k] from stack row slots[t, k] (each expert's first slot: one row per expert).
    An int16 MXFP4 matrix of an expert with many tokens may run on f32 activations
    (mxfp4_f32_activations), as the reference's."""
    cdef Wmat g, u, d, gf, uf, df
    cdef object w_gate, w_up, w_down, keep, biases, activations
    cdef const float *bp[3]
    cdef int threads, isa, swiglu_oai
    cdef float alpha, limit
    cdef Py_ssize_t n_bias

    def __init__(self, w_gate, w_up, w_down, b_gate, b_up, b_down, str activation,
                 float alpha, float limit, int threads, activations="f32", n_experts=None):
        _check_threads(threads)
        _activations(activations)
        if activation not in ("swigluoai", "silu"):
            raise ValueError(f"activation must be 'swigluoai' or 'silu', found {activation!r}")
        if not colibri_bx_exp_ready():
            raise RuntimeError("PreparedBiasedGrouped: NumPy's float32 exp loop was not found")
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.threads, self.activations = threads, activations
        self.swiglu_oai, self.alpha, self.limit = activation == "swigluoai", alpha, limit
        self._load()
        cdef Py_ssize_t E = self.g.n_experts if n_experts is None else n_experts
        cdef Py_ssize_t I = self.g.rows, D = self.g.cols
        if E < 1:
            raise ValueError(f"n_experts must be at least 1, found {E}")
        self.n_bias = E
        keep = []
        for i, (name, b, rows) in enumerate((("b_gate", b_gate, I), ("b_up", b_up, I),
                                             ("b_down", b_down, D))):
            self.bp[i] = NULL
            if b is None:
                continue
            b = np.ascontiguousarray(b, dtype=np.float32)
            if b.shape != (E, rows):
                raise ValueError(f"{name} has shape {b.shape}, expected ({E}, {rows})")
            keep.append(b)
            self.bp[i] = <const float *>colibri_array_data(b)
        self.biases = keep

    def _load(self):
        keep = []
        _load_ffn(self.w_gate, self.w_up, self.w_down, &self.g, &self.u, &self.d, keep,
                  _activations(self.activations))
        _load_ffn(self.w_gate, self.w_up, self.w_down, &self.gf, &self.uf, &self.df, keep, 0)
        self.keep, self.isa = keep, _isa

    def __call__(self, x, ids, weights, out, slots=None):
        cdef Py_ssize_t xd[2]
        cdef Py_ssize_t od[2]
        cdef const float *xp = _f32(x, "x", 2, False, xd)
        cdef float *op = _f32(out, "out", 2, True, od)
        cdef Py_ssize_t D = self.g.cols, I = self.g.rows, E = self.n_bias
        cdef Py_ssize_t T = xd[0]
        if xd[1] != D or od[0] != T or od[1] != D:
            raise ValueError(f"PreparedBiasedGrouped: x ({xd[0]}, {xd[1]}) and out ({od[0]}, "
                             f"{od[1]}) must both be (T, {D})")
        cdef const int32_t[:, ::1] iv = ids
        cdef const float[:, ::1] wv = weights
        cdef const int32_t[:, ::1] sv = ids if slots is None else slots
        cdef Py_ssize_t K = iv.shape[1], TK = T * K, i
        if iv.shape[0] != T or K < 1 or wv.shape[0] != T or wv.shape[1] != K:
            raise ValueError(f"PreparedBiasedGrouped: ids ({iv.shape[0]}, {K}) and weights "
                             f"({wv.shape[0]}, {wv.shape[1]}) must be ({T}, K), K >= 1")
        if sv.shape[0] != T or sv.shape[1] != K:
            raise ValueError(f"PreparedBiasedGrouped: slots ({sv.shape[0]}, {sv.shape[1]}) "
                             f"must be shaped as ids ({T}, {K})")
        if T == 0:
            return
        cdef const int32_t *idp = &iv[0, 0]
        cdef const int32_t *slp = &sv[0, 0]
        for i in range(TK):
            if not 0 <= idp[i] < E:
                raise ValueError(f"PreparedBiasedGrouped: expert id {idp[i]} at ({i // K}, "
                                 f"{i % K}) is out of range for {E} experts")
            if not 0 <= slp[i] < self.g.n_experts:
                raise ValueError(f"PreparedBiasedGrouped: slot {slp[i]} at ({i // K}, "
                                 f"{i % K}) is out of range for {self.g.n_experts} stack rows")
        if self.isa != _isa:
            self._load()
        cdef const Wmat *g = &self.g
        cdef const Wmat *u = &self.u
        cdef const Wmat *d = &self.d
        cdef Py_ssize_t sg = g.xsum_cols, su = u.xsum_cols, sd = d.xsum_cols
        cdef bint qx = g.iact or u.iact
        cdef Py_ssize_t bytes_gu = I * (g.row_stride + u.row_stride), bytes_dn = D * d.row_stride
        cdef int nth = _team(<double>(bytes_gu + bytes_dn) * TK, self.threads)
        # a GEMM path's scratch when some matrix may take one (an expert has <= TK tokens)
        cdef Py_ssize_t n_min = _gemm_min_for(g)
        if _gemm_min_for(u) < n_min:
            n_min = _gemm_min_for(u)
        if _gemm_min_for(d) < n_min:
            n_min = _gemm_min_for(d)
        if (_mx_f32(g, TK) or _mx_f32(u, TK) or _mx_f32(d, TK)) and _gemm_min < n_min:
            n_min = _gemm_min                # the f32 GEMM of the twins
        cdef Py_ssize_t gbytes = _gemm_bytes(TK, nth, n_min)
        cdef Py_ssize_t nbytes = (8 * (E + 1) + 8 * E + 4 * TK + 8 * TK + 8 * TK + 8 * E
                                  + 4 * TK * (D + sg + su + 2 * I + sd + D) + 16 * 64 + gbytes
                                  + (_act_bytes(TK, D, g.wide or u.wide) if qx else 0)
                                  + (_act_bytes(TK, I, d.wide) if d.iact else 0))
        cdef GroupedJob j
        j.bg, j.bu, j.bd = self.bp[0], self.bp[1], self.bp[2]
        j.T, j.K, j.D, j.I = T, K, D, I
        j.x, j.y, j.weights = xp, op, &wv[0, 0]
        j.qx, j.swiglu_oai, j.alpha, j.limit = qx, self.swiglu_oai, self.alpha, self.limit
        buf = _take(nbytes)
        cdef char *cur = _base(buf)
        try:
            with nogil:
                _grouped_run(&j, g, u, d, &self.gf, &self.uf, &self.df, idp, slp, E, nth,
                             gbytes, cur)
        finally:
            _give(buf)


cdef void _grouped_run(GroupedJob *jp, const Wmat *gw, const Wmat *uw, const Wmat *dw,
                       const Wmat *gfw, const Wmat *ufw, const Wmat *dfw,
                       const int32_t *ids, const int32_t *slot_rows, Py_ssize_t E, int nth,
                       Py_ssize_t gbytes, char *cur) noexcept nogil:
    """PreparedBiasedGrouped's work on its scratch cur (jp: the call's arguments set, all
    checked; E the biases' experts): group the slots, then four pool jobs: gather, gate /
    up / activation, down (tiles of one expert, as gate / up), the combine per token."""
    cdef GroupedJob j = jp[0]
    cdef Wmat g = gw[0], u = uw[0], d = dw[0], gf = gfw[0], uf = ufw[0], df = dfw[0]
    cdef Py_ssize_t T = j.T, K = j.K, D = g.cols, I = g.rows, TK = T * K, p, e, t, k, i, n
    cdef Py_ssize_t n_active = 0, max_tokens = 0
    cdef int64_t *offsets = <int64_t *>_carve(&cur, 8 * (E + 1))
    cdef int64_t *cursor = <int64_t *>_carve(&cur, 8 * E)
    cdef int32_t *slots = <int32_t *>_carve(&cur, 4 * TK)
    cdef int64_t *pos = <int64_t *>_carve(&cur, 8 * TK)
    cdef int64_t *tpos = <int64_t *>_carve(&cur, 8 * TK)
    cdef int32_t *active = <int32_t *>_carve(&cur, 4 * E)
    cdef int32_t *srow = <int32_t *>_carve(&cur, 4 * E)
    cdef int64_t v
    j.xg = <float *>_carve(&cur, 4 * TK * D)
    j.xsg = <float *>_carve(&cur, 4 * TK * g.xsum_cols)
    j.xsu = <float *>_carve(&cur, 4 * TK * u.xsum_cols)
    j.hg = <float *>_carve(&cur, 4 * TK * I)
    j.h = <float *>_carve(&cur, 4 * TK * I)
    j.xsd = <float *>_carve(&cur, 4 * TK * d.xsum_cols)
    j.og = <float *>_carve(&cur, 4 * TK * D)
    if gbytes > 0:                               # one scratch, shared by the three matrices
        g.gemm_scratch = <float *>_carve(&cur, gbytes)
        u.gemm_scratch = g.gemm_scratch
        d.gemm_scratch = g.gemm_scratch
        gf.gemm_scratch = g.gemm_scratch
        uf.gemm_scratch = g.gemm_scratch
        df.gemm_scratch = g.gemm_scratch
    j.ax.q, j.ax.d, j.ax.s, j.ax.qs, j.ax.ds, j.ax.isa, j.ax.wide = NULL, NULL, NULL, 0, 0, 0, 0
    j.ah = j.ax
    if j.qx:
        _carve_act(&cur, &j.ax, TK, D, g.wide or u.wide)
    if d.iact:
        _carve_act(&cur, &j.ah, TK, I, d.wide)
    _count_sort(ids, TK, E, offsets, slots, cursor)
    for p in range(TK):
        pos[slots[p]] = p
    for e in range(E):
        n = offsets[e + 1] - offsets[e]
        if n > 0:
            active[n_active] = <int32_t>e
            srow[e] = slot_rows[slots[offsets[e]]]
            n_active += 1
            if n > max_tokens:
                max_tokens = n
    for t in range(T):                          # each token's positions, ascending
        for k in range(K):
            v = pos[t * K + k]
            i = k
            while i > 0 and tpos[t * K + i - 1] > v:
                tpos[t * K + i] = tpos[t * K + i - 1]
                i -= 1
            tpos[t * K + i] = v
    j.g, j.u, j.d, j.gf, j.uf, j.df = &g, &u, &d, &gf, &uf, &df
    j.offsets, j.slots, j.tpos, j.active, j.srow = offsets, slots, tpos, active, srow
    j.n_active = n_active
    # row tiles of one expert (its token rows stay in cache across them, where tiles of
    # every expert would stream each expert's h once per tile: measured slower at pp128):
    # gate / up tiles whole groups (q4 down: its group sums) or 32-blocks (down on the idot
    # path) of h, and whole panels on a GEMM path
    cdef Py_ssize_t align_gu = d.group if d.xsum_cols > 0 else (32 if d.iact else 1), align_dn = 1
    cdef Py_ssize_t nr_gu = COLIBRI_IGEMM_NR if g.iact else COLIBRI_GEMM_NR
    if gbytes > 0:
        align_gu = align_gu * nr_gu // _gcd(align_gu, nr_gu)
        align_dn = COLIBRI_IGEMM_NR if d.iact else COLIBRI_GEMM_NR
    cdef bint one_pass = max_tokens <= COLIBRI_MAX_NT
    j.tr_gu = _tile_rows(I, g.row_stride + u.row_stride, nth, align_gu, one_pass)
    j.nt_gu = (I + j.tr_gu - 1) // j.tr_gu
    j.tr_dn = _tile_rows(D, d.row_stride, nth, align_dn, one_pass)
    j.nt_dn = (D + j.tr_dn - 1) // j.tr_dn
    colibri_pool_run(nth, _grouped_gather_task, &j, TK)
    colibri_pool_run(nth, _grouped_gateup_task, &j, n_active * j.nt_gu)
    colibri_pool_run(nth, _grouped_down_task, &j, n_active * j.nt_dn)
    colibri_pool_run(nth, _grouped_combine_task, &j, T)
