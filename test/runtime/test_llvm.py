"""The LLVM device: programs run on LLVM against independent references (numpy, torch, Python integers) and bit for bit
against the CPU device, which renders the same UOps to C; hand-built kernels for what the front end doesn't emit
(variables of every kind, direct ALU ops, Threefry, gated vector loads); the disk cache across processes; the error
when llvmlite is missing."""
from __future__ import annotations
import ctypes
import gc
import math
import os
import subprocess
import sys
import numpy as np
import pytest
from test.runtime.test_python_device import _arith, _compare, check_vector_loads_on_padded_edges
import torch
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.device import Buffer, CompileError, Device
from fusegrad.dtype import DType, from_np_dtype, to_np_dtype
from fusegrad.engine.realize import CompiledRunner
from fusegrad.helpers import Context
from fusegrad.uop.ops import Ops, UOp
from test.runtime.test_python_device import ALL, FLOATS, INTS, assert_same, data, tame

llvmlite = pytest.importorskip("llvmlite")

from fusegrad.renderer.llvmir import LLVMRenderer  # noqa: E402
from fusegrad.runtime.ops_llvm import LLVMProgram, undefined_symbols  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# *** helpers ***

def tensor(a: np.ndarray, dt: DType | None, device: str) -> Tensor:
    t = Tensor(a, device=device)
    return t.cast(dt) if dt is not None and t.dtype != dt else t

def on(dev: str, fn, *arrays: np.ndarray, dt: DType | None = None) -> np.ndarray:
    out = fn(*[tensor(a, dt, dev) for a in arrays])
    assert out.device == dev
    return out.numpy()

def cross_check(fn, *arrays: np.ndarray, dt: DType | None = None, ulps: int = 0) -> np.ndarray:
    """fn on LLVM, checked bit for bit (or within `ulps`) against fn on CPU; returns the LLVM result."""
    got, cpu = on("LLVM", fn, *arrays, dt=dt), on("CPU", fn, *arrays, dt=dt)
    assert_same(cpu, got, ulps, what=f"LLVM vs CPU {dt}")
    return got

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)
def red(src: UOp, *rngs: UOp, op: Ops = Ops.ADD) -> UOp: return UOp(Ops.REDUCE, src.dtype, (src, *rngs), op)

def run_kernel(ast: UOp, arrays: list[np.ndarray], opts: list[Opt] | None = None, var_vals: dict | None = None,
               devices: tuple[str, ...] = ("LLVM", "CPU")) -> list[list[np.ndarray]]:
    """`ast` run on each device through CompiledRunner, as the engine runs it; the buffers after each run."""
    ret = []
    for dev in devices:
        p = get_program(ast, Device[dev].renderer, opts=opts)
        bufs = [Buffer(dev, a.size, from_np_dtype(a.dtype)).copyin(memoryview(np.ascontiguousarray(a)))
                for a in arrays]
        CompiledRunner(p)(bufs, var_vals or {})
        ret.append([b.numpy() for b in bufs])
    return ret

def program(ast: UOp, opts: list[Opt] | None = None):
    """(ProgramSpec, LLVMProgram) of a kernel AST."""
    p = get_program(ast, Device["LLVM"].renderer, opts=opts)
    return p, LLVMProgram(p.name, Device["LLVM"].compiler.compile_cached(p.src))

def ptr(a: np.ndarray) -> ctypes.c_void_p: return ctypes.c_void_p(a.ctypes.data)

# *** the device ***

def test_device_and_renderer():
    dev = Device["LLVM"]
    assert dev.renderer.device == "LLVM" and dev.renderer.has_threads
    cpu = Device["CPU"].renderer
    # the optimizer shapes the same kernels for both CPU devices
    for attr in ("simd_bytes", "vector_dtypes", "has_fma", "vector_registers"):
        assert getattr(dev.renderer, attr) == getattr(cpu, attr), attr
    assert dtypes.float32 in dev.renderer.vector_dtypes and dev.renderer.simd_bytes >= 16
    # host memory: copies between CPU and LLVM are host copies
    a = np.arange(10, dtype=np.float32)
    t = Tensor(a, device="CPU").to("LLVM")
    np.testing.assert_array_equal((t * 2).to("CPU").numpy(), a * 2)

