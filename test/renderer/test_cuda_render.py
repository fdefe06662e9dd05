"""The CUDA renderer's kernels compile with NVRTC to cubins for sm_80 and sm_90: a representative set of Tensor
programs (elementwise ops and casts of every dtype, bitcasts, transcendentals, nan and inf constants, reductions
grouped through shared memory, a matmul tiled through shared memory (LTILE), softmax, a convolution, half and bfloat16,
Variables, threefry random numbers, gathers and scatters, matmuls and a convolution on tensor cores: mma.sync of half,
bfloat16 and, with ALLOW_TF32=1, tf32), scheduled and rendered with `CUDARenderer`. Each cubin is
checked against what the code generator asked for: its architecture, a kernel of each name, the static shared memory
of each kernel. The half constants the renderer writes are checked against NumPy's rounding.

The full version (slow): every kernel the op tests (test/tensor/test_ops.py) make, compiled for both architectures."""
from __future__ import annotations
import itertools
import math
import os
import re
import struct
import subprocess
import sys
import numpy as np
import pytest
from fusegrad import Device, Tensor, Variable, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import OptOps
from fusegrad.uop.ops import ORDER_ONLY
from fusegrad.dtype import DType
from fusegrad.helpers import Context
from fusegrad.renderer import ProgramSpec
from fusegrad.renderer.cuda import CUDARenderer, _half_bits
from fusegrad.runtime.ops_cuda import CUDACompiler
from test.runtime.test_cuda import _sm
from fusegrad.uop.ops import Ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCHS = ("sm_80", "sm_90")
EVERY_DTYPE = (dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32,
               dtypes.int64, dtypes.uint64, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)

# *** the kernels ***

def programs(*ts: Tensor, ren: CUDARenderer | None = None) -> list[ProgramSpec]:
    """The CUDA programs of the kernels that realize `ts` (scheduled as on any device, rendered for CUDA)."""
    ren = ren or CUDARenderer()
    sched = ts[0].schedule(*ts[1:])
    return [get_program(si.ast, ren) for si in sched if si.ast.op is Ops.SINK]

def _source(dt: DType, shape: tuple[int, ...], seed: int) -> Tensor:
    x = np.random.default_rng(seed).standard_normal(shape) * 5
    if dt == dtypes.bool: return Tensor(x > 0)
    return Tensor(x.astype(np.float32)).cast(dt).realize()

