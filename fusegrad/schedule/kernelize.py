"""Steps 1-4 of scheduling: simplify the tensor graph, decide which nodes are realized into buffers (the fusion
decision), and group everything else into KERNEL UOps, each with its AST. After this, a realized node `r` is
`ASSIGN(BUFFER, KERNEL(ast, buffers...), arg=r.shape)` and its users load from that buffer."""
from __future__ import annotations
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Container
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import SPEC, prod, rng_counter_of
from fusegrad.uop.spec import kernel_spec, tensor_spec, verify
from fusegrad.schedule.indexing import KernelBuilder, flat_index
from fusegrad.schedule.merge import KERNEL_OPS_LIMIT, LONG_CONTRACTION, SNAPSHOT, merge_kernels, op_weight
from fusegrad.schedule.simplify import sym_tensor
from fusegrad.uop.graph import StructureWalk, bound_variables, buffer_stand_in, is_liftable, new_buffer, \
    structure_key, substitute_map, var_values
from fusegrad.uop.ops import GroupOp, Ops, UOp, _arg_key, arg_uops, buffer_node, is_realized
from fusegrad.uop.pattern import graph_rewrite_map
from fusegrad.uop.symbolic import simplify_indexing
from fusegrad.viz import record as _viz

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _ASSIGN, _BITCAST, _BUFFER, _CAST = Ops.ADD, Ops.ASSIGN, Ops.BITCAST, Ops.BUFFER, Ops.CAST
_CONTIGUOUS, _COPY, _DEFINE_VAR, _DEVICE, _EXPAND = Ops.CONTIGUOUS, Ops.COPY, Ops.DEFINE_VAR, Ops.DEVICE, Ops.EXPAND
_INDEX, _KERNEL, _LOAD, _MUL, _PAD, _REDUCE_AXIS = Ops.INDEX, Ops.KERNEL, Ops.LOAD, Ops.MUL, Ops.PAD, Ops.REDUCE_AXIS
_RESHAPE, _SCATTER, _SHRINK, _SINK, _STORE = Ops.RESHAPE, Ops.SCATTER, Ops.SHRINK, Ops.SINK, Ops.STORE
_WHERE = Ops.WHERE

def max_size(shape: tuple) -> int:
    """The number of elements a buffer for `shape` needs: for a symbolic shape, at the Variables' largest values."""
    n = prod(shape)
    return n if isinstance(n, int) else int(n.vmax)

def find_realized(sink: UOp, why: dict[UOp, tuple] | None = None) -> set[UOp]:
    """The fusion decision: which nodes get their own buffer (and kernel). With `why` (only when explaining a
    schedule), each rule that realizes a node records there the first reason: (rule, details...)."""
    realize: set[UOp] = set()
    topo = list(sink.toposort())
    users: dict[UOp, list[UOp]] = {}
    for u in topo:
        for s in u.src: users.setdefault(s, []).append(u)
    _realize_always(topo, realize, why)
    _realize_outputs(sink, realize, why)
    required = set(realize)   # (outputs, copies' sources, contiguous and assign nodes: buffers of these very nodes)
    _realize_broadcast_values(topo, users, realize, why)
    _realize_nested_reductions(topo, realize, why)
    _realize_padded_reductions(topo, realize, why)
    roots = _kernel_roots(topo, users, realize, why)
    _realize_beside_contractions(topo, roots, realize, why)
    _realize_expensive_shared(topo, roots, realize, why)
    _bound_kernel_size(topo, realize, why)
    _realize_before_widening_casts(realize, required, why)
    return {u for u in realize if not is_realized(u)}

def widens_exactly(src: DType, dst: DType) -> bool:
    """Whether every value of dtype `src` converts to dtype `dst` exactly, and `dst` takes more bytes: a float to a
    float with at least its exponent and mantissa bits, an int to a wider int that holds its whole range."""
    src, dst = src.scalar(), dst.scalar()
    if dst.itemsize <= src.itemsize: return False
    if dtypes.is_float(src) and dtypes.is_float(dst):
        (se, sm), (de, dm) = dtypes.finfo(src), dtypes.finfo(dst)
        return se <= de and sm <= dm
    if dtypes.is_int(src) and dtypes.is_int(dst) and dtypes.index not in (src, dst):
        return dtypes.is_unsigned(src) or not dtypes.is_unsigned(dst)
    return False

