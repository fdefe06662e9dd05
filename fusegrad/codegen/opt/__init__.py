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
`axis` indexes `Kernel.loops`: the output loops (outer to inner), then the reduce loops. `amt` 0 means the whole loop.

Range kinds after `get_optimized_ast`: "global" (the outermost output loop, split across cores), "loop", "reduce",
"upcast", "unroll"."""
from __future__ import annotations
import math
from dataclasses import dataclass
from enum import Enum, auto
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import coeff, range_kind, range_size
from fusegrad.uop.ops import Ops, UOp

class OptOps(Enum):
    UPCAST = auto(); UNROLL = auto(); SWAP = auto(); KBLOCK = auto(); SPLIT = auto(); PACK = auto(); PADTO = auto()
    def __repr__(self) -> str: return f"OptOps.{self.name}"

@dataclass(frozen=True)
class Opt:
    """One optimization step; see the module docstring."""
    op: OptOps
    axis: int
    arg: int
    def __repr__(self) -> str: return f"Opt(op={self.op}, axis={self.axis}, arg={self.arg})"

class KernelOptError(Exception):
    """An Opt that doesn't apply to this kernel (bad axis, amount that doesn't divide the loop, ...)."""

def _store_ranges(ast: UOp) -> list[UOp]:
    return [u for st in ast.src for u in st.src[0].toposort() if u.op is Ops.RANGE]

def uniquify_reduce_ranges(ast: UOp) -> UOp:
    """Give REDUCEs that share a RANGE but can't share its loop fresh RANGEs: a REDUCE nested inside another over
    the same RANGE, and sibling REDUCEs whose values vary with different outer ranges (their loops sit in different
    places). Siblings with the same outer ranges keep sharing, so they run in one loop."""
    next_id = max((u.arg[0] for u in ast.toposort() if u.op is Ops.RANGE), default=-1) + 1
    def rename(red: UOp, rngs) -> UOp:
        nonlocal next_id
        fresh = {}
        for r in rngs:
            fresh[r] = UOp(Ops.RANGE, r.dtype, r.src, (next_id, r.arg[1])); next_id += 1
        return red.substitute(fresh)
    while True:
        reds = [u for u in ast.toposort() if u.op is Ops.REDUCE]
        change = None
        for red in reds:
            own = set(red.src[1:])
            inner = [u for u in red.src[0].toposort() if u.op is Ops.REDUCE and own.intersection(u.src[1:])]
            if inner:
                change = (inner[-1], rename(inner[-1], own.intersection(inner[-1].src[1:])))
                break
        if change is None:
            seen: dict[UOp, frozenset[UOp]] = {}
            for red in reds:
                outer = frozenset(x for x in red.src[0].toposort() if x.op is Ops.RANGE) - set(red.src[1:])
                if bad := [r for r in red.src[1:] if r in seen and seen[r] != outer]:
                    change = (red, rename(red, bad))
                    break
                for r in red.src[1:]: seen[r] = outer
        if change is None: return ast
        ast = ast.substitute({change[0]: change[1]})

# a kernel nesting more output loops than this is flattened: C compilers peel and unroll deep nests of short loops
# until they run out of memory (`Tensor.ones(*[2]*24) + 1`: 24 loops of 2, over a minute of gcc)
MAX_OUTPUT_LOOPS = 8

def merge_contiguous_loops(ast: UOp, lanes: int) -> UOp:
    """Adjacent output loops that every memory access addresses as one (the outer loop's coefficient is the inner
    loop's size times the inner's, and neither appears outside the addresses) become one loop of their product
    - when that makes whole vectors of `lanes` where the inner loop alone doesn't: a 1x1 convolution's 28x28 pixels
      are one loop of 784, 49 vectors of 16, where a vector along the rows of 28 was padded to 32. 7x7 images (49
      pixels) keep their rows: the heuristic takes the channels as the vector there, which times faster than merged
      pixels (DESIGN.md, "Loop shapes for CPUs").
      The AST is returned unchanged when an address wouldn't stay affine in the merged loop.
    - always, in a kernel of more than MAX_OUTPUT_LOOPS output loops (a rank-24 elementwise op is one loop); if it
      still has too many, the adjacent loops of the smallest product are merged whatever their addresses (an index
      then divides the merged loop back into its parts)."""
    from fusegrad.uop.symbolic import simplify_indexing
    outs = sorted(set(_store_ranges(ast)), key=lambda r: r.arg[0])
    def whole_vectors(sa: int | UOp, sb: int | UOp) -> bool:
        return isinstance(sa, int) and isinstance(sb, int) and sb % lanes != 0 and (sa * sb) % lanes == 0
    deep = len(outs) > MAX_OUTPUT_LOOPS
    # (most kernels have no such pair: they skip the walks below, which run for every kernel compiled)
    if not deep and (lanes < 2 or not any(whole_vectors(range_size(a), range_size(b)) for a, b in zip(outs, outs[1:]))):
        return ast
    topo = ast.toposort()
    idxs = [u for u in topo if u.op is Ops.INDEX]
    addresses = set(UOp.sink_of(*[idx.src[1] for idx in idxs]).toposort())
    # a loop that a gate or a value uses (a padding check, an iota) keeps its own range
    blocked: set[UOp] = set()
    for u in topo:
        if u.op is Ops.INDEX: uses = [x for g in u.src[2:] for x in g.toposort()]
        elif u in addresses or u.op is Ops.REDUCE: continue
        else: uses = [x for s in u.src if s.op is Ops.RANGE or s in addresses for x in s.toposort()]
        blocked.update(x for x in uses if x.op is Ops.RANGE)
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
            (deep or whole_vectors(sa, sb)) and \
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
        r = new_range[run[0]] = UOp(Ops.RANGE, run[0].dtype, (UOp.const(dtypes.index, size(run)),), run[0].arg)
        stride = size(run)
        for i, x in enumerate(run):
            stride //= range_size(x)
            part = r // stride if stride != 1 else r
            step[x] = part % range_size(x) if i else part
    merged = simplify_indexing(ast.substitute(step))
    if deep: return merged
    idxs = [u for u in merged.toposort() if u.op is Ops.INDEX]
    return ast if any(coeff(idx.src[1], new_range[a]) is None for idx in idxs for a in affine) else merged

class Kernel:
    """A kernel AST with its loops, transformed by `apply_opt` and finalized by `get_optimized_ast`."""
    def __init__(self, ast: UOp, renderer=None):
        if ast.op is not Ops.SINK or any(s.op is not Ops.STORE for s in ast.src):
            raise ValueError(f"a kernel AST is a SINK of STOREs, got {ast.op}")
        lanes = getattr(renderer, "simd_bytes", 0) // 4   # (float32 lanes)
        self.ast, self.renderer = uniquify_reduce_ranges(merge_contiguous_loops(ast, lanes)), renderer
        topo = self.ast.toposort()
        out = sorted(set(_store_ranges(self.ast)), key=lambda r: r.arg[0])
        red: list[UOp] = []
        for u in topo:
            if u.op is Ops.REDUCE: red.extend(r for r in u.src[1:] if r not in red)
        self.loops: list[UOp] = out + red
        self.expanded: list[UOp] = []        # upcast/unroll ranges, in creation order
        self.copies: list[UOp] = []          # loops of PACK copies
        self.packed: set[int] = set()        # ids of the output loops a PACK copy's layout is fixed along
        self.applied_opts: list[Opt] = []
        self.useful = 1.0                    # the fraction of the loop iterations that aren't padding (PADTO)
        self.next_id = max((u.arg[0] for u in topo if u.op is Ops.RANGE), default=-1) + 1
        self.reduceops = [u for u in topo if u.op is Ops.REDUCE]
        # a kernel storing to addresses it loads (a scatter) runs its loop in order on one core, as written: two
        # iterations may hit one address, and the later one must see the earlier one's write
        self.in_order = any(u.op is Ops.LOAD for st in self.ast.src for u in st.src[0].toposort())

    # *** queries ***

    @property
    def first_reduce(self) -> int: return sum(1 for r in self.loops if range_kind(r) != "reduce")
    def output_axes(self) -> list[int]: return list(range(self.first_reduce))
    def reduce_axes(self) -> list[int]: return list(range(self.first_reduce, len(self.loops)))
    def size(self, axis: int) -> int | UOp: return range_size(self.loops[axis])
    def accesses(self) -> list[tuple[UOp, bool]]:
        """Every memory INDEX of the kernel with whether it is stored to."""
        stores = {st.src[0] for st in self.ast.src}
        return [(u, u in stores) for u in self.ast.toposort() if u.op is Ops.INDEX]

    # *** transformations ***

    def _split(self, axis: int, amt: int, kind: str) -> UOp:
        """Split `amt` off the inside of loop `axis` as a new range of `kind` ("loop": `amt` is the outer part)."""
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
        if amt == size:
            outer, expr = None, inner
            self.loops.pop(axis)
        else:
            outer = UOp.range(size // amt, r.arg[0], r.arg[1])
            expr = outer * amt + inner
            self.loops[axis] = outer
        if kind == "loop":
            self.loops.insert(axis + 1, inner)
            if r.arg[0] in self.packed: self.packed.add(inner.arg[0])
        else: self.expanded.append(inner)
        # REDUCEs list their ranges as sources: there r becomes (outer, inner); in index math it becomes expr
        replaced: dict[UOp, UOp] = {}
        for u in self.ast.toposort():
            if u is r: replaced[u] = expr; continue
            if u.op is Ops.REDUCE and r in u.src[1:]:
                split_r = ([outer] if outer is not None else []) + [inner]
                rngs = [x for s in u.src[1:] for x in (split_r if s is r else [s])]
                replaced[u] = u.replace(src=(replaced[u.src[0]], *rngs)); continue
            new_src = tuple(replaced[s] for s in u.src)
            replaced[u] = u if new_src == u.src else u.replace(src=new_src)
        self.ast = replaced[self.ast]
        return inner

    def apply_opt(self, opt: Opt) -> UOp | None:
        """Apply one Opt (raises KernelOptError if it doesn't fit); returns the new expanded range, if any."""
        if self.in_order: raise KernelOptError("a kernel storing to loaded addresses runs its loop as written")
        if not 0 <= opt.axis < len(self.loops): raise KernelOptError(f"no axis {opt.axis} in {len(self.loops)} loops")
        ret = None
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
        else: raise KernelOptError(f"unknown opt {opt.op}")
        self.applied_opts.append(opt)
        return ret

    def _padto(self, axis: int, amt: int) -> None:
        r = self.loops[axis]
        size = range_size(r)
        if axis >= self.first_reduce: raise KernelOptError("PADTO needs an output axis")
        if not isinstance(size, int) or amt < 2 or size % amt == 0: raise KernelOptError(f"can't pad {size} to {amt}")
        padded = UOp.range(-(-size // amt) * amt, r.arg[0], r.arg[1])
        ast = self.ast.substitute({r: padded})
        # every access that varies with the loop is gated, so the padded iterations neither read nor write memory
        inside = padded < size
        gated = {}
        for u in ast.toposort():
            if u.op is Ops.INDEX and padded in u.toposort():
                valid = inside if len(u.src) < 3 else u.src[2] & inside
                gated[u] = u.replace(src=(u.src[0], u.src[1], valid))
        self.ast = ast.substitute(gated)
        self.loops[axis] = padded
        self.useful *= size / range_size(padded)

    def kblock_reduce(self, axis: int) -> UOp:
        """The REDUCE that KBLOCK of reduce loop `axis` would block, or KernelOptError saying why it can't."""
        r = self.loops[axis]
        if range_kind(r) != "reduce": raise KernelOptError("KBLOCK needs a reduce loop")
        if len(self.ast.src) != 1: raise KernelOptError("KBLOCK needs a single STORE")
        idx, value = self.ast.src[0].src[:2]
        reds = [u for u in value.toposort() if u.op is Ops.REDUCE]
        over = [u for u in reds if r in u.src[1:]]
        if len(over) != 1 or over[0].dtype != idx.src[0].dtype.base or over[0].arg not in (Ops.ADD, Ops.MAX, Ops.MUL):
            raise KernelOptError("KBLOCK needs the stored value to hold one REDUCE over the axis, in the output dtype")
        # (an epilogue is computed for every block: another reduction in it would be computed that many times)
        inside = over[0].toposort()
        if any(u is not over[0] and u not in inside for u in reds):
            raise KernelOptError("KBLOCK needs a stored value without other reductions")
        if any(u.op is Ops.INDEX and u.src[0] is idx.src[0] and u is not idx for u in self.ast.toposort()) or \
                any(u.op is Ops.LOAD and u.src[0] is idx for u in value.toposort()):
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
        part = UOp(Ops.REDUCE, red.dtype, (red.src[0].substitute({r: blk * amt + inner}), *rngs), red.arg)
        prev = (blk < 1).where(identity_element(red.arg, red.dtype), idx.load())
        acc = part.alu(red.arg, prev)
        # an epilogue after the reduction (a convolution's batch norm and relu) is applied by the last block only:
        # the blocks before it store the bare partial result
        stored = acc if value is red else (blk < size // amt - 1).where(acc, value.substitute({red: acc}))
        self.ast = UOp.sink_of(st.replace(src=(idx, stored) + st.src[2:]))
        self.loops[axis] = inner
        self.loops.insert(1, blk)

    MAX_LOCAL_BYTES = 64 * 1024

    def _pack(self, axis: int, buf_arg: int) -> None:
        if axis >= self.first_reduce: raise KernelOptError("PACK needs an output axis")
        idxs = {u for u in self.ast.toposort() if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL
                and u.src[0].arg == buf_arg}
        if len(idxs) != 1: raise KernelOptError(f"PACK needs exactly one access to buffer {buf_arg}")
        idx = idxs.pop()
        if any(u.op is Ops.STORE and u.src[0] is idx for u in self.ast.toposort()): raise KernelOptError("stored")
        outs = self.loops[:self.first_reduce]
        deps = {u for u in idx.toposort() if u.op is Ops.RANGE}
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
        loads = {u for u in topo if u.op is Ops.LOAD and u.src[0] is idx}
        users = [u for u in topo for x in u.src if x in loads]
        casts = {u for u in users if u.op is Ops.CAST}
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
        local = UOp(Ops.DEFINE_LOCAL, elem.ptr(n, "local"), arg=len(self.copies))
        value = UOp(Ops.LOAD, idx.dtype.base, (idx.substitute(fresh),))
        copy = local.index(lin.substitute(fresh)).store(value.cast(to) if to is not None else value)
        ready = UOp(Ops.BARRIER, local.dtype, (local, UOp(Ops.END, dtypes.void, (copy, *fresh.values()))))
        replaced = casts if to is not None else loads
        self.packed |= packed
        self.ast = self.ast.substitute({u: UOp(Ops.LOAD, u.dtype, (ready.index(lin),)) for u in replaced})

    def get_optimized_ast(self) -> UOp:
        """The AST with ranges renumbered in loop order and their final kinds: the outermost output loop becomes
        "global" (split across cores) when every STORE depends on it."""
        outs = self.loops[:self.first_reduce]
        parallel = bool(outs) and not self.in_order and all(outs[0] in st.src[0].toposort() for st in self.ast.src)
        mapping: dict[UOp, UOp] = {}
        for i, r in enumerate(self.loops + self.expanded + self.copies):
            kind = "global" if i == 0 and parallel else range_kind(r)
            mapping[r] = UOp(Ops.RANGE, r.dtype, r.src, (i, kind))
        return self.ast.substitute(mapping)

def kernel_name(ast: UOp) -> str:
    """E_<sizes> for elementwise kernels, r_<sizes> when there is a reduction (loop sizes in loop order)."""
    rngs = sorted({u for u in ast.toposort() if u.op is Ops.RANGE}, key=lambda r: r.arg[0])
    prefix = "r" if any(u.op is Ops.REDUCE for u in ast.toposort()) else "E"
    parts = [str(s) if isinstance(s := range_size(r), int) else "".join(c for c in s.render() if c.isalnum())
             for r in rngs]
    return "_".join([prefix] + parts) if parts else prefix
