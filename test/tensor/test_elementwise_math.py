"""Activations and math functions compared with torch (CPU): values, dtypes and gradients on random inputs, special
values (inf, nan, -0.0), large arguments, half precision, non-contiguous inputs and errors.

Compiles dominate the run time, so every case is built lazily and all are realized in one batch by a fixture."""
from __future__ import annotations
from typing import Callable
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.dtype import to_torch_dtype

torch.set_num_threads(1)
F = torch.nn.functional

def _rand(shape: tuple[int, ...], low: float, high: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, size=shape)

# (name, fusegrad fn, torch fn, domain): unary functions checked in float32 and float64 with gradients
UNARY: list[tuple[str, Callable, Callable, tuple[float, float]]] = [
    ("gelu_tanh", lambda x: x.gelu(), lambda x: F.gelu(x, approximate="tanh"), (-4, 4)),
    ("gelu_none", lambda x: x.gelu(approximate="none"), lambda x: F.gelu(x), (-4, 4)),
    ("quick_gelu", lambda x: x.quick_gelu(), lambda x: x * torch.sigmoid(1.702 * x), (-4, 4)),
    ("erf", lambda x: x.erf(), torch.erf, (-5, 5)),
    ("elu", lambda x: x.elu(), F.elu, (-3, 3)),
    ("elu_alpha", lambda x: x.elu(0.5), lambda x: F.elu(x, 0.5), (-3, 3)),
    ("celu", lambda x: x.celu(2.0), lambda x: F.celu(x, 2.0), (-3, 3)),
    ("selu", lambda x: x.selu(), lambda x: 1.0507 * torch.where(x > 0, x, 1.67326 * torch.expm1(x)), (-3, 3)),
    ("softplus", lambda x: x.softplus(), F.softplus, (-30, 30)),
    ("softplus_beta", lambda x: x.softplus(2.0), lambda x: F.softplus(x, 2.0), (-15, 15)),
    ("softsign", lambda x: x.softsign(), F.softsign, (-5, 5)),
    ("mish", lambda x: x.mish(), F.mish, (-5, 5)),
    ("hardswish", lambda x: x.hardswish(), F.hardswish, (-5, 5)),
    ("hardsigmoid", lambda x: x.hardsigmoid(), F.hardsigmoid, (-5, 5)),
    ("hardtanh", lambda x: x.hardtanh(), F.hardtanh, (-3, 3)),
    ("hardtanh_range", lambda x: x.hardtanh(-0.5, 2), lambda x: F.hardtanh(x, -0.5, 2), (-3, 3)),
    ("relu6", lambda x: x.relu6(), F.relu6, (-3, 9)),
    ("swish", lambda x: x.swish(), F.silu, (-5, 5)),
    ("logsigmoid", lambda x: x.logsigmoid(), F.logsigmoid, (-30, 30)),
    ("sin", lambda x: x.sin(), torch.sin, (-10, 10)),
    ("cos", lambda x: x.cos(), torch.cos, (-10, 10)),
    ("tan", lambda x: x.tan(), torch.tan, (-1.4, 1.4)),
    ("asin", lambda x: x.asin(), torch.asin, (-0.99, 0.99)),
    ("acos", lambda x: x.acos(), torch.acos, (-0.99, 0.99)),
    ("atan", lambda x: x.atan(), torch.atan, (-10, 10)),
    ("sinh", lambda x: x.sinh(), torch.sinh, (-5, 5)),
    ("cosh", lambda x: x.cosh(), torch.cosh, (-5, 5)),
    ("tanh", lambda x: x.tanh(), torch.tanh, (-5, 5)),
    ("asinh", lambda x: x.asinh(), torch.asinh, (-10, 10)),
    ("acosh", lambda x: x.acosh(), torch.acosh, (1.01, 10)),
    ("atanh", lambda x: x.atanh(), torch.atanh, (-0.99, 0.99)),
    ("log10", lambda x: x.log10(), torch.log10, (0.01, 100)),
    ("square", lambda x: x.square(), torch.square, (-3, 3)),
]

