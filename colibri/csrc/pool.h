/* colibri/csrc/pool.h: the kernels' thread pool.
 *
 * Why not OpenMP: a decode step runs ~30 short parallel jobs (0.05-1 ms each) with Python
 * work in between. OpenMP's fork/join gives two bad choices there: idle workers that sleep
 * (OMP_WAIT_POLICY=PASSIVE) pay a wake-up per job (tens of microseconds on a VM, where an
 * idle vCPU halts; mixtral-mini int8 decode on 2 threads ran slower than on 1), and workers
 * that spin make every join wait for a worker the OS has descheduled when the cores are
 * shared (the same decode fell to a quarter with a busy neighbour process).
 * This pool keeps the good half of each: workers spin for a short while after a job (so the
 * jobs of one decode step find them awake), then sleep (each on its own condition variable:
 * a job wakes only the workers it uses, so a call on many threads leaves no crowd to wake
 * for later calls on few); and the caller never waits for a worker to join: it claims work
 * items itself and returns as soon as every item is done. A late worker (asleep, or
 * descheduled) finds nothing left and costs nothing; only an item a worker has started is
 * waited for, and the waiting caller yields its core to it.
 *
 * Use: colibri_pool_run(nth, fn, ctx, n) calls fn(ctx, i) once for every i < n, on up to nth
 * threads (the caller and nth - 1 workers), and returns when all calls have returned.
 * colibri_worker_num() is the running thread's number in 0..nth-1 (0: the caller), for
 * per-thread scratch. One caller at a time uses the workers; a concurrent caller (another
 * Python thread) runs its job alone on its own thread. fn must not call the pool.
 *
 * Claiming: one 64-bit word holds the job's generation, thread count, item count and next
 * item (11 | 7 | 23 | 23 bits); a thread claims item i by a compare-and-swap of that word
 * from (job, next = i) to (job, i + 1), and only then reads fn and ctx: while an item of a
 * job is unfinished, the caller does not publish the next job, so they are that job's.
 * (A word seen again after 2048 jobs is the same job state, so claiming from it is right.)
 *
 * Builds without POSIX threads (Windows, or COLIBRI_NO_THREADS) run every job on the caller.
 */
#ifndef COLIBRI_POOL_H
#define COLIBRI_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef void (*colibri_task_fn)(void *ctx, ptrdiff_t item);

#define COLIBRI_POOL_MAX_THREADS 127         /* 7 bits of the state word */
#define COLIBRI_POOL_MAX_ITEMS ((ptrdiff_t)1 << 23)

#if !defined(COLIBRI_NO_THREADS) && !defined(_WIN32) && (defined(__GNUC__) || defined(__clang__))
#define COLIBRI_POOL_THREADS 1
#else
#define COLIBRI_POOL_THREADS 0
#endif

#include "amx_tiles.h"   /* colibri_tls_tiles, colibri_tiles_release */

static inline void colibri_pool_release_tiles(void)
{
    if (colibri_tls_tiles) {
        colibri_tiles_release();
        colibri_tls_tiles = 0;
    }
}

static int colibri_pool_spin_us = 500;      /* how long an idle worker spins before sleeping;
                                              * set at import by colibri.kernels.runtime (SPIN_US) */
static long colibri_pool_backoffs = 0;      /* times a worker stopped spinning (cores shared) */
static long colibri_pool_worker_items = 0;  /* work items run by worker threads (not callers) */

#if COLIBRI_POOL_THREADS

#include <pthread.h>
#include <sched.h>
#include <time.h>

#define COLIBRI_POOL_WINDOW_NS 20000000    /* spin time over which preemption is judged */
#define COLIBRI_POOL_BACKOFF_NS 200000000  /* no spinning for this long after a bad window */

static __thread int colibri_tls_worker = 0;

#define COLIBRI_ST_NEXT(s) ((ptrdiff_t)((s) & 0x7FFFFF))
#define COLIBRI_ST_N(s) ((ptrdiff_t)(((s) >> 23) & 0x7FFFFF))
#define COLIBRI_ST_NTH(s) ((int)(((s) >> 46) & 127))
#define COLIBRI_ST_GEN(s) ((uint32_t)((s) >> 53))
#define COLIBRI_ST_PACK(gen, nth, n) \
    (((uint64_t)(gen) << 53) | ((uint64_t)(nth) << 46) | ((uint64_t)(n) << 23))

