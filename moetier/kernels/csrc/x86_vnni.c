/* The int8-activation kernels on AVX-512 VNNI (vpdpbusd: 64 unsigned bytes times 64 signed
 * bytes, summed four by four into sixteen int32). The same bits as mt_q8_rows_generic: every
 * block's integer sum is exact in any order (|sum| < 2^22), and the float steps are the
 * contract's (mt.h), one (token, row) per lane:
 *     acc = fma(ws[b] * xs[b], (float) isum[b], acc)   for b = 0, 1, ... in order.
 *
 * Lanes are (token, row) pairs: a tile of RT rows x TT tokens, RT * TT = 16. Each row's block
 * is multiplied whole by one vpdpbusd into a vector of partial sums (lanes = columns), and the
 * sixteen vectors of a tile are reduced together (reduce_pairs / reduce_one: 44 additions and
 * shuffles for the 16 x 16 partials, instead of a horizontal sum per row and block), which
 * leaves the tile's sums in the lanes of one vector. int4 weights are unsigned nibbles
 * (q + 8), int8 weights are XOR-ed with 0x80 (q + 128, unsigned); the offset times the
 * block's sum of activations (corrT) is subtracted after, exactly.
 *
 * int4: a row's 64 bytes hold a pair of blocks; their low nibbles are the even columns of
 * both blocks, the high ones the odd columns, which is the order xq keeps them in
 * (mt_q8_pos), so one load, two masks and two vpdpbusd compute a pair. */
#include <stdatomic.h>

#include "mt.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define MT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

int mt_cpu_vnni(void) {
    static atomic_int v = -1; /* racing first callers store the same value */
    int x = atomic_load_explicit(&v, memory_order_relaxed);
    if (x < 0) {
        __builtin_cpu_init();
        x = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        atomic_store_explicit(&v, x, memory_order_relaxed);
    }
    return x;
}

/* a[q], 128-bit lane L: the sums of lanes 4L..4L+3 of a[4q..4q+3] (lane i of the result: a[4q+i]) */
MT_VNNI INLINE __m512i sum4(const __m512i *a) {
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

#define SEL_EVEN _MM_SHUFFLE(2, 0, 2, 0) /* 128-bit lanes 0, 2 of a, then 0, 2 of b */
#define SEL_ODD _MM_SHUFFLE(3, 1, 3, 1)

/* lo[i] = sum of a[i]'s lanes 0-7, hi[i] = of its lanes 8-15 (two blocks per vector) */
MT_VNNI INLINE void reduce_pairs(const __m512i a[16], __m512i *lo, __m512i *hi) {
    const __m512i u0 = sum4(a), u1 = sum4(a + 4), u2 = sum4(a + 8), u3 = sum4(a + 12);
    /* [lo 0-3, hi 0-3, lo 4-7, hi 4-7] and the same for 8-15 */
    const __m512i v0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, SEL_EVEN), _mm512_shuffle_i32x4(u0, u1, SEL_ODD));
    const __m512i v1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u2, u3, SEL_EVEN), _mm512_shuffle_i32x4(u2, u3, SEL_ODD));
    *lo = _mm512_shuffle_i32x4(v0, v1, SEL_EVEN);
    *hi = _mm512_shuffle_i32x4(v0, v1, SEL_ODD);
}

/* s[i] = sum of a[i]'s sixteen lanes (one block per vector) */
MT_VNNI INLINE __m512i reduce_one(const __m512i a[16]) {
    const __m512i u0 = sum4(a), u1 = sum4(a + 4), u2 = sum4(a + 8), u3 = sum4(a + 12);
    const __m512i v0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, SEL_EVEN), _mm512_shuffle_i32x4(u0, u1, SEL_ODD));
    const __m512i v1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u2, u3, SEL_EVEN), _mm512_shuffle_i32x4(u2, u3, SEL_ODD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(v0, v1, SEL_EVEN), _mm512_shuffle_i32x4(v0, v1, SEL_ODD));
}

/* What a tile needs besides its rows and tokens. */
typedef struct {
    const q8ctx *k;
    const float *wsT; /* [ngroups][16] float scales of the tile's 16 rows, row i in lane i */
    int64_t gpb;      /* blocks per weight group */
} tilectx;

/* One block's step for every lane: acc = fma(ws * xs, (float)(s - corr), acc). Lane j * RT + i
 * is token t0 + j, row i0 + i. */
