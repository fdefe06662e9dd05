"""End-to-end tests of the Tensor front end: every op is run through the whole compiler (schedule -> codegen -> C ->
run) and compared with PyTorch (CPU) or NumPy as the independent reference.

Kernel compiles dominate the run time (~50-100 ms per new kernel), so the tests share a few shapes and keep the
parametrization moderate; the exhaustive dtype x op matrix is marked slow."""
from __future__ import annotations
import math
from typing import Callable
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.dtype import to_np_dtype, to_torch_dtype

torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------------------------------------
# helpers

def _rand(shape: tuple[int, ...], dtype: str = "float32", low: float = -2.0, high: float = 2.0,
          seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + 7919 * len(shape) + sum(shape))
    if np.issubdtype(np.dtype(dtype), np.integer):
        return np.asarray(rng.integers(int(low), int(high), size=shape, endpoint=True)).astype(dtype)
    if dtype == "bool": return np.asarray(rng.integers(0, 1, size=shape, endpoint=True)).astype(bool)
    return np.asarray(rng.uniform(low, high, size=shape)).astype(dtype)

def _ref_np(ref: torch.Tensor) -> np.ndarray:
    """The reference as numpy; bfloat16 has no numpy type so it is compared in float32."""
    ref = ref.detach()
    return (ref.float() if ref.dtype == torch.bfloat16 else ref).numpy()

def _got_np(out: Tensor) -> np.ndarray:
    return (out.float() if out.dtype == dtypes.bfloat16 else out).numpy()

