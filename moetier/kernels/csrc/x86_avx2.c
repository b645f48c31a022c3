/* The AVX2 + FMA path (x86-64-v3: AVX2, FMA, F16C). The same bits as generic.c: see the
 * contract in mt.h. The contract's sixteen lanes are two ymm registers, lanes 0-7 and
 * 8-15 of each chunk of sixteen columns; the horizontal tree adds them in the contract's
 * order (i + 8, then i + 4, i + 2, i + 1).
 *
 * AVX2 has sixteen ymm registers, so a tile of (tokens x rows) accumulators -- two
 * registers each -- is split into passes that fit: the micro-kernels below are written
 * for a fixed NT tokens x NR rows and instantiated per shape, so every accumulator lives
 * in a register. */
#include <stdlib.h>
#include <string.h>

#include "mt.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

#ifndef MT_AVX2_MANY_MIN
#define MT_AVX2_MANY_MIN 32 /* tokens from which the outer-product path beats the fused tiles */
#endif

MT_AVX2 INLINE float hsum16(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);                                                  /* i, i+8 */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* i, i+4 */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                 /* i, i+2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                               /* 0, 1 */
}

/* lanes [0, n) of 8 set (n may be <= 0 or >= 8) */
MT_AVX2 INLINE __m256i lane_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t m = (int32_t)(n < 0 ? 0 : n > 8 ? 8 : n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), idx);
}

/* ---------------------------------------------------------------- f32 tiles */

/* acc[j][i] over chunks of 16 of rows wr[i0 + i] and tokens xr[j0 + j]: NT x NR pairs. */
#define TILE_MK(NT, NR)                                                                                    \
    MT_AVX2 static void tile_mk_##NT##_##NR(const float *const *xr, const float *const *wr, int64_t n,       \
                                            float out[TBMAX][RB], int j0, int i0) {                         \
        __m256 a[NT][NR][2];                                                                               \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++) a[j][i][0] = a[j][i][1] = _mm256_setzero_ps();                     \
        const int64_t nfull = n & ~(int64_t)15;                                                            \
        for (int64_t c = 0; c < nfull; c += 16) {                                                          \
            __m256 w[NR][2];                                                                               \
            for (int i = 0; i < NR; i++) {                                                                 \
                w[i][0] = _mm256_loadu_ps(wr[i0 + i] + c);                                                 \
                w[i][1] = _mm256_loadu_ps(wr[i0 + i] + c + 8);                                             \
            }                                                                                              \
            for (int j = 0; j < NT; j++) {                                                                 \
                const __m256 x0 = _mm256_loadu_ps(xr[j0 + j] + c), x1 = _mm256_loadu_ps(xr[j0 + j] + c + 8); \
                for (int i = 0; i < NR; i++) {                                                             \
                    a[j][i][0] = _mm256_fmadd_ps(w[i][0], x0, a[j][i][0]);                                 \
                    a[j][i][1] = _mm256_fmadd_ps(w[i][1], x1, a[j][i][1]);                                 \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        if (nfull < n) { /* the tail chunk: columns >= n read as 0 */                                     \
            const __m256i m0 = lane_mask(n - nfull), m1 = lane_mask(n - nfull - 8);                        \
            __m256 w[NR][2];                                                                               \
            for (int i = 0; i < NR; i++) {                                                                 \
                w[i][0] = _mm256_maskload_ps(wr[i0 + i] + nfull, m0);                                      \
                w[i][1] = _mm256_maskload_ps(wr[i0 + i] + nfull + 8, m1);                                  \
            }                                                                                              \
            for (int j = 0; j < NT; j++) {                                                                 \
                const __m256 x0 = _mm256_maskload_ps(xr[j0 + j] + nfull, m0);                              \
                const __m256 x1 = _mm256_maskload_ps(xr[j0 + j] + nfull + 8, m1);                          \
                for (int i = 0; i < NR; i++) {                                                             \
                    a[j][i][0] = _mm256_fmadd_ps(w[i][0], x0, a[j][i][0]);                                 \
                    a[j][i][1] = _mm256_fmadd_ps(w[i][1], x1, a[j][i][1]);                                 \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++) out[j0 + j][i0 + i] = hsum16(a[j][i][0], a[j][i][1]);             \
    }
TILE_MK(1, 4)
TILE_MK(2, 2)
TILE_MK(3, 2)
TILE_MK(4, 1)

MT_AVX2 static void tile_avx2(int tb, const float *const *xr, const float *const *wr, int64_t n,
                              float out[TBMAX][RB]) {
    switch (tb) {
    case 1: tile_mk_1_4(xr, wr, n, out, 0, 0); break;
    case 2: tile_mk_2_2(xr, wr, n, out, 0, 0); tile_mk_2_2(xr, wr, n, out, 0, 2); break;
    case 3: tile_mk_3_2(xr, wr, n, out, 0, 0); tile_mk_3_2(xr, wr, n, out, 0, 2); break;
    default:
        for (int i = 0; i < RB; i++) tile_mk_4_1(xr, wr, n, out, 0, i);
        break;
    }
}

/* ---------------------------------------------------------------- batched: many tokens
 * For T > TBMAX a block of RB rows is dequantized once, then multiplied with the tokens
 * in blocks of BCOLS columns (so a group of tokens and the rows stay in L1) and tiles of
 * BTOK tokens. Between column blocks each (token, row) keeps its sixteen lane
 * accumulators in `st` -- the contract's accumulators, only stored for a while: each
 * still sees its chunks in increasing order. */
#define BCOLS 512
#define BTOK MT_STATE_TOKENS

/* NT tokens x 1 dequantized row over columns [c0, c1): twelve accumulators, the row in
 * two registers, the tokens straight from memory. st: the first token's lanes for this
 * row; the next token's are RB * 16 floats further. */
#define BATCH_MK(NT)                                                                                       \
    MT_AVX2 static void batch_mk_##NT(const float *xs, int64_t C, const float *wr, int64_t c0, int64_t c1, \
                                      float *st) {                                                         \
        __m256 a[NT][2];                                                                                   \
        for (int j = 0; j < NT; j++) {                                                                     \
            a[j][0] = _mm256_loadu_ps(st + j * RB * 16);                                                   \
            a[j][1] = _mm256_loadu_ps(st + j * RB * 16 + 8);                                               \
        }                                                                                                  \
        const int64_t nfull = C & ~(int64_t)15, e = c1 < nfull ? c1 : nfull;                               \
        for (int64_t c = c0; c < e; c += 16) {                                                             \
            const __m256 w0 = _mm256_loadu_ps(wr + c), w1 = _mm256_loadu_ps(wr + c + 8);                   \
            for (int j = 0; j < NT; j++) {                                                                 \
                a[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs + j * C + c), a[j][0]);                   \
                a[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs + j * C + c + 8), a[j][1]);               \
            }                                                                                              \
        }                                                                                                  \
        if (c1 == C && nfull < C) { /* the tail chunk: columns >= C read as 0 */                          \
            const __m256i m0 = lane_mask(C - nfull), m1 = lane_mask(C - nfull - 8);                        \
            const __m256 w0 = _mm256_maskload_ps(wr + nfull, m0), w1 = _mm256_maskload_ps(wr + nfull + 8, m1); \
            for (int j = 0; j < NT; j++) {                                                                 \
                a[j][0] = _mm256_fmadd_ps(w0, _mm256_maskload_ps(xs + j * C + nfull, m0), a[j][0]);        \
                a[j][1] = _mm256_fmadd_ps(w1, _mm256_maskload_ps(xs + j * C + nfull + 8, m1), a[j][1]);    \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++) {                                                                     \
            _mm256_storeu_ps(st + j * RB * 16, a[j][0]);                                                   \
            _mm256_storeu_ps(st + j * RB * 16 + 8, a[j][1]);                                               \
        }                                                                                                  \
    }
BATCH_MK(1)
BATCH_MK(2)
BATCH_MK(3)
BATCH_MK(4)
BATCH_MK(5)
BATCH_MK(6)

/* Row values for the batched path: exactly mt_dequant_row_generic, vectorised (the same
 * products (q - 8) * scale, q * scale; bf16 is a shift). */
MT_AVX2 static const float *row_values_avx2(const qmat *w, int64_t r, float *buf) {
    const uint8_t *row = w->data + r * w->row_bytes;
    if (w->dtype == DT_F32) return (const float *)row; /* masked loads never read past the row */
    if (w->dtype == DT_BF16) {
        const int64_t C = w->cols, nfull = C & ~(int64_t)7;
        for (int64_t c = 0; c < nfull; c += 8) {
            const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * c)));
            _mm256_storeu_ps(buf + c, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        }
        for (int64_t c = nfull; c < C; c++) {
            uint16_t b;
            memcpy(&b, row + 2 * c, 2);
            const uint32_t bits = (uint32_t)b << 16;
            memcpy(&buf[c], &bits, 4);
        }
        return buf;
    }
    if (w->dtype == DT_MXFP4) {
        /* lane l holds nibble l of the chunk's word; its magnitude from an eight-entry table,
         * times the scale, and the nibble's sign bit set apart (exact: see mt.h) */
        const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
        const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i m7 = _mm256_set1_epi32(7), m8 = _mm256_set1_epi32(8);
        const uint8_t *es = w->escales + r * w->ngroups;
        for (int64_t gi = 0; gi < w->ngroups; gi++) {
            const __m256 sc = _mm256_set1_ps(mt_e8m0(es[gi]));
            const uint8_t *q = row + gi * (MT_MX_GROUP / 2);
            float *o = buf + gi * MT_MX_GROUP;
            for (int64_t c = 0; c < MT_MX_GROUP; c += 8) {
                int32_t word;
                memcpy(&word, q + c / 2, 4);
                const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32(word), sh);
                const __m256 v = _mm256_mul_ps(_mm256_permutevar8x32_ps(mag, _mm256_and_si256(nib, m7)), sc);
                const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, m8), 28);
                _mm256_storeu_ps(o + c, _mm256_or_ps(v, _mm256_castsi256_ps(sign)));
            }
        }
        return buf;
    }
    if (w->g % 16) { /* groups that split a chunk of 16: the plain loop */
        mt_dequant_row_generic(w, r, buf);
        return buf;
    }
    const uint16_t *s = w->scales + r * w->ngroups;
    const __m256i eight = _mm256_set1_epi32(8), mk = _mm256_set1_epi32(15);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const __m256 sc = _mm256_set1_ps(_cvtsh_ss(s[gi]));
        float *o = buf + gi * w->g;
        if (w->dtype == DT_INT8) {
            const int8_t *q = (const int8_t *)row + gi * w->g;
            for (int64_t c = 0; c < w->g; c += 8) {
                const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + c)));
                _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_cvtepi32_ps(v), sc));
            }
        } else {
            const uint8_t *q = row + gi * (w->g / 2);
            for (int64_t c = 0; c < w->g; c += 8) {
                int32_t word;
                memcpy(&word, q + c / 2, 4);
                const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), sh), mk);
                _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, eight)), sc));
            }
        }
    }
    return buf;
}

