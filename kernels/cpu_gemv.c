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
 * threads > 1 splits the rows over that many threads of a pool kept for the process (see "The pool"
 * below): one decode token of the 3B model is 252 products, and a thread created per call cost ~0.2 ms a
 * product on the 2-core x86 machine — 50 ms a token, as much as a 2048 -> 256 product takes eight times over.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(EDGEKV_PORTABLE)
#include <immintrin.h>
#define EDGEKV_AVX2 1
#else
#define EDGEKV_AVX2 0
#endif

/* ------------------------------------------------------------------------------------------------------
 * The pool: threads started at the first call that asks for them and kept until the process ends.
 *
 * A call cuts its work into `chunks` and opens a ticket; the calling thread and every worker that sees the
 * ticket open take chunks from one atomic counter until none are left, then the caller closes the ticket
 * and waits only for the workers still inside it. Nobody waits for a worker that was not scheduled: on a
 * machine busy with other work the caller takes every chunk itself (a fixed share per thread would make
 * the call as slow as its last-scheduled thread). A worker joins by counting itself in `active` and then
 * checking the ticket is still the one it saw (the caller closes, then reads `active`: sequentially
 * consistent on both sides, so either the caller waits for it or it sees the ticket closed and leaves
 * without reading the call's description). Between calls a worker spins on the ticket for pool_spin_ns
 * (decode issues its products back to back, tens of microseconds apart), then sleeps on a condition
 * variable; a call always takes the mutex and broadcasts, so a worker going to sleep cannot miss it. The
 * spin follows OMP_WAIT_POLICY as torch's OpenMP threads do: PASSIVE (what every edgekv command sets, to
 * leave a shared machine's cores to others) sleeps at once, anything else spins 200 us. On the 2-core x86
 * machine, 3B int4 decode with two threads, a spinning pool beside torch's default (spinning) OpenMP
 * threads made every attention call ~80x slower (the two spinners took both cores from the threads that
 * had work); with both passive, 5.83 tok/s against 5.87 with the pool spinning. Inside a run of calls a caller
 * marks as one (pool_hold: a decoder layer's products) workers spin whatever the policy.
 *
 * One caller at a time: a second thread calling while the pool is busy runs its chunks itself (the same
 * results: each chunk writes its own outputs, in the same arithmetic). After fork() the child has no
 * workers (POSIX keeps only the forking thread); the pool notices the new pid and starts its own.
 * ------------------------------------------------------------------------------------------------------ */
static int64_t pool_spin_ns = 200000L;

typedef void (*chunk_fn)(void *arg, int64_t chunk);

static struct {
  pthread_mutex_t busy; /* held by the calling thread */
  pthread_mutex_t m;    /* with wake: sleeping workers */
  pthread_cond_t wake;
  atomic_ullong ticket; /* odd: a call is open */
  atomic_llong next;    /* the next chunk to take */
  atomic_int active;    /* workers inside the open call */
  atomic_int hold;      /* > 0: a caller has more calls coming at once (pool_hold): workers spin, not sleep */
  chunk_fn fn;
  void *arg;
  int64_t chunks;
  int workers;
  pid_t pid;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0, 0, 0};

static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void pool_take(chunk_fn fn, void *arg, int64_t chunks) {
  for (int64_t c; (c = atomic_fetch_add(&pool.next, 1)) < chunks;) fn(arg, c);
}

static void *pool_worker(void *unused) {
  (void)unused;
  unsigned long long seen = atomic_load(&pool.ticket); /* a call open now is left to the others */
  for (;;) {
    unsigned long long t = atomic_load(&pool.ticket);
    if (!(t & 1) || t == seen) {
      const int64_t until = now_ns() + pool_spin_ns;
      for (int spins = 0; !(t & 1) || t == seen; spins++) {
        pool_pause();
        t = atomic_load(&pool.ticket);
        if ((spins & 255) == 255 && (!(t & 1) || t == seen) && now_ns() > until && atomic_load(&pool.hold) <= 0) {
          pthread_mutex_lock(&pool.m);
          while (t = atomic_load(&pool.ticket), !(t & 1) || t == seen) pthread_cond_wait(&pool.wake, &pool.m);
          pthread_mutex_unlock(&pool.m);
        }
      }
    }
    seen = t;
    atomic_fetch_add(&pool.active, 1);
    if (atomic_load(&pool.ticket) == t) pool_take(pool.fn, pool.arg, pool.chunks);
    atomic_fetch_sub(&pool.active, 1);
  }
  return NULL;
}

/* Starts workers up to `want` (called with pool.busy held). */
static void pool_grow(int want) {
  if (pool.pid != getpid()) { /* first use, or a forked child: the parent's workers are not here, and one of
                                 them may have held the mutex at the fork */
    pthread_mutex_init(&pool.m, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = 0;
    pool.pid = getpid();
    const char *policy = getenv("OMP_WAIT_POLICY"); /* as torch's OpenMP threads wait (edgekv/threads.py) */
    pool_spin_ns = policy && (policy[0] == 'P' || policy[0] == 'p') ? 0 : 200000L;
  }
  while (pool.workers < want) {
    pthread_t tid;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    const int failed = pthread_create(&tid, &attr, pool_worker, NULL);
    pthread_attr_destroy(&attr);
    if (failed) break; /* fewer threads: the chunks are shared by those there are */
    pool.workers++;
  }
}

/* Runs fn(arg, 0 .. chunks-1) on up to `threads` threads (the caller's among them); returns when all have. */
static void pool_run(chunk_fn fn, void *arg, int64_t chunks, int threads) {
  if (threads > 1 && chunks > 1 && pthread_mutex_trylock(&pool.busy) == 0) {
    pool_grow(threads - 1);
    pool.fn = fn;
    pool.arg = arg;
    pool.chunks = chunks;
    atomic_store(&pool.next, 0);
    pthread_mutex_lock(&pool.m);
    const unsigned long long t = atomic_load(&pool.ticket) + 1; /* odd: open */
    atomic_store(&pool.ticket, t);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.m);
    pool_take(fn, arg, chunks);
    atomic_store(&pool.ticket, t + 1); /* closed */
    for (int spins = 0; atomic_load(&pool.active) > 0; spins++) {
      pool_pause();
      if ((spins & 1023) == 1023) sched_yield();
    }
    pthread_mutex_unlock(&pool.busy);
    return;
  }
  for (int64_t c = 0; c < chunks; c++) fn(arg, c);
}

/* Brackets a run of calls issued back to back by one caller (a decoder layer's products, microseconds apart):
 * while held, workers that finish a call spin for the next one instead of sleeping, whatever the wait policy, so
 * only the run's first call pays for waking them. Released, they sleep as the policy says (at once when passive).
 * Holds nest (a count); a forked child starts with none. Only the C layer calls hold, for the ~2 ms of a 3B layer's
 * products, when the machine's other work waits on them anyway. 3B 4-bit decode with two threads on the 2-core x86
 * VM (ms a token, two runs each): the post-attention calls 62.2 / 61.6 held, 64.7 / 66.3 not (POOL_HOLD 0). */
#ifndef POOL_HOLD
#define POOL_HOLD 1 /* 0: every call wakes the workers anew (for measuring what holding saves) */
#endif
static void pool_hold_forked(void) { atomic_store(&pool.hold, 0); } /* the holders are the parent's threads */
static void pool_hold_once(void) { pthread_atfork(NULL, NULL, pool_hold_forked); }
static pthread_once_t pool_hold_init = PTHREAD_ONCE_INIT;
static void pool_hold(int on) {
  if (!POOL_HOLD) return;
  pthread_once(&pool_hold_init, pool_hold_once);
  atomic_fetch_add(&pool.hold, on ? 1 : -1);
}

/* For tests: on 1 holds, 0 releases, -1 only reads; returns the count of holds after. */
int edgekv_pool_hold(int on) {
  if (on >= 0) pool_hold(on);
  return atomic_load(&pool.hold);
}

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
  int64_t N, K, rows; /* rows a chunk, a multiple of 4 */
  float *scratch;     /* [N]: the fp32 sums before bias and rounding */
};

static void run(void *arg, int64_t chunk) {
  const struct job *j = (const struct job *)arg;
  const int64_t n0 = chunk * j->rows, n1 = n0 + j->rows < j->N ? n0 + j->rows : j->N;
  rows(j->W, j->x, j->scratch, n0, n1, j->K);
  for (int64_t n = n0; n < n1; n++) {
    float s = j->scratch[n];
    if (j->bias) s += widen(j->bias[n]);
    j->y[n] = narrow(s);
  }
}

/* Returns 0, or -1 when memory could not be had (nothing written then). */
int edgekv_gemv_bf16(const uint16_t *W, const uint16_t *x16, const uint16_t *bias, uint16_t *y, int64_t N,
                     int64_t K, int threads) {
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  float *x = (float *)malloc((size_t)K * sizeof(float));
  float *scratch = (float *)malloc((size_t)N * sizeof(float));
  if (!x || !scratch) {
    free(x);
    free(scratch);
    return -1;
  }
  for (int64_t k = 0; k < K; k++) x[k] = widen(x16[k]);
  /* chunks of at least 16 rows, four a thread when there are enough rows for that */
  int64_t per = (N + 4 * threads - 1) / (4 * threads);
  per = per < 16 ? 16 : (per + 3) / 4 * 4;
  struct job job = {W, x, bias, y, N, K, per, scratch};
  pool_run(run, &job, (N + per - 1) / per, threads);
  free(x);
  free(scratch);
  return 0;
}

