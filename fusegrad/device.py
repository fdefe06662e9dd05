"""Devices, memory and compilers: `Device[name]` loads a device plugin (fusegrad/runtime/ops_<name>.py), `Buffer` is a
lazily allocated piece of device memory, `Allocator` and `Compiler` are the parts a device plugin provides."""
from __future__ import annotations
import functools
import hashlib
import importlib
import importlib.util
import os
import pathlib
import shlex
import shutil
import stat
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable
from fusegrad.dtype import DType, dtypes, to_np_dtype
from fusegrad.helpers import CACHELEVEL, DEBUG, ContextVar, atomic_write, cache_dir, prod, remove_path
from fusegrad.hostcpu import host_cpu_count

class GlobalCounters:
    """Process-wide work counters, updated as schedules run (and by allocations, for mem_used)."""
    global_ops: int = 0      # ALU ops of the kernels run
    global_mem: int = 0      # bytes the kernels and copies moved
    time_sum_s: float = 0.0  # measured kernel time (only when runs were timed)
    kernel_count: int = 0    # compiled kernels run (copies and views are not kernels)
    mem_used: int = 0        # bytes of device memory currently allocated by Buffers
    @staticmethod
    def reset() -> None:
        """Zero the run counters (mem_used tracks live memory, so it is kept)."""
        GlobalCounters.global_ops, GlobalCounters.global_mem, GlobalCounters.time_sum_s = 0, 0, 0.0
        GlobalCounters.kernel_count = 0

# *** the device registry ***

_RUNTIME_DIR = pathlib.Path(__file__).parent / "runtime"

class _Device:
    """`Device[name]` -> the (cached) device object; `Device.DEFAULT` is the device new tensors go to."""
    def __init__(self) -> None:
        self._default: str | None = None

    @functools.cached_property
    def _devices(self) -> list[str]:
        return sorted(p.stem[len("ops_"):].upper() for p in _RUNTIME_DIR.glob("ops_*.py"))

    @property
    def available(self) -> list[str]:
        """The device names this install has plugins for (whether or not they work on this machine)."""
        return list(self._devices)

    def canonicalize(self, device: str | None) -> str:
        """"cpu" -> "CPU", "CPU:0" -> "CPU", "cpu:1" -> "CPU:1"; None -> the default device."""
        return self.DEFAULT if device is None else _canonicalize(device)

    def _check(self, canonical: str) -> None:
        base = canonical.partition(":")[0]
        if base not in self._devices:
            raise ValueError(f"unknown device {canonical!r}; available devices: {', '.join(self._devices)}")

    def __getitem__(self, name: str) -> Compiled: return self._open(self.canonicalize(name))

    @functools.cache  # noqa: B019 -- one object per device for the life of the process is the point
    def _open(self, canonical: str) -> Compiled:
        self._check(canonical)
        base = canonical.partition(":")[0]
        module = importlib.import_module(f"fusegrad.runtime.ops_{base.lower()}")
        cls = getattr(module, f"{base}Device", None)
        if cls is None: raise ValueError(f"fusegrad/runtime/ops_{base.lower()}.py defines no {base}Device")
        return cls(canonical)

    @property
    def DEFAULT(self) -> str:
        if self._default is None: self._default = self._from_env()
        return self._default
    @DEFAULT.setter
    def DEFAULT(self, name: str) -> None:
        canonical = self.canonicalize(name)
        self._check(canonical)
        self._default = canonical

    def _from_env(self) -> str:
        # DEV=CPU wins; else a tinygrad-style CPU=1 naming exactly one device; else an NVIDIA GPU if one works; else CPU
        if dev := os.getenv("DEV"):
            canonical = self.canonicalize(dev)
            self._check(canonical)
            return canonical
        chosen = [d for d in self._devices if os.getenv(d) == "1"]  # not getenv: PYTHON=/usr/bin/python mustn't crash
        if len(chosen) > 1: raise ValueError(f"more than one device selected by environment variables: {chosen}")
        if chosen: return chosen[0]
        return "CUDA" if _gpu_found() else _host_device()

