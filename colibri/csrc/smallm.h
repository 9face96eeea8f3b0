/* csrc/smallm.h: the small-M integer row kernels (int16 activation codes against q4 / q8
 * rows) for the AVX-512 paths: each weight block read and decoded once for a pass of up to
 * COLIBRI_SM_MAX_NT tokens, four blocks per 512-bit vector, so a token costs fewer
 * operations than in the pair bodies of avx512_int.h / vnni.h. They replace those bodies
 * for int16 codes on the avx512vnni path (and so on amx / amx-emu below their tiles) and on
 * avx512, at every token count below the integer GEMM's crossover: the bodies of decode
 * (one token), of batched decode and of speculative verification (1-3 tokens per matrix or
 * expert, then the GEMM of igemm.h). The body text also has an int8 form (vpdpbusd on the
 * nibbles / q8 + 128); it measured no faster than the VNNI pair body (q4, 1 thread,
 * scripts/bench_igemm.py: 60 vs 65 GMAC/s at one token, level at 2-4), so it is not
 * instantiated. Measured (the same script, 1 thread, gate 3584 x 1024 + down 1024 x 3584 in
 * cache, EPYC Zen 4, interleaved runs against the pair bodies): q4 int16 GMAC/s 1 token 37.6
 * -> 41.1, 2 tokens 48.4 -> 58.4, 3 tokens 53.4 -> 60.3; q8 int16 34.3 -> 33.2, 46.5 -> 47.8,
 * 52.7 -> 51.6 (level).
 *
 * The same bits as the avx2 path (the one float text). A row is walked in superchunks of 16
 * blocks (512 columns): row-kernel chunks A (blocks 0-7) and B (8-15). Product vector P_i
 * (i = 0..3) holds, per 128-bit lane L, the partial sums of one block: L = 0, 1, 2, 3 ->
 * blocks 2i, 2i + 1 of A, 2i, 2i + 1 of B (4 int32 lanes per block):
 *   q4: the 16 code bytes of each of those blocks are one 128-bit lane of one vector (a
 *       32-byte load of A's pair, one of B's); int16: unpacked with zero, & 15 and >> 4
 *       give four vectors, elements 0-7, 8-15, 16-23, 24-31 of the four blocks; int8: & 15
 *       and >> 4 give elements 0-15 and 16-31.
 *   q8: the two 64-byte pairs permuted by quadwords into the same runs, sign-extended
 *       (int16) or + 128 (int8, vpdpbusd's unsigned operand, corrected by 16 s as in vnni.h).
 * The activation codes are repacked once per call (colibri_sm_repack) so that each run of a
 * P_i is one 64-byte load: the 32-byte units of the packed rows (types.h: a pair of blocks'
 * run of 8 int16 codes, or half of a pair's int8 codes) reordered as [A pair i | B pair i].
 * Per token four (int16) or two (int8) multiply-adds per P_i, then the fold: unpack and add
 * 32-bit and then 64-bit lanes of the four P_i, which leaves each block's exact int32 sum
 * with chunk A in the low 256 bits and B in the high, each in lane order 0 2 4 6 1 3 5 7:
 * the order of the packed d and s and of avx2_int.h's accumulators. Then per token, in
 * 512 bits, the q4 fold (- s), the convert and (scale x d), and two 256-bit fmas, A then
 * B, into the row's 8-lane accumulator: the avx2 body's float operations in its order
 * (chunk by chunk), the scales from its own functions (colibri_iscales_*), its horizontal
 * sum. Fewer operations per token and block than the pair bodies: one fold per 16 blocks
 * instead of one per 8 and half the float operations; per block of weights one code load
 * and 1.5 (q4 int16) decoding operations instead of 2.5.
 *
 * Integer sums are exact in any order (int16: |.| <= 32 * 128 * 32767 < 2^31; int8 q8 with
 * + 128: 32 * 255 * 127), so these lanes hold avx2_int.h's integers. Bounds of the inputs:
 * rows of q4 / q8 codes, cols a multiple of 32, the token rows of colibri_quantize_row.
 */
#ifndef COLIBRI_SMALLM_H
#define COLIBRI_SMALLM_H

#include <stdlib.h>

#include "avx2_int.h"
#include "avx512_int.h"
#include "vnni.h"

