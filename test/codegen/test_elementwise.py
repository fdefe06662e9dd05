"""Elementwise kernels on every dtype, run as compiled C and checked against numpy/torch/Python arithmetic."""
import math
import numpy as np
import pytest
import torch
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.dtype import ALL_DTYPES, DType, dtypes, to_np_dtype
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import glob, rng, run

N = 37  # not a multiple of any vector width

def ew_kernel(fns: list, in_dts: list[DType], out_dts: list[DType], n: int = N) -> UOp:
    """One kernel with an output per fn: out_k[i] = fns[k](*inputs[i])."""
    r = rng(n, 0)
    loads = [glob(len(fns) + i, dt, n).index(r).load() for i, dt in enumerate(in_dts)]
    return UOp.sink_of(*[glob(k, odt, n).index(r).store(fn(*loads)) for k, (fn, odt) in enumerate(zip(fns, out_dts))])

def np_storage(dt: DType):
    return np.uint16 if dt == dtypes.bfloat16 else to_np_dtype(dt)

def bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

def bf16_vals(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()

def run_ew(fn, ins: list[np.ndarray], in_dts: list[DType], out_dt: DType, noopt=False) -> np.ndarray:
    return run_ews([fn], ins, in_dts, [out_dt], noopt)[0]

def run_ews(fns: list, ins: list[np.ndarray], in_dts: list[DType], out_dts: list[DType], noopt=False) -> list:
    """Run a multi-output elementwise kernel (one compile for several checks)."""
    n = len(ins[0])
    outs = [np.zeros(n, np_storage(dt)) for dt in out_dts]
    run(ew_kernel(fns, in_dts, out_dts, n), [*outs, *ins], noopt=noopt)
    return outs

def sample(dt: DType, n: int = N, seed: int = 0, special: bool = True) -> np.ndarray:
    """Values of dt (bits for bfloat16) including extremes, nan, inf and signed zeros."""
    rs = np.random.RandomState(seed)
    if dt == dtypes.bool: return rs.randint(0, 2, n).astype(np.bool_)
    if dtypes.is_int(dt):
        info = np.iinfo(to_np_dtype(dt))
        vals = rs.randint(max(info.min, -1000), min(info.max, 1000) + 1, n, dtype=np.int64).astype(to_np_dtype(dt))
        if special: vals[:4] = [info.min, info.max, 0, -1 if info.min < 0 else 1]
        return vals
    vals = (rs.randn(n) * 10).astype(np.float32)
    if special: vals[:6] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.5]
    if dt == dtypes.bfloat16: return bf16_bits(vals)
    return vals.astype(to_np_dtype(dt))

def as_float(x: np.ndarray, dt: DType) -> np.ndarray:
    return bf16_vals(x) if dt == dtypes.bfloat16 else x.astype(np.float64)

BINARY = {"add": (lambda a, b: a + b), "mul": (lambda a, b: a * b), "max": (lambda a, b: a.maximum(b)),
          "lt": (lambda a, b: a < b), "ne": (lambda a, b: a.ne(b))}

def np_binary(name: str, a: np.ndarray, b: np.ndarray, dt: DType) -> np.ndarray:
    if dt == dtypes.bool:
        return {"add": a | b, "mul": a & b, "max": a | b, "lt": ~a & b, "ne": a != b}[name]
    if dt == dtypes.bfloat16:
        ta, tb = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (a, b)]
        res = {"add": ta + tb, "mul": ta * tb, "max": torch.maximum(ta, tb), "lt": ta < tb, "ne": ta != tb}[name]
        return res.numpy() if res.dtype == torch.bool else res.view(torch.int16).numpy().view(np.uint16)
    with np.errstate(all="ignore"):
        return {"add": a + b, "mul": a * b, "max": np.maximum(a, b), "lt": a < b, "ne": a != b}[name]