def _gpu_found() -> bool:
    """Whether an NVIDIA GPU is there to use: its driver starts, it counts a GPU, and NVRTC loads (cheap where
    there is no driver: one failed library load)."""
    return importlib.import_module("fusegrad.runtime.ops_cuda").gpu_found()

def _host_device() -> str:
    """CPU (C through the system compiler: batched, the fastest first runs); LLVM when there is no C compiler but
    llvmlite is installed."""
    try: find_cc()
    except Exception:
        if importlib.util.find_spec("llvmlite") is not None: return "LLVM"
    return "CPU"

@functools.cache
def _canonicalize(device: str) -> str:
    name, _, rest = device.partition(":")
    return name.upper() + (f":{rest}" if rest and rest != "0" else "")

Device = _Device()

# *** memory ***

class Allocator:
    """Device memory. A device implements `_alloc`/`_free` and the copies; `_as_buffer` (zero-copy host view) and
    `_offset` (a sub-range of an allocation, for Buffer views) are optional."""
    supports_views: bool = False
    # whether Buffers of this device may trade allocations (Buffer.exchange_memory), where _exchangeable allows
    exchanges_memory: bool = False
    # whether kernels queued on the device run in the order they were queued, each after the ones before it have
    # finished (the CPU's C pool): then memory that queued kernels still use can serve a kernel queued after them
    queue_ordered: bool = False
    def alloc(self, size: int, options: Any = None, queued: bool = False) -> Any:
        """`size` bytes of device memory. `queued`: the memory is first used by a kernel queued after every kernel
        queued so far (see LRUAllocator.alloc)."""
        if size < 0: raise ValueError(f"can't allocate {size} bytes")
        return self._alloc(size, options)
    def free(self, opaque: Any, size: int, options: Any = None) -> None: self._free(opaque, size, options)
    def _alloc(self, size: int, options: Any) -> Any: raise NotImplementedError
    def _free(self, opaque: Any, size: int, options: Any) -> None: pass  # garbage collection frees by default
    def _copyin(self, dest: Any, src: memoryview) -> None: raise NotImplementedError
    def _copyout(self, dest: memoryview, src: Any) -> None: raise NotImplementedError
    def _offset(self, opaque: Any, size: int, offset: int) -> Any: raise NotImplementedError(f"{self} has no views")
    def _exchangeable(self, opaque: Any) -> bool:
        """Whether nothing but its Buffer holds this allocation's address for later use (no host view reads it)."""
        return False

# 0: freed memory goes straight back to the device instead of the allocators' caches (LRUAllocator)
LRU = ContextVar.get("LRU", 1)

