/* csrc/avx512_int.h: the 512-bit integer part of the integer-activation row kernels ("idot",
 * avx2_int.h): one chunk of 8 blocks at a time, two blocks per pair as before, but a pair's
 * products in one 512-bit vector where the AVX2 and 256-bit VNNI bodies use two or four
 * 256-bit ones. Only the chunk function changes: the chunk's 8 int32 block sums come out as
 * the same integers in the same 256-bit lane order (0 2 4 6 1 3 5 7), and everything after
 * them (scales, q4 fold, fma per chunk, horizontal sum) is COLIBRI_DEF_IDOT_BODY's AVX2 text,
 * so these bodies give the avx2 path's floats bit for bit.
 *
 * A pair's vector P (16 int32 lanes, four 128-bit lanes L0..L3) holds partial sums of block
 * j in L0 and L2 and of block j + 1 in L1 and L3, for both code widths:
 *   int16: c01 = [c0 | c1], c23 = [c2 | c3] of colibri_iwiden16_avx2 (elements 0-15 and
 *          16-31 of both blocks), against the packed token row's 64-byte runs at 128 k and
 *          128 k + 64 (which are [qt0 | qt1], [qt2 | qt3] of the AVX2 body): two vpmaddwd
 *          (or vpdpwssd) where the AVX2 body has four.
 *   int8 (MXFP4's chunk, mxfp4.h): [lo | hi] of the pair decode against the 64 bytes at
 *          64 k ([ql | qh]): one vpdpbusd where the 256-bit VNNI body has two. (For q4 / q8
 *          that measured level with the 256-bit VNNI chunk, which they keep.)
 * The fold of a chunk's four P (colibri_ifold2_512, colibri_ifold4_512): unpack and add the
 * 32-bit and then the 64-bit lanes of two P so that each 128-bit lane holds one partial sum
 * of each of the four pairs, then add the two 256-bit halves: block 2 k + h of pair k lands
 * in lane k + 4 h, the AVX2 order. Integer sums are exact in any order (|.| <= 32 * 128 *
 * 32767 < 2^31, as in the AVX2 body), so the order of these adds does not show.
 */
#ifndef COLIBRI_AVX512_INT_H
#define COLIBRI_AVX512_INT_H

#include "avx2_int.h"
#include "avx512.h"

#if COLIBRI_X86
/* Two pairs' P (k even, k + 1) -> one vector: 128-bit lane L = [P_k, P_k+1, P_k, P_k+1]
 * partial sums of lane L's block. */
COLIBRI_AVX512_INLINE __m512i colibri_ifold2_512(__m512i pk, __m512i pk1)
{
    return _mm512_add_epi32(_mm512_unpacklo_epi32(pk, pk1), _mm512_unpackhi_epi32(pk, pk1));
}

/* Pairs 0, 1 (u01) and 2, 3 (u23) -> the chunk's 8 block sums, lane order 0 2 4 6 1 3 5 7. */
COLIBRI_AVX512_INLINE __m256i colibri_ifold4_512(__m512i u01, __m512i u23)
{
    __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23),
                                 _mm512_unpackhi_epi64(u01, u23));
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* The int16 weight codes of blocks j (and j + 1 when two) at w: c01 = [c0 | c1], c23 =
 * [c2 | c3] of colibri_iwiden16_avx2. q4: the 32 code bytes zero-extended to 16 bits
 * (128-bit lanes: bytes 0-7, 8-15, 16-23, 24-31), lanes reordered 0 2 1 3, then & 15 and
 * >> 4. q8: the 64 code bytes' quadwords reordered 0 4 1 5 2 6 3 7 and sign-extended. An odd
 * last block is read alone (16 or 32 bytes, masked: never past the row). */
COLIBRI_AVX512_INLINE void colibri_iwiden16_512(const int fmt, const uint8_t *w, const int two,
                                                __m512i *c01, __m512i *c23)
{
    if (fmt == COLIBRI_Q4) {
        __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                        : _mm256_maskz_loadu_epi8(0xFFFFu, w);
        __m512i x = _mm512_cvtepu8_epi16(b);
        x = _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));
        *c01 = _mm512_and_si512(x, _mm512_set1_epi16(15));
        *c23 = _mm512_srli_epi16(x, 4);
    } else {
        __m512i v = two ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w);
        v = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7), v);
        *c01 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
        *c23 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
    }
}

