"""Graph utilities every layer above the IR uses: fresh BUFFER nodes, substituting nodes in a graph, the bound
Variables a graph uses, and a graph's structure as a key (the same for graphs that differ only in their buffers)."""
from __future__ import annotations
import itertools
from collections.abc import Container, Iterable
from fusegrad.dtype import DType, dtypes
from fusegrad.uop.ops import Ops, UOp, UOpMetaClass, arg_uops, map_arg_uops, new_node, with_src

_buffer_ids = itertools.count()

def new_buffer(device: UOp, size: int, dtype: DType) -> UOp:
    """A fresh BUFFER node (unique: the id keeps two buffers of equal size and dtype distinct)."""
    # (made as new: the id makes it so)
    u = new_node(_BUFFER, dtype, (device,), (next(_buffer_ids), size))
    # (its shape and device memoized now: a replayed realize makes one per output and asks both soon after)
    d = u.__dict__
    d["_shape"], d["_device"] = (size,), device.arg
    return u

def buffer_stand_in(i: int, buf: UOp) -> UOp:
    """The i-th stand-in for a buffer like `buf` (same device, size and dtype): a graph over stand-ins describes every
    graph of its structure, whatever buffers it reads."""
    return UOp(Ops.BUFFER, buf.dtype, buf.src, (("param", i), buf.arg[1]))

def substitute_map(root: UOp, dvars: dict[UOp, UOp], in_args: bool = False,
                   topo: Iterable[UOp] | None = None) -> dict[UOp, UOp]:
    """old -> new for every node under `root` after replacing the keys of `dvars` by their values. With `in_args`,
    the symbolic expressions inside shape args (movement ops, ASSIGN) are substituted too. `topo` is root's toposort
    if the caller has it (one that stops at the keys of `dvars` is enough: only root's own entry is then complete)."""
    out: dict[UOp, UOp] = {}
    at = out.__getitem__
    for u in (root.toposort() if topo is None else topo):
        if u in dvars: out[u] = dvars[u]; continue
        new_src = tuple(map(at, u.src))  # (map over a bound method: no Python frame per node)
        if not (in_args and _symbolic_arg(u)):
            # (UOps compare by identity, so == on the source tuples is the identity check, done in C)
            out[u] = u if new_src == u.src else with_src(u, new_src)
            continue
        arg = map_arg_uops(u.arg, lambda x: x.substitute(dvars))
        same = arg is u.arg or arg == u.arg and all(a is b for a, b in zip(arg_uops(arg), arg_uops(u.arg)))
        out[u] = u if same and all(a is b for a, b in zip(new_src, u.src)) else u.replace(src=new_src, arg=arg)
    return out

class SharedSubstitution:
    """substitute_map of one replacement map over many roots (every lazy tensor a realize re-points): a node below
    several of them is worked out once, so the walk costs the union of their graphs, not the sum (a program holding
    each step of a chain, or many pending results, would walk a graph per tensor). `sub(root)` is root's node with
    the keys of `dvars` replaced (root itself where none lies below it); the walk stops at the keys."""
    def __init__(self, dvars: dict[UOp, UOp]) -> None: self.new: dict[UOp, UOp] = dict(dvars)
    def __call__(self, root: UOp) -> UOp:
        new = self.new
        if (ret := new.get(root)) is not None: return ret
        at = new.__getitem__
        # depth first, an iterator over each open node's sources: a node is worked out once all its sources are
        stack = [(root, iter(root.src))]
        while stack:
            node, srcs = stack[-1]
            for s in srcs:
                if s not in new:
                    stack.append((s, iter(s.src)))
                    break
            else:
                stack.pop()
                new_src = tuple(map(at, src := node.src))
                # (UOps compare by identity, so == on the source tuples is the identity check, done in C)
                new[node] = node if new_src == src else with_src(node, new_src)
        return new[root]

class BuffersBelow:
    """The nodes of `among` (buffers) below any of several roots, each node walked once over all the roots: `walk(u)`
    adds those below u to `found`."""
    def __init__(self, among: Container[UOp]) -> None:
        self.among, self.seen, self.found = among, set(), set()
    def walk(self, root: UOp) -> None:
        among, seen, found = self.among, self.seen, self.found
        stack = [root]
        while stack:
            if (u := stack.pop()) in seen: continue
            seen.add(u)
            if u in among: found.add(u)
            stack.extend(u.src)

def _symbolic_arg(u: UOp) -> bool:
    """Whether u's arg may hold symbolic sizes: a shape, shrink or pad tuple, or a tensor-level iota's length."""
    return type(u.arg) is tuple or (u.op is Ops.RANGE and isinstance(u.arg, UOp))

def bound_variables(topo: Iterable[UOp]) -> dict[UOp, UOp]:
    """BIND -> its Variable, for every bound Variable used by these nodes (as a value or in a symbolic shape)."""
    binds: dict[UOp, UOp] = {}
    if not UOpMetaClass.binds_made: return binds
    for u in topo:
        if u.op is Ops.BIND: binds[u] = u.src[0]
        elif _symbolic_arg(u):
            for x in arg_uops(u.arg):
                for b in x.toposort():
                    if b.op is Ops.BIND: binds[b] = b.src[0]
    return binds

