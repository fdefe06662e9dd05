"""Running schedules: an `ExecItem` (kernel AST + buffers) is lowered to a `Runner` (a compiled kernel, a copy or a
no-op view), buffers are allocated, the runners run, and `GlobalCounters` count the work."""
from __future__ import annotations
import ctypes
import functools
import itertools
import math
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable
from fusegrad.device import Buffer, Device, GlobalCounters, UnrunScheduleError, unwritten_buffers
from fusegrad.engine.explain import DEBUG_NANS, check_nans
from fusegrad.dtype import dtypes
from fusegrad.helpers import BEAM, CPU_ASYNC, CPU_THREADS, DEBUG, NOOPT, TRANSCENDENTAL, ContextVar, ansilen, colored
from fusegrad.hostcpu import host_cpu_count
from fusegrad.renderer import ALLOW_TF32, Estimates, ProgramSpec
from fusegrad.runtime.cpu_compiler import CPUCompiler, TieredCompiler
from fusegrad.runtime.cpu_memory import CPUAllocator
from fusegrad.runtime.cpu_pool import HOST_COPY_SOURCE
from fusegrad.runtime.cpu_program import CPUProgram, LaunchGraph
from fusegrad.schedule.linear import ScheduleItem
from fusegrad.schedule.merge import takes_memory
from fusegrad.schedule.replay import ReplayPlan
from fusegrad.uop.affine import coeff
from fusegrad.uop.ops import GroupOp, Ops, UOp, _arg_key, _c_idiv, _c_mod, _compute_min_max, _minmax_of_products, \
    device_buffer, exec_alu, python_alu
from fusegrad.viz import record as _viz

__all__ = ["ExecItem", "Runner", "CompiledRunner", "BufferCopy", "ViewOp", "GlobalCounters", "get_runner",
           "lower_schedule_item", "exec_items", "run_schedule", "compile_kernels", "method_cache", "capturing",
           "replay_runners", "run_replayed", "expect_writes", "UnrunScheduleError"]

# a kernel is split across threads only when it does enough work: a dispatch through the C pool costs a few us, so
# below these bounds one thread finishes first (DESIGN.md, "Measurements")
THREAD_MIN_OPS, THREAD_MIN_MEM = 1 << 17, 1 << 20
# a device that queues kernels (CPU) has the calling thread run part of a split kernel itself, when nothing is queued
# ahead of it, only for kernels of about a millisecond and more: there a second core halves the time to the result,
# where for shorter ones the caller's next Python is worth more (measured in DESIGN.md, "CPU kernels run
# asynchronously")
JOIN_MIN_OPS, JOIN_MIN_MEM = 1 << 28, 1 << 25
# a chunk of about a quarter of a second and more is run by the device's workers alone, never by the calling thread,
# which stays free to take a Ctrl-C while it waits (the kernel runs on to its end in the background)
LONG_CHUNK_OPS, LONG_CHUNK_MEM = 1 << 29, 1 << 31

def sym_infer(x: Any, var_vals: dict[str, int]) -> int:
    """The value of an int or of a symbolic expression of Variables given by name in var_vals."""
    if isinstance(x, int): return x
    if (fn := _evaluators.get(x)) is None:
        if len(_evaluators) >= 4096: _evaluators.clear()   # (bounded: a long run compiles ever new kernels)
        fn = _evaluators[x] = _evaluator(x)
    if fn is not False: return fn(var_vals)
    subs = {u: u.const_like(var_vals[u.arg[0]]) for u in x.toposort() if u.op is Ops.DEFINE_VAR}
    return int(x.substitute(subs))

# per symbolic expression, the function sym_infer evaluates it with (False: one of its ops isn't plain arithmetic).
# A replay with other values of Variables evaluates each kernel's size and work with them: a walk over the nodes,
# each computed as constant folding computes it (exec_alu), without building and simplifying a graph per value
_evaluators: dict[UOp, Any] = {}

def _evaluator(x: UOp) -> Callable[[dict[str, int]], int] | bool:
    order = list(x.toposort())
    index = {u: i for i, u in enumerate(order)}
    steps: list[tuple[int, Any, Any, tuple[int, ...]]] = []
    for u in order:
        if u.op is Ops.CONST: steps.append((0, u.arg, None, ()))
        elif u.op is Ops.DEFINE_VAR: steps.append((1, u.arg[0], None, ()))
        elif u.op in python_alu and dtypes.is_int(u.dtype) or u.op in GroupOp.Comparison:
            steps.append((2, u.op, u.dtype, tuple(index[s] for s in u.src)))
        else: return False
    last = index[x]
    def evaluate(var_vals: dict[str, int]) -> int:
        vals: list[Any] = []
        for kind, arg, dtype, srcs in steps:
            if kind == 0: vals.append(arg)
            elif kind == 1: vals.append(var_vals[arg])
            else: vals.append(exec_alu(arg, dtype, tuple([vals[i] for i in srcs])))
        return int(vals[last])
    return _straight_line(order, index, last, evaluate)

# the ops _straight_line writes as Python where their operands are ints: with index operands and results these compute
# what exec_alu computes (no wrap-around for the index dtype; C division through _c_idiv and _c_mod)
_INT_EXPR = {Ops.ADD: "{0} + {1}", Ops.SUB: "{0} - {1}", Ops.MUL: "{0} * {1}", Ops.NEG: "-{0}",
             Ops.MAX: "({0} if {0} > {1} else {1})", Ops.IDIV: "_idiv({0}, {1})", Ops.MOD: "_mod({0}, {1})",
             Ops.WHERE: "({1} if {0} else {2})"}
_INT_COMPARE = {Ops.CMPLT: "{0} < {1}", Ops.CMPNE: "{0} != {1}", Ops.CMPEQ: "{0} == {1}"}

def _straight_line(order: list[UOp], index: dict[UOp, int], last: int,
                   slow: Callable[[dict[str, int]], int]) -> Callable[[dict[str, int]], int]:
    """The evaluation of `order` (sym_infer's steps) written out as one Python function, each node once: a replay
    with new values of its Variables evaluates the sizes and work of its kernels without walking the steps. A value
    that is not an int (a Variable bound to something else) is evaluated by `slow`, the walk."""
    lines, env = ["def evaluate(vv):"], {"_alu": exec_alu, "_idiv": _c_idiv, "_mod": _c_mod, "_slow": slow}
    ints: set[int] = set()   # the nodes whose values are ints for certain
    for i, u in enumerate(order):
        srcs = [f"v{index[s]}" for s in u.src]
        if u.op is Ops.CONST:
            env[f"C{i}"] = u.arg
            lines.append(f"  v{i} = C{i}")
            if type(u.arg) is int: ints.add(i)
        elif u.op is Ops.DEFINE_VAR:
            lines += [f"  v{i} = vv[{u.arg[0]!r}]", f"  if type(v{i}) is not int: return _slow(vv)"]
            ints.add(i)
        elif all(index[s] in ints for s in u.src if not (u.op is Ops.WHERE and s is u.src[0])) and \
                (u.op in _INT_EXPR and u.dtype == dtypes.index or u.op in _INT_COMPARE):
            lines.append(f"  v{i} = " + (_INT_EXPR.get(u.op) or _INT_COMPARE[u.op]).format(*srcs))
            if u.op in _INT_EXPR: ints.add(i)
        else:
            env[f"O{i}"], env[f"D{i}"] = u.op, u.dtype
            lines.append(f"  v{i} = _alu(O{i}, D{i}, ({', '.join(srcs)},))")
    lines.append(f"  return int(v{last})")
    exec(compile("\n".join(lines), "<sym_infer>", "exec"), env)  # noqa: S102
    return env["evaluate"]

# *** the memory a kernel touches, as a function of its Variables ***

class _Bounded:
    """Stands for a node in the range analysis (uop/ops.py `_compute_min_max`) with its bounds given, so the same rules
    give a node's bounds from its sources' bounds for one set of Variable values."""
    __slots__ = ("op", "dtype", "arg", "src", "_min_max")
    def __init__(self, op: Ops, dtype: Any, arg: Any, src: tuple, mm: tuple | None = None):
        self.op, self.dtype, self.arg, self.src, self._min_max = op, dtype, arg, src, mm
    @property
    def vmin(self) -> Any: return self._min_max[0]
    @property
    def vmax(self) -> Any: return self._min_max[1]

def _bounds_of(u: UOp, *srcs: tuple) -> tuple:
    """The bounds of `u` when its sources lie within `srcs` (a (min, max) each)."""
    return _compute_min_max(_Bounded(u.op, u.dtype, u.arg, tuple(_Bounded(s.op, s.dtype, s.arg, (), mm)  # type: ignore
                                                                    for s, mm in zip(u.src, srcs))))

def _mul_bounds(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int]: return _minmax_of_products((a0, a1), (b0, b1))

# what an index expression may be made of for its bounds to be worked out (a loaded value, say, is not)
_INDEX_OPS = GroupOp.ALU | {Ops.CONST, Ops.DEFINE_VAR, Ops.RANGE, Ops.CAST}

def _negated_lt(c: UOp) -> UOp | None:
    """The comparison x < y when `c` says not (x < y)."""
    if c.op is Ops.NOT and c.src[0].op is Ops.CMPLT: return c.src[0]
    if c.op in (Ops.CMPNE, Ops.XOR, Ops.CMPEQ) and c.src[0].op is Ops.CMPLT and c.src[1].op is Ops.CONST and \
            c.src[1].arg is (c.op is not Ops.CMPEQ):
        return c.src[0]
    return None

