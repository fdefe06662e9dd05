"""The ONNX operators, each a function of Tensors written with fusegrad's Tensor API.

An op is a function whose positional parameters are the node's inputs (None where an optional input is left out)
and whose keyword-only parameters are the attributes it supports, with ONNX's defaults. The runner rejects any
attribute an op's function doesn't name, so an unsupported attribute is an error instead of being ignored. An op that
needs the node's opset version, its output count or the runner takes a keyword `ctx`."""
from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

import fusegrad.engine.realize as _realize
from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType, least_upper_float
from fusegrad.onnx import narrow
from fusegrad.onnx.errors import Unsupported
from fusegrad.tensor.indexing import _check_index_values
from fusegrad.onnx.onnx_dtypes import onnx_dtype
from fusegrad.uop.ops import is_symbolic, ssimplify, sym_eq, sym_value


@dataclass
class OpDef:
    fn: Callable[..., Any]
    attrs: frozenset[str] = field(default_factory=frozenset)
    wants_ctx: bool = False


@dataclass
class Context:
    """What an op may need besides its inputs and attributes."""
    node_name: str
    op_type: str
    opset: int
    n_outputs: int
    env: Mapping[str, Tensor]
    runner: Any


OPS: dict[tuple[str, str], OpDef] = {}


@dataclass
class DeviceCheck:
    """A check of values computed on the device: `check` gets them as NumPy arrays and returns an error message, or
    None where they are valid."""
    node: str
    op_type: str
    values: list[Tensor]
    check: Callable[..., str | None]


def device_check(ctx: Context | None, values: list[Tensor], check: Callable[..., str | None]) -> bool:
    """Have `check` run on `values` after every call of the model, where the runner can (`OnnxRunner.jit()`: the
    values are extra outputs of its TinyJit, read after each replay, which runs no Python of the ops). Returns whether
    the check is registered; where it isn't, the op checks what it can read itself. Inside a TinyJit capture other
    than `jit()`'s (a function of the user's that calls the runner) it can't: the values can't be read there, and the
    replays would never check them, so that is an error naming `jit()`."""
    checks = getattr(ctx.runner, "device_checks", None) if ctx is not None else None
    if checks is None and ctx is not None and _realize.capturing:
        raise Unsupported(f"{ctx.op_type} checks values computed on the device after every call (an index or length "
                          f"out of range would read or write outside its buffers); a TinyJit capture of a function "
                          f"that calls the runner can't, as its replays run no Python of the ops: call the model "
                          f"through OnnxRunner.jit(), which checks them after each replay")
    if checks is None: return False
    checks.append(DeviceCheck(ctx.node_name, ctx.op_type, values, check))   # type: ignore[union-attr]
    return True


