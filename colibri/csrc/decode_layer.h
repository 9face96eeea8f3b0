/* colibri/csrc/decode_layer.h: the elementwise float32 steps of the compiled decode step
 * (colibri/pyx/decode_layer.pxi) between its kernel calls, and its stage clock.
 *
 * Each is the NumPy operation the Python step (Model._step, Attention.decode, MoE.__call__)
 * makes there, element for element, so the compiled step gets the same bits:
 *   - residual add h += o (np.add(h, o, out=h)), multiplier o *= m (np.multiply);
 *   - clip_qkv: np.clip(x, -c, c) = minimum(maximum(x, -c), c), NaN kept NaN;
 *   - LayerNorm of a row (PhiMoE, DBRX: norms.layer_norm), NumPy's summation order;
 *   - the shared expert's gate: s *= 1 / (1 + exp(-z)); y += s, with exp NumPy's own float32
 *     loop (its SIMD polynomial, which differs from libm's expf in the last bit for about
 *     40 % of arguments), called through the ufunc's loop table: colibri_find_exp_loop finds
 *     it once (0: not found, and the model's gated layers stay on the Python step).
 * Compiled with contraction off, as rowops.h: no fused multiply-add where NumPy rounds twice.
 */
#ifndef COLIBRI_DECODE_LAYER_H
#define COLIBRI_DECODE_LAYER_H

#include <math.h>
#include <stddef.h>
#include <time.h>

#include "npy.h"        /* Python.h, NumPy's array API */
#include <numpy/ufuncobject.h>
#include "rowops.h"     /* COLIBRI_ROWOPS_FN, COLIBRI_NO_CONTRACT */

#ifdef I
#undef I
#endif

/* NumPy's float32 -> float32 loop of np.exp, the one its type resolution picks (the first
 * of the ufunc's loops with those types), and its data */
static PyUFuncGenericFunction colibri_exp_loop = NULL;
static void *colibri_exp_data = NULL;

/* Find that loop in ufunc (np.exp, an np.ufunc: the caller checks); 1 when found, else 0. */
static int colibri_find_exp_loop(PyObject *ufunc)
{
    PyUFuncObject *u = (PyUFuncObject *)ufunc;
    int i;
    if (u->nin != 1 || u->nout != 1 ||
        u->functions == NULL || u->types == NULL)
        return 0;
    for (i = 0; i < u->ntypes; i++)
        if (u->types[2 * i] == NPY_FLOAT && u->types[2 * i + 1] == NPY_FLOAT) {
            colibri_exp_loop = u->functions[i];
            colibri_exp_data = u->data == NULL ? NULL : u->data[i];
            return colibri_exp_loop != NULL;
        }
    return 0;
}

/* np.exp of one float32, through that loop (which needs no GIL: a plain C loop) */
static inline float colibri_np_exp(float x)
{
    float in = x, out;
    char *args[2] = {(char *)&in, (char *)&out};
    npy_intp dims[1] = {1}, steps[2] = {sizeof(float), sizeof(float)};
    colibri_exp_loop(args, dims, steps, colibri_exp_data);
    return out;
}

/* h[i] += o[i], i < n */
COLIBRI_ROWOPS_FN void colibri_add_into(float *h, const float *o, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        h[i] = h[i] + o[i];
}

/* x[i] *= m, i < n */
COLIBRI_ROWOPS_FN void colibri_scale_into(float *x, float m, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    for (i = 0; i < n; i++)
        x[i] = x[i] * m;
}

/* x[i] = min(max(x[i], -c), c), NaN staying NaN (NumPy's clip), i < n */
COLIBRI_ROWOPS_FN void colibri_clip_into(float *x, float c, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        float v = x[i];
        if (v != v)
            continue;
        v = v > -c ? v : -c;
        x[i] = v < c ? v : c;
    }
}

/* the sigmoid of a shared-expert gate logit, float32: 1 / (1 + np.exp(-z)) (needs the loop) */
COLIBRI_ROWOPS_FN float colibri_gate_sigmoid(float z)
{
    COLIBRI_NO_CONTRACT
    const float e = colibri_np_exp(-z);
    const float d = 1.0f + e;
    return 1.0f / d;
}

/* sum of x[i], i < n, in NumPy's float32 add.reduce order over a contiguous row (pairwise:
 * 8 interleaved partial sums over blocks of up to 128, halves split at multiples of 8), as
 * rowops.h's colibri_pairwise_sumsq over the squares */
COLIBRI_ROWOPS_FN float colibri_pairwise_sum(const float *x, ptrdiff_t n)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    if (n < 8) {
        float res = 0.0f;
        for (i = 0; i < n; i++)
            res += x[i];
        return res;
    }
    if (n <= COLIBRI_PW_BLOCK) {
        float r[8], res;
        int j;
        for (j = 0; j < 8; j++)
            r[j] = x[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (j = 0; j < 8; j++)
                r[j] += x[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += x[i];
        return res;
    }
    {
        ptrdiff_t n2 = n / 2;
        n2 -= n2 % 8;
        return colibri_pairwise_sum(x, n2) + colibri_pairwise_sum(x + n2, n - n2);
    }
}

/* LayerNorm of one row of n floats into out (may be x): norms.layer_norm's operations, the
 * same bits: mean = sum(x) / n and var = sum((x - mean)^2) / n (float32 sums in NumPy's
 * order, each divided in double as NumPy's float32-by-intp division, then rounded), out =
 * (x - mean) * (1 / sqrt(var + eps)) * weight [+ bias]. */
COLIBRI_ROWOPS_FN void colibri_layer_norm_row(const float *x, ptrdiff_t n, const float *weight,
                                              const float *bias, float eps, float *out)
{
    COLIBRI_NO_CONTRACT
    ptrdiff_t i;
    const float mean = (float)((double)colibri_pairwise_sum(x, n) / (double)n);
    float var, inv;
    for (i = 0; i < n; i++)
        out[i] = x[i] - mean;
    var = (float)((double)colibri_pairwise_sumsq(out, n) / (double)n);
    var = var + eps;
    var = sqrtf(var);
    inv = 1.0f / var;
    for (i = 0; i < n; i++) {
        const float c = out[i] * inv;
        out[i] = c * weight[i];
    }
    if (bias != NULL)
        for (i = 0; i < n; i++)
            out[i] = out[i] + bias[i];
}

/* seconds on the clock Python's time.perf_counter reads (CLOCK_MONOTONIC); 0 without it */
static inline double colibri_stage_clock(void)
{
#if defined(CLOCK_MONOTONIC) && !defined(_WIN32)
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#else
    return 0.0;
#endif
}

#endif /* COLIBRI_DECODE_LAYER_H */
