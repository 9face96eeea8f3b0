# colibri/pyx/decode_step.pxi: the compiled decode step's sequence, every layer of T
# consecutive tokens of one sequence (decode_layer.pxi's DecodeBinding.step, T = 1, and
# DecodeBinding.rows, a speculative verification's T <= DECODE_MAX_ROWS, call it without
# the GIL): per layer the norm of each row, the attention (GQA with its sinks, here: q|k|v
# and wo as one call over the T rows, RoPE per row, the T keys and values stored, then each
# row's attention over the cache up to its own slot; MLA: decode_families.pxi, likewise),
# the residual add, the norm, the router over the T rows and each row's routing, the
# experts as one call grouped by expert (or the biased ones row by row:
# decode_families.pxi), the shared expert and its gate, the residual add, with the time of
# each stage.


cdef Py_ssize_t _step_bytes(const DModel *m, Py_ssize_t T) noexcept nogil:
    """The scratch _decode_step carves for T rows before its kernels' work space."""
    cdef Py_ssize_t n = 4 * (T * m.E_max + 4 * m.E_max + 2 * T * m.K_max + T * m.D + 3 * T)
    n += 10 * 64
    if m.mla:
        n += _mla_buf_bytes(m.H, m.Dn, m.Dr, m.Dv, m.R, m.Rq, T)
    return n


cdef Py_ssize_t _decode_step(const DModel *m, DBind *b, Py_ssize_t T, Py_ssize_t slot0,
                             const float *cos, const float *sin, char *cur) noexcept nogil:
    """Every layer for the T tokens in b.h (T, D) at slots slot0..slot0+T-1, cos / sin
    (T, Dr/2) (see DecodeBinding.step / rows); -1 or the layer of NaN router logits."""
    cdef Py_ssize_t D = m.D, H = m.H, hr = m.h_rope, i, j, e, r, K, mi = 0
    cdef int th = m.threads
    cdef const DLayer *ly
    cdef float *logits = <float *>_carve(&cur, 4 * T * m.E_max)   # (T, E)
    cdef float *rp = <float *>_carve(&cur, 4 * m.E_max)           # routing scratch: p,
    cdef float *rkey = <float *>_carve(&cur, 4 * m.E_max)         # key,
    cdef float *rgs = <float *>_carve(&cur, 4 * m.E_max)          # group scores,
    cdef int32_t *rgids = <int32_t *>_carve(&cur, 4 * m.E_max)    # group ids
    cdef int32_t *ids = <int32_t *>_carve(&cur, 4 * T * m.K_max)  # (T, K)
    cdef float *wts = <float *>_carve(&cur, 4 * T * m.K_max)
    cdef float *s = <float *>_carve(&cur, 4 * T * D)              # the shared expert's output
    cdef int32_t *one_id = <int32_t *>_carve(&cur, 4 * T)         # (T, 1): expert 0, weight 1
    cdef float *one_w = <float *>_carve(&cur, 4 * T)
    cdef float *z = <float *>_carve(&cur, 4 * T)                  # the shared gate's logits
    if m.mla:
        _mla_carve(&cur, &b.mb, H, m.Dn, m.Dr, m.Dv, m.R, m.Rq, T)
    cdef char *work = cur
    cdef float gv
    cdef double t0, t1
    cdef RouteJob job
    for r in range(T):
        one_id[r] = 0
        one_w[r] = 1.0
    for j in range(N_STAGES):
        b.sec[j] = 0.0
    t0 = colibri_stage_clock()
    for i in range(m.n_layers):
        ly = &m.layers[i]
        # attention: norm, q|k|v, q/k norms, clip, RoPE, cache write + attention, wo
        _norm_rows(m.layer_norm, b.h, T, D, ly.attn_norm, ly.attn_norm_bias, m.eps, b.xa)
        if ly.mla:                  # or the latent attention (decode_families.pxi)
            _mla_attention(&ly.a, &b.mb, b.xa, T, b.fmt, b.kp[i], b.vp[i], slot0, H, m.Dn,
                           m.Dr, m.Dv, m.Rq, m.latent_eps, m.scale, cos, sin, th, work)
            _linear_core(b.mb.o, T, &ly.wo, ly.wo_bias, b.o, 0, th, work)
        else:
            _gqa_attention(m, ly, b, i, T, slot0, cos, sin, work)
        if m.has_rmult:
            colibri_scale_into(b.o, m.rmult, T * D)
        colibri_add_into(b.h, b.o, T * D)
        _norm_rows(m.layer_norm, b.h, T, D, ly.ffn_norm, ly.ffn_norm_bias, m.eps, b.xf)
        t1 = colibri_stage_clock()
        b.sec[STAGE_ATTENTION] += t1 - t0
        t0 = t1
        if ly.moe:
            # the router (f32 activations) over the rows and each row's top-k, as PreparedRoute
            K = ly.K
            _linear_core(b.xf, T, &ly.router, ly.router_bias, logits, 0, th, work)
            for e in range(T * ly.E):
                if logits[e] != logits[e]:
                    return i
            job.n_group, job.topk_group, job.bias = ly.n_group, ly.topk_group, ly.corr_bias
            for r in range(T):
                _route_token(logits + r * ly.E, ly.E, K, ly.rule, ly.norm_topk, False, 0,
                             ly.thresh, r, rp, rkey, ids + r * K, wts + r * K, &job, rgs,
                             rgids)
            if b.route != NULL:         # the caller's record of this layer's choices
                for r in range(T):
                    for j in range(b.route_k):
                        b.route[(mi * T + r) * b.route_k + j] = ids[r * K + j] if j < K else -1
                mi += 1
            if ly.rscale != 1.0:
                for j in range(T * K):
                    wts[j] = wts[j] * ly.rscale
            t1 = colibri_stage_clock()
            b.sec[STAGE_ROUTER] += t1 - t0
            t0 = t1
            if ly.biased:
                for r in range(T):
                    _biased_token(&ly.g, &ly.u, &ly.d, &ly.bx, b.xf + r * D, ids + r * K,
                                  wts + r * K, K, b.y + r * D, th, work)
            else:               # one call: each expert's weights read once for its rows
                _ffn_core(b.xf, ids, wts, T, K, &ly.g, &ly.u, &ly.d, b.y, th, work)
            t1 = colibri_stage_clock()
            b.sec[STAGE_EXPERTS] += t1 - t0
            t0 = t1
            if ly.shared:
                _ffn_core(b.xf, one_id, one_w, T, 1, &ly.sg, &ly.su, &ly.sd, s, th, work)
                if ly.gated:
                    _linear_core(b.xf, T, &ly.sgate, NULL, z, 0, th, work)
                    for r in range(T):
                        gv = colibri_gate_sigmoid(z[r])
                        colibri_scale_into(s + r * D, gv, D)
                colibri_add_into(b.y, s, T * D)
                t1 = colibri_stage_clock()
                b.sec[STAGE_SHARED] += t1 - t0
                t0 = t1
        else:
            _ffn_core(b.xf, one_id, one_w, T, 1, &ly.g, &ly.u, &ly.d, b.y, th, work)
            t1 = colibri_stage_clock()
            b.sec[STAGE_DENSE] += t1 - t0
            t0 = t1
        if m.has_rmult:
            colibri_scale_into(b.y, m.rmult, T * D)
        colibri_add_into(b.h, b.y, T * D)
    return -1


