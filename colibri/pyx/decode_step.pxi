# colibri/pyx/decode_step.pxi: the compiled decode step's sequence, every layer of one
# token (decode_layer.pxi's DecodeBinding.step calls it without the GIL): per layer the
# norm, the attention (GQA with its sinks, here; MLA: decode_families.pxi), wo, the
# residual add, the norm, the router and one token's routing, the experts (plain, or the
# biased ones: decode_families.pxi), the shared expert and its gate, the residual add, with
# the time of each stage.


cdef Py_ssize_t _decode_step(const DModel *m, DBind *b, Py_ssize_t slot, const float *cos,
                             const float *sin, char *cur) noexcept nogil:
    """Every layer for one token (see DecodeBinding.step); -1 or the layer of NaN logits."""
    cdef Py_ssize_t D = m.D, H = m.H, i, j, e
    cdef int th = m.threads
    cdef const DLayer *ly
    cdef float *logits = <float *>_carve(&cur, 4 * m.E_max)
    cdef float *rp = <float *>_carve(&cur, 4 * m.E_max)           # routing scratch: p,
    cdef float *rkey = <float *>_carve(&cur, 4 * m.E_max)         # key,
    cdef float *rgs = <float *>_carve(&cur, 4 * m.E_max)          # group scores,
    cdef int32_t *rgids = <int32_t *>_carve(&cur, 4 * m.E_max)    # group ids
    cdef int32_t *ids = <int32_t *>_carve(&cur, 4 * m.K_max)
    cdef float *wts = <float *>_carve(&cur, 4 * m.K_max)
    cdef float *s = <float *>_carve(&cur, 4 * D)                  # the shared expert's output
    cdef int32_t *one_id = <int32_t *>_carve(&cur, 4)
    cdef float *one_w = <float *>_carve(&cur, 4)
    if m.mla:
        _mla_carve(&cur, &b.mb, H, m.Dn, m.Dr, m.Dv, m.R, m.Rq)
    cdef char *work = cur
    cdef float gv, z
    cdef double t0, t1
    cdef RouteJob job
    one_id[0] = 0
    one_w[0] = 1.0
    for j in range(N_STAGES):
        b.sec[j] = 0.0
    t0 = colibri_stage_clock()
    for i in range(m.n_layers):
        ly = &m.layers[i]
        # attention: norm, q|k|v, q/k norms, clip, RoPE, cache write + attention, wo
        _norm_row(m.layer_norm, b.h, D, ly.attn_norm, ly.attn_norm_bias, m.eps, b.xa)
        if ly.mla:                  # or the latent attention (decode_families.pxi)
            _mla_attention(&ly.a, &b.mb, b.xa, b.fmt, b.kp[i], b.vp[i], slot, H, m.Dn, m.Dr,
                           m.Dv, m.Rq, m.latent_eps, m.scale, cos, sin, th, work)
            _linear_core(b.mb.o, 1, &ly.wo, ly.wo_bias, b.o, 0, th, work)
        else:
            _gqa_attention(m, ly, b, i, slot, cos, sin, work)
        if m.has_rmult:
            colibri_scale_into(b.o, m.rmult, D)
        colibri_add_into(b.h, b.o, D)
        _norm_row(m.layer_norm, b.h, D, ly.ffn_norm, ly.ffn_norm_bias, m.eps, b.xf)
        t1 = colibri_stage_clock()
        b.sec[STAGE_ATTENTION] += t1 - t0
        t0 = t1
        if ly.moe:
            # the router (f32 activations) and one token's top-k, as PreparedRoute
            _linear_core(b.xf, 1, &ly.router, ly.router_bias, logits, 0, th, work)
            for e in range(ly.E):
                if logits[e] != logits[e]:
                    return i
            job.n_group, job.topk_group, job.bias = ly.n_group, ly.topk_group, ly.corr_bias
            _route_token(logits, ly.E, ly.K, ly.rule, ly.norm_topk, False, 0, ly.thresh, 0,
                         rp, rkey, ids, wts, &job, rgs, rgids)
            if ly.rscale != 1.0:
                for j in range(ly.K):
                    wts[j] = wts[j] * ly.rscale
            t1 = colibri_stage_clock()
            b.sec[STAGE_ROUTER] += t1 - t0
            t0 = t1
            if ly.biased:
                _biased_token(&ly.g, &ly.u, &ly.d, &ly.bx, b.xf, ids, wts, ly.K, b.y, th, work)
            else:
                _ffn_core(b.xf, ids, wts, 1, ly.K, &ly.g, &ly.u, &ly.d, b.y, th, work)
            t1 = colibri_stage_clock()
            b.sec[STAGE_EXPERTS] += t1 - t0
            t0 = t1
            if ly.shared:
                _ffn_core(b.xf, one_id, one_w, 1, 1, &ly.sg, &ly.su, &ly.sd, s, th, work)
                if ly.gated:
                    _linear_core(b.xf, 1, &ly.sgate, NULL, &z, 0, th, work)
                    gv = colibri_gate_sigmoid(z)
                    colibri_scale_into(s, gv, D)
                colibri_add_into(b.y, s, D)
                t1 = colibri_stage_clock()
                b.sec[STAGE_SHARED] += t1 - t0
                t0 = t1
        else:
            _ffn_core(b.xf, one_id, one_w, 1, 1, &ly.g, &ly.u, &ly.d, b.y, th, work)
            t1 = colibri_stage_clock()
            b.sec[STAGE_DENSE] += t1 - t0
            t0 = t1
        if m.has_rmult:
            colibri_scale_into(b.y, m.rmult, D)
        colibri_add_into(b.h, b.y, D)
    return -1