# special values every unary function must get right (nan where torch gives nan, exact infinities and zeros)
SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -1e-7, 0.5, -0.5, 1.0, -1.0, 2.5, -3.5,
           3.0, 20.0, -20.0, 100.0, -100.0, 1e4, -9999.5, 1e30, -1e30]
# sin/cos/tan of large arguments need an exact range reduction
LARGE = list(np.linspace(-1e4, 1e4, 37)) + [12345.678, 3.0e4, 2 ** 20 + 0.5]
BINARY_SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.5, -2.5, 7.0, -7.0, 1e10]

# half precision for a sample (each case is one more kernel to compile; test_half_dtypes_keep_dtype has more)
HALF_CHECKED = {"gelu_none", "erf", "elu", "softplus", "hardswish", "logsigmoid", "cos", "acos", "tanh", "acosh"}
ODD = {"erf", "softsign", "sin", "tan", "asin", "atan", "sinh", "tanh", "asinh", "atanh", "gelu_tanh", "square"}

def _torch_unary(fn: Callable, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x, requires_grad=True)
    out = fn(t)
    (g,) = torch.autograd.grad(out.sum(), t)
    return out.detach().numpy(), g.numpy()

@pytest.fixture(scope="module")
def realized() -> dict:
    """Every lazy result of this file, realized together (one compile batch)."""
    res: dict = {}
    for i, (name, fg, _, (lo, hi)) in enumerate(UNARY):
        for dt in ("float32", "float64"):
            x_np = _rand((4, 5), lo, hi, i).astype(dt)
            x = Tensor(x_np)
            out = fg(x)
            res[(name, dt)] = (x_np, out, out.sum().gradient(x)[0])
        # non-contiguous input: a transposed and flipped view
        x_np = _rand((5, 3), lo, hi, i + 100).astype("float32")
        res[(name, "view")] = (x_np, fg(Tensor(x_np).T.flip(0)), None)
        res[(name, "special")] = (np.array(SPECIAL), fg(Tensor(np.array(SPECIAL))), None)
        if name in HALF_CHECKED: res[(name, "half")] = (x_np, fg(Tensor(x_np).half()), None)
    for name in ("sin", "cos", "tan"):
        for dt in ("float32", "float64"):
            res[(name, "large", dt)] = getattr(Tensor(np.array(LARGE, dtype=dt)), name)()
    Tensor.realize(*[t for v in res.values() for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, Tensor)])
    return res

@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("case", UNARY, ids=[c[0] for c in UNARY])
def test_unary(realized, case, dt):
    name, _, tfn, _ = case
    x_np, out, grad = realized[(name, dt)]
    exp, exp_g = _torch_unary(tfn, x_np)
    tol = 1e-5 if dt == "float32" else 1e-10
    assert out.dtype == (dtypes.float32 if dt == "float32" else dtypes.float64)
    np.testing.assert_allclose(out.numpy(), exp, rtol=tol, atol=tol)
    # (torch computes some float64 gradients with float32 constants: hardsigmoid's 1/6)
    np.testing.assert_allclose(grad.numpy(), exp_g, rtol=max(tol * 10, 1e-7), atol=max(tol * 10, 1e-7))

@pytest.mark.parametrize("case", UNARY, ids=[c[0] for c in UNARY])
def test_unary_view_special_half(realized, case):
    name, _, tfn, _ = case
    x_np, out, _ = realized[(name, "view")]
    np.testing.assert_allclose(out.numpy(), tfn(torch.tensor(x_np).T.flip(0)).numpy(), rtol=1e-5, atol=1e-6)
    x_np, out, _ = realized[(name, "special")]
    exp = tfn(torch.tensor(x_np)).numpy()
    got = out.numpy()
    np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-300, equal_nan=True)
    # the sign of zero results of odd functions
    zero = (exp == 0) & (name in ODD)
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(exp[zero]))
    if name not in HALF_CHECKED: return
    x_np, out, _ = realized[(name, "half")]
    assert out.dtype == dtypes.float16
    exp = tfn(torch.tensor(x_np).half().float()).half().float().numpy()
    np.testing.assert_allclose(out.float().numpy(), exp, rtol=2e-3, atol=2e-3)

