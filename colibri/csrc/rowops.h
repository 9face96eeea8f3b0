/* colibri/csrc/rowops.h: the small per-token row operations of a decode step, in plain C.
 *
 * A decode step normalises and rotates a few vectors per layer (RMSNorm of the residual row
 * twice, RoPE of the q and k heads, q/k norms for some families). In NumPy each is a chain of
 * 4-8 ufunc calls of ~1 us of dispatch apiece for ~1 us of arithmetic; here each is one call.
 *
 * The arithmetic is NumPy's, operation for operation, so results are the same bits as the
 * NumPy code they replace (colibri.engine.attention's rms_norm / apply_rope):
 *   - RMSNorm: ss = sum(x * x) in float32, summed in the order of NumPy's float32
 *     add.reduce over a contiguous row (pairwise: 8 interleaved partial sums over blocks
 *     of up to 128, halves split at multiples of 8); r = 1 / sqrt(ss / n + eps) in float32;
 *     out = weight * (x * r).
 *   - RoPE (half split): x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s, each product rounded.
 * No fused multiply-add may be formed (it rounds once where NumPy rounds twice): the
 * functions below are compiled with contraction off.
 *
 * Shapes: n elements of a row; rows of `stride` floats; h = Dr/2 rotary pairs per row.
 */
#ifndef COLIBRI_ROWOPS_H
#define COLIBRI_ROWOPS_H

#include <math.h>
#include <stddef.h>

#if defined(__clang__)
#define COLIBRI_NO_CONTRACT _Pragma("clang fp contract(off)")
#define COLIBRI_ROWOPS_FN static
#elif defined(__GNUC__)
#define COLIBRI_NO_CONTRACT
#define COLIBRI_ROWOPS_FN static __attribute__((optimize("fp-contract=off")))
#else
#define COLIBRI_NO_CONTRACT
#define COLIBRI_ROWOPS_FN static
#endif

/* NumPy's pairwise-summation block. */
#define COLIBRI_PW_BLOCK 128

/* sum of x[i]^2 for i < n in NumPy's pairwise order (FLOAT_pairwise_sum over the squares). */
COLIBRI_ROWOPS_FN float colibri_pairwise_sumsq(const float *x, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    if (n < 8) {
        float res = 0.0f;
        for (i = 0; i < n; i++) {
            const float sq = x[i] * x[i];
            res += sq;
        }
        return res;
    }
    if (n <= COLIBRI_PW_BLOCK) {
        float r[8], res, sq;
        int j;
        for (j = 0; j < 8; j++)
            r[j] = x[j] * x[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (j = 0; j < 8; j++) {
                sq = x[i + j] * x[i + j];
                r[j] += sq;
            }
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) {
            sq = x[i] * x[i];
            res += sq;
        }
        return res;
    }
    {
        ptrdiff_t n2 = n / 2;
        n2 -= n2 % 8;
        return colibri_pairwise_sumsq(x, n2) + colibri_pairwise_sumsq(x + n2, n - n2);
    }
}

/* RMSNorm of `rows` rows of n floats (row stride xs, out stride os; out may be x):
 * out = weight * (x * (1 / sqrt(sum(x^2) / n + eps))). */
COLIBRI_ROWOPS_FN void colibri_rms_norm_rows(const float *x, ptrdiff_t xs, ptrdiff_t rows,
                                             ptrdiff_t n, const float *weight, float eps,
                                             float *out, ptrdiff_t os)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t r, i;
    for (r = 0; r < rows; r++) {
        const float *xr = x + r * xs;
        float *o = out + r * os;
        const float ss = colibri_pairwise_sumsq(xr, n);
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i < n; i++) {
            const float xi = xr[i] * inv;
            o[i] = weight[i] * xi;
        }
    }
}

/* RoPE, half split, in place on `rows` rows of stride xs: for i < h,
 * (x[i], x[h+i]) <- (x[i] c[i] - x[h+i] s[i], x[h+i] c[i] + x[i] s[i]); columns >= 2h stay. */
COLIBRI_ROWOPS_FN void colibri_rope_rows(float *x, ptrdiff_t xs, ptrdiff_t rows, ptrdiff_t h,
                                         const float *c, const float *s)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t r, i;
    for (r = 0; r < rows; r++) {
        float *x1 = x + r * xs, *x2 = x1 + h;
        for (i = 0; i < h; i++) {
            const float a = x1[i] * c[i], b = x2[i] * s[i];
            const float d = x2[i] * c[i], e = x1[i] * s[i];
            x1[i] = a - b;
            x2[i] = d + e;
        }
    }
}

#endif /* COLIBRI_ROWOPS_H */
