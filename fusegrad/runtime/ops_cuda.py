"""The CUDA device: NVIDIA GPUs through the CUDA driver API (`libcuda.so.1`, which comes with NVIDIA's driver) and
NVRTC (`pip install 'fusegrad[cuda]'`: the nvidia-cuda-nvrtc-cu12 wheel), both called with ctypes. Kernels are CUDA C
(renderer/cuda.py) compiled in process to a cubin for the GPU's compute capability (cached on disk, keyed by the
architecture and NVRTC's version), loaded as a module and launched on the context's default stream over `global_dims`
blocks of `local_dims` threads; a launch over the GPU's limits is refused before it is made. `CUDA` is the first GPU,
`CUDA:1` the second, and so on (each GPU its own context). It is never the default device by itself: `DEV=CUDA` (or
`CUDA=1`) picks it.

TinyJit replays a run of kernels of one GPU as one CUDA graph (CUDAGraph): built once, its nodes' buffer arguments
updated where a replay's differ, launched with one call. Copies between buffers of the device stay on the GPUs:
device to device on one GPU, peer to peer between two that can reach each other's memory, else through the host.

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
import struct
import threading
from typing import Any, Callable, NamedTuple
from fusegrad.device import Compiled, CompileError, Compiler, LRUAllocator, numbered
from fusegrad.helpers import DEBUG
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
                       "nvrtcGetPTXSize": [p, ctypes.POINTER(sz)], "nvrtcGetPTX": [p, ctypes.c_char_p],
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

    def compile(self, src: str) -> bytes: return self._nvrtc(src, self.options, "CUBIN")

    def ptx(self, src: str) -> str:
        """The PTX of `src` for the architecture's virtual one (compute_XY): the kernel as NVRTC's optimizer left it
        (which shared-memory loads are vectors, the barriers), before ptxas."""
        return self._nvrtc(src, [f"--gpu-architecture=compute_{self.arch[3:]}", *self.OPTIONS], "PTX") \
            .rstrip(b"\0").decode()

    def _nvrtc(self, src: str, options: list[str], output: str) -> bytes:
        """`src` compiled with `options`; NVRTC's output `output` (CUBIN or PTX)."""
        lib, prog = nvrtc(), ctypes.c_void_p()
        _nvrtc_check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernel.cu", 0, None, None),
                     "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                size = ctypes.c_size_t()
                _nvrtc_check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
                log = ctypes.create_string_buffer(size.value)
                _nvrtc_check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
                raise CompileError(compile_error(self.arch, log.value.decode(errors="replace"), src))
            size = ctypes.c_size_t()
            _nvrtc_check(getattr(lib, f"nvrtcGet{output}Size")(prog, ctypes.byref(size)), f"nvrtcGet{output}Size")
            out = ctypes.create_string_buffer(size.value)
            _nvrtc_check(getattr(lib, f"nvrtcGet{output}")(prog, out), f"nvrtcGet{output}")
            return out.raw
        finally: lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def validate(self, lib: bytes) -> bool: return lib.startswith(b"\x7fELF") and len(lib) > 64

def _elf(cubin: bytes) -> tuple[list[tuple], dict[str, tuple], list[tuple[str, int]]]:
    """A 64-bit little-endian ELF file's section headers (name offset, type, flags, address, offset, size, link, info,
    alignment, entry size), the same by section name, and its symbol table's entries (name, section index) in order."""
    if not cubin.startswith(b"\x7fELF") or len(cubin) < 64: return [], {}, []
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, strings = struct.unpack_from("<HHH", cubin, 0x3a)
    if count == 0: return [], {}, []
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    def name_at(table: int, at: int) -> str: return cubin[table + at:cubin.index(b"\0", table + at)].decode()
    by_name = {name_at(sections[strings][4], sec[0]): sec for sec in sections}
    symbols: list[tuple[str, int]] = []
    for sec in sections:
        if sec[1] != 2: continue   # (SHT_SYMTAB: its link is its string table)
        for at in range(sec[4], sec[4] + sec[5], 24):
            name, _, _, where = struct.unpack_from("<IBBH", cubin, at)
            symbols.append((name_at(sections[sec[6]][4], name), where))
    return sections, by_name, symbols

