"""Indexed loads from one-hot reductions: a gather written as `sum over r of (e == r ? v(r) : 0)` loads v(e) once.

The front end expresses every gather (getitem with tensor indices, `gather`, embeddings, one-hot picks in losses) as
a reduction over the indexed dimension whose body selects the one position equal to an index value. Computed as
written, its work is (the result's elements) x (the indexed dimension's size). When the index value `e` does not
depend on the reduced range `r`, at most one `r` matches, so the reduction equals `v` with `r` replaced by `e` where
`0 <= e < size`, and the reduction's identity elsewhere: one load instead of `size` compares.

The selection is recognized by its value, not its form: a body that is the reduction's identity wherever `e == r` is
false (a select, negated or cast, a product by a one-hot, a masked max) is a pick. A sum whose body adds a pick to
other terms (a loss's gradient: the one-hot next to the softmax) sums the pick apart, as a load. A big sum computed in
chunks (`Tensor._reduce`) sees the class as `r % size`; its range is split in two so that the pick is found.
"""
from __future__ import annotations
import math
from fusegrad.dtype import ConstType, dtypes
from fusegrad.uop.ops import Ops, UOp, exec_alu, python_alu
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _AND, _CAST, _CMPEQ, _CONST, _IDIV, _MAX = Ops.ADD, Ops.AND, Ops.CAST, Ops.CMPEQ, Ops.CONST, Ops.IDIV, Ops.MAX
_MOD, _MUL, _NEG, _OR, _RANGE, _SUB, _WHERE = Ops.MOD, Ops.MUL, Ops.NEG, Ops.OR, Ops.RANGE, Ops.SUB, Ops.WHERE

def _depends_on(u: UOp, r: UOp) -> bool: return r in u.toposort()

def _is_range_value(side: UOp, r: UOp) -> bool:
    """Whether `side` is the range `r`, or `r` through integer casts that each hold all of its values."""
    while side.op is _CAST and dtypes.is_int(side.dtype) and dtypes.max(side.dtype) >= r.src[0].vmax - 1:
        side = side.src[0]
    return side is r

def _equal_to_range(c: UOp, r: UOp) -> UOp | None:
    """e where the condition `c` says `e == r` (r possibly cast to e's integer dtype) and e doesn't depend on r."""
    if c.op is not _CMPEQ: return None
    for side, other in ((c.src[0], c.src[1]), (c.src[1], c.src[0])):
        if _is_range_value(side, r) and dtypes.is_int(other.dtype) and not _depends_on(other, r): return other
    return None

def _identity_value(op: Ops, dtype) -> ConstType | None:
    """The identity of the reduction `op` in `dtype` (what an empty selection contributes); None if not handled."""
    if op is _ADD: return dtypes.as_const(0, dtype)
    if op is _MAX: return False if dtype.scalar() == dtypes.bool else dtypes.min(dtype)
    return None

def _value_off(u: UOp, c: UOp, memo: dict[UOp, ConstType | None]) -> ConstType | None:
    """The value of `u` wherever the condition `c` is False, where that is one constant whatever the other values
    are (None where it isn't known to be). A product with a zero factor counts as zero: a one-hot product picks its
    value as a selection does. A float product isn't: 0 * inf is nan, so a row's infinity elsewhere must still make
    the sum nan, as it does in any other reduction."""
    if u is c: return False
    if u in memo: return memo[u]
    ret: ConstType | None = None
    if u.op is _CONST: ret = u.arg
    elif u.op is _WHERE:
        s = _value_off(u.src[0], c, memo)
        if s is not None: ret = _value_off(u.src[1] if s else u.src[2], c, memo)
        else:
            a, b = _value_off(u.src[1], c, memo), _value_off(u.src[2], c, memo)
            if a is not None and b is not None and a == b and type(a) is type(b): ret = a
    elif u.op is _CAST and dtypes.is_float(u.dtype) or u.op is _CAST and u.dtype.scalar() == dtypes.bool:
        if (v := _value_off(u.src[0], c, memo)) is not None: ret = dtypes.as_const(v, u.dtype)
    elif u.op is _CAST and dtypes.is_int(u.dtype):
        # (a float that an integer can't hold has no defined integer value)
        if (v := _value_off(u.src[0], c, memo)) is not None and not (isinstance(v, float) and not math.isfinite(v)):
            ret = dtypes.as_const(v, u.dtype)
    elif u.op in (_AND, _MUL, _OR) or u.op in python_alu:
        vals = [_value_off(s, c, memo) for s in u.src]
        absorbing = {_AND: False, _MUL: None if dtypes.is_float(u.dtype) else 0, _OR: True}.get(u.op)
        if absorbing is not None and any(v is not None and v == absorbing for v in vals):
            ret = dtypes.as_const(absorbing, u.dtype)
        elif all(v is not None for v in vals): ret = exec_alu(u.op, u.dtype, tuple(vals))  # type: ignore[arg-type]
    memo[u] = ret
    return ret

def _is_identity(v: ConstType | None, want: ConstType) -> bool:
    if v is None or isinstance(v, tuple): return False
    return v == want and not (isinstance(v, float) and math.isnan(v))

def _in_range(e: UOp, size: UOp) -> UOp | None:
    """The condition 0 <= e < size in e's integer dtype (None where it can't be written in it)."""
    conds = [] if dtypes.is_unsigned(e.dtype) else [e.const_like(-1) < e]
    if size.vmax <= dtypes.max(e.dtype):
        conds.append(e < (e.const_like(size.arg) if size.op is _CONST else size.cast(e.dtype)))
    elif size.vmin <= dtypes.max(e.dtype): return None   # (a size past e's range only sometimes: no simple bound)
    if not conds: return UOp.const(dtypes.bool, True)
    return conds[0] & conds[1] if len(conds) == 2 else conds[0]

