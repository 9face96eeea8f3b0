/* csrc/igemm.h: the integer-activation GEMM path (prefill with int8 / int16 activation codes
 * against q8 / q4 / mxfp4 weights): its scalar specification, the panel decoder, the AVX2, AVX-VNNI
 * (256-bit) and AVX-512 VNNI (512-bit) micro-kernels, and its table colibri_igemm_for.
 *
 * The idot row kernels (avx2_int.h, vnni.h) decode each weight block once per pass of 3-4
 * tokens; with many tokens per matrix that decoding, not the multiplies, is most of the
 * work. Here a panel of up to NR = 48 rows is decoded once per K-chunk of KC = 256 columns
 * (8 blocks of 32) into the layout the dot-product instructions want, lanes across rows:
 *   int8 codes:  per 4 consecutive columns ("step", 8 per block), the 48 rows' 4 code bytes
 *                as 48 dwords in row order (vpdpbusd / vpmaddubsw: 4 products per lane);
 *   int16 codes: per 2 consecutive columns (16 steps per block), the 48 rows' 2 int16 codes;
 * plus each row's weight scale per block (f32). A micro-kernel then runs MT tokens x MRV
 * vectors of rows: per step the weight vectors are loaded once and each token's 4 (int8) or
 * 2 (int16) activation codes broadcast to every lane (from the packed token rows of
 * colibri_quantize_row: 4 consecutive int8 codes within a half block, or 2 int16 codes, are
 * contiguous there), accumulated exactly in int32 per block; then per block one convert and
 * one FMA with (weight scale x activation scale).
 *
 * Arithmetic (the specification, colibri_igemm_scalar): for row i and token t,
 *     isum_b = sum over the 32 columns of block b of code_w * code_a     (exact int32)
 *     acc = 0; for b in block order: acc = fmaf((float)isum_b, s_i,g(b) * d_t,b, acc)
 *     y = acc
 * code_w: the int8 (q8), nibble - 8 (q4) or twice the FP4 value (mxfp4: 0, +-1, +-2, +-3,
 * +-4, +-6, +-8, +-12, an integer); code_a: the int8 / int16 activation code; d the
 * activation block scale; s_i,g the weight group scale (mxfp4: the block's E8M0 scale
 * halved, 2^(e - 128), exact); s_i,g * d a float product, rounded.
 * The integer sums are exact whatever the instructions (the bounds below), so every body
 * gives these bits: the result of a (row, token) depends on nothing else (not the panel,
 * the micro-kernel shape, the token pass, the thread). It differs in the last bits from the
 * row kernel's (which sums 8 blocks in lanes, then horizontally): a token's output may
 * change in the last bits between a call with few tokens (row kernel) and one with many.
 *
 * How the bodies reach exact integer sums (|code_a| <= 127 int8, <= 32767 int16):
 *   VNNI int8 (vpdpbusd, u8 x s8): the panel holds u8 codes: q4 the nibble (0..15), q8 the
 *     byte + 128 (w ^ 0x80), mxfp4 u = code2 + 12 (0..24, mxfp4.h's row-kernel operand); the
 *     block sum less 8 sum code_a (q4), 128 sum code_a (q8) or 12 sum code_a (mxfp4) is the
 *     signed one. The activation rows carry s = 8 * sum code_a per block (the row kernels'
 *     q4 fold), so the correction is s, 16 s or s + s / 2 (s is a multiple of 8: exact).
 *     Sums <= 32 * 255 * 127 before it.
 *   AVX2 int8 (vpmaddubsw + vpmaddwd with ones): q4, mxfp4 as VNNI (pairs <= 2 * 24 * 127); q8
 *     holds signed codes and multiplies |w| by sign(code_a, w) (pairs <= 2 * 128 * 127 <
 *     2^15: never saturates), no correction.
 *   AVX-512 VNNI int16: each code split into two s8 halves against the u8 panel, two
 *     vpdpbusd (colibri_irepack_avx512 has the arithmetic).
 *   256-bit int16 (vpdpwssd / vpmaddwd, s16 x s16): the panel holds signed codes (q4 nibble - 8,
 *     mxfp4 code2);
 *     the pair products never reach vpmaddwd's one inexact case (-32768^2 twice), and
 *     |isum| <= 32 * 128 * 32767 < 2^31. (float)isum then rounds (|isum| may pass 2^24) the
 *     same way in every body: round to nearest even (C conversion, vcvtdq2ps).
 */
#ifndef COLIBRI_IGEMM_H
#define COLIBRI_IGEMM_H

#include "types.h"
#include "avx2.h"
#include "vnni.h"
#include "gemm.h"
#include "mxfp4.h"

#define COLIBRI_IGEMM_NR 48    /* rows per panel: 3 vectors of 16 (512-bit), 6 of 8 (256) */
#define COLIBRI_IGEMM_KC 256   /* columns per K-chunk: 8 blocks, one chunk of the d, s order */
#define COLIBRI_IGEMM_NB 64    /* tokens per pass (callers split longer calls into passes) */
/* Bytes of the decoded panel (int16 codes: 2 bytes per weight), and the floats of a
 * thread's scratch: the panel, the scales (NR per block of the chunk), the panel's code
 * sums (NR per block: the split int16 scheme of the AVX-512 VNNI body), that body's
 * repacked codes of a token block (4 x 512 bytes), the accumulators (NB x NR), then an NB x
 * NR tile for the caller (the expert FFN's up rows). */
