"""Memory planning: intermediate buffers whose lifetimes don't overlap share one allocation."""
from __future__ import annotations
from typing import Any

def plan_memory(items: list[Any], keep: set[int]) -> int:
    """Rewrite `items[i].bufs` so unallocated intermediate buffers (ids not in `keep`) reuse storage of buffers that
    are dead by the time they are first written. Returns the number of buffers that now share storage."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    bufs: dict[int, Any] = {}
    for i, ei in enumerate(items):
        for b in ei.bufs:
            if b is None or id(b) in keep or b.is_allocated() or getattr(b, "_base", None) is not None: continue
            bufs[id(b)] = b
            first.setdefault(id(b), i)
            last[id(b)] = i
    # free list of (nbytes, device, base buffer, index after which it is free)
    pool: list[tuple[int, str, Any, int]] = []
    assigned: dict[int, Any] = {}
    shared = 0
    for bid in sorted(bufs, key=lambda x: (first[x], x)):
        b = bufs[bid]
        fits = [p for p in pool if p[1] == b.device and p[0] >= b.nbytes and p[3] < first[bid]]
        if fits:
            best = min(fits, key=lambda p: p[0])
            pool.remove(best)
            base = best[2]
            assigned[bid] = base.view(b.size, b.dtype, 0)
            shared += 1
        else:
            base = b
        pool.append((base.nbytes, b.device, base, last[bid]))
    if assigned:
        for ei in items: ei.bufs = [assigned.get(id(b), b) if b is not None else None for b in ei.bufs]
    return shared
