/* Hand-written C references for bench_cpu.py: each workload as a person would write it in plain C with OpenMP, on
   `nthreads` threads. Built at run time by bench_cpu.py with `gcc -O3 -march=native -mprefer-vector-width=512 -fopenmp
   -fPIC -shared` (gcc's tuning for some AVX-512 CPUs otherwise prefers 256-bit vectors) and called through ctypes on
   contiguous float32 numpy arrays. No -ffast-math: reductions are vectorized by `omp simd`. */
#include <math.h>
#include <string.h>

/* *** matmul: C[M,N] = A[M,K] @ B[K,N], row-major *** */

/* The register tile: TM rows x TN columns of C stay in registers (4 x 64 floats = 16 AVX-512 or 32 AVX2 registers)
   while k runs over a TK-long block, so each loaded B vector feeds TM multiply-adds. */
#define TM 4
#define TN 64
#define TK 256

static void matmul_tile(const float *A, const float *B, float *C, long N, long K, long i, long j, long k0, long k1) {
  float acc[TM][TN];
  for (int r = 0; r < TM; r++)
    for (int c = 0; c < TN; c++) acc[r][c] = C[(i + r) * N + j + c];
  for (long k = k0; k < k1; k++) {
    const float *b = B + k * N + j;
    for (int r = 0; r < TM; r++) {
      const float a = A[(i + r) * K + k];
      for (int c = 0; c < TN; c++) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < TM; r++)
    for (int c = 0; c < TN; c++) C[(i + r) * N + j + c] = acc[r][c];
}

/* The rows and columns left over when M or N isn't a multiple of the tile: a plain i-k-j loop. */
static void matmul_edge(const float *A, const float *B, float *C, long N, long K, long i, long j0, long j1, long k0,
                        long k1) {
  for (long k = k0; k < k1; k++) {
    const float a = A[i * K + k];
    for (long j = j0; j < j1; j++) C[i * N + j] += a * B[k * N + j];
  }
}

void ref_matmul(const float *A, const float *B, float *C, long M, long N, long K, int nthreads) {
  const long mt = M / TM * TM, nt = N / TN * TN;
  #pragma omp parallel num_threads(nthreads)
  {
    #pragma omp for schedule(static)
    for (long i = 0; i < M; i++) memset(C + i * N, 0, N * sizeof(float));
    for (long k0 = 0; k0 < K; k0 += TK) {
      const long k1 = k0 + TK < K ? k0 + TK : K;
      /* the threads share the rows; the implicit barrier keeps each k block's updates in order */
      #pragma omp for schedule(static)
      for (long i = 0; i < M; i += TM) {
        if (i < mt) {
          for (long j = 0; j < nt; j += TN) matmul_tile(A, B, C, N, K, i, j, k0, k1);
          for (long r = i; r < i + TM; r++) matmul_edge(A, B, C, N, K, r, nt, N, k0, k1);
        } else {
          for (long r = i; r < M; r++) matmul_edge(A, B, C, N, K, r, 0, N, k0, k1);
        }
      }
    }
  }
}

/* *** out = max(a*b + c, 0) *** */

void ref_fma_relu(const float *restrict a, const float *restrict b, const float *restrict c, float *restrict out, long n,
                  int nthreads) {
  #pragma omp parallel for simd num_threads(nthreads) schedule(static)
  for (long i = 0; i < n; i++) {
    const float v = a[i] * b[i] + c[i];
    out[i] = v > 0.0f ? v : 0.0f;
  }
}

/* *** out = in transposed (in: rows x cols), in 32x32 blocks so both sides read and write whole cache lines *** */

void ref_transpose(const float *restrict in, float *restrict out, long rows, long cols, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (long c0 = 0; c0 < cols; c0 += 32)
    for (long r0 = 0; r0 < rows; r0 += 32)
      for (long c = c0; c < c0 + 32 && c < cols; c++)
        for (long r = r0; r < r0 + 32 && r < rows; r++) out[c * rows + r] = in[r * cols + c];
}

/* *** sums *** */

static float row_sum(const float *restrict row, long cols) {
  float s = 0.0f;
  #pragma omp simd reduction(+:s)
  for (long j = 0; j < cols; j++) s += row[j];
  return s;
}

void ref_rowsum(const float *m, float *out, long rows, long cols, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (long r = 0; r < rows; r++) out[r] = row_sum(m + r * cols, cols);
}

/* The whole array: vectorized float partial sums per row-sized chunk, added up in double. */
double ref_sum(const float *x, long n, int nthreads) {
  const long chunk = 4096;
  double total = 0.0;
  #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(+:total)
  for (long i = 0; i < n; i += chunk) total += row_sum(x + i, i + chunk < n ? chunk : n - i);
  return total;
}

/* *** row-wise softmax and layernorm (no affine part) of a rows x cols matrix *** */

void ref_softmax(const float *x, float *out, long rows, long cols, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (long r = 0; r < rows; r++) {
    const float *restrict in = x + r * cols;
    float *restrict o = out + r * cols;
    float mx = -INFINITY, s = 0.0f;
    #pragma omp simd reduction(max:mx)
    for (long j = 0; j < cols; j++) mx = in[j] > mx ? in[j] : mx;
    for (long j = 0; j < cols; j++) { o[j] = expf(in[j] - mx); s += o[j]; }
    const float inv = 1.0f / s;
    #pragma omp simd
    for (long j = 0; j < cols; j++) o[j] *= inv;
  }
}

void ref_layernorm(const float *x, float *out, long rows, long cols, float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (long r = 0; r < rows; r++) {
    const float *restrict in = x + r * cols;
    float *restrict o = out + r * cols;
    const float mean = row_sum(in, cols) / (float)cols;
    float var = 0.0f;
    #pragma omp simd reduction(+:var)
    for (long j = 0; j < cols; j++) var += (in[j] - mean) * (in[j] - mean);
    const float rstd = 1.0f / sqrtf(var / (float)cols + eps);
    #pragma omp simd
    for (long j = 0; j < cols; j++) o[j] = (in[j] - mean) * rstd;
  }
}