/* Tokens per pass (the callers pass at most colibri_idot_block's number; a call with more
 * runs passes of this many). 4: a token's three product vectors between blocks and its
 * accumulator fit the 32 registers with the weight vectors; 8 spill. Measured, 1 thread,
 * scripts/bench_igemm.py (gate 3584 x 1024 + down, in cache), q4 int16 GMAC/s at 8 tokens:
 * 8 per pass 38.8, the pair body (3 per pass) 51.7, the integer GEMM 70.2. */
#define COLIBRI_SM_MAX_NT 4     /* (COLIBRI_SM_NT's cases) */
/* A call with fewer rows than this takes the pair body (the repack is per call). */
#define COLIBRI_SM_MIN_ROWS 4
/* Repacked token rows up to this many bytes live on the stack (the pool's threads have
 * 1 MiB), larger ones in a malloc'd buffer for the call. */
#define COLIBRI_SM_STACK_BYTES 32768

/* Bytes of one repacked token row of nb blocks: superchunks of 16 blocks, 512 (int8) or
 * 1024 (int16) bytes each. */
static inline ptrdiff_t colibri_sm_row_bytes(int wide, ptrdiff_t nb)
{
    return (nb + 15) / 16 * (wide ? 1024 : 512);
}

/* nt packed token rows (q, stride qs bytes; colibri_quantize_row's layout, nb blocks) into
 * dst (stride colibri_sm_row_bytes): the 32-byte unit r (0..UP-1, UP = 4 int16 / 2 int8) of
 * pair k = 8 S + 4 h + i moves from 32 UP k + 32 r to 256 UP S + 64 UP i + 64 r + 32 h;
 * units past the row's pairs are zero. */
static inline void colibri_sm_repack(int wide, const int8_t *q, ptrdiff_t qs, int nt,
                                     ptrdiff_t nb, int8_t *dst)
{
    const ptrdiff_t up = wide ? 4 : 2, npairs = (nb + 1) / 2;
    const ptrdiff_t rb = colibri_sm_row_bytes(wide, nb), nk = rb / (32 * up);
    ptrdiff_t k, r;
    int t;
    for (t = 0; t < nt; t++) {
        const int8_t *src = q + t * qs;
        int8_t *o = dst + t * rb;
        for (k = 0; k < nk; k++) {
            const ptrdiff_t S = k >> 3, h = (k >> 2) & 1, i = k & 3;
            int8_t *to = o + 256 * up * S + 64 * up * i + 32 * h;
            for (r = 0; r < up; r++) {
                if (k < npairs)
                    memcpy(to + 64 * r, src + 32 * up * k + 32 * r, 32);
                else
                    memset(to + 64 * r, 0, 32);
            }
        }
    }
}

#if COLIBRI_X86
/* The q4 code bytes of P_i: blocks 2i, 2i + 1 of chunk A (at a) and of chunk B (at b), na /
 * nb of each chunk's blocks present (0..8; the others read as zero, never loaded). */
