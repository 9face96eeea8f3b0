/* csrc/avx2.h: the AVX2 + FMA + F16C bodies of the f32-activation row kernels (plain and
 * quantized weight rows), the shared AVX2 helpers (horizontal sum, exp, SiLU) and the read
 * bandwidth kernel. The integer-activation bodies are in avx2_int.h. */
#ifndef COLIBRI_AVX2_H
#define COLIBRI_AVX2_H

#include "scalar.h"

#if COLIBRI_X86
/* ------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C. 8 floats per vector. Per token two independent partial accumulators,
 * so consecutive FMAs do not wait on each other.
 */

#define COLIBRI_AVX2_FN static __attribute__((target("avx2,fma,f16c")))
#define COLIBRI_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

COLIBRI_AVX2_INLINE float colibri_hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (attention scores minus their maximum, SiLU's exp(-|g|)): Cephes' expf
 * reduction and polynomial (~1 ulp); 0 below -87.3 (where expf is subnormal or 0), NaN for
 * NaN. */
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

/* silu(g) * u on 8 lanes: g * (g >= 0 ? 1 : e) / (1 + e) with e = exp(-|g|), which never
 * overflows; very negative g gives -0 as the scalar formula does, NaN stays NaN. */
COLIBRI_AVX2_INLINE __m256 colibri_silu_mul8_avx2(__m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 e = colibri_exp_neg_avx2(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 num = _mm256_blendv_ps(one, e, neg);
    return _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(g, num), _mm256_add_ps(one, e)), u);
}

/* h[i] = silu(h[i]) * u[i] for i < n; the last n % 8 through the same 8-lane code (a
 * padded copy), so an element's bits do not depend on where a call's range starts. */
COLIBRI_AVX2_FN void colibri_silu_mul_avx2(float *h, const float *u, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(h + i, colibri_silu_mul8_avx2(_mm256_loadu_ps(h + i),
                                                       _mm256_loadu_ps(u + i)));
    if (i < n) {
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(a, h + i, (size_t)(n - i) * 4);
        memcpy(b, u + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(a, colibri_silu_mul8_avx2(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
        memcpy(h + i, a, (size_t)(n - i) * 4);
    }
}

/* 8 consecutive elements of a plain-format row, widened to f32. */
COLIBRI_AVX2_INLINE __m256 colibri_load8_avx2(int fmt, const uint8_t *row, ptrdiff_t c)
{
    if (fmt == COLIBRI_F32) return _mm256_loadu_ps((const float *)(row + 4 * c));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * c));
    if (fmt == COLIBRI_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX2_INLINE float colibri_elem_avx2(int fmt, const uint8_t *row, ptrdiff_t c)
{
    if (fmt == COLIBRI_F16) return _cvtsh_ss(colibri_ld_u16(row + 2 * c));
    return colibri_plain_elem(fmt, row, c);
}

/* NT and fmt are compile-time constants after inlining: one unrolled body per pair. */
COLIBRI_AVX2_INLINE void colibri_dot_plain_avx2_body(const int fmt, const uint8_t *row,
                                                     ptrdiff_t cols, const float *x,
                                                     ptrdiff_t xs, float *out, ptrdiff_t os,
                                                     const int NT)
{
    __m256 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT];
    float r[COLIBRI_MAX_NT];
    int t;
    ptrdiff_t c = 0;
    for (t = 0; t < NT; t++) { a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); }
    for (; c + 16 <= cols; c += 16) {
        __m256 w0 = colibri_load8_avx2(fmt, row, c), w1 = colibri_load8_avx2(fmt, row, c + 8);
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + c;
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), a0[t]);
            a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), a1[t]);
        }
    }
    if (c + 8 <= cols) {
        __m256 w0 = colibri_load8_avx2(fmt, row, c);
        for (t = 0; t < NT; t++)
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * xs + c), a0[t]);
        c += 8;
    }
    for (t = 0; t < NT; t++) r[t] = colibri_hsum256(_mm256_add_ps(a0[t], a1[t]));
    for (; c < cols; c++) {                      /* < 8 leftover columns */
        float w = colibri_elem_avx2(fmt, row, c);
        for (t = 0; t < NT; t++) r[t] += w * x[t * xs + c];
    }
    for (t = 0; t < NT; t++) out[t * os] = r[t];
}