@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_binary(dt: DType):
    a, b = sample(dt, seed=1), sample(dt, seed=2)
    b[6:10] = a[6:10]  # some equal pairs
    names = list(BINARY)
    out_dts = [dtypes.bool if name in ("lt", "ne") else dt for name in names]
    for name, got in zip(names, run_ews([BINARY[n] for n in names], [a, b], [dt, dt], out_dts)):
        np.testing.assert_array_equal(got, np_binary(name, a, b, dt), err_msg=name)

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16])
def test_max_propagates_nan(dt: DType):
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0], to_np_dtype(dt))
    b = np.array([1.0, np.nan, np.nan, -np.inf, -3.0], to_np_dtype(dt))
    got = run_ew(BINARY["max"], [a, b], [dt, dt], dt)
    np.testing.assert_array_equal(got, np.array([np.nan, np.nan, np.nan, -np.inf, 2.0], to_np_dtype(dt)))

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16])
def test_scalar_max_rule(dt: DType):
    # the scalar MAX (written as a max instruction and a select on a being nan, so gcc doesn't branch on a > b) keeps
    # the rule `a if a > b or a != a else b`: a nan on either side wins and two zeros give the second
    pairs = [(np.nan, 1.0), (1.0, np.nan), (np.nan, np.nan), (0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0), (np.inf, -np.inf),
             (-np.inf, np.inf), (np.nan, -np.inf), (np.inf, np.nan), (-1.0, -0.0), (-0.0, -1.0), (2.5, 2.5),
             (-3.0, 7.0)]
    a, b = (np.array([p[i] for p in pairs], to_np_dtype(dt)) for i in (0, 1))
    got = run_ew(BINARY["max"], [a, b], [dt, dt], dt)
    want = np.where((a > b) | np.isnan(a), a, b)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

VMAX_DTS = [dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16, dtypes.int8, dtypes.uint8, dtypes.int16,
            dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64]

@pytest.mark.parametrize("width", [4, 16, 32])
@pytest.mark.parametrize("dt", VMAX_DTS, ids=str)
def test_vector_max(dt: DType, width: int):
    # MAX of vectors (the loop upcast to `width` lanes: up to 256 bytes, wider than a register, compared in halves) is
    # native comparisons and a bitwise select. Floats: a nan on either side wins (numpy's maximum, torch.maximum), and
    # as the scalar rule `a if a > b or a != a else b` two zeros give the second: max(0.0, -0.0) is -0.0
    n = 128
    a, b = sample(dt, n, seed=7), sample(dt, n, seed=8)
    b[10:20] = a[10:20]  # equal pairs
    if dtypes.is_float(dt):
        pairs = [(np.nan, 1.0), (1.0, np.nan), (np.nan, np.nan), (0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0), (0.0, 0.0),
                 (np.inf, -np.inf), (-np.inf, np.inf), (-np.inf, -np.inf), (np.nan, -np.inf), (np.inf, np.nan),
                 (-0.0, np.nan), (np.nan, 0.0), (-1.0, -0.0), (-0.0, -1.0)]
        for k, (x, y) in enumerate(pairs * 2):   # in both halves of a wide vector
            i = 32 + k if k < len(pairs) else 96 + k - len(pairs)
            a[i], b[i] = (bf16_bits(np.array([x, y])) if dt == dtypes.bfloat16 else (x, y))
    out = np.zeros(n, np_storage(dt))
    p = run(ew_kernel([BINARY["max"]], [dt, dt], [dt], n), [out, a, b], opts=[Opt(OptOps.UPCAST, 0, width)])
    assert "fg_vmax_" in p.src and "fg_vselect_" in p.src and "= fg_max_" not in p.src, "not a native vector max"
    np.testing.assert_array_equal(out, np_binary("max", a, b, dt))
    if dtypes.is_float(dt):
        fa, fb, got = as_float(a, dt), as_float(b, dt), as_float(out, dt)
        want = np.where((fa > fb) | np.isnan(fa), fa, fb)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

CAST_DTS = [dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32,
            dtypes.int64, dtypes.uint64, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]

