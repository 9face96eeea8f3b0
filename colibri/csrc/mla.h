/* colibri/csrc/mla.h: the absorbed decode step of multi-head latent attention (DeepSeek-V2 /
 * V3; colibri/engine/mla.py, MLA.decode), one token over the latent cache, on the file's own kv_b.
 *
 * kv_b (H*(Dn+Dv), R) holds per head h the Dn rows W_kb[h] (R columns each) and then the Dv
 * rows W_vb[h]. The cache holds per position j the latent c_j (R) and the rotated key kr_j
 * (Dr). For query head h with q_nope[h] (Dn), q_rope[h] (Dr, rotated):
 *   q_lat[h] = sum_i q_nope[h, i] W_kb[h, i]          (R: a sum of decoded rows, in order i)
 *   s_j      = scale * ((q_lat[h] . c_j) + (q_rope[h] . kr_j))
 *   o_lat[h] = (sum_j exp(s_j - max s) c_j) / sum_j exp(s_j - max s)
 *   out[h]   = W_vb[h] o_lat[h]                       (Dv: the f32-activation row kernel)
 * The weight rows are decoded exactly (the floats colibri_decode_row gives: gemm.h's panel
 * decode), so the step is the NumPy form over kv_b widened to float32 (_reference.py,
 * mla_absorbed) up to summation order, without that f32 copy (4x the bytes of q8, 7x of q4).
 *
 * colibri_tmv_*: out (C) = sum_i q[i] W[i] over n rows of any weight format (the transposed
 * matrix-vector product q_lat needs: W_kb is stored row-major by output feature of kv_b).
 * Scalar: element by element, rows in order (multiply then add). AVX2: the rows decoded in
 * panels of COLIBRI_GEMM_NR x COLIBRI_GEMM_KC (gemm.h's AVX2 panel decode), then per row one
 * fused multiply-add into the 8-lane accumulators, rows in order; when cols is a multiple of
 * 64 (and the format not MXFP4) the same decode and FMAs with 64 columns of accumulators in
 * registers down all rows (the same bits, no panel). AVX-512 (cols % 64 == 0, not MXFP4):
 * the register body on 16 lanes, the same decode and FMAs, the same bits as AVX2; other
 * shapes on the AVX-512 paths run the AVX2 bodies.
 *
 * colibri_mla_attend_*: the latent attention of nh heads over n positions (c and kr rows of
 * cache format fmt, f32 / f16 / bf16, widened exactly as they are loaded). Scalar: dot
 * products in index order, libm expf; AVX2 / AVX-512: attend.h's score helpers (8 keys per
 * reduction), its softmax (the exp polynomial, ~1 ulp) and 8 / 16-lane weighted sums, the
 * heads of a call sharing each block of positions while it is in L1. The paths agree to ~1e-6
 * relative.
 */
#ifndef COLIBRI_MLA_H
#define COLIBRI_MLA_H

#include "gemm.h"
#include "attend.h"

/* Heads one colibri_mla_attend call takes at most (the caller splits more). */
#define COLIBRI_MLA_MAX_HEADS 128

/* out[c] = sum_i q[i] * W[i][c] for c < cols, rows i < n at row0 + i * rs (format fmt, group
 * the quantization group). */
static void colibri_tmv_scalar(int fmt, const uint8_t *row0, ptrdiff_t rs, ptrdiff_t n,
                               ptrdiff_t cols, ptrdiff_t group, const float *q, float *out)
{
    ptrdiff_t i, c;
    for (c = 0; c < cols; c++) out[c] = 0.0f;
    for (i = 0; i < n; i++)
        for (c = 0; c < cols; c++)
            out[c] += q[i] * colibri_weight_elem(fmt, row0 + i * rs, cols, group, c);
}

