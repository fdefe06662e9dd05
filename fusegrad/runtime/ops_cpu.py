"""The CPU device: C rendered by ClangRenderer, compiled by the system C compiler into a shared object, loaded with
ctypes and called on host memory. Kernels are queued on a thread pool written in C and run while Python goes on (host
access to a buffer waits for the kernels using it); one kernel can be split across cores by running disjoint ranges
of its outermost loop on several threads."""
from __future__ import annotations
import _ctypes
import ctypes
import atexit
import collections
import functools
import itertools
import os
import queue
import re
import shlex
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable
from fusegrad.device import Compiled, CompileError, Compiler, LRUAllocator, find_cc, numbered
from fusegrad.helpers import CPU_ASYNC, CPU_THREADS, DEBUG, remove_stale
from fusegrad.hostcpu import fingerprint, host_cpu_count

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
        wait_for(opaque)
        # a separate ctypes object per export, so free() can see (via weakrefs) whether a memoryview still uses it
        exp = (ctypes.c_uint8 * len(opaque)).from_buffer(opaque)
        root = getattr(opaque, "_root", opaque)
        exports = root.__dict__.setdefault("_exports", [])
        exports[:] = [r for r in exports if r() is not None] + [weakref.ref(exp)]
        return memoryview(exp).cast("B")

    def _reusable(self, opaque: ctypes.Array) -> bool:
        # memory a live memoryview (e.g. a numpy array) still reads must not be handed to another Buffer
        if _exported(opaque): return False
        fin = opaque.__dict__.get("_finalizer")
        return fin is None or fin.alive

    def _idle(self, opaque: ctypes.Array) -> bool:
        return not (count := getattr(_root(opaque), "_fg_job", 0)) or (pool := _c_pool()) is None or pool.done(count)

    # (host access waits for the queued kernels that use the memory: see CPool)
    def _copyin(self, dest: ctypes.Array, src: memoryview) -> None:
        wait_for(dest)
        memoryview(dest).cast("B")[:] = src
    def _copyout(self, dest: memoryview, src: ctypes.Array) -> None:
        wait_for(src)
        dest[:] = memoryview(src).cast("B")

def address(opaque: ctypes.Array) -> int:
    """The address of a CPU allocation, for passing to C code."""
    return ctypes.addressof(opaque)

# *** compiler ***

DEFAULT_FLAGS = ["-O2", "-march=native", "-fno-math-errno"]

@functools.cache
def _cc_version(cc: tuple[str, ...]) -> str:
    try: out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired): return "unknown"
    return out.splitlines()[0] if out else "unknown"

# what a compile (a folder) and a program load (a shared object, deleted once loaded) put in the temp folder
_STALE_TEMPS = re.compile(r"fusegrad-cc-(?:(\d+)-)?|fusegrad-(\d+)-\d+-.*\.so$")

