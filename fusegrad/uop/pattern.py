"""Pattern rewriting: `UPat` describes a subgraph, `PatternMatcher` maps patterns to rewrites, `graph_rewrite` applies
them to a fixed point. Everything is iterative, so graphs of any depth rewrite without hitting the recursion limit."""
from __future__ import annotations
import inspect
import itertools
import time
from typing import Any, Callable, Iterable
from fusegrad.dtype import DType
from fusegrad.helpers import DEBUG
from fusegrad.uop.ops import GroupOp, Ops, UOp
from fusegrad.viz import record as _viz

class UPat:
    """A pattern over UOps. `op`/`dtype` may be one value or a set; `src` is a tuple (in order), a list (any
    permutation, for commutative ops) or a single UPat (every source matches it); `name` binds the matched node."""
    __slots__ = ("op", "dtype", "arg", "name", "src", "allow_any_len", "_src_options", "_op_checks")

    def __init__(self, op: Ops | Iterable[Ops] | None = None, dtype: DType | Iterable[DType] | None = None,
                 src: tuple[UPat, ...] | list[UPat] | UPat | None = None, arg: Any = None, name: str | None = None,
                 allow_any_len: bool = False):
        self.op: frozenset[Ops] | None = None if op is None else frozenset((op,) if isinstance(op, Ops) else op)
        self.dtype: frozenset[DType] | None = None if dtype is None else \
            frozenset((dtype,) if isinstance(dtype, DType) else dtype)
        self.arg, self.name, self.src, self.allow_any_len = arg, name, src, allow_any_len
        # every ordering of sources to try: one for a tuple, all permutations for a list
        if src is None or isinstance(src, UPat): self._src_options: list[tuple[UPat, ...]] | None = None
        elif isinstance(src, list): self._src_options = [tuple(p) for p in itertools.permutations(src)]
        else: self._src_options = [tuple(src)]
        # per source ordering, the (position, allowed ops) of sources whose pattern names ops: checked before any
        # bindings are built, so a wrong ordering of a commutative pattern is rejected cheaply
        self._op_checks: list[tuple[tuple[int, frozenset[Ops]], ...]] = [] if self._src_options is None else \
            [tuple((i, p.op) for i, p in enumerate(o) if p.op is not None) for o in self._src_options]

    # *** constructors ***

    @staticmethod
    def var(name: str | None = None, dtype: DType | Iterable[DType] | None = None) -> UPat:
        """Any node (of `dtype`), bound to `name`."""
        return UPat(dtype=dtype, name=name)
    @staticmethod
    def cvar(name: str | None = None, dtype: DType | Iterable[DType] | None = None) -> UPat:
        """Any constant (of `dtype`), bound to `name`."""
        return UPat(Ops.CONST, dtype=dtype, name=name)
    @staticmethod
    def const(dtype: DType | Iterable[DType] | None, b: Any) -> UPat:
        """The constant `b`."""
        return UPat(Ops.CONST, dtype=dtype, arg=b)

    def named(self, name: str) -> UPat:
        ret = UPat.__new__(UPat)
        for k in UPat.__slots__: setattr(ret, k, getattr(self, k))
        ret.name = name
        return ret

    # *** building patterns with operators (commutative ops match any source order) ***

    def alu(self, op: Ops, *src: UPat) -> UPat:
        srcs = (self,) + src
        return UPat(op, src=list(srcs) if op in GroupOp.Commutative else srcs)
    def _other(self, x: Any) -> UPat: return x if isinstance(x, UPat) else UPat.const(None, x)
    def __add__(self, x: Any) -> UPat: return self.alu(Ops.ADD, self._other(x))
    def __radd__(self, x: Any) -> UPat: return self.alu(Ops.ADD, self._other(x))
    def __mul__(self, x: Any) -> UPat: return self.alu(Ops.MUL, self._other(x))
    def __rmul__(self, x: Any) -> UPat: return self.alu(Ops.MUL, self._other(x))
    def __floordiv__(self, x: Any) -> UPat: return self.alu(Ops.IDIV, self._other(x))
    def __mod__(self, x: Any) -> UPat: return self.alu(Ops.MOD, self._other(x))
    def __lt__(self, x: Any) -> UPat: return self.alu(Ops.CMPLT, self._other(x))
    def __and__(self, x: Any) -> UPat: return self.alu(Ops.AND, self._other(x))
    def __or__(self, x: Any) -> UPat: return self.alu(Ops.OR, self._other(x))
    def __xor__(self, x: Any) -> UPat: return self.alu(Ops.XOR, self._other(x))
    def maximum(self, x: Any) -> UPat: return self.alu(Ops.MAX, self._other(x))
    def ne(self, x: Any) -> UPat: return self.alu(Ops.CMPNE, self._other(x))
    def where(self, x: Any, y: Any) -> UPat: return self.alu(Ops.WHERE, self._other(x), self._other(y))
    def cast(self, dtype: DType | None = None) -> UPat: return UPat(Ops.CAST, dtype, (self,))
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        fields = []
        if self.op is not None: fields.append("{" + ", ".join(sorted(o.name for o in self.op)) + "}")
        if self.dtype is not None: fields.append(f"dtype={set(self.dtype)}")
        if self.arg is not None: fields.append(f"arg={self.arg!r}")
        if self.name is not None: fields.append(f"name={self.name!r}")
        if self.src is not None: fields.append(f"src={self.src!r}")
        return f"UPat({', '.join(fields)})"

    # *** matching ***

    def match(self, uop: UOp, store: dict[str, UOp]) -> list[dict[str, UOp]]:
        """Every way this pattern matches `uop`, each as the bindings extending `store` (empty list: no match)."""
        if self.op is not None and uop.op not in self.op: return []
        if self.dtype is not None and uop.dtype not in self.dtype and uop.dtype.scalar() not in self.dtype: return []
        if self.arg is not None and not _arg_equal(self.arg, uop.arg): return []
        if self.name is not None:
            bound = store.get(self.name)
            if bound is not None:
                if bound is not uop: return []
            else: store = {**store, self.name: uop}
        if self.src is None: return [store]
        if isinstance(self.src, UPat):
            stores = [store]
            for s in uop.src: stores = [r for st in stores for r in self.src.match(s, st)]
            return stores
        assert self._src_options is not None
        src = uop.src
        n = len(self._src_options[0])
        if len(src) != n and not (self.allow_any_len and len(src) >= n): return []
        res: list[dict[str, UOp]] = []
        for option, op_checks in zip(self._src_options, self._op_checks):
            if any(src[i].op not in ops for i, ops in op_checks): continue
            stores = [store]
            for p, s in zip(option, src):
                # one binding so far is by far the common case: skip building a flattened list
                stores = p.match(s, stores[0]) if len(stores) == 1 else [r for st in stores for r in p.match(s, st)]
                if not stores: break
            res.extend(stores)
        return res

