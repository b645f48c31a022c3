/* moetier fast kernels: shared declarations.
 *
 * THE ARITHMETIC CONTRACT (what makes every kernel row-invariant and every code path
 * bit-identical -- the portable C path (generic.c), the AVX2+FMA path (x86_avx2.c), the
 * AVX-512 path (x86_avx512.c), the NEON path (arm_neon.c) and the numba fallback in
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
 *     rounding fused multiply-add (vfmadd / fmla / fmaf / llvm.fma), the same everywhere.
 *     Sixteen lanes are one AVX-512 register, two AVX2 registers (lanes 0-7, 8-15) or
 *     four NEON registers (0-3, 4-7, 8-11, 12-15): a lane is a lane on every path.
 *   sum(a, n): the same with acc[l] = acc[l] + a[16k + l].
 *   exp(x): the contract's own exponential (mt_exp below): Cody-Waite reduction by
 *     ln 2, a degree-7 polynomial in fma, scaling by an exact power of two; x < -86.5
 *     gives 0 (no subnormals), x > 88.75 gives inf, NaN stays NaN. Every step is one
 *     IEEE operation, so the vector and the scalar versions agree bit for bit (libm's
 *     expf would be scalar-only and would differ between libraries).
 *
 * Every reduction is one of those two, with n the length of the reduced dimension (C for
 * linear, dq for attention scores, the row's own number of visible keys for the softmax
 * denominator), or a maximum (exact in any order), or the attention output
 * out[d] = fma(p[s], v[s][d], out[d]) for s = 0, 1, ..., q_pos in order, per element d.
 * Attention with a sliding window W sees keys max(0, q_pos - W + 1) .. q_pos (the same
 * reductions over that range); with a learned sink per head (gpt-oss), the row's maximum
 * is max(keys' maximum, sink), and the denominator is sum(exp(score - m)) + exp(sink - m),
 * that one add after the contract's sum.
 * Every other operation is elementwise IEEE arithmetic.
 * Blocking over output rows, tokens, heads or keys, threading, and the choice of code
 * path only decide WHICH accumulator is computed WHEN, never the operations inside one
 * accumulator. Hence row t's bits depend only on row t's inputs.
 *
 * Weights: a quantized weight is exactly q * scale (int8: q; int4: nibble - 8), the value
 * moetier.weights.quant.dequantize produces; that product is exact in float32 (at most
 * 8 + 11 significant bits), so a path may form it in any exact way (e.g. one fma of the
 * nibble with scale and -8 * scale). mxfp4: e2m1(nibble) * 2^(e - 127) (mt_e2m1, mt_e8m0),
 * exact too (2 significant bits times a power of two, -0 kept -0); a path may look up the
 * magnitude and set the sign bit apart (IEEE multiplication takes the sign apart as well). Quantized weights stay quantized in memory: a path
 * dequantizes a chunk in registers or a block of rows into a small per-thread buffer,
 * never a whole matrix.
 *
 * THE INT8-ACTIVATION CONTRACT (opt-in and lossy: FastOps(activations="int8")). For int8
 * and int4 weights whose group size is a multiple of MT_Q8B (64), a linear may instead
 * quantize each token's activations per block of 64 columns -- xs = amax / 127 (IEEE division; 0 for
 * an all-zero block), xq = rint(x / xs) as int8 (0 where xs is 0) -- and compute
 *     acc = +0; for each block b in increasing order:
 *         acc = fma(ws[b] * xs[b], (float) isum[b], acc)
 *     y = acc (+ bias)
 * where ws[b] is the weight scale of the group holding block b and isum[b] is the exact
 * integer sum of (weight q) * xq over the block's columns (columns >= C have xq = 0). The
 * integer sums are exact in any order, so every path agrees bit for bit here too; only
 * the rounding of the activations to int8 is lossy (its error is measured, see
 * `moetier bench activations`).
 *
 * Every file is compiled with -ffp-contract=off so the compiler never fuses a multiply
 * and an add that the contract does not fuse, and without -ffast-math so nothing is
 * reassociated or approximated.
 */
