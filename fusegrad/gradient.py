"""Reverse-mode autodiff as a rewrite of the tensor graph: one derivative rule per op, applied from the root in reverse
topological order. The result is an ordinary lazy graph, so it schedules and fuses like any other.

Where the derivative is not unique the rules follow torch:
- elementwise MAX of two equal inputs gives each half of the gradient (torch.maximum); where one is nan, both get all
  of it;
- a MAX reduction splits the gradient evenly among the elements equal to the maximum (the nans, if it is nan). torch
  does the same for `x.max()` and `x.amax(dim)`, but `x.max(dim)` (which returns indices) gives it all to the one
  element at the returned index;
- functions with a kink whose convention differs from these (relu, clamp, hardtanh, pow at 0, ...) carry their own
  rule (with_gradient below).
"""
from __future__ import annotations
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar
from fusegrad.dtype import dtypes, sum_acc_dtype
from fusegrad.helpers import rng_counter_of
from fusegrad.schedule.simplify import const_view
from fusegrad.uop.graph import StructureWalk, bound_variables, new_buffer, substitute_map
from fusegrad.uop.ops import GroupOp, Ops, UOp, _arg_key
from fusegrad.uop.pattern import PatternMatcher, UPat

# *** tensor-level graph building (constants carry a device and the shape of the value they stand in for) ***

def _const(like: UOp, v: float | int | bool, dtype=None) -> UOp:
    return const_view(v, dtype or like.dtype, UOp(Ops.DEVICE, arg=like.device), like.shape)

def _alu(op: Ops, *src: UOp) -> UOp:
    dt = dtypes.bool if op in GroupOp.Comparison else src[-1].dtype
    return UOp(op, dt, src)

def _mul(a: UOp, b: UOp) -> UOp: return _alu(Ops.MUL, a, b)
def _neg(a: UOp) -> UOp: return _alu(Ops.NEG, a)
def _recip(a: UOp) -> UOp: return _alu(Ops.RECIP, a)
def _scale(a: UOp, v: float) -> UOp: return _mul(a, _const(a, v))
def _where(c: UOp, a: UOp, b: UOp) -> UOp: return _alu(Ops.WHERE, c, a, b)
def _zero(like: UOp) -> UOp: return _const(like, 0)

def _sum_to(g: UOp, axes: tuple[int, ...]) -> UOp:
    """`g` summed over `axes` (kept as size 1), accumulated in at least float32 and returned in g's dtype."""
    if not axes: return g
    acc = sum_acc_dtype(g.dtype)
    return g.cast(acc).r(Ops.ADD, axes).cast(g.dtype)

def _expand_to(g: UOp, shape: tuple[int, ...]) -> UOp: return g if g.shape == shape else g.expand(shape)

# *** the rules: each gets the upstream gradient `ctx` and the node, and returns one gradient (or None) per source ***

def _no_grad(ret: UOp) -> tuple[None, ...]: return (None,) * len(ret.src)

def _max_grad(ctx: UOp, ret: UOp) -> tuple[UOp, UOp]:
    x, y = ret.src
    half = _scale(ctx, 0.5)
    eq = _alu(Ops.CMPEQ, x, y)
    # the smaller input gets nothing; unordered (nan) inputs both get the gradient, as torch.maximum
    return (_where(eq, half, _where(_alu(Ops.CMPLT, x, y), _zero(ctx), ctx)),
            _where(eq, half, _where(_alu(Ops.CMPLT, y, x), _zero(ctx), ctx)))

def _pow_grad(ctx: UOp, ret: UOp) -> tuple[UOp, UOp]:
    x, y = ret.src
    dx = _mul(y, _alu(Ops.POW, x, _alu(Ops.ADD, y, _const(y, -1))))
    dy = _mul(ret, _scale(_alu(Ops.LOG2, x), math.log(2)))
    return _mul(ctx, dx), _mul(ctx, dy)

