# colibri/pyx/routing.pxi: routing, logits (T, E) -> ids (T, K), weights (T, K).

cdef enum:                  # the group rules' codes (2 is sparsemixer)
    SOFTMAX_GROUP = 3
    SIGMOID_GROUP = 4

RULES = {"softmax_topk": 0, "topk_softmax": 1, "sparsemixer": 2,
         "softmax_group_topk": SOFTMAX_GROUP, "sigmoid_group_topk": SIGMOID_GROUP}
# the rules that choose groups of experts first (DeepSeek): they take n_group / topk_group,
# the sigmoid one a correction bias (E,); no noise
GROUP_RULES = ("softmax_group_topk", "sigmoid_group_topk")


ctypedef struct RouteJob:
    # route_topk on the pool: work item t = token t
    const float *logits
    Py_ssize_t E, k
    int rule
    bint norm, noisy
    uint64_t seed
    float thresh                # sparsemixer: 2 * router_jitter_noise
    float *p
    float *key
    int32_t *ids
    float *w
    # the group rules: groups, groups kept, correction bias (E,) or NULL, scratch
    Py_ssize_t n_group, topk_group
    const float *bias
    float *gscore
    int32_t *gids


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

cdef void _keep_groups(float *key, const float *gscore, Py_ssize_t E, Py_ssize_t n_group,
                       Py_ssize_t topk_group, int32_t *gids, float masked) noexcept nogil:
    """key[e] = masked for every expert outside the topk_group groups of largest gscore
    (n_group groups of E / n_group consecutive experts; ties -> lower group)."""
    cdef Py_ssize_t g, e, size = E // n_group
    cdef bint keep
    _select_topk(gscore, n_group, topk_group, gids)
    for g in range(n_group):
        keep = False
        for e in range(topk_group):
            if gids[e] == g:
                keep = True
        if not keep:
            for e in range(g * size, (g + 1) * size):
                key[e] = masked


cdef void _route_softmax_group(const float *l, Py_ssize_t E, Py_ssize_t k, Py_ssize_t n_group,
                               Py_ssize_t topk_group, float *p, float *key, float *gscore,
                               int32_t *gids, int32_t *ids, float *w) noexcept nogil:
    """DeepSeek-V2 group_limited_greedy: p = softmax over all E; a group's score is its
    largest p; the experts outside the topk_group best groups get p = 0; top-k of that;
    weights = those p (no renormalisation)."""
    cdef Py_ssize_t g, e, j, size = E // n_group
    cdef float m
    _softmax(l, E, p)
    for g in range(n_group):
        m = p[g * size]
        for e in range(g * size + 1, (g + 1) * size):
            if p[e] > m:
                m = p[e]
        gscore[g] = m
    for e in range(E):
        key[e] = p[e]
    _keep_groups(key, gscore, E, n_group, topk_group, gids, 0.0)
    _select_topk(key, E, k, ids)
    for j in range(k):
        w[j] = key[ids[j]]


