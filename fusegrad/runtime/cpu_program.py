"""A CPU kernel loaded from a shared object and called on host memory: queued on the C pool (and split across cores)
or run on the calling thread (split by the Python pool)."""
from __future__ import annotations
import ctypes
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple
from fusegrad.helpers import CPU_ASYNC, CPU_THREADS
from fusegrad.hostcpu import CHUNKS_PER_THREAD
from fusegrad.runtime.cpu_compiler import load_library, unload_library
from fusegrad.runtime.cpu_pool import allocation_root, c_pool, cores, has_host_view, python_pool, stamp
from fusegrad.viz import record as _viz

def _clamped_threads(threads: int, global_size: int) -> int:
    """The threads a kernel call is split across: at most CPU_THREADS (when set) and global_size, at least 1."""
    if CPU_THREADS.value > 0: threads = min(threads, CPU_THREADS.value)
    return max(1, min(threads, global_size))

def _arguments(bufs: tuple, vals: tuple) -> tuple[list, list]:
    """A queued kernel's arguments, everything by pointer: the buffers' memory, and each Variable's value in a C
    variable (returned too: it is held with the job)."""
    boxed = [ctypes.c_double(v) if type(v) is float else ctypes.c_long(v) for v in vals]
    return boxed, [ctypes.addressof(b) if b is not None else None for b in bufs] + [ctypes.addressof(v) for v in boxed]

def _chunks(threads: int, global_size: int, join: bool) -> int:
    """The chunks a queued call split across `threads` runs in. A parallel loop of at most CHUNKS_PER_THREAD
    iterations per thread holds pieces of work the optimizer cut (a matmul's column panels, CHUNKS_PER_THREAD per
    core): a chunk each, claimed by whichever thread is free, so threads that reach the kernel at different times
    share it evenly. A longer loop (an elementwise kernel's rows; an AMX matmul's rows, where each chunk packs B's
    panels: 1.3 -> 1.7 ms for 1024^3 in eight) and a joined call, which the calling thread helps with from its start
    (a standalone 512^3 matmul measured 2-8% slower in pieces), run in one chunk per thread."""
    if threads <= 1 or join or global_size > threads * CHUNKS_PER_THREAD: return threads
    return global_size

def _workers(threads: int, helpable: bool) -> int:
    """Worker threads a call split in `threads` chunks needs: one fewer where the waiting thread runs a chunk too."""
    return max(1, threads - 1) if helpable else threads

class SharedLibrary(ctypes.CDLL):
    """A shared object loaded once for every program whose binary it is: the kernels compiled in one compiler run
    share one binary, and loading it per kernel (a temp file written, dlopen binding every symbol) cost ~0.5 ms of CPU
    and 1-3 ms of wall time each. Unloaded once no program holds it. `targets`: the libraries its kernels' entry points
    forward to (cpu_compiler.forwarding), loaded as long as it is."""
    targets: list[ctypes.CDLL]

_libraries: weakref.WeakValueDictionary[bytes, SharedLibrary] = weakref.WeakValueDictionary()
_libraries_lock = threading.Lock()   # (the background compiler's thread loads optimized binaries too)

def _forget_libraries_lock() -> None:
    global _libraries_lock
    _libraries_lock = threading.Lock()   # (a fork while another thread held it: the child's copy would stay locked)
if hasattr(os, "register_at_fork"): os.register_at_fork(after_in_child=_forget_libraries_lock)

def shared_library(lib: bytes) -> SharedLibrary:
    """The shared object `lib`, loaded on first use and shared by the programs that use it after that."""
    with _libraries_lock:
        if (dll := _libraries.get(lib)) is not None: return dll
        dll = load_library(lib, SharedLibrary)   # type: ignore[assignment]
        dll.targets = []
        # ctypes never unloads a library: without dlclose every program ever loaded keeps its mappings, and a long
        # run with thousands of distinct kernels exhausts the process's map count. The finalizer holds everything it
        # calls, so it works at interpreter shutdown after this module's globals are gone; at exit it doesn't run.
        weakref.finalize(dll, unload_library, dll._handle).atexit = False
        _libraries[lib] = dll
        return dll

