/* The aarch64 NEON path (Advanced SIMD is part of every AArch64 CPU). The same bits as
 * generic.c: see the contract in mt.h. The contract's sixteen lanes are four float32x4
 * registers (lanes 0-3, 4-7, 8-11, 12-15); vfmaq_f32 is the single-rounding fma and
 * vdivq_f32 / vrndnq_f32 are the IEEE operations the contract names.
 *
 * Tested without an ARM machine: tests/kernels_driver.c, cross-compiled and run under
 * qemu-user, checks these kernels against the portable ones and against outputs recorded
 * from the x86 build (tests/test_kernels_neon.py). */
#include <stdlib.h>
#include <string.h>

#include "mt.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum16(float32x4_t a0, float32x4_t a1, float32x4_t a2, float32x4_t a3) {
    const float32x4_t s8lo = vaddq_f32(a0, a2), s8hi = vaddq_f32(a1, a3); /* i, i+8 */
    const float32x4_t s4 = vaddq_f32(s8lo, s8hi);                          /* i, i+4 */
    const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4)); /* i, i+2 */
    return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);                    /* 0, 1 */
}

/* 16 floats from p, lanes >= n (n in [0, 16]) read as 0 and never loaded. */
INLINE void load16_tail(const float *p, int64_t n, float32x4_t v[4]) {
    float tmp[16] = {0};
    memcpy(tmp, p, (size_t)n * 4);
    for (int c = 0; c < 4; c++) v[c] = vld1q_f32(tmp + 4 * c);
}

/* ---------------------------------------------------------------- f32 tiles */

#define TILE_MK(NT, NR)                                                                                    \
    static void tile_mk_##NT##_##NR(const float *const *xr, const float *const *wr, int64_t n,              \
                                    float out[TBMAX][RB], int i0) {                                        \
        float32x4_t a[NT][NR][4];                                                                          \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++)                                                                   \
                for (int c = 0; c < 4; c++) a[j][i][c] = vdupq_n_f32(0.0f);                                \
        const int64_t nfull = n & ~(int64_t)15;                                                            \
        for (int64_t k = 0; k < nfull; k += 16) {                                                          \
            float32x4_t w[NR][4];                                                                          \
            for (int i = 0; i < NR; i++)                                                                   \
                for (int c = 0; c < 4; c++) w[i][c] = vld1q_f32(wr[i0 + i] + k + 4 * c);                   \
            for (int j = 0; j < NT; j++)                                                                   \
                for (int c = 0; c < 4; c++) {                                                              \
                    const float32x4_t xv = vld1q_f32(xr[j] + k + 4 * c);                                   \
                    for (int i = 0; i < NR; i++) a[j][i][c] = vfmaq_f32(a[j][i][c], w[i][c], xv);          \
                }                                                                                          \
        }                                                                                                  \
        if (nfull < n) {                                                                                   \
            float32x4_t w[NR][4];                                                                          \
            for (int i = 0; i < NR; i++) load16_tail(wr[i0 + i] + nfull, n - nfull, w[i]);                \
            for (int j = 0; j < NT; j++) {                                                                 \
                float32x4_t xv[4];                                                                         \
                load16_tail(xr[j] + nfull, n - nfull, xv);                                                 \
                for (int c = 0; c < 4; c++)                                                                \
                    for (int i = 0; i < NR; i++) a[j][i][c] = vfmaq_f32(a[j][i][c], w[i][c], xv[c]);       \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++)                                                                   \
                out[j][i0 + i] = hsum16(a[j][i][0], a[j][i][1], a[j][i][2], a[j][i][3]);                   \
    }
TILE_MK(1, 4)
TILE_MK(2, 2)
TILE_MK(3, 1)
TILE_MK(4, 1)

