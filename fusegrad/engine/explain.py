"""Answers about a computation before (or while) it runs: why the scheduler cut the graph where it did
(`explain`), what a realize will cost (`estimate`), and where a NaN or Inf came from (`DEBUG_NANS`).

Source lines are recorded only while asked for (`TRACK_SOURCES=1`, or `fusegrad.track_sources()`): the Tensor front
end then notes, for each node a tensor operation makes, the first frame outside the package. Without it nothing is
recorded and an answer names the op that made a node instead. This module sits below the Tensor (it takes graphs of
UOps) and imports nothing from engine/realize.py, which calls it for DEBUG_NANS."""
from __future__ import annotations
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any
from fusegrad.dtype import dtypes
from fusegrad.helpers import ContextVar, prod, rng_counter_of
from fusegrad.schedule.kernelize import RECOMPUTE_LIMIT, _placeholder, kernelize_map
from fusegrad.schedule.linear import kernels_in_order
from fusegrad.schedule.memory import share_storage
from fusegrad.schedule.merge import kernel_outputs, outer_stores, takes_memory
from fusegrad.schedule.simplify import expand_composites, sym_tensor
from fusegrad.uop.ops import GroupOp, Ops, UOp, buffer_map, buffer_node
from fusegrad.uop.graph import is_liftable, substitute_map
from fusegrad.uop.pattern import graph_rewrite_map
from fusegrad.viz import record as _viz

__all__ = ["Source", "sources", "record_source", "source_of", "Explanation", "explain", "Estimate", "estimate",
           "explain_and_estimate", "Roofline", "DEBUG_NANS", "NanWatch"]

DEBUG_NANS = ContextVar("DEBUG_NANS", 0)

# *** where each node was made (only while source tracking is on) ***

@dataclass(frozen=True)
class Source:
    """The user's line that made a node: file, line number, and the package function it called there."""
    filename: str
    lineno: int
    api: str
    def __str__(self) -> str: return f"{self.api} at {os.path.basename(self.filename)}:{self.lineno}"

# node -> Source; weak keys, so recording keeps no graph alive
sources: weakref.WeakKeyDictionary[UOp, Source] = weakref.WeakKeyDictionary()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

def record_source(u: UOp, depth: int = 2) -> None:
    """Note the first frame outside the package above the caller as the source of `u` (kept if one is noted)."""
    if u in sources: return
    f: Any = sys._getframe(depth)
    api = "?"
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        api = f.f_code.co_name
        f = f.f_back
    if f is not None: sources[u] = Source(f.f_code.co_filename, f.f_lineno, api)

def source_of(u: UOp, users: dict[UOp, list[UOp]] | None = None) -> Source | None:
    """The recorded source of `u`, or of the nearest node above it that has one (a node made inside a tensor method
    without a Tensor of its own is attributed to that method's call)."""
    if (s := sources.get(u)) is not None or not users: return s
    seen, frontier = {u}, [u]
    while frontier:
        nxt = []
        for x in frontier:
            for y in users.get(x, []):
                if y in seen: continue
                if (s := sources.get(y)) is not None: return s
                seen.add(y)
                nxt.append(y)
        frontier = nxt
    return None

def _users(topo: list[UOp]) -> dict[UOp, list[UOp]]:
    users: dict[UOp, list[UOp]] = {}
    for u in topo:
        for s in u.src: users.setdefault(s, []).append(u)
    return users

def _describe(u: UOp) -> str:
    shape = "x".join(str(d) for d in u.shape) if u.shape else "scalar"
    # (a function built as one node is named by its function: "linear", "gelu", "gradient of linear")
    what = u.arg.name if u.op is Ops.COMPOSITE else u.op.name
    return f"{what} {shape} {u.dtype.name if hasattr(u.dtype, 'name') else u.dtype}"

# *** explain: every kernel boundary with its reason ***

