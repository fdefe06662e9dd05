/* A stand-in for the CUDA driver API (libcuda.so.1) for machines without a GPU: one or more GPUs of compute capability
   9.0 whose device memory is host memory (malloc), whose modules accept any ELF image and whose launches run nothing
   but are recorded (grid, block, the bytes of the parameters), so the tests can check what the CUDA runtime asks of
   the driver. Copies do copy (between host and device, device to device, peer to peer), so data that only moves can
   be checked end to end. Graphs are kept as the driver would: a graph's nodes, an instantiated copy of them that
   cuGraphExecKernelNodeSetParams changes, and its launches. Every call is appended to a log ("name@device ...").

   What the runtime must get right is checked, as the driver would refuse it: an address passed to a copy must lie in
   an allocation of the GPU it is given for, a launch's buffer parameters (as many as fake_params says) in allocations
   of the GPU whose context is current, an event is recorded in its own context's stream.

   fake_set() chooses a machine with no GPU, the device memory's size and a kernel's static shared memory;
   fake_devices() the number of GPUs and whether they reach each other's memory. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

/* CUDA_KERNEL_NODE_PARAMS as cuda.h declares it: the first version (the functions without _v2) and the second (CUDA
   12's _v2 functions), which adds the kernel (used when func is NULL) and the context (NULL: the current one) */
typedef struct {
  void *func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void **kernelParams;
  void **extra;
} CUDA_KERNEL_NODE_PARAMS;
typedef struct {
  void *func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void **kernelParams;
  void **extra;
  void *kern;
  void *ctx;
} CUDA_KERNEL_NODE_PARAMS_v2;

#define MAX_DEVICES 4
#define ERR_INVALID_VALUE 1
#define ERR_INVALID_CONTEXT 201
#define ERR_INVALID_HANDLE 400
#define ERR_ILLEGAL_ADDRESS 700

static int no_device = 0, n_devices = 1, peer_ok = 1;
static size_t mem_total = 1 << 20, mem_used = 0;
static int func_shared = 0;
static int record_params = 0;   /* how many parameters of a launch to record, for a kernel fake_params doesn't name */

/* the contexts: one per GPU; the current one is per thread, as the driver keeps it */
typedef struct { int device; } Context;
static Context contexts[MAX_DEVICES];
static __thread int current = -1;
static int peer_enabled[MAX_DEVICES][MAX_DEVICES];

/* the last launch */
int launches = 0;                 /* cuLaunchKernel calls */
int graph_launches = 0;           /* cuGraphLaunch calls */
int node_updates = 0;             /* cuGraphExecKernelNodeSetParams calls */
int peer_copies = 0, device_copies = 0, host_copies = 0;
unsigned last_grid[3], last_block[3];
uint64_t last_params[16];   /* the first bytes (up to 8) of each parameter, zero-extended */
char last_function[256];
int last_device = -1;       /* the GPU whose context was current at the last launch */
static long work_done = 0;   /* launches of kernels and graphs so far (what events time) */

/* the call log */
static char call_log[1 << 16];
static size_t log_len = 0;
static void note(const char *name) {
  char item[96];
  int n = snprintf(item, sizeof item, "%s@%d ", name, current >= 0 ? contexts[current].device : -1);
  if (n > 0 && log_len + (size_t)n < sizeof call_log) { memcpy(call_log + log_len, item, (size_t)n); log_len += (size_t)n; }
}
const char *fake_log(void) { call_log[log_len] = 0; return call_log; }
void fake_log_clear(void) { log_len = 0; }

/* kernels by name: how many parameters each takes and how many of them are buffers */
typedef struct { char name[128]; int params, buffers; } KernelInfo;
static KernelInfo kernels[256];
static int n_kernels = 0;
void fake_params(const char *name, int params, int buffers) {
  for (int i = 0; i < n_kernels; i++)
    if (strcmp(kernels[i].name, name) == 0) { kernels[i].params = params; kernels[i].buffers = buffers; return; }
  if (n_kernels == 256) return;
  strncpy(kernels[n_kernels].name, name, sizeof kernels[0].name - 1);
  kernels[n_kernels].params = params;
  kernels[n_kernels++].buffers = buffers;
}
static void kernel_info(const char *name, int *params, int *buffers) {
  for (int i = 0; i < n_kernels; i++)
    if (strcmp(kernels[i].name, name) == 0) { *params = kernels[i].params; *buffers = kernels[i].buffers; return; }
  *params = record_params; *buffers = 0;
}