def dynamic_shared_bytes(cubin: bytes) -> int:
    """The bytes of dynamic shared memory a cubin's kernel takes: the value of its variable DYNAMIC_SHARED_SYMBOL
    (renderer/cuda.py; in the section of initialized globals, found through the ELF symbol table), 0 without it."""
    from fusegrad.renderer.cuda import DYNAMIC_SHARED_SYMBOL
    if DYNAMIC_SHARED_SYMBOL.encode() not in cubin: return 0
    sections, _, _ = _elf(cubin)
    for sec in sections:
        if sec[1] != 2: continue
        for at in range(sec[4], sec[4] + sec[5], 24):
            name, _, _, where, value, nbytes = struct.unpack_from("<IBBHQQ", cubin, at)
            if nbytes == 4 and cubin[sections[sec[6]][4] + name:].startswith(DYNAMIC_SHARED_SYMBOL.encode() + b"\0"):
                return struct.unpack_from("<I", cubin, sections[where][4] + value)[0]
    return 0

# attributes of a cubin's .nv.info sections (EIATTR_*): each is a format byte, an attribute byte and a value, entries
# 4-byte aligned; the format 4 (EIFMT_SVAL) is a 16-bit size and that many bytes, 3 (EIFMT_HVAL) and 2 (EIFMT_BVAL)
# 2 bytes (the value, and padding), 1 (EIFMT_NVAL) none but 2 bytes of padding (`01 35 00 00` in an sm_80 cubin)
_EIFMT_SVAL = 4
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2f, 0x11

class KernelResources(NamedTuple):
    """What ptxas gave a kernel of a cubin: 32-bit registers per thread, the bytes of its stack frame (local memory a
    thread takes: spilled registers and arrays it couldn't keep in registers; 0 in a kernel that spills nothing), and
    its machine instructions (static: the size of its code over the 16 bytes of an instruction from sm_70 on)."""
    registers: int
    frame_bytes: int
    instructions: int

def kernel_resources(cubin: bytes) -> dict[str, KernelResources]:
    """Each kernel of a cubin by name, with its registers, stack frame and instructions: the EIATTR_REGCOUNT and
    EIATTR_FRAME_SIZE attributes of the cubin's `.nv.info` sections (each value a function's symbol index and the
    number; what ptxas prints with -v as "Used N registers", kept in the cubin so a cached one tells it too), and the
    size of its `.text.<name>` section."""
    _, by_name, symbols = _elf(cubin)
    found: dict[str, dict[int, int]] = {}
    for name, sec in by_name.items():
        if not (name == ".nv.info" or name.startswith(".nv.info.")): continue
        data, at = cubin[sec[4]:sec[4] + sec[5]], 0
        while at + 2 <= len(data):
            fmt, attr = data[at], data[at + 1]
            if fmt == _EIFMT_SVAL:
                size, = struct.unpack_from("<H", data, at + 2)
                if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and size == 8:
                    symbol, value = struct.unpack_from("<II", data, at + 4)
                    found.setdefault(symbols[symbol][0], {})[attr] = value
                at += 4 + size
            else: at += 4
    return {k: KernelResources(v.get(_EIATTR_REGCOUNT, 0), v.get(_EIATTR_FRAME_SIZE, 0),
                               by_name[f".text.{k}"][5] // 16)
            for k, v in found.items() if f".text.{k}" in by_name}

# *** the driver API ***

# CUdevice_attribute and CUfunction_attribute values (cuda.h)
_ATTR = {"max_threads_per_block": 1, "max_block_dim_x": 2, "max_block_dim_y": 3, "max_block_dim_z": 4,
         "max_grid_dim_x": 5, "max_grid_dim_y": 6, "max_grid_dim_z": 7, "max_shared_memory_per_block": 8,
         "compute_capability_major": 75, "compute_capability_minor": 76, "reserved_shared_memory_per_block": 111,
         "max_shared_memory_per_block_optin": 97}
_FUNC_MAX_THREADS_PER_BLOCK, _FUNC_SHARED_SIZE_BYTES, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES = 0, 1, 8
CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NO_DEVICE, CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 2, 100, 704
CU_EVENT_DISABLE_TIMING = 2

class CUDA_KERNEL_NODE_PARAMS(ctypes.Structure):
    """cuda.h's CUDA_KERNEL_NODE_PARAMS_v2 (72 bytes on a 64-bit machine): the struct that describes a graph's kernel
    node to cuGraphAddKernelNode_v2 and cuGraphExecKernelNodeSetParams_v2 (CUDA 12 on). The first version, which the
    names without _v2 take (every driver since CUDA 10 exports them), is its first 56 bytes, so one struct serves both:
    `kern` and `ctx` stay NULL (the node runs `func`, in `func`'s context)."""
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]

