"""GPU-style kernels from the code generator, run on the CL device (PoCL) and on the PYTHON device's work-group
emulation (`PythonRenderer(gpu=True)`, what PYTHON_GPU=1 declares), against NumPy: reductions across a work-group
through local memory and a barrier (the heuristic's choice and forced GROUP/GROUPTOP of padded rows), matmuls, the
device limits the optimizer must keep to (work-items per group, per dimension, local memory) for the heuristic and
for every candidate BEAM times, LOCAL on several output loops, more than three output loops merged into a launch
dimension, Variables as kernel arguments, TinyJit, sharding over two CL devices, and BEAM on CL.

Kernels are built by hand as ASTs where the test forces opts, and through Tensors elsewhere. PoCL builds a program
in about half a second whatever its number of kernels, so each test compiles its kernels together."""
from __future__ import annotations
import copy
import math
import os
import subprocess
import sys
import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from fusegrad import Tensor, TinyJit, Variable, nn  # noqa: E402
from fusegrad.codegen import get_program  # noqa: E402
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps  # noqa: E402
from fusegrad.codegen.opt import search  # noqa: E402
from fusegrad.device import Buffer, Device  # noqa: E402
from fusegrad.dtype import DType, dtypes, from_np_dtype, to_np_dtype  # noqa: E402
from fusegrad.engine.realize import CompiledRunner  # noqa: E402
from fusegrad.helpers import Context  # noqa: E402
from fusegrad.renderer import ProgramSpec, Renderer  # noqa: E402
from fusegrad.renderer.python import PythonRenderer  # noqa: E402
from fusegrad.uop.ops import Ops, UOp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
rng = np.random.default_rng(0)

# *** building and running kernels ***

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)

def row_reduce_ast(rows: int, n: int, dt: DType) -> UOp:
    """out0[r] = sum of a[r, :n], out1[r] = max of b[r, :n]: two reductions over one loop (a float16 sum accumulated
    in float32, as the front end does)."""
    acc = dtypes.float32 if dt == dtypes.float16 else dt
    out0, out1, a, b = glob(0, dt, rows), glob(1, dt, rows), glob(2, dt, rows * n), glob(3, dt, rows * n)
    r0, r1 = UOp.range(rows, 0), UOp.range(n, 1, "reduce")
    total = UOp(Ops.REDUCE, acc, (a.index(r0 * n + r1).load().cast(acc), r1), Ops.ADD)
    most = UOp(Ops.REDUCE, dt, (b.index(r0 * n + r1).load(), r1), Ops.MAX)
    return UOp.sink_of(out0.index(r0).store(total.cast(dt)), out1.index(r0).store(most))

def matmul_ast(M: int, N: int, K: int) -> UOp:
    out, a, b = glob(0, dtypes.float32, M * N), glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, K * N)
    m, n, k = UOp.range(M, 0), UOp.range(N, 1), UOp.range(K, 2, "reduce")
    red = UOp(Ops.REDUCE, dtypes.float32, (a.index(m * K + k).load() * b.index(k * N + n).load(), k), Ops.ADD)
    return UOp.sink_of(out.index(m * N + n).store(red))

def transpose3_ast(A: int, B: int, C: int) -> UOp:
    """out[a, b, c] = inp[c, b, a] * 2 + 1: three output loops that no address sees as one."""
    out, inp = glob(0, dtypes.float32, A * B * C), glob(1, dtypes.float32, A * B * C)
    a, b, c = UOp.range(A, 0), UOp.range(B, 1), UOp.range(C, 2)
    val = inp.index((c * B + b) * A + a).load() * 2.0 + 1.0
    return UOp.sink_of(out.index((a * B + b) * C + c).store(val))

