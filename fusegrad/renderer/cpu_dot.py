"""bfloat16 products at the rate of a CPU's bfloat16 dot-product instruction (AVX512_BF16's `vdpbf16ps`: per 32-bit
lane, acc += a[2i+1]*b[2i+1], then acc += a[2i]*b[2i], each product exact and each add rounded as a fused
multiply-add, bfloat16 denormals read as zero and a denormal sum flushed to zero).

A register-tiled matmul of bfloat16 operands is lowered like a float32 one: its products formed in float32 from the
converted values, each row of the tile a broadcast scalar of A times vectors of B, the reduce loop unrolled into
chains of multiply-adds. Two consecutive links of such a chain whose scalars are A[m, k] and A[m, k + 1] (adjacent
bfloat16 elements of one buffer) and whose vectors hold bfloat16 values (converted from bfloat16, or loaded from a
packed copy that only such values were stored to) are one `vdpbf16ps`: A's pair read as one 32-bit word and
broadcast, B's two vectors interleaved per lane (the upper halves of their float32 lanes: their lower halves are
zero), computed once per pair of B rows and shared by the tile's rows. `bf16_pairs` finds those links in the
linearized kernel; the C renderer writes each pair as one instruction (DESIGN.md, "bfloat16 products"). A kernel
that is nothing but a bfloat16 matmul (`amx_plan`) is written whole instead: on AMX tiles, or as dot products of B's
rows packed in pairs."""
from __future__ import annotations
from dataclasses import dataclass
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import coeff
from fusegrad.uop.ops import Ops, UOp

DOT_LANES = 16   # the float32 lanes of one vdpbf16ps on 512-bit registers
# (the ops tested for every node of a kernel, as module-level names: on Python 3.11 each `Ops.X` goes through the Enum
# metaclass's __getattr__)
_STORE, _INDEX, _DEFINE_LOCAL, _MULACC = Ops.STORE, Ops.INDEX, Ops.DEFINE_LOCAL, Ops.MULACC
_F32_DOT = dtypes.float32.vec(DOT_LANES)

@dataclass(frozen=True)
class Bf16Pair:
    """Two links of a multiply-add chain computed as one bfloat16 dot product: `acc` plus A[lo] * `lo_vec` plus
    A[lo + 1] * `hi_vec`, where `lo` is the (ungated) INDEX of the first of the two adjacent bfloat16 elements of A."""
    inner: UOp    # the first link (its multiply-add is not written: the pair's instruction computes it)
    acc: UOp      # what the first link adds to
    lo: UOp       # INDEX of A[m, k]; A[m, k + 1] follows it in memory
    lo_vec: UOp   # the float32 vector A[m, k] multiplies
    hi_vec: UOp   # the float32 vector A[m, k + 1] multiplies

def _split_offset(x: UOp) -> tuple[UOp | None, int]:
    """An index expression as (its part that isn't a constant, or None, and the constant added to it)."""
    if x.op is Ops.CONST: return None, x.arg
    if x.op is Ops.ADD and x.src[1].op is Ops.CONST: return x.src[0], x.src[1].arg
    return x, 0

def _bf16_scalar(v: UOp) -> UOp | None:
    """The INDEX of the bfloat16 element that the float32 vector `v` broadcasts (an ungated load converted to
    float32), or None."""
    if v.op is not Ops.VECTORIZE or any(s is not v.src[0] for s in v.src): return None
    c = v.src[0]
    if c.op is not Ops.CAST or c.dtype != dtypes.float32 or (ld := c.src[0]).op is not Ops.LOAD or \
            ld.dtype != dtypes.bfloat16 or len(ld.src) != 1 or (idx := ld.src[0]).op is not Ops.INDEX or \
            len(idx.src) != 2 or idx.dtype.vcount != 1:
        return None
    return idx

def _local_of(x: UOp) -> UOp:
    """The DEFINE_LOCAL behind a buffer operand of an INDEX (a BARRIER stands for its buffer once it is copied)."""
    while x.op is Ops.BARRIER: x = x.src[0]
    return x

def _exact_locals(uops: list[UOp]) -> set[UOp]:
    """The local buffers (packed copies) that only values converted from bfloat16 are stored to."""
    exact: dict[UOp, bool] = {}
    for u in uops:
        if u.op is _STORE and u.src[0].op is _INDEX and (buf := _local_of(u.src[0].src[0])).op is _DEFINE_LOCAL:
            # (a gated store leaves what was there before where its gate is false)
            exact[buf] = exact.get(buf, True) and _from_bf16(u.src[1]) and len(u.src[0].src) == 2
    return {buf for buf, ok in exact.items() if ok}

def _from_bf16(v: UOp) -> bool: return v.op is Ops.CAST and v.src[0].dtype.scalar() == dtypes.bfloat16