class CPUProgram:
    """A kernel `void name(ptr..., var..., long core_lo, long core_hi)` loaded from shared object bytes; a var is a
    `long` (integers) or a `double` (floats), chosen by the Python type of its value. Its calls take `reads`: the
    positions of the buffers the kernel only reads (host reads of those don't wait for it: see cpu_pool.stamp); a
    buffer not named there is taken as written."""
    takes_reads = True
    def __init__(self, name: str, lib: bytes):
        self.name, self.lib = name, lib
        self._entry: int | None = None  # set by _load when the binary has the C pool's entry point
        self.fxn = self._load(name, lib)
        self.fxn.restype = None
        self._sig: tuple | None = None

    def _load(self, name: str, lib: bytes) -> Any:
        """The callable ctypes function `name` of `lib` (a subclass may load another binary format)."""
        previous = getattr(self, "_dll", None)
        try: dll = shared_library(lib)
        except OSError as e: raise RuntimeError(f"can't load the shared object for {name}: {e}") from e
        # (dll[name], not getattr: a fresh function object, since getattr caches one on the library, which other
        # programs share)
        try: fxn = dll[name]
        except AttributeError as e: raise RuntimeError(f"the shared object has no function {name!r}") from e
        # the entry point with one signature for every kernel, for the C thread pool (not every renderer writes one)
        try: self._entry = ctypes.cast(dll[f"{name}_entry"], ctypes.c_void_p).value
        except AttributeError: pass
        # a program loading a second binary (TieredCPUProgram.upgrade) points its first binary's entry at the new one:
        # the first binary, which other programs may share and call through, keeps the new one loaded
        if isinstance(previous, SharedLibrary): previous.targets.append(dll)
        self._dll = dll
        return fxn

    def prepare(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1, join: bool = False,
                varying: tuple[int, ...] = (), helpable: bool = True, reads: tuple[int, ...] = ()) \
            -> Callable[..., None] | None:
        """The queued call `self(*bufs, vals=..., ...)` as a function that repeats it (a TinyJit replay: the same
        kernel every step), with the arguments converted once. The buffers at positions `varying` change per call:
        the function takes their allocations, in that order. None where calls aren't queued."""
        threads = _clamped_threads(threads, global_size)
        if self._entry is None or not CPU_ASYNC.value or cores() < 2 or (pool := c_pool()) is None: return None
        return PreparedLaunch(self, pool, bufs, vals, global_size, threads, join, varying, helpable, reads)

    def __call__(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1,
                 wait: bool = False, join: bool = False, helpable: bool = True, reads: tuple[int, ...] = ()) \
            -> float | None:
        """Run over [0, global_size), split across `threads` threads (capped by CPU_THREADS when set): on the C pool
        in contiguous chunks (_chunks) that the threads claim as they are free, else in `threads` chunks. The kernel
        is queued on the C pool (see CPool) and this returns before it has run, unless `wait` (then it returns the
        elapsed seconds) or a buffer has a live host view (a memoryview or numpy array of its memory, whose reader
        expects the new values once the kernel is called). With `join`, a kernel that nothing is queued ahead of has
        chunks run by this thread before the call returns. Not `helpable`: chunks too long for the calling thread to
        run (it must stay free to take a Ctrl-C), queued for the workers even when they would run here."""
        threads = _clamped_threads(threads, global_size)
        pool = c_pool() if self._entry is not None else None
        # (a timed one-thread kernel runs here, as it would without a queue: the handover to a worker isn't its time)
        queued = bool(CPU_ASYNC.value) and cores() > 1
        if pool is not None and (threads > 1 or (queued and not wait) or not helpable):
            if wait: pool.wait()  # (timed alone: nothing queued before it)
            st = time.perf_counter() if wait else 0.0
            boxed, addresses = _arguments(bufs, vals)
            args = (ctypes.c_void_p * len(addresses))(*addresses)
            # a timed call under PROFILE: each chunk's thread and times, for the timeline's per-thread lanes
            n = _chunks(threads, global_size, join and helpable)
            chunks = (ctypes.c_long * (3 * n))() if wait and _viz.PROFILE else None
            # (the program too: its code must stay loaded until the job has run; and the records, which its chunks
            # write even when a Ctrl-C ends this call's wait)
            count = pool.submit(self._entry, args, global_size, n, _workers(threads, helpable),
                                (self, args, boxed, bufs, chunks), join and threads > 1 and helpable, bufs, helpable,
                                chunks)
            # (stamped once queued: another thread touching these buffers meanwhile races with the kernel anyway)
            exported = False
            for i, b in enumerate(bufs):
                if b is None: continue
                stamp(root := allocation_root(b), count, 0 if i in reads else count)
                if has_host_view(root): exported = True
            if wait or exported or not queued: pool.wait(count)
            if not wait: return None
            et = time.perf_counter()
            if chunks is not None: _note_chunks(self, pool, chunks, global_size, st, et)
            return et - st
        # run here and now: after whatever is queued, which may write these buffers
        if (cpool := c_pool()) is not None: cpool.wait()
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
            python_pool.run(self.fxn, [(*bufs, *vals, bounds[i], bounds[i + 1]) for i in range(threads)])
        return time.perf_counter() - st if wait else None

