"""Step 4b of scheduling: kernels with several outputs. A kernel whose result another kernel reads at loops they
share is folded into that reader: one kernel computes the value once, stores it, and uses it, instead of a second
pass that stores it and a third that loads it back. An optimizer's new moment, read by the parameter update element
for element (Adam: three kernels per parameter become one); a row's mean and variance, read by every element of the
row (the layernorm kernel that writes the output also stores the statistics its backward reads: stored once per row,
after the row's reductions, at the loops the row's elements run in). And a snapshot, the copy of a buffer that a
lazy reader of its old value keeps (the gradient into a model's input, over weights the optimizer overwrites), takes
the memory of the buffer the kernel overwrites, which gets the snapshot's (on the CPU), or is stored by that kernel,
from the old value it loads anyway: no pass of its own."""
from __future__ import annotations
import functools
from fusegrad.device import Device
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import coeff, range_size
from fusegrad.uop.ops import GroupOp, Ops, UOp, buffer_node

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _ASSIGN, _BUFFER, _CAST, _DEFINE_GLOBAL = Ops.ADD, Ops.ASSIGN, Ops.BUFFER, Ops.CAST, Ops.DEFINE_GLOBAL
_DEFINE_LOCAL, _DEFINE_VAR, _INDEX, _KERNEL, _LOAD = Ops.DEFINE_LOCAL, Ops.DEFINE_VAR, Ops.INDEX, Ops.KERNEL, Ops.LOAD
_MUL, _RANGE, _REDUCE, _REDUCE_AXIS, _SINK = Ops.MUL, Ops.RANGE, Ops.REDUCE, Ops.REDUCE_AXIS, Ops.SINK
_COPY, _STORE = Ops.COPY, Ops.STORE

# the arg of a COPY node that is a snapshot (tensor/__init__.py _snapshot), kept in its copy kernel's AST (the last
# element of its arg): such a copy may take its source's memory (_snapshot_by_exchange) or be stored by the kernel
# that overwrites its source (_snapshot_into)
SNAPSHOT = "snapshot"
# the mark that replaces it in a copy that takes its source's memory (engine/realize.py BufferCopy)
TAKES_MEMORY = "takes memory"

def takes_memory(copy_ast: UOp) -> bool:
    """Whether a COPY kernel's AST is a snapshot that takes its source's memory (_snapshot_by_exchange)."""
    return copy_ast.arg[-1:] == (TAKES_MEMORY,)

# the most stores one kernel gets: past a few, a bigger kernel only compiles slower
MAX_OUTPUTS = 4

# the most weighted ops (see op_weight) one kernel computes. The C compiler's time grows with a kernel's source (about
# 0.2 ms per plain op on the 2-core machine, over 0.1 s per float32 sine): a fused chain of 200 sines took gcc over
# 30 s, while bounded pieces of one chain are all the same kernel, compiled once, and different pieces compile in
# parallel. At the limit a kernel takes gcc about 0.2 s; a chain of 1000 plain ops is one kernel.
KERNEL_OPS_LIMIT = 1024

# (float32, float64) cost of a transcendental in plain ops of compile time, measured with gcc 12 on kernels of chains
# of each: codegen/transcendental.py expands them into arithmetic, branches of integer selects for the sine's
# reduction. (POW is a call of the C library: one op)
_EXPANDED = {Ops.SIN: (400, 2000), Ops.EXP2: (40, 40), Ops.LOG2: (60, 100)}

def op_weight(u: UOp) -> int:
    """What a node costs in its kernel's compile time, in plain ALU ops: 1 for an ALU op, a conversion or a reduction,
    dozens to thousands for a transcendental (expanded to arithmetic), 0 for index arithmetic, memory and movement."""
    if u.op in _EXPANDED: return _EXPANDED[u.op][u.dtype.itemsize >= 8]
    if u.op in GroupOp.Elementwise: return 0 if u.dtype == dtypes.index else 1
    return 1 if u.op in (_REDUCE_AXIS, _REDUCE) else 0

def kernel_weight(ast: UOp) -> int:
    """The weighted ops of a kernel AST (see op_weight)."""
    return sum(op_weight(u) for u in ast.toposort())

def kernel_outputs(k: UOp) -> tuple[UOp, ...]:
    """The sources of a KERNEL it writes: one per STORE of its AST (a COPY or a view writes its first source)."""
    return k.src[:len(k.arg.src)] if k.arg.op is _SINK else k.src[:1]

