/* csrc/vnni.h: the VNNI bodies of the integer-activation row kernels ("idot": int8 and int16
 * codes against q8/q4 rows), for two paths (dispatch.h):
 *   avx512vnni  AVX-512 VNNI + VL, EVEX encoding (and the avx512 path's other bodies);
 *   avxvnni     AVX-VNNI, VEX encoding, for CPUs with it but without AVX-512 (and the
 *               avx2 path's other bodies).
 * Both are colibri_idot_avx2_body's structure (the body text is shared: COLIBRI_DEF_IDOT_BODY
 * in avx2_int.h); only the integer part of a chunk differs, 256-bit on avxvnni and 512-bit on
 * avx512vnni (a pair's products in one vector, avx512_int.h; the same integers):
 *   int8:  vpdpbusd (u8 x s8, 4 products summed into each int32 lane, no saturation) does
 *          what vpmaddubsw + vpmaddwd(ones) + vpaddd do. Per pair and token:
 *          q4: p = dpbusd(dpbusd(0, lo, ql), hi, qh), the nibbles 0..15 as the u8 operand.
 *              vpmaddubsw saturates its pairs to int16, but no pair of the AVX2 body reaches
 *              the bound: |pair| <= 2 * 15 * 127 = 3810 (the vpaddw of two, 7620), so both
 *              bodies sum the same 8 byte products exactly into each int32 lane.
 *          q8: the weights as u8 w + 128 (w ^ 0x80, once per pair for all tokens): p =
 *              dpbusd(dpbusd(0, lo ^ 0x80, ql), hi ^ 0x80, qh), and after the reduction
 *              each block sum less 128 * sum q = 16 * s (the s row the q4 fold uses, same
 *              lane order): sum (w + 128) q - 128 sum q = sum w q, exact in int32 (|.| <=
 *              32 * 255 * 127 before the correction). The AVX2 body gets the same exact
 *              sum with vpsignb (|w| x sign(q, w): |pair| <= 2 * 128 * 127 = 32512 < 32767,
 *              the codes q in [-127, 127], so its vpmaddubsw never saturates either); the
 *              xor saves its two vpsignb per pair and token. Padding: a block past the row
 *              (the partner of an odd last block, lanes past n) has d = 0 and s = 0.
 *   int16: vpdpwssd (s16 x s16, 2 products summed and accumulated into each int32 lane, no
 *          saturation: the non-"s" form) does vpmaddwd + vpaddd: per pair and token four
 *          chained vpdpwssd for four vpmaddwd and three vpaddd; vpmaddwd's one inexact case
 *          (-32768 * -32768 twice) cannot occur (|code| <= 32767), the sums stay below 2^31
 *          (|.| <= 32 * 128 * 32767), so the lanes are again the same integers.
 * Everything after the integer block sums (the hadd reduction to lane order 0 2 4 6 1 3 5 7,
 * the scales, the q4 fold, fma per chunk, the final horizontal sum) is the AVX2 text, so a
 * VNNI path's result is the avx2 path's, bit for bit. The EVEX body is also compiled with
 * AVX-512VL, so it has 32 vector registers (the 4-token body spills less).
 * The 512-bit chunks (change 30), one token, 3584 x 1024 / 1024 x 1024 q4, 1 thread, Zen 5:
 * int16 26.2 -> 28.6 GB/s from L2, 25.9 -> 29.0 streamed; int8 36.0 -> 37.0 (L2).
 */
#ifndef COLIBRI_VNNI_H
#define COLIBRI_VNNI_H

#include "avx2_int.h"
#include "avx512.h"
#include "avx512_int.h"

#if COLIBRI_VNNI
#define COLIBRI_AVX512VNNI_TARGET COLIBRI_AVX512_TARGET ",avx512vnni"
#define COLIBRI_AVX512VNNI_FN static __attribute__((target(COLIBRI_AVX512VNNI_TARGET)))
#define COLIBRI_AVX512VNNI_INLINE \
    static inline __attribute__((always_inline, target(COLIBRI_AVX512VNNI_TARGET)))
#define COLIBRI_AVXVNNI_TARGET "avx2,fma,f16c,avxvnni"
#define COLIBRI_AVXVNNI_FN static __attribute__((target(COLIBRI_AVXVNNI_TARGET)))
#define COLIBRI_AVXVNNI_INLINE \
    static inline __attribute__((always_inline, target(COLIBRI_AVXVNNI_TARGET)))

/* The chunk functions of one VNNI path (SFX: its name; ATTR: its inline attributes; DPBUSD,
 * DPWSSD: the intrinsics of its encoding), with colibri_ichunk_any_avx2's signature (ones is
 * unused). The loops are colibri_ichunk_avx2's and colibri_ichunk16_avx2's. */
