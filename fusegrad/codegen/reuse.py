"""Expensive values computed once per row: a CPU kernel whose stores compute a transcendental value (an exponential)
that one of its reductions also computes over the same positions (softmax: the sum of exp(x - max) over the row, and
each exp(x - max) scaled by the sum's reciprocal) gets the value written once per row into an array of the thread's
own, in a loop of its own, and both the reduction and the stores read it back from there (from L1: a row of 4096
floats is 16 KB). The exponential is then computed once per element instead of twice.

The match is made on the optimized AST (loops and their upcast lanes final): the reduction's value and the store's
are the same graph but for the positions they load at, which are `base + s * pos` with the same base (loops around
both, e.g. the row's) and, over the reduction's ranges, `pos` running over the row once (a mixed radix of its loops
and lanes); a store padded to the vector width reads the array under its gate. The array is filled in a loop over
the row whose lanes are the reduction's vector lanes, so it is as vectorized as the reduction was (a reduction
without lanes, a row of a prime length, fills it in a plain loop); applied only where lower.py keeps those lanes as
vectors and the kernel's main vector axis as it was, and only to kernels that don't run GPU-style (where local
memory is shared by a group)."""
from __future__ import annotations
import math
from fusegrad.uop.affine import coeff, live_ranges, range_kind, range_size
from fusegrad.uop.ops import Ops, UOp
from fusegrad.codegen.lower import SUM_BLOCKED_OVER, choose_reduce_vector_axes, choose_vector_axis

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_BARRIER, _CMPLT, _CONST, _DEFINE_LOCAL, _END = Ops.BARRIER, Ops.CMPLT, Ops.CONST, Ops.DEFINE_LOCAL, Ops.END
_INDEX, _LOAD, _RANGE, _REDUCE, _SINK = Ops.INDEX, Ops.LOAD, Ops.RANGE, Ops.REDUCE, Ops.SINK

# ops whose value is worth keeping rather than computing again (each expands to dozens of ALU ops)
EXPENSIVE = (Ops.EXP2, Ops.LOG2, Ops.SIN)

# the largest array of the thread's own (as codegen/opt PACK's bound: it lives on the stack, beside L1)
MAX_ROW_BYTES = 64 * 1024

def _expensive(ast: UOp) -> set[UOp]:
    """The nodes of `ast` with an expensive op at or below them (memory accesses and reductions stop it: a value
    computed from a reduction's result is not recomputed per element)."""
    out: set[UOp] = set()
    for u in ast.toposort():
        if u.op in EXPENSIVE or (u.op not in (_REDUCE, _INDEX, _LOAD) and not out.isdisjoint(u.src)):
            out.add(u)
    return out

def _unify(a: UOp, b: UOp, pairs: dict[UOp, UOp], seen: set[tuple[UOp, UOp]]) -> bool:
    """Whether `a` and `b` are the same graph but for the positions of their memory accesses (INDEX a -> INDEX b
    added to `pairs`)."""
    if a is b or (a, b) in seen: return True
    if a.op is not b.op or a.dtype != b.dtype or a.arg != b.arg or a.op is _RANGE or \
            (len(a.src) != len(b.src) and a.op is not _INDEX):
        return False
    if a.op is _INDEX:
        # (an access of another buffer is not the same value moved; the reduction's are all valid, a store's may be
        # gated at the padded end of its row: see _rows)
        if len(a.src) != 2 or len(b.src) > 3 or a.src[0] is not b.src[0] or pairs.get(a, b) is not b: return False
        pairs[a] = b
    elif not all(_unify(x, y, pairs, seen) for x, y in zip(a.src, b.src)): return False
    seen.add((a, b))
    return True

