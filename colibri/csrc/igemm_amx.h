/* csrc/igemm_amx.h: the AMX bodies of the integer GEMM (igemm.h), written once over the tile
 * operations of csrc/amx_tiles.h and instantiated for the instructions (path amx) and their
 * emulation (amx-emu). Not a header of its own: igemm.h includes it in its COLIBRI_VNNI
 * section, after the avx512vnni bodies (a call of fewer than colibri_amx_min_tokens tokens
 * runs those) and the panel decoder, before the table (colibri_igemm_for).
 *
 * Blocking. Tokens are the tiles' rows (A: 16 tokens x one block of 32 codes, int8), weight
 * rows their columns (B: the block's 8 steps of 4 codes for 16 rows, the VNNI order the panel
 * decoder already writes: step k of block j, row r at panel[(8 j + k) 4 NR + 4 r]), so one
 * dot product gives the 16 x 16 exact int32 block sums of 16 tokens x 16 rows (C). A call is
 * igemm.h's: a panel of NR = 48 rows (3 B tiles) decoded once per K-chunk of 8 blocks, up to
 * NB = 64 tokens (4 A tiles). Per (token block, 16 rows): for every block j of the chunk one
 * dot product (K = 32: the block sums must stay apart, each has its own scales), its C
 * stored, then the float part of the 16 x 16 outputs in 16 registers; the tile work of
 * block j + 1 is issued before the float part of block j (two sets of tiles: C 0 / 1, A 4 /
 * 5, B 6 / 7), so the matrix unit and the vector units overlap.
 *
 * The codes: the panel holds signed weight codes (COLIBRI_IPANEL_I8: q4 nibble - 8, q8 the
 * byte, mxfp4 2 * FP4), so no correction term:
 *   int8 activations:  isum = TDPBSSD(A = codes, B = weights)                      (s8 x s8)
 *   int16 activations: a = 256 hi + lo, hi = a >> 8 (s8), lo = a & 255 (u8), so
 *                      isum = 256 TDPBSSD(A = hi, B) + TDPBUSD(A = lo, B)      (u8 x s8)
 *                      (|256 sum w hi| <= 256 * 32 * 128 * 128 = 2^27: exact in int32).
 * Every block sum is the exact integer of the specification (igemm.h), and the float part is
 * the avx512vnni body's: acc = fmaf((float)isum, s * d, acc) per block in block order (the
 * product s * d rounded first, vcvtdq2ps rounding to nearest even), so the outputs are the
 * avx512vnni path's bits and the scalar specification's, for every format and both widths.
 */
#ifndef COLIBRI_IGEMM_AMX_H
#define COLIBRI_IGEMM_AMX_H

#include "amx.h"

/* The thread's scratch: the signed panel (NR x KC bytes), the scales (NR x 8 floats), the A
 * tiles of a token block (8 blocks x 512 bytes; int16: hi bytes, then lo bytes at + 4096),
 * two blocks' stored C tiles (2 x 2048 bytes: int32, int16 hi then lo), the token block's
 * activation scales (8 x 16 floats, 0 past the last token), the accumulators (NB x NR).
 * The caller's NB x NR tile at the end of the scratch stays clear. */
#define COLIBRI_IAMX_PANEL 0
#define COLIBRI_IAMX_SC (COLIBRI_IGEMM_NR * COLIBRI_IGEMM_KC)
#define COLIBRI_IAMX_A (COLIBRI_IAMX_SC + 4 * 8 * COLIBRI_IGEMM_NR)
#define COLIBRI_IAMX_C (COLIBRI_IAMX_A + 2 * 8 * 512)
#define COLIBRI_IAMX_D (COLIBRI_IAMX_C + 2 * 2048)
#define COLIBRI_IAMX_ACC (COLIBRI_IAMX_D + 4 * 8 * 16)
#define COLIBRI_IAMX_BYTES (COLIBRI_IAMX_ACC + 4 * COLIBRI_IGEMM_NB * COLIBRI_IGEMM_NR)
typedef char colibri_iamx_scratch_fits[
    COLIBRI_IAMX_BYTES + 4 * COLIBRI_IGEMM_NB * COLIBRI_IGEMM_NR <= 4 * COLIBRI_GEMM_SCRATCH ? 1 : -1];