COLIBRI_AVX512_INLINE __m512i colibri_sm_q4bytes(const uint8_t *a, const uint8_t *b, int i,
                                                 int na, int nbk, const int full)
{
    __m256i lo, hi;
    if (full) {
        lo = _mm256_loadu_si256((const __m256i *)(const void *)(a + 32 * i));
        hi = _mm256_loadu_si256((const __m256i *)(const void *)(b + 32 * i));
    } else {
        const __mmask32 ma = (2 * i < na ? 0xFFFFu : 0u) | (2 * i + 1 < na ? 0xFFFF0000u : 0u);
        const __mmask32 mb = (2 * i < nbk ? 0xFFFFu : 0u) | (2 * i + 1 < nbk ? 0xFFFF0000u : 0u);
        lo = _mm256_maskz_loadu_epi8(ma, a + 32 * i);
        hi = _mm256_maskz_loadu_epi8(mb, b + 32 * i);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The q8 code bytes of blocks 2i, 2i + 1 of one chunk (64 bytes at p + 64 i), n present. */
COLIBRI_AVX512_INLINE __m512i colibri_sm_q8bytes(const uint8_t *p, int i, int n, const int full)
{
    __mmask64 m;
    if (full) return _mm512_loadu_si512((const void *)(p + 64 * i));
    m = (2 * i < n ? 0xFFFFFFFFull : 0ull) | (2 * i + 1 < n ? 0xFFFFFFFF00000000ull : 0ull);
    return _mm512_maskz_loadu_epi8(m, p + 64 * i);
}

/* The weight vectors w[0..UP-1] of P_i (UP = 4 int16, 2 int8), matching the repacked runs. */
COLIBRI_AVX512_INLINE void colibri_sm_weights(const int fmt, const int WIDE, const uint8_t *wq,
                                              int i, int na, int nbk, const int full,
                                              __m512i w[4])
{
    if (fmt == COLIBRI_Q4) {
        const __m512i v = colibri_sm_q4bytes(wq, wq + 128, i, na, nbk, full);
        if (WIDE) {
            const __m512i z = _mm512_setzero_si512(), m15 = _mm512_set1_epi16(15);
            const __m512i lo = _mm512_unpacklo_epi8(v, z), hi = _mm512_unpackhi_epi8(v, z);
            w[0] = _mm512_and_si512(lo, m15);
            w[1] = _mm512_and_si512(hi, m15);
            w[2] = _mm512_srli_epi16(lo, 4);
            w[3] = _mm512_srli_epi16(hi, 4);
        } else {
            const __m512i m15 = _mm512_set1_epi8(15);
            w[0] = _mm512_and_si512(v, m15);
            w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
        }
    } else {
        const __m512i a = colibri_sm_q8bytes(wq, i, na, full);
        const __m512i b = colibri_sm_q8bytes(wq + 256, i, nbk, full);
        if (WIDE) {     /* quadwords [a0 a4 b0 b4 | a1 a5 b1 b5], [a2 a6 b2 b6 | a3 a7 b3 b7] */
            const __m512i t01 = _mm512_permutex2var_epi64(
                a, _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13), b);
            const __m512i t23 = _mm512_permutex2var_epi64(
                a, _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15), b);
            w[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(t01));
            w[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(t01, 1));
            w[2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(t23));
            w[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(t23, 1));
        } else {        /* 128-bit lanes [a0 a2 b0 b2], [a1 a3 b1 b3], + 128 */
            const __m512i m80 = _mm512_set1_epi8((char)0x80);
            w[0] = _mm512_xor_si512(m80, _mm512_permutex2var_epi64(
                a, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), b));
            w[1] = _mm512_xor_si512(m80, _mm512_permutex2var_epi64(
                a, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), b));
        }
    }
}

/* 32-bit then 64-bit unpack-and-add of the four P_i: block sums, [A | B] in lane order
 * 0 2 4 6 1 3 5 7 each. */
COLIBRI_AVX512_INLINE __m512i colibri_sm_fold(__m512i u01, __m512i u23)
{
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23), _mm512_unpackhi_epi64(u01, u23));
}

/* The scales of the chunk at block b0 (n of its blocks in the row), as
 * COLIBRI_DEF_IDOT_BODY picks them: its main loop's for a whole chunk (MODE 0-2), its rest
 * loop's otherwise. */
COLIBRI_AVX512_INLINE __m256 colibri_sm_scales(const uint8_t *scales, ptrdiff_t b0, int n,
                                               ptrdiff_t cols, ptrdiff_t group, int MODE,
                                               int lg, __m256i idx)
{
    const ptrdiff_t ng = cols / group;
    if (MODE != 3 && n == 8) return colibri_iscales_avx2(scales, b0, MODE, lg, idx);
    if (MODE == 2) return colibri_iscales_avx2(scales, b0, MODE, lg, idx);
    if (MODE != 3 && ng >= 8) return colibri_iscales_tail_avx2(scales, b0, ng, lg);
    return colibri_iscales_any_avx2(scales, b0, n, group);
}

/* The body: one row against NT tokens (qr: the repacked rows, token t at qr + t * qrs). SFX
 * names the path, ATTR its attributes, DPW(acc, w, a) its int16 multiply-accumulate, DPB its
 * int8 one (u8 x s8). */
