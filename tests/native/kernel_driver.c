/* Runs kernels of kernels/cpu_gemv.c on inputs from a file, for tests/test_cpu_int4.py, test_cpu_int8_head.py and
 * test_cpu_fused_layer.py:
 * built for another architecture (aarch64: NEON) and run under an emulator, its outputs are compared with the host's.
 *   kernel_driver int4 IN OUT  IN: int64 N, K, G, threads, digits, P; tiles (K*N/2 bytes); scales (2*N*K/G bytes,
 *                              fp16); zeros (N*K/G bytes); x (4*P*K bytes, fp32: P rows)
 *                              OUT: int32 simd; y (4*N bytes: row 0 alone); Y (4*P*N bytes: the P rows at once);
 *                              W (4*N*K bytes, fp32 dequantized)
 *   kernel_driver q8 IN OUT    IN: int64 N, K, G, threads, P; tiles (N*K bytes, int8); scales (4*N*K/G bytes,
 *                              fp32); x (4*P*K bytes, fp32: P rows)
 *                              OUT: int32 simd; Y (4*P*N bytes)
 *   kernel_driver layer IN OUT IN: int64 P, d, Hq, Hkv, hd, inner, G, threads; float32 eps (and 4 bytes of padding);
 *                              then the weights q, k, v, o, gate, up, down, each: tiles (K*N/2 bytes), scales
 *                              (2*N*K/G, fp16), zeros (N*K/G), int64 has_bias, bias (4*N, fp32, if has_bias);
 *                              then bf16: norm1 [d], norm2 [d], x [P][d], cos [P][hd], sin [P][hd], a [P][Hq*hd]
 *                              OUT: int32 simd; bf16 q [P][Hq*hd], k, v [P][Hkv*hd] (pre) and out [P][d] (post of
 *                              x and a)  */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int edgekv_gemv_int4(const uint8_t *, const uint16_t *, const uint8_t *, const float *, const float *, float *,
                     int64_t, int64_t, int64_t, int, int);
int edgekv_gemm_int4(const uint8_t *, const uint16_t *, const uint8_t *, const float *, const float *, float *,
                     int64_t, int64_t, int64_t, int64_t, int, int);
int edgekv_dequant_int4(const uint8_t *, const uint16_t *, const uint8_t *, void *, int, int64_t, int64_t, int64_t, int);
int edgekv_gemm_q8(const int8_t *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int);
int edgekv_int4_simd(void);
struct edgekv_q4_linear {
  const uint8_t *tiles;
  const uint16_t *scales;
  const uint8_t *zeros;
  const float *bias;
  int64_t N, K, G;
};
int edgekv_layer_pre_bf16(const uint16_t *, const uint16_t *, float, const struct edgekv_q4_linear *,
                          const struct edgekv_q4_linear *, const struct edgekv_q4_linear *, const uint16_t *,
                          const uint16_t *, uint16_t *, uint16_t *, uint16_t *, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int);
int edgekv_layer_post_bf16(const uint16_t *, const uint16_t *, const struct edgekv_q4_linear *, const uint16_t *,
                           float, const struct edgekv_q4_linear *, const struct edgekv_q4_linear *,
                           const struct edgekv_q4_linear *, uint16_t *, int64_t, int64_t, int);

static void *take(FILE *f, size_t bytes) {
  void *p = malloc(bytes);
  if (!p || fread(p, 1, bytes, f) != bytes) exit(3);
  return p;
}

static int int4(FILE *in, FILE *out) {
  int64_t *dims = take(in, 6 * sizeof(int64_t));
  const int64_t N = dims[0], K = dims[1], G = dims[2], P = dims[5];
  uint8_t *tiles = take(in, (size_t)(K * N / 2));
  uint16_t *scales = take(in, (size_t)(2 * N * (K / G)));
  uint8_t *zeros = take(in, (size_t)(N * (K / G)));
  float *x = take(in, (size_t)(4 * P * K));
  float *y = malloc((size_t)(4 * N)), *rows = malloc((size_t)(4 * P * N)), *w = malloc((size_t)(4 * N * K));
  if (edgekv_gemv_int4(tiles, scales, zeros, x, NULL, y, N, K, G, (int)dims[4], (int)dims[3]) != 0) return 4;
  if (edgekv_gemm_int4(tiles, scales, zeros, x, NULL, rows, P, N, K, G, (int)dims[4], (int)dims[3]) != 0) return 6;
  if (edgekv_dequant_int4(tiles, scales, zeros, w, 0, N, K, G, (int)dims[3]) != 0) return 5;
  fwrite(y, 4, (size_t)N, out);
  fwrite(rows, 4, (size_t)(P * N), out);
  fwrite(w, 4, (size_t)(N * K), out);
  return 0;
}

