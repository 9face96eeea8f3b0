/* csrc/amx_tiles.h: the AMX tile operations the AMX kernels are written over, twice: the
 * instructions (path amx) and a plain-C emulation of their architectural definitions (path
 * amx-emu), so that every AMX kernel runs, and is tested, on any CPU that runs its base path.
 *
 * The operations (Intel SDM vol. 2, "LDTILECFG", "TILELOADD", "TILESTORED", "TILEZERO",
 * "TDPBSSD/TDPBSUD/TDPBUSD/TDPBUUD", "TDPBF16PS"; the emulation was cross-read with the AMX
 * instructions of the Bochs emulator, cpu/amx.cc, which reads the pseudocode the same way):
 *   config   LDTILECFG of a 64-byte palette-1 record (colibri_tilecfg): per tile rows <= 16
 *            and colsb <= 64 bytes, both zero or both not; reserved bytes zero (#GP else);
 *            every tile is zeroed. Palette 0 releases the tiles (TILERELEASE).
 *   load     TILELOADD t, [base + r * stride]: rows r < rows(t) of colsb(t) bytes; the rest
 *            of each row and the rows past rows(t) read as zero.
 *   store    TILESTORED: rows r < rows(t), colsb(t) bytes each, to base + r * stride.
 *   zero     TILEZERO t.
 *   dot      C = m x n dwords (tsrcdest), A = m x k dwords (tsrc1), B = k x n dwords (tsrc2),
 *            with C.rows == A.rows, C.colsb == B.colsb, A.colsb / 4 == B.rows <= 16, the
 *            three tiles distinct (#UD else); for each row m, dword n, k in order:
 *              TDPB{S,U}{S,U}D: C[m][n] += a0 b0 + a1 b1 + a2 b2 + a3 b3, the 4 bytes of
 *                A[m][k] and B[k][n] sign- (S) or zero- (U) extended (first letter A, second
 *                B: TDPBUSD is u8 A x s8 B), the sum in 32-bit wraparound arithmetic;
 *              TDPBF16PS: per row m two f32 partials per n, e (even) and o (odd), from +0:
 *                e = fma(A[m].bf16[2k], B[k].bf16[2n], e), o = fma(.. 2k+1 .., .. 2n+1 .., o)
 *                over k in order, then C[m][n] = C[m][n] + (e + o): every operation f32
 *                with round-to-nearest-even, denormal inputs as zero (DAZ), denormal results
 *                flushed to zero (FTZ), MXCSR ignored. (The Intrinsics Guide's shorter
 *                pseudocode, which adds each product into C directly, is not the SDM's.)
 *            Bytes of a C row past colsb and rows past C.rows are zeroed.
 * FTZ here follows the x86 definition of underflow (SDM vol. 1, 4.9.1.5): a result is tiny
 * when, rounded with an unbounded exponent, it is below 2^-126 in magnitude; a tiny result
 * becomes a zero of its sign (colibri_temu_fma).
 *
 * A body uses them as COLIBRI_TILE(P, OP)(...) with P = AMX or EMU and declares the state
 * with COLIBRI_TILE_STATE(P) (the emulation's 8 tiles live on the body's stack; the real
 * tiles are the thread's). Tile numbers must be literals (the instructions encode them).
 */
#ifndef COLIBRI_AMX_TILES_H
#define COLIBRI_AMX_TILES_H

#include "types.h"

/* The 64-byte operand of LDTILECFG, palette 1: byte 0 the palette, 1 start_row, 16..31 colsb
 * of tiles 0..7 (u16), 48..55 their rows; every other byte reserved (zero). */