#define COLIBRI_DEF_VNNI_CHUNKS(SFX, ATTR, DPBUSD, DPWSSD)                                   \
ATTR void colibri_ichunk_##SFX(const int fmt, const uint8_t *wq, const int8_t *q,            \
                               ptrdiff_t qs, const int n, const int32_t *s, ptrdiff_t ds,    \
                               __m256i *isum, const int NT)                                  \
{                                                                                            \
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;                                       \
    const __m256i m80 = _mm256_set1_epi8((char)0x80);                                        \
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];                                      \
    int k, t;                                                                                \
    for (k = 0; k < 4; k++) {                                                                \
        __m256i lo = _mm256_setzero_si256(), hi = lo;                                        \
        if (2 * k < n) colibri_ipair_avx2(fmt, wq + 2 * k * bpb, 2 * k + 1 < n, &lo, &hi);   \
        if (fmt == COLIBRI_Q8) { lo = _mm256_xor_si256(lo, m80); hi = _mm256_xor_si256(hi, m80); } \
        for (t = 0; t < NT; t++) {                                                           \
            const int8_t *qt = q + t * qs + 64 * k;                                          \
            __m256i p = _mm256_setzero_si256();                                              \
            if (2 * k < n) {                                                                 \
                __m256i ql = _mm256_loadu_si256((const __m256i *)qt);                        \
                __m256i qh = _mm256_loadu_si256((const __m256i *)(qt + 32));                 \
                p = DPBUSD(DPBUSD(p, lo, ql), hi, qh);                                       \
            }                                                                                \
            if (k & 1)                                                                       \
                h[k >> 1][t] = _mm256_hadd_epi32(v[k >> 1][t], p);                           \
            else                                                                             \
                v[k >> 1][t] = p;                                                            \
        }                                                                                    \
    }                                                                                        \
    for (t = 0; t < NT; t++) {                                                               \
        isum[t] = _mm256_hadd_epi32(h[0][t], h[1][t]);                                       \
        if (fmt == COLIBRI_Q8)              /* - 128 * sum q = - 16 * s, in the same lanes */ \
            isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(                           \
                _mm256_loadu_si256((const __m256i *)(const void *)(s + t * ds)), 4));        \
    }                                                                                        \
}                                                                                            \
                                                                                             \
ATTR void colibri_ichunk16_##SFX(const int fmt, const uint8_t *wq, const int8_t *q,          \
                                 ptrdiff_t qs, const int n, __m256i *isum, const int NT)     \
{                                                                                            \
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;                                       \
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];                                      \
    int k, t;                                                                                \
    for (k = 0; k < 4; k++) {                                                                \
        __m256i c[4];                                                                        \
        c[0] = c[1] = c[2] = c[3] = _mm256_setzero_si256();                                  \
        if (2 * k < n) colibri_iwiden16_avx2(fmt, wq + 2 * k * bpb, 2 * k + 1 < n, c);       \
        for (t = 0; t < NT; t++) {                                                           \
            const __m256i *qt = (const __m256i *)(const void *)(q + t * qs + 128 * k);       \
            __m256i p = _mm256_setzero_si256();                                              \
            if (2 * k < n) {                                                                 \
                p = DPWSSD(p, c[0], _mm256_loadu_si256(qt));                                 \
                p = DPWSSD(p, c[1], _mm256_loadu_si256(qt + 1));                             \
                p = DPWSSD(p, c[2], _mm256_loadu_si256(qt + 2));                             \
                p = DPWSSD(p, c[3], _mm256_loadu_si256(qt + 3));                             \
            }                                                                                \
            if (k & 1)                                                                       \
                h[k >> 1][t] = _mm256_hadd_epi32(v[k >> 1][t], p);                           \
            else                                                                             \
                v[k >> 1][t] = p;                                                            \
        }                                                                                    \
    }                                                                                        \
    for (t = 0; t < NT; t++) isum[t] = _mm256_hadd_epi32(h[0][t], h[1][t]);                  \
}                                                                                            \
                                                                                             \
ATTR void colibri_ichunk_any_##SFX(const int fmt, const int WIDE, const uint8_t *wq,         \
                                   const int8_t *q, ptrdiff_t qs, const int n, __m256i ones, \
                                   const int32_t *s, ptrdiff_t ds, __m256i *isum,            \
                                   const int NT)                                             \
{                                                                                            \
    (void)ones;                                                                              \
    if (WIDE)                                                                                \
        colibri_ichunk16_##SFX(fmt, wq, q, qs, n, isum, NT);                                 \
    else                                                                                     \
        colibri_ichunk_##SFX(fmt, wq, q, qs, n, s, ds, isum, NT);                            \
}

COLIBRI_DEF_VNNI_CHUNKS(avxvnni, COLIBRI_AVXVNNI_INLINE, _mm256_dpbusd_avx_epi32,
                        _mm256_dpwssd_avx_epi32)

/* The avx512vnni path's chunks are 512-bit (avx512_int.h): a pair's products in one vector.
 * int8: [lo | hi] of colibri_ipair_avx2 (q8: as u8 w + 128) in one vector. q4: the pair's 32
 * code bytes in both halves, the upper half shifted right by 4, then & 15. q8: the 64 code
 * bytes' quadwords reordered 0 1 4 5 2 3 6 7 (the halves of both blocks), ^ 0x80. */