/* 1 when the AVX2 path was compiled in, 0 for the portable loop. */
int edgekv_gemv_simd(void) { return EDGEKV_AVX2; }

/* ------------------------------------------------------------------------------------------------------
 * 4-bit weights (issue 29): y = W x for W stored as 4-bit integers q, per-group zero points z and float16
 * scales s (the AutoAWQ GEMM format, edgekv/model/int4.py): W[n, k] = (q[k][n] - z[g][n]) * s[g][n], g = k / G.
 *
 * Weights are repacked once (edgekv/kernels/cpu_gemv.py: int4_tiles) into tiles of 16 output columns x 4
 * input rows, 32 bytes each, the tiles of one 16-column block consecutive over K:
 *     byte 2c + p of the tile of rows k0..k0+3:  low nibble q[k0 + p][c], high nibble q[k0 + 2 + p][c]
 * so that masking the low (high) nibbles leaves, for every column, the rows (k0, k0 + 1) ((k0 + 2, k0 + 3))
 * side by side: one AVX2 vpmaddubsw multiplies them by two activations and adds the pair.
 *
 * The activations become integers for the products: per group, X_k = round(x_k * 2^(B - E)) with
 * |x_k| < 2^E for the whole group — fixed point against the group's largest value, split into D signed bytes
 * X = d0 + 2^8 d1 (+ 2^16 d2 (+ 2^24 d3)), B = 8 D - 2: D = 4 for fp32 activations (at most 2^-30 of the
 * group's largest |x| per activation, below fp32's own rounding of all but the smallest), 3 for fp16 (2^-22)
 * and 2 for bf16 (2^-14: a group of G values has an rms of at least max / sqrt(G), so against the group's
 * own contribution the error stays near 2^-14 sqrt(G) / sqrt(3), ~1.7e-4 at G = 128, while rounding the
 * weights to bf16 — the same-precision product — costs ~2^-9 / sqrt(3), ~1e-3). The products q * d are
 * exact in 16-bit lanes (|2 * 15 * 128| * 8 < 2^15) for 16 rows, then joined exactly in 32 bits (up to three
 * digits: 16 * 15 * 2^22 < 2^31; four: as the d0 + 2^8 d1 and d2 + 2^8 d3 parts, joined in fp32 with one
 * rounding) and summed over the group in fp32:
 *     y[n] += s[g][n] * 2^(E - B) * (sum_k q[k][n] X_k - z[g][n] sum_k X_k)
 * Converting 4-bit integers to fp32 one by one (shift, mask, convert, fma) measured 0.09-0.13 ns per weight
 * on the 2-core AVX2 machine, no faster than the bf16 kernel above; the integer products with three digits
 * 0.04, with four 0.065 (one L3-resident 2048 x 11008 weight, one thread); every digit costs two vpmaddubsw
 * and two adds per 64 weights, against three operations to unpack them. NEON (aarch64:
 * Jetson's CPU) does the same integer arithmetic with vmull_s8 / vpadalq_s16; other CPUs run the portable
 * loop. All three compute the same integers and the same fp32 operations, so their outputs are equal.
 * ------------------------------------------------------------------------------------------------------ */
#include <math.h>

#if defined(__aarch64__) && !defined(EDGEKV_PORTABLE)
#include <arm_neon.h>
#define EDGEKV_NEON 1
#else
#define EDGEKV_NEON 0
#endif

#define Q4_ROWS_PER_CHUNK 16

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent) {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa) { /* subnormal: normalize */
    exponent = 113;
    while (!(mantissa & 0x400u)) {
      mantissa <<= 1;
      exponent--;
    }
    u = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  } else {
    u = sign;
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

#define Q4_DIGITS 4 /* at most */

#if defined(__GNUC__)
#define Q4_INLINE static inline __attribute__((always_inline))
#else
#define Q4_INLINE static inline
#endif

struct q4_input { /* the activations, prepared once per call */
  uint32_t *pairs;  /* [D][K / 2]: signed bytes (d(X_k), d(X_k+1)) of digit j, the 16 bits written twice */
  float *factor;    /* [K / G]: 2^(E - B) */
  float *xsum;      /* [K / G]: sum_k X_k of the group */
};

/* Group g's activations as digits (the portable way); returns -2 for inf / nan. */
static int q4_prepare_group(const float *x, int64_t K, int64_t G, int digits, struct q4_input *in, int64_t g) {
  const int bits = 8 * digits - 2;
  float top = 0.0f;
  for (int64_t k = g * G; k < (g + 1) * G; k++) {
    const float a = fabsf(x[k]);
    if (!(a <= 3.0e38f)) return -2; /* inf or nan */
    if (a > top) top = a;
  }
  int e = 0;
  if (top > 0.0f) frexpf(top, &e); /* top = m 2^e, 0.5 <= m < 1: every |x| < 2^e */
  in->factor[g] = ldexpf(1.0f, e - bits);
  const double scale = ldexp(1.0, bits - e); /* x * scale is exact in double; lrint rounds it to nearest even */
  int64_t total = 0;
  for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
    int32_t d[2][Q4_DIGITS];
    for (int j = 0; j < 2; j++) {
      int32_t X = (int32_t)lrint((double)x[k + j] * scale); /* |X| <= 2^bits */
      total += X;
      for (int digit = 0; digit < digits - 1; digit++) { /* balanced bytes: -128..127 */
        const int32_t low = ((X + 128) & 255) - 128;
        d[j][digit] = low;
        X = (X - low) / 256;
      }
      d[j][digits - 1] = X; /* |X| <= 64 here */
    }
    for (int digit = 0; digit < digits; digit++) {
      const uint32_t pair = (uint32_t)(uint8_t)(int8_t)d[0][digit] | (uint32_t)(uint8_t)(int8_t)d[1][digit] << 8;
      in->pairs[digit * (K / 2) + k / 2] = pair | pair << 16;
    }
  }
  in->xsum[g] = (float)total;
  return 0;
}

#if EDGEKV_AVX2
/* The same digits eight activations at a time. x * 2^(bits - e) is exact in fp32 as it is in double (a
 * power of two; |x| < 2^e keeps the product below 2^bits), and vcvtps2dq rounds it in the current rounding
 * mode as lrint does, so the integers are equal; a group so small that 2^(bits - e) is not an fp32 number
 * takes the portable way. */
static int q4_prepare_group_avx2(const float *x, int64_t K, int64_t G, int digits, struct q4_input *in, int64_t g) {
  const int bits = 8 * digits - 2;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), finite = _mm256_set1_ps(3.0e38f);
  __m256 high = _mm256_setzero_ps();
  for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude);
    if (_mm256_movemask_ps(_mm256_cmp_ps(a, finite, _CMP_LE_OQ)) != 0xff) return -2; /* inf or nan */
    high = _mm256_max_ps(high, a);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(high), _mm256_extractf128_ps(high, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float top = _mm_cvtss_f32(h);
  int e = 0;
  if (top > 0.0f) frexpf(top, &e);
  if (bits - e > 127) return q4_prepare_group(x, K, G, digits, in, g);
  in->factor[g] = ldexpf(1.0f, e - bits);
  const __m256 scale = _mm256_set1_ps(ldexpf(1.0f, bits - e));
  const __m256i bias = _mm256_set1_epi32(128), byte = _mm256_set1_epi32(255);
  const __m256i gather = _mm256_setr_epi8(0, 4, 0, 4, 8, 12, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 0, 4, 8, 12, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1);
  __m256i total = _mm256_setzero_si256(); /* four 64-bit lanes */
  for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
    __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), scale));
    total = _mm256_add_epi64(total, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(X)),
                                                     _mm256_cvtepi32_epi64(_mm256_extracti128_si256(X, 1))));
    for (int digit = 0; digit < digits; digit++) {
      __m256i d = X;
      if (digit < digits - 1) {
        d = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(X, bias), byte), bias);
        X = _mm256_srai_epi32(_mm256_sub_epi32(X, d), 8);
      }
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(d, gather), 0x08);
      _mm_storeu_si128((__m128i *)(in->pairs + digit * (K / 2) + k / 2), _mm256_castsi256_si128(packed));
    }
  }
  const __m128i t2 = _mm_add_epi64(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  in->xsum[g] = (float)(_mm_cvtsi128_si64(t2) + _mm_extract_epi64(t2, 1));
  return 0;
}
#endif

static int q4_prepare(const float *x, int64_t K, int64_t G, int digits, struct q4_input *in) {
  for (int64_t g = 0; g < K / G; g++) {
#if EDGEKV_AVX2
    const int code = q4_prepare_group_avx2(x, K, G, digits, in, g);
#else
    const int code = q4_prepare_group(x, K, G, digits, in, g);
#endif
    if (code) return code;
  }
  return 0;
}

/* Bytes ahead of the read that the bf16 path asks the cache for, one line in every 64 bytes of each block's
 * tiles: the hardware prefetcher follows two interleaved streams less far than this. One thread over the
 * weights of two 3B layers from memory (a 2048 x 11008 ... 11008 x 2048 mix): 12.9 GB/s without, 15.3 /
 * 15.7 / 15.3 GB/s at 256 / 512 / 1024 bytes (2-core AMD EPYC, best of 15). */
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 512
#endif

