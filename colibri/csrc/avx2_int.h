/* csrc/avx2_int.h: the AVX2 bodies of the integer-activation row kernels ("idot": int8 and
 * int16 codes against q8/q4 rows) and of the activation quantizer (bit for bit the scalar
 * one in types.h). The avx512 path runs these too; the VNNI paths (vnni.h) share their body
 * text (COLIBRI_DEF_IDOT_BODY) with another chunk function (dispatch.h). */
#ifndef COLIBRI_AVX2_INT_H
#define COLIBRI_AVX2_INT_H

#include "avx2.h"

#if COLIBRI_X86
/* int8 activations (AVX2), on the packed token rows of colibri_quantize_row. Integer part,
 * per pair of 32-blocks (j, j+1) and token, llama.cpp's technique with the layout chosen so
 * that nothing crosses a 128-bit lane:
 *   q4: the pair's 32 code bytes, one load: lo = v & 15 (block j elements 0..15 | block j+1
 *       elements 0..15), hi = v >> 4 & 15 (elements 16..31 of each), matching the packed
 *       q; vpmaddubsw(lo, q_lo) + vpmaddubsw(hi, q_hi): 16 s16 (|.| <= 4 * 15 * 127,
 *       exact); vpmaddwd with ones -> 8 s32, lane half 0 block j, 1 block j+1. The -8 is
 *       folded out per block with s = 8 * sum q (colibri_quantize_block).
 *   q8: lo / hi = the halves of both blocks (two 16-byte loads each); vpmaddubsw(|w|,
 *       sign(q, w)) per half (|.| <= 2 * 128 * 127 < 2^15, exact); vpmaddwd with ones, add.
 * Three vphaddd levels over the 4 pairs of a chunk of 8 blocks leave the 8 block sums
 * isum_b as one int32 vector in lane order 0 2 4 6 1 3 5 7, the order of the packed d, s;
 * the weight scales are permuted once per chunk to match. The float part is lane-wise:
 *   acc = fma(float(isum - s (q4)), scale * d, acc)    per chunk of 8 blocks
 *   out = hsum(acc)
 * Integer sums are exact and the float operations of one token do not depend on nt, so a
 * token gets the same bits alone or in a block. A weight pair is decoded once for all nt
 * tokens. The last chunk may hold fewer than 8 blocks (zero vectors stand in; the padded d
 * and s are 0) and an odd last block is loaded alone (16 bytes: never past the row).
 */
COLIBRI_AVX2_INLINE void colibri_ipair_avx2(const int fmt, const uint8_t *wq, const int two,
                                            __m256i *lo, __m256i *hi)
{
    /* codes of blocks j (and j+1 when two) at wq: lo/hi as described above */
    const __m256i m15 = _mm256_set1_epi8(15);
    if (fmt == COLIBRI_Q4) {
        __m256i v = two ? _mm256_loadu_si256((const __m256i *)wq)
                        : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                  _mm_loadu_si128((const __m128i *)wq), 0);
        *lo = _mm256_and_si256(v, m15);
        *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    } else {
        __m128i a0 = _mm_loadu_si128((const __m128i *)wq);
        __m128i a1 = _mm_loadu_si128((const __m128i *)(wq + 16));
        if (two) {
            *lo = _mm256_inserti128_si256(_mm256_castsi128_si256(a0),
                                          _mm_loadu_si128((const __m128i *)(wq + 32)), 1);
            *hi = _mm256_inserti128_si256(_mm256_castsi128_si256(a1),
                                          _mm_loadu_si128((const __m128i *)(wq + 48)), 1);
        } else {
            *lo = _mm256_inserti128_si256(_mm256_setzero_si256(), a0, 0);
            *hi = _mm256_inserti128_si256(_mm256_setzero_si256(), a1, 0);
        }
    }
}

