"""Memory planning: intermediate buffers whose lifetimes don't overlap share one allocation."""
from __future__ import annotations
from collections.abc import Hashable, Sequence
from typing import Any

def share_storage(uses: Sequence[Sequence[Hashable]], nbytes: dict[Any, int], device: dict[Any, str]) -> dict[Any, Any]:
    """Which buffers can live in another's storage. `uses[i]`: the buffers step i uses (only those that may share:
    intermediates); `nbytes` and `device` of each. Returns {buffer: the buffer whose storage it takes}: a buffer first
    used after the other's last use, on its device, with at least its size (the smallest such)."""
    first: dict[Any, int] = {}
    last: dict[Any, int] = {}
    for i, step in enumerate(uses):
        for b in step:
            first.setdefault(b, i)
            last[b] = i
    # free list of (nbytes, device, base buffer, index after which it is free)
    pool: list[tuple[int, str, Any, int]] = []
    shares: dict[Any, Any] = {}
    for b in first:  # (in order of first use: dicts keep insertion order)
        fits = [p for p in pool if p[1] == device[b] and p[0] >= nbytes[b] and p[3] < first[b]]
        if fits:
            best = min(fits, key=lambda p: p[0])
            pool.remove(best)
            shares[b] = best[2]
            pool.append((best[0], device[b], best[2], last[b]))
        else: pool.append((nbytes[b], device[b], b, last[b]))
    return shares

def plan_memory(items: list[Any], keep: set[int]) -> int:
    """Rewrite `items[i].bufs` so unallocated intermediate buffers (ids not in `keep`) reuse storage of buffers that
    are dead by the time they are first written. Returns the number of buffers that now share storage."""
    bufs: dict[int, Any] = {}
    uses: list[list[int]] = []
    for ei in items:
        step = []
        for b in ei.bufs:
            if b is None or id(b) in keep or b.is_allocated() or getattr(b, "_base", None) is not None: continue
            bufs[id(b)] = b
            step.append(id(b))
        uses.append(step)
    shares = share_storage(uses, {k: b.nbytes for k, b in bufs.items()}, {k: b.device for k, b in bufs.items()})
    if shares:
        assigned = {k: bufs[base].view(bufs[k].size, bufs[k].dtype, 0) for k, base in shares.items()}
        for ei in items: ei.bufs = [assigned.get(id(b), b) if b is not None else None for b in ei.bufs]
    return len(shares)
