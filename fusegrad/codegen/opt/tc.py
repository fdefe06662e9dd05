"""Tensor cores: the TC opt lays a matmul-shaped reduction out for a warp matrix instruction (a `TensorCore` of the
renderer), and `fuse_wmma` makes the lowered accumulation the instruction's own.

A reduction qualifies when it is a sum of products of two values loaded from memory, `A[.., m, .., k] * B[.., k, ..,
n]`, each of the tensor core's input dtype cast to its output dtype, the sum's (or of that dtype without a cast where
the two are the same: float32's TF32), with an output loop M that only A varies with, one N that only B varies with,
and a reduce loop K both vary with (a matmul; a convolution with M its output pixels, N its output channels, K its
input channels). TC splits them into
the instruction's (M, N, K) tiles: their outer parts stay loops, and the inner parts become the warp's lanes, a
"local" range of `threads` work-items that is launch dimension 0 (so a lane's id is its thread id modulo the warp
size, as the hardware numbers lanes), and the elements of the fragments each lane holds. The reduction becomes

    REDUCE(ADD, WMMA(VECTORIZE(A elements), VECTORIZE(B elements), 0), *outer reduce loops)    (a vector of C's)

and the STORE one store per C element, each of its lane's element (GEP) at its (row, col) of the tile. After lowering
the sum is an accumulator of C's elements updated by ADD(acc, WMMA(a, b, 0)); `fuse_wmma` turns it into
WMMA(a, b, acc), so the instruction accumulates.

Staged operands: each lane reading its fragment elements from global memory reads each of them separately (2 bytes),
and every warp of a group reads the same rows of A (or columns of B) again. TC keeps A and B as functions of their
(row, col) (`Kernel.tc_frame`, updated by the opts after it), so LTILE of the K loop can stage them the way the group
reads them: per block of K, the rows of A that the group's tiles cover times the block (and the block times B's
columns) are copied into local memory by all the group's work-items, neighbouring ones reading neighbouring
elements, and the lanes read their fragments from the copy (`stage_operands`)."""
from __future__ import annotations
import math
from fusegrad.codegen.lower import SUM_BLOCKED_OVER
from fusegrad.codegen.opt import Kernel, KernelOptError, OptOps, _linear
from fusegrad.dtype import dtypes
from fusegrad.helpers import SPEC
from fusegrad.renderer import TensorCore
from fusegrad.uop.affine import coeff, range_size
from fusegrad.uop.ops import ORDER_ONLY, Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite
from fusegrad.uop.spec import kernel_spec, tensor_core_spec, verify

def _as_input(x: UOp, tc: TensorCore) -> UOp | None:
    """`x` (of tc's output dtype) as the same values of its input dtype, where it is a conversion of such values: a
    CAST of them, a WHERE of such (a padding's gate: WHERE(valid, CAST(load), 0)), zero; or `x` itself where the two
    dtypes are the same (float32's TF32)."""
    if x.dtype == tc.dtype_in: return x
    if x.op is Ops.CAST and x.src[0].dtype == tc.dtype_in: return x.src[0]
    if x.op is Ops.CONST and x.dtype.count == 1 and x.arg == 0: return UOp.const(tc.dtype_in, 0)
    if x.op is Ops.WHERE and (a := _as_input(x.src[1], tc)) is not None and (b := _as_input(x.src[2], tc)) is not None:
        return UOp(Ops.WHERE, tc.dtype_in, (x.src[0], a, b))
    return None

def _operand(x: UOp, tc: TensorCore) -> UOp | None:
    """What factor `x` gives the tensor core: values of its input dtype cast to its output dtype (see `_as_input`),
    computed from loads (a load, or a conversion fused into the kernel)."""
    if x.dtype != tc.dtype_out or (y := _as_input(x, tc)) is None: return None
    return y if any(u.op is Ops.LOAD for u in y.toposort()) else None

