"""Sharded tensors: one UOp per shard, collectives as kernels and copies.

A tensor on several devices is `MULTI(shard_0, ..., shard_n-1)` with the split axis as arg (None: every source is a
whole replica). Each source is an ordinary single-device graph, so everything downstream (fusion, codegen, autodiff)
sees only single-device graphs: an operation applied to a MULTI is rewritten at once, when its Tensor is made, into
one operation per shard (`to_multi`). What crosses devices becomes COPY nodes:
  - a reduction over the split axis reduces each shard, then all-reduces the partial results (a ring of copies and
    adds for big tensors, every device adding all the copies in the same order for small ones), giving replicas;
  - a movement over the split axis (shrink, pad, flip, or a reshape that does not keep shards whole) re-splits the
    result evenly, each new shard assembled from the pieces of the old shards it covers;
  - operands with different layouts are brought to one layout the same way (a replica is just shrunk).
Replicas are always computed identically (same operations in the same order), so they stay bitwise equal.

A graph whose DEVICE has a tuple of devices and no MULTI (constants, `arange`, random numbers made for a sharded
tensor) is a replica made lazily: each device gets the same graph on its own DEVICE."""
from __future__ import annotations
from typing import Callable
from fusegrad.dtype import dtypes
from fusegrad.helpers import prod
from fusegrad.schedule.simplify import const_view
from fusegrad.uop.ops import GroupOp, Ops, UOp

Bounds = tuple[tuple[int, int], ...]

