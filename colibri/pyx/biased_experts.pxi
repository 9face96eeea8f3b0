# colibri/pyx/biased_experts.pxi: routed experts with biases and / or the swigluoai activation
# (GPT-OSS; colibri/kernels/biased_experts.py, BiasedExperts) in one nogil call: the decode
# step's one token (PreparedBiasedExperts); T token rows grouped by expert are
# biased_grouped.pxi's.

cdef extern from "csrc/swigluoai.h" nogil:
    void colibri_swigluoai(int isa, const float *g, float *u, Py_ssize_t n, float alpha,
                           float limit)


cdef enum:
    BIASED_MAX_K = 64           # experts per token a call takes


ctypedef struct BiasedJob:
    # one token's K experts; k indexes them in ascending expert order
    const Wmat *g
    const Wmat *u
    const Wmat *d
    const float *bg             # (E, I) biases or NULL
    const float *bu
    const float *bd             # (E, D) or NULL
    const float *x              # (1, D)
    const float *xsg            # group sums of x for gate / up (q4, f32 activations)
    const float *xsu
    Act ax                      # x quantized (gate / up on the idot path)
    float *hg                   # (K, I) the activation's other input (swigluoai: gate; silu: up)
    float *h                    # (K, I) its in-place input, then the activation
    const float *xsd            # (K, I/Gd) group sums of h for down (q4)
    Act ah                      # h quantized (down on the idot path), row k = expert k
    float *og                   # (K, D) expert outputs
    const int32_t *experts      # (K,) ascending: the rows of the biases
    const int32_t *rows         # (K,) the rows of the weight stacks (experts, or arena slots)
    const float *wk             # (K,) their weights
    float *y                    # (1, D)
    Py_ssize_t K, D, I, tr_gu, nt_gu, tr_dn
    int swiglu_oai
    float alpha, limit


