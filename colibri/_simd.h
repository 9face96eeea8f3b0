/* _simd.h -- the inner loops of colibri's kernels, one body per instruction set.
 *
 * The header the extension includes: it includes the C layer in colibri/csrc/, in order.
 * Everything there is a static (inline) C helper with no Python in it; _kernels.pyx owns the
 * loops over tokens, rows and experts and calls in for one weight row at a time (the row
 * kernel), or for one panel of rows against many tokens (the GEMM path).
 *   csrc/types.h       codes, kernel signatures, byte loaders, f16/bf16, the row layout of
 *                      the formats, the packed activation rows, SiLU, the routing RNG
 *   csrc/scalar.h      the scalar bodies: the specification
 *   csrc/avx2.h        AVX2 f32-activation row kernels and the shared AVX2 helpers
 *   csrc/avx2_int.h    AVX2 integer-activation row kernels (int8 / int16) and quantizer
 *   csrc/avx512.h      AVX-512 f32-activation row kernels
 *   csrc/vnni.h        AVX-512 VNNI (EVEX) and AVX-VNNI (VEX) integer-activation row kernels
 *   csrc/dispatch.h    which paths run here; the (path, format) tables of the row kernels
 *   csrc/gemm.h        the GEMM (prefill) path: driver, scalar and AVX2 bodies, its table
 *   csrc/igemm.h       the integer-activation GEMM (prefill on int8 / int16 codes): scalar
 *                      spec, AVX2, AVX-VNNI and AVX-512 VNNI bodies, its table
 * Included by _kernels.pyx beside this header: csrc/attend.h (decode attention), csrc/pool.h
 * (the thread pool), csrc/rowops.h (a decode step's row operations), csrc/npy.h (NumPy
 * array checks).
 * A new body (AMX, NEON): a header of its own beside the others, included
 * here before dispatch.h (inside its own compile-time guard, as COLIBRI_X86 guards the x86
 * ones), a path code in types.h (and its name in the Python side's list of ISAs), and its
 * entries in dispatch.h (colibri_isa_supported, the *_for tables; gemm.h's table for a GEMM
 * body). Every body matches scalar.h's results as the existing ones do (the same bits, or
 * the documented summation order of its path).
 *
 * Three bodies of every row kernel, and two paths that add integer row kernels:
 *   scalar      always compiled; the readable specification of each weight format and the
 *               fallback on non-x86 machines;
 *   avx2        AVX2 + FMA + F16C;
 *   avx512      AVX-512 F/BW/VL/DQ (+ the AVX2 set);
 *   avxvnni     avx2 + AVX-VNNI: the VEX vpdpbusd / vpdpwssd int8 / int16 row kernels;
 *   avx512vnni  avx512 + AVX-512 VNNI: the same kernels in EVEX (32 registers).
 * (A VNNI path runs its base path's body for every other kernel: colibri_isa_base.)
 * The module is compiled for the baseline of the architecture (no -march=native): the SIMD
 * bodies carry __attribute__((target(...))), so one build holds all of them and the path is
 * chosen once at run time from the CPU (colibri_isa_supported, which also checks that the
 * OS saves the vector registers). On a non-x86 machine or a compiler without target
 * attributes only the scalar body exists.
 *
 * Weight formats (docs/format.md §6; a row is `cols` elements of one output, C = cols, G = group):
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
 * The avx512 path runs the AVX2 int8 bodies; avxvnni and avx512vnni run the VNNI ones
 * (csrc/vnni.h: the AVX2 bits, with vpdpbusd / vpdpwssd for the integer part; see
 * colibri_idot_for).
 *
 * The int16 row kernel (activations="int16"): the same with 16-bit codes, d = amax / 32767
 * (colibri_quantize_block16): the same formula, the same exactness (the integer sums stay
 * below 2^31), its own packed layout (colibri_qpos16); the codes of a token row are
 * addressed in bytes by both kernels (q, q_stride), so the callers handle either width alike.
 */
#ifndef COLIBRI_SIMD_H
#define COLIBRI_SIMD_H

#include "csrc/types.h"
#include "csrc/scalar.h"
#include "csrc/avx2.h"
#include "csrc/avx2_int.h"
#include "csrc/avx512.h"
#include "csrc/vnni.h"
#include "csrc/mxfp4.h"
#include "csrc/dispatch.h"
#include "csrc/gemm.h"
#include "csrc/igemm.h"

#endif /* COLIBRI_SIMD_H */
