/* colibri/csrc/attend.h: attention of one new token over a KV cache (the decode step).
 *
 * For query head h, with kv head g = h / G (G query heads per kv head):
 *   s_j   = scale * (q_h . k_g,j)                      j = 0 .. n-1
 *   e_j   = exp(s_j - max_j s_j)
 *   out_h = (sum_j e_j v_g,j) / sum_j e_j
 * q: (H, Dh) float rows; key j of kv head g at element g * hs + j * rs of k (the same for v),
 * so a cache slice with strided heads and positions is read in place; s: G * n floats of
 * scratch. The cache's elements are of storage format fmt: COLIBRI_F32, COLIBRI_F16 or
 * COLIBRI_BF16 (types.h's codes), widened exactly as they are loaded (vcvtph2ps; bf16 by a
 * 16-bit shift); everything is computed in float32. The kernel knows elements and strides
 * only: which positions are attended (a sliding window, the slots of the cache) is the
 * caller's choice of k, v and n.
 *
 * Scalar: dot products and sums in index order, libm expf. AVX2: 8-lane partial sums and an
 * exp polynomial (Cephes' expf, ~1 ulp); AVX-512: 16-lane sums, the same polynomial. The
 * paths agree to ~1e-6 relative, not bit for bit; each gives the same bits for any thread
 * count (a head is one call's work).
 * A NaN or inf in q or k gives NaN scores and a NaN head, as in NumPy.
 *
 * Attention sinks (GPT-OSS; the *_sinks entries, sinks non-NULL): head h's softmax has one
 * more logit z_h whose value row is zero, so
 *   out_h = (sum_j e_j v_g,j) / (sum_j e_j + exp(z_h - max_j s_j))
 * (the same sum as with max(max_j s_j, z_h) subtracted, exp(z - m) overflowing to inf giving
 * the limit 0); a NULL sinks is the plain softmax, the same bits as before.
 *
 * colibri_kv_store rounds float32 rows into the storage format (to nearest, ties to even,
 * as NumPy's float16 cast and quant.f32_to_bf16 round): the decode step's cache write, the
 * same bits on every path.
 */
#ifndef COLIBRI_ATTEND_H
#define COLIBRI_ATTEND_H

#include "avx512.h"  /* the path codes, COLIBRI_AVX2_FN / AVX512_FN, colibri_exp_neg_avx2 */

/* Query heads per kv head the AVX2 body handles (more: the scalar body). */
#define COLIBRI_ATTEND_MAX_G 64

/* Bytes of one cache element of format fmt. */
static inline ptrdiff_t colibri_kv_size(int fmt) { return fmt == COLIBRI_F32 ? 4 : 2; }

/* float32 -> IEEE half bits, to nearest, ties to even: overflow (|x| >= 65520) to inf,
 * subnormal halves below 2^-14, NaN kept NaN (quiet, top payload bits), integer operations
 * only (no dependence on the FPU's modes). */
static inline uint16_t colibri_f32_to_f16(float f)
{
    uint32_t x, ax, sign;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);            /* inf */
    if (ax < 0x38800000u) {                                /* below 2^-14: a subnormal half */
        uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, r, rem, half;
        int shift;
        if (ax < 0x33000000u) return (uint16_t)sign;       /* below 2^-25: 0 (2^-25 ties to 0) */
        shift = 126 - (int)e;                              /* 14 .. 24 */
        r = m >> shift;
        rem = m & ((1u << shift) - 1u);
        half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);                       /* r == 0x400: the least normal */
    }
    ax -= (uint32_t)(127 - 15) << 23;                      /* rebias, then round 23 -> 10 bits */
    return (uint16_t)(sign | ((ax + 0xFFFu + ((ax >> 13) & 1u)) >> 13));
}

