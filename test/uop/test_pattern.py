"""The rewrite engine: UPat matching, PatternMatcher dispatch and graph_rewrite / graph_rewrite_map.
Expected results are graphs built by hand (hash-consing makes `is` a full structural comparison)."""
import itertools
import pytest
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp, Variable
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite, graph_rewrite_map

x, y, z = Variable("x", 0, 10), Variable("y", 0, 10), Variable("z", 0, 10)
def ic(v) -> UOp: return UOp.const(dtypes.index, v)

def matches(pat: UPat, u: UOp) -> list[dict[str, UOp]]: return pat.match(u, {})

# the identities most tests use
identities = PatternMatcher([
    (UPat.var("a") * 1, lambda a: a),
    (UPat.var("a") + 0, lambda a: a),
], name="identities")

class TestUPatMatch:
    def test_op_and_op_set(self):
        assert matches(UPat(Ops.ADD), x + 1)
        assert not matches(UPat(Ops.MUL), x + 1)
        assert matches(UPat({Ops.MUL, Ops.ADD}), x + 1) and matches(UPat((Ops.MUL, Ops.ADD)), x * 2)
        assert matches(UPat(), x + 1)  # no op: anything

    def test_commutative_list_src_matches_any_order(self):
        pat = UPat(Ops.ADD, src=[UPat.cvar("c"), UPat.var("v")])
        for u in (x + 3, 3 + x):
            (store,) = matches(pat, u)
            assert store["c"] is ic(3) and store["v"] is x

    def test_list_src_tries_every_permutation(self):
        # three sources of three different kinds, given in every order
        pat = UPat(Ops.WHERE, src=[UPat(Ops.CMPLT, name="cond"), UPat(Ops.CONST, name="k"),
                                   UPat(Ops.DEFINE_VAR, name="v")])
        cond, k = x < 3, ic(7)
        for order in itertools.permutations([cond, k, y]):
            (store,) = matches(pat, UOp(Ops.WHERE, dtypes.index, order))
            assert store == {"cond": cond, "k": k, "v": y}

    def test_list_src_reports_every_way_to_match(self):
        # x + y against [var a, var b]: a=x,b=y and a=y,b=x
        stores = matches(UPat(Ops.ADD, src=[UPat.var("a"), UPat.var("b")]), x + y)
        assert sorted((s["a"].arg[0], s["b"].arg[0]) for s in stores) == [("x", "y"), ("y", "x")]

    def test_tuple_src_is_ordered(self):
        pat = UPat(Ops.ADD, src=(UPat.cvar("c"), UPat.var("v")))
        assert matches(pat, 3 + x)
        assert not matches(pat, x + 3)

    def test_src_length_must_match(self):
        pat = UPat(Ops.SINK, src=(UPat.cvar("c"),))
        assert matches(pat, UOp.sink_of(ic(1)))
        assert not matches(pat, UOp.sink_of(ic(1), x))
        assert not matches(pat, UOp.sink_of())

    def test_allow_any_len(self):
        pat = UPat(Ops.SINK, src=(UPat.cvar("c"),), allow_any_len=True)
        assert matches(pat, UOp.sink_of(ic(1), x, y))
        assert matches(pat, UOp.sink_of(ic(1)))
        assert not matches(pat, UOp.sink_of(x, ic(1)))   # the listed prefix still has to match
        assert not matches(pat, UOp.sink_of())            # and be there

    def test_single_upat_src_matches_every_source(self):
        pat = UPat(Ops.SINK, src=UPat(Ops.CONST))
        assert matches(pat, UOp.sink_of(ic(1), ic(2), ic(3)))
        assert matches(pat, UOp.sink_of(ic(1)))
        assert not matches(pat, UOp.sink_of(ic(1), x, ic(3)))

    def test_same_name_twice_binds_the_same_node(self):
        pat = UPat(Ops.ADD, src=(UPat.var("v"), UPat.var("v")))
        (store,) = matches(pat, x + x)
        assert store == {"v": x}
        assert not matches(pat, x + y)
        # also across levels: (v * c) + v
        pat2 = UPat(Ops.ADD, src=[UPat(Ops.MUL, src=[UPat.var("v"), UPat.cvar("c")]), UPat.var("v")])
        assert matches(pat2, x * 3 + x) and matches(pat2, x + 3 * x)
        assert not matches(pat2, x * 3 + y)

    def test_arg_matching(self):
        assert matches(UPat.const(None, 0), ic(0))
        assert not matches(UPat.const(None, 0), ic(1))
        assert matches(UPat(Ops.RANGE, arg=(2, "loop")), UOp.range(8, 2))
        assert not matches(UPat(Ops.RANGE, arg=(3, "loop")), UOp.range(8, 2))
        # True == 1 in Python, but a bool constant is not the integer 1
        assert not matches(UPat(Ops.CONST, arg=1), UOp.const(dtypes.bool, True))
        assert not matches(UPat(Ops.CONST, arg=True), ic(1))
        assert matches(UPat(Ops.CONST, arg=True), UOp.const(dtypes.bool, True))
        # an int pattern constant matches the equal float constant (x*1 applies to floats too)
        assert matches(UPat(Ops.CONST, arg=1), UOp.const(dtypes.float32, 1.0))

    def test_dtype_matching(self):
        f = Variable("f", 0, 10, dtypes.int32).cast(dtypes.float32)
        assert matches(UPat(dtype=dtypes.float32), f)
        assert not matches(UPat(dtype=dtypes.int32), f)
        assert matches(UPat(dtype={dtypes.int32, dtypes.float32}), f)
        assert matches(UPat.var("v", dtypes.index), x) and not matches(UPat.var("v", dtypes.int32), x)
        assert matches(UPat.cvar("c", dtypes.bool), UOp.const(dtypes.bool, False))

    def test_name_binds_the_matched_node(self):
        (store,) = matches(UPat(Ops.MUL, name="m", src=[UPat.var("v"), UPat.cvar("c")]), x * 4)
        assert store == {"m": x * 4, "v": x, "c": ic(4)}