static void tile_neon(int tb, const float *const *xr, const float *const *wr, int64_t n, float out[TBMAX][RB]) {
    switch (tb) {
    case 1: tile_mk_1_4(xr, wr, n, out, 0); break;
    case 2: tile_mk_2_2(xr, wr, n, out, 0); tile_mk_2_2(xr, wr, n, out, 2); break;
    case 3:
        for (int i = 0; i < RB; i++) tile_mk_3_1(xr, wr, n, out, i);
        break;
    default:
        for (int i = 0; i < RB; i++) tile_mk_4_1(xr, wr, n, out, i);
        break;
    }
}

/* ---------------------------------------------------------------- weights in registers */

/* Sixteen weights of row rp at column c (c a multiple of 16, inside the stored row):
 * exactly the dequantized values. int4: nibbles of the 8 bytes, zipped into column order,
 * widened, then (nibble - 8) * scale as one fma with scale and -8 * scale (exact, mt.h). */
INLINE void chunk_w(const int dtype, const uint8_t *rp, int64_t c, float32x4_t sc, float32x4_t m8,
                    float32x4_t w[4]) {
    if (dtype == DT_F32) {
        for (int k = 0; k < 4; k++) w[k] = vld1q_f32((const float *)rp + c + 4 * k);
    } else if (dtype == DT_BF16) {
        const uint16x8_t h0 = vld1q_u16((const uint16_t *)rp + c), h1 = vld1q_u16((const uint16_t *)rp + c + 8);
        w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h0), 16));
        w[1] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h0), 16));
        w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h1), 16));
        w[3] = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h1), 16));
    } else if (dtype == DT_INT8) {
        const int8x16_t q = vld1q_s8((const int8_t *)rp + c);
        const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
        w[0] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), sc);
        w[1] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), sc);
        w[2] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), sc);
        w[3] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))), sc);
    } else {
        const uint8x8_t b = vld1_u8(rp + c / 2);
        const uint8x8_t lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
        const uint16x8_t n0 = vmovl_u8(vzip1_u8(lo, hi)), n1 = vmovl_u8(vzip2_u8(lo, hi)); /* cols 0-7, 8-15 */
        w[0] = vfmaq_f32(m8, vcvtq_f32_u32(vmovl_u16(vget_low_u16(n0))), sc);
        w[1] = vfmaq_f32(m8, vcvtq_f32_u32(vmovl_u16(vget_high_u16(n0))), sc);
        w[2] = vfmaq_f32(m8, vcvtq_f32_u32(vmovl_u16(vget_low_u16(n1))), sc);
        w[3] = vfmaq_f32(m8, vcvtq_f32_u32(vmovl_u16(vget_high_u16(n1))), sc);
    }
}

/* mxfp4, sixteen columns at c: each nibble's magnitude doubled (0, 1, 2, 3, 4, 6, 8, 12:
 * integers) by a byte table lookup, widened, times half the scale (a power of two: exact),
 * then the nibble's sign bit set (-0 kept): exactly e2m1(nibble) * scale (mt.h). */
INLINE void chunk_mxfp4(const uint8_t *rp, int64_t c, float32x4_t half_sc, float32x4_t w[4]) {
    static const uint8_t mag2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0};
    const uint8x8_t b = vld1_u8(rp + c / 2);
    const uint8x8_t lo = vand_u8(b, vdup_n_u8(15)), hi = vshr_n_u8(b, 4);
    const uint8x16_t nib = vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi)); /* columns 0-15 */
    const uint8x16_t m = vqtbl1q_u8(vld1q_u8(mag2), vandq_u8(nib, vdupq_n_u8(7)));
    const uint8x16_t sg = vandq_u8(nib, vdupq_n_u8(8));
    const uint16x8_t m0 = vmovl_u8(vget_low_u8(m)), m1 = vmovl_u8(vget_high_u8(m));
    const uint16x8_t s0 = vmovl_u8(vget_low_u8(sg)), s1 = vmovl_u8(vget_high_u8(sg));
    const uint16x4_t mv[4] = {vget_low_u16(m0), vget_high_u16(m0), vget_low_u16(m1), vget_high_u16(m1)};
    const uint16x4_t sv[4] = {vget_low_u16(s0), vget_high_u16(s0), vget_low_u16(s1), vget_high_u16(s1)};
    for (int k = 0; k < 4; k++) {
        const float32x4_t v = vmulq_f32(vcvtq_f32_u32(vmovl_u16(mv[k])), half_sc);
        w[k] = vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(v), vshlq_n_u32(vmovl_u16(sv[k]), 28)));
    }
}