cdef void _biased_gateup_task(void *ctx, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of gate and up of expert k = it / nt_gu, their biases, then
    the activation of those rows (into h)."""
    cdef const BiasedJob *j = <const BiasedJob *>ctx
    cdef Py_ssize_t k = it // j.nt_gu, r0 = (it % j.nt_gu) * j.tr_gu, r1 = r0 + j.tr_gu
    cdef Py_ssize_t e = j.experts[k], w = j.rows[k], I = j.I
    if r1 > I:
        r1 = I
    # swigluoai writes its result over up, silu_mul over gate: that one goes to h
    cdef float *gate = j.hg if j.swiglu_oai else j.h
    cdef float *up = j.h if j.swiglu_oai else j.hg
    _linear_rows(j.g, w, j.x, 1, j.xsg, j.ax, NULL if j.bg == NULL else j.bg + e * I,
                 gate + k * I, I, r0, r1)
    _linear_rows(j.u, w, j.x, 1, j.xsu, j.ax, NULL if j.bu == NULL else j.bu + e * I,
                 up + k * I, I, r0, r1)
    if j.swiglu_oai:
        colibri_swigluoai(_isa, gate + k * I + r0, up + k * I + r0, r1 - r0, j.alpha, j.limit)
    else:
        colibri_silu_mul(_isa, gate + k * I + r0, up + k * I + r0, r1 - r0)


cdef void _biased_down_task(void *ctx, Py_ssize_t it) noexcept nogil:
    """Work item it: rows r0..r1 of down of every expert (+ bias), then y[r0:r1] = sum_k
    og[k] * w_k in ascending expert order (BiasedExperts' order of the sums)."""
    cdef const BiasedJob *j = <const BiasedJob *>ctx
    cdef Py_ssize_t r0 = it * j.tr_dn, r1 = r0 + j.tr_dn, k, e, c, D = j.D
    cdef float wk
    if r1 > D:
        r1 = D
    for k in range(j.K):
        e = j.experts[k]
        _linear_rows(j.d, j.rows[k], j.h + k * j.I, 1, j.xsd + k * j.d.xsum_cols, _act_at(&j.ah, k),
                     NULL if j.bd == NULL else j.bd + e * D, j.og + k * D, D, r0, r1)
    for c in range(r0, r1):
        j.y[c] = 0.0
    for k in range(j.K):
        wk = j.wk[k]
        for c in range(r0, r1):
            j.y[c] = j.y[c] + j.og[k * D + c] * wk


cdef Py_ssize_t _biased_bytes(Py_ssize_t K, const Wmat *g, const Wmat *u,
                              const Wmat *d) noexcept nogil:
    """The scratch of a one-token run over K experts (_biased_one)."""
    cdef Py_ssize_t I = g.rows, D = g.cols
    cdef bint qx = g.iact or u.iact
    return (4 * (g.xsum_cols + u.xsum_cols) + 4 * K * (2 * I + d.xsum_cols + D) + 6 * 64
            + (_act_bytes(1, D, g.wide or u.wide) if qx else 0)
            + (_act_bytes(K, I, d.wide) if d.iact else 0))


cdef void _biased_job(BiasedJob *j, const Wmat *g, const Wmat *u, const Wmat *d,
                      const float *bg, const float *bu, const float *bd, bint swiglu_oai,
                      float alpha, float limit, const float *x, float *y, Py_ssize_t K,
                      const int32_t *experts, const int32_t *rows,
                      const float *wk) noexcept nogil:
    """j for one token x (D,) -> y (D,) over K experts sorted by id (their stack rows, their
    weights), before _biased_one gives it its scratch."""
    j.g, j.u, j.d = g, u, d
    j.bg, j.bu, j.bd = bg, bu, bd
    j.x, j.y, j.K, j.D, j.I = x, y, K, g.cols, g.rows
    j.experts, j.rows, j.wk = experts, rows, wk
    j.swiglu_oai, j.alpha, j.limit = swiglu_oai, alpha, limit
    j.ax.q, j.ax.d, j.ax.s, j.ax.qs, j.ax.ds, j.ax.isa, j.ax.wide = NULL, NULL, NULL, 0, 0, 0, 0
    j.ah = j.ax


cdef void _biased_one(BiasedJob *j, int threads, char *cur) noexcept nogil:
    """The one-token run of j on cur (_biased_bytes bytes, 64-aligned): x's activations and
    group sums, gate / up rows with their biases and the activation (one pool job), h's
    activations or group sums, then down rows with their bias and the weighted sum (the
    second job). PreparedBiasedExperts' call and the compiled decode step's
    (pyx/decode_families.pxi) both run it."""
    cdef const Wmat *g = j.g
    cdef const Wmat *u = j.u
    cdef const Wmat *d = j.d
    cdef Py_ssize_t K = j.K, I = j.I, D = j.D
    cdef Py_ssize_t sg = g.xsum_cols, su = u.xsum_cols, sd = d.xsum_cols
    cdef bint qx = g.iact or u.iact
    cdef int nth
    j.xsg = <float *>_carve(&cur, 4 * sg)
    j.xsu = <float *>_carve(&cur, 4 * su)
    j.hg = <float *>_carve(&cur, 4 * K * I)
    j.h = <float *>_carve(&cur, 4 * K * I)
    j.xsd = <float *>_carve(&cur, 4 * K * sd)
    j.og = <float *>_carve(&cur, 4 * K * D)
    if qx:
        _carve_act(&cur, &j.ax, 1, D, g.wide or u.wide)
        _quantize_serial(j.x, 1, D, &j.ax)
    if d.iact:
        _carve_act(&cur, &j.ah, K, I, d.wide)
    if sg > 0:
        colibri_group_sums(j.x, D, g.group, <float *>j.xsg)
    if su > 0:
        colibri_group_sums(j.x, D, u.group, <float *>j.xsu)
    nth = _team(<double>K * (I * (g.row_stride + u.row_stride) + D * d.row_stride), threads)
    j.tr_gu = _tile_rows(I, g.row_stride + u.row_stride, nth, 1, True)
    j.nt_gu = (I + j.tr_gu - 1) // j.tr_gu
    colibri_pool_run(nth, _biased_gateup_task, j, K * j.nt_gu)
    if d.iact:                           # h's rows for down, between the two jobs
        _quantize_serial(j.h, K, I, &j.ah)
    elif sd > 0:
        _group_sums_serial(j.h, K, I, d.group, <float *>j.xsd)
    j.tr_dn = _tile_rows(D, d.row_stride, nth, 1, True)
    colibri_pool_run(nth, _biased_down_task, j, (D + j.tr_dn - 1) // j.tr_dn)


cdef class PreparedBiasedExperts:
    """BiasedExperts' decode (one token) in one nogil call: `p(x, ids, weights, out)` with x
    (1, D), ids int32 (1, K), weights (1, K), out (1, D) float32 C-contiguous: out = sum
    over the K slots in ascending id order (a repeated id: in slot order) of w_k * (down_e(act(
    gate_e(x) + b_gate[e], up_e(x) + b_up[e])) + b_down[e]); act swigluoai (alpha, limit) or
    silu(g) * u. Stacks (E, I, D), (E, I, D), (E, D, I) as WeightRefs, biases float32 (E, I),
    (E, I), (E, D) or None. The same row-kernel calls as the per-expert prepared linears of
    BiasedExperts (the same bits) but the activation (csrc/swigluoai.h / silu_mul: within a
    few ulp of NumPy's).

    Over an expert cache's arena (colibri.experts.expert_cache) the stacks hold its slots:
    n_experts is then the biases' first dimension E (default: the stacks' count), and
    `p(x, ids, weights, out, slots)` reads expert ids[k]'s weights from stack row slots[k]
    (int32 (1, K)) and its biases from row ids[k]; the order of the sums is still the
    experts'."""
    cdef Wmat g, u, d
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
        self.keep, self.isa = keep, _isa

    def __call__(self, x, ids, weights, out, slots=None):
        cdef Py_ssize_t xd[2]
        cdef Py_ssize_t od[2]
        cdef const float *xp = _f32(x, "x", 2, False, xd)
        cdef float *op = _f32(out, "out", 2, True, od)
        cdef Py_ssize_t D = self.g.cols, E = self.g.n_experts
        if xd[0] != 1 or xd[1] != D or od[0] != 1 or od[1] != D:
            raise ValueError(f"PreparedBiasedExperts: x ({xd[0]}, {xd[1]}) and out ({od[0]}, "
                             f"{od[1]}) must be (1, {D}) (one token)")
        cdef const int32_t[:, ::1] iv = ids
        cdef const float[:, ::1] wv = weights
        cdef Py_ssize_t K = iv.shape[1], k, i
        cdef int32_t experts[BIASED_MAX_K]
        cdef int32_t rows[BIASED_MAX_K]
        cdef float wk[BIASED_MAX_K]
        cdef const int32_t[:, ::1] sv = ids if slots is None else slots
        if iv.shape[0] != 1 or not 1 <= K <= BIASED_MAX_K or wv.shape[0] != 1 \
                or wv.shape[1] != K:
            raise ValueError(f"PreparedBiasedExperts: ids ({iv.shape[0]}, {K}) and weights "
                             f"({wv.shape[0]}, {wv.shape[1]}) must be (1, K), 1 <= K <= "
                             f"{BIASED_MAX_K}")
        if sv.shape[0] != 1 or sv.shape[1] != K:
            raise ValueError(f"PreparedBiasedExperts: slots ({sv.shape[0]}, {sv.shape[1]}) "
                             f"must be shaped as ids (1, {K})")
        if _overlap(xp, D, op, D):
            raise ValueError("PreparedBiasedExperts: out must not overlap x")
        if self.isa != _isa:
            self._load()
        for k in range(K):                   # insertion sort by expert id, stable
            i = k
            while i > 0 and experts[i - 1] > iv[0, k]:
                experts[i], rows[i], wk[i] = experts[i - 1], rows[i - 1], wk[i - 1]
                i -= 1
            experts[i], rows[i], wk[i] = iv[0, k], sv[0, k], wv[0, k]
        for k in range(K):
            if not 0 <= experts[k] < self.n_bias:
                raise ValueError(f"PreparedBiasedExperts: expert id {experts[k]} is out of "
                                 f"range for {self.n_bias} experts")
            if not 0 <= rows[k] < E:
                raise ValueError(f"PreparedBiasedExperts: slot {rows[k]} is out of range for "
                                 f"{E} stack rows")
        cdef BiasedJob j
        _biased_job(&j, &self.g, &self.u, &self.d, self.bp[0], self.bp[1], self.bp[2],
                    self.swiglu_oai, self.alpha, self.limit, xp, op, K, experts, rows, wk)
        buf = _take(_biased_bytes(K, &self.g, &self.u, &self.d))
        cdef char *cur = _base(buf)
        try:
            with nogil:
                _biased_one(&j, self.threads, cur)
        finally:
            _give(buf)