cdef void _gqa_attention(const DModel *m, const DLayer *ly, DBind *b, Py_ssize_t i,
                         Py_ssize_t slot, const float *cos, const float *sin,
                         char *work) noexcept nogil:
    """Layer i's GQA attention of the token in b.xa (normed) into b.o: q|k|v, q/k norms,
    clip, RoPE, the cache write and the attention over the cache (with the sinks), wo."""
    cdef Py_ssize_t H = m.H, Hkv = m.Hkv, Dh = m.Dh, nq = m.nq, nk = m.nk
    cdef Py_ssize_t S = b.S, es = b.es, start, n, j
    cdef int th = m.threads, nth
    cdef float *q_heads = b.qkv
    cdef float *k_heads = b.qkv + nq
    cdef float *v_heads = b.qkv + nq + nk
    _linear_core(b.xa, 1, &ly.qkv, ly.qkv_bias, b.qkv, 0, th, work)
    if ly.qk_norm == QK_FULL:
        colibri_rms_norm_rows(q_heads, nq, 1, nq, ly.q_norm, m.eps, q_heads, nq)
        colibri_rms_norm_rows(k_heads, nk, 1, nk, ly.k_norm, m.eps, k_heads, nk)
    if ly.clip:
        colibri_clip_into(b.qkv, ly.clip_c, nq + 2 * nk)
    if ly.qk_norm == QK_PER_HEAD:
        colibri_rms_norm_rows(q_heads, Dh, H, Dh, ly.q_norm, m.eps, q_heads, Dh)
        colibri_rms_norm_rows(k_heads, Dh, Hkv, Dh, ly.k_norm, m.eps, k_heads, Dh)
    if m.h_rope > 0:
        colibri_rope_rows(q_heads, Dh, H + Hkv, m.h_rope, cos, sin)
    start = slot + 1 - ly.window if ly.window and slot >= ly.window else 0
    n = slot + 1 - start
    for j in range(Hkv):
        colibri_kv_store(b.fmt, b.kp[i] + (j * S + slot) * Dh * es, k_heads + j * Dh, Dh)
        colibri_kv_store(b.fmt, b.vp[i] + (j * S + slot) * Dh * es, v_heads + j * Dh, Dh)
    nth = _attend_team(Hkv, n, Dh, th)
    _attend_core(b.fmt, q_heads, b.kp[i] + start * Dh * es, b.vp[i] + start * Dh * es,
                 b.att, S * Dh, Dh, n, H, Hkv, Dh, m.scale, nth, <float *>work, ly.sinks)
    _linear_core(b.att, 1, &ly.wo, ly.wo_bias, b.o, 0, th, work)
