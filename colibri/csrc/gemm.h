/* csrc/gemm.h: the GEMM path (prefill): its driver, its scalar and AVX2 bodies and its table
 * per (path, format), colibri_gemm_for. */
#ifndef COLIBRI_GEMM_H
#define COLIBRI_GEMM_H

#include "types.h"
#include "avx2.h"
#include "avx512.h"
#include "mxfp4.h"

/* ==========================================================================================
 * GEMM path (prefill): one panel of up to COLIBRI_GEMM_NR weight rows against many tokens.
 *
 * The row kernel (avx2.h and the others) decodes a weight block once per token block (3-4
 * tokens): with many tokens per matrix the decoding dominates. Here the panel is decoded to f32
 * once per K-chunk of KC columns, row-major (panel[i][c]; f32 rows are copied too: read in
 * place, rows 4 KB apart would share L1 sets), and a register-blocked micro-kernel runs every
 * token block over it: MT = 4 tokens x MR = 3 rows, 12 accumulators of 8 column lanes; per 8
 * columns 3 weight loads, 4 x loads and 12 FMAs (0.22 instructions per multiply-add with the
 * loop). The lanes run along the columns, so the decoded rows need no transpose: the lane
 * partials of each (token, row) go to scratch between K-chunks, and the horizontal sum is taken
 * at the end.
 *
 * Arithmetic (what the results depend on): the decoded weight is exact, w = q * s (q4:
 * (nibble - 8) * s) or the widened plain element, the same float as colibri_decode_row. One
 * (row, token) output is
 *     lane j (j < 8) = sum over the columns c = j (mod 8), c < C8 = C - C % 8, in order
 *                      (a fused multiply-add in the AVX2 body; in the scalar body multiply
 *                      then add, unless the compiler contracts them for an FMA target)
 *     out = hsum(lanes), then fmaf(w[c], x[c], out) for the < 8 leftover columns, in
 *           order (plain formats; fused on every path: a plain "+=" would be contracted
 *           for some targets and not others)
 * so a result depends only on the row, the token and the path: not on the panel, the tile,
 * the token block or the number of tokens of the call. It does differ in the last bits from
 * the row kernel (another summation order).
 *
 * The AVX-512 bodies (every AVX-512 path, VNNI or not) run the same lanes two rows per
 * vector: the avx2 path's bits (see colibri_mk_avx512_body).
 */

#define COLIBRI_GEMM_NR 24    /* rows per panel (8 micro-panels of MR) */
#define COLIBRI_GEMM_MR 3     /* rows per micro-kernel pass */
#define COLIBRI_GEMM_MT 4     /* tokens per micro-kernel pass */
#define COLIBRI_GEMM_KC 256   /* columns per K-chunk: a 24 KB panel; with 4 tokens' x, in L1 */
#define COLIBRI_GEMM_NB 64    /* tokens per pass (callers split longer calls into passes
                                 of near-equal size and run each over a tile's panels) */
/* Floats of per-thread scratch: the panel, the lane partials (NB x NR x 8), then an NB x NR
 * tile for the caller. */
#define COLIBRI_GEMM_SCRATCH (COLIBRI_GEMM_NR * COLIBRI_GEMM_KC + \
                              9 * COLIBRI_GEMM_NB * COLIBRI_GEMM_NR)

/* y[t * ys + i] = W[i] . x[t] for i < nr <= NR, t < n <= NB: rows at row0 + i * row_stride,
 * x rows at x + t * xs; scratch: the first NR * (KC + 8 NB) floats of a thread's scratch
 * (64-byte aligned). */
typedef void (*colibri_gemm_fn)(const uint8_t *row0, ptrdiff_t row_stride, int nr,
                                ptrdiff_t cols, ptrdiff_t group, const float *x, ptrdiff_t xs,
                                ptrdiff_t n, float *y, ptrdiff_t ys, float *scratch);

/* Element c of a row of any format, dequantized (the value colibri_decode_row gives). */
static inline float colibri_weight_elem(int fmt, const uint8_t *row, ptrdiff_t cols,
                                        ptrdiff_t group, ptrdiff_t c)
{
    if (fmt == COLIBRI_MXFP4)
        return colibri_fp4_value(colibri_mxfp4_nibble(row, c))
               * colibri_e8m0_to_f32(row[cols / 2 + c / 32]);
    if (fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4) {
        const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
        float s = colibri_f16_to_f32(colibri_ld_u16(scales + 2 * (c / group)));
        float q = fmt == COLIBRI_Q8 ? (float)(int8_t)row[c]
                                    : (float)(colibri_q4_nibble(row, c) - 8);
        return q * s;
    }
    return colibri_plain_elem(fmt, row, c);
}

