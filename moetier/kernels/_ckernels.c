/* moetier fast kernels: row-invariant linear, expert FFN, rmsnorm, softmax, attention.
 *
 * THE ARITHMETIC CONTRACT (what makes every kernel row-invariant and every code path
 * bit-identical -- AVX-512 here, the portable C path below, and the numba fallback in
 * _nbkernels.py):
 *
 *   dot(a, b, n): sixteen lane accumulators acc[0..15] start at +0.0f. For every chunk
 *     k = 0, 1, ... of sixteen columns, in increasing k, lane l does
 *         acc[l] = fma(a[16k + l], b[16k + l], acc[l])
 *     where columns >= n read as 0.0f (the last, partial chunk). Then the fixed tree
 *         s8[i] = acc[i] + acc[i+8]   (i < 8)
 *         s4[i] = s8[i] + s8[i+4]     (i < 4)
 *         s2[i] = s4[i] + s4[i+2]     (i < 2)
 *         dot   = s2[0] + s2[1].
 *     The sequence of floating-point operations depends on n alone. fma is the single
 *     rounding fused multiply-add (vfmadd / fmaf / llvm.fma), the same in every path.
 *   sum(a, n): the same with acc[l] = acc[l] + a[16k + l].
 *   exp(x): the contract's own exponential (exp_generic below): Cody-Waite reduction by
 *     ln 2, a degree-7 polynomial in fma, scaling by an exact power of two; x < -86.5
 *     gives 0 (no subnormals), x > 88.75 gives inf, NaN stays NaN. Every step is one
 *     IEEE operation, so the 16-lane and the scalar versions agree bit for bit (libm's
 *     expf would be scalar-only and would differ between libraries).
 *
 * Every reduction in this file is one of those two, with n the length of the reduced
 * dimension (C for linear, dq for attention scores, the row's own number of visible keys
 * for the softmax denominator), or a maximum (exact in any order), or the attention
 * output out[d] = fma(p[s], v[s][d], out[d]) for s = 0, 1, ..., q_pos in order, per
 * element d. Every other operation is elementwise IEEE arithmetic.
 * Blocking over output rows, tokens, heads or keys, threading, and the choice of code
 * path only decide WHICH accumulator is computed WHEN, never the operations inside one
 * accumulator. Hence row t's bits depend only on row t's inputs.
 *
 * The file is compiled with -ffp-contract=off so the compiler never fuses a multiply
 * and an add that the contract does not fuse, and without -ffast-math so nothing is
 * reassociated or approximated.
 *
 * Quantized weights stay quantized in memory. For up to four tokens (decode) each
 * 16-column chunk of four weight rows is dequantized in registers and used at once;
 * for more tokens each block of four rows is dequantized into a small per-thread buffer
 * and used by every token. Either way the values are exactly q * scale, what
 * moetier.weights.quant.dequantize produces; a whole matrix is never expanded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MT_X86 1
#define MT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#else
#define MT_X86 0
#endif

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

/* Where the compiler supports it, the portable kernels are also built for x86-64 with
 * AVX2 + FMA (chosen at load time): fmaf becomes one vfmadd either way, so both clones
 * give the same bits; the AVX2 clone is just vectorised. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define MT_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MT_CLONES
#endif

/* Bumped whenever the Python-facing signatures or the arithmetic change, or a fix must
 * not be missed (5: the work pool's claim protocol); fast.py refuses a build of another
 * version (a stale in-place build after a pull) and says so. */
#define MT_KERNELS_VERSION 5

enum { DT_F32 = 0, DT_BF16 = 1, DT_INT8 = 2, DT_INT4 = 3 };
#define RB 4 /* output rows per block */
#define TBMAX 4 /* tokens per tile */

typedef struct {
    int dtype;
    const uint8_t *data;    /* row r starts at data + r * row_bytes */
    int64_t row_bytes;
    const uint16_t *scales; /* [rows, ngroups] float16 bits; NULL for f32 / bf16 */
    int64_t ngroups;
    int64_t rows, cols;     /* logical R, C */
    int64_t g;              /* group size (0 for f32 / bf16) */
} qmat;

static int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* ---------------------------------------------------------------- portable path */

static inline float f16_to_f32(uint16_t h) {
    /* exact: every float16 value is representable in float32 */
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u, bits;
    float v;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact */
        v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    bits = sign | (e == 31 ? 0x7f800000u : (e + 112u) << 23) | (m << 13);
    memcpy(&v, &bits, 4);
    return v;
}

/* Dequantize row r into buf[0..cols): exactly the reference values. */
MT_CLONES static void dequant_row_generic(const qmat *w, int64_t r, float *buf) {
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
            const float sc = f16_to_f32(s[c0 / w->g]);
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
            const float sc = f16_to_f32(s[gi]);
            const uint8_t *q = row + gi * half;
            float *o = buf + gi * w->g;
            for (int64_t j = 0; j < half; j++) {
                o[2 * j] = (float)((int)(q[j] & 15) - 8) * sc;
                o[2 * j + 1] = (float)((int)(q[j] >> 4) - 8) * sc;
            }
        }
        break;
    }
    }
}

/* exp coefficients (Cephes expf): ln 2 = EXP_C1 + EXP_C2, EXP_C1 exact in 9 bits */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f
#define EXP_LO -86.5f /* below: 0 (the result would be subnormal soon after) */
#define EXP_HI 88.75f /* above: inf */

