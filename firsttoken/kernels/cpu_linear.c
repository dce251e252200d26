/* firsttoken's few-rows float32 linear products for x86 CPUs with AVX2 + FMA (firsttoken/kernels/cpu_linear.py
   builds and loads this file).

   out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for the few rows of a decode step (M <= 16), in two layouts:
   - ft_linear_im: W stored input-major, wt = W^T as a contiguous [K, N] (the widening layers: q/k/v, gate/up,
     lm_head, on CPUs with AVX-512; on AVX2 CPUs the loader keeps every weight row-major, loader.keeps_row_major).
     Blocks of KB rows of wt are read from memory once, in one sequential sweep, and every row of x accumulates its
     KB products into its output row (in L1/L2), two rows of x per pass over the block.
   - ft_linear_rm: W row-major [N, K] (the narrowing down projection). Rows of W are read one by one, one
     sequential stream, and each is dotted with up to four rows of x while in L1.
   (ft_linear_im takes 16 outputs a pass where the CPU has AVX-512: im_range16, bitwise the same sums.)
   MKL's sgemm has no good path for 2-16 rows on an AVX2 CPU (its time grows almost linearly with the rows); here
   a weight read from memory costs about the same whether 1 or 16 rows of x use it.

   Every output (m, n) is summed the same way whatever M and the thread count (im: k in order, in blocks of KB,
   each block's products summed in order then added to the running sum; rm: two 8-lane partial sums over k % 16,
   then a fixed reduction), so a request's decode products are bitwise the same whichever requests share its
   step. Threads split the outputs n into chunks (ft_parallel below: OpenMP's team, or this file's own threads in
   fused decode steps; the int8 products' too, their row quantization on OpenMP). The Python side checks
   K % KB == 0 and N % 8 == 0 (im), K % 16 == 0 (rm). */
#define _GNU_SOURCE /* sched_getaffinity */
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KB 8

/* What this CPU runs beyond AVX2, found once at load (no race among callers): AVX-512 F/BW/VL/DQ (the 16-wide
   input-major products, the decode attention), with AVX512-BF16 (bf16 dot products), with AVX-512 VNNI (int8). */
static int avx512_cpu, avx512_bf16_cpu, vnni_cpu;
__attribute__((constructor)) static void detect_cpu(void) {
    __builtin_cpu_init();
    avx512_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    avx512_bf16_cpu = avx512_cpu && __builtin_cpu_supports("avx512bf16");
    vnni_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vnni");
}
#define MAX_INT8_ROWS 16 /* cpu_linear.py's MAX_ROWS */

/* ---- the kernels' threads: ft_parallel ----

   fn(ctx, i) for i in [0, n). With threads < 0, on up to -threads threads: the caller and persistent workers, each
   claiming the next index from one atomic counter until none is left (threads > 0: an OpenMP parallel for, see
   ft_parallel). Why not OpenMP's parallel for there: its team ends at a barrier that waits for every thread of the
   team, so a worker the OS pre-empted (a served decode step shares two cores with the event loop that streams the
   tokens and with the clients) stalls the step until it runs again, and its idle workers spin for milliseconds
   after each region, taking the core that the event loop needs while the engine runs Python. Here a worker is
   optional: the caller claims indices too and returns when all are done, so a worker that is late or pre-empted
   between indices costs nothing (only one pre-empted while holding an index is waited for: indices are a few
   microseconds of work); an idle worker spins for the next region (0.1 ms; 2 ms in decode steps: ft_pool_spin)
   and then sleeps on a futex until a caller publishes work. Which thread computes an index never changes what it
   computes.

   Publication: a region's (fn, ctx, n, width) goes to slot[gen & 1], then `claim` = gen << 32 (index 0). A worker
   reads claim, then the slot of its generation, and takes index i only by a compare-and-swap of (gen, i) to
   (gen, i + 1): if the caller has moved on (the slot may be mid-rewrite for gen + 2), the generation differs and
   what it read is dropped. Indices are counted done after they ran; the caller waits for all n. One caller at a
   time (a mutex, tried: a second concurrent caller runs its region alone). */
typedef void (*task_fn)(void *ctx, int64_t i);
typedef struct {
    _Atomic(task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
    _Atomic int width; /* threads taking part: worker w when w + 1 < width */
} pool_slot;
#define POOL_MAX_WORKERS 63
#define POOL_SPIN_NS 100000 /* an idle worker spins this long before it sleeps (ft_pool_spin changes it) */
static struct {
    pthread_mutex_t busy;
    pthread_mutex_t start; /* starting workers */
    _Atomic uint64_t claim; /* (generation << 32) | next index */
    _Atomic int64_t done;
    _Atomic uint32_t wake; /* the futex word: the generation last published */
    _Atomic int sleepers;
    _Atomic int workers; /* started */
    pool_slot slot[2];
    _Atomic uint64_t regions, helped; /* regions run on more than one thread; indices the workers took (tests) */
    _Atomic int held; /* tests: workers take no index while set (the caller must do all) */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .start = PTHREAD_MUTEX_INITIALIZER};

static _Atomic int64_t pool_spin_ns = POOL_SPIN_NS;
/* how long idle workers spin before they sleep: long in decode steps (the next step's regions begin within a few
   milliseconds of Python, and a sleeping worker takes ~0.1 ms or more to wake), short elsewhere (a prefill's torch
   ops need every core for OpenMP's own team) */
void ft_pool_spin(int64_t ns) { atomic_store(&pool_spin_ns, ns); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* take and run indices of the region published as `c`'s generation; returns how many this thread ran */
static int64_t pool_work(uint64_t c, int worker) {
    uint32_t gen = (uint32_t)(c >> 32);
    pool_slot *s = &pool.slot[gen & 1];
    task_fn fn = atomic_load(&s->fn);
    void *ctx = atomic_load(&s->ctx);
    int64_t n = atomic_load(&s->n), ran = 0;
    if (worker >= 0 && (worker + 1 >= atomic_load(&s->width) || atomic_load(&pool.held))) return 0;
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (int64_t)(c & 0xffffffffu) >= n) return ran;
        if (atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) {
            fn(ctx, (int64_t)(c & 0xffffffffu));
            atomic_fetch_add(&pool.done, 1);
            ran++;
            c = atomic_load(&pool.claim);
        }
    }
}

static void *pool_worker(void *arg) {
    int w = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&pool.wake);
    for (;;) {
        int64_t since = now_ns();
        uint32_t gen;
        for (int spins = 1; (gen = atomic_load(&pool.wake)) == seen; spins++) {
            _mm_pause();
            if (spins % 64 == 0 && now_ns() - since > atomic_load(&pool_spin_ns)) {
                atomic_fetch_add(&pool.sleepers, 1);
                if (atomic_load(&pool.wake) == seen)
                    syscall(SYS_futex, &pool.wake, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
                since = now_ns();
            }
        }
        seen = gen;
        int64_t ran = pool_work(atomic_load(&pool.claim), w);
        if (ran) atomic_fetch_add(&pool.helped, (uint64_t)ran);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has none of the parent's threads */
    atomic_store(&pool.workers, 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.start, NULL);
}

static void pool_start(int want) { /* workers 0 .. want - 1, started once; fewer if threads cannot be had */
    if (want > POOL_MAX_WORKERS) want = POOL_MAX_WORKERS;
    if (atomic_load(&pool.workers) >= want) return;
    pthread_mutex_lock(&pool.start);
    static int at_fork;
    if (!at_fork) at_fork = !pthread_atfork(NULL, NULL, pool_after_fork);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old); /* workers never take a signal meant for the process */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 1 << 20);
    for (int w = atomic_load(&pool.workers); w < want; w++) {
        pthread_t t;
        if (pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)w)) break;
        atomic_fetch_add(&pool.workers, 1);
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_mutex_unlock(&pool.start);
}

static int64_t read_int(const char *path, int field) { /* a file's field-th whitespace-separated integer, or -1 */
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char word[64];
    int64_t v = -1;
    for (int i = 0; i <= field && fscanf(f, "%63s", word) == 1; i++)
        if (i == field) v = strcmp(word, "max") == 0 ? -1 : strtoll(word, NULL, 10);
    fclose(f);
    return v;
}

/* The CPUs a cgroup CPU quota allows, rounded up (cgroup v2 cpu.max "quota period", or v1 cfs_quota_us and
   cfs_period_us), or 0 when there is no quota. A container limited with --cpus sees every core of its host in its
   affinity mask; workers beyond its quota spin away the time it is allowed. */
int ft_quota_cpus(const char *cpu_max, const char *v1_quota, const char *v1_period) {
    int64_t quota = read_int(cpu_max, 0), period = read_int(cpu_max, 1);
    if (quota <= 0 || period <= 0) {
        quota = read_int(v1_quota, 0);
        period = read_int(v1_period, 0);
    }
    if (quota <= 0 || period <= 0) return 0;
    return (int)((quota + period - 1) / period);
}

static int pool_cpus(void) { /* CPUs this process may use: more threads than that only spin against each other */
    static _Atomic int cpus;
    int c = atomic_load(&cpus);
    if (!c) {
        cpu_set_t set;
        c = sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : INT_MAX;
        int quota = ft_quota_cpus("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                                  "/sys/fs/cgroup/cpu/cpu.cfs_period_us");
        if (quota > 0 && quota < c) c = quota;
        atomic_store(&cpus, c);
    }
    return c;
}

/* threads > 0: OpenMP (the team torch's own ops use, so nothing else spins beside it: steps whose torch ops run
   on several threads); threads < 0: the pool with -threads (decode steps whose work is all this file's) */
static void ft_parallel(int threads, int64_t n, task_fn fn, void *ctx) {
    if (threads >= 0) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 1)
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    threads = -threads;
    if (threads > POOL_MAX_WORKERS + 1) threads = POOL_MAX_WORKERS + 1;
    if (threads > pool_cpus()) threads = pool_cpus();
    if (threads <= 1 || n <= 1 || pthread_mutex_trylock(&pool.busy)) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pool_start(threads - 1);
    uint32_t gen = (uint32_t)(atomic_load(&pool.claim) >> 32) + 1;
    pool_slot *s = &pool.slot[gen & 1];
    atomic_store(&s->fn, fn);
    atomic_store(&s->ctx, ctx);
    atomic_store(&s->n, n);
    atomic_store(&s->width, threads);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.claim, (uint64_t)gen << 32);
    atomic_store(&pool.wake, gen);
    if (atomic_load(&pool.sleepers)) syscall(SYS_futex, &pool.wake, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    pool_work((uint64_t)gen << 32, -1);
    while (atomic_load(&pool.done) < n) _mm_pause();
    atomic_fetch_add(&pool.regions, 1);
    pthread_mutex_unlock(&pool.busy);
}

