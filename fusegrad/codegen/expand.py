"""Vectorization: the vector axis (one RANGE of kind "upcast" chosen by lower.py) becomes SIMD lanes.

A value that depends on the vector axis gets a vector dtype of `width` lanes. Memory accesses that are contiguous
along the axis become one vector LOAD/STORE (INDEX with a vector pointer dtype); others become one scalar access per
lane. ALU ops on dtypes the renderer can hold in vectors stay vector ops; the rest are split into lanes (GEP) and
rebuilt (VECTORIZE), and every such VECTORIZE of a non-vector dtype is folded away again by GEP(VECTORIZE) -> lane."""
from __future__ import annotations
import functools
from dataclasses import dataclass, field
from typing import Literal
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.uop.affine import coeff, live_ranges
from fusegrad.uop.ops import GroupOp, Ops, UOp, exec_alu
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite
from fusegrad.uop.symbolic import simplify_index

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_AND, _CMPLT, _CMPNE, _GEP, _INDEX, _LOAD, _NOOP = Ops.AND, Ops.CMPLT, Ops.CMPNE, Ops.GEP, Ops.INDEX, Ops.LOAD, Ops.NOOP
_STORE, _VECTORIZE, _WHERE = Ops.STORE, Ops.VECTORIZE, Ops.WHERE

@dataclass
class VecCtx:
    vec: UOp
    width: int
    vec_dtypes: tuple[DType, ...]
    live: dict = field(default_factory=dict)
    coeffs: dict = field(default_factory=dict)   # memo for coeff along the vector axis
    # the kernel's accesses share most of their terms: each node's lanes (the vector axis replaced by each lane's
    # constant) are made once per kernel. `lane_subs[k]` maps a node to lane k's node where they differ; `lanes_done`
    # and `zero_done` hold the nodes walked for all lanes and for lane 0 alone (the base of a vector access)
    lane_subs: list = field(default_factory=list)
    lanes_done: dict = field(default_factory=dict)
    zero_sub: dict = field(default_factory=dict)
    zero_done: dict = field(default_factory=dict)
    # the memory pass's memo (node -> rewritten node). A node the vector axis doesn't reach has nothing to rewrite:
    # what the pass makes of lanes (positions with the axis replaced by constants) goes here as it is, so the
    # rewrite doesn't walk it again
    rewritten: dict = field(default_factory=dict)
    def __post_init__(self) -> None:
        self.lane_subs = [{self.vec: UOp.const(self.vec.dtype, k)} for k in range(self.width)]
        self.zero_sub = {self.vec: UOp.const(self.vec.dtype, 0)}
    def dep(self, u: UOp) -> bool: return self.vec in live_ranges(u, self.live)
    def coeff(self, x: UOp) -> int | None: return coeff(x, self.vec, self.coeffs)
    def final(self, u: UOp) -> UOp:
        """`u`, which the vector axis doesn't reach, marked as rewritten."""
        self.rewritten.setdefault(u, u)
        return u
    def index_dep(self, idx: UOp) -> bool:
        """Whether the INDEX `idx` addresses differently per lane (its buffer, a BARRIER's value, is one)."""
        return any(self.dep(s) for s in idx.src[1:])
    def lanes(self, u: UOp) -> list[UOp]:
        """`u` with the vector axis replaced by each lane's constant (as `u.substitute` of each would)."""
        _substitute_into(u, self.lane_subs, self.lanes_done)
        return [self.final(sub.get(u, u)) for sub in self.lane_subs]
    def lane_zero(self, u: UOp) -> UOp:
        """`u` with the vector axis replaced by 0."""
        _substitute_into(u, [self.zero_sub], self.zero_done)
        return self.zero_sub.get(u, u)
    def index_lanes(self, idx: UOp) -> list[UOp]:
        """The INDEX `idx` of each lane: its position (and gate) per lane, its buffer the same for all (a BARRIER
        before a local buffer is one barrier, whatever the lanes of what was stored before it)."""
        return [idx.replace(src=(idx.src[0], *rest)) for rest in zip(*[self.lanes(s) for s in idx.src[1:]])]