/* acc + vpmaddwd(a, b): vpdpwssd's result without VNNI (the same integers: no pair of codes
 * reaches vpmaddwd's one inexact case, -32768 * -32768 twice). */
COLIBRI_AVX512_INLINE __m512i colibri_dpwssd_avx512(__m512i acc, __m512i a, __m512i b)
{
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

/* colibri_ichunk16_avx2's contract (isum[t]: the chunk's int32 block sums for NT tokens,
 * lane order 0 2 4 6 1 3 5 7; n <= 8 blocks, 0 past n) with 512-bit pair products; SFX: the
 * path, ATTR its inline attributes, DPWSSD its int16 multiply-accumulate. */
#define COLIBRI_DEF_ICHUNK16_512(SFX, ATTR, DPWSSD)                                          \
ATTR void colibri_ichunk16_512_##SFX(const int fmt, const uint8_t *wq, const int8_t *q,     \
                                     ptrdiff_t qs, const int n, __m256i *isum, const int NT) \
{                                                                                            \
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;                                       \
    __m512i u[2][COLIBRI_MAX_NT], pk[COLIBRI_MAX_NT];                                        \
    int k, t;                                                                                \
    for (t = 0; t < NT; t++) pk[t] = _mm512_setzero_si512();  /* (set at k = 0; for gcc) */  \
    for (k = 0; k < 4; k++) {                                                                \
        __m512i c01 = _mm512_setzero_si512(), c23 = c01;                                     \
        if (2 * k < n) colibri_iwiden16_512(fmt, wq + 2 * k * bpb, 2 * k + 1 < n, &c01, &c23); \
        for (t = 0; t < NT; t++) {                                                           \
            const int8_t *qt = q + t * qs + 128 * k;                                         \
            __m512i p = _mm512_setzero_si512();                                              \
            if (2 * k < n)                                                                   \
                p = DPWSSD(DPWSSD(p, c01, _mm512_loadu_si512(qt)), c23,                      \
                           _mm512_loadu_si512(qt + 64));                                     \
            if (k & 1)                                                                       \
                u[k >> 1][t] = colibri_ifold2_512(pk[t], p);                                 \
            else                                                                             \
                pk[t] = p;                                                                   \
        }                                                                                    \
    }                                                                                        \
    for (t = 0; t < NT; t++) isum[t] = colibri_ifold4_512(u[0][t], u[1][t]);                 \
}

COLIBRI_DEF_ICHUNK16_512(avx512, COLIBRI_AVX512_INLINE, colibri_dpwssd_avx512)

/* The avx512 path's chunk function (colibri_ichunk_any_avx2's signature): int16 codes in
 * 512 bits, int8 codes the AVX2 chunk. */
COLIBRI_AVX512_INLINE void colibri_ichunk_any_avx512(const int fmt, const int WIDE,
                                                     const uint8_t *wq, const int8_t *q,
                                                     ptrdiff_t qs, const int n, __m256i ones,
                                                     const int32_t *s, ptrdiff_t ds,
                                                     __m256i *isum, const int NT)
{
    (void)s; (void)ds;
    if (WIDE)
        colibri_ichunk16_512_avx512(fmt, wq, q, qs, n, isum, NT);
    else
        colibri_ichunk_avx2(fmt, wq, q, qs, n, ones, isum, NT);
}

COLIBRI_DEF_IDOT_BODY(colibri_idot_avx512_body, COLIBRI_AVX512_INLINE, colibri_ichunk_any_avx512)

COLIBRI_DEF_IQUANT(colibri_idot16_q8_avx512, COLIBRI_Q8, 1, COLIBRI_AVX512_FN,
                   colibri_idot_avx512_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q4_avx512, COLIBRI_Q4, 1, COLIBRI_AVX512_FN,
                   colibri_idot_avx512_body)
#endif /* COLIBRI_X86 */

#endif /* COLIBRI_AVX512_INT_H */