def assert_close(out: Tensor, ref: torch.Tensor | np.ndarray, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Shapes equal, values equal (ints/bools) or close (floats), nan where the reference has nan."""
    exp = _ref_np(ref) if isinstance(ref, torch.Tensor) else np.asarray(ref)
    got = _got_np(out)
    assert out.shape == tuple(exp.shape), f"shape {out.shape} != expected {exp.shape}"
    assert got.shape == exp.shape, f"numpy() shape {got.shape} != expected {exp.shape}"
    if exp.dtype == np.bool_ or np.issubdtype(exp.dtype, np.integer):
        np.testing.assert_array_equal(got, exp)
    else:
        np.testing.assert_allclose(got.astype(np.float64), exp.astype(np.float64), atol=atol, rtol=rtol, equal_nan=True)

def helper_test_op(shapes: list[tuple[int, ...]], torch_fxn: Callable, fg_fxn: Callable | None = None,
                   dtype: str = "float32", low: float = -2.0, high: float = 2.0, atol: float = 1e-6,
                   rtol: float = 1e-5, vals: list[np.ndarray] | None = None) -> Tensor:
    """Run the same computation on random inputs in torch and fusegrad and compare. Returns fusegrad's output."""
    arrs = vals if vals is not None else [_rand(s, dtype, low, high, seed=i) for i, s in enumerate(shapes)]
    ref = torch_fxn(*[torch.from_numpy(np.array(a)) for a in arrs])
    out = (fg_fxn or torch_fxn)(*[Tensor(a) for a in arrs])
    assert isinstance(out, Tensor)
    assert_close(out, ref, atol=atol, rtol=rtol)
    return out

# ---------------------------------------------------------------------------------------------------------------------
# elementwise binary arithmetic with broadcasting

BROADCAST_SHAPES = [((3, 4), (3, 4)), ((3, 1), (1, 4)), ((4,), (3, 4)), ((), (2, 3)), ((2, 3), ())]

@pytest.mark.parametrize("shapes", BROADCAST_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_binary_broadcast(op: str, shapes):
    fxn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
           "div": lambda x, y: x / y}[op]
    # keep divisors away from 0 so the comparison is well conditioned
    vals = [_rand(shapes[0], seed=1), _rand(shapes[1], low=0.5, high=2.0, seed=2)]
    helper_test_op([], fxn, vals=vals)

@pytest.mark.parametrize("name,fxn", [
    ("x+2", lambda x: x + 2), ("2+x", lambda x: 2 + x), ("x-2.5", lambda x: x - 2.5), ("2.5-x", lambda x: 2.5 - x),
    ("x*3", lambda x: x * 3), ("3*x", lambda x: 3 * x), ("x/4", lambda x: x / 4), ("4/x", lambda x: 4 / x),
    ("x**2", lambda x: x ** 2), ("2**x", lambda x: 2 ** x), ("x**0.5", lambda x: x ** 0.5), ("-x", lambda x: -x),
])
def test_python_scalar_either_side(name, fxn):
    helper_test_op([(3, 4)], fxn, low=0.5, high=3.0, atol=1e-5)

def test_pow_tensor_tensor():
    helper_test_op([(3, 4), (3, 4)], lambda x, y: x ** y, low=0.5, high=2.0, atol=1e-5, rtol=1e-5)

def test_pow_negative_base_integer_exponent():
    # torch: (-2.0)**3 == -8, (-2.0)**2 == 4 (integer-valued exponents of negative bases are real)
    x = np.array([-2.0, -1.5, -0.5, 0.0, 1.5], dtype=np.float32)
    for e in (2, 3):
        assert_close(Tensor(x) ** e, torch.from_numpy(x) ** e, atol=1e-5)

def test_pow_edge_cases():
    # 0**0 == 1, a negative base with a fractional exponent is nan, inf**-1 == 0
    x = np.array([0.0, 0.0, 2.0, -8.0, -2.0, 4.0, np.inf, 0.0], dtype=np.float32)
    y = np.array([0.0, 2.0, -1.0, 1 / 3, 0.5, 0.0, -1.0, -1.0], dtype=np.float32)
    assert_close(Tensor(x) ** Tensor(y), torch.from_numpy(x) ** torch.from_numpy(y), atol=1e-6)
    assert_close(Tensor(x) ** 0, torch.from_numpy(x) ** 0)
    assert_close(Tensor(x[2:6]) ** -1, torch.from_numpy(x[2:6]) ** -1, atol=1e-6)

def test_int_pow():
    x = np.array([-3, -2, 0, 1, 2, 5], dtype=np.int32)
    out = Tensor(x) ** 3
    assert out.dtype == dtypes.int32
    assert_close(out, (torch.from_numpy(x) ** 3).int())

def test_int_pow_tensor_exponent():
    x, y = np.array([0, 2, 3, -2, 5, 1], dtype=np.int32), np.array([0, 0, 1, 3, 2, 7], dtype=np.int32)
    out = Tensor(x) ** Tensor(y)
    assert dtypes.is_int(out.dtype)
    assert_close(out, (torch.from_numpy(x) ** torch.from_numpy(y)).to(torch.int32))

def test_true_division_of_ints_is_float():
    a, b = np.array([7, -7, 3, 0, 10], dtype=np.int32), np.array([2, 2, -4, 5, 3], dtype=np.int32)
    out = Tensor(a) / Tensor(b)
    assert out.dtype == dtypes.float32
    assert_close(out, torch.from_numpy(a) / torch.from_numpy(b))
    out2 = Tensor(a) / 2
    assert out2.dtype == dtypes.float32
    assert_close(out2, torch.from_numpy(a) / 2)

INT_A = np.array([-7, -7, -3, -1, 0, 1, 3, 7, 7, -8, 8, 5], dtype=np.int32)
INT_B = np.array([2, -2, 2, 3, -3, -3, 3, 2, -2, 3, -3, 5], dtype=np.int32)

@pytest.mark.parametrize("dtype", ["int8", "int32", "int64"])
def test_floordiv_int_negative(dtype):
    a, b = INT_A.astype(dtype), INT_B.astype(dtype)
    out = Tensor(a) // Tensor(b)
    assert out.dtype == Tensor(a).dtype
    assert_close(out, torch.floor_divide(torch.from_numpy(a), torch.from_numpy(b)))

@pytest.mark.parametrize("dtype", ["int8", "int32", "int64"])
def test_mod_int_negative(dtype):
    a, b = INT_A.astype(dtype), INT_B.astype(dtype)
    out = Tensor(a) % Tensor(b)
    assert out.dtype == Tensor(a).dtype
    assert_close(out, torch.remainder(torch.from_numpy(a), torch.from_numpy(b)))

@pytest.mark.parametrize("name,fxn", [("a//3", lambda a: a // 3), ("a//-3", lambda a: a // -3),
                                      ("a%3", lambda a: a % 3), ("a%-3", lambda a: a % -3),
                                      ("-20//a", lambda a: -20 // a), ("20%a", lambda a: 20 % a)])
def test_floordiv_mod_int_scalar(name, fxn):
    a = INT_B.copy()  # no zeros: it is also used as a divisor
    assert_close(fxn(Tensor(a)), fxn(torch.from_numpy(a)).int())

def test_mod_float():
    a = np.array([-7.5, 7.5, -7.5, 7.5, 0.25, -3.0], dtype=np.float32)
    b = np.array([2.0, -2.0, -2.0, 2.0, 1.0, 1.5], dtype=np.float32)
    assert_close(Tensor(a) % Tensor(b), torch.remainder(torch.from_numpy(a), torch.from_numpy(b)), atol=1e-6)

# dtype promotion of tensor-tensor ops: the result dtypes numpy (ints) and torch (floats) agree on with tinygrad
PROMO_PAIRS = [("int8", "uint8", "int16"), ("int32", "float16", "float16"), ("bool", "int8", "int8"),
               ("uint8", "int32", "int32"), ("float16", "float32", "float32"), ("int64", "float32", "float32"),
               ("uint32", "int32", "int64"), ("int16", "uint16", "int32"), ("bool", "float32", "float32"),
               ("bfloat16", "float16", "float32"), ("bfloat16", "float32", "float32"), ("int32", "int64", "int64"),
               ("uint8", "uint16", "uint16"), ("float32", "float64", "float64")]

def _make(vals: list, dtname: str) -> tuple[Tensor, torch.Tensor]:
    dt = getattr(dtypes, dtname)
    return Tensor(vals, dtype=dt), torch.tensor(vals, dtype=to_torch_dtype(dt))

@pytest.mark.parametrize("d1,d2,expected", PROMO_PAIRS, ids=lambda p: str(p))
def test_binary_dtype_promotion(d1, d2, expected):
    v1 = [1, 0, 3, 1] if d1 != "bool" else [True, False, True, True]
    v2 = [2, 5, 1, 0] if d2 != "bool" else [True, True, False, False]
    f1, f2 = Tensor(v1, dtype=getattr(dtypes, d1)), Tensor(v2, dtype=getattr(dtypes, d2))
    a, b = np.array(v1, dtype=np.float64), np.array(v2, dtype=np.float64)
    for out, ref in ((f1 + f2, a + b), (f2 * f1, b * a), (f1.maximum(f2), np.maximum(a, b))):
        assert out.dtype == getattr(dtypes, expected), f"{d1},{d2}: {out.dtype} != {expected}"
        assert_close(out, ref.astype(expected), atol=0)

@pytest.mark.parametrize("dtname,scalar,expected", [
    ("int8", 1, "int8"), ("uint8", 3, "uint8"), ("int16", 2, "int16"), ("int32", 1.5, "float32"),
    ("int64", 2.5, "float32"), ("float16", 1.5, "float16"), ("float16", 2, "float16"), ("float64", 2, "float64"),
    ("bool", 1, "int32"),  # tinygrad: a bool tensor with a Python int becomes the default int (torch gives int64)
])
def test_scalar_dtype_promotion(dtname, scalar, expected):
    vals = [1, 2, 3, 0] if dtname != "bool" else [True, False, True, False]
    f, t = _make(vals, dtname)
    for out, ref in ((f + scalar, t + scalar), (scalar * f, scalar * t)):
        assert out.dtype == getattr(dtypes, expected), f"{dtname} with {scalar!r}: got {out.dtype}"
        assert_close(out, ref.to(to_torch_dtype(out.dtype)), atol=1e-3)

@pytest.mark.parametrize("name,fxn", [
    ("int<2.5", lambda t: t < 2.5), ("int==2.0", lambda t: t == 2.0), ("int>=1.5", lambda t: t >= 1.5),
    ("int+0.5", lambda t: t + 0.5), ("int*1.5", lambda t: t * 1.5), ("int/2.0", lambda t: t / 2.0),
    ("int-0.25", lambda t: 0.25 - t), ("int.clamp_min(2.5)", None),
])
def test_int_tensor_with_float_scalar(name, fxn):
    # the float scalar promotes the int tensor to float; it must not be truncated to an int first
    x = np.array([-2, 1, 2, 3, 5], dtype=np.int32)
    tx = torch.from_numpy(x)
    if fxn is None:
        out, ref = Tensor(x).maximum(2.5), torch.clamp(tx, min=2.5)
        assert out.dtype == dtypes.float32
    else:
        out, ref = fxn(Tensor(x)), fxn(tx)
        assert out.dtype == (dtypes.bool if ref.dtype == torch.bool else dtypes.float32)
    assert_close(out, ref)

def test_floordiv_float():
    a = np.array([-7.5, 7.5, -7.5, 7.5, 0.5, -0.5, 6.0], dtype=np.float32)
    b = np.array([2.0, -2.0, -2.0, 2.0, 1.0, 1.0, 3.0], dtype=np.float32)
    assert_close(Tensor(a) // Tensor(b), torch.floor_divide(torch.from_numpy(a), torch.from_numpy(b)))
    assert_close(Tensor(a) // 2, torch.floor_divide(torch.from_numpy(a), 2))

def test_bool_arithmetic_with_scalars():
    b = np.array([True, False, True])
    out = Tensor(b) * 2.5
    assert out.dtype == dtypes.float32 and out.tolist() == [2.5, 0.0, 2.5]
    assert (Tensor(b) + Tensor(b)).dtype == dtypes.bool  # torch and numpy: bool + bool is logical or
    assert (Tensor(b) + Tensor(b)).tolist() == (torch.from_numpy(b) + torch.from_numpy(b)).tolist()
    assert (Tensor(b) * Tensor([False, True, True])).tolist() == [False, False, True]

# ---------------------------------------------------------------------------------------------------------------------
# comparisons and where

@pytest.mark.parametrize("op", ["lt", "le", "gt", "ge", "eq", "ne"])
def test_comparisons(op):
    fxn = {"lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y,
           "eq": lambda x, y: x == y, "ne": lambda x, y: x != y}[op]
    # small ints stored as floats so == and != have ties to find
    a = np.array([[0., 1, 2, 3], [-1, 1, 1, 5], [2, 2, -3, 0]], dtype=np.float32)
    b = np.array([[1., 1, 0, 3]], dtype=np.float32)
    out = fxn(Tensor(a), Tensor(b))
    assert out.dtype == dtypes.bool
    assert_close(out, fxn(torch.from_numpy(a), torch.from_numpy(b)))
    # with a scalar on either side, and between ints and floats
    ia = a.astype(np.int32)
    for got, ref in ((fxn(Tensor(a), 1.0), fxn(torch.from_numpy(a), 1.0)),
                     (fxn(2, Tensor(ia)), fxn(2, torch.from_numpy(ia))),
                     (fxn(Tensor(ia), Tensor(b)), fxn(torch.from_numpy(ia), torch.from_numpy(b)))):
        assert got.dtype == dtypes.bool
        assert_close(got, ref)

def test_where():
    cond = np.array([[True, False, True, False]])
    x, y = _rand((3, 4), seed=3), _rand((3, 1), seed=4)
    assert_close(Tensor(cond).where(Tensor(x), Tensor(y)),
                 torch.where(torch.from_numpy(cond), torch.from_numpy(x), torch.from_numpy(y)))

def test_where_scalars():
    x = _rand((3, 4), seed=5)
    tx = torch.from_numpy(x)
    assert_close((Tensor(x) > 0).where(Tensor(x), 0.0), torch.where(tx > 0, tx, 0.0))
    assert_close((Tensor(x) > 0).where(1.0, -1.0), torch.where(tx > 0, 1.0, -1.0))
    out = (Tensor(x) > 0).where(1, 2)
    assert dtypes.is_int(out.dtype)
    assert_close(out, torch.where(tx > 0, 1, 2).int())

def test_where_dtype_promotion():
    c = np.array([True, False, True])
    a, b = np.array([1, 2, 3], dtype=np.int32), np.array([0.5, 1.5, 2.5], dtype=np.float32)
    out = Tensor(c).where(Tensor(a), Tensor(b))
    assert out.dtype == dtypes.float32
    assert_close(out, torch.where(torch.from_numpy(c), torch.from_numpy(a), torch.from_numpy(b)))

# ---------------------------------------------------------------------------------------------------------------------
# unary ops

UNARY = {
    "relu": (lambda x: x.relu(), -3, 3, 0), "exp": (lambda x: x.exp(), -10, 10, 1e-5),
    "exp2": (lambda x: x.exp2(), -10, 10, 1e-5), "log": (lambda x: x.log(), 1e-3, 100, 1e-5),
    "log2": (lambda x: x.log2(), 1e-3, 100, 1e-5), "sqrt": (lambda x: x.sqrt(), 0, 100, 1e-5),
    "sin": (lambda x: x.sin(), -10, 10, 1e-5), "neg": (lambda x: x.neg(), -3, 3, 0),
    "unary_minus": (lambda x: -x, -3, 3, 0), "reciprocal": (lambda x: x.reciprocal(), 0.1, 10, 1e-6),
    "square": (lambda x: x.square(), -3, 3, 1e-6),
}

@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name):
    fxn, low, high, atol = UNARY[name]
    helper_test_op([(4, 5)], fxn, low=low, high=high, atol=atol, rtol=1e-5)

def test_sin_large_arguments():
    # range reduction must stay accurate well beyond a few periods
    helper_test_op([(64,)], lambda x: x.sin(), low=-200, high=200, atol=2e-5, rtol=1e-4)

def test_exp_log_roundtrip_precision():
    helper_test_op([(64,)], lambda x: x.exp().log(), low=-20, high=20, atol=1e-5, rtol=1e-5)

@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "sin", "exp2", "log2"])
def test_float64_transcendentals_keep_double_precision(name):
    # computing a float64 op through float32 would leave ~1e-7 relative error
    x = np.linspace(0.1, 20, 97) if name in ("log", "sqrt", "log2") else np.linspace(-20, 20, 97)
    out = getattr(Tensor(x), name)()
    assert out.dtype == dtypes.float64
    assert_close(out, getattr(torch.from_numpy(x), name)(), atol=1e-13, rtol=1e-13)

def test_int64_uint64_large_values():
    big = np.array([2 ** 40 + 7, -(2 ** 41) - 3, 5], dtype=np.int64)
    assert (Tensor(big) * 3).tolist() == (big * 3).tolist()
    assert (Tensor(big) // 1000).tolist() == [int(v) // 1000 for v in big]
    assert (Tensor(big) % 1000).tolist() == [int(v) % 1000 for v in big]
    assert (Tensor(big) > 2 ** 40).tolist() == [True, False, False]
    u = np.array([2 ** 63 + 5, 3, 2 ** 64 - 1], dtype=np.uint64)
    assert (Tensor(u) + 1).tolist() == [2 ** 63 + 6, 4, 0]
    assert Tensor(u).max().item() == 2 ** 64 - 1 and Tensor(u).min().item() == 3
    assert (Tensor(u) > Tensor(np.full(3, 2 ** 62, np.uint64))).tolist() == [True, False, True]

@pytest.mark.parametrize("name", ["exp", "sqrt", "log", "sin"])
def test_unary_of_int_is_float(name):
    a = np.array([1, 2, 3, 9], dtype=np.int32)
    out = getattr(Tensor(a), name)()
    assert out.dtype == dtypes.float32
    assert_close(out, getattr(torch.from_numpy(a), name)(), atol=1e-6)

def test_maximum_minimum():
    a, b = _rand((3, 4), seed=6), _rand((1, 4), seed=7)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close(Tensor(a).maximum(Tensor(b)), torch.maximum(ta, tb))
    assert_close(Tensor(a).minimum(Tensor(b)), torch.minimum(ta, tb))
    assert_close(Tensor(a).maximum(0.5), torch.clamp(ta, min=0.5))
    assert_close(Tensor(a).minimum(-0.5), torch.clamp(ta, max=-0.5))

def test_maximum_int_and_ties():
    a, b = np.array([-3, 0, 5, 7, -8], dtype=np.int32), np.array([-3, 1, 4, 7, -9], dtype=np.int32)
    out = Tensor(a).maximum(Tensor(b))
    assert out.dtype == dtypes.int32
    assert_close(out, torch.maximum(torch.from_numpy(a), torch.from_numpy(b)))
    assert_close(Tensor(a).minimum(Tensor(b)), torch.minimum(torch.from_numpy(a), torch.from_numpy(b)))

@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax(axis):
    helper_test_op([(3, 5)], lambda x: x.softmax(axis), low=-5, high=5, atol=1e-6)

@pytest.mark.parametrize("axis", [-1, 0])
def test_log_softmax(axis):
    helper_test_op([(3, 5)], lambda x: x.log_softmax(axis), low=-5, high=5, atol=1e-5)

def test_softmax_large_values_stable():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]], dtype=np.float32)
    assert_close(Tensor(x).softmax(-1), torch.from_numpy(x).softmax(-1), atol=1e-6)
    assert_close(Tensor(x).log_softmax(-1), torch.from_numpy(x).log_softmax(-1), atol=1e-5)

def test_softmax_default_axis_is_last():
    x = _rand((2, 3), seed=8)
    assert_close(Tensor(x).softmax(), torch.from_numpy(x).softmax(-1), atol=1e-6)
    assert_close(Tensor(x).log_softmax(), torch.from_numpy(x).log_softmax(-1), atol=1e-5)

# ---------------------------------------------------------------------------------------------------------------------
# cast

@pytest.mark.parametrize("src,dst,vals", [
    ("float32", "int32", [-2.7, -1.5, -0.5, 0.0, 0.5, 1.5, 2.7, 100.9]),   # truncation toward zero
    ("float32", "bool", [-2.0, 0.0, 0.5, -0.0, 3.0]),
    ("bool", "float32", [True, False, True]),
    ("int32", "float32", [-5, 0, 7, 16777217]),
    ("int32", "int8", [300, -129, 127, -128, 255, 0]),                     # wraps like C/numpy
    ("uint8", "int8", [200, 127, 128, 0, 255]),
    ("int8", "uint8", [-1, -128, 5]),
    ("int32", "float16", [1, 2049, -7, 65504]),
    ("float32", "float16", [0.1, 1 / 3, 65504.0, 1e-4]),
    ("float16", "float32", [0.1, 1 / 3, -2.5]),
    ("int64", "int32", [2 ** 40 + 5, -(2 ** 33) - 1, 7]),
    ("float64", "float32", [1 / 3, 1e-30, -2.5]),
    ("float32", "uint8", [0.0, 1.9, 254.5, 100.1]),
    ("int32", "bool", [0, 1, -1, 5]),
])
def test_cast(src, dst, vals):
    npsrc = np.array(vals, dtype=src)
    ref = torch.from_numpy(npsrc).to(to_torch_dtype(getattr(dtypes, dst)))
    out = Tensor(npsrc).cast(getattr(dtypes, dst))
    assert out.dtype == getattr(dtypes, dst)
    assert_close(out, ref, atol=0, rtol=0)

@pytest.mark.parametrize("vals", [[1.0, 2.5, -3.0, 0.1, 1e30, 1.00390625, 3.14159]])
def test_cast_bfloat16(vals):
    x = np.array(vals, dtype=np.float32)
    out = Tensor(x).cast(dtypes.bfloat16)
    assert out.dtype == dtypes.bfloat16
    assert_close(out.float(), torch.from_numpy(x).bfloat16().float(), atol=0, rtol=0)

def test_cast_by_name():
    out = Tensor([1.5, -2.5]).cast("int32")
    assert out.dtype == dtypes.int32
    assert out.tolist() == [1, -2]

# ---------------------------------------------------------------------------------------------------------------------
# reductions

RED_AXES = [None, 0, 1, -1, (0, 2), (-1, 0), (0, 1, 2)]

def _torch_axis(axis):
    return tuple(range(3)) if axis is None else axis

@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axis", RED_AXES, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_reduce(op, axis, keepdim):
    x = _rand((2, 3, 4), seed=9)
    tx = torch.from_numpy(x)
    tfx = {"sum": torch.sum, "max": torch.amax, "min": torch.amin, "mean": torch.mean}[op]
    ref = tfx(tx, dim=_torch_axis(axis), keepdim=keepdim)
    out = getattr(Tensor(x), op)(axis=axis, keepdim=keepdim)
    assert_close(out, ref, atol=1e-6, rtol=1e-5)

def test_reduce_positional_axis_and_default():
    x = _rand((3, 4), seed=10)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).sum(), tx.sum(), atol=1e-5)
    assert_close(Tensor(x).sum(1), tx.sum(1), atol=1e-6)
    assert_close(Tensor(x).max(0), tx.amax(0))
    assert Tensor(x).sum().shape == ()