# (memoized: a kernel's AST is asked again for every merge tried with it; ASTs are interned, so the key is cheap)
@functools.lru_cache(maxsize=4096)
def _leaves(ast: UOp) -> tuple[UOp, ...]:
    """The DEFINE_GLOBALs and DEFINE_VARs of a kernel AST."""
    return tuple(u for u in ast.toposort() if u.op in (_DEFINE_GLOBAL, _DEFINE_VAR))

def _n_globals(ast: UOp) -> int:
    return 1 + max((u.arg for u in _leaves(ast) if u.op is _DEFINE_GLOBAL), default=-1)

def _mergeable(k: UOp) -> bool:
    """A kernel that may take part in a merge: a SINK of stores, each at one unmasked index, without local memory
    and without a long contraction (a big matmul or convolution keeps a kernel to itself, where the optimizer tiles
    it; see kernelize.py find_realized). Not a kernel with an empty output: it has nothing to run (scheduling drops
    it), and merged, its store would run at the other kernel's loops, past the end of its empty buffer."""
    ast = k.arg
    if ast.op is not _SINK or any(len(st.src[0].src) != 2 for st in ast.src): return False
    if any(buffer_node(o).arg[1] == 0 for o in kernel_outputs(k)): return False
    return not any(u.op is _DEFINE_LOCAL or (u.op is _REDUCE and _is_long_contraction(u)) for u in ast.toposort())

# a sum of products of two operands that vary along different loops (a matmul, a convolution) over more than this
# many products per output gets a kernel to itself (see kernelize.py find_realized)
LONG_CONTRACTION = 384

def _is_long_contraction(red: UOp) -> bool:
    n = _loop_product(red.src[1:])
    return _is_contraction(red) and n is not None and n > LONG_CONTRACTION

# a contraction whose stores run contiguously along no output loop of at least this many elements (a vector of
# float32 on AVX2) is vectorized along a strided one
CONTIGUOUS_STORE_MIN = 8

# (memoized as _leaves: every merge tried with a kernel asks it again)
@functools.lru_cache(maxsize=4096)
def _stores_strided(ast: UOp) -> bool:
    """Whether kernel `ast` holds a contraction (a sum of products of two operands varying along different loops) and
    stores along no loop of CONTIGUOUS_STORE_MIN or more elements contiguously: a 3x3 convolution's weight gradient,
    contiguous only along its 3 columns, is vectorized along its output channels, 9 * Cin floats apart. An
    elementwise reader merged into it (the optimizer's update of those weights) would then read and write its
    buffers through gathers and scatters that far apart (ResNet-18's last weight gradient with SGD's update 15 ms,
    alone 2.5 ms)."""
    if not any(u.op is _REDUCE and _is_contraction(u) for u in ast.toposort()): return False
    for st in ast.src:
        idx = st.src[0].src[1]
        if any(coeff(idx, r) == 1 and isinstance(n := range_size(r), int) and n >= CONTIGUOUS_STORE_MIN
               for r in idx.toposort() if r.op is _RANGE): return False
    return True

def _is_contraction(red: UOp) -> bool:
    """A sum of products of two operands that vary along different loops (a matmul, a convolution)."""
    x = red.src[0]
    while x.op is _CAST: x = x.src[0]
    if red.arg is not _ADD or x.op is not _MUL: return False
    a, b = ({r for r in s.toposort() if r.op is _RANGE} for s in x.src)
    return bool(a - b) and bool(b - a)

def _loop_product(loops: tuple[UOp, ...]) -> int | None:
    """The product of the loops' sizes, or None if one is symbolic."""
    n = 1
    for r in loops:
        if not isinstance(size := range_size(r), int): return None
        n *= size
    return n

def _same_size(a: UOp, b: UOp) -> bool:
    sa, sb = range_size(a), range_size(b)
    return sa == sb if isinstance(sa, int) and isinstance(sb, int) else sa is sb

@functools.lru_cache(maxsize=4096)
def _ranges(u: UOp) -> tuple[UOp, ...]:
    """The RANGEs `u` depends on, in loop order."""
    return tuple(sorted({r for r in u.toposort() if r.op is _RANGE}, key=lambda r: r.arg[0]))

def _output_loops(ast: UOp) -> list[UOp]:
    """The loops a kernel's stores are indexed by, in loop order."""
    return sorted({r for st in ast.src for r in _ranges(st.src[0].src[1])}, key=lambda r: r.arg[0])

def outer_stores(k: UOp) -> list[int]:
    """The outputs of KERNEL `k` (positions in kernel_outputs) stored at fewer loops than the kernel runs: a
    reduction's result stored once per row beside the row's elements."""
    if k.arg.op is not _SINK: return []
    n = len(_output_loops(k.arg))
    return [i for i, st in enumerate(k.arg.src) if len(_ranges(st.src[0].src[1])) < n]

