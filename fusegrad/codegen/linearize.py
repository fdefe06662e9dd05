"""Linearization: a lowered kernel graph -> an ordered list of UOps with RANGE ... END(RANGE) loop blocks.

Loops form a tree: output loops nest in axis order; the loops of a reduction sit inside the deepest loop its
accumulator's reset depends on. Every node goes in the deepest loop among the ranges its value varies with (so loop
invariant code is hoisted), except that a memory load is never hoisted out of a loop that may run zero times (see
`_sink_loads`), and within one loop the nodes and child loops are ordered topologically."""
from __future__ import annotations
import heapq
from fusegrad.uop.affine import live_ranges_all, range_kind
from fusegrad.uop.ops import Ops, UOp

_LOOP_KINDS = ("global", "loop", "reduce", "copy")
# the ops whose loops are not just their sources' (_loops_of)
# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the passes over every node
# compare against module-level names)
_CONST, _LOAD, _INDEX, _SINK, _END, _RANGE, _STORE = Ops.CONST, Ops.LOAD, Ops.INDEX, Ops.SINK, Ops.END, Ops.RANGE, \
    Ops.STORE
_LOOP_SET_OPS = {Ops.RANGE, Ops.END, Ops.LOAD}
_FIRST = {Ops.DEFINE_GLOBAL: 0, Ops.DEFINE_VAR: 1, Ops.DEFINE_LOCAL: 2, Ops.DEFINE_REG: 2}

def _may_be_empty(r: UOp) -> bool:
    """Whether loop `r` may run zero times."""
    end = r.src[0]
    return (end.arg if end.op is _CONST else end.vmin) <= 0

def _enclosing_loops(parent: dict[UOp, UOp | None], s: UOp | None) -> list[UOp]:
    """Loop `s` and the loops around it, innermost first."""
    ret = []
    while s is not None: ret.append(s); s = parent[s]
    return ret

def _sink_loads(topo: list[UOp], scope: dict[UOp, UOp | None], parent: dict[UOp, UOp | None]) -> None:
    """Move memory loads into loops that may be empty. A load hoisted out of a loop runs even when the loop runs zero
    times, and then it may read out of bounds (an empty buffer, an index made of a size variable that is 0): a load
    whose every use is inside such a loop goes inside the innermost one."""
    loads = [u for u in topo if u.op is _LOAD and u.src[0].op is _INDEX]
    if not loads: return
    # (only the loads' users are needed)
    users: dict[UOp, list[UOp]] = {u: [] for u in loads}
    for u in topo:
        for s in u.src:
            if s in users: users[s].append(u)
    around: dict[UOp | None, set[UOp]] = {}   # each loop's enclosing loops, itself included
    for u in reversed(loads):   # users first: a load used by a load that moves in can follow it
        # where each use needs the value: a loop bound before its loop, anything else in its own loop
        uses = [parent[x] if x in parent else scope[x] for x in users[u] if x.op not in (_SINK, _END)]
        if not uses: continue
        common = _enclosing_loops(parent, uses[0])
        for s in uses[1:]:
            if s is uses[0]: continue
            if (a := around.get(s)) is None: a = around[s] = set(_enclosing_loops(parent, s))
            common = [r for r in common if r in a]
        for r in common:   # innermost first, up to the loop the load already is in
            if r is scope[u]: break
            if _may_be_empty(r):
                scope[u] = r
                break

def linearize(sink: UOp) -> list[UOp]:
    """The nodes of `sink` in execution order; a loop over RANGE r is `r, body..., UOp(Ops.END, src=(r,))`."""
    topo = list(sink.toposort())
    loops_of = _loops_of(topo)
    parent, depth, loops = _loop_tree(topo, loops_of)
    scope = _scopes(topo, loops_of, parent, depth)
    _sink_loads(topo, scope, parent)
    return _BlockOrder(topo, parent, scope, loops).emit(None)