def _facts(gate: UOp) -> list[tuple[UOp, str, UOp, int]]:
    """What a load or store's gate says about integer nodes: (x, "hi", y, k) for x <= max(y) + k and (x, "lo", y, k)
    for x >= min(y) + k. Conjuncts of other forms say nothing here (the bounds are only wider for it)."""
    out: list[tuple[UOp, str, UOp, int]] = []
    stack = [gate]
    while stack:
        c = stack.pop()
        if c.op is Ops.AND and c.dtype.scalar() == dtypes.bool:
            stack += c.src
            continue
        if c.op is Ops.CMPLT: (x, y), ge = c.src, False
        elif (lt := _negated_lt(c)) is not None: (x, y), ge = lt.src, True
        elif c.op is Ops.CMPEQ and c.src[0].dtype.scalar() != dtypes.bool:
            (x, y), ge = c.src, None
        else: continue
        if not all(dtypes.is_int(s.dtype) or s.dtype.scalar() == dtypes.index for s in (x, y)): continue
        if ge is None: out += [(x, "lo", y, 0), (x, "hi", y, 0), (y, "lo", x, 0), (y, "hi", x, 0)]
        elif ge: out += [(x, "lo", y, 0), (y, "hi", x, 0)]  # x >= y
        else: out += [(x, "hi", y, -1), (y, "lo", x, 1)]  # x < y
    return [f for f in out if f[0].op is not Ops.CONST]

def _acyclic_facts(gate: UOp | None) -> dict[UOp, list[tuple[str, UOp, int]]]:
    """The facts of `gate` (see _facts) by the node they bound, leaving out any that would make a node's bounds
    depend on themselves."""
    facts: dict[UOp, list[tuple[str, UOp, int]]] = {}
    def needs(a: UOp, b: UOp) -> bool:  # whether a's bounds are computed from b's (through sources or facts)
        stack, seen = [a], set()
        while stack:
            if (u := stack.pop()) is b: return True
            if u in seen: continue
            seen.add(u)
            stack += list(u.src) + [y for _, y, _ in facts.get(u, [])]
        return False
    for x, side, y, k in (_facts(gate) if gate is not None else []):
        if not needs(y, x): facts.setdefault(x, []).append((side, y, k))
    return facts

def _regrouped(idx: UOp, gate: UOp) -> UOp:
    """`idx` written as k*e + rest for each sum e of ranges that the gate bounds and that idx holds in the same
    proportions (a padding's window: idx spells 8*oy + 8*kh - 8 where the gate says 1 <= oy + kh), so the gate's
    bounds on e narrow idx's bounds too. The value is the same; only the bounds analysis sees the grouping."""
    rest, groups = idx, []
    for e in _acyclic_facts(gate):
        if e.op is not Ops.ADD or e.dtype != dtypes.index: continue
        rngs = [u for u in e.toposort() if u.op is Ops.RANGE]
        d, c = [coeff(e, r) for r in rngs], [coeff(rest, r) for r in rngs]
        if not rngs or any(x is None or x == 0 for x in d + c) or c[0] % d[0]: continue
        k = c[0] // d[0]
        if any(ci != k * di for ci, di in zip(c, d)): continue
        less = (rest - e * k).simplify()
        if any(r in less.toposort() for r in rngs): continue
        rest = less
        groups.append(e * k)
    # (the groups are added after the last simplification, which would distribute them again)
    for g in groups: rest = rest + g
    return rest

def _order(root: UOp, facts: dict[UOp, list[tuple[str, UOp, int]]]) -> list[UOp]:
    """The nodes `root`'s bounds are computed from, each after its sources and after the nodes its facts name."""
    order: list[UOp] = []
    seen: set[UOp] = set()
    stack: list[tuple[UOp, bool]] = [(root, False)]
    while stack:
        u, done = stack.pop()
        if done:
            if u not in seen:
                seen.add(u)
                order.append(u)
            continue
        if u in seen: continue
        stack.append((u, True))
        stack += [(s, False) for s in u.src] + [(y, False) for _, y, _ in facts.get(u, [])]
    return order

# the most loop points VarBounds evaluates an access at, where the range analysis finds it out of bounds
EXACT_POINTS = 1 << 16

def _evaluate(order: list[UOp], values: dict[UOp, Any]) -> None:
    """Put in `values` the value of each node of `order` (an index expression's nodes, sources first) it lacks,
    computed as the kernel computes it, from `values`' leaves (DEFINE_VARs, CONSTs, RANGEs); KeyError for a leaf
    without a value, TypeError for an op it can't evaluate."""
    for x in order:
        if x in values: continue
        if x.op is Ops.CAST: out = bool(values[x.src[0]]) if x.dtype.scalar() == dtypes.bool else int(values[x.src[0]])
        elif x.op in python_alu: out = exec_alu(x.op, x.dtype.scalar(), tuple(values[s] for s in x.src))
        elif x.op in (Ops.DEFINE_VAR, Ops.RANGE): raise KeyError(x)
        else: raise TypeError(f"can't evaluate {x.op}")
        values[x] = out