_GRAPH_FUNCTIONS = ("cuGraphCreate", "cuGraphAddKernelNode", "cuGraphInstantiateWithFlags",
                    "cuGraphExecKernelNodeSetParams", "cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy")
# the functions whose current version is named _v2 (the names without it keep the first version's struct)
_GRAPH_V2 = ("cuGraphAddKernelNode", "cuGraphExecKernelNodeSetParams")

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
                 "cuMemcpyDtoDAsync_v2", "cuMemcpyPeerAsync", "cuDeviceCanAccessPeer", "cuCtxEnablePeerAccess",
                 "cuModuleLoadData", "cuModuleUnload", "cuModuleGetFunction", "cuFuncGetAttribute", "cuLaunchKernel",
                 "cuEventCreate", "cuEventRecord", "cuEventSynchronize", "cuEventElapsedTime", "cuEventDestroy_v2",
                 "cuStreamWaitEvent", "cuGetErrorName", "cuGetErrorString"):
        getattr(lib, name).restype = ctypes.c_int
    vp, u, u64, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64, ctypes.c_size_t
    # (every CUdeviceptr and size_t is declared: ctypes would pass a Python int as a 32-bit int)
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), sz]
    lib.cuMemFree_v2.argtypes = [u64]
    lib.cuMemcpyHtoD_v2.argtypes = [u64, vp, sz]
    lib.cuMemcpyDtoH_v2.argtypes = [vp, u64, sz]
    lib.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, sz, vp]
    lib.cuMemcpyPeerAsync.argtypes = [u64, vp, u64, vp, sz, vp]
    lib.cuDeviceCanAccessPeer.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuCtxEnablePeerAccess.argtypes = [vp, u]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
    lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp]
    lib.cuEventRecord.argtypes = [vp, vp]
    lib.cuStreamWaitEvent.argtypes = [vp, vp, u]
    # graphs (CUDA 11.4 on): a driver without them runs every launch on its own
    if all(hasattr(lib, name) for name in _GRAPH_FUNCTIONS):
        # (the _v2 function, where the driver has it, is called by the plain name: the struct fits both)
        for name in _GRAPH_V2:
            if hasattr(lib, f"{name}_v2"): setattr(lib, name, getattr(lib, f"{name}_v2"))
        for name in _GRAPH_FUNCTIONS: getattr(lib, name).restype = ctypes.c_int
        params = ctypes.POINTER(CUDA_KERNEL_NODE_PARAMS)
        lib.cuGraphCreate.argtypes = [ctypes.POINTER(vp), u]
        lib.cuGraphAddKernelNode.argtypes = [ctypes.POINTER(vp), vp, ctypes.POINTER(vp), sz, params]
        lib.cuGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_ulonglong]
        lib.cuGraphExecKernelNodeSetParams.argtypes = [vp, vp, params]
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphExecDestroy.argtypes = [vp]
        lib.cuGraphDestroy.argtypes = [vp]
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
        """Copy `nbytes` from device memory `src` to `dest`, queued on the GPUs' streams after the work before it: on
        one GPU device to device, between two that reach each other's memory peer to peer, else through the host."""
        if nbytes == 0: return
        dd, sd = dest.device, src.device
        if dd.context.value == sd.context.value:
            dd.activate()
            check(libcuda().cuMemcpyDtoDAsync_v2(dest.ptr, src.ptr, nbytes, None),
                  f"device copy of {nbytes} bytes on {dd.device}")
        elif dd.peer_access(sd): _peer_copy(dest, src, nbytes)
        else:
            # (synchronous: the read waits for the source's stream, the write is queued before later work on dest's)
            host = memoryview(bytearray(nbytes))
            self._copyout(host, src)
            self._copyin(dest, host)

