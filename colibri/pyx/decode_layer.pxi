# colibri/pyx/decode_layer.pxi: the compiled decode step, every layer of one token in one
# nogil call (DecodeLayers: the layers' weights and settings, checked once; DecodeBinding:
# those layers over one cache and its RunState's buffers, one call per step; or over T
# consecutive tokens of that cache, one call per speculative verification: rows, the same
# sequence with each linear and the experts called once over the T rows, decode_step.pxi).
#
# A layer is the Python step's sequence of kernel calls (Model._step, Attention.decode or
# MLA.decode, MoE.__call__) in the same order through the same C functions: RMSNorm rows
# (csrc/rowops.h), q|k|v (_linear_core), q/k norms, clip, RoPE, the cache write and the
# attention with its sinks (_attend_core), or the latent attention (decode_families.pxi),
# wo, the residual add, RMSNorm, the router, one token's routing (_route_token), the experts
# (_ffn_core, or the biased ones: decode_families.pxi), the shared expert and its gate, the
# residual add (csrc/decode_layer.h; the gate's exp is NumPy's own float32 loop). So the
# results are the Python step's bits, with the same pool jobs: what this removes is the
# Python between them (~11 calls into the module per layer, each with its checks and the GIL).

cdef extern from "csrc/decode_layer.h" nogil:
    void colibri_add_into(float *h, const float *o, Py_ssize_t n)
    void colibri_scale_into(float *x, float m, Py_ssize_t n)
    void colibri_clip_into(float *x, float c, Py_ssize_t n)
    float colibri_gate_sigmoid(float z)
    double colibri_stage_clock()

cdef extern from "csrc/decode_layer.h":
    int colibri_find_exp_loop(object ufunc)

# NumPy's float32 exp loop, for the shared-expert gate (the Python step's np.exp, the same bits)
EXP_LOOP = type(np.exp) is np.ufunc and colibri_find_exp_loop(np.exp) == 1


def gate_sigmoid(float z):
    """1 / (1 + exp(-z)) in float32 as the compiled step computes a shared-expert gate
    (MoE.__call__'s NumPy expression, the same bits); needs EXP_LOOP."""
    if not EXP_LOOP:
        raise RuntimeError("gate_sigmoid: NumPy's float32 exp loop was not found")
    return colibri_gate_sigmoid(z)

cdef enum:
    QK_NONE = 0
    QK_FULL = 1
    QK_PER_HEAD = 2
    STAGE_ATTENTION = 0             # DecodeBinding.seconds, as colibri.kernels.runtime.STAGES
    STAGE_ROUTER = 1
    STAGE_EXPERTS = 2
    STAGE_SHARED = 3
    STAGE_DENSE = 4
    N_STAGES = 5

    MAX_ROWS = 33                   # rows of one DecodeBinding.rows call: 32 drafts + 1

QK_NORM_CODES = {"none": QK_NONE, "full": QK_FULL, "per_head": QK_PER_HEAD}
DECODE_MAX_ROWS = MAX_ROWS
STAGE_NAMES = ("attention", "router", "experts", "shared", "dense")


ctypedef struct DLayer:
    # one layer's weights (Wmats of the current ISA) and settings
    Wmat qkv, wo                    # (H*Dh + 2*Hkv*Dh, D), (D, H*Dh)
    Wmat router, g, u, d            # (E, D); experts (E, I, D) x 2, (E, D, I), or a dense MLP
    Wmat sg, su, sd, sgate          # the shared expert (Is, D) x 2, (D, Is); its gate (1, D)
    const float *attn_norm
    const float *ffn_norm
    const float *attn_norm_bias     # LayerNorm biases or NULL
    const float *ffn_norm_bias
    const float *qkv_bias           # NULL: none (likewise below)
    const float *wo_bias
    const float *router_bias
    const float *q_norm
    const float *k_norm
    const float *corr_bias          # sigmoid_group_topk's correction bias (E,)
    int qk_norm                     # QK_NONE / QK_FULL / QK_PER_HEAD
    bint clip, moe, shared, gated
    float clip_c, thresh, rscale
    Py_ssize_t window               # sliding window slots, 0: full attention
    Py_ssize_t E, K, n_group, topk_group
    int rule
    bint norm_topk
    bint mla                        # latent attention (a, below) instead of qkv / wo's GQA
    DMla a
    const float *sinks              # (H,) attention sinks (GPT-OSS) or NULL
    bint biased                     # biased / swigluoai experts (bx) instead of _ffn_core
    DBiased bx


