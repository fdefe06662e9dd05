/* Hand-written C references for bench_core.py: the memory-bound kernels as a person would write them, split across
   `nthreads` pthreads (the caller's thread runs the first chunk). Built by bench_core.py with
   `cc -O3 -march=native -fPIC -shared` and called through ctypes on numpy arrays (contiguous float32). */
#include <pthread.h>
#include <stddef.h>

#define MAX_THREADS 64

/* One chunk of a kernel: rows/elements [lo, hi) of the job described by `args`. */
typedef void (*range_fn)(const void *args, long lo, long hi);

struct chunk { range_fn fn; const void *args; long lo, hi; };

static void *run_chunk(void *p) {
  const struct chunk *c = p;
  c->fn(c->args, c->lo, c->hi);
  return NULL;
}

/* fn over [0, n) in nthreads contiguous chunks; chunk borders are multiples of 16 items so two threads never write
   to the same 64-byte cache line. A thread that can't be started has its chunk run by the caller instead. */
static void parallel_for(range_fn fn, const void *args, long n, int nthreads) {
  if (nthreads < 1) nthreads = 1;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  struct chunk chunks[MAX_THREADS];
  pthread_t tids[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int t = 0; t < nthreads; t++) {
    long lo = (n * t / nthreads) & ~15L, hi = t == nthreads - 1 ? n : (n * (t + 1) / nthreads) & ~15L;
    chunks[t] = (struct chunk){fn, args, lo, hi};
  }
  for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&tids[t], NULL, run_chunk, &chunks[t]) == 0;
  run_chunk(&chunks[0]);
  for (int t = 1; t < nthreads; t++) {
    if (started[t]) pthread_join(tids[t], NULL);
    else run_chunk(&chunks[t]);
  }
}

/* *** out[i] = max(x[i]*y[i] + z[i], 0) * 0.5 *** */

struct ew_args { const float *x, *y, *z; float *out; };

static void ew_range(const void *a, long lo, long hi) {
  const struct ew_args *p = a;
  const float *restrict x = p->x, *restrict y = p->y, *restrict z = p->z;
  float *restrict out = p->out;
  for (long i = lo; i < hi; i++) {
    float v = x[i] * y[i] + z[i];
    out[i] = (v > 0.0f ? v : 0.0f) * 0.5f;
  }
}

void ref_elementwise(const float *x, const float *y, const float *z, float *out, long n, int nthreads) {
  struct ew_args a = {x, y, z, out};
  parallel_for(ew_range, &a, n, nthreads);
}

/* *** out[r] = sum of row r of a rows x cols matrix *** */

struct rowsum_args { const float *m; float *out; long cols; };

static void rowsum_range(const void *a, long lo, long hi) {
  const struct rowsum_args *p = a;
  const long cols = p->cols;
  for (long r = lo; r < hi; r++) {
    const float *restrict row = p->m + r * cols;
    /* 16 independent partial sums: the compiler may not reorder float additions, so a single accumulator would be
       one add at a time (latency-bound, far below memory speed); 16 lanes map onto SIMD registers as written. */
    float acc[16] = {0};
    long j = 0;
    for (; j + 16 <= cols; j += 16)
      for (int k = 0; k < 16; k++) acc[k] += row[j + k];
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    for (; j < cols; j++) s += row[j];
    p->out[r] = s;
  }
}

void ref_rowsum(const float *m, float *out, long rows, long cols, int nthreads) {
  struct rowsum_args a = {m, out, cols};
  parallel_for(rowsum_range, &a, rows, nthreads);
}

/* *** dst[i] = src[i]: the machine's memory bandwidth figure *** */

struct copy_args { const float *src; float *dst; };

static void copy_range(const void *a, long lo, long hi) {
  const struct copy_args *p = a;
  const float *restrict src = p->src;
  float *restrict dst = p->dst;
  for (long i = lo; i < hi; i++) dst[i] = src[i];
}

void ref_copy(const float *src, float *dst, long n, int nthreads) {
  struct copy_args a = {src, dst};
  parallel_for(copy_range, &a, n, nthreads);
}