/* The driver shared by every path. Per K-chunk: decode the panel (DECODE: columns c0 ..
 * c0 + kc8 of rows < nr into panel[i * KC + c - c0]), then every token block (n tokens in
 * ceil(n / MT) blocks of near-equal size: block b is [b n / nb, (b + 1) n / nb)) against
 * every micro-panel of MR rows. Last: y = HSUM(lanes) + the leftover columns, in order. */
#define COLIBRI_GEMM_DRIVER(FMT, DECODE, MK, HSUM, MR)                                      \
    {                                                                                       \
        const ptrdiff_t C8 = cols & ~(ptrdiff_t)7, as = 8 * COLIBRI_GEMM_NR;                \
        const ptrdiff_t nb = (n + COLIBRI_GEMM_MT - 1) / COLIBRI_GEMM_MT;                   \
        float *panel = scratch, *acc = scratch + COLIBRI_GEMM_NR * COLIBRI_GEMM_KC;         \
        ptrdiff_t c0 = 0, b, t, c;                                                          \
        int i;                                                                              \
        do {                                                                                \
            const ptrdiff_t kc8 = C8 - c0 < COLIBRI_GEMM_KC ? C8 - c0 : COLIBRI_GEMM_KC;    \
            DECODE;                                                                         \
            for (b = 0; b < nb; b++) {                                                      \
                const ptrdiff_t t0 = b * n / nb, t1 = (b + 1) * n / nb;                     \
                for (i = 0; i < nr; i += (MR))                                              \
                    MK(panel + i * COLIBRI_GEMM_KC, COLIBRI_GEMM_KC, kc8, x + t0 * xs + c0, \
                       xs, acc + t0 * as + 8 * i, as, (int)(t1 - t0),                       \
                       nr - i < (MR) ? nr - i : (MR), c0 == 0);                             \
            }                                                                               \
            c0 += kc8;                                                                      \
        } while (c0 < C8);                                                                  \
        for (t = 0; t < n; t++)                                                             \
            for (i = 0; i < nr; i++) {                                                      \
                float v = HSUM(acc + t * as + 8 * i);                                       \
                for (c = C8; c < cols; c++)    /* fused, whatever the target contracts */  \
                    v = fmaf(colibri_weight_elem(FMT, row0 + i * rs, cols, group, c),       \
                             x[t * xs + c], v);                                             \
                y[t * ys + i] = v;                                                          \
            }                                                                               \
    }

/* Scalar bodies: the specification (and the path on non-x86 machines, where the compiler
 * vectorises the 8-lane inner loops). */
static void colibri_panel_scalar(int fmt, const uint8_t *row0, ptrdiff_t rs, int nr,
                                 ptrdiff_t cols, ptrdiff_t group, ptrdiff_t c0, ptrdiff_t kc,
                                 float *panel)
{
    ptrdiff_t c;
    int i;
    for (i = 0; i < nr; i++)
        for (c = 0; c < kc; c++)
            panel[i * COLIBRI_GEMM_KC + c] =
                colibri_weight_elem(fmt, row0 + i * rs, cols, group, c0 + c);
}

/* lanes[t][i][j] (+)= sum over c = j (mod 8) of w[i][c] x[t][c], c < kc8. */
static void colibri_mk_scalar(const float *w, ptrdiff_t ws, ptrdiff_t kc8, const float *x,
                              ptrdiff_t xs, float *acc, ptrdiff_t as, int mt, int mr,
                              int first)
{
    float l[8];
    ptrdiff_t c;
    int t, i, j;
    for (t = 0; t < mt; t++)
        for (i = 0; i < mr; i++) {
            const float *wi = w + i * ws, *xt = x + t * xs;
            float *a = acc + t * as + 8 * i;
            for (j = 0; j < 8; j++) l[j] = first ? 0.0f : a[j];
            for (c = 0; c < kc8; c += 8)
                for (j = 0; j < 8; j++) l[j] += wi[c + j] * xt[c + j];
            for (j = 0; j < 8; j++) a[j] = l[j];
        }
}