#ifndef MT_H
#define MT_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

/* Bumped whenever the Python-facing signatures or the arithmetic change, or a fix must
 * not be missed (6: per-ISA paths chosen by name); fast.py refuses a build of another
 * version (a stale in-place build after a pull) and says so. */
#define MT_KERNELS_VERSION 18

enum { DT_F32 = 0, DT_BF16 = 1, DT_INT8 = 2, DT_INT4 = 3, DT_MXFP4 = 4 };
#define MT_MX_GROUP 32 /* mxfp4: values per e8m0 scale */
#define RB 4    /* output rows per block */
#define TBMAX 4 /* tokens per tile of the generic path; also the fused-decode limit */

/* The kernels' own prefetches of weights ahead of the rows they read (each byte is read
 * once per call) go to L2, not L1: _mm_prefetch's hint on x86 (MT_PF_HINT, where
 * immintrin.h is included), __builtin_prefetch's locality elsewhere. Measured, alternating
 * builds, Zen 4, 2 threads: OLMoE's 8 int4 experts of a decode layer from memory
 * 1200-1255 -> 1079-1110 us a call; an OLMoE int4 decode step in-process 36.5-36.7 ->
 * 32.6 ms. A prefetch hint changes when bytes arrive, never a value. */
#ifndef MT_PF_HINT
#define MT_PF_HINT _MM_HINT_T1
#endif
#ifndef MT_PF_LOCALITY
#define MT_PF_LOCALITY 2
#endif

typedef struct {
    int dtype;
    const uint8_t *data;    /* row r starts at data + r * row_bytes */
    int64_t row_bytes;
    const uint16_t *scales; /* [rows, ngroups] float16 bits; NULL for f32 / bf16 / mxfp4 */
    const uint8_t *escales; /* [rows, ngroups] e8m0 exponents (mxfp4 only) */
    int64_t ngroups;
    int64_t rows, cols;     /* logical R, C */
    int64_t g;              /* group size (0 for f32 / bf16) */
} qmat;

struct mt_isa;

/* One linear call under the int8-activation contract: the quantized tokens and the weights. */
#define MT_Q8B 64 /* columns per activation block */
typedef struct q8ctx {
    const int8_t *xq;     /* [T][xstride], column j at mt_q8_pos(dtype, j); 0 past C */
    const float *xs;      /* [T][nb] block scales */
    const int32_t *xsum;  /* [T][nb] sum of a block's xq (int4: the -8 of every nibble) */
    const float *xsT;     /* [nb][Tp] xs by block, tokens >= T 0 (kernels that tile tokens; Tp >= T + 3) */
    const int32_t *corrT; /* [nb][Tp] the weights' offset times xsum: int4 8 * xsum (nibble = q + 8),
                           * int8 128 * xsum (q + 128 as an unsigned byte); tokens >= T 0 */
    int64_t T, nb, xstride, Tp;
    const qmat *w;
    const float *bias;
    float *y;
} q8ctx;

/* Where xq keeps column j (block b = j / 64, column c = j % 64). int8 weights: in place.
 * int4 weights: blocks in pairs (2p, 2p + 1), 128 bytes a pair: the even columns of block 2p,
 * those of 2p + 1, then the odd columns of 2p and of 2p + 1 -- the low and the high nibbles
 * of the pair's 64 bytes of a row, in order (an odd last block pairs with zeros). */
static inline int64_t mt_q8_pos(int dtype, int64_t j) {
    if (dtype != DT_INT4) return j;
    const int64_t b = j / MT_Q8B, c = j % MT_Q8B;
    return (b / 2) * 2 * MT_Q8B + (c & 1) * MT_Q8B + (b & 1) * (MT_Q8B / 2) + c / 2;
}

void mt_q8_rows_generic(const q8ctx *k, int64_t r0, int64_t n);