typedef struct {
    uint8_t palette, start_row, reserved0[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} colibri_tilecfg;
typedef char colibri_tilecfg_is_64_bytes[sizeof(colibri_tilecfg) == 64 ? 1 : -1];

/* AMX tiles (csrc/amx.h): the configuration the running thread has loaded (0: none, or
 * released), and how to release it. A kernel that configures tiles sets the first; the pool
 * releases them (TILERELEASE) when the thread has run its items of a job, so no thread keeps
 * tile state between jobs. */
#if defined(__GNUC__) || defined(__clang__)
static __thread int colibri_tls_tiles = 0;
#else
static int colibri_tls_tiles = 0;
#endif
static void (*colibri_tiles_release)(void) = 0;

#define COLIBRI_TILE_NAMES 8        /* palette 1: 8 tiles of 16 rows x 64 bytes */
#define COLIBRI_TILE_MAX_ROWS 16
#define COLIBRI_TILE_MAX_COLSB 64

/* ------------------------------------------------------------------------------------------
 * The emulation: the architectural state and one function per instruction. A function that
 * meets a case the hardware faults on records the first such fault (e->fault: which
 * instruction and why) and leaves the state as it was; the kernels never reach one (their
 * shapes are fixed), the tests of the layer provoke each.
 */
typedef struct {
    uint8_t t[COLIBRI_TILE_NAMES][COLIBRI_TILE_MAX_ROWS][COLIBRI_TILE_MAX_COLSB];
    colibri_tilecfg cfg;
    int configured;               /* a palette-1 configuration is loaded */
    const char *fault;            /* the first fault, or NULL */
} colibri_temu;

static inline void colibri_temu_fault(colibri_temu *e, const char *why)
{
    if (!e->fault) e->fault = why;
}

static void colibri_temu_release(colibri_temu *e)
{
    memset(e->t, 0, sizeof(e->t));
    memset(&e->cfg, 0, sizeof(e->cfg));
    e->configured = 0;
}

static void colibri_temu_init(colibri_temu *e)
{
    colibri_temu_release(e);
    e->fault = NULL;
}

/* LDTILECFG. */
static void colibri_temu_config(colibri_temu *e, const colibri_tilecfg *cfg)
{
    const uint8_t *b = (const uint8_t *)(const void *)cfg;
    int i;
    if (cfg->palette == 0) { colibri_temu_release(e); return; }
    if (cfg->palette != 1) { colibri_temu_fault(e, "ldtilecfg: palette > 1 (#GP)"); return; }
    for (i = 2; i < 64; i++)
        if (b[i] && !((i >= 16 && i < 32) || (i >= 48 && i < 56))) {
            colibri_temu_fault(e, "ldtilecfg: a reserved byte is not zero (#GP)");
            return;
        }
    for (i = 0; i < COLIBRI_TILE_NAMES; i++) {
        if (cfg->colsb[i] > COLIBRI_TILE_MAX_COLSB || cfg->rows[i] > COLIBRI_TILE_MAX_ROWS) {
            colibri_temu_fault(e, "ldtilecfg: rows > 16 or colsb > 64 (#GP)");
            return;
        }
        if ((cfg->colsb[i] == 0) != (cfg->rows[i] == 0)) {
            colibri_temu_fault(e, "ldtilecfg: a tile with rows or colsb zero but not both (#GP)");
            return;
        }
    }
    memset(e->t, 0, sizeof(e->t));
    e->cfg = *cfg;
    e->configured = 1;
}

/* 1 when tile t may be read or written (configured, rows > 0, colsb a multiple of 4). */
static int colibri_temu_valid(colibri_temu *e, int t, const char *why)
{
    if (!e->configured || t < 0 || t >= COLIBRI_TILE_NAMES || e->cfg.rows[t] == 0 ||
        (e->cfg.colsb[t] & 3)) {
        colibri_temu_fault(e, why);
        return 0;
    }
    if (e->cfg.start_row >= e->cfg.rows[t]) {
        colibri_temu_fault(e, "tile access: start_row >= rows (#UD)");
        return 0;
    }
    return 1;
}

/* TILELOADD t, [base + r * stride] (rows from start_row, which is then 0 again). */
static void colibri_temu_loadd(colibri_temu *e, int t, const void *base, ptrdiff_t stride)
{
    const int rows = e->cfg.rows[t], colsb = e->cfg.colsb[t];
    int r;
    if (!colibri_temu_valid(e, t, "tileloadd: tile not configured (#UD)")) return;
    for (r = e->cfg.start_row; r < COLIBRI_TILE_MAX_ROWS; r++) {
        memset(e->t[t][r], 0, COLIBRI_TILE_MAX_COLSB);
        if (r < rows) memcpy(e->t[t][r], (const uint8_t *)base + r * stride, (size_t)colsb);
    }
    e->cfg.start_row = 0;
}

/* TILESTORED [base + r * stride], t. */
static void colibri_temu_stored(colibri_temu *e, int t, void *base, ptrdiff_t stride)
{
    int r;
    if (!colibri_temu_valid(e, t, "tilestored: tile not configured (#UD)")) return;
    for (r = e->cfg.start_row; r < e->cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, e->t[t][r], e->cfg.colsb[t]);
    e->cfg.start_row = 0;
}

/* TILEZERO t. */
static void colibri_temu_zero(colibri_temu *e, int t)
{
    if (!e->configured || t < 0 || t >= COLIBRI_TILE_NAMES || e->cfg.rows[t] == 0) {
        colibri_temu_fault(e, "tilezero: tile not configured (#UD)");
        return;
    }
    memset(e->t[t], 0, sizeof(e->t[t]));
}

/* The shape checks every dot product makes; 1 when C, A, B may be multiplied. */
static int colibri_temu_shapes(colibri_temu *e, int c, int a, int b)
{
    if (c == a || c == b || a == b) {
        colibri_temu_fault(e, "tile dot product: the three tiles must differ (#UD)");
        return 0;
    }
    if (!colibri_temu_valid(e, c, "tile dot product: tile not configured (#UD)") ||
        !colibri_temu_valid(e, a, "tile dot product: tile not configured (#UD)") ||
        !colibri_temu_valid(e, b, "tile dot product: tile not configured (#UD)"))
        return 0;
    if (e->cfg.colsb[c] != e->cfg.colsb[b] || e->cfg.rows[c] != e->cfg.rows[a] ||
        e->cfg.colsb[a] / 4 != e->cfg.rows[b]) {
        colibri_temu_fault(e, "tile dot product: shapes do not match (#UD)");
        return 0;
    }
    return 1;
}

/* Zero the bytes of C past its rows and colsb (write_row_and_zero, zero_upper_rows). */
static void colibri_temu_zero_rest(colibri_temu *e, int c)
{
    int r;
    for (r = 0; r < COLIBRI_TILE_MAX_ROWS; r++)
        if (r >= e->cfg.rows[c]) memset(e->t[c][r], 0, COLIBRI_TILE_MAX_COLSB);
        else memset(e->t[c][r] + e->cfg.colsb[c], 0, COLIBRI_TILE_MAX_COLSB - e->cfg.colsb[c]);
}

/* TDPBSSD (sa = sb = 1), TDPBSUD (1, 0), TDPBUSD (0, 1), TDPBUUD (0, 0). */
static void colibri_temu_dpb(colibri_temu *e, int c, int a, int b, int sa, int sb)
{
    int m, k, n, i;
    if (!colibri_temu_shapes(e, c, a, b)) return;
    for (m = 0; m < e->cfg.rows[c]; m++)
        for (k = 0; k < e->cfg.rows[b]; k++)
            for (n = 0; n < e->cfg.colsb[c] / 4; n++) {
                uint32_t acc;
                memcpy(&acc, e->t[c][m] + 4 * n, 4);
                for (i = 0; i < 4; i++) {
                    const uint8_t x = e->t[a][m][4 * k + i], y = e->t[b][k][4 * n + i];
                    const int32_t xv = sa ? (int32_t)(int8_t)x : (int32_t)x;
                    const int32_t yv = sb ? (int32_t)(int8_t)y : (int32_t)y;
                    acc += (uint32_t)(xv * yv);           /* |xv * yv| <= 2^16: no overflow */
                }
                memcpy(e->t[c][m] + 4 * n, &acc, 4);
            }
    colibri_temu_zero_rest(e, c);
}

static inline uint32_t colibri_f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* DAZ: a denormal as a zero of its sign. */
static inline float colibri_temu_daz(float x)
{
    const uint32_t b = colibri_f32_bits(x);
    return (b & 0x7F800000u) == 0 ? colibri_bits_to_f32(b & 0x80000000u) : x;
}

/* fma(a, b, c) as the AMX FP32 FMA: DAZ on a, b, c; rounded to nearest even; a tiny result
 * (below 2^-126 when rounded with an unbounded exponent) flushed to a zero of its sign.
 * fmaf rounds once (gradual underflow): |r| < 2^-126 then means the exact value is below
 * 2^-126 - 2^-150, tiny either way; |r| == 2^-126 can come from an exact value just below
 * that rounds up on the subnormal grid but not on the unbounded one (tiny iff |exact| <
 * 2^-126 - 2^-151, the midpoint, whose tie goes to the even 2^-126), decided on the exact
 * value p + c (p = a b exact in double, TwoSum for the sum; s - 2^-126 + 2^-151 is exact by
 * Sterbenz). */
static float colibri_temu_fma(float a, float b, float c)
{
    float r;
    a = colibri_temu_daz(a);
    b = colibri_temu_daz(b);
    c = colibri_temu_daz(c);
    r = fmaf(a, b, c);
    if (fabsf(r) < 1.17549435e-38f)                                   /* below 2^-126 */
        return colibri_bits_to_f32(colibri_f32_bits(r) & 0x80000000u);
    if (fabsf(r) == 1.17549435e-38f) {
        const double p = (double)a * (double)b, cc = (double)c, s = p + cc;
        const double bp = s - p, err = (p - (s - bp)) + (cc - bp);    /* s + err = p + c */
        const double mid = 1.1754942807573643e-38;                    /* 2^-126 - 2^-151 */
        const double d = s > 0 ? (s - mid) + err : (-s - mid) - err;
        if (d < 0) return colibri_bits_to_f32(colibri_f32_bits(r) & 0x80000000u);
    }
    return r;
}

/* TDPBF16PS. */
static void colibri_temu_dpbf16ps(colibri_temu *e, int c, int a, int b)
{
    int m, k, n;
    if (!colibri_temu_shapes(e, c, a, b)) return;
    for (m = 0; m < e->cfg.rows[c]; m++) {
        float ev[16], od[16], cv;
        for (n = 0; n < 16; n++) ev[n] = od[n] = 0.0f;
        for (k = 0; k < e->cfg.rows[b]; k++)
            for (n = 0; n < e->cfg.colsb[c] / 4; n++) {
                const float a0 = colibri_bf16_to_f32(colibri_ld_u16(e->t[a][m] + 4 * k));
                const float a1 = colibri_bf16_to_f32(colibri_ld_u16(e->t[a][m] + 4 * k + 2));
                const float b0 = colibri_bf16_to_f32(colibri_ld_u16(e->t[b][k] + 4 * n));
                const float b1 = colibri_bf16_to_f32(colibri_ld_u16(e->t[b][k] + 4 * n + 2));
                ev[n] = colibri_temu_fma(a0, b0, ev[n]);
                od[n] = colibri_temu_fma(a1, b1, od[n]);
            }
        for (n = 0; n < e->cfg.colsb[c] / 4; n++) {
            memcpy(&cv, e->t[c][m] + 4 * n, 4);
            cv = colibri_temu_fma(cv, 1.0f, colibri_temu_fma(ev[n], 1.0f, od[n]));
            memcpy(e->t[c][m] + 4 * n, &cv, 4);
        }
    }
    colibri_temu_zero_rest(e, c);
}

/* ------------------------------------------------------------------------------------------
 * The operations by path. EMU: the functions above on the body's state; AMX: the
 * instructions (GCC's / clang's intrinsics; tileloadd's and ldtilecfg's asm tell the
 * compiler of no memory read beyond 8 bytes, so a compiler barrier orders the stores that
 * filled the operand before them, and the stores after them). The AMX forms need a function
 * compiled for amx-tile / amx-int8 / amx-bf16 (COLIBRI_AMX_FN, csrc/amx.h).
 */
#define COLIBRI_TILE(P, OP) COLIBRI_TILE_##OP##_##P
#define COLIBRI_TILE_STATE(P) COLIBRI_TILE_STATE_##P

#define COLIBRI_TILE_STATE_EMU colibri_temu tctx_[1]; colibri_temu *const tctx = tctx_; \
                               colibri_temu_init(tctx)
#define COLIBRI_TILE_CONFIG_EMU(cfg, id) colibri_temu_config(tctx, cfg)
#define COLIBRI_TILE_LOAD_EMU(t, p, stride) colibri_temu_loadd(tctx, t, p, stride)
#define COLIBRI_TILE_STORE_EMU(t, p, stride) colibri_temu_stored(tctx, t, p, stride)
#define COLIBRI_TILE_ZERO_EMU(t) colibri_temu_zero(tctx, t)
#define COLIBRI_TILE_DPBSSD_EMU(c, a, b) colibri_temu_dpb(tctx, c, a, b, 1, 1)
#define COLIBRI_TILE_DPBSUD_EMU(c, a, b) colibri_temu_dpb(tctx, c, a, b, 1, 0)
#define COLIBRI_TILE_DPBUSD_EMU(c, a, b) colibri_temu_dpb(tctx, c, a, b, 0, 1)
#define COLIBRI_TILE_DPBUUD_EMU(c, a, b) colibri_temu_dpb(tctx, c, a, b, 0, 0)
#define COLIBRI_TILE_DPBF16PS_EMU(c, a, b) colibri_temu_dpbf16ps(tctx, c, a, b)

#define COLIBRI_COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")
#define COLIBRI_TILE_STATE_AMX (void)0
#define COLIBRI_TILE_CONFIG_AMX(cfg, id) colibri_amx_config(cfg, id)
#define COLIBRI_TILE_LOAD_AMX(t, p, stride) \
    do { COLIBRI_COMPILER_BARRIER(); _tile_loadd(t, p, stride); COLIBRI_COMPILER_BARRIER(); } while (0)
#define COLIBRI_TILE_STORE_AMX(t, p, stride) _tile_stored(t, p, stride)   /* "memory" clobber */
#define COLIBRI_TILE_ZERO_AMX(t) _tile_zero(t)
#define COLIBRI_TILE_DPBSSD_AMX(c, a, b) _tile_dpbssd(c, a, b)
#define COLIBRI_TILE_DPBSUD_AMX(c, a, b) _tile_dpbsud(c, a, b)
#define COLIBRI_TILE_DPBUSD_AMX(c, a, b) _tile_dpbusd(c, a, b)
#define COLIBRI_TILE_DPBUUD_AMX(c, a, b) _tile_dpbuud(c, a, b)
#define COLIBRI_TILE_DPBF16PS_AMX(c, a, b) _tile_dpbf16ps(c, a, b)

/* The two configurations of the kernels (ids for colibri_amx_config's per-thread cache).
 * Integer GEMM (igemm_amx.h): C tiles 0-3 16 x 64 B (16 tokens x 16 rows of int32), A tiles
 * 4-5 16 x 32 B (16 tokens x one 32-code block), B tiles 6-7 8 x 64 B (one block's 8 steps
 * of 4 codes for 16 rows, VNNI order). bf16 GEMM (gemm_amx.h): C 0-3 16 x 64 B, A 4-5
 * 16 x 64 B (16 tokens x 32 bf16), B 6-7 16 x 64 B (16 pairs of columns x 16 rows). */
enum { COLIBRI_TILECFG_NONE = 0, COLIBRI_TILECFG_INT = 1, COLIBRI_TILECFG_BF16 = 2 };

static inline colibri_tilecfg colibri_tilecfg_of(int id)
{
    colibri_tilecfg c;
    int i;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (i = 0; i < 8; i++) {
        c.colsb[i] = i < 4 ? 64 : (i < 6 && id == COLIBRI_TILECFG_INT ? 32 : 64);
        c.rows[i] = i >= 6 && id == COLIBRI_TILECFG_INT ? 8 : 16;
    }
    return c;
}

#endif /* COLIBRI_AMX_TILES_H */