def test_compile_error_and_bad_object():
    with pytest.raises(CompileError, match="invalid LLVM IR"): Device["LLVM"].compiler.compile("define void @f( {")
    with pytest.raises(ValueError): undefined_symbols(b"not an object")
    src = "declare float @fg_no_such_function(float)\ndefine void @k(ptr %p) {\n  %x = call float " \
          "@fg_no_such_function(float 1.0)\n  store float %x, ptr %p\n  ret void\n}\n"
    lib = Device["LLVM"].compiler.compile(src)
    assert "fg_no_such_function" in undefined_symbols(lib)
    # an unresolvable symbol is an exception, not the JIT aborting the process
    with pytest.raises(RuntimeError, match="fg_no_such_function"): LLVMProgram("k", lib)
    with pytest.raises(RuntimeError, match="no function"):
        LLVMProgram("nope", Device["LLVM"].compiler.compile("define void @k() {\n  ret void\n}\n"))

# *** elementwise, every dtype ***

# the same programs the PYTHON device is cross-checked with
@pytest.mark.parametrize("dt", ALL, ids=str)
def test_elementwise(dt: DType):
    a, b = data(dt, (5, 24), 1), data(dt, (5, 24), 2)
    cross_check(_arith(dt), a, b, dt=dt)
    got = cross_check(_compare, a, b, dt=dt)
    if dt != dtypes.bfloat16:
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(got[0], a < b)
            np.testing.assert_array_equal(got[1], a == b)
            np.testing.assert_array_equal(got[2], a != b)

@pytest.mark.parametrize("dt", [d for d in INTS], ids=str)
def test_integer_arithmetic_wraps(dt: DType):
    a, b = data(dt, (64,), 3), data(dt, (64,), 4)
    got = on("LLVM", lambda x, y: Tensor.stack(x + y, x - y, x * y, x * 3 + 7, -x), a, b)
    with np.errstate(over="ignore"):
        want = [a + b, a - b, a * b, a * a.dtype.type(3) + a.dtype.type(7), (0 - a).astype(a.dtype)]
    for g, w in zip(got, want): np.testing.assert_array_equal(g, w)

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.float32, dtypes.float64], ids=str)
def test_float_ops_against_numpy(dt: DType):
    a, b = data(dt, (4, 40), 5), data(dt, (4, 40), 6)
    # one kernel per op (stacking adds zero padding, which turns -0.0 into 0.0)
    fns = [lambda x, y: x + y, lambda x, y: x * y, lambda x, y: x - y, lambda x, y: x / y, lambda x, y: -x,
           lambda x, y: x.sqrt()]
    with np.errstate(all="ignore"):
        want = [a + b, a * b, a - b, a / b, -a, np.sqrt(a)]
    for fn, w in zip(fns, want): assert_same(w, on("LLVM", fn, a, b), what=str(dt))

def test_bfloat16_rounding_against_torch():
    x = np.random.default_rng(9).standard_normal(512).astype(np.float32) * 100
    x[:7] = [np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1.0000001, np.nan]
    y = np.random.default_rng(10).standard_normal(512).astype(np.float32)
    tx, ty = torch.from_numpy(x).bfloat16(), torch.from_numpy(y).bfloat16()
    assert_same(tx.float().numpy(), on("LLVM", lambda a: a.cast(dtypes.bfloat16).float(), x))
    got = on("LLVM", lambda a, b: (a.cast(dtypes.bfloat16) * b.cast(dtypes.bfloat16)).float(), x, y)
    assert_same((tx * ty).float().numpy(), got)

def test_half_rounds_after_every_op_like_torch():
    a, b = data(dtypes.float16, (6, 32), 7), data(dtypes.float16, (6, 32), 8)
    a, b = tame(a), tame(b)
    got = on("LLVM", lambda x, y: ((x * 3 + 1) * y).float(), a, b)
    want = ((torch.from_numpy(a) * 3 + 1) * torch.from_numpy(b)).float().numpy()
    np.testing.assert_array_equal(got, want)

# *** casts and bitcasts ***

