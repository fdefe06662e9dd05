"""The CL device: OpenCL, through pyopencl. Kernels are OpenCL C (renderer/opencl.py), built by the device's OpenCL
compiler into a program binary (cached on disk like the CPU's shared objects, keyed by the device and its driver's
version; for PoCL the source alone, which PoCL's own cache keeps built) and launched on one in-order command queue per
device: a GPU-style kernel as its grid of work-groups (`global_dims` x `local_dims`, refused before launching where the
group asks more than the device has), a CPU-style one as one work-item per iteration of its parallel outermost loop.
`CL` is the first OpenCL device found (GPUs first), `CL:1` the second, and so on; PoCL (`pip install
'fusegrad[opencl]'`) makes the CPU one (`POCL_DEVICES='pthread pthread'` lists it twice, as CL and CL:1).

pyopencl rather than ctypes on the OpenCL C API: its wheel brings an ICD loader that finds PoCL's and the system's
OpenCL implementations, every call's error code is checked and raised by name, and the OpenCL objects (buffers,
programs, kernels, events) are released when Python drops them, also while queued commands still use them (OpenCL
frees them after those commands). With ctypes all of that would be ours to write, for no gain per launch: setting the
arguments and enqueueing a kernel are a few C calls either way."""
from __future__ import annotations
import functools
import hashlib
import math
import re
import warnings
from typing import Any
from fusegrad.device import Compiled, CompileError, Compiler, LRUAllocator, numbered

MISSING = "pip install 'fusegrad[opencl]' (pyopencl, and PoCL: an OpenCL implementation for the CPU)"

def _cl() -> Any:
    try: import pyopencl as cl
    except ImportError as e: raise ImportError(f"the CL device needs pyopencl: {MISSING}") from e
    return cl

@functools.cache
def cl_devices() -> tuple[Any, ...]:
    """The OpenCL devices of every platform, GPUs first (the order CL, CL:1, ... name them)."""
    cl = _cl()
    try: platforms = cl.get_platforms()
    except cl.Error as e: raise RuntimeError(f"the CL device found no OpenCL platform ({e}): {MISSING}") from e
    if not platforms: raise RuntimeError(f"the CL device found no OpenCL platform: {MISSING}")
    devices = []
    for p in platforms:
        try: devices += p.get_devices()
        except cl.Error: pass   # (a platform without devices)
    if not devices: raise RuntimeError(f"the CL device found OpenCL platforms but no devices: {MISSING}")
    return tuple(sorted(devices, key=lambda d: not d.type & cl.device_type.GPU))

# *** memory ***

class CLMemory:
    """An allocation: the OpenCL buffer and the device whose context holds it (its queue runs what uses it)."""
    __slots__ = ("buf", "device")
    def __init__(self, buf: Any, device: CLDevice): self.buf, self.device = buf, device

class CLAllocator(LRUAllocator):
    """Buffers of the device's context. Copies to and from the host wait for the queue: the host memory they read or
    write may be gone or read right after they return."""
    def __init__(self, device: CLDevice):
        super().__init__()
        self.device = device

    def _alloc(self, size: int, options: Any) -> CLMemory:
        cl, dev = _cl(), self.device
        if size > dev.cl_device.max_mem_alloc_size:
            raise MemoryError(f"can't allocate {size} bytes on {dev.device}: its largest buffer is "
                              f"{dev.cl_device.max_mem_alloc_size} bytes")
        # (OpenCL has no empty buffers)
        try: return CLMemory(cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, max(size, 1)), dev)
        except cl.Error as e: raise MemoryError(f"can't allocate {size} bytes on {dev.device}: {e}") from e

    def _offset(self, opaque: CLMemory, size: int, offset: int) -> CLMemory:
        # the memory planner's views start at 0: the buffer itself (kernels and copies touch only the view's bytes)
        if offset == 0 or size == 0: return CLMemory(opaque.buf, opaque.device)
        align = self.device.cl_device.mem_base_addr_align // 8
        if offset % align:
            raise NotImplementedError(f"a view at byte {offset} of a buffer on {self.device.device}: OpenCL "
                                      f"sub-buffers start at multiples of {align} bytes there")
        return CLMemory(opaque.buf.get_sub_region(offset, size), opaque.device)

    def _copyin(self, dest: CLMemory, src: memoryview) -> None:
        _cl().enqueue_copy(dest.device.queue, dest.buf, src, is_blocking=True)

    def _copyout(self, dest: memoryview, src: CLMemory) -> None:
        _cl().enqueue_copy(src.device.queue, dest, src.buf, is_blocking=True)