def cast_inputs(src: DType, dst: DType) -> np.ndarray:
    """Values of src whose conversion to dst is defined in C (floats to ints: truncated value fits dst)."""
    if dtypes.is_float(src) and dtypes.is_int(dst):
        lo, hi = (0, 250) if dtypes.is_unsigned(dst) else (-120, 120)
        vals = np.array([lo, hi, 0.0, -0.0, 0.5, 1.5, 2.5, 99.75] + [lo + 0.25, hi - 0.75], np.float32)
        return bf16_bits(vals) if src == dtypes.bfloat16 else vals.astype(to_np_dtype(src))
    return sample(src, seed=3)

@pytest.mark.parametrize("src", CAST_DTS, ids=str)
def test_cast(src: DType):
    # floats go to ints in two kernels: signed and unsigned destinations need different (defined) input ranges
    groups = [[d for d in CAST_DTS if not (dtypes.is_float(src) and dtypes.is_int(d))]]
    if dtypes.is_float(src): groups += [[d for d in CAST_DTS if dtypes.is_int(d) and dtypes.is_unsigned(d) == u]
                                        for u in (False, True)]
    for dsts in groups:
        x = cast_inputs(src, dsts[0])
        outs = run_ews([lambda a, d=d: a.cast(d) for d in dsts], [x], [src], dsts)
        for dst, got in zip(dsts, outs): check_cast(x, got, src, dst)

def check_cast(x: np.ndarray, got: np.ndarray, src: DType, dst: DType):
    if src == dtypes.bfloat16 or dst == dtypes.bfloat16:
        tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if src == dtypes.bfloat16 else torch.from_numpy(x)
        if dst == dtypes.bfloat16:
            want = tx.float().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16) if src == dtypes.float64 \
                else tx.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        else: want = tx.to(getattr(torch, {dtypes.bool: "bool"}.get(dst, to_np_dtype(dst).name))).numpy()
    else:
        with np.errstate(all="ignore"): want = x.astype(to_np_dtype(dst))
    if dtypes.is_float(dst):
        wf = as_float(want, dst)
        np.testing.assert_array_equal(as_float(got, dst), wf)
        # signed zeros keep their sign (a nan's sign is not meaningful)
        np.testing.assert_array_equal(np.signbit(as_float(got, dst))[~np.isnan(wf)], np.signbit(wf)[~np.isnan(wf)])
    else: np.testing.assert_array_equal(got, want)

def test_bf16_rounds_to_nearest_even():
    # float32 values exactly halfway between two bfloat16 values round to the even one; just above rounds up
    f = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.0e38, 1e-40], np.float32)
    got = run_ew(lambda a: a.cast(dtypes.bfloat16), [f], [dtypes.float32], dtypes.bfloat16)
    np.testing.assert_array_equal(got, bf16_bits(f))
    np.testing.assert_array_equal(bf16_vals(got)[:4], [1.0, 1 + 2**-6, 1 + 2**-7, -1.0])

def c_div(a: int, b: int) -> int:
    if b == 0: return 0
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q

def wrap(v: int, dt: DType) -> int:
    bits = 8 * dt.itemsize
    v &= (1 << bits) - 1
    return v - (1 << bits) if not dtypes.is_unsigned(dt) and v >= 1 << (bits - 1) else v

INT_DTS = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32, dtypes.int64,
           dtypes.uint64]