@pytest.mark.parametrize("src", ALL, ids=str)
def test_casts(src: DType):
    # every conversion, widened back losslessly to stack them. Floats going to integers are made finite and in
    # range first: C leaves other conversions undefined
    a = data(src, (3, 16), 6)
    def fn(x: Tensor):
        fl = Tensor.stack(*[x.cast(d).cast(dtypes.float64) for d in FLOATS])
        if dtypes.is_float(src):
            fin = (x.isnan() | x.isinf()).where(0.0, x).clip(-100.0, 100.0)
            ints = [(fin.abs() if dtypes.is_unsigned(d) else fin).cast(d).cast(dtypes.int64) for d in INTS]
        else: ints = [x.cast(d).cast(dtypes.int64) for d in INTS]
        return Tensor.stack(*ints, x.cast(dtypes.bool).cast(dtypes.int64)), fl
    outs = [[o.numpy() for o in fn(tensor(a, src, dev))] for dev in ("LLVM", "CPU")]
    for got, cpu in zip(*outs): assert_same(cpu, got, what=f"casts from {src}")
    if src in (dtypes.bfloat16, dtypes.bool): return
    # against numpy, one kernel per conversion (stacking adds zero padding, which turns -0.0 into 0.0)
    if not dtypes.is_float(src):
        ints = outs[0][0]
        for k, d in enumerate(INTS): np.testing.assert_array_equal(ints[k], a.astype(to_np_dtype(d)).astype(np.int64))
    for d in (dtypes.float16, dtypes.float32, dtypes.float64):
        with np.errstate(over="ignore"): want = a.astype(to_np_dtype(d))
        assert_same(want, on("LLVM", lambda x, d=d: x.cast(d), a), what=f"{src}->{d}")

def test_int_to_float_rounding():
    v = np.array([2**53 + 1, 2**63 - 1, -(2**62) - 2**38 - 1, 16777217, -16777219, 2**24 + 2**23 + 1] * 4, np.int64)
    u = np.array([2**64 - 1, 2**63 + 2**39 + 1, 2**32 + 1, 18446744073709549568] * 6, np.uint64)
    for arr in (v, u):
        got = on("LLVM", lambda x: Tensor.stack(x.cast(dtypes.float32).cast(dtypes.float64), x.cast(dtypes.float64)),
                 arr)
        np.testing.assert_array_equal(got[0], arr.astype(np.float32).astype(np.float64))
        np.testing.assert_array_equal(got[1], arr.astype(np.float64))

def test_float64_to_half_rounds_once():
    d = np.random.default_rng(4).uniform(-3, 3, 256)
    d[:4] = [1 + 2 ** -11 + 2 ** -40, 2049.0000001, 65520.0, -1e300]
    with np.errstate(over="ignore"): want = d.astype(np.float16)
    np.testing.assert_array_equal(Tensor(d, device="LLVM").cast(dtypes.float16).numpy(), want)

@pytest.mark.parametrize("pair", [(np.float32, np.int32), (np.float32, np.uint32), (np.float64, np.int64),
                                  (np.float16, np.int16), (np.int8, np.uint8), (np.uint16, np.float16)])
def test_bitcast(pair):
    src, dst = pair
    a = data(from_np_dtype(np.dtype(src)), (64,), 12)
    got = on("LLVM", lambda x: x.bitcast(from_np_dtype(np.dtype(dst))), a)
    want = a.view(dst)
    if np.dtype(dst).kind == "f": assert_same(want, got)
    else: np.testing.assert_array_equal(got, want)

# *** integer division, shifts, max ***

@pytest.mark.parametrize("dt", [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint8, dtypes.uint32,
                                dtypes.uint64], ids=str)