/* Rows [r0, r0 + nr) (values wr) of every token, T > TBMAX. st: BTOK * RB * 16 floats. */
static void batch_rows(const linear_ctx *k, int64_t r0, int nr, const float *const *wr, float *st) {
    const int64_t T = k->T, C = k->w->cols, R = k->w->rows;
    for (int64_t tt = 0; tt < T; tt += BTOK) {
        const int64_t nt = T - tt < BTOK ? T - tt : BTOK;
        memset(st, 0, (size_t)(nt * RB * 16) * 4);
        for (int64_t c0 = 0; c0 < C; c0 += BCOLS) {
            const int64_t c1 = c0 + BCOLS < C ? c0 + BCOLS : C;
            for (int i = 0; i < nr; i++) {
                for (int64_t t0 = 0; t0 < nt; t0 += 6) {
                    const float *xs = k->x + (tt + t0) * C;
                    float *sp = st + (t0 * RB + i) * 16;
                    switch (nt - t0 < 6 ? nt - t0 : 6) {
                    case 6: batch_mk_6(xs, C, wr[i], c0, c1, sp); break;
                    case 5: batch_mk_5(xs, C, wr[i], c0, c1, sp); break;
                    case 4: batch_mk_4(xs, C, wr[i], c0, c1, sp); break;
                    case 3: batch_mk_3(xs, C, wr[i], c0, c1, sp); break;
                    case 2: batch_mk_2(xs, C, wr[i], c0, c1, sp); break;
                    default: batch_mk_1(xs, C, wr[i], c0, c1, sp); break;
                    }
                }
            }
        }
        for (int64_t t = 0; t < nt; t++)
            for (int i = 0; i < nr; i++) {
                const float v = mt_hsum16(st + (t * RB + i) * 16);
                k->y[(tt + t) * R + r0 + i] = k->bias ? v + k->bias[r0 + i] : v;
            }
    }
}

/* ---------------------------------------------------------------- fused decode: few tokens
 * For up to TBMAX tokens each chunk of sixteen columns of a weight row is dequantized in
 * registers -- the exact values the buffer path stores -- and used at once. int4: the
 * two 32-bit words of the chunk's 8 bytes are broadcast, shifted by 0, 4, ..., 28 and
 * masked: lane l holds nibble l; the value (nibble - 8) * scale is one fma of the nibble
 * with scale and -8 * scale (exact, see mt.h: both products and their sum are
 * representable). */

typedef struct {
    __m256 sc, m8; /* scale, -8 * scale of the current group (int8: scale only) */
} gscale;

MT_AVX2 INLINE void chunk_w(const int dtype, const uint8_t *rp, int64_t c, gscale s, __m256 *w0, __m256 *w1) {
    if (dtype == DT_F32) {
        *w0 = _mm256_loadu_ps((const float *)rp + c);
        *w1 = _mm256_loadu_ps((const float *)rp + c + 8);
    } else if (dtype == DT_BF16) {
        const __m256i h0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)rp + c)));
        const __m256i h1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)rp + c + 8)));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(h0, 16));
        *w1 = _mm256_castsi256_ps(_mm256_slli_epi32(h1, 16));
    } else if (dtype == DT_INT8) {
        const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rp + c)));
        const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rp + c + 8)));
        *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), s.sc);
        *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(q1), s.sc);
    } else {
        /* nibble l to the top of lane l, then down: no mask constant */
        const __m256i sh = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
        /* vbroadcastss from memory: a load, no shuffle */
        const __m256i d0 = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(rp + c / 2)));
        const __m256i d1 = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(rp + c / 2 + 4)));
        const __m256i n0 = _mm256_srli_epi32(_mm256_sllv_epi32(d0, sh), 28);
        const __m256i n1 = _mm256_srli_epi32(_mm256_sllv_epi32(d1, sh), 28);
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n0), s.sc, s.m8);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n1), s.sc, s.m8);
    }
}

MT_AVX2 INLINE gscale group_scale(const int dtype, const uint16_t *sp, int64_t gi) {
    gscale s;
    if (dtype == DT_INT8 || dtype == DT_INT4) {
        const float v = _cvtsh_ss(sp[gi]);
        s.sc = _mm256_set1_ps(v);
        s.m8 = _mm256_set1_ps(-8.0f * v);
    } else {
        s.sc = s.m8 = _mm256_setzero_ps();
    }
    return s;
}

/* The fused kernels keep every accumulator in a named variable: with arrays of vectors
 * the compiler stores them to the stack on every chunk, and those stores stall the loads
 * of the next chunk. ACC(n) declares accumulator pair n (lanes 0-7, 8-15). */
#define ACC(n) __m256 a##n##l = _mm256_setzero_ps(), a##n##h = _mm256_setzero_ps()
#define FMA2(n, w0, w1, x0, x1)                                                                           \
    do {                                                                                               \
        a##n##l = _mm256_fmadd_ps((w0), (x0), a##n##l);                                                \
        a##n##h = _mm256_fmadd_ps((w1), (x1), a##n##h);                                                \
    } while (0)
#define OUT(n) hsum16(a##n##l, a##n##h)

/* Row rp's chunk at column c into (w0, w1); in the tail chunk (c = cfull < C) columns
 * >= C read as 0. Quantized rows are stored to whole groups, so the chunk is there. */
MT_AVX2 INLINE void chunk_tail(const int dtype, const uint8_t *rp, int64_t c, int64_t C, gscale s,
                               __m256 *w0, __m256 *w1) {
    const __m256i m0 = lane_mask(C - c), m1 = lane_mask(C - c - 8);
    if (dtype == DT_F32) { /* the row ends at C: never load past it */
        *w0 = _mm256_maskload_ps((const float *)rp + c, m0);
        *w1 = _mm256_maskload_ps((const float *)rp + c + 8, m1);
    } else if (dtype == DT_BF16) {
        float tmp[16] = {0};
        for (int64_t k = c; k < C; k++) {
            uint16_t b;
            memcpy(&b, rp + 2 * k, 2);
            const uint32_t bits = (uint32_t)b << 16;
            memcpy(&tmp[k - c], &bits, 4);
        }
        *w0 = _mm256_loadu_ps(tmp);
        *w1 = _mm256_loadu_ps(tmp + 8);
    } else {
        chunk_w(dtype, rp, c, s, w0, w1);
        *w0 = _mm256_and_ps(*w0, _mm256_castsi256_ps(m0));
        *w1 = _mm256_and_ps(*w1, _mm256_castsi256_ps(m1));
    }
}

MT_AVX2 INLINE void x_tail(const float *x, int64_t c, int64_t C, __m256 *x0, __m256 *x1) {
    *x0 = _mm256_maskload_ps(x + c, lane_mask(C - c));
    *x1 = _mm256_maskload_ps(x + c + 8, lane_mask(C - c - 8));
}

typedef struct {
    const uint8_t *rp;
    const uint16_t *sp;
} wrow;

MT_AVX2 INLINE wrow row_of(const qmat *w, int64_t r) {
    wrow o = {w->data + r * w->row_bytes, w->scales ? w->scales + r * w->ngroups : NULL};
    return o;
}

/* Columns per scale group, and bytes per column step of 16 columns' prefetch offset. */
#define GROUP_STEP(dtype, w) ((dtype) == DT_INT8 || (dtype) == DT_INT4 ? (w)->g : (int64_t)1 << 40)
MT_AVX2 INLINE int64_t col_bytes(const int dtype, int64_t c) {
    return dtype == DT_F32 ? 4 * c : dtype == DT_BF16 ? 2 * c : dtype == DT_INT8 ? c : c / 2;
}

/* Hardware prefetchers do not ramp up within a row of a kilobyte or two, so the decode
 * kernels fetch the same bytes of the rows one block (RB rows) ahead, a cache line at a
 * time: while this block computes, the next one arrives. (Past the last row: a prefetch
 * never faults.) */
MT_AVX2 INLINE void prefetch_ahead(const int dtype, const uint8_t *rp, int64_t row_bytes, int64_t c) {
    const int64_t off = col_bytes(dtype, c);
    if ((off & 63) < col_bytes(dtype, 16))
        for (int64_t b = off & ~(int64_t)63; b < off + col_bytes(dtype, 16); b += 64)
            _mm_prefetch((const char *)rp + RB * row_bytes + b, MT_PF_HINT);
}

/* 1 token x 4 rows: eight accumulator chains, enough to hide the fma latency. */
MT_AVX2 INLINE void fused_1x4(const int dtype, const qmat *w, const int64_t *rows, const float *x, float *o) {
    const int64_t C = w->cols, cfull = C & ~(int64_t)15, step = GROUP_STEP(dtype, w);
    const wrow p0 = row_of(w, rows[0]), p1 = row_of(w, rows[1]), p2 = row_of(w, rows[2]), p3 = row_of(w, rows[3]);
    gscale s0 = group_scale(dtype, p0.sp, 0), s1 = group_scale(dtype, p1.sp, 0);
    gscale s2 = group_scale(dtype, p2.sp, 0), s3 = group_scale(dtype, p3.sp, 0);
    ACC(0);
    ACC(1);
    ACC(2);
    ACC(3);
    int64_t next = step, gi = 0;
    for (int64_t c = 0; c < cfull; c += 16) {
        if (c == next) {
            gi++;
            next += step;
            s0 = group_scale(dtype, p0.sp, gi);
            s1 = group_scale(dtype, p1.sp, gi);
            s2 = group_scale(dtype, p2.sp, gi);
            s3 = group_scale(dtype, p3.sp, gi);
        }
        prefetch_ahead(dtype, p0.rp, w->row_bytes, c);
        prefetch_ahead(dtype, p1.rp, w->row_bytes, c);
        prefetch_ahead(dtype, p2.rp, w->row_bytes, c);
        prefetch_ahead(dtype, p3.rp, w->row_bytes, c);
        __m256 w0, w1;
        chunk_w(dtype, p0.rp, c, s0, &w0, &w1);
        FMA2(0, w0, w1, _mm256_loadu_ps(x + c), _mm256_loadu_ps(x + c + 8));
        chunk_w(dtype, p1.rp, c, s1, &w0, &w1);
        FMA2(1, w0, w1, _mm256_loadu_ps(x + c), _mm256_loadu_ps(x + c + 8));
        chunk_w(dtype, p2.rp, c, s2, &w0, &w1);
        FMA2(2, w0, w1, _mm256_loadu_ps(x + c), _mm256_loadu_ps(x + c + 8));
        chunk_w(dtype, p3.rp, c, s3, &w0, &w1);
        FMA2(3, w0, w1, _mm256_loadu_ps(x + c), _mm256_loadu_ps(x + c + 8));
    }
    if (cfull < C) {
        const int64_t g = cfull / (step < C ? step : C);
        __m256 x0, x1, w0, w1;
        x_tail(x, cfull, C, &x0, &x1);
        chunk_tail(dtype, p0.rp, cfull, C, group_scale(dtype, p0.sp, g), &w0, &w1);
        FMA2(0, w0, w1, x0, x1);
        chunk_tail(dtype, p1.rp, cfull, C, group_scale(dtype, p1.sp, g), &w0, &w1);
        FMA2(1, w0, w1, x0, x1);
        chunk_tail(dtype, p2.rp, cfull, C, group_scale(dtype, p2.sp, g), &w0, &w1);
        FMA2(2, w0, w1, x0, x1);
        chunk_tail(dtype, p3.rp, cfull, C, group_scale(dtype, p3.sp, g), &w0, &w1);
        FMA2(3, w0, w1, x0, x1);
    }
    o[0] = OUT(0);
    o[1] = OUT(1);
    o[2] = OUT(2);
    o[3] = OUT(3);
}

