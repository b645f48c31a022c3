/* The portable path: the contract (mt.h) written out in plain C, one lane at a time.
 * It is the oracle the SIMD paths are tested against, and what runs on a CPU that has
 * none of them. */
#include <stdlib.h>
#include <string.h>

#include "mt.h"

/* Where the compiler supports it, the portable kernels are also built for x86-64 with
 * AVX2 + FMA (chosen at load time): fmaf becomes one vfmadd either way, so both clones
 * give the same bits; the AVX2 clone is just faster. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define MT_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MT_CLONES
#endif

/* Dequantize row r into buf[0..cols): exactly the reference values. */
MT_CLONES void mt_dequant_row_generic(const qmat *w, int64_t r, float *buf) {
    const uint8_t *row = w->data + r * w->row_bytes;
    const int64_t C = w->cols;
    switch (w->dtype) {
    case DT_F32:
        memcpy(buf, row, (size_t)C * 4);
        break;
    case DT_BF16:
        for (int64_t c = 0; c < C; c++) {
            uint16_t b;
            memcpy(&b, row + 2 * c, 2);
            uint32_t bits = (uint32_t)b << 16;
            memcpy(&buf[c], &bits, 4);
        }
        break;
    case DT_INT8: {
        const uint16_t *s = w->scales + r * w->ngroups;
        for (int64_t c0 = 0; c0 < C; c0 += w->g) {
            const float sc = mt_f16(s[c0 / w->g]);
            const int64_t c1 = c0 + w->g < C ? c0 + w->g : C;
            for (int64_t c = c0; c < c1; c++) buf[c] = (float)(int8_t)row[c] * sc;
        }
        break;
    }
    case DT_INT4: {
        const uint16_t *s = w->scales + r * w->ngroups;
        /* whole groups (g is even, so a group is whole bytes); the buffer holds Cp >= C */
        const int64_t half = w->g / 2;
        for (int64_t gi = 0; gi < w->ngroups; gi++) {
            const float sc = mt_f16(s[gi]);
            const uint8_t *q = row + gi * half;
            float *o = buf + gi * w->g;
            for (int64_t j = 0; j < half; j++) {
                o[2 * j] = (float)((int)(q[j] & 15) - 8) * sc;
                o[2 * j + 1] = (float)((int)(q[j] >> 4) - 8) * sc;
            }
        }
        break;
    }
    case DT_MXFP4: {
        const uint8_t *s = w->escales + r * w->ngroups;
        for (int64_t gi = 0; gi < w->ngroups; gi++) { /* whole groups, like int4 */
            const float sc = mt_e8m0(s[gi]);
            const uint8_t *q = row + gi * (MT_MX_GROUP / 2);
            float *o = buf + gi * MT_MX_GROUP;
            for (int64_t j = 0; j < MT_MX_GROUP / 2; j++) {
                o[2 * j] = mt_e2m1[q[j] & 15] * sc;
                o[2 * j + 1] = mt_e2m1[q[j] >> 4] * sc;
            }
        }
        break;
    }
    }
}

static const float *row_values_generic(const qmat *w, int64_t r, float *buf) {
    mt_dequant_row_generic(w, r, buf);
    return buf;
}

float mt_hsum16(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

MT_CLONES static void tile_generic(int tb, const float *const *xr, const float *const *wr, int64_t n,
                                   float out[TBMAX][RB]) {
    float acc[TBMAX][RB][16];
    memset(acc, 0, sizeof(acc));
    const int64_t nfull = n & ~(int64_t)15;
    for (int64_t k = 0; k < nfull; k += 16)
        for (int j = 0; j < tb; j++)
            for (int i = 0; i < RB; i++) {
                const float *x = xr[j] + k, *w = wr[i] + k;
                float *a = acc[j][i];
                for (int l = 0; l < 16; l++) a[l] = fmaf(w[l], x[l], a[l]);
            }
    if (nfull < n) { /* the tail chunk: columns >= n read as 0 */
        for (int j = 0; j < tb; j++)
            for (int i = 0; i < RB; i++)
                for (int l = 0; l < 16; l++) {
                    const int64_t c = nfull + l;
                    acc[j][i][l] = fmaf(c < n ? wr[i][c] : 0.0f, c < n ? xr[j][c] : 0.0f, acc[j][i][l]);
                }
    }
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < RB; i++) out[j][i] = mt_hsum16(acc[j][i]);
}

/* Rows [r0, r0 + RB) of every token from dequantized rows and a tile kernel: the buffer
 * path every ISA can use (and the only one of the generic path). */