/* tests: hold the workers (1: they take no index) or let them go (0) */
void ft_pool_hold(int held) { atomic_store(&pool.held, held); }

/* tests: regions run on more than one thread, indices the workers ran, workers started */
void ft_pool_stats(int64_t *out) {
    out[0] = (int64_t)atomic_load(&pool.regions);
    out[1] = (int64_t)atomic_load(&pool.helped);
    out[2] = atomic_load(&pool.workers);
}

/* chunks of at most `per` outputs (a multiple of `align`) over N outputs: ~4 a thread, at least `least` outputs */
static int64_t chunk_size(int64_t N, int threads, int64_t least, int64_t align) {
    threads = threads < 0 ? -threads : threads; /* the pool's count (ft_parallel) */
    if (threads <= 1) return N > 0 ? N : 1;
    int64_t per = (N + 4 * threads - 1) / (4 * threads);
    if (per < least) per = least;
    return (per + align - 1) / align * align;
}

/* ---- input-major: rows of x against a [K, N] weight, outputs n0 <= n < n1 ---- */

/* out[m, n0..n1) = bias (or 0): the running sums' start */
static void init_outputs(const float *bias, float *out, int64_t ldo, int64_t M, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * ldo + n0;
        if (bias)
            memcpy(o, bias + n0, (size_t)(n1 - n0) * sizeof(float));
        else
            memset(o, 0, (size_t)(n1 - n0) * sizeof(float));
    }
}

static void im_range(const float *x, int64_t ldx, const float *wt, const float *bias, float *out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    init_outputs(bias, out, ldo, M, n0, n1);
    for (int64_t k = 0; k < K; k += KB) {
        const float *w = wt + k * N;
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            const float *xa = x + m * ldx + k, *xb = xa + ldx;
            __m256 ba[KB], bb[KB];
            for (int j = 0; j < KB; j++) {
                ba[j] = _mm256_set1_ps(xa[j]);
                bb[j] = _mm256_set1_ps(xb[j]);
            }
            float *oa = out + m * ldo, *ob = oa + ldo;
            for (int64_t n = n0; n < n1; n += 8) {
                __m256 v = _mm256_loadu_ps(w + n);
                __m256 sa = _mm256_mul_ps(ba[0], v), sb = _mm256_mul_ps(bb[0], v);
                for (int j = 1; j < KB; j++) {
                    v = _mm256_loadu_ps(w + j * N + n);
                    sa = _mm256_fmadd_ps(ba[j], v, sa);
                    sb = _mm256_fmadd_ps(bb[j], v, sb);
                }
                _mm256_storeu_ps(oa + n, _mm256_add_ps(_mm256_loadu_ps(oa + n), sa));
                _mm256_storeu_ps(ob + n, _mm256_add_ps(_mm256_loadu_ps(ob + n), sb));
            }
        }
        for (; m < M; m++) { /* the same sums, one row */
            const float *xa = x + m * ldx + k;
            __m256 ba[KB];
            for (int j = 0; j < KB; j++) ba[j] = _mm256_set1_ps(xa[j]);
            float *oa = out + m * ldo;
            for (int64_t n = n0; n < n1; n += 8) {
                __m256 sa = _mm256_mul_ps(ba[0], _mm256_loadu_ps(w + n));
                for (int j = 1; j < KB; j++) sa = _mm256_fmadd_ps(ba[j], _mm256_loadu_ps(w + j * N + n), sa);
                _mm256_storeu_ps(oa + n, _mm256_add_ps(_mm256_loadu_ps(oa + n), sa));
            }
        }
    }
}

/* im_range with 16 outputs a pass where the CPU has AVX-512, a last 8 (n1 - n0 not a multiple of 16) through
   im_range itself: every output's sums are the same operations in the same order as im_range's (a lane's block: a
   multiply, 7 multiply-adds in k order, then added to the running sum), so the results are bitwise im_range's;
   half the instructions per output. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
static void im_range16(const float *x, int64_t ldx, const float *wt, const float *bias, float *out, int64_t ldo,
                       int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    int64_t n16 = n0 + (n1 - n0) / 16 * 16;
    init_outputs(bias, out, ldo, M, n0, n16);
    for (int64_t k = 0; k < K; k += KB) {
        const float *w = wt + k * N;
        int64_t m = 0;
        for (; m + 1 < M; m += 2) {
            const float *xa = x + m * ldx + k, *xb = xa + ldx;
            __m512 ba[KB], bb[KB];
            for (int j = 0; j < KB; j++) {
                ba[j] = _mm512_set1_ps(xa[j]);
                bb[j] = _mm512_set1_ps(xb[j]);
            }
            float *oa = out + m * ldo, *ob = oa + ldo;
            for (int64_t n = n0; n < n16; n += 16) {
                __m512 v = _mm512_loadu_ps(w + n);
                __m512 sa = _mm512_mul_ps(ba[0], v), sb = _mm512_mul_ps(bb[0], v);
                for (int j = 1; j < KB; j++) {
                    v = _mm512_loadu_ps(w + j * N + n);
                    sa = _mm512_fmadd_ps(ba[j], v, sa);
                    sb = _mm512_fmadd_ps(bb[j], v, sb);
                }
                _mm512_storeu_ps(oa + n, _mm512_add_ps(_mm512_loadu_ps(oa + n), sa));
                _mm512_storeu_ps(ob + n, _mm512_add_ps(_mm512_loadu_ps(ob + n), sb));
            }
        }
        for (; m < M; m++) { /* the same sums, one row */
            const float *xa = x + m * ldx + k;
            __m512 ba[KB];
            for (int j = 0; j < KB; j++) ba[j] = _mm512_set1_ps(xa[j]);
            float *oa = out + m * ldo;
            for (int64_t n = n0; n < n16; n += 16) {
                __m512 sa = _mm512_mul_ps(ba[0], _mm512_loadu_ps(w + n));
                for (int j = 1; j < KB; j++) sa = _mm512_fmadd_ps(ba[j], _mm512_loadu_ps(w + j * N + n), sa);
                _mm512_storeu_ps(oa + n, _mm512_add_ps(_mm512_loadu_ps(oa + n), sa));
            }
        }
    }
    if (n16 < n1) im_range(x, ldx, wt, bias, out, ldo, M, N, K, n16, n1);
}

static int im16_off; /* tests: ft_im16(0) compares the AVX2 loop */
typedef void (*im_range_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t);
typedef struct { /* ft_linear_im's chunks: outputs [i per, (i + 1) per) */
    im_range_fn range;
    const float *x;
    int64_t ldx;
    const float *wt, *bias;
    float *out;
    int64_t ldo, M, N, K, per;
} im_task;
static void im_chunk(void *ctx, int64_t i) {
    const im_task *t = ctx;
    int64_t n0 = i * t->per, n1 = n0 + t->per < t->N ? n0 + t->per : t->N;
    t->range(t->x, t->ldx, t->wt, t->bias, t->out, t->ldo, t->M, t->N, t->K, n0, n1);
}
int ft_im16(int on) { /* which input-major loop runs: on < 0 asks, 0/1 sets (where the CPU has AVX-512) */
    if (on >= 0) im16_off = !on;
    return avx512_cpu && !im16_off;
}

void ft_linear_im(const float *x, int64_t ldx, const float *wt, const float *bias, float *out, int64_t ldo,
                  int64_t M, int64_t N, int64_t K, int threads) {
    im_range_fn range = avx512_cpu && !im16_off ? im_range16 : im_range;
    im_task t = {range, x, ldx, wt, bias, out, ldo, M, N, K, chunk_size(N, threads, 64, 16)};
    ft_parallel(threads, (N + t.per - 1) / t.per, im_chunk, &t);
}

/* ---- row-major: rows of x against a [N, K] weight ---- */

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

static inline __m256 f32x8(const float *p) { return _mm256_loadu_ps(p); }

/* rows NAME##MB: MB rows of x dotted with one weight row r of type WT, its 16-wide blocks read by LOAD as float32 */
#define ROWS(NAME, WT, LOAD, MB)                                                                                 \
    static void NAME##MB(const float *x, int64_t ldx, const WT *r, float *o, int64_t ldo, int64_t K, float b) { \
        __m256 a[MB][2];                                                                                         \
        for (int i = 0; i < MB; i++) {                                                                           \
            a[i][0] = _mm256_setzero_ps();                                                                       \
            a[i][1] = _mm256_setzero_ps();                                                                       \
        }                                                                                                        \
        for (int64_t k = 0; k < K; k += 16) {                                                                    \
            __m256 v0 = LOAD(r + k), v1 = LOAD(r + k + 8);                                                       \
            for (int i = 0; i < MB; i++) {                                                                       \
                a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), v0, a[i][0]);                        \
                a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), v1, a[i][1]);                    \
            }                                                                                                    \
        }                                                                                                        \
        for (int i = 0; i < MB; i++) o[i * ldo] = hsum(_mm256_add_ps(a[i][0], a[i][1])) + b;                    \
    }

typedef struct { /* a row-major product's chunks: outputs [i per, (i + 1) per) */
    const float *x;
    int64_t ldx;
    const void *w;
    const float *bias;
    float *out;
    int64_t ldo, M, N, K, per;
    const uint16_t *xb; /* the dot-product loop's packed rows */
} rm_task;

