"""The CUDA device without a GPU: the errors where there is no driver or no GPU, NVRTC's cubins and compile errors,
and the runtime against a stand-in driver (fake_libcuda.c, built here with the C compiler: memory in host memory,
launches recorded, not run): memory copies and views, out-of-memory, what a launch passes to the driver (grid, block,
parameters, timing), and the launches refused before they reach the driver."""
from __future__ import annotations
import ctypes
import json
import os
import struct
import subprocess
import sys
import pytest
from fusegrad.device import CompileError
from fusegrad.helpers import Context
from fusegrad.runtime import ops_cuda
from fusegrad.runtime.ops_cuda import CUDACompiler, CUDADevice, CUDAError, CUDAProgram

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

def _has_driver() -> bool:
    try: ctypes.CDLL("libcuda.so.1")
    except OSError: return False
    return True

# *** without a driver ***

def test_no_driver_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(ops_cuda, "LIBCUDA", "libcuda-not-here.so.1")
    ops_cuda.libcuda.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"needs NVIDIA's driver, whose libcuda\.so\.1 isn't on this machine"):
            CUDADevice("CUDA")
    finally: ops_cuda.libcuda.cache_clear()

def test_dev_cuda_without_driver():
    """DEV=CUDA in a fresh process: on a machine without NVIDIA's driver the first tensor raises the clear error (with
    the driver, it computes)."""
    code = "from fusegrad import Tensor; print((Tensor([1.0, 2.0]) + 1).tolist())"
    env = {**os.environ, "DEV": "CUDA"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if _has_driver(): assert r.stdout.strip() == "[2.0, 3.0]", r.stderr
    else:
        assert r.returncode != 0
        assert "RuntimeError: the CUDA device needs NVIDIA's driver, whose libcuda.so.1 isn't on this machine" \
            in r.stderr, r.stderr

def test_not_the_default_device():
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "CUDA")}
    r = subprocess.run([sys.executable, "-c", "from fusegrad import Device; print(Device.DEFAULT)"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() != "CUDA", r.stderr

# *** NVRTC ***

def _sm(cubin: bytes) -> int:
    """The architecture a cubin is for: the low byte of its ELF header's e_flags (90 for sm_90)."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2   # (64-bit ELF)
    return struct.unpack_from("<I", cubin, 48)[0] & 0xff

KERNEL = """extern "C" __global__ void __launch_bounds__(64) scale(float* __restrict__ out, const float* __restrict__ a,
                                                             double s) {
  __shared__ float tile[64];
  tile[threadIdx.x] = a[blockIdx.x * 64 + threadIdx.x];
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = tile[63 - threadIdx.x] * (float)s;
}
"""

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_makes_a_cubin_for_the_architecture(arch):
    cubin = CUDACompiler(arch).compile(KERNEL)
    assert _sm(cubin) == int(arch[3:])
    assert b"scale" in cubin and CUDACompiler(arch).validate(cubin)

def test_cache_is_keyed_by_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c80, c90 = CUDACompiler("sm_80"), CUDACompiler("sm_90")
    assert c80.cachekey != c90.cachekey and "sm_80" in c80.cachekey
    assert c80.cache_path(KERNEL) != c90.cache_path(KERNEL)
    with Context(CACHELEVEL=2):
        assert _sm(c80.compile_cached(KERNEL)) == 80 and _sm(c90.compile_cached(KERNEL)) == 90
        # a second compiler of the same architecture reads the binary back (from disk: its memory cache is empty)
        again = CUDACompiler("sm_90")
        assert _sm(again.compile_cached(KERNEL)) == 90 and again.compiles == 0 and again.disk_hits == 1

def test_compile_error_names_the_line_and_the_log():
    src = KERNEL.replace("(float)s;", "(float)s + undefined_thing;")
    with pytest.raises(CompileError) as e: CUDACompiler("sm_80").compile(src)
    msg = str(e.value)
    line = next(i for i, t in enumerate(src.splitlines(), 1) if "undefined_thing" in t)
    assert f"line {line}: identifier \"undefined_thing\" is undefined" in msg, msg
    assert "--- NVRTC log ---" in msg and "kernel.cu(" in msg and "sm_80" in msg

def test_bad_architecture_is_refused():
    with pytest.raises(ValueError, match="expected sm_XY"): CUDACompiler("compute_90a; rm")

# *** the runtime, against the stand-in driver ***

@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("fakecuda") / "libcuda.so.1")
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", out, os.path.join(HERE, "fake_libcuda.c")], check=True)
    return out

@pytest.fixture
def fake(fake_lib, monkeypatch):
    """The stand-in driver, reset: one GPU with 1 MiB of memory, kernels of no static shared memory."""
    monkeypatch.setattr(ops_cuda, "LIBCUDA", fake_lib)
    ops_cuda.libcuda.cache_clear()
    lib = ctypes.CDLL(fake_lib)
    lib.fake_set(0, ctypes.c_size_t(1 << 20), 0)
    lib.fake_mem_used.restype = ctypes.c_size_t
    yield lib
    ops_cuda.libcuda.cache_clear()

def test_no_gpu_found(fake):
    fake.fake_set(1, ctypes.c_size_t(1 << 20), 0)
    with pytest.raises(RuntimeError, match="found NVIDIA's driver .* but no GPU"): CUDADevice("CUDA")

def test_device_facts(fake):
    dev = CUDADevice("CUDA")
    assert dev.name == "Fake GPU" and dev.arch == "sm_90" and dev.memory_size == 1 << 20
    ren = dev.renderer
    assert (ren.max_workgroup, ren.local_max, ren.global_max, ren.local_bytes) == \
        (1024, (1024, 1024, 64), (2 ** 31 - 1, 65535, 65535), 49152)
    assert dev.compiler.arch == "sm_90"
    with pytest.raises(RuntimeError, match="CUDA:1 is GPU 1, but there are 1"): CUDADevice("CUDA:1")
    with pytest.raises(ValueError, match="numbered"): CUDADevice("CUDA:x")

def test_memory_copies_and_views(fake):
    dev = CUDADevice("CUDA")
    alloc = dev.allocator
    a, b = alloc.alloc(64), alloc.alloc(64)
    assert fake.fake_mem_used() == 128
    data = bytes(range(64))
    alloc._copyin(a, memoryview(data))   # (read-only host memory)
    out = bytearray(64)
    alloc._copyout(memoryview(out), a)
    assert bytes(out) == data
    view = alloc._offset(a, 16, 40)
    part = bytearray(16)
    alloc._copyout(memoryview(part), view)
    assert bytes(part) == data[40:56]
    alloc._transfer(b, a, 64)
    alloc._copyout(memoryview(out), b)
    assert bytes(out) == data
    alloc._free(a, 64, None)
    alloc._free(b, 64, None)
    assert fake.fake_mem_used() == 0

def test_out_of_memory_names_the_size(fake):
    alloc = CUDADevice("CUDA").allocator
    keep = alloc.alloc(600_000)
    with pytest.raises(MemoryError, match=r"can't allocate 700000 bytes on CUDA \(Fake GPU\): out of device memory, "
                                          r"448576 of its 1048576 bytes free"):
        alloc.alloc(700_000)
    alloc.free_cache()
    alloc._free(keep, 600_000, None)

def _last_launch(fake, n: int) -> tuple[list[int], list[int], list[int]]:
    grid, block = (ctypes.c_uint * 3).in_dll(fake, "last_grid"), (ctypes.c_uint * 3).in_dll(fake, "last_block")
    params = (ctypes.c_uint64 * 16).in_dll(fake, "last_params")
    return list(grid), list(block), list(params)[:n]

def _launches(fake) -> int: return ctypes.c_int.in_dll(fake, "launches").value

ELF = b"\x7fELF" + bytes(60)   # (the stand-in loads any ELF image)

def test_gpu_style_launch(fake):
    dev = CUDADevice("CUDA")
    a, b = dev.allocator.alloc(256), dev.allocator.alloc(256)
    fake.fake_record(4)
    prg = CUDAProgram(dev, "kern", ELF)
    secs = prg(a, b, vals=(7, 2.5), global_dims=(3, 2), local_dims=(32, 4), wait=True)
    assert secs == pytest.approx(1.5e-3)
    grid, block, params = _last_launch(fake, 4)
    assert grid == [3, 2, 1] and block == [32, 4, 1]
    assert params == [a.ptr, b.ptr, 7, struct.unpack("<Q", struct.pack("<d", 2.5))[0]]
    assert prg(a, b, vals=(-1, 0.0), global_dims=(5,), local_dims=(64,)) is None
    assert _last_launch(fake, 4)[:2] == ([5, 1, 1], [64, 1, 1]) and _last_launch(fake, 4)[2][2] == 2 ** 64 - 1

def test_cpu_style_launch(fake):
    """A kernel without work-item ids: one thread per iteration of its loop, [core_lo, core_hi) = [0, global_size)."""
    dev = CUDADevice("CUDA")
    a = dev.allocator.alloc(4)
    fake.fake_record(3)
    CUDAProgram(dev, "loop", ELF)(a, global_size=300)
    assert _last_launch(fake, 3) == ([3, 1, 1], [128, 1, 1], [a.ptr, 0, 300])
    CUDAProgram(dev, "loop", ELF)(a, global_size=5)
    assert _last_launch(fake, 3) == ([1, 1, 1], [5, 1, 1], [a.ptr, 0, 5])
    # one without ids or a parallel loop, which the engine launches as one group of one: it gets its [0, 1) too
    CUDAProgram(dev, "once", ELF)(a, global_size=1, global_dims=(1,), local_dims=(1,))
    assert _last_launch(fake, 3) == ([1, 1, 1], [1, 1, 1], [a.ptr, 0, 1])

@pytest.mark.parametrize("global_dims,local_dims,shared,match", [
    ((1,), (2048,), 0, "a work-group of 2048 work-items"),
    ((1, 1, 1), (1, 1, 128), 0, "128 work-items along dimension 2"),
    ((1, 70000), (32, 1), 0, "70000 blocks along dimension 1 .* the most is 65535"),
    # (a kernel's static shared memory as an sm_90 cubin counts it: with the 1 KiB the driver reserves)
    ((4,), (64,), 64 * 1024 + 1024, "65536 bytes of local memory per work-group; the device has 49152"),
    ((4, 4), (64,), 0, "same length"),
])
def test_launch_over_the_limits_is_refused(fake, global_dims, local_dims, shared, match):
    fake.fake_set(0, ctypes.c_size_t(1 << 20), shared)
    dev = CUDADevice("CUDA")
    prg = CUDAProgram(dev, "big", ELF)
    before = _launches(fake)
    with pytest.raises((RuntimeError, ValueError), match=match):
        prg(dev.allocator.alloc(4), global_dims=global_dims, local_dims=local_dims)
    assert _launches(fake) == before   # refused before the driver saw it

def test_all_the_shared_memory_of_a_block(fake):
    fake.fake_set(0, ctypes.c_size_t(1 << 20), 48 * 1024 + 1024)
    dev = CUDADevice("CUDA")
    fake.fake_record(1)
    CUDAProgram(dev, "most", ELF)(dev.allocator.alloc(4), global_dims=(2,), local_dims=(1024,))
    assert _last_launch(fake, 1)[:2] == ([2, 1, 1], [1024, 1, 1])

def test_load_errors(fake):
    dev = CUDADevice("CUDA")
    with pytest.raises(CUDAError, match="loading the cubin of k failed: CUDA_ERROR_INVALID_IMAGE"):
        CUDAProgram(dev, "k", b"not a cubin")
    with pytest.raises(CUDAError, match="finding kernel missing_k in its cubin failed: CUDA_ERROR_NOT_FOUND"):
        CUDAProgram(dev, "missing_k", ELF)

STAND_IN_RUN = """
import ctypes, json, sys
import numpy as np
from fusegrad.runtime import ops_cuda
ops_cuda.LIBCUDA = sys.argv[1]
fake = ctypes.CDLL(sys.argv[1])
fake.fake_set(0, ctypes.c_size_t(1 << 24), 0)
from fusegrad import Device, Tensor
from fusegrad.engine.realize import CompiledRunner
x = np.arange(1000, dtype=np.float32)
t = Tensor(x, device="CUDA")
assert (t.numpy() == x).all()   # a copy there and back
out = (t * 2).sum()
sched = out.schedule()
progs = []
for ei in sched:
    ei = ei.lower()
    ei.run({})
    if isinstance(ei.prg, CompiledRunner): progs.append(ei.prg.p)
grid, block = list((ctypes.c_uint * 3).in_dll(fake, "last_grid")), list((ctypes.c_uint * 3).in_dll(fake, "last_block"))
p = progs[-1]
launches = ctypes.c_int.in_dll(fake, "launches").value
print(json.dumps([Device["CUDA"].compiler.arch, list(p.global_dims), list(p.local_dims), grid, block, launches]))
"""

def test_tensors_through_the_stand_in_driver(fake_lib):
    """A fresh process with DEV=CUDA against the stand-in: data goes there and back, a reduction is compiled by NVRTC
    for the GPU's architecture (sm_90), its cubin loaded, and launched over the ProgramSpec's grid."""
    r = subprocess.run([sys.executable, "-c", STAND_IN_RUN, fake_lib], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CACHELEVEL": "0"})
    assert r.returncode == 0, r.stderr
    arch, gd, ld, grid, block, launches = json.loads(r.stdout)
    assert arch == "sm_90"
    assert list(gd) + [1] * (3 - len(gd)) == grid and list(ld) + [1] * (3 - len(ld)) == block and launches >= 1