def test_reduce_large_sum_precision():
    # 1-D sum of 2^16 values: a naive float32 accumulation is still within this tolerance, a broken one is not
    x = _rand((1 << 16,), low=0.0, high=1.0, seed=11)
    assert_close(Tensor(x).sum(), torch.from_numpy(x.astype(np.float64)).sum().float(), rtol=1e-4)
    assert_close(Tensor(x).mean(), torch.from_numpy(x.astype(np.float64)).mean().float(), rtol=1e-4)

# tinygrad's accumulation dtypes: what sum returns for each input dtype
SUM_DTYPES = {"bool": "int32", "int8": "int32", "int16": "int32", "int32": "int32", "uint8": "uint32",
              "uint16": "uint32", "uint32": "uint32", "int64": "int64", "uint64": "uint64",
              "float16": "float16", "float32": "float32", "float64": "float64"}

@pytest.mark.parametrize("dtname", list(SUM_DTYPES))
def test_sum_dtype(dtname):
    if dtname == "bool": x = np.array([[True, False, True], [True, True, True]])
    elif dtname.startswith("u"): x = np.array([[200, 100, 250], [7, 0, 255]], dtype=dtname)
    else: x = np.array([[100, -100, 120], [-128, 127, 3]] if "int" in dtname else [[1.5, -2.25, 3.0], [0.5, 8, -1]],
                       dtype=dtname)
    out = Tensor(x).sum()
    assert out.dtype == getattr(dtypes, SUM_DTYPES[dtname])
    # values: numpy summing in a wide type (int8 values that overflow int8 must not wrap)
    wide = np.float64 if x.dtype.kind == "f" else np.int64
    assert out.item() == pytest.approx(float(x.astype(wide).sum()))
    out_ax = Tensor(x).sum(axis=1)
    assert out_ax.dtype == getattr(dtypes, SUM_DTYPES[dtname])
    np.testing.assert_allclose(out_ax.numpy().astype(np.float64), x.astype(wide).sum(axis=1).astype(np.float64))