/* FN: every row of x against a row-major [N, K] weight of type WT, four rows of x per weight row at a time */
#define LINEAR_RM(FN, WT, NAME)                                                                                  \
    static void NAME##chunk(void *ctx, int64_t i) {                                                              \
        const rm_task *t = ctx;                                                                                  \
        int64_t M = t->M, K = t->K, ldx = t->ldx, ldo = t->ldo, n1 = (i + 1) * t->per;                           \
        for (int64_t n = i * t->per; n < (n1 < t->N ? n1 : t->N); n++) {                                         \
            const WT *r = (const WT *)t->w + n * K;                                                              \
            float b = t->bias ? t->bias[n] : 0.f;                                                                \
            for (int64_t m = 0; m < M; m += 4) {                                                                 \
                const float *xm = t->x + m * ldx;                                                                \
                float *om = t->out + m * ldo + n;                                                                \
                switch (M - m < 4 ? M - m : 4) {                                                                 \
                    case 4: NAME##4(xm, ldx, r, om, ldo, K, b); break;                                           \
                    case 3: NAME##3(xm, ldx, r, om, ldo, K, b); break;                                           \
                    case 2: NAME##2(xm, ldx, r, om, ldo, K, b); break;                                           \
                    default: NAME##1(xm, ldx, r, om, ldo, K, b); break;                                          \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    void FN(const float *x, int64_t ldx, const WT *w, const float *bias, float *out, int64_t ldo, int64_t M,    \
            int64_t N, int64_t K, int threads) {                                                                 \
        rm_task t = {x, ldx, w, bias, out, ldo, M, N, K, chunk_size(N, threads, 16, 1), NULL};                   \
        ft_parallel(threads, (N + t.per - 1) / t.per, NAME##chunk, &t);                                          \
    }

ROWS(rows, float, f32x8, 1)
ROWS(rows, float, f32x8, 2)
ROWS(rows, float, f32x8, 3)
ROWS(rows, float, f32x8, 4)
LINEAR_RM(ft_linear_rm, float, rows)

/* ---- bfloat16 weights, row-major [N, K] (--dtype bfloat16: the checkpoint's layout; --quantization bf16) ----

   ft_linear_rm_bf16: the same dot products as ft_linear_rm, the weights read as bf16 (half the bytes) and widened
   exactly to float32 (a bf16 is the top half of a float32) before the same multiply-adds; x and out are float32,
   any float32 values: float32 arithmetic on every CPU (--quantization bf16's promise). A bf16 model's caller widens
   its few rows and rounds the outputs back to bf16, as torch's bf16 product rounds its float32 sums; it calls
   ft_linear_rm_bf16_bf16x instead, which may take the dot-product loop below. Every output is summed in the same
   order whatever M and the thread count. The Python side checks K % 16 == 0. */

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

ROWS(rows_bf16_, uint16_t, bf16x8, 1)
ROWS(rows_bf16_, uint16_t, bf16x8, 2)
ROWS(rows_bf16_, uint16_t, bf16x8, 3)
ROWS(rows_bf16_, uint16_t, bf16x8, 4)
LINEAR_RM(ft_linear_rm_bf16, uint16_t, rows_bf16_)

/* ---- bfloat16 weights with AVX512-BF16 dot products (vdpbf16ps), where the CPU has them ----

   ft_linear_rm_bf16_bf16x takes this path on CPUs with AVX512-BF16 when K % 32 == 0, else ft_linear_rm_bf16. The
   rows of x are taken as bf16 (they must hold bf16 values: the activations of a bf16 model, widened; anything else
   would be rounded to nearest even first, which is why float32 activations never come here), packed once per
   call. Each weight row is read once, in one sequential stream,
   and dotted with up to 16 rows of x while in L1: one 16-lane float32 accumulator per row of x, 32 products an
   instruction, k in order (lane l sums k = 32 j + 2 l and 2 l + 1 over j; vdpbf16ps treats denormal inputs as
   zero and rounds to nearest even), then one fixed tree over the lanes (l with l + 8, then + 4, + 2, + 1).
   Several outputs' trees run in one pass of shuffles and adds (red8, red16), each output's own additions the same
   as red1's, so an output (m, n) is the same bits whatever M, the rows beside it and the thread count. One weight
   row at a time, not a register tile of several: the hardware prefetcher keeps up with one sequential stream, not
   with several interleaved (the figures:
   docs/runs/notes/2026-12-03-code-comment-figures.md#left-in-cpu_linearc-until-2026-12-05). */
#define DPBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) /* a subset: inlined by DPBF16 ones */
#define DP_INLINE __attribute__((always_inline)) static inline
#define DP_ROWS 16 /* rows of x per pass over a weight row */
/* passes of at least DP_PF_ROWS rows prefetch the weight row DP_PF rows ahead: they compute long enough per row for
   the hardware prefetcher to fall behind; fewer rows leave it to the hardware */
#define DP_PF 2
#define DP_PF_ROWS 5

AVX512 DP_INLINE __m512 pair8(__m512 x, __m512 y) { /* lanes 0-7: x_l + x_l+8; lanes 8-15: the same of y */
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
}
AVX512 DP_INLINE __m512 pair4(__m512 x, __m512 y) { /* blocks of 4: x.lo, x.hi, y.lo, y.hi, each l + l+4 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
AVX512 DP_INLINE __m512 pair2(__m512 x, __m512 y) { /* each block: x_0 + x_2, x_1 + x_3, y_0 + y_2, y_1 + y_3 */
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
}
AVX512 DP_INLINE __m512 pair1(__m512 x, __m512 y) { /* each block: x_0 + x_1, x_2 + x_3, y_0 + y_1, y_2 + y_3 */
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
AVX512 DP_INLINE float red1(__m512 v) { return _mm512_cvtss_f32(pair1(pair2(pair4(pair8(v, v), v), v), v)); }
static const int RED8_LANE[8] = {0, 1, 8, 9, 4, 5, 12, 13}; /* vector i's sum: in this lane */
static const int RED16_LANE[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
AVX512 DP_INLINE __m512 red8(const __m512 *v) { /* the sums of 8 vectors (RED8_LANE says where) */
    __m512 b0 = pair4(pair8(v[0], v[4]), pair8(v[2], v[6])), b1 = pair4(pair8(v[1], v[5]), pair8(v[3], v[7]));
    __m512 c = pair2(b0, b1);
    return pair1(c, c);
}
AVX512 DP_INLINE __m512 red16(const __m512 *v) { /* the sums of 16 vectors (RED16_LANE says where) */
    __m512 b[4];
    for (int j = 0; j < 4; j++) b[j] = pair4(pair8(v[j], v[j + 8]), pair8(v[j + 4], v[j + 12]));
    return pair1(pair2(b[0], b[2]), pair2(b[1], b[3]));
}

/* MR rows of xb dotted with one weight row r: out[i * ldo] = sum + b. xb holds the rows in chunks of 32 k,
   interleaved: chunk j of row i at xb[(j * MR + i) * 32] (one pointer and constant offsets: 16 rows' addresses
   would not fit the general registers) */
#define DP_PASS(MR)                                                                                              \
    DPBF16 static void dp_pass_##MR(const uint16_t *xb, int64_t K, const uint16_t *r, float *o, int64_t ldo,     \
                                    float b) {                                                                   \
        __m512 acc[MR > 8 ? 16 : MR > 1 ? 8 : 1];                                                                \
        _Pragma("GCC unroll 16") for (int i = 0; i < (MR > 8 ? 16 : MR > 1 ? 8 : 1); i++) acc[i] =               \
            _mm512_setzero_ps();                                                                                 \
        for (int64_t k = 0; k < K; k += 32, xb += MR * 32) {                                                     \
            __m512bh wv = (__m512bh)_mm512_loadu_si512(r + k);                                                   \
            if (MR >= DP_PF_ROWS) _mm_prefetch((const char *)(r + DP_PF * K + k), _MM_HINT_T0);        \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) acc[i] =                                       \
                _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(xb + i * 32), wv);                         \
        }                                                                                                        \
        float s[16];                                                                                             \
        if (MR == 1) {                                                                                           \
            o[0] = red1(acc[0]) + b;                                                                             \
        } else if (MR <= 8) {                                                                                    \
            _mm512_storeu_ps(s, red8(acc));                                                                      \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) o[i * ldo] = s[RED8_LANE[i]] + b;              \
        } else {                                                                                                 \
            _mm512_storeu_ps(s, red16(acc));                                                                     \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) o[i * ldo] = s[RED16_LANE[i]] + b;             \
        }                                                                                                        \
    }
DP_PASS(1) DP_PASS(2) DP_PASS(3) DP_PASS(4) DP_PASS(5) DP_PASS(6) DP_PASS(7) DP_PASS(8)
DP_PASS(9) DP_PASS(10) DP_PASS(11) DP_PASS(12) DP_PASS(13) DP_PASS(14) DP_PASS(15) DP_PASS(16)
typedef void (*dp_pass_fn)(const uint16_t *, int64_t, const uint16_t *, float *, int64_t, float);
static const dp_pass_fn DP_PASSES[DP_ROWS + 1] = {
    0, dp_pass_1, dp_pass_2, dp_pass_3, dp_pass_4, dp_pass_5, dp_pass_6, dp_pass_7, dp_pass_8,
    dp_pass_9, dp_pass_10, dp_pass_11, dp_pass_12, dp_pass_13, dp_pass_14, dp_pass_15, dp_pass_16};

DPBF16 static void dp_chunk(void *ctx, int64_t i) {
    const rm_task *t = ctx;
    int64_t M = t->M, K = t->K, n1 = (i + 1) * t->per < t->N ? (i + 1) * t->per : t->N;
    for (int64_t n = i * t->per; n < n1; n++) {
        float b = t->bias ? t->bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += DP_ROWS) {
            int64_t mr = M - m0 < DP_ROWS ? M - m0 : DP_ROWS;
            DP_PASSES[mr](t->xb + m0 * K, K, (const uint16_t *)t->w + n * K, t->out + m0 * t->ldo + n, t->ldo, b);
        }
    }
}

