/* The operations, on any ISA's kernels: how work is split into chunks for the pool and
 * how the pieces of one operation follow each other. Nothing here decides a bit: every
 * floating-point operation happens inside an ISA's kernel (or is elementwise IEEE
 * arithmetic written out here once for all of them). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mt.h"

const mt_isa *const mt_isas[] = {
#if defined(__x86_64__)
    &mt_isa_avx512,
    &mt_isa_avx2,
#endif
#if defined(__aarch64__)
    &mt_isa_neon,
#endif
    &mt_isa_generic,
    NULL,
};

const mt_isa *mt_isa_by_name(const char *name) {
    for (int i = 0; mt_isas[i]; i++)
        if (strcmp(mt_isas[i]->name, name) == 0) return mt_isas[i];
    return NULL;
}

const mt_isa *mt_isa_best(void) {
    /* callers on several threads may race to fill it in: they store the same value */
    static const mt_isa *_Atomic best = NULL;
    const mt_isa *b = atomic_load_explicit(&best, memory_order_relaxed);
    if (!b) {
        for (int i = 0; mt_isas[i] && !b; i++)
            if (mt_isas[i]->supported()) b = mt_isas[i];
        atomic_store_explicit(&best, b, memory_order_relaxed);
    }
    return b;
}

void *mt_xalloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    return p;
}

#define SCRATCH_SLOTS 9
typedef struct {
    float *p[SCRATCH_SLOTS];
    size_t n[SCRATCH_SLOTS];
} scratch_t;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *v) {
    scratch_t *s = v;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(s->p[i]);
    free(s);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

float *mt_scratch(int slot, size_t floats) {
    if (slot < 0 || slot >= SCRATCH_SLOTS) return NULL;
    pthread_once(&scratch_once, scratch_init);
    scratch_t *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof(*s)))) return NULL;
        pthread_setspecific(scratch_key, s);
    }
    if (s->n[slot] < floats) {
        free(s->p[slot]);
        s->n[slot] = 0;
        if (!(s->p[slot] = mt_xalloc(floats * 4))) return NULL;
        s->n[slot] = floats;
    }
    return s->p[slot];
}

int64_t mt_rowbuf_len(const qmat *w) {
    int64_t n = mt_round16(w->cols);
    int64_t cp = w->g ? w->ngroups * w->g : w->cols;
    return (n > cp ? n : cp) + 16;
}

/* ---------------------------------------------------------------- linear */
/* One token of int4 weights on an ISA with an xp_order: chunks up to sixteen times longer (512 KiB
 * of int4 rows). The pool gives each thread one contiguous range of the chunks, so a chunk's end
 * is only where another thread may take over; longer chunks leave fewer such joins in a
 * thread's stream (measured, alternating builds: 2048 x 2048 int4, batch 1, 2 threads, Zen 4,
 * 107-111 us a linear with 128 KiB chunks -> 99-110 us; 1024 rows 61 -> 57-60 us). */
#define PAIRS_CHUNK_MUL 16
/* ... and a chunk's first MT_CHUNK_PROLOGUE blocks, which no earlier block of the thread
 * prefetched, are prefetched when the chunk starts (measured with the sequential prefetch of
 * x86_avx512.c's halves kernels: 4.6 MB int4 experts, batch 1, 2 threads, Zen 4,
 * 16.9-19.2 -> 19.4-20.2 GB/s best). */
#define MT_CHUNK_PROLOGUE 2

/* A job of one or more linears (an expert's gate and up share their input; a layer's
 * experts run in one job): their row blocks, linear after linear, cut into chunks of at most
 * the linear's bpc blocks and at most a quarter of a thread's share. A chunk never spans two
 * linears. The pool cuts the chunks into one contiguous range per thread and balances the end
 * by taking chunks from the backs of the other ranges (pool.c), so chunks of equal size give
 * ranges of equal work. */
#define LINEAR_MAX_CHUNKS 1024
#define LINEAR_MAX_K 64 /* linears per job */
typedef struct {
    linear_ctx *k[LINEAR_MAX_K];
    int64_t start[LINEAR_MAX_CHUNKS], end[LINEAR_MAX_CHUNKS]; /* chunk c: blocks [start[c], end[c]) */
    uint8_t which[LINEAR_MAX_CHUNKS];                         /* of linear which[c] */
} linear_job;

/* The chunks of nk <= LINEAR_MAX_K linears of nb[i] blocks, at most bpc[i] blocks a chunk, each
 * a multiple of gran[i] blocks but for a linear's last. */
static int64_t plan_chunks(linear_job *j, const int64_t *nb, const int64_t *bpc_in, const int64_t *gran, int nk,
                           int nthreads) {
    int64_t total = 0, est = 0, scale = 1;
    for (int i = 0; i < nk; i++) {
        total += nb[i];
        est += nb[i] / bpc_in[i];
    }
    /* at least four chunks a thread, so that a small job still has a range for every thread and
     * a few chunks to even out its end */
    const int64_t most = (total + 4 * nthreads - 1) / (4 * nthreads);
    /* huge matrices: fewer, bigger chunks */
    if (est > (LINEAR_MAX_CHUNKS - 2 * LINEAR_MAX_K) / 2) scale = est / ((LINEAR_MAX_CHUNKS - 2 * LINEAR_MAX_K) / 2) + 1;
    int64_t n = 0;
    for (int i = 0; i < nk; i++) {
        const int64_t bpc = bpc_in[i] * scale < most ? bpc_in[i] * scale : most;
        const int64_t sz = (bpc + gran[i] - 1) / gran[i] * gran[i];
        int64_t b = 0;
        while (b < nb[i]) {
            int64_t e = b + sz > nb[i] ? nb[i] : b + sz;
            if (n >= LINEAR_MAX_CHUNKS - 2 * (nk - i)) e = nb[i]; /* the rest of this linear in one chunk */
            j->start[n] = b;
            j->end[n] = e;
            j->which[n] = (uint8_t)i;
            n++;
            b = e;
        }
    }
    return n;
}