/* isum[t] = the int32 block sums of the chunk's blocks (n <= 8 of them; 0 past n) for NT
 * tokens, lane order 0 2 4 6 1 3 5 7; wq: the codes of the chunk's first block, q: token
 * 0's packed q at that block. */
COLIBRI_AVX2_INLINE void colibri_ichunk_avx2(const int fmt, const uint8_t *wq, const int8_t *q,
                                             ptrdiff_t qs, const int n, __m256i ones,
                                             __m256i *isum, const int NT)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;            /* bytes per 32 codes */
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];
    int k, t;
    for (k = 0; k < 4; k++) {                                    /* pair k: blocks 2k, 2k+1 */
        __m256i lo = _mm256_setzero_si256(), hi = lo, alo = lo, ahi = lo;
        if (2 * k < n) colibri_ipair_avx2(fmt, wq + 2 * k * bpb, 2 * k + 1 < n, &lo, &hi);
        if (fmt == COLIBRI_Q8) { alo = _mm256_sign_epi8(lo, lo); ahi = _mm256_sign_epi8(hi, hi); }
        for (t = 0; t < NT; t++) {
            const int8_t *qt = q + t * qs + 64 * k;
            __m256i p = _mm256_setzero_si256();
            if (2 * k < n) {
                __m256i ql = _mm256_loadu_si256((const __m256i *)qt);
                __m256i qh = _mm256_loadu_si256((const __m256i *)(qt + 32));
                if (fmt == COLIBRI_Q4) {
                    p = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ql),
                                                           _mm256_maddubs_epi16(hi, qh)), ones);
                } else {
                    p = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(ql, lo)), ones),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, _mm256_sign_epi8(qh, hi)), ones));
                }
            }
            if (k & 1)
                h[k >> 1][t] = _mm256_hadd_epi32(v[k >> 1][t], p);
            else
                v[k >> 1][t] = p;
        }
    }
    for (t = 0; t < NT; t++) isum[t] = _mm256_hadd_epi32(h[0][t], h[1][t]);
}

/* The int16 weight codes of blocks j (and j + 1 when two) at w, widened in-lane: c[0..3]. */
COLIBRI_AVX2_INLINE void colibri_iwiden16_avx2(const int fmt, const uint8_t *w, const int two,
                                               __m256i c[4])
{
    if (fmt == COLIBRI_Q4) {
        const __m256i z = _mm256_setzero_si256(), m15 = _mm256_set1_epi16(15);
        __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                        : _mm256_inserti128_si256(z, _mm_loadu_si128((const __m128i *)w), 0);
        __m256i u0 = _mm256_unpacklo_epi8(b, z), u1 = _mm256_unpackhi_epi8(b, z);
        c[0] = _mm256_and_si256(u0, m15);
        c[1] = _mm256_and_si256(u1, m15);
        c[2] = _mm256_srli_epi16(u0, 4);
        c[3] = _mm256_srli_epi16(u1, 4);
    } else {
        __m256i lo, hi;
        colibri_ipair_avx2(fmt, w, two, &lo, &hi);
        c[0] = _mm256_srai_epi16(_mm256_unpacklo_epi8(lo, lo), 8);
        c[1] = _mm256_srai_epi16(_mm256_unpackhi_epi8(lo, lo), 8);
        c[2] = _mm256_srai_epi16(_mm256_unpacklo_epi8(hi, hi), 8);
        c[3] = _mm256_srai_epi16(_mm256_unpackhi_epi8(hi, hi), 8);
    }
}

/* colibri_ichunk_avx2 on int16 codes (packed by colibri_qpos16): a pair's weight codes are
 * widened to 16 bits in-lane once (q4: the 32 code bytes unpacked with zero, then & 15 and
 * >> 4; q8: each byte unpacked with itself, then >> 8 arithmetic), giving four vectors
 * c[0..3] = elements 0-7, 8-15, 16-23, 24-31 of both blocks (lane half 0 block j, half 1
 * block j+1); per token, four vpmaddwd with the matching 16-code runs and three adds leave the
 * same 8 int32 partial sums per pair as the int8 body (|.| <= 32 * 128 * 32767 < 2^31). */