def test_sum_bfloat16():
    vals = [[1.5, 2.0, -0.25], [8.0, 0.125, 3.0]]
    out = Tensor(vals, dtype=dtypes.bfloat16).sum(axis=1)
    assert out.dtype == dtypes.bfloat16
    assert_close(out.float(), torch.tensor(vals, dtype=torch.bfloat16).sum(1).float())

def test_sum_float16_accumulates_in_float32():
    # 4096 * 0.1 in float16 accumulation would stall far from 409.6 (the spacing at 256..512 is 0.25)
    x = np.full((4096,), 0.1, dtype=np.float16)
    out = Tensor(x).sum()
    assert out.dtype == dtypes.float16
    assert out.item() == pytest.approx(float(np.float16(x.astype(np.float32).sum())), rel=1e-3)

@pytest.mark.parametrize("dtname", ["int8", "int32", "uint8", "bool"])
def test_mean_of_ints_is_float(dtname):
    x = np.array([[1, 2, 4], [7, 0, 3]], dtype=dtname) if dtname != "bool" else np.array([[True, False, True]])
    out = Tensor(x).mean(axis=-1)
    assert dtypes.is_float(out.dtype)
    np.testing.assert_allclose(out.numpy(), x.astype(np.float64).mean(axis=-1), rtol=1e-6)
    assert Tensor(x).mean().item() == pytest.approx(float(x.astype(np.float64).mean()))

@pytest.mark.parametrize("dtname", ["int8", "int32", "uint8", "int64", "float16"])
def test_max_min_keep_dtype(dtname):
    x = np.array([[1, -2, 4], [7, 0, -3]] if not dtname.startswith("u") else [[1, 200, 4], [7, 0, 3]], dtype=dtname)
    for op, npop in (("max", np.max), ("min", np.min)):
        out = getattr(Tensor(x), op)(axis=1)
        assert out.dtype == getattr(dtypes, dtname)
        np.testing.assert_array_equal(out.numpy(), npop(x, axis=1))
        assert getattr(Tensor(x), op)().item() == npop(x)

@pytest.mark.parametrize("dtname", ["int8", "uint8", "int32", "int64", "uint32"])
def test_int_reduce_identity_extremes(dtname):
    # max/min must start from the dtype's extremes: all-minimum input to max, all-maximum input to min
    lo, hi = np.iinfo(dtname).min, np.iinfo(dtname).max
    assert Tensor(np.full((2, 5), lo, dtype=dtname)).max(axis=1).tolist() == [int(lo)] * 2
    assert Tensor(np.full((2, 5), hi, dtype=dtname)).min(axis=1).tolist() == [int(hi)] * 2

def test_float_reduce_all_inf():
    x = np.full((2, 3), -np.inf, dtype=np.float32)
    assert Tensor(x).max(axis=1).tolist() == [-math.inf] * 2
    assert Tensor(-x).min().item() == math.inf

def test_count_with_bool_sum():
    x = _rand((5, 7), seed=50)
    cnt = (Tensor(x) > 0).sum(axis=1)
    assert dtypes.is_int(cnt.dtype)
    np.testing.assert_array_equal(cnt.numpy(), (x > 0).sum(axis=1))
    assert (Tensor(x) > 0).float().mean().item() == pytest.approx(float((x > 0).mean()), rel=1e-6)