def _stores_outer(ast: UOp) -> bool:
    """Whether every store's index depends on the outermost loops only: a store that doesn't vary with an inner loop
    is placed outside it and runs once per element (an inner loop outside it would repeat it, and a store of a
    reduction computed once per row would not be)."""
    loops = _output_loops(ast)
    return all(set(rs := _ranges(st.src[0].src[1])) == set(loops[:len(rs)]) for st in ast.src)

def _renumber(ast: UOp, slots: dict[int, int], params: dict[int, int]) -> UOp:
    """`ast` with DEFINE_GLOBAL i as slots[i] and parameter _pj as _p{params[j]}."""
    sub: dict[UOp, UOp] = {}
    for u in _leaves(ast):
        if u.op is _DEFINE_GLOBAL and slots[u.arg] != u.arg: sub[u] = u.replace(arg=slots[u.arg])
        elif u.op is _DEFINE_VAR and not u.src and isinstance(u.arg[0], str) and u.arg[0][:2] == "_p" and \
                u.arg[0][2:].isdigit():  # (a kernel parameter, not a Variable)
            j = int(u.arg[0][2:])
            if params[j] != j: sub[u] = u.replace(arg=(f"_p{params[j]}",) + tuple(u.arg[1:]))
    return ast.substitute(sub) if sub else ast

