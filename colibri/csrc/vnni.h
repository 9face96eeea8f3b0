/* csrc/vnni.h: the VNNI bodies of the integer-activation row kernels ("idot": int8 and int16
 * codes against q8/q4 rows), for two paths (dispatch.h):
 *   avx512vnni  AVX-512 VNNI + VL, EVEX encoding (and the avx512 path's other bodies);
 *   avxvnni     AVX-VNNI, VEX encoding, for CPUs with it but without AVX-512 (and the
 *               avx2 path's other bodies).
 * Both are colibri_idot_avx2_body's structure (the body text is shared: COLIBRI_DEF_IDOT_BODY
 * in avx2_int.h); only the integer part of a chunk differs, 256-bit (int16 on avx512vnni:
 * 512-bit, a pair's products in one vector, avx512_int.h; the same integers):
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
 * The 512-bit int16 chunk (change 30), one token, 3584 x 1024 q4 in cache, 1 thread, Zen 5:
 * 29.0 GB/s (256-bit VNNI) -> 31.1.
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
 * DPWSSD: the intrinsics of its encoding): the int8 chunk (colibri_ichunk_avx2's loop), the
 * 256-bit int16 chunk (colibri_ichunk16_avx2's), and the path's chunk function with
 * colibri_ichunk_any_avx2's signature (ones is unused) over its int8 chunk and CHUNK16. */
#define COLIBRI_DEF_VNNI_CHUNK8(SFX, ATTR, DPBUSD)                                           \
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
}

#define COLIBRI_DEF_VNNI_CHUNK16(SFX, ATTR, DPWSSD)                                          \
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
}

#define COLIBRI_DEF_VNNI_ANY(SFX, ATTR, CHUNK16)                                             \
ATTR void colibri_ichunk_any_##SFX(const int fmt, const int WIDE, const uint8_t *wq,         \
                                   const int8_t *q, ptrdiff_t qs, const int n, __m256i ones, \
                                   const int32_t *s, ptrdiff_t ds, __m256i *isum,            \
                                   const int NT)                                             \
{                                                                                            \
    (void)ones;                                                                              \
    if (WIDE)                                                                                \
        CHUNK16(fmt, wq, q, qs, n, isum, NT);                                                \
    else                                                                                     \
        colibri_ichunk_##SFX(fmt, wq, q, qs, n, s, ds, isum, NT);                            \
}

COLIBRI_DEF_VNNI_CHUNK8(avxvnni, COLIBRI_AVXVNNI_INLINE, _mm256_dpbusd_avx_epi32)
COLIBRI_DEF_VNNI_CHUNK16(avxvnni, COLIBRI_AVXVNNI_INLINE, _mm256_dpwssd_avx_epi32)
COLIBRI_DEF_VNNI_ANY(avxvnni, COLIBRI_AVXVNNI_INLINE, colibri_ichunk16_avxvnni)

/* avx512vnni: the 256-bit int8 chunk (a 512-bit one, [lo | hi] in one vpdpbusd, measured
 * level with it: 40.5 vs 41.1 GB/s of q4 in cache, change 30) and the 512-bit int16 chunk
 * of avx512_int.h (31.1 vs 29.0). */
COLIBRI_DEF_VNNI_CHUNK8(avx512vnni, COLIBRI_AVX512VNNI_INLINE, _mm256_dpbusd_epi32)
COLIBRI_DEF_ICHUNK16_512(avx512vnni, COLIBRI_AVX512VNNI_INLINE, _mm512_dpwssd_epi32)
COLIBRI_DEF_VNNI_ANY(avx512vnni, COLIBRI_AVX512VNNI_INLINE, colibri_ichunk16_512_avx512vnni)

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