/* Row values for the buffered paths: exactly mt_dequant_row_generic. */
static const float *row_values_neon(const qmat *w, int64_t r, float *buf) {
    const uint8_t *row = w->data + r * w->row_bytes;
    if (w->dtype == DT_F32) return (const float *)row;
    if (w->dtype == DT_MXFP4) {
        const uint8_t *es = w->escales + r * w->ngroups;
        for (int64_t gi = 0; gi < w->ngroups; gi++) {
            const float32x4_t half_sc = vdupq_n_f32(mt_e8m0(es[gi]) * 0.5f);
            for (int64_t c = gi * MT_MX_GROUP; c < (gi + 1) * MT_MX_GROUP; c += 16) {
                float32x4_t wv[4];
                chunk_mxfp4(row, c, half_sc, wv);
                for (int k = 0; k < 4; k++) vst1q_f32(buf + c + 4 * k, wv[k]);
            }
        }
        return buf;
    }
    if (w->dtype == DT_BF16 || w->g % 16) {
        mt_dequant_row_generic(w, r, buf);
        return buf;
    }
    const uint16_t *s = w->scales + r * w->ngroups;
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const float v = mt_f16(s[gi]);
        const float32x4_t sc = vdupq_n_f32(v), m8 = vdupq_n_f32(-8.0f * v);
        for (int64_t c = gi * w->g; c < (gi + 1) * w->g; c += 16) {
            float32x4_t wv[4];
            chunk_w(w->dtype, row, c, sc, m8, wv);
            for (int k = 0; k < 4; k++) vst1q_f32(buf + c + 4 * k, wv[k]);
        }
    }
    return buf;
}

