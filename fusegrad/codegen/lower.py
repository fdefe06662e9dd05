"""Lowering an optimized kernel AST: expanded (upcast/unroll) axes become separate values, REDUCEs become
accumulators in registers updated inside their loops.

After `lower_kernel` the graph holds no REDUCE over a loop: each became
    acc  = DEFINE_REG(arg=id)                       a register (declared once, at the top of the kernel)
    init = STORE(acc, identity, *outer_loops)       reset in the loop the result lives in
    cur  = LOAD(acc, init, *reduce_loops)           read inside the innermost reduce loop
    upd  = STORE(acc, op(cur, value))               accumulate
    res  = LOAD(acc, END(upd, *reduce_loops))       read after the reduce loops closed
The only RANGEs of kind "upcast" left are the vector axes (if any), turned into SIMD lanes by expand.py: the main one,
and in a kernel with several reductions (softmax) one per reduction that doesn't involve the main one."""
from __future__ import annotations
import itertools
import math
from dataclasses import dataclass, field
from fusegrad.codegen.bounds import clauses, zero_guard_list
from fusegrad.dtype import DType, dtypes
from fusegrad.uop.affine import coeff, live_ranges, range_kind, range_size
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _CONST, _DEFINE_REG, _END, _LOAD = Ops.ADD, Ops.CONST, Ops.DEFINE_REG, Ops.END, Ops.LOAD
_MAX, _MUL, _MULACC, _WHERE = Ops.MAX, Ops.MUL, Ops.MULACC, Ops.WHERE

LOOP_KINDS = ("global", "loop", "reduce", "copy")

def identity_element(op: Ops, dt: DType) -> UOp:
    """The value a reduction starts from: 0 for ADD, 1 for MUL, the dtype's minimum (-inf for floats) for MAX."""
    if op is _ADD: return UOp.const(dt, 0)
    if op is _MUL: return UOp.const(dt, 1)
    if op is _MAX: return UOp.const(dt, dtypes.min(dt))
    raise NotImplementedError(f"no identity for reduce op {op}")

@dataclass
class LowerCtx:
    vec: UOp | None = None           # the RANGE kept as SIMD lanes
    use_fma: bool = False            # fuse ADD-reduces of products into fused multiply-adds
    next_reg: int = 0
    live: dict = field(default_factory=dict)     # memo for live_ranges
    reduce_vecs: tuple[UOp, ...] = ()  # further vector axes, each the lanes of one reduction's partial accumulators
    next_range: int = 0              # the id of the next RANGE made while lowering
    splits: dict = field(default_factory=dict)   # (reduce loop, block) -> its block loops, shared by sibling sums
    quick: bool = False              # unrolled reduce axes stay loops (see lower_kernel)
    rolled: bool = False             # quick lowering made a loop of a tile or an unrolled axis
    rolled_tiles: frozenset = frozenset()   # the tiles quick lowering made loops (as loops)

    @property
    def vecs(self) -> tuple[UOp, ...]: return ((self.vec,) if self.vec is not None else ()) + self.reduce_vecs

def _combine(ctx: LowerCtx, op: Ops, acc: UOp, val: UOp) -> UOp:
    if op is _ADD and ctx.use_fma and val.dtype.scalar() in (dtypes.float32, dtypes.float64):
        if val.op is _MUL: return UOp(_MULACC, acc.dtype, (val.src[0], val.src[1], acc))
        # a padded reduction's term, where(in range, a * b, 0) (a vocabulary of 50257 padded to blocks of 512), where
        # a is a load that the same gate already makes 0 outside the range: a multiply-add of a and where(in range,
        # b, 0), so the padded steps add 0 * 0, where the select of the product cost a multiply, a blend and an add
        # per term (b's select is shared by the register tile's terms it enters)
        if val.op is _WHERE and val.src[1].op is _MUL and val.src[2].op is _CONST and val.src[2].arg == 0:
            gate, zero, (a, b) = val.src[0], val.src[2], val.src[1].src
            if _zero_outside(b, gate): a, b = b, a
            if _zero_outside(a, gate):
                if not _zero_outside(b, gate): b = UOp(_WHERE, b.dtype, (gate, b, zero))
                return UOp(_MULACC, acc.dtype, (a, b, acc))
    return acc.alu(op, val)

