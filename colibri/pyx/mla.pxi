# colibri/pyx/mla.pxi: the absorbed decode step of latent attention (DeepSeek MLA,
# csrc/mla.h) on the file's own kv_b: PreparedMLA, one nogil call per layer and token.

cdef extern from "csrc/mla.h" nogil:
    enum:
        COLIBRI_MLA_MAX_HEADS
        COLIBRI_GEMM_KC
    void colibri_tmv(int isa, int fmt, const uint8_t *row0, Py_ssize_t rs, Py_ssize_t n,
                     Py_ssize_t cols, Py_ssize_t group, const float *q, float *out,
                     float *panel)
    void colibri_mla_attend(int isa, int fmt, const float *ql, const float *qr, int R, int Dr,
                            const void *lat, const void *rot, Py_ssize_t n, float scale,
                            float *s, float *ol, int nh)


ctypedef struct MlaJob:
    # work item c = query heads c * hper .. min(H, (c + 1) * hper)
    const Wmat *w               # kv_b (H*(Dn+Dv), R), f32 activations
    const float *q              # (H, qs): q_nope in the first Dn columns
    const float *qr             # (H, Dr) rotated
    const void *lat             # latent rows (n, R), cache format fmt
    const void *rot             # rotary rows (n, Dr)
    float *ql                   # (H, R) the absorbed queries
    float *ol                   # (H, R) the attention-weighted latents
    float *out                  # (H, Dv)
    float *scratch              # per worker: panel, xsum, scores (per_worker floats each)
    Py_ssize_t per_worker, qs, n, H, Dn, Dv, R, Dr, hper, xsum_pad
    int isa, fmt
    float scale


cdef void _mla_task(void *ctx, Py_ssize_t c) noexcept nogil:
    cdef const MlaJob *j = <const MlaJob *>ctx
    cdef const Wmat *w = j.w
    cdef Py_ssize_t h0 = c * j.hper, h1 = h0 + j.hper, h, R = j.R, rs = w.row_stride
    if h1 > j.H:
        h1 = j.H
    cdef float *panel = j.scratch + colibri_worker_num() * j.per_worker
    cdef float *xsum = panel + COLIBRI_GEMM_NR * COLIBRI_GEMM_KC
    cdef float *s = xsum + j.xsum_pad
    cdef const uint8_t *head
    for h in range(h0, h1):                            # q_lat[h] = q_nope[h] W_kb[h]
        head = w.base + h * (j.Dn + j.Dv) * rs
        colibri_tmv(j.isa, w.fmt, head, rs, j.Dn, R, w.group, j.q + h * j.qs, j.ql + h * R,
                    panel)
    colibri_mla_attend(j.isa, j.fmt, j.ql + h0 * R, j.qr + h0 * j.Dr, <int>R, <int>j.Dr,
                       j.lat, j.rot, j.n, j.scale, s, j.ol + h0 * R, <int>(h1 - h0))
    for h in range(h0, h1):                            # out[h] = W_vb[h] o_lat[h]
        head = w.base + (h * (j.Dn + j.Dv) + j.Dn) * rs
        if w.xsum_cols:
            colibri_group_sums(j.ol + h * R, R, w.group, xsum)
        w.dot(head, rs, j.Dv, R, w.group, j.ol + h * R, R, xsum, w.xsum_cols, 1,
              j.out + h * j.Dv, j.Dv)