static void linear_chunk(void *ctx, int64_t chunk) {
    linear_job *j = ctx;
    const int64_t b0 = j->start[chunk], b1 = j->end[chunk];
    linear_ctx *k = j->k[j->which[chunk]];
    if (k->q8) { /* the int8-activation contract: rows [b0 * RB, b1 * RB) */
        const int64_t r0 = b0 * RB, r1 = b1 * RB < k->w->rows ? b1 * RB : k->w->rows;
        (k->isa->q8_rows ? k->isa->q8_rows : mt_q8_rows_generic)(k->q8, r0, r1 - r0);
        return;
    }
    const int64_t nbuf = RB * k->blen + MT_STATE_TOKENS * RB * 16;
    float *buf = mt_scratch(4, (size_t)(nbuf > MT_PAIR_BUF ? nbuf : MT_PAIR_BUF));
    if (!buf) {
        atomic_store(&k->failed, 1);
        return;
    }
    int64_t b = b0;
    if (MT_LANES && k->T <= TBMAX && k->isa->linear_lanes) { /* decode: the rows in lanes (mt_lanes), where the ISA has them */
        b += k->isa->linear_lanes(k, b0 * RB, (b1 - b0) * RB) / RB;
        if (b == b1) return;
    }
    if (k->T <= TBMAX) { /* the decode kernels prefetch blocks ahead; fetch the chunk's first ones now */
        const qmat *w = k->w;
        const int64_t nb = b1 - b < MT_CHUNK_PROLOGUE ? b1 - b : MT_CHUNK_PROLOGUE;
        const char *d = (const char *)w->data + b * RB * w->row_bytes;
        for (int64_t o = 0; o < nb * RB * w->row_bytes; o += 64) __builtin_prefetch(d + o, 0, MT_PF_LOCALITY);
        if (w->scales) {
            const char *sc = (const char *)(w->scales + b * RB * w->ngroups);
            for (int64_t o = 0; o < nb * RB * w->ngroups * 2; o += 64) __builtin_prefetch(sc + o, 0, MT_PF_LOCALITY);
        }
    }
    while (b < b1) {
        if (b + 1 < b1 && k->isa->linear_pair && k->isa->linear_pair(k, b * RB, buf)) {
            b += 2;
            continue;
        }
        k->isa->linear_block(k, b * RB, buf);
        b++;
    }
}

/* Whether the ISA's int4 kernels read x's columns in an order of their own for w (linear_ctx.xp). */
static int xp_wanted(const mt_isa *isa, const qmat *w) {
    const int64_t xp_mult = isa->xp_order == MT_XP_PAIRS32 ? 32 : isa->xp_order == MT_XP_HALVES16 ? 16 : 0;
    /* every token count of the job path (the outer-product paths copy x their own way); whole
     * groups only (a group wider than the row, g > C, would have those kernels read x past C) */
    return xp_mult && w->dtype == DT_INT4 && w->cols % xp_mult == 0 && w->g % xp_mult == 0 && w->cols % w->g == 0;
}

/* x's columns in that order into xp [T, C] (C a multiple of the order's chunk, as xp_wanted
 * asks): xp[j] = x[mt_int4_pairs_src(j)] or x[mt_int4_halves_src(j)], written as the
 * interleave (halves) or the even / odd split (pairs) it is, loops the compiler turns into
 * shuffles (an index computed per element took about 20 us of a 16-token 1408 x 2048 linear). */
static void xp_order_into(const mt_isa *isa, const float *x, int64_t T, int64_t C, float *xp) {
    const int64_t n = T * C; /* chunks never straddle tokens: C is a multiple of the chunk */
    if (isa->xp_order == MT_XP_PAIRS32) {
        for (int64_t c = 0; c < n; c += 16) /* each half of a 32-chunk: its even columns, then its odd */
            for (int k = 0; k < 8; k++) {
                xp[c + k] = x[c + 2 * k];
                xp[c + 8 + k] = x[c + 2 * k + 1];
            }
        return;
    }
    for (int64_t c = 0; c < n; c += 16) /* halves: columns c + k and c + 8 + k side by side */
        for (int k = 0; k < 8; k++) {
            xp[c + 2 * k] = x[c + k];
            xp[c + 2 * k + 1] = x[c + 8 + k];
        }
}

/* ... in scratch slot `slot` (NULL: no memory) */
static float *xp_fill(const mt_isa *isa, const float *x, int64_t T, int64_t C, int slot) {
    float *xp = mt_scratch(slot, (size_t)(T * C));
    if (xp) xp_order_into(isa, x, T, C, xp);
    return xp;
}

/* about 32 KiB of weights per chunk: small enough to balance, big enough to amortise */
static int64_t blocks_per_chunk(const qmat *w, int64_t T, int pairs) {
    int64_t bpc = (32 << 10) / (RB * (w->row_bytes > 0 ? w->row_bytes : 1));
    if (T > TBMAX) bpc = bpc * TBMAX / T; /* keep chunks near equal work at large T */
    if (bpc < 1) bpc = 1;
    return pairs ? bpc * PAIRS_CHUNK_MUL : bpc;
}

/* Run nk linear contexts (each with its x, xp, w, bias, y set) as one job. 0 or -1 (no memory). */
static int linears_run(int nthreads, linear_ctx *k, int nk) {
    linear_job j;
    int64_t nb[LINEAR_MAX_K], bpc[LINEAR_MAX_K], gran[LINEAR_MAX_K];
    for (int i = 0; i < nk; i++) {
        j.k[i] = &k[i];
        nb[i] = (k[i].w->rows + RB - 1) / RB;
        bpc[i] = blocks_per_chunk(k[i].w, k[i].T, k[i].T == 1 && (k[i].xp != NULL || k[i].q8 != NULL));
        /* the int8-activation kernels work in tiles of 16 rows (x86_vnni.c); an ISA's pairs of
         * blocks, where it has them, for many tokens */
        gran[i] = k[i].q8 ? 16 / RB : k[i].T > TBMAX && k[i].isa->linear_pair ? 2 : 1;
    }
    const int64_t nchunks = plan_chunks(&j, nb, bpc, gran, nk, nthreads > 1 ? nthreads : 1);
    mt_pool_run(nthreads, nchunks, linear_chunk, &j);
    for (int i = 0; i < nk; i++)
        if (atomic_load(&k[i].failed)) return -1;
    return 0;
}

/* y[t, r] = dot(x[t], w[r], C) (+ bias[r]) for one linear, or for two (w2: NULL or a second
 * weight of the same columns, y2 its output, no bias) in one job -- or one after the other on
 * the ISA's outer-product path, from many_min tokens.  x [T, C], y [T, R]. Returns 0 or -1
 * (no memory). */
static int linear_job_run(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *w, const float *bias,
                          float *y, const qmat *w2, float *y2) {
    if (isa->linear_many && T >= isa->many_min)
        return isa->linear_many(nthreads, x, T, w, bias, y) == 0 &&
                       (!w2 || isa->linear_many(nthreads, x, T, w2, NULL, y2) == 0)
                   ? 0
                   : -1;
    float *xp = NULL, *xp2 = NULL;
    if (xp_wanted(isa, w) && !(xp = xp_fill(isa, x, T, w->cols, 3))) return -1;
    /* the same columns, so the same order (an expert's gate and up) */
    if (w2 && xp_wanted(isa, w2) && !(xp2 = xp ? xp : xp_fill(isa, x, T, w2->cols, 3))) return -1;
    linear_ctx k[2] = {{isa, x, T, mt_rowbuf_len(w), w, bias, y, 0, xp},
                       {isa, x, T, w2 ? mt_rowbuf_len(w2) : 0, w2, NULL, y2, 0, xp2}};
    return linears_run(nthreads, k, w2 ? 2 : 1);
}

