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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(EDGEKV_PORTABLE)
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

static int q4_prepare(const float *x, int64_t K, int64_t G, int digits, struct q4_input *in) {
  const int bits = 8 * digits - 2;
  const int64_t groups = K / G;
  for (int64_t g = 0; g < groups; g++) {
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
  }
  return 0;
}

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
    const __m256 xs = _mm256_set1_ps(in->xsum[g]), f = _mm256_set1_ps(in->factor[g]);
    const uint8_t *z = zeros + g * N + n0;
    const uint16_t *s = scales + g * N + n0;
    const __m256 z0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)z)));
    const __m256 z1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + 8))));
    const __m256 sc0 = _mm256_mul_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)));
    const __m256 sc1 = _mm256_mul_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8))));
    y0 = _mm256_fmadd_ps(sc0, _mm256_fnmadd_ps(z0, xs, a0), y0);
    y1 = _mm256_fmadd_ps(sc1, _mm256_fnmadd_ps(z1, xs, a1), y1);
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
  const struct q4_input *in;
  const uint16_t *scales;
  const uint8_t *zeros;
  const float *bias;
  float *y;
  int64_t b0, b1, N, K, G;
  int digits;
};

static void *q4_run(void *arg) {
  const struct q4_job *j = (const struct q4_job *)arg;
  for (int64_t b = j->b0; b < j->b1; b++) { /* the two block bodies, each compiled for its digit count */
    const uint8_t *t = j->tiles + b * (j->K / 4) * 32;
    if (j->digits == 4)
      q4_block(t, j->in, j->scales, j->zeros, j->bias, j->y, b * 16, j->N, j->K, j->G, 4);
    else if (j->digits == 3)
      q4_block(t, j->in, j->scales, j->zeros, j->bias, j->y, b * 16, j->N, j->K, j->G, 3);
    else
      q4_block(t, j->in, j->scales, j->zeros, j->bias, j->y, b * 16, j->N, j->K, j->G, 2);
  }
  return NULL;
}

/* y [N] (fp32) = W x + bias. tiles: K * N / 2 bytes (see above); scales float16 [K/G][N]; zeros [K/G][N];
 * x fp32 [K]; bias fp32 [N] or NULL. N % 16 == 0, K % 16 == 0, G % 16 == 0, K % G == 0. digits: 4 for fp32
 * activations, 3 for fp16, 2 for bf16 (see above).
 * Returns 0; -1 when memory could not be had, -2 for a non-finite activation, -3 for a bad shape (nothing
 * written then). */
int edgekv_gemv_int4(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, const float *x,
                     const float *bias, float *y, int64_t N, int64_t K, int64_t G, int digits, int threads) {
  if (N <= 0 || K <= 0 || G <= 0 || N % 16 || K % 16 || G % Q4_ROWS_PER_CHUNK || K % G) return -3;
  if (digits < 2 || digits > 4) return -3;
  struct q4_input in;
  in.pairs = (uint32_t *)malloc((size_t)(Q4_DIGITS * (K / 2)) * sizeof(uint32_t));
  in.factor = (float *)malloc((size_t)(K / G) * sizeof(float));
  in.xsum = (float *)malloc((size_t)(K / G) * sizeof(float));
  int code = (in.pairs && in.factor && in.xsum) ? q4_prepare(x, K, G, digits, &in) : -1;
  if (code == 0) {
    const int64_t blocks = N / 16;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > blocks) threads = (int)blocks;
    struct q4_job jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    const int64_t per = (blocks + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
      const int64_t b0 = t * per < blocks ? t * per : blocks, b1 = b0 + per < blocks ? b0 + per : blocks;
      jobs[t] = (struct q4_job){tiles, &in, scales, zeros, bias, y, b0, b1, N, K, G, digits};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, q4_run, &jobs[t]) == 0;
    q4_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
      if (started[t])
        pthread_join(tids[t], NULL);
      else
        q4_run(&jobs[t]);
    }
  }
  free(in.pairs);
  free(in.factor);
  free(in.xsum);
  return code;
}

/* W [N][K] (nn.Linear's orientation) = (q - z) * s from the tiles: fp32 (out_bf16 == 0) or bf16 rounded to
 * nearest even (out_bf16 == 1). The prefill of a chunk multiplies this by its rows (torch's GEMM). */
int edgekv_dequant_int4(const uint8_t *tiles, const uint16_t *scales, const uint8_t *zeros, void *out, int out_bf16,
                        int64_t N, int64_t K, int64_t G) {
  if (N <= 0 || K <= 0 || G <= 0 || N % 16 || K % 4 || K % G) return -3;
  float *w32 = out_bf16 ? NULL : (float *)out;
  uint16_t *w16 = out_bf16 ? (uint16_t *)out : NULL;
  for (int64_t b = 0; b < N / 16; b++) {
    const uint8_t *t = tiles + b * (K / 4) * 32;
    for (int64_t k0 = 0; k0 < K; k0 += 4, t += 32) {
      const int64_t g = k0 / G;
      for (int c = 0; c < 16; c++) {
        const int64_t n = b * 16 + c;
        const float s = half_to_float(scales[g * N + n]), z = (float)zeros[g * N + n];
        const uint8_t b0 = t[2 * c], b1 = t[2 * c + 1];
        const float v[4] = {((float)(b0 & 15) - z) * s, ((float)(b1 & 15) - z) * s, ((float)(b0 >> 4) - z) * s,
                            ((float)(b1 >> 4) - z) * s};
        for (int r = 0; r < 4; r++) {
          if (w32)
            w32[n * K + k0 + r] = v[r];
          else
            w16[n * K + k0 + r] = narrow(v[r]);
        }
      }
    }
  }
  return 0;
}

/* 1: AVX2 integer products, 2: NEON, 0: the portable loop (for the 4-bit kernel). */
int edgekv_int4_simd(void) { return EDGEKV_AVX2 ? 1 : EDGEKV_NEON ? 2 : 0; }