def _loops_of(topo: list[UOp]) -> dict[UOp, frozenset[UOp]]:
    """The loops each node has to be inside: those its value or a source's varies with (an END no longer varies
    with the loops it closes)."""
    live = live_ranges_all(topo, {})
    # (only loops count: a RANGE of another kind may be left in the graph)
    if not all(range_kind(u) in _LOOP_KINDS for u in topo if u.op is _RANGE):
        live = {u: frozenset(r for r in ls if range_kind(r) in _LOOP_KINDS) for u, ls in live.items()}
    # a load from a buffer the kernel also stores to can't be hoisted out of the loops around that store: it has to
    # see what earlier iterations wrote (e.g. partial sums accumulated in the output)
    store_loops: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        if u.op is _STORE and u.src[0].op is _INDEX:
            store_loops[u.src[0].src[0]] = store_loops.get(u.src[0].src[0], frozenset()) | live[u]
    loops_of: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        # a node varies with no loop its sources don't (only a RANGE adds itself): its set is theirs, built only
        # where they differ (most nodes share their sources' set)
        if not (src := u.src): ls = live[u]
        else:
            ls = loops_of[src[0]]
            for s in src[1:]:
                if (o := loops_of[s]) is not ls and not o <= ls: ls = ls | o if ls else o
        if (op := u.op) in _LOOP_SET_OPS:
            if op is _RANGE: ls = ls | live[u]
            elif op is _END: ls = ls - set(src[1:])
            elif src[0].op is _INDEX and src[0].src[0] in store_loops: ls = ls | store_loops[src[0].src[0]]
        loops_of[u] = ls
    return loops_of

def _loop_tree(topo: list[UOp], loops_of: dict[UOp, frozenset[UOp]]) \
        -> tuple[dict[UOp, UOp | None], dict[UOp, int], list[UOp]]:
    """The loop tree: each loop's parent and depth, and the loops in graph order. Output loops nest in axis order;
    another loop (a reduction's) sits in the deepest of the loops its END has to be inside, and of those the END
    closes before it."""
    parent: dict[UOp, UOp | None] = {}
    outs = sorted({r for r in topo if r.op is _RANGE and range_kind(r) in ("global", "loop")},
                  key=lambda r: r.arg[0])
    for i, r in enumerate(outs): parent[r] = outs[i - 1] if i else None
    enclosing: dict[UOp, frozenset[UOp]] = {}
    for u in topo:
        if u.op is not _END: continue
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
    loops = [r for r in topo if r.op is _RANGE and range_kind(r) in _LOOP_KINDS]
    for r in loops: get_depth(r)
    return parent, depth, loops

def _scopes(topo: list[UOp], loops_of: dict[UOp, frozenset[UOp]], parent: dict[UOp, UOp | None],
            depth: dict[UOp, int]) -> dict[UOp, UOp | None]:
    """The loop each node goes in: the deepest of those it has to be inside (None: outside every loop), which must
    hold all the others."""
    scope: dict[UOp, UOp | None] = {}
    ancestors: dict[UOp | None, set[UOp]] = {}   # each loop's enclosing loops, itself included
    for u in topo:
        if u.op is _RANGE and u in parent: scope[u] = u; continue
        ls = loops_of[u]
        s = max(ls, key=lambda r: depth[r]) if ls else None
        if (anc := ancestors.get(s)) is None: anc = ancestors[s] = set(_enclosing_loops(parent, s))
        if not ls.issubset(anc):
            raise RuntimeError(f"{u.op} depends on loops {sorted(r.arg for r in ls - anc)} outside its loop {s.arg}")
        scope[u] = s
    return scope

