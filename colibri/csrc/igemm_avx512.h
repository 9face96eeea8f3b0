/* csrc/igemm_avx512.h: the AVX-512 VNNI micro-kernel of the integer GEMM (igemm.h) and its
 * entry points. Not a header of its own: igemm.h includes it inside its COLIBRI_VNNI section,
 * after the panel decoder and the shared driver (COLIBRI_DEF_IGEMM_SIMD, COLIBRI_DEF_IMK)
 * it builds on, and before the table (colibri_igemm_for) that names its functions. */
#ifndef COLIBRI_IGEMM_AVX512_H
#define COLIBRI_IGEMM_AVX512_H

/* ------------------------------------------------------------------------------------------
 * AVX-512 VNNI (EVEX, 32 registers): vectors of 16 rows, up to 4 tokens x 3 vectors (the
 * whole 48-row panel): 12 int32 and 12 f32 accumulators, 3 weight vectors; per step 3
 * weight loads and 4 broadcasts feed 12 vpdpbusd (int16 codes: two steps per 4 columns,
 * the split scheme below; it measured as fast as vpdpwssd on 2-column steps from 32
 * tokens and faster below, its u8 panel needing no widening).
 */
/* The split int16 scheme (AVX-512 VNNI; vpdpwssd does half of vpdpbusd's products per
 * instruction at no higher throughput): a = 256 hi + lo' + 128 with hi = a >> 8 and lo' =
 * (a & 255) - 128, both s8, so against the u8 panel codes u (the int8 panel: q4 nibble, q8
 * w + 128), sum u a = 256 sum u hi + sum u lo' + 128 N (N = sum u, the decoder's code sums),
 * and the signed block sum is that less s (q4) or 16 s (q8), as for int8 codes. |256 sum u
 * hi| <= 256 * 32 * 255 * 128 < 2^31: exact. Per token the chunk's codes are split once per
 * token block into hi bytes (rq + 512 t) and lo' bytes (+ 256), at the int16 positions of
 * the packed row (4 consecutive codes of a step stay 4 consecutive bytes). */
