/* csrc/avx512.h: the AVX-512 F/BW/VL/DQ bodies of the f32-activation row kernels and of the
 * read bandwidth kernel (built on the AVX2 helpers). */
#ifndef COLIBRI_AVX512_H
#define COLIBRI_AVX512_H

#include "avx2.h"

#if COLIBRI_X86
/* ------------------------------------------------------------------------------------------
 * AVX-512 F/BW/VL/DQ. 16 floats per vector; plain-format tails use masked loads, which
 * never touch the masked-off bytes.
 */

#define COLIBRI_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define COLIBRI_AVX512_FN static __attribute__((target(COLIBRI_AVX512_TARGET)))
#define COLIBRI_AVX512_INLINE \
    static inline __attribute__((always_inline, target(COLIBRI_AVX512_TARGET)))

COLIBRI_AVX512_INLINE float colibri_hsum512(__m512 v)
{
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return colibri_hsum256(s);
}

/* 16 elements of a plain-format row (the first `n` of them when n < 16; the rest 0). */
COLIBRI_AVX512_INLINE __m512 colibri_load16_avx512(int fmt, const uint8_t *row, ptrdiff_t c,
                                                   __mmask16 m)
{
    if (fmt == COLIBRI_F32) return _mm512_maskz_loadu_ps(m, row + 4 * c);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * c);
    if (fmt == COLIBRI_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX512_INLINE void colibri_dot_plain_avx512_body(const int fmt, const uint8_t *row,
                                                         ptrdiff_t cols, const float *x,
                                                         ptrdiff_t xs, float *out,
                                                         ptrdiff_t os, const int NT)
{
    const __mmask16 all = 0xFFFF;
    __m512 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT];
    int t;
    ptrdiff_t c = 0;
    for (t = 0; t < NT; t++) { a0[t] = _mm512_setzero_ps(); a1[t] = _mm512_setzero_ps(); }
    for (; c + 32 <= cols; c += 32) {
        __m512 w0 = colibri_load16_avx512(fmt, row, c, all);
        __m512 w1 = colibri_load16_avx512(fmt, row, c + 16, all);
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + c;
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a1[t]);
        }
    }
    for (; c < cols; c += 16) {                  /* last 1..31 columns, masked */
        ptrdiff_t left = cols - c;
        __mmask16 m = left >= 16 ? all : (__mmask16)((1u << left) - 1u);
        __m512 w0 = colibri_load16_avx512(fmt, row, c, m);
        for (t = 0; t < NT; t++)
            a0[t] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, x + t * xs + c), a0[t]);
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum512(_mm512_add_ps(a0[t], a1[t]));
}

/* Quantized rows: the AVX2 scheme at 16 lanes. Per 32-element block, w0 = elements 0..15,
 * w1 = 16..31 (q4: one 16-byte load zero-extended to 32-bit lanes, & 15 and >> 4);
 * t0 = w0*x0 / fma, t1 = w1*x1 / fma; a[g % 2] = fma(t0 + t1, s_g, a[g % 2]); scales and
 * the q4 offset in chunks of 16 groups (masked loads for the last chunk). */
COLIBRI_AVX512_INLINE void colibri_codes32_avx512(const int fmt, const uint8_t *q, __m512 w[2])
{
    if (fmt == COLIBRI_Q4) {
        __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(l, _mm512_set1_epi32(15)));
        w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(l, 4));
    } else {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        w[1] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    }
}

COLIBRI_AVX512_INLINE void colibri_group_avx512(const int fmt, const uint8_t *qg,
                                                ptrdiff_t group, const float *xg, ptrdiff_t xs,
                                                __m512 *tsum, const int NT, const int G32)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;
    __m512 t0[COLIBRI_MAX_NT], t1[COLIBRI_MAX_NT], w[2];
    ptrdiff_t b;
    int t;
    colibri_codes32_avx512(fmt, qg, w);
    for (t = 0; t < NT; t++) {
        const float *xt = xg + t * xs;
        t0[t] = _mm512_mul_ps(w[0], _mm512_loadu_ps(xt));
        t1[t] = _mm512_mul_ps(w[1], _mm512_loadu_ps(xt + 16));
    }
    for (b = 32; !G32 && b < group; b += 32) {
        colibri_codes32_avx512(fmt, qg + b / 32 * bpb, w);
        for (t = 0; t < NT; t++) {
            const float *xt = xg + t * xs + b;
            t0[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xt), t0[t]);
            t1[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xt + 16), t1[t]);
        }
    }
    for (t = 0; t < NT; t++) tsum[t] = _mm512_add_ps(t0[t], t1[t]);
}

COLIBRI_AVX512_INLINE void colibri_dot_quant_avx512_body(const int fmt, const uint8_t *row,
                                                         ptrdiff_t cols, ptrdiff_t group,
                                                         const float *x, ptrdiff_t xs,
                                                         const float *xsum, ptrdiff_t ss,
                                                         float *out, ptrdiff_t os,
                                                         const int NT, const int G32)
{
    const ptrdiff_t ng = cols / group, qpg = fmt == COLIBRI_Q4 ? group / 2 : group;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2), *q = row;
    const float *xp = x;
    __m512 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT], o[COLIBRI_MAX_NT], ts[COLIBRI_MAX_NT];
    float sb[16];
    ptrdiff_t g0, g;
    int t;
    for (t = 0; t < NT; t++) {
        a0[t] = _mm512_setzero_ps(); a1[t] = _mm512_setzero_ps(); o[t] = _mm512_setzero_ps();
    }
    for (g0 = 0; g0 < ng; g0 += 16) {
        const ptrdiff_t n16 = ng - g0 < 16 ? ng - g0 : 16;
        const __mmask16 m = n16 == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n16) - 1u);
        __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + 2 * g0));
        _mm512_storeu_ps(sb, sc);
        if (fmt == COLIBRI_Q4)
            for (t = 0; t < NT; t++)
                o[t] = _mm512_fmadd_ps(sc, _mm512_maskz_loadu_ps(m, xsum + t * ss + g0), o[t]);
        for (g = 0; g + 1 < n16; g += 2) {
            __m512 sa = _mm512_set1_ps(sb[g]), sn = _mm512_set1_ps(sb[g + 1]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm512_fmadd_ps(ts[t], sa, a0[t]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a1[t] = _mm512_fmadd_ps(ts[t], sn, a1[t]);
        }
        if (g < n16) {
            __m512 sa = _mm512_set1_ps(sb[g]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm512_fmadd_ps(ts[t], sa, a0[t]);
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum512(_mm512_add_ps(a0[t], a1[t]));
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * colibri_hsum512(o[t]) : r;
    }
}

COLIBRI_DEF_PLAIN(colibri_dot_f32_avx512, COLIBRI_F32, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_PLAIN(colibri_dot_f16_avx512, COLIBRI_F16, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_PLAIN(colibri_dot_bf16_avx512, COLIBRI_BF16, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_QUANT(colibri_dot_q8_avx512, COLIBRI_Q8, COLIBRI_AVX512_FN,
                  colibri_dot_quant_avx512_body)
COLIBRI_DEF_QUANT(colibri_dot_q4_avx512, COLIBRI_Q4, COLIBRI_AVX512_FN,
                  colibri_dot_quant_avx512_body)

COLIBRI_AVX512_FN uint64_t colibri_read_sum_avx512(const uint8_t *p, size_t n)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
    }
    a0 = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(a0) + colibri_read_sum_scalar(p + i, n - i);
}
#endif /* COLIBRI_X86 */

#endif /* COLIBRI_AVX512_H */