/* Fused decode: NT tokens x NR rows, each chunk of a row dequantized in registers. */
#define FUSED_MK(NT, NR)                                                                                   \
    INLINE void fused_mk_##NT##_##NR(const int dtype, const qmat *w, const int64_t *rows,                  \
                                     const float *const *xr, float out[TBMAX][RB], int i0) {                \
        const int64_t C = w->cols, cfull = C & ~(int64_t)15;                                               \
        const int quant = dtype == DT_INT8 || dtype == DT_INT4;                                            \
        const int64_t step = quant ? w->g : 64;                                                            \
        const uint8_t *rp[NR];                                                                             \
        const uint16_t *sp[NR];                                                                            \
        for (int i = 0; i < NR; i++) {                                                                     \
            rp[i] = w->data + rows[i0 + i] * w->row_bytes;                                                 \
            sp[i] = quant ? w->scales + rows[i0 + i] * w->ngroups : NULL;                                   \
        }                                                                                                  \
        float32x4_t a[NT][NR][4];                                                                          \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++)                                                                   \
                for (int c = 0; c < 4; c++) a[j][i][c] = vdupq_n_f32(0.0f);                                \
        int64_t gi = 0;                                                                                    \
        for (int64_t s0 = 0; s0 < cfull; s0 += step, gi++) {                                               \
            float32x4_t sc[NR], m8[NR];                                                                    \
            for (int i = 0; i < NR; i++) {                                                                 \
                const float v = quant ? mt_f16(sp[i][gi]) : 0.0f;                                          \
                sc[i] = vdupq_n_f32(v);                                                                    \
                m8[i] = vdupq_n_f32(-8.0f * v);                                                            \
            }                                                                                              \
            const int64_t s1 = s0 + step < cfull ? s0 + step : cfull;                                      \
            for (int64_t c = s0; c < s1; c += 16) {                                                        \
                for (int i = 0; i < NR; i++) {                                                             \
                    float32x4_t wv[4];                                                                     \
                    chunk_w(dtype, rp[i], c, sc[i], m8[i], wv);                                            \
                    for (int j = 0; j < NT; j++)                                                           \
                        for (int k = 0; k < 4; k++)                                                        \
                            a[j][i][k] = vfmaq_f32(a[j][i][k], wv[k], vld1q_f32(xr[j] + c + 4 * k));       \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        if (cfull < C) { /* the tail chunk: columns >= C read as 0 */                                     \
            for (int i = 0; i < NR; i++) {                                                                 \
                float tmp[16] = {0};                                                                       \
                float32x4_t wv[4];                                                                         \
                if (dtype == DT_F32) {                                                                     \
                    load16_tail((const float *)rp[i] + cfull, C - cfull, wv);                              \
                } else if (dtype == DT_BF16) {                                                             \
                    for (int64_t c = cfull; c < C; c++) {                                                  \
                        uint16_t b;                                                                        \
                        memcpy(&b, rp[i] + 2 * c, 2);                                                      \
                        const uint32_t bits = (uint32_t)b << 16;                                           \
                        memcpy(&tmp[c - cfull], &bits, 4);                                                 \
                    }                                                                                      \
                    for (int k = 0; k < 4; k++) wv[k] = vld1q_f32(tmp + 4 * k);                            \
                } else {                                                                                   \
                    const float v = mt_f16(sp[i][cfull / step]);                                           \
                    chunk_w(dtype, rp[i], cfull, vdupq_n_f32(v), vdupq_n_f32(-8.0f * v), wv);              \
                    for (int k = 0; k < 4; k++) vst1q_f32(tmp + 4 * k, wv[k]);                             \
                    for (int64_t c = C - cfull; c < 16; c++) tmp[c] = 0.0f;                                \
                    for (int k = 0; k < 4; k++) wv[k] = vld1q_f32(tmp + 4 * k);                            \
                }                                                                                          \
                for (int j = 0; j < NT; j++) {                                                             \
                    float32x4_t xv[4];                                                                     \
                    load16_tail(xr[j] + cfull, C - cfull, xv);                                             \
                    for (int k = 0; k < 4; k++) a[j][i][k] = vfmaq_f32(a[j][i][k], wv[k], xv[k]);          \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int i = 0; i < NR; i++)                                                                   \
                out[j][i0 + i] = hsum16(a[j][i][0], a[j][i][1], a[j][i][2], a[j][i][3]);                   \
    }
FUSED_MK(1, 4)
FUSED_MK(2, 2)
FUSED_MK(3, 1)
FUSED_MK(4, 1)

#define FUSED_DT(DT)                                                                                       \
    static void fused_##DT(int tb, const qmat *w, const int64_t *rows, const float *const *xr,             \
                           float out[TBMAX][RB]) {                                                         \
        switch (tb) {                                                                                      \
        case 1: fused_mk_1_4(DT, w, rows, xr, out, 0); break;                                              \
        case 2:                                                                                            \
            fused_mk_2_2(DT, w, rows, xr, out, 0);                                                         \
            fused_mk_2_2(DT, w, rows, xr, out, 2);                                                         \
            break;                                                                                         \
        case 3:                                                                                            \
            for (int i = 0; i < RB; i++) fused_mk_3_1(DT, w, rows, xr, out, i);                            \
            break;                                                                                         \
        default:                                                                                           \
            for (int i = 0; i < RB; i++) fused_mk_4_1(DT, w, rows, xr, out, i);                            \
            break;                                                                                         \
        }                                                                                                  \
    }
FUSED_DT(DT_F32)
FUSED_DT(DT_BF16)
FUSED_DT(DT_INT8)
FUSED_DT(DT_INT4)

/* ---------------------------------------------------------------- batched: many tokens */

#define BATCH_MK(NT)                                                                                       \
    static void batch_mk_##NT(const float *x, int64_t C, const float *wr, float *y, int64_t R, int64_t r,   \
                              int64_t t0, const float *bias) {                                             \
        float32x4_t a[NT][4];                                                                              \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int c = 0; c < 4; c++) a[j][c] = vdupq_n_f32(0.0f);                                       \
        const int64_t nfull = C & ~(int64_t)15;                                                            \
        const float *xs = x + t0 * C;                                                                      \
        for (int64_t k = 0; k < nfull; k += 16) {                                                          \
            float32x4_t wv[4];                                                                             \
            for (int c = 0; c < 4; c++) wv[c] = vld1q_f32(wr + k + 4 * c);                                 \
            for (int j = 0; j < NT; j++)                                                                   \
                for (int c = 0; c < 4; c++) a[j][c] = vfmaq_f32(a[j][c], wv[c], vld1q_f32(xs + j * C + k + 4 * c)); \
        }                                                                                                  \
        if (nfull < C) {                                                                                   \
            float32x4_t wv[4];                                                                             \
            load16_tail(wr + nfull, C - nfull, wv);                                                        \
            for (int j = 0; j < NT; j++) {                                                                 \
                float32x4_t xv[4];                                                                         \
                load16_tail(xs + j * C + nfull, C - nfull, xv);                                            \
                for (int c = 0; c < 4; c++) a[j][c] = vfmaq_f32(a[j][c], wv[c], xv[c]);                    \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++) {                                                                     \
            const float v = hsum16(a[j][0], a[j][1], a[j][2], a[j][3]);                                    \
            y[(t0 + j) * R + r] = bias ? v + bias[r] : v;                                                  \
        }                                                                                                  \
    }
BATCH_MK(1)
BATCH_MK(2)
BATCH_MK(3)
BATCH_MK(4)
BATCH_MK(5)
BATCH_MK(6)

static void batch_rows(const linear_ctx *k, int64_t r0, int nr, const float *const *wr) {
    const int64_t T = k->T, C = k->w->cols, R = k->w->rows;
    for (int i = 0; i < nr; i++) {
        int64_t t0 = 0;
        for (; t0 + 6 <= T; t0 += 6) batch_mk_6(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias);
        switch (T - t0) {
        case 5: batch_mk_5(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias); break;
        case 4: batch_mk_4(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias); break;
        case 3: batch_mk_3(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias); break;
        case 2: batch_mk_2(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias); break;
        case 1: batch_mk_1(k->x, C, wr[i], k->y, R, r0 + i, t0, k->bias); break;
        default: break;
        }
    }
}

static void linear_block_neon(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    const int64_t R = w->rows, C = w->cols, T = k->T;
    const int nr = (int)(R - r0 < RB ? R - r0 : RB);
    const int quant = w->dtype == DT_INT8 || w->dtype == DT_INT4;
    if (T > TBMAX || (quant && w->g % 16) || w->dtype == DT_MXFP4) { /* mxfp4: dequantized rows */
        if (T <= TBMAX) {
            mt_linear_block_tiles(k, r0, buf, row_values_neon, tile_neon);
            return;
        }
        const float *wr[RB];
        for (int i = 0; i < nr; i++) wr[i] = row_values_neon(w, r0 + i, buf + i * k->blen);
        batch_rows(k, r0, nr, wr);
        return;
    }
    int64_t rows[RB];
    for (int i = 0; i < RB; i++) rows[i] = r0 + (i < nr ? i : nr - 1);
    const float *xr[TBMAX];
    for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (j < T ? j : 0) * C;
    float res[TBMAX][RB];
    switch (w->dtype) {
    case DT_F32: fused_DT_F32((int)T, w, rows, xr, res); break;
    case DT_BF16: fused_DT_BF16((int)T, w, rows, xr, res); break;
    case DT_INT8: fused_DT_INT8((int)T, w, rows, xr, res); break;
    default: fused_DT_INT4((int)T, w, rows, xr, res); break;
    }
    for (int j = 0; j < T; j++)
        for (int i = 0; i < nr; i++) k->y[j * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
}

/* ---------------------------------------------------------------- elementwise, sums, P.V */

INLINE float32x4_t exp_neon(float32x4_t x) {
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(EXP_LOG2E))); /* nearest, ties to even */
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(EXP_C1));                    /* x - n * C1, fused */
    r = vfmsq_f32(r, n, vdupq_n_f32(EXP_C2));
    const float32x4_t z = vmulq_f32(r, r);
    float32x4_t y = vdupq_n_f32(EXP_P0);
    y = vfmaq_f32(vdupq_n_f32(EXP_P1), y, r);
    y = vfmaq_f32(vdupq_n_f32(EXP_P2), y, r);
    y = vfmaq_f32(vdupq_n_f32(EXP_P3), y, r);
    y = vfmaq_f32(vdupq_n_f32(EXP_P4), y, r);
    y = vfmaq_f32(vdupq_n_f32(EXP_P5), y, r);
    y = vfmaq_f32(r, y, z);
    y = vaddq_f32(y, vdupq_n_f32(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(126)), 23);
    float32x4_t res = vmulq_f32(vmulq_f32(y, vreinterpretq_f32_s32(e)), vdupq_n_f32(2.0f));
    res = vbslq_f32(vcltq_f32(x, vdupq_n_f32(EXP_LO)), vdupq_n_f32(0.0f), res);
    res = vbslq_f32(vcgtq_f32(x, vdupq_n_f32(EXP_HI)), vdupq_n_f32(INFINITY), res);
    return vbslq_f32(vceqq_f32(x, x), res, x); /* NaN stays NaN */
}

