"""The scheduler's entry point: the graph of the tensors to compute -> the kernels that compute it, in order, over
device Buffers, and the values of the bound Variables. The live tensors are the caller's: it passes down how to
re-point them at their nodes' replacements and which buffers they hold (see LiveGraphs)."""
from __future__ import annotations
from collections.abc import Container
from typing import Protocol
from fusegrad.device import Buffer
from fusegrad.schedule.kernelize import CacheLookup, cached_entry, kernelize_map_cached, schedule_cache, \
    schedule_cache_lookup, schedule_cache_stats
from fusegrad.schedule.linear import ScheduleItem, kernels_in_order
from fusegrad.schedule.memory import plan_memory
from fusegrad.schedule.merge import kernel_outputs
from fusegrad.schedule.replay import ReplayPlan, record_replay, shared_replacements
from fusegrad.uop.graph import StructureWalk
from fusegrad.uop.ops import Ops, UOp, buffer_node, device_buffer, is_realized, toposort_memo
from fusegrad.viz import record as _viz

class LiveGraphs(Protocol):
    """What scheduling needs from the live tensors, passed down by the Tensor front end."""
    def apply(self, replacements: dict[UOp, UOp]) -> None:
        """Point every live tensor at its node's replacement."""
    def roots(self) -> list[UOp]:
        """The graphs of the tensors being scheduled, as they are now."""
    def held_buffers(self, among: Container[UOp]) -> set[UOp]:
        """The BUFFER nodes `among` these that live tensors hold (so they keep their own memory)."""
    def apply_and_hold(self, replacements: dict[UOp, UOp], among: Container[UOp]) -> set[UOp]:
        """apply(replacements), then held_buffers(among)."""

def replay_plan(walk: StructureWalk) -> ReplayPlan | None:
    """The replay plan of the structure of the graph `walk` went through (a graph without bound Variables), when the
    schedule cache has one for it and its constants' values."""
    return replay_plan_for(walk.key(), walk.consts)

def replay_plan_for(skey: tuple, consts: list[UOp]) -> ReplayPlan | None:
    """The replay plan of the structure key `skey` (StructureWalk.key) for these values of the graph's liftable
    constants `consts`, when the schedule cache has one."""
    entry = cached_entry(skey, consts)
    return entry.replay if entry is not None else None

def replay_buffers(plan: ReplayPlan, topo: list[UOp], live: LiveGraphs) -> list[Buffer]:
    """The Buffers of the fresh buffers of `plan` for a graph of its structure (`topo`: its toposort), the live
    tensors re-pointed at what their nodes became: a replayed schedule without ScheduleItems (the engine runs the
    plan's kernels on these and the graph's buffers, engine/realize.py run_replayed)."""
    schedule_cache_stats["hits"] += 1
    outs, results = plan.instantiate(topo)
    index = {o: i for i, o in enumerate(outs)}
    return plan.storage(outs, frozenset([index[b] for b in live.apply_and_hold(results, index)]))

def create_schedule_with_vars(graph: UOp, topo: dict[UOp, None], live: LiveGraphs, lookup: CacheLookup | None = None) \
        -> tuple[list[ScheduleItem], dict[str, int], ReplayPlan | None]:
    """The items that compute `graph` (a SINK of the tensors to compute; `topo`: its toposort), the values of the bound
    Variables they use (by name), and the replay plan the items were instantiated from (None for a schedule made
    afresh). Afterwards every live tensor points at what its node became: a buffer for each node computed.
    (`lookup`: schedule_cache_lookup(graph, topo), if the caller made it.)"""
    var_vals: dict[str, int] = {}
    if lookup is None: lookup = schedule_cache_lookup(graph, topo)
    if lookup.entry is not None and (plan := lookup.entry.replay) is not None:
        # this structure was scheduled before: its kernels, the realized nodes' buffers and the memory plan come
        # from the plan
        schedule_cache_stats["hits"] += 1
        outs, results = plan.instantiate(lookup.topo)
        live.apply(results)
        index = {o: i for i, o in enumerate(outs)}
        kept = frozenset(index[b] for b in live.held_buffers(index))
        items = plan.items(lookup.topo, outs, kept)
        if _viz.VIZ: _viz.record_schedule(graph, {}, items)
        return items, var_vals, plan
    # (the kernels' graphs are walked from many places while they are built and merged: each walk is made once)
    with toposort_memo(): replaced = kernelize_map_cached(graph, var_vals, lookup)
    live.apply(shared := shared_replacements(replaced, topo, live.roots()))
    sink = UOp.sink_of(*live.roots())
    topo = sink.toposort()
    # (kernels with an empty output have nothing to run)
    kernels = [k for k in kernels_in_order(sink, topo) if buffer_node(k.src[0]).arg[1] > 0]  # type: ignore[union-attr]
    # a kernel's sources are its buffers, then the constants its parameters _p0, _p1... take in this call
    items = []
    for k in kernels:
        bufs, fixedvars = [], {}
        for b in k.src:
            if b.op is Ops.CONST: fixedvars[f"_p{len(fixedvars)}"] = b.arg
            else: bufs.append(device_buffer(b))
        items.append(ScheduleItem(k.arg, bufs, fixedvars))
    # every kernel output is a buffer from now on (those of a kernel with several outputs that only the
    # replaced nodes reach too: the kernel's sources name its outputs' buffers, not their ASSIGNs)
    becomes = {u: (u.src[0].reshape(u.arg) if u.arg != u.src[0].shape else u.src[0])
               for u in UOp.sink_of(sink, *replaced.values()).toposort()
               if u.op is Ops.ASSIGN and is_realized(u)}
    live.apply(becomes)
    written = {buffer_node(o) for k in kernels for o in kernel_outputs(k)}
    if lookup.skey is not None and (entry := schedule_cache.get(lookup.skey)) is not None and \
            entry.replay is None:
        entry.replay = record_replay(lookup.topo, kernels, becomes, shared)
    # (only this schedule's buffers are planned)
    plan_memory(items, {id(device_buffer(b)) for b in live.held_buffers(written)})
    if _viz.VIZ: _viz.record_schedule(graph, replaced, items)
    return items, var_vals, None