def run_programs(device: str, items: list[tuple[ProgramSpec, list[np.ndarray]]]) -> list[list[np.ndarray]]:
    """Run each program on `device` over copies of its arrays (indexed by DEFINE_GLOBAL number; element 0 the output),
    the programs compiled together; the arrays after each run."""
    libs = Device[device].compiler.compile_cached_many([p.src for p, _ in items])
    results = []
    for (p, arrays), lib in zip(items, libs):
        bufs = [Buffer(device, a.size, from_np_dtype(a.dtype)).copyin(memoryview(np.ascontiguousarray(a).reshape(-1)))
                for a in arrays]
        CompiledRunner(p, precompiled=lib)(bufs, {}, wait=True)
        results.append([b.numpy().reshape(a.shape) for b, a in zip(bufs, arrays)])
    return results

def uses_local_memory(p: ProgramSpec) -> bool:
    """Whether `p` reduces across a work-group: local memory, a barrier and more than one work-item."""
    ops = {u.op for u in p.uops}
    return Ops.DEFINE_LOCAL in ops and Ops.BARRIER in ops and math.prod(p.local_dims) > 1

def local_bytes(p: ProgramSpec) -> int:
    return sum(u.dtype.size * u.dtype.base.itemsize for u in p.uops if u.op is Ops.DEFINE_LOCAL)

def assert_within(p: ProgramSpec, ren: Renderer) -> None:
    """`p`'s launch fits `ren`'s limits."""
    assert len(p.local_dims) <= 3 and len(p.global_dims) == len(p.local_dims), (p.name, p.global_dims, p.local_dims)
    assert math.prod(p.local_dims) <= ren.max_workgroup, (p.name, p.local_dims, p.applied_opts)
    assert all(n <= most for n, most in zip(p.local_dims, ren.local_max)), (p.name, p.local_dims, p.applied_opts)
    assert local_bytes(p) <= ren.local_bytes, (p.name, local_bytes(p), p.applied_opts)

# *** reductions across a work-group ***

ROW_LENGTHS = (1, 7, 255, 257, 4097)
RED_DTYPES = (dtypes.float32, dtypes.float16, dtypes.int32)

def grouped(n: int, g: int, op: OptOps = OptOps.GROUP) -> list[Opt]:
    """Reduce loop 1 (of n) split across g work-items, padded to a multiple of g first where g doesn't divide n."""
    return ([Opt(OptOps.PADTO, 1, g)] if n % g else []) + [Opt(op, 1, g)]

