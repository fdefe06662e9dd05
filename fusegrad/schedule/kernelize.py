"""Steps 1-4 of scheduling: simplify the tensor graph, decide which nodes are realized into buffers (the fusion
decision), and group everything else into KERNEL UOps, each with its AST. After this, a realized node `r` is
`ASSIGN(BUFFER, KERNEL(ast, buffers...), arg=r.shape)` and its users load from that buffer."""
from __future__ import annotations
import itertools
from fusegrad.dtype import dtypes
from fusegrad.helpers import SPEC, prod
from fusegrad.uop.spec import kernel_spec, tensor_spec, verify
from fusegrad.schedule.indexing import KernelBuilder, flat_index, is_realized, storage_of
from fusegrad.schedule.simplify import sym_tensor
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import graph_rewrite, graph_rewrite_map
from fusegrad.uop.symbolic import pm_simplify_indexing

_buffer_ids = itertools.count()

def new_buffer(device: UOp, size: int, dtype) -> UOp:
    """A fresh BUFFER node (unique: the id keeps two buffers of equal size and dtype distinct)."""
    return UOp(Ops.BUFFER, dtype, (device,), (next(_buffer_ids), size))

def buffer_of(u: UOp) -> UOp:
    """The BUFFER node behind a realized node or a reshape view of one."""
    if (b := storage_of(u)) is None: raise RuntimeError(f"{u.op} is not a buffer")
    return b

def find_realized(sink: UOp) -> set[UOp]:
    """The fusion decision: which nodes get their own buffer (and kernel)."""
    realize: set[UOp] = set()
    topo = list(sink.toposort())
    for out in sink.src:
        # an output already in a buffer in row-major order (only reshapes on top) needs no kernel
        if storage_of(out) is None: realize.add(out)
    for u in topo:
        if u.op in (Ops.CONTIGUOUS, Ops.ASSIGN, Ops.COPY) and not is_realized(u): realize.add(u)
        if u.op is Ops.COPY and storage_of(u.src[0]) is None: realize.add(u.src[0])
        # a computed value that is broadcast is computed once into a buffer, not once per output element
        if u.op is Ops.EXPAND:
            base = u.src[0].base
            if not is_realized(base) and not _is_cheap(base): realize.add(base)
    # a reduce feeding more than one kernel is computed once (walk users before sources)
    users: dict[UOp, list[UOp]] = {}
    for u in topo:
        for s in u.src: users.setdefault(s, []).append(u)
    roots: dict[UOp, frozenset[UOp]] = {}
    for u in reversed(topo):
        if u.op is Ops.SINK: continue
        if u in realize or is_realized(u): roots[u] = frozenset([u]); continue
        r = frozenset().union(*(roots.get(x, frozenset()) for x in users.get(u, []) if x.op is not Ops.SINK))
        if u.op is Ops.REDUCE_AXIS and len(r) > 1:
            realize.add(u); roots[u] = frozenset([u])
        else: roots[u] = r
    return {u for u in realize if not is_realized(u)}

def _is_cheap(u: UOp) -> bool:
    """Computed from constants and loop indices alone (no memory reads, no reductions): recomputing it is free."""
    return not any(x.op in (Ops.BUFFER, Ops.REDUCE_AXIS, Ops.ASSIGN, Ops.CONTIGUOUS, Ops.COPY) for x in u.toposort())

def _device(u: UOp) -> UOp: return UOp(Ops.DEVICE, arg=u.device)

def _assign_target(u: UOp) -> UOp:
    """The buffer view an ASSIGN writes to (checked to be a realized buffer)."""
    target = u.src[0]
    if not is_realized(target.base):
        raise RuntimeError("assign target must be a realized tensor (call .realize() on it first)")
    return target

def build_kernel(r: UOp) -> UOp:
    """The kernel computing realized node `r`, whose sources already refer to earlier kernels' outputs. Returns
    ASSIGN(BUFFER, KERNEL) (for an assign: the target view over it, so users keep reading through the view)."""
    if r.op is Ops.COPY: return _copy_kernel(r)
    kb = KernelBuilder(lambda u: u is not r and is_realized(u))
    shape = r.shape
    ranges = tuple(kb.new_range(s, "loop") if s != 1 else UOp.const(dtypes.index, 0) for s in shape)
    if r.op is Ops.ASSIGN:
        target_view, value_node = _assign_target(r), r.src[1]
        target_base = target_view.base
        out_buf = buffer_of(target_base)
        # address the target through its view: an assign may write a slice of a buffer
        _, idx, valid = KernelBuilder(is_realized).address(target_view, ranges)
    else:
        out_buf = new_buffer(_device(r), prod(shape), r.dtype)
        value_node = r.src[0] if r.op is Ops.CONTIGUOUS else r
        idx, valid = flat_index(ranges, shape), None
    g = kb.define_global(out_buf)  # defined first: DEFINE_GLOBAL 0 is the buffer written
    val = kb.value(value_node, ranges)
    store_idx = g.index(idx, valid=valid) if valid is not None else g.index(idx)
    # index arithmetic from movement ops simplifies a lot once ranges are known (e.g. reshape round trips vanish)
    ast = graph_rewrite(UOp(Ops.SINK, dtypes.void, (UOp(Ops.STORE, dtypes.void, (store_idx, val)),)),
                        pm_simplify_indexing, name="simplify kernel indices")
    if SPEC: verify(ast, kernel_spec, "kernel AST")
    if r.op is Ops.ASSIGN and _reads_output_elsewhere(ast):
        # the value reads the buffer being written at other positions: compute it into a temporary first, so the
        # in-place writes can't be observed by the reads
        return build_kernel(r.replace(src=(r.src[0], build_kernel(r.src[1]))))
    # an assign over a pending kernel's output names that output as its first source, so it runs after it
    first = target_base if r.op is Ops.ASSIGN and target_base.op is Ops.ASSIGN else out_buf
    kernel = UOp(Ops.KERNEL, dtypes.void, (first,) + tuple(kb.globals[1:]), ast)
    if r.op is not Ops.ASSIGN: return UOp(Ops.ASSIGN, r.dtype, (out_buf, kernel), shape)
    # users of an assign read the target view, now over the buffer as this kernel leaves it
    done = UOp(Ops.ASSIGN, out_buf.dtype, (out_buf, kernel), out_buf.shape)
    return target_view.substitute({target_base: done})