def _realize_before_widening_casts(realize: set[UOp], required: set[UOp], why: dict[UOp, tuple] | None) -> None:
    """A widening cast that would get a buffer leaves the buffer to its source: the narrow value is stored and each
    reader casts it as it loads (the cast is exact: the reader sees the same values). Half the memory for a bfloat16
    or half value read as float32, and a reader that multiplies it keeps its operands narrow: a bfloat16 layer's
    gradient, which the matmuls of the backward pass read through such a cast, then takes the bfloat16 products
    (dot-product instructions, AMX, with their own rules: bfloat16 denormals count as zero there, as in torch's).
    A chain of widening casts leaves its buffer to the narrowest value. Not for the nodes that need a buffer of their
    own (`required`: outputs, a copy's source)."""
    def widening(u: UOp) -> bool:
        return u.op is _CAST and u not in required and not is_realized(u) and widens_exactly(u.src[0].dtype, u.dtype)
    for u in list(realize):
        if not widening(u): continue
        x = u.src[0]
        while widening(x): x = x.src[0]
        # (the source must be a value a kernel computes, or a buffer already; a view of one is left as it is)
        if not (is_realized(x) or x.op in GroupOp.Elementwise or x.op is _REDUCE_AXIS): continue
        realize.discard(u)
        if not is_realized(x):
            realize.add(x)
            if why is not None and u in why: why.setdefault(x, why[u])

def _realize_always(topo: list[UOp], realize: set[UOp], why: dict[UOp, tuple] | None) -> None:
    """Contiguous, assign, copy and scatter nodes get a buffer, and so does what a copy reads."""
    for u in topo:
        if u.op in (_CONTIGUOUS, _ASSIGN, _COPY, _SCATTER) and not is_realized(u): realize.add(u)
        if why is not None and u in realize:
            why.setdefault(u, ("always", "SNAPSHOT" if u.op is _COPY and u.arg == SNAPSHOT else u.op.name))
        if u.op is _COPY and contiguous_range(u.src[0]) is None:
            # a copy reads a buffer: a run of a node's elements (a shard of it) needs just that node realized
            realize.add(base if (base := _range_base(u.src[0])) is not None else u.src[0])
            if why is not None: why.setdefault(base if base is not None else u.src[0], ("copy_source",))

def _realize_outputs(sink: UOp, realize: set[UOp], why: dict[UOp, tuple] | None) -> None:
    """Each output of the sink gets a buffer unless it already is one, or a reshape of a node that gets one."""
    for out in sink.src:
        # an output already in a buffer in row-major order (only reshapes on top), or a reshape of a node that gets
        # one anyway, needs no kernel of its own
        base = out
        while base.op is _RESHAPE: base = base.src[0]
        if buffer_node(out) is None and base not in realize:
            realize.add(out)
            if why is not None: why.setdefault(out, ("output",))

def _realize_broadcast_values(topo: list[UOp], users: dict[UOp, list[UOp]], realize: set[UOp],
                              why: dict[UOp, tuple] | None) -> None:
    """A broadcast computed value gets a buffer, unless cheap, or used row by row and within RECOMPUTE_LIMIT ops."""
    # the ALU ops that compute a node inside its consumer's kernel, each counted once however many paths reach it
    # (the kernel computes a shared value once: a variance reads x and the mean of x), None for more than
    # RECOMPUTE_LIMIT
    ops_of: dict[UOp, frozenset[UOp] | None] = {}
    heavy = _heavy_nodes(topo)
    expands_of: dict[UOp, list[UOp]] = {}
    for u in topo:
        if u.op is _EXPAND: expands_of.setdefault(_unpadded(u.src[0].base, heavy), []).append(u)
    anyway: dict[UOp, bool] = {}
    def broadcast_whole(y: UOp) -> bool:
        """Whether y will get a buffer for a broadcast of its own that isn't row by row (a layernorm's output that
        a matmul reads): the walk of a row value below it (the layernorm's mean) may end there."""
        # (its walks go up from y's broadcasts, so they never ask about y itself)
        if y not in anyway:
            anyway[y] = not _is_cheap(y, heavy, realize) and \
                any(not _is_row_broadcast(e, users, realize, broadcast_whole) for e in expands_of.get(y, ()))
        return anyway[y]
    for u in topo:
        if u in realize or is_realized(u) or not (u.op in GroupOp.Elementwise or u.op in GroupOp.Movement or
                                                  u.op is _REDUCE_AXIS):
            ops_of[u] = frozenset()
            continue
        below = [ops_of.get(s, frozenset()) for s in u.src]
        mine = None if None in below else frozenset().union(*below, () if u.op in GroupOp.Movement else (u,))
        ops_of[u] = mine if mine is not None and len(mine) <= RECOMPUTE_LIMIT else None
        # a computed value that is broadcast is computed once into a buffer, not once per output element; except a
        # cheap enough per-row value used row by row, which the consumer computes once per row itself
        if u.op is _EXPAND:
            base = _unpadded(u.src[0].base, heavy)
            if not is_realized(base) and not _is_cheap(base, heavy, realize) and \
                    (ops_of[base] is None or not _is_row_broadcast(u, users, realize, broadcast_whole)):
                realize.add(base)
                if why is not None:
                    why.setdefault(base, ("expand", prod(u.shape) // max(prod(base.shape), 1) if all(
                        type(d) is int for d in u.shape + base.shape) else None, ops_of[base] is None))
                ops_of[base] = ops_of[u] = frozenset()