#if EDGEKV_AVX2
/* bf16 activations (two digits) on AVX2, `nb` 16-column blocks at a time (1 or 2) sharing the activation
 * broadcasts: the same integers and fp32 operations as q4_block below, fewer instructions. For each
 * chunk of 16 rows the 16-bit sums of digit 0 and digit 1 (one lane per column) are interleaved and
 * joined by one vpmaddwd against (1, 256) into s0 + 256 s1 in 32 bits, exact, for columns 0-3 / 8-11
 * and 4-7 / 12-15; the group's two accumulators go back to column order once per group. */
/* A group's end for one 16-column block, its integer sums in column order: c0 / c1 = sum_k q X_k of columns 0-7 /
 * 8-15 in fp32; y += s 2^(E - B) (sum_k q X_k - z sum_k X_k). */
Q4_INLINE void q4_group_scale(__m256 c0, __m256 c1, const struct q4_input *in, int64_t g, const uint16_t *scales,
                              const uint8_t *zeros, int64_t N, int64_t n, __m256 *y0, __m256 *y1) {
  const __m256 xs = _mm256_set1_ps(in->xsum[g]), f = _mm256_set1_ps(in->factor[g]);
  const uint8_t *z = zeros + g * N + n;
  const uint16_t *sc = scales + g * N + n;
  const __m256 z0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)z)));
  const __m256 z1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + 8))));
  const __m256 s0 = _mm256_mul_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc)));
  const __m256 s1 = _mm256_mul_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 8))));
  *y0 = _mm256_fmadd_ps(s0, _mm256_fnmadd_ps(z0, xs, c0), *y0);
  *y1 = _mm256_fmadd_ps(s1, _mm256_fnmadd_ps(z1, xs, c1), *y1);
}

/* The same for bf16 activations' joined digits: a0 / a1 hold columns 0-3, 8-11 / 4-7, 12-15 (as the digits were
 * joined), put back in column order first. */
Q4_INLINE void q4_group_end(__m256 a0, __m256 a1, const struct q4_input *in, int64_t g, const uint16_t *scales,
                            const uint8_t *zeros, int64_t N, int64_t n, __m256 *y0, __m256 *y1) {
  q4_group_scale(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31), in, g, scales, zeros,
                 N, n, y0, y1);
}

/* y[n .. n + 16) = y0, y1 (+ bias). */
Q4_INLINE void q4_store(__m256 y0, __m256 y1, const float *bias, float *y, int64_t n) {
  if (bias) {
    y0 = _mm256_add_ps(y0, _mm256_loadu_ps(bias + n));
    y1 = _mm256_add_ps(y1, _mm256_loadu_ps(bias + n + 8));
  }
  _mm256_storeu_ps(y + n, y0);
  _mm256_storeu_ps(y + n + 8, y1);
}

Q4_INLINE void q4_blocks_bf16(const uint8_t *t, int64_t tile_stride, const struct q4_input *in, const uint16_t *scales,
                              const uint8_t *zeros, const float *bias, float *y, int64_t n0, int64_t N, int64_t K,
                              int64_t G, const int nb) {
  const int64_t groups = K / G, half_k = K / 2;
  const __m256i low = _mm256_set1_epi8(0x0f), join = _mm256_set1_epi32(1 | 256 << 16);
  __m256 y0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, y1[2] = {y0[0], y0[0]};
  for (int64_t g = 0; g < groups; g++) {
    __m256 a0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, a1[2] = {a0[0], a0[0]};
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += Q4_ROWS_PER_CHUNK) {
      __m256i d0[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, d1[2] = {d0[0], d0[0]};
      for (int64_t k = k0; k < k0 + Q4_ROWS_PER_CHUNK; k += 4) {
        const uint32_t *p = in->pairs + k / 2;
        const __m256i x0l = _mm256_set1_epi32((int)p[0]), x0h = _mm256_set1_epi32((int)p[1]);
        const __m256i x1l = _mm256_set1_epi32((int)p[half_k]), x1h = _mm256_set1_epi32((int)p[half_k + 1]);
        for (int b = 0; b < nb; b++) {
          const __m256i w = _mm256_loadu_si256((const __m256i *)(t + b * tile_stride + k * 8));
          if ((k & 7) == 0) _mm_prefetch((const char *)(t + b * tile_stride + k * 8 + Q4_PREFETCH), _MM_HINT_T0);
          const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
          d0[b] = _mm256_add_epi16(d0[b], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0l), _mm256_maddubs_epi16(hi, x0h)));
          d1[b] = _mm256_add_epi16(d1[b], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x1l), _mm256_maddubs_epi16(hi, x1h)));
        }
      }
      for (int b = 0; b < nb; b++) {
        a0[b] = _mm256_add_ps(a0[b], _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpacklo_epi16(d0[b], d1[b]), join)));
        a1[b] = _mm256_add_ps(a1[b], _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_unpackhi_epi16(d0[b], d1[b]), join)));
      }
    }
    for (int b = 0; b < nb; b++) q4_group_end(a0[b], a1[b], in, g, scales, zeros, N, n0 + 16 * b, &y0[b], &y1[b]);
  }
  for (int b = 0; b < nb; b++) q4_store(y0[b], y1[b], bias, y, n0 + 16 * b);
}
#endif

#if EDGEKV_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EDGEKV_AVX512 1
/* Whether bf16 activations take the AVX-512 blocks below (1) or the AVX2 ones (0): the same integers and fp32
 * operations, so the same outputs (a test switches it: edgekv_int4_set_wide). */
static int q4_wide = 1;

/* q4_blocks_bf16 with 512-bit vectors: a load is two tiles of the block (rows k..k+3 in the low half, k+4..k+7
 * in the high half), the activation pairs of both put side by side by one permute per digit and nibble. Each
 * half sums its 16-bit lanes over two of the chunk's four tiles (half the bound's margin used: 4 * 3840 <
 * 2^15), both are joined to 32 bits as the AVX2 blocks join theirs and added there, exactly: the chunk's
 * integer sums are the AVX2 ones, converted and accumulated in the same order. Up to four blocks at a time (AVX-512
 * has the registers for them): four streams from memory. The products were never what limited one core — in cache
 * these blocks run no faster than the AVX2 ones (a 2048 x 512 weight: 18-20 GB/s of 4-bit weights either way) —
 * the reads were: a 2048 -> 11008 product from memory on one thread of the 2-core x86 VM, 11.5 GB/s with four
 * blocks at a time against 10.5 with two (and 9.8 with the AVX2 blocks), the prefetch distance (256-4096 bytes,
 * to L1 or L2) within noise. */
Q4_INLINE void q4_blocks_bf16_512(const uint8_t *t, int64_t tile_stride, const struct q4_input *in,
                                  const uint16_t *scales, const uint8_t *zeros, const float *bias, float *y, int64_t n0,
                                  int64_t N, int64_t K, int64_t G, const int nb) {
  const int64_t groups = K / G, half_k = K / 2;
  const __m512i low = _mm512_set1_epi8(0x0f), join = _mm512_set1_epi32(1 | 256 << 16);
  const __m512i pick_l = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i pick_h = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  __m256 y0[4], y1[4];
  for (int b = 0; b < 4; b++) y0[b] = y1[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 a0[4], a1[4];
    for (int b = 0; b < 4; b++) a0[b] = a1[b] = _mm256_setzero_ps();
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += Q4_ROWS_PER_CHUNK) {
      __m512i d0[4], d1[4];
      for (int b = 0; b < 4; b++) d0[b] = d1[b] = _mm512_setzero_si512();
      for (int64_t k = k0; k < k0 + Q4_ROWS_PER_CHUNK; k += 8) {
        const __m512i p0 = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(in->pairs + k / 2)));
        const __m512i p1 = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(in->pairs + half_k + k / 2)));
        const __m512i x0l = _mm512_permutexvar_epi32(pick_l, p0), x0h = _mm512_permutexvar_epi32(pick_h, p0);
        const __m512i x1l = _mm512_permutexvar_epi32(pick_l, p1), x1h = _mm512_permutexvar_epi32(pick_h, p1);
        for (int b = 0; b < nb; b++) {
          const __m512i w = _mm512_loadu_si512((const void *)(t + b * tile_stride + k * 8));
          _mm_prefetch((const char *)(t + b * tile_stride + k * 8 + Q4_PREFETCH), _MM_HINT_T0);
          const __m512i lo = _mm512_and_si512(w, low), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
          d0[b] = _mm512_add_epi16(d0[b], _mm512_add_epi16(_mm512_maddubs_epi16(lo, x0l), _mm512_maddubs_epi16(hi, x0h)));
          d1[b] = _mm512_add_epi16(d1[b], _mm512_add_epi16(_mm512_maddubs_epi16(lo, x1l), _mm512_maddubs_epi16(hi, x1h)));
        }
      }
      for (int b = 0; b < nb; b++) {
        const __m512i l = _mm512_madd_epi16(_mm512_unpacklo_epi16(d0[b], d1[b]), join);
        const __m512i h = _mm512_madd_epi16(_mm512_unpackhi_epi16(d0[b], d1[b]), join);
        const __m256i l2 = _mm256_add_epi32(_mm512_castsi512_si256(l), _mm512_extracti64x4_epi64(l, 1));
        const __m256i h2 = _mm256_add_epi32(_mm512_castsi512_si256(h), _mm512_extracti64x4_epi64(h, 1));
        a0[b] = _mm256_add_ps(a0[b], _mm256_cvtepi32_ps(l2));
        a1[b] = _mm256_add_ps(a1[b], _mm256_cvtepi32_ps(h2));
      }
    }
    for (int b = 0; b < nb; b++) q4_group_end(a0[b], a1[b], in, g, scales, zeros, N, n0 + 16 * b, &y0[b], &y1[b]);
  }
  for (int b = 0; b < nb; b++) q4_store(y0[b], y1[b], bias, y, n0 + 16 * b);
}
#else
#define EDGEKV_AVX512 0
#endif