static inline float colibri_hsum8_scalar(const float *l)
{
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* MR: rows per micro-kernel pass (the driver's step over the panel). */
#define COLIBRI_DEF_GEMM(NAME, FMT, ATTR, PANEL, MK, HSUM, MR)                              \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,               \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, ptrdiff_t n, float *y,    \
                   ptrdiff_t ys, float *scratch)                                            \
    COLIBRI_GEMM_DRIVER(FMT, PANEL(FMT, row0, rs, nr, cols, group, c0, kc8, panel), MK, HSUM, \
                        MR)

#define COLIBRI_DEF_GEMM_SCALAR(NAME, FMT)                                                   \
    COLIBRI_DEF_GEMM(NAME, FMT, static, colibri_panel_scalar, colibri_mk_scalar,             \
                     colibri_hsum8_scalar, COLIBRI_GEMM_MR)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_f32_scalar, COLIBRI_F32)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_f16_scalar, COLIBRI_F16)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_bf16_scalar, COLIBRI_BF16)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_q8_scalar, COLIBRI_Q8)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_q4_scalar, COLIBRI_Q4)
COLIBRI_DEF_GEMM_SCALAR(colibri_gemm_mxfp4_scalar, COLIBRI_MXFP4)

#if COLIBRI_X86
/* AVX2 bodies. Decode: per 32 columns of a quantized row, the codes as four vectors
 * (colibri_codes32_avx2), times the group's scale (q4: fma(q, s, -8 s), exact); plain rows
 * widened 8 columns at a time. c0 is a multiple of 32 (KC is), kc8 of 8.
 * PAIRED (compile-time; the AVX-512 bodies): rows 2p and 2p + 1 interleaved by runs of 8
 * columns, [row 2p c..c+7 | row 2p+1 c..c+7] at panel + 2p KC + 2c, so that one 512-bit load
 * holds both rows' 8 columns; an odd last row's partner is zeros. Else row i at panel + i KC. */