def test_max_negative_values_only():
    # an accumulator initialised with 0 instead of -inf would give 0 here
    x = np.array([[-5.0, -3.0, -4.0], [-1e30, -2e30, -3e30]], dtype=np.float32)
    assert_close(Tensor(x).max(axis=1), x.max(axis=1))
    assert_close(-Tensor(-x).min(axis=1), x.max(axis=1))

def test_reduce_of_expression_and_chain():
    a, b = _rand((4, 6), seed=12), _rand((4, 6), seed=13)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close((Tensor(a) * Tensor(b)).sum(axis=1).exp(), (ta * tb).sum(1).exp(), atol=1e-5, rtol=1e-5)
    assert_close(Tensor(a).sum(axis=0).max(), ta.sum(0).max(), atol=1e-6)
    # a reduce feeding an elementwise op on its input (needs the reduce's result broadcast back)
    assert_close(Tensor(a) - Tensor(a).mean(axis=1, keepdim=True), ta - ta.mean(1, keepdim=True), atol=1e-6)

# ---------------------------------------------------------------------------------------------------------------------
# movement ops

def test_reshape():
    x = _rand((2, 3, 4), seed=14)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).reshape(6, 4), tx.reshape(6, 4))
    assert_close(Tensor(x).reshape((4, 6)), tx.reshape((4, 6)))
    assert_close(Tensor(x).reshape(-1), tx.reshape(-1))
    assert_close(Tensor(x).reshape(2, -1, 2), tx.reshape(2, -1, 2))
    assert_close(Tensor(x).reshape((1, 24, 1)), tx.reshape((1, 24, 1)))
    assert_close(Tensor(np.array(3.0, dtype=np.float32)).reshape(1, 1), torch.tensor(3.0).reshape(1, 1))
    assert_close(Tensor([[5.0]]).reshape(()), torch.tensor([[5.0]]).reshape(()))

def test_permute():
    x = _rand((2, 3, 4), seed=15)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).permute(2, 0, 1), tx.permute(2, 0, 1))
    assert_close(Tensor(x).permute((1, 2, 0)), tx.permute((1, 2, 0)))
    assert_close(Tensor(x).permute(-1, 0, 1), tx.permute(-1, 0, 1))

def test_expand():
    x = _rand((1, 4), seed=16)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).expand(3, 4), tx.expand(3, 4))
    assert_close(Tensor(x).expand((3, -1)), tx.expand((3, -1)))
    assert_close(Tensor(x).expand(2, 3, 4), tx.expand(2, 3, 4))   # adds leading dims like torch
    y = _rand((3, 1), seed=17)
    assert_close(Tensor(y).expand(3, 5) * 2, torch.from_numpy(y).expand(3, 5) * 2)

def test_pad_nested():
    x = _rand((2, 3), seed=18)
    tx = torch.from_numpy(x)
    # nested form: one (before, after) per dim in dim order; torch's F.pad lists the last dim first
    assert_close(Tensor(x).pad(((1, 1), (2, 0))), torch.nn.functional.pad(tx, (2, 0, 1, 1)))
    assert_close(Tensor(x).pad(((0, 0), (0, 3))), torch.nn.functional.pad(tx, (0, 3)))
    # padded values are zeros even when the padded tensor is then fed through an op with f(0) != 0
    assert_close(Tensor(x).pad(((1, 0), (0, 1))).exp(), torch.nn.functional.pad(tx, (0, 1, 1, 0)).exp(), atol=1e-6)
    assert_close((Tensor(x).exp()).pad(((1, 0), (0, 1))), torch.nn.functional.pad(tx.exp(), (0, 1, 1, 0)), atol=1e-6)

def test_pad_then_reduce():
    # padded zeros take part in the reduce: max of negatives with padding is 0, exp of padding adds 1 each
    x = _rand((3, 4), low=-3, high=-1, seed=51)
    tx = torch.from_numpy(x)
    F = torch.nn.functional
    assert_close(Tensor(x).pad(((0, 0), (1, 2))).max(axis=1), F.pad(tx, (1, 2)).amax(1))
    assert_close(Tensor(x).pad(((2, 0), (0, 0))).min(axis=0), F.pad(tx, (0, 0, 2, 0)).amin(0))
    assert_close(Tensor(x).pad(((0, 0), (1, 2))).exp().sum(axis=1), F.pad(tx, (1, 2)).exp().sum(1), atol=1e-6)
    assert_close(Tensor(x).shrink(((1, 3), (1, 4))).sum(axis=0), tx[1:3, 1:4].sum(0), atol=1e-6)
    assert_close(Tensor(x).flip(1).pad(((0, 0), (0, 1))).log_softmax(-1),
                 F.pad(tx.flip(1), (0, 1)).log_softmax(-1), atol=1e-5)

def test_shrink():
    x = _rand((4, 5), seed=19)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).shrink(((0, 2), (1, 3))), tx[0:2, 1:3])
    assert_close(Tensor(x).shrink(((1, 1), (0, 5))), tx[1:1, 0:5])

def test_pad_shrink_none_means_whole_dim():
    # tinygrad: None in the nested form leaves that dim alone
    x = _rand((2, 3), seed=18)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).pad((None, (1, 2))), torch.nn.functional.pad(tx, (1, 2)))
    assert_close(Tensor(x).shrink((None, (1, 3))), tx[:, 1:3])

def test_flip():
    x = _rand((2, 3, 4), seed=20)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).flip(0), tx.flip(0))
    assert_close(Tensor(x).flip(-1), tx.flip(-1))
    assert_close(Tensor(x).flip((0, 2)), tx.flip((0, 2)))

def test_transpose_and_T():
    x = _rand((2, 3, 4), seed=21)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).transpose(), tx.transpose(1, 0))  # tinygrad default: dim0=1, dim1=0
    assert_close(Tensor(x).transpose(0, 2), tx.transpose(0, 2))
    assert_close(Tensor(x).transpose(-1, -2), tx.transpose(-1, -2))
    y = _rand((3, 5), seed=22)
    assert_close(Tensor(y).T, torch.from_numpy(y).T)
    assert_close(Tensor(y).transpose(dim0=1, dim1=0), torch.from_numpy(y).transpose(1, 0))

def test_contiguous():
    y = _rand((3, 5), seed=23)
    ty = torch.from_numpy(y)
    t = Tensor(y).T.contiguous()
    assert_close(t, ty.T.contiguous())
    assert_close(t.reshape(15), ty.T.contiguous().reshape(15))

def test_movement_chain():
    x = _rand((2, 3, 4), seed=24)
    tx = torch.from_numpy(x)
    f = lambda t: t.permute(2, 0, 1).reshape(4, 6).flip(1)[1:3] * 2 + 1
    assert_close(f(Tensor(x)), f(tx))
    g = lambda t: t.reshape(6, 4)[::2].permute(1, 0).expand(2, 4, 3)
    assert_close(g(Tensor(x)), g(tx))

SLICES = [
    ("[::2, 1:5]", lambda t: t[::2, 1:5]), ("[1]", lambda t: t[1]), ("[-1]", lambda t: t[-1]),
    ("[..., 0]", lambda t: t[..., 0]), ("[None]", lambda t: t[None]), ("[1:-1]", lambda t: t[1:-1]),
    ("[:, None, 2]", lambda t: t[:, None, 2]), ("[1, -2]", lambda t: t[1, -2]),
    ("[:, ::3]", lambda t: t[:, ::3]), ("[-3:, :-2]", lambda t: t[-3:, :-2]), ("[2:2]", lambda t: t[2:2]),
    ("[..., None]", lambda t: t[..., None]), ("[:10, 4:100]", lambda t: t[:10, 4:100]),
]