/* y[t, r] = dot(x[t], w[r], C) (+ bias[r]).  x [T, C], y [T, R]. Returns 0 or -1 (no memory). */
int mt_linear(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *w, const float *bias,
              float *y) {
    return linear_job_run(isa, nthreads, x, T, w, bias, y, NULL, NULL);
}

/* Per head h < H: y[t, h, :N] = x[t, h, :C] @ W[h * S + off : + N].T -- mt_linear on each head's
 * block of rows (its bits), the heads in jobs of up to LINEAR_MAX_K linears. Strides in floats.
 * One token reads x and writes y in place; more are copied head by head. 0 or -1 (no memory). */
int mt_head_linears(const mt_isa *isa, int nthreads, const float *x, int64_t xs_t, int64_t xs_h, int64_t T,
                    int64_t H, const qmat *w, int64_t S, int64_t off, int64_t N, float *y, int64_t ys_t,
                    int64_t ys_h) {
    const int64_t C = w->cols;
    const int many = isa->linear_many && T >= isa->many_min, xw = !many && xp_wanted(isa, w);
    const int64_t hb = H < LINEAR_MAX_K ? H : LINEAR_MAX_K; /* heads per job */
    float *xb = T > 1 ? mt_xalloc((size_t)(hb * T * C) * 4) : NULL;
    float *yb = T > 1 ? mt_xalloc((size_t)(hb * T * N) * 4) : NULL;
    float *xpb = xw ? mt_scratch(3, (size_t)(hb * T * C)) : NULL; /* the thread's own x-order buffer, kept */
    int rc = (T > 1 && (!xb || !yb)) || (xw && !xpb) ? -1 : 0;
    qmat wh[LINEAR_MAX_K];
    linear_ctx k[LINEAR_MAX_K];
    for (int64_t h0 = 0; h0 < H && rc == 0; h0 += hb) {
        const int n = (int)(H - h0 < hb ? H - h0 : hb);
        for (int i = 0; i < n; i++) {
            const int64_t h = h0 + i, r0 = h * S + off;
            wh[i] = *w;
            wh[i].rows = N;
            wh[i].data = w->data + r0 * w->row_bytes;
            if (w->scales) wh[i].scales = w->scales + r0 * w->ngroups;
            if (w->escales) wh[i].escales = w->escales + r0 * w->ngroups;
            const float *xh = x + h * xs_h;
            float *yh = y + h * ys_h;
            if (T > 1) {
                float *xc = xb + i * T * C;
                for (int64_t t = 0; t < T; t++) memcpy(xc + t * C, x + t * xs_t + h * xs_h, (size_t)C * 4);
                xh = xc;
                yh = yb + i * T * N;
            }
            if (xw) xp_order_into(isa, xh, T, C, xpb + i * T * C);
            k[i] = (linear_ctx){isa, xh, T, mt_rowbuf_len(&wh[i]), &wh[i], NULL, yh, 0,
                                xw ? xpb + i * T * C : NULL, NULL};
        }
        if (many) {
            for (int i = 0; i < n && rc == 0; i++) rc = mt_linear(isa, nthreads, k[i].x, T, &wh[i], NULL, k[i].y);
        } else {
            rc = linears_run(nthreads, k, n);
        }
        if (T > 1)
            for (int i = 0; i < n; i++)
                for (int64_t t = 0; t < T; t++)
                    memcpy(y + t * ys_t + (h0 + i) * ys_h, yb + (i * T + t) * N, (size_t)N * 4);
    }
    free(xb);
    free(yb);
    return rc;
}

/* ---------------------------------------------------------------- int8 activations (lossy) */

/* The quantized weight of row r at column c: q (int8) or nibble - 8 (int4). */
static inline int32_t wq_at(const qmat *w, int64_t r, int64_t c) {
    const uint8_t *row = w->data + r * w->row_bytes;
    if (w->dtype == DT_INT8) return (int8_t)row[c];
    const uint8_t b = row[c / 2];
    return (int32_t)((c & 1) ? b >> 4 : b & 15) - 8;
}

void mt_q8_rows_generic(const q8ctx *k, int64_t r0, int64_t n) {
    const qmat *w = k->w;
    const int64_t C = w->cols, R = w->rows;
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint16_t *ws = w->scales + r * w->ngroups;
        for (int64_t t = 0; t < k->T; t++) {
            const int8_t *xq = k->xq + t * k->xstride;
            float acc = 0.0f;
            for (int64_t b = 0; b < k->nb; b++) {
                int32_t isum = 0;
                for (int64_t j = MT_Q8B * b; j < MT_Q8B * (b + 1) && j < C; j++)
                    isum += wq_at(w, r, j) * xq[mt_q8_pos(w->dtype, j)];
                const float sc = mt_f16(ws[(MT_Q8B * b) / w->g]) * k->xs[t * k->nb + b];
                acc = fmaf(sc, (float)isum, acc);
            }
            k->y[t * R + r] = k->bias ? acc + k->bias[r] : acc;
        }
    }
}

/* Whether w's linears may run under the int8-activation contract (else: the exact kernels). */
static int q8_ok(const qmat *w) {
    return (w->dtype == DT_INT8 || w->dtype == DT_INT4) && w->g > 0 && w->g % MT_Q8B == 0;
}

/* x [T, C] quantized for weights of one dtype: the buffers a q8ctx points into. */
typedef struct {
    int8_t *xq;
    float *xs, *xsT;
    int32_t *xsum, *corrT;
    int64_t T, nb, xstride, Tp;
} q8acts;

static void q8_free(q8acts *a) {
    free(a->xq);
    free(a->xs);
    free(a->xsT);
    free(a->xsum);
    free(a->corrT);
    memset(a, 0, sizeof(*a));
}

/* The contract's quantization of x's blocks of 64 (mt.h), in the layouts of q8ctx. 0 or -1. */
static int q8_quantize(const float *x, int64_t T, int64_t C, int dtype, q8acts *a) {
    const int64_t nb = (C + MT_Q8B - 1) / MT_Q8B, nbp = dtype == DT_INT4 ? (nb + 1) / 2 * 2 : nb;
    const int64_t Tp = (T + 3 + 15) / 16 * 16, xstride = nbp * MT_Q8B; /* a tile of 4 tokens may pass T by 3 */
    const int32_t off = dtype == DT_INT4 ? 8 : 128;
    *a = (q8acts){mt_xalloc((size_t)(T * xstride)), mt_xalloc((size_t)(T * nb) * 4), mt_xalloc((size_t)(nb * Tp) * 4),
                  mt_xalloc((size_t)(T * nb) * 4), mt_xalloc((size_t)(nb * Tp) * 4), T, nb, xstride, Tp};
    if (!a->xq || !a->xs || !a->xsT || !a->xsum || !a->corrT) {
        q8_free(a);
        return -1;
    }
    memset(a->xq, 0, (size_t)(T * xstride));
    memset(a->xsT, 0, (size_t)(nb * Tp) * 4);
    memset(a->corrT, 0, (size_t)(nb * Tp) * 4);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + t * C + MT_Q8B * b;
            const int64_t n = C - MT_Q8B * b < MT_Q8B ? C - MT_Q8B * b : MT_Q8B;
            float amax = 0.0f;
            for (int64_t j = 0; j < n; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
            const float sc = amax / 127.0f;
            int32_t sum = 0;
            for (int64_t j = 0; j < n; j++) {
                const int32_t q = sc > 0.0f ? (int32_t)rintf(xb[j] / sc) : 0;
                a->xq[t * xstride + mt_q8_pos(dtype, MT_Q8B * b + j)] = (int8_t)q;
                sum += q;
            }
            a->xs[t * nb + b] = a->xsT[b * Tp + t] = sc;
            a->xsum[t * nb + b] = sum;
            a->corrT[b * Tp + t] = off * sum;
        }
    return 0;
}

