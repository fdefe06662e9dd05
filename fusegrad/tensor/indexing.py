"""Indexing: basic and advanced __getitem__/__setitem__, gather and scatter, masks, triangles and diagonals, rolls,
repeats, splits and einops-style rearrange.

A gather by index tensors is a one-hot compare-and-sum reduction, out[b] = sum_n where(pos[b] == n, x[n], 0), which
the scheduler fuses into one kernel and the code generator turns into one indexed load per element (codegen/gather.py);
its gradient is a scatter-add. Writes by index tensors (setitem, scatter, scatter_reduce) are SCATTER nodes: a copy of
the target, then one loop over the values in order (see DESIGN.md, "Gathers and scatters"). An
index tensor's values can't be checked without reading them. The knob CHECK_OOB (environment or Context) says which
are read: 0 none; 1 (the default) those already in memory (realized, as a tensor made from a list or an array is),
which costs a copy of their values to the host but no computation; 2 every one, a lazy one computed first (a sync in
the middle of building the graph). An index that fails the check is an IndexError naming it and the size, as in
PyTorch. An index that isn't checked (a lazy index tensor under CHECK_OOB=1, or inside a TinyJit capture) and is out
of range (after wrapping negatives, where allowed) matches no position: it reads 0 (False for bool tensors) and
writes nowhere, never another element. Python int and slice indices and indices given as lists or arrays are always
checked. Boolean masks have a data-dependent result size, so they are realized and read once (nonzero) before
indexing."""
from __future__ import annotations
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Sequence
from fusegrad.dtype import ConstType, dtypes
from fusegrad.helpers import Context, ContextVar, argfix, prod
from fusegrad.uop.ops import Ops, UOp, buffer_node, is_symbolic, sym_le

if TYPE_CHECKING:
    from fusegrad.tensor import Tensor

def _T():
    from fusegrad.tensor import Tensor
    return Tensor

# which index tensors are read to check their values (see the module's docstring)
CHECK_OOB = ContextVar("CHECK_OOB", 1)

def _check_index_values(index: Tensor, size: Any, dim: int, negatives: bool, name: str = "index",
                        ignore: int | None = None) -> None:
    """IndexError if an entry of the index tensor is outside [0, size) (or [-size, size) with `negatives`), where
    CHECK_OOB says its values are to be read. Entries equal to `ignore` (a loss's ignore_index) are allowed."""
    from fusegrad.engine.realize import capturing
    if not CHECK_OOB or capturing or not isinstance(size, int) or index.uop.op is Ops.MULTI: return
    if any(not isinstance(s, int) for s in index.shape) or index.numel() == 0: return
    if CHECK_OOB < 2 and buffer_node(index.uop) is None: return
    vals = index.numpy()
    lo, hi = int(vals.min()), int(vals.max())
    if hi < size and lo >= (-size if negatives else 0): return  # (the common case: no entry needs a second look)
    if ignore is not None:
        if (vals := vals[vals != ignore]).size == 0: return
        lo, hi = int(vals.min()), int(vals.max())
    if hi >= size or lo < (-size if negatives else 0):
        raise IndexError(f"{name} {hi if hi >= size else lo} is out of bounds for dimension {dim} with size {size}")

def _axis(axis: int, ndim: int, name: str = "dim") -> int:
    if not isinstance(axis, int) or isinstance(axis, bool): raise TypeError(f"{name} must be an int, got {axis!r}")
    n = max(ndim, 1)
    if not -n <= axis < n: raise IndexError(f"{name} {axis} is out of range for a tensor with {ndim} dimensions")
    return axis % n

def _is_mask(t: Tensor) -> bool: return t.dtype in (dtypes.bool, dtypes.uint8)

def _index_tensor(i: Any, device: str) -> Tensor:
    """A list / numpy array / Tensor used as an index, as a Tensor, with its dtype checked."""
    Tensor = _T()
    if not isinstance(i, Tensor):
        t = Tensor(i, device=device) if not (isinstance(i, (list, tuple)) and len(i) == 0) else \
            Tensor.zeros(0, dtype=dtypes.int64, device=device)
    else: t = i
    if not (dtypes.is_int(t.dtype) or t.dtype == dtypes.bool):
        raise IndexError(f"tensors used as indices must be integer or bool tensors, got {t.dtype}")
    return t

def _host_range(i: Any) -> tuple[int, int]:
    """(min, max) of the integers in a nested list/tuple or a numpy array."""
    if type(i).__module__ == "numpy": return int(i.min()), int(i.max())
    flat, stack = [], [i]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)): stack.extend(x)
        else: flat.append(int(x))
    return min(flat), max(flat)

def _onehot(index: Tensor, n: int) -> Tensor:
    """index.shape + (n,) bools: True where the index equals the position (out-of-range indices match nothing). The
    positions count in int64 where n passes int32's range or the index is 64-bit (an int32 count would wrap, and a
    64-bit index narrowed to int32 could wrap onto a position; a 32-bit one that wraps turns negative: no match)."""
    Tensor = _T()
    wide = isinstance(n, int) and n - 1 > dtypes.max(dtypes.int32) or index.dtype.itemsize > 4
    dt = dtypes.int64 if wide else dtypes.int32
    return index.cast(dt).unsqueeze(-1) == Tensor.arange(n, dtype=dt, device=index.device)

def _flat_position(shape: tuple[int, ...], comps: list[Tensor | int], out_shape: tuple[int, ...],
                   wrap: bool) -> Tensor:
    """The row-major position in a tensor of `shape` of each element of a result of `out_shape`, from one component
    per dim: an index tensor (broadcast to out_shape; negatives wrapped where `wrap`), or an int: the result's own
    position along that axis. -1 where an index tensor is out of range, which reads 0 and writes nothing. int64 where
    an index tensor is, or where the tensor holds more positions than int32 counts (a wrapped position would be
    another element)."""
    Tensor = _T()
    wide = isinstance(n := prod(shape), int) and n > dtypes.max(dtypes.int32) or \
        any(isinstance(c, Tensor) and (c.dtype.itemsize > 4 or dtypes.is_unsigned(c.dtype)) for c in comps)
    dt = dtypes.int64 if wide else dtypes.int32
    pos, valid, stride = None, None, 1
    for c, size in list(zip(comps, shape))[::-1]:
        if isinstance(c, int):
            t = Tensor.arange(out_shape[c], dtype=dt, device=_device_of(comps)).reshape(
                tuple(out_shape[c] if a == c else 1 for a in range(len(out_shape))))
        else:
            t = c.cast(dt)
            if wrap: t = (t < 0).where(t + size, t)
            t = t._broadcast_to(out_shape)
            ok = (t >= 0) & (t < size)
            valid = ok if valid is None else valid & ok
        pos = t * stride if pos is None else pos + t * stride
        stride *= size
    pos = pos._broadcast_to(out_shape)
    return pos if valid is None else valid.where(pos, -1)

