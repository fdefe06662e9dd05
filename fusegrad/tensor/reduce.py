"""Reductions beyond sum/max/mean: statistics, scans, sorting and selection."""
from __future__ import annotations
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence
from fusegrad.tensor.composite import composite
from fusegrad.dtype import DType, dtypes, least_upper_float, sum_acc_dtype, to_dtype
from fusegrad.gradient import IndexGradient, with_gradient
from fusegrad.helpers import prod

if TYPE_CHECKING: from fusegrad.tensor import Tensor

# scans of up to this many elements are one fused reduce over a triangular window (n*n work); longer ones are split
# into blocks of about sqrt(n) scanned the same way, plus a scan of the block totals
_SCAN_WINDOW = 64

def _resolve(axis: int, ndim: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise IndexError(f"axis {axis} is out of range for a tensor with {ndim} dimensions")
    return axis + ndim if axis < 0 else axis

def _iota(n: int, like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """0..n-1 (int32) laid along the dim of `shape` whose size is n and which is not 1 (shape has one such dim)."""
    from fusegrad.tensor import Tensor
    return Tensor.arange(n, dtype=dtypes.int32, device=like.device).reshape(shape)

def _window(x: Tensor) -> tuple[Tensor, Tensor]:
    """For x of shape (..., n): w[..., i, j] = x[..., j] and the mask j <= i (both (..., n, n))."""
    n = x.shape[-1]
    w = x.unsqueeze(-2).expand(x.shape[:-1] + (n, n))
    mask = _iota(n, x, (1, n)) <= _iota(n, x, (n, 1))
    return w, mask

def _scan_last(x: Tensor, window: Callable[[Tensor, Tensor], Tensor], combine: Callable[[Tensor, Tensor], Tensor],
               identity: Any) -> Tensor:
    """Inclusive scan along the last axis. window(w, mask) scans a short row through its triangular window;
    combine(a, b) merges a running value with one before it. O(log log n) levels of a few kernels each."""
    n = x.shape[-1]
    if n <= _SCAN_WINDOW: return window(*_window(x))
    size = math.isqrt(n - 1) + 1
    blocks = -(-n // size)
    padded = x.pad(((0, 0),) * (x.ndim - 1) + ((0, blocks * size - n),), value=identity)
    inner = _scan_last(padded.reshape(x.shape[:-1] + (blocks, size)), window, combine, identity)
    totals = _scan_last(inner[..., -1], window, combine, identity)
    # the running value of everything before each block: the block totals' scan shifted right by one
    before = totals.pad(((0, 0),) * (x.ndim - 1) + ((1, -1),), value=identity).unsqueeze(-1)
    first = _iota(blocks, x, (blocks, 1)) == 0
    out = first.where(inner, combine(inner, before))
    return out.reshape(x.shape[:-1] + (blocks * size,))[..., :n]

# rows up to this long are sorted by counting, for each element, the elements that go before it (n*n work in two
# kernels); longer ones by a bitonic network (log2(n)^2 / 2 steps of n work, two kernels each)
_SORT_COUNT_LIMIT = 4096

def _bitonic(x: Tensor, descending: bool) -> tuple[Tensor, Tensor]:
    """(values, indices) of x (..., n) sorted along its last axis; stable, since ties are ordered by index."""
    from fusegrad.tensor import Tensor
    n = x.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    lead = x.shape[:-1]
    key = x.pad(((0, 0),) * len(lead) + ((0, size - n),))
    idx = Tensor.arange(size, dtype=dtypes.int32, device=x.device).reshape((1,) * len(lead) + (size,)).expand(
        lead + (size,))
    packed = _pack(key, idx)
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            key, idx = _unpack(packed, x.dtype)
            shp = lead + (size // (2 * j), 2, j)
            kk, ii = key.reshape(shp), idx.reshape(shp)
            lo_k, hi_k, lo_i, hi_i = kk[..., 0, :], kk[..., 1, :], ii[..., 0, :], ii[..., 1, :]
            # pairs in blocks whose bit k is set sort the other way, so that each 2k block is bitonic for the next k
            block_desc = ((_iota(size // (2 * j), x, (size // (2 * j), 1)) // (k // (2 * j))) % 2) == 1
            swap = block_desc.where(_before_padded(lo_k, hi_k, lo_i, hi_i, n, descending),
                                    _before_padded(hi_k, lo_k, hi_i, lo_i, n, descending))
            key = _stack2(swap.where(hi_k, lo_k), swap.where(lo_k, hi_k), -2)
            idx = _stack2(swap.where(hi_i, lo_i), swap.where(lo_i, hi_i), -2)
            packed = _pack(key.reshape(lead + (size,)), idx.reshape(lead + (size,)))
            j //= 2
        k *= 2
    key, idx = _unpack(packed, x.dtype)
    return key[..., :n], idx[..., :n]

def _before_padded(a: Tensor, b: Tensor, ia: Tensor, ib: Tensor, n: int, descending: bool) -> Tensor:
    """_order_before with the padding (indices >= n) after every element."""
    pa, pb = ia >= n, ib >= n
    return (pa.logical_not() & pb) | ((pa | pb).logical_not() & _order_before(a, b, ia, ib, descending))

def _carrier(dt: DType) -> DType:
    """The dtype that holds both a value of dtype dt (exactly) and an int32 index (as bits or as a number)."""
    if dtypes.is_float(dt): return dtypes.float64 if dt.itemsize == 8 else dtypes.float32
    return dtypes.int64 if dt.itemsize == 8 or dt == dtypes.uint32 else dtypes.int32

def _pack(vals: Tensor, idx: Tensor) -> Tensor:
    """vals and int32 idx (same shape) stacked in one contiguous tensor of shape (..., 2), so that both are realized
    by the same kernel: realizing one of them alone must not leave the other reading buffers that memory planning
    has since reused."""
    c = _carrier(vals.dtype)
    if dtypes.is_float(c): i = idx.bitcast(c) if c == dtypes.float32 else idx.cast(dtypes.int64).bitcast(c)
    else: i = idx.cast(c)
    v = vals.bitcast(c) if vals.dtype == dtypes.uint64 else vals.cast(c)
    return _stack2(v, i, -1).contiguous()

def _stack2(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """a and b (same shape and dtype) stacked along a new axis at dim (-1 or -2) by selection: exact for every value
    (cat adds zero padding, which turns -0.0 into +0.0)."""
    shape = (2, 1) if dim == -2 else (2,)
    first = _iota(2, a, shape) == 0
    return first.where(a.unsqueeze(dim), b.unsqueeze(dim))

def _unpack(packed: Tensor, dt: DType) -> tuple[Tensor, Tensor]:
    v, i = packed[..., 0], packed[..., 1]
    if packed.dtype == dtypes.float32: i = i.bitcast(dtypes.int32)
    elif packed.dtype == dtypes.float64: i = i.bitcast(dtypes.int64)
    return (v.bitcast(dt) if dt == dtypes.uint64 else v.cast(dt)), i.cast(dtypes.int32)

def _paired(vals: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]: return _unpack(_pack(vals, idx), vals.dtype)

def _on_axis(x: Tensor, axis: int, fn: Callable[[Tensor], Any]) -> Any:
    """fn applied along `axis` (moved last, then back); fn returns a tensor or a tuple of them."""
    if x.ndim == 0: return _squeeze0(fn(x.reshape(1)))
    ax = _resolve(axis, x.ndim)
    moved = x.transpose(ax, -1) if ax != x.ndim - 1 else x
    ret = fn(moved)
    back = (lambda t: t.transpose(ax, -1)) if ax != x.ndim - 1 else (lambda t: t)
    return tuple(back(t) for t in ret) if isinstance(ret, tuple) else back(ret)

def _squeeze0(ret: Any) -> Any:
    return tuple(t.reshape(()) for t in ret) if isinstance(ret, tuple) else ret.reshape(())

def _lowest(dt: DType) -> Any: return float("-inf") if dtypes.is_float(dt) else dtypes.min(dt)

def _cummax_last(x: Tensor) -> Tensor:
    return _scan_last(x, lambda w, m: m.where(w, _lowest(x.dtype)).max(-1), lambda a, b: a.maximum(b),
                      _lowest(x.dtype))

def _cumsum_last(x: Tensor) -> Tensor:
    return _scan_last(x, lambda w, m: m.where(w, 0).sum(-1, dtype=x.dtype), lambda a, b: a + b, 0)

def _order_before(a: Tensor, b: Tensor, ia: Tensor, ib: Tensor, descending: bool) -> Tensor:
    """True where element a (at index ia) comes before element b in a stable sort; nan sorts as the largest."""
    strict = (a > b) if descending else (a < b)
    tie = a == b
    if dtypes.is_float(a.dtype):
        na, nb = a.isnan(), b.isnan()
        strict = strict | ((na & nb.logical_not()) if descending else (na.logical_not() & nb))
        tie = tie | (na & nb)
    return strict | (tie & (ia < ib))

class ReduceMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()

    # *** reductions ***

    def prod(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False,
             dtype: DType | str | None = None) -> Tensor:
        """Product of the elements over `axis`, in `dtype` if given, else in the tensor's own dtype as tinygrad does
        (an int8 product wraps in int8; a bool product is `all`). torch's upcast to int64 is `dtype=dtypes.int64`."""
        acc = to_dtype(dtype) if dtype is not None else self.dtype
        if acc == dtypes.bool: return self.all(axis, keepdim)
        return self.cast(acc)._reduce(_ops().MUL, axis, keepdim)

    def any(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """True where any element over `axis` is nonzero (False over an empty axis)."""
        if any(self.shape[a] == 0 for a in self._reduce_axes(axis)):
            # a max has no identity, but a count does
            return self.bool().cast(dtypes.int32).sum(axis, keepdim) > 0
        return self.bool()._reduce(_ops().MAX, axis, keepdim)
    def all(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """True where every element over `axis` is nonzero (True over an empty axis)."""
        return self.logical_not().any(axis, keepdim).logical_not()

    def _float_stat_input(self: Any, name: str) -> Tensor:
        if not dtypes.is_float(self.dtype): raise TypeError(f"{name} needs a floating point tensor, got {self.dtype}")
        return self.cast(dtypes.float32) if self.dtype.itemsize < 4 else self
    @composite(shaped=True)
    def var(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
        """Variance over `axis` with `correction` (1: Bessel's); inf or nan where n <= correction, as torch."""
        x = self._float_stat_input("var")
        n = prod(self.shape[a] for a in self._reduce_axes(axis))
        sq = (x - x.mean(axis, keepdim=True)).square().sum(axis, keepdim)
        return (sq / max(0, n - correction)).cast(self.dtype)
    @composite(shaped=True)
    def std(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
        """Standard deviation over `axis` with `correction`."""
        return self._float_stat_input("std").var(axis, keepdim, correction).sqrt().cast(self.dtype)
    def var_mean(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False,
                 correction: int = 1) -> tuple[Tensor, Tensor]:
        """(variance, mean) over `axis`."""
        return self.var(axis, keepdim, correction), self._float_stat_input("var_mean").mean(axis, keepdim) \
            .cast(self.dtype)
    def std_mean(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False,
                 correction: int = 1) -> tuple[Tensor, Tensor]:
        """(standard deviation, mean) over `axis`."""
        return self.std(axis, keepdim, correction), self._float_stat_input("std_mean").mean(axis, keepdim) \
            .cast(self.dtype)

    @composite(shaped=True)
    def logsumexp(self: Any, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
        """log(sum(exp(x))) over `axis`, shifted by the maximum so it can't overflow."""
        x = self.cast(least_upper_float(self.dtype))
        axes = self._reduce_axes(axis)
        if any(self.shape[a] == 0 for a in axes): return x.sum(axis, keepdim).full_like(float("-inf"))
        # an infinite maximum would make x - m nan: shift by 0 there
        m = x.max(axis, keepdim=True).detach()
        m = m.isinf().where(0.0, m)
        ret = (x - m).exp().sum(axis, keepdim=True).log() + m
        return ret if keepdim else ret.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))

    def softmin(self: Any, axis: int = -1, dtype: DType | str | None = None) -> Tensor:
        """softmax of -x along `axis`."""
        return (-self).softmax(axis, dtype)

    # *** scans ***

    @composite(shaped=True)
    def cumsum(self: Any, axis: int = 0) -> Tensor:
        """Running sum along `axis` (ints and bools accumulate in the sum's integer dtype)."""
        acc = sum_acc_dtype(self.dtype)
        ret = _on_axis(self.cast(acc), axis, _cumsum_last)
        return ret.cast(self.dtype) if self.dtype in (dtypes.float16, dtypes.bfloat16) else ret
    def cumprod(self: Any, axis: int) -> Tensor:
        """Running product along `axis`."""
        acc = self.dtype if dtypes.is_float(self.dtype) else sum_acc_dtype(self.dtype)
        return _on_axis(self.cast(acc), axis, lambda x: _scan_last(
            x, lambda w, m: m.where(w, 1).prod(-1), lambda a, b: a * b, 1))
    def cummax(self: Any, axis: int = 0) -> tuple[Tensor, Tensor]:
        """(running maximum, index of the element it came from: the last such, or the last nan) along `axis`."""
        return _on_axis(self, axis, lambda x: _cum_extreme(x, True))
    def cummin(self: Any, axis: int = 0) -> tuple[Tensor, Tensor]:
        """(running minimum, index of the element it came from: the last such, or the last nan) along `axis`."""
        return _on_axis(self, axis, lambda x: _cum_extreme(x, False))
    def logcumsumexp(self: Any, axis: int = 0) -> Tensor:
        """log(cumsum(exp(x))) along `axis`, each prefix shifted by its own maximum."""
        def window(w: Tensor, mask: Tensor) -> Tensor:
            m = mask.where(w, float("-inf")).max(-1, keepdim=True).detach()
            m = m.isinf().where(0.0, m)
            return mask.where((w - m).exp(), 0.0).sum(-1).log() + m.squeeze(-1)
        x = self.cast(least_upper_float(self.dtype))
        return _on_axis(x, axis, lambda t: _scan_last(t, window, lambda a, b: a.logaddexp(b), float("-inf")))

    # *** sorting and selection ***

    def _ranks(self: Any, descending: bool) -> Tensor:
        """For x of shape (..., n): each element's position in the stable sort of its row (int32)."""
        n = self.shape[-1]
        xi, xj = self.unsqueeze(-1), self.unsqueeze(-2)
        ii, jj = _iota(n, self, (n, 1)), _iota(n, self, (1, n))
        return _order_before(xj, xi, jj, ii, descending).cast(dtypes.int32).sum(-1, dtype=dtypes.int32)
    def _take_ranks(self: Any, ranks: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The elements of ranks 0..k-1 of each row and their indices."""
        n = self.shape[-1]
        hit = ranks.unsqueeze(-2) == _iota(k, self, (k, 1))  # (..., k, n): element i has rank r
        x = self.cast(dtypes.int32) if self.dtype == dtypes.bool else self
        vals = hit.where(x.unsqueeze(-2), 0).sum(-1, dtype=x.dtype)
        if dtypes.is_float(x.dtype):
            # exactly one element per rank: summing its bits keeps -0.0 (a float sum would give +0.0); the float sum
            # only carries the gradient, as a zero term
            it = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}[x.dtype.itemsize]
            bits = hit.where(x.detach().bitcast(it).unsqueeze(-2), 0).sum(-1, dtype=it).bitcast(x.dtype)
            vd = vals.detach()
            vals = bits - vd.isfinite().where(vd - vals, 0.0)
        idx = hit.where(_iota(n, self, (1, n)), 0).sum(-1, dtype=dtypes.int32)
        return _paired(vals.cast(self.dtype), idx)

    def sort(self: Any, dim: int = -1, descending: bool = False) -> tuple[Tensor, Tensor]:
        """(sorted values, their original indices) along `dim`; stable, nan sorts as the largest."""
        def fn(x: Tensor) -> tuple[Tensor, Tensor]:
            if x.shape[-1] > _SORT_COUNT_LIMIT: return _bitonic(x, descending)
            return x._take_ranks(x._ranks(descending), x.shape[-1])
        return _on_axis(self, dim, fn)
    def argsort(self: Any, dim: int = -1, descending: bool = False) -> Tensor:
        """The indices that sort the tensor along `dim` (stable)."""
        return self.sort(dim, descending)[1]
    def topk(self: Any, k: int, dim: int = -1, largest: bool = True, sorted_: bool = True) -> tuple[Tensor, Tensor]:
        """(the k largest (or smallest) values along `dim`, their indices), in sorted order."""
        n = self.shape[_resolve(dim, self.ndim)] if self.ndim else 1
        if not isinstance(k, int) or isinstance(k, bool): raise TypeError(f"topk k must be an int, got {k!r}")
        if not 0 <= k <= n: raise ValueError(f"topk k={k} is out of range for a dimension of size {n}")
        def fn(x: Tensor) -> tuple[Tensor, Tensor]:
            if x.shape[-1] > _SORT_COUNT_LIMIT:
                vals, idx = _bitonic(x, largest)
                return vals[..., :k], idx[..., :k]
            return x._take_ranks(x._ranks(largest), k)
        return _on_axis(self, dim, fn)

def _cum_extreme(x: Tensor, is_max: bool) -> tuple[Tensor, Tensor]:
    """Running max (or min) of x along its last axis and the index it came from."""
    n = x.shape[-1]
    if x.dtype == dtypes.bool: key = x.cast(dtypes.int32) if is_max else x.logical_not().cast(dtypes.int32)
    elif dtypes.is_float(x.dtype): key = x if is_max else -x
    else: key = x if is_max else ~x
    vals = _cummax_last(key)
    if dtypes.is_float(x.dtype):
        # a nan stays the running value from where it appears (and its index is the last nan's)
        vals = _cummax_last(key.isnan().cast(dtypes.int32)).cast(dtypes.bool).where(float("nan"), vals)
    # the index: the last j <= i where x_j equals the running value at j (then that value is also the one at i)
    hit = (key == vals) | key.isnan() if dtypes.is_float(x.dtype) else key == vals
    idx = _cummax_last(hit.where(_iota(n, x, (n,)), -1))
    if x.dtype == dtypes.bool: out = vals.cast(dtypes.bool) if is_max else vals.cast(dtypes.bool).logical_not()
    elif dtypes.is_float(x.dtype): out = vals if is_max else -vals
    else: out = vals if is_max else ~vals
    out, idx = _paired(out, idx)
    # each running value's gradient goes to the element at its index (a tie's to the last one), as torch
    return with_gradient(out, (x, idx), IndexGradient()), idx

def _ops():
    from fusegrad.uop.ops import Ops
    return Ops

__all__ = ["ReduceMixin"]