#if COLIBRI_X86
/* panel: COLIBRI_GEMM_NR * COLIBRI_GEMM_KC floats, 32-byte aligned. */
COLIBRI_AVX2_INLINE void colibri_tmv_avx2_body(const int fmt, const uint8_t *row0,
                                               ptrdiff_t rs, ptrdiff_t n, ptrdiff_t cols,
                                               ptrdiff_t group, const float *q, float *out,
                                               float *panel)
{
    ptrdiff_t c0, i0, c;
    int i;
    for (c = 0; c < cols; c++) out[c] = 0.0f;
    for (c0 = 0; c0 < cols; c0 += COLIBRI_GEMM_KC) {
        const ptrdiff_t kc = cols - c0 < COLIBRI_GEMM_KC ? cols - c0 : COLIBRI_GEMM_KC;
        const ptrdiff_t kc8 = kc - kc % 8;
        for (i0 = 0; i0 < n; i0 += COLIBRI_GEMM_NR) {
            const int nr = n - i0 < COLIBRI_GEMM_NR ? (int)(n - i0) : COLIBRI_GEMM_NR;
            colibri_panel_avx2_body(fmt, row0 + i0 * rs, rs, nr, cols, group, c0, kc8, panel,
                                    0);
            for (i = 0; i < nr; i++) {
                const __m256 qv = _mm256_set1_ps(q[i0 + i]);
                const float *w = panel + i * COLIBRI_GEMM_KC;
                float *o = out + c0;
                for (c = 0; c + 32 <= kc8; c += 32) {
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(qv, _mm256_load_ps(w + c),
                                                            _mm256_loadu_ps(o + c)));
                    _mm256_storeu_ps(o + c + 8, _mm256_fmadd_ps(qv, _mm256_load_ps(w + c + 8),
                                                                _mm256_loadu_ps(o + c + 8)));
                    _mm256_storeu_ps(o + c + 16,
                                     _mm256_fmadd_ps(qv, _mm256_load_ps(w + c + 16),
                                                     _mm256_loadu_ps(o + c + 16)));
                    _mm256_storeu_ps(o + c + 24,
                                     _mm256_fmadd_ps(qv, _mm256_load_ps(w + c + 24),
                                                     _mm256_loadu_ps(o + c + 24)));
                }
                for (; c < kc8; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(qv, _mm256_load_ps(w + c),
                                                            _mm256_loadu_ps(o + c)));
                for (c = kc8; c < kc; c++)     /* plain formats: the last cols % 8 columns */
                    o[c] = _mm_cvtss_f32(_mm_fmadd_ss(
                        _mm_set_ss(q[i0 + i]),
                        _mm_set_ss(colibri_weight_elem(fmt, row0 + (i0 + i) * rs, cols, group,
                                                       c0 + c)),
                        _mm_set_ss(o[c])));
            }
        }
    }
}

/* The same sums with the accumulators in registers: per 64 columns, 64 / L vectors of L
 * lanes down all n rows, each weight decoded as the panel body decodes it (q4: fma(code, s,
 * -8 s), exact) and added by the same fused multiply-add in the same row order, so the same
 * bits as the panel body, without the panel's store and reload. q8 / q4 and plain formats,
 * cols % 64 == 0. One text for the AVX2 body (P = 256, L = 8) and the AVX-512 one (P = 512,
 * L = 16), over each path's COLIBRI_TMV<P>_<OP> (V: the vector type; L its lanes; ZERO,
 * SET1, FMA, MUL, STORE; CODES32(fmt, codes, w): 32 codes as 32 / L vectors; PLAIN(fmt, row,
 * c): L plain elements). */