def reduce_data(dt: DType, rows: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The inputs of row_reduce_ast and NumPy's results. Sums are of small integers, so every order of adding them is
    exact; maxima are of normal floats or of int32s over their whole range."""
    npdt = to_np_dtype(dt)
    ints = rng.integers(-8, 9, (rows, n))
    b = rng.standard_normal((rows, n)).astype(npdt) if dtypes.is_float(dt) else \
        rng.integers(-2 ** 31, 2 ** 31, (rows, n)).astype(npdt)
    return [ints.astype(npdt), b], [ints.sum(1).astype(npdt), b.max(1)]

def check_reductions(device: str, ren: Renderer, cases: list[tuple[DType, int, list[Opt] | None]],
                     rows: int = 3) -> None:
    """Each (dtype, row length, opts or None for the heuristic's) kernel against NumPy; a forced GROUP, and the
    heuristic's choice from 16 elements on, reduce across the work-group."""
    items, wants = [], []
    for dt, n, opts in cases:
        p = get_program(row_reduce_ast(rows, n, dt), ren, opts=opts)
        if opts is not None or n >= 16: assert uses_local_memory(p), (dt, n, opts, p.applied_opts)
        assert_within(p, ren)
        ins, want = reduce_data(dt, rows, n)
        items.append((p, [np.zeros(rows, ins[0].dtype), np.zeros(rows, ins[0].dtype), *ins]))
        wants.append(want)
    for (dt, n, opts), got, want in zip(cases, run_programs(device, items), wants):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"sum {dt} n={n} opts={opts}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"max {dt} n={n} opts={opts}")

# (PoCL turns each kernel into machine code at its first launch, about half a second: the default run takes every
# row length in float32 and a few in the other dtypes; the slow test has them all)
FEW = [(dtypes.float32, n, opts) for n in ROW_LENGTHS for opts in (None, grouped(n, 16), grouped(n, 256))] + \
      [(dt, n, opts) for dt in (dtypes.float16, dtypes.int32)
       for n, opts in [(1, None), (255, grouped(255, 16)), (257, None), (4097, grouped(4097, 256))]]

def test_workgroup_reductions_cl():
    """Sum and max of rows of 1 to 4097 elements: the heuristic's kernel (grouped from 16 elements on), and groups of
    16 and 256 work-items padded where they don't divide the row, in float32, float16 and int32."""
    check_reductions("CL", Device["CL"].renderer, FEW)

@pytest.mark.slow
@pytest.mark.parametrize("dt", RED_DTYPES, ids=lambda d: d.name)
def test_workgroup_reductions_cl_every_case(dt: DType):
    check_reductions("CL", Device["CL"].renderer,
                     [(dt, n, opts) for n in ROW_LENGTHS for opts in (None, grouped(n, 16), grouped(n, 256))])

def test_workgroup_reductions_python_gpu():
    """The same kernels on the PYTHON device's work-group emulation (which checks barriers and races), short rows."""
    cases = [(dtypes.float32, 7, grouped(7, 4)), (dtypes.int32, 37, grouped(37, 8)),
             (dtypes.float16, 33, grouped(33, 8, OptOps.GROUPTOP)), (dtypes.float32, 40, None)]
    check_reductions("PYTHON", PythonRenderer(gpu=True), cases, rows=2)

def test_grouptop_takes_contiguous_chunks():
    """GROUPTOP: each work-item reduces a contiguous chunk of the row (GROUP: every G-th element); both right on CL."""
    ren = Device["CL"].renderer
    ast = row_reduce_ast(3, 256, dtypes.float32)
    top = get_program(ast, ren, opts=[Opt(OptOps.GROUPTOP, 1, 16)])
    plain = get_program(ast, ren, opts=[Opt(OptOps.GROUP, 1, 16)])
    assert uses_local_memory(top) and uses_local_memory(plain) and top.local_dims == plain.local_dims == (16,)
    assert top.src != plain.src
    ins, want = reduce_data(dtypes.float32, 3, 256)
    outs = [np.zeros(3, np.float32), np.zeros(3, np.float32)]
    for got in run_programs("CL", [(top, [*outs, *ins]), (plain, [*outs, *ins])]):
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

# *** matmul ***

def check_matmuls(device: str, ren: Renderer, shapes: list[tuple[int, int, int]]) -> None:
    items, refs = [], []
    for M, N, K in shapes:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        p = get_program(matmul_ast(M, N, K), ren)
        assert p.global_dims and p.local_dims, p.name   # a GPU-style kernel
        assert_within(p, ren)
        items.append((p, [np.zeros((M, N), np.float32), a, b]))
        refs.append(a.astype(np.float64) @ b.astype(np.float64))
    for (M, N, K), got, ref in zip(shapes, run_programs(device, items), refs):
        # float32 products summed in some order: within a few ulps of the sum of magnitudes
        np.testing.assert_allclose(got[0], ref, rtol=0, atol=1e-5 * math.sqrt(K) * 8, err_msg=f"{M}x{N}x{K}")

def test_matmul_cl():
    check_matmuls("CL", Device["CL"].renderer, [(1, 1, 1), (17, 33, 65), (1000, 1000, 1000), (1023, 1023, 1023)])

def test_matmul_python_gpu():
    check_matmuls("PYTHON", PythonRenderer(gpu=True), [(1, 1, 1), (17, 33, 65)])

# *** the device's limits ***

def small_renderer() -> Renderer:
    """The CL device's renderer as it would be on a device with groups of at most 16 work-items, 8 along dimension 2,
    and 256 bytes of local memory."""
    ren = copy.copy(Device["CL"].renderer)
    ren.max_workgroup, ren.local_max, ren.local_bytes = 16, (16, 16, 8), 256
    return ren

LIMIT_ASTS = {"reduce_4097": row_reduce_ast(3, 4097, dtypes.float32),
              "reduce_255_half": row_reduce_ast(5, 255, dtypes.float16),
              "matmul_17x33x65": matmul_ast(17, 33, 65), "transpose_7x9x11": transpose3_ast(7, 9, 11)}

def test_heuristic_respects_small_limits():
    """The heuristic's kernels fit the small device (where the CL device's own renderer gives bigger groups), and
    compute the same on CL."""
    small, big = small_renderer(), Device["CL"].renderer
    assert max(math.prod(get_program(ast, big).local_dims) for ast in LIMIT_ASTS.values()) > 16
    items = []
    for ast in LIMIT_ASTS.values():
        p = get_program(ast, small)
        assert_within(p, small)
        items.append(p)
    assert any(uses_local_memory(p) for p in items)
    check_same_results(items)

def check_same_results(progs: list[ProgramSpec]) -> None:
    """Each program computes what the unoptimized kernel of its AST does, on CL."""
    items = []
    for p in progs:
        assert p.ast is not None
        sizes = sorted(((u.arg, u.dtype) for u in p.ast.toposort() if u.op is Ops.DEFINE_GLOBAL), key=lambda x: x[0])
        arrays = [np.zeros(dt.size, to_np_dtype(dt.base)) if i == 0 else
                  rng.standard_normal(dt.size).astype(to_np_dtype(dt.base)) for i, dt in sizes]
        items += [(p, arrays), (get_program(p.ast, Device["CL"].renderer, opts=[]), arrays)]
    outs = run_programs("CL", items)
    for p, got, want in zip(progs, outs[::2], outs[1::2]):
        tol = 1e-2 if got[0].dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got[0].astype(np.float64), want[0].astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=f"{p.name} {p.applied_opts}")

def test_beam_candidates_respect_small_limits():
    """Every candidate BEAM's actions make from the heuristic's kernel and from the unoptimized one fits the small
    device (a sample of them extended once more too); work-item opts beyond its limits are refused, not made."""
    small = small_renderer()
    made = 0
    for ast in LIMIT_ASTS.values():
        frontier: list[tuple[Opt, ...]] = [(), tuple(get_program(ast, small).applied_opts)]
        for depth in range(2):
            nxt = []
            for opts in frontier:
                k = Kernel(ast, small)
                for o in opts: k.apply_opt(o)
                for act in search.candidate_actions(k):
                    try: p = get_program(ast, small, opts=[*opts, act])
                    except KernelOptError: continue
                    assert_within(p, small)
                    made += 1
                    nxt.append((*opts, act))
            frontier = nxt[::max(1, len(nxt) // 3)]
    assert made > 40, made
    ast = LIMIT_ASTS["reduce_4097"]
    for opts in ([Opt(OptOps.PADTO, 1, 32), Opt(OptOps.GROUP, 1, 32)],
                 [Opt(OptOps.PADTO, 1, 8), Opt(OptOps.GROUP, 1, 8), Opt(OptOps.LOCAL, 0, 3)],
                 # 16 work-items x 4 rows x 2 reductions x 4 bytes of partial results: 512 bytes of local memory
                 [Opt(OptOps.PADTO, 1, 16), Opt(OptOps.GROUP, 1, 16), Opt(OptOps.PADTO, 0, 4),
                  Opt(OptOps.UPCAST, 0, 4)]):
        with pytest.raises(KernelOptError): get_program(ast, small, opts=opts)
        get_program(ast, Device["CL"].renderer, opts=opts)   # (the CL device's own limits take them)

def test_beam_search_on_a_small_device(monkeypatch, tmp_path):
    """A real BEAM search on CL with the small device's limits: every kernel it renders fits them, and the kernel it
    chooses computes the same as the unoptimized one."""
    small = small_renderer()
    monkeypatch.setattr(Device["CL"], "renderer", small)
    rendered: list[ProgramSpec] = []
    def recording(ast: UOp, ren: Renderer, *args, **kwargs) -> ProgramSpec:
        p = get_program(ast, ren, *args, **kwargs)
        rendered.append(p)
        return p
    monkeypatch.setattr(search, "get_program", recording)
    ast = LIMIT_ASTS["reduce_4097"]
    with Context(BEAM_ROUNDS=2):
        opts = search.beam_search(ast, "CL", 2, CompiledRunner, timeout_s=3.0)
    assert len(rendered) > 5
    for p in rendered: assert_within(p, small)
    monkeypatch.undo()
    check_same_results([get_program(ast, small, opts=opts)])

# *** launch dimensions ***

@pytest.mark.parametrize("opts,local_dims", [
    ([Opt(OptOps.LOCAL, 2, 11), Opt(OptOps.LOCAL, 1, 3)], (11, 3)),
    ([Opt(OptOps.LOCAL, 2, 11), Opt(OptOps.LOCAL, 1, 3), Opt(OptOps.LOCAL, 0, 7)], (11, 3, 7))], ids=["2d", "3d"])
def test_local_on_several_output_loops(opts: list[Opt], local_dims: tuple[int, ...]):
    """LOCAL on two and three output loops: a work-group spans them, the innermost loop launch dimension 0."""
    ast = transpose3_ast(7, 9, 11)
    p = get_program(ast, Device["CL"].renderer, opts=opts)
    assert p.local_dims == local_dims
    assert math.prod(p.global_dims) * math.prod(p.local_dims) == 7 * 9 * 11
    x = rng.standard_normal((11, 9, 7)).astype(np.float32)
    got = run_programs("CL", [(p, [np.zeros((7, 9, 11), np.float32), x])])[0][0]
    np.testing.assert_array_equal(got, x.transpose(2, 1, 0) * np.float32(2) + np.float32(1))

def realize_kernels(*ts: Tensor) -> list[ProgramSpec]:
    """Run the schedule of `ts`; its kernels' programs."""
    sched, var_vals = ts[0].schedule_with_vars(*ts[1:])
    progs = []
    for ei in sched:
        ei = ei.lower()
        ei.run(var_vals)
        if isinstance(ei.prg, CompiledRunner): progs.append(ei.prg.p)
    return progs

def test_more_than_three_output_loops():
    """A permute of a rank-5 tensor (five output loops no address merges) launches on at most three dimensions, the
    outer loops merged into one and recovered by division and modulo."""
    x = rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    t = Tensor(x, device="CL").permute(4, 2, 0, 3, 1) * 3 - 1
    (p,) = realize_kernels(t)
    assert 1 <= len(p.global_dims) <= 3 and math.prod(p.global_dims) * math.prod(p.local_dims) >= x.size
    assert sum(u.op is Ops.SPECIAL for u in p.uops) <= 6
    np.testing.assert_array_equal(t.numpy(), x.transpose(4, 2, 0, 3, 1) * np.float32(3) - np.float32(1))

def test_variables_as_kernel_arguments():
    """A bound Variable's shrink on CL: the kernel takes the Variable as an argument, its grid depends on it, and one
    compiled kernel serves every value."""
    x = rng.standard_normal((40, 300)).astype(np.float32)
    t = Tensor(x, device="CL").realize()
    n = Variable("n", 1, 40)
    srcs = set()
    for v in (40, 13, 1):
        out = (t[:n.bind(v)] * 2 + 1).sum(1)
        progs = realize_kernels(out)
        assert any(p.vars for p in progs), [p.name for p in progs]
        srcs |= {p.src for p in progs}
        got = out.numpy()
        assert got.shape == (v,)
        np.testing.assert_allclose(got, (x[:v] * 2 + 1).sum(1), rtol=1e-5, atol=1e-4, err_msg=f"n={v}")
    assert len(srcs) == 1, len(srcs)
    (p,) = [p for p in progs]
    assert p.global_dims and p.local_dims

def test_tinyjit_on_cl():
    """A jitted layer with a softmax on CL: the captured kernels are GPU-style, replays give the right values."""
    w = rng.standard_normal((24, 10)).astype(np.float32)
    tw = Tensor(w, device="CL").realize()
    @TinyJit
    def f(x: Tensor) -> Tensor: return (x @ tw).softmax(-1).realize()
    for i in range(4):
        x = rng.standard_normal((8, 24)).astype(np.float32)
        got = f(Tensor(x, device="CL")).numpy()
        z = x.astype(np.float64) @ w
        e = np.exp(z - z.max(-1, keepdims=True))
        np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6, err_msg=f"call {i}")
    kernels = [ei.prg.p for ei in f.captured if isinstance(ei.prg, CompiledRunner)]
    assert kernels and all(p.global_dims and p.local_dims for p in kernels)

def test_sharding_over_two_cl_devices():
    """A matmul sharded by rows over CL and CL:1 (PoCL's CPU device listed twice), with a sum across the shards."""
    code = """
import numpy as np
from fusegrad import Tensor
rng = np.random.default_rng(1)
x, w = rng.standard_normal((10, 16)).astype(np.float32), rng.standard_normal((16, 6)).astype(np.float32)
devs = ("CL", "CL:1")
tx, tw = Tensor(x).shard(devs, axis=0), Tensor(w).shard(devs)
y = (tx @ tw).relu()
s = y.sum(0)
ref = np.maximum(x.astype(np.float64) @ w, 0)
np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(s.numpy(), ref.sum(0), rtol=1e-5, atol=1e-4)
print("OK", sorted(y.device) if isinstance(y.device, tuple) else y.device)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "POCL_DEVICES": "pthread pthread"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "OK" and "CL:1" in res.stdout

def test_beam_on_cl(tmp_path, monkeypatch):
    """BEAM=2 on a small CL kernel: a search runs, and the result is right."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x = rng.standard_normal((5, 700)).astype(np.float32)
    before = search.beam_stats["searches"] + search.beam_stats["cache_hits"]
    with Context(BEAM=2, BEAM_TIMEOUT_S=3.0, BEAM_ROUNDS=2):
        got = (Tensor(x, device="CL").exp() * 0.5).sum(1).numpy()
    assert search.beam_stats["searches"] + search.beam_stats["cache_hits"] > before
    np.testing.assert_allclose(got, (np.exp(x.astype(np.float64)) * 0.5).sum(1), rtol=1e-5)

def test_grouped_reduction_with_vector_lanes():
    """GROUP, then UPCAST of an output loop (a matmul with few outputs and a long reduction, as a convolution's weight
    gradient): the vector accumulators' lanes go to local memory each to its own slot, behind one barrier."""
    check_matmuls("CL", Device["CL"].renderer, [(4, 16, 1024)])

def test_group_of_one_of_nested_reduce_loops_of_the_same_size():
    """A mean over two nested loops of 16 (channels' means of NCHW) grouped along either loop: the other loop of the
    same reduction is not given the same work-item ids (a softmax's two sequential reductions are), against NumPy."""
    xs = rng.random(8 * 4 * 16 * 16).astype(np.float32)
    ast = [si.ast for si in Tensor(xs.reshape(8, 4, 16, 16)).mean((0, 2, 3)).schedule() if si.ast.op is Ops.SINK][-1]
    ren = PythonRenderer(gpu=True)
    want = xs.reshape(8, 4, 16, 16).mean((0, 2, 3))
    for axis in (1, 2, 3):
        p = get_program(ast, ren, opts=[Opt(OptOps.GROUP, axis, 4), Opt(OptOps.LOCAL, 0, 4)])
        got = run_programs("PYTHON", [(p, [np.zeros(4, np.float32), xs])])[0][0]
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"GROUP of axis {axis}")

def test_batchnorm_statistics_on_cl():
    """BatchNorm2d's training output on CL against NumPy: its variance kernel holds two reductions over loops of the
    same sizes (8, 32, 32), and a group shares one loop of the other reduction, not both of its 32s."""
    xs = rng.random((8, 16, 32, 32)).astype(np.float32)
    bn = nn.BatchNorm2d(16)
    for t in nn.state.get_state_dict(bn).values(): t.replace(t.to("CL")).realize()
    Tensor.training = True
    try: got = bn(Tensor(xs, device="CL")).numpy()
    finally: Tensor.training = False
    mean, var = xs.mean((0, 2, 3), keepdims=True), xs.var((0, 2, 3), keepdims=True)
    np.testing.assert_allclose(got, (xs - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-4)

def test_rows_reduced_by_groups_on_cl():
    """Softmax, layernorm and a sum over many long rows (more outputs than FEW_OUTPUTS): each row is reduced by a
    group of work-items reading its neighbouring elements together (GROUP), not one work-item per row, on CL against
    torch; so is a vector times a matrix stored by rows; a matmul with as many outputs keeps its register tiles (its
    loads are shared between outputs)."""
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((4100, 300)).astype(np.float32)
    w, b = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    xt, wt, bt = (Tensor(a, device="CL") for a in (x, w, b))
    tx = torch.from_numpy(x)
    cases = [(xt.softmax(-1), torch.softmax(tx, -1)), (xt.layernorm(-1) * wt + bt,
             torch.nn.functional.layer_norm(tx, (300,), torch.from_numpy(w), torch.from_numpy(b))),
             (xt.sum(-1), tx.sum(-1))]
    for t, want in cases:
        (p,) = realize_kernels(t)
        assert any(o.op is OptOps.GROUP for o in p.applied_opts), p.applied_opts
        np.testing.assert_allclose(t.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    # a vector times a matrix stored by rows (a Linear's weight, (out, in)): every row read by a group
    v, m = rng.standard_normal((1, 300)).astype(np.float32), rng.standard_normal((5000, 300)).astype(np.float32)
    mv = Tensor(v, device="CL") @ Tensor(m, device="CL").T
    (p,) = realize_kernels(mv)
    assert any(o.op is OptOps.GROUP for o in p.applied_opts), p.applied_opts
    np.testing.assert_allclose(mv.numpy(), v @ m.T, rtol=1e-4, atol=1e-4)
    mm = xt[:, :256] @ Tensor(rng.standard_normal((256, 64)).astype(np.float32), device="CL")
    (p,) = realize_kernels(mm)
    assert not any(o.op is OptOps.GROUP for o in p.applied_opts), p.applied_opts

def test_strided_half_convolution_on_a_gpu():
    """A strided half convolution on a GPU-style device reads its weights in place (no copy with the output channels
    innermost, a CPU's vectorization, whose half values the scheduler would keep converted to float32): one kernel,
    which the CUDA renderer lays out on tensor cores; on CL against torch."""
    torch = pytest.importorskip("torch")
    from fusegrad.renderer.cuda import CUDARenderer
    x = rng.standard_normal((16, 16, 16, 16)).astype(np.float16)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.2).astype(np.float16)
    t = Tensor(x, device="CL").conv2d(Tensor(w, device="CL"), stride=2, padding=1)
    asts = [si.ast for si in t.schedule() if si.ast.op is Ops.SINK]
    assert len(asts) == 1
    assert any(u.op is Ops.WMMA for u in get_program(asts[0], CUDARenderer("sm_90")).uops)
    t = Tensor(x, device="CL").conv2d(Tensor(w, device="CL"), stride=2, padding=1)
    want = torch.nn.functional.conv2d(torch.from_numpy(x).float(), torch.from_numpy(w).float(), stride=2, padding=1)
    np.testing.assert_allclose(t.numpy().astype(np.float32), want.numpy(), rtol=2e-3, atol=2e-3)
