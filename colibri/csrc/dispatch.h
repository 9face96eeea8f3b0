/* csrc/dispatch.h: the run-time choice of the path. Which paths this CPU and OS run
 * (colibri_isa_supported, colibri_isa_best), the row-kernel tables per (path, format)
 * (colibri_dot_for, colibri_idot_for), and the per-path entry points of activation
 * quantization, SwiGLU and the read kernel. (The GEMM table is in gemm.h.) */
#ifndef COLIBRI_DISPATCH_H
#define COLIBRI_DISPATCH_H

#include "scalar.h"
#include "avx2.h"
#include "avx2_int.h"
#include "avx512.h"
#include "avx512_int.h"
#include "vnni.h"
#include "smallm.h"
#include "mxfp4.h"
#include "amx.h"

/* ------------------------------------------------------------------------------------------
 * Run-time choice of the path.
 */

/* 1 when this CPU and OS run the given path (the OS must save the vector registers:
 * __builtin_cpu_supports checks XCR0 for AVX and AVX-512 state, and reports AVX-VNNI only
 * where AVX state is saved and AVX-512 VNNI only where AVX-512 state is). A VNNI path needs
 * its base path (colibri_isa_base) and the VNNI flag of its encoding. */
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
#if COLIBRI_VNNI
        if (isa == COLIBRI_ISA_AVXVNNI) return __builtin_cpu_supports("avxvnni") != 0;
#endif
        if (isa == COLIBRI_ISA_AVX512 || (COLIBRI_VNNI && isa == COLIBRI_ISA_AVX512VNNI))
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                   (isa == COLIBRI_ISA_AVX512 || __builtin_cpu_supports("avx512vnni"));
#if COLIBRI_VNNI
        if (isa == COLIBRI_ISA_AMX_EMU || isa == COLIBRI_ISA_AMX)   /* amx.h: CPU, OS, self-check */
            return colibri_amx_usable(isa, colibri_isa_supported(COLIBRI_ISA_AVX512VNNI));
#endif
    }
#endif
    return 0;
}

/* The widest supported path: the highest code (types.h orders them by preference; a CPU
 * with AVX-VNNI and AVX-512 but not AVX-512 VNNI, if one existed, would get avxvnni), never
 * amx-emu (the emulation is a test path: it is only chosen by name). */
static int colibri_isa_best(void)
{
    int isa;
    for (isa = COLIBRI_N_ISA - 1; isa > 0; isa--)
        if (isa != COLIBRI_ISA_AMX_EMU && colibri_isa_supported(isa)) return isa;
    return COLIBRI_ISA_SCALAR;
}

/* Why this CPU / OS / build does not run path isa ("" when it does): the first missing
 * piece, in the order colibri_isa_supported checks them (the AMX paths: colibri_amx_why). */
static const char *colibri_isa_why_not(int isa)
{
    if (isa < 0 || isa >= COLIBRI_N_ISA) return "unknown path";
    if (colibri_isa_supported(isa)) return "";
#if COLIBRI_X86
    {
        unsigned int a, b, c, d;
        __builtin_cpu_init();
        if (!__builtin_cpu_supports("avx2")) return "CPU lacks AVX2";
        if (!__builtin_cpu_supports("fma")) return "CPU lacks FMA";
        if (!(__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)))) return "CPU lacks F16C";
        if (isa == COLIBRI_ISA_AVXVNNI) return "CPU lacks AVX-VNNI (256-bit, VEX)";
        if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
            !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
            return "CPU or OS lacks AVX-512 F / BW / VL / DQ";
        if (!__builtin_cpu_supports("avx512vnni")) return "CPU lacks AVX-512 VNNI";
        if (isa == COLIBRI_ISA_AMX_EMU || isa == COLIBRI_ISA_AMX) return colibri_amx_why;
    }
    return "not compiled into this build";
#else
    return "not an x86-64 build";
#endif
}

/* The row kernel of (isa, fmt); NULL for an unknown pair or a path not compiled in. */
static colibri_dot_fn colibri_dot_for(int isa, int fmt)
{
    static const colibri_dot_fn scalar[COLIBRI_N_FMT] = {
        colibri_dot_f32_scalar, colibri_dot_f16_scalar, colibri_dot_bf16_scalar,
        colibri_dot_q8_scalar, colibri_dot_q4_scalar, [COLIBRI_MXFP4] = colibri_dot_mxfp4_scalar};
#if COLIBRI_X86
    static const colibri_dot_fn avx2[COLIBRI_N_FMT] = {
        colibri_dot_f32_avx2, colibri_dot_f16_avx2, colibri_dot_bf16_avx2,
        colibri_dot_q8_avx2, colibri_dot_q4_avx2, [COLIBRI_MXFP4] = colibri_dot_mxfp4_avx2};
    static const colibri_dot_fn avx512[COLIBRI_N_FMT] = {
        colibri_dot_f32_avx512, colibri_dot_f16_avx512, colibri_dot_bf16_avx512,
        colibri_dot_q8_avx512, colibri_dot_q4_avx512,
        [COLIBRI_MXFP4] = colibri_dot_mxfp4_avx512};
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

/* One block of activations on path isa (the AVX2 body also serves every wider path): the
 * same bits. */
static inline float colibri_quantize_block(int isa, const float *xb, int8_t *lo, int8_t *hi,
                                           int32_t *s)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR)
        return colibri_quantize_block_avx2(xb, lo, hi, s);