#define COLIBRI_TMV_OP(P, OP) COLIBRI_TMV##P##_##OP
#define COLIBRI_TMV_REGS_BODY(NAME, ATTR, P)                                                 \
ATTR void NAME(const int fmt, const uint8_t *row0, ptrdiff_t rs, ptrdiff_t n, ptrdiff_t cols, \
               ptrdiff_t group, const float *q, float *out)                                  \
{                                                                                            \
    enum { L = COLIBRI_TMV_OP(P, L), NV = 64 / L, NW = 32 / L };                             \
    const int quant = fmt == COLIBRI_Q8 || fmt == COLIBRI_Q4;                                \
    const ptrdiff_t codes = fmt == COLIBRI_Q4 ? cols / 2 : cols;    /* scales follow codes */ \
    ptrdiff_t c0, i;                                                                         \
    int b, k;                                                                                \
    for (c0 = 0; c0 < cols; c0 += 64) {                                                      \
        COLIBRI_TMV_OP(P, V) a[NV];                                                          \
        for (k = 0; k < NV; k++) a[k] = COLIBRI_TMV_OP(P, ZERO)();                           \
        for (i = 0; i < n; i++) {                                                            \
            const uint8_t *row = row0 + i * rs;                                              \
            const COLIBRI_TMV_OP(P, V) qv = COLIBRI_TMV_OP(P, SET1)(q[i]);                   \
            if (i + 2 < n)                                                                   \
                __builtin_prefetch(row + 2 * rs + (fmt == COLIBRI_Q4 ? c0 / 2 : c0), 0, 3);  \
            if (quant) {                                                                     \
                for (b = 0; b < 2; b++) {                                                    \
                    const ptrdiff_t c = c0 + 32 * b;                                         \
                    const float sc = _cvtsh_ss(colibri_ld_u16(row + codes + 2 * (c / group))); \
                    const COLIBRI_TMV_OP(P, V) sv = COLIBRI_TMV_OP(P, SET1)(sc);             \
                    const COLIBRI_TMV_OP(P, V) ov = COLIBRI_TMV_OP(P, SET1)(-8.0f * sc);     \
                    COLIBRI_TMV_OP(P, V) w[NW];                                              \
                    COLIBRI_TMV_OP(P, CODES32)(fmt, row + (fmt == COLIBRI_Q4 ? c / 2 : c), w); \
                    for (k = 0; k < NW; k++)                                                 \
                        a[NW * b + k] = COLIBRI_TMV_OP(P, FMA)(                              \
                            qv, fmt == COLIBRI_Q4 ? COLIBRI_TMV_OP(P, FMA)(w[k], sv, ov)     \
                                                  : COLIBRI_TMV_OP(P, MUL)(w[k], sv),        \
                            a[NW * b + k]);                                                  \
                }                                                                            \
            } else {                                                                         \
                for (k = 0; k < NV; k++)                                                     \
                    a[k] = COLIBRI_TMV_OP(P, FMA)(qv, COLIBRI_TMV_OP(P, PLAIN)(fmt, row,     \
                                                                               c0 + L * k), \
                                                  a[k]);                                     \
            }                                                                                \
        }                                                                                    \
        for (k = 0; k < NV; k++) COLIBRI_TMV_OP(P, STORE)(out + c0 + L * k, a[k]);           \
    }                                                                                        \
}

#define COLIBRI_TMV256_V __m256
#define COLIBRI_TMV256_L 8
#define COLIBRI_TMV256_ZERO _mm256_setzero_ps
#define COLIBRI_TMV256_SET1 _mm256_set1_ps
#define COLIBRI_TMV256_FMA _mm256_fmadd_ps
#define COLIBRI_TMV256_MUL _mm256_mul_ps
#define COLIBRI_TMV256_STORE _mm256_storeu_ps
#define COLIBRI_TMV256_CODES32 colibri_codes32_avx2
#define COLIBRI_TMV256_PLAIN colibri_load8_avx2
COLIBRI_TMV_REGS_BODY(colibri_tmv_regs_avx2_body, COLIBRI_AVX2_INLINE, 256)