class TestPatternMatcher:
    def test_callback_gets_bindings_and_returns_replacement(self):
        pm = PatternMatcher([(UPat(Ops.MUL, src=[UPat.var("v"), UPat.cvar("c")]),
                              lambda v, c: v + v if c.arg == 2 else None)])
        assert pm.rewrite(x * 2) is x + x
        assert pm.rewrite(2 * x) is x + x
        assert pm.rewrite(x * 3) is None      # the callback declined
        assert pm.rewrite(x + 2) is None      # no rule for ADD

    def test_first_rule_wins(self):
        pm = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: ic(1)), (UPat(Ops.ADD, name="a"), lambda a: ic(2))])
        assert pm.rewrite(x + y) is ic(1)

    def test_declined_rule_falls_through_to_the_next(self):
        pm = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: None), (UPat(Ops.ADD, name="a"), lambda a: ic(2))])
        assert pm.rewrite(x + y) is ic(2)

    def test_returning_the_same_node_is_no_rewrite(self):
        pm = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: a)])
        assert pm.rewrite(x + y) is None
        assert graph_rewrite(x + y, pm) is x + y

    def test_ctx_passed_when_callback_has_ctx(self):
        seen = []
        def record(ctx, a): ctx.append(a)
        def no_ctx(a): return None
        pm = PatternMatcher([(UPat(Ops.ADD, name="a"), no_ctx), (UPat(Ops.ADD, name="a"), record)])
        e = (x + y) * (y + z)
        assert graph_rewrite(e, pm, ctx=seen) is e
        assert set(seen) == {x + y, y + z}

    def test_ctx_can_drive_the_rewrite(self):
        # replace each variable by the value the context gives it
        pm = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), lambda ctx, v: v.const_like(ctx[v.arg[0]]))])
        assert graph_rewrite(x * 3 + y, pm, ctx={"x": 2, "y": 5}) is ic(2) * 3 + ic(5)

    def test_dispatch_by_op_skips_rules_for_other_ops(self):
        tried: list[tuple[str, Ops]] = []
        class CountingUPat(UPat):
            def match(self, uop, store):
                tried.append((self.name, uop.op))
                return super().match(uop, store)
        other_ops = [Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.WHERE, Ops.CAST, Ops.LOAD, Ops.STORE, Ops.XOR]
        rules = [(CountingUPat(other_ops[i % 10], name=f"other{i}"), lambda **kw: None) for i in range(50)]
        rules.append((CountingUPat(Ops.ADD, name="add", src=[UPat.var("a"), UPat.cvar("c")]),
                      lambda add, a, c: a if c.arg == 0 else None))
        pm = PatternMatcher(rules)
        e = ((x + y) + 0) + (z + 0)
        assert graph_rewrite(e, pm) is (x + y) + z
        # only the ADD rule was ever tried, and only on ADD nodes
        assert tried and all(name == "add" and op is Ops.ADD for name, op in tried)

    def test_rules_with_no_op_apply_to_every_op(self):
        pm = PatternMatcher([(UPat(Ops.MUL, name="m"), lambda m: None),
                             (UPat(name="u", dtype=dtypes.bool), lambda u: UOp.const(dtypes.bool, True))])
        assert pm.rewrite(x < 3) is UOp.const(dtypes.bool, True)
        assert pm.rewrite(x.ne(3)) is UOp.const(dtypes.bool, True)
        assert pm.rewrite(x + 3) is None

    def test_combine_with_plus(self):
        fold_add = PatternMatcher([(UPat(Ops.ADD, src=(UPat.cvar("a"), UPat.cvar("b"))),
                                    lambda a, b: a.const_like(a.arg + b.arg))], name="fold_add")
        both = identities + fold_add
        assert graph_rewrite((x * 1) + (ic(2) + ic(3)), both) is x + 5
        assert graph_rewrite((x * 1) + (ic(2) + ic(3)), identities) is x + (ic(2) + ic(3))
        assert len(both.patterns) == 3
        # rules of the left matcher come first
        first = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: ic(1))])
        second = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: ic(2))])
        assert (first + second).rewrite(x + y) is ic(1) and (second + first).rewrite(x + y) is ic(2)

