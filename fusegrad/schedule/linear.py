"""Step 5 of scheduling: the kernels of a kernelized graph in the order they run, and the item a schedule is made of."""
from __future__ import annotations
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from fusegrad.device import Buffer
from fusegrad.schedule.merge import kernel_outputs
from fusegrad.uop.ops import Ops, UOp, buffer_node

@dataclass
class ScheduleItem:
    """One step of a schedule: a kernel AST (or COPY) with the buffers it uses and the values of its parameters
    (`_p0`, `_p1`, ...: the constants lifted out of the cached kernel)."""
    ast: UOp
    bufs: list[Buffer | None]
    fixedvars: dict[str, Any] = field(default_factory=dict)

def kernels_in_order(sink: UOp, topo: Iterable[UOp] | None = None) -> list[UOp]:
    """Every KERNEL under `sink` (`topo`: its toposort, if the caller has it), dependencies first. Besides data
    dependencies, a kernel that reads a buffer runs before a kernel that overwrites it in place (an ASSIGN target),
    so it sees the old values."""
    kernels = [u for u in (sink.toposort() if topo is None else topo) if u.op is Ops.KERNEL]
    index = {k: i for i, k in enumerate(kernels)}
    deps: dict[UOp, set[UOp]] = {k: set() for k in kernels}
    writers: dict[UOp, UOp] = {}
    for k in kernels:
        for s in k.src:
            if s.op is Ops.ASSIGN and s.src[1] in deps: deps[k].add(s.src[1])
        for o in kernel_outputs(k): writers.setdefault(buffer_node(o), k)
    for k in kernels:
        for s in k.src[len(kernel_outputs(k)):]:
            w = writers.get(s) if s.op is Ops.BUFFER else None
            if w is not None and w is not k and k not in _ancestors(w, deps): deps[w].add(k)
    # Kahn's algorithm, stable in toposort order
    remaining = {k: len(d) for k, d in deps.items()}
    users: dict[UOp, list[UOp]] = {k: [] for k in kernels}
    for k, d in deps.items():
        for x in d: users[x].append(k)
    ready = deque(sorted((k for k, n in remaining.items() if n == 0), key=index.__getitem__))
    out: list[UOp] = []
    while ready:
        k = ready.popleft()
        out.append(k)
        for u in sorted(users[k], key=index.__getitem__):
            remaining[u] -= 1
            if remaining[u] == 0: ready.append(u)
    if len(out) != len(kernels): raise RuntimeError("cycle between kernels (a buffer is read and written in place)")
    return out

def _ancestors(k: UOp, deps: dict[UOp, set[UOp]]) -> set[UOp]:
    seen: set[UOp] = set()
    stack = list(deps[k])
    while stack:
        x = stack.pop()
        if x in seen: continue
        seen.add(x)
        stack.extend(deps[x])
    return seen