def reason_text(why: tuple) -> tuple[str, str]:
    """(the reason, in the user's terms, what would fuse it) for a reason recorded by find_realized."""
    rule = why[0]
    if rule == "always":
        op = why[1]
        if op == "CONTIGUOUS": return "you asked for it with .contiguous()", "remove the .contiguous() call"
        if op == "ASSIGN": return "assign target: the value is written into an existing buffer", "a hard boundary"
        if op == "COPY": return "different devices: a copy to another device", \
            "a hard boundary (keep both operands on one device to avoid it)"
        if op == "SNAPSHOT": return "a copy of the old values a lazy tensor reads (the gradient into an input), " \
            "kept before the buffer is overwritten (where the overwriting kernel loads them all, it takes the " \
            "buffer's memory on the CPU, else that kernel stores it)", \
            "realize that tensor before the write, or don't keep it (requires_grad=False on an input)"
        if op == "SCATTER": return "a write by tensor indices (setitem, scatter): the target is copied into a " \
            "buffer of its own, then the values are written into it in order", "a hard boundary"
        return f"{op} always gets a kernel of its own", "a hard boundary"
    if rule == "copy_source":
        return "read by a copy to another device, which needs it in memory", "a hard boundary"
    if rule == "output": return "realized by you (one of the tensors asked for)", "a hard boundary"
    if rule == "expand":
        ratio, costly = why[1], why[2]
        times = f"{ratio}x" if ratio is not None else "many times"
        if costly:
            return f"read after an expand and more than {RECOMPUTE_LIMIT} ops to compute (recompute would cost " \
                   f"{times})", "a hard boundary"
        return f"read by several elements each after an expand (recompute would cost {times})", \
            "broadcast it only along trailing axes (a keepdim reduction used row by row is fused)"
    if rule == "nested_reduce":
        return "reduce of a reduce: it would run inside the loop of a later reduction", "a hard boundary"
    if rule == "padded_reduce":
        return "padding of a reduction: padded, its loop would also run for every padded element", \
            "pad the reduction's input instead of its result"
    if rule == "shared_reduce":
        return f"a reduction read by {why[1]} kernels is computed once", \
            "read it from one kernel only (compute its readers together)"
    if rule == "beside_contraction":
        return f"a contraction beside a longer one ({why[1]} products per output): a long contraction gets a " \
               "kernel of its own", "a hard boundary"
    if rule == "expensive_shared":
        return f"more than {RECOMPUTE_LIMIT} fused ops read by {why[1]} kernels: computed once, not in each", \
            "a hard boundary"
    if rule == "kernel_size":
        return f"kernel size limit: the kernel would pass {why[1]} weighted ops (KERNEL_OPS_LIMIT)", "a hard boundary"
    if rule == "assign_temporary":
        return "an assign reads its target at other elements: its value is computed into a temporary first", \
            "a hard boundary"
    raise ValueError(f"no text for the scheduler's reason {why!r}")

# how an output inside a function built as one node is described: "MAX 64x10 float inside sparse_cross_entropy"
INSIDE = " inside "

@dataclass
class KernelExplained:
    """One kernel of a schedule: what it computes and why each of its outputs got a buffer."""
    index: int
    kind: str
    outputs: list[tuple[str, str, str, Source | None]]  # (node described, reason, what would fuse it, source)
    merged: bool = False

@dataclass
class Explanation:
    kernels: list[KernelExplained] = field(default_factory=list)
    tracked: bool = False
    def __str__(self) -> str:
        lines = [f"{len(self.kernels)} kernel{'s' if len(self.kernels) != 1 else ''}"]
        for k in self.kernels:
            note = f", {len(k.outputs)} outputs merged into one kernel" if k.merged else ""
            lines.append(f"kernel {k.index}: {k.kind}{note}")
            for desc, reason, fix, src in k.outputs:
                # (without a recorded source: the function a node inside one came from, else the node's kind)
                made = f"made by {src}" if src is not None else \
                    f"made by {desc.split(INSIDE)[1] if INSIDE in desc else desc.rsplit(' ', 2)[0]}"
                lines.append(f"  {desc} ({made})")
                lines.append(f"    cut: {reason}")
                lines.append(f"    to fuse: {fix}")
        if not self.tracked and self.kernels:
            lines.append("(source lines: set TRACK_SOURCES=1 or use fusegrad.track_sources() while building)")
        return "\n".join(lines)

