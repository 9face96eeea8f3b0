# colibri/pyx/csrc.pxi: the C layer's declarations (_simd.h and csrc/: the row kernels,
# GEMM and dispatch; decode attention; the thread pool). Included by _kernels.pyx.

cdef extern from "_simd.h" nogil:
    enum:
        COLIBRI_ISA_SCALAR
        COLIBRI_ISA_AVX2
        COLIBRI_ISA_AVX512
        COLIBRI_ISA_AVXVNNI
        COLIBRI_ISA_AVX512VNNI
        COLIBRI_N_ISA
        COLIBRI_F32
        COLIBRI_F16
        COLIBRI_BF16
        COLIBRI_Q8
        COLIBRI_Q4
        COLIBRI_MXFP4
        COLIBRI_MAX_NT
        COLIBRI_INT8_NT
        COLIBRI_SM_MAX_NT
    ctypedef void (*colibri_dot_fn)(const uint8_t *row0, Py_ssize_t row_stride,
                                    Py_ssize_t nrows, Py_ssize_t cols, Py_ssize_t group,
                                    const float *x, Py_ssize_t x_stride,
                                    const float *xsum, Py_ssize_t xsum_stride,
                                    int nt, float *out, Py_ssize_t out_stride) noexcept nogil
    int colibri_isa_supported(int isa)
    int colibri_isa_best()
    colibri_dot_fn colibri_dot_for(int isa, int fmt)
    ctypedef void (*colibri_idot_fn)(const uint8_t *row0, Py_ssize_t row_stride,
                                     Py_ssize_t nrows, Py_ssize_t cols, Py_ssize_t group,
                                     const int8_t *q, Py_ssize_t q_stride, const float *d,
                                     const int32_t *s, Py_ssize_t d_stride, int nt, float *out,
                                     Py_ssize_t out_stride) noexcept nogil
    colibri_idot_fn colibri_idot_for(int isa, int fmt, int wide)
    Py_ssize_t colibri_act_row_bytes(int wide, Py_ssize_t cols)
    void colibri_quantize_act(int isa, int wide, const float *x, Py_ssize_t b0, Py_ssize_t b1,
                              int8_t *q, float *d, int32_t *s)
    void colibri_quantize_pad(int wide, Py_ssize_t cols, int8_t *q, float *d, int32_t *s,
                              Py_ssize_t npad)
    void colibri_quantize_plain(int isa, int wide, const float *x, Py_ssize_t cols, void *q,
                                float *d)
    void colibri_quantize_row(int isa, int wide, const float *x, Py_ssize_t cols, int8_t *q,
                              float *d, int32_t *s, Py_ssize_t npad)
    int colibri_block_tokens(int fmt)
    int colibri_idot_block(int isa, int fmt, int wide)
    int colibri_idot_small_m(int isa, int fmt, int wide)
    uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
    void colibri_decode_row(int fmt, const uint8_t *row, Py_ssize_t cols, Py_ssize_t group,
                            float *out)
    void colibri_group_sums(const float *x, Py_ssize_t cols, Py_ssize_t group, float *xsum)
    float colibri_silu(float g)
    void colibri_silu_mul(int isa, float *h, const float *u, Py_ssize_t n)
    float colibri_gumbel(uint64_t seed, uint64_t t, uint64_t e)
    enum:
        COLIBRI_GEMM_NR
        COLIBRI_GEMM_NB
        COLIBRI_GEMM_SCRATCH
    ctypedef void (*colibri_gemm_fn)(const uint8_t *row0, Py_ssize_t row_stride, int nr,
                                     Py_ssize_t cols, Py_ssize_t group, const float *x,
                                     Py_ssize_t xs, Py_ssize_t n, float *y, Py_ssize_t ys,
                                     float *panel) noexcept nogil
    colibri_gemm_fn colibri_gemm_for(int isa, int fmt)
    enum:
        COLIBRI_IGEMM_NR
        COLIBRI_IGEMM_NB
        COLIBRI_IGEMM_SCRATCH
    ctypedef void (*colibri_igemm_fn)(const uint8_t *row0, Py_ssize_t rs, int nr,
                                      Py_ssize_t cols, Py_ssize_t group, const int8_t *q,
                                      Py_ssize_t qs, const float *d, const int32_t *s,
                                      Py_ssize_t ds, Py_ssize_t n, float *y, Py_ssize_t ys,
                                      float *scratch) noexcept nogil
    colibri_igemm_fn colibri_igemm_for(int isa, int fmt, int wide)
    Py_ssize_t colibri_igemm_crossover(int isa, int wide)
    int colibri_amx_selfcheck_drill(int corrupt)
    const char *colibri_isa_why_not(int isa)
    int colibri_amx_min_tokens

cdef extern from "csrc/attend.h" nogil:
    void colibri_attend(int isa, int fmt, const float *q, int G, int Dh, const void *k,
                        const void *v, Py_ssize_t hs, Py_ssize_t rs, Py_ssize_t n, float scale,
                        float *s, float *out, int h0, int h1)
    void colibri_attend_sinks(int isa, int fmt, const float *q, int G, int Dh, const void *k,
                              const void *v, Py_ssize_t hs, Py_ssize_t rs, Py_ssize_t n,
                              float scale, const float *sinks, float *s, float *out, int h0,
                              int h1)
    void colibri_kv_store(int fmt, void *dst, const float *src, Py_ssize_t n)
    void colibri_kv_widen(int isa, int fmt, const void *src, Py_ssize_t rb, Py_ssize_t rows,
                          Py_ssize_t cols, float *dst)

# The thread pool (csrc/pool.h): colibri_pool_run(nth, fn, ctx, n) calls fn(ctx, i) for i < n on
# up to nth threads and returns when all have returned; colibri_worker_num() is the running
# thread's number (0..nth-1), which picks its slice of per-thread scratch.
cdef extern from "csrc/pool.h" nogil:
    ctypedef void (*colibri_task_fn)(void *ctx, Py_ssize_t item) noexcept nogil
    void colibri_pool_run(int nth, colibri_task_fn fn, void *ctx, Py_ssize_t n)
    int colibri_worker_num()
    int colibri_pool_threaded()
    int colibri_pool_spin_us
    long colibri_pool_backoffs
    long colibri_pool_worker_items
    enum:
        COLIBRI_POOL_MAX_THREADS