def _device_of(comps: list) -> Any: return next(c.device for c in comps if not isinstance(c, int))

def _positions(shape: tuple[int, ...], index: Tensor, dim: int) -> Tensor:
    """The flat position in a tensor of `shape` of each element of `index` read along `dim` (gather's and scatter's
    addressing: index's own position in the other dims); -1 where the index is outside [0, shape[dim])."""
    return _flat_position(shape, [index if k == dim else k for k in range(index.ndim)], index.shape, wrap=False)

def _take(x: Tensor, pos: Tensor) -> Tensor:
    """x's elements (in row-major order) at the flat positions `pos` (any shape; -1: 0, or False). Written as a
    one-hot selection, which the code generator turns into an indexed load; its gradient adds each output's gradient
    into the position it was read from (a scatter: work the size of `pos`, not of x times it)."""
    from fusegrad.gradient import with_gradient
    if isinstance(x.device, tuple) or isinstance(pos.device, tuple): return _take_sharded(x, pos)
    out = _select_sum(_onehot(pos, x.numel()), x.flatten(), -1)
    return with_gradient(out, (x, pos), TakeGradient())

def _scatter_flat(target: Tensor, pos: Tensor, values: Tensor, how: str | None, ties_with: Tensor | None = None) \
        -> Tensor:
    """target with values[j] combined (how: None writes over it, "add", "mul", "max", "min") into the flat position
    pos[j] (-1: nowhere), in the values' row-major order, so the last of duplicate positions wins. Its work is the
    size of `values` (one SCATTER node: a copy, then a loop over the values). `ties_with`: the tensor whose elements
    count among the ties of a "max"/"min" gradient (default: target; torch counts self's even where include_self=False
    replaced it)."""
    from fusegrad.gradient import with_gradient
    Tensor = _T()
    pos, values = pos.flatten(), values.flatten().cast(target.dtype)
    if not all(isinstance(s, int) for s in target.shape + pos.shape):
        # (symbolic shapes: the one-hot formula, whose work is the target's size times the values')
        return _scatter_by_onehot(target.flatten(), pos, values, how).reshape(target.shape)
    if any(isinstance(t.device, tuple) for t in (target, pos, values)):
        return _scatter_sharded(target, pos, values, how)
    out = Tensor(UOp(Ops.SCATTER, target.dtype, (target.uop, pos.uop, values.uop), how))
    return with_gradient(out, (target, values, pos) + ((ties_with,) if ties_with is not None else ()),
                         ScatterGradient(how))

# *** over several devices ***
# A gather or scatter of a sharded tensor is built here, shard by shard, over the shards' own nodes: each shard is an
# ordinary single-device gather or scatter at positions in its own addressing, with its own gradient rule. (A rule in
# schedule/multi.py could split the forward SCATTER as well, but gradient rules run shard by shard on single-device
# graphs: a rule given a shard and positions that count over the whole tensor can't place them. Built here, each
# shard's rule sees its local positions, so the gradients are scatters and gathers of the size of what they move too.)

def _devices(*ts: Tensor) -> tuple[str, ...]:
    """The devices of tensors of which one at least is on several: all must be on the same ones."""
    devs = next(t.device for t in ts if isinstance(t.device, tuple))
    for t in ts:
        if t.device != devs: raise ValueError(f"tensors are on different devices: {t.device} and {devs}")
    return devs

def _as_multi(t: Tensor, devices: tuple[str, ...]) -> UOp:
    """t's MULTI (a lazy graph on several devices: replicas)."""
    from fusegrad.schedule.multi import replicate
    return t.uop if t.uop.op is Ops.MULTI else replicate(t.uop, devices)

def _whole_on_each(t: Tensor, devices: tuple[str, ...]) -> list[Tensor]:
    """t whole on each device, one single-device tensor per device (a split tensor's shards gathered: copies of
    its size)."""
    from fusegrad.schedule.multi import replicate
    return [_T()(s) for s in replicate(t.uop, devices).src]

def _shard_positions(pos: Tensor, shape: tuple[int, ...], axis: int, lo: int, hi: int) -> Tensor:
    """Flat positions in a tensor of `shape` as flat positions in its part lo..hi along `axis` (the addressing of the
    shard that holds it); -1 where a position is outside that part."""
    total, n, inner = prod(shape), shape[axis], prod(shape[axis + 1:])
    p = pos.cast(dtypes.int64 if total > dtypes.max(dtypes.int32) or pos.dtype.itemsize > 4 else dtypes.int32)
    if prod(shape[:axis]) == 1:   # the part is one run of the flat order: a shift
        return ((p >= lo * inner) & (p < hi * inner)).where(p - lo * inner, -1)
    # p = (outer, k, r) over (shape[:axis], n, inner): the part keeps hi - lo of the n rows of each outer block
    k, outer = (p // inner) % n, p // (n * inner)
    inside = (p >= 0) & (p < total) & (k >= lo) & (k < hi)
    return inside.where(p - outer * ((n - (hi - lo)) * inner) - lo * inner, -1)

def _scatter_sharded(target: Tensor, pos: Tensor, values: Tensor, how: str | None) -> Tensor:
    """_scatter_flat over several devices: each shard of the target scatters all the values (copied whole to its
    device) at the positions that fall in it, the others written nowhere; replicas each scatter all of them. The
    result is laid out as the target; the work is the values' size per device."""
    from fusegrad.schedule.multi import multi_bounds
    Tensor = _T()
    devs = _devices(target, pos, values)
    t = _as_multi(target, devs)
    bounds, ps, vs = multi_bounds(t), _whole_on_each(pos, devs), _whole_on_each(values, devs)
    outs = []
    for i, s in enumerate(t.src):
        shard = Tensor(s)
        if bounds is None: outs.append(_scatter_flat(shard, ps[i], vs[i], how))
        elif shard.numel() == 0: outs.append(shard)
        else: outs.append(_scatter_flat(shard, _shard_positions(ps[i], target.shape, t.arg, *bounds[i]), vs[i], how))
    return Tensor(UOp(Ops.MULTI, target.dtype, tuple(o.uop for o in outs), t.arg))

def _take_sharded(x: Tensor, pos: Tensor) -> Tensor:
    """_take over several devices. Replicas of x: each device reads its own part of the positions from its replica
    (the result is laid out as the positions). x split: each shard reads the positions that fall in it (0 elsewhere),
    and the partial results are summed over the devices (replicas)."""
    from fusegrad.schedule.multi import multi_bounds
    Tensor = _T()
    devs = _devices(x, pos)
    xm = _as_multi(x, devs)
    if xm.arg is None:
        pm = _as_multi(pos, devs)
        outs = [_take(Tensor(xs), Tensor(p)) for xs, p in zip(xm.src, pm.src)]
        return Tensor(UOp(Ops.MULTI, x.dtype, tuple(o.uop for o in outs), pm.arg))
    parts = []
    for xs, p, (lo, hi) in zip(xm.src, _whole_on_each(pos, devs), multi_bounds(xm)):
        shard = Tensor(xs)
        local = None if shard.numel() == 0 else _shard_positions(p, x.shape, xm.arg, lo, hi)
        part = Tensor.zeros(*pos.shape, dtype=x.dtype, device=p.device) if local is None else _take(shard, local)
        # a float read elsewhere is -0.0 here, the identity of the sum over the devices (+0.0 would turn a -0.0 read
        # by its shard into +0.0)
        if dtypes.is_float(x.dtype): part = part if local is None else (local >= 0).where(part, -0.0)
        if dtypes.is_float(x.dtype) and local is None: part = part.full_like(-0.0)
        parts.append(part.unsqueeze(0).uop)
    stacked = Tensor(UOp(Ops.MULTI, x.dtype, tuple(parts), 0))
    return stacked.any(0) if x.dtype == dtypes.bool else stacked.sum(0, dtype=x.dtype)

def _scatter_by_onehot(target: Tensor, pos: Tensor, values: Tensor, how: str | None) -> Tensor:
    """_scatter_flat of a flat target as a one-hot reduction over the values for each of target's elements: the
    definition its gradients follow, and the way for symbolic shapes."""
    Tensor = _T()
    oh = _onehot(pos, target.numel())                                     # (values, target)
    v = values.unsqueeze(-1)
    hit = oh.any(0)
    if how is None:
        order = Tensor.arange(1, pos.numel() + 1, dtype=dtypes.int32, device=pos.device).unsqueeze(-1)
        last = oh.where(order, 0).max(0)
        return hit.where(_select_sum(oh & (order == last), v, 0), target)
    if how == "add": return target + _select_sum(oh, v, 0)
    if how == "mul": return target * oh.where(v, 1).prod(0)
    big = math.inf if dtypes.is_float(target.dtype) else dtypes.max(target.dtype)
    if how == "max": return hit.where(oh.where(v, -big if dtypes.is_float(target.dtype) else
                                               dtypes.min(target.dtype)).max(0).maximum(target), target)
    return hit.where(oh.where(v, big).min(0).minimum(target), target)

@dataclass(frozen=True)
class TakeGradient:
    """The gradient of _take (ins: x, the positions): each output's gradient is added into the element it was read
    from."""
    pure: ClassVar[bool] = True
    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp, None]:
        Tensor = _T()
        x, pos = Tensor(ins[0]), Tensor(ins[1])
        zeros = Tensor.zeros(*x.shape, dtype=x.dtype, device=x.device)
        return _scatter_flat(zeros, pos, Tensor(grad), "add").uop, None

