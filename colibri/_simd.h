/* _simd.h -- the inner loops of colibri's kernels, one body per instruction set.
 *
 * Everything here is a static inline C helper with no Python in it; _kernels.pyx owns the
 * loops over tokens, rows and experts and calls in here for one weight row at a time (the
 * row kernel), or for one panel of rows against many tokens (the GEMM path, at the end).
 *
 * Three bodies of every row kernel:
 *   scalar  always compiled; the readable specification of each weight format and the
 *           fallback on non-x86 machines;
 *   avx2    AVX2 + FMA + F16C;
 *   avx512  AVX-512 F/BW/VL/DQ (+ the AVX2 set).
 * The module is compiled for the baseline of the architecture (no -march=native): the SIMD
 * bodies carry __attribute__((target(...))), so one build holds all three and the path is
 * chosen once at run time from the CPU (colibri_isa_supported, which also checks that the
 * OS saves the vector registers). On a non-x86 machine or a compiler without target
 * attributes only the scalar body exists.
 *
 * Weight formats (SPEC 1.5; a row is `cols` elements of one output, C = cols, G = group):
 *   f32, f16, bf16  C little-endian elements
 *   q8              C int8 q, then C/G f16 scales            w = q * s[g]
 *   q4              C/2 bytes, then C/G f16 scales           w = (nibble - 8) * s[g]
 *                   32-element blocks of 16 bytes: byte 16j+i holds element 32j+i in its low
 *                   nibble and 32j+16+i in its high nibble (llama.cpp Q4_0 order).
 *
 * The row kernel ("dot"): one weight row against nt <= COLIBRI_MAX_NT token vectors, so a
 * row loaded (and dequantized, in registers) once serves several tokens:
 *   out[t * out_stride] = sum_c w[c] * x[t * x_stride + c]          for t < nt
 * (Its entry points take a tile of nrows rows, row i at row0 + i * row_stride, out + i: the
 * dispatch and setup are paid once per tile; each row is still the same body, same bits.)
 * q4 also takes xsum[t * xsum_stride + g] = sum of x over group g: the SIMD bodies fold the
 * -8 offset out of the inner loop, sum_c (q_c - 8) s x_c = s (sum_c q_c x_c - 8 sum_c x_c).
 * Every body computes one (row, token) output with the same operations in the same order
 * whatever nt is: a token's result does not depend on how many tokens share the call.
 * No body reads a byte outside the row or outside x: tails are scalar or masked.
 *
 * The int8 row kernel ("idot", activations="int8", q8/q4 rows only): the tokens arrive
 * quantized like llama.cpp's Q8_0 (colibri_quantize_block: per 32-block an f32 scale d and
 * 32 int8 q), and
 *   out[t] = sum over 32-blocks b of (s_g(b) * d_t,b) * isum_t,b,
 *   isum_t,b = sum over the block of code * q_t  (an exact int32; code = int8, or nibble - 8)
 * The integer part is exact on every path; the float part's order is per path (scalar: block
 * order; AVX2: 8 lanes, then a horizontal sum) and, as above, never depends on nt. Token
 * rows are held in a packed layout (colibri_qpos / colibri_dpos) that lets the AVX2 body
 * decode two q4 blocks with one load and reduce 8 blocks without crossing 128-bit lanes.
 * The AVX-512 path runs the AVX2 int8 bodies (see colibri_idot_for).
 *
 * The int16 row kernel (activations="int16"): the same with 16-bit codes, d = amax / 32767
 * (colibri_quantize_block16): the same formula, the same exactness (the integer sums stay
 * below 2^31), its own packed layout (colibri_qpos16); the codes of a token row are
 * addressed in bytes by both kernels (q, q_stride), so the callers handle either width alike.
 */
#ifndef COLIBRI_SIMD_H
#define COLIBRI_SIMD_H

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

enum { COLIBRI_ISA_SCALAR = 0, COLIBRI_ISA_AVX2 = 1, COLIBRI_ISA_AVX512 = 2, COLIBRI_N_ISA = 3 };
/* Same codes as the file's dtype field (SPEC 1.3). */
enum { COLIBRI_F32 = 0, COLIBRI_F16 = 1, COLIBRI_BF16 = 2, COLIBRI_Q8 = 3, COLIBRI_Q4 = 4,
       COLIBRI_N_FMT = 5 };

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

/* ------------------------------------------------------------------------------------------
 * Scalar bodies: the specification. One f32 accumulator per token and group, in element
 * order; the scale multiplies each group's partial sum.
 */

static void colibri_dot_plain_scalar(int fmt, const uint8_t *row, ptrdiff_t cols,
                                     const float *x, ptrdiff_t xs, int nt,
                                     float *out, ptrdiff_t os)
{
    int t;
    ptrdiff_t c;
    for (t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float acc = 0.0f;
        for (c = 0; c < cols; c++) acc += colibri_plain_elem(fmt, row, c) * xt[c];
        out[t * os] = acc;
    }
}

/* The plain-format entry points: the body per row (group and the sums unused). */
#define COLIBRI_DEF_DOT_PLAIN_SCALAR(NAME, FMT)                                              \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,      \
                     ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                        \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)group; (void)xsum; (void)ss;                                                   \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_dot_plain_scalar(FMT, row0 + i * rs, cols, x, xs, nt, out + i, os);      \
    }

COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_f32_scalar, COLIBRI_F32)
COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_f16_scalar, COLIBRI_F16)
COLIBRI_DEF_DOT_PLAIN_SCALAR(colibri_dot_bf16_scalar, COLIBRI_BF16)

static void colibri_dot_quant_scalar(int fmt, const uint8_t *row, ptrdiff_t cols,
                                     ptrdiff_t group, const float *x, ptrdiff_t xs, int nt,
                                     float *out, ptrdiff_t os)
{
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    int t;
    ptrdiff_t g, c;
    for (t = 0; t < nt; t++) {
        const float *xt = x + t * xs;
        float acc = 0.0f;
        for (g = 0; g < cols / group; g++) {
            float part = 0.0f;
            for (c = g * group; c < (g + 1) * group; c++) {
                float q = fmt == COLIBRI_Q8 ? (float)(int8_t)row[c]
                                            : (float)(colibri_q4_nibble(row, c) - 8);
                part += q * xt[c];
            }
            acc += part * colibri_f16_to_f32(colibri_ld_u16(scales + 2 * g));
        }
        out[t * os] = acc;
    }
}

/* The quantized entry points (the scalar body subtracts the q4 offset per element: the
 * group sums are unused). */
#define COLIBRI_DEF_DOT_QUANT_SCALAR(NAME, FMT)                                              \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,      \
                     ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                        \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)xsum; (void)ss;                                                                \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_dot_quant_scalar(FMT, row0 + i * rs, cols, group, x, xs, nt, out + i,   \
                                     os);                                                    \
    }

COLIBRI_DEF_DOT_QUANT_SCALAR(colibri_dot_q8_scalar, COLIBRI_Q8)
COLIBRI_DEF_DOT_QUANT_SCALAR(colibri_dot_q4_scalar, COLIBRI_Q4)

/* int8 / int16 activations, the specification: per token, per 32-block, the exact integer dot
 * of the codes with q (int8 at colibri_qpos, or int16 at colibri_qpos16 when wide), then
 * acc += (s * d) * isum in block order (one f32 accumulator). */
