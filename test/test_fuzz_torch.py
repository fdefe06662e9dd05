"""A seeded differential fuzzer against PyTorch: random small programs over convolutions, pooling, gather / scatter /
tensor indexing, cumulative ops, where with broadcasting, pad modes, interpolate, half and bfloat16, layernorm /
batchnorm and in-place updates under autograd, glued with elementwise, reduce and movement ops. Each program runs in
fusegrad (float32 inputs) and in torch on the CPU in float64 from the same inputs; the forward outputs and the
gradients of every float input (`loss = sum(out * w)` with random weights w) are compared.

A program is Python source over fusegrad's (tinygrad's) Tensor API. The torch side evaluates the same text with `TT`,
a stand-in that maps each method to torch, tags every value with the dtype fusegrad computes it in, and rejects lines
whose result is ill-conditioned (comparisons, maxima and kinks of values closer than the tolerance, where the two
frameworks could pick different sides). The tolerance of every compared value follows the unit roundoff of the least
precise dtype the value went through and the magnitudes of the program's values.

Replay a failure with `python -m test.test_fuzz_torch SEED`; `python -m test.test_fuzz_torch A-B` surveys seeds A..B-1
and prints the failing ones."""
from __future__ import annotations
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Tensor, dtypes

REF = {"dtype": torch.float64}   # the dtype the torch side computes float values in
# unit roundoff of each dtype fusegrad computes in; a value's error bound is K_TOL roundoffs of the program's magnitude
UNIT = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
K_TOL = 16
FLOATS = tuple(UNIT)
MAX_NUMEL, MAX_DIM, MAX_RANK = 2048, 32, 5
VALUE_LIMIT = 64.0           # larger intermediate values are rejected: they would only widen the tolerance
HALF_LIMIT = 8.0             # half and bfloat16 are entered only from small values
CONSTS = (0.5, 1.5, 2.0, -1.0, -0.25)

class Reject(Exception):
    """The generator must not use this line: its result would be ill-conditioned or invalid."""

# ---------------------------------------------------------------------------------------------------------------------
# inputs

def input_array(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2.0, 2.0, size=shape).astype(np.float32)

def index_array(shape: tuple[int, ...], hi: int, seed: int, lo: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi, size=shape).astype(np.int32)

def unique_index_array(shape: tuple[int, ...], dim: int, hi: int, seed: int) -> np.ndarray:
    """Indices in [0, hi) that never repeat along `dim` (shape[dim] <= hi): a scatter of them has one writer per
    element, so its result does not depend on the order of the writes."""
    keys = np.random.default_rng(seed).random(shape[:dim] + (hi,) + shape[dim + 1:])
    return np.argsort(keys, axis=dim).take(range(shape[dim]), axis=dim).astype(np.int32)

# ---------------------------------------------------------------------------------------------------------------------
# the torch reference

def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None: return tuple(range(ndim))
    return tuple(a % ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))