class _BlockOrder:
    """Writes each loop's body out in order: its nodes and child loops ordered by their dependencies, a child loop
    as RANGE, its body, END."""
    def __init__(self, topo: list[UOp], parent: dict[UOp, UOp | None], scope: dict[UOp, UOp | None],
                 loops: list[UOp]):
        self.order = {u: i for i, u in enumerate(topo)}
        self.parent, self.scope = parent, scope
        self.children: dict[UOp | None, list[UOp]] = {}
        for r in loops: self.children.setdefault(parent[r], []).append(r)
        self.members: dict[UOp | None, list[UOp]] = {}
        for u in topo:
            if u.op in (_SINK, _END) or (u.op is _RANGE and u in parent): continue
            self.members.setdefault(scope[u], []).append(u)
        self.deps = self._dependencies(topo)

    def _dependencies(self, topo: list[UOp]) -> dict[UOp | None, dict[UOp, set[UOp]]]:
        """For each block (a loop, None: the kernel's top level), for each of its items (a node, or a child loop with
        all it holds), the items it needs placed before. A source that `u` reads is needed in exactly one block: the
        innermost one holding both, where they lie in different items. Found from each node's path of items from the
        top, so one pass over the graph's edges serves every block."""
        deps: dict[UOp | None, dict[UOp, set[UOp]]] = {None: {}}
        for r in self.parent: deps[r] = {}
        for b, ms in self.members.items():
            for m in ms: deps[b][m] = set()
        for b, cs in self.children.items():
            for c in cs: deps[b][c] = set()
        chains: dict[UOp | None, tuple[UOp, ...]] = {None: ()}
        def chain(r: UOp | None) -> tuple[UOp, ...]:
            # the loops from the outermost down to r
            if r not in chains: chains[r] = chain(self.parent[r]) + (r,)
            return chains[r]
        # each node's path of items from the top: its loops, then itself (a loop's path ends with the loop)
        parent, scope = self.parent, self.scope
        paths = {u: chain(u) if u in parent else chain(scope[u]) + (u,) for u in topo}
        for u in topo:
            if u.op in (_SINK, _END): continue
            pu = paths[u]
            # (a node and a source that are both nodes of one block, most edges, meet in that block as themselves)
            own, mine = (None, None) if u in parent else (scope[u], deps[scope[u]][u])
            for s in u.src:
                if s.op is _SINK: continue
                if mine is not None and s.op is not _END and s not in parent and scope[s] is own:
                    mine.add(s)
                    continue
                # ENDs are ordering-only: depending on one means depending on the loop it closes
                for x in ((s.src[0],) + s.src[1:] if s.op is _END else (s,)):
                    px = paths[x]
                    i = 0
                    while i < len(pu) and i < len(px) and pu[i] is px[i]: i += 1
                    if i == len(pu) or i == len(px): continue   # one holds the other: the same item at every level
                    block = deps[pu[i - 1] if i else None]
                    if px[i] in block: block[pu[i]].add(px[i])
        return deps

    def schedule(self, items: list[UOp], deps: dict[UOp, set[UOp]]) -> list[UOp]:
        """List scheduling from the end: each step places, last among what's left, the ready item (all its users
        placed) that comes latest in the graph's order. Values land just before their first use (short live ranges:
        loads of the output aren't held in registers across a reduce loop) and loops come early."""
        n_users = {it: 0 for it in items}
        for ds in deps.values():
            for d in ds: n_users[d] += 1
        parent, order = self.parent, self.order
        # (the heap's key, negated: the latest first)
        key = lambda it: (-(_FIRST.get(it.op, 3) if it not in parent else 3), -order[it], id(it), it)
        heap = [key(it) for it in items if n_users[it] == 0]
        heapq.heapify(heap)
        rev: list[UOp] = []
        while heap:
            it = heapq.heappop(heap)[3]
            rev.append(it)
            for d in deps[it]:
                n_users[d] -= 1
                if n_users[d] == 0: heapq.heappush(heap, key(d))
        if len(rev) < len(items): raise RuntimeError("cycle while linearizing")
        return rev[::-1]

    def emit(self, block: UOp | None) -> list[UOp]:
        items: list[UOp] = self.members.get(block, []) + self.children.get(block, [])
        out: list[UOp] = []
        for it in self.schedule(items, self.deps[block]):
            if it in self.parent: out += [it] + self.emit(it) + [UOp(_END, src=(it,))]
            else: out.append(it)
        return out