def _substitute_into(u: UOp, subs: list[dict[UOp, UOp]], done: dict[UOp, None]) -> None:
    """Extend each of `subs` (a node -> its replacement, seeded with the nodes to replace) over the nodes of `u` not
    in `done` (those walked before), keeping only the nodes that change; then every node of `u` is in `done`."""
    if u in done: return
    for x in u.toposort(gate=lambda x: x not in done):
        if x in done: continue
        done[x] = None
        if not x.src: continue
        for sub in subs:
            if x in sub: continue
            new_src = tuple(map(sub.get, x.src, x.src))
            if new_src != x.src: sub[x] = UOp(x.op, x.dtype, new_src, x.arg)

def broadcast(s: UOp, width: int) -> UOp: return UOp(_VECTORIZE, s.dtype.vec(width), (s,) * width)
def gep(s: UOp, k: int) -> UOp: return UOp(_GEP, s.dtype.scalar(), (s,), k) if s.dtype.count > 1 else s

def _split_index(idx: UOp) -> tuple[UOp, UOp, UOp | None]:
    return idx.src[0], idx.src[1], idx.src[2] if len(idx.src) > 2 else None

def _contiguous(ctx: VecCtx, buf: UOp, i: UOp, valid: UOp | None) -> bool:
    return buf.dtype.base in ctx.vec_dtypes and (valid is None or not ctx.dep(valid)) and ctx.coeff(i) == 1

def _vec_index(ctx: VecCtx, buf: UOp, i: UOp, valid: UOp | None) -> UOp:
    base = ctx.final(simplify_index(ctx.lane_zero(i)))
    assert isinstance(buf.dtype, PtrDType)
    return UOp(_INDEX, buf.dtype.vec(ctx.width), (buf, base) + ((valid,) if valid is not None else ()))

def _same_gate(lanes: list[UOp]) -> UOp | None | Literal[False]:
    """The gate of a contiguous vector access whose lanes' gates are one expression (a padded edge that vector
    boundaries align with: all lanes in or all out): None where that is always true; False where the lanes differ."""
    if any(v is not lanes[0] for v in lanes): return False
    return None if lanes[0].op is Ops.CONST and lanes[0].arg is True else lanes[0]

def _monotone(valid: UOp, r: UOp) -> bool:
    """Whether `valid` is an AND of comparisons of expressions affine in r: then it holds for every r in [a, b]
    when it holds at a and at b."""
    if valid.op is _AND: return all(_monotone(s, r) for s in valid.src)
    if valid.op is _CMPNE and valid.src[1].op is Ops.CONST and valid.src[0].dtype == dtypes.bool:
        return _monotone(valid.src[0], r)   # logical not
    return valid.op is _CMPLT and all(coeff(s, r) is not None for s in valid.src)

def _vec_load(ctx: VecCtx, ld: UOp, idx: UOp) -> UOp | None:
    if ld.dtype.count > 1 or not ctx.index_dep(idx): return None
    buf, i, valid = _split_index(idx)
    if _contiguous(ctx, buf, i, valid): return UOp(_LOAD, ld.dtype.vec(ctx.width), (_vec_index(ctx, buf, i, valid),))
    if valid is not None and buf.dtype.base in ctx.vec_dtypes and ctx.coeff(i) == 1:
        lanes = [ctx.final(simplify_index(v)) for v in ctx.lanes(valid)]
        if (same := _same_gate(lanes)) is not False:
            return UOp(_LOAD, ld.dtype.vec(ctx.width), (_vec_index(ctx, buf, i, same),))
        # a padded edge: LOAD(INDEX(vector pointer), all_valid, *lane_valid) is one vector load where every lane is
        # valid and a gated load per lane elsewhere
        every = lanes[0] & lanes[-1] if _monotone(valid, ctx.vec) else functools.reduce(lambda a, b: a & b, lanes)
        return UOp(_LOAD, ld.dtype.vec(ctx.width),
                   (_vec_index(ctx, buf, i, None), ctx.final(simplify_index(every)), *lanes))
    lanes = [UOp(_LOAD, ld.dtype, (i,)) for i in ctx.index_lanes(idx)]
    # (a lane's load of a kernel buffer is all constants in place of the axis; one of a local buffer follows the
    # barrier, which may come after stores still to be rewritten)
    if not buf.src: lanes = [ctx.final(x) for x in lanes]
    return UOp(_VECTORIZE, ld.dtype.vec(ctx.width), tuple(lanes))

