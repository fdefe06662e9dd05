"""The CUDA device: NVIDIA GPUs through the CUDA driver API (`libcuda.so.1`, which comes with NVIDIA's driver) and
NVRTC (`pip install 'fusegrad[cuda]'`: the nvidia-cuda-nvrtc-cu12 wheel), both called with ctypes. Kernels are CUDA C
(renderer/cuda.py) compiled in process to a cubin for the GPU's compute capability (cached on disk, keyed by the
architecture and NVRTC's version), loaded as a module and launched on the context's default stream over `global_dims`
blocks of `local_dims` threads; a launch over the GPU's limits is refused before it is made. `CUDA` is the first GPU,
`CUDA:1` the second, and so on. It is never the default device by itself: `DEV=CUDA` (or `CUDA=1`) picks it.

ctypes rather than a binding package: the driver API a framework needs is a couple of dozen C functions, and with
ctypes the device needs nothing but the driver and the NVRTC wheel."""
from __future__ import annotations
import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import math
import os
import re
import threading
from typing import Any
from fusegrad.device import Compiled, CompileError, Compiler, LRUAllocator, numbered
from fusegrad.runtime.ops_cl import check_group, launch_dims

MISSING_NVRTC = "pip install 'fusegrad[cuda]' (the nvidia-cuda-nvrtc-cu12 wheel)"
LIBCUDA = "libcuda.so.1"   # the driver API's library (the tests point this at a stand-in)

# *** NVRTC: CUDA C -> cubin ***

def _nvrtc_paths() -> list[str]:
    """Where libnvrtc may be: the `cuda` extra's wheel first (nvidia/cuda_nvrtc), then another NVIDIA wheel's (CUDA 13's
    are nvidia/cu13), then the system's (the loader's path, a CUDA toolkit in /usr/local/cuda)."""
    paths = []
    if (spec := importlib.util.find_spec("nvidia")) is not None:
        for root in spec.submodule_search_locations or []:
            paths += sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*")))
            paths += sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
    if found := ctypes.util.find_library("nvrtc"): paths.append(found)
    paths += ["libnvrtc.so.12", "libnvrtc.so", *sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))]
    return list(dict.fromkeys(p for p in paths if "builtins" not in p and ".alt." not in p))

@functools.cache
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library, its functions' types declared."""
    lib = None
    for path in _nvrtc_paths():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError: continue
    if lib is None: raise RuntimeError(f"the CUDA device needs NVRTC (libnvrtc.so.12), which isn't installed: "
                                       f"{MISSING_NVRTC}")
    p, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, args in {"nvrtcCreateProgram": [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p, i, p, p],
                       "nvrtcCompileProgram": [p, i, ctypes.POINTER(ctypes.c_char_p)],
                       "nvrtcGetProgramLogSize": [p, ctypes.POINTER(sz)], "nvrtcGetProgramLog": [p, ctypes.c_char_p],
                       "nvrtcGetCUBINSize": [p, ctypes.POINTER(sz)], "nvrtcGetCUBIN": [p, ctypes.c_char_p],
                       "nvrtcDestroyProgram": [ctypes.POINTER(p)], "nvrtcVersion": [ctypes.POINTER(i)] * 2}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes, lib.nvrtcGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p
    return lib