@pytest.mark.parametrize("name,fxn", SLICES, ids=[s[0] for s in SLICES])
def test_basic_indexing(name, fxn):
    x = _rand((4, 6), seed=25)
    assert_close(fxn(Tensor(x)), fxn(torch.from_numpy(x)))

def test_negative_step_numpy():
    # torch has no negative slice steps: numpy is the reference
    x = _rand((5, 6), seed=26)
    assert_close(Tensor(x)[::-2, 1::-1], x[::-2, 1::-1])
    assert_close(Tensor(x)[3:0:-1, -1:-5:-2], x[3:0:-1, -1:-5:-2])

def test_indexing_3d():
    x = _rand((2, 3, 4), seed=27)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x)[1, :, ::2], tx[1, :, ::2])
    assert_close(Tensor(x)[..., 1:3][0], tx[..., 1:3][0])
    assert_close(Tensor(x)[:, -1, None, :], tx[:, -1, None, :])

# ---------------------------------------------------------------------------------------------------------------------
# matmul

MATMUL_SHAPES = [((3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)), ((2, 3, 4), (2, 4, 5)),
                 ((2, 3, 4), (4, 5)), ((1, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((33, 65), (65, 17))]

@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(shapes):
    helper_test_op(list(shapes), lambda a, b: a @ b, atol=1e-5, rtol=1e-5)

def test_matmul_method_and_dot():
    a, b = _rand((3, 4), seed=28), _rand((4, 2), seed=29)
    ref = torch.from_numpy(a) @ torch.from_numpy(b)
    assert_close(Tensor(a).matmul(Tensor(b)), ref, atol=1e-5)
    assert_close(Tensor(a).dot(Tensor(b)), ref, atol=1e-5)
    v = _rand((4,), seed=30)
    assert_close(Tensor(v).dot(Tensor(v)), torch.from_numpy(v).dot(torch.from_numpy(v)), atol=1e-5)

def test_matmul_dtype_reverse_and_keywords():
    # tinygrad's signature: matmul(x, reverse=False, dtype=None), dot(w, dtype=None)
    a, b = _rand((3, 4), seed=31), _rand((4, 5), seed=32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close(Tensor(b).matmul(x=Tensor(a), reverse=True), ta @ tb, atol=1e-5)
    half = Tensor(a).dot(w=Tensor(b), dtype="float16")
    assert half.dtype == dtypes.float16
    assert_close(half, (ta @ tb).half(), atol=1e-3, rtol=1e-3)
    # half operands with a float32 result: exact float32 products, as a float32 product of the half values
    ha, hb = ta.half(), tb.half()
    wide = Tensor(ha.numpy()).matmul(Tensor(hb.numpy()), dtype=dtypes.float32)
    assert wide.dtype == dtypes.float32
    assert_close(wide, ha.float() @ hb.float(), atol=1e-5)
    ints = Tensor(np.arange(6, dtype=np.int32).reshape(2, 3)).dot(Tensor(np.ones((3, 2), np.int32)), dtype="float32")
    assert ints.dtype == dtypes.float32 and ints.tolist() == [[3.0, 3.0], [12.0, 12.0]]

def test_clone_to_device():
    x = Tensor(_rand((2, 3), seed=33))
    c = x.clone(device="CPU")
    assert c.device == "CPU" and c.uop is not x.uop
    assert_close(c, torch.from_numpy(x.numpy()))

@pytest.mark.parametrize("source", ["realized", "lazy, realized after the clone", "sharded"])
def test_clone_is_new_memory(source: str):
    # a write to the tensor after clone() leaves the clone alone, as torch's clone (contiguous() of a realized tensor
    # is the tensor itself, so a clone made by it changed with the tensor)
    base = _rand((2, 3), seed=34)
    ref = torch.from_numpy(base) + 1
    ref_clone = ref.clone()
    ref.mul_(10)
    if source == "sharded":
        t = (Tensor(base) + 1).shard(("CPU:0", "CPU:1"), axis=0).realize()
    else:
        t = Tensor(base).realize() + 1
        if source == "realized": t.realize()
    c = t.clone()
    t.realize()
    t.assign(t * 10).realize()
    assert_close(c, ref_clone)
    assert_close(t, ref)

def test_clone_passes_gradients():
    w, tw = Tensor(_rand((4,), seed=35), requires_grad=True), torch.from_numpy(_rand((4,), seed=35)).requires_grad_()
    (w.clone() * w).sum().backward()
    (tw.clone() * tw).sum().backward()
    assert_close(w.grad, tw.grad)

def test_matmul_int():
    a = np.arange(12, dtype=np.int32).reshape(3, 4) - 5
    b = np.arange(8, dtype=np.int32).reshape(4, 2) * 3 - 7
    out = Tensor(a) @ Tensor(b)
    assert out.dtype == dtypes.int32
    assert_close(out, a.astype(np.int64) @ b.astype(np.int64))

def test_matmul_larger_precision():
    helper_test_op([(64, 256), (256, 48)], lambda a, b: a @ b, low=-1, high=1, atol=1e-4, rtol=1e-4)

def test_matmul_then_elementwise():
    helper_test_op([(8, 16), (16, 8), (8,)], lambda a, b, c: (a @ b + c).relu(), atol=1e-5)

# ---------------------------------------------------------------------------------------------------------------------
# float16 / bfloat16 arithmetic (looser tolerances)

@pytest.mark.parametrize("name,fxn,low,high", [
    ("add", lambda x, y: x + y, -2, 2), ("mul", lambda x, y: x * y, -2, 2), ("div", lambda x, y: x / y, 0.5, 2),
    ("exp", lambda x, y: x.exp(), -4, 4), ("sqrt", lambda x, y: x.sqrt(), 0, 4), ("sum", lambda x, y: x.sum(1), -2, 2),
    ("max", lambda x, y: x.max(1) if isinstance(x, Tensor) else x.amax(1), -2, 2),
    ("matmul", lambda x, y: x @ y.T, -1, 1),
])
def test_float16_ops(name, fxn, low, high):
    a, b = _rand((4, 8), "float16", low, high, seed=31), _rand((4, 8), "float16", low, high, seed=32)
    ref = fxn(torch.from_numpy(a), torch.from_numpy(b))
    out = fxn(Tensor(a), Tensor(b))
    assert out.dtype == dtypes.float16
    assert_close(out, ref, atol=1e-2, rtol=2e-3)

@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "sin"])
def test_float16_transcendental_precision(name):
    # torch computes in float32 and rounds once (<= 0.5 ulp); allow 2 ulp (2^-9 relative) over a wide normal range
    lo, hi = {"exp": (-9.0, 11.0), "log": (0.01, 60000.0), "sqrt": (0.0, 60000.0), "sin": (-6.0, 6.0)}[name]
    x = np.linspace(lo, hi, 1001).astype(np.float16)
    ref = getattr(torch.from_numpy(x), name)()
    out = getattr(Tensor(x), name)()
    assert out.dtype == dtypes.float16
    assert_close(out, ref, atol=2e-3 if name in ("log", "sin") else 0, rtol=2 ** -9)

@pytest.mark.parametrize("name,fxn", [("add", lambda x, y: x + y), ("mul", lambda x, y: x * y),
                                      ("exp", lambda x, y: x.exp()), ("max", lambda x, y: x.maximum(y))])
def test_bfloat16_ops(name, fxn):
    va, vb = [1.5, -2.0, 0.3125, 7.0, -0.1], [0.5, 3.0, -1.25, 0.0078125, 2.0]
    ref = fxn(torch.tensor(va, dtype=torch.bfloat16), torch.tensor(vb, dtype=torch.bfloat16))
    out = fxn(Tensor(va, dtype=dtypes.bfloat16), Tensor(vb, dtype=dtypes.bfloat16))
    assert out.dtype == dtypes.bfloat16
    assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)