def _note_chunks(program: CPUProgram, pool: Any, chunks: Any, size: int, st: float, et: float) -> None:
    """Hand the recorder a profiled call's chunks (read once the job is done) in perf_counter seconds."""
    off, n = pool.clock_offset_ns, len(chunks) // 3
    rows = [(chunks[3 * i], size * i // n, size * (i + 1) // n, (chunks[3 * i + 1] + off) * 1e-9,
             (chunks[3 * i + 2] + off) * 1e-9) for i in range(n)]
    _viz.note_chunks(program, st, et, rows)

_addressof = ctypes.addressof

# id of a launch_args dict -> (the dict, CPU_THREADS when made, its values' C variables, their addresses, global size,
# threads, helpable, workers, join) (PreparedLaunch.set_values)
_launch_values: dict[int, tuple] = {}

class PreparedLaunch:
    """A queued kernel call with its arguments converted once (CPUProgram.prepare); calling it with the allocations of
    the buffers at `varying` queues the call. Consecutive ones run in one pool call through LaunchGraph."""
    def __init__(self, program: CPUProgram, pool: Any, bufs: tuple, vals: tuple, global_size: int, threads: int,
                 join: bool, varying: tuple[int, ...], helpable: bool, reads: tuple[int, ...] = ()):
        # (the buffers at `varying` may be given as None: their addresses are filled in per call)
        self.program, self.pool, self.varying, self.nbufs = program, pool, varying, len(bufs)
        self.boxed, self.addresses = _arguments(bufs, vals)
        self.work = (0, 0)   # (set_values: the ops and bytes moved of a launch with Variables)
        self.dynamic = False   # (whether set_values was called: a graph then reads its values per call)
        self.array_type = ctypes.c_void_p * len(self.addresses)
        self.fixed = self.array_type(*self.addresses)
        fixed = [i for i, b in enumerate(bufs) if b is not None and i not in varying]
        self.kept = [bufs[i] for i in fixed]  # (held while queued)
        self.roots = [allocation_root(b) for b in self.kept]
        # whether the kernel writes each of them, then each per-call allocation (else it only reads it)
        self.root_writes = [i not in reads for i in fixed]
        self.varying_writes = [i not in reads for i in varying]
        self.writes = self.root_writes + self.varying_writes
        self.global_size, self.threads, self.helpable = global_size, threads, helpable
        self.workers, self.join = _workers(threads, helpable), join and threads > 1 and helpable
        self.chunks = _chunks(threads, global_size, self.join)
        # (the chunks it runs in within a queued LaunchGraph, and the workers they need: see note_work)
        self.graph_chunks, self.graph_workers = self.chunks, self.workers
        # a joined call (a long kernel the caller helps with) is queued alone: a graph returns before its jobs run
        self.graph = None if self.join else LaunchGraph
        # (run_here's arrays for fg_run_many: one job, its arguments at offset 0)
        self._here = ((ctypes.c_void_p * 1)(program._entry), (ctypes.c_long * 1)(0), (ctypes.c_long * 1)(global_size))

    def note_work(self, work: tuple[int, int]) -> None:
        """Take the work (ops, bytes moved) of this launch, which has no Variables: a kernel its caller runs on one
        thread is split across the threads in a queued LaunchGraph where its work reaches GRAPH_SPLIT_OPS /
        GRAPH_SPLIT_MEM."""
        if self.threads == 1 and self.helpable and (work[0] >= GRAPH_SPLIT_OPS or work[1] >= GRAPH_SPLIT_MEM):
            self.graph_chunks = _clamped_threads(cores(), self.global_size)
            self.graph_workers = max(1, self.graph_chunks - 1)

    def set_values(self, launch: dict[str, Any], work: tuple[int, int]) -> None:
        """Take other values of the kernel's Variables, and the size and split they give (CompiledRunner.launch_args),
        for the calls from now on. Calls already queued keep theirs: the values go into new C variables and a new
        argument array."""
        # (what follows from one launch_args is worked out once and shared by the launches given it, the layers of a
        # model running one kernel: its C variables too, which nothing writes once made)
        made = _launch_values.get(id(launch))
        if made is None or made[0] is not launch or made[1] != CPU_THREADS.value:
            if len(_launch_values) >= 256: _launch_values.clear()
            gs = launch["global_size"]
            threads, helpable = _clamped_threads(launch["threads"], gs), launch["helpable"]
            made = _launch_values[id(launch)] = (launch, CPU_THREADS.value, *_arguments((), launch["vals"]), gs,
                                                 threads, helpable, _workers(threads, helpable),
                                                 launch["join"] and threads > 1 and helpable)
        _, _, self.boxed, addresses, gs, self.threads, self.helpable, self.workers, join = made
        self.addresses = self.addresses[:self.nbufs] + addresses
        self.fixed = self.array_type(*self.addresses)
        self.global_size = gs
        # (a launch in a graph stays in it: its join, a hint that the caller helps a long kernel, is dropped there)
        self.join = self.graph is None and join
        self.chunks = _chunks(self.threads, gs, self.join)
        self._here[2][0] = gs
        self.work, self.dynamic = work, True
        self.graph_chunks, self.graph_workers = self.chunks, self.workers

    def run_here(self, *allocations: Any) -> bool:
        """Run this call on the calling thread, whole, if no job is queued ahead of it (True); else do nothing (False).
        For a call too small to be worth a worker's wake-up (see LaunchGraph's inline graphs): an eager loop's tiny
        kernels. Its allocations need no stamp: the call is done when this returns."""
        pool = self.pool
        if self.threads != 1 or not self.helpable or pool._finished.value < pool.submitted: return False
        args: Any = self.array_type.from_buffer_copy(self.fixed)
        for i, a in zip(self.varying, allocations): args[i] = _addressof(a)
        fns, offsets, sizes = self._here
        pool._run_many(1, fns, args, offsets, sizes)   # (run_many without its check: nothing is queued, as seen above)
        return True

    def __call__(self, *allocations: Any) -> None:
        if allocations:
            # (an array of its own per call: a queued job reads its arguments only when it runs)
            args: Any = self.array_type.from_buffer_copy(self.fixed)
            stamped = self.roots.copy()
            for i, a in zip(self.varying, allocations):
                args[i] = _addressof(a)
                stamped.append(getattr(a, "_root", a))   # (allocation_root)
        else: args, stamped = self.fixed, self.roots
        pool = self.pool
        count = pool.submit(self.program._entry, args, self.global_size, self.chunks, self.workers,
                            (self.program, args, self.boxed, self.kept, allocations), self.join, stamped, self.helpable)
        exported = False
        for root, writes in zip(stamped, self.writes):
            stamp(root, count, count if writes else 0)
            # (has_host_view, asked only of an allocation that ever had a host view)
            if root.__dict__.get("_exports") and has_host_view(root): exported = True
        if exported: pool.wait(count)

