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
 * Helpers that find nothing to claim poll pool.left for a while (pool.spin_ns, the
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
    _Alignas(64) _Atomic int64_t left;  /* chunks of the published job not yet claimed */
    _Alignas(64) _Atomic int64_t done;  /* chunks of the published job finished */
    _Alignas(64) atomic_int sleeping;   /* helpers asleep (or about to be) on cv */
    _Atomic int64_t spin_ns;            /* mt_pool_set_spin: idle polling before sleeping */
    atomic_int parked;                  /* mt_pool_park: 1 until the next job, polling helpers sleep */
    pthread_mutex_t mu;                 /* guards the cv wait; nothing else */
    pthread_cond_t cv;
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
    const int64_t spin = atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    for (int64_t t0 = now_ns(), n = 0;; n++) {
        if (atomic_load_explicit(&pool.left, memory_order_relaxed) > 0) return;
        if ((n & 15) == 15) {
            if (now_ns() - t0 >= spin || atomic_load_explicit(&pool.parked, memory_order_relaxed)) break;
            if ((n & 63) == 63) sched_yield(); /* polite: a thread with work on this CPU runs first */
        }
        CPU_RELAX();
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
void mt_pool_run(int nthreads, int64_t nchunks, chunk_fn fn, void *ctx) {
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
    atomic_store_explicit(&pool.parked, 0, memory_order_relaxed);
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
            CPU_RELAX();
        } else {
            sched_yield(); /* a helper holding a chunk was descheduled */
        }
    }
    POOL_JITTER();
    /* release: the next owner (another thread) sees this job's state settled */
    atomic_store_explicit(&pool.owner, 0, memory_order_release);
}