#define COLIBRI_PANEL_POS(c) (PAIRED ? 2 * ((c) & ~(ptrdiff_t)7) + ((c) & 7) : (c))
COLIBRI_AVX2_INLINE void colibri_panel_avx2_body(const int fmt, const uint8_t *row0,
                                                 ptrdiff_t rs, int nr, ptrdiff_t cols,
                                                 ptrdiff_t group, ptrdiff_t c0, ptrdiff_t kc8,
                                                 float *panel, const int PAIRED)
{
    /* the scale of each 32-column block of the chunk, and -8 times it (q4) */
    float sb[COLIBRI_GEMM_KC / 32], ob[COLIBRI_GEMM_KC / 32];
    const ptrdiff_t nblk = kc8 / 32;
    int i;
    ptrdiff_t c, j;
    if (PAIRED && (nr & 1))
        for (c = 0; c < kc8; c += 8)
            _mm256_store_ps(panel + (nr - 1) * COLIBRI_GEMM_KC + 8 + 2 * c, _mm256_setzero_ps());
    for (i = 0; i < nr; i++) {
        const uint8_t *row = row0 + i * rs;
        float *out = panel + (PAIRED ? (i >> 1) * 2 * COLIBRI_GEMM_KC + 8 * (i & 1)
                                     : i * COLIBRI_GEMM_KC);
        if (fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4) {
            const uint8_t *sp = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
            const uint8_t *q = row + (fmt == COLIBRI_Q4 ? c0 / 2 : c0);
            ptrdiff_t g = c0 / group, left = group - c0 % group;    /* columns left in g */
            __m256 w[4];
            j = 0;
            if (group == 32)                         /* one scale per block: 8 at once */
                for (; j + 8 <= nblk; j += 8) {
                    const __m256 sc =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + 2 * (g + j))));
                    _mm256_storeu_ps(sb + j, sc);
                    _mm256_storeu_ps(ob + j, _mm256_mul_ps(sc, _mm256_set1_ps(-8.0f)));
                }
            if (group == 32) g += j;
            for (; j < nblk; j++) {                  /* block j: group g, `left` columns on */
                sb[j] = _cvtsh_ss(colibri_ld_u16(sp + 2 * g));
                ob[j] = -8.0f * sb[j];
                left -= 32;
                if (left == 0) { g++; left = group; }
            }
            for (j = 0; j < nblk; j++) {
                const __m256 sv = _mm256_broadcast_ss(sb + j);
                float *o = out + COLIBRI_PANEL_POS(32 * j);
                const ptrdiff_t r8 = COLIBRI_PANEL_POS(8);          /* the next 8 columns */
                colibri_codes32_avx2(fmt, q, w);
                q += fmt == COLIBRI_Q4 ? 16 : 32;
                if (fmt == COLIBRI_Q4) {
                    const __m256 ov = _mm256_broadcast_ss(ob + j);
                    _mm256_store_ps(o, _mm256_fmadd_ps(w[0], sv, ov));
                    _mm256_store_ps(o + r8, _mm256_fmadd_ps(w[1], sv, ov));
                    _mm256_store_ps(o + 2 * r8, _mm256_fmadd_ps(w[2], sv, ov));
                    _mm256_store_ps(o + 3 * r8, _mm256_fmadd_ps(w[3], sv, ov));
                } else {
                    _mm256_store_ps(o, _mm256_mul_ps(w[0], sv));
                    _mm256_store_ps(o + r8, _mm256_mul_ps(w[1], sv));
                    _mm256_store_ps(o + 2 * r8, _mm256_mul_ps(w[2], sv));
                    _mm256_store_ps(o + 3 * r8, _mm256_mul_ps(w[3], sv));
                }
            }
        } else if (fmt == COLIBRI_MXFP4) {
            /* per 32-column block: the 16 code bytes as 2 * FP4 in int8 by one pshufb per
             * half (colibri_fp4x32_avx2), widened, times scale / 2: v * 2^(e - 127) exactly,
             * the float colibri_weight_elem gives (an FP4 value has 2 significant bits; the
             * smallest product, 2^-128, is a float). cols is a multiple of 32, so kc8 is. */
            const uint8_t *q = row + c0 / 2, *sp = row + cols / 2 + c0 / 32;
            __m256 w[4];
            for (j = 0; j < nblk; j++, q += 16) {
                const __m256 sv = _mm256_set1_ps(0.5f * colibri_e8m0_to_f32(sp[j]));
                colibri_fp4x32_avx2(q, w);
                _mm256_store_ps(out + COLIBRI_PANEL_POS(32 * j), _mm256_mul_ps(w[0], sv));
                _mm256_store_ps(out + COLIBRI_PANEL_POS(32 * j + 8), _mm256_mul_ps(w[1], sv));
                _mm256_store_ps(out + COLIBRI_PANEL_POS(32 * j + 16), _mm256_mul_ps(w[2], sv));
                _mm256_store_ps(out + COLIBRI_PANEL_POS(32 * j + 24), _mm256_mul_ps(w[3], sv));
            }
            for (c = 32 * nblk; c < kc8; c++)
                out[COLIBRI_PANEL_POS(c)] = colibri_weight_elem(fmt, row, cols, group, c0 + c);
        } else {
            for (c = 0; c < kc8; c += 8)
                _mm256_store_ps(out + COLIBRI_PANEL_POS(c), colibri_load8_avx2(fmt, row, c0 + c));
        }
    }
}
#undef COLIBRI_PANEL_POS

/* The micro-kernel: MT tokens x NG row groups, 8 column lanes per row; lanes read from acc
 * first unless FIRST. One text for the AVX2 body (P = 256: a group is one row, a vector its
 * 8 lanes) and the AVX-512 body (P = 512: a group is a row pair of the PAIRED panel, a
 * vector both rows' 8 lanes), over each path's vector operations COLIBRI_MK<P>_<OP> (V: the
 * type; ZERO; LDA / STA: an accumulator's lanes from / to acc; X(p): a token's 8 columns at
 * p, broadcast to every row of a group; W(p, c): a group's 8 columns c..c+7, p its first
 * row's start; GS: panel rows per group, so 8 GS floats of acc per group). Named
 * accumulators, not arrays: GCC 12 keeps an array of vectors in registers but also stores
 * it to the stack on every iteration. */
#define COLIBRI_MK_OP(P, OP) COLIBRI_MK##P##_##OP
#define COLIBRI_MK_TOKENS(X, P)                                                              \
    X(0, a00, a01, a02, P) X(1, a10, a11, a12, P) X(2, a20, a21, a22, P)                     \
    X(3, a30, a31, a32, P)