def _zero_outside(x: UOp, gate: UOp) -> bool:
    """Whether x is a load whose gate holds `gate` as a clause: it reads 0 wherever `gate` is false."""
    if x.op is not _LOAD or x.src[0].op is not Ops.INDEX or len(x.src[0].src) < 3: return False
    return gate in clauses(x.src[0].src[2])

# *** blocked float sums ***

# A float sum that adds more than SUM_BLOCKED_OVER terms into one accumulator (vector lanes and upcast accumulators
# count their own terms) is computed as a cascade instead: partial sums of blocks of at most SUM_BLOCK terms, added
# in blocks of at most SUM_BLOCK, and so on. Its rounding error then grows like SUM_BLOCK * log(n) instead of n (a
# float32 sum of 2^25 ones stopped at 2^24, where adding 1 rounds back to 2^24). Shorter sums (a matmul's K, a
# softmax row) keep their single loop.
SUM_BLOCKED_OVER = 4096
SUM_BLOCK = 64

def _trips(r: UOp) -> int:
    n = range_size(r)
    return n if isinstance(n, int) else int(n.vmax)

def _new_range(ctx: LowerCtx, size: int | UOp) -> UOp:
    ctx.next_range += 1
    # (a symbolic size in simplest form: simplify_indexing would otherwise make a second RANGE of it in the indices)
    return UOp.range(size.simplify() if isinstance(size, UOp) else size, ctx.next_range - 1, "reduce")