#define COLIBRI_IGEMM_PANEL_BYTES (COLIBRI_IGEMM_NR * COLIBRI_IGEMM_KC * 2)
#define COLIBRI_IGEMM_SCRATCH (COLIBRI_IGEMM_PANEL_BYTES / 4 + \
                               2 * COLIBRI_IGEMM_NR * (COLIBRI_IGEMM_KC / 32) + 4 * 128 + \
                               2 * COLIBRI_IGEMM_NB * COLIBRI_IGEMM_NR)

/* The callers give each thread COLIBRI_GEMM_SCRATCH floats, for either GEMM path. */
typedef char colibri_igemm_scratch_fits[COLIBRI_IGEMM_SCRATCH <= COLIBRI_GEMM_SCRATCH ? 1 : -1];

/* y[t * ys + i] = W[i] . x[t] for i < nr <= NR, t < n <= NB, on the packed token rows of
 * colibri_quantize_row (q: token t at q + t * qs bytes; d, s at + t * ds), rows at row0 + i *
 * rs (q8 / q4, cols a multiple of 32, group a multiple of 32 dividing cols); scratch: a
 * thread's COLIBRI_IGEMM_SCRATCH floats, 64-byte aligned. */
typedef void (*colibri_igemm_fn)(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,
                                 ptrdiff_t group, const int8_t *q, ptrdiff_t qs,
                                 const float *d, const int32_t *s, ptrdiff_t ds, ptrdiff_t n,
                                 float *y, ptrdiff_t ys, float *scratch);

/* ------------------------------------------------------------------------------------------
 * Scalar body: the specification, one (row, token) output at a time.
 */
static void colibri_igemm_scalar_body(int fmt, int wide, const uint8_t *row0, ptrdiff_t rs,
                                      int nr, ptrdiff_t cols, ptrdiff_t group,
                                      const int8_t *q, ptrdiff_t qs, const float *d,
                                      ptrdiff_t ds, ptrdiff_t n, float *y, ptrdiff_t ys)
{
    const ptrdiff_t nb = cols / 32;
    ptrdiff_t t, b, c;
    int i;
    for (t = 0; t < n; t++) {
        const int8_t *qt = q + t * qs;
        const int16_t *qt16 = (const int16_t *)(const void *)qt;
        for (i = 0; i < nr; i++) {
            const uint8_t *row = row0 + i * rs;
            const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
            float acc = 0.0f;
            for (b = 0; b < nb; b++) {
                int32_t isum = 0;
                float sg;
                for (c = 32 * b; c < 32 * b + 32; c++) {
                    int w = fmt == COLIBRI_Q8 ? (int)(int8_t)row[c]
                            : fmt == COLIBRI_MXFP4 ? colibri_fp4_code2(colibri_mxfp4_nibble(row, c))
                            : colibri_q4_nibble(row, c) - 8;
                    isum += w * (wide ? qt16[colibri_qpos16(c)] : qt[colibri_qpos(c)]);
                }
                sg = fmt == COLIBRI_MXFP4 ? 0.5f * colibri_e8m0_to_f32(scales[b])
                     : colibri_f16_to_f32(colibri_ld_u16(scales + 2 * (32 * b / group)));
                acc = fmaf((float)isum, sg * d[t * ds + colibri_dpos(b)], acc);
            }
            y[t * ys + i] = acc;
        }
    }
}

#define COLIBRI_DEF_IGEMM_SCALAR(NAME, FMT, WIDE)                                            \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,             \
                     ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,        \
                     const int32_t *s, ptrdiff_t ds, ptrdiff_t n, float *y, ptrdiff_t ys,   \
                     float *scratch)                                                         \
    {                                                                                        \
        (void)s; (void)scratch;                                                              \
        colibri_igemm_scalar_body(FMT, WIDE, row0, rs, nr, cols, group, q, qs, d, ds, n, y, \
                                  ys);                                                       \
    }

COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm_q8_scalar, COLIBRI_Q8, 0)
COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm_q4_scalar, COLIBRI_Q4, 0)
COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm16_q8_scalar, COLIBRI_Q8, 1)
COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm16_q4_scalar, COLIBRI_Q4, 1)
COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm_mx_scalar, COLIBRI_MXFP4, 0)
COLIBRI_DEF_IGEMM_SCALAR(colibri_igemm16_mx_scalar, COLIBRI_MXFP4, 1)

#if COLIBRI_X86
/* ------------------------------------------------------------------------------------------
 * The panel decoder (AVX2; every SIMD body uses it: it runs once per K-chunk and token pass,
 * against up to 64 tokens' multiplies).
 */