#define COLIBRI_DEF_SM_BODY(SFX, ATTR, DPW, DPB)                                                \
ATTR void colibri_sm_body_##SFX(const int fmt, const int WIDE, const uint8_t *row,              \
                                ptrdiff_t cols, ptrdiff_t group, const int8_t *qr,              \
                                ptrdiff_t qrs, const float *d, const int32_t *s, ptrdiff_t ds,  \
                                float *out, ptrdiff_t os, const int NT, const int MODE)         \
{                                                                                               \
    const ptrdiff_t nb = cols / 32, bpb = fmt == COLIBRI_Q4 ? 16 : 32;                          \
    const ptrdiff_t sup = WIDE ? 1024 : 512, up = WIDE ? 4 : 2;                                 \
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);                        \
    const ptrdiff_t bpg = group / 32;                                                           \
    __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);      /* lane -> block */           \
    int lg = 0, t, i, r;                                                                        \
    ptrdiff_t b0;                                                                               \
    __m256 acc[COLIBRI_SM_MAX_NT];                                                              \
    while (((ptrdiff_t)1 << lg) < bpg) lg++;                                                    \
    if (MODE == 1) idx = _mm256_srlv_epi32(idx, _mm256_set1_epi32(lg));                         \
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                      \
    for (b0 = 0; b0 < nb; b0 += 16) {                                                           \
        const int na = nb - b0 >= 8 ? 8 : (int)(nb - b0);                                       \
        const int nbk = nb - b0 >= 16 ? 8 : nb - b0 > 8 ? (int)(nb - b0 - 8) : 0;               \
        const int full = na == 8 && nbk == 8;                                                   \
        const uint8_t *wq = row + b0 * bpb;                                                     \
        const int8_t *qs0 = qr + (b0 / 16) * sup;                                               \
        __m512i pe[COLIBRI_SM_MAX_NT], u0[COLIBRI_SM_MAX_NT], u1[COLIBRI_SM_MAX_NT];            \
        const __m256 sva = colibri_sm_scales(scales, b0, na, cols, group, MODE, lg, idx);       \
        const __m256 svb = nbk ? colibri_sm_scales(scales, b0 + 8, nbk, cols, group, MODE, lg,  \
                                                   idx) : _mm256_setzero_ps();                  \
        {                                     /* the superchunk's 4 (q4) or 8 (q8) lines, ahead */ \
            const char *pf = (const char *)wq + COLIBRI_PREFETCH_BYTES;                         \
            int l;                                                                              \
            for (l = 0; l < (fmt == COLIBRI_Q4 ? 4 : 8); l++)                                   \
                _mm_prefetch(pf + 64 * l, _MM_HINT_T1);                                         \
        }                                                                                       \
        for (t = 0; t < NT; t++)              /* (set below; GCC cannot tell) */               \
            pe[t] = u0[t] = u1[t] = _mm512_setzero_si512();                                     \
        for (i = 0; i < 4; i++) {                                                               \
            __m512i w[4];                                                                       \
            colibri_sm_weights(fmt, WIDE, wq, i, na, nbk, full, w);                             \
            for (t = 0; t < NT; t++) {                                                          \
                const int8_t *a = qs0 + t * qrs + 64 * up * i;                                  \
                __m512i p = _mm512_setzero_si512();                                             \
                for (r = 0; r < up; r++)                                                        \
                    p = WIDE ? DPW(p, w[r], _mm512_loadu_si512((const void *)(a + 64 * r)))     \
                             : DPB(p, w[r], _mm512_loadu_si512((const void *)(a + 64 * r)));    \
                if (i == 0 || i == 2) pe[t] = p;                                                \
                else if (i == 1) u0[t] = colibri_ifold2_512(pe[t], p);                          \
                else u1[t] = colibri_ifold2_512(pe[t], p);                                      \
            }                                                                                   \
        }                                                                                       \
        {                                                                                       \
            const __m512 sv = _mm512_insertf32x8(_mm512_castps256_ps512(sva), svb, 1);          \
            for (t = 0; t < NT; t++) {                                                          \
                const float *dt = d + t * ds + b0;                                              \
                const int32_t *st = s + t * ds + b0;                                            \
                __m512i isum = colibri_sm_fold(u0[t], u1[t]);                                   \
                __m512 f, m;                                                                    \
                if (nbk) {                                                                      \
                    if (fmt == COLIBRI_Q4)                                                      \
                        isum = _mm512_sub_epi32(isum, _mm512_loadu_si512((const void *)st));    \
                    else if (!WIDE)               /* q8 + 128: - 128 sum q = - 16 s */          \
                        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(                        \
                            _mm512_loadu_si512((const void *)st), 4));                          \
                    f = _mm512_cvtepi32_ps(isum);                                               \
                    m = _mm512_mul_ps(sv, _mm512_loadu_ps(dt));                                 \
                    acc[t] = _mm256_fmadd_ps(_mm512_castps512_ps256(f),                         \
                                             _mm512_castps512_ps256(m), acc[t]);                \
                    acc[t] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(f, 1),                      \
                                             _mm512_extractf32x8_ps(m, 1), acc[t]);             \
                } else {                          /* chunk A alone: the row's last 1..8 blocks */ \
                    __m256i ia = _mm512_castsi512_si256(isum);                                  \
                    if (fmt == COLIBRI_Q4)                                                      \
                        ia = _mm256_sub_epi32(ia, _mm256_loadu_si256((const __m256i *)(const void *)st)); \
                    else if (!WIDE)                                                             \
                        ia = _mm256_sub_epi32(ia, _mm256_slli_epi32(                            \
                            _mm256_loadu_si256((const __m256i *)(const void *)st), 4));         \
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia),                            \
                                             _mm256_mul_ps(sva, _mm256_loadu_ps(dt)), acc[t]);  \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    {                           /* the rest of the row ahead: its scales (see avx2_int.h) */    \
        const char *p0 = (const char *)(row + (nb & ~(ptrdiff_t)15) * bpb) + COLIBRI_PREFETCH_BYTES; \
        const char *p1 = (const char *)(scales + 2 * (cols / group)) + COLIBRI_PREFETCH_BYTES;  \
        for (; p0 < p1; p0 += 64) _mm_prefetch(p0, _MM_HINT_T1);                                \
        _mm_prefetch(p1 - 1, _MM_HINT_T1);                                                      \
    }                                                                                           \
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);                             \
}

