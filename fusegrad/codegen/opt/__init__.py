"""Kernel optimization: a `Kernel` holds a kernel AST and its loops, `apply_opt` splits and reorders them.

An optimization never changes what a kernel computes, only how its loops are shaped:
  UPCAST(axis, amt)  split `amt` off the inside of a loop and expand it in registers. On an output loop the lanes
                     become separate values (vectorized along a contiguous axis); on a reduce loop they become
                     separate partial accumulators, combined after the loop.
  UNROLL(axis, amt)  split `amt` off the inside of a reduce loop and unroll it, accumulating the lanes one after
                     the other into the same accumulator (the summation order is unchanged).
  SWAP(axis, other)  exchange the nesting order of two output loops.
  SPLIT(axis, amt)   split an output loop into an outer loop of `amt` iterations around an inner loop of the rest.
  PACK(axis, buf)    copy what the kernel loads from global buffer `buf` inside output loop `axis` into a local
                     (stack) buffer at the start of that loop's body, and load from the copy: a block of a matrix
                     read with a large stride becomes contiguous and stays in L1 while loops inside reuse it. A load
                     that varies with output loops inside `axis` is copied for all their iterations: a tile (a
                     transposing copy reads its tile contiguously, then writes the output from L1).
  PADTO(axis, amt)   round output loop `axis` up to a multiple of `amt`: the extra iterations compute garbage that
                     is never stored (every memory access that varies with the loop is gated by `index < size`), so
                     the loop can be vectorized and tiled whatever its size (1023 columns become 64 vectors of 16).
  KBLOCK(axis, amt)  block a reduce loop through the output buffer: the loop runs `amt` at a time in registers and
                     an outer loop over the blocks (placed right inside the outermost output loop) adds each block's
                     result to the output, so the data one block reads stays in cache while all output tiles use it.
                     Only for a single STORE of a value holding one REDUCE (whose dtype is the output's) and no other
                     reduction, to a buffer not read otherwise; what the value computes from the REDUCE (an
                     epilogue: bias, batch norm, relu) is applied by the last block.
For a GPU-style renderer (`has_local`: kernels launched over a grid of work-groups, see docs/architecture.md):
  LOCAL(axis, amt)   split `amt` off the inside of output loop `axis` as work-items of a group: `amt` neighbouring
                     outputs are computed by neighbouring work-items (coalesced memory accesses).
  GROUP(axis, amt)   split `amt` off the inside of reduce loop `axis` as work-items of a group: each work-item reduces
                     every amt-th element (coalesced), writes its partial result to local memory, and after a barrier
                     the partial results are reduced; one work-item stores the result.
  GROUPTOP(axis, amt) the same with the work-items taking contiguous chunks of the loop (the split from the outside).
  LTILE(axis, amt)   split `amt` off the inside of reduce loop `axis` (a reduction's outermost loop: a matmul's, a
                     convolution's input channels) and, for each block of `amt` iterations, stage what the group's
                     work-items load along the block in local memory: the work-items copy the block of each load
                     that some of them share (a matmul's rows of A for all its columns), each a part, between two
                     barriers, and then read the copy.
  PADTO on a reduce loop rounds it up with iterations that read nothing and contribute the reduction's identity, so
                     a GROUP of 256 fits a row of 257 (on a CPU: vectors or KBLOCK blocks fit a vocabulary of 50257).
  TC(axis, (tc_select, tc_opt, use_tc)) a matmul-shaped sum (of products of two loads of half, bfloat16, or float32
                     with ALLOW_TF32) on the renderer's tensor cores (`Renderer.tensor_cores`): its M, N and K loops
                     split into the instruction's tile, the tile's rows and columns spread over the lanes of a warp (a
                     "local" range, launch dimension 0) and the elements of their fragments, the sum a WMMA per tile
                     (see tc.py). First of the opts (after PADTO only); `axis` picks one of the ways to use it;
                     tc_opt 2 pads the loops the tile doesn't divide; use_tc is 1.
                     After it: LOCAL, UPCAST and PADTO of output loops, UNROLL of reduce loops, SWAP, and LTILE of
                     its K loop: the blocks of A and B the group's warps read (before the lanes split them into
                     fragments) staged in local memory, each copied whole with coalesced reads (tc.py).
  (PACK, KBLOCK and SPLIT are CPU loop shapes: a GPU-style kernel refuses them.)
`axis` indexes `Kernel.loops`: the output loops (outer to inner), then the reduce loops. `amt` 0 means the whole loop.

Range kinds after `get_optimized_ast`: "global" (the outermost output loop, split across cores; in a GPU-style kernel
every output loop, one launch dimension each), "local" (work-items of a group, GPU-style only), "loop", "reduce",
"upcast", "unroll"."""
from __future__ import annotations
import functools
import math
from dataclasses import dataclass
from enum import Enum, auto
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import coeff, live_ranges, range_kind, range_size
from fusegrad.uop.ops import Ops, UOp

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _BARRIER, _CAST, _DEFINE_GLOBAL = Ops.ADD, Ops.BARRIER, Ops.CAST, Ops.DEFINE_GLOBAL
_DEFINE_LOCAL, _END, _INDEX, _LOAD, _MAX, _MUL = Ops.DEFINE_LOCAL, Ops.END, Ops.INDEX, Ops.LOAD, Ops.MAX, Ops.MUL
_RANGE, _REDUCE, _SINK, _STORE = Ops.RANGE, Ops.REDUCE, Ops.SINK, Ops.STORE

class OptOps(Enum):
    UPCAST = auto(); UNROLL = auto(); SWAP = auto(); KBLOCK = auto(); SPLIT = auto(); PACK = auto(); PADTO = auto()
    LOCAL = auto(); GROUP = auto(); GROUPTOP = auto(); LTILE = auto(); TC = auto()
    def __repr__(self) -> str: return f"OptOps.{self.name}"

@dataclass(frozen=True)
class Opt:
    """One optimization step; see the module docstring."""
    op: OptOps
    axis: int
    arg: int | tuple[int, ...]   # (a tuple only for TC)
    def __repr__(self) -> str: return f"Opt(op={self.op}, axis={self.axis}, arg={self.arg})"

class KernelOptError(Exception):
    """An Opt that doesn't apply to this kernel (bad axis, amount that doesn't divide the loop, ...)."""

def _store_ranges(ast: UOp) -> list[UOp]:
    return [u for st in ast.src for u in st.src[0].toposort() if u.op is _RANGE]

def uniquify_reduce_ranges(ast: UOp) -> UOp:
    """Give REDUCEs that share a RANGE but can't share its loop fresh RANGEs: a REDUCE nested inside another over
    the same RANGE, and sibling REDUCEs whose values vary with different outer ranges (their loops sit in different
    places). Siblings with the same outer ranges keep sharing, so they run in one loop."""
    next_id = max((u.arg[0] for u in ast.toposort() if u.op is _RANGE), default=-1) + 1
    def rename(red: UOp, rngs) -> UOp:
        nonlocal next_id
        fresh = {}
        for r in rngs:
            fresh[r] = UOp(_RANGE, r.dtype, r.src, (next_id, r.arg[1])); next_id += 1
        return red.substitute(fresh)
    while True:
        reds = [u for u in ast.toposort() if u.op is _REDUCE]
        change = None
        for red in reds:
            own = set(red.src[1:])
            inner = [u for u in red.src[0].toposort() if u.op is _REDUCE and own.intersection(u.src[1:])]
            if inner:
                change = (inner[-1], rename(inner[-1], own.intersection(inner[-1].src[1:])))
                break
        if change is None:
            seen: dict[UOp, frozenset[UOp]] = {}
            for red in reds:
                outer = frozenset(x for x in red.src[0].toposort() if x.op is _RANGE) - set(red.src[1:])
                if bad := [r for r in red.src[1:] if r in seen and seen[r] != outer]:
                    change = (red, rename(red, bad))
                    break
                for r in red.src[1:]: seen[r] = outer
        if change is None: return ast
        ast = ast.substitute({change[0]: change[1]})

