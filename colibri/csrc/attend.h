/* colibri/csrc/attend.h: attention of one new token over a KV cache (the decode step).
 *
 * For query head h, with kv head g = h / G (G query heads per kv head):
 *   s_j   = scale * (q_h . k_g,j)                      j = 0 .. n-1
 *   e_j   = exp(s_j - max_j s_j)
 *   out_h = (sum_j e_j v_g,j) / sum_j e_j
 * q: (H, Dh) rows; key j of kv head g at k + g * hs + j * rs (the same for v), so a cache
 * slice with strided heads and positions is read in place; s: G * n floats of scratch.
 * The kernel knows floats and strides only: which positions are attended (a sliding window,
 * the slots of the cache) is the caller's choice of k, v and n.
 *
 * Scalar: dot products and sums in index order, libm expf. AVX2: 8-lane partial sums and an
 * exp polynomial (Cephes' expf, ~1 ulp). The paths agree to ~1e-6 relative, not bit for
 * bit; each gives the same bits for any thread count (a head is one call's work).
 * A NaN or inf in q or k gives NaN scores and a NaN head, as in NumPy.
 */
#ifndef COLIBRI_ATTEND_H
#define COLIBRI_ATTEND_H

#include "avx2.h"   /* the path codes, COLIBRI_AVX2_FN, colibri_exp_neg_avx2 */

/* Query heads per kv head the AVX2 body handles (more: the scalar body). */
#define COLIBRI_ATTEND_MAX_G 64

static void colibri_attend_scalar(const float *q, int G, int Dh, const float *k,
                                  const float *v, ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n,
                                  float scale, float *s, float *out, int h0, int h1)
{
    int h, i;
    ptrdiff_t j;
    for (h = h0; h < h1; h++) {
        const float *qh = q + (ptrdiff_t)h * Dh;
        const float *kg = k + (h / G) * hs, *vg = v + (h / G) * hs;
        float *oh = out + (ptrdiff_t)h * Dh;
        float m = -INFINITY, sum = 0.0f, inv;
        for (j = 0; j < n; j++) {
            float d = 0.0f;
            for (i = 0; i < Dh; i++) d += qh[i] * kg[j * rs + i];
            s[j] = d * scale;
            m = s[j] > m || s[j] != s[j] ? s[j] : m;         /* a NaN score wins */
        }
        for (j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        inv = 1.0f / sum;
        for (i = 0; i < Dh; i++) oh[i] = 0.0f;
        for (j = 0; j < n; j++)
            for (i = 0; i < Dh; i++) oh[i] += s[j] * vg[j * rs + i];
        for (i = 0; i < Dh; i++) oh[i] *= inv;
    }
}

#if COLIBRI_X86

/* 8 dot products q . k_j (j = 0..7, rows rs apart), Dh a multiple of 8, times scale:
 * one horizontal reduction for the 8 (two hadd levels, then the 128-bit halves summed). */
COLIBRI_AVX2_INLINE __m256 colibri_scores8_avx2(const float *q, const float *k, ptrdiff_t rs,
                                                int Dh, float scale)
{
    __m256 a[8], t0, t2;
    int l, i;
    for (l = 0; l < 8; l++) a[l] = _mm256_setzero_ps();
    for (i = 0; i < Dh; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (l = 0; l < 8; l++)
            a[l] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + l * rs + i), a[l]);
    }
    t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    t2 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_mul_ps(_mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                                       _mm256_permute2f128_ps(t0, t2, 0x31)),
                         _mm256_set1_ps(scale));
}

/* One dot product q . k (Dh a multiple of 8), times scale. */
COLIBRI_AVX2_INLINE float colibri_score1_avx2(const float *q, const float *k, int Dh, float scale)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i;
    for (i = 0; i + 16 <= Dh; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
    }
    if (i < Dh) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    return colibri_hsum256(_mm256_add_ps(a0, a1)) * scale;
}

/* s[0..n) = exp(s - max s) (NaN everywhere if a score is NaN); returns their sum. */
COLIBRI_AVX2_INLINE float colibri_softmax_num_avx2(float *s, ptrdiff_t n)
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

/* Rows j .. j + m - 1 (those below n) of a (rows rs floats apart, Dh used) towards L1: the
 * cache of a long context comes from L3 or memory (the weights streamed since evicted it),
 * and one kv head's rows are contiguous only per position. */
