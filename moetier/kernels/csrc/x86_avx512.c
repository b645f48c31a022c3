/* The AVX-512 path (x86-64 with AVX-512 F/BW/VL/DQ, FMA, F16C; the fused decode kernel
 * also needs VBMI). The same bits as generic.c: see the contract in mt.h. */
#include <stdlib.h>
#include <string.h>

#include "mt.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))


MT_AVX512 static inline float hsum16_avx512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);                                                 /* i, i+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* i, i+4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                 /* i, i+2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                          /* 0, 1 */
}

/* hsum16_avx512 of eight vectors at once, into lanes 0-7: the same additions, the same operands
 * in the same order (each row's tree: i + 8, i + 4, i + 2, i + 1), rows side by side. */
MT_AVX512 static inline __m512 hsum16x8_avx512(const __m512 v[8]) {
    __m512 s8[4], s4[2];
    for (int i = 0; i < 4; i++) /* rows 2i (lanes 0-7) and 2i + 1 (8-15): lo + hi */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* rows 4i .. 4i + 3, four lanes each: i + 4 */
        s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* per 128 bits k: rows k (lanes 0, 1) and 4 + k (2, 3): i + 2 */
    const __m512 s2 = _mm512_add_ps(_mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* i + 1: row k at lane 4k, row 4 + k at 4k + 1 */
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2, s2, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), s1);
}

MT_AVX512 static inline __attribute__((always_inline)) void
tile_avx512_tb(const int tb, const float *const *xr, const float *const *wr, int64_t n,
               float out[TBMAX][RB]) {
    __m512 acc[TBMAX][RB];
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < RB; i++) acc[j][i] = _mm512_setzero_ps();
    const int64_t nfull = n & ~(int64_t)15;
    for (int64_t c = 0; c < nfull; c += 16) {
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm512_loadu_ps(wr[i] + c);
        for (int j = 0; j < tb; j++) {
            __m512 xv = _mm512_loadu_ps(xr[j] + c);
            for (int i = 0; i < RB; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
        }
    }
    if (nfull < n) {
        __mmask16 m = (__mmask16)((1u << (n - nfull)) - 1u);
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm512_maskz_loadu_ps(m, wr[i] + nfull);
        for (int j = 0; j < tb; j++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xr[j] + nfull);
            for (int i = 0; i < RB; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
        }
    }
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < RB; i++) out[j][i] = hsum16_avx512(acc[j][i]);
}

MT_AVX512 static void tile_avx512(int tb, const float *const *xr, const float *const *wr, int64_t n,
                                  float out[TBMAX][RB]) {
    switch (tb) {
    case 1: tile_avx512_tb(1, xr, wr, n, out); break;
    case 2: tile_avx512_tb(2, xr, wr, n, out); break;
    case 3: tile_avx512_tb(3, xr, wr, n, out); break;
    default: tile_avx512_tb(4, xr, wr, n, out); break;
    }
}

MT_AVX512 static inline __m512 exp_avx512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C1), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_C2), r);
    const __m512 z = _mm512_mul_ps(r, r);
    __m512 y = _mm512_set1_ps(EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P5));
    y = _mm512_fmadd_ps(y, z, r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    __m512 res = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(e)), _mm512_set1_ps(2.0f));
    res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ), _mm512_setzero_ps());
    res = _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_HI), _CMP_GT_OQ),
                             _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(res, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* y[i] = exp(x[i] - m) */
MT_AVX512 static void exp_shift_avx512(const float *x, float m, int64_t n, float *y) {
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, k, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
    }
}

/* g[i] = (g / (1 + exp(-g))) * u[i] */
MT_AVX512 static void swiglu_avx512(float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
        const __m512 sl = _mm512_div_ps(gv, _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(zero, gv))));
        _mm512_mask_storeu_ps(g + i, k, _mm512_mul_ps(sl, _mm512_maskz_loadu_ps(k, u + i)));
    }
}

MT_AVX512 static float sum_avx512(const float *a, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    const int64_t nfull = n & ~(int64_t)15;
    for (int64_t k = 0; k < nfull; k += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(a + k));
    if (nfull < n) {
        __mmask16 m = (__mmask16)((1u << (n - nfull)) - 1u);
        acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, a + nfull));
    }
    return hsum16_avx512(acc);
}

/* int4, group size a multiple of 32: 16 bytes -> 32 columns at a time. Nibble n maps
 * through a 16-entry table (n - 8) * scale, i.e. exactly (float)q * scale. */
MT_AVX512 static void dequant_int4_avx512(const qmat *w, int64_t r, float *buf) {
    const uint8_t *row = w->data + r * w->row_bytes;
    const uint16_t *s = w->scales + r * w->ngroups;
    const __m512 nib = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const int64_t bytes_per_group = w->g / 2;
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const __m512 table = _mm512_mul_ps(nib, _mm512_set1_ps(_cvtsh_ss(s[gi])));
        const uint8_t *q = row + gi * bytes_per_group;
        float *o = buf + gi * w->g;
        for (int64_t b = 0; b < bytes_per_group; b += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(q + b));
            __m128i lo = _mm_and_si128(v, lo4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
            __m128i n0 = _mm_unpacklo_epi8(lo, hi); /* columns 0..15 of the 32 */
            __m128i n1 = _mm_unpackhi_epi8(lo, hi); /* columns 16..31 */
            _mm512_storeu_ps(o + 2 * b, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(n0), table));
            _mm512_storeu_ps(o + 2 * b + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(n1), table));
        }
    }
}

/* mxfp4: like int4 g32 -- 16 bytes -> the group's 32 columns; nibble n maps through the
 * 16-entry table e2m1(n) * scale (the products of mt.h, -0 kept). */
MT_AVX512 static void dequant_mxfp4_avx512(const qmat *w, int64_t r, float *buf) {
    const uint8_t *row = w->data + r * w->row_bytes;
    const uint8_t *es = w->escales + r * w->ngroups;
    const __m512 e2m1 = _mm512_loadu_ps(mt_e2m1);
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const __m512 table = _mm512_mul_ps(e2m1, _mm512_set1_ps(mt_e8m0(es[gi])));
        const __m128i v = _mm_loadu_si128((const __m128i *)(row + gi * (MT_MX_GROUP / 2)));
        const __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
        float *o = buf + gi * MT_MX_GROUP;
        _mm512_storeu_ps(o, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table));
        _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table));
    }
}

/* int8, group size a multiple of 16. */
MT_AVX512 static void dequant_int8_avx512(const qmat *w, int64_t r, float *buf) {
    const int8_t *row = (const int8_t *)(w->data + r * w->row_bytes);
    const uint16_t *s = w->scales + r * w->ngroups;
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const __m512 sc = _mm512_set1_ps(_cvtsh_ss(s[gi]));
        for (int64_t c = gi * w->g; c < (gi + 1) * w->g; c += 16) {
            __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c)));
            _mm512_storeu_ps(buf + c, _mm512_mul_ps(_mm512_cvtepi32_ps(q), sc));
        }
    }
}

