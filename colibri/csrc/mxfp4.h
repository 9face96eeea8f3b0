/* csrc/mxfp4.h: the MXFP4 row kernels (OCP microscaling FP4, GPT-OSS's experts as they ship):
 * the scalar specification, the AVX2 and AVX-512 bodies.
 *
 * Row layout (docs/format.md section 6): C/2 code bytes, byte j holding element 2j in its low
 * nibble and 2j + 1 in its high nibble (the checkpoint's `*_blocks` order), then C/32 E8M0
 * scale bytes. Element c = FP4_E2M1[nibble] * 2^(scale[c / 32] - 127).
 *
 * The integer-activation bodies ("idot", int8 and int16 codes of colibri_quantize_row) come
 * after the f32 ones: twice an FP4 value is an integer (0, +-1, +-2, +-3, +-4, +-6, +-8,
 * +-12), so a block's dot with the activation codes is an exact int32 and its scale is
 * 2^(e - 127) / 2 times the activation block's d. */
#ifndef COLIBRI_MXFP4_H
#define COLIBRI_MXFP4_H

#include "types.h"
#include "avx512.h"
#include "avx2_int.h"
#include "vnni.h"

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

/* The entry points: avx2.h's COLIBRI_DEF_PLAIN (one body unrolled per token count), the
 * format argument it passes dropped (these bodies know theirs). */
#define COLIBRI_MXFP4_AVX2_BODY(FMT, ...) colibri_dot_mxfp4_avx2_body(__VA_ARGS__)
#define COLIBRI_MXFP4_AVX512_BODY(FMT, ...) colibri_dot_mxfp4_avx512_body(__VA_ARGS__)

COLIBRI_DEF_PLAIN(colibri_dot_mxfp4_avx2, COLIBRI_MXFP4, COLIBRI_AVX2_FN, COLIBRI_MXFP4_AVX2_BODY)
COLIBRI_DEF_PLAIN(colibri_dot_mxfp4_avx512, COLIBRI_MXFP4, COLIBRI_AVX512_FN,
                  COLIBRI_MXFP4_AVX512_BODY)
#endif /* COLIBRI_X86 */

/* ==========================================================================================
 * Integer activations (activations="int8" / "int16"): the doubled FP4 codes against the packed
 * token rows, llama.cpp's MXFP4 x Q8_0 technique (MXFP4 and the activations share the block
 * of 32, so each block is one integer dot and one scale product).
 */

/* 2 * FP4_E2M1[nibble], an integer. */
static inline int colibri_fp4_code2(int nibble)
{
    static const int8_t v[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    return v[nibble];
}

/* The specification: per token and block b, isum = sum of code2 * q over the block (exact
 * int32: |.| <= 32 * 12 * 32767 < 2^24, so float(isum) is exact too), then acc +=
 * ((scale_b / 2) * d_b) * isum in block order (one f32 accumulator). */
static void colibri_idot_mxfp4_row_scalar(int wide, const uint8_t *row, ptrdiff_t cols,
                                          const int8_t *q, ptrdiff_t qs, const float *d,
                                          ptrdiff_t ds, int nt, float *out, ptrdiff_t os)
{
    const uint8_t *scales = row + cols / 2;
    ptrdiff_t b, c;
    int t;
    for (t = 0; t < nt; t++) {
        const int8_t *qt = q + t * qs;
        const int16_t *qt16 = (const int16_t *)(const void *)qt;
        float acc = 0.0f;
        for (b = 0; b < cols / 32; b++) {
            int32_t isum = 0;
            for (c = 32 * b; c < 32 * b + 32; c++)
                isum += colibri_fp4_code2(colibri_mxfp4_nibble(row, c)) *
                        (wide ? qt16[colibri_qpos16(c)] : qt[colibri_qpos(c)]);
            acc += (0.5f * colibri_e8m0_to_f32(scales[b]) * d[t * ds + colibri_dpos(b)]) *
                   (float)isum;
        }
        out[t * os] = acc;
    }
}

#define COLIBRI_DEF_MX_IDOT_SCALAR(NAME, WIDE)                                              \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,        \
                     const int32_t *s, ptrdiff_t ds, int nt, float *out, ptrdiff_t os)      \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)group; (void)s;                                                                \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_idot_mxfp4_row_scalar(WIDE, row0 + i * rs, cols, q, qs, d, ds, nt,      \
                                          out + i, os);                                      \
    }