/* y[n0 .. n0+16) for the 16-column block starting at tile t; acc/out in fp32. */
Q4_INLINE void q4_block(const uint8_t *t, const struct q4_input *in, const uint16_t *scales, const uint8_t *zeros,
                        const float *bias, float *y, int64_t n0, int64_t N, int64_t K, int64_t G, const int digits) {
  const int64_t groups = K / G, half_k = K / 2;
#if EDGEKV_AVX2
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 y0 = _mm256_setzero_ps(), y1 = y0;
  for (int64_t g = 0; g < groups; g++) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += Q4_ROWS_PER_CHUNK) {
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t k = k0; k < k0 + Q4_ROWS_PER_CHUNK; k += 4) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(t + k * 8));
        const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        const uint32_t *p = in->pairs + k / 2;
#define Q4_DIGIT(acc, j)                                                                                     \
  acc = _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32((int)p[(j) * half_k])), \
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32((int)p[(j) * half_k + 1]))))
        Q4_DIGIT(s0, 0);
        Q4_DIGIT(s1, 1);
        if (digits >= 3) Q4_DIGIT(s2, 2);
        if (digits == 4) Q4_DIGIT(s3, 3);
#undef Q4_DIGIT
      }
      /* exact: sum_k q X_k over the chunk, columns 0-7 (l) and 8-15 (h) */
#define Q4_WIDE(part) _mm256_cvtepi16_epi32(part)
      const __m128i l0 = _mm256_castsi256_si128(s0), l1 = _mm256_castsi256_si128(s1), l2 = _mm256_castsi256_si128(s2);
      const __m128i h0 = _mm256_extracti128_si256(s0, 1), h1 = _mm256_extracti128_si256(s1, 1);
      const __m128i h2 = _mm256_extracti128_si256(s2, 1);
      if (digits == 4) { /* (d0 + 2^8 d1) + 2^16 (d2 + 2^8 d3), joined in fp32 */
        const __m256 base = _mm256_set1_ps(65536.0f);
        const __m128i l3 = _mm256_castsi256_si128(s3), h3 = _mm256_extracti128_si256(s3, 1);
        a0 = _mm256_add_ps(a0, _mm256_fmadd_ps(
                                   _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(l2), _mm256_slli_epi32(Q4_WIDE(l3), 8))), base,
                                   _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(l0), _mm256_slli_epi32(Q4_WIDE(l1), 8)))));
        a1 = _mm256_add_ps(a1, _mm256_fmadd_ps(
                                   _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(h2), _mm256_slli_epi32(Q4_WIDE(h3), 8))), base,
                                   _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(h0), _mm256_slli_epi32(Q4_WIDE(h1), 8)))));
      } else if (digits == 2) { /* d0 + 2^8 d1 in 32 bits */
        a0 = _mm256_add_ps(a0, _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(l0), _mm256_slli_epi32(Q4_WIDE(l1), 8))));
        a1 = _mm256_add_ps(a1, _mm256_cvtepi32_ps(_mm256_add_epi32(Q4_WIDE(h0), _mm256_slli_epi32(Q4_WIDE(h1), 8))));
      } else { /* d0 + 2^8 d1 + 2^16 d2 in 32 bits */
        a0 = _mm256_add_ps(a0, _mm256_cvtepi32_ps(_mm256_add_epi32(
                                   Q4_WIDE(l0), _mm256_add_epi32(_mm256_slli_epi32(Q4_WIDE(l1), 8),
                                                                 _mm256_slli_epi32(Q4_WIDE(l2), 16)))));
        a1 = _mm256_add_ps(a1, _mm256_cvtepi32_ps(_mm256_add_epi32(
                                   Q4_WIDE(h0), _mm256_add_epi32(_mm256_slli_epi32(Q4_WIDE(h1), 8),
                                                                 _mm256_slli_epi32(Q4_WIDE(h2), 16)))));
      }
#undef Q4_WIDE
    }
    q4_group_scale(a0, a1, in, g, scales, zeros, N, n0, &y0, &y1);
  }
  if (bias) {
    y0 = _mm256_add_ps(y0, _mm256_loadu_ps(bias + n0));
    y1 = _mm256_add_ps(y1, _mm256_loadu_ps(bias + n0 + 8));
  }
  _mm256_storeu_ps(y + n0, y0);
  _mm256_storeu_ps(y + n0 + 8, y1);
#elif EDGEKV_NEON
  const uint8x16_t low = vdupq_n_u8(0x0f);
  float32x4_t yv[4];
  for (int i = 0; i < 4; i++) yv[i] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    float32x4_t av[4];
    for (int i = 0; i < 4; i++) av[i] = vdupq_n_f32(0.0f);
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += Q4_ROWS_PER_CHUNK) {
      int32x4_t s[Q4_DIGITS][4];
      for (int d = 0; d < Q4_DIGITS; d++)
        for (int i = 0; i < 4; i++) s[d][i] = vdupq_n_s32(0);
      for (int64_t k = k0; k < k0 + Q4_ROWS_PER_CHUNK; k += 4) {
        const uint8x16_t w0 = vld1q_u8(t + k * 8), w1 = vld1q_u8(t + k * 8 + 16);
        const int8x16_t lo0 = vreinterpretq_s8_u8(vandq_u8(w0, low)), hi0 = vreinterpretq_s8_u8(vshrq_n_u8(w0, 4));
        const int8x16_t lo1 = vreinterpretq_s8_u8(vandq_u8(w1, low)), hi1 = vreinterpretq_s8_u8(vshrq_n_u8(w1, 4));
        const uint32_t *p = in->pairs + k / 2;
        for (int d = 0; d < digits; d++) {
          const int8x8_t pl = vreinterpret_s8_u32(vdup_n_u32(p[d * half_k])), ph = vreinterpret_s8_u32(vdup_n_u32(p[d * half_k + 1]));
          s[d][0] = vpadalq_s16(s[d][0], vaddq_s16(vmull_s8(vget_low_s8(lo0), pl), vmull_s8(vget_low_s8(hi0), ph)));
          s[d][1] = vpadalq_s16(s[d][1], vaddq_s16(vmull_s8(vget_high_s8(lo0), pl), vmull_s8(vget_high_s8(hi0), ph)));
          s[d][2] = vpadalq_s16(s[d][2], vaddq_s16(vmull_s8(vget_low_s8(lo1), pl), vmull_s8(vget_low_s8(hi1), ph)));
          s[d][3] = vpadalq_s16(s[d][3], vaddq_s16(vmull_s8(vget_high_s8(lo1), pl), vmull_s8(vget_high_s8(hi1), ph)));
        }
      }
      for (int i = 0; i < 4; i++) {
        if (digits == 4) {
          const float32x4_t lower = vcvtq_f32_s32(vaddq_s32(s[0][i], vshlq_n_s32(s[1][i], 8)));
          const float32x4_t upper = vcvtq_f32_s32(vaddq_s32(s[2][i], vshlq_n_s32(s[3][i], 8)));
          av[i] = vaddq_f32(av[i], vfmaq_f32(lower, upper, vdupq_n_f32(65536.0f)));
        } else {
          const int32x4_t c = vaddq_s32(s[0][i], vaddq_s32(vshlq_n_s32(s[1][i], 8), vshlq_n_s32(s[2][i], 16)));
          av[i] = vaddq_f32(av[i], vcvtq_f32_s32(c));
        }
      }
    }
    const float32x4_t xs = vdupq_n_f32(in->xsum[g]);
    for (int i = 0; i < 4; i++) {
      float zf[4], sf[4];
      for (int j = 0; j < 4; j++) {
        zf[j] = (float)zeros[g * N + n0 + 4 * i + j];
        sf[j] = in->factor[g] * half_to_float(scales[g * N + n0 + 4 * i + j]);
      }
      yv[i] = vfmaq_f32(yv[i], vld1q_f32(sf), vfmsq_f32(av[i], vld1q_f32(zf), xs));
    }
  }
  for (int i = 0; i < 4; i++) {
    if (bias) yv[i] = vaddq_f32(yv[i], vld1q_f32(bias + n0 + 4 * i));
    vst1q_f32(y + n0 + 4 * i, yv[i]);
  }
#else
  float yc[16] = {0};
  for (int64_t g = 0; g < groups; g++) {
    float ac[16] = {0};
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += Q4_ROWS_PER_CHUNK) {
      int32_t s[Q4_DIGITS][16] = {{0}};
      for (int64_t k = k0; k < k0 + Q4_ROWS_PER_CHUNK; k += 4) {
        const uint8_t *w = t + k * 8;
        const uint32_t *p = in->pairs + k / 2;
        for (int d = 0; d < digits; d++) {
          const int8_t l0 = (int8_t)(p[d * half_k] & 0xff), l1 = (int8_t)((p[d * half_k] >> 8) & 0xff);
          const int8_t h0 = (int8_t)(p[d * half_k + 1] & 0xff), h1 = (int8_t)((p[d * half_k + 1] >> 8) & 0xff);
          for (int c = 0; c < 16; c++) {
            const uint8_t b0 = w[2 * c], b1 = w[2 * c + 1];
            s[d][c] += (b0 & 15) * l0 + (b1 & 15) * l1 + (b0 >> 4) * h0 + (b1 >> 4) * h1;
          }
        }
      }
      for (int c = 0; c < 16; c++)
        ac[c] += digits == 4 ? fmaf((float)(s[2][c] + s[3][c] * 256), 65536.0f, (float)(s[0][c] + s[1][c] * 256))
                             : (float)(s[0][c] + s[1][c] * 256 + s[2][c] * 65536);
    }
    for (int c = 0; c < 16; c++) {
      const float sc = in->factor[g] * half_to_float(scales[g * N + n0 + c]);
      yc[c] = fmaf(sc, fmaf(-(float)zeros[g * N + n0 + c], in->xsum[g], ac[c]), yc[c]);
    }
  }
  for (int c = 0; c < 16; c++) y[n0 + c] = bias ? yc[c] + bias[n0 + c] : yc[c];