@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("name", ["sin", "cos", "tan"])
def test_trig_large_arguments(realized, name, dt):
    exp = getattr(torch, name)(torch.tensor(np.array(LARGE, dtype=dt))).numpy()
    tol = 1e-6 if dt == "float32" else 1e-12
    np.testing.assert_allclose(realized[(name, "large", dt)].numpy(), exp, rtol=tol, atol=tol)

@pytest.mark.parametrize("dt", ["int32", "bool", "int64"])
def test_unary_int_inputs_give_float(dt):
    x_np = np.array([0, 1, 1, 0, 1], dtype=dt) if dt == "bool" else np.array([-3, 0, 1, 2, 5], dtype=dt)
    outs = [Tensor(x_np).erf(), Tensor(x_np).atan(), Tensor(x_np).sinh(), Tensor(x_np).log10()]
    Tensor.realize(*outs)
    for out, fn in zip(outs, (torch.erf, torch.atan, torch.sinh, torch.log10)):
        exp = fn(torch.tensor(x_np))
        assert out.dtype == dtypes.float32 and exp.dtype == torch.float32
        np.testing.assert_allclose(out.numpy(), exp.numpy(), rtol=1e-6)

def test_round_half_to_even():
    vals = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.4, 2.0 ** 23 + 1, 2.0 ** 52 + 1, 1e30, float("nan"),
            float("inf"), float("-inf"), -0.0, 3.7, -3.7, 1e-40]
    for dt in ("float32", "float64"):
        x_np = np.array(vals + ([1e300] if dt == "float64" else []), dtype=dt)
        got, exp = Tensor(x_np).round().numpy(), torch.round(torch.tensor(x_np)).numpy()
        np.testing.assert_array_equal(got, exp)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(exp))
    assert Tensor([1, -2, 3]).round().tolist() == [1, -2, 3] and Tensor([1, -2]).round().dtype == dtypes.int32
    x = Tensor([0.3, 1.7])
    assert x.round().sum().gradient(x)[0].tolist() == [0.0, 0.0]

def test_isinf_isfinite():
    x_np = np.array([1.0, float("inf"), float("-inf"), float("nan"), -0.0, 1e38], dtype=np.float32)
    x, t = Tensor(x_np), torch.tensor(x_np)
    outs = [x.isinf(), x.isinf(detect_positive=False), x.isinf(detect_negative=False),
            x.isinf(False, False), x.isfinite(), Tensor([1, 2]).isinf(), Tensor([1, 2]).isfinite()]
    Tensor.realize(*outs)
    exps = [torch.isinf(t), torch.isneginf(t), torch.isposinf(t), torch.zeros(6, dtype=torch.bool), torch.isfinite(t),
            torch.tensor([False, False]), torch.tensor([True, True])]
    for o, e in zip(outs, exps):
        assert o.dtype == dtypes.bool
        assert o.tolist() == e.tolist()

# binary functions: (name, fusegrad fn, torch fn, shapes, domain of a, domain of b, differentiable inputs)
BINARY: list[tuple[str, Callable, Callable, list[tuple[int, ...]], tuple[float, float], tuple[float, float]]] = [
    ("copysign", lambda a, b: a.copysign(b), torch.copysign, [(3, 4), (4,)], (-3, 3), (-3, 3)),
    ("logaddexp", lambda a, b: a.logaddexp(b), torch.logaddexp, [(3, 4), (3, 1)], (-50, 50), (-50, 50)),
    ("fmod", lambda a, b: a.fmod(b), torch.fmod, [(3, 4), (3, 4)], (-10, 10), (0.5, 3)),
    ("lerp", lambda a, b: a.lerp(b, 0.3), lambda a, b: torch.lerp(a, b, 0.3), [(3, 4), (4,)], (-3, 3), (-3, 3)),
    ("lerp_high", lambda a, b: a.lerp(b, 0.8), lambda a, b: torch.lerp(a, b, 0.8), [(3, 4), (3, 4)], (-3, 3), (-3, 3)),
    ("lerp_tensor_w", lambda a, b: a.lerp(b, b.sigmoid()), lambda a, b: torch.lerp(a, b, torch.sigmoid(b)),
     [(3, 4), (3, 4)], (-3, 3), (-3, 3)),
]

