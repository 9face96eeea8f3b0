# colibri/pyx/routing.pxi: routing, logits (T, E) -> ids (T, K), weights (T, K).

RULES = {"softmax_topk": 0, "topk_softmax": 1, "sparsemixer": 2}


cdef void _softmax(const float *v, Py_ssize_t n, float *p) noexcept nogil:
    """p = softmax(v), max-subtracted; exp in f32, sum in f64. Never NaN for non-NaN v:
    all -inf -> uniform, any +inf -> uniform over the +inf entries (the limits)."""
    cdef float m = v[0]
    cdef Py_ssize_t i, count = 0
    cdef double s = 0.0
    for i in range(1, n):
        if v[i] > m:
            m = v[i]
    if m == -INFINITY:
        for i in range(n):
            p[i] = <float>(1.0 / n)
        return
    if m == INFINITY:
        for i in range(n):
            if v[i] == INFINITY:
                count += 1
        for i in range(n):
            p[i] = <float>(1.0 / count) if v[i] == INFINITY else 0.0
        return
    for i in range(n):
        p[i] = expf(v[i] - m)
        s += p[i]
    for i in range(n):
        p[i] = <float>(p[i] / s)


cdef void _select_topk(const float *key, Py_ssize_t E, Py_ssize_t k, int32_t *ids) noexcept nogil:
    """ids[0..k) = the k largest keys, largest first, ties -> lower index.
    Partial selection: one pass, a sorted list of k kept by insertion (O(E k) worst case)."""
    cdef Py_ssize_t e, j, n = 0
    cdef float v
    for e in range(E):
        v = key[e]
        if n < k:
            j = n
            n += 1
        elif v > key[ids[k - 1]]:
            j = k - 1
        else:
            continue
        while j > 0 and v > key[ids[j - 1]]:        # strict: an equal key stays behind
            ids[j] = ids[j - 1]
            j -= 1
        ids[j] = <int32_t>e


cdef void _route_sparsemixer(const float *l, Py_ssize_t E, float thresh, float *p,
                             float *masked, int32_t *ids, float *w) noexcept nogil:
    """PhiMoE's sparsemixer, inference form (transformers' sparsemixer with training=False),
    top-2: e1 = argmax z (first of equal maxima); the experts j with (m - z_j) / max(|z_j|, m)
    > thresh (= 2 * router_jitter_noise, m = z[e1]) masked to -inf; w1 = softmax(masked z)[e1].
    Then e1 itself masked, e2 = argmax of the rest, m = z[e2], the same rule on the original
    z; w2 = softmax over those at e2. All arithmetic in f32 as torch does it (the softmax's
    sum in f64, as _softmax)."""
    cdef Py_ssize_t e, j
    cdef int32_t first = -1, best
    cdef float m, a, f
    for j in range(2):
        best = -1
        m = -INFINITY
        for e in range(E):                           # argmax, e1 excluded the second time
            if e != first and (best < 0 or l[e] > m):
                m = l[e]
                best = <int32_t>e
        for e in range(E):                           # the relative-threshold mask
            a = fabsf(l[e])
            f = a if a > m else m
            masked[e] = -INFINITY if (e == first or (m - l[e]) / f > thresh) else l[e]
        _softmax(masked, E, p)
        ids[j] = best
        w[j] = p[best]
        first = best


cdef void _route_token(const float *l, Py_ssize_t E, Py_ssize_t k, int rule, bint norm,
                       bint noisy, uint64_t seed, float thresh, Py_ssize_t t, float *p,
                       float *key, int32_t *ids, float *w) noexcept nogil:
    """One token's routing (see kernels.route_topk); p, key: scratch of E floats."""
    cdef const float *sel
    cdef Py_ssize_t e, j, i
    cdef double s = 0.0
    cdef float wj
    cdef int32_t ij
    if noisy:
        for e in range(E):
            key[e] = l[e] + colibri_gumbel(seed, <uint64_t>t, <uint64_t>e)
    if rule == 0:                                   # softmax over all E, then top-k
        _softmax(l, E, p)
        sel = p
        if noisy:
            sel = key
        _select_topk(sel, E, k, ids)
        for j in range(k):
            w[j] = p[ids[j]]
        if norm:
            for j in range(k):
                s += w[j]
            for j in range(k):
                w[j] = <float>(w[j] / s)
    elif rule == 2:                                 # PhiMoE's sparsemixer (k = 2, no noise)
        _route_sparsemixer(l, E, thresh, p, key, ids, w)
    else:                                           # top-k of the logits, softmax over the k
        sel = l
        if noisy:
            sel = key
        _select_topk(sel, E, k, ids)
        for j in range(k):
            p[j] = l[ids[j]]
        _softmax(p, k, w)
    # list by weight, descending, ties -> lower expert (insertion sort of k items)
    for j in range(1, k):
        wj = w[j]
        ij = ids[j]
        i = j
        while i > 0 and (w[i - 1] < wj or (w[i - 1] == wj and ids[i - 1] > ij)):
            w[i] = w[i - 1]
            ids[i] = ids[i - 1]
            i -= 1
        w[i] = wj
        ids[i] = ij