static void exp_shift_neon(const float *x, float m, int64_t n, float *y) {
    const float32x4_t mv = vdupq_n_f32(m);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, exp_neon(vsubq_f32(vld1q_f32(x + i), mv)));
    for (; i < n; i++) y[i] = mt_exp(x[i] - m);
}

static void swiglu_neon(float *g, const float *u, int64_t n) {
    const float32x4_t one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t gv = vld1q_f32(g + i);
        const float32x4_t sl = vdivq_f32(gv, vaddq_f32(one, exp_neon(vsubq_f32(zero, gv))));
        vst1q_f32(g + i, vmulq_f32(sl, vld1q_f32(u + i)));
    }
    for (; i < n; i++) {
        const float gv = g[i];
        g[i] = (gv / (1.0f + mt_exp(0.0f - gv))) * u[i];
    }
}

static float sum_neon(const float *a, int64_t n) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    const int64_t nfull = n & ~(int64_t)15;
    for (int64_t k = 0; k < nfull; k += 16)
        for (int c = 0; c < 4; c++) acc[c] = vaddq_f32(acc[c], vld1q_f32(a + k + 4 * c));
    if (nfull < n) {
        float32x4_t t[4];
        load16_tail(a + nfull, n - nfull, t);
        for (int c = 0; c < 4; c++) acc[c] = vaddq_f32(acc[c], t[c]);
    }
    return hsum16(acc[0], acc[1], acc[2], acc[3]);
}