#define COLIBRI_DEF_TMV_AVX2(name, FMT)                                                      \
    COLIBRI_AVX2_FN void name(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t n, ptrdiff_t cols,\
                              ptrdiff_t group, const float *q, float *out, float *panel)     \
    {                                                                                        \
        if (FMT != COLIBRI_MXFP4 && cols % 64 == 0)                                          \
            colibri_tmv_regs_avx2_body(FMT, row0, rs, n, cols, group, q, out);               \
        else                                                                                 \
            colibri_tmv_avx2_body(FMT, row0, rs, n, cols, group, q, out, panel);             \
    }
COLIBRI_DEF_TMV_AVX2(colibri_tmv_f32_avx2, COLIBRI_F32)
COLIBRI_DEF_TMV_AVX2(colibri_tmv_f16_avx2, COLIBRI_F16)
COLIBRI_DEF_TMV_AVX2(colibri_tmv_bf16_avx2, COLIBRI_BF16)
COLIBRI_DEF_TMV_AVX2(colibri_tmv_q8_avx2, COLIBRI_Q8)
COLIBRI_DEF_TMV_AVX2(colibri_tmv_q4_avx2, COLIBRI_Q4)
COLIBRI_DEF_TMV_AVX2(colibri_tmv_mxfp4_avx2, COLIBRI_MXFP4)

/* The register body on 16 lanes (COLIBRI_TMV_REGS_BODY): the same bits as the AVX2 bodies. */
#define COLIBRI_TMV512_V __m512
#define COLIBRI_TMV512_L 16
#define COLIBRI_TMV512_ZERO _mm512_setzero_ps
#define COLIBRI_TMV512_SET1 _mm512_set1_ps
#define COLIBRI_TMV512_FMA _mm512_fmadd_ps
#define COLIBRI_TMV512_MUL _mm512_mul_ps
#define COLIBRI_TMV512_STORE _mm512_storeu_ps
#define COLIBRI_TMV512_CODES32 colibri_codes32_avx512
#define COLIBRI_TMV512_PLAIN(fmt, row, c) colibri_load16_avx512(fmt, row, c, (__mmask16)0xFFFF)
COLIBRI_TMV_REGS_BODY(colibri_tmv_avx512_body, COLIBRI_AVX512_INLINE, 512)

#define COLIBRI_DEF_TMV_AVX512(name, FMT)                                                    \
    COLIBRI_AVX512_FN void name(const uint8_t *row0, ptrdiff_t rs, ptrdiff_t n,             \
                                ptrdiff_t cols, ptrdiff_t group, const float *q, float *out) \
    {                                                                                        \
        colibri_tmv_avx512_body(FMT, row0, rs, n, cols, group, q, out);                      \
    }
COLIBRI_DEF_TMV_AVX512(colibri_tmv_f32_avx512, COLIBRI_F32)
COLIBRI_DEF_TMV_AVX512(colibri_tmv_f16_avx512, COLIBRI_F16)
COLIBRI_DEF_TMV_AVX512(colibri_tmv_bf16_avx512, COLIBRI_BF16)
COLIBRI_DEF_TMV_AVX512(colibri_tmv_q8_avx512, COLIBRI_Q8)
COLIBRI_DEF_TMV_AVX512(colibri_tmv_q4_avx512, COLIBRI_Q4)
#endif /* COLIBRI_X86 */

