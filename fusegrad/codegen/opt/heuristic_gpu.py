"""Hand-coded optimizations for GPU-style kernels: a long reduction to few outputs split across the work-items of a
group, register tiles where loads are reused along an output loop (a matmul's rows and columns), work-items along the
output loops, innermost first (neighbouring work-items then touch neighbouring memory), the reduction staged through
local memory where that is fast, and its inner loop unrolled. A matmul-shaped sum that one of the renderer's tensor
cores fits is laid out for it instead (TC), with a few of its tiles per warp and a few warps per group."""
from __future__ import annotations
import math
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.codegen.opt.tc import tc_candidates, tc_fits, tc_loops, vector_copies
from fusegrad.helpers import pads_cheaply
from fusegrad.uop.affine import coeff, range_size
from fusegrad.uop.ops import UOp

WORKGROUP = 256     # work-items per group aimed at (within the renderer's limit)
GROUP_MAX = 256     # the most work-items one reduction is split across
FEW_OUTPUTS = 4096  # a reduction to fewer outputs than this leaves work-items idle unless it is split across a group
ROW_MIN = 128       # a reduction along rows this long is split across a group however many rows there are
ITEMS_ROW = 64      # elements each work-item of a grouped reduction reduces at least (where G * G <= n gives fewer)
HANDFUL = 64        # a reduction to at most this many outputs has nothing else to run in parallel
ITEMS_FEW = 4       # so its work-items reduce this few elements each (a wide group: one row's latency)
VECTOR = 4          # lanes of an elementwise kernel's vectors (float4)
ITEMS = 4           # elements an elementwise kernel without vectors computes per work-item, along an outer loop
ITEMS_MIN_OUTPUTS = 1 << 20   # ... where it has at least this many (a smaller one keeps one per work-item)
TILE = 8            # register tile along each output loop that loads are reused along (a 4096 float32 matmul on an
                    # H200: 17 TFLOP/s with tiles of 4, 26 with 8)
TILE_SMALL = 4      # the tile along a loop shorter than 4 * TILE
TILE_INNER = 4      # of a register tile, the outputs next to each other (the rest are TILE_LOCALS work-items apart):
                    # a work-item reads them from a staged block as one 16-byte vector, and a warp's reads are
                    # contiguous (no two lanes in one bank); 0: the whole tile (a 4096 float32 matmul on an H200:
                    # 38.7 TFLOP/s with 4, 34.6 with the whole tile)
TILE_LOCALS = 16    # work-items along each output loop of a register-tiled kernel
UNROLL_BY = 4       # unroll of a register-tiled kernel's innermost reduce loop (a 4096 float32 matmul on an H200:
                    # 38.7 TFLOP/s with 4, 30.1 with 8, whose 164 registers leave one group per multiprocessor)
LTILE_BLOCK = 32    # iterations of a register-tiled kernel's reduction staged in local memory at a time
TC_TILES = (4, 8)   # tensor core tiles per warp along M and N (their fragments of A and B are reused from registers)
TC_WARPS = (2, 2)   # warps per group along M and N (4096^3 half on an H200, staged: 151 TFLOP/s, 135 with (4, 2))
TC_UNROLL = 1       # WMMAs chained along K per iteration of a tensor-core kernel's K loop
TC_MIN_WARPS = 512  # warps a tensor-core kernel keeps for its tiles (about 4 per multiprocessor of an H100/H200)
TC_MIN_GROUPS = 128  # groups it keeps for its warps (about one per multiprocessor)
TC_STAGE = 1        # 1: a tensor-core kernel's operands staged through local memory (LTILE of its K loop), 0: each
                    # lane reads its fragments from global memory
TC_BLOCK_K = 128    # bytes of K staged at a time in each row (64 halves, 32 floats; fewer where K or local memory
                    # doesn't fit them): 4096^3 half on an H200, double-buffered: 166 TFLOP/s with 64 bytes, 196 with
                    # 128
TC_STATIC_LOCAL = 48 * 1024   # bytes of local memory at most for operands not all copied 16 bytes a load (a
                    # convolution's window, gated padding): a ResNet 3x3 convolution staged above it ran at 2.3-6.1
                    # TFLOP/s on an H200, 18.5 unstaged
