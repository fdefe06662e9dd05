"""Linearization: a lowered kernel graph -> an ordered list of UOps with RANGE ... END(RANGE) loop blocks.

Loops form a tree: output loops nest in axis order; the loops of a reduction sit inside the deepest loop its
accumulator's reset depends on. Every node goes in the deepest loop among the ranges its value varies with (so loop
invariant code is hoisted), except that a memory load is never hoisted out of a loop that may run zero times (see
`_sink_loads`), and within one loop the nodes and child loops are ordered topologically."""
from __future__ import annotations
import heapq
from fusegrad.uop.affine import live_ranges, range_kind
from fusegrad.uop.ops import Ops, UOp

_LOOP_KINDS = ("global", "loop", "reduce", "copy")
_FIRST = {Ops.DEFINE_GLOBAL: 0, Ops.DEFINE_VAR: 1, Ops.DEFINE_LOCAL: 2, Ops.DEFINE_REG: 2}

def _may_be_empty(r: UOp) -> bool:
    """Whether loop `r` may run zero times."""
    end = r.src[0]
    return (end.arg if end.op is Ops.CONST else end.vmin) <= 0

def _sink_loads(topo: list[UOp], scope: dict[UOp, UOp | None], parent: dict[UOp, UOp | None]) -> None:
    """Move memory loads into loops that may be empty. A load hoisted out of a loop runs even when the loop runs zero
    times, and then it may read out of bounds (an empty buffer, an index made of a size variable that is 0): a load
    whose every use is inside such a loop goes inside the innermost one."""
    users: dict[UOp, list[UOp]] = {}
    for u in topo:
        for s in u.src: users.setdefault(s, []).append(u)
    def chain(s: UOp | None) -> list[UOp]:   # s and the loops around it, innermost first
        ret = []
        while s is not None: ret.append(s); s = parent[s]
        return ret
    for u in reversed(topo):   # users first: a load used by a load that moves in can follow it
        if u.op is not Ops.LOAD or u.src[0].op is not Ops.INDEX: continue
        # where each use needs the value: a loop bound before its loop, anything else in its own loop
        uses = [parent[x] if x in parent else scope[x] for x in users.get(u, []) if x.op not in (Ops.SINK, Ops.END)]
        if not uses: continue
        common = chain(uses[0])
        for s in uses[1:]:
            around = set(chain(s))
            common = [r for r in common if r in around]
        for r in common:   # innermost first, up to the loop the load already is in
            if r is scope[u]: break
            if _may_be_empty(r):
                scope[u] = r
                break

