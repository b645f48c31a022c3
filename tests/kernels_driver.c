/* A test driver for the C kernels without Python: runs every kernel on fixed inputs with
 * every kernel path this CPU supports and prints one line per (case, path):
 *     <case> <path> <64-bit FNV-1a hash of the output's bits>
 * tests/test_kernels_neon.py builds it natively and for aarch64 (run under qemu-user),
 * and checks that every path, on both machines, prints the same hash for every case:
 * the NEON path against the portable one and against the x86 build's paths.
 *
 * Inputs come from a fixed integer generator and are turned into floats by exact IEEE
 * operations, so both builds compute on the same bits. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mt.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t next_u32(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float next_f32(float scale) { return (float)((int32_t)(next_u32() % 20001u) - 10000) * (scale * 1e-4f); }

static float *floats(int64_t n, float scale) {
    float *p = mt_xalloc((size_t)(n > 0 ? n : 1) * 4);
    for (int64_t i = 0; i < n; i++) p[i] = next_f32(scale);
    return p;
}

static uint64_t fnv(const float *a, int64_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &a[i], 4);
        for (int k = 0; k < 4; k++) {
            h ^= (b >> (8 * k)) & 0xFF;
            h *= 0x100000001b3ull;
        }
    }
    return h;
}

/* A random matrix [rows, cols] of a dtype, laid out as the Python layer passes it. */
static qmat make_qmat(int dtype, int64_t rows, int64_t cols, int64_t g) {
    qmat w;
    memset(&w, 0, sizeof(w));
    w.dtype = dtype;
    w.rows = rows;
    w.cols = cols;
    if (dtype == DT_F32 || dtype == DT_BF16) {
        w.row_bytes = cols * (dtype == DT_F32 ? 4 : 2);
    } else if (dtype == DT_MXFP4) {
        w.g = MT_MX_GROUP;
        w.ngroups = (cols + MT_MX_GROUP - 1) / MT_MX_GROUP;
        w.row_bytes = w.ngroups * MT_MX_GROUP / 2;
        uint8_t *e = mt_xalloc((size_t)(rows * w.ngroups));
        for (int64_t i = 0; i < rows * w.ngroups; i++) e[i] = (uint8_t)(118 + next_u32() % 12); /* 2^-9..2^2 */
        w.escales = e;
    } else {
        w.g = g;
        w.ngroups = (cols + g - 1) / g;
        w.row_bytes = dtype == DT_INT8 ? w.ngroups * g : w.ngroups * g / 2;
        uint16_t *s = mt_xalloc((size_t)(rows * w.ngroups) * 2);
        for (int64_t i = 0; i < rows * w.ngroups; i++) s[i] = (uint16_t)(0x1c00 + next_u32() % 0x0c00); /* ~2^-8..2^-5 */
        w.scales = s;
    }
    uint8_t *d = mt_xalloc((size_t)(rows * w.row_bytes));
    if (dtype == DT_F32) {
        for (int64_t i = 0; i < rows * cols; i++) {
            const float v = next_f32(1.0f);
            memcpy(d + 4 * i, &v, 4);
        }
    } else if (dtype == DT_BF16) {
        for (int64_t i = 0; i < rows * cols; i++) {
            const float v = next_f32(1.0f);
            uint32_t b;
            memcpy(&b, &v, 4);
            const uint16_t h = (uint16_t)(b >> 16);
            memcpy(d + 2 * i, &h, 2);
        }
    } else {
        for (int64_t i = 0; i < rows * w.row_bytes; i++) d[i] = (uint8_t)next_u32();
    }
    w.data = d;
    return w;
}

static void free_qmat(qmat *w) {
    free((void *)w->data);
    free((void *)w->scales);
    free((void *)w->escales);
}

static void report(const char *name, const mt_isa *isa, const float *out, int64_t n) {
    printf("%s %s %016llx\n", name, isa->name, (unsigned long long)fnv(out, n));
}