/* The A tiles of tokens 0 .. mt - 1 (mt <= 16; rows past mt zero) for blocks b0 .. b0 + kb - 1:
 * block j's 32 codes of token t in column order at apack + 512 j + 32 t (int8: the two 16-code
 * halves of the packed pair layout, colibri_qpos; int16: colibri_qpos16's four runs of 8,
 * split into high bytes there and low bytes at + 4096). */
COLIBRI_AVX512VNNI_INLINE void colibri_iamx_pack(const int WIDE, const int8_t *q, ptrdiff_t qs,
                                                  int mt, ptrdiff_t b0, int kb, uint8_t *apack)
{
    int j, t;
    for (j = 0; j < kb; j++) {
        const ptrdiff_t b = b0 + j;
        for (t = 0; t < 16; t++) {
            uint8_t *o = apack + 512 * j + 32 * t;
            if (t >= mt) {
                memset(o, 0, 32);
                if (WIDE) memset(o + 4096, 0, 32);
            } else if (!WIDE) {
                const int8_t *src = q + t * qs + 64 * (b >> 1) + 16 * (b & 1);
                _mm_storeu_si128((__m128i *)(void *)o, _mm_loadu_si128((const __m128i *)src));
                _mm_storeu_si128((__m128i *)(void *)(o + 16),
                                 _mm_loadu_si128((const __m128i *)(src + 32)));
            } else {
                const int16_t *src = (const int16_t *)(const void *)(q + t * qs) +
                                     64 * (b >> 1) + 8 * (b & 1);
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)src));
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(src + 16)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(src + 32)), 2);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(src + 48)), 3);
                _mm256_storeu_si256((__m256i *)(void *)o,
                                    _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
                _mm256_storeu_si256((__m256i *)(void *)(o + 4096), _mm512_cvtepi16_epi8(v));
            }
        }
    }
}

/* One block's tile work (set: C TC (int16: TC hi, TL lo), A TA, B TB), its C stored at cb. */
#define COLIBRI_IAMX_STEP8(P, TC, TA, TB, j, cb)                                             \
    do {                                                                                    \
        COLIBRI_TILE(P, ZERO)(TC);                                                          \
        COLIBRI_TILE(P, LOAD)(TA, apack + 512 * (j), 32);                                   \
        COLIBRI_TILE(P, LOAD)(TB, panel + (j) * 32 * COLIBRI_IGEMM_NR + 64 * v,             \
                              4 * COLIBRI_IGEMM_NR);                                        \
        COLIBRI_TILE(P, DPBSSD)(TC, TA, TB);                                                \
        COLIBRI_TILE(P, STORE)(TC, cb, 64);                                                 \
    } while (0)
#define COLIBRI_IAMX_STEP16(P, TC, TL, TB, j, cb)                                            \
    do {                                                                                    \
        COLIBRI_TILE(P, ZERO)(TC);                                                          \
        COLIBRI_TILE(P, ZERO)(TL);                                                          \
        COLIBRI_TILE(P, LOAD)(4, apack + 512 * (j), 32);                                    \
        COLIBRI_TILE(P, LOAD)(5, apack + 4096 + 512 * (j), 32);                             \
        COLIBRI_TILE(P, LOAD)(TB, panel + (j) * 32 * COLIBRI_IGEMM_NR + 64 * v,             \
                              4 * COLIBRI_IGEMM_NR);                                        \
        COLIBRI_TILE(P, DPBSSD)(TC, 4, TB);                                                 \
        COLIBRI_TILE(P, DPBUSD)(TL, 5, TB);                                                 \
        COLIBRI_TILE(P, STORE)(TC, cb, 64);                                                 \
        COLIBRI_TILE(P, STORE)(TL, cb + 1024, 64);                                          \
    } while (0)
/* block j's tile work on the set of its parity */
#define COLIBRI_IAMX_STEP(P, j)                                                              \
    do {                                                                                    \
        if (WIDE) {                                                                         \
            if ((j) & 1) COLIBRI_IAMX_STEP16(P, 2, 3, 7, j, cbuf + 2048);                   \
            else COLIBRI_IAMX_STEP16(P, 0, 1, 6, j, cbuf);                                  \
        } else {                                                                            \
            if ((j) & 1) COLIBRI_IAMX_STEP8(P, 1, 5, 7, j, cbuf + 2048);                    \
            else COLIBRI_IAMX_STEP8(P, 0, 4, 6, j, cbuf);                                   \
        }                                                                                   \
    } while (0)