def _kernel_kind(k: UOp) -> str:
    ast = k.arg
    if ast.op is Ops.COPY:
        return "copy, which takes the memory of the buffer it copies (nothing moves)" \
            if takes_memory(ast) else "copy"
    return "reduce" if any(u.op is Ops.REDUCE for u in ast.toposort()) else "elementwise"

def _kernel_of(x: UOp) -> UOp | None:
    """The KERNEL that computes the replacement `x` of a realized node (under views for an assign)."""
    while x.op in GroupOp.Movement: x = x.src[0]
    if x.op is Ops.ASSIGN and len(x.src) > 1 and x.src[1].op is Ops.KERNEL: return x.src[1]
    return None

@dataclass
class _Scheduled:
    sink: UOp
    topo: list[UOp]
    simplified: dict[UOp, UOp]
    why: dict[UOp, tuple]
    kmap: dict[UOp, UOp]
    kernels: list[UOp]
    results: list[UOp]
    ssink: UOp

def _inside_composites(topo: list[UOp], simplified: dict[UOp, UOp]) -> dict[UOp, UOp]:
    """Each node of the simplified graph that a COMPOSITE's expansion made (not one of its operands' nodes) -> that
    COMPOSITE (the user's node), for naming a kernel boundary inside a function built as one node: each composite
    expanded over its simplified operands and simplified as sym_tensor does, which makes the same nodes."""
    inside: dict[UOp, UOp] = {}
    for c in topo:
        if c.op is not Ops.COMPOSITE: continue
        srcs = tuple(simplified.get(x, x) for x in c.src)
        expanded = c.arg.expand(srcs)
        final = graph_rewrite_map(expanded, sym_tensor, name="sym_tensor").get(expanded, expanded)
        operands = set(UOp.sink_of(*srcs).toposort())
        for n in final.toposort(gate=lambda x: x not in operands):
            if n not in operands: inside.setdefault(n, c)
    return inside

def _schedule(roots: list[UOp]) -> _Scheduled:
    """Kernelize the graph of `roots` with reasons recorded, without touching the schedule cache or any tensor."""
    sink = UOp.sink_of(*roots)
    topo = list(sink.toposort())
    # random counters are kernel parameters, as in the schedule cache (kernelize.py): folded, they would be evaluated
    lifted = {u: _placeholder(i, u) for i, u in enumerate(topo) if is_liftable(u) and u.dtype == dtypes.uint64 and
              rng_counter_of(u.arg) is not None}
    normal = substitute_map(sink, lifted) if lifted else {u: u for u in topo}
    rewritten = graph_rewrite_map(normal[sink], sym_tensor, name="sym_tensor")
    simplified = {u: rewritten.get(normal[u], normal[u]) for u in topo}
    ssink = simplified[sink]
    why: dict[UOp, tuple] = {}
    kmap = kernelize_map(ssink, why)
    results = [kmap.get(r, r) for r in ssink.src]
    kernels = [k for k in kernels_in_order(UOp.sink_of(*results))
               if (b := buffer_node(k.src[0])) is not None and b.arg[1] > 0]
    return _Scheduled(sink, topo, simplified, why, kmap, kernels, results, ssink)

def explain(roots: list[UOp]) -> Explanation:
    """Every kernel that realizing `roots` would run, each output with the reason it got a buffer and its source."""
    return _explain(_schedule(roots))