def _vec_store(ctx: VecCtx, st: UOp, idx: UOp) -> UOp | None:
    if idx.dtype.vcount > 1 or not ctx.index_dep(idx): return None
    buf, i, valid = _split_index(idx)
    if _contiguous(ctx, buf, i, valid): return st.replace(src=(_vec_index(ctx, buf, i, valid), *st.src[1:]))
    if valid is not None and buf.dtype.base in ctx.vec_dtypes and ctx.coeff(i) == 1 and \
            (same := _same_gate([ctx.final(simplify_index(v)) for v in ctx.lanes(valid)])) is not False:
        return st.replace(src=(_vec_index(ctx, buf, i, same), *st.src[1:]))
    # one store per lane, grouped under a NOOP
    value = st.src[1]
    return UOp(_NOOP, dtypes.void, tuple(UOp(_STORE, dtypes.void, (i, UOp(_GEP, value.dtype, (value,), k)))
                                            for k, i in enumerate(ctx.index_lanes(idx))))

pm_vector_memory = PatternMatcher([
    (UPat(Ops.LOAD, src=(UPat(Ops.INDEX, name="idx"),), name="ld"), _vec_load),
    (UPat(Ops.STORE, src=(UPat(Ops.INDEX, name="idx"), UPat()), name="st"), _vec_store),
], name="vector_memory")
pm_vector_memory.__doc__ = "memory accesses along the vector axis are one vector access when contiguous, else per lane"
# *** values ***

def _is_vec(u: UOp) -> bool: return u.dtype.count > 1

# bools are vectors only in registers: masks made by comparisons, combined by logic ops, used by WHERE and CAST (in
# memory they stay lanes: bool is not a vector dtype of any renderer)
_MASK_OPS = GroupOp.Comparison | {Ops.AND, Ops.OR, Ops.XOR, Ops.NOT, Ops.NEG, Ops.WHERE, Ops.CAST}

def _in_vectors(ctx: VecCtx, x: UOp) -> bool:
    dts = [x.dtype.scalar()] + [s.dtype.scalar() for s in x.src]
    if dtypes.bool in dts and x.op not in _MASK_OPS: return False
    return all(d in ctx.vec_dtypes or d == dtypes.bool for d in dts)

def _alu(ctx: VecCtx, x: UOp) -> UOp | None:
    if not any(_is_vec(s) for s in x.src) or _is_vec(x): return None
    w = ctx.width
    if x.op is _WHERE and not _is_vec(x.src[0]) and x.dtype in ctx.vec_dtypes:
        # a scalar condition picks a whole vector
        return UOp(_WHERE, x.dtype.vec(w), (x.src[0], *[s if _is_vec(s) else broadcast(s, w) for s in x.src[1:]]))
    if _in_vectors(ctx, x):
        return UOp(x.op, x.dtype.vec(w), tuple(s if _is_vec(s) else broadcast(s, w) for s in x.src), x.arg)
    return UOp(_VECTORIZE, x.dtype.vec(w), tuple(x.replace(src=tuple(gep(s, k) for s in x.src)) for k in range(w)))

def _lanes_reduce(red: UOp) -> UOp | None:
    x, op = red.src[0], red.arg[0]
    if not _is_vec(x): return None
    vals = [gep(x, k) for k in range(x.dtype.count)]
    while len(vals) > 1:   # pairwise, so float sums stay accurate
        vals = [vals[i].alu(op, vals[i + 1]) if i + 1 < len(vals) else vals[i] for i in range(0, len(vals), 2)]
    return vals[0]

def _fold_index_const(x: UOp) -> UOp | None:
    # lanes of the vector axis used as values (e.g. arange) fold to per-lane constants
    if x.dtype != dtypes.index or not all(s.op is Ops.CONST for s in x.src): return None
    return UOp.const(x.dtype, exec_alu(x.op, x.dtype, tuple(s.arg for s in x.src)))