#define COLIBRI_IAMX_T16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)     \
                            X(12) X(13) X(14) X(15)
#define COLIBRI_IAMX_DECL(T) __m512 a##T;
#define COLIBRI_IAMX_LDA(T) a##T = _mm512_loadu_ps(acc + (t0 + T) * COLIBRI_IGEMM_NR + 16 * v);
#define COLIBRI_IAMX_STA(T) _mm512_storeu_ps(acc + (t0 + T) * COLIBRI_IGEMM_NR + 16 * v, a##T);
/* token T's 16 rows of block j: acc = fma(float(isum), s * d, acc) */
#define COLIBRI_IAMX_EPI(T)                                                                  \
    {                                                                                       \
        const __m512i c = _mm512_load_si512((const void *)(cb + 64 * T));                   \
        const __m512i i = WIDE ? _mm512_add_epi32(_mm512_slli_epi32(c, 8), _mm512_load_si512( \
                                     (const void *)(cb + 1024 + 64 * T))) : c;              \
        a##T = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scv, _mm512_set1_ps(dj[T])), \
                               a##T);                                                       \
    }

/* NAME##_tiles: the tile body (igemm.h's colibri_igemm_fn contract); NAME: it from
 * colibri_amx_min_tokens tokens, BELOW (the avx512vnni body) under. */