# a kernel nesting more output loops than this is flattened: C compilers peel and unroll deep nests of short loops
# until they run out of memory (`Tensor.ones(*[2]*24) + 1`: 24 loops of 2, over a minute of gcc)
MAX_OUTPUT_LOOPS = 8

def _loops_used_outside_addresses(topo: list[UOp], idxs: list[UOp]) -> set[UOp]:
    """The loops that a gate or a value uses (a padding check, an iota): merged with a neighbour, they would need their
    own range back."""
    addresses = set(UOp.sink_of(*[idx.src[1] for idx in idxs]).toposort())
    blocked: set[UOp] = set()
    for u in topo:
        if u.op is _INDEX: uses = [x for g in u.src[2:] for x in g.toposort()]
        elif u in addresses or u.op is _REDUCE: continue
        else: uses = [x for s in u.src if s.op is _RANGE or s in addresses for x in s.toposort()]
        blocked.update(x for x in uses if x.op is _RANGE)
    return blocked

def merge_contiguous_loops(ast: UOp, lanes: int, always: bool = False) -> UOp:
    """Adjacent output loops that every memory access addresses as one (the outer loop's coefficient is the inner
    loop's size times the inner's, and neither appears outside the addresses) become one loop of their product
    - when that makes whole vectors of `lanes` where the inner loop alone doesn't: a 1x1 convolution's 28x28 pixels
      are one loop of 784, 49 vectors of 16, where a vector along the rows of 28 was padded to 32. 7x7 images (49
      pixels) keep their rows: the heuristic takes the channels as the vector there, which times faster than merged
      pixels (DESIGN.md, "Loop shapes for CPUs").
      The AST is returned unchanged when an address wouldn't stay affine in the merged loop.
    - with `always` (a GPU-style kernel: fewer, longer loops give work-groups more work-items), wherever the
      addresses stay affine;
    - always, in a kernel of more than MAX_OUTPUT_LOOPS output loops (a rank-24 elementwise op is one loop); if it
      still has too many, the adjacent loops of the smallest product are merged whatever their addresses (an index
      then divides the merged loop back into its parts)."""
    from fusegrad.uop.symbolic import simplify_indexing
    outs = sorted(set(_store_ranges(ast)), key=lambda r: r.arg[0])
    def whole_vectors(sa: int | UOp, sb: int | UOp) -> bool:
        return isinstance(sa, int) and isinstance(sb, int) and sb % lanes != 0 and (sa * sb) % lanes == 0
    deep = len(outs) > MAX_OUTPUT_LOOPS
    # (most kernels have no such pair: they skip the walks below, which run for every kernel compiled)
    if not deep and not always and \
            (lanes < 2 or not any(whole_vectors(range_size(a), range_size(b)) for a, b in zip(outs, outs[1:]))):
        return ast
    topo = ast.toposort()
    idxs = [u for u in topo if u.op is _INDEX]
    blocked = _loops_used_outside_addresses(topo, idxs)
    coeffs = {r: [coeff(idx.src[1], r) for idx in idxs] for r in outs}
    def size(run: list[UOp]) -> int | UOp:
        sizes = [range_size(r) for r in run]
        return math.prod(sizes) if all(isinstance(x, int) for x in sizes) else sizes[0]
    # runs of loops that become one, outer to inner; built from the innermost loop out
    runs: list[list[UOp]] = [[outs[-1]]] if outs else []
    for a in reversed(outs[:-1]):
        inner = runs[0]
        sa, sb = range_size(a), size(inner)
        ok = isinstance(sa, int) and isinstance(sb, int) and a not in blocked and inner[0] not in blocked and \
            (deep or always or whole_vectors(sa, sb)) and \
            all(ca is not None and cb is not None and ca == sb * cb for ca, cb in zip(coeffs[a], coeffs[inner[-1]]))
        if ok: inner.insert(0, a)
        else: runs.insert(0, [a])
    affine = [run[0] for run in runs if len(run) > 1]
    while deep and len(runs) > MAX_OUTPUT_LOOPS:
        pairs = [i for i in range(len(runs) - 1) if all(isinstance(size(x), int) for x in runs[i:i + 2])]
        if not pairs: break
        i = min(pairs, key=lambda i: (size(runs[i]) * size(runs[i + 1]), -i))
        runs[i:i + 2] = [runs[i] + runs[i + 1]]
    if all(len(run) == 1 for run in runs): return ast
    step: dict[UOp, UOp] = {}
    new_range: dict[UOp, UOp] = {}
    for run in runs:
        if len(run) == 1: continue
        r = new_range[run[0]] = UOp(_RANGE, run[0].dtype, (UOp.const(dtypes.index, size(run)),), run[0].arg)
        stride = size(run)
        for i, x in enumerate(run):
            stride //= range_size(x)
            part = r // stride if stride != 1 else r
            step[x] = part % range_size(x) if i else part
    merged = simplify_indexing(ast.substitute(step))
    if deep: return merged
    idxs = [u for u in merged.toposort() if u.op is _INDEX]
    return ast if any(coeff(idx.src[1], new_range[a]) is None for idx in idxs for a in affine) else merged