static q8ctx q8_ctx(const q8acts *a, const qmat *w, const float *bias, float *y) {
    return (q8ctx){a->xq, a->xs, a->xsum, a->xsT, a->corrT, a->T, a->nb, a->xstride, a->Tp, w, bias, y};
}

/* Several linears of one input in one job (an attention layer's q, k and v): y[i][t, r] =
 * dot(x[t], w[i][r], C) (+ bias[i][r]), the bits of mt_linear (or mt_linear_q8) on each. Every
 * w[i] has C columns; n <= LINEAR_MAX_K. x [T, C]. Returns 0 or -1 (no memory). */
int mt_linears(const mt_isa *isa, int nthreads, const float *x, int64_t T, int n, const qmat *w,
               const float *const *bias, float *const *y, int q8) {
    if (n < 1 || n > LINEAR_MAX_K) return -1;
    int any_q8 = 0;
    for (int i = 0; i < n; i++) any_q8 |= q8 && q8_ok(&w[i]);
    if (!any_q8 && isa->linear_many && T >= isa->many_min) { /* the outer-product path: one by one */
        for (int i = 0; i < n; i++)
            if (mt_linear(isa, nthreads, x, T, &w[i], bias[i], y[i]) != 0) return -1;
        return 0;
    }
    linear_ctx k[LINEAR_MAX_K];
    q8ctx qk[LINEAR_MAX_K];
    q8acts qa[LINEAR_MAX_K];
    float *xp = NULL;
    int rc = 0;
    memset(qa, 0, sizeof(qa));
    for (int i = 0; i < n && rc == 0; i++) {
        const int q = q8 && q8_ok(&w[i]);
        const int xw = !q && xp_wanted(isa, &w[i]);
        if (xw && !xp && !(xp = xp_fill(isa, x, T, w[i].cols, 3))) rc = -1; /* the same columns: one order */
        int from = -1; /* an earlier linear's quantization of x for this dtype */
        for (int j = 0; j < i && q; j++)
            if (qa[j].xq && w[j].dtype == w[i].dtype) from = j;
        if (rc == 0 && q && from < 0 && q8_quantize(x, T, w[i].cols, w[i].dtype, &qa[i]) != 0) rc = -1;
        k[i] = (linear_ctx){isa, x, T, mt_rowbuf_len(&w[i]), &w[i], bias[i], y[i], 0, xw ? xp : NULL, NULL};
        if (rc == 0 && q) {
            qk[i] = q8_ctx(&qa[from < 0 ? i : from], &w[i], bias[i], y[i]);
            k[i].q8 = &qk[i];
        }
    }
    if (rc == 0) rc = linears_run(nthreads, k, n);
    for (int i = 0; i < n; i++) q8_free(&qa[i]);
    return rc;
}

/* One linear under the int8-activation contract (weights outside it: exact, as mt_linear). */
int mt_linear_q8(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *w, const float *bias,
                 float *y) {
    return mt_linears(isa, nthreads, x, T, 1, w, &bias, &y, 1);
}

/* SwiGLU expert: y = down(silu(gate x) * up x). x [T, D], y [T, D]. */
int mt_ffn(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *gate, const qmat *up,
           const qmat *down, float *y) {
    const int64_t I = gate->rows;
    float *hg = mt_xalloc((size_t)(T * I) * 4), *hu = mt_xalloc((size_t)(T * I) * 4);
    int rc = -1;
    if (hg && hu) rc = linear_job_run(isa, nthreads, x, T, gate, NULL, hg, up, hu);
    if (rc == 0) {
        isa->swiglu(hg, hu, T * I); /* silu(g) * u as the reference writes it */
        rc = mt_linear(isa, nthreads, hg, T, down, NULL, y);
    }
    free(hg);
    free(hu);
    return rc;
}

/* Up to LINEAR_MAX_K / 2 experts of few tokens each: every gate and up in one job, then every
 * down in one job -- two waits for the pool instead of two per expert, and the threads share
 * all the experts' rows (a layer's experts at decode are a few MB in all). q8: the linears
 * inside the int8-activation contract run under it, an expert's gate and up on one
 * quantization of x. */
