"""A CPU kernel loaded from a shared object and called on host memory: queued on the C pool (and split across cores)
or run on the calling thread (split by the Python pool)."""
from __future__ import annotations
import ctypes
import time
import weakref
from typing import Any, Callable
from fusegrad.helpers import CPU_ASYNC, CPU_THREADS
from fusegrad.runtime.cpu_compiler import load_library, unload_library
from fusegrad.runtime.cpu_pool import allocation_root, c_pool, cores, has_host_view, python_pool

def _clamped_threads(threads: int, global_size: int) -> int:
    """The threads a kernel call is split across: at most CPU_THREADS (when set) and global_size, at least 1."""
    if CPU_THREADS.value > 0: threads = min(threads, CPU_THREADS.value)
    return max(1, min(threads, global_size))

def _arguments(bufs: tuple, vals: tuple) -> tuple[list, list]:
    """A queued kernel's arguments, everything by pointer: the buffers' memory, and each Variable's value in a C
    variable (returned too: it is held with the job)."""
    boxed = [ctypes.c_double(v) if type(v) is float else ctypes.c_long(v) for v in vals]
    return boxed, [ctypes.addressof(b) if b is not None else None for b in bufs] + [ctypes.addressof(v) for v in boxed]

def _workers(threads: int, helpable: bool) -> int:
    """Worker threads a call split in `threads` chunks needs: one fewer where the waiting thread runs a chunk too."""
    return max(1, threads - 1) if helpable else threads

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
        try: self._dll = load_library(lib)
        except OSError as e: raise RuntimeError(f"can't load the shared object for {name}: {e}") from e
        try: fxn = getattr(self._dll, name)
        except AttributeError as e: raise RuntimeError(f"the shared object has no function {name!r}") from e
        # the entry point with one signature for every kernel, for the C thread pool (not every renderer writes one)
        if (entry := getattr(self._dll, f"{name}_entry", None)) is not None:
            self._entry = ctypes.cast(entry, ctypes.c_void_p).value
        # ctypes never unloads a library: without dlclose every program ever loaded keeps its mappings, and a long
        # run with thousands of distinct kernels exhausts the process's map count. The finalizer holds everything it
        # calls, so it works at interpreter shutdown after this module's globals are gone; at exit it doesn't run.
        weakref.finalize(self, unload_library, self._dll._handle).atexit = False
        return fxn

    def prepare(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1, join: bool = False,
                varying: tuple[int, ...] = (), helpable: bool = True) -> Callable[..., None] | None:
        """The queued call `self(*bufs, vals=..., ...)` as a function that repeats it (a TinyJit replay: the same
        kernel every step), with the arguments converted once. The buffers at positions `varying` change per call:
        the function takes their allocations, in that order. None where calls aren't queued."""
        threads = _clamped_threads(threads, global_size)
        if self._entry is None or not CPU_ASYNC.value or cores() < 2 or (pool := c_pool()) is None: return None
        # (the buffers at `varying` may be given as None: their addresses are filled in per call)
        boxed, addresses = _arguments(bufs, vals)
        array_type = ctypes.c_void_p * len(addresses)
        fixed = array_type(*addresses)
        kept = [b for i, b in enumerate(bufs) if b is not None and i not in varying]  # (held by the closure)
        roots = [allocation_root(b) for b in kept]
        entry, submit = self._entry, pool.submit
        workers, join = _workers(threads, helpable), join and threads > 1 and helpable
        def launch(*allocations: Any) -> None:
            if allocations:
                # (an array of its own per call: a queued job reads its arguments only when it runs)
                now = addresses.copy()
                for i, a in zip(varying, allocations): now[i] = ctypes.addressof(a)
                args: Any = array_type(*now)
                stamped = roots + [allocation_root(a) for a in allocations]
            else: args, stamped = fixed, roots
            count = submit(entry, args, global_size, threads, workers, (self, args, boxed, kept, allocations), join,
                           stamped, helpable)
            exported = False
            for root in stamped:
                root._fg_job = count
                if has_host_view(root): exported = True
            if exported: pool.wait(count)
        return launch

    def __call__(self, *bufs: Any, vals: tuple = (), global_size: int = 1, threads: int = 1,
                 wait: bool = False, join: bool = False, helpable: bool = True) -> float | None:
        """Run over [0, global_size), split into `threads` contiguous chunks run in parallel (capped by CPU_THREADS
        when set). The kernel is queued on the C pool (see CPool) and this returns before it has run, unless `wait`
        (then it returns the elapsed seconds) or a buffer has a live host view (a memoryview or numpy array of its
        memory, whose reader expects the new values once the kernel is called). With `join`, a kernel that nothing
        is queued ahead of has chunks run by this thread before the call returns. Not `helpable`: chunks too long
        for the calling thread to run (it must stay free to take a Ctrl-C), queued for the workers even when they
        would run here."""
        threads = _clamped_threads(threads, global_size)
        pool = c_pool() if self._entry is not None else None
        # (a timed one-thread kernel runs here, as it would without a queue: the handover to a worker isn't its time)
        queued = bool(CPU_ASYNC.value) and cores() > 1
        if pool is not None and (threads > 1 or (queued and not wait) or not helpable):
            if wait: pool.wait()  # (timed alone: nothing queued before it)
            st = time.perf_counter() if wait else 0.0
            boxed, addresses = _arguments(bufs, vals)
            args = (ctypes.c_void_p * len(addresses))(*addresses)
            # (the program too: its code must stay loaded until the job has run)
            count = pool.submit(self._entry, args, global_size, threads, _workers(threads, helpable),
                                (self, args, boxed, bufs), join and threads > 1 and helpable, bufs, helpable)
            # (stamped once queued: another thread touching these buffers meanwhile races with the kernel anyway)
            exported = False
            for b in bufs:
                if b is None: continue
                root = allocation_root(b)
                root._fg_job = count
                if has_host_view(root): exported = True
            if wait or exported or not queued: pool.wait(count)
            return time.perf_counter() - st if wait else None
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