class VarBounds:
    """The loads and stores of a kernel whose memory depends on Variables (a slice, shrink or pad bounded by one, a
    loop over a symbolic size): the lowest and highest element each touches, under the values of one call, checked
    against the buffers before the kernel runs, so a value that puts a view out of range is an error and never a
    read or write outside a buffer.

    The bounds are the range analysis of uop/ops.py (vmin/vmax) with the Variables fixed to their values and each
    loop running over its extent, narrowed by what the access's gate says (a padding's loads are gated). That walk
    is written once per kernel as straight-line Python over the values, so a call costs a few microseconds."""

    def __init__(self, name: str, ast: UOp):
        self.name = name
        topo = ast.toposort()
        stores = {u.src[0] for u in topo if u.op is Ops.STORE}
        # (buffer position, written, index, gate, names of the Variables it depends on)
        self.accesses: list[tuple[int, bool, UOp, UOp | None, tuple[str, ...]]] = []
        for u in topo:
            if u.op is not Ops.INDEX or u.src[0].op is not Ops.DEFINE_GLOBAL or len(u.src) < 2: continue
            idx, gate = u.src[1], (u.src[2] if len(u.src) > 2 else None)
            if idx.dtype.count != 1 or not (dtypes.is_int(idx.dtype) or idx.dtype.scalar() == dtypes.index): continue
            if gate is not None: idx = _regrouped(idx, gate)
            deps = idx.toposort() if gate is None else UOp.sink(idx, gate).toposort()
            if not any(d.op is Ops.DEFINE_VAR for d in deps): continue
            if any(d.op not in _INDEX_OPS and d.op is not Ops.SINK for d in idx.toposort()): continue
            names = tuple(sorted({d.arg[0] for d in deps if d.op is Ops.DEFINE_VAR}))
            self.accesses.append((u.src[0].arg, u in stores, idx, gate, names))
        self.positions = tuple(a[0] for a in self.accesses)
        self._fn = self._compile() if self.accesses else None
        self._names = {name for a in self.accesses for name in a[4]}
        self._exact_seen: dict[tuple, tuple[int, int, int] | None] = {}

    def _compile(self) -> Callable[[dict[str, Any], tuple[int, ...]], tuple[int, int, int] | None]:
        lines, env = ["def check(vv, sizes):"], {"_mul": _mul_bounds, "_bounds_of": _bounds_of}
        num: dict[UOp, int] = {}
        shared: set[UOp] = set()  # nodes whose bounds, not narrowed by any gate, are computed already
        for n, (_, _, idx, gate, _) in enumerate(self.accesses):
            facts = _acyclic_facts(gate)
            # what this access's gate narrows, and what is computed from that: bounds of this access's own
            narrowed: set[UOp] = set()
            dynamic: set[UOp] = set()  # computed per call: depends on a Variable, or narrowed
            order = _order(idx, facts)
            for u in order:
                if u in facts or any(s in narrowed for s in u.src): narrowed.add(u)
                if u.op is Ops.DEFINE_VAR or u in narrowed or any(s in dynamic for s in u.src): dynamic.add(u)
            def name(u: UOp, narrowed: set[UOp] = narrowed, n: int = n) -> str:
                return f"{num[u]}_{n}" if u in narrowed else f"{num[u]}"
            # the names of the bounds that are empty when the access never happens (an empty loop, a false gate)
            empty: dict[UOp, set[str]] = {}
            for u in order:
                num.setdefault(u, len(num))
                empty[u] = set().union(*(empty[s] for s in u.src), *(empty[y] for _, y, _ in facts.get(u, [])))
                if u.op is Ops.RANGE or u in facts: empty[u].add(name(u))
                if u in narrowed or u not in shared:
                    lines += self._bounds_line(u, name, u not in dynamic, facts, env)
                    if u not in narrowed: shared.add(u)
            j, never = name(idx), " or ".join(f"l{e} > h{e}" for e in sorted(empty[idx]))
            test = f"(l{j} < 0 or h{j} >= sizes[{n}])"
            lines.append(f"  if {'not (' + never + ') and ' if never else ''}{test}: return {n}, l{j}, h{j}")
        lines.append("  return None")
        exec(compile("\n".join(lines), f"<bounds of {self.name}>", "exec"), env)  # noqa: S102
        return env["check"]

    @staticmethod
    def _bounds_line(u: UOp, name: Callable[[UOp], str], static: bool, facts: dict[UOp, list[tuple[str, UOp, int]]],
                     env: dict[str, Any]) -> list[str]:
        """The lines computing l<name>, h<name>: the bounds of `u` from its sources' (and its facts')."""
        i, a = name(u), [name(s) for s in u.src]
        if static:
            if all(type(x) in (int, bool) for x in u._min_max): return [f"  l{i}, h{i} = {u.vmin}, {u.vmax}"]
            env[f"S{i}"] = u._min_max
            return [f"  l{i}, h{i} = S{i}"]
        # the rules of the range analysis for the ops index expressions are made of, written out for the common
        # cases (a constant factor, a positive divisor, a dividend >= 0), the others through _bounds_of
        env[f"U{i}"] = u
        general = f"_bounds_of(U{i}, {', '.join(f'(l{j}, h{j})' for j in a)})"
        factor = [s for s in u.src if s.op is Ops.CONST and type(s.arg) is int]
        if u.op is Ops.DEFINE_VAR: out = [f"  l{i} = h{i} = vv[{u.arg[0]!r}]"]
        elif u.op is Ops.RANGE: out = [f"  l{i}, h{i} = 0, h{a[0]} - 1"]
        elif u.dtype != dtypes.index: out = [f"  l{i}, h{i} = {general}"]
        elif u.op is Ops.ADD: out = [f"  l{i}, h{i} = l{a[0]} + l{a[1]}, h{a[0]} + h{a[1]}"]
        elif u.op is Ops.MUL and factor:
            c, x = factor[0].arg, name(u.src[1] if u.src[0] is factor[0] else u.src[0])
            lo, hi = (f"l{x}", f"h{x}") if c >= 0 else (f"h{x}", f"l{x}")
            out = [f"  l{i}, h{i} = {lo} * {c}, {hi} * {c}"]
        elif u.op is Ops.MUL:
            x, y = a
            out = [f"  l{i}, h{i} = (l{x} * l{y}, h{x} * h{y}) if l{x} >= 0 and l{y} >= 0 else "
                   f"_mul(l{x}, h{x}, l{y}, h{y})"]
        elif u.op is Ops.MAX: out = [f"  l{i}, h{i} = max(l{a[0]}, l{a[1]}), max(h{a[0]}, h{a[1]})"]
        elif u.op is Ops.IDIV:
            x, d = a
            out = [f"  l{i}, h{i} = (l{x} // h{d}, h{x} // l{d}) if l{x} >= 0 and l{d} >= 1 else {general}"]
        elif u.op is Ops.MOD:
            x, d = a
            out = [f"  l{i}, h{i} = ((l{x}, h{x}) if h{x} < l{d} else (0, min(h{x}, h{d} - 1))) "
                   f"if l{x} >= 0 and l{d} >= 1 else {general}"]
        else: out = [f"  l{i}, h{i} = {general}"]
        for side, y, k in facts.get(u, []):
            out.append(f"  h{i} = min(h{i}, h{name(y)} + {k})" if side == "hi" else
                       f"  l{i} = max(l{i}, l{name(y)} + {k})")
        return out

    def sizes(self, bufs: list[Buffer | None]) -> tuple[int, ...]:
        """The sizes of the buffers the accesses touch, in the order `check` compares them."""
        return tuple([b.size if (b := bufs[i]) is not None else 1 << 62 for i in self.positions])

    def within(self, sizes: tuple[int, ...], var_vals: dict[str, Any]) -> bool:
        """Whether every access stays inside buffers of these `sizes` under `var_vals` (what `check` checks, without
        the message); True where a Variable has no value, as `check` lets the launch name it."""
        if self._fn is None: return True
        try: return self._found(var_vals, sizes) is None
        except KeyError: return True

    def _found(self, var_vals: dict[str, Any], sizes: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The first access out of its buffer: (access, lowest, highest element). The range analysis can only
        overestimate (an index it can't narrow by its gate, as a padding's index rebuilt through divisions by
        symbolic sizes); where it finds one, the accesses are evaluated at every point of their loops, if there are
        at most EXACT_POINTS, and that answer holds (kept per set of values)."""
        assert self._fn is not None
        if (bad := self._fn(var_vals, sizes)) is None: return None
        key = (tuple(sorted((k, v) for k, v in var_vals.items() if k in self._names)), sizes)
        if (known := self._exact_seen.get(key, False)) is not False: return known
        exact = self._exact(var_vals, sizes)
        if exact is not False: self._exact_seen[key] = exact
        return bad if exact is False else exact

    def _exact(self, var_vals: dict[str, Any], sizes: tuple[int, ...]) -> tuple[int, int, int] | None | bool:
        """(access, lowest, highest) of the first access out of its buffer, evaluated at every point of its loops;
        None if every access stays inside; False where that isn't known (too many points, an op it can't evaluate)."""
        for n, (_, _, idx, gate, _) in enumerate(self.accesses):
            topo = list(idx.toposort() if gate is None else UOp.sink(idx, gate).toposort())
            ranges = [u for u in topo if u.op is Ops.RANGE]
            # the nodes that don't change with the loops are computed once, the others at every point
            varying: set[UOp] = set(ranges)
            for u in topo:
                if any(s in varying for s in u.src): varying.add(u)
            values: dict[UOp, Any] = {}
            for u in topo:
                if u.op is Ops.CONST: values[u] = u.arg
                elif u.op is Ops.DEFINE_VAR and u.arg[0] in var_vals: values[u] = var_vals[u.arg[0]]
            try: _evaluate([u for u in topo if u not in varying and u.op is not Ops.SINK], values)
            except (KeyError, TypeError): return False
            if any(r.src[0] not in values for r in ranges): return False   # (a loop whose extent varies)
            extents = [values[r.src[0]] for r in ranges]
            if math.prod(extents) > EXACT_POINTS: return False
            order = [u for u in topo if u in varying and u.op not in (Ops.RANGE, Ops.SINK)]
            lo, hi = None, None
            for point in itertools.product(*map(range, extents)):
                vals = dict(values)
                vals.update(zip(ranges, point))
                try: _evaluate(order, vals)
                except (KeyError, TypeError): return False
                if gate is not None and not vals[gate]: continue
                i = vals[idx]
                lo, hi = (i, i) if lo is None else (min(lo, i), max(hi, i))
            if lo is not None and (lo < 0 or hi >= sizes[n]): return n, lo, hi
        return None

    def check(self, bufs: list[Buffer | None], var_vals: dict[str, Any]) -> None:
        """Raise IndexError, naming the Variables and their values, when under `var_vals` an access would touch an
        element outside its buffer in `bufs`."""
        if self._fn is None: return
        sizes = self.sizes(bufs)
        try: bad = self._found(var_vals, sizes)
        except KeyError: return  # a Variable without a value: the launch says which
        if bad is None: return
        n, lo, hi = bad
        pos, written, _, _, names = self.accesses[n]
        vals = ", ".join(f"{k}={var_vals[k]}" for k in names)
        raise IndexError(f"Variable{'s' if len(names) > 1 else ''} {vals} put{'' if len(names) > 1 else 's'} a view "
                         f"out of range: kernel {self.name} would {'write' if written else 'read'} elements "
                         f"{lo}..{hi} of buffer {pos}, which holds {sizes[n]} elements")

class Runner:
    """Something an ExecItem runs: `runner(bufs, var_vals, wait)` returns the elapsed seconds when `wait`."""
    # the check of the memory its call touches under the Variables' values, for a kernel where that depends on them
    bounds: VarBounds | None = None
    # what one call adds to GlobalCounters.kernel_count (a compiled kernel's; copies and views are no kernels)
    kernels: int = 0
    def __init__(self, display_name: str, device: str, estimates: Estimates = Estimates()):
        self.display_name, self.device, self.estimates = display_name, device, estimates
    def __call__(self, rawbufs: list[Buffer], var_vals: dict[str, int], wait: bool = False) -> float | None:
        raise NotImplementedError
    def __repr__(self) -> str: return f"<{type(self).__name__} {self.display_name}>"

class CompiledRunner(Runner):
    """A kernel compiled for its device and ready to call."""
    kernels = 1
    # the realize that made it, while it runs a quick program (see QUICK_CODEGEN); None once it has its full one
    quick_realize: int | None = None
    def __init__(self, p: ProgramSpec, precompiled: bytes | None = None, cached: bytes | None = None):
        # precompiled: a binary the caller vouches for; cached: one from the compile caches (recompiled if it fails)
        self.p = p
        dev = Device[p.device]
        self.dev = dev
        if DEBUG >= 4: print(p.src)
        self.lib = precompiled if precompiled is not None else cached if cached is not None else \
            dev.compiler.compile_cached(p.src)
        try: self._prg = dev.runtime(p.function_name, self.lib)
        except Exception:
            if precompiled is not None: raise
            # a cached binary that doesn't load is recompiled once before giving up
            dev.compiler.evict(p.src)
            self.lib = dev.compiler.compile_cached(p.src)
            self._prg = dev.runtime(p.function_name, self.lib)
        # argument plumbing is fixed per kernel, so work it out once (this runs every step of a training loop)
        self._gidx = tuple(p.globals)
        self._vnames = tuple(v.arg[0] for v in p.vars)
        # the kernel ABI passes float parameters as double and integer ones as 64-bit ints
        self._vconv = tuple(float if dtypes.is_float(v.dtype) else int for v in p.vars)
        # the ProgramSpec contract makes any kernel with global_size > 1 splittable; the device says how far
        self._static_gs = p.global_size if isinstance(p.global_size, int) else None
        self._may_split = self._static_gs is None or self._static_gs > 1
        # (ops, bytes moved) when they don't depend on Variables: the thread count and the caller's join need them
        self._static_work = (p.estimates.ops, p.estimates.mem) \
            if isinstance(p.estimates.ops, int) and isinstance(p.estimates.mem, int) else None
        if p.vars and p.ast is not None and (bounds := VarBounds(p.name, p.ast)).accesses: self.bounds = bounds
        self._by_values: dict[tuple, tuple[dict[str, Any], tuple[int, int]]] = {}   # (launch_args)
        # the positions of the buffers the kernel surely only reads, for a device whose calls take them
        self._reads = {"reads": tuple(j for j, i in enumerate(self._gidx) if i in p.read_only)} \
            if getattr(self._prg, "takes_reads", False) and p.read_only else {}
        super().__init__(colored(p.name, "cyan"), p.device, p.estimates)

    @property
    def src(self) -> str: return self.p.src
    @property
    def uops(self) -> list[UOp]: return self.p.uops

    def _work(self, var_vals: dict[str, int]) -> tuple[int, int]:
        """The ops and bytes moved of this call."""
        if self._static_work is not None: return self._static_work
        return sym_infer(self.estimates.ops, var_vals), sym_infer(self.estimates.mem, var_vals)

    def threads(self, var_vals: dict[str, int], work: tuple[int, int] | None = None) -> int:
        """How many threads this call is split across: all the device allows for big kernels, else 1."""
        if not self._may_split: return 1
        ops, mem = work if work is not None else self._work(var_vals)
        return self.dev.max_threads if ops >= THREAD_MIN_OPS or mem >= THREAD_MIN_MEM else 1

    def _launch(self, var_vals: dict[str, int]) -> dict[str, Any]:
        """The keyword arguments of the device program's call (and of its `prepare`) other than the buffers."""
        try: vals = tuple([conv(var_vals[n]) for n, conv in zip(self._vnames, self._vconv)])
        except KeyError as e: raise ValueError(f"kernel {self.p.name} needs a value for Variable {e.args[0]}: bind it "
                                         "(Variable.bind(value)) where the shape is built, or pass the bound Variable "
                                         "to the TinyJit function") from e
        gs = self._static_gs if self._static_gs is not None else sym_infer(self.p.global_size, var_vals)
        work = self._work(var_vals)
        threads = self.threads(var_vals, work) if gs > 1 else 1
        helpable = work[0] < LONG_CHUNK_OPS * threads and work[1] < LONG_CHUNK_MEM * threads
        launch = {"vals": vals, "global_size": gs, "threads": threads, "helpable": helpable,
                  "join": helpable and threads > 1 and (work[0] >= JOIN_MIN_OPS or work[1] >= JOIN_MIN_MEM)}
        if self.p.global_dims:   # a GPU-style kernel: its grid of work-groups
            launch["global_dims"] = tuple(sym_infer(d, var_vals) for d in self.p.global_dims)
            launch["local_dims"] = self.p.local_dims
        return launch

    def launch_args(self, var_vals: dict[str, int]) -> tuple[dict[str, Any], tuple[int, int]]:
        """_launch's arguments and _work's (ops, bytes moved) for these values of the kernel's Variables: the same
        objects for the same values (a prepared launch is updated only when they are other ones)."""
        # (by _arg_key: a lifted constant of -0.0 is another value than 0.0, and 1.0 another than 1)
        key = tuple([_arg_key(var_vals.get(n)) for n in self._vnames])
        if (hit := self._by_values.get(key)) is None:
            # (a decoder's position takes a new value per token: the oldest values are dropped)
            if len(self._by_values) >= 64: self._by_values.pop(next(iter(self._by_values)))
            hit = self._by_values[key] = (self._launch(var_vals), self._work(var_vals))
        return hit

    def __call__(self, rawbufs: list[Buffer], var_vals: dict[str, int], wait: bool = False) -> float | None:
        bufs = [rawbufs[i]._buf for i in self._gidx] if self._gidx else [b._buf for b in rawbufs]
        return self._prg(*bufs, wait=wait, **self._launch(var_vals), **self._reads)

    def prepare(self, rawbufs: list[Buffer], var_vals: dict[str, int], varying: tuple[int, ...] = ()) \
            -> tuple[Callable[..., None], tuple[int, ...]] | None:
        """This call as a function that repeats it with its arguments converted once (see the device program's
        `prepare`), and the order in which it takes the allocations of the buffers `varying` (indices into `rawbufs`)
        that change per call; None where the device has no such thing."""
        if (prepare := getattr(self._prg, "prepare", None)) is None: return None
        order = self._gidx if self._gidx else tuple(range(len(rawbufs)))
        positions = tuple(j for j, i in enumerate(order) if i in varying)
        bufs = [None if j in positions else rawbufs[i]._buf for j, i in enumerate(order)]
        launch = prepare(*bufs, varying=positions, **self._launch(var_vals), **self._reads)
        return None if launch is None else (launch, tuple(order[j] for j in positions))