def _position(i: UOp, moving: list[UOp]) -> tuple[UOp, int, dict[UOp, int]] | None:
    """`i` as (base, s, {r: k}) with i == base + s * sum(k * r) over the ranges `moving` it varies with (the k
    without a common factor), base free of them; None if it isn't affine in them."""
    ks = {}
    for r in moving:
        k = coeff(i, r)
        if k is None: return None
        if k: ks[r] = k
    if not ks or any(k < 0 for k in ks.values()): return None
    s = math.gcd(*ks.values())
    base = i.substitute({r: r.const_like(0) for r in ks}).simplify()
    return base, s, {r: k // s for r, k in ks.items()}

def _rows(red: UOp, e_red: UOp, e_out: UOp, pairs: dict[UOp, UOp]) \
        -> tuple[dict[UOp, tuple[UOp, int]], dict[UOp, int], dict[UOp, int], UOp | None] | None:
    """The reduction's and the store's positions in the row: ({INDEX of e_red: (base, s)}, pos_red, pos_out, the
    store's gate), where pos_red runs over the row once and pos_out stays in it where the gate holds; None where the
    accesses don't move along one row."""
    mine = [r for r in red.src[1:] if r.op is _RANGE]
    bases, pos_red, pos_out, gates = {}, None, None, set()
    for ia, ib in pairs.items():
        a = _position(ia.src[1], mine)
        if a is None: return None
        # the ranges around both (the row) are loops: a lane (an upcast range) would need a row of its own
        around = {r for r in a[0].toposort() if r.op is _RANGE}
        if any(range_kind(r) not in ("global", "loop") for r in around): return None
        others = sorted({r for r in ib.src[1].toposort() if r.op is _RANGE} - around, key=lambda r: r.arg[0])
        b = _position(ib.src[1], others)
        if b is None or b[0] is not a[0] or b[1] != a[1]: return None
        if (pos_red is not None and a[2] != pos_red) or (pos_out is not None and b[2] != pos_out): return None
        # the store's loops along the row run inside those around it, so the row is filled once for all of them
        if around and min(r.arg[0] for r in b[2]) < max(r.arg[0] for r in around): return None
        bases[ia], pos_red, pos_out = (a[0], a[1]), a[2], b[2]
        if len(ib.src) == 3: gates.add(ib.src[2])
    if pos_red is None or pos_out is None or len(gates) > 1: return None
    # pos_red a mixed radix (every position of the row once), pos_out inside the row (or gated to it)
    n = 1
    for r, k in sorted(pos_red.items(), key=lambda x: x[1]):
        if k != n or not isinstance(range_size(r), int): return None
        n *= range_size(r)
    if len(pos_red) != len(mine) or any(not isinstance(range_size(r), int) for r in pos_out): return None
    gate = gates.pop() if gates else None
    if gate is None and sum(k * (range_size(r) - 1) for r, k in pos_out.items()) >= n: return None
    if gate is not None:
        # (the padding of the store's loops: exactly pos_out < n)
        if gate.op is not _CMPLT or gate.src[1].op is not _CONST or gate.src[1].arg != n: return None
        g = _position(gate.src[0], list(pos_out))
        if g is None or g[0].op is not _CONST or g[0].arg != 0 or g[1] != 1 or g[2] != pos_out: return None
    return bases, pos_red, pos_out, gate

def _linear(pos: dict[UOp, int]) -> UOp:
    terms = [r * k if k != 1 else r for r, k in sorted(pos.items(), key=lambda x: x[1])]
    out = terms[0]
    for t in terms[1:]: out = out + t
    return out

def _candidates(ast: UOp) -> tuple[list[UOp], list[UOp], set[UOp]]:
    """(the REDUCEs whose value has an expensive node, the expensive nodes of the stores outside any REDUCE, the
    expensive nodes)."""
    topo = ast.toposort()
    if not any(u.op in EXPENSIVE for u in topo) or not any(u.op is _REDUCE for u in topo): return [], [], set()
    exp = _expensive(ast)
    # (nodes with an expensive op anywhere below them, through reductions too)
    below: set[UOp] = set()
    for u in topo:
        if u.op in EXPENSIVE or not below.isdisjoint(u.src): below.add(u)
    reds = [u for u in topo if u.op is _REDUCE and u.src[0] in below]
    outs = []
    for st in ast.src:
        outs += [u for u in st.src[1].toposort(gate=lambda u: u.op is not _REDUCE) if u in exp]
    return reds, outs, exp

def store_once(ast: UOp, renderer) -> UOp:
    """`ast` (optimized) with an expensive value that a reduction and a store both compute written once per row to an
    array of the thread's own and read back by both (see the module docstring); `ast` itself where none is found."""
    if ast.op is not _SINK or getattr(renderer, "has_local", False) or not getattr(renderer, "vector_dtypes", ()):
        return ast
    reds, outs, exp = _candidates(ast)
    if not reds or not outs: return ast
    by_key: dict[tuple, list[UOp]] = {}
    for u in outs: by_key.setdefault((u.op, u.dtype, u.arg), []).append(u)
    live: dict = {}
    for red in reds:
        done = _reuse(ast, red, by_key, exp, live, renderer)
        if done is not None: return done
    return ast

def _reuse(ast: UOp, red: UOp, by_key: dict[tuple, list[UOp]], exp: set[UOp], live: dict, renderer) -> UOp | None:
    mine = set(red.src[1:])
    # the largest node of the reduction's value that a store computes too
    for e_red in reversed(list(red.src[0].toposort())):
        if e_red not in exp or not (same := by_key.get((e_red.op, e_red.dtype, e_red.arg))): continue
        if not mine & live_ranges(e_red, live): continue
        found = []
        for e_out in same:
            pairs: dict[UOp, UOp] = {}
            if not _unify(e_red, e_out, pairs, set()) or not pairs: continue
            if (rows := _rows(red, e_red, e_out, pairs)) is not None: found.append((e_out, rows))
        if found: return _rewrite(ast, red, e_red, found, renderer)
    return None

def _rewrite(ast: UOp, red: UOp, e_red: UOp, found: list, renderer) -> UOp | None:
    bases, pos_red = found[0][1][0], found[0][1][1]
    if any(rows[0].keys() != bases.keys() or rows[1] != pos_red for _, rows in found): return None
    dt = e_red.dtype
    n = math.prod(range_size(r) for r in pos_red)
    if dt not in renderer.vector_dtypes or n * dt.itemsize > MAX_ROW_BYTES: return None
    # the array is filled over the reduction's lanes along the row (an upcast range of coefficient 1), so as
    # vectorized as the reduction was; a reduction without them (a row of a prime length) is filled by a plain loop
    first = next(r for r, k in pos_red.items() if k == 1)
    lane = first if range_kind(first) == "upcast" else None
    if lane is None and range_kind(first) != "reduce": return None
    width = range_size(lane) if lane is not None else 1
    if n // width > SUM_BLOCKED_OVER: return None
    vec = choose_vector_axis(ast, renderer)
    n_locals = [u.arg for u in ast.toposort() if u.op is _DEFINE_LOCAL]
    local = UOp(_DEFINE_LOCAL, dt.ptr(n, "local"), arg=1 + max(n_locals, default=-1))
    loops = [r for r in red.src[1:] if range_kind(r) == "reduce"]
    if all(r in loops or r is lane for r in red.src[1:]):
        # written where the reduction computes it, in the same loop (lowering expands no lane of it apart from the
        # reduction's value: its lanes are the vector's)
        filled = local.index(_linear(pos_red)).store(e_red)
        ready = UOp(_BARRIER, local.dtype, (local, UOp(_END, filled.dtype, (filled, *loops))))
        sub = {}
    else:
        # (a reduction with lanes of other kinds: written in a loop of its own, and the reduction reads it back)
        q = UOp.range(n // width, 1 + max(u.arg[0] for u in ast.toposort() if u.op is _RANGE), "copy")
        pos_copy = q * width + lane if lane is not None else q
        moved = {ia: ia.replace(src=(ia.src[0], base + pos_copy * s if s != 1 else base + pos_copy))
                 for ia, (base, s) in bases.items()}
        filled = local.index(pos_copy).store(e_red.substitute(moved))
        ready = UOp(_BARRIER, local.dtype, (local, UOp(_END, filled.dtype, (filled, q))))
        sub = {e_red: ready.index(_linear(pos_red)).load(dtype=dt)}
    for e_out, (_, _, pos_out, gate) in found: sub[e_out] = ready.index(_linear(pos_out), valid=gate).load(dtype=dt)
    new = ast.substitute(sub)
    # only where the array's lanes stay vector lanes and the kernel's main vector axis stays what it was
    new_vec = choose_vector_axis(new, renderer)
    if new_vec is not vec or (lane is not None and lane not in choose_reduce_vector_axes(new, renderer, new_vec)):
        return None
    return new