@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("case", BINARY, ids=[c[0] for c in BINARY])
def test_binary(case, dt):
    name, fg, tfn, shapes, da, db = case
    a_np, b_np = _rand(shapes[0], *da, 1).astype(dt), _rand(shapes[1], *db, 2).astype(dt)
    a, b = Tensor(a_np), Tensor(b_np)
    out = fg(a, b)
    # copysign has no gradient with respect to the sign source (torch's is zero)
    ga, gb = out.sum().gradient(a, b) if name != "copysign" else (out.sum().gradient(a)[0], b.zeros_like())
    Tensor.realize(out, ga, gb)
    ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    tout = tfn(ta, tb)
    tga, tgb = torch.autograd.grad(tout.sum(), (ta, tb))
    tol = 1e-5 if dt == "float32" else 1e-10
    assert out.dtype == to_dtype_of(tout) and out.shape == tuple(tout.shape)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(ga.numpy(), tga.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(gb.numpy(), tgb.numpy(), rtol=tol, atol=tol)

def to_dtype_of(t: torch.Tensor):
    return {torch.float32: dtypes.float32, torch.float64: dtypes.float64, torch.int32: dtypes.int32}[t.dtype]

@pytest.mark.parametrize("name", ["copysign", "logaddexp", "fmod"])
def test_binary_special_values(name):
    a_np = np.array([[v] * len(BINARY_SPECIAL) for v in BINARY_SPECIAL])
    b_np = a_np.T.copy()
    got = getattr(Tensor(a_np), name)(Tensor(b_np)).numpy()
    exp = getattr(torch, name)(torch.tensor(a_np), torch.tensor(b_np)).numpy()
    np.testing.assert_allclose(got, exp, rtol=1e-12, equal_nan=True)
    np.testing.assert_array_equal(np.signbit(got[~np.isnan(exp)]), np.signbit(exp[~np.isnan(exp)]))

def test_fmod_large_quotient_and_ints():
    a_np, b_np = np.array([1e10, -7.5, 123456.789, 5.0]), np.array([0.3, 2.0, -1e-3, float("inf")])
    np.testing.assert_allclose(Tensor(a_np).fmod(Tensor(b_np)).numpy(), np.fmod(a_np, b_np), rtol=1e-12)
    ai, bi = np.array([7, -7, 7, -7, 0], dtype=np.int32), np.array([3, 3, -3, -3, 5], dtype=np.int32)
    out = Tensor(ai).fmod(Tensor(bi))
    assert out.dtype == dtypes.int32 and out.tolist() == torch.fmod(torch.tensor(ai), torch.tensor(bi)).tolist()
    assert Tensor(ai).fmod(2).tolist() == torch.fmod(torch.tensor(ai), 2).tolist()

def test_copysign_dtypes():
    out = Tensor([1, -2, 3]).copysign(Tensor([-1, 1, -1]))
    exp = torch.copysign(torch.tensor([1, -2, 3]), torch.tensor([-1, 1, -1]))
    assert out.dtype == dtypes.float32 and out.tolist() == exp.tolist()
    out = Tensor([1.5, -2.0], dtype=dtypes.float16).copysign(-1.0)
    assert out.dtype == dtypes.float16 and out.tolist() == [-1.5, -2.0]

def test_logaddexp_ints_and_half():
    out = Tensor([1, 2, 3]).logaddexp(Tensor([3, 2, 1]))
    exp = torch.logaddexp(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1]))
    assert out.dtype == dtypes.float32
    np.testing.assert_allclose(out.numpy(), exp.numpy(), rtol=1e-6)
    out = Tensor([1.0, -3.0], dtype=dtypes.float16).logaddexp(0.5)
    assert out.dtype == dtypes.float16
    np.testing.assert_allclose(out.float().numpy(), np.logaddexp([1.0, -3.0], 0.5), rtol=2e-3)