/* What the panel holds (the micro-kernel's operand). */
enum { COLIBRI_IPANEL_U8 = 0,     /* int8: q4 nibble, q8 byte + 128, mxfp4 code2 + 12 (VNNI) */
       COLIBRI_IPANEL_S8 = 1,     /* int8: q4 nibble, q8 signed byte, mxfp4 code2 + 12 (AVX2) */
       COLIBRI_IPANEL_S16 = 2,    /* int16: signed codes (q4 nibble - 8, mxfp4 code2) */
       COLIBRI_IPANEL_I8 = 3 };   /* int8: signed codes (q4 nibble - 8, q8, mxfp4 code2; AMX) */

static inline int32_t colibri_ld_i32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Dwords k = 0..3 of 16 bytes at p[r] + off for 8 rows r, transposed: u[k] lane r = bytes
 * 4k..4k+3 of row r. (Rows 0 / 4, 1 / 5, ... share a register, so the 64-bit unpacks leave
 * the rows in order.) */
COLIBRI_AVX2_INLINE void colibri_itranspose8x4_avx2(const uint8_t *const p[8], ptrdiff_t off,
                                                    __m256i u[4])
{
#define COLIBRI_LD2(A, B) _mm256_inserti128_si256(_mm256_castsi128_si256(                      \
    _mm_loadu_si128((const __m128i *)(p[A] + off))), _mm_loadu_si128((const __m128i *)(p[B] + off)), 1)
    const __m256i a = COLIBRI_LD2(0, 4), b = COLIBRI_LD2(1, 5);
    const __m256i c = COLIBRI_LD2(2, 6), e = COLIBRI_LD2(3, 7);
#undef COLIBRI_LD2
    const __m256i t0 = _mm256_unpacklo_epi32(a, b), t1 = _mm256_unpackhi_epi32(a, b);
    const __m256i t2 = _mm256_unpacklo_epi32(c, e), t3 = _mm256_unpackhi_epi32(c, e);
    u[0] = _mm256_unpacklo_epi64(t0, t2);
    u[1] = _mm256_unpackhi_epi64(t0, t2);
    u[2] = _mm256_unpacklo_epi64(t1, t3);
    u[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* a[r] lane j -> sc[j * NR + r] (8 x 8). */
COLIBRI_AVX2_INLINE void colibri_itranspose8x8_ps_avx2(const __m256 a[8], float *sc)
{
    __m256 t[8], u[8];
    int r;
    for (r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_ps(a[r], a[r + 1]);
        t[r + 1] = _mm256_unpackhi_ps(a[r], a[r + 1]);
    }
    for (r = 0; r < 8; r += 4) {
        u[r] = _mm256_shuffle_ps(t[r], t[r + 2], 0x44);
        u[r + 1] = _mm256_shuffle_ps(t[r], t[r + 2], 0xEE);
        u[r + 2] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0x44);
        u[r + 3] = _mm256_shuffle_ps(t[r + 1], t[r + 3], 0xEE);
    }
    for (r = 0; r < 4; r++) {
        _mm256_storeu_ps(sc + r * COLIBRI_IGEMM_NR, _mm256_permute2f128_ps(u[r], u[r + 4], 0x20));
        _mm256_storeu_ps(sc + (r + 4) * COLIBRI_IGEMM_NR,
                         _mm256_permute2f128_ps(u[r], u[r + 4], 0x31));
    }
}

/* The 8 f16 scales at p[r] + off of 8 rows as f32, transposed: sc[j * NR + r] = scale j of
 * row r (group 32: a chunk's 8 blocks). */
COLIBRI_AVX2_INLINE void colibri_iscales8x8_avx2(const uint8_t *const p[8], ptrdiff_t off,
                                                 float *sc)
{
    __m256 a[8];
    int r;
    for (r = 0; r < 8; r++) a[r] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p[r] + off)));
    colibri_itranspose8x8_ps_avx2(a, sc);
}

/* The same for 8 E8M0 scale bytes per row (mxfp4), halved: 2^(e - 128) (byte 0: 2^-128,
 * the subnormal colibri_e8m0_to_f32 gives, halved exactly). */
COLIBRI_AVX2_INLINE void colibri_imxscales8x8_avx2(const uint8_t *const p[8], ptrdiff_t off,
                                                   float *sc)
{
    const __m256 half = _mm256_set1_ps(0.5f);
    __m256 a[8];
    int r;
    for (r = 0; r < 8; r++) {
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p[r] + off)));
        const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23),
                                                _mm256_set1_epi32(0x00400000),
                                                _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        a[r] = _mm256_mul_ps(_mm256_castsi256_ps(bits), half);
    }
    colibri_itranspose8x8_ps_avx2(a, sc);
}

/* Blocks b0 .. b0 + kb - 1 (kb <= 8) of rows 0 .. nv8 * 8 - 1 (rows past nr repeat row nr -
 * 1: decoded, never stored) into the panel (KIND) and their scales sc[j * NR + row]. */