void mt_linear_block_tiles(const linear_ctx *k, int64_t r0, float *buf,
                           const float *(*row_values)(const qmat *, int64_t, float *), tile_fn tile) {
    const qmat *w = k->w;
    const int64_t R = w->rows, C = w->cols, T = k->T;
    const int nr = (int)(R - r0 < RB ? R - r0 : RB);
    const float *wr[RB];
    for (int i = 0; i < RB; i++) /* rows past R repeat the last one (results unused) */
        wr[i] = i < nr ? row_values(w, r0 + i, buf + i * k->blen) : wr[nr - 1];
    for (int64_t t0 = 0; t0 < T; t0 += TBMAX) {
        const int tb = (int)(T - t0 < TBMAX ? T - t0 : TBMAX);
        const float *xr[TBMAX];
        for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (t0 + (j < tb ? j : 0)) * C;
        float res[TBMAX][RB];
        tile(tb, xr, wr, C, res);
        for (int j = 0; j < tb; j++)
            for (int i = 0; i < nr; i++)
                k->y[(t0 + j) * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
    }
}

static void linear_block_generic(const linear_ctx *k, int64_t r0, float *buf) {
    mt_linear_block_tiles(k, r0, buf, row_values_generic, tile_generic);
}

static float sum_generic(const float *a, int64_t n) {
    float acc[16] = {0};
    for (int64_t k = 0; k < n; k += 16)
        for (int l = 0; l < 16; l++) acc[l] = acc[l] + (k + l < n ? a[k + l] : 0.0f);
    return mt_hsum16(acc);
}

static float max_generic(const float *a, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = a[i] > m ? a[i] : m; /* exact in any order (up to the sign of 0) */
    return m;
}

MT_CLONES static void divide_generic(float *y, float d, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = y[i] / d;
}

MT_CLONES static void exp_shift_generic(const float *x, float m, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = mt_exp(x[i] - m);
}

MT_CLONES static void swiglu_generic(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float gv = g[i];
        const float sl = gv / (1.0f + mt_exp(0.0f - gv));
        g[i] = sl * u[i];
    }
}

MT_CLONES static void pv_generic(int nh, const float *const *p, const float *v, int64_t vstride, int64_t s0,
                                 int64_t s1, int64_t dv, float *const *acc) {
    for (int64_t s = s0; s < s1; s++) {
        const float *vr = v + s * vstride;
        for (int h = 0; h < nh; h++) {
            const float ps = p[h][s];
            for (int64_t d = 0; d < dv; d++) acc[h][d] = fmaf(ps, vr[d], acc[h][d]);
        }
    }
}

MT_CLONES static double fma_probe_generic(int64_t n, float seed) {
    float a[12];
    for (int i = 0; i < 12; i++) a[i] = seed + (float)i;
    const float b = 0.999999f, c = 1e-7f;
    for (int64_t k = 0; k < n; k++)
        for (int i = 0; i < 12; i++) a[i] = fmaf(a[i], b, c);
    volatile float sink = 0.0f;
    for (int i = 0; i < 12; i++) sink += a[i];
    (void)sink;
    return 2.0 * 12 * (double)n;
}

static uint64_t read_probe_generic(const uint8_t *p, int64_t bytes) {
    uint64_t s = 0;
    for (int64_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s += v;
    }
    return s;
}

static int supported_always(void) { return 1; }

const mt_isa mt_isa_generic = {
    .name = "portable",
    .supported = supported_always,
    .linear_block = linear_block_generic,
    .tile = tile_generic,
    .sum = sum_generic,
    .max = max_generic,
    .divide = divide_generic,
    .exp_shift = exp_shift_generic,
    .swiglu = swiglu_generic,
    .pv = pv_generic,
    .fma_probe = fma_probe_generic,
    .read_probe = read_probe_generic,
};

/* ---------------------------------------------------------------- transposed linears
 * y[t, h, c] = sum over n < N of x[t, h, n] * W[h * S + off + n, c]: per head h, a block of
 * N rows of a stored matrix W [*, C] used transposed (its rows are the inputs). MLA's
 * absorbed query (W_UK_h^T, moetier/model/attention.py) is one, read from the stored rows
 * instead of a float32 copy of each transposed block. The bits are the linear contract's
 * (tile_generic) for the matrix W_h^T [C, N]: per output, 16 lanes, lane l the fmaf chain
 * over n = l, l + 16, ... in order (the tail past N read as 0 * 0), then mt_hsum16. Each
 * weight is its dequantized value, exactly what mt_dequant_row_generic gives. One
 * implementation for every path (vectorized over c by the compiler, the AVX2 clone on x86),
 * so every path gives the same bits. */
#define LT_TB 4  /* tokens per block */
#define LT_CB 64 /* columns per chunk */

typedef struct {
    const float *x;
    int64_t xs_t, xs_h; /* x[t, h, n] at x[t * xs_t + h * xs_h + n] */
    int64_t T, N, C, S, off;
    const qmat *w;
    float *y;
    int64_t ys_t, ys_h; /* y[t, h, c] at y[t * ys_t + h * ys_h + c] */
    int64_t ncb;        /* column chunks per head */
} lt_ctx;

/* The dequantized values of row r, columns [c0, c0 + n) (mt_dequant_row_generic's), the
 * columns cut at group boundaries once per chunk: segment i is [cut[i], cut[i + 1]), group gid[i]. */