class TT:
    """A fusegrad Tensor stand-in over a torch tensor: float values are held in float64; `dt` is the dtype fusegrad
    computes the value in and `unit` the largest unit roundoff of the dtypes that went into it."""
    def __init__(self, t: torch.Tensor, dt: str, unit: float = 0.0, check: bool = True):
        self.t, self.dt, self.spread = t, dt, 0.0
        self.normalized = False   # computed from a layernorm / batchnorm
        self.unit = max(unit, UNIT.get(dt, 0.0))
        if dt in FLOATS and check:
            if not bool(torch.isfinite(self.v).all()): raise Reject("not finite")
            if self.v.numel() and float(self.v.abs().max()) > VALUE_LIMIT: raise Reject("too large")

    @property
    def v(self) -> torch.Tensor: return self.t.detach()   # for checks: no graph, no warnings
    @property
    def shape(self) -> tuple[int, ...]: return tuple(self.t.shape)
    @property
    def ndim(self) -> int: return self.t.ndim
    @property
    def is_float(self) -> bool: return self.dt in FLOATS
    def tol(self) -> torch.Tensor:
        """Allowed |fusegrad - reference| per element."""
        if not self.is_float or self.v.numel() == 0: return torch.zeros_like(self.v)
        return K_TOL * self.unit * (self.v.abs() + max(float(self.v.abs().max()), 1.0))

    def _new(self, t: torch.Tensor, *others: Any, dt: str | None = None) -> TT:
        srcs = [self] + [o for o in others if isinstance(o, TT)]
        if dt is None: dt = next((s.dt for s in srcs if s.is_float), self.dt)
        out = TT(t, dt, max(s.unit for s in srcs))
        out.normalized = any(s.normalized for s in srcs)
        return out
    def _normalized(self, *others: Any) -> None:
        """Normalizing a normalized value makes the first one's scale and shift nearly vanish from the result: their
        gradients cancel down to what eps leaves, far below the magnitude of the terms that cancel."""
        if any(o.normalized for o in (self,) + others if isinstance(o, TT)): raise Reject("normalization of a norm")
    @staticmethod
    def _t(y: Any) -> Any: return y.t if isinstance(y, TT) else y
    def _near(self, c: Any, what: str) -> None:
        """Reject when a value is within the tolerance of a point where the result jumps (but not exactly on it)."""
        if not self.is_float: return
        d = (self.v - (c.v if isinstance(c, TT) else c)).abs()
        if bool(((d > 0) & (d <= 4 * self.tol())).any()): raise Reject(f"{what} near a tie")

    # elementwise
    def __add__(self, y: Any) -> TT: return self._new(self.t + self._t(y), y)
    def __radd__(self, y: Any) -> TT: return self._new(self._t(y) + self.t, y)
    def __sub__(self, y: Any) -> TT: return self._new(self.t - self._t(y), y)
    def __rsub__(self, y: Any) -> TT: return self._new(self._t(y) - self.t, y)
    def __mul__(self, y: Any) -> TT: return self._new(self.t * self._t(y), y)
    def __rmul__(self, y: Any) -> TT: return self._new(self._t(y) * self.t, y)
    def __truediv__(self, y: Any) -> TT:
        d = self._t(y)
        if float(torch.as_tensor(d).detach().abs().min()) < 0.25: raise Reject("division by a small number")
        return self._new(self.t / d, y)
    def __neg__(self) -> TT: return self._new(-self.t)
    def __matmul__(self, y: TT) -> TT: return self._new(self.t @ y.t, y)
    def add(self, y: Any) -> TT: return self + y
    def maximum(self, y: Any) -> TT:
        self._near(y, "maximum")
        return self._new(torch.maximum(self.t, torch.as_tensor(self._t(y), dtype=self.t.dtype)), y)
    def minimum(self, y: Any) -> TT:
        self._near(y, "minimum")
        return self._new(torch.minimum(self.t, torch.as_tensor(self._t(y), dtype=self.t.dtype)), y)
    def _cmp(self, y: Any, fn: Callable) -> TT:
        self._near(y, "comparison")
        if isinstance(y, TT): y._near(self, "comparison")
        return TT(fn(self.t, self._t(y)), "bool")
    def __lt__(self, y: Any) -> TT: return self._cmp(y, torch.lt)
    def __gt__(self, y: Any) -> TT: return self._cmp(y, torch.gt)
    def where(self, x: Any, y: Any) -> TT:
        src = x if isinstance(x, TT) else y
        xt, yt = (torch.as_tensor(self._t(v), dtype=src.t.dtype) for v in (x, y))
        return src._new(torch.where(self.t, xt, yt), x, y)
    def masked_fill(self, mask: TT, value: float) -> TT:
        # fusegrad's masked_fill keeps self's shape (the mask broadcasts to it, not both to a common shape)
        if torch.broadcast_shapes(self.shape, mask.shape) != self.shape: raise ValueError("mask broadcasts self")
        return self._new(self.t.masked_fill(mask.t, value))
    def relu(self) -> TT:
        self._near(0, "relu")
        return self._new(torch.relu(self.t))
    def abs(self) -> TT:
        self._near(0, "abs")
        return self._new(self.t.abs())
    def clip(self, lo: float, hi: float) -> TT:
        self._near(lo, "clip"); self._near(hi, "clip")
        return self._new(self.t.clip(lo, hi))
    def square(self) -> TT: return self._new(self.t * self.t)
    def exp(self) -> TT: return self._new(self.t.exp())
    def log(self) -> TT:
        if float(self.v.min()) < 0.5: raise Reject("log of a small number")
        return self._new(self.t.log())
    def sqrt(self) -> TT:
        if float(self.v.min()) < 0.25: raise Reject("sqrt near 0")
        return self._new(self.t.sqrt())
    def rsqrt(self) -> TT:
        if float(self.v.min()) < 1e-6: raise Reject("rsqrt near 0")
        return self._new(self.t.rsqrt())
    def sin(self) -> TT: return self._new(self.t.sin())
    def sigmoid(self) -> TT: return self._new(self.t.sigmoid())
    def tanh(self) -> TT: return self._new(self.t.tanh())
    def silu(self) -> TT: return self._new(F.silu(self.t))
    def gelu(self) -> TT: return self._new(F.gelu(self.t, approximate="tanh"))
    def elu(self, alpha: float = 1.0) -> TT:
        self._near(0, "elu")
        return self._new(F.elu(self.t, alpha))
    def leaky_relu(self, neg_slope: float = 0.01) -> TT:
        self._near(0, "leaky_relu")
        return self._new(F.leaky_relu(self.t, neg_slope))
    def softmax(self, axis: int = -1) -> TT: return self._new(self.t.softmax(axis))
    def log_softmax(self, axis: int = -1) -> TT: return self._new(self.t.log_softmax(axis))

    # dtypes: a cast to a narrower float rounds the value as fusegrad does
    def _to(self, dt: str) -> TT:
        if dt in FLOATS:
            if dt != "float32" and float(self.v.abs().max()) > HALF_LIMIT: raise Reject("half of a large value")
            tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dt]
            t = self.t.to(tdt).to(REF["dtype"]) if self.is_float else self.t.to(REF["dtype"])
            out = TT(t, dt, self.unit)
            out.normalized = self.normalized
            return out
        if self.is_float: raise Reject("float -> int casts round: not fuzzed")
        return TT(self.t.to(torch.bool if dt == "bool" else torch.int64), dt)
    def float(self) -> TT: return self._to("float32")
    def half(self) -> TT: return self._to("float16")
    def bfloat16(self) -> TT: return self._to("bfloat16")
    def cast(self, dt: str) -> TT: return self._to(dt)

    # reductions
    def _ties(self, axis: Any) -> None:
        """max/min pass their gradient to the maximum: reject near-ties (equal values split it evenly in both)."""
        if not self.is_float: return
        ax = _axes(axis, self.ndim)
        keep = [a for a in range(self.ndim) if a not in ax]
        x = self.v.permute(keep + list(ax)).reshape(*[self.shape[a] for a in keep], -1)
        if x.shape[-1] < 2: return
        top = x.sort(-1, descending=True).values
        gap = top[..., :1] - top[..., 1:]
        if bool(((gap > 0) & (gap <= 4 * self.tol().max())).any()): raise Reject("max of near-ties")
    def _spread(self, axis: Any, correction: int = 0) -> None:
        """A variance is computed with cancellation: reject groups whose variance is small next to their mean square
        (the rounding error of float32 / half grows by that ratio, as does a normalization's condition number; a group
        of one is all cancellation: x - mean(x) is 0 only if both sides of it round alike)."""
        ax = _axes(axis, self.ndim)
        if int(np.prod([self.shape[a] for a in ax])) <= correction: raise Reject("no degrees of freedom")
        v = self.v
        if bool((v.var(ax, correction=0) * 16 < (v * v).mean(ax)).any()): raise Reject("variance of near-equal values")
    def sum(self, axis: Any = None, keepdim: bool = False) -> TT:
        return self._new(self.t.sum(_axes(axis, self.ndim), keepdim=keepdim))
    def mean(self, axis: Any = None, keepdim: bool = False) -> TT:
        return self._new(self.t.mean(_axes(axis, self.ndim), keepdim=keepdim))
    def max(self, axis: Any = None, keepdim: bool = False) -> TT:
        self._ties(axis)
        return self._new(self.t.amax(_axes(axis, self.ndim), keepdim=keepdim))
    def min(self, axis: Any = None, keepdim: bool = False) -> TT:
        (-self)._ties(axis)
        return self._new(self.t.amin(_axes(axis, self.ndim), keepdim=keepdim))
    def var(self, axis: Any = None, keepdim: bool = False, correction: int = 1) -> TT:
        self._spread(axis, correction)
        return self._new(self.t.var(_axes(axis, self.ndim), keepdim=keepdim, correction=correction))
    def std(self, axis: Any = None, keepdim: bool = False, correction: int = 1) -> TT:
        self._spread(axis, correction)
        var = self.t.var(_axes(axis, self.ndim), keepdim=keepdim, correction=correction)
        if float(var.detach().min()) < 1e-3: raise Reject("std near 0")
        return self._new(var.sqrt())
    def cumsum(self, axis: int = 0) -> TT: return self._new(self.t.cumsum(axis))
    def cumprod(self, axis: int) -> TT: return self._new(self.t.cumprod(axis))

    # movement
    def reshape(self, *shape: Any) -> TT:
        return self._new(self.t.reshape(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape))
    def permute(self, *order: Any) -> TT:
        return self._new(self.t.permute(order[0] if len(order) == 1 and isinstance(order[0], tuple) else order))
    def transpose(self, d0: int, d1: int) -> TT: return self._new(self.t.transpose(d0, d1))
    def expand(self, *shape: Any) -> TT:
        return self._new(self.t.expand(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape))
    def flip(self, axis: Any) -> TT: return self._new(self.t.flip(_axes(axis, self.ndim)))
    def shrink(self, arg: Any) -> TT:
        return self._new(self.t[tuple(slice(None) if a is None else slice(*a) for a in arg)])
    def repeat(self, *reps: int) -> TT: return self._new(self.t.repeat(*reps))
    def roll(self, shifts: Any, dims: Any = None) -> TT: return self._new(self.t.roll(shifts, dims))
    def cat(self, *others: TT, dim: int = 0) -> TT:
        return self._new(torch.cat([self.t] + [o.t for o in others], dim), *others)
    def pad(self, padding: Any, mode: str = "constant", value: float = 0.0) -> TT:
        if all(isinstance(p, int) for p in padding):   # torch's flat form: the last dim first
            pairs = [(padding[i], padding[i + 1]) for i in range(0, len(padding), 2)][::-1]
            pairs = [(0, 0)] * (self.ndim - len(pairs)) + pairs
        else: pairs = [(0, 0) if p is None else tuple(p) for p in padding]
        if mode == "constant":
            flat = [v for p in pairs[::-1] for v in p]
            return self._new(F.pad(self.t, flat, value=value))
        # reflect / replicate / circular as one gather per dim: numpy's reflect, edge and wrap, which are torch's
        # modes over any number of dims
        x = self.t
        for d, (b, e) in enumerate(pairs):
            n = x.shape[d]
            if mode == "reflect" and (b >= n or e >= n): raise ValueError("reflect padding must be below the size")
            if mode == "circular" and (b > n or e > n): raise ValueError("circular padding must be at most the size")
            i = torch.arange(-b, n + e)
            if mode == "reflect": i = (n - 1) - ((n - 1) - i.abs()).abs() if n > 1 else i * 0
            elif mode == "replicate": i = i.clamp(0, n - 1)
            else: i = i % n
            x = x.index_select(d, i)
        return self._new(x)
    def __getitem__(self, idx: Any) -> TT:
        idx = idx if isinstance(idx, tuple) else (idx,)
        return self._new(self.t[tuple(i.t if isinstance(i, TT) else i for i in idx)],
                         *[i for i in idx if isinstance(i, TT) and i.is_float])

    # the op families
    def conv2d(self, weight: TT, bias: TT | None = None, groups: int = 1, stride: Any = 1, dilation: Any = 1,
               padding: Any = 0) -> TT:
        bt = None if bias is None else bias.t
        return self._new(F.conv2d(self.t, weight.t, bt, stride, padding, dilation, groups), weight, bias)
    def conv_transpose2d(self, weight: TT, bias: TT | None = None, groups: int = 1, stride: Any = 1,
                         dilation: Any = 1, padding: Any = 0, output_padding: Any = 0) -> TT:
        return self._new(F.conv_transpose2d(self.t, weight.t, None if bias is None else bias.t, stride, padding,
                                            output_padding, groups, dilation), weight, bias)
    def max_pool2d(self, kernel_size: tuple[int, int] = (2, 2), stride: Any = None, dilation: Any = 1,
                   padding: Any = 0, ceil_mode: bool = False) -> TT:
        out = F.max_pool2d(self.t, kernel_size, stride, padding, dilation, ceil_mode)
        # the windows, padded with -inf, must not hold near-ties (exact ties: both pass the gradient to the first)
        k, s, d, p = (v if isinstance(v, tuple) else (v, v) for v in
                      (kernel_size, kernel_size if stride is None else stride, dilation, padding))
        oh, ow = out.shape[-2:]
        need = [(o - 1) * st + (kk - 1) * dd + 1 for o, st, kk, dd in zip((oh, ow), s, k, d)]
        right, bottom = (max(0, n - size - pp) for n, size, pp in zip(need, self.shape[-2:], p))
        x = F.pad(self.t.detach(), (p[1], bottom, p[0], right), value=-float("inf"))
        win = x.unfold(-2, (k[0] - 1) * d[0] + 1, s[0]).unfold(-2, (k[1] - 1) * d[1] + 1, s[1])
        win = win[..., :oh, :ow, ::d[0], ::d[1]].reshape(*out.shape, -1)
        if win.shape[-1] > 1:
            top = win.sort(-1, descending=True).values
            gap = top[..., 0] - top[..., 1]
            if bool(((gap > 0) & (gap <= 4 * self.tol().max())).any()): raise Reject("max_pool2d of near-ties")
        return self._new(out)
    def avg_pool2d(self, kernel_size: tuple[int, int] = (2, 2), stride: Any = None, dilation: Any = 1,
                   padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True) -> TT:
        if dilation != 1: raise ValueError("torch's avg_pool2d has no dilation")
        return self._new(F.avg_pool2d(self.t, kernel_size, stride, padding, ceil_mode, count_include_pad))
    def gather(self, dim: int, index: TT) -> TT: return self._new(self.t.gather(dim, index.t))
    def scatter(self, dim: int, index: TT, src: Any, reduce: str | None = None) -> TT:
        s = src.t if isinstance(src, TT) else src
        if reduce is None: return self._new(self.t.scatter(dim, index.t, s), src)
        return self._new(self.t.scatter(dim, index.t, s, reduce=reduce), src)
    def scatter_reduce(self, dim: int, index: TT, src: TT, reduce: str, include_self: bool = True) -> TT:
        if reduce in ("amax", "amin"):   # the gradient goes to the extreme: no near-ties among its candidates
            cand = torch.cat([self.v.flatten(), src.v.flatten()]).sort().values
            gap = cand[1:] - cand[:-1]
            if bool(((gap > 0) & (gap <= 4 * max(self.tol().max(), src.tol().max()))).any()):
                raise Reject("scatter_reduce of near-ties")
        return self._new(self.t.scatter_reduce(dim, index.t, src.t, reduce, include_self=include_self), src)
    def interpolate(self, size: tuple[int, ...], mode: str = "linear", align_corners: bool = False) -> TT:
        lead = self.shape[:self.ndim - len(size)]
        x = self.t.reshape(int(np.prod(lead)), 1, *self.shape[self.ndim - len(size):])
        if mode == "linear":
            m = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(size)]
            y = F.interpolate(x, size=size, mode=m, align_corners=align_corners)
        else: y = _select_like(x, size, mode)
        return self._new(y.reshape(*lead, *size))
    def layernorm(self, axis: Any = -1, eps: float = 1e-5) -> TT:
        self._normalized()
        self._spread(axis)
        ax = _axes(axis, self.ndim)
        keep = [a for a in range(self.ndim) if a not in ax]
        x = self.t.permute(keep + list(ax))
        y = F.layer_norm(x, x.shape[len(keep):], eps=eps)
        out = self._new(y.permute(list(np.argsort(keep + list(ax)))))
        out.normalized = True
        return out
    def batchnorm(self, weight: TT | None, bias: TT | None, mean: TT, invstd: TT, axis: Any = 1) -> TT:
        self._normalized(weight, bias, mean, invstd)
        ax = _axes(axis, self.ndim)
        shp = [s if i in ax else 1 for i, s in enumerate(self.shape)]
        y = (self.t - mean.t.reshape(shp)) * invstd.t.reshape(shp)
        if weight is not None: y = y * weight.t.reshape(shp)
        if bias is not None: y = y + bias.t.reshape(shp)
        out = self._new(y, weight, bias, mean, invstd)
        out.normalized = True
        return out