def elementwise(dt: DType) -> list[Tensor]:
    a, b = _source(dt, (33, 17), 0), _source(dt, (33, 17), 1)
    outs = [a + b, a * b, a < b, a == b, (a < b).where(a, b), a.maximum(b), a.cast(dtypes.float32),
            Tensor.rand(33, 17).cast(dt)]
    if dt != dtypes.bool: outs += [a - b, -a]
    if dtypes.is_int(dt): outs += [a // b, a % b, a << (b & 7), a >> (b & 7), a & b, a | b, a ^ b]
    if dtypes.is_float(dt): outs += [a / b, a.exp(), a.log(), a.sin(), a.sqrt(), a.pow(b), a.trunc(), a.reciprocal()]
    return outs

def representative() -> list[ProgramSpec]:
    progs: list[ProgramSpec] = []
    for dt in EVERY_DTYPE: progs += programs(*elementwise(dt))
    f32 = Tensor.rand(64, 300).realize()
    # every cast between dtypes, bitcasts of the same size
    progs += programs(*[_source(s, (9, 7), 2).cast(d) for s in EVERY_DTYPE for d in EVERY_DTYPE if s != d])
    progs += programs(f32.bitcast(dtypes.int32), f32.cast(dtypes.float64).bitcast(dtypes.uint64),
                      f32.cast(dtypes.float16).bitcast(dtypes.int16), f32.cast(dtypes.bfloat16).bitcast(dtypes.uint16),
                      _source(dtypes.int32, (8,), 3).bitcast(dtypes.float32))
    # transcendentals, nan and inf
    progs += programs(f32.tanh(), f32.sigmoid(), f32.erf(), f32.cos(), f32.tan(), f32.log2(), f32.exp2(),
                      f32.cast(dtypes.float64).exp(), f32.cast(dtypes.float16).sin(),
                      (f32 > 0.5).where(f32, float("nan")), f32.maximum(float("-inf")) + float("inf"),
                      (f32.cast(dtypes.float64) > 0.5).where(float("inf"), float("nan")))
    # the math library's exp2, log2 and sin (TRANSCENDENTAL=0) rather than polynomials
    with Context(TRANSCENDENTAL=0):
        progs += programs(f32.exp(), f32.log(), f32.sin(), f32.cast(dtypes.float64).exp2(), f32.half().log2())
    # reductions (grouped through shared memory), softmax, a matmul, a convolution, half and bfloat16
    x = Tensor.rand(2, 3, 16, 16).realize()
    progs += programs(f32.sum(1), f32.max(1), f32.sum(), f32.softmax(-1), f32.log_softmax(0),
                      Tensor.rand(128, 128).realize() @ Tensor.rand(128, 128).realize(),
                      x.conv2d(Tensor.rand(8, 3, 3, 3).realize(), padding=1),
                      f32.half().sum(1), f32.cast(dtypes.bfloat16).softmax(-1),
                      f32.half()[:, :64].T @ f32.half()[:, :64])
    # a Variable's shrink, random numbers (threefry), gathers and scatters
    n = Variable("n", 1, 64)
    idx = Tensor(np.random.default_rng(4).integers(0, 300, (64, 5)).astype(np.int32)).realize()
    progs += programs((f32[:n.bind(13)] * 2 + 1).sum(1), Tensor.rand(1000), Tensor.randn(17, 3),
                      f32.gather(1, idx), f32[idx[:, 0]], f32.scatter(1, idx, 1.0),
                      f32.scatter_reduce(1, idx, Tensor.rand(64, 5), "sum"))
    progs += tensor_core_programs()
    return progs

def tensor_core_programs() -> list[ProgramSpec]:
    """Kernels the heuristic lays out for mma.sync: half and bfloat16 matmuls (one batched, one with a bias and relu
    after it), half convolutions (one padded, with a bias and relu), a float32 matmul as TF32."""
    h = lambda *shape: Tensor.rand(*shape).realize().half().realize()
    b16 = lambda *shape: Tensor.rand(*shape).realize().cast(dtypes.bfloat16).realize()
    f32 = lambda t: t.cast(dtypes.float32)
    progs = programs(h(64, 32) @ h(32, 64), b16(32, 64) @ b16(64, 48), f32(h(2, 32, 16)) @ f32(h(2, 16, 16)),
                     (f32(h(48, 32)) @ f32(h(32, 32)) + Tensor.rand(32).realize()).relu(),
                     f32(h(1, 16, 18, 18)).conv2d(f32(h(8, 16, 3, 3))),
                     f32(h(2, 16, 16, 16)).conv2d(f32(h(32, 16, 3, 3)), Tensor.rand(32).realize(), padding=1).relu())
    with Context(ALLOW_TF32=1): progs += programs(Tensor.rand(32, 32).realize() @ Tensor.rand(32, 64).realize())
    # K long enough for the heuristic to stage the operands through shared memory (LTILE after TC)
    progs += programs(h(256, 128) @ h(128, 256), b16(64, 256) @ b16(256, 64), f32(h(2, 64, 128)) @ f32(h(2, 128, 32)),
                      f32(h(2, 64, 8, 8)).conv2d(f32(h(32, 64, 3, 3)), padding=1))
    with Context(ALLOW_TF32=1): progs += programs(Tensor.rand(64, 128).realize() @ Tensor.rand(128, 64).realize())
    return progs

@pytest.fixture(scope="module")
def kernels() -> list[ProgramSpec]:
    Tensor.manual_seed(0)
    return representative()

def test_the_set_has_what_it_claims(kernels):
    """The set holds what it is meant to test: grouped reductions, an LTILE matmul, Variables, threefry, gathers and
    every dtype."""
    ops = [{u.op for u in p.uops} for p in kernels]
    assert any(Ops.BARRIER in o and Ops.DEFINE_LOCAL in o and Ops.SPECIAL in o for o in ops)
    assert any(any(o.op is OptOps.LTILE for o in p.applied_opts) for p in kernels)
    assert any(any(o.op in (OptOps.GROUP, OptOps.GROUPTOP) for o in p.applied_opts) for p in kernels)
    assert any(p.vars for p in kernels) and any(Ops.THREEFRY in o for o in ops)
    wmma = {u.arg[0] for p in kernels for u in p.uops if u.op is Ops.WMMA}
    assert wmma == {"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                    "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}, wmma
    dts = {(u.dtype.base if hasattr(u.dtype, "base") else u.dtype).scalar() for p in kernels for u in p.uops}
    assert set(EVERY_DTYPE) <= dts
    assert len(kernels) > 150

def test_launch_bounds_and_barriers(kernels):
    """Each kernel declares the block size it is launched with, and has one __syncthreads per BARRIER."""
    for p in kernels:
        if any(u.op is Ops.SPECIAL for u in p.uops): threads = math.prod(p.local_dims)
        else:   # (no ids: a loop over [core_lo, core_hi) or none; launched on up to 128 threads)
            threads = 128
            assert math.prod(p.local_dims or (1,)) == 1 and "long core_lo, long core_hi)" in p.src, p.src
        assert f"__launch_bounds__({threads}) {p.function_name}(" in p.src, p.src
        # (a BARRIER that only orders, a double-buffered copy's, waits for nothing)
        assert p.src.count("__syncthreads();") == sum(u.op is Ops.BARRIER and u.arg != ORDER_ONLY for u in p.uops), \
            p.src

# *** what NVRTC made ***

def elf_sections(elf: bytes) -> dict[str, int]:
    """Section name -> size, of a 64-bit little-endian ELF file."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3a)
    header = lambda i: struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
    names = header(shstrndx)[4]
    out = {}
    for i in range(shnum):
        name, _, _, _, _, size = header(i)
        out[elf[names + name:elf.index(b"\0", names + name)].decode()] = size
    return out

def shared_bytes_asked(p: ProgramSpec) -> tuple[int, int]:
    """(bytes of shared memory the kernel's DEFINE_LOCALs declare, how many arrays)."""
    locs = [u for u in p.uops if u.op is Ops.DEFINE_LOCAL]
    return sum(u.dtype.size * u.dtype.base.itemsize for u in locs), len(locs)

def compile_together(srcs: list[str], arch: str) -> bytes:
    """One cubin of all the sources (the renderer's symbols are unique and its helpers guarded, so they are one valid
    program): NVRTC starts once, not once per kernel."""
    return CUDACompiler(arch).compile("\n".join(dict.fromkeys(srcs)))

def check_cubin(cubin: bytes, arch: str, progs: list[ProgramSpec]) -> None:
    assert _sm(cubin) == int(arch[3:])
    sections = elf_sections(cubin)
    # sm_90 cubins count the 1 KiB of shared memory the driver reserves in each block in a kernel's static size
    reserved = 1024 if ".nv.shared.reserved.0" in sections else 0
    for p in progs:
        assert f".text.{p.function_name}" in sections, p.function_name
        asked, arrays = shared_bytes_asked(p)
        got = sections.get(f".nv.shared.{p.function_name}", reserved) - reserved
        # (arrays are aligned: a few bytes of padding between them)
        assert asked <= got <= asked + 16 * max(arrays - 1, 0), (p.function_name, asked, got)
        assert got <= CUDARenderer().local_bytes

@pytest.mark.parametrize("arch", ARCHS)
def test_representative_kernels_compile(kernels, arch):
    check_cubin(compile_together([p.src for p in kernels], arch), arch, kernels)

def test_one_kernel_alone(kernels):
    """A kernel is a whole program by itself too (what the device compiles): the grouped reduction."""
    p = next(p for p in kernels if any(u.op is Ops.BARRIER for u in p.uops))
    check_cubin(CUDACompiler("sm_90").compile(p.src), "sm_90", [p])

def test_tensor_core_kernels(kernels):
    """Each WMMA is one call of the mma.sync function, whose asm names the instruction; a kernel with WMMAs launches
    whole warps (the lanes along threadIdx.x), and without ALLOW_TF32 no float32 matmul uses a tensor core."""
    tc = [p for p in kernels if any(u.op is Ops.WMMA for u in p.uops)]
    assert len(tc) >= 12
    # (the operands of some staged through shared memory: every fragment element read from a __shared__ array)
    staged = [p for p in tc if any(o.op is OptOps.LTILE for o in p.applied_opts)]
    copies_async = 0
    assert len(staged) >= 5 and {u.arg[2] for p in staged for u in p.uops if u.op is Ops.WMMA} == \
        {"half", "__bf16", "float"}
    for p in staged:
        frags = [e.src[0] if e.op is Ops.GEP else e
                 for u in p.uops if u.op is Ops.WMMA for v in u.src[:2] for e in v.src]
        assert all(e.op is Ops.LOAD and e.src[0].src[0].op is Ops.BARRIER for e in frags)
        # (double-buffered where every copy is of 16-byte vectors: one barrier per block, the copies asynchronous,
        # waited for before each barrier; else two barriers per block)
        double = any(u.op is Ops.BARRIER and u.arg == ORDER_ONLY for u in p.uops)
        assert sum(u.op is Ops.DEFINE_LOCAL for u in p.uops) == 1 and p.src.count("__syncthreads();") == 2 - double
        lines = [ln.strip() for ln in p.src.splitlines()]
        if any(ln.startswith("if") and "cp.async.cg.shared.global" in ln for ln in lines):
            copies_async += 1
            assert all(lines[i - 1] == 'asm volatile("cp.async.wait_all;" ::: "memory");'
                       for i, ln in enumerate(lines) if ln == "__syncthreads();"), p.src
    assert copies_async >= 4
    for p in tc:
        names = {u.arg[0] for u in p.uops if u.op is Ops.WMMA}
        assert all(f'asm volatile("{n} ' in p.src for n in names), p.src
        calls = sum(p.src.count("fg_" + n.removeprefix("mma.sync.aligned.").replace(".", "_") + "(") for n in names)
        assert calls == 1 + sum(u.op is Ops.WMMA for u in p.uops), p.src   # (its definition and one call per WMMA)
        assert p.local_dims[0] == 32 and "threadIdx.x" in p.src
    assert "cvt.rna.tf32.f32" in next(p.src for p in tc if "tf32" in p.src)
    f32 = programs(Tensor.rand(32, 32).realize() @ Tensor.rand(32, 64).realize())
    assert not any(u.op is Ops.WMMA for p in f32 for u in p.uops)
    assert not CUDARenderer("sm_75").tensor_cores

@pytest.mark.parametrize("arch", ARCHS)
def test_dynamic_shared_memory(monkeypatch, arch):
    """Local buffers above the static 48 KiB (a GPU's opt-in limit given as local_bytes): 4x2 warps of 4x8 tensor-core
    tiles, double-buffered, take 57 KiB, declared as dynamic shared memory whose size the cubin's
    DYNAMIC_SHARED_SYMBOL holds (read back by the runtime, `dynamic_shared_bytes`); within 48 KiB the heuristic
    doesn't stage them, and a kernel whose locals fit has no such symbol."""
    from fusegrad.codegen.opt import heuristic_gpu
    from fusegrad.renderer.cuda import DYNAMIC_SHARED_SYMBOL, STATIC_SHARED_BYTES
    from fusegrad.runtime.ops_cuda import dynamic_shared_bytes
    for k, v in dict(TC_WARPS=(4, 2), TC_MIN_GROUPS=1, TC_MIN_WARPS=1).items(): monkeypatch.setattr(heuristic_gpu, k, v)
    h = lambda *shape: Tensor.rand(*shape).realize().half().realize()
    a, b = h(512, 256).cast(dtypes.float32), h(256, 256).cast(dtypes.float32)
    wmma = lambda ps: next(p for p in ps if any(u.op is Ops.WMMA for u in p.uops))
    big = wmma(programs(a @ b, ren=CUDARenderer(arch, local_bytes=227 * 1024)))
    asked, arrays = shared_bytes_asked(big)
    assert any(o.op is OptOps.LTILE for o in big.applied_opts) and arrays == 1 and asked > STATIC_SHARED_BYTES
    assert "extern __shared__" in big.src and DYNAMIC_SHARED_SYMBOL in big.src
    cubin = CUDACompiler(arch).compile(big.src)
    assert dynamic_shared_bytes(cubin) == asked
    sections = elf_sections(cubin)
    assert sections.get(f".nv.shared.{big.function_name}", 0) <= 1024   # (at most what the driver reserves)
    small = wmma(programs(a @ b))
    assert not any(o.op is OptOps.LTILE for o in small.applied_opts) and "extern __shared__" not in small.src
    assert dynamic_shared_bytes(CUDACompiler(arch).compile(small.src)) == 0

def test_tensor_core_tiles_leave_small_products_enough_groups(monkeypatch):
    """A 4096^3 half product takes the full tiles (TC_TILES per warp, TC_WARPS per group); a 512^3 one keeps
    TC_MIN_GROUPS groups and TC_MIN_WARPS warps, where the full tiles would leave it 8 groups."""
    import fusegrad.tensor as fgt
    from fusegrad.codegen.opt import heuristic_gpu as hg
    monkeypatch.setattr(fgt, "_has_tensor_cores", lambda device: True)   # (the CPU's own matmul converts half first)
    for n in (512, 1024, 4096):
        a = Tensor.empty(n, n, dtype=dtypes.half)
        (p,) = programs(a @ a)[-1:]
        groups, per_group = math.prod(p.global_dims), math.prod(p.local_dims) // 32
        warps = math.prod(hg.TC_WARPS)
        if n == 4096: assert (groups, per_group) == (n * n // (16 * 8 * math.prod(hg.TC_TILES) * warps), warps)
        else: assert groups >= hg.TC_MIN_GROUPS and groups * per_group >= hg.TC_MIN_WARPS, p.applied_opts

@pytest.mark.parametrize("shape", [(512, 512, 512), (256, 384, 128)])
def test_float32_matmul_reads_its_staged_tiles_as_vectors(shape):
    """A register-tiled float32 matmul stages A and B in one shared buffer, between two barriers a block, laid out as
    the global buffers are: a work-item's neighbouring columns of B (TILE_INNER of its tile) and its unrolled stretch
    of K in A's rows are neighbours in shared memory, which NVRTC loads as 16-byte vectors (its PTX: every staged read
    a `ld.shared.v4`, where they were all scalar loads, and two barriers a block, not four)."""
    from fusegrad.codegen.opt import heuristic_gpu as hg
    m, k, n = shape
    a, b = Tensor.empty(m, k), Tensor.empty(k, n)
    (p,) = programs(a @ b)[-1:]
    ltiles = [o for o in p.applied_opts if o.op is OptOps.LTILE]
    assert ltiles and [o.arg for o in p.applied_opts if o.op is OptOps.UPCAST][:2] == [hg.TILE_INNER] * 2
    ptx = CUDACompiler("sm_90").ptx(p.src)
    vectors, scalars = ptx.count("ld.shared.v4.f32"), len(re.findall(r"ld\.shared\.f32\b", ptx))
    # (per block of K, each work-item reads TILE_INNER columns of B and UNROLL_BY elements of A's rows per vector)
    assert vectors >= 8 and scalars <= vectors // 4, (vectors, scalars)
    assert len(re.findall(r"\bbar\.sync\b", ptx)) == 2 and p.src.count("__shared__") == 1

def test_staged_tensor_core_tiles_leave_room_for_warps(monkeypatch):
    """Where a tensor-core kernel's operands are staged (the group's warps share the copies), its tiles leave each loop
    a multiple of its warps: ResNet-50's 1x1 convolution 256 -> 64 at 56x56 took 8 of its 392 tiles of pixels a warp
    and left 49, one warp a group. Where they aren't (the padded 3x3 convolution at 56x56), the register tile stays
    whole: there it is all that reuses a fragment."""
    from fusegrad.codegen.opt import heuristic_gpu as hg
    from fusegrad.renderer.python import PythonRenderer
    monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(like=CUDARenderer("sm_90", local_bytes=227 << 10)))
    def product(cin: int, cout: int, k: int) -> ProgramSpec:
        x = Tensor.empty(32, cin, 56, 56, dtype=dtypes.half, device="PYTHON")
        w = Tensor.empty(cout, cin, k, k, dtype=dtypes.half, device="PYTHON")
        asts = [si.ast for si in x.conv2d(w, padding=k // 2).schedule() if si.ast.op is Ops.SINK]
        return get_program(next(a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())),
                           Device["PYTHON"].renderer)
    staged = product(256, 64, 1)
    assert any(o.op is OptOps.LTILE for o in staged.applied_opts), staged.applied_opts
    assert math.prod(staged.local_dims) // 32 == math.prod(hg.TC_WARPS), staged.applied_opts
    unstaged = product(64, 64, 3)
    assert not any(o.op is OptOps.LTILE for o in unstaged.applied_opts), unstaged.applied_opts
    assert math.prod(o.arg for o in unstaged.applied_opts if o.op is OptOps.UPCAST) == math.prod(hg.TC_TILES)

def test_wgmma_probe_compiles_for_sm_90a_and_reads_the_mma_layouts():
    """bench/wgmma_probe.py (run on a Hopper GPU to find wgmma's operand layouts): its kernel compiles for sm_90a and
    not for plain sm_90 (NVRTC refuses wgmma there), and the A registers and D elements it assumes per warp are the
    mma.sync m16n8k16 layouts of the renderer's table (checked on GPUs), lane by lane."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("wgmma_probe", os.path.join(ROOT, "bench", "wgmma_probe.py"))
    assert spec is not None and spec.loader is not None
    wp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wp)
    from fusegrad.device import CompileError
    src = wp.KERNEL % dict(B_ELEMS=1024, LBO=128, SBO=256, TRANS_B=0)
    assert CUDACompiler("sm_90a").compile(src).startswith(b"\x7fELF")
    with pytest.raises(CompileError, match="wgmma"): CUDACompiler("sm_90").compile(src)
    tc = next(t for t in CUDARenderer("sm_90").tensor_cores if t.dtype_in == dtypes.half)
    codes = (np.arange(64)[:, None] * 16 + np.arange(16)[None, :]).astype(np.float16)   # (exact in half)
    regs = wp.a_registers(codes).view(np.float16).reshape(128, 8)
    for warp, lane, i in itertools.product(range(4), range(32), range(8)):
        r, c = tc.coords("A", lane, i)
        assert regs[warp * 32 + lane, i] == (16 * warp + r) * 16 + c
    d = wp.d_matrix(np.arange(128 * 32, dtype=np.float32))
    for warp, lane, i in itertools.product(range(4), range(32), range(32)):
        r, c = tc.coords("C", lane, i % 4)
        assert d[16 * warp + r, 8 * (i // 4) + c] == (warp * 32 + lane) * 32 + i

def test_elementwise_kernels_take_several_items_per_work_item(monkeypatch):
    """A large elementwise kernel (CUDA has no vector types) computes ITEMS outputs per work-item along its outermost
    loop that ITEMS divides, never the innermost (whose neighbouring work-items' accesses coalesce); a small kernel,
    or one of a single loop, one each. On the PYTHON device as a GPU (ITEMS_MIN_OUTPUTS lowered): numpy's values."""
    from fusegrad.codegen.opt import heuristic_gpu as hg
    from fusegrad.engine import realize
    from fusegrad.renderer.python import PythonRenderer
    h = lambda *shape: Tensor.empty(*shape, dtype=dtypes.half)
    big = h(24, 256, 16, 48)[:, :, 1:15, 1:15].permute(1, 0, 2, 3).contiguous()   # (1.2M outputs)
    (p,) = programs(big)
    assert (OptOps.UPCAST, 0, hg.ITEMS) in [(o.op, o.axis, o.arg) for o in p.applied_opts], p.applied_opts
    for small in (h(6, 8, 16, 48).permute(1, 0, 2, 3).contiguous(), h(1 << 21).exp()):
        assert not any(o.op is OptOps.UPCAST for p in programs(small) for o in p.applied_opts)
    ren = PythonRenderer(like=CUDARenderer("sm_80"))
    monkeypatch.setattr(Device["PYTHON"], "renderer", ren)
    monkeypatch.setattr(realize, "method_cache", {})
    monkeypatch.setattr(hg, "ITEMS_MIN_OUTPUTS", 16)
    x = np.random.default_rng(3).standard_normal((3, 8, 5, 7)).astype(np.float16)
    make = lambda: Tensor(x, device="PYTHON").pad(((0, 0), (0, 0), (1, 1), (1, 1))).permute(1, 0, 2, 3) * 2
    (p,) = programs(make(), ren=ren)
    assert any(o.op is OptOps.UPCAST and o.arg == hg.ITEMS for o in p.applied_opts), p.applied_opts
    np.testing.assert_array_equal(make().numpy(), np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(1, 0, 2, 3) * 2)

def test_float32_exp_without_float64():
    """CUDA's float64 is slow: exp of float32 and half (a softmax's, a sigmoid's) is float32 arithmetic there, no
    double and no exp2 call, though the renderer has a float64 exp2 for float64's own exp."""
    x = Tensor.rand(64, 300).realize()
    for t in (x.softmax(-1), x.sigmoid(), x.cast(dtypes.half).exp()):
        for p in programs(t):
            assert "double" not in p.src and "exp2(" not in p.src, p.src
    (p,) = programs(x.cast(dtypes.float64).exp2())
    assert "exp2(" in p.src

@pytest.mark.parametrize("dt", [dtypes.half, dtypes.bfloat16])
def test_half_convolutions_take_tensor_cores(dt):
    """A half or bfloat16 convolution (3x3 and 1x1, as ResNet's) forms its products in float32 as a matmul does, so
    the heuristic lays it out on a tensor core."""
    for cin, cout, k in ((16, 32, 3), (32, 64, 1)):
        x, w = Tensor.empty(2, cin, 8, 8, dtype=dt), Tensor.empty(cout, cin, k, k, dtype=dt)
        progs = programs(x.conv2d(w, padding=k // 2))
        assert any(u.op is Ops.WMMA for p in progs for u in p.uops), [p.applied_opts for p in progs]

# *** the renderer's own pieces ***

def test_half_constants_round_as_numpy():
    vals = [0.0, -0.0, 1.0, 0.1, -2.5, 65504.0, 65519.99, 65520.0, -1e9, 6e-8, 3e-8, 2.9e-8, 1e-8, 1 / 3, 2049.0,
            2051.0, float("inf"), float("-inf")]
    vals += list(np.random.default_rng(0).standard_normal(200) * 1000)
    with np.errstate(over="ignore"): want = [int(np.float64(v).astype(np.float16).view(np.uint16)) for v in vals]
    assert [_half_bits(v) for v in vals] == want
    assert _half_bits(float("nan")) & 0x7c00 == 0x7c00 and _half_bits(float("nan")) & 0x3ff

def test_renderer_limits_and_arch():
    ren = CUDARenderer("sm_90")
    assert (ren.max_workgroup, ren.local_max, ren.global_max, ren.local_bytes, ren.fast_local_memory) == \
        (1024, (1024, 1024, 64), (2 ** 31 - 1, 65535, 65535), 48 * 1024, True)
    assert ren.has_local and ren.arch == "sm_90"
    with pytest.raises(ValueError, match="expected sm_XY"): CUDARenderer("90")

def test_launch_grid_within_the_limits():
    """A grid's y and z take 65535 blocks: a kernel with a big second output loop is launched within that."""
    progs = programs(Tensor.rand(3, 70000).realize() * 2)
    for p in progs:
        assert all(int(g) <= m for g, m in zip(p.global_dims, CUDARenderer().global_max)), p.global_dims

# *** the full version: every kernel of the op tests ***

@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_every_op_test_kernel_compiles(tmp_path, arch):
    out = tmp_path / "kernels.txt"
    env = {**os.environ, "FG_CUDA_KERNELS_OUT": str(out)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "test.renderer.cuda_kernels_plugin",
                        "-p", "no:randomly", "-p", "no:xdist", "test/tensor/test_ops.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    srcs = out.read_text().split("\n// ---- kernel ----\n")
    assert len(srcs) > 300, len(srcs)
    for i in range(0, len(srcs), 200):   # (in parts: a message names fewer kernels)
        cubin = compile_together(srcs[i:i + 200], arch)
        assert _sm(cubin) == int(arch[3:])