TC_BLOCK_K_PAIRS = 64   # TC_BLOCK_K for such operands (their blocks as measured before 16-byte copies)

def _try(k: Kernel, op: OptOps, r: UOp, amt: int) -> bool:
    try: k.apply_opt(Opt(op, k.loops.index(r), amt))
    except KernelOptError: return False
    return True

def _padded(k: Kernel, r: UOp, amt: int) -> UOp | None:
    """Loop r padded to a multiple of amt (its new range), or None where it can't be."""
    i = k.loops.index(r)
    return k.loops[i] if _try(k, OptOps.PADTO, r, amt) else None

def _pow2_at_most(n: int) -> int: return 1 << (max(n, 1).bit_length() - 1)

def gpu_optimizations(k: Kernel) -> list[Opt]:
    """Choose and apply opts to the GPU-style kernel `k`; returns them (also in k.applied_opts)."""
    if _tensor_cores(k): return k.applied_opts
    _group_long_reduction(k)
    _vector_lanes(k)
    _items_per_work_item(k)
    tiled = _register_tiles(k)
    _work_items_over_outputs(k)
    _register_tiles_outside(k, tiled)
    _stage_through_local(k)
    _unroll_inner_reduction(k)
    return k.applied_opts

def _tensor_cores(k: Kernel) -> bool:
    """TC where one of the renderer's tensor cores fits the kernel's sum (its M, N and K loops multiples of the
    instruction's tile, or padded to them where that wastes at most an eighth of each), then TC_TILES tiles per warp
    (UPCAST) and TC_WARPS warps per group (LOCAL) where the loops divide, and the K loop unrolled by TC_UNROLL. A
    small product keeps TC_MIN_WARPS warps and TC_MIN_GROUPS groups (fewer tiles per warp, fewer warps per group, none
    where it has fewer: the tiles that suit 4096^3 left a 512^3 product 8 groups of 8 warps on a GPU of 132
    multiprocessors). Its operands are then staged in local memory (`_stage_tensor_core_operands`); where they are,
    the tiles leave room for the warps (`_tiles_and_warps`). Whether it applied."""
    if not (tcs := getattr(k.renderer, "tensor_cores", None)) or not k.reduceops: return False
    ways = [c for c in tc_candidates(k, tcs) if all(isinstance(range_size(r), int) for r in c[1:])]
    # the innermost loops the tile fits or pads cheaply: a convolution's row of 56 pixels padded to 64 rather than its
    # batch of 32 (a tile's rows are then neighbouring pixels, read together, not 32 images apart)
    way = next((c for c in ways if all(pads_cheaply(range_size(r), d) for r, d in zip(c[1:], c[0].dims))), None)
    if way is None: return False
    fits = tc_fits(ways)
    if not _try_opt(k, Opt(OptOps.TC, fits.index(way), (-1, 0, 1)) if way in fits else
                    Opt(OptOps.TC, ways.index(way), (-1, 2, 1))): return False
    # (staged operands are shared by the group's warps, so the tiles leave room for them; unstaged, the register tile
    # is all that reuses a fragment: the padded 3x3 convolution at 56x56 ran 0.147 ms with 4x8 tiles on one warp a
    # group, 0.229 with 2x4 tiles on 2x2 warps)
    state, applied = k._state(), list(k.applied_opts)
    _tiles_and_warps(k, room_for_warps=True)
    if _stage_tensor_core_operands(k): return True
    k._restore(state)
    k.applied_opts[:] = applied
    _tiles_and_warps(k, room_for_warps=False)
    _stage_tensor_core_operands(k)
    return True