static void colibri_idot_quant_scalar(int fmt, int wide, const uint8_t *row, ptrdiff_t cols,
                                      ptrdiff_t group, const int8_t *q, ptrdiff_t qs,
                                      const float *d, ptrdiff_t ds, int nt, float *out,
                                      ptrdiff_t os)
{
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    ptrdiff_t b, nb = cols / 32;
    int t, i;
    for (t = 0; t < nt; t++) {
        const int8_t *qt = q + t * qs;
        const int16_t *qt16 = (const int16_t *)(const void *)qt;
        float acc = 0.0f;
        for (b = 0; b < nb; b++) {
            int32_t isum = 0;
            for (i = 0; i < 32; i++) {
                ptrdiff_t c = 32 * b + i;
                int code = fmt == COLIBRI_Q8 ? (int)(int8_t)row[c]
                                             : colibri_q4_nibble(row, c) - 8;
                isum += code * (wide ? qt16[colibri_qpos16(c)] : qt[colibri_qpos(c)]);
            }
            float sg = colibri_f16_to_f32(colibri_ld_u16(scales + 2 * (32 * b / group)));
            acc += (sg * d[t * ds + colibri_dpos(b)]) * (float)isum;
        }
        out[t * os] = acc;
    }
}

/* The scalar entry points (the body subtracts the q4 offset per element: s is unused). */
#define COLIBRI_DEF_IDOT_SCALAR(NAME, FMT, WIDE)                                             \
    static void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,    \
                     ptrdiff_t group, const int8_t *q, ptrdiff_t qs, const float *d,        \
                     const int32_t *s, ptrdiff_t ds, int nt, float *out, ptrdiff_t os)      \
    {                                                                                        \
        ptrdiff_t i;                                                                         \
        (void)s;                                                                             \
        for (i = 0; i < nrows; i++)                                                          \
            colibri_idot_quant_scalar(FMT, WIDE, row0 + i * rs, cols, group, q, qs, d, ds,  \
                                      nt, out + i, os);                                      \
    }

COLIBRI_DEF_IDOT_SCALAR(colibri_idot_q8_scalar, COLIBRI_Q8, 0)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot_q4_scalar, COLIBRI_Q4, 0)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot16_q8_scalar, COLIBRI_Q8, 1)
COLIBRI_DEF_IDOT_SCALAR(colibri_idot16_q4_scalar, COLIBRI_Q4, 1)

/* Sum (mod 2^64) of a byte buffer as little-endian u64 words, plus the last n % 8 bytes
 * one by one: the memory-read bandwidth kernel. Every path computes the same number.
 * Four accumulators so the adds do not serialise. */
static uint64_t colibri_read_sum_scalar(const uint8_t *p, size_t n)
{
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, w0, w1, w2, w3;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        memcpy(&w0, p + i, 8); memcpy(&w1, p + i + 8, 8);
        memcpy(&w2, p + i + 16, 8); memcpy(&w3, p + i + 24, 8);
        a0 += w0; a1 += w1; a2 += w2; a3 += w3;
    }
    for (; i + 8 <= n; i += 8) { memcpy(&w0, p + i, 8); a0 += w0; }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3;
}

#if COLIBRI_X86
/* ------------------------------------------------------------------------------------------
 * AVX2 + FMA + F16C. 8 floats per vector. Per token two independent partial accumulators,
 * so consecutive FMAs do not wait on each other.
 */

#define COLIBRI_AVX2_FN static __attribute__((target("avx2,fma,f16c")))
#define COLIBRI_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

COLIBRI_AVX2_INLINE float colibri_hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (attention scores minus their maximum, SiLU's exp(-|g|)): Cephes' expf
 * reduction and polynomial (~1 ulp); 0 below -87.3 (where expf is subnormal or 0), NaN for
 * NaN. */
COLIBRI_AVX2_INLINE __m256 colibri_exp_neg_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.3365447505f);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 t, r, p;
    __m256i e;
    x = _mm256_max_ps(x, lo);
    t = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_fnmadd_ps(t, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(t, _mm256_set1_ps(-2.12194440e-4f), r);
    p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(t), _mm256_set1_epi32(127)), 23);
    p = _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    return _mm256_or_ps(p, nan);
}

/* silu(g) * u on 8 lanes: g * (g >= 0 ? 1 : e) / (1 + e) with e = exp(-|g|), which never
 * overflows; very negative g gives -0 as the scalar formula does, NaN stays NaN. */
COLIBRI_AVX2_INLINE __m256 colibri_silu_mul8_avx2(__m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 e = colibri_exp_neg_avx2(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
    const __m256 num = _mm256_blendv_ps(one, e, neg);
    return _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(g, num), _mm256_add_ps(one, e)), u);
}

/* h[i] = silu(h[i]) * u[i] for i < n; the last n % 8 through the same 8-lane code (a
 * padded copy), so an element's bits do not depend on where a call's range starts. */
COLIBRI_AVX2_FN void colibri_silu_mul_avx2(float *h, const float *u, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(h + i, colibri_silu_mul8_avx2(_mm256_loadu_ps(h + i),
                                                       _mm256_loadu_ps(u + i)));
    if (i < n) {
        float a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        memcpy(a, h + i, (size_t)(n - i) * 4);
        memcpy(b, u + i, (size_t)(n - i) * 4);
        _mm256_storeu_ps(a, colibri_silu_mul8_avx2(_mm256_loadu_ps(a), _mm256_loadu_ps(b)));
        memcpy(h + i, a, (size_t)(n - i) * 4);
    }
}

/* 8 consecutive elements of a plain-format row, widened to f32. */
COLIBRI_AVX2_INLINE __m256 colibri_load8_avx2(int fmt, const uint8_t *row, ptrdiff_t c)
{
    if (fmt == COLIBRI_F32) return _mm256_loadu_ps((const float *)(row + 4 * c));
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * c));
    if (fmt == COLIBRI_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX2_INLINE float colibri_elem_avx2(int fmt, const uint8_t *row, ptrdiff_t c)
{
    if (fmt == COLIBRI_F16) return _cvtsh_ss(colibri_ld_u16(row + 2 * c));
    return colibri_plain_elem(fmt, row, c);
}

/* NT and fmt are compile-time constants after inlining: one unrolled body per pair. */
COLIBRI_AVX2_INLINE void colibri_dot_plain_avx2_body(const int fmt, const uint8_t *row,
                                                     ptrdiff_t cols, const float *x,
                                                     ptrdiff_t xs, float *out, ptrdiff_t os,
                                                     const int NT)
{
    __m256 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT];
    float r[COLIBRI_MAX_NT];
    int t;
    ptrdiff_t c = 0;
    for (t = 0; t < NT; t++) { a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); }
    for (; c + 16 <= cols; c += 16) {
        __m256 w0 = colibri_load8_avx2(fmt, row, c), w1 = colibri_load8_avx2(fmt, row, c + 8);
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + c;
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), a0[t]);
            a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), a1[t]);
        }
    }
    if (c + 8 <= cols) {
        __m256 w0 = colibri_load8_avx2(fmt, row, c);
        for (t = 0; t < NT; t++)
            a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * xs + c), a0[t]);
        c += 8;
    }
    for (t = 0; t < NT; t++) r[t] = colibri_hsum256(_mm256_add_ps(a0[t], a1[t]));
    for (; c < cols; c++) {                      /* < 8 leftover columns */
        float w = colibri_elem_avx2(fmt, row, c);
        for (t = 0; t < NT; t++) r[t] += w * x[t * xs + c];
    }
    for (t = 0; t < NT; t++) out[t * os] = r[t];
}