pm_vectorize = PatternMatcher([
    (UPat(Ops.RANGE, name="r"), lambda ctx, r: UOp(Ops.VECTORIZE, r.dtype.vec(ctx.width),
                                                   tuple(UOp.const(r.dtype, k) for k in range(ctx.width)))
     if r is ctx.vec else None),
    # an accumulator along this pass's axis (its RANGE source is already the lanes; another axis' is still a RANGE)
    (UPat(Ops.DEFINE_REG, name="d"), lambda ctx, d: d.replace(dtype=d.dtype.vec(ctx.width), src=())
     if d.src and d.src[0].op is not Ops.RANGE and not _is_vec(d) else None),
    # accumulator reads and writes follow the accumulator's width
    (UPat(Ops.LOAD, src=(UPat(Ops.DEFINE_REG, name="d"),), allow_any_len=True, name="ld"),
     lambda d, ld: ld.replace(dtype=d.dtype) if d.dtype != ld.dtype else None),
    (UPat(Ops.STORE, src=(UPat((Ops.DEFINE_REG, Ops.INDEX), name="d"), UPat.var("v")), allow_any_len=True, name="st"),
     lambda ctx, d, v, st: st.replace(src=(d, broadcast(v, d.dtype.vcount), *st.src[2:]))
     if d.dtype.vcount > 1 and not _is_vec(v) else None),
    (UPat(Ops.REDUCE, name="red"), lambda red: _lanes_reduce(red) if red.arg[1] == "lanes" else None),
    (UPat(Ops.GEP, src=(UPat(Ops.VECTORIZE, name="v"),), name="g"), lambda v, g: v.src[g.arg]),
    (UPat(Ops.GEP, name="g"), lambda g: g.src[0] if not _is_vec(g.src[0]) else None),
    (UPat(GroupOp.ALU | {Ops.CAST, Ops.BITCAST}, name="x"), _alu),
    (UPat(GroupOp.ALU, name="x"), _fold_index_const),
], name="vectorize")
pm_vectorize.__doc__ = "values along the vector axis are vectors of supported dtypes or bool masks; no other " \
    "vector dtype remains"

_ACCESSES, _CONST = {Ops.LOAD, Ops.STORE}, Ops.CONST   # (module-level: `Ops.X` lookups are slow, see linearize.py)

# ops a rule of pm_vectorize may rewrite though nothing below them is a vector
_NOT_SCALAR_PART = {Ops.DEFINE_REG, Ops.STORE, Ops.GEP, Ops.REDUCE, Ops.VECTORIZE}

def _scalar_part(sink: UOp, vec: UOp) -> dict[UOp, UOp]:
    """The nodes of `sink` that pm_vectorize leaves as they are, each mapped to itself: scalar nodes over scalar
    nodes that are not the vector axis, nor an op a rule rewrites regardless (an accumulator, a store, a lane pick, a
    reduction), nor index arithmetic on constants alone (which the rules fold)."""
    out: dict[UOp, UOp] = {}
    for u in sink.toposort():
        if u is vec or u.dtype.count != 1 or u.op in _NOT_SCALAR_PART or not all(map(out.__contains__, u.src)):
            continue
        if u.src and u.op in GroupOp.ALU and all(s.op is _CONST for s in u.src): continue
        out[u] = u
    return out

def vectorize(sink: UOp, vec: UOp, width: int, vec_dtypes: tuple[DType, ...]) -> UOp:
    """Turn the vector axis `vec` of a lowered kernel into SIMD lanes."""
    ctx = VecCtx(vec, width, vec_dtypes)
    # the memory pass rewrites loads and stores alone: a node with none below it stays as it is, and is not walked
    # (the index arithmetic, most of a kernel's nodes)
    unchanged = ctx.rewritten
    for u in sink.toposort():
        if u.op not in _ACCESSES and all(map(unchanged.__contains__, u.src)): unchanged[u] = u
    sink = graph_rewrite(sink, pm_vector_memory, ctx=ctx, name="vector_memory", memo=unchanged)
    sink = graph_rewrite(sink, pm_vectorize, ctx=ctx, bottom_up=True, name="vectorize", memo=_scalar_part(sink, vec))
    for u in sink.toposort():
        if u.dtype.count > 1 and u.dtype.scalar() not in vec_dtypes + (dtypes.bool,) and \
                not isinstance(u.dtype, PtrDType):
            raise RuntimeError(f"vectorize left a {u.dtype} {u.op}")
    return sink
