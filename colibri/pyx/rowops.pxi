# colibri/pyx/rowops.pxi: a decode step's row operations (csrc/rowops.h: RMSNorm of rows, RoPE
# of heads in place) and attend_cached. Their arrays, and those of the prepared calls
# (prepared.pxi), are checked through NumPy's C API (type, dtype, byte order, alignment, C
# order, writability, shapes): a decode step passes ~150 arrays, and a typed memoryview costs
# ~1 us of buffer-protocol code per array.

cdef extern from "csrc/npy.h":
    int colibri_npy_import() except -1
    float *colibri_f32_array(object a, int ndim, int writable, Py_ssize_t *dims)
    void *colibri_kv_array(object a, int ndim, int writable, Py_ssize_t *dims, int *fmt)
    void *colibri_array_data(object a)

colibri_npy_import()

cdef extern from "csrc/rowops.h" nogil:
    void colibri_rms_norm_rows(const float *x, Py_ssize_t xs, Py_ssize_t rows, Py_ssize_t n,
                               const float *weight, float eps, float *out, Py_ssize_t os)
    void colibri_rope_rows(float *x, Py_ssize_t xs, Py_ssize_t rows, Py_ssize_t h,
                           const float *c, const float *s)


cdef str _found(a):
    return (f"{getattr(a, 'dtype', type(a).__name__)} with shape {getattr(a, 'shape', None)}"
            + (" (not C-contiguous)" if isinstance(a, np.ndarray) and not a.flags.c_contiguous
               else "") + (" (read-only)" if isinstance(a, np.ndarray)
                           and not a.flags.writeable else ""))


cdef float *_f32(object a, str name, int ndim, bint writable, Py_ssize_t *dims) except NULL:
    """The data of a, an aligned native-order C-contiguous float32 ndarray of ndim dimensions
    (writable if asked), its shape in dims; else ValueError naming what was expected and
    found. The caller holds a reference to a while it uses the pointer."""
    cdef float *p = colibri_f32_array(a, ndim, writable, dims)
    if p == NULL:
        raise ValueError(f"{name} must be a {'writable ' if writable else ''}C-contiguous "
                         f"float32 array of {ndim} dimension{'s' if ndim > 1 else ''}, found "
                         f"{_found(a)}")
    return p


cdef void *_kv(object a, str name, int ndim, Py_ssize_t *dims, int *fmt) except NULL:
    """The data of a, a writable aligned native-order C-contiguous cache plane of float32,
    float16 or uint16 (bf16 bits) of ndim dimensions, its shape in dims and its storage
    format in fmt; else ValueError naming what was expected and found."""
    cdef void *p = colibri_kv_array(a, ndim, 1, dims, fmt)
    if p == NULL:
        raise ValueError(f"{name} must be a writable C-contiguous float32, float16 or uint16 "
                         f"(bf16) array of {ndim} dimensions, found {_found(a)}")
    return p


cdef bint _overlap(const float *a, Py_ssize_t na, const float *b, Py_ssize_t nb) noexcept:
    return a < b + nb and b < a + na


cdef bint _overlap_bytes(const void *a, Py_ssize_t na, const void *b, Py_ssize_t nb) noexcept:
    return <const char *>a < <const char *>b + nb and <const char *>b < <const char *>a + na