/* 1 token x 2 rows of int4 weights, columns and groups in multiples of 32 (linear_ctx.xp).
 * Eight bytes of a row are sixteen columns, one chunk of the contract: vpmovzxbd widens
 * them to the 32-bit lanes, where the low nibble (masked by 0x0F) is an even column and the
 * high one (masked by 0xF0, in place: 16 * nibble) the next odd column. So accumulator e
 * holds contract lanes 0, 2, ..., 14 and accumulator o lanes 1, 3, ..., 15, each lane's
 * columns still added in increasing order, and xp holds x in the same order. The value of
 * a weight is the contract's fma(nibble, scale, -8 * scale); for the high nibble it is
 * fma(16 * nibble, scale / 16, -8 * scale), the same exact product (scale / 16 is exact:
 * scale comes from float16) so the same single rounding, the same bits. The lanes are put
 * back in order before the contract's tree, so every output is bit for bit fused_1x4's.
 * Per 32 columns of a row that is two widening loads and two masks per chunk, then a
 * convert and two fmas per eight weights: the fewest vector operations found for exact
 * activations (with vpshufb spreading a 16-byte load, as before, it took 4.75 per eight
 * weights against 4.5; with pointer-stepped loops and the scales converted eight groups at
 * a time it is 1.35x the old kernel in one thread, in cache, Zen 3). The mask instead of a
 * shift for the high nibble: shifts share the fma ports (Intel: p0/p1; Zen 3: +1.7 cycles
 * per eight beside eight fmas, a mask 0), a mask also runs on the shuffle port (measured,
 * one thread, 2048 columns, Xeon with AVX-512, the AVX2 path: in cache 6.58 -> 7.44 GB/s,
 * 200 MB from memory 6.41 -> 7.11, every output's bits equal). The rows PAIRS_AHEAD rows
 * ahead are prefetched as they are read. */
#define PAIRS_AHEAD (2 * RB)
MT_AVX2 INLINE float hsum16_pairs(__m256 e, __m256 o) {
    const __m256 a = _mm256_unpacklo_ps(e, o), b = _mm256_unpackhi_ps(e, o); /* 0 1 2 3 | 8 9 10 11, 4..7 | 12..15 */
    return hsum16(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* 32 columns of row n (bytes p, scale s, -8 * scale m) against x in pairs order at xq */
#define PAIRS_ROW(n, p, s, s16, m, xq)                                                                     \
    do {                                                                                                   \
        const __m256i t0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));                   \
        const __m256i t1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8)));             \
        a##n##l = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t0, m4)), s, m),      \
                                  _mm256_loadu_ps(xq), a##n##l);                                           \
        a##n##h = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t0, m40)), s16, m),   \
                                  _mm256_loadu_ps((xq) + 8), a##n##h);                                     \
        a##n##l = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t1, m4)), s, m),      \
                                  _mm256_loadu_ps((xq) + 16), a##n##l);                                    \
        a##n##h = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t1, m40)), s16, m),   \
                                  _mm256_loadu_ps((xq) + 24), a##n##h);                                    \
    } while (0)

/* Two rows: their four accumulators, two scales and two -8 * scales stay in registers
 * (four rows spill them: measured slower). G: the group size, a constant where it is a
 * common one, so the loop over a group's chunks unrolls. */
MT_AVX2 INLINE void pairs_1x2_g(const qmat *w, int64_t r0, int64_t r1, const int lanes, const float *xp, float *o,
                                const int64_t G) {
    const int64_t rb = w->row_bytes, ng = w->ngroups;
    const uint8_t *p0 = w->data + r0 * rb, *p1 = w->data + r1 * rb;
    const uint16_t *s = w->scales + r0 * ng, *s1 = w->scales + r1 * ng;
    const __m256i m4 = _mm256_set1_epi32(0x0F), m40 = _mm256_set1_epi32(0xF0);
    /* the rows PAIRS_AHEAD ahead of a block, or each lane's own stream MT_LANE_PF bytes ahead
     * (mt_lanes); past the end: a prefetch never faults */
    const char *ahead = (const char *)p0 + (lanes ? MT_LANE_PF : PAIRS_AHEAD * rb);
    const char *ahead1 = lanes ? (const char *)p1 + MT_LANE_PF : ahead + rb;
    float sc[6][8] __attribute__((aligned(32))); /* scale, -8 * scale and scale / 16 of eight groups, per row */
    ACC(0);
    ACC(1);
    const float *xq = xp;
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        const int nn = ng - g0 < 8 ? (int)(ng - g0) : 8;
        if (nn == 8) {
            const __m256 f0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g0)));
            const __m256 f1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s1 + g0)));
            _mm256_store_ps(sc[0], f0);
            _mm256_store_ps(sc[1], _mm256_mul_ps(f0, _mm256_set1_ps(-8.0f)));
            _mm256_store_ps(sc[2], f1);
            _mm256_store_ps(sc[3], _mm256_mul_ps(f1, _mm256_set1_ps(-8.0f)));
            _mm256_store_ps(sc[4], _mm256_mul_ps(f0, _mm256_set1_ps(0.0625f)));
            _mm256_store_ps(sc[5], _mm256_mul_ps(f1, _mm256_set1_ps(0.0625f)));
        } else {
            for (int j = 0; j < nn; j++) {
                const float f0 = _cvtsh_ss(s[g0 + j]), f1 = _cvtsh_ss(s1[g0 + j]);
                sc[0][j] = f0;
                sc[1][j] = -8.0f * f0;
                sc[2][j] = f1;
                sc[3][j] = -8.0f * f1;
                sc[4][j] = 0.0625f * f0;
                sc[5][j] = 0.0625f * f1;
            }
        }
        for (int j = 0; j < nn; j++) {
            const __m256 s0 = _mm256_broadcast_ss(&sc[0][j]), m0 = _mm256_broadcast_ss(&sc[1][j]);
            const __m256 s1 = _mm256_broadcast_ss(&sc[2][j]), m1 = _mm256_broadcast_ss(&sc[3][j]);
            const __m256 h0 = _mm256_broadcast_ss(&sc[4][j]), h1 = _mm256_broadcast_ss(&sc[5][j]);
            for (int64_t c = 0; c < G; c += 32) {
                _mm_prefetch(ahead, MT_PF_HINT);
                _mm_prefetch(ahead1, MT_PF_HINT);
                ahead += 16;
                ahead1 += 16;
                PAIRS_ROW(0, p0, s0, h0, m0, xq);
                PAIRS_ROW(1, p1, s1, h1, m1, xq);
                p0 += 16;
                p1 += 16;
                xq += 32;
            }
        }
    }
    o[0] = hsum16_pairs(a0l, a0h);
    o[1] = hsum16_pairs(a1l, a1h);
}

/* rows r0 and r1: neighbours (lanes 0) or one step of two lanes (lanes 1) */
MT_AVX2 static void pairs_1x2_rows(const qmat *w, int64_t r0, int64_t r1, const int lanes, const float *xp, float *o) {
    switch (w->g) {
    case 32: pairs_1x2_g(w, r0, r1, lanes, xp, o, 32); break;
    case 64: pairs_1x2_g(w, r0, r1, lanes, xp, o, 64); break;
    case 128: pairs_1x2_g(w, r0, r1, lanes, xp, o, 128); break;
    default: pairs_1x2_g(w, r0, r1, lanes, xp, o, w->g); break;
    }
}

MT_AVX2 static void pairs_1x2(const qmat *w, int64_t r0, const float *xp, float *o) {
    pairs_1x2_rows(w, r0, r0 + 1, 0, xp, o);
}

/* 1 row x NT (<= 6) tokens of int4 weights, columns and groups in multiples of 32, x in
 * the pairs order (xp, token by token): the few-token batches of 2 to MT_AVX2_R4_MIN - 1
 * tokens, and a last block of fewer than four rows up to many_min - 1 (from MT_AVX2_R4_MIN
 * tokens, four rows take pairs_rows4 below). Each chunk of sixteen
 * columns is dequantized once in registers, as in pairs_1x2 (the same values and lanes),
 * and used by every token of the tile: twelve accumulators, the tokens' x from memory.
 * (The tiles of 4 tokens dequantized each chunk once per 4 tokens with the broadcast-and-
 * shift kernel: 10 vector operations of dequantization per 8 fmas, against 7 per 12 here.)
 * The columns go in blocks of PT_COLS, so the tile's x (six tokens: 12 KiB) stays in L1
 * while every row of the block passes over it (T = 16, 2 threads: 1.16 -> 1.47 GB/s); between blocks each (token, row) keeps its
 * even and odd lanes in st -- the contract's accumulators, only stored for a while. */
#define PT_COLS 512
#define PT_TOK 6
#define TOKS_ACC(j)                                                                                        \
    __m256 e##j = NT > j ? _mm256_loadu_ps(st + j * 16) : _mm256_setzero_ps();                             \
    __m256 o##j = NT > j ? _mm256_loadu_ps(st + j * 16 + 8) : _mm256_setzero_ps()
#define TOKS_FMA(j)                                                                                        \
    if (NT > j) {                                                                                          \
        e##j = _mm256_fmadd_ps(we, _mm256_loadu_ps(xq + j * C), e##j);                                     \
        o##j = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xq + j * C + 8), o##j);                                 \
    }
#define TOKS_STORE(j)                                                                                      \
    if (NT > j) {                                                                                          \
        _mm256_storeu_ps(st + j * 16, e##j);                                                               \
        _mm256_storeu_ps(st + j * 16 + 8, o##j);                                                           \
    }

/* row r, columns [c0, c1) (whole groups), tokens xp[j * C + c]: st[j * 16 ..] even lanes, then odd */
MT_AVX2 INLINE void pairs_tokens(const qmat *w, int64_t r, const float *xp, int64_t C, int64_t c0, int64_t c1,
                                 float *st, const int NT, const int64_t G) {
    const uint8_t *p = w->data + r * w->row_bytes + c0 / 2;
    const uint16_t *s = w->scales + r * w->ngroups;
    const __m256i m4 = _mm256_set1_epi32(0x0F), m40 = _mm256_set1_epi32(0xF0);
    TOKS_ACC(0);
    TOKS_ACC(1);
    TOKS_ACC(2);
    TOKS_ACC(3);
    TOKS_ACC(4);
    TOKS_ACC(5);
    const float *xq = xp + c0;
    for (int64_t gi = c0 / G; gi < c1 / G; gi++) {
        const float f = _cvtsh_ss(s[gi]);
        const __m256 sc = _mm256_set1_ps(f), m8 = _mm256_set1_ps(-8.0f * f), s16 = _mm256_set1_ps(0.0625f * f);
        for (int64_t c = 0; c < G; c += 16) {
            if ((c & 127) == 0) /* a line of the next block's row (past the end: never faults) */
                _mm_prefetch((const char *)p + RB * w->row_bytes, MT_PF_HINT);
            const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
            const __m256 we = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t, m4)), sc, m8);
            const __m256 wo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t, m40)), s16, m8);
            TOKS_FMA(0) TOKS_FMA(1) TOKS_FMA(2) TOKS_FMA(3) TOKS_FMA(4) TOKS_FMA(5)
            p += 8;
            xq += 16;
        }
    }
    TOKS_STORE(0) TOKS_STORE(1) TOKS_STORE(2) TOKS_STORE(3) TOKS_STORE(4) TOKS_STORE(5)
}