def _explain(s: _Scheduled) -> Explanation:
    users = _users(s.topo)
    original: dict[UOp, UOp] = {}  # simplified node -> the user's node it came from
    for o, n in s.simplified.items(): original.setdefault(n, o)
    inside = _inside_composites(s.topo, s.simplified) if any(u.op is Ops.COMPOSITE for u in s.topo) else {}
    by_kernel: dict[UOp, list[UOp]] = {}
    for n in s.why:
        if n in s.kmap and (k := _kernel_of(s.kmap[n])) is not None: by_kernel.setdefault(k, []).append(n)
    out = Explanation(tracked=len(sources) > 0)
    for i, k in enumerate(s.kernels):
        nodes = by_kernel.get(k, [])
        outs = [buffer_node(o) for o in kernel_outputs(k)]
        outer = {n for n in nodes if outs.index(buffer_node(s.kmap[n].src[0] if s.kmap[n].op is Ops.ASSIGN else
                                                             s.kmap[n])) in outer_stores(k)}
        outputs = []
        for n in nodes:
            reason, fix = reason_text(s.why[n])
            o = original.get(n, n)
            # (a node inside a function built as one node is named with that function, from its call)
            composite = inside.get(n) if n not in original else None
            src = source_of(o if composite is None else composite, users)
            if s.why[n] == ("always", "CONTIGUOUS") and src is not None and src.api != "contiguous":
                reason, fix = f"{src.api}() makes its result contiguous (a buffer of its own)", "a hard boundary"
            if n in outer:
                reason += "; stored where it is computed, in a kernel with more loops, once per element of its " \
                          "outer loops (several outputs across a reduction)"
            desc = _describe(o) if composite is None else f"{_describe(o)}{INSIDE}{composite.arg.name}"
            outputs.append((desc, reason, fix, src))
        if not nodes:
            # a kernel no realized node names: the temporary an assign computes its value into (kernelize.py
            # build_kernel), read only by the assign's kernel
            readers = [r for r in s.kernels if r is not k and any(buffer_node(x) is buffer_node(k.src[0])
                                                                 for x in r.src if x.op in (Ops.BUFFER, Ops.ASSIGN))]
            if readers and all(_writes_in_place(r) for r in readers):
                reason, fix = reason_text(("assign_temporary",))
                outputs.append((f"temporary {k.arg.dtype if k.arg.op is Ops.COPY else 'value'}", reason, fix, None))
        out.kernels.append(KernelExplained(i + 1, _kernel_kind(k), outputs, merged=len(kernel_outputs(k)) > 1))
    return out

def _writes_in_place(k: UOp) -> bool:
    """Whether kernel `k` writes a buffer that existed before the schedule (an assign's target)."""
    return any((b := buffer_node(o)) is not None and _allocated(b) for o in kernel_outputs(k))

# *** estimate: the cost of a realize, before anything runs ***

@dataclass(frozen=True)
class Roofline:
    """A device's measured peaks: FLOP/s of a big contraction, bytes/s of a big elementwise kernel, the time a kernel
    launch costs beyond its work, the time a realize costs beyond its kernels' (scheduling, starting them) and what
    each node of the graph it realizes adds to that (a big graph's schedule, even a cached one, walks it)."""
    flops_per_s: float
    bytes_per_s: float
    launch_s: float
    realize_s: float = 0.0
    node_s: float = 0.0
    def time(self, flops: int, nbytes: int) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.launch_s

@dataclass
class Estimate:
    kernels: int
    flops: int
    bytes: int
    peak_memory: int
    predicted_s: float | None
    live_at_peak: list[tuple[int, str]] = field(default_factory=list)  # (bytes, what) for the new buffers
    per_kernel: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, flops, bytes)
    def __str__(self) -> str:
        t = f", predicted {self.predicted_s * 1e3:.3f} ms" if self.predicted_s is not None else ""
        lines = [f"{self.kernels} kernels, {self.flops} FLOPs, {self.bytes} bytes moved, peak memory "
                 f"{self.peak_memory} bytes{t}"]
        lines += [f"  {n:>12d} bytes  {what}" for n, what in self.live_at_peak[:10]]
        return "\n".join(lines)

def _range_size(r: UOp) -> int:
    n = r.src[0]
    return n.arg if n.op is Ops.CONST and isinstance(n.arg, int) else int(n.vmax) + 1

# exp2, log2 and sin are computed as polynomials with range reduction (codegen/transcendental.py): about this many
# arithmetic ops each
_TRANSCENDENTAL_FLOPS = {Ops.EXP2: 20, Ops.LOG2: 20, Ops.SIN: 20}