/* Quantized rows (q8, q4). The order of operations for one (row, token) output is fixed,
 * whatever nt is, so a token gets the same bits alone or in a block of tokens:
 *   each 32-element block of group g: its codes as four 8-lane f32 vectors w0..w3 (q4
 *   without the -8), x0..x3 the matching x;
 *     t0 = w0*x0 for the group's first block, else fma(w0, x0, t0); t1 likewise (w1, x1);
 *     t0 = fma(w2, x2, t0); t1 = fma(w3, x3, t1)
 *   a[g % 2] = fma(t0 + t1, s_g, a[g % 2])          (two chains: consecutive groups alternate)
 *   out = hsum(a0 + a1)                                                       q8
 *   out = hsum(a0 + a1) - 8 hsum(o), o = sum over chunks of 8 groups of s * xsum      q4
 * The f16 scales of 8 groups are widened by one vcvtph2ps. q4 block: two 8-byte loads
 * zero-extended to 32-bit lanes; & 15 gives elements 0..7 and 8..15, >> 4 gives 16..23 and
 * 24..31 (the Q4_0 order): no shuffles.
 */
COLIBRI_AVX2_INLINE void colibri_codes32_avx2(const int fmt, const uint8_t *q, __m256 w[4])
{
    if (fmt == COLIBRI_Q4) {
        const __m256i m = _mm256_set1_epi32(15);
        __m256i l0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        __m256i l1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(l0, m));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(l1, m));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(l0, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(l1, 4));
    } else {
        int j;
        for (j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(q + 8 * j))));
    }
}

/* tsum[t] = t0 + t1 of one group for NT tokens; qg: the group's codes, xg: x at its first
 * column (token t at xg + t * xs). */
COLIBRI_AVX2_INLINE void colibri_group_avx2(const int fmt, const uint8_t *qg, ptrdiff_t group,
                                            const float *xg, ptrdiff_t xs, __m256 *tsum,
                                            const int NT, const int G32)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;          /* bytes per 32 codes */
    __m256 t0[COLIBRI_MAX_NT], t1[COLIBRI_MAX_NT], w[4];
    ptrdiff_t b;
    int t;
    colibri_codes32_avx2(fmt, qg, w);
    for (t = 0; t < NT; t++) {
        const float *xt = xg + t * xs;
        t0[t] = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
        t1[t] = _mm256_mul_ps(w[1], _mm256_loadu_ps(xt + 8));
        t0[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), t0[t]);
        t1[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), t1[t]);
    }
    for (b = 32; !G32 && b < group; b += 32) {
        colibri_codes32_avx2(fmt, qg + b / 32 * bpb, w);
        for (t = 0; t < NT; t++) {
            const float *xt = xg + t * xs + b;
            t0[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xt), t0[t]);
            t1[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), t1[t]);
            t0[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), t0[t]);
            t1[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), t1[t]);
        }
    }
    for (t = 0; t < NT; t++) tsum[t] = _mm256_add_ps(t0[t], t1[t]);
}

COLIBRI_AVX2_INLINE void colibri_dot_quant_avx2_body(const int fmt, const uint8_t *row,
                                                     ptrdiff_t cols, ptrdiff_t group,
                                                     const float *x, ptrdiff_t xs,
                                                     const float *xsum, ptrdiff_t ss,
                                                     float *out, ptrdiff_t os, const int NT,
                                                     const int G32)
{
    const ptrdiff_t ng = cols / group, qpg = fmt == COLIBRI_Q4 ? group / 2 : group;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2), *q = row;
    const float *xp = x;
    __m256 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT], o[COLIBRI_MAX_NT], ts[COLIBRI_MAX_NT];
    float sb[8];
    ptrdiff_t g0, g;
    int t;
    for (t = 0; t < NT; t++) {
        a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); o[t] = _mm256_setzero_ps();
    }
    for (g0 = 0; g0 < ng; g0 += 8) {
        const ptrdiff_t n8 = ng - g0 < 8 ? ng - g0 : 8;
        __m256 sc;
        if (n8 == 8) {
            sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * g0)));
        } else {                                 /* last chunk: zero-padded copy */
            uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            memcpy(h, scales + 2 * g0, (size_t)(2 * n8));
            sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        }
        _mm256_storeu_ps(sb, sc);
        if (fmt == COLIBRI_Q4) {
            for (t = 0; t < NT; t++) {
                const float *st = xsum + t * ss + g0;
                __m256 xv;
                if (n8 == 8) {
                    xv = _mm256_loadu_ps(st);
                } else {
                    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    memcpy(f, st, (size_t)(4 * n8));
                    xv = _mm256_loadu_ps(f);
                }
                o[t] = _mm256_fmadd_ps(sc, xv, o[t]);
            }
        }
        for (g = 0; g + 1 < n8; g += 2) {        /* g0 is even: local parity = global */
            __m256 sa = _mm256_broadcast_ss(sb + g), sn = _mm256_broadcast_ss(sb + g + 1);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm256_fmadd_ps(ts[t], sa, a0[t]);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a1[t] = _mm256_fmadd_ps(ts[t], sn, a1[t]);
        }
        if (g < n8) {                            /* an odd count: the last group is even */
            __m256 sa = _mm256_broadcast_ss(sb + g);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm256_fmadd_ps(ts[t], sa, a0[t]);
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum256(_mm256_add_ps(a0[t], a1[t]));
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * colibri_hsum256(o[t]) : r;
    }
}