COLIBRI_DEF_MX_IDOT_SCALAR(colibri_idot_mxfp4_scalar, 0)
COLIBRI_DEF_MX_IDOT_SCALAR(colibri_idot16_mxfp4_scalar, 1)

#if COLIBRI_X86
/* The SIMD bodies: colibri_idot_avx2_body's structure (avx2_int.h) with an MXFP4 pair decode
 * and E8M0 scales. Per pair of blocks (j, j + 1): their 32 code bytes in one load (block j in
 * lane 0, j + 1 in lane 1), the nibbles interleaved back into element order by two in-lane
 * unpacks, so lo = elements 0..15 and hi = 16..31 of each block, the packed q's order; one
 * pshufb each maps the nibbles to u = code2 + 12 (0..24, unsigned: the operand vpmaddubsw and
 * vpdpbusd take without a sign trick). The +12 is folded out per block as q4 folds its -8:
 * sum u q - 12 sum q, with 12 sum q = s + s / 2 (s = 8 sum q, colibri_quantize_block), all
 * exact int32. Integer part per pair and token:
 *   int8 AVX2:  vpmaddubsw(u, q) twice (|pair| <= 2 * 24 * 127, their vpaddw <= 12192: no
 *               saturation), vpmaddwd with ones;   VNNI: vpdpbusd twice;
 *   int16:      u widened in-lane with zero (unpack), four vpmaddwd + adds (AVX2) or four
 *               chained vpdpwssd (VNNI); |.| <= 32 * 24 * 32767 < 2^31.
 * Three vphaddd levels leave the 8 block sums of a chunk in lane order 0 2 4 6 1 3 5 7 (the
 * packed d, s order); the chunk's 8 scale bytes are permuted to it, made 2^(e - 127) by a
 * shift into the exponent (0: 2^-127, a subnormal, blended in), halved (exact); then per chunk
 * acc = fma(float(isum), (scale / 2) * d, acc) and out = hsum(acc) (|isum| < 2^24 after the
 * fold: float(isum) exact). A VNNI path's result is the avx2 path's bit for bit (the same
 * integers, the same float text). */
#define COLIBRI_MX_L(V) (char)(12 + (V))
#define COLIBRI_MX_LUT16                                                                       \
    COLIBRI_MX_L(0), COLIBRI_MX_L(1), COLIBRI_MX_L(2), COLIBRI_MX_L(3), COLIBRI_MX_L(4),        \
    COLIBRI_MX_L(6), COLIBRI_MX_L(8), COLIBRI_MX_L(12), COLIBRI_MX_L(0), COLIBRI_MX_L(-1),      \
    COLIBRI_MX_L(-2), COLIBRI_MX_L(-3), COLIBRI_MX_L(-4), COLIBRI_MX_L(-6), COLIBRI_MX_L(-8),   \
    COLIBRI_MX_L(-12)

/* Blocks j (and j + 1 when two; else zero bytes) at wq -> lo, hi as described above. */
COLIBRI_AVX2_INLINE void colibri_mx_ipair_avx2(const uint8_t *wq, const int two, __m256i *lo,
                                               __m256i *hi)
{
    const __m256i lut = _mm256_setr_epi8(COLIBRI_MX_LUT16, COLIBRI_MX_LUT16);
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i v = two ? _mm256_loadu_si256((const __m256i *)wq)
                          : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                    _mm_loadu_si128((const __m128i *)wq), 0);
    const __m256i l = _mm256_and_si256(v, m15), h = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
    *lo = _mm256_shuffle_epi8(lut, _mm256_unpacklo_epi8(l, h));
    *hi = _mm256_shuffle_epi8(lut, _mm256_unpackhi_epi8(l, h));
}

