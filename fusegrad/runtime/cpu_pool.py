"""The thread pools CPU kernels run on: a job queue written in C (cpu_pool.c, compiled once with the CPU compiler),
on which kernels are queued and run while Python goes on, split into chunks across cores; and a Python pool that
splits a kernel across threads where there is no C pool (LLVM kernels, a machine where it doesn't compile).

Each queued job holds what it uses, and stamps the allocations it uses with the job count at which it is done:
`wait_for` is how host access to an allocation waits for exactly the kernels using it."""
from __future__ import annotations
import atexit
import collections
import ctypes
import functools
import os
import pathlib
import queue
import re
import threading
import time
from typing import Any
from fusegrad.helpers import CPU_ASYNC, DEBUG
from fusegrad.hostcpu import host_cpu_count
from fusegrad.runtime.cpu_compiler import load_library

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

python_pool = _ThreadPool()
# a forked child has none of the parent's worker threads: it starts its own
if hasattr(os, "register_at_fork"): os.register_at_fork(after_in_child=lambda: python_pool.__init__())

# the C pool's source ships beside this module (package data). Its text is part of the compile cache key, so an edited
# pool is compiled again. (Found by path, as the device plugins are: a package imported under a second name, the
# tinygrad alias, has a module spec without a location for importlib.resources.)
POOL_SOURCE_PATH = pathlib.Path(__file__).with_name("cpu_pool.c")
POOL_SOURCE = POOL_SOURCE_PATH.read_text(encoding="utf-8")

# a copy between host memories runs as a kernel queued behind the kernels before it (engine/realize.py); it is compiled
# in the pool's compiler run, so a first call that copies doesn't start the compiler for it. Chunks are byte ranges.
HOST_COPY_SOURCE = """void fg_copy(unsigned char *dst, const unsigned char *src, long lo, long hi) {
  __builtin_memmove(dst + lo, src + lo, (unsigned long)(hi - lo));
}
void fg_copy_entry(void **a, long lo, long hi) { fg_copy((unsigned char *)a[0], (const unsigned char *)a[1], lo, hi); }
"""

WAIT_SLICE_NS = 50_000_000  # a wait returns to Python this often, so Ctrl-C (a Python signal handler) is seen