class BufferCopy(Runner):
    """Copies bufs[1] into bufs[0] (same or different devices) through host memory, or device to device where both
    allocators are of one kind that has `_transfer`; with `src_offset`, a part of bufs[1] from that byte on. With
    `takes_memory` (a snapshot of a buffer that the schedule overwrites whole next: schedule/merge.py
    _snapshot_by_exchange), the copy takes bufs[1]'s memory and leaves it bufs[0]'s where they can trade
    (Buffer.exchange_memory); bufs[1]'s contents are then undefined until it is written."""
    def __init__(self, nbytes: int, dest_device: str, src_device: str, src_offset: int | None = None,
                 takes_memory: bool = False):
        name = f"{'take' if takes_memory else 'copy'} {nbytes:8d}, {dest_device[:7]:>7s} <- {src_device[:7]:7s}"
        super().__init__(colored(name, "yellow"), dest_device, Estimates(mem=0 if takes_memory else nbytes))
        self.src_offset, self.takes_memory = src_offset, takes_memory
        # (a prepared launch's work, as CompiledRunner's: ops, bytes moved)
        self._static_work = (0, 0 if takes_memory else nbytes)

    def _work(self, var_vals: dict[str, int]) -> tuple[int, int]: return self._static_work

    def take(self, rawbufs: list[Buffer]) -> bool:
        """Whether bufs[0] took bufs[1]'s memory (for `takes_memory`; else the copy copies). (The memory bufs[1]
        gets is first used by the kernel queued next that overwrites it: `queued`)"""
        return rawbufs[0].nbytes > 0 and rawbufs[0].ensure_allocated(queued=True).exchange_memory(rawbufs[1])

    def prepare(self, rawbufs: list[Buffer], varying: tuple[int, ...] = ()) \
            -> tuple[Callable[..., None], tuple[int, ...]] | None:
        """The copy as a prepared launch (see CompiledRunner.prepare) where it is queued as a kernel: a whole buffer
        between host memories (an eager training step's snapshot of a weight, which then joins the step's launch
        graph instead of breaking it in two); None otherwise. Its chunks run in parallel: the destination is always a
        buffer of its own, never memory the source still uses (memory planning shares storage only between buffers
        whose uses don't overlap)."""
        dest, src = rawbufs[0], rawbufs[1]
        # (one that takes memory runs in order, at its turn: the kernels after it take the addresses it leaves)
        if self.src_offset or self.takes_memory or dest.nbytes != src.nbytes or dest.nbytes == 0 or \
                (prg := _host_copy_program(dest, src)) is None:
            return None
        threads = Device[dest.device].max_threads if dest.nbytes >= THREAD_MIN_MEM else 1
        bufs = [None if i in varying else b._buf for i, b in enumerate((dest, src))]
        launch = prg.prepare(*bufs, global_size=dest.nbytes, threads=threads, varying=tuple(sorted(varying)),
                             reads=(1,))
        return None if launch is None else (launch, tuple(sorted(varying)))

    def __call__(self, rawbufs: list[Buffer], var_vals: dict[str, int], wait: bool = False) -> float | None:
        dest, src = rawbufs[0], rawbufs[1]
        off = self.src_offset
        if off is None and dest.nbytes != src.nbytes:
            raise ValueError(f"copy between buffers of {src.nbytes} and {dest.nbytes} bytes")
        if off is not None and off + dest.nbytes > src.nbytes:
            raise ValueError(f"copy of {dest.nbytes} bytes from byte {off} of a {src.nbytes} byte buffer")
        if dest.nbytes == 0: return 0.0 if wait else None  # nothing to move (a launch runs at least one item)
        if self.takes_memory and self.take(rawbufs): return 0.0 if wait else None
        if (prg := _host_copy_program(dest, src)) is not None:
            # host memory to host memory: queued as a kernel, so the caller doesn't wait for the kernels before it
            part = src._buf if not off and dest.nbytes == src.nbytes else \
                src.allocator._offset(src._buf, dest.nbytes, off or 0)
            # (memory that overlaps, two views of one buffer, is moved by one thread: memmove's order is then kept)
            d0, s0 = ctypes.addressof(dest._buf), ctypes.addressof(part)
            apart = d0 + dest.nbytes <= s0 or s0 + dest.nbytes <= d0
            threads = Device[dest.device].max_threads if apart and dest.nbytes >= THREAD_MIN_MEM else 1
            return prg(dest._buf, part, global_size=dest.nbytes, threads=threads, wait=wait, reads=(1,))
        st = time.perf_counter()
        if type(dest.allocator) is type(src.allocator) and hasattr(dest.allocator, "_transfer") and \
                (off is None or src.allocator.supports_views):
            # between memories of one kind of device (GPUs): the devices copy, without the host in between
            part = src._buf if off is None else src.allocator._offset(src._buf, dest.nbytes, off)
            dest.allocator._transfer(dest._buf, part, dest.nbytes)
        # (the source unchecked: this item's schedule checked its reads before it ran, and a snapshot's source is a
        # buffer that a later item of the schedule overwrites)
        elif off is not None and dest.nbytes != src.nbytes:  # a part of the source
            dest.copyin(src.as_buffer(check=False)[off:off + dest.nbytes])
        elif hasattr(dest.allocator, "_as_buffer") and not hasattr(src.allocator, "_as_buffer"):
            # the destination's own memory is host memory: copy straight into it
            src.copyout(dest.as_buffer(), check=False)
        else: dest.copyin(src.as_buffer(check=False))
        if wait:
            Device[dest.device].synchronize()
            return time.perf_counter() - st
        return None