def _reduce_grad(ctx: UOp, ret: UOp) -> tuple[UOp]:
    x = ret.src[0]
    op, axes = ret.arg
    g = _expand_to(ctx, x.shape)
    if op is Ops.ADD: return (g,)
    r = _expand_to(ret, x.shape)
    if op is Ops.MAX:
        # every element equal to the maximum gets an equal share (every nan, where the maximum is nan)
        is_max = _alu(Ops.CMPEQ, x, r)
        if dtypes.is_float(x.dtype):
            is_max = _alu(Ops.OR, is_max, _alu(Ops.AND, _alu(Ops.CMPNE, x, x), _alu(Ops.CMPNE, r, r)))
        is_max = is_max.cast(ctx.dtype)
        count = _expand_to(_sum_to(is_max, axes), x.shape)
        return (_mul(g, _alu(Ops.FDIV, is_max, count)),)
    if op is Ops.MUL:
        # d prod / d x_i is the product of the others: prod/x_i without zeros; with one zero only that element gets
        # the product of the nonzero ones; with two or more zeros every such product is 0
        is_zero = _alu(Ops.CMPEQ, x, _zero(x))
        zeros = _expand_to(_sum_to(is_zero.cast(x.dtype), axes), x.shape)
        nonzero_prod = _expand_to(_where(is_zero, _const(x, 1), x).r(Ops.MUL, axes), x.shape)
        one_zero = _alu(Ops.CMPEQ, zeros, _const(zeros, 1))
        no_zero = _alu(Ops.CMPEQ, zeros, _zero(zeros))
        d = _where(no_zero, _alu(Ops.FDIV, r, _where(is_zero, _const(x, 1), x)),
                   _where(one_zero, _where(is_zero, nonzero_prod, _zero(x)), _zero(x)))
        return (_mul(g, d),)
    raise NotImplementedError(f"no gradient for a {op} reduction")

def _expand_grad(ctx: UOp, ret: UOp) -> tuple[UOp]:
    src_shape = ret.src[0].shape
    axes = tuple(i for i, (s, o) in enumerate(zip(src_shape, ret.shape)) if s != o)
    return (_sum_to(ctx, axes),)

def _permute_grad(ctx: UOp, ret: UOp) -> tuple[UOp]:
    inverse = [0] * len(ret.arg)
    for i, a in enumerate(ret.arg): inverse[a] = i
    return (ctx.permute(tuple(inverse)),)

def _cast_grad(ctx: UOp, ret: UOp) -> tuple[UOp | None]:
    src_dt = ret.src[0].dtype
    return (ctx.cast(src_dt),) if dtypes.is_float(src_dt) and dtypes.is_float(ret.dtype) else (None,)

def _copy_grad(ctx: UOp, ret: UOp) -> tuple[UOp | None, None]:
    dev = ret.src[0].device
    return (ctx if ctx.device == dev else UOp(Ops.COPY, ctx.dtype, (ctx, UOp(Ops.DEVICE, arg=dev)))), None

LN2 = math.log(2)