MT_AVX512 static void dequant_bf16_avx512(const qmat *w, int64_t r, float *buf) {
    const uint16_t *row = (const uint16_t *)(w->data + r * w->row_bytes);
    const int64_t C = w->cols, nfull = C & ~(int64_t)15;
    for (int64_t c = 0; c < nfull; c += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + c)));
        _mm512_storeu_ps(buf + c, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
    for (int64_t c = nfull; c < C; c++) {
        uint32_t bits = (uint32_t)row[c] << 16;
        memcpy(&buf[c], &bits, 4);
    }
}

MT_AVX512 static void pv_avx512(int nh, const float *const *p, const float *v, int64_t vstride,
                                int64_t s0, int64_t s1, int64_t dv, float *const *acc) {
    /* 4 heads x 4 chunks of 16 values in registers; s runs innermost, in order */
    for (int64_t d0 = 0; d0 < dv; d0 += 64) {
        int nc = (int)((dv - d0 + 15) / 16);
        if (nc > 4) nc = 4;
        __mmask16 mk[4];
        for (int c = 0; c < 4; c++) {
            int64_t left = dv - d0 - 16 * c;
            mk[c] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
        }
        __m512 a[4][4];
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < 4; c++)
                a[h][c] = h < nh ? _mm512_maskz_loadu_ps(mk[c], acc[h] + d0 + 16 * c) : _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s++) {
            const float *vr = v + s * vstride + d0;
            __m512 vv[4];
            for (int c = 0; c < 4; c++) vv[c] = _mm512_maskz_loadu_ps(mk[c], vr + 16 * c);
            for (int h = 0; h < nh; h++) {
                __m512 ps = _mm512_set1_ps(p[h][s]);
                for (int c = 0; c < 4; c++) a[h][c] = _mm512_fmadd_ps(ps, vv[c], a[h][c]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(acc[h] + d0 + 16 * c, mk[c], a[h][c]);
    }
}

/* Fused dequantize-and-dot for up to four tokens (the decode case): each 16-column chunk
 * of the four weight rows is dequantized in registers -- exactly the values the buffer
 * path stores -- and used at once, so no buffer round trip. Same accumulators, same
 * operations in the same order as tile() over dequantized rows: same bits.
 * int4 nibbles reach their lanes with one vpmultishiftqb (lane i's low byte = bits
 * 4i..4i+7 of the 8 packed bytes; vpermps reads only the low 4 bits of each index) and
 * become (n - 8) * scale with one vpermps through a 16-entry table. */
#define MT_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma,f16c")))

/* bytes of the block MT_PREFETCH_BLOCKS ahead to prefetch per step, whole lines, so that the
 * block's `steps` steps cover it */
static inline int64_t mt_prefetch_step(int64_t block_bytes, int64_t steps) {
    const int64_t s = steps > 0 ? steps : 1;
    return ((block_bytes + s - 1) / s + 63) & ~(int64_t)63;
}
#ifndef MT_PREFETCH_BLOCKS
#define MT_PREFETCH_BLOCKS 2 /* prefetch distance, in row blocks */
#endif
/* ... of the int4 halves kernels, whose loop does more work per byte (measured with the L2
 * prefetch hint, alternating builds, Zen 4, 2 threads: a layer's 8 OLMoE int4 experts from
 * memory 1074-1104 us a call at 2 blocks, 1029-1044 at 3, 1035-1075 at 4). fused_tb keeps
 * MT_PREFETCH_BLOCKS: at 3 the OLMoE int8 decode step took 44.4-50.7 ms, at 2 43.7-45.8. */
#ifndef MT_HALVES_PREFETCH_BLOCKS
#define MT_HALVES_PREFETCH_BLOCKS 3
#endif

/* One 16-column chunk of row i at column c, dequantized in registers. `full` chunks are
 * inside [0, C); the tail chunk is masked so columns >= C read as 0.0f (the contract). */
MT_VBMI static inline __attribute__((always_inline)) __m512
chunk_w(const int dtype, const uint8_t *rp, int64_t c, __m512 tab, __m512i ctrl, __mmask16 m, const int full) {
    if (dtype == DT_F32) {
        const float *p = (const float *)rp + c;
        return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
    }
    if (dtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)rp + c;
        __m256i h = full ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(m, p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == DT_INT8) { /* g % 16 == 0: the stored (padded) row covers every chunk */
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rp + c))));
        return full ? _mm512_mul_ps(q, tab) : _mm512_maskz_mul_ps(m, q, tab);
    }
    __m512i idx = _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(*(const int64_t *)(rp + c / 2)));
    return full ? _mm512_permutexvar_ps(idx, tab) : _mm512_maskz_permutexvar_ps(m, idx, tab);
}

MT_VBMI static inline __attribute__((always_inline)) void
fused_tbl(const int dtype, const int tb, const int NR, const int lanes, const float *const *xr, const qmat *w,
          const int64_t *rows, float *out) {
    const int64_t C = w->cols, cfull = C & ~(int64_t)15;
    const int quant = dtype == DT_INT8 || dtype == DT_INT4;
    /* columns per step of the outer loop: one quantization group (one scale per row), or
     * 64 columns for f32 / bf16; each step prefetches its bytes MT_PREFETCH_BLOCKS row
     * blocks ahead, or in lanes (mt_lanes) MT_LANE_PF bytes ahead on its own row, and the
     * scales as far ahead. */
    const int64_t step = quant ? w->g : 64;
    const int64_t step_bytes = dtype == DT_F32 ? 4 * step : dtype == DT_BF16 ? 2 * step
                             : dtype == DT_INT8 ? step : step / 2;
    const int64_t pfd = MT_PREFETCH_BLOCKS * RB * w->row_bytes;
    const uint8_t *rp[2 * RB];
    const uint16_t *sp[2 * RB];
    for (int i = 0; i < NR; i++) {
        rp[i] = w->data + rows[i] * w->row_bytes;
        sp[i] = quant ? w->scales + rows[i] * w->ngroups : NULL;
    }
    const __m512 nib = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i ctrl = _mm512_set_epi8(0, 0, 0, 60, 0, 0, 0, 56, 0, 0, 0, 52, 0, 0, 0, 48, 0, 0, 0, 44, 0, 0,
                                         0, 40, 0, 0, 0, 36, 0, 0, 0, 32, 0, 0, 0, 28, 0, 0, 0, 24, 0, 0, 0, 20,
                                         0, 0, 0, 16, 0, 0, 0, 12, 0, 0, 0, 8, 0, 0, 0, 4, 0, 0, 0, 0);
    __m512 acc[TBMAX][2 * RB], tab[2 * RB];
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < NR; i++) acc[j][i] = _mm512_setzero_ps();
    for (int i = 0; i < NR; i++) tab[i] = _mm512_setzero_ps();
    int64_t s0 = 0, k = 0;
    for (; s0 < cfull; s0 += step, k++) {
        for (int i = 0; i < NR; i++) {
            if (!lanes)
                _mm_prefetch((const char *)rp[i] + k * step_bytes + pfd, MT_PF_HINT);
            else if (MT_LANE_PF) {
                _mm_prefetch((const char *)rp[i] + k * step_bytes + MT_LANE_PF, MT_PF_HINT);
                if (quant && (k & 15) == 0) /* the scales of the groups MT_LANE_PF bytes ahead */
                    _mm_prefetch((const char *)(sp[i] + k + MT_LANE_PF / step_bytes), MT_PF_HINT);
            }
            if (dtype == DT_INT4) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(_cvtsh_ss(sp[i][k])));
            if (dtype == DT_INT8) tab[i] = _mm512_set1_ps(_cvtsh_ss(sp[i][k]));
        }
        const int64_t s1 = s0 + step < cfull ? s0 + step : cfull;
        for (int64_t c = s0; c < s1; c += 16) {
            __m512 wv[2 * RB];
            for (int i = 0; i < NR; i++) wv[i] = chunk_w(dtype, rp[i], c, tab[i], ctrl, 0, 1);
            for (int j = 0; j < tb; j++) {
                __m512 xv = _mm512_loadu_ps(xr[j] + c);
                for (int i = 0; i < NR; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
            }
        }
    }
    if (cfull < C) { /* the tail chunk, in the group of column cfull */
        const __mmask16 m = (__mmask16)((1u << (C - cfull)) - 1u);
        for (int i = 0; i < NR; i++) {
            if (dtype == DT_INT4) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(_cvtsh_ss(sp[i][cfull / step])));
            if (dtype == DT_INT8) tab[i] = _mm512_set1_ps(_cvtsh_ss(sp[i][cfull / step]));
        }
        __m512 wv[2 * RB];
        for (int i = 0; i < NR; i++) wv[i] = chunk_w(dtype, rp[i], cfull, tab[i], ctrl, m, 0);
        for (int j = 0; j < tb; j++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xr[j] + cfull);
            for (int i = 0; i < NR; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
        }
    }
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < NR; i++) out[j * NR + i] = hsum16_avx512(acc[j][i]);
}