void fake_devices(int n, int can_peer) { n_devices = n; peer_ok = can_peer; }
void fake_record(int n) { record_params = n; }
size_t fake_mem_used(void) { return mem_used; }
int fake_peer_enabled(int from, int to) { return peer_enabled[from][to]; }
size_t fake_node_params_size(int version) {
  return version == 2 ? sizeof(CUDA_KERNEL_NODE_PARAMS_v2) : sizeof(CUDA_KERNEL_NODE_PARAMS);
}
size_t fake_node_params_offset(int field) {   /* (of the second version) */
  switch (field) {
    case 0: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, func);
    case 1: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, gridDimX);
    case 6: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, blockDimZ);
    case 7: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, sharedMemBytes);
    case 8: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, kernelParams);
    case 9: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, extra);
    case 10: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, kern);
    case 11: return offsetof(CUDA_KERNEL_NODE_PARAMS_v2, ctx);
  }
  return (size_t)-1;
}

CUresult cuInit(unsigned flags) { (void)flags; return no_device ? 100 : 0; }
CUresult cuDeviceGetCount(int *n) { *n = no_device ? 0 : n_devices; return 0; }
CUresult cuDeviceGet(int *d, int i) { if (i < 0 || i >= n_devices) return 101; *d = i; return 0; }
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
CUresult cuDeviceCanAccessPeer(int *can, int d, int peer) {
  note("cuDeviceCanAccessPeer");
  if (d < 0 || d >= n_devices || peer < 0 || peer >= n_devices) return 101;
  *can = d != peer && peer_ok;
  return 0;
}
static int context_index(void *ctx) {
  for (int i = 0; i < n_devices; i++) if (ctx == &contexts[i]) return i;
  return -1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) {
  if (d < 0 || d >= n_devices) return 101;
  contexts[d].device = d;
  *ctx = &contexts[d];
  return 0;
}
CUresult cuCtxSetCurrent(void *ctx) {
  int i = context_index(ctx);
  if (i < 0) return ERR_INVALID_CONTEXT;
  current = i;
  return 0;
}
CUresult cuCtxSynchronize(void) { note("cuCtxSynchronize"); return current < 0 ? ERR_INVALID_CONTEXT : 0; }
CUresult cuCtxEnablePeerAccess(void *peer, unsigned flags) {
  note("cuCtxEnablePeerAccess");
  int p = context_index(peer);
  if (current < 0) return ERR_INVALID_CONTEXT;
  if (p < 0 || flags != 0) return ERR_INVALID_VALUE;
  if (!peer_ok || p == current) return 217;   /* CUDA_ERROR_PEER_ACCESS_UNSUPPORTED */
  if (peer_enabled[current][p]) return 704;   /* CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */
  peer_enabled[current][p] = 1;
  return 0;
}