def test_c_integer_division(dt: DType):
    info = np.iinfo(to_np_dtype(dt))
    avals = [info.min, info.min + 1, -7, -1, 0, 5, 7, info.max] if info.min < 0 else [0, 1, 5, 7, info.max]
    bvals = [-3, -1, 0, 2, 7, info.min] if info.min < 0 else [0, 1, 2, 7, info.max]
    a = np.array([x for x in avals for _ in bvals], to_np_dtype(dt))
    b = np.array([y for _ in avals for y in bvals], to_np_dtype(dt))
    got = cross_check(lambda x, y: Tensor.stack(x.div(y, rounding_mode="trunc"), x % y, x // y), a, b)
    def wrap(v: int) -> int: return (v - int(info.min)) % (1 << (8 * a.itemsize)) + int(info.min)
    for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
        q = 0 if y == 0 else wrap(abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1))   # C: truncation
        assert got[0][k] == q, (x, y)
        if y != 0: assert (got[1][k], got[2][k]) == (wrap(x % y), wrap(x // y)), (x, y)   # Python: floor

@pytest.mark.parametrize("dt", [dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64],
                         ids=str)
def test_shifts(dt: DType):
    a = data(dt, (96,), 13)
    bits = 8 * a.itemsize
    n = np.arange(96) % (bits + 4)   # counts up to past the width: those give 0
    got = on("LLVM", lambda x, c: Tensor.stack(x << c, x >> c), a, n.astype(a.dtype))
    def ref(x: int, c: int, left: bool) -> int:
        if c >= bits: return 0
        v = (x << c) if left else (x >> c)
        return (v - int(np.iinfo(a.dtype).min)) % (1 << bits) + int(np.iinfo(a.dtype).min)
    for k in range(96):
        assert got[0][k] == ref(int(a[k]), int(n[k]), True), (a[k], n[k])
        assert got[1][k] == ref(int(a[k]), int(n[k]), False), (a[k], n[k])

def test_max_propagates_nan():
    a = tame(data(dtypes.float32, (4, 32), 11), 0.0)
    a[1, 5] = a[2, 31] = np.nan
    got = cross_check(lambda x: Tensor.stack(x.max(1), x.min(1)), a)
    assert np.isnan(got[:, 1]).all() and np.isnan(got[:, 2]).all() and not np.isnan(got[:, [0, 3]]).any()
    # (not -0.0 against 0.0: torch.maximum gives either, C's (a > b || a != a) ? a : b gives b)
    x = np.array([np.nan, 1.0, -3.0, np.inf, np.nan, -np.inf], np.float32)
    y = np.array([1.0, np.nan, 0.0, np.nan, np.nan, 2.0], np.float32)
    got = on("LLVM", lambda p, q: p.maximum(q), x, y)
    assert_same(torch.maximum(torch.from_numpy(x), torch.from_numpy(y)).numpy(), got)

# *** transcendental functions ***

@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_transcendentals(dt: DType):
    a, b = data(dt, (4, 40), 3), data(dt, (4, 40), 4)
    fn = lambda x, y: Tensor.stack(x.exp2(), x.log2(), x.sin(), x.exp(), x.log(), x.cos(), x.abs() ** y, x.sqrt())
    cross_check(fn, a, b, dt=dt)   # the same libm calls as the C path: bit for bit

def test_transcendental_edges():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, 3.4e38, 128.0, -150.0], np.float32)
    fns = {"exp2": (Tensor.exp2, np.exp2), "log2": (Tensor.log2, np.log2), "sin": (Tensor.sin, np.sin),
           "sqrt": (Tensor.sqrt, np.sqrt)}
    for arr in (x, x.astype(np.float64)):
        for name, (fn, ref) in fns.items():
            got = on("LLVM", fn, arr)
            with np.errstate(all="ignore"): assert_same(ref(arr), got, ulps=1 if arr.dtype == np.float32 else 0,
                                                        what=f"{name} {arr.dtype}")
            if name == "sqrt": assert math.copysign(1, got[1]) == -1   # sqrt(-0.0) is -0.0

# *** reductions, matmul, movement ***

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.int32, dtypes.float16, dtypes.uint8, dtypes.float64], ids=str)
def test_reductions(dt: DType):
    a = data(dt, (12, 40), 10)
    if dtypes.is_float(dt): a = tame(a, 1.25)
    sum_dt = dtypes.float32 if dt == dtypes.float16 else dt
    fn = lambda x: Tensor.stack(x.sum(0).cast(sum_dt)[:12], x.sum(1).cast(sum_dt), x.max(1).cast(sum_dt))
    got = cross_check(fn, a)
    np.testing.assert_array_equal(got[2], a.max(1).astype(to_np_dtype(sum_dt)))
    if dtypes.is_int(dt):
        with np.errstate(over="ignore"): np.testing.assert_array_equal(got[1], a.sum(1, dtype=to_np_dtype(sum_dt)))

