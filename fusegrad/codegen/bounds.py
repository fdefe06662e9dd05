"""Loop bounds from gates: a sum's loop skips the iterations whose terms a padding gate makes zero.

A convolution with padding reads its input under a gate, `0 <= oy + ky - pad < H`, and multiplies what it reads
(0 outside the image) by the weight of tap ky. Where the window loop ky is a loop of the kernel and the gate's other
part (oy) is a loop around it, the gate says which taps of each output row are inside the image:
`ky in [max(0, pad - oy), min(K, H + pad - oy))`. That loop then runs over exactly those taps (a loop of
`hi - lo` trips, its index shifted by `lo`) and its clauses leave the gate. On ResNet's 2x2 images (3x3 window,
padding 1) 5 of the 9 taps read padding: the products drop to 4/9.

Applied to a sum (REDUCE ADD) whose term is zero wherever the clause is false (a product with a load under that
gate, and so on: `zero_guards`), for a clause `a + s*r < b` or `b < a + s*r` (s = 1 or -1) of one of its loops r,
with a and b made of constants, variables and the kernel's output loops (global, loop: the loops that enclose the
sum's). A skipped term is +0 or -0, which adds nothing to a sum that starts at +0, so finite inputs give the same
bits. A non-finite weight at a tap that reads only padding is where it differs from multiplying: 0 * inf is NaN,
and a skipped product is nothing (as direct convolutions in oneDNN, which PyTorch's CPU convolutions use, skip the
padding; its im2col path multiplies it).

A window axis that is unrolled or upcast instead of a loop has constants for its lanes: lowering makes a lane's term
whose zero guard is constant false there a constant 0 (lower.py `_lanes_of_sum`), which adds nothing."""
from __future__ import annotations
from fusegrad.uop.affine import coeff, range_kind
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow)
_ADD, _AND, _CMPLT, _CONST, _INDEX, _LOAD = Ops.ADD, Ops.AND, Ops.CMPLT, Ops.CONST, Ops.INDEX, Ops.LOAD
_MUL, _RANGE, _WHERE = Ops.MUL, Ops.RANGE, Ops.WHERE

# the loops a bound may depend on: the output loops, which enclose every loop of a sum
_OUTER_KINDS = ("global", "loop")

def clauses(gate: UOp) -> list[UOp]:
    """The conjuncts of a gate: `a & (b & c)` -> [a, b, c]."""
    return clauses(gate.src[0]) + clauses(gate.src[1]) if gate.op is _AND else [gate]

def zero_guards(x: UOp, memo: dict[UOp, frozenset[UOp]] | None = None) -> frozenset[UOp]:
    """Clauses c such that x == 0 wherever c is false: those of the gate of a load (a gated load reads 0), of a
    product's either factor (IEEE's 0 * inf aside), of where(gate, y, 0)'s gate; a sum's are those of both terms.
    (`memo`: each shared node once, where a term reuses one many times: x*x of x*x ...)"""
    if memo is None: memo = {}
    if (known := memo.get(x)) is not None: return known
    op, src = x.op, x.src
    if op is _LOAD:
        idx = src[0]
        out = frozenset(clauses(idx.src[2])) if idx.op is _INDEX and len(idx.src) > 2 else frozenset()
    elif op is _MUL: out = zero_guards(src[0], memo) | zero_guards(src[1], memo)
    elif op is _WHERE and src[2].op is _CONST and src[2].arg == 0:
        out = frozenset(clauses(src[0])) | zero_guards(src[1], memo)
    elif op is _WHERE: out = zero_guards(src[1], memo) & zero_guards(src[2], memo)
    elif op is _ADD: out = zero_guards(src[0], memo) & zero_guards(src[1], memo)
    elif op in (Ops.CAST, Ops.NEG): out = zero_guards(src[0], memo)
    else: out = frozenset()
    memo[x] = out
    return out

def zero_guard_list(x: UOp) -> list[UOp]:
    """zero_guards(x) in the order of x's toposort: a frozenset of UOps (hashed by identity) iterates in an order
    that varies from process to process, and the bounds and selects built from the clauses are kernel source."""
    guards = zero_guards(x)
    return [u for u in x.toposort() if u in guards] if guards else []