#define fused_tb(dtype, tb, xr, w, rows, out) fused_tbl(dtype, tb, RB, 0, xr, w, rows, &(out)[0][0])

#define FUSED_DT(DT)                                                                                   \
    MT_VBMI static void fused_##DT(int tb, const float *const *xr, const qmat *w, const int64_t *rows,  \
                                   float out[TBMAX][RB]) {                                             \
        switch (tb) {                                                                                  \
        case 1: fused_tb(DT, 1, xr, w, rows, out); break;                                              \
        case 2: fused_tb(DT, 2, xr, w, rows, out); break;                                              \
        case 3: fused_tb(DT, 3, xr, w, rows, out); break;                                              \
        default: fused_tb(DT, 4, xr, w, rows, out); break;                                             \
        }                                                                                              \
    }
FUSED_DT(DT_F32)
FUSED_DT(DT_BF16)
FUSED_DT(DT_INT8)
FUSED_DT(DT_INT4)

static void fused(int tb, const float *const *xr, const qmat *w, const int64_t *rows, float out[TBMAX][RB]) {
    switch (w->dtype) {
    case DT_F32: fused_DT_F32(tb, xr, w, rows, out); break;
    case DT_BF16: fused_DT_BF16(tb, xr, w, rows, out); break;
    case DT_INT8: fused_DT_INT8(tb, xr, w, rows, out); break;
    default: fused_DT_INT4(tb, xr, w, rows, out); break;
    }
}

#define BMK_TOK 6 /* tokens per tile of the batched kernels */

/* The halves kernel: int4 weights, columns and groups in multiples of 16 (linear_ctx.xp, in the
 * halves order of mt_int4_halves_src). A 16-column chunk of a row is its 8 packed bytes
 * broadcast to every 64-bit lane: the even 32-bit lanes hold bytes 0-3 (columns 0-7), the
 * odd ones bytes 4-7 (columns 8-15), so one vpsrlvd by 4 * (lane / 2) brings column k to
 * lane 2k and column 8 + k to lane 2k + 1, and vpermps (which reads only the low 4 bits of
 * each index) turns each nibble into (n - 8) * scale through the 16-entry table. No
 * byte shuffle: one shift and one vpermps per chunk instead of vpmultishiftqb + vpermps.
 * Register lane 2k accumulates contract lane k and lane 2k + 1 contract lane 8 + k, each
 * lane's columns in increasing order; the lanes are put back in order before the
 * contract's tree, so every output is bit for bit fused_tb's. NT (1..6) tokens x RB rows: each
 * chunk of a row is dequantized in registers once and used by every token of the tile (24
 * accumulators at NT = 6). */
MT_AVX512 static inline __attribute__((always_inline)) void
halves_tbl(const int nt, const int NR, const int lanes, const qmat *w, const int64_t *rows, const float *const *xh,
          float out[BMK_TOK][2 * RB]) {
    const int64_t C = w->cols, g = w->g, rb = w->row_bytes, ng = w->ngroups;
    const int64_t pfd = MT_HALVES_PREFETCH_BLOCKS * RB * rb;
    const uint8_t *rp[2 * RB];
    const uint16_t *sp[2 * RB];
    for (int i = 0; i < NR; i++) {
        rp[i] = w->data + rows[i] * rb;
        sp[i] = w->scales + rows[i] * ng;
    }
    const __m512 nib = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    __m512 acc[BMK_TOK][2 * RB];
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < NR; i++) acc[j][i] = _mm512_setzero_ps();
    /* The block MT_HALVES_PREFETCH_BLOCKS ahead is fetched as one sequential stream, a few
     * lines per group (the RB rows of a block are contiguous), and its scales a line per
     * group: one sequential stream instead of a line of each row per group (measured: 4.6 MB
     * experts from memory, 2 threads, Zen 4: 17.0-17.3 -> 19.2-20.3 GB/s best, with the chunk
     * prologue). */
    const int64_t per = mt_prefetch_step(NR * rb, ng);
    const char *pf = (const char *)rp[0] + pfd;
    const char *spf = (const char *)(sp[0] + MT_HALVES_PREFETCH_BLOCKS * RB * ng);
    /* the scales of sixteen groups of each row, converted at once (in cache, one thread, Zen 4:
     * 13.1 -> 15.4 GB/s against one scalar conversion per group) */
    float sc[2 * RB][16] __attribute__((aligned(64)));
    for (int64_t c0 = 0, gi = 0; c0 < C; c0 += g, gi++) {
        __m512 tab[2 * RB];
        if (!lanes) {
            for (int64_t o = gi * per; o < (gi + 1) * per; o += 64) _mm_prefetch(pf + o, MT_PF_HINT);
            if (gi * 64 < NR * ng * 2) _mm_prefetch(spf + gi * 64, MT_PF_HINT);
        } else if (MT_LANE_PF) {
            for (int i = 0; i < NR; i++) _mm_prefetch((const char *)rp[i] + (c0 >> 1) + MT_LANE_PF, MT_PF_HINT);
            if ((gi & 15) == 0)
                for (int i = 0; i < NR; i++) _mm_prefetch((const char *)(sp[i] + gi) + MT_LANE_PF / 16, MT_PF_HINT);
        }
        if ((gi & 15) == 0)
            for (int i = 0; i < NR; i++) {
                if (ng - gi >= 16)
                    _mm512_store_ps(sc[i], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp[i] + gi))));
                else
                    for (int64_t j = 0; j < ng - gi; j++) sc[i][j] = _cvtsh_ss(sp[i][gi + j]);
            }
        for (int i = 0; i < NR; i++) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(sc[i][gi & 15]));
        for (int64_t c = c0; c < c0 + g; c += 16) {
            __m512 wv[2 * RB];
            for (int i = 0; i < NR; i++) {
                int64_t q;
                memcpy(&q, rp[i] + (c >> 1), 8); /* c >= 0: no signed division */
                wv[i] = _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(q), sh), tab[i]);
            }
            for (int j = 0; j < nt; j++) {
                const __m512 xv = _mm512_loadu_ps(xh[j] + c);
                for (int i = 0; i < NR; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
            }
        }
    }
    const __m512i back = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < NR; i++) out[j][i] = hsum16_avx512(_mm512_permutexvar_ps(back, acc[j][i]));
}