@pytest.mark.parametrize("dt", ["int32", "int64", "uint8", "int8"])
def test_shifts(dt):
    x_np = np.array([1, 3, 7, 100, 0] if dt == "uint8" else [1, -3, 7, -100, 0], dtype=dt)
    s_np = np.array([0, 1, 2, 3, 1], dtype=dt)
    x, s, tx, ts = Tensor(x_np), Tensor(s_np), torch.tensor(x_np), torch.tensor(s_np)
    outs = [x.lshift(s), x.rshift(s), x.lshift(2), x.rshift(1), x << 1, x >> 2]
    Tensor.realize(*outs)
    exps = [tx << ts, tx >> ts, tx << 2, tx >> 1, tx << 1, tx >> 2]
    for o, e in zip(outs, exps):
        assert o.dtype == x.dtype and o.tolist() == e.tolist()

def test_empty_and_0d():
    e = Tensor.zeros(0, 3)
    outs = [e.erf(), e.atan(), e.gelu(), e.round(), Tensor(0.5).asin(), Tensor(-0.3).round(),
            Tensor(2.0).logaddexp(1.0)]
    Tensor.realize(*outs)
    assert all(o.shape == (0, 3) for o in outs[:4])
    assert outs[4].shape == () and abs(outs[4].item() - np.arcsin(0.5)) < 1e-6
    assert outs[5].item() == 0.0 and np.signbit(outs[5].item())
    assert abs(outs[6].item() - np.logaddexp(2.0, 1.0)) < 1e-6

def test_div_rounding_mode():
    a_np, b_np = np.array([7.5, -7.5, 7, -7, 0.5]), np.array([2.0, 2.0, -2, -2, -0.25])
    for mode in (None, "trunc", "floor"):
        got = Tensor(a_np).div(Tensor(b_np), rounding_mode=mode).numpy()
        np.testing.assert_allclose(got, torch.div(torch.tensor(a_np), torch.tensor(b_np), rounding_mode=mode).numpy())
        ai, bi = np.array([7, -7, 7, -7]), np.array([2, 2, -2, -2])
        out = Tensor(ai).div(Tensor(bi), rounding_mode=mode)
        exp = torch.div(torch.tensor(ai), torch.tensor(bi), rounding_mode=mode)
        assert out.dtype == (dtypes.float32 if mode is None else dtypes.int64) and out.tolist() == exp.tolist()