def _select_like(x: torch.Tensor, size: tuple[int, ...], mode: str) -> torch.Tensor:
    """Nearest-mode interpolate of float64 `x` that picks the elements torch's float32 index arithmetic picks."""
    n = int(np.prod(x.shape[2:]))
    ids = torch.arange(n, dtype=torch.float32).reshape(1, 1, *x.shape[2:])
    pick = F.interpolate(ids, size=size, mode=mode).to(torch.int64).flatten()
    return x.flatten(2)[:, :, pick].reshape(*x.shape[:2], *size)

class TorchTensor:
    """The `Tensor` name in reference programs."""
    @staticmethod
    def stack(*xs: TT, dim: int = 0) -> TT: return xs[0]._new(torch.stack([x.t for x in xs], dim), *xs[1:])

def _fg_input(shape: tuple[int, ...], seed: int) -> Tensor: return Tensor(input_array(shape, seed), requires_grad=True)
def _tt_input(shape: tuple[int, ...], seed: int) -> TT:
    return TT(torch.tensor(input_array(shape, seed), dtype=REF["dtype"], requires_grad=True), "float32")
def _tt_index(a: np.ndarray) -> TT: return TT(torch.tensor(a, dtype=torch.int64), "int32")

def fg_setitem(t: Tensor, idx: Any, v: Any) -> Tensor:
    """An in-place write into a fresh copy of t under autograd: the copy's other elements keep their gradient path."""
    y = t * 1.0
    y[idx] = v
    return y