#define COLIBRI_DEF_IGEMM_AMX(NAME, ATTR, P, FMT, WIDE_, BELOW)                              \
ATTR void NAME##_tiles(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,            \
                       ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,       \
                       const int32_t *s, ptrdiff_t ds, ptrdiff_t n, float *y, ptrdiff_t ys,  \
                       float *scratch)                                                       \
{                                                                                            \
    const int WIDE = WIDE_;                                                                  \
    uint8_t *const base = (uint8_t *)(void *)scratch;                                        \
    uint8_t *const panel = base + COLIBRI_IAMX_PANEL, *const apack = base + COLIBRI_IAMX_A;  \
    uint8_t *const cbuf = base + COLIBRI_IAMX_C;                                             \
    float *const sc = (float *)(void *)(base + COLIBRI_IAMX_SC);                             \
    float *const dv = (float *)(void *)(base + COLIBRI_IAMX_D);                              \
    float *const acc = (float *)(void *)(base + COLIBRI_IAMX_ACC);                           \
    const ptrdiff_t nb = cols / 32;                                                          \
    const int nv = (nr + 15) / 16;                                                           \
    const colibri_tilecfg cfg = colibri_tilecfg_of(COLIBRI_TILECFG_INT);                     \
    ptrdiff_t b0, t0, t;                                                                     \
    int v, j, i;                                                                             \
    COLIBRI_TILE_STATE(P);                                                                   \
    (void)s;                                                                                 \
    COLIBRI_TILE(P, CONFIG)(&cfg, COLIBRI_TILECFG_INT);                                      \
    memset(acc, 0, sizeof(float) * COLIBRI_IGEMM_NR * ((n + 15) & ~(ptrdiff_t)15));         \
    for (b0 = 0; b0 < nb; b0 += 8) {                                                         \
        const int kb = nb - b0 < 8 ? (int)(nb - b0) : 8;                                     \
        colibri_ipanel_avx2(FMT, COLIBRI_IPANEL_I8, row0, rs, nr, 2 * nv, cols, group, b0,  \
                            kb, panel, sc, NULL);                                            \
        for (t0 = 0; t0 < n; t0 += 16) {                                                     \
            const int mt = n - t0 < 16 ? (int)(n - t0) : 16;                                 \
            colibri_iamx_pack(WIDE, q + t0 * qs, qs, mt, b0, kb, apack);                     \
            for (j = 0; j < kb; j++)                                                         \
                for (i = 0; i < 16; i++)                                                     \
                    dv[16 * j + i] = i < mt ? d[(t0 + i) * ds + b0 + colibri_dpos(j)] : 0.0f; \
            for (v = 0; v < nv; v++) {                                                       \
                COLIBRI_IAMX_T16(COLIBRI_IAMX_DECL)                                          \
                COLIBRI_IAMX_T16(COLIBRI_IAMX_LDA)                                           \
                COLIBRI_IAMX_STEP(P, 0);                                                     \
                for (j = 0; j < kb; j++) {                                                   \
                    const uint8_t *const cb = cbuf + 2048 * (j & 1);                         \
                    const __m512 scv = _mm512_loadu_ps(sc + j * COLIBRI_IGEMM_NR + 16 * v);  \
                    const float *const dj = dv + 16 * j;                                     \
                    if (j + 1 < kb) COLIBRI_IAMX_STEP(P, j + 1);                             \
                    COLIBRI_IAMX_T16(COLIBRI_IAMX_EPI)                                       \
                }                                                                            \
                COLIBRI_IAMX_T16(COLIBRI_IAMX_STA)                                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    for (t = 0; t < n; t++)                                                                  \
        for (i = 0; i < nr; i++) y[t * ys + i] = acc[t * COLIBRI_IGEMM_NR + i];              \
}                                                                                            \
static void NAME(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols, ptrdiff_t group, \
                 const int8_t *q, ptrdiff_t qs, const float *d, const int32_t *s,            \
                 ptrdiff_t ds, ptrdiff_t n, float *y, ptrdiff_t ys, float *scratch)          \
{                                                                                            \
    if (n < colibri_amx_min_tokens)                                                          \
        BELOW(row0, rs, nr, cols, group, q, qs, d, s, ds, n, y, ys, scratch);                \
    else                                                                                     \
        NAME##_tiles(row0, rs, nr, cols, group, q, qs, d, s, ds, n, y, ys, scratch);         \
}

#define COLIBRI_DEF_IGEMM_AMX_ALL(SFX, ATTR, P)                                              \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm_q8_##SFX, ATTR, P, COLIBRI_Q8, 0,                    \
                          colibri_igemm_q8_avx512vnni)                                       \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm_q4_##SFX, ATTR, P, COLIBRI_Q4, 0,                    \
                          colibri_igemm_q4_avx512vnni)                                       \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm16_q8_##SFX, ATTR, P, COLIBRI_Q8, 1,                  \
                          colibri_igemm16_q8_avx512vnni)                                     \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm16_q4_##SFX, ATTR, P, COLIBRI_Q4, 1,                  \
                          colibri_igemm16_q4_avx512vnni)                                     \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm_mx_##SFX, ATTR, P, COLIBRI_MXFP4, 0,                 \
                          colibri_igemm_mx_avx512vnni)                                       \
    COLIBRI_DEF_IGEMM_AMX(colibri_igemm16_mx_##SFX, ATTR, P, COLIBRI_MXFP4, 1,               \
                          colibri_igemm16_mx_avx512vnni)

COLIBRI_DEF_IGEMM_AMX_ALL(amxemu, COLIBRI_AVX512VNNI_FN, EMU)
#if COLIBRI_AMX
COLIBRI_DEF_IGEMM_AMX_ALL(amx, COLIBRI_AMX_FN, AMX)
#endif

/* The tile body of (isa: amx or amx-emu, fmt, wide) whatever the token count (the
 * self-check, the tests' hook); NULL for another pair. */