def _realize_nested_reductions(topo: list[UOp], realize: set[UOp], why: dict[UOp, tuple] | None) -> None:
    """A reduction inside another reduction's loop gets a buffer."""
    # nested, it would run once per iteration of the outer loop (a convolution then a mean over the image), where
    # nothing vectorizes or tiles it. (A broadcast reduction inside one, as softmax's max in its sum, was decided by
    # _realize_broadcast_values: hoisted or realized.)
    seen: set[UOp] = set()
    for u in topo:
        if u.op is _REDUCE_AXIS: _realize_reductions_below(u.src[0], realize, seen, False, why, ("nested_reduce",))

def _realize_padded_reductions(topo: list[UOp], realize: set[UOp], why: dict[UOp, tuple] | None) -> None:
    """A reduction under a padding gets a buffer."""
    # padding gates only the reduction's result, so its loop would run for every element, the padded ones too (a cat
    # of n reductions would compute each of them n times)
    under_pad: set[UOp] = set()
    for u in topo:
        if u.op is _PAD: _realize_reductions_below(u.src[0], realize, under_pad, True, why, ("padded_reduce",))

def _kernel_roots(topo: list[UOp], users: dict[UOp, list[UOp]], realize: set[UOp],
                  why: dict[UOp, tuple] | None) -> dict[UOp, frozenset[UOp]]:
    """A reduction feeding more than one kernel gets a buffer (computed once); returns each node's kernel roots."""
    # walk users before sources: a node's roots are the realized nodes its users end in
    roots: dict[UOp, frozenset[UOp]] = {}
    for u in reversed(topo):
        if u.op is _SINK: continue
        if u in realize or is_realized(u): roots[u] = frozenset([u]); continue
        r = frozenset().union(*(roots.get(x, frozenset()) for x in users.get(u, []) if x.op is not _SINK))
        if u.op is _REDUCE_AXIS and len(r) > 1:
            realize.add(u); roots[u] = frozenset([u])
            if why is not None: why.setdefault(u, ("shared_reduce", len(r)))
        else: roots[u] = r
    return roots

def _realize_beside_contractions(topo: list[UOp], roots: dict[UOp, frozenset[UOp]], realize: set[UOp],
                                 why: dict[UOp, tuple] | None) -> None:
    """A contraction in the kernel of a longer one, of over LONG_CONTRACTION products per output, gets a buffer."""
    # a kernel holds one long contraction (a sum of products of two broadcast operands: a big matmul or convolution):
    # a contraction beside it (a residual block's 1x1 downsample next to its 3x3 convolution) is computed into a
    # buffer first, so the optimizer tiles and blocks the long one by itself (two reductions in one kernel can't be
    # blocked through the output). Short ones (an LSTM cell's two products) stay together in one kernel.
    by_root: dict[UOp, list[UOp]] = {}
    for u in topo:
        if u.op is _REDUCE_AXIS and u not in realize and len(roots.get(u, ())) == 1 and \
                (n := _contraction_length(u)) is not None:
            by_root.setdefault(next(iter(roots[u])), []).append((n * prod(u.shape), n, u))
    for group in by_root.values():
        if len(group) < 2: continue
        _, length, longest = max(group, key=lambda g: g[:2])
        if length <= LONG_CONTRACTION: continue
        for _, _, r in group:
            if r is not longest and r not in longest.toposort() and longest not in r.toposort():
                realize.add(r)
                if why is not None: why.setdefault(r, ("beside_contraction", length))

def _realize_expensive_shared(topo: list[UOp], roots: dict[UOp, frozenset[UOp]], realize: set[UOp],
                              why: dict[UOp, tuple] | None) -> None:
    """A value of over RECOMPUTE_LIMIT elementwise ops feeding more than one kernel gets a buffer."""
    # recomputing it in each kernel would make a chain of such values (x = f(x, sum(x)) in a loop) cost quadratic
    # work and code size
    ops: dict[UOp, int] = {}
    for u in topo:
        if u.op in GroupOp.Movement and u not in realize: ops[u] = ops.get(u.src[0], 0); continue
        if u in realize or is_realized(u) or u.op not in GroupOp.Elementwise: ops[u] = 0; continue
        ops[u] = min(RECOMPUTE_LIMIT + 1, 1 + sum(ops.get(s, 0) for s in u.src))
        if ops[u] > RECOMPUTE_LIMIT and len(roots.get(u, ())) > 1:
            realize.add(u); ops[u] = 0
            if why is not None: why.setdefault(u, ("expensive_shared", len(roots[u])))