/* Quantized rows (q8, q4). The order of operations for one (row, token) output is fixed,
 * whatever nt is, so a token gets the same bits alone or in a block of tokens:
 *   each 32-element block of group g: its codes as four 8-lane f32 vectors w0..w3 (q4
 *   without the -8), x0..x3 the matching x;
 *     t0 = w0*x0 for the group's first block, else fma(w0, x0, t0); t1 likewise (w1, x1);
 *     t0 = fma(w2, x2, t0); t1 = fma(w3, x3, t1)
 *   a[g % 2] = fma(t0 + t1, s_g, a[g % 2])          (two chains: consecutive groups alternate)
 *   out = hsum(a0 + a1)                                                       q8
 *   out = hsum(a0 + a1) - 8 hsum(o), o = sum over chunks of 8 groups of s * xsum      q4
 * The f16 scales of 8 groups are widened by one vcvtph2ps. q4 block: two 8-byte loads
 * zero-extended to 32-bit lanes; & 15 gives elements 0..7 and 8..15, >> 4 gives 16..23 and
 * 24..31 (the Q4_0 order): no shuffles.
 */
COLIBRI_AVX2_INLINE void colibri_codes32_avx2(const int fmt, const uint8_t *q, __m256 w[4])
{
    if (fmt == COLIBRI_Q4) {
        const __m256i m = _mm256_set1_epi32(15);
        __m256i l0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
        __m256i l1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
        w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(l0, m));
        w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(l1, m));
        w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(l0, 4));
        w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(l1, 4));
    } else {
        int j;
        for (j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(q + 8 * j))));
    }
}

/* tsum[t] = t0 + t1 of one group for NT tokens; qg: the group's codes, xg: x at its first
 * column (token t at xg + t * xs). */
COLIBRI_AVX2_INLINE void colibri_group_avx2(const int fmt, const uint8_t *qg, ptrdiff_t group,
                                            const float *xg, ptrdiff_t xs, __m256 *tsum,
                                            const int NT, const int G32)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;          /* bytes per 32 codes */
    __m256 t0[COLIBRI_MAX_NT], t1[COLIBRI_MAX_NT], w[4];
    ptrdiff_t b;
    int t;
    colibri_codes32_avx2(fmt, qg, w);
    for (t = 0; t < NT; t++) {
        const float *xt = xg + t * xs;
        t0[t] = _mm256_mul_ps(w[0], _mm256_loadu_ps(xt));
        t1[t] = _mm256_mul_ps(w[1], _mm256_loadu_ps(xt + 8));
        t0[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), t0[t]);
        t1[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), t1[t]);
    }
    for (b = 32; !G32 && b < group; b += 32) {
        colibri_codes32_avx2(fmt, qg + b / 32 * bpb, w);
        for (t = 0; t < NT; t++) {
            const float *xt = xg + t * xs + b;
            t0[t] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xt), t0[t]);
            t1[t] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xt + 8), t1[t]);
            t0[t] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xt + 16), t0[t]);
            t1[t] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xt + 24), t1[t]);
        }
    }
    for (t = 0; t < NT; t++) tsum[t] = _mm256_add_ps(t0[t], t1[t]);
}

COLIBRI_AVX2_INLINE void colibri_dot_quant_avx2_body(const int fmt, const uint8_t *row,
                                                     ptrdiff_t cols, ptrdiff_t group,
                                                     const float *x, ptrdiff_t xs,
                                                     const float *xsum, ptrdiff_t ss,
                                                     float *out, ptrdiff_t os, const int NT,
                                                     const int G32)
{
    const ptrdiff_t ng = cols / group, qpg = fmt == COLIBRI_Q4 ? group / 2 : group;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2), *q = row;
    const float *xp = x;
    __m256 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT], o[COLIBRI_MAX_NT], ts[COLIBRI_MAX_NT];
    float sb[8];
    ptrdiff_t g0, g;
    int t;
    for (t = 0; t < NT; t++) {
        a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); o[t] = _mm256_setzero_ps();
    }
    for (g0 = 0; g0 < ng; g0 += 8) {
        const ptrdiff_t n8 = ng - g0 < 8 ? ng - g0 : 8;
        __m256 sc;
        if (n8 == 8) {
            sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 2 * g0)));
        } else {                                 /* last chunk: zero-padded copy */
            uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            memcpy(h, scales + 2 * g0, (size_t)(2 * n8));
            sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        }
        _mm256_storeu_ps(sb, sc);
        if (fmt == COLIBRI_Q4) {
            for (t = 0; t < NT; t++) {
                const float *st = xsum + t * ss + g0;
                __m256 xv;
                if (n8 == 8) {
                    xv = _mm256_loadu_ps(st);
                } else {
                    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    memcpy(f, st, (size_t)(4 * n8));
                    xv = _mm256_loadu_ps(f);
                }
                o[t] = _mm256_fmadd_ps(sc, xv, o[t]);
            }
        }
        for (g = 0; g + 1 < n8; g += 2) {        /* g0 is even: local parity = global */
            __m256 sa = _mm256_broadcast_ss(sb + g), sn = _mm256_broadcast_ss(sb + g + 1);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm256_fmadd_ps(ts[t], sa, a0[t]);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a1[t] = _mm256_fmadd_ps(ts[t], sn, a1[t]);
        }
        if (g < n8) {                            /* an odd count: the last group is even */
            __m256 sa = _mm256_broadcast_ss(sb + g);
            colibri_group_avx2(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm256_fmadd_ps(ts[t], sa, a0[t]);
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum256(_mm256_add_ps(a0[t], a1[t]));
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * colibri_hsum256(o[t]) : r;
    }
}

/* One entry point per (format, path); the switch picks the body unrolled for nt tokens. */
#define COLIBRI_PLAIN_ROWS(BODY, FMT, NT)                                                   \
    for (i = 0; i < nrows; i++) BODY(FMT, row0 + i * rs, cols, x, xs, out + i, os, NT);

#define COLIBRI_DEF_PLAIN(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,       \
                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                          \
    {                                                                                       \
        ptrdiff_t i;                                                                        \
        (void)group; (void)xsum; (void)ss;                                                  \
        switch (nt) {                                                                       \
        case 1: COLIBRI_PLAIN_ROWS(BODY, FMT, 1) break;                                     \
        case 2: COLIBRI_PLAIN_ROWS(BODY, FMT, 2) break;                                     \
        case 3: COLIBRI_PLAIN_ROWS(BODY, FMT, 3) break;                                     \
        default: COLIBRI_PLAIN_ROWS(BODY, FMT, 4) break;                                    \
        }                                                                                   \
    }

/* Quantized entry points: one body per nt, and per group == 32 (the default group: one
 * 32-element block per scale, straight-line) or any multiple of 32. */
#define COLIBRI_QUANT_ROWS(BODY, FMT, NT, G32)                                              \
    for (i = 0; i < nrows; i++)                                                             \
        BODY(FMT, row0 + i * rs, cols, group, x, xs, xsum, ss, out + i, os, NT, G32);

#define COLIBRI_QUANT_CASES(BODY, FMT, G32)                                                  \
    switch (nt) {                                                                           \
    case 1: COLIBRI_QUANT_ROWS(BODY, FMT, 1, G32) break;                                    \
    case 2: COLIBRI_QUANT_ROWS(BODY, FMT, 2, G32) break;                                    \
    case 3: COLIBRI_QUANT_ROWS(BODY, FMT, 3, G32) break;                                    \
    default: COLIBRI_QUANT_ROWS(BODY, FMT, 4, G32) break;                                   \
    }

#define COLIBRI_DEF_QUANT(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t nrows, ptrdiff_t cols,     \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, const float *xsum,       \
                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)                          \
    {                                                                                       \
        ptrdiff_t i;                                                                        \
        if (group == 32) {                                                                  \
            COLIBRI_QUANT_CASES(BODY, FMT, 1)                                               \
        } else {                                                                            \
            COLIBRI_QUANT_CASES(BODY, FMT, 0)                                               \
        }                                                                                   \
    }