class CPool:
    """The C pool's job queue as seen from Python. Whatever a queued job uses (its argument array, the Variables'
    values, the buffers' memory) is held here until the job has finished; each allocation a job uses is stamped
    with the job count at which that job is done, so host access to it (Buffer copies, .numpy()) waits for exactly
    the jobs that use it.

    Waiting is interruptible: Ctrl-C raises KeyboardInterrupt in the waiting thread within a slice (or, when that
    thread is running a chunk of a kernel, once the chunk ends), and the queued kernels run on to their end."""
    QUEUE = int(re.search(r"#define FG_QUEUE (\d+)", POOL_SOURCE).group(1))   # (the C queue's length)
    def __init__(self, lib: ctypes.CDLL):
        self._submit, self._wait = lib.fg_pool_submit, lib.fg_pool_wait
        self._submit.restype = ctypes.c_ulong
        self._submit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        self._wait.restype, self._wait.argtypes = ctypes.c_int, [ctypes.c_ulong, ctypes.c_long]
        self._submit_many = lib.fg_pool_submit_many
        self._submit_many.restype = ctypes.c_ulong
        self._submit_many.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 6 + [ctypes.c_int]
        self._submit_many_wait = lib.fg_pool_submit_many_wait
        self._submit_many_wait.restype = ctypes.c_ulong
        self._submit_many_wait.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 6 + [ctypes.c_int, ctypes.c_long]
        self._run_many = lib.fg_run_many
        self._run_many.restype, self._run_many.argtypes = None, [ctypes.c_long] + [ctypes.c_void_p] * 4
        self.clock_ns = lib.fg_clock_ns
        self.clock_ns.restype, self.clock_ns.argtypes = ctypes.c_long, []
        self._trace_start = lib.fg_trace_start
        self._trace_start.restype, self._trace_start.argtypes = ctypes.c_long, [ctypes.c_void_p, ctypes.c_long]
        self._finished = ctypes.c_ulong.in_dll(lib, "fg_finished")
        self._submitted = ctypes.c_ulong.in_dll(lib, "fg_submitted")
        self._held: collections.deque[tuple[int, Any]] = collections.deque()
        self._lock = threading.Lock()
        self.submitted = self._seen = 0

    def submit(self, entry: int, args: Any, size: int, chunks: int, workers: int, held: Any, join: bool = False,
               stamped: Any = (), help: bool = True, record: Any = None) -> int:
        """Queue entry(args, lo, hi) over [0, size) in `chunks` chunks; returns the job count at which it is done.
        `held` is kept alive until then. The caller stamps the allocations the job uses with that count; `stamped` lists
        them for when the call is interrupted before it returns the count (then they are stamped here). With `join`,
        if nothing is queued ahead of the job, this thread runs chunks of it before returning. Without `help`, no
        waiting thread runs its chunks, only the workers (`workers` of them): for chunks so long that the caller must
        stay free to take a Ctrl-C. `record`: None, or a ctypes array of 3 * chunks longs that each chunk fills with
        (the thread that ran it: worker k as k, any other thread as 0; start; end), in ns of `clock_ns`; it holds them
        once the job is done (wait for it first)."""
        if record is not None and len(record) < 3 * max(1, chunks):
            raise ValueError(f"a record array for {chunks} chunks needs {3 * max(1, chunks)} longs, got {len(record)}")
        # a full queue is waited on here, where Ctrl-C can stop the wait (the C submit would wait without a break).
        # (_seen, the finished count the last release saw, is a lower bound: at worst a wait that returns at once)
        if self.submitted - self._seen >= self.QUEUE: self.wait(self.submitted - self.QUEUE + 1)
        try: count = self._submit(entry, args, size, chunks, workers, join, help, record)
        except BaseException:
            # a Ctrl-C that arrived while this thread ran chunks is raised as the call returns, before its result is
            # kept: the job is queued all the same, so what it uses is held and stamped up to every job submitted yet
            self._queued(count := self._submitted.value, held)
            for b in stamped:
                if b is not None: stamp(allocation_root(b), count, count)
            raise
        self._queued(count, held)
        return count

    def submit_many(self, count: int, fns: Any, args: Any, offsets: Any, sizes: Any, chunks: Any, help: Any,
                    workers: int, held: Any, stamped: Any = (), wait: bool = False) -> int:
        """Queue `count` jobs in one call, job k being fns[k](args + offsets[k], lo, hi) over [0, sizes[k]) in
        chunks[k] chunks (the arrays are ctypes arrays), none joined; returns the job count at which the last one is
        done. At most QUEUE jobs at once. `held` and `stamped` as for submit. With `wait`, this thread then runs their
        chunks and waits for them in the same C call, for at most a wait slice: `done` of the count returned says
        whether they have finished (if not, the caller stamps and waits as after a call without `wait`)."""
        if count > self.QUEUE: raise ValueError(f"submit_many takes at most {self.QUEUE} jobs, got {count}")
        if self.submitted + count - self._seen > self.QUEUE: self.wait(self.submitted + count - self.QUEUE)
        try:
            end = self._submit_many_wait(count, fns, args, offsets, sizes, chunks, help, workers, WAIT_SLICE_NS) \
                if wait else self._submit_many(count, fns, args, offsets, sizes, chunks, help, workers)
        except BaseException:
            self._queued(end := self._submitted.value, held)
            for b in stamped:
                if b is not None: stamp(allocation_root(b), end, end)
            raise
        self._queued(end, held)
        return end

    def run_many(self, count: int, fns: Any, args: Any, offsets: Any, sizes: Any) -> None:
        """Run `count` jobs (as for submit_many) on this thread, each whole, after everything queued before them."""
        if self._finished.value < self.submitted: self.wait()   # (here, where Ctrl-C can stop the wait)
        self._run_many(count, fns, args, offsets, sizes)

    def _queued(self, count: int, held: Any) -> None:
        # (what _release does, under the same lock: this runs for every kernel queued)
        self._seen = finished = self._finished.value
        with self._lock:
            if count > self.submitted: self.submitted = count
            q = self._held
            q.append((count, held))
            while q and q[0][0] <= finished: q.popleft()

    def run(self, entry: int, args: Any, size: int, chunks: int) -> None:
        """entry(args, lo, hi) over [0, size) in `chunks` chunks, returning once it has run (the caller helps)."""
        self.wait(self.submit(entry, args, size, chunks, chunks - 1, None))

    def done(self, count: int) -> bool: return self._finished.value >= count

    @functools.cached_property
    def clock_offset_ns(self) -> int:
        """time.perf_counter_ns() - clock_ns(), measured once: chunk records in perf_counter's time. (Both read
        CLOCK_MONOTONIC on Linux, where this is ~0; measuring it keeps a platform where they differ right.) The
        reading taken between the closest pair of perf_counter readings of a few: a thread switched out between two
        readings would put the offset off by the time it waited."""
        best: tuple[int, int] | None = None
        for _ in range(8):
            before = time.perf_counter_ns()
            c = self.clock_ns()
            after = time.perf_counter_ns()
            if best is None or after - before < best[0]: best = (after - before, (before + after) // 2 - c)
        assert best is not None
        return best[1]

    def timeline(self, fn: Any, capacity: int = 1 << 16) -> list[tuple[int, int, int, float, float]]:
        """Run fn() with every chunk that any thread runs recorded (of jobs queued alone or in a graph; not those
        fg_run_many runs whole), at most `capacity`: (job number, chunk, lane: worker k as k and any other thread as 0,
        start, end), in seconds of time.perf_counter, once the queue has drained after fn."""
        self.drain()   # (the capacity and buffer are set with no chunk running)
        buf = (ctypes.c_long * (5 * capacity))()
        self._trace_start(buf, capacity)
        try: fn()
        finally:
            self.drain()   # (no chunk still running may write into buf once it is freed)
            n = self._trace_start(None, 0)
        off, r = self.clock_offset_ns, buf
        return [(r[5 * k], r[5 * k + 1], r[5 * k + 2], (r[5 * k + 3] + off) * 1e-9, (r[5 * k + 4] + off) * 1e-9)
                for k in range(n)]

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
        try: lib = load_library(device.compiler.compile_cached_many([POOL_SOURCE, HOST_COPY_SOURCE], 1)[0])
        except OSError:   # (a cached binary that doesn't load is compiled again)
            device.compiler.evict(POOL_SOURCE)
            lib = load_library(device.compiler.compile_cached(POOL_SOURCE))
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

def c_pool(device: Any = None) -> CPool | None:
    """The process's C pool (made on first use, with the compiler of `device`, by default the CPU device)."""
    if _pool_made: return _pool_made[0]
    with _pool_lock:
        if not _pool_made:
            if device is None:
                from fusegrad.device import Device
                device = Device["CPU"]
            _pool_made.append(_make_c_pool(device))
    return _pool_made[0]

def build_pool_in_background(device: Any) -> None:
    """Compile the C pool on another thread while the first kernels are generated and compiled: an empty disk cache
    otherwise makes the first kernel launch wait ~0.1 s for it."""
    if _pool_made or not CPU_ASYNC.value or cores() < 2: return
    threading.Thread(target=c_pool, args=(device,), name="fusegrad-cpu-pool-build", daemon=True).start()

def _forget_pool_lock() -> None:
    global _pool_lock
    _pool_lock = threading.Lock()   # (a fork while the build thread held it: the child makes its own pool)
if hasattr(os, "register_at_fork"): os.register_at_fork(after_in_child=_forget_pool_lock)

def allocation_root(opaque: Any) -> Any:
    """The allocation a view was made of (the allocation itself if it is none)."""
    return getattr(opaque, "_root", opaque)

# Each allocation a queued job uses carries `_fg_job`, the job count at which the last job using it is done: writing
# it from the host, or handing it to another buffer, waits for that. Reading it from the host only needs the jobs that
# write it, so a job that only reads an allocation (a labels tensor checked on the host every step while the last
# step's kernels still read it) leaves `_fg_wf` = (the write floor, the `_fg_job` it holds for). Every stamp goes
# through `stamp`; the pair speaks only for the stamp it was made with, so a stamp written otherwise (a site that
# doesn't know what its job writes) leaves it stale, and a stale pair means the floor is `_fg_job` itself: a read then
# waits for every use.

def write_floor(root: Any) -> int:
    """The job count at which the last queued job that may write this allocation is done."""
    job = getattr(root, "_fg_job", 0)
    wf = root.__dict__.get("_fg_wf")
    return wf[0] if wf is not None and wf[1] == job else job

def stamp(root: Any, job: int, wrote: int) -> None:
    """Note queued jobs using allocation `root`: the last done at count `job`, the last that writes it at `wrote`
    (0: none of them writes it). A stamp may be for earlier jobs than one already noted (two views of an allocation
    in one launch graph): the later counts are kept."""
    floor = max(write_floor(root), wrote)
    if (last := getattr(root, "_fg_job", 0)) > job: job = last
    root._fg_job = job
    root._fg_wf = (floor, job)

def wait_for(opaque: Any, reading: bool = False) -> None:
    """Until the queued kernels that use this CPU allocation (or its base allocation) have finished; `reading`: only
    those that may write it."""
    root = allocation_root(opaque)
    count = write_floor(root) if reading else getattr(root, "_fg_job", 0)
    if count and (pool := c_pool()) is not None and not pool.done(count): pool.wait(count)

def has_host_view(root: Any) -> bool:
    """Whether a live host view (a memoryview from _as_buffer) reads this allocation."""
    exports = root.__dict__.get("_exports")   # (most allocations never had one: no generator for them)
    return bool(exports) and any(r() is not None for r in exports)

@functools.cache
def cores() -> int:
    """The cores this process may run on, read once: kernels are queued only with two or more."""
    return host_cpu_count()