ctypedef struct DModel:
    # what a step needs of DecodeLayers, for the nogil call
    DLayer *layers
    Py_ssize_t n_layers, D, H, Hkv, Dh, h_rope, nq, nk, E_max, K_max
    float eps, scale, rmult
    bint has_rmult, layer_norm      # LayerNorm (PhiMoE, DBRX), else RMSNorm
    int threads
    # the cache planes: kvh heads of kw (keys) and vw (values) floats per position; MLA: one
    # "head", the latent (Rkv) and the rotary key (Dr)
    Py_ssize_t kvh, kw, vw
    bint mla                        # every layer MLA (then Dn, Dr, Dv, R, Rq, latent_eps)
    Py_ssize_t Dn, Dr, Dv, R, Rq
    float latent_eps


ctypedef struct DBind:
    # what a pass of T rows needs of DecodeBinding: its row buffers (a step's: the
    # RunState's, T = 1; DecodeBinding.rows': carved from the scratch, h the caller's) and
    # the cache planes
    float *h                        # (T, D) the residual stream
    float *xa                       # (T, D) the normed inputs of attention and FFN
    float *xf
    float *o                        # (T, D) attention's output, the FFN's
    float *y
    float *qkv                      # (T, H*Dh + 2*Hkv*Dh)
    float *att                      # (T, H*Dh) the heads' attention
    double *sec                     # seconds per stage (N_STAGES)
    int32_t *route                  # NULL, or (M, T, route_k): each MoE layer's rows' experts
    Py_ssize_t route_k
    char **kp                       # per layer: sequence 0's key plane (Hkv, S, Dh)
    char **vp
    int fmt
    Py_ssize_t S, es
    DMlaBuf mb                      # MLA models: the step's latent-attention vectors