def var_values(binds: Iterable[UOp]) -> dict[str, int]:
    """Variable name -> bound value; one Variable bound to two values in one schedule is an error."""
    out: dict[str, int] = {}
    for b in binds:
        (var, val) = b.unbind()
        if out.setdefault(var.arg[0], val) != val:
            raise ValueError(f"Variable {var.arg[0]} is bound to both {out[var.arg[0]]} and {val} in one computation")
    return out

def is_liftable(u: UOp) -> bool:
    """A tensor-level constant that may become a kernel parameter (not bool: masks fold into control flow)."""
    return u.op is Ops.CONST and bool(u.src) and u.dtype != dtypes.bool and u.dtype != dtypes.index

def structure_key(topo: list[UOp]) -> tuple[tuple, list[UOp]]:
    """The structure of a graph without bound Variables as a key, and its liftable constants: StructureWalk's parts
    for the nodes of `topo` (a toposort: each node after its sources) in that order. It describes the same graph as
    the normalized one (buffers as stand-ins, liftable constants as placeholders) as a tuple with a node per toposort
    position, each naming its sources by position."""
    walk = StructureWalk().walk(topo)  # (every node's sources are placed before it: each is placed where it stands)
    return tuple(walk.parts), walk.consts

class StructureWalk:
    """The toposort of a graph given by its roots (the sources of the SINK a schedule would make) and its structure
    key, made in one walk: `position` is the toposort (node -> index, in order), and `key()` equals
    `structure_key` of the toposort of the roots' SINK. This is the one definition of a node's part in the key: the
    BUFFERs named by size alone, liftable constants by "_c" (their values are checked against the cache entry's),
    every other node by its op, dtype, sources' positions and its arg's key. `walk` may be called again with more
    roots: the toposort goes on as `toposort(known=...)` would (a realize adds the readers of the buffers it
    overwrites). `assigns` lists the ASSIGN nodes met."""
    __slots__ = ("position", "parts", "consts", "assigns", "roots")
    def __init__(self) -> None:
        self.position: dict[UOp, int] = {}
        self.parts: list[tuple] = []
        self.consts: list[UOp] = []
        self.assigns: list[UOp] = []
        self.roots: list[UOp] = []

    def walk(self, roots: Iterable[UOp]) -> StructureWalk:
        # (written for speed: a realize walks its whole graph. The order is the one of UOp.toposort, a depth-first
        # post-order with the sources in order. Recursion is the cheapest walk in Python (~40% less time than a stack
        # of iterators); a graph deeper than the recursion limit is finished by the iterative walk, which goes on
        # from the nodes placed so far: they are a prefix of the same order, so the result is the same)
        position, consts, assigns = self.position, self.consts, self.assigns
        get, append = position.get, self.parts.append

        def place(u: UOp) -> int:
            """Place u after its sources (placing those first), and return its position."""
            src = u.src
            # (most nodes have one or two sources: no list for those)
            if (n := len(src)) == 1:
                if (i := get(s := src[0])) is None: i = place(s)
                at: tuple[int, ...] = (i,)
            elif n == 2:
                if (i := get(s := src[0])) is None: i = place(s)
                if (j := get(s := src[1])) is None: j = place(s)
                at = (i, j)
            else:
                positions = []
                for s in src:
                    if (i := get(s)) is None: i = place(s)
                    positions.append(i)
                at = tuple(positions)
            # (no Python call from here on: a RecursionError, raised only where a call begins, never leaves a node
            # half placed)
            op = u.op
            if op is _BUFFER: arg: object = ("param", u.arg[1])
            elif op is _CONST and src and (dt := u.dtype) is not _BOOL and dt is not _INDEX:  # is_liftable
                arg = "_c"
                consts.append(u)
            else:
                arg = u._ukey[3]
                if op is _ASSIGN: assigns.append(u)
            position[u] = i = len(position)
            append((op, u.dtype, at, arg))
            return i

        def place_deep(root: UOp) -> None:
            """place(root) without recursion: a node is placed once its sources are (so place() doesn't recurse)."""
            stack = [(root, iter(root.src))]
            while stack:
                u, srcs = stack[-1]
                for s in srcs:
                    if s not in position:
                        stack.append((s, iter(s.src)))
                        break
                else:
                    stack.pop()
                    place(u)

        try:
            for root in roots:
                self.roots.append(root)
                if root in position: continue
                try: place(root)
                except RecursionError: place_deep(root)
        finally:
            # (place refers to itself: without this cycle, the nodes walked are freed by reference counting)
            place = None  # type: ignore[assignment]  # noqa: F841
        return self

    def key(self) -> tuple:
        """The structure key of the SINK of every root walked."""
        return (*self.parts, (Ops.SINK, dtypes.void, tuple(map(self.position.__getitem__, self.roots)), None))

    def topo(self, sink: UOp) -> list[UOp]:
        """The toposort of `sink` (the SINK of the roots) as a list."""
        return [*self.position, sink]

_BUFFER, _CONST, _ASSIGN = Ops.BUFFER, Ops.CONST, Ops.ASSIGN
_BOOL, _INDEX = dtypes.bool, dtypes.index