static inline float exp_generic(float x) {
    if (x != x) return x;
    if (x < EXP_LO) return 0.0f;
    if (x > EXP_HI) return INFINITY;
    const float n = rintf(x * EXP_LOG2E); /* nearest, ties to even: n in [-125, 128] */
    float r = fmaf(-n, EXP_C1, x);
    r = fmaf(-n, EXP_C2, r);
    const float z = r * r;
    float y = EXP_P0;
    y = fmaf(y, r, EXP_P1);
    y = fmaf(y, r, EXP_P2);
    y = fmaf(y, r, EXP_P3);
    y = fmaf(y, r, EXP_P4);
    y = fmaf(y, r, EXP_P5);
    y = fmaf(y, z, r);
    y = y + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 126) << 23; /* 2^(n-1), normal */
    float pw;
    memcpy(&pw, &bits, 4);
    return (y * pw) * 2.0f; /* two steps: 2^n itself overflows at n = 128 */
}

static float hsum16_generic(const float *a) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

/* out[j][i] = dot(xr[j], wr[i], n) for j < tb, i < RB (the contract, portable). */
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
        for (int i = 0; i < RB; i++) out[j][i] = hsum16_generic(acc[j][i]);
}

static float sum_generic(const float *a, int64_t n) {
    float acc[16] = {0};
    for (int64_t k = 0; k < n; k += 16)
        for (int l = 0; l < 16; l++) acc[l] = acc[l] + (k + l < n ? a[k + l] : 0.0f);
    return hsum16_generic(acc);
}

/* acc[h][d] = fma(p[h][s], v[s][d], acc[h][d]) for s in [s0, s1), increasing (portable).
 * Callers zero acc first and walk s in increasing blocks: one sequence per element. */
MT_CLONES static void pv_generic(int nh, const float *const *p, const float *v, int64_t vstride, int64_t s0,
                                 int64_t s1, int64_t dv, float *const *acc) {
    for (int64_t s = s0; s < s1; s++) {
        const float *vr = v + s * vstride;
        for (int h = 0; h < nh; h++) {
            float ps = p[h][s];
            for (int64_t d = 0; d < dv; d++) acc[h][d] = fmaf(ps, vr[d], acc[h][d]);
        }
    }
}

/* ---------------------------------------------------------------- AVX-512 path */
#if MT_X86

MT_AVX512 static inline float hsum16_avx512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);                                                 /* i, i+8 */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* i, i+4 */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                 /* i, i+2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                          /* 0, 1 */
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
        const __m512 table = _mm512_mul_ps(nib, _mm512_set1_ps(f16_to_f32(s[gi])));
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

/* int8, group size a multiple of 16. */
MT_AVX512 static void dequant_int8_avx512(const qmat *w, int64_t r, float *buf) {
    const int8_t *row = (const int8_t *)(w->data + r * w->row_bytes);
    const uint16_t *s = w->scales + r * w->ngroups;
    for (int64_t gi = 0; gi < w->ngroups; gi++) {
        const __m512 sc = _mm512_set1_ps(f16_to_f32(s[gi]));
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

#ifndef MT_PREFETCH_BLOCKS
#define MT_PREFETCH_BLOCKS 2 /* prefetch distance, in row blocks */
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
fused_tb(const int dtype, const int tb, const float *const *xr, const qmat *w, const int64_t *rows,
         float out[TBMAX][RB]) {
    const int64_t C = w->cols, cfull = C & ~(int64_t)15;
    const int quant = dtype == DT_INT8 || dtype == DT_INT4;
    /* columns per step of the outer loop: one quantization group (one scale per row), or
     * 64 columns for f32 / bf16; each step prefetches its bytes MT_PREFETCH_BLOCKS row
     * blocks ahead. */
    const int64_t step = quant ? w->g : 64;
    const int64_t step_bytes = dtype == DT_F32 ? 4 * step : dtype == DT_BF16 ? 2 * step
                             : dtype == DT_INT8 ? step : step / 2;
    const int64_t pfd = MT_PREFETCH_BLOCKS * RB * w->row_bytes;
    const uint8_t *rp[RB];
    const uint16_t *sp[RB];
    for (int i = 0; i < RB; i++) {
        rp[i] = w->data + rows[i] * w->row_bytes;
        sp[i] = quant ? w->scales + rows[i] * w->ngroups : NULL;
    }
    const __m512 nib = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i ctrl = _mm512_set_epi8(0, 0, 0, 60, 0, 0, 0, 56, 0, 0, 0, 52, 0, 0, 0, 48, 0, 0, 0, 44, 0, 0,
                                         0, 40, 0, 0, 0, 36, 0, 0, 0, 32, 0, 0, 0, 28, 0, 0, 0, 24, 0, 0, 0, 20,
                                         0, 0, 0, 16, 0, 0, 0, 12, 0, 0, 0, 8, 0, 0, 0, 4, 0, 0, 0, 0);
    __m512 acc[TBMAX][RB], tab[RB];
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < RB; i++) acc[j][i] = _mm512_setzero_ps();
    for (int i = 0; i < RB; i++) tab[i] = _mm512_setzero_ps();
    int64_t s0 = 0, k = 0;
    for (; s0 < cfull; s0 += step, k++) {
        for (int i = 0; i < RB; i++) {
            _mm_prefetch((const char *)rp[i] + k * step_bytes + pfd, _MM_HINT_T0);
            if (dtype == DT_INT4) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(f16_to_f32(sp[i][k])));
            if (dtype == DT_INT8) tab[i] = _mm512_set1_ps(f16_to_f32(sp[i][k]));
        }
        const int64_t s1 = s0 + step < cfull ? s0 + step : cfull;
        for (int64_t c = s0; c < s1; c += 16) {
            __m512 wv[RB];
            for (int i = 0; i < RB; i++) wv[i] = chunk_w(dtype, rp[i], c, tab[i], ctrl, 0, 1);
            for (int j = 0; j < tb; j++) {
                __m512 xv = _mm512_loadu_ps(xr[j] + c);
                for (int i = 0; i < RB; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
            }
        }
    }
    if (cfull < C) { /* the tail chunk, in the group of column cfull */
        const __mmask16 m = (__mmask16)((1u << (C - cfull)) - 1u);
        for (int i = 0; i < RB; i++) {
            if (dtype == DT_INT4) tab[i] = _mm512_mul_ps(nib, _mm512_set1_ps(f16_to_f32(sp[i][cfull / step])));
            if (dtype == DT_INT8) tab[i] = _mm512_set1_ps(f16_to_f32(sp[i][cfull / step]));
        }
        __m512 wv[RB];
        for (int i = 0; i < RB; i++) wv[i] = chunk_w(dtype, rp[i], cfull, tab[i], ctrl, m, 0);
        for (int j = 0; j < tb; j++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xr[j] + cfull);
            for (int i = 0; i < RB; i++) acc[j][i] = _mm512_fmadd_ps(wv[i], xv, acc[j][i]);
        }
    }
    for (int j = 0; j < tb; j++)
        for (int i = 0; i < RB; i++) out[j][i] = hsum16_avx512(acc[j][i]);
}

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