#define PAIRS_TOKENS_NT(NT)                                                                                \
    MT_AVX2 static void pairs_tokens_##NT(const qmat *w, int64_t r, const float *xp, int64_t c0, int64_t c1, \
                                          float *st) {                                                     \
        const int64_t C = w->cols;                                                                         \
        switch (w->g) {                                                                                    \
        case 32: pairs_tokens(w, r, xp, C, c0, c1, st, NT, 32); break;                                     \
        case 64: pairs_tokens(w, r, xp, C, c0, c1, st, NT, 64); break;                                     \
        case 128: pairs_tokens(w, r, xp, C, c0, c1, st, NT, 128); break;                                   \
        default: pairs_tokens(w, r, xp, C, c0, c1, st, NT, w->g); break;                                   \
        }                                                                                                  \
    }
PAIRS_TOKENS_NT(1)
PAIRS_TOKENS_NT(2)
PAIRS_TOKENS_NT(3)
PAIRS_TOKENS_NT(4)
PAIRS_TOKENS_NT(5)
PAIRS_TOKENS_NT(6)
typedef void (*pairs_tokens_fn)(const qmat *, int64_t, const float *, int64_t, int64_t, float *);
static const pairs_tokens_fn pairs_tokens_of[PT_TOK + 1] = {
    NULL, pairs_tokens_1, pairs_tokens_2, pairs_tokens_3, pairs_tokens_4, pairs_tokens_5, pairs_tokens_6};

/* Rows [r0, r0 + nr) of every token (T > 1) from xp; st: RB * PT_TOK * 16 floats. */
MT_AVX2 static void pairs_rows(const linear_ctx *k, int64_t r0, int nr, float *st) {
    const qmat *w = k->w;
    const int64_t T = k->T, C = w->cols, R = w->rows;
    for (int64_t t0 = 0; t0 < T; t0 += PT_TOK) {
        const int nt = (int)(T - t0 < PT_TOK ? T - t0 : PT_TOK);
        /* whole groups; a tile whose x fits in 32 KiB in one block (measured: 4 tokens of
         * 2048 columns are faster unblocked, the rows then stream whole) */
        const int64_t bc = nt * C * 4 <= (32 << 10) ? C : PT_COLS > w->g ? PT_COLS / w->g * w->g : w->g;
        const float *xt = k->xp + t0 * C;
        memset(st, 0, sizeof(float) * RB * PT_TOK * 16);
        for (int64_t c0 = 0; c0 < C; c0 += bc)
            for (int i = 0; i < nr; i++)
                pairs_tokens_of[nt](w, r0 + i, xt, c0, c0 + bc < C ? c0 + bc : C, st + i * PT_TOK * 16);
        for (int i = 0; i < nr; i++)
            for (int j = 0; j < nt; j++) {
                const float *a = st + (i * PT_TOK + j) * 16;
                const float v = hsum16_pairs(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8));
                k->y[(t0 + j) * R + r0 + i] = k->bias ? v + k->bias[r0 + i] : v;
            }
    }
}

/* Four rows x MT_AVX2_R4_MIN to many_min - 1 tokens of int4 weights (xp's conditions; speculative
 * verification, batched decode, a prefill's experts), and MT_AVX2_R4_MIN8 to many_min - 1 of
 * int8 weights in whole groups of a multiple of 16 (there in column order, x as it is, the
 * values q * scale of int8_1x4; 1408 x 2048 at 16 tokens, one thread: 36 -> 56 GFLOP/s
 * against the fused tiles of four tokens, 5 tokens 29 -> 39): the rows are dequantized
 * once per block of R4_COLS columns into a small buffer, in xp's order (per sixteen columns
 * eight even then eight odd, the values of pairs_1x2 and pairs_tokens), then a register
 * tile of four rows x three tokens runs over it, one half (the even lanes, then the odd)
 * at a time: twelve accumulators, the three tokens' x in registers, each row's eight
 * values loaded once for three fmas (7 loads per 12 fmas; pairs_tokens loads 13 per 14
 * and dequantizes each chunk again for every six tokens). Each (row, token) keeps its
 * sixteen lanes in st between blocks, so every lane still adds its columns in increasing
 * order: the bits of pairs_rows. The rows of the buffer are R4_PAD floats apart so the
 * four rows' loads do not share an L1 set at any column count. Measured on Zen 3 (AVX2
 * only), both builds alternating in one process, int4 g64, 1408 x 2048: at 16 tokens 52 ->
 * 65 GFLOP/s on one thread (the probe's peak: about 101), 101 -> 131 on two; at 7 tokens
 * 45 -> 60, at 31 50 -> 68 (one thread); blocks of 256 or 1024 columns were slower than
 * 512. Against the outer-product path (many_min), one thread: this kernel 69 GFLOP/s to its
 * 56 at 32 tokens, 58 to 61 at 64, 54 to 69 at 96. */
#ifndef MT_AVX2_R4_MIN
#define MT_AVX2_R4_MIN 7 /* tokens from which pairs_rows4 beats pairs_rows (6: even, 7: pairs_rows would run 6 + 1) */
#endif
#ifndef MT_AVX2_R4_MIN8
#define MT_AVX2_R4_MIN8 5 /* int8: tokens from which pairs_rows4 beats the fused tiles of four */
#endif
#ifndef R4_COLS
#define R4_COLS 512
#endif
#define R4_PAD 16

/* rows r0..r0+3, columns [c0, c1) (whole groups) -> wb (row i at wb + i * ws), xp order */
MT_AVX2 INLINE void r4_dequant_g(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb, int64_t ws,
                                 const int64_t G) {
    const int64_t rb = w->row_bytes, ng = w->ngroups;
    const __m256i m4 = _mm256_set1_epi32(0x0F), m40 = _mm256_set1_epi32(0xF0);
    for (int i = 0; i < RB; i++) {
        const uint8_t *p = w->data + (r0 + i) * rb + c0 / 2;
        const uint16_t *s = w->scales + (r0 + i) * ng;
        float *d = wb + i * ws;
        for (int64_t gi = c0 / G; gi < c1 / G; gi++) {
            const float f = _cvtsh_ss(s[gi]);
            const __m256 sc = _mm256_set1_ps(f), m8 = _mm256_set1_ps(-8.0f * f), s16 = _mm256_set1_ps(0.0625f * f);
            for (int64_t c = 0; c < G; c += 16) {
                if ((c & 127) == 0) /* a line of the next block's row (past the end: never faults) */
                    _mm_prefetch((const char *)p + RB * rb, MT_PF_HINT);
                const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
                _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t, m4)), sc, m8));
                _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t, m40)), s16, m8));
                p += 8;
                d += 16;
            }
        }
    }
}

/* int8: rows r0..r0+3, columns [c0, c1) (whole groups of a multiple of 16) -> wb, in
 * column order: q * scale, int8_1x4's values (one exact multiply) */
MT_AVX2 INLINE void r4_dequant8_g(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb, int64_t ws,
                                  const int64_t G) {
    const int64_t rb = w->row_bytes, ng = w->ngroups;
    for (int i = 0; i < RB; i++) {
        const uint8_t *p = w->data + (r0 + i) * rb + c0;
        const uint16_t *s = w->scales + (r0 + i) * ng;
        float *d = wb + i * ws;
        for (int64_t gi = c0 / G; gi < c1 / G; gi++) {
            const __m256 sc = _mm256_set1_ps(_cvtsh_ss(s[gi]));
            for (int64_t c = 0; c < G; c += 16) {
                if ((c & 63) == 0) /* a line of the next block's row (past the end: never faults) */
                    _mm_prefetch((const char *)p + RB * rb, MT_PF_HINT);
                const __m256i q0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
                const __m256i q1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
                _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), sc));
                _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), sc));
                p += 16;
                d += 16;
            }
        }
    }
}

MT_AVX2 static void r4_dequant(const qmat *w, int64_t r0, int64_t c0, int64_t c1, float *wb, int64_t ws) {
    if (w->dtype == DT_INT8) {
        switch (w->g) {
        case 32: r4_dequant8_g(w, r0, c0, c1, wb, ws, 32); break;
        case 64: r4_dequant8_g(w, r0, c0, c1, wb, ws, 64); break;
        case 128: r4_dequant8_g(w, r0, c0, c1, wb, ws, 128); break;
        default: r4_dequant8_g(w, r0, c0, c1, wb, ws, w->g); break;
        }
        return;
    }
    switch (w->g) {
    case 32: r4_dequant_g(w, r0, c0, c1, wb, ws, 32); break;
    case 64: r4_dequant_g(w, r0, c0, c1, wb, ws, 64); break;
    case 128: r4_dequant_g(w, r0, c0, c1, wb, ws, 128); break;
    default: r4_dequant_g(w, r0, c0, c1, wb, ws, w->g); break;
    }
}

/* One half (eight lanes) of rows 0..3 x three (two) tokens over n > 0 columns, written out
 * in assembly: wb and xq at the half's first value, row i's values at wb + i * R4_WS, x of
 * token j at xq + j * C, the accumulator of (row i, token j) at st + i * ss + j * 16, held in
 * ymm(3i + j) meanwhile; the tokens' x in ymm12-14, a row's values in ymm15. Each fma is the
 * contract's acc = fma(w, x, acc) per lane, the columns in increasing order. Written in C,
 * the compiler read x or the row's values from memory in every fma (13 loads per 12 fmas
 * instead of 7), or kept two accumulators on the stack once told not to: 1408 x 2048 at 16
 * tokens, one thread, Zen 3, alternating builds, 56 -> 62 GFLOP/s (31 tokens: 59 -> 65). */
#define R4_WS (R4_COLS + R4_PAD) /* floats between the buffer's rows: built into the tiles' loops */
#define R4_ROW2(i, a0, a1)                                                                                 \
    "vmovups %c[d" #i "](%[w],%[c]), %%ymm15\n\t"                                                          \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm" #a0 "\n\t"                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm" #a1 "\n\t"