def _pick(red: UOp, body: UOp) -> UOp | None:
    """The reduction `red` of `body` over its ranges as a load, where `body` is the identity at every position of
    some range `r` but one, `e == r` (e independent of r): the body at r = e, for an e in range."""
    want = _identity_value(red.arg, red.dtype)
    if want is None: return None
    ranges = red.src[1:]
    for r in ranges:
        # (an empty range has no position to load at)
        if r.op is not _RANGE or r.src[0].vmin < 1: continue
        for c in body.toposort():
            if c.op is not _CMPEQ or (e := _equal_to_range(c, r)) is None: continue
            if not _is_identity(_value_off(body, c, {}), want) or (valid := _in_range(e, r.src[0])) is None: continue
            # (out of range, r becomes 0: a position that exists, its value discarded by the WHERE)
            at = valid.where(e.cast(dtypes.index), UOp.const(dtypes.index, 0))
            picked = valid.where(body.substitute({c: UOp.const(dtypes.bool, True)}).substitute({r: at}),
                                 UOp.const(red.dtype, want))
            others = tuple(x for x in ranges if x is not r)
            return red.replace(src=(picked,) + others) if others else picked
    return None

def _terms(u: UOp, neg: bool = False) -> list[tuple[UOp, bool]]:
    """`u` as a sum of terms, each with whether it is negated."""
    if u.op is _ADD: return _terms(u.src[0], neg) + _terms(u.src[1], neg)
    if u.op is _SUB: return _terms(u.src[0], neg) + _terms(u.src[1], not neg)
    if u.op is _NEG: return _terms(u.src[0], not neg)
    return [(u, neg)]

def _split_range(red: UOp) -> UOp | None:
    """The reduction over a range `r` that a compare sees as `r % m` (a big sum computed in chunks that each cover
    several rows: `row == r // m`, `label[row] == r % m`) as one over two ranges, r = hi * m + lo, so that the
    compare is `label[...] == lo`: a pick the rules above see."""
    body = red.src[0]
    for c in body.toposort():
        if c.op is not _CMPEQ: continue
        for side in c.src:
            while side.op is _CAST and dtypes.is_int(side.dtype): side = side.src[0]
            if side.op is not _MOD or side.src[1].op is not _CONST or (r := side.src[0]) not in red.src[1:]:
                continue
            m, n = side.src[1].arg, r.src[0]
            if n.op is not _CONST or not 1 < m < n.arg or n.arg % m: continue
            # (fresh axis ids, past those a kernel numbers its loops with)
            axis = 1000 * (r.arg[0] + 1)
            # (a loop of the same id and size would be the same node: two loops merged into one)
            if any(u.op is _RANGE and u.arg[0] in (axis, axis + 1) for u in red.toposort()): continue
            hi, lo = UOp.range(n.arg // m, axis, "reduce"), UOp.range(m, axis + 1, "reduce")
            new_body = _divide_through(body.substitute({r: hi * m + lo}), m).simplify()
            return red.replace(src=(new_body,) + tuple(x for x in red.src[1:] if x is not r) + (hi, lo))
    return None

def _divide_through(u: UOp, m: int) -> UOp:
    """`u` with each `x // d` of a nonnegative `x` and a `d` that `m` divides written `(x // m) // (d // m)` (equal for
    x >= 0), so that the simplifier sees `(hi * m + lo) // m` as `hi` inside a row's index (the inner quotient is
    simplified at once: the rules would fold the two divisions back into one)."""
    while True:
        subs = {x: (x.src[0] // m).simplify() // (x.src[1].arg // m) for x in u.toposort() if x.op is _IDIV and
                x.src[1].op is _CONST and x.src[1].arg > m and x.src[1].arg % m == 0 and x.src[0].vmin >= 0 and
                not (x.src[0].op is _IDIV and x.src[0].src[1].op is _CONST and x.src[0].src[1].arg == m)}
        if not subs: return u
        u = u.substitute(subs)

def _collapse(red: UOp) -> UOp | None:
    body, ranges = red.src[0], red.src[1:]
    if (whole := _pick(red, body)) is not None: return whole
    if red.arg in (_ADD, _MAX) and (split := _split_range(red)) is not None and \
            _pick(split, split.src[0]) is not None:
        return split
    if red.arg is not _ADD or len(terms := _terms(body)) < 2: return None
    # a sum of a pick and other terms (a loss's gradient adds the one-hot to the softmax): the pick is summed apart,
    # as a load, and the rest stays one reduction
    picks, rest = [], []
    for t, neg in terms:
        p = _pick(red.replace(src=(t,) + ranges), t)
        if p is None: rest.append(-t if neg else t)
        else: picks.append(-p if neg else p)
    if not picks: return None
    ret = red.replace(src=(_sum(rest),) + ranges) if rest else None
    for p in picks: ret = p if ret is None else ret + p
    return ret

def _sum(xs: list[UOp]) -> UOp:
    ret = xs[0]
    for x in xs[1:]: ret = ret + x
    return ret

gather_collapse = PatternMatcher([(UPat(Ops.REDUCE, name="red"), _collapse)], name="gather_collapse")
gather_collapse.__doc__ = "no reduction selects one position `e == r` with an `e` independent of `r`: it loads at `e`"

def collapse_gathers(ast: UOp) -> UOp: return graph_rewrite(ast, gather_collapse)