int main(void) {
    static const int64_t shapes[][3] = {{1, 16, 16}, {5, 33, 32}, {9, 64, 64},  {7, 100, 64}, {13, 130, 32},
                                        {4, 47, 10}, {6, 96, 48}, {11, 200, 6}, {3, 8, 8},    {17, 520, 64}};
    static const int64_t tokens[] = {1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 100};
    static const char *dts[] = {"f32", "bf16", "int8", "int4", "mxfp4"};
    char name[128];
    for (int dt = 0; dt < 5; dt++)
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
            const int64_t R = shapes[si][0], C = shapes[si][1], g = dt == DT_MXFP4 ? MT_MX_GROUP : shapes[si][2];
            qmat w = make_qmat(dt, R, C, g);
            float *bias = floats(R, 1.0f);
            for (size_t ti = 0; ti < sizeof(tokens) / sizeof(tokens[0]); ti++) {
                const int64_t T = tokens[ti];
                float *x = floats(T * C, 1.0f), *y = mt_xalloc((size_t)(T * R) * 4);
                snprintf(name, sizeof(name), "linear/%s/R%lld/C%lld/g%lld/T%lld", dts[dt], (long long)R,
                         (long long)C, (long long)g, (long long)T);
                for (int i = 0; mt_isas[i]; i++) {
                    if (!mt_isas[i]->supported()) continue;
                    memset(y, 0xFF, (size_t)(T * R) * 4);
                    if (mt_linear(mt_isas[i], 2, x, T, &w, (T % 2) ? bias : NULL, y) != 0) return 2;
                    report(name, mt_isas[i], y, T * R);
                }
                if ((dt == DT_INT8 || dt == DT_INT4) && g % 64 == 0) { /* the int8-activation contract */
                    snprintf(name, sizeof(name), "linear-q8/%s/R%lld/C%lld/g%lld/T%lld", dts[dt], (long long)R,
                             (long long)C, (long long)g, (long long)T);
                    for (int i = 0; mt_isas[i]; i++) {
                        if (!mt_isas[i]->supported()) continue;
                        memset(y, 0xFF, (size_t)(T * R) * 4);
                        if (mt_linear_q8(mt_isas[i], 2, x, T, &w, (T % 2) ? bias : NULL, y) != 0) return 2;
                        report(name, mt_isas[i], y, T * R);
                    }
                }
                free(x);
                free(y);
            }
            free(bias);
            free_qmat(&w);
        }
    /* transposed per-head linears (mt_linear_t: one implementation for every path) beside
     * mt_linear on each head's rows transposed to float32, under the same case name: the same bits */
    for (int dt = 0; dt < 5; dt++) {
        const int64_t H = 3, N = 40, S = 48, C = 100, g = dt == DT_MXFP4 ? MT_MX_GROUP : 16;
        qmat w = make_qmat(dt, H * S, C, dt < DT_INT8 ? 0 : g);
        float *rowbuf = mt_xalloc((size_t)(mt_rowbuf_len(&w) + 64) * 4), *wt = mt_xalloc((size_t)(C * N) * 4);
        for (int64_t off = 0; off <= 8; off += 8)
            for (int64_t T = 1; T <= 9; T += 4) {
                const int64_t xs_h = N + 3, ys_h = C + 2;
                float *x = floats(T * H * xs_h, 1.0f), *y = mt_xalloc((size_t)(T * H * ys_h) * 4);
                float *xh = mt_xalloc((size_t)(T * N) * 4), *yh = mt_xalloc((size_t)(T * C) * 4);
                snprintf(name, sizeof(name), "linear_t/%s/off%lld/T%lld", dts[dt], (long long)off, (long long)T);
                memset(y, 0, (size_t)(T * H * ys_h) * 4);
                mt_linear_t(2, x, H * xs_h, xs_h, T, H, N, &w, S, off, y, H * ys_h, ys_h);
                float *got = mt_xalloc((size_t)(T * H * C) * 4);
                for (int64_t t = 0; t < T; t++)
                    for (int64_t h = 0; h < H; h++) memcpy(got + (t * H + h) * C, y + (t * H + h) * ys_h, (size_t)C * 4);
                printf("%s linear_t %016llx\n", name, (unsigned long long)fnv(got, T * H * C));
                for (int i = 0; mt_isas[i]; i++) {
                    if (!mt_isas[i]->supported()) continue;
                    for (int64_t h = 0; h < H; h++) {
                        for (int64_t n = 0; n < N; n++) {
                            mt_dequant_row_generic(&w, h * S + off + n, rowbuf);
                            for (int64_t c = 0; c < C; c++) wt[c * N + n] = rowbuf[c];
                        }
                        qmat f = {.dtype = DT_F32, .data = (const uint8_t *)wt, .row_bytes = N * 4, .rows = C, .cols = N};
                        for (int64_t t = 0; t < T; t++) memcpy(xh + t * N, x + t * H * xs_h + h * xs_h, (size_t)N * 4);
                        if (mt_linear(mt_isas[i], 2, xh, T, &f, NULL, yh) != 0) return 2;
                        for (int64_t t = 0; t < T; t++) memcpy(got + (t * H + h) * C, yh + t * C, (size_t)C * 4);
                    }
                    report(name, mt_isas[i], got, T * H * C);
                }
                free(x);
                free(y);
                free(xh);
                free(yh);
                free(got);
            }
        free(rowbuf);
        free(wt);
        free_qmat(&w);
    }
    /* expert FFN: gate and up [I, D], down [D, I] */
    for (int dt = 2; dt < 5; dt++) {
        const int64_t D = 72, I = 40;
        qmat gt = make_qmat(dt, I, D, 16), up = make_qmat(dt, I, D, 16), dn = make_qmat(dt, D, I, 8);
        for (int64_t T = 1; T <= 9; T += 4) {
            float *x = floats(T * D, 2.0f), *y = mt_xalloc((size_t)(T * D) * 4);
            snprintf(name, sizeof(name), "ffn/%s/T%lld", dts[dt], (long long)T);
            for (int i = 0; mt_isas[i]; i++) {
                if (!mt_isas[i]->supported()) continue;
                if (mt_ffn(mt_isas[i], 2, x, T, &gt, &up, &dn, y) != 0) return 2;
                report(name, mt_isas[i], y, T * D);
            }
            free(x);
            free(y);
        }
        free_qmat(&gt);
        free_qmat(&up);
        free_qmat(&dn);
    }
    /* attention: q [T, H, dq], k [S, Hkv, dq], v [S, Hkv, dv] */
    static const int64_t att[][5] = {{1, 1, 5, 3, 4}, {4, 4, 16, 16, 9}, {6, 2, 40, 24, 23}, {16, 1, 72, 64, 40},
                                     {3, 3, 33, 130, 17}, {8, 1, 576, 512, 5}};
    for (size_t ai = 0; ai < sizeof(att) / sizeof(att[0]); ai++) {
        const int64_t H = att[ai][0], Hkv = att[ai][1], dq = att[ai][2], dv = att[ai][3], S = att[ai][4];
        for (int64_t T = 1; T <= 5; T += 2) {
            float *q = floats(T * H * dq, 1.0f), *k = floats(S * Hkv * dq, 1.0f), *v = floats(S * Hkv * dv, 1.0f);
            float *y = mt_xalloc((size_t)(T * H * dv) * 4);
            int64_t *pos = mt_xalloc((size_t)T * 8);
            for (int64_t t = 0; t < T; t++) pos[t] = (int64_t)(next_u32() % (uint32_t)S);
            snprintf(name, sizeof(name), "attention/H%lld/Hkv%lld/dq%lld/dv%lld/T%lld", (long long)H,
                     (long long)Hkv, (long long)dq, (long long)dv, (long long)T);
            float *sinks = floats(H, 2.0f);
            for (int i = 0; mt_isas[i]; i++) {
                if (!mt_isas[i]->supported()) continue;
                if (mt_attention(mt_isas[i], 2, q, k, v, pos, T, H, S, Hkv, dq, dv, 0.3f, NULL, 0, y) != 0) return 2;
                report(name, mt_isas[i], y, T * H * dv);
            }
            /* learned sinks and a sliding window (gpt-oss) */
            for (int i = 0; mt_isas[i]; i++) {
                if (!mt_isas[i]->supported()) continue;
                char sw[160];
                snprintf(sw, sizeof(sw), "%s/sinks-window3", name);
                if (mt_attention(mt_isas[i], 2, q, k, v, pos, T, H, S, Hkv, dq, dv, 0.3f, sinks, 3, y) != 0) return 2;
                report(sw, mt_isas[i], y, T * H * dv);
            }
            free(sinks);
            free(q);
            free(k);
            free(v);
            free(y);
            free(pos);
        }
    }
    /* softmax, rmsnorm, the contract's exp */
    static const int64_t lens[] = {1, 7, 8, 9, 15, 16, 17, 31, 100, 2048};
    for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++) {
        const int64_t n = lens[li];
        float *x = floats(3 * n, 20.0f), *wt = floats(n, 1.0f), *y = mt_xalloc((size_t)(3 * n) * 4);
        for (int i = 0; mt_isas[i]; i++) {
            if (!mt_isas[i]->supported()) continue;
            for (int t = 0; t < 3; t++) mt_softmax_row(mt_isas[i], x + t * n, n, y + t * n);
            snprintf(name, sizeof(name), "softmax/n%lld", (long long)n);
            report(name, mt_isas[i], y, 3 * n);
            mt_rmsnorm(mt_isas[i], x, 3, n, wt, 1e-6f, y);
            snprintf(name, sizeof(name), "rmsnorm/n%lld", (long long)n);
            report(name, mt_isas[i], y, 3 * n);
        }
        free(x);
        free(wt);
        free(y);
    }
    {
        const int64_t n = 200003;
        float *x = mt_xalloc((size_t)n * 4), *y = mt_xalloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++) x[i] = (float)(i - n / 2) * 1e-3f; /* -100 .. 100 */
        for (int i = 0; mt_isas[i]; i++) {
            if (!mt_isas[i]->supported()) continue;
            mt_isas[i]->exp_shift(x, 0.0f, n, y);
            report("exp", mt_isas[i], y, n);
            mt_isas[i]->swiglu(y, x, n);
            report("swiglu", mt_isas[i], y, n);
        }
        memcpy(y, x, (size_t)n * 4);
        mt_glu_clamped(y, x + 1, n - 1, 1.702f, 7.0f); /* one implementation for every path */
        report("glu-clamped", &mt_isa_generic, y, n);
        free(x);
        free(y);
    }
    return 0;
}