#define halves_tb(nt, NR, w, rows, xh, out) halves_tbl(nt, NR, 0, w, rows, xh, out)
#define HALVES_TB(NT)                                                                                    \
    MT_AVX512 static void halves_##NT(const qmat *w, const int64_t *rows, const float *const *xh,      \
                                      float out[BMK_TOK][2 * RB]) {                                    \
        halves_tb(NT, RB, w, rows, xh, out);                                                           \
    }
HALVES_TB(1)
HALVES_TB(2)
HALVES_TB(3)
HALVES_TB(4)
HALVES_TB(5)
HALVES_TB(6)

/* One token, two blocks (2 * RB rows) at once: twice the independent fma chains (each row's
 * accumulator is one chain, so RB rows leave the fma latency exposed at one token). The same
 * operations per row as halves_1: same bits. */
MT_AVX512 static void halves_1x2b(const qmat *w, const int64_t *rows, const float *const *xh,
                                  float out[BMK_TOK][2 * RB]) {
    halves_tb(1, 2 * RB, w, rows, xh, out);
}

MT_AVX512 static void halves_lanes(const qmat *w, const int64_t *rows, const float *const *xh,
                                  float out[BMK_TOK][2 * RB]) {
    halves_tbl(1, 2 * RB, 1, w, rows, xh, out);
}
#define HALVES_LANES(NT)                                                                                 \
    MT_AVX512 static void halves_lanes_##NT(const qmat *w, const int64_t *rows, const float *const *xh, \
                                            float out[BMK_TOK][2 * RB]) {                              \
        halves_tbl(NT, RB, 1, w, rows, xh, out);                                                       \
    }
HALVES_LANES(2)
HALVES_LANES(3)
HALVES_LANES(4)

static int fused_ok(const qmat *w, int64_t T);
#define FUSED_LANES(DT)                                                                                  \
    MT_VBMI static void fused_lanes_##DT(int tb, const float *const *xr, const qmat *w, const int64_t *rows, \
                                         float *out) {                                                  \
        switch (tb) {                                                                                  \
        case 1: fused_tbl(DT, 1, RB, 1, xr, w, rows, out); break;                                      \
        case 2: fused_tbl(DT, 2, RB, 1, xr, w, rows, out); break;                                      \
        case 3: fused_tbl(DT, 3, RB, 1, xr, w, rows, out); break;                                      \
        default: fused_tbl(DT, 4, RB, 1, xr, w, rows, out); break;                                     \
        }                                                                                              \
    }
FUSED_LANES(DT_F32)
FUSED_LANES(DT_BF16)
FUSED_LANES(DT_INT8)

/* Decode (up to TBMAX tokens) in lanes (mt_lanes): int4 in halves order, one token in eight
 * lanes (halves_tbl's two blocks), two to four in four; int8, bfloat16, float32 through the
 * fused kernel in four. */
static int64_t linear_lanes_avx512(const linear_ctx *k, int64_t r0, int64_t n) {
    const qmat *w = k->w;
    const int64_t T = k->T, C = w->cols, R = w->rows;
    if (T > TBMAX || (!k->xp && !(fused_ok(w, T) && w->dtype != DT_INT4))) return 0;
    const int nl = k->xp && T == 1 ? 2 * RB : RB;
    const int64_t L = mt_lanes(w, r0, n, nl);
    const float *xh[BMK_TOK], *xr[TBMAX];
    for (int j = 0; j < BMK_TOK; j++) xh[j] = k->xp ? k->xp + (j < T ? j : 0) * C : NULL;
    for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (j < T ? j : 0) * C;
    for (int64_t j = 0; j < L; j++) {
        int64_t rows[2 * RB];
        for (int i = 0; i < nl; i++) rows[i] = r0 + i * L + j;
        float res[BMK_TOK][2 * RB], f[TBMAX * RB];
        if (k->xp) {
            switch (T) {
            case 1: halves_lanes(w, rows, xh, res); break;
            case 2: halves_lanes_2(w, rows, xh, res); break;
            case 3: halves_lanes_3(w, rows, xh, res); break;
            default: halves_lanes_4(w, rows, xh, res); break;
            }
        } else {
            switch (w->dtype) {
            case DT_INT8: fused_lanes_DT_INT8((int)T, xr, w, rows, f); break;
            case DT_BF16: fused_lanes_DT_BF16((int)T, xr, w, rows, f); break;
            default: fused_lanes_DT_F32((int)T, xr, w, rows, f); break;
            }
        }
        for (int64_t t = 0; t < T; t++)
            for (int i = 0; i < nl; i++) {
                const float v = k->xp ? res[t][i] : f[t * RB + i];
                k->y[t * R + rows[i]] = k->bias ? v + k->bias[rows[i]] : v;
            }
    }
    return L * nl;
}

/* ---------------------------------------------------------------- batched: many tokens
 * For T > TBMAX a block of RB rows is dequantized once (row_values_avx512), then
 * multiplied with the tokens in blocks of BCOLS512 columns, so the rows and a group of
 * tokens stay in L1, by a micro-kernel of RB rows x up to 6 tokens: 24 accumulators, each
 * weight register reused by every token and each token's register by every row. Between
 * column blocks each (token, row) keeps its sixteen lane accumulators in `st`: the
 * contract's accumulators, only stored for a while, each still seeing its chunks in
 * increasing order (as x86_avx2.c's batch_rows). */
#define BCOLS512 512

