/* _simd.h -- the inner loops of colibri's kernels, one body per instruction set.
 *
 * Everything here is a static inline C helper with no Python in it; _kernels.pyx owns the
 * loops over tokens, rows and experts and calls in here for one weight row at a time.
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
 * q4 also takes xsum[t * xsum_stride + g] = sum of x over group g: the SIMD bodies fold the
 * -8 offset out of the inner loop, sum_c (q_c - 8) s x_c = s (sum_c q_c x_c - 8 sum_c x_c).
 * No body reads a byte outside the row or outside x: tails are scalar or masked.
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

#define COLIBRI_MAX_NT 4   /* tokens per weight-row pass */

typedef void (*colibri_dot_fn)(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                               const float *x, ptrdiff_t x_stride,
                               const float *xsum, ptrdiff_t xsum_stride,
                               int nt, float *out, ptrdiff_t out_stride);

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

/* xsum[g] = sum of x over group g (f32, in element order), for the q4 offset fold. */
static inline void colibri_group_sums(const float *x, ptrdiff_t cols, ptrdiff_t group, float *xsum)
{
    ptrdiff_t g, c;
    for (g = 0; g < cols / group; g++) {
        float s = 0.0f;
        for (c = g * group; c < (g + 1) * group; c++) s += x[c];
        xsum[g] = s;
    }
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

static void colibri_dot_f32_scalar(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                                   const float *x, ptrdiff_t xs, const float *xsum,
                                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)
{
    (void)group; (void)xsum; (void)ss;
    colibri_dot_plain_scalar(COLIBRI_F32, row, cols, x, xs, nt, out, os);
}

static void colibri_dot_f16_scalar(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                                   const float *x, ptrdiff_t xs, const float *xsum,
                                   ptrdiff_t ss, int nt, float *out, ptrdiff_t os)
{
    (void)group; (void)xsum; (void)ss;
    colibri_dot_plain_scalar(COLIBRI_F16, row, cols, x, xs, nt, out, os);
}

static void colibri_dot_bf16_scalar(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                                    const float *x, ptrdiff_t xs, const float *xsum,
                                    ptrdiff_t ss, int nt, float *out, ptrdiff_t os)
{
    (void)group; (void)xsum; (void)ss;
    colibri_dot_plain_scalar(COLIBRI_BF16, row, cols, x, xs, nt, out, os);
}

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

static void colibri_dot_q8_scalar(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                                  const float *x, ptrdiff_t xs, const float *xsum,
                                  ptrdiff_t ss, int nt, float *out, ptrdiff_t os)
{
    (void)xsum; (void)ss;
    colibri_dot_quant_scalar(COLIBRI_Q8, row, cols, group, x, xs, nt, out, os);
}

static void colibri_dot_q4_scalar(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group,
                                  const float *x, ptrdiff_t xs, const float *xsum,
                                  ptrdiff_t ss, int nt, float *out, ptrdiff_t os)
{
    (void)xsum; (void)ss;     /* the scalar body subtracts the offset per element */
    colibri_dot_quant_scalar(COLIBRI_Q4, row, cols, group, x, xs, nt, out, os);
}

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
 * AVX2 + FMA + F16C. 8 floats per vector. Per token two (q: up to four) independent
 * partial accumulators, so consecutive FMAs do not wait on each other.
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

/* Quantized rows; NACC partial accumulators per token (4 for one token, where latency is
 * the limit; 2 for several, where registers are). */
COLIBRI_AVX2_INLINE void colibri_dot_quant_avx2_body(const int fmt, const uint8_t *row,
                                                     ptrdiff_t cols, ptrdiff_t group,
                                                     const float *x, ptrdiff_t xs,
                                                     const float *xsum, ptrdiff_t ss,
                                                     float *out, ptrdiff_t os, const int NT)
{
    const int NACC = NT == 1 ? 4 : 2;
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[COLIBRI_MAX_NT], p[COLIBRI_MAX_NT][4];
    float off[COLIBRI_MAX_NT];
    ptrdiff_t g, c, ng = cols / group;
    int t, j;
    for (t = 0; t < NT; t++) { acc[t] = _mm256_setzero_ps(); off[t] = 0.0f; }
    for (g = 0; g < ng; g++) {
        for (t = 0; t < NT; t++)
            for (j = 0; j < NACC; j++) p[t][j] = _mm256_setzero_ps();
        for (c = g * group; c < (g + 1) * group; c += 32) {
            __m256 w[4];
            if (fmt == COLIBRI_Q4) {
                /* one 16-byte load: low nibbles = elements c..c+15, high = c+16..c+31 */
                __m128i raw = _mm_loadu_si128((const __m128i *)(row + c / 2));
                __m128i lo = _mm_and_si128(raw, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
            } else {
                for (j = 0; j < 4; j++)
                    w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                        _mm_loadl_epi64((const __m128i *)(row + c + 8 * j))));
            }
            for (t = 0; t < NT; t++) {
                const float *xt = x + t * xs + c;
                for (j = 0; j < 4; j++)
                    p[t][j % NACC] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xt + 8 * j),
                                                     p[t][j % NACC]);
            }
        }
        {
            float s = _cvtsh_ss(colibri_ld_u16(scales + 2 * g));
            __m256 vs = _mm256_set1_ps(s);
            for (t = 0; t < NT; t++) {
                __m256 sum = p[t][0];
                for (j = 1; j < NACC; j++) sum = _mm256_add_ps(sum, p[t][j]);
                acc[t] = _mm256_fmadd_ps(sum, vs, acc[t]);
                if (fmt == COLIBRI_Q4) off[t] += s * xsum[t * ss + g];
            }
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum256(acc[t]);
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * off[t] : r;
    }
}