/* colibri_tmv on path isa; panel as the AVX2 body's (unused by the scalar one). */
static inline void colibri_tmv(int isa, int fmt, const uint8_t *row0, ptrdiff_t rs,
                               ptrdiff_t n, ptrdiff_t cols, ptrdiff_t group, const float *q,
                               float *out, float *panel)
{
#if COLIBRI_X86
    if (colibri_isa_base(isa) == COLIBRI_ISA_AVX512 && cols % 64 == 0) {
        switch (fmt) {
        case COLIBRI_F32: colibri_tmv_f32_avx512(row0, rs, n, cols, group, q, out); return;
        case COLIBRI_F16: colibri_tmv_f16_avx512(row0, rs, n, cols, group, q, out); return;
        case COLIBRI_BF16: colibri_tmv_bf16_avx512(row0, rs, n, cols, group, q, out); return;
        case COLIBRI_Q8: colibri_tmv_q8_avx512(row0, rs, n, cols, group, q, out); return;
        case COLIBRI_Q4: colibri_tmv_q4_avx512(row0, rs, n, cols, group, q, out); return;
        default: break;
        }
    }
    if (colibri_isa_base(isa) != COLIBRI_ISA_SCALAR) {
        switch (fmt) {
        case COLIBRI_F32: colibri_tmv_f32_avx2(row0, rs, n, cols, group, q, out, panel); return;
        case COLIBRI_F16: colibri_tmv_f16_avx2(row0, rs, n, cols, group, q, out, panel); return;
        case COLIBRI_BF16:
            colibri_tmv_bf16_avx2(row0, rs, n, cols, group, q, out, panel);
            return;
        case COLIBRI_Q8: colibri_tmv_q8_avx2(row0, rs, n, cols, group, q, out, panel); return;
        case COLIBRI_Q4: colibri_tmv_q4_avx2(row0, rs, n, cols, group, q, out, panel); return;
        case COLIBRI_MXFP4:
            colibri_tmv_mxfp4_avx2(row0, rs, n, cols, group, q, out, panel);
            return;
        default: break;
        }
    }
#endif
    (void)isa;
    (void)panel;
    colibri_tmv_scalar(fmt, row0, rs, n, cols, group, q, out);
}

/* ------------------------------------------------------------------------------------------
 * The latent attention: nh query heads ql (nh, R), qr (nh, Dr) over positions j < n of the
 * latent rows lat (row j at element j * R) and the rotary rows rot (row j at j * Dr), cache
 * format fmt, into ol (nh, R); s: nh * n floats of scratch.
 */
static void colibri_mla_attend_scalar(int fmt, const float *ql, const float *qr, int R, int Dr,
                                      const void *lat, const void *rot, ptrdiff_t n,
                                      float scale, float *s, float *ol, int nh)
{
    const ptrdiff_t es = colibri_kv_size(fmt);
    int h, i;
    ptrdiff_t j;
    for (h = 0; h < nh; h++) {
        const float *qh = ql + (ptrdiff_t)h * R, *rh = qr + (ptrdiff_t)h * Dr;
        float *oh = ol + (ptrdiff_t)h * R, *sh = s + h * n;
        float m = -INFINITY, sum = 0.0f, inv;
        for (j = 0; j < n; j++) {
            const char *cj = (const char *)lat + j * R * es, *kj = (const char *)rot + j * Dr * es;
            float a = 0.0f, b = 0.0f;
            for (i = 0; i < R; i++) a += qh[i] * colibri_kv_elem(fmt, cj, i);
            for (i = 0; i < Dr; i++) b += rh[i] * colibri_kv_elem(fmt, kj, i);
            sh[j] = (a + b) * scale;
            m = sh[j] > m || sh[j] != sh[j] ? sh[j] : m;     /* a NaN score wins */
        }
        for (j = 0; j < n; j++) {
            sh[j] = expf(sh[j] - m);
            sum += sh[j];
        }
        inv = 1.0f / sum;
        for (i = 0; i < R; i++) oh[i] = 0.0f;
        for (j = 0; j < n; j++) {
            const char *cj = (const char *)lat + j * R * es;
            for (i = 0; i < R; i++) oh[i] += sh[j] * colibri_kv_elem(fmt, cj, i);
        }
        for (i = 0; i < R; i++) oh[i] *= inv;
    }
}

#if COLIBRI_X86
/* The score pass of both SIMD bodies: s[h, j] = (q_lat[h] . lat[j] + q_rope[h] . rot[j]) *
 * scale for the nh heads over the n cached positions, block by block, so the heads share each
 * block of COLIBRI_ATTEND_BLOCK rows; attend.h's score helpers of ISA (avx2, avx512). */