COLIBRI_AVX2_INLINE void colibri_ichunk16_avx2(const int fmt, const uint8_t *wq,
                                               const int8_t *q, ptrdiff_t qs, const int n,
                                               __m256i *isum, const int NT)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;            /* bytes per 32 codes */
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];
    int k, t;
    for (k = 0; k < 4; k++) {                                    /* pair k: blocks 2k, 2k+1 */
        __m256i c[4];
        c[0] = c[1] = c[2] = c[3] = _mm256_setzero_si256();
        if (2 * k < n) colibri_iwiden16_avx2(fmt, wq + 2 * k * bpb, 2 * k + 1 < n, c);
        for (t = 0; t < NT; t++) {
            const __m256i *qt = (const __m256i *)(const void *)(q + t * qs + 128 * k);
            __m256i p = _mm256_setzero_si256();
            if (2 * k < n)
                p = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(c[0], _mm256_loadu_si256(qt)),
                                     _mm256_madd_epi16(c[1], _mm256_loadu_si256(qt + 1))),
                    _mm256_add_epi32(_mm256_madd_epi16(c[2], _mm256_loadu_si256(qt + 2)),
                                     _mm256_madd_epi16(c[3], _mm256_loadu_si256(qt + 3))));
            if (k & 1)
                h[k >> 1][t] = _mm256_hadd_epi32(v[k >> 1][t], p);
            else
                v[k >> 1][t] = p;
        }
    }
    for (t = 0; t < NT; t++) isum[t] = _mm256_hadd_epi32(h[0][t], h[1][t]);
}

/* The scales of a chunk's blocks in lane order 0 2 4 6 1 3 5 7. Fast path (the main loop,
 * no call and no stack copy, so the loop keeps its constants in registers), by group size:
 *   mode 0, group 32: the chunk's 8 scales, one load, permuted;
 *   mode 1, group 64, 128, 256: the chunk starts a group (b0 is a multiple of 8) and
 *           spans 8 >> lg of them: those scales (never past the row), lane l takes
 *           scale (block of lane l) >> lg;
 *   mode 2, group a multiple of 512: the chunk lies inside one group: one scale. */
COLIBRI_AVX2_INLINE __m256 colibri_iscales_avx2(const uint8_t *scales, ptrdiff_t b0, int mode,
                                                int lg, __m256i idx)
{
    if (mode == 0)
        return _mm256_permutevar8x32_ps(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * b0))), idx);
    if (mode == 1) {                  /* the 8 >> lg scales of the chunk, exactly */
        const uint8_t *p = scales + 2 * (b0 >> lg);
        __m128i raw;
        if (lg == 1) {
            raw = _mm_loadl_epi64((const __m128i *)p);
        } else if (lg == 2) {
            int32_t v;
            memcpy(&v, p, 4);
            raw = _mm_cvtsi32_si128(v);
        } else {
            raw = _mm_cvtsi32_si128((int)colibri_ld_u16(p));
        }
        return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(raw), idx);
    }
    return _mm256_set1_ps(_cvtsh_ss(colibri_ld_u16(scales + 2 * (b0 >> lg))));
}

/* Any group size, blocks b0 .. b0 + n - 1 (n <= 8), 0 past n: the chunks the fast path does
 * not take (the last one, and every chunk of a group size that is not 32 * 2^k). */