MT_VNNI INLINE __m512 apply(const int RT, const int TT, const tilectx *c, int i0, int64_t t0, int64_t b, __m512i s,
                            __m512 acc) {
    const q8ctx *k = c->k;
    const float *wg = c->wsT + (b / c->gpb) * 16 + i0;
    const __m512 wv = RT == 16  ? _mm512_loadu_ps(wg)
                      : RT == 8 ? _mm512_broadcast_f32x8(_mm256_loadu_ps(wg))
                                : _mm512_broadcast_f32x4(_mm_loadu_ps(wg));
    __m512 xv;
    __m512i cv;
    if (TT == 1) {
        xv = _mm512_set1_ps(k->xsT[b * k->Tp + t0]);
        cv = _mm512_set1_epi32(k->corrT[b * k->Tp + t0]);
    } else { /* lane l takes token t0 + l / RT */
        const __m512i tok = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              RT == 8 ? 3 : 2);
        const __mmask16 m = (__mmask16)((1u << TT) - 1u); /* Tp leaves room for TT past the last token */
        xv = _mm512_permutexvar_ps(tok, _mm512_maskz_loadu_ps(m, k->xsT + b * k->Tp + t0));
        cv = _mm512_permutexvar_epi32(tok, _mm512_maskz_loadu_epi32(m, k->corrT + b * k->Tp + t0));
    }
    return _mm512_fmadd_ps(_mm512_mul_ps(wv, xv), _mm512_cvtepi32_ps(_mm512_sub_epi32(s, cv)), acc);
}

/* The tile's dot products over every block: rp[i] row i0 + i's data, xt[j] token t0 + j's xq. */
MT_VNNI INLINE __m512 tile(const int int4, const int RT, const int TT, const tilectx *c, const uint8_t *const *rp,
                           const int8_t *const *xt, int i0, int64_t t0, const uint8_t *pf, int64_t pf_step) {
    const q8ctx *k = c->k;
    const int64_t nb = k->nb;
    const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    if (int4) {
        for (int64_t p = 0; 2 * p < nb; p++) {
            const int full = 2 * p + 1 < nb; /* else: a last block alone, the row may end after it */
            __m512i XL[4], XH[4], a[16];
            for (int j = 0; j < TT; j++) {
                XL[j] = _mm512_loadu_si512(xt[j] + p * 2 * MT_Q8B);
                XH[j] = _mm512_loadu_si512(xt[j] + p * 2 * MT_Q8B + MT_Q8B);
            }
            if (pf)
                for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch((const char *)pf + p * pf_step + o, MT_PF_HINT);
            for (int i = 0; i < RT; i++) {
                const __m512i v = full ? _mm512_loadu_si512(rp[i] + p * MT_Q8B)
                                       : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, rp[i] + p * MT_Q8B);
                const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                for (int j = 0; j < TT; j++)
                    a[j * RT + i] =
                        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, XL[j]), hi, XH[j]);
            }
            __m512i s0, s1;
            reduce_pairs(a, &s0, &s1);
            acc = apply(RT, TT, c, i0, t0, 2 * p, s0, acc);
            if (full) acc = apply(RT, TT, c, i0, t0, 2 * p + 1, s1, acc);
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            __m512i X[4], a[16];
            for (int j = 0; j < TT; j++) X[j] = _mm512_loadu_si512(xt[j] + b * MT_Q8B);
            if (pf)
                for (int64_t o = 0; o < pf_step; o += 64) _mm_prefetch((const char *)pf + b * pf_step + o, MT_PF_HINT);
            for (int i = 0; i < RT; i++) {
                const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(rp[i] + b * MT_Q8B), flip);
                for (int j = 0; j < TT; j++) a[j * RT + i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, X[j]);
            }
            acc = apply(RT, TT, c, i0, t0, b, reduce_one(a), acc);
        }
    }
    return acc;
}

/* The 16 rows' group scales as floats, transposed: wsT[g * 16 + i] = scale of row rows[i], group g. */
MT_VNNI static void scales_T(const qmat *w, const int64_t *rows, float *wsT) {
    const int64_t G = w->ngroups;
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
        const __mmask16 m = G - g0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g0)) - 1u);
        __m512 r[16], t[16];
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w->scales + rows[i] * G + g0));
        /* 16 x 16 transpose: pairs of rows, then quads, then 128-bit lanes twice */
        for (int i = 0; i < 16; i += 2) {
            t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 16; i += 4)
            for (int h = 0; h < 2; h++) {
                r[i + h] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
                r[i + 2 + h] =
                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + h]), _mm512_castps_pd(t[i + 2 + h])));
            }
        /* r[4q + c], 128-bit lane L: group 4L + c' of rows 4q..4q+3, c' = (0, 2, 1, 3)[c] */
        for (int q = 0; q < 4; q += 2)
            for (int c = 0; c < 4; c++) {
                t[4 * q + c] = _mm512_shuffle_f32x4(r[4 * q + c], r[4 * q + 4 + c], _MM_SHUFFLE(2, 0, 2, 0));
                t[4 * q + 4 + c] = _mm512_shuffle_f32x4(r[4 * q + c], r[4 * q + 4 + c], _MM_SHUFFLE(3, 1, 3, 1));
            }
        /* t[8h + 4e + c] (h: rows 0-7 / 8-15; e: 128-bit lanes 0, 2 / 1, 3), lanes: [L_e of rows 4q.., L_e+2 ..] */
        for (int e = 0; e < 2; e++)
            for (int c = 0; c < 4; c++) {
                const __m512 a = t[4 * e + c], b = t[8 + 4 * e + c];
                /* group 4 * L + c' for L = e (first) and e + 2 (second), c' as above */
                const int cp = c == 1 ? 2 : c == 2 ? 1 : c;
                const int64_t ga = g0 + 4 * e + cp, gb = g0 + 4 * (e + 2) + cp;
                const __m512 fa = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
                const __m512 fb = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
                if (ga < G) _mm512_storeu_ps(wsT + ga * 16, fa);
                if (gb < G) _mm512_storeu_ps(wsT + gb * 16, fb);
            }
    }
}