def shard_bounds(size: int, n: int) -> Bounds:
    """Where `size` elements split into `n` shards: equal ones of ceil(size/n), the last ones smaller or empty."""
    step = -(-size // n) if n else 0
    return tuple((min(i * step, size), min((i + 1) * step, size)) for i in range(n))

def multi_bounds(m: UOp) -> Bounds | None:
    """The ranges of the split axis each shard of a MULTI holds (None for replicas)."""
    if m.arg is None: return None
    out, start = [], 0
    for s in m.src:
        out.append((start, start + s.shape[m.arg]))
        start += s.shape[m.arg]
    return tuple(out)

def devices_of(m: UOp) -> tuple[str, ...]: return tuple(s.device for s in m.src)

def shards_of(u: UOp) -> tuple[UOp, ...]:
    """The single-device graphs behind a tensor's node: a MULTI's shards, or the node itself."""
    return u.src if u.op is _MULTI else (u,)

def _device(d: str) -> UOp: return UOp(Ops.DEVICE, arg=d)

def _graph_flag(u: UOp, name: str, own: Callable[[UOp], bool]) -> bool:
    """Whether `own` holds for any node of `u`'s graph, memoized per node under `name`."""
    d = u.__dict__
    if name in d: return d[name]
    if all(name in s.__dict__ for s in u.src):  # the common case: a new node over known ones
        d[name] = own(u) or any(s.__dict__[name] for s in u.src)
        return d[name]
    for x in u.toposort(gate=lambda x: name not in x.__dict__):
        if name not in x.__dict__: x.__dict__[name] = own(x) or any(s.__dict__[name] for s in x.src)
    return d[name]

def _needs_multi(u: UOp) -> bool:
    """Whether `u`'s graph holds a MULTI or a DEVICE of several devices."""
    return _graph_flag(u, "_multi", lambda x: x.op is Ops.MULTI or (x.op is Ops.DEVICE and isinstance(x.arg, tuple)))

def needs_multi(u: UOp) -> bool:
    """A graph that `to_multi` must rewrite: an operation over a MULTI, or a lazy replica not split yet."""
    return u.op is not Ops.MULTI and _needs_multi(u)

def _tuple_device(u: UOp) -> tuple[str, ...] | None:
    for x in u.toposort():
        if x.op is Ops.DEVICE and isinstance(x.arg, tuple): return x.arg
    return None

def replicate(u: UOp, devices: tuple[str, ...]) -> UOp:
    """A single-device or tuple-device graph as replicas on `devices`: a graph without buffers (constants, ranges) is
    rebuilt on each device, anything else is copied."""
    if u.op is Ops.MULTI: return relayout(u, devices, None)
    tdev = _tuple_device(u)
    if tdev is not None:
        if tuple(tdev) != tuple(devices):
            raise ValueError(f"tensors are on different devices: {tdev} and {devices}")
        return UOp(Ops.MULTI, u.dtype, tuple(u.substitute({_device(tdev): _device(d)}) for d in devices), None)
    return shard_uop(u, devices, None)

_MEMORY_OPS = {Ops.BUFFER, Ops.COPY, Ops.ASSIGN, Ops.KERNEL, Ops.MULTI}
_MULTI = Ops.MULTI   # (a module name: an Ops.X lookup costs ~0.1 us, and every tensor operation asks)

def _rebuildable(u: UOp) -> bool:
    """A graph with no memory behind it: made anew on another device instead of copied."""
    return not _graph_flag(u, "_memory", lambda x: x.op in _MEMORY_OPS)

def _copy_to(u: UOp, device: str) -> UOp:
    if u.device == device: return u
    if _rebuildable(u): return u.substitute({_device(u.device): _device(device)})
    return UOp(Ops.COPY, u.dtype, (u, _device(device)))

def _shrink_axis(u: UOp, axis: int, lo: int, hi: int) -> UOp:
    if (lo, hi) == (0, u.shape[axis]): return u
    return u.shrink(tuple((lo, hi) if i == axis else (0, s) for i, s in enumerate(u.shape)))

def _pad_axis(u: UOp, axis: int, before: int, after: int) -> UOp:
    if before == 0 and after == 0: return u
    return u.pad(tuple((before, after) if i == axis else (0, 0) for i in range(len(u.shape))))

def _cat(parts: list[UOp], axis: int, like: UOp, device: str, shape: tuple[int, ...]) -> UOp:
    """The parts (on one device) joined along `axis`: each padded to the whole extent and selected by position (a
    select rather than a sum, so -0.0 stays -0.0)."""
    parts = [p for p in parts if p.shape[axis] != 0]
    if not parts: return const_view(0, like.dtype, _device(device), shape)  # an empty shard
    if len(parts) == 1: return parts[0]
    total = sum(p.shape[axis] for p in parts)
    full = tuple(total if i == axis else d for i, d in enumerate(parts[0].shape))
    position = UOp(Ops.RANGE, dtypes.int32, (_device(device),), total)
    position = position.reshape(tuple(total if i == axis else 1 for i in range(len(full)))).expand(full)
    out, start = None, 0
    for p in parts:
        n = p.shape[axis]
        p = _pad_axis(p, axis, start, total - start - n)
        out = p if out is None else position.alu(Ops.CMPLT, const_view(start, dtypes.int32, _device(device), full)) \
            .where(out, p)
        start += n
    return out

def gather_region(m: UOp, axis: int, lo: int, hi: int, device: str) -> UOp:
    """Elements lo..hi along `axis` of the whole tensor `m` (a MULTI), assembled on `device` from the shards that hold
    them: each piece shrunk where it lies, then copied."""
    if m.arg is None: return _copy_to(_shrink_axis(_replica_for(m, device), axis, lo, hi), device)
    a = m.arg
    parts = []
    for s, (b0, b1) in zip(m.src, multi_bounds(m)):
        if a == axis:
            p0, p1 = max(lo, b0), min(hi, b1)
            if p1 <= p0: continue
            parts.append(_copy_to(_shrink_axis(s, a, p0 - b0, p1 - b0), device))
        else:
            if b1 <= b0: continue
            parts.append(_copy_to(_shrink_axis(s, axis, lo, hi), device))
    shape = tuple(hi - lo if i == axis else d for i, d in enumerate(m.shape))
    return _cat(parts, a, m, device, shape)

def shard_uop(u: UOp, devices: tuple[str, ...], axis: int | None, bounds: Bounds | None = None) -> UOp:
    """`u` (one device, or a MULTI) laid out on `devices`: split along `axis` (by `bounds`, default even), or
    replicated."""
    if u.op is Ops.MULTI: return relayout(u, devices, axis, bounds)
    if axis is not None and bounds is None: bounds = shard_bounds(u.shape[axis], len(devices))
    if axis is None: return UOp(Ops.MULTI, u.dtype, tuple(_copy_to(u, d) for d in devices), None)
    return UOp(Ops.MULTI, u.dtype, tuple(_copy_to(_shrink_axis(u, axis, lo, hi), d)
                                         for d, (lo, hi) in zip(devices, bounds)), axis)

def relayout(m: UOp, devices: tuple[str, ...], axis: int | None, bounds: Bounds | None = None) -> UOp:
    """A MULTI re-split: along `axis` by `bounds` (default even) on `devices`, or replicated there. Each new shard is
    assembled from the pieces of the old shards it covers; a layout that is already right is returned as is."""
    if axis is not None and bounds is None: bounds = shard_bounds(m.shape[axis], len(devices))
    if tuple(devices) == devices_of(m) and axis == m.arg and (axis is None or bounds == multi_bounds(m)): return m
    if axis is None: return UOp(Ops.MULTI, m.dtype, tuple(gather(m, d) for d in devices), None)
    return UOp(Ops.MULTI, m.dtype, tuple(gather_region(m, axis, lo, hi, d) for d, (lo, hi) in zip(devices, bounds)),
               axis)

def _replica_for(m: UOp, device: str) -> UOp:
    """The replica of a replicated MULTI to read on `device`: its own if it has one, else the first."""
    return next((s for s in m.src if s.device == device), m.src[0])

def gather(m: UOp, device: str) -> UOp:
    """The whole tensor `m` (a MULTI) on one device."""
    if m.arg is None: return _copy_to(_replica_for(m, device), device)
    return gather_region(m, m.arg, 0, m.shape[m.arg], device)

# *** all-reduce ***

RING_MIN_ELEMENTS = 1 << 14  # below this, the ring's extra steps cost more than the bytes it saves

def all_reduce(parts: list[UOp], op: Ops) -> list[UOp]:
    """Every device's partial result combined with `op` (ADD, MAX, MUL), the total on every device.

    Two devices, or small tensors: the first device combines copies of all partial results, then sends the total to
    the others (2(n-1) copies and one kernel). Big tensors over three or more devices go round a ring: each chunk is
    combined on its way round the devices, then the combined chunks are passed round, so no device moves more than
    about twice its data. Every value is combined once and copied, so the replicas are bitwise equal."""
    n = len(parts)
    if n == 1: return parts
    devs = [p.device for p in parts]
    combine: Callable[[UOp, UOp], UOp] = lambda a, b: a.alu(op, b)
    numel = prod(parts[0].shape)
    if n == 2 or numel < max(RING_MIN_ELEMENTS, n):
        total = parts[0]
        for p in parts[1:]: total = combine(total, _copy_to(p, devs[0]))
        return [total] + [_copy_to(total, d) for d in devs[1:]]
    shape = parts[0].shape
    flat = [p.reshape((numel,)) for p in parts]
    chunks = shard_bounds(numel, n)
    reduced = []
    for c, (lo, hi) in enumerate(chunks):
        # chunk c starts on device c+1 and ends, combined over all devices, on device c
        acc = _shrink_axis(flat[(c + 1) % n], 0, lo, hi)
        for k in range(2, n + 1):
            dev = (c + k) % n
            acc = combine(_copy_to(acc, devs[dev]), _shrink_axis(flat[dev], 0, lo, hi))
        reduced.append(acc)
    return [_cat([_copy_to(r, d) for r in reduced if r.shape[0]], 0, parts[0], d, (numel,)).reshape(shape)
            for d in devs]

# *** the rewrite of operations over MULTIs ***

def _same_layout(srcs: list[UOp], like: UOp) -> list[tuple[UOp, ...]]:
    """The shards of each of `srcs` in the layout of `like` (so that shard i of each lies on one device)."""
    devs, bounds = devices_of(like), multi_bounds(like)
    out = []
    for s in srcs:
        if s.arg == like.arg and devices_of(s) == devs and multi_bounds(s) == bounds: out.append(s.src)
        elif s.arg is None and devices_of(s) == devs:
            out.append(tuple(_shrink_axis(x, like.arg, lo, hi) for x, (lo, hi) in zip(s.src, bounds)))
        else: out.append(relayout(s, devs, like.arg, bounds).src)
    return out

def _per_shard(u: UOp, srcs: list[UOp], like: UOp) -> UOp:
    shards = _same_layout(srcs, like)
    return UOp(Ops.MULTI, u.dtype, tuple(u.replace(src=tuple(s[i] for s in shards)) for i in range(len(like.src))),
               like.arg)

def _elementwise(u: UOp, srcs: list[UOp]) -> UOp:
    like = next((s for s in srcs if s.arg is not None), srcs[0])
    return _per_shard(u, srcs, like)

def _reduce(u: UOp, m: UOp) -> UOp:
    op, axes = u.arg
    parts = [s.r(op, axes) for s in m.src]
    if m.arg is None or m.arg not in axes: return UOp(Ops.MULTI, u.dtype, tuple(parts), m.arg)
    return UOp(Ops.MULTI, u.dtype, tuple(all_reduce(parts, op)), None)

def _reshape(u: UOp, m: UOp) -> UOp:
    if m.arg is None: return UOp(Ops.MULTI, u.dtype, tuple(s.reshape(u.arg) for s in m.src), None)
    a, old, new = m.arg, m.shape, u.arg
    before, after = prod(old[:a]), prod(old[a + 1:])
    for na in range(len(new)):
        if prod(new[:na]) != before or new[na] == 1 and old[a] != 1: continue
        rest = prod(new[na + 1:])
        sizes = [s.shape[a] * after for s in m.src]
        if rest == 0 or any(x % rest for x in sizes): continue
        shards = tuple(s.reshape(tuple(x // rest if i == na else d for i, d in enumerate(new)))
                       for s, x in zip(m.src, sizes))
        return UOp(Ops.MULTI, u.dtype, shards, na)
    # the shards don't stay whole (e.g. the split axis merges with an axis before it): replicate, then reshape
    return UOp(Ops.MULTI, u.dtype, tuple(s.reshape(new) for s in relayout(m, devices_of(m), None).src), None)

def _resplit(m: UOp, new_shape: tuple[int, ...], make: Callable[[int, int, str], UOp], dtype) -> UOp:
    """A MULTI of `new_shape` split evenly along m's axis, shard i built by make(lo, hi, device)."""
    a = m.arg
    bounds = shard_bounds(new_shape[a], len(m.src))
    return UOp(Ops.MULTI, dtype, tuple(make(lo, hi, d) for (lo, hi), d in zip(bounds, devices_of(m))), a)

def _movement(u: UOp, m: UOp) -> UOp:
    a, op, arg = m.arg, u.op, u.arg
    if op is Ops.RESHAPE: return _reshape(u, m)
    if op is Ops.PERMUTE:
        return UOp(Ops.MULTI, u.dtype, tuple(s.permute(arg) for s in m.src), None if a is None else arg.index(a))
    if a is None: return UOp(Ops.MULTI, u.dtype, tuple(UOp(op, u.dtype, (s,), arg) for s in m.src), None)
    if op is Ops.EXPAND:
        if arg[a] != m.shape[a]: raise ValueError(f"can't expand split axis {a} of a sharded tensor {m.shape} to {arg}")
        return UOp(Ops.MULTI, u.dtype, tuple(s.expand(tuple(s.shape[a] if i == a else d for i, d in enumerate(arg)))
                                             for s in m.src), a)
    if op is Ops.SHRINK:
        lo, hi = arg[a]
        whole = tuple((0, s) if i == a else p for i, (p, s) in enumerate(zip(arg, m.shape)))
        if (lo, hi) == (0, m.shape[a]):
            return UOp(Ops.MULTI, u.dtype, tuple(s.shrink(tuple((0, s.shape[a]) if i == a else p for i, p in
                                                                enumerate(whole))) for s in m.src), a)
        def shrink_piece(x0: int, x1: int, d: str) -> UOp:
            g = gather_region(m, a, lo + x0, lo + x1, d)
            return g.shrink(tuple((0, x1 - x0) if i == a else p for i, p in enumerate(whole)))
        return _resplit(m, u.shape, shrink_piece, u.dtype)
    if op is Ops.PAD:
        pl, pr = arg[a]
        rest = tuple((0, 0) if i == a else p for i, p in enumerate(arg))
        if (pl, pr) == (0, 0): return UOp(Ops.MULTI, u.dtype, tuple(s.pad(rest) for s in m.src), a)
        n = m.shape[a]
        def pad_piece(x0: int, x1: int, d: str) -> UOp:
            t0, t1 = min(max(0, x0 - pl), n), min(max(0, x1 - pl), n)
            g = gather_region(m, a, t0, max(t0, t1), d)
            before = min(max(0, pl - x0), x1 - x0)
            return g.pad(tuple((before, (x1 - x0) - before - (max(t0, t1) - t0)) if i == a else p
                               for i, p in enumerate(rest)))
        return _resplit(m, u.shape, pad_piece, u.dtype)
    if op is Ops.FLIP:
        if not arg[a]: return UOp(Ops.MULTI, u.dtype, tuple(s.flip(arg) for s in m.src), a)
        n = m.shape[a]
        return _resplit(m, u.shape, lambda x0, x1, d: gather_region(m, a, n - x1, n - x0, d).flip(arg), u.dtype)
    raise NotImplementedError(f"{op} on a sharded tensor")

def _multi_rule(u: UOp, srcs: list[UOp]) -> UOp:
    """`u` over its (rewritten) sources, at least one of them a MULTI: one `u` per shard, collectives where needed."""
    like = next(s for s in srcs if s.op is Ops.MULTI)
    devs = devices_of(like)
    fixed = []
    for s in srcs:
        if s.op is Ops.MULTI:
            if len(s.src) != len(devs): raise ValueError(f"tensors are on different devices: {devs} and "
                                                          f"{devices_of(s)}")
            fixed.append(s)
        elif s.op is Ops.DEVICE: fixed.append(s)
        elif _tuple_device(s) is not None: fixed.append(replicate(s, devs))
        else: raise ValueError(f"tensors are on different devices: {s.device} and {devs}")
    srcs = fixed
    op = u.op
    if op in GroupOp.Elementwise or op in (Ops.CONTIGUOUS, Ops.DETACH, Ops.CONTIGUOUS_BACKWARD):
        return _elementwise(u, srcs)
    if op is Ops.ASSIGN: return _per_shard(u.replace(arg=None), srcs, srcs[0])
    if op is Ops.REDUCE_AXIS: return _reduce(u, srcs[0])
    if op in GroupOp.Movement: return _movement(u, srcs[0])
    if op is Ops.COPY:
        target = srcs[1].arg
        if isinstance(target, tuple): return relayout(srcs[0], target, srcs[0].arg)
        return gather(srcs[0], target)
    if op is Ops.CUSTOM_GRAD:
        # the value and the inputs shard alike (e.g. a convolution with the batch split and the weight replicated)
        ms = [s for s in srcs if s.op is Ops.MULTI]
        if len(ms) != len(srcs): raise NotImplementedError("a custom gradient over sharded and unsharded tensors")
        if getattr(u.arg, "elementwise", False):
            # a rule over inputs of the value's own shape (clamp, pow) reads them element by element: laid out as the
            # value is, each shard's rule sees matching shards
            srcs = [s if s.arg == srcs[0].arg else relayout(s, devs, srcs[0].arg, multi_bounds(srcs[0])) for s in srcs]
        return UOp(Ops.MULTI, u.dtype, tuple(u.replace(src=tuple(s.src[i] for s in srcs)) for i in range(len(devs))),
                   srcs[0].arg)
    raise NotImplementedError(f"{op} is not supported on sharded tensors")

def to_multi(root: UOp) -> UOp:
    """`root` with every operation over a MULTI rewritten into one per shard: the result is a MULTI whose sources are
    single-device graphs."""
    new: dict[UOp, UOp] = {}
    for u in root.toposort(gate=lambda x: x.op is not Ops.MULTI and _needs_multi(x)):
        if u.op is Ops.MULTI or u.op is Ops.DEVICE or not _needs_multi(u): new[u] = u; continue
        srcs = [new[s] for s in u.src]
        if any(s.op is Ops.MULTI for s in srcs): new[u] = _multi_rule(u, srcs)
        else: new[u] = u if all(a is b for a, b in zip(srcs, u.src)) else u.replace(src=tuple(srcs))
    ret = new[root]
    if ret.op is not Ops.MULTI and (tdev := _tuple_device(ret)) is not None: ret = replicate(ret, tdev)
    return ret

# *** gradients ***

def gradient_seeds(root: UOp, seed: UOp) -> dict[UOp, UOp]:
    """The roots and seeds for differentiating `root`: a sharded root's shards seeded with the matching shards of
    `seed`. Of replicas only the first is seeded: each replica is the whole value, so seeding all would count it n
    times."""
    if root.op is not Ops.MULTI: return {root: seed}
    seed = relayout(seed if seed.op is Ops.MULTI else replicate(seed, devices_of(root)), devices_of(root), root.arg,
                    multi_bounds(root))
    if root.arg is None: return {root.src[0]: seed.src[0]}
    return dict(zip(root.src, seed.src))

def gradient_targets(targets: list[UOp]) -> set[UOp]:
    """The nodes to differentiate with respect to: a sharded target's shards."""
    return {s for t in targets for s in shards_of(t)}

def gradient_of(target: UOp, grads: dict[UOp, UOp]) -> UOp | None:
    """A target's gradient from its shards' (None if none has one): shards of a split tensor get their own
    gradients, replicas the sum of all replicas' gradients (the all-reduce of data-parallel training)."""
    if target.op is not Ops.MULTI: return grads.get(target)
    gs = [grads.get(s) for s in target.src]
    if all(g is None for g in gs): return None
    gs = [g if g is not None else const_view(0, s.dtype, _device(s.device), s.shape) for g, s in zip(gs, target.src)]
    if target.arg is not None: return UOp(Ops.MULTI, target.dtype, tuple(gs), target.arg)
    return UOp(Ops.MULTI, target.dtype, tuple(all_reduce(gs, Ops.ADD)), None)