static int ffn_group(const mt_isa *isa, int nthreads, int n, const mt_expert *ex, int q8) {
    linear_ctx k[LINEAR_MAX_K];
    q8ctx qk[LINEAR_MAX_K];
    q8acts qa[LINEAR_MAX_K / 2][3]; /* x for the gate, x for an up of another dtype, h for the down */
    float *h[LINEAR_MAX_K / 2][3];  /* hg, hu, xp of hg */
    float *xp[LINEAR_MAX_K / 2];
    int rc = 0;
    memset(h, 0, sizeof(h));
    memset(xp, 0, sizeof(xp));
    memset(qa, 0, sizeof(qa));
    for (int e = 0; e < n && rc == 0; e++) {
        const mt_expert *x = &ex[e];
        const int64_t TI = x->T * x->gate->rows;
        const int gq = q8 && q8_ok(x->gate), uq = q8 && q8_ok(x->up);
        const int ushare = gq && uq && x->up->dtype == x->gate->dtype;
        h[e][0] = mt_xalloc((size_t)TI * 4);
        h[e][1] = mt_xalloc((size_t)TI * 4);
        if (!h[e][0] || !h[e][1]) rc = -1;
        if (rc == 0 && gq && q8_quantize(x->x, x->T, x->gate->cols, x->gate->dtype, &qa[e][0]) != 0) rc = -1;
        if (rc == 0 && uq && !ushare && q8_quantize(x->x, x->T, x->up->cols, x->up->dtype, &qa[e][1]) != 0) rc = -1;
        const int gxp = !gq && xp_wanted(isa, x->gate), uxp = !uq && xp_wanted(isa, x->up);
        if (rc == 0 && (gxp || uxp)) { /* gate and up have the same columns, so the same order */
            if (!(xp[e] = mt_xalloc((size_t)(x->T * x->gate->cols) * 4))) rc = -1;
            else xp_order_into(isa, x->x, x->T, x->gate->cols, xp[e]);
        }
        if (rc == 0 && !(q8 && q8_ok(x->down)) && xp_wanted(isa, x->down) && !(h[e][2] = mt_xalloc((size_t)TI * 4)))
            rc = -1;
        k[2 * e] = (linear_ctx){isa, x->x, x->T, mt_rowbuf_len(x->gate), x->gate, NULL, h[e][0], 0, gxp ? xp[e] : NULL,
                                NULL};
        k[2 * e + 1] = (linear_ctx){isa, x->x, x->T, mt_rowbuf_len(x->up), x->up, NULL, h[e][1], 0, uxp ? xp[e] : NULL,
                                    NULL};
        if (rc == 0 && gq) {
            qk[2 * e] = q8_ctx(&qa[e][0], x->gate, NULL, h[e][0]);
            k[2 * e].q8 = &qk[2 * e];
        }
        if (rc == 0 && uq) {
            qk[2 * e + 1] = q8_ctx(&qa[e][ushare ? 0 : 1], x->up, NULL, h[e][1]);
            k[2 * e + 1].q8 = &qk[2 * e + 1];
        }
    }
    if (rc == 0) rc = linears_run(nthreads, k, 2 * n);
    for (int e = 0; e < n && rc == 0; e++) {
        const mt_expert *x = &ex[e];
        const int dq = q8 && q8_ok(x->down);
        isa->swiglu(h[e][0], h[e][1], x->T * x->gate->rows);
        if (dq && q8_quantize(h[e][0], x->T, x->down->cols, x->down->dtype, &qa[e][2]) != 0) rc = -1;
        if (h[e][2]) xp_order_into(isa, h[e][0], x->T, x->down->cols, h[e][2]);
        k[e] = (linear_ctx){isa, h[e][0], x->T, mt_rowbuf_len(x->down), x->down, NULL, x->y, 0, h[e][2], NULL};
        if (rc == 0 && dq) {
            qk[e] = q8_ctx(&qa[e][2], x->down, NULL, x->y);
            k[e].q8 = &qk[e];
        }
    }
    if (rc == 0) rc = linears_run(nthreads, k, n);
    for (int e = 0; e < n; e++) {
        free(h[e][0]);
        free(h[e][1]);
        free(h[e][2]);
        free(xp[e]);
        for (int i = 0; i < 3; i++) q8_free(&qa[e][i]);
    }
    return rc;
}

int mt_ffn_many(const mt_isa *isa, int nthreads, int64_t n, const mt_expert *ex, int q8) {
    mt_expert group[LINEAR_MAX_K / 2];
    int ng = 0;
    for (int64_t e = 0; e < n; e++) {
        const mt_expert *x = &ex[e];
        if (x->T <= 0) continue;
        if (!q8 && isa->linear_many && x->T >= isa->many_min) { /* a big batch: its own outer-product jobs */
            if (mt_ffn(isa, nthreads, x->x, x->T, x->gate, x->up, x->down, x->y) != 0) return -1;
            continue;
        }
        group[ng++] = *x;
        if (ng == LINEAR_MAX_K / 2) {
            if (ffn_group(isa, nthreads, ng, group, q8) != 0) return -1;
            ng = 0;
        }
    }
    return ng ? ffn_group(isa, nthreads, ng, group, q8) : 0;
}

int mt_ffn_q8(const mt_isa *isa, int nthreads, const float *x, int64_t T, const qmat *gate, const qmat *up,
              const qmat *down, float *y) {
    const mt_expert e = {x, T, gate, up, down, y};
    return mt_ffn_many(isa, nthreads, 1, &e, 1);
}

void mt_combine(const float *ys, const float *w, int64_t T, int64_t K, int64_t D, float *out) {
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const float wj = w[t * K + j];
            const float *y = ys + (t * K + j) * D;
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + wj * y[d];
        }
    }
}

void mt_rope(const float *x, const float *cos, const float *sin, int64_t T, int64_t H, int64_t d, int64_t P,
             int interleave, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * P, *s = sin + t * P;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + (t * H + h) * d;
            float *o = out + (t * H + h) * d;
            for (int64_t i = 2 * P; i < d; i++) o[i] = xr[i];
            if (interleave) {
                for (int64_t p = 0; p < P; p++) {
                    const float a = xr[2 * p], b = xr[2 * p + 1];
                    o[2 * p] = a * c[p] - b * s[p];
                    o[2 * p + 1] = b * c[p] + a * s[p];
                }
            } else {
                for (int64_t p = 0; p < P; p++) {
                    const float a = xr[p], b = xr[P + p];
                    o[p] = a * c[p] - b * s[p];
                    o[P + p] = b * c[p] + a * s[p];
                }
            }
        }
    }
}

void mt_glu_clamped(float *g, const float *u, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float gv = g[i] > limit ? limit : g[i]; /* min(g, limit), NaN kept */
        const float uv = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        const float sg = 1.0f / (1.0f + mt_exp(0.0f - gv * alpha));
        g[i] = (uv + 1.0f) * (gv * sg);
    }
}

/* ---------------------------------------------------------------- norms, softmax */

void mt_rmsnorm(const mt_isa *isa, const float *x, int64_t T, int64_t C, const float *wt, float eps, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * C;
        float res[TBMAX][RB];
        const float *xs[TBMAX] = {xr, xr, xr, xr};
        const float *ws[RB] = {xr, xr, xr, xr};
        isa->tile(1, xs, ws, C, res); /* sum of squares = dot(x, x, C) */
        const float var = res[0][0] / (float)C;
        const float den = sqrtf(var + eps);
        for (int64_t c = 0; c < C; c++) y[t * C + c] = xr[c] / den * wt[c];
    }
}

void mt_softmax_row(const mt_isa *isa, const float *x, int64_t n, float *y) {
    const float m = isa->max(x, n); /* exact in any order (a sign of 0 cannot change x - m's exp) */
    isa->exp_shift(x, m, n, y);
    isa->divide(y, isa->sum(y, n), n);
}

/* ---------------------------------------------------------------- attention */

/* A softmax row with a learned sink logit in the denominator (mt.h: one add after the sum). */
static void softmax_row_sink(const mt_isa *isa, const float *x, int64_t n, float sink, float *y) {
    const float mx = isa->max(x, n), m = mx > sink ? mx : sink;
    isa->exp_shift(x, m, n, y);
    isa->divide(y, isa->sum(y, n) + mt_exp(sink - m), n);
}

/* The first key row t sees: 0, or q_pos - W + 1 under a sliding window W. */
static inline int64_t first_key(int64_t qpos, int64_t window) {
    return window > 0 && qpos - window + 1 > 0 ? qpos - window + 1 : 0;
}

typedef struct {
    const mt_isa *isa;
    const float *q, *k, *v;
    const int64_t *qpos;
    int64_t H, S, Hkv, dq, dv, rep, hgroup, ngroups;
    float scale;
    float *out;
    atomic_int failed;
    int64_t T, tbk; /* tokens, tokens per block (the many-row path) */
    const float *sinks; /* [H] or NULL */
    int64_t window;     /* 0: causal over every earlier key */
} attn_ctx;

