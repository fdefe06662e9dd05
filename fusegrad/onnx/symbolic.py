"""Symbolic input dims: the shape arithmetic of a model evaluated on the host with bound Variables in it.

A model input's named dim (`dim_param`, e.g. `batch`) is a bound Variable in the input's shape (runner.py), so the
kernels compiled for one value serve every other. Shape then gives the Variable itself, and the small integer ops that
exported models chain after it (Gather, Concat, Unsqueeze, Mul...) are folded here on host arrays whose entries are
ints or symbolic ints (NumPy object arrays), so Reshape, Expand and Slice get symbolic sizes. The device value of such
an array is built from the Variables too (a symbolic int as a Tensor is a loop index), so it stays right when TinyJit
replays with other values. What can't be folded symbolically falls back to the call's concrete values (`concretize`)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import math

import numpy as np

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.ops import HOST_MAX, axis_of, known_value, op, with_host
from fusegrad.onnx.onnx_dtypes import ONNX_DTYPES, np_name, onnx_dtype
from fusegrad.uop.ops import Ops, is_symbolic, ssimplify, sym_value


def has_symbolic(values: Any) -> bool:
    """Whether a shape or a host array holds a symbolic entry."""
    if isinstance(values, np.ndarray): return values.dtype == object and any(is_symbolic(v) for v in values.flat)
    return any(is_symbolic(v) for v in values)


def sym_array(values: Sequence[Any]) -> np.ndarray:
    """An int64 array of the values, or an object array where some are symbolic."""
    vals = [ssimplify(v) for v in values]
    if not has_symbolic(vals): return np.array(vals, dtype=np.int64)
    arr = np.empty(len(vals), dtype=object)
    arr[:] = vals
    return arr


def host_tensor(arr: np.ndarray, dtype: DType) -> Tensor:
    """A tensor of `dtype` holding a host array (symbolic entries as values of their Variables), remembering it."""
    if not has_symbolic(arr): return with_host(Tensor(np.asarray(arr).astype(np_name(dtype))), np.asarray(arr))
    flat = [Tensor(v).cast(dtype) if is_symbolic(v) else Tensor(np.array(int(v), dtype=np_name(dtype)))
            for v in arr.reshape(-1)]
    t = flat[0].reshape(1).cat(*[f.reshape(1) for f in flat[1:]]) if flat else Tensor.empty(0, dtype=dtype)
    return with_host(t.reshape(arr.shape), arr)


def concrete_array(arr: np.ndarray) -> np.ndarray:
    """A host array with each symbolic entry replaced by its value in this call."""
    if not has_symbolic(arr): return arr
    return np.array([sym_value(v) for v in arr.reshape(-1)], dtype=np.int64).reshape(arr.shape)


def concretize(t: Tensor) -> Tensor:
    """The tensor with this call's values for its symbolic dims and host entries: right for this call only."""
    known = known_value(t)
    if known is not None and has_symbolic(known):
        arr = concrete_array(known)
        return with_host(Tensor(arr.astype(np_name(t.dtype))), arr)
    if not has_symbolic(t.shape): return t
    # a bound size's value is inside the dim it sizes, so this shrink reads exactly this call's elements
    out = t.shrink(tuple((0, sym_value(s)) for s in t.shape))
    return with_host(out, known) if known is not None else out


def variables_of(values: Sequence[Any]) -> list[str]:
    """The names of the Variables in symbolic shape entries."""
    names = {u.arg[0] for v in values if is_symbolic(v) for u in v.toposort() if u.op is Ops.DEFINE_VAR}
    return sorted(names)


@op("Shape")
def shape(x: Tensor, *, start: int = 0, end: int | None = None) -> Tensor:
    return host_tensor(sym_array(list(x.shape)[start:end]), dtypes.int64)


@op("Size")
def size(x: Tensor) -> Tensor: return host_tensor(sym_array([math.prod(x.shape)]).reshape(()), dtypes.int64)


# *** the integer ops folded on the host ***