/* One entry point per (format, path); the switch picks the body unrolled for nt tokens. */
#define COLIBRI_PLAIN_ROWS(BODY, FMT, NT)                                                   \
    for (i = 0; i < nrows; i++) BODY(FMT, row0 + i * rs, cols, x, xs, out + i, os, NT);

#define COLIBRI_DEF_PLAIN(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,       \
                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                          \
    {                                                                                       \
        ptrdiff_t i;                                                                        \
        (void)group; (void)xsum; (void)ss;                                                  \
        switch (nt) {                                                                       \
        case 1: COLIBRI_PLAIN_ROWS(BODY, FMT, 1) break;                                     \
        case 2: COLIBRI_PLAIN_ROWS(BODY, FMT, 2) break;                                     \
        case 3: COLIBRI_PLAIN_ROWS(BODY, FMT, 3) break;                                     \
        default: COLIBRI_PLAIN_ROWS(BODY, FMT, 4) break;                                    \
        }                                                                                   \
    }

/* Quantized entry points: one body per nt, and per group == 32 (the default group: one
 * 32-element block per scale, straight-line) or any multiple of 32. */
#define COLIBRI_QUANT_ROWS(BODY, FMT, NT, G32)                                              \
    for (i = 0; i < nrows; i++)                                                             \
        BODY(FMT, row0 + i * rs, cols, group, x, xs, xsum, ss, out + i, os, NT, G32);

#define COLIBRI_QUANT_CASES(BODY, FMT, G32)                                                  \
    switch (nt) {                                                                           \
    case 1: COLIBRI_QUANT_ROWS(BODY, FMT, 1, G32) break;                                    \
    case 2: COLIBRI_QUANT_ROWS(BODY, FMT, 2, G32) break;                                    \
    case 3: COLIBRI_QUANT_ROWS(BODY, FMT, 3, G32) break;                                    \
    default: COLIBRI_QUANT_ROWS(BODY, FMT, 4, G32) break;                                   \
    }

#define COLIBRI_DEF_QUANT(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,       \
                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                          \
    {                                                                                       \
        ptrdiff_t i;                                                                        \
        if (group == 32) {                                                                  \
            COLIBRI_QUANT_CASES(BODY, FMT, 1)                                               \
        } else {                                                                            \
            COLIBRI_QUANT_CASES(BODY, FMT, 0)                                               \
        }                                                                                   \
    }

COLIBRI_DEF_PLAIN(colibri_dot_f32_avx2, COLIBRI_F32, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_PLAIN(colibri_dot_f16_avx2, COLIBRI_F16, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_PLAIN(colibri_dot_bf16_avx2, COLIBRI_BF16, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_QUANT(colibri_dot_q8_avx2, COLIBRI_Q8, COLIBRI_AVX2_FN,
                  colibri_dot_quant_avx2_body)
COLIBRI_DEF_QUANT(colibri_dot_q4_avx2, COLIBRI_Q4, COLIBRI_AVX2_FN,
                  colibri_dot_quant_avx2_body)

COLIBRI_AVX2_FN uint64_t colibri_read_sum_avx2(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    uint64_t lanes[4], total;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    _mm256_storeu_si256((__m256i *)lanes, a0);
    total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return total + colibri_read_sum_scalar(p + i, n - i);
}
#endif /* COLIBRI_X86 */

#endif /* COLIBRI_AVX2_H */