def _merge(producer: UOp, reader: UOp) -> UOp | None:
    """The KERNEL computing `reader`'s stores and `producer`'s, with the reader's loads of the producer's outputs
    replaced by the values stored; None where that would compute or store something more than once, or reorder a
    load and a store.

    The producer's stores may be at fewer loops than the reader's (a row's mean read by every element of the row):
    its loops become the reader's loops it is read at, the outermost ones, so its values (reductions included) are
    computed once per element they store and stored right after they are computed."""
    p_ast, r_ast = producer.arg, reader.arg
    if _stores_strided(p_ast) or _stores_strided(r_ast): return None
    n_r_out, n_r_glob, n_p_out, n_p_glob = len(r_ast.src), _n_globals(r_ast), len(p_ast.src), _n_globals(p_ast)
    p_outs = list(producer.src[:n_p_out])
    # a reader of an output's old value (its BUFFER, not the producer's ASSIGN) must stay before the producer
    written = {buffer_node(o) for o in p_outs}
    if any(s.op is _BUFFER and buffer_node(s) in written for s in reader.src[n_r_out:n_r_glob]): return None
    # the merged kernel's buffers: the reader's outputs, the producer's, then everything read (one argument per
    # memory); then the parameters
    r_glob, r_params = list(reader.src[:n_r_glob]), list(reader.src[n_r_glob:])
    p_glob, p_params = list(producer.src[:n_p_glob]), list(producer.src[n_p_glob:])
    globals_ = r_glob[:n_r_out] + p_outs
    memory = {buffer_node(g): i for i, g in enumerate(globals_)}
    def place(g: UOp) -> int:
        mem = buffer_node(g)
        if mem not in memory:
            memory[mem] = len(globals_)
            globals_.append(g)
        return memory[mem]
    r_slots = {i: (i if i < n_r_out else place(g)) for i, g in enumerate(r_glob)}
    p_slots = {i: (n_r_out + i if i < n_p_out else place(g)) for i, g in enumerate(p_glob)}
    params = list(r_params)
    p_param_slots = {}
    for j, prm in enumerate(p_params):
        if prm not in params: params.append(prm)
        p_param_slots[j] = params.index(prm)
    # the reader's loads of the producer's outputs: at the loops of the one kernel that has fewer (all of them), read
    # at as many loops of the other (not inside a reduction's loop: it would be computed once per iteration)
    p_slots_out = {n_r_out + j for j in range(n_p_out)}
    # (checked first on the reader as it is, its arguments not renumbered yet (that changes no loop): most merges
    # refused are refused here, a reader reducing over the producer's output)
    if not _read_at_output_loops(r_ast, {i for i, slot in r_slots.items() if slot in p_slots_out}): return None
    r_new = _renumber(r_ast, r_slots, {j: j for j in range(len(r_params))})
    p_new = _renumber(p_ast, p_slots, p_param_slots)
    def loads_of(ast: UOp) -> list[UOp]:
        return [u for u in ast.toposort() if u.op is _LOAD and u.src[0].op is _INDEX and
                u.src[0].src[0].op is _DEFINE_GLOBAL and u.src[0].src[0].arg in p_slots_out]
    loads = loads_of(r_new)
    if not loads or any(len(ld.src[0].src) != 2 for ld in loads): return None
    r_loops, p_loops = _output_loops(r_new), _output_loops(p_new)
    at = sorted({r for ld in loads for r in _ranges(ld.src[0].src[1])}, key=lambda r: r.arg[0])
    if any(r not in r_loops for r in at): return None
    if not at:
        # both kernels without output loops (scalars: a step counter and what is made of it, a count and its
        # reciprocal), when what they reduce over is small: one kernel computes both, one after the other
        device = reader.src[0].device
        if r_loops or p_loops or not (_small_scalar(p_new, device) and _small_scalar(r_new, device)): return None
    if len(at) == len(p_loops):
        # the producer runs in the reader's loops (a row's statistics in the kernel of the row's elements)
        fitted = _fit(r_new, at, p_new, p_loops)
        if fitted is None: return None
        r_new, p_new = fitted
    elif len(at) == len(r_loops) < len(p_loops):
        # the reader runs in the producer's loops (a running statistic updated where the statistic is computed)
        stored = {st.src[0].src[0].arg: st.src[0].src[1] for st in p_new.src}
        p_at = sorted({r for ld in loads for r in _ranges(stored[ld.src[0].src[0].arg])}, key=lambda r: r.arg[0])
        fitted = _fit(p_new, p_at, r_new, at)
        if fitted is None: return None
        p_new, r_new = fitted
    else: return None
    value_of = {st.src[0].src[0].arg: st for st in p_new.src}
    inline = {}
    for ld in loads_of(r_new):
        st = value_of[ld.src[0].src[0].arg]
        if not _same_index(ld.src[0].src[1], st.src[0].src[1]): return None
        inline[ld] = st.src[1]
    merged = UOp.sink_of(*[st.substitute(inline) for st in r_new.src], *p_new.src)
    if not _stores_outer(merged): return None
    store_at = {st.src[0].src[0].arg: st.src[0].src[1] for st in merged.src}
    out_loads: dict[int, set[UOp]] = {}
    for u in merged.toposort():
        if u.op is _INDEX and u.src[0].op is _DEFINE_GLOBAL and u.src[0].arg in store_at:
            if len(u.src) != 2 or not _same_index(u.src[1], store_at[u.src[0].arg]): return None
        if u.op is _LOAD and u.src[0].op is _INDEX and u.src[0].src[0].op is _DEFINE_GLOBAL:
            out_loads.setdefault(u.src[0].src[0].arg, set()).add(u)
    # an output may be loaded (its old value, at the element stored: checked above) only where the store of it
    # needs the load first, so the store can't overtake the load
    n_loops = len(_output_loops(merged))
    for st in merged.src:
        if not (mine := out_loads.get(st.src[0].src[0].arg)): continue
        if not all(x in st.src[1].toposort() for x in mine): return None
        # an old value stored once per element of fewer loops than the kernel runs is read by every element of the
        # inner loops: where those run in parallel (a GPU's work-items), the one that stores races with the others
        # that still read it, so only its own store may use it
        if len(_ranges(st.src[0].src[1])) < n_loops and \
                any(x in other.src[1].toposort() for other in merged.src if other is not st for x in mine):
            return None
    return UOp(_KERNEL, reader.dtype, tuple(globals_) + tuple(params), merged)

# a kernel without output loops merges with another such kernel when each of its reductions runs over at most this many
# elements (a loss's count of labels, not a whole tensor's sum, which may be split over the cores)
SCALAR_REDUCE_MAX = 1 << 12

def _gpu_style(device: str | tuple[str, ...]) -> bool:
    """Whether `device` runs GPU-style kernels (work-groups)."""
    return bool(getattr(Device[device if isinstance(device, str) else device[0]].renderer, "has_local", False))

def _small_scalar(ast: UOp, device: str | tuple[str, ...]) -> bool:
    """Whether every reduction of kernel `ast` runs over at most SCALAR_REDUCE_MAX elements; on a GPU-style device,
    whether it has none (there a scalar's reduction is spread over a work-group's threads: two in one kernel would
    run one after the other, and GPT-2's decoding on an H200 took 2.5-2.7 against 2.0-2.2 ms a token)."""
    limit = 1 if _gpu_style(device) else SCALAR_REDUCE_MAX
    return all((n := _loop_product(u.src[1:])) is not None and n <= limit for u in ast.toposort() if u.op is _REDUCE)