/* One linear call: y[t, r] = dot(x[t], w[r], C) (+ bias[r]). */
typedef struct {
    const struct mt_isa *isa;
    const float *x;
    int64_t T, blen;
    const qmat *w;
    const float *bias;
    float *y;
    atomic_int failed; /* a chunk could not allocate its buffer */
    /* int4 weights on an ISA with an xp_order (see there): x's columns in that order
     * (mt_int4_pairs_src, mt_int4_halves_src), token by token; NULL otherwise */
    const float *xp;
    /* NULL, or this linear under the int8-activation contract (x already quantized there) */
    const struct q8ctx *q8;
} linear_ctx;

/* The orders an ISA's int4 kernels may want x's columns in (mt_isa.xp_order). */
enum { MT_XP_NONE = 0, MT_XP_PAIRS32 = 1, MT_XP_HALVES16 = 2 };

/* The column order of linear_ctx.xp: per chunk of 32 columns c, the even columns of
 * [c, c + 16), its odd ones, then the even and the odd ones of [c + 16, c + 32) -- the
 * order of the low and the high nibbles of the chunk's 16 bytes. */
static inline int64_t mt_int4_pairs_src(int64_t j) {
    const int64_t c = j & ~(int64_t)31, i = j & 31, half = i >> 4, odd = (i >> 3) & 1, k = i & 7;
    return c + 16 * half + 2 * k + odd;
}

/* The halves order: per chunk of 16 columns c, position 2k holds column c + k and
 * position 2k + 1 column c + 8 + k (k < 8) -- the 32-bit lanes a chunk's 8 bytes reach
 * when broadcast to every 64-bit lane and shifted by 4 * (lane / 2). */
static inline int64_t mt_int4_halves_src(int64_t j) {
    return (j & ~(int64_t)15) + 8 * (j & 1) + ((j & 15) >> 1);
}

/* out[j][i] = dot(xr[j], wr[i], n) for j < tb <= TBMAX, i < RB. */
typedef void (*tile_fn)(int tb, const float *const *xr, const float *const *wr, int64_t n,
                        float out[TBMAX][RB]);

/* The kernels of one instruction set. Every function computes exactly what the generic
 * one computes (the contract above); `linear_block` may use `buf`: RB * ctx->blen floats
 * for dequantized rows, then MT_STATE_TOKENS * RB * 16 for accumulators kept between
 * column blocks (see x86_avx2.c). */
