/* The work pool shared by every kernel (see the protocol below). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "mt.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---------------------------------------------------------------- work pool
 * A call splits its output into independent chunks (row blocks, attention items). The
 * chunks are cut into one contiguous RANGE per thread of the call: the caller works through
 * range 0 from its front, helper h through range h, so that each thread streams through
 * consecutive rows (the hardware prefetchers and the kernels' own prefetch see one stream per
 * thread; chunks dealt out alternately from one counter broke every thread's stream at every
 * chunk. Measured, alternating builds, 2 threads, Zen 4: a 2048 x 2048 int4 linear at batch 1,
 * 120-127 -> 96-100 us; an OLMoE decode step in-process, 41.6-43.8 -> 34.1-35.2 ms). A thread
 * whose range is empty takes chunks from the BACK of the others' ranges, so a helper that is
 * descheduled, or never started, costs the call a chunk, not its range: the caller never waits
 * for a helper to START, only for chunks a helper has already claimed to finish (a fork-join
 * team would wait for it at both ends of every call). Which thread computes a chunk never
 * changes its bits: chunks share nothing.
 *
 * Protocol. One thread at a time OWNS the pool (pool.owner, taken with a try-lock); a
 * caller that finds it owned, from another Python thread, computes its whole job itself
 * (the same bits). The owner runs one job at a time:
 *   1. it writes the job (fn, ctx, nchunks) into pool.job and sets pool.done = 0 and
 *      pool.left = nchunks;
 *   2. it publishes the job by storing each range word (lo, hi) of the job's ranges
 *      (release), then pool.go = 1 for the waiting helpers (seq_cst);
 *   3. it, and any helper, claims a chunk by a compare-exchange of a range word (acquire):
 *      (lo, hi) -> (lo + 1, hi) claims chunk lo (the front), (lo, hi) -> (lo, hi - 1) claims
 *      chunk hi - 1 (the back), only while lo < hi;
 *   4. a claimer reads pool.job only after its claim succeeded, subtracts 1 from pool.left,
 *      runs the chunk, and then adds 1 to pool.done (release), after which it touches
 *      nothing of the job;
 *   5. the owner returns only once pool.done == nchunks (acquire), after storing go = 0.
 * Invariants (each follows from the steps above):
 *   I1. Between jobs every range word is empty (lo == hi): the owner writes the job (step 1)
 *       and the range words (step 2) only when every chunk of the previous job has been
 *       claimed AND finished (done == n), and ranges the job does not use stay empty.
 *   I2. A successful claim is a chunk of the published job, claimed once. During a job the
 *       range words only shrink, so each chunk index of a range leaves it exactly once. A
 *       compare-exchange succeeds only against the current value, so a helper whose load
 *       is stale (an earlier job's (lo, hi), read before it was preempted) either fails
 *       and rereads, or -- if the current job's range happens to hold that same value --
 *       claims that chunk of the current job, which is free: the value carries no job
 *       identity that could go stale.
 *   I3. Its acquire synchronises with the owner's release of that range word in step 2
 *       (the claims in between are read-modify-writes, which continue that release
 *       sequence), so the claimer sees the job written in step 1.
 *   I4. pool.done counts finished claims of the published job only: it is reset before
 *       the job is published and only claim holders add to it (I2), so when the owner
 *       sees done == nchunks every chunk has run to completion and no thread holds a
 *       claim. The release/acquire pair makes each chunk's writes (the output, ctx->failed)
 *       and each claimer's update of pool.left visible to the owner before it returns.
 *   I5. So a job's ctx (on the owner's stack) is read only by claim holders, and the
 *       owner's frame outlives every claim: no helper ever reads a popped frame.
 * pool.nranges (how many range words the job uses) and pool.left (chunks not yet claimed)
 * are hints read without ordering: a stale one makes a helper look at too few ranges (the
 * owner, which scans the ranges it wrote, claims what is left) or poll once more.
 * Helpers that find nothing to claim poll pool.go for a while (pool.spin_ns, the
 * kernels.idle_spin_us setting), then sleep on pool.cv; see pool_wait_for_work for why no
 * wake-up is lost. The polling is there because a sleeping helper wakes late: on a 2-vCPU
 * virtual machine without guest halt-polling (cpuidle haltpoll, guest_halt_poll_ns = 0) a
 * condition-variable wake-up took 20 us median but 0.42 ms at p90 (an idle vCPU halts, and
 * the wake-up goes through the hypervisor), against 20 us p90 with the CPUs held out of
 * their idle state. A decode step makes dozens of kernel calls with Python between them
 * (attention's projections, norms, rope), so a helper that slept between them joined each
 * call late or not at all (a 2048 x 2048 int4 linear at batch 1 ran at the speed of one
 * thread). A polling helper calls sched_yield now and then, so a thread with work on its
 * CPU (another process of the cluster, between the dense worker and the expert store) runs
 * first. */


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
#define POOL_SPIN_NS_DEFAULT 2000000 /* how long an idle helper polls for the next job before it sleeps */

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
    _Alignas(64) atomic_int go;         /* 1 while a job is published and not all finished */
    _Alignas(64) _Atomic int64_t left;  /* chunks of the published job not yet claimed (a hint) */
    _Alignas(64) _Atomic int64_t done;  /* chunks of the published job finished */
    _Alignas(64) atomic_int sleeping;   /* helpers asleep (or about to be) on cv */
    atomic_int nranges;                 /* range words of the published job (a hint) */
    _Atomic int64_t spin_ns;            /* mt_pool_set_spin: idle polling before sleeping */
    atomic_int parked;                  /* mt_pool_park: 1 until the next job, polling helpers sleep */
    _Atomic uint64_t jobs;              /* jobs published so far: a sleeper woken for one polls */
    pthread_mutex_t mu;                 /* guards the cv wait; nothing else */
    pthread_cond_t cv;
    /* range r: chunks [lo, hi) of the published job not yet claimed, as hi << 32 | lo */
    struct {
        _Alignas(64) _Atomic uint64_t v;
    } range[POOL_MAX];
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .spin_ns = POOL_SPIN_NS_DEFAULT};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* How long idle helpers poll for the next job before they sleep (see above). */
void mt_pool_set_spin(int64_t ns) { atomic_store_explicit(&pool.spin_ns, ns < 0 ? 0 : ns, memory_order_relaxed); }
int64_t mt_pool_spin(void) { return atomic_load_explicit(&pool.spin_ns, memory_order_relaxed); }