ctypedef struct RouteJob:
    # route_topk on the pool: work item t = token t
    const float *logits
    Py_ssize_t E, k
    int rule
    bint norm, noisy
    uint64_t seed
    float thresh
    float *p
    float *key
    int32_t *ids
    float *w


cdef void _route_task(void *ctx, Py_ssize_t t) noexcept nogil:
    cdef const RouteJob *j = <const RouteJob *>ctx
    _route_token(j.logits + t * j.E, j.E, j.k, j.rule, j.norm, j.noisy, j.seed, j.thresh, t,
                 j.p + t * j.E, j.key + t * j.E, j.ids + t * j.k, j.w + t * j.k)


cdef float _sparsemixer_threshold(str rule, Py_ssize_t k, double jitter_eps) except? -1:
    """2 * jitter_eps in f32 (the threshold torch compares against), checked for the rule."""
    if rule == "sparsemixer" and k != 2:
        raise ValueError(f"rule 'sparsemixer' routes to k = 2 experts, got k = {k}")
    if not jitter_eps >= 0:
        raise ValueError(f"jitter_eps must be >= 0, got {jitter_eps!r}")
    return <float>(2.0 * jitter_eps)


def route_topk(const float[:, ::1] logits, Py_ssize_t k, str rule, bint norm_topk_prob,
               noise_seed, int threads, double jitter_eps=0.0):
    """ids int32 (T, K), weights float32 (T, K) from logits float32 (T, E)."""
    _check_threads(threads)
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1]
    if rule not in RULES:
        raise ValueError(f"unknown routing rule {rule!r}; expected one of {', '.join(RULES)}")
    cdef int rcode = RULES[rule]
    if E < 1 or not 1 <= k <= E:
        raise ValueError(f"k = {k} must be in 1..E, with E = {E} experts")
    cdef float thresh = _sparsemixer_threshold(rule, k, jitter_eps)
    if rcode == 2 and noise_seed is not None:
        raise ValueError("rule 'sparsemixer' takes no routing noise")
    arr = np.asarray(logits)
    if T and np.isnan(arr).any():
        bad = np.argwhere(np.isnan(arr))[0]
        raise ValueError(f"logits contain NaN (first at token {bad[0]}, expert {bad[1]})")
    cdef bint noisy = noise_seed is not None
    cdef uint64_t seed = (int(noise_seed) & 0xFFFFFFFFFFFFFFFF) if noisy else 0
    ids = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    if T == 0:
        return ids, wts
    cdef int32_t[:, ::1] iv = ids
    cdef float[:, ::1] wv = wts
    cdef float *scratch = <float *>malloc(2 * T * E * sizeof(float))
    if scratch == NULL:
        raise MemoryError(f"route_topk: no memory for {T} x {E} scratch")
    cdef float *p = scratch
    cdef float *key = scratch + T * E
    cdef int nth = _team(<double>T * E * 64, threads)      # ~64 B of work per logit
    cdef RouteJob job
    try:
        with nogil:
            job.logits, job.E, job.k = &logits[0, 0], E, k
            job.rule, job.norm = rcode, norm_topk_prob
            job.noisy, job.seed, job.p, job.key = noisy, seed, p, key
            job.thresh = thresh
            job.ids, job.w = &iv[0, 0], &wv[0, 0]
            colibri_pool_run(nth, _route_task, &job, T)
    finally:
        free(scratch)
    return ids, wts