/* memory: every live allocation is listed with its GPU, so an address can be checked */
typedef struct { char *base; size_t size; int device; } Allocation;
static Allocation allocations[4096];
static int n_allocations = 0;
/* the GPU of the allocation holding [p, p + n) (-1: none does) */
static int device_of(CUdeviceptr p, size_t n) {
  for (int i = 0; i < n_allocations; i++) {
    char *b = allocations[i].base;
    if ((char *)p >= b && (char *)p + n <= b + allocations[i].size) return allocations[i].device;
  }
  return -1;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (current < 0) return ERR_INVALID_CONTEXT;
  if (n == 0) return 1;
  if (mem_used + n > mem_total) return 2;
  if (n_allocations == 4096) return 2;
  char *b = malloc(n);
  if (!b) return 2;
  allocations[n_allocations++] = (Allocation){b, n, contexts[current].device};
  mem_used += n;
  *p = (CUdeviceptr)b;
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  for (int i = 0; i < n_allocations; i++)
    if (allocations[i].base == (char *)p) {
      mem_used -= allocations[i].size;
      free(allocations[i].base);
      allocations[i] = allocations[--n_allocations];
      return 0;
    }
  return ERR_INVALID_VALUE;
}
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) { *free_ = mem_total - mem_used; *total = mem_total; return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) {
  note("cuMemcpyHtoD_v2");
  if (device_of(d, n) < 0) return ERR_INVALID_VALUE;
  memcpy((void *)d, h, n);
  host_copies++;
  return 0;
}
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) {
  note("cuMemcpyDtoH_v2");
  if (device_of(d, n) < 0) return ERR_INVALID_VALUE;
  memcpy(h, (void *)d, n);
  host_copies++;
  return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *stream) {
  note("cuMemcpyDtoDAsync_v2");
  if (stream != NULL) return ERR_INVALID_HANDLE;   /* (the runtime uses the context's default stream) */
  if (current < 0) return ERR_INVALID_CONTEXT;
  int dev = contexts[current].device;
  if (device_of(d, n) != dev || device_of(s, n) != dev) return ERR_INVALID_VALUE;
  memmove((void *)d, (void *)s, n);
  device_copies++;
  return 0;
}
CUresult cuMemcpyPeerAsync(CUdeviceptr d, void *dctx, CUdeviceptr s, void *sctx, size_t n, void *stream) {
  note("cuMemcpyPeerAsync");
  int di = context_index(dctx), si = context_index(sctx);
  if (stream != NULL) return ERR_INVALID_HANDLE;
  if (di < 0 || si < 0) return ERR_INVALID_CONTEXT;
  if (device_of(d, n) != di || device_of(s, n) != si) return ERR_INVALID_VALUE;
  memmove((void *)d, (void *)s, n);
  peer_copies++;
  return 0;
}

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

/* a launch's parameters as recorded; ILLEGAL_ADDRESS when a buffer parameter isn't memory of GPU `device` */
static CUresult read_params(const char *name, void **params, uint64_t *out, int device) {
  int n, buffers;
  kernel_info(name, &n, &buffers);
  memset(out, 0, 16 * sizeof(uint64_t));
  for (int i = 0; i < n && i < 16; i++) memcpy(&out[i], params[i], 8);
  for (int i = 0; i < buffers && i < 16; i++) if (device_of(out[i], 1) != device) return ERR_ILLEGAL_ADDRESS;
  return 0;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  (void)shared; (void)extra;
  note("cuLaunchKernel");
  if (current < 0) return ERR_INVALID_CONTEXT;
  if (stream != NULL) return ERR_INVALID_HANDLE;
  CUresult r = read_params((const char *)f, params, last_params, contexts[current].device);
  if (r) return r;
  launches++;
  work_done++;
  last_device = contexts[current].device;
  last_grid[0] = gx; last_grid[1] = gy; last_grid[2] = gz;
  last_block[0] = bx; last_block[1] = by; last_block[2] = bz;
  strncpy(last_function, (const char *)f, sizeof(last_function) - 1);
  return 0;
}

/* events: every launch (of a kernel or a graph) between two events takes 1.5 ms */
typedef struct { int context, flags, recorded; long at; } Event;
int events_made = 0;
CUresult cuEventCreate(void **e, unsigned flags) {
  if (current < 0) return ERR_INVALID_CONTEXT;
  Event *ev = calloc(1, sizeof(Event));
  ev->context = current; ev->flags = (int)flags;
  *e = ev;
  events_made++;
  return 0;
}
CUresult cuEventRecord(void *e, void *stream) {
  note("cuEventRecord");
  Event *ev = e;
  if (stream != NULL) return ERR_INVALID_HANDLE;
  if (ev->context != current) return ERR_INVALID_HANDLE;   /* an event is recorded in its own context */
  ev->recorded = 1; ev->at = work_done;
  return 0;
}
CUresult cuEventSynchronize(void *e) { (void)e; return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
  Event *x = a, *y = b;
  if (!x->recorded || !y->recorded || (x->flags & 2) || (y->flags & 2)) return ERR_INVALID_HANDLE;
  *ms = 1.5f * (float)(y->at - x->at);
  return 0;
}
CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
CUresult cuStreamWaitEvent(void *stream, void *e, unsigned flags) {
  note("cuStreamWaitEvent");
  Event *ev = e;
  if (stream != NULL || flags != 0) return ERR_INVALID_VALUE;
  if (!ev->recorded) return ERR_INVALID_HANDLE;
  return 0;
}