static int q8(FILE *in, FILE *out) {
  int64_t *dims = take(in, 5 * sizeof(int64_t));
  const int64_t N = dims[0], K = dims[1], G = dims[2], P = dims[4];
  int8_t *tiles = take(in, (size_t)(N * K));
  float *scales = take(in, (size_t)(4 * N * (K / G)));
  float *x = take(in, (size_t)(4 * P * K));
  float *y = malloc((size_t)(4 * P * N));
  if (edgekv_gemm_q8(tiles, scales, x, y, P, N, K, G, (int)dims[3]) != 0) return 4;
  fwrite(y, 4, (size_t)(P * N), out);
  return 0;
}

static int layer(FILE *in, FILE *out) {
  int64_t *dims = take(in, 8 * sizeof(int64_t));
  const int64_t P = dims[0], d = dims[1], hq = dims[2], hkv = dims[3], hd = dims[4], inner = dims[5], G = dims[6];
  const int threads = (int)dims[7];
  float *eps = take(in, 8);
  const int64_t shapes[7][2] = {{hq * hd, d}, {hkv * hd, d}, {hkv * hd, d}, {d, hq * hd},
                                {inner, d},   {inner, d},    {d, inner}}; /* (N, K) */
  struct edgekv_q4_linear w[7];
  for (int i = 0; i < 7; i++) {
    const int64_t N = shapes[i][0], K = shapes[i][1];
    w[i].tiles = take(in, (size_t)(K * N / 2));
    w[i].scales = take(in, (size_t)(2 * N * (K / G)));
    w[i].zeros = take(in, (size_t)(N * (K / G)));
    const int64_t *has_bias = take(in, sizeof(int64_t));
    w[i].bias = *has_bias ? take(in, (size_t)(4 * N)) : NULL;
    w[i].N = N;
    w[i].K = K;
    w[i].G = G;
  }
  uint16_t *norm1 = take(in, (size_t)(2 * d)), *norm2 = take(in, (size_t)(2 * d)), *x = take(in, (size_t)(2 * P * d));
  uint16_t *cos = take(in, (size_t)(2 * P * hd)), *sin = take(in, (size_t)(2 * P * hd));
  uint16_t *a = take(in, (size_t)(2 * P * hq * hd));
  uint16_t *q = malloc((size_t)(2 * P * hq * hd)), *k = malloc((size_t)(2 * P * hkv * hd));
  uint16_t *v = malloc((size_t)(2 * P * hkv * hd)), *o = malloc((size_t)(2 * P * d));
  if (edgekv_layer_pre_bf16(x, norm1, eps[0], &w[0], &w[1], &w[2], cos, sin, q, k, v, P, d, hq, hkv, hd, threads))
    return 4;
  if (edgekv_layer_post_bf16(x, a, &w[3], norm2, eps[0], &w[4], &w[5], &w[6], o, P, d, threads)) return 5;
  fwrite(q, 2, (size_t)(P * hq * hd), out);
  fwrite(k, 2, (size_t)(P * hkv * hd), out);
  fwrite(v, 2, (size_t)(P * hkv * hd), out);
  fwrite(o, 2, (size_t)(P * d), out);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 4) return 2;
  FILE *in = fopen(argv[2], "rb"), *out = fopen(argv[3], "wb");
  if (!in || !out) return 2;
  const int32_t simd = edgekv_int4_simd();
  fwrite(&simd, sizeof simd, 1, out);
  const int code = strcmp(argv[1], "q8") == 0     ? q8(in, out)
                   : strcmp(argv[1], "int4") == 0 ? int4(in, out)
                   : strcmp(argv[1], "layer") == 0 ? layer(in, out)
                                                   : 2;
  fclose(in);
  fclose(out);
  return code;
}
