"""PatternMatcher.rewrite binds a rule whose pattern names only ops (or nothing) without walking the pattern: the
bindings and the rules offered must be those UPat.match gives."""
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp, Variable
from fusegrad.uop.pattern import PatternMatcher, UPat

x = Variable("x", 0, 10)
f = UOp.const(dtypes.float32, 1.5)

def _offered(rules: list[tuple[UPat, str]], u: UOp) -> list[tuple[str, dict]]:
    """(label, bindings) of each rule offered `u`, in order (every rule returns None, so all are tried)."""
    seen: list[tuple[str, dict]] = []
    PatternMatcher([(p, (lambda label: lambda **kw: seen.append((label, kw)))(label)) for p, label in rules]).rewrite(u)
    return seen

def test_bindings_of_op_only_patterns():
    rules = [
        (UPat(Ops.ADD, name="a"), "named"),
        (UPat(Ops.ADD), "unnamed"),
        (UPat(name="any"), "wildcard"),
    ]
    u = x + 1
    assert _offered(rules, u) == [("named", {"a": u}), ("unnamed", {}), ("wildcard", {"any": u})]
    assert _offered(rules, x * 2) == [("wildcard", {"any": x * 2})]

def test_dtype_arg_and_sources_still_checked():
    rules = [
        (UPat(Ops.ADD, dtype=dtypes.float32, name="a"), "float add"),
        (UPat(Ops.CONST, arg=3, name="c"), "three"),
        (UPat(Ops.ADD, src=(UPat.var("l"), UPat.cvar("r")), name="a"), "add const"),
    ]
    assert _offered(rules, x + 1) == [("add const", {"a": x + 1, "l": x, "r": UOp.const(dtypes.index, 1)})]
    assert _offered(rules, f + f) == [("float add", {"a": f + f}), ("add const", {"a": f + f, "l": f, "r": f})]
    three = UOp.const(dtypes.index, 3)
    assert _offered(rules, three) == [("three", {"c": three})] and _offered(rules, UOp.const(dtypes.index, 4)) == []

def test_first_rule_that_returns_a_node_wins():
    u = x + 1
    pm = PatternMatcher([(UPat(Ops.ADD, name="a"), lambda a: None), (UPat(Ops.ADD), lambda: x),
                         (UPat(name="a"), lambda a: a * 3)])
    assert pm.rewrite(u) is x

def test_rewrite_skips_graphs_no_rule_can_change():
    # a pass whose rules name MUL: the part of the graph with no MUL at or below it is not walked, and the result is
    # the one a full walk gives (a wildcard rule that changes nothing forces the full walk)
    from fusegrad.uop.pattern import RewriteContext, graph_rewrite
    y = Variable("y", 0, 10)
    plain = (x + 3) // 2 + (y % 4)           # no MUL anywhere
    scaled = (x * 2 + 1) * (y + 5)
    sink = UOp.sink_of(plain + scaled, plain * 7)
    double = (UPat(Ops.MUL, name="m"), lambda m: m.src[0] + m.src[0] if m.src[1].op is Ops.CONST and
              m.src[1].arg == 2 else None)
    rc = RewriteContext(PatternMatcher([double]), None, False)
    out = rc.rewrite(sink)
    full = graph_rewrite(sink, PatternMatcher([double, (UPat(name="any"), lambda any: None)]))
    assert out is full
    assert out is UOp.sink_of(plain + ((x + x) + 1) * (y + 5), plain * 7)
    # `plain` is kept as it is, nothing below it was walked
    assert rc.replace[plain] is plain and all(s not in rc.replace for s in plain.src)
    # a graph without any MUL is returned as it is
    assert graph_rewrite(plain, PatternMatcher([double])) is plain