# a kernel the engine runs on one thread (below its THREAD_MIN_OPS / THREAD_MIN_MEM, which are set for a call that may
# wake a sleeping worker: ~50 us) is split across the threads in a queued graph from this much work (ops, bytes
# moved): there the worker is running the graph's kernels already, and a chunk costs it a claim (~0.3 us). The
# ResNet-style CNN at batch 16 (its 6 us elementwise kernel split in two): 0.120 -> 0.110 ms (10th percentile); its
# average pool (26624 ops: 2.2 us alone, 5 us whole in the replay, after a convolution whose output both threads
# wrote) split too from 1 << 14 ops: the fastest of 1200 calls 92.8 -> 87.4 us, 10th percentile 118 -> 112 us
GRAPH_SPLIT_OPS, GRAPH_SPLIT_MEM = 1 << 14, 1 << 17

# a graph of at most this much work in all (ops, bytes moved: about 0.1 ms on one core) runs on the calling thread,
# each kernel whole, rather than queued: a small model's replay then waits for no worker (which another process may
# hold the core from) and its kernels' data stays in one core's cache
INLINE_MAX_OPS, INLINE_MAX_MEM = 1 << 22, 1 << 22

class _Piece(NamedTuple):
    """Up to a queue's length of a graph's launches, as the C pool takes them."""
    n: int                    # jobs
    block: Any                # the ctypes array type of all their arguments
    template: Any             # the arguments, with the per-call allocations' slots empty
    arrays: tuple             # per job: entry point, offset of its arguments in the block, size, chunks, help
    patches: list             # (slot in the block, index of the allocation whose address goes there)
    fixed: list               # (allocation root, jobs after the last one using it, jobs after the last one writing it
                              # or None) of the buffers fixed in the launches
    fixed_roots: list         # their roots alone
    varying: list             # (index of a per-call allocation, jobs after the last one using it, after the last one
                              # writing it or None)
    held: tuple               # what the jobs use besides the block and the allocations (programs, values, buffers)
    workers: int
    dynamic: list             # (job, offset of its arguments, launch) of the launches whose values change per call