#define COLIBRI_ATTEND_AHEAD 32
static inline void colibri_prefetch_rows(const float *a, ptrdiff_t j, int m, ptrdiff_t n,
                                         ptrdiff_t rs, int Dh)
{
    int l, b;
    for (l = 0; l < m && j + l < n; l++)
        for (b = 0; b < 4 * Dh; b += 64)
            __builtin_prefetch((const char *)(a + (j + l) * rs) + b, 0, 3);
}

/* Positions per block: the block's keys (then values) stay in L1 while the G query heads of
 * their kv head use them (64 rows of Dh 64: 16 KiB). */
#define COLIBRI_ATTEND_BLOCK 64

/* Dh a multiple of 8 (the caller falls back to the scalar body otherwise); h0 .. h1 whole
 * groups of G heads; s: G * n floats. The G heads of a kv head are done together, block of
 * positions by block, so each key and value row comes from memory once per kv head. */
COLIBRI_AVX2_FN void colibri_attend_avx2(const float *q, int G, int Dh, const float *k,
                                         const float *v, ptrdiff_t hs, ptrdiff_t rs,
                                         ptrdiff_t n, float scale, float *s, float *out,
                                         int h0, int h1)
{
    int g, h, i;
    ptrdiff_t j, jb, je;
    for (g = h0 / G; g * G < h1; g++) {
        const float *kg = k + g * hs, *vg = v + g * hs;
        float inv[COLIBRI_ATTEND_MAX_G];
        for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {          /* scores */
            je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
            for (h = 0; h < G; h++) {
                const float *qh = q + (ptrdiff_t)(g * G + h) * Dh;
                float *sh = s + h * n;
                for (j = jb; j + 8 <= je; j += 8) {
                    if (h == 0)                         /* the first head brings the rows in */
                        colibri_prefetch_rows(kg, j + COLIBRI_ATTEND_AHEAD, 8, n, rs, Dh);
                    _mm256_storeu_ps(sh + j, colibri_scores8_avx2(qh, kg + j * rs, rs, Dh, scale));
                }
                for (; j < je; j++)
                    sh[j] = colibri_score1_avx2(qh, kg + j * rs, Dh, scale);
            }
        }
        for (h = 0; h < G; h++)                                      /* softmax numerators */
            inv[h] = 1.0f / colibri_softmax_num_avx2(s + h * n, n);
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
                        const float *vj = vg + j * rs + i;
                        if (h == 0 && i == 0)
                            colibri_prefetch_rows(vg, j + COLIBRI_ATTEND_AHEAD, 1, n, rs, Dh);
                        for (c = 0; c < 8; c++)
                            o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), o[c]);
                    }
                    for (c = 0; c < 8; c++) _mm256_storeu_ps(oh + i + 8 * c, o[c]);
                }
                for (; i + 32 <= Dh; i += 32) {
                    __m256 o0 = _mm256_loadu_ps(oh + i), o1 = _mm256_loadu_ps(oh + i + 8);
                    __m256 o2 = _mm256_loadu_ps(oh + i + 16), o3 = _mm256_loadu_ps(oh + i + 24);
                    for (j = jb; j < je; j++) {
                        const __m256 p = _mm256_broadcast_ss(sh + j);
                        const float *vj = vg + j * rs + i;
                        if (h == 0 && i == 0)
                            colibri_prefetch_rows(vg, j + COLIBRI_ATTEND_AHEAD, 1, n, rs, Dh);
                        o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), o0);
                        o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), o1);
                        o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), o2);
                        o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), o3);
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
                                             _mm256_loadu_ps(vg + j * rs + i), o0);
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

#endif /* COLIBRI_X86 */

/* Heads h0 .. h1 - 1 on path isa (every wider path runs the AVX2 body). */
static inline void colibri_attend(int isa, const float *q, int G, int Dh, const float *k,
                                  const float *v, ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n,
                                  float scale, float *s, float *out, int h0, int h1)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR && Dh % 8 == 0 &&
        G <= COLIBRI_ATTEND_MAX_G && h0 % G == 0 && h1 % G == 0) {
        colibri_attend_avx2(q, G, Dh, k, v, hs, rs, n, scale, s, out, h0, h1);
        return;
    }
#endif
    (void)isa;
    colibri_attend_scalar(q, G, Dh, k, v, hs, rs, n, scale, s, out, h0, h1);
}

#endif /* COLIBRI_ATTEND_H */