#define ATT_BLOCK_QUERIES 32 /* query vectors per block of the many-row path */

/* keys per block of the P.V pass: the block of V (32 keys x dv floats) stays in L1 while
 * every group of heads and every slice of dv passes over it (at 128 keys and MLA's dv of
 * 128-512 it spilled to L2 and P.V ran at a third of the fma rate) */
#define ATT_SB 32

/* One work item = (t, kv head, group of query heads of that kv head). Each key block is
 * loaded once and used by every head of the group (the MLA decode case: up to 128 heads
 * on one latent). How heads are grouped never changes a head's operations. */
static void attention_item(void *ctx, int64_t it) {
    attn_ctx *a = ctx;
    const mt_isa *isa = a->isa;
    const int64_t H = a->H, S = a->S, Hkv = a->Hkv, dq = a->dq, dv = a->dv, rep = a->rep;
    const int64_t t = it / (Hkv * a->ngroups), kvh = (it / a->ngroups) % Hkv, hg = it % a->ngroups;
    const int64_t h0 = kvh * rep + hg * a->hgroup;
    const int64_t nh = rep - hg * a->hgroup < a->hgroup ? rep - hg * a->hgroup : a->hgroup;
    const int64_t n = a->qpos[t] + 1, lo = first_key(a->qpos[t], a->window); /* keys lo..q_pos[t] */
    const int64_t stride = S + 16;
    float *sc = mt_scratch(5, (size_t)(nh * stride));
    if (!sc) {
        atomic_store(&a->failed, 1);
        return;
    }
    /* scores: (4 heads) x (4 keys) tiles of the dot contract, key block outermost */
    for (int64_t s0 = lo; s0 < n; s0 += RB) {
        const int ns = (int)(n - s0 < RB ? n - s0 : RB);
        const float *kr[RB];
        for (int i = 0; i < RB; i++) kr[i] = a->k + ((s0 + (i < ns ? i : 0)) * Hkv + kvh) * dq;
        for (int64_t hb = 0; hb < nh; hb += 4) {
            const int nb = (int)(nh - hb < 4 ? nh - hb : 4);
            const float *qr[TBMAX];
            for (int j = 0; j < TBMAX; j++) qr[j] = a->q + (t * H + h0 + hb + (j < nb ? j : 0)) * dq;
            float res[TBMAX][RB];
            isa->tile(nb, qr, kr, dq, res);
            for (int j = 0; j < nb; j++)
                for (int i = 0; i < ns; i++) sc[(hb + j) * stride + s0 + i] = res[j][i] * a->scale;
        }
    }
    for (int64_t h = 0; h < nh; h++) {
        float *row = sc + h * stride + lo;
        if (a->sinks) softmax_row_sink(isa, row, n - lo, a->sinks[h0 + h], row);
        else mt_softmax_row(isa, row, n - lo, row);
    }
    /* out = sum_s p[s] v[s], s increasing, in key blocks that every head block revisits */
    for (int64_t h = 0; h < nh; h++) memset(a->out + (t * H + h0 + h) * dv, 0, (size_t)dv * 4);
    for (int64_t s0 = lo; s0 < n; s0 += ATT_SB) {
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
            isa->pv(nb, p, a->v + kvh * dv, Hkv * dv, s0, s1, dv, o);
        }
    }
}

/* Many query rows (prefill): one work item = (a block of tbk tokens, kv head). Its query
 * vectors (tbk tokens x the kv head's query heads) meet the keys in one linear call --
 * scores[i][s] = dot(q_i, k_s, dq), the same dot as the one-token path, on the kernels
 * that make many rows fast -- then each row's softmax over its own visible keys, then
 * P.V in key blocks that every query vector of the block passes over while the block of V
 * stays in L1. Each query vector sees exactly the operations of the one-token path. */
static void attention_block(void *ctx, int64_t it) {
    attn_ctx *a = ctx;
    const mt_isa *isa = a->isa;
    const int64_t H = a->H, Hkv = a->Hkv, dq = a->dq, dv = a->dv, rep = a->rep;
    const int64_t tb0 = (it / Hkv) * a->tbk, kvh = it % Hkv;
    const int64_t nt = a->T - tb0 < a->tbk ? a->T - tb0 : a->tbk, nq = nt * rep;
    int64_t nmax = 0;
    for (int64_t j = 0; j < nt; j++) nmax = a->qpos[tb0 + j] + 1 > nmax ? a->qpos[tb0 + j] + 1 : nmax;
    float *qb = mt_scratch(6, (size_t)(nq * dq)), *sc = mt_scratch(7, (size_t)(nq * nmax + 16));
    if (!qb || !sc) {
        atomic_store(&a->failed, 1);
        return;
    }
    for (int64_t j = 0; j < nt; j++) /* row j * rep + r: token tb0 + j, head kvh * rep + r */
        memcpy(qb + j * rep * dq, a->q + ((tb0 + j) * H + kvh * rep) * dq, (size_t)(rep * dq) * 4);
    qmat K;
    memset(&K, 0, sizeof(K));
    K.dtype = DT_F32;
    K.data = (const uint8_t *)(a->k + kvh * dq);
    K.row_bytes = Hkv * dq * 4;
    K.rows = nmax;
    K.cols = dq;
    if (mt_linear(isa, 1, qb, nq, &K, NULL, sc) != 0) {
        atomic_store(&a->failed, 1);
        return;
    }
    for (int64_t i = 0; i < nq; i++) {
        const int64_t qp = a->qpos[tb0 + i / rep], n = qp + 1, lo = first_key(qp, a->window);
        float *row = sc + i * nmax;
        for (int64_t s = lo; s < n; s++) row[s] = row[s] * a->scale;
        if (a->sinks) softmax_row_sink(isa, row + lo, n - lo, a->sinks[kvh * rep + i % rep], row + lo);
        else mt_softmax_row(isa, row + lo, n - lo, row + lo);
    }
    for (int64_t j = 0; j < nt; j++) memset(a->out + ((tb0 + j) * H + kvh * rep) * dv, 0, (size_t)(rep * dv) * 4);
    for (int64_t s0 = 0; s0 < nmax; s0 += ATT_SB)
        for (int64_t j = 0; j < nt; j++) {
            const int64_t n = a->qpos[tb0 + j] + 1, lo = first_key(a->qpos[tb0 + j], a->window);
            if (n <= s0 || lo >= s0 + ATT_SB) continue;
            const int64_t s1 = s0 + ATT_SB < n ? s0 + ATT_SB : n;
            for (int64_t hb = 0; hb < rep; hb += 4) {
                const int nb = (int)(rep - hb < 4 ? rep - hb : 4);
                const float *p[4];
                float *o[4];
                for (int i = 0; i < 4; i++) {
                    const int64_t h = hb + (i < nb ? i : 0);
                    p[i] = sc + (j * rep + h) * nmax;
                    o[i] = a->out + ((tb0 + j) * H + kvh * rep + h) * dv;
                }
                isa->pv(nb, p, a->v + kvh * dv, Hkv * dv, s0 > lo ? s0 : lo, s1, dv, o);
            }
        }
}

