"""The schedule cache's fast path. The first schedule of a graph structure records a ReplayPlan in its cache entry:
the kernels in order with where each one's buffers and parameters sit in the graph's toposort, the fresh output
buffers, and which buffer each realized node becomes. A later graph of the same structure (the next training step)
gets its kernels and its tensors' new buffers from the plan, without instantiating the cached kernel graph, ordering
its kernels or rewriting tensors twice."""
from __future__ import annotations
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from fusegrad.device import Buffer
from fusegrad.dtype import DType
from fusegrad.schedule.linear import ScheduleItem
from fusegrad.schedule.memory import share_storage
from fusegrad.uop.graph import new_buffer, substitute_map
from fusegrad.uop.ops import GroupOp, Ops, UOp, buffer_node, device_buffer, new_node

_RESHAPE = Ops.RESHAPE

# A buffer reference: a toposort position (a BUFFER of the graph) when >= 0, else ~i for the i-th fresh output buffer.
BufferRef = int

@dataclass(frozen=True)
class ReplayPlan:
    outs: tuple[tuple[UOp, int, DType], ...]                         # fresh output buffers: (device, size, dtype)
    kernels: tuple[tuple[UOp, tuple[BufferRef, ...], tuple[int, ...]], ...]  # (AST, buffers, parameters' positions)
    results: tuple[tuple[int, BufferRef, tuple[int, ...] | None], ...]  # (position, its buffer, reshaped to)
    # fresh buffers that no tensor keeps -> which other one's storage each takes, per set of kept ones (see
    # memory.share_storage: the same structure plans the same way every step)
    shares: dict[frozenset[int], dict[int, int]] = field(default_factory=dict, compare=False)
    # kept for the engine, which lowers the items (engine/realize.py lower_replayed): each kernel's runner, per values
    # of the knobs that change generated code (CODEGEN_KNOBS), so a replayed step skips the method cache lookup of
    # each kernel
    runners: dict[tuple[int, ...], tuple[Any, ...]] = field(default_factory=dict, compare=False)
    # each kernel's launch prepared over all its buffers (CompiledRunner.prepare: arguments converted once; the
    # buffers are passed per step, so no memory is held here), with the parameter values it was made for; False for
    # a kernel that has none. Per values of the code and thread knobs.
    launches: dict[tuple, list[Any]] = field(default_factory=dict, compare=False)
    # per values of the code and launch knobs: the runners and prepared launches when the engine can launch a replay
    # straight from the plan (engine/realize.py replay_runners)
    direct: dict[tuple[int, ...], Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # per result reshaped: whether the reshape is a realized tensor's plain form (_is_plain_buffer of the tensor
        # front end: another shape than its buffer's, all ints, not empty), known from the plan alone
        plain = tuple(ref < 0 and shape is not None and shape != (self.outs[~ref][1],) and 0 not in shape
                      for _, ref, shape in self.results)
        object.__setattr__(self, "_plain", plain)
        # the fresh buffers' device names in canonical form (what Buffer's constructor makes of them), for Buffer.fresh
        object.__setattr__(self, "_devices", tuple(Buffer(d.arg, 0, dtype).device for d, _, dtype in self.outs))

    def instantiate(self, topo: list[UOp]) -> tuple[list[UOp], dict[UOp, UOp]]:
        """For a graph of the recorded structure (`topo`: its toposort): its fresh output buffers, and each realized
        node -> the buffer (view) it becomes."""
        outs = [new_buffer(device, size, dtype) for device, size, dtype in self.outs]
        results: dict[UOp, UOp] = {}
        for (pos, ref, shape), plain in zip(self.results, self._plain):
            b = topo[ref] if ref >= 0 else outs[~ref]
            if shape is not None:
                # (a reshape of a fresh buffer is a new node too; the shape, a tuple of ints, is its own key)
                b = UOp(_RESHAPE, b.dtype, (b,), shape) if ref >= 0 else new_node(_RESHAPE, b.dtype, (b,), shape)
                d = b.__dict__
                d["_shape"] = shape  # (the shape of a reshape is its arg)
                if plain: d["_plain"] = True
            results[topo[pos]] = b
        return outs, results

    def storage(self, outs: list[UOp], kept: frozenset[int]) -> list[Buffer]:
        """The Buffers of the fresh buffers `outs`: those in `kept` (indices: the ones a tensor holds from now on) get
        their own, the others share storage where their lifetimes allow."""
        if (shares := self.shares.get(kept)) is None:
            uses = [[~r for r in refs if r < 0 and ~r not in kept] for _, refs, _ in self.kernels]
            temps = {i for step in uses for i in step}
            nbytes = {i: self.outs[i][1] * self.outs[i][2].itemsize for i in temps}
            shares = self.shares[kept] = share_storage(uses, nbytes, {i: self.outs[i][0].arg for i in temps})
        storage: list[Any] = [None] * len(outs)
        for i, ((_, size, dtype), device) in enumerate(zip(self.outs, self._devices)):
            if i in shares: continue
            # (a temporary's storage nothing else names: a plain Buffer, not one registered for its BUFFER node; a
            # kept one's is registered in its fresh node, which has none yet)
            storage[i] = b = Buffer.fresh(device, size, dtype)
            if i in kept: outs[i].__dict__["_buffer"] = b
        for i, base in shares.items(): storage[i] = storage[base].view(self.outs[i][1], self.outs[i][2], 0)
        return storage

    def kernel_buffers(self, topo: list[UOp], storage: list[Buffer]) -> list[list[Buffer]]:
        """Each kernel's Buffers, for a graph of the recorded structure (`topo`) and its fresh buffers' `storage`."""
        return [[device_buffer(topo[r]) if r >= 0 else storage[~r] for r in refs] for _, refs, _ in self.kernels]

    def items(self, topo: list[UOp], outs: list[UOp], kept: frozenset[int]) -> list[ScheduleItem]:
        """The kernels over this graph's buffers and `outs`. Outputs in `kept` (indices: those a tensor holds from now
        on) get their own Buffers; the others share storage where their lifetimes allow."""
        bufs = self.kernel_buffers(topo, self.storage(outs, kept))
        return [ScheduleItem(ast, b, {f"_p{i}": topo[p].arg for i, p in enumerate(params)})
                for (ast, _, params), b in zip(self.kernels, bufs)]

# the ops whose gradient is not that of their value: a graph re-pointed past one would be differentiated otherwise
_GRADIENT_RULES = (Ops.DETACH, Ops.CUSTOM_GRAD)
# (a COMPOSITE's arg and its sources' shapes and dtypes) -> whether its graph holds a DETACH or CUSTOM_GRAD
_rules_known: dict[tuple, bool] = {}

def _composite_has_rules(c: UOp) -> bool:
    """Whether COMPOSITE node `c`'s graph (its sources' graphs not counted) holds a DETACH or CUSTOM_GRAD."""
    key = (c.arg, tuple((s.shape, s.dtype) for s in c.src))
    if (known := _rules_known.get(key)) is not None: return known
    srcs = set(c.src)
    found = any(n not in srcs and (n.op in _GRADIENT_RULES or n.op is Ops.COMPOSITE and _composite_has_rules(n))
                for n in c.arg.expand(c.src).toposort(gate=lambda n: n not in srcs))
    if len(_rules_known) >= 4096: _rules_known.clear()
    _rules_known[key] = found
    return found

def shared_replacements(replaced: dict[UOp, UOp], topo: Iterable[UOp], roots: Iterable[UOp]) -> dict[UOp, UOp]:
    """The replacements every live tensor takes after a schedule: those of the scheduled tensors' own nodes (`roots`)
    and of BUFFERs; of a node one of the schedule's kernels computes (its buffer from now on, as in tinygrad: a graph
    reusing it needn't compute it again, and autodiff stops there); and of a node the scheduler rewrote (a graph over
    such buffers, a composite expanded, a sum over an axis of size 1 made a view) where no DETACH or CUSTOM_GRAD lies
    between the node and the buffers it reads (composites' graphs included). Where one does, the rewrite dropped it (a
    DETACH is its source's value, relu's own derivative a MAX's), and a lazy tensor holding the node keeps its graph:
    re-pointed, it would be differentiated otherwise once a value was read (numpy() schedules a copy). `topo`: the
    toposort of the graph scheduled."""
    computed = {k for k, v in replaced.items() if k is not v and v.base.op is Ops.ASSIGN}
    rules: dict[UOp, bool] = {}
    for u in topo:
        # (above a node computed into a buffer, autodiff stops at that buffer)
        rules[u] = u not in computed and (u.op in _GRADIENT_RULES or any(rules.get(s, False) for s in u.src) or
                                          u.op is Ops.COMPOSITE and _composite_has_rules(u))
    keep = set(roots)
    return {k: v for k, v in replaced.items()
            if k is not v and (k in keep or k.op is Ops.BUFFER or k in computed or rules.get(k, True) is False)}

def record_replay(topo: list[UOp], kernels: list[UOp], becomes: dict[UOp, UOp],
                  shared: dict[UOp, UOp]) -> ReplayPlan | None:
    """The plan of a schedule just made: `topo` the graph's toposort, `kernels` its KERNEL nodes in run order (those
    with an empty output left out), `shared` the replacements of the graph's nodes the live tensors take
    (shared_replacements), `becomes` the buffer each realized replacement became. None when a realized node's buffer
    isn't a plain one (a view into a slice)."""
    position = {u: i for i, u in enumerate(topo)}
    outs: dict[UOp, int] = {}
    def ref(b: UOp) -> BufferRef:
        b = buffer_node(b)
        if b in position: return position[b]
        if b not in outs: outs[b] = len(outs)
        return ~outs[b]
    planned = []
    for k in kernels:
        refs, params = [], []
        for s in k.src:
            if s.op is not Ops.CONST: refs.append(ref(s))
            elif s in position: params.append(position[s])
            else: return None  # a parameter that isn't one of the graph's constants
        planned.append((k.arg, tuple(refs), tuple(params)))
    results = []
    for u, r in shared.items():
        # a realized node, or a view of one: its buffer. Other replaced nodes stay out (a lazy tensor holding one is
        # rewritten over the new buffers instead: the same values)
        if (b := becomes.get(r)) is None and r.op in GroupOp.Movement:
            if r.base in becomes:
                b = substitute_map(r, becomes, topo=r.toposort(gate=lambda x: x not in becomes))[r]  # (not below them)
            # a view of one of the graph's own buffers (a sum over axes of size 1 simplified away): a later step's
            # node becomes the same view of its buffer, as the general path re-points it
            elif r.base.op is Ops.BUFFER and r.base in position: b = r
        if b is None: continue
        base = b
        while base.op is Ops.RESHAPE: base = base.src[0]  # (a reshape of a reshape is one reshape)
        if base.op is not Ops.BUFFER: continue  # an expanded or padded view: rewritten like the others
        if not all(type(s) is int for s in b.shape): return None
        results.append((position[u], ref(base), None if b is base else b.shape))
    # the tensors scheduled must all end up as buffers
    done = {topo[pos] for pos, _, _ in results}
    if not all(u in done or u.op is Ops.BUFFER or (u.op is Ops.RESHAPE and u.src[0].op is Ops.BUFFER)
               for u in topo[-1].src):
        return None
    return ReplayPlan(tuple((b.src[0], b.arg[1], b.dtype) for b in outs), tuple(planned), tuple(results))