cdef class PreparedMLA:
    """The absorbed MLA decode step with kv_b (H*(Dn+Dv), Rkv) fixed, as a WeightRef of the
    file (any weight format, read in place, f32 activations: the decoded weights exactly):
    `p(q, q_rope, lat_cache, rot_cache, c_new, kr_new, slot, scale, out)` writes the new
    latent c_new (1, Rkv) and rotated key kr_new (1, Dr) to slot `slot` of sequence 0 of
    lat_cache (B, 1, S, Rkv) / rot_cache (B, 1, S, Dr) (rounded to their storage dtype:
    float32, float16 or uint16 bf16 bits, both the same), then out (1, H*Dv) = the heads'
    attention over slots 0..slot (csrc/mla.h), from q (H, Dn + Dr) (its first Dn columns:
    q_nope) and q_rope (H, Dr) rotated. Everything else float32 C-contiguous."""
    cdef Wmat m
    cdef object w, keep
    cdef int threads, isa
    cdef readonly Py_ssize_t n_heads, nope_dim, v_dim, kv_rank

    def __init__(self, kv_b, Py_ssize_t n_heads, Py_ssize_t nope_dim, Py_ssize_t v_dim,
                 int threads):
        _check_threads(threads)
        if n_heads < 1 or nope_dim < 1 or v_dim < 1:
            raise ValueError(f"PreparedMLA: n_heads {n_heads}, nope_dim {nope_dim} and v_dim "
                             f"{v_dim} must be >= 1")
        self.w, self.threads = kv_b, threads
        self.n_heads, self.nope_dim, self.v_dim = n_heads, nope_dim, v_dim
        self._load()
        if self.m.rows != n_heads * (nope_dim + v_dim) or self.m.n_experts != 1:
            raise ValueError(f"PreparedMLA: kv_b has {self.m.n_experts} x {self.m.rows} rows, "
                             f"expected one matrix of n_heads * (nope_dim + v_dim) = "
                             f"{n_heads * (nope_dim + v_dim)}")
        self.kv_rank = self.m.cols

    def _load(self):
        self.keep = _load(self.w, "kv_b", &self.m, 0)
        self.isa = _isa

    def __call__(self, q, q_rope, lat_cache, rot_cache, c_new, kr_new, Py_ssize_t slot,
                 float scale, out):
        cdef Py_ssize_t qd[2]
        cdef Py_ssize_t rd[2]
        cdef Py_ssize_t ld[4]
        cdef Py_ssize_t kd[4]
        cdef Py_ssize_t cd[2]
        cdef Py_ssize_t krd[2]
        cdef Py_ssize_t od[2]
        cdef int lfmt, kfmt
        cdef const float *qp = _f32(q, "q", 2, False, qd)
        cdef const float *rp = _f32(q_rope, "q_rope", 2, False, rd)
        cdef char *lc = <char *>_kv(lat_cache, "lat_cache", 4, ld, &lfmt)
        cdef char *kc = <char *>_kv(rot_cache, "rot_cache", 4, kd, &kfmt)
        cdef const float *cp = _f32(c_new, "c_new", 2, False, cd)
        cdef const float *krp = _f32(kr_new, "kr_new", 2, False, krd)
        cdef float *op = _f32(out, "out", 2, True, od)
        cdef Py_ssize_t H = self.n_heads, Dn = self.nope_dim, Dv = self.v_dim
        cdef Py_ssize_t R = self.kv_rank, Dr = rd[1], S = ld[2]
        if qd[0] != H or qd[1] < Dn or rd[0] != H:
            raise ValueError(f"PreparedMLA: q ({qd[0]}, {qd[1]}) and q_rope ({rd[0]}, "
                             f"{rd[1]}) must be ({H}, >= {Dn}) and ({H}, Dr)")
        if lfmt != kfmt:
            raise ValueError(f"PreparedMLA: lat_cache ({lat_cache.dtype}) and rot_cache "
                             f"({rot_cache.dtype}) differ in dtype")
        if ld[0] < 1 or ld[1] != 1 or ld[3] != R or kd[0] != ld[0] or kd[1] != 1 \
                or kd[2] != S or kd[3] != Dr:
            raise ValueError(f"PreparedMLA: lat_cache {lat_cache.shape} and rot_cache "
                             f"{rot_cache.shape} must be (B, 1, S, {R}) and (B, 1, S, {Dr})")
        if cd[0] != 1 or cd[1] != R or krd[0] != 1 or krd[1] != Dr:
            raise ValueError(f"PreparedMLA: c_new ({cd[0]}, {cd[1]}) and kr_new ({krd[0]}, "
                             f"{krd[1]}) must be (1, {R}) and (1, {Dr})")
        if od[0] != 1 or od[1] != H * Dv:
            raise ValueError(f"PreparedMLA: out has shape ({od[0]}, {od[1]}), expected "
                             f"(1, {H * Dv})")
        if not 0 <= slot < S:
            raise ValueError(f"PreparedMLA: slot {slot} is not inside the cache's {S} slots")
        cdef Py_ssize_t es = 4 if lfmt == COLIBRI_F32 else 2
        cdef Py_ssize_t lb = S * R * es, kb = S * Dr * es, ob = 4 * H * Dv
        if (_overlap_bytes(op, ob, qp, 4 * H * qd[1]) or _overlap_bytes(op, ob, rp, 4 * H * Dr)
                or _overlap_bytes(op, ob, lc, lb) or _overlap_bytes(op, ob, kc, kb)
                or _overlap_bytes(lc, lb, kc, kb) or _overlap_bytes(cp, 4 * R, lc, lb)
                or _overlap_bytes(krp, 4 * Dr, kc, kb)):
            raise ValueError("PreparedMLA: out, the queries, the new rows and the caches "
                             "must not overlap")
        if self.isa != _isa:
            self._load()
        cdef Py_ssize_t total = _mla_floats(&self.m, H, Dn, Dv, Dr, slot + 1, es, self.threads)
        cdef char *mem = <char *>malloc(4 * total + 64)
        if mem == NULL:
            raise MemoryError(f"PreparedMLA: no memory for {total} floats of scratch")
        cdef float *base = <float *>(mem + (64 - (<size_t>mem) % 64) % 64)
        try:
            with nogil:
                _mla_core(&self.m, lfmt, qp, qd[1], rp, lc, kc, cp, krp, slot, H, Dn, Dv, Dr,
                          scale, self.threads, base, op)
        finally:
            free(mem)