/* The half scales of blocks b0 .. b0 + n - 1 (n <= 8; 1/2 past n, where d is 0), lane
 * order 0 2 4 6 1 3 5 7. A partial chunk's bytes are copied (never read past the row), the
 * lanes past n given the byte 127, not 0: 2^-128 is a subnormal, and a multiply with a
 * subnormal operand takes a microcode assist on some x86 cores (once per row here). */
COLIBRI_AVX2_INLINE __m256 colibri_mx_half_scales_avx2(const uint8_t *sp, const int n)
{
    const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m128i raw;
    __m256i e, bits;
    if (n == 8) {
        raw = _mm_loadl_epi64((const __m128i *)sp);
    } else {
        uint8_t b[16];
        memset(b, 127, sizeof b);
        memcpy(b, sp, (size_t)n);
        raw = _mm_loadu_si128((const __m128i *)b);
    }
    e = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(raw), idx);
    bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000),
                              _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
}

/* The chunk function of one path (colibri_ichunk_any_avx2's contract: isum[t] = the block
 * sums of the chunk's n <= 8 blocks, 0 past n, for NT tokens; wq: the chunk's first code
 * byte, q: token 0's packed codes there, s: token 0's s there): DEF(SFX, ATTR, DOT8, DOT16),
 * DOT8(lo, ql, hi, qh) the int32 pair sums of int8 codes, DOT16(c, qt) those of int16 ones. */
#define COLIBRI_DEF_MX_CHUNK(SFX, ATTR, DOT8, DOT16)                                             \
ATTR void colibri_mx_ichunk_##SFX(const int WIDE, const uint8_t *wq, const int8_t *q,          \
                                  ptrdiff_t qs, const int n, const int32_t *s, ptrdiff_t ds,   \
                                  __m256i *isum, const int NT)                                 \
{                                                                                              \
    const __m256i ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();                    \
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];                                        \
    int k, t;                                                                                  \
    (void)ones;                                                                                \
    for (k = 0; k < 4; k++) {                                  /* pair k: blocks 2k, 2k+1 */   \
        __m256i lo = z, hi = z, c[4];                                                          \
        if (2 * k < n) colibri_mx_ipair_avx2(wq + 32 * k, 2 * k + 1 < n, &lo, &hi);            \
        if (WIDE) {                                                                            \
            c[0] = _mm256_unpacklo_epi8(lo, z);                                                \
            c[1] = _mm256_unpackhi_epi8(lo, z);                                                \
            c[2] = _mm256_unpacklo_epi8(hi, z);                                                \
            c[3] = _mm256_unpackhi_epi8(hi, z);                                                \
        }                                                                                      \
        for (t = 0; t < NT; t++) {                                                             \
            __m256i p = z;                                                                     \
            if (2 * k < n) {                                                                   \
                if (WIDE) {                                                                    \
                    const __m256i *qt = (const __m256i *)(const void *)(q + t * qs + 128 * k); \
                    p = DOT16(c, qt);                                                          \
                } else {                                                                       \
                    const int8_t *qt = q + t * qs + 64 * k;                                    \
                    p = DOT8(lo, _mm256_loadu_si256((const __m256i *)qt), hi,                  \
                             _mm256_loadu_si256((const __m256i *)(qt + 32)));                  \
                }                                                                              \
            }                                                                                  \
            if (k & 1)                                                                         \
                h[k >> 1][t] = _mm256_hadd_epi32(v[k >> 1][t], p);                             \
            else                                                                               \
                v[k >> 1][t] = p;                                                              \
        }                                                                                      \
    }                                                                                          \
    for (t = 0; t < NT; t++) {                        /* - 12 sum q = - (s + s / 2) */         \
        const __m256i st = _mm256_loadu_si256((const __m256i *)(const void *)(s + t * ds));    \
        isum[t] = _mm256_sub_epi32(_mm256_hadd_epi32(h[0][t], h[1][t]),                        \
                                   _mm256_add_epi32(st, _mm256_srai_epi32(st, 1)));            \
    }                                                                                          \
}

#define COLIBRI_MX_DOT8_AVX2(lo, ql, hi, qh)                                                   \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ql),                           \
                                       _mm256_maddubs_epi16(hi, qh)), ones)