/* float32 -> bf16 bits, to nearest, ties to even; NaN kept NaN (quiet bit set). */
static inline uint16_t colibri_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x0040u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* n floats of src into n elements of format fmt at dst (rounded as above). */
static inline void colibri_kv_store(int fmt, void *dst, const float *src, ptrdiff_t n)
{
    ptrdiff_t i;
    if (fmt == COLIBRI_F32) { memcpy(dst, src, 4 * (size_t)n); return; }
    for (i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = fmt == COLIBRI_F16 ? colibri_f32_to_f16(src[i])
                                                  : colibri_f32_to_bf16(src[i]);
}

/* Element i of a cache row of format fmt, as float (exact). */
static inline float colibri_kv_elem(int fmt, const void *p, ptrdiff_t i)
{
    if (fmt == COLIBRI_F32) return ((const float *)p)[i];
    if (fmt == COLIBRI_F16) return colibri_f16_to_f32(((const uint16_t *)p)[i]);
    return colibri_bf16_to_f32(((const uint16_t *)p)[i]);
}

/* rows x cols elements of format fmt (row r at src + r * rb bytes) into dst (rows x cols
 * floats, contiguous), exactly: what the NumPy paths read of a 16-bit cache (kv_cache.to_f32;
 * NumPy's own float16 cast costs ~1 ns an element, 6x this). */
static void colibri_kv_widen_scalar(int fmt, const char *src, ptrdiff_t rb, ptrdiff_t rows,
                                    ptrdiff_t cols, float *dst)
{
    ptrdiff_t r, i;
    for (r = 0; r < rows; r++)
        for (i = 0; i < cols; i++)
            dst[r * cols + i] = colibri_kv_elem(fmt, src + r * rb, i);
}

static void colibri_attend_scalar(int fmt, const float *q, int G, int Dh, const void *k,
                                  const void *v, ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n,
                                  float scale, const float *sinks, float *s, float *out,
                                  int h0, int h1)
{
    const ptrdiff_t es = colibri_kv_size(fmt);
    int h, i;
    ptrdiff_t j;
    for (h = h0; h < h1; h++) {
        const float *qh = q + (ptrdiff_t)h * Dh;
        const char *kg = (const char *)k + (h / G) * hs * es;
        const char *vg = (const char *)v + (h / G) * hs * es;
        float *oh = out + (ptrdiff_t)h * Dh;
        float m = -INFINITY, sum = 0.0f, inv;
        for (j = 0; j < n; j++) {
            const char *kj = kg + j * rs * es;
            float d = 0.0f;
            for (i = 0; i < Dh; i++) d += qh[i] * colibri_kv_elem(fmt, kj, i);
            s[j] = d * scale;
            m = s[j] > m || s[j] != s[j] ? s[j] : m;         /* a NaN score wins */
        }
        for (j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        if (sinks) sum += expf(sinks[h] - m);
        inv = 1.0f / sum;
        for (i = 0; i < Dh; i++) oh[i] = 0.0f;
        for (j = 0; j < n; j++) {
            const char *vj = vg + j * rs * es;
            for (i = 0; i < Dh; i++) oh[i] += s[j] * colibri_kv_elem(fmt, vj, i);
        }
        for (i = 0; i < Dh; i++) oh[i] *= inv;
    }
}

#if COLIBRI_X86

/* Elements i .. i + 7 of a cache row (bytes at p) of format fmt, widened to float32. */
COLIBRI_AVX2_INLINE __m256 colibri_kv_load8(const int fmt, const char *p, ptrdiff_t i)
{
    __m128i h;
    if (fmt == COLIBRI_F32) return _mm256_loadu_ps((const float *)(const void *)p + i);
    h = _mm_loadu_si128((const __m128i *)(const void *)(p + 2 * i));
    if (fmt == COLIBRI_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX2_FN void colibri_kv_widen_avx2(int fmt, const char *src, ptrdiff_t rb,
                                           ptrdiff_t rows, ptrdiff_t cols, float *dst)
{
    ptrdiff_t r, i;
    for (r = 0; r < rows; r++) {
        const char *row = src + r * rb;
        float *d = dst + r * cols;
        if (fmt == COLIBRI_F16)
            for (i = 0; i + 8 <= cols; i += 8)
                _mm256_storeu_ps(d + i, colibri_kv_load8(COLIBRI_F16, row, i));
        else
            for (i = 0; i + 8 <= cols; i += 8)
                _mm256_storeu_ps(d + i, colibri_kv_load8(COLIBRI_BF16, row, i));
        for (; i < cols; i++) d[i] = colibri_kv_elem(fmt, row, i);
    }
}

/* 8 dot products q . k_j (j = 0..7, rows rb bytes apart), Dh a multiple of 8, times scale:
 * one horizontal reduction for the 8 (two hadd levels, then the 128-bit halves summed). */
COLIBRI_AVX2_INLINE __m256 colibri_scores8_avx2(const int fmt, const float *q, const char *k,
                                                ptrdiff_t rb, int Dh, float scale)
{
    __m256 a[8], t0, t2;
    int l, i;
    for (l = 0; l < 8; l++) a[l] = _mm256_setzero_ps();
    for (i = 0; i < Dh; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (l = 0; l < 8; l++)
            a[l] = _mm256_fmadd_ps(qv, colibri_kv_load8(fmt, k + l * rb, i), a[l]);
    }
    t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    t2 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                                       _mm256_permute2f128_ps(t0, t2, 0x31)),
                         _mm256_set1_ps(scale));
}

/* One dot product q . k (Dh a multiple of 8), times scale. */
COLIBRI_AVX2_INLINE float colibri_score1_avx2(const int fmt, const float *q, const char *k,
                                              int Dh, float scale)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i;
    for (i = 0; i + 16 <= Dh; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), colibri_kv_load8(fmt, k, i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), colibri_kv_load8(fmt, k, i + 8), a1);
    }
    if (i < Dh) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), colibri_kv_load8(fmt, k, i), a0);
    return colibri_hsum256(_mm256_add_ps(a0, a1)) * scale;
}