def _tiles_and_warps(k: Kernel, room_for_warps: bool) -> None:
    """TC_TILES tiles per warp (UPCAST), TC_WARPS warps per group (LOCAL) and TC_UNROLL of K, each where the loop
    divides (the amount halved until it does, or until the kernel keeps TC_MIN_WARPS warps and TC_MIN_GROUPS groups).
    With `room_for_warps` a loop's tiles also leave it a multiple of its warps: ResNet-50's 1x1 convolution 256 -> 64
    at 56x56, whose 392 tiles of pixels took 8 a warp and left 49, had one warp a group (0.070 ms on an H200; 0.054
    with 4 tiles a warp and 2x2 warps)."""
    per_group = 1   # warps per group
    for op, which, n in ((OptOps.UPCAST, 1, TC_TILES[1]), (OptOps.UPCAST, 0, TC_TILES[0]),
                         (OptOps.LOCAL, 1, TC_WARPS[1]), (OptOps.LOCAL, 0, TC_WARPS[0]), (OptOps.UNROLL, 2, TC_UNROLL)):
        r = tc_loops(k)[which]
        if r is None or not isinstance(sz := range_size(r), int): continue
        if room_for_warps and op is OptOps.UPCAST:
            while n > 1 and sz % (n * TC_WARPS[which]): n //= 2
        elif sz % n: continue
        # (the groups are the output loops' iterations: UPCAST takes tiles from the warps, LOCAL gathers them in groups)
        groups = math.prod(s if isinstance(s, int) else 1 << 20 for s in map(range_size, k.loops[:k.first_reduce]))
        if op is OptOps.UPCAST: have, floor = groups * per_group, TC_MIN_WARPS
        else: have, floor = groups, (TC_MIN_GROUPS if op is OptOps.LOCAL else 0)
        while n > 1 and have // n < floor: n //= 2
        if n > 1 and _try(k, op, r, n) and op is OptOps.LOCAL: per_group *= n

def _stage_tensor_core_operands(k: Kernel) -> bool:
    """With TC_STAGE, a tensor-core kernel's K loop blocked by TC_BLOCK_K bytes of its input dtype (halved until the
    tiles of K divide it and the copies fit local memory; where they aren't all copied 16 bytes a load, at most
    TC_BLOCK_K_PAIRS bytes and TC_STATIC_LOCAL of local memory; at least two tiles of the instruction) and each block
    of A and B the group reads staged in local memory (LTILE): copied once per group with coalesced reads, and read
    by its warps from there (each lane's fragment elements are otherwise separate reads of global memory, and the
    group's warps read the same rows and columns again). Whether it staged them."""
    if not (TC_STAGE and k.renderer.fast_local_memory and k.tc is not None) or (r := tc_loops(k)[2]) is None:
        return False
    tc = k.tc[0]
    n, tiles = range_size(r), TC_BLOCK_K // tc.dtype_in.itemsize // tc.dims[2]
    if not isinstance(n, int): return False
    while tiles >= 2:
        if n % tiles == 0:
            state, applied = k._state(), list(k.applied_opts)
            if _try(k, OptOps.LTILE, r, tiles):
                if vector_copies(k) or k.local_memory() <= TC_STATIC_LOCAL and \
                        tiles * tc.dims[2] * tc.dtype_in.itemsize <= TC_BLOCK_K_PAIRS: return True
                k._restore(state)
                k.applied_opts[:] = applied
                r = tc_loops(k)[2]
                assert r is not None
        tiles //= 2
    return False

def _try_opt(k: Kernel, opt: Opt) -> bool:
    try: k.apply_opt(opt)
    except KernelOptError: return False
    return True

def _outputs(k: Kernel) -> int:
    """How many work-items the output loops can give (those a reduction is broadcast along stay loops)."""
    seq = k.sequential_outputs()
    sizes = [k.size(i) for i in k.output_axes() if k.loops[i] not in seq]
    return math.prod(s if isinstance(s, int) else 1 << 20 for s in sizes)