def _peer_copy(dest: CUDAMemory, src: CUDAMemory, nbytes: int) -> None:
    """Copy between two GPUs, on the destination's stream: it waits for the work queued on the source's stream (which
    may write the source), and the source's later work waits for it (which may overwrite the source or reuse its
    memory). The host goes on at once."""
    lib, dd, sd = libcuda(), dest.device, src.device
    sd.activate()
    check(lib.cuEventRecord(sd.sync_event, None), f"cuEventRecord on {sd.device}")
    dd.activate()
    check(lib.cuStreamWaitEvent(None, sd.sync_event, 0), f"{dd.device} waiting for {sd.device}")
    check(lib.cuMemcpyPeerAsync(dest.ptr, dd.context, src.ptr, sd.context, nbytes, None),
          f"peer copy of {nbytes} bytes from {sd.device} to {dd.device}")
    check(lib.cuEventRecord(dd.sync_event, None), f"cuEventRecord on {dd.device}")
    sd.activate()
    check(lib.cuStreamWaitEvent(None, dd.sync_event, 0), f"{sd.device} waiting for {dd.device}")

# *** programs ***

def _arguments(bufs: tuple, vals: tuple, global_size: int) -> list[Any]:
    """A launch's parameters as C values: each buffer's address (0 for one given later), each Variable's value (a
    double for a float, a 64-bit int for an integer), then the range [0, global_size) of a kernel without ids."""
    args: list[Any] = [ctypes.c_uint64(b.ptr if b is not None else 0) for b in bufs]
    args += [ctypes.c_double(v) if type(v) is float else ctypes.c_int64(v) for v in vals]
    # (a GPU-style kernel has no such parameters: the driver reads as many as the kernel has and ignores these)
    return args + [ctypes.c_int64(0), ctypes.c_int64(global_size)]

def _pointers(args: list[Any]) -> Any:
    """The array of pointers to each parameter that the driver's kernelParams is."""
    return (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])