static float max_neon(const float *a, int64_t n) {
    float32x4_t m = vdupq_n_f32(-INFINITY);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(a + i);
        m = vbslq_f32(vcgtq_f32(x, m), x, m);
    }
    float l[4], r = -INFINITY;
    vst1q_f32(l, m);
    for (int j = 0; j < 4; j++) r = l[j] > r ? l[j] : r;
    for (; i < n; i++) r = a[i] > r ? a[i] : r;
    return r;
}

static void divide_neon(float *y, float d, int64_t n) {
    const float32x4_t dv = vdupq_n_f32(d);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vdivq_f32(vld1q_f32(y + i), dv));
    for (; i < n; i++) y[i] = y[i] / d;
}

static void pv_neon(int nh, const float *const *p, const float *v, int64_t vstride, int64_t s0, int64_t s1,
                    int64_t dv, float *const *acc) {
    const int64_t dfull = dv & ~(int64_t)15;
    for (int64_t d0 = 0; d0 < dfull; d0 += 16) { /* 4 heads x 4 registers of 4 values */
        float32x4_t a[4][4];
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < 4; c++) a[h][c] = vld1q_f32(acc[h] + d0 + 4 * c);
        for (int64_t s = s0; s < s1; s++) {
            const float *vr = v + s * vstride + d0;
            float32x4_t vv[4];
            for (int c = 0; c < 4; c++) vv[c] = vld1q_f32(vr + 4 * c);
            for (int h = 0; h < nh; h++) {
                const float32x4_t ps = vdupq_n_f32(p[h][s]);
                for (int c = 0; c < 4; c++) a[h][c] = vfmaq_f32(a[h][c], ps, vv[c]);
            }
        }
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < 4; c++) vst1q_f32(acc[h] + d0 + 4 * c, a[h][c]);
    }
    for (int64_t s = s0; s < s1 && dfull < dv; s++) { /* the last d < 16: scalar, same order */
        const float *vr = v + s * vstride;
        for (int h = 0; h < nh; h++) {
            const float ps = p[h][s];
            for (int64_t d = dfull; d < dv; d++) acc[h][d] = fmaf(ps, vr[d], acc[h][d]);
        }
    }
}