def _trunc_div(a: Any, b: Any) -> Any:
    if is_symbolic(a) or is_symbolic(b):
        # a symbolic size is >= 1: with a positive int divisor floor and truncation agree
        if is_symbolic(b) or b <= 0 or (is_symbolic(a) and a.vmin < 0): raise _NoFold
        return ssimplify(a // b)
    q = abs(int(a)) // abs(int(b))
    return q if (a >= 0) == (b >= 0) else -q


def _sym_equal(a: Any, b: Any) -> bool:
    if not is_symbolic(a) and not is_symbolic(b): return bool(a == b)
    d = ssimplify(a - b)
    if not is_symbolic(d): return d == 0
    if d.vmin > 0 or d.vmax < 0: return False
    raise _NoFold  # equal for some values of the Variables only: this call's value decides


class _NoFold(Exception):
    """This op on these values isn't folded: it runs as usual."""


def _no_fold(a: Any, b: Any) -> Any: raise _NoFold


def _elementwise(fn: Callable[[Any, Any], Any], plain: Callable[[np.ndarray, np.ndarray], np.ndarray]
                 ) -> Callable[..., np.ndarray]:
    def run(a: np.ndarray, b: np.ndarray, **attrs: Any) -> np.ndarray:
        if not has_symbolic(a) and not has_symbolic(b): return plain(a, b, **attrs)
        if attrs: raise _NoFold
        return np.asarray(np.frompyfunc(fn, 2, 1)(a, b), dtype=object)
    return run


def _plain_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.any(b == 0): raise _NoFold  # the op says what is wrong
    q = np.abs(a) // np.abs(b)
    return np.where((a >= 0) == (b >= 0), q, -q).astype(a.dtype)


def _plain_mod(a: np.ndarray, b: np.ndarray, *, fmod: int = 0) -> np.ndarray:
    if np.any(b == 0): raise _NoFold
    return (np.fmod(a, b) if fmod else np.mod(a, b)).astype(a.dtype)


def _axes(args: list[Any], attrs: dict[str, Any], i: int) -> list[int] | None:
    if len(args) > i and args[i] is not None: return [int(v) for v in args[i].reshape(-1)]
    return list(attrs["axes"]) if attrs.get("axes") is not None else None


def _gather(data: np.ndarray, idx: np.ndarray, *, axis: int = 0) -> np.ndarray:
    a = axis_of(axis, data.ndim)
    n = data.shape[a]
    if has_symbolic(idx) or np.any((idx < -n) | (idx >= n)): raise _NoFold  # the op names the bad index
    return np.take(data, np.where(idx < 0, idx + n, idx).astype(np.int64), axis=a)


def _concat(*xs: np.ndarray, axis: int) -> np.ndarray:
    obj = any(x.dtype == object for x in xs)
    return np.concatenate([x.astype(object) if obj else x for x in xs], axis=axis_of(axis, xs[0].ndim))


def _unsqueeze(x: np.ndarray, *rest: Any, **attrs: Any) -> np.ndarray:
    ax = _axes([x, *rest], attrs, 1)
    if ax is None: raise _NoFold
    rank = x.ndim + len(ax)
    shape = list(x.shape)
    for a in sorted(axis_of(a, rank) for a in ax): shape.insert(a, 1)
    return x.reshape(shape)


def _squeeze(x: np.ndarray, *rest: Any, **attrs: Any) -> np.ndarray:
    ax = _axes([x, *rest], attrs, 1)
    return np.squeeze(x) if not ax else np.squeeze(x, axis=tuple(axis_of(a, x.ndim) for a in ax))


def _slice(x: np.ndarray, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray | None = None,
           steps: np.ndarray | None = None) -> np.ndarray:
    if any(v is not None and has_symbolic(v) for v in (starts, ends, axes, steps)): raise _NoFold
    ax = [int(a) for a in axes] if axes is not None else list(range(len(starts)))
    sp = [int(s) for s in steps] if steps is not None else [1] * len(starts)
    idx: list[Any] = [slice(None)] * x.ndim
    for s, e, a, p in zip(starts, ends, ax, sp):
        if p == 0: raise _NoFold
        idx[axis_of(a, x.ndim)] = slice(int(s), int(e), p)
    return x[tuple(idx)]


def _cast(x: np.ndarray, *, to: int, saturate: int = 1, round_mode: str = "up") -> np.ndarray:
    # (to a type without a fusegrad dtype, a narrow one or STRING, the op itself runs)
    if to not in ONNX_DTYPES: raise _NoFold
    dt = onnx_dtype(to)
    if not has_symbolic(x): return x.astype(np_name(dt))
    if dtypes.is_int(dt) and dt.itemsize >= 4: return x  # sizes fit in int32 and int64
    raise _NoFold


def _reshape(x: np.ndarray, shape: np.ndarray, *, allowzero: int = 0) -> np.ndarray:
    if has_symbolic(shape): raise _NoFold
    want = [int(v) for v in shape]
    if not allowzero: want = [x.shape[i] if v == 0 else v for i, v in enumerate(want)]
    return x.reshape(want)


def _where(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    obj = a.dtype == object or b.dtype == object
    return np.where(c, a.astype(object) if obj else a, b.astype(object) if obj else b)


# op type -> (host function, which input's dtype the output has: an index, or None for bool)
FOLDS: dict[str, tuple[Callable[..., np.ndarray], int | None]] = {
    "Gather": (_gather, 0), "Concat": (_concat, 0), "Unsqueeze": (_unsqueeze, 0), "Squeeze": (_squeeze, 0),
    "Slice": (_slice, 0), "Identity": (lambda x: x, 0), "Reshape": (_reshape, 0), "Where": (_where, 1),
    "Add": (_elementwise(lambda a, b: ssimplify(a + b), np.add), 0),
    "Sub": (_elementwise(lambda a, b: ssimplify(a - b), np.subtract), 0),
    "Mul": (_elementwise(lambda a, b: ssimplify(a * b), np.multiply), 0),
    "Div": (_elementwise(_trunc_div, _plain_div), 0), "Mod": (_elementwise(_no_fold, _plain_mod), 0),
    "Equal": (_elementwise(_sym_equal, np.equal), None), "Cast": (_cast, -1),
}


def fold(op_type: str, args: list[Tensor | None], attrs: dict[str, Any]) -> Tensor | None:
    """The op's result computed on the host when all its inputs are small integer arrays known there (the shape
    arithmetic after Shape, symbolic or not), so the ops that need Python ints don't read the device; None where the
    op should run as usual."""
    entry = FOLDS.get(op_type)
    if entry is None or not args or args[0] is None: return None
    hosts: list[np.ndarray | None] = []
    for t in args:
        if t is None: hosts.append(None); continue
        if not (dtypes.is_int(t.dtype) or t.dtype == dtypes.bool): return None
        known = known_value(t)
        if known is None: return None
        hosts.append(known)
    fn, like = entry
    try: out = fn(*hosts, **attrs)
    except _NoFold: return None
    out = np.asarray(out)
    if out.size > HOST_MAX: return None
    if like is None:
        out = out.astype(bool)
        return with_host(Tensor(out), out)
    dt = onnx_dtype(attrs["to"]) if like == -1 else args[like].dtype  # type: ignore[union-attr]
    if out.dtype == object and not has_symbolic(out): out = out.astype(np_name(dt))
    return host_tensor(out, dt)
