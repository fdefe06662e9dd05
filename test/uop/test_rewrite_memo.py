"""A memo shared by graph rewrites (the index simplification of code generation): every graph is rewritten to what a
fresh rewrite gives, whatever was rewritten before, and a node rewritten once is not rewritten again."""
from __future__ import annotations
import random
from fusegrad.dtype import dtypes
from fusegrad.uop import symbolic as sym
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

def _random_index(rng: random.Random, loops: list[UOp], depth: int = 3) -> UOp:
    if depth == 0: return rng.choice(loops) if rng.random() < 0.8 else UOp.const(dtypes.index, rng.randint(0, 9))
    a, b = _random_index(rng, loops, depth - 1), _random_index(rng, loops, depth - 1)
    k = rng.randint(1, 12)
    return rng.choice([lambda: a + b, lambda: a * k + b, lambda: (a + b) // k, lambda: (a * k + b) % (k + 1),
                       lambda: (a + 3) // k * k + b % k])()

def test_memo_gives_a_fresh_rewrites_result():
    rng = random.Random(0)
    loops = [UOp.range(n, i, "loop") for i, n in enumerate((4, 7, 16))]
    exprs = [_random_index(rng, loops) for _ in range(300)]
    memo: dict[UOp, UOp] = {}
    for e in exprs:
        fresh = graph_rewrite(e, sym.symbolic)
        assert graph_rewrite(e, sym.symbolic, memo=memo) is fresh
        # and the same expression again, now from the memo
        assert graph_rewrite(e, sym.symbolic, memo=memo) is fresh
    # the memo holds results for the nodes below the roots too
    assert len(memo) > len(exprs)

def test_memo_skips_nodes_rewritten_before():
    calls: list[UOp] = []
    def double(x: UOp) -> UOp | None:
        calls.append(x)
        return None
    pm = PatternMatcher([(UPat(Ops.ADD, name="x"), double)])
    a, b = UOp.variable("a", 0, 10), UOp.variable("b", 0, 10)
    shared = a + b
    memo: dict[UOp, UOp] = {}
    graph_rewrite(shared * 2, pm, memo=memo)
    assert calls == [shared]
    graph_rewrite((shared + 1) * 3, pm, memo=memo)
    # only the new ADD was tried; `shared` came from the memo
    assert calls == [shared, shared + 1]

def test_simplify_index_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(sym, "INDEX_MEMO_SIZE", 10)
    sym._index_memo.clear()
    r = UOp.range(32, 0, "loop")
    for k in range(2, 40):
        e = (r * k + 5) // k
        assert sym.simplify_index(e) is graph_rewrite(e, sym.symbolic)
        # emptied before a call that finds it over the bound: at most one expression's nodes beyond it
        assert len(sym._index_memo) <= 10 + len(e.toposort()) + 8
