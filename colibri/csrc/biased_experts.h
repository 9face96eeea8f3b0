/* colibri/csrc/biased_experts.h: the elementwise float32 steps of the grouped biased-expert
 * call (colibri/pyx/biased_experts.pxi, PreparedBiasedGrouped: GPT-OSS's experts over T > 1
 * token rows) between its kernel calls.
 *
 * Each is the NumPy operation of BiasedExperts.reference (colibri/kernels/biased_experts.py,
 * the specification), element for element, so the grouped call gets its bits:
 *   - swigluoai (biased_experts._swigluoai_into): g' = minimum(g, limit),
 *     u' = clip(u, -limit, limit) (NaN kept NaN), t = exp(-(g' * alpha)),
 *     u = (u' + 1) * (g' * (1 / (t + 1)));
 *   - silu_mul (biased_experts._silu_mul_into): t = exp(-g), u = (g * (1 / (t + 1))) * u;
 *   - the combine: y += o * w (the expert output scaled, then added: two roundings).
 * exp is NumPy's own float32 loop (decode_layer.h's colibri_exp_loop, found once at import),
 * called on contiguous runs of up to COLIBRI_BX_RUN elements: an element's result depends
 * only on its argument (the loop's SIMD polynomial is elementwise). Compiled with
 * contraction off (rowops.h): no fused multiply-add where NumPy rounds twice.
 */
#ifndef COLIBRI_BIASED_EXPERTS_H
#define COLIBRI_BIASED_EXPERTS_H

#include <stddef.h>

#include "decode_layer.h"   /* colibri_exp_loop, colibri_exp_data; rowops.h */

#define COLIBRI_BX_RUN 256

/* 1 when NumPy's float32 exp loop has been found (decode_layer.pxi does it at import). */
static inline int colibri_bx_exp_ready(void) { return colibri_exp_loop != NULL; }

/* t[i] = np.exp(t[i]) for i < n, in place, through NumPy's loop. */
static inline void colibri_bx_exp(float *t, ptrdiff_t n)
{
    char *args[2] = {(char *)t, (char *)t};
    npy_intp dims[1] = {(npy_intp)n}, steps[2] = {sizeof(float), sizeof(float)};
    colibri_exp_loop(args, dims, steps, colibri_exp_data);
}

/* u[i] = swigluoai(g[i], u[i]) for i < n (g overwritten with g'), as
 * biased_experts._swigluoai_into. */
COLIBRI_ROWOPS_FN void colibri_bx_swigluoai(float *g, float *u, ptrdiff_t n, float alpha,
                                            float limit)
{
    COLIBRI_NO_CONTRACT
    float t[COLIBRI_BX_RUN];
    ptrdiff_t i0, i, m;
    for (i0 = 0; i0 < n; i0 += COLIBRI_BX_RUN) {
        m = n - i0 < COLIBRI_BX_RUN ? n - i0 : COLIBRI_BX_RUN;
        for (i = 0; i < m; i++) {
            float gc = g[i0 + i], uc = u[i0 + i];
            if (gc == gc)                                   /* np.minimum: NaN propagates */
                gc = gc < limit ? gc : limit;
            if (uc == uc) {                                 /* np.clip: max, then min */
                uc = uc > -limit ? uc : -limit;
                uc = uc < limit ? uc : limit;
            }
            g[i0 + i] = gc;
            u[i0 + i] = uc;
            t[i] = -(gc * alpha);
        }
        colibri_bx_exp(t, m);
        for (i = 0; i < m; i++) {
            const float s = 1.0f / (t[i] + 1.0f);
            u[i0 + i] = (u[i0 + i] + 1.0f) * (s * g[i0 + i]);
        }
    }
}

/* u[i] = silu(g[i]) * u[i] for i < n, as biased_experts._silu_mul_into. */
COLIBRI_ROWOPS_FN void colibri_bx_silu_mul(const float *g, float *u, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    float t[COLIBRI_BX_RUN];
    ptrdiff_t i0, i, m;
    for (i0 = 0; i0 < n; i0 += COLIBRI_BX_RUN) {
        m = n - i0 < COLIBRI_BX_RUN ? n - i0 : COLIBRI_BX_RUN;
        for (i = 0; i < m; i++) t[i] = -g[i0 + i];
        colibri_bx_exp(t, m);
        for (i = 0; i < m; i++) {
            const float s = 1.0f / (t[i] + 1.0f);
            u[i0 + i] = (g[i0 + i] * s) * u[i0 + i];
        }
    }
}

/* y[i] = y[i] + o[i] * w for i < n (the product rounded, then the sum). */
COLIBRI_ROWOPS_FN void colibri_bx_weighted_add(float *y, const float *o, float w, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        const float p = o[i] * w;
        y[i] = y[i] + p;
    }
}

#endif /* COLIBRI_BIASED_EXPERTS_H */