class TestGraphRewrite:
    def test_identities_everywhere(self):
        e = UOp.sink_of((x * 1 + 0) * (y + 0), (z * 1) * 1)
        assert graph_rewrite(e, identities) is UOp.sink_of(x * y, z)
        assert graph_rewrite(e, identities, bottom_up=True) is UOp.sink_of(x * y, z)

    def test_untouched_graph_is_returned_as_is(self):
        e = (x + y) * z
        assert graph_rewrite(e, identities) is e and graph_rewrite(e, identities, bottom_up=True) is e

    def test_top_down_and_bottom_up_differ(self):
        # rule A rewrites a parent by looking at its child; rule B rewrites that child. Top-down sees the parent first,
        # so A fires; bottom-up rewrites the child first, after which A no longer matches.
        f = Variable("f", 0, 10, dtypes.int32).cast(dtypes.float32)
        rules = PatternMatcher([
            (UPat(Ops.NEG, src=(UPat(Ops.RECIP, src=(UPat.var("a"),)),)), lambda a: a.alu(Ops.SQRT)),  # A
            (UPat(Ops.RECIP, src=(UPat.var("a"),)), lambda a: a.alu(Ops.EXP2)),                        # B
        ])
        e = f.alu(Ops.RECIP).alu(Ops.NEG)
        assert graph_rewrite(e, rules) is f.alu(Ops.SQRT)
        assert graph_rewrite(e, rules, bottom_up=True) is f.alu(Ops.EXP2).alu(Ops.NEG)

    def test_fixed_point_on_one_node(self):
        # a constant counts down one step per rewrite: reaching 0 takes many rewrites of the same node
        countdown = PatternMatcher([(UPat.cvar("c", dtypes.index),
                                     lambda c: c.const_like(c.arg - 1) if c.arg > 0 else None)])
        for bottom_up in (False, True):
            assert graph_rewrite(ic(25), countdown, bottom_up=bottom_up) is ic(0)

    def test_fixed_point_through_the_graph(self):
        # constants above 100 count down one per rewrite and 100 becomes 0: the 105 turns into 0 only after six
        # rewrites, then the parent's x+0 must fire, then the grandparent's x*1
        def count(c): return c.const_like(c.arg - 1 if c.arg > 100 else 0) if c.arg >= 100 else None
        countdown = PatternMatcher([(UPat.cvar("c", dtypes.index), count)])
        e = (y + (x + ic(105)) * ic(1)) * ic(3)
        for bottom_up in (False, True):
            assert graph_rewrite(e, countdown + identities, bottom_up=bottom_up) is (y + x) * 3

    def test_new_nodes_from_rules_are_rewritten_too(self):
        # a rule that creates a node another rule then simplifies: (a*2) -> (a+a)*1 -> a+a
        pm = identities + PatternMatcher([(UPat.var("a") * 2, lambda a: (a + a) * 1)])
        for bottom_up in (False, True):
            assert graph_rewrite(UOp.sink_of(x * 2 + 0), pm, bottom_up=bottom_up) is UOp.sink_of(x + x)

    def test_shared_nodes_rewritten_once(self):
        calls = []
        def once(a):
            calls.append(a)
            return a
        pm = PatternMatcher([(UPat.var("a") * 1, once)])
        shared = x * 1
        e = UOp.sink_of(shared + y, shared + z, shared * 3)
        for bottom_up in (False, True):
            calls.clear()
            assert graph_rewrite(e, pm, bottom_up=bottom_up) is UOp.sink_of(x + y, x + z, x * 3)
            assert calls == [x]

    def test_deep_chain_no_recursion_error(self):
        n = 20_000
        e, expected = x, x
        for i in range(1, n + 1):
            e = (e + 0) * 1 + i
            expected = expected + i
        for bottom_up in (False, True):
            assert graph_rewrite(e, identities, bottom_up=bottom_up) is expected

    def test_rules_that_never_settle_raise(self):
        a, b = UOp(Ops.NOOP, dtypes.void, (), "a"), UOp(Ops.NOOP, dtypes.void, (), "b")
        flip = PatternMatcher([(UPat(Ops.NOOP, name="n"), lambda n: b if n.arg == "a" else a)])
        grow = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), lambda v: v + 0)])  # x -> x+0 -> (x+0)+0 ...
        for bottom_up in (False, True):
            with pytest.raises(RuntimeError): graph_rewrite(a.sink(), flip, bottom_up=bottom_up)
            with pytest.raises(RuntimeError): graph_rewrite(x * 2, grow, bottom_up=bottom_up)

    def test_ctx_guarded_rule_may_wrap_a_node_in_itself(self):
        # a rule that wraps a node once (remembering it in ctx) terminates: the inner copy is left alone
        def wrap(ctx, v):
            if v in ctx: return None
            ctx.add(v)
            return v.cast(dtypes.int32)
        pm = PatternMatcher([(UPat(Ops.DEFINE_VAR, name="v"), wrap)])
        for bottom_up in (False, True):
            assert graph_rewrite(UOp.sink_of(x, y), pm, ctx=set(), bottom_up=bottom_up) is \
                UOp.sink_of(x.cast(dtypes.int32), y.cast(dtypes.int32))