class LRUAllocator(Allocator):
    """An allocator that keeps freed allocations (up to `max_cached` bytes) to hand them out again: training loops
    free and re-allocate the same sizes every step, and fresh host memory costs page faults."""
    def __init__(self, max_cached: int = 1 << 30) -> None:
        self.cache: OrderedDict[tuple[int, Any], list[Any]] = OrderedDict()
        self.cached_bytes, self.max_cached = 0, max_cached

    def alloc(self, size: int, options: Any = None, queued: bool = False) -> Any:
        if (lst := self.cache.get((size, options))):
            # memory first used by a kernel queued after all the others, on a device that runs its queue in order:
            # the most recently freed allocation, even while queued kernels still use it (they finish before the new
            # one starts, and a host access waits for all of them). Its lines are the likeliest to be in the caches,
            # and a buffer made again every step keeps one allocation however far the Python runs ahead of the
            # kernels: an eager step's weights went round 7 allocations of 1.6 MB, read from memory each time.
            # Otherwise an allocation that no queued kernel still uses (with none, fresh memory: cheaper than waiting
            # for the kernels, as a host copy into it would): the most recently freed one if it is (all are, after a
            # synchronizing read), else the oldest that is. While kernels run behind the Python that queues them,
            # the newest are the ones they still use: a scan from the newest checked a dozen per allocation in an
            # eager training step. An emptied list stays: an eager loop frees and takes one size by turns
            idle = self._idle
            if (queued and self.queue_ordered) or idle(lst[-1]):
                self.cached_bytes -= size
                return lst.pop()
            for i in range(len(lst) - 1):
                if idle(lst[i]):
                    self.cached_bytes -= size
                    return lst.pop(i)
        try: return super().alloc(size, options)
        except MemoryError:
            self.free_cache()
            return super().alloc(size, options)

    def free(self, opaque: Any, size: int, options: Any = None) -> None:
        if LRU.value and size <= self.max_cached and self._reusable(opaque):
            if (lst := self.cache.get(key := (size, options))) is None:
                if len(self.cache) >= 1024:  # (the emptied lists of sizes no longer used go)
                    for k in [k for k, v in self.cache.items() if not v]: del self.cache[k]
                lst = self.cache[key] = []
            lst.append(opaque)
            self.cache.move_to_end(key)
            self.cached_bytes += size
            # evict least recently freed sizes first
            while self.cached_bytes > self.max_cached:
                key, lst = next(iter(self.cache.items()))
                if lst:
                    self.cached_bytes -= key[0]
                    super().free(lst.pop(0), key[0], key[1])
                if not lst: del self.cache[key]
        else: super().free(opaque, size, options)

    def _reusable(self, opaque: Any) -> bool: return True
    def _idle(self, opaque: Any) -> bool:
        """Whether no queued work uses this allocation any more (devices that queue kernels: see ops_cpu)."""
        return True

    def free_cache(self) -> None:
        """Really free every cached allocation."""
        for (size, options), lst in self.cache.items():
            for opaque in lst: super().free(opaque, size, options)
        self.cache.clear()
        self.cached_bytes = 0

class UnrunScheduleError(RuntimeError):
    """A buffer was read that a schedule returned by Tensor.schedule() has yet to write: its contents are not the
    tensor's values until that schedule runs."""