/* s[0..n) = exp(s - max s) (NaN everywhere if a score is NaN); returns their sum, and the
 * max (NaN if a score is) in *max. */
COLIBRI_AVX2_INLINE float colibri_softmax_num_max_avx2(float *s, ptrdiff_t n, float *max)
{
    __m256 vm = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
    __m256 nanv = _mm256_setzero_ps();
    float m;
    int bad = 0;
    ptrdiff_t j;
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(s + j);
        vm = _mm256_max_ps(vm, x);
        nanv = _mm256_or_ps(nanv, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    {
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        m = _mm_cvtss_f32(m4);
    }
    for (; j < n; j++) {
        m = s[j] > m ? s[j] : m;
        bad |= s[j] != s[j];
    }
    if (bad || _mm256_movemask_ps(nanv) != 0) m = NAN;
    *max = m;
    {
        const __m256 mv = _mm256_set1_ps(m);
        for (j = 0; j + 8 <= n; j += 8) {
            const __m256 e = colibri_exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
            _mm256_storeu_ps(s + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        if (j < n) {                                       /* the last 1..7 scores */
            float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const int rest = (int)(n - j);
            int i;
            memcpy(tail, s + j, 4 * (size_t)rest);
            _mm256_storeu_ps(tail, colibri_exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(tail), mv)));
            for (i = rest; i < 8; i++) tail[i] = 0.0f;
            memcpy(s + j, tail, 4 * (size_t)rest);
            vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(tail));
        }
    }
    return colibri_hsum256(vsum);
}

COLIBRI_AVX2_INLINE float colibri_softmax_num_avx2(float *s, ptrdiff_t n)
{
    float m;
    return colibri_softmax_num_max_avx2(s, n, &m);
}

/* 1 / the softmax denominator of head h: its numerators' sum, plus the sink's exp(z_h - m)
 * when there are sinks. */
COLIBRI_AVX2_INLINE float colibri_softmax_inv_avx2(float *s, ptrdiff_t n, const float *sinks,
                                                   int h)
{
    float m, sum = colibri_softmax_num_max_avx2(s, n, &m);
    if (sinks) sum += expf(sinks[h] - m);
    return 1.0f / sum;
}

/* Rows j .. j + m - 1 (those below n) of a (rows rb bytes apart, nb bytes used) towards
 * L1: the cache of a long context comes from L3 or memory (the weights streamed since
 * evicted it), and one kv head's rows are contiguous only per position. */
#define COLIBRI_ATTEND_AHEAD 32
static inline void colibri_prefetch_rows(const char *a, ptrdiff_t j, int m, ptrdiff_t n,
                                         ptrdiff_t rb, ptrdiff_t nb)
{
    int l;
    ptrdiff_t b;
    for (l = 0; l < m && j + l < n; l++)
        for (b = 0; b < nb; b += 64)
            __builtin_prefetch(a + (j + l) * rb + b, 0, 3);
}

/* Positions per block: the block's keys (then values) stay in L1 while the G query heads of
 * their kv head use them (64 rows of Dh 64: 16 KiB). */
#define COLIBRI_ATTEND_BLOCK 64