def _split_loop(ctx: LowerCtx, r: UOp, cap: int) -> tuple[UOp, UOp, UOp | None]:
    """Reduce loop r as blocks: (loop over the blocks, loop in a block, loop over the remainder or None). A block is
    the largest divisor of the loop in (cap/2, cap], so that most loops need no remainder loop, else cap (always for
    a symbolic loop). Sums over the same loop share its blocks, so they still run in one loop."""
    n = range_size(r)
    b = next((d for d in range(cap, cap // 2, -1) if n % d == 0), cap) if isinstance(n, int) else cap
    if (r, b) not in ctx.splits:
        rest = _new_range(ctx, n % b) if not isinstance(n, int) or n % b else None
        ctx.splits[(r, b)] = (_new_range(ctx, n // b), _new_range(ctx, b), rest)
    return ctx.splits[(r, b)]

def _cascade(ctx: LowerCtx, dt: DType, x: UOp, loops: list[UOp], expanded: list[UOp], vecs: list[UOp]) -> UOp:
    """The sum of x over `loops` (outer to inner), the unrolled and upcast axes `expanded` and the vector axes `vecs`,
    adding at most SUM_BLOCK terms into each accumulator: the block is a suffix of the loops (when it holds at least
    an eighth of SUM_BLOCK terms) or blocks of the loop that overflows one, then a sum over its remainder. Upcast
    accumulators are combined per block, vector lanes after the whole sum."""
    per_block = math.prod(_trips(r) for r in expanded if range_kind(r) == "unroll")
    if per_block * math.prod(_trips(r) for r in loops) <= SUM_BLOCK or not loops:
        return UOp(Ops.REDUCE, dt, (x, *loops, *expanded, *vecs), _ADD)
    j = len(loops)   # loops[j:] fit a block, loops[j - 1] doesn't
    while per_block * _trips(loops[j - 1]) <= SUM_BLOCK:
        j -= 1
        per_block *= _trips(loops[j])
    r, n = loops[j - 1], range_size(loops[j - 1])
    if j < len(loops) and (per_block > SUM_BLOCK // 8 or not isinstance(n, int)):
        return _cascade(ctx, dt, UOp(Ops.REDUCE, dt, (x, *loops[j:], *expanded), _ADD), loops[:j], [], vecs)
    outer, block, rest = _split_loop(ctx, r, SUM_BLOCK // per_block)
    b = range_size(block)
    inner = UOp(Ops.REDUCE, dt, (x.substitute({r: outer * b + block}), block, *loops[j:], *expanded), _ADD)
    ret = _cascade(ctx, dt, inner, loops[:j - 1] + [outer], [], vecs)
    if rest is None: return ret
    # the remainder's loops, and those of the sums inside x that depend on these loops (blocks of a cascade), are
    # loops of their own: a RANGE is one loop of the kernel. A reduction inside x that doesn't (a row's max under a
    # sum of exp) has the same value in the remainder: it is not computed again there
    varying = set(loops)
    for u in x.toposort():
        if u not in varying and not varying.isdisjoint(u.src): varying.add(u)
    inside = [o for u in x.toposort() if u.op is Ops.REDUCE and u in varying for o in u.src[1:]
              if range_kind(o) == "reduce"]
    fresh = {o: ctx.splits.setdefault((r, b, o), _new_range(ctx, range_size(o))) for o in loops + inside if o is not r}
    fresh[r] = rest + (n // b) * b
    return ret + _cascade(ctx, dt, x.substitute(fresh), [fresh[o] if o is not r else rest for o in loops], expanded,
                          vecs)

def _block_sum(ctx: LowerCtx, red: UOp) -> UOp | None:
    if red.arg is not _ADD or not dtypes.is_float(red.dtype): return None
    loops = [r for r in red.src[1:] if range_kind(r) == "reduce"]
    # (unrolled terms go into the same accumulator, upcast ones into accumulators of their own)
    chain = [r for r in red.src[1:] if range_kind(r) == "unroll"]
    if math.prod(_trips(r) for r in loops + chain) <= SUM_BLOCKED_OVER: return None
    expanded = [r for r in red.src[1:] if r not in loops and r not in ctx.vecs]
    return _cascade(ctx, red.dtype, red.src[0], loops, expanded, [r for r in red.src[1:] if r in ctx.vecs])

pm_block_sums = PatternMatcher([(UPat(Ops.REDUCE, name="red"), _block_sum)], name="block_sums")
pm_block_sums.__doc__ = "no float sum adds more than SUM_BLOCKED_OVER terms into one accumulator"

# *** expansion of upcast/unroll axes by substitution ***

def _each_lane(u: UOp, axes: list[UOp]) -> list[UOp]:
    """`u` with `axes` replaced by each combination of their values (the last axis varying fastest)."""
    if not axes: return [u]
    return u.substitute_each([{r: UOp.const(r.dtype, v) for r, v in zip(axes, lane)}
                              for lane in itertools.product(*[range(range_size(r)) for r in axes])])

def _lanes_of_sum(term: UOp, op: Ops, axes: list[UOp]) -> list[UOp]:
    """_each_lane of a reduction's term. In a sum, a lane whose term a gate makes zero there (a product with a load
    in padding: a clause of its zero guards constant false, its lanes and the tiles around it substituted) is a
    constant 0, which lowering adds nothing for: the padding is skipped, as codegen/bounds.py skips a loop's
    iterations in padding."""
    lanes = _each_lane(term, axes)
    if op is not _ADD or not (guards := zero_guard_list(term)): return lanes
    false: dict[UOp, bool] = {}
    def is_false(c: UOp) -> bool:
        if (known := false.get(c)) is None: known = false[c] = (v := c.simplify()).op is _CONST and v.arg is False
        return known
    # (the guards' clauses substituted as the term is: lanes share most of them)
    return [UOp.const(t.dtype, 0) if any(is_false(c) for c in lane.src) else t
            for t, lane in zip(lanes, _each_lane(UOp.sink_of(*guards), axes))]

def _lane_clauses(term: UOp, lanes: set[UOp]) -> list[UOp]:
    """The clauses of the term's zero guards that vary with nothing but `lanes`: in a program where those are
    expanded, each is constant in each lane."""
    out = []
    for c in zero_guard_list(term):
        rs = [r for r in c.toposort() if r.op is _RANGE]
        if rs and all(r in lanes for r in rs): out.append(c)
    return out

def _padding_factor(term: UOp, cs: list[UOp]) -> int | None:
    """Which factor of product `term` is a load whose gate holds every clause of `cs` (so it reads +0 where one is
    false), or None."""
    if term.op is not Ops.MUL: return None
    for i, f in enumerate(term.src):
        if f.op is _LOAD and f.src[0].op is Ops.INDEX and len(f.src[0].src) > 2 and \
                all(c in clauses(f.src[0].src[2]) for c in cs):
            return i
    return None

def _skip_in_padding(term: UOp, lanes: set[UOp]) -> UOp:
    """A quick program's term where `lanes` are loops that the full program expands (whose lanes in padding it drops,
    _lanes_of_sum): the other factor selected to 0 there, so the product adds +0 * 0 and the sum the same bits.
    (lower_kernel lowers a kernel whose terms aren't such products whole.)"""
    if not (cs := _lane_clauses(term, lanes)): return term
    i = _padding_factor(term, cs)
    assert i is not None, "a term in padding that isn't a product with a gated load"
    keep = cs[0]
    for c in cs[1:]: keep = keep & c
    other = term.src[1 - i]
    other = keep.where(other, other.const_like(0))
    return term.replace(src=(term.src[0], other) if i == 0 else (other, term.src[1]))

def _expand_reduce(ctx: LowerCtx, red: UOp) -> UOp | None:
    """REDUCE(src, *ranges, arg=op) -> REDUCE(*values, *loops[, vec], arg=(op, n_acc, n_seq)): one value per
    combination of the expanded axes; "upcast" reduce axes give separate accumulators, "unroll" axes a chain."""
    if not isinstance(red.arg, Ops): return None
    rngs = red.src[1:]
    acc_axes = [r for r in rngs if range_kind(r) == "upcast" and r not in ctx.vecs]
    seq_axes = [r for r in rngs if range_kind(r) == "unroll"]
    keep = tuple(r for r in rngs if r not in acc_axes and r not in seq_axes)
    if ctx.quick and seq_axes and any(range_kind(r) in LOOP_KINDS for r in keep):
        # the chain as loops inside the reduction's own, in the order it was unrolled in: the accumulator takes the
        # same terms in the same order. (Not where the reduction has no loop: there the chain starts from the
        # identity, which the unrolled form may fold away, and 0 + -0.0 is not -0.0.) Fresh loops for each
        # reduction: an unrolled axis may be shared by sums in different loops (a blocked sum and its remainder),
        # where its lanes were constants but a loop is one place in the kernel
        rolled = {r: _new_range(ctx, range_size(r)) for r in seq_axes}
        ctx.rolled = True
        vals = _lanes_of_sum(red.src[0].substitute(rolled), red.arg, acc_axes)
        if red.arg is _ADD:
            vals = [_skip_in_padding(v, ctx.rolled_tiles | set(rolled.values())) for v in vals]
        return UOp(Ops.REDUCE, red.dtype, (*vals, *keep, *rolled.values()),
                   (red.arg, math.prod(range_size(r) for r in acc_axes), 1))
    vals = _lanes_of_sum(red.src[0], red.arg, acc_axes + seq_axes)
    if ctx.rolled_tiles and red.arg is _ADD: vals = [_skip_in_padding(v, set(ctx.rolled_tiles)) for v in vals]
    n_acc = math.prod(range_size(r) for r in acc_axes)
    return UOp(Ops.REDUCE, red.dtype, (*vals, *keep), (red.arg, n_acc, len(vals) // n_acc))

pm_expand_reduce = PatternMatcher([(UPat(Ops.REDUCE, name="red"), _expand_reduce)], name="expand_reduce")
pm_expand_reduce.__doc__ = "every REDUCE lists one value per combination of its upcast/unroll lanes"

def _lower_reduce(ctx: LowerCtx, red: UOp) -> UOp | None:
    op, n_acc, n_seq = red.arg
    vals, rngs = red.src[:n_acc * n_seq], red.src[n_acc * n_seq:]
    loops = [r for r in rngs if range_kind(r) in LOOP_KINDS]
    dt = red.dtype
    # (and the loops its loops' bounds vary with: a loop bounded per outer iteration, codegen/bounds.py, resets the
    # accumulator in them even where its terms don't vary with them)
    live = frozenset().union(*[live_ranges(v, ctx.live) for v in vals],
                             *[live_ranges(r.src[0], ctx.live) for r in loops if r.src[0].op is not _CONST])
    # the vector axis of this reduction: its own lanes (partial accumulators), or one its value varies with
    vec = next((v for v in ctx.vecs if v in rngs), None)
    if vec is None: vec = next((v for v in ctx.vecs if v in live), None)
    own_vec = vec is not None and vec in rngs
    outer_srcs = tuple(sorted((r for r in live if range_kind(r) in LOOP_KINDS and r not in loops),
                              key=lambda r: r.arg[0]))
    acc_on_vec = vec is not None
    finals = []
    for a in range(n_acc):
        chain = vals[a * n_seq:(a + 1) * n_seq]
        # (adding a constant 0 changes nothing: the sum starts at +0 and never holds -0; a sum of nothing but
        # padding is its identity)
        if op is _ADD: chain = [v for v in chain if not (v.op is _CONST and v.arg == 0)]
        if not loops or not chain:
            cur = identity_element(op, dt)
            for v in chain: cur = _combine(ctx, op, cur, v)
            finals.append(cur)
            continue
        acc = UOp(_DEFINE_REG, dt, (vec,) if acc_on_vec else (), ctx.next_reg)
        ctx.next_reg += 1
        init = UOp(Ops.STORE, dtypes.void, (acc, identity_element(op, dt)) + outer_srcs)
        cur = UOp(_LOAD, dt, (acc, init, *loops))
        for v in chain: cur = _combine(ctx, op, cur, v)
        upd = UOp(Ops.STORE, dtypes.void, (acc, cur))
        finals.append(UOp(_LOAD, dt, (acc, UOp(_END, dtypes.void, (upd, *loops)))))
    res = finals[0]
    for f in finals[1:]: res = res.alu(op, f)
    # partial accumulators along the vector lanes are combined across lanes (expand.py makes it a horizontal reduce)
    if own_vec: res = UOp(Ops.REDUCE, dt, (res, vec), (op, "lanes"))
    return res

pm_lower_reduce = PatternMatcher([(UPat(Ops.REDUCE, name="red"),
                                   lambda ctx, red: _lower_reduce(ctx, red) if red.arg[1] != "lanes" else None)],
                                 name="lower_reduce")
pm_lower_reduce.__doc__ = "no REDUCE over a loop remains: accumulators are registers updated inside the loops"

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the passes over every
# node of a kernel compare against module-level names)
_INDEX, _RANGE, _REDUCE, _STORE = Ops.INDEX, Ops.RANGE, Ops.REDUCE, Ops.STORE

def choose_vector_axis(ast: UOp, renderer) -> UOp | None:
    """The upcast RANGE to keep as SIMD lanes: a power-of-two axis contiguous in the most memory accesses."""
    vec_dts = getattr(renderer, "vector_dtypes", ())
    if not vec_dts: return None
    topo = ast.toposort()
    if any(u.op is _REDUCE and u.dtype not in vec_dts for u in topo): return None
    best, best_score = None, 0
    stored = {u.src[0] for u in topo if u.op is _STORE}
    reds = [u for u in topo if u.op is _REDUCE]
    outputs = [u for u in topo if u.op is _RANGE and range_kind(u) == "upcast" and not any(u in r.src for r in reds)]
    # (a single reduction that output lanes go through weighs its accesses by where they run and prefers wider
    # vectors; several, as softmax, or one computed once for all the lanes, keep the plain count: their own reduce
    # vector axes are chosen after this one)
    reduces = bool(reds)
    single = len(reds) == 1 and (not outputs or any(r in reds[0].src[0].toposort() for r in outputs))
    # each access's nodes, and whether it is inside a reduction's loop, found once for every candidate axis
    accesses = []
    for idx in (u for u in topo if u.op is _INDEX):
        deps = idx.toposort()
        accesses.append((idx, deps, any(x.op is _RANGE and range_kind(x) in ("reduce", "unroll") for x in deps)))
    for r in (u for u in topo if u.op is _RANGE and range_kind(u) == "upcast"):
        sz = range_size(r)
        if not isinstance(sz, int) or sz < 2 or sz & (sz - 1) or sz > 64: continue
        score, coeffs = 0, {}
        for idx, deps, in_reduce in accesses:
            if r not in deps: continue
            # contiguous: one vector access (behind a check that every lane is valid, if the mask varies with r);
            # a store per lane after a reduction costs little next to the reduction's loads
            contiguous = coeff(idx.src[1], r, coeffs) == 1 and idx.src[0].dtype.base in vec_dts
            # an access inside a reduction's loop runs far more often than one after it
            inner = single and in_reduce
            score += (4 if inner else 1) * (1 if contiguous else 0 if idx in stored and reduces else -1)
        # (with a reduction, the wider of two vector axes wins: an image row of 8 pixels loses to 16 channels)
        if single: score *= sz
        if score > best_score: best, best_score = r, score
    # (a pool's first maximum: a max, then a max over the taps' positions where they equal it)
    if best is None and reds and all(r.arg is _MAX for r in reds): best = _pool_row(ast, accesses, stored, vec_dts)
    # (a CPU's: GPU-style kernels are shaped by their own heuristic)
    if best is None and single and not getattr(renderer, "has_local", False):
        best = _gathering_row(ast, accesses, stored, vec_dts)
    return best

def _pool_row(ast: UOp, accesses: list, stored: set[UOp], vec_dts: tuple) -> UOp | None:
    """A max pool's output row upcast by the heuristic where its window reads every second (third, fourth) pixel: the
    stores are contiguous along it and every load gathers along it. Its lanes' taps are loaded one by one, its maxes
    are vector ones (a scalar max is a compare and a branch per tap)."""
    for r in (u for u in ast.toposort() if u.op is _RANGE and range_kind(u) == "upcast"):
        sz = range_size(r)
        if not isinstance(sz, int) or sz < 4 or sz & (sz - 1) or sz > 64: continue
        steps = [(coeff(idx.src[1], r), idx in stored, idx.src[0].dtype.base in vec_dts)
                 for idx, deps, _ in accesses if r in deps]
        if any(st for _, st, _ in steps) and all(ok and (c == 1 if st else c in (2, 3, 4)) for c, st, ok in steps):
            return r
    return None

def _gathering_row(ast: UOp, accesses: list, stored: set[UOp], vec_dts: tuple) -> UOp | None:
    """An upcast output axis of a single reduction that every store and some load inside the reduction are contiguous
    along, while the other loads that vary with it are strided (a layernorm's weight gradient whose input arrives
    transposed: the heuristic's `_vectorize_gathering_output`). The strided loads count against it above, but
    gathered lane by lane they are the scalar code's own loads, and each contiguous one is a vector: it is the SIMD
    axis all the same."""
    for r in (u for u in ast.toposort() if u.op is _RANGE and range_kind(u) == "upcast"):
        sz = range_size(r)
        if not isinstance(sz, int) or sz < 4 or sz & (sz - 1) or sz > 64: continue
        steps = [(coeff(idx.src[1], r), idx in stored, inner, idx.src[0].dtype.base in vec_dts)
                 for idx, deps, inner in accesses if r in deps]
        if all(ok and (c == 1 if st else c is not None) for c, st, _, ok in steps) and \
                any(st for _, st, _, _ in steps) and any(c == 1 and inner for c, st, inner, _ in steps if not st):
            return r
    return None

def choose_reduce_vector_axes(ast: UOp, renderer, vec: UOp | None) -> tuple[UOp, ...]:
    """In a kernel with several reductions, or one beside a main vector axis `vec`, an upcast reduce axis of each one
    that doesn't involve `vec`, contiguous in every load that varies with it: its partial accumulators become SIMD
    lanes too."""
    vec_dts = getattr(renderer, "vector_dtypes", ())
    reds = [u for u in ast.toposort() if u.op is _REDUCE]
    if (len(reds) < 2 and vec is None) or not vec_dts: return ()
    live: dict = {}
    chosen: list[tuple[UOp, UOp]] = []
    for red in reds:
        if red.dtype not in vec_dts: continue
        for r in red.src[1:]:
            sz = range_size(r)
            if range_kind(r) != "upcast" or not isinstance(sz, int) or sz < 2 or sz & (sz - 1) or sz > 64: continue
            idxs = [u for u in red.src[0].toposort() if u.op is _INDEX and r in u.toposort()]
            if not idxs or not all(coeff(i.src[1], r) == 1 and i.src[0].dtype.base in vec_dts for i in idxs): continue
            # no value may vary along two vector axes: this reduction's inputs vary with no other one, and the
            # inputs of the others (a reduction nested in this one) don't vary with this one
            axes = [v for v in (vec,) if v is not None] + [a for _, a in chosen]
            if any(a in live_ranges(red.src[0], live) for a in axes) or \
                    any(r in live_ranges(other.src[0], live) for other, _ in chosen):
                continue
            chosen.append((red, r))
            break
    return tuple(r for _, r in chosen)

def _quick_multiplies_padding(ast: UOp, vecs: set[UOp | None]) -> bool:
    """Whether a sum of `ast` has a term in padding for some lanes of its upcast or unrolled axes (other than the
    vector axes: a clause of its zero guards varies with nothing else) that isn't a product with a gated load:
    a quick program, whose loops take the place of some of those lanes, couldn't skip the products the full
    program drops (_skip_in_padding)."""
    for red in ast.toposort():
        if red.op is not _REDUCE or red.arg is not _ADD: continue
        lanes = {r for r in red.src[0].toposort() if r.op is _RANGE and range_kind(r) in ("upcast", "unroll") and
                 r not in vecs}
        if (cs := _lane_clauses(red.src[0], lanes)) and _padding_factor(red.src[0], cs) is None: return True
    return False

def _rollable_tiles(ast: UOp, vecs: tuple[UOp, ...]) -> list[UOp]:
    """The upcast output axes (not vector axes) that can become loops without a store landing in a loop it doesn't
    vary with. Output loops nest in the order of their ids, the upcast ones innermost (linearize.py), and a store goes
    in the deepest loop it varies with: one that doesn't vary with a loop around it would run once per iteration of
    that loop, twice for a loop of 2, which an in-place update (x += ...) merged beside a broadcast output mustn't."""
    topo = ast.toposort()
    reduce_rngs = {r for u in topo if u.op is _REDUCE for r in u.src[1:]}
    loops = [r for r in topo if r.op is _RANGE and range_kind(r) in ("global", "loop")]
    cands = sorted((r for r in topo if r.op is _RANGE and range_kind(r) == "upcast" and r not in vecs and
                    r not in reduce_rngs), key=lambda r: r.arg[0])
    if not cands: return []
    varies = [{u for u in st.toposort() if u.op is _RANGE} for st in ast.src]
    def nests(order: list[UOp]) -> bool:
        # every store varies with each loop around the deepest one it varies with
        for v in varies:
            deepest = max((i for i, r in enumerate(order) if r in v), default=-1)
            if not all(r in v for r in order[:deepest]): return False
        return True
    chosen: list[UOp] = []
    for r in cands:
        if nests(sorted(loops + chosen + [r], key=lambda x: x.arg[0])): chosen.append(r)
    return chosen

def lower_kernel(ast: UOp, renderer=None, use_fma: bool = False, quick: bool = False) -> tuple[UOp, LowerCtx]:
    """The optimized AST with expanded axes substituted and REDUCEs lowered to accumulators.

    `quick`: the same kernel with less code, computing every output element with the same operations in the same
    order, so both give the same bits. Only the vector axes and a reduction's partial accumulators stay expanded
    (those decide the order of a sum); the other upcast output axes (a register tile's rows and columns) become
    loops where that moves no store into a loop it doesn't vary with (_rollable_tiles), and unrolled reduce axes
    loops inside their reduction's (see _expand_reduce). The outermost loop, which
    the cores split, is the same loop: a call may run some chunks of one and some of the other."""
    vec = choose_vector_axis(ast, renderer)
    reduce_vecs = choose_reduce_vector_axes(ast, renderer, vec)
    # (the full program skips a sum's lanes in padding (_lanes_of_sum), which the quick one's loops skip by a select
    # (_skip_in_padding) where the term allows it, else the kernel is lowered whole: 0 * inf is NaN)
    if quick and _quick_multiplies_padding(ast, {vec, *reduce_vecs}): quick = False
    ctx = LowerCtx(vec=vec, use_fma=use_fma and getattr(renderer, "has_fma", False),
                   reduce_vecs=reduce_vecs, quick=quick)
    reduce_rngs = {r for u in ast.toposort() if u.op is _REDUCE for r in u.src[1:]}
    if quick and (tiles := _rollable_tiles(ast, ctx.vecs)):
        as_loops = {r: UOp(_RANGE, r.dtype, r.src, (r.arg[0], "loop")) for r in tiles}
        ast = ast.substitute(as_loops)
        ctx.rolled, ctx.rolled_tiles = True, frozenset(as_loops.values())
    ctx.next_range = max((u.arg[0] for u in ast.toposort() if u.op is _RANGE), default=-1) + 1
    stores = []
    for st in ast.src:
        axes = [r for r in st.toposort() if r.op is _RANGE and range_kind(r) == "upcast" and r is not ctx.vec
                and r not in reduce_rngs]
        stores += _each_lane(st, axes)
    sink = graph_rewrite(UOp.sink_of(*stores), pm_block_sums, ctx=ctx, name="block_sums")
    sink = graph_rewrite(sink, pm_expand_reduce, ctx=ctx, name="expand_reduce")
    sink = graph_rewrite(sink, pm_lower_reduce, ctx=ctx, bottom_up=True, name="lower_reduce")
    return sink, ctx