@pytest.mark.parametrize("dt", INT_DTS, ids=str)
def test_int_div_mod(dt: DType):
    info = np.iinfo(to_np_dtype(dt))
    rs = np.random.RandomState(4)
    a = rs.randint(max(info.min, -500), min(info.max, 500), 64).astype(to_np_dtype(dt))
    b = rs.randint(max(info.min, -9), 10, 64).astype(to_np_dtype(dt))
    a[:6] = [info.min, info.min, 7, 0, info.max, 5]
    b[:6] = [-1 if info.min < 0 else 1, 0, 0, 3, 2 if info.min == 0 else -1, info.max]
    q, m = run_ews([lambda x, y: x // y, lambda x, y: x % y], [a, b], [dt, dt], [dt, dt])
    want_q = [wrap(c_div(int(x), int(y)), dt) for x, y in zip(a, b)]
    want_m = [wrap(int(x) - c_div(int(x), int(y)) * int(y), dt) if y != 0 else 0 for x, y in zip(a, b)]
    assert q.tolist() == want_q
    assert m.tolist() == want_m

@pytest.mark.parametrize("d", [-1, 0, -3, 7, 1])
def test_int_div_mod_by_constant(d: int):
    a = np.array([-2**31, -7, -6, -1, 0, 1, 6, 7, 2**31 - 1], np.int32)
    q, m = run_ews([lambda x: x // UOp.const(dtypes.int32, d), lambda x: x % UOp.const(dtypes.int32, d)], [a],
                   [dtypes.int32], [dtypes.int32] * 2)
    assert q.tolist() == [wrap(c_div(int(x), d), dtypes.int32) for x in a]
    assert m.tolist() == [wrap(int(x) - c_div(int(x), d) * d, dtypes.int32) if d else 0 for x in a]

@pytest.mark.parametrize("dt", [dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.uint32, dtypes.int64])
def test_shifts(dt: DType):
    bits = 8 * dt.itemsize
    a = sample(dt, 40, seed=5)
    s = np.array([(i * 7) % (bits + 8) - 2 for i in range(40)], to_np_dtype(dt) if not dtypes.is_unsigned(dt)
                 else np.int64).astype(to_np_dtype(dt))
    shl, shr = run_ews([lambda x, y: x << y, lambda x, y: x >> y], [a, s], [dt, dt], [dt, dt])
    ok = lambda y: 0 <= int(y) < bits
    assert shl.tolist() == [wrap(int(x) << int(y), dt) if ok(y) else 0 for x, y in zip(a, s)]
    assert shr.tolist() == [wrap(int(x) >> int(y), dt) if ok(y) else 0 for x, y in zip(a, s)]

UNARY = {Ops.SQRT: np.sqrt, Ops.EXP2: np.exp2, Ops.LOG2: np.log2, Ops.SIN: np.sin, Ops.TRUNC: np.trunc,
         Ops.RECIP: lambda x: 1 / x, Ops.NEG: np.negative}

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16], ids=str)
def test_unary_float(dt: DType):
    x = sample(dt, seed=6)
    ops = list(UNARY)
    for op, got in zip(ops, run_ews([lambda a, op=op: a.alu(op) for op in ops], [x], [dt], [dt] * len(ops))):
        check_unary(op, x, got, dt)

def check_unary(op: Ops, x: np.ndarray, got: np.ndarray, dt: DType):
    with np.errstate(all="ignore"):
        if dt == dtypes.bfloat16:
            want = as_float(bf16_bits(UNARY[op](bf16_vals(x).astype(np.float32))), dt)
        else: want = UNARY[op](x.astype(np.float32) if dt == dtypes.float16 else x).astype(to_np_dtype(dt))
    rtol = {dtypes.float64: 1e-13, dtypes.float32: 1e-6, dtypes.float16: 1e-3, dtypes.bfloat16: 1e-2}[dt]
    np.testing.assert_allclose(as_float(got, dt), as_float(want, dt) if dt != dtypes.bfloat16 else want, rtol=rtol,
                               atol=0)

def test_where_compare_chain():
    a, b = sample(dtypes.float32, seed=7, special=False), sample(dtypes.float32, seed=8, special=False)
    got = run_ew(lambda x, y: (x < y).where(x * 2.0, y - x), [a, b], [dtypes.float32] * 2, dtypes.float32)
    np.testing.assert_array_equal(got, np.where(a < b, a * np.float32(2), b - a))

def test_bool_logic():
    a, b = sample(dtypes.bool, seed=9), sample(dtypes.bool, seed=10)
    got = run_ew(lambda x, y: (x & y) | (x ^ y).logical_not(), [a, b], [dtypes.bool] * 2, dtypes.bool)
    np.testing.assert_array_equal(got, (a & b) | ~(a ^ b))

def test_int_overflow_wraps():
    a = np.array([2**31 - 1, -2**31, 123456789, -5], np.int32)
    got = run_ew(lambda x: x * x + x, [a], [dtypes.int32], dtypes.int32)
    assert got.tolist() == [wrap(int(x) * int(x) + int(x), dtypes.int32) for x in a]

def test_float_semantics_not_fast_math():
    # a*b+c rounds twice (no contraction into fma); x-x is nan for inf; no reassociation of (big+x)-big
    a = np.array([1 + 2**-12, np.inf, 1e20], np.float32)
    b = np.array([1 - 2**-12, 1.0, 1.0], np.float32)
    c = np.array([-1.0, 0.0, 1.0], np.float32)
    fma, sub, assoc = run_ews([lambda x, y, z: x * y + z, lambda x, y, z: x - x, lambda x, y, z: (x + y) - x],
                              [a, b, c], [dtypes.float32] * 3, [dtypes.float32] * 3)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(fma, a * b + c)
        np.testing.assert_array_equal(sub, a - a)
        np.testing.assert_array_equal(assoc, (a + b) - a)

# *** indexing: padding masks and symbolic variables ***

def guarded_array(n: int, dtype=np.float32) -> np.ndarray:
    """An array whose last element is the last byte before a page that can't be read (touching past it crashes)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    nbytes = n * np.dtype(dtype).itemsize
    npages = (nbytes + page - 1) // page
    mem = mmap.mmap(-1, (npages + 1) * page)
    buf = (ctypes.c_char * len(mem)).from_buffer(mem)
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(ctypes.addressof(buf) + npages * page, page, 0) == 0
    arr = np.frombuffer(mem, dtype=np.uint8, count=nbytes, offset=npages * page - nbytes).view(dtype)
    guarded_array.keep.append((mem, buf))
    return arr
guarded_array.keep = []

@pytest.mark.parametrize("noopt", [False, True])
def test_padding_valid_mask(noopt: bool):
    n, pad = 29, 3
    a = guarded_array(n)
    a[:] = np.arange(1, n + 1)
    r = rng(n + 2 * pad, 0)
    valid = (r < pad).logical_not() & (r < n + pad)
    ld = glob(1, dtypes.float32, n).index(r - pad, valid=valid).load()
    out = np.full(n + 2 * pad, -1, np.float32)
    run(UOp.sink_of(glob(0, dtypes.float32, n + 2 * pad).index(r).store(ld + 1.0)), [out, a], noopt=noopt)
    np.testing.assert_array_equal(out, np.pad(a, pad) + 1)

def test_store_with_valid_mask():
    n = 20
    r = rng(n, 0)
    out = np.full(n, -1, np.int32)
    a = np.arange(n, dtype=np.int32)
    st = glob(0, dtypes.int32, n).index(r, valid=r < 7).store(glob(1, dtypes.int32, n).index(r).load() * 3)
    run(UOp.sink_of(st), [out, a])
    np.testing.assert_array_equal(out, np.where(np.arange(n) < 7, a * 3, -1))

def test_symbolic_variable_in_index_and_loop_end():
    n = UOp.variable("n", 1, 64)
    off = UOp.variable("off", 0, 16)
    r = rng(n, 0)
    val = glob(1, dtypes.float32, 80).index(r + off).load() * 2.0
    ast = UOp.sink_of(glob(0, dtypes.float32, 64).index(r).store(val))
    a = np.arange(80, dtype=np.float32)
    for nv, ov in [(10, 3), (64, 16), (1, 0)]:
        out = np.zeros(64, np.float32)
        run(ast, [out, a], var_vals={"n": nv, "off": ov})
        np.testing.assert_array_equal(out[:nv], a[ov:ov + nv] * 2)
        assert not out[nv:].any()

def test_2d_transpose_and_broadcast():
    M, K = 13, 24
    r0, r1 = rng(M, 0), rng(K, 1)
    a = np.random.RandomState(11).randn(K, M).astype(np.float32)
    b = np.random.RandomState(12).randn(K).astype(np.float32)
    val = glob(1, dtypes.float32, M * K).index(r1 * M + r0).load() + glob(2, dtypes.float32, K).index(r1).load()
    out = np.zeros((M, K), np.float32)
    run(UOp.sink_of(glob(0, dtypes.float32, M * K).index(r0 * K + r1).store(val)), [out, a, b])
    np.testing.assert_array_equal(out, a.T + b)

def test_elementwise_parallel_split():
    M, K = 10, 33
    r0, r1 = rng(M, 0), rng(K, 1)
    a = np.random.RandomState(13).randn(M, K).astype(np.float32)
    ast = UOp.sink_of(glob(0, dtypes.float32, M * K).index(r0 * K + r1).store(
        glob(1, dtypes.float32, M * K).index(r0 * K + r1).load().alu(Ops.EXP2)))
    out = np.zeros((M, K), np.float32)
    p = run(ast, [out, a], splits=[(0, 4), (4, 10)])
    assert p.global_size == M
    np.testing.assert_allclose(out, np.exp2(a), rtol=1e-6)
    out[:] = 0
    run(ast, [out, a], splits=[(3, 7)])
    assert not out[:3].any() and not out[7:].any()
    np.testing.assert_allclose(out[3:7], np.exp2(a[3:7]), rtol=1e-6)

def test_arange_value_from_index():
    n = 40
    r = rng(n, 0)
    ast = UOp.sink_of(glob(0, dtypes.float32, n).index(r).store((r * 3 - 5).cast(dtypes.float32) * 0.5))
    out = np.zeros(n, np.float32)
    run(ast, [out])
    np.testing.assert_array_equal(out, (np.arange(n) * 3 - 5) * np.float32(0.5))

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.float16, dtypes.bfloat16], ids=str)
def test_float_constants(dt: DType):
    vals = [math.inf, -math.inf, -0.0, 1e-30, 65504.0, 0.1, -3.25]
    zero = np.zeros(4, np_storage(dt))
    outs = run_ews([lambda x, v=v: x + UOp.const(dt, v) for v in vals], [zero], [dt], [dt] * len(vals))
    for v, got in zip(vals, outs):
        want = np.float32(v) if dt == dtypes.bfloat16 else np.array(v).astype(to_np_dtype(dt))
        if dt == dtypes.bfloat16: want = as_float(bf16_bits(np.array([want] * 4, np.float32)), dt)
        np.testing.assert_array_equal(as_float(got, dt), np.zeros(4) + want, err_msg=str(v))

@pytest.mark.parametrize("dt", [dtypes.int64, dtypes.int32, dtypes.uint64, dtypes.int8])
def test_int_constants_extremes(dt: DType):
    info = np.iinfo(to_np_dtype(dt))
    x = np.array([0, 1, 2, 3], to_np_dtype(dt))
    outs = run_ews([lambda a: a.maximum(UOp.const(dt, int(info.min))), lambda a: a * 0 + UOp.const(dt, int(info.max)),
                    lambda a: a * 0 + UOp.const(dt, int(info.min))], [x], [dt], [dt] * 3)
    assert [o.tolist() for o in outs] == [x.tolist(), [int(info.max)] * 4, [int(info.min)] * 4]

def test_threefry_known_answers():
    # Random123's known-answer vectors for Threefry-2x32 (20 rounds); a uint64 holds (word0 | word1 << 32)
    n = 3
    r = rng(n, 0)
    x, k = glob(1, dtypes.uint64, n).index(r).load(), glob(2, dtypes.uint64, n).index(r).load()
    ast = UOp.sink_of(glob(0, dtypes.uint64, n).index(r).store(x.alu(Ops.THREEFRY, k)))
    xs = np.array([0, 2**64 - 1, (0x85a308d3 << 32) | 0x243f6a88], np.uint64)
    ks = np.array([0, 2**64 - 1, (0x03707344 << 32) | 0x13198a2e], np.uint64)
    out = np.zeros(n, np.uint64)
    run(ast, [out, xs, ks])
    assert [(int(v) & 0xffffffff, int(v) >> 32) for v in out] == \
        [(0x6b200159, 0x99ba4efe), (0x1cb996fc, 0xbb002be7), (0xc4923a9c, 0x483df7a0)]
