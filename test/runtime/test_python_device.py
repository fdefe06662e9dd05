"""The PYTHON device: its scalar semantics against independent references (Python integers, exact rationals, numpy,
torch, published test vectors), and Tensor programs and hand-built kernels cross-checked against the CPU device.

Cross-checks compare bits: integers and bools exactly, floats bit for bit (nan only by position, -0.0 != 0.0). The
tolerances: 1 ulp where a kernel calls a float32 transcendental function (exp2, log2, sin, pow): the CPU calls the C
library's float versions (glibc's exp2f/log2f/sinf/powf are within 1 ulp, not correctly rounded), the PYTHON device
rounds the double-precision result, which is correctly rounded (test_transcendentals_round_correctly). A softmax
passes a 1-ulp difference of one exp through a sum and a division, so it may differ by 2; random programs calling
transcendental functions may amplify it further (cancellation), so they are compared with a relative tolerance.

Kernels that gcc 12 miscompiled before the renderer worked around it are checked on both devices against references."""
from __future__ import annotations
import math
import os
import re
import subprocess
import sys
from fractions import Fraction
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.device import Buffer, Device
from fusegrad.dtype import DType, from_np_dtype, to_np_dtype
from fusegrad.engine.realize import CompiledRunner
from fusegrad.helpers import Context
from fusegrad.renderer.python import PythonRenderer, parse_listing
from fusegrad.runtime.ops_python import (PythonProgram, bf16_bits_to_float, f32_to_bf16_bits, fma_f32, fma_f64,
                                         int_to_float, round_f32, threefry)
from fusegrad.uop.ops import Ops, UOp

INTS = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32, dtypes.int64,
        dtypes.uint64]
FLOATS = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]
ALL = [dtypes.bool] + INTS + FLOATS
SPECIAL = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1e-40, -3e-39, 3.3e38, 65504.0, 7e4, 0.5, -2.5,
           1e-8, 2.0 ** -24, 1.5, -1.5, 2.5, 1e30]

# *** helpers ***