COLIBRI_DEF_PLAIN(colibri_dot_f32_avx2, COLIBRI_F32, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_PLAIN(colibri_dot_f16_avx2, COLIBRI_F16, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_PLAIN(colibri_dot_bf16_avx2, COLIBRI_BF16, COLIBRI_AVX2_FN,
                  colibri_dot_plain_avx2_body)
COLIBRI_DEF_QUANT(colibri_dot_q8_avx2, COLIBRI_Q8, COLIBRI_AVX2_FN,
                  colibri_dot_quant_avx2_body)
COLIBRI_DEF_QUANT(colibri_dot_q4_avx2, COLIBRI_Q4, COLIBRI_AVX2_FN,
                  colibri_dot_quant_avx2_body)

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

/* colibri_ichunk_avx2 on int16 codes (packed by colibri_qpos16): a pair's weight codes are
 * widened to 16 bits in-lane once (q4: the 32 code bytes unpacked with zero, then & 15 and
 * >> 4; q8: each byte unpacked with itself, then >> 8 arithmetic), giving four vectors
 * c0..c3 = elements 0-7, 8-15, 16-23, 24-31 of both blocks (lane half 0 block j, half 1
 * block j+1); per token, four vpmaddwd with the matching 16-code runs and three adds leave the
 * same 8 int32 partial sums per pair as the int8 body (|.| <= 32 * 128 * 32767 < 2^31). */
COLIBRI_AVX2_INLINE void colibri_ichunk16_avx2(const int fmt, const uint8_t *wq,
                                               const int8_t *q, ptrdiff_t qs, const int n,
                                               __m256i *isum, const int NT)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;            /* bytes per 32 codes */
    const __m256i m15 = _mm256_set1_epi16(15);
    __m256i h[2][COLIBRI_MAX_NT], v[2][COLIBRI_MAX_NT];
    int k, t;
    for (k = 0; k < 4; k++) {                                    /* pair k: blocks 2k, 2k+1 */
        __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0;
        if (2 * k < n) {
            const uint8_t *w = wq + 2 * k * bpb;
            const int two = 2 * k + 1 < n;
            if (fmt == COLIBRI_Q4) {
                const __m256i z = _mm256_setzero_si256();
                __m256i b = two ? _mm256_loadu_si256((const __m256i *)w)
                                : _mm256_inserti128_si256(z, _mm_loadu_si128((const __m128i *)w), 0);
                __m256i u0 = _mm256_unpacklo_epi8(b, z), u1 = _mm256_unpackhi_epi8(b, z);
                c0 = _mm256_and_si256(u0, m15);
                c1 = _mm256_and_si256(u1, m15);
                c2 = _mm256_srli_epi16(u0, 4);
                c3 = _mm256_srli_epi16(u1, 4);
            } else {
                __m256i lo, hi;
                colibri_ipair_avx2(fmt, w, two, &lo, &hi);
                c0 = _mm256_srai_epi16(_mm256_unpacklo_epi8(lo, lo), 8);
                c1 = _mm256_srai_epi16(_mm256_unpackhi_epi8(lo, lo), 8);
                c2 = _mm256_srai_epi16(_mm256_unpacklo_epi8(hi, hi), 8);
                c3 = _mm256_srai_epi16(_mm256_unpackhi_epi8(hi, hi), 8);
            }
        }
        for (t = 0; t < NT; t++) {
            const __m256i *qt = (const __m256i *)(const void *)(q + t * qs + 128 * k);
            __m256i p = _mm256_setzero_si256();
            if (2 * k < n)
                p = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_loadu_si256(qt)),
                                     _mm256_madd_epi16(c1, _mm256_loadu_si256(qt + 1))),
                    _mm256_add_epi32(_mm256_madd_epi16(c2, _mm256_loadu_si256(qt + 2)),
                                     _mm256_madd_epi16(c3, _mm256_loadu_si256(qt + 3))));
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
                                                 __m256i *isum, const int NT)
{
    if (WIDE)
        colibri_ichunk16_avx2(fmt, wq, q, qs, n, isum, NT);
    else
        colibri_ichunk_avx2(fmt, wq, q, qs, n, ones, isum, NT);
}

COLIBRI_AVX2_INLINE void colibri_idot_avx2_body(const int fmt, const uint8_t *row,
                                                ptrdiff_t cols, ptrdiff_t group,
                                                const int8_t *q, ptrdiff_t qs, const float *d,
                                                const int32_t *s, ptrdiff_t ds, float *out,
                                                ptrdiff_t os, const int NT, const int MODE,
                                                const int WIDE)
{
    const ptrdiff_t qpb = WIDE ? 64 : 32;                  /* code bytes per 32-block */
    const ptrdiff_t nb = cols / 32, bpb = fmt == COLIBRI_Q4 ? 16 : 32;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    const ptrdiff_t bpg = group / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);      /* lane -> block */
    int lg = 0, t;
    ptrdiff_t b0;
    __m256 acc[COLIBRI_MAX_NT];
    __m256i isum[COLIBRI_MAX_NT];
    while (((ptrdiff_t)1 << lg) < bpg) lg++;
    if (MODE == 1) idx = _mm256_srlv_epi32(idx, _mm256_set1_epi32(lg));
    for (t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (b0 = 0; MODE != 3 && b0 + 8 <= nb; b0 += 8) {
        const __m256 sv = colibri_iscales_avx2(scales, b0, MODE, lg, idx);
        {                                       /* the chunk's 2 (q4) or 4 (q8) lines, ahead */
            const char *pf = (const char *)(row + b0 * bpb) + COLIBRI_PREFETCH_BYTES;
            _mm_prefetch(pf, _MM_HINT_T1);
            _mm_prefetch(pf + 64, _MM_HINT_T1);
            if (fmt == COLIBRI_Q8) {
                _mm_prefetch(pf + 128, _MM_HINT_T1);
                _mm_prefetch(pf + 192, _MM_HINT_T1);
            }
        }
        colibri_ichunk_any_avx2(fmt, WIDE, row + b0 * bpb, q + qpb * b0, qs, 8, ones, isum, NT);
        colibri_iacc_avx2(fmt, isum, sv, d, s, ds, b0, acc, NT);
    }
    if (MODE != 3) {
        /* The chunk prefetches above request the code bytes of the whole chunks only; the
         * rest of the row ahead (codes of a partial last chunk, and the scales: every 64
         * bytes and the row's last byte) is requested here, after the codes, so that every
         * line of the rows ahead is. With 1024 columns the scales are 1 line in 9 (512 +
         * 64 bytes); left to a demand miss per row (the hardware prefetcher restarts at
         * every 4 KiB page, and the mmap'd file has no huge pages) they cost about a
         * quarter of the rate. Measured on the mixtral-mini q4 file, 1 thread, best of 6,
         * before/after interleaved: 3584 x 1024 gate matrices 10 -> 13 GB/s, 1024 x 3584
         * down 11 -> 13, the decode expert FFN (T=1, K=2) 11.2-11.7 -> 12.6-12.8, the
         * 32000 x 1024 head from a cold cache 10-11 -> 12-14. Issuing these before the
         * chunk loop (ahead of the row's codes) measured no better than none on the down
         * rows. (Those figures are for L1 prefetches; see COLIBRI_PREFETCH_BYTES for L2.) */
        const char *p0 = (const char *)(row + (nb & ~(ptrdiff_t)7) * bpb) + COLIBRI_PREFETCH_BYTES;
        const char *p1 = (const char *)(scales + 2 * (cols / group)) + COLIBRI_PREFETCH_BYTES;
        for (; p0 < p1; p0 += 64) _mm_prefetch(p0, _MM_HINT_T1);
        _mm_prefetch(p1 - 1, _MM_HINT_T1);
    }
    for (; b0 < nb; b0 += 8) {                        /* the rest: the last 1..7 blocks, or all */
        const int n = nb - b0 < 8 ? (int)(nb - b0) : 8;
        const ptrdiff_t ng = cols / group;
        const __m256 sv = MODE == 2 ? colibri_iscales_avx2(scales, b0, MODE, lg, idx)
                        : MODE != 3 && ng >= 8 ? colibri_iscales_tail_avx2(scales, b0, ng, lg)
                        : colibri_iscales_any_avx2(scales, b0, n, group);
        colibri_ichunk_any_avx2(fmt, WIDE, row + b0 * bpb, q + qpb * b0, qs, n, ones, isum, NT);
        colibri_iacc_avx2(fmt, isum, sv, d, s, ds, b0, acc, NT);
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum256(acc[t]);
}

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

COLIBRI_AVX2_FN uint64_t colibri_read_sum_avx2(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    uint64_t lanes[4], total;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    _mm256_storeu_si256((__m256i *)lanes, a0);
    total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return total + colibri_read_sum_scalar(p + i, n - i);
}

/* ------------------------------------------------------------------------------------------
 * AVX-512 F/BW/VL/DQ. 16 floats per vector; plain-format tails use masked loads, which
 * never touch the masked-off bytes.
 */

#define COLIBRI_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define COLIBRI_AVX512_FN static __attribute__((target(COLIBRI_AVX512_TARGET)))
#define COLIBRI_AVX512_INLINE \
    static inline __attribute__((always_inline, target(COLIBRI_AVX512_TARGET)))

COLIBRI_AVX512_INLINE float colibri_hsum512(__m512 v)
{
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return colibri_hsum256(s);
}

/* 16 elements of a plain-format row (the first `n` of them when n < 16; the rest 0). */
COLIBRI_AVX512_INLINE __m512 colibri_load16_avx512(int fmt, const uint8_t *row, ptrdiff_t c,
                                                   __mmask16 m)
{
    if (fmt == COLIBRI_F32) return _mm512_maskz_loadu_ps(m, row + 4 * c);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * c);
    if (fmt == COLIBRI_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

COLIBRI_AVX512_INLINE void colibri_dot_plain_avx512_body(const int fmt, const uint8_t *row,
                                                         ptrdiff_t cols, const float *x,
                                                         ptrdiff_t xs, float *out,
                                                         ptrdiff_t os, const int NT)
{
    const __mmask16 all = 0xFFFF;
    __m512 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT];
    int t;
    ptrdiff_t c = 0;
    for (t = 0; t < NT; t++) { a0[t] = _mm512_setzero_ps(); a1[t] = _mm512_setzero_ps(); }
    for (; c + 32 <= cols; c += 32) {
        __m512 w0 = colibri_load16_avx512(fmt, row, c, all);
        __m512 w1 = colibri_load16_avx512(fmt, row, c + 16, all);
        for (t = 0; t < NT; t++) {
            const float *xt = x + t * xs + c;
            a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a0[t]);
            a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a1[t]);
        }
    }
    for (; c < cols; c += 16) {                  /* last 1..31 columns, masked */
        ptrdiff_t left = cols - c;
        __mmask16 m = left >= 16 ? all : (__mmask16)((1u << left) - 1u);
        __m512 w0 = colibri_load16_avx512(fmt, row, c, m);
        for (t = 0; t < NT; t++)
            a0[t] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m, x + t * xs + c), a0[t]);
    }
    for (t = 0; t < NT; t++) out[t * os] = colibri_hsum512(_mm512_add_ps(a0[t], a1[t]));
}

