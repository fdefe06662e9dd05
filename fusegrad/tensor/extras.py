"""The rest of tinygrad's Tensor API: constants and raw ALU ops, symbolic-size helpers, parameter marking, hashing
(Keccak / SHA-3 computed in kernels), linear algebra (QR, SVD), downloads, and custom kernels."""
from __future__ import annotations
import functools
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import fetch, prod
from fusegrad.uop.ops import GroupOp, Ops, UOp

if TYPE_CHECKING:
    from fusegrad.tensor import Tensor

def _T() -> type:
    from fusegrad.tensor import Tensor
    return Tensor

# *** Keccak-f[1600] constants ***

_RC = [0x0000000000000001, 0x0000000000008082, 0x800000000000808A, 0x8000000080008000, 0x000000000000808B,
       0x0000000080000001, 0x8000000080008081, 0x8000000000008009, 0x000000000000008A, 0x0000000000000088,
       0x0000000080008009, 0x000000008000000A, 0x000000008000808B, 0x800000000000008B, 0x8000000000008089,
       0x8000000000008003, 0x8000000000008002, 0x8000000000000080, 0x000000000000800A, 0x800000008000000A,
       0x8000000080008081, 0x8000000000008080, 0x0000000080000001, 0x8000000080008008]
# rotation of lane x + 5y
_ROT = [0, 1, 62, 28, 27, 36, 44, 6, 55, 20, 3, 10, 43, 25, 39, 41, 45, 15, 21, 8, 18, 2, 61, 56, 14]
# pi: lane x + 5y moves to y + 5 * ((2x + 3y) % 5); as a gather, the source of each destination
_PI_SRC = [0] * 25
for _x in range(5):
    for _y in range(5): _PI_SRC[_y + 5 * ((2 * _x + 3 * _y) % 5)] = _x + 5 * _y
_SHA3 = {"sha3_224": (144, 28), "sha3_256": (136, 32), "sha3_384": (104, 48), "sha3_512": (72, 64)}

# Errors of the types torch and tinygrad raise, which programs catch, that are also the types raised here before (so
# `except ValueError` and `except TypeError` keep working)
class ShapeError(RuntimeError, ValueError):
    """Shapes an op can't take: matmul's inner dims or 0-d operands, a reshape to another size, a bad permutation."""

class OperandTypeError(RuntimeError, TypeError):
    """An operand dtype an op doesn't take: shifts and bitwise ops of floats."""

class EmptyReductionError(IndexError, ValueError):
    """A reduction without an identity (max, min, argmax) over an empty dimension."""