def _arg_equal(want: Any, have: Any) -> bool:
    # bools and ints compare equal in Python (True == 1); constants of different kinds must not match
    return want == have and (type(want) is type(have) or not isinstance(want, bool) and not isinstance(have, bool))

class PatternMatcher:
    """An ordered list of `(UPat, callback)` rules. Rules are dispatched by op, so matching cost doesn't grow with the
    number of rules for other ops. A callback gets the named bindings as keyword arguments (and `ctx` if it has such a
    parameter) and returns a replacement UOp or None. Matchers combine with `+`."""

    def __init__(self, patterns: list[tuple[UPat, Callable[..., UOp | None]]], name: str | None = None):
        self.patterns = list(patterns)
        self.name = name
        # (a pattern that names only ops and binds the node, most rules' root, matches every node it is offered: its
        # bindings are made without walking the pattern)
        entries = [(p, fxn, "ctx" in inspect.signature(fxn).parameters,
                    p.dtype is None and p.arg is None and p.src is None) for p, fxn in self.patterns]
        # per op: the rules that can match it (those naming the op, and those with any op), in rule order
        self.wildcard = [e for e in entries if e[0].op is None]
        all_ops = {op for p, _ in self.patterns if p.op is not None for op in p.op}
        self.pdict: dict[Ops, list[tuple[UPat, Callable, bool, bool]]] = \
            {op: [e for e in entries if e[0].op is None or op in e[0].op] for op in all_ops}

    def __add__(self, other: PatternMatcher) -> PatternMatcher:
        return PatternMatcher(self.patterns + other.patterns, name=f"{self.name}+{other.name}")

    def rewrite(self, uop: UOp, ctx: Any = None) -> UOp | None:
        """The first rule's replacement for `uop`, or None when no rule applies."""
        for pat, fxn, wants_ctx, whole in self.pdict.get(uop.op, self.wildcard):
            for store in ((({pat.name: uop} if pat.name is not None else {}),) if whole else pat.match(uop, {})):
                ret = fxn(ctx=ctx, **store) if wants_ctx else fxn(**store)
                if ret is not None and ret is not uop:
                    if _viz.VIZ: _viz.record_step(uop, ret, fxn)
                    return ret
        return None