/* graphs: a graph is a list of kernel nodes; an instantiated graph (exec) a copy of it */
#define MAX_NODES 64
typedef struct {
  char func[128];
  unsigned dims[7];        /* grid x, y, z, block x, y, z, shared memory */
  uint64_t params[16];
  int dependency;          /* the node it waits for (-1: none; -2: several) */
} Node;
typedef struct { int device, n; Node nodes[MAX_NODES]; } Graph;
typedef struct { Graph graph; int launches; } Exec;
static Graph *graphs[64];
static Exec *execs[64];
static int n_graphs = 0, n_execs = 0;

static CUresult set_node(Node *node, const CUDA_KERNEL_NODE_PARAMS *p, int device) {
  const char *name = (const char *)p->func;
  if (p->extra != NULL || p->kernelParams == NULL) return ERR_INVALID_VALUE;
  CUresult r = read_params(name, p->kernelParams, node->params, device);
  if (r) return r;
  strncpy(node->func, name, sizeof node->func - 1);
  unsigned dims[7] = {p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX, p->blockDimY, p->blockDimZ,
                      p->sharedMemBytes};
  memcpy(node->dims, dims, sizeof dims);
  return 0;
}
CUresult cuGraphCreate(void **g, unsigned flags) {
  note("cuGraphCreate");
  if (flags != 0 || current < 0 || n_graphs == 64) return ERR_INVALID_VALUE;
  Graph *graph = calloc(1, sizeof(Graph));
  graph->device = contexts[current].device;
  graphs[n_graphs++] = graph;
  *g = graph;
  return 0;
}
CUresult cuGraphAddKernelNode(void **node, void *g, void *const *deps, size_t n_deps,
                              const CUDA_KERNEL_NODE_PARAMS *p) {
  note("cuGraphAddKernelNode");
  Graph *graph = g;
  if (graph->n == MAX_NODES) return ERR_INVALID_VALUE;
  Node *made = &graph->nodes[graph->n];
  memset(made, 0, sizeof *made);
  made->dependency = n_deps == 0 ? -1 : n_deps > 1 ? -2 : -3;
  if (n_deps == 1) {
    for (int i = 0; i < graph->n; i++) if (deps[0] == &graph->nodes[i]) made->dependency = i;
    if (made->dependency == -3) return ERR_INVALID_VALUE;   /* not a node of this graph */
  }
  CUresult r = set_node(made, p, graph->device);
  if (r) return r;
  graph->n++;
  *node = made;
  return 0;
}
CUresult cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long flags) {
  note("cuGraphInstantiateWithFlags");
  if (flags != 0 || n_execs == 64) return ERR_INVALID_VALUE;
  Exec *exec = calloc(1, sizeof(Exec));
  exec->graph = *(Graph *)g;
  execs[n_execs++] = exec;
  *e = exec;
  return 0;
}
CUresult cuGraphExecKernelNodeSetParams(void *e, void *node, const CUDA_KERNEL_NODE_PARAMS *p) {
  note("cuGraphExecKernelNodeSetParams");
  Exec *exec = e;
  /* the node is one of the graph the exec was made from: the same place in its copy */
  for (int g = 0; g < n_graphs; g++) {
    Graph *graph = graphs[g];
    if ((Node *)node < graph->nodes || (Node *)node >= graph->nodes + graph->n) continue;
    int k = (int)((Node *)node - graph->nodes);
    if (k >= exec->graph.n || strcmp(exec->graph.nodes[k].func, (const char *)p->func) != 0) return ERR_INVALID_VALUE;
    CUresult r = set_node(&exec->graph.nodes[k], p, exec->graph.device);
    if (r) return r;
    node_updates++;
    return 0;
  }
  return ERR_INVALID_HANDLE;
}
CUresult cuGraphLaunch(void *e, void *stream) {
  note("cuGraphLaunch");
  Exec *exec = e;
  if (stream != NULL) return ERR_INVALID_HANDLE;
  if (current < 0 || contexts[current].device != exec->graph.device) return ERR_INVALID_CONTEXT;
  exec->launches++;
  graph_launches++;
  work_done++;
  return 0;
}
/* the second versions: the same, for a node that names its function (kern NULL) in the graph's context */
static CUresult check_v2(const CUDA_KERNEL_NODE_PARAMS_v2 *p, int device) {
  if (p->func == NULL || p->kern != NULL) return ERR_INVALID_VALUE;
  if (p->ctx != NULL && context_index(p->ctx) != device) return ERR_INVALID_CONTEXT;
  return 0;
}
CUresult cuGraphAddKernelNode_v2(void **node, void *g, void *const *deps, size_t n_deps,
                                 const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
  CUresult r = check_v2(p, ((Graph *)g)->device);
  if (r) return r;
  note("v2");
  return cuGraphAddKernelNode(node, g, deps, n_deps, (const CUDA_KERNEL_NODE_PARAMS *)p);
}
CUresult cuGraphExecKernelNodeSetParams_v2(void *e, void *node, const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
  CUresult r = check_v2(p, ((Exec *)e)->graph.device);
  if (r) return r;
  note("v2");
  return cuGraphExecKernelNodeSetParams(e, node, (const CUDA_KERNEL_NODE_PARAMS *)p);
}
CUresult cuGraphExecDestroy(void *e) { (void)e; return 0; }   /* (kept: the tests read the last ones made) */
CUresult cuGraphDestroy(void *g) { (void)g; return 0; }

