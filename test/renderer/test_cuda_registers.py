"""What ptxas gave each kernel of a cubin (registers per thread, stack frame, instructions: `kernel_resources`), and
32-bit index arithmetic in the CUDA renderer where range analysis shows every index value fits an int (kernels
rendered and compiled with NVRTC, not run: no GPU needed)."""
from __future__ import annotations
import ctypes
import re
import pytest
from fusegrad import Tensor, Variable, dtypes
from fusegrad.codegen.opt import heuristic_gpu
from fusegrad.helpers import Context
from fusegrad.renderer.cuda import CUDARenderer, index_fits_int32
from fusegrad.runtime.ops_cuda import CUDACompiler, CUDADevice, CUDAProgram, kernel_resources, nvrtc
from fusegrad.uop.ops import Ops, UOp
from test.renderer.test_cuda_render import programs
from test.runtime.test_cuda import fake, fake_lib  # noqa: F401 (the stand-in driver's fixtures)

# a store of a constant: a handful of registers (the thread's id, the address, the value)
TINY = """extern "C" __global__ void __launch_bounds__(128) tiny(float* __restrict__ out) {
  out[threadIdx.x] = 1.0f;
}
"""

def live_accumulators(name: str, n: int, threads: int) -> str:
    """A kernel whose `n` float accumulators are all live across a loop of unknown length (each step reads them all)
    and all stored after it."""
    return f"""extern "C" __global__ void __launch_bounds__({threads}) {name}(float* __restrict__ out,
    const float* __restrict__ b, int steps) {{
  float acc[{n}];
  #pragma unroll
  for (int i = 0; i < {n}; i++) acc[i] = b[i * {threads} + threadIdx.x];
  for (int k = 0; k < steps; k++) {{
    float x = b[k];
    #pragma unroll
    for (int i = 0; i < {n}; i++) acc[i] = acc[i] * x + acc[({n} - 1) - i];
  }}
  #pragma unroll
  for (int i = 0; i < {n}; i++) out[i * {threads} + threadIdx.x] = acc[i];
}}
"""

def ptxas_report(src: str, arch: str) -> dict[str, tuple[int, int]]:
    """Kernel name -> (registers, bytes of stack frame) as ptxas prints them with -v (NVRTC's log): the reference the
    cubin's attributes are checked against."""
    lib, prog = nvrtc(), ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    try:
        opts = [f"--gpu-architecture={arch}", *CUDACompiler.OPTIONS, "--ptxas-options=-v"]
        assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])) == 0
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
    finally: lib.nvrtcDestroyProgram(ctypes.byref(prog))
    out = {}
    for part in log.value.decode().split("Compiling entry function '")[1:]:
        name = part.split("'", 1)[0]
        frame = int(re.search(r"(\d+) bytes stack frame", part).group(1))
        out[name] = (int(re.search(r"Used (\d+) registers", part).group(1)), frame)
    return out

# *** registers ***

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_resources_are_what_ptxas_reports(arch):
    src = TINY + live_accumulators("many", 64, 128) + live_accumulators("spilled", 96, 1024)
    got = kernel_resources(CUDACompiler(arch).compile(src))
    want = ptxas_report(src, arch)
    assert set(got) == set(want) == {"tiny", "many", "spilled"}
    assert {k: (r.registers, r.frame_bytes) for k, r in got.items()} == want

def test_register_counts_obey_what_a_kernel_needs_and_the_hardware_allows():
    """A tiny kernel takes a few registers; 64 live float accumulators take at least 64, within the 255 a thread may
    have; under __launch_bounds__(1024) a thread has at most 64 (65536 per multiprocessor), so 96 live accumulators
    spill to a stack frame."""
    src = TINY + live_accumulators("many", 64, 128) + live_accumulators("spilled", 96, 1024)
    res = kernel_resources(CUDACompiler("sm_90").compile(src))
    tiny, many, spilled = res["tiny"], res["many"], res["spilled"]
    assert 0 < tiny.registers <= 16 and tiny.frame_bytes == 0 and 0 < tiny.instructions < 32
    assert 64 <= many.registers <= 255 and many.frame_bytes == 0
    # (each of the 64 accumulators takes at least one instruction in the loop)
    assert many.instructions >= 64 + tiny.instructions
    assert spilled.registers <= 65536 // 1024 and spilled.frame_bytes >= 4 * (96 - 64)