class Buffer:
    """`size` elements of `dtype` on `device`, allocated on first use. A view (`base` given) shares the base's memory
    at byte `offset`; memory is freed when the base and all its views are garbage collected."""
    # how many kernels (and copies) of schedules returned by Tensor.schedule() and not run yet write this buffer:
    # while any do, its contents are not its tensor's values and reading them raises (see expect_writes)
    unwritten: int = 0
    def __init__(self, device: str, size: int, dtype: DType, opaque: Any = None, base: Buffer | None = None,
                 offset: int = 0):
        if size < 0: raise ValueError(f"Buffer size must be >= 0, got {size}")
        # (the cached name lookup itself: a Buffer is made per output of every realize)
        self.device, self.size, self.dtype, self.offset = \
            _canonicalize(device) if device is not None else Device.DEFAULT, size, dtype, offset
        self._base: Buffer | None = None
        if base is not None:
            if opaque is not None: raise ValueError("a view takes its memory from its base; don't pass opaque")
            if base._base is not None: raise ValueError("the base of a view must not be a view itself")
            if base.device != self.device: raise ValueError(f"view on {self.device} of a buffer on {base.device}")
            if offset < 0 or offset + self.nbytes > base.nbytes:
                raise ValueError(f"view of {self.nbytes} bytes at offset {offset} exceeds base of {base.nbytes} bytes")
            self._base = base
            # (a view takes its base's address when allocated: the base's memory may no longer change hands)
            base._viewed = True
        elif offset != 0: raise ValueError("only views have an offset")
        if opaque is not None: self.allocate(opaque)

    @classmethod
    def fresh(cls, device: str, size: int, dtype: DType) -> Buffer:
        """Buffer(device, size, dtype) of a canonical device name and a valid size, without the constructor's checks
        (a replayed realize makes one per output)."""
        b = _new_object(cls)
        b.device, b.size, b.dtype, b.offset, b._base = device, size, dtype, 0, None
        return b

    @property
    def base(self) -> Buffer: return self._base if self._base is not None else self
    @property
    def nbytes(self) -> int: return self.size * self.dtype.itemsize
    @property
    def allocator(self) -> Allocator:
        # (a device object lives as long as the process: its allocator is looked up once per device name)
        if (a := _allocators.get(self.device)) is None: a = _allocators[self.device] = Device[self.device].allocator
        return a

    def is_allocated(self) -> bool: return "_buf" in self.__dict__
    def ensure_allocated(self, queued: bool = False) -> Buffer:
        return self if "_buf" in self.__dict__ else self.allocate(queued=queued)

    def allocate(self, opaque: Any = None, queued: bool = False) -> Buffer:
        """Get memory now: `opaque` (an existing allocation) if given, else from the device (or from the base).
        `queued`: the memory is first used by a kernel queued after every kernel queued so far (Allocator.alloc)."""
        if "_buf" in self.__dict__: raise RuntimeError(f"{self!r} is already allocated")
        nbytes = self.size * self.dtype.itemsize
        if self._base is not None:
            self._base.ensure_allocated()
            self._buf = self.allocator._offset(self._base._buf, nbytes, self.offset)
        elif opaque is not None:
            self._buf, self._owned = opaque, False  # memory we didn't allocate isn't ours to free or count
        else:
            if nbytes > 1 << 30 and nbytes > (mem := Device[self.device].memory_size):
                raise MemoryError(f"{self!r} needs {nbytes} bytes, more than the {mem} bytes of memory of device "
                                  f"{self.device}")
            self._buf, self._owned = self.allocator.alloc(nbytes, queued=queued), True
            GlobalCounters.mem_used += nbytes
        return self

    def exchange_memory(self, other: Buffer) -> bool:
        """Trade allocations with `other`, a base Buffer of the same device and size: a copy of a buffer about to be
        overwritten whole (a snapshot of a weight the optimizer updates) takes the buffer's memory, and the buffer the
        copy's fresh memory, so nothing is copied. Queued kernels keep the addresses they were given, so the
        allocations' pending work goes with them. False, with nothing changed, where something else may hold either
        address for later use: a view of either Buffer, a host view of its memory, memory it didn't allocate."""
        a, b = self.__dict__, other.__dict__
        if self._base is not None or other._base is not None or "_viewed" in a or "_viewed" in b or \
                self.device != other.device or self.nbytes != other.nbytes or not a.get("_owned") or \
                not b.get("_owned"):
            return False
        allocator = self.allocator
        if not allocator.exchanges_memory or not allocator._exchangeable(a["_buf"]) or \
                not allocator._exchangeable(b["_buf"]):
            return False
        a["_buf"], b["_buf"] = b["_buf"], a["_buf"]
        return True

    def deallocate(self) -> None:
        """Give the memory back (to the allocator's cache). Views just drop their handle."""
        if "_buf" not in self.__dict__: raise RuntimeError(f"{self!r} is not allocated")
        opaque = self._buf
        del self._buf
        if self._base is None and self._owned:
            nbytes = self.size * self.dtype.itemsize
            GlobalCounters.mem_used -= nbytes
            self.allocator.free(opaque, nbytes)

    def __del__(self) -> None:
        # (deallocate's work inline: a replayed realize frees its previous result's Buffer)
        # interpreter shutdown may have torn down what this needs; the OS reclaims the memory anyway
        try:
            if self._base is None and (opaque := self.__dict__.get("_buf")) is not None and self._owned:
                nbytes = self.size * self.dtype.itemsize
                GlobalCounters.mem_used -= nbytes
                self.allocator.free(opaque, nbytes)
        except Exception: pass

    # *** writes a returned schedule has yet to make ***

    def expect_write(self) -> None:
        """Note that a kernel of a schedule handed out without running will write this buffer (Tensor.schedule)."""
        self.unwritten += 1
        unwritten_buffers[id(self)] = weakref.ref(self, functools.partial(_forget_unwritten, id(self)))

    def written(self) -> None:
        """Note that one of the kernels expect_write counted has run (or is running: it may read what it writes)."""
        if self.unwritten > 1: self.unwritten -= 1
        elif self.unwritten:
            del self.unwritten  # (back to the class's 0)
            unwritten_buffers.pop(id(self), None)

    def check_written(self, what: str = "reading") -> None:
        """Raise UnrunScheduleError when this buffer (or the one it is a view of) waits for a schedule to write it."""
        if self.unwritten or (self._base is not None and self._base.unwritten):
            raise UnrunScheduleError(
                f"{what} {self!r}, which a schedule returned by Tensor.schedule() (or schedule_with_vars) computes and "
                "which has not run yet: run that schedule first with fusegrad.engine.realize.run_schedule(schedule, "
                "var_vals), or call .realize() instead of .schedule()")

    def view(self, size: int, dtype: DType, offset: int) -> Buffer:
        """A Buffer of `size` `dtype` elements sharing this buffer's memory from byte `offset`."""
        return Buffer(self.device, size, dtype, base=self.base, offset=self.offset + offset)

    # *** host transfers ***

    def copyin(self, mv: memoryview) -> Buffer:
        """Fill the buffer from host memory of exactly nbytes bytes."""
        mv = _flat_bytes(mv)
        if mv.nbytes != self.nbytes: raise ValueError(f"copyin of {mv.nbytes} bytes into a {self.nbytes} byte buffer")
        if self.nbytes: self.ensure_allocated().allocator._copyin(self._buf, mv)
        else: self.ensure_allocated()
        return self

    def copyout(self, mv: memoryview, check: bool = True) -> memoryview:
        """Copy the contents into writable host memory of exactly nbytes bytes. (`check=False`: a schedule's copy item,
        whose reads its schedule checked before running, check_unwritten: its source may be a buffer that a later
        item overwrites.)"""
        if check and (self.unwritten or self._base is not None): self.check_written("copying out")
        mv = _flat_bytes(mv)
        if mv.nbytes != self.nbytes: raise ValueError(f"copyout of a {self.nbytes} byte buffer into {mv.nbytes} bytes")
        if self.nbytes: self.ensure_allocated().allocator._copyout(mv, self._buf)
        return mv

    def as_buffer(self, allow_zero_copy: bool = True, check: bool = True) -> memoryview:
        """The contents as a byte memoryview: on devices with host memory (CPU) the memory itself, else a copy.
        (`check`: as copyout's.)"""
        if check and (self.unwritten or self._base is not None): self.check_written()
        self.ensure_allocated()
        if allow_zero_copy and hasattr(self.allocator, "_as_buffer"): return self.allocator._as_buffer(self._buf)
        return self.copyout(memoryview(bytearray(self.nbytes)), check=check)

    def numpy(self, shape: tuple[int, ...] | None = None) -> Any:
        """A numpy array of this buffer's dtype (bfloat16 widened to float32) holding a copy of the contents, 1-D or
        of `shape` (which must hold exactly `size` elements)."""
        import numpy as np
        if self.unwritten or self._base is not None: self.check_written()
        if shape is not None and prod(shape) != self.size:
            raise ValueError(f"numpy: shape {shape} doesn't hold the {self.size} elements of {self!r}")
        if self.dtype.scalar() == dtypes.bfloat16:  # numpy has no bfloat16: widen the bits to float32
            raw = np.frombuffer(self.as_buffer(), dtype=np.uint16).astype(np.uint32) << 16
            out = raw.view(np.float32)
            return out if shape is None else out.reshape(shape)
        # copied out straight into the array's memory (no host view of the buffer is made: one would have to be
        # tracked, as memory a live view reads isn't reused)
        out = np.empty(self.size, to_np_dtype(self.dtype))
        if self.size: self.ensure_allocated().allocator._copyout(memoryview(out).cast("B"), self._buf)
        return out if shape is None else out.reshape(shape)

    def __repr__(self) -> str:
        extra = f" view of offset {self.offset}" if self._base is not None else ""
        alloc = "" if self.is_allocated() else " (unallocated)"
        return f"<Buffer {self.device} size={self.size} dtype={self.dtype}{extra}{alloc}>"