#define COLIBRI_DEF_MLA_SCORES(ISA, ATTR)                                                     \
ATTR void colibri_mla_scores_##ISA(const int fmt, const float *ql, const float *qr, int R,    \
                                   int Dr, const char *L0, const char *K0, ptrdiff_t rb,      \
                                   ptrdiff_t kb, ptrdiff_t n, float scale, float *s, int nh) \
{                                                                                             \
    int h;                                                                                    \
    ptrdiff_t j, jb, je;                                                                      \
    for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {                                        \
        je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;                   \
        for (h = 0; h < nh; h++) {                                                            \
            const float *qh = ql + (ptrdiff_t)h * R, *rh = qr + (ptrdiff_t)h * Dr;            \
            float *sh = s + h * n;                                                            \
            for (j = jb; j + 8 <= je; j += 8) {                                               \
                if (h == 0) {                                                                 \
                    colibri_prefetch_rows(L0, j + COLIBRI_ATTEND_AHEAD, 8, n, rb, rb);        \
                    colibri_prefetch_rows(K0, j + COLIBRI_ATTEND_AHEAD, 8, n, kb, kb);        \
                }                                                                             \
                _mm256_storeu_ps(sh + j, _mm256_mul_ps(                                       \
                    _mm256_add_ps(colibri_scores8_##ISA(fmt, qh, L0 + j * rb, rb, R, 1.0f),   \
                                  colibri_scores8_##ISA(fmt, rh, K0 + j * kb, kb, Dr, 1.0f)), \
                    _mm256_set1_ps(scale)));                                                  \
            }                                                                                 \
            for (; j < je; j++)                                                               \
                sh[j] = (colibri_score1_##ISA(fmt, qh, L0 + j * rb, R, 1.0f) +                \
                         colibri_score1_##ISA(fmt, rh, K0 + j * kb, Dr, 1.0f)) * scale;       \
        }                                                                                     \
    }                                                                                         \
}
COLIBRI_DEF_MLA_SCORES(avx2, COLIBRI_AVX2_INLINE)
COLIBRI_DEF_MLA_SCORES(avx512, COLIBRI_AVX512_INLINE)

/* R and Dr multiples of 8. The heads share each block of COLIBRI_ATTEND_BLOCK positions: the
 * block's rows come from memory once for all nh heads. */
COLIBRI_AVX2_INLINE void colibri_mla_attend_avx2_body(const int fmt, const float *ql,
                                                      const float *qr, int R, int Dr,
                                                      const void *lat, const void *rot,
                                                      ptrdiff_t n, float scale, float *s,
                                                      float *ol, int nh)
{
    const ptrdiff_t es = colibri_kv_size(fmt), rb = R * es, kb = Dr * es;
    const char *L0 = (const char *)lat, *K0 = (const char *)rot;
    float inv[COLIBRI_MLA_MAX_HEADS];
    int h, i;
    ptrdiff_t j, jb, je;
    colibri_mla_scores_avx2(fmt, ql, qr, R, Dr, L0, K0, rb, kb, n, scale, s, nh);
    for (h = 0; h < nh; h++) {                                          /* softmax numerators */
        inv[h] = 1.0f / colibri_softmax_num_avx2(s + h * n, n);
        for (i = 0; i < R; i += 8) _mm256_storeu_ps(ol + (ptrdiff_t)h * R + i, _mm256_setzero_ps());
    }
    for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {                  /* weighted latents */
        je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
        for (h = 0; h < nh; h++) {
            const float *sh = s + h * n;
            float *oh = ol + (ptrdiff_t)h * R;
            for (i = 0; i + 32 <= R; i += 32) {
                __m256 o0 = _mm256_loadu_ps(oh + i), o1 = _mm256_loadu_ps(oh + i + 8);
                __m256 o2 = _mm256_loadu_ps(oh + i + 16), o3 = _mm256_loadu_ps(oh + i + 24);
                for (j = jb; j < je; j++) {
                    const __m256 p = _mm256_broadcast_ss(sh + j);
                    const char *cj = L0 + j * rb;
                    o0 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, cj, i), o0);
                    o1 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, cj, i + 8), o1);
                    o2 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, cj, i + 16), o2);
                    o3 = _mm256_fmadd_ps(p, colibri_kv_load8(fmt, cj, i + 24), o3);
                }
                _mm256_storeu_ps(oh + i, o0);
                _mm256_storeu_ps(oh + i + 8, o1);
                _mm256_storeu_ps(oh + i + 16, o2);
                _mm256_storeu_ps(oh + i + 24, o3);
            }
            for (; i < R; i += 8) {
                __m256 o0 = _mm256_loadu_ps(oh + i);
                for (j = jb; j < je; j++)
                    o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sh + j),
                                         colibri_kv_load8(fmt, L0 + j * rb, i), o0);
                _mm256_storeu_ps(oh + i, o0);
            }
        }
    }
    for (h = 0; h < nh; h++) {
        const __m256 iv = _mm256_set1_ps(inv[h]);
        float *oh = ol + (ptrdiff_t)h * R;
        for (i = 0; i < R; i += 8)
            _mm256_storeu_ps(oh + i, _mm256_mul_ps(_mm256_loadu_ps(oh + i), iv));
    }
}