# *** compiler ***

# a compiler message in the build log: clang's "<file>:<line>:<col>: error: <msg>", or PoCL's "error: <file>:<line>:
# <col>: <msg>"
_LOG_LINE = re.compile(r"^(?:error: )?\S*?:(\d+):\d+: (?:error: )?(.*)$", re.MULTILINE)

def build_error(device: str, log: str, src: str) -> str:
    """The message of a failed build: each error with the source line it points at, the log, the numbered source."""
    lines = src.splitlines()
    errors = [f"line {m.group(1)}: {m.group(2)}\n    {lines[int(m.group(1)) - 1].strip()}"
              for m in _LOG_LINE.finditer(log) if "warning:" not in m.group(0) and 0 < int(m.group(1)) <= len(lines)]
    head = "\n".join(errors) if errors else "(no error line in the log)"
    if "unknown target CPU" in log:
        # (PoCL compiles for the host CPU by the name its LLVM gives it; an LLVM older than the CPU knows no name)
        head += "\nthis OpenCL implementation's compiler doesn't know this CPU: the PoCL in pyopencl's wheel " \
            "(LLVM 14) can't compile for CPUs newer than its LLVM (AMD's Zen 5); a newer PoCL can (Debian: apt-get " \
            "install pocl-opencl-icd), or use the CPU device"
    return f"OpenCL build failed on {device}:\n{head}\n--- build log ---\n{log.strip()}\n" \
        f"--- source ---\n{numbered(src)}"