MT_AVX2 static void r4_tile_2(const float *wb, const float *xq, int64_t C, int64_t n, float *st, int64_t ss) {
    int64_t c = 0;
    __asm__ volatile(
        "vmovups (%[s0]), %%ymm0\n\t vmovups 64(%[s0]), %%ymm1\n\t"
        "vmovups (%[s0],%[sb]), %%ymm3\n\t vmovups 64(%[s0],%[sb]), %%ymm4\n\t"
        "vmovups (%[s2]), %%ymm6\n\t vmovups 64(%[s2]), %%ymm7\n\t"
        "vmovups (%[s2],%[sb]), %%ymm9\n\t vmovups 64(%[s2],%[sb]), %%ymm10\n\t"
        "1:\n\t"
        "vmovups (%[x0],%[c]), %%ymm12\n\t"
        "vmovups (%[x1],%[c]), %%ymm13\n\t"
        R4_ROW2(0, 0, 1) R4_ROW2(1, 3, 4) R4_ROW2(2, 6, 7) R4_ROW2(3, 9, 10)
        "add $64, %[c]\n\t"
        "cmp %[n], %[c]\n\t"
        "jl 1b\n\t"
        "vmovups %%ymm0, (%[s0])\n\t vmovups %%ymm1, 64(%[s0])\n\t"
        "vmovups %%ymm3, (%[s0],%[sb])\n\t vmovups %%ymm4, 64(%[s0],%[sb])\n\t"
        "vmovups %%ymm6, (%[s2])\n\t vmovups %%ymm7, 64(%[s2])\n\t"
        "vmovups %%ymm9, (%[s2],%[sb])\n\t vmovups %%ymm10, 64(%[s2],%[sb])\n\t"
        : [c] "+r"(c)
        : [x0] "r"(xq), [x1] "r"(xq + C), [w] "r"(wb), [n] "r"(n * 4), [s0] "r"(st), [s2] "r"(st + 2 * ss),
          [sb] "r"(ss * 4), [d0] "i"(0), [d1] "i"(R4_WS * 4), [d2] "i"(2 * R4_WS * 4), [d3] "i"(3 * R4_WS * 4)
        : "xmm0", "xmm1", "xmm3", "xmm4", "xmm6", "xmm7", "xmm9", "xmm10", "xmm12", "xmm13", "xmm15", "cc", "memory");
}
#define R4_ROW3(i, a0, a1, a2)                                                                             \
    "vmovups %c[d" #i "](%[w],%[c]), %%ymm15\n\t"                                                          \
    "vfmadd231ps %%ymm15, %%ymm12, %%ymm" #a0 "\n\t"                                                       \
    "vfmadd231ps %%ymm15, %%ymm13, %%ymm" #a1 "\n\t"                                                       \
    "vfmadd231ps %%ymm15, %%ymm14, %%ymm" #a2 "\n\t"
MT_AVX2 static void r4_tile_3(const float *wb, const float *xq, int64_t C, int64_t n, float *st, int64_t ss) {
    int64_t c = 0;
    __asm__ volatile(
        "vmovups (%[s0]), %%ymm0\n\t vmovups 64(%[s0]), %%ymm1\n\t vmovups 128(%[s0]), %%ymm2\n\t"
        "vmovups (%[s0],%[sb]), %%ymm3\n\t vmovups 64(%[s0],%[sb]), %%ymm4\n\t vmovups 128(%[s0],%[sb]), %%ymm5\n\t"
        "vmovups (%[s2]), %%ymm6\n\t vmovups 64(%[s2]), %%ymm7\n\t vmovups 128(%[s2]), %%ymm8\n\t"
        "vmovups (%[s2],%[sb]), %%ymm9\n\t vmovups 64(%[s2],%[sb]), %%ymm10\n\t vmovups 128(%[s2],%[sb]), %%ymm11\n\t"
        "1:\n\t"
        "vmovups (%[x0],%[c]), %%ymm12\n\t"
        "vmovups (%[x1],%[c]), %%ymm13\n\t"
        "vmovups (%[x2],%[c]), %%ymm14\n\t"
        R4_ROW3(0, 0, 1, 2) R4_ROW3(1, 3, 4, 5) R4_ROW3(2, 6, 7, 8) R4_ROW3(3, 9, 10, 11)
        "add $64, %[c]\n\t"
        "cmp %[n], %[c]\n\t"
        "jl 1b\n\t"
        "vmovups %%ymm0, (%[s0])\n\t vmovups %%ymm1, 64(%[s0])\n\t vmovups %%ymm2, 128(%[s0])\n\t"
        "vmovups %%ymm3, (%[s0],%[sb])\n\t vmovups %%ymm4, 64(%[s0],%[sb])\n\t vmovups %%ymm5, 128(%[s0],%[sb])\n\t"
        "vmovups %%ymm6, (%[s2])\n\t vmovups %%ymm7, 64(%[s2])\n\t vmovups %%ymm8, 128(%[s2])\n\t"
        "vmovups %%ymm9, (%[s2],%[sb])\n\t vmovups %%ymm10, 64(%[s2],%[sb])\n\t vmovups %%ymm11, 128(%[s2],%[sb])\n\t"
        : [c] "+r"(c)
        : [x0] "r"(xq), [x1] "r"(xq + C), [x2] "r"(xq + 2 * C), [w] "r"(wb), [n] "r"(n * 4), [s0] "r"(st),
          [s2] "r"(st + 2 * ss), [sb] "r"(ss * 4), [d0] "i"(0), [d1] "i"(R4_WS * 4), [d2] "i"(2 * R4_WS * 4),
          [d3] "i"(3 * R4_WS * 4)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
          "xmm13", "xmm14", "xmm15", "cc", "memory");
}

/* Whether pairs_rows4 takes a block of nr rows of T tokens: a whole block, groups that fit a
 * column block, and T tokens' lanes beside the buffer in MT_PAIR_BUF. */
static inline int r4_takes(const qmat *w, int64_t T, int nr) {
    return nr == RB && w->g <= R4_COLS && RB * R4_WS + RB * T * 16 <= MT_PAIR_BUF;
}

/* Rows [r0, r0 + RB) of every token (T > 1) from xp (int4) or x (int8); buf: MT_PAIR_BUF floats. */
MT_AVX2 static void pairs_rows4(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    const int64_t T = k->T, C = w->cols, R = w->rows;
    const int64_t bc = C < R4_COLS ? C : R4_COLS / w->g * w->g; /* whole groups (g <= R4_COLS) */
    const int64_t ws = R4_WS, ss = T * 16;
    float *wb = buf, *st = buf + RB * ws;
    const float *xs = k->xp ? k->xp : k->x; /* int4: xp's order, the buffer's too; int8: columns in order */
    memset(st, 0, sizeof(float) * (size_t)(RB * ss));
    const int64_t ntiles = (T + 2) / 3;
    for (int64_t c0 = 0; c0 < C; c0 += bc) {
        const int64_t c1 = c0 + bc < C ? c0 + bc : C;
        r4_dequant(w, r0, c0, c1, wb, ws);
        for (int64_t t0 = 0, tile = 0; t0 < T; tile++) {
            const int64_t nt = (T - t0 + (ntiles - tile) - 1) / (ntiles - tile); /* as even as possible */
            for (int h = 0; h < 16; h += 8) {
                const float *xq = xs + t0 * C + c0 + h;
                float *s = st + t0 * 16 + h;
                if (nt == 3) r4_tile_3(wb + h, xq, C, c1 - c0, s, ss);
                else r4_tile_2(wb + h, xq, C, c1 - c0, s, ss); /* T >= 2 tokens: tiles of 2 or 3 */
            }
            t0 += nt;
        }
    }
    for (int i = 0; i < RB; i++)
        for (int64_t t = 0; t < T; t++) {
            const float *a = st + i * ss + t * 16; /* int4: the even lanes, then the odd */
            const float v = k->xp ? hsum16_pairs(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8))
                                  : hsum16(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8));
            k->y[t * R + r0 + i] = k->bias ? v + k->bias[r0 + i] : v;
        }
}

/* 1 token x 4 rows of int8 weights, groups in multiples of 16 and whole (C a multiple of
 * g): fused_1x4's operations (the value q * scale, one fma per lane and chunk), with the
 * loops stepping pointers, the scales converted eight groups at a time and one prefetch
 * per cache line of each row PAIRS_AHEAD rows ahead -- 1.4x fused_1x4 in cache and 1.15x
 * from memory, one thread, Zen 3. */
#define INT8_ROW(n, p, s, xq)                                                                               \
    do {                                                                                                   \
        const __m256 w0_ = _mm256_mul_ps(                                                                  \
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))), s);          \
        const __m256 w1_ = _mm256_mul_ps(                                                                  \
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8)))), s);    \
        a##n##l = _mm256_fmadd_ps(w0_, _mm256_loadu_ps(xq), a##n##l);                                      \
        a##n##h = _mm256_fmadd_ps(w1_, _mm256_loadu_ps((xq) + 8), a##n##h);                                \
    } while (0)

MT_AVX2 INLINE void int8_1x4_g(const qmat *w, int64_t r0, const float *x, float *o, const int64_t G) {
    const int64_t rb = w->row_bytes, ng = w->ngroups;
    const uint8_t *p0 = w->data + r0 * rb, *p1 = p0 + rb, *p2 = p1 + rb, *p3 = p2 + rb;
    const uint16_t *s = w->scales + r0 * ng;
    const char *ahead = (const char *)(p0 + PAIRS_AHEAD * rb); /* past the end: a prefetch never faults */
    float sc[RB][8] __attribute__((aligned(32))); /* the scales of eight groups, per row */
    ACC(0);
    ACC(1);
    ACC(2);
    ACC(3);
    const float *xq = x;
    int64_t c = 0;
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        const int nn = ng - g0 < 8 ? (int)(ng - g0) : 8;
        for (int i = 0; i < RB; i++) {
            if (nn == 8)
                _mm256_store_ps(sc[i], _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i * ng + g0))));
            else
                for (int j = 0; j < nn; j++) sc[i][j] = _cvtsh_ss(s[i * ng + g0 + j]);
        }
        for (int j = 0; j < nn; j++) {
            const __m256 s0 = _mm256_broadcast_ss(&sc[0][j]), s1 = _mm256_broadcast_ss(&sc[1][j]);
            const __m256 s2 = _mm256_broadcast_ss(&sc[2][j]), s3 = _mm256_broadcast_ss(&sc[3][j]);
            for (int64_t k = 0; k < G; k += 16, c += 16) {
                if ((c & 63) == 0) { /* a new line of each row: fetch the same line of the rows ahead */
                    _mm_prefetch(ahead, MT_PF_HINT);
                    _mm_prefetch(ahead + rb, MT_PF_HINT);
                    _mm_prefetch(ahead + 2 * rb, MT_PF_HINT);
                    _mm_prefetch(ahead + 3 * rb, MT_PF_HINT);
                    ahead += 64;
                }
                INT8_ROW(0, p0, s0, xq);
                INT8_ROW(1, p1, s1, xq);
                INT8_ROW(2, p2, s2, xq);
                INT8_ROW(3, p3, s3, xq);
                p0 += 16;
                p1 += 16;
                p2 += 16;
                p3 += 16;
                xq += 16;
            }
        }
    }
    o[0] = OUT(0);
    o[1] = OUT(1);
    o[2] = OUT(2);
    o[3] = OUT(3);
}

MT_AVX2 static void int8_1x4(const qmat *w, int64_t r0, const float *x, float *o) {
    switch (w->g) {
    case 32: int8_1x4_g(w, r0, x, o, 32); break;
    case 64: int8_1x4_g(w, r0, x, o, 64); break;
    case 128: int8_1x4_g(w, r0, x, o, 128); break;
    default: int8_1x4_g(w, r0, x, o, w->g); break;
    }
}