def test_tensor_core_accumulators_take_registers(monkeypatch):
    """A half matmul laid out with TC_TILES (4, 8) keeps 32 tiles of 4 float accumulators per lane across its K loop:
    at least 128 registers, more than a kernel with a 2x2 tile."""
    import fusegrad.tensor as fgt
    monkeypatch.setattr(fgt, "_has_tensor_cores", lambda device: True)   # (the CPU's own matmul converts half first)
    for k in ("TC_MIN_GROUPS", "TC_MIN_WARPS"): monkeypatch.setattr(heuristic_gpu, k, 1)
    a = Tensor.empty(1024, 1024, dtype=dtypes.half)
    counts = {}
    for tiles in ((4, 8), (2, 2)):
        monkeypatch.setattr(heuristic_gpu, "TC_TILES", tiles)
        p = next(p for p in programs(a @ a, ren=CUDARenderer("sm_90")) if any(u.op is Ops.WMMA for u in p.uops))
        counts[tiles] = kernel_resources(CUDACompiler("sm_90").compile(p.src))[p.function_name].registers
    assert counts[(4, 8)] >= 4 * 32 and counts[(2, 2)] >= 4 * 4
    assert counts[(4, 8)] > counts[(2, 2)] + 64

@pytest.mark.usefixtures("fake")
def test_a_loaded_kernel_tells_its_resources(capsys):
    """A CUDA program knows its kernel's registers (as ptxas reports them), and DEBUG=2 prints them when it loads."""
    src = TINY + live_accumulators("many", 64, 128)
    cubin, want = CUDACompiler("sm_90").compile(src), ptxas_report(src, "sm_90")
    with Context(DEBUG=2): prg = CUDAProgram(CUDADevice("CUDA"), "many", cubin)
    assert (prg.resources.registers, prg.resources.frame_bytes) == want["many"]
    assert f"many: {want['many'][0]} registers" in capsys.readouterr().out

# *** 32-bit indices ***

def _index_types(src: str) -> set[str]:
    """The types the kernel declares its work-item ids and loop counters with."""
    return set(re.findall(r"\b(int|long) (?:gidx\d|lidx\d)\b", src)) | set(re.findall(r"for \((int|long) ridx", src))

I32 = dict(ren=CUDARenderer(index32=True))   # (32-bit indices are the renderer's option: 64 bits by default)

def test_small_kernels_index_in_32_bits():
    x = Tensor.empty(256, 300)
    for p in programs(x + 1, x.sum(1), x.softmax(-1), Tensor.empty(128, 64) @ Tensor.empty(64, 96), **I32):
        assert _index_types(p.src) == {"int"}, p.src
        assert not re.search(r"\blong\b", p.src.split("{", 1)[1]), p.src
        assert p.function_name in kernel_resources(CUDACompiler("sm_80").compile(p.src))

def test_indices_past_2_31_stay_64_bit():
    """A kernel over 3 GiB of bytes, and one writing 1024 bytes read from past 2**31 (its output's indices are small:
    the input's aren't), keep 64-bit indices; rendered and compiled, not run."""
    big = Tensor.empty(3 * 2 ** 30, dtype=dtypes.uint8)
    for t in (big + 1, big[2 ** 31 + 5:2 ** 31 + 1029] + 1):
        (p,) = programs(t, **I32)
        assert "long" in _index_types(p.src) and "int" not in _index_types(p.src), p.src
        assert p.function_name in kernel_resources(CUDACompiler("sm_90").compile(p.src))

def test_variables_count_with_their_declared_bounds():
    """A Variable's shrink indexes in 32 bits where the Variable's declared maximum keeps every index within int, in
    64 where it doesn't (whatever the value bound)."""
    x = Tensor.empty(2 ** 31 + 64, dtype=dtypes.uint8)
    for top, want in ((1000, "int"), (2 ** 31 + 64, "long")):
        n = Variable("n", 1, top)
        (p,) = programs(x[:n.bind(5)] * 2, **I32)
        assert _index_types(p.src) == {want}, p.src
        CUDACompiler("sm_80").compile(p.src)

