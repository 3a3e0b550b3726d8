/* The one thread pool of the compiled kernels: `reap_pool_size(n)` starts n - 1 workers,
   `reap_parallel` (step_common.h; from Python: `reap.quant.ckernel.parallel`) runs a job on
   them and the caller. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "step_common.h"

#if defined(__x86_64__)
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

/* A job is split into chunks that the caller and the workers claim from a shared ticket
   (job number << 32 | next chunk), so a worker that the OS has not scheduled yet delays
   nothing: the others take the chunks it has not claimed. Which thread computes a row never changes its value. */
#define MAX_THREADS 64
#define SPINS 20000 /* default pause loops before an idle worker sleeps */
#define CLOSED 0xffffffffu

static struct {
    int n; /* threads including the caller */
    pthread_t th[MAX_THREADS];
    atomic_uint_fast64_t gen, ticket;
    atomic_int done, quit, spins; /* spins: pause loops before an idle worker sleeps */
    int sleeping;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_fn fn;
    const void *ctx;
    int64_t total, chunk, nchunks;
} P = {.n = 1, .spins = SPINS, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* How long idle workers spin before they sleep: long between the many small jobs of a decode
   step, 0 after a prefill call, so that the torch ops between two calls (with their own
   OpenMP threads) get the cores. Read on every pause loop, so it acts at once. */
void reap_pool_spin(int spins) { atomic_store_explicit(&P.spins, spins, memory_order_relaxed); }

/* claim and run chunks of the open job until none is left */
static void run_chunks(void) {
    for (;;) {
        uint_fast64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
        uint64_t c = t & 0xffffffffu;
        if (c == CLOSED || (int64_t)c >= P.nchunks) return;
        if (!atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        int64_t a = (int64_t)c * P.chunk, b = a + P.chunk < P.total ? a + P.chunk : P.total;
        P.fn(P.ctx, a, b);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static uint_fast64_t start_gen; /* the generation when the workers were created */

static void *worker(void *arg) {
    (void)arg;
    uint_fast64_t seen = start_gen; /* not P.gen: a job may already have been posted */
    for (;;) {
        uint_fast64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen) {
            if (++spins < atomic_load_explicit(&P.spins, memory_order_relaxed)) {
                PAUSE();
                continue;
            }
            pthread_mutex_lock(&P.mu);
            P.sleeping++;
            while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.cv, &P.mu);
            P.sleeping--;
            pthread_mutex_unlock(&P.mu);
        }
        seen = g;
        if (atomic_load(&P.quit)) return NULL;
        run_chunks();
    }
}

static void wake_all(void) {
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (P.sleeping) pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
}

static atomic_flag busy = ATOMIC_FLAG_INIT; /* a job is open, or the pool is being resized */

/* Use n threads (the caller plus n - 1 workers); returns the count in use. While another
   thread's job holds the pool (a caller running on a worker of it) the size stays. */
int reap_pool_size(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n == P.n || atomic_flag_test_and_set(&busy)) return P.n;
    if (P.n > 1) { /* stop the old workers */
        atomic_store(&P.quit, 1);
        wake_all();
        for (int i = 1; i < P.n; i++) pthread_join(P.th[i], NULL);
        atomic_store(&P.quit, 0);
    }
    P.n = 1;
    start_gen = atomic_load(&P.gen);
    for (int i = 1; i < n; i++) {
        if (pthread_create(&P.th[i], NULL, worker, NULL) != 0) break;
        P.n = i + 1;
    }
    atomic_flag_clear(&busy);
    return P.n;
}

/* fn(ctx, a, b) over [0, total) in chunks of at least `grain` items (about four per thread),
   shared by the caller and the workers; returns when all are done. Safe to call from several
   threads at once: while one caller's job holds the pool, the others run theirs alone. */
void reap_parallel(task_fn fn, const void *ctx, int64_t total, int64_t grain) {
    if (total <= 0) return;
    int64_t chunk = total / (4 * (int64_t)P.n);
    chunk = chunk > grain ? chunk : grain;
    if (P.n == 1 || chunk >= total || atomic_flag_test_and_set(&busy)) {
        fn(ctx, 0, total); /* alone, or another thread's job holds the pool: on this thread */
        return;
    }
    uint_fast64_t job = (atomic_load(&P.ticket) >> 32) + 1;
    atomic_store_explicit(&P.ticket, job << 32 | CLOSED, memory_order_release);
    P.fn = fn;
    P.ctx = ctx;
    P.total = total;
    P.chunk = chunk;
    P.nchunks = (total + chunk - 1) / chunk;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    atomic_store_explicit(&P.ticket, job << 32, memory_order_release);
    wake_all();
    run_chunks();
    for (int spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < P.nchunks;)
        if (++spins < 256) PAUSE(); else sched_yield();
    atomic_flag_clear(&busy);
}