def rms_norm_rows(x, weight, float eps, out):
    """out (N, C) = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of x (N, C) float32;
    weight (C,); out may be x itself. NumPy's operations and summation order (csrc/rowops.h)."""
    cdef Py_ssize_t xd[2]
    cdef Py_ssize_t wd[1]
    cdef Py_ssize_t od[2]
    cdef const float *x0 = _f32(x, "x", 2, False, xd)
    cdef const float *w0 = _f32(weight, "weight", 1, False, wd)
    cdef float *o0 = _f32(out, "out", 2, True, od)
    cdef Py_ssize_t N = xd[0], C = xd[1]
    if wd[0] != C:
        raise ValueError(f"rms_norm_rows: weight has {wd[0]} elements, expected {C} "
                         f"(the columns of x, shape ({N}, {C}))")
    if od[0] != N or od[1] != C:
        raise ValueError(f"rms_norm_rows: out has shape ({od[0]}, {od[1]}), "
                         f"expected ({N}, {C})")
    if x0 != o0 and _overlap(x0, N * C, o0, N * C):
        raise ValueError("rms_norm_rows: out overlaps x without being x")
    if N == 0 or C == 0:
        return
    colibri_rms_norm_rows(x0, C, N, C, w0, eps, o0, C)     # a few rows: the GIL is kept


def rope_rows(x, cos, sin):
    """Rotate each row of x (N, Dh) float32 in place by the half-split rule on its first
    2h columns, h = len(cos) = len(sin) (<= Dh / 2): x[:h], x[h:2h] = x[:h] cos - x[h:2h] sin,
    x[h:2h] cos + x[:h] sin (NumPy's float32 operations, csrc/rowops.h)."""
    cdef Py_ssize_t xd[2]
    cdef Py_ssize_t cd[1]
    cdef Py_ssize_t sd[1]
    cdef float *x0 = _f32(x, "x", 2, True, xd)
    cdef const float *c0 = _f32(cos, "cos", 1, False, cd)
    cdef const float *s0 = _f32(sin, "sin", 1, False, sd)
    cdef Py_ssize_t N = xd[0], Dh = xd[1], h = cd[0]
    if sd[0] != h or 2 * h > Dh:
        raise ValueError(f"rope_rows: cos ({h},) and sin ({sd[0]},) must have the same "
                         f"length h with 2h <= {Dh} (the columns of x, shape ({N}, {Dh}))")
    if _overlap(x0, N * Dh, c0, h) or _overlap(x0, N * Dh, s0, h):
        raise ValueError("rope_rows: cos / sin overlap x")
    if N == 0 or h == 0:
        return
    colibri_rope_rows(x0, Dh, N, h, c0, s0)     # a few rows: the GIL is kept


def attend_cached(q, k_cache, v_cache, k_new, v_new, Py_ssize_t slot, Py_ssize_t start,
                  float scale, out, int threads):
    """KVCache.write_one then attend_decode, in one call: k_new / v_new (Hkv, Dh) go to
    slot `slot` of sequence 0 of k_cache / v_cache (B, Hkv, S, Dh), rounded to the caches'
    storage dtype (to nearest, ties to even), then out (H, Dh) = attention of q (H, Dh) over
    slots start..slot (the same kernel and bits as attend_decode over that slice). The
    caches float32, float16 or uint16 (bf16 bits), both the same; everything else float32;
    all C-contiguous; 0 <= start <= slot < S."""
    _attend_cached(q, k_cache, v_cache, k_new, v_new, slot, start, scale, out, threads, NULL)


def attend_cached_sinks(q, k_cache, v_cache, k_new, v_new, Py_ssize_t slot,
                        Py_ssize_t start, float scale, sinks, out, int threads):
    """attend_cached with attention sinks (GPT-OSS): sinks float32 (H,), one logit per query
    head in its softmax whose value row is zero (csrc/attend.h): out_h = (sum_j e_j v_j) /
    (sum_j e_j + exp(sinks[h] - max_j s_j)). Everything else as attend_cached."""
    cdef Py_ssize_t sd[1]
    cdef const float *sp = _f32(sinks, "sinks", 1, False, sd)
    if sd[0] != np.shape(q)[0]:
        raise ValueError(f"attend_cached_sinks: sinks has {sd[0]} elements, expected one per "
                         f"query head ({np.shape(q)[0]})")
    _attend_cached(q, k_cache, v_cache, k_new, v_new, slot, start, scale, out, threads, sp)


