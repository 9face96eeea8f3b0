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
/* AVX2: a block's 16 code bytes as four vectors of 8 elements: 4 bytes broadcast, shifted
 * right by 0, 4, ..., 28 per lane, & 15 the nibble; its magnitude from an 8-entry table
 * (vpermps reads the low 3 bits), its sign bit (nibble bit 3) moved to bit 31. Per token:
 * p = w0 x0, fma(w1, x1), fma(w2, x2), fma(w3, x3); acc = fma(p, scale, acc); out = hsum. */
COLIBRI_AVX2_INLINE __m256 colibri_fp4x8_avx2(const uint8_t *q, __m256 lut)
{
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    uint32_t w;
    memcpy(&w, q, 4);
    __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts),
                                   _mm256_set1_epi32(15));
    __m256 mag = _mm256_permutevar8x32_ps(lut, idx);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

COLIBRI_AVX2_INLINE void colibri_dot_mxfp4_avx2_body(const uint8_t *row, ptrdiff_t cols,
                                                     const float *x, ptrdiff_t xs, float *out,
                                                     ptrdiff_t os, const int NT)
{
    const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const uint8_t *scales = row + cols / 2;
    __m256 acc[COLIBRI_MAX_NT];
    ptrdiff_t b;
    int t;
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (b = 0; b < cols / 32; b++) {
        const uint8_t *q = row + 16 * b;
        const __m256 w0 = colibri_fp4x8_avx2(q, lut), w1 = colibri_fp4x8_avx2(q + 4, lut);
        const __m256 w2 = colibri_fp4x8_avx2(q + 8, lut), w3 = colibri_fp4x8_avx2(q + 12, lut);
        const __m256 s = _mm256_set1_ps(colibri_e8m0_to_f32(scales[b]));
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + 32 * b;
            __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xt));
            p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), p);
            p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), p);
            p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), p);
            acc[t] = _mm256_fmadd_ps(p, s, acc[t]);
        }
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);
}

/* AVX-512: 8 code bytes as 16 elements: each byte doubled (unpack with itself), widened to
 * 32-bit lanes, shifted right by 0 / 4 alternately, & 15; the value (sign included) from the
 * 16-entry table by vpermps. Per token: p = w0 x0, fma(w1, x1); acc = fma(p, scale, acc). */
COLIBRI_AVX512_INLINE __m512 colibri_fp4x16_avx512(const uint8_t *q, __m512 lut)
{
    const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
    __m128i b = _mm_loadl_epi64((const __m128i *)q);
    __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    idx = _mm512_and_si512(_mm512_srlv_epi32(idx, shifts), _mm512_set1_epi32(15));
    return _mm512_permutexvar_ps(idx, lut);
}

COLIBRI_AVX512_INLINE void colibri_dot_mxfp4_avx512_body(const uint8_t *row, ptrdiff_t cols,
                                                         const float *x, ptrdiff_t xs,
                                                         float *out, ptrdiff_t os, const int NT)
{
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const uint8_t *scales = row + cols / 2;
    __m512 acc[COLIBRI_MAX_NT];
    ptrdiff_t b;
    int t;
    for (t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (b = 0; b < cols / 32; b++) {
        const uint8_t *q = row + 16 * b;
        const __m512 w0 = colibri_fp4x16_avx512(q, lut), w1 = colibri_fp4x16_avx512(q + 8, lut);
        const __m512 s = _mm512_set1_ps(colibri_e8m0_to_f32(scales[b]));
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