MT_AVX512 static inline __attribute__((always_inline)) void
bmk_avx512(const int nt, const float *xs, int64_t C, const float *const *wr, int64_t c0, int64_t c1, float *st) {
    __m512 a[BMK_TOK][RB];
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < RB; i++) a[j][i] = _mm512_loadu_ps(st + (j * RB + i) * 16);
    const int64_t nfull = C & ~(int64_t)15, e = c1 < nfull ? c1 : nfull;
    for (int64_t c = c0; c < e; c += 16) {
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm512_loadu_ps(wr[i] + c);
        for (int j = 0; j < nt; j++) {
            const __m512 xv = _mm512_loadu_ps(xs + j * C + c);
            for (int i = 0; i < RB; i++) a[j][i] = _mm512_fmadd_ps(wv[i], xv, a[j][i]);
        }
    }
    if (c1 == C && nfull < C) { /* the tail chunk: columns >= C read as 0 */
        const __mmask16 m = (__mmask16)((1u << (C - nfull)) - 1u);
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = _mm512_maskz_loadu_ps(m, wr[i] + nfull);
        for (int j = 0; j < nt; j++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xs + j * C + nfull);
            for (int i = 0; i < RB; i++) a[j][i] = _mm512_fmadd_ps(wv[i], xv, a[j][i]);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < RB; i++) _mm512_storeu_ps(st + (j * RB + i) * 16, a[j][i]);
}

#define BMK(NT)                                                                                          \
    MT_AVX512 static void bmk_##NT(const float *xs, int64_t C, const float *const *wr, int64_t c0, int64_t c1, \
                                   float *st) {                                                          \
        bmk_avx512(NT, xs, C, wr, c0, c1, st);                                                           \
    }
BMK(1)
BMK(2)
BMK(3)
BMK(4)
BMK(5)
BMK(6)

/* Rows [r0, r0 + RB) (values wr; rows past R repeat the last, results unused) of every
 * token, T > TBMAX. st: MT_STATE_TOKENS * RB * 16 floats. */
MT_AVX512 static void batch_rows_avx512(const linear_ctx *k, int64_t r0, int nr, const float *const *wr, float *st) {
    const int64_t T = k->T, C = k->w->cols, R = k->w->rows;
    for (int64_t tt = 0; tt < T; tt += MT_STATE_TOKENS) {
        const int64_t nt = T - tt < MT_STATE_TOKENS ? T - tt : MT_STATE_TOKENS;
        memset(st, 0, (size_t)(nt * RB * 16) * 4);
        for (int64_t c0 = 0; c0 < C; c0 += BCOLS512) {
            const int64_t c1 = c0 + BCOLS512 < C ? c0 + BCOLS512 : C;
            for (int64_t t0 = 0; t0 < nt; t0 += BMK_TOK) {
                const float *xs = k->x + (tt + t0) * C;
                float *sp = st + t0 * RB * 16;
                switch (nt - t0 < BMK_TOK ? nt - t0 : BMK_TOK) {
                case 6: bmk_6(xs, C, wr, c0, c1, sp); break;
                case 5: bmk_5(xs, C, wr, c0, c1, sp); break;
                case 4: bmk_4(xs, C, wr, c0, c1, sp); break;
                case 3: bmk_3(xs, C, wr, c0, c1, sp); break;
                case 2: bmk_2(xs, C, wr, c0, c1, sp); break;
                default: bmk_1(xs, C, wr, c0, c1, sp); break;
                }
            }
        }
        for (int64_t t = 0; t < nt; t++)
            for (int i = 0; i < nr; i++) {
                const float v = hsum16_avx512(_mm512_loadu_ps(st + (t * RB + i) * 16));
                k->y[(tt + t) * R + r0 + i] = k->bias ? v + k->bias[r0 + i] : v;
            }
    }
}

static const float *row_values_avx512(const qmat *w, int64_t r, float *buf);

/* int8 activations: VNNI's kernel where the CPU has it, else AVX2's (an AVX-512 CPU has AVX2) */
static void q8_rows_avx512(const q8ctx *k, int64_t r0, int64_t n) {
    (mt_cpu_vnni() ? mt_q8_rows_vnni : mt_q8_rows_avx2)(k, r0, n);
}

static int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("avx2"); /* q8_rows is AVX2's */
}

static int cpu_vbmi(void) {
    static atomic_int v = -1; /* racing first callers store the same value */
    int x = atomic_load_explicit(&v, memory_order_relaxed);
    if (x < 0) {
        __builtin_cpu_init();
        x = cpu_avx512() && __builtin_cpu_supports("avx512vbmi");
        atomic_store_explicit(&v, x, memory_order_relaxed);
    }
    return x;
}

/* Row r's float values: the row itself (f32: masked loads never read past the row) or
 * buf, filled with the exact dequantized values. */
static const float *row_values_avx512(const qmat *w, int64_t r, float *buf) {
    switch (w->dtype) {
    case DT_F32: return (const float *)(w->data + r * w->row_bytes);
    case DT_BF16: dequant_bf16_avx512(w, r, buf); return buf;
    case DT_INT8:
        if (w->g % 16 == 0) { dequant_int8_avx512(w, r, buf); return buf; }
        break;
    case DT_INT4:
        if (w->g % 32 == 0) { dequant_int4_avx512(w, r, buf); return buf; }
        break;
    case DT_MXFP4: dequant_mxfp4_avx512(w, r, buf); return buf;
    }
    mt_dequant_row_generic(w, r, buf);
    return buf;
}

/* The fused path covers every dtype whose chunks of 16 columns share one scale. */
static int fused_ok(const qmat *w, int64_t T) {
    if (T > TBMAX || !cpu_vbmi() || w->dtype == DT_MXFP4) return 0; /* mxfp4: dequantized rows, tiles */
    return (w->dtype != DT_INT8 && w->dtype != DT_INT4) || w->g % 16 == 0;
}