def op(*names: str, domain: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = inspect.signature(fn).parameters
        attrs = frozenset(n for n, p in params.items() if p.kind == p.KEYWORD_ONLY and n != "ctx")
        for name in names: OPS[(domain, name)] = OpDef(fn, attrs, "ctx" in params)
        return fn
    return register


# *** helpers ***

# Host copies of small tensors whose values are known without running anything: initializers, constants and shapes.
# Ops that need values as Python ints (axes, shapes, pads) read these instead of the device, so a model whose such
# values all come from there runs without a read-back, and so inside TinyJit.
_HOST: dict[int, tuple[weakref.ref, np.ndarray]] = {}
HOST_MAX = 4096


def with_host(t: Tensor, arr: np.ndarray) -> Tensor:
    """Remember the host value of a small tensor (returns the tensor)."""
    if arr.size <= HOST_MAX:
        key = id(t)
        _HOST[key] = (weakref.ref(t, lambda _, k=key: _HOST.pop(k, None)), arr)
    return t


def known_value(t: Tensor) -> np.ndarray | None:
    """The tensor's remembered host copy (a constant, an initializer, a small shape computation), else None."""
    entry = _HOST.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def host_value(t: Tensor) -> np.ndarray:
    """The tensor's values on the host: its remembered copy, else read back from the device."""
    known = known_value(t)
    return known if known is not None else np.asarray(t.numpy())


def ints(t: Tensor | Sequence[int] | None) -> list[Any]:
    """The values of a small int tensor (a shape, axes, pads...) as Python ints, or symbolic ints where the host copy
    holds one (a size computed from a symbolic input dim)."""
    if t is None: return []
    if not isinstance(t, Tensor): return [int(v) for v in t]
    return [v if is_symbolic(v) else int(v) for v in host_value(t).reshape(-1)]


def scalar(t: Tensor) -> Any:
    v = host_value(t).reshape(-1)
    if v.size != 1: raise ValueError(f"expected a single value, got shape {tuple(t.shape)}")
    return v[0] if is_symbolic(v[0]) else v[0].item()


def axis_of(a: int, ndim: int) -> int:
    if not -max(ndim, 1) <= a < max(ndim, 1): raise ValueError(f"axis {a} is out of range for rank {ndim}")
    return a % max(ndim, 1)


def is_float(t: Tensor) -> bool: return dtypes.is_float(t.dtype)


def in_float(t: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply a float-only function to a tensor of any dtype, returning its dtype."""
    return fn(t) if is_float(t) else fn(t.cast(dtypes.float32)).cast(t.dtype)


def const_tensor(v: Any, dtype: DType) -> Tensor: return Tensor(np.asarray(v)).cast(dtype)


# *** elementwise: unary ***

def _unary(name: str, fn: Callable[[Tensor], Tensor]) -> None:
    OPS[("", name)] = OpDef(fn)

for _name, _fn in {
    "Abs": Tensor.abs, "Acos": Tensor.acos, "Acosh": Tensor.acosh, "Asin": Tensor.asin, "Asinh": Tensor.asinh,
    "Atan": Tensor.atan, "Atanh": Tensor.atanh, "Ceil": Tensor.ceil, "Cos": Tensor.cos, "Cosh": Tensor.cosh,
    "Erf": Tensor.erf, "Exp": Tensor.exp, "Floor": Tensor.floor, "Log": Tensor.log, "Reciprocal": Tensor.reciprocal,
    "Relu": Tensor.relu, "Round": Tensor.round, "Sigmoid": Tensor.sigmoid, "Sign": Tensor.sign, "Sin": Tensor.sin,
    "Sinh": Tensor.sinh, "Sqrt": Tensor.sqrt, "Tan": Tensor.tan, "Tanh": Tensor.tanh, "Softplus": Tensor.softplus,
    "Softsign": Tensor.softsign, "HardSwish": Tensor.hardswish, "Mish": Tensor.mish, "IsNaN": Tensor.isnan,
    "Not": Tensor.logical_not, "BitwiseNot": Tensor.bitwise_not, "Neg": lambda x: -x, "Identity": lambda x: x,
}.items(): _unary(_name, _fn)


@op("IsInf")
def isinf(x: Tensor, *, detect_negative: int = 1, detect_positive: int = 1) -> Tensor:
    return x.isinf(bool(detect_positive), bool(detect_negative))


@op("Elu")
def elu(x: Tensor, *, alpha: float = 1.0) -> Tensor: return (x > 0).where(x, alpha * (x.exp() - 1))


@op("Celu")
def celu(x: Tensor, *, alpha: float = 1.0) -> Tensor:
    return x.maximum(0) + (alpha * ((x / alpha).exp() - 1)).minimum(0)


@op("Selu")
def selu(x: Tensor, *, alpha: float = 1.67326319217681884765625, gamma: float = 1.05070102214813232421875) -> Tensor:
    return gamma * (x > 0).where(x, alpha * (x.exp() - 1))


@op("LeakyRelu")
def leaky_relu(x: Tensor, *, alpha: float = 0.01) -> Tensor: return (x < 0).where(x * alpha, x)


@op("PRelu")
def prelu(x: Tensor, slope: Tensor) -> Tensor: return (x < 0).where(x * slope, x)


@op("ThresholdedRelu")
def thresholded_relu(x: Tensor, *, alpha: float = 1.0) -> Tensor: return (x > alpha).where(x, 0)


@op("HardSigmoid")
def hard_sigmoid(x: Tensor, *, alpha: float = 0.2, beta: float = 0.5) -> Tensor:
    return (x * alpha + beta).maximum(0).minimum(1)


@op("Shrink")
def shrink(x: Tensor, *, bias: float = 0.0, lambd: float = 0.5) -> Tensor:
    return in_float(x, lambda v: (v < -lambd).where(v + bias, (v > lambd).where(v - bias, 0)))


# erfc(u) = exp(-u^2) R(u) for u >= 0, with R = P / Q a rational function fitted to erfcx on [0, 10] (iteratively
# reweighted least squares on Chebyshev points, relative error 1.6e-8 in float64); beyond 10 exp(-u^2) is below
# float32's smallest subnormal
_ERFCX_P = (0.9999999999995015, 1.295438537586108, 0.8360534071740351, 0.3079835607316076, 0.06424903479338792,
            0.006087199518009373)
_ERFCX_Q = (1.0, 2.4238177045317726, 2.571038814158048, 1.5375252197676976, 0.5514455575126914, 0.11386383163993048,
            0.010790076946633018, -1.9758653255208536e-08)


def _horner(x: Tensor, coeffs: Sequence[float]) -> Tensor:
    out = x * coeffs[-1] + coeffs[-2]
    for c in reversed(coeffs[:-2]): out = out * x + c
    return out


def _gelu_erf32(x: Tensor) -> Tensor:
    """x Phi(x) in float32: Phi(-|x|) = erfc(|x| / sqrt 2) / 2 from one exponential and one rational function, and
    Phi(|x|) = 1 - Phi(-|x|). Within ~30 ulp for |x| <= 5 and ~250 in the far negative tail (the rounding of u^2 in the
    exponential), where 0.5 x (1 + erf(x / sqrt 2)) loses everything to the cancellation of 1 + erf; a fifth of the
    work of the erf of Tensor.gelu, whose three polynomials and exponential every element pays for."""
    u = x.abs() * (1 / math.sqrt(2))
    r = u.minimum(10.0)
    half_erfc = (-(u * u)).exp() * (_horner(r, _ERFCX_P) / _horner(r, _ERFCX_Q)) * 0.5
    return x * (x < 0).where(half_erfc, 1.0 - half_erfc)


@op("Gelu")
def gelu(x: Tensor, *, approximate: str = "none") -> Tensor:
    if approximate not in ("none", "tanh"): raise Unsupported(f"Gelu approximate={approximate!r}")
    # (float64 keeps Tensor.gelu's erf, exact to double precision; narrower floats compute in float32)
    if approximate == "none" and is_float(x) and x.dtype.itemsize <= 4:
        return _gelu_erf32(x.cast(dtypes.float32)).cast(x.dtype)
    return x.gelu(approximate).cast(x.dtype)


@op("Swish")
def swish(x: Tensor, *, alpha: float = 1.0) -> Tensor: return x * (x * alpha).sigmoid()


@op("Clip")
def clip(x: Tensor, lo: Tensor | None = None, hi: Tensor | None = None, *, min: float | None = None,  # noqa: A002
         max: float | None = None) -> Tensor:  # noqa: A002
    # before opset 11 the bounds were attributes
    lo_v: Any = lo if lo is not None else min
    hi_v: Any = hi if hi is not None else max
    if lo_v is not None: x = x.maximum(lo_v.cast(x.dtype) if isinstance(lo_v, Tensor) else lo_v)
    if hi_v is not None: x = x.minimum(hi_v.cast(x.dtype) if isinstance(hi_v, Tensor) else hi_v)
    return x


@op("Cast")
def cast(x: Tensor, *, to: int, saturate: int = 1, round_mode: str = "up") -> Tensor:
    # an 8-, 4- or 2-bit input is read as its values; such an output is rounded into its holder
    x = narrow.values(x)
    if to in narrow.NARROW: return narrow.round_to(x, to, bool(saturate), round_mode)
    dt = onnx_dtype(to)
    if dtypes.is_float(x.dtype) and dt == dtypes.bool: return x != 0
    return x.cast(dt)


@op("CastLike")
def cast_like(x: Tensor, like: Tensor, *, saturate: int = 1, round_mode: str = "up") -> Tensor:
    if (t := narrow.narrow_type(like)) is not None: return cast(x, to=t, saturate=saturate, round_mode=round_mode)
    x = narrow.values(x)
    if dtypes.is_float(x.dtype) and like.dtype == dtypes.bool: return x != 0
    return x.cast(like.dtype)


# *** elementwise: binary and variadic ***

@op("Add")
def add(a: Tensor, b: Tensor) -> Tensor: return a + b


@op("Sub")
def sub(a: Tensor, b: Tensor) -> Tensor: return a - b


@op("Mul")
def mul(a: Tensor, b: Tensor) -> Tensor: return a * b


@op("Div")
def div(a: Tensor, b: Tensor) -> Tensor:
    # integer division truncates toward zero in ONNX (as C)
    return a.div(b, rounding_mode="trunc") if dtypes.is_int(a.dtype) else a / b


@op("Pow")
def pow_(a: Tensor, b: Tensor) -> Tensor:
    # the result has the base's dtype
    if is_float(a): return a.pow(b.cast(a.dtype))
    if is_float(b): return a.cast(b.dtype).pow(b).cast(a.dtype)
    return a.cast(dtypes.float64).pow(b.cast(dtypes.float64)).round().cast(a.dtype)


@op("Mod")
def mod(a: Tensor, b: Tensor, *, fmod: int = 0) -> Tensor:
    if fmod not in (0, 1): raise ValueError(f"fmod must be 0 or 1, got {fmod}")
    if fmod or not is_float(a): return a.fmod(b) if fmod else a.mod(b)
    # NumPy's floor remainder, from the exact fmod: moved into the divisor's sign where the signs differ (by +-inf
    # that gives +-inf), a zero remainder takes the divisor's sign, and by 0 or of +-inf it is NaN
    r = a.fmod(b)
    r = ((r != 0) & ((r < 0) != (b < 0))).where(r + b, r)
    return (r == 0).where(Tensor.zeros_like(r).copysign(b), r)


for _name, _fn2 in {
    "Equal": Tensor.eq, "Greater": Tensor.gt, "Less": Tensor.lt, "GreaterOrEqual": Tensor.ge, "LessOrEqual": Tensor.le,
    "And": Tensor.logical_and, "Or": Tensor.logical_or, "Xor": lambda a, b: a != b,
    "BitwiseAnd": Tensor.bitwise_and, "BitwiseOr": Tensor.bitwise_or, "BitwiseXor": Tensor.bitwise_xor,
}.items(): OPS[("", _name)] = OpDef(_fn2)


@op("BitShift")
def bitshift(a: Tensor, b: Tensor, *, direction: str) -> Tensor:
    if direction not in ("LEFT", "RIGHT"): raise ValueError(f"direction must be LEFT or RIGHT, got {direction!r}")
    if is_float(a) or is_float(b) or dtypes.bool in (a.dtype, b.dtype):
        raise ValueError(f"the inputs must be integers, got {a.dtype} and {b.dtype}")
    # a shift by the bit width or more, or by a negative amount, gives every bit shifted out (0, or -1 for a right
    # shift of a negative value) as in NumPy; C leaves such shifts undefined, so they never reach the kernel
    width = a.dtype.itemsize * 8
    out = (b < 0) | (b >= width) if not dtypes.is_unsigned(a.dtype) else b >= width
    safe = out.where(0, b)
    if direction == "LEFT": return out.where(0, a.lshift(safe))
    return out.where(a.rshift(width - 1) if not dtypes.is_unsigned(a.dtype) else 0, a.rshift(safe))


def _variadic(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(*xs: Tensor) -> Tensor:
        if not xs: raise ValueError("needs at least one input")
        out = xs[0]
        for x in xs[1:]: out = fn(out, x)
        return out
    return run


OPS[("", "Sum")] = OpDef(_variadic(Tensor.add))
OPS[("", "Max")] = OpDef(_variadic(Tensor.maximum))
OPS[("", "Min")] = OpDef(_variadic(Tensor.minimum))
OPS[("", "Mean")] = OpDef(lambda *xs: _variadic(Tensor.add)(*xs) / len(xs))


@op("Where")
def where(c: Tensor, a: Tensor, b: Tensor) -> Tensor: return c.where(a, b)


# *** reductions ***

def _reduce_axes(x: Tensor, axes_in: Tensor | None, axes: Sequence[int] | None, noop: int) -> tuple[int, ...] | None:
    """The axes to reduce (None: no reduction at all), from the input (opset 18 on; ReduceSum 13) or the attribute."""
    ax = ints(axes_in) if axes_in is not None else list(axes or [])
    if not ax: return None if noop else tuple(range(x.ndim))
    return tuple(sorted({axis_of(a, x.ndim) for a in ax}))


def _reduce(fn: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> Callable[..., Tensor]:
    def run(x: Tensor, axes_in: Tensor | None = None, *, axes: Sequence[int] | None = None, keepdims: int = 1,
            noop_with_empty_axes: int = 0) -> Tensor:
        ax = _reduce_axes(x, axes_in, axes, noop_with_empty_axes)
        # (no axes to reduce: the reduction over none, as the ops' function bodies give it: |x| for ReduceL1 and
        # ReduceL2, x * x for ReduceSumSquare, log(x) for ReduceLogSum)
        if ax is None: return fn(x, (), True)
        if x.ndim == 0: return fn(x.reshape(1), (0,), False)
        return fn(x, ax, bool(keepdims))
    return run


def _sum(x: Tensor, ax: tuple[int, ...], k: bool) -> Tensor: return x.sum(ax, keepdim=k, dtype=x.dtype)


def _empty_ok(init: float, fn: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> Callable[..., Tensor]:
    """A reduction whose value over no elements is `init` (ONNX defines max of nothing as -inf, etc.)."""
    def run(x: Tensor, ax: tuple[int, ...], k: bool) -> Tensor:
        if any(x.shape[a] == 0 for a in ax):
            shape = tuple(1 if i in ax else s for i, s in enumerate(x.shape)) if k else \
                tuple(s for i, s in enumerate(x.shape) if i not in ax)
            v = init if is_float(x) or math.isfinite(init) else \
                (dtypes.max(x.dtype) if init > 0 else dtypes.min(x.dtype))
            return Tensor.full(shape, v, dtype=x.dtype)
        return fn(x, ax, k)
    return run


for _name, _red in {
    "ReduceSum": _empty_ok(0, _sum),
    "ReduceMean": lambda x, ax, k: x.mean(ax, keepdim=k),
    "ReduceMax": _empty_ok(-math.inf, lambda x, ax, k: x.max(ax, keepdim=k)),
    "ReduceMin": _empty_ok(math.inf, lambda x, ax, k: x.min(ax, keepdim=k)),
    "ReduceProd": _empty_ok(1, lambda x, ax, k: x.prod(ax, keepdim=k, dtype=x.dtype)),
    "ReduceL1": _empty_ok(0, lambda x, ax, k: _sum(x.abs(), ax, k)),
    "ReduceL2": _empty_ok(0, lambda x, ax, k: in_float(_sum(x * x, ax, k), Tensor.sqrt)),
    "ReduceSumSquare": _empty_ok(0, lambda x, ax, k: _sum(x * x, ax, k)),
    "ReduceLogSum": _empty_ok(-math.inf, lambda x, ax, k: in_float(_sum(x, ax, k), Tensor.log)),
    "ReduceLogSumExp": _empty_ok(-math.inf, lambda x, ax, k: in_float(x, lambda v: v.logsumexp(ax, keepdim=k))),
}.items(): OPS[("", _name)] = OpDef(_reduce(_red), frozenset({"axes", "keepdims", "noop_with_empty_axes"}))


def _arg(largest: bool) -> Callable[..., Tensor]:
    def run(x: Tensor, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0) -> Tensor:
        a = axis_of(axis, x.ndim)
        if x.shape[a] == 0 and any(s == 0 for i, s in enumerate(x.shape) if i != a):
            # (no result to compute: an empty dim along the axis is an error only where there are results)
            return Tensor.empty(*[1 if i == a else s for i, s in enumerate(x.shape) if keepdims or i != a],
                                dtype=dtypes.int64, device=x.device)
        v = x.flip(a) if select_last_index else x
        i = v.argmax(a, keepdim=bool(keepdims)) if largest else v.argmin(a, keepdim=bool(keepdims))
        if select_last_index: i = (x.shape[a] - 1) - i
        return i.cast(dtypes.int64)
    return run


OPS[("", "ArgMax")] = OpDef(_arg(True), frozenset({"axis", "keepdims", "select_last_index"}))
OPS[("", "ArgMin")] = OpDef(_arg(False), frozenset({"axis", "keepdims", "select_last_index"}))


def _softmax_like(fn: Callable[[Tensor, int], Tensor]) -> Callable[..., Tensor]:
    def run(x: Tensor, *, axis: int | None = None, ctx: Context) -> Tensor:
        # (no elements: no row to normalize, where the row's max would be an error)
        if 0 in x.shape: return Tensor.empty(*x.shape, dtype=x.dtype, device=x.device)
        if ctx.opset >= 13: return fn(x, axis_of(-1 if axis is None else axis, x.ndim))
        # before opset 13 the input was flattened to 2D at `axis` (default 1) and normalized over the second part
        a = axis_of(1 if axis is None else axis, x.ndim)
        return fn(x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:])), 1).reshape(x.shape)
    return run


def _hardmax(x: Tensor, a: int) -> Tensor:
    return (x.argmax(a, keepdim=True) == Tensor.arange(x.shape[a]).reshape(
        tuple(-1 if i == a else 1 for i in range(x.ndim)))).cast(x.dtype)


def _softmax(x: Tensor, a: int) -> Tensor:
    """Tensor.softmax with the exponentials stored by the kernel that takes the row's max and read by the one that
    sums and scales them: fused into one kernel, each exp is computed twice (for the sum and for the output); an
    attention's softmax over 128 keys ran in ~25% less kernel time."""
    x = x.cast(least_upper_float(x.dtype))
    e = (x - x.max(a, keepdim=True)).exp().contiguous()
    r = e.sum(a, keepdim=True).reciprocal()
    out = e * r
    if a == x.ndim - 1 and x.ndim >= 2:
        key = id(out)
        _SOFTMAX_ROWS[key] = (weakref.ref(out, lambda _, k=key: _SOFTMAX_ROWS.pop(k, None)), e, r)
    return out


# a softmax over the last axis -> its exponentials and their rows' reciprocal sums: MatMul by such a softmax scales
# the product's rows instead (`matmul`), so the normalized probabilities aren't written and read back
_SOFTMAX_ROWS: dict[int, tuple[weakref.ref, Tensor, Tensor]] = {}


def _softmax_rows(t: Tensor) -> tuple[Tensor, Tensor] | None:
    entry = _SOFTMAX_ROWS.get(id(t))
    return (entry[1], entry[2]) if entry is not None and entry[0]() is t else None


for _name, _sm in {"Softmax": _softmax, "LogSoftmax": lambda x, a: x.log_softmax(a),
                   "Hardmax": _hardmax}.items():
    OPS[("", _name)] = OpDef(_softmax_like(_sm), frozenset({"axis"}), True)


@op("CumSum")
def cumsum(x: Tensor, axis: Tensor, *, exclusive: int = 0, reverse: int = 0) -> Tensor:
    a = axis_of(int(scalar(axis)), x.ndim)
    v = x.flip(a) if reverse else x
    out = v.cumsum(a)
    if exclusive: out = out - v
    return (out.flip(a) if reverse else out).cast(x.dtype)


@op("CumProd")
def cumprod(x: Tensor, axis: Tensor, *, exclusive: int = 0, reverse: int = 0) -> Tensor:
    a = axis_of(int(scalar(axis)), x.ndim)
    v = x.flip(a) if reverse else x
    if exclusive:
        # shift right by one along the axis, with a leading one
        v = v.pad(tuple((1, -1) if i == a else (0, 0) for i in range(x.ndim)), value=1)
    out = v.cumprod(a)
    return (out.flip(a) if reverse else out).cast(x.dtype)


# *** linear algebra ***

@op("MatMul")
def matmul(a: Tensor, b: Tensor) -> Tensor:
    # softmax(x) @ v as (e @ v) * (1 / row sums of e): each row of the product is scaled once, and the probabilities,
    # a (rows, keys) tensor of an attention, are never stored (their kernel wrote them and the matmul read them back)
    if (rows := _softmax_rows(a)) is not None and b.ndim >= 2 and a.dtype == b.dtype:
        e, r = rows
        return e.matmul(b) * r
    return a.matmul(b)


@op("Gemm")
def gemm(a: Tensor, b: Tensor, c: Tensor | None = None, *, alpha: float = 1.0, beta: float = 1.0, transA: int = 0,
         transB: int = 0) -> Tensor:
    if transA: a = a.T
    if transB: b = b.T
    out = a @ b
    if alpha != 1.0: out = out * alpha
    if c is not None: out = out + (c * beta if beta != 1.0 else c)
    return out.cast(a.dtype)


@op("Einsum")
def einsum(*xs: Tensor, equation: str) -> Tensor: return Tensor.einsum(equation.replace(" ", ""), *xs)


# *** convolution and pooling ***

def _pads_to_pairs(pads: Sequence[int] | None, n: int) -> list[tuple[int, int]]:
    """ONNX pads (all begins, then all ends) as (begin, end) per spatial dim."""
    if not pads: return [(0, 0)] * n
    if len(pads) != 2 * n: raise ValueError(f"pads {list(pads)} must have 2 values per spatial dim ({2 * n})")
    return [(pads[i], pads[i + n]) for i in range(n)]


def _auto_pads(auto_pad: str, in_sizes: Sequence[int], k: Sequence[int], s: Sequence[int], d: Sequence[int],
               pads: Sequence[int] | None) -> list[tuple[int, int]]:
    n = len(k)
    if auto_pad in ("NOTSET", ""): return _pads_to_pairs(pads, n)
    if auto_pad == "VALID": return [(0, 0)] * n
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"): raise ValueError(f"unknown auto_pad {auto_pad!r}")
    out = []
    for i, kk, ss, dd in zip(in_sizes, k, s, d):
        total = max(0, (-(-i // ss) - 1) * ss + (kk - 1) * dd + 1 - i)
        small, big = total // 2, total - total // 2
        out.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return out


def _flat(pairs: Sequence[tuple[int, int]]) -> list[int]:
    """(begin, end) per dim -> torch's flat padding (last dim first)."""
    return [v for b, e in reversed(pairs) for v in (b, e)]


def _kernel_geometry(w: Tensor, kernel_shape: Sequence[int] | None, strides: Sequence[int] | None,
                     dilations: Sequence[int] | None) -> tuple[tuple[int, ...], int, list[int], list[int]]:
    """A convolution's kernel size (checked against kernel_shape), its rank, strides and dilations."""
    k = tuple(w.shape[2:])
    n = len(k)
    if kernel_shape and tuple(kernel_shape) != k:
        raise ValueError(f"kernel_shape {list(kernel_shape)} doesn't match the weight's {k}")
    return k, n, list(strides or [1] * n), list(dilations or [1] * n)

@op("Conv")
def conv(x: Tensor, w: Tensor, b: Tensor | None = None, *, auto_pad: str = "NOTSET",
         dilations: Sequence[int] | None = None, group: int = 1, kernel_shape: Sequence[int] | None = None,
         pads: Sequence[int] | None = None, strides: Sequence[int] | None = None) -> Tensor:
    k, n, s, d = _kernel_geometry(w, kernel_shape, strides, dilations)
    pairs = _auto_pads(auto_pad, x.shape[2:], k, s, d, pads)
    return x.conv2d(w, b, groups=group, stride=s, dilation=d, padding=_flat(pairs)).cast(x.dtype)


@op("ConvTranspose")
def conv_transpose(x: Tensor, w: Tensor, b: Tensor | None = None, *, auto_pad: str = "NOTSET",
                   dilations: Sequence[int] | None = None, group: int = 1, kernel_shape: Sequence[int] | None = None,
                   output_padding: Sequence[int] | None = None, output_shape: Sequence[int] | None = None,
                   pads: Sequence[int] | None = None, strides: Sequence[int] | None = None) -> Tensor:
    k, n, s, d = _kernel_geometry(w, kernel_shape, strides, dilations)
    op_ = list(output_padding or [0] * n)
    i_ = x.shape[2:]
    # the full transpose (no pads) covers every contribution; output_padding adds positions at the end that get none;
    # the pads then cut from either side (a negative cut pads)
    full = [ss * (i - 1) + (kk - 1) * dd + 1 for i, ss, kk, dd in zip(i_, s, k, d)]
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        want = list(output_shape)[-n:] if output_shape else [i * ss for i, ss in zip(i_, s)]
        total = [f + o - w_ for f, o, w_ in zip(full, op_, want)]
        # (as ONNX's reference: only SAME_UPPER puts the larger half at the end)
        if auto_pad == "SAME_UPPER": pairs = [(t // 2, t - t // 2) for t in total]
        else: pairs = [(t - t // 2, t // 2) for t in total]
    elif auto_pad == "VALID": pairs = [(0, 0)] * n
    else: pairs = _pads_to_pairs(pads, n)
    out = x.conv_transpose2d(w, None, group, s, d, 0, 0)
    out = out.pad(((0, 0), (0, 0)) + tuple((-bg, o - e) for (bg, e), o in zip(pairs, op_)))
    return out if b is None else out + _channel(b, out.ndim)


def _pool_geometry(x: Tensor, auto_pad: str, kernel_shape: Sequence[int], strides: Sequence[int] | None,
                   dilations: Sequence[int] | None, pads: Sequence[int] | None, ceil_mode: int):
    k = list(kernel_shape)
    n = len(k)
    s, d = list(strides or [1] * n), list(dilations or [1] * n)
    in_sizes = x.shape[2:]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # the output size is ceil(in / stride); padding makes it so
        pairs = []
        for i, kk, ss, dd in zip(in_sizes, k, s, d):
            total = max(0, (-(-i // ss) - 1) * ss + (kk - 1) * dd + 1 - i)
            small, big = total // 2, total - total // 2
            pairs.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    else: pairs = _auto_pads(auto_pad, in_sizes, k, s, d, pads)
    return k, s, d, pairs


def _window_count(i: int, a: int, b: int, kk: int, ss: int, dd: int, ceil_mode: bool) -> int:
    """ONNX's pool output length along an axis of `i` elements padded by (a, b): floor (or ceil) of (in + pads -
    span) / stride, plus one."""
    q = i + a + b - ((kk - 1) * dd + 1)
    return (-(-q // ss) if ceil_mode else q // ss) + 1


def _ceil_pads(x: Tensor, k: Sequence[int], s: Sequence[int], d: Sequence[int],
               pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pads with the right ones made long enough that pooling without ceil_mode makes the windows ceil_mode does:
    ceil((in + pads - span) / stride) + 1 of them, less one that would start in the right padding (as onnxruntime and
    torch count them). Pooling a tensor padded by hand with ceil_mode counted that one too."""
    out = []
    for i, kk, ss, dd, (a, b) in zip(x.shape[2:], k, s, d, pairs):
        span = (kk - 1) * dd + 1
        n = _window_count(i, a, b, kk, ss, dd, True)
        if (n - 1) * ss >= i + a: n -= 1
        out.append((a, max(b, (n - 1) * ss + span - i - a)))
    return out


def _no_windows(x: Tensor, k: Sequence[int], s: Sequence[int], d: Sequence[int], pairs: Sequence[tuple[int, int]],
                ceil_mode: int) -> tuple[int, ...] | None:
    """The output shape of a pool with no window along some axis (a dilated kernel longer than the padded input:
    ONNX's floor((in + pads - span) / stride) + 1 is then 0, and its ceil where the span is longer by a stride or
    more), None where it has windows."""
    if any(is_symbolic(i) for i in x.shape[2:]): return None
    sizes = [_window_count(i, a, b, kk, ss, dd, bool(ceil_mode))
             for i, kk, ss, dd, (a, b) in zip(x.shape[2:], k, s, d, pairs)]
    return (*x.shape[:2], *(max(n, 0) for n in sizes)) if min(sizes) <= 0 else None


@op("MaxPool")
def max_pool(x: Tensor, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, dilations: Sequence[int] | None = None,
             kernel_shape: Sequence[int], pads: Sequence[int] | None = None, storage_order: int = 0,
             strides: Sequence[int] | None = None, ctx: Context) -> Tensor | tuple[Tensor, Tensor]:
    k, s, d, pairs = _pool_geometry(x, auto_pad, kernel_shape, strides, dilations, pads, ceil_mode)
    n = len(k)
    want_idx = ctx.n_outputs > 1
    if (empty := _no_windows(x, k, s, d, pairs, ceil_mode)) is not None:
        out = Tensor.empty(*empty, dtype=x.dtype, device=x.device)
        return (out, Tensor.empty(*empty, dtype=dtypes.int64, device=x.device)) if want_idx else out
    if all(max(p) <= (dd * (kk - 1) + 1) // 2 for p, kk, dd in zip(pairs, k, d)):
        res = x.max_pool2d(tuple(k), s, d, _flat(pairs), bool(ceil_mode), return_indices=want_idx)
    else:
        # ONNX allows pads beyond half the kernel: pad by hand with the lowest value
        if want_idx: raise Unsupported("MaxPool indices with pads larger than half the kernel")
        low = -math.inf if is_float(x) else dtypes.min(x.dtype)
        if ceil_mode: pairs, ceil_mode = _ceil_pads(x, k, s, d, pairs), 0
        xp = x.pad(((0, 0), (0, 0)) + tuple(pairs), value=low)
        res = xp.max_pool2d(tuple(k), s, d, 0, bool(ceil_mode))
    if not want_idx: return res
    out, idx = res
    spatial = x.shape[2:]
    plane = math.prod(spatial)
    idx = idx.cast(dtypes.int64)
    if storage_order:
        if n != 2: raise Unsupported("MaxPool storage_order=1 for other than 2 spatial dims")
        h, w_ = spatial
        idx = (idx % w_) * h + idx // w_
    # ONNX's indices count over the whole tensor, not one plane
    base = Tensor.arange(x.shape[0] * x.shape[1], dtype=dtypes.int64).reshape((x.shape[0], x.shape[1]) + (1,) * n)
    return out, idx + base * plane


@op("AveragePool")
def avg_pool(x: Tensor, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, count_include_pad: int = 0,
             dilations: Sequence[int] | None = None, kernel_shape: Sequence[int], pads: Sequence[int] | None = None,
             strides: Sequence[int] | None = None) -> Tensor:
    k, s, d, pairs = _pool_geometry(x, auto_pad, kernel_shape, strides, dilations, pads, ceil_mode)
    if (empty := _no_windows(x, k, s, d, pairs, ceil_mode)) is not None:
        return Tensor.empty(*empty, dtype=x.dtype, device=x.device)
    if all(max(p) <= (dd * (kk - 1) + 1) // 2 for p, kk, dd in zip(pairs, k, d)):
        return x.avg_pool2d(tuple(k), s, d, _flat(pairs), bool(ceil_mode), bool(count_include_pad))
    # pads beyond half the kernel: sum and count by hand
    # (with ceil_mode, zeros past the pads to whole windows: they add nothing to a window's sum or its count)
    full = _ceil_pads(x, k, s, d, pairs) if ceil_mode else list(pairs)
    ones = Tensor.ones(*x.shape[2:], dtype=x.dtype, device=x.device)
    xp = x.pad(((0, 0), (0, 0)) + tuple(full))
    total = xp.avg_pool2d(tuple(k), s, d, 0, False)
    cnt = ones.pad(tuple(pairs), value=1 if count_include_pad else 0).pad(
        tuple((0, f[1] - p[1]) for f, p in zip(full, pairs))).avg_pool2d(tuple(k), s, d, 0, False)
    return total / cnt


@op("GlobalAveragePool")
def global_avg_pool(x: Tensor) -> Tensor: return x.mean(tuple(range(2, x.ndim)), keepdim=True)


@op("GlobalMaxPool")
def global_max_pool(x: Tensor) -> Tensor: return x.max(tuple(range(2, x.ndim)), keepdim=True)


@op("LpPool")
def lp_pool(x: Tensor, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, dilations: Sequence[int] | None = None,
            kernel_shape: Sequence[int], p: int = 2, pads: Sequence[int] | None = None,
            strides: Sequence[int] | None = None) -> Tensor:
    k, s, d, pairs = _pool_geometry(x, auto_pad, kernel_shape, strides, dilations, pads, ceil_mode)
    if (empty := _no_windows(x, k, s, d, pairs, ceil_mode)) is not None:
        return Tensor.empty(*empty, dtype=x.dtype, device=x.device)
    if ceil_mode and not any(is_symbolic(i) for i in x.shape[2:]):
        # (the windows ceil_mode adds past the end sum what they cover: padded with zeros to whole windows, where
        # avg_pool2d's ceil_mode averaged them)
        pairs, ceil_mode = _ceil_pads(x, k, s, d, pairs), 0
    xp = x.abs().pow(p).pad(((0, 0), (0, 0)) + tuple(pairs))
    return (xp.avg_pool2d(tuple(k), s, d, 0, bool(ceil_mode)) * math.prod(k)).pow(1 / p)


@op("GlobalLpPool")
def global_lp_pool(x: Tensor, *, p: int = 2) -> Tensor:
    return x.abs().pow(p).sum(tuple(range(2, x.ndim)), keepdim=True).pow(1 / p)


# *** normalization ***

def _channel(t: Tensor, ndim: int) -> Tensor: return t.reshape((1, -1) + (1,) * (ndim - 2))


@op("BatchNormalization")
def batch_norm(x: Tensor, scale: Tensor, bias: Tensor, mean: Tensor, var: Tensor, *, epsilon: float = 1e-5,
               momentum: float = 0.9, training_mode: int = 0, spatial: int = 1,
               ctx: Context) -> Tensor | tuple[Tensor, ...]:
    if not spatial: raise Unsupported("BatchNormalization spatial=0")
    if training_mode:
        axes = tuple(i for i in range(x.ndim) if i != 1)
        bmean, bvar = x.mean(axes), x.var(axes, correction=0)
        y = (x - _channel(bmean, x.ndim)) * (_channel(bvar, x.ndim) + epsilon).rsqrt() * _channel(scale, x.ndim) + \
            _channel(bias, x.ndim)
        return y, mean * momentum + bmean * (1 - momentum), var * momentum + bvar * (1 - momentum)
    inv = (var + epsilon).rsqrt() * scale
    return x * _channel(inv, x.ndim) + _channel(bias - mean * inv, x.ndim)


@op("InstanceNormalization")
def instance_norm(x: Tensor, scale: Tensor, bias: Tensor, *, epsilon: float = 1e-5) -> Tensor:
    axes = tuple(range(2, x.ndim))
    m = x.mean(axes, keepdim=True)
    v = ((x - m) ** 2).mean(axes, keepdim=True)
    return (x - m) * (v + epsilon).rsqrt() * _channel(scale, x.ndim) + _channel(bias, x.ndim)


@op("LayerNormalization")
def layer_norm(x: Tensor, scale: Tensor, bias: Tensor | None = None, *, axis: int = -1, epsilon: float = 1e-5,
               stash_type: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    a = axis_of(axis, x.ndim)
    axes = tuple(range(a, x.ndim))
    xf = x.cast(dtypes.float32) if stash_type == 1 and x.dtype != dtypes.float64 else x
    m = xf.mean(axes, keepdim=True)
    inv = ((xf - m) ** 2).mean(axes, keepdim=True).add(epsilon).rsqrt()
    y = ((xf - m) * inv).cast(x.dtype) * scale
    if bias is not None: y = y + bias
    return y, m, inv


@op("RMSNormalization")
def rms_norm(x: Tensor, scale: Tensor, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1) -> Tensor:
    axes = tuple(range(axis_of(axis, x.ndim), x.ndim))
    xf = x.cast(dtypes.float32) if stash_type == 1 and x.dtype != dtypes.float64 else x
    return (xf * (xf * xf).mean(axes, keepdim=True).add(epsilon).rsqrt()).cast(x.dtype) * scale


@op("GroupNormalization")
def group_norm(x: Tensor, scale: Tensor, bias: Tensor, *, epsilon: float = 1e-5, num_groups: int,
               stash_type: int = 1, ctx: Context) -> Tensor:
    n, c = x.shape[:2]
    g = x.reshape(n, num_groups, -1)
    gf = g.cast(dtypes.float32) if stash_type == 1 and x.dtype != dtypes.float64 else g
    m = gf.mean(-1, keepdim=True)
    y = ((gf - m) * ((gf - m) ** 2).mean(-1, keepdim=True).add(epsilon).rsqrt()).cast(x.dtype).reshape(x.shape)
    if ctx.opset < 21:
        # opset 18's scale and bias hold one value per group
        scale, bias = scale.repeat_interleave(c // num_groups), bias.repeat_interleave(c // num_groups)
    return y * _channel(scale, x.ndim) + _channel(bias, x.ndim)


@op("LpNormalization")
def lp_norm(x: Tensor, *, axis: int = -1, p: int = 2) -> Tensor:
    a = axis_of(axis, x.ndim)
    norm = x.abs().sum(a, keepdim=True) if p == 1 else (x * x).sum(a, keepdim=True).sqrt()
    if p not in (1, 2): raise Unsupported(f"LpNormalization p={p}")
    return (norm == 0).where(0, x / norm)


@op("MeanVarianceNormalization")
def mvn(x: Tensor, *, axes: Sequence[int] = (0, 2, 3)) -> Tensor:
    ax = tuple(axis_of(a, x.ndim) for a in axes)
    m = x.mean(ax, keepdim=True)
    return (x - m) / ((x - m) ** 2).mean(ax, keepdim=True).sqrt().add(1e-9)


@op("LRN")
def lrn(x: Tensor, *, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0, size: int) -> Tensor:
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = (x * x).pad(((0, 0), (before, after)) + ((0, 0),) * (x.ndim - 2))
    window = sq.unfold(1, size, 1).sum(-1)
    return x / (bias + alpha / size * window) ** beta


# *** shapes and movement ***

@op("Reshape")
def reshape(x: Tensor, shape_t: Tensor | None = None, *, allowzero: int = 0,
            shape: Sequence[int] | None = None) -> Tensor:
    want = ints(shape_t) if shape_t is not None else list(shape or [])
    if not allowzero: want = [x.shape[i] if _is_int(v, 0) else v for i, v in enumerate(want)]
    minus = [i for i, v in enumerate(want) if _is_int(v, -1)]
    if len(minus) > 1: raise ValueError(f"shape {want} has more than one -1")
    total = ssimplify(math.prod(x.shape))
    if minus:
        known = ssimplify(math.prod(v for i, v in enumerate(want) if i != minus[0]))
        rest = ssimplify(total // known) if not _is_int(known, 0) else None
        if is_symbolic(rest) and is_symbolic(known) and sym_value(known):
            # (batch * 6) / (batch * 2): a whole number the simplifier doesn't see; checked below for every value
            rest = sym_value(total) // sym_value(known)
        if rest is None or not sym_eq(ssimplify(rest * known), total):
            raise ValueError(f"can't reshape {tuple(x.shape)} to {want}")
        want[minus[0]] = rest
    if not sym_eq(ssimplify(math.prod(want)), total): raise ValueError(f"can't reshape {tuple(x.shape)} to {want}")
    return x.reshape(tuple(want))


def _is_int(v: Any, n: int) -> bool: return not is_symbolic(v) and v == n


@op("Flatten")
def flatten(x: Tensor, *, axis: int = 1) -> Tensor:
    a = axis if axis >= 0 else axis + x.ndim
    if not 0 <= a <= x.ndim: raise ValueError(f"axis {axis} is out of range for rank {x.ndim}")
    return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))


@op("Squeeze")
def squeeze(x: Tensor, axes_in: Tensor | None = None, *, axes: Sequence[int] | None = None) -> Tensor:
    ax = ints(axes_in) if axes_in is not None else list(axes or [])
    if not ax:
        # (every dim of 1: whether a named dim is depends on the call, and so does the result's rank)
        if any(is_symbolic(s) for s in x.shape): raise Unsupported("Squeeze without axes of a named dim")
        return x.reshape(tuple(s for s in x.shape if s != 1))
    ax = [axis_of(a, x.ndim) for a in ax]
    if any(x.shape[a] != 1 for a in ax): raise ValueError(f"can't squeeze axes {ax} of shape {tuple(x.shape)}")
    return x.reshape(tuple(s for i, s in enumerate(x.shape) if i not in ax))


@op("Unsqueeze")
def unsqueeze(x: Tensor, axes_in: Tensor | None = None, *, axes: Sequence[int] | None = None) -> Tensor:
    ax = ints(axes_in) if axes_in is not None else list(axes or [])
    rank = x.ndim + len(ax)
    ax = sorted(axis_of(a, rank) for a in ax)
    if len(set(ax)) != len(ax): raise ValueError(f"repeated axes {ax}")
    shape_ = list(x.shape)
    for a in ax: shape_.insert(a, 1)
    return x.reshape(tuple(shape_))


@op("Transpose")
def transpose(x: Tensor, *, perm: Sequence[int] | None = None) -> Tensor:
    return x.permute(tuple(perm) if perm is not None else tuple(range(x.ndim))[::-1])


@op("Concat")
def concat(*xs: Tensor, axis: int) -> Tensor:
    a = axis_of(axis, xs[0].ndim)
    return xs[0].cat(*xs[1:], dim=a)


@op("Split")
def split(x: Tensor, split_in: Tensor | None = None, *, axis: int = 0, split: Sequence[int] | None = None,
          num_outputs: int | None = None, ctx: Context) -> list[Tensor]:
    a = axis_of(axis, x.ndim)
    sizes = ints(split_in) if split_in is not None else list(split or [])
    if not sizes:
        n = num_outputs or ctx.n_outputs
        chunk = -(-x.shape[a] // n)
        sizes = [min(chunk, x.shape[a] - i * chunk) for i in range(n)]
    if sum(sizes) != x.shape[a]: raise ValueError(f"split sizes {sizes} don't add up to dim {a} of {tuple(x.shape)}")
    return list(x.split(sizes, a))


@op("Slice")
def slice_(x: Tensor, starts_in: Tensor | None = None, ends_in: Tensor | None = None, axes_in: Tensor | None = None,
           steps_in: Tensor | None = None, *, starts: Sequence[int] | None = None, ends: Sequence[int] | None = None,
           axes: Sequence[int] | None = None) -> Tensor:
    # before opset 10 starts, ends and axes were attributes
    st = ints(starts_in) if starts_in is not None else list(starts or [])
    en = ints(ends_in) if ends_in is not None else list(ends or [])
    ax = ints(axes_in) if axes_in is not None else list(axes or range(len(st)))
    sp = ints(steps_in) if steps_in is not None else [1] * len(st)
    if not len(st) == len(en) == len(ax) == len(sp): raise ValueError("starts, ends, axes and steps differ in length")
    idx: list[Any] = [slice(None)] * x.ndim
    for s, e, a, p in zip(st, en, ax, sp):
        if p == 0: raise ValueError("a slice step can't be 0")
        a = axis_of(a, x.ndim)
        if is_symbolic(x.shape[a]) or is_symbolic(s) or is_symbolic(e):
            idx[a] = _symbolic_slice(s, e, p, x.shape[a])
            continue
        # Python's slice clamps as ONNX does (including the sentinels INT64_MAX and INT64_MIN), except a start before
        # the dim's beginning with a negative step: ONNX clamps it to the first element, Python to before it (empty)
        if p < 0 and s < -x.shape[a]: s = 0
        idx[a] = slice(s, e, p)
    if any(is_symbolic(d) for d in x.shape): return x[tuple(idx)]
    dims = [len(range(*sl.indices(d))) for sl, d in zip(idx, x.shape)]
    if any(n == 0 for n in dims): return Tensor.empty(*dims, dtype=x.dtype, device=x.device)
    return x[tuple(idx)]


def _symbolic_slice(s: Any, e: Any, p: int, d: Any) -> slice:
    """A step-1 slice of a dim with a symbolic size or symbolic bounds, where the bounds provably lie inside it for
    every value of the Variables; anything else is Unsupported here (the runner then uses this call's values)."""
    big = 1 << 62
    if p != 1: raise Unsupported("a strided slice of a symbolic dim")
    if not is_symbolic(e) and e >= big: e = d
    elif not is_symbolic(e) and e < 0: e = ssimplify(d + e)
    if not is_symbolic(s) and s < 0: s = ssimplify(d + s)
    lo, span = ssimplify(s), ssimplify(e - s)
    inside = ssimplify(d - e)
    def vmin(v: Any) -> int: return v.vmin if is_symbolic(v) else v
    if vmin(lo) < 0 or vmin(span) < 0 or vmin(inside) < 0:
        raise Unsupported(f"slice {s}:{e} of a dim of size {d} is not inside it for every value")
    return slice(lo, e)


def _norm_index(idx: Tensor, n: int) -> Tensor:
    idx = idx.cast(dtypes.int64) if idx.dtype != dtypes.int64 else idx
    return (idx < 0).where(idx + n, idx)


@op("Gather")
def gather(x: Tensor, idx: Tensor, *, axis: int = 0) -> Tensor:
    a = axis_of(axis, x.ndim)
    # a single index known on the host (a constant, as in `h[:, 0]`) is a slice; one computed on the device is selected
    # like the others (reading it here would be a wait, and under TinyJit a value frozen at the capture)
    if idx.ndim == 0 and (known := known_value(idx)) is not None:
        v = int(known.reshape(-1)[0])
        if not -x.shape[a] <= v < x.shape[a]:
            raise IndexError(f"Gather index {v} is out of range for axis {a} of size {x.shape[a]}")
        v %= x.shape[a]
        return x.shrink(tuple((v, v + 1) if d == a else None for d in range(x.ndim))).reshape(
            x.shape[:a] + x.shape[a + 1:])
    if idx.ndim >= 1 and all(type(d) is int for d in x.shape + idx.shape):
        # PyTorch's gather of the indices spread over the result's shape (x.shape[:a] + idx.shape + x.shape[a+1:],
        # negative indices counting from the end): one indexed load per element, stored in the result's order.
        # Indexing (below) stores it with the indices' axes last (an embedding's (positions, tokens), which a
        # layer norm over the positions then reads as scattered scalars) and normalizes the indices in a kernel of
        # its own
        # (an index out of range is an IndexError where its values are at hand, as indexing checks them: the gather
        # reads the normalized indices, which nothing checks)
        _check_index_values(idx, x.shape[a], a, True)
        flat = _norm_index(idx.reshape(-1), x.shape[a])
        spread = x.shape[:a] + (flat.shape[0],) + x.shape[a + 1:]
        where = flat.reshape((1,) * a + (flat.shape[0],) + (1,) * (x.ndim - a - 1)).expand(spread)
        return x.gather(a, where).reshape(x.shape[:a] + idx.shape + x.shape[a + 1:])
    # indexing by a tensor is ONNX's Gather, and it builds the selection at the result's shape, which the code
    # generator turns into one indexed load per element (a one-hot mask of (indices, positions) made here would be a
    # kernel of its own, and a sum over every position)
    return x[(slice(None),) * a + (idx,)]


@op("GatherElements")
def gather_elements(x: Tensor, idx: Tensor, *, axis: int = 0) -> Tensor:
    a = axis_of(axis, x.ndim)
    return x.gather(a, _norm_index(idx, x.shape[a]))


@op("GatherND")
def gather_nd(x: Tensor, idx: Tensor, *, batch_dims: int = 0) -> Tensor:
    b, k = batch_dims, idx.shape[-1]
    bshape, dshape, rshape = x.shape[:b], x.shape[b:b + k], x.shape[b + k:]
    mshape = idx.shape[b:-1]
    bp, dp, rp, mp = math.prod(bshape), math.prod(dshape), math.prod(rshape), math.prod(mshape)
    strides = [math.prod(dshape[j + 1:]) for j in range(k)]
    ii = idx.cast(dtypes.int64)
    lin = sum((_norm_index(ii[..., j], dshape[j]) * strides[j] for j in range(k)), Tensor.zeros(*ii.shape[:-1],
                                                                                               dtype=dtypes.int64))
    lin = lin.reshape(bp, mp, 1).expand(bp, mp, rp).cast(dtypes.int32)
    out = x.reshape(bp, dp, rp).gather(1, lin)
    return out.reshape(tuple(bshape) + tuple(mshape) + tuple(rshape))


_SCATTER_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@op("ScatterElements", "Scatter")
def scatter_elements(x: Tensor, idx: Tensor, upd: Tensor, *, axis: int = 0, reduction: str = "none") -> Tensor:
    a = axis_of(axis, x.ndim)
    i = _norm_index(idx, x.shape[a])
    if reduction == "none": return x.scatter(a, i, upd)
    if reduction not in _SCATTER_REDUCE: raise Unsupported(f"reduction {reduction!r}")
    return x.scatter_reduce(a, i, upd, _SCATTER_REDUCE[reduction])  # type: ignore[arg-type]


@op("ScatterND")
def scatter_nd(x: Tensor, idx: Tensor, upd: Tensor, *, reduction: str = "none") -> Tensor:
    k = idx.shape[-1]
    dshape, rshape = x.shape[:k], x.shape[k:]
    mp, rp, dp = math.prod(idx.shape[:-1]), math.prod(rshape), math.prod(dshape)
    strides = [math.prod(dshape[j + 1:]) for j in range(k)]
    ii = idx.cast(dtypes.int64)
    lin = sum((_norm_index(ii[..., j], dshape[j]) * strides[j] for j in range(k)), Tensor.zeros(*ii.shape[:-1],
                                                                                               dtype=dtypes.int64))
    lin = lin.reshape(mp, 1).expand(mp, rp)
    flat, u = x.reshape(dp, rp), upd.reshape(mp, rp)
    if reduction == "none": out = flat.scatter(0, lin, u)
    elif reduction in _SCATTER_REDUCE: out = flat.scatter_reduce(0, lin, u, _SCATTER_REDUCE[reduction])  # type: ignore
    else: raise Unsupported(f"reduction {reduction!r}")
    return out.reshape(x.shape)


@op("Expand")
def expand(x: Tensor, shape_t: Tensor) -> Tensor:
    want = ints(shape_t)
    rank = max(len(want), x.ndim)
    xs = (1,) * (rank - x.ndim) + tuple(x.shape)
    ws = (1,) * (rank - len(want)) + tuple(want)
    out = []
    for a, b in zip(xs, ws):
        if a != b and a != 1 and b != 1: raise ValueError(f"can't broadcast {tuple(x.shape)} to {want}")
        out.append(a if b == 1 else b)
    return x.reshape(xs).expand(tuple(out))


@op("Tile")
def tile(x: Tensor, repeats: Tensor) -> Tensor:
    r = ints(repeats)
    if len(r) != x.ndim: raise ValueError(f"repeats {r} needs one entry per dim of {tuple(x.shape)}")
    if any(v == 0 for v in r): return Tensor.empty(*(s * v for s, v in zip(x.shape, r)), dtype=x.dtype)
    return x.repeat(r)


@op("ConstantOfShape")
def constant_of_shape(shape_t: Tensor, *, value: Tensor | None = None) -> Tensor:
    dims = ints(shape_t)
    if value is None: return Tensor.zeros(*dims, dtype=dtypes.float32) if dims else Tensor(np.float32(0))
    return Tensor.full(tuple(dims), scalar(value), dtype=value.dtype)


@op("Constant")
def constant(*, value: Tensor | None = None, value_float: float | None = None,
             value_floats: Sequence[float] | None = None, value_int: int | None = None,
             value_ints: Sequence[int] | None = None, value_string: str | None = None,
             value_strings: Sequence[str] | None = None, sparse_value: Any = None) -> Tensor:
    if value is not None: return value
    arr = None
    if value_float is not None: arr = np.array(value_float, dtype=np.float32)
    if value_floats is not None: arr = np.array(value_floats, dtype=np.float32)
    if value_int is not None: arr = np.array(value_int, dtype=np.int64)
    if value_ints is not None: arr = np.array(value_ints, dtype=np.int64)
    if arr is not None: return with_host(Tensor(arr), arr)
    # (a string tensor is a NumPy array of str, on the host)
    if value_string is not None: return np.array(value_string, dtype=object)
    if value_strings is not None: return np.array(list(value_strings), dtype=object)
    raise Unsupported("sparse constants")


@op("Range")
def range_(start: Tensor, limit: Tensor, delta: Tensor) -> Tensor:
    s, lim, d = scalar(start), scalar(limit), scalar(delta)
    if is_symbolic(s) or is_symbolic(lim) or is_symbolic(d):
        # arange(start, n) with a symbolic n (position ids of a sequence); other symbolic ranges use the call's values
        n = ssimplify(lim - s)
        if d != 1 or is_float(start) or not is_symbolic(n) or n.vmin < 1: raise Unsupported("a symbolic Range")
        return (Tensor.arange(n, dtype=dtypes.int64) + s).cast(start.dtype)
    n = max(math.ceil((lim - s) / d), 0)
    if n == 0: return Tensor.empty(0, dtype=start.dtype)
    # start + i * delta, in the inputs' dtype (as ONNX's loop that adds delta would only differ by rounding)
    return (Tensor.arange(n, dtype=dtypes.int64 if not is_float(start) else start.dtype) * d + s).cast(start.dtype)


@op("Pad")
def pad(x: Tensor, pads_in: Tensor | None = None, value_in: Tensor | None = None, axes_in: Tensor | None = None, *,
        mode: str = "constant", pads: Sequence[int] | None = None, value: float = 0.0) -> Tensor:
    p = ints(pads_in) if pads_in is not None else list(pads or [])
    ax = [axis_of(a, x.ndim) for a in ints(axes_in)] if axes_in is not None else list(range(x.ndim))
    if len(p) != 2 * len(ax): raise ValueError(f"pads {p} must have 2 values for each of the axes {ax}")
    pairs: list[tuple[int, int]] = [(0, 0)] * x.ndim
    for j, a in enumerate(ax): pairs[a] = (p[j], p[j + len(ax)])
    v = scalar(value_in) if value_in is not None else value
    modes = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}
    if mode not in modes: raise Unsupported(f"Pad mode {mode!r}")
    if mode != "constant": return x.pad(tuple(pairs), mode=modes[mode])
    return x.pad(tuple(pairs), value=v)


@op("Dropout")
def dropout(x: Tensor, ratio_in: Tensor | None = None, training_in: Tensor | None = None, *, seed: int | None = None,
            ratio: float = 0.5, is_test: int = 0, ctx: Context) -> tuple[Tensor, Tensor]:
    training = bool(scalar(training_in)) if training_in is not None else False
    r = float(scalar(ratio_in)) if ratio_in is not None else ratio
    if not training or r == 0:
        return x, Tensor.ones(*x.shape, dtype=dtypes.bool)
    if seed is not None: Tensor.manual_seed(seed)
    keep = Tensor.rand(*x.shape) >= r
    return keep.where(x / (1 - r), 0).cast(x.dtype), keep


@op("Trilu")
def trilu(x: Tensor, k: Tensor | None = None, *, upper: int = 1) -> Tensor:
    kk = int(scalar(k)) if k is not None else 0
    return x.triu(kk) if upper else x.tril(kk)


@op("TopK")
def topk(x: Tensor, k: Tensor, *, axis: int = -1, largest: int = 1, sorted: int = 1) -> tuple[Tensor, Tensor]:  # noqa: A002
    v, i = x.topk(int(scalar(k)), axis_of(axis, x.ndim), bool(largest), True)
    return v, i.cast(dtypes.int64)


@op("OneHot")
def one_hot(idx: Tensor, depth: Tensor, values: Tensor, *, axis: int = -1) -> Tensor:
    d = int(scalar(depth))
    a = axis_of(axis, idx.ndim + 1)
    i = idx.cast(dtypes.int64)
    i = (i < 0).where(i + d, i)
    pos = Tensor.arange(d, dtype=dtypes.int64).reshape(tuple(-1 if j == a else 1 for j in range(idx.ndim + 1)))
    hit = i.unsqueeze(a) == pos
    return hit.where(values[1], values[0])


@op("NonZero")
def nonzero(x: Tensor) -> Tensor:
    if x.ndim == 0: x = x.reshape(1)
    return x.nonzero().T.cast(dtypes.int64)


@op("Compress")
def compress(x: Tensor, cond: Tensor, *, axis: int | None = None) -> Tensor:
    keep = [i for i, c in enumerate(np.asarray(cond.numpy()).reshape(-1)) if c]
    src, a = (x.reshape(-1), 0) if axis is None else (x, axis_of(axis, x.ndim))
    keep = [i for i in keep if i < src.shape[a]]
    if not keep: return Tensor.empty(*(0 if d == a else s for d, s in enumerate(src.shape)), dtype=x.dtype)
    return gather(src, Tensor(np.array(keep, dtype=np.int64)), axis=a)


@op("EyeLike")
def eye_like(x: Tensor, *, dtype: int | None = None, k: int = 0) -> Tensor:
    dt = onnx_dtype(dtype) if dtype is not None else x.dtype
    r, c = x.shape
    rows = Tensor.arange(r, dtype=dtypes.int32).reshape(-1, 1)
    cols = Tensor.arange(c, dtype=dtypes.int32).reshape(1, -1)
    return (cols - rows == k).cast(dt)


@op("DepthToSpace")
def depth_to_space(x: Tensor, *, blocksize: int, mode: str = "DCR") -> Tensor:
    n, c, h, w = x.shape
    b = blocksize
    if mode == "DCR": y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    elif mode == "CRD": y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    else: raise ValueError(f"mode must be DCR or CRD, got {mode!r}")
    return y.reshape(n, c // (b * b), h * b, w * b)


@op("SpaceToDepth")
def space_to_depth(x: Tensor, *, blocksize: int, mode: str = "DCR") -> Tensor:
    n, c, h, w = x.shape
    b = blocksize
    y = x.reshape(n, c, h // b, b, w // b, b)
    if mode == "DCR": y = y.permute(0, 3, 5, 1, 2, 4)
    elif mode == "CRD": y = y.permute(0, 1, 3, 5, 2, 4)
    else: raise ValueError(f"mode must be DCR or CRD, got {mode!r}")
    return y.reshape(n, c * b * b, h // b, w // b)


# *** recurrent layers ***

def _activation(name: str, alpha: float | None, beta: float | None) -> Callable[[Tensor], Tensor]:
    acts: dict[str, Callable[[Tensor], Tensor]] = {
        "Sigmoid": Tensor.sigmoid, "Tanh": Tensor.tanh, "Relu": Tensor.relu, "Softsign": Tensor.softsign,
        "Softplus": Tensor.softplus,
        "Affine": lambda x: x * (1.0 if alpha is None else alpha) + (0.0 if beta is None else beta),
        "LeakyRelu": lambda x: leaky_relu(x, alpha=0.01 if alpha is None else alpha),
        "ThresholdedRelu": lambda x: thresholded_relu(x, alpha=1.0 if alpha is None else alpha),
        "ScaledTanh": lambda x: (1.0 if alpha is None else alpha) * (x * (1.0 if beta is None else beta)).tanh(),
        "HardSigmoid": lambda x: hard_sigmoid(x, alpha=0.2 if alpha is None else alpha,
                                              beta=0.5 if beta is None else beta),
        "Elu": lambda x: elu(x, alpha=1.0 if alpha is None else alpha),
    }
    if name not in acts: raise Unsupported(f"activation {name!r}")
    return acts[name]


def _recurrent(kind: str, x: Tensor, w: Tensor, r: Tensor, b: Tensor | None, seq_lens: Tensor | None,
               h0: Tensor | None, c0: Tensor | None, p: Tensor | None, activations: Sequence[str] | None,
               alpha: Sequence[float] | None, beta: Sequence[float] | None, clip: float | None, direction: str,
               hidden: int, layout: int, linear_before_reset: int = 0) -> tuple[Tensor, ...]:
    """LSTM, GRU and RNN: the input projection of every step in one matmul, then the steps one by one."""
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    defaults = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[kind]
    if direction not in ("forward", "reverse", "bidirectional"): raise ValueError(f"direction {direction!r}")
    ndir = 2 if direction == "bidirectional" else 1
    if layout: x = x.permute(1, 0, 2)
    seq, batch = x.shape[:2]
    n_act = len(defaults)
    acts_n = list(activations) if activations else defaults * ndir
    if len(acts_n) == n_act and ndir == 2: acts_n = acts_n * 2
    al, be = list(alpha or []), list(beta or [])
    fns = [_activation(a, al[i] if i < len(al) else None, be[i] if i < len(be) else None) for i, a in enumerate(acts_n)]
    lens = ints(seq_lens) if seq_lens is not None else [seq] * batch
    masked = any(v != seq for v in lens)
    if masked and direction != "forward": raise Unsupported("sequence_lens shorter than the sequence unless forward")
    steps_mask = Tensor(np.array([[t < v for v in lens] for t in range(seq)], dtype=np.bool_)).reshape(seq, batch, 1) \
        if masked else None
    ys, hs, cs = [], [], []
    for d in range(ndir):
        reverse = direction == "reverse" or d == 1
        f, g, h_act = (fns[d * n_act:(d + 1) * n_act] + [None, None])[:3]
        wd, rd = w[d], r[d]  # (gates*hidden, input), (gates*hidden, hidden)
        bw = b[d, :gates * hidden] if b is not None else None
        br = b[d, gates * hidden:] if b is not None else None
        xw = x @ wd.T  # (seq, batch, gates*hidden)
        if bw is not None: xw = xw + bw
        h = h0[d] if h0 is not None else Tensor.zeros(batch, hidden, dtype=x.dtype)
        c = c0[d] if c0 is not None else Tensor.zeros(batch, hidden, dtype=x.dtype)
        out: list[Tensor] = [None] * seq  # type: ignore[list-item]
        for t in (range(seq - 1, -1, -1) if reverse else range(seq)):
            xt = xw[t]
            if kind == "GRU":
                rec = h @ rd[:2 * hidden].T
                if br is not None: rec = rec + br[:2 * hidden]
                pre = xt[:, :2 * hidden] + rec
                if clip is not None: pre = pre.clip(-clip, clip)
                z, rr = f(pre[:, :hidden]), f(pre[:, hidden:])
                rh, rbh = rd[2 * hidden:], (br[2 * hidden:] if br is not None else 0)
                if linear_before_reset: hh = xt[:, 2 * hidden:] + rr * (h @ rh.T + rbh)
                else: hh = xt[:, 2 * hidden:] + (rr * h) @ rh.T + rbh
                if clip is not None: hh = hh.clip(-clip, clip)
                new_h, new_c = (1 - z) * g(hh) + z * h, c
            else:
                pre = xt + h @ rd.T
                if br is not None: pre = pre + br
                if clip is not None: pre = pre.clip(-clip, clip)
                if kind == "RNN": new_h, new_c = f(pre), c
                else:
                    i_, o_, f_, c_ = (pre[:, k * hidden:(k + 1) * hidden] for k in range(4))
                    if p is not None: i_, f_ = i_ + p[d, :hidden] * c, f_ + p[d, 2 * hidden:] * c
                    new_c = f(f_) * c + f(i_) * g(c_)
                    if p is not None: o_ = o_ + p[d, hidden:2 * hidden] * new_c
                    new_h = f(o_) * h_act(new_c)
            if steps_mask is not None:
                new_h, new_c = steps_mask[t].where(new_h, h), steps_mask[t].where(new_c, c)
                out[t] = steps_mask[t].where(new_h, 0)
            else: out[t] = new_h
            h, c = new_h, new_c
        ys.append(Tensor.stack(*out, dim=0) if seq else Tensor.zeros(0, batch, hidden, dtype=x.dtype))
        hs.append(h)
        cs.append(c)
    y = Tensor.stack(*ys, dim=1)  # (seq, ndir, batch, hidden)
    yh, yc = Tensor.stack(*hs, dim=0), Tensor.stack(*cs, dim=0)
    if layout: y, yh, yc = y.permute(2, 0, 1, 3), yh.permute(1, 0, 2), yc.permute(1, 0, 2)
    return y, yh, yc


@op("LSTM")
def lstm(x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None, seq_lens: Tensor | None = None,
         h0: Tensor | None = None, c0: Tensor | None = None, p: Tensor | None = None, *,
         activation_alpha: Sequence[float] | None = None, activation_beta: Sequence[float] | None = None,
         activations: Sequence[str] | None = None, clip: float | None = None, direction: str = "forward",
         hidden_size: int, input_forget: int = 0, layout: int = 0) -> tuple[Tensor, ...]:
    if input_forget: raise Unsupported("LSTM input_forget=1")
    return _recurrent("LSTM", x, w, r, b, seq_lens, h0, c0, p, activations, activation_alpha, activation_beta, clip,
                      direction, hidden_size, layout)


@op("GRU")
def gru(x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None, seq_lens: Tensor | None = None,
        h0: Tensor | None = None, *, activation_alpha: Sequence[float] | None = None,
        activation_beta: Sequence[float] | None = None, activations: Sequence[str] | None = None,
        clip: float | None = None, direction: str = "forward", hidden_size: int, layout: int = 0,
        linear_before_reset: int = 0) -> tuple[Tensor, ...]:
    return _recurrent("GRU", x, w, r, b, seq_lens, h0, None, None, activations, activation_alpha, activation_beta,
                      clip, direction, hidden_size, layout, linear_before_reset)[:2]


@op("RNN")
def rnn(x: Tensor, w: Tensor, r: Tensor, b: Tensor | None = None, seq_lens: Tensor | None = None,
        h0: Tensor | None = None, *, activation_alpha: Sequence[float] | None = None,
        activation_beta: Sequence[float] | None = None, activations: Sequence[str] | None = None,
        clip: float | None = None, direction: str = "forward", hidden_size: int,
        layout: int = 0) -> tuple[Tensor, ...]:
    return _recurrent("RNN", x, w, r, b, seq_lens, h0, None, None, activations, activation_alpha, activation_beta,
                      clip, direction, hidden_size, layout)[:2]


# *** BitCast, SwiGLU, ReverseSequence, Unique ***

@op("BitCast")
def bitcast(x: Tensor, *, to: int) -> Tensor:
    dt = onnx_dtype(to)
    if dt.itemsize != x.dtype.itemsize:
        raise ValueError(f"BitCast needs types of one size, got {x.dtype} ({x.dtype.itemsize} bytes) to {dt} "
                         f"({dt.itemsize} bytes)")
    # a bool is one byte of 0 or 1, as a uint8 holds it
    if x.dtype == dtypes.bool: return x.cast(dtypes.uint8).bitcast(dt) if dt != dtypes.uint8 else x.cast(dt)
    if dt == dtypes.bool: return x.bitcast(dtypes.uint8) != 0 if x.dtype != dtypes.uint8 else x != 0
    return x.bitcast(dt)


@op("SwiGLU")
def swiglu(a: Tensor, b: Tensor, *, alpha: float = 1.0) -> Tensor:
    """a * sigmoid(alpha * a) * b, computed in float32 at least."""
    if not is_float(a) or a.dtype != b.dtype: raise ValueError(f"the inputs must be of one float type, got {a.dtype} "
                                                               f"and {b.dtype}")
    work = least_upper_float(a.dtype) if a.dtype.itemsize >= 4 else dtypes.float32
    af, bf = a.cast(work), b.cast(work)
    return (af * (af * alpha).sigmoid() * bf).cast(a.dtype)


@op("ReverseSequence")
def reverse_sequence(x: Tensor, sequence_lens: Tensor, *, batch_axis: int = 1, time_axis: int = 0) -> Tensor:
    """The first sequence_lens[b] steps of each batch entry b along the time axis reversed, the rest as they are."""
    if x.ndim < 2 or {batch_axis, time_axis} != {0, 1}:
        raise ValueError(f"batch_axis ({batch_axis}) and time_axis ({time_axis}) must be 0 and 1 of a tensor of rank "
                         f"2 or more (rank {x.ndim})")
    n_batch, n_time = x.shape[batch_axis], x.shape[time_axis]
    if tuple(sequence_lens.shape) != (n_batch,):
        raise ValueError(f"sequence_lens must have shape ({n_batch},), got {tuple(sequence_lens.shape)}")
    lens = sequence_lens.cast(dtypes.int32).reshape(1, -1)  # (1, batch)
    t = Tensor.arange(n_time, dtype=dtypes.int32).reshape(-1, 1)
    src = (t < lens).where(lens - 1 - t, t)  # (time, batch): the step each output step reads
    if time_axis == 1: src = src.transpose(0, 1)
    index = src.reshape(*src.shape, *([1] * (x.ndim - 2))).expand(*x.shape)
    return x.gather(time_axis, index)


@op("Unique")
def unique(x: Tensor, *, axis: int | None = None, sorted: int = 1) -> tuple[Tensor, ...]:  # noqa: A002
    """The distinct values (or slices along `axis`), the index of each one's first occurrence, the index of each
    input element's value among them and each one's count. The output's length depends on the values, so it runs on
    the host (a read of x)."""
    if sorted not in (0, 1): raise ValueError(f"sorted must be 0 or 1, got {sorted}")
    if known_value(x) is None and _realize.capturing:
        raise Unsupported("an input computed on the device under TinyJit: the output's length depends on its values, "
                          "which a capture can't replay (call the runner without TinyJit)")
    arr = host_value(x)
    a = None if axis is None else axis_of(axis, arr.ndim)
    flat = arr.reshape(-1) if a is None else arr
    vals, first, inverse, counts = np.unique(flat, return_index=True, return_inverse=True, return_counts=True, axis=a)
    inverse = inverse.reshape(-1)
    if not sorted:
        # the order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        vals, first, counts, inverse = np.take(vals, order, axis=0 if a is None else a), first[order], \
            counts[order], rank[inverse]
    outs = [vals.astype(arr.dtype), first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)]
    return tuple(with_host(Tensor(np.ascontiguousarray(o)).cast(x.dtype if i == 0 else dtypes.int64), o)
                 for i, o in enumerate(outs))


@op("Det")
def det(x: Tensor) -> Tensor:
    """The determinant of each (..., n, n) matrix: Gaussian elimination with partial pivoting, unrolled over the n
    columns (n is static), in float64 for float64 input and float32 otherwise."""
    if x.ndim < 2 or x.shape[-1] != x.shape[-2] or not is_float(x):
        raise ValueError(f"the input must be float (..., n, n) matrices, got {x.dtype} of shape {tuple(x.shape)}")
    n = x.shape[-1]
    work = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    a = x.cast(work)
    rows = Tensor.arange(n)
    out = Tensor.ones(*x.shape[:-2], dtype=work) if x.ndim > 2 else Tensor.ones((), dtype=work)
    for k in range(n):
        # the row at or below k with the largest entry in column k comes to row k (a swap flips the sign)
        col = (rows >= k).where(a[..., :, k].abs(), -1.0)
        p = col.argmax(-1)
        hot_p, hot_k = (rows == p.unsqueeze(-1)).cast(work), (rows == k).cast(work)
        row_p, row_k = (hot_p.unsqueeze(-1) * a).sum(-2), a[..., k, :]
        swap = (row_p - row_k).unsqueeze(-2)
        a = a - hot_p.unsqueeze(-1) * swap + hot_k.unsqueeze(-1) * swap
        pivot = a[..., k, k]
        out = out * (p != k).where(-pivot, pivot)
        # a zero pivot leaves the determinant 0 whatever is eliminated
        factor = (rows > k).where(a[..., :, k] / (pivot == 0).where(1.0, pivot).unsqueeze(-1), 0.0)
        a = a - factor.unsqueeze(-1) * a[..., k, :].unsqueeze(-2)
    return out.cast(x.dtype)


@op("Col2Im")
def col2im(x: Tensor, image_shape: Tensor, block_shape: Tensor, *, dilations: Sequence[int] | None = None,
           pads: Sequence[int] | None = None, strides: Sequence[int] | None = None) -> Tensor:
    """(N, C, *image_shape) from (N, C * prod(block_shape), L) columns: each block position's values are spread at
    their strided places in the padded image and summed where blocks overlap (the inverse layout of im2col)."""
    image, block = ints(image_shape), ints(block_shape)
    nd = len(image)
    dil, st = list(dilations or [1] * nd), list(strides or [1] * nd)
    pad = list(pads or [0] * (2 * nd))
    if len(block) != nd or len(dil) != nd or len(st) != nd or len(pad) != 2 * nd:
        raise ValueError(f"image_shape {image}, block_shape {block}, dilations {dil}, strides {st} and pads {pad} "
                         "must agree in their number of spatial dims")
    if x.ndim != 3: raise ValueError(f"the input must be (N, C * prod(block_shape), L), got shape {tuple(x.shape)}")
    padded = [image[d] + pad[d] + pad[d + nd] for d in range(nd)]
    counts = [(padded[d] - dil[d] * (block[d] - 1) - 1) // st[d] + 1 for d in range(nd)]
    n_block = math.prod(block)
    if x.shape[1] % n_block or x.shape[2] != math.prod(counts) or min(counts) < 1:
        raise ValueError(f"input shape {tuple(x.shape)} doesn't fit blocks {block} over {counts} positions of the "
                         f"padded image {padded}")
    c = x.shape[1] // n_block
    cols = x.reshape(x.shape[0], c, n_block, *counts)
    out: Tensor | None = None
    for i, offset in enumerate(np.ndindex(*block)):
        v = cols[:, :, i]
        for d in range(nd):
            ax = 2 + d
            if st[d] > 1:  # stride: st - 1 zeros after each value
                v = v.unsqueeze(ax + 1).pad([(0, 0)] * (ax + 1) + [(0, st[d] - 1)] + [(0, 0)] * (v.ndim - ax - 1))
                v = v.reshape(*v.shape[:ax], counts[d] * st[d], *v.shape[ax + 2:])
            before = offset[d] * dil[d]
            v = v.pad([(0, 0)] * ax + [(before, padded[d] - before - v.shape[ax])] + [(0, 0)] * (v.ndim - ax - 1))
        out = v if out is None else out + v
    assert out is not None
    return out[(slice(None), slice(None), *(slice(pad[d], pad[d] + image[d]) for d in range(nd)))]


@op("MaxUnpool")
def max_unpool(x: Tensor, indices: Tensor, output_shape: Tensor | None = None, *, kernel_shape: Sequence[int],
               pads: Sequence[int] | None = None, strides: Sequence[int] | None = None) -> Tensor:
    """Zeros with each value of x written at its index: MaxPool's Indices, flat over the whole output (batch and
    channels included) of the shape MaxPool would have pooled x from, grown with zeros to output_shape if given."""
    nd = x.ndim - 2
    st, pad = list(strides or [1] * nd), list(pads or [0] * (2 * nd))
    if nd < 1 or len(kernel_shape) != nd or len(st) != nd or len(pad) != 2 * nd:
        raise ValueError(f"kernel_shape {list(kernel_shape)}, strides {st} and pads {pad} must fit the {nd} spatial "
                         f"dims of an input of shape {tuple(x.shape)}")
    if tuple(indices.shape) != tuple(x.shape):
        raise ValueError(f"the indices must have the input's shape {tuple(x.shape)}, got {tuple(indices.shape)}")
    shape = [*x.shape[:2], *((x.shape[2 + d] - 1) * st[d] - pad[d] - pad[d + nd] + kernel_shape[d] for d in range(nd))]
    flat = Tensor.zeros(math.prod(shape), dtype=x.dtype)
    out = flat.scatter(0, indices.reshape(-1).cast(dtypes.int32), x.reshape(-1)).reshape(*shape)
    if output_shape is None: return out
    # the indices count in the shape MaxPool's output implies; a larger output_shape adds zeros after each dim
    want = ints(output_shape)
    if len(want) != x.ndim or tuple(want[:2]) != tuple(x.shape[:2]) or any(w < s for w, s in zip(want, shape)):
        raise ValueError(f"output_shape {want} must keep the input's batch and channels {tuple(x.shape[:2])} and be "
                         f"at least the unpooled shape {shape}")
    return out.pad([(0, w - s) for w, s in zip(want, shape)])


# *** training optimizers (ai.onnx.preview.training): one step for each of n tensors, inputs and outputs grouped by kind

TRAINING = "ai.onnx.preview.training"


def _groups(xs: tuple[Tensor, ...], kinds: int) -> list[list[Tensor]]:
    """The optimizer's inputs after R and T: `kinds` groups of n tensors each (X..., G..., then the states)."""
    if not xs or len(xs) % kinds: raise ValueError(f"needs {kinds} inputs per optimized tensor after R and T, got "
                                                   f"{len(xs)}")
    n = len(xs) // kinds
    return [list(xs[i * n:(i + 1) * n]) for i in range(kinds)]


@op("Adagrad", domain=TRAINING)
def adagrad(r: Tensor, t: Tensor, *xs: Tensor, decay_factor: float = 0.0, epsilon: float = 0.0,
            norm_coefficient: float = 0.0) -> tuple[Tensor, ...]:
    xs_, gs, hs = _groups(xs, 3)
    rate = r / (1 + t.cast(r.dtype) * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs_, gs, hs):
        g = g + norm_coefficient * x
        h = h + g * g
        new_x.append(x - rate.cast(x.dtype) * g / (h.sqrt() + epsilon))
        new_h.append(h)
    return tuple(new_x + new_h)


@op("Adam", domain=TRAINING)
def adam(r: Tensor, t: Tensor, *xs: Tensor, alpha: float = 0.9, beta: float = 0.999, epsilon: float = 0.0,
         norm_coefficient: float = 0.0, norm_coefficient_post: float = 0.0) -> tuple[Tensor, ...]:
    xs_, gs, vs, hs = _groups(xs, 4)
    tf = t.cast(dtypes.float64 if r.dtype == dtypes.float64 else dtypes.float32)
    # the bias correction from the second step (T counts the steps taken, from 0)
    corrected = r * (1 - const_tensor(beta, tf.dtype).pow(tf)).sqrt() / (1 - const_tensor(alpha, tf.dtype).pow(tf))
    rate = (t > 0).where(corrected, r)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs_, gs, vs, hs):
        g = g + norm_coefficient * x
        v = alpha * v + (1 - alpha) * g
        h = beta * h + (1 - beta) * g * g
        new_x.append((1 - norm_coefficient_post) * (x - rate.cast(x.dtype) * v / (h.sqrt() + epsilon)))
        new_v.append(v)
        new_h.append(h)
    return tuple(new_x + new_v + new_h)


@op("Momentum", domain=TRAINING)
def momentum(r: Tensor, t: Tensor, *xs: Tensor, alpha: float, beta: float, mode: str,
             norm_coefficient: float) -> tuple[Tensor, ...]:
    if mode not in ("standard", "nesterov"): raise ValueError(f"mode must be standard or nesterov, got {mode!r}")
    xs_, gs, vs = _groups(xs, 3)
    # the first step (T = 0) takes the whole gradient
    b = (t > 0).where(beta, 1.0).cast(r.dtype)
    new_x, new_v = [], []
    for x, g, v in zip(xs_, gs, vs):
        g = g + norm_coefficient * x
        v = alpha * v + b.cast(x.dtype) * g
        step = v if mode == "standard" else g + alpha * v
        new_x.append(x - r.cast(x.dtype) * step)
        new_v.append(v)
    return tuple(new_x + new_v)


@op("TensorScatter")
def tensor_scatter(past: Tensor, update: Tensor, write_indices: Tensor | None = None, *, axis: int = -2,
                   mode: str = "linear") -> Tensor:
    """The cache with each batch entry's update written along `axis` from write_indices[b] on (wrapping around the
    cache's length in mode circular). Runs on the device: each cache position reads the update step landing there."""
    if mode not in ("linear", "circular"): raise ValueError(f"mode must be linear or circular, got {mode!r}")
    a = axis_of(axis, past.ndim)
    if a == 0: raise ValueError("axis must not be the batch axis 0")
    if update.ndim != past.ndim or any(u != p for i, (u, p) in enumerate(zip(update.shape, past.shape)) if i != a) \
            or update.shape[a] > past.shape[a]:
        raise ValueError(f"update of shape {tuple(update.shape)} doesn't fit the cache of shape {tuple(past.shape)} "
                         f"along axis {a}")
    n_max, n_upd = past.shape[a], update.shape[a]
    shape = [1] * past.ndim
    shape[0], shape[a] = past.shape[0], n_max
    start = write_indices.cast(dtypes.int32).reshape(-1) if write_indices is not None else \
        Tensor.zeros(past.shape[0], dtype=dtypes.int32)
    pos = Tensor.arange(n_max, dtype=dtypes.int32).reshape(1, -1) - start.reshape(-1, 1)  # (batch, cache positions)
    if mode == "circular": pos = pos % n_max  # (a floor remainder: never negative)
    hit = (pos >= 0) & (pos < n_upd)
    src = hit.where(pos, 0).reshape(shape)
    read = update.gather(a, src.expand(*past.shape))
    return hit.reshape(shape).where(read, past)


@op("CausalConvWithState")
def causal_conv_with_state(x: Tensor, weight: Tensor, bias: Tensor | None = None, past_state: Tensor | None = None,
                           *, activation: str = "none") -> tuple[Tensor, Tensor]:
    """A depthwise causal 1-D convolution over (batch, channels, length) carrying its last kernel - 1 inputs as a
    state between calls; the output optionally through SiLU. Returns the output and the new state."""
    if activation not in ("none", "silu", "swish"):
        raise ValueError(f"activation must be none, silu or swish, got {activation!r}")
    if x.ndim != 3 or weight.ndim != 3 or weight.shape[0] != x.shape[1] or weight.shape[1] != 1:
        raise ValueError(f"the input must be (batch, channels, length) and the weight (channels, 1, k), got shapes "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    b, c, n = x.shape
    k = weight.shape[2]
    if past_state is None: past_state = Tensor.zeros(b, c, k - 1, dtype=x.dtype)
    elif tuple(past_state.shape) != (b, c, k - 1):
        raise ValueError(f"past_state must have shape {(b, c, k - 1)}, got {tuple(past_state.shape)}")
    padded = past_state.cast(x.dtype).cat(x, dim=2) if k > 1 else x
    # half types sum in float32, the convolution rounds to the input's type before the activation
    work = dtypes.float32 if is_float(x) and x.dtype.itemsize < 4 else x.dtype
    pw, ww = padded.cast(work), weight.cast(work)
    out = pw[:, :, 0:n] * ww[:, 0, 0].reshape(1, c, 1)
    for j in range(1, k): out = out + pw[:, :, j:j + n] * ww[:, 0, j].reshape(1, c, 1)
    if bias is not None: out = out + bias.cast(work).reshape(1, c, 1)
    out = out.cast(x.dtype)
    if activation != "none": out = in_float(out.cast(work), lambda v: v * v.sigmoid()).cast(x.dtype)
    return out, padded[:, :, padded.shape[2] - (k - 1):]


@op("LinearAttention")
def linear_attention(query: Tensor, key: Tensor, value: Tensor, past_state: Tensor | None = None,
                     decay: Tensor | None = None, beta: Tensor | None = None, *, chunk_size: int | None = None,
                     kv_num_heads: int, q_num_heads: int, scale: float | None = None,
                     update_rule: str = "gated_delta") -> tuple[Tensor, Tensor]:
    """Recurrent linear attention over (batch, T, heads * dim) inputs: a (d_k, d_v) state per kv head, decayed by
    exp(decay) (gated rules), written with k v^T (delta rules: v less what the state already holds for k, times beta)
    and read by each query head's q. The T steps are unrolled (chunk_size is only a hint for chunked kernels)."""
    rules = ("linear", "gated", "delta", "gated_delta")
    if update_rule not in rules: raise ValueError(f"update_rule must be one of {', '.join(rules)}, got {update_rule!r}")
    if q_num_heads <= 0 or kv_num_heads <= 0 or q_num_heads % kv_num_heads:
        raise ValueError(f"q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads ({kv_num_heads})")
    gated, delta = update_rule in ("gated", "gated_delta"), update_rule in ("delta", "gated_delta")
    if gated != (decay is not None) or delta != (beta is not None):
        raise ValueError(f"update_rule {update_rule!r}: the decay input is {'required' if gated else 'not allowed'} "
                         f"and the beta input {'required' if delta else 'not allowed'}")
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise ValueError("query, key and value must be (batch, T, heads * dim)")
    b, t = query.shape[0], query.shape[1]
    dk, dv = query.shape[2] // q_num_heads, value.shape[2] // kv_num_heads
    f32 = dtypes.float32

    def heads(x: Tensor, h: int) -> Tensor: return x.reshape(b, t, h, -1).permute(0, 2, 1, 3).cast(f32)
    q, k, v = heads(query, q_num_heads), heads(key, kv_num_heads), heads(value, kv_num_heads)
    g = bt = None
    if decay is not None:
        if decay.shape[2] not in (kv_num_heads, kv_num_heads * dk):
            raise ValueError(f"decay's last dim {decay.shape[2]} must be kv_num_heads ({kv_num_heads}) or "
                             f"kv_num_heads * d_k ({kv_num_heads * dk})")
        g = heads(decay, kv_num_heads).exp()  # (b, h, t, 1 or dk)
    if beta is not None:
        if beta.shape[2] not in (kv_num_heads, 1):
            raise ValueError(f"beta's last dim {beta.shape[2]} must be kv_num_heads ({kv_num_heads}) or 1")
        bt = beta.reshape(b, t, beta.shape[2], 1).permute(0, 2, 1, 3).cast(f32)
    if past_state is not None and tuple(past_state.shape) != (b, kv_num_heads, dk, dv):
        raise ValueError(f"past_state must have shape {(b, kv_num_heads, dk, dv)}, got {tuple(past_state.shape)}")
    state = past_state.cast(f32) if past_state is not None else Tensor.zeros(b, kv_num_heads, dk, dv, dtype=f32)
    s = 1.0 / math.sqrt(dk) if not scale else float(scale)
    group = q_num_heads // kv_num_heads
    outs = []
    for i in range(t):
        ki, vi = k[:, :, i], v[:, :, i]
        if g is not None: state = state * g[:, :, i].unsqueeze(-1)
        if bt is not None: vi = bt[:, :, i] * (vi - (state * ki.unsqueeze(-1)).sum(2))
        state = state + ki.unsqueeze(-1) * vi.unsqueeze(-2)
        read = state.unsqueeze(2).expand(b, kv_num_heads, group, dk, dv).reshape(b, q_num_heads, dk, dv)
        outs.append((q[:, :, i].unsqueeze(-1) * read).sum(2) * s)  # (b, hq, dv)
    out = Tensor.stack(*outs, dim=2).permute(0, 2, 1, 3).reshape(b, t, q_num_heads * dv).cast(query.dtype)
    return out, state.cast(past_state.dtype if past_state is not None else query.dtype)


def _call_graph(graph: Any, x: Tensor, ctx: Context, what: str) -> Tensor:
    """A one-input, one-output graph attribute applied to x (it sees the enclosing graph's values too)."""
    if len(graph.input_names) != 1 or len(graph.output_names) != 1:
        raise ValueError(f"{what} must take one input and give one output, it has {len(graph.input_names)} and "
                         f"{len(graph.output_names)}")
    out = graph.run({**dict(ctx.env), graph.input_names[0]: x}, ctx.runner)
    return out[graph.output_names[0]]


@op("FlexAttention", domain="ai.onnx.preview")
def flex_attention(q: Tensor, k: Tensor, v: Tensor, *, ctx: Context, scale: float | None = None,
                   score_mod: Any = None, prob_mod: Any = None, softmax_precision: int | None = None) -> Tensor:
    """softmax(score_mod(q k^T * scale)) then prob_mod, times v, over (batch, heads, seq, dim) inputs; query heads
    may be a multiple of the key/value heads. The softmax runs in softmax_precision (default: float32 for half
    types, else the input's type)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k and v must be (batch, heads, seq, dim), got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    hq, hk = q.shape[1], k.shape[1]
    if v.shape[1] != hk or v.shape[2] != k.shape[2] or k.shape[3] != q.shape[3] or hq % hk:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} don't fit q {tuple(q.shape)}")
    if hq != hk:
        k = k.unsqueeze(2).expand(k.shape[0], hk, hq // hk, *k.shape[2:]).reshape(k.shape[0], hq, *k.shape[2:])
        v = v.unsqueeze(2).expand(v.shape[0], hk, hq // hk, *v.shape[2:]).reshape(v.shape[0], hq, *v.shape[2:])
    s = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    work = onnx_dtype(softmax_precision) if softmax_precision is not None else \
        (dtypes.float32 if q.dtype.itemsize < 4 else q.dtype)
    # the scale split over q and k (its square root on each), as ONNX's reference does, keeps the product in range
    root = const_tensor(math.sqrt(np.float32(s)), q.dtype)
    scores = ((q * root) @ (k * root).transpose(-1, -2)).cast(work)
    if score_mod is not None: scores = _call_graph(score_mod, scores, ctx, "score_mod").cast(work)
    probs = scores.softmax(-1)
    if prob_mod is not None: probs = _call_graph(prob_mod, probs, ctx, "prob_mod").cast(work)
    return (probs @ v.cast(work)).cast(v.dtype)


@op("TfIdfVectorizer")
def tfidf_vectorizer(x: Tensor, *, max_gram_length: int, max_skip_count: int, min_gram_length: int, mode: str,
                     ngram_counts: Sequence[int], ngram_indexes: Sequence[int],
                     pool_int64s: Sequence[int] | None = None, pool_strings: Sequence[str] | None = None,
                     weights: Sequence[float] | None = None) -> Tensor:
    """Counts of the pool's n-grams (lengths min_gram_length..max_gram_length, their tokens max_skip_count or fewer
    apart) in each row of integer tokens, as TF (counts), IDF (the weight where present) or TFIDF (count times
    weight). Runs on the host (a read of x)."""
    if pool_strings is not None or pool_int64s is None: raise Unsupported("string pools (pool_strings)")
    if mode not in ("TF", "IDF", "TFIDF"): raise ValueError(f"mode must be TF, IDF or TFIDF, got {mode!r}")
    if not 1 <= min_gram_length <= max_gram_length or max_skip_count < 0 or len(ngram_counts) < max_gram_length:
        raise ValueError(f"min_gram_length {min_gram_length}, max_gram_length {max_gram_length}, max_skip_count "
                         f"{max_skip_count} and {len(ngram_counts)} ngram_counts don't fit")
    if known_value(x) is None and _realize.capturing:
        raise Unsupported("an input computed on the device under TinyJit (its tokens are counted on the host)")
    pool = list(pool_int64s)
    # the pool's n-grams of length n lie from ngram_counts[n - 1], each n values; each maps to an output column
    column: dict[tuple[int, ...], int] = {}
    bounds = list(ngram_counts) + [len(pool)]
    k = 0
    for n in range(1, len(ngram_counts) + 1):
        for s in range(bounds[n - 1], bounds[n], n):
            column[tuple(pool[s:s + n])] = ngram_indexes[k]
            k += 1
    width = max(ngram_indexes) + 1 if len(ngram_indexes) else 0
    w = np.asarray(weights if weights is not None else [1.0] * len(ngram_indexes), np.float32)
    rows = host_value(x)
    rows2 = rows.reshape(1, -1) if rows.ndim == 1 else rows.reshape(rows.shape[0], -1)
    counts = np.zeros((rows2.shape[0], width), np.float32)
    for r, row in enumerate(rows2.tolist()):
        for n in range(min_gram_length, max_gram_length + 1):
            # a unigram is counted once, not once per skip
            for skip in range(max_skip_count + 1 if n > 1 else 1):
                step = skip + 1
                for start in range(len(row) - (n - 1) * step):
                    col = column.get(tuple(row[start:start + (n - 1) * step + 1:step]))
                    if col is not None: counts[r, col] += 1
    weight_of = np.zeros(width, np.float32)
    weight_of[list(ngram_indexes)] = w
    out = counts if mode == "TF" else (counts > 0) * weight_of if mode == "IDF" else counts * weight_of
    out = out.astype(np.float32).reshape(width) if rows.ndim == 1 else out.astype(np.float32)
    return Tensor(out)
