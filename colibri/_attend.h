/* colibri/_attend.h: attention of one new token over a KV cache (the decode fast path).
 *
 * For query head h, with kv head g = h / G (G query heads per kv head):
 *   s_j   = scale * (q_h . k_g,j)                      j = 0 .. n-1
 *   e_j   = exp(s_j - max_j s_j)
 *   out_h = (sum_j e_j v_g,j) / sum_j e_j
 * q: (H, Dh) rows; key j of kv head g at k + g * hs + j * rs (the same for v), so a cache
 * slice with strided heads and positions is read in place; s: n floats of scratch.
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

#include "_simd.h"

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

/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf reduction and polynomial;
 * 0 below -87.3 (where expf is subnormal or 0), NaN for NaN. */
COLIBRI_AVX2_INLINE __m256 colibri_exp_neg_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3365447505f);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 t, r, p;
    __m256i e;
    x = _mm256_max_ps(x, lo);
    t = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_fnmadd_ps(t, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(t, _mm256_set1_ps(-2.12194440e-4f), r);
    p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(127)), 23);
    p = _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    return _mm256_or_ps(p, nan);
}

/* Dh a multiple of 8 (the caller falls back to the scalar body otherwise). */
COLIBRI_AVX2_FN void colibri_attend_avx2(const float *q, int G, int Dh, const float *k,
                                         const float *v, ptrdiff_t hs, ptrdiff_t rs,
                                         ptrdiff_t n, float scale, float *s, float *out,
                                         int h0, int h1)
{
    int h, i;
    ptrdiff_t j;
    for (h = h0; h < h1; h++) {
        const float *qh = q + (ptrdiff_t)h * Dh;
        const float *kg = k + (h / G) * hs, *vg = v + (h / G) * hs;
        float *oh = out + (ptrdiff_t)h * Dh;
        __m256 vm = _mm256_set1_ps(-INFINITY), vsum = _mm256_setzero_ps();
        __m256 nanv = _mm256_setzero_ps();
        float m, sum;
        int bad = 0;
        for (j = 0; j + 8 <= n; j += 8) {                  /* scores, 8 positions at once */
            __m256 a[8], t0, t1, t2, t3;
            int l;
            for (l = 0; l < 8; l++) a[l] = _mm256_setzero_ps();
            for (i = 0; i < Dh; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + i);
                for (l = 0; l < 8; l++)
                    a[l] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kg + (j + l) * rs + i), a[l]);
            }
            /* 8 horizontal sums into one vector: lane halves summed after two hadd levels */
            t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            t2 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            t1 = _mm256_permute2f128_ps(t0, t2, 0x20);
            t3 = _mm256_permute2f128_ps(t0, t2, 0x31);
            _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_add_ps(t1, t3), _mm256_set1_ps(scale)));
        }
        for (; j < n; j++) {                               /* the last 1..7 positions */
            const float *kj = kg + j * rs;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (i = 0; i + 16 <= Dh; i += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kj + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), _mm256_loadu_ps(kj + i + 8),
                                     a1);
            }
            if (i < Dh)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kj + i), a0);
            s[j] = colibri_hsum256(_mm256_add_ps(a0, a1)) * scale;
        }
        for (j = 0; j + 8 <= n; j += 8) {                  /* their maximum (NaN wins) */
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
        {                                                  /* exp(s - max), and their sum */
            const __m256 mv = _mm256_set1_ps(m);
            for (j = 0; j + 8 <= n; j += 8) {
                const __m256 e = colibri_exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                _mm256_storeu_ps(s + j, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            if (j < n) {                                   /* the last 1..7 scores */
                float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                const int rest = (int)(n - j);
                memcpy(tail, s + j, 4 * (size_t)rest);
                _mm256_storeu_ps(tail, colibri_exp_neg_avx2(_mm256_sub_ps(_mm256_loadu_ps(tail),
                                                                          mv)));
                for (i = rest; i < 8; i++) tail[i] = 0.0f;
                memcpy(s + j, tail, 4 * (size_t)rest);
                vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(tail));
            }
            sum = colibri_hsum256(vsum);
        }
        {                                                  /* values: 32 columns at a time */
            const __m256 inv = _mm256_set1_ps(1.0f / sum);
            for (i = 0; i + 32 <= Dh; i += 32) {
                __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
                for (j = 0; j < n; j++) {
                    const __m256 p = _mm256_broadcast_ss(s + j);
                    const float *vj = vg + j * rs + i;
                    o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), o0);
                    o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), o1);
                    o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), o2);
                    o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), o3);
                }
                _mm256_storeu_ps(oh + i, _mm256_mul_ps(o0, inv));
                _mm256_storeu_ps(oh + i + 8, _mm256_mul_ps(o1, inv));
                _mm256_storeu_ps(oh + i + 16, _mm256_mul_ps(o2, inv));
                _mm256_storeu_ps(oh + i + 24, _mm256_mul_ps(o3, inv));
            }
            for (; i < Dh; i += 8) {
                __m256 o0 = _mm256_setzero_ps();
                for (j = 0; j < n; j++)
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j),
                                         _mm256_loadu_ps(vg + j * rs + i), o0);
                _mm256_storeu_ps(oh + i, _mm256_mul_ps(o0, inv));
            }
        }
    }
}

#endif /* COLIBRI_X86 */

/* Heads h0 .. h1 - 1 on path isa (AVX-512 runs the AVX2 body). */
static inline void colibri_attend(int isa, const float *q, int G, int Dh, const float *k,
                                  const float *v, ptrdiff_t hs, ptrdiff_t rs, ptrdiff_t n,
                                  float scale, float *s, float *out, int h0, int h1)
{
#if COLIBRI_X86
    if ((isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) && Dh % 8 == 0) {
        colibri_attend_avx2(q, G, Dh, k, v, hs, rs, n, scale, s, out, h0, h1);
        return;
    }
#endif
    (void)isa;
    colibri_attend_scalar(q, G, Dh, k, v, hs, rs, n, scale, s, out, h0, h1);
}

#endif /* COLIBRI_ATTEND_H */