def _side_by_side(first: UOp, second: UOp) -> UOp | None:
    """The KERNEL storing what KERNELs `first` and `second` (without loops, neither reading what the other writes)
    store, one after the other; None where one reads or writes a buffer the other writes."""
    f_ast, s_ast = first.arg, second.arg
    n_f_out, n_f_glob, n_s_out, n_s_glob = len(f_ast.src), _n_globals(f_ast), len(s_ast.src), _n_globals(s_ast)
    f_outs, s_outs = list(first.src[:n_f_out]), list(second.src[:n_s_out])
    written = {buffer_node(o) for o in f_outs + s_outs}
    if len(written) != n_f_out + n_s_out or \
            any(buffer_node(g) in written for g in (*first.src[n_f_out:n_f_glob], *second.src[n_s_out:n_s_glob])):
        return None
    globals_ = f_outs + s_outs
    memory = {buffer_node(g): i for i, g in enumerate(globals_)}
    def place(g: UOp) -> int:
        if (mem := buffer_node(g)) not in memory:
            memory[mem] = len(globals_)
            globals_.append(g)
        return memory[mem]
    f_slots = {i: (i if i < n_f_out else place(g)) for i, g in enumerate(first.src[:n_f_glob])}
    s_slots = {i: (n_f_out + i if i < n_s_out else place(g)) for i, g in enumerate(second.src[:n_s_glob])}
    params = list(first.src[n_f_glob:])
    s_param_slots = {}
    for j, prm in enumerate(second.src[n_s_glob:]):
        if prm not in params: params.append(prm)
        s_param_slots[j] = params.index(prm)
    f_new = _renumber(f_ast, f_slots, {j: j for j in range(len(params))})
    # (the second's reduction loops get ids of their own)
    f_new, s_new = _fit(f_new, [], _renumber(s_ast, s_slots, s_param_slots), [])  # type: ignore[misc]
    return UOp(_KERNEL, first.dtype, tuple(globals_) + tuple(params), UOp.sink_of(*f_new.src, *s_new.src))

def _read_at_output_loops(ast: UOp, slots: set[int]) -> bool:
    """Whether kernel `ast` loads its arguments `slots` somewhere, each at one unmasked index of its output loops
    alone (not of a reduction's)."""
    loads = [u for u in ast.toposort() if u.op is _LOAD and u.src[0].op is _INDEX and
             u.src[0].src[0].op is _DEFINE_GLOBAL and u.src[0].src[0].arg in slots]
    if not loads or any(len(ld.src[0].src) != 2 for ld in loads): return False
    at, loops = {r for ld in loads for r in _ranges(ld.src[0].src[1])}, set(_output_loops(ast))
    # (a kernel without output loops, a scalar's, loads the one element there is)
    return (bool(at) or not loops) and at <= loops

def _fit(frame: UOp, at: list[UOp], other: UOp, loops: list[UOp]) -> tuple[UOp, UOp] | None:
    """`frame` and `other` over the same loops: `other`'s output `loops` become the `frame`'s loops `at` (of the same
    sizes, one for one), its other loops get ids of their own. `at` must be the frame's outermost loops: if they
    aren't, the frame's loops are reordered when it has no reduction and all its stores are at all its loops."""
    if len(at) != len(loops) or not all(_same_size(a, b) for a, b in zip(at, loops)): return None
    frame_loops = _output_loops(frame)
    if [r for r in frame_loops if r in at] != frame_loops[:len(at)]:
        if any(u.op is _REDUCE for u in frame.toposort()) or \
                not all(set(_ranges(st.src[0].src[1])) == set(frame_loops) for st in frame.src):
            return None
        order = [r for r in frame_loops if r in at] + [r for r in frame_loops if r not in at]
        moved = {r: r.replace(arg=(old.arg[0],) + tuple(r.arg[1:])) for r, old in zip(order, frame_loops)}
        frame, at = frame.substitute(moved), [moved[r] for r in at]
    next_id = 1 + max((r.arg[0] for r in _ranges(frame)), default=-1)
    sub = dict(zip(loops, at))
    for r in _ranges(other):
        if r not in sub:
            sub[r] = r.replace(arg=(next_id,) + tuple(r.arg[1:]))
            next_id += 1
    return frame, other.substitute(sub)

def _same_index(a: UOp, b: UOp) -> bool:
    return a is b or a.simplify() is b.simplify()

