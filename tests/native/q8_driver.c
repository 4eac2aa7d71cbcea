/* Runs the int8 kernel of kernels/cpu_gemv.c on inputs from a file, for tests/test_cpu_int8_head.py: built for
 * another architecture (aarch64: NEON) and run under an emulator, its outputs are compared with the host's.
 *   q8_driver IN OUT     IN: int64 N, K, G, threads, P; tiles (N*K bytes, int8); scales (4*N*K/G bytes, fp32);
 *                        x (4*P*K bytes, fp32: P rows)
 *                        OUT: int32 simd; Y (4*P*N bytes)  */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int edgekv_gemm_q8(const int8_t *, const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int);
int edgekv_int4_simd(void);

static void *take(FILE *f, size_t bytes) {
  void *p = malloc(bytes);
  if (!p || fread(p, 1, bytes, f) != bytes) exit(3);
  return p;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  FILE *in = fopen(argv[1], "rb");
  if (!in) return 2;
  int64_t *dims = take(in, 5 * sizeof(int64_t));
  const int64_t N = dims[0], K = dims[1], G = dims[2], P = dims[4];
  int8_t *tiles = take(in, (size_t)(N * K));
  float *scales = take(in, (size_t)(4 * N * (K / G)));
  float *x = take(in, (size_t)(4 * P * K));
  fclose(in);
  float *y = malloc((size_t)(4 * P * N));
  if (edgekv_gemm_q8(tiles, scales, x, y, P, N, K, G, (int)dims[3]) != 0) return 4;
  FILE *out = fopen(argv[2], "wb");
  const int32_t simd = edgekv_int4_simd();
  fwrite(&simd, sizeof simd, 1, out);
  fwrite(y, 4, (size_t)(P * N), out);
  fclose(out);
  return 0;
}
