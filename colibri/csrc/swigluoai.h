/* colibri/csrc/swigluoai.h: GPT-OSS's expert activation (colibri/kernels/biased_experts.py,
 * swigluoai), in place:
 *   g' = min(g, limit), u' = clamp(u, -limit, limit)        (a NaN stays NaN, as NumPy's)
 *   u  = (u' + 1) * (g' * sigmoid(alpha * g'))
 * Scalar: libm expf, the operations of the NumPy form in its order (g' * (1 / (1 + exp(-a))));
 * AVX2 (and every wider path, as colibri_silu_mul): sigmoid(a) = (a >= 0 ? 1 : e) / (1 + e)
 * with e = exp(-|a|) by the exp polynomial of avx2.h (~1 ulp, never overflows), so the paths
 * agree to a few ulp; on one path an element's result depends only on its g and u.
 */
#ifndef COLIBRI_SWIGLUOAI_H
#define COLIBRI_SWIGLUOAI_H

#include "avx2.h"

static inline void colibri_swigluoai_scalar(const float *g, float *u, ptrdiff_t n, float alpha,
                                            float limit)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        const float gc = g[i] < limit || g[i] != g[i] ? g[i] : limit;
        const float uc = u[i] != u[i] ? u[i] : u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        const float t = gc * (1.0f / (1.0f + expf(-(gc * alpha))));
        u[i] = (uc + 1.0f) * t;
    }
}

#if COLIBRI_X86
COLIBRI_AVX2_INLINE __m256 colibri_swigluoai8_avx2(__m256 g, __m256 u, __m256 alpha,
                                                   __m256 limit)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 gnan = _mm256_cmp_ps(g, g, _CMP_UNORD_Q), unan = _mm256_cmp_ps(u, u, _CMP_UNORD_Q);
    __m256 a, e, s;
    g = _mm256_blendv_ps(_mm256_min_ps(g, limit), g, gnan);
    u = _mm256_blendv_ps(_mm256_max_ps(_mm256_min_ps(u, limit),
                                       _mm256_sub_ps(_mm256_setzero_ps(), limit)), u, unan);
    a = _mm256_mul_ps(g, alpha);
    e = colibri_exp_neg_avx2(_mm256_or_ps(a, _mm256_set1_ps(-0.0f)));          /* exp(-|a|) */
    s = _mm256_div_ps(_mm256_blendv_ps(one, e, _mm256_cmp_ps(a, _mm256_setzero_ps(),
                                                             _CMP_LT_OQ)),
                      _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_mul_ps(g, s));
}

/* The last n % 8 through the same 8-lane code (a padded copy), as colibri_silu_mul_avx2. */
COLIBRI_AVX2_FN void colibri_swigluoai_avx2(const float *g, float *u, ptrdiff_t n, float alpha,
                                            float limit)
{
    const __m256 av = _mm256_set1_ps(alpha), lv = _mm256_set1_ps(limit);
    ptrdiff_t i;
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(u + i, colibri_swigluoai8_avx2(_mm256_loadu_ps(g + i),
                                                        _mm256_loadu_ps(u + i), av, lv));
    if (i < n) {
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(a, g + i, (size_t)(n - i) * 4);
        memcpy(b, u + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(b, colibri_swigluoai8_avx2(_mm256_loadu_ps(a), _mm256_loadu_ps(b), av,
                                                    lv));
        memcpy(u + i, b, (size_t)(n - i) * 4);
    }
}
#endif

/* u[i] = swigluoai(g[i], u[i]) for i < n on path isa. */
static inline void colibri_swigluoai(int isa, const float *g, float *u, ptrdiff_t n, float alpha,
                                     float limit)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR) {
        colibri_swigluoai_avx2(g, u, n, alpha, limit);
        return;
    }
#endif
    (void)isa;
    colibri_swigluoai_scalar(g, u, n, alpha, limit);
}

#endif /* COLIBRI_SWIGLUOAI_H */