cdef class DecodeLayers:
    """Every layer of a model for the compiled decode step: `DecodeLayers(specs, hidden,
    n_heads, n_kv_heads, head_dim, rope_pairs, eps, scale, residual_mult, threads,
    activations, mla=None)`, specs a list of one dict per layer (colibri.engine.decode_layer builds
    them: WeightRefs and float32 vectors, checked here once); mla: (nope_dim, rope_dim, v_dim,
    kv_rank, q_rank, latent_eps) for latent attention (scale then its softmax scale);
    layer_norm: LayerNorm instead of RMSNorm. Bind it to a cache with DecodeBinding."""
    cdef DModel m
    cdef int act, isa
    cdef list specs, keep

    @property
    def n_layers(self):
        return self.m.n_layers

    def __cinit__(self):
        self.m.layers = NULL

    def __dealloc__(self):
        free(self.m.layers)

    def __init__(self, list specs, Py_ssize_t hidden, Py_ssize_t n_heads,
                 Py_ssize_t n_kv_heads, Py_ssize_t head_dim, Py_ssize_t rope_pairs, float eps,
                 float scale, residual_mult, int threads, activations, mla=None,
                 bint layer_norm=False):
        _check_threads(threads)
        if n_kv_heads < 1 or n_heads % n_kv_heads or head_dim < 1 or 2 * rope_pairs > head_dim:
            raise ValueError(f"DecodeLayers: {n_heads} heads over {n_kv_heads} kv heads of "
                             f"{head_dim} with {rope_pairs} rotary pairs")
        self.m.mla, self.m.layer_norm = mla is not None, layer_norm
        self.m.kvh, self.m.kw, self.m.vw = n_kv_heads, head_dim, head_dim
        self.m.Dn = self.m.Dr = self.m.Dv = self.m.R = self.m.Rq = 0
        self.m.latent_eps = 0.0
        if self.m.mla:                  # (nope_dim, rope_dim, v_dim, kv_rank, q_rank, eps)
            self.m.Dn, self.m.Dr, self.m.Dv, self.m.R, self.m.Rq, self.m.latent_eps = mla
            if (min(self.m.Dn, self.m.Dv, self.m.R) < 1 or self.m.Rq < 0
                    or self.m.Dr != 2 * rope_pairs):
                raise ValueError(f"DecodeLayers: MLA dims {mla} with {rope_pairs} rotary "
                                 f"pairs")
            self.m.kvh, self.m.kw, self.m.vw = 1, self.m.R, self.m.Dr
        self.act = _activations(activations)
        self.m.n_layers, self.m.D, self.m.H = len(specs), hidden, n_heads
        self.m.Hkv, self.m.Dh, self.m.h_rope = n_kv_heads, head_dim, rope_pairs
        self.m.nq, self.m.nk = n_heads * head_dim, n_kv_heads * head_dim
        self.m.eps, self.m.scale, self.m.threads = eps, scale, threads
        self.m.has_rmult = residual_mult is not None
        self.m.rmult = residual_mult if self.m.has_rmult else 1.0
        self.specs = specs
        self.m.layers = <DLayer *>malloc(max(1, self.m.n_layers) * sizeof(DLayer))
        if self.m.layers == NULL:
            raise MemoryError("DecodeLayers: no memory for the layer table")
        self._load()

    cdef object _vec(self, spec, str key, Py_ssize_t n, int i, const float **out):
        """spec[key] (None, or float32 (n,)) into *out; kept alive in self.keep."""
        cdef Py_ssize_t dims[1]
        a = spec.get(key)
        if a is None:
            out[0] = NULL
            return
        out[0] = _f32(a, f"layer {i} {key}", 1, False, dims)
        if dims[0] != n:
            raise ValueError(f"DecodeLayers: layer {i} {key} has {dims[0]} elements, "
                             f"expected {n}")
        self.keep.append(a)

    cdef object _mat(self, spec, str key, Wmat *m, int act, Py_ssize_t rows, Py_ssize_t cols,
                     int i):
        """spec[key] (a WeightRef) loaded into m for the current ISA, its shape checked."""
        self.keep.append(_load(spec[key], f"layer {i} {key}", m, act))
        if m.rows != rows or m.cols != cols:
            raise ValueError(f"DecodeLayers: layer {i} {key} is ({m.rows}, {m.cols}), "
                             f"expected ({rows}, {cols})")

    def _load(self):
        """Check every layer's weights and fill the table for the current ISA."""
        cdef DLayer *L
        cdef Py_ssize_t D = self.m.D, i, E, I, Is
        self.keep = []
        self.m.E_max, self.m.K_max = 1, 1
        for i in range(self.m.n_layers):
            s, L = self.specs[i], &self.m.layers[i]
            self._vec(s, "attn_norm", D, i, &L.attn_norm)
            self._vec(s, "ffn_norm", D, i, &L.ffn_norm)
            self._vec(s, "attn_norm_bias", D, i, &L.attn_norm_bias)
            self._vec(s, "ffn_norm_bias", D, i, &L.ffn_norm_bias)
            if L.attn_norm == NULL or L.ffn_norm == NULL:
                raise ValueError(f"DecodeLayers: layer {i} needs attn_norm and ffn_norm")
            L.mla = s.get("mla", False)
            if L.mla != self.m.mla:
                raise ValueError(f"DecodeLayers: layer {i} is {'' if L.mla else 'not '}MLA, "
                                 f"the model {'is' if self.m.mla else 'is not'}")
            if L.mla:
                self._load_mla(s, L, i)
            else:
                self._load_gqa(s, L, i)
            L.moe = s["moe"]
            L.shared = L.gated = L.biased = False
            E, L.K, L.corr_bias, L.router_bias = 1, 1, NULL, NULL
            self.keep.append(_load(s["gate"], f"layer {i} gate", &L.g, self.act))
            self.keep.append(_load(s["up"], f"layer {i} up", &L.u, self.act))
            self.keep.append(_load(s["down"], f"layer {i} down", &L.d, self.act))
            I = L.g.rows
            if (L.g.cols != D or L.u.rows != I or L.u.cols != D or L.d.rows != D
                    or L.d.cols != I or L.u.n_experts != L.g.n_experts
                    or L.d.n_experts != L.g.n_experts):
                raise ValueError(f"DecodeLayers: layer {i} FFN weights disagree: gate "
                                 f"({L.g.n_experts} x {L.g.rows} x {L.g.cols}), up ({L.u.rows} "
                                 f"x {L.u.cols}), down ({L.d.rows} x {L.d.cols}) for D {D}")
            if L.moe:
                E = L.g.n_experts
                self._mat(s, "router", &L.router, 0, E, D, i)      # f32 activations
                self._vec(s, "router_bias", E, i, &L.router_bias)
                L.K, L.rule, L.norm_topk = s["k"], RULES[s["rule"]], s["norm_topk"]
                if not 1 <= L.K <= E:
                    raise ValueError(f"DecodeLayers: layer {i} routes to k = {L.K} of {E}")
                L.thresh = _sparsemixer_threshold(s["rule"], L.K, s["jitter"])
                L.n_group, L.topk_group = s["n_group"], s["topk_group"]
                bias_view = _group_settings(L.rule, E, L.K, s["corr_bias"], L.n_group,
                                            L.topk_group)
                L.corr_bias = NULL
                if bias_view is not None:
                    self._vec(s, "corr_bias", E, i, &L.corr_bias)
                L.rscale = s["rscale"]
                L.biased = s.get("biased", False)
                if L.biased:
                    self._load_biased(s, L, i)
                if s["shared"] is not None:
                    L.shared = True
                    self.keep.append(_load(s["shared"][0], f"layer {i} shared gate",
                                           &L.sg, self.act))
                    self.keep.append(_load(s["shared"][1], f"layer {i} shared up", &L.su,
                                           self.act))
                    self.keep.append(_load(s["shared"][2], f"layer {i} shared down", &L.sd,
                                           self.act))
                    Is = L.sg.rows
                    if (L.sg.cols != D or L.su.rows != Is or L.su.cols != D or L.sd.rows != D
                            or L.sd.cols != Is or L.sg.n_experts != 1 or L.su.n_experts != 1
                            or L.sd.n_experts != 1):
                        raise ValueError(f"DecodeLayers: layer {i} shared expert weights "
                                         f"disagree")
                    if s["shared_gate"] is not None:
                        if not EXP_LOOP:
                            raise ValueError(f"DecodeLayers: layer {i}'s shared-expert gate "
                                             f"needs NumPy's float32 exp loop (not found)")
                        L.gated = True
                        self._mat(s, "shared_gate", &L.sgate, 0, 1, D, i)
            elif L.g.n_experts != 1:
                raise ValueError(f"DecodeLayers: layer {i} dense MLP has {L.g.n_experts} "
                                 f"experts")
            L.E = E
            if E > self.m.E_max:
                self.m.E_max = E
            if L.moe and L.K > self.m.K_max:
                self.m.K_max = L.K
        self.isa = _isa

    cdef _load_gqa(self, spec, DLayer *L, int i):
        """Layer i's GQA attention: the fused q|k|v, wo, q/k norms, clip, window, sinks."""
        cdef Py_ssize_t D = self.m.D, nq = self.m.nq, nk = self.m.nk
        self._mat(spec, "qkv", &L.qkv, self.act, nq + 2 * nk, D, i)
        self._vec(spec, "qkv_bias", nq + 2 * nk, i, &L.qkv_bias)
        self._mat(spec, "wo", &L.wo, self.act, D, nq, i)
        self._vec(spec, "wo_bias", D, i, &L.wo_bias)
        L.qk_norm = QK_NORM_CODES[spec["qk_norm"]]
        full = L.qk_norm == QK_FULL                 # (H*Dh,) / (Hkv*Dh,), else (Dh,)
        self._vec(spec, "q_norm", nq if full else self.m.Dh, i, &L.q_norm)
        self._vec(spec, "k_norm", nk if full else self.m.Dh, i, &L.k_norm)
        if L.qk_norm != QK_NONE and (L.q_norm == NULL or L.k_norm == NULL):
            raise ValueError(f"DecodeLayers: layer {i} qk_norm {spec['qk_norm']!r} needs "
                             f"q_norm and k_norm")
        L.clip = spec["clip"] is not None
        L.clip_c = spec["clip"] if L.clip else 0.0
        L.window = spec["window"] or 0
        self._vec(spec, "sinks", self.m.H, i, &L.sinks)

    cdef _load_mla(self, spec, DLayer *L, int i):
        """Layer i's latent attention (the projections with the model's activations, kv_b
        with f32 ones as PreparedMLA), its norms and wo (D, H*Dv)."""
        cdef DModel *m = &self.m
        cdef Py_ssize_t D = m.D, H = m.H, qw = m.H * (m.Dn + m.Dr)
        L.qk_norm, L.clip, L.clip_c, L.window, L.sinks = QK_NONE, False, 0.0, 0, NULL
        L.q_norm = L.k_norm = L.qkv_bias = NULL
        if m.Rq > 0:
            self._mat(spec, "wq_a", &L.a.wq_a, self.act, m.Rq, D, i)
            self._vec(spec, "wq_a_bias", m.Rq, i, &L.a.bq_a)
            self._vec(spec, "q_a_norm", m.Rq, i, &L.a.q_a_norm)
            self._mat(spec, "wq_b", &L.a.wq_b, self.act, qw, m.Rq, i)
            self._vec(spec, "wq_b_bias", qw, i, &L.a.bq_b)
            L.a.bq = NULL
            if L.a.q_a_norm == NULL:
                raise ValueError(f"DecodeLayers: layer {i}'s q LoRA needs q_a_norm")
        else:
            self._mat(spec, "wq", &L.a.wq, self.act, qw, D, i)
            self._vec(spec, "wq_bias", qw, i, &L.a.bq)
            L.a.bq_a = L.a.bq_b = L.a.q_a_norm = NULL
        self._mat(spec, "wkv_a", &L.a.wkv_a, self.act, m.R + m.Dr, D, i)
        self._vec(spec, "wkv_a_bias", m.R + m.Dr, i, &L.a.bkv_a)
        self._vec(spec, "kv_a_norm", m.R, i, &L.a.kv_a_norm)
        if L.a.kv_a_norm == NULL:
            raise ValueError(f"DecodeLayers: layer {i} needs kv_a_norm")
        self._mat(spec, "kv_b", &L.a.kvb, 0, H * (m.Dn + m.Dv), m.R, i)
        self._mat(spec, "wo", &L.wo, self.act, D, H * m.Dv, i)
        self._vec(spec, "wo_bias", D, i, &L.wo_bias)

    cdef _load_biased(self, spec, DLayer *L, int i):
        """Layer i's biased experts: biases flattened (E*I, E*I, E*D), the activation."""
        cdef Py_ssize_t E = L.g.n_experts, I = L.g.rows, D = self.m.D
        if L.K > BIASED_MAX_K:
            raise ValueError(f"DecodeLayers: layer {i} routes to {L.K} biased experts, at "
                             f"most {BIASED_MAX_K}")
        self._vec(spec, "b_gate", E * I, i, &L.bx.bg)
        self._vec(spec, "b_up", E * I, i, &L.bx.bu)
        self._vec(spec, "b_down", E * D, i, &L.bx.bd)
        L.bx.swiglu_oai = spec["swiglu_oai"]
        L.bx.alpha, L.bx.limit = spec["alpha"], spec["limit"]

    cdef int _ensure(self) except -1:
        """Reload the weights' row kernels when the ISA path changed (as PreparedLinear)."""
        if self.isa != _isa:
            self._load()
        return 0

    cdef Py_ssize_t _work_bytes(self, Py_ssize_t slots, Py_ssize_t T) noexcept nogil:
        """Scratch any one kernel call of a pass of T rows needs (linear and expert FFN over
        the T rows, attention of one row over up to `slots` positions, the biased experts'
        per-row call), for the current knobs."""
        cdef Py_ssize_t i, n = 4 * self.m.threads * slots * (self.m.H // self.m.Hkv), b
        cdef const DLayer *L
        for i in range(self.m.n_layers):
            L = &self.m.layers[i]
            if L.mla:
                b = _mla_work_bytes(&L.a, self.m.H, self.m.Dn, self.m.Dr, self.m.Dv, slots,
                                    self.m.threads, self.m.Rq > 0, T)
            else:
                b = _linear_bytes(T, &L.qkv, self.m.threads)
            n = b if b > n else n
            b = _linear_bytes(T, &L.wo, self.m.threads)
            n = b if b > n else n
            if L.biased:
                b = _biased_bytes(L.K, &L.g, &L.u, &L.d)
            else:
                b = _ffn_bytes(T, L.K if L.moe else 1, &L.g, &L.u, &L.d, self.m.threads)
            n = b if b > n else n
            if L.moe:
                b = _linear_bytes(T, &L.router, self.m.threads)
                n = b if b > n else n
            if L.shared:
                b = _ffn_bytes(T, 1, &L.sg, &L.su, &L.sd, self.m.threads)
                n = b if b > n else n
            if L.gated:
                b = _linear_bytes(T, &L.sgate, self.m.threads)
                n = b if b > n else n
        return n


cdef class DecodeBinding:
    """DecodeLayers over one KV cache (batch 1) and a RunState's buffers: `b.step(k, v,
    slot, cos, sin)` runs every layer for the token whose embedding is in state.h (1, D),
    its keys and values written to slot `slot` of the cache planes k, v (the cache's lists,
    checked against the bound arrays at each step, rebound if they changed), cos / sin
    float32 (Dr/2,) of its position; returns -1, or the layer whose router logits were NaN
    (the step stopped there, the state's buffers holding that layer's vectors).
    `b.rows(k, v, slot0, cos, sin, h)`: the same for T <= DECODE_MAX_ROWS consecutive tokens
    of the sequence (a speculative verification), h float32 (T, D) their embeddings, updated
    in place to the last layer's residual stream, at slots slot0..slot0+T-1, cos / sin
    (T, Dr/2); each row attends causally (the cache's slots up to its own); its other
    vectors in the binding's scratch (the step is its T = 1 case, the same bits); when it
    returns a layer, nan_rows holds that layer's (xa, o, xf) (T, D). routing, when given:
    int32 (M, T, K) C-contiguous, M the MoE layers, K the most experts a token takes; it
    receives each MoE layer's experts of each row (-1 past a layer's own top-k).
    seconds: float64 (5,), the last call's time per stage (STAGE_NAMES)."""
    cdef readonly DecodeLayers layers
    cdef readonly object state
    cdef readonly object seconds
    cdef readonly object nan_rows       # after rows returned a layer: its (xa, o, xf) (T, D)
    cdef list k_planes, v_planes
    cdef DBind b
    cdef object scratch
    cdef Py_ssize_t cap, gm, igm, mb
    cdef Py_ssize_t ready               # the rows the scratch is sized for (current knobs)
    cdef int isa

    def __cinit__(self):
        self.b.kp = NULL
        self.b.vp = NULL
        self.b.route = NULL

    def __dealloc__(self):
        free(self.b.kp)
        free(self.b.vp)

    def __init__(self, DecodeLayers layers, state, list k_planes, list v_planes):
        cdef Py_ssize_t d[2]
        cdef Py_ssize_t D = layers.m.D, nq = layers.m.nq, nk = layers.m.nk
        self.layers, self.state = layers, state
        for name in ("h", "xa", "xf", "o", "y"):
            if getattr(state, name).shape != (1, D):
                raise ValueError(f"DecodeBinding: state.{name} must be (1, {D}), found "
                                 f"{getattr(state, name).shape}")
        self.b.h = _f32(state.h, "state.h", 2, True, d)
        self.b.xa = _f32(state.xa, "state.xa", 2, True, d)
        self.b.xf = _f32(state.xf, "state.xf", 2, True, d)
        self.b.o = _f32(state.o, "state.o", 2, True, d)
        self.b.y = _f32(state.y, "state.y", 2, True, d)
        self.b.qkv = _f32(state.qkv_row, "state.qkv_row", 2, True, d)
        if d[0] != 1 or d[1] != nq + 2 * nk:
            raise ValueError(f"DecodeBinding: state.qkv_row must be (1, {nq + 2 * nk})")
        self.b.att = _f32(state.att_row, "state.att_row", 2, True, d)
        if d[0] != 1 or d[1] != nq:
            raise ValueError(f"DecodeBinding: state.att_row must be (1, {nq})")
        self.seconds = np.zeros(N_STAGES, dtype=np.float64)
        self.b.sec = <double *>colibri_array_data(self.seconds)
        self.b.kp = <char **>malloc(max(1, layers.m.n_layers) * sizeof(char *))
        self.b.vp = <char **>malloc(max(1, layers.m.n_layers) * sizeof(char *))
        if self.b.kp == NULL or self.b.vp == NULL:
            raise MemoryError("DecodeBinding: no memory for the plane table")
        self.scratch = None
        self.nan_rows = None
        self.cap = -1
        self.ready = 0
        self._bind(k_planes, v_planes)

    def _bind(self, list k_planes, list v_planes):
        """Check the cache planes (one (1, Hkv, S, Dh) array of one storage dtype per layer,
        as KVCache makes them; MLA: (1, 1, S, Rkv) latents and (1, 1, S, Dr) rotary keys) and
        keep their addresses."""
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t kd[4]
        cdef Py_ssize_t vd[4]
        cdef int kfmt, vfmt, fmt = COLIBRI_F32
        cdef Py_ssize_t i, j, S = 1
        if len(k_planes) != m.n_layers or len(v_planes) != m.n_layers:
            raise ValueError(f"DecodeBinding: {len(k_planes)} key and {len(v_planes)} value "
                             f"planes for {m.n_layers} layers")
        for i in range(m.n_layers):
            self.b.kp[i] = <char *>_kv(k_planes[i], f"k[{i}]", 4, kd, &kfmt)
            self.b.vp[i] = <char *>_kv(v_planes[i], f"v[{i}]", 4, vd, &vfmt)
            for j in range(3):
                if kd[j] != vd[j]:
                    raise ValueError(f"DecodeBinding: layer {i}'s key and value planes differ")
            if (kd[0] != 1 or kd[1] != m.kvh or kd[3] != m.kw or vd[3] != m.vw
                    or (i > 0 and kd[2] != S)):
                raise ValueError(f"DecodeBinding: layer {i}'s planes are {k_planes[i].shape} "
                                 f"and {v_planes[i].shape}, expected (1, {m.kvh}, S, {m.kw}) "
                                 f"and (1, {m.kvh}, S, {m.vw}) for every layer")
            if kfmt != vfmt or (i > 0 and kfmt != fmt):
                raise ValueError("DecodeBinding: the planes differ in storage dtype")
            fmt, S = kfmt, kd[2]
        self.b.fmt, self.b.S, self.b.es = fmt, S, 4 if fmt == COLIBRI_F32 else 2
        self.k_planes, self.v_planes = list(k_planes), list(v_planes)
        self._grow(max(1, self.ready))

    cdef int _grow(self, Py_ssize_t T) except -1:
        """Scratch of a pass of T rows for the current knobs and ISA: the row buffers (for
        rows; a step uses its RunState's), the fixed part (router logits, routing scratch,
        ids, weights, the shared expert's output, a dense MLP's ids and weights, MLA's
        vectors) and the part of the largest kernel call."""
        self.layers._ensure()
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t need = (4 * T * (4 * m.D + 2 * m.nq + 2 * m.nk) + 6 * 64
                                + _step_bytes(m, T) + self.layers._work_bytes(self.b.S, T))
        if need > self.cap:
            self.scratch = np.empty(need + 64, dtype=np.uint8)
            self.cap = need
        self.gm, self.igm, self.mb, self.isa = _gemm_min, _igemm_min, _min_bytes, _isa
        self.ready = T
        return 0

    cdef int _prepare(self, list k_planes, list v_planes, Py_ssize_t T) except -1:
        """Rebind the cache planes if they changed; regrow the scratch if the knobs or the
        ISA changed or T rows need more."""
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t i
        cdef bint same = len(k_planes) == m.n_layers and len(v_planes) == m.n_layers
        if same:
            for i in range(m.n_layers):
                if (k_planes[i] is not self.k_planes[i]
                        or v_planes[i] is not self.v_planes[i]):
                    same = False
                    break
        if not same:
            self._bind(k_planes, v_planes)
        if (self.isa != _isa or self.gm != _gemm_min or self.igm != _igemm_min
                or self.mb != _min_bytes or T > self.ready):
            self._grow(T)
        return 0

    def step(self, list k_planes, list v_planes, Py_ssize_t slot, cos, sin):
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t cd[1]
        cdef Py_ssize_t sd[1]
        cdef Py_ssize_t bad
        self._prepare(k_planes, v_planes, 1)
        cdef const float *cp = _f32(cos, "cos", 1, False, cd)
        cdef const float *sp = _f32(sin, "sin", 1, False, sd)
        if cd[0] != m.h_rope or sd[0] != m.h_rope:
            raise ValueError(f"step: cos ({cd[0]},) and sin ({sd[0]},) must have "
                             f"{m.h_rope} elements")
        if not 0 <= slot < self.b.S:
            raise ValueError(f"step: slot {slot} is outside the cache's {self.b.S} slots")
        cdef char *base = _base(self.scratch)
        with nogil:
            bad = _decode_step(m, &self.b, 1, slot, cp, sp, base)
        return bad

    cdef int _check_routing(self, routing, Py_ssize_t T) except -1:
        """routing must be int32 (M, T, K_max), C-contiguous and writable."""
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t i, M = 0
        for i in range(m.n_layers):
            M += m.layers[i].moe
        want = (M, T, m.K_max)
        if (not isinstance(routing, np.ndarray) or routing.dtype != np.int32
                or routing.shape != want or not routing.flags.c_contiguous
                or not routing.flags.writeable):
            raise ValueError(f"rows: routing must be a writable C-contiguous int32 array of "
                             f"shape {want}, found "
                             f"{getattr(routing, 'dtype', type(routing).__name__)} "
                             f"{getattr(routing, 'shape', '')}")
        return 0

    def rows(self, list k_planes, list v_planes, Py_ssize_t slot0, cos, sin, h, routing=None):
        cdef DModel *m = &self.layers.m
        cdef Py_ssize_t hd[2]
        cdef Py_ssize_t cd[2]
        cdef Py_ssize_t sd[2]
        cdef Py_ssize_t bad, T, N = m.nq + 2 * m.nk
        cdef float *hp = _f32(h, "h", 2, True, hd)
        T = hd[0]
        if not 1 <= T <= MAX_ROWS or hd[1] != m.D:
            raise ValueError(f"rows: h is ({hd[0]}, {hd[1]}), expected (T, {m.D}) with "
                             f"1 <= T <= {MAX_ROWS}")
        cdef const float *cp = _f32(cos, "cos", 2, False, cd)
        cdef const float *sp = _f32(sin, "sin", 2, False, sd)
        if cd[0] != T or sd[0] != T or cd[1] != m.h_rope or sd[1] != m.h_rope:
            raise ValueError(f"rows: cos ({cd[0]}, {cd[1]}) and sin ({sd[0]}, {sd[1]}) must "
                             f"be ({T}, {m.h_rope})")
        self._prepare(k_planes, v_planes, T)
        if slot0 < 0 or slot0 + T > self.b.S:
            raise ValueError(f"rows: slots {slot0}..{slot0 + T - 1} are outside the cache's "
                             f"{self.b.S} slots")
        cdef char *cur = _base(self.scratch)
        cdef DBind rb = self.b                  # the same planes, T-row buffers
        rb.h = hp
        rb.xa = <float *>_carve(&cur, 4 * T * m.D)
        rb.xf = <float *>_carve(&cur, 4 * T * m.D)
        rb.o = <float *>_carve(&cur, 4 * T * m.D)
        rb.y = <float *>_carve(&cur, 4 * T * m.D)
        rb.qkv = <float *>_carve(&cur, 4 * T * N)
        rb.att = <float *>_carve(&cur, 4 * T * m.nq)
        rb.route, rb.route_k = NULL, 0
        if routing is not None:
            self._check_routing(routing, T)
            if routing.size:            # else no MoE layer: nothing to record
                rb.route = <int32_t *>colibri_array_data(routing)
                rb.route_k = m.K_max
        with nogil:
            bad = _decode_step(m, &rb, T, slot0, cp, sp, cur)
        if bad >= 0:                # what the NaN's error names: that layer's vectors
            self.nan_rows = (self._view(rb.xa, T), self._view(rb.o, T), self._view(rb.xf, T))
        return bad

    cdef object _view(self, float *p, Py_ssize_t T):
        """The (T, D) float32 rows at p in the scratch, as an array (a copy)."""
        cdef Py_ssize_t off = <char *>p - <char *>colibri_array_data(self.scratch)
        return self.scratch[off:off + 4 * T * self.layers.m.D].view(np.float32).reshape(
            T, self.layers.m.D).copy()