@functools.cache
def _remove_stale_temps() -> None:
    """Once per process: remove what killed processes left in the temp folder (see remove_stale)."""
    remove_stale(tempfile.gettempdir(), _STALE_TEMPS)

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
        host = fingerprint() if any("native" in f for f in self.flags) else ""
        super().__init__(f"{self.cc}|{_cc_version(tuple(self.cc))}|{self.flags}|{host}")

    def compile(self, src: str) -> bytes:
        _remove_stale_temps()
        # (named with the pid: a folder a killed process left behind is told from a live one's, see remove_stale)
        with tempfile.TemporaryDirectory(prefix=f"fusegrad-cc-{os.getpid()}-") as d:
            out = os.path.join(d, "k.so")
            cmd = [*self.cc, *self.flags, "-shared", "-fPIC", "-x", "c", "-", "-o", out, "-lm"]
            try: res = subprocess.run(cmd, input=src.encode(), capture_output=True)
            except OSError as e: raise CompileError(f"can't run {shlex.join(cmd)}: {e}\n{numbered(src)}") from e
            if res.returncode != 0:
                raise CompileError(f"{shlex.join(cmd)} failed:\n{res.stderr.decode(errors='replace').strip()}\n"
                                   f"--- source ---\n{numbered(src)}")
            with open(out, "rb") as f: return f.read()

    def _compile_all(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        # starting the compiler costs more than compiling a small kernel, so kernels are compiled a batch at a time:
        # one translation unit (one shared object) per batch, the batches in parallel. Kernels with pragmas of their
        # own, and kernels named like one already in the batch, go to other batches.
        if len(srcs) < 2: return super()._compile_all(srcs)
        nbatches = units if units is not None else max(host_cpu_count(), -(-len(srcs) // BATCH_KERNELS))
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
        return elf_is_whole(lib, ET_DYN) if sys.platform.startswith("linux") else len(lib) > 0

def _table(lib: bytes, fmt: str, offset: int, entsize: int, n: int) -> Any:
    """The n entries of a header table (entries may be longer than the layout this reads)."""
    if entsize == struct.calcsize(fmt): return struct.iter_unpack(fmt, memoryview(lib)[offset:offset + n * entsize])
    return (struct.unpack_from(fmt, lib, offset + i * entsize) for i in range(n))

ET_REL, ET_DYN = 1, 3   # ELF file types: an object file (LLVM's output), a shared object (the C compiler's)

def elf_is_whole(lib: bytes, elf_type: int) -> bool:
    """Whether `lib` is an ELF file of type `elf_type` whose program and section header tables, and the contents its
    loader reads (a shared object's segments, an object file's sections), lie within it. The dynamic loader maps
    segments without looking at the file's size, so a truncated shared object passes dlopen and then crashes the
    process (SIGBUS) when the missing pages are touched."""
    if len(lib) < 52 or lib[:4] != b"\x7fELF" or lib[4] not in (1, 2) or lib[5] not in (1, 2) or lib[6] != 1:
        return False
    wide, end = lib[4] == 2, "<" if lib[5] == 1 else ">"
    if wide and len(lib) < 64: return False
    if struct.unpack_from(end + "H", lib, 16)[0] != elf_type: return False
    phoff, shoff = struct.unpack_from(end + ("QQ" if wide else "II"), lib, 32 if wide else 28)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(end + "HHHHH", lib, 54 if wide else 42)
    # (header sizes and layouts: Elf64_Phdr, Elf64_Shdr / Elf32_Phdr, Elf32_Shdr)
    ph_size, sh_size, ph_fmt, sh_fmt = (56, 64, "IIQQQQQQ", "IIQQQQIIQQ") if wide else (32, 40, "8I", "10I")
    if phnum and (phentsize < ph_size or phoff + phnum * phentsize > len(lib)): return False
    if shnum and (shentsize < sh_size or shoff + shnum * shentsize > len(lib) or shstrndx >= shnum): return False
    loads = 0
    for ph in _table(lib, end + ph_fmt, phoff, phentsize, phnum):
        p_type, offset, filesz, memsz = (ph[0], ph[2], ph[5], ph[6]) if wide else (ph[0], ph[1], ph[4], ph[5])
        if offset + filesz > len(lib): return False
        if p_type == 1:   # PT_LOAD
            if filesz > memsz: return False
            loads += 1
    # (the dynamic loader reads segments only; an object file is loaded by its sections)
    for sh in _table(lib, end + sh_fmt, shoff, shentsize, shnum if elf_type == ET_REL else 0):
        if sh[1] not in (0, 8) and sh[4] + sh[5] > len(lib): return False   # (SHT_NULL, SHT_NOBITS: no contents)
    return loads > 0 if elf_type == ET_DYN else shnum > 0

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

# The same, in C, as a queue of jobs: kernels rendered with an `<name>_entry(void **args, long lo, long hi)` wrapper
# are submitted without waiting for them (see CPUProgram: the Python that builds and schedules the next kernels runs
# while these do) and split into chunks that worker threads and any thread waiting on the queue claim from a shared
# ticket (the current job's number and its next chunk). Jobs run one after another in submission order, each only
# once the one before has finished, so a kernel sees everything the kernels before it wrote. Workers spin for about
# 10 us when there is nothing to claim (kernels of a step follow each other within microseconds), then yield the
# core a while and sleep: spinning longer would take the core from other processes (two test workers on two cores
# ran 2.5x slower with ~150 us of spinning). While jobs come in a burst (a realize loop: ~100-300 us of Python
# between kernels) they keep yielding for 500 us instead of 30: a sleeping worker takes ~50 us to wake, a yielding
# one gives its core to any other runnable thread at once. A thread waiting for a job claims its chunks too: a worker
# the OS doesn't run in time (another process's threads spinning on the other core) costs that chunk's time, not the
# scheduler's next tick (4 ms, measured after a numpy matmul: OpenBLAS's threads spin for ~0.1 s).
_C_POOL_SRC = r"""
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
typedef void (*fg_entry)(void **, long, long);
#define FG_MAX_WORKERS 255
#define FG_QUEUE 64            /* jobs queued or running at once: a submit beyond waits for the oldest */
#define FG_SPIN 300            /* pauses (about 10 us), then yields to other runnable threads for */
#define FG_YIELD_NS 30000L     /* 30 us, or when jobs come in a burst (this one began within FG_HOT_GAP_NS of */
#define FG_HOT_YIELD_NS 500000L /* the end of the one before) 500 us, then sleep */
#define FG_HOT_GAP_NS 1000000L
typedef struct { fg_entry fn; void **args; long size; long n; } fg_job;
static fg_job fg_q[FG_QUEUE];
static pthread_mutex_t fg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fg_cv = PTHREAD_COND_INITIALIZER;       /* sleeping workers wait here for a job to begin */
static pthread_cond_t fg_done_cv = PTHREAD_COND_INITIALIZER;  /* sleeping waiters wait here for a job to end */
/* jobs ever submitted and ever finished: jobs fg_finished .. fg_submitted - 1 are queued, the first one running */
atomic_ulong fg_submitted, fg_finished;
static atomic_ulong fg_ticket;   /* (running job's number << 32) | its next unclaimed chunk */
static atomic_long fg_left;      /* chunks of the running job not finished yet */
static atomic_int fg_hot;        /* the running job began within FG_HOT_GAP_NS of the end of the one before */
static long fg_last_ns;          /* when the last job ended */
static int fg_workers, fg_sleepers, fg_waiters, fg_atfork;
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
/* job j becomes the running one (fg_mu held) */
static void fg_begin(unsigned long j) {
  atomic_store_explicit(&fg_left, fg_q[j % FG_QUEUE].n, memory_order_relaxed);
  atomic_store_explicit(&fg_hot, fg_now_ns() - fg_last_ns < FG_HOT_GAP_NS, memory_order_relaxed);
  atomic_store_explicit(&fg_ticket, (j & 0xffffffffUL) << 32, memory_order_release);
  if (fg_sleepers) pthread_cond_broadcast(&fg_cv);
}
/* the running job's last chunk is done: the next queued one begins */
static void fg_finish(void) {
  pthread_mutex_lock(&fg_mu);
  unsigned long next = atomic_load(&fg_finished) + 1;
  atomic_store_explicit(&fg_finished, next, memory_order_release);
  fg_last_ns = fg_now_ns();
  if (atomic_load(&fg_submitted) > next) fg_begin(next);
  if (fg_waiters) pthread_cond_broadcast(&fg_done_cv);
  pthread_mutex_unlock(&fg_mu);
}
/* whether the running job has a chunk left to claim. (The slot may be refilled for a later job only after the ticket
   moved past it; a stale answer costs one more look) */
static inline int fg_claimable(void) {
  unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
  return (long)(t & 0xffffffffUL) < fg_q[(t >> 32) % FG_QUEUE].n;
}
/* claim and run chunks of the running job, and of the ones after it, until none is left to claim (with `only` >= 0:
   only chunks of job number `only`; with `until` > 0: no new claim once fg_now_ns() has passed it); returns how many
   this thread ran. A claim succeeds only while the ticket still names the job, and the job can't finish while a claimed
   chunk runs, so its function and arguments stay valid */
static int fg_claim_of(long only, long until) {
  int ran = 0;
  for (;;) {
    if (until > 0 && fg_now_ns() >= until) return ran;
    unsigned long t = atomic_load_explicit(&fg_ticket, memory_order_acquire);
    unsigned long i = t & 0xffffffffUL;
    if (only >= 0 && (t >> 32) != ((unsigned long)only & 0xffffffffUL)) return ran;
    fg_job *job = &fg_q[(t >> 32) % FG_QUEUE];
    long n = job->n;
    if ((long)i >= n) return ran;
    if (!atomic_compare_exchange_weak_explicit(&fg_ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
      continue;
    job->fn(job->args, job->size * (long)i / n, job->size * (long)(i + 1) / n);
    ran++;
    if (atomic_fetch_sub_explicit(&fg_left, 1, memory_order_acq_rel) == 1) fg_finish();
  }
}
static int fg_claim(void) { return fg_claim_of(-1, 0); }
static void *fg_worker(void *arg) {
  (void)arg;
  for (;;) {
    long yield_until = 0;
    for (int spin = 0; !fg_claimable(); spin++) {
      if (spin < FG_SPIN) { fg_relax(); continue; }
      if (spin == FG_SPIN) yield_until = fg_now_ns() + (atomic_load(&fg_hot) ? FG_HOT_YIELD_NS : FG_YIELD_NS);
      if ((spin & 15) || fg_now_ns() < yield_until) { sched_yield(); continue; }
      pthread_mutex_lock(&fg_mu);
      fg_sleepers++;
      while (!fg_claimable()) pthread_cond_wait(&fg_cv, &fg_mu);
      fg_sleepers--;
      pthread_mutex_unlock(&fg_mu);
    }
    fg_claim();
  }
  return 0;
}
/* until `count` jobs have finished, claiming their chunks too; returns 1. With `ns` >= 0, returns 0 once about `ns`
   nanoseconds have passed (after the chunk this thread runs, if any), so the caller can look at signals and wait on */
int fg_pool_wait(unsigned long count, long ns) {
  struct timespec until = {0, 0};
  long deadline = 0;
  if (ns >= 0) {
    deadline = fg_now_ns() + ns;
    clock_gettime(CLOCK_REALTIME, &until);   /* (pthread_cond_timedwait's clock) */
    until.tv_sec += ns / 1000000000L;
    until.tv_nsec += ns % 1000000000L;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
  }
  for (int spin = 0; atomic_load_explicit(&fg_finished, memory_order_acquire) < count; spin++) {
    if (ns >= 0 && fg_now_ns() >= deadline) return 0;
    if (fg_claim_of(-1, deadline)) { spin = 0; continue; }
    if (spin < FG_SPIN) { fg_relax(); continue; }
    /* every chunk is claimed and the one running is long: sleep until a job ends (no core spent on waiting) */
    pthread_mutex_lock(&fg_mu);
    fg_waiters++;
    if (atomic_load(&fg_finished) < count && !fg_claimable()) {
      if (ns < 0) pthread_cond_wait(&fg_done_cv, &fg_mu);
      else pthread_cond_timedwait(&fg_done_cv, &fg_mu, &until);
    }
    fg_waiters--;
    pthread_mutex_unlock(&fg_mu);
  }
  return 1;
}
/* a forked child has none of the parent's threads: no workers, and locks and condition variables that no thread
   holds or waits on (the parent waits for its queue to drain before forking, so no job is left half done) */
static void fg_forget_workers(void) {
  fg_workers = fg_sleepers = fg_waiters = 0;
  pthread_mutex_init(&fg_mu, 0);
  pthread_cond_init(&fg_cv, 0);
  pthread_cond_init(&fg_done_cv, 0);
}
/* queue fn(args, lo, hi) over [0, size) in n chunks, with at least `workers` worker threads; returns the job count
   at which it has finished (for fg_pool_wait). With `join`, a job that runs at once (nothing queued ahead of it) gets
   chunks run by the caller too, until none is left to claim */
unsigned long fg_pool_submit(fg_entry fn, void **args, long size, long n, int workers, int join) {
  if (n < 1) n = 1;
  if (n > size) n = size > 0 ? size : 1;
  if (workers > FG_MAX_WORKERS) workers = FG_MAX_WORKERS;
  pthread_mutex_lock(&fg_mu);
  unsigned long j;
  while ((j = atomic_load(&fg_submitted)) - atomic_load(&fg_finished) >= FG_QUEUE) {
    pthread_mutex_unlock(&fg_mu);
    fg_pool_wait(j - FG_QUEUE + 1, -1);  /* the queue is full: help with its oldest job */
    pthread_mutex_lock(&fg_mu);
  }
  if (!fg_atfork) { pthread_atfork(0, 0, fg_forget_workers); fg_atfork = 1; }
  while (fg_workers < workers) {
    pthread_t t;
    if (pthread_create(&t, 0, fg_worker, 0)) break;  /* fewer workers: waiting threads run the chunks */
    pthread_detach(t);
    fg_workers++;
  }
  fg_q[j % FG_QUEUE] = (fg_job){fn, args, size, n};
  atomic_store_explicit(&fg_submitted, j + 1, memory_order_release);
  int now = atomic_load(&fg_finished) == j;
  if (now) fg_begin(j);  /* nothing ahead of it: it runs now */
  pthread_mutex_unlock(&fg_mu);
  if (now && join) fg_claim_of((long)j, 0);
  return j + 1;
}
"""

WAIT_SLICE_NS = 50_000_000  # a wait returns to Python this often, so Ctrl-C (a Python signal handler) is seen

class CPool:
    """The C pool's job queue as seen from Python. Whatever a queued job uses (its argument array, the Variables'
    values, the buffers' memory) is held here until the job has finished; each allocation a job uses is stamped
    with the job count at which that job is done, so host access to it (Buffer copies, .numpy()) waits for exactly
    the jobs that use it.

    Waiting is interruptible: Ctrl-C raises KeyboardInterrupt in the waiting thread within a slice (or, when that
    thread is running a chunk of a kernel, once the chunk ends), and the queued kernels run on to their end."""
    QUEUE = int(re.search(r"#define FG_QUEUE (\d+)", _C_POOL_SRC).group(1))   # (the C queue's length)
    def __init__(self, lib: ctypes.CDLL):
        self._submit, self._wait = lib.fg_pool_submit, lib.fg_pool_wait
        self._submit.restype = ctypes.c_ulong
        self._submit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                 ctypes.c_int]
        self._wait.restype, self._wait.argtypes = ctypes.c_int, [ctypes.c_ulong, ctypes.c_long]
        self._finished = ctypes.c_ulong.in_dll(lib, "fg_finished")
        self._submitted = ctypes.c_ulong.in_dll(lib, "fg_submitted")
        self._held: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self.submitted = self._seen = 0

    def submit(self, entry: int, args: Any, size: int, chunks: int, workers: int, held: Any, join: bool = False,
               stamp: Any = ()) -> int:
        """Queue entry(args, lo, hi) over [0, size) in `chunks` chunks; returns the job count at which it is done.
        `held` is kept alive until then. The caller stamps the allocations the job uses with that count; `stamp` lists
        them for when the call is interrupted before it returns the count (then they are stamped here). With `join`,
        if nothing is queued ahead of the job, this thread runs chunks of it before returning."""
        # a full queue is waited on here, where Ctrl-C can stop the wait (the C submit would wait without a break).
        # (_seen, the finished count the last release saw, is a lower bound: at worst a wait that returns at once)
        if self.submitted - self._seen >= self.QUEUE: self.wait(self.submitted - self.QUEUE + 1)
        try: count = self._submit(entry, args, size, chunks, workers, join)
        except BaseException:
            # a Ctrl-C that arrived while this thread ran chunks is raised as the call returns, before its result is
            # kept: the job is queued all the same, so what it uses is held and stamped up to every job submitted yet
            self._queued(count := self._submitted.value, held)
            for b in stamp:
                if b is not None: _root(b)._fg_job = count
            raise
        self._queued(count, held)
        return count

    def _queued(self, count: int, held: Any) -> None:
        with self._lock:
            if count > self.submitted: self.submitted = count
            self._held.append((count, held))
        self._release()

    def run(self, entry: int, args: Any, size: int, chunks: int) -> None:
        """entry(args, lo, hi) over [0, size) in `chunks` chunks, returning once it has run (the caller helps)."""
        self.wait(self.submit(entry, args, size, chunks, chunks - 1, None))

    def done(self, count: int) -> bool: return self._finished.value >= count

    def wait(self, count: int | None = None) -> None:
        """Until the jobs up to `count` (all jobs submitted so far: None) have finished; this thread runs chunks."""
        count = self.submitted if count is None else count
        if self._finished.value < count:
            # in slices: between them Python runs its signal handlers, so Ctrl-C raises KeyboardInterrupt here
            while not self._wait(count, WAIT_SLICE_NS): pass
        self._release()

    def drain(self) -> None:
        """Until every job submitted so far has finished, without a break for signals: before a fork and at exit,
        where no job may be left running."""
        if self._finished.value < (count := self._submitted.value): self._wait(count, -1)
        self._release()

    def _release(self) -> None:
        self._seen = finished = self._finished.value
        with self._lock:
            held = self._held
            while held and held[0][0] <= finished: held.popleft()

def _make_c_pool(device: Any) -> CPool | None:
    """The C pool compiled with `device`'s compiler (None where that fails: kernels then run synchronously, split
    across threads from Python)."""
    try:
        try: lib = _load_library(device.compiler.compile_cached(_C_POOL_SRC))
        except OSError:   # (a cached binary that doesn't load is compiled again)
            device.compiler.evict(_C_POOL_SRC)
            lib = _load_library(device.compiler.compile_cached(_C_POOL_SRC))
        pool = CPool(lib)
    except Exception as e:
        if DEBUG >= 1: print(f"CPU: no C thread pool ({e}); kernels run synchronously, split by the Python pool")
        return None
    # a forked child must not inherit half-run jobs: the queue drains before every fork. (At exit the same, so no job
    # runs while the interpreter frees what it uses.)
    if hasattr(os, "register_at_fork"): os.register_at_fork(before=pool.drain)
    atexit.register(pool.drain)
    return pool

_pool_made: list[CPool | None] = []   # the pool, once made (one for the process: every CPU device queues on it)
_pool_lock = threading.Lock()

def _c_pool(device: Any = None) -> CPool | None:
    """The process's C pool (made on first use, with the compiler of `device`, by default the CPU device)."""
    if _pool_made: return _pool_made[0]
    with _pool_lock:
        if not _pool_made:
            if device is None:
                from fusegrad.device import Device
                device = Device["CPU"]
            _pool_made.append(_make_c_pool(device))
    return _pool_made[0]

def _build_pool_in_background(device: CPUDevice) -> None:
    """Compile the C pool on another thread while the first kernels are generated and compiled: an empty disk cache
    otherwise makes the first kernel launch wait ~0.1 s for it."""
    if _pool_made or not CPU_ASYNC.value or _cores() < 2: return
    threading.Thread(target=_c_pool, args=(device,), name="fusegrad-cpu-pool-build", daemon=True).start()

def _forget_pool_lock() -> None:
    global _pool_lock
    _pool_lock = threading.Lock()   # (a fork while the build thread held it: the child makes its own pool)
if hasattr(os, "register_at_fork"): os.register_at_fork(after_in_child=_forget_pool_lock)

def _root(opaque: Any) -> Any: return getattr(opaque, "_root", opaque)

def wait_for(opaque: Any) -> None:
    """Until the queued kernels that use this CPU allocation (or its base allocation) have finished."""
    if (count := getattr(_root(opaque), "_fg_job", 0)) and (pool := _c_pool()) is not None and not pool.done(count):
        pool.wait(count)

def _exported(root: Any) -> bool:
    """Whether a live host view (a memoryview from _as_buffer) reads this allocation."""
    exports = root.__dict__.get("_exports")   # (most allocations never had one: no generator for them)
    return bool(exports) and any(r() is not None for r in exports)

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

def _clamped_threads(threads: int, global_size: int) -> int:
    """The threads a kernel call is split across: at most CPU_THREADS (when set) and global_size, at least 1."""
    if CPU_THREADS.value > 0: threads = min(threads, CPU_THREADS.value)
    return max(1, min(threads, global_size))

def _arguments(bufs: tuple, vals: tuple) -> tuple[list, list]:
    """A queued kernel's arguments, everything by pointer: the buffers' memory, and each Variable's value in a C
    variable (returned too: it is held with the job)."""
    boxed = [ctypes.c_double(v) if type(v) is float else ctypes.c_long(v) for v in vals]
    return boxed, [ctypes.addressof(b) if b is not None else None for b in bufs] + [ctypes.addressof(v) for v in boxed]

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

    def prepare(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1, join: bool = False,
                varying: tuple[int, ...] = ()) -> Callable[..., None] | None:
        """The queued call `self(*bufs, vals=..., ...)` as a function that repeats it (a TinyJit replay: the same
        kernel every step), with the arguments converted once. The buffers at positions `varying` change per call:
        the function takes their allocations, in that order. None where calls aren't queued."""
        threads = _clamped_threads(threads, global_size)
        if self._entry is None or not CPU_ASYNC.value or _cores() < 2 or (pool := _c_pool()) is None: return None
        # (the buffers at `varying` may be given as None: their addresses are filled in per call)
        boxed, addresses = _arguments(bufs, vals)
        array_type = ctypes.c_void_p * len(addresses)
        fixed = array_type(*addresses)
        kept = [b for i, b in enumerate(bufs) if b is not None and i not in varying]  # (held by the closure)
        roots = [_root(b) for b in kept]
        entry, workers, join, submit = self._entry, max(1, threads - 1), join and threads > 1, pool.submit
        def launch(*allocations: Any) -> None:
            if allocations:
                # (an array of its own per call: a queued job reads its arguments only when it runs)
                now = addresses.copy()
                for i, a in zip(varying, allocations): now[i] = ctypes.addressof(a)
                args: Any = array_type(*now)
                stamped = roots + [_root(a) for a in allocations]
            else: args, stamped = fixed, roots
            count = submit(entry, args, global_size, threads, workers, (self, args, boxed, kept, allocations), join,
                           stamped)
            exported = False
            for root in stamped:
                root._fg_job = count
                if _exported(root): exported = True
            if exported: pool.wait(count)
        return launch

    def __call__(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1,
                 wait: bool = False, join: bool = False) -> float | None:
        """Run over [0, global_size), split into `threads` contiguous chunks run in parallel (capped by CPU_THREADS
        when set). The kernel is queued on the C pool (see CPool) and this returns before it has run, unless `wait`
        (then it returns the elapsed seconds) or a buffer has a live host view (a memoryview or numpy array of its
        memory, whose reader expects the new values once the kernel is called). With `join`, a kernel that nothing
        is queued ahead of has chunks run by this thread before the call returns."""
        threads = _clamped_threads(threads, global_size)
        pool = _c_pool() if self._entry is not None else None
        # (a timed one-thread kernel runs here, as it would without a queue: the handover to a worker isn't its time)
        queued = bool(CPU_ASYNC.value) and _cores() > 1
        if pool is not None and (threads > 1 or (queued and not wait)):
            if wait: pool.wait()  # (timed alone: nothing queued before it)
            st = time.perf_counter() if wait else 0.0
            boxed, addresses = _arguments(bufs, vals)
            args = (ctypes.c_void_p * len(addresses))(*addresses)
            # (the program too: its code must stay loaded until the job has run)
            count = pool.submit(self._entry, args, global_size, threads, max(1, threads - 1), (self, args, boxed, bufs),
                                join and threads > 1, bufs)
            # (stamped once queued: another thread touching these buffers meanwhile races with the kernel anyway)
            exported = False
            for b in bufs:
                if b is None: continue
                root = _root(b)
                root._fg_job = count
                if _exported(root): exported = True
            if wait or exported or not queued: pool.wait(count)
            return time.perf_counter() - st if wait else None
        # run here and now: after whatever is queued, which may write these buffers
        if (c_pool := _c_pool()) is not None: c_pool.wait()
        if (sig := (len(bufs), tuple(type(v) is float for v in vals) if vals else ())) != self._sig:
            # argtypes make ctypes convert cheaply and pass 64-bit values correctly; they only change with the
            # signature: pointers, then a double per float parameter and a long per integer one, then the range
            self.fxn.argtypes = [ctypes.c_void_p] * len(bufs) + \
                [ctypes.c_double if f else ctypes.c_long for f in sig[1]] + [ctypes.c_long] * 2
            self._sig = sig
        st = time.perf_counter() if wait else 0.0
        if threads == 1: self.fxn(*bufs, *vals, 0, max(global_size, 1))
        else:
            bounds = [global_size * i // threads for i in range(threads + 1)]
            _pool.run(self.fxn, [(*bufs, *vals, bounds[i], bounds[i + 1]) for i in range(threads)])
        return time.perf_counter() - st if wait else None

@functools.cache
def _cores() -> int: return host_cpu_count()

# *** the device ***

class CPUDevice(Compiled):
    """The host CPU."""
    def __init__(self, device: str = "CPU"):
        super().__init__(device, CPUAllocator(), None, None, CPUProgram)
        _build_pool_in_background(self)

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

    def synchronize(self) -> None:
        """Wait until every kernel queued so far (on any CPU device: they share one queue) has run."""
        if (pool := _c_pool()) is not None: pool.wait()

    @property
    def max_threads(self) -> int:
        return int(CPU_THREADS.value) if CPU_THREADS.value > 0 else self._ncpu

    @functools.cached_property
    def _ncpu(self) -> int: return host_cpu_count()