class LaunchGraph:
    """Prepared launches queued in one call to the C pool (fg_pool_submit_many): a TinyJit replay's kernels without
    a return to Python between them; with little `work` in all (ops, bytes moved), run on the calling thread instead
    (fg_run_many). `calls` pairs each launch with, per buffer it takes per call, the index of that buffer's allocation
    in the list a call of the graph gets. A launch with Variables (see PreparedLaunch.set_values) is read per call:
    its values, size and split, and its `work` counts towards the graph's besides the `work` of the others."""
    waits = True   # (its call takes wait=True: see __call__)

    def __init__(self, calls: list[tuple[PreparedLaunch, tuple[int, ...]]], work: tuple[int, int] | None = None):
        if not calls: raise ValueError("a LaunchGraph needs at least one launch")
        self.pool = calls[0][0].pool
        self.work = work
        self.inline = work is not None and work[0] <= INLINE_MAX_OPS and work[1] <= INLINE_MAX_MEM and \
            all(launch.helpable for launch, _ in calls)
        self.dynamic = [launch for launch, _ in calls if launch.dynamic]
        self._static_helpable = all(launch.helpable for launch, _ in calls if not launch.dynamic)
        self.pieces = [self._piece(calls[i:i + self.pool.QUEUE]) for i in range(0, len(calls), self.pool.QUEUE)]
        # fg_run_many's arguments per piece for an inline graph: the job count and the addresses of its arrays and of
        # its template (which takes each call's addresses in place)
        self._inline_args = [(p.n, ctypes.addressof(p.arrays[0]), ctypes.addressof(p.template),
                              ctypes.addressof(p.arrays[1]), ctypes.addressof(p.arrays[2])) for p in self.pieces]

    @staticmethod
    def _piece(calls: list[tuple[PreparedLaunch, tuple[int, ...]]]) -> _Piece:
        n = len(calls)
        addresses: list[Any] = []
        offsets, patches = [], []
        last_use: dict[int, tuple[Any, int]] = {}   # root id -> (root, index of the last job using it)
        last_write: dict[int, int] = {}              # root id -> index of the last job writing it
        alloc_last: dict[int, int] = {}              # allocation index -> index of the last job using it
        alloc_write: dict[int, int] = {}             # allocation index -> index of the last job writing it
        for k, (launch, indices) in enumerate(calls):
            offsets.append(len(addresses))
            patches += [(len(addresses) + pos, idx) for pos, idx in zip(launch.varying, indices)]
            addresses += launch.addresses
            for root, writes in zip(launch.roots, launch.root_writes):
                last_use[id(root)] = (root, k)
                if writes: last_write[id(root)] = k
            for idx, writes in zip(indices, launch.varying_writes):
                alloc_last[idx] = k
                if writes: alloc_write[idx] = k
        block = ctypes.c_void_p * max(1, len(addresses))
        arrays = ((ctypes.c_void_p * n)(*[launch.program._entry for launch, _ in calls]),
                  (ctypes.c_long * n)(*offsets), (ctypes.c_long * n)(*[launch.global_size for launch, _ in calls]),
                  (ctypes.c_long * n)(*[launch.graph_chunks for launch, _ in calls]),
                  (ctypes.c_int * n)(*[int(launch.helpable) for launch, _ in calls]))
        # each allocation is stamped with the count at which the last job using it is done (n - 1 - k before the end),
        # and the one at which the last job writing it is
        fixed = [(root, n - 1 - k, n - 1 - last_write[i] if i in last_write else None)
                 for i, (root, k) in last_use.items()]
        varying = [(idx, n - 1 - k, n - 1 - alloc_write[idx] if idx in alloc_write else None)
                   for idx, k in alloc_last.items()]
        held = ([launch.program for launch, _ in calls], [launch.boxed for launch, _ in calls],
                [launch.kept for launch, _ in calls], arrays)
        return _Piece(n, block, block(*addresses), arrays, patches, fixed, [r for r, _, _ in fixed], varying, held,
                      max(launch.graph_workers for launch, _ in calls),
                      [(k, offsets[k], launch) for k, (launch, _) in enumerate(calls) if launch.dynamic])

    def _inline_now(self) -> bool:
        """Whether this call runs on the calling thread, with the work the launches with Variables have now."""
        if self.work is None or not self._static_helpable or not all(launch.helpable for launch in self.dynamic):
            return False
        ops = self.work[0] + sum(launch.work[0] for launch in self.dynamic)
        mem = self.work[1] + sum(launch.work[1] for launch in self.dynamic)
        return ops <= INLINE_MAX_OPS and mem <= INLINE_MAX_MEM

    def __call__(self, allocations: list[Any], wait: bool = False) -> None:
        """Launch the graph with this call's allocations. With `wait`, return only once its kernels have run (and
        everything queued before them): this thread claims their chunks as soon as they are queued."""
        pool = self.pool
        if self.inline and not self.dynamic:
            # (the common small replay: each piece's template takes this call's addresses in place, since its jobs run
            # here and now, and the C call's arguments are the same addresses every time)
            if pool._finished.value < pool.submitted: pool.wait()   # (after everything queued before, as run_many)
            run_many = pool._run_many
            for piece, args in zip(self.pieces, self._inline_args):
                template = piece.template
                for slot, idx in piece.patches: template[slot] = _addressof(allocations[idx])
                run_many(*args)
            return
        inline = self.inline if not self.dynamic else self._inline_now()
        for piece in self.pieces:
            fns, offsets, sizes, chunks, helps = piece.arrays
            # (a block of its own per call: the queued jobs read their arguments only when they run)
            args = piece.block.from_buffer_copy(piece.template)
            for slot, idx in piece.patches: args[slot] = ctypes.addressof(allocations[idx])
            workers, values = piece.workers, []
            for k, offset, launch in piece.dynamic:
                # (the size arrays are read when the jobs are queued, the values' C variables when they run: those
                # are new ones per set_values, held with the jobs)
                args[offset + launch.nbufs:offset + len(launch.addresses)] = launch.addresses[launch.nbufs:]
                sizes[k], chunks[k], helps[k] = launch.global_size, launch.chunks, int(launch.helpable)
                workers = max(workers, launch.workers)
                values.append(launch.boxed)
            if inline:
                pool.run_many(piece.n, fns, args, offsets, sizes)
                continue
            end = pool.submit_many(piece.n, fns, args, offsets, sizes, chunks, helps, workers,
                                   (piece.held, args, allocations, values),
                                   itertools.chain(piece.fixed_roots, allocations), wait)
            # (jobs that have run need no stamp: host access to their allocations has nothing to wait for)
            if wait and pool._finished.value >= end: continue
            exported = wait
            # (an allocation that is also a fixed buffer's, or two views of one, is stamped twice: stamp keeps the
            # later jobs)
            for root, back, wback in piece.fixed:
                stamp(root, end - back, 0 if wback is None else end - wback)
                if has_host_view(root): exported = True
            for idx, back, wback in piece.varying:
                stamp(root := allocation_root(allocations[idx]), end - back, 0 if wback is None else end - wback)
                if has_host_view(root): exported = True
            if exported: pool.wait(end)
