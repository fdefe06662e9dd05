"""The CUDA device without a GPU: the errors where there is no driver or no GPU, NVRTC's cubins and compile errors,
and the runtime against a stand-in driver (fake_libcuda.c, built here with the C compiler: memory in host memory,
launches recorded, not run): memory copies and views, out-of-memory, what a launch passes to the driver (grid, block,
parameters, timing), the launches refused before they reach the driver, prepared launches and CUDA graphs (TinyJit's
replays), copies on one GPU and between two (peer to peer, or through the host), and sharding over two GPUs."""
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

def test_default_device_is_cuda_only_with_a_gpu():
    """No DEV: a fresh process picks CUDA where NVIDIA's driver runs a GPU (and NVRTC loads), the host device else."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "CUDA")}
    code = ("from fusegrad import Device; from fusegrad.runtime.ops_cuda import gpu_found; "
            "print(Device.DEFAULT, gpu_found())")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    default, found = r.stdout.split()
    assert found == str(_has_driver() and _counts_gpu()), r.stdout
    assert (default == "CUDA") == (found == "True"), r.stdout

def _counts_gpu() -> bool:
    """Whether the machine's driver counts a GPU (asked with ctypes here, independently of the device's code)."""
    lib, count = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0

# *** NVRTC ***

def _sm(cubin: bytes) -> int:
    """The architecture a cubin is for (90 for sm_90), from its ELF header's e_flags: in the low byte where the ELF
    ABI version (e_ident[8]) is 7, as NVRTC 12 and before write it; in the second byte in CUDA 13's newer layout."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2   # (64-bit ELF)
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return flags & 0xff if cubin[8] == 7 else (flags >> 8) & 0xff

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
    lib.fake_log.restype = lib.fake_exec_function.restype = ctypes.c_char_p
    lib.fake_exec_param.restype = ctypes.c_uint64
    lib.fake_exec_dim.restype = ctypes.c_uint
    lib.fake_node_params_size.restype = lib.fake_node_params_offset.restype = ctypes.c_size_t
    yield lib
    ops_cuda.libcuda.cache_clear()

def test_no_gpu_found(fake):
    fake.fake_set(1, ctypes.c_size_t(1 << 20), 0)
    with pytest.raises(RuntimeError, match="found NVIDIA's driver .* but no GPU"): CUDADevice("CUDA")

def test_default_device_follows_the_gpu(fake):
    """Without DEV, the default is CUDA when the driver counts a GPU, the host device when it counts none."""
    from fusegrad.device import Device
    with pytest.MonkeyPatch.context() as mp:
        for k in ("DEV", "CUDA"): mp.delenv(k, raising=False)
        assert Device._from_env() == "CUDA" and ops_cuda.gpu_found()
        fake.fake_set(1, ctypes.c_size_t(1 << 20), 0)
        ops_cuda.libcuda.cache_clear()
        assert not ops_cuda.gpu_found() and Device._from_env() != "CUDA"

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

# *** prepared launches and graphs ***

def _count(fake, name: str) -> int: return ctypes.c_int.in_dll(fake, name).value

def _calls(fake) -> list[str]:
    """The stand-in's call log since it was last cleared: "function@GPU" each."""
    return fake.fake_log().decode().split()

def _f64(x: float) -> int: return struct.unpack("<Q", struct.pack("<d", x))[0]

def test_kernel_node_params_layout(fake):
    """The struct a graph's kernel node is described by: the stand-in's C declarations (cuda.h's two versions, as the
    C compiler lays them out) against the runtime's ctypes one, whose first bytes are the first version."""
    P = ops_cuda.CUDA_KERNEL_NODE_PARAMS
    assert ctypes.sizeof(P) == fake.fake_node_params_size(2) == 72
    assert P.kern.offset == fake.fake_node_params_size(1) == 56
    for i, field in [(0, "func"), (1, "gridDimX"), (6, "blockDimZ"), (7, "sharedMemBytes"), (8, "kernelParams"),
                     (9, "extra"), (10, "kern"), (11, "ctx")]:
        assert getattr(P, field).offset == fake.fake_node_params_offset(i), field