/* Causal attention of T query rows of one sequence; the work items are independent. */
int mt_attention(const mt_isa *isa, int nthreads, const float *q, const float *k, const float *v,
                 const int64_t *qpos, int64_t T, int64_t H, int64_t S, int64_t Hkv, int64_t dq, int64_t dv,
                 float scale, const float *sinks, int64_t window, float *out) {
    const int64_t rep = H / Hkv;
    if (T > 1) {
        /* blocks of at least ATT_BLOCK_QUERIES query vectors, as many blocks as threads */
        int64_t tbk = (ATT_BLOCK_QUERIES + rep - 1) / rep;
        if (tbk > T) tbk = T;
        while (tbk > 1 && ((T + tbk - 1) / tbk) * Hkv < nthreads) tbk = (tbk + 1) / 2;
        attn_ctx a = {isa, q, k, v, qpos, H, S, Hkv, dq, dv, rep, 0, 0, scale, out, 0, T, tbk, sinks, window};
        mt_pool_run(nthreads, ((T + tbk - 1) / tbk) * Hkv, attention_block, &a);
        return atomic_load(&a.failed) ? -1 : 0;
    }
    /* split a kv head's query heads only as far as needed to give every thread work */
    int64_t splits = 1;
    while (T * Hkv * splits < nthreads && splits < (rep + 3) / 4) splits++;
    int64_t hgroup = (rep + splits - 1) / splits;
    hgroup = (hgroup + 3) / 4 * 4;
    const int64_t ngroups = (rep + hgroup - 1) / hgroup;
    attn_ctx a = {isa, q, k, v, qpos, H, S, Hkv, dq, dv, rep, hgroup, ngroups, scale, out, 0, T, 1, sinks, window};
    mt_pool_run(nthreads, T * Hkv * ngroups, attention_item, &a);
    return atomic_load(&a.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------- probes */

#define PROBE_CHUNKS_PER_THREAD 8 /* small chunks: a thread that starts late takes fewer */

typedef struct {
    const mt_isa *isa;
    int64_t rounds;
    const uint8_t *p;
    int64_t bytes, nchunks;
    _Atomic uint64_t sum; /* read: checksum; fma: flops */
} probe_ctx;

static void fma_chunk(void *ctx, int64_t c) {
    probe_ctx *k = ctx;
    atomic_fetch_add(&k->sum, (uint64_t)k->isa->fma_probe(k->rounds, 1.0f + (float)c));
}

static void read_chunk(void *ctx, int64_t c) {
    probe_ctx *k = ctx;
    const int64_t per = (k->bytes / k->nchunks) & ~(int64_t)127;
    const int64_t off = c * per, n = c == k->nchunks - 1 ? k->bytes - off : per;
    atomic_fetch_add(&k->sum, k->isa->read_probe(k->p + off, n));
}

double mt_fma_probe(const mt_isa *isa, int nthreads, int64_t rounds) {
    const int64_t nchunks = (int64_t)nthreads * PROBE_CHUNKS_PER_THREAD;
    probe_ctx k = {isa, rounds, NULL, 0, nchunks, 0};
    mt_pool_run(nthreads, nchunks, fma_chunk, &k);
    return (double)atomic_load(&k.sum);
}

uint64_t mt_read_probe(const mt_isa *isa, int nthreads, const uint8_t *p, int64_t bytes) {
    const int64_t nchunks = (int64_t)nthreads * PROBE_CHUNKS_PER_THREAD;
    probe_ctx k = {isa, 0, p, bytes, nchunks, 0};
    mt_pool_run(nthreads, nchunks, read_chunk, &k);
    return atomic_load(&k.sum);
}

/* ---------------------------------------------------------------- a GQA attention layer */
int mt_gqa_block(const mt_isa *isa, int nthreads, const mt_gqa *a) {
    const int64_t T = a->T, D = a->D, nq = a->H * a->hd, nk = a->Hkv * a->hd, row = a->S - a->T;
    float *h = mt_xalloc((size_t)(T * D) * 4), *q = mt_xalloc((size_t)(T * nq) * 4);
    float *k = mt_xalloc((size_t)(T * nk) * 4), *v = mt_xalloc((size_t)(T * nk) * 4);
    float *qn = mt_xalloc((size_t)(T * nq) * 4), *kn = mt_xalloc((size_t)(T * nk) * 4);
    float *qr = mt_xalloc((size_t)(T * nq) * 4), *att = mt_xalloc((size_t)(T * nq) * 4);
    float *o = mt_xalloc((size_t)(T * D) * 4);
    int rc = -1;
    if (!h || !q || !k || !v || !qn || !kn || !qr || !att || !o) goto done;
    mt_rmsnorm(isa, a->x, T, D, a->norm, a->eps, h);
    {
        const qmat w[3] = {*a->wq, *a->wk, *a->wv};
        const float *const bias[3] = {a->bq, a->bk, a->bv};
        float *const y[3] = {q, k, v};
        if (mt_linears(isa, nthreads, h, T, 3, w, bias, y, a->q8) < 0) goto done;
    }
    float *qs = q, *ks = k; /* after the q/k norms */
    if (a->qk_mode == 1) {        /* over the whole projection: rows of H * hd */
        mt_rmsnorm(isa, q, T, nq, a->qn, a->eps, qn);
        mt_rmsnorm(isa, k, T, nk, a->kn, a->eps, kn);
        qs = qn, ks = kn;
    } else if (a->qk_mode == 2) { /* per head: rows of hd */
        mt_rmsnorm(isa, q, T * a->H, a->hd, a->qn, a->eps, qn);
        mt_rmsnorm(isa, k, T * a->Hkv, a->hd, a->kn, a->eps, kn);
        qs = qn, ks = kn;
    }
    if (a->clip) { /* np.clip(v, -c, c) elementwise: maximum, then minimum; a NaN stays NaN */
        float *const bufs[3] = {qs, ks, v};
        const int64_t lens[3] = {T * nq, T * nk, T * nk};
        const float c = a->clip_to;
        for (int b = 0; b < 3; b++)
            for (int64_t i = 0; i < lens[b]; i++) {
                const float e = bufs[b][i];
                bufs[b][i] = e < -c ? -c : e > c ? c : e;
            }
    }
    mt_rope(qs, a->cos, a->sin, T, a->H, a->hd, a->P, a->interleave, qr);
    mt_rope(ks, a->cos, a->sin, T, a->Hkv, a->hd, a->P, a->interleave, a->kc + row * nk);
    memcpy(a->vc + row * nk, v, (size_t)(T * nk) * 4);
    if (mt_attention(isa, nthreads, qr, a->kc, a->vc, a->qpos, T, a->H, a->S, a->Hkv, a->hd, a->hd, a->scale,
                     a->sinks, a->window, att) < 0)
        goto done;
    if ((a->q8 ? mt_linear_q8(isa, nthreads, att, T, a->wo, a->bo, o)
               : mt_linear(isa, nthreads, att, T, a->wo, a->bo, o)) < 0)
        goto done;
    for (int64_t i = 0; i < T * D; i++) a->out[i] = a->x[i] + o[i];
    rc = 0;
done:
    free(h);
    free(q);
    free(k);
    free(v);
    free(qn);
    free(kn);
    free(qr);
    free(att);
    free(o);
    return rc;
}

/* ---------------------------------------------------------------- the softmax router's choice */
/* a ranks before b (values va, vb at indices ia < ib or not): np.argsort(-v, kind="stable") */
static inline int ranks_before(float va, int64_t ia, float vb, int64_t ib) {
    const int na = va != va, nb = vb != vb;
    if (na || nb) return !na || (nb && ia < ib); /* NaNs last, among them by index */
    return va > vb || (va == vb && ia < ib);
}

int mt_route_softmax(const mt_isa *isa, int nthreads, const float *h, int64_t T, const qmat *w, const float *bias,
                     int64_t K, int q8, int32_t *ids, float *chosen) {
    const int64_t E = w->rows;
    float *logits = mt_xalloc((size_t)(T * E) * 4), *scores = mt_xalloc((size_t)(T * E) * 4);
    unsigned char *taken = malloc((size_t)E);
    int rc = -1;
    if (!logits || !scores || !taken) goto done;
    if ((q8 ? mt_linear_q8(isa, nthreads, h, T, w, bias, logits) : mt_linear(isa, nthreads, h, T, w, bias, logits)) < 0)
        goto done;
    for (int64_t t = 0; t < T; t++) {
        const float *s = scores + t * E;
        mt_softmax_row(isa, logits + t * E, E, scores + t * E);
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || ranks_before(s[e], e, s[best], best))) best = e;
            taken[best] = 1;
            ids[t * K + j] = (int32_t)best;
            chosen[t * K + j] = s[best];
        }
    }
    rc = 0;