static struct {
    uint64_t state;              /* atomic: the packed job word */
    ptrdiff_t done;              /* atomic: items of the current job that have returned */
    int sleeping[COLIBRI_POOL_MAX_THREADS];   /* atomic: worker w blocked on cv[w] */
    colibri_task_fn fn;          /* the current job, written before its state word */
    void *ctx;
    ptrdiff_t base;              /* item offset of the current chunk of a long job */
    int n_workers;               /* worker threads started (numbers 1..n_workers) */
    uint32_t gen;
    pthread_mutex_t run_mu;      /* held by the one caller that uses the workers */
    pthread_mutex_t mu;          /* sleep / wake */
    pthread_cond_t cv[COLIBRI_POOL_MAX_THREADS];  /* one per worker: a job wakes only its own */
    int ready;                   /* cv initialised, fork handler installed */
} colibri_pool = {0, 0, {0}, NULL, NULL, 0, 0, 0, PTHREAD_MUTEX_INITIALIZER,
                  PTHREAD_MUTEX_INITIALIZER};

static inline void colibri_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline int64_t colibri_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claim and run items of the job whose generation is gen until none is left. */
static void colibri_pool_drain(uint32_t gen)
{
    uint64_t s = __atomic_load_n(&colibri_pool.state, __ATOMIC_ACQUIRE);
    for (;;) {
        if (COLIBRI_ST_GEN(s) != gen || COLIBRI_ST_NEXT(s) >= COLIBRI_ST_N(s)) {
            colibri_pool_release_tiles();
            return;
        }
        if (!__atomic_compare_exchange_n(&colibri_pool.state, &s, s + 1, 1, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;                                   /* s now holds the current word */
        colibri_pool.fn(colibri_pool.ctx, colibri_pool.base + COLIBRI_ST_NEXT(s));
        if (colibri_tls_worker != 0)
            __atomic_fetch_add(&colibri_pool_worker_items, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&colibri_pool.done, 1, __ATOMIC_RELEASE);
        s = __atomic_load_n(&colibri_pool.state, __ATOMIC_ACQUIRE);
    }
}

/* CPU time of the calling thread (ns); -1 where unknown. */
static inline int64_t colibri_thread_cpu_ns(void)
{
#ifdef CLOCK_THREAD_CPUTIME_ID
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0)
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
    return -1;
}

static void *colibri_pool_worker(void *arg)
{
    const int me = (int)(intptr_t)arg;
    uint32_t seen = COLIBRI_ST_GEN(__atomic_load_n(&colibri_pool.state, __ATOMIC_ACQUIRE));
    int64_t calm_from = 0;          /* no spinning before this time (ns) */
    int64_t spun = 0, lost = 0;     /* spin wall time, and the part spent off the CPU */
    int wanted = 1;                 /* the last job had work for this worker */
    colibri_tls_worker = me;
    for (;;) {
        uint64_t s = __atomic_load_n(&colibri_pool.state, __ATOMIC_ACQUIRE);
        const int spin_us = __atomic_load_n(&colibri_pool_spin_us, __ATOMIC_RELAXED);
        int64_t now;
        if (COLIBRI_ST_GEN(s) == seen && wanted && spin_us > 0 &&
            (now = colibri_now_ns()) >= calm_from) {
            /* Spin a while: the next job of a decode step comes within microseconds. A
             * spinning thread that spends a good part of its spin off the CPU is competing
             * for oversubscribed cores (other busy processes): it takes CPU from them and
             * from our own caller, so it stops spinning for a while (then tries again). */
            const int64_t until = now + (int64_t)spin_us * 1000, cpu0 = colibri_thread_cpu_ns();
            int64_t wall;
            unsigned k = 0;
            while (COLIBRI_ST_GEN(s = __atomic_load_n(&colibri_pool.state, __ATOMIC_ACQUIRE))
                   == seen) {
                colibri_cpu_relax();
                if ((++k & 255) == 0 && colibri_now_ns() >= until)
                    break;
            }
            if (cpu0 >= 0) {
                wall = colibri_now_ns() - now;
                spun += wall;
                lost += wall - (colibri_thread_cpu_ns() - cpu0);
                if (spun >= COLIBRI_POOL_WINDOW_NS) {
                    if (4 * lost > spun) {              /* off the CPU > 1/4 of the time */
                        calm_from = colibri_now_ns() + COLIBRI_POOL_BACKOFF_NS;
                        __atomic_fetch_add(&colibri_pool_backoffs, 1, __ATOMIC_RELAXED);
                    }
                    spun = lost = 0;
                }
            }
        }
        if (COLIBRI_ST_GEN(s) == seen) {
            /* then sleep until a job for this worker; the caller checks sleeping[me] after
             * publishing (both seq_cst), and signals only the workers its job uses */
            pthread_mutex_lock(&colibri_pool.mu);
            __atomic_store_n(&colibri_pool.sleeping[me], 1, __ATOMIC_SEQ_CST);
            for (;;) {
                s = __atomic_load_n(&colibri_pool.state, __ATOMIC_SEQ_CST);
                if (COLIBRI_ST_GEN(s) != seen && me < COLIBRI_ST_NTH(s))
                    break;
                pthread_cond_wait(&colibri_pool.cv[me], &colibri_pool.mu);
            }
            __atomic_store_n(&colibri_pool.sleeping[me], 0, __ATOMIC_SEQ_CST);
            pthread_mutex_unlock(&colibri_pool.mu);
        }
        seen = COLIBRI_ST_GEN(s);
        wanted = me < COLIBRI_ST_NTH(s);
        if (wanted)
            colibri_pool_drain(seen);
    }
    return NULL;
}

/* After fork() the child has no workers: forget them (and any lock state). */
static void colibri_pool_atfork_child(void)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    int w;
    colibri_pool.n_workers = 0;
    colibri_pool.run_mu = m;
    colibri_pool.mu = m;
    for (w = 0; w < COLIBRI_POOL_MAX_THREADS; w++) {
        colibri_pool.sleeping[w] = 0;
        colibri_pool.cv[w] = c;
    }
    colibri_tls_worker = 0;
}