/* One entry point per (format, path); the switch picks the body unrolled for nt tokens. */
#define COLIBRI_DEF_PLAIN(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group, const float *x,    \
                   ptrdiff_t xs, const float *xsum, ptrdiff_t ss, int nt, float *out,      \
                   ptrdiff_t os)                                                            \
    {                                                                                       \
        (void)group; (void)xsum; (void)ss;                                                  \
        switch (nt) {                                                                       \
        case 1: BODY(FMT, row, cols, x, xs, out, os, 1); break;                             \
        case 2: BODY(FMT, row, cols, x, xs, out, os, 2); break;                             \
        case 3: BODY(FMT, row, cols, x, xs, out, os, 3); break;                             \
        default: BODY(FMT, row, cols, x, xs, out, os, 4); break;                            \
        }                                                                                   \
    }

#define COLIBRI_DEF_QUANT(NAME, FMT, ATTR, BODY)                                             \
    ATTR void NAME(const uint8_t *row, ptrdiff_t cols, ptrdiff_t group, const float *x,    \
                   ptrdiff_t xs, const float *xsum, ptrdiff_t ss, int nt, float *out,      \
                   ptrdiff_t os)                                                            \
    {                                                                                       \
        switch (nt) {                                                                       \
        case 1: BODY(FMT, row, cols, group, x, xs, xsum, ss, out, os, 1); break;            \
        case 2: BODY(FMT, row, cols, group, x, xs, xsum, ss, out, os, 2); break;            \
        case 3: BODY(FMT, row, cols, group, x, xs, xsum, ss, out, os, 3); break;            \
        default: BODY(FMT, row, cols, group, x, xs, xsum, ss, out, os, 4); break;           \
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

COLIBRI_AVX512_INLINE void colibri_dot_quant_avx512_body(const int fmt, const uint8_t *row,
                                                         ptrdiff_t cols, ptrdiff_t group,
                                                         const float *x, ptrdiff_t xs,
                                                         const float *xsum, ptrdiff_t ss,
                                                         float *out, ptrdiff_t os,
                                                         const int NT)
{
    const uint8_t *scales = row + (fmt == COLIBRI_Q8 ? cols : cols / 2);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m512 acc[COLIBRI_MAX_NT], p0[COLIBRI_MAX_NT], p1[COLIBRI_MAX_NT];
    float off[COLIBRI_MAX_NT];
    ptrdiff_t g, c, ng = cols / group;
    int t;
    for (t = 0; t < NT; t++) { acc[t] = _mm512_setzero_ps(); off[t] = 0.0f; }
    for (g = 0; g < ng; g++) {
        for (t = 0; t < NT; t++) { p0[t] = _mm512_setzero_ps(); p1[t] = _mm512_setzero_ps(); }
        for (c = g * group; c < (g + 1) * group; c += 32) {
            __m512 w0, w1;
            if (fmt == COLIBRI_Q4) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(row + c / 2));
                w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low4)));
                w1 = _mm512_cvtepi32_ps(
                    _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low4)));
            } else {
                w0 = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c))));
                w1 = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c + 16))));
            }
            for (t = 0; t < NT; t++) {
                const float *xt = x + t * xs + c;
                p0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), p0[t]);
                p1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), p1[t]);
            }
        }
        {
            float s = _cvtsh_ss(colibri_ld_u16(scales + 2 * g));
            __m512 vs = _mm512_set1_ps(s);
            for (t = 0; t < NT; t++) {
                acc[t] = _mm512_fmadd_ps(_mm512_add_ps(p0[t], p1[t]), vs, acc[t]);
                if (fmt == COLIBRI_Q4) off[t] += s * xsum[t * ss + g];
            }
        }
    }
    for (t = 0; t < NT; t++) {
        float r = colibri_hsum512(acc[t]);
        out[t * os] = fmt == COLIBRI_Q4 ? r - 8.0f * off[t] : r;
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

static uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
{
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX512) return colibri_read_sum_avx512(p, n);
    if (isa == COLIBRI_ISA_AVX2) return colibri_read_sum_avx2(p, n);
#endif
    (void)isa;
    return colibri_read_sum_scalar(p, n);
}

#endif /* COLIBRI_SIMD_H */