DPBF16 static void linear_rm_bf16_dp(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *out,
                                     int64_t ldo, int64_t M, int64_t N, int64_t K, int threads, uint16_t *xb) {
    for (int64_t m = 0; m < M; m++) { /* pass p's rows (DP_ROWS each, the last fewer) interleaved as DP_PASS reads */
        int64_t m0 = m / DP_ROWS * DP_ROWS, mr = M - m0 < DP_ROWS ? M - m0 : DP_ROWS;
        for (int64_t k = 0; k < K; k += 32)
            _mm512_storeu_si512(xb + m0 * K + (k / 32 * mr + m - m0) * 32,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + k + 16),
                                                             _mm512_loadu_ps(x + m * ldx + k)));
    }
    rm_task t = {x, ldx, w, bias, out, ldo, M, N, K, chunk_size(N, threads, 16, 1), xb};
    ft_parallel(threads, (N + t.per - 1) / t.per, dp_chunk, &t);
}

int ft_bf16_dp(void) { return avx512_bf16_cpu; } /* ft_linear_rm_bf16_bf16x's loop where K % 32 == 0 (the log) */

/* x: rows holding bf16 values (a bf16 model's activations, widened to float32) */
void ft_linear_rm_bf16_bf16x(const float *x, int64_t ldx, const uint16_t *w, const float *bias, float *out,
                             int64_t ldo, int64_t M, int64_t N, int64_t K, int threads) {
    uint16_t *xb = avx512_bf16_cpu && K % 32 == 0 ? malloc((size_t)(M * K) * sizeof(uint16_t)) : NULL;
    if (xb == NULL) {
        ft_linear_rm_bf16(x, ldx, w, bias, out, ldo, M, N, K, threads);
        return;
    }
    linear_rm_bf16_dp(x, ldx, w, bias, out, ldo, M, N, K, threads, xb);
    free(xb);
}

/* ---- int8 weights (--quantization int8; loading/quant.py) ----

   Weights are int8, input-major ([K, N], the layout torch._int_mm takes), one float scale per output column n;
   each input row is quantized to int8 with its own scale, and out = (float)(xq @ wq) * xscale[m] * wscale[n]
   (+ bias[n]), in that order. The int32 sums are exact, so any correct product gives the same numbers:
   torch._int_mm for prefill where oneDNN multiplies int8 exactly (VNNI or AMX CPUs: loading/quant.py decides),
   ft_int8_rows otherwise and for the few rows of a decode step (a quarter of float32's bytes).
   - ft_quant_rows: each row of x to int8 with its own symmetric scale (max |x| / 127; q = x * (1 / scale)
     rounded half to even); a row holding a NaN or an infinity gets scale NaN and zeros (its outputs are NaN), a row
     whose max |x| is under 127 x FLT_MIN gets scale 1 (zeros: its outputs are the bias).
   - ft_dequant: the scaling above, after torch._int_mm.
   - ft_int8_rows / ft_int8_linear: the products and the scaling, from int8 rows / from float rows.
   All have torch twins in loading/quant.py with the same arithmetic (bitwise the same results, for machines
   without the kernels). A row's outputs depend on that row alone, whichever path and whatever shares the step. */

static inline int32_t int16_pair(int8_t lo, int8_t hi) {
    return (int32_t)((uint32_t)(uint16_t)(int16_t)lo | ((uint32_t)(uint16_t)(int16_t)hi << 16));
}

/* acc[m, n] = sum_k xq[m, k] * wt[k, n] in int32 (exact, so in any order), outputs n0 <= n < n1. The weights of a
   block of 8 k are widened to int16 once, interleaved by pairs of k, and every row's pairs multiply them with
   vpmaddwd (16 products a instruction, summed in pairs into 32 bits). acc is the caller's float output, reused. */
static void int8_rows_range(const int8_t *xq, const int8_t *wt, int32_t *acc, int64_t ldo, int64_t M, int64_t N,
                            int64_t K, int64_t n0, int64_t n1) {
    int32_t xp[MAX_INT8_ROWS][4];
    for (int64_t m = 0; m < M; m++) memset(acc + m * ldo + n0, 0, (size_t)(n1 - n0) * sizeof(int32_t));
    for (int64_t k = 0; k < K; k += 8) {
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) xp[m][j] = int16_pair(xq[m * K + k + 2 * j], xq[m * K + k + 2 * j + 1]);
        const int8_t *w = wt + k * N;
        for (int64_t n = n0; n < n1; n += 8) {
            __m256i wp[4];
            for (int j = 0; j < 4; j++) {
                __m128i a = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + (2 * j) * N + n)));
                __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + (2 * j + 1) * N + n)));
                wp[j] = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
            }
            for (int64_t m = 0; m < M; m++) {
                __m256i s = _mm256_madd_epi16(_mm256_set1_epi32(xp[m][0]), wp[0]);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_set1_epi32(xp[m][1]), wp[1]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_set1_epi32(xp[m][2]), wp[2]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_set1_epi32(xp[m][3]), wp[3]));
                __m256i *o = (__m256i *)(acc + m * ldo + n);
                _mm256_storeu_si256(o, _mm256_add_epi32(_mm256_loadu_si256(o), s));
            }
        }
    }
}

/* The 8 vectors int8_rows_range_x32 builds from 8 k x 32 columns of a [K, N] weight (4 per half of the 8 k, each
   32-bit lane one column's 4 consecutive k). */
static inline void x32_interleave(const int8_t *w, int64_t N, __m256i u[8]) {
    for (int h = 0; h < 2; h++) {
        const int8_t *r = w + 4 * h * N;
        __m256i r0 = _mm256_loadu_si256((const __m256i *)r);
        __m256i r1 = _mm256_loadu_si256((const __m256i *)(r + N));
        __m256i r2 = _mm256_loadu_si256((const __m256i *)(r + 2 * N));
        __m256i r3 = _mm256_loadu_si256((const __m256i *)(r + 3 * N));
        __m256i t0 = _mm256_unpacklo_epi8(r0, r1), t1 = _mm256_unpackhi_epi8(r0, r1);
        __m256i t2 = _mm256_unpacklo_epi8(r2, r3), t3 = _mm256_unpackhi_epi8(r2, r3);
        u[4 * h] = _mm256_unpacklo_epi16(t0, t2);
        u[4 * h + 1] = _mm256_unpackhi_epi16(t0, t2);
        u[4 * h + 2] = _mm256_unpacklo_epi16(t1, t3);
        u[4 * h + 3] = _mm256_unpackhi_epi16(t1, t3);
    }
}

/* The same sums as int8_rows_range, 32 columns and 8 k a pass, for inputs and weights in [-127, 127] (what both
   quantizers give; -128 never occurs): each 32-byte load of 4 rows of weights is interleaved so every 32-bit lane
   holds one column's 4 consecutive k, and a row's 4 inputs (broadcast) multiply it with vpmaddubsw (32 products a
   instruction, summed in pairs into 16 bits: |x| unsigned against w carrying x's sign, at most 2 x 127 x 127, so
   never saturating) then vpmaddwd against ones (pairs into 32 bits). No weight is widened to 16 bits first: about a
   third of the old loop's instructions at one row. The sums sit in acc permuted within each 32 columns (vector i
   of a block: columns 4i..4i+3 and 16+4i..16+4i+3); x32_unpermute puts them back. N % 32 == 0, the thread's columns
   in whole blocks of 32. */
static void int8_rows_range_x32(const int8_t *xq, const int8_t *wt, int32_t *acc, int64_t ldo, int64_t M, int64_t N,
                                int64_t K, int64_t n0, int64_t n1) {
    __m256i xs[MAX_INT8_ROWS][2], xa[MAX_INT8_ROWS][2];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m = 0; m < M; m++) memset(acc + m * ldo + n0, 0, (size_t)(n1 - n0) * sizeof(int32_t));
    for (int64_t k = 0; k < K; k += 8) {
        for (int64_t m = 0; m < M; m++)
            for (int h = 0; h < 2; h++) {
                int32_t v;
                memcpy(&v, xq + m * K + k + 4 * h, 4);
                xs[m][h] = _mm256_set1_epi32(v);
                xa[m][h] = _mm256_abs_epi8(xs[m][h]);
            }
        const int8_t *w = wt + k * N;
        for (int64_t n = n0; n < n1; n += 32) {
            __m256i u[8];
            x32_interleave(w + n, N, u);
            for (int64_t m = 0; m < M; m++) {
                __m256i *o = (__m256i *)(acc + m * ldo + n);
                for (int i = 0; i < 4; i++) {
                    __m256i s = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(xa[m][0], _mm256_sign_epi8(u[i], xs[m][0])), ones);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(xa[m][1], _mm256_sign_epi8(u[4 + i], xs[m][1])), ones));
                    _mm256_storeu_si256(o + i, _mm256_add_epi32(_mm256_loadu_si256(o + i), s));
                }
            }
        }
    }
}

/* int8_rows_range_x32's sums (permuted the same way) from a blocked weight (cpu_linear.py's int8_pack: for each 32
   columns, for each 8 k, the 256 bytes x32_interleave gives, so 32 columns are one sequential run of K x 32 bytes):
   each 32 columns in turn, two rows at a time, their sums held in registers over all K while the block streams in
   order, no weight shuffled at run time (faster than interleaving at run time at 1-16 rows: the figures in
   docs/runs/notes/2026-12-03-code-comment-figures.md#left-in-cpu_linearc-until-2026-12-05).
   The magnitudes vpmaddubsw takes unsigned, |x|, are taken from the broadcast inputs in the loop, not a copy. */