def test_every_index_value_is_checked_not_only_addresses():
    """The range of each index node counts, and the product inside an index multiply-add: ((n*2**20)//2**20) and
    n*2**20 - 2**31 end within int but pass through 2**32."""
    n = Variable("n", 0, 4095)
    big, half = UOp.const(dtypes.index, 1 << 20), UOp.const(dtypes.index, -(1 << 31))
    assert index_fits_int32([n, big, n * 1000])
    assert not index_fits_int32([n, big, n * big, (n * big) // big])
    mulacc = UOp(Ops.MULACC, dtypes.index, (n, big, half))
    assert -(1 << 31) <= mulacc.vmin <= mulacc.vmax < 1 << 31
    assert not index_fits_int32([n, big, half, mulacc])
    # (a loop's counter steps one past its last value)
    assert index_fits_int32([UOp.const(dtypes.index, 2 ** 31 - 2)])
    assert not index_fits_int32([UOp.const(dtypes.index, 2 ** 31 - 1)])

def test_index32_off_renders_64_bit():
    # (by default only tensor-core kernels: the same kernel that index32 narrows stays 64-bit)
    for ren in (CUDARenderer(), CUDARenderer(index32=False)):
        (p,) = programs(Tensor.empty(64, 64) + 1, ren=ren)
        assert _index_types(p.src) == {"long"}, p.src
    (p,) = programs(Tensor.empty(64, 64) + 1, **I32)
    assert _index_types(p.src) == {"int"}, p.src

def test_index32_by_default_in_tensor_core_kernels(monkeypatch):
    # a half matmul on tensor cores: 32-bit indices by default, 64-bit with index32=False
    import fusegrad.tensor as fgt
    monkeypatch.setattr(fgt, "_has_tensor_cores", lambda device: True)   # (the CPU's own matmul converts half first)
    mm = lambda: Tensor.empty(256, 256, dtype=dtypes.half) @ Tensor.empty(256, 256, dtype=dtypes.half)
    for ren, want in ((CUDARenderer("sm_80"), {"int"}), (CUDARenderer("sm_80", index32=False), {"long"})):
        (p,) = programs(mm(), ren=ren)
        assert "mma.sync" in p.src and _index_types(p.src) == want, _index_types(p.src)

# *** ldmatrix ***

def _staged_tensor_core_programs(monkeypatch) -> list:
    """Kernels whose tensor-core operands are staged through local memory: half and bfloat16 matmuls and a 1x1 half
    convolution (as the heuristic lays them out for an H100's shared memory), and a half matmul of 2x2 tiles."""
    import fusegrad.tensor as fgt
    monkeypatch.setattr(fgt, "_has_tensor_cores", lambda device: True)   # (the CPU's own matmul converts half first)
    ren = CUDARenderer("sm_90", local_bytes=227 * 1024)
    h = lambda *shape, dt=dtypes.half: Tensor.empty(*shape, dtype=dt)
    progs = programs(h(1024, 1024) @ h(1024, 1024), h(512, 256, dt=dtypes.bfloat16) @ h(256, 512, dt=dtypes.bfloat16),
                     h(8, 256, 28, 28).conv2d(h(64, 256, 1, 1)), ren=ren)
    monkeypatch.setattr(heuristic_gpu, "TC_TILES", (2, 2))
    progs += programs(h(512, 512) @ h(512, 512), ren=ren)
    return [p for p in progs if any(u.op is Ops.WMMA for u in p.uops) and any(u.op is Ops.DEFINE_LOCAL for u in p.uops)]

def _value(x: UOp, env: dict[UOp, int]) -> int:
    """Index expression `x` with its variables set to `env`, folded by the simplifier (not the renderer's code)."""
    v = x.substitute({k: UOp.const(k.dtype, n) for k, n in env.items()}).simplify()
    assert v.op is Ops.CONST, v
    return v.arg

def test_ldmatrix_delivers_each_lanes_elements(monkeypatch):
    """Each ldmatrix the renderer makes (of one fragment, or of two B fragments in one x4): every lane's rows as
    rendered (the plan's terms and per-lane numbers), read as the PTX ISA says ldmatrix reads them, give every lane
    the elements its own loads read (each address evaluated by the simplifier with the kernel's other variables at
    random values). Every fragment of each kernel is loaded so, and the kernels compile."""
    import random
    from fusegrad.renderer.cuda import lane_id, ldmatrix_loads
    rng = random.Random(0)
    progs = _staged_tensor_core_programs(monkeypatch)
    assert len(progs) == 4
    for p in progs:
        lane = lane_id(p.uops)
        plans, pairs = ldmatrix_loads(p.uops)
        frags = {f for u in p.uops if u.op is Ops.WMMA for f in u.src[:2]}
        assert set(plans) == frags and any(pl.matrices == 4 for pl in plans.values()), p.src
        assert p.src.count("ldmatrix.sync.aligned.m8n8") == len(frags) - len(pairs) and pairs
        variables = [u for u in p.uops if u.op in (Ops.RANGE, Ops.SPECIAL) and u is not lane]
        for _ in range(3):
            env = {v: rng.randint(int(v.vmin), int(v.vmax)) for v in variables}
            for frag, plan in plans.items():
                if frag in pairs.values(): continue
                elements = frag.src + (pairs[frag].src if frag in pairs else ())
                assert plan.matrices == len(elements) // 2
                free = sum(_value(t, env) for t in plan.free)
                a, b, c, d = plan.rows
                row = [free + (ln % 8) * a + (ln // 8 % 2) * b + (ln // 16) * c + d for ln in range(32)]
                for ln in range(32):
                    want = []
                    for x in elements:
                        ld, at = (x.src[0], x.arg) if x.op is Ops.GEP else (x, 0)
                        want.append(_value(ld.src[0].src[1], {**env, lane: ln}) + at)
                    # register j of lane ln: two elements of matrix j (the rows lanes 8j..8j+7 gave)
                    got = [row[8 * j + 2 * (ln % 4) + s] + ln // 4 if plan.trans else
                           row[8 * j + ln // 4] + 2 * (ln % 4) + s for j in range(plan.matrices) for s in (0, 1)]
                    assert got == want, (p.function_name, ln, got, want)
                # (each row 16 bytes aligned: 8 elements of 2 bytes, and the buffer aligned to 16)
                assert all(r % 8 == 0 for r in row)
        cubin = CUDACompiler("sm_80").compile(p.src)
        assert p.function_name in kernel_resources(cubin)

def test_ldmatrix_only_where_the_layout_matches(monkeypatch):
    """A fragment whose elements are in another order, or whose rows would start off 16 bytes, is loaded element by
    element."""
    from fusegrad.renderer.cuda import lane_id, ldmatrix_plan
    p = _staged_tensor_core_programs(monkeypatch)[0]
    lane = lane_id(p.uops)
    a, b = next(u for u in p.uops if u.op is Ops.WMMA).src[:2]
    assert ldmatrix_plan(a, lane) is not None and ldmatrix_plan(b, lane) is not None
    swapped = UOp(Ops.VECTORIZE, a.dtype, (a.src[1], a.src[0], *a.src[2:]))
    assert ldmatrix_plan(swapped, lane) is None
    def shifted(x: UOp, by: int) -> UOp:
        ld = x.src[0] if x.op is Ops.GEP else x
        idx = ld.src[0]
        moved = ld.replace(src=(idx.replace(src=(idx.src[0], idx.src[1] + by)),))
        return x.replace(src=(moved,)) if x.op is Ops.GEP else moved
    assert ldmatrix_plan(UOp(Ops.VECTORIZE, b.dtype, tuple(shifted(x, 8) for x in b.src)), lane) is not None
    assert ldmatrix_plan(UOp(Ops.VECTORIZE, b.dtype, tuple(shifted(x, 2) for x in b.src)), lane) is None

def test_ldmatrix_off_loads_element_by_element(monkeypatch):
    import fusegrad.tensor as fgt
    monkeypatch.setattr(fgt, "_has_tensor_cores", lambda device: True)
    h = Tensor.empty(1024, 1024, dtype=dtypes.half)
    for on in (True, False):
        p = programs(h @ h, ren=CUDARenderer("sm_90", local_bytes=227 * 1024, ldmatrix=on))[-1]
        assert any(u.op is Ops.DEFINE_LOCAL for u in p.uops) and ("ldmatrix" in p.src) == on