COLIBRI_AVX2_INLINE void colibri_ipanel_avx2(const int fmt, const int KIND, const uint8_t *row0,
                                             ptrdiff_t rs, int nr, int nv8, ptrdiff_t cols,
                                             ptrdiff_t group, ptrdiff_t b0, int kb,
                                             uint8_t *panel, float *sc, int32_t *ns)
{
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    const __m256i m15 = _mm256_set1_epi8(15), m80 = _mm256_set1_epi8((char)0x80);
    const __m256i eight = _mm256_set1_epi8(8);
    const ptrdiff_t soff = fmt == COLIBRI_Q8 ? cols : cols / 2, bpb = fmt == COLIBRI_Q8 ? 32 : 16;
    /* mxfp4: nibble -> code2 + 12 (the int8 panels) or code2 (int16), in both lanes */
    const __m256i mxlut = KIND == COLIBRI_IPANEL_S16 || KIND == COLIBRI_IPANEL_I8
        ? _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                           0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
        : _mm256_setr_epi8(COLIBRI_MX_LUT16, COLIBRI_MX_LUT16);
    ptrdiff_t gi[8];                                   /* block j's group */
    int g, r, j, k;
    for (j = 0; j < kb; j++) gi[j] = 32 * (b0 + j) / group;
    for (g = 0; g < nv8; g++) {
        const uint8_t *p[8];
        for (r = 0; r < 8; r++) p[r] = row0 + (8 * g + r < nr ? 8 * g + r : nr - 1) * rs;
        if (fmt == COLIBRI_MXFP4 && kb == 8)
            colibri_imxscales8x8_avx2(p, soff + b0, sc + 8 * g);
        else if (fmt == COLIBRI_MXFP4)                 /* E8M0, halved: 2^(e - 128), exact */
            for (r = 0; r < 8; r++)
                for (j = 0; j < kb; j++)
                    sc[j * COLIBRI_IGEMM_NR + 8 * g + r] =
                        0.5f * colibri_e8m0_to_f32(p[r][soff + b0 + j]);
        else if (group == 32 && kb == 8)               /* 8 rows x 8 scales, transposed */
            colibri_iscales8x8_avx2(p, soff + 2 * b0, sc + 8 * g);
        else
            for (r = 0; r < 8; r++)
                for (j = 0; j < kb; j++)
                    sc[j * COLIBRI_IGEMM_NR + 8 * g + r] =
                        _cvtsh_ss(colibri_ld_u16(p[r] + soff + 2 * gi[j]));
        for (j = 0; j < kb; j++) {
            __m256i st[8], u[4];
            const ptrdiff_t off = (b0 + j) * bpb;
            colibri_itranspose8x4_avx2(p, off, u);
            if (fmt == COLIBRI_Q4) {
                for (k = 0; k < 4; k++) {
                    st[k] = _mm256_and_si256(u[k], m15);
                    st[k + 4] = _mm256_and_si256(_mm256_srli_epi16(u[k], 4), m15);
                }
            } else if (fmt == COLIBRI_MXFP4) {
                /* u[k]: bytes 4k..4k+3 = elements 8k..8k+7 (low nibble first) of each row;
                 * mapped, interleaved into element order (rows 0, 1 | 2, 3 of each lane
                 * half: steps 2k, 2k+1 of each), the dwords regrouped by step */
                for (k = 0; k < 4; k++) {
                    const __m256i l = _mm256_shuffle_epi8(mxlut, _mm256_and_si256(u[k], m15));
                    const __m256i h = _mm256_shuffle_epi8(
                        mxlut, _mm256_and_si256(_mm256_srli_epi16(u[k], 4), m15));
                    const __m256i a = _mm256_shuffle_epi32(_mm256_unpacklo_epi8(l, h), 0xD8);
                    const __m256i c = _mm256_shuffle_epi32(_mm256_unpackhi_epi8(l, h), 0xD8);
                    st[2 * k] = _mm256_unpacklo_epi64(a, c);
                    st[2 * k + 1] = _mm256_unpackhi_epi64(a, c);
                }
            } else {
                for (k = 0; k < 4; k++) st[k] = u[k];
                colibri_itranspose8x4_avx2(p, off + 16, u);
                for (k = 0; k < 4; k++) st[k + 4] = u[k];
            }
            if (KIND == COLIBRI_IPANEL_S16) {
                /* step k's 4 signed codes per lane -> two int16 pair vectors: (c0, c1) and
                 * (c2, c3), each code sign-extended into its 16-bit half */
                uint8_t *o = panel + ((ptrdiff_t)16 * j * COLIBRI_IGEMM_NR + 8 * g) * 4;
                for (k = 0; k < 8; k++) {
                    __m256i v = fmt == COLIBRI_Q4 ? _mm256_sub_epi8(st[k], eight) : st[k];
                    __m256i p01 = _mm256_blend_epi16(
                        _mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24),
                        _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 8), 0xAA);
                    __m256i p23 = _mm256_blend_epi16(
                        _mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24),
                        _mm256_srai_epi32(v, 8), 0xAA);
                    _mm256_store_si256((__m256i *)(void *)(o + 2 * k * 4 * COLIBRI_IGEMM_NR), p01);
                    _mm256_store_si256((__m256i *)(void *)(o + (2 * k + 1) * 4 * COLIBRI_IGEMM_NR),
                                       p23);
                }
            } else {
                uint8_t *o = panel + ((ptrdiff_t)8 * j * COLIBRI_IGEMM_NR + 8 * g) * 4;
                __m256i sum16 = _mm256_setzero_si256();       /* |.| <= 8 * 2 * 255 */
                for (k = 0; k < 8; k++) {
                    __m256i v = KIND == COLIBRI_IPANEL_U8 && fmt == COLIBRI_Q8
                                    ? _mm256_xor_si256(st[k], m80)
                                    : KIND == COLIBRI_IPANEL_I8 && fmt == COLIBRI_Q4
                                    ? _mm256_sub_epi8(st[k], eight) : st[k];
                    _mm256_store_si256((__m256i *)(void *)(o + k * 4 * COLIBRI_IGEMM_NR), v);
                    if (ns) sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(v, ones8));
                }
                if (ns)                      /* the row's block sum of u8 codes, per lane */
                    _mm256_storeu_si256((__m256i *)(void *)(ns + j * COLIBRI_IGEMM_NR + 8 * g),
                                        _mm256_madd_epi16(sum16, ones16));
            }
        }
    }
}