#endif
}

struct q4_job {
  const uint8_t *tiles;
  const struct q4_input *in; /* [rows] */
  const uint16_t *scales;
  const uint8_t *zeros;
  const float *bias;
  float *y; /* [rows][N] */
  int64_t rows, blocks, per, N, K, G; /* per: 16-column blocks a chunk */
  int digits;
};

/* The chunk's blocks, each for every row before the next block: a block's tiles (K * 8 bytes) come from memory
 * for the first row and from the cache for the others, and each row gets the same operations it gets alone. */
static void q4_run(void *arg, int64_t chunk) {
  const struct q4_job *j = (const struct q4_job *)arg;
  const int64_t b1 = (chunk + 1) * j->per < j->blocks ? (chunk + 1) * j->per : j->blocks, stride = (j->K / 4) * 32;
  for (int64_t b = chunk * j->per; b < b1;) {
#if EDGEKV_AVX2
    if (j->digits == 2) {
#if EDGEKV_AVX512
      if (q4_wide) { /* four blocks at a time where the chunk has them: four streams from memory */
        const int nb = b + 4 <= b1 ? 4 : b + 2 <= b1 ? 2 : 1;
        for (int64_t r = 0; r < j->rows; r++) {
          const uint8_t *t = j->tiles + b * stride;
          float *y = j->y + r * j->N;
          if (nb == 4)
            q4_blocks_bf16_512(t, stride, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 4);
          else if (nb == 2)
            q4_blocks_bf16_512(t, stride, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 2);
          else
            q4_blocks_bf16_512(t, stride, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 1);
        }
        b += nb;
        continue;
      }
#endif
      const int nb = b + 2 <= b1 ? 2 : 1;
      for (int64_t r = 0; r < j->rows; r++) {
        if (nb == 2)
          q4_blocks_bf16(j->tiles + b * stride, stride, j->in + r, j->scales, j->zeros, j->bias, j->y + r * j->N, b * 16,
                         j->N, j->K, j->G, 2);
        else
          q4_blocks_bf16(j->tiles + b * stride, stride, j->in + r, j->scales, j->zeros, j->bias, j->y + r * j->N, b * 16,
                         j->N, j->K, j->G, 1);
      }
      b += nb;
      continue;
    }
#endif
    for (int64_t r = 0; r < j->rows; r++) { /* the block bodies, each compiled for its digit count */
      const uint8_t *t = j->tiles + b * stride;
      float *y = j->y + r * j->N;
      if (j->digits == 4)
        q4_block(t, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 4);
      else if (j->digits == 3)
        q4_block(t, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 3);
      else
        q4_block(t, j->in + r, j->scales, j->zeros, j->bias, y, b * 16, j->N, j->K, j->G, 2);
    }
    b++;
  }
}

/* Products of fewer weight-rows (P * N * K) than this run on the calling thread alone, and larger ones on at most
 * one thread per this many. A worker waits passively between calls (OMP_WAIT_POLICY=PASSIVE: asleep), and waking
 * it takes a system call and, on a virtual machine, the other vCPU's wake-up; for a 3B k/v projection (0.5M weights,
 * ~20 us alone) that was more than the product. A layer call holds the workers between its products (pool_hold),
 * so most products find them awake. 3B 4-bit decode with two threads on the 2-core x86 VM, ms a token (the
 * fused layer, the AVX-512 blocks, the pool held; two runs each, one process per setting): 2^20 (the 2048 x 2048
 * q and o products on two threads, k and v alone) 106.1 / 107.5, 2^22 (q and o alone too) 114.4 / 111.8. Before
 * the hold and the AVX-512 blocks: every product on the pool 150.7 / 131.0; products under 1M weights alone
 * 128.1 / 128.6; under 5M (k, v, q, o) alone 122.7 / 127.2. */
#ifndef Q4_WORK_PER_THREAD
#define Q4_WORK_PER_THREAD (INT64_C(1) << 20)
#endif

/* Y [P][N] (fp32) = X W^T + bias for P rows of activations X [P][K]: every row gets exactly what
 * edgekv_gemv_int4 gives it alone. The short chunks of a stream (a 112x112 frame pair is 16 tokens, a question
 * a few dozen) read each weight once this way, where dequantizing every weight for a GEMM costs more than the
 * products (see edgekv/model/decode_routes.py for the measured crossover). */
int edgekv_gemm_int4(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, const float *x,
                     const float *bias, float *y, int64_t P, int64_t N, int64_t K, int64_t G, int digits, int threads) {
  if (P <= 0 || N <= 0 || K <= 0 || G <= 0 || N % 16 || K % 16 || G % Q4_ROWS_PER_CHUNK || K % G) return -3;
  if (digits < 2 || digits > 4) return -3;
  struct q4_input *in = (struct q4_input *)calloc((size_t)P, sizeof *in);
  uint32_t *pairs = (uint32_t *)malloc((size_t)P * (size_t)(digits * (K / 2)) * sizeof(uint32_t));
  float *factor = (float *)malloc((size_t)P * (size_t)(K / G) * sizeof(float));
  float *xsum = (float *)malloc((size_t)P * (size_t)(K / G) * sizeof(float));
  int code = (in && pairs && factor && xsum) ? 0 : -1;
  for (int64_t r = 0; r < P && code == 0; r++) {
    in[r].pairs = pairs + r * digits * (K / 2); /* digit j of row r at pairs[j * K / 2]: what the blocks read */
    in[r].factor = factor + r * (K / G);
    in[r].xsum = xsum + r * (K / G);
    code = q4_prepare(x + r * K, K, G, digits, &in[r]);
  }
  if (code == 0) {
    const int64_t blocks = N / 16;
    /* a thread for every Q4_WORK_PER_THREAD weight-rows at most: waking a sleeping worker for a small product
     * costs more than it saves (see Q4_WORK_PER_THREAD) */
    const int64_t useful = (P * N * K) / Q4_WORK_PER_THREAD;
    if (threads > useful) threads = (int)useful;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    const int64_t per = (blocks + 4 * threads - 1) / (4 * threads); /* four chunks a thread */
    struct q4_job job = {tiles, in, scales, zeros, bias, y, P, blocks, per, N, K, G, digits};
    pool_run(q4_run, &job, (blocks + per - 1) / per, threads);
  }
  free(in);
  free(pairs);
  free(factor);
  free(xsum);
  return code;
}

/* y [N] (fp32) = W x + bias. tiles: K * N / 2 bytes (see above); scales float16 [K/G][N]; zeros [K/G][N];
 * x fp32 [K]; bias fp32 [N] or NULL. N % 16 == 0, K % 16 == 0, G % 16 == 0, K % G == 0. digits: 4 for fp32
 * activations, 3 for fp16, 2 for bf16 (see above).
 * Returns 0; -1 when memory could not be had, -2 for a non-finite activation, -3 for a bad shape (nothing
 * written then). */
int edgekv_gemv_int4(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, const float *x,
                     const float *bias, float *y, int64_t N, int64_t K, int64_t G, int digits, int threads) {
  return edgekv_gemm_int4(tiles, scales, zeros, x, bias, y, 1, N, K, G, digits, threads);
}

/* P rows of a bf16 model in one call: X bf16 [P][K] widened, the products as above with two digits, Y bf16
 * [P][N] rounded once to nearest even (what torch's conversion of the fp32 result gives). */
int edgekv_gemm_int4_bf16(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, const uint16_t *x16,
                          const float *bias, uint16_t *y16, int64_t P, int64_t N, int64_t K, int64_t G, int threads) {
  if (P <= 0 || N <= 0 || K <= 0) return -3;
  float *x = (float *)malloc((size_t)(P * K) * sizeof(float)), *y = (float *)malloc((size_t)(P * N) * sizeof(float));
  int code = -1;
  if (x && y) {
    for (int64_t k = 0; k < P * K; k++) x[k] = widen(x16[k]);
    code = edgekv_gemm_int4(tiles, scales, zeros, x, bias, y, P, N, K, G, 2, threads);
    if (code == 0)
      for (int64_t n = 0; n < P * N; n++) y16[n] = narrow(y[n]);
  }
  free(x);
  free(y);
  return code;
}

/* The decode step of a bf16 model: one row of the above. */
int edgekv_gemv_int4_bf16(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, const uint16_t *x16,
                          const float *bias, uint16_t *y16, int64_t N, int64_t K, int64_t G, int threads) {
  return edgekv_gemm_int4_bf16(tiles, scales, zeros, x16, bias, y16, 1, N, K, G, threads);
}