class CUDAProgram:
    """A kernel of a cubin. It runs on the device its first buffer is on: another GPU loads the cubin as a module of
    its own context on first use (where its architecture differs, the source compiled for it)."""
    def __init__(self, device: CUDADevice, name: str, lib: bytes):
        self.device, self.name, self.lib = device, name, lib
        # (bytes of dynamic shared memory each block of it takes: renderer/cuda.py `_shared_layout`)
        self.dynamic_shared = dynamic_shared_bytes(lib)
        # (its registers per thread, stack frame and instructions, as ptxas made it)
        self.resources = kernel_resources(lib).get(name)
        if DEBUG >= 2 and self.resources is not None:
            r = self.resources
            print(f"*** CUDA    {name}: {r.registers} registers, {r.frame_bytes} bytes of stack frame, "
                  f"{r.instructions} instructions")
        self._functions: dict[CUDADevice, tuple[ctypes.c_void_p, int, int]] = {}
        self._modules: list[tuple[CUDADevice, ctypes.c_void_p]] = []
        self._checked_groups: set[tuple[CUDADevice, tuple[int, ...]]] = set()   # (GPU, local dims) within its limits
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
            if self.dynamic_shared:
                lib.cuFuncSetAttribute.restype = ctypes.c_int
                lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                check(lib.cuFuncSetAttribute(fn, _FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.dynamic_shared),
                      f"letting {self.name} take {self.dynamic_shared} bytes of dynamic shared memory")
            f = self._functions[dev] = (fn, most.value, shared.value)
        return f

    def _geometry(self, dev: CUDADevice, global_size: int, global_dims: tuple[int, ...] | None,
                  local_dims: tuple[int, ...] | None) -> tuple[ctypes.c_void_p, tuple, tuple] | None:
        """(the function, the grid, the block) of a launch on `dev`; None for a launch of no threads. A launch over
        the GPU's or the kernel's limits is refused here (RuntimeError), before the driver sees it."""
        fn, most, shared = self._function(dev)
        if global_dims is None:
            if global_size <= 0: return None
            block = min(global_size, most, 128)
            return fn, (math.ceil(global_size / block), 1, 1), (block, 1, 1)
        gd, ld = launch_dims(self.name, global_dims, local_dims)
        # (a group is checked once per GPU: a prepared launch whose Variables change takes new grids, not new groups)
        if (dev, ld) not in self._checked_groups:
            check_group(self.name, f"{dev.device} ({dev.name})", ld,
                        max(shared - dev.reserved_shared, 0) + self.dynamic_shared,
                        max_items=min(most, dev.limits[0]), max_sizes=dev.limits[1], local_mem=dev.limits[3])
            self._checked_groups.add((dev, ld))
        for d, (n, top) in enumerate(zip(gd, dev.limits[2])):
            if n > top:
                raise RuntimeError(f"kernel {self.name} on {dev.device}: {n} blocks along dimension {d} "
                                   f"(global_dims {gd}); the most is {top}")
        if 0 in gd: return None
        return fn, tuple(gd) + (1,) * (3 - len(gd)), tuple(ld) + (1,) * (3 - len(ld))

    def __call__(self, *bufs: CUDAMemory, vals: tuple = (), global_size: int = 1, threads: int = 1, wait: bool = False,
                 join: bool = False, helpable: bool = True, global_dims: tuple[int, ...] | None = None,
                 local_dims: tuple[int, ...] | None = None) -> float | None:
        """Run the kernel: a GPU-style one (`global_dims` given) as global_dims[d] blocks of local_dims[d] threads
        along each dimension d (x, y, z), a CPU-style one as `global_size` threads (one per iteration of its parallel
        loop). With `wait`, wait for it and return the seconds it took on the GPU (between two events around it on
        the stream). `threads`, `join` and `helpable` are the CPU's and mean nothing here."""
        dev = bufs[0].device if bufs else self.device
        if (geometry := self._geometry(dev, global_size, global_dims, local_dims)) is None:
            return 0.0 if wait else None
        fn, grid, block = geometry
        args = _arguments(bufs, vals, global_size)
        params = _pointers(args)
        lib = libcuda()
        dev.activate()
        if wait:
            start, end = dev.timing_events
            check(lib.cuEventRecord(start, None), "cuEventRecord")
        # (the message is made only on failure: this runs for every kernel)
        if status := lib.cuLaunchKernel(fn, *grid, *block, self.dynamic_shared, None, params, None):
            check(status, f"launching {self.name} over {grid} blocks of {block} threads")
        if not wait: return None
        check(lib.cuEventRecord(end, None), "cuEventRecord")
        check(lib.cuEventSynchronize(end), f"waiting for {self.name}")
        ms = ctypes.c_float()
        check(lib.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return ms.value * 1e-3

    def prepare(self, *bufs: CUDAMemory | None, vals: tuple = (), global_size: int = 1, threads: int = 1,
                join: bool = False, helpable: bool = True, global_dims: tuple[int, ...] | None = None,
                local_dims: tuple[int, ...] | None = None, varying: tuple[int, ...] = ()) -> CUDALaunch:
        """The launch `self(*bufs, vals=..., ...)` as a function that repeats it with its arguments converted once (a
        TinyJit replay), taking the memory of the buffers at positions `varying` (None in `bufs`) per call."""
        return CUDALaunch(self, bufs, vals, global_size, global_dims, local_dims, varying)

    def __del__(self) -> None:
        try:
            for dev, module in self._modules:
                dev.activate()
                libcuda().cuModuleUnload(module)
        except Exception: pass   # (at interpreter shutdown the driver may be gone)

_EMPTY = object()   # (CUDALaunch.at: a launch of no threads, told apart from one not resolved yet)

class CUDALaunch:
    """A prepared launch (CUDAProgram.prepare): its parameters made once, its grid checked once per GPU. Called with
    the memory of the buffers at `varying`, it launches the kernel with those addresses. Where its other buffers say
    which GPU it runs on, consecutive ones of that GPU run as one CUDA graph: `graph` makes it (see CUDAGraph)."""
    def __init__(self, program: CUDAProgram, bufs: tuple[CUDAMemory | None, ...], vals: tuple, global_size: int,
                 global_dims: tuple[int, ...] | None, local_dims: tuple[int, ...] | None, varying: tuple[int, ...]):
        self.program, self.varying, self.global_size, self.nbufs = program, varying, global_size, len(bufs)
        self.global_dims, self.local_dims = global_dims, local_dims
        self.args = _arguments(bufs, vals, global_size)
        self.version = 0   # (counts set_values calls: a graph's node of this launch is updated when it moved on)
        self.params = _pointers(self.args)
        self._at_device: dict[CUDADevice, Any] = {}
        devices = {b.device for b in bufs if b is not None}
        if len(devices) > 1: raise ValueError(f"kernel {program.name} prepared over buffers of several GPUs")
        self.device = devices.pop() if devices else None
        if self.device is not None: self.at(self.device)   # (a launch over the GPU's limits is refused now)
        self.graph = self.device.launch_graph if self.device is not None and self.device.graphs else None

    def set_values(self, launch: dict[str, Any], work: tuple[int, int] | None = None) -> None:
        """Take other values of the kernel's Variables and the grid they give (CompiledRunner.launch_args) for the
        calls from now on; a grid over the GPU's limits is refused here. `work` means nothing here."""
        values = _arguments((), launch["vals"], launch["global_size"])
        for arg, new in zip(self.args[self.nbufs:], values): arg.value = new.value
        self.global_size, self.global_dims = launch["global_size"], launch.get("global_dims")
        self._at_device.clear()
        if self.device is not None: self.at(self.device)
        self.version += 1

    def at(self, dev: CUDADevice) -> tuple[ctypes.c_void_p, tuple, tuple] | None:
        """(function, grid, block) of this launch on `dev`, None for a launch of no threads."""
        if (geometry := self._at_device.get(dev)) is None:
            made = self.program._geometry(dev, self.global_size, self.global_dims, self.local_dims)
            geometry = self._at_device[dev] = _EMPTY if made is None else made
        return None if geometry is _EMPTY else geometry

    def __call__(self, *allocations: CUDAMemory) -> None:
        dev = self.device if self.device is not None else allocations[0].device
        if (geometry := self.at(dev)) is None: return
        for pos, a in zip(self.varying, allocations): self.args[pos].value = a.ptr
        fn, grid, block = geometry
        dev.activate()
        # (the driver copies the parameters' values at the launch: the next call may change them)
        if status := libcuda().cuLaunchKernel(fn, *grid, *block, self.program.dynamic_shared, None, self.params,
                                              None):
            check(status, f"launching {self.program.name} over {grid} blocks of {block} threads")

class CUDAGraph:
    """Consecutive prepared launches of one GPU as one CUDA graph: a kernel node per launch, each depending on the one
    before (the launches' order), instantiated on the first call. A call updates the nodes whose buffers' memory
    differs from the last call's (cuGraphExecKernelNodeSetParams) and launches the graph on the stream: one driver
    call for the whole run of kernels. `calls` pairs each launch with the index, per buffer it takes per call, of that
    buffer's memory in the list a call of the graph gets (the engine's launch-graph contract, see LaunchGraph); `work`
    (their ops and bytes moved) changes nothing here: the GPU runs any graph the same way."""
    def __init__(self, device: CUDADevice, calls: list[tuple[CUDALaunch, tuple[int, ...]]],
                 work: tuple[int, int] | None = None):
        if not calls: raise ValueError("a CUDAGraph needs at least one launch")
        if any(launch.device is not device for launch, _ in calls):
            raise ValueError(f"a CUDAGraph of {device.device} holds only launches of that GPU")
        self.device, self.calls = device, calls
        # the launches with Variables (set_values): their nodes are updated when their values or grid changed
        self.dynamic = [launch for launch, _ in calls if launch.version]
        self.node_versions: list[tuple[int, CUDALaunch, int]] = []   # (node, launch, its version in the node)
        self.graph: ctypes.c_void_p | None = None
        self.exec: ctypes.c_void_p | None = None   # (None where no launch has threads: nothing to run)
        self.built = False
        # per node: its handle, its CUDA_KERNEL_NODE_PARAMS, its parameters (the graph's own values)
        self.nodes: list[tuple[ctypes.c_void_p, CUDA_KERNEL_NODE_PARAMS, list[Any], Any]] = []
        # per index of a call's memory: (node, the parameter holding its address) of every use
        self.uses: list[list[tuple[int, Any]]] = []

    def _build(self, allocations: list[CUDAMemory]) -> None:
        lib, dev = libcuda(), self.device
        dev.activate()
        graph = ctypes.c_void_p()
        check(lib.cuGraphCreate(ctypes.byref(graph), 0), f"cuGraphCreate on {dev.device}")
        self.graph = graph
        self.uses = [[] for _ in allocations]
        try:
            before: Any = None
            for launch, indices in self.calls:
                if (geometry := launch.at(dev)) is None: continue   # (no threads: nothing to run)
                fn, grid, block = geometry
                args = [type(a)(a.value) for a in launch.args]
                for pos, idx in zip(launch.varying, indices):
                    args[pos].value = allocations[idx].ptr
                    self.uses[idx].append((len(self.nodes), args[pos]))
                params = _pointers(args)
                p = CUDA_KERNEL_NODE_PARAMS(fn.value, *grid, *block, launch.program.dynamic_shared,
                                            ctypes.cast(params, ctypes.c_void_p), None)
                node = ctypes.c_void_p()
                deps = (ctypes.c_void_p * 1)(before) if before is not None else None
                check(lib.cuGraphAddKernelNode(ctypes.byref(node), graph, deps, 1 if deps is not None else 0,
                                               ctypes.byref(p)),
                      f"adding kernel {launch.program.name} to a graph on {dev.device}")
                if launch in self.dynamic: self.node_versions.append((len(self.nodes), launch, launch.version))
                self.nodes.append((node, p, args, params))
                before = node.value
            if self.nodes:
                exe = ctypes.c_void_p()
                check(lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0),
                      f"instantiating a graph of {len(self.nodes)} kernels on {dev.device}")
                self.exec = exe
        except Exception:
            # (made again from the start by the next call)
            lib.cuGraphDestroy(graph)
            self.graph, self.nodes, self.uses, self.node_versions = None, [], [], []
            raise
        self.built = True

    def __call__(self, allocations: list[CUDAMemory]) -> None:
        lib = libcuda()
        if self.dynamic and any(launch.at(self.device) is None for launch in self.dynamic):
            # a launch with Variables has no threads with this call's values: a node can't be given an empty grid, so
            # this call's launches run one by one (on the same stream, in order) and the graph stays as it was
            for launch, indices in self.calls: launch(*[allocations[i] for i in indices])
            return
        if not self.built: self._build(allocations)
        else:
            changed: set[int] = set()
            for a, uses in zip(allocations, self.uses):
                for k, arg in uses:
                    if arg.value != a.ptr:
                        arg.value = a.ptr
                        changed.add(k)
            for n, (k, launch, version) in enumerate(self.node_versions):
                if launch.version == version: continue
                _, p, args, _ = self.nodes[k]
                for arg, new in zip(args[launch.nbufs:], launch.args[launch.nbufs:]): arg.value = new.value
                _, grid, block = launch.at(self.device)  # type: ignore[misc]
                p.gridDimX, p.gridDimY, p.gridDimZ = grid
                p.blockDimX, p.blockDimY, p.blockDimZ = block
                self.node_versions[n] = (k, launch, launch.version)
                changed.add(k)
            if changed: self.device.activate()
            for k in sorted(changed):
                node, p, _, _ = self.nodes[k]
                if status := lib.cuGraphExecKernelNodeSetParams(self.exec, node, ctypes.byref(p)):
                    check(status, f"updating the arguments of a graph's kernel on {self.device.device}")
        if not self.nodes: return
        self.device.activate()
        if status := lib.cuGraphLaunch(self.exec, None):
            check(status, f"launching a graph of {len(self.nodes)} kernels on {self.device.device}")

    def __del__(self) -> None:
        try:
            if self.exec is None and self.graph is None: return
            self.device.activate()
            if self.exec is not None: libcuda().cuGraphExecDestroy(self.exec)
            if self.graph is not None: libcuda().cuGraphDestroy(self.graph)
        except Exception: pass   # (at interpreter shutdown the driver may be gone)

