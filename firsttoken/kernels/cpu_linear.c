/* firsttoken's few-rows float32 linear products for x86 CPUs with AVX2 + FMA (firsttoken/kernels/cpu_linear.py
   builds and loads this file).

   out[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for the few rows of a decode step (M <= 16), in two layouts:
   - ft_linear_im: W stored input-major, wt = W^T as a contiguous [K, N] (the widening layers: q/k/v, gate/up,
     lm_head). Blocks of KB rows of wt are read from memory once, in one sequential sweep, and every row of x
     accumulates its KB products into its output row (in L1/L2), two rows of x per pass over the block.
   - ft_linear_rm: W row-major [N, K] (the narrowing down projection). Rows of W are read one by one, one
     sequential stream, and each is dotted with up to four rows of x while in L1.
   MKL's sgemm has no good path for 2-16 rows on an AVX2 CPU (its time grows almost linearly with the rows); here
   a weight read from memory costs about the same whether 1 or 16 rows of x use it.

   Every output (m, n) is summed the same way whatever M and the thread count (im: k in order, in blocks of KB,
   each block's products summed in order then added to the running sum; rm: two 8-lane partial sums over k % 16,
   then a fixed reduction), so a request's decode products are bitwise the same whichever requests share its
   step. Threads split the outputs n (OpenMP: the runtime torch already loaded, libgomp.so.1). The Python side
   checks K % KB == 0 and N % 8 == 0 (im), K % 16 == 0 (rm). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KB 8

/* ---- input-major: rows of x against a [K, N] weight, outputs n0 <= n < n1 ---- */

static void im_range(const float *x, int64_t ldx, const float *wt, const float *bias, float *out, int64_t ldo,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m++) {
        float *o = out + m * ldo + n0;
        if (bias)
            memcpy(o, bias + n0, (size_t)(n1 - n0) * sizeof(float));
        else
            memset(o, 0, (size_t)(n1 - n0) * sizeof(float));
    }
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

void ft_linear_im(const float *x, int64_t ldx, const float *wt, const float *bias, float *out, int64_t ldo,
                  int64_t M, int64_t N, int64_t K, int threads) {
    if (threads <= 1) {
        im_range(x, ldx, wt, bias, out, ldo, M, N, K, 0, N);
        return;
    }
    int64_t per = (N / 8 + threads - 1) / threads * 8; /* whole vectors per thread */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < threads; t++) {
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) im_range(x, ldx, wt, bias, out, ldo, M, N, K, n0, n1);
    }
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

#define ROWS(MB)                                                                                                 \
    static void rows##MB(const float *x, int64_t ldx, const float *r, float *o, int64_t ldo, int64_t K,        \
                         float b) {                                                                              \
        __m256 a[MB][2];                                                                                         \
        for (int i = 0; i < MB; i++) {                                                                           \
            a[i][0] = _mm256_setzero_ps();                                                                       \
            a[i][1] = _mm256_setzero_ps();                                                                       \
        }                                                                                                        \
        for (int64_t k = 0; k < K; k += 16) {                                                                    \
            __m256 v0 = _mm256_loadu_ps(r + k), v1 = _mm256_loadu_ps(r + k + 8);                                 \
            for (int i = 0; i < MB; i++) {                                                                       \
                a[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), v0, a[i][0]);                        \
                a[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), v1, a[i][1]);                    \
            }                                                                                                    \
        }                                                                                                        \
        for (int i = 0; i < MB; i++) o[i * ldo] = hsum(_mm256_add_ps(a[i][0], a[i][1])) + b;                    \
    }
ROWS(1)
ROWS(2)
ROWS(3)
ROWS(4)

void ft_linear_rm(const float *x, int64_t ldx, const float *w, const float *bias, float *out, int64_t ldo,
                  int64_t M, int64_t N, int64_t K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const float *r = w + n * K;
        float b = bias ? bias[n] : 0.f;
        for (int64_t m = 0; m < M; m += 4) {
            const float *xm = x + m * ldx;
            float *om = out + m * ldo + n;
            switch (M - m < 4 ? M - m : 4) {
                case 4: rows4(xm, ldx, r, om, ldo, K, b); break;
                case 3: rows3(xm, ldx, r, om, ldo, K, b); break;
                case 2: rows2(xm, ldx, r, om, ldo, K, b); break;
                default: rows1(xm, ldx, r, om, ldo, K, b); break;
            }
        }
    }
}