@dataclass(frozen=True)
class ScatterGradient:
    """The gradient of _scatter_flat (ins: target, values, positions). A value gets the gradient of the position it
    went to (as torch's scatter, duplicates included); the target gets it where no value replaced it. For "max" and
    "min" the target element and the values equal to the result share it evenly (torch's convention for ties); for
    "mul" the gradient is the one-hot formula's (torch's conventions for zeros)."""
    pure: ClassVar[bool] = True
    how: str | None
    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp | None, ...]:
        from fusegrad.gradient import compute_gradient
        Tensor = _T()
        g, target, values, pos = Tensor(grad), Tensor(ins[0]), Tensor(ins[1]), Tensor(ins[2])
        if self.how in (None, "add"):
            g_values = _take(g, pos).reshape(values.shape)
            if self.how == "add": return (grad, g_values.uop, None) + ((None,) * (len(ins) - 3))
            hit = _scatter_flat(Tensor.zeros(*target.shape, dtype=dtypes.bool, device=target.device), pos,
                                Tensor.ones(*pos.shape, dtype=dtypes.bool, device=pos.device), None)
            return (hit.where(0, g).uop, g_values.uop, None) + ((None,) * (len(ins) - 3))
        if self.how in ("max", "min"):
            # torch's convention: the gradient is shared evenly by the target element and the values equal to the
            # result (ties), each found by a gather and counted by a scatter-add: work the size of the values
            out = _scatter_flat(target, pos, values, self.how)
            at = lambda t: _take(t, pos).reshape(values.shape)
            out_at = at(out)
            from_values = (values == out_at) & (pos >= 0).reshape(values.shape)
            kept = target == out
            ties_ref = target if len(ins) < 4 else Tensor(ins[3])
            tied = ties_ref == out
            from_values_n = _scatter_flat(Tensor.zeros(*target.shape, device=target.device), pos,
                                          from_values.cast(dtypes.float32), "add")
            share = g / (tied.cast(dtypes.float32) + from_values_n).maximum(1).cast(g.dtype)
            # (the values' shares read at their positions, each buffer gathered by itself: work the size of the values,
            # not of the target)
            count_at = (at(ties_ref) == out_at).cast(dtypes.float32) + at(from_values_n)
            g_values = from_values.where(at(g) / count_at.maximum(1).cast(g.dtype), 0)
            return (kept.where(share, 0).uop, g_values.uop, None) + ((None,) if len(ins) > 3 else ())
        formula = _scatter_by_onehot(target.flatten(), pos.flatten(), values.flatten(), self.how).reshape(target.shape)
        grads = compute_gradient(formula.uop, grad, {ins[0], ins[1]})
        return (grads.get(ins[0]), grads.get(ins[1]), None) + ((None,) * (len(ins) - 3))

def _select_sum(onehot: Tensor, x: Tensor, axis: int) -> Tensor:
    """Sum over `axis` of x where onehot (where, not multiply, so nan/inf elsewhere don't leak in), in x's dtype."""
    if x.dtype == dtypes.bool: return onehot.where(x, False).any(axis)
    return onehot.where(x, 0).sum(axis).cast(x.dtype)

def _symbolic_window(i: Any, size: Any, dim: int) -> tuple[Any, Any]:
    """The (begin, end) that an index or a step-1 slice selects where the index or the size is symbolic. Python's
    negative indices and clamping need the values, so a symbolic window must lie inside the dimension as given."""
    if isinstance(i, slice):
        if i.step not in (None, 1): raise IndexError(f"a slice with a symbolic bound or size needs step 1, got {i}")
        b, e = (0 if i.start is None else i.start), (size if i.stop is None else i.stop)
    else: b, e = i, i + 1
    if any(isinstance(x, int) and x < 0 for x in (b, e)):
        raise IndexError(f"negative index {i} in dimension {dim} of symbolic size {size}: give it from the start")
    if not (sym_le(0, b) and sym_le(b, e) and sym_le(e, size)):
        raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
    return b, e

class IndexingMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()

    # *** __getitem__ ***

    def _parse_indices(self: Tensor, indices: Any) -> list:
        """Normalize an index into a list of int / slice / None / ('adv', Tensor) entries covering every dim."""
        Tensor = _T()
        raw = list(indices) if isinstance(indices, tuple) else [indices]
        entries: list = []
        for i in raw:
            if isinstance(i, bool): entries.append(("bool", i))
            elif i is None or i is Ellipsis or isinstance(i, slice): entries.append(i)
            elif isinstance(i, int) or is_symbolic(i): entries.append(i)
            elif type(i).__module__ == "numpy" and getattr(i, "shape", None) == () and hasattr(i, "item"):
                entries.append(("bool", bool(i)) if isinstance(i.item(), bool) else int(i.item()))
            elif isinstance(i, (Tensor, list, tuple)) or type(i).__module__ == "numpy":
                t = _index_tensor(i, self.device)
                if t.ndim == 0 and _is_mask(t): entries.append(("bool", bool(t.item())))
                elif _is_mask(t): entries.append(("mask", t))
                elif not isinstance(i, Tensor) and t.numel():
                    # indices given as host data are checked now, as torch does (a device tensor's values aren't
                    # known without waiting for it: out-of-range entries there select nothing)
                    entries.append(("adv", t, _host_range(i)))
                else: entries.append(("adv", t))
            else: raise TypeError(f"unsupported index type {type(i).__name__}: use ints, slices, None, ..., "
                                  "bools, lists or integer/bool Tensors")
        if sum(e is Ellipsis for e in entries) > 1: raise IndexError("an index can only have a single ellipsis (...)")
        consumed = sum(e[1].ndim if isinstance(e, tuple) and e[0] == "mask" else
                       0 if e is None or e is Ellipsis or isinstance(e, tuple) and e[0] == "bool" else 1
                       for e in entries)
        if consumed > self.ndim:
            raise IndexError(f"too many indices for a tensor of dimension {self.ndim} (got {consumed})")
        fill = [slice(None)] * (self.ndim - consumed)
        if Ellipsis in entries:
            at = entries.index(Ellipsis)
            entries = entries[:at] + fill + entries[at + 1:]
        else: entries += fill
        # masks become one integer index per dim they cover (their nonzero positions)
        out, dim = [], 0
        for e in entries:
            if isinstance(e, tuple) and e[0] == "mask":
                m = e[1]
                if m.shape != self.shape[dim:dim + m.ndim]:
                    raise IndexError(f"the shape of the mask {m.shape} at index {dim} does not match the shape "
                                     f"{self.shape[dim:dim + m.ndim]} of the indexed tensor there")
                nz = m.nonzero()
                out += [("adv", nz[:, k]) for k in range(m.ndim)]
                dim += m.ndim
            else:
                if isinstance(e, tuple) and e[0] == "adv" and len(e) == 3:
                    (lo, hi), size = e[2], self.shape[dim]
                    if hi >= size or lo < -size:
                        bad = hi if hi >= size else lo
                        raise IndexError(f"index {bad} is out of bounds for dimension {dim} with size {size}")
                    e = e[:2]
                elif isinstance(e, tuple) and e[0] == "adv":
                    e = ("adv", e[1], dim)  # (an index tensor of the caller's, checked in _getitem: its dim kept)
                out.append(e)
                if not (e is None or isinstance(e, tuple) and e[0] == "bool"): dim += 1
        return out

    def _basic_index(self: Tensor, entries: list) -> Tensor:
        """Apply ints, slices and None (one per dim of self, plus Nones): shrinks, flips, strides and reshapes."""
        shrink_arg, flip_axes, strides, squeeze, out_shape = [], [], [], [], []
        dim = 0
        for i in entries:
            if i is None: out_shape.append(None); continue
            size = self.shape[dim]
            if is_symbolic(i) or is_symbolic(size) or \
                    isinstance(i, slice) and (is_symbolic(i.start) or is_symbolic(i.stop)):
                b, e = _symbolic_window(i, size, dim)
                shrink_arg.append((b, e)); strides.append(1); squeeze.append(not isinstance(i, slice))
                if isinstance(i, slice): out_shape.append(dim)
            elif isinstance(i, int):
                if not -size <= i < size:
                    raise IndexError(f"index {i} is out of bounds for dimension {dim} with size {size}")
                i = i + size if i < 0 else i
                shrink_arg.append((i, i + 1)); strides.append(1); squeeze.append(True)
            else:
                if i.step == 0: raise ValueError("slice step cannot be zero")
                start, stop, step = i.indices(size)
                # the elements start, start+step, ... before stop, as a (begin, end) window read forwards or backwards
                count = len(range(start, stop, step))
                b = start if step > 0 else start + step * (count - 1) if count else 0
                e = b + abs(step) * (count - 1) + 1 if count else b
                shrink_arg.append((b, e)); strides.append(step); squeeze.append(False)
                if step < 0: flip_axes.append(dim)
                out_shape.append(dim)
            dim += 1
        x = self.shrink(tuple(shrink_arg)) if shrink_arg else self
        if flip_axes: x = x.flip(flip_axes)
        if any(abs(s) != 1 for s in strides):
            # stride s: pad each dim to a multiple of s, split it into (n, s) and keep the first of every s
            st = [abs(s) for s in strides]
            x = x.pad(tuple((0, -sh % s) for sh, s in zip(x.shape, st)))
            x = x.reshape(tuple(d for sh, s in zip(x.shape, st) for d in (sh // s, s)))
            x = x.shrink(tuple(p for n in x.shape[::2] for p in ((0, n), (0, 1))))
            x = x.reshape(x.shape[::2])
        kept = iter([d for d, sq in zip(x.shape, squeeze) if not sq])
        return x.reshape(tuple(1 if o is None else next(kept) for o in out_shape))

    def _getitem(self: Tensor, entries: list) -> Tensor:
        Tensor = _T()
        # python bools are new dims of size 1 (True) or 0 (False); with other tensor indices, True is an index 0
        has_adv = any(isinstance(e, tuple) and e[0] == "adv" for e in entries)
        basic, adv, empty_dims, out_pos, last_adv, adjacent = [], [], [], 0, None, True
        for k, e in enumerate(entries):
            if isinstance(e, tuple) and e[0] == "bool":
                basic.append(None)
                if not has_adv:
                    if not e[1]: empty_dims.append(out_pos)
                    out_pos += 1
                    continue
                if not e[1]: raise IndexError("a False index can't be combined with tensor indices")
                t = Tensor(0, device=self.device)
            elif isinstance(e, tuple): basic.append(slice(None)); t = e[1]
            else:
                basic.append(e)
                if not isinstance(e, int): out_pos += 1
                continue
            # ints don't separate tensor indices (they are applied first), slices and None do
            if last_adv is not None and any(not isinstance(entries[j], int) for j in range(last_adv + 1, k)):
                adjacent = False
            adv.append((out_pos, t)); last_adv = k
            out_pos += 1
        x = self._basic_index(basic)
        if not (type(n := prod(x.shape)) is int and n == 0):  # (as in torch, no index is read for an empty result)
            for e in entries:
                if isinstance(e, tuple) and e[0] == "adv" and len(e) == 3:
                    _check_index_values(e[1], self.shape[e[2]], e[2], True)
        if empty_dims: x = x.shrink(tuple((0, 0) if d in empty_dims else (0, s) for d, s in enumerate(x.shape)))
        if not adv: return x
        return x._gather_adv(adv, adjacent)

    def _gather_adv(self: Tensor, adv: list, adjacent: bool) -> Tensor:
        """x indexed by integer tensors at dims [d for d, _ in adv]: their broadcast shape B replaces those dims (in
        place when the indices were adjacent, in front otherwise)."""
        from fusegrad.tensor import _broadcast_shape
        dims = [d for d, _ in adv]
        try: bshape = _broadcast_shape(*[t.shape for _, t in adv])
        except ValueError: raise IndexError("shape mismatch: indexing tensors could not be broadcast together with "
                                            f"shapes {[t.shape for _, t in adv]}") from None
        sizes = [self.shape[d] for d in dims]
        rest = [d for d in range(self.ndim) if d not in dims]
        # the output's dims: B in place of the indexed dims when they were adjacent, in front otherwise. The gather
        # is computed in that order, so its kernel stores the output contiguously (computed with B last and then
        # permuted, an embedding's rows were stored feature by feature and every reader of them read across rows)
        lead = rest[:dims[0]] if adjacent else []
        trail = rest[len(lead):]
        out_shape = tuple(self.shape[d] for d in lead) + bshape + tuple(self.shape[d] for d in trail)
        n = prod(sizes)
        if n == 0 or prod(bshape) == 0:
            if prod(bshape) and n == 0: raise IndexError("index is out of bounds for a dimension with size 0")
            return _T().zeros(*out_shape, dtype=self.dtype, device=self.device)
        # every output element's flat position in self: the index tensors in the indexed dims, the output's own
        # position in the others
        comps: list = [0] * self.ndim
        for k, d in enumerate(lead): comps[d] = k
        for k, d in enumerate(trail): comps[d] = len(lead) + len(bshape) + k
        for d, t in adv:   # (right-aligned in B, as broadcasting aligns them)
            comps[d] = t.reshape((1,) * (len(lead) + len(bshape) - t.ndim) + t.shape + (1,) * len(trail))
        return _take(self, _flat_position(self.shape, comps, out_shape, wrap=True))

    def __getitem__(self: Tensor, indices: Any) -> Tensor:
        """PyTorch indexing: ints, slices (any step), None, ..., bools, and integer/bool tensors or lists."""
        if (window := self._window_index(indices)) is not None: return window
        return self._getitem(self._parse_indices(indices))

    def _window_index(self: Tensor, indices: Any) -> Tensor | None:
        """The commonest index, ints and slices of step 1 over the leading dims (`x[i]`, `x[:, 2:5]`), made directly:
        the shrink and reshape _basic_index makes, without its parsing (18 -> 4 us). None for any other index (or a
        symbolic size, a sharded tensor, an int out of range: the general path says why)."""
        u = self._uop
        shape = u.shape
        idx = indices if type(indices) is tuple else (indices,)
        if len(idx) > len(shape) or sys.modules["fusegrad.tensor"]._sharding_used: return None
        window, out = [], []
        for i, s in zip(idx, shape):
            if type(s) is not int: return None
            if type(i) is int:
                if not -s <= i < s: return None
                i = i + s if i < 0 else i
                window.append((i, i + 1))
            elif type(i) is slice and (i.step is None or type(i.step) is int and i.step == 1) and \
                    (i.start is None or type(i.start) is int) and (i.stop is None or type(i.stop) is int):
                b, e, _ = i.indices(s)
                window.append((b, max(b, e)))
                out.append(max(b, e) - b)
            else: return None
        rest = shape[len(idx):]
        if not all(type(s) is int for s in rest): return None
        full = (*window, *((0, s) for s in rest))
        v = u if all(b == 0 and e == s for (b, e), s in zip(full, shape)) else u.shrink(full)
        if (new := (*out, *rest)) != v.shape: v = v.reshape(new)
        return self if v is u else type(self)._of(v)

    # *** __setitem__ ***

    def __setitem__(self: Tensor, indices: Any, v: Any) -> None:
        """Write `v` (broadcast and cast to this dtype) into the indexed positions, as PyTorch's setitem."""
        Tensor = _T()
        from fusegrad.tensor import _is_realized_view
        from fusegrad.gradient import compute_gradient
        entries = self._parse_indices(indices)
        view = self._getitem(entries)
        if not isinstance(v, Tensor): v = Tensor(v, device=self.device, dtype=self.dtype)
        if v.device != self.device: raise ValueError(f"setitem value is on {v.device}, the tensor on {self.device}")
        v = v.cast(self.dtype)
        try: v = v._broadcast_to(view.shape) if v.shape != view.shape else v
        except ValueError: raise ValueError(f"shape mismatch: value of shape {v.shape} can't be broadcast to the "
                                            f"indexing result of shape {view.shape}") from None
        has_adv = any(isinstance(e, tuple) and e[0] == "adv" for e in entries)
        if _is_realized_view(self.uop) and self.requires_grad is True:
            raise RuntimeError("a realized tensor that requires grad can't be written in place; write into a copy")
        if view.numel() == 0: return
        if _is_realized_view(self.uop) and not has_adv:
            # basic indexing of memory: write through the view, only the indexed elements are touched
            # a value that reads this memory is computed first, so overlapping reads see the old values
            reads_self = self.uop.base in v.uop.toposort()
            view.assign(v.contiguous() if reads_self else v).realize()
            return
        if has_adv:
            # tensor indices may repeat: scatter into the flattened tensor, where the last write wins
            # (positions are counted from 1: an unchecked out-of-range index gathers 0, position -1, written nowhere)
            # (int64 past int32's range: a wrapped position would be written)
            n = self.numel()
            pdt = dtypes.int64 if isinstance(n, int) and n > dtypes.max(dtypes.int32) else dtypes.int32
            flat_pos = Tensor.arange(1, n + 1, dtype=pdt, device=self.device).reshape(self.shape)
            with Context(CHECK_OOB=0):  # (the indices were checked by the _getitem above)
                pos = flat_pos._getitem(entries).flatten() - 1
                # (into self as it is, not its flattened view: a tensor split along an axis other than the first
                # would be gathered whole to be flattened)
                new = _scatter_flat(self, pos, v, None) if pos.numel() else self
        else:
            # the indexing's adjoint places a tensor of the view's shape into a tensor of self's shape: apply it to
            # the value and to ones (the written positions), using a fresh placeholder so self's graph isn't touched
            wd = dtypes.int32 if self.dtype == dtypes.bool or not dtypes.is_float(self.dtype) and \
                self.dtype.itemsize < 4 else self.dtype
            ph = Tensor.empty(*self.shape, dtype=wd, device=self.device)
            pview = ph._getitem(entries)
            placed = Tensor(compute_gradient(pview.uop, v.cast(wd).uop, {ph.uop})[ph.uop])
            hit = Tensor(compute_gradient(pview.uop, pview.ones_like().uop, {ph.uop})[ph.uop]) != 0
            new = hit.where(placed.cast(self.dtype), self)
        if _is_realized_view(self.uop): self.assign(new.contiguous()).realize()
        else: self.uop = new.uop

    # *** gather / scatter ***

    def _check_index_like(self: Tensor, name: str, dim: int, index: Tensor) -> int:
        Tensor = _T()
        if not isinstance(index, Tensor): raise TypeError(f"{name}: index must be a Tensor, not {type(index).__name__}")
        if not dtypes.is_int(index.dtype): raise TypeError(f"{name}: index must be integer, not {index.dtype}")
        d = _axis(dim, self.ndim)
        if index.ndim != self.ndim and not (index.ndim <= 1 and self.ndim <= 1):
            raise ValueError(f"{name}: index has {index.ndim} dims but self has {self.ndim}; they must match")
        for k, (a, b) in enumerate(zip(index.shape, self.shape)):
            if k != d and a > b: raise ValueError(f"{name}: index shape {index.shape} is larger than self "
                                                  f"{self.shape} at dimension {k}")
        _check_index_values(index, self.shape[d] if self.ndim else 1, d, False, f"{name}: index")
        return d

    def gather(self: Tensor, dim: int, index: Tensor) -> Tensor:
        """out[..i..] = self[..index[..i..]..] along `dim` (PyTorch's gather). Indices outside [0, size) are an
        IndexError where CHECK_OOB reads them (see the module's docstring), else they read 0."""
        d = self._check_index_like("gather", dim, index)
        x, idx = (self.reshape(1), index.reshape(1)) if self.ndim == 0 else (self, index.reshape(index.shape or (1,)))
        if idx.numel() == 0 or x.shape[d] == 0:
            return _T().zeros(*index.shape, dtype=self.dtype, device=self.device)
        return _take(x, _positions(x.shape, idx, d)).reshape(index.shape)

    def _scatter_parts(self: Tensor, name: str, dim: int, index: Tensor, src: Any) -> tuple[Tensor, Tensor]:
        """(flat positions in self of index's elements, src cut to index's shape in self's dtype)."""
        Tensor = _T()
        d = self._check_index_like(name, dim, index)
        if isinstance(src, Tensor):
            if src.ndim != index.ndim: raise ValueError(f"{name}: src has {src.ndim} dims, index {index.ndim}")
            if any(i > s for i, s in zip(index.shape, src.shape)):
                raise ValueError(f"{name}: index shape {index.shape} is larger than src {src.shape}")
            src = src.cast(self.dtype).shrink(tuple((0, i) for i in index.shape))
        else: src = Tensor.full(index.shape, src, dtype=self.dtype, device=self.device)
        return _positions(self.shape, index, d), src

    def scatter(self: Tensor, dim: int, index: Tensor, src: Tensor | ConstType,
                reduce: Literal["multiply", "add"] | None = None) -> Tensor:
        """A copy of self with src written at `index` along `dim` (PyTorch's scatter; reduce 'add' or 'multiply').
        Duplicate indices: the last one in index's row-major order wins (what PyTorch does on the CPU, though it
        documents it as undefined). Indices outside [0, size) are an IndexError where CHECK_OOB reads them, else they
        write nowhere. The work is index's size, not self's size times it."""
        if reduce not in (None, "add", "multiply"):
            raise ValueError(f"scatter reduce must be None, 'add' or 'multiply', got {reduce!r}")
        if self.ndim == 0:
            if not isinstance(index, _T()) or index.ndim: raise ValueError("scatter on a 0-d tensor needs a 0-d index")
            src1 = src.reshape(1) if isinstance(src, _T()) else src
            return self.reshape(1).scatter(0, index.reshape(1), src1, reduce).reshape(())
        if reduce is not None: return self.scatter_reduce(dim, index, src if isinstance(src, _T()) else
                                                          _T().full(index.shape, src, dtype=self.dtype,
                                                                    device=self.device),
                                                          "sum" if reduce == "add" else "prod")
        pos, src = self._scatter_parts("scatter", dim, index, src)
        if index.numel() == 0: return self
        return _scatter_flat(self, pos, src, None)

    def scatter_reduce(self: Tensor, dim: int, index: Tensor, src: Tensor,
                       reduce: Literal["sum", "prod", "mean", "amax", "amin"], include_self: bool = True) -> Tensor:
        """Reduce src's values into self at `index` along `dim` (PyTorch's scatter_reduce). Indices outside
        [0, size) are an IndexError where CHECK_OOB reads them, else they write nowhere. The work is index's size,
        not self's size times it."""
        Tensor = _T()
        if reduce not in ("sum", "prod", "mean", "amax", "amin"):
            raise ValueError(f"scatter_reduce reduce must be one of sum, prod, mean, amax, amin, got {reduce!r}")
        if not isinstance(src, Tensor):
            raise TypeError(f"scatter_reduce: src must be a Tensor, got {type(src).__name__}")
        if self.ndim == 0:
            if not isinstance(index, Tensor) or index.ndim or src.ndim:
                raise ValueError("scatter_reduce on a 0-d tensor needs a 0-d index and src")
            return self.reshape(1).scatter_reduce(0, index.reshape(1), src.reshape(1), reduce, include_self).reshape(())
        pos, s = self._scatter_parts("scatter_reduce", dim, index, src)
        if index.numel() == 0: return self
        how = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}[reduce]
        base = self
        if not include_self:
            # the positions written start from the reduction's identity instead of self's value
            fl = dtypes.is_float(self.dtype)
            start = {"add": 0, "mul": 1, "max": -math.inf if fl else dtypes.min(self.dtype),
                     "min": math.inf if fl else dtypes.max(self.dtype)}[how]
            base = _scatter_flat(self, pos, Tensor.full(pos.shape, start, dtype=self.dtype, device=self.device), None)
        total = _scatter_flat(base, pos, s, how, ties_with=None if include_self else self)
        if reduce != "mean": return total
        ones = Tensor.ones(*pos.shape, dtype=dtypes.int32, device=self.device)
        count = _scatter_flat(Tensor.zeros(*self.shape, dtype=dtypes.int32, device=self.device), pos, ones, "add")
        n = count + 1 if include_self else count.maximum(1)
        if dtypes.is_float(self.dtype): return total / n.cast(self.dtype)
        return total.div(n.cast(self.dtype), rounding_mode="floor")

    # *** masks ***

    def masked_fill(self: Tensor, mask: Tensor, value: Tensor | ConstType) -> Tensor:
        """self where mask is False, value where it is True, in self's dtype. self, mask and value broadcast together
        (as tinygrad's and torch's; a value tensor of any broadcastable shape, as tinygrad's)."""
        Tensor = _T()
        if not isinstance(mask, Tensor) or mask.dtype != dtypes.bool:
            raise TypeError(f"masked_fill: mask must be a bool Tensor, got {getattr(mask, 'dtype', type(mask))}")
        value = value.cast(self.dtype) if isinstance(value, Tensor) else Tensor(value, device=self.device,
                                                                                   dtype=self.dtype)
        return mask.where(value, self)

    def nonzero(self: Tensor, size: int | None = None, fill_value: ConstType = 0) -> Tensor:
        """(count, ndim) positions (dtypes.default_int, as tinygrad) of the nonzero elements, in row-major order. The
        count depends on the data, so the tensor is realized and read once; with `size`, the result has `size` rows
        (cut, or padded with fill_value)."""
        Tensor = _T()
        flat = self.flatten().cast(dtypes.bool).tolist() if self.numel() else []
        pos = [i for i, b in enumerate(flat) if b]
        if size is not None:
            if size < 0: raise ValueError(f"nonzero size must be nonnegative, got {size}")
            rows = [list(_unravel(p, self.shape)) for p in pos[:size]] + \
                [[fill_value] * self.ndim] * max(0, size - len(pos))
        else: rows = [list(_unravel(p, self.shape)) for p in pos]
        if not rows or self.ndim == 0:
            return Tensor.zeros(len(rows), self.ndim, dtype=dtypes.default_int, device=self.device)
        return Tensor(rows, dtype=dtypes.default_int, device=self.device)

    def masked_select(self: Tensor, mask: Tensor, size: int | None = None, fill_value: ConstType = 0) -> Tensor:
        """The elements of self where mask (broadcast) is True, as a 1-D tensor."""
        Tensor = _T()
        from fusegrad.tensor import _broadcast_shape
        if not isinstance(mask, Tensor) or mask.dtype != dtypes.bool:
            raise TypeError(f"masked_select: mask must be a bool Tensor, got {getattr(mask, 'dtype', type(mask))}")
        shape = _broadcast_shape(self.shape, mask.shape)
        x, m = self._broadcast_to(shape).flatten(), mask._broadcast_to(shape).flatten()
        if size is None: return x[m]
        idx = m.nonzero(size, -1)[:, 0]
        return (idx >= 0).where(x._gather_adv([(0, idx)], True), fill_value)

    def one_hot(self: Tensor, num_classes: int = -1) -> Tensor:
        """One-hot vectors along a new last dim, in dtypes.default_int (int32) as tinygrad's; num_classes=-1 means
        max()+1 (reads the data). A class outside [0, num_classes) is an IndexError where CHECK_OOB reads the values
        (see the module's docstring), else its row is all zeros."""
        if not dtypes.is_int(self.dtype): raise TypeError(f"one_hot needs an integer tensor, got {self.dtype}")
        if not isinstance(num_classes, int) or num_classes < -1:
            raise ValueError(f"num_classes must be a nonnegative int or -1, got {num_classes!r}")
        if num_classes == -1:
            if self.numel() == 0: raise ValueError("one_hot can't infer num_classes from an empty tensor")
            num_classes = int(self.max().item()) + 1
            if self.min().item() < 0: raise IndexError(f"one_hot: class {self.min().item()} is negative")
        else: _check_index_values(self, num_classes, self.ndim, False, "one_hot: class")
        return _onehot(self, num_classes).cast(dtypes.default_int)

    # *** triangles and diagonals ***

    def _tri(self: Tensor, diagonal: int, lower: bool) -> Tensor:
        Tensor = _T()
        if self.ndim < 2: raise ValueError(f"tril/triu need a tensor with at least 2 dims, got shape {self.shape}")
        r, c = self.shape[-2:]
        rows = Tensor.arange(r, dtype=dtypes.int32, device=self.device).reshape(r, 1)
        cols = Tensor.arange(c, dtype=dtypes.int32, device=self.device).reshape(1, c)
        keep = (cols <= rows + diagonal) if lower else (cols >= rows + diagonal)
        return keep.where(self, False if self.dtype == dtypes.bool else 0)

    def tril(self: Tensor, diagonal: int = 0) -> Tensor:
        """The lower triangle of the last two dims (at and below `diagonal`); the rest is 0."""
        return self._tri(diagonal, True)

    def triu(self: Tensor, diagonal: int = 0) -> Tensor:
        """The upper triangle of the last two dims (at and above `diagonal`); the rest is 0."""
        return self._tri(diagonal, False)

    def diagonal(self: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
        """The diagonal of dims dim1 and dim2 (shifted by offset) as a new last dim, as PyTorch's diagonal."""
        if self.ndim < 2: raise ValueError(f"diagonal needs a tensor with at least 2 dims, got shape {self.shape}")
        a, b = _axis(dim1, self.ndim, "dim1"), _axis(dim2, self.ndim, "dim2")
        if a == b: raise ValueError(f"diagonal dimensions cannot be identical: {dim1}, {dim2}")
        x = self.permute([k for k in range(self.ndim) if k not in (a, b)] + [a, b])
        r, c = x.shape[-2:]
        r0, c0 = (0, offset) if offset >= 0 else (-offset, 0)
        n = max(0, min(r - r0, c - c0))
        lead = x.shape[:-2]
        x = x.shrink(tuple((0, s) for s in lead) + ((min(r0, r), min(r0, r) + n), (min(c0, c), min(c0, c) + n)))
        if n == 0: return x.reshape(lead + (0,))
        # in a flattened n x n block the diagonal is every (n+1)-th element
        x = x.reshape(lead + (n * n,)).pad(tuple((0, 0) for _ in lead) + ((0, n),))
        return x.reshape(lead + (n, n + 1)).shrink(tuple((0, s) for s in lead) + ((0, n), (0, 1))).reshape(lead + (n,))

    def diag(self: Tensor) -> Tensor:
        """A 1-D tensor becomes a diagonal matrix; a 2-D tensor gives its diagonal."""
        Tensor = _T()
        if self.ndim == 2: return self.diagonal()
        if self.ndim != 1: raise ValueError(f"diag needs a 1-D or 2-D tensor, got shape {self.shape}")
        n = self.shape[0]
        eye = Tensor.arange(n, device=self.device).reshape(n, 1) == Tensor.arange(n, device=self.device).reshape(1, n)
        return eye.where(self.reshape(1, n), False if self.dtype == dtypes.bool else 0)

    # *** rolls, repeats, splits ***

    def roll(self: Tensor, shifts: int | tuple[int, ...], dims: int | tuple[int, ...] | None = None) -> Tensor:
        """Shift elements along dims, wrapping around (PyTorch's roll; dims=None rolls the flattened tensor)."""
        if dims is None:
            if not isinstance(shifts, int): raise ValueError("roll with dims=None takes a single int shift")
            return self.flatten().roll(shifts, 0).reshape(self.shape)
        sh, dm = (shifts,) if isinstance(shifts, int) else tuple(shifts), (dims,) if isinstance(dims, int) else \
            tuple(dims)
        if len(sh) != len(dm): raise ValueError(f"roll: shifts {shifts} and dims {dims} must have the same length")
        x = self
        for s, d in zip(sh, dm):
            d = _axis(d, self.ndim)
            n = x.shape[d]
            if n == 0 or s % n == 0: continue
            s %= n
            both = x.cat(x, dim=d)
            x = both.shrink(tuple((n - s, 2 * n - s) if k == d else (0, z) for k, z in enumerate(x.shape)))
        return x

    def repeat(self: Tensor, repeats: Any, *args: int) -> Tensor:
        """Tile the tensor: repeats[i] copies along dim i (leading extra repeats add dims), as PyTorch's repeat."""
        reps = argfix(repeats, *args)
        if any(not isinstance(r, int) or r < 0 for r in reps): raise ValueError(f"repeat counts must be ints >= 0: "
                                                                                f"{reps}")
        if len(reps) < self.ndim: raise ValueError(f"repeat needs at least {self.ndim} counts, got {len(reps)}")
        shape = (1,) * (len(reps) - self.ndim) + self.shape
        x = self.reshape(tuple(d for s in shape for d in (1, s)))
        x = x.expand(tuple(d for r, s in zip(reps, shape) for d in (r, s)))
        return x.reshape(tuple(r * s for r, s in zip(reps, shape)))

    def repeat_interleave(self: Tensor, repeats: int, dim: int | None = None) -> Tensor:
        """Repeat each element `repeats` times along dim (the flattened tensor when dim is None)."""
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 0:
            raise ValueError(f"repeat_interleave repeats must be an int >= 0, got {repeats!r}")
        x = self.flatten() if dim is None else self
        d = 0 if dim is None else _axis(dim, self.ndim)
        if x.ndim == 0: x = x.reshape(1)
        x = x.unsqueeze(d + 1)
        x = x.expand(x.shape[:d + 1] + (repeats,) + x.shape[d + 2:])
        return x.reshape(x.shape[:d] + (x.shape[d] * repeats,) + x.shape[d + 2:])

    def split(self: Tensor, sizes: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
        """Pieces along dim: of `sizes` each (the last may be smaller), or of the listed sizes."""
        d = _axis(dim, self.ndim)
        n = self.shape[d]
        if isinstance(sizes, int):
            if sizes <= 0 and not (sizes == 0 and n == 0): raise ValueError(f"split size must be positive, got {sizes}")
            lens = [min(sizes, n - i) for i in range(0, n, sizes)] if n else [0]
        else:
            lens = list(sizes)
            if sum(lens) != n or any(s < 0 for s in lens):
                raise ValueError(f"split sizes {lens} must be nonnegative and sum to the dim size {n}")
        out, at = [], 0
        for s in lens:
            out.append(self.shrink(tuple((at, at + s) if k == d else (0, z) for k, z in enumerate(self.shape))))
            at += s
        return tuple(out)

    def chunk(self: Tensor, chunks: int, dim: int = 0) -> list[Tensor]:
        """At most `chunks` pieces along dim, each of ceil(size / chunks) elements (the last may be smaller)."""
        if not isinstance(chunks, int) or chunks <= 0: raise ValueError(f"chunk count must be a positive int: {chunks}")
        n = self.shape[_axis(dim, self.ndim)]
        return list(self.split(max(1, math.ceil(n / chunks)), dim)) if n else [self] * chunks

    # *** einops ***

    def rearrange(self: Tensor, formula: str, **sizes: int) -> Tensor:
        """einops-style reshape/permute: 'b (h w) c -> b h w c' with h=... for sizes the formula can't infer."""
        if "->" not in formula: raise ValueError(f"rearrange formula needs '->': {formula!r}")
        lhs, rhs = (_parse_side(s, formula) for s in formula.split("->", 1))
        lnames = [n for g in lhs for n in g]
        rnames = [n for g in rhs for n in g]
        if sorted(lnames) != sorted(rnames) or len(set(lnames)) != len(lnames):
            raise ValueError(f"rearrange: both sides must name the same axes once each: {formula!r}")
        has_ell = "..." in lnames
        if len(lhs) - has_ell > self.ndim or not has_ell and len(lhs) != self.ndim:
            raise ValueError(f"rearrange: {formula!r} has {len(lhs)} groups on the left, the tensor {self.ndim} dims")
        ell = self.ndim - (len(lhs) - 1) if has_ell else 0
        dims: dict[str, tuple[int, ...]] = {}
        flat_shape: list[int] = []
        k = 0
        for g in lhs:
            if g == ["..."]:
                dims["..."] = self.shape[k:k + ell]; flat_shape += list(dims["..."]); k += ell; continue
            total = self.shape[k]; k += 1
            known = {n: sizes[n] for n in g if n in sizes}
            unknown = [n for n in g if n not in known]
            if len(unknown) > 1: raise ValueError(f"rearrange: can't infer the sizes of {unknown} in {formula!r}")
            rest = total // max(1, prod(known.values())) if unknown else 1
            if prod(known.values()) * rest != total:
                raise ValueError(f"rearrange: sizes {known} don't divide dim of size {total} in {formula!r}")
            for n in g:
                dims[n] = (known.get(n, rest),); flat_shape.append(dims[n][0])
        order = [lnames.index(n) for n in rnames]
        # '...' may stand for several dims: expand the permutation over them
        pos, at = {}, 0
        for n in lnames: pos[n] = list(range(at, at + len(dims[n]))); at += len(dims[n])
        x = self.reshape(tuple(flat_shape)).permute([p for i in order for p in pos[lnames[i]]])
        out = [s for g in rhs for s in (dims["..."] if g == ["..."] else (prod(d for n in g for d in dims[n]),))]
        return x.reshape(tuple(out))

def _parse_side(side: str, formula: str) -> list[list[str]]:
    """'a (b c) ...' -> [['a'], ['b', 'c'], ['...']]."""
    groups: list[list[str]] | None = []
    cur: list[str] | None = None
    for tok in side.replace("(", " ( ").replace(")", " ) ").split():
        if tok == "(":
            if cur is not None: raise ValueError(f"rearrange: nested parentheses in {formula!r}")
            cur = []
        elif tok == ")":
            if cur is None: raise ValueError(f"rearrange: unbalanced parentheses in {formula!r}")
            groups.append(cur); cur = None
        elif tok == "1":
            # a unit axis; inside parentheses a factor of 1 changes nothing
            if cur is None: groups.append([])
        elif not (tok == "..." or tok.isidentifier()): raise ValueError(f"rearrange: bad axis name {tok!r}")
        elif cur is not None: cur.append(tok)
        else: groups.append([tok])
    if cur is not None: raise ValueError(f"rearrange: unbalanced parentheses in {formula!r}")
    return groups

def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape): out.append(i % s); i //= s
    return tuple(reversed(out))