/* The dequantizer's work: 16-column blocks [b0, b1) of W. (q - z) is an integer in [-15, 15] and s a
 * float16, so (q - z) * s is exact in fp32; bf16 output rounds it once, to nearest even. */
struct dq_job {
  const uint8_t *tiles;
  const uint16_t *scales;
  const uint8_t *zeros;
  float *w32;
  uint16_t *w16;
  int64_t N, K, G, per; /* per: blocks a chunk */
};

static void dq_block_portable(const struct dq_job *j, int64_t b) {
  const int64_t N = j->N, K = j->K, G = j->G;
  const uint8_t *t = j->tiles + b * (K / 4) * 32;
  for (int64_t k0 = 0; k0 < K; k0 += 4, t += 32) {
    const int64_t g = k0 / G;
    for (int c = 0; c < 16; c++) {
      const int64_t n = b * 16 + c;
      const float sc = half_to_float(j->scales[g * N + n]), z = (float)j->zeros[g * N + n];
      const uint8_t b0 = t[2 * c], b1 = t[2 * c + 1];
      const float v[4] = {((float)(b0 & 15) - z) * sc, ((float)(b1 & 15) - z) * sc, ((float)(b0 >> 4) - z) * sc,
                          ((float)(b1 >> 4) - z) * sc};
      for (int r = 0; r < 4; r++) {
        if (j->w32)
          j->w32[n * K + k0 + r] = v[r];
        else
          j->w16[n * K + k0 + r] = narrow(v[r]);
      }
    }
  }
}

#if EDGEKV_AVX2
/* Eight weights a vector: the low and high nibbles of a tile interleaved two bytes at a time give, per
 * column, its four rows k0..k0+3 side by side (bytes 2c, 2c+1: rows k0, k0+1; their high nibbles: k0+2, k0+3);
 * two columns widen to eight int32, then (q - z) * s per column and one 16-byte (fp32) or 8-byte (bf16)
 * store into each of the two rows. The same fp32 operations as the portable loop, so the same bits. */
static void dq_block_avx2(const struct dq_job *j, int64_t b) {
  const int64_t N = j->N, K = j->K, G = j->G;
  const uint8_t *t = j->tiles + b * (K / 4) * 32;
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int64_t g = 0; g < K / G; g++) {
    __m256 zv[8], sv[8]; /* columns (2i, 2i + 1), each four times */
    for (int i = 0; i < 8; i++) {
      const int64_t n = b * 16 + 2 * i;
      const float z0 = (float)j->zeros[g * N + n], z1 = (float)j->zeros[g * N + n + 1];
      const float s0 = half_to_float(j->scales[g * N + n]), s1 = half_to_float(j->scales[g * N + n + 1]);
      zv[i] = _mm256_setr_ps(z0, z0, z0, z0, z1, z1, z1, z1);
      sv[i] = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
    }
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += 4) {
      const uint8_t *tile = t + (k0 / 4) * 32;
      for (int half = 0; half < 2; half++) { /* columns 0-7, then 8-15 */
        const __m128i w = _mm_loadu_si128((const __m128i *)(tile + 16 * half));
        const __m128i lo = _mm_and_si128(w, low), hi = _mm_and_si128(_mm_srli_epi16(w, 4), low);
        const __m128i rows[2] = {_mm_unpacklo_epi16(lo, hi), _mm_unpackhi_epi16(lo, hi)}; /* 4 bytes a column */
        for (int part = 0; part < 2; part++) {
          for (int pair = 0; pair < 2; pair++) { /* columns 8 half + 4 part + 2 pair + (0, 1) */
            const int i = 4 * half + 2 * part + pair;
            const __m128i q8 = pair ? _mm_srli_si128(rows[part], 8) : rows[part];
            const __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8)), zv[i]), sv[i]);
            const int64_t n = b * 16 + 2 * i;
            if (j->w32) {
              _mm_storeu_ps(j->w32 + n * K + k0, _mm256_castps256_ps128(v));
              _mm_storeu_ps(j->w32 + (n + 1) * K + k0, _mm256_extractf128_ps(v, 1));
            } else { /* round to nearest even as narrow() does; NaN (a NaN scale) stays NaN */
              const __m256i u = _mm256_castps_si256(v);
              const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
              __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
              const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
              r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
              const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
              _mm_storel_epi64((__m128i *)(j->w16 + n * K + k0), packed);
              _mm_storel_epi64((__m128i *)(j->w16 + (n + 1) * K + k0), _mm_srli_si128(packed, 8));
            }
          }
        }
      }
    }
  }
}
#endif

static void dq_run(void *arg, int64_t chunk) {
  const struct dq_job *j = (const struct dq_job *)arg;
  const int64_t blocks = j->N / 16, b1 = (chunk + 1) * j->per < blocks ? (chunk + 1) * j->per : blocks;
  for (int64_t b = chunk * j->per; b < b1; b++) {
#if EDGEKV_AVX2
    if (j->K % 4 == 0 && j->G % 4 == 0) {
      dq_block_avx2(j, b);
      continue;
    }
#endif
    dq_block_portable(j, b);
  }
}

/* W [N][K] (nn.Linear's orientation) = (q - z) * s from the tiles: fp32 (out_bf16 == 0) or bf16 rounded to
 * nearest even (out_bf16 == 1), on `threads` threads. The prefill of a chunk multiplies this by its rows
 * (torch's GEMM). */
int edgekv_dequant_int4(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, void *out, int out_bf16,
                        int64_t N, int64_t K, int64_t G, int threads) {
  if (N <= 0 || K <= 0 || G <= 0 || N % 16 || K % 4 || K % G) return -3;
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  const int64_t blocks = N / 16, per = (blocks + 4 * threads - 1) / (4 * threads);
  struct dq_job job = {tiles, scales, zeros, out_bf16 ? NULL : (float *)out, out_bf16 ? (uint16_t *)out : NULL,
                       N, K, G, per};
  pool_run(dq_run, &job, (blocks + per - 1) / per, threads);
  return 0;
}

/* 1: AVX2 integer products, 2: NEON, 3: AVX-512 BW for bf16 activations (AVX2 for the others), 0: the portable
 * loop (for the 4-bit kernel). */
int edgekv_int4_simd(void) {
#if EDGEKV_AVX512
  if (q4_wide) return 3;
#endif
  return EDGEKV_AVX2 ? 1 : EDGEKV_NEON ? 2 : 0;
}

/* Turns the AVX-512 blocks on (1) or off (0, the AVX2 ones) where they were compiled; returns the setting before,
 * or -1 where they were not (nothing changes then). Not for a call in flight: set it between products. */
int edgekv_int4_set_wide(int on) {
#if EDGEKV_AVX512
  const int before = q4_wide;
  q4_wide = on ? 1 : 0;
  return before;
#else
  (void)on;
  return -1;
#endif
}

/* ------------------------------------------------------------------------------------------------------
 * int8 weights (issue 29: the opt-in int8 lm_head, `model.lm_head: int8`): y = W x for W stored as int8
 * w [N][K], |w| <= 127, with an fp32 scale per row and group of G inputs: W[n, k] = w[n][k] * s[g][n],
 * g = k / G (symmetric, round to nearest: edgekv/kernels/cpu_gemv.py q8_quantize). The int8 values are tiled:
 * rows 8b .. 8b + 7 of inputs 16c .. 16c + 15 are 128 consecutive bytes (row-major 8 x 16), the tiles of one
 * block of eight rows consecutive over K, so the eight rows the AVX2 loop reads at once are one stream.
 *
 * The activations become fixed point per group: X_k = round(x_k * 2^(Q8_BITS - E)) with |x_k| < 2^E for the
 * whole group (E at least Q8_MIN_EXP), so |X_k| <= 2^14 fits 16 bits: 2^-15 of the group's largest |x| per
 * activation, the bf16 kernel's two digits. The products w * X are made sixteen at a time, 16-bit pairs summed
 * into 32 bits (AVX2 vpmaddwd, NEON vmlal_s16), and summed over the group exactly (127 * 2^14 * G < 2^31 for
 * G <= 1024). The group's integer sum S[n][g] then joins the row's fp32 total, the groups in order:
 *     y[n] = fmaf((float)S[n][g], s[g][n] * 2^(E_g - Q8_BITS), y[n])
 * the same fp32 operations on every path, so AVX2 (eight rows a vector), NEON and the portable loop give the
 * same bits. Unlike the 4-bit kernel, which needs two vpmaddubsw per digit for 64 weights, one vpmaddwd
 * covers 16 int8 weights at full 16-bit activation precision: about three instructions per 16 weights, so
 * the product keeps up with memory (decode_routes.py has the figures).
 * ------------------------------------------------------------------------------------------------------ */
#define Q8_BITS 14
#define Q8_MIN_EXP (-100) /* groups below 2^-100 are read at that scale (their integers round towards 0) */
#define Q8_ROWS_PER_CHUNK 256
/* Bytes ahead that the AVX2 loop asks for. The 3B lm_head (151936 x 2048), one thread, 2-core x86 VM, best of 8
 * interleaved rounds: no prefetch 24.0 ms (12.9 GB/s of int8 weights), 256 B 21.3, 512 B 21.9, 1024 B 19.5,
 * 2048 B 19.5; the same rows laid out row by row (eight streams) took 34.0 ms; an 8 MB weight from cache
 * streams ~16 GB/s, so the loop is near its own arithmetic ceiling here. */
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 1024
#endif