/* Rows [r0, r0 + n) of every token; tiles of 16 rows (the last one's missing rows repeat its
 * last row and are not stored). */
MT_VNNI static void q8_rows_dt(const int int4, const q8ctx *k, int64_t r0, int64_t n, float *wsT) {
    const qmat *w = k->w;
    const int64_t R = w->rows, T = k->T;
    tilectx c = {k, wsT, w->g / MT_Q8B};
    { /* the chunk's first tile now: each tile prefetches the next, and no earlier one fetched this */
        const int64_t first = (n < 16 ? n : 16) * w->row_bytes;
        for (int64_t o = 0; o < first; o += 64) _mm_prefetch((const char *)(w->data + r0 * w->row_bytes) + o, MT_PF_HINT);
    }
    for (int64_t s0 = r0; s0 < r0 + n; s0 += 16) {
        const int ns = (int)(r0 + n - s0 < 16 ? r0 + n - s0 : 16);
        int64_t rows[16];
        const uint8_t *rp[16];
        for (int i = 0; i < 16; i++) {
            rows[i] = s0 + (i < ns ? i : ns - 1);
            rp[i] = w->data + rows[i] * w->row_bytes;
        }
        scales_T(w, rows, wsT);
        /* the next tile's rows (contiguous), prefetched a slice per step of its first pass below */
        const int64_t steps = int4 ? (k->nb + 1) / 2 : k->nb;
        const uint8_t *pf = s0 + 16 < r0 + n ? w->data + (s0 + 16) * w->row_bytes : NULL;
        const int64_t pf_step = (16 * w->row_bytes + steps - 1) / steps;
        for (int64_t t0 = 0; t0 < T;) {
            const int TT = T - t0 >= 3 ? 4 : T - t0 == 2 ? 2 : 1, RT = 16 / TT;
            const int8_t *xt[4];
            for (int j = 0; j < TT; j++) xt[j] = k->xq + (t0 + j < T ? t0 + j : T - 1) * k->xstride;
            for (int i0 = 0; i0 < ns; i0 += RT) {
                /* the first pass over the tile's blocks (its first RT rows, first tokens) fetches the
                 * next tile, once: later passes read rows already here */
                const uint8_t *npf = t0 == 0 && i0 == 0 ? pf : NULL;
                __m512 acc;
                if (TT == 1) acc = int4 ? tile(1, 16, 1, &c, rp, xt, 0, t0, npf, pf_step)
                                        : tile(0, 16, 1, &c, rp, xt, 0, t0, npf, pf_step);
                else if (TT == 2) acc = int4 ? tile(1, 8, 2, &c, rp + i0, xt, i0, t0, npf, pf_step)
                                             : tile(0, 8, 2, &c, rp + i0, xt, i0, t0, npf, pf_step);
                else acc = int4 ? tile(1, 4, 4, &c, rp + i0, xt, i0, t0, npf, pf_step)
                                : tile(0, 4, 4, &c, rp + i0, xt, i0, t0, npf, pf_step);
                float o[16];
                _mm512_storeu_ps(o, acc);
                for (int j = 0; j < TT && t0 + j < T; j++)
                    for (int i = 0; i < RT && i0 + i < ns; i++) {
                        const int64_t r = s0 + i0 + i;
                        k->y[(t0 + j) * R + r] = k->bias ? o[j * RT + i] + k->bias[r] : o[j * RT + i];
                    }
            }
            t0 += TT;
        }
    }
}

MT_VNNI void mt_q8_rows_vnni(const q8ctx *k, int64_t r0, int64_t n) {
    float *wsT = mt_scratch(8, (size_t)(k->w->ngroups * 16 + 16));
    if (!wsT) /* no memory for the tile's scales: the generic loop needs none */
        mt_q8_rows_generic(k, r0, n);
    else if (k->w->dtype == DT_INT4)
        q8_rows_dt(1, k, r0, n, wsT);
    else
        q8_rows_dt(0, k, r0, n, wsT);
}
#endif