/* 0: portable C, 1: AVX-512, 2: AVX-512 with VBMI (fused decode path). */
static int cpu_simd_level(void) {
    __builtin_cpu_init();
    int base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    return base ? 1 + (__builtin_cpu_supports("avx512vbmi") != 0) : 0;
}
#else
static int cpu_simd_level(void) { return 0; }
#endif

/* The fused path covers every dtype whose chunks of 16 columns share one scale. */
static int fused_ok(int simd, const qmat *w, int64_t T) {
    if (simd < 2 || T > TBMAX) return 0;
    return (w->dtype != DT_INT8 && w->dtype != DT_INT4) || w->g % 16 == 0;
}

/* ---------------------------------------------------------------- dispatch helpers */

static void tile(int simd, int tb, const float *const *xr, const float *const *wr, int64_t n,
                 float out[TBMAX][RB]) {
#if MT_X86
    if (simd) {
        tile_avx512(tb, xr, wr, n, out);
        return;
    }
#endif
    (void)simd;
    tile_generic(tb, xr, wr, n, out);
}

static float sum_n(int simd, const float *a, int64_t n) {
#if MT_X86
    if (simd) return sum_avx512(a, n);
#endif
    (void)simd;
    return sum_generic(a, n);
}

/* Returns a pointer to row r's float values: the row itself (f32 with SIMD: masked loads
 * never read past the row) or buf, filled with the exact dequantized values. */
static const float *row_values(int simd, const qmat *w, int64_t r, float *buf) {
#if MT_X86
    if (simd) {
        switch (w->dtype) {
        case DT_F32: return (const float *)(w->data + r * w->row_bytes);
        case DT_BF16: dequant_bf16_avx512(w, r, buf); return buf;
        case DT_INT8:
            if (w->g % 16 == 0) { dequant_int8_avx512(w, r, buf); return buf; }
            break;
        case DT_INT4:
            if (w->g % 32 == 0) { dequant_int4_avx512(w, r, buf); return buf; }
            break;
        }
    }
#endif
    (void)simd;
    dequant_row_generic(w, r, buf);
    return buf;
}

static int64_t rowbuf_len(const qmat *w) {
    int64_t n = round16(w->cols);
    int64_t cp = w->g ? w->ngroups * w->g : w->cols;
    return (n > cp ? n : cp) + 16;
}

static void *xalloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

/* ---------------------------------------------------------------- work pool
 * A call splits its output into independent chunks (row blocks, attention items). The
 * caller claims chunks from an atomic counter and so do helper threads that happen to be
 * running; the caller never waits for a helper to START, only for chunks a helper has
 * already claimed to finish. On a shared machine a descheduled helper therefore costs a
 * chunk, not the call (a fork-join team would wait for it at both ends of every call).
 * Which thread computes a chunk never changes its bits: chunks share nothing.
 *
 * Protocol. One thread at a time OWNS the pool (pool.owner, taken with a try-lock); a
 * caller that finds it owned, from another Python thread, computes its whole job itself
 * (the same bits). The owner runs one job at a time:
 *   1. it writes the job (fn, ctx, nchunks) into pool.job and sets pool.done = 0;
 *   2. it publishes the job by storing pool.left = nchunks (release);
 *   3. it, and any helper, claims chunks by decrementing pool.left with a compare-exchange
 *      from a value v > 0 to v - 1 (acquire): the claimer now holds chunk nchunks - v;
 *   4. a claimer reads pool.job only after its claim succeeded, runs the chunk, and then
 *      adds 1 to pool.done (release), after which it touches nothing of the job;
 *   5. the owner returns only once pool.done == nchunks (acquire).
 * Invariants (each follows from the steps above):
 *   I1. pool.left > 0 only between step 2 and the last claim of the published job, and
 *       pool.job never changes in that time: the owner writes it (step 1) only when every
 *       chunk of the previous job has been claimed (left == 0) AND finished (done == n).
 *   I2. A successful claim is a chunk of the published job, claimed once. pool.left falls
 *       monotonically from nchunks to 0 during a job, so each value v in [1, nchunks] is
 *       replaced by v - 1 exactly once. A compare-exchange succeeds only against the
 *       current value, so a helper whose load is stale (an earlier job's v, read before
 *       it was preempted) either fails and rereads, or -- if the current job happens to
 *       have that same v left -- claims that chunk of the current job, which is free:
 *       the value carries no job identity that could go stale.
 *   I3. Its acquire synchronises with the owner's release in step 2 (the claims in
 *       between are read-modify-writes, which continue that release sequence), so the
 *       claimer sees the job written in step 1.
 *   I4. pool.done counts finished claims of the published job only: it is reset before
 *       the job is published and only claim holders add to it (I2), so when the owner
 *       sees done == nchunks every chunk has run to completion and no thread holds a
 *       claim. The release/acquire pair makes each chunk's writes (the output, ctx->failed)
 *       visible to the owner before it returns.
 *   I5. So a job's ctx (on the owner's stack) is read only by claim holders, and the
 *       owner's frame outlives every claim: no helper ever reads a popped frame.
 * Why the count runs down to 0 rather than up to nchunks: a claim then needs no limit
 * read from elsewhere. With a count running up and the limit in its own variable, a
 * helper that read the count of a finished job and then the limit of the next (larger)
 * one could claim a chunk twice and count it twice, letting the owner return while that
 * chunk still ran on its stack-allocated ctx.
 * Helpers that find nothing to claim spin on pool.left, then sleep on pool.cv; see
 * pool_wait_for_work for why no wake-up is lost. */