def merge_kernels(root: UOp) -> dict[UOp, UOp]:
    """old -> new for the nodes under `root`, with kernels merged (see the module docstring). One pass: merges are
    decided on the graph of kernels (groups, checked to stay acyclic), then the graph is rebuilt once."""
    topo = list(root.toposort())
    kernels = [u for u in topo if u.op is _KERNEL]
    deps = _kernel_deps(kernels)
    group = {k: k for k in kernels}              # kernel -> its group's representative (union-find)
    members = {k: [k] for k in kernels}
    merged: dict[UOp, UOp] = {}                  # representative -> the group's KERNEL (sources: old nodes)
    def find(k: UOp) -> UOp:
        # (path halving: each step also points a kernel at its grandparent, so chains of merges stay short to walk)
        while (up := group[k]) is not k:
            group[k] = top = group[up]
            k = top
        return k
    # (each group's dependencies, found once and updated by each merge: `reaches` walks the same groups for every
    # merge tried, all the way up a chain of kernels)
    group_deps_memo: dict[UOp, set[UOp]] = {}
    def group_deps(g: UOp) -> set[UOp]:
        if (ret := group_deps_memo.get(g)) is None:
            ret = group_deps_memo[g] = {find(d) for m in members[g] for d in deps[m]} - {g}
        return ret
    def reaches(starts: set[UOp], target: UOp) -> bool:
        stack, seen = list(starts), set()
        while stack:
            g = stack.pop()
            if g is target: return True
            if g in seen: continue
            seen.add(g)
            stack.extend(group_deps(g))
        return False
    mergeable = {k: _mergeable(k) for k in kernels}
    weights: dict[UOp, int] = {}
    def weight(g: UOp) -> int:
        if g not in weights: weights[g] = sum(kernel_weight(m.arg) for m in members[g])
        return weights[g]
    def join(gp: UOp, gr: UOp, both: UOp | None) -> bool:
        """Make group gp part of group gr, whose KERNEL is now `both` (None: no merge)."""
        if both is None: return False
        # (its sources must not name a kernel of its own group: that kernel is this one now)
        own = set(members[gp]) | set(members[gr])
        if any(x in own for src in both.src for x in src.toposort(gate=lambda u: u.op is not _KERNEL)):
            return False
        group[gp] = gr
        # the merged group depends on what either did; the groups that depended on gp's now depend on it
        gp_deps, gr_deps = group_deps_memo.pop(gp, None), group_deps_memo.pop(gr, None)
        for ds in group_deps_memo.values():
            if gp in ds:
                ds.discard(gp)
                ds.add(gr)
        if gp_deps is not None and gr_deps is not None: group_deps_memo[gr] = (gp_deps | gr_deps) - {gp, gr}
        weights[gr] = weight(gr) + weight(gp)
        members[gr] += members.pop(gp)
        merged[gr] = both
        merged.pop(gp, None)
        return True
    # readers in order: an optimizer's update takes its moments, a chain folds from its start, and a statistic goes
    # to its first reader (the forward's output, not the backward)
    for reader in kernels:
        if not mergeable[reader]: continue
        for via in reader.src[len(reader.arg.src):_n_globals(reader.arg)]:
            if via.op is not _ASSIGN or via.src[1].op is not _KERNEL: continue
            producer = via.src[1]
            gr, gp = find(reader), find(producer)
            if gr is gp or not mergeable.get(producer, False) or via.src[0] not in kernel_outputs(producer) or \
                    via.src[0].device != reader.src[0].device:
                continue
            # merged, the producer runs where the reader does: nothing else the reader's group waits for may wait
            # for the producer's group
            if reaches(group_deps(gr) - {gp}, gp): continue
            if len(members[gp]) + len(members[gr]) > MAX_OUTPUTS: continue
            # (a chain that fusion cut for its size stays cut; shared ops would count once, so this may refuse a
            # merge that just fits)
            if weight(gp) + weight(gr) > KERNEL_OPS_LIMIT: continue
            join(gp, gr, _merge(merged.get(gp, gp), merged.get(gr, gr)))
    # then kernels without loops that neither waits for (an optimizer's two step counters, each with what is made of
    # it) are one kernel storing the values of both
    scalars: list[UOp] = []
    for k in kernels:
        if (g := find(k)) in scalars or not mergeable[k]: continue
        ast = merged.get(g, g).arg
        if _output_loops(ast) or not _small_scalar(ast, g.src[0].device): continue
        for other in scalars:
            if len(members[other]) + len(members[g]) > MAX_OUTPUTS or weight(other) + weight(g) > KERNEL_OPS_LIMIT or \
                    other.src[0].device != g.src[0].device or reaches(group_deps(g), other) or \
                    reaches(group_deps(other), g):
                continue
            if join(g, other, _side_by_side(merged.get(other, other), merged.get(g, g))): break
        else: scalars.append(g)
    # last, a snapshot of a buffer that one kernel overwrites whole takes the buffer's memory, and the buffer gets
    # the snapshot's: the writer reads the old values from the snapshot, as does every other reader of them in the
    # schedule. Where memory can't change hands (another device), the writer stores the snapshot, from the old values
    # it loads anyway (one writer, and nothing the writer waits for waits for the snapshot). Neither counts in a
    # limit: a store of a value loaded anyway costs no compile time
    writers = _writers(kernels)
    copies: dict[UOp, UOp] | None = None   # a copy kernel -> the ASSIGN of its output (found once, if needed)
    for k in kernels:
        if k.arg.op is not _COPY or k.arg.arg[-1] != SNAPSHOT or len(ws := writers.get(k.src[1], ())) != 1: continue
        g = find(next(iter(ws)))
        if Device[k.src[1].device].allocator.exchanges_memory:
            if copies is None:
                copies = {u.src[1]: u for u in topo if u.op is _ASSIGN and u.src[1].op is _KERNEL and
                          u.src[1].arg.op is _COPY}
            readers = {find(r): None for r in kernels if r is not k and k.src[1] in r.src[len(kernel_outputs(r)):]}
            if k in copies and (exchanged := _snapshot_by_exchange(k, merged.get(g, g), copies[k])) is not None and \
                    all(merged.get(r, r).arg.op in (_SINK, _COPY) for r in readers if r is not g):
                merged[k], merged[g] = exchanged
                for r in readers:
                    if r is g: continue
                    # (the other readers of the old values read them from the snapshot, after it has taken them)
                    kr = merged.get(r, r)
                    n = len(kernel_outputs(kr))
                    merged[r] = kr.replace(src=kr.src[:n] + tuple(copies[k] if s is k.src[1] else s
                                                                  for s in kr.src[n:]))
                continue
        if not reaches(group_deps(g) - {k}, k): join(k, g, _snapshot_into(k, merged.get(g, g)))
    if not merged: return {u: u for u in topo}
    replacement = {m: g for g in merged for m in members[g]}
    return _rebuild(topo, replacement, merged, members)