static void linear_block_avx512(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    if (k->xp) { /* int4, C and g multiples of 16: the halves kernels (xp: every token, halves order) */
        const int64_t R = w->rows, C = w->cols, T = k->T;
        const int nr = (int)(R - r0 < RB ? R - r0 : RB);
        int64_t rows[RB];
        for (int i = 0; i < RB; i++) rows[i] = r0 + (i < nr ? i : nr - 1); /* past R: repeat (unused) */
        /* tiles of at most BMK_TOK tokens, as even as possible */
        const int64_t ntiles = (T + BMK_TOK - 1) / BMK_TOK;
        for (int64_t tile = 0, t0 = 0; tile < ntiles; tile++) {
            const int tb = (int)((T - t0) / (ntiles - tile) + ((T - t0) % (ntiles - tile) != 0));
            const float *xh[BMK_TOK];
            for (int j = 0; j < BMK_TOK; j++) xh[j] = k->xp + (t0 + (j < tb ? j : 0)) * C;
            float res[BMK_TOK][2 * RB];
            switch (tb) {
            case 1: halves_1(w, rows, xh, res); break;
            case 2: halves_2(w, rows, xh, res); break;
            case 3: halves_3(w, rows, xh, res); break;
            case 4: halves_4(w, rows, xh, res); break;
            case 5: halves_5(w, rows, xh, res); break;
            default: halves_6(w, rows, xh, res); break;
            }
            for (int j = 0; j < tb; j++)
                for (int i = 0; i < nr; i++)
                    k->y[(t0 + j) * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
            t0 += tb;
        }
        return;
    }
    if (k->T > TBMAX) { /* dequantized rows, then the batched micro-kernel */
        const int nr = (int)(w->rows - r0 < RB ? w->rows - r0 : RB);
        const float *wr[RB];
        for (int i = 0; i < RB; i++) wr[i] = i < nr ? row_values_avx512(w, r0 + i, buf + i * k->blen) : wr[nr - 1];
        batch_rows_avx512(k, r0, nr, wr, buf + RB * k->blen);
        return;
    }
    if (!fused_ok(w, k->T)) {
        mt_linear_block_tiles(k, r0, buf, row_values_avx512, tile_avx512);
        return;
    }
    const int64_t R = w->rows, C = w->cols, T = k->T;
    const int nr = (int)(R - r0 < RB ? R - r0 : RB);
    int64_t rows[RB];
    for (int i = 0; i < RB; i++) rows[i] = r0 + (i < nr ? i : nr - 1); /* past R: repeat (unused) */
    const float *xr[TBMAX];
    for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (j < T ? j : 0) * C;
    float res[TBMAX][RB];
    fused((int)T, xr, w, rows, res);
    for (int j = 0; j < T; j++)
        for (int i = 0; i < nr; i++) k->y[j * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
}

/* ---------------------------------------------------------------- batched: 8 rows x 3 tokens
 * PAIR_MIN_TOKENS or more tokens of int4 weights in halves order (linear_ctx.xp), or more than
 * TBMAX of int8, bfloat16 or mxfp4 weights, two whole blocks (PAIR_ROWS rows) at once. Each
 * block of PAIR_COLS columns of those rows is dequantized once into L1 -- for int4 the values
 * halves_tb forms in registers, in the same lane order -- and multiplied with every token,
 * PAIR_TOK at a time: 24 accumulators, 8 weight and 3 token loads per 24 fmas. halves_tb
 * dequantizes each chunk once per 6 tokens and loads each token's chunk once per RB rows (6
 * loads per 24 fmas); batch_rows_avx512 loads 10 per 24 fmas. Loads are what these loops pay
 * for beside the fmas: in L1, one thread, the 24 fmas of a chunk ran at 94% of the fma probe
 * with no load, 85% with the 3 token loads, 71% with all 11. Between column blocks each
 * (token, row) keeps its sixteen lane accumulators in the state: the contract's accumulators,
 * only stored for a while, each still seeing its chunks in increasing order. So every output
 * has the contract's bits, as on every other path. */
#define PAIR_ROWS (2 * RB)
#define PAIR_COLS MT_PAIR_COLS
#define PAIR_TOK 3
/* From how many tokens pair_batch replaces halves_tb's tiles for int4 (measured, alternating
 * builds, 1408 x 2048 g64, 2 threads, Xeon with AVX-512: 10 tokens 322 -> 353 us, 12: 402 -> 396,
 * 16: 508 -> 493, 24: 782 -> 685, 32: 1003 -> 864, 64: 2003 -> 1646). For int8 it replaces
 * batch_rows_avx512 from TBMAX + 1 tokens (5: 342 -> 239 us, 8: 425 -> 347, 16: 638 -> 507,
 * 64: 1981 -> 1712), as for bfloat16 and mxfp4 (bench compute, mini-glm's experts, GFLOP/s at
 * 6 and 16 tokens: bf16 61 -> 74, 104 -> 135; mxfp4 87 -> 106, 128 -> 152). */
#define PAIR_MIN_TOKENS 12

/* wb[i][c - c0] = the value of row r0 + i at halves position c, c in [c0, c1) (multiples of 16,
 * inside whole groups): the rows side by side, a group's eight tables at a time, the scales of
 * sixteen groups converted at once. Prefetches the same columns of the next PAIR_ROWS rows.
 * With nt > 0 tokens (xh[j]: token j's x at column c0) it also runs the first tile of the
 * block, pair_mk's operations on each value as it is formed: the same fmas in the same order
 * (chunks in increasing order, rows, tokens), so the same bits, but the tile's fmas overlap the
 * dequantization instead of waiting for it, and its values are not loaded back. Measured,
 * int4 g64, alternating builds, AMD Zen 5 (family 26 model 2): 1408 x 2048, 16 tokens, from
 * memory, 2 threads, best of 5: 268.7 -> 260.6 us (2048 x 1408: 269.8 -> 265.7); in cache, one
 * thread: 12 tokens 368 -> 341-356 us, 16 tokens 462 -> 456. The 8 x 3 loop alone runs at 94%
 * of the fma probe there, so the rest of pair_batch's time is this dequantization (about 1.5
 * cycles per 16 values of a row: a broadcast load, a shift, a vpermps and a store). */
MT_AVX512 static inline __attribute__((always_inline)) void
halves_dequant_tb(const int nt, const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb,
                  const float *const *xh, float *st) {
    const int64_t g = w->g, rb = w->row_bytes, ng = w->ngroups;
    const __m512 nib = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const uint8_t *rp = w->data + r0 * rb;
    const uint16_t *sp = w->scales + r0 * ng;
    const char *next = (const char *)rp + PAIR_ROWS * rb;
    for (int i = 0; i < PAIR_ROWS; i++)
        for (int64_t o = c0 >> 1; o < c1 >> 1; o += 64) _mm_prefetch(next + i * rb + o, MT_PF_HINT);
    float sc[PAIR_ROWS][16] __attribute__((aligned(64)));
    __m512 a[PAIR_TOK][PAIR_ROWS];
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < PAIR_ROWS; i++) a[j][i] = _mm512_load_ps(st + (j * PAIR_ROWS + i) * 16);
    const int64_t gi0 = c0 / g;
    for (int64_t gi = gi0, c = c0; c < c1; gi++) {
        if ((gi - gi0) % 16 == 0)
            for (int i = 0; i < PAIR_ROWS; i++) {
                const uint16_t *s = sp + i * ng + gi;
                if (ng - gi >= 16)
                    _mm512_store_ps(sc[i], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s)));
                else
                    for (int64_t m = 0; m < ng - gi; m++) sc[i][m] = _cvtsh_ss(s[m]);
            }
        __m512 tab[PAIR_ROWS];
        for (int i = 0; i < PAIR_ROWS; i++) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(sc[i][(gi - gi0) % 16]));
        const int64_t e = (gi + 1) * g < c1 ? (gi + 1) * g : c1;
        for (; c < e; c += 16) {
            __m512 xv[PAIR_TOK];
            for (int j = 0; j < nt; j++) xv[j] = _mm512_loadu_ps(xh[j] + (c - c0));
            for (int i = 0; i < PAIR_ROWS; i++) {
                const __m512i q =
                    _mm512_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(rp + i * rb + (c >> 1))));
                const __m512 wv = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, sh), tab[i]);
                _mm512_store_ps(wb + i * PAIR_COLS + (c - c0), wv);
                for (int j = 0; j < nt; j++) a[j][i] = _mm512_fmadd_ps(wv, xv[j], a[j][i]);
            }
        }
    }
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < PAIR_ROWS; i++) _mm512_store_ps(st + (j * PAIR_ROWS + i) * 16, a[j][i]);
}

