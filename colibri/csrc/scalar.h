/* csrc/scalar.h: the scalar bodies of the row kernels, the specification every SIMD body
 * matches (and the only path on non-x86 machines). */
#ifndef COLIBRI_SCALAR_H
#define COLIBRI_SCALAR_H

#include "types.h"

/* ------------------------------------------------------------------------------------------
 * Scalar bodies: the specification. One f32 accumulator per token and group, in element
 * order; the scale multiplies each group's partial sum.
 */

static void colibri_dot_plain_scalar(int fmt, const uint8_t *row, ptrdiff_t cols,
                                     const float *x, ptrdiff_t xs, int nt,
                                     float *out, ptrdiff_t os)
{
    int t;
    ptrdiff_t c;
    for (t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float acc = 0.0f;
        for (c = 0; c < cols; c++) acc += colibri_plain_elem(fmt, row, c) * xt[c];
        out[t * os] = acc;
    }
}

/* The plain-format entry points: the body per row (group and the sums unused). */
#define COLIBRI_DEF_DOT_PLAIN_SCALAR(NAME, FMT)                                              \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,      \
                     ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                        \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)group; (void)xsum; (void)ss;                                                   \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_dot_plain_scalar(FMT, row0 + i * rs, cols, x, xs, nt, out + i, os);      \
    }

COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_f32_scalar, COLIBRI_F32)
COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_f16_scalar, COLIBRI_F16)
COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_bf16_scalar, COLIBRI_BF16)

static void colibri_dot_quant_scalar(int fmt, const uint8_t *row, ptrdiff_t cols,
                                     ptrdiff_t group, const float *x, ptrdiff_t xs, int nt,
                                     float *out, ptrdiff_t os)
{
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    int t;
    ptrdiff_t g, c;
    for (t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float acc = 0.0f;
        for (g = 0; g < cols / group; g++) {
            float part = 0.0f;
            for (c = g * group; c < (g + 1) * group; c++) {
                float q = fmt == COLIBRI_Q8 ? (float)(int8_t)row[c]
                                            : (float)(colibri_q4_nibble(row, c) - 8);
                part += q * xt[c];
            }
            acc += part * colibri_f16_to_f32(colibri_ld_u16(scales + 2 * g));
        }
        out[t * os] = acc;
    }
}

/* The quantized entry points (the scalar body subtracts the q4 offset per element: the
 * group sums are unused). */
#define COLIBRI_DEF_DOT_QUANT_SCALAR(NAME, FMT)                                              \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,      \
                     ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                        \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)xsum; (void)ss;                                                                \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_dot_quant_scalar(FMT, row0 + i * rs, cols, group, x, xs, nt, out + i,   \
                                     os);                                                    \
    }

COLIBRI_DEF_DOT_QUANT_SCALAR(colibri_dot_q8_scalar, COLIBRI_Q8)
COLIBRI_DEF_DOT_QUANT_SCALAR(colibri_dot_q4_scalar, COLIBRI_Q4)

/* int8 / int16 activations, the specification: per token, per 32-block, the exact integer dot
 * of the codes with q (int8 at colibri_qpos, or int16 at colibri_qpos16 when wide), then
 * acc += (s * d) * isum in block order (one f32 accumulator). */
static void colibri_idot_quant_scalar(int fmt, int wide, const uint8_t *row, ptrdiff_t cols,
                                      ptrdiff_t group, const int8_t *q, ptrdiff_t qs,
                                      const float *d, ptrdiff_t ds, int nt, float *out,
                                      ptrdiff_t os)
{
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    ptrdiff_t b, nb = cols / 32;
    int t, i;
    for (t = 0; t < nt; t++) {
        const int8_t *qt = q + t * qs;
        const int16_t *qt16 = (const int16_t *)(const void *)qt;
        float acc = 0.0f;
        for (b = 0; b < nb; b++) {
            int32_t isum = 0;
            for (i = 0; i < 32; i++) {
                ptrdiff_t c = 32 * b + i;
                int code = fmt == COLIBRI_Q8 ? (int)(int8_t)row[c]
                                             : colibri_q4_nibble(row, c) - 8;
                isum += code * (wide ? qt16[colibri_qpos16(c)] : qt[colibri_qpos(c)]);
            }
            float sg = colibri_f16_to_f32(colibri_ld_u16(scales + 2 * (32 * b / group)));
            acc += (sg * d[t * ds + colibri_dpos(b)]) * (float)isum;
        }
        out[t * os] = acc;
    }
}

/* The scalar entry points (the body subtracts the q4 offset per element: s is unused). */
#define COLIBRI_DEF_IDOT_SCALAR(NAME, FMT, WIDE)                                             \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,        \
                     const int32_t *s, ptrdiff_t ds, int nt, float *out, ptrdiff_t os)      \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)s;                                                                             \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_idot_quant_scalar(FMT, WIDE, row0 + i * rs, cols, group, q, qs, d, ds,  \
                                      nt, out + i, os);                                      \
    }

COLIBRI_DEF_IDOT_SCALAR(colibri_idot_q8_scalar, COLIBRI_Q8, 0)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot_q4_scalar, COLIBRI_Q4, 0)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot16_q8_scalar, COLIBRI_Q8, 1)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot16_q4_scalar, COLIBRI_Q4, 1)

/* Sum (mod 2^64) of a byte buffer as little-endian u64 words, plus the last n % 8 bytes
 * one by one: the memory-read bandwidth kernel. Every path computes the same number.
 * Four accumulators so the adds do not serialise. */
static uint64_t colibri_read_sum_scalar(const uint8_t *p, size_t n)
{
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, w0, w1, w2, w3;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        memcpy(&w0, p + i, 8); memcpy(&w1, p + i + 8, 8);
        memcpy(&w2, p + i + 16, 8); memcpy(&w3, p + i + 24, 8);
        a0 += w0; a1 += w1; a2 += w2; a3 += w3;
    }
    for (; i + 8 <= n; i += 8) { memcpy(&w0, p + i, 8); a0 += w0; }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3;
}

#endif /* COLIBRI_SCALAR_H */