def kernel_work(k: UOp) -> tuple[int, int]:
    """(FLOPs, bytes) of a kernel from its AST alone: each ALU op counted once per iteration of the loops it depends
    on, each buffer it uses read or written once in full."""
    ast = k.arg
    bufs = [b for b in k.src if b.op is not Ops.CONST]
    nbytes = sum(buffer_node(b).arg[1] * b.dtype.itemsize for b in bufs if buffer_node(b) is not None)  # type: ignore
    if ast.op is Ops.COPY: return 0, 0 if takes_memory(ast) else 2 * ast.arg[0]
    flops = 0
    loops: dict[UOp, frozenset] = {}
    for u in ast.toposort():
        own = frozenset([u]) if u.op is Ops.RANGE else frozenset()
        loops[u] = own.union(*(loops[s] for s in u.src))
        if u.op is Ops.REDUCE: loops[u] = loops[u] - frozenset(u.src[1:])
        if u.op in GroupOp.ALU and u.dtype.scalar() != dtypes.index and u.dtype.scalar() != dtypes.bool:
            flops += prod([_range_size(r) for r in loops[u]]) * _TRANSCENDENTAL_FLOPS.get(u.op, 1)
        if u.op is Ops.REDUCE: flops += prod([_range_size(r) for r in loops[u] | frozenset(u.src[1:])])
    return flops, nbytes

def estimate(roots: list[UOp], held: list[UOp], mem_used: int, roofline: Roofline | None) -> Estimate:
    """The kernels, FLOPs, bytes and peak memory of realizing `roots` (`held`: other nodes live tensors hold, whose
    buffers keep their own memory; `mem_used`: the bytes allocated now), and the time the roofline predicts."""
    return _estimate(_schedule(roots), held, mem_used, roofline)

def explain_and_estimate(roots: list[UOp], held: list[UOp], mem_used: int, roofline: Roofline | None) \
        -> tuple[Explanation, Estimate]:
    """explain(roots) and estimate(...) of one kernelization (what VIZ records with each schedule)."""
    s = _schedule(roots)
    return _explain(s), _estimate(s, held, mem_used, roofline)

def _estimate(s: _Scheduled, held: list[UOp], mem_used: int, roofline: Roofline | None) -> Estimate:
    users = _users(s.topo)
    original: dict[UOp, UOp] = {}
    for o, n in s.simplified.items(): original.setdefault(n, o)
    made_by: dict[UOp, UOp] = {}  # output BUFFER -> the user's node it holds
    for n, r in s.kmap.items():
        if (k := _kernel_of(r)) is not None:
            for o in kernel_outputs(k):
                if (b := buffer_node(o)) is not None: made_by.setdefault(b, original.get(n, n))
    keep = {b for x in s.results + [s.kmap[s.simplified[h]] for h in held if s.simplified.get(h) in s.kmap]
            if (b := buffer_node(x)) is not None}
    flops = nbytes = 0
    per_kernel = []
    uses: list[list[UOp]] = []
    fresh: dict[UOp, int] = {}
    for k in s.kernels:
        f, b = kernel_work(k)
        flops, nbytes = flops + f, nbytes + b
        per_kernel.append((_kernel_kind(k), f, b))
        step = []
        for x in k.src:
            if x.op is Ops.CONST or (buf := buffer_node(x)) is None or buf in fresh or _allocated(buf): continue
            fresh[buf] = buf.arg[1] * buf.dtype.itemsize
            step.append(buf)
        uses.append([b for b in step if b not in keep])
        # a buffer used again later is a use of it at that step too
        uses[-1] += [buf for x in k.src if (buf := buffer_node(x)) is not None and buf in fresh and buf not in keep
                     and buf not in step]
    shares = share_storage(uses, fresh, {b: b.device for b in fresh})
    storages = {b: n for b, n in fresh.items() if b not in shares}
    live = sorted(((n, _what(made_by.get(b), users)) for b, n in storages.items()), key=lambda x: -x[0])
    predicted = None if roofline is None else roofline.realize_s + roofline.node_s * len(s.topo) + \
        sum(roofline.time(f, b) for _, f, b in per_kernel)
    return Estimate(len(s.kernels), flops, nbytes, mem_used + sum(storages.values()), predicted, live, per_kernel)

def _allocated(buf: UOp) -> bool:
    b = buffer_map.get(buf)
    return b is not None and b.is_allocated()

def _what(u: UOp | None, users: dict[UOp, list[UOp]]) -> str:
    if u is None: return "a temporary"
    src = source_of(u, users)
    return _describe(u) + (f" ({src})" if src is not None else "")

