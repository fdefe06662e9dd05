"""The CPU device: C rendered by ClangRenderer, compiled by the system C compiler into a shared object, loaded with
ctypes and called on host memory. One kernel can be split across cores by calling it from several threads on
disjoint ranges of its outermost loop (ctypes releases the GIL during the call)."""
from __future__ import annotations
import _ctypes
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any
from fusegrad.device import Compiled, CompileError, Compiler, LRUAllocator, numbered
from fusegrad.helpers import CPU_THREADS, DEBUG, host_cpu_count

# *** memory ***

ALIGN = 64  # bytes: a cache line, and enough for any SIMD load the renderer emits

def _libc_allocator() -> tuple[Any, Any, Any] | None:
    try:
        libc = ctypes.CDLL(None)
        alloc, free = libc.aligned_alloc, libc.free
    except (OSError, AttributeError): return None
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return alloc, free, madvise

# big allocations are aligned to and advised for 2 MiB pages (MADV_HUGEPAGE, Linux; where transparent huge pages are
# off it changes nothing): 512 times fewer TLB entries and first-touch page faults for a kernel streaming through tens
# of megabytes (a fused elementwise kernel over 2^24 floats: about 8% faster)
HUGE_PAGE, HUGE_MIN, MADV_HUGEPAGE = 1 << 21, 1 << 22, 14

_LIBC = _libc_allocator()

