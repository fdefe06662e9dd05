"""Hand-coded optimization heuristics for CPUs: vectorize a contiguous axis, register-tile matmul-like kernels, split
long reductions into partial accumulators."""
from __future__ import annotations
import os
from fusegrad.codegen.affine import coeff, range_size
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.uop.ops import UOp

def _largest_divisor(n: int, choices: tuple[int, ...]) -> int:
    return next((c for c in choices if n % c == 0), 1)

def hand_coded_optimizations(k: Kernel) -> list[Opt]:
    """Choose and apply opts to `k`; returns them (also in k.applied_opts)."""
    ren = k.renderer
    if not k.reduceops: return []  # elementwise: a plain contiguous inner loop is what gcc vectorizes best
    acc_dt = k.reduceops[-1].dtype
    vec_dts = getattr(ren, "vector_dtypes", ())
    width = getattr(ren, "simd_bytes", 0) // acc_dt.itemsize if acc_dt in vec_dts else 0
    budget = max(getattr(ren, "vector_registers", 16) // 2, 4)   # accumulators kept in registers

    def split(op: OptOps, r: UOp, amt: int) -> tuple[UOp | None, UOp | None]:
        """Apply op to loop r: (the remaining outer loop or None, the new inner range or None if it didn't apply)."""
        idx, n = k.loops.index(r), len(k.loops)
        try: inner = k.apply_opt(Opt(op, idx, amt))
        except KernelOptError: return r, None
        return (k.loops[idx] if len(k.loops) == n else None), inner

    def strides(r: UOp) -> list[tuple[int | None, bool]]:
        return [(coeff(idx.src[1], r), is_store) for idx, is_store in k.accesses()]

    outs = [k.loops[i] for i in k.output_axes()]
    reds = [k.loops[i] for i in k.reduce_axes()]

    # 1. vectorize along an output axis that is contiguous in the output and contiguous or broadcast in every load
    vec_out = None
    if width >= 2:
        for r in reversed(outs):
            sz = range_size(r)
            if not isinstance(sz, int) or sz % width: continue
            st = strides(r)
            if all(c == 1 for c, is_store in st if is_store) and all(c in (0, 1) for c, _ in st) and \
                    any(c == 1 for c, is_store in st if not is_store):
                vec_out = r
                break
    if vec_out is not None:
        rest, inner = split(OptOps.UPCAST, vec_out, width)
        if inner is None: return k.applied_opts
        # 2. register tiling: upcast another output axis whose lanes share a vector load (a load that doesn't
        #    depend on it), and take a second vector along the vectorized axis
        loads = [idx for idx, is_store in k.accesses() if not is_store]
        reuse = [r for r in k.loops[:k.first_reduce] if r is not rest and isinstance(range_size(r), int) and
                 any(coeff(idx.src[1], r) == 0 and coeff(idx.src[1], inner) == 1 for idx in loads)]
        # with reuse, two vectors wide and as many rows as fit; without, several vectors so each row of the
        # reduction is read in longer contiguous runs
        n_vec = 1
        if rest is not None and isinstance(sz := range_size(rest), int):
            n_vec = _largest_divisor(sz, (2,) if reuse else tuple(c for c in (8, 4, 2) if c <= budget))
            if n_vec > 1:
                rest, inner2 = split(OptOps.UPCAST, rest, n_vec)
                if inner2 is None: n_vec = 1
        if reuse:
            r = reuse[-1]
            amt = _largest_divisor(range_size(r), tuple(c for c in (8, 6, 4, 3, 2) if c * n_vec <= budget))
            if amt > 1: split(OptOps.UPCAST, r, amt)
        # 3. matmul-like: the columns of the vectorized axis go outermost (split across cores), so the slice of the
        #    broadcast input they need is reused by every row tile; long reductions are blocked through the output
        #    so that slice stays in cache
        if reuse and rest is not None and rest in k.loops and isinstance(range_size(rest), int) and \
                range_size(rest) >= 2 and k.loops.index(rest) != 0:
            k.apply_opt(Opt(OptOps.SWAP, 0, k.loops.index(rest)))
        # a reduction over a strided axis with no reuse (a column sum): rows are read in blocks, each block added
        # to the output, so every row is read once, contiguously, by the core that owns its columns
        if not reuse and len(k.reduceops) == 1:
            red_rngs = [k.loops[i] for i in k.reduce_axes()]
            if len(red_rngs) == 1 and isinstance(rsz := range_size(red_rngs[0]), int) and rsz >= 64 and \
                    rsz % 8 == 0 and all(c not in (0, 1) for c, st in strides(red_rngs[0]) if not st):
                if k.first_reduce == 1 and isinstance(osz := range_size(k.loops[0]), int):
                    # one chunk of columns per core: the longest contiguous runs per row
                    cores = os.cpu_count() or 2
                    chunks = next((t for t in (cores, 2 * cores, 4 * cores) if osz % t == 0 and osz > t), None)
                    if chunks is not None: k.apply_opt(Opt(OptOps.SPLIT, 0, chunks))
                if k.first_reduce >= 2:
                    try: k.apply_opt(Opt(OptOps.KBLOCK, k.loops.index(red_rngs[0]), _largest_divisor(rsz, (32, 16, 8))))
                    except KernelOptError: pass
        if reuse:
            for r in [k.loops[i] for i in k.reduce_axes()]:
                if isinstance(sz := range_size(r), int) and sz > 384:
                    blk = next((b for b in (256, 192, 128) if sz % b == 0), None)
                    if blk is not None:
                        try: k.apply_opt(Opt(OptOps.KBLOCK, k.loops.index(r), blk))
                        except KernelOptError: pass
                break
        # 4. unroll the reduce a little so each accumulator gets a short chain of multiply-adds per iteration
        for r in [k.loops[i] for i in k.reduce_axes()]:
            if isinstance(sz := range_size(r), int) and sz % 4 == 0 and sz >= 8:
                split(OptOps.UNROLL, r, 4)
                break
        return k.applied_opts

    # 5. no vectorizable output axis: vectorize the reduction itself with partial accumulators along an axis that
    #    is contiguous in every load that depends on it
    if width >= 2 and len(k.reduceops) == 1:
        for r in reversed(reds):
            sz = range_size(r)
            if not isinstance(sz, int) or sz % width or not all(c in (0, 1) for c, _ in strides(r)): continue
            rem, inner = split(OptOps.UPCAST, r, width)
            if inner is None: continue
            # a few vector accumulators hide the latency of the adds
            if rem is not None and isinstance(rs := range_size(rem), int):
                if (extra := _largest_divisor(rs, (4, 2))) > 1 and rs >= 2 * extra: split(OptOps.UPCAST, rem, extra)
            # matrix-vector: an output axis that some load doesn't depend on shares that load across its lanes
            for o in reversed(outs):
                if isinstance(osz := range_size(o), int) and any(c == 0 for c, st in strides(o) if not st):
                    if (amt := _largest_divisor(osz, (4, 2))) > 1: split(OptOps.UPCAST, o, amt)
                    break
            return k.applied_opts
    return k.applied_opts