# *** DEBUG_NANS: the first operation that made a NaN or Inf ***

class NanWatch:
    """The tensor graph of one realize and a copy of every buffer it reads, taken before any kernel runs, so the first
    operation producing a NaN or Inf can be found by evaluating the graph node by node on the host."""
    current: NanWatch | None = None

    def __init__(self, roots: list[UOp]):
        # (a function built as one node is evaluated operation by operation: the one making the NaN is named)
        self.sink = expand_composites(UOp.sink_of(*roots))
        self.topo = list(self.sink.toposort())
        self.leaves: dict[UOp, Any] = {}
        for u in self.topo:
            if u.op is Ops.BUFFER and (b := buffer_map.get(u)) is not None and b.is_allocated():
                self.leaves[u] = b.numpy().copy()

    def locate(self) -> str | None:
        """Where the first NaN or Inf of the graph comes from, or None if evaluating it on the host finds none."""
        import numpy as np
        users = _users(self.topo)
        vals: dict[UOp, Any] = {}
        def has(x: Any, test: Any) -> bool: return x is not None and np.asarray(x).dtype.kind == "f" and \
            bool(test(x).any())
        inf_leaf = None
        with np.errstate(all="ignore"):
            for u in self.topo:
                try: v = _eval(u, vals, self.leaves)
                except Exception: v = None
                vals[u] = v
                if v is None or not _is_float(u): continue
                srcs = [vals.get(s) for s in u.src if s.op is not Ops.DEVICE]
                if any(x is None for x in srcs): continue
                # a NaN where no input has one, or an Inf where no input has one (an input holding an Inf, as a
                # masked softmax's -inf, is only the answer when nothing after it made the NaN)
                if has(v, np.isnan) and not any(has(x, np.isnan) for x in srcs) or \
                        has(v, np.isinf) and not any(has(x, np.isinf) for x in srcs) and u.op is not Ops.BUFFER:
                    return _nan_message(u, v, srcs, source_of(u, users))
                if u.op is Ops.BUFFER and inf_leaf is None and has(v, np.isinf): inf_leaf = (u, v)
        return _nan_message(inf_leaf[0], inf_leaf[1], [], source_of(inf_leaf[0], users)) if inf_leaf else None

def _is_float(u: UOp) -> bool: return dtypes.is_float(u.dtype) and u.op is not Ops.SINK

def _nan_message(u: UOp, v: Any, srcs: list[Any], src: Source | None) -> str:
    import numpy as np
    flat = np.asarray(v).reshape(-1)
    nan = np.isnan(flat)
    new_nan = nan.any() and not any(np.asarray(x).dtype.kind == "f" and np.isnan(x).any() for x in srcs)
    i = int(np.flatnonzero(nan if new_nan else ~np.isfinite(flat))[0])
    idx = np.unravel_index(i, np.shape(v)) if np.ndim(v) else ()
    what = "NaN" if np.isnan(flat[i]) else "Inf"
    where = f" ({src})" if src is not None else " (set TRACK_SOURCES=1 for the source line)"
    if u.op is Ops.BUFFER:
        return f"DEBUG_NANS: {what} in an input buffer {_describe(u)}{where}, element {tuple(map(int, idx))}"
    ins = []
    for x in srcs:
        a = np.asarray(x)
        if u.op is Ops.REDUCE_AXIS:
            sel = tuple(slice(None) if d in u.arg[1] else int(j) for d, j in enumerate(idx))
            ins.append(np.array2string(a[sel].reshape(-1)[:8], precision=6))
        else: ins.append(repr(a[idx].item() if a.ndim else a.item()))
    return f"DEBUG_NANS: {u.op.name} produced {what} at element {tuple(map(int, idx))}{where}: " \
           f"inputs {', '.join(ins)} (dtype {u.dtype})"