static colibri_igemm_fn colibri_igemm_tiles_for(int isa, int fmt, int wide)
{
#define COLIBRI_IAMX_PICK(SFX)                                                               \
    return wide ? (fmt == COLIBRI_Q8 ? colibri_igemm16_q8_##SFX##_tiles                     \
                   : fmt == COLIBRI_Q4 ? colibri_igemm16_q4_##SFX##_tiles                   \
                   : colibri_igemm16_mx_##SFX##_tiles)                                      \
                : (fmt == COLIBRI_Q8 ? colibri_igemm_q8_##SFX##_tiles                       \
                   : fmt == COLIBRI_Q4 ? colibri_igemm_q4_##SFX##_tiles                     \
                   : colibri_igemm_mx_##SFX##_tiles);
    if (fmt != COLIBRI_Q8 && fmt != COLIBRI_Q4 && fmt != COLIBRI_MXFP4) return NULL;
    if (isa == COLIBRI_ISA_AMX_EMU) { COLIBRI_IAMX_PICK(amxemu) }
#if COLIBRI_AMX
    if (isa == COLIBRI_ISA_AMX) { COLIBRI_IAMX_PICK(amx) }
#endif
#undef COLIBRI_IAMX_PICK
    return NULL;
}

#endif /* COLIBRI_IGEMM_AMX_H */

/* The self-check before amx is first chosen: each tile body of path isa_a against path
 * isa_b's on 48 rows x 256 columns of random codes x 16 tokens (every format and width);
 * 1: the same bits. The real check is amx against amx-emu; corrupt (the drill of
 * colibri_amx_selfcheck_drill) flips the last bit of one output of isa_a first. */
static int colibri_amx_compare_bodies(int isa_a, int isa_b, int corrupt)
{
    static float scratch[COLIBRI_GEMM_SCRATCH] __attribute__((aligned(64)));
    static float scratch2[COLIBRI_GEMM_SCRATCH] __attribute__((aligned(64)));
    static uint8_t rows[48 * 320];
    static int8_t q[16 * 512];
    static float d[16 * 8], y1[16 * 48], y2[16 * 48];
    static int32_t s[16 * 8];
    const int fmts[3] = {COLIBRI_Q8, COLIBRI_Q4, COLIBRI_MXFP4};
    uint32_t x = 12345u;
    int i, f, wide;
    for (i = 0; i < (int)sizeof(rows); i++) { x = x * 1103515245u + 12345u; rows[i] = (uint8_t)(x >> 16); }
    for (i = 0; i < (int)sizeof(q); i++) { x = x * 1103515245u + 12345u; q[i] = (int8_t)(x >> 16); }
    for (i = 0; i < 16 * 8; i++) { d[i] = 0.001f * (float)(i + 1); s[i] = 0; }
    for (f = 0; f < 3; f++)
        for (wide = 0; wide < 2; wide++) {
            const int fmt = fmts[f];
            const ptrdiff_t rs = fmt == COLIBRI_Q8 ? 320 : 160;
            const ptrdiff_t soff = fmt == COLIBRI_Q8 ? 256 : 128;
            colibri_igemm_fn body_a = colibri_igemm_tiles_for(isa_a, fmt, wide);
            colibri_igemm_fn body_b = colibri_igemm_tiles_for(isa_b, fmt, wide);
            int r;
            if (body_a == NULL || body_b == NULL) return 0;
            for (r = 0; r < 48; r++)            /* scales: f16 1.0 (q8, q4), E8M0 2^0 */
                for (i = 0; i < 8; i++) {
                    uint8_t *sp = rows + r * rs + soff;
                    if (fmt == COLIBRI_MXFP4) sp[i] = 127;
                    else { sp[2 * i] = 0x00; sp[2 * i + 1] = 0x3C; }
                }
            body_a(rows, rs, 48, 256, 32, q, wide ? 512 : 256, d, s, 8, 16, y1, 48, scratch);
            body_b(rows, rs, 48, 256, 32, q, wide ? 512 : 256, d, s, 8, 16, y2, 48, scratch2);
            if (colibri_tls_tiles) { colibri_tiles_release(); colibri_tls_tiles = 0; }
            if (corrupt) {
                uint32_t u;
                memcpy(&u, &y1[7], 4);
                u ^= 1u;
                memcpy(&y1[7], &u, 4);
            }
            if (memcmp(y1, y2, sizeof(y1)) != 0) return 0;
        }
    return 1;
}

static int colibri_amx_selfcheck(void)
{
#if COLIBRI_AMX
    return colibri_amx_compare_bodies(COLIBRI_ISA_AMX, COLIBRI_ISA_AMX_EMU, 0);
#else
    return 0;
#endif
}

/* The self-check's failure path, drilled where there is no AMX: the emulation against
 * itself (corrupt: with one output bit flipped) through colibri_amx_verdict, as the real
 * check goes: a mismatch disables amx for the process with its one warning line. 1: the
 * same bits. A test hook (_kernels._amx_selfcheck_drill); it needs the avx512vnni path. */
static int colibri_amx_selfcheck_drill(int corrupt)
{
    return colibri_amx_verdict(
        colibri_amx_compare_bodies(COLIBRI_ISA_AMX_EMU, COLIBRI_ISA_AMX_EMU, corrupt));
}
