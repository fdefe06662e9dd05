"""A seeded fuzzer of random tensor programs: each program is a few lines of Tensor code (elementwise chains, reduces,
movement ops, matmuls, casts, in-place assigns, several outputs realized together), run through the whole compiler and
compared with NumPy evaluating the same lines in float64/int64 from the same float32/integer inputs.

A program is plain Python source over a tiny subset of the Tensor API, so the same text is evaluated twice: once with
`Tensor`s and once with `Ref`, a NumPy stand-in that also carries an error bound per element (in units of float32 eps)
so the tolerance follows the magnitudes that went into each value. The generator evaluates every candidate line on
`Ref` first and drops lines that would be ill-conditioned (overflow, comparisons of nearly equal floats, integer wrap).

Replay a failure with `python -m test.test_fuzz_programs SEED` (or `replay(SEED)`): it prints the program and the
comparison. The bottom of the file holds minimized reproducers of bugs the fuzzer found, one test each."""
from __future__ import annotations
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.device import GlobalCounters

EPS32 = 2.0 ** -24       # float32 unit roundoff
RTOL, ERR_K, ATOL0 = 1e-4, 256, 1e-6
MAX_NUMEL, MAX_DIM, MAX_RANK = 4096, 64, 5
FLOAT_LIMIT, INT_LIMIT = 1e6, 2 ** 24
# integer dtypes: exact comparison; a value outside a dtype's range would wrap, so such lines are not generated
INT_RANGE = {"int8": (-128, 127), "uint8": (0, 255), "int16": (-2 ** 15, 2 ** 15 - 1), "int32": (-INT_LIMIT, INT_LIMIT),
             "uint32": (0, INT_LIMIT), "int64": (-2 ** 40, 2 ** 40)}
INTS = tuple(INT_RANGE)
SUM_DT = {"int8": "int32", "int16": "int32", "int32": "int32", "bool": "int32", "uint8": "uint32", "uint32": "uint32",
          "int64": "int64"}
CONSTS = (0.5, 1.5, 2.0, -1.0, 3.0, -0.25)  # exact in float32, so constants add no rounding of their own

class Reject(Exception):
    """The generator must not use this line: its result would be ill-conditioned or out of range."""

# ---------------------------------------------------------------------------------------------------------------------
# inputs