/* The caller is about to wait for another process (the dense worker for the expert store's
 * answer, the store for the worker's next call): until the next job, no kernel of this
 * process runs, so polling helpers would only take CPU time from the process that works
 * meanwhile. They go to sleep at their next check instead of polling out spin_ns; the
 * next job wakes them as a sleeping helper is woken. A hint only: the protocol does not
 * read it, and a job published meanwhile clears it. */
void mt_pool_park(void) { atomic_store_explicit(&pool.parked, 1, memory_order_relaxed); }

static inline uint64_t range_word(uint64_t lo, uint64_t hi) { return hi << 32 | lo; }

/* Claim a chunk of range r, from its front or its back (step 3): its index, or -1 when the
 * range is empty. */
static int64_t range_claim(int r, int back) {
    /* relaxed: only a guess for the compare-exchange, which rereads on failure */
    uint64_t v = atomic_load_explicit(&pool.range[r].v, memory_order_relaxed);
    for (;;) {
        const uint64_t lo = v & 0xFFFFFFFFu, hi = v >> 32;
        if (lo >= hi) return -1;
        const uint64_t next = back ? range_word(lo, hi - 1) : range_word(lo + 1, hi);
        POOL_JITTER();
        /* acquire on success: see pool.job as the owner wrote it (I3) */
        if (atomic_compare_exchange_weak_explicit(&pool.range[r].v, &v, next, memory_order_acquire,
                                                  memory_order_relaxed))
            return (int64_t)(back ? hi - 1 : lo);
    }
}

/* Claim and run chunks of the published job until none are left unclaimed: thread `self`'s
 * own range from its front, then the others' from their backs. */
static void pool_work(int self) {
    for (;;) {
        const int nr = atomic_load_explicit(&pool.nranges, memory_order_relaxed);
        int64_t c = self < nr ? range_claim(self, 0) : -1;
        for (int j = 1; c < 0 && j <= nr; j++) c = range_claim((self + j) % nr, 1);
        if (c < 0) return;
        atomic_fetch_sub_explicit(&pool.left, 1, memory_order_relaxed);
        POOL_JITTER();
        pool.job.fn(pool.job.ctx, c); /* I1, I2: pool.job is stable while we hold a claim */
        POOL_JITTER();
        /* release: the chunk's writes (and our reads of pool.job and ctx) happen before the
         * owner's acquire of the final count, after which it may return or write the next job */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        POOL_JITTER();
    }
}

/* Until a job is published with chunks left: spin a little, then sleep on cv. No wake-up
 * is lost: the helper announces itself in pool.sleeping and then checks pool.go, the owner
 * stores pool.go and then reads pool.sleeping, all four seq_cst, so in their single total
 * order either the helper sees the job or the owner sees the sleeper and broadcasts under
 * pool.mu, which the helper holds from its check until cond_wait releases it. A helper that
 * sleeps through a whole job costs nothing: the others claim its range. */