#define COLIBRI_MX_DOT16_AVX2(c, qt)                                                           \
    _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(c[0], _mm256_loadu_si256(qt)),         \
                                      _mm256_madd_epi16(c[1], _mm256_loadu_si256(qt + 1))),    \
                     _mm256_add_epi32(_mm256_madd_epi16(c[2], _mm256_loadu_si256(qt + 2)),     \
                                      _mm256_madd_epi16(c[3], _mm256_loadu_si256(qt + 3))))
COLIBRI_DEF_MX_CHUNK(avx2, COLIBRI_AVX2_INLINE, COLIBRI_MX_DOT8_AVX2, COLIBRI_MX_DOT16_AVX2)

/* One (row, NT tokens) output of path ATTR over the chunk function CHUNK: the whole chunks
 * (n = 8, a constant: the chunk unrolls), then the last 1..7 blocks. The prefetches are
 * colibri_idot_avx2_body's (2 code lines per chunk ahead, then the rest of the row ahead: a
 * partial chunk's codes and the scales). */
#define COLIBRI_DEF_MX_IDOT_BODY(NAME, ATTR, CHUNK)                                              \
ATTR void NAME(const uint8_t *row, ptrdiff_t cols, const int8_t *q, ptrdiff_t qs,              \
               const float *d, const int32_t *s, ptrdiff_t ds, float *out, ptrdiff_t os,       \
               const int NT, const int WIDE)                                                   \
{                                                                                              \
    const ptrdiff_t qpb = WIDE ? 64 : 32, nb = cols / 32;      /* code bytes per 32-block */   \
    const uint8_t *scales = row + cols / 2;                                                    \
    __m256 acc[COLIBRI_MAX_NT];                                                                \
    __m256i isum[COLIBRI_MAX_NT];                                                              \
    ptrdiff_t b0;                                                                              \
    int t;                                                                                     \
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();                                     \
    for (b0 = 0; b0 + 8 <= nb; b0 += 8) {                                                      \
        const char *pf = (const char *)(row + 16 * b0) + COLIBRI_PREFETCH_BYTES;               \
        const __m256 sv = colibri_mx_half_scales_avx2(scales + b0, 8);                         \
        _mm_prefetch(pf, _MM_HINT_T1);                                                         \
        _mm_prefetch(pf + 64, _MM_HINT_T1);                                                    \
        CHUNK(WIDE, row + 16 * b0, q + qpb * b0, qs, 8, s + b0, ds, isum, NT);                 \
        for (t = 0; t < NT; t++)                                                               \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]),                              \
                                     _mm256_mul_ps(sv, _mm256_loadu_ps(d + t * ds + b0)),      \
                                     acc[t]);                                                  \
    }                                                                                          \
    {                                  /* the rest of the row ahead: codes, scales */          \
        const char *p0 = (const char *)(row + 16 * b0) + COLIBRI_PREFETCH_BYTES;               \
        const char *p1 = (const char *)(scales + nb) + COLIBRI_PREFETCH_BYTES;                 \
        for (; p0 < p1; p0 += 64) _mm_prefetch(p0, _MM_HINT_T1);                               \
        _mm_prefetch(p1 - 1, _MM_HINT_T1);                                                     \
    }                                                                                          \
    if (b0 < nb) {                                                                             \
        const int n = (int)(nb - b0);                                                          \
        const __m256 sv = colibri_mx_half_scales_avx2(scales + b0, n);                         \
        CHUNK(WIDE, row + 16 * b0, q + qpb * b0, qs, n, s + b0, ds, isum, NT);                 \
        for (t = 0; t < NT; t++)                                                               \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]),                              \
                                     _mm256_mul_ps(sv, _mm256_loadu_ps(d + t * ds + b0)),      \
                                     acc[t]);                                                  \
    }                                                                                          \
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);                            \
}

#define COLIBRI_MX_IDOT_ROWS(BODY, NT)                                                       \
    for (i = 0; i < nrows; i++) BODY(row0 + i * rs, cols, q, qs, d, s, ds, out + i, os, NT, wide);