#define MT_STATE_TOKENS 96
#ifndef MT_PAIR_COLS
#define MT_PAIR_COLS 512 /* columns of a pair's dequantized block */
#endif
#define MT_PAIR_BUF (2 * RB * MT_PAIR_COLS + MT_STATE_TOKENS * 2 * RB * 16)
typedef struct mt_isa {
    const char *name;
    int (*supported)(void);
    /* output rows [r0, r0 + RB) (clipped to R) of every token */
    void (*linear_block)(const linear_ctx *k, int64_t r0, float *buf);
    /* optional: rows [r0, r0 + 2 * RB) at once, where the ISA does them faster than block by
     * block (one token: more independent accumulators; many: each token's columns read once
     * per 2 * RB rows); 1 where done, 0 where not its case. buf: the 64-byte aligned buffer of
     * linear_block, at least MT_PAIR_BUF floats. */
    int (*linear_pair)(const linear_ctx *k, int64_t r0, float *buf);
    /* optional, decode (T <= TBMAX): rows [r0, r0 + n) in lanes (mt_lanes), where the ISA has
     * a lane kernel for w and T; returns how many rows it did from r0 (a multiple of RB, maybe 0) */
    int64_t (*linear_lanes)(const linear_ctx *k, int64_t r0, int64_t n);
    /* optional: the whole linear for T >= many_min tokens (its own split into chunks);
     * returns 0 or -1 (no memory) */
    int (*linear_many)(int nthreads, const float *x, int64_t T, const qmat *w, const float *bias, float *y);
    int64_t many_min;
    /* its linear_block reads linear_ctx.xp ([T][C], every token) for int4 weights whose
     * columns and group size are multiples of 32 (MT_XP_PAIRS32) or 16 (MT_XP_HALVES16);
     * mt_linear makes it */
    int xp_order;
    /* optional: rows [r0, r0 + n) of every token under the int8-activation contract (NULL:
     * the generic one) */
    void (*q8_rows)(const struct q8ctx *k, int64_t r0, int64_t n);
    /* probes of the machine's limits (bench compute): n rounds of twelve independent fma
     * chains, returns the flops done; a read of every byte of p (returns a checksum) */
    double (*fma_probe)(int64_t n, float seed);
    uint64_t (*read_probe)(const uint8_t *p, int64_t bytes);
    tile_fn tile;
    float (*sum)(const float *a, int64_t n);
    float (*max)(const float *a, int64_t n);                        /* -inf for n = 0; NaN never wins */
    void (*divide)(float *y, float d, int64_t n);                   /* y = y / d */
    void (*exp_shift)(const float *x, float m, int64_t n, float *y); /* y = exp(x - m) */
    void (*swiglu)(float *g, const float *u, int64_t n);             /* g = (g / (1 + exp(-g))) * u */
    /* acc[h][d] = fma(p[h][s], v[s][d], acc[h][d]) for s in [s0, s1) increasing, h < nh <= 4 */
    void (*pv)(int nh, const float *const *p, const float *v, int64_t vstride, int64_t s0, int64_t s1,
               int64_t dv, float *const *acc);
} mt_isa;

extern const mt_isa mt_isa_generic;
#if defined(__x86_64__)
extern const mt_isa mt_isa_avx2;
extern const mt_isa mt_isa_avx512;
void mt_q8_rows_avx2(const q8ctx *k, int64_t r0, int64_t n); /* AVX2's q8_rows, for the AVX-512 table */
/* AVX-512 VNNI's (x86_vnni.c), which the AVX-512 table takes where the CPU has VNNI */
int mt_cpu_vnni(void);
void mt_q8_rows_vnni(const q8ctx *k, int64_t r0, int64_t n);
#endif
#if defined(__aarch64__)
extern const mt_isa mt_isa_neon;
#endif

/* Every ISA compiled into this build, best first (the generic one last), NULL-terminated. */
extern const mt_isa *const mt_isas[];
const mt_isa *mt_isa_by_name(const char *name); /* NULL: unknown here */
const mt_isa *mt_isa_best(void);                /* the best one this CPU supports */

/* ---------------------------------------------------------------- shared scalar helpers */

/* Lanes: a decode kernel that works on nl rows at once takes them from nl lanes, each a
 * contiguous stretch of L rows, rows r0 + i * L + j for lane i at step j, rather than nl
 * neighbouring rows: each lane then reads its own stretch of memory in order, one ascending
 * stream a page, the pattern a hardware prefetcher follows (neighbouring rows of 1 KiB put
 * four interleaved streams in each 4 KiB page), and the kernel prefetches each lane's own
 * stream MT_LANE_PF bytes ahead. Which rows run together decides nothing in any row's
 * arithmetic: the same bits. mt_lanes returns L for the whole lanes of [r0, r0 + n) clipped
 * to R (0: none) and prefetches each lane's first MT_LANE_PF bytes and first scales. */
#ifndef MT_LANE_PF
#define MT_LANE_PF 1024
#endif
#ifndef MT_LANES /* 0: rows in blocks as before lanes (a build to compare against: CFLAGS=-DMT_LANES=0) */
#define MT_LANES 1
#endif
static inline int64_t mt_lanes(const qmat *w, int64_t r0, int64_t n, int nl) {
    if (r0 + n > w->rows) n = w->rows - r0;
    const int64_t unit = nl % RB == 0 ? nl : nl * RB; /* whole blocks, whole lanes */
    const int64_t L = n / unit * unit / nl;
    for (int i = 0; L && i < nl; i++) {
        const int64_t r = r0 + i * L;
        const char *d = (const char *)w->data + r * w->row_bytes;
        for (int64_t o = 0; o < MT_LANE_PF; o += 64) __builtin_prefetch(d + o, 0, MT_PF_LOCALITY);
        if (w->scales) __builtin_prefetch(w->scales + r * w->ngroups, 0, MT_PF_LOCALITY);
    }
    return L;
}