COLIBRI_AVX2_INLINE __m256 colibri_iscales_any_avx2(const uint8_t *scales, ptrdiff_t b0, int n,
                                                    ptrdiff_t group)
{
    const ptrdiff_t bpg = group / 32;
    uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    ptrdiff_t g = b0 / bpg, r = b0 % bpg;
    int j;
    for (j = 0; j < n; j++) {
        h[colibri_dpos(j)] = colibri_ld_u16(scales + 2 * g);
        if (++r == bpg) { r = 0; g++; }
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* The scales of the last, partial chunk (blocks b0 .. nb - 1, b0 a multiple of 8) for a
 * group of 32 * 2^lg with ng >= 8 groups in the row: the row's last 8 scales in one load
 * (never past the row), each lane's group picked by index. Lanes past the row's last block
 * take some scale of the row; their d and s are 0. Replaces colibri_iscales_any_avx2 there:
 * its division and its store-to-load round trip cost ~25 cycles per row, measured as int8
 * q4 one-token GEMV 2048 x 1408 (a 4-block tail) 16.7 GB/s vs 22 for 1536 columns. */
COLIBRI_AVX2_INLINE __m256 colibri_iscales_tail_avx2(const uint8_t *scales, ptrdiff_t b0,
                                                     ptrdiff_t ng, int lg)
{
    const __m256i blocks = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);    /* lane -> block */
    __m256 last8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * (ng - 8))));
    __m256i g = _mm256_srlv_epi32(_mm256_add_epi32(blocks, _mm256_set1_epi32((int)b0)),
                                  _mm256_set1_epi32(lg));
    return _mm256_permutevar8x32_ps(last8, _mm256_sub_epi32(g, _mm256_set1_epi32((int)(ng - 8))));
}

/* acc[t] += float(isum[t] - s (q4)) * (sv * d) for the chunk at block b0 */
COLIBRI_AVX2_INLINE void colibri_iacc_avx2(const int fmt, const __m256i *isum, __m256 sv,
                                           const float *d, const int32_t *s, ptrdiff_t ds,
                                           ptrdiff_t b0, __m256 *acc, const int NT)
{
    int t;
    for (t = 0; t < NT; t++) {
        __m256i i = isum[t];
        if (fmt == COLIBRI_Q4)
            i = _mm256_sub_epi32(i, _mm256_loadu_si256((const __m256i *)(s + t * ds + b0)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i),
                                 _mm256_mul_ps(sv, _mm256_loadu_ps(d + t * ds + b0)), acc[t]);
    }
}

/* MODE (a compile-time constant, from the group size; see colibri_iscales_avx2): 0 group 32,
 * 1 group 64 / 128 / 256, 2 group 512 * k, 3 any other multiple of 32 (the generic scales).
 * WIDE (compile-time): 0 int8 codes, 1 int16 codes (colibri_ichunk16_avx2). */
COLIBRI_AVX2_INLINE void colibri_ichunk_any_avx2(const int fmt, const int WIDE,
                                                 const uint8_t *wq, const int8_t *q,
                                                 ptrdiff_t qs, const int n, __m256i ones,
                                                 const int32_t *s, ptrdiff_t ds,
                                                 __m256i *isum, const int NT)
{
    (void)s; (void)ds;                     /* the chunk's s (the VNNI q8 body's correction) */
    if (WIDE)
        colibri_ichunk16_avx2(fmt, wq, q, qs, n, isum, NT);
    else
        colibri_ichunk_avx2(fmt, wq, q, qs, n, ones, isum, NT);
}

/* The body of the integer row kernels, one (row, NT tokens) output: NAME with attributes ATTR
 * (the target of its path) over the chunk function CHUNK (colibri_ichunk_any_avx2 here; the
 * VNNI paths, vnni.h, pass theirs). The scales, the q4 fold, the accumulation order and the
 * prefetches are this text on every path, so their float results are the same bits. */