cdef void _gqa_attention(const DModel *m, const DLayer *ly, DBind *b, Py_ssize_t i,
                         Py_ssize_t T, Py_ssize_t slot0, const float *cos, const float *sin,
                         char *work) noexcept nogil:
    """Layer i's GQA attention of the T tokens in b.xa (normed) into b.o: q|k|v, q/k norms,
    clip, RoPE, the cache writes and each row's attention over the cache up to its slot
    (with the sinks), wo."""
    cdef Py_ssize_t H = m.H, Hkv = m.Hkv, Dh = m.Dh, nq = m.nq, nk = m.nk, hr = m.h_rope
    cdef Py_ssize_t N = nq + 2 * nk, S = b.S, es = b.es, start, n, j, r, slot
    cdef int th = m.threads, nth
    cdef float *row
    _linear_core(b.xa, T, &ly.qkv, ly.qkv_bias, b.qkv, 0, th, work)
    if ly.qk_norm == QK_FULL:
        colibri_rms_norm_rows(b.qkv, N, T, nq, ly.q_norm, m.eps, b.qkv, N)
        colibri_rms_norm_rows(b.qkv + nq, N, T, nk, ly.k_norm, m.eps, b.qkv + nq, N)
    if ly.clip:
        colibri_clip_into(b.qkv, ly.clip_c, T * N)
    for r in range(T):
        row = b.qkv + r * N               # q heads, then k heads, then v heads
        if ly.qk_norm == QK_PER_HEAD:
            colibri_rms_norm_rows(row, Dh, H, Dh, ly.q_norm, m.eps, row, Dh)
            colibri_rms_norm_rows(row + nq, Dh, Hkv, Dh, ly.k_norm, m.eps, row + nq, Dh)
        if hr > 0:
            colibri_rope_rows(row, Dh, H + Hkv, hr, cos + r * hr, sin + r * hr)
        slot = slot0 + r
        for j in range(Hkv):
            colibri_kv_store(b.fmt, b.kp[i] + (j * S + slot) * Dh * es, row + nq + j * Dh, Dh)
            colibri_kv_store(b.fmt, b.vp[i] + (j * S + slot) * Dh * es,
                             row + nq + nk + j * Dh, Dh)
    for r in range(T):                    # causal: row r sees the slots up to its own
        slot = slot0 + r
        start = slot + 1 - ly.window if ly.window and slot >= ly.window else 0
        n = slot + 1 - start
        nth = _attend_team(Hkv, n, Dh, th)
        _attend_core(b.fmt, b.qkv + r * N, b.kp[i] + start * Dh * es,
                     b.vp[i] + start * Dh * es, b.att + r * nq, S * Dh, Dh, n, H, Hkv, Dh,
                     m.scale, nth, <float *>work, ly.sinks)
    _linear_core(b.att, T, &ly.wo, ly.wo_bias, b.o, 0, th, work)