def linearize(sink: UOp) -> list[UOp]:
    """The nodes of `sink` in execution order; a loop over RANGE r is `r, body..., UOp(Ops.END, src=(r,))`."""
    topo = list(sink.toposort())
    order = {u: i for i, u in enumerate(topo)}
    memo: dict[UOp, frozenset[UOp]] = {}
    live = {u: frozenset(r for r in live_ranges(u, memo) if range_kind(r) in _LOOP_KINDS) for u in topo}
    # a load from a buffer the kernel also stores to can't be hoisted out of the loops around that store: it has to
    # see what earlier iterations wrote (e.g. partial sums accumulated in the output)
    store_loops: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        if u.op is Ops.STORE and u.src[0].op is Ops.INDEX:
            store_loops[u.src[0].src[0]] = store_loops.get(u.src[0].src[0], frozenset()) | live[u]
    loops_of: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        ls = frozenset().union(*[loops_of[s] for s in u.src]) | live[u]
        if u.op is Ops.END: ls = ls - set(u.src[1:])
        if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0] in store_loops:
            ls = ls | store_loops[u.src[0].src[0]]
        loops_of[u] = ls

    # *** the loop tree ***
    parent: dict[UOp, UOp | None] = {}
    outs = sorted({r for r in topo if r.op is Ops.RANGE and range_kind(r) in ("global", "loop")},
                  key=lambda r: r.arg[0])
    for i, r in enumerate(outs): parent[r] = outs[i - 1] if i else None
    enclosing: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        if u.op is not Ops.END: continue
        for i, r in enumerate(u.src[1:]):
            if r in enclosing: continue
            enclosing[r] = loops_of[u] | frozenset(u.src[1:1 + i])
    depth: dict[UOp, int] = {}
    def get_depth(r: UOp) -> int:
        if r not in depth:
            if r not in parent:
                encl = enclosing.get(r, frozenset())
                parent[r] = max(encl, key=get_depth) if encl else None
            depth[r] = 0 if parent[r] is None else get_depth(parent[r]) + 1
        return depth[r]
    loops = [r for r in topo if r.op is Ops.RANGE and range_kind(r) in _LOOP_KINDS]
    for r in loops: get_depth(r)

    def ancestors(r: UOp | None) -> list[UOp]:
        ret = []
        while r is not None: ret.append(r); r = parent[r]
        return ret

    scope: dict[UOp, UOp | None] = {}
    for u in topo:
        if u.op is Ops.RANGE and u in parent: scope[u] = u; continue
        ls = loops_of[u]
        s = max(ls, key=lambda r: depth[r]) if ls else None
        if not ls.issubset(anc := set(ancestors(s))):
            raise RuntimeError(f"{u.op} depends on loops {sorted(r.arg for r in ls - anc)} outside its loop {s.arg}")
        scope[u] = s
    _sink_loads(topo, scope, parent)
    children: dict[UOp | None, list[UOp]] = {}
    for r in loops: children.setdefault(parent[r], []).append(r)
    members: dict[UOp | None, list[UOp]] = {}
    for u in topo:
        if u.op in (Ops.SINK, Ops.END) or (u.op is Ops.RANGE and u in parent): continue
        members.setdefault(scope[u], []).append(u)

    def item_in(u: UOp, block: UOp | None) -> UOp | None:
        """What `u` is inside `block`: itself, the child loop of `block` containing it, or None (outside)."""
        s = scope[u]
        if s is block and u not in parent: return u
        while s is not None and parent.get(s) is not block: s = parent.get(s)
        return s

    def subtree(r: UOp) -> list[UOp]:
        ret = [r] + members.get(r, [])
        for c in children.get(r, []): ret += subtree(c)
        return ret

    def emit(block: UOp | None) -> list[UOp]:
        items: list[UOp] = members.get(block, []) + children.get(block, [])
        deps: dict[UOp, set[UOp]] = {it: set() for it in items}
        for it in items:
            nodes = subtree(it) if it in parent else [it]
            inside = set(nodes)
            for n in nodes:
                for s in n.src:
                    if s in inside or s.op is Ops.SINK: continue
                    # ENDs are ordering-only: depending on one means depending on the loop it closes
                    srcs = [s] if s.op is not Ops.END else [s.src[0]]
                    for x in srcs:
                        d = item_in(x, block)
                        if d is not None and d is not it and d in deps: deps[it].add(d)
                    if s.op is Ops.END:
                        for x in s.src[1:]:
                            d = item_in(x, block)
                            if d is not None and d is not it and d in deps: deps[it].add(d)
        # list scheduling from the end: each step places, last among what's left, the ready item (all its users
        # placed) that comes latest in the graph's order. Values land just before their first use (short live
        # ranges: loads of the output aren't held in registers across a reduce loop) and loops come early.
        n_users = {it: 0 for it in items}
        for ds in deps.values():
            for d in ds: n_users[d] += 1
        key = lambda it: (_FIRST.get(it.op, 3) if it not in parent else 3, order[it])
        heap = [(tuple(-k for k in key(it)), id(it), it) for it in items if n_users[it] == 0]
        heapq.heapify(heap)
        rev: list[UOp] = []
        while heap:
            _, _, it = heapq.heappop(heap)
            rev.append(it)
            for d in deps[it]:
                n_users[d] -= 1
                if n_users[d] == 0: heapq.heappush(heap, (tuple(-k for k in key(d)), id(d), d))
        if len(rev) < len(items): raise RuntimeError("cycle while linearizing")
        out: list[UOp] = []
        for it in reversed(rev):
            if it in parent: out += [it] + emit(it) + [UOp(Ops.END, src=(it,))]
            else: out.append(it)
        return out

    return emit(None)
