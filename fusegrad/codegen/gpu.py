"""The launch grid of a GPU-style kernel: its "global" and "local" ranges become the ids of a work-group and of a
work-item in it (SPECIAL gidx<d> and lidx<d>), at most three launch dimensions of each.

Dimension 0 is the innermost range (the one neighbouring work-items differ in, so their memory accesses coalesce).
A kernel with more than three output loops has its outer ones merged into one launch dimension, each recovered from
the merged id by a division and a modulo."""
from __future__ import annotations
import functools
import math
import operator
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import range_kind, range_size
from fusegrad.uop.ops import Ops, UOp

MAX_DIMS = 3

def _ids(rngs: list[UOp], special: UOp) -> dict[UOp, UOp]:
    """Each of `rngs` (outer to inner, merged into one launch dimension) from the dimension's id `special`."""
    out: dict[UOp, UOp] = {}
    stride: int | UOp = 1
    for r in reversed(rngs):
        part = special if isinstance(stride, int) and stride == 1 else special // stride
        out[r] = part if r is rngs[0] else part % range_size(r)
        stride = stride * range_size(r)
    return out

def _largest(size: int | UOp) -> int: return size if isinstance(size, int) else int(size.vmax)

def launch_grid(sink: UOp, global_max: tuple[int, ...] = ()) -> UOp:
    """`sink` with its "global" and "local" ranges replaced by SPECIAL ids (see the module docstring). Where a launch
    dimension could exceed `global_max` (the most work-groups along each dimension: a CUDA grid's y and z have
    65535), all the "global" ranges are merged into dimension 0."""
    topo = sink.toposort()
    subst: dict[UOp, UOp] = {}
    for kind, prefix in (("global", "gidx"), ("local", "lidx")):
        rngs = sorted((u for u in topo if u.op is Ops.RANGE and range_kind(u) == kind), key=lambda r: r.arg[0])
        cut = max(len(rngs) - MAX_DIMS + 1, 1)
        if kind == "global" and global_max and rngs:
            sizes = [math.prod(_largest(range_size(r)) for r in rngs[:cut])]
            sizes += [_largest(range_size(r)) for r in rngs[cut:]]
            if any(n > lim for n, lim in zip(reversed(sizes), global_max)): cut = len(rngs)
        dims = [rngs[:cut], *[[r] for r in rngs[cut:]]] if rngs else []
        for d, group in enumerate(reversed(dims)):
            size = functools.reduce(operator.mul, [range_size(r) for r in group])
            size = size if isinstance(size, UOp) else UOp.const(dtypes.index, size)
            subst.update(_ids(group, UOp(Ops.SPECIAL, dtypes.index, (size,), f"{prefix}{d}")))
    return sink.substitute(subst) if subst else sink

def launch_dims(uops: list[UOp]) -> tuple[tuple, tuple]:
    """(work-groups per launch dimension, work-items per group) of a linearized GPU-style kernel: one entry per
    dimension up to the highest one used, 1 where a dimension has no id (a kernel with none runs one work-item)."""
    sizes: dict[str, int | UOp] = {}
    for u in uops:
        if u.op is Ops.SPECIAL: sizes[u.arg] = range_size(u)
    n = max((int(name[4:]) + 1 for name in sizes), default=1)
    return tuple(sizes.get(f"gidx{d}", 1) for d in range(n)), tuple(sizes.get(f"lidx{d}", 1) for d in range(n))