typedef void (*chunk_fn)(void *ctx, int64_t chunk);

#ifdef MT_POOL_JITTER
/* Test builds only (tests/test_kernels.py compiles one): a random stall, now and then,
 * between any two steps of the protocol, so that interleavings a loaded machine produces
 * once a day happen within seconds. The installed build has none. */
static void pool_jitter(void) {
    static _Thread_local uint32_t s;
    if (!s) s = (uint32_t)(uintptr_t)&s | 1u;
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    const uint32_t r = s & 63, n = (s >> 8) & (r < 16 ? 4095 : 65535); /* up to ~5 or ~80 us */
    if (r < 20)
        for (volatile uint32_t i = 0; i < n; i++) {
        }
    else if (r == 20)
        sched_yield();
}
#define POOL_JITTER() pool_jitter()
#else
#define POOL_JITTER() ((void)0)
#endif

#define POOL_MAX 64
#define POOL_SPIN 2000 /* idle polls (~100 us) before a helper sleeps */

static struct {
    /* the owner's state: written only by the thread holding owner (or before any helper) */
    atomic_int owner;                /* 1 while a caller owns the pool */
    int nhelpers;
    struct {
        chunk_fn fn;
        void *ctx;
        int64_t nchunks;
    } job;
    /* shared with the helpers, each on its own cache line */
    _Alignas(64) _Atomic int64_t left;  /* chunks of the published job not yet claimed */
    _Alignas(64) _Atomic int64_t done;  /* chunks of the published job finished */
    _Alignas(64) atomic_int sleeping;   /* helpers asleep (or about to be) on cv */
    pthread_mutex_t mu;                 /* guards the cv wait; nothing else */
    pthread_cond_t cv;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Claim and run chunks of the published job until none are left unclaimed. */
static void pool_work(void) {
    /* relaxed: only a guess for the compare-exchange, which rereads on failure */
    int64_t v = atomic_load_explicit(&pool.left, memory_order_relaxed);
    while (v > 0) {
        POOL_JITTER();
        /* acquire on success: see pool.job as the owner wrote it (I3). On failure v is
         * reloaded (relaxed: it is again only a guess). */
        if (!atomic_compare_exchange_weak_explicit(&pool.left, &v, v - 1, memory_order_acquire,
                                                   memory_order_relaxed))
            continue;
        POOL_JITTER();
        pool.job.fn(pool.job.ctx, pool.job.nchunks - v); /* I1: pool.job is stable while we hold a claim */
        POOL_JITTER();
        /* release: the chunk's writes (and our reads of pool.job and ctx) happen before the
         * owner's acquire of the final count, after which it may return or write the next job */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        POOL_JITTER();
        v = atomic_load_explicit(&pool.left, memory_order_relaxed);
    }
}

/* Until a job has chunks left: spin a little, then sleep on cv. No wake-up is lost: the
 * helper announces itself in pool.sleeping and then checks pool.left, the owner stores
 * pool.left and then reads pool.sleeping, all four seq_cst, so in their single total
 * order either the helper sees the job or the owner sees the sleeper and broadcasts
 * under pool.mu, which the helper holds from its check until cond_wait releases it. A
 * helper that sleeps through a whole job costs nothing: the owner claims its chunks. */
static void pool_wait_for_work(void) {
    for (int spin = 0; spin < POOL_SPIN; spin++) {
        if (atomic_load_explicit(&pool.left, memory_order_relaxed) > 0) return;
#if MT_X86
        _mm_pause();
#endif
    }
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.sleeping, 1, memory_order_seq_cst);
    while (atomic_load_explicit(&pool.left, memory_order_seq_cst) == 0) pthread_cond_wait(&pool.cv, &pool.mu);
    atomic_fetch_sub_explicit(&pool.sleeping, 1, memory_order_relaxed);
    pthread_mutex_unlock(&pool.mu);
}

static void *pool_helper(void *arg) {
    (void)arg;
    for (;;) {
        pool_wait_for_work();
        pool_work();
    }
    return NULL;
}

