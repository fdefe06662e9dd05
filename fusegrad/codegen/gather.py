"""Indexed loads from one-hot reductions: a gather written as `sum over r of (e == r ? v(r) : 0)` loads v(e) once.

The front end expresses every gather (getitem with tensor indices, `gather`, embeddings, one-hot picks in losses) as
a reduction over the indexed dimension whose body selects the one position equal to an index value. Computed as
written, its work is (the result's elements) x (the indexed dimension's size). When the index value `e` does not
depend on the reduced range `r`, at most one `r` matches, so the reduction equals `v` with `r` replaced by `e` where
`0 <= e < size`, and the reduction's identity elsewhere: one load instead of `size` compares.
"""
from __future__ import annotations
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

def _conjuncts(c: UOp) -> list[UOp]:
    return _conjuncts(c.src[0]) + _conjuncts(c.src[1]) if c.op is Ops.AND else [c]

def _depends_on(u: UOp, r: UOp) -> bool: return r in u.toposort()

def _is_range_value(side: UOp, r: UOp) -> bool:
    """Whether `side` is the range `r`, or `r` through integer casts that each hold all of its values."""
    while side.op is Ops.CAST and dtypes.is_int(side.dtype) and dtypes.max(side.dtype) >= r.src[0].vmax - 1:
        side = side.src[0]
    return side is r

def _equal_to_range(c: UOp, r: UOp) -> UOp | None:
    """e where the condition `c` says `e == r` (r possibly cast to e's integer dtype) and e doesn't depend on r."""
    if c.op is not Ops.CMPEQ: return None
    for side, other in ((c.src[0], c.src[1]), (c.src[1], c.src[0])):
        if _is_range_value(side, r) and dtypes.is_int(other.dtype) and not _depends_on(other, r): return other
    return None

def _identity(op: Ops, v: UOp) -> bool:
    """Whether `v` is the identity of the reduction `op` (what an empty selection contributes)."""
    if v.op is not Ops.CONST: return False
    if op is Ops.ADD: return v.arg == 0
    if op is Ops.MAX: return v.arg is False or v.arg == dtypes.min(v.dtype)
    return False

def _in_range(e: UOp, size: UOp) -> UOp | None:
    """The condition 0 <= e < size in e's integer dtype (None where it can't be written in it)."""
    conds = [] if dtypes.is_unsigned(e.dtype) else [e.const_like(-1) < e]
    if size.vmax <= dtypes.max(e.dtype):
        conds.append(e < (e.const_like(size.arg) if size.op is Ops.CONST else size.cast(e.dtype)))
    elif size.vmin <= dtypes.max(e.dtype): return None   # (a size past e's range only sometimes: no simple bound)
    if not conds: return UOp.const(dtypes.bool, True)
    return conds[0] & conds[1] if len(conds) == 2 else conds[0]

def _collapse(red: UOp) -> UOp | None:
    body, ranges = red.src[0], red.src[1:]
    # (a selection summed in a wider dtype: the cast moves inside, to the selected value and the zero)
    if body.op is Ops.CAST and body.src[0].op is Ops.WHERE and body.src[0].src[2].op is Ops.CONST:
        c, v, z = body.src[0].src
        body = c.where(v.cast(body.dtype), UOp.const(body.dtype, z.arg))
    if body.op is not Ops.WHERE or not _identity(red.arg, body.src[2]): return None
    conds = _conjuncts(body.src[0])
    for r in ranges:
        # (an empty range has no position to load at)
        if r.op is not Ops.RANGE or r.src[0].vmin < 1: continue
        for k, c in enumerate(conds):
            if (e := _equal_to_range(c, r)) is None or (valid := _in_range(e, r.src[0])) is None: continue
            # (out of range, r becomes 0: a position that exists, its value discarded by the WHERE)
            at = valid.where(e.cast(dtypes.index), UOp.const(dtypes.index, 0))
            rest = [x.substitute({r: at}) for j, x in enumerate(conds) if j != k]
            cond = valid
            for x in rest: cond = cond & x
            picked = cond.where(body.src[1].substitute({r: at}), body.src[2])
            others = tuple(x for x in ranges if x is not r)
            return red.replace(src=(picked,) + others) if others else picked
    return None

gather_collapse = PatternMatcher([(UPat(Ops.REDUCE, name="red"), _collapse)], name="gather_collapse")
gather_collapse.__doc__ = "no reduction selects one position `e == r` with an `e` independent of `r`: it loads at `e`"

def collapse_gathers(ast: UOp) -> UOp: return graph_rewrite(ast, gather_collapse)