# a copy between host memories (CPU devices) runs as a kernel of its own, queued behind the kernels before it: a copy
# through the host would wait for them first (an eager training step's snapshot of a weight waited for the forward
# pass's matmul). Its source is compiled with the C pool (cpu_pool.HOST_COPY_SOURCE).
_host_copies: dict[str, CPUProgram | None] = {}   # device -> its copy program (None: copies go through the host)

def _host_copy_program(dest: Buffer, src: Buffer) -> CPUProgram | None:
    """The copy kernel for dest <- src where both are host memory of CPU devices compiling C, else None."""
    if type(dest.allocator) is not CPUAllocator or type(src.allocator) is not CPUAllocator: return None
    if (prg := _host_copies.get(dest.device, False)) is not False: return prg
    dev = Device[dest.device]
    prg = None
    if isinstance(dev.compiler, CPUCompiler) and isinstance(dev.runtime, type) and issubclass(dev.runtime, CPUProgram):
        try: prg = dev.runtime("fg_copy", dev.compiler.compile_cached(HOST_COPY_SOURCE))
        except Exception: prg = None   # (no C compiler that works: the copy goes through the host as before)
    _host_copies[dest.device] = prg
    return prg

class ViewOp(Runner):
    """A BUFFER_VIEW: bufs[0] already shares bufs[1]'s memory, so there is nothing to run."""
    def __init__(self, buf: Buffer): super().__init__(colored(f"view {buf.nbytes:8d} @ {buf.offset:<10d}", "yellow"),
                                                      buf.device)
    def __call__(self, rawbufs: list[Buffer], var_vals: dict[str, int], wait: bool = False) -> float | None:
        if rawbufs[0].base is not rawbufs[1].base:
            raise RuntimeError(f"BUFFER_VIEW output {rawbufs[0]!r} is not a view of {rawbufs[1]!r}")
        return 0.0 if wait else None

# *** lowering ***

# the knobs that change the code generated for a kernel AST: part of the method cache key, so a `Context` that sets
# one of them inside a process gets kernels generated under its values, not ones compiled before
CODEGEN_KNOBS: tuple[ContextVar, ...] = (BEAM, NOOPT, TRANSCENDENTAL, ALLOW_TF32)

# (device, ast, values of CODEGEN_KNOBS) -> runner: the same kernel is generated and compiled once per process. Least
# recently used kernels are dropped past METHOD_CACHE_SIZE, so a process making endless distinct kernels doesn't grow
# forever (each loaded program holds memory mappings; a dropped one unloads once no ExecItem uses it).
method_cache: dict[tuple[str, UOp, tuple[int, ...]], CompiledRunner] = {}
METHOD_CACHE_SIZE = 4096

def codegen_knob_values() -> tuple[int, ...]: return tuple([int(k.value) for k in CODEGEN_KNOBS])

# the knobs that change how a kernel call is split and queued: a prepared launch is made again when they change
LAUNCH_KNOBS: tuple[ContextVar, ...] = (CPU_THREADS, CPU_ASYNC)
def launch_knob_values() -> tuple[int, ...]: return tuple([int(k.value) for k in LAUNCH_KNOBS])
_REPLAY_KNOBS = CODEGEN_KNOBS + LAUNCH_KNOBS   # (codegen_knob_values() + launch_knob_values())

def _method_key(device: str, ast: UOp) -> tuple[str, UOp, tuple[int, ...]]:
    # the devices of one kind in this process (CPU, CPU:1, ...) run the same programs: their memory is all host memory
    return (Device.canonicalize(device).partition(":")[0], ast, codegen_knob_values())

def get_runner(device: str, ast: UOp) -> CompiledRunner:
    """The compiled kernel for `ast` on `device`, from the method cache or freshly generated and compiled."""
    ckey = _method_key(device, ast)
    if (ret := method_cache.pop(ckey, None)) is not None:
        method_cache[ckey] = ret  # most recently used goes last
        return ret
    return compile_kernels(device, [ast])[0]

# Code generation is Python (one core) and a C compiler is a process of its own: while the kernels of a big schedule
# are generated, the ones generated so far are compiled on the other cores (each group one compiler run; the last
# group split across the cores). A group is sent once code generation has run PIPELINE_GROUP_S since the last one and
# fewer groups than PIPELINE_SLOTS (the cores but the one generating code) are compiling: the first compile starts
# early, and where compiling is the slower side the kernels generated meanwhile make one bigger group instead of a
# queue of compiler runs that each pay for starting the compiler. Schedules of fewer than QUICK_MIN_KERNELS new kernels
# (eager ops, tests) wait PIPELINE_SMALL_GROUP_S: a compiler run more costs them about as much as it overlaps.
PIPELINE_GROUP_S = 0.05
PIPELINE_SMALL_GROUP_S = 0.15
PIPELINE_SLOTS: int | None = None   # (None: the host's cores less one)

# QUICK_COMPILE=1: a schedule of at least QUICK_MIN_KERNELS new kernels, on a device that compiles in two tiers (CPU:
# TieredCompiler), is compiled quickly first and runs while its optimized build compiles in the background, which then
# takes over (the same results). A model's first call then waits for a fraction of the compile time (DESIGN.md,
# "Compile paths and the default"). Smaller schedules get their optimized build at once: there starting the compiler
# is most of the cost either way, and the second build would be extra work for little gain (with 2 here, a
# compile-heavy part of the test suite took ~10% more CPU).
QUICK_COMPILE = ContextVar("QUICK_COMPILE", 1)
QUICK_MIN_KERNELS = 8
# QUICK_CODEGEN=1: those kernels are also generated as quick programs first (codegen.get_program's `quick`: the same
# bits from less code, a fraction of the code generation and of the C), and a kernel that runs again in a later realize
# gets its full program then, compiled optimized in the background (upgrade_quick_kernels). A kernel that runs once
# (an initializer, a script's single call) never pays for the full program.
QUICK_CODEGEN = ContextVar("QUICK_CODEGEN", 1)

# the number of the current realize (one more at the start of each run_schedule's kernels and after each replay's
# check): a runner with a quick program records the one that made it, and takes its full program when a later one
# uses it. id -> weak reference of the runners still on their quick program.
_realizes = [0]
_quick_runners: dict[int, Any] = {}

def _note_quick(runner: CompiledRunner) -> None:
    runner.quick_realize = _realizes[0]
    key = id(runner)
    _quick_runners[key] = weakref.ref(runner, lambda _, key=key: _quick_runners.pop(key, None))

def upgrade_quick_kernels(runners: Any = None) -> None:
    """Generate the full programs of the runners among `runners` that still run a quick program made by an earlier
    realize (None: every such runner, whenever made) and compile them optimized in the background; each takes over
    its runner's calls once compiled (TieredCPUProgram.upgrade). Their results are the same bits."""
    if runners is None: todo = [r for ref in list(_quick_runners.values()) if (r := ref()) is not None]
    else: todo = [r for r in runners if getattr(r, "quick_realize", None) not in (None, _realizes[0])]
    if not todo: return
    from fusegrad.codegen import get_program
    later: dict[int, tuple[Any, list[str], list[Callable[[bytes], None]]]] = {}
    for r in todo:
        r.quick_realize = None
        _quick_runners.pop(id(r), None)
        gen_st = time.perf_counter()
        full = get_program(r.p.ast, r.dev.renderer)
        # (what the kernel runs from now on is what VIZ and DEBUG show of it)
        if _viz.VIZ: _viz.record_kernel(r.p.ast, full, time.perf_counter() - gen_st)
        if DEBUG >= 4: print(full.src)
        # (the same loop split across the cores and the same arguments, or the quick program stays)
        if (full.global_size, full.globals, full.vars) != (r.p.global_size, r.p.globals, r.p.vars): continue
        if (tiered := getattr(r.dev, "tiered", None)) is None: continue
        entry = later.setdefault(id(tiered), (tiered, [], []))
        entry[1].append(full.src)
        entry[2].append(functools.partial(_take_full_program, r, full))
    for tiered, srcs, done in later.values(): tiered.later(srcs, done)

def optimized_kernels() -> None:
    """Bring every kernel compiled so far to its optimized build and wait for it: the full programs of the kernels
    still on a quick one, and the background compiles of both tiers (what a benchmark's steady figures should time)."""
    upgrade_quick_kernels()
    TieredCompiler.wait_all()