def _outer_only(x: UOp) -> bool:
    """Whether x is made of constants, variables and output loops (no load, no other loop)."""
    return all(u.op is not _LOAD and (u.op is not _RANGE or range_kind(u) in _OUTER_KINDS) for u in x.toposort())

def _bound(clause: UOp, r: UOp) -> tuple[str, UOp] | None:
    """("lo", v) where the clause says r >= v, ("hi", v) where it says r < v, None where it isn't `a + s*r < b` or
    `b < a + s*r` (s = +-1) with a, b of the output loops."""
    if clause.op is not _CMPLT: return None
    lhs, rhs = clause.src
    for side, e, other in ((0, lhs, rhs), (1, rhs, lhs)):
        s = coeff(e, r)
        if s not in (1, -1) or coeff(other, r) != 0: continue
        a = e.substitute({r: r.const_like(0)})
        if not (_outer_only(a) and _outer_only(other)): return None
        # side 0: a + s*r < other; side 1: other < a + s*r
        if side == 0: return ("hi", other - a) if s == 1 else ("lo", a - other + 1)
        return ("lo", other - a + 1) if s == 1 else ("hi", a - other)
    return None

def _without(gate: UOp, drop: set[UOp]) -> UOp | None:
    """The gate's clauses but those in `drop` (None: none left)."""
    keep = [c for c in clauses(gate) if c not in drop]
    if not keep: return None
    out = keep[-1]
    for c in reversed(keep[:-1]): out = c & out
    return out

def _drop_clauses(x: UOp, drop: set[UOp]) -> UOp:
    """x with the clauses `drop` taken out of its loads' gates and its selects (they hold wherever x is evaluated)."""
    subs: dict[UOp, UOp] = {}
    for u in x.toposort():
        if u.op is _INDEX and len(u.src) > 2 and not drop.isdisjoint(clauses(u.src[2])):
            gate = _without(u.src[2], drop)
            subs[u] = u.replace(src=u.src[:2] + ((gate,) if gate is not None else ()))
        elif u.op is _WHERE and not drop.isdisjoint(clauses(u.src[0])):
            gate = _without(u.src[0], drop)
            subs[u] = u.src[1] if gate is None else u.replace(src=(gate,) + u.src[1:])
    return x.substitute(subs) if subs else x

def _bound_sum_loops(ctx: list[int], red: UOp) -> UOp | None:
    """The sum with each of its loops that a clause of its terms' zero guards bounds running over those bounds."""
    if red.arg is not _ADD: return None
    val, rngs = red.src[0], list(red.src[1:])
    guards = zero_guard_list(val)
    if not guards: return None
    changed = False
    for i, r in enumerate(rngs):
        if range_kind(r) != "reduce": continue
        bounds = [(c, b) for c in guards if (b := _bound(c, r)) is not None]
        if not bounds: continue
        lo, hi = r.const_like(0), r.src[0]
        for _, (kind, v) in bounds:
            if kind == "lo": lo = lo.maximum(v)
            else: hi = hi.minimum(v)
        lo = lo.simplify()
        # (a new loop id: the kernel's ids are unique)
        new_r = UOp.range((hi - lo).simplify(), ctx[0], "reduce")
        ctx[0] += 1
        val = _drop_clauses(val, {c for c, _ in bounds}).substitute({r: new_r + lo})
        guards = zero_guard_list(val)
        rngs[i], changed = new_r, True
    return red.replace(src=(val, *rngs)) if changed else None

pm_bound_sum_loops = PatternMatcher([(UPat(Ops.REDUCE, name="red"), _bound_sum_loops)], name="bound_sum_loops")
pm_bound_sum_loops.__doc__ = "a sum's loop runs only over the iterations its padding gates let through"

def bound_sum_loops(ast: UOp) -> UOp:
    """The optimized AST with its sums' loops bounded by their gates (see the module's docstring)."""
    topo = ast.toposort()
    # (most kernels have no sum under a gate: no rewrite walk for them)
    if not any(u.op is Ops.REDUCE and u.arg is _ADD and zero_guards(u.src[0]) for u in topo): return ast
    next_id = [max((u.arg[0] for u in topo if u.op is _RANGE), default=-1) + 1]
    return graph_rewrite(ast, pm_bound_sum_loops, ctx=next_id, name="bound_sum_loops")