pm_gradient = PatternMatcher([
    # arithmetic
    (UPat(Ops.ADD, name="ret"), lambda ctx, ret: (ctx, ctx)),
    (UPat(Ops.SUB, name="ret"), lambda ctx, ret: (ctx, _neg(ctx))),
    (UPat(Ops.MUL, name="ret"), lambda ctx, ret: (_mul(ctx, ret.src[1]), _mul(ctx, ret.src[0]))),
    (UPat(Ops.MULACC, name="ret"), lambda ctx, ret: (_mul(ctx, ret.src[1]), _mul(ctx, ret.src[0]), ctx)),
    (UPat(Ops.FDIV, name="ret"), lambda ctx, ret: (_alu(Ops.FDIV, ctx, ret.src[1]),
                                                   _neg(_mul(ctx, _alu(Ops.FDIV, ret, ret.src[1]))))),
    (UPat(Ops.NEG, name="ret"), lambda ctx, ret: (_neg(ctx),)),
    (UPat(Ops.RECIP, name="ret"), lambda ctx, ret: (_neg(_mul(ctx, _mul(ret, ret))),)),
    (UPat(Ops.SQRT, name="ret"), lambda ctx, ret: (_mul(ctx, _recip(_scale(ret, 2))),)),
    (UPat(Ops.EXP2, name="ret"), lambda ctx, ret: (_mul(ctx, _scale(ret, LN2)),)),
    (UPat(Ops.LOG2, name="ret"), lambda ctx, ret: (_mul(ctx, _recip(_scale(ret.src[0], LN2))),)),
    # sin' = cos, and cos(x) = sin(pi/2 - x)
    (UPat(Ops.SIN, name="ret"), lambda ctx, ret: (
        _mul(ctx, _alu(Ops.SIN, _alu(Ops.ADD, _const(ret, math.pi / 2), _neg(ret.src[0])))),)),
    (UPat(Ops.POW, name="ret"), _pow_grad),
    (UPat(Ops.MAX, name="ret"), _max_grad),
    # the condition gets nothing; each branch gets the gradient where it was chosen
    (UPat(Ops.WHERE, name="ret"), lambda ctx, ret: (None, _where(ret.src[0], ctx, _zero(ctx)),
                                                    _where(ret.src[0], _zero(ctx), ctx))),
    # piecewise constant: zero almost everywhere (as torch's trunc/floor/ceil)
    (UPat(Ops.TRUNC, name="ret"), lambda ctx, ret: (_zero(ctx),)),
    # comparisons and integer or bitwise ops carry no gradient
    (UPat(GroupOp.Comparison | {Ops.IDIV, Ops.MOD, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR, Ops.NOT,
                                Ops.THREEFRY, Ops.BITCAST}, name="ret"), _no_grad),
    (UPat(Ops.CAST, name="ret"), _cast_grad),
    # reductions and movement: each movement's gradient is its inverse movement
    (UPat(Ops.REDUCE_AXIS, name="ret"), _reduce_grad),
    (UPat(Ops.RESHAPE, name="ret"), lambda ctx, ret: (ctx.reshape(ret.src[0].shape),)),
    (UPat(Ops.PERMUTE, name="ret"), _permute_grad),
    (UPat(Ops.EXPAND, name="ret"), _expand_grad),
    (UPat(Ops.PAD, name="ret"), lambda ctx, ret: (
        ctx.shrink(tuple((b, b + s) for (b, _), s in zip(ret.arg, ret.src[0].shape))),)),
    (UPat(Ops.SHRINK, name="ret"), lambda ctx, ret: (
        ctx.pad(tuple((b, s - e) for (b, e), s in zip(ret.arg, ret.src[0].shape))),)),
    (UPat(Ops.FLIP, name="ret"), lambda ctx, ret: (ctx.flip(ret.arg),)),
    # buffers and copies: the value passes through; DETACH stops it, an assign's old target contributes nothing
    (UPat(Ops.CONTIGUOUS, name="ret"), lambda ctx, ret: (ctx,)),
    (UPat(Ops.CONTIGUOUS_BACKWARD, name="ret"), lambda ctx, ret: (UOp(Ops.CONTIGUOUS, ctx.dtype, (ctx,)),)),
    # a value with a user-given gradient: src[0] is the (detached) value, arg computes the inputs' gradients
    (UPat(Ops.CUSTOM_GRAD, name="ret"), lambda ctx, ret: (None,) + ret.arg(ctx, ret.src[1:])),
    # an elementwise function built as one node: its arg knows the gradients (tensor/composite.py)
    (UPat(Ops.COMPOSITE, name="ret"), lambda ctx, ret: ret.arg.gradients(ctx, ret.src)),
    (UPat(Ops.DETACH, name="ret"), _no_grad),
    (UPat(Ops.COPY, name="ret"), _copy_grad),
    (UPat(Ops.ASSIGN, name="ret"), lambda ctx, ret: (None, ctx)),
], name="gradient")
pm_gradient.__doc__ = "Each rule maps a node's gradient to one gradient per source, of that source's shape and dtype."

# *** derivatives by convention: a value computed as usual whose gradient is a rule's (torch's choice at a kink) ***

def with_gradient(value: Any, ins: tuple[Any, ...], rule: Callable) -> Any:
    """The tensor `value` whose gradient with respect to the tensors `ins` is rule(grad, ins) (UOps in, one UOp or None
    per input out) instead of the derivative of value's own graph. The forward graph, and so its kernels, stays
    value's own: the node vanishes before scheduling. Rules are frozen dataclasses with `pure` set, so a graph made
    again compares equal (the schedule and gradient caches key on it)."""
    from fusegrad.tensor import Tensor
    if not dtypes.is_float(value.dtype): return value
    return Tensor(UOp(Ops.CUSTOM_GRAD, value.dtype, (UOp(Ops.DETACH, value.dtype, (value.uop,)),
                                                     *(t.uop for t in ins)), rule))