static double fma_probe_neon(int64_t n, float seed) {
    float32x4_t a[12];
    for (int i = 0; i < 12; i++) a[i] = vdupq_n_f32(seed + (float)i);
    const float32x4_t b = vdupq_n_f32(0.999999f), c = vdupq_n_f32(1e-7f);
    for (int64_t k = 0; k < n; k++)
        for (int i = 0; i < 12; i++) a[i] = vfmaq_f32(c, a[i], b);
    float32x4_t s = a[0];
    for (int i = 1; i < 12; i++) s = vaddq_f32(s, a[i]);
    volatile float sink = vgetq_lane_f32(s, 0);
    (void)sink;
    return 2.0 * 12 * 4 * (double)n;
}

static uint64_t read_probe_neon(const uint8_t *p, int64_t bytes) {
    uint64x2_t s0 = vdupq_n_u64(0), s1 = s0;
    int64_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        s0 = vaddq_u64(s0, vld1q_u64((const uint64_t *)(const void *)(p + i)));
        s1 = vaddq_u64(s1, vld1q_u64((const uint64_t *)(const void *)(p + i + 16)));
    }
    s0 = vaddq_u64(s0, s1);
    return vgetq_lane_u64(s0, 0) + vgetq_lane_u64(s0, 1);
}

/* ---------------------------------------------------------------- int8 activations (SDOT) */

/* The int8-activation contract (mt.h) with the dot-product extension (SDOT: sixteen signed
 * bytes times sixteen, summed four by four into four int32; ARMv8.2's optional FEAT_DotProd,
 * in every ARMv8.4 CPU): four rows at a time, a block's partial sums of the four rows folded by
 * pairwise adds into one vector (lane i: row i), then the contract's float steps per lane.
 * int4: the nibbles (0..15) multiply the even and the odd columns (mt_q8_pos) and 8 * sum(xq)
 * is subtracted after; int8: q times xq directly. Integer sums are exact in any order. */
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#define MT_DOT __attribute__((target("arch=armv8.2-a+dotprod")))

static int cpu_dotprod(void) {
    static atomic_int v = -1; /* racing first callers store the same value */
    int x = atomic_load_explicit(&v, memory_order_relaxed);
    if (x < 0) {
        x = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
        atomic_store_explicit(&v, x, memory_order_relaxed);
    }
    return x;
}