/* a fresh machine: no memory allocated, no graphs, nothing counted (what was allocated before is freed) */
void fake_set(int no_gpu, size_t memory, int shared) {
  no_device = no_gpu; mem_total = memory; func_shared = shared;
  n_devices = 1; peer_ok = 1; n_kernels = 0; record_params = 0;
  memset(peer_enabled, 0, sizeof peer_enabled);
  for (int i = 0; i < n_allocations; i++) free(allocations[i].base);
  n_allocations = 0; mem_used = 0;
  for (int i = 0; i < n_graphs; i++) free(graphs[i]);
  for (int i = 0; i < n_execs; i++) free(execs[i]);
  n_graphs = n_execs = 0;
  launches = graph_launches = node_updates = peer_copies = device_copies = host_copies = 0;
  log_len = 0;
}
/* what the tests read of the instantiated graphs (the latest is n - 1) */
int fake_execs(void) { return n_execs; }
int fake_exec_nodes(int e) { return execs[e]->graph.n; }
int fake_exec_launches(int e) { return execs[e]->launches; }
int fake_exec_device(int e) { return execs[e]->graph.device; }
const char *fake_exec_function(int e, int k) { return execs[e]->graph.nodes[k].func; }
unsigned fake_exec_dim(int e, int k, int i) { return execs[e]->graph.nodes[k].dims[i]; }
uint64_t fake_exec_param(int e, int k, int i) { return execs[e]->graph.nodes[k].params[i]; }
int fake_exec_dependency(int e, int k) { return execs[e]->graph.nodes[k].dependency; }

CUresult cuGetErrorName(CUresult e, const char **s) {
  *s = e == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : e == 200 ? "CUDA_ERROR_INVALID_IMAGE" : e == 500 ? "CUDA_ERROR_NOT_FOUND"
     : e == 1 ? "CUDA_ERROR_INVALID_VALUE" : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT"
     : e == 400 ? "CUDA_ERROR_INVALID_HANDLE" : e == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
  return 0;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "(from the stand-in driver)"; return 0; }