static int pool_has_work(void) {
    return atomic_load_explicit(&pool.go, memory_order_relaxed) &&
           atomic_load_explicit(&pool.left, memory_order_relaxed) > 0;
}

static void pool_wait_for_work(void) {
    const int64_t spin = atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    for (int64_t t0 = now_ns(), n = 0;; n++) {
        if (pool_has_work()) return;
        if ((n & 15) == 15) {
            if (now_ns() - t0 >= spin || atomic_load_explicit(&pool.parked, memory_order_relaxed)) break;
            if ((n & 63) == 63) sched_yield(); /* polite: a thread with work on this CPU runs first */
        }
        CPU_RELAX();
    }
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.sleeping, 1, memory_order_seq_cst);
    /* A job published after this point ends the wait even when it has finished by the time
     * this helper runs (go is 0 again): a vCPU that halted takes up to half a millisecond to
     * wake, longer than a small job, and a helper that went back to sleep then would miss
     * every call of a burst. It polls for the next one instead, as it does after a job it
     * took part in. */
    const uint64_t seen = atomic_load_explicit(&pool.jobs, memory_order_relaxed);
    while (atomic_load_explicit(&pool.go, memory_order_seq_cst) == 0 &&
           atomic_load_explicit(&pool.jobs, memory_order_relaxed) == seen)
        pthread_cond_wait(&pool.cv, &pool.mu);
    atomic_fetch_sub_explicit(&pool.sleeping, 1, memory_order_relaxed);
    pthread_mutex_unlock(&pool.mu);
}

static void *pool_helper(void *arg) {
    const int self = (int)(intptr_t)arg; /* 1, 2, ...: its range, when a job has that many */
    for (;;) {
        pool_wait_for_work();
        pool_work(self);
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
    atomic_store_explicit(&pool.go, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.left, 0, memory_order_relaxed);
    for (int r = 0; r < POOL_MAX; r++) atomic_store_explicit(&pool.range[r].v, 0, memory_order_relaxed);
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
        int rc = pthread_create(&th, &at, pool_helper, (void *)(intptr_t)(pool.nhelpers + 1));
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        pool.nhelpers++;
    }
}

/* Run fn(ctx, c) for c in [0, nchunks) on up to nthreads threads (the caller included);
 * returns when every chunk has finished, on whichever thread. */
void mt_pool_run(int nthreads, int64_t nchunks, chunk_fn fn, void *ctx) {
    int expect = 0;
    /* acquire on success: see the job state the previous owner left (its release below) */
    if (nthreads <= 1 || nchunks <= 1 || nchunks > (int64_t)0xFFFFFFFF || /* a range word holds 32-bit indices */
        !atomic_compare_exchange_strong_explicit(&pool.owner, &expect, 1, memory_order_acquire,
                                                 memory_order_relaxed)) {
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
        return;
    }
    pool_grow(nthreads - 1);
    /* step 1: nobody reads these now (I1: every range is empty and done == the previous nchunks) */
    pool.job.fn = fn;
    pool.job.ctx = ctx;
    pool.job.nchunks = nchunks;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed); /* ordered by the releases below */
    atomic_store_explicit(&pool.left, nchunks, memory_order_relaxed);
    atomic_store_explicit(&pool.parked, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.jobs, 1, memory_order_relaxed); /* before go: see pool_wait_for_work */
    /* one range per thread of the call, the helpers that exist; never more ranges than chunks */
    int64_t nr = pool.nhelpers + 1 < nthreads ? pool.nhelpers + 1 : nthreads;
    if (nr > nchunks) nr = nchunks;
    atomic_store_explicit(&pool.nranges, (int)nr, memory_order_relaxed);
    POOL_JITTER();
    /* step 2: publish, range by range (release), then wake the helpers. seq_cst on go (a
     * release, and ordered before the load of sleeping: see pool_wait_for_work) */
    for (int64_t r = 0; r < nr; r++)
        atomic_store_explicit(&pool.range[r].v, range_word((uint64_t)(nchunks * r / nr), (uint64_t)(nchunks * (r + 1) / nr)),
                              memory_order_release);
    atomic_store_explicit(&pool.go, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&pool.sleeping, memory_order_seq_cst) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    pool_work(0);
    /* step 5: acquire pairs with each claimer's release (I4) */
    for (long spin = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < nchunks; spin++) {
        if (spin < 2000) {
            CPU_RELAX();
        } else {
            sched_yield(); /* a helper holding a chunk was descheduled */
        }
    }
    atomic_store_explicit(&pool.go, 0, memory_order_relaxed);
    POOL_JITTER();
    /* release: the next owner (another thread) sees this job's state settled */
    atomic_store_explicit(&pool.owner, 0, memory_order_release);
}
