# colibri/pyx/decode_families.pxi: what DeepSeek's, GPT-OSS's and the LayerNorm families'
# layers add to the compiled decode step (decode_layer.pxi), as nogil calls on its scratch:
#   - _norm_rows: the model's norm of rows, RMSNorm or LayerNorm (PhiMoE, DBRX:
#     norms.layer_norm's operations in NumPy's summation order, csrc/decode_layer.h);
#   - _mla_attention: MLA.decode (colibri/engine/mla.py) — the q projection (or q LoRA: wq_a, its
#     RMSNorm, wq_b), kv_a, the latent's RMSNorm, RoPE of q_rope and k_rope, then PreparedMLA's
#     absorbed attention (_mla_core, pyx/mla.pxi) — into the heads' output (H*Dv); over T
#     rows the projections one call each, then row by row RoPE, the latent written and the
#     attention up to it;
#   - _biased_token: PreparedBiasedExperts' one-token call (pyx/biased_experts.pxi's
#     _biased_job / _biased_one: the same run, the same order of the sums), on carved
#     scratch instead of the per-process buffer.
# The same C functions in the same order as the Python step, so the same bits.

from libc.string cimport memcpy

cdef extern from "csrc/decode_layer.h" nogil:
    void colibri_layer_norm_row(const float *x, Py_ssize_t n, const float *weight,
                                const float *bias, float eps, float *out)

BIASED_TOP_K_MAX = BIASED_MAX_K     # the experts per token _biased_token takes

ctypedef struct DMla:
    # one layer's latent attention (colibri.engine.mla.MLA): Wmats of the current ISA
    Wmat wq, wq_a, wq_b, wkv_a    # (H*(Dn+Dr), D) or (Rq, D) + (H*(Dn+Dr), Rq); (Rkv+Dr, D)
    Wmat kvb                      # kv_b (H*(Dn+Dv), Rkv), f32 activations (PreparedMLA's)
    const float *bq               # their biases or NULL
    const float *bq_a
    const float *bq_b
    const float *bkv_a
    const float *q_a_norm         # (Rq,) or NULL (no q LoRA)
    const float *kv_a_norm        # (Rkv,)


ctypedef struct DMlaBuf:
    # a step's MLA vectors (carved once per binding)
    # a pass's MLA vectors of its T rows (carved per call)
    float *q                      # (T, H, Dn+Dr)
    float *qa                     # (T, Rq)
    float *qr                     # (H, Dr) one row's q_rope, rotated
    float *ckv                    # (T, Rkv + Dr) kv_a's output
    float *c                      # (T, Rkv) the normed latent
    float *kr                     # (Dr,) one row's k_rope, rotated
    float *o                      # (T, H*Dv) the heads' output


ctypedef struct DBiased:
    # one layer's biased / swigluoai experts (colibri.kernels.biased_experts.BiasedExperts)
    const float *bg               # (E, I), (E, I), (E, D) or NULL
    const float *bu
    const float *bd
    bint swiglu_oai               # else silu(g) * u
    float alpha, limit


cdef Py_ssize_t _mla_buf_bytes(Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dr, Py_ssize_t Dv,
                               Py_ssize_t R, Py_ssize_t Rq, Py_ssize_t T) noexcept nogil:
    return 4 * (T * (H * (Dn + Dr) + Rq + R + Dr + R + H * Dv) + H * Dr + Dr) + 7 * 64


cdef void _mla_carve(char **cur, DMlaBuf *mb, Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dr,
                     Py_ssize_t Dv, Py_ssize_t R, Py_ssize_t Rq, Py_ssize_t T) noexcept nogil:
    """The vectors of T rows' latent attention (the rotated q_rope and k_rope: one row's)."""
    mb.q = <float *>_carve(cur, 4 * T * H * (Dn + Dr))
    mb.qa = <float *>_carve(cur, 4 * T * Rq)
    mb.qr = <float *>_carve(cur, 4 * H * Dr)
    mb.ckv = <float *>_carve(cur, 4 * T * (R + Dr))
    mb.c = <float *>_carve(cur, 4 * T * R)
    mb.kr = <float *>_carve(cur, 4 * Dr)
    mb.o = <float *>_carve(cur, 4 * T * H * Dv)


