# colibri/pyx/prepared.pxi: the prepared calls (PreparedLinear, PreparedRoute,
# PreparedExperts): weights checked once, then a call per decode step.

# ---------------------------------------------------------------------------------------------
# prepared calls: a weight (or three), its thread count and activations checked once, then a
# call per decode step that checks only what changes (the arrays)

cdef class PreparedLinear:
    """linear with w, bias, threads and activations fixed: `p(x, out)` writes out (T, R) =
    x (T, C) @ W.T (+ bias); the same work as linear(x, w, bias, out, 0, threads,
    activations). The weight is checked when made and again (re-read) if the ISA changes."""
    cdef Wmat m
    cdef object w, keep, bias_view, activations
    cdef const float *bp
    cdef int threads, isa
    cdef readonly Py_ssize_t rows, cols

    def __init__(self, w, bias, int threads, activations="f32"):
        _check_threads(threads)
        _activations(activations)
        self.w, self.threads, self.activations = w, threads, activations
        self._load()
        self.rows, self.cols = self.m.rows, self.m.cols
        cdef const float[::1] bv
        self.bp = NULL
        if bias is not None:
            bv = bias
            if bv.shape[0] != self.m.rows:
                raise ValueError(f"bias has {bv.shape[0]} elements, expected rows {self.m.rows}")
            self.bias_view = bv
            self.bp = &bv[0]

    def _load(self):
        self.keep = _load(self.w, "w", &self.m, _activations(self.activations))
        self.isa = _isa

    def __call__(self, x, out):
        cdef Py_ssize_t xd[2]
        cdef Py_ssize_t od[2]
        cdef const float *xp = _f32(x, "x", 2, False, xd)
        cdef float *op = _f32(out, "out", 2, True, od)
        cdef Py_ssize_t T = xd[0], R = self.m.rows, C = self.m.cols
        if xd[1] != C:
            raise ValueError(f"x has {xd[1]} columns, the weight has cols {C}")
        if od[0] != T or od[1] != R:
            raise ValueError(f"out has shape ({od[0]}, {od[1]}), expected ({T}, {R})")
        if T == 0:
            return
        if _overlap(xp, T * C, op, T * R):
            raise ValueError("out must not overlap x (linear reads every row of x while "
                             "writing)")
        if self.isa != _isa:
            self._load()
        _linear_run(xp, T, &self.m, self.bp, op, 0, self.threads)


cdef class PreparedRoute:
    """route_topk with k, rule, norm_topk_prob, threads (and a group rule's bias, n_group,
    topk_group) fixed, no noise: `p(logits)` -> (ids int32 (T, K), weights float32 (T, K))
    from logits float32 (T, E), as route_topk."""
    cdef Py_ssize_t k, n_group, topk_group
    cdef int rule, threads
    cdef bint norm
    cdef object bias
    cdef float thresh

    def __init__(self, Py_ssize_t k, str rule, bint norm_topk_prob, int threads, bias=None,
                 Py_ssize_t n_group=1, Py_ssize_t topk_group=1, double jitter_eps=0.0):
        _check_threads(threads)
        if rule not in RULES:
            raise ValueError(f"unknown routing rule {rule!r}; expected one of "
                             f"{', '.join(RULES)}")
        if k < 1:
            raise ValueError(f"k = {k} must be >= 1")
        self.thresh = _sparsemixer_threshold(rule, k, jitter_eps)
        self.k, self.rule, self.norm, self.threads = k, RULES[rule], norm_topk_prob, threads
        self.bias, self.n_group, self.topk_group = bias, n_group, topk_group

    def __call__(self, logits):
        cdef Py_ssize_t ld[2]
        cdef const float *lp = _f32(logits, "logits", 2, False, ld)
        cdef Py_ssize_t T = ld[0], E = ld[1], k = self.k, i, bad = -1
        if k > E:
            raise ValueError(f"k = {k} must be in 1..E, with E = {E} experts")
        bias_view = _group_settings(self.rule, E, k, self.bias, self.n_group, self.topk_group)
        for i in range(T * E):
            if lp[i] != lp[i]:                                     # NaN
                bad = i
                break
        if bad >= 0:
            raise ValueError(f"logits contain NaN (first at token {bad // E}, expert "
                             f"{bad % E})")
        return _route_run(lp, T, E, k, self.rule, self.norm, False, 0, self.thresh, bias_view,
                          self.n_group, self.topk_group, self.threads)


cdef class PreparedExperts:
    """expert_ffn with the three expert stacks, threads and activations fixed:
    `p(x, ids, weights, out)`, the same work as expert_ffn(x, ids, weights, ..., out, ...)."""
    cdef Wmat g, u, d
    cdef object w_gate, w_up, w_down, keep, activations
    cdef int threads, isa

    def __init__(self, w_gate, w_up, w_down, int threads, activations="f32"):
        _check_threads(threads)
        _activations(activations)
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down
        self.threads, self.activations = threads, activations
        self._load()

    def _load(self):
        keep = []
        _load_ffn(self.w_gate, self.w_up, self.w_down, &self.g, &self.u, &self.d, keep,
                  _activations(self.activations))
        self.keep, self.isa = keep, _isa

    def __call__(self, const float[:, ::1] x, const int32_t[:, ::1] ids,
                 const float[:, ::1] weights, float[:, ::1] out):
        cdef Py_ssize_t T = x.shape[0], D = x.shape[1], K = ids.shape[1], E = self.g.n_experts
        cdef Py_ssize_t i, bad = -1
        if D != self.g.cols:
            raise ValueError(f"x has {D} columns, the experts' hidden size is {self.g.cols}")
        if ids.shape[0] != T or K < 1:
            raise ValueError(f"ids has shape ({ids.shape[0]}, {K}), expected ({T}, K >= 1)")
        if weights.shape[0] != T or weights.shape[1] != K:
            raise ValueError(f"weights has shape ({weights.shape[0]}, {weights.shape[1]}), "
                             f"expected ({T}, {K})")
        if out.shape[0] != T or out.shape[1] != D:
            raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}), expected "
                             f"({T}, {D})")
        for i in range(T * K):
            if not 0 <= ids[i // K, i % K] < E:
                bad = i
                break
        if bad >= 0:
            raise ValueError(f"expert id {ids[bad // K, bad % K]} at ({bad // K}, {bad % K}) "
                             f"is out of range for {E} experts")
        if T == 0:
            return
        if self.isa != _isa:
            self._load()
        _ffn(x, ids, weights, &self.g, &self.u, &self.d, out, self.threads)