static inline __m256i bcast4(const int8_t *p) { /* 4 int8 in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* a += the 32 columns' sums of 8 k of one row: xs its 4 + 4 inputs, xa their magnitudes, w0 / w1 the weights */
#define FT_I8_BLK_STEP(a, xs0, xs1, xa0, xa1, w0, w1)                                                         \
    a = _mm256_add_epi32(a, _mm256_add_epi32(                                                                       \
        _mm256_madd_epi16(_mm256_maddubs_epi16(xa0, _mm256_sign_epi8(w0, xs0)), ones),                              \
        _mm256_madd_epi16(_mm256_maddubs_epi16(xa1, _mm256_sign_epi8(w1, xs1)), ones)))

static void int8_rows_range_blk(const int8_t *xq, const int8_t *blk, int32_t *acc, int64_t ldo, int64_t M, int64_t K,
                                int64_t n0, int64_t n1) {
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t kblocks = K / 8;
    for (int64_t n = n0; n < n1; n += 32) {
        const __m256i *wb = (const __m256i *)(blk + (n / 32) * kblocks * 256);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) { /* two rows share each weight load */
            const int8_t *sa = xq + m * K, *sb = sa + K;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t kb = 0; kb < kblocks; kb++) {
                const __m256i *w = wb + kb * 8;
                __m256i xs0 = bcast4(sa + 8 * kb), xs1 = bcast4(sa + 8 * kb + 4);
                __m256i xa0 = _mm256_abs_epi8(xs0), xa1 = _mm256_abs_epi8(xs1);
                __m256i ys0 = bcast4(sb + 8 * kb), ys1 = bcast4(sb + 8 * kb + 4);
                __m256i ya0 = _mm256_abs_epi8(ys0), ya1 = _mm256_abs_epi8(ys1);
#define FT_I8_BLK_PAIR(i, a, b)                                                                                      \
    {                                                                                                                \
        __m256i w0 = _mm256_loadu_si256(w + i), w1 = _mm256_loadu_si256(w + 4 + i);                                 \
        FT_I8_BLK_STEP(a, xs0, xs1, xa0, xa1, w0, w1);                                                        \
        FT_I8_BLK_STEP(b, ys0, ys1, ya0, ya1, w0, w1);                                                        \
    }
                FT_I8_BLK_PAIR(0, a0, b0)
                FT_I8_BLK_PAIR(1, a1, b1)
                FT_I8_BLK_PAIR(2, a2, b2)
                FT_I8_BLK_PAIR(3, a3, b3)
#undef FT_I8_BLK_PAIR
            }
            __m256i *o = (__m256i *)(acc + m * ldo + n), *p = (__m256i *)(acc + (m + 1) * ldo + n);
            _mm256_storeu_si256(o, a0), _mm256_storeu_si256(o + 1, a1);
            _mm256_storeu_si256(o + 2, a2), _mm256_storeu_si256(o + 3, a3);
            _mm256_storeu_si256(p, b0), _mm256_storeu_si256(p + 1, b1);
            _mm256_storeu_si256(p + 2, b2), _mm256_storeu_si256(p + 3, b3);
        }
        for (; m < M; m++) {
            const int8_t *sa = xq + m * K;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t kb = 0; kb < kblocks; kb++) {
                const __m256i *w = wb + kb * 8;
                __m256i xs0 = bcast4(sa + 8 * kb), xs1 = bcast4(sa + 8 * kb + 4);
                __m256i xa0 = _mm256_abs_epi8(xs0), xa1 = _mm256_abs_epi8(xs1);
#define FT_I8_BLK_ONE(i, a) FT_I8_BLK_STEP(a, xs0, xs1, xa0, xa1, _mm256_loadu_si256(w + i), \
                                           _mm256_loadu_si256(w + 4 + i));
                FT_I8_BLK_ONE(0, a0)
                FT_I8_BLK_ONE(1, a1)
                FT_I8_BLK_ONE(2, a2)
                FT_I8_BLK_ONE(3, a3)
#undef FT_I8_BLK_ONE
            }
            __m256i *o = (__m256i *)(acc + m * ldo + n);
            _mm256_storeu_si256(o, a0), _mm256_storeu_si256(o + 1, a1);
            _mm256_storeu_si256(o + 2, a2), _mm256_storeu_si256(o + 3, a3);
        }
    }
}
#undef FT_I8_BLK_STEP

/* int8_rows_range_x32's sums back in column order, in place (4 lane swaps per 32 columns a row) */
static void x32_unpermute(int32_t *acc, int64_t ldo, int64_t M, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n += 32) {
            __m256i *a = (__m256i *)(acc + m * ldo + n);
            __m256i p0 = _mm256_loadu_si256(a), p1 = _mm256_loadu_si256(a + 1);
            __m256i p2 = _mm256_loadu_si256(a + 2), p3 = _mm256_loadu_si256(a + 3);
            _mm256_storeu_si256(a, _mm256_permute2x128_si256(p0, p1, 0x20));
            _mm256_storeu_si256(a + 1, _mm256_permute2x128_si256(p2, p3, 0x20));
            _mm256_storeu_si256(a + 2, _mm256_permute2x128_si256(p0, p1, 0x31));
            _mm256_storeu_si256(a + 3, _mm256_permute2x128_si256(p2, p3, 0x31));
        }
}

/* The same sums with AVX-512 VNNI (vpdpwssd: 32 products summed into 16 lanes of 32 bits, one instruction), 16
   columns and 16 k a pass; K % 16 == 0, N % 16 == 0 and the thread's columns in whole vectors of 16. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void int8_rows_range_vnni(const int8_t *xq, const int8_t *wt, int32_t *acc, int64_t ldo, int64_t M,
                                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
    int32_t xp[MAX_INT8_ROWS][8];
    for (int64_t m = 0; m < M; m++) memset(acc + m * ldo + n0, 0, (size_t)(n1 - n0) * sizeof(int32_t));
    for (int64_t k = 0; k < K; k += 16) {
        for (int64_t m = 0; m < M; m++)
            for (int j = 0; j < 8; j++) xp[m][j] = int16_pair(xq[m * K + k + 2 * j], xq[m * K + k + 2 * j + 1]);
        const int8_t *w = wt + k * N;
        for (int64_t n = n0; n < n1; n += 16) {
            __m512i wp[8];
            for (int j = 0; j < 8; j++) {
                __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (2 * j) * N + n)));
                __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + (2 * j + 1) * N + n)));
                /* 16 pairs (k, k+1), columns in the order 0-3, 8-11, 4-7, 12-15 (unpack works within 128-bit
                   lanes); the sums stay in that order until vnni_finish puts them back */
                wp[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(a, b)),
                                           _mm256_unpackhi_epi16(a, b), 1);
            }
            for (int64_t m = 0; m < M; m++) {
                int32_t *o = acc + m * ldo + n;
                __m512i s = _mm512_loadu_si512(o);
                for (int j = 0; j < 8; j++) s = _mm512_dpwssd_epi32(s, _mm512_set1_epi32(xp[m][j]), wp[j]);
                _mm512_storeu_si512(o, s);
            }
        }
    }
}

/* out = (float)acc * xscale[m] * wscale[n] (+ bias[n]) for the VNNI loop's sums, columns put back in order */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void vnni_finish(const int32_t *acc, const float *xscale, const float *wscale, const float *bias, float *out,
                        int64_t M, int64_t N, int64_t n0, int64_t n1) {
    const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    for (int64_t m = 0; m < M; m++) {
        __m512 sr = _mm512_set1_ps(xscale[m]);
        for (int64_t n = n0; n < n1; n += 16) {
            __m512i a = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(acc + m * N + n));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), sr), _mm512_loadu_ps(wscale + n));
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n));
            _mm512_storeu_ps(out + m * N + n, v);
        }
    }
}


typedef struct { /* int8_rows_block's chunks: outputs [i per, (i + 1) per) */
    const int8_t *xq, *wt;
    const float *xscale, *wscale, *bias;
    float *out;
    int64_t M, N, K, per;
    int vnni, blocked; /* blocked: wt is cpu_linear.py's int8_pack blocks */
} i8_task;

static void i8_chunk(void *ctx, int64_t i) {
    const i8_task *t = ctx;
    int64_t M = t->M, N = t->N, n0 = i * t->per, n1 = n0 + t->per < N ? n0 + t->per : N;
    int32_t *acc = (int32_t *)t->out; /* int32 sums in the output's own memory, then turned into floats in place */
    if (n0 >= n1) return;
    if (t->vnni) {
        int8_rows_range_vnni(t->xq, t->wt, acc, N, M, N, t->K, n0, n1);
        vnni_finish(acc, t->xscale, t->wscale, t->bias, t->out, M, N, n0, n1);
        return;
    }
    if (t->blocked) {
        int8_rows_range_blk(t->xq, t->wt, acc, N, M, t->K, n0, n1);
        x32_unpermute(acc, N, M, n0, n1);
    } else if (N % 32 == 0) { /* chunks in whole blocks of 32 (int8_rows_block) */
        int8_rows_range_x32(t->xq, t->wt, acc, N, M, N, t->K, n0, n1);
        x32_unpermute(acc, N, M, n0, n1);
    } else {
        int8_rows_range(t->xq, t->wt, acc, N, M, N, t->K, n0, n1);
    }
    for (int64_t m = 0; m < M; m++) {
        __m256 sr = _mm256_set1_ps(t->xscale[m]);
        for (int64_t n = n0; n < n1; n += 8) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + m * N + n))), sr),
                _mm256_loadu_ps(t->wscale + n));
            if (t->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(t->bias + n));
            _mm256_storeu_ps(t->out + m * N + n, v);
        }
    }
}

/* out [M, N] float32 = (float)(xq @ wt) * xscale[m] * wscale[n] (+ bias[n]) for M <= MAX_INT8_ROWS rows; threads
   as ft_parallel's, one chunk of whole vectors of outputs per thread (not chunk_size's several: each chunk packs the
   rows' input pairs again, which made more chunks slower:
   docs/runs/notes/2026-12-03-code-comment-figures.md#left-in-cpu_linearc-until-2026-12-05) */