/* Quantized rows: the AVX2 scheme at 16 lanes. Per 32-element block, w0 = elements 0..15,
 * w1 = 16..31 (q4: one 16-byte load zero-extended to 32-bit lanes, & 15 and >> 4);
 * t0 = w0*x0 / fma, t1 = w1*x1 / fma; a[g % 2] = fma(t0 + t1, s_g, a[g % 2]); scales and
 * the q4 offset in chunks of 16 groups (masked loads for the last chunk). */
COLIBRI_AVX512_INLINE void colibri_codes32_avx512(const int fmt, const uint8_t *q, __m512 w[2])
{
    if (fmt == COLIBRI_Q4) {
        __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        w[0] = _mm512_cvtepi32_ps(_mm512_and_si512(l, _mm512_set1_epi32(15)));
        w[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(l, 4));
    } else {
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
        w[1] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    }
}

COLIBRI_AVX512_INLINE void colibri_group_avx512(const int fmt, const uint8_t *qg,
                                                ptrdiff_t group, const float *xg, ptrdiff_t xs,
                                                __m512 *tsum, const int NT, const int G32)
{
    const ptrdiff_t bpb = fmt == COLIBRI_Q4 ? 16 : 32;
    __m512 t0[COLIBRI_MAX_NT], t1[COLIBRI_MAX_NT], w[2];
    ptrdiff_t b;
    int t;
    colibri_codes32_avx512(fmt, qg, w);
    for (t = 0; t < NT; t++) {
        const float *xt = xg + t * xs;
        t0[t] = _mm512_mul_ps(w[0], _mm512_loadu_ps(xt));
        t1[t] = _mm512_mul_ps(w[1], _mm512_loadu_ps(xt + 16));
    }
    for (b = 32; !G32 && b < group; b += 32) {
        colibri_codes32_avx512(fmt, qg + b / 32 * bpb, w);
        for (t = 0; t < NT; t++) {
            const float *xt = xg + t * xs + b;
            t0[t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xt), t0[t]);
            t1[t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xt + 16), t1[t]);
        }
    }
    for (t = 0; t < NT; t++) tsum[t] = _mm512_add_ps(t0[t], t1[t]);
}

COLIBRI_AVX512_INLINE void colibri_dot_quant_avx512_body(const int fmt, const uint8_t *row,
                                                         ptrdiff_t cols, ptrdiff_t group,
                                                         const float *x, ptrdiff_t xs,
                                                         const float *xsum, ptrdiff_t ss,
                                                         float *out, ptrdiff_t os,
                                                         const int NT, const int G32)
{
    const ptrdiff_t ng = cols / group, qpg = fmt == COLIBRI_Q4 ? group / 2 : group;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2), *q = row;
    const float *xp = x;
    __m512 a0[COLIBRI_MAX_NT], a1[COLIBRI_MAX_NT], o[COLIBRI_MAX_NT], ts[COLIBRI_MAX_NT];
    float sb[16];
    ptrdiff_t g0, g;
    int t;
    for (t = 0; t < NT; t++) {
        a0[t] = _mm512_setzero_ps(); a1[t] = _mm512_setzero_ps(); o[t] = _mm512_setzero_ps();
    }
    for (g0 = 0; g0 < ng; g0 += 16) {
        const ptrdiff_t n16 = ng - g0 < 16 ? ng - g0 : 16;
        const __mmask16 m = n16 == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n16) - 1u);
        __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + 2 * g0));
        _mm512_storeu_ps(sb, sc);
        if (fmt == COLIBRI_Q4)
            for (t = 0; t < NT; t++)
                o[t] = _mm512_fmadd_ps(sc, _mm512_maskz_loadu_ps(m, xsum + t * ss + g0), o[t]);
        for (g = 0; g + 1 < n16; g += 2) {
            __m512 sa = _mm512_set1_ps(sb[g]), sn = _mm512_set1_ps(sb[g + 1]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm512_fmadd_ps(ts[t], sa, a0[t]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a1[t] = _mm512_fmadd_ps(ts[t], sn, a1[t]);
        }
        if (g < n16) {
            __m512 sa = _mm512_set1_ps(sb[g]);
            colibri_group_avx512(fmt, q, group, xp, xs, ts, NT, G32);
            q += qpg; xp += group;
            for (t = 0; t < NT; t++) a0[t] = _mm512_fmadd_ps(ts[t], sa, a0[t]);
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum512(_mm512_add_ps(a0[t], a1[t]));
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * colibri_hsum512(o[t]) : r;
    }
}

COLIBRI_DEF_PLAIN(colibri_dot_f32_avx512, COLIBRI_F32, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_PLAIN(colibri_dot_f16_avx512, COLIBRI_F16, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_PLAIN(colibri_dot_bf16_avx512, COLIBRI_BF16, COLIBRI_AVX512_FN,
                  colibri_dot_plain_avx512_body)
COLIBRI_DEF_QUANT(colibri_dot_q8_avx512, COLIBRI_Q8, COLIBRI_AVX512_FN,
                  colibri_dot_quant_avx512_body)
COLIBRI_DEF_QUANT(colibri_dot_q4_avx512, COLIBRI_Q4, COLIBRI_AVX512_FN,
                  colibri_dot_quant_avx512_body)

COLIBRI_AVX512_FN uint64_t colibri_read_sum_avx512(const uint8_t *p, size_t n)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
    }
    a0 = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
    return (uint64_t)_mm512_reduce_add_epi64(a0) + colibri_read_sum_scalar(p + i, n - i);
}
#endif /* COLIBRI_X86 */

/* ------------------------------------------------------------------------------------------
 * Run-time choice of the path.
 */

/* 1 when this CPU and OS run the given path (the OS must save the vector registers:
 * __builtin_cpu_supports checks XCR0 for AVX and AVX-512 state). */
static int colibri_isa_supported(int isa)
{
    if (isa == COLIBRI_ISA_SCALAR) return 1;
#if COLIBRI_X86
    {
        unsigned int a, b, c, d;
        int f16c;
        __builtin_cpu_init();
        f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));   /* CPUID.1:ECX.F16C */
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c))
            return 0;
        if (isa == COLIBRI_ISA_AVX2) return 1;
        if (isa == COLIBRI_ISA_AVX512)
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    }
#endif
    return 0;
}