def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc_check(nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value

def _nvrtc_check(status: int, what: str) -> None:
    if status != 0: raise RuntimeError(f"NVRTC: {what} failed: {nvrtc().nvrtcGetErrorString(status).decode()}")

# a message in NVRTC's log: "<program name>(<line>): error: <message>"
_LOG_LINE = re.compile(r"^\S*\((\d+)\): (?:catastrophic )?error: (.*)$", re.MULTILINE)

def compile_error(arch: str, log: str, src: str) -> str:
    """The message of a failed compile: each error with the source line it points at, the log, the numbered source."""
    lines = src.splitlines()
    errors = [f"line {m.group(1)}: {m.group(2)}\n    {lines[int(m.group(1)) - 1].strip()}"
              for m in _LOG_LINE.finditer(log) if 0 < int(m.group(1)) <= len(lines)]
    head = "\n".join(errors) if errors else "(no error line in the log)"
    return f"NVRTC failed to compile for {arch}:\n{head}\n--- NVRTC log ---\n{log.strip()}\n" \
        f"--- source ---\n{numbered(src)}"

class CUDACompiler(Compiler):
    """CUDA C -> a cubin (the GPU's machine code, loaded as is: no PTX JIT at load) for architecture `arch` (sm_XY).
    The disk cache is keyed by the architecture and NVRTC's version. NVRTC compiles different programs in several
    threads at once, so new kernels are compiled in parallel."""
    parallel = True
    # IEEE floats: no contraction of a*b+c (fused multiply-adds are the kernel's explicit ones); division, square root
    # and denormals as IEEE says (NVRTC's defaults, stated so no configuration changes them)
    OPTIONS = ("--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false", "-std=c++17")

    def __init__(self, arch: str):
        if not re.fullmatch(r"sm_\d+[a-z]?", arch): raise ValueError(f"CUDA architecture {arch!r}: expected sm_XY")
        self.arch = arch
        self.options = [f"--gpu-architecture={arch}", *self.OPTIONS]
        super().__init__(f"CUDA|nvrtc {'.'.join(map(str, nvrtc_version()))}|{' '.join(self.options)}")

    def compile(self, src: str) -> bytes:
        lib, prog = nvrtc(), ctypes.c_void_p()
        _nvrtc_check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernel.cu", 0, None, None),
                     "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(self.options))(*[o.encode() for o in self.options])
            status = lib.nvrtcCompileProgram(prog, len(self.options), opts)
            if status != 0:
                size = ctypes.c_size_t()
                _nvrtc_check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
                log = ctypes.create_string_buffer(size.value)
                _nvrtc_check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
                raise CompileError(compile_error(self.arch, log.value.decode(errors="replace"), src))
            size = ctypes.c_size_t()
            _nvrtc_check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            _nvrtc_check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally: lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def validate(self, lib: bytes) -> bool: return lib.startswith(b"\x7fELF") and len(lib) > 64

# *** the driver API ***

# CUdevice_attribute and CUfunction_attribute values (cuda.h)
_ATTR = {"max_threads_per_block": 1, "max_block_dim_x": 2, "max_block_dim_y": 3, "max_block_dim_z": 4,
         "max_grid_dim_x": 5, "max_grid_dim_y": 6, "max_grid_dim_z": 7, "max_shared_memory_per_block": 8,
         "compute_capability_major": 75, "compute_capability_minor": 76, "reserved_shared_memory_per_block": 111}
_FUNC_MAX_THREADS_PER_BLOCK, _FUNC_SHARED_SIZE_BYTES = 0, 1
CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NO_DEVICE = 2, 100

class CUDAError(RuntimeError):
    """A driver API call failed; `status` is its CUresult."""
    def __init__(self, msg: str, status: int):
        super().__init__(msg)
        self.status = status

@functools.cache
def libcuda() -> ctypes.CDLL:
    """The driver API (libcuda.so.1, installed with NVIDIA's driver), initialized."""
    try: lib = ctypes.CDLL(LIBCUDA)
    except OSError as e:
        raise RuntimeError("the CUDA device needs NVIDIA's driver, whose libcuda.so.1 isn't on this machine (no GPU "
                           f"driver installed: {e})") from None
    for name in ("cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute", "cuDeviceGetName",
                 "cuDeviceTotalMem_v2", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuCtxSynchronize",
                 "cuMemAlloc_v2", "cuMemFree_v2", "cuMemGetInfo_v2", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
                 "cuMemcpyDtoD_v2", "cuModuleLoadData", "cuModuleUnload", "cuModuleGetFunction", "cuFuncGetAttribute",
                 "cuLaunchKernel", "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuEventElapsedTime",
                 "cuEventDestroy_v2", "cuGetErrorName", "cuGetErrorString"):
        getattr(lib, name).restype = ctypes.c_int
    vp, u = ctypes.c_void_p, ctypes.c_uint
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [vp, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuMemcpyDtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
    lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp]
    status = lib.cuInit(0)
    if status == CUDA_ERROR_NO_DEVICE:
        raise RuntimeError("the CUDA device found NVIDIA's driver (libcuda.so.1) but no GPU (cuInit: "
                           "CUDA_ERROR_NO_DEVICE)")
    check(status, "cuInit (starting NVIDIA's driver)")
    return lib

def check(status: int, what: str) -> None:
    """Raise CUDAError naming the call and the driver's error where `status` isn't CUDA_SUCCESS."""
    if status == 0: return
    name, desc = ctypes.c_char_p(), ctypes.c_char_p()
    lib = ctypes.CDLL(LIBCUDA)   # (loaded already: this is the same handle)
    lib.cuGetErrorName(status, ctypes.byref(name))
    lib.cuGetErrorString(status, ctypes.byref(desc))
    raise CUDAError(f"CUDA: {what} failed: {(name.value or b'error %d' % status).decode()}: "
                    f"{(desc.value or b'').decode()}", status)

# *** memory ***

class CUDAMemory:
    """A piece of device memory: its address (a CUdeviceptr) and the device that holds it."""
    __slots__ = ("ptr", "device")
    def __init__(self, ptr: int, device: CUDADevice): self.ptr, self.device = ptr, device

def _host_pointer(mv: memoryview) -> tuple[Any, int]:
    """(an object to keep alive, the address) of host memory `mv` (read-only memory is copied first)."""
    try: buf = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    except TypeError: buf = (ctypes.c_char * mv.nbytes).from_buffer_copy(mv)
    return buf, ctypes.addressof(buf)

class CUDAAllocator(LRUAllocator):
    """cuMemAlloc'd memory of the device. The copies are synchronous (they wait for the kernels before them on the
    stream, and the host memory may be gone or read right after they return)."""
    supports_views = True
    def __init__(self, device: CUDADevice):
        super().__init__()
        self.device = device

    def _alloc(self, size: int, options: Any) -> CUDAMemory:
        lib, dev, ptr = libcuda(), self.device, ctypes.c_uint64()
        dev.activate()
        # (the driver allocates nothing of 0 bytes)
        if (status := lib.cuMemAlloc_v2(ctypes.byref(ptr), max(size, 1))) == CUDA_ERROR_OUT_OF_MEMORY:
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            raise MemoryError(f"can't allocate {size} bytes on {dev.device} ({dev.name}): out of device memory, "
                              f"{free.value} of its {total.value} bytes free")
        check(status, f"cuMemAlloc of {size} bytes on {dev.device}")
        return CUDAMemory(ptr.value, dev)

    def _free(self, opaque: CUDAMemory, size: int, options: Any) -> None:
        opaque.device.activate()
        check(libcuda().cuMemFree_v2(opaque.ptr), f"cuMemFree on {opaque.device.device}")

    def _offset(self, opaque: CUDAMemory, size: int, offset: int) -> CUDAMemory:
        return CUDAMemory(opaque.ptr + offset, opaque.device)

    def _copyin(self, dest: CUDAMemory, src: memoryview) -> None:
        keep, addr = _host_pointer(src)
        dest.device.activate()
        check(libcuda().cuMemcpyHtoD_v2(dest.ptr, addr, src.nbytes),
              f"copy of {src.nbytes} bytes to {dest.device.device}")
        del keep

    def _copyout(self, dest: memoryview, src: CUDAMemory) -> None:
        keep, addr = _host_pointer(dest)
        src.device.activate()
        check(libcuda().cuMemcpyDtoH_v2(addr, src.ptr, dest.nbytes),
              f"copy of {dest.nbytes} bytes from {src.device.device}")
        del keep

    def _transfer(self, dest: CUDAMemory, src: CUDAMemory, nbytes: int) -> None:
        """Copy `nbytes` from device memory `src` to `dest` (on one GPU, or between two through unified addressing)."""
        dest.device.activate()
        check(libcuda().cuMemcpyDtoD_v2(dest.ptr, src.ptr, nbytes), f"device copy of {nbytes} bytes")

# *** programs ***

class CUDAProgram:
    """A kernel of a cubin. It runs on the device its first buffer is on: another GPU loads the cubin as a module of
    its own context on first use (where its architecture differs, the source compiled for it)."""
    def __init__(self, device: CUDADevice, name: str, lib: bytes):
        self.device, self.name, self.lib = device, name, lib
        self._functions: dict[CUDADevice, tuple[ctypes.c_void_p, int, int]] = {}
        self._modules: list[tuple[CUDADevice, ctypes.c_void_p]] = []
        self._function(device)   # (a cubin that doesn't load fails here, where the caller recompiles it)

    def _function(self, dev: CUDADevice) -> tuple[ctypes.c_void_p, int, int]:
        """(the CUfunction, the most threads per block it takes, its static shared memory in bytes) on `dev`."""
        if (f := self._functions.get(dev)) is None:
            if dev.compiler.cachekey != self.device.compiler.cachekey:
                raise RuntimeError(f"kernel {self.name} was compiled for {self.device.compiler.arch}; {dev.device} is "
                                   f"{dev.compiler.arch}")
            lib, module, fn = libcuda(), ctypes.c_void_p(), ctypes.c_void_p()
            dev.activate()
            check(lib.cuModuleLoadData(ctypes.byref(module), self.lib), f"loading the cubin of {self.name}")
            self._modules.append((dev, module))
            check(lib.cuModuleGetFunction(ctypes.byref(fn), module, self.name.encode()),
                  f"finding kernel {self.name} in its cubin")
            most, shared = ctypes.c_int(), ctypes.c_int()
            check(lib.cuFuncGetAttribute(ctypes.byref(most), _FUNC_MAX_THREADS_PER_BLOCK, fn), "cuFuncGetAttribute")
            check(lib.cuFuncGetAttribute(ctypes.byref(shared), _FUNC_SHARED_SIZE_BYTES, fn), "cuFuncGetAttribute")
            f = self._functions[dev] = (fn, most.value, shared.value)
        return f

    def __call__(self, *bufs: CUDAMemory, vals: tuple = (), global_size: int = 1, threads: int = 1, wait: bool = False,
                 join: bool = False, helpable: bool = True, global_dims: tuple[int, ...] | None = None,
                 local_dims: tuple[int, ...] | None = None) -> float | None:
        """Run the kernel: a GPU-style one (`global_dims` given) as global_dims[d] blocks of local_dims[d] threads
        along each dimension d (x, y, z), a CPU-style one as `global_size` threads (one per iteration of its parallel
        loop). With `wait`, wait for it and return the seconds it took on the GPU. `threads`, `join` and `helpable`
        are the CPU's and mean nothing here."""
        dev = bufs[0].device if bufs else self.device
        fn, most, shared = self._function(dev)
        args: list[Any] = [ctypes.c_uint64(b.ptr) for b in bufs]
        args += [ctypes.c_double(v) if type(v) is float else ctypes.c_int64(v) for v in vals]
        # a kernel without work-item ids takes the range of its parallel loop, [core_lo, core_hi): the whole loop. (A
        # GPU-style kernel has no such parameters: the driver reads as many as the kernel has and ignores these)
        args += [ctypes.c_int64(0), ctypes.c_int64(global_size)]
        if global_dims is None:
            block = min(global_size, most, 128)
            grid, block_dims = (math.ceil(global_size / max(block, 1)), 1, 1), (block, 1, 1)
            if global_size <= 0: return 0.0 if wait else None
        else:
            gd, ld = launch_dims(self.name, global_dims, local_dims)
            check_group(self.name, f"{dev.device} ({dev.name})", ld, max(shared - dev.reserved_shared, 0),
                        max_items=min(most, dev.limits[0]),
                        max_sizes=dev.limits[1], local_mem=dev.limits[3])
            for d, (n, top) in enumerate(zip(gd, dev.limits[2])):
                if n > top:
                    raise RuntimeError(f"kernel {self.name} on {dev.device}: {n} blocks along dimension {d} "
                                       f"(global_dims {gd}); the most is {top}")
            if 0 in gd: return 0.0 if wait else None
            grid, block_dims = tuple(gd) + (1,) * (3 - len(gd)), tuple(ld) + (1,) * (3 - len(ld))
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        lib = libcuda()
        dev.activate()
        if wait: start, end = dev.event(), dev.event()
        if wait: check(lib.cuEventRecord(start, None), "cuEventRecord")
        check(lib.cuLaunchKernel(fn, *grid, *block_dims, 0, None, params, None),
              f"launching {self.name} over {grid} blocks of {block_dims} threads")
        if not wait: return None
        check(lib.cuEventRecord(end, None), "cuEventRecord")
        check(lib.cuEventSynchronize(end), f"waiting for {self.name}")
        ms = ctypes.c_float()
        check(lib.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        lib.cuEventDestroy_v2(start)
        lib.cuEventDestroy_v2(end)
        return ms.value * 1e-3

    def __del__(self) -> None:
        try:
            for dev, module in self._modules:
                dev.activate()
                libcuda().cuModuleUnload(module)
        except Exception: pass   # (at interpreter shutdown the driver may be gone)

# *** the device ***

_current = threading.local()   # .ctx: the context current in this thread (as set by CUDADevice.activate)

class CUDADevice(Compiled):
    """One NVIDIA GPU: its primary context, its memory, the compiler for its architecture."""
    def __init__(self, device: str = "CUDA"):
        _, _, n = device.partition(":")
        if n and not n.isdigit(): raise ValueError(f"{device}: a CUDA device is numbered CUDA:0, CUDA:1, ...")
        lib, idx, count = libcuda(), int(n or 0), ctypes.c_int()
        check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if count.value == 0: raise RuntimeError("the CUDA device found NVIDIA's driver but no GPU")
        if idx >= count.value: raise RuntimeError(f"{device} is GPU {idx}, but there are {count.value}")
        self.cu_device, self.context = ctypes.c_int(), ctypes.c_void_p()
        check(lib.cuDeviceGet(ctypes.byref(self.cu_device), idx), f"cuDeviceGet({idx})")
        name = ctypes.create_string_buffer(256)
        check(lib.cuDeviceGetName(name, 256, self.cu_device), "cuDeviceGetName")
        self.name = name.value.decode()
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), self.cu_device),
              f"creating a context on {device}")
        a = {k: self.attribute(k) for k in _ATTR if k != "reserved_shared_memory_per_block"}
        # shared memory the driver keeps for itself in every block (sm_90 cubins count it in a kernel's static size)
        try: self.reserved_shared = self.attribute("reserved_shared_memory_per_block")
        except CUDAError: self.reserved_shared = 0   # (a driver older than CUDA 11 has no such attribute)
        self.arch = f"sm_{a['compute_capability_major']}{a['compute_capability_minor']}"
        # (threads per block, threads along x/y/z, blocks along x/y/z, static shared memory per block)
        self.limits = (a["max_threads_per_block"], (a["max_block_dim_x"], a["max_block_dim_y"], a["max_block_dim_z"]),
                       (a["max_grid_dim_x"], a["max_grid_dim_y"], a["max_grid_dim_z"]),
                       a["max_shared_memory_per_block"])
        super().__init__(device, CUDAAllocator(self), None, None, functools.partial(CUDAProgram, self))

    def attribute(self, name: str) -> int:
        v = ctypes.c_int()
        check(libcuda().cuDeviceGetAttribute(ctypes.byref(v), _ATTR[name], self.cu_device), f"the GPU's {name}")
        return v.value

    def activate(self) -> None:
        """Make this GPU's context current in the calling thread (each thread has its own current context)."""
        if getattr(_current, "ctx", None) != self.context.value:
            check(libcuda().cuCtxSetCurrent(self.context), f"making {self.device}'s context current")
            _current.ctx = self.context.value

    def event(self) -> ctypes.c_void_p:
        ev = ctypes.c_void_p()
        check(libcuda().cuEventCreate(ctypes.byref(ev), 0), "cuEventCreate")
        return ev

    @functools.cached_property
    def renderer(self) -> Any:
        from fusegrad.renderer.cuda import CUDARenderer
        threads, sizes, grid, shared = self.limits
        return CUDARenderer(self.arch, max_workgroup=threads, local_max=sizes, global_max=grid, local_bytes=shared)

    @functools.cached_property
    def compiler(self) -> CUDACompiler: return CUDACompiler(self.arch)

    @property
    def memory_size(self) -> int:
        total = ctypes.c_size_t()
        check(libcuda().cuDeviceTotalMem_v2(ctypes.byref(total), self.cu_device), "cuDeviceTotalMem")
        return total.value

    def synchronize(self) -> None:
        self.activate()
        check(libcuda().cuCtxSynchronize(), f"waiting for {self.device}")