/* 2 tokens x 2 rows. */
MT_AVX2 INLINE void fused_2x2(const int dtype, const qmat *w, int64_t r0, int64_t r1, const float *xa,
                              const float *xb, float *oa, float *ob) {
    const int64_t C = w->cols, cfull = C & ~(int64_t)15, step = GROUP_STEP(dtype, w);
    const wrow p = row_of(w, r0), q = row_of(w, r1);
    gscale sp = group_scale(dtype, p.sp, 0), sq = group_scale(dtype, q.sp, 0);
    ACC(0);
    ACC(1);
    ACC(2);
    ACC(3);
    int64_t next = step, gi = 0;
    for (int64_t c = 0; c < cfull; c += 16) {
        if (c == next) {
            gi++;
            next += step;
            sp = group_scale(dtype, p.sp, gi);
            sq = group_scale(dtype, q.sp, gi);
        }
        prefetch_ahead(dtype, p.rp, w->row_bytes, c);
        prefetch_ahead(dtype, q.rp, w->row_bytes, c);
        __m256 w0, w1;
        chunk_w(dtype, p.rp, c, sp, &w0, &w1);
        FMA2(0, w0, w1, _mm256_loadu_ps(xa + c), _mm256_loadu_ps(xa + c + 8));
        FMA2(1, w0, w1, _mm256_loadu_ps(xb + c), _mm256_loadu_ps(xb + c + 8));
        chunk_w(dtype, q.rp, c, sq, &w0, &w1);
        FMA2(2, w0, w1, _mm256_loadu_ps(xa + c), _mm256_loadu_ps(xa + c + 8));
        FMA2(3, w0, w1, _mm256_loadu_ps(xb + c), _mm256_loadu_ps(xb + c + 8));
    }
    if (cfull < C) {
        const int64_t g = cfull / (step < C ? step : C);
        __m256 xa0, xa1, xb0, xb1, w0, w1;
        x_tail(xa, cfull, C, &xa0, &xa1);
        x_tail(xb, cfull, C, &xb0, &xb1);
        chunk_tail(dtype, p.rp, cfull, C, group_scale(dtype, p.sp, g), &w0, &w1);
        FMA2(0, w0, w1, xa0, xa1);
        FMA2(1, w0, w1, xb0, xb1);
        chunk_tail(dtype, q.rp, cfull, C, group_scale(dtype, q.sp, g), &w0, &w1);
        FMA2(2, w0, w1, xa0, xa1);
        FMA2(3, w0, w1, xb0, xb1);
    }
    oa[0] = OUT(0);
    ob[0] = OUT(1);
    oa[1] = OUT(2);
    ob[1] = OUT(3);
}

/* NT (3 or 4) tokens x 1 row; for NT = 3 the fourth token pointer repeats the third and
 * its accumulator is discarded. */
MT_AVX2 INLINE void fused_4x1(const int dtype, const int nt, const qmat *w, int64_t r, const float *const *xr,
                              float *out, int64_t ostride) {
    const int64_t C = w->cols, cfull = C & ~(int64_t)15, step = GROUP_STEP(dtype, w);
    const wrow p = row_of(w, r);
    const float *x0 = xr[0], *x1 = xr[1], *x2 = xr[2], *x3 = xr[nt > 3 ? 3 : 2];
    gscale sp = group_scale(dtype, p.sp, 0);
    ACC(0);
    ACC(1);
    ACC(2);
    ACC(3);
    int64_t next = step, gi = 0;
    for (int64_t c = 0; c < cfull; c += 16) {
        if (c == next) {
            gi++;
            next += step;
            sp = group_scale(dtype, p.sp, gi);
        }
        prefetch_ahead(dtype, p.rp, w->row_bytes, c);
        __m256 w0, w1;
        chunk_w(dtype, p.rp, c, sp, &w0, &w1);
        FMA2(0, w0, w1, _mm256_loadu_ps(x0 + c), _mm256_loadu_ps(x0 + c + 8));
        FMA2(1, w0, w1, _mm256_loadu_ps(x1 + c), _mm256_loadu_ps(x1 + c + 8));
        FMA2(2, w0, w1, _mm256_loadu_ps(x2 + c), _mm256_loadu_ps(x2 + c + 8));
        if (nt > 3) FMA2(3, w0, w1, _mm256_loadu_ps(x3 + c), _mm256_loadu_ps(x3 + c + 8));
    }
    if (cfull < C) {
        const int64_t g = cfull / (step < C ? step : C);
        __m256 w0, w1, t0, t1;
        chunk_tail(dtype, p.rp, cfull, C, group_scale(dtype, p.sp, g), &w0, &w1);
        x_tail(x0, cfull, C, &t0, &t1);
        FMA2(0, w0, w1, t0, t1);
        x_tail(x1, cfull, C, &t0, &t1);
        FMA2(1, w0, w1, t0, t1);
        x_tail(x2, cfull, C, &t0, &t1);
        FMA2(2, w0, w1, t0, t1);
        if (nt > 3) {
            x_tail(x3, cfull, C, &t0, &t1);
            FMA2(3, w0, w1, t0, t1);
        }
    }
    out[0] = OUT(0);
    out[ostride] = OUT(1);
    out[2 * ostride] = OUT(2);
    if (nt > 3) out[3 * ostride] = OUT(3);
}

/* res[j][i] for tb tokens x RB rows (rows: RB row indices, repeats past R). */
#define FUSED_DT(DT)                                                                                       \
    MT_AVX2 static void fused_##DT(int tb, const qmat *w, const int64_t *rows, const float *const *xr,     \
                                   float res[TBMAX][RB]) {                                                 \
        switch (tb) {                                                                                      \
        case 1: fused_1x4(DT, w, rows, xr[0], &res[0][0]); break;                                          \
        case 2:                                                                                            \
            fused_2x2(DT, w, rows[0], rows[1], xr[0], xr[1], &res[0][0], &res[1][0]);                      \
            fused_2x2(DT, w, rows[2], rows[3], xr[0], xr[1], &res[0][2], &res[1][2]);                      \
            break;                                                                                         \
        default:                                                                                           \
            for (int i = 0; i < RB; i++) fused_4x1(DT, tb, w, rows[i], xr, &res[0][i], RB);                \
            break;                                                                                         \
        }                                                                                                  \
    }
FUSED_DT(DT_F32)
FUSED_DT(DT_BF16)
FUSED_DT(DT_INT8)
FUSED_DT(DT_INT4)

/* One token of int4 weights in two lanes (mt_lanes) through the pairs kernel. int8 weights
 * stay in blocks: int8_1x4 in four lanes measured no faster (Xeon, AVX2 path, 2 threads). */
static int64_t linear_lanes_avx2(const linear_ctx *k, int64_t r0, int64_t n) {
    if (k->T != 1 || !k->xp) return 0;
    const qmat *w = k->w;
    const int64_t L = mt_lanes(w, r0, n, 2);
    for (int64_t j = 0; j < L; j++) {
        const int64_t ra = r0 + j, rb = r0 + L + j;
        float res[2];
        pairs_1x2_rows(w, ra, rb, 1, k->xp, res);
        k->y[ra] = k->bias ? res[0] + k->bias[ra] : res[0];
        k->y[rb] = k->bias ? res[1] + k->bias[rb] : res[1];
    }
    return 2 * L;
}

