"""Regression tests for kernels the CPU got wrong: three that gcc 12.2 miscompiled at -O3 -march=native (valid C,
wrong machine code; the renderer now works around them in `ClangRenderer.prelude`) and loads that ran out of bounds
when the loop around them ran zero times.

These run through the real CPU device (its compiler flags, -O3), against numpy/torch, and against the PYTHON device,
which interprets the same UOps with bounds-checked memory."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.device import Buffer, Device
from fusegrad.dtype import from_np_dtype
from fusegrad.engine.realize import CompiledRunner
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import glob, reduce, rng

def on(dev: str, fn, *arrays: np.ndarray) -> np.ndarray:
    return fn(*[Tensor(a, device=dev) for a in arrays]).numpy()

# *** 1. float32 -> float16 -> float32 rounds ***
# gcc vectorizes the conversions with AVX512-FP16 (SLP of the scalar code, or of the lanes the renderer writes out for
# a dtype it has no vectors of) and then folds the pair of vector conversions away: half(1e5) stayed 1e5 instead of inf

def test_half_cast_then_reciprocal_against_torch():
    x = np.full((16, 16), 1e5, np.float32)
    x[0, :6] = [1.0, 3.0, 2049.0, 65519.0, 65520.0, 1e-8]
    want = torch.from_numpy(x).half().reciprocal().numpy()
    np.testing.assert_array_equal(on("CPU", lambda t: t.cast(dtypes.float16).reciprocal(), x), want)

@pytest.mark.parametrize("shape", [(64, 8), (64, 16), (16, 16, 16), (3, 40)])
def test_half_round_trip(shape: tuple[int, ...]):
    x = np.random.default_rng(1).uniform(-3000, 3000, shape).astype(np.float32)
    x.flat[:3] = [1e5, 2049.0, 1 / 3]
    want = torch.from_numpy(x).half().float().numpy()
    np.testing.assert_array_equal(on("CPU", lambda t: t.cast(dtypes.float16).cast(dtypes.float32), x), want)

def test_half_round_trip_in_vectorized_reductions():
    # the reduction is vectorized along its axis; the half cast is written out lane by lane
    x = np.random.default_rng(2).uniform(-3, 3, (64, 64))
    x[:, 0] = 1 / 3
    x32 = x.astype(np.float32)
    x16 = torch.from_numpy(x32).half()
    got = on("CPU", lambda t: t.cast(dtypes.float16).cast(dtypes.float32).sum(1), x32)
    np.testing.assert_allclose(got, x16.float().sum(1).numpy(), rtol=1e-6)
    got = on("CPU", lambda t: t.cast(dtypes.float16).cast(dtypes.float64).sum(1), x)
    # numpy rounds float64 to float16 directly (torch goes through float32: twice rounded)
    np.testing.assert_allclose(got, x.astype(np.float16).astype(np.float64).sum(1), rtol=1e-12)
    got = on("CPU", lambda t, u: (t.cast(dtypes.float16).cast(dtypes.float32) * u).sum(0), x32, x32)
    np.testing.assert_allclose(got, (x16.float() * torch.from_numpy(x32)).sum(0).numpy(), rtol=1e-5)

# *** 2. a padded (gated) load reads its element ***
# gcc's loop vectorizer gave every vector copy of a masked load the first copy's mask: the fuzzer's seed 507

PADS = [((0, 0), (3, -1), (3, 2), (-1, 0)), ((1, 0), (2, 0), (0, 3), (0, 0)), ((0, 0), (1, 1), (2, 2), (1, 1)),
        ((2, -1), (0, 1), (-1, 3), (0, 2))]

@pytest.mark.parametrize("pad", PADS, ids=str)
def test_padded_expand(pad):
    x = np.arange(48, dtype=np.float32).reshape(6, 2, 4) + 1
    fn = lambda t: t.reshape(6, 2, 4, 1).expand(6, 2, 4, 5).pad(pad, value=-1.0)
    big = np.broadcast_to(x.reshape(6, 2, 4, 1), (6, 2, 4, 5))
    want = np.pad(big, [(max(a, 0), max(b, 0)) for a, b in pad], constant_values=-1.0)
    want = want[tuple(slice(-min(a, 0), want.shape[i] + min(b, 0)) for i, (a, b) in enumerate(pad))]
    np.testing.assert_array_equal(on("CPU", fn, x), want)
    np.testing.assert_array_equal(on("PYTHON", fn, x), want)

# *** 3. a float sum adds in the order of its loops ***
# gcc's loop vectorizer made an in-order float reduction of loads from a strided axis add them in memory order

def sequential_sum(a: np.ndarray) -> np.float32:
    acc = np.float32(0)
    for v in a.ravel(): acc = np.float32(acc + v)
    return acc

@pytest.mark.parametrize("shape,perm", [((3, 4, 1, 2), (0, 3, 2, 1)), ((2, 3, 5), (2, 1, 0)), ((5, 3, 2), (1, 2, 0)),
                                        ((3, 2, 2, 3), (3, 0, 2, 1))], ids=str)
def test_strided_sum_in_loop_order(shape, perm):
    # small odd sizes: one scalar accumulator, loops in the order of the permuted tensor's elements
    x = np.random.default_rng(3).uniform(-2, 2, shape).astype(np.float32)
    x.flat[::3] *= 1e4   # magnitudes far apart, so the order of the additions shows in the result
    fn = lambda t: t.permute(*perm).sum()
    want = sequential_sum(x.transpose(perm))
    # the C code adds in exactly the order the UOps say (the interpreter's order); how many accumulators the
    # optimizer keeps depends on the machine's vector width, so against the sequential sum only closeness holds
    assert on("CPU", fn, x) == on("PYTHON", fn, x)
    np.testing.assert_allclose(on("CPU", fn, x), want, rtol=1e-5)

# *** 4. no loads out of bounds when a loop runs zero times ***

@pytest.mark.parametrize("dev", ["CPU", "PYTHON"])
def test_empty_reductions(dev: str):
    # the PYTHON device raises on any access out of a buffer's bounds
    e = np.zeros(0, np.float32)
    assert on(dev, lambda t: t.sum(), e) == 0
    assert on(dev, lambda t: t.prod(), e) == 1
    np.testing.assert_array_equal(on(dev, lambda t: t.sum(1), np.zeros((4, 0), np.float32)), np.zeros(4))
    np.testing.assert_array_equal(on(dev, lambda t: t.reshape(0, 32).sum(0), e), np.zeros(32))
    assert on(dev, lambda t: t.cast(dtypes.int32).sum(), np.zeros(0, np.int32)) == 0

def test_empty_loop_is_not_upcast():
    r = rng(0, 0, "reduce")
    ast = UOp.sink_of(glob(0, dtypes.float32, 1).index(UOp.const(dtypes.index, 0)).store(
        reduce(glob(1, dtypes.float32, 0).index(r).load(), r)))
    for amt in (16, 4, 0):
        with pytest.raises(KernelOptError): Kernel(ast).apply_opt(Opt(OptOps.UPCAST, 0, amt))
    p = get_program(ast, Device["CPU"].renderer)
    assert p.applied_opts == () and not any(u.op is Ops.LOAD and u.dtype.count > 1 for u in p.uops)

def test_load_not_hoisted_out_of_empty_loop():
    # out = sum_{r < n} a[n-1] * b[r]: a[n-1] doesn't vary in the loop, but with n = 0 it is a[-1]
    n = UOp.variable("n", 0, 8)
    r = rng(n, 0, "reduce")
    a, b = glob(1, dtypes.float32, 8), glob(2, dtypes.float32, 8)
    val = reduce(a.index(n - 1).load() * b.index(r).load(), r)
    ast = UOp.sink_of(glob(0, dtypes.float32, 1).index(UOp.const(dtypes.index, 0)).store(val))
    for dev in ("CPU", "PYTHON"):
        p = get_program(ast, Device[dev].renderer)
        for nv in (0, 1, 5):
            arrs = [np.full(1, 7, np.float32), np.arange(8, dtype=np.float32) + 1, np.arange(8, dtype=np.float32)]
            bufs = [Buffer(dev, x.size, from_np_dtype(x.dtype)).copyin(memoryview(x)) for x in arrs]
            CompiledRunner(p)(bufs, {"n": nv})
            assert bufs[0].numpy()[0] == nv * sum(range(nv)), (dev, nv)

# *** 5. a select on the loop indices ***
# at -O2 with the dynamic cost model gcc's loop vectorizer left elements of such a kernel's output unwritten (valid
# C; right at -O3 and with -fno-tree-loop-vectorize): fuzz_torch seeds 523 (the rows stacked with themselves) and
# 6103 (a setitem alone)

@pytest.mark.parametrize("rows", [5, 6, 8])
def test_stack_of_rows_replaced_by_setitem(rows: int):
    a = np.arange(1, 4 * rows + 1, dtype=np.float32).reshape(rows, 4, 1)
    v = Tensor(a).flip(1) * 1.0
    v[0:1] = 1.0
    vt = torch.from_numpy(a).flip(1) * 1.0
    vt[0:1] = 1.0
    np.testing.assert_array_equal(Tensor.stack(v, v, dim=3).numpy(), torch.stack([vt, vt], dim=3).numpy())

@pytest.mark.parametrize("dt", [np.float32, np.float64, np.int16, np.int32, np.int64])
def test_setitem_of_a_block(dt):
    # (the integer and double kernels were miscompiled the same way: an int32 block left elements 10 and 11 at 0)
    a = np.arange(1, 37).astype(dt).reshape(2, 9, 2)
    v = Tensor(a) * 1
    v[0:1, 1:2, :] = 7
    vt = torch.from_numpy(a) * 1
    vt[0:1, 1:2, :] = 7
    np.testing.assert_array_equal(v.numpy(), vt.numpy())

# *** which kernels get the workarounds ***

def test_workarounds_only_where_needed():
    from test.codegen.helpers import RENDERER, matmul_ast
    src = lambda ast, opts=None: get_program(ast, RENDERER, opts=opts).src
    r0, r1 = rng(64, 0), rng(32, 1, "reduce")
    a = glob(1, dtypes.float32, 64 * 32)
    def row_sum(val): return UOp.sink_of(glob(0, dtypes.float32, 64).index(r0).store(reduce(val, r1)))
    # matmul and elementwise kernels keep the whole of -O3 (48 rows: a whole number of register tiles on AVX2 and
    # AVX-512; padded rows are gated accesses)
    assert "#pragma" not in src(matmul_ast(48, 64, 64))
    assert "#pragma" not in src(UOp.sink_of(glob(0, dtypes.float32, 64).index(r0).store(a.index(r0).load() * 2.0)))
    # one float addition per iteration of one loop: gcc keeps the order
    assert "#pragma" not in src(row_sum(a.index(r0 * 32 + r1).load()), opts=[])
    # a chain of additions per iteration (unrolled): no loop vectorizer
    assert "no-tree-loop-vectorize" in src(row_sum(a.index(r0 * 32 + r1).load()), opts=[Opt(OptOps.UNROLL, 1, 4)])
    # a padded load: no loop vectorizer
    valid = r0 < 60
    assert "no-tree-loop-vectorize" in src(UOp.sink_of(glob(0, dtypes.float32, 64).index(r0).store(
        a.index(r0, valid=valid).load())))
    # half: no AVX512-FP16
    h = glob(1, dtypes.float16, 64)
    assert "no-avx512fp16" in src(UOp.sink_of(glob(0, dtypes.float32, 64).index(r0).store(
        h.index(r0).load().cast(dtypes.float32))))