/* Dh a multiple of 8 (the caller falls back to the scalar body otherwise); h0 .. h1 whole
 * groups of G heads; s: G * n floats. The G heads of a kv head are done together, block of
 * positions by block, so each key and value row comes from memory once per kv head. */
COLIBRI_AVX2_INLINE void colibri_attend_avx2_body(const int fmt, const float *q, int G, int Dh,
                                                  const void *k, const void *v, ptrdiff_t hs,
                                                  ptrdiff_t rs, ptrdiff_t n, float scale,
                                                  const float *sinks, float *s, float *out,
                                                  int h0, int h1)
{
    const ptrdiff_t es = colibri_kv_size(fmt), rb = rs * es, nb = Dh * es;
    int g, h, i;
    ptrdiff_t j, jb, je;
    for (g = h0 / G; g * G < h1; g++) {
        const char *kg = (const char *)k + g * hs * es, *vg = (const char *)v + g * hs * es;
        float inv[COLIBRI_ATTEND_MAX_G];
        for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {          /* scores */
            je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
            for (h = 0; h < G; h++) {
                const float *qh = q + (ptrdiff_t)(g * G + h) * Dh;
                float *sh = s + h * n;
                for (j = jb; j + 8 <= je; j += 8) {
                    if (h == 0)                         /* the first head brings the rows in */
                        colibri_prefetch_rows(kg, j + COLIBRI_ATTEND_AHEAD, 8, n, rb, nb);
                    _mm256_storeu_ps(sh + j, colibri_scores8_avx2(fmt, qh, kg + j * rb, rb, Dh,
                                                                  scale));
                }
                for (; j < je; j++)
                    sh[j] = colibri_score1_avx2(fmt, qh, kg + j * rb, Dh, scale);
            }
        }
        for (h = 0; h < G; h++)                                      /* softmax numerators */
            inv[h] = colibri_softmax_inv_avx2(s + h * n, n, sinks, g * G + h);
        for (h = 0; h < G; h++)
            for (i = 0; i < Dh; i += 8)
                _mm256_storeu_ps(out + (ptrdiff_t)(g * G + h) * Dh + i, _mm256_setzero_ps());
        for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {          /* values */
            je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
            for (h = 0; h < G; h++) {
                const float *sh = s + h * n;
                float *oh = out + (ptrdiff_t)(g * G + h) * Dh;
                for (i = 0; i + 64 <= Dh; i += 64) {    /* 8 independent FMA chains */
                    __m256 o[8];
                    int c;
                    for (c = 0; c < 8; c++) o[c] = _mm256_loadu_ps(oh + i + 8 * c);
                    for (j = jb; j < je; j++) {
                        const __m256 p = _mm256_broadcast_ss(sh + j);
                        const char *vj = vg + j * rb;
                        if (h == 0 && i == 0)
                            colibri_prefetch_rows(vg, j + COLIBRI_ATTEND_AHEAD, 1, n, rb, nb);
                        for (c = 0; c < 8; c++)
                            o[c] = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, vj, i + 8 * c), o[c]);
                    }
                    for (c = 0; c < 8; c++) _mm256_storeu_ps(oh + i + 8 * c, o[c]);
                }
                for (; i + 32 <= Dh; i += 32) {
                    __m256 o0 = _mm256_loadu_ps(oh + i), o1 = _mm256_loadu_ps(oh + i + 8);
                    __m256 o2 = _mm256_loadu_ps(oh + i + 16), o3 = _mm256_loadu_ps(oh + i + 24);
                    for (j = jb; j < je; j++) {
                        const __m256 p = _mm256_broadcast_ss(sh + j);
                        const char *vj = vg + j * rb;
                        if (h == 0 && i == 0)
                            colibri_prefetch_rows(vg, j + COLIBRI_ATTEND_AHEAD, 1, n, rb, nb);
                        o0 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, vj, i), o0);
                        o1 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, vj, i + 8), o1);
                        o2 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, vj, i + 16), o2);
                        o3 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, vj, i + 24), o3);
                    }
                    _mm256_storeu_ps(oh + i, o0);
                    _mm256_storeu_ps(oh + i + 8, o1);
                    _mm256_storeu_ps(oh + i + 16, o2);
                    _mm256_storeu_ps(oh + i + 24, o3);
                }
                for (; i < Dh; i += 8) {
                    __m256 o0 = _mm256_loadu_ps(oh + i);
                    for (j = jb; j < je; j++)
                        o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sh + j),
                                             colibri_kv_load8(fmt, vg + j * rb, i), o0);
                    _mm256_storeu_ps(oh + i, o0);
                }
            }
        }
        for (h = 0; h < G; h++) {
            float *oh = out + (ptrdiff_t)(g * G + h) * Dh;
            const __m256 iv = _mm256_set1_ps(inv[h]);
            for (i = 0; i < Dh; i += 8)
                _mm256_storeu_ps(oh + i, _mm256_mul_ps(_mm256_loadu_ps(oh + i), iv));
        }
    }
}