/* The packed activation offsets (bytes from the chunk start) of block j's step k: int8 the
 * 4 codes of columns 32j + 4k.., int16 the 2 of columns 32j + 2k.. (colibri_qpos, _qpos16;
 * the chunk starts at an even block). */
#define COLIBRI_IQ8_OFF(j, k) (64 * ((j) >> 1) + 32 * ((k) >> 2) + 16 * ((j) & 1) + 4 * ((k) & 3))
#define COLIBRI_IQ16_OFF(j, k) \
    (2 * (64 * ((j) >> 1) + 16 * ((k) >> 2) + 8 * ((j) & 1) + 2 * ((k) & 3)))

/* The driver of a SIMD body: per K-chunk decode the panel (KIND8 for int8 codes), then
 * every token block of up to MTMAX tokens against every micro-panel of up to MRVMAX
 * vectors of VROWS rows (MK: the micro-kernel dispatcher, acc[t * NR + row] += the chunk's
 * blocks). The accumulators start at 0 and live in scratch between chunks. */
#define COLIBRI_DEF_IGEMM_SIMD(NAME, ATTR, FMT, WIDE, KIND8, MK, VROWS, MRVMAX, MTMAX,       \
                               SPLIT16, REPACK)                                             \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,               \
                   ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,          \
                   const int32_t *s, ptrdiff_t ds, ptrdiff_t n, float *y, ptrdiff_t ys,     \
                   float *scratch)                                                          \
    {                                                                                       \
        uint8_t *panel = (uint8_t *)(void *)scratch;                                       \
        float *sc = scratch + COLIBRI_IGEMM_PANEL_BYTES / 4;                                \
        int32_t *ns = (int32_t *)(void *)(sc + COLIBRI_IGEMM_NR * (COLIBRI_IGEMM_KC / 32));   \
        int8_t *rq = (int8_t *)(void *)(ns + COLIBRI_IGEMM_NR * (COLIBRI_IGEMM_KC / 32));    \
        float *acc = (float *)(void *)(rq + 4 * 512);                                      \
        const int split = WIDE && SPLIT16;   /* int16 codes as two bytes, u8 panel */       \
        const ptrdiff_t nb = cols / 32, qb = WIDE ? 64 : 32;      /* code bytes per block */ \
        const int nv = (nr + VROWS - 1) / VROWS;                                            \
        ptrdiff_t b0, t0, t;                                                                \
        int v0, i;                                                                          \
        memset(acc, 0, sizeof(float) * COLIBRI_IGEMM_NR * n);                               \
        for (b0 = 0; b0 < nb; b0 += 8) {                                                    \
            const int kb = nb - b0 < 8 ? (int)(nb - b0) : 8;                                \
            colibri_ipanel_avx2(FMT, WIDE && !split ? COLIBRI_IPANEL_S16 : KIND8, row0, rs, \
                                nr, (nv * VROWS + 7) / 8, cols, group, b0, kb, panel, sc,   \
                                split ? ns : NULL);                                         \
            for (t0 = 0; t0 < n; t0 += MTMAX) {                                             \
                const int mt = n - t0 < MTMAX ? (int)(n - t0) : MTMAX;                      \
                if (split) REPACK(q + t0 * qs + qb * b0, qs, mt, kb, rq);                   \
                for (v0 = 0; v0 < nv; v0 += MRVMAX) {                                       \
                    const int mrv = nv - v0 < MRVMAX ? nv - v0 : MRVMAX;                    \
                    MK(FMT, WIDE, panel + 4 * VROWS * v0, sc + VROWS * v0, kb,              \
                       split ? rq : q + t0 * qs + qb * b0, split ? 512 : qs,                \
                       d + t0 * ds + b0, s + t0 * ds + b0, ds,                              \
                       acc + t0 * COLIBRI_IGEMM_NR + VROWS * v0, mt, mrv);                  \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (t = 0; t < n; t++)                                                             \
            for (i = 0; i < nr; i++) y[t * ys + i] = acc[t * COLIBRI_IGEMM_NR + i];         \
    }

#define colibri_irepack_none(q, qs, mt, kb, rq) ((void)0)

/* A micro-kernel dispatcher: the body NAME##_body with compile-time MT (1..MTMAX) and MRV
 * (1..MRVMAX). */
#define COLIBRI_IMK_CASE(BODY, MT, MRV)                                                      \
    BODY(fmt, WIDE, panel, sc, kb, q, qs, d, s, ds, acc, MT, MRV);                           \
    return;
#define COLIBRI_IMK_ROWS(BODY, MT, MRVMAX)                                                   \
    if (mrv >= 3 && MRVMAX >= 3) { COLIBRI_IMK_CASE(BODY, MT, 3) }                          \
    if (mrv == 2 && MRVMAX >= 2) { COLIBRI_IMK_CASE(BODY, MT, 2) }                          \
    COLIBRI_IMK_CASE(BODY, MT, 1)
#define COLIBRI_DEF_IMK(NAME, ATTR, BODY, MRVMAX, MTMAX)                                     \
    ATTR void NAME(const int fmt, const int WIDE, const uint8_t *panel, const float *sc,    \
                   int kb, const int8_t *q, ptrdiff_t qs, const float *d, const int32_t *s, \
                   ptrdiff_t ds, float *acc, int mt, int mrv)                               \
    {                                                                                       \
        if (mt >= 4 && MTMAX >= 4) { COLIBRI_IMK_ROWS(BODY, 4, MRVMAX) }                    \
        if (mt == 3 && MTMAX >= 3) { COLIBRI_IMK_ROWS(BODY, 3, MRVMAX) }                    \
        if (mt == 2 && MTMAX >= 2) { COLIBRI_IMK_ROWS(BODY, 2, MRVMAX) }                    \
        COLIBRI_IMK_ROWS(BODY, 1, MRVMAX)                                                   \
    }

/* ------------------------------------------------------------------------------------------
 * 256-bit micro-kernel (AVX2, and AVX-VNNI with DOT8 / DOT16 its instructions): vectors of
 * 8 rows. Per block: the int32 sums of MT tokens x MRV vectors over the block's steps, then
 * acc = fma(float(isum - correction), scale * d, acc) per (token, vector).
 *   DOT8(ia, w, aw, a): ia + the 4-product sums of the panel codes w (aw: |w| for the AVX2
 *                       q8 body) with the broadcast codes a;  DOT16(ia, w, a): 2-product.
 *   CORR8: the int8 correction (0 none, 1 s, 16: 16 s; q4 is always s).
 */
#define COLIBRI_DEF_IMK256(NAME, ATTR, DOT8, DOT16, Q8ABS, CORR8)                            \
ATTR void NAME(const int fmt, const int WIDE, const uint8_t *panel, const float *sc, int kb, \
               const int8_t *q, ptrdiff_t qs, const float *d, const int32_t *s,             \
               ptrdiff_t ds, float *acc, const int MT, const int MRV)                       \
{                                                                                           \
    const __m256i ones = _mm256_set1_epi16(1);                                              \
    __m256 fa[4][3];                                                                        \
    int j, k, t, v;                                                                         \
    (void)ones;                                                                             \
    for (t = 0; t < MT; t++)                                                                \
        for (v = 0; v < MRV; v++) fa[t][v] = _mm256_loadu_ps(acc + t * COLIBRI_IGEMM_NR + 8 * v); \
    for (j = 0; j < kb; j++) {                                                              \
        const int dp = (int)colibri_dpos(j);                                                \
        __m256i ia[4][3];                                                                   \
        for (t = 0; t < MT; t++)                                                            \
            for (v = 0; v < MRV; v++) ia[t][v] = _mm256_setzero_si256();                    \
        if (!WIDE) {                                                                        \
            for (k = 0; k < 8; k++) {                                                       \
                const uint8_t *pw = panel + (8 * j + k) * 4 * COLIBRI_IGEMM_NR;             \
                __m256i w[3], aw[3];                                                        \
                for (v = 0; v < MRV; v++) {                                                 \
                    w[v] = _mm256_load_si256((const __m256i *)(const void *)(pw + 32 * v)); \
                    aw[v] = Q8ABS && fmt == COLIBRI_Q8 ? _mm256_abs_epi8(w[v]) : w[v];      \
                }                                                                           \
                (void)aw;                                                                   \
                for (t = 0; t < MT; t++) {                                                  \
                    const __m256i a = _mm256_set1_epi32(                                    \
                        colibri_ld_i32(q + t * qs + COLIBRI_IQ8_OFF(j, k)));                \
                    for (v = 0; v < MRV; v++) ia[t][v] = DOT8(ia[t][v], w[v], aw[v], a);    \
                }                                                                           \
            }                                                                               \
        } else {                                                                            \
            for (k = 0; k < 16; k++) {                                                      \
                const uint8_t *pw = panel + (16 * j + k) * 4 * COLIBRI_IGEMM_NR;            \
                __m256i w[3];                                                               \
                for (v = 0; v < MRV; v++)                                                   \
                    w[v] = _mm256_load_si256((const __m256i *)(const void *)(pw + 32 * v)); \
                for (t = 0; t < MT; t++) {                                                  \
                    const __m256i a = _mm256_set1_epi32(                                    \
                        colibri_ld_i32(q + t * qs + COLIBRI_IQ16_OFF(j, k)));               \
                    for (v = 0; v < MRV; v++) ia[t][v] = DOT16(ia[t][v], w[v], a);          \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (t = 0; t < MT; t++) {                                                          \
            const int corr = WIDE ? 0 : fmt == COLIBRI_Q4 ? s[t * ds + dp]                  \
                                      : fmt == COLIBRI_MXFP4                                \
                                      ? s[t * ds + dp] + (s[t * ds + dp] >> 1)              \
                                      : CORR8 * s[t * ds + dp];                             \
            const __m256 dv = _mm256_set1_ps(d[t * ds + dp]);                               \
            for (v = 0; v < MRV; v++) {                                                     \
                __m256i i = ia[t][v];                                                       \
                if (!WIDE && (fmt != COLIBRI_Q8 || CORR8))                                  \
                    i = _mm256_sub_epi32(i, _mm256_set1_epi32(corr));                       \
                fa[t][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i),                           \
                    _mm256_mul_ps(_mm256_loadu_ps(sc + j * COLIBRI_IGEMM_NR + 8 * v), dv),  \
                    fa[t][v]);                                                              \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (t = 0; t < MT; t++)                                                                \
        for (v = 0; v < MRV; v++) _mm256_storeu_ps(acc + t * COLIBRI_IGEMM_NR + 8 * v, fa[t][v]); \
}

/* AVX2: vpmaddubsw + vpmaddwd(ones); q8 signed codes through |w| x sign(a, w). */
#define COLIBRI_IDOT8_AVX2(ia, w, aw, a)                                                     \
    _mm256_add_epi32(ia, _mm256_madd_epi16(_mm256_maddubs_epi16(                            \
        aw, fmt == COLIBRI_Q8 ? _mm256_sign_epi8(a, w) : a), ones))
#define COLIBRI_IDOT16_AVX2(ia, w, a) _mm256_add_epi32(ia, _mm256_madd_epi16(w, a))
COLIBRI_DEF_IMK256(colibri_imk_avx2_body, COLIBRI_AVX2_INLINE, COLIBRI_IDOT8_AVX2,
                   COLIBRI_IDOT16_AVX2, 1, 0)
COLIBRI_DEF_IMK(colibri_imk_avx2, COLIBRI_AVX2_INLINE, colibri_imk_avx2_body, 2, 2)

#define COLIBRI_DEF_IGEMM_AVX2(NAME, FMT, WIDE)                                              \
    COLIBRI_DEF_IGEMM_SIMD(NAME, COLIBRI_AVX2_FN, FMT, WIDE, COLIBRI_IPANEL_S8,             \
                           colibri_imk_avx2, 8, 2, 2, 0, colibri_irepack_none)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm_q8_avx2, COLIBRI_Q8, 0)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm_q4_avx2, COLIBRI_Q4, 0)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm16_q8_avx2, COLIBRI_Q8, 1)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm16_q4_avx2, COLIBRI_Q4, 1)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm_mx_avx2, COLIBRI_MXFP4, 0)
COLIBRI_DEF_IGEMM_AVX2(colibri_igemm16_mx_avx2, COLIBRI_MXFP4, 1)
#endif /* COLIBRI_X86 */

#if COLIBRI_VNNI
/* AVX-VNNI (VEX, 16 registers): the 256-bit micro-kernel with vpdpbusd / vpdpwssd; the
 * panel's q8 bytes + 128, corrected by 16 s. 3 tokens x 2 vectors. */
#define COLIBRI_IDOT8_AVXVNNI(ia, w, aw, a) _mm256_dpbusd_avx_epi32(ia, w, a)
#define COLIBRI_IDOT16_AVXVNNI(ia, w, a) _mm256_dpwssd_avx_epi32(ia, w, a)
COLIBRI_DEF_IMK256(colibri_imk_avxvnni_body, COLIBRI_AVXVNNI_INLINE, COLIBRI_IDOT8_AVXVNNI,
                   COLIBRI_IDOT16_AVXVNNI, 0, 16)
COLIBRI_DEF_IMK(colibri_imk_avxvnni, COLIBRI_AVXVNNI_INLINE, colibri_imk_avxvnni_body, 2, 3)

#define COLIBRI_DEF_IGEMM_AVXVNNI(NAME, FMT, WIDE)                                           \
    COLIBRI_DEF_IGEMM_SIMD(NAME, COLIBRI_AVXVNNI_FN, FMT, WIDE, COLIBRI_IPANEL_U8,          \
                           colibri_imk_avxvnni, 8, 2, 3, 0, colibri_irepack_none)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm_q8_avxvnni, COLIBRI_Q8, 0)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm_q4_avxvnni, COLIBRI_Q4, 0)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm16_q8_avxvnni, COLIBRI_Q8, 1)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm16_q4_avxvnni, COLIBRI_Q4, 1)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm_mx_avxvnni, COLIBRI_MXFP4, 0)