def compile_kernels(device: str, asts: list[UOp]) -> list[CompiledRunner]:
    """Generate code for every kernel AST, compile the sources together (see Compiler.compile_cached_many) and put
    the runners in the method cache."""
    from fusegrad.codegen import get_program, quick_codegen_ok  # codegen is only needed once something is compiled
    dev = Device[device]
    programs: list[ProgramSpec] = []
    searching = BEAM >= 1 and not NOOPT
    # (not while BEAM times candidate kernels: a compiler running beside them would skew their timings)
    pipelined = dev.compiler.parallel and len(asts) > 1 and host_cpu_count() > 1 and not searching
    tiered = getattr(dev, "tiered", None) if QUICK_COMPILE and len(asts) >= QUICK_MIN_KERNELS and not searching \
        else None
    quick_gen = tiered is not None and bool(QUICK_CODEGEN)
    def compile_group(srcs: list[str], units: int | None = None) -> list[tuple[bytes, bool]]:
        # (binary, whether it is the optimized one)
        if tiered is not None: return tiered.first(srcs, units)
        return [(lib, True) for lib in dev.compiler.compile_cached_many(srcs, units)]
    groups: list[Future] = []   # the compiles of the groups sent so far, in order
    slots = PIPELINE_SLOTS if PIPELINE_SLOTS is not None else max(1, host_cpu_count() - 1)
    group_s = PIPELINE_GROUP_S if len(asts) >= QUICK_MIN_KERNELS else PIPELINE_SMALL_GROUP_S
    compiling: ThreadPoolExecutor | None = None
    # where compiles run beside code generation, the kernels whose C takes the compiler longest (reductions, then the
    # bigger graphs) are generated first: the group left for after code generation, which the call waits for, then
    # holds the quick ones (ResNet-18's elementwise kernels rather than its last convolutions)
    order = sorted(range(len(asts)), key=lambda i: _compile_weight(asts[i]), reverse=True) if pipelined else \
        list(range(len(asts)))
    try:
        first, since = 0, time.perf_counter()
        gen_start = since
        for ast in (asts[i] for i in order):
            gen_st = time.perf_counter()
            if searching:
                # searched opts, or the ones a search chose before (disk); candidates are timed as this engine runs them
                from fusegrad.codegen.opt.search import beam_opts
                opts = beam_opts(ast, device, int(BEAM.value), runner=CompiledRunner, knobs=CODEGEN_KNOBS)
                p = get_program(ast, dev.renderer, opts=opts)
            else: p = get_program(ast, dev.renderer, quick=quick_gen and quick_codegen_ok(ast, dev.renderer))
            programs.append(p)
            if _viz.VIZ: _viz.record_kernel(ast, p, time.perf_counter() - gen_st)
            if DEBUG >= 3:
                print(ast)
                print(f"{p.name}: applied opts {p.applied_opts}")
            # (not when the kernels left would take less than a group's time to generate, at the pace so far, which
            # overestimates them since the heavy ones come first: the group would hold nearly everything in one compiler
            # run, where the end's split across the cores compiles it in a fraction of that)
            now = time.perf_counter()
            if pipelined and len(programs) < len(asts) and now - since >= group_s and \
                    (now - gen_start) / len(programs) * (len(asts) - len(programs)) >= group_s and \
                    sum(not g.done() for g in groups) < slots:
                if compiling is None: compiling = ThreadPoolExecutor(max_workers=host_cpu_count())
                groups.append(compiling.submit(compile_group, [q.src for q in programs[first:]], 1))
                first, since = len(programs), time.perf_counter()
        compile_st = time.perf_counter()
        last = compile_group([p.src for p in programs[first:]])
        libs = [lib for group in groups for lib in group.result()] + last
        if _viz.TIMED: _viz.record_compile(asts, compile_st, device)
    finally:
        if compiling is not None: compiling.shutdown(wait=True)
    # (back in the order of `asts`)
    by_ast: list[Any] = [None] * len(asts)
    for i, p, lib in zip(order, programs, libs): by_ast[i] = (p, lib)
    programs, libs = [p for p, _ in by_ast], [lib for _, lib in by_ast]
    runners = [CompiledRunner(p, cached=lib) for p, (lib, _) in zip(programs, libs)]
    # the kernels that run a quick binary get their optimized one from the background (a runner whose quick binary
    # didn't load was compiled optimized already); a quick program's, only if it runs again (upgrade_quick_kernels)
    quick = [(p.src, r) for p, r, (lib, final) in zip(programs, runners, libs)
             if not final and r.lib is lib and not p.quick]
    for p, r in zip(programs, runners):
        if p.quick: _note_quick(r)
    if tiered is not None and quick:
        tiered.later([src for src, _ in quick], [functools.partial(_take_optimized, r) for _, r in quick])
    for ast, r in zip(asts, runners): method_cache[_method_key(device, ast)] = r
    while len(method_cache) > METHOD_CACHE_SIZE: method_cache.pop(next(iter(method_cache)))
    return runners

def _compile_weight(ast: UOp) -> tuple[bool, int]:
    """How long a kernel's C may take to compile, as far as its AST tells before code generation: whether it reduces
    (the optimizer unrolls and tiles those), then its size."""
    topo = ast.toposort()
    return any(u.op is Ops.REDUCE for u in topo), len(topo)

def _take_optimized(runner: CompiledRunner, lib: bytes) -> None:
    """Have `runner` run the optimized binary `lib` of its kernel from now on (called on the background thread)."""
    runner._prg.upgrade(lib)
    runner.lib = lib

def _take_full_program(runner: CompiledRunner, full: ProgramSpec, lib: bytes) -> None:
    """Have `runner` run `full`, the full program of its kernel, from its optimized binary `lib` (called on the
    background thread)."""
    runner._prg.upgrade(lib, full.function_name)
    runner.lib, runner.p = lib, full

@dataclass
class ExecItem:
    """One step of a schedule: a kernel AST (or COPY / BUFFER_VIEW) and the buffers it uses; `prg` once lowered."""
    ast: UOp
    bufs: list[Buffer | None]
    metadata: tuple = ()
    fixedvars: dict[str, int] = field(default_factory=dict)
    prg: Runner | None = None
    # a launch prepared for this kernel (CompiledRunner.prepare over every buffer: the function and the order of the
    # buffers it takes), set by a replayed schedule plan
    launch: tuple[Callable[..., None], tuple[int, ...]] | None = None

    def lower(self) -> ExecItem: return lower_schedule_item(self)

    def outputs(self) -> list[Buffer]:
        """The buffers this item writes: a kernel's one per STORE (the first of bufs), a copy's or view's
        destination."""
        n = _stores(self.ast) if self.ast.op is Ops.SINK else 1
        return [b for b in self.bufs[:n] if b is not None]

    def prepared(self, varying: tuple[int, ...], var_vals: dict[str, int] | None = None) \
            -> tuple[Callable[..., None], tuple[int, ...]] | None:
        """This kernel's launch prepared over its buffers, those at `varying` passed per call (see
        CompiledRunner.prepare), where its runner has one and its values are all fixed parameters (no Variable).
        With `var_vals`, a kernel with Variables is prepared too (with these values), where its device's launch takes
        other values per call: its `set_values` takes CompiledRunner.launch_args of each call's values."""
        prg = self.prg
        if isinstance(prg, BufferCopy): return prg.prepare(self.bufs, varying)  # type: ignore[arg-type]
        if not isinstance(prg, CompiledRunner): return None
        if all(n in self.fixedvars for n in prg._vnames): return prg.prepare(self.bufs, self.fixedvars, varying)  # type: ignore[arg-type]
        if var_vals is None: return None
        vv = {**var_vals, **self.fixedvars}
        if any(n not in vv for n in prg._vnames): return None
        made = prg.prepare(self.bufs, vv, varying)  # type: ignore[arg-type]
        return made if made is not None and hasattr(made[0], "set_values") else None

    def run(self, var_vals: dict[str, int] | None = None, wait: bool = False, do_update_stats: bool = True) \
            -> float | None:
        """Run (lowering first if needed) and, if `do_update_stats`, count the work in GlobalCounters."""
        prg = self.prg if self.prg is not None else lower_schedule_item(self).prg
        assert prg is not None
        # (counted before the run: a runner may read what it writes through the Buffer)
        if unwritten_buffers:
            for b in self.outputs(): b.written()
        # (a kernel's new buffers may take memory that kernels queued before it still use: Allocator.alloc)
        queued = type(prg) is CompiledRunner
        if self.launch is not None and not wait and DEBUG < 2 and not _viz.TIMED:
            fn, order = self.launch
            fn(*[self.bufs[i].ensure_allocated(queued)._buf for i in order])  # type: ignore[union-attr]
            if do_update_stats: _update_stats(prg, self.fixedvars, None, prg.device)
            return None
        vv = {**var_vals, **self.fixedvars} if var_vals else self.fixedvars
        # positions matter (kernels index bufs by DEFINE_GLOBAL number), so a missing buffer stays a None
        bufs = [b.ensure_allocated(queued) if b is not None else None for b in self.bufs]
        et = prg(bufs, vv, wait=wait or DEBUG >= 2 or _viz.TIMED)  # type: ignore[arg-type]
        device = bufs[0].device if bufs and bufs[0] is not None else prg.device
        if _viz.TIMED: _viz.record_run(prg, self.ast, vv, et, device)
        if do_update_stats: _update_stats(prg, vv, et, device)
        return et

def _stores(ast: UOp) -> int: return sum(1 for x in ast.src if x.op is Ops.STORE)

def _item_name(ei: ExecItem) -> str:
    return {Ops.SINK: "a kernel", Ops.COPY: "a copy"}.get(ei.ast.op, "a buffer view")