cdef inline Py_ssize_t _mla_plan(const Wmat *w, Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dv,
                                 Py_ssize_t Dr, Py_ssize_t n, Py_ssize_t es, int threads,
                                 int *nth, Py_ssize_t *hper, Py_ssize_t *xsum_pad
                                 ) noexcept nogil:
    """The team (nth), heads per work item (hper) and xsum padding of an absorbed step over
    n cached positions (cache element size es); returns the floats of one worker's
    scratch (panel, group sums, scores)."""
    cdef Py_ssize_t R = w.cols
    nth[0] = _team(<double>(H * (Dn + Dv) * w.row_stride + n * (R + Dr) * es), threads)
    if nth[0] > H:
        nth[0] = <int>H
    hper[0] = (H + nth[0] - 1) // nth[0]
    if hper[0] > COLIBRI_MLA_MAX_HEADS:
        hper[0] = COLIBRI_MLA_MAX_HEADS
    xsum_pad[0] = (R // 32 + 16) // 16 * 16
    return COLIBRI_GEMM_NR * COLIBRI_GEMM_KC + xsum_pad[0] + (hper[0] * n + 15) // 16 * 16


cdef Py_ssize_t _mla_floats(const Wmat *w, Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dv,
                            Py_ssize_t Dr, Py_ssize_t n, Py_ssize_t es,
                            int threads) noexcept nogil:
    """Floats of scratch _mla_core needs over n positions (from a 64-aligned base)."""
    cdef int nth
    cdef Py_ssize_t hper, xsum_pad
    cdef Py_ssize_t per = _mla_plan(w, H, Dn, Dv, Dr, n, es, threads, &nth, &hper, &xsum_pad)
    return nth * per + 2 * H * w.cols + 16


cdef void _mla_core(const Wmat *w, int fmt, const float *q, Py_ssize_t qs, const float *qr,
                    char *lc, char *kc, const float *c_new, const float *kr_new,
                    Py_ssize_t slot, Py_ssize_t H, Py_ssize_t Dn, Py_ssize_t Dv, Py_ssize_t Dr,
                    float scale, int threads, float *base, float *out) noexcept nogil:
    """PreparedMLA's work once its arguments are checked (the compiled decode step's MLA
    too): c_new (Rkv,) and kr_new (Dr,) stored to slot `slot` of sequence 0's latent plane lc
    (S, Rkv) and rotary plane kc (S, Dr) (storage format fmt), then out (H*Dv) = the heads'
    attention over slots 0..slot from q (H, qs) (q_nope its first Dn columns) and qr (H, Dr);
    base: _mla_floats(...) floats, 64-aligned."""
    cdef Py_ssize_t R = w.cols, es = 4 if fmt == COLIBRI_F32 else 2, n = slot + 1
    colibri_kv_store(fmt, lc + slot * R * es, c_new, R)         # the new token's rows
    colibri_kv_store(fmt, kc + slot * Dr * es, kr_new, Dr)
    cdef int nth
    cdef Py_ssize_t hper, xsum_pad
    cdef Py_ssize_t per = _mla_plan(w, H, Dn, Dv, Dr, n, es, threads, &nth, &hper, &xsum_pad)
    cdef Py_ssize_t items = (H + hper - 1) // hper
    cdef MlaJob job
    job.w, job.q, job.qr, job.lat, job.rot = w, q, qr, lc, kc
    job.scratch, job.ql, job.ol, job.out = base, base + nth * per, base + nth * per + H * R, out
    job.per_worker, job.qs, job.n, job.H, job.Dn, job.Dv = per, qs, n, H, Dn, Dv
    job.R, job.Dr, job.hper, job.xsum_pad = R, Dr, hper, xsum_pad
    job.isa, job.fmt, job.scale = _isa, fmt, scale
    colibri_pool_run(nth, _mla_task, &job, items)