#define COLIBRI_DEF_IDOT_BODY(NAME, ATTR, CHUNK)                                                \
ATTR void NAME(const int fmt, const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,              \
               const int8_t *q, ptrdiff_t qs, const float *d, const int32_t *s, ptrdiff_t ds,   \
               float *out, ptrdiff_t os, const int NT, const int MODE, const int WIDE)          \
{                                                                                               \
    const ptrdiff_t qpb = WIDE ? 64 : 32;                  /* code bytes per 32-block */        \
    const ptrdiff_t nb = cols / 32, bpb = fmt == COLIBRI_Q4 ? 16 : 32;                          \
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);                        \
    const ptrdiff_t bpg = group / 32;                                                           \
    const __m256i ones = _mm256_set1_epi16(1);                                                  \
    __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);      /* lane -> block */           \
    int lg = 0, t;                                                                              \
    ptrdiff_t b0;                                                                               \
    __m256 acc[COLIBRI_MAX_NT];                                                                 \
    __m256i isum[COLIBRI_MAX_NT];                                                               \
    while (((ptrdiff_t)1 << lg) < bpg) lg++;                                                    \
    if (MODE == 1) idx = _mm256_srlv_epi32(idx, _mm256_set1_epi32(lg));                         \
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                      \
    for (b0 = 0; MODE != 3 && b0 + 8 <= nb; b0 += 8) {                                          \
        const __m256 sv = colibri_iscales_avx2(scales, b0, MODE, lg, idx);                      \
        {                                       /* the chunk's 2 (q4) or 4 (q8) lines, ahead */ \
            const char *pf = (const char *)(row + b0 * bpb) + COLIBRI_PREFETCH_BYTES;           \
            _mm_prefetch(pf, _MM_HINT_T1);                                                      \
            _mm_prefetch(pf + 64, _MM_HINT_T1);                                                 \
            if (fmt == COLIBRI_Q8) {                                                            \
                _mm_prefetch(pf + 128, _MM_HINT_T1);                                            \
                _mm_prefetch(pf + 192, _MM_HINT_T1);                                            \
            }                                                                                   \
        }                                                                                       \
        CHUNK(fmt, WIDE, row + b0 * bpb, q + qpb * b0, qs, 8, ones, s + b0, ds, isum, NT);                  \
        colibri_iacc_avx2(fmt, isum, sv, d, s, ds, b0, acc, NT);                                \
    }                                                                                           \
    if (MODE != 3) {                                                                            \
        /* The chunk prefetches above request the code bytes of the whole chunks only; the      \
         * rest of the row ahead (codes of a partial last chunk, and the scales: every 64       \
         * bytes and the row's last byte) is requested here, after the codes, so that every     \
         * line of the rows ahead is. With 1024 columns the scales are 1 line in 9 (512 +       \
         * 64 bytes); left to a demand miss per row (the hardware prefetcher restarts at        \
         * every 4 KiB page, and the mmap'd file has no huge pages) they cost about a           \
         * quarter of the rate. Measured on the mixtral-mini q4 file, 1 thread, best of 6,      \
         * before/after interleaved: 3584 x 1024 gate matrices 10 -> 13 GB/s, 1024 x 3584       \
         * down 11 -> 13, the decode expert FFN (T=1, K=2) 11.2-11.7 -> 12.6-12.8, the          \
         * 32000 x 1024 head from a cold cache 10-11 -> 12-14. Issuing these before the         \
         * chunk loop (ahead of the row's codes) measured no better than none on the down       \
         * rows. (Those figures are for L1 prefetches; see COLIBRI_PREFETCH_BYTES for L2.) */   \
        const char *p0 = (const char *)(row + (nb & ~(ptrdiff_t)7) * bpb) + COLIBRI_PREFETCH_BYTES; \
        const char *p1 = (const char *)(scales + 2 * (cols / group)) + COLIBRI_PREFETCH_BYTES;  \
        for (; p0 < p1; p0 += 64) _mm_prefetch(p0, _MM_HINT_T1);                                \
        _mm_prefetch(p1 - 1, _MM_HINT_T1);                                                      \
    }                                                                                           \
    for (; b0 < nb; b0 += 8) {                        /* the rest: the last 1..7 blocks, or all */ \
        const int n = nb - b0 < 8 ? (int)(nb - b0) : 8;                                         \
        const ptrdiff_t ng = cols / group;                                                      \
        const __m256 sv = MODE == 2 ? colibri_iscales_avx2(scales, b0, MODE, lg, idx)           \
                        : MODE != 3 && ng >= 8 ? colibri_iscales_tail_avx2(scales, b0, ng, lg)  \
                        : colibri_iscales_any_avx2(scales, b0, n, group);                       \
        CHUNK(fmt, WIDE, row + b0 * bpb, q + qpb * b0, qs, n, ones, s + b0, ds, isum, NT);                  \
        colibri_iacc_avx2(fmt, isum, sv, d, s, ds, b0, acc, NT);                                \
    }                                                                                           \
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);                             \
}