static void int8_rows_block(const int8_t *xq, const float *xscale, const int8_t *wt, const float *wscale,
                            const float *bias, float *out, int64_t M, int64_t N, int64_t K, int threads,
                            int blocked) {
    int vnni = !blocked && K % 16 == 0 && N % 16 == 0 && vnni_cpu;
    int64_t vec = vnni ? 16 : N % 32 == 0 ? 32 : 8;
    int nt = threads < 0 ? -threads : threads <= 1 ? 1 : threads;
    int64_t per = nt <= 1 ? N : (N / vec + nt - 1) / nt * vec;
    i8_task t = {xq, wt, xscale, wscale, bias, out, M, N, K, per, vnni, blocked};
    ft_parallel(threads, (N + per - 1) / per, i8_chunk, &t);
}

/* The same numbers as torch._int_mm followed by ft_dequant, for any M, in blocks of MAX_INT8_ROWS rows (each
   block reads the weights once: a decode step's few rows stream them; prefill on a CPU where torch._int_mm is not
   exact rereads them from cache). K % 8 == 0 and N % 8 == 0, else every output is NaN. */
static void int8_rows(const int8_t *xq, const float *xscale, const int8_t *wt, const float *wscale, const float *bias,
                      float *out, int64_t M, int64_t N, int64_t K, int threads, int blocked) {
    if (K % 8 || N % 8 || (blocked && N % 32)) {
        for (int64_t i = 0; i < M * N; i++) out[i] = __builtin_nanf("");
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += MAX_INT8_ROWS) {
        int64_t rows = M - m0 < MAX_INT8_ROWS ? M - m0 : MAX_INT8_ROWS;
        int8_rows_block(xq + m0 * K, xscale + m0, wt, wscale, bias, out + m0 * N, rows, N, K, threads, blocked);
    }
}

void ft_int8_rows(const int8_t *xq, const float *xscale, const int8_t *wt, const float *wscale, const float *bias,
                  float *out, int64_t M, int64_t N, int64_t K, int threads) {
    int8_rows(xq, xscale, wt, wscale, bias, out, M, N, K, threads, 0);
}

/* ft_int8_rows with the weight in int8_pack's blocks (N % 32 == 0, else every output is NaN) */
void ft_int8_rows_blk(const int8_t *xq, const float *xscale, const int8_t *blk, const float *wscale, const float *bias,
                      float *out, int64_t M, int64_t N, int64_t K, int threads) {
    int8_rows(xq, xscale, blk, wscale, bias, out, M, N, K, threads, 1);
}

void ft_quant_rows(const float *x, int64_t ldx, int8_t *q, float *scales, int64_t M, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 16)
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * ldx;
        int8_t *o = q + m * K;
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        const __m256 inf = _mm256_set1_ps(__builtin_inff());
        __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 a = _mm256_and_ps(abs_mask, _mm256_loadu_ps(r + k));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ)); /* NaN or infinity */
            mx = _mm256_max_ps(mx, a);
        }
        float lanes[8], amax = 0.f;
        int nonfinite = _mm256_movemask_ps(bad) != 0;
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        for (; k < K; k++) {
            float a = r[k] < 0 ? -r[k] : r[k];
            nonfinite |= !(a < __builtin_inff());
            amax = a > amax ? a : amax;
        }
        if (nonfinite) { /* NaN scale, zeros: the row's outputs are NaN, as a float product's would be */
            scales[m] = __builtin_nanf("");
            memset(o, 0, (size_t)K);
            continue;
        }
        float s = amax / 127.f;
        if (!(s >= __FLT_MIN__)) s = 1.f; /* all zeros, or so small that 1 / s overflows: zeros */
        scales[m] = s;
        float inv = 1.f / s;
        __m256 vinv = _mm256_set1_ps(inv);
        for (k = 0; k + 8 <= K; k += 8) {
            __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vinv)); /* half to even */
            __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
            _mm_storel_epi64((__m128i *)(o + k), _mm_packs_epi16(w16, w16));
        }
        for (; k < K; k++) o[k] = (int8_t)_mm_cvtss_si32(_mm_set_ss(r[k] * inv)); /* the lanes' rounding */
    }
}

void ft_dequant(const int32_t *acc, const float *srow, const float *scol, const float *bias, float *out, int64_t M,
                int64_t N, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 16)
    for (int64_t m = 0; m < M; m++) {
        const int32_t *a = acc + m * N;
        float *o = out + m * N;
        __m256 sr = _mm256_set1_ps(srow[m]);
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a + n))),
                                                   sr), _mm256_loadu_ps(scol + n));
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n));
            _mm256_storeu_ps(o + n, v);
        }
        for (; n < N; n++) o[n] = (float)a[n] * srow[m] * scol[n] + (bias ? bias[n] : 0.f);
    }
}

int ft_int8_vnni(void) { return vnni_cpu; } /* which loop ft_int8_rows takes where the shapes allow (the log) */

/* ft_quant_rows then ft_int8_rows in one call, from float32 rows (a decode step: one call per product). */
static void int8_linear(const float *x, int64_t ldx, const int8_t *wt, const float *wscale, const float *bias,
                        float *out, int64_t M, int64_t N, int64_t K, int threads, int blocked) {
    float *xs = malloc((size_t)M * sizeof(float) + (size_t)(M * K)); /* the scales, then the int8 rows */
    if (!xs) { /* no memory for the quantized rows: NaNs say so rather than wrong numbers */
        for (int64_t i = 0; i < M * N; i++) out[i] = __builtin_nanf("");
        return;
    }
    int8_t *xq = (int8_t *)(xs + M);
    ft_quant_rows(x, ldx, xq, xs, M, K, threads);
    int8_rows(xq, xs, wt, wscale, bias, out, M, N, K, threads, blocked);
    free(xs);
}

void ft_int8_linear(const float *x, int64_t ldx, const int8_t *wt, const float *wscale, const float *bias, float *out,
                    int64_t M, int64_t N, int64_t K, int threads) {
    int8_linear(x, ldx, wt, wscale, bias, out, M, N, K, threads, 0);
}

/* ft_int8_linear with the weight in int8_pack's blocks */
void ft_int8_linear_blk(const float *x, int64_t ldx, const int8_t *blk, const float *wscale, const float *bias,
                        float *out, int64_t M, int64_t N, int64_t K, int threads) {
    int8_linear(x, ldx, blk, wscale, bias, out, M, N, K, threads, 1);
}

/* ---- a whole decode step's decoder layers in one call (firsttoken/loading/fused_decode.py) ----

   A decode step of a few rows spends most of its time outside the products when every op is a separate torch
   call (~1,400 per step for 8 layers). ft_decode_layers runs the decoder layers of Qwen2VLModel (Qwen2,
   Qwen2.5-VL and Qwen3-VL's decoders) for a few decode rows in one call, in the model's activation dtype: bf16
   (every value that is a bf16 tensor on the eager path is rounded to bf16 here, held in float32) or float32 (no
   rounding). Products are this file's few-rows kernels, each layer's in the layout it is stored in (KIND_*): the
   same calls the eager path's FewRowsLinear makes. Per layer and row (R = the rounding to the activation dtype):
     h = R(w_in * R(x * rsqrt(mean(x^2) + eps)))
     qkv = R(h . Wqkv + b)
     q, k = R(q_norm/k_norm) per head (Qwen3), then rotary: R(R(x * cos) + R(roll(x) * sin_rolled))
     k, v -> the paged cache at the row's slot
     a = R(softmax(scale * q . K^T) V)                   (float32; each query head over its KV head, GQA)
     x = R(x + R(a . Wo)); h = R(w_post * R(norm(x)))
     x = R(x + R(R(R(silu(gate)) * up) . Wdown))
   The attention sums in float32 in another order than torch's SDPA (and its exp is a polynomial), the norm's sum
   of squares in another order than torch.sum: outputs may differ from the eager path's by a rounding step; the
   rest is the same arithmetic. The Python side checks the shapes (each kernel's, head_dim % 8 == 0). */

enum { KIND_BF16_RM = 0, KIND_F32_RM = 1, KIND_F32_IM = 2, KIND_I8_IM = 3, KIND_I8_BLK = 4 }; /* a weight's
   dtype and layout: which product (KIND_I8_IM: --quantization int8's [K, N] int8 weight with a float32 scale per
   output; each row of x is quantized with its own scale, as ft_int8_linear; KIND_I8_BLK: the same weight in
   int8_pack's blocks) */

typedef struct {
    const void *in_norm, *post_norm; /* [H], the activation dtype */
    const void *qkv_w;               /* [(nh + 2 nkv) D, H] */
    const float *qkv_b;              /* float32 [(nh + 2 nkv) D] or NULL */
    const void *q_norm, *k_norm;     /* [D] or NULL (Qwen3's per-head norms) */
    const void *o_w;                 /* [H, nh D] */
    const void *gate_up_w;           /* [2 I, H] */
    const void *down_w;              /* [H, I] */
    int32_t qkv_kind, o_kind, gate_up_kind, down_kind;
    const float *qkv_s, *o_s, *gate_up_s, *down_s; /* KIND_I8_IM's and KIND_I8_BLK's scales per output, else NULL */
} ft_layer;

/* bf16: x holds bf16 values (a bf16 model's step); else float32 activations, whose products stay float32
   arithmetic (bf16 weights widened, never x rounded) */
static void product(int32_t kind, const float *x, int64_t ldx, const void *w, const float *scale, const float *bias,
                    float *out, int64_t ldo, int64_t M, int64_t N, int64_t K, int threads, int bf16) {
    if (kind == KIND_I8_IM || kind == KIND_I8_BLK) /* ldo == N at every call below */
        int8_linear(x, ldx, (const int8_t *)w, scale, bias, out, M, N, K, threads, kind == KIND_I8_BLK);
    else if (kind == KIND_BF16_RM && bf16)
        ft_linear_rm_bf16_bf16x(x, ldx, (const uint16_t *)w, bias, out, ldo, M, N, K, threads);
    else if (kind == KIND_BF16_RM)
        ft_linear_rm_bf16(x, ldx, (const uint16_t *)w, bias, out, ldo, M, N, K, threads);
    else if (kind == KIND_F32_RM)
        ft_linear_rm(x, ldx, (const float *)w, bias, out, ldo, M, N, K, threads);
    else
        ft_linear_im(x, ldx, (const float *)w, bias, out, ldo, M, N, K, threads);
}