#define COLIBRI_MK_LOAD(T, A0, A1, A2, P)                                                    \
    if (MT > T) {                                                                           \
        A0 = COLIBRI_MK_OP(P, LDA)(acc + T * as);                                           \
        if (NG > 1) A1 = COLIBRI_MK_OP(P, LDA)(acc + T * as + 8 * COLIBRI_MK_OP(P, GS));    \
        if (NG > 2) A2 = COLIBRI_MK_OP(P, LDA)(acc + T * as + 16 * COLIBRI_MK_OP(P, GS));   \
    }
#define COLIBRI_MK_FMA(T, A0, A1, A2, P)                                                     \
    if (MT > T) {                                                                           \
        const COLIBRI_MK_OP(P, V) xv = COLIBRI_MK_OP(P, X)(x + T * xs + c);                 \
        A0 = COLIBRI_MK_OP(P, FMA)(w0, xv, A0);                                             \
        if (NG > 1) A1 = COLIBRI_MK_OP(P, FMA)(w1, xv, A1);                                 \
        if (NG > 2) A2 = COLIBRI_MK_OP(P, FMA)(w2, xv, A2);                                 \
    }
#define COLIBRI_MK_STORE(T, A0, A1, A2, P)                                                   \
    if (MT > T) {                                                                           \
        COLIBRI_MK_OP(P, STA)(acc + T * as, A0);                                            \
        if (NG > 1) COLIBRI_MK_OP(P, STA)(acc + T * as + 8 * COLIBRI_MK_OP(P, GS), A1);     \
        if (NG > 2) COLIBRI_MK_OP(P, STA)(acc + T * as + 16 * COLIBRI_MK_OP(P, GS), A2);    \
    }
#if defined(__clang__)
#define COLIBRI_UNROLL2 _Pragma("unroll 2")
#elif defined(__GNUC__)
#define COLIBRI_UNROLL2 _Pragma("GCC unroll 2")
#else
#define COLIBRI_UNROLL2
#endif
#define COLIBRI_MK_BODY(NAME, ATTR, P)                                                       \
ATTR void NAME(const float *w, ptrdiff_t ws, ptrdiff_t kc8, const float *x, ptrdiff_t xs,    \
               float *acc, ptrdiff_t as, const int MT, const int NG, const int FIRST)        \
{                                                                                            \
    const COLIBRI_MK_OP(P, V) z = COLIBRI_MK_OP(P, ZERO)();                                  \
    COLIBRI_MK_OP(P, V) a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z,       \
                        a21 = z, a22 = z, a30 = z, a31 = z, a32 = z, w0 = z, w1 = z, w2 = z; \
    const ptrdiff_t gs = COLIBRI_MK_OP(P, GS) * ws;          /* panel floats per group */  \
    const float *w1p = w + gs, *w2p = w + 2 * gs;                                            \
    ptrdiff_t c;                                                                             \
    if (!FIRST) { COLIBRI_MK_TOKENS(COLIBRI_MK_LOAD, P) }                                    \
    COLIBRI_UNROLL2                                                                          \
    for (c = 0; c < kc8; c += 8) {                                                           \
        w0 = COLIBRI_MK_OP(P, W)(w, c);                                                      \
        if (NG > 1) w1 = COLIBRI_MK_OP(P, W)(w1p, c);                                        \
        if (NG > 2) w2 = COLIBRI_MK_OP(P, W)(w2p, c);                                        \
        COLIBRI_MK_TOKENS(COLIBRI_MK_FMA, P)                                                 \
    }                                                                                        \
    COLIBRI_MK_TOKENS(COLIBRI_MK_STORE, P)                                                   \
}

/* The micro-kernel entry of a path: mt tokens (1..4) x mr rows, the body unrolled for each
 * (tokens, groups) case; NG: the groups of mr rows. */