def test_prepared_launch(fake):
    """A launch prepared once: the buffers given per call take their places among the parameters; the grid is the
    plain launch's."""
    dev = CUDADevice("CUDA")
    a, b, c = (dev.allocator.alloc(64) for _ in range(3))
    fake.fake_params(b"kern", 5, 2)   # (out, in, a Variable, core_lo, core_hi)
    launch = CUDAProgram(dev, "kern", ELF).prepare(a, None, vals=(3,), global_size=300, varying=(1,))
    assert launch.graph is dev.launch_graph
    before = _launches(fake)
    launch(b)
    assert _last_launch(fake, 5) == ([3, 1, 1], [128, 1, 1], [a.ptr, b.ptr, 3, 0, 300])
    launch(c)
    assert _last_launch(fake, 5)[2] == [a.ptr, c.ptr, 3, 0, 300] and _launches(fake) == before + 2
    # every buffer given per call (a replayed schedule): the GPU is the buffers'; no graph, the GPU isn't known before
    launch = CUDAProgram(dev, "kern", ELF).prepare(None, None, vals=(-2,), global_dims=(2, 3), local_dims=(16, 2),
                                                   varying=(0, 1))
    assert launch.graph is None
    launch(c, a)
    assert _last_launch(fake, 5) == ([2, 3, 1], [16, 2, 1], [c.ptr, a.ptr, 2 ** 64 - 2, 0, 1])
    # no threads: nothing launched
    CUDAProgram(dev, "kern", ELF).prepare(a, None, global_dims=(0,), local_dims=(4,), varying=(1,))(b)
    assert _launches(fake) == before + 3

def test_prepared_launch_over_the_limits_is_refused(fake):
    dev = CUDADevice("CUDA")
    with pytest.raises(RuntimeError, match="70000 blocks along dimension 1"):
        CUDAProgram(dev, "big", ELF).prepare(dev.allocator.alloc(4), global_dims=(1, 70000), local_dims=(32, 1))

def _exec_node(fake, e: int, k: int, n: int) -> tuple[str, list[int], list[int], int]:
    """(function, grid + block + shared memory, the first n parameters, the node it depends on) of node k."""
    return (fake.fake_exec_function(e, k).decode(), [fake.fake_exec_dim(e, k, i) for i in range(7)],
            [fake.fake_exec_param(e, k, i) for i in range(n)], fake.fake_exec_dependency(e, k))

def test_graph_of_launches(fake):
    """Launches of one GPU as a CUDA graph: built on the first call (a node per launch, each after the one before),
    launched with one cuGraphLaunch per call; a call whose buffers differ updates just the nodes that take them."""
    dev = CUDADevice("CUDA")
    x, y, w, out, x2, out2 = (dev.allocator.alloc(256) for _ in range(6))
    fake.fake_params(b"k1", 4, 2)
    fake.fake_params(b"k2", 6, 3)
    # w = k1(x); out = k2(w, y): x, out and y come per call (indices 0, 1, 2 of the graph's list)
    k1 = CUDAProgram(dev, "k1", ELF).prepare(w, None, global_dims=(4,), local_dims=(32,), varying=(1,))
    k2 = CUDAProgram(dev, "k2", ELF).prepare(None, w, None, vals=(2.5,), global_size=1000, varying=(0, 2))
    assert k1.graph is k2.graph is dev.launch_graph
    graph = k1.graph([(k1, (0,)), (k2, (1, 2))], (0, 0))
    fake.fake_log_clear()
    kernels = _launches(fake)
    graph([x, out, y])
    # (the second versions of the node functions, where the driver has them: CUDA 12's)
    assert _calls(fake) == ["cuGraphCreate@0", "v2@0", "cuGraphAddKernelNode@0", "v2@0", "cuGraphAddKernelNode@0",
                            "cuGraphInstantiateWithFlags@0", "cuGraphLaunch@0"]
    assert fake.fake_execs() == 1 and fake.fake_exec_nodes(0) == 2 and fake.fake_exec_device(0) == 0
    assert _exec_node(fake, 0, 0, 4) == ("k1", [4, 1, 1, 32, 1, 1, 0], [w.ptr, x.ptr, 0, 1], -1)
    assert _exec_node(fake, 0, 1, 6) == ("k2", [8, 1, 1, 128, 1, 1, 0], [out.ptr, w.ptr, y.ptr, _f64(2.5), 0, 1000], 0)
    # the same buffers again: launched as it is
    fake.fake_log_clear()
    graph([x, out, y])
    assert _calls(fake) == ["cuGraphLaunch@0"] and _count(fake, "node_updates") == 0
    # another input: only the node reading it changes
    fake.fake_log_clear()
    graph([x2, out, y])
    assert _calls(fake) == ["v2@0", "cuGraphExecKernelNodeSetParams@0", "cuGraphLaunch@0"]
    assert _exec_node(fake, 0, 0, 4)[2] == [w.ptr, x2.ptr, 0, 1]
    assert _exec_node(fake, 0, 1, 6)[2] == [out.ptr, w.ptr, y.ptr, _f64(2.5), 0, 1000]
    # another output and another second input: the second node, updated once
    graph([x2, out2, x])
    assert _count(fake, "node_updates") == 2
    assert _exec_node(fake, 0, 1, 6)[2] == [out2.ptr, w.ptr, x.ptr, _f64(2.5), 0, 1000]
    assert fake.fake_execs() == 1 and fake.fake_exec_launches(0) == 4 and _count(fake, "graph_launches") == 4
    assert _launches(fake) == kernels   # (no kernel launched on its own)

