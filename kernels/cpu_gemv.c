/* bf16 matrix-vector product for decode on CPU (edgekv/kernels/cpu_gemv.py builds and calls it).
 *
 * y[n] = bf16(bias[n] + sum_k W[n, k] * x[k]) for a row-major bf16 weight W [N, K] (a torch Linear's
 * weight as loaded, no second layout), a bf16 vector x [K] and an optional bf16 bias [N]. The products
 * and sums are fp32 (a bf16 value is the top half of an fp32 one: widening is a 16-bit shift); the
 * output is rounded once, to nearest even.
 *
 * One decode token reads every weight once, so the product is bound by memory bandwidth when the kernel
 * keeps up with memory. On an AVX2 CPU torch's bf16 linear converts as it goes and streams ~5-9 GB/s
 * where an fp32 read streams 15-30 (edgekv/model/decode_routes.py); this kernel widens eight weights per
 * instruction and keeps four rows and sixteen columns in flight (eight accumulators). Elsewhere (aarch64,
 * x86 without AVX2) the portable loop below is left to the compiler's vectoriser.
 *
 * threads > 1 splits the rows over that many POSIX threads (created per call: a few tens of
 * microseconds against milliseconds of weights per call at the 3B shape).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EDGEKV_AVX2 1
#else
#define EDGEKV_AVX2 0
#endif

static inline float widen(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t narrow(float f) { /* round to nearest even; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#if EDGEKV_AVX2
static inline __m256 widen8(const uint16_t *p) {
  __m128i h = _mm_loadu_si128((const __m128i *)p);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif

/* fp32 dot products of rows [n0, n1) of W with x into out[n0 .. n1). */
static void rows(const uint16_t *W, const float *x, float *out, int64_t n0, int64_t n1, int64_t K) {
  int64_t n = n0;
#if EDGEKV_AVX2
  const int64_t kv = K - K % 16;
  for (; n + 4 <= n1; n += 4) {
    const uint16_t *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (int64_t k = 0; k < kv; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      a0 = _mm256_fmadd_ps(widen8(w0 + k), x0, a0);
      b0 = _mm256_fmadd_ps(widen8(w0 + k + 8), x1, b0);
      a1 = _mm256_fmadd_ps(widen8(w1 + k), x0, a1);
      b1 = _mm256_fmadd_ps(widen8(w1 + k + 8), x1, b1);
      a2 = _mm256_fmadd_ps(widen8(w2 + k), x0, a2);
      b2 = _mm256_fmadd_ps(widen8(w2 + k + 8), x1, b2);
      a3 = _mm256_fmadd_ps(widen8(w3 + k), x0, a3);
      b3 = _mm256_fmadd_ps(widen8(w3 + k + 8), x1, b3);
    }
    float s0 = hsum(_mm256_add_ps(a0, b0)), s1 = hsum(_mm256_add_ps(a1, b1));
    float s2 = hsum(_mm256_add_ps(a2, b2)), s3 = hsum(_mm256_add_ps(a3, b3));
    for (int64_t k = kv; k < K; k++) {
      s0 += widen(w0[k]) * x[k];
      s1 += widen(w1[k]) * x[k];
      s2 += widen(w2[k]) * x[k];
      s3 += widen(w3[k]) * x[k];
    }
    out[n] = s0;
    out[n + 1] = s1;
    out[n + 2] = s2;
    out[n + 3] = s3;
  }
#endif
  for (; n < n1; n++) {
    const uint16_t *w = W + n * K;
    float lanes[16] = {0};
    const int64_t kv16 = K - K % 16;
    for (int64_t k = 0; k < kv16; k += 16)
      for (int j = 0; j < 16; j++) lanes[j] += widen(w[k + j]) * x[k + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += lanes[j];
    for (int64_t k = kv16; k < K; k++) s += widen(w[k]) * x[k];
    out[n] = s;
  }
}

struct job {
  const uint16_t *W;
  const float *x;
  const uint16_t *bias;
  uint16_t *y;
  int64_t n0, n1, K;
  float *scratch;
};

static void finish(const struct job *j) {
  for (int64_t n = j->n0; n < j->n1; n++) {
    float s = j->scratch[n - j->n0];
    if (j->bias) s += widen(j->bias[n]);
    j->y[n] = narrow(s);
  }
}

static void *run(void *arg) {
  struct job *j = (struct job *)arg;
  /* scratch holds this job's rows only: the fp32 sums before bias and rounding */
  rows(j->W, j->x, j->scratch - j->n0, j->n0, j->n1, j->K);
  finish(j);
  return NULL;
}

/* Returns 0, or -1 when memory could not be had (nothing written then). */
int edgekv_gemv_bf16(const uint16_t *W, const uint16_t *x16, const uint16_t *bias, uint16_t *y, int64_t N,
                     int64_t K, int threads) {
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  if ((int64_t)threads * 64 > N) threads = (int)(N / 64 > 0 ? N / 64 : 1);
  float *x = (float *)malloc((size_t)K * sizeof(float));
  float *scratch = (float *)malloc((size_t)N * sizeof(float));
  if (!x || !scratch) {
    free(x);
    free(scratch);
    return -1;
  }
  for (int64_t k = 0; k < K; k++) x[k] = widen(x16[k]);
  struct job jobs[64];
  pthread_t tids[64];
  int started[64] = {0};
  const int64_t per = ((N + threads - 1) / threads + 3) / 4 * 4; /* rows per thread, a multiple of 4 */
  for (int t = 0; t < threads; t++) {
    int64_t n0 = (int64_t)t * per, n1 = n0 + per < N ? n0 + per : N;
    if (n0 > N) n0 = N;
    jobs[t] = (struct job){W, x, bias, y, n0, n1, K, scratch + n0};
  }
  for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, run, &jobs[t]) == 0;
  run(&jobs[0]);
  for (int t = 1; t < threads; t++) {
    if (started[t])
      pthread_join(tids[t], NULL);
    else
      run(&jobs[t]); /* no thread could be had: do its rows here */
  }
  free(x);
  free(scratch);
  return 0;
}

/* 1 when the AVX2 path was compiled in, 0 for the portable loop. */
int edgekv_gemv_simd(void) { return EDGEKV_AVX2; }