def input_array(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """The data of a program input; deterministic in (shape, dtype, seed)."""
    rng = np.random.default_rng(seed)
    if dtype in INT_RANGE: return rng.integers(0 if dtype.startswith("u") else -5, 10 if dtype.startswith("u") else 5,
                                               size=shape, endpoint=True).astype(dtype)
    return rng.uniform(-2.0, 2.0, size=shape).astype(np.float32)

# ---------------------------------------------------------------------------------------------------------------------
# the NumPy reference: the subset of the Tensor API that programs use, with an error bound per element

def _np_dtype_name(a: np.ndarray) -> str:
    return "bool" if a.dtype == np.bool_ else a.dtype.name if np.issubdtype(a.dtype, np.integer) else "float32"

def _in_range(v: np.ndarray, dt: str) -> bool:
    lo, hi = INT_RANGE[dt]
    return v.size == 0 or (int(v.min()) >= lo and int(v.max()) <= hi)

class Ref:
    """A Tensor stand-in: `v` holds exact-ish values (float64 / int64 / bool), `err` an absolute error bound of the
    float32 computation in units of EPS32 (zero for ints and bools, which must match exactly)."""
    def __init__(self, v: Any, err: Any = None, dt: str | None = None):
        self.v = np.asarray(v)
        self.dt = dt or _np_dtype_name(self.v)
        if self.dt == "float32": self.v = self.v.astype(np.float64)
        elif self.dt in INT_RANGE:
            self.v = self.v.astype(np.int64)
            if not _in_range(self.v, self.dt): raise Reject(f"{self.dt} range")
        self.err = np.zeros(self.v.shape) if err is None or self.dt != "float32" else \
            np.broadcast_to(np.asarray(err, dtype=np.float64), self.v.shape)

    @property
    def shape(self) -> tuple[int, ...]: return tuple(self.v.shape)
    @property
    def ndim(self) -> int: return self.v.ndim
    def tol(self) -> np.ndarray:
        """Allowed |fusegrad - reference| per element."""
        return RTOL * np.abs(self.v) + ERR_K * EPS32 * self.err + ATOL0 if self.dt == "float32" else \
            np.zeros(self.v.shape)

    def _mv(self, fn: Callable[[np.ndarray], np.ndarray]) -> Ref:
        return Ref(fn(self.v), fn(self.err), self.dt)
    def _operand(self, y: Any) -> Ref:
        if isinstance(y, Ref): return y
        if self.dt == "float32" or isinstance(y, float): return Ref(np.float64(y), dt="float32")
        return Ref(np.int64(y), dt=self.dt if self.dt in INT_RANGE else "int32")

    # movement
    def reshape(self, *shape: Any) -> Ref:
        shp = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._mv(lambda a: a.reshape(shp))
    def permute(self, *order: Any) -> Ref:
        o = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else order
        return self._mv(lambda a: a.transpose(o))
    def transpose(self, d0: int, d1: int) -> Ref: return self._mv(lambda a: np.swapaxes(a, d0, d1))
    @property
    def T(self) -> Ref: return self._mv(lambda a: a.transpose())
    def expand(self, *shape: Any) -> Ref:
        shp = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._mv(lambda a: np.broadcast_to(a, shp))
    def flip(self, axis: Any) -> Ref: return self._mv(lambda a: np.flip(a, axis))
    def shrink(self, arg: Any) -> Ref: return self._mv(lambda a: a[tuple(slice(b, e) for b, e in arg)])
    def pad(self, padding: Any, value: float = 0.0) -> Ref:
        crop = tuple(slice(max(-b, 0), s - max(-e, 0)) for (b, e), s in zip(padding, self.shape))
        pos = tuple((max(b, 0), max(e, 0)) for b, e in padding)
        return Ref(np.pad(self.v[crop], pos, constant_values=value), np.pad(self.err[crop], pos), self.dt)
    def __getitem__(self, idx: Any) -> Ref: return self._mv(lambda a: a[idx])
    def contiguous(self) -> Ref: return self
    def realize(self) -> Ref: return self
    def assign(self, x: Ref) -> Ref: return x

    # elementwise
    def _bin(self, y: Any, fn: Callable, err: Callable | None, reverse: bool = False) -> Ref:
        a, b = (self, self._operand(y)) if not reverse else (self._operand(y), self)
        v = fn(a.v, b.v)
        if a.dt == "float32" and b.dt == "float32" and err is not None:
            return Ref(v, err(a, b, v) + np.abs(v), "float32")
        return Ref(v, dt=a.dt if a.dt == b.dt else "float32")
    def __add__(self, y: Any) -> Ref: return self._bin(y, np.add, lambda a, b, v: a.err + b.err)
    def __radd__(self, y: Any) -> Ref: return self._bin(y, np.add, lambda a, b, v: a.err + b.err, True)
    def __sub__(self, y: Any) -> Ref: return self._bin(y, np.subtract, lambda a, b, v: a.err + b.err)
    def __rsub__(self, y: Any) -> Ref: return self._bin(y, np.subtract, lambda a, b, v: a.err + b.err, True)
    def __mul__(self, y: Any) -> Ref:
        return self._bin(y, np.multiply, lambda a, b, v: np.abs(b.v) * a.err + np.abs(a.v) * b.err)
    def __rmul__(self, y: Any) -> Ref: return self.__mul__(y)
    def __truediv__(self, y: Any) -> Ref:
        b = self._operand(y)
        if np.abs(b.v).min(initial=1) < 0.25: raise Reject("division by a small number")
        return self._bin(b, np.divide, lambda a, b, v: a.err / np.abs(b.v) + np.abs(a.v) * b.err / b.v ** 2)
    def __floordiv__(self, y: Any) -> Ref: return self._bin(y, np.floor_divide, None)
    def __mod__(self, y: Any) -> Ref: return self._bin(y, np.mod, None)
    def __and__(self, y: Any) -> Ref: return self._bin(y, np.bitwise_and, None)
    def __or__(self, y: Any) -> Ref: return self._bin(y, np.bitwise_or, None)
    def __xor__(self, y: Any) -> Ref: return self._bin(y, np.bitwise_xor, None)
    def __neg__(self) -> Ref: return Ref(-self.v, self.err, self.dt)
    def maximum(self, y: Any) -> Ref: return self._bin(y, np.maximum, lambda a, b, v: np.maximum(a.err, b.err))
    def minimum(self, y: Any) -> Ref: return self._bin(y, np.minimum, lambda a, b, v: np.maximum(a.err, b.err))
    def _cmp(self, y: Any, fn: Callable) -> Ref:
        a, b = self, self._operand(y)
        if a.dt == "float32" and np.any(np.abs(a.v - b.v) <= 2 * (a.tol() + b.tol())):
            raise Reject("comparison of floats closer than the tolerance")
        return Ref(fn(a.v, b.v), dt="bool")
    def __lt__(self, y: Any) -> Ref: return self._cmp(y, np.less)
    def __gt__(self, y: Any) -> Ref: return self._cmp(y, np.greater)
    def __eq__(self, y: Any) -> Ref: return self._cmp(y, np.equal)  # type: ignore[override]
    def __ne__(self, y: Any) -> Ref: return self._cmp(y, np.not_equal)  # type: ignore[override]
    __hash__ = object.__hash__
    def where(self, x: Any, y: Any) -> Ref:
        if not isinstance(x, Ref) and not isinstance(y, Ref):   # two Python scalars: ints stay int32
            dt = "int32" if isinstance(x, int) and isinstance(y, int) else "float32"
            x, y = Ref(np.asarray(x), dt=dt), Ref(np.asarray(y), dt=dt)
        elif not isinstance(x, Ref): x = y._operand(x)
        elif not isinstance(y, Ref): y = x._operand(y)
        c = self.v.astype(bool)
        return Ref(np.where(c, x.v, y.v), np.where(c, x.err, y.err), x.dt)
    def logical_not(self) -> Ref: return Ref(~self.v.astype(bool), dt="bool")
    def cast(self, dt: str) -> Ref:
        if self.dt == "float32" and dt != "float32": raise Reject("float -> int casts round: not fuzzed")
        return Ref(self.v.astype(np.float64 if dt == "float32" else np.bool_ if dt == "bool" else np.int64), dt=dt)
    def abs(self) -> Ref: return Ref(np.abs(self.v), self.err, self.dt)
    def relu(self) -> Ref: return Ref(np.maximum(self.v, 0), self.err, self.dt)
    def clip(self, lo: float, hi: float) -> Ref: return Ref(np.clip(self.v, lo, hi), self.err, self.dt)
    def square(self) -> Ref: return self * self
    def _unary(self, v: np.ndarray, err: np.ndarray) -> Ref:
        if self.dt != "float32": raise Reject("float op on an int tensor")
        return Ref(v, err + np.abs(v), "float32")
    # transcendental: propagated error plus a few ulps of the libm call; exp/sin also round their argument
    def exp(self) -> Ref:
        v = np.exp(self.v)
        return self._unary(v, v * (self.err + np.abs(self.v) + 2))
    def log(self) -> Ref:
        if self.v.min(initial=1) < 1: raise Reject("log is only fuzzed on x >= 1")
        return self._unary(np.log(self.v), self.err / self.v + 2)
    def sqrt(self) -> Ref:
        if self.v.min(initial=1) < 0: raise Reject("sqrt of a negative number")
        v = np.sqrt(self.v)
        with np.errstate(divide="ignore", invalid="ignore"):   # sqrt near 0 is ill-conditioned: inf, then rejected
            return self._unary(v, np.where(self.err == 0, 0, self.err / (2 * v)))
    def reciprocal(self) -> Ref:
        if self.v.min(initial=1) < 1: raise Reject("reciprocal is only fuzzed on x >= 1")
        return self._unary(1 / self.v, self.err / self.v ** 2)
    def sin(self) -> Ref: return self._unary(np.sin(self.v), np.abs(np.cos(self.v)) * self.err + np.abs(self.v) + 2)
    def sigmoid(self) -> Ref:
        s = 1 / (1 + np.exp(-self.v))
        return self._unary(s, s * (1 - s) * (self.err + np.abs(self.v)) + 4)
    def tanh(self) -> Ref:
        t = np.tanh(self.v)
        return self._unary(t, (1 - t * t) * 2 * (self.err + np.abs(self.v)) + 8)

    # reductions
    def _red(self, fn: Callable, axis: Any, keepdim: bool, err: Callable) -> Ref:
        v = fn(self.v, axis=axis, keepdims=keepdim)
        if self.dt != "float32":
            if np.abs(self.v).sum() > INT_LIMIT: raise Reject("int32 range")
            return Ref(v, dt=SUM_DT[self.dt] if fn is np.sum else self.dt)
        return Ref(v, err(axis, keepdim), "float32")
    def sum(self, axis: Any = None, keepdim: bool = False) -> Ref:
        return self._red(np.sum, axis, keepdim, lambda ax, kd: np.sum(self.err + np.abs(self.v), axis=ax, keepdims=kd))
    def mean(self, axis: Any = None, keepdim: bool = False) -> Ref:
        r = self._red(np.mean, axis, keepdim, lambda ax, kd: np.mean(self.err + np.abs(self.v), axis=ax, keepdims=kd))
        return Ref(r.v, r.err + np.abs(r.v), "float32")
    def max(self, axis: Any = None, keepdim: bool = False) -> Ref:
        return self._red(np.max, axis, keepdim, lambda ax, kd: np.max(self.err, axis=ax, keepdims=kd))
    def min(self, axis: Any = None, keepdim: bool = False) -> Ref:
        return self._red(np.min, axis, keepdim, lambda ax, kd: np.max(self.err, axis=ax, keepdims=kd))
    # composites, built from the primitives above so their error bounds follow
    def softmax(self, axis: int = -1) -> Ref:
        e = (self - self.max(axis, keepdim=True)).exp()
        return e / e.sum(axis, keepdim=True)
    def log_softmax(self, axis: int = -1) -> Ref:
        m = self - self.max(axis, keepdim=True)
        return m - m.exp().sum(axis, keepdim=True).log()
    def logsumexp(self, axis: Any = None, keepdim: bool = False) -> Ref:
        m = self.max(axis, keepdim=True)
        r = (self - m).exp().sum(axis, keepdim=True).log() + m
        return r if keepdim else r.reshape(np.sum(self.v, axis=axis).shape)
    def var(self, axis: Any = None, keepdim: bool = False, correction: int = 1) -> Ref:
        n = self.v.size // max(np.sum(self.v, axis=axis).size, 1)
        return (self - self.mean(axis, keepdim=True)).square().sum(axis, keepdim) / max(0, n - correction)
    def std(self, axis: Any = None, keepdim: bool = False, correction: int = 1) -> Ref:
        return self.var(axis, keepdim, correction).sqrt()
    def argmax(self, axis: int | None = None, keepdim: bool = False) -> Ref:
        x, ax = (self.reshape(-1), 0) if axis is None else (self, axis)
        if x.dt == "float32" and x.shape[ax] > 1:
            # the maximum must win by more than the error of the two largest values, or the index is a coin toss
            top = np.sort(x.v, axis=ax)
            tol = np.max(x.tol(), axis=ax)
            if np.any(np.take(top, -1, ax) - np.take(top, -2, ax) <= 4 * tol): raise Reject("argmax of near-ties")
        return Ref(np.argmax(x.v, axis=ax, keepdims=keepdim), dt="int32")
    def argmin(self, axis: int | None = None, keepdim: bool = False) -> Ref:
        if self.dt == "float32": return (-self).argmax(axis, keepdim)
        x, ax = (self.reshape(-1), 0) if axis is None else (self, axis)
        return Ref(np.argmin(x.v, axis=ax, keepdims=keepdim), dt="int32")
    def _rounding(self, fn: Callable) -> Ref:
        if self.dt != "float32": return self
        if np.any(np.abs(self.v - np.round(self.v)) <= 2 * self.tol()): raise Reject("rounding near an integer")
        return Ref(fn(self.v), dt="float32")
    def floor(self) -> Ref: return self._rounding(np.floor)
    def ceil(self) -> Ref: return self._rounding(np.ceil)
    def cat(self, *others: Ref, dim: int = 0) -> Ref:
        xs = (self,) + others
        return Ref(np.concatenate([x.v for x in xs], dim), np.concatenate([x.err for x in xs], dim), self.dt)
    def any(self, axis: Any = None, keepdim: bool = False) -> Ref: return Ref(np.any(self.v, axis, keepdims=keepdim))
    def all(self, axis: Any = None, keepdim: bool = False) -> Ref: return Ref(np.all(self.v, axis, keepdims=keepdim))
    def __matmul__(self, y: Ref) -> Ref:
        v = np.matmul(self.v, y.v)
        if self.dt != "float32":
            if np.matmul(np.abs(self.v), np.abs(y.v)).max(initial=0) > INT_LIMIT: raise Reject("int32 range")
            return Ref(v, dt=self.dt)
        av, bv = np.abs(self.v), np.abs(y.v)
        return Ref(v, np.matmul(self.err, bv) + np.matmul(av, y.err) + np.matmul(av, bv) + np.abs(v), "float32")

def ref_assign_view(t: Ref, region: tuple, x: Ref, read: tuple | None) -> Ref:
    """NumPy side of `assign_view`."""
    v, err = t.v.copy(), t.err.copy()
    new = x if read is None else t.shrink(read) + x
    sl = tuple(slice(b, e) for b, e in region)
    v[sl], err[sl] = new.v, new.err
    return Ref(v, err, t.dt)

def fg_assign_view(t: Tensor, region: tuple, x: Tensor, read: tuple | None) -> Tensor:
    """Write x (plus the old values of region `read` of t, if given) into a region of the realized tensor t in place,
    realized now; returns t."""
    view = t.shrink(region)
    view.assign(x if read is None else t.shrink(read) + x).realize()
    return t

class RefTensor:
    """The `Tensor` name in reference programs: the creation functions programs use."""
    @staticmethod
    def arange(start: int, stop: int | None = None, step: int = 1) -> Ref:
        return Ref(np.arange(start, stop, step) if stop is not None else np.arange(start), dt="int32")
    @staticmethod
    def full(shape: tuple[int, ...], value: float | int) -> Ref:
        return Ref(np.full(shape, value), dt="float32" if isinstance(value, float) else "int32")
    @staticmethod
    def eye(n: int) -> Ref: return Ref(np.eye(n), dt="float32")
    @staticmethod
    def stack(*xs: Ref, dim: int = 0) -> Ref:
        return Ref(np.stack([x.v for x in xs], dim), np.stack([x.err for x in xs], dim), xs[0].dt)

REF_ENV: dict[str, Any] = {"make_input": lambda s, d, seed: Ref(input_array(s, d, seed)),
                           "assign_view": ref_assign_view, "Tensor": RefTensor}
FG_ENV: dict[str, Any] = {"make_input": lambda s, d, seed: Tensor(input_array(s, d, seed)),
                          "assign_view": fg_assign_view, "Tensor": Tensor}

# ---------------------------------------------------------------------------------------------------------------------
# programs

@dataclass
class Program:
    seed: int
    lines: list[tuple[str, str]] = field(default_factory=list)   # (variable, expression)
    outputs: list[str] = field(default_factory=list)
    self_reading_assigns: int = 0   # an assign that reads its target elsewhere needs a temporary: one more kernel

    @property
    def n_ops(self) -> int:
        """Tensor operations in the program: method calls, operators and indexing (an expression like
        `(x.abs() + 1).log()` is three). Every kernel needs at least one of them."""
        return sum(len(_OP_RE.findall(e)) + sum(w - 1 for m in _OP_RE.findall(e) if (w := _COMPOSITE.get(m[1:-1], 1)))
                   for _, e in self.lines if not e.startswith("make_input"))

    def source(self) -> str:
        body = "\n".join(f"{v} = {e}" for v, e in self.lines)
        return f"# fuzz program seed={self.seed}\n{body}\nTensor.realize({', '.join(self.outputs)})"

_OP_RE = re.compile(r"\.\w+\(|assign_view\(|\.T\b|\[| [-+*/@%&|^<>]=? | // | == | != |^-|\(-")

# Tensor methods made of several operations (softmax: max, subtract, exp, sum, divide)
_COMPOSITE = {"softmax": 5, "log_softmax": 6, "logsumexp": 6, "var": 6, "std": 7, "argmax": 6, "argmin": 7,
              "cat": 3, "stack": 4, "floor": 3, "ceil": 3, "eye": 3, "min": 3, "mean": 2}

def _factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0: out.append(p); n //= p
        p += 1
    return out + ([n] if n > 1 else [])

class Generator:
    """Builds a random program line by line, checking every line on the NumPy reference before keeping it."""
    def __init__(self, seed: int):
        self.rs, self.prog = random.Random(seed), Program(seed)
        self.env: dict[str, Ref] = {}
        self.pool: list[str] = []            # variables later lines may use
        self.inputs: set[str] = set()
        self.pending: list[tuple[str, str]] = []  # inputs the candidate line needs (kept with it)
        self.consumes: list[str] = []
        self.self_read = 0   # the candidate line is an assign that reads its own target elsewhere
        self.n_vars = 0

    # helpers
    def _name(self, prefix: str) -> str:
        self.n_vars += 1
        return f"{prefix}{self.n_vars}"
    def random_shape(self) -> tuple[int, ...]:
        if self.rs.random() < 0.12:
            # now and then a long axis or two, so the optimizer vectorizes, tiles and blocks (16 floats per vector)
            shp = [self.rs.choice([16, 24, 32, 48, 64]) for _ in range(self.rs.randint(1, 2))]
            small = self.rs.randint(1, 5)
            shp.insert(self.rs.randint(0, len(shp)), small if small * int(np.prod(shp)) <= MAX_NUMEL else 1)
            return tuple(shp)
        rank = self.rs.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])
        hi = 9 if rank <= 2 else 6 if rank == 3 else 4
        return tuple(self.rs.randint(1, hi) for _ in range(rank))
    def new_input(self, shape: tuple[int, ...], dt: str) -> str:
        name = self._name("x")
        self.pending.append((name, f"make_input({shape}, '{dt}', {self.rs.randrange(10000)})"))
        return name
    def pick(self, dt: str | tuple[str, ...] | None = None, pred: Callable[[Ref], bool] | None = None) -> str | None:
        dts = (dt,) if isinstance(dt, str) else dt
        cands = [n for n in self.pool if (dts is None or self.env[n].dt in dts) and (pred is None or pred(self.env[n]))]
        if not cands: return None
        # mostly extend the newest values (long chains), sometimes reuse an older one (values used twice)
        recent = [n for n in cands if n in self.pool[-2:]]
        return self.rs.choice(recent) if recent and self.rs.random() < 0.7 else self.rs.choice(cands)

    def try_line(self, expr: str | None) -> bool:
        if expr is None:
            self.pending, self.consumes, self.self_read = [], [], 0
            return False
        env = {**REF_ENV, **self.env}
        try:
            for name, e in self.pending: env[name] = eval(e, env)
            r = eval(expr, env)
            self._check(r)
        except (Reject, ValueError, IndexError):   # numpy's errors: an invalid line (e.g. shapes don't broadcast)
            self.pending, self.consumes, self.self_read = [], [], 0
            return False
        for name, e in self.pending:
            self.prog.lines.append((name, e)); self.env[name] = env[name]; self.pool.append(name); self.inputs.add(name)
        for c in self.consumes: self.pool.remove(c)
        self.prog.self_reading_assigns += self.self_read
        self.pending, self.consumes, self.self_read = [], [], 0
        out = self._name("v")
        self.prog.lines.append((out, expr)); self.env[out] = r; self.pool.append(out)
        return True

    @staticmethod
    def _check(r: Ref) -> None:
        if r.ndim > MAX_RANK or r.v.size > MAX_NUMEL or r.v.size == 0 or any(s > MAX_DIM for s in r.shape):
            raise Reject("shape out of range")
        if r.dt == "float32":
            if not np.all(np.isfinite(r.v)) or not np.all(np.isfinite(r.err)): raise Reject("not finite")
            if np.abs(r.v).max(initial=0) > FLOAT_LIMIT: raise Reject("too large")
            # keep outputs well conditioned: the propagated error must stay small next to the values
            if (ERR_K * EPS32 * r.err).max(initial=0) > 1e-2 * (np.abs(r.v).max(initial=0) + 1): raise Reject("cond")
        elif r.dt in INT_RANGE and not _in_range(r.v, r.dt): raise Reject(f"{r.dt} range")

    # *** families of lines ***

    def unary(self) -> str | None:
        a = self.pick()
        if a is None: return None
        dt = self.env[a].dt
        if dt == "float32":
            ops = ["-{a}", "{a}.relu()", "{a}.abs()", "{a}.clip(-4, 4).exp()", "({a}.abs() + 1).log()",
                   "({a}.abs() + 1).sqrt()", "({a}.abs() + 1).reciprocal()", "{a}.sin()", "{a}.sigmoid()",
                   "{a}.tanh()", "{a}.square()", "{a} * {c}", "{a} + {c}", "{c} - {a}", "{a} / {c}",
                   "{a}.clip(-1, 1.5)"]
        elif dt in INT_RANGE:
            ops = ["-{a}", "{a}.abs()", "{a} * 3", "{a} + 2", "{a} - 7", "{a}.cast('float32')", "{a} // 3", "{a} % 4",
                   "{a}.maximum(0)", "{a} & 6", "{a} ^ 5"]
        else:
            ops = ["{a}.cast('float32')", "{a}.cast('int32')", "{a}.logical_not()", "{a}.where(1.5, -0.5)",
                   "{a}.where(2, -3)"]
        return self.rs.choice(ops).format(a=a, c=self.rs.choice(CONSTS))

    def _broadcast_partner(self, a: str, dt: str) -> str:
        """Another value whose shape broadcasts with a's: an existing one or a new input."""
        sa = self.env[a].shape
        def fits(r: Ref) -> bool:
            try: return int(np.prod(np.broadcast_shapes(sa, r.shape))) <= MAX_NUMEL
            except ValueError: return False
        if self.rs.random() < 0.6 and (b := self.pick(dt, fits)) is not None: return b
        shp = [1 if self.rs.random() < 0.3 else s for s in sa]
        if shp and self.rs.random() < 0.3: shp = shp[self.rs.randint(1, len(shp)):]
        elif self.rs.random() < 0.15 and len(shp) < 4: shp = [self.rs.randint(2, 4)] + shp
        return self.new_input(tuple(shp), dt)

    def binary(self) -> str | None:
        a = self.pick(("float32",) + INTS)
        if a is None: return None
        dt = self.env[a].dt
        b = self._broadcast_partner(a, dt)
        if self.rs.random() < 0.5: a, b = b, a
        if dt == "float32":
            ops = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} / ({b}.abs() + 1)", "{a}.maximum({b})",
                   "{a}.minimum({b})"]
        else:
            ops = ["{a} + {b}", "{a} - {b}", "{a} * {b}", "{a}.maximum({b})", "{a}.minimum({b})",
                   "{a} // ({b}.abs() + 1)", "{a} % ({b}.abs() + 1)", "{a} & {b}", "{a} | {b}", "{a} ^ {b}"]
        return self.rs.choice(ops).format(a=a, b=b)

    def compare(self) -> str | None:
        a = self.pick(("float32",) + INTS)
        if a is None: return None
        dt = self.env[a].dt
        if self.rs.random() < 0.4: return f"{a} {self.rs.choice(['<', '>'])} {self.rs.choice([0, 1, -1])}"
        b = self._broadcast_partner(a, dt)
        ops = ["<", ">"] + (["==", "!="] if dt in INT_RANGE else [])
        return f"{a} {self.rs.choice(ops)} {b}"

    def where(self) -> str | None:
        c = self.pick("bool")
        if c is None: return self.compare()
        dt = self.rs.choice(["float32", "float32", "int32"])
        x = self._broadcast_partner(c, dt)
        y = self._broadcast_partner(c, dt) if self.rs.random() < 0.6 else \
            str(self.rs.choice(CONSTS) if dt == "float32" else 4)
        return f"{c}.where({x}, {y})" if self.rs.random() < 0.7 else f"{c}.where({y}, {x})"

    def reduce(self) -> str | None:
        a = self.pick(pred=lambda r: r.ndim > 0)
        if a is None: return None
        r = self.env[a]
        ops = {"float32": ["sum", "sum", "max", "min", "mean"], "bool": ["any", "all", "sum"]}.get(r.dt,
                                                                                                ["sum", "max", "min"])
        op = self.rs.choice(ops)
        if self.rs.random() < 0.2: axis: Any = None
        else:
            axes = sorted(self.rs.sample(range(r.ndim), self.rs.randint(1, r.ndim)))
            axis = axes[0] if len(axes) == 1 and self.rs.random() < 0.5 else tuple(axes)
            if self.rs.random() < 0.3: axis = tuple(x - r.ndim for x in axes)  # negative axes
        kd = ", keepdim=True" if self.rs.random() < 0.4 else ""
        return f"{a}.{op}({'' if axis is None and not kd else 'axis=' + str(axis)}{kd})"

    def movement(self) -> str | None:
        a = self.pick()
        if a is None: return None
        s, rs = self.env[a].shape, self.rs
        kind = rs.choice(["reshape", "reshape", "permute", "permute", "expand", "pad", "pad", "shrink", "flip",
                          "getitem", "getitem"])
        n = int(np.prod(s)) if s else 1
        if kind == "reshape":
            choice = rs.randint(0, 4)
            if choice == 0 and len(s) >= 2:   # merge two neighbouring dims
                i = rs.randrange(len(s) - 1)
                new = s[:i] + (s[i] * s[i + 1],) + s[i + 2:]
            elif choice == 1 and any(len(_factors(d)) > 1 for d in s):   # split a dim
                i = rs.choice([i for i, d in enumerate(s) if len(_factors(d)) > 1])
                f = rs.choice(_factors(s[i]))
                new = s[:i] + (f, s[i] // f) + s[i + 1:]
            elif choice == 2:   # insert or drop a 1
                if 1 in s and rs.random() < 0.5:
                    i = rs.choice([i for i, d in enumerate(s) if d == 1])
                    new = s[:i] + s[i + 1:]
                else:
                    i = rs.randint(0, len(s))
                    new = s[:i] + (1,) + s[i:]
            else:   # a fresh factorization of the element count
                fs = _factors(n)
                rs.shuffle(fs)
                k = rs.randint(1, max(1, min(4, len(fs))))
                dims = [1] * k
                for f in fs: dims[rs.randrange(k)] *= f
                new = tuple(dims) if n > 1 or rs.random() < 0.5 else ()
            return f"{a}.reshape({new})"
        if kind == "permute" and len(s) >= 2:
            if rs.random() < 0.3: return f"{a}.transpose({rs.randrange(len(s))}, {rs.randrange(len(s))})"
            order = list(range(len(s)))
            rs.shuffle(order)
            return f"{a}.permute({tuple(order)})"
        if kind == "expand":
            if 1 in s and rs.random() < 0.7:
                new = tuple(rs.randint(1, 6) if d == 1 else d for d in s)
                return f"{a}.expand({new})"
            i = rs.randint(0, len(s))
            new = s[:i] + (1,) + s[i:]
            return f"{a}.reshape({new}).expand({new[:i] + (rs.randint(2, 5),) + new[i + 1:]})"
        if kind == "pad" and s:
            pads = tuple((rs.randint(-1, 3), rs.randint(-1, 3)) if rs.random() < 0.6 else (0, 0) for _ in s)
            if all(p == (0, 0) for p in pads): pads = ((1, 2),) + pads[1:]
            if any(d + b + e < 1 for d, (b, e) in zip(s, pads)): return None
            dt = self.env[a].dt
            val = "" if rs.random() < 0.6 or dt == "bool" else \
                f", value={rs.choice(CONSTS) if dt == 'float32' else rs.choice([2, -3])}"
            return f"{a}.pad({pads}{val})"
        if kind == "shrink" and s:
            arg = []
            for d in s:
                b = rs.randint(0, d - 1) if rs.random() < 0.6 else 0
                arg.append((b, rs.randint(b + 1, d) if rs.random() < 0.6 else d))
            return f"{a}.shrink({tuple(arg)})"
        if kind == "flip" and s:
            axes = sorted(rs.sample(range(len(s)), rs.randint(1, len(s))))
            return f"{a}.flip({axes[0] if len(axes) == 1 else tuple(axes)})"
        if kind == "getitem" and s:
            parts = []
            for d in s:
                k = rs.random()
                if k < 0.3: parts.append(":")
                elif k < 0.45: parts.append(str(rs.randint(-d, d - 1)))
                else:
                    step = rs.choice([1, 2, 3, -1, -2])
                    start = rs.choice(["", str(rs.randint(0, d - 1)), str(-rs.randint(1, d))])
                    stop = rs.choice(["", "", str(rs.randint(-d, d))])
                    parts.append(f"{start}:{stop}:{step}" if step != 1 else f"{start}:{stop}")
            if rs.random() < 0.2: parts.insert(rs.randint(0, len(parts)), "None")
            if rs.random() < 0.2 and len(parts) > 1: parts = parts[:rs.randint(1, len(parts) - 1)] + ["..."]
            return f"{a}[{', '.join(parts)}]"
        return None

    def matmul(self) -> str | None:
        a = self.pick(("float32",) + INTS, lambda r: 1 <= r.ndim <= 3)
        if a is None: return None
        ra = self.env[a]
        k = ra.shape[-1]
        def fits(r: Ref) -> bool:
            if r.ndim == 0 or r.dt != ra.dt: return False
            if r.shape[-2 if r.ndim >= 2 else -1] != k: return False
            try: np.broadcast_shapes(ra.shape[:-2], r.shape[:-2])
            except ValueError: return False
            return True
        def fits_t(r: Ref) -> bool:   # r transposed (a view) fits
            return r.ndim >= 2 and r.dt == ra.dt and r.shape[-1] == k and \
                len(r.shape[:-2]) <= 1 and (ra.ndim <= 2 or r.ndim == 2)
        if self.rs.random() < 0.5 and (b := self.pick(ra.dt, fits)) is not None: return f"{a} @ {b}"
        if self.rs.random() < 0.5 and (b := self.pick(ra.dt, fits_t)) is not None: return f"{a} @ {b}.transpose(-1, -2)"
        m, kind = self.rs.choice([1, 2, 3, 4, 5, 6, 7, 16, 32]), self.rs.random()
        if kind < 0.2: return f"{a} @ {self.new_input((k,), ra.dt)}"
        if kind < 0.6: return f"{a} @ {self.new_input((k, m), ra.dt)}"
        return f"{a} @ {self.new_input((m, k), ra.dt)}.T"   # the right operand is a permuted view

    def create(self) -> str | None:
        rs = self.rs
        kind = rs.randint(0, 4)
        if kind == 0: return f"Tensor.arange({rs.randint(1, 12)})"
        if kind == 1:
            shp = self.random_shape()
            return f"Tensor.arange({int(np.prod(shp))}).reshape({shp})"
        if kind == 2: return f"Tensor.arange({rs.randint(-5, 3)}, {rs.randint(4, 12)}, {rs.randint(1, 3)})"
        if kind == 3: return f"Tensor.full({self.random_shape()}, {rs.choice(CONSTS + (2, -3))})"
        return f"Tensor.eye({rs.randint(1, 6)})"

    def composite(self) -> str | None:
        a = self.pick(("float32",) + INTS, lambda r: r.ndim > 0)
        if a is None: return None
        r, rs = self.env[a], self.rs
        ax = rs.randrange(r.ndim) - (r.ndim if rs.random() < 0.3 else 0)
        kd = rs.random() < 0.5
        if r.dt in INT_RANGE or rs.random() < 0.15:
            return rs.choice([f"{a}.argmax()", f"{a}.argmax(axis={ax})", f"{a}.argmin(axis={ax}, keepdim={kd})"])
        return rs.choice([f"{a}.softmax({ax})", f"{a}.log_softmax({ax})", f"{a}.logsumexp(axis={ax}, keepdim={kd})",
                          f"{a}.var(axis={ax}, keepdim={kd})", f"{a}.std(axis={ax})", f"{a}.floor()", f"{a}.ceil()",
                          f"{a} - {a}.max(axis={ax}, keepdim=True)", f"{a}.sum(axis={ax}, keepdim=True).max()",
                          f"{a} / ({a}.sum(axis={ax}, keepdim=True).abs() + 1)",
                          f"{a} * {a}.mean(axis={ax}, keepdim=True)"])

    def cat(self) -> str | None:
        a = self.pick(pred=lambda r: r.ndim > 0)
        if a is None: return None
        r, rs = self.env[a], self.rs
        d = rs.randrange(r.ndim)
        if rs.random() < 0.3:
            b = self.pick(r.dt, lambda x: x.shape == r.shape) or self.new_input(r.shape, r.dt)
            return f"Tensor.stack({a}, {b}, dim={rs.randint(-r.ndim - 1, r.ndim)})"
        def fits(x: Ref) -> bool:
            return x.ndim == r.ndim and all(p == q for i, (p, q) in enumerate(zip(x.shape, r.shape)) if i != d)
        if r.dt == "bool" or (b := self.pick(r.dt, fits)) is None or rs.random() < 0.4:
            if r.dt == "bool": return None
            b = self.new_input(r.shape[:d] + (rs.randint(1, 4),) + r.shape[d + 1:], r.dt)
        return f"{a}.cat({b}, dim={d})" if rs.random() < 0.7 else f"{b}.cat({a}, {a}, dim={d - r.ndim})"

    def cast(self) -> str | None:
        a = self.pick(INTS + ("bool",))
        if a is None: return None
        return f"{a}.cast('{self.rs.choice(('float32', 'bool') + INTS)}')"

    def realize(self) -> str | None:
        a = self.pick(pred=lambda r: True)
        if a is None or a in self.inputs: return None
        return f"{a}.{self.rs.choice(['contiguous', 'realize'])}()"

    def assign(self) -> str | None:
        a = self.pick(("float32",) + INTS, lambda r: r.ndim > 0)
        if a is None: return None
        r = self.env[a]
        if self.rs.random() < 0.5:   # assign the whole (lazy) tensor; the value may read the target elsewhere
            t = self.new_input(r.shape, r.dt)
            self.consumes.append(t)
            kind = self.rs.randint(0, 4)
            if kind == 0: return f"{t}.assign({a})"
            if kind == 1: return f"{t}.assign({a} + {t})"
            self.self_read = 1
            ax = self.rs.randrange(r.ndim)
            if kind == 2: return f"{t}.assign({a} - {t}.flip({ax}))"
            # the read of the target is under an elementwise op, the movement above it
            if kind == 4 and r.ndim >= 2 and r.shape[-1] == r.shape[-2]:
                return f"{t}.assign(({a} * {t}).transpose(-1, -2))"
            return f"{t}.assign(({a} - {t}).flip({ax}))"
        # write into a region of a bigger buffer, realized at once
        pads = [(self.rs.randint(0, 2), self.rs.randint(0, 2)) for _ in r.shape]
        big = tuple(d + b + e for d, (b, e) in zip(r.shape, pads))
        t = self.new_input(big, r.dt)
        self.consumes.append(t)
        region = tuple((b, b + d) for d, (b, _) in zip(r.shape, pads))
        # the value may read the old contents: the region written, or another (overlapping) one of the same shape
        k = self.rs.randint(0, 2)
        read = None if k == 0 else region if k == 1 else \
            tuple((o, o + d) for d, o in ((d, self.rs.randint(0, B - d)) for d, B in zip(r.shape, big)))
        if read is not None and read != region: self.self_read = 1
        return f"assign_view({t}, {region}, {a}, {read})"

    FAMILIES: list[tuple[str, float]] = [("unary", 3), ("binary", 4), ("compare", 1), ("where", 1.5),
                                         ("reduce", 3.5), ("movement", 6), ("matmul", 1), ("cast", 0.5),
                                         ("realize", 0.5), ("assign", 1.0), ("create", 0.5),
                                         ("composite", 1.5), ("cat", 1.0)]

    def generate(self) -> Program:
        rs = self.rs
        k = rs.random()
        dt = "int32" if k < 0.15 else rs.choice(["int8", "uint8", "int16", "int64"]) if k < 0.25 else "float32"
        for _ in range(rs.choice([1, 1, 2, 3])): self._commit_input(self.random_shape(), dt)
        target = rs.randint(3, 12)
        names, weights = zip(*self.FAMILIES)
        ops, tries = 0, 0
        while ops < target and tries < 300:
            tries += 1
            if self.try_line(getattr(self, rs.choices(names, weights)[0])()): ops += 1
        computed = [n for n in self.pool if n not in self.inputs]
        if not computed: self.try_line(f"{self.pool[0]} + 1") or self.try_line(f"{self.pool[0]}.cast('float32')")
        computed = [n for n in self.pool if n not in self.inputs]
        # outputs: the last value and some values nothing else reads (so most lines are computed)
        used = {w for _, e in self.prog.lines for w in e.replace("(", " ").replace(")", " ").replace(",", " ")
                .replace(".", " ").replace("[", " ").split()}
        leaves = [n for n in computed if n not in used and n != self.prog.lines[-1][0]]
        outs = [self.prog.lines[-1][0]] + rs.sample(leaves, min(len(leaves), rs.choice([1, 2, 2, 3])))
        self.prog.outputs = list(dict.fromkeys(outs))
        return self.prog

    def _commit_input(self, shape: tuple[int, ...], dt: str) -> None:
        name = self._name("x")
        e = f"make_input({shape}, '{dt}', {self.rs.randrange(10000)})"
        self.prog.lines.append((name, e))
        self.env[name] = eval(e, dict(REF_ENV))
        self.pool.append(name); self.inputs.add(name)

def generate(seed: int) -> Program: return Generator(seed).generate()

# ---------------------------------------------------------------------------------------------------------------------
# running and comparing

@dataclass
class Result:
    prog: Program
    ok: bool
    kernels: int = 0
    message: str = ""

RERUN_SALT = 1_000_003   # the second run adds this to every input's data seed

def reference(prog: Program, salt: int = 0) -> dict[str, Ref] | None:
    """Every variable of the program on the NumPy reference, or None when these inputs make a line ill-conditioned
    (the generator only vetted the unsalted inputs)."""
    env: dict[str, Any] = dict(REF_ENV, make_input=lambda s, d, seed: Ref(input_array(s, d, seed + salt)))
    try:
        for name, e in prog.lines:
            env[name] = eval(e, env)
            Generator._check(env[name])
    except (Reject, ValueError, IndexError): return None
    return env

def run_fusegrad(prog: Program, salt: int = 0) -> tuple[dict[str, np.ndarray], int]:
    """The program's outputs computed by fusegrad, and the number of kernels that ran."""
    env: dict[str, Any] = dict(FG_ENV, make_input=lambda s, d, seed: Tensor(input_array(s, d, seed + salt)))
    k0 = GlobalCounters.kernel_count
    for name, e in prog.lines: env[name] = eval(e, env)
    Tensor.realize(*{id(env[o]): env[o] for o in prog.outputs}.values())
    kernels = GlobalCounters.kernel_count - k0
    return {o: env[o].numpy() for o in prog.outputs}, kernels

def compare(prog: Program, got: dict[str, np.ndarray], ref: dict[str, Ref]) -> list[str]:
    problems = []
    for o in prog.outputs:
        exp, g = ref[o], got[o]
        if g.shape != exp.shape: problems.append(f"{o}: shape {g.shape} != expected {exp.shape}"); continue
        if _np_dtype_name(g) != exp.dt: problems.append(f"{o}: dtype {g.dtype} != expected {exp.dt}"); continue
        diff, tol = np.abs(g.astype(np.float64) - exp.v.astype(np.float64)), exp.tol()
        bad = ~(diff <= tol)
        if bad.any():
            i = np.unravel_index(np.argmax(np.where(bad, diff - tol, -np.inf)), exp.shape) if exp.shape else ()
            problems.append(f"{o}: {int(bad.sum())}/{bad.size} elements differ; at {tuple(int(x) for x in i)} got "
                            f"{g[i]!r} expected {exp.v[i]!r} (tolerance {tol[i]:.3g})\n"
                            f"  got      {np.array2string(g.ravel()[:12], precision=4)}\n"
                            f"  expected {np.array2string(exp.v.ravel()[:12], precision=4)}")
    return problems

def run_program(prog: Program, rerun: bool = True) -> Result:
    """Run the program in fusegrad and on the NumPy reference and compare every output. With `rerun`, run it again
    on new input data: the same graph over other buffers comes from the schedule cache."""
    ref = reference(prog)
    assert ref is not None, "the generator kept an ill-conditioned line"
    try: got, kernels = run_fusegrad(prog)
    except Exception: return Result(prog, False, message=f"fusegrad raised:\n{traceback.format_exc()}")
    problems = compare(prog, got, ref)
    bound = prog.n_ops + prog.self_reading_assigns
    if kernels > bound: problems.append(f"{kernels} kernels for {prog.n_ops} ops (bound {bound})")
    if rerun and not problems and (ref2 := reference(prog, RERUN_SALT)) is not None:
        tag = f"[second run, input seeds + {RERUN_SALT}]"
        try: got2, kernels2 = run_fusegrad(prog, RERUN_SALT)
        except Exception: return Result(prog, False, kernels, f"{tag} fusegrad raised:\n{traceback.format_exc()}")
        problems += [f"{tag} {p}" for p in compare(prog, got2, ref2)]
        if kernels2 != kernels: problems.append(f"{tag} {kernels2} kernels, the first run had {kernels}")
    return Result(prog, not problems, kernels, "\n".join(problems))

def report(res: Result) -> str:
    return f"fuzz program seed={res.prog.seed} failed (replay: python -m test.test_fuzz_programs " \
           f"{res.prog.seed})\n{res.prog.source()}\n--- {res.message}"

def replay(seed: int, verbose: bool = True) -> Result:
    """Regenerate and run program `seed`, printing its source and the comparison."""
    res = run_program(generate(seed))
    if verbose:
        print(res.prog.source())
        print(f"--- {'ok' if res.ok else 'FAILED'}: {res.kernels} kernels for {res.prog.n_ops} ops")
        if res.message: print(res.message)
    return res

# ---------------------------------------------------------------------------------------------------------------------
# the fuzz tests

N_FAST = 150

def test_generator_is_deterministic():
    for seed in (0, 1, 77):
        assert generate(seed).source() == generate(seed).source()

def test_comparison_catches_wrong_values():
    # the fuzzer must be able to fail: a result off by a little more than the tolerance, a transposed result and an
    # extra kernel are all reported
    prog = Program(0, [("x1", "make_input((3, 3), 'float32', 5)"), ("v2", "(x1.abs() + 1).log().sum(axis=1)"),
                       ("v3", "x1.T")], ["v2", "v3"])
    ref = reference(prog)
    assert ref is not None
    good = {"v2": ref["v2"].v.astype(np.float32), "v3": ref["v3"].v.astype(np.float32)}
    assert compare(prog, good, ref) == []
    off = dict(good, v2=good["v2"] + 2 * ref["v2"].tol().astype(np.float32))
    assert len(compare(prog, off, ref)) == 1
    assert len(compare(prog, dict(good, v3=good["v3"].T.copy()), ref)) == 1
    got, kernels = run_fusegrad(prog)
    assert compare(prog, got, ref) == [] and 1 <= kernels <= prog.n_ops == 5

@pytest.mark.parametrize("seed", range(N_FAST))
def test_fuzz_program(seed: int):
    res = run_program(generate(seed))
    assert res.ok, report(res)

@pytest.mark.slow
def test_fuzz_programs_many():
    fails = [r for r in (run_program(generate(s)) for s in range(10_000, 12_000)) if not r.ok]
    assert not fails, f"{len(fails)} of 2000 programs failed, seeds {[r.prog.seed for r in fails]}\n" + \
        "\n\n".join(report(r) for r in fails[:5])

# ---------------------------------------------------------------------------------------------------------------------
# minimized reproducers of bugs the fuzzer found (each fails until its bug is fixed)

def test_repro_zero_dim_numpy_input_keeps_its_shape():
    # the first survey: every program with a 0-d input failed (np.ascontiguousarray makes 0-d arrays 1-d)
    assert Tensor(np.array(2.5, dtype=np.float32)).shape == ()
    assert (Tensor(np.array(3, dtype=np.int32)) + 1).numpy().shape == ()

def test_repro_read_of_assign_to_2d_target_sees_new_values():
    # fuzz seeds 30, 57, 195 (first generator): a kernel reading a 2-d assign target (a RESHAPE over the ASSIGN) was
    # ordered before the assign kernel, so .numpy() returned the old values
    b = np.arange(8, dtype=np.float32).reshape(2, 4)
    t = Tensor(b.copy())
    t.assign(t.flip(1) + 1)
    np.testing.assert_array_equal(t.numpy(), b[:, ::-1] + 1)

def test_repro_assign_in_place_transpose_of_expression():
    # fuzz seeds 30, 103, 114 (and most failures with an assign): the value reads the target under an elementwise op
    # and a movement op sits above it, so element (i, j) is written before (j, i) reads it: the value must go through
    # a temporary buffer like `t.assign(t.T)` does
    a = np.arange(9, dtype=np.float32).reshape(3, 3)
    t = Tensor(a.copy())
    t.assign((t * 1).T)
    np.testing.assert_array_equal(t.numpy(), a.T)

def test_repro_assign_flip_of_expression():
    a = np.arange(4, dtype=np.float32)
    t = Tensor(a.copy())
    t.assign((-t).flip(0))
    np.testing.assert_array_equal(t.numpy(), -a[::-1])
    b = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor(b.copy())
    t.assign((t + 1).flip(1) * 2)
    np.testing.assert_array_equal(t.numpy(), (b + 1)[:, ::-1] * 2)

# The next three were one bug: the C kernels are right (right at -O1, or with -fno-tree-loop-vectorize), but gcc
# 12.2's loop vectorizer miscompiled them at -O3 -march=native (reversed loads in a nested float reduction; a
# conditional load in a short inner loop). The renderer now turns the loop vectorizer off for such kernels.

def test_repro_pad_rows():
    # fuzz seeds 246, 3293: rows 2.. of the padded output come back 0 (or garbage)
    a = np.arange(1, 17, dtype=np.float32).reshape(8, 2)
    np.testing.assert_array_equal(Tensor(a).pad(((1, 0), (0, 0))).numpy(), np.pad(a, ((1, 0), (0, 0))))

def test_repro_sum_of_flipped_rows():
    # fuzz seeds 3142, 3948: 315 instead of 300
    a = np.arange(1, 25, dtype=np.float32).reshape(4, 1, 6)
    assert Tensor(a).flip(2).sum().item() == 300.0
    b = np.arange(1, 17, dtype=np.float32).reshape(4, 4, 1, 1)
    got = Tensor(b)[:, 1::-1, 0, :].sum(axis=(0, 1, 2)).numpy()
    np.testing.assert_array_equal(got, b[:, 1::-1, 0, :].sum((0, 1, 2)))

def test_repro_pad_crop_of_broadcast():
    # fuzz seed 507: a pad that also crops (negative amounts) of an expanded tensor reads garbage
    a = np.arange(1, 17, dtype=np.float32).reshape(2, 2, 4, 1)
    got = Tensor(a).expand(2, 2, 4, 5).pad(((0, 0), (3, -1), (0, 0), (-1, 0))).numpy()
    exp = np.pad(np.broadcast_to(a, (2, 2, 4, 5))[:, :1, :, 1:], ((0, 0), (3, 0), (0, 0), (0, 0)))
    np.testing.assert_array_equal(got, exp)

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts mappings in /proc/self/maps")
def test_repro_dropped_program_unmaps_its_library():
    # a survey of 4,150 fuzz programs in one process died with "can't load the shared object ...: failed to map
    # segment" and then numpy MemoryErrors: every kernel keeps its shared object mapped (~5 mappings each, never
    # dlclose'd) and the method cache keeps every kernel, so ~13,000 distinct kernels exhaust vm.max_map_count
    # (65530). Evicting kernels only helps once a dropped program gives its mappings back.
    import gc
    from fusegrad.device import Device
    dev = Device["CPU"]
    lib = dev.compiler.compile_cached("void f(float* restrict d0, long lo, long hi) { d0[0] = 1.0f; }")
    def n_maps() -> int:
        with open("/proc/self/maps") as f: return sum(1 for _ in f)
    gc.collect()
    base = n_maps()
    # (100 distinct binaries: programs of the same bytes share one load; bytes past the end of an ELF file are ignored)
    progs = [dev.runtime("f", lib + b"\0" * (i + 1)) for i in range(100)]
    assert n_maps() - base >= 100, "each loaded binary should be mapped"
    del progs
    gc.collect()
    assert n_maps() - base < 20, f"{n_maps() - base} mappings left after dropping 100 programs"

if __name__ == "__main__":
    if len(sys.argv) > 1:
        for s in sys.argv[1:]: replay(int(s))
    else:   # survey: run many seeds, print the failing ones
        st, n = time.perf_counter(), 300
        failing = [s for s in range(n) if not run_program(generate(s)).ok]
        print(f"{n} programs in {time.perf_counter() - st:.1f}s, failing seeds: {failing}")