# *** the device ***

def gpu_found() -> bool:
    """Whether this machine has a GPU the CUDA device can use (the default device then): NVIDIA's driver starts and
    counts one GPU or more, and NVRTC loads."""
    try:
        count = ctypes.c_int()
        if libcuda().cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0: return False
        nvrtc()
        return True
    except (RuntimeError, OSError): return False

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
        a = {k: self.attribute(k) for k in _ATTR if k not in ("reserved_shared_memory_per_block",
                                                              "max_shared_memory_per_block_optin")}
        # shared memory the driver keeps for itself in every block (sm_90 cubins count it in a kernel's static size)
        try: self.reserved_shared = self.attribute("reserved_shared_memory_per_block")
        except CUDAError: self.reserved_shared = 0   # (a driver older than CUDA 11 has no such attribute)
        self.arch = f"sm_{a['compute_capability_major']}{a['compute_capability_minor']}"
        # (threads per block, threads along x/y/z, blocks along x/y/z, static shared memory per block)
        # (threads per block, threads along x/y/z, blocks along x/y/z, shared memory per block: what a kernel may
        # ask for beyond the static 48 KiB, as dynamic shared memory, where the driver says so)
        try: shared = max(a["max_shared_memory_per_block"], self.attribute("max_shared_memory_per_block_optin"))
        except CUDAError: shared = a["max_shared_memory_per_block"]
        self.limits = (a["max_threads_per_block"], (a["max_block_dim_x"], a["max_block_dim_y"], a["max_block_dim_z"]),
                       (a["max_grid_dim_x"], a["max_grid_dim_y"], a["max_grid_dim_z"]), shared)
        self.graphs = all(hasattr(lib, f) for f in _GRAPH_FUNCTIONS)   # whether TinyJit replays through CUDA graphs
        self._peers: dict[int, bool] = {}   # GPU ordinal -> whether this context reads its memory directly
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

    def event(self, flags: int = 0) -> ctypes.c_void_p:
        """A new event of this GPU's context."""
        self.activate()
        ev = ctypes.c_void_p()
        check(libcuda().cuEventCreate(ctypes.byref(ev), flags), f"cuEventCreate on {self.device}")
        return ev

    @functools.cached_property
    def timing_events(self) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
        """The two events a timed launch is measured between (made once: DEBUG=2 and BEAM time every launch)."""
        return self.event(), self.event()

    @functools.cached_property
    def sync_event(self) -> ctypes.c_void_p:
        """The event another GPU's stream waits on to follow this one's (recorded again for each wait: a wait takes
        the record made before it)."""
        return self.event(CU_EVENT_DISABLE_TIMING)

    @functools.cached_property
    def launch_graph(self) -> Callable[..., CUDAGraph]:
        """What the engine calls to run consecutive prepared launches of this GPU as one graph (one object per GPU:
        launches of one GPU share it, so the engine groups no others with them)."""
        return functools.partial(CUDAGraph, self)

    def peer_access(self, other: CUDADevice) -> bool:
        """Whether this GPU's context reaches `other`'s memory directly: asked of the driver once, and enabled then."""
        if (ok := self._peers.get(other.cu_device.value)) is None:
            lib, can = libcuda(), ctypes.c_int()
            check(lib.cuDeviceCanAccessPeer(ctypes.byref(can), self.cu_device, other.cu_device),
                  f"cuDeviceCanAccessPeer({self.device}, {other.device})")
            ok = bool(can.value)
            if ok:
                self.activate()
                # (already enabled: by another library of this process, say)
                if (status := lib.cuCtxEnablePeerAccess(other.context, 0)) != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                    check(status, f"enabling {self.device}'s access to {other.device}'s memory")
            self._peers[other.cu_device.value] = ok
        return ok

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