def merge_contiguous_reduce_loops(ast: UOp, lanes: int) -> UOp:
    """Adjacent loops of a reduction that every memory access addresses as one (as in merge_contiguous_loops) become
    one loop of their product, where the inner loop alone isn't whole vectors of `lanes`: a batch norm's sums over
    the 2x2 or 4x4 images of a late layer reduce over the pixels as one contiguous loop, which the heuristic
    vectorizes, where two loops of 2 or 4 ran as scalar code. A loop that a gate or a value uses (a padding check)
    keeps its own, and so does one that a reduction names apart from its neighbour."""
    from fusegrad.uop.symbolic import simplify_indexing
    topo = ast.toposort()
    reds = [u for u in topo if u.op is _REDUCE and len(u.src) > 2]
    if lanes < 2 or not reds: return ast
    # (most reductions have no pair to merge: they skip the walks below, which run for every kernel compiled)
    if not any(isinstance(a := range_size(x), int) and isinstance(b := range_size(y), int) and a > 1 and b > 1 and
               b % lanes != 0 for red in reds for x, y in zip(red.src[1:], red.src[2:])):
        return ast
    idxs = [u for u in topo if u.op is _INDEX]
    blocked = _loops_used_outside_addresses(topo, idxs)
    # each loop's (outer, inner) neighbours in every reduction that names it
    neighbours: dict[UOp, set[tuple[UOp | None, UOp | None]]] = {}
    for red in reds:
        rngs = (None, *red.src[1:], None)
        for i in range(1, len(rngs) - 1): neighbours.setdefault(rngs[i], set()).add((rngs[i - 1], rngs[i + 1]))
    def joins(a: UOp, run: list[UOp]) -> bool:
        sizes = [range_size(x) for x in (a, *run)]
        if not all(isinstance(x, int) and x > 1 for x in sizes) or sizes[-1] % lanes == 0 or a in blocked or \
                run[0] in blocked:
            return False
        if neighbours[a] != {(o, run[0]) for o, _ in neighbours[a]} or \
                neighbours[run[0]] != {(a, i) for _, i in neighbours[run[0]]}:
            return False
        inner = math.prod(sizes[1:])
        return all((ca := coeff(idx.src[1], a)) is not None and (cb := coeff(idx.src[1], run[-1])) is not None and
                   ca == inner * cb for idx in idxs)
    step: dict[UOp, UOp] = {}
    head: dict[UOp, UOp] = {}    # the outermost loop of each merged run -> the merged loop
    for red in reds:
        rngs = [r for r in red.src[1:] if r not in step]
        i = len(rngs) - 1
        while i > 0:
            run = [rngs[i]]
            while i > 0 and joins(rngs[i - 1], run):
                run.insert(0, rngs[i - 1])
                i -= 1
            i -= 1
            if len(run) == 1: continue
            size = math.prod(range_size(x) for x in run)
            merged = head[run[0]] = UOp(_RANGE, run[0].dtype, (UOp.const(dtypes.index, size),), run[0].arg)
            for j, x in enumerate(run):
                size //= range_size(x)
                part = merged // size if size != 1 else merged
                step[x] = part % range_size(x) if j else part
    if not step: return ast
    # rebuilt bottom-up: a reduction names the merged loop in place of its parts, every other use takes its part
    new: dict[UOp, UOp] = {}
    for u in topo:
        if u in step: new[u] = step[u]
        elif u.op is _REDUCE:
            new[u] = u.replace(src=(new[u.src[0]], *[head.get(r, r) for r in u.src[1:] if r in head or r not in step]))
        elif u.src: new[u] = u.replace(src=tuple(new[s] for s in u.src))
        else: new[u] = u
    out = simplify_indexing(new[ast])
    # (an address that isn't affine in the merged loop would divide it back in every iteration)
    if any(coeff(idx.src[1], r) is None for idx in out.toposort() if idx.op is _INDEX for r in head.values()):
        return ast
    return out

def _stores_loaded(ast: UOp) -> bool:
    """Whether a kernel stores to addresses it loads (a scatter)."""
    return any(u.op is _LOAD for st in ast.src for u in st.src[0].toposort())