static void pool_after_fork_child(void) {
    /* the helpers did not survive the fork, nor did a job another thread was running:
     * start afresh (the caller claims everything until new helpers start) */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.nhelpers = 0;
    atomic_store_explicit(&pool.sleeping, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.left, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.owner, 0, memory_order_relaxed);
}

/* Called by the owner only (so nhelpers needs no lock). */
static void pool_grow(int want) {
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork = 1;
    }
    while (pool.nhelpers < want && pool.nhelpers < POOL_MAX) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &at, pool_helper, NULL);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        pool.nhelpers++;
    }
}

/* Run fn(ctx, c) for c in [0, nchunks) on up to nthreads threads (the caller included);
 * returns when every chunk has finished, on whichever thread. */
static void pool_run(int nthreads, int64_t nchunks, chunk_fn fn, void *ctx) {
    int expect = 0;
    /* acquire on success: see the job state the previous owner left (its release below) */
    if (nthreads <= 1 || nchunks <= 1 ||
        !atomic_compare_exchange_strong_explicit(&pool.owner, &expect, 1, memory_order_acquire,
                                                 memory_order_relaxed)) {
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
        return;
    }
    pool_grow(nthreads - 1);
    /* step 1: nobody reads these now (I1: left == 0 and done == the previous nchunks) */
    pool.job.fn = fn;
    pool.job.ctx = ctx;
    pool.job.nchunks = nchunks;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed); /* ordered by the release below */
    POOL_JITTER();
    /* step 2: publish. seq_cst (a release, and ordered before the load of sleeping: see
     * pool_wait_for_work) */
    atomic_store_explicit(&pool.left, nchunks, memory_order_seq_cst);
    if (atomic_load_explicit(&pool.sleeping, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    pool_work();
    /* step 5: acquire pairs with each claimer's release (I4) */
    for (long spin = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < nchunks; spin++) {
        if (spin < 2000) {
#if MT_X86
            _mm_pause();
#endif
        } else {
            sched_yield(); /* a helper holding a chunk was descheduled */
        }
    }
    POOL_JITTER();
    /* release: the next owner (another thread) sees this job's state settled */
    atomic_store_explicit(&pool.owner, 0, memory_order_release);
}

typedef struct {
    int simd, use_fused;
    const float *x;
    int64_t T, blocks_per_chunk, blen;
    const qmat *w;
    const float *bias;
    float *y;
    atomic_int failed; /* a chunk could not allocate its buffer */
} linear_ctx;

/* Output rows [r0, r0 + RB) of every token: one row block. */
static void linear_block(const linear_ctx *k, int64_t r0, float *buf) {
    const qmat *w = k->w;
    const int64_t R = w->rows, C = w->cols, T = k->T;
    const int nr = (int)(R - r0 < RB ? R - r0 : RB);
    const float *wr[RB] = {NULL, NULL, NULL, NULL};
    int64_t rows[RB];
    for (int i = 0; i < RB; i++) rows[i] = r0 + (i < nr ? i : nr - 1);
    if (!k->use_fused)
        for (int i = 0; i < RB; i++) /* rows past R repeat the last one (results unused) */
            wr[i] = (i < nr || i == 0) ? row_values(k->simd, w, rows[i], buf + i * k->blen) : wr[i - 1];
    for (int64_t t0 = 0; t0 < T; t0 += TBMAX) {
        const int tb = (int)(T - t0 < TBMAX ? T - t0 : TBMAX);
        const float *xr[TBMAX];
        for (int j = 0; j < TBMAX; j++) xr[j] = k->x + (t0 + (j < tb ? j : 0)) * C;
        float res[TBMAX][RB];
#if MT_X86
        if (k->use_fused)
            fused(tb, xr, w, rows, res);
        else
#endif
            tile(k->simd, tb, xr, wr, C, res);
        for (int j = 0; j < tb; j++)
            for (int i = 0; i < nr; i++)
                k->y[(t0 + j) * R + r0 + i] = k->bias ? res[j][i] + k->bias[r0 + i] : res[j][i];
    }
}

static void linear_chunk(void *ctx, int64_t chunk) {
    linear_ctx *k = ctx;
    const int64_t nb = (k->w->rows + RB - 1) / RB;
    const int64_t b0 = chunk * k->blocks_per_chunk;
    const int64_t b1 = b0 + k->blocks_per_chunk < nb ? b0 + k->blocks_per_chunk : nb;
    float *buf = k->use_fused ? NULL : xalloc((size_t)(RB * k->blen) * 4);
    if (!k->use_fused && !buf) {
        atomic_store(&k->failed, 1);
        return;
    }
    for (int64_t b = b0; b < b1; b++) linear_block(k, b * RB, buf);
    free(buf);
}

/* y[t, r] = dot(x[t], w[r], C) (+ bias[r]).  x [T, C], y [T, R]. Returns 0 or -1 (no memory). */
static int linear_impl(int simd, int nthreads, const float *x, int64_t T, const qmat *w,
                       const float *bias, float *y) {
    const int64_t nb = (w->rows + RB - 1) / RB;
    /* about 32 KiB of weights per chunk: small enough to balance, big enough to amortise */
    int64_t bpc = (32 << 10) / (RB * (w->row_bytes > 0 ? w->row_bytes : 1));
    if (T > TBMAX) bpc = bpc * TBMAX / T; /* keep chunks near equal work at large T */
    if (bpc < 1) bpc = 1;
    linear_ctx k = {simd, fused_ok(simd, w, T), x, T, bpc, rowbuf_len(w), w, bias, y, 0};
    pool_run(nthreads, (nb + bpc - 1) / bpc, linear_chunk, &k);
    return atomic_load(&k.failed) ? -1 : 0;
}

/* SwiGLU expert: y = down(silu(gate x) * up x). x [T, D], y [T, D]. */
static int ffn_impl(int simd, int nthreads, const float *x, int64_t T, const qmat *gate,
                    const qmat *up, const qmat *down, float *y) {
    const int64_t I = gate->rows;
    float *hg = xalloc((size_t)(T * I) * 4), *hu = xalloc((size_t)(T * I) * 4);
    int rc = -1;
    if (hg && hu && linear_impl(simd, nthreads, x, T, gate, NULL, hg) == 0 &&
        linear_impl(simd, nthreads, x, T, up, NULL, hu) == 0) {
        /* silu(g) * u as the reference writes it: (g / (1 + exp(-g))) * u */
#if MT_X86
        if (simd)
            swiglu_avx512(hg, hu, T * I);
        else
#endif
            for (int64_t i = 0; i < T * I; i++) {
                float gv = hg[i];
                float sl = gv / (1.0f + exp_generic(0.0f - gv));
                hg[i] = sl * hu[i];
            }
        rc = linear_impl(simd, nthreads, hg, T, down, NULL, y);
    }
    free(hg);
    free(hu);
    return rc;
}

static void rmsnorm_impl(int simd, const float *x, int64_t T, int64_t C, const float *wt, float eps,
                         float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * C;
        float res[TBMAX][RB];
        const float *xs[TBMAX] = {xr, xr, xr, xr};
        const float *ws[RB] = {xr, xr, xr, xr};
        tile(simd, 1, xs, ws, C, res); /* sum of squares = dot(x, x, C) */
        float var = res[0][0] / (float)C;
        float den = sqrtf(var + eps);
        for (int64_t c = 0; c < C; c++) y[t * C + c] = xr[c] / den * wt[c];
    }
}