def _group_long_reduction(k: Kernel) -> None:
    """A reduction of a loop of n to few outputs, or along rows (`_along_rows`), is split across G work-items, G the
    largest power of two with G * G <= n (each work-item reduces about as many elements as the group then reduces from
    local memory) or G <= n / ITEMS_ROW where that is more (a group reads a row in wider strides: 8192 floats on an
    H200 2x faster with 256 work-items than with 64), or n / ITEMS_FEW for a handful of outputs."""
    if not k.reduceops: return
    r = next((k.loops[i] for i in reversed(k.reduce_axes()) if isinstance(k.size(i), int)), None)
    if r is None or (n := range_size(r)) < 16: return
    if (outputs := _outputs(k)) >= FEW_OUTPUTS and not (n >= ROW_MIN and _along_rows(k, r)): return
    # (a reduction to a handful of outputs is latency-bound: a wide group, each work-item reading a few elements)
    g = min(_pow2_at_most(max(math.isqrt(n), n // (ITEMS_FEW if outputs <= HANDFUL else ITEMS_ROW))), GROUP_MAX,
            _pow2_at_most(k.renderer.max_workgroup))
    if n % g:
        # (reduce loops of the same size are grouped together, so they are padded together)
        for x in [x for x in k.loops[k.first_reduce:] if x is not r and range_size(x) == n]: _padded(k, x, g)
        if (r := _padded(k, r, g)) is None: return
    _try(k, OptOps.GROUP, r, g)

def _along_rows(k: Kernel, r: UOp) -> bool:
    """Whether reduce loop r runs along rows in memory, each row reduced for one output: every load that varies with
    r reads it contiguously and varies with every output loop that work-items take or with none of them (a vector
    that every row is multiplied by, as a matrix-vector product's), and some load is rows (no load is shared between
    some outputs only, as a matmul's or a convolution's are). One work-item per row would read a row each, its
    neighbours rows apart (no access coalesced); a group per row reads each row's neighbouring elements together."""
    seq = k.sequential_outputs()
    outs = [k.loops[i] for i in k.output_axes() if k.loops[i] not in seq]
    along = [idx.src[1] for idx, is_store in k.accesses() if not is_store and coeff(idx.src[1], r) != 0]
    varies = [sum(coeff(x, o) != 0 for o in outs) for x in along]
    return any(v == len(outs) for v in varies) and all(coeff(x, r) == 1 and v in (0, len(outs))
                                                          for x, v in zip(along, varies))

def _vector_lanes(k: Kernel) -> None:
    """An elementwise kernel whose innermost output loop every access reads contiguously (or not at all) computes
    VECTOR lanes of it per work-item, where the renderer has vectors of its dtypes: one vector load per buffer."""
    if k.reduceops or not (vec_dts := tuple(getattr(k.renderer, "vector_dtypes", ()))) or not k.output_axes(): return
    r = k.loops[k.output_axes()[-1]]
    n = range_size(r)
    accesses = k.accesses()
    if not isinstance(n, int) or n % VECTOR or n < 2 * VECTOR or \
            any(idx.src[0].dtype.base not in vec_dts for idx, _ in accesses): return
    strides = [coeff(idx.src[1], r) for idx, _ in accesses]
    if all(c in (0, 1) for c in strides) and 1 in strides: _try(k, OptOps.UPCAST, r, VECTOR)

def _items_per_work_item(k: Kernel) -> None:
    """An elementwise kernel of many outputs without vectors (16-bit values on CUDA, an innermost loop of 7) computes
    ITEMS of them per work-item along its outermost loop that ITEMS divides (not the innermost, along which its
    neighbours' accesses are coalesced): independent loads in flight, and the index arithmetic shared."""
    if k.reduceops or k.expanded or not k.output_axes() or not isinstance(n := _outputs(k), int) or \
            n < ITEMS_MIN_OUTPUTS or ITEMS < 2:
        return
    for i in k.output_axes()[:-1]:
        if isinstance(size := range_size(k.loops[i]), int) and size % ITEMS == 0 and size > ITEMS:
            _try(k, OptOps.UPCAST, k.loops[i], ITEMS)
            return

def _register_tiles(k: Kernel) -> dict[int, int]:
    """TILE x TILE outputs per work-item along the output loops that some load doesn't vary with (that load's values
    are then reused from registers), TILE_SMALL along a loop shorter than 4 * TILE, for kernels with a reduction (a
    matmul, a convolution); a loop the tile doesn't divide is padded where that wastes at most an eighth. TILE_INNER
    neighbouring outputs of each tile are upcast here; what of the tile remains (loop id: amount) is returned, for
    `_register_tiles_outside` to upcast outside the work-items."""
    if not k.reduceops or k.groups: return {}
    loads = [idx.src[1] for idx, is_store in k.accesses() if not is_store]
    rest: dict[int, int] = {}
    for i in reversed(k.output_axes()):
        r = k.loops[i]
        n = range_size(r)
        if len(rest) == 2 or not isinstance(n, int) or n < 4 * TILE_SMALL or not any(coeff(x, r) == 0 for x in loads):
            continue
        tile = TILE if n >= 4 * TILE else TILE_SMALL
        # (a loop of 1023 is padded to 1024 for its tiles)
        if n % tile and (not pads_cheaply(n, tile) or (r := _padded(k, r, tile)) is None): continue
        inner = math.gcd(tile, TILE_INNER) if TILE_INNER else tile
        # (the loop that remains keeps the range's id through the splits)
        if _try(k, OptOps.UPCAST, r, inner): rest[r.arg[0]] = tile // inner
    return rest

def _register_tiles_outside(k: Kernel, rest: dict[int, int]) -> None:
    """The rest of each register tile (`_register_tiles`) upcast outside the work-items along its loop (by the range's
    id): a work-item's outputs TILE_INNER at a time, TILE_LOCALS * TILE_INNER apart."""
    for r in [r for r in k.loops if rest.get(r.arg[0], 1) > 1]: _try(k, OptOps.UPCAST, r, rest[r.arg[0]])

def _work_items_over_outputs(k: Kernel) -> None:
    """Work-items along the output loops, innermost first, up to WORKGROUP per group; a loop that no power of two
    divides well is padded to one (wasting at most an eighth)."""
    budget = min(WORKGROUP, _pow2_at_most(k.renderer.max_workgroup)) // math.prod(range_size(r) for r in k.locals)
    # (a register-tiled kernel gets a square of work-items: each reuses loads along both loops)
    per_loop = TILE_LOCALS if k.expanded and k.reduceops else budget
    seq = k.sequential_outputs()
    for r in [k.loops[i] for i in reversed(k.output_axes()) if k.loops[i] not in seq]:
        if budget < 2: break
        n = range_size(r)
        if not isinstance(n, int) or n < 2: continue
        amt = math.gcd(n, min(budget, per_loop))
        want = min(budget, per_loop, _pow2_at_most(n))
        while want > max(amt, 8) and not pads_cheaply(n, want): want //= 2
        if amt < want and (padded := _padded(k, r, want)) is not None: r, amt = padded, want
        if amt >= 2 and _try(k, OptOps.LOCAL, r, amt): budget //= amt

def _stage_through_local(k: Kernel) -> None:
    """A register-tiled kernel with work-items reduces its outermost reduce loop in blocks of LTILE_BLOCK (half that
    for a loop shorter than twice the block) staged in local memory (a loop that the block doesn't divide is padded
    when that wastes at most an eighth), where local memory is faster than global memory: on a CPU's OpenCL the
    barriers cost more than the copies save (a 1024 matmul on PoCL took 2.5x longer)."""
    if not (k.expanded and k.locals and k.reduce_axes() and k.renderer.fast_local_memory): return
    r = k.loops[k.reduce_axes()[0]]
    n = range_size(r)
    if not isinstance(n, int) or not (sizes := [b for b in (LTILE_BLOCK, LTILE_BLOCK // 2) if n >= 2 * b]): return
    block = next((b for b in sizes if n % b == 0), sizes[0])
    if n % block:
        if not pads_cheaply(n, block) or (r := _padded(k, r, block)) is None: return
    _try(k, OptOps.LTILE, r, block)

def _unroll_inner_reduction(k: Kernel) -> None:
    """A register-tiled kernel's innermost reduce loop unrolled by UNROLL_BY (its loads and products then schedule
    together; the sum's order is unchanged)."""
    if not (k.expanded and k.reduce_axes()): return
    r = k.loops[k.reduce_axes()[-1]]
    n = range_size(r)
    if isinstance(n, int) and n % UNROLL_BY == 0 and n >= 2 * UNROLL_BY: _try(k, OptOps.UNROLL, r, UNROLL_BY)