/* The entry points (colibri_idot_fn): nt picks the unrolled body, the row loop inside. */
#define COLIBRI_DEF_MX_IDOT(NAME, WIDE, ATTR, BODY)                                          \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,         \
                   const int32_t *s, ptrdiff_t ds, int nt, float *out, ptrdiff_t os)       \
    {                                                                                       \
        const int wide = WIDE;                                                              \
        ptrdiff_t i;                                                                        \
        (void)group;                                                                        \
        switch (nt) {                                                                       \
        case 1: COLIBRI_MX_IDOT_ROWS(BODY, 1) break;                                        \
        case 2: COLIBRI_MX_IDOT_ROWS(BODY, 2) break;                                        \
        case 3: COLIBRI_MX_IDOT_ROWS(BODY, 3) break;                                        \
        default: COLIBRI_MX_IDOT_ROWS(BODY, 4) break;                                       \
        }                                                                                   \
    }

COLIBRI_DEF_MX_IDOT_BODY(colibri_idot_mxfp4_avx2_body, COLIBRI_AVX2_INLINE, colibri_mx_ichunk_avx2)
COLIBRI_DEF_MX_IDOT(colibri_idot_mxfp4_avx2, 0, COLIBRI_AVX2_FN, colibri_idot_mxfp4_avx2_body)
COLIBRI_DEF_MX_IDOT(colibri_idot16_mxfp4_avx2, 1, COLIBRI_AVX2_FN, colibri_idot_mxfp4_avx2_body)

#if COLIBRI_VNNI
/* The VNNI variants (vnni.h's two encodings): vpdpbusd twice, vpdpwssd chained. */
#define COLIBRI_MX_DOT8_VNNI(DPBUSD, lo, ql, hi, qh)                                          \
    DPBUSD(DPBUSD(_mm256_setzero_si256(), lo, ql), hi, qh)
#define COLIBRI_MX_DOT16_VNNI(DPWSSD, c, qt)                                                   \
    DPWSSD(DPWSSD(DPWSSD(DPWSSD(_mm256_setzero_si256(), c[0], _mm256_loadu_si256(qt)),          \
                         c[1], _mm256_loadu_si256(qt + 1)), c[2], _mm256_loadu_si256(qt + 2)),  \
           c[3], _mm256_loadu_si256(qt + 3))
#define COLIBRI_MX_DOT8_AVXVNNI(lo, ql, hi, qh)                                                \
    COLIBRI_MX_DOT8_VNNI(_mm256_dpbusd_avx_epi32, lo, ql, hi, qh)
#define COLIBRI_MX_DOT16_AVXVNNI(c, qt) COLIBRI_MX_DOT16_VNNI(_mm256_dpwssd_avx_epi32, c, qt)
COLIBRI_DEF_MX_CHUNK(avxvnni, COLIBRI_AVXVNNI_INLINE, COLIBRI_MX_DOT8_AVXVNNI,
                     COLIBRI_MX_DOT16_AVXVNNI)

/* avx512vnni: the chunk in 512 bits, as vnni.h's q4 / q8 chunks (avx512_int.h has the lane
 * layout and the fold): int8 [lo | hi] against the 64 code bytes at 64 k, one vpdpbusd;
 * int16 lo and hi widened (zero-extended, 128-bit lanes reordered 0 2 1 3: [c0 | c1],
 * [c2 | c3] of the AVX2 chunk) against the runs at 128 k and 128 k + 64, two vpdpwssd. The
 * same block sums, so the avx2 path's bits. */