def _bf16_vector(v: UOp, exact: set[UOp]) -> bool:
    """Whether the float32 vector `v` holds bfloat16 values (the lower 16 bits of every lane zero): converted from
    bfloat16, or loaded (ungated) from a packed copy of such values."""
    if v.dtype != _F32_DOT: return False
    if _from_bf16(v): return True
    return v.op is Ops.LOAD and len(v.src) == 1 and (idx := v.src[0]).op is Ops.INDEX and len(idx.src) == 2 and \
        _local_of(idx.src[0]) in exact

def _link(m: UOp, exact: set[UOp]) -> tuple[UOp, UOp] | None:
    """(A's INDEX, B's vector) of a multiply-add of a broadcast bfloat16 scalar of A and a vector of bfloat16 values."""
    if m.op is not _MULACC or m.dtype != _F32_DOT: return None
    for s, v in ((m.src[0], m.src[1]), (m.src[1], m.src[0])):
        if (idx := _bf16_scalar(s)) is not None and _bf16_vector(v, exact): return idx, v
    return None

def bf16_pairs(uops: list[UOp], users: dict[UOp, list[UOp]]) -> dict[UOp, Bf16Pair]:
    """The second link of each pair of multiply-add links that one bfloat16 dot product computes, with the pair.

    A link pairs with the one it adds to when that one is used by nothing else, is not itself the second link of a
    pair, and their scalars are adjacent elements of one bfloat16 buffer (in either order)."""
    exact = _exact_locals(uops)
    pairs: dict[UOp, Bf16Pair] = {}
    for u in uops:
        if (outer := _link(u, exact)) is None or (inner_m := u.src[2]) in pairs or users.get(inner_m) != [u] or \
                (inner := _link(inner_m, exact)) is None:
            continue
        (i0, v0), (i1, v1) = inner, outer
        if i0.src[0] is not i1.src[0]: continue
        (b0, o0), (b1, o1) = _split_offset(i0.src[1]), _split_offset(i1.src[1])
        if b0 is not b1: continue
        if o1 == o0 + 1: pairs[u] = Bf16Pair(inner_m, inner_m.src[2], i0, v0, v1)
        elif o0 == o1 + 1: pairs[u] = Bf16Pair(inner_m, inner_m.src[2], i1, v1, v0)
    return pairs

# *** whole matmuls: on AMX tiles, or (a CPU without them) as dot products of pairs: renderer/cstyle.py ***

AMX_TILE = 32   # rows and columns of the block of output one pass computes (2 x 2 tiles of 16 x 16); K steps of 32
AMX_MAX_K = 4096   # the packed panel of B (64 bytes per step of K) is a stack array: at most 256 KB

@dataclass(frozen=True)
class AmxPlan:
    """out[m, n] = sum over k of A[m, k] * B[k, n] (bfloat16 A and B, the sum in float32, stored as float32 or rounded
    to bfloat16), every index an offset plus a stride per loop: M rows (the kernel's parallel loop), N columns
    contiguous in out, K contiguous in A, B contiguous along N or along K (a transposed weight: x @ w.T). Each a
    multiple of AMX_TILE."""
    out: UOp
    a: UOp
    b: UOp
    m: int
    n: int
    k: int
    a_off: int
    a_row: int    # A's stride along m (along k it is 1)
    b_off: int
    b_row: int    # B's stride along k
    b_col: int    # B's stride along n (one of b_row and b_col is 1)
    o_off: int
    o_row: int    # out's stride along m (along n it is 1)

def _strides(idx: UOp, loops: tuple[UOp, ...]) -> tuple[int, ...] | None:
    """The index's constant offset and its stride along each loop, or None where it isn't such a sum."""
    cs = tuple(coeff(idx, r) for r in loops)
    off = idx.substitute({r: r.const_like(0) for r in loops}).simplify()
    if any(not isinstance(c, int) for c in cs) or off.op is not Ops.CONST or not isinstance(off.arg, int): return None
    # (the index must be exactly that sum: checked at the loops' last iterations too)
    last = idx.substitute({r: r.const_like(r.src[0].arg - 1) for r in loops}).simplify()
    if last.op is not Ops.CONST or last.arg != off.arg + sum(c * (r.src[0].arg - 1) for c, r in zip(cs, loops)):
        return None
    return (off.arg, *cs)

def _bf16_load(x: UOp) -> UOp | None:
    """The INDEX of an ungated bfloat16 load from a global buffer that `x` converts to float32, or None."""
    if x.op is not Ops.CAST or x.dtype != dtypes.float32 or (ld := x.src[0]).op is not Ops.LOAD or \
            ld.dtype != dtypes.bfloat16 or len(ld.src) != 1 or (idx := ld.src[0]).op is not Ops.INDEX or \
            len(idx.src) != 2 or idx.src[0].op is not Ops.DEFINE_GLOBAL:
        return None
    return idx