static void softmax_row(int simd, const float *x, int64_t n, float *y) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m; /* max: exact in any order */
#if MT_X86
    if (simd)
        exp_shift_avx512(x, m, n, y);
    else
#endif
        for (int64_t i = 0; i < n; i++) y[i] = exp_generic(x[i] - m);
    float s = sum_n(simd, y, n);
    for (int64_t i = 0; i < n; i++) y[i] = y[i] / s;
}

typedef struct {
    int simd;
    const float *q, *k, *v;
    const int64_t *qpos;
    int64_t H, S, Hkv, dq, dv, rep, hgroup, ngroups;
    float scale;
    float *out;
    atomic_int failed;
} attn_ctx;

#define ATT_SB 128 /* keys per block of the P.V pass: the block of V stays in L2 across heads */

/* One work item = (t, kv head, group of query heads of that kv head). Each key block is
 * loaded once and used by every head of the group (the MLA decode case: up to 128 heads
 * on one latent). How heads are grouped never changes a head's operations. */
static void attention_item(void *ctx, int64_t it) {
    attn_ctx *a = ctx;
    const int64_t H = a->H, S = a->S, Hkv = a->Hkv, dq = a->dq, dv = a->dv, rep = a->rep;
    const int64_t t = it / (Hkv * a->ngroups), kvh = (it / a->ngroups) % Hkv, hg = it % a->ngroups;
    const int64_t h0 = kvh * rep + hg * a->hgroup;
    const int64_t nh = rep - hg * a->hgroup < a->hgroup ? rep - hg * a->hgroup : a->hgroup;
    const int64_t n = a->qpos[t] + 1; /* keys 0..q_pos[t] */
    const int64_t stride = S + 16;
    float *sc = xalloc((size_t)(nh * stride) * 4);
    if (!sc) {
        atomic_store(&a->failed, 1);
        return;
    }
    /* scores: (4 heads) x (4 keys) tiles of the dot contract, key block outermost */
    for (int64_t s0 = 0; s0 < n; s0 += RB) {
        const int ns = (int)(n - s0 < RB ? n - s0 : RB);
        const float *kr[RB];
        for (int i = 0; i < RB; i++) kr[i] = a->k + ((s0 + (i < ns ? i : 0)) * Hkv + kvh) * dq;
        for (int64_t hb = 0; hb < nh; hb += 4) {
            const int nb = (int)(nh - hb < 4 ? nh - hb : 4);
            const float *qr[TBMAX];
            for (int j = 0; j < TBMAX; j++) qr[j] = a->q + (t * H + h0 + hb + (j < nb ? j : 0)) * dq;
            float res[TBMAX][RB];
            tile(a->simd, nb, qr, kr, dq, res);
            for (int j = 0; j < nb; j++)
                for (int i = 0; i < ns; i++) sc[(hb + j) * stride + s0 + i] = res[j][i] * a->scale;
        }
    }
    for (int64_t h = 0; h < nh; h++) softmax_row(a->simd, sc + h * stride, n, sc + h * stride);
    /* out = sum_s p[s] v[s], s increasing, in key blocks that every head block revisits */
    for (int64_t h = 0; h < nh; h++) memset(a->out + (t * H + h0 + h) * dv, 0, (size_t)dv * 4);
    for (int64_t s0 = 0; s0 < n; s0 += ATT_SB) {
        const int64_t s1 = s0 + ATT_SB < n ? s0 + ATT_SB : n;
        for (int64_t hb = 0; hb < nh; hb += 4) {
            const int nb = (int)(nh - hb < 4 ? nh - hb : 4);
            const float *p[4];
            float *o[4];
            for (int j = 0; j < 4; j++) {
                const int64_t h = hb + (j < nb ? j : 0);
                p[j] = sc + h * stride;
                o[j] = a->out + (t * H + h0 + h) * dv;
            }
#if MT_X86
            if (a->simd)
                pv_avx512(nb, p, a->v + kvh * dv, Hkv * dv, s0, s1, dv, o);
            else
#endif
                pv_generic(nb, p, a->v + kvh * dv, Hkv * dv, s0, s1, dv, o);
        }
    }
    free(sc);
}