static void linear_block_avx2(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    const int64_t R = w->rows, C = w->cols, T = k->T;
    const int nr = (int)(R - r0 < RB ? R - r0 : RB);
    const int quant = w->dtype == DT_INT8 || w->dtype == DT_INT4;
    /* groups that split a chunk, and mxfp4: dequantized rows, then tiles */
    if ((quant && w->g % 16) || w->dtype == DT_MXFP4) {
        if (T <= TBMAX) {
            mt_linear_block_tiles(k, r0, buf, row_values_avx2, tile_avx2);
            return;
        }
        const float *wr[RB];
        for (int i = 0; i < nr; i++) wr[i] = row_values_avx2(w, r0 + i, buf + i * k->blen);
        batch_rows(k, r0, nr, wr, buf + RB * k->blen);
        return;
    }
    /* one token: the pairs kernel (int4) or the int8 one (a last block of fewer rows: below) */
    if (k->xp && T > 1) { /* int4, several tokens (xp holds them all) */
        if (T >= MT_AVX2_R4_MIN && r4_takes(w, T, nr))
            pairs_rows4(k, r0, buf);
        else
            pairs_rows(k, r0, nr, buf);
        return;
    }
    const int int8_whole = w->dtype == DT_INT8 && w->g % 16 == 0 && C % w->g == 0, int8_one = T == 1 && int8_whole;
    if (int8_whole && T >= MT_AVX2_R4_MIN8 && r4_takes(w, T, nr)) { /* int8, several tokens */
        pairs_rows4(k, r0, buf);
        return;
    }
    if ((k->xp || int8_one) && nr == RB) {
        float res[RB];
        if (k->xp) {
            pairs_1x2(w, r0, k->xp, res);
            pairs_1x2(w, r0 + 2, k->xp, res + 2);
        } else {
            int8_1x4(w, r0, k->x, res);
        }
        for (int i = 0; i < RB; i++) k->y[r0 + i] = k->bias ? res[i] + k->bias[r0 + i] : res[i];
        return;
    }
    /* chunks dequantized in registers, for each tile of up to TBMAX tokens */
    int64_t rows[RB];
    for (int i = 0; i < RB; i++) rows[i] = r0 + (i < nr ? i : nr - 1); /* past R: repeat (unused) */
    for (int64_t t0 = 0; t0 < T; t0 += TBMAX) {
        const int tb = (int)(T - t0 < TBMAX ? T - t0 : TBMAX);
        const float *xr[TBMAX];
        for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (t0 + (j < tb ? j : 0)) * C;
        float res[TBMAX][RB];
        switch (w->dtype) {
        case DT_F32: fused_DT_F32(tb, w, rows, xr, res); break;
        case DT_BF16: fused_DT_BF16(tb, w, rows, xr, res); break;
        case DT_INT8: fused_DT_INT8(tb, w, rows, xr, res); break;
        default: fused_DT_INT4(tb, w, rows, xr, res); break;
        }
        for (int j = 0; j < tb; j++)
            for (int i = 0; i < nr; i++)
                k->y[(t0 + j) * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
    }
}

/* ---------------------------------------------------------------- many tokens: outer products
 * For many tokens the contract's accumulators are laid out so the fma can be an outer
 * product, as in a GEMM micro-kernel: one register holds lane l of eight output rows,
 * updated with eight weights of one column (rows r..r+7, column 16k + l) times one
 * token's value at that column, broadcast. Per (token, row, lane) that is exactly the
 * contract's acc[l] = fma(w[16k + l], x[16k + l], acc[l]) for k = 0, 1, ... in order;
 * the lanes are then summed by the contract's tree, eight rows at a time.
 * Tokens are first copied lane-major (xt[t][l][k] = x[t][16k + l], 0 past C), and each
 * panel of PANEL rows is dequantized and transposed the same way (P[l][k][r]), so both
 * operands of a lane's pass stream from consecutive addresses. */
#define PANEL 24
#define NTT 4

typedef struct {
    const float *xt; /* [T][16][nk] */
    int64_t T, nk;
    const qmat *w;
    const float *bias;
    float *y;
    atomic_int failed;
} many_ctx;

/* eight values of row `row` at columns [c, c + 8), 0 at columns >= C */
MT_AVX2 INLINE __m256 load8(const float *row, int64_t c, int64_t C) {
    return c + 8 <= C ? _mm256_loadu_ps(row + c) : _mm256_maskload_ps(row + c, lane_mask(C - c));
}

/* In-register 8x8 transpose: r[i] (row i) -> r[j] (column j). */
MT_AVX2 INLINE void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* P[(l * nk + k) * PANEL + i] = value of row r0 + i at column 16k + l (0 past C or past R). */
MT_AVX2 static int build_panel(const qmat *w, int64_t r0, int64_t nk, float *P) {
    const int64_t R = w->rows, C = w->cols, blen = mt_rowbuf_len(w);
    float *rb = mt_scratch(2, (size_t)(PANEL * blen));
    if (!rb) return -1;
    const float *rows[PANEL];
    for (int i = 0; i < PANEL; i++) rows[i] = r0 + i < R ? row_values_avx2(w, r0 + i, rb + i * blen) : NULL;
    for (int h = 0; h < PANEL; h += 8)
        for (int64_t c = 0; c < nk * 16; c += 8) {
            __m256 v[8];
            for (int i = 0; i < 8; i++) v[i] = rows[h + i] && c < C ? load8(rows[h + i], c, C) : _mm256_setzero_ps();
            transpose8(v); /* v[j]: column c + j of rows h..h+7 */
            const int64_t k = c / 16, l0 = c % 16;
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(P + ((l0 + j) * nk + k) * PANEL + h, v[j]);
        }
    return 0;
}

/* Lane l of PANEL (24) rows x NT (<= 4) tokens over every k: twelve accumulators, three
 * weight registers reused by every token, each token's value broadcast from memory (a
 * broadcast per three fmas). The lane's results go to S[(j * 16 + l) * PANEL + i].
 * Accumulators are named variables: in an array the compiler stores them to the stack on
 * every k. */
#define MACC(j) __m256 m##j##0 = _mm256_setzero_ps(), m##j##1 = _mm256_setzero_ps(), m##j##2 = _mm256_setzero_ps()
#define MANY_STEP(j)                                                                                       \
    if (nt_ > j) {                                                                                         \
        const __m256 xb = _mm256_broadcast_ss(px + j * 16 * nk + k);                                       \
        m##j##0 = _mm256_fmadd_ps(w0, xb, m##j##0);                                                        \
        m##j##1 = _mm256_fmadd_ps(w1, xb, m##j##1);                                                        \
        m##j##2 = _mm256_fmadd_ps(w2, xb, m##j##2);                                                        \
    }
#define MANY_STORE(j)                                                                                      \
    if (nt_ > j) {                                                                                         \
        _mm256_storeu_ps(S + (j * 16 + l) * PANEL, m##j##0);                                               \
        _mm256_storeu_ps(S + (j * 16 + l) * PANEL + 8, m##j##1);                                           \
        _mm256_storeu_ps(S + (j * 16 + l) * PANEL + 16, m##j##2);                                          \
    }
#define MANY_MK(NT)                                                                                        \
    MT_AVX2 static void many_mk_##NT(const float *P, const float *xt, int64_t nk, int l, float *S) {        \
        const int nt_ = NT;                                                                                \
        MACC(0);                                                                                           \
        MACC(1);                                                                                           \
        MACC(2);                                                                                           \
        MACC(3);                                                                                           \
        const float *pw = P + (int64_t)l * nk * PANEL;                                                     \
        const float *px = xt + (int64_t)l * nk;                                                            \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < nk; k++) {                                        \
            const __m256 w0 = _mm256_loadu_ps(pw + k * PANEL), w1 = _mm256_loadu_ps(pw + k * PANEL + 8);   \
            const __m256 w2 = _mm256_loadu_ps(pw + k * PANEL + 16);                                        \
            MANY_STEP(0) MANY_STEP(1) MANY_STEP(2) MANY_STEP(3)                                            \
        }                                                                                                  \
        MANY_STORE(0) MANY_STORE(1) MANY_STORE(2) MANY_STORE(3)                                            \
    }
MANY_MK(1)
MANY_MK(2)
MANY_MK(3)
MANY_MK(4)

/* y rows [r0, r0 + PANEL) of tokens [t0, t0 + nt) from their sixteen lanes in S: the
 * contract's tree (i + 8, i + 4, i + 2, i + 1), eight rows per register. */
MT_AVX2 static void many_reduce(const float *S, int nt, int64_t t0, int64_t r0, const many_ctx *m) {
    const int64_t R = m->w->rows;
    for (int j = 0; j < nt; j++)
        for (int h = 0; h < PANEL; h += 8) {
            __m256 v[16];
            for (int l = 0; l < 16; l++) v[l] = _mm256_loadu_ps(S + (j * 16 + l) * PANEL + h);
            for (int i = 0; i < 8; i++) v[i] = _mm256_add_ps(v[i], v[i + 8]);
            for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(v[i], v[i + 4]);
            for (int i = 0; i < 2; i++) v[i] = _mm256_add_ps(v[i], v[i + 2]);
            float d[8];
            _mm256_storeu_ps(d, _mm256_add_ps(v[0], v[1]));
            for (int i = 0; i < 8 && r0 + h + i < R; i++) {
                const int64_t r = r0 + h + i;
                m->y[(t0 + j) * R + r] = m->bias ? d[i] + m->bias[r] : d[i];
            }
        }
}

static void many_panel(void *ctx, int64_t panel) {
    many_ctx *m = ctx;
    const int64_t nk = m->nk, r0 = panel * PANEL;
    float *P = mt_scratch(0, (size_t)(16 * nk * PANEL)), *S = mt_scratch(1, (size_t)(NTT * 16 * PANEL));
    if (!P || !S || build_panel(m->w, r0, nk, P) < 0) {
        atomic_store(&m->failed, 1);
        return;
    }
    for (int64_t t0 = 0; t0 < m->T; t0 += NTT) {
        const int nt = (int)(m->T - t0 < NTT ? m->T - t0 : NTT);
        const float *xt = m->xt + t0 * 16 * nk;
        for (int l = 0; l < 16; l++) switch (nt) {
            case 4: many_mk_4(P, xt, nk, l, S); break;
            case 3: many_mk_3(P, xt, nk, l, S); break;
            case 2: many_mk_2(P, xt, nk, l, S); break;
            default: many_mk_1(P, xt, nk, l, S); break;
            }
        many_reduce(S, nt, t0, r0, m);
    }
}

static int linear_many_avx2(int nthreads, const float *x, int64_t T, const qmat *w, const float *bias, float *y) {
    const int64_t C = w->cols, nk = (C + 15) / 16;
    float *xt = mt_xalloc((size_t)(T * 16 * nk) * 4);
    if (!xt) return -1;
    for (int64_t t = 0; t < T; t++)
        for (int l = 0; l < 16; l++)
            for (int64_t k = 0; k < nk; k++) {
                const int64_t c = 16 * k + l;
                xt[(t * 16 + l) * nk + k] = c < C ? x[t * C + c] : 0.0f;
            }
    many_ctx m = {xt, T, nk, w, bias, y, 0};
    mt_pool_run(nthreads, (w->rows + PANEL - 1) / PANEL, many_panel, &m);
    free(xt);
    return atomic_load(&m.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------- int8 activations (lossy)
 * The int8-activation contract (mt.h) with vpmaddubsw: eight rows at a time, lane = row,
 * one block of 64 columns per step. int4: a block's 32 bytes, masked (low nibbles: the
 * block's even columns) and shifted then masked (high nibbles: its odd ones), the order
 * the activations were stored in; the nibbles (0..15) multiply the activations exactly
 * (i16 pairs <= 2 * 15 * 127, two added <= 7620), and 8 * sum(xq) is subtracted after.
 * int8: |q| times xq with q's sign (pairs <= 2 * 127 * 127 < 2^15), in two halves. */

/* eight vectors of eight int32 -> one vector of their eight sums (exact) */
MT_AVX2 INLINE __m256i hsum8x8(const __m256i p[8]) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Block b's exact integer sums of eight rows (rp) with one token's activations xb: int8, the
 * block's 64 in order; int4, its 32 even columns (the odd ones 64 further, mt_q8_pos). */
MT_AVX2 INLINE __m256i q8_block(const int int4, const uint8_t *const *rp, int64_t b, const int8_t *xb) {
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F);
    const __m256i X0 = _mm256_loadu_si256((const __m256i *)xb),
                  X1 = _mm256_loadu_si256((const __m256i *)(xb + (int4 ? MT_Q8B : 32)));
    __m256i p[8];
    for (int i = 0; i < 8; i++) {
        if (int4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(rp[i] + b * 32));
            const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            p[i] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, X0), _mm256_maddubs_epi16(hi, X1)),
                                     ones);
        } else {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(rp[i] + b * 64));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(rp[i] + b * 64 + 32));
            p[i] = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q0), _mm256_sign_epi8(X0, q0)), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q1), _mm256_sign_epi8(X1, q1)), ones));
        }
    }
    return hsum8x8(p);
}

MT_AVX2 INLINE void q8_rows_dt(const int int4, const q8ctx *k, int64_t r0, int64_t n, float *wsv) {
    const qmat *w = k->w;
    const int64_t R = w->rows, nb = k->nb, gpb = w->g / MT_Q8B; /* blocks per weight group */
    for (int64_t g0 = r0; g0 < r0 + n; g0 += 8) {
        const int nr = (int)(r0 + n - g0 < 8 ? r0 + n - g0 : 8);
        const uint8_t *rp[8];
        for (int i = 0; i < 8; i++) {
            const int64_t r = g0 + (i < nr ? i : nr - 1); /* past the chunk: repeat (unused) */
            rp[i] = w->data + r * w->row_bytes;
            for (int64_t gi = 0; gi < w->ngroups; gi++) wsv[gi * 8 + i] = _cvtsh_ss(w->scales[r * w->ngroups + gi]);
        }
        /* the next eight rows, fetched while the first token walks these: one stream a row, a
         * group of rows ahead (past the chunk or the matrix: a prefetch never faults) */
        const int64_t ahead = 8 * w->row_bytes, bb = int4 ? 32 : 64; /* bytes of a row per block */
        for (int64_t t = 0; t < k->T; t++) {
            const int8_t *xq = k->xq + t * k->xstride;
            const float *xs = k->xs + t * nb;
            const int32_t *xsum = k->xsum + t * nb;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b0 = 0, gi = 0; b0 < nb; b0 += gpb, gi++) {
                const __m256 ws = _mm256_loadu_ps(wsv + gi * 8);
                const int64_t b1 = b0 + gpb < nb ? b0 + gpb : nb;
                for (int64_t b = b0; b < b1; b++) {
                    if (t == 0 && ((b * bb) & 63) == 0)
                        for (int i = 0; i < 8; i++) _mm_prefetch((const char *)rp[i] + ahead + b * bb, MT_PF_HINT);
                    __m256i isum = q8_block(int4, rp, b, xq + (int4 ? mt_q8_pos(DT_INT4, MT_Q8B * b) : MT_Q8B * b));
                    if (int4) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * xsum[b]));
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_set1_ps(xs[b])), _mm256_cvtepi32_ps(isum), acc);
                }
            }
            float o[8];
            _mm256_storeu_ps(o, acc);
            for (int i = 0; i < nr; i++)
                k->y[t * R + g0 + i] = k->bias ? o[i] + k->bias[g0 + i] : o[i];
        }
    }
}

