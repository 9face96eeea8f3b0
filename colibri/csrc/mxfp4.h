/* csrc/mxfp4.h: the MXFP4 row kernels (OCP microscaling FP4, GPT-OSS's experts as they ship):
 * the scalar specification, the AVX2 and AVX-512 bodies.
 *
 * Row layout (docs/format.md section 6): C/2 code bytes, byte j holding element 2j in its low
 * nibble and 2j + 1 in its high nibble (the checkpoint's `*_blocks` order), then C/32 E8M0
 * scale bytes. Element c = FP4_E2M1[nibble] * 2^(scale[c / 32] - 127). */
#ifndef COLIBRI_MXFP4_H
#define COLIBRI_MXFP4_H

#include "types.h"
#include "avx512.h"

/* The scalar body (the specification): per token and 32-element block, the products in
 * element order into one f32 partial, then acc += partial * scale in block order. */
static void colibri_dot_mxfp4_row_scalar(const uint8_t *row, ptrdiff_t cols, const float *x,
                                         ptrdiff_t xs, int nt, float *out, ptrdiff_t os)
{
    const uint8_t *scales = row + cols / 2;
    ptrdiff_t b, c;
    int t;
    for (t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float acc = 0.0f;
        for (b = 0; b < cols / 32; b++) {
            float part = 0.0f;
            for (c = 32 * b; c < 32 * b + 32; c++)
                part += colibri_fp4_value(colibri_mxfp4_nibble(row, c)) * xt[c];
            acc += part * colibri_e8m0_to_f32(scales[b]);
        }
        out[t * os] = acc;
    }
}

static void colibri_dot_mxfp4_scalar(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows,
                                     ptrdiff_t cols, ptrdiff_t group, const float *x,
                                     ptrdiff_t xs, const float *xsum, ptrdiff_t ss, int nt,
                                     float *out, ptrdiff_t os)
{
    ptrdiff_t i;
    (void)group; (void)xsum; (void)ss;
    for (i = 0; i < nrows; i++)
        colibri_dot_mxfp4_row_scalar(row0 + i * rs, cols, x, xs, nt, out + i, os);
}

#if COLIBRI_X86
/* AVX2: a block's 16 code bytes as 32 elements: the low and high nibbles interleaved back
 * into element order (two unpacks), each nibble mapped by one pshufb to 2 * its FP4 value as
 * an int8 (0, 1, 2, 3, 4, 6, 8, 12 and negated: exact), widened to four vectors of 8 floats.
 * Per token: p = w0 x0, fma(w1, x1), fma(w2, x2), fma(w3, x3); acc = fma(p, scale / 2, acc);
 * out = hsum. (2v x rounds as v x, times 2; p * (scale / 2) is the product with v exactly.) */
COLIBRI_AVX2_INLINE void colibri_fp4x32_avx2(const uint8_t *q, __m256 w[4])
{
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));     /* 0..15 */
    const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));     /* 16..31 */
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
}

COLIBRI_AVX2_INLINE void colibri_dot_mxfp4_avx2_body(const uint8_t *row, ptrdiff_t cols,
                                                     const float *x, ptrdiff_t xs, float *out,
                                                     ptrdiff_t os, const int NT)
{
    const uint8_t *scales = row + cols / 2;
    __m256 acc[COLIBRI_MAX_NT], w[4];
    ptrdiff_t b;
    int t;
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (b = 0; b < cols / 32; b++) {
        const __m256 s = _mm256_set1_ps(0.5f * colibri_e8m0_to_f32(scales[b]));
        colibri_fp4x32_avx2(row + 16 * b, w);
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + 32 * b;
            __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
            p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), p);
            p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), p);
            p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), p);
            acc[t] = _mm256_fmadd_ps(p, s, acc[t]);
        }
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);
}

/* AVX-512: the AVX2 decode to 2 * FP4 as int8 (unpacks + pshufb), each 16 widened to one
 * vector. Per token: p = w0 x0, fma(w1, x1); acc = fma(p, scale / 2, acc). */
COLIBRI_AVX512_INLINE void colibri_dot_mxfp4_avx512_body(const uint8_t *row, ptrdiff_t cols,
                                                         const float *x, ptrdiff_t xs,
                                                         float *out, ptrdiff_t os, const int NT)
{
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m = _mm_set1_epi8(0x0F);
    const uint8_t *scales = row + cols / 2;
    __m512 acc[COLIBRI_MAX_NT];
    ptrdiff_t b;
    int t;
    for (t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (b = 0; b < cols / 32; b++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(row + 16 * b));
        const __m128i lo = _mm_and_si128(q, m), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi))));
        const __m512 s = _mm512_set1_ps(0.5f * colibri_e8m0_to_f32(scales[b]));
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + 32 * b;
            __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(xt));
            p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), p);
            acc[t] = _mm512_fmadd_ps(p, s, acc[t]);
        }
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum512(acc[t]);
}

#define COLIBRI_MXFP4_ROWS(BODY, NT)                                                         \
    for (i = 0; i < nrows; i++) BODY(row0 + i * rs, cols, x, xs, out + i, os, NT);

#define COLIBRI_DEF_MXFP4(NAME, ATTR, BODY)                                                  \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,       \
                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                          \
    {                                                                                       \
        ptrdiff_t i;                                                                        \
        (void)group; (void)xsum; (void)ss;                                                  \
        switch (nt) {                                                                       \
        case 1: COLIBRI_MXFP4_ROWS(BODY, 1) break;                                          \
        case 2: COLIBRI_MXFP4_ROWS(BODY, 2) break;                                          \
        case 3: COLIBRI_MXFP4_ROWS(BODY, 3) break;                                          \
        default: COLIBRI_MXFP4_ROWS(BODY, 4) break;                                         \
        }                                                                                   \
    }

COLIBRI_DEF_MXFP4(colibri_dot_mxfp4_avx2, COLIBRI_AVX2_FN, colibri_dot_mxfp4_avx2_body)
COLIBRI_DEF_MXFP4(colibri_dot_mxfp4_avx512, COLIBRI_AVX512_FN, colibri_dot_mxfp4_avx512_body)
#endif /* COLIBRI_X86 */

#endif /* COLIBRI_MXFP4_H */