def test_graph_errors_and_empty_graphs(fake):
    """A node the driver refuses fails the call, naming the kernel, and the next call builds the graph anew; a graph
    of launches without threads runs nothing."""
    fake.fake_devices(2, 1)
    d0, d1 = CUDADevice("CUDA"), CUDADevice("CUDA:1")
    fake.fake_params(b"k", 4, 2)   # (the stand-in refuses a buffer that isn't the graph's GPU's)
    a, b, other = d0.allocator.alloc(64), d0.allocator.alloc(64), d1.allocator.alloc(64)
    launch = CUDAProgram(d0, "k", ELF).prepare(a, None, global_size=16, varying=(1,))
    graph = launch.graph([(launch, (0,)), (launch, (0,))])
    with pytest.raises(CUDAError, match="adding kernel k to a graph on CUDA failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        graph([other])
    graph([b])
    assert fake.fake_execs() == 1 and fake.fake_exec_nodes(0) == 2 and _count(fake, "graph_launches") == 1
    assert _exec_node(fake, 0, 1, 4) == ("k", [1, 1, 1, 16, 1, 1, 0], [a.ptr, b.ptr, 0, 16], 0)
    empty = CUDAProgram(d0, "k", ELF).prepare(a, None, global_dims=(0,), local_dims=(8,), varying=(1,))
    fake.fake_log_clear()
    empty.graph([(empty, (0,)), (empty, (0,))])([b])
    assert "cuGraphLaunch@0" not in _calls(fake) and "cuGraphInstantiateWithFlags@0" not in _calls(fake)

def test_graphs_are_per_gpu(fake):
    fake.fake_devices(2, 1)
    d0, d1 = CUDADevice("CUDA"), CUDADevice("CUDA:1")
    a0, a1 = d0.allocator.alloc(64), d1.allocator.alloc(64)
    fake.fake_params(b"k", 3, 1)
    l0 = CUDAProgram(d0, "k", ELF).prepare(a0, global_size=4)
    l1 = CUDAProgram(d0, "k", ELF).prepare(a1, global_size=4)
    assert l0.graph is d0.launch_graph and l1.graph is d1.launch_graph and l0.graph is not l1.graph
    with pytest.raises(ValueError, match="holds only launches of that GPU"): l0.graph([(l0, ()), (l1, ())])
    graph = l1.graph([(l1, ()), (l1, ())])
    graph([])
    assert fake.fake_exec_device(0) == 1 and fake.fake_exec_nodes(0) == 2
    assert _exec_node(fake, 0, 1, 3) == ("k", [1, 1, 1, 4, 1, 1, 0], [a1.ptr, 0, 4], 0)

def test_timing_events(fake):
    """A timed launch is measured between two events around it on the stream, made once per GPU."""
    dev = CUDADevice("CUDA")
    a = dev.allocator.alloc(4)
    made = _count(fake, "events_made")
    prg = CUDAProgram(dev, "k", ELF)
    assert prg(a, global_size=4, wait=True) == pytest.approx(1.5e-3)
    assert prg(a, global_size=4, wait=True) == pytest.approx(1.5e-3)
    assert _count(fake, "events_made") == made + 2

# *** copies ***

def _filled(dev: CUDADevice, data: bytes) -> ops_cuda.CUDAMemory:
    mem = dev.allocator.alloc(len(data))
    dev.allocator._copyin(mem, memoryview(data))
    return mem

def _read(dev: CUDADevice, mem: ops_cuda.CUDAMemory, n: int) -> bytes:
    out = bytearray(n)
    dev.allocator._copyout(memoryview(out), mem)
    return bytes(out)

def test_device_copy_on_one_gpu(fake):
    dev = CUDADevice("CUDA")
    data = bytes(range(64))
    a, b = _filled(dev, data), dev.allocator.alloc(64)
    fake.fake_log_clear()
    dev.allocator._transfer(b, a, 64)
    dev.allocator._transfer(dev.allocator._offset(b, 16, 8), dev.allocator._offset(a, 16, 40), 16)
    assert _calls(fake) == ["cuMemcpyDtoDAsync_v2@0"] * 2
    assert _read(dev, b, 64) == data[:8] + data[40:56] + data[24:]

def test_peer_copy_between_two_gpus(fake):
    """Where the driver says the GPUs reach each other's memory, peer access is enabled once and the copy is queued on
    the destination's stream, after the work queued on the source's, and the source's stream waits for it."""
    fake.fake_devices(2, 1)
    d0, d1 = CUDADevice("CUDA"), CUDADevice("CUDA:1")
    assert d0.context.value != d1.context.value
    data = bytes(range(100, 164))
    a, b = _filled(d0, data), d1.allocator.alloc(64)
    fake.fake_log_clear()
    d1.allocator._transfer(b, a, 64)
    calls = _calls(fake)
    assert calls[0].startswith("cuDeviceCanAccessPeer@") and calls[1:] == [
        "cuCtxEnablePeerAccess@1", "cuEventRecord@0", "cuStreamWaitEvent@1", "cuMemcpyPeerAsync@1",
        "cuEventRecord@1", "cuStreamWaitEvent@0"]
    assert fake.fake_peer_enabled(1, 0) and not fake.fake_peer_enabled(0, 1)
    assert _read(d1, b, 64) == data
    # the next copy asks nothing again; a part of the source goes too (a shard of a buffer)
    fake.fake_log_clear()
    d1.allocator._transfer(b, d0.allocator._offset(a, 32, 32), 32)
    assert "cuMemcpyPeerAsync@1" in _calls(fake) and not any("Peer" in c and "Async" not in c for c in _calls(fake))
    assert _read(d1, b, 64) == data[32:] + data[32:]
    assert _count(fake, "peer_copies") == 2 and _count(fake, "host_copies") == 3   # (the copy in, the two reads)

def test_copy_between_gpus_without_peer_access(fake):
    fake.fake_devices(2, 0)
    d0, d1 = CUDADevice("CUDA"), CUDADevice("CUDA:1")
    data = bytes(range(64))
    a, b = _filled(d0, data), d1.allocator.alloc(64)
    fake.fake_log_clear()
    d1.allocator._transfer(b, a, 64)
    assert [c for c in _calls(fake) if not c.startswith("cuDeviceCanAccessPeer")] == \
        ["cuMemcpyDtoH_v2@0", "cuMemcpyHtoD_v2@1"]
    assert _read(d1, b, 64) == data and _count(fake, "peer_copies") == 0

def test_second_gpu(fake):
    """CUDA:1 has a context of its own: its memory and its launches are the second GPU's."""
    fake.fake_devices(2, 1)
    d1 = CUDADevice("CUDA:1")
    assert d1.name == "Fake GPU" and d1.cu_device.value == 1
    a = d1.allocator.alloc(64)
    fake.fake_params(b"k", 3, 1)   # (the stand-in refuses a buffer that isn't the current GPU's)
    CUDAProgram(CUDADevice("CUDA"), "k", ELF)(a, global_size=8)
    assert ctypes.c_int.in_dll(fake, "last_device").value == 1
    with pytest.raises(RuntimeError, match="CUDA:2 is GPU 2, but there are 2"): CUDADevice("CUDA:2")

# (a script's start: the stand-in driver loaded in place of libcuda, its counters and recorded launches readable)
JIT_PREAMBLE = """
import ctypes, json, sys
import numpy as np
from fusegrad.runtime import ops_cuda
ops_cuda.LIBCUDA = sys.argv[1]
fake = ctypes.CDLL(sys.argv[1])
fake.fake_set(0, ctypes.c_size_t(1 << 24), 0)
from fusegrad import Tensor, TinyJit, Variable
from fusegrad.engine.realize import CompiledRunner, sym_infer
count = lambda name: ctypes.c_int.in_dll(fake, name).value
fake.fake_exec_param.restype = ctypes.c_uint64
fake.fake_exec_dim.restype = ctypes.c_uint
rng = np.random.default_rng(0)
"""

JIT_RUN = JIT_PREAMBLE + """
w = Tensor(rng.random((16, 8), dtype=np.float32), device="CUDA").realize()

@TinyJit
def f(x):
    h = (x @ w).relu()
    b = (h * h.sum(axis=0)).sum(axis=1)
    return (h / b.reshape(-1, 1)) @ w.T

xs = [Tensor(rng.random((4, 16), dtype=np.float32), device="CUDA").realize() for _ in range(4)]
# eager steps first: from the second on, the schedule's replay plan launches the kernels through prepared launches
# that take every buffer per call (their GPU is the buffers')
prepared = []
launch_call = ops_cuda.CUDALaunch.__call__
def counted(self, *allocations):
    prepared.append(allocations[0].device.device)
    return launch_call(self, *allocations)
ops_cuda.CUDALaunch.__call__ = counted
fake.fake_record(1)
eager = []
for x in xs[:3]:
    out = f.fxn(x).realize()
    eager.append(ctypes.c_uint64.in_dll(fake, "last_params").value == out._buffer()._buf.ptr)
ops_cuda.CUDALaunch.__call__ = launch_call
f(xs[0])
out1 = f(xs[1])   # the capture
kernels = [ei for ei in f.captured if isinstance(ei.prg, CompiledRunner)]
assert len(kernels) == len(f.captured), f.captured
for ei in kernels:   # (each kernel's parameters: its buffers, Variables and the range [0, global_size))
    nbufs = len(ei.prg._gidx) if ei.prg._gidx else len(ei.bufs)
    fake.fake_params(ei.prg.p.function_name.encode(), nbufs + len(ei.prg._vnames) + 2, nbufs)
def expected(x, out):
    # each kernel's buffer parameters in this replay: the input and output swapped for this call's
    swap = {id(xs[1]._buffer()): x._buffer(), id(out1._buffer()): out._buffer()}
    rows = []
    for ei in kernels:
        bufs = [ei.bufs[i] for i in ei.prg._gidx] if ei.prg._gidx else ei.bufs
        rows.append([swap.get(id(b), b)._buf.ptr for b in bufs])
    return rows
replays, last = [], None
for x in (xs[2], xs[2], xs[3], xs[3]):
    k0, g0, u0, e0 = count("launches"), count("graph_launches"), count("node_updates"), fake.fake_execs()
    out = f(x)
    e = fake.fake_execs() - 1
    want = expected(x, out)
    got = [[fake.fake_exec_param(e, k, i) for i in range(len(row))] for k, row in enumerate(want)]
    changed = len(want) if last is None else sum(a != b for a, b in zip(want, last))
    replays.append(dict(kernels=count("launches") - k0, graphs=count("graph_launches") - g0,
                        made=fake.fake_execs() - e0, nodes=fake.fake_exec_nodes(e), updates=count("node_updates") - u0,
                        changed=changed, params_match=got == want))
    last = want
    if x is xs[3]: del out   # (the output's memory goes back to the allocator: the next one may reuse it)
print(json.dumps(dict(n=len(kernels), replays=replays, eager=eager, prepared=prepared)))
"""

def test_tinyjit_replays_through_a_cuda_graph(fake_lib):
    """TinyJit on CUDA, against the stand-in (kernels compiled by NVRTC, not run): from the first replay on, one
    cuGraphLaunch per replay and no kernel launched on its own; the graph, built once, holds every captured kernel,
    and after each replay its nodes take this call's input and output (updated only where they changed). The same
    function run eagerly launches its replayed schedule's kernels through prepared launches, on its output."""
    r = subprocess.run([sys.executable, "-c", JIT_RUN, fake_lib], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CACHELEVEL": "0"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    n, replays = got["n"], got["replays"]
    assert n >= 3, got
    for i, rep in enumerate(replays):
        assert rep["kernels"] == 0 and rep["graphs"] == 1 and rep["nodes"] == n and rep["params_match"], (i, rep)
        assert rep["made"] == (1 if i == 0 else 0), (i, rep)
        if i > 0: assert rep["updates"] == rep["changed"], (i, rep)
    assert replays[2]["changed"] >= 1   # (another input: its readers were updated)
    assert got["eager"] == [True] * 3 and got["prepared"] == ["CUDA"] * (2 * n), got

MULTI_RUN = """
import ctypes, json, sys
import numpy as np
from fusegrad.runtime import ops_cuda
ops_cuda.LIBCUDA = sys.argv[1]
fake = ctypes.CDLL(sys.argv[1])
fake.fake_set(0, ctypes.c_size_t(1 << 24), 0)
fake.fake_devices(2, int(sys.argv[2]))
from fusegrad import Tensor
from fusegrad.schedule.multi import shards_of
from fusegrad.uop.ops import device_buffer
count = lambda name: ctypes.c_int.in_dll(fake, name).value
x = np.arange(64, dtype=np.float32).reshape(8, 8)
t = Tensor(x, device="CUDA").realize()
moved = t.to("CUDA:1").realize()
one = dict(peer=count("peer_copies"), same=bool((moved.numpy() == x).all()), device=moved.device)
def shards(s):
    return [(u.device, device_buffer(u.base).numpy().reshape(-1, 8).tolist()) for u in shards_of(s.uop)]
split = shards(t.shard(("CUDA:0", "CUDA:1"), axis=0).realize())
copies = shards(t.shard(("CUDA:0", "CUDA:1")).realize())
peer = count("peer_copies")
# a data-parallel TinyJit: each GPU's run of kernels one graph, the partial sums crossing between them
from fusegrad import TinyJit
from fusegrad.engine.realize import CompiledRunner
w = Tensor(np.ones((16, 8), np.float32), device="CUDA").shard(("CUDA:0", "CUDA:1")).realize()
@TinyJit
def f(x):
    h = (x @ w).relu()
    return (h * h.sum(axis=0)).sum(axis=1)
xs = [Tensor(np.ones((8, 16), np.float32), device="CUDA").shard(("CUDA:0", "CUDA:1"), axis=0).realize()
      for _ in range(4)]
f(xs[0]), f(xs[1])
for ei in f.captured:   # (the stand-in checks that a kernel's buffers are its GPU's)
    if isinstance(ei.prg, CompiledRunner):
        nbufs = len(ei.prg._gidx) if ei.prg._gidx else len(ei.bufs)
        fake.fake_params(ei.prg.p.function_name.encode(), nbufs + len(ei.prg._vnames) + 2, nbufs)
jit = []
for x in xs[2:]:
    before = [count(n) for n in ("graph_launches", "peer_copies", "host_copies")]
    f(x)
    jit.append([count(n) - b for n, b in zip(("graph_launches", "peer_copies", "host_copies"), before)])
print(json.dumps(dict(one=one, split=split, copies=copies, peer=peer, enabled=fake.fake_peer_enabled(1, 0), jit=jit)))
"""

@pytest.mark.parametrize("peer", [1, 0])
def test_copies_and_shards_over_two_gpus(fake_lib, peer):
    """Tensors moved to the second GPU and sharded over two, against the stand-in with two GPUs: the engine's copies
    go GPU to GPU (peer to peer where the GPUs reach each other, else through the host) and land where they should;
    a TinyJit over sharded tensors replays a graph on each GPU with the copies between them."""
    r = subprocess.run([sys.executable, "-c", MULTI_RUN, fake_lib, str(peer)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CACHELEVEL": "0"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    rows = [[float(8 * i + j) for j in range(8)] for i in range(8)]
    assert got["one"] == dict(peer=peer, same=True, device="CUDA:1")
    # (the first GPU's shard of a split is a kernel's, which the stand-in doesn't run: the second's is the copy of
    # the source's rows 4-7, from the middle of its buffer)
    assert [d for d, _ in got["split"]] == ["CUDA", "CUDA:1"] and got["split"][1][1] == rows[4:]
    assert got["copies"] == [["CUDA", rows], ["CUDA:1", rows]]
    assert got["enabled"] == peer and got["peer"] == 3 * peer
    # each replay: a graph per GPU, and two copies between them, peer to peer or each out to the host and back
    assert got["jit"] == [[2, 2 * peer, 4 * (1 - peer)]] * 2