def whole_matmul_plan(renderer: object, nodes: list[UOp]) -> AmxPlan | None:
    """The plan of a kernel that `renderer` writes whole as a bfloat16 matmul (`amx_plan`: on AMX tiles, or as dot
    products of pairs on a CPU with AVX512_BF16), or None: what the heuristic leaves without opts and the C renderer
    writes as its template."""
    if not (getattr(renderer, "amx", False) or getattr(renderer, "bf16_dot", False)): return None
    return amx_plan(nodes)

def amx_plan(nodes: list[UOp]) -> AmxPlan | None:
    """The plan of a kernel that is nothing but a bfloat16 matmul (its AST, or its linearized loop nest without opts:
    `nodes` in either form), or None."""
    stores = [u for u in nodes if u.op is Ops.STORE and u.src[0].op is Ops.INDEX]
    loops = [u for u in nodes if u.op is Ops.RANGE]
    if len(stores) != 1 or len(loops) != 3 or \
            any(r.src[0].op is not Ops.CONST or not isinstance(r.src[0].arg, int) for r in loops):
        return None
    st = stores[0]
    out_idx, v = st.src[0], st.src[1]
    if len(out_idx.src) != 2 or out_idx.src[0].op is not Ops.DEFINE_GLOBAL or v.dtype.count != 1: return None
    if out_idx.src[0].dtype.base not in (dtypes.float32, dtypes.bfloat16): return None
    if v.op is Ops.CAST and out_idx.src[0].dtype.base == dtypes.bfloat16 and v.dtype == dtypes.bfloat16: v = v.src[0]
    if v.dtype != dtypes.float32: return None
    # the sum of products: a REDUCE (the AST), or an accumulator register added to in the reduce loop (the loop nest)
    if v.op is Ops.REDUCE and v.arg is Ops.ADD and len(v.src) == 2: prod, red = v.src[0], v.src[1]
    elif v.op is Ops.LOAD and (acc := v.src[0]).op is Ops.DEFINE_REG:
        updates = [u for u in nodes if u.op is Ops.STORE and u.src[0] is acc]
        init = [u for u in updates if u.src[1].op is Ops.CONST]
        step = [u for u in updates if u.src[1].op is Ops.ADD]
        if len(updates) != 2 or len(init) != 1 or init[0].src[1].arg != 0 or len(step) != 1: return None
        add = step[0].src[1]
        prev = [s for s in add.src if s.op is Ops.LOAD and s.src[0] is acc]
        if len(prev) != 1 or len(prev[0].src) < 3: return None
        prod, red = next(s for s in add.src if s is not prev[0]), prev[0].src[2]
        # (nothing else computes in floats: the kernel is the product and its sum only)
        if any(u.dtype.scalar() in (dtypes.float32, dtypes.bfloat16) and u.op not in (Ops.CONST, Ops.LOAD, Ops.CAST,
                                                                                      Ops.MUL, Ops.ADD, Ops.DEFINE_REG)
               for u in nodes):
            return None
        if sum(1 for u in nodes if u.op is Ops.MUL and u.dtype == dtypes.float32) != 1: return None
    else: return None
    if prod.op is not Ops.MUL or red.op is not Ops.RANGE or red not in loops: return None
    ia, ib = _bf16_load(prod.src[0]), _bf16_load(prod.src[1])
    if ia is None or ib is None: return None
    # (m: the outer output loop, the kernel's parallel one)
    m, n = sorted((r for r in loops if r is not red), key=lambda r: r.arg[0])
    if n.arg[1] == "global" or red.arg[1] == "global": return None
    if (sa := _strides(ia.src[1], (m, n, red))) is None or (sb := _strides(ib.src[1], (m, n, red))) is None: return None
    if sa[1] == 0: ia, ib, sa, sb = ib, ia, sb, sa   # (A: the operand that moves with m)
    so = _strides(out_idx.src[1], (m, n, red))
    if so is None or sa[2:] != (0, 1) or sb[1] != 0 or 1 not in (sb[2], sb[3]) or so[2:] != (1, 0): return None
    sizes = [r.src[0].arg for r in (m, n, red)]
    # (not one writing a buffer it reads: its panels of B are copied before the rows they feed are written)
    if any(s % AMX_TILE for s in sizes) or sizes[2] > AMX_MAX_K or min(sa[1], sb[2], sb[3], so[1]) <= 0 or \
            out_idx.src[0] in (ia.src[0], ib.src[0]):
        return None
    return AmxPlan(out_idx.src[0], ia.src[0], ib.src[0], *sizes, sa[0], sa[1], sb[0], sb[3], sb[2], so[0], so[1])