def data(dt: DType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random values of `dt` (bfloat16: float32 values, cast on the device) with the extremes and special values
    at the front: integer min/max/0/-1, and for floats zeros, infinities, nan, subnormals, overflow of half."""
    r = np.random.default_rng(seed)
    if dt == dtypes.bool: return r.integers(0, 2, shape).astype(bool)
    if dtypes.is_int(dt):
        info = np.iinfo(to_np_dtype(dt))
        x = r.integers(info.min, info.max, shape, dtype=to_np_dtype(dt), endpoint=True)
        specials = [info.min, info.max, 0, 1, 2, 3, 7] + ([-1, -2, -3, -7] if info.min < 0 else [])
        x.flat[:len(specials)] = np.array(r.permutation(np.array(specials, dtype=object)), dtype=x.dtype)
        return x
    x = (r.standard_normal(shape) * 8).astype(np.float64 if dt == dtypes.float64 else np.float32)
    x.flat[:len(SPECIAL)] = r.permutation(SPECIAL)
    with np.errstate(over="ignore"): return x.astype(np.float16) if dt == dtypes.float16 else x

def f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"): return x.astype(np.float16)

def tame(x: np.ndarray, fill: float = 1.0) -> np.ndarray:
    """x with the special values (non-finite and huge) replaced: sums and products of them say little."""
    x = x.copy()
    x[~(np.abs(x.astype(np.float64)) < 1e4)] = fill
    return x

def tensor(a: np.ndarray, dt: DType, device: str) -> Tensor:
    t = Tensor(a, device=device)
    return t.cast(dt) if dt == dtypes.bfloat16 else t

def on_both(fn, *arrays: np.ndarray, dt: DType | None = None) -> list[np.ndarray]:
    """[fn on CPU, fn on PYTHON] of Tensors made from `arrays` (cast to `dt` on the device when it is bfloat16)."""
    outs = []
    for dev in ("CPU", "PYTHON"):
        ts = [tensor(a, dt, dev) if dt is not None else Tensor(a, device=dev) for a in arrays]
        out = fn(*ts)
        assert out.device == dev
        outs.append(out.numpy())
    return outs

def ordered(x: np.ndarray) -> np.ndarray:
    """Float bits as integers in the order of the values (-0.0 is one step below 0.0): differences count ulps."""
    bits = x.view({2: np.int16, 4: np.int32, 8: np.int64}[x.itemsize]).astype(np.int64)
    return np.where(bits < 0, -(bits & ((1 << (8 * x.itemsize - 1)) - 1)) - 1, bits)

def assert_same(cpu: np.ndarray, py: np.ndarray, ulps: int = 0, what: str = "") -> None:
    assert cpu.shape == py.shape and cpu.dtype == py.dtype, (cpu.shape, py.shape, cpu.dtype, py.dtype)
    if cpu.dtype.kind != "f":
        np.testing.assert_array_equal(cpu, py, err_msg=what)
        return
    nan_c, nan_p = np.isnan(cpu), np.isnan(py)
    assert (nan_c == nan_p).all(), f"{what}: nan at different places: cpu {np.argwhere(nan_c != nan_p)[:5]}"
    d = np.abs(ordered(cpu[~nan_c]) - ordered(py[~nan_c]))
    if d.size and d.max() > ulps:
        k = int(np.argmax(d))
        raise AssertionError(f"{what}: {int((d > ulps).sum())} values differ by up to {d.max()} ulps, e.g. "
                             f"cpu {cpu[~nan_c][k]!r} vs python {py[~nan_c][k]!r}")

def cross_check(fn, *arrays: np.ndarray, dt: DType | None = None, ulps: int = 0) -> np.ndarray:
    cpu, py = on_both(fn, *arrays, dt=dt)
    assert_same(cpu, py, ulps, what=f"{dt}")
    return py

# *** Tensor programs, CPU vs PYTHON ***

def _arith(dt: DType):
    if dt == dtypes.bool:
        return lambda a, b: Tensor.stack(a & b, a | b, a ^ b, a + b, a * b, a.maximum(b), a.logical_not(),
                                         (a < b).where(a, b))
    if dtypes.is_int(dt):
        return lambda a, b: Tensor.stack(a + b, a - b, a * b, a.div(b, rounding_mode="trunc"), a // b, a % b,
                                         a.maximum(b), a.minimum(b), -a, a.abs(), a & b, a | b, a ^ b, a << 3,
                                         a >> 2, a << (b & 63), a >> (b & 63), a * 3 + 7, (a < b).where(a, b))
    return lambda a, b: Tensor.stack(a + b, a - b, a * b, a / b, a.maximum(b), a.minimum(b), -a, a.abs(), a.sqrt(),
                                     a.reciprocal(), a.trunc(), a.floor(), a.ceil(), a % b, a * b + a,
                                     a.clip(-1.0, 1.0), (a < b).where(a, b), a * 0.1 - 3.0)

def _compare(a: Tensor, b: Tensor) -> Tensor:
    return Tensor.stack(a < b, a == b, a != b, a >= b, a.bool(), *((a.isnan(), a.isinf())
                        if dtypes.is_float(a.dtype) else ()))

@pytest.mark.parametrize("dt", ALL, ids=str)
def test_elementwise(dt: DType):
    a, b = data(dt, (5, 24), 1), data(dt, (5, 24), 2)
    cross_check(_arith(dt), a, b, dt=dt)
    cross_check(_compare, a, b, dt=dt)

@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_transcendentals(dt: DType):
    a, b = data(dt, (4, 40), 3), data(dt, (4, 40), 4)
    fn = lambda x, y: Tensor.stack(x.exp2(), x.log2(), x.sin(), x.exp(), x.log(), x.cos(), x.abs() ** y)
    cross_check(fn, a, b, dt=dt, ulps=0 if dt == dtypes.float64 else 1)

def test_transcendentals_round_correctly():
    # with the math library (TRANSCENDENTAL=0: no polynomials), the PYTHON device's float32 exp2/log2/sin are the
    # correctly rounded values (float64 numpy, rounded)
    x = np.random.default_rng(5).standard_normal(2000).astype(np.float32) * 30
    x64 = x.astype(np.float64)
    with Context(TRANSCENDENTAL=0):
        t = Tensor(x, device="PYTHON")
        for got, want in [(t.exp2(), np.exp2(x64)), (t.abs().log2(), np.log2(np.abs(x64))), (t.sin(), np.sin(x64))]:
            np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))

@pytest.mark.parametrize("src", ALL, ids=str)
def test_casts(src: DType):
    # every conversion, widened back losslessly (floats to float64, integers to int64 bits) to stack them. Floats
    # going to integers are made finite and in range first: C leaves other conversions undefined
    a = data(src, (3, 16), 6)
    def fn(x: Tensor) -> Tensor:
        fl = Tensor.stack(*[x.cast(d).cast(dtypes.float64) for d in FLOATS])
        if dtypes.is_float(src):
            fin = (x.isnan() | x.isinf()).where(0.0, x).clip(-100.0, 100.0)
            ints = [(fin.abs() if dtypes.is_unsigned(d) else fin).cast(d).cast(dtypes.int64) for d in INTS]
        else: ints = [x.cast(d).cast(dtypes.int64) for d in INTS]
        return Tensor.stack(*ints, x.cast(dtypes.bool).cast(dtypes.int64)), fl
    outs = [[o.numpy() for o in fn(tensor(a, src, dev))] for dev in ("CPU", "PYTHON")]
    for cpu, py in zip(*outs): assert_same(cpu, py, what=f"casts from {src}")

def test_int_to_float_rounding():
    # large integers don't fit a float's significand: each conversion rounds once, to nearest even
    v = np.array([2**53 + 1, 2**63 - 1, -(2**62) - 2**38 - 1, 16777217, -16777219, 2**24 + 2**23 + 1] * 4, np.int64)
    u = np.array([2**64 - 1, 2**63 + 2**39 + 1, 2**32 + 1, 18446744073709549568] * 6, np.uint64)
    for arr in (v, u):
        py = cross_check(lambda x: Tensor.stack(x.cast(dtypes.float32).cast(dtypes.float64), x.cast(dtypes.float64)),
                         arr)
        np.testing.assert_array_equal(py[0], arr.astype(np.float32).astype(np.float64))
        np.testing.assert_array_equal(py[1], arr.astype(np.float64))

@pytest.mark.parametrize("dt", [dtypes.int8, dtypes.int32, dtypes.int64, dtypes.uint32])
def test_c_integer_division(dt: DType):
    info = np.iinfo(to_np_dtype(dt))
    avals = [info.min, info.min + 1, -7, -1, 0, 5, 7, info.max] if info.min < 0 else [0, 1, 5, 7, info.max]
    bvals = [-3, -1, 0, 2, 7, info.min] if info.min < 0 else [0, 1, 2, 7, info.max]
    a = np.array([x for x in avals for _ in bvals], to_np_dtype(dt))
    b = np.array([y for _ in avals for y in bvals], to_np_dtype(dt))
    py = cross_check(lambda x, y: Tensor.stack(x.div(y, rounding_mode="trunc"), x % y, x // y), a, b)
    def wrap(v: int) -> int: return (v - int(info.min)) % (1 << (8 * a.itemsize)) + int(info.min)
    for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        q = 0 if y == 0 else wrap(abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1))   # C: truncation
        assert py[0][k] == q, (x, y)
        if y != 0: assert (py[1][k], py[2][k]) == (wrap(x % y), wrap(x // y)), (x, y)   # Python: floor

def test_half_and_bfloat16_round_after_every_op():
    a, b = data(dtypes.float32, (6, 32), 7), data(dtypes.float32, (6, 32), 8)
    fn = lambda x, y: Tensor.stack(x * 1000 * y * 1000 - x * y + 3.3, (x - y) * (x + y))
    cross_check(fn, f16(a), f16(b))
    cross_check(fn, a, b, dt=dtypes.bfloat16)
    # against torch, which also rounds every half op's result
    x, y = f16(a), f16(b)
    want = ((torch.from_numpy(x) * 3 + 1) * torch.from_numpy(y)).float().numpy()
    np.testing.assert_array_equal(((Tensor(x, device="PYTHON") * 3 + 1) * Tensor(y, device="PYTHON")).float().numpy(),
                                  want)

def test_bfloat16_rounding_against_torch():
    x = np.random.default_rng(9).standard_normal(512).astype(np.float32) * 100
    x[:6] = [np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1.0000001]
    got = Tensor(x, device="PYTHON").cast(dtypes.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, torch.from_numpy(x).bfloat16().float().numpy())

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.int32, dtypes.float16, dtypes.uint8, dtypes.float64], ids=str)
def test_reductions(dt: DType):
    a = data(dt, (12, 40), 10)
    if dtypes.is_float(dt): a = tame(a, 1.25)   # finite sums, so their bits mean something
    sum_dt = dtypes.float32 if dt == dtypes.float16 else dt   # reduce of float16 sums in float
    fn = lambda x: Tensor.stack(x.sum(0).cast(sum_dt)[:12], x.sum(1).cast(sum_dt), x.max(1).cast(sum_dt))
    cross_check(fn, a)
    cross_check(lambda x: x.max(0).cast(sum_dt) + x.min(0).cast(sum_dt), a)

def test_max_propagates_nan():
    a = tame(data(dtypes.float32, (4, 32), 11), 0.0)
    a[1, 5] = a[2, 31] = np.nan
    py = cross_check(lambda x: Tensor.stack(x.max(1), x.min(1)), a)
    assert np.isnan(py[:, 1]).all() and np.isnan(py[:, 2]).all() and not np.isnan(py[:, [0, 3]]).any()

@pytest.mark.parametrize("shape", [(4, 4, 4), (33, 17, 9), (64, 64, 64), (8, 512, 32)])
def test_matmul(shape: tuple[int, int, int]):
    M, K, N = shape
    a, b = tame(data(dtypes.float32, (M, K), 12)), tame(data(dtypes.float32, (K, N), 13))
    np.testing.assert_allclose(cross_check(lambda x, y: x @ y, a, b), a @ b, rtol=1e-4, atol=1e-2)
    bt = b.T.copy()
    cross_check(lambda x, y: x @ y.T, a, bt)

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.float16, dtypes.float64, dtypes.bfloat16], ids=str)
def test_matmul_dtypes(dt: DType):
    a, b = data(dt, (12, 20), 14), data(dt, (20, 8), 15)
    if dtypes.is_int(dt): a, b = a % 1000, b % 1000
    else: a, b = tame(a, 2.0), tame(b, 2.0)
    cross_check(lambda x, y: x @ y, a, b, dt=dt)

def test_softmax():
    x = tame(data(dtypes.float32, (8, 50), 16), 3.0)
    py = cross_check(lambda t: Tensor.stack(t.softmax(1), t.log_softmax(1)), x, ulps=2)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(py[0], e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.float32, dtypes.int8], ids=str)
def test_movement(dt: DType):
    a = data(dt, (6, 10), 17)
    def fn(t: Tensor) -> Tensor:
        outs = [t.pad(((1, 2), (3, 0))).shrink(((0, 6), (0, 10))), t.flip(0), t.flip((0, 1)),
                t.pad(((1, 2), (3, 0)))[2:8, :10], t.T.contiguous().reshape(6, 10)]
        strided = t[::2, 1::3].pad(((0, 3), (0, 7))) + t[1::2, :0:-3].pad(((3, 0), (4, 3))).flip(1)
        return Tensor.stack(*outs, strided.reshape(6, 10))
    py = cross_check(fn, a)
    np.testing.assert_array_equal(py[1], a[::-1])
    np.testing.assert_array_equal(py[3], np.pad(a, ((1, 2), (3, 0)))[2:8, :10])
    cross_check(lambda t: t.pad(((2, 2), (5, 3))).sum(0) + t.flip(1)[:, 2:9].pad(((0, 0), (4, 7))).sum(0), a)

# *** hand-built kernels, CPU vs PYTHON ***

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)
def red(src: UOp, *rngs: UOp) -> UOp: return UOp(Ops.REDUCE, src.dtype, (src, *rngs), Ops.ADD)

def run_kernel(ast: UOp, arrays: list[np.ndarray], opts: list[Opt] | None = None,
               var_vals: dict | None = None) -> list[list[np.ndarray]]:
    """Run `ast` on CPU and on PYTHON (through CompiledRunner, as the engine does); the buffers after each run."""
    ret = []
    for dev in ("CPU", "PYTHON"):
        p = get_program(ast, Device[dev].renderer, opts=opts)
        if opts is not None: assert list(p.applied_opts) == opts
        bufs = [Buffer(dev, a.size, from_np_dtype(a.dtype)).copyin(memoryview(np.ascontiguousarray(a)))
                for a in arrays]
        CompiledRunner(p)(bufs, var_vals or {})
        ret.append([b.numpy() for b in bufs])
    return ret

def matmul_ast(M: int, N: int, K: int) -> UOp:
    r0, r1, r2 = UOp.range(M, 0), UOp.range(N, 1), UOp.range(K, 2, "reduce")
    acc = red(glob(1, dtypes.float32, M * K).index(r0 * K + r2).load() * glob(2, dtypes.float32, K * N).index(
        r2 * N + r1).load(), r2)
    return UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(acc))

# ALU ops the Tensor front end doesn't emit directly, one output buffer each: (op, is a float32 libm call)
FLOAT_OPS = [(Ops.IDIV, False), (Ops.MOD, False), (Ops.MAX, False), (Ops.MULACC, False), (Ops.RECIP, False),
             (Ops.TRUNC, False), (Ops.SQRT, False), (Ops.NEG, False), (Ops.POW, True), (Ops.EXP2, True),
             (Ops.LOG2, True), (Ops.SIN, True)]
INT_OPS = [(Ops.RECIP, False), (Ops.SQRT, False), (Ops.EXP2, False), (Ops.LOG2, False), (Ops.POW, False),
           (Ops.MULACC, False), (Ops.IDIV, False), (Ops.MOD, False), (Ops.SHL, False), (Ops.SHR, False)]

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.float32, dtypes.float64, dtypes.int8, dtypes.int32,
                                dtypes.uint16], ids=str)
def test_direct_alu_ops(dt: DType):
    n = 48
    ops = FLOAT_OPS if dtypes.is_float(dt) else INT_OPS
    if dtypes.is_float(dt):
        a, b, c = (data(dt, (n,), s) for s in (27, 28, 29))
        b[:4] = [0.0, -0.0, 3.0, 1e-3]
        a[4], b[4] = 2047.0, 0.9990234375   # IDIV: the quotient truncates in float32, then rounds to half (2048)
    else:   # small operands: (int)pow/exp2/log2 beyond int32 (or of 0) are out of range, which C leaves undefined
        r = np.random.default_rng(27)
        lo = 0 if dtypes.is_unsigned(dt) else -3
        a, b, c = (r.integers(lo_, hi, n).astype(to_np_dtype(dt)) for lo_, hi in ((1, 12), (lo, 4), (lo, 4)))
        b[:3] = [0, 3, lo]
    rng = UOp.range(n, 0)
    ld = [glob(i, dt, n).index(rng).load() for i in range(len(ops), len(ops) + 3)]
    vals = [ld[0].alu(op, *([] if op in (Ops.RECIP, Ops.TRUNC, Ops.SQRT, Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN)
                            else [ld[1]] if op is not Ops.MULACC else [ld[1], ld[2]])) for op, _ in ops]
    ast = UOp.sink_of(*[glob(i, dt, n).index(rng).store(v) for i, v in enumerate(vals)])
    cpu, py = run_kernel(ast, [np.zeros(n, a.dtype) for _ in ops] + [a, b, c])
    for (op, libm), x, y in zip(ops, cpu, py):
        assert_same(x, y, ulps=1 if libm and dt != dtypes.float64 else 0, what=f"{op} {dt}")

def test_blocked_and_packed_matmul():
    M, N, K = 16, 64, 96
    a, b = tame(data(dtypes.float32, (M, K), 18), 0.5), tame(data(dtypes.float32, (K, N), 19), 0.5)
    U = lambda ax, n: Opt(OptOps.UPCAST, ax, n)
    tiled = [U(1, 16), U(1, 2), U(0, 4), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.KBLOCK, 2, 32), Opt(OptOps.PACK, 1, 2),
             Opt(OptOps.UNROLL, 3, 4)]
    for opts in (tiled, [Opt(OptOps.SPLIT, 0, 4), U(2, 8)], []):
        cpu, py = run_kernel(matmul_ast(M, N, K), [np.full((M, N), np.nan, np.float32), a, b], opts=opts)
        assert_same(cpu[0], py[0], what=str(opts))
        np.testing.assert_allclose(py[0].reshape(M, N), a @ b, rtol=1e-4, atol=1e-3)

def padded_conv1d_ast(N: int, KW: int) -> UOp:
    """out[i] = sum_k w[k] * xpad[i + k - 2]: x read behind a padding gate."""
    r0, rk = UOp.range(N, 0), UOp.range(KW, 1, "reduce")
    pos = r0 + rk - 2
    xv = glob(1, dtypes.float32, N).index(pos, valid=(pos < 0).logical_not() & (pos < N)).load()
    return UOp.sink_of(glob(0, dtypes.float32, N).index(r0).store(red(xv * glob(2, dtypes.float32, KW).index(
        rk).load(), rk)))

def check_vector_loads_on_padded_edges(renderer, run) -> None:
    """The output axis vectorized: near the edges some lanes are padding, so the vector load is taken only when all
    lanes are valid, else each lane is loaded behind its own gate. `run(ast, arrays, opts)` gives (reference, got)."""
    N, KW = 64, 5
    x, w = tame(data(dtypes.float32, (N,), 20)), tame(data(dtypes.float32, (KW,), 21))
    ast = padded_conv1d_ast(N, KW)
    p = get_program(ast, renderer, opts=[Opt(OptOps.UPCAST, 0, 8)])
    assert any(u.op is Ops.LOAD and len(u.src) > 2 and u.dtype.count == 8 for u in p.uops)
    ref, got = run(ast, [np.zeros(N, np.float32), x, w], [Opt(OptOps.UPCAST, 0, 8)])
    assert_same(ref[0], got[0])
    xp = np.pad(x, 2)
    want = [sum(np.float64(w[k]) * xp[i + k] for k in range(KW)) for i in range(N)]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)

def test_vector_loads_on_padded_edges():
    check_vector_loads_on_padded_edges(Device["PYTHON"].renderer, lambda ast, arrays, opts: run_kernel(ast, arrays,
                                                                                                       opts=opts))

def test_symbolic_variables():
    n, off = UOp.variable("n", 1, 64), UOp.variable("off", 0, 16)
    r = UOp.range(n, 0)
    val = glob(1, dtypes.float32, 80).index(r + off).load() * 2.0 + off.cast(dtypes.float32)
    ast = UOp.sink_of(glob(0, dtypes.float32, 64).index(r).store(val))
    a = np.arange(80, dtype=np.float32)
    for nv, ov in [(10, 3), (64, 16)]:
        cpu, py = run_kernel(ast, [np.zeros(64, np.float32), a], var_vals={"n": nv, "off": ov})
        assert_same(cpu[0], py[0])
        np.testing.assert_array_equal(py[0][:nv], a[ov:ov + nv] * 2 + ov)
        assert not py[0][nv:].any()

def test_threefry_known_answers():
    # Random123's known-answer vectors for Threefry-2x32 with 20 rounds; a uint64 is (word0 | word1 << 32)
    cases = [(0, 0, (0x6b200159, 0x99ba4efe)), (2**64 - 1, 2**64 - 1, (0x1cb996fc, 0xbb002be7)),
             ((0x85a308d3 << 32) | 0x243f6a88, (0x03707344 << 32) | 0x13198a2e, (0xc4923a9c, 0x483df7a0))]
    for x, k, (w0, w1) in cases: assert threefry(x, k) == (w1 << 32) | w0
    r = UOp.range(3, 0)
    xs, ks = glob(1, dtypes.uint64, 3).index(r).load(), glob(2, dtypes.uint64, 3).index(r).load()
    ast = UOp.sink_of(glob(0, dtypes.uint64, 3).index(r).store(xs.alu(Ops.THREEFRY, ks)))
    arrs = [np.zeros(3, np.uint64), np.array([c[0] for c in cases], np.uint64), np.array([c[1] for c in cases],
                                                                                          np.uint64)]
    cpu, py = run_kernel(ast, arrs)
    assert_same(cpu[0], py[0])
    assert py[0].tolist() == [threefry(c[0], c[1]) for c in cases]

def test_scalar_renderer():
    # a renderer declaring no SIMD (PYTHON_SIMD=0): the optimizer emits no vectors and no fused multiply-adds
    M, N, K = 8, 24, 16
    a, b = tame(data(dtypes.float32, (M, K), 22), 0.25), tame(data(dtypes.float32, (K, N), 23), 0.25)
    ren = PythonRenderer(simd=False)
    p = get_program(matmul_ast(M, N, K), ren)
    assert not any(u.dtype.count > 1 or u.op is Ops.MULACC for u in p.uops)
    out = np.zeros(M * N, np.float32)
    prg = PythonProgram(p.name, p.src.encode())
    prg(*[memoryview(x).cast("B") for x in (out, a, b)], global_size=p.global_size)
    np.testing.assert_allclose(out.reshape(M, N), a @ b, rtol=1e-5, atol=1e-4)

def test_chunks_run_in_any_order():
    # the runtime may split [0, global_size) across threads: PYTHON runs the chunks in reverse, results must agree
    p = get_program(matmul_ast(12, 16, 8), Device["PYTHON"].renderer)
    assert p.global_size > 1
    a, b = tame(data(dtypes.float32, (12, 8), 24)), tame(data(dtypes.float32, (8, 16), 25))
    prg = PythonProgram(p.name, p.src.encode())
    outs = []
    for threads in (1, 3, p.global_size):
        out = np.zeros(12 * 16, np.float32)
        prg(*[memoryview(x).cast("B") for x in (out, a, b)], global_size=p.global_size, threads=threads)
        outs.append(out)
    for o in outs[1:]: assert_same(outs[0], o)

# *** the interpreter itself ***

def test_listing_round_trip():
    p = get_program(matmul_ast(4, 8, 4), Device["PYTHON"].renderer)
    name, ins = parse_listing(p.src)
    assert name == p.name and len(ins) == len(p.uops)
    pos = {u: i for i, u in enumerate(p.uops)}
    for u, (op, dt, srcs, arg) in zip(p.uops, ins):
        assert (op, dt, arg) == (u.op, u.dtype, u.arg)
        assert srcs == tuple(pos.get(s) for s in u.src)

def test_out_of_bounds_access_is_an_error():
    r = UOp.range(8, 0)
    ast = UOp.sink_of(glob(0, dtypes.float32, 8).index(r).store(glob(1, dtypes.float32, 8).index(r + 1).load()))
    p = get_program(ast, Device["PYTHON"].renderer)
    prg = PythonProgram(p.name, p.src.encode())
    src, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    with pytest.raises(RuntimeError, match="access to elements"):
        prg(memoryview(out).cast("B"), memoryview(src).cast("B"), global_size=p.global_size)

def test_unwritten_accumulator_is_an_error():
    src = ("# PYTHON kernel bad\n0 | DEFINE_GLOBAL | dtypes.float32.ptr(1) |  | 0\n"
           "1 | DEFINE_REG | dtypes.float32 |  | 0\n2 | CONST | dtypes.index |  | 0\n"
           "3 | INDEX | dtypes.float32.ptr(1) | 0,2 | None\n4 | LOAD | dtypes.float32 | 1 | None\n"
           "5 | STORE | dtypes.void | 3,4 | None\n")
    with pytest.raises(RuntimeError, match="accumulator read before"):
        PythonProgram("bad", src.encode())(memoryview(bytearray(4)))

def round_exact_f32(exact: Fraction) -> float:
    """The float32 nearest to a rational, ties to even: the best of the float32 around its nearest double."""
    near = np.float32(float(exact))
    cands = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1)))

def test_fma_is_correctly_rounded():
    r = np.random.default_rng(26)
    for _ in range(3000):
        a, b = np.float32(r.standard_normal()), np.float32(r.standard_normal())
        c = np.float32(-(a * b) * np.float32(1 + r.standard_normal() * 1e-6))   # cancellation: the hard cases
        exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        assert fma_f32(float(a), float(b), float(c)) == round_exact_f32(exact)
        assert fma_f64(float(a), float(b), float(c)) == float(exact)   # Fraction -> float rounds correctly
    # a*b rounded first would give 0 here
    a = 1.0 + 2.0 ** -12
    assert fma_f32(a, a, -(1.0 + 2.0 ** -11)) == 2.0 ** -24
    # exact: 1 + 2^-23 + 2^-24 - 2^-60, just below a float32 midpoint; rounded to double first it would be the
    # midpoint, which rounds to even (1 + 2^-22)
    assert fma_f32(2.0 ** -24 * (1 + 2.0 ** -18), 1 - 2.0 ** -18, 1 + 2.0 ** -23) == 1 + 2.0 ** -23
    a = 1.0 + 2.0 ** -30
    assert fma_f64(a, a, -1.0) == 2.0 ** -29 + 2.0 ** -60
    assert math.isnan(fma_f32(math.inf, 0.0, 1.0)) and fma_f64(1e308, 10.0, -math.inf) == -math.inf
    assert fma_f64(1e308, 10.0, -1e308) == math.inf and fma_f64(-1e308, 10.0, 1e307) == -math.inf

def test_conversion_helpers():
    assert round_f32(1e39) == math.inf and round_f32(0.1) == float(np.float32(0.1))
    x = np.array([1.0, 1.00390625, 1.005859375, 1.0117188, -3e38, 1e-40, 3.4e38], np.float32)
    got = [bf16_bits_to_float(f32_to_bf16_bits(float(v))) for v in x]
    np.testing.assert_array_equal(got, torch.from_numpy(x).bfloat16().float().numpy())
    assert f32_to_bf16_bits(float(np.uint32(0x7F800001).view(np.float32))) == 0x7FC0   # a nan stays a nan
    ints = np.array([2**53 + 1, 2**63 - 1, -(2**60) - 1, 16777217, -16777219, 2**24 + 3], np.int64)
    for v, w32 in zip(ints.tolist(), ints.astype(np.float32).tolist()):
        assert int_to_float(v, 24) == w32 and int_to_float(v, 53) == float(v)
    assert int_to_float(2**64 - 1, 24) == 2.0 ** 64

def test_default_device_from_env():
    code = ("from fusegrad import Tensor, Device; t = (Tensor([1, 2, 3]) * 2).sum(); "
            "print(Device.DEFAULT, t.device, t.item())")
    env = {**os.environ, "DEV": "PYTHON"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PYTHON", "PYTHON", "12"]

# *** random programs ***

# glibc's float exp/log/sin/pow are not correctly rounded (1 ulp); +,-,*,/ and sqrt are, so those compare exactly
TRANSCENDENTAL = re.compile(r"\.(exp|exp2|log|log2|logsumexp|sin|cos|tan|tanh|sigmoid|softmax|log_softmax|gelu|silu"
                            r"|pow)\(|\*\*")

@pytest.mark.parametrize("seeds", [range(0, 15), range(15, 30)], ids=str)
def test_fuzz_programs_agree(seeds: range):
    # the program fuzzer's random Tensor programs (elementwise chains, reduces, movement, matmuls, casts, assigns):
    # bit for bit, or (programs calling transcendental functions) within a float32 rounding of each other
    from test.test_fuzz_programs import FG_ENV, generate
    for seed in seeds:
        prog = generate(seed)
        outs = []
        for dev in ("CPU", "PYTHON"):
            old, Device.DEFAULT = Device.DEFAULT, dev
            try:
                env = dict(FG_ENV)
                for name, e in prog.lines: env[name] = eval(e, env)
                Tensor.realize(*{id(env[o]): env[o] for o in prog.outputs}.values())
                outs.append([env[o].numpy() for o in prog.outputs])
            finally: Device.DEFAULT = old
        for o, cpu, py in zip(prog.outputs, *outs):
            if TRANSCENDENTAL.search(prog.source()) and cpu.dtype.kind == "f":
                np.testing.assert_allclose(cpu, py, rtol=1e-5, atol=1e-6, err_msg=f"seed {seed} {o}")
            else: assert_same(cpu, py, what=f"seed {seed} {o}")

# *** kernels gcc 12 miscompiles ***
# gcc 12.2 at -O3 -march=native miscompiles the plain C of these kernels (the renderer works around it: see
# ClangRenderer.prelude). The PYTHON results are checked against references, and the CPU must agree with them.

def half_cast_then_op() -> tuple:
    x = np.full((16, 16), 1e5, np.float32)
    x[0, :4] = [1.0, 3.0, 2049.0, 65519.0]
    return x, lambda t: t.cast(dtypes.float16).reciprocal(), np.reciprocal(f16(x))   # float16(1e5) is inf

def gated_load_of_padding() -> tuple:
    x = np.arange(48, dtype=np.float32).reshape(6, 2, 4) + 1
    fn = lambda t: t.reshape(6, 2, 4, 1).expand(6, 2, 4, 5).pad(((0, 0), (3, -1), (3, 2), (-1, 0)), value=-1.0)
    want = np.pad(np.broadcast_to(x.reshape(6, 2, 4, 1), (6, 2, 4, 5)), ((0, 0), (3, 0), (3, 2), (0, 0)),
                  constant_values=-1.0)[:, :4, :, 1:]
    return x, fn, want

def strided_float_sum() -> tuple:
    # 24 elements, one accumulator: the float32 sum in the order of the elements of the transposed tensor (the
    # kernel's loop order), then divided by 24
    from test.test_fuzz_programs import input_array
    x = input_array((3, 4, 1, 2), "float32", 8365)
    acc = np.float32(0)
    for v in x.transpose(0, 3, 2, 1).ravel(): acc = np.float32(acc + v)
    return x, lambda t: t.transpose(3, 1).mean(), np.float32(acc / np.float32(24))

CASES = [half_cast_then_op, gated_load_of_padding, strided_float_sum]

@pytest.mark.parametrize("case", CASES)
def test_python_computes_what_gcc_miscompiles(case):
    x, fn, want = case()
    np.testing.assert_array_equal(fn(Tensor(x, device="PYTHON")).numpy(), want)

@pytest.mark.parametrize("case", CASES)
def test_cpu_agrees_where_gcc_miscompiles(case):
    x, fn, want = case()
    cpu, py = on_both(fn, x)
    assert_same(cpu, py)
    np.testing.assert_array_equal(cpu, want)