static inline float bf16_round(float f) { /* torch's float -> bf16 (round to nearest even; NaN -> 0x7fc0) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u = 0x7fc00000u;
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_bits(float rounded) {
    uint32_t u;
    memcpy(&u, &rounded, 4);
    return (uint16_t)(u >> 16);
}

static inline float rnd(float f, int bf16) { return bf16 ? bf16_round(f) : f; }

static inline float elem(const void *p, int64_t i, int bf16) { /* element i of a bf16 or float32 array */
    return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* dst[at .. at + n) of a bf16 or float32 array = src (values already in its dtype) */
static void store(void *dst, int64_t at, const float *src, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[at + i] = bf16_bits(src[i]);
    else
        memcpy((float *)dst + at, src, (size_t)n * sizeof(float));
}

/* 8 elements of a bf16 or float32 array, as float32 */
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* out[i] = R(w[i] * R(x[i] * rsqrt(mean(x^2) + eps))); out may be x */
static void norm_row(const float *x, const void *w, float *out, int64_t n, float eps, int bf16) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        s0 = _mm256_add_ps(s0, _mm256_mul_ps(a, a));
        s1 = _mm256_add_ps(s1, _mm256_mul_ps(b, b));
    }
    float ss = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = rnd(elem(w, i, bf16) * rnd(x[i] * inv, bf16), bf16);
}

/* e^x for 8 floats (Cephes' expf as in avx_mathfun: range reduction by ln 2, a degree-5 polynomial; ~2 ulp),
   inputs clamped to [-88.38, 88.38] */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x), y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* the 8 sums of a[0..7]'s lanes, in order */
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* one row's query heads of KV head h over its seq_len cached keys/values; q [G, D] (activation-dtype values), out
   [G, D] float32 (the caller rounds); kc, vc: bf16 or float32; at[j]: where key j of KV head 0 sits in the cache
   (from the block table, made once per call); scores: G * (seq_len rounded up to 8) floats of scratch. Keys 8 at a
   time (one vector of 8 scores per query head), the softmax in vectors, values two vectors of D at a time for every
   head. */
static void attend_group(const float *q, int64_t G, const void *kc, const void *vc, const int64_t *at,
                         int64_t seq_len, int64_t h, int64_t D, float scale, float *scores, float *out, int bf16) {
    int64_t padded = (seq_len + 7) / 8 * 8;
    float keys[8 * 512]; /* 8 keys widened once, read by every query head */
    for (int64_t j0 = 0; j0 < seq_len; j0 += 8) {
        for (int t = 0; t < 8; t++) { /* past the end: repeat the last key (its scores are dropped below) */
            int64_t row = at[j0 + t < seq_len ? j0 + t : seq_len - 1] + h * D;
            for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(keys + t * D + i, load8(kc, row + i, bf16));
        }
        for (int64_t g = 0; g < G; g++) {
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += 8) {
                __m256 qv = _mm256_loadu_ps(q + g * D + i);
                for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + t * D + i), acc[t]);
            }
            _mm256_storeu_ps(scores + g * padded + j0, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * padded, mx = -INFINITY;
        for (int64_t j = seq_len; j < padded; j++) s[j] = -INFINITY;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int t = 0; t < 8; t++) mx = lanes[t] > mx ? lanes[t] : mx;
        __m256 sum8 = _mm256_setzero_ps(), mxv = _mm256_set1_ps(mx);
        for (int64_t j = 0; j < padded; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
            if (j + 8 > seq_len) /* the padding: exactly zero */
                e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
            _mm256_storeu_ps(s + j, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        __m256 inv = _mm256_set1_ps(1.0f / hsum(sum8));
        for (int64_t j = 0; j < padded; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
    }
    for (int64_t i = 0; i < D; i += 16) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            int64_t ng = G - g0 < 4 ? G - g0 : 4;
            __m256 a[4][2];
            for (int g = 0; g < 4; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
            for (int64_t j = 0; j < seq_len; j++) {
                int64_t v = at[j] + h * D + i;
                __m256 v0 = load8(vc, v, bf16), v1 = D - i > 8 ? load8(vc, v + 8, bf16) : _mm256_setzero_ps();
                for (int g = 0; g < ng; g++) {
                    __m256 p = _mm256_set1_ps(scores[(g0 + g) * padded + j]);
                    a[g][0] = _mm256_fmadd_ps(p, v0, a[g][0]);
                    a[g][1] = _mm256_fmadd_ps(p, v1, a[g][1]);
                }
            }
            for (int g = 0; g < ng; g++) {
                _mm256_storeu_ps(out + (g0 + g) * D + i, a[g][0]);
                if (D - i > 8) _mm256_storeu_ps(out + (g0 + g) * D + i + 8, a[g][1]);
            }
        }
    }
}

/* attend_group with AVX-512 (CPUs with AVX-512F/BW/VL/DQ, D % 64 == 0, any G): the same three
   phases, 16 lanes wide. Scores 16 keys at a time: every key's 16-lane products of q . k (d in chunks of 16, in
   order) reduced by red16's fixed tree, one vector of 16 scores per query head. The softmax 16 lanes at a time (the
   same exp polynomial). Values: each value row widened once and used by every query head of the group (4 vectors of
   16 dims a pass; a dims' sum over j in order, as attend_group's), instead of re-read per 16 dims. Outputs may
   differ from attend_group's by float32 rounding (another summation order for the scores and the softmax's sum). */
AVX512 static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

AVX512 static inline __m512 exp16(__m512 x) { /* exp8's polynomial, 16 lanes */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 z = _mm512_mul_ps(x, x), y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

AVX512 static void attend_group16(const float *q, int64_t G, const void *kc, const void *vc, const int64_t *at,
                                  int64_t seq_len, int64_t h, int64_t D, float scale, float *scores, float *out,
                                  int bf16) {
    int64_t padded = (seq_len + 15) / 16 * 16;
    float keys[16 * 512]; /* 16 keys widened once, read by every query head */
    const __m512i order = _mm512_loadu_si512(RED16_LANE); /* red16's lanes back in key order (an involution) */
    for (int64_t j0 = 0; j0 < seq_len; j0 += 16) {
        for (int t = 0; t < 16; t++) { /* past the end: repeat the last key (its scores are dropped below) */
            int64_t row = at[j0 + t < seq_len ? j0 + t : seq_len - 1] + h * D;
            for (int64_t i = 0; i < D; i += 16) _mm512_storeu_ps(keys + t * D + i, load16(kc, row + i, bf16));
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 acc[16];
            for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D; i += 16) {
                __m512 qv = _mm512_loadu_ps(q + g * D + i);
                for (int t = 0; t < 16; t++) acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + t * D + i), acc[t]);
            }
            __m512 sc = _mm512_permutexvar_ps(order, red16(acc));
            _mm512_storeu_ps(scores + g * padded + j0, _mm512_mul_ps(sc, _mm512_set1_ps(scale)));
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * padded;
        for (int64_t j = seq_len; j < padded; j++) s[j] = -INFINITY;
        __m512 m16 = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + j));
        __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(m16)), sum16 = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += 16) {
            __m512 v = _mm512_loadu_ps(s + j);
            __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                           exp16(_mm512_sub_ps(v, mxv))); /* the padding: exactly zero */
            _mm512_storeu_ps(s + j, e);
            sum16 = _mm512_add_ps(sum16, e);
        }
        __m512 inv = _mm512_set1_ps(1.0f / red1(sum16));
        for (int64_t j = 0; j < padded; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
    }
    for (int64_t i = 0; i < D; i += 64) {
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            int64_t ng = G - g0 < 4 ? G - g0 : 4;
            __m512 a[4][4];
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) a[g][c] = _mm512_setzero_ps();
            const float *p0 = scores + g0 * padded;
            for (int64_t j = 0; j < seq_len; j++) {
                int64_t v = at[j] + h * D + i;
                __m512 v0 = load16(vc, v, bf16), v1 = load16(vc, v + 16, bf16), v2 = load16(vc, v + 32, bf16),
                       v3 = load16(vc, v + 48, bf16);
                for (int g = 0; g < 4; g++) {
                    if (g >= ng) break;
                    __m512 p = _mm512_set1_ps(p0[g * padded + j]);
                    a[g][0] = _mm512_fmadd_ps(p, v0, a[g][0]);
                    a[g][1] = _mm512_fmadd_ps(p, v1, a[g][1]);
                    a[g][2] = _mm512_fmadd_ps(p, v2, a[g][2]);
                    a[g][3] = _mm512_fmadd_ps(p, v3, a[g][3]);
                }
            }
            for (int g = 0; g < ng; g++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(out + (g0 + g) * D + i + 16 * c, a[g][c]);
        }
    }
}

int ft_attention_avx512(void) { return avx512_cpu; } /* which attention loop ft_decode_layers takes (D % 64 == 0) */

/* One row's query heads of KV head h through attend_group16 (wide != 0: needs ft_attention_avx512() and
   D % 64 == 0) or attend_group; for tests. Returns -1 when the loop asked for cannot run here or scratch fails. */
int ft_attend(const float *q, int64_t G, const void *kc, const void *vc, const int64_t *at, int64_t seq_len,
              int64_t h, int64_t D, float scale, float *out, int bf16, int wide) {
    if (seq_len < 1 || D > 512 || D % 8 || (wide && (!avx512_cpu || D % 64))) return -1;
    float *scores = malloc((size_t)(G * ((seq_len + 15) / 16 * 16)) * sizeof(float));
    if (!scores) return -1;
    (wide ? attend_group16 : attend_group)(q, G, kc, vc, at, seq_len, h, D, scale, scores, out, bf16);
    free(scores);
    return 0;
}

