"""Step 1 of scheduling: simplify the tensor graph before any fusion decision is made."""
from __future__ import annotations
from collections import OrderedDict
from fusegrad.dtype import dtypes
from fusegrad.helpers import prod
from fusegrad.uop.ops import GroupOp, Ops, UOp, _arg_key, buffer_node, exec_alu, resolve
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ASSIGN, _BITCAST, _BUFFER, _CONST, _DEVICE = Ops.ASSIGN, Ops.BITCAST, Ops.BUFFER, Ops.CONST, Ops.DEVICE
_EXPAND, _FLIP, _KERNEL, _PAD, _PERMUTE, _RESHAPE = Ops.EXPAND, Ops.FLIP, Ops.KERNEL, Ops.PAD, Ops.PERMUTE, Ops.RESHAPE
_SHRINK, _SINK = Ops.SHRINK, Ops.SINK

# the constant views made last, kept alive: a training step makes the same ones every step (its 0.9s and 1e-8s at
# each parameter's shape), and a live view is found by hash-consing instead of made again with its shape
_recent_const_views: OrderedDict[tuple, UOp] = OrderedDict()
RECENT_CONST_VIEWS = 512

def const_view(value, dtype, device: UOp, shape: tuple[int, ...]) -> UOp:
    """A tensor-level constant: a 0-d CONST on `device`, reshaped and broadcast to `shape`."""
    # (looked up by the Python number as given, which _arg_key tells apart from any other: most are already the
    # dtype's, and as_const gives one value for it; numpy scalars, which compare equal across kinds, are made one first)
    if (t := type(value)) is not float and t is not int and t is not bool: value = dtypes.as_const(value, dtype)
    key = (_arg_key(value), dtype, device, shape)
    if (ret := _recent_const_views.get(key)) is not None:
        _recent_const_views.move_to_end(key)
        return ret
    ret = c = UOp(_CONST, dtype, (device,), dtypes.as_const(value, dtype))
    if shape != (): ret = c.reshape((1,) * len(shape)).expand(shape) if any(s != 1 for s in shape) else c.reshape(shape)
    _recent_const_views[key] = ret
    if len(_recent_const_views) > RECENT_CONST_VIEWS: _recent_const_views.popitem(last=False)
    return ret

def const_value(u: UOp):
    """The value of every element of `u` if it is a view of a constant that stays uniform (no PAD), else None."""
    while u.op in GroupOp.Movement:
        if u.op is _PAD: return None
        u = u.src[0]
    return u.arg if u.op is _CONST and u.src else None

def _device_of(u: UOp) -> UOp: return UOp(_DEVICE, arg=u.device)

def _fold_alu(a: UOp) -> UOp | None:
    vals = [const_value(s) for s in a.src]
    if any(v is None for v in vals): return None
    return const_view(exec_alu(a.op, a.dtype, tuple(vals)), a.dtype, _device_of(a), a.shape)

def _fold_cast(c: UOp) -> UOp | None:
    if (v := const_value(c.src[0])) is None or c.op is _BITCAST: return None
    return const_view(v, c.dtype, _device_of(c), c.shape)

def _movement_of_const(m: UOp) -> UOp | None:
    # a uniform constant stays a constant under any movement but PAD; rebuild it in canonical form
    if m.op is _PAD or (v := const_value(m)) is None: return None
    canonical = const_view(v, m.dtype, _device_of(m), m.shape)
    return canonical if canonical is not m else None

def _size_zero(x: UOp) -> UOp | None:
    if x.op in (_BUFFER, _CONST, _SINK, _KERNEL, _DEVICE, _ASSIGN) or x.shape is None: return None
    if prod(x.shape) != 0 or (x.op is _EXPAND and x.src[0].op is _RESHAPE and x.src[0].src[0].op is _CONST):
        return None
    return const_view(0, x.dtype, _device_of(x), x.shape)

def _is_noop_movement(m: UOp) -> bool:
    src_shape = m.src[0].shape
    if m.op in (_RESHAPE, _EXPAND): return m.arg == src_shape
    if m.op is _PERMUTE: return m.arg == tuple(range(len(m.arg)))
    if m.op is _PAD: return all(b == 0 and e == 0 for b, e in m.arg)
    if m.op is _SHRINK: return all(b == 0 and e == s for (b, e), s in zip(m.arg, src_shape))
    # (a symbolic size that may be above 1 keeps the flip)
    if m.op is _FLIP: return not any(f for f, s in zip(m.arg, src_shape) if resolve(s > 1))
    return False

def _expanded(c: UOp) -> UOp: return c.arg.expand(c.src)

expand_composites_pm = PatternMatcher([(UPat(Ops.COMPOSITE, name="c"), _expanded)], name="expand_composites")
expand_composites_pm.__doc__ = "No COMPOSITE node is left: each is the graph of its function (tensor/composite.py)."

def expand_composites(u: UOp) -> UOp:
    """`u`'s graph with every COMPOSITE node replaced by its function's graph: what the scheduler sees of it."""
    return graph_rewrite(u, expand_composites_pm, name="expand_composites")

sym_tensor = PatternMatcher([
    # constant folding: ALU and CAST of uniform constants are constants
    (UPat(GroupOp.ALU, name="a"), _fold_alu),
    (UPat((Ops.CAST, Ops.BITCAST), name="c"), _fold_cast),
    # cast to the same dtype, detach (no autodiff in the schedule), and an empty reduce do nothing
    (UPat(Ops.CAST, name="c"), lambda c: c.src[0] if c.src[0].dtype == c.dtype else None),
    (UPat(Ops.DETACH, name="d"), lambda d: d.src[0]),
    (UPat((Ops.CONTIGUOUS_BACKWARD, Ops.CUSTOM_GRAD), name="d"), lambda d: d.src[0]),
    # an elementwise function built as one node becomes its graph
    (UPat(Ops.COMPOSITE, name="c"), _expanded),
    # a reduction over no axis, or over axes of size 1 only, is its source
    (UPat(Ops.REDUCE_AXIS, name="r"), lambda r: r.src[0] if all(r.src[0].shape[a] == 1 for a in r.arg[1]) else None),
    # movement: no-ops vanish, reshapes merge, constants stay canonical
    (UPat(GroupOp.Movement, name="m"), lambda m: m.src[0] if _is_noop_movement(m) else None),
    (UPat(Ops.RESHAPE, src=(UPat(Ops.RESHAPE, name="inner"),), name="m"),
     lambda m, inner: inner.src[0].reshape(m.arg)),
    (UPat(GroupOp.Movement, name="m"), _movement_of_const),
    # a contiguous copy of something already contiguous in memory is that thing
    (UPat(Ops.CONTIGUOUS, name="c"), lambda c: c.src[0] if buffer_node(c.src[0]) is not None else None),
    # size-0 tensors hold nothing: replace them by a constant so no kernel reads or writes them
    (UPat(name="x"), _size_zero),
], name="sym_tensor")
sym_tensor.__doc__ = "Composites expanded, constants folded, no-op movements removed, size-0 values constant: the " \
    "graph is canonical."