def clamped(x: Any, lo: Any, hi: Any, closed: bool, nan_passes: bool = False) -> Any:
    """The tensor x clamped to [lo, hi] (tensors or numbers; None: no bound) with ClampGradient's rule."""
    if lo is None and hi is None: raise ValueError("clip needs at least one of min_ or max_")
    xs, bounds = x, []
    for b in (lo, hi):
        if b is not None:
            xs, bt = xs._broadcasted(b)
            bounds.append(bt)
    bounds = [b._broadcast_to(xs.shape).cast(xs.dtype) for b in bounds]
    value = xs if lo is None else xs.maximum(bounds[0])
    if hi is not None: value = value.minimum(bounds[-1])
    return with_gradient(value, (xs, *bounds), ClampGradient(lo is not None, hi is not None, closed, nan_passes))

@dataclass(frozen=True)
class ClampGradient:
    """The gradient of x clamped to [lo, hi] (ins: x, then the bounds present, all of one shape). closed=True is
    torch.clamp's: x gets the gradient where lo <= x <= hi (not where x is nan), a bound where it was chosen (hi too
    where lo > hi). closed=False is relu's, hardtanh's and hardsigmoid's: x gets it where lo < x < hi; with nan_passes
    also where x is nan (torch's relu and hardtanh pass it there, its hardsigmoid doesn't)."""
    pure: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True   # (inputs of the value's shape: sharded alike)
    has_lo: bool
    has_hi: bool
    closed: bool
    nan_passes: bool = False

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp | None, ...]:
        from fusegrad.tensor import Tensor
        g, x = Tensor(grad), Tensor(ins[0])
        lo = Tensor(ins[1]) if self.has_lo else None
        hi = Tensor(ins[1 + self.has_lo]) if self.has_hi else None
        if self.closed:
            inside = (x >= lo if lo is not None else None, x <= hi if hi is not None else None)
        else:
            inside = (x > lo if lo is not None else None, x < hi if hi is not None else None)
        keep = inside[0] & inside[1] if lo is not None and hi is not None else inside[0] if lo is not None \
            else inside[1]
        if self.nan_passes and dtypes.is_float(x.dtype): keep = keep | x.isnan()
        ret: list[UOp | None] = [keep.where(g, 0.0).uop]
        if lo is not None:
            chosen = x < lo if hi is None else (x < lo) & (lo < hi)
            ret.append(chosen.where(g, 0.0).uop)
        if hi is not None:
            chosen = x > hi if lo is None else (x > hi) | (hi < lo)
            ret.append(chosen.where(g, 0.0).uop)
        return tuple(ret)

@dataclass(frozen=True)
class PowGradient:
    """The gradient of a ** b (ins: a, b, float, of one shape) as torch's: a gets b * a^(b-1), 0 where b is 0; b gets
    a^b * log(a), 0 where a is 0 and b >= 0. (The derivative of the formula the value is computed with would be nan
    at a = 0 and 0 where its special cases pick a constant.)"""
    pure: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True   # (inputs of the value's shape: sharded alike)

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp, UOp]:
        from fusegrad.tensor import Tensor
        g, a, b = Tensor(grad), Tensor(ins[0]), Tensor(ins[1])
        da = (b == 0).where(0.0, b * a.pow(b - 1))
        db = ((a == 0) & (b >= 0)).where(0.0, a.pow(b) * a.log())
        return (g * da).uop, (g * db).uop

# derivatives in terms of the function's own value: finite for every x, where the derivative of the formula the value is
# computed with meets 0 * inf once exp overflows (1 / (1 + exp(-x)) at x = -1000)
_VALUE_DERIVATIVES: dict[str, Callable[[Any], Any]] = {
    "exp": lambda x: x.exp(),
    "sigmoid": lambda x: (s := x.sigmoid()) * (1 - s),
    "tanh": lambda x: 1 - x.tanh().square(),
}

@dataclass(frozen=True)
class UnaryGradient:
    """The gradient of a unary function named in _VALUE_DERIVATIVES (ins: its float input)."""
    pure: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True   # (inputs of the value's shape: sharded alike)
    name: str

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp]:
        from fusegrad.tensor import Tensor
        return (Tensor(grad) * _VALUE_DERIVATIVES[self.name](Tensor(ins[0]))).uop,