def _writers(kernels: list[UOp]) -> dict[UOp, set[UOp]]:
    """BUFFER -> the kernels writing it."""
    writers: dict[UOp, set[UOp]] = {}
    for k in kernels:
        for o in kernel_outputs(k):
            if (mem := buffer_node(o)) is not None: writers.setdefault(mem, set()).add(k)
    return writers

def _old_value_loads(copy: UOp, writer: UOp) -> tuple[int, list[UOp]] | None:
    """For KERNEL `copy` (a snapshot) and KERNEL `writer` (a SINK of stores) overwriting the buffer it copies: the
    writer's output slot of that buffer and its loads of the old values, where the copy is of the whole buffer and
    the writer overwrites it element for element, each element's old value loaded only at the index stored, before
    the store (which needs the load). None otherwise."""
    w_ast, src = writer.arg, copy.src[1]
    if w_ast.op is not _SINK or src.op is not _BUFFER or copy.arg.arg[1] != 0 or \
            copy.arg.arg[0] != src.arg[1] * src.dtype.itemsize:
        return None
    n_out = len(w_ast.src)
    slot = next((i for i, o in enumerate(writer.src[:n_out]) if buffer_node(o) is src), None)
    # (a writer reading the buffer through another argument too reads it elsewhere than where it stores)
    if slot is None or src in writer.src[n_out:]: return None
    st = w_ast.src[slot]
    idx = st.src[0]
    if len(idx.src) != 2 or not _whole(idx.src[1], src.arg[1]): return None
    loads = [u for u in w_ast.toposort() if u.op is _LOAD and u.src[0].op is _INDEX and u.src[0].src[0] is idx.src[0]]
    if not loads or any(len(ld.src[0].src) != 2 or not _same_index(ld.src[0].src[1], idx.src[1]) for ld in loads) or \
            not all(ld in st.src[1].toposort() for ld in loads):
        return None
    return slot, loads

def _snapshot_by_exchange(copy: UOp, writer: UOp, copied: UOp) -> tuple[UOp, UOp] | None:
    """KERNEL `copy` (a snapshot) as a copy that takes its source's memory (TAKES_MEMORY: the buffer gets the
    snapshot's fresh memory), and KERNEL `writer`, which overwrites that buffer, loading the old values from the
    snapshot (`copied`: the ASSIGN of the copy's output) instead: no store of the snapshot and no copy. None where
    _old_value_loads finds the writer reads the old values elsewhere than where it stores them."""
    if (found := _old_value_loads(copy, writer)) is None: return None
    slot, loads = found
    w_ast = writer.arg
    # the snapshot is the argument after the writer's buffers
    n_glob = _n_globals(w_ast)
    snap = w_ast.src[slot].src[0].src[0].replace(arg=n_glob)
    ast = w_ast.substitute({ld: ld.replace(src=(ld.src[0].replace(src=(snap, ld.src[0].src[1])), *ld.src[1:]))
                            for ld in loads})
    taking = UOp(_KERNEL, copy.dtype, copy.src, copy.arg.replace(arg=copy.arg.arg[:-1] + (TAKES_MEMORY,)))
    return taking, UOp(_KERNEL, writer.dtype, (*writer.src[:n_glob], copied, *writer.src[n_glob:]), ast)