#define COLIBRI_DEF_MK(NAME, ATTR, BODY, NG)                                                 \
ATTR void NAME(const float *w, ptrdiff_t ws, ptrdiff_t kc8, const float *x, ptrdiff_t xs,    \
               float *acc, ptrdiff_t as, int mt, int mr, int first)                          \
{                                                                                            \
    const int ng = NG(mr);                                                                   \
    switch (mt * 4 + ng) {                                                                   \
    COLIBRI_MK_CASES(BODY, 4) COLIBRI_MK_CASES(BODY, 3) COLIBRI_MK_CASES(BODY, 2)            \
    default: COLIBRI_MK_CASES(BODY, 1)                                                       \
    }                                                                                        \
}
#define COLIBRI_MK_CALL(BODY, MT, G)                                                         \
    if (first) BODY(w, ws, kc8, x, xs, acc, as, MT, G, 1);                                   \
    else BODY(w, ws, kc8, x, xs, acc, as, MT, G, 0);                                         \
    return;
#define COLIBRI_MK_CASES(BODY, MT)                                                           \
    case MT * 4 + 3: COLIBRI_MK_CALL(BODY, MT, 3)                                            \
    case MT * 4 + 2: COLIBRI_MK_CALL(BODY, MT, 2)                                            \
    case MT * 4 + 1: COLIBRI_MK_CALL(BODY, MT, 1)

#define COLIBRI_MK256_V __m256
#define COLIBRI_MK256_ZERO _mm256_setzero_ps
#define COLIBRI_MK256_LDA _mm256_loadu_ps
#define COLIBRI_MK256_STA _mm256_storeu_ps
#define COLIBRI_MK256_FMA _mm256_fmadd_ps
#define COLIBRI_MK256_X _mm256_loadu_ps
#define COLIBRI_MK256_W(p, c) _mm256_loadu_ps((p) + (c))
#define COLIBRI_MK256_GS 1
COLIBRI_MK_BODY(colibri_mk_avx2_body, COLIBRI_AVX2_INLINE, 256)
#define COLIBRI_MK_ROWS_AVX2(mr) (mr)
COLIBRI_DEF_MK(colibri_mk_avx2, COLIBRI_AVX2_FN, colibri_mk_avx2_body, COLIBRI_MK_ROWS_AVX2)

COLIBRI_AVX2_INLINE float colibri_hsum8_avx2(const float *l)
{
    return colibri_hsum256(_mm256_loadu_ps(l));
}

#define COLIBRI_DEF_GEMM_AVX2(NAME, FMT)                                                     \
    COLIBRI_AVX2_INLINE void NAME##_panel(const int fmt, const uint8_t *row0, ptrdiff_t rs, \
                                          int nr, ptrdiff_t cols, ptrdiff_t group,          \
                                          ptrdiff_t c0, ptrdiff_t kc8, float *panel)        \
    {                                                                                       \
        colibri_panel_avx2_body(FMT, row0, rs, nr, cols, group, c0, kc8, panel, 0);         \
        (void)fmt;                                                                          \
    }                                                                                       \
    COLIBRI_DEF_GEMM(NAME, FMT, COLIBRI_AVX2_FN, NAME##_panel, colibri_mk_avx2,             \
                     colibri_hsum8_avx2, COLIBRI_GEMM_MR)

COLIBRI_DEF_GEMM_AVX2(colibri_gemm_f32_avx2, COLIBRI_F32)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_f16_avx2, COLIBRI_F16)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_bf16_avx2, COLIBRI_BF16)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_q8_avx2, COLIBRI_Q8)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_q4_avx2, COLIBRI_Q4)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_mxfp4_avx2, COLIBRI_MXFP4)

/* AVX-512 bodies: the AVX2 arithmetic, two rows per vector. The panel is PAIRED (one 512-bit
 * load = rows 2p and 2p + 1, 8 columns each); each token's 8 columns are broadcast to both
 * halves; an accumulator holds the 8 lanes of two rows, i.e. acc + t as + 16 p, where the
 * AVX2 body keeps one row's 8. Every lane sees the same fused multiply-adds in the same
 * order as in the AVX2 body, and the same horizontal sum follows, so the results are the
 * avx2 path's, bit for bit, at twice the multiply-adds per instruction: MT = 4 tokens x MR
 * = 6 rows (3 pairs), 12 accumulators of 16 lanes; per 8 columns 3 weight loads, 4
 * broadcasts, 12 FMAs. An odd last row's partner (zeros in the panel) accumulates into the
 * lane slot of row nr, which the driver never reads (nr < NR then). */