cdef Py_ssize_t _mla_work_bytes(const DMla *a, Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dr,
                                Py_ssize_t Dv, Py_ssize_t slots, int threads,
                                bint lora, Py_ssize_t T) noexcept nogil:
    """Scratch any one call of _mla_attention over T rows needs (a row's attention over up
    to `slots` positions)."""
    cdef Py_ssize_t n = 0, b, m
    cdef int nth
    cdef Py_ssize_t hper, xp, per
    for nth in range(1, threads + 1):     # _mla_plan's team grows with the cache: any size
        hper = (H + nth - 1) // nth
        if hper > COLIBRI_MLA_MAX_HEADS:
            hper = COLIBRI_MLA_MAX_HEADS
        xp = (a.kvb.cols // 32 + 16) // 16 * 16
        per = COLIBRI_GEMM_NR * COLIBRI_GEMM_KC + xp + (hper * slots + 15) // 16 * 16
        m = 4 * (nth * per + 2 * H * a.kvb.cols + 16)
        n = m if m > n else n
    if lora:
        b = _linear_bytes(T, &a.wq_a, threads)
        n = b if b > n else n
        b = _linear_bytes(T, &a.wq_b, threads)
    else:
        b = _linear_bytes(T, &a.wq, threads)
    n = b if b > n else n
    b = _linear_bytes(T, &a.wkv_a, threads)
    return b if b > n else n


cdef void _mla_attention(const DMla *a, const DMlaBuf *mb, const float *x, Py_ssize_t T,
                         int fmt, char *lat, char *rot, Py_ssize_t slot0, Py_ssize_t H,
                         Py_ssize_t Dn, Py_ssize_t Dr, Py_ssize_t Dv, Py_ssize_t Rq,
                         float latent_eps, float scale, const float *cos, const float *sin,
                         int threads, char *work) noexcept nogil:
    """MLA.decode up to its output projection for T consecutive rows: x (T, D) normed ->
    mb.o (T, H*Dv); the projections one call over the rows, then per row RoPE, its latent
    and rotated key written to slot slot0 + r of sequence 0's planes lat (S, Rkv) / rot
    (S, Dr) and its absorbed attention up to that slot; cos / sin (T, Dr/2)."""
    cdef Py_ssize_t R = a.kvb.cols, qs = Dn + Dr, h, r, qw = H * (Dn + Dr)
    cdef Py_ssize_t hr = Dr // 2
    cdef const float *q
    if Rq > 0:                                        # q LoRA: wq_b(RMSNorm(wq_a(x)))
        _linear_core(x, T, &a.wq_a, a.bq_a, mb.qa, 0, threads, work)
        colibri_rms_norm_rows(mb.qa, Rq, T, Rq, a.q_a_norm, latent_eps, mb.qa, Rq)
        _linear_core(mb.qa, T, &a.wq_b, a.bq_b, mb.q, 0, threads, work)
    else:
        _linear_core(x, T, &a.wq, a.bq, mb.q, 0, threads, work)
    _linear_core(x, T, &a.wkv_a, a.bkv_a, mb.ckv, 0, threads, work)
    colibri_rms_norm_rows(mb.ckv, R + Dr, T, R, a.kv_a_norm, latent_eps, mb.c, R)
    for r in range(T):
        q = mb.q + r * qw
        for h in range(H):                            # q_rope, contiguous, rotated
            memcpy(mb.qr + h * Dr, q + h * qs + Dn, 4 * Dr)
        colibri_rope_rows(mb.qr, Dr, H, hr, cos + r * hr, sin + r * hr)
        memcpy(mb.kr, mb.ckv + r * (R + Dr) + R, 4 * Dr)
        colibri_rope_rows(mb.kr, Dr, 1, hr, cos + r * hr, sin + r * hr)
        _mla_core(&a.kvb, fmt, q, qs, mb.qr, lat, rot, mb.c + r * R, mb.kr, slot0 + r, H, Dn,
                  Dv, Dr, scale, threads, <float *>work, mb.o + r * H * Dv)


cdef void _biased_token(const Wmat *g, const Wmat *u, const Wmat *d, const DBiased *bx,
                        const float *x, const int32_t *ids, const float *wts, Py_ssize_t K,
                        float *y, int threads, char *cur) noexcept nogil:
    """PreparedBiasedExperts(x, ids, weights, y) for one token of K <= BIASED_MAX_K experts
    (ids in range), on cur (_biased_bytes(K, ...) bytes, 64-aligned): the same run
    (_biased_one, pyx/biased_experts.pxi)."""
    cdef int32_t experts[BIASED_MAX_K]
    cdef float wk[BIASED_MAX_K]
    cdef Py_ssize_t k, i
    cdef BiasedJob j
    for k in range(K):                   # insertion sort by expert id, stable
        i = k
        while i > 0 and experts[i - 1] > ids[k]:
            experts[i], wk[i] = experts[i - 1], wk[i - 1]
            i -= 1
        experts[i], wk[i] = ids[k], wts[k]
    _biased_job(&j, g, u, d, bx.bg, bx.bu, bx.bd, bx.swiglu_oai, bx.alpha, bx.limit, x, y,
                K, experts, experts, wk)
    _biased_one(&j, threads, cur)


cdef inline void _norm_rows(bint layer_norm, const float *x, Py_ssize_t T, Py_ssize_t n,
                            const float *w, const float *bias, float eps,
                            float *out) noexcept nogil:
    """The model's norm of the rows x (T, n) into out: Model.norm_rows_into's, the same bits."""
    cdef Py_ssize_t r
    if layer_norm:
        for r in range(T):
            colibri_layer_norm_row(x + r * n, n, w, bias, eps, out + r * n)
    else:
        colibri_rms_norm_rows(x, n, T, n, w, eps, out, n)


def layer_norm_rows(x, weight, bias, float eps, out):
    """LayerNorm of the rows of x (N, C) into out (N, C) as the compiled decode step computes
    it (norms.layer_norm's operations and summation order, the same bits); weight (C,), bias
    (C,) or None; all float32 C-contiguous."""
    cdef Py_ssize_t xd[2]
    cdef Py_ssize_t od[2]
    cdef Py_ssize_t wd[1]
    cdef Py_ssize_t bd[1]
    cdef const float *xp = _f32(x, "x", 2, False, xd)
    cdef float *op = _f32(out, "out", 2, True, od)
    cdef const float *wp = _f32(weight, "weight", 1, False, wd)
    cdef const float *bp = NULL if bias is None else _f32(bias, "bias", 1, False, bd)
    cdef Py_ssize_t i
    if od[0] != xd[0] or od[1] != xd[1] or wd[0] != xd[1] or (bias is not None
                                                             and bd[0] != xd[1]):
        raise ValueError(f"layer_norm_rows: x ({xd[0]}, {xd[1]}), weight ({wd[0]},), out "
                         f"({od[0]}, {od[1]}) and bias must agree")
    for i in range(xd[0]):
        colibri_layer_norm_row(xp + i * xd[1], xd[1], wp, bp, eps, op + i * xd[1])