#define COLIBRI_SM_ROWS(SFX, FMT, NT, MODE)                                                  \
    for (i = 0; i < nrows; i++)                                                              \
        colibri_sm_body_##SFX(FMT, WIDE, row0 + i * rs, cols, group, qr, qrs, d, s, ds,      \
                              out + i, os, NT, MODE);

#define COLIBRI_SM_NT(SFX, FMT, MODE)                                                        \
    switch (nt) {                                                                            \
    case 1: COLIBRI_SM_ROWS(SFX, FMT, 1, MODE) break;                                        \
    case 2: COLIBRI_SM_ROWS(SFX, FMT, 2, MODE) break;                                        \
    case 3: COLIBRI_SM_ROWS(SFX, FMT, 3, MODE) break;                                        \
    default: COLIBRI_SM_ROWS(SFX, FMT, 4, MODE) break;            /* COLIBRI_SM_MAX_NT */    \
    }

/* The pair body in passes of the tokens it takes (3 int16, COLIBRI_INT8_NT int8; its
 * callers used to pass no more). */
static inline void colibri_sm_pair_passes(colibri_idot_fn pair, int wide, const uint8_t *row0,
                                          ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,
                                          ptrdiff_t group, const int8_t *q, ptrdiff_t qs,
                                          const float *d, const int32_t *s, ptrdiff_t ds,
                                          int ntall, float *out, ptrdiff_t os)
{
    const int per = wide ? 3 : COLIBRI_INT8_NT;
    int t0, nt;
    for (t0 = 0; t0 < ntall; t0 += nt) {
        nt = ntall - t0 < per ? ntall - t0 : per;
        pair(row0, rs, nrows, cols, group, q + t0 * qs, qs, d + t0 * ds, s + t0 * ds, ds, nt,
             out + t0 * os, os);
    }
}

/* The entry point (colibri_idot_fn) of one path, format and code width: the token rows
 * repacked once, then passes of up to COLIBRI_SM_MAX_NT tokens over the rows; PAIR: the
 * pair body it stands in for (few rows, or no memory for the repack). */