/* The widest supported path. */
static int colibri_isa_best(void)
{
    int isa;
    for (isa = COLIBRI_N_ISA - 1; isa > 0; isa--)
        if (colibri_isa_supported(isa)) return isa;
    return COLIBRI_ISA_SCALAR;
}

/* The row kernel of (isa, fmt); NULL for an unknown pair or a path not compiled in. */
static colibri_dot_fn colibri_dot_for(int isa, int fmt)
{
    static const colibri_dot_fn scalar[COLIBRI_N_FMT] = {
        colibri_dot_f32_scalar, colibri_dot_f16_scalar, colibri_dot_bf16_scalar,
        colibri_dot_q8_scalar, colibri_dot_q4_scalar};
#if COLIBRI_X86
    static const colibri_dot_fn avx2[COLIBRI_N_FMT] = {
        colibri_dot_f32_avx2, colibri_dot_f16_avx2, colibri_dot_bf16_avx2,
        colibri_dot_q8_avx2, colibri_dot_q4_avx2};
    static const colibri_dot_fn avx512[COLIBRI_N_FMT] = {
        colibri_dot_f32_avx512, colibri_dot_f16_avx512, colibri_dot_bf16_avx512,
        colibri_dot_q8_avx512, colibri_dot_q4_avx512};
#endif
    if (fmt < 0 || fmt >= COLIBRI_N_FMT) return NULL;
    if (isa == COLIBRI_ISA_SCALAR) return scalar[fmt];
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2) return avx2[fmt];
    if (isa == COLIBRI_ISA_AVX512) return avx512[fmt];
#endif
    return NULL;
}

/* One block of activations on path isa (the AVX2 body also serves AVX-512): the same bits. */
static inline float colibri_quantize_block(int isa, const float *xb, int8_t *lo, int8_t *hi,
                                           int32_t *s)
{
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512)
        return colibri_quantize_block_avx2(xb, lo, hi, s);
#endif
    (void)isa;
    return colibri_quantize_block_scalar(xb, lo, hi, s);
}

static inline float colibri_quantize_block16(int isa, const float *xb, int16_t *base, int32_t *s)
{
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512)
        return colibri_quantize_block16_avx2(xb, base, s);
#endif
    (void)isa;
    return colibri_quantize_block16_scalar(xb, base, s);
}

/* Code bytes of a packed token row of C columns: C rounded up to a pair of blocks. */
static inline ptrdiff_t colibri_act_row_bytes(int wide, ptrdiff_t cols)
{
    return (wide ? 2 : 1) * ((cols + 63) / 64 * 64);
}

/* Blocks b0 .. b1 - 1 of the row x (C floats) into the packed row (q, d, s); wide: int16
 * codes (q then holds 2-byte codes, addressed in bytes), else int8. */
static inline void colibri_quantize_act(int isa, int wide, const float *x, ptrdiff_t b0,
                                        ptrdiff_t b1, int8_t *q, float *d, int32_t *s)
{
    ptrdiff_t b;
    for (b = b0; b < b1; b++) {
        if (wide) {
            int16_t *base = (int16_t *)(void *)q + 64 * (b >> 1) + 8 * (b & 1);
            d[colibri_dpos(b)] = colibri_quantize_block16(isa, x + 32 * b, base,
                                                          s + colibri_dpos(b));
        } else {
            int8_t *lo = q + 64 * (b >> 1) + 16 * (b & 1);
            d[colibri_dpos(b)] = colibri_quantize_block(isa, x + 32 * b, lo, lo + 32,
                                                        s + colibri_dpos(b));
        }
    }
}

/* A whole token row into the packed layout, with the padding (the partner of an odd last
 * block: q 0; d, s up to npad entries: 0). */
static inline void colibri_quantize_pad(int wide, ptrdiff_t cols, int8_t *q, float *d,
                                        int32_t *s, ptrdiff_t npad)
{
    ptrdiff_t b, nb = cols / 32;
    int i;
    if (nb & 1) {
        if (wide) {
            int16_t *base = (int16_t *)(void *)q + 64 * (nb >> 1) + 8;
            for (i = 0; i < 4; i++) memset(base + 16 * i, 0, 16);
        } else {
            memset(q + 64 * (nb >> 1) + 16, 0, 16);
            memset(q + 64 * (nb >> 1) + 48, 0, 16);
        }
    }
    for (b = nb; b < npad; b++) { d[colibri_dpos(b)] = 0.0f; s[colibri_dpos(b)] = 0; }
}

static inline void colibri_quantize_row(int isa, int wide, const float *x, ptrdiff_t cols,
                                        int8_t *q, float *d, int32_t *s, ptrdiff_t npad)
{
    colibri_quantize_act(isa, wide, x, 0, cols / 32, q, d, s);
    colibri_quantize_pad(wide, cols, q, d, s, npad);
}

/* The plain layout (quantize_activations): q (cols codes: int8, or int16 when wide),
 * d (cols / 32). */
static inline void colibri_quantize_plain(int isa, int wide, const float *x, ptrdiff_t cols,
                                          void *q, float *d)
{
    ptrdiff_t b;
    int32_t s;
    int i;
    for (b = 0; b < cols / 32; b++) {
        if (wide) {
            int16_t packed[64], *out = (int16_t *)q + 32 * b;
            d[b] = colibri_quantize_block16(isa, x + 32 * b, packed, &s);
            for (i = 0; i < 32; i++) out[i] = packed[16 * (i >> 3) + (i & 7)];
        } else {
            int8_t *out = (int8_t *)q + 32 * b;
            d[b] = colibri_quantize_block(isa, x + 32 * b, out, out + 16, &s);
        }
    }
}

/* The SwiGLU product of n values in place: h[i] = silu(h[i]) * u[i]. Scalar: libm expf;
 * AVX2 (and AVX-512): an exp polynomial (~1 ulp), so the paths agree to a few ulp, not bit
 * for bit; on one path the result of an element depends only on h[i] and u[i]. */