# ---------------------------------------------------------------------------------------------------------------------
# integer overflow wraps (as numpy and C two's complement do)

@pytest.mark.parametrize("dtname,a,b,op", [
    ("int8", [100, -100, 127], [100, -100, 1], "add"), ("int8", [100, -50, 64], [3, 3, 2], "mul"),
    ("uint8", [250, 0, 128], [10, 1, 128], "add"), ("uint8", [0, 5, 3], [1, 10, 4], "sub"),
    ("int16", [30000, -30000, 200], [30000, -30000, 200], "mul"), ("int32", [2 ** 31 - 1, -2 ** 31, 65536],
                                                                     [1, -1, 65536], "add"),
    ("int32", [2 ** 31 - 1, 65536, -7], [2, 65536, 3], "mul"), ("uint32", [0, 4000000000], [1, 500000000], "sub"),
])
def test_int_overflow_wraps(dtname, a, b, op):
    na, nb = np.array(a, dtype=dtname), np.array(b, dtype=dtname)
    with np.errstate(over="ignore"):
        ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op](na, nb)
    fxn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y}[op]
    out = fxn(Tensor(na), Tensor(nb))
    assert out.dtype == getattr(dtypes, dtname)
    np.testing.assert_array_equal(out.numpy(), ref)

def test_int_scalar_wraps():
    na = np.array([100, -100, 5], dtype=np.int8)
    out = Tensor(na) + 100
    assert out.dtype == dtypes.int8
    np.testing.assert_array_equal(out.numpy(), (na.astype(np.int32) + 100).astype(np.int8))

# ---------------------------------------------------------------------------------------------------------------------
# nan / inf propagation (torch semantics)

def test_nan_inf_elementwise():
    x = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 100.0, -100.0], dtype=np.float32)
    tx = torch.from_numpy(x)
    with np.errstate(all="ignore"):
        for name in ("exp", "log", "sqrt", "log2", "exp2", "reciprocal"):
            assert_close(getattr(Tensor(x), name)(), getattr(tx, name)(), atol=1e-6, rtol=1e-5)
        assert_close(Tensor(x) / 0.0, tx / 0.0)
        assert_close(Tensor(x) * 0.0, tx * 0.0)
        assert_close(Tensor(x) - Tensor(x), tx - tx)

def test_exp_overflow_log_zero_sqrt_negative():
    assert Tensor([100.0]).exp().item() == math.inf
    assert Tensor([0.0]).log().item() == -math.inf
    assert math.isnan(Tensor([-1.0]).sqrt().item())
    assert math.isnan(Tensor([-1.0]).log().item())
    assert Tensor([-200.0]).exp().item() == 0.0

def test_nan_in_maximum_and_max_reduce():
    x = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, -1.0]], dtype=np.float32)
    y = np.array([[np.nan, 0.0, 2.0], [2.0, np.nan, -3.0]], dtype=np.float32)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    assert_close(Tensor(x).max(axis=1), tx.amax(1))
    assert_close(Tensor(x).min(axis=1), tx.amin(1))
    assert_close(Tensor(x).maximum(Tensor(y)), torch.maximum(tx, ty))
    assert_close(Tensor(x).minimum(Tensor(y)), torch.minimum(tx, ty))
    assert math.isnan(Tensor(x).max().item())

def test_inf_in_reductions():
    x = np.array([[1.0, np.inf, 3.0], [-np.inf, 5.0, -1.0], [np.inf, -np.inf, 0.0]], dtype=np.float32)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x).sum(axis=1), tx.sum(1))
    assert_close(Tensor(x).max(axis=1), tx.amax(1))
    assert_close(Tensor(x).min(axis=0), tx.amin(0))
    # torch gives a whole row of nan when +inf is present (inf - inf); the row with only -inf is well defined
    assert_close(Tensor(x).softmax(-1)[1:2], tx.softmax(-1)[1:2])

# ---------------------------------------------------------------------------------------------------------------------
# edge cases: 0-d and empty tensors

def test_zero_dim_tensors():
    a, b = Tensor(3.0), Tensor(2.0)
    assert (a + b).shape == ()
    assert (a * b).item() == 6.0
    assert (a + Tensor.ones(2, 3)).numpy().tolist() == [[4.0] * 3] * 2
    assert a.exp().item() == pytest.approx(math.exp(3.0), rel=1e-6)
    assert Tensor(5).sum().item() == 5
    assert Tensor(5.0).max().item() == 5.0
    assert a.reshape(1).tolist() == [3.0]

def test_empty_tensors():
    e = Tensor.zeros(3, 0)
    assert e.shape == (3, 0)
    assert e.numpy().shape == (3, 0)
    assert (e + 1).numpy().shape == (3, 0)
    assert (e * e).exp().shape == (3, 0)
    np.testing.assert_array_equal(e.sum(axis=1).numpy(), np.zeros(3, dtype=np.float32))
    assert e.sum().item() == 0.0
    assert e.sum(axis=0).shape == (0,)
    assert e.max(axis=0).shape == (0,)  # reducing a non-empty axis of an empty tensor is fine (torch agrees)
    assert e.max(axis=0).numpy().shape == (0,)
    assert Tensor([]).shape == (0,)
    assert Tensor([]).sum().item() == 0.0
    assert Tensor.zeros(0, dtype=dtypes.int32).sum().item() == 0
    assert all(math.isnan(v) for v in e.mean(axis=1).tolist())  # torch: mean over nothing is nan
    assert (Tensor.zeros(0, 4) @ Tensor.zeros(4, 3)).shape == (0, 3)
    np.testing.assert_array_equal((Tensor.zeros(2, 0) @ Tensor.zeros(0, 3)).numpy(), np.zeros((2, 3), np.float32))
    # batched rows times one matrix, with an empty inner or row dimension (NumPy's shapes and zeros)
    for xs, ws in (((2, 3, 0), (0, 5)), ((2, 0, 4), (4, 5)), ((0, 3, 4), (4, 5))):
        want = np.zeros(xs, np.float32) @ np.zeros(ws, np.float32)
        np.testing.assert_array_equal((Tensor.ones(*xs) @ Tensor.ones(*ws)).numpy(), want)

def test_max_over_empty_raises():
    # torch raises for max/min over an empty axis; a -inf answer would silently hide the bug
    for f in (lambda: Tensor.zeros(3, 0).max(axis=1).realize(), lambda: Tensor([]).max().realize(),
              lambda: Tensor.zeros(3, 0).min(axis=1).realize()):
        with pytest.raises((ValueError, RuntimeError, IndexError)) as exc:
            f()
        assert any(w in str(exc.value).lower() for w in ("empty", "zero", "size", "numel"))

# ---------------------------------------------------------------------------------------------------------------------
# odd and larger sizes: these reach the optimizer's upcast/unroll/vector paths, their remainders, and the multi-threaded
# split of big kernels (>= 4 MB touched), which small shapes never exercise

BIG = (1031, 1027)   # 4.2 MB of float32, prime-ish dims so no vector width or thread count divides them

def test_big_elementwise_odd_size():
    helper_test_op([BIG, BIG, (1027,)], lambda x, y, z: ((x * y + z).relu() * 0.5), atol=1e-6)