def _bound_kernel_size(topo: list[UOp], realize: set[UOp], why: dict[UOp, tuple] | None = None) -> None:
    """Add to `realize` what keeps every kernel within KERNEL_OPS_LIMIT weighted ops (merge.op_weight) beyond its
    single heaviest op: where a node would make its kernel bigger, its heaviest sources are computed into buffers
    first. A deep chain (200 sines) becomes a chain of kernels that are each the same few links, so one of them is
    compiled for all. (The heaviest op doesn't count: an op can't be split, and one float64 sine with a little
    arithmetic around it, randn's, cut into two kernels would compile no faster and cost a buffer and a launch.)"""
    def inside(s: UOp) -> bool: return s not in realize and not is_realized(s)
    def region(u: UOp) -> tuple[int, int]:
        # the exact weight of the kernel part computing u (each node once, however many paths lead to it), and the
        # weight of its heaviest op
        seen, stack, total, top = set(), [u], 0, 0
        while stack:
            x = stack.pop()
            if x in seen: continue
            seen.add(x)
            total, top = total + op_weight(x), max(top, op_weight(x))
            stack.extend(s for s in x.src if inside(s))
        return total, top
    weight: dict[UOp, int] = {}  # an upper bound of region(u)'s total: shared nodes are counted once per path
    heaviest_op: dict[UOp, int] = {}
    for u in topo:
        if is_realized(u): weight[u] = heaviest_op[u] = 0; continue
        w = op_weight(u) + sum(weight[s] for s in u.src if inside(s))
        top = max([op_weight(u)] + [heaviest_op[s] for s in u.src if inside(s)])
        if w - top > KERNEL_OPS_LIMIT: w, top = region(u)
        while w - top > KERNEL_OPS_LIMIT:
            bases = [b for s in u.src if inside(b := s.base) and weight[b] > 0 and
                     (b.op in GroupOp.Elementwise or b.op is _REDUCE_AXIS)]
            if not bases: break
            heaviest = max(bases, key=lambda b: weight[b])
            realize.add(heaviest)
            if why is not None: why.setdefault(heaviest, ("kernel_size", KERNEL_OPS_LIMIT))
            weight[heaviest] = heaviest_op[heaviest] = 0
            w, top = region(u)
        weight[u], heaviest_op[u] = (0, 0) if u in realize else (w, top)

def _contraction_length(r: UOp) -> int | None:
    """For a sum over products of two operands broadcast against each other (a matmul, a convolution), the number of
    products per output; else None."""
    x = r.src[0]
    while x.op is _CAST: x = x.src[0]
    if r.arg[0] is not _ADD or x.op is not _MUL or \
            not all(_is_broadcast(s) for s in x.src):
        return None
    if not all(type(d) is int for d in x.shape + r.shape): return None
    return prod(x.shape) // max(prod(r.shape), 1)

def _is_broadcast(u: UOp) -> bool:
    """Whether the movement ops and casts from u down to the first other node include an EXPAND."""
    while u.op in GroupOp.Movement or u.op is _CAST:
        if u.op is _EXPAND: return True
        u = u.src[0]
    return False

def _realize_reductions_below(start: UOp, realize: set[UOp], seen: set[UOp], through_expand: bool,
                              why: dict[UOp, tuple] | None = None, reason: tuple = ()) -> None:
    """Add to `realize` the first unrealized REDUCE_AXIS on every path down from `start` (not past a broadcast
    unless `through_expand`); `seen` holds the nodes already walked. (`why`, `reason`: see find_realized.)"""
    stack = [start]
    while stack:
        x = stack.pop()
        if x in seen or x in realize or is_realized(x): continue
        seen.add(x)
        if x.op is _REDUCE_AXIS:
            realize.add(x)
            if why is not None: why.setdefault(x, reason)
        elif through_expand or x.op is not _EXPAND: stack.extend(x.src)

# the most ALU ops of a fused value that is recomputed in every kernel that uses it
RECOMPUTE_LIMIT = 32
SINGLE_ROW_FUSED = 16384  # elements of a single row whose reductions its consumer computes (see _is_row_broadcast)

def _unpadded(u: UOp, heavy: dict[UOp, bool]) -> UOp:
    """The value under a constant padding (pad(x, value=v) is where(pad(ones), pad(x), v)): padding costs nothing
    in the kernel that reads it, so x is what gets a buffer, and the kernel computing x keeps its plain indices."""
    while u.op is _WHERE and u.src[1].op is _PAD and u.src[0].op is _PAD and _is_cheap(u.src[0], heavy) and \
            _is_cheap(u.src[2], heavy) and u.src[0].arg == u.src[1].arg:
        u = u.src[1].src[0].base
    return u

