"""Division and modulo that a range or a gate decides: `(e % m) < c` where e wraps once around m becomes a comparison of
e itself, and an `e // m` or `e % m` under a gate (a load's valid, a select's condition) that keeps e between two
multiples of m becomes q and e - q*m. Every case is checked against Python's integers with C semantics (truncating
division), exhaustively over each variable's range, negative ranges included (where the rules must stay away)."""
import itertools
import random
import pytest
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp, Variable
from fusegrad.uop.symbolic import simplify_indexing
from test.uop.test_symbolic_fuzz import evaluate

def _values(root: UOp, env: dict[str, int]):
    return evaluate(root, env)[root]

def _points(vs: list[tuple[str, int, int]]):
    for combo in itertools.product(*[range(lo, hi + 1) for _, lo, hi in vs]):
        yield dict(zip([n for n, _, _ in vs], combo))

def _lt_mod_cases(rng: random.Random, n: int):
    for _ in range(n):
        lo = rng.randint(-6, 40)
        hi = lo + rng.randint(0, 40)
        m = rng.randint(1, 40)
        yield lo, hi, rng.choice([1, 2, 3, -1]), rng.randint(-5, 80), m, rng.randint(-2, m + 2)

@pytest.mark.parametrize("dt", [dtypes.index, dtypes.int32])
def test_mod_compare_matches_python(dt):
    rng = random.Random(7)
    # every bound around the pieces' edges of a padded pool window (values 0..30 and 34, or 0..29 and 33..34)
    cases = [(0, 31, 1, c, 35, k) for c in (1, 33, 34) for k in range(-1, 37)] + [(0, 3, 34, 0, 35, 32)]
    for lo, hi, a, c, m, k in cases + list(_lt_mod_cases(rng, 150)):
        x = Variable("x", lo, hi, dt)
        e = (x * a + c) % m < k
        s = e.simplify()
        for env in _points([("x", lo, hi)]):
            assert _values(s, env) == _values(e, env), (lo, hi, a, c, m, k, env, s.render())

def test_mod_compare_of_a_padded_window_folds_to_the_loop():
    # a 3x3 stride-2 pool's gradient over a 32-wide axis padded by 1: window row 2's position is (x + 34) % 35
    x = Variable("x", 0, 31)
    assert ((x + 34) % 35 < 32).simplify() is (UOp.const(dtypes.index, 0) < x)
    assert ((x + 33) % 35 < 32).simplify() is (UOp.const(dtypes.index, 1) < x)
    # the range crosses two multiples of 35: undecided, left as it is
    y = Variable("y", 0, 40)
    assert ((y + 34) % 35 < 32).simplify().src[0].op is Ops.MOD

def _index_kernel(idx: UOp, valid: UOp) -> UOp:
    buf = UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(1 << 20), arg=0)
    ld = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32.ptr(1 << 20), (buf, idx, valid)),))
    sel = UOp(Ops.WHERE, dtypes.int32, (valid, idx.cast(dtypes.int32), UOp.const(dtypes.int32, -1)))
    return UOp(Ops.SINK, dtypes.void, (ld, sel))

def _parts(sink: UOp) -> tuple[UOp, UOp, UOp]:
    ld, sel = sink.src
    if ld.op is Ops.CONST: return UOp.const(dtypes.index, 0), UOp.const(dtypes.bool, False), sel  # never valid
    ix = ld.src[0]
    return ix.src[1], ix.src[2] if len(ix.src) > 2 else UOp.const(dtypes.bool, True), sel

def test_gated_divmod_matches_python():
    rng = random.Random(3)
    for _ in range(60):
        n1, n2 = rng.randint(1, 12), rng.randint(1, 12)
        c1, c2 = rng.randint(0, 40), rng.randint(0, 40)
        m1, m2 = rng.randint(2, 14), rng.randint(2, 14)
        k1, k2 = rng.randint(0, m1), rng.randint(0, m2)
        x, y = Variable("x", 0, n1 - 1), Variable("y", 0, n2 - 1)
        ex, ey = (x + c1) % m1, (y + c2) % m2
        idx = (ex // 2) * 16 + ey + (x + c1) // m1 * 100 + (y + c2) // m2 * 1000
        valid = (ex < k1) & (ey < k2)
        before = _index_kernel(idx, valid)
        after = simplify_indexing(before)
        bi, bv, bs = _parts(before)
        ai, av, as_ = _parts(after)
        for env in _points([("x", 0, n1 - 1), ("y", 0, n2 - 1)]):
            ok = _values(bv, env)
            assert _values(av, env) == ok
            assert _values(as_, env) == _values(bs, env)
            if ok: assert _values(ai, env) == _values(bi, env), (n1, n2, c1, c2, m1, m2, k1, k2, env)

def test_gate_decides_the_window_position():
    # the pool gradient's load: its index no longer divides or takes a modulo of the wrapped position
    x = Variable("x", 0, 31)
    e = (x + 34) % 35
    after = simplify_indexing(_index_kernel((e // 2) * 16 + (x + 34) // 35, e < 32))
    idx, valid, _ = _parts(after)
    assert all(u.op is not Ops.MOD or u.src[0] is not (x + 34).simplify() for u in idx.toposort())
    assert valid is (UOp.const(dtypes.index, 0) < x)
    for env in _points([("x", 1, 31)]): assert _values(idx, env) == (env["x"] - 1) // 2 * 16 + 1

def test_negative_numerators_are_left_alone():
    x = Variable("x", -10, 10)
    e = (x + 5) % 7
    before = _index_kernel(e // 2, e < 3)
    after = simplify_indexing(before)
    for env in _points([("x", -10, 10)]):
        bi, bv, _ = _parts(before)
        ai, av, _ = _parts(after)
        assert _values(av, env) == _values(bv, env)
        if _values(bv, env): assert _values(ai, env) == _values(bi, env)