def check_unwritten(schedule: list[ExecItem]) -> None:
    """Raise UnrunScheduleError when an item of `schedule` reads a buffer that a schedule handed out by
    Tensor.schedule() has yet to write with an item that is not in `schedule` (another schedule's, or one left out
    of a partial run). Reads of a buffer written by items of `schedule` are its own order's business: an assign's
    target is read (its old values) by the items before the one that writes it. Checked before any item runs, so a
    realize that raises leaves every buffer as it was."""
    writes: dict[int, int] = {}   # id -> how many items of `schedule` write it
    for ei in schedule:
        for b in ei.outputs(): writes[id(b)] = writes.get(id(b), 0) + 1
    for ei in schedule:
        outs = ei.outputs()
        for b in ei.bufs:
            if b is None or b in outs: continue
            for x in (b,) if b._base is None else (b, b._base):
                if x.unwritten > writes.get(id(x), 0): x.check_written(f"{_item_name(ei)} reading")

def expect_writes(schedule: list[ExecItem]) -> None:
    """Mark the buffers `schedule`'s items write as waiting for it: until the item writing one runs, reading it (its
    tensor's numpy(), a kernel of another schedule) raises UnrunScheduleError instead of giving what the memory holds.
    For schedules handed out to run later (Tensor.schedule); one run at once (realize) is not marked."""
    for ei in schedule:
        for b in ei.outputs(): b.expect_write()

def _update_stats(prg: Runner, var_vals: dict[str, int], et: float | None, device: str) -> None:
    ops, mem = prg._work(var_vals) if isinstance(prg, CompiledRunner) else \
        (sym_infer(prg.estimates.ops, var_vals), sym_infer(prg.estimates.mem, var_vals))
    GlobalCounters.global_ops += ops
    GlobalCounters.global_mem += mem
    if isinstance(prg, CompiledRunner): GlobalCounters.kernel_count += 1
    if et is not None: GlobalCounters.time_sum_s += et
    if DEBUG >= 2:
        is_kernel = isinstance(prg, CompiledRunner)
        idx = f"{GlobalCounters.kernel_count:5d}" if is_kernel else "    -"
        gs = f"gs={sym_infer(prg.p.global_size, var_vals)}" if is_kernel else ""
        name = prg.display_name + " " * max(0, 34 - ansilen(prg.display_name))
        flops = f"{ops / et * 1e-9:9.2f} GFLOPS" if et and ops else " " * 16
        perf = f"{flops} {mem / et * 1e-9:8.2f} GB/s" if et else " " * 30
        print(f"*** {device:7s} {idx} {name} {gs:12s} tm {_fmt_time(et)} ({perf})"
              f"  total {_fmt_time(GlobalCounters.time_sum_s)}")

def _fmt_time(s: float | None) -> str:
    if s is None: return " " * 10
    return f"{s * 1e6:8.2f}us" if s < 1e-3 else f"{s * 1e3:8.2f}ms"

def lower_schedule_item(si: ExecItem) -> ExecItem:
    """`si` with its runner: a compiled kernel (device of bufs[0]), a BufferCopy or a ViewOp."""
    if si.prg is not None: return si
    if si.ast.op is Ops.SINK:
        if not si.bufs or si.bufs[0] is None: raise ValueError("a kernel ExecItem needs its output buffer as bufs[0]")
        prg: Runner = get_runner(si.bufs[0].device, si.ast)
    elif si.ast.op is Ops.COPY:
        dest, src = si.bufs[0], si.bufs[1]
        assert dest is not None and src is not None, "a COPY needs a destination and a source buffer"
        prg = BufferCopy(dest.nbytes, dest.device, src.device, si.ast.arg[1] if isinstance(si.ast.arg, tuple) else None,
                         takes_memory=isinstance(si.ast.arg, tuple) and takes_memory(si.ast))
    elif si.ast.op is Ops.BUFFER_VIEW:
        assert si.bufs[0] is not None
        prg = ViewOp(si.bufs[0])
    else: raise ValueError(f"don't know how to run an ExecItem with a {si.ast.op} ast")
    # (the constructor, not dataclasses.replace: this runs for every kernel of every eager step)
    return ExecItem(si.ast, si.bufs, si.metadata, si.fixedvars, prg, si.launch)

def compile_new_kernels(schedule: list[ExecItem]) -> None:
    """Compile the kernels of a schedule that aren't in the method cache yet, all at once (one batch per device)."""
    new: dict[str, dict[UOp, None]] = {}
    for si in schedule:
        if si.prg is None and si.ast.op is Ops.SINK and si.bufs and si.bufs[0] is not None and \
                (key := _method_key(si.bufs[0].device, si.ast)) not in method_cache:
            new.setdefault(key[0], {})[si.ast] = None
    for dev, asts in new.items():
        if len(asts) > 1: compile_kernels(dev, list(asts))

def exec_items(schedule: list[ScheduleItem], plan: ReplayPlan | None = None) -> list[ExecItem]:
    """The ExecItems of a schedule. For one instantiated from a replay plan (`plan`), the plan keeps each kernel's
    runner and its prepared launch per values of the knobs, so a replayed step neither looks its kernels up in the
    method cache nor converts their arguments again."""
    if plan is None: return [ExecItem(si.ast, si.bufs, fixedvars=si.fixedvars) for si in schedule]
    knobs = codegen_knob_values()
    runners = plan.runners.get(knobs, (None,) * len(schedule))
    items = [ExecItem(si.ast, si.bufs, fixedvars=si.fixedvars, prg=prg) for si, prg in zip(schedule, runners)]
    if knobs not in plan.runners:
        compile_new_kernels(items)
        items = [lower_schedule_item(ei) for ei in items]
        plan.runners[knobs] = tuple(ei.prg for ei in items)
    prepared = plan.launches.setdefault(knobs + launch_knob_values(), [None] * len(items))
    for i, ei in enumerate(items):
        if (state := prepared[i]) is False: continue
        # (by value and type: 0.0 and -0.0 are different parameters, and a nan is the same one again)
        vals = tuple([_arg_key(v) for v in ei.fixedvars.values()])
        if state is None or state[2] != vals:
            if (made := ei.prepared(tuple(range(len(ei.bufs))))) is None:
                prepared[i] = False
                continue
            state = prepared[i] = (made[0], made[1], vals)
        ei.launch = (state[0], state[1])
    return items

def replay_runners(plan: ReplayPlan) -> tuple[tuple[Runner, ...], list[Any], list[Any], list[Any]] | None:
    """What run_replayed needs to launch a replay of `plan` straight from it under the current knobs: the kernels'
    runners, their prepared launches (kept in the plan as exec_items keeps them) and per kernel what run_replayed
    keeps of its own (see there). None unless an earlier replay lowered the kernels under these knobs (exec_items) and
    none of them needs its memory checked against Variable values."""
    # (the code and launch knobs read in one pass: this runs on every replayed realize)
    launch = tuple([int(k.value) for k in _REPLAY_KNOBS])
    if (ready := plan.direct.get(launch)) is None:
        knobs = launch[:len(CODEGEN_KNOBS)]
        if (runners := plan.runners.get(knobs)) is None or any(r.bounds is not None for r in runners): return None
        # (the last list: run_replayed's launch graphs, and whether a runner of the plan may still run a quick program)
        ready = plan.direct[launch] = (runners, plan.launches.setdefault(launch, [None] * len(runners)),
                                       [None] * len(runners), [None, True])
    if _quick_runners and ready[3][1]:
        # (a plan's runners stay its runners: once none runs a quick program, none will)
        upgrade_quick_kernels(ready[0])
        ready[3][1] = any(r.quick_realize is not None for r in ready[0] if isinstance(r, CompiledRunner))
    _realizes[0] += 1   # (a replay makes no runner: the realize ends here as far as they are concerned)
    return ready

# a single kernel of at most this much work (ops, bytes moved: a few microseconds) launched by run_replayed runs on the
# calling thread when no kernel is queued ahead of it: waking a worker for it costs more than running it
HERE_MAX_OPS, HERE_MAX_MEM = 1 << 16, 1 << 17

