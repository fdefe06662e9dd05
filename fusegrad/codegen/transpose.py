"""Gathers that together read a square block of a matrix become loads of its rows and a transpose in registers.

A PACK copy that transposes (`x @ W.T`'s W, copied contiguous along the output's vector) stores, for each of w
consecutive elements of W's rows, a vector gathered from w rows (opt/__init__.py makes the w stores of a block side by
side). Those w gathers read exactly the w x w block that w contiguous vector loads of the rows read: each gathered
vector is then one lane of every row's vector. A gather touches w cache lines for one element of each; the rows'
loads touch each line once, in the order of memory. (CPU kernels only: a row's vector load is at any element, which
a GPU's vector types don't allow.)"""
from __future__ import annotations
from fusegrad.dtype import DType
from fusegrad.uop.ops import Ops, UOp

_ADD, _CONST, _DEFINE_LOCAL, _GEP, _INDEX, _LOAD, _STORE, _VECTORIZE = \
    Ops.ADD, Ops.CONST, Ops.DEFINE_LOCAL, Ops.GEP, Ops.INDEX, Ops.LOAD, Ops.STORE, Ops.VECTORIZE

def _lane_address(ld: UOp) -> tuple[UOp, UOp | None, int] | None:
    """(buffer, the non-constant part of the position or None, the constant part) of an ungated scalar load, else
    None."""
    if ld.op is not _LOAD or len(ld.src) != 1 or (idx := ld.src[0]).op is not _INDEX or len(idx.src) != 2 or \
            ld.dtype.count != 1:
        return None
    pos = idx.src[1]
    if pos.op is _CONST: return idx.src[0], None, pos.arg
    if pos.op is _ADD and pos.src[1].op is _CONST: return idx.src[0], pos.src[0], pos.src[1].arg
    return idx.src[0], pos, 0

def _pick(dt: DType, srcs: list[tuple[UOp, int]]) -> UOp:
    """The vector of lanes `srcs` (a vector and a lane of it, each): a shuffle of at most two vectors."""
    return UOp(_VECTORIZE, dt, tuple(UOp(_GEP, dt.scalar(), (v,), i) for v, i in srcs))

def transposed(rows: list[UOp]) -> list[UOp]:
    """The columns of the square matrix whose rows are the w vectors `rows` (w a power of two), in log2(w) steps of
    two-vector shuffles: the step of size b swaps, in every 2b x 2b block, its top-right and bottom-left b x b
    blocks."""
    w, dt = len(rows), rows[0].dtype
    out = list(rows)
    b = w // 2
    while b:
        for r in range(w):
            if r & b: continue
            x, y = out[r], out[r + b]
            out[r] = _pick(dt, [(x, j) if not j & b else (y, j - b) for j in range(w)])
            out[r + b] = _pick(dt, [(x, j + b) if not j & b else (y, j) for j in range(w)])
        b //= 2
    return out

def transpose_gathers(sink: UOp, vector_dtypes: tuple[DType, ...]) -> UOp:
    """`sink` with each block of w gathers stored to local memory (lane i of gather j at element c + i * stride + j of
    one buffer) replaced by w vector loads of the rows (at c + i * stride), transposed in registers."""
    topo = sink.toposort()
    copied = {u.src[1] for u in topo
              if u.op is _STORE and u.src[0].op is _INDEX and u.src[0].src[0].op is _DEFINE_LOCAL}
    # gathers by (buffer, position's non-constant part, lanes) -> their lanes' constant parts, by the first lane's
    blocks: dict[tuple, dict[int, tuple[UOp, list[int]]]] = {}
    for g in copied:
        if g.op is not _VECTORIZE or (w := g.dtype.count) < 2 or w & (w - 1) or g.dtype.scalar() not in vector_dtypes:
            continue
        lanes = [a for s in g.src if (a := _lane_address(s)) is not None]
        if len(lanes) != w or any(a[:2] != lanes[0][:2] for a in lanes): continue
        consts = [a[2] for a in lanes]
        blocks.setdefault((*lanes[0][:2], w), {})[consts[0]] = (g, consts)
    replaced: dict[UOp, UOp] = {}
    for (buf, pos, w), by_start in blocks.items():
        for c0, (g0, consts0) in sorted(by_start.items()):
            if g0 in replaced: continue
            stride = consts0[1] - consts0[0]
            if stride < w: continue
            block = [by_start.get(c0 + j) for j in range(w)]
            if any(b is None or b[0] in replaced or b[1] != [c0 + j + i * stride for i in range(w)]
                   for j, b in enumerate(block)):
                continue
            dt, pos_dt = g0.dtype, g0.src[0].src[0].src[1].dtype
            def row(at: int) -> UOp:
                where = UOp.const(pos_dt, at) if pos is None else pos if at == 0 else pos + UOp.const(pos_dt, at)
                return UOp(_LOAD, dt, (UOp(_INDEX, buf.dtype.vec(w), (buf, where)),))
            for b, t in zip(block, transposed([row(c0 + i * stride) for i in range(w)])):
                if b is not None: replaced[b[0]] = t
    return sink.substitute(replaced) if replaced else sink