static inline void span_values(const qmat *w, int64_t r, int64_t c0, int nseg, const int *cut, const int64_t *gid,
                               float *out) {
    const uint8_t *row = w->data + r * w->row_bytes;
    if (w->dtype == DT_F32) {
        memcpy(out, row + 4 * c0, (size_t)cut[nseg] * 4);
        return;
    }
    if (w->dtype == DT_BF16) {
        const uint16_t *b = (const uint16_t *)(const void *)(row) + c0; /* rows are 2-byte aligned */
        uint32_t *o = (uint32_t *)(void *)out;
        for (int i = 0; i < cut[nseg]; i++) o[i] = (uint32_t)b[i] << 16;
        return;
    }
    for (int s = 0; s < nseg; s++) {
        const int64_t gi = gid[s];
        const int a = cut[s], e = cut[s + 1];
        if (w->dtype == DT_INT8) {
            const float sc = mt_f16(w->scales[r * w->ngroups + gi]);
            const int8_t *q = (const int8_t *)(row + c0);
            for (int i = a; i < e; i++) out[i] = (float)q[i] * sc;
        } else if (w->dtype == DT_INT4) {
            const float sc = mt_f16(w->scales[r * w->ngroups + gi]);
            for (int i = a; i < e; i++) {
                const int64_t c = c0 + i;
                const int q = (c & 1) ? row[c >> 1] >> 4 : row[c >> 1] & 15;
                out[i] = (float)(q - 8) * sc;
            }
        } else {
            const float sc = mt_e8m0(w->escales[r * w->ngroups + gi]);
            for (int i = a; i < e; i++) {
                const int64_t c = c0 + i;
                out[i] = mt_e2m1[(c & 1) ? row[c >> 1] >> 4 : row[c >> 1] & 15] * sc;
            }
        }
    }
}

MT_CLONES static void linear_t_chunk(void *vctx, int64_t chunk) {
    const lt_ctx *k = vctx;
    const int64_t h = chunk / k->ncb, c0 = (chunk % k->ncb) * LT_CB;
    const int cn = (int)(k->C - c0 < LT_CB ? k->C - c0 : LT_CB);
    const int64_t n16 = mt_round16(k->N);
    int cut[LT_CB + 1], nseg = 0;
    int64_t gid[LT_CB];
    if (k->w->g > 0) { /* quantized: cut at group boundaries */
        for (int i = 0; i < cn;) {
            const int64_t gi = (c0 + i) / k->w->g;
            const int64_t e = (gi + 1) * k->w->g - c0;
            cut[nseg] = i;
            gid[nseg++] = gi;
            i = e < cn ? (int)e : cn;
        }
    } else {
        cut[0] = 0;
        gid[nseg++] = 0;
    }
    cut[nseg] = cn;
    float acc[LT_TB][16][LT_CB];
    float wv[LT_CB];
    for (int64_t t0 = 0; t0 < k->T; t0 += LT_TB) {
        const int tb = (int)(k->T - t0 < LT_TB ? k->T - t0 : LT_TB);
        memset(acc, 0, (size_t)tb * sizeof(acc[0]));
        for (int64_t n = 0; n < n16; n++) {
            const int l = (int)(n & 15);
            if (n < k->N) {
                span_values(k->w, h * k->S + k->off + n, c0, nseg, cut, gid, wv);
                for (int j = 0; j < tb; j++) {
                    const float xv = k->x[(t0 + j) * k->xs_t + h * k->xs_h + n];
                    float *a = acc[j][l];
                    for (int c = 0; c < cn; c++) a[c] = fmaf(wv[c], xv, a[c]);
                }
            } else {
                for (int j = 0; j < tb; j++) {
                    float *a = acc[j][l];
                    for (int c = 0; c < cn; c++) a[c] = fmaf(0.0f, 0.0f, a[c]);
                }
            }
        }
        for (int j = 0; j < tb; j++) { /* mt_hsum16 over the lanes, per column */
            float (*a)[LT_CB] = acc[j];
            for (int i = 0; i < 8; i++)
                for (int c = 0; c < cn; c++) a[i][c] = a[i][c] + a[i + 8][c];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < cn; c++) a[i][c] = a[i][c] + a[i + 4][c];
            for (int i = 0; i < 2; i++)
                for (int c = 0; c < cn; c++) a[i][c] = a[i][c] + a[i + 2][c];
            float *yr = k->y + (t0 + j) * k->ys_t + h * k->ys_h + c0;
            for (int c = 0; c < cn; c++) yr[c] = a[0][c] + a[1][c];
        }
    }
}

void mt_linear_t(int nthreads, const float *x, int64_t xs_t, int64_t xs_h, int64_t T, int64_t H, int64_t N,
                 const qmat *w, int64_t S, int64_t off, float *y, int64_t ys_t, int64_t ys_h) {
    lt_ctx k = {x, xs_t, xs_h, T, N, w->cols, S, off, w, y, ys_t, ys_h, (w->cols + LT_CB - 1) / LT_CB};
    if (T <= 0 || H <= 0 || w->cols <= 0) return;
    mt_pool_run(nthreads, H * k.ncb, linear_t_chunk, &k);
}