# id -> weak reference of every Buffer whose `unwritten` count is not 0 (empty but for schedules handed out and not
# run yet: a realize tests it to keep its fast paths)
unwritten_buffers: dict[int, weakref.ref[Buffer]] = {}

def _forget_unwritten(key: int, _: Any) -> None: unwritten_buffers.pop(key, None)

# device name -> its allocator (Buffer.allocator)
_allocators: dict[str, Allocator] = {}
_new_object = object.__new__

def _flat_bytes(mv: Any) -> memoryview:
    mv = mv if isinstance(mv, memoryview) else memoryview(mv)
    if not mv.c_contiguous: raise ValueError("host memory for a copy must be contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv

# *** compilers ***

class CompileError(Exception):
    """The device compiler rejected a program; the message holds its output and the numbered source."""

def numbered(src: str) -> str:
    return "\n".join(f"{i+1:4d} {line}" for i, line in enumerate(src.splitlines()))

@functools.cache
def find_cc() -> list[str]:
    """The C compiler command: $CC (may include arguments), else the first of cc, gcc, clang on PATH."""
    if cc := os.getenv("CC"): return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        if path := shutil.which(name): return [path]
    raise CompileError("no C compiler found: set CC or install cc, gcc or clang")

class Compiler:
    """Turns source into a loadable binary, with a memory cache and a disk cache (CACHELEVEL=0 disables the disk).

    Cache entries on disk are `MAGIC + sha256(payload) + payload`, written atomically, so a truncated or garbage file
    is detected and recompiled instead of crashing the program that loads it. What is read is checked before it is
    trusted: only a regular file (not a link, FIFO, device or folder) of at most MAX_ENTRY_BYTES is read, without
    blocking, and its payload must pass `validate` (the device's check that the binary is whole); anything else is
    removed and recompiled."""
    MAGIC = b"FGC1"
    MEM_CACHE_SIZE = 256        # binaries kept in memory (least recently used dropped; the disk keeps them all)
    MAX_ENTRY_BYTES = 1 << 28   # no compiled program is near this: a bigger entry is not one of ours
    parallel: bool = False      # compile() may run in several threads at once (a compiler process per call)
    def __init__(self, cachekey: str | None = None):
        # cachekey names this compiler's configuration (compiler path, version, flags); None means no caching
        self.cachekey = cachekey
        self.mem_cache: OrderedDict[str, bytes] = OrderedDict()
        self.disk_hits, self.compiles = 0, 0

    def compile(self, src: str) -> bytes: raise NotImplementedError
    def validate(self, lib: bytes) -> bool:
        """Whether a cached binary looks loadable (devices override with a format check)."""
        return True

    def _key(self, src: str) -> str: return hashlib.sha256(f"{self.cachekey}\0{src}".encode()).hexdigest()
    def cache_path(self, src: str) -> str:
        return os.path.join(cache_dir(), "compiled", self._key(src)[:2], self._key(src))

    def compile_cached(self, src: str) -> bytes:
        """`compile(src)`, through the memory and disk caches."""
        return self.compile_cached_many([src])[0]

    def compile_cached_many(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        """`compile_cached` of every source; the ones not cached are compiled together (in parallel threads when
        the compiler allows it), so a schedule of new kernels costs about one compile per core, not one per kernel.
        `units`: how many compiler runs the uncached sources are split into at most (a compiler that batches)."""
        if self.cachekey is None: return self._compile_all(srcs, units)
        out: dict[str, bytes] = {}
        for src in dict.fromkeys(srcs):
            key = self._key(src)
            if (lib := self.mem_cache.get(key)) is not None: self.mem_cache.move_to_end(key)
            elif CACHELEVEL >= 1 and (lib := self._read(self.cache_path(src))) is not None: self.disk_hits += 1
            else: continue
            out[src] = lib
        todo = [src for src in dict.fromkeys(srcs) if src not in out]
        for src, lib in zip(todo, self._compile_all(todo, units)):
            # (a compiler that wrote a broken binary, e.g. on a full disk, must not have it loaded or cached)
            if not self.validate(lib): raise CompileError(f"the compiler wrote an invalid binary for:\n{numbered(src)}")
            if CACHELEVEL >= 1: self._write(self.cache_path(src), lib)
            out[src] = lib
        for src, lib in out.items():
            self.mem_cache[self._key(src)] = lib
            while len(self.mem_cache) > self.MEM_CACHE_SIZE: self.mem_cache.popitem(last=False)
        return [out[src] for src in srcs]

    def _compile_all(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        if not self.parallel or len(srcs) < 2: return [self._compile(src) for src in srcs]
        with ThreadPoolExecutor(max_workers=min(len(srcs), host_cpu_count())) as pool:
            return list(pool.map(self._compile, srcs))

    def evict(self, src: str) -> None:
        """Forget a cached binary (memory and disk), e.g. when it failed to load."""
        if self.cachekey is None: return
        self.mem_cache.pop(self._key(src), None)
        remove_path(self.cache_path(src))

    def _compile(self, src: str) -> bytes:
        self.compiles += 1
        return self.compile(src)

    def _read(self, path: str) -> bytes | None:
        # O_NONBLOCK: opening a FIFO doesn't wait for a writer; O_NOFOLLOW: a link (to /dev/zero, say) isn't followed
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try: fd = os.open(path, flags)
        except FileNotFoundError: return None
        except OSError as e: return self._corrupt(path, f"can't open it ({e.strerror})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode): return self._corrupt(path, "not a regular file")
            if st.st_size > self.MAX_ENTRY_BYTES: return self._corrupt(path, f"{st.st_size} bytes")
            data = b""
            # (to one byte past the size: a file that grew meanwhile isn't the one that was checked)
            while len(data) <= st.st_size and (more := os.read(fd, st.st_size + 1 - len(data))): data += more
        except OSError as e: return self._corrupt(path, f"can't read it ({e.strerror})")
        finally: os.close(fd)
        head = len(self.MAGIC) + 32
        if len(data) != st.st_size or len(data) < head or not data.startswith(self.MAGIC):
            return self._corrupt(path, "not a cache entry")
        lib = data[head:]
        if hashlib.sha256(lib).digest() != data[len(self.MAGIC):head]: return self._corrupt(path, "checksum mismatch")
        if not self.validate(lib): return self._corrupt(path, "not a whole binary")
        return lib

    def _corrupt(self, path: str, why: str) -> None:
        # removed, so the recompiled binary takes its place (a folder there would stop the write)
        if DEBUG >= 1: print(f"compile cache: removing bad entry {path}: {why}")
        remove_path(path)
        return None

    def _write(self, path: str, lib: bytes) -> None:
        try:
            with atomic_write(path) as f: f.write(self.MAGIC + hashlib.sha256(lib).digest() + lib)
        except OSError as e:  # a read-only or full cache dir only costs speed
            if DEBUG >= 1: print(f"compile cache: can't write {path}: {e}")

# *** a device ***

@functools.cache
def host_memory_size() -> int:
    """Bytes of physical memory of this machine."""
    try: return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError): return 1 << 62  # (no sysconf: no bound short of the address space)

class Compiled:
    """A device: its memory (`allocator`), code generator (`renderer`), `compiler` and program class (`runtime`)."""
    def __init__(self, device: str, allocator: Allocator, renderer: Any, compiler: Compiler | None,
                 runtime: Callable[..., Any] | None):
        self.device, self.allocator, self.runtime = device, allocator, runtime
        # a subclass may supply renderer/compiler lazily (as properties) instead
        if renderer is not None: self.renderer = renderer
        if compiler is not None: self.compiler = compiler
    @property
    def max_threads(self) -> int:
        """How many host threads one kernel may be split across (1: the runtime doesn't split)."""
        return 1
    @property
    def memory_size(self) -> int:
        """Bytes of memory the device has (the machine's RAM here, for devices in host memory): no tensor larger than
        this can be held."""
        return host_memory_size()
    def synchronize(self) -> None:
        """Wait until all work submitted to the device is done (host devices run synchronously)."""
    def __repr__(self) -> str: return f"<{type(self).__name__} {self.device}>"