def _snapshot_into(copy: UOp, writer: UOp) -> UOp | None:
    """The KERNEL `writer` (a SINK of stores) storing also what KERNEL `copy` (a snapshot) copies, from the old values
    it loads (see _old_value_loads). The copy's destination becomes the writer's last output. None where
    _old_value_loads finds none to store."""
    if (found := _old_value_loads(copy, writer)) is None: return None
    slot, _ = found
    w_ast = writer.arg
    n_out = len(w_ast.src)
    # the destination is argument n_out, the arguments after the outputs move up by one
    n_glob = _n_globals(w_ast)
    moved = _renumber(w_ast, {i: i if i < n_out else i + 1 for i in range(n_glob)},
                      {j: j for j in range(len(writer.src) - n_glob)})
    old = next(u for u in moved.toposort() if u.op is _LOAD and u.src[0].op is _INDEX and u.src[0].src[0].op is
               _DEFINE_GLOBAL and u.src[0].src[0].arg == slot)
    dest = old.src[0].src[0].replace(arg=n_out)
    store = UOp(_STORE, dtypes.void, (old.src[0].replace(src=(dest, old.src[0].src[1])), old))
    ast = UOp.sink_of(*moved.src, store)
    return UOp(_KERNEL, writer.dtype, (*writer.src[:n_out], copy.src[0], *writer.src[n_out:]), ast)

def _whole(idx: UOp, size: int) -> bool:
    """Whether `idx`, over the loops it depends on, is every index of [0, size) once: the loops' row-major index in
    some order (each loop's coefficient the product of the sizes of the loops with smaller ones, no constant)."""
    loops = _ranges(idx)
    coeffs = [(coeff(idx, r), range_size(r)) for r in loops]
    if any(not isinstance(c, int) or not isinstance(n, int) or c <= 0 for c, n in coeffs): return False
    stride = 1
    for c, n in sorted(coeffs):
        if c != stride: return False
        stride *= n
    if stride != size: return False
    start = idx.substitute({r: r.const_like(0) for r in loops}).simplify()
    return start.op is Ops.CONST and start.arg == 0

def _kernel_deps(kernels: list[UOp]) -> dict[UOp, set[UOp]]:
    """kernel -> the kernels that must run before it: those whose outputs it reads, and those reading (the old
    value of) a buffer it overwrites."""
    deps: dict[UOp, set[UOp]] = {}
    writers = _writers(kernels)
    for k in kernels:
        found: set[UOp] = set()
        for s in k.src:
            for x in s.toposort(gate=lambda u: u.op is not _KERNEL):
                if x.op is _KERNEL and x is not k: found.add(x)
        deps[k] = found
    for k in kernels:
        for s in k.src[len(kernel_outputs(k)):]:
            if s.op is _BUFFER:
                for w in writers.get(s, ()):
                    if w is not k: deps[w].add(k)
    return deps

def _rebuild(topo: list[UOp], replacement: dict[UOp, UOp], merged: dict[UOp, UOp],
             members: dict[UOp, list[UOp]]) -> dict[UOp, UOp]:
    """old -> new for every node of `topo`: a merged kernel's members become its group's KERNEL, rebuilt over the
    new versions of its sources (which may come later in `topo` than a member: they are built first)."""
    out: dict[UOp, UOp] = {}
    def sources(u: UOp) -> tuple[UOp, ...]:
        return merged[replacement[u]].src if u in replacement else u.src
    for root in topo:
        stack = [(root, False)]
        while stack:
            u, ready = stack.pop()
            if u in out: continue
            if not ready:
                stack.append((u, True))
                stack.extend((s, False) for s in sources(u) if s not in out)
                continue
            if u in replacement:
                g = merged[replacement[u]]
                new = UOp(_KERNEL, g.dtype, tuple(out[s] for s in g.src), g.arg)
                for m in members[replacement[u]]: out[m] = new
            else:
                new_src = tuple(out[s] for s in u.src)
                out[u] = u if all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src)
    return out