@dataclass(frozen=True)
class IndexGradient:
    """The gradient of values picked along the last axis at int indices (ins: x (..., n), the indices (..., m)): each
    value's gradient goes to the one element it was picked from (cummax/cummin, as torch)."""
    pure: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True   # (inputs of the value's shape: sharded alike)

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp, None]:
        from fusegrad.tensor import Tensor
        g, x, idx = Tensor(grad), Tensor(ins[0]), Tensor(ins[1])
        n = x.shape[-1]
        hit = idx.unsqueeze(-1) == Tensor.arange(n, device=x.device)   # (..., m, n)
        return hit.where(g.unsqueeze(-1), 0.0).sum(-2).cast(x.dtype).uop, None

# nodes whose sources are not values (leaves of the tensor graph), and DETACH, which stops the walk
_LEAVES = {Ops.BUFFER, Ops.CONST, Ops.DEVICE, Ops.RANGE, Ops.DEFINE_VAR, Ops.BIND, Ops.KERNEL, Ops.UNIQUE}

def compute_gradient(root: UOp, root_grad: UOp, targets: set[UOp], walk: StructureWalk | None = None) \
        -> dict[UOp, UOp]:
    """The gradient of `root` (seeded with `root_grad`) with respect to every node on a path from root to a target.
    Targets the root does not depend on are absent from the result. (`walk`: the StructureWalk of [root, root_grad],
    if the caller made it.)"""
    return compute_gradients({root: root_grad}, targets, walk=walk)

def compute_gradients(seeds: dict[UOp, UOp], targets: set[UOp], leaves: frozenset[UOp] = frozenset(),
                      walk: StructureWalk | None = None) -> dict[UOp, UOp]:
    """compute_gradient of several roots at once (the sum of their seeded gradients), e.g. the shards of a tensor
    split over devices. Gradients don't pass below `leaves` (shards that are copies of one another are each a
    variable of their own). (`walk`: the StructureWalk of the roots, then the seeds, if the caller made it.)"""
    for root, root_grad in seeds.items():
        if root_grad.shape != root.shape:
            raise ValueError(f"gradient shape {root_grad.shape} != tensor shape {root.shape}")
    if leaves: return _derive(seeds, targets, leaves)
    return _cached_gradients(seeds, targets, walk)

def _derive(seeds: dict[UOp, UOp], targets: set[UOp], leaves: frozenset[UOp] = frozenset()) -> dict[UOp, UOp]:
    """compute_gradients by applying the rules."""
    sink = UOp.sink_of(*seeds)
    topo = [u for u in sink.toposort(gate=lambda u: u.op not in _LEAVES and u.op is not Ops.DETACH) if u is not sink]
    # only nodes that lead to a target need a gradient
    on_path: dict[UOp, bool] = {}
    for u in topo: on_path[u] = u in targets or any(on_path.get(s, False) for s in u.src)
    grads: dict[UOp, UOp] = dict(seeds)
    for u in reversed(topo):
        if (g := grads.get(u)) is None or u.op in _LEAVES or u in leaves: continue
        if not any(on_path.get(s, False) for s in u.src): continue
        src_grads = pm_gradient.rewrite(u, ctx=g)
        if src_grads is None: raise NotImplementedError(f"no gradient rule for {u.op}")
        assert isinstance(src_grads, tuple) and len(src_grads) == len(u.src), f"bad gradient rule for {u.op}"
        for s, sg in zip(u.src, src_grads):
            if sg is None or not on_path.get(s, False): continue
            assert sg.shape == s.shape, f"gradient of {u.op} has shape {sg.shape}, its source {s.shape}"
            if sg.dtype != s.dtype: sg = sg.cast(s.dtype)
            # a node used more than once sums the gradients of its uses
            grads[s] = sg if s not in grads else _alu(Ops.ADD, grads[s], sg)
    return {u: g for u, g in grads.items() if u in targets}