def test_large_reductions():
    a = np.random.default_rng(1).standard_normal((512, 2048)).astype(np.float32)
    got = on("LLVM", lambda x: x.sum(1), a)
    np.testing.assert_allclose(got, a.astype(np.float64).sum(1), rtol=1e-4, atol=1e-3)
    got = on("LLVM", lambda x: x.sum(0), a)
    np.testing.assert_allclose(got, a.astype(np.float64).sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(on("LLVM", lambda x: x.max(), a), a.max())
    big = np.random.default_rng(2).standard_normal(1 << 22).astype(np.float32)
    np.testing.assert_allclose(on("LLVM", lambda x: x.sum(), big), big.astype(np.float64).sum(), rtol=1e-4)

@pytest.mark.parametrize("shape", [(4, 4, 4), (33, 17, 9), (64, 64, 64), (256, 256, 256)])
def test_matmul(shape):
    M, K, N = shape
    a, b = tame(data(dtypes.float32, (M, K), 12)), tame(data(dtypes.float32, (K, N), 13))
    np.testing.assert_allclose(cross_check(lambda x, y: x @ y, a, b), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-2)

def test_matmul_is_vectorized():
    a = Tensor(np.ones((64, 64), np.float32), device="LLVM")
    p = get_program((a @ a).schedule()[-1].ast, Device["LLVM"].renderer)
    assert any(u.op is Ops.MULACC and u.dtype.count > 1 for u in p.uops)
    assert "<8 x float>" in p.src or "<16 x float>" in p.src or "<4 x float>" in p.src
    assert "@llvm.fma.v" in p.src

@pytest.mark.parametrize("M, K, N", [(128, 784, 512), (37, 1000, 80)])
def test_x_at_w_t_copies_blocks_transposed(M: int, K: int, N: int):
    """`x @ W.T`'s copy of W that transposes is TRANSPOSED_COPY blocks on LLVM too, written as shufflevector steps:
    the same bits as the CPU device's C, and NumPy's values."""
    rng = np.random.default_rng(16)
    a, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    x = Tensor(a, device="LLVM")
    p = get_program((x @ Tensor(w, device="LLVM").T).schedule()[-1].ast, Device["LLVM"].renderer)
    if Device["LLVM"].renderer.simd_bytes >= 32:
        assert any(u.op is Ops.TRANSPOSED_COPY for u in p.uops) and "shufflevector" in p.src
    got = cross_check(lambda x, y: x @ y.T, a, w)
    np.testing.assert_allclose(got, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.float16, dtypes.float64, dtypes.bfloat16], ids=str)
def test_matmul_dtypes(dt: DType):
    a, b = data(dt, (12, 20), 14), data(dt, (20, 8), 15)
    if dtypes.is_int(dt): a, b = a % 1000, b % 1000
    else: a, b = tame(a, 2.0), tame(b, 2.0)
    got = cross_check(lambda x, y: x @ y, a, b, dt=dt)
    if dt == dtypes.int32: np.testing.assert_array_equal(got, a @ b)

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.float32, dtypes.int8, dtypes.bool], ids=str)
def test_movement(dt: DType):
    a = data(dt, (6, 10), 17)
    def fn(t: Tensor) -> Tensor:
        outs = [t.pad(((1, 2), (3, 0))).shrink(((0, 6), (0, 10))), t.flip(0), t.flip((0, 1)),
                t.pad(((1, 2), (3, 0)))[2:8, :10], t.T.contiguous().reshape(6, 10)]
        return Tensor.stack(*outs)
    got = cross_check(fn, a)
    np.testing.assert_array_equal(got[0], np.pad(a, ((1, 2), (3, 0)))[0:6, 0:10])
    np.testing.assert_array_equal(got[1], a[::-1])
    np.testing.assert_array_equal(got[2], a[::-1, ::-1])
    np.testing.assert_array_equal(got[3], np.pad(a, ((1, 2), (3, 0)))[2:8, :10])
    np.testing.assert_array_equal(got[4], a.T.reshape(6, 10))
    if dt != dtypes.bool:
        got = on("LLVM", lambda t: t.pad(((2, 2), (5, 3))).sum(0), a)
        np.testing.assert_array_equal(got, np.pad(a, ((2, 2), (5, 3))).sum(0).astype(got.dtype))

def test_softmax_and_conv_like():
    x = tame(data(dtypes.float32, (8, 50), 16), 3.0)
    got = cross_check(lambda t: Tensor.stack(t.softmax(1), t.log_softmax(1)), x)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(got[0], e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)

# *** hand-built kernels ***