def test_errors():
    x = Tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="approximate"): x.gelu(approximate="erf")
    with pytest.raises(ValueError, match="rounding_mode"): x.div(2, rounding_mode="round")
    with pytest.raises(ValueError, match="min_val"): x.hardtanh(2, 1)
    with pytest.raises(TypeError, match="integer"): x.lshift(1)
    with pytest.raises(TypeError, match="lerp"): x.lerp(3.0, 0.5)
    with pytest.raises(ValueError, match="broadcast"): x.copysign(Tensor([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="bool"): Tensor([True]).fmod(Tensor([True]))

def test_half_dtypes_keep_dtype():
    for dt in (dtypes.float16, dtypes.bfloat16):
        x = Tensor([0.25, -1.5, 2.0], dtype=dt)
        outs = [x.erf(), x.sinh(), x.atan(), x.gelu(), x.mish(), x.round(), x.softplus()]
        Tensor.realize(*outs)
        tx = torch.tensor([0.25, -1.5, 2.0], dtype=to_torch_dtype(dt))
        exps = [torch.erf(tx), torch.sinh(tx), torch.atan(tx), F.gelu(tx, approximate="tanh"), F.mish(tx),
                torch.round(tx), F.softplus(tx)]
        for o, e in zip(outs, exps):
            assert o.dtype == dt
            np.testing.assert_allclose(o.float().numpy(), e.float().numpy(), rtol=1e-2, atol=1e-2)

@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_exp_tanh_to_an_ulp(dt):
    # exp2(x*log2(e)) in the input's precision would be off by ~30 ulp at |x| ~ 80
    x_np = np.concatenate([np.linspace(-80, 80, 801), np.linspace(-0.6, 0.6, 121), SPECIAL]).astype(dt)
    x = Tensor(x_np)
    outs = [x.exp(), x.tanh()]
    Tensor.realize(*outs)
    tol = 2.5e-7 if dt == "float32" else 5e-16
    for o, fn in zip(outs, (torch.exp, torch.tanh)):
        np.testing.assert_allclose(o.numpy(), fn(torch.tensor(x_np)).numpy(), rtol=tol, atol=1e-300, equal_nan=True)
    xs = Tensor(x_np[:801])
    (g,) = xs.exp().sum().gradient(xs)
    np.testing.assert_allclose(g.numpy(), np.exp(x_np[:801].astype(np.float64)), rtol=tol * 4)

def test_float32_erf_within_1_ulp_of_the_exact_value():
    """float32 erf (a polynomial below 1 in float64, erfc as exp(-x^2) times a polynomial in 1/x up to 4 in float32)
    is within 1 ulp of Python's double erf, over [-6, 6] and tiny magnitudes; nan stays nan, +-inf gives +-1,
    -0.0 keeps its sign; float64 erf (its series) stays within 1e-13 of it."""
    import math
    x = np.concatenate([np.linspace(-6, 6, 20001), np.geomspace(1e-38, 6, 5000), -np.geomspace(1e-38, 6, 5000)])
    x = x.astype(np.float32)
    got = Tensor(x).erf().numpy().astype(np.float64)
    exact = np.array([math.erf(float(v)) for v in x])
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 1
    special = Tensor(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)).erf().numpy()
    assert np.isnan(special[0]) and list(special[1:3]) == [1.0, -1.0] and np.signbit(special[3])
    x64 = np.linspace(-6, 6, 2001)
    np.testing.assert_allclose(Tensor(x64).erf().numpy(), [math.erf(v) for v in x64], rtol=1e-13, atol=1e-16)

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float16])
def test_exp_gradient_is_its_value(dt):
    """exp's gradient is g * exp(x) in the input's precision, as torch's: the backward graph of a float32 or half
    exp holds no float64 (the derivative of the float64 formula the value is computed with recomputed 2^y in float64),
    and matches torch, overflow to inf included."""
    from fusegrad.schedule.simplify import expand_composites
    from fusegrad.uop.ops import Ops
    x = np.concatenate([_rand((200,), -20, 20, 5), [0.0, -100.0, 80.0, 12.0]]).astype(np.float32)
    g = _rand((x.size,), -2, 2, 6).astype(np.float32)
    tdt = to_torch_dtype(dt)
    xt = Tensor(x, requires_grad=True).cast(dt)
    (xt.exp() * Tensor(g).cast(dt)).sum().backward()
    grad = xt.grad
    tx = torch.tensor(x).to(tdt).requires_grad_()
    (tx.exp() * torch.tensor(g).to(tdt)).sum().backward()
    assert grad is not None and tx.grad is not None
    # (the value's own 2^y of a float64 argument is rounded at once: lowering computes it in float32)
    graph = list(expand_composites(grad.uop).toposort())
    users = [u for u in graph for s in u.src if s.op is Ops.EXP2]
    assert users and all(u.op is Ops.CAST and u.dtype.itemsize < 8 for u in users), users[:3]
    tol = 1e-6 if dt == dtypes.float32 else 1e-3
    np.testing.assert_allclose(grad.numpy().astype(np.float64), tx.grad.to(torch.float64).numpy(), rtol=tol, atol=0)

def test_exp_near_and_below_underflow():
    """exp where the result is denormal, rounds to 0 or is 0 (softmax's masked -inf lanes) equals torch's bit for bit
    in float32, +0.0 below the smallest denormal (those lanes scale a 0: no underflowing product), for exp and
    exp2, with and without a float64 argument."""
    x = np.array([-np.inf, -1e4, -120.0, -104.0, -103.97, -103.2, -100.0, -87.5, -87.3, 0.0, 88.7, 89.0, np.inf,
                  np.nan], np.float32)
    xt = torch.tensor(x)
    np.testing.assert_array_equal(Tensor(x).exp().numpy(), xt.exp().numpy())
    np.testing.assert_array_equal(Tensor(x * np.float32(1.4427)).exp2().numpy(), torch.exp2(xt * 1.4427).numpy())
    np.testing.assert_array_equal(Tensor(x.astype(np.float64)).exp().cast(dtypes.float32).numpy(),
                                  xt.double().exp().float().numpy())
    assert not np.signbit(Tensor(x[:3]).exp().numpy()).any()