def _rewrite_to_fixed_point(pm: PatternMatcher, uop: UOp, ctx: Any, limit: int = 10000) -> UOp:
    for _ in range(limit):
        new = pm.rewrite(uop, ctx)
        if new is None: return uop
        uop = new
    raise RuntimeError(f"{pm.name or 'graph_rewrite'}: rewriting did not reach a fixed point after {limit} steps at "
                       f"{uop.op}")

_NOTHING: frozenset[UOp] = frozenset()

def _unruled(root: UOp, ruled: dict[Ops, Any]) -> set[UOp]:
    """The nodes of `root`'s graph with no op of `ruled` at or below them (one pass over its toposort)."""
    out: set[UOp] = set()
    add = out.add
    for u in root.toposort():
        if u.op not in ruled and out.issuperset(u.src): add(u)
    return out

class RewriteContext:
    """One graph_rewrite run: the rules, the context, and the memo of node -> fully rewritten node (`memo`: one kept
    by the caller across runs of the same rules, see graph_rewrite)."""
    def __init__(self, pm: PatternMatcher, ctx: Any, bottom_up: bool, memo: dict[UOp, UOp] | None = None):
        self.pm, self.ctx, self.bottom_up = pm, ctx, bottom_up
        self.replace: dict[UOp, UOp] = {} if memo is None else memo
        self.max_reentries = 100
        # the nodes no rule can change (see rewrite), found at the first root; a caller's memo does that itself
        self.fixed: set[UOp] | frozenset[UOp] | None = None if memo is None else _NOTHING

    def rewrite(self, root: UOp) -> UOp:
        """`root` rewritten to a fixed point; an explicit stack replaces recursion.

        top-down: a node is rewritten until no rule applies, then its sources are rewritten, then it is rebuilt and
        rewritten again. bottom-up: sources first, then the node; a new node from a rule is processed from scratch."""
        replace, pm, ctx, bottom_up = self.replace, self.pm, self.ctx, self.bottom_up
        pm_rewrite, replaced_by = pm.rewrite, replace.__getitem__
        # a node of an op no rule names is not offered to the rules (most nodes, for a pass that rewrites loads)
        ruled, wildcard = pm.pdict, bool(pm.wildcard)
        # and where no rule takes any op: a node with no such op at or below it stays as it is, so the walk doesn't go
        # below it (a lowering pass for reductions, in a kernel of a few reductions, walks those and their users)
        # (found once per run: graph_rewrite_map rewrites more roots of the same graph)
        if (fixed := self.fixed) is None: fixed = self.fixed = _NOTHING if wildcard else _unruled(root, ruled)
        # stack entries: (original node, stage, node being processed for it)
        stack: list[tuple[UOp, int, UOp]] = [(root, 0, root)]
        push, pop = stack.append, stack.pop
        # nodes whose processing has started and not finished; meeting one again means a rule put a node being
        # rewritten back into its own result. That can be fine once (a ctx-guarded rule wrapping a node), but rules that
        # cycle (a -> b -> a) would loop forever, so re-entries per node are capped
        pending: set[UOp] = set()
        reentries: dict[UOp, int] = {}
        while stack:
            n, stage, cur = pop()
            if stage == 0:
                if n in replace: continue
                if n in fixed:
                    replace[n] = n
                    continue
                if n in pending:
                    reentries[n] = reentries.get(n, 0) + 1
                    if reentries[n] > self.max_reentries:
                        raise RuntimeError(f"{pm.name or 'graph_rewrite'}: rules rewrite a {n.op} into a graph "
                                           "containing itself, forever")
                pending.add(n)
                # (most nodes match no rule: the first try is made here, the loop to a fixed point only after a match)
                if not bottom_up and (wildcard or n.op in ruled) and (new := pm_rewrite(n, ctx)) is not None:
                    cur = _rewrite_to_fixed_point(pm, new, ctx)
                if cur is not n and cur in replace:
                    replace[n] = replace[cur]
                    pending.discard(n)
                    continue
                push((n, 1, cur))
                for s in reversed(cur.src):
                    if s not in replace: push((s, 0, s))
            elif stage == 1:
                new_src = tuple(map(replaced_by, cur.src))
                # tuples of UOps compare element by element with identity (UOp has no __eq__), at C speed
                rebuilt = cur if new_src == cur.src else UOp(cur.op, cur.dtype, new_src, cur.arg)
                # top-down already took `cur` to a fixed point; only a rebuilt node can match again
                new = None if (rebuilt is cur and not bottom_up) or not (wildcard or rebuilt.op in ruled) else \
                    pm_rewrite(rebuilt, ctx)
                if new is None:
                    replace[n] = rebuilt
                    if cur is not n: replace[cur] = rebuilt
                    pending.discard(n)
                else:
                    push((n, 2, new))
                    push((new, 0, new))
            else:
                replace[n] = replace[cur]
                pending.discard(n)
        return replace[root]