FLOAT_OPS = [Ops.IDIV, Ops.MOD, Ops.MAX, Ops.MULACC, Ops.RECIP, Ops.TRUNC, Ops.SQRT, Ops.NEG, Ops.POW, Ops.EXP2,
             Ops.LOG2, Ops.SIN, Ops.FDIV, Ops.SUB]
INT_OPS = [Ops.RECIP, Ops.SQRT, Ops.EXP2, Ops.LOG2, Ops.POW, Ops.MULACC, Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR,
           Ops.MAX, Ops.NEG, Ops.XOR]
UNARY = (Ops.RECIP, Ops.TRUNC, Ops.SQRT, Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN)

@pytest.mark.parametrize("vec", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64, dtypes.int8,
                                dtypes.int32, dtypes.uint16, dtypes.int64], ids=str)
def test_direct_alu_ops(dt: DType, vec: bool):
    n = 48
    ops = FLOAT_OPS if dtypes.is_float(dt) else INT_OPS
    np_dt = np.float32 if dt == dtypes.bfloat16 else to_np_dtype(dt)
    if dtypes.is_float(dt):
        a, b, c = (data(dtypes.float32 if dt == dtypes.bfloat16 else dt, (n,), s) for s in (27, 28, 29))
        b[:4] = [0.0, -0.0, 3.0, 1e-3]
    else:   # small operands: (int)exp2/pow out of the dtype's range is undefined in C
        r = np.random.default_rng(27)
        lo = 0 if dtypes.is_unsigned(dt) else -3
        a, b, c = (r.integers(lo_, hi, n).astype(np_dt) for lo_, hi in ((1, 6), (lo, 4), (lo, 4)))
        b[:3] = [0, 3, lo]
    ldt = dtypes.float32 if dt == dtypes.bfloat16 else dt
    rng = UOp.range(n, 0)
    ld = [glob(i, ldt, n).index(rng).load().cast(dt) for i in range(len(ops), len(ops) + 3)]
    vals = [ld[0].alu(op, *([] if op in UNARY else [ld[1]] if op is not Ops.MULACC else [ld[1], ld[2]]))
            for op in ops]
    ast = UOp.sink_of(*[glob(i, ldt, n).index(rng).store(v.cast(ldt)) for i, v in enumerate(vals)])
    opts = [Opt(OptOps.UPCAST, 0, 8)] if vec else []
    # against the PYTHON device, which interprets the same UOps: independent of both compilers (gcc 12 miscompiles
    # the vectorized uint16 RECIP, giving 1/1 = 65535 in lane 0). It rounds float32 libm functions correctly, glibc
    # is within 1 ulp of that
    got, ref = run_kernel(ast, [np.zeros(n, a.dtype) for _ in ops] + [a, b, c], opts=opts, devices=("LLVM", "PYTHON"))
    for op, x, y in zip(ops, got, ref):
        libm = op in (Ops.POW, Ops.EXP2, Ops.LOG2, Ops.SIN) and dt != dtypes.float64
        assert_same(y, x, ulps=1 if libm else 0, what=f"{op} {dt}")

def test_variables_of_every_kind():
    # out[i] = in[i + off] * scale + (h + b) where scale is float32, h half, b bfloat16, off int8 (300 wraps to 44)
    n, off = UOp.variable("n", 1, 64), UOp.variable("off", 0, 100, dtypes.int8)
    scale = UOp.variable("scale", -100, 100, dtypes.float32)
    h, b = UOp.variable("h", -100, 100, dtypes.float16), UOp.variable("b", -100, 100, dtypes.bfloat16)
    d = UOp.variable("d", -100, 100, dtypes.float64)
    r = UOp.range(n, 0)
    x = glob(1, dtypes.float32, 200).index(r + off.cast(dtypes.index)).load()
    val = x * scale + (h.cast(dtypes.float32) + b.cast(dtypes.float32)) + d.cast(dtypes.float32)
    ast = UOp.sink_of(glob(0, dtypes.float32, 64).index(r).store(val))
    p, prg = program(ast)
    assert [v.arg[0] for v in p.vars] == ["b", "d", "h", "n", "off", "scale"]
    inp = np.arange(200, dtype=np.float32) / 7
    for nv, ov, sv, hv, bv, dv in [(10, 3, 2.5, 1.0009765625, 1.00390625, 0.25), (64, 300, -1.1, 0.1, 3.3, 1e300)]:
        out = np.zeros(64, np.float32)
        prg(ptr(out), ptr(inp), vals=(bv, dv, hv, nv, ov, sv), global_size=int(nv) if p.global_size != 1 else 1)
        o = np.int8(np.int64(ov).astype(np.int8))
        with np.errstate(over="ignore"):
            add = np.float32(np.float16(hv)) + np.float32(torch.tensor(np.float32(bv)).bfloat16().float().item())
            want = inp[o:o + nv] * np.float32(sv) + add + np.float32(dv)
        np.testing.assert_array_equal(out[:nv], want)
        assert not out[nv:].any()