COLIBRI_AVX512VNNI_INLINE __m512i colibri_ipair_512(const int fmt, const uint8_t *w,
                                                    const int two)
{
    if (fmt == COLIBRI_Q4) {
        __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                        : _mm256_maskz_loadu_epi8(0xFFFFu, w);
        __m512i v = _mm512_broadcast_i64x4(b);
        return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4),
                                _mm512_set1_epi8(15));
    } else {
        __m512i v = two ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w);
        v = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), v);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
}

/* colibri_ichunk_avx512vnni's contract (the q8 correction - 16 s included) in 512 bits: one
 * vpdpbusd per pair and token against the 64 code bytes at 64 k ([ql | qh]). */
COLIBRI_AVX512VNNI_INLINE void colibri_ichunk_512_avx512vnni(const int fmt, const uint8_t *wq,
                                                             const int8_t *q, ptrdiff_t qs,
                                                             const int n, const int32_t *s,
                                                             ptrdiff_t ds, __m256i *isum,
                                                             const int NT)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;
    __m512i u[2][COLIBRI_MAX_NT], pk[COLIBRI_MAX_NT];
    int k, t;
    for (t = 0; t < NT; t++) pk[t] = _mm512_setzero_si512();    /* (set at k = 0; for gcc) */
    for (k = 0; k < 4; k++) {
        __m512i z = _mm512_setzero_si512();
        if (2 * k < n) z = colibri_ipair_512(fmt, wq + 2 * k * bpb, 2 * k + 1 < n);
        for (t = 0; t < NT; t++) {
            __m512i p = _mm512_setzero_si512();
            if (2 * k < n)
                p = _mm512_dpbusd_epi32(p, z, _mm512_loadu_si512(q + t * qs + 64 * k));
            if (k & 1)
                u[k >> 1][t] = colibri_ifold2_512(pk[t], p);
            else
                pk[t] = p;
        }
    }
    for (t = 0; t < NT; t++) {
        isum[t] = colibri_ifold4_512(u[0][t], u[1][t]);
        if (fmt == COLIBRI_Q8)                  /* - 128 * sum q = - 16 * s, in the same lanes */
            isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(
                _mm256_loadu_si256((const __m256i *)(const void *)(s + t * ds)), 4));
    }
}

COLIBRI_DEF_ICHUNK16_512(avx512vnni, COLIBRI_AVX512VNNI_INLINE, _mm512_dpwssd_epi32)

COLIBRI_AVX512VNNI_INLINE void colibri_ichunk_any_avx512vnni(const int fmt, const int WIDE,
                                                         const uint8_t *wq, const int8_t *q,
                                                         ptrdiff_t qs, const int n,
                                                         __m256i ones, const int32_t *s,
                                                         ptrdiff_t ds, __m256i *isum,
                                                         const int NT)
{
    (void)ones;
    if (WIDE)
        colibri_ichunk16_512_avx512vnni(fmt, wq, q, qs, n, isum, NT);
    else
        colibri_ichunk_512_avx512vnni(fmt, wq, q, qs, n, s, ds, isum, NT);
}

COLIBRI_DEF_IDOT_BODY(colibri_idot_avx512vnni_body, COLIBRI_AVX512VNNI_INLINE,
                      colibri_ichunk_any_avx512vnni)
COLIBRI_DEF_IDOT_BODY(colibri_idot_avxvnni_body, COLIBRI_AVXVNNI_INLINE,
                      colibri_ichunk_any_avxvnni)

COLIBRI_DEF_IQUANT(colibri_idot_q8_avx512vnni, COLIBRI_Q8, 0, COLIBRI_AVX512VNNI_FN,
                   colibri_idot_avx512vnni_body)
COLIBRI_DEF_IQUANT(colibri_idot_q4_avx512vnni, COLIBRI_Q4, 0, COLIBRI_AVX512VNNI_FN,
                   colibri_idot_avx512vnni_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q8_avx512vnni, COLIBRI_Q8, 1, COLIBRI_AVX512VNNI_FN,
                   colibri_idot_avx512vnni_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q4_avx512vnni, COLIBRI_Q4, 1, COLIBRI_AVX512VNNI_FN,
                   colibri_idot_avx512vnni_body)

COLIBRI_DEF_IQUANT(colibri_idot_q8_avxvnni, COLIBRI_Q8, 0, COLIBRI_AVXVNNI_FN,
                   colibri_idot_avxvnni_body)
COLIBRI_DEF_IQUANT(colibri_idot_q4_avxvnni, COLIBRI_Q4, 0, COLIBRI_AVXVNNI_FN,
                   colibri_idot_avxvnni_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q8_avxvnni, COLIBRI_Q8, 1, COLIBRI_AVXVNNI_FN,
                   colibri_idot_avxvnni_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q4_avxvnni, COLIBRI_Q4, 1, COLIBRI_AVXVNNI_FN,
                   colibri_idot_avxvnni_body)
#endif /* COLIBRI_VNNI */

#endif /* COLIBRI_VNNI_H */