done:
    free(logits);
    free(scores);
    free(taken);
    return rc;
}

int mt_experts_run(const mt_isa *isa, int nthreads, const float *x, int64_t T, int64_t D, const int64_t *ids,
                   int64_t K, int64_t n, const int64_t *eid, const qmat *w, int q8, float *y, const float *cw,
                   float *combined) {
    mt_expert *ex = calloc((size_t)(n + 1), sizeof(mt_expert));
    int64_t *pos = malloc((size_t)(T * K + 1) * sizeof(int64_t));
    float *xs = NULL, *ys = NULL;
    int rc = -1;
    if (!ex || !pos) goto done;
    /* each expert's slots, in (t, k) order */
    int64_t nrows = 0;
    for (int64_t e = 0; e < n; e++) {
        ex[e].T = 0;
        for (int64_t s = 0; s < T * K; s++)
            if (ids[s] == eid[e]) pos[nrows + ex[e].T++] = s;
        nrows += ex[e].T;
    }
    xs = malloc((size_t)(nrows * D + 1) * 4);
    ys = malloc((size_t)(nrows * D + 1) * 4);
    if (!xs || !ys) goto done;
    int64_t r = 0;
    for (int64_t e = 0; e < n; e++) {
        ex[e].x = xs + r * D;
        ex[e].y = ys + r * D;
        ex[e].gate = &w[3 * e];
        ex[e].up = &w[3 * e + 1];
        ex[e].down = &w[3 * e + 2];
        for (int64_t i = 0; i < ex[e].T; i++) memcpy(xs + (r + i) * D, x + (pos[r + i] / K) * D, (size_t)D * 4);
        r += ex[e].T;
    }
    rc = mt_ffn_many(isa, nthreads, n, ex, q8);
    if (rc == 0)
        for (int64_t i = 0; i < nrows; i++) memcpy(y + pos[i] * D, ys + i * D, (size_t)D * 4);
    if (rc == 0 && combined) mt_combine(y, cw, T, K, D, combined); /* combine_slots, in k order */
done:
    free(ex);
    free(pos);
    free(xs);
    free(ys);
    return rc;
}

float mt_np_sum(const float *a, int64_t n) {
    if (n < 8) {
        float r = -0.0f;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        float r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return mt_np_sum(a, n2) + mt_np_sum(a + n2, n - n2);
}

int mt_moe_block(const mt_isa *isa, int nthreads, const mt_moe *a) {
    const int64_t T = a->T, D = a->D, K = a->K;
    float *h = mt_xalloc((size_t)(T * D) * 4), *slots = mt_xalloc((size_t)(T * K * D) * 4);
    float *mixed = mt_xalloc((size_t)(T * D) * 4);
    int64_t *ids = malloc((size_t)(T * K) * sizeof(int64_t)), *eid = malloc((size_t)(T * K) * sizeof(int64_t));
    qmat *w = malloc((size_t)(3 * T * K) * sizeof(qmat));
    int rc = -1;
    if (!h || !slots || !mixed || !ids || !eid || !w) goto done;
    mt_rmsnorm(isa, a->x, T, D, a->norm, a->eps, h);
    if (mt_route_softmax(isa, nthreads, h, T, a->router, a->bias, K, a->q8, a->ids, a->weights) < 0) goto done;
    for (int64_t t = 0; t < T; t++) { /* routing_weights: / (sum + 1e-20) where renorm, then * scale */
        float *wt = a->weights + t * K;
        if (a->renorm) {
            const float s = mt_np_sum(wt, K) + 1e-20f;
            for (int64_t j = 0; j < K; j++) wt[j] = wt[j] / s;
        }
        for (int64_t j = 0; j < K; j++) wt[j] = wt[j] * a->scale;
    }
    /* the union of the routed experts, in increasing order (moe_plain's), each with its weights */
    int64_t n = 0;
    for (int64_t s = 0; s < T * K; s++) {
        const int64_t e = a->ids[s];
        ids[s] = e;
        if (e < 0 || e >= a->E || !a->have[e]) {
            rc = -2;
            goto done;
        }
        int64_t i = n;
        while (i > 0 && eid[i - 1] > e) i--;
        if (i > 0 && eid[i - 1] == e) continue;
        memmove(eid + i + 1, eid + i, (size_t)(n - i) * sizeof(int64_t));
        eid[i] = e;
        n++;
    }
    for (int64_t i = 0; i < n; i++) memcpy(&w[3 * i], &a->w[3 * eid[i]], 3 * sizeof(qmat));
    /* every slot's expert is in the union: mt_experts_run writes all of them (no zeroing needed) */
    if (mt_experts_run(isa, nthreads, h, T, D, ids, K, n, eid, w, a->q8, slots, a->weights, mixed) < 0) goto done;
    for (int64_t i = 0; i < T * D; i++) a->out[i] = a->x[i] + mixed[i];
    rc = 0;
done:
    free(h);
    free(slots);
    free(mixed);
    free(ids);
    free(eid);
    free(w);
    return rc;
}