def _product(red: UOp) -> UOp | None:
    """The MUL a sum reduces, where padded iterations (PADTO: WHERE(inside, x, 0)) already read zeros."""
    x = red.src[0]
    if x.op is Ops.WHERE and x.src[2].op is Ops.CONST and x.src[2].arg == 0:
        # every load varying with a padded loop is gated by its bound: the product is 0 there anyway
        x = x.src[1]
    return x if x.op is Ops.MUL else None

def _lane_expr(weights: tuple[int, ...], lane: UOp) -> UOp:
    """sum(w_b * bit b of lane): runs of bits whose weights double are one field, (lane // 2^lo % 2^n) * w."""
    out, b, bits = UOp.const(dtypes.index, 0), 0, len(weights)
    while b < bits:
        if weights[b] == 0:
            b += 1
            continue
        lo = b
        while b + 1 < bits and weights[b + 1] == 2 * weights[b]: b += 1
        field = lane // (1 << lo) if lo else lane
        if b + 1 < bits: field = field % (1 << (b + 1 - lo))
        out = out + field * weights[lo]
        b += 1
    return out

def _coord(tc: TensorCore, which: str, lane: UOp, i: int) -> tuple[UOp, UOp]:
    rows, cols, elems = tc.layout["ABC".index(which)]
    return _lane_expr(rows, lane) + elems[i][0], _lane_expr(cols, lane) + elems[i][1]

def tc_candidates(k: Kernel, tcs: list[TensorCore]) -> list[tuple[TensorCore, UOp, UOp, UOp]]:
    """(tensor core, M loop, N loop, K loop) of each way kernel `k` can use one of `tcs`, the innermost loops first;
    empty where its reduction doesn't qualify (see the module docstring)."""
    # (from the AST as it is now: an opt before TC, a PADTO, made new nodes)
    reds = [u for u in k.ast.toposort() if u.op is Ops.REDUCE]
    if len(reds) != 1 or len(k.ast.src) != 1: return []
    red = reds[0]
    if red.arg is not Ops.ADD or red not in k.ast.src[0].src[1].toposort() or (mul := _product(red)) is None: return []
    outs, out = k.loops[:k.first_reduce], []
    for tc in tcs:
        if red.dtype != tc.dtype_out: continue
        for a, b in (mul.src, mul.src[::-1]):
            la, lb = _operand(a, tc), _operand(b, tc)
            if la is None or lb is None: continue
            ra = {u for u in la.toposort() if u.op is Ops.RANGE}
            rb = {u for u in lb.toposort() if u.op is Ops.RANGE}
            ms = [r for r in reversed(outs) if r in ra and r not in rb]
            ns = [r for r in reversed(outs) if r in rb and r not in ra]
            ks = [r for r in reversed(red.src[1:]) if r in ra and r in rb and r in k.loops]
            out += [(tc, m, n, kk) for kk in ks for n in ns for m in ms]
    return out

def tc_fits(cands: list[tuple[TensorCore, UOp, UOp, UOp]]) -> list[tuple[TensorCore, UOp, UOp, UOp]]:
    """The candidates whose M, N and K loops are multiples of the instruction's tile."""
    return [c for c in cands
            if all(isinstance(n := range_size(r), int) and n % d == 0 for r, d in zip(c[1:], c[0].dims))]