#define HALVES_DEQUANT(NT)                                                                               \
    MT_AVX512 static void halves_dequant_##NT(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb, \
                                              const float *const *xh, float *st) {                      \
        halves_dequant_tb(NT, w, r0, c0, c1, wb, xh, st);                                                \
    }
HALVES_DEQUANT(0)
HALVES_DEQUANT(3)

/* The same for int8 weights (group size a multiple of 16): wb[i][c - c0] = q * scale of row
 * r0 + i at column c, the values of dequant_int8_avx512. */
MT_AVX512 static void int8_dequant(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb) {
    const int64_t g = w->g, rb = w->row_bytes, ng = w->ngroups;
    const int8_t *rp = (const int8_t *)(w->data + r0 * rb);
    const uint16_t *sp = w->scales + r0 * ng;
    const char *next = (const char *)rp + PAIR_ROWS * rb;
    for (int i = 0; i < PAIR_ROWS; i++)
        for (int64_t o = c0; o < c1; o += 64) _mm_prefetch(next + i * rb + o, MT_PF_HINT);
    for (int64_t gi = c0 / g, c = c0; c < c1; gi++) {
        __m512 sc[PAIR_ROWS];
        for (int i = 0; i < PAIR_ROWS; i++) sc[i] = _mm512_set1_ps(_cvtsh_ss(sp[i * ng + gi]));
        const int64_t e = (gi + 1) * g < c1 ? (gi + 1) * g : c1;
        for (; c < e; c += 16)
            for (int i = 0; i < PAIR_ROWS; i++) {
                const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rp + i * rb + c)));
                _mm512_store_ps(wb + i * PAIR_COLS + (c - c0), _mm512_mul_ps(_mm512_cvtepi32_ps(q), sc[i]));
            }
    }
}

/* ... of bfloat16 (the bits shifted up) and mxfp4 weights (each group of 32 through its
 * 16-entry table e2m1(n) * scale, the values of dequant_mxfp4_avx512). */
MT_AVX512 static void plain_dequant(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb) {
    const int64_t rb = w->row_bytes;
    const __m512 e2m1 = _mm512_loadu_ps(mt_e2m1);
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int i = 0; i < PAIR_ROWS; i++) {
        const uint8_t *row = w->data + (r0 + i) * rb;
        const char *next = (const char *)row + PAIR_ROWS * rb;
        float *o = wb + i * PAIR_COLS - c0;
        if (w->dtype == DT_BF16) {
            for (int64_t c = c0; c < c1; c += 16) {
                if ((c & 31) == 0) _mm_prefetch(next + 2 * c, MT_PF_HINT);
                const __m512i v =
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c)));
                _mm512_store_ps(o + c, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
        } else { /* mxfp4: c0 and c1 are multiples of 32 (whole groups) */
            const uint8_t *es = w->escales + (r0 + i) * w->ngroups;
            for (int64_t c = c0; c < c1; c += MT_MX_GROUP) {
                if ((c & 127) == 0) _mm_prefetch(next + c / 2, MT_PF_HINT);
                const __m512 table = _mm512_mul_ps(e2m1, _mm512_set1_ps(mt_e8m0(es[c / MT_MX_GROUP])));
                const __m128i v = _mm_loadu_si128((const __m128i *)(row + c / 2));
                const __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
                const __m512i n0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)); /* columns 0..15 */
                const __m512i n1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)); /* 16..31 */
                _mm512_store_ps(o + c, _mm512_permutexvar_ps(n0, table));
                _mm512_store_ps(o + c + 16, _mm512_permutexvar_ps(n1, table));
            }
        }
    }
}

/* st[j][i] += the chunks of [0, n) of row i (wb, rows PAIR_COLS apart) and token j (xh[j]):
 * sixteen lane accumulators each, loaded from st and stored back. */
MT_AVX512 static inline __attribute__((always_inline)) void
pair_mk(const int nt, const float *wb, const float *const *xh, int64_t n, float *st) {
    __m512 a[PAIR_TOK][PAIR_ROWS];
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < PAIR_ROWS; i++) a[j][i] = _mm512_load_ps(st + (j * PAIR_ROWS + i) * 16);
    for (int64_t c = 0; c < n; c += 16) {
        __m512 xv[PAIR_TOK];
        for (int j = 0; j < nt; j++) xv[j] = _mm512_loadu_ps(xh[j] + c);
        for (int i = 0; i < PAIR_ROWS; i++) {
            __m512 wv = _mm512_load_ps(wb + i * PAIR_COLS + c);
            __asm__("" : "+v"(wv)); /* one load into a register, not a memory operand of each fma
                                     * (24 loads a chunk instead of 8: 52% of the probe instead of 71%) */
            for (int j = 0; j < nt; j++) a[j][i] = _mm512_fmadd_ps(wv, xv[j], a[j][i]);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int i = 0; i < PAIR_ROWS; i++) _mm512_store_ps(st + (j * PAIR_ROWS + i) * 16, a[j][i]);
}

#define PAIR_MK(NT)                                                                                      \
    MT_AVX512 static void pair_mk_##NT(const float *wb, const float *const *xh, int64_t n, float *st) {   \
        pair_mk(NT, wb, xh, n, st);                                                                      \
    }
PAIR_MK(1)
PAIR_MK(2)
PAIR_MK(3)

/* Rows [r0, r0 + PAIR_ROWS) of every token: int4 in halves order (x from linear_ctx.xp, lanes put
 * back in order at the end) or the weights of pair_dtype_ok (x itself). buf: PAIR_ROWS *
 * PAIR_COLS floats of dequantized weights, then MT_STATE_TOKENS * PAIR_ROWS * 16 of state
 * (64-byte aligned). */