def run_replayed(plan: ReplayPlan, ready: tuple[tuple[Runner, ...], list[Any], list[Any], list[Any]],
                 topo: list[UOp], storage: list[Buffer], do_update_stats: bool = True,
                 kernels: range | None = None) -> None:
    """Run a replayed schedule's kernels in order straight from its plan, without ExecItems: `ready` from
    replay_runners, `topo` the toposort of the graph, `storage` the Buffers of the plan's fresh buffers. A kernel goes
    through its prepared launch (made again when its parameters' values change, as exec_items does; a small one run
    on this thread when nothing is queued) or, where it has none, is called as ExecItem.run calls it. Once the
    launches are prepared, later replays queue consecutive ones through one launch graph (_launch_graphs). (Not while
    DEBUG, VIZ or PROFILE watch each kernel. `kernels`: only these, one by one.)"""
    runners, prepared, direct, whole = ready
    if kernels is None and (segments := whole[0]) and [prepared[i] for i in segments[0]] == segments[1]:
        ops = mem = count = 0
        for seg in segments[2]:
            if type(seg) is range:
                run_replayed(plan, ready, topo, storage, do_update_stats, seg)
                continue
            graph, refs, work, n = seg
            # (the allocations as below)
            allocations = []
            for r in refs:
                if r < 0: b = storage[~r]
                elif (b := topo[r].__dict__.get("_buffer")) is None: b = device_buffer(topo[r])
                allocations.append(a if (a := b.__dict__.get("_buf")) is not None else b.allocate(queued=True)._buf)
            graph(allocations)
            ops, mem, count = ops + work[0], mem + work[1], count + n
        if count and do_update_stats:
            GlobalCounters.global_ops += ops
            GlobalCounters.global_mem += mem
            GlobalCounters.kernel_count += count
        return
    ops = mem = count = 0
    for i, (ast, refs, params) in enumerate(plan.kernels) if kernels is None else \
            ((k, plan.kernels[k]) for k in kernels):
        state, mine = prepared[i], direct[i]
        if params or mine is None or mine[0] is not state:
            fixedvars = {f"_p{j}": topo[p].arg for j, p in enumerate(params)} if params else _NO_VARS
            kbufs = [device_buffer(topo[r]) if r >= 0 else storage[~r] for r in refs]
            if state is not False and (params or state is None):
                # (by value and type, as exec_items compares them)
                vals = tuple([_arg_key(v) for v in fixedvars.values()]) if params else ()
                if state is None or state[2] != vals:
                    made = ExecItem(ast, kbufs, fixedvars=dict(fixedvars), prg=runners[i]).prepared(
                        tuple(range(len(kbufs))))
                    state = prepared[i] = False if made is None else (made[0], made[1], vals)
            if state is False:
                # (a copy taking its source's memory trades it here, without an ExecItem: an eager step makes one)
                if not (type(prg := runners[i]) is BufferCopy and prg.takes_memory and prg.take(kbufs)):
                    ExecItem(ast, kbufs, fixedvars=dict(fixedvars), prg=prg).run(None, do_update_stats=do_update_stats)
                continue
            if mine is None or mine[0] is not state: mine = direct[i] = _direct_launch(state, refs, runners[i])
            work = mine[3] if mine[3] is not None else runners[i]._work(fixedvars)  # type: ignore[attr-defined]
        elif (work := mine[3]) is None: work = runners[i]._work(_NO_VARS)  # type: ignore[attr-defined]
        # the allocations in the launch's order, straight from the graph's BUFFER nodes and the fresh Buffers (each
        # allocated where it has none yet)
        allocations = []
        for r in mine[1]:
            if r < 0: b = storage[~r]
            elif (b := topo[r].__dict__.get("_buffer")) is None: b = device_buffer(topo[r])
            allocations.append(a if (a := b.__dict__.get("_buf")) is not None else b.allocate(queued=True)._buf)
        if not ((here := mine[2]) is not None and here(*allocations)): state[0](*allocations)
        if do_update_stats: ops, mem, count = ops + work[0], mem + work[1], count + runners[i].kernels
    if count:
        GlobalCounters.global_ops += ops
        GlobalCounters.global_mem += mem
        GlobalCounters.kernel_count += count
    # (made once, after this path has prepared the launches; False: there is no graph to make)
    if whole[0] is None and kernels is None: whole[0] = _launch_graphs(plan, ready) or False

def _launch_graphs(plan: ReplayPlan, ready: tuple) -> tuple | None:
    """How later replays of `plan` launch its kernels: runs of consecutive kernels that have a launch prepared for
    all their buffers (no lifted constants, work known without values, the CPU's LaunchGraph) as one graph each,
    queued in one call where a call per kernel cost a training step ~20 us per kernel. Returns (the kernels in
    graphs, their launches, the segments in order: a range of kernels launched one by one, or (graph, the buffer
    references whose allocations it takes in that order, (ops, bytes moved), kernels)); None where no graph is worth
    making (runs of one kernel, or of kernels all small enough to run on the calling thread: launched one by one,
    each where it runs best)."""
    prepared, direct = ready[1], ready[2]
    def graph_of(i: int) -> Any:
        state, mine = prepared[i], direct[i]
        if plan.kernels[i][2] or not state or mine is None or mine[0] is not state or mine[3] is None: return None
        # (the CPU's: a GPU's graph of an eager replay, whose buffers are new every call, is not used here yet)
        return graph if (graph := getattr(state[0], "graph", None)) is LaunchGraph else None
    segments: list[Any] = []
    graphed: list[int] = []
    i, n = 0, len(plan.kernels)
    while i < n:
        j = i + 1
        if (graph := graph_of(i)) is not None:
            while j < n and graph_of(j) is graph: j += 1
        if j - i < 2 or all(direct[k][2] is not None for k in range(i, j)):
            # (one by one: merged with the run before when that is one by one too)
            if segments and type(segments[-1]) is range: segments[-1] = range(segments[-1].start, j)
            else: segments.append(range(i, j))
            i = j
            continue
        index: dict[int, int] = {}
        calls = [(prepared[k][0], tuple([index.setdefault(r, len(index)) for r in direct[k][1]])) for k in range(i, j)]
        for k in range(i, j):
            # (a kernel run on one thread alone may be split across the threads in a graph, where a chunk costs a
            # claim rather than a wake-up: the CPU's launches decide by its work)
            if (note := getattr(prepared[k][0], "note_work", None)) is not None:
                note(direct[k][3])
        work = (sum(direct[k][3][0] for k in range(i, j)), sum(direct[k][3][1] for k in range(i, j)))
        # (no work given to the graph: it is always queued, never run inline, as the kernels one by one were)
        segments.append((graph(calls), tuple(index), work, sum(ready[0][k].kernels for k in range(i, j))))
        graphed += range(i, j)
        i = j
    if not graphed: return None
    return graphed, [prepared[k] for k in graphed], segments

def _direct_launch(state: tuple, refs: tuple[int, ...], prg: Any) -> tuple:
    """What run_replayed keeps for a kernel's prepared launch `state`: the launch itself (to see that it is still the
    one prepared), the buffer references in the order the launch takes their allocations, its run_here where the
    kernel is small enough to run on the calling thread, and its work where that doesn't depend on values."""
    work = getattr(prg, "_static_work", None)
    small = work is not None and work[0] <= HERE_MAX_OPS and work[1] <= HERE_MAX_MEM
    return (state, tuple([refs[j] for j in state[1]]), getattr(state[0], "run_here", None) if small else None, work)

_NO_VARS: dict[str, Any] = {}  # (read only)

def check_bounds(items: list[ExecItem], var_vals: dict[str, Any], subst: dict[int, Buffer] | None = None) -> None:
    """Raise IndexError when a kernel of `items` would touch memory outside a buffer under these Variable values
    (see VarBounds); all are checked before any runs, so an error leaves every buffer as it was. `subst` (by id) are
    the buffers a replay runs the items on in place of their own."""
    for ei in items:
        if ei.prg is not None and (bounds := ei.prg.bounds) is not None:
            bufs = ei.bufs if subst is None else [subst.get(id(b), b) for b in ei.bufs]
            bounds.check(bufs, {**var_vals, **ei.fixedvars} if ei.fixedvars else var_vals)

class BoundsCheck:
    """check_bounds of the same items on buffers of the same sizes for one set of values after another (a TinyJit's
    replays): the kernels that share a VarBounds (one program run on several layers' buffers), buffer sizes and fixed
    parameters are one check, so each distinct one runs once per set of values."""
    def __init__(self, items: list[ExecItem]):
        self.items = items
        groups: dict[tuple, tuple[VarBounds, tuple[int, ...], dict[str, Any]]] = {}
        for ei in items:
            if ei.prg is None or (bounds := ei.prg.bounds) is None: continue
            sizes = bounds.sizes(ei.bufs)
            fixed = tuple([(k, _arg_key(v)) for k, v in ei.fixedvars.items()])
            groups.setdefault((id(bounds), sizes, fixed), (bounds, sizes, ei.fixedvars))
        self.groups = list(groups.values())

    def check(self, var_vals: dict[str, Any], subst: dict[int, Buffer] | None = None) -> None:
        """check_bounds(items, var_vals, subst), where the buffers of `subst` have the sizes of those they replace."""
        for bounds, sizes, fixed in self.groups:
            if not bounds.within(sizes, {**var_vals, **fixed} if fixed else var_vals):
                check_bounds(self.items, var_vals, subst)   # (raises, naming the first kernel out of range)
                raise AssertionError("the bounds of a kernel differ between two checks of the same values")

# the JIT puts a recorder here while it captures; each item run by run_schedule is handed to capturing[0].add
capturing: list[Any] = []

def run_schedule(schedule: list[ExecItem], var_vals: dict[str, int] | None = None,
                 do_update_stats: bool = True) -> None:
    """Lower and run every item in order (allocating buffers as needed), counting the work in GlobalCounters."""
    var_vals = var_vals if var_vals is not None else {}
    st, k0, t0 = time.perf_counter(), GlobalCounters.kernel_count, GlobalCounters.time_sum_s
    if unwritten_buffers: check_unwritten(schedule)
    compile_new_kernels(schedule)
    items = [lower_schedule_item(si) for si in schedule]
    # (the runners made for this schedule, here or when it was made, carry this realize's number: they keep their
    # quick programs until a later realize runs them)
    if _quick_runners: upgrade_quick_kernels([ei.prg for ei in items])
    _realizes[0] += 1
    check_bounds(items, var_vals)
    nans = bool(DEBUG_NANS)
    for ei in items:
        ei.run(var_vals, do_update_stats=do_update_stats)
        if capturing: capturing[0].add(ei, var_vals)
        if nans: check_nans(ei.bufs, ei.ast, ei.prg.display_name if ei.prg is not None else "?")
    if DEBUG >= 1 and schedule:
        timed = f", {(GlobalCounters.time_sum_s - t0) * 1e3:.2f} ms in kernels" if DEBUG >= 2 else ""
        print(f"run_schedule: {len(schedule)} items, {GlobalCounters.kernel_count - k0} kernels, "
              f"{(time.perf_counter() - st) * 1e3:.2f} ms{timed}")