def _is_row_broadcast(expand: UOp, users: dict[UOp, list[UOp]], realize: set[UOp],
                      realized_anyway: Callable[[UOp], bool]) -> bool:
    """Whether a broadcast value can be computed inside its consumers, once per output row: it is broadcast only along
    trailing axes, and every path to a kernel output (a node in `realize`, or one `realized_anyway` says will be) is
    elementwise on that shape or a reduction over those axes.
    The consumer's loops then run in shape order with the broadcast axes innermost, and the linearizer hoists the
    value out of them: x - x.max(1, keepdim=True) needs no kernel of its own, so softmax and layernorm are one."""
    src_shape, shape = expand.src[0].shape, expand.shape
    axes = [i for i, (a, b) in enumerate(zip(src_shape, shape)) if a != b]
    if not axes or any(i not in axes and s != 1 for i, s in enumerate(shape) if i > axes[0]): return False
    # a single long row (or column) is computed once into a buffer: its consumer's loop along the row is split across
    # cores, and each part would compute the row's reductions again; for a short one that costs less than a launch
    if all(s == 1 for i, s in enumerate(shape) if i not in axes) and \
            not (isinstance(n := prod(shape), int) and n <= SINGLE_ROW_FUSED): return False
    stack, seen = [expand], set()
    while stack:
        u = stack.pop()
        for x in users.get(u, []):
            if x in seen or x.op is _SINK: continue
            seen.add(x)
            if x.op is _REDUCE_AXIS and set(axes) <= set(x.arg[1]) and x.src[0].shape == shape: continue
            if x.op in (_ASSIGN, _CONTIGUOUS) and x in realize and x.shape == shape: continue
            if x.op not in GroupOp.Elementwise or x.shape != shape:
                if u is not expand and realized_anyway(u): break
                return False
            if x not in realize: stack.append(x)
    return True

_HEAVY = frozenset((Ops.BUFFER, Ops.REDUCE_AXIS, Ops.ASSIGN, Ops.CONTIGUOUS, Ops.COPY))

def _heavy_nodes(topo: list[UOp]) -> dict[UOp, bool]:
    """For each node of `topo` (a toposort), whether it or a node below it reads memory or reduces: one pass over the
    graph for every _is_cheap question (a walk below each broadcast value was quadratic in a long chain of them)."""
    heavy: dict[UOp, bool] = {}
    for u in topo: heavy[u] = u.op in _HEAVY or any(map(heavy.__getitem__, u.src))
    return heavy

def _is_cheap(u: UOp, heavy: dict[UOp, bool], realize: Container[UOp] = ()) -> bool:
    """Computed from constants and loop indices alone (no memory reads, no reductions), or a conversion of a buffer
    read (half inputs of a matmul, converted as they are loaded; a buffer already, or a node in `realize`, which gets
    one): recomputing it costs less than a buffer of it. `heavy`: _heavy_nodes of a graph `u` is in."""
    while u.op in (_CAST, _BITCAST) or u.op in GroupOp.Movement: u = u.src[0]
    return is_realized(u) or u in realize or not heavy[u]

def _device(u: UOp) -> UOp: return UOp(_DEVICE, arg=u.device)

def _assign_target(u: UOp) -> UOp:
    """The buffer view an ASSIGN writes to (checked to be a realized buffer)."""
    target = u.src[0]
    if not is_realized(target.base):
        raise RuntimeError("assign target must be a realized tensor (call .realize() on it first)")
    return target

def build_kernel(r: UOp) -> UOp:
    """The kernel computing realized node `r`, whose sources already refer to earlier kernels' outputs. Returns
    ASSIGN(BUFFER, KERNEL) (for an assign: the target view over it, so users keep reading through the view)."""
    if r.op is _COPY: return _copy_kernel(r)
    if r.op is _SCATTER: return _scatter_kernel(r)
    kb = KernelBuilder(lambda u: u is not r and is_realized(u))
    shape = r.shape
    ranges = tuple(kb.new_range(s, "loop") if s != 1 else UOp.const(dtypes.index, 0) for s in shape)
    if r.op is _ASSIGN:
        target_view, value_node = _assign_target(r), r.src[1]
        target_base = target_view.base
        out_buf = buffer_node(target_base)
        # address the target through its view: an assign may write a slice of a buffer
        _, idx, valid = KernelBuilder(is_realized).address(target_view, ranges)
    else:
        out_buf = new_buffer(_device(r), max_size(shape), r.dtype)
        value_node = r.src[0] if r.op is _CONTIGUOUS else r
        idx, valid = flat_index(ranges, shape), None
    g = kb.define_global(out_buf)  # defined first: DEFINE_GLOBAL 0 is the buffer written
    val = kb.value(value_node, ranges)
    store_idx = g.index(idx, valid=valid) if valid is not None else g.index(idx)
    # index arithmetic from movement ops simplifies a lot once ranges are known (e.g. reshape round trips vanish)
    ast = simplify_indexing(UOp(_SINK, dtypes.void, (UOp(_STORE, dtypes.void, (store_idx, val)),)))
    if SPEC: verify(ast, kernel_spec, "kernel AST")
    if r.op is _ASSIGN and _reads_output_elsewhere(ast):
        # the value reads the buffer being written at other positions: compute it into a temporary first, so the
        # in-place writes can't be observed by the reads
        return build_kernel(r.replace(src=(r.src[0], build_kernel(r.src[1]))))
    # an assign over a pending kernel's output names that output as its first source, so it runs after it
    first = target_base if r.op is _ASSIGN and target_base.op is _ASSIGN else out_buf
    # the parameters the kernel reads follow its buffers (in _p0, _p1... order); a lifted constant's placeholder is
    # replaced by this call's constant when the cached kernelization is instantiated
    kernel = UOp(_KERNEL, dtypes.void, (first,) + tuple(kb.globals[1:]) + tuple(kb.params), ast)
    if r.op is not _ASSIGN: return UOp(_ASSIGN, r.dtype, (out_buf, kernel), shape)
    # users of an assign read the target view, now over the buffer as this kernel leaves it
    done = UOp(_ASSIGN, out_buf.dtype, (out_buf, kernel), out_buf.shape)
    return target_view.substitute({target_base: done})