def test_symbolic_variables_through_the_engine():
    n, off = UOp.variable("n", 1, 64), UOp.variable("off", 0, 16)
    r = UOp.range(n, 0)
    val = glob(1, dtypes.float32, 80).index(r + off).load() * 2.0 + off.cast(dtypes.float32)
    ast = UOp.sink_of(glob(0, dtypes.float32, 64).index(r).store(val))
    a = np.arange(80, dtype=np.float32)
    for nv, ov in [(10, 3), (64, 16)]:
        got, cpu = run_kernel(ast, [np.zeros(64, np.float32), a], var_vals={"n": nv, "off": ov})
        np.testing.assert_array_equal(got[0][:nv], a[ov:ov + nv] * 2 + ov)
        assert_same(cpu[0], got[0])

def test_threefry_known_answers():
    # Random123's known-answer vectors for Threefry-2x32 with 20 rounds; a uint64 is (word0 | word1 << 32)
    cases = [(0, 0, (0x6b200159, 0x99ba4efe)), (2**64 - 1, 2**64 - 1, (0x1cb996fc, 0xbb002be7)),
             ((0x85a308d3 << 32) | 0x243f6a88, (0x03707344 << 32) | 0x13198a2e, (0xc4923a9c, 0x483df7a0))] * 3
    n = len(cases)
    rng = UOp.range(n, 0)
    x, k = glob(1, dtypes.uint64, n).index(rng).load(), glob(2, dtypes.uint64, n).index(rng).load()
    ast = UOp.sink_of(glob(0, dtypes.uint64, n).index(rng).store(x.alu(Ops.THREEFRY, k)))
    xs = np.array([c[0] for c in cases], np.uint64)
    ks = np.array([c[1] for c in cases], np.uint64)
    want = np.array([(w1 << 32) | w0 for _, _, (w0, w1) in cases], np.uint64)
    for opts in ([], [Opt(OptOps.UPCAST, 0, 3)]):
        got, cpu = run_kernel(ast, [np.zeros(n, np.uint64), xs, ks], opts=opts)
        np.testing.assert_array_equal(got[0], want)

def test_vector_loads_on_padded_edges():
    # the same check as the PYTHON device's, the reference being the CPU device
    def run(ast, arrays, opts):
        got, cpu = run_kernel(ast, arrays, opts=opts)
        return cpu, got
    check_vector_loads_on_padded_edges(Device["LLVM"].renderer, run)

def test_gated_store_and_load_bounds():
    # a gated store writes only where the gate holds; a gated load never touches memory outside the buffer
    n = 40
    r = UOp.range(n, 0)
    src = glob(1, dtypes.int32, 20).index(r - 10, valid=((r < 10).logical_not() & (r < 30))).load()
    ast = UOp.sink_of(glob(0, dtypes.int32, n).index(r, valid=(r < 35)).store(src + 1))
    a = np.arange(20, dtype=np.int32) * 3
    got = run_kernel(ast, [np.full(n, -5, np.int32), a], devices=("LLVM",))[0][0]
    want = np.full(n, -5, np.int32)
    want[:35] = 1
    want[10:30] = a + 1
    np.testing.assert_array_equal(got, want)

# *** threads ***

def test_threads_split_big_kernel():
    a = np.random.default_rng(3).standard_normal(1 << 22).astype(np.float32)
    want = np.maximum(a * np.float32(2) + np.float32(1), 0)
    np.testing.assert_array_equal((Tensor(a, device="LLVM") * 2 + 1).relu().numpy(), want)
    p = get_program(((Tensor(a, device="LLVM") * 2 + 1).relu()).schedule()[-1].ast, Device["LLVM"].renderer)
    assert p.global_size > 1
    _, prg = program(p.ast)
    bufs = [np.zeros_like(a), a]
    for threads in (1, 2, 7):
        bufs[0][:] = np.nan
        prg(*[ptr(bufs[i]) for i in p.globals], global_size=p.global_size, threads=threads)
        np.testing.assert_array_equal(bufs[0], want)