/* One compiled body per storage format (fmt a constant after inlining). */
#define COLIBRI_DEF_ATTEND_AVX2(name, FMT)                                                   \
    COLIBRI_AVX2_FN void name(const float *q, int G, int Dh, const void *k, const void *v,  \
                              ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n, float scale,         \
                              const float *sinks, float *s, float *out, int h0, int h1)      \
    {                                                                                        \
        colibri_attend_avx2_body(FMT, q, G, Dh, k, v, hs, rs, n, scale, sinks, s, out, h0,  \
                                 h1);                                                        \
    }
COLIBRI_DEF_ATTEND_AVX2(colibri_attend_f32_avx2, COLIBRI_F32)
COLIBRI_DEF_ATTEND_AVX2(colibri_attend_f16_avx2, COLIBRI_F16)
COLIBRI_DEF_ATTEND_AVX2(colibri_attend_bf16_avx2, COLIBRI_BF16)

/* ------------------------------------------------------------------------------------------
 * AVX-512 (Dh a multiple of 16): 16 floats per vector. Scores as the AVX2 body, 8 keys per
 * reduction, each dot product over 512-bit halves of the row; the weighted values with up
 * to 4 query heads at once: a value row is loaded (and widened) once for the G heads of its
 * kv head instead of once per head (4 heads x 4 vectors of 16 = 64 columns per pass, 16
 * accumulators). The softmax is the AVX2 one, so the paths differ only in summation order.
 */

/* Elements i .. i + 15 of a cache row of format fmt, widened to float32. */
COLIBRI_AVX512_INLINE __m512 colibri_kv_load16(const int fmt, const char *p, ptrdiff_t i)
{
    __m256i h;
    if (fmt == COLIBRI_F32) return _mm512_loadu_ps((const float *)(const void *)p + i);
    h = _mm256_loadu_si256((const __m256i *)(const void *)(p + 2 * i));
    if (fmt == COLIBRI_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX512_INLINE __m256 colibri_fold512(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* 8 dot products q . k_j (rows rb bytes apart), Dh a multiple of 16, times scale. */
COLIBRI_AVX512_INLINE __m256 colibri_scores8_avx512(const int fmt, const float *q, const char *k,
                                                    ptrdiff_t rb, int Dh, float scale)
{
    __m512 a[8];
    __m256 t0, t2;
    int l, i;
    for (l = 0; l < 8; l++) a[l] = _mm512_setzero_ps();
    for (i = 0; i < Dh; i += 16) {
        const __m512 qv = _mm512_loadu_ps(q + i);
        for (l = 0; l < 8; l++)
            a[l] = _mm512_fmadd_ps(qv, colibri_kv_load16(fmt, k + l * rb, i), a[l]);
    }
    t0 = _mm256_hadd_ps(_mm256_hadd_ps(colibri_fold512(a[0]), colibri_fold512(a[1])),
                        _mm256_hadd_ps(colibri_fold512(a[2]), colibri_fold512(a[3])));
    t2 = _mm256_hadd_ps(_mm256_hadd_ps(colibri_fold512(a[4]), colibri_fold512(a[5])),
                        _mm256_hadd_ps(colibri_fold512(a[6]), colibri_fold512(a[7])));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                                       _mm256_permute2f128_ps(t0, t2, 0x31)),
                         _mm256_set1_ps(scale));
}

COLIBRI_AVX512_INLINE float colibri_score1_avx512(const int fmt, const float *q, const char *k,
                                                  int Dh, float scale)
{
    __m512 a = _mm512_setzero_ps();
    int i;
    for (i = 0; i < Dh; i += 16)
        a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), colibri_kv_load16(fmt, k, i), a);
    return colibri_hsum512(a) * scale;
}