def apply_tc(k: Kernel, axis: int, arg) -> None:
    """The TC opt on kernel `k` (see the module docstring): `arg` is (tc_select, tc_opt, use_tc) as tinygrad's:
    tc_select -1 for the first of the renderer's tensor cores that fits, else an index into them; `axis` picks among
    the ways the kernel can use it (`tc_candidates`, innermost loops first); tc_opt 0 or 1: among those whose loops
    the instruction's tile divides (others are refused: PADTO them first), 2: among all, the loops the tile doesn't
    divide padded to it (PADTO: padded rows and columns read nothing, a padded K contributes zeros); use_tc 1 (the
    WMMA instruction)."""
    if not (isinstance(arg, tuple) and len(arg) == 3 and all(isinstance(x, int) for x in arg)):
        raise KernelOptError(f"TC takes (tc_select, tc_opt, use_tc), got {arg!r}")
    tc_select, tc_opt, use_tc = arg
    if use_tc != 1 or tc_opt not in (0, 1, 2):
        raise KernelOptError(f"TC supports tc_opt 0 to 2 and use_tc 1, got {arg!r}")
    if not k.gpu: raise KernelOptError("TC needs a GPU-style renderer")
    if k.tc is not None or any(o.op is not OptOps.PADTO for o in k.applied_opts):
        raise KernelOptError("TC comes first (after PADTO only)")
    tcs = list(getattr(k.renderer, "tensor_cores", []))
    if tc_select != -1:
        if not 0 <= tc_select < len(tcs): raise KernelOptError(f"no tensor core {tc_select} of {len(tcs)}")
        tcs = [tcs[tc_select]]
    cands = tc_candidates(k, tcs)
    ways = tc_fits(cands) if tc_opt < 2 else [c for c in cands if all(isinstance(range_size(r), int) for r in c[1:])]
    if not ways:
        why = "no matmul-shaped reduction of its dtypes" if not cands else f"sizes (M, N, K) " \
            f"{[tuple(range_size(r) for r in c[1:]) for c in cands]} aren't multiples of the tile {cands[0][0].dims}"
        raise KernelOptError(f"TC: {why}")
    if not 0 <= axis < len(ways): raise KernelOptError(f"TC axis {axis}: {len(ways)} ways to use a tensor core")
    tc, rm, rn, rk = ways[axis]
    if tc_opt >= 2:
        ids = [r.arg[0] for r in (rm, rn, rk)]
        for r, d in zip((rm, rn, rk), tc.dims):
            if range_size(r) % d: k._padto(k.loops.index(next(x for x in k.loops if x.arg[0] == r.arg[0])), d)
        by_id = {r.arg[0]: r for r in k.loops}
        rm, rn, rk = (by_id[i] for i in ids)
    red, st = next(u for u in k.ast.toposort() if u.op is Ops.REDUCE), k.ast.src[0]
    trips = 1
    for r in red.src[1:]:
        trips *= range_size(r) // (tc.dims[2] if r is rk else 1) if isinstance(range_size(r), int) else 1 << 30
    if trips > SUM_BLOCKED_OVER: raise KernelOptError("TC of a sum long enough to be summed in blocks")
    mul = _product(red)
    assert mul is not None
    la, lb = next((_operand(a, tc), _operand(b, tc)) for a, b in (mul.src, mul.src[::-1])
                  if _operand(a, tc) is not None and _operand(b, tc) is not None and rm in a.toposort())
    lane = UOp.range(tc.threads, k.next_id, "local")
    k.next_id += 1
    # each tiled loop: its outer part (None when the tile is the whole loop) and the index of the tile's first row
    base: dict[UOp, UOp] = {}
    outer: dict[UOp, UOp | None] = {}
    for r, d in zip((rm, rn, rk), tc.dims):
        n = range_size(r)
        assert isinstance(n, int)
        outer[r] = UOp.range(n // d, r.arg[0], r.arg[1]) if n > d else None
        base[r] = outer[r] * d if outer[r] is not None else UOp.const(dtypes.index, 0)
    def frag(ld: UOp, which: str, rr: UOp, rc: UOp) -> UOp:
        elems = []
        for i in range(tc.elements(which)):
            row, col = _coord(tc, which, lane, i)
            elems.append(ld.substitute({rr: base[rr] + row, rc: base[rc] + col}))
        return UOp(Ops.VECTORIZE, tc.dtype_in.vec(len(elems)), tuple(elems))
    nc = tc.elements("C")
    acc_dt = tc.dtype_out.vec(nc)
    zero = UOp(Ops.VECTORIZE, acc_dt, (UOp.const(tc.dtype_out, 0),) * nc)
    wmma = UOp(Ops.WMMA, acc_dt, (frag(la, "A", rm, rk), frag(lb, "B", rk, rn), zero), tc.wmma_arg)
    rngs = [outer[rk] if r is rk else r for r in red.src[1:] if r is not rk or outer[rk] is not None]
    acc = UOp(Ops.REDUCE, acc_dt, (wmma, *rngs), Ops.ADD)
    stores = []
    for e in range(nc):
        row, col = _coord(tc, "C", lane, e)
        stores.append(st.substitute({red: UOp(Ops.GEP, tc.dtype_out, (acc,), e), rm: base[rm] + row,
                                     rn: base[rn] + col}))
    k.ast = UOp.sink_of(*stores)
    for r in (rm, rn, rk):
        if outer[r] is None: k.loops.remove(r)
        else: k.loops[k.loops.index(r)] = outer[r]
    k.locals.append(lane)
    # (launch dimension 0, whatever other work-items there are: lanes are numbered by the thread id in the block)
    k.local_keys[lane] = (2, 0, 0)
    k.reduceops = [acc]
    k.tc = (tc, tuple(r.arg[0] for r in (rm, rn, rk)))
    # the operands as functions of their (row, col), for a copy to local memory (LTILE of the K loop): stand-ins for
    # the M, N and K loops, which the AST no longer has
    held = {r: UOp.range(range_size(r), k.next_id + i, "loop") for i, r in enumerate((rm, rn, rk))}
    k.next_id += 3
    k.tc_frame = UOp.sink_of(la.substitute(held), lb.substitute(held), base[rm], base[rn], base[rk], lane,
                             *held.values())
    if SPEC: verify(k.ast, tensor_core_spec + kernel_spec, "kernel AST after TC")

def tc_loops(k: Kernel) -> tuple[UOp | None, UOp | None, UOp | None]:
    """The loops over the tiles along M, N and K of a kernel that TC laid out (None where the tile is the whole loop,
    or that loop was split off entirely since)."""
    assert k.tc is not None, "the kernel has no TC"
    by_id = {r.arg[0]: r for r in k.loops}
    m, n, kk = (by_id.get(i) for i in k.tc[1])
    return m, n, kk

# *** the operands staged through local memory (LTILE after TC) ***

# each row of a staged operand that is a multiple of 32 bytes long is padded by this many bytes: the rows of a warp's
# fragment then start in different banks of local memory (a row of 32 halves is 16 of the 32 banks: rows 0 and 2 of a
# fragment would meet)
ROW_PAD_BYTES = 16
# bytes of an operand each work-item copies from global memory in one load where the operand is read contiguously
# along the copy's innermost dimension (16: a 128-bit load of 8 halves or 4 floats; 0: element by element, in pairs
# along K where the fragments read pairs)
VECTOR_COPY_BYTES = 16
# 1: where every operand is copied 16 bytes a load (VECTOR_COPY_BYTES), two local buffers take turns, the next block
# copied while the fragments of this one are read (one barrier per block; on CUDA the copies are asynchronous); 0: one
# buffer, copied and read between two barriers. (4096^3 half on an H200: 145 TFLOP/s copied in pairs, 162 in 16-byte
# loads, 166 double-buffered, 196 double-buffered with blocks of 64; copied in pairs, double buffering took 145 -> 122)
DOUBLE_BUFFER = 1

def _vector_width(y: UOp, dims: list[tuple[UOp, int, UOp, UOp]], along: UOp | None = None) -> int:
    """Elements of operand `y` one load copies (VECTOR_COPY_BYTES), or 1: `y` a plain load of a global buffer (no
    gate, no conversion) contiguous along the copy's innermost dimension (loop `along` where given), whose size the
    width divides. The address need not be aligned: the renderer checks it (CUDA falls back to one load per
    element)."""
    width = VECTOR_COPY_BYTES // y.dtype.itemsize
    if width < 2 or y.op is not Ops.LOAD or len(y.src) != 1 or (idx := y.src[0]).op is not Ops.INDEX or \
            len(idx.src) != 2 or idx.src[0].op is not Ops.DEFINE_GLOBAL or \
            along is not None and dims[-1][0] is not along: return 1
    return width if coeff(idx.src[1], dims[-1][0]) == 1 and dims[-1][1] % width == 0 else 1

def _widths(staged: list, frame: UOp) -> list[int]:
    """The elements one load copies of each staged operand (A, B), where both can be copied in vectors (else 1 for
    both: the copies as measured before, pairs along K): A only along K, where its fragments' pairs stay neighbours
    in local memory (copied along M, each lane reads its 8 elements one by one), B along K or N (4 elements a
    fragment). (ResNet's 1x1 convolutions, their images read along the pixels through a padding's gates, ran at
    8.7-9.8 TFLOP/s on an H200 with A copied along M or B alone in vectors; their kernels are again those measured
    at 9.8-10.2x torch's time before 16-byte copies.)"""
    widths = [_vector_width(y, dims, frame.src[8] if i == 0 else None) for i, (y, dims, _) in enumerate(staged)]
    return widths if all(w > 1 for w in widths) else [1] * len(widths)

def staged_operands(frame: UOp, tc: TensorCore, fixed: set[UOp]) -> list[tuple[UOp, list[tuple[UOp, int, UOp, UOp]],
                                                                                list[int]]]:
    """The blocks of A and B that the work-items of a group read in one iteration of the `fixed` loops (the output
    loops and LTILE's block loop), from `Kernel.tc_frame` (see `apply_tc`): for each, its value at the stand-in
    loops, its dimensions in the order of the copy (outer to inner), each (stand-in loop or other range the value
    varies with, size, the block's first index, the index a work-item reads without its lane's part), and their
    order in local memory (indices into the dimensions, outer to inner).
    KernelOptError where the tiles a group reads along M, N or K aren't one block (SWAP or splits in another order
    can leave gaps)."""
    ya, yb, bm, bn, bk, _, pm, pn, pk = frame.src
    dm, dn, dk = tc.dims
    out = []
    for y, coords in ((ya, ((pm, bm, dm), (pk, bk, dk))), (yb, ((pk, bk, dk), (pn, bn, dn)))):
        dims: list[tuple[UOp, int, UOp, UOp]] = []
        for held, b, d in coords:
            free = [r for r in b.toposort() if r.op is Ops.RANGE and r not in fixed]
            cs = {r: coeff(b, r) for r in free}
            free.sort(key=lambda r: cs[r] or 0)
            size, offset = d, UOp.const(dtypes.index, 0)
            for r in free:
                # (the tile's d rows, then each loop's iterations d * (the ones inside it) apart: one block)
                if cs[r] != size or not isinstance(n := range_size(r), int):
                    raise KernelOptError("LTILE after TC: the tiles a group reads aren't one block")
                size, offset = size * n, offset + r * cs[r]
            dims.append((held, size, b.substitute({r: UOp.const(dtypes.index, 0) for r in free}), offset))
        extra = sorted((r for r in y.toposort() if r.op is Ops.RANGE and r not in fixed and r not in (pm, pn, pk)),
                       key=lambda r: r.arg[0])
        if not all(isinstance(range_size(r), int) for r in extra):
            raise KernelOptError("LTILE after TC: an operand varies with a symbolic loop")
        dims += [(r, range_size(r), UOp.const(dtypes.index, 0), r) for r in extra]
        # the copy's innermost dimension is the one the operand reads contiguously (coalesced)
        addr = next((u.src[1] for u in y.toposort() if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL), None)
        def stride(dim: tuple) -> int:
            c = coeff(addr, dim[0]) if addr is not None else None
            return abs(c) if c else 1 << 62
        dims.sort(key=stride, reverse=True)
        # in local memory the copy's innermost dimension stays innermost where it is copied in vectors; else K goes
        # innermost where a lane's elements are pairs along K (each pair one load)
        kdim = next(i for i, d in enumerate(dims) if d[0] is pk)
        out.append((y, dims, kdim))
    # (K innermost where a lane's elements are pairs along K and the operands aren't copied in vectors)
    widths = _widths(out, frame)
    return [(y, dims, [i for i in range(len(dims)) if not paired or i != kdim] + ([kdim] if paired else []))
            for (y, dims, kdim), which, w in zip(out, "AB", widths) for paired in [_paired(tc, which) and w == 1]]

def _paired(tc: TensorCore, which: str) -> bool:
    """Whether each lane's elements of operand `which` (16-bit) are pairs of neighbours along K, each pair at an even
    K for every lane: elements 2i and 2i + 1 at the same row and the next col of A (the next row of B)."""
    rows, cols, elems = tc.layout["ABC".index(which)]
    kc = 1 if which == "A" else 0   # (K is A's col and B's row)
    return tc.dtype_in.itemsize == 2 and len(elems) % 2 == 0 and all(w % 2 == 0 for w in (cols if kc else rows)) and \
        all(elems[i + 1][kc] == elems[i][kc] + 1 and elems[i + 1][1 - kc] == elems[i][1 - kc] and elems[i][kc] % 2 == 0
            for i in range(0, len(elems), 2))

def _local_sizes(y: UOp, dims: list, layout: list[int]) -> list[int]:
    """The sizes of a staged operand's dimensions in local memory, outer to inner, the innermost padded where it is a
    multiple of 32 bytes (ROW_PAD_BYTES)."""
    sizes = [dims[i][1] for i in layout]
    if len(sizes) > 1 and sizes[-1] * y.dtype.itemsize % 32 == 0: sizes[-1] += ROW_PAD_BYTES // y.dtype.itemsize
    return sizes

def _regions(staged: list, itemsize: int) -> list[int]:
    """Where each staged operand starts in the one local buffer they share, and (last) its size, in elements: each
    region aligned to 16 bytes."""
    align, starts = 16 // itemsize, [0]
    for y, dims, layout in staged:
        starts.append(starts[-1] + -(-math.prod(_local_sizes(y, dims, layout)) // align) * align)
    return starts

def _double_buffered(staged: list, frame: UOp) -> bool:
    """Whether staged operands take two buffers in turn (DOUBLE_BUFFER, where every copy is of 16-byte vectors)."""
    return bool(DOUBLE_BUFFER) and all(w > 1 for w in _widths(staged, frame))

def staged_bytes(frame: UOp | None, tc: TensorCore, fixed: set[UOp]) -> int:
    """Bytes of local memory the staged operands take (see `staged_operands`)."""
    if frame is None: raise KernelOptError("LTILE after TC and PADTO")
    staged = staged_operands(frame, tc, fixed)
    return _regions(staged, tc.dtype_in.itemsize)[-1] * tc.dtype_in.itemsize * \
        (2 if _double_buffered(staged, frame) else 1)

def vector_copies(k: Kernel) -> bool:
    """Whether the staged operands of tensor-core kernel `k` (after LTILE) are all copied 16 bytes a load."""
    assert k.tc is not None and k.tc_frame is not None, "no staged tensor-core operands"
    fixed = set(k.loops[:k.first_reduce]) | set(k.tiles)
    return all(w > 1 for w in _widths(staged_operands(k.tc_frame, k.tc[0], fixed), k.tc_frame))

def check_tc_ltile(k: Kernel, r: UOp) -> None:
    """KernelOptError unless LTILE of loop `r` can stage kernel k's tensor core operands: r is TC's K loop, the first
    LTILE, and no output loop was padded since TC."""
    if k.tc_frame is None or k.tiles or r is not tc_loops(k)[2]:
        raise KernelOptError("LTILE after TC stages its K loop (once, and not after a PADTO)")

def stage_operands(ast: UOp, frame: UOp, tc: TensorCore, tile: UOp, fixed: set[UOp], locals_: list[UOp],
                   next_id: int) -> UOp:
    """The WMMA's fragments read from copies of A's and B's blocks in local memory (`staged_operands`; `frame` and the
    ranges as the final AST numbers them): the W work-items of the group copy each block, element c by work-item
    c % W (in the copy's order, so neighbouring work-items read neighbouring elements; 16 bytes a load where the
    global buffer is read contiguously, else pairs of elements along K where the fragments are such pairs), rows
    padded by ROW_PAD_BYTES, both blocks in one local buffer, and each lane reads its fragments' elements from the
    copies. Single-buffered: in each iteration of block loop `tile`, a barrier, the copies, a second barrier, the
    fragments. With DOUBLE_BUFFER (where every copy is of 16-byte vectors) two such buffers take turns: block 0 is
    copied before the loop, and each iteration has one barrier (block i copied, block i-1 read by every work-item),
    then copies block i+1 into the other buffer (nothing waits for it before the next iteration's barrier: on CUDA
    an asynchronous copy, `cp.async`) before its fragments read block i, so the copies overlap the products."""
    workers, me = math.prod(range_size(r) for r in locals_), _linear(locals_)
    lane, held = frame.src[5], frame.src[6:9]
    staged = staged_operands(frame, tc, fixed)
    # (both copies in one buffer, between the same two barriers)
    starts = _regions(staged, tc.dtype_in.itemsize)
    size, double, widths = starts[-1], _double_buffered(staged, frame), _widths(staged, frame)
    local = UOp(Ops.DEFINE_LOCAL, tc.dtype_in.ptr(size * (2 if double else 1), "local"),
                arg=sum(1 for u in ast.toposort() if u.op is Ops.DEFINE_LOCAL))
    plans, places = [], []
    for which, (y, dims, layout), start, vector in zip("AB", staged, starts, widths):
        sizes, held_sizes = [s for _, s, _, _ in dims], _local_sizes(y, dims, layout)
        def at(coords: list[UOp], layout=layout, held_sizes=held_sizes, start=start) -> UOp:
            """The position in local memory of the element at `coords` (in the copy's order of the dimensions)."""
            lin = UOp.const(dtypes.index, 0)
            for i, n in zip(layout, held_sizes): lin = lin * n + coords[i]
            return lin + start if start else lin
        # (a pair of elements neighbouring along K, innermost, is one load or store of two where the rows' lengths
        # keep it aligned to its size)
        pairs = dims[layout[-1]][0] is held[2] and _paired(tc, which) and (len(layout) == 1 or held_sizes[-1] % 2 == 0)
        places.append((at, pairs))
        # (a vector of the global buffer's neighbours is one load, and one store to local memory where the rows'
        # lengths keep it aligned to its size: `_local_sizes` pads by 16 bytes)
        if len(layout) > 1 and held_sizes[-1] % vector: vector = 1
        plans.append((y, dims, layout, sizes, at, vector, vector if vector > 1 else 2 if pairs else 1))

    def copy(buf: UOp, block: UOp, offset: UOp | None, gate: UOp | None) -> list[UOp]:
        """The stores of the copies of block `block` (a value of the block loop) into `buf` from `offset` on, each
        gated by `gate`; each copy's loop a fresh one."""
        nonlocal next_id
        out = []
        for y, dims, layout, sizes, at, vector, width in plans:
            # the copy's element c: work-item c % W copies (the pair or vector of) element c in the copy's order
            copied_sizes = [s // width if i == layout[-1] else s for i, s in enumerate(sizes)]
            count = math.prod(sizes) // width
            rounds = -(-count // workers)
            j = UOp.range(rounds, next_id, "copy") if rounds > 1 else UOp.const(dtypes.index, 0)
            next_id += 1
            c = j * workers + me
            pos, step = [], 1
            for i, s in reversed(list(enumerate(copied_sizes))):
                p = (c // step) % s if step > 1 else c % s
                pos.insert(0, p * width if i == layout[-1] else p)
                step *= s
            valid = c < count if count % workers else None
            if gate is not None: valid = gate if valid is None else valid & gate
            values = []
            for e in range(1 if vector > 1 else width):
                value = y.substitute({key: origin + p + (e if i == layout[-1] else 0)
                                      for i, ((key, _, origin, _), p) in enumerate(zip(dims, pos))})
                if block is not tile: value = value.substitute({tile: block})
                if valid is not None:
                    value = value.substitute({u: u.replace(src=(*u.src[:2], valid if len(u.src) < 3 else
                                                                 u.src[2] & valid))
                                              for u in value.toposort() if u.op is Ops.INDEX})
                values.append(value)
            if vector > 1:
                # (the load of the first element, widened: `_vector_width` took a plain load)
                idx = values[0].src[0]
                wide = UOp(Ops.LOAD, y.dtype.vec(width), (UOp(Ops.INDEX, idx.dtype.vec(width), idx.src),))
            else: wide = UOp(Ops.VECTORIZE, y.dtype.vec(width), tuple(values)) if width > 1 else values[0]
            place = at(pos) if offset is None else at(pos) + offset
            dest = UOp(Ops.INDEX, buf.dtype.vec(width) if width > 1 else buf.dtype,
                       (buf, place) + ((valid,) if valid is not None else ()))
            copied = dest.store(wide)
            out.append(UOp(Ops.END, dtypes.void, (copied, j)) if rounds > 1 else copied)
        return out

    if not double:
        before = UOp(Ops.BARRIER, local.dtype, (local, tile))
        ready, read_at = UOp(Ops.BARRIER, local.dtype, (local, *copy(before, tile, None, None))), None
    else:
        n = range_size(tile)
        top = UOp(Ops.BARRIER, local.dtype, (local, tile, *copy(local, UOp.const(dtypes.index, 0), None, None)))
        ahead = copy(top, tile + 1, ((tile + 1) % 2) * size, tile + 1 < n)
        # (the fragments' loads after the copies of the next block, with no barrier between: ORDER_ONLY)
        ready, read_at = UOp(Ops.BARRIER, local.dtype, (top, *ahead), ORDER_ONLY), (tile % 2) * size
    frags = []
    for which, (y, dims, layout), (at, pairs) in zip("AB", staged, places):
        rows, cols = (held[0], held[2]) if which == "A" else (held[2], held[1])
        elems: list[UOp] = []
        for i in range(tc.elements(which)):
            if pairs and i % 2: continue
            row, col = _coord(tc, which, lane, i)
            coords = [offset + row if key is rows else offset + col if key is cols else offset
                      for key, _, _, offset in dims]
            place = at(coords) if read_at is None else at(coords) + read_at
            if not pairs:
                elems.append(UOp(Ops.LOAD, y.dtype, (ready.index(place),)))
                continue
            two = UOp(Ops.LOAD, y.dtype.vec(2), (UOp(Ops.INDEX, ready.dtype.vec(2), (ready, place)),))
            elems += [UOp(Ops.GEP, y.dtype, (two,), 0), UOp(Ops.GEP, y.dtype, (two,), 1)]
        frags.append(UOp(Ops.VECTORIZE, y.dtype.vec(len(elems)), tuple(elems)))
    wmma = next(u for u in ast.toposort() if u.op is Ops.WMMA)
    return ast.substitute({wmma: wmma.replace(src=(frags[0], frags[1], wmma.src[2]))})

# *** after lowering ***

def _fuse_add(x: UOp, w: UOp) -> UOp | None:
    c = w.src[2]
    if c.op is Ops.VECTORIZE and all(s.op is Ops.CONST and s.arg == 0 for s in c.src) or \
            c.op is Ops.CONST and c.arg == 0:
        return w.replace(src=(w.src[0], w.src[1], x))
    return None

pm_fuse_wmma = PatternMatcher([
    (UPat(Ops.ADD, src=(UPat.var("x"), UPat(Ops.WMMA, name="w"))), _fuse_add),
    (UPat(Ops.ADD, src=(UPat(Ops.WMMA, name="w"), UPat.var("x"))), _fuse_add),
    # (an accumulator's reset: a vector constant as the lanes renderers can write)
    (UPat(Ops.CONST, name="c"), lambda c: UOp(Ops.VECTORIZE, c.dtype, (UOp.const(c.dtype.scalar(), c.arg),) *
                                             c.dtype.count) if c.dtype.count > 1 else None),
], name="fuse_wmma")
pm_fuse_wmma.__doc__ = "a tensor core's sum accumulates in the instruction: ADD(acc, WMMA(a, b, 0)) -> WMMA(a, b, acc)"

def fuse_wmma(sink: UOp) -> UOp:
    """A lowered kernel with its tensor core sums accumulated by the WMMAs themselves (no-op without WMMA)."""
    if not any(u.op is Ops.WMMA for u in sink.toposort()): return sink
    return graph_rewrite(sink, pm_fuse_wmma, name="fuse_wmma")