def _eval(u: UOp, vals: dict[UOp, Any], leaves: dict[UOp, Any]) -> Any:
    """The value of tensor-graph node `u` on the host (numpy), from its sources' values; None where unknown."""
    import numpy as np
    from fusegrad.dtype import to_np_dtype
    op = u.op
    if op in (Ops.DEVICE, Ops.SINK): return None
    if op is Ops.BUFFER: return leaves.get(u)
    s = [vals.get(x) for x in u.src]
    if op is Ops.CONST: return np.array(u.arg, dtype=to_np_dtype(u.dtype)).reshape(())
    if s and s[0] is None and op not in (Ops.ASSIGN,): return None
    if op in (Ops.CONTIGUOUS, Ops.DETACH, Ops.CONTIGUOUS_BACKWARD, Ops.CUSTOM_GRAD, Ops.COPY): return s[0]
    if op is Ops.ASSIGN: return s[1]
    x = np.asarray(s[0])
    if op is Ops.RESHAPE: return x.reshape(u.arg)
    if op is Ops.PERMUTE: return x.transpose(u.arg)
    if op is Ops.EXPAND: return np.broadcast_to(x, u.arg)
    if op is Ops.PAD: return np.pad(x, u.arg)
    if op is Ops.SHRINK: return x[tuple(slice(b, e) for b, e in u.arg)]
    if op is Ops.FLIP: return np.flip(x, tuple(i for i, f in enumerate(u.arg) if f))
    if op is Ops.CAST: return x.astype(to_np_dtype(u.dtype))
    if op is Ops.BITCAST: return np.ascontiguousarray(x).view(to_np_dtype(u.dtype))
    if op is Ops.REDUCE_AXIS:
        fn = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.MAX: np.maximum}[u.arg[0]]
        return fn.reduce(x, axis=tuple(u.arg[1]), keepdims=True).astype(x.dtype)
    if any(v is None for v in s): return None
    a = [np.asarray(v) for v in s]
    out_dt = to_np_dtype(u.dtype)
    table = {Ops.NEG: lambda: -a[0], Ops.RECIP: lambda: np.reciprocal(a[0]), Ops.SQRT: lambda: np.sqrt(a[0]),
             Ops.EXP2: lambda: np.exp2(a[0]), Ops.LOG2: lambda: np.log2(a[0]), Ops.SIN: lambda: np.sin(a[0]),
             Ops.TRUNC: lambda: np.trunc(a[0]), Ops.NOT: lambda: np.logical_not(a[0]),
             Ops.ADD: lambda: a[0] + a[1], Ops.SUB: lambda: a[0] - a[1], Ops.MUL: lambda: a[0] * a[1],
             Ops.FDIV: lambda: a[0] / a[1], Ops.MAX: lambda: np.maximum(a[0], a[1]), Ops.POW: lambda: a[0] ** a[1],
             Ops.CMPLT: lambda: a[0] < a[1], Ops.CMPNE: lambda: a[0] != a[1], Ops.CMPEQ: lambda: a[0] == a[1],
             Ops.AND: lambda: a[0] & a[1], Ops.OR: lambda: a[0] | a[1], Ops.XOR: lambda: a[0] ^ a[1],
             Ops.WHERE: lambda: np.where(a[0], a[1], a[2]), Ops.MULACC: lambda: a[0] * a[1] + a[2]}
    if op not in table: return None
    return np.asarray(table[op]()).astype(out_dt)

def check_nans(bufs: list[Any], ast: UOp, name: str) -> None:
    """DEBUG_NANS, after a kernel ran: raise FloatingPointError when one of its outputs holds a NaN or Inf, naming the
    operation that produced it (from the realize's NanWatch, when there is one) or else the kernel."""
    import numpy as np
    n_out = 1 if ast.op is not Ops.SINK else sum(1 for x in ast.src if x.op is Ops.STORE)
    for b in bufs[:n_out]:
        if b is None or not dtypes.is_float(b.dtype) or not b.is_allocated(): continue
        if np.isfinite(b.numpy()).all(): continue
        found = NanWatch.current.locate() if NanWatch.current is not None else None
        message = found if found is not None else f"DEBUG_NANS: kernel {name} wrote a NaN or Inf into a {b.dtype} " \
            f"buffer of {b.size} elements (the operation could not be traced on the host)"
        if _viz.TIMED: _viz.record_finding("DEBUG_NANS", message)
        raise FloatingPointError(message)