COLIBRI_AVX512VNNI_INLINE void colibri_irepack_avx512(const int8_t *q, ptrdiff_t qs, int mt,
                                                      int kb, int8_t *rq)
{
    const __m256i m80 = _mm256_set1_epi8((char)0x80);
    int t, i;
    for (t = 0; t < mt; t++) {
        const int16_t *src = (const int16_t *)(const void *)(q + t * qs);
        for (i = 0; i < 64 * ((kb + 1) / 2); i += 32) {
            const __m512i v = _mm512_loadu_si512((const void *)(src + i));
            _mm256_storeu_si256((__m256i *)(void *)(rq + 512 * t + i),
                                _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
            _mm256_storeu_si256((__m256i *)(void *)(rq + 512 * t + 256 + i),
                                _mm256_xor_si256(_mm512_cvtepi16_epi8(v), m80));
        }
    }
}

COLIBRI_AVX512VNNI_INLINE void colibri_imk_avx512vnni_body(
    const int fmt, const int WIDE, const uint8_t *panel, const float *sc, int kb,
    const int8_t *q, ptrdiff_t qs, const float *d, const int32_t *s, ptrdiff_t ds, float *acc,
    const int MT, const int MRV)
{
    const int32_t *ns = (const int32_t *)(const void *)(sc + COLIBRI_IGEMM_NR * (COLIBRI_IGEMM_KC / 32));
    __m512 fa[4][3];
    int j, k, t, v;
    for (t = 0; t < MT; t++)
        for (v = 0; v < MRV; v++) fa[t][v] = _mm512_loadu_ps(acc + t * COLIBRI_IGEMM_NR + 16 * v);
    for (j = 0; j < kb; j++) {
        const int dp = (int)colibri_dpos(j);
        /* each token's codes of block j (the step offsets below are constants) */
        const ptrdiff_t jo = WIDE ? COLIBRI_IQ16_OFF(j, 0) / 2 : COLIBRI_IQ8_OFF(j, 0);
        const int8_t *qb[4];
        __m512i ia[4][3];
        for (t = 0; t < MT; t++) qb[t] = q + t * qs + jo;
        for (t = 0; t < MT; t++)
            for (v = 0; v < MRV; v++) ia[t][v] = _mm512_setzero_si512();
        if (!WIDE) {
            for (k = 0; k < 8; k++) {
                const uint8_t *pw = panel + (8 * j + k) * 4 * COLIBRI_IGEMM_NR;
                __m512i w[3];
                for (v = 0; v < MRV; v++) w[v] = _mm512_load_si512((const void *)(pw + 64 * v));
                for (t = 0; t < MT; t++) {
                    const __m512i a = _mm512_set1_epi32(
                        colibri_ld_i32(qb[t] + COLIBRI_IQ8_OFF(0, k)));
                    for (v = 0; v < MRV; v++) ia[t][v] = _mm512_dpbusd_epi32(ia[t][v], w[v], a);
                }
            }
        } else {                 /* split int16: 256 x (u . hi) then + u . lo', in ia */
            int h;
            for (h = 0; h < 2; h++) {
                if (h)
                    for (t = 0; t < MT; t++)
                        for (v = 0; v < MRV; v++) ia[t][v] = _mm512_slli_epi32(ia[t][v], 8);
                for (k = 0; k < 8; k++) {
                    const uint8_t *pw = panel + (8 * j + k) * 4 * COLIBRI_IGEMM_NR;
                    __m512i w[3];
                    for (v = 0; v < MRV; v++) w[v] = _mm512_load_si512((const void *)(pw + 64 * v));
                    for (t = 0; t < MT; t++) {
                        const __m512i a = _mm512_set1_epi32(colibri_ld_i32(
                            qb[t] + 256 * h + COLIBRI_IQ16_OFF(0, 2 * k) / 2));
                        for (v = 0; v < MRV; v++) ia[t][v] = _mm512_dpbusd_epi32(ia[t][v], w[v], a);
                    }
                }
            }
            for (t = 0; t < MT; t++)                              /* + 128 N */
                for (v = 0; v < MRV; v++)
                    ia[t][v] = _mm512_add_epi32(ia[t][v], _mm512_slli_epi32(_mm512_loadu_si512(
                        (const void *)(ns + j * COLIBRI_IGEMM_NR + 16 * v)), 7));
        }
        for (t = 0; t < MT; t++) {
            const int st = s[t * ds + dp];
            const int corr = fmt == COLIBRI_Q4 ? st : fmt == COLIBRI_MXFP4 ? st + (st >> 1) : 16 * st;
            const __m512 dv = _mm512_set1_ps(d[t * ds + dp]);
            for (v = 0; v < MRV; v++) {
                __m512i i = ia[t][v];
                i = _mm512_sub_epi32(i, _mm512_set1_epi32(corr));
                fa[t][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i),
                    _mm512_mul_ps(_mm512_loadu_ps(sc + j * COLIBRI_IGEMM_NR + 16 * v), dv),
                    fa[t][v]);
            }
        }
    }
    for (t = 0; t < MT; t++)
        for (v = 0; v < MRV; v++) _mm512_storeu_ps(acc + t * COLIBRI_IGEMM_NR + 16 * v, fa[t][v]);
}
COLIBRI_DEF_IMK(colibri_imk_avx512vnni, COLIBRI_AVX512VNNI_INLINE, colibri_imk_avx512vnni_body,
                3, 4)

#define COLIBRI_DEF_IGEMM_AVX512VNNI(NAME, FMT, WIDE)                                        \
    COLIBRI_DEF_IGEMM_SIMD(NAME, COLIBRI_AVX512VNNI_FN, FMT, WIDE, COLIBRI_IPANEL_U8,       \
                           colibri_imk_avx512vnni, 16, 3, 4, 1, colibri_irepack_avx512)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm_q8_avx512vnni, COLIBRI_Q8, 0)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm_q4_avx512vnni, COLIBRI_Q4, 0)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm16_q8_avx512vnni, COLIBRI_Q8, 1)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm16_q4_avx512vnni, COLIBRI_Q4, 1)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm_mx_avx512vnni, COLIBRI_MXFP4, 0)
COLIBRI_DEF_IGEMM_AVX512VNNI(colibri_igemm16_mx_avx512vnni, COLIBRI_MXFP4, 1)

#endif /* COLIBRI_IGEMM_AVX512_H */