def _combine(how: str | None, old: UOp, v: UOp) -> UOp:
    """The value a scatter leaves at a position holding `old` when `v` comes in."""
    if how is None: return v
    if how == "add": return old + v
    if how == "mul": return old * v
    if how == "max": return old.maximum(v)
    # (float min through max keeps max's nan propagation)
    return -((-old).maximum(-v)) if dtypes.is_float(v.dtype) else (v < old).where(v, old)

def _scatter_kernel(r: UOp) -> UOp:
    """SCATTER(target, positions, values) as two kernels: the target copied into a new buffer, then one loop over the
    values in their row-major order that combines each into its position (a later duplicate sees an earlier one's
    write: the code generator runs a kernel storing to loaded addresses in order, on one core)."""
    target, positions, values = r.src
    copied = build_kernel(UOp(_CONTIGUOUS, r.dtype, (target,)))
    out_buf, n = copied.src[0], copied.src[0].arg[1]
    if n == 0: return copied   # (no position to write)
    kb = KernelBuilder(is_realized)
    ranges = tuple(kb.new_range(s, "loop") if s != 1 else UOp.const(dtypes.index, 0) for s in positions.shape)
    g = kb.define_global(out_buf)
    p, v = kb.value(positions, ranges), kb.value(values, ranges)
    bounds = [] if dtypes.is_unsigned(p.dtype) else [p.const_like(-1) < p]
    if n <= dtypes.max(p.dtype): bounds.append(p < p.const_like(n))
    valid = bounds[0] & bounds[1] if len(bounds) == 2 else bounds[0] if bounds else UOp.const(dtypes.bool, True)
    at = valid.where(p.cast(dtypes.index), UOp.const(dtypes.index, 0))  # (a position that exists when invalid)
    if r.arg is not None: v = _combine(r.arg, UOp(_LOAD, r.dtype, (g.index(at),)), v)
    ast = simplify_indexing(UOp(_SINK, dtypes.void, (UOp(_STORE, dtypes.void, (g.index(at, valid=valid), v)),)))
    if SPEC: verify(ast, kernel_spec, "kernel AST")
    kernel = UOp(_KERNEL, dtypes.void, (copied,) + tuple(kb.globals[1:]) + tuple(kb.params), ast)
    return UOp(_ASSIGN, r.dtype, (out_buf, kernel), r.shape)

def _reads_output_elsewhere(ast: UOp) -> bool:
    """Whether a kernel loads from its output buffer at an index other than the one it stores to."""
    store_index = ast.src[0].src[0]
    return any(u.op is _INDEX and u.src[0].arg == 0 and u is not store_index for u in ast.toposort())

def _range_base(u: UOp) -> UOp | None:
    """The node whose row-major elements `u` is a run of (reshapes over a shrink), or None. The run is contiguous
    when every axis outside the innermost one the shrink cuts keeps a single index."""
    while u.op is _RESHAPE: u = u.src[0]
    if u.op is not _SHRINK: return None
    src = u.src[0]
    if not all(type(x) is int for x in src.shape) or arg_uops(u.arg): return None
    cut = [i for i, ((b, e), n) in enumerate(zip(u.arg, src.shape)) if (b, e) != (0, n)]
    if cut and any(e - b != 1 for b, e in u.arg[:cut[-1]]): return None
    while src.op is _RESHAPE: src = src.src[0]
    return src

def contiguous_range(u: UOp) -> tuple[UOp, int] | None:
    """(the realized node, first element) when `u` is a run of consecutive elements of a buffer in row-major order
    (the buffer itself, reshapes of it, or a shrink that keeps whole rows: what a COPY can read in place)."""
    while u.op is _RESHAPE: u = u.src[0]
    if u.op is not _SHRINK: return (u, 0) if buffer_node(u) is not None else None
    src = u.src[0]
    if buffer_node(src) is None or _range_base(u) is None: return None
    offset, stride = 0, 1
    for (b, _), n in reversed(list(zip(u.arg, src.shape))):
        offset += b * stride
        stride *= n
    while src.op is _RESHAPE: src = src.src[0]
    return src, offset