MT_AVX2 static void q8_rows_avx2(const q8ctx *k, int64_t r0, int64_t n) {
    float *wsv = mt_scratch(8, (size_t)(k->w->ngroups * 8));
    if (!wsv) /* no memory for 8 scales per group: the generic loop needs none */
        mt_q8_rows_generic(k, r0, n);
    else if (k->w->dtype == DT_INT4)
        q8_rows_dt(1, k, r0, n, wsv);
    else
        q8_rows_dt(0, k, r0, n, wsv);
}

/* ---------------------------------------------------------------- elementwise, sums, P.V */

MT_AVX2 INLINE __m256 exp_avx2(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    const __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P5));
    y = _mm256_fmadd_ps(y, z, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    /* n outside [-125, 128] only where x is outside [EXP_LO, EXP_HI] (or NaN): replaced below */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    __m256 res = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ));
    res = _mm256_blendv_ps(res, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ));
    return _mm256_blendv_ps(res, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

MT_AVX2 static void exp_shift_avx2(const float *x, float m, int64_t n, float *y) {
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    if (i < n) {
        const __m256i k = lane_mask(n - i);
        _mm256_maskstore_ps(y + i, k, exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + i, k), mv)));
    }
}

MT_AVX2 static void swiglu_avx2(float *g, const float *u, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i k = lane_mask(n - i);
        const __m256 gv = _mm256_maskload_ps(g + i, k);
        const __m256 sl = _mm256_div_ps(gv, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, gv))));
        _mm256_maskstore_ps(g + i, k, _mm256_mul_ps(sl, _mm256_maskload_ps(u + i, k)));
    }
}

MT_AVX2 static float sum_avx2(const float *a, int64_t n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    const int64_t nfull = n & ~(int64_t)15;
    for (int64_t k = 0; k < nfull; k += 16) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(a + k));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(a + k + 8));
    }
    if (nfull < n) {
        lo = _mm256_add_ps(lo, _mm256_maskload_ps(a + nfull, lane_mask(n - nfull)));
        hi = _mm256_add_ps(hi, _mm256_maskload_ps(a + nfull + 8, lane_mask(n - nfull - 8)));
    }
    return hsum16(lo, hi);
}

MT_AVX2 static float max_avx2(const float *a, int64_t n) {
    /* lane-wise m = x > m ? x : m (NaN never wins), then the lanes the same way */
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        m = _mm256_blendv_ps(m, x, _mm256_cmp_ps(x, m, _CMP_GT_OQ));
    }
    float l[8], r = -INFINITY;
    _mm256_storeu_ps(l, m);
    for (int j = 0; j < 8; j++) r = l[j] > r ? l[j] : r;
    for (; i < n; i++) r = a[i] > r ? a[i] : r;
    return r;
}

MT_AVX2 static void divide_avx2(float *y, float d, int64_t n) {
    const __m256 dv = _mm256_set1_ps(d);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_loadu_ps(y + i), dv));
    for (; i < n; i++) y[i] = y[i] / d;
}

/* acc[h][d0 .. d0 + 8 NC) over s in [s0, s1), increasing, for NH heads: NC registers of 8
 * values each (twelve accumulators at 4 x 3, all named variables: in an array the compiler
 * keeps them in memory and every fma waits for a store), v's registers shared by the
 * heads, each head's p[s] broadcast. Whole registers load and store plainly; the last
 * register of a row whose width is not a multiple of 8 is masked (tail = its lanes). */
#define PV_LD(h, c)                                                                                        \
    __m256 a##h##c = _mm256_setzero_ps();                                                                  \
    if (NH_ > h && NC_ > c)                                                                                \
        a##h##c = (c == NC_ - 1 && tail) ? _mm256_maskload_ps(acc[h] + d0 + 8 * c, mt)                    \
                                         : _mm256_loadu_ps(acc[h] + d0 + 8 * c);
#define PV_ST(h, c)                                                                                        \
    if (NH_ > h && NC_ > c) {                                                                              \
        if (c == NC_ - 1 && tail)                                                                          \
            _mm256_maskstore_ps(acc[h] + d0 + 8 * c, mt, a##h##c);                                         \
        else                                                                                               \
            _mm256_storeu_ps(acc[h] + d0 + 8 * c, a##h##c);                                                \
    }
#define PV_STEP(h)                                                                                         \
    if (NH_ > h) {                                                                                         \
        const __m256 ps = _mm256_broadcast_ss(p[h] + s);                                                   \
        a##h##0 = _mm256_fmadd_ps(ps, v0, a##h##0);                                                        \
        if (NC_ > 1) a##h##1 = _mm256_fmadd_ps(ps, v1, a##h##1);                                           \
        if (NC_ > 2) a##h##2 = _mm256_fmadd_ps(ps, v2, a##h##2);                                           \
    }
#define PV_MK(NH, NC)                                                                                      \
    MT_AVX2 static void pv_mk_##NH##_##NC(const float *const *p, const float *v, int64_t vstride,           \
                                          int64_t s0, int64_t s1, int64_t d0, int tail, float *const *acc) { \
        const int NH_ = NH, NC_ = NC;                                                                      \
        const __m256i mt = lane_mask(tail);                                                                \
        PV_LD(0, 0) PV_LD(0, 1) PV_LD(0, 2) PV_LD(1, 0) PV_LD(1, 1) PV_LD(1, 2)                            \
        PV_LD(2, 0) PV_LD(2, 1) PV_LD(2, 2) PV_LD(3, 0) PV_LD(3, 1) PV_LD(3, 2)                            \
        for (int64_t s = s0; s < s1; s++) {                                                                \
            const float *vr = v + s * vstride + d0;                                                        \
            const __m256 v0 = (NC_ == 1 && tail) ? _mm256_maskload_ps(vr, mt) : _mm256_loadu_ps(vr);      \
            const __m256 v1 = NC_ < 2 ? v0 : (NC_ == 2 && tail) ? _mm256_maskload_ps(vr + 8, mt)           \
                                                                 : _mm256_loadu_ps(vr + 8);                \
            const __m256 v2 = NC_ < 3 ? v0 : tail ? _mm256_maskload_ps(vr + 16, mt) : _mm256_loadu_ps(vr + 16); \
            PV_STEP(0) PV_STEP(1) PV_STEP(2) PV_STEP(3)                                                    \
        }                                                                                                  \
        PV_ST(0, 0) PV_ST(0, 1) PV_ST(0, 2) PV_ST(1, 0) PV_ST(1, 1) PV_ST(1, 2)                            \
        PV_ST(2, 0) PV_ST(2, 1) PV_ST(2, 2) PV_ST(3, 0) PV_ST(3, 1) PV_ST(3, 2)                            \
    }
PV_MK(1, 1) PV_MK(1, 2) PV_MK(1, 3)
PV_MK(2, 1) PV_MK(2, 2) PV_MK(2, 3)
PV_MK(3, 1) PV_MK(3, 2) PV_MK(3, 3)
PV_MK(4, 1) PV_MK(4, 2) PV_MK(4, 3)

typedef void (*pv_fn)(const float *const *, const float *, int64_t, int64_t, int64_t, int64_t, int,
                      float *const *);
static const pv_fn pv_mks[4][3] = {{pv_mk_1_1, pv_mk_1_2, pv_mk_1_3}, {pv_mk_2_1, pv_mk_2_2, pv_mk_2_3},
                                   {pv_mk_3_1, pv_mk_3_2, pv_mk_3_3}, {pv_mk_4_1, pv_mk_4_2, pv_mk_4_3}};

/* acc[h][d] = fma(p[h][s], v[s][d], acc[h][d]) for s in [s0, s1), increasing: passes of 24
 * values of d (12 accumulators for 4 heads), then the rest. */
MT_AVX2 static void pv_avx2(int nh, const float *const *p, const float *v, int64_t vstride, int64_t s0,
                            int64_t s1, int64_t dv, float *const *acc) {
    const pv_fn *mk = pv_mks[nh - 1];
    int64_t d0 = 0;
    for (; d0 + 24 <= dv; d0 += 24) mk[2](p, v, vstride, s0, s1, d0, 0, acc);
    const int64_t left = dv - d0;
    if (left > 0) mk[(left + 7) / 8 - 1](p, v, vstride, s0, s1, d0, (int)(left % 8), acc);
}

MT_AVX2 static double fma_probe_avx2(int64_t n, float seed) {
    __m256 a0 = _mm256_set1_ps(seed), a1 = _mm256_add_ps(a0, a0), a2 = _mm256_add_ps(a1, a0);
    __m256 a3 = _mm256_add_ps(a2, a0), a4 = _mm256_add_ps(a3, a0), a5 = _mm256_add_ps(a4, a0);
    __m256 a6 = _mm256_add_ps(a5, a0), a7 = _mm256_add_ps(a6, a0), a8 = _mm256_add_ps(a7, a0);
    __m256 a9 = _mm256_add_ps(a8, a0), a10 = _mm256_add_ps(a9, a0), a11 = _mm256_add_ps(a10, a0);
    const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t k = 0; k < n; k++) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c); a2 = _mm256_fmadd_ps(a2, b, c);
        a3 = _mm256_fmadd_ps(a3, b, c); a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c); a8 = _mm256_fmadd_ps(a8, b, c);
        a9 = _mm256_fmadd_ps(a9, b, c); a10 = _mm256_fmadd_ps(a10, b, c); a11 = _mm256_fmadd_ps(a11, b, c);
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    volatile float sink = hsum16(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    (void)sink;
    return 2.0 * 12 * 8 * (double)n;
}

MT_AVX2 static uint64_t read_probe_avx2(const uint8_t *p, int64_t bytes) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 128 <= bytes; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    uint64_t o[4];
    _mm256_storeu_si256((__m256i *)o, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
    return o[0] + o[1] + o[2] + o[3];
}

/* The AVX-512 table's int8-activation rows too (its CPUs have AVX2; no 512-bit kernel of its own yet). */
void mt_q8_rows_avx2(const q8ctx *k, int64_t r0, int64_t n) { q8_rows_avx2(k, r0, n); }

static int cpu_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

const mt_isa mt_isa_avx2 = {
    .name = "avx2",
    .supported = cpu_avx2,
    .linear_block = linear_block_avx2,
    .linear_lanes = linear_lanes_avx2,
    .linear_many = linear_many_avx2,
    .many_min = MT_AVX2_MANY_MIN,
    .xp_order = MT_XP_PAIRS32,
    .q8_rows = q8_rows_avx2,
    .tile = tile_avx2,
    .sum = sum_avx2,
    .max = max_avx2,
    .divide = divide_avx2,
    .exp_shift = exp_shift_avx2,
    .swiglu = swiglu_avx2,
    .pv = pv_avx2,
    .fma_probe = fma_probe_avx2,
    .read_probe = read_probe_avx2,
};
#endif