def test_program_is_freed():
    _, prg = program(UOp.sink_of(glob(0, dtypes.float32, 4).index(UOp.range(4, 0)).store(UOp.const(dtypes.float32,
                                                                                                      1.5))))
    engine = prg._engine
    del prg
    gc.collect()
    assert engine.closed

# *** the disk cache, and llvmlite missing ***

_CACHE_PROGRAM = """
import numpy as np
from fusegrad import Tensor, Device
x = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4), device="LLVM")
assert ((x * 3 + 1).exp2().sum(1)).numpy().shape == (3,)
c = Device["LLVM"].compiler
print(c.compiles, c.disk_hits)
"""

def test_disk_cache_round_trip(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CACHELEVEL": "1", "PYTHONPATH": ROOT}
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROGRAM], env=env, capture_output=True, text=True,
                           cwd=ROOT) for _ in range(2)]
    for r in runs: assert r.returncode == 0, r.stderr
    (c1, h1), (c2, h2) = [tuple(map(int, r.stdout.split())) for r in runs]
    assert c1 > 0 and h1 == 0
    assert c2 == 0 and h2 == c1   # the second process loads every kernel from the disk cache
    assert any(f.is_file() for f in (tmp_path / "fusegrad" / "compiled").rglob("*"))

_NO_LLVMLITE = """
import sys
sys.modules["llvmlite"] = None   # import llvmlite now raises ImportError
sys.modules["llvmlite.binding"] = None
import fusegrad
from fusegrad import Tensor, Device
assert (Tensor([1.0, 2.0]) * 2).numpy().tolist() == [2.0, 4.0]
try: Device["LLVM"]
except ImportError as e: print("ERR", e)
"""

def test_missing_llvmlite_is_a_clear_error():
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("DEV", None)
    r = subprocess.run([sys.executable, "-c", _NO_LLVMLITE], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "ERR the LLVM device needs llvmlite: pip install 'fusegrad[llvm]'" in r.stdout

def test_renderer_is_pure_text():
    # rendering needs no llvmlite: the IR names every declared intrinsic and has the C kernel signature
    a = UOp.variable("a", 0, 10)
    f = UOp.variable("f", -1, 1, dtypes.float32)
    r = UOp.range(16, 0)
    ast = UOp.sink_of(glob(0, dtypes.float32, 16).index(r).store(
        glob(1, dtypes.float32, 16).index(r).load().alu(Ops.EXP2) * f + a.cast(dtypes.float32)))
    with Context(TRANSCENDENTAL=0): p = get_program(ast, LLVMRenderer())  # exp2 as the intrinsic, not a polynomial
    assert f"define void @{p.name}(ptr noalias %data0, ptr noalias %data1, i64 %\"var.a\", double %\"var.f\", " \
           "i64 %core_lo, i64 %core_hi)" in p.src
    assert "declare" in p.src and "@llvm.exp2" in p.src and "fast" not in p.src and " nsw " not in p.src

def test_optimization_levels_agree():
    from fusegrad.runtime.ops_llvm import LLVMCompiler
    M = 48
    a, b = tame(data(dtypes.float32, (M, M), 30)), tame(data(dtypes.float32, (M, M), 31))
    ta, tb = Tensor(a, device="LLVM"), Tensor(b, device="LLVM")
    p = get_program((ta @ tb).schedule()[-1].ast, Device["LLVM"].renderer)
    outs, keys = [], set()
    for opt in (0, 1, 2, 3):
        comp = LLVMCompiler(opt)
        keys.add(comp.cachekey)
        out = np.zeros((M, M), np.float32)
        LLVMProgram(p.name, comp.compile(p.src))(ptr(out), ptr(a), ptr(b), global_size=p.global_size, threads=2)
        outs.append(out)
    assert len(keys) == 4   # the optimization level is part of the cache key
    for out in outs: assert_same(outs[0], out)   # no fast-math at any level: the same bits
    np.testing.assert_allclose(outs[0], a.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="0..3"): LLVMCompiler(5)
