/* A stand-in for the CUDA driver API (libcuda.so.1) for machines without a GPU: one GPU of compute capability 9.0
   whose device memory is host memory (malloc), whose modules accept any ELF image and whose launches run nothing but
   are recorded (grid, block, the bytes of the first fake_record(n) parameters), so the tests can check what the CUDA runtime asks of the
   driver. fake_set() chooses a machine with no GPU, the device memory's size and a kernel's static shared memory. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static int no_device = 0;
static size_t mem_total = 1 << 20, mem_used = 0;
static int func_shared = 0;
static int record_params = 0;   /* how many parameters of a launch to record (the kernel's count: fake_record) */

/* the last launch */
int launches = 0;
unsigned last_grid[3], last_block[3];
uint64_t last_params[16];   /* the first bytes (up to 8) of each parameter, zero-extended */
char last_function[256];

void fake_set(int no_gpu, size_t memory, int shared) { no_device = no_gpu; mem_total = memory; func_shared = shared; }
void fake_record(int n) { record_params = n; }
size_t fake_mem_used(void) { return mem_used; }

CUresult cuInit(unsigned flags) { (void)flags; return no_device ? 100 : 0; }
CUresult cuDeviceGetCount(int *n) { *n = no_device ? 0 : 1; return 0; }
CUresult cuDeviceGet(int *d, int i) { if (i != 0) return 101; *d = i; return 0; }
CUresult cuDeviceGetName(char *name, int len, int d) { (void)d; strncpy(name, "Fake GPU", len); return 0; }
CUresult cuDeviceTotalMem_v2(size_t *bytes, int d) { (void)d; *bytes = mem_total; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int d) {
  (void)d;
  switch (attr) {
    case 1: *v = 1024; return 0;          /* threads per block */
    case 2: case 3: *v = 1024; return 0;  /* block x, y */
    case 4: *v = 64; return 0;            /* block z */
    case 5: *v = 2147483647; return 0;    /* grid x */
    case 6: case 7: *v = 65535; return 0; /* grid y, z */
    case 8: *v = 49152; return 0;         /* shared memory per block */
    case 75: *v = 9; return 0;            /* compute capability */
    case 76: *v = 0; return 0;
    case 111: *v = 1024; return 0;        /* shared memory reserved by the driver in each block */
  }
  return 1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) { (void)d; *ctx = (void *)0x1000; return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1000 ? 0 : 201; }
CUresult cuCtxSynchronize(void) { return 0; }

/* memory: each allocation is preceded by its size */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (n == 0) return 1;
  if (mem_used + n > mem_total) return 2;
  size_t *b = malloc(n + 16);
  if (!b) return 2;
  b[0] = n;
  mem_used += n;
  *p = (CUdeviceptr)(b + 2);
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { size_t *b = (size_t *)p - 2; mem_used -= b[0]; free(b); return 0; }
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) { *free_ = mem_total - mem_used; *total = mem_total; return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) { memcpy((void *)d, h, n); return 0; }
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) { memcpy(h, (void *)d, n); return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void *)d, (void *)s, n); return 0; }

/* modules and functions: a function is a copy of its name */
CUresult cuModuleLoadData(void **m, const void *image) {
  if (memcmp(image, "\x7f" "ELF", 4) != 0) return 200;   /* CUDA_ERROR_INVALID_IMAGE */
  *m = (void *)0x2000;
  return 0;
}
CUresult cuModuleUnload(void *m) { return m == (void *)0x2000 ? 0 : 400; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  (void)m;
  if (strncmp(name, "missing", 7) == 0) return 500;   /* CUDA_ERROR_NOT_FOUND */
  *f = strdup(name);
  return 0;
}
CUresult cuFuncGetAttribute(int *v, int attr, void *f) {
  (void)f;
  if (attr == 0) { *v = 1024; return 0; }
  if (attr == 1) { *v = func_shared; return 0; }
  return 1;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  (void)shared; (void)stream; (void)extra;
  launches++;
  last_grid[0] = gx; last_grid[1] = gy; last_grid[2] = gz;
  last_block[0] = bx; last_block[1] = by; last_block[2] = bz;
  strncpy(last_function, (const char *)f, sizeof(last_function) - 1);
  for (int i = 0; i < record_params && i < 16; i++) memcpy(&last_params[i], params[i], 8);
  return 0;
}

/* events: every kernel takes 1.5 ms */
CUresult cuEventCreate(void **e, unsigned flags) { (void)flags; *e = (void *)0x3000; return 0; }
CUresult cuEventRecord(void *e, void *stream) { (void)e; (void)stream; return 0; }
CUresult cuEventSynchronize(void *e) { (void)e; return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { (void)a; (void)b; *ms = 1.5f; return 0; }
CUresult cuEventDestroy_v2(void *e) { (void)e; return 0; }

CUresult cuGetErrorName(CUresult e, const char **s) {
  *s = e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : e == 200 ? "CUDA_ERROR_INVALID_IMAGE" : e == 500 ? "CUDA_ERROR_NOT_FOUND"
                                                                                              : "CUDA_ERROR_UNKNOWN";
  return 0;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "(from the stand-in driver)"; return 0; }