/* R and Dr multiples of 16: the AVX2 body's structure on 16 lanes (attend.h's AVX-512
 * score helpers; a latent row is widened once per 64 columns for the pass). */
COLIBRI_AVX512_INLINE void colibri_mla_attend_avx512_body(const int fmt, const float *ql,
                                                          const float *qr, int R, int Dr,
                                                          const void *lat, const void *rot,
                                                          ptrdiff_t n, float scale, float *s,
                                                          float *ol, int nh)
{
    const ptrdiff_t es = colibri_kv_size(fmt), rb = R * es, kb = Dr * es;
    const char *L0 = (const char *)lat, *K0 = (const char *)rot;
    float inv[COLIBRI_MLA_MAX_HEADS];
    int h, i;
    ptrdiff_t j, jb, je;
    colibri_mla_scores_avx512(fmt, ql, qr, R, Dr, L0, K0, rb, kb, n, scale, s, nh);
    for (h = 0; h < nh; h++) {
        inv[h] = 1.0f / colibri_softmax_num_avx2(s + h * n, n);
        for (i = 0; i < R; i += 16)
            _mm512_storeu_ps(ol + (ptrdiff_t)h * R + i, _mm512_setzero_ps());
    }
    for (jb = 0; jb < n; jb += COLIBRI_ATTEND_BLOCK) {                  /* weighted latents */
        je = jb + COLIBRI_ATTEND_BLOCK < n ? jb + COLIBRI_ATTEND_BLOCK : n;
        for (h = 0; h < nh; h++) {
            const float *sh = s + h * n;
            float *oh = ol + (ptrdiff_t)h * R;
            for (i = 0; i + 64 <= R; i += 64) {
                __m512 o0 = _mm512_loadu_ps(oh + i), o1 = _mm512_loadu_ps(oh + i + 16);
                __m512 o2 = _mm512_loadu_ps(oh + i + 32), o3 = _mm512_loadu_ps(oh + i + 48);
                for (j = jb; j < je; j++) {
                    const __m512 p = _mm512_set1_ps(sh[j]);
                    const char *cj = L0 + j * rb;
                    o0 = _mm512_fmadd_ps(p, colibri_kv_load16(fmt, cj, i), o0);
                    o1 = _mm512_fmadd_ps(p, colibri_kv_load16(fmt, cj, i + 16), o1);
                    o2 = _mm512_fmadd_ps(p, colibri_kv_load16(fmt, cj, i + 32), o2);
                    o3 = _mm512_fmadd_ps(p, colibri_kv_load16(fmt, cj, i + 48), o3);
                }
                _mm512_storeu_ps(oh + i, o0);
                _mm512_storeu_ps(oh + i + 16, o1);
                _mm512_storeu_ps(oh + i + 32, o2);
                _mm512_storeu_ps(oh + i + 48, o3);
            }
            for (; i < R; i += 16) {
                __m512 o0 = _mm512_loadu_ps(oh + i);
                for (j = jb; j < je; j++)
                    o0 = _mm512_fmadd_ps(_mm512_set1_ps(sh[j]),
                                         colibri_kv_load16(fmt, L0 + j * rb, i), o0);
                _mm512_storeu_ps(oh + i, o0);
            }
        }
    }
    for (h = 0; h < nh; h++) {
        const __m512 iv = _mm512_set1_ps(inv[h]);
        float *oh = ol + (ptrdiff_t)h * R;
        for (i = 0; i < R; i += 16)
            _mm512_storeu_ps(oh + i, _mm512_mul_ps(_mm512_loadu_ps(oh + i), iv));
    }
}