/* Heads per pass and 16-column vectors per head of the weighted values. */
#define COLIBRI_ATTEND_HEADS 4
#define COLIBRI_ATTEND_VECS 4

COLIBRI_AVX512_INLINE void colibri_attend_avx512_body(const int fmt, const float *q, int G,
                                                      int Dh, const void *k, const void *v,
                                                      ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n,
                                                      float scale, const float *sinks,
                                                      float *s, float *out, int h0, int h1)
{
    const ptrdiff_t es = colibri_kv_size(fmt), rb = rs * es, nb = Dh * es;
    int g, h, i, t, c;
    ptrdiff_t j, jb, je;
    for (g = h0 / G; g * G < h1; g++) {
        const char *kg = (const char *)k + g * hs * es, *vg = (const char *)v + g * hs * es;
        float inv[COLIBRI_ATTEND_MAX_G];
        for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {          /* scores */
            je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
            for (h = 0; h < G; h++) {
                const float *qh = q + (ptrdiff_t)(g * G + h) * Dh;
                float *sh = s + h * n;
                for (j = jb; j + 8 <= je; j += 8) {
                    if (h == 0)
                        colibri_prefetch_rows(kg, j + COLIBRI_ATTEND_AHEAD, 8, n, rb, nb);
                    _mm256_storeu_ps(sh + j, colibri_scores8_avx512(fmt, qh, kg + j * rb, rb,
                                                                    Dh, scale));
                }
                for (; j < je; j++)
                    sh[j] = colibri_score1_avx512(fmt, qh, kg + j * rb, Dh, scale);
            }
        }
        for (h = 0; h < G; h++)                                      /* softmax numerators */
            inv[h] = colibri_softmax_inv_avx2(s + h * n, n, sinks, g * G + h);
        for (h = 0; h < G; h++)
            for (i = 0; i < Dh; i += 16)
                _mm512_storeu_ps(out + (ptrdiff_t)(g * G + h) * Dh + i, _mm512_setzero_ps());
        for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {          /* values */
            je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
            for (h = 0; h < G; h += COLIBRI_ATTEND_HEADS) {
                const int hn = G - h < COLIBRI_ATTEND_HEADS ? G - h : COLIBRI_ATTEND_HEADS;
                for (i = 0; i < Dh; i += 16 * COLIBRI_ATTEND_VECS) {
                    const int nv = (Dh - i) / 16 < COLIBRI_ATTEND_VECS ? (Dh - i) / 16
                                                                       : COLIBRI_ATTEND_VECS;
                    __m512 o[COLIBRI_ATTEND_HEADS][COLIBRI_ATTEND_VECS];
                    for (t = 0; t < COLIBRI_ATTEND_HEADS; t++)
                        for (c = 0; c < COLIBRI_ATTEND_VECS; c++)
                            o[t][c] = t < hn && c < nv
                                ? _mm512_loadu_ps(out + (ptrdiff_t)(g * G + h + t) * Dh + i
                                                  + 16 * c)
                                : _mm512_setzero_ps();
                    for (j = jb; j < je; j++) {
                        const char *vj = vg + j * rb;
                        __m512 x[COLIBRI_ATTEND_VECS];
                        if (h == 0 && i == 0)
                            colibri_prefetch_rows(vg, j + COLIBRI_ATTEND_AHEAD, 1, n, rb, nb);
                        for (c = 0; c < COLIBRI_ATTEND_VECS; c++)
                            x[c] = c < nv ? colibri_kv_load16(fmt, vj, i + 16 * c)
                                          : _mm512_setzero_ps();
                        for (t = 0; t < COLIBRI_ATTEND_HEADS; t++) {
                            if (t < hn) {
                                const __m512 p = _mm512_set1_ps(s[(h + t) * n + j]);
                                for (c = 0; c < COLIBRI_ATTEND_VECS; c++)
                                    o[t][c] = _mm512_fmadd_ps(p, x[c], o[t][c]);
                            }
                        }
                    }
                    for (t = 0; t < hn; t++)
                        for (c = 0; c < nv; c++)
                            _mm512_storeu_ps(out + (ptrdiff_t)(g * G + h + t) * Dh + i + 16 * c,
                                             o[t][c]);
                }
            }
        }
        for (h = 0; h < G; h++) {
            float *oh = out + (ptrdiff_t)(g * G + h) * Dh;
            const __m512 iv = _mm512_set1_ps(inv[h]);
            for (i = 0; i < Dh; i += 16)
                _mm512_storeu_ps(oh + i, _mm512_mul_ps(_mm512_loadu_ps(oh + i), iv));
        }
    }
}