#define COLIBRI_DEF_SM(NAME, SFX, FMT, WIDE_, ATTR, PAIR)                                    \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,      \
                   ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,          \
                   const int32_t *s, ptrdiff_t ds, int ntall, float *out, ptrdiff_t os)     \
    {                                                                                        \
        const int WIDE = WIDE_;                                                              \
        const ptrdiff_t bpg = group / 32, nb = cols / 32;                                   \
        const ptrdiff_t qrs = colibri_sm_row_bytes(WIDE, nb);                               \
        int8_t stack[COLIBRI_SM_STACK_BYTES] __attribute__((aligned(64)));                  \
        int8_t *heap = NULL, *qr = stack;                                                    \
        int t0, nt;                                                                          \
        ptrdiff_t i;                                                                         \
        const int npass = ntall < COLIBRI_SM_MAX_NT ? ntall : COLIBRI_SM_MAX_NT;            \
        if (nrows < COLIBRI_SM_MIN_ROWS) {                                                   \
            colibri_sm_pair_passes(PAIR, WIDE, row0, rs, nrows, cols, group, q, qs, d, s,   \
                                   ds, ntall, out, os);                                      \
            return;                                                                          \
        }                                                                                    \
        if (npass * qrs > COLIBRI_SM_STACK_BYTES) {                                          \
            heap = (int8_t *)malloc((size_t)(npass * qrs));                                  \
            if (heap == NULL) {                                                              \
                colibri_sm_pair_passes(PAIR, WIDE, row0, rs, nrows, cols, group, q, qs, d,  \
                                       s, ds, ntall, out, os);                               \
                return;                                                                      \
            }                                                                                \
            qr = heap;                                                                       \
        }                                                                                    \
        for (t0 = 0; t0 < ntall; t0 += nt) {                                                 \
            nt = ntall - t0 < COLIBRI_SM_MAX_NT ? ntall - t0 : COLIBRI_SM_MAX_NT;            \
            colibri_sm_repack(WIDE, q, qs, nt, nb, qr);                                      \
            if (bpg == 1) {                                                                  \
                COLIBRI_SM_NT(SFX, FMT, 0)                                                   \
            } else if (bpg & (bpg - 1)) {                                                    \
                COLIBRI_SM_NT(SFX, FMT, 3)                                                   \
            } else if (bpg <= 8) {                                                           \
                COLIBRI_SM_NT(SFX, FMT, 1)                                                   \
            } else {                                                                         \
                COLIBRI_SM_NT(SFX, FMT, 2)                                                   \
            }                                                                                \
            q += nt * qs; d += nt * ds; s += nt * ds; out += nt * os;                        \
        }                                                                                    \
        free(heap);                                                                          \
    }

/* avx512 (no VNNI): int16 through vpmaddwd + vpaddd (the same integers, avx512_int.h). */
#define COLIBRI_SM_DPB_NONE(acc, w, a) (acc)
COLIBRI_DEF_SM_BODY(avx512, COLIBRI_AVX512_INLINE, colibri_dpwssd_avx512, COLIBRI_SM_DPB_NONE)
COLIBRI_DEF_SM(colibri_smdot16_q8_avx512, avx512, COLIBRI_Q8, 1, COLIBRI_AVX512_FN,
               colibri_idot16_q8_avx512)
COLIBRI_DEF_SM(colibri_smdot16_q4_avx512, avx512, COLIBRI_Q4, 1, COLIBRI_AVX512_FN,
               colibri_idot16_q4_avx512)
#endif /* COLIBRI_X86 */

#if COLIBRI_VNNI
COLIBRI_DEF_SM_BODY(avx512vnni, COLIBRI_AVX512VNNI_INLINE, _mm512_dpwssd_epi32,
                    _mm512_dpbusd_epi32)
COLIBRI_DEF_SM(colibri_smdot16_q8_avx512vnni, avx512vnni, COLIBRI_Q8, 1, COLIBRI_AVX512VNNI_FN,
               colibri_idot16_q8_avx512vnni)
COLIBRI_DEF_SM(colibri_smdot16_q4_avx512vnni, avx512vnni, COLIBRI_Q4, 1, COLIBRI_AVX512VNNI_FN,
               colibri_idot16_q4_avx512vnni)
#endif /* COLIBRI_VNNI */

#endif /* COLIBRI_SMALLM_H */