MT_DOT static void q8_rows_dot(const q8ctx *k, int64_t r0, int64_t n, float *wsv) {
    const qmat *w = k->w;
    const int64_t R = w->rows, nb = k->nb, gpb = w->g / MT_Q8B;
    const int int4 = w->dtype == DT_INT4;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int64_t g0 = r0; g0 < r0 + n; g0 += 4) {
        const int nr = (int)(r0 + n - g0 < 4 ? r0 + n - g0 : 4);
        const uint8_t *rp[4];
        for (int i = 0; i < 4; i++) {
            const int64_t r = g0 + (i < nr ? i : nr - 1); /* past the chunk: repeat (unused) */
            rp[i] = w->data + r * w->row_bytes;
            for (int64_t gi = 0; gi < w->ngroups; gi++) wsv[gi * 4 + i] = mt_f16(w->scales[r * w->ngroups + gi]);
        }
        for (int64_t t = 0; t < k->T; t++) {
            const int8_t *xq = k->xq + t * k->xstride;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t b = 0; b < nb; b++) {
                int32x4_t s[4];
                if (int4) {
                    const int8_t *xe = xq + mt_q8_pos(DT_INT4, MT_Q8B * b), *xo = xe + MT_Q8B;
                    const int8x16_t e0 = vld1q_s8(xe), e1 = vld1q_s8(xe + 16), o0 = vld1q_s8(xo), o1 = vld1q_s8(xo + 16);
                    for (int i = 0; i < 4; i++) {
                        const uint8x16_t v0 = vld1q_u8(rp[i] + b * 32), v1 = vld1q_u8(rp[i] + b * 32 + 16);
                        int32x4_t a = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(v0, m4)), e0);
                        a = vdotq_s32(a, vreinterpretq_s8_u8(vandq_u8(v1, m4)), e1);
                        a = vdotq_s32(a, vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)), o0);
                        s[i] = vdotq_s32(a, vreinterpretq_s8_u8(vshrq_n_u8(v1, 4)), o1);
                    }
                } else {
                    const int8_t *xb = xq + MT_Q8B * b;
                    const int8x16_t X0 = vld1q_s8(xb), X1 = vld1q_s8(xb + 16), X2 = vld1q_s8(xb + 32),
                                    X3 = vld1q_s8(xb + 48);
                    for (int i = 0; i < 4; i++) {
                        const int8_t *wb = (const int8_t *)rp[i] + MT_Q8B * b;
                        int32x4_t a = vdotq_s32(vdupq_n_s32(0), vld1q_s8(wb), X0);
                        a = vdotq_s32(a, vld1q_s8(wb + 16), X1);
                        a = vdotq_s32(a, vld1q_s8(wb + 32), X2);
                        s[i] = vdotq_s32(a, vld1q_s8(wb + 48), X3);
                    }
                }
                int32x4_t sum = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3])); /* lane i: row i */
                if (int4) sum = vsubq_s32(sum, vdupq_n_s32(8 * k->xsum[t * nb + b]));
                const float32x4_t sc = vmulq_n_f32(vld1q_f32(wsv + (b / gpb) * 4), k->xs[t * nb + b]);
                acc = vfmaq_f32(acc, sc, vcvtq_f32_s32(sum));
            }
            float o[4];
            vst1q_f32(o, acc);
            for (int i = 0; i < nr; i++) k->y[t * R + g0 + i] = k->bias ? o[i] + k->bias[g0 + i] : o[i];
        }
    }
}

static void q8_rows_neon(const q8ctx *k, int64_t r0, int64_t n) {
    float *wsv = cpu_dotprod() ? mt_scratch(8, (size_t)(k->w->ngroups * 4)) : NULL;
    if (wsv) q8_rows_dot(k, r0, n, wsv);
    else mt_q8_rows_generic(k, r0, n); /* no SDOT (or no memory for the scales) */
}

static int supported_neon(void) { return 1; }

const mt_isa mt_isa_neon = {
    .name = "neon",
    .supported = supported_neon,
    .linear_block = linear_block_neon,
    .q8_rows = q8_rows_neon,
    .tile = tile_neon,
    .sum = sum_neon,
    .max = max_neon,
    .divide = divide_neon,
    .exp_shift = exp_shift_neon,
    .swiglu = swiglu_neon,
    .pv = pv_neon,
    .fma_probe = fma_probe_neon,
    .read_probe = read_probe_neon,
};
#endif