#define COLIBRI_DEF_ATTEND_AVX512(name, FMT)                                                 \
    COLIBRI_AVX512_FN void name(const float *q, int G, int Dh, const void *k, const void *v,\
                                ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n, float scale,       \
                                const float *sinks, float *s, float *out, int h0, int h1)    \
    {                                                                                        \
        colibri_attend_avx512_body(FMT, q, G, Dh, k, v, hs, rs, n, scale, sinks, s, out, h0,\
                                   h1);                                                      \
    }
COLIBRI_DEF_ATTEND_AVX512(colibri_attend_f32_avx512, COLIBRI_F32)
COLIBRI_DEF_ATTEND_AVX512(colibri_attend_f16_avx512, COLIBRI_F16)
COLIBRI_DEF_ATTEND_AVX512(colibri_attend_bf16_avx512, COLIBRI_BF16)

#endif /* COLIBRI_X86 */

/* Heads h0 .. h1 - 1 on path isa over a cache of format fmt (COLIBRI_F32 / F16 / BF16;
 * avx512 and avx512vnni run the AVX-512 bodies when Dh is a multiple of 16, every other
 * SIMD case the AVX2 bodies); hs, rs in elements; sinks: H floats (indexed by query head)
 * or NULL (no sinks). */
static inline void colibri_attend_sinks(int isa, int fmt, const float *q, int G, int Dh,
                                        const void *k, const void *v, ptrdiff_t hs,
                                        ptrdiff_t rs, ptrdiff_t n, float scale,
                                        const float *sinks, float *s, float *out, int h0,
                                        int h1)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR && Dh % 8 == 0 &&
        G <= COLIBRI_ATTEND_MAX_G && h0 % G == 0 && h1 % G == 0) {
#define COLIBRI_ATTEND_ARGS q, G, Dh, k, v, hs, rs, n, scale, sinks, s, out, h0, h1
        if (colibri_isa_base(isa) == COLIBRI_ISA_AVX512 && Dh % 16 == 0) {
            if (fmt == COLIBRI_F16) colibri_attend_f16_avx512(COLIBRI_ATTEND_ARGS);
            else if (fmt == COLIBRI_BF16) colibri_attend_bf16_avx512(COLIBRI_ATTEND_ARGS);
            else colibri_attend_f32_avx512(COLIBRI_ATTEND_ARGS);
            return;
        }
        if (fmt == COLIBRI_F16) colibri_attend_f16_avx2(COLIBRI_ATTEND_ARGS);
        else if (fmt == COLIBRI_BF16) colibri_attend_bf16_avx2(COLIBRI_ATTEND_ARGS);
        else colibri_attend_f32_avx2(COLIBRI_ATTEND_ARGS);
#undef COLIBRI_ATTEND_ARGS
        return;
    }
#endif
    (void)isa;
    colibri_attend_scalar(fmt, q, G, Dh, k, v, hs, rs, n, scale, sinks, s, out, h0, h1);
}

/* colibri_attend_sinks without sinks. */
static inline void colibri_attend(int isa, int fmt, const float *q, int G, int Dh,
                                  const void *k, const void *v, ptrdiff_t hs, ptrdiff_t rs,
                                  ptrdiff_t n, float scale, float *s, float *out, int h0, int h1)
{
    colibri_attend_sinks(isa, fmt, q, G, Dh, k, v, hs, rs, n, scale, NULL, s, out, h0, h1);
}

/* colibri_kv_widen_scalar on path isa (every SIMD path: the AVX2 body); fmt F16 or BF16. */
static inline void colibri_kv_widen(int isa, int fmt, const void *src, ptrdiff_t rb,
                                    ptrdiff_t rows, ptrdiff_t cols, float *dst)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR) {
        colibri_kv_widen_avx2(fmt, (const char *)src, rb, rows, cols, dst);
        return;
    }
#endif
    (void)isa;
    colibri_kv_widen_scalar(fmt, (const char *)src, rb, rows, cols, dst);
}

#endif /* COLIBRI_ATTEND_H */