COLIBRI_DEF_IGEMM_AVXVNNI(colibri_igemm16_mx_avxvnni, COLIBRI_MXFP4, 1)

/* AVX-512 VNNI: csrc/igemm_avx512.h (the 48-row micro-kernel, the split int16 scheme). */
#include "igemm_avx512.h"
/* AMX (amx, amx-emu): csrc/igemm_amx.h (tiles from colibri_amx_min_tokens tokens per pass). */
#include "igemm_amx.h"
#endif /* COLIBRI_VNNI */

/* The integer GEMM of (isa, fmt, wide: int16 codes, else int8); NULL unless fmt is q8, q4
 * or mxfp4. The avx512 path (no VNNI) runs the AVX2 body, as its row kernels do. */
static colibri_igemm_fn colibri_igemm_for(int isa, int fmt, int wide)
{
    if (fmt != COLIBRI_Q8 && fmt != COLIBRI_Q4 && fmt != COLIBRI_MXFP4) return NULL;
#define COLIBRI_IGEMM_PICK(SFX)                                                              \
    return wide ? (fmt == COLIBRI_Q8 ? colibri_igemm16_q8_##SFX                             \
                   : fmt == COLIBRI_Q4 ? colibri_igemm16_q4_##SFX : colibri_igemm16_mx_##SFX) \
                : (fmt == COLIBRI_Q8 ? colibri_igemm_q8_##SFX                               \
                   : fmt == COLIBRI_Q4 ? colibri_igemm_q4_##SFX : colibri_igemm_mx_##SFX);
    if (isa == COLIBRI_ISA_SCALAR) { COLIBRI_IGEMM_PICK(scalar) }
#if COLIBRI_AMX
    if (isa == COLIBRI_ISA_AMX) { COLIBRI_IGEMM_PICK(amx) }
#endif
#if COLIBRI_VNNI
    if (isa == COLIBRI_ISA_AMX_EMU) { COLIBRI_IGEMM_PICK(amxemu) }
    if (isa == COLIBRI_ISA_AVX512VNNI) { COLIBRI_IGEMM_PICK(avx512vnni) }
    if (isa == COLIBRI_ISA_AVXVNNI) { COLIBRI_IGEMM_PICK(avxvnni) }
#endif
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) { COLIBRI_IGEMM_PICK(avx2) }
#endif
#undef COLIBRI_IGEMM_PICK
    return NULL;
}

static int colibri_cpu_is_amd(void)
{
#if COLIBRI_X86
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
#else
    return 0;
#endif
}

/* AMD's AVX-512 (Zen 4: 512-bit instructions on 256-bit units) keeps the small-M row
 * kernels (smallm.h) ahead for longer in a whole model: mixtral-mini q4, 2 threads, one
 * forward of T tokens after 64 cached, crossover 4 / 8 / 16 / none, best of 6 alternated
 * (scripts/bench_crossover.py): T = 4 16.6 / 11.3 / 11.5 / 11.3 ms, T = 8 29.6 / 23.1 /
 * 20.7 / 20.4, T = 32 75.6 / 69.8 / 64.4 / 68.4, T = 128 (int8) 149 / 145 / 142 / 179;
 * int16 and int8 alike. One expert or attention matrix alone crosses at 5-8 there
 * (scripts/bench_igemm.py, 2 threads); why the model's calls cross later is not profiled.
 * Intel's avx512vnni keeps its measured 4. */
#define COLIBRI_IGEMM_CROSSOVER_AMD 16

/* From how many tokens per matrix the integer GEMM body of (isa, wide) beats the idot row
 * kernel, measured (docs/performance.md change 25: mixtral-mini's expert shapes, 1 thread,
 * scripts/bench_igemm.py; on AMD CPUs COLIBRI_IGEMM_CROSSOVER_AMD, measured in a whole
 * model, above); 0: at no token count measured (the AVX2 body, on the avx2 and avx512
 * paths: vpmaddubsw + vpmaddwd on 8-row vectors with 16 registers do no fewer
 * instructions per multiply-add than the row kernel, which decodes q4 cheaply; AVX-VNNI
 * int16, 16 steps per block in 16 registers). The path's default unless
 * runtime.igemm_min_tokens forces one number for every path. */
static ptrdiff_t colibri_igemm_crossover(int isa, int wide)
{
    isa = colibri_isa_int_base(isa);      /* the AMX bodies run avx512vnni's below their own */
    if (isa == COLIBRI_ISA_AVX512VNNI)
        return colibri_cpu_is_amd() ? COLIBRI_IGEMM_CROSSOVER_AMD : 4;
    if (isa == COLIBRI_ISA_AVXVNNI) return wide ? 0 : 6;
    return 0;
}

#if !COLIBRI_VNNI
static int colibri_amx_selfcheck_drill(int corrupt) { (void)corrupt; return -1; }
#endif

#endif /* COLIBRI_IGEMM_H */