#endif
    (void)isa;
    return colibri_quantize_block_scalar(xb, lo, hi, s);
}

static inline float colibri_quantize_block16(int isa, const float *xb, int16_t *base, int32_t *s)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR)
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
 * AVX2 (and every wider path): an exp polynomial (~1 ulp), so the paths agree to a few ulp, not bit
 * for bit; on one path the result of an element depends only on h[i] and u[i]. */
static inline void colibri_silu_mul(int isa, float *h, const float *u, ptrdiff_t n)
{
    ptrdiff_t i;
#if COLIBRI_X86
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR) {
        colibri_silu_mul_avx2(h, u, n);
        return;
    }
#endif
    (void)isa;
    for (i = 0; i < n; i++) h[i] = colibri_silu(h[i]) * u[i];
}

/* The quantized-activation row kernel of (isa, fmt, wide: int16 codes, else int8); NULL
 * unless fmt is q8 or q4. The avx512vnni and avxvnni paths run their VNNI bodies (vnni.h:
 * vpdpbusd / vpdpwssd, the same bits as AVX2); the avx512 path runs a 512-bit int16 body
 * (avx512_int.h, the same bits) and the AVX2 int8 bodies (vpsignb, which the AVX2 q8 body
 * needs, has no 512-bit form). */
static colibri_idot_fn colibri_idot_for(int isa, int fmt, int wide)
{
    isa = colibri_isa_int_base(isa);                   /* the AMX paths: avx512vnni's rows */
    if (fmt == COLIBRI_MXFP4) return colibri_idot_mxfp4_for(isa, wide);
    if (fmt != COLIBRI_Q8 && fmt != COLIBRI_Q4) return NULL;
    if (isa == COLIBRI_ISA_SCALAR) {
        if (wide) return fmt == COLIBRI_Q8 ? colibri_idot16_q8_scalar : colibri_idot16_q4_scalar;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_scalar : colibri_idot_q4_scalar;
    }
#if COLIBRI_VNNI
    if (isa == COLIBRI_ISA_AVX512VNNI) {     /* int16: the small-M bodies (smallm.h) */
        if (wide)
            return fmt == COLIBRI_Q8 ? colibri_smdot16_q8_avx512vnni : colibri_smdot16_q4_avx512vnni;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_avx512vnni : colibri_idot_q4_avx512vnni;
    }
    if (isa == COLIBRI_ISA_AVXVNNI) {
        if (wide) return fmt == COLIBRI_Q8 ? colibri_idot16_q8_avxvnni : colibri_idot16_q4_avxvnni;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_avxvnni : colibri_idot_q4_avxvnni;
    }
#endif
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX512 && wide)
        return fmt == COLIBRI_Q8 ? colibri_smdot16_q8_avx512 : colibri_smdot16_q4_avx512;
    if (isa == COLIBRI_ISA_AVX2 || isa == COLIBRI_ISA_AVX512) {
        if (wide) return fmt == COLIBRI_Q8 ? colibri_idot16_q8_avx2 : colibri_idot16_q4_avx2;
        return fmt == COLIBRI_Q8 ? colibri_idot_q8_avx2 : colibri_idot_q4_avx2;
    }
#endif
    return NULL;
}

/* Tokens per call of colibri_idot_for(isa, fmt, wide) that the callers pass: the small-M
 * bodies (smallm.h: int16 codes on avx512vnni and avx512) take COLIBRI_SM_MAX_NT, the pair
 * bodies 3 (int16) or COLIBRI_INT8_NT (int8); mxfp4 as the pair bodies. (The int8 small-M
 * body measured no faster than the pair body: q4 60 vs 65 GMAC/s at one token, level at 2-4;
 * it stays unused.) */
static int colibri_idot_small_m(int isa, int fmt, int wide)
{
    isa = colibri_isa_int_base(isa);
    return (fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4) && wide &&
           ((COLIBRI_VNNI && isa == COLIBRI_ISA_AVX512VNNI) || isa == COLIBRI_ISA_AVX512);
}

static int colibri_idot_block(int isa, int fmt, int wide)
{
    if (colibri_idot_small_m(isa, fmt, wide)) return COLIBRI_SM_MAX_NT;
    return wide ? 3 : COLIBRI_INT8_NT;
}

static uint64_t colibri_read_sum(int isa, const uint8_t *p, size_t n)
{
    isa = colibri_isa_base(isa);
#if COLIBRI_X86
    if (isa == COLIBRI_ISA_AVX512) return colibri_read_sum_avx512(p, n);
    if (isa == COLIBRI_ISA_AVX2) return colibri_read_sum_avx2(p, n);
#endif
    (void)isa;
    return colibri_read_sum_scalar(p, n);
}

#endif /* COLIBRI_DISPATCH_H */