static inline void colibri_silu_mul(int isa, float *h, const float *u, ptrdiff_t n)
{
    ptrdiff_t i;
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) {
        colibri_silu_mul_avx2(h, u, n);
        return;
    }
#endif
    (void)isa;
    for (i = 0; i < n; i++) h[i] = colibri_silu(h[i]) * u[i];
}

/* The quantized-activation row kernel of (isa, fmt, wide: int16 codes, else int8); NULL
 * unless fmt is q8 or q4. The AVX-512 path runs the AVX2 bodies (every AVX-512 CPU has
 * AVX2): an AVX-512-specific body (VNNI's vpdpbusd / vpdpwssd) could not be tested on the
 * machines this was written on, so it does not exist yet. */
static colibri_idot_fn colibri_idot_for(int isa, int fmt, int wide)
{
    if (fmt != COLIBRI_Q8 && fmt != COLIBRI_Q4) return NULL;
    if (isa == COLIBRI_ISA_SCALAR) {
        if (wide) return fmt == COLIBRI_Q8 ? colibri_idot16_q8_scalar : colibri_idot16_q4_scalar;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_scalar : colibri_idot_q4_scalar;
    }
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) {
        if (wide) return fmt == COLIBRI_Q8 ? colibri_idot16_q8_avx2 : colibri_idot16_q4_avx2;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_avx2 : colibri_idot_q4_avx2;
    }
#endif
    return NULL;
}

static uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
{
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX512) return colibri_read_sum_avx512(p, n);
    if (isa == COLIBRI_ISA_AVX2) return colibri_read_sum_avx2(p, n);
#endif
    (void)isa;
    return colibri_read_sum_scalar(p, n);
}

/* ==========================================================================================
 * GEMM path (prefill): one panel of up to COLIBRI_GEMM_NR weight rows against many tokens.
 *
 * The row kernel above decodes a weight block once per token block (3-4 tokens): with many
 * tokens per matrix the decoding dominates. Here the panel is decoded to f32 once per K-chunk
 * of KC columns, row-major (panel[i][c]; f32 rows are copied too: read in place, rows 4 KB
 * apart would share L1 sets), and a register-blocked micro-kernel runs every token block over
 * it: MT = 4 tokens x MR = 3 rows, 12 accumulators of 8 column lanes; per 8 columns 3 weight
 * loads, 4 x loads and 12 FMAs (0.22 instructions per multiply-add with the loop). The lanes
 * run along the columns, so the decoded rows need no transpose: the lane partials of each
 * (token, row) go to scratch between K-chunks, and the horizontal sum is taken at the end.
 *
 * Arithmetic (what the results depend on): the decoded weight is exact, w = q * s (q4:
 * (nibble - 8) * s) or the widened plain element, the same float as colibri_decode_row. One
 * (row, token) output is
 *     lane j (j < 8) = sum over the columns c = j (mod 8), c < C8 = C - C % 8, in order
 *                      (a fused multiply-add in the AVX2 body; in the scalar body multiply
 *                      then add, unless the compiler contracts them for an FMA target)
 *     out = hsum(lanes) + w[c] x[c] for the < 8 leftover columns, in order (plain formats)
 * so a result depends only on the row, the token and the path: not on the panel, the tile,
 * the token block or the number of tokens of the call. It does differ in the last bits from
 * the row kernel (another summation order).
 *
 * The AVX-512 path uses the AVX2 bodies (colibri_gemm_for): the development machine has no
 * AVX-512, so a 16-lane body would be untested code.
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
#define COLIBRI_GEMM_DRIVER(FMT, DECODE, MK, HSUM)                                          \
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
                for (i = 0; i < nr; i += COLIBRI_GEMM_MR)                                   \
                    MK(panel + i * COLIBRI_GEMM_KC, COLIBRI_GEMM_KC, kc8, x + t0 * xs + c0, \
                       xs, acc + t0 * as + 8 * i, as, (int)(t1 - t0),                       \
                       nr - i < COLIBRI_GEMM_MR ? nr - i : COLIBRI_GEMM_MR, c0 == 0);       \
            }                                                                               \
            c0 += kc8;                                                                      \
        } while (c0 < C8);                                                                  \
        for (t = 0; t < n; t++)                                                             \
            for (i = 0; i < nr; i++) {                                                      \
                float v = HSUM(acc + t * as + 8 * i);                                       \
                for (c = C8; c < cols; c++)                                                 \
                    v += colibri_weight_elem(FMT, row0 + i * rs, cols, group, c) *          \
                         x[t * xs + c];                                                     \
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

#define COLIBRI_DEF_GEMM(NAME, FMT, ATTR, PANEL, MK, HSUM)                                  \
    ATTR void NAME(const uint8_t *row0, ptrdiff_t rs, int nr, ptrdiff_t cols,               \
                   ptrdiff_t group, const float *x, ptrdiff_t xs, ptrdiff_t n, float *y,    \
                   ptrdiff_t ys, float *scratch)                                            \
    COLIBRI_GEMM_DRIVER(FMT, PANEL(FMT, row0, rs, nr, cols, group, c0, kc8, panel), MK, HSUM)

COLIBRI_DEF_GEMM(colibri_gemm_f32_scalar, COLIBRI_F32, static, colibri_panel_scalar,
                 colibri_mk_scalar, colibri_hsum8_scalar)
COLIBRI_DEF_GEMM(colibri_gemm_f16_scalar, COLIBRI_F16, static, colibri_panel_scalar,
                 colibri_mk_scalar, colibri_hsum8_scalar)
COLIBRI_DEF_GEMM(colibri_gemm_bf16_scalar, COLIBRI_BF16, static, colibri_panel_scalar,
                 colibri_mk_scalar, colibri_hsum8_scalar)
COLIBRI_DEF_GEMM(colibri_gemm_q8_scalar, COLIBRI_Q8, static, colibri_panel_scalar,
                 colibri_mk_scalar, colibri_hsum8_scalar)
COLIBRI_DEF_GEMM(colibri_gemm_q4_scalar, COLIBRI_Q4, static, colibri_panel_scalar,
                 colibri_mk_scalar, colibri_hsum8_scalar)

#if COLIBRI_X86
/* AVX2 bodies. Decode: per 32 columns of a quantized row, the codes as four vectors
 * (colibri_codes32_avx2), times the group's scale (q4: fma(q, s, -8 s), exact); plain rows
 * widened 8 columns at a time. c0 is a multiple of 32 (KC is), kc8 of 8. */
COLIBRI_AVX2_INLINE void colibri_panel_avx2_body(const int fmt, const uint8_t *row0,
                                                 ptrdiff_t rs, int nr, ptrdiff_t cols,
                                                 ptrdiff_t group, ptrdiff_t c0, ptrdiff_t kc8,
                                                 float *panel)
{
    /* the scale of each 32-column block of the chunk, and -8 times it (q4) */
    float sb[COLIBRI_GEMM_KC / 32], ob[COLIBRI_GEMM_KC / 32];
    const ptrdiff_t nblk = kc8 / 32;
    int i;
    ptrdiff_t c, j;
    for (i = 0; i < nr; i++) {
        const uint8_t *row = row0 + i * rs;
        float *out = panel + i * COLIBRI_GEMM_KC;
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
            for (j = 0; j < nblk; j++, out += 32) {
                const __m256 sv = _mm256_broadcast_ss(sb + j);
                colibri_codes32_avx2(fmt, q, w);
                q += fmt == COLIBRI_Q4 ? 16 : 32;
                if (fmt == COLIBRI_Q4) {
                    const __m256 ov = _mm256_broadcast_ss(ob + j);
                    _mm256_store_ps(out, _mm256_fmadd_ps(w[0], sv, ov));
                    _mm256_store_ps(out + 8, _mm256_fmadd_ps(w[1], sv, ov));
                    _mm256_store_ps(out + 16, _mm256_fmadd_ps(w[2], sv, ov));
                    _mm256_store_ps(out + 24, _mm256_fmadd_ps(w[3], sv, ov));
                } else {
                    _mm256_store_ps(out, _mm256_mul_ps(w[0], sv));
                    _mm256_store_ps(out + 8, _mm256_mul_ps(w[1], sv));
                    _mm256_store_ps(out + 16, _mm256_mul_ps(w[2], sv));
                    _mm256_store_ps(out + 24, _mm256_mul_ps(w[3], sv));
                }
            }
        } else {
            for (c = 0; c < kc8; c += 8)
                _mm256_store_ps(out + c, colibri_load8_avx2(fmt, row, c0 + c));
        }
    }
}