cdef void _route_sigmoid_group(const float *l, Py_ssize_t E, Py_ssize_t k, Py_ssize_t n_group,
                               Py_ssize_t topk_group, const float *bias, bint norm, float *p,
                               float *key, float *gscore, int32_t *gids, int32_t *ids,
                               float *w) noexcept nogil:
    """DeepSeek-V3 / GLM-4-MoE: s = sigmoid(logits), choice c = s + bias; a group's score is
    the sum of its two largest c; the experts outside the topk_group best groups get
    c = -inf; top-k of c; weights = s (not c) of those, divided by (their sum + 1e-20) when
    norm. All in float32, as transformers."""
    cdef Py_ssize_t g, e, j, size = E // n_group
    cdef float a, b, v, s = 0.0
    for e in range(E):
        p[e] = 1.0 / (1.0 + expf(-l[e]))
        key[e] = p[e] + bias[e]
    for g in range(n_group):
        a = key[g * size]                 # the largest and second largest c of the group
        b = -INFINITY
        for e in range(g * size + 1, (g + 1) * size):
            v = key[e]
            if v > a:
                b = a
                a = v
            elif v > b:
                b = v
        gscore[g] = a + b
    _keep_groups(key, gscore, E, n_group, topk_group, gids, -INFINITY)
    _select_topk(key, E, k, ids)
    for j in range(k):
        w[j] = p[ids[j]]
    if norm:
        for j in range(k):
            s += w[j]
        s += <float>1e-20
        for j in range(k):
            w[j] = w[j] / s


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
                       float *key, int32_t *ids, float *w, const RouteJob *job,
                       float *gscore, int32_t *gids) noexcept nogil:
    """One token's routing (see kernels.route_topk); p, key, gscore: scratch of E floats,
    gids of E int32; job: the group rules' settings."""
    cdef const float *sel
    cdef Py_ssize_t e, j, i
    cdef double s = 0.0
    cdef float wj
    cdef int32_t ij
    if noisy:
        for e in range(E):
            key[e] = l[e] + colibri_gumbel(seed, <uint64_t>t, <uint64_t>e)
    if rule == SOFTMAX_GROUP:
        _route_softmax_group(l, E, k, job.n_group, job.topk_group, p, key, gscore, gids,
                             ids, w)
    elif rule == SIGMOID_GROUP:
        _route_sigmoid_group(l, E, k, job.n_group, job.topk_group, job.bias, norm, p, key,
                             gscore, gids, ids, w)
    elif rule == 0:                                 # softmax over all E, then top-k
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




cdef void _route_task(void *ctx, Py_ssize_t t) noexcept nogil:
    cdef const RouteJob *j = <const RouteJob *>ctx
    _route_token(j.logits + t * j.E, j.E, j.k, j.rule, j.norm, j.noisy, j.seed, j.thresh,
                 t, j.p + t * j.E, j.key + t * j.E, j.ids + t * j.k, j.w + t * j.k, j,
                 j.gscore + t * j.E, j.gids + t * j.E)


cdef inline bint _grouped(int rcode) noexcept:
    return rcode == SOFTMAX_GROUP or rcode == SIGMOID_GROUP


