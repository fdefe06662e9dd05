"""Small analyses of index expressions shared by the optimizer, the lowerer and the renderers: which RANGEs a node
depends on and the (constant) coefficient of a RANGE in an affine index."""
from __future__ import annotations
from collections.abc import Iterable
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _CAST, _CONST, _END, _MUL, _NEG, _RANGE = Ops.ADD, Ops.CAST, Ops.CONST, Ops.END, Ops.MUL, Ops.NEG, Ops.RANGE
_SUB = Ops.SUB

def range_kind(r: UOp) -> str: return r.arg[1]
def range_size(r: UOp) -> int | UOp:
    """The trip count of a RANGE: an int when constant, else the (symbolic) end expression."""
    return r.src[0].arg if r.src[0].op is _CONST else r.src[0]

def base_and_offset(x: UOp) -> tuple[UOp | None, int]:
    """An index expression as (its part that isn't a constant, or None, and the constant added to it)."""
    if x.op is _CONST: return None, x.arg
    if x.op is _ADD and x.src[1].op is _CONST: return x.src[0], x.src[1].arg
    return x, 0

def coeff(x: UOp, r: UOp, memo: dict[UOp, int | None] | None = None) -> int | None:
    """c such that x == c*r + (terms without r), or None when r appears non-affinely (or with a symbolic factor).
    `memo`: the coefficients of r in nodes seen before (kept by a caller asking about many expressions of one
    kernel, which share most of their terms): read and extended."""
    c: dict[UOp, int | None] = {} if memo is None else memo
    if (known := c.get(x, c)) is not c: return known
    for u in x.toposort(gate=lambda u: u not in c) if c else x.toposort():
        if u in c: continue
        if u is r: c[u] = 1; continue
        cs = [c[s] for s in u.src]
        if all(v == 0 for v in cs): c[u] = 0; continue
        if any(v is None for v in cs): c[u] = None; continue
        if u.op is _ADD: c[u] = cs[0] + cs[1]
        elif u.op is _SUB: c[u] = cs[0] - cs[1]
        elif u.op is _NEG: c[u] = -cs[0]
        elif u.op is _MUL:
            # exactly one side depends on r; the other must be a constant
            dep, other = (0, 1) if cs[0] != 0 else (1, 0)
            c[u] = cs[dep] * u.src[other].arg if u.src[other].op is _CONST and cs[other] == 0 else None
        elif u.op is _CAST and dtypes.is_int(u.dtype) and dtypes.is_int(u.src[0].dtype): c[u] = cs[0]
        else: c[u] = None
    return c[x]

def live_ranges(u: UOp, memo: dict[UOp, frozenset[UOp]]) -> frozenset[UOp]:
    """The RANGEs the value of `u` varies with: an END(store, *loops) no longer varies with its loops, a lanes
    REDUCE(x, vec) no longer with its vector axis, a REDUCE(x, *ranges) not with the ranges it reduces. `memo`
    caches results across calls."""
    if (known := memo.get(u)) is not None: return known
    # (the common case, a walk in toposort order, finds every source known: no walk below u)
    todo = (u,) if all(map(memo.__contains__, u.src)) else u.toposort(gate=lambda x: x not in memo)
    for x in todo:
        if x not in memo: memo[x] = _live_step(x, memo)
    return memo[u]

def live_ranges_all(topo: Iterable[UOp], memo: dict[UOp, frozenset[UOp]]) -> dict[UOp, frozenset[UOp]]:
    """`memo` with live_ranges of every node of `topo` (a toposort: sources first)."""
    for x in topo:
        if x not in memo: memo[x] = _live_step(x, memo)
    return memo

_EMPTY: frozenset[UOp] = frozenset()
# the ops whose set is not their sources' together (one test for the other nodes, nearly all of them)
_ADDS_OR_DROPS = {Ops.RANGE, Ops.END, Ops.REDUCE}

def _live_step(x: UOp, memo: dict[UOp, frozenset[UOp]]) -> frozenset[UOp]:
    # x's set from its sources' (all in memo); most nodes vary with what one source does: that set is shared
    s = _EMPTY
    for y in x.src:
        if (o := memo[y]) is not s and not o <= s: s = s | o if s else o
    if (op := x.op) not in _ADDS_OR_DROPS: return s
    if op is _RANGE: s = s | {x}
    elif op is _END: s = s - set(x.src[1:])
    elif isinstance(x.arg, tuple) and x.arg[1] == "lanes": s = s - {x.src[1]}
    elif isinstance(x.arg, Ops): s = s - set(x.src[1:])  # a REDUCE not lowered yet
    return s