class Kernel:
    """A kernel AST with its loops, transformed by `apply_opt` and finalized by `get_optimized_ast`."""
    def __init__(self, ast: UOp, renderer=None):
        if ast.op is not _SINK or any(s.op is not _STORE for s in ast.src):
            raise ValueError(f"a kernel AST is a SINK of STOREs, got {ast.op}")
        lanes = getattr(renderer, "simd_bytes", 0) // 4   # (float32 lanes)
        gpu = bool(getattr(renderer, "has_local", False)) and not _stores_loaded(ast)
        merged = merge_contiguous_loops(ast, lanes, always=gpu)
        # (again while it merges: runs are grown from the innermost loop out, and two loops whose product isn't whole
        # vectors (a 3x3 window's taps, 9) stay apart even where the outer loop would then make whole vectors of
        # all three: 3x3 convolution weights copied with the output channels innermost, 256 x 3 x 3 rows)
        while merged is not ast:
            ast, merged = merged, merge_contiguous_loops(merged, lanes, always=gpu)
        self.ast = uniquify_reduce_ranges(merged if gpu else merge_contiguous_reduce_loops(merged, lanes))
        self.renderer = renderer
        topo = self.ast.toposort()
        out = sorted(set(_store_ranges(self.ast)), key=lambda r: r.arg[0])
        red: list[UOp] = []
        for u in topo:
            if u.op is _REDUCE: red.extend(r for r in u.src[1:] if r not in red)
        self.loops: list[UOp] = out + red
        self.expanded: list[UOp] = []        # upcast/unroll ranges, in creation order
        self.copies: list[UOp] = []          # loops of PACK copies
        self.packed: set[int] = set()        # ids of the output loops a PACK copy's layout is fixed along
        self.locals: list[UOp] = []          # work-item ranges of a GPU-style kernel (LOCAL, GROUP), in creation order
        self.local_keys: dict[UOp, tuple] = {}   # their launch order: sorted by key, the last is launch dimension 0
        self.groups: set[UOp] = set()        # the locals split off a reduce loop (GROUP, GROUPTOP)
        self.tiles: list[UOp] = []           # the block loops of LTILE
        self.tc = None                       # TC's TensorCore and the ids of its M, N and K loops (tc.py)
        self.tc_frame: UOp | None = None     # TC's operands before the lanes' substitution (tc.py, `staged_operands`)
        self.applied_opts: list[Opt] = []
        self.useful = 1.0                    # the fraction of the loop iterations that aren't padding (PADTO)
        self.next_id = max((u.arg[0] for u in topo if u.op is _RANGE), default=-1) + 1
        self.reduceops = [u for u in topo if u.op is _REDUCE]
        # a kernel storing to addresses it loads (a scatter) runs its loop in order on one core, as written: two
        # iterations may hit one address, and the later one must see the earlier one's write
        self.in_order = _stores_loaded(self.ast)

    # *** queries ***

    @property
    def first_reduce(self) -> int: return sum(1 for r in self.loops if range_kind(r) != "reduce")
    def output_axes(self) -> list[int]: return list(range(self.first_reduce))
    def reduce_axes(self) -> list[int]: return list(range(self.first_reduce, len(self.loops)))
    def size(self, axis: int) -> int | UOp: return range_size(self.loops[axis])
    def accesses(self) -> list[tuple[UOp, bool]]:
        """Every memory INDEX of the kernel with whether it is stored to."""
        # (the heuristics ask many times of one AST: found once per AST, a copy handed out)
        if (memo := self.__dict__.get("_accesses")) is None or memo[0] is not self.ast:
            stores = {st.src[0] for st in self.ast.src}
            memo = self._accesses = (self.ast, [(u, u in stores) for u in self.ast.toposort() if u.op is _INDEX])
        return list(memo[1])

    @property
    def gpu(self) -> bool:
        """Whether the kernel is GPU-style: launched over work-groups of work-items (see the module docstring)."""
        return bool(getattr(self.renderer, "has_local", False)) and not self.in_order

    def local_memory(self) -> int:
        """Bytes of local memory the grouped reductions will use: a partial result per work-item and lane."""
        total = 0
        for red in (u for u in self.ast.toposort() if u.op is _REDUCE):
            if not (groups := [r for r in red.src[1:] if r in self.groups]): continue
            lanes = {r for r in live_ranges(red.src[0], {}) if range_kind(r) in ("local", "upcast")}
            total += red.dtype.itemsize * math.prod(range_size(r) for r in lanes - set(red.src[1:]) | set(groups))
        fixed = set(self.loops[:self.first_reduce]) | set(self.tiles)
        if self.tc is not None:
            from fusegrad.codegen.opt.tc import staged_bytes
            return total + (staged_bytes(self.tc_frame, self.tc[0], fixed) if self.tiles else 0)
        # (each staged block's region of its shared buffer starts at a multiple of 16 bytes: `_stage_tiles`)
        return total + sum(-(-idx.dtype.base.itemsize * math.prod(range_size(r) for r in block) // 16) * 16
                           for _, idx, block in _tiled_loads(self.ast, self.tiles, fixed, self.locals))

    def sequential_outputs(self) -> set[UOp]:
        """The output loops that a reduction's result is broadcast along (a softmax's columns, for the sums of its
        rows): a GPU-style kernel keeps them loops of each work-item, so the reduction runs once for all of them."""
        memo: dict[UOp, frozenset[UOp]] = {}
        outs, ret = set(self.loops[:self.first_reduce]), set()
        for st in self.ast.src:
            stored_at = live_ranges(st.src[0], memo) & outs
            for red in (u for u in st.src[1].toposort() if u.op is _REDUCE):
                ret |= stored_at - live_ranges(red, memo)
        return ret

    def _check_launch(self) -> None:
        """KernelOptError if the work-items of a group or their local memory exceed the renderer's limits."""
        if not self.locals: return
        sizes = [range_size(r) for r in sorted(self.locals, key=lambda r: self.local_keys[r])][::-1]
        limits = tuple(getattr(self.renderer, "local_max", ())) or (1 << 30,) * 3
        if len(sizes) > len(limits) or any(n > lim for n, lim in zip(sizes, limits)):
            raise KernelOptError(f"work-group {sizes} exceeds the launch dimensions {limits}")
        if math.prod(sizes) > self.renderer.max_workgroup:
            raise KernelOptError(f"work-group of {math.prod(sizes)} exceeds {self.renderer.max_workgroup} work-items")
        if (used := self.local_memory()) > self.renderer.local_bytes:
            raise KernelOptError(f"{used} bytes of local memory exceed {self.renderer.local_bytes}")

    def _check_groupable(self, r: UOp) -> None:
        """KernelOptError unless every reduction over reduce loop `r` runs once per work-item: a grouped reduction
        inside another loop would reuse its local memory while other work-items still read it."""
        for red in (u for u in self.ast.toposort() if u.op is _REDUCE and r in u.src[1:]):
            outer = live_ranges(red.src[0], {}) - set(red.src[1:])
            if any(x not in self.loops[:self.first_reduce] and range_kind(x) not in ("local", "upcast") for x in outer):
                raise KernelOptError("GROUP of a reduction nested in another loop")

    # *** transformations ***

    def _split(self, axis: int, amt: int, kind: str, top: bool = False, shared: tuple[UOp, ...] = ()) -> UOp:
        """Split `amt` off the inside of loop `axis` as a new range of `kind` ("loop": `amt` is the outer part; `top`:
        the new range is the outer part of the loop, of `amt` iterations). The loops `shared` (of the same size) are
        split the same way, around the same new range."""
        r = self.loops[axis]
        size = range_size(r)
        if not isinstance(size, int): raise KernelOptError(f"can't split symbolic loop {r.arg}")
        amt = amt or size
        # an empty loop isn't split: its lanes would be loads and stores the loop never makes
        if amt <= 0 or amt > size or size % amt != 0 or (kind == "loop" and amt in (1, size)):
            raise KernelOptError(f"{amt} doesn't split loop of {size}")
        # a PACK copy made inside this loop has no room for lanes of it: upcast or unroll it before the PACK
        if kind != "loop" and r.arg[0] in self.packed: raise KernelOptError("can't expand a loop a PACK copies along")
        if kind == "loop": amt = size // amt
        inner = UOp.range(amt, self.next_id, kind); self.next_id += 1
        # each split loop -> (its outer part or None, its index expression)
        splits: dict[UOp, tuple[UOp | None, UOp]] = {}
        for x in (r, *shared):
            if amt == size:
                splits[x] = (None, inner)
                self.loops.remove(x)
            else:
                outer = UOp.range(size // amt, x.arg[0], x.arg[1])
                splits[x] = (outer, inner * (size // amt) + outer if top else outer * amt + inner)
                self.loops[self.loops.index(x)] = outer
        if kind == "loop":
            self.loops.insert(axis + 1, inner)
            if r.arg[0] in self.packed: self.packed.add(inner.arg[0])
        elif kind == "local":
            self.locals.append(inner)
            self.local_keys[inner] = (range_kind(r) == "reduce", axis, -len(self.locals))
        else: self.expanded.append(inner)
        self._replace_splits(splits, inner)
        return inner

    def _replace_splits(self, splits: dict[UOp, tuple[UOp | None, UOp]], inner: UOp) -> None:
        """Each split loop of `splits` (-> its outer part or None, its index expression) replaced in the AST: REDUCEs
        list their ranges as sources, there the loop becomes (outer, inner); in index math its expression."""
        replaced: dict[UOp, UOp] = {}
        for u in self.ast.toposort():
            if u in splits: replaced[u] = splits[u][1]; continue
            if u.op is _REDUCE and any(x in splits for x in u.src[1:]):
                rngs = [y for x in u.src[1:] for y in ((splits[x][0], inner) if x in splits else (x,)) if y is not None]
                replaced[u] = u.replace(src=(replaced[u.src[0]], *rngs)); continue
            new_src = tuple(replaced[s] for s in u.src)
            replaced[u] = u if new_src == u.src else u.replace(src=new_src)
        self.ast = replaced[self.ast]
        if self.tc_frame is not None: self.tc_frame = self.tc_frame.substitute({x: e for x, (_, e) in splits.items()})

    def _ltile(self, axis: int, amt: int) -> None:
        r = self.loops[axis]
        size = range_size(r)
        if range_kind(r) != "reduce" or not isinstance(size, int) or amt < 2 or amt >= size or size % amt:
            raise KernelOptError(f"LTILE needs a reduce loop with a proper divisor, not {amt} of {size}")
        reds = [u for u in self.ast.toposort() if u.op is _REDUCE and r in u.src[1:]]
        # (the block loop is the reduction's outermost, so its other loops run inside each block: a convolution's
        # window)
        if any(red.src[1] is not r for red in reds): raise KernelOptError("LTILE needs the reduction's outermost loop")
        if self.tc is not None:
            from fusegrad.codegen.opt.tc import check_tc_ltile
            check_tc_ltile(self, r)
        from fusegrad.codegen.lower import SUM_BLOCKED_OVER
        trips = lambda red: math.prod(s if isinstance(s := range_size(x), int) else SUM_BLOCKED_OVER + 1
                                      for x in red.src[1:])
        if any(red.arg is _ADD and dtypes.is_float(red.dtype) and trips(red) > SUM_BLOCKED_OVER for red in reds):
            raise KernelOptError("LTILE of a float sum long enough to be summed in blocks")
        self._check_groupable(r)
        outer = UOp.range(size // amt, r.arg[0], "reduce")
        inner = UOp.range(amt, self.next_id, "reduce"); self.next_id += 1
        self.loops[axis] = outer
        self.loops.insert(axis + 1, inner)
        self._replace_splits({r: (outer, outer * amt + inner)}, inner)
        self.tiles.append(outer)

    def _state(self) -> tuple:
        return (self.ast, list(self.loops), list(self.expanded), list(self.copies), set(self.packed), list(self.locals),
                dict(self.local_keys), set(self.groups), list(self.tiles), self.next_id, self.useful, self.tc,
                list(self.reduceops), self.tc_frame)

    def _restore(self, state: tuple) -> None:
        (self.ast, self.loops, self.expanded, self.copies, self.packed, self.locals, self.local_keys, self.groups,
         self.tiles, self.next_id, self.useful, self.tc, self.reduceops, self.tc_frame) = state

    def apply_opt(self, opt: Opt) -> UOp | None:
        """Apply one Opt (raises KernelOptError if it doesn't fit, leaving the kernel as it was); returns the new
        expanded (or work-item) range, if any."""
        if self.in_order: raise KernelOptError("a kernel storing to loaded addresses runs its loop as written")
        if not 0 <= opt.axis < len(self.loops): raise KernelOptError(f"no axis {opt.axis} in {len(self.loops)} loops")
        if self.gpu and opt.op in (OptOps.PACK, OptOps.KBLOCK, OptOps.SPLIT):
            raise KernelOptError(f"{opt.op.name} shapes loops for CPUs, not GPU-style kernels")
        if not self.gpu and opt.op in (OptOps.LOCAL, OptOps.GROUP, OptOps.GROUPTOP, OptOps.LTILE, OptOps.TC):
            raise KernelOptError(f"{opt.op.name} needs a GPU-style renderer (has_local)")
        if self.tc is not None and (opt.op in (OptOps.GROUP, OptOps.GROUPTOP) or
                                    (opt.op in (OptOps.UPCAST, OptOps.PADTO) and opt.axis >= self.first_reduce)):
            # (the sum is the tensor core's: of whole tiles, accumulated by the instruction in one register set)
            raise KernelOptError(f"{opt.op.name} of a reduce loop after TC")
        if opt.op is not OptOps.TC and not isinstance(opt.arg, int):
            raise KernelOptError(f"{opt.op.name} takes an int, not {opt.arg!r}")
        if self.loops[opt.axis] in self.tiles and opt.op is not OptOps.SWAP:
            raise KernelOptError("the block loop of an LTILE stays as it is")
        state = self._state()
        try: ret = self._apply(opt)
        except KernelOptError:
            self._restore(state)
            raise
        self.applied_opts.append(opt)
        return ret

    def _apply(self, opt: Opt) -> UOp | None:
        ret = None
        if opt.op in (OptOps.UPCAST, OptOps.PADTO) and opt.axis < self.first_reduce:
            # an output loop that a store's index doesn't move with, where the kernel reads that index back (KBLOCK's
            # block loop: each block adds to the partial sum the one before it stored) runs its iterations in order:
            # as lanes they would all read the value before any stored, and a padded block would apply the epilogue
            # again
            r, stored = self.loops[opt.axis], {st.src[0] for st in self.ast.src if st.op is _STORE}
            if any(u.op is _LOAD and u.src[0] in stored and r not in u.src[0].toposort()
                   for u in self.ast.toposort()):
                raise KernelOptError(f"{opt.op.name} of a loop whose iterations read what the ones before stored")
        if opt.op is OptOps.UPCAST: ret = self._split(opt.axis, opt.arg, "upcast")
        elif opt.op is OptOps.UNROLL:
            if range_kind(self.loops[opt.axis]) != "reduce": raise KernelOptError("UNROLL needs a reduce axis")
            ret = self._split(opt.axis, opt.arg, "unroll")
        elif opt.op is OptOps.SWAP:
            a, b = opt.axis, opt.arg
            if not (a < self.first_reduce and 0 <= b < self.first_reduce):
                raise KernelOptError("SWAP needs output axes")
            self.loops[a], self.loops[b] = self.loops[b], self.loops[a]
        elif opt.op is OptOps.KBLOCK: self._kblock(opt.axis, opt.arg)
        elif opt.op is OptOps.PADTO: self._padto(opt.axis, opt.arg)
        elif opt.op is OptOps.PACK: self._pack(opt.axis, opt.arg)
        elif opt.op is OptOps.SPLIT:
            if opt.axis >= self.first_reduce: raise KernelOptError("SPLIT needs an output axis")
            self._split(opt.axis, opt.arg, "loop")
        elif opt.op is OptOps.LTILE: self._ltile(opt.axis, opt.arg)
        elif opt.op is OptOps.TC:
            from fusegrad.codegen.opt.tc import apply_tc
            apply_tc(self, opt.axis, opt.arg)
        elif opt.op is OptOps.LOCAL:
            if opt.axis >= self.first_reduce: raise KernelOptError("LOCAL needs an output axis")
            if self.loops[opt.axis] in self.sequential_outputs():
                raise KernelOptError("LOCAL of a loop a reduction's result is broadcast along")
            ret = self._split(opt.axis, opt.arg, "local")
        elif opt.op in (OptOps.GROUP, OptOps.GROUPTOP):
            r = self.loops[opt.axis]
            if range_kind(r) != "reduce": raise KernelOptError(f"{opt.op.name} needs a reduce axis")
            self._check_groupable(r)
            # one loop of the same size in each other reduction (a softmax's sum after its max) shares the work-items:
            # two loops of one reduction given the same ids would each skip most of their elements
            reductions = [u for u in self.ast.toposort() if u.op is _REDUCE]
            own = next((list(u.src[1:]) for u in reductions if r in u.src[1:]), [r])
            shared: list[UOp] = []
            for red in reductions:
                if r in red.src[1:]: continue
                fits = [x for x in red.src[1:] if x in self.loops[self.first_reduce:] and x not in shared
                        and range_size(x) == range_size(r)]
                # the loop at r's place in its own reduction first (the same element of the same shape)
                fits.sort(key=lambda x: list(red.src[1:]).index(x) != own.index(r))
                for x in fits:
                    try: self._check_groupable(x)
                    except KernelOptError: continue
                    shared.append(x)
                    break
            ret = self._split(opt.axis, opt.arg, "local", top=opt.op is OptOps.GROUPTOP, shared=tuple(shared))
            self.groups.add(ret)
        else: raise KernelOptError(f"unknown opt {opt.op}")
        if self.gpu: self._check_launch()
        return ret

    def _padto(self, axis: int, amt: int) -> None:
        r = self.loops[axis]
        size = range_size(r)
        if not isinstance(size, int) or amt < 2 or size % amt == 0: raise KernelOptError(f"can't pad {size} to {amt}")
        if self.tc is not None:
            # (the staged copy of TC's operands reads them unpadded: the padding's gates are the AST's only)
            if self.tiles: raise KernelOptError("PADTO after the LTILE of a TC")
            self.tc_frame = None
        padded = UOp.range(-(-size // amt) * amt, r.arg[0], r.arg[1])
        ast = self.ast.substitute({r: padded})
        # every access that varies with the loop is gated, so the padded iterations neither read nor write memory, and
        # a padded iteration of a reduction contributes its identity. Rebuilt from the leaves up: an access inside
        # another's index (a gather's index loaded from a concatenation) is gated in every place it is used (a
        # substitution of the outer access would keep the inner one it was made from, ungated, reading past its
        # buffer's end in the padded iterations)
        from fusegrad.codegen.lower import identity_element
        inside = padded < size
        varies: set[UOp] = set()
        rebuilt: dict[UOp, UOp] = {}
        for u in ast.toposort():
            if u is padded or any(s in varies for s in u.src): varies.add(u)
            src = tuple(rebuilt.get(s, s) for s in u.src)
            if u.op is _INDEX and u in varies: src = (src[0], src[1], inside if len(src) < 3 else src[2] & inside)
            elif u.op is _REDUCE and axis >= self.first_reduce and padded in u.src[1:]:
                src = (inside.where(src[0], identity_element(u.arg, u.dtype)), *src[1:])
            if src != u.src: rebuilt[u] = u.replace(src=src)
        ast = rebuilt.get(ast, ast)
        self.ast = ast
        self.loops[axis] = padded
        self.useful *= size / range_size(padded)

    def kblock_reduce(self, axis: int) -> UOp:
        """The REDUCE that KBLOCK of reduce loop `axis` would block, or KernelOptError saying why it can't."""
        r = self.loops[axis]
        if range_kind(r) != "reduce": raise KernelOptError("KBLOCK needs a reduce loop")
        if len(self.ast.src) != 1: raise KernelOptError("KBLOCK needs a single STORE")
        idx, value = self.ast.src[0].src[:2]
        reds = [u for u in value.toposort() if u.op is _REDUCE]
        over = [u for u in reds if r in u.src[1:]]
        if len(over) != 1 or over[0].dtype != idx.src[0].dtype.base or over[0].arg not in (_ADD, _MAX, _MUL):
            raise KernelOptError("KBLOCK needs the stored value to hold one REDUCE over the axis, in the output dtype")
        # (an epilogue is computed for every block: another reduction in it would be computed that many times)
        inside = over[0].toposort()
        if any(u is not over[0] and u not in inside for u in reds):
            raise KernelOptError("KBLOCK needs a stored value without other reductions")
        if any(u.op is _INDEX and u.src[0] is idx.src[0] and u is not idx for u in self.ast.toposort()) or \
                any(u.op is _LOAD and u.src[0] is idx for u in value.toposort()):
            raise KernelOptError("KBLOCK can't accumulate into a buffer the kernel also reads")
        if not self.first_reduce: raise KernelOptError("KBLOCK needs an output loop to place the block loop in")
        return over[0]

    def _kblock(self, axis: int, amt: int) -> None:
        r = self.loops[axis]
        size = range_size(r)
        if range_kind(r) != "reduce" or not isinstance(size, int) or amt <= 0 or size % amt or amt >= size:
            raise KernelOptError(f"KBLOCK needs a reduce loop with a proper divisor, not {amt} of {size}")
        red = self.kblock_reduce(axis)
        st = self.ast.src[0]
        idx, value = st.src[:2]
        from fusegrad.codegen.lower import identity_element
        blk = UOp.range(size // amt, self.next_id, "loop"); self.next_id += 1
        inner = UOp.range(amt, r.arg[0], "reduce")
        rngs = tuple(inner if x is r else x for x in red.src[1:])
        part = UOp(_REDUCE, red.dtype, (red.src[0].substitute({r: blk * amt + inner}), *rngs), red.arg)
        prev = (blk < 1).where(identity_element(red.arg, red.dtype), idx.load())
        acc = part.alu(red.arg, prev)
        # an epilogue after the reduction (a convolution's batch norm and relu) is applied by the last block only:
        # the blocks before it store the bare partial result
        stored = acc if value is red else (blk < size // amt - 1).where(acc, value.substitute({red: acc}))
        self.ast = UOp.sink_of(st.replace(src=(idx, stored) + st.src[2:]))
        self.loops[axis] = inner
        self.loops.insert(1, blk)

    MAX_LOCAL_BYTES = 512 * 1024

    def _pack(self, axis: int, buf_arg: int) -> None:
        if axis >= self.first_reduce: raise KernelOptError("PACK needs an output axis")
        idxs = {u for u in self.ast.toposort() if u.op is _INDEX and u.src[0].op is _DEFINE_GLOBAL
                and u.src[0].arg == buf_arg}
        if len(idxs) != 1: raise KernelOptError(f"PACK needs exactly one access to buffer {buf_arg}")
        idx = idxs.pop()
        if any(u.op is _STORE and u.src[0] is idx for u in self.ast.toposort()): raise KernelOptError("stored")
        outs = self.loops[:self.first_reduce]
        deps = {u for u in idx.toposort() if u.op is _RANGE}
        tile = deps & set(outs[axis + 1:])  # (output loops are plain loops: upcast lanes aren't among them)
        # layout of the copy: its loops outermost (in the order of their strides in memory), then the upcast lanes
        # with the innermost split (the vector lanes) last, so the copy is contiguous along the vector lanes even
        # when the buffer isn't (a transposed matrix gets transposed by the copy)
        strides = {r: coeff(idx.src[1], r) for r in deps}
        def layout(r: UOp) -> tuple:
            if r in self.expanded: return (1, -self.expanded.index(r))
            return (0, -(strides[r] if strides[r] is not None else 1 << 62))
        inner = sorted(deps - set(outs[:axis + 1]), key=layout)
        packed = {r.arg[0] for r in deps & set(outs[:axis + 1]) | tile}
        sizes = [range_size(r) for r in inner]
        if not inner or not all(isinstance(s, int) for s in sizes): raise KernelOptError("nothing to PACK")
        n = math.prod(sizes)
        # a load that is only ever converted (half -> float) is packed converted: the inner loops then read floats
        topo = list(self.ast.toposort())
        loads = {u for u in topo if u.op is _LOAD and u.src[0] is idx}
        users = [u for u in topo for x in u.src if x in loads]
        casts = {u for u in users if u.op is _CAST}
        to = next(iter(casts)).dtype if casts and len(casts) == len(users) and len({c.dtype for c in casts}) == 1 \
            else None
        elem = to if to is not None else idx.dtype.base
        if n * elem.itemsize > self.MAX_LOCAL_BYTES: raise KernelOptError(f"PACK of {n} elements is too big")
        # the copy loops over fresh ranges where the load has loops (a tile's output loops too); upcast lanes stay
        # (they expand the same way)
        fresh = {}
        for r in inner:
            if range_kind(r) in ("reduce", "loop"):
                fresh[r] = UOp.range(range_size(r), self.next_id, "copy"); self.next_id += 1
                self.copies.append(fresh[r])
        lin = UOp.const(dtypes.index, 0)
        for r, s in zip(inner, sizes): lin = lin * s + r
        local = UOp(_DEFINE_LOCAL, elem.ptr(n, "local"), arg=len(self.copies))
        def copied(sub: dict[UOp, UOp]) -> UOp:
            value = UOp(_LOAD, idx.dtype.base, (idx.substitute(sub),))
            return local.index(lin.substitute(sub)).store(value.cast(to) if to is not None else value)
        # a copy that transposes (the buffer's rows along one of its loops, the vector lanes down its columns) copies
        # whole w x w blocks transposed in registers where the renderer can (TRANSPOSED_COPY: w contiguous loads of
        # rows, log2(w) steps of shuffles, w stores), where each vector stored was otherwise gathered one element of
        # w rows at a time; the elements past the last whole block of the loop are gathered in a loop of their own
        lanes = [r for r in inner if r in self.expanded]
        if getattr(self.renderer, "transposed_copy", False) and to is None and len(idx.src) == 2 and \
                (run := _transposed_run(inner, strides, lanes)) is not None and coeff(lin, lanes[-1]) == 1 and \
                elem in self.renderer.vector_dtypes and all(r in fresh for r in run) and \
                range_size(lanes[-1]) * elem.itemsize <= self.renderer.simd_bytes:
            # (the run's loops walk its rows as one: position p of the run is at p elements in the buffer and at
            # p * dst_step in the copy, each loop being the row-major digit of p)
            w, size, lane = range_size(lanes[-1]), math.prod(range_size(r) for r in run), lanes[-1]
            def at(p: UOp) -> dict[UOp, UOp]:
                digits, inside = {}, 1
                for r in reversed(run):
                    digits[r] = (p // inside) % range_size(r) if len(run) > 1 else p
                    inside *= range_size(r)
                return digits
            blocks = UOp.range(size // w, fresh[run[0]].arg[0], "copy")
            self.copies[self.copies.index(fresh[run[0]])] = blocks
            for r in run[1:]: self.copies.remove(fresh[r])
            corner = {**fresh, **at(blocks * w), lane: lane.const_like(0)}
            dst_step, src_step = coeff(lin, run[-1]), strides[lane]
            parts = [UOp(_END, dtypes.void, (UOp(Ops.TRANSPOSED_COPY, dtypes.void, (
                local.index(lin.substitute(corner).simplify()), idx.substitute(corner).simplify()),
                (w, dst_step, src_step)), blocks))]
            if size % w:
                rest = UOp.range(size % w, self.next_id, "copy"); self.next_id += 1
                self.copies.append(rest)
                parts.append(UOp(_END, dtypes.void, (copied({**fresh, **at(rest + size // w * w)}), rest)))
            for r in run: del fresh[r]
            copy = UOp(Ops.NOOP, dtypes.void, tuple(parts))
        else: copy = copied(fresh)
        ready = UOp(_BARRIER, local.dtype, (local, UOp(_END, dtypes.void, (copy, *fresh.values()))))
        replaced = casts if to is not None else loads
        self.packed |= packed
        self.ast = self.ast.substitute({u: UOp(_LOAD, u.dtype, (ready.index(lin),)) for u in replaced})

    def get_optimized_ast(self) -> UOp:
        """The AST with ranges renumbered in loop order and their final kinds: the outermost output loop becomes
        "global" (split across cores) when every STORE depends on it. In a GPU-style kernel every output loop is
        "global" and the work-items "local" (in launch order: the last is dimension 0), grouped reductions go
        through local memory, the output loops their results are broadcast along are shared by the work-items of
        the group, and a store that doesn't vary with some work-item or group is made by the first."""
        outs = self.loops[:self.first_reduce]
        if self.gpu:
            ordered = self.loops + self.expanded + self.copies + sorted(self.locals, key=lambda r: self.local_keys[r])
            seq = self.sequential_outputs()
            kinds = ["global" if i < len(outs) and r not in seq else range_kind(r) for i, r in enumerate(ordered)]
        else:
            parallel = bool(outs) and not self.in_order and all(outs[0] in st.src[0].toposort() for st in self.ast.src)
            ordered = self.loops + self.expanded + self.copies
            kinds = ["global" if i == 0 and parallel else range_kind(r) for i, r in enumerate(ordered)]
        mapping = {r: UOp(_RANGE, r.dtype, r.src, (i, kind)) for i, (r, kind) in enumerate(zip(ordered, kinds))}
        ast = self.ast.substitute(mapping)
        if not self.gpu: return ast
        frame = self.tc_frame.substitute(mapping) if self.tc_frame is not None else None
        ast, next_id = _group_reductions(ast, {mapping[g] for g in self.groups}, len(mapping))
        if len(self.groups) == 1 and seq:
            ast = _spread_over_group(ast, [mapping[r] for r in outs if r in seq], mapping[next(iter(self.groups))])
        grid = [mapping[r] for r in ordered if range_kind(mapping[r]) in ("global", "local")]
        if self.tiles:
            tiles = [mapping[t] for t in self.tiles]
            fixed = {mapping[r] for r in outs} | set(tiles)
            locals_ = [mapping[r] for r in sorted(self.locals, key=self.local_keys.get)]
            if self.tc is not None:
                from fusegrad.codegen.opt.tc import stage_operands
                assert frame is not None
                ast = stage_operands(ast, frame, self.tc[0], tiles[0], fixed, locals_, next_id)
            else: ast = _stage_tiles(ast, tiles, fixed, locals_, next_id)
        return _store_once(ast, grid)

def _transposed_run(inner: list[UOp], strides: dict[UOp, int | None], lanes: list[UOp]) -> list[UOp] | None:
    """The loops of a PACK copy that walk the buffer's rows (the last at stride 1, each other at the stride of the next
    times its size, next to each other in `inner`: a Linear weight's row, a 3x3 convolution's window and input
    channels) where its vector lanes are strided in the buffer by a constant (the copy transposes: `x @ W.T`'s W, a
    convolution's weights packed along the output channels), when they are at least a vector's count long together;
    else None."""
    if not lanes or not isinstance(st := strides[lanes[-1]], int) or st in (0, 1) or \
            not isinstance(w := range_size(lanes[-1]), int) or w < 2 or w & (w - 1):
        return None
    for i, r in enumerate(inner):
        if r in lanes or strides[r] != 1 or not isinstance(range_size(r), int): continue
        run = [r]
        while i > 0 and (p := inner[i - 1]) not in lanes and isinstance(range_size(p), int) and \
                strides[p] == strides[run[0]] * range_size(run[0]):  # type: ignore[operator]
            run.insert(0, p)
            i -= 1
        if math.prod(range_size(x) for x in run) >= w: return run
    return None

def _linear(rngs: list[UOp]) -> UOp:
    """The row-major position of `rngs` (the last varies fastest)."""
    lin = UOp.const(dtypes.index, 0)
    for r in rngs: lin = lin * range_size(r) + r
    return lin

def _group_reductions(ast: UOp, groups: set[UOp], next_id: int) -> tuple[UOp, int]:
    """Each REDUCE over work-item ranges `groups` split in two: every work-item reduces its part over the other ranges
    and stores it to local memory (one slot per work-item and per output lane it varies with), and after a barrier
    the slots of its group are reduced over a fresh loop (by every work-item: the result is theirs to store). Returns
    the AST and the next free range id."""
    replaced: dict[UOp, UOp] = {}
    for red in [u for u in ast.toposort() if u.op is _REDUCE and groups.intersection(u.src[1:])]:
        own = [r for r in red.src[1:] if r in groups]
        rest = [r for r in red.src[1:] if r not in groups]
        # (a grouped reduction inside this one's value, as a softmax's max in its sum, is already replaced)
        src = red.src[0].substitute(replaced) if replaced else red.src[0]
        partial = UOp(_REDUCE, red.dtype, (src, *rest), red.arg) if rest else src
        # (upcast lanes innermost, the one stored contiguously last: it is the likely vector axis, whose lanes are then
        # one vector store and load)
        live = live_ranges(partial, {})
        items = sorted((r for r in live if range_kind(r) == "local" and r not in own), key=lambda r: r.arg[0])
        lanes = sorted((r for r in live if range_kind(r) == "upcast"),
                       key=lambda r: (any(coeff(st.src[0].src[1], r) == 1 for st in ast.src), r.arg[0]))
        slots = math.prod(range_size(r) for r in items + own + lanes)
        local = UOp(_DEFINE_LOCAL, red.dtype.ptr(slots, "local"), arg=len(replaced))
        written = local.index(_linear(items + own + lanes)).store(partial)
        ready = UOp(_BARRIER, local.dtype, (local, written))
        fresh = []
        for r in own:
            fresh.append(UOp.range(range_size(r), next_id, "reduce")); next_id += 1
        value = UOp(_LOAD, red.dtype, (ready.index(_linear(items + fresh + lanes)),))
        replaced[red] = UOp(_REDUCE, red.dtype, (value, *fresh), red.arg)
    return (ast.substitute(replaced) if replaced else ast), next_id

def _tiled_loads(ast: UOp, tiles: list[UOp], fixed: set[UOp], locals_: list[UOp]) -> list[tuple[UOp, UOp, list[UOp]]]:
    """(REDUCE, INDEX, block ranges) of each global load that LTILE stages: inside a reduction over a block loop of
    `tiles`, varying with it, and not with every work-item range (so work-items share it). Its block is the ranges it
    varies with inside one iteration of the block loop and one work-group (all but the `fixed` ones), outermost first
    in the order of the copy in local memory (`_block_layout`)."""
    out = []
    for tile in tiles:
        for red in (u for u in ast.toposort() if u.op is _REDUCE and tile in u.src[1:]):
            loads = {u.src[0] for u in red.src[0].toposort() if u.op is _LOAD and u.src[0].op is _INDEX}
            for idx in loads:
                if idx.src[0].op is not _DEFINE_GLOBAL: continue
                deps = {u for u in idx.toposort() if u.op is _RANGE}
                block = sorted(deps - fixed, key=lambda r: r.arg[0])
                if tile not in deps or all(r in deps for r in locals_) or \
                        any(range_kind(r) not in ("local", "upcast", "unroll", "reduce") for r in block):
                    continue
                out.append((red, idx, _block_layout(idx.src[1], block)))
    return out

def _block_layout(index: UOp, block: list[UOp]) -> list[UOp]:
    """A staged block's ranges in the order of the global buffer: by their strides in `index`, largest first, where
    each is a constant. The copy then reads the buffer contiguously (work-item c copies element c), and a work-item's
    elements that are neighbours in the buffer (a register tile's columns, an unrolled stretch of K) are neighbours
    in local memory too, which the GPU compiler reads as one vector (a 4096 float32 matmul's K step: 4 loads of
    local memory a work-item instead of 16). Else (an index with divisions: a convolution's window) as given."""
    strides = {r: coeff(index, r) for r in block}
    if any(not isinstance(s, int) or s <= 0 for s in strides.values()): return block
    return sorted(block, key=lambda r: -strides[r])

def _stage_tiles(ast: UOp, tiles: list[UOp], fixed: set[UOp], locals_: list[UOp], next_id: int) -> UOp:
    """The loads LTILE stages read from local memory: in each iteration of the block loop, after a barrier (the
    previous block's reads are done), the work-items of the group copy the block, element c by work-item c % W of the
    W of the group, and after a second barrier they read the copy (see the module docstring). The blocks of one block
    loop and dtype share one local buffer (each region aligned to 16 bytes) and its two barriers: a matmul copies A
    and B between the same two, their global loads in flight together."""
    workers = math.prod(range_size(r) for r in locals_)
    me = _linear(locals_)
    replaced: dict[UOp, UOp] = {}
    n_local = sum(1 for u in ast.toposort() if u.op is _DEFINE_LOCAL)
    shared: dict[tuple[UOp, object], list[tuple[UOp, list[UOp]]]] = {}
    for _, idx, block in _tiled_loads(ast, tiles, fixed, locals_):
        tile = next(t for t in tiles if t in idx.toposort())
        shared.setdefault((tile, idx.dtype.base), []).append((idx, block))
    for (tile, dtype), loads in shared.items():
        align, starts = max(1, 16 // dtype.itemsize), [0]
        for _, block in loads: starts.append(starts[-1] + -(-math.prod(range_size(r) for r in block) // align) * align)
        local = UOp(_DEFINE_LOCAL, dtype.ptr(starts[-1], "local"), arg=n_local)
        n_local += 1
        before = UOp(_BARRIER, local.dtype, (local, tile))
        copies = []
        for (idx, block), at in zip(loads, starts):
            size = math.prod(range_size(r) for r in block)
            rounds = -(-size // workers)
            j = UOp.range(rounds, next_id, "copy") if rounds > 1 else UOp.const(dtypes.index, 0)
            next_id += 1
            c = j * workers + me
            coords, stride = {}, 1
            for r in reversed(block):
                coords[r] = (c // stride) % range_size(r) if stride > 1 else c % range_size(r)
                stride *= range_size(r)
            valid = c < size if size % workers else None
            src = idx.substitute(coords)
            if valid is not None:
                src = src.replace(src=(*src.src[:2], valid if len(src.src) < 3 else src.src[2] & valid))
            value = UOp(_LOAD, idx.dtype.base, (src,))
            place = c + at if at else c
            dest = before.index(place)
            if valid is not None: dest = UOp(_INDEX, dest.dtype, (before, place, valid))
            copied = dest.store(value)
            copies.append(UOp(_END, dtypes.void, (copied, j)) if rounds > 1 else copied)
        ready = UOp(_BARRIER, local.dtype, (local, *copies))
        for (idx, block), at in zip(loads, starts):
            staged = ready.index(_linear(block) + at if at else _linear(block))
            for u in ast.toposort():
                if u.op is _LOAD and u.src[0] is idx: replaced[u] = UOp(_LOAD, u.dtype, (staged,))
    return ast.substitute(replaced) if replaced else ast

def _spread_over_group(ast: UOp, loops: list[UOp], g: UOp) -> UOp:
    """Output loops `loops` (that the grouped reductions' results are broadcast along: all the work-items of a group
    hold those results) shared among the work-items of group range `g`: work-item g takes iterations g, g + G, ...
    of the longest one (of each, it would miss the pairs of iterations of different rounds) and all of the others,
    the accesses of the last round gated where G doesn't divide the loop."""
    size = range_size(g)
    for r in sorted(loops, key=lambda r: range_size(r) if isinstance(range_size(r), int) else 0)[-1:]:
        n = range_size(r)
        if not isinstance(n, int) or not isinstance(size, int): continue
        rounds = UOp(_RANGE, r.dtype, (UOp.const(dtypes.index, -(-n // size)),), r.arg)
        pos = rounds * size + g
        ast = ast.substitute({r: pos})
        if n % size == 0: continue
        gated = {u: u.replace(src=(u.src[0], u.src[1], pos < n if len(u.src) < 3 else u.src[2] & (pos < n)))
                 for u in ast.toposort() if u.op is _INDEX and rounds in u.toposort()}
        ast = ast.substitute(gated)
    return ast

def _store_once(ast: UOp, grid: list[UOp]) -> UOp:
    """Every STORE whose address doesn't vary with a launch range (a reduction's result, which all the work-items of
    its group hold) gated to that range's first iteration, so one work-item stores it."""
    gated = {}
    for st in ast.src:
        idx = st.src[0]
        deps = set(idx.toposort())
        missing = [r for r in grid if r not in deps]
        if not missing: continue
        valid = functools.reduce(lambda a, b: a & b, [r < 1 for r in missing])
        if len(idx.src) > 2: valid = idx.src[2] & valid
        gated[st] = st.replace(src=(idx.replace(src=(idx.src[0], idx.src[1], valid)), *st.src[1:]))
    return ast.substitute(gated) if gated else ast

def kernel_name(ast: UOp) -> str:
    """E_<sizes> for elementwise kernels, r_<sizes> when there is a reduction (loop sizes in loop order)."""
    rngs = sorted({u for u in ast.toposort() if u.op is _RANGE}, key=lambda r: r.arg[0])
    prefix = "r" if any(u.op is _REDUCE for u in ast.toposort()) else "E"
    parts = [str(s) if isinstance(s := range_size(r), int) else "".join(c for c in s.render() if c.isalnum())
             for r in rngs]
    return "_".join([prefix] + parts) if parts else prefix