class CPUAllocator(LRUAllocator):
    """64-byte aligned host memory. An allocation is a ctypes byte array (so it can be passed straight to a kernel);
    it is freed when it and every view of it are garbage collected."""
    def _alloc(self, size: int, options: Any) -> ctypes.Array:
        if _LIBC is None:
            # no libc: over-allocate a ctypes array (zero-filled, so slower) and take the aligned part
            raw = (ctypes.c_uint8 * (size + ALIGN - 1))()
            return (ctypes.c_uint8 * size).from_buffer(raw, -ctypes.addressof(raw) % ALIGN)
        # malloc'd memory isn't zero-filled and reuses freed heap pages, which is much cheaper than fresh zero pages
        huge = size >= HUGE_MIN and _LIBC[2] is not None and sys.platform.startswith("linux")
        align = HUGE_PAGE if huge else ALIGN
        ptr = _LIBC[0](align, max(align, -(-size // align) * align))
        if not ptr: raise MemoryError(f"can't allocate {size} bytes of host memory")
        if huge: _LIBC[2](ptr, -(-size // align) * align, MADV_HUGEPAGE)  # a hint: failure changes nothing
        ret = (ctypes.c_uint8 * size).from_address(ptr)
        # the memory is freed when the array object is collected. When it dies in a reference cycle, the garbage
        # collector runs this finalizer before the owning Buffer's __del__ hands the array back to the LRU cache,
        # so _reusable checks that the finalizer hasn't run (reusing the array then would be a use after free)
        ret._finalizer = weakref.finalize(ret, _LIBC[1], ptr)
        ret._finalizer.atexit = False  # at exit the OS takes the memory back anyway
        return ret

    def _offset(self, opaque: ctypes.Array, size: int, offset: int) -> ctypes.Array:
        view = (ctypes.c_uint8 * size).from_buffer(opaque, offset)
        view._root = getattr(opaque, "_root", opaque)  # exports are tracked on the allocation itself
        return view

    def _as_buffer(self, opaque: ctypes.Array) -> memoryview:
        # a separate ctypes object per export, so free() can see (via weakrefs) whether a memoryview still uses it
        exp = (ctypes.c_uint8 * len(opaque)).from_buffer(opaque)
        root = getattr(opaque, "_root", opaque)
        exports = root.__dict__.setdefault("_exports", [])
        exports[:] = [r for r in exports if r() is not None] + [weakref.ref(exp)]
        return memoryview(exp).cast("B")

    def _reusable(self, opaque: ctypes.Array) -> bool:
        # memory a live memoryview (e.g. a numpy array) still reads must not be handed to another Buffer
        if any(r() is not None for r in opaque.__dict__.get("_exports", ())): return False
        fin = opaque.__dict__.get("_finalizer")
        return fin is None or fin.alive

    def _copyin(self, dest: ctypes.Array, src: memoryview) -> None: memoryview(dest).cast("B")[:] = src
    def _copyout(self, dest: memoryview, src: ctypes.Array) -> None: dest[:] = memoryview(src).cast("B")

def address(opaque: ctypes.Array) -> int:
    """The address of a CPU allocation, for passing to C code."""
    return ctypes.addressof(opaque)

# *** compiler ***

DEFAULT_FLAGS = ["-O2", "-march=native", "-fno-math-errno"]

@functools.cache
def find_cc() -> list[str]:
    """The C compiler command: $CC (may include arguments), else the first of cc, gcc, clang on PATH."""
    if cc := os.getenv("CC"): return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        if path := shutil.which(name): return [path]
    raise CompileError("no C compiler found: set CC or install cc, gcc or clang")

@functools.cache
def _cc_version(cc: tuple[str, ...]) -> str:
    try: out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired): return "unknown"
    return out.splitlines()[0] if out else "unknown"

@functools.cache
def _host_cpu() -> str:
    # -march=native binaries only run on this kind of CPU, so a cache shared between machines must tell them apart
    try:
        with open("/proc/cpuinfo") as f: info = f.read()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return hashlib.sha256("\n".join(dict.fromkeys(lines)).encode()).hexdigest()[:16]
    except OSError: return platform.processor() or platform.machine()

BATCH_KERNELS = 24  # kernels per compiler process when a schedule has many new ones

def _kernel_name(src: str) -> str | None:
    """The name of the (last) exported function of a kernel's C source."""
    names = re.findall(r"^void (\w+)\(", src, flags=re.MULTILINE)
    return names[-1] if names else None

class CPUCompiler(Compiler):
    """C source -> shared object bytes, with the system C compiler. `flags` are the code generation flags (the
    renderer's `compile_flags` when it has them); the flags that make a shared object are always added."""
    parallel = True  # every compile is its own process
    def __init__(self, flags: list[str] | None = None):
        self.flags = list(DEFAULT_FLAGS if flags is None else flags)
        self.cc = find_cc()
        host = _host_cpu() if any("native" in f for f in self.flags) else ""
        super().__init__(f"{self.cc}|{_cc_version(tuple(self.cc))}|{self.flags}|{host}")

    def compile(self, src: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="fusegrad-cc-") as d:
            out = os.path.join(d, "k.so")
            cmd = [*self.cc, *self.flags, "-shared", "-fPIC", "-x", "c", "-", "-o", out, "-lm"]
            try: res = subprocess.run(cmd, input=src.encode(), capture_output=True)
            except OSError as e: raise CompileError(f"can't run {shlex.join(cmd)}: {e}\n{numbered(src)}") from e
            if res.returncode != 0:
                raise CompileError(f"{shlex.join(cmd)} failed:\n{res.stderr.decode(errors='replace').strip()}\n"
                                   f"--- source ---\n{numbered(src)}")
            with open(out, "rb") as f: return f.read()

    def _compile_all(self, srcs: list[str]) -> list[bytes]:
        # starting the compiler costs more than compiling a small kernel, so kernels are compiled a batch at a time:
        # one translation unit (one shared object) per batch, the batches in parallel. Kernels with pragmas of their
        # own, and kernels named like one already in the batch, go to other batches.
        if len(srcs) < 2: return super()._compile_all(srcs)
        nbatches = max(host_cpu_count(), -(-len(srcs) // BATCH_KERNELS))
        batches: list[list[int]] = [[] for _ in range(nbatches)]
        names: list[set[str]] = [set() for _ in range(nbatches)]
        for i, src in enumerate(srcs):
            name = _kernel_name(src)
            fits = [b for b in range(len(batches)) if name is not None and "#pragma" not in src and name not in names[b]
                    and all("#pragma" not in srcs[j] for j in batches[b])]
            if not fits: batches.append([i]); names.append({name or ""}); continue
            b = min(fits, key=lambda b: len(batches[b]))
            batches[b].append(i)
            names[b].add(name)  # type: ignore[arg-type]
        batches = [b for b in batches if b]
        units = ["\n".join(srcs[i] for i in b) for b in batches]
        try: libs = super()._compile_all(units)
        except CompileError:
            if all(len(b) == 1 for b in batches): raise
            return super()._compile_all(srcs)  # one by one, so the error names the kernel that failed
        out: list[bytes] = [b""] * len(srcs)
        for b, lib in zip(batches, libs):
            for i in b: out[i] = lib
        return out

    def validate(self, lib: bytes) -> bool:
        return lib.startswith(b"\x7fELF") if sys.platform.startswith("linux") else len(lib) > 0

# *** programs ***

class _ThreadPool:
    """Persistent worker threads that run (function, args) tasks; the caller runs one share of the work itself."""
    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.nworkers, self.lock = 0, threading.Lock()

    def _work(self) -> None:
        while True:
            fxn, args, done = self.tasks.get()
            try:
                fxn(*args)
                done.put(None)
            except BaseException as e: done.put(e)

    def run(self, fxn: Any, argsets: list[tuple]) -> None:
        """fxn(*a) for every a in argsets, concurrently; returns when all are done, raising the first error."""
        with self.lock:
            while self.nworkers < len(argsets) - 1:
                threading.Thread(target=self._work, name=f"fusegrad-cpu-{self.nworkers}", daemon=True).start()
                self.nworkers += 1
        done: queue.SimpleQueue = queue.SimpleQueue()
        for args in argsets[1:]: self.tasks.put((fxn, args, done))
        err: BaseException | None = None
        try: fxn(*argsets[0])
        except BaseException as e: err = e
        for _ in argsets[1:]:
            if (e := done.get()) is not None and err is None: err = e
        if err is not None: raise err

_pool = _ThreadPool()
# a forked child has none of the parent's worker threads: it starts its own
if hasattr(os, "register_at_fork"): os.register_at_fork(after_in_child=lambda: _pool.__init__())

# The same, in C: kernels rendered with an `<name>_entry(void **args, long lo, long hi)` wrapper are split across
# threads without Python in between. Workers spin for about 10 us after a job (kernels of a step follow each other
# within microseconds), then yield the core a while and sleep: spinning longer would take the core from other
# processes (two test workers on two cores ran 2.5x slower with ~150 us of spinning). While jobs come in a burst
# (a realize loop: ~100-300 us of Python between kernels) they keep yielding for 500 us instead of 30: a sleeping
# worker takes ~50 us to wake, a yielding one gives its core to any other runnable thread at once. A dispatch costs
# a few microseconds where the Python pool's costs tens. The chunks of a job are claimed from a shared ticket (the job's
# generation and the next chunk), and the calling thread claims whatever is left after its own: a worker the OS
# doesn't run in time (another process's threads spinning on the other core) costs that chunk's time, not the
# scheduler's next tick (4 ms, measured after a numpy matmul: OpenBLAS's threads spin for ~0.1 s).
_C_POOL_SRC = r"""
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
typedef void (*fg_entry)(void **, long, long);
#define FG_MAX_WORKERS 255
#define FG_SPIN 300            /* pauses (about 10 us), then yields to other runnable threads for */
#define FG_YIELD_NS 30000L     /* 30 us, or when jobs come in a burst (this one posted within FG_HOT_GAP_NS of */
#define FG_HOT_YIELD_NS 500000L /* the end of the one before) 500 us, then sleep */
#define FG_HOT_GAP_NS 1000000L
static pthread_mutex_t fg_run_mu = PTHREAD_MUTEX_INITIALIZER, fg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fg_cv = PTHREAD_COND_INITIALIZER;
static atomic_long fg_gen;
static atomic_ulong fg_ticket;   /* (generation << 32) | the next unclaimed chunk of the current job */
static atomic_int fg_done;       /* chunks of the current job finished */
static atomic_int fg_hot;       /* the current job came within FG_HOT_GAP_NS of the one before */
static long fg_last_ns;          /* when the last job ended */
static int fg_workers, fg_atfork;
static long fg_start[FG_MAX_WORKERS + 1];
static fg_entry fg_fn;
static void **fg_args;
static long fg_size;
static int fg_n;
static inline void fg_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}
static inline long fg_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000L + ts.tv_nsec;
}
/* claim and run chunks of job `gen` until none is left; returns how many this thread ran. A claim succeeds only
   while the ticket still names that job, and the job can't end while a claimed chunk runs, so its function and
   arguments stay valid */
static int fg_claim(unsigned long gen) {
  int ran = 0;
  for (;;) {
    unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
    unsigned long i = t & 0xffffffffUL;
    if ((t >> 32) != (gen & 0xffffffffUL) || i >= (unsigned long)fg_n) return ran;
    if (!atomic_compare_exchange_weak_explicit(&fg_ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
      continue;
    fg_fn(fg_args, fg_size * (long)i / fg_n, fg_size * (long)(i + 1) / fg_n);
    ran++;
  }
}
static void *fg_worker(void *arg) {
  long id = (long)arg, seen = fg_start[id];
  for (;;) {
    long yield_until = 0;
    for (int spin = 0; atomic_load_explicit(&fg_gen, memory_order_acquire) == seen; spin++) {
      if (spin < FG_SPIN) { fg_relax(); continue; }
      if (spin == FG_SPIN) yield_until = fg_now_ns() + (atomic_load(&fg_hot) ? FG_HOT_YIELD_NS : FG_YIELD_NS);
      if ((spin & 15) || fg_now_ns() < yield_until) { sched_yield(); continue; }
      pthread_mutex_lock(&fg_mu);
      while (atomic_load(&fg_gen) == seen) pthread_cond_wait(&fg_cv, &fg_mu);
      pthread_mutex_unlock(&fg_mu);
    }
    seen = atomic_load(&fg_gen);
    int ran = fg_claim((unsigned long)seen);
    if (ran) atomic_fetch_add_explicit(&fg_done, ran, memory_order_release);
  }
  return 0;
}
/* a forked child has none of the parent's threads: no workers, and locks and a condition variable that no thread
   holds or waits on (the parent's sleeping workers would leave the condition variable waiting for them forever) */
static void fg_forget_workers(void) {
  fg_workers = 0;
  pthread_mutex_init(&fg_run_mu, 0);
  pthread_mutex_init(&fg_mu, 0);
  pthread_cond_init(&fg_cv, 0);
}
int fg_pool_run(fg_entry fn, void **args, long size, int n) {
  if (n > FG_MAX_WORKERS + 1) n = FG_MAX_WORKERS + 1;
  pthread_mutex_lock(&fg_run_mu);
  if (!fg_atfork) { pthread_atfork(0, 0, fg_forget_workers); fg_atfork = 1; }
  while (fg_workers < n - 1) {
    pthread_t t;
    fg_start[fg_workers + 1] = atomic_load(&fg_gen);
    if (pthread_create(&t, 0, fg_worker, (void *)(long)(fg_workers + 1))) break;
    pthread_detach(t);
    fg_workers++;
  }
  if (n > fg_workers + 1) n = fg_workers + 1;
  fg_fn = fn; fg_args = args; fg_size = size; fg_n = n;
  atomic_store_explicit(&fg_done, 0, memory_order_relaxed);
  atomic_store_explicit(&fg_hot, fg_now_ns() - fg_last_ns < FG_HOT_GAP_NS, memory_order_relaxed);
  unsigned long gen = (unsigned long)atomic_load(&fg_gen) + 1;
  /* chunk 0 is this thread's: the ticket starts at chunk 1, published before the generation the workers wait on */
  atomic_store_explicit(&fg_ticket, ((gen & 0xffffffffUL) << 32) | 1, memory_order_release);
  pthread_mutex_lock(&fg_mu);
  atomic_store_explicit(&fg_gen, (long)gen, memory_order_release);
  pthread_cond_broadcast(&fg_cv);
  pthread_mutex_unlock(&fg_mu);
  fn(args, 0, size / n);
  int ran = 1 + fg_claim(gen);
  atomic_fetch_add_explicit(&fg_done, ran, memory_order_release);
  for (int spin = 0; atomic_load_explicit(&fg_done, memory_order_acquire) < n; spin++) {
    if (spin < FG_SPIN) fg_relax(); else sched_yield();
  }
  fg_last_ns = fg_now_ns();
  pthread_mutex_unlock(&fg_run_mu);
  return n;
}
"""

@functools.cache
def _c_pool() -> Any:
    """fg_pool_run from the C pool compiled with the CPU compiler (None where that fails: the Python pool then)."""
    try:
        from fusegrad.device import Device
        fxn = _load_library(Device["CPU"].compiler.compile_cached(_C_POOL_SRC)).fg_pool_run
    except Exception as e:
        if DEBUG >= 1: print(f"CPU: no C thread pool ({e}); kernels are split across threads from Python")
        return None
    fxn.restype, fxn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    return fxn
_load_counter = itertools.count()

def _load_library(lib: bytes) -> ctypes.CDLL:
    # dlopen needs a file; the name must never repeat in this process (the loader reuses objects by name)
    fd, path = tempfile.mkstemp(prefix=f"fusegrad-{os.getpid()}-{next(_load_counter)}-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f: f.write(lib)
        return ctypes.CDLL(path)
    finally: os.unlink(path)

def _unload_library(handle: int, dlclose: Any = _ctypes.dlclose, error: type = OSError) -> None:
    try: dlclose(handle)
    except error: pass

class CPUProgram:
    """A kernel `void name(ptr..., var..., long core_lo, long core_hi)` loaded from shared object bytes; a var is a
    `long` (integers) or a `double` (floats), chosen by the Python type of its value."""
    def __init__(self, name: str, lib: bytes):
        self.name, self.lib = name, lib
        self._entry: int | None = None  # set by _load when the binary has the C pool's entry point
        self.fxn = self._load(name, lib)
        self.fxn.restype = None
        self._sig: tuple | None = None

    def _load(self, name: str, lib: bytes) -> Any:
        """The callable ctypes function `name` of `lib` (a subclass may load another binary format)."""
        try: self._dll = _load_library(lib)
        except OSError as e: raise RuntimeError(f"can't load the shared object for {name}: {e}") from e
        try: fxn = getattr(self._dll, name)
        except AttributeError as e: raise RuntimeError(f"the shared object has no function {name!r}") from e
        # the entry point with one signature for every kernel, for the C thread pool (not every renderer writes one)
        if (entry := getattr(self._dll, f"{name}_entry", None)) is not None:
            self._entry = ctypes.cast(entry, ctypes.c_void_p).value
        # ctypes never unloads a library: without dlclose every program ever loaded keeps its mappings, and a long
        # run with thousands of distinct kernels exhausts the process's map count. The finalizer holds everything it
        # calls, so it works at interpreter shutdown after this module's globals are gone; at exit it doesn't run.
        weakref.finalize(self, _unload_library, self._dll._handle).atexit = False
        return fxn

    def __call__(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1,
                 wait: bool = False) -> float | None:
        """Run over [0, global_size), split into `threads` contiguous chunks run in parallel (capped by CPU_THREADS
        when set). Returns the elapsed seconds if `wait`."""
        if (sig := (len(bufs), tuple(type(v) is float for v in vals) if vals else ())) != self._sig:
            # argtypes make ctypes convert cheaply and pass 64-bit values correctly; they only change with the
            # signature: pointers, then a double per float parameter and a long per integer one, then the range
            self.fxn.argtypes = [ctypes.c_void_p] * len(bufs) + \
                [ctypes.c_double if f else ctypes.c_long for f in sig[1]] + [ctypes.c_long] * 2
            self._sig = sig
        if CPU_THREADS.value > 0: threads = min(threads, CPU_THREADS.value)
        threads = max(1, min(threads, global_size))
        st = time.perf_counter() if wait else 0.0
        if threads == 1: self.fxn(*bufs, *vals, 0, max(global_size, 1))
        elif self._entry is not None and (c_pool := _c_pool()) is not None:
            # everything by pointer: the buffers' memory, and each Variable's value in a C variable kept alive here
            boxed = [ctypes.c_double(v) if type(v) is float else ctypes.c_long(v) for v in vals]
            args = (ctypes.c_void_p * (len(bufs) + len(vals)))(
                *[ctypes.addressof(b) if b is not None else None for b in bufs], *[ctypes.addressof(v) for v in boxed])
            c_pool(self._entry, args, global_size, threads)
        else:
            bounds = [global_size * i // threads for i in range(threads + 1)]
            _pool.run(self.fxn, [(*bufs, *vals, bounds[i], bounds[i + 1]) for i in range(threads)])
        return time.perf_counter() - st if wait else None

# *** the device ***

class CPUDevice(Compiled):
    """The host CPU."""
    def __init__(self, device: str = "CPU"):
        super().__init__(device, CPUAllocator(), None, None, CPUProgram)

    @functools.cached_property
    def renderer(self) -> Any:
        # imported on first use: the renderer depends on codegen, which shouldn't load just to allocate memory
        from fusegrad.renderer.cstyle import ClangRenderer
        return ClangRenderer()

    @functools.cached_property
    def compiler(self) -> CPUCompiler:
        try: flags = getattr(self.renderer, "compile_flags", None)
        except ImportError:
            if DEBUG >= 1: print("CPU: no ClangRenderer yet, compiling with the default flags")
            flags = None
        return CPUCompiler(flags)

    @property
    def max_threads(self) -> int:
        return int(CPU_THREADS.value) if CPU_THREADS.value > 0 else self._ncpu

    @functools.cached_property
    def _ncpu(self) -> int: return host_cpu_count()