cdef object _group_settings(int rcode, Py_ssize_t E, Py_ssize_t k, bias, Py_ssize_t n_group,
                           Py_ssize_t topk_group):
    """Check a group rule's settings against E and k; the bias as a float32 (E,) view or
    None. ValueError naming the setting."""
    cdef const float[::1] bv
    if not _grouped(rcode):
        return None
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group = {n_group} must divide the E = {E} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group = {topk_group} must be in 1..n_group = {n_group}")
    if k > topk_group * (E // n_group):
        raise ValueError(f"k = {k} exceeds the {topk_group * (E // n_group)} experts of "
                         f"topk_group = {topk_group} groups of {E // n_group}")
    if rcode == SIGMOID_GROUP:
        if E // n_group < 2:
            raise ValueError(f"sigmoid_group_topk scores a group by its two best experts: "
                             f"groups of {E // n_group} expert (E = {E}, n_group = {n_group})")
        if bias is None:
            raise ValueError("sigmoid_group_topk needs the correction bias (E,)")
        bv = bias
        if bv.shape[0] != E:
            raise ValueError(f"bias has {bv.shape[0]} elements, expected E = {E}")
        return bv
    return None


cdef object _route_run(const float *lp, Py_ssize_t T, Py_ssize_t E, Py_ssize_t k, int rcode,
                       bint norm, bint noisy, uint64_t seed, float thresh, object bias_view,
                       Py_ssize_t n_group, Py_ssize_t topk_group, int threads):
    """The routing of T tokens on the pool: (ids int32 (T, K), weights float32 (T, K))."""
    cdef const float[::1] bv
    ids = np.empty((T, k), dtype=np.int32)
    wts = np.empty((T, k), dtype=np.float32)
    if T == 0:
        return ids, wts
    cdef bint grouped = _grouped(rcode)
    cdef Py_ssize_t blocks = 3 if grouped else 2
    cdef float *scratch = <float *>malloc(blocks * T * E * sizeof(float))
    cdef int32_t *gids = NULL
    if grouped:
        gids = <int32_t *>malloc(T * E * sizeof(int32_t))
    if scratch == NULL or (grouped and gids == NULL):
        free(scratch)
        free(gids)
        raise MemoryError(f"route_topk: no memory for {T} x {E} scratch")
    cdef RouteJob job
    job.logits, job.E, job.k = lp, E, k
    job.rule, job.norm, job.noisy, job.seed = rcode, norm, noisy, seed
    job.thresh = thresh
    job.p, job.key = scratch, scratch + T * E
    job.ids = <int32_t *>colibri_array_data(ids)
    job.w = <float *>colibri_array_data(wts)
    job.n_group, job.topk_group, job.bias = n_group, topk_group, NULL
    job.gscore = scratch + 2 * T * E if grouped else NULL
    job.gids = gids
    if bias_view is not None:
        bv = bias_view
        job.bias = &bv[0]
    try:
        with nogil:
            colibri_pool_run(_team(<double>T * E * 64, threads), _route_task, &job, T)
    finally:
        free(scratch)
        free(gids)
    return ids, wts


cdef float _sparsemixer_threshold(str rule, Py_ssize_t k, double jitter_eps) except? -1:
    """2 * jitter_eps in f32 (the threshold torch compares against), checked for the rule."""
    if rule == "sparsemixer" and k != 2:
        raise ValueError(f"rule 'sparsemixer' routes to k = 2 experts, got k = {k}")
    if not jitter_eps >= 0:
        raise ValueError(f"jitter_eps must be >= 0, got {jitter_eps!r}")
    return <float>(2.0 * jitter_eps)


def route_topk(const float[:, ::1] logits, Py_ssize_t k, str rule, bint norm_topk_prob,
               noise_seed, int threads, bias=None, Py_ssize_t n_group=1,
               Py_ssize_t topk_group=1, double jitter_eps=0.0):
    """ids int32 (T, K), weights float32 (T, K) from logits float32 (T, E); the group rules
    take n_group, topk_group and (sigmoid_group_topk) bias float32 (E,), sparsemixer
    jitter_eps."""
    _check_threads(threads)
    cdef Py_ssize_t T = logits.shape[0], E = logits.shape[1]
    if rule not in RULES:
        raise ValueError(f"unknown routing rule {rule!r}; expected one of {', '.join(RULES)}")
    cdef int rcode = RULES[rule]
    if E < 1 or not 1 <= k <= E:
        raise ValueError(f"k = {k} must be in 1..E, with E = {E} experts")
    bias_view = _group_settings(rcode, E, k, bias, n_group, topk_group)
    cdef float thresh = _sparsemixer_threshold(rule, k, jitter_eps)
    cdef bint noisy = noise_seed is not None
    if noisy and (_grouped(rcode) or rcode == 2):
        raise ValueError(f"routing rule {rule!r} takes no noise_seed")
    arr = np.asarray(logits)
    if T and np.isnan(arr).any():
        bad = np.argwhere(np.isnan(arr))[0]
        raise ValueError(f"logits contain NaN (first at token {bad[0]}, expert {bad[1]})")
    cdef uint64_t seed = (int(noise_seed) & 0xFFFFFFFFFFFFFFFF) if noisy else 0
    if T == 0:
        return np.empty((0, k), dtype=np.int32), np.empty((0, k), dtype=np.float32)
    return _route_run(&logits[0, 0], T, E, k, rcode, norm_topk_prob, noisy, seed, thresh,
                      bias_view,
                      n_group, topk_group, threads)