COLIBRI_AVX512VNNI_INLINE void colibri_mx_ichunk_avx512vnni(const int WIDE, const uint8_t *wq,
                                                            const int8_t *q, ptrdiff_t qs,
                                                            const int n, const int32_t *s,
                                                            ptrdiff_t ds, __m256i *isum,
                                                            const int NT)
{
    __m512i u[2][COLIBRI_MAX_NT], pk[COLIBRI_MAX_NT];
    int k, t;
    for (t = 0; t < NT; t++) pk[t] = _mm512_setzero_si512();    /* (set at k = 0; for gcc) */
    for (k = 0; k < 4; k++) {                                  /* pair k: blocks 2k, 2k+1 */
        __m256i lo = _mm256_setzero_si256(), hi = lo;
        __m512i c01, c23, z8;
        if (2 * k < n) colibri_mx_ipair_avx2(wq + 32 * k, 2 * k + 1 < n, &lo, &hi);
        if (WIDE) {
            c01 = _mm512_cvtepu8_epi16(lo);
            c23 = _mm512_cvtepu8_epi16(hi);
            c01 = _mm512_shuffle_i64x2(c01, c01, _MM_SHUFFLE(3, 1, 2, 0));
            c23 = _mm512_shuffle_i64x2(c23, c23, _MM_SHUFFLE(3, 1, 2, 0));
        } else {
            z8 = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (t = 0; t < NT; t++) {
            __m512i p = _mm512_setzero_si512();
            if (2 * k < n) {
                if (WIDE) {
                    const int8_t *qt = q + t * qs + 128 * k;
                    p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(p, c01, _mm512_loadu_si512(qt)),
                                            c23, _mm512_loadu_si512(qt + 64));
                } else {
                    p = _mm512_dpbusd_epi32(p, z8, _mm512_loadu_si512(q + t * qs + 64 * k));
                }
            }
            if (k & 1)
                u[k >> 1][t] = colibri_ifold2_512(pk[t], p);
            else
                pk[t] = p;
        }
    }
    for (t = 0; t < NT; t++) {                        /* - 12 sum q = - (s + s / 2) */
        const __m256i st = _mm256_loadu_si256((const __m256i *)(const void *)(s + t * ds));
        isum[t] = _mm256_sub_epi32(colibri_ifold4_512(u[0][t], u[1][t]),
                                   _mm256_add_epi32(st, _mm256_srai_epi32(st, 1)));
    }
}
COLIBRI_DEF_MX_IDOT_BODY(colibri_idot_mxfp4_avx512vnni_body, COLIBRI_AVX512VNNI_INLINE,
                         colibri_mx_ichunk_avx512vnni)
COLIBRI_DEF_MX_IDOT_BODY(colibri_idot_mxfp4_avxvnni_body, COLIBRI_AVXVNNI_INLINE,
                         colibri_mx_ichunk_avxvnni)
COLIBRI_DEF_MX_IDOT(colibri_idot_mxfp4_avx512vnni, 0, COLIBRI_AVX512VNNI_FN,
                    colibri_idot_mxfp4_avx512vnni_body)
COLIBRI_DEF_MX_IDOT(colibri_idot16_mxfp4_avx512vnni, 1, COLIBRI_AVX512VNNI_FN,
                    colibri_idot_mxfp4_avx512vnni_body)
COLIBRI_DEF_MX_IDOT(colibri_idot_mxfp4_avxvnni, 0, COLIBRI_AVXVNNI_FN,
                    colibri_idot_mxfp4_avxvnni_body)
COLIBRI_DEF_MX_IDOT(colibri_idot16_mxfp4_avxvnni, 1, COLIBRI_AVXVNNI_FN,
                    colibri_idot_mxfp4_avxvnni_body)
#endif /* COLIBRI_VNNI */
#endif /* COLIBRI_X86 */

/* The MXFP4 integer row kernel of path isa (the avx512 path runs the AVX2 body, as q8 / q4 do;
 * NULL for a path not compiled in). */
static colibri_idot_fn colibri_idot_mxfp4_for(int isa, int wide)
{
    isa = colibri_isa_int_base(isa);
    if (isa == COLIBRI_ISA_SCALAR) return wide ? colibri_idot16_mxfp4_scalar : colibri_idot_mxfp4_scalar;
#if COLIBRI_VNNI
    if (isa == COLIBRI_ISA_AVX512VNNI)
        return wide ? colibri_idot16_mxfp4_avx512vnni : colibri_idot_mxfp4_avx512vnni;
    if (isa == COLIBRI_ISA_AVXVNNI)
        return wide ? colibri_idot16_mxfp4_avxvnni : colibri_idot_mxfp4_avxvnni;
#endif
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512)
        return wide ? colibri_idot16_mxfp4_avx2 : colibri_idot_mxfp4_avx2;
#endif
    return NULL;
}

#endif /* COLIBRI_MXFP4_H */