def tt_setitem(t: TT, idx: Any, v: Any) -> TT:
    y = t.t * 1.0
    y[tuple(i.t if isinstance(i, TT) else i for i in idx)] = v.t if isinstance(v, TT) else v
    return t._new(y, v)

FG_ENV: dict[str, Any] = {"Tensor": Tensor, "make_input": _fg_input, "setitem": fg_setitem,
                          "make_index": lambda s, hi, seed, lo=0: Tensor(index_array(s, hi, seed, lo)),
                          "unique_index": lambda s, d, hi, seed: Tensor(unique_index_array(s, d, hi, seed))}
TT_ENV: dict[str, Any] = {"Tensor": TorchTensor, "make_input": _tt_input, "setitem": tt_setitem,
                          "make_index": lambda s, hi, seed, lo=0: _tt_index(index_array(s, hi, seed, lo)),
                          "unique_index": lambda s, d, hi, seed: _tt_index(unique_index_array(s, d, hi, seed))}

# ---------------------------------------------------------------------------------------------------------------------
# programs

@dataclass
class Program:
    seed: int
    lines: list[tuple[str, str]] = field(default_factory=list)   # (variable, expression)
    outputs: list[str] = field(default_factory=list)

    def source(self) -> str:
        body = "\n".join(f"{v} = {e}" for v, e in self.lines)
        return f"# fuzz program seed={self.seed}\n{body}\n# outputs: {', '.join(self.outputs)}"