static inline int64_t mt_round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static inline float mt_f16(uint16_t h) {
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

/* mxfp4: the e2m1 value of a nibble (8: -0.0) and 2^(e - 127) of an e8m0 byte (0: the
 * subnormal 2^-127, 255: NaN) -- moetier.weights.quant.E2M1 and e8m0_to_f32 */
static const float mt_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static inline float mt_e8m0(uint8_t e) {
    const uint32_t bits = e == 0 ? 0x00400000u : e == 255 ? 0x7fc00000u : (uint32_t)e << 23;
    float v;
    memcpy(&v, &bits, 4);
    return v;
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

/* The contract's exp, one IEEE operation per step (fmaf is the single-rounding fma). */
static inline float mt_exp(float x) {
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

/* The generic pieces other paths fall back to (generic.c). */
void mt_dequant_row_generic(const qmat *w, int64_t r, float *buf);
void mt_linear_block_tiles(const linear_ctx *k, int64_t r0, float *buf,
                           const float *(*row_values)(const qmat *, int64_t, float *), tile_fn tile);
float mt_hsum16(const float *a);
/* Per head h < H: y[t, h, :] = x[t, h, :N] @ W[h * S + off : h * S + off + N, :] (the rows used
 * transposed; strides in floats). The linear contract's bits for that transposed matrix on
 * every path (generic.c). */
void mt_linear_t(int nthreads, const float *x, int64_t xs_t, int64_t xs_h, int64_t T, int64_t H, int64_t N,
                 const qmat *w, int64_t S, int64_t off, float *y, int64_t ys_t, int64_t ys_h);

/* ---------------------------------------------------------------- the operations (ops.c) */

void *mt_xalloc(size_t bytes);
/* A per-thread buffer of at least `floats` floats, kept for the thread's next calls (slots
 * 0..8 are independent buffers, each used by one kernel: 0-2 the outer-product panels,
 * 3 x in an int4 order, 4 linear row blocks, 5 attention scores of one token,
 * 6-7 the queries and scores of a block of tokens, 8 the int8-activation kernels' weight
 * scales); NULL when out of memory. */
float *mt_scratch(int slot, size_t floats);
int64_t mt_rowbuf_len(const qmat *w);
int mt_linear(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *w, const float *bias,
              float *y);
/* Several linears of the same x in one job (each w[i] with x's columns, n <= 64); q8: those
 * inside the int8-activation contract under it. The bits of mt_linear (mt_linear_q8) on each. */
int mt_linears(const mt_isa *isa, int nthreads, const float *x, int64_t T, int n, const qmat *w,
               const float *const *bias, float *const *y, int q8);
/* Per head h < H: y[t, h, :N] = x[t, h, :C] @ W[h * S + off : h * S + off + N].T, W [rows, C]
 * (strides in floats): mt_linear's bits on each head's block of rows, in few jobs. */
int mt_head_linears(const mt_isa *isa, int nthreads, const float *x, int64_t xs_t, int64_t xs_h, int64_t T,
                    int64_t H, const qmat *w, int64_t S, int64_t off, int64_t N, float *y, int64_t ys_t,
                    int64_t ys_h);
int mt_ffn(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *gate, const qmat *up,
           const qmat *down, float *y);
/* Many experts, each y = down(silu(gate x) * up x) on its own rows (x [T, D], y [T, D]);
 * the same bits as mt_ffn on each, computed together (few-token experts share the pool's
 * jobs). Returns 0 or -1 (no memory). */
typedef struct {
    const float *x;
    int64_t T;
    const qmat *gate, *up, *down;
    float *y;
} mt_expert;
int mt_ffn_many(const mt_isa *isa, int nthreads, int64_t n, const mt_expert *ex, int q8);
/* The same under the int8-activation contract (weights outside it: the exact kernels); mt_ffn_many
 * with q8 set does so too. */
int mt_linear_q8(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *w, const float *bias,
                 float *y);
int mt_ffn_q8(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *gate, const qmat *up,
              const qmat *down, float *y);
void mt_rmsnorm(const mt_isa *isa, const float *x, int64_t T, int64_t C, const float *wt, float eps, float *y);
void mt_softmax_row(const mt_isa *isa, const float *x, int64_t n, float *y);
/* sinks: NULL or [H] (one learned logit per head in every row's softmax); window: 0 or W */
int mt_attention(const mt_isa *isa, int nthreads, const float *q, const float *k, const float *v,
                 const int64_t *qpos, int64_t T, int64_t H, int64_t S, int64_t Hkv, int64_t dq, int64_t dv,
                 float scale, const float *sinks, int64_t window, float *out);
/* One GQA attention layer over one sequence's T rows, from the residual stream to the residual
 * stream (moetier.model.attention.GqaAttention.block): h = rmsnorm(x, norm); q, k, v = the
 * linears of h (q8: under the int8-activation contract); q and k normed (qk_mode 1: over the
 * whole projection, 2: per head; qn/kn their weights); where `clip`, q, k and v clipped to
 * [-clip_to, clip_to] as np.clip does (NaN stays NaN); q and k rotated (mt_rope, P pairs); k and v
 * written to cache rows S - T .. S - 1 of kc, vc [>= S, Hkv, hd]; attention over cache rows
 * 0 .. S - 1 at qpos; out = x + o(attention). Every step is the function the Python path calls
 * for it, on the same values in the same order, so the bits are that path's. Returns 0, or -1
 * (no memory). */
typedef struct {
    const float *x, *norm;
    int64_t T, D;
    float eps;
    const qmat *wq, *wk, *wv, *wo;
    const float *bq, *bk, *bv, *bo;
    const float *qn, *kn;
    int qk_mode, clip;
    float clip_to;
    int64_t H, Hkv, hd, P;
    const float *cos, *sin;
    int interleave;
    float *kc, *vc;
    int64_t S;
    const int64_t *qpos;
    float scale;
    const float *sinks;
    int64_t window;
    float *out;
    int q8;
} mt_gqa;
int mt_gqa_block(const mt_isa *isa, int nthreads, const mt_gqa *a);
/* The softmax router's choice (moetier.model.router: scores = softmax(h @ w.T + bias), ids the K
 * best of each row, best first, the lower expert on ties -- np.argsort(-scores, kind="stable")'s
 * order, a NaN after every number -- and their scores): h [T, C], w [E, C], bias NULL or [E];
 * ids [T, K] int32, chosen [T, K]. The linear (q8: under the int8-activation contract) and the
 * softmax are the functions the Python path calls, so the same bits. Returns 0, or -1 (no memory). */
int mt_route_softmax(const mt_isa *isa, int nthreads, const float *h, int64_t T, const qmat *w, const float *bias,
                     int64_t K, int q8, int32_t *ids, float *chosen);
/* The slots of the listed experts: y[s] = FFN_e(x[s / K]) for every slot s < T * K with ids[s] =
 * eid[e], e < n (w: gate, up and down of each, 3n); other slots are left as they are. With cw
 * [T, K] (and combined [T, D]), also combined = mt_combine(y, cw). x [T, D], y [T, K, D]. The
 * bits of mt_ffn_many on each expert's rows. Returns 0, or -1 (no memory). */
int mt_experts_run(const mt_isa *isa, int nthreads, const float *x, int64_t T, int64_t D, const int64_t *ids,
                   int64_t K, int64_t n, const int64_t *eid, const qmat *w, int q8, float *y, const float *cw,
                   float *combined);
/* numpy's float32 sum of n contiguous numbers (np.add.reduce over a row: its pairwise_sum -- under 8
 * in order from -0.0, up to 128 in eight running sums then ((r0 + r1) + (r2 + r3)) + ((r4 + r5) +
 * (r6 + r7)) and the rest in order, above that the two halves at a multiple of 8). */
float mt_np_sum(const float *a, int64_t n);
/* A MoE layer of resident plain SwiGLU experts with a softmax router, residual stream in and out
 * (moetier.model.ffn.MoeBlock.block): h = rmsnorm(x, norm, eps); ids, chosen = mt_route_softmax(h,
 * router, bias, K); weights = chosen, divided by (their mt_np_sum + 1e-20) where renorm, times
 * scale; out = x + mt_combine(the slots of mt_experts_run, weights). The experts are the table's:
 * w [3E] (gate, up, down of expert e at 3e), have [E] nonzero where expert e is there. ids [T, K]
 * int32 and weights [T, K] are written too. Each step is the function the Python path calls, so
 * the same bits. Returns 0, -1 (no memory) or -2 (a routed expert is not in the table). */
typedef struct {
    const float *x, *norm;
    int64_t T, D;
    float eps;
    const qmat *router;
    const float *bias;
    int64_t K;
    int renorm;
    float scale;
    int64_t E;
    const qmat *w;
    const unsigned char *have;
    int q8;
    float *out;
    int32_t *ids;
    float *weights;
} mt_moe;
int mt_moe_block(const mt_isa *isa, int nthreads, const mt_moe *a);
/* gpt-oss's clamped SwiGLU, elementwise: g = min(g, limit), u = clamp(u, -limit, limit),
 * g = (u + 1) * (g * (1 / (1 + exp(-(g * alpha))))) -- with the contract's exp, in place in g */
void mt_glu_clamped(float *g, const float *u, int64_t n, float alpha, float limit);

/* Elementwise steps of the forward pass, each exactly its numpy definition (one IEEE operation
 * per step; -ffp-contract=off keeps a multiply and an add apart):
 * mt_combine: out[t, d] = 0, then out[t, d] += w[t, j] * ys[t, j, d] for j = 0 .. K-1 in order
 *   (moetier.model.ops.combine_slots); ys [T, K, D], w [T, K], out [T, D].
 * mt_rope: out = x, then per row t, head h and pair p < P of the first 2P dims, with a, b the
 *   pair (x[p], x[P + p]; interleaved: x[2p], x[2p + 1]): a * c - b * s and b * c + a * s for
 *   c = cos[t, p], s = sin[t, p] (moetier.model.rope.Rope.apply); x, out [T, H, d], cos, sin [T, P]. */
void mt_combine(const float *ys, const float *w, int64_t T, int64_t K, int64_t D, float *out);
void mt_rope(const float *x, const float *cos, const float *sin, int64_t T, int64_t H, int64_t d, int64_t P,
             int interleave, float *out);

/* The probes on nthreads threads: flops done / a checksum of the bytes read. */
double mt_fma_probe(const mt_isa *isa, int nthreads, int64_t rounds);
uint64_t mt_read_probe(const mt_isa *isa, int nthreads, const uint8_t *p, int64_t bytes);

/* ---------------------------------------------------------------- the work pool (pool.c) */

typedef void (*chunk_fn)(void *ctx, int64_t chunk);
/* Run fn(ctx, c) for c in [0, nchunks) on up to nthreads threads (the caller included);
 * returns when every chunk has finished, on whichever thread. */
void mt_pool_run(int nthreads, int64_t nchunks, chunk_fn fn, void *ctx);
/* How long (ns) idle helpers poll for the next job before they sleep (see pool.c). */
void mt_pool_set_spin(int64_t ns);
int64_t mt_pool_spin(void);
void mt_pool_park(void);

#endif