/* Causal attention of T query rows of one sequence; the work items are independent. */
static int attention_impl(int simd, int nthreads, const float *q, const float *k, const float *v,
                          const int64_t *qpos, int64_t T, int64_t H, int64_t S, int64_t Hkv,
                          int64_t dq, int64_t dv, float scale, float *out) {
    const int64_t rep = H / Hkv;
    /* split a kv head's query heads only as far as needed to give every thread work */
    int64_t splits = 1;
    while (T * Hkv * splits < nthreads && splits < (rep + 3) / 4) splits++;
    int64_t hgroup = (rep + splits - 1) / splits;
    hgroup = (hgroup + 3) / 4 * 4;
    const int64_t ngroups = (rep + hgroup - 1) / hgroup;
    attn_ctx a = {simd, q, k, v, qpos, H, S, Hkv, dq, dv, rep, hgroup, ngroups, scale, out, 0};
    pool_run(nthreads, T * Hkv * ngroups, attention_item, &a);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------- Python bindings
 * The Python layer (moetier.kernels.fast) validates dtypes and shapes; here every buffer
 * is checked against the byte length the kernel will touch, so a wrong call raises
 * instead of reading or writing out of bounds. */

typedef struct {
    Py_buffer views[16];
    int n;
} bufset;

static void bufset_release(bufset *bs) {
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->views[i]);
    bs->n = 0;
}

static void *get_buf(bufset *bs, PyObject *obj, int64_t need, int writable, const char *what) {
    if (obj == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s is missing", what);
        return NULL;
    }
    Py_buffer *v = &bs->views[bs->n];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return NULL;
    bs->n++;
    if (v->len < need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, the kernel needs %lld", what, v->len,
                     (long long)need);
        return NULL;
    }
    return v->buf;
}

static int parse_qmat(bufset *bs, PyObject *spec, int64_t rows, int64_t cols, qmat *w, const char *what) {
    int dtype;
    long long g;
    PyObject *data, *scales;
    if (!PyArg_ParseTuple(spec, "iOOL", &dtype, &data, &scales, &g)) return -1;
    memset(w, 0, sizeof(*w));
    w->dtype = dtype;
    w->rows = rows;
    w->cols = cols;
    w->g = g;
    if (dtype == DT_F32 || dtype == DT_BF16) {
        w->row_bytes = cols * (dtype == DT_F32 ? 4 : 2);
    } else if (dtype == DT_INT8 || dtype == DT_INT4) {
        if (g <= 0 || (dtype == DT_INT4 && g % 2)) {
            PyErr_Format(PyExc_ValueError, "%s: invalid group size %lld", what, g);
            return -1;
        }
        w->ngroups = (cols + g - 1) / g;
        w->row_bytes = dtype == DT_INT8 ? w->ngroups * g : w->ngroups * g / 2;
        w->scales = get_buf(bs, scales, rows * w->ngroups * 2, 0, what);
        if (!w->scales) return -1;
    } else {
        PyErr_Format(PyExc_ValueError, "%s: unknown dtype code %d", what, dtype);
        return -1;
    }
    w->data = get_buf(bs, data, rows * w->row_bytes, 0, what);
    return w->data ? 0 : -1;
}

static int pick_simd(int simd) {
    /* callers on several threads may race to fill it in: they store the same value */
    static atomic_int level = -1;
    int lv = atomic_load_explicit(&level, memory_order_relaxed);
    if (lv < 0) {
        lv = cpu_simd_level();
        atomic_store_explicit(&level, lv, memory_order_relaxed);
    }
    return simd ? lv : 0;
}