def _copy_kernel(r: UOp) -> UOp:
    """A COPY between devices: a run of consecutive elements of the source buffer into a new buffer on the target
    device (the ast's arg: the bytes and the byte offset in the source)."""
    rng = contiguous_range(r.src[0])
    assert rng is not None, "the scheduler realizes a COPY's source unless it is a run of a buffer"
    src, offset = rng
    out_buf = new_buffer(r.src[1], max_size(r.shape), r.dtype)
    # (a snapshot keeps its mark: merge.py may have the kernel overwriting its source store it)
    ast = UOp(_COPY, r.dtype, arg=(out_buf.arg[1] * r.dtype.itemsize, offset * r.dtype.itemsize) +
              ((SNAPSHOT,) if r.arg == SNAPSHOT else ()))
    return UOp(_ASSIGN, r.dtype, (out_buf, UOp(_KERNEL, dtypes.void, (out_buf, src), ast)), r.shape)

def kernelize_map(sink: UOp, why: dict[UOp, tuple] | None = None) -> dict[UOp, UOp]:
    """old -> new for every node of `sink`: realized nodes become ASSIGN(BUFFER, KERNEL), the rest follow. (`why`:
    see find_realized; its keys are nodes of the simplified graph.)"""
    simplified = graph_rewrite_map(sink, sym_tensor, name="sym_tensor")
    ssink = simplified[sink]
    if SPEC: verify(ssink, tensor_spec, "tensor graph after sym_tensor")
    realized = find_realized(ssink, why)
    # one pass in dependency order: rebuild each node over its sources' replacements; realized nodes become kernels
    final: dict[UOp, UOp] = {}
    for u in ssink.toposort():
        new_src = tuple(final[s] for s in u.src)
        nu = u if all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src)
        final[u] = build_kernel(nu) if u in realized else nu
    # elementwise kernels that feed another element for element are folded into it (kernels with several outputs)
    merged = merge_kernels(UOp.sink_of(*final.values()))
    if _viz.VIZ: _viz.record_kernelize(ssink, final, UOp.sink_of(*final.values()), merged, build_kernel, merge_kernels)
    return {k: merged[final[v]] if v in final else v for k, v in simplified.items()}

__all__ = ["kernelize_map", "kernelize_map_cached"]

# *** the schedule cache: an identical graph over different buffers (the next training step) is kernelized once ***
#
# The cache key is the graph with its buffers replaced by numbered parameters and its constants replaced by numbered
# placeholders, so graphs that differ only in buffers or in the values of Python numbers share an entry. An entry
# bakes the constants it was first built with into the kernels (full constant folding); when a later graph of the
# same structure brings a different value at some position, that position is lifted for good: it becomes a kernel
# parameter (a DEFINE_VAR) and the value is bound per call. So a step counter or a learning-rate schedule costs one
# extra compile, then hits every step; constants that never change stay folded into the code.

@dataclass
class _CacheEntry:
    baseline: tuple        # the constant values the kernels were built with (keys from _arg_key, so -0.0 != 0.0)
    lifted: frozenset      # positions that are kernel parameters
    changed: dict          # kernelized graph: structure node -> its replacement
    outs: tuple            # output BUFFERs created by the cached kernelization (fresh ones per call)
    topo: tuple = ()       # toposort of the replacements, walked to instantiate them
    # entries keyed by structure_key: where the graph's nodes sit in its toposort, so a hit maps them by position
    # without building the normalized graph. (toposort position, its parameter or placeholder) and (position, the
    # node's replacement)
    leaves: tuple = ()
    positions: tuple = ()
    replay: Any = None     # a ReplayPlan (schedule/replay.py) once a schedule of this structure was made

    def accepts(self, keys: tuple) -> bool:
        return all(k == b for i, (k, b) in enumerate(zip(keys, self.baseline)) if i not in self.lifted)

schedule_cache: dict[UOp, _CacheEntry] = {}
SCHEDULE_CACHE_SIZE = 512
schedule_cache_stats = {"hits": 0, "misses": 0}

def _placeholder(i: int, c: UOp) -> UOp:
    dt = c.dtype
    lo, hi = (-math.inf, math.inf) if dtypes.is_float(dt) else (dtypes.min(dt), dtypes.max(dt))
    return UOp(_DEFINE_VAR, dt, c.src, (f"_c{i}", lo, hi))

@dataclass
class CacheLookup:
    """A graph's toposort and, for a graph without bound Variables, its structure key and the cache entry that
    accepts its constants (None on a miss)."""
    topo: list[UOp]
    binds: dict[UOp, UOp]
    skey: tuple | None = None
    entry: _CacheEntry | None = None

def schedule_cache_lookup(sink: UOp, topo: Iterable[UOp] | None = None) -> CacheLookup:
    """Look `sink`'s graph up in the schedule cache by its structure (see structure_key). (`topo`: its toposort, if
    the caller made it.)"""
    topo = list(topo if topo is not None else sink.toposort())
    binds = bound_variables(topo)
    if binds: return CacheLookup(topo, binds)
    skey, sconsts = structure_key(topo)
    return CacheLookup(topo, binds, skey, cached_entry(skey, sconsts))