/* MT tokens x MR rows, 8 column lanes each; lanes read from acc first unless FIRST. Named
 * accumulators, not arrays: GCC 12 keeps an array of vectors in registers but also stores it
 * to the stack on every iteration. */
#define COLIBRI_MK_TOKENS(X)                                                                 \
    X(0, a00, a01, a02) X(1, a10, a11, a12) X(2, a20, a21, a22) X(3, a30, a31, a32)
COLIBRI_AVX2_INLINE void colibri_mk_avx2_body(const float *w, ptrdiff_t ws, ptrdiff_t kc8,
                                              const float *x, ptrdiff_t xs, float *acc,
                                              ptrdiff_t as, const int MT, const int MR,
                                              const int FIRST)
{
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z,
           a30 = z, a31 = z, a32 = z, w0 = z, w1 = z, w2 = z;
    const float *w1p = w + ws, *w2p = w + 2 * ws;
    ptrdiff_t c;
#define COLIBRI_MK_LOAD(T, A0, A1, A2)                                                       \
    if (MT > T) {                                                                           \
        A0 = _mm256_loadu_ps(acc + T * as);                                                 \
        if (MR > 1) A1 = _mm256_loadu_ps(acc + T * as + 8);                                 \
        if (MR > 2) A2 = _mm256_loadu_ps(acc + T * as + 16);                                \
    }
#define COLIBRI_MK_FMA(T, A0, A1, A2)                                                        \
    if (MT > T) {                                                                           \
        const __m256 xv = _mm256_loadu_ps(x + T * xs + c);                                  \
        A0 = _mm256_fmadd_ps(w0, xv, A0);                                                   \
        if (MR > 1) A1 = _mm256_fmadd_ps(w1, xv, A1);                                       \
        if (MR > 2) A2 = _mm256_fmadd_ps(w2, xv, A2);                                       \
    }
#define COLIBRI_MK_STORE(T, A0, A1, A2)                                                      \
    if (MT > T) {                                                                           \
        _mm256_storeu_ps(acc + T * as, A0);                                                 \
        if (MR > 1) _mm256_storeu_ps(acc + T * as + 8, A1);                                 \
        if (MR > 2) _mm256_storeu_ps(acc + T * as + 16, A2);                                \
    }
    if (!FIRST) { COLIBRI_MK_TOKENS(COLIBRI_MK_LOAD) }
#if defined(__clang__)
#pragma unroll 2
#elif defined(__GNUC__)
#pragma GCC unroll 2
#endif
    for (c = 0; c < kc8; c += 8) {
        w0 = _mm256_loadu_ps(w + c);
        if (MR > 1) w1 = _mm256_loadu_ps(w1p + c);
        if (MR > 2) w2 = _mm256_loadu_ps(w2p + c);
        COLIBRI_MK_TOKENS(COLIBRI_MK_FMA)
    }
    COLIBRI_MK_TOKENS(COLIBRI_MK_STORE)
#undef COLIBRI_MK_LOAD
#undef COLIBRI_MK_FMA
#undef COLIBRI_MK_STORE
}
#undef COLIBRI_MK_TOKENS

COLIBRI_AVX2_FN void colibri_mk_avx2(const float *w, ptrdiff_t ws, ptrdiff_t kc8,
                                     const float *x, ptrdiff_t xs, float *acc, ptrdiff_t as,
                                     int mt, int mr, int first)
{
#define COLIBRI_MK_CASE(MT, MR)                                                              \
    if (first) colibri_mk_avx2_body(w, ws, kc8, x, xs, acc, as, MT, MR, 1);                  \
    else colibri_mk_avx2_body(w, ws, kc8, x, xs, acc, as, MT, MR, 0);                        \
    return;
#define COLIBRI_MK_ROWS(MT)                                                                  \
    if (mr == 3) { COLIBRI_MK_CASE(MT, 3) } else if (mr == 2) { COLIBRI_MK_CASE(MT, 2) }    \
    else { COLIBRI_MK_CASE(MT, 1) }
    switch (mt) {
    case 4: COLIBRI_MK_ROWS(4)
    case 3: COLIBRI_MK_ROWS(3)
    case 2: COLIBRI_MK_ROWS(2)
    default: COLIBRI_MK_ROWS(1)
    }
#undef COLIBRI_MK_ROWS
#undef COLIBRI_MK_CASE
}

COLIBRI_AVX2_INLINE float colibri_hsum8_avx2(const float *l)
{
    return colibri_hsum256(_mm256_loadu_ps(l));
}

#define COLIBRI_DEF_GEMM_AVX2(NAME, FMT)                                                     \
    COLIBRI_AVX2_INLINE void NAME##_panel(const int fmt, const uint8_t *row0, ptrdiff_t rs, \
                                          int nr, ptrdiff_t cols, ptrdiff_t group,          \
                                          ptrdiff_t c0, ptrdiff_t kc8, float *panel)        \
    {                                                                                       \
        colibri_panel_avx2_body(FMT, row0, rs, nr, cols, group, c0, kc8, panel);            \
        (void)fmt;                                                                          \
    }                                                                                       \
    COLIBRI_DEF_GEMM(NAME, FMT, COLIBRI_AVX2_FN, NAME##_panel, colibri_mk_avx2,             \
                     colibri_hsum8_avx2)

COLIBRI_DEF_GEMM_AVX2(colibri_gemm_f32_avx2, COLIBRI_F32)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_f16_avx2, COLIBRI_F16)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_bf16_avx2, COLIBRI_BF16)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_q8_avx2, COLIBRI_Q8)
COLIBRI_DEF_GEMM_AVX2(colibri_gemm_q4_avx2, COLIBRI_Q4)
#endif /* COLIBRI_X86 */

/* The GEMM panel kernel of (isa, fmt); NULL for an unknown pair or a path not compiled in.
 * AVX-512 machines run the AVX2 bodies (see the section comment). */
static colibri_gemm_fn colibri_gemm_for(int isa, int fmt)
{
    static const colibri_gemm_fn scalar[COLIBRI_N_FMT] = {
        colibri_gemm_f32_scalar, colibri_gemm_f16_scalar, colibri_gemm_bf16_scalar,
        colibri_gemm_q8_scalar, colibri_gemm_q4_scalar};
#if COLIBRI_X86
    static const colibri_gemm_fn avx2[COLIBRI_N_FMT] = {
        colibri_gemm_f32_avx2, colibri_gemm_f16_avx2, colibri_gemm_bf16_avx2,
        colibri_gemm_q8_avx2, colibri_gemm_q4_avx2};
#endif
    if (fmt < 0 || fmt >= COLIBRI_N_FMT) return NULL;
    if (isa == COLIBRI_ISA_SCALAR) return scalar[fmt];
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) return avx2[fmt];
#endif
    return NULL;
}

#endif /* COLIBRI_SIMD_H */