MT_AVX512 static void pair_batch(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    const int64_t T = k->T, C = w->cols, R = w->rows;
    const int halves = k->xp != NULL;
    const float *x = halves ? k->xp : k->x;
    float *wb = buf, *st = buf + PAIR_ROWS * PAIR_COLS;
    const __m512i back = halves ? _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)
                                : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t tt = 0; tt < T; tt += MT_STATE_TOKENS) {
        const int64_t nt = T - tt < MT_STATE_TOKENS ? T - tt : MT_STATE_TOKENS;
        memset(st, 0, (size_t)(nt * PAIR_ROWS * 16) * 4);
        const int64_t ntiles = (nt + PAIR_TOK - 1) / PAIR_TOK;
        /* tiles of at most PAIR_TOK tokens, as even as possible; int4's first one, where it has
         * PAIR_TOK tokens, runs with the dequantization */
        const int fused = halves && (nt + ntiles - 1) / ntiles == PAIR_TOK; /* the first tile's size */
        for (int64_t c0 = 0; c0 < C; c0 += PAIR_COLS) {
            const int64_t c1 = c0 + PAIR_COLS < C ? c0 + PAIR_COLS : C;
            if (!halves) (w->dtype == DT_INT8 ? int8_dequant : plain_dequant)(w, r0, c0, c1, wb);
            for (int64_t tile = 0, t0 = 0; tile < ntiles; tile++) {
                const int tb = (int)((nt - t0) / (ntiles - tile) + ((nt - t0) % (ntiles - tile) != 0));
                const float *xh[PAIR_TOK];
                for (int j = 0; j < PAIR_TOK; j++) xh[j] = x + (tt + t0 + (j < tb ? j : 0)) * C + c0;
                float *sp = st + t0 * PAIR_ROWS * 16;
                if (tile == 0 && halves) {
                    (fused ? halves_dequant_3 : halves_dequant_0)(w, r0, c0, c1, wb, xh, sp);
                    if (fused) {
                        t0 += tb;
                        continue;
                    }
                }
                switch (tb) {
                case 1: pair_mk_1(wb, xh, c1 - c0, sp); break;
                case 2: pair_mk_2(wb, xh, c1 - c0, sp); break;
                default: pair_mk_3(wb, xh, c1 - c0, sp); break;
                }
                t0 += tb;
            }
        }
        for (int64_t t = 0; t < nt; t++) {
            __m512 v[PAIR_ROWS];
            for (int i = 0; i < PAIR_ROWS; i++)
                v[i] = _mm512_permutexvar_ps(back, _mm512_load_ps(st + (t * PAIR_ROWS + i) * 16));
            float d[16] __attribute__((aligned(64)));
            _mm512_store_ps(d, hsum16x8_avx512(v));
            for (int i = 0; i < PAIR_ROWS; i++) k->y[(tt + t) * R + r0 + i] = k->bias ? d[i] + k->bias[r0 + i] : d[i];
        }
    }
}

/* pair_batch's weights besides int4 in halves order: whole chunks of 16 columns (x is read up to
 * the row's end, never past it), int8 groups of whole chunks, mxfp4 blocks of whole groups. Not
 * float32: at 6 tokens a copy of the rows costs more than it saves (bench compute, mini-glm's
 * experts: 55.7 -> 48.8 GFLOP/s; 16 tokens 101 -> 103). */
static int pair_dtype_ok(const qmat *w) {
    if (w->cols % 16) return 0;
    switch (w->dtype) {
    case DT_BF16: return 1;
    case DT_INT8: return w->g % 16 == 0;
    case DT_MXFP4: return w->cols % MT_MX_GROUP == 0;
    default: return 0;
    }
}

/* Blocks r0 / RB and r0 / RB + 1, both whole: one token of int4 weights in halves order
 * (linear_ctx.xp), or PAIR_MIN_TOKENS or more of those, or more than TBMAX of pair_dtype_ok's
 * (pair_batch): 1 where done, 0 where this is not that case (the caller runs them one by one). */
static int linear_pair_avx512(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    if (r0 + 2 * RB > w->rows) return 0;
    if (k->xp ? k->T >= PAIR_MIN_TOKENS : k->T > TBMAX && pair_dtype_ok(w)) {
        pair_batch(k, r0, buf);
        return 1;
    }
    if (!k->xp || k->T != 1) return 0;
    int64_t rows[2 * RB];
    for (int i = 0; i < 2 * RB; i++) rows[i] = r0 + i;
    const float *xh[BMK_TOK] = {k->xp};
    float res[BMK_TOK][2 * RB];
    halves_1x2b(w, rows, xh, res);
    for (int i = 0; i < 2 * RB; i++) k->y[r0 + i] = k->bias ? res[0][i] + k->bias[r0 + i] : res[0][i];
    return 1;
}

MT_AVX512 static double fma_probe_avx512(int64_t n, float seed) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(seed + (float)i);
    const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    for (int64_t k = 0; k < n; k++) {
        a[0] = _mm512_fmadd_ps(a[0], b, c); a[1] = _mm512_fmadd_ps(a[1], b, c); a[2] = _mm512_fmadd_ps(a[2], b, c);
        a[3] = _mm512_fmadd_ps(a[3], b, c); a[4] = _mm512_fmadd_ps(a[4], b, c); a[5] = _mm512_fmadd_ps(a[5], b, c);
        a[6] = _mm512_fmadd_ps(a[6], b, c); a[7] = _mm512_fmadd_ps(a[7], b, c); a[8] = _mm512_fmadd_ps(a[8], b, c);
        a[9] = _mm512_fmadd_ps(a[9], b, c); a[10] = _mm512_fmadd_ps(a[10], b, c); a[11] = _mm512_fmadd_ps(a[11], b, c);
    }
    __m512 s = a[0];
    for (int i = 1; i < 12; i++) s = _mm512_add_ps(s, a[i]);
    volatile float sink = hsum16_avx512(s);
    (void)sink;
    return 2.0 * 12 * 16 * (double)n;
}

MT_AVX512 static uint64_t read_probe_avx512(const uint8_t *p, int64_t bytes) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0;
    int64_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void *)(p + i)));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512((const void *)(p + i + 64)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1));
}

MT_AVX512 static float max_avx512(const float *a, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(a + i);
        m = _mm512_mask_mov_ps(m, _mm512_cmp_ps_mask(x, m, _CMP_GT_OQ), x);
    }
    float l[16], r = -INFINITY;
    _mm512_storeu_ps(l, m);
    for (int j = 0; j < 16; j++) r = l[j] > r ? l[j] : r;
    for (; i < n; i++) r = a[i] > r ? a[i] : r;
    return r;
}

MT_AVX512 static void divide_avx512(float *y, float d, int64_t n) {
    const __m512 dv = _mm512_set1_ps(d);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_div_ps(_mm512_loadu_ps(y + i), dv));
    for (; i < n; i++) y[i] = y[i] / d;
}

const mt_isa mt_isa_avx512 = {
    .name = "avx512",
    .supported = cpu_avx512,
    .linear_block = linear_block_avx512,
    .linear_pair = linear_pair_avx512,
    .linear_lanes = linear_lanes_avx512,
    .xp_order = MT_XP_HALVES16,
    .q8_rows = q8_rows_avx512,
    .tile = tile_avx512,
    .sum = sum_avx512,
    .max = max_avx512,
    .divide = divide_avx512,
    .exp_shift = exp_shift_avx512,
    .swiglu = swiglu_avx512,
    .pv = pv_avx512,
    .fma_probe = fma_probe_avx512,
    .read_probe = read_probe_avx512,
};
#endif