COLIBRI_DEF_IDOT_BODY(colibri_idot_avx2_body, COLIBRI_AVX2_INLINE, colibri_ichunk_any_avx2)

#define COLIBRI_IQUANT_ROWS(BODY, FMT, NT, MODE)                                            \
    for (i = 0; i < nrows; i++)                                                             \
        BODY(FMT, row0 + i * rs, cols, group, q, qs, d, s, ds, out + i, os, NT, MODE, wide);

#define COLIBRI_IQUANT_CASES(BODY, FMT, MODE)                                               \
    switch (nt) {                                                                           \
    case 1: COLIBRI_IQUANT_ROWS(BODY, FMT, 1, MODE) break;                                  \
    case 2: COLIBRI_IQUANT_ROWS(BODY, FMT, 2, MODE) break;                                  \
    case 3: COLIBRI_IQUANT_ROWS(BODY, FMT, 3, MODE) break;                                  \
    default: COLIBRI_IQUANT_ROWS(BODY, FMT, 4, MODE) break;                                 \
    }

/* One entry point per format and code width; the group size picks the scale MODE, nt the
 * unrolled body, and the row loop runs inside each (so the body's constants are set up
 * once). */
#define COLIBRI_DEF_IQUANT(NAME, FMT, WIDE, ATTR, BODY)                                      \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,         \
                   const int32_t *s, ptrdiff_t ds, int nt, float *out, ptrdiff_t os)       \
    {                                                                                       \
        const ptrdiff_t bpg = group / 32;                                                   \
        const int wide = WIDE;                                                              \
        ptrdiff_t i;                                                                        \
        if (bpg == 1) {                                                                     \
            COLIBRI_IQUANT_CASES(BODY, FMT, 0)                                              \
        } else if (bpg & (bpg - 1)) {                                                       \
            COLIBRI_IQUANT_CASES(BODY, FMT, 3)                                              \
        } else if (bpg <= 8) {                                                              \
            COLIBRI_IQUANT_CASES(BODY, FMT, 1)                                              \
        } else {                                                                            \
            COLIBRI_IQUANT_CASES(BODY, FMT, 2)                                              \
        }                                                                                   \
    }

COLIBRI_DEF_IQUANT(colibri_idot_q8_avx2, COLIBRI_Q8, 0, COLIBRI_AVX2_FN, colibri_idot_avx2_body)
COLIBRI_DEF_IQUANT(colibri_idot_q4_avx2, COLIBRI_Q4, 0, COLIBRI_AVX2_FN, colibri_idot_avx2_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q8_avx2, COLIBRI_Q8, 1, COLIBRI_AVX2_FN, colibri_idot_avx2_body)
COLIBRI_DEF_IQUANT(colibri_idot16_q4_avx2, COLIBRI_Q4, 1, COLIBRI_AVX2_FN, colibri_idot_avx2_body)

/* colibri_block_scale_scalar and the codes in AVX2, bit for bit: the same f32 operations
 * (max |x|, amax / qmax, 1 / d, x * id), and vcvtps2dq rounds to nearest even as the
 * scalar magic-number add does (both in the default rounding mode). The codes r[0..3]
 * (elements 0-7 .. 24-31, int32) are set when the result is 0; *s = 8 * their sum. */
