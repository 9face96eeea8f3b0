/* csrc/types.h: what every kernel body shares (see _simd.h for the whole C layer).
 *
 * The path and format codes, the kernel signatures (colibri_dot_fn, colibri_idot_fn), the
 * byte loaders and f16/bf16 decoding, the row layout of the weight formats, the packed layout
 * of quantized activation rows with its scalar quantizer, SiLU, and the counter-based RNG of
 * the Gumbel routing noise.
 */
#ifndef COLIBRI_TYPES_H
#define COLIBRI_TYPES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && \
    __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "colibri reads little-endian weight files with plain loads: big-endian hosts unsupported"
#endif

/* COLIBRI_NO_SIMD: build the scalar path only (compilers without target attributes). */
#if !defined(COLIBRI_NO_SIMD) && (defined(__x86_64__) || defined(__i386__)) && \
    (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define COLIBRI_X86 0
#endif

/* The VNNI bodies (vnni.h) need a compiler that knows the avxvnni target and its intrinsics
 * (GCC 11, clang 12); with an older one their paths are not compiled in and never
 * supported (the other paths are unchanged). */
#if COLIBRI_X86 && !defined(COLIBRI_NO_VNNI) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define COLIBRI_VNNI 1
#else
#define COLIBRI_VNNI 0
#endif

/* The AMX bodies (csrc/amx*.h, igemm_amx.h, gemm_amx.h) need a compiler that knows the
 * amx-tile / amx-int8 / amx-bf16 targets and intrinsics (GCC 11, clang 12) and x86-64 (the
 * intrinsics are 64-bit only); without it the amx path is never supported and amx-emu (the
 * same bodies over the emulated tiles) still is. */
#if COLIBRI_VNNI && defined(__x86_64__) && !defined(COLIBRI_NO_AMX)
#define COLIBRI_AMX 1
#else
#define COLIBRI_AMX 0
#endif

/* The paths, in order of preference (colibri_isa_best takes the highest this CPU runs).
 * avxvnni: the avx2 path with the VEX AVX-VNNI integer row kernels; avx512vnni: the avx512
 * path with the EVEX AVX-512 VNNI ones (csrc/vnni.h). Every kernel but those takes the body
 * of the path's base (colibri_isa_base). amx: avx512vnni with the AMX tile bodies of the
 * integer GEMM and of the bf16-activation GEMM (csrc/igemm_amx.h, gemm_amx.h); amx-emu: the
 * same bodies over the plain-C tile emulation (csrc/amx_tiles.h), never chosen by itself. */
enum { COLIBRI_ISA_SCALAR = 0, COLIBRI_ISA_AVX2 = 1, COLIBRI_ISA_AVX512 = 2,
       COLIBRI_ISA_AVXVNNI = 3, COLIBRI_ISA_AVX512VNNI = 4, COLIBRI_ISA_AMX_EMU = 5,
       COLIBRI_ISA_AMX = 6, COLIBRI_N_ISA = 7 };

/* The path whose bodies a path runs for the kernels it has none of its own for (the root:
 * the AMX paths run avx512's, through avx512vnni's integer row kernels). */
static inline int colibri_isa_base(int isa)
{
    if (isa == COLIBRI_ISA_AVXVNNI) return COLIBRI_ISA_AVX2;
    if (isa == COLIBRI_ISA_AVX512VNNI) return COLIBRI_ISA_AVX512;
    if (isa == COLIBRI_ISA_AMX_EMU || isa == COLIBRI_ISA_AMX) return COLIBRI_ISA_AVX512;
    return isa;
}

/* The path whose integer-activation bodies (row kernels; the integer GEMM below the AMX
 * crossover) a path runs: the AMX paths run avx512vnni's. */
static inline int colibri_isa_int_base(int isa)
{
    return isa == COLIBRI_ISA_AMX_EMU || isa == COLIBRI_ISA_AMX ? COLIBRI_ISA_AVX512VNNI : isa;
}
/* Same codes as the file's dtype field (docs/format.md §3) and colibri/dtypes.py (the extension
 * checks them at import). */
enum { COLIBRI_F32 = 0, COLIBRI_F16 = 1, COLIBRI_BF16 = 2, COLIBRI_Q8 = 3, COLIBRI_Q4 = 4,
       COLIBRI_MXFP4 = 6, COLIBRI_N_FMT = 7 };      /* 5 is i32: stored, never multiplied */

#define COLIBRI_MAX_NT 4   /* tokens per weight-row pass (the kernels accept 1..4) */

/* Tokens per pass the callers use: 4 for plain formats; 3 for q8/q4, whose 4-token body
 * needs more than the 16 AVX2 registers (two accumulators per token, the token partials, the
 * decoded codes) and spills: measured 24 vs 19 GMAC/s on a 1024 x 1024 q4 matrix in L2. */
static inline int colibri_block_tokens(int fmt)
{
    return fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4 ? 3 : COLIBRI_MAX_NT;
}

typedef void (*colibri_dot_fn)(const uint8_t *row0, ptrdiff_t row_stride, ptrdiff_t nrows,
                               ptrdiff_t cols, ptrdiff_t group,
                               const float *x, ptrdiff_t x_stride,
                               const float *xsum, ptrdiff_t xsum_stride,
                               int nt, float *out, ptrdiff_t out_stride);

/* The int8-activation row kernel, over nrows consecutive q8/q4 weight rows (row i at row0 +
 * i * row_stride) against nt token rows quantized by colibri_quantize_row: q (token t at q +
 * t * q_stride bytes; int8 codes, or int16 ones for the int16 kernels), d and s (at + t *
 * d_stride).
 *   out[t * out_stride + i] = sum over blocks b of (s_g(b) * d_b) * isum_b   (row i),
 *   isum_b = sum over the block of code * q, an exact int32 (code: int8, or nibble - 8).
 * Several rows per call: the per-call setup (format and group dispatch, constants) is paid
 * once per tile, not per row (about a quarter of the instructions of a 1024-column row). */
typedef void (*colibri_idot_fn)(const uint8_t *row0, ptrdiff_t row_stride, ptrdiff_t nrows,
                                ptrdiff_t cols, ptrdiff_t group, const int8_t *q,
                                ptrdiff_t q_stride, const float *d, const int32_t *s,
                                ptrdiff_t d_stride, int nt, float *out, ptrdiff_t out_stride);

/* Tokens per pass of the int8 bodies: 4. Callgrind, 1024 x 4096, 12 tokens: q4 0.133
 * instructions per multiply-add with 4 per pass, 0.139 with 3; q8 0.220 vs 0.226 (a token's
 * integer partial sums take about 3 AVX2 registers between block pairs; 4 tokens spill a
 * few, 3 decode each weight pair for fewer tokens). */
#define COLIBRI_INT8_NT 4

/* The int8 AVX2 bodies prefetch the weight bytes this far ahead of the chunk they decode
 * (into the next rows: a matrix's rows are contiguous), and each row's scales as far ahead
 * (see colibri_idot_avx2_body), into L2 (_MM_HINT_T1). They need it, the f32 bodies do not:
 * at ~0.2 instructions per multiply-add a q4 row is consumed faster than the hardware
 * prefetcher alone streams it. Measured, 16384 x 4096 q4, one token, one thread on a
 * shared machine (best of many): no prefetch 11 GB/s, 1 KiB ahead 15, 4 KiB 17-19, 8 KiB
 * 21, 16 KiB 18 (read bandwidth 21-29), all into L1 (_MM_HINT_T0). Into L2 instead, the
 * decode expert FFN (T = 1, random experts of every layer, from the mapped file; EPYC,
 * docs/performance.md change 13): olmoe-16L q4 1 thread 12.8 -> 16.9 GB/s, 2
 * threads 19.6 -> 24.5; mixtral-mini q4 13.9 -> 17.2, 19.1 -> 22.5 (the L2 has more misses
 * in flight than the L1); 4 or 16 KiB ahead no better; NTA as T0; T2 as T1 or a little
 * less. q8 (4 lines per chunk) then gained as well: mixtral-mini q8 17.0 -> 19.4 GB/s (1
 * thread), 18.6 -> 23.6 (2). A prefetch never faults, so it cannot bring in a page past the
 * matrix the way a load would. */
#define COLIBRI_PREFETCH_BYTES 8192

/* ------------------------------------------------------------------------------------------
 * Scalar element access (memcpy: rows are not aligned for their element type).
 */

static inline float colibri_ld_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }
static inline uint16_t colibri_ld_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float colibri_bits_to_f32(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

/* IEEE half -> float, exact for every input (subnormals, inf, NaN payloads), with integer
 * operations only, so it does not depend on the FPU's denormal modes. */
static inline float colibri_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {                       /* inf / NaN: keep the payload */
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {                    /* normal: rebias 15 -> 127 */
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {                   /* +-0 */
        bits = sign;
    } else {                                  /* subnormal: mant * 2^-24, normalise */
        uint32_t e = 113u;
        while (!(mant & 0x400u)) { mant <<= 1; e--; }
        bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
    }
    return colibri_bits_to_f32(bits);
}

/* bf16 is the upper half of an f32. */
static inline float colibri_bf16_to_f32(uint16_t b)
{
    return colibri_bits_to_f32((uint32_t)b << 16);
}

/* Element c of a row of plain format fmt, as float. */
static inline float colibri_plain_elem(int fmt, const uint8_t *row, ptrdiff_t c)
{
    if (fmt == COLIBRI_F32) return colibri_ld_f32(row + 4 * c);
    if (fmt == COLIBRI_F16) return colibri_f16_to_f32(colibri_ld_u16(row + 2 * c));
    return colibri_bf16_to_f32(colibri_ld_u16(row + 2 * c));
}

/* MXFP4 (csrc/mxfp4.h): nibble of element c (byte c / 2, low nibble first), the FP4 E2M1
 * value of a nibble (bit 3 the sign), and an E8M0 scale byte as 2^(s - 127) (s = 255, NaN in
 * the OCP spec, is refused by the converter; 0 is 2^-127, a subnormal). */
static inline int colibri_mxfp4_nibble(const uint8_t *row, ptrdiff_t c)
{
    return (row[c >> 1] >> (4 * (c & 1))) & 0x0F;
}

static inline float colibri_fp4_value(int nibble)
{
    static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    return nibble & 8 ? -mag[nibble & 7] : mag[nibble & 7];
}

static inline float colibri_e8m0_to_f32(uint8_t s)
{
    uint32_t bits = s ? (uint32_t)s << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Nibble of q4 element c (0..15), from the Q4_0 block order. */
static inline int colibri_q4_nibble(const uint8_t *row, ptrdiff_t c)
{
    ptrdiff_t j = c >> 5, i = c & 31;
    uint8_t b = row[16 * j + (i & 15)];
    return i < 16 ? (b & 0x0F) : (b >> 4);
}

/* Bytes of one row's payload (without padding to row_stride). */
static inline ptrdiff_t colibri_row_bytes(int fmt, ptrdiff_t cols, ptrdiff_t group)
{
    switch (fmt) {
    case COLIBRI_F32: return 4 * cols;
    case COLIBRI_F16: case COLIBRI_BF16: return 2 * cols;
    case COLIBRI_Q8: return cols + 2 * (cols / group);
    case COLIBRI_Q4: return cols / 2 + 2 * (cols / group);
    case COLIBRI_MXFP4: return cols / 2 + cols / 32;
    default: return 0;
    }
}

/* Decode one row to float (the dequantize kernel; a test and debugging helper). */
static inline void colibri_decode_row(int fmt, const uint8_t *row, ptrdiff_t cols,
                                      ptrdiff_t group, float *out)
{
    ptrdiff_t c;
    if (fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4) {
        const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
        for (c = 0; c < cols; c++) {
            float s = colibri_f16_to_f32(colibri_ld_u16(scales + 2 * (c / group)));
            float q = fmt == COLIBRI_Q8 ? (float)(int8_t)row[c]
                                        : (float)(colibri_q4_nibble(row, c) - 8);
            out[c] = q * s;
        }
    } else if (fmt == COLIBRI_MXFP4) {
        for (c = 0; c < cols; c++)
            out[c] = colibri_fp4_value(colibri_mxfp4_nibble(row, c))
                     * colibri_e8m0_to_f32(row[cols / 2 + c / 32]);
    } else {
        for (c = 0; c < cols; c++) out[c] = colibri_plain_elem(fmt, row, c);
    }
}

/* xsum[g] = sum of x over group g, for the q4 offset fold. Four interleaved partial sums
 * (elements c, c+1, c+2, c+3 of each step of 4), combined as (s0 + s1) + (s2 + s3): a fixed
 * order, so a token's sums do not depend on which call or thread computes them, and four
 * independent adds per cycle instead of one dependent chain. group is a multiple of 32. */
static inline void colibri_group_sums(const float *x, ptrdiff_t cols, ptrdiff_t group, float *xsum)
{
    ptrdiff_t g, c;
    for (g = 0; g < cols / group; g++) {
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (c = g * group; c < (g + 1) * group; c += 4) {
            s0 += x[c]; s1 += x[c + 1]; s2 += x[c + 2]; s3 += x[c + 3];
        }
        xsum[g] = (s0 + s1) + (s2 + s3);
    }
}

/* ------------------------------------------------------------------------------------------
 * Activations as int8 (the "int8" path, W4A8 / W8A8): llama.cpp's Q8_0 blocks of 32.
 * Per block b of 32 elements: amax = max |x|; d = amax / 127 (f32); id = d != 0 ? 1 / d : 0;
 * q = nearest-even round of x * id (f32 product), in [-127, 127]. A block holding a NaN or
 * an inf gets d = NaN and q = 0, so every output using it is NaN (never a quiet finite
 * number). A block whose 1 / d overflows (d < 2^-128: amax below ~3.7e-37, subnormal
 * territory) gets d = 0 and q = 0, as if it were zero: its true contribution is below
 * 1e-36 of the weight scale, and x * inf would give inf / NaN codes.
 * s_b = 8 * sum of the block's q (int32): the q4 kernels fold the nibble's -8 out of their
 * inner loop with it, sum_i (n_i - 8) q_i = sum_i n_i q_i - s_b, all exact integers.
 * One scalar body for every ISA (it is O(C) per token against O(R C) for the dot products,
 * and f32-exact operations make it bit-identical everywhere); the rounding adds and
 * subtracts 1.5 * 2^23, exact nearest-even for |v| < 2^22 without a libm call.
 *
 * The row kernels read a token row in a packed layout (colibri_quantize_act):
 *   q: blocks in pairs (2k, 2k+1), 64 bytes per pair: q_2k[0:16] q_2k+1[0:16] q_2k[16:32]
 *      q_2k+1[16:32]; the row is C rounded up to 64 bytes. A q4 pair's 32 code bytes then
 *      decode with one load: & 15 gives the first 32 bytes, >> 4 & 15 the second.
 *   d, s: per chunk of 8 blocks in the order 0 2 4 6 1 3 5 7 (colibri_dpos), the lane order
 *      in which the AVX2 reduction of 8 blocks' integer sums leaves them; the row is C/32
 *      rounded up to 8 entries, zero past the last block.
 * quantize_activations (the public function) returns the plain layout.
 */
static inline ptrdiff_t colibri_qpos(ptrdiff_t c)      /* packed position of element c */
{
    ptrdiff_t b = c >> 5, i = c & 31;
    return 64 * (b >> 1) + 32 * (i >> 4) + 16 * (b & 1) + (i & 15);
}

static inline ptrdiff_t colibri_dpos(ptrdiff_t b)      /* packed position of block b's d, s */
{
    return (b & ~(ptrdiff_t)7) | ((b & 1) << 2) | ((b >> 1) & 3);
}

/* The scale of one block for codes in [-qmax, qmax]: *d = amax / qmax, *id = 1 / d (0 for
 * d = 0). Returns 0 (codes = round(x * id)), 1 (a NaN or inf: d = NaN, codes 0) or 2 (1 / d
 * overflows: d = 0, codes 0). */
static inline int colibri_block_scale_scalar(const float *xb, float qmax, float *d, float *id)
{
    float amax = 0.0f;
    int bad = 0, i;
    for (i = 0; i < 32; i++) {
        float a = fabsf(xb[i]);
        bad |= !(a <= 3.402823466e+38f);         /* NaN or inf */
        amax = a > amax ? a : amax;
    }
    *d = amax / qmax;
    *id = *d != 0.0f ? 1.0f / *d : 0.0f;
    if (bad) { *d = NAN; return 1; }
    if (*id > 3.402823466e+38f) { *d = 0.0f; return 2; }
    return 0;
}

/* Nearest-even round of x * id as an int, exact for |x * id| < 2^22 (no libm call). */
static inline int colibri_round_code(float x, float id)
{
    const float magic = 12582912.0f;            /* 1.5 * 2^23 */
    return (int)((x * id + magic) - magic);
}

/* One block: q[0:16] to lo, q[16:32] to hi; returns d, sets *s. */
static inline float colibri_quantize_block_scalar(const float *xb, int8_t *lo, int8_t *hi,
                                                  int32_t *s)
{
    float d, id;
    int sum = 0, i;
    *s = 0;
    if (colibri_block_scale_scalar(xb, 127.0f, &d, &id)) {
        memset(lo, 0, 16);
        memset(hi, 0, 16);
        return d;
    }
    for (i = 0; i < 32; i++) {
        int qi = colibri_round_code(xb[i], id);
        (i < 16 ? lo : hi - 16)[i] = (int8_t)qi;
        sum += qi;
    }
    *s = 8 * sum;
    return d;
}

/* Activations as int16 (the "int16" path, W4A16 / W8A16 with 16-bit activation codes):
 * colibri_quantize_block_scalar's rule with 32767 for 127: d = amax / 32767, q = nearest-even
 * round of x * (1 / d) in [-32767, 32767], s = 8 * sum of q; the same NaN / inf and overflow
 * cases. Relative to the block's largest element a code is off by at most 2^-16, so the
 * products are within ~1e-5 of the f32 path's (f16 activations would be 2^-11).
 * Packed layout: blocks in pairs (2k, 2k+1), 64 codes (128 bytes) per pair, in runs of 8:
 *   b_2k[0:8] b_2k+1[0:8] b_2k[8:16] b_2k+1[8:16] ... b_2k[24:32] b_2k+1[24:32]
 * (colibri_qpos16), so that a pair of q4 code bytes widened to 16 bits in-lane (unpack with
 * zero) lines up with it: lane half 0 block 2k, half 1 block 2k+1, as in the int8 path. The
 * d and s rows are the int8 path's (colibri_dpos). */
static inline ptrdiff_t colibri_qpos16(ptrdiff_t c)    /* packed position of element c */
{
    ptrdiff_t b = c >> 5, i = c & 31;
    return 64 * (b >> 1) + 16 * (i >> 3) + 8 * (b & 1) + (i & 7);
}

/* One block to the packed pair at `base` (element i at base[16 * (i >> 3) + (i & 7)]; base =
 * the pair's start, + 8 for its second block); returns d, sets *s. */
static inline float colibri_quantize_block16_scalar(const float *xb, int16_t *base, int32_t *s)
{
    float d, id;
    int sum = 0, i;
    *s = 0;
    if (colibri_block_scale_scalar(xb, 32767.0f, &d, &id)) {
        for (i = 0; i < 4; i++) memset(base + 16 * i, 0, 16);
        return d;
    }
    for (i = 0; i < 32; i++) {
        int qi = colibri_round_code(xb[i], id);             /* |qi| <= 32767: |x| <= amax */
        base[16 * (i >> 3) + (i & 7)] = (int16_t)qi;
        sum += qi;
    }
    *s = 8 * sum;
    return d;
}

/* SiLU, written so that very negative inputs give -0 (exp overflows to inf), never NaN. */
static inline float colibri_silu(float g) { return g / (1.0f + expf(-g)); }

/* ------------------------------------------------------------------------------------------
 * Counter-based RNG for Gumbel routing noise: a pure function of (seed, token, expert), so
 * the noise does not depend on which thread handles a token, or on how many there are.
 * SplitMix64's finaliser as the mixing function; _reference.py holds the NumPy twin.
 */

#define COLIBRI_GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t colibri_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Gumbel(0, 1) for (seed, token t, expert e): u uniform in (0, 1) from 24 random bits,
 * g = -log(-log(u)), computed in double and rounded once to float. */
static inline float colibri_gumbel(uint64_t seed, uint64_t t, uint64_t e)
{
    uint64_t key = colibri_mix64(seed + COLIBRI_GOLDEN * (t + 1));
    uint64_t bits = colibri_mix64(key + COLIBRI_GOLDEN * (e + 1));
    double u = ((double)(bits >> 40) + 0.5) * (1.0 / 16777216.0);
    return (float)(-log(-log(u)));
}

#endif /* COLIBRI_TYPES_H */