struct q8_job {
  const int8_t *W;
  const float *scales; /* [K/G][N] */
  const int16_t *X;    /* [P][K] */
  const float *factor; /* [P][K/G]: 2^(E_g - Q8_BITS) */
  float *y;            /* [P][N] */
  int64_t P, N, K, G;
};

static void q8_rows_portable(const struct q8_job *j, int64_t n0, int64_t n1) {
  const int64_t groups = j->K / j->G;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *w = j->W + (n - n % 8) * j->K + (n % 8) * 16; /* row n's first 16 bytes in its block */
    for (int64_t p = 0; p < j->P; p++) {
      const int16_t *X = j->X + p * j->K;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        int32_t s = 0;
        for (int64_t k = g * j->G; k < (g + 1) * j->G; k++) s += (int32_t)w[(k / 16) * 128 + k % 16] * (int32_t)X[k];
        total = fmaf((float)s, j->scales[g * j->N + n] * j->factor[p * groups + g], total);
      }
      j->y[p * j->N + n] = total;
    }
  }
}

#if EDGEKV_AVX2
static inline __m256i q8_madd16(const int8_t *w, __m256i x, __m256i acc) {
  __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w16, x));
}

/* Rows [n0, n1) (a multiple of 8 apart): eight rows a pass, 128 consecutive bytes a step (the tiled layout),
 * their eight group sums joined into one vector for the fp32 part. */
static void q8_rows_avx2(const struct q8_job *j, int64_t n0, int64_t n1) {
  const int64_t K = j->K, G = j->G, groups = K / G;
  for (int64_t n = n0; n < n1; n += 8) {
    const int8_t *w = j->W + n * K; /* the block of rows n .. n + 7 */
    for (int64_t p = 0; p < j->P; p++) {
      const int16_t *X = j->X + p * K;
      __m256 total = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; g++) {
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
          const __m256i x = _mm256_loadu_si256((const __m256i *)(X + k));
          const int8_t *t = w + k * 8;
          _mm_prefetch((const char *)(t + Q8_PREFETCH), _MM_HINT_T0);
          _mm_prefetch((const char *)(t + Q8_PREFETCH + 64), _MM_HINT_T0);
          a0 = q8_madd16(t, x, a0);
          a1 = q8_madd16(t + 16, x, a1);
          a2 = q8_madd16(t + 32, x, a2);
          a3 = q8_madd16(t + 48, x, a3);
          a4 = q8_madd16(t + 64, x, a4);
          a5 = q8_madd16(t + 80, x, a5);
          a6 = q8_madd16(t + 96, x, a6);
          a7 = q8_madd16(t + 112, x, a7);
        }
        /* eight vectors of eight partial sums -> one vector of the eight rows' sums (exact integer adds) */
        const __m256i s0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
        const __m256i s4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                                              _mm256_permute2x128_si256(s0123, s4567, 0x31));
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(j->scales + g * j->N + n),
                                           _mm256_set1_ps(j->factor[p * groups + g]));
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, total);
      }
      _mm256_storeu_ps(j->y + p * j->N + n, total);
    }
  }
}
#endif

#if EDGEKV_NEON
static void q8_rows_neon(const struct q8_job *j, int64_t n0, int64_t n1) {
  const int64_t K = j->K, G = j->G, groups = K / G;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t *w = j->W + (n - n % 8) * K + (n % 8) * 16; /* row n's first 16 bytes in its block */
    for (int64_t p = 0; p < j->P; p++) {
      const int16_t *X = j->X + p * K;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        int32x4_t a = vdupq_n_s32(0), b = a;
        for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
          const int8x16_t w8 = vld1q_s8(w + k * 8);
          const int16x8_t lo = vmovl_s8(vget_low_s8(w8)), hi = vmovl_high_s8(w8);
          const int16x8_t xl = vld1q_s16(X + k), xh = vld1q_s16(X + k + 8);
          a = vmlal_s16(a, vget_low_s16(lo), vget_low_s16(xl));
          b = vmlal_high_s16(b, lo, xl);
          a = vmlal_s16(a, vget_low_s16(hi), vget_low_s16(xh));
          b = vmlal_high_s16(b, hi, xh);
        }
        const int32_t s = vaddvq_s32(vaddq_s32(a, b));
        total = fmaf((float)s, j->scales[g * j->N + n] * j->factor[p * groups + g], total);
      }
      j->y[p * j->N + n] = total;
    }
  }
}
#endif

static void q8_run(void *arg, int64_t chunk) {
  const struct q8_job *j = (const struct q8_job *)arg;
  int64_t n0 = chunk * Q8_ROWS_PER_CHUNK;
  const int64_t n1 = n0 + Q8_ROWS_PER_CHUNK < j->N ? n0 + Q8_ROWS_PER_CHUNK : j->N;
#if EDGEKV_AVX2
  q8_rows_avx2(j, n0, n1);
#elif EDGEKV_NEON
  q8_rows_neon(j, n0, n1);
#else
  q8_rows_portable(j, n0, n1);
#endif
}

/* Y [P][N] (fp32) = X W^T for int8 W [N][K] with fp32 scales [K/G][N] (see above) and fp32 activations
 * X [P][K]. K % G == 0, G % 16 == 0, 16 <= G <= 1024. Returns 0; -1 when memory could not be had, -2 for a
 * non-finite activation, -3 for a bad shape (nothing written then). */
int edgekv_gemm_q8(const int8_t *W, const float *scales, const float *x, float *y, int64_t P, int64_t N, int64_t K,
                   int64_t G, int threads) {
  if (P <= 0 || N <= 0 || N % 8 || K <= 0 || G < 16 || G > 1024 || G % 16 || K % G) return -3;
  const int64_t groups = K / G;
  int16_t *X = (int16_t *)malloc((size_t)(P * K) * sizeof(int16_t));
  float *factor = (float *)malloc((size_t)(P * groups) * sizeof(float));
  int code = (X && factor) ? 0 : -1;
  for (int64_t i = 0; i < P * groups && code == 0; i++) {
    const float *v = x + i * G;
    float largest = 0.0f;
    for (int64_t k = 0; k < G; k++) {
      const float a = fabsf(v[k]);
      if (!isfinite(a)) code = -2;
      largest = a > largest ? a : largest;
    }
    if (code) break;
    int e = 0;
    frexpf(largest, &e); /* largest < 2^e */
    if (e < Q8_MIN_EXP) e = Q8_MIN_EXP;
    for (int64_t k = 0; k < G; k++) X[i * G + k] = (int16_t)lrintf(ldexpf(v[k], Q8_BITS - e));
    factor[i] = ldexpf(1.0f, e - Q8_BITS);
  }
  if (code == 0) {
    const int64_t useful = (P * N * K) / Q4_WORK_PER_THREAD;
    if (threads > useful) threads = (int)useful;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    struct q8_job job = {W, scales, X, factor, y, P, N, K, G};
    pool_run(q8_run, &job, (N + Q8_ROWS_PER_CHUNK - 1) / Q8_ROWS_PER_CHUNK, threads);
  }
  free(X);
  free(factor);
  return code;
}

/* ------------------------------------------------------------------------------------------------------
 * The glue of a decode step (issue 29): Qwen2's RMSNorm and the rotary of q and k, one call each where torch
 * issues 6-8 small operations (at the 3B shape a decode token spent ~6.5 ms in 73 norms and ~4 ms in 72
 * rotations on one core, most of it per-operation overhead; README "4-bit weights").
 *
 * Both compute what transformers' eager code computes, rounding where it rounds. dtype 0: fp32, 1: bf16.
 *   RMSNorm (Qwen2RMSNorm): v = x in fp32; r = 1 / sqrt(mean(v^2) + eps) in fp32; y = (v * r) rounded to the
 *   input dtype; out = weight * y, rounded to the dtype. The mean is summed in double and rounded once to fp32
 *   (torch sums fp32 partial sums, so the two may differ in the last bit of the mean, and a last-bit change of r
 *   reaches a bf16 output only where it sits on a rounding tie: at the 3B width, 9 of 32768 values of one norm
 *   in one layer of a 16-row chunk).
 *   Rotary (apply_rotary_pos_emb): out = x * cos + rotate_half(x) * sin with cos / sin in x's dtype; in bf16
 *   each product is rounded to bf16, their fp32 sum rounded to bf16 (torch's three operations exactly); in
 *   fp32 two products and a sum, no fused multiply-add (-std=c11 keeps the compiler from contracting them).
 * ------------------------------------------------------------------------------------------------------ */

/* out [rows][n] = RMSNorm(x [rows][n]) * weight [n]; x and out may be the same memory. Returns 0, or -3 for
 * a bad shape or dtype. */