/* Start workers up to number nth - 1 (called with run_mu held); returns the threads usable. */
static int colibri_pool_grow(int nth)
{
    if (!colibri_pool.ready) {
        int w;
        for (w = 0; w < COLIBRI_POOL_MAX_THREADS; w++) pthread_cond_init(&colibri_pool.cv[w], NULL);
        pthread_atfork(NULL, NULL, colibri_pool_atfork_child);
        colibri_pool.ready = 1;
    }
    while (colibri_pool.n_workers < nth - 1) {
        pthread_t th;
        pthread_attr_t attr;
        int rc;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        rc = pthread_create(&th, &attr, colibri_pool_worker,
                            (void *)(intptr_t)(colibri_pool.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;                                      /* run with the workers we have */
        colibri_pool.n_workers++;
    }
    return colibri_pool.n_workers + 1 < nth ? colibri_pool.n_workers + 1 : nth;
}

static void colibri_pool_run(int nth, colibri_task_fn fn, void *ctx, ptrdiff_t n)
{
    ptrdiff_t base, i;
    if (nth > COLIBRI_POOL_MAX_THREADS)
        nth = COLIBRI_POOL_MAX_THREADS;
    if (nth > n)
        nth = (int)n;
    if (nth <= 1 || pthread_mutex_trylock(&colibri_pool.run_mu) != 0) {
        const int saved = colibri_tls_worker;
        colibri_tls_worker = 0;
        for (i = 0; i < n; i++)
            fn(ctx, i);
        colibri_pool_release_tiles();
        colibri_tls_worker = saved;
        return;
    }
    nth = colibri_pool_grow(nth);
    colibri_tls_worker = 0;
    for (base = 0; base < n; base += COLIBRI_POOL_MAX_ITEMS) {
        const ptrdiff_t m = n - base < COLIBRI_POOL_MAX_ITEMS ? n - base
                                                                 : COLIBRI_POOL_MAX_ITEMS;
        const uint32_t gen = colibri_pool.gen = (colibri_pool.gen + 1) & 0x7FF;
        unsigned k = 0;
        colibri_pool.fn = fn;
        colibri_pool.ctx = ctx;
        colibri_pool.base = base;
        __atomic_store_n(&colibri_pool.done, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&colibri_pool.state, COLIBRI_ST_PACK(gen, nth, m), __ATOMIC_SEQ_CST);
        {
            int w;
            for (w = 1; w < nth; w++)
                if (__atomic_load_n(&colibri_pool.sleeping[w], __ATOMIC_SEQ_CST)) {
                    pthread_mutex_lock(&colibri_pool.mu);
                    pthread_cond_signal(&colibri_pool.cv[w]);
                    pthread_mutex_unlock(&colibri_pool.mu);
                }
        }
        colibri_pool_drain(gen);
        /* every item is claimed: wait for the ones workers are running; after a short spin,
         * give the core away (with more threads than cores the worker may need this one) */
        while (__atomic_load_n(&colibri_pool.done, __ATOMIC_ACQUIRE) < m) {
            if (++k < 2048)
                colibri_cpu_relax();
            else
                sched_yield();
        }
    }
    pthread_mutex_unlock(&colibri_pool.run_mu);
}

static inline int colibri_worker_num(void) { return colibri_tls_worker; }

#else  /* no threads: every job runs on the caller */

static void colibri_pool_run(int nth, colibri_task_fn fn, void *ctx, ptrdiff_t n)
{
    ptrdiff_t i;
    (void)nth;
    for (i = 0; i < n; i++)
        fn(ctx, i);
    colibri_pool_release_tiles();
}

static inline int colibri_worker_num(void) { return 0; }

#endif

static inline int colibri_pool_threaded(void) { return COLIBRI_POOL_THREADS; }

#endif /* COLIBRI_POOL_H */