def cached_entry(skey: tuple, consts: list[UOp]) -> _CacheEntry | None:
    """The schedule cache's entry for the structure key `skey` (see structure_key) when it accepts the values of the
    graph's liftable constants `consts`, else None."""
    entry = schedule_cache.get(skey)
    if entry is None or (consts and not entry.accepts(tuple([_arg_key(c.arg) for c in consts]))): return None
    return entry

def walked_lookup(walk: StructureWalk, sink: UOp) -> CacheLookup:
    """schedule_cache_lookup for the graph `walk` went through (`sink`: the SINK of its roots), from the walk's
    toposort and structure key."""
    topo = walk.topo(sink)
    binds = bound_variables(topo)
    if binds: return CacheLookup(topo, binds)
    skey = walk.key()
    return CacheLookup(topo, binds, skey, cached_entry(skey, walk.consts))

def kernelize_map_cached(sink: UOp, var_vals: dict[str, int] | None = None,
                         lookup: CacheLookup | None = None) -> dict[UOp, UOp]:
    """kernelize_map for the nodes that change, using the schedule cache. The cached result is instantiated with
    this graph's buffers, fresh output buffers, and this graph's values for lifted constants. Bound Variables are
    unbound for the key (one entry, one compiled kernel serves every value); their values go to `var_vals`.
    (`lookup`: schedule_cache_lookup(sink), if the caller made it.)"""
    lookup = lookup if lookup is not None else schedule_cache_lookup(sink)
    topo, binds = lookup.topo, lookup.binds
    if var_vals is not None: var_vals.update(var_values(binds))
    if not binds:
        skey, entry = lookup.skey, lookup.entry
        if entry is not None:
            schedule_cache_stats["hits"] += 1
            if not entry.positions: return {}
            back = {p: topo[i] for i, p in entry.leaves}
            back.update({o: new_buffer(o.src[0], o.arg[1], o.dtype) for o in entry.outs})
            inst = substitute_map(UOp.sink_of(*entry.changed.values()), back, topo=entry.topo)
            return {topo[i]: inst[r] for i, r in entry.positions}
    to_param: dict[UOp, UOp] = dict(binds)
    consts: list[UOp] = []
    for u in topo:
        if u.op is _BUFFER: to_param[u] = buffer_stand_in(len(to_param), u)
        elif is_liftable(u):
            to_param[u] = _placeholder(len(consts), u)
            consts.append(u)
    normalized = substitute_map(sink, to_param, in_args=bool(binds))
    key = normalized[sink] if binds else skey
    keys = tuple(_arg_key(c.arg) for c in consts)
    entry = schedule_cache.get(key)
    if entry is None or not entry.accepts(keys):
        schedule_cache_stats["misses"] += 1
        # random counters change on every call: parameters from the start (see helpers.rng_counter_const)
        lifted = frozenset(i for i, c in enumerate(consts)
                           if c.dtype == dtypes.uint64 and rng_counter_of(c.arg) is not None)
        if entry is not None:
            lifted |= entry.lifted | {i for i, (k, b) in enumerate(zip(keys, entry.baseline)) if k != b}
        entry = _kernelize_structure(normalized[sink], [to_param[c] for c in consts], consts, lifted, keys,
                                     frozenset(to_param[u] for u in topo if u.op is _BUFFER))
        if not binds:
            at = {normalized[u]: i for i, u in enumerate(topo)}
            entry.leaves = tuple((at[p], p) for p in to_param.values())
            entry.positions = tuple((at[n], r) for n, r in entry.changed.items())
        schedule_cache.pop(key, None)
        while len(schedule_cache) >= SCHEDULE_CACHE_SIZE: schedule_cache.pop(next(iter(schedule_cache)))
        schedule_cache[key] = entry
    else: schedule_cache_stats["hits"] += 1
    if not entry.changed: return {}
    # instantiate: parameters back to this graph's buffers and constants (so kernels get this call's values), cached
    # output buffers to new ones
    back: dict[UOp, UOp] = {p: b for b, p in to_param.items()}
    back.update({o: new_buffer(o.src[0], o.arg[1], o.dtype) for o in entry.outs})
    inst = substitute_map(UOp.sink_of(*entry.changed.values()), back, in_args=bool(binds), topo=entry.topo)
    return {orig: inst[entry.changed[n]] for orig, n in normalized.items() if n in entry.changed}

def _kernelize_structure(key: UOp, placeholders: list[UOp], consts: list[UOp], lifted: frozenset, keys: tuple,
                         params: frozenset) -> _CacheEntry:
    """Kernelize the structure `key` with the constants not in `lifted` baked in as the values `consts`."""
    baked = substitute_map(key, {p: consts[i] for i, p in enumerate(placeholders) if i not in lifted})
    nmap = kernelize_map(baked[key])
    changed = {n: nmap[b] for n, b in baked.items() if b in nmap and nmap[b] is not b}
    everything = tuple(UOp.sink_of(*changed.values()).toposort())
    outs = tuple(u for u in everything if u.op is _BUFFER and u not in params)
    return _CacheEntry(keys, lifted, changed, outs, everything)