#define COLIBRI_GEMM_MR512 6
#define COLIBRI_MK512_V __m512
#define COLIBRI_MK512_ZERO _mm512_setzero_ps
#define COLIBRI_MK512_LDA _mm512_loadu_ps
#define COLIBRI_MK512_STA _mm512_storeu_ps
#define COLIBRI_MK512_FMA _mm512_fmadd_ps
#define COLIBRI_MK512_X(p) _mm512_broadcast_f32x8(_mm256_loadu_ps(p))
#define COLIBRI_MK512_W(p, c) _mm512_load_ps((p) + 2 * (c))
#define COLIBRI_MK512_GS 2
COLIBRI_MK_BODY(colibri_mk_avx512_body, COLIBRI_AVX512_INLINE, 512)
#define COLIBRI_MK_PAIRS(mr) (((mr) + 1) / 2)                 /* row pairs, 1..3 */
COLIBRI_DEF_MK(colibri_mk_avx512, COLIBRI_AVX512_FN, colibri_mk_avx512_body, COLIBRI_MK_PAIRS)

#define COLIBRI_DEF_GEMM_AVX512(NAME, FMT)                                                   \
    COLIBRI_AVX512_INLINE void NAME##_panel(const int fmt, const uint8_t *row0,             \
                                            ptrdiff_t rs, int nr, ptrdiff_t cols,           \
                                            ptrdiff_t group, ptrdiff_t c0, ptrdiff_t kc8,   \
                                            float *panel)                                   \
    {                                                                                       \
        colibri_panel_avx2_body(FMT, row0, rs, nr, cols, group, c0, kc8, panel, 1);         \
        (void)fmt;                                                                          \
    }                                                                                       \
    COLIBRI_DEF_GEMM(NAME, FMT, COLIBRI_AVX512_FN, NAME##_panel, colibri_mk_avx512,         \
                     colibri_hsum8_avx2, COLIBRI_GEMM_MR512)

COLIBRI_DEF_GEMM_AVX512(colibri_gemm_f32_avx512, COLIBRI_F32)
COLIBRI_DEF_GEMM_AVX512(colibri_gemm_f16_avx512, COLIBRI_F16)
COLIBRI_DEF_GEMM_AVX512(colibri_gemm_bf16_avx512, COLIBRI_BF16)
COLIBRI_DEF_GEMM_AVX512(colibri_gemm_q8_avx512, COLIBRI_Q8)
COLIBRI_DEF_GEMM_AVX512(colibri_gemm_q4_avx512, COLIBRI_Q4)
COLIBRI_DEF_GEMM_AVX512(colibri_gemm_mxfp4_avx512, COLIBRI_MXFP4)
#endif /* COLIBRI_X86 */

/* The GEMM panel kernel of (isa, fmt); NULL for an unknown pair or a path not compiled in. */
static colibri_gemm_fn colibri_gemm_for(int isa, int fmt)
{
    static const colibri_gemm_fn scalar[COLIBRI_N_FMT] = {
        colibri_gemm_f32_scalar, colibri_gemm_f16_scalar, colibri_gemm_bf16_scalar,
        colibri_gemm_q8_scalar, colibri_gemm_q4_scalar,
        [COLIBRI_MXFP4] = colibri_gemm_mxfp4_scalar};
#if COLIBRI_X86
    static const colibri_gemm_fn avx2[COLIBRI_N_FMT] = {
        colibri_gemm_f32_avx2, colibri_gemm_f16_avx2, colibri_gemm_bf16_avx2,
        colibri_gemm_q8_avx2, colibri_gemm_q4_avx2, [COLIBRI_MXFP4] = colibri_gemm_mxfp4_avx2};
    static const colibri_gemm_fn avx512[COLIBRI_N_FMT] = {
        colibri_gemm_f32_avx512, colibri_gemm_f16_avx512, colibri_gemm_bf16_avx512,
        colibri_gemm_q8_avx512, colibri_gemm_q4_avx512,
        [COLIBRI_MXFP4] = colibri_gemm_mxfp4_avx512};
#endif
    if (fmt < 0 || fmt >= COLIBRI_N_FMT) return NULL;
    isa = colibri_isa_base(isa);
    if (isa == COLIBRI_ISA_SCALAR) return scalar[fmt];
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2) return avx2[fmt];
    if (isa == COLIBRI_ISA_AVX512) return avx512[fmt];
#endif
    return NULL;
}

#endif /* COLIBRI_GEMM_H */