def graph_rewrite(sink: UOp, pm: PatternMatcher, ctx: Any = None, bottom_up: bool = False,
                  name: str | None = None, memo: dict[UOp, UOp] | None = None) -> UOp:
    """`sink` with the rules of `pm` applied everywhere until none applies.

    `memo`: a dict of node -> its rewritten node, read and extended by this run, for a caller that rewrites many
    graphs sharing nodes with the same rules. Only for rules whose result depends on the node alone (no `ctx`, no
    state): a node's rewrite is then the same in every graph, so a later run reuses what an earlier one found."""
    if _viz.VIZ:
        return _viz.record_rewrite(lambda: RewriteContext(pm, ctx, bottom_up, memo).rewrite(sink), sink, pm, name)
    st = time.perf_counter()
    ret = RewriteContext(pm, ctx, bottom_up, memo).rewrite(sink)
    if DEBUG >= 6 and name: print(f"graph_rewrite {name}: {(time.perf_counter()-st)*1e3:.2f} ms")
    return ret

def graph_rewrite_map(sink: UOp, pm: PatternMatcher, ctx: Any = None, bottom_up: bool = False,
                      name: str | None = None, input_map: dict[UOp, UOp] | None = None) -> dict[UOp, UOp]:
    """Like graph_rewrite, but returns old -> new for every node of the original graph (so holders of old nodes,
    such as Tensors, can be re-pointed). `input_map` chains an earlier map: its keys are mapped through this rewrite."""
    rc = RewriteContext(pm, ctx, bottom_up)
    if _viz.VIZ: _viz.record_rewrite(lambda: rc.rewrite(sink), sink, pm, name)
    else: rc.rewrite(sink)
    ret = {}
    done = rc.replace  # (most nodes were reached by the sink's rewrite: no new run for each)
    for u in sink.toposort(): ret[u] = done[u] if u in done else rc.rewrite(u)
    if input_map is not None: return {k: ret.get(v, v) for k, v in input_map.items()}
    return ret