COLIBRI_AVX2_INLINE int colibri_block_codes_avx2(const float *xb, float qmax, __m256i r[4],
                                                 float *d, int32_t *s)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 fmax = _mm256_set1_ps(3.402823466e+38f);
    __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    __m256 a0 = _mm256_and_ps(x0, absmask), a1 = _mm256_and_ps(x1, absmask);
    __m256 a2 = _mm256_and_ps(x2, absmask), a3 = _mm256_and_ps(x3, absmask);
    __m256 ok = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(a0, fmax, _CMP_LE_OQ),
                                            _mm256_cmp_ps(a1, fmax, _CMP_LE_OQ)),
                              _mm256_and_ps(_mm256_cmp_ps(a2, fmax, _CMP_LE_OQ),
                                            _mm256_cmp_ps(a3, fmax, _CMP_LE_OQ)));
    __m256 m = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    __m256 vid;
    __m256i t;
    __m128i t4;
    float db, id;
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    db = _mm_cvtss_f32(m4) / qmax;
    id = db != 0.0f ? 1.0f / db : 0.0f;
    *s = 0;
    if (_mm256_movemask_ps(ok) != 0xFF) { *d = NAN; return 1; }
    if (id > 3.402823466e+38f) { *d = 0.0f; return 2; }
    *d = db;
    vid = _mm256_set1_ps(id);
    r[0] = _mm256_cvtps_epi32(_mm256_mul_ps(x0, vid));
    r[1] = _mm256_cvtps_epi32(_mm256_mul_ps(x1, vid));
    r[2] = _mm256_cvtps_epi32(_mm256_mul_ps(x2, vid));
    r[3] = _mm256_cvtps_epi32(_mm256_mul_ps(x3, vid));
    t = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    *s = 8 * _mm_cvtsi128_si32(t4);
    return 0;
}

/* colibri_quantize_block_scalar in AVX2, bit for bit. */
COLIBRI_AVX2_FN float colibri_quantize_block_avx2(const float *xb, int8_t *lo, int8_t *hi,
                                                  int32_t *s)
{
    __m256i r[4], p;
    float d;
    if (colibri_block_codes_avx2(xb, 127.0f, r, &d, s)) {
        memset(lo, 0, 16);
        memset(hi, 0, 16);
        return d;
    }
    /* packs interleave 128-bit lanes: 0..3 4..7 of each r end in dword order 0 4 1 5 2 6 3 7 */
    p = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128((__m128i *)lo, _mm256_castsi256_si128(p));
    _mm_storeu_si128((__m128i *)hi, _mm256_extracti128_si256(p, 1));
    return d;
}

/* colibri_quantize_block16_scalar in AVX2, bit for bit (the codes are within int16, so the
 * saturating pack is exact). */
COLIBRI_AVX2_FN float colibri_quantize_block16_avx2(const float *xb, int16_t *base, int32_t *s)
{
    __m256i r[4], p;
    float d;
    int i;
    if (colibri_block_codes_avx2(xb, 32767.0f, r, &d, s)) {
        for (i = 0; i < 4; i++) memset(base + 16 * i, 0, 16);
        return d;
    }
    /* packs interleave 128-bit lanes: (r0, r1) -> elements 0-3 8-11 | 4-7 12-15; the 64-bit
     * permute 0 2 1 3 gives 0-7 | 8-15, the two runs of 8 */
    for (i = 0; i < 2; i++) {
        p = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2 * i], r[2 * i + 1]), 0xD8);
        _mm_storeu_si128((__m128i *)(void *)(base + 32 * i), _mm256_castsi256_si128(p));
        _mm_storeu_si128((__m128i *)(void *)(base + 32 * i + 16), _mm256_extracti128_si256(p, 1));
    }
    return d;
}
#endif /* COLIBRI_X86 */

#endif /* COLIBRI_AVX2_INT_H */