# *** the gradient cache: a training loop differentiates a graph of the same structure every step ***
#
# The rules are a function of the graph's structure: its ops, dtypes, args and constants' values, but not of which
# buffers it reads. So the gradients of a structure seen before are its cached gradient graph, built over
# placeholder buffers, with this graph's buffers substituted: the nodes made are the same ones the rules would make
# (hash-consing: the forward nodes that gradients use come out as the graph's own nodes). A structure is cached the
# second time it is seen (a graph whose constants all change every step never repeats). Not cached:
# graphs with bound Variables and user gradient functions (CUSTOM_GRAD rules without `pure = True`), which may
# depend on more than the structure.

@dataclass
class _GradientTemplate:
    nodes: tuple[tuple[int, UOp], ...]     # (toposort position of a graph node the gradients use, its stand-in)
    targets: tuple[int, ...]               # the targets' toposort positions, in the order of `sink`'s sources
    sink: UOp                              # the targets' gradients over the stand-ins
    topo: tuple[UOp, ...]                  # sink's toposort down to the stand-ins

GRADIENT_CACHE_SIZE = 128
_gradient_cache: dict[tuple, _GradientTemplate | None] = {}   # None: seen once
gradient_cache_stats = {"hits": 0, "misses": 0}

def _cached_gradients(seeds: dict[UOp, UOp], targets: set[UOp], walk: StructureWalk | None = None) \
        -> dict[UOp, UOp]:
    # one walk gives the toposort and the structure key. (The order of a toposort is a function of the graph's
    # structure, so positions in it name the same nodes in graphs of the same structure)
    if walk is None: walk = StructureWalk().walk([*seeds, *seeds.values()])
    position = walk.position
    topo = list(position)
    # (a random counter only seeds the generator, which the rules never look into: keyed by position, not value, so a
    # step with dropout, whose counters are new every step, finds the template too)
    values = tuple(None if c.dtype == dtypes.uint64 and rng_counter_of(c.arg) is not None else _arg_key(c.arg)
                   for c in walk.consts)
    key = (walk.key(), values, tuple(sorted(position[t] for t in targets if t in position)))
    if (template := _gradient_cache.get(key)) is not None:
        gradient_cache_stats["hits"] += 1
        new = substitute_map(template.sink, {p: topo[i] for i, p in template.nodes}, topo=template.topo)
        # a node made again has its template's shape (the stand-ins have their nodes' shapes): known now, not
        # computed node by node where something asks for a gradient's shape (an optimizer's step)
        for u in template.topo:
            if "_shape" not in (d := new[u].__dict__): d["_shape"] = u.__dict__["_shape"]
        # (and a gradient its template's device: an optimizer asks for it too)
        for g in template.sink.src:
            if "_device" not in (d := new[g].__dict__): d["_device"] = g.__dict__["_device"]
        return {topo[i]: new[g] for i, g in zip(template.targets, template.sink.src)}
    # (checked after the look-up: a template is made only for a structure that passes, and what is checked, the ops and
    # args, is in the key)
    if bound_variables(topo) or any(u.op is Ops.CUSTOM_GRAD and not getattr(u.arg, "pure", False) for u in topo):
        return _derive(seeds, targets)
    gradient_cache_stats["misses"] += 1
    grads = _derive(seeds, targets)
    if key in _gradient_cache:
        # the graph's buffers become placeholders, and the graph's nodes that the gradients use are found by position
        # (only the nodes the rules made are made again)
        order = list(grads)
        over = substitute_map(UOp.sink_of(*grads.values()),
                              {u: new_buffer(u.src[0], u.arg[1], u.dtype) for u in topo if u.op is Ops.BUFFER})
        nodes = tuple((i, over[u]) for i, u in enumerate(topo) if u in over)
        sink = UOp.sink_of(*(over[grads[t]] for t in order))
        stand_ins = {p for _, p in nodes}
        template_topo = tuple(sink.toposort(gate=lambda u: u not in stand_ins))
        for u in template_topo: u.shape   # (computed once, for the nodes made from the template)
        for g in sink.src: g.device
        _gradient_cache[key] = _GradientTemplate(nodes, tuple(position[t] for t in order), sink, template_topo)
    else:
        while len(_gradient_cache) >= GRADIENT_CACHE_SIZE: _gradient_cache.pop(next(iter(_gradient_cache)))
        _gradient_cache[key] = None
    return grads