@pytest.mark.parametrize("axis", [0, 1, None])
def test_big_sum_odd_size(axis):
    x = _rand(BIG, low=0.0, high=1.0, seed=40)
    ref = torch.from_numpy(x).double().sum(dim=axis if axis is not None else (0, 1)).float()
    assert_close(Tensor(x).sum(axis=axis), ref, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("axis", [0, 1])
def test_big_max_odd_size(axis):
    x = _rand(BIG, seed=41)
    x[517, 3], x[2, 1026] = 50.0, 60.0   # the maxima sit in a loop remainder
    assert_close(Tensor(x).max(axis=axis), torch.from_numpy(x).amax(axis))

def test_big_reduce_of_permuted_input():
    x = _rand((257, 1031), seed=42)
    assert_close(Tensor(x).T.sum(axis=1), torch.from_numpy(x).T.sum(1), rtol=1e-5, atol=1e-4)
    assert_close(Tensor(x).T.contiguous().max(axis=0), torch.from_numpy(x).T.amax(0))

def test_big_softmax():
    helper_test_op([(37, 1003)], lambda x: x.softmax(-1), low=-10, high=10, atol=1e-7, rtol=1e-4)

def test_big_int_sum():
    n = 50_000  # n*(n-1)/2 = 1.25e9 still fits the int32 accumulator
    assert Tensor.arange(n).sum().item() == n * (n - 1) // 2
    assert Tensor.ones(3001, dtype=dtypes.int8).sum().item() == 3001

@pytest.mark.parametrize("shapes", [((127, 255), (255, 63)), ((1, 513), (513, 129)), ((65, 1), (1, 67))], ids=str)
def test_matmul_odd_sizes(shapes):
    helper_test_op(list(shapes), lambda a, b: a @ b, low=-1, high=1, atol=1e-4, rtol=1e-4)

def test_matmul_transposed_inputs():
    a, b = _rand((96, 80), seed=43), _rand((112, 96), seed=44)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    assert_close(Tensor(a).T @ Tensor(b).T, ta.T @ tb.T, atol=1e-4, rtol=1e-4)

def test_expand_then_reduce():
    x = _rand((3, 1), seed=45)
    assert_close(Tensor(x).expand(3, 1000).sum(axis=1), torch.from_numpy(x).expand(3, 1000).sum(1), rtol=1e-5)
    assert_close(Tensor(x).pad(((0, 0), (5, 7))).sum(axis=1), torch.from_numpy(x).sum(1), rtol=1e-6)

def test_big_strided_slices():
    x = _rand((1000, 600), seed=46)
    tx = torch.from_numpy(x)
    assert_close(Tensor(x)[::3, 7::5] * 2, tx[::3, 7::5] * 2)
    assert_close(Tensor(x)[::-7, ::-3], x[::-7, ::-3])

# ---------------------------------------------------------------------------------------------------------------------
# a mix: a small MLP forward, compared with torch

def test_small_mlp_forward():
    x, w1, b1, w2 = _rand((8, 16), seed=33), _rand((16, 32), seed=34), _rand((32,), seed=35), _rand((32, 10), seed=36)
    f = lambda x, w1, b1, w2: (x @ w1 + b1).relu() @ w2
    ref = f(*[torch.from_numpy(v) for v in (x, w1, b1, w2)]).log_softmax(-1)
    out = f(*[Tensor(v) for v in (x, w1, b1, w2)]).log_softmax(-1)
    assert_close(out, ref, atol=1e-4, rtol=1e-4)

# ---------------------------------------------------------------------------------------------------------------------
# the exhaustive dtype x op matrix (slow: one kernel per cell)

MATRIX_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                 "float32", "float64"]
MATRIX_OPS = {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "sub": lambda x, y: x - y,
              "lt": lambda x, y: x < y, "eq": lambda x, y: x == y, "max": lambda x, y: x.maximum(y),
              "where": lambda x, y: (x != y).where(x, y), "sum": lambda x, y: x.sum(0), "neg": lambda x, y: -x}

# subtraction and negation of bools have no numpy/torch meaning (both raise), so those cells are left out
MATRIX_CELLS = [(d, op) for d in MATRIX_DTYPES for op in MATRIX_OPS if not (d == "bool" and op in ("sub", "neg"))]

@pytest.mark.slow
@pytest.mark.parametrize("dtname,op", MATRIX_CELLS)
def test_dtype_op_matrix(dtname, op):
    np_dt = np.dtype(dtname)
    a = _rand((3, 5), dtname, 0, 9, seed=37) if dtname != "bool" else _rand((3, 5), "bool", seed=37)
    b = _rand((3, 5), dtname, 0, 9, seed=38) if dtname != "bool" else _rand((3, 5), "bool", seed=38)
    fxn = MATRIX_OPS[op]
    with np.errstate(all="ignore"):
        na, nb = a.astype(np_dt), b.astype(np_dt)
        # numpy as the reference (torch lacks arithmetic on uint16/32/64); sums in the tinygrad accumulation dtype
        ref = {"add": lambda: na + nb, "mul": lambda: na * nb, "sub": lambda: na - nb, "lt": lambda: na < nb,
               "eq": lambda: na == nb, "max": lambda: np.maximum(na, nb), "where": lambda: np.where(na != nb, na, nb),
               "sum": lambda: na.sum(0, dtype=to_np_dtype(getattr(dtypes, SUM_DTYPES[dtname]))),
               "neg": lambda: -na}[op]()
    if dtname == "bool" and op in ("add", "mul"): ref = ref.astype(bool)
    out = fxn(Tensor(na), Tensor(nb))
    assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_cat_and_stack():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(9, dtype=np.float32).reshape(3, 3) * -1
    np.testing.assert_array_equal(Tensor(a).cat(Tensor(b), dim=0).numpy(), np.concatenate([a, b], 0))
    np.testing.assert_array_equal(Tensor(a).cat(Tensor(a), Tensor(a), dim=-1).numpy(), np.concatenate([a, a, a], -1))
    np.testing.assert_array_equal(Tensor.stack(Tensor(a), Tensor(a * 2), dim=1).numpy(), np.stack([a, a * 2], 1))
    ints = Tensor([1, 2]).cat(Tensor([3.5]))
    assert ints.dtype == dtypes.float32 and ints.tolist() == [1.0, 2.0, 3.5]
    with pytest.raises(ValueError, match="differ"):
        Tensor(a).cat(Tensor(b), dim=1)

@pytest.mark.parametrize("axis,keepdim", [(None, False)] + [(a, k) for a in (0, 1, -1) for k in (False, True)])
def test_argmax_argmin(axis, keepdim):
    x = np.array([[3, 1, 4, 1], [5, 9, 2, 6], [5, 3, 5, 9]], dtype=np.float32)  # ties: first index wins
    tx = torch.from_numpy(x)
    targs = {} if axis is None else {"dim": axis, "keepdim": keepdim}
    np.testing.assert_array_equal(Tensor(x).argmax(axis, keepdim).numpy(), tx.argmax(**targs).numpy())
    np.testing.assert_array_equal(Tensor(x).argmin(axis, keepdim).numpy(), tx.argmin(**targs).numpy())
    xi = x.astype(np.int32)
    ti = torch.from_numpy(xi)
    np.testing.assert_array_equal(Tensor(xi).argmax(axis, keepdim).numpy(), ti.argmax(**targs).numpy())
    np.testing.assert_array_equal(Tensor(xi).argmin(axis, keepdim).numpy(), ti.argmin(**targs).numpy())

def test_argmax_nan_and_scalar():
    x = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    assert Tensor(x).argmax().item() == torch.from_numpy(x).argmax().item()
    assert Tensor(2.5).argmax().item() == 0
    with pytest.raises(ValueError, match="empty"):
        Tensor.zeros(0).argmax()