static PyObject *py_linear(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wspec, *bo, *yo;
    long long T, C, R;
    int simd, nthreads;
    if (!PyArg_ParseTuple(args, "OLLLOOOii", &xo, &T, &C, &R, &wspec, &bo, &yo, &simd, &nthreads))
        return NULL;
    bufset bs = {.n = 0};
    qmat w;
    const float *x, *bias = NULL;
    float *y;
    int rc;
    if (parse_qmat(&bs, wspec, R, C, &w, "w") < 0) goto fail;
    if (!(x = get_buf(&bs, xo, T * C * 4, 0, "x"))) goto fail;
    if (bo != Py_None && !(bias = get_buf(&bs, bo, R * 4, 0, "bias"))) goto fail;
    if (!(y = get_buf(&bs, yo, T * R * 4, 1, "out"))) goto fail;
    simd = pick_simd(simd);
    Py_BEGIN_ALLOW_THREADS
    rc = linear_impl(simd, nthreads, x, T, &w, bias, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    bufset_release(&bs);
    return NULL;
}

static PyObject *py_ffn(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *gs, *us, *ds, *yo;
    long long T, D, I;
    int simd, nthreads;
    if (!PyArg_ParseTuple(args, "OLLLOOOOii", &xo, &T, &D, &I, &gs, &us, &ds, &yo, &simd, &nthreads))
        return NULL;
    bufset bs = {.n = 0};
    qmat g, u, d;
    const float *x;
    float *y;
    int rc;
    if (parse_qmat(&bs, gs, I, D, &g, "gate") < 0 || parse_qmat(&bs, us, I, D, &u, "up") < 0 ||
        parse_qmat(&bs, ds, D, I, &d, "down") < 0)
        goto fail;
    if (!(x = get_buf(&bs, xo, T * D * 4, 0, "x"))) goto fail;
    if (!(y = get_buf(&bs, yo, T * D * 4, 1, "out"))) goto fail;
    simd = pick_simd(simd);
    Py_BEGIN_ALLOW_THREADS
    rc = ffn_impl(simd, nthreads, x, T, &g, &u, &d, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
fail:
    bufset_release(&bs);
    return NULL;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *yo;
    long long T, C;
    float eps;
    int simd;
    if (!PyArg_ParseTuple(args, "OLLOfOi", &xo, &T, &C, &wo, &eps, &yo, &simd)) return NULL;
    bufset bs = {.n = 0};
    const float *x, *wt;
    float *y;
    if (!(x = get_buf(&bs, xo, T * C * 4, 0, "x")) || !(wt = get_buf(&bs, wo, C * 4, 0, "weight")) ||
        !(y = get_buf(&bs, yo, T * C * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    simd = pick_simd(simd);
    Py_BEGIN_ALLOW_THREADS
    rmsnorm_impl(simd, x, T, C, wt, eps, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_softmax(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    long long T, N;
    int simd;
    if (!PyArg_ParseTuple(args, "OLLOi", &xo, &T, &N, &yo, &simd)) return NULL;
    bufset bs = {.n = 0};
    const float *x;
    float *y;
    if (!(x = get_buf(&bs, xo, T * N * 4, 0, "x")) || !(y = get_buf(&bs, yo, T * N * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    simd = pick_simd(simd);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t t = 0; t < T; t++) softmax_row(simd, x + t * N, N, y + t * N);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_attention(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *ko, *vo, *po, *yo;
    long long T, H, S, Hkv, dq, dv;
    float scale;
    int simd, nthreads;
    if (!PyArg_ParseTuple(args, "OOOOLLLLLLfOii", &qo, &ko, &vo, &po, &T, &H, &S, &Hkv, &dq, &dv, &scale,
                          &yo, &simd, &nthreads))
        return NULL;
    bufset bs = {.n = 0};
    const float *q, *k, *v;
    const int64_t *qpos;
    float *y;
    int rc;
    if (Hkv <= 0 || H % Hkv) {
        PyErr_Format(PyExc_ValueError, "H=%lld is not a multiple of Hkv=%lld", H, Hkv);
        return NULL;
    }
    if (!(q = get_buf(&bs, qo, T * H * dq * 4, 0, "q")) || !(k = get_buf(&bs, ko, S * Hkv * dq * 4, 0, "k")) ||
        !(v = get_buf(&bs, vo, S * Hkv * dv * 4, 0, "v")) || !(qpos = get_buf(&bs, po, T * 8, 0, "q_pos")) ||
        !(y = get_buf(&bs, yo, T * H * dv * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    for (int64_t t = 0; t < T; t++) {
        if (qpos[t] < 0 || qpos[t] >= S) {
            bufset_release(&bs);
            PyErr_Format(PyExc_ValueError, "q_pos[%lld]=%lld outside the %lld cached positions", (long long)t,
                         (long long)qpos[t], S);
            return NULL;
        }
    }
    simd = pick_simd(simd);
    Py_BEGIN_ALLOW_THREADS
    rc = attention_impl(simd, nthreads, q, k, v, qpos, T, H, S, Hkv, dq, dv, scale, y);
    Py_END_ALLOW_THREADS
    bufset_release(&bs);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_exp(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    long long N;
    int simd;
    if (!PyArg_ParseTuple(args, "OLOi", &xo, &N, &yo, &simd)) return NULL;
    bufset bs = {.n = 0};
    const float *x;
    float *y;
    if (!(x = get_buf(&bs, xo, N * 4, 0, "x")) || !(y = get_buf(&bs, yo, N * 4, 1, "out"))) {
        bufset_release(&bs);
        return NULL;
    }
    simd = pick_simd(simd);
#if MT_X86
    if (simd)
        exp_shift_avx512(x, 0.0f, N, y);
    else
#endif
        for (int64_t i = 0; i < N; i++) y[i] = exp_generic(x[i] - 0.0f);
    bufset_release(&bs);
    Py_RETURN_NONE;
}

static PyObject *py_has_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(pick_simd(1));
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS, "linear(x, T, C, R, (dtype, data, scales, g), bias, out, simd, threads)"},
    {"ffn", py_ffn, METH_VARARGS, "ffn(x, T, D, I, gate, up, down, out, simd, threads)"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, T, C, weight, eps, out, simd)"},
    {"softmax", py_softmax, METH_VARARGS, "softmax(x, T, N, out, simd)"},
    {"attention", py_attention, METH_VARARGS,
     "attention(q, k, v, q_pos, T, H, S, Hkv, dq, dv, scale, out, simd, threads)"},
    {"exp", py_exp, METH_VARARGS, "exp(x, N, out, simd): the contract's exponential, elementwise"},
    {"has_simd", py_has_simd, METH_NOARGS, "0: portable C, 1: AVX-512, 2: AVX-512 with VBMI"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "moetier C kernels (see moetier/kernels/fast.py)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ckernels(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (m && PyModule_AddIntConstant(m, "VERSION", MT_KERNELS_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