/* rotary in place on one head of D values: R(R(x * cos) + R(roll(x, D / 2) * sin_rolled)); cos, sin_rolled at
   element offset t of their tables */
static void rotary_head(float *x, const void *cos, const void *sin_rolled, int64_t t, int64_t D, int bf16) {
    float rolled[512];
    int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) rolled[i] = x[(i + half) % D];
    for (int64_t i = 0; i < D; i++)
        x[i] = rnd(rnd(x[i] * elem(cos, t + i, bf16), bf16) + rnd(rolled[i] * elem(sin_rolled, t + i, bf16), bf16),
                   bf16);
}

static void round_rows(float *x, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_round(x[i]);
}

typedef struct { /* one layer's attention, task t = (row t / nkv, KV head t % nkv) */
    const float *qkv;
    float *att;
    const void *kc, *vc;
    int64_t *const *row_at;
    const int64_t *seq_lens;
    float *scores;
    int64_t nqkv, nh, nkv, G, D, padded;
    float scale;
    int bf16, wide;
} attend_task;

static void attend_one(void *ctx, int64_t t) {
    const attend_task *a = ctx;
    int64_t m = t / a->nkv, kvh = t % a->nkv;
    float *o = a->att + m * a->nh * a->D + kvh * a->G * a->D;
    (a->wide ? attend_group16 : attend_group)(a->qkv + m * a->nqkv + kvh * a->G * a->D, a->G, a->kc, a->vc,
                                              a->row_at[m], a->seq_lens[m], kvh, a->D, a->scale,
                                              a->scores + t * a->G * a->padded, o, a->bf16);
    round_rows(o, a->G * a->D, a->bf16);
}

/* x: [M, H] in the activation dtype (bf16 when bf16 != 0, else float32), the rows' hidden states in, the last
   layer's output out. kv: L pointers to each layer's cache [2, num_blocks, block_size, nkv, D] in the activation
   dtype, V at kv_half elements after K. cos, sin_rolled: [M, D] in the activation dtype. block_tables:
   [M, bt_stride] int32; seq_lens: tokens in each row's sequence with this one; slots: where each row's key/value
   goes. final_norm (or NULL): the model's final norm weight [H]: x out is then the normed rows, and with head_w
   (the lm_head's weight in its stored layout, head_kind) logits [M, vocab] float32 get the lm_head's outputs (bf16:
   rounded to bf16, as the eager lm_head's). Returns 0, or -1 when scratch memory could not be had or the shapes
   are not these loops' (x untouched). */
int ft_decode_layers(const ft_layer *layers, int64_t L, void *const *kv, int64_t kv_half, void *x, int64_t M,
                     int64_t H, int64_t nh, int64_t nkv, int64_t D, int64_t I, float eps, const void *cos,
                     const void *sin_rolled, const int32_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                     const int64_t *slots, int64_t block_size, float scale, int bf16, int threads,
                     const void *final_norm, const void *head_w, int32_t head_kind, const float *head_s, int64_t vocab,
                     float *logits) {
    int64_t nqkv = (nh + 2 * nkv) * D, G = nh / nkv, max_len = 0, total_len = 0;
    if (D > 512 || D % 8 || nh % nkv || M > 64) return -1;
    for (int64_t m = 0; m < M; m++) {
        max_len = seq_lens[m] > max_len ? seq_lens[m] : max_len;
        total_len += seq_lens[m];
    }
    int64_t tasks = M * nkv, padded = (max_len + 15) / 16 * 16; /* scores scratch per query head */
    int wide = avx512_cpu && D % 64 == 0; /* attend_group16 */
    float *buf = malloc((size_t)(M * (H + H + nqkv + nh * D + 2 * I + H) + tasks * G * padded) * sizeof(float));
    int64_t *at = malloc((size_t)total_len * sizeof(int64_t)), *row_at[64];
    if (!buf || !at) {
        free(buf);
        free(at);
        return -1;
    }
    for (int64_t m = 0, n = 0; m < M; n += seq_lens[m], m++) { /* token j of row m: [block, offset] -> elements */
        row_at[m] = at + n;
        const int32_t *table = block_tables + m * bt_stride;
        for (int64_t j = 0; j < seq_lens[m]; j++)
            at[n + j] = ((int64_t)table[j / block_size] * block_size + j % block_size) * nkv * D;
    }
    float *xf = buf, *h = xf + M * H, *qkv = h + M * H, *att = qkv + M * nqkv, *gu = att + M * nh * D,
          *y = gu + M * 2 * I, *scores = y + M * H;
    for (int64_t i = 0; i < M * H; i++) xf[i] = elem(x, i, bf16);
    size_t esize = bf16 ? 2 : 4;
    for (int64_t l = 0; l < L; l++) {
        const ft_layer *p = layers + l;
        char *kc = kv[l], *vc = (char *)kv[l] + kv_half * esize;
        for (int64_t m = 0; m < M; m++) norm_row(xf + m * H, p->in_norm, h + m * H, H, eps, bf16);
        product(p->qkv_kind, h, H, p->qkv_w, p->qkv_s, p->qkv_b, qkv, nqkv, M, nqkv, H, threads, bf16);
        round_rows(qkv, M * nqkv, bf16);
        for (int64_t m = 0; m < M; m++) {
            float *r = qkv + m * nqkv;
            for (int64_t hd = 0; hd < nh + nkv; hd++) {
                float *head = r + hd * D;
                const void *w = hd < nh ? p->q_norm : p->k_norm;
                if (w) norm_row(head, w, head, D, eps, bf16);
                rotary_head(head, cos, sin_rolled, m * D, D, bf16);
            }
            int64_t at_slot = slots[m] * nkv * D; /* the cache's [block_size, nkv, D] blocks, flat */
            store(kc, at_slot, r + nh * D, nkv * D, bf16);
            store(vc, at_slot, r + (nh + nkv) * D, nkv * D, bf16);
        }
        attend_task at_task = {qkv, att, kc, vc, row_at, seq_lens, scores, nqkv, nh, nkv, G, D, padded, scale, bf16,
                               wide};
        ft_parallel(threads, tasks, attend_one, &at_task);
        product(p->o_kind, att, nh * D, p->o_w, p->o_s, NULL, y, H, M, H, nh * D, threads, bf16);
        for (int64_t i = 0; i < M * H; i++) xf[i] = rnd(xf[i] + rnd(y[i], bf16), bf16);
        for (int64_t m = 0; m < M; m++) norm_row(xf + m * H, p->post_norm, h + m * H, H, eps, bf16);
        product(p->gate_up_kind, h, H, p->gate_up_w, p->gate_up_s, NULL, gu, 2 * I, M, 2 * I, H, threads, bf16);
        for (int64_t m = 0; m < M; m++) {
            float *g = gu + m * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++) {
                float a = rnd(g[i], bf16), b = rnd(u[i], bf16);
                g[i] = rnd(rnd(a / (1.0f + expf(-a)), bf16) * b, bf16);
            }
        }
        product(p->down_kind, gu, 2 * I, p->down_w, p->down_s, NULL, y, H, M, H, I, threads, bf16);
        for (int64_t i = 0; i < M * H; i++) xf[i] = rnd(xf[i] + rnd(y[i], bf16), bf16);
    }
    if (final_norm) { /* the model's final norm, then (head_w) its lm_head: the hidden states are the normed rows */
        for (int64_t m = 0; m < M; m++) norm_row(xf + m * H, final_norm, h + m * H, H, eps, bf16);
        memcpy(xf, h, (size_t)(M * H) * sizeof(float));
        if (head_w) {
            product(head_kind, h, H, head_w, head_s, NULL, logits, vocab, M, vocab, H, threads, bf16);
            round_rows(logits, M * vocab, bf16); /* as the eager lm_head's bf16 output, widened by .float() */
        }
    }
    store(x, 0, xf, M * H, bf16);
    free(buf);
    free(at);
    return 0;
}

/* ---- the sampler's top-k and argmax (firsttoken/sampling/sampler.py) ----

   The k largest of x[0..n), largest first, ties in index order (the earlier first; k = 1 is argmax's first
   maximum), into vals/ids; NaNs are never chosen. One pass over x, 8 lanes compared with the current k-th largest at
   a time; the few that pass are inserted into the sorted k (for a vocabulary of 10^5 logits and k <= 64, a few
   hundred insertions at most after the first k). torch's topk and argmax on this path are scalar loops (~2 ns a
   logit on a 2-vCPU EPYC). Returns how many were found (k, or fewer when x holds fewer non-NaN values), -1 for a k
   out of range. */
static void topk_insert(float f, int64_t i, float *vals, int64_t *ids, int64_t have, int64_t k) {
    int64_t p = have < k ? have : k - 1; /* the slot freed at the end (the smallest drops out when full) */
    while (p > 0 && vals[p - 1] < f) { /* strictly: an equal value found earlier stays ahead */
        vals[p] = vals[p - 1];
        ids[p] = ids[p - 1];
        p--;
    }
    vals[p] = f;
    ids[p] = i;
}

int64_t ft_topk(const float *x, int64_t n, int64_t k, float *vals, int64_t *ids) {
    if (k < 1 || k > 4096) return -1;
    int64_t have = 0, i = 0;
    for (; i < n && have < k; i++)
        if (x[i] == x[i]) topk_insert(x[i], i, vals, ids, have++, k);
    if (have < k) return have;
    float thr = vals[k - 1];
    for (; i + 8 <= n; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(thr), _CMP_GT_OQ));
        while (mask) {
            int b = __builtin_ctz((unsigned)mask);
            mask &= mask - 1;
            if (x[i + b] > thr) { /* thr may have risen since the compare */
                topk_insert(x[i + b], i + b, vals, ids, k, k);
                thr = vals[k - 1];
            }
        }
    }
    for (; i < n; i++)
        if (x[i] > thr) {
            topk_insert(x[i], i, vals, ids, k, k);
            thr = vals[k - 1];
        }
    return k;
}