class Generator:
    """Builds a random program line by line, evaluating every candidate line on the torch reference first."""
    def __init__(self, seed: int):
        self.rs, self.prog = random.Random(seed), Program(seed)
        self.env: dict[str, TT] = {}
        self.pool: list[str] = []
        self.inputs: set[str] = set()
        self.pending: list[tuple[str, str]] = []
        self.n_vars = 0

    def _name(self, prefix: str) -> str:
        self.n_vars += 1
        return f"{prefix}{self.n_vars}"
    def _pending(self, prefix: str, expr: str) -> str:
        name = self._name(prefix)
        self.pending.append((name, expr))
        return name
    def new_input(self, shape: tuple[int, ...]) -> str:
        return self._pending("x", f"make_input({tuple(shape)}, {self.rs.randrange(10000)})")
    def new_index(self, shape: tuple[int, ...], hi: int, lo: int = 0) -> str:
        lo_arg = f", {lo}" if lo else ""
        return self._pending("i", f"make_index({tuple(shape)}, {hi}, {self.rs.randrange(10000)}{lo_arg})")
    def pick(self, pred: Callable[[TT], bool] | None = None, floats: bool = True) -> str | None:
        cands = [n for n in self.pool if (not floats or self.env[n].is_float) and (pred is None or pred(self.env[n]))]
        if not cands: return None
        recent = [n for n in cands if n in self.pool[-2:]]
        return self.rs.choice(recent) if recent and self.rs.random() < 0.7 else self.rs.choice(cands)
    def random_shape(self, rank: int | None = None) -> tuple[int, ...]:
        rank = self.rs.choice([1, 2, 2, 3, 3, 4]) if rank is None else rank
        hi = 9 if rank <= 2 else 6 if rank == 3 else 5
        return tuple(self.rs.randint(1, hi) for _ in range(rank))

    def try_line(self, expr: str | None) -> bool:
        if expr is None:
            self.pending = []
            return False
        env = {**TT_ENV, **self.env}
        try:
            for name, e in self.pending: env[name] = eval(e, env)
            r = eval(expr, env)
            if not isinstance(r, TT): raise Reject("not a tensor")
            if r.ndim > MAX_RANK or r.t.numel() > MAX_NUMEL or r.t.numel() == 0 or any(s > MAX_DIM for s in r.shape):
                raise Reject("shape out of range")
        except (Reject, ValueError, IndexError, RuntimeError, TypeError):   # torch's errors: an invalid line
            self.pending = []
            return False
        for name, e in self.pending:
            self.prog.lines.append((name, e)); self.env[name] = env[name]
            if name.startswith("x"): self.pool.append(name); self.inputs.add(name)
        self.pending = []
        out = self._name("v")
        self.prog.lines.append((out, expr)); self.env[out] = r; self.pool.append(out)
        return True

    # *** glue ***
    def unary(self) -> str | None:
        a = self.pick()
        if a is None: return None
        ops = ["-{a}", "{a}.relu()", "{a}.abs()", "{a}.clip(-2, 2).exp()", "({a}.abs() + 1).log()", "{a}.sigmoid()",
               "{a}.tanh()", "{a}.square()", "{a} * {c}", "{a} + {c}", "{a}.clip(-1, 1.5)", "{a}.sin()",
               "{a}.gelu()", "{a}.silu()", "{a}.elu()", "{a}.leaky_relu(0.1)", "({a}.square() + 1).rsqrt()"]
        return self.rs.choice(ops).format(a=a, c=self.rs.choice(CONSTS))

    def _partner(self, a: str) -> str:
        """A float value whose shape broadcasts with a's: an existing one or a new input."""
        sa = self.env[a].shape
        def fits(r: TT) -> bool:
            try: return int(np.prod(np.broadcast_shapes(sa, r.shape))) <= MAX_NUMEL
            except ValueError: return False
        if self.rs.random() < 0.5 and (b := self.pick(fits)) is not None: return b
        shp = [1 if self.rs.random() < 0.3 else s for s in sa]
        if shp and self.rs.random() < 0.3: shp = shp[self.rs.randint(1, len(shp)):]
        return self.new_input(tuple(shp))

    def binary(self) -> str | None:
        a = self.pick()
        if a is None: return None
        b = self._partner(a)
        if self.rs.random() < 0.5: a, b = b, a
        ops = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / ({b}.abs() + 1)", "{a}.maximum({b})", "{a}.minimum({b})"]
        return self.rs.choice(ops).format(a=a, b=b)

    def reduce(self) -> str | None:
        a = self.pick(lambda r: r.ndim > 0)
        if a is None: return None
        r = self.env[a]
        op = self.rs.choice(["sum", "sum", "max", "min", "mean", "var", "std", "softmax", "log_softmax"])
        ax = self.rs.randrange(r.ndim) - (r.ndim if self.rs.random() < 0.3 else 0)
        if op in ("softmax", "log_softmax"): return f"{a}.{op}({ax})"
        axes: Any = ax
        if self.rs.random() < 0.3 and r.ndim > 1: axes = tuple(sorted(self.rs.sample(range(r.ndim), 2)))
        kd = ", keepdim=True" if self.rs.random() < 0.4 else ""
        corr = f", correction={self.rs.choice([0, 1])}" if op in ("var", "std") else ""
        return f"{a}.{op}(axis={axes}{kd}{corr})"

    def movement(self) -> str | None:
        a = self.pick()
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        kind = rs.choice(["reshape", "permute", "expand", "flip", "shrink", "getitem", "repeat", "roll", "cat",
                          "stack"])
        if kind == "reshape" and s:
            n = int(np.prod(s))
            if len(s) >= 2 and rs.random() < 0.5:
                i = rs.randrange(len(s) - 1)
                return f"{a}.reshape({s[:i] + (s[i] * s[i + 1],) + s[i + 2:]})"
            divs = [d for d in range(2, n) if n % d == 0]
            return f"{a}.reshape({(rs.choice(divs), -1) if divs else (1, n)})"
        if kind == "permute" and len(s) >= 2:
            order = list(range(len(s))); rs.shuffle(order)
            return f"{a}.permute({tuple(order)})"
        if kind == "expand":
            i = rs.randint(0, len(s))
            new = s[:i] + (1,) + s[i:]
            return f"{a}.reshape({new}).expand({new[:i] + (rs.randint(2, 4),) + new[i + 1:]})"
        if kind == "flip" and s: return f"{a}.flip({rs.randrange(len(s))})"
        if kind == "shrink" and s:
            arg = []
            for d in s:
                b = rs.randint(0, d - 1)
                arg.append((b, rs.randint(b + 1, d)))
            return f"{a}.shrink({tuple(arg)})"
        if kind == "getitem" and s:
            parts = []
            for d in s:
                k = rs.random()
                if k < 0.4: parts.append(":")
                elif k < 0.55: parts.append(str(rs.randint(-d, d - 1)))
                else: parts.append(f"{rs.randint(0, d - 1)}::{rs.choice([1, 2, 3])}")
            return f"{a}[{', '.join(parts)}]"
        if kind == "repeat" and s: return f"{a}.repeat({tuple(rs.randint(1, 3) for _ in s)})"
        if kind == "roll" and s:
            d = rs.randrange(len(s))
            return f"{a}.roll({rs.randint(-s[d], s[d])}, {d})"
        if kind == "cat" and s:
            d = rs.randrange(len(s))
            b = self.new_input(s[:d] + (rs.randint(1, 3),) + s[d + 1:])
            return f"{a}.cat({b}, dim={d})"
        if kind == "stack":
            b = self.pick(lambda r: r.shape == s) or self.new_input(s)
            return f"Tensor.stack({a}, {b}, dim={rs.randint(0, len(s))})"
        return None

    def matmul(self) -> str | None:
        a = self.pick(lambda r: 1 <= r.ndim <= 3)
        if a is None: return None
        k = self.env[a].shape[-1]
        return f"{a} @ {self.new_input((k, self.rs.randint(1, 6)))}"

    # *** the op families ***
    def _image(self, min_hw: int = 1) -> str:
        """A 4-d (N, C, H, W) float value: an existing one, a reshape of one, or a new input."""
        a = self.pick(lambda r: r.ndim == 4 and min(r.shape[2:]) >= min_hw)
        if a is not None and self.rs.random() < 0.7: return a
        b = self.pick(lambda r: r.ndim == 3 and min(r.shape[1:]) >= min_hw)
        if b is not None and self.rs.random() < 0.5: return f"{b}.reshape((1,) + {self.env[b].shape})"
        rs = self.rs
        return self.new_input((rs.randint(1, 2), rs.randint(1, 4), rs.randint(max(min_hw, 3), 9),
                               rs.randint(max(min_hw, 3), 9)))

    def _pair(self, lo: int, hi: int) -> Any:
        return self.rs.randint(lo, hi) if self.rs.random() < 0.5 else (self.rs.randint(lo, hi), self.rs.randint(lo, hi))

    def conv(self) -> str | None:
        x = self._image()
        env = {**TT_ENV, **self.env}
        for n, e in self.pending: env[n] = eval(e, env)
        cin = eval(x, env).shape[1]
        rs = self.rs
        groups = rs.choice([g for g in (1, 2, 3, 4) if cin % g == 0])
        cout = groups * rs.randint(1, 3)
        k = (rs.randint(1, 3), rs.randint(1, 3))
        stride, dilation, padding = self._pair(1, 2), self._pair(1, 2), self._pair(0, 2)
        b = f", {self.new_input((cout,))}" if rs.random() < 0.5 else ""
        if rs.random() < 0.6:
            w = self.new_input((cout, cin // groups) + k)
            return f"{x}.conv2d({w}{b}, groups={groups}, stride={stride}, dilation={dilation}, padding={padding})"
        w = self.new_input((cin, cout // groups) + k)
        st = stride if isinstance(stride, tuple) else (stride, stride)
        dl = dilation if isinstance(dilation, tuple) else (dilation, dilation)
        op = tuple(rs.randint(0, max(s, d) - 1) for s, d in zip(st, dl))
        return f"{x}.conv_transpose2d({w}{b}, groups={groups}, stride={stride}, dilation={dilation}, " \
               f"padding={padding}, output_padding={op})"

    def pooling(self) -> str | None:
        x, rs = self._image(2), self.rs
        k = (rs.randint(1, 3), rs.randint(1, 3))
        stride = rs.choice([None, self._pair(1, 3)])
        padding = (rs.randint(0, k[0] // 2), rs.randint(0, k[1] // 2)) if rs.random() < 0.6 else 0
        ceil = rs.random() < 0.4
        if rs.random() < 0.5:
            dil = self._pair(1, 2)
            return f"{x}.max_pool2d({k}, stride={stride}, dilation={dil}, padding={padding}, ceil_mode={ceil})"
        return f"{x}.avg_pool2d({k}, stride={stride}, padding={padding}, ceil_mode={ceil}, " \
               f"count_include_pad={rs.random() < 0.5})"

    def index(self) -> str | None:
        a = self.pick(lambda r: r.ndim > 0)
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        d = rs.randrange(len(s))
        kind = rs.randint(0, 4)
        if kind == 0:   # gather: an index no larger than the input in the other dims
            shp = tuple(rs.randint(1, n) if i != d else rs.randint(1, 6) for i, n in enumerate(s))
            return f"{a}.gather({d}, {self.new_index(shp, s[d])})"
        if kind == 1:   # tensor index in one dim, the others sliced or indexed too
            ishape = self.random_shape(rs.randint(1, 2))
            parts = [":"] * d + [self.new_index(ishape, s[d], -s[d] if rs.random() < 0.3 else 0)]
            if rs.random() < 0.4 and d + 1 < len(s): parts.append(self.new_index(ishape, s[d + 1]))
            return f"{a}[{', '.join(parts)}]"
        if kind == 2:   # scatter of unique indices (one writer per element), a tensor or a constant source
            shp = tuple(rs.randint(1, n) for n in s)
            idx = self._pending("i", f"unique_index({shp}, {d}, {s[d]}, {rs.randrange(10000)})")
            src = self.new_input(shp) if rs.random() < 0.7 else str(rs.choice(CONSTS))
            return f"{a}.scatter({d}, {idx}, {src})"
        if kind == 3:
            shp = tuple(rs.randint(1, n) if i != d else rs.randint(1, 6) for i, n in enumerate(s))
            idx, src = self.new_index(shp, s[d]), self.new_input(shp)
            red = rs.choice(["sum", "prod", "mean", "amax", "amin"])
            return f"{a}.scatter_reduce({d}, {idx}, {src}, {red!r}, include_self={rs.random() < 0.6})"
        # in-place write under autograd into a slice or an element
        parts = []
        for n in s:
            k = rs.random()
            if k < 0.4: parts.append(":")
            elif k < 0.6: parts.append(str(rs.randint(-n, n - 1)))
            else:
                b = rs.randint(0, n - 1)
                parts.append(f"{b}:{rs.randint(b + 1, n)}")
        idx = "(" + ", ".join(f"slice({p.replace(':', ', ') or 'None'})" if ":" in p and p != ":" else
                              "slice(None)" if p == ":" else p for p in parts) + ",)"
        if rs.random() < 0.3:   # rows picked by a tensor of distinct indices (one writer per element)
            k = rs.randint(1, s[0])
            idx = "(" + self._pending("i", f"unique_index(({k},), 0, {s[0]}, {rs.randrange(10000)})") + ",)"
        env = {**TT_ENV, **self.env}
        for n, e in self.pending: env[n] = eval(e, env)
        region = env[a].t[tuple(i.t if isinstance(i, TT) else i for i in eval(idx, env))].shape
        v = str(rs.choice(CONSTS)) if rs.random() < 0.3 else self.new_input(
            tuple(1 if rs.random() < 0.3 else n for n in region))
        return f"setitem({a}, {idx}, {v})"

    def cumulative(self) -> str | None:
        a = self.pick(lambda r: r.ndim > 0)
        if a is None: return None
        d = self.rs.randrange(self.env[a].ndim)
        return f"{a}.cumsum({d})" if self.rs.random() < 0.6 else f"{a}.cumprod({d})"

    def where(self) -> str | None:
        a = self.pick()
        if a is None: return None
        c = f"({a} {self.rs.choice(['<', '>'])} {self._partner(a) if self.rs.random() < 0.5 else 0})"
        x = self._partner(a)
        y = self._partner(a) if self.rs.random() < 0.6 else str(self.rs.choice(CONSTS))
        if self.rs.random() < 0.2: return f"{x}.masked_fill({c}, {self.rs.choice(CONSTS)})"
        return f"{c}.where({x}, {y})" if self.rs.random() < 0.5 else f"{c}.where({y}, {x})"

    def pad(self) -> str | None:
        a = self.pick(lambda r: r.ndim > 0)
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        mode = rs.choice(["constant", "reflect", "replicate", "circular"])
        n = rs.randint(1, min(3, len(s)))
        lo = -1 if mode == "constant" else 0
        flat = tuple(rs.randint(lo, min(3, d)) for d in s[::-1][:n] for _ in range(2))
        val = f", value={rs.choice(CONSTS)}" if mode == "constant" and rs.random() < 0.4 else ""
        if rs.random() < 0.3:   # the per-dim form
            pairs = [None] * (len(s) - n) + [(flat[2 * i], flat[2 * i + 1]) for i in range(n)][::-1]
            return f"{a}.pad({tuple(pairs)}, mode={mode!r}{val})"
        return f"{a}.pad({flat}, mode={mode!r}{val})"

    def interpolate(self) -> str | None:
        a = self.pick(lambda r: r.ndim >= 2)
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        n = rs.randint(1, min(3, len(s) - 1))
        size = tuple(rs.randint(1, 9) for _ in range(n))
        mode = rs.choice(["linear", "linear", "nearest", "nearest-exact"])
        ac = f", align_corners={rs.random() < 0.5}" if mode == "linear" else ""
        return f"{a}.interpolate({size}, mode={mode!r}{ac})"

    def half(self) -> str | None:
        a = self.pick(lambda r: r.dt == "float32")
        if a is None: return None
        return f"{a}.{self.rs.choice(['half', 'bfloat16'])}()"

    def norm(self) -> str | None:
        a = self.pick(lambda r: r.ndim >= 2)
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        if rs.random() < 0.5:
            ax: Any = rs.randrange(len(s)) - len(s) if rs.random() < 0.6 else tuple(range(len(s) - 2, len(s)))
            return f"{a}.layernorm(axis={ax})"
        red = tuple(i for i in range(len(s)) if i != 1)
        w, b = self.new_input((s[1],)), self.new_input((s[1],))
        if rs.random() < 0.5:   # training mode: statistics of the batch, gradients through them
            return f"{a}.batchnorm({w}, {b}, {a}.mean(axis={red}), ({a}.var(axis={red}, correction=0) + 1e-5).rsqrt())"
        m, inv = self.new_input((s[1],)), self.new_input((s[1],))
        return f"{a}.batchnorm({w}, {b}, {m}, {inv}.abs() + 0.5)"

    FAMILIES: list[tuple[str, float]] = [("unary", 2), ("binary", 2), ("reduce", 1.5), ("movement", 2.5),
                                         ("matmul", 0.5), ("conv", 1.5), ("pooling", 1.5), ("index", 2),
                                         ("cumulative", 1), ("where", 1), ("pad", 1.5), ("interpolate", 1),
                                         ("half", 0.7), ("norm", 1)]

    def generate(self) -> Program:
        rs = self.rs
        for _ in range(rs.choice([1, 1, 2])):
            name = self._name("x")
            shape = self.random_shape() if rs.random() < 0.6 else (rs.randint(1, 2), rs.randint(1, 4),
                                                                    rs.randint(3, 9), rs.randint(3, 9))
            e = f"make_input({shape}, {rs.randrange(10000)})"
            self.prog.lines.append((name, e)); self.env[name] = eval(e, dict(TT_ENV))
            self.pool.append(name); self.inputs.add(name)
        names, weights = zip(*self.FAMILIES)
        target, ops, tries = rs.randint(2, 7), 0, 0
        while ops < target and tries < 200:
            tries += 1
            if self.try_line(getattr(self, rs.choices(names, weights)[0])()): ops += 1
        computed = [n for n in self.pool if n not in self.inputs]
        if not computed: self.try_line(f"{self.pool[0]} * 2.0")
        used = {w for _, e in self.prog.lines for w in
                e.replace("(", " ").replace(")", " ").replace(",", " ").replace(".", " ").replace("[", " ").split()}
        leaves = [n for n in self.pool if n not in self.inputs and n not in used and n != self.prog.lines[-1][0]]
        outs = [self.prog.lines[-1][0]] + rs.sample(leaves, min(len(leaves), rs.choice([0, 1, 2])))
        self.prog.outputs = list(dict.fromkeys(outs))
        return self.prog

def generate(seed: int) -> Program: return Generator(seed).generate()

# ---------------------------------------------------------------------------------------------------------------------
# running and comparing

@dataclass
class Result:
    prog: Program
    ok: bool
    message: str = ""

def _weights(shape: tuple[int, ...], k: int) -> np.ndarray: return input_array(shape, 7919 * k + 13)

def run_reference(prog: Program, dtype: torch.dtype = torch.float64) -> tuple[dict[str, TT], dict[str, TT | None]]:
    """The outputs and the gradient of every float input on torch, each with the tolerance it carries, computed in
    `dtype` (float64: the reference; float32: an estimate of the rounding error of the same program in float32)."""
    env: dict[str, Any] = dict(TT_ENV)
    REF["dtype"] = dtype
    try:
        for name, e in prog.lines: env[name] = eval(e, env)
    finally: REF["dtype"] = torch.float64
    outs = {o: env[o] for o in prog.outputs}
    loss = sum(((o.t * torch.tensor(_weights(o.shape, k), dtype=o.t.dtype)).sum()
                for k, o in enumerate(outs.values()) if o.is_float), torch.zeros((), dtype=torch.float64))
    ins = [n for n, e in prog.lines if e.startswith("make_input")]
    if loss.requires_grad: loss.backward()
    # the gradient's tolerance: the least precise dtype anywhere in the program (the backward pass crosses them all)
    unit = max([o.unit for o in env.values() if isinstance(o, TT)])
    grads = {n: None if env[n].t.grad is None else TT(env[n].t.grad, "float32", unit, check=False) for n in ins}
    return outs, grads

def run_fusegrad(prog: Program) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray | None]]:
    env: dict[str, Any] = dict(FG_ENV)
    for name, e in prog.lines: env[name] = eval(e, env)
    outs = {o: env[o] for o in prog.outputs}
    fl = [(k, o) for k, o in enumerate(outs.values()) if dtypes.is_float(o.dtype)]
    ins = [n for n, e in prog.lines if e.startswith("make_input")]
    if fl:
        loss = sum((o.float() * Tensor(_weights(o.shape, k))).sum() for k, o in fl)
        loss.backward()
    got = {o: t.float().numpy() if dtypes.is_float(t.dtype) else t.numpy() for o, t in outs.items()}
    grads = {n: None if env[n].grad is None else env[n].grad.numpy() for n in ins}
    return got, grads

def _compare(what: str, got: np.ndarray | None, exp: TT | None) -> str | None:
    if exp is None and got is None: return None
    shape = exp.shape if exp is not None else got.shape   # type: ignore[union-attr]
    e = np.zeros(shape) if exp is None else exp.t.detach().numpy().astype(np.float64)
    g = np.zeros(shape) if got is None else np.asarray(got, dtype=np.float64)
    if g.shape != e.shape: return f"{what}: shape {g.shape} != expected {e.shape}"
    tol = np.zeros(shape) if exp is None else exp.tol().detach().numpy() + 8 * exp.spread
    if exp is None: tol = tol + K_TOL * UNIT["float32"]
    bad = ~(np.abs(g - e) <= tol)
    if not bad.any(): return None
    i = np.unravel_index(np.argmax(np.where(bad, np.abs(g - e) - tol, -np.inf)), shape) if shape else ()
    return (f"{what}: {int(bad.sum())}/{bad.size} elements differ; at {tuple(int(x) for x in i)} got {g[i]!r} "
            f"expected {e[i]!r} (tolerance {tol[i]:.3g})\n  got      {np.array2string(g.ravel()[:10], precision=4)}\n"
            f"  expected {np.array2string(e.ravel()[:10], precision=4)}")

def _spread(ref: dict[str, Any], ref32: dict[str, Any]) -> None:
    """Widen each reference value's tolerance by torch's own float32 error on it (the largest in its tensor, counted
    8 times: fusegrad adds in other orders): that error follows the conditioning of the computation, which the
    roundoff bound alone does not see (a gradient that cancels to 0, a normalization of close values)."""
    for k, r in ref.items():
        if r is not None and r.is_float and ref32.get(k) is not None and r.v.numel():
            r.spread = float((ref32[k].v.to(torch.float64) - r.v).abs().max())

def run_program(prog: Program) -> Result:
    ref_out, ref_grad = run_reference(prog)
    try:
        out32, grad32 = run_reference(prog, torch.float32)
        _spread(ref_out, out32); _spread(ref_grad, grad32)
    except Reject: pass   # a tie the float64 run cleared by its margin: no estimate, the roundoff bound alone
    try: got_out, got_grad = run_fusegrad(prog)
    except Exception: return Result(prog, False, f"fusegrad raised:\n{traceback.format_exc()}")
    problems = [p for o in prog.outputs if (p := _compare(f"output {o}", got_out[o], ref_out[o]))]
    problems += [p for n in ref_grad if (p := _compare(f"grad of {n}", got_grad[n], ref_grad[n]))]
    return Result(prog, not problems, "\n".join(problems))

def report(res: Result) -> str:
    return f"fuzz program seed={res.prog.seed} failed (replay: python -m test.test_fuzz_torch {res.prog.seed})\n" \
           f"{res.prog.source()}\n--- {res.message}"

def minimize(prog: Program) -> Program:
    """A failing program with lines and outputs dropped one at a time while it still fails (greedy)."""
    def fails(p: Program) -> bool:
        try: return bool(p.outputs) and not run_program(p).ok
        except Exception: return False   # the reference itself cannot run the reduced program
    changed = True
    while changed:
        changed = False
        for i in range(len(prog.outputs)):
            cand = Program(prog.seed, prog.lines, prog.outputs[:i] + prog.outputs[i + 1:])
            if fails(cand): prog, changed = cand, True; break
        for i in range(len(prog.lines) - 1, -1, -1):
            if prog.lines[i][0] in prog.outputs: continue
            cand = Program(prog.seed, prog.lines[:i] + prog.lines[i + 1:], prog.outputs)
            if fails(cand): prog, changed = cand, True
            if changed: break
    return prog

def replay(seed: int, verbose: bool = True) -> Result:
    res = run_program(generate(seed))
    if verbose:
        print(res.prog.source())
        print(f"--- {'ok' if res.ok else 'FAILED'}")
        if res.message: print(res.message)
    return res

# ---------------------------------------------------------------------------------------------------------------------
# the fuzz tests

N_FAST = 60

def test_generator_is_deterministic():
    for seed in (0, 1, 77):
        assert generate(seed).source() == generate(seed).source()

def test_comparison_catches_wrong_values():
    # the comparison must be able to fail: an output or a gradient off by a little more than its tolerance
    prog = Program(0, [("x1", "make_input((2, 3, 5, 5), 1)"), ("x2", "make_input((4, 3, 2, 2), 2)"),
                       ("v3", "x1.conv2d(x2, padding=1)")], ["v3"])
    ref_out, ref_grad = run_reference(prog)
    got_out, got_grad = run_fusegrad(prog)
    assert _compare("v3", got_out["v3"], ref_out["v3"]) is None
    assert all(_compare(n, got_grad[n], ref_grad[n]) is None for n in ("x1", "x2"))
    off = got_out["v3"].copy()
    off.flat[7] += 2 * float(ref_out["v3"].tol().flatten()[7])
    assert _compare("v3", off, ref_out["v3"]) is not None
    g = got_grad["x2"].copy()   # type: ignore[union-attr]
    g.flat[3] += 2 * float(ref_grad["x2"].tol().flatten()[3])   # type: ignore[union-attr]
    assert _compare("x2", g, ref_grad["x2"]) is not None
    assert _compare("x2", None, ref_grad["x2"]) is not None   # a missing gradient is a zero gradient

@pytest.mark.parametrize("seed", range(N_FAST))
def test_fuzz_torch(seed: int):
    res = run_program(generate(seed))
    assert res.ok, report(res)

@pytest.mark.slow
def test_fuzz_torch_many():
    fails = [r for r in (run_program(generate(s)) for s in range(10_000, 11_000)) if not r.ok]
    assert not fails, f"{len(fails)} of 1000 programs failed, seeds {[r.prog.seed for r in fails]}\n" + \
        "\n\n".join(report(r) for r in fails[:5])

# ---------------------------------------------------------------------------------------------------------------------
# minimized reproducers of bugs the fuzzer found

if __name__ == "__main__":
    args = sys.argv[1:] or ["0-200"]
    for arg in args:
        if "-" in arg:
            lo, hi = map(int, arg.split("-"))
            st, failing = time.perf_counter(), []
            for s in range(lo, hi):
                r = run_program(generate(s))
                if not r.ok:
                    failing.append(s)
                    print(report(r), flush=True)
            print(f"{hi - lo} programs in {time.perf_counter() - st:.1f}s, failing seeds: {failing}", flush=True)
        elif arg.startswith("min"): print(report(run_program(minimize(generate(int(arg[3:]))))))
        else: replay(int(arg))