#define COLIBRI_DEF_MLA_ATTEND(name, BODY, FN, FMT)                                          \
    FN void name(const float *ql, const float *qr, int R, int Dr, const void *lat,            \
                 const void *rot, ptrdiff_t n, float scale, float *s, float *ol, int nh)      \
    {                                                                                        \
        BODY(FMT, ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);                             \
    }
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_f32_avx2, colibri_mla_attend_avx2_body,
                       COLIBRI_AVX2_FN, COLIBRI_F32)
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_f16_avx2, colibri_mla_attend_avx2_body,
                       COLIBRI_AVX2_FN, COLIBRI_F16)
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_bf16_avx2, colibri_mla_attend_avx2_body,
                       COLIBRI_AVX2_FN, COLIBRI_BF16)
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_f32_avx512, colibri_mla_attend_avx512_body,
                       COLIBRI_AVX512_FN, COLIBRI_F32)
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_f16_avx512, colibri_mla_attend_avx512_body,
                       COLIBRI_AVX512_FN, COLIBRI_F16)
COLIBRI_DEF_MLA_ATTEND(colibri_mla_attend_bf16_avx512, colibri_mla_attend_avx512_body,
                       COLIBRI_AVX512_FN, COLIBRI_BF16)
#endif /* COLIBRI_X86 */

/* The latent attention on path isa (nh <= COLIBRI_MLA_MAX_HEADS): AVX-512 bodies on the
 * avx512 paths when R and Dr are multiples of 16, AVX2 bodies on every SIMD path when they
 * are multiples of 8, else the scalar body. */
static inline void colibri_mla_attend(int isa, int fmt, const float *ql, const float *qr,
                                      int R, int Dr, const void *lat, const void *rot,
                                      ptrdiff_t n, float scale, float *s, float *ol, int nh)
{
#if COLIBRI_X86
    const int base = colibri_isa_base(isa);
    if (base == COLIBRI_ISA_AVX512 && R % 16 == 0 && Dr % 16 == 0) {
        if (fmt == COLIBRI_F16)
            colibri_mla_attend_f16_avx512(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        else if (fmt == COLIBRI_BF16)
            colibri_mla_attend_bf16_avx512(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        else
            colibri_mla_attend_f32_avx512(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        return;
    }
    if (base != COLIBRI_ISA_SCALAR && R % 8 == 0 && Dr % 8 == 0) {
        if (fmt == COLIBRI_F16)
            colibri_mla_attend_f16_avx2(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        else if (fmt == COLIBRI_BF16)
            colibri_mla_attend_bf16_avx2(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        else
            colibri_mla_attend_f32_avx2(ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
        return;
    }
#endif
    (void)isa;
    colibri_mla_attend_scalar(fmt, ql, qr, R, Dr, lat, rot, n, scale, s, ol, nh);
}

#endif /* COLIBRI_MLA_H */