cdef _attend_cached(q, k_cache, v_cache, k_new, v_new, Py_ssize_t slot, Py_ssize_t start,
                    float scale, out, int threads, const float *sinks):
    """attend_cached's checks and work; sinks H floats or NULL."""
    _check_threads(threads)
    cdef Py_ssize_t qd[2]
    cdef Py_ssize_t kd[4]
    cdef Py_ssize_t vd[4]
    cdef Py_ssize_t knd[2]
    cdef Py_ssize_t vnd[2]
    cdef Py_ssize_t od[2]
    cdef int kfmt, vfmt
    cdef const float *qp = _f32(q, "q", 2, False, qd)
    cdef char *kc = <char *>_kv(k_cache, "k_cache", 4, kd, &kfmt)
    cdef char *vc = <char *>_kv(v_cache, "v_cache", 4, vd, &vfmt)
    cdef const float *knp = _f32(k_new, "k_new", 2, False, knd)
    cdef const float *vnp = _f32(v_new, "v_new", 2, False, vnd)
    cdef float *op = _f32(out, "out", 2, True, od)
    cdef Py_ssize_t H = qd[0], Dh = qd[1], Hkv = kd[1], S = kd[2]
    cdef Py_ssize_t n = slot + 1 - start, g, i
    cdef Py_ssize_t es = 4 if kfmt == COLIBRI_F32 else 2
    if vfmt != kfmt:
        raise ValueError(f"attend_cached: v_cache ({v_cache.dtype}) and k_cache "
                         f"({k_cache.dtype}) differ in dtype")
    for i in range(4):
        if vd[i] != kd[i]:
            raise ValueError(f"attend_cached: v_cache {v_cache.shape} and k_cache "
                             f"{k_cache.shape} differ")
    if (kd[0] < 1 or kd[3] != Dh or knd[0] != Hkv or knd[1] != Dh or vnd[0] != Hkv
            or vnd[1] != Dh):
        raise ValueError(f"attend_cached: k_cache {k_cache.shape} must be (B >= 1, Hkv, S, "
                         f"{Dh}) and k_new {k_new.shape}, v_new {v_new.shape} (Hkv, {Dh}) "
                         f"for q of shape ({H}, {Dh})")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"attend_cached: {H} query heads are not a multiple of {Hkv} kv heads")
    if not 0 <= start <= slot < S:
        raise ValueError(f"attend_cached: slots {start}..{slot} are not inside the cache's "
                         f"{S} slots (0 <= start <= slot < S)")
    if od[0] != H or od[1] != Dh:
        raise ValueError(f"attend_cached: out has shape ({od[0]}, {od[1]}), "
                         f"expected ({H}, {Dh})")
    cdef Py_ssize_t plane = Hkv * S * Dh * es             # bytes of one sequence's (Hkv, S, Dh)
    cdef Py_ssize_t ob = 4 * H * Dh, nb = 4 * Hkv * Dh
    if (_overlap(op, H * Dh, qp, H * Dh) or _overlap_bytes(op, ob, kc, plane)
            or _overlap_bytes(op, ob, vc, plane) or _overlap_bytes(kc, plane, vc, plane)
            or _overlap_bytes(knp, nb, kc, plane) or _overlap_bytes(vnp, nb, vc, plane)):
        raise ValueError("attend_cached: out, q, the new rows and the caches must not overlap")
    if Dh == 0:
        return
    for g in range(Hkv):                                  # the new token's key and value
        colibri_kv_store(kfmt, kc + (g * S + slot) * Dh * es, knp + g * Dh, Dh)
        colibri_kv_store(kfmt, vc + (g * S + slot) * Dh * es, vnp + g * Dh, Dh)
    _attend_run(kfmt, qp, kc + start * Dh * es, vc + start * Dh * es, op, S * Dh, Dh, n, H,
                Hkv, Dh, scale, threads, "attend_cached", sinks)