class TestGraphRewriteMap:
    def test_every_original_node_maps_to_its_rewrite(self):
        xm, xma = x * 1, x * 1 + 0
        yp = y + 0
        ypz = yp * z
        sink = UOp.sink_of(xma, ypz)
        expected = {x: x, y: y, z: z, ic(0): ic(0), ic(1): ic(1), xm: x, xma: x, yp: y, ypz: y * z,
                    sink: UOp.sink_of(x, y * z)}
        for bottom_up in (False, True):
            got = graph_rewrite_map(sink, identities, bottom_up=bottom_up)
            assert got == expected

    def test_input_map_is_chained(self):
        sink = UOp.sink_of(x * 1 + 0, y)
        # e.g. tensors pointing at nodes of the graph: their entries are carried through this rewrite
        held = {"t0": x * 1 + 0, "t1": y, "t2": sink}
        got = graph_rewrite_map(sink, identities, input_map=held)
        assert got == {"t0": x, "t1": y, "t2": UOp.sink_of(x, y)}

    def test_deep_chain_map(self):
        e = x
        for i in range(1, 5001): e = (e + 0) + i
        got = graph_rewrite_map(e, identities, bottom_up=True)
        assert len(got) == len(e.toposort())
        assert got[e] is graph_rewrite(e, identities)