class ExtrasMixin:
    """tinygrad-compatible odds and ends that don't belong to one op family."""
    __slots__ = ()

    # *** constants and raw ops ***

    @classmethod
    def const(cls, b: Any, dtype: DType | str | None = None) -> Tensor:
        """A 0-d tensor holding the Python number `b` (dtype inferred like Tensor(b) when not given)."""
        return _T()(b, dtype=dtype)

    def alu(self: Tensor, op: Ops, *src: Tensor) -> Tensor:
        """Apply the elementwise UOp `op` to this tensor and `src` (broadcast together; comparisons give bool)."""
        if op not in GroupOp.ALU: raise ValueError(f"alu needs an elementwise op, got {op}")
        from fusegrad.tensor import _broadcast_shape
        T = _T()
        srcs = [s if isinstance(s, T) else T(s, dtype=self.dtype, device=self.device) for s in src]
        shape = _broadcast_shape(self.shape, *(s.shape for s in srcs))
        xs = [t.expand(shape) if t.shape != shape else t for t in (self, *srcs)]
        dt = dtypes.bool if op in GroupOp.Comparison else xs[-1].dtype
        return T(UOp(op, dt, tuple(x.uop for x in xs)))

    def ufix(self: Tensor, x: Any) -> Tensor:
        """`x` as a tensor on this tensor's device with its dtype (a float number with an int tensor gives the
        default float, as arithmetic would)."""
        T = _T()
        if isinstance(x, T): return x
        if isinstance(x, UOp): x = x.arg if x.op is Ops.CONST else x
        dt = dtypes.default_float if isinstance(x, float) and not dtypes.is_float(self.dtype) else self.dtype
        return T(x, dtype=dt, device=self.device)

    def usum(self: Tensor, *uops: Any) -> Tensor:
        """This tensor plus every argument (tensors, numbers or symbolic ints), broadcast."""
        return functools.reduce(lambda acc, x: acc + acc.ufix(x), uops, self)

    def uprod(self: Tensor, *uops: Any) -> Tensor:
        """This tensor times every argument (tensors, numbers or symbolic ints), broadcast."""
        return functools.reduce(lambda acc, x: acc * acc.ufix(x), uops, self)

    @property
    def max_shape(self: Tensor) -> tuple[int, ...]:
        """The shape with each symbolic dimension at the largest value its variables allow."""
        return tuple(s if isinstance(s, int) else int(s.vmax) for s in self.shape)

    def max_numel(self: Tensor) -> int:
        """The number of elements at max_shape."""
        return prod(self.max_shape)

    def contiguous_backward(self: Tensor) -> Tensor:
        """The same values; the gradient flowing back through this point is materialized (contiguous)."""
        return _T()(UOp(Ops.CONTIGUOUS_BACKWARD, self.dtype, (self.uop,)))

    @classmethod
    def invalids(cls, *shape: Any, device: str | None = None, dtype: DType | str | None = None) -> Tensor:
        """A tensor whose values are undefined (memory is allocated, not initialized), like empty."""
        return _T().empty(*shape, device=device, dtype=dtype)

    @property
    def is_param(self: Tensor) -> bool:
        """Whether this tensor is marked as a model parameter (is_param_)."""
        ref = _PARAMS.get(id(self))
        return ref is not None and ref() is self

    def is_param_(self: Tensor, is_param: bool = True) -> Tensor:
        """Mark (or unmark) this tensor as a model parameter, in place."""
        key = id(self)
        if is_param: _PARAMS[key] = weakref.ref(self, lambda _r: _PARAMS.pop(key, None))
        else: _PARAMS.pop(key, None)
        return self

    # *** hashing ***

    def keccak(self: Tensor, cfg: str | tuple[int, int] = "sha3_256") -> Tensor:
        """SHA-3 of the bytes of each row (the last dim, as uint8), computed in kernels: (..., n) -> (..., out).
        cfg is a name (sha3_224/256/384/512) or (rate in bytes, output bytes) with SHA-3's domain padding."""
        T = _T()
        rate, out_bytes = _SHA3[cfg] if isinstance(cfg, str) and cfg in _SHA3 else cfg if isinstance(cfg, tuple) \
            else (None, None)
        if rate is None: raise ValueError(f"unknown keccak cfg {cfg!r}; use one of {sorted(_SHA3)} or (rate, out)")
        if rate % 8 or not 0 < rate < 200 or out_bytes > rate:
            raise ValueError(f"keccak rate must be a multiple of 8 below 200 and >= the output size, got {cfg}")
        data = self if self.dtype == dtypes.uint8 else self.contiguous().bitcast_bytes()
        lead, n = data.shape[:-1], data.shape[-1] if data.ndim else 1
        data = data.reshape(*lead, n)
        nblocks = n // rate + 1
        pad = nblocks * rate - n
        tail = [0x06] + [0] * (pad - 1)
        tail[-1] |= 0x80
        padded = data.cat(T(tail, dtype=dtypes.uint8, device=self.device).expand(*lead, pad), dim=-1)
        shifts = T([8 * k for k in range(8)], dtype=dtypes.uint64, device=self.device)
        lanes = (padded.reshape(*lead, nblocks, rate // 8, 8).cast(dtypes.uint64) << shifts).sum(-1,
                                                                                                  dtype=dtypes.uint64)
        state = T.zeros(*lead, 25, dtype=dtypes.uint64, device=self.device)
        for b in range(nblocks):
            block = lanes[..., b, :].pad(((0, 0),) * len(lead) + ((0, 25 - rate // 8),))
            state = _keccak_f(state ^ block)
        out_lanes = state[..., :(out_bytes + 7) // 8]
        out = ((out_lanes.unsqueeze(-1) >> shifts) & 255).cast(dtypes.uint8).reshape(*lead, -1)
        return out[..., :out_bytes]

    def hash(self: Tensor) -> Tensor:
        """A 32-byte SHA3-256 digest of the whole tensor's bytes (row-major), as a (32,) uint8 tensor."""
        return self.contiguous().bitcast_bytes().flatten().keccak("sha3_256")

    def bitcast_bytes(self: Tensor) -> Tensor:
        """The little-endian bytes of each element: (..., ) -> (..., itemsize) uint8."""
        T = _T()
        size = self.dtype.itemsize
        if self.dtype == dtypes.uint8: return self.unsqueeze(-1)
        if self.dtype == dtypes.bool: return self.cast(dtypes.uint8).unsqueeze(-1)
        as_uint = {1: dtypes.uint8, 2: dtypes.uint16, 4: dtypes.uint32, 8: dtypes.uint64}[size]
        u = self.bitcast(as_uint).cast(dtypes.uint64).unsqueeze(-1)
        shifts = T([8 * k for k in range(size)], dtype=dtypes.uint64, device=self.device)
        return ((u >> shifts) & 255).cast(dtypes.uint8)

    # *** linear algebra ***

    def qr(self: Tensor) -> tuple[Tensor, Tensor]:
        """Reduced QR decomposition of the last two dims (m x n): Q (m x k) with orthonormal columns and R (k x n)
        upper triangular, k = min(m, n), by Householder reflections (batched over leading dims)."""
        if self.ndim < 2: raise ValueError(f"qr needs at least 2 dims, got shape {self.shape}")
        if not dtypes.is_float(self.dtype): raise TypeError(f"qr needs a float tensor, got {self.dtype}")
        T = _T()
        *lead, m, n = self.shape
        k = min(m, n)
        R, Q = self, T.eye(m, dtype=self.dtype, device=self.device).expand(*lead, m, m)
        rows = T.arange(m, device=self.device).reshape(m, 1)
        for j in range(k):
            col = R[..., :, j:j + 1] * (rows >= j)  # (..., m, 1), zero above the diagonal
            sign = (col[..., j:j + 1, :] >= 0).where(1.0, -1.0)
            alpha = -sign * col.square().sum(-2, True).sqrt()
            v = col - alpha * (rows == j)
            vnorm = v.square().sum(-2, True)
            h = (vnorm > 0).where(2.0 / vnorm.maximum(1e-30), 0.0)
            R = (R - v * (h * (v.transpose(-1, -2) @ R))).realize()
            Q = (Q - (Q @ v) * h * v.transpose(-1, -2)).realize()
        return Q[..., :, :k], R[..., :k, :].triu()

    def svd(self: Tensor, full_matrices: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """U, S, Vh with self = U @ diag(S) @ Vh over the last two dims (singular values descending), by one-sided
        Jacobi rotations on the columns: sweeps until the columns are orthogonal. full_matrices=False gives the
        reduced factors (U m x k, Vh k x n); True completes U and Vh to square orthogonal matrices."""
        if self.ndim < 2: raise ValueError(f"svd needs at least 2 dims, got shape {self.shape}")
        if not dtypes.is_float(self.dtype): raise TypeError(f"svd needs a float tensor, got {self.dtype}")
        T = _T()
        *lead, m, n = self.shape
        if m < n:
            U, S, Vh = self.transpose(-1, -2).svd(full_matrices)
            return Vh.transpose(-1, -2), S, U.transpose(-1, -2)
        A = self.cast(dtypes.float64) if self.dtype != dtypes.float64 else self
        V = T.eye(n, dtype=A.dtype, device=self.device).expand(*lead, n, n).contiguous()
        pairs = [(p, q) for p in range(n) for q in range(p + 1, n)]
        for _ in range(max(6, int(2 * math.log2(max(n, 2))) + 4)):
            for p, q in pairs:
                a, b = A[..., :, p:p + 1], A[..., :, q:q + 1]
                alpha, beta, gamma = a.square().sum(-2, True), b.square().sum(-2, True), (a * b).sum(-2, True)
                zeta = (beta - alpha) / (2 * gamma.where(gamma, 1e-300))
                t = zeta.sign().where(zeta.sign(), 1.0) / (zeta.abs() + (1 + zeta.square()).sqrt())
                t = (gamma.abs() > 1e-300).where(t, 0.0)
                c = 1 / (1 + t.square()).sqrt()
                s = c * t
                A = _rotate_cols(A, p, q, c, s).realize()
                V = _rotate_cols(V, p, q, c, s).realize()
        S = A.square().sum(-2).sqrt()  # (..., n)
        order = S.argsort(-1, descending=True)
        S = S.gather(-1, order)
        U = A.gather(-1, order.unsqueeze(-2).expand(*lead, m, n)) / S.unsqueeze(-2).maximum(1e-300)
        V = V.gather(-1, order.unsqueeze(-2).expand(*lead, n, n))
        if full_matrices and m > n:
            Qf, _ = U.cat(T.eye(m, dtype=U.dtype, device=self.device)[:, :m - n].expand(*lead, m, m - n), dim=-1).qr()
            U = U.cat(Qf[..., :, n:], dim=-1)
        return U.cast(self.dtype), S.cast(self.dtype), V.transpose(-1, -2).cast(self.dtype)

    # *** downloads ***

    @staticmethod
    def from_url(url: str, gunzip: bool = False, **kwargs: Any) -> Tensor:
        """The bytes at `url` as a uint8 tensor, downloaded once into the cache directory (keyed by the URL, see
        helpers.fetch) and read from there afterwards; gunzip=True decompresses them. Keywords go to the Tensor (e.g.
        device)."""
        T = _T()
        device = kwargs.pop("device", None)
        if kwargs: raise TypeError(f"from_url got unexpected keyword arguments {sorted(kwargs)}")
        raw = fetch(url, gunzip=gunzip).read_bytes()
        from fusegrad.tensor import _canonical_device
        return T(T._from_bytes(memoryview(raw), (len(raw),), dtypes.uint8, _canonical_device(device)))

    # *** custom kernels ***

    def custom_kernel(self: Tensor, *lst: Tensor, fxn: Callable, grad_fxn: Callable | None = None) -> list[Tensor]:
        """Compute `fxn(self, *lst)` (a function of tensors returning a tensor or a list of them) as its own kernels:
        each output is realized as a separate buffer (a fusion boundary). With grad_fxn, backward doesn't
        differentiate fxn: the gradients of the inputs from each output are grad_fxn(grad_output, *inputs), a
        tensor or a tuple with one tensor (or None) per input."""
        T = _T()
        ins = (self,) + lst
        outs = fxn(*ins)
        outs = [outs] if isinstance(outs, T) else list(outs)
        if grad_fxn is None: return [o.contiguous() for o in outs]
        return [T(UOp(Ops.CUSTOM_GRAD, o.dtype, (o.detach().uop, *(x.uop for x in ins)), _UserGradient(grad_fxn, ins)))
                .contiguous() for o in outs]

    def call(self: Tensor, *lst: Tensor, fxn: Any, grad_fxn: Callable | None = None) -> Tensor:
        """Apply a function (a callable on tensors) to this tensor and `lst` as one fusion unit: see custom_kernel."""
        if not callable(fxn): raise TypeError("call needs a callable fxn (a function of tensors)")
        return self.custom_kernel(*lst, fxn=fxn, grad_fxn=grad_fxn)[0]

    def callify(self: Tensor, *lst: Tensor) -> Tensor:
        """This tensor's value as a single kernel output (the graph so far becomes one realized unit)."""
        return self.contiguous()

    def linear_with_vars(self: Tensor, *lst: Tensor) -> tuple[UOp, dict[str, int]]:
        """The kernels computing these tensors (a SINK of their kernel ASTs) and the values of the bound Variables
        they use. Scheduling them realizes the tensors' inputs; the tensors themselves stay unrealized."""
        items = self.contiguous().schedule(*[t.contiguous() for t in lst])
        return UOp.sink_of(*[si.ast for si in items]), {k: v for si in items for k, v in si.fixedvars.items()}

    def schedule_linear(self: Tensor, *lst: Tensor) -> UOp:
        """The kernels computing these tensors as one SINK of kernel ASTs (see linear_with_vars)."""
        return self.linear_with_vars(*lst)[0]

class _UserGradient:
    """The gradient rule of a custom_kernel output: calls grad_fxn on tensors and checks what it returns."""
    def __init__(self, fn: Callable, ins: tuple): self.fn, self.n = fn, len(ins)

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp | None, ...]:
        T = _T()
        gs = self.fn(T(grad), *[T(u) for u in ins])
        gs = (gs,) if isinstance(gs, T) or gs is None else tuple(gs)
        if len(gs) != len(ins):
            raise ValueError(f"custom_kernel grad_fxn returned {len(gs)} gradients for {len(ins)} inputs")
        for g, u in zip(gs, ins):
            if g is not None and g.shape != u.shape:
                raise ValueError(f"custom_kernel grad_fxn returned a gradient of shape {g.shape} for an input of "
                                 f"shape {u.shape}")
        return tuple(None if g is None else g.cast(u.dtype).uop for g, u in zip(gs, ins))

# tensors marked with is_param_, by id (Tensor compares elementwise, so it can't key a set); entries leave with them
_PARAMS: dict[int, weakref.ref] = {}

def _rotl(x: Tensor, amounts: Tensor) -> Tensor:
    return (x << amounts) | (x >> ((64 - amounts) & 63))

def _keccak_f(state: Tensor) -> Tensor:
    """The 24 rounds of Keccak-f[1600] on (..., 25) uint64 lanes (lane x + 5y); one realized tensor per round."""
    T = _T()
    dev, lead = state.device, state.shape[:-1]
    rot = T(_ROT, dtype=dtypes.uint64, device=dev)
    pi = T(_PI_SRC, dtype=dtypes.int32, device=dev)
    one = T([1] * 5, dtype=dtypes.uint64, device=dev)
    for rc in _RC:
        a = state.reshape(*lead, 5, 5)  # [y][x]
        c = a[..., 0, :] ^ a[..., 1, :] ^ a[..., 2, :] ^ a[..., 3, :] ^ a[..., 4, :]  # (..., 5) over x
        c_left, c_right = c.roll(1, -1), c.roll(-1, -1)  # c[x-1], c[x+1]
        d = c_left ^ _rotl(c_right, one)
        a = (a ^ d.unsqueeze(-2)).reshape(*lead, 25)
        b = _rotl(a, rot).gather(-1, pi.expand(*lead, 25)).reshape(*lead, 5, 5)
        a = b ^ (~b.roll(-1, -1) & b.roll(-2, -1))
        lane0 = T([rc] + [0] * 24, dtype=dtypes.uint64, device=dev)
        state = (a.reshape(*lead, 25) ^ lane0).realize()
    return state

def _rotate_cols(M: Tensor, p: int, q: int, c: Tensor, s: Tensor) -> Tensor:
    """M with columns p and q replaced by c*a - s*b and s*a + c*b."""
    a, b = M[..., :, p:p + 1], M[..., :, q:q + 1]
    na, nb = c * a - s * b, s * a + c * b
    n = M.shape[-1]
    cols = [na if j == p else nb if j == q else M[..., :, j:j + 1] for j in range(n)]
    return cols[0].cat(*cols[1:], dim=-1) if n > 1 else cols[0]