def _reads_output_elsewhere(ast: UOp) -> bool:
    """Whether a kernel loads from its output buffer at an index other than the one it stores to."""
    store_index = ast.src[0].src[0]
    return any(u.op is Ops.INDEX and u.src[0].arg == 0 and u is not store_index for u in ast.toposort())

def _copy_kernel(r: UOp) -> UOp:
    """A COPY between devices: the whole (contiguous) source buffer into a new buffer on the target device."""
    src = r.src[0]
    while src.op is Ops.RESHAPE: src = src.src[0]
    out_buf = new_buffer(r.src[1], prod(r.shape), r.dtype)
    ast = UOp(Ops.COPY, r.dtype, arg=out_buf.arg[1] * r.dtype.itemsize)
    return UOp(Ops.ASSIGN, r.dtype, (out_buf, UOp(Ops.KERNEL, dtypes.void, (out_buf, src), ast)), r.shape)

def kernelize_map(sink: UOp) -> dict[UOp, UOp]:
    """old -> new for every node of `sink`: realized nodes become ASSIGN(BUFFER, KERNEL), the rest follow."""
    simplified = graph_rewrite_map(sink, sym_tensor, name="sym_tensor")
    ssink = simplified[sink]
    if SPEC: verify(ssink, tensor_spec, "tensor graph after sym_tensor")
    realized = find_realized(ssink)
    # one pass in dependency order: rebuild each node over its sources' replacements; realized nodes become kernels
    final: dict[UOp, UOp] = {}
    for u in ssink.toposort():
        new_src = tuple(final[s] for s in u.src)
        nu = u if all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src)
        final[u] = build_kernel(nu) if u in realized else nu
    return {k: final.get(v, v) for k, v in simplified.items()}

def substitute_map(root: UOp, dvars: dict[UOp, UOp]) -> dict[UOp, UOp]:
    """old -> new for every node under `root` after replacing the keys of `dvars` by their values."""
    out: dict[UOp, UOp] = {}
    for u in root.toposort():
        if u in dvars: out[u] = dvars[u]; continue
        new_src = tuple(out[s] for s in u.src)
        out[u] = u if all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src)
    return out

__all__ = ["kernelize_map", "kernelize_map_cached", "is_realized", "buffer_of", "new_buffer"]

# *** the schedule cache: an identical graph over different buffers (the next training step) is kernelized once ***

schedule_cache: dict[UOp, tuple[dict[UOp, UOp], tuple[UOp, ...]]] = {}
SCHEDULE_CACHE_SIZE = 512
schedule_cache_stats = {"hits": 0, "misses": 0}

def _param(i: int, buf: UOp) -> UOp: return UOp(Ops.BUFFER, buf.dtype, buf.src, (("param", i), buf.arg[1]))

def kernelize_map_cached(sink: UOp) -> dict[UOp, UOp]:
    """kernelize_map for the nodes that change, using the schedule cache. Buffers are replaced by numbered parameters
    to form the cache key; the cached result is instantiated with this graph's buffers and fresh output buffers."""
    topo = list(sink.toposort())
    inputs = [u for u in topo if u.op is Ops.BUFFER]
    to_param = {b: _param(i, b) for i, b in enumerate(inputs)}
    normalized = substitute_map(sink, to_param)
    key = normalized[sink]
    if (hit := schedule_cache.get(key)) is None:
        schedule_cache_stats["misses"] += 1
        nmap = kernelize_map(key)
        changed = {k: v for k, v in nmap.items() if k is not v}
        params = set(to_param.values())
        outs = tuple(u for u in UOp.sink_of(*changed.values()).toposort() if u.op is Ops.BUFFER and u not in params)
        hit = (changed, outs)
        if len(schedule_cache) >= SCHEDULE_CACHE_SIZE: schedule_cache.pop(next(iter(schedule_cache)))
        schedule_cache[key] = hit
    else: schedule_cache_stats["hits"] += 1
    changed, outs = hit
    if not changed: return {}
    # instantiate: parameters back to this graph's buffers, cached output buffers to new ones
    back = {p: b for b, p in to_param.items()}
    back.update({o: new_buffer(o.src[0], o.arg[1], o.dtype) for o in outs})
    vals = UOp.sink_of(*changed.values())
    inst = substitute_map(vals, back)
    return {orig: inst[changed[n]] for orig, n in normalized.items() if n in changed}