class CLCompiler(Compiler):
    """OpenCL C -> the device's program binary (what clGetProgramInfo(CL_PROGRAM_BINARIES) gives: for PoCL LLVM
    bitcode, which the driver turns into machine code when the program is loaded)."""
    def __init__(self, device: CLDevice):
        cl, d = _cl(), device.cl_device
        self.device = device
        # IEEE division and square roots (OpenCL allows a few ulps unless asked)
        exact = d.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT
        self.options = "-cl-fp32-correctly-rounded-divide-sqrt" if exact else ""
        # PoCL makes its program binary by compiling every kernel for any group size, seconds of work for a kernel with
        # barriers, which it does again for the group size of the first launch; and it keeps the programs it built
        # from a source in a cache of its own. So for PoCL the lib is the source alone, built again where it is loaded
        self.keep_binary = "Portable Computing Language" not in d.platform.name
        super().__init__(f"CL|{d.platform.name}|{d.platform.version}|{d.name}|{d.version}|{d.driver_version}|"
                         f"{self.options}")

    def compile(self, src: str) -> bytes:
        cl, dev = _cl(), self.device
        prg = cl._cl._Program(dev.context, src)   # (pyopencl's Program would keep a disk cache of its own)
        try:
            with warnings.catch_warnings():   # (a driver's remarks on a program that built are no concern of a user's)
                warnings.simplefilter("ignore", cl.CompilerWarning)
                prg.build(self.options.encode(), [dev.cl_device])
        except cl.Error as e:
            try: log = prg.get_build_info(dev.cl_device, cl.program_build_info.LOG)
            except cl.Error: log = str(e)
            raise CompileError(build_error(dev.device, log, src)) from None
        return pack(src, bytes(prg.get_info(cl.program_info.BINARIES)[0]) if self.keep_binary else b"")

    def _compile_all(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        # a build costs about the same for one kernel as for ten (the driver's compiler starts up, its builtins are
        # linked in), so new kernels are built together: one program of up to BATCH_KERNELS kernels (the renderer
        # names each after its source and guards its helpers, so any set of them is one valid source)
        if len(srcs) < 2: return super()._compile_all(srcs)
        out: list[bytes] = []
        for i in range(0, len(srcs), BATCH_KERNELS):
            batch = srcs[i:i + BATCH_KERNELS]
            try: lib = self._compile("\n".join(batch))
            except CompileError:
                # this batch one by one, so the error names the kernel (the batches built already stay built)
                out += super()._compile_all(batch)
                continue
            out += [lib] * len(batch)
        return out

    def validate(self, lib: bytes) -> bool: return unpack(lib) is not None

# What the compiler gives is the program's source and its binary, so a CL device of another kind (a GPU beside PoCL)
# that runs the kernel builds it from the source for itself
_MAGIC = b"FGCL"

def pack(src: str, binary: bytes) -> bytes:
    text = src.encode()
    return _MAGIC + len(text).to_bytes(8, "little") + text + binary

def unpack(lib: bytes) -> tuple[str, bytes] | None:
    """(source, binary) of what `pack` made; None if `lib` isn't that."""
    if len(lib) < 12 or not lib.startswith(_MAGIC): return None
    n = int.from_bytes(lib[4:12], "little")
    if len(lib) < 12 + n: return None   # (the binary may be empty: see CLCompiler.keep_binary)
    try: return lib[12:12 + n].decode(), lib[12 + n:]
    except UnicodeDecodeError: return None

BATCH_KERNELS = 32

# *** programs ***

class CLProgram:
    """A kernel loaded from its program binary. It runs on the queue of the device its first buffer is on: another CL
    device loads it into its own context on first use (the binary where the device is of the same kind, else the
    program built from its source for that device)."""
    def __init__(self, device: CLDevice, name: str, lib: bytes):
        if (unpacked := unpack(lib)) is None: raise ValueError(f"not a CL program binary for kernel {name}")
        self.device, self.name, self.lib, self.source = device, name, lib, unpacked[0]
        self._kernels: dict[CLDevice, Any] = {}
        self._groups_ok: set[tuple[CLDevice, tuple[int, ...]]] = set()   # group shapes checked against a device
        self._kernel(device)   # (a binary that doesn't load fails here, where the caller recompiles it)

    def _kernel(self, dev: CLDevice) -> Any:
        if (k := self._kernels.get(dev)) is None:
            cl = _cl()
            lib = self.lib if dev.compiler.cachekey == self.device.compiler.cachekey else \
                dev.compiler.compile_cached(self.source)
            try: k = self._kernels[dev] = cl.Kernel(dev.load(lib), self.name)
            except cl.Error as e:
                raise RuntimeError(f"can't load the OpenCL binary of kernel {self.name} on {dev.device}: {e}") from e
        return k

    def _check_group(self, dev: CLDevice, k: Any, local_dims: tuple[int, ...]) -> None:
        """Refuse a work-group `dev` can't run (checked once per device and group shape)."""
        if (dev, local_dims) in self._groups_ok: return
        cl, d = _cl(), dev.cl_device
        info = cl.kernel_work_group_info
        check_group(self.name, dev.device, local_dims, int(k.get_work_group_info(info.LOCAL_MEM_SIZE, d)),
                    max_items=min(int(d.max_work_group_size), int(k.get_work_group_info(info.WORK_GROUP_SIZE, d))),
                    max_sizes=tuple(d.max_work_item_sizes), local_mem=int(d.local_mem_size))
        self._groups_ok.add((dev, local_dims))

    def __call__(self, *bufs: CLMemory, vals: tuple = (), global_size: int = 1, threads: int = 1, wait: bool = False,
                 join: bool = False, helpable: bool = True, global_dims: tuple[int, ...] | None = None,
                 local_dims: tuple[int, ...] | None = None) -> float | None:
        """Run the kernel: a GPU-style one (`global_dims` given) as global_dims[d] work-groups of local_dims[d]
        work-items along each launch dimension d, a CPU-style one as `global_size` work-items (one per iteration of
        its parallel loop). With `wait`, wait for it and return the seconds the device says it took. `threads`,
        `join` and `helpable` are the CPU's and mean nothing here."""
        import numpy as np
        dev = bufs[0].device if bufs else self.device
        k = self._kernel(dev)
        if global_dims is not None:
            global_dims, local_dims = launch_dims(self.name, global_dims, local_dims)
            self._check_group(dev, k, local_dims)
        fdt = np.float64 if dev.renderer.has_fp64 else np.float32
        k.set_args(*[b.buf for b in bufs], *[fdt(v) if type(v) is float else np.int64(v) for v in vals])
        if global_dims is None:
            if global_size <= 0: return 0.0 if wait else None   # (OpenCL launches no empty grid)
            ev = _cl().enqueue_nd_range_kernel(dev.queue, k, (global_size,), None)
        else:
            if 0 in global_dims: return 0.0 if wait else None
            ev = _cl().enqueue_nd_range_kernel(dev.queue, k, tuple(g * n for g, n in zip(global_dims, local_dims)),
                                               local_dims)
        if not wait: return None
        ev.wait()
        return (ev.profile.end - ev.profile.start) * 1e-9

def launch_dims(name: str, global_dims: tuple, local_dims: tuple | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (global_dims, local_dims) of a GPU-style launch as ints, checked for shape."""
    if local_dims is None: raise ValueError(f"kernel {name}: a launch with global_dims needs local_dims")
    gd, ld = tuple(int(g) for g in global_dims), tuple(int(n) for n in local_dims)
    if not 1 <= len(gd) <= 3 or len(gd) != len(ld):
        raise ValueError(f"kernel {name}: global_dims {gd} and local_dims {ld} must have the same length, 1 to 3")
    if any(g < 0 for g in gd) or any(n < 1 for n in ld):
        raise ValueError(f"kernel {name}: global_dims {gd} must be >= 0 and local_dims {ld} >= 1")
    return gd, ld

def check_group(name: str, device: str, local_dims: tuple[int, ...], local_mem_used: int, max_items: int,
                max_sizes: tuple[int, ...], local_mem: int) -> None:
    """Refuse (RuntimeError) a work-group of `local_dims` work-items using `local_mem_used` bytes of local memory that
    exceeds a limit of `device`: `max_items` work-items in all (the device's and this kernel's), `max_sizes` along
    each dimension, `local_mem` bytes. OpenCL implementations don't all refuse such a launch themselves, and one that
    runs part of a group would compute wrong results."""
    where = f"kernel {name} on {device}"
    if (n := math.prod(local_dims)) > max_items:
        raise RuntimeError(f"{where}: a work-group of {n} work-items (local_dims {local_dims}); the most it takes is "
                           f"{max_items}")
    for d, (n, most) in enumerate(zip(local_dims, max_sizes)):
        if n > most:
            raise RuntimeError(f"{where}: {n} work-items along dimension {d} (local_dims {local_dims}); the most is "
                               f"{most}")
    if local_mem_used > local_mem:
        raise RuntimeError(f"{where}: {local_mem_used} bytes of local memory per work-group; the device has "
                           f"{local_mem}")

# *** the device ***

class CLDevice(Compiled):
    """An OpenCL device with a context and an in-order, profiling queue of its own."""
    PROGRAMS_KEPT = 16   # loaded programs kept for the next kernels of their batch (a kernel holds its own)
    def __init__(self, device: str = "CL"):
        cl = _cl()
        devices = cl_devices()
        _, _, n = device.partition(":")
        if n and not n.isdigit(): raise ValueError(f"{device}: a CL device is numbered CL:0, CL:1, ...")
        idx = int(n or 0)
        if idx >= len(devices):
            found = ", ".join(f"{i}: {d.name}" for i, d in enumerate(devices))
            raise RuntimeError(f"{device} is OpenCL device {idx}, but there are {len(devices)} ({found}); PoCL lists "
                               "its CPU device twice with POCL_DEVICES='pthread pthread'")
        self.cl_device = devices[idx]
        self.context = cl.Context([self.cl_device])
        self.queue = cl.CommandQueue(self.context, self.cl_device,
                                     properties=cl.command_queue_properties.PROFILING_ENABLE)
        self._programs: dict[bytes, Any] = {}
        super().__init__(device, CLAllocator(self), None, None, functools.partial(CLProgram, self))

    def load(self, lib: bytes) -> Any:
        """The program of what this device's compiler made, built for this device (the kernels of one batch share
        it: loaded once)."""
        key = hashlib.sha256(lib).digest()
        if (prg := self._programs.pop(key, None)) is None:
            cl = _cl()
            if (unpacked := unpack(lib)) is None: raise ValueError("not a CL program binary")
            src, binary = unpacked
            prg = cl._cl._Program(self.context, [self.cl_device], [binary]) if binary else \
                cl._cl._Program(self.context, src)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", cl.CompilerWarning)
                prg.build(b"" if binary else self.compiler.options.encode(), [self.cl_device])
        self._programs[key] = prg   # (most recently used last)
        while len(self._programs) > self.PROGRAMS_KEPT: self._programs.pop(next(iter(self._programs)))
        return prg

    @functools.cached_property
    def renderer(self) -> Any:
        from fusegrad.renderer.opencl import OpenCLRenderer
        d = self.cl_device
        return OpenCLRenderer(has_fp64="cl_khr_fp64" in d.extensions.split() or bool(d.double_fp_config),
                              device_name=f"{self.device} ({d.name})", max_workgroup=int(d.max_work_group_size),
                              local_max=tuple(int(n) for n in d.max_work_item_sizes),
                              local_bytes=int(d.local_mem_size),
                              fast_local_memory=bool(d.type & _cl().device_type.GPU))

    @functools.cached_property
    def compiler(self) -> CLCompiler: return CLCompiler(self)

    @property
    def memory_size(self) -> int: return int(self.cl_device.global_mem_size)

    def synchronize(self) -> None: self.queue.finish()