int edgekv_rmsnorm(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps, int dtype) {
  if (rows < 0 || n <= 0 || (dtype != 0 && dtype != 1)) return -3;
  for (int64_t r = 0; r < rows; r++) {
    double total = 0.0;
    if (dtype == 0) {
      const float *v = (const float *)x + r * n;
      for (int64_t k = 0; k < n; k++) {
        const float square = v[k] * v[k]; /* torch's pow(2): one fp32 rounding */
        total += (double)square;
      }
    } else {
      const uint16_t *v = (const uint16_t *)x + r * n;
      for (int64_t k = 0; k < n; k++) {
        const float a = widen(v[k]);
        total += (double)(a * a);
      }
    }
    const float mean = (float)(total / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    if (dtype == 0) {
      const float *v = (const float *)x + r * n, *w = (const float *)weight;
      float *o = (float *)out + r * n;
      for (int64_t k = 0; k < n; k++) {
        const float y = v[k] * scale;
        o[k] = w[k] * y;
      }
    } else {
      const uint16_t *v = (const uint16_t *)x + r * n, *w = (const uint16_t *)weight;
      uint16_t *o = (uint16_t *)out + r * n;
      for (int64_t k = 0; k < n; k++) {
        const float y = widen(narrow(widen(v[k]) * scale));
        o[k] = narrow(widen(w[k]) * y);
      }
    }
  }
  return 0;
}

/* Rotate x in place: x[h][p][0..hd) for heads h < heads, rows p < rows, element (h, p, j) at
 * x + h * head_stride + p * row_stride + j (in elements), by cos / sin [rows][hd] of x's dtype. Returns 0,
 * or -3 for a bad shape or dtype. */
int edgekv_rotary(void *x, const void *cos, const void *sin, int64_t heads, int64_t rows, int64_t hd,
                  int64_t head_stride, int64_t row_stride, int dtype) {
  if (heads < 0 || rows < 0 || hd <= 0 || hd % 2 || hd > 1024 || (dtype != 0 && dtype != 1)) return -3;
  const int64_t half = hd / 2;
  float v[1024];
  for (int64_t h = 0; h < heads; h++) {
    for (int64_t p = 0; p < rows; p++) {
      const int64_t at = h * head_stride + p * row_stride;
      if (dtype == 0) {
        float *e = (float *)x + at;
        const float *c = (const float *)cos + p * hd, *s = (const float *)sin + p * hd;
        memcpy(v, e, (size_t)hd * sizeof(float));
        for (int64_t j = 0; j < hd; j++) {
          const float rotated = j < half ? -v[j + half] : v[j - half];
          const float a = v[j] * c[j], b = rotated * s[j];
          e[j] = a + b;
        }
      } else {
        uint16_t *e = (uint16_t *)x + at;
        const uint16_t *c = (const uint16_t *)cos + p * hd, *s = (const uint16_t *)sin + p * hd;
        for (int64_t j = 0; j < hd; j++) v[j] = widen(e[j]);
        for (int64_t j = 0; j < hd; j++) {
          const float rotated = j < half ? -v[j + half] : v[j - half];
          const float a = widen(narrow(v[j] * widen(c[j]))), b = widen(narrow(rotated * widen(s[j])));
          e[j] = narrow(a + b);
        }
      }
    }
  }
  return 0;
}

/* ------------------------------------------------------------------------------------------------------
 * One Qwen2 decoder layer of a 4-bit model with bf16 activations, in two calls around the attention (issue 29):
 *   pre:  h = RMSNorm(x) * w1; q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv; q, k rotated
 *   post: x1 = x + a Wo^T; h = RMSNorm(x1) * w2; x2 = x1 + (silu(h Wg^T) * (h Wu^T)) Wd^T
 * P rows at once. Every product is edgekv_gemm_int4's with two activation digits, rounded once to bf16, and
 * every operation between them rounds to bf16 where transformers' eager bf16 code does, so the layer computes
 * what the same products and torch's operations give one by one — but for the norms' means (see above) and
 * SiLU's exp (libm's expf here, torch's vectorised exp there): last-bit differences in fp32, which reach a bf16
 * value only on a rounding tie (and then, through the layers after it, spread). A decode token of the 3B model
 * issued ~900 small torch operations and 252 product calls from Python; with this, 72 calls and the attention.
 * ------------------------------------------------------------------------------------------------------ */
struct edgekv_q4_linear {
  const uint8_t *tiles;
  const uint16_t *scales;
  const uint8_t *zeros;
  const float *bias; /* fp32 [N] or NULL */
  int64_t N, K, G;
};

/* y16 [P][N] = bf16(x [P][K] W^T + bias), x fp32 (bf16 values), y32 scratch [P][N]. */
static int q4_linear_bf16(const struct edgekv_q4_linear *w, const float *x, float *y32, uint16_t *y16, int64_t P,
                          int threads) {
  const int code = edgekv_gemm_int4(w->tiles, w->scales, w->zeros, x, w->bias, y32, P, w->N, w->K, w->G, 2, threads);
  if (code == 0)
    for (int64_t i = 0; i < P * w->N; i++) y16[i] = narrow(y32[i]);
  return code;
}

static void widen_all(const uint16_t *h, float *f, int64_t count) {
  for (int64_t i = 0; i < count; i++) f[i] = widen(h[i]);
}

/* q16 [P][Hq * hd], k16 / v16 [P][Hkv * hd] from x16 [P][d]; cos16 / sin16 [P][hd]. Returns 0, -1 (memory),
 * -2 (an inf / nan activation reached a product: nothing to trust in the outputs), -3 (shapes). */
int edgekv_layer_pre_bf16(const uint16_t *x16, const uint16_t *norm16, float eps, const struct edgekv_q4_linear *q,
                          const struct edgekv_q4_linear *k, const struct edgekv_q4_linear *v, const uint16_t *cos16,
                          const uint16_t *sin16, uint16_t *q16, uint16_t *k16, uint16_t *v16, int64_t P, int64_t d,
                          int64_t hq, int64_t hkv, int64_t hd, int threads) {
  if (P <= 0 || d <= 0 || q->K != d || k->K != d || v->K != d || q->N != hq * hd || k->N != hkv * hd ||
      v->N != hkv * hd)
    return -3;
  uint16_t *h16 = (uint16_t *)malloc((size_t)(P * d) * sizeof(uint16_t));
  float *h = (float *)malloc((size_t)(P * d) * sizeof(float));
  const int64_t widest = q->N > k->N ? q->N : k->N;
  float *y32 = (float *)malloc((size_t)(P * widest) * sizeof(float));
  int code = (h16 && h && y32) ? 0 : -1;
  if (threads > 1) pool_hold(1); /* the three products follow each other */
  if (code == 0) code = edgekv_rmsnorm(x16, norm16, h16, P, d, eps, 1);
  if (code == 0) {
    widen_all(h16, h, P * d);
    code = q4_linear_bf16(q, h, y32, q16, P, threads);
  }
  if (code == 0) code = q4_linear_bf16(k, h, y32, k16, P, threads);
  if (code == 0) code = q4_linear_bf16(v, h, y32, v16, P, threads);
  if (code == 0) code = edgekv_rotary(q16, cos16, sin16, hq, P, hd, hd, hq * hd, 1);
  if (code == 0) code = edgekv_rotary(k16, cos16, sin16, hkv, P, hd, hd, hkv * hd, 1);
  if (threads > 1) pool_hold(0);
  free(h16);
  free(h);
  free(y32);
  return code;
}

/* out16 [P][d] from the residual x16 [P][d] and the attention's output a16 [P][Hq * hd]. Returns as above. */
int edgekv_layer_post_bf16(const uint16_t *x16, const uint16_t *a16, const struct edgekv_q4_linear *o,
                           const uint16_t *norm16, float eps, const struct edgekv_q4_linear *gate,
                           const struct edgekv_q4_linear *up, const struct edgekv_q4_linear *down, uint16_t *out16,
                           int64_t P, int64_t d, int threads) {
  const int64_t inner = gate->N, width = o->K;
  if (P <= 0 || d <= 0 || o->N != d || gate->K != d || up->K != d || up->N != inner || down->K != inner ||
      down->N != d)
    return -3;
  const int64_t most = inner > width ? (inner > d ? inner : d) : (width > d ? width : d);
  float *f = (float *)malloc((size_t)(P * most) * sizeof(float));
  float *y32 = (float *)malloc((size_t)(P * most) * sizeof(float));
  uint16_t *x1 = (uint16_t *)malloc((size_t)(P * d) * sizeof(uint16_t));
  uint16_t *t16 = (uint16_t *)malloc((size_t)(P * most) * sizeof(uint16_t));
  uint16_t *g16 = (uint16_t *)malloc((size_t)(P * inner) * sizeof(uint16_t));
  int code = (f && y32 && x1 && t16 && g16) ? 0 : -1;
  if (threads > 1) pool_hold(1); /* the four products follow each other */
  if (code == 0) {
    widen_all(a16, f, P * width);
    code = q4_linear_bf16(o, f, y32, t16, P, threads); /* t16: the attention's projection */
  }
  if (code == 0) {
    for (int64_t i = 0; i < P * d; i++) x1[i] = narrow(widen(x16[i]) + widen(t16[i]));
    code = edgekv_rmsnorm(x1, norm16, t16, P, d, eps, 1); /* t16: the normed x1 */
  }
  if (code == 0) {
    widen_all(t16, f, P * d);
    code = q4_linear_bf16(gate, f, y32, g16, P, threads);
  }
  if (code == 0) code = q4_linear_bf16(up, f, y32, t16, P, threads); /* t16: up */
  if (code == 0) {
    for (int64_t i = 0; i < P * inner; i++) {
      const float g = widen(g16[i]);
      const float act = widen(narrow(g / (1.0f + expf(-g)))); /* torch's silu in fp32, rounded to bf16 */
      f[i] = widen(narrow(act * widen(t16[i])));
    }
    code = q4_linear_bf16(down, f, y32, t16, P, threads); /* t16: down */
  }
  if (code == 0)
    for (int64_t i = 0; i < P * d; i++) out16[i] = narrow(widen(x1[i]) + widen(t16[i]));
  if (threads > 1) pool_hold(0);
  free(f);
  free(y32);
  free(x1);
  free(t16);
  free(g16);
  return code;
}
