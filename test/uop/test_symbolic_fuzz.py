"""Fuzz `UOp.simplify()`: random integer expressions over Variables are evaluated at random points before and after
simplification with an independent evaluator (C semantics: truncating division, two's-complement wrap-around for fixed
width ints, no wrap for dtypes.index), and every node's value must lie inside its [vmin, vmax]."""
import math
import random
from fractions import Fraction
import pytest
from fusegrad.dtype import DType, dtypes
from fusegrad.uop.ops import Ops, UOp, Variable

# *** an evaluator that shares no code with fusegrad's exec_alu ***

def wrap(v: int, dt: DType) -> int:
    """Two's-complement wrap of a Python int to a fixed-width dtype; index is unbounded."""
    if dt.scalar() == dtypes.index: return v
    if dtypes.is_unsigned(dt): return v % (1 << (8 * dt.itemsize))
    half = 1 << (8 * dt.itemsize - 1)
    return (v + half) % (2 * half) - half

def c_div(a: int, b: int) -> int:
    """C's a/b: the exact quotient truncated toward zero."""
    return math.trunc(Fraction(a, b))

def c_mod(a: int, b: int) -> int:
    """C's a%b: what is left after subtracting the truncated quotient times b."""
    return a - b * c_div(a, b)

def evaluate(root: UOp, env: dict[str, int]) -> dict[UOp, int | bool]:
    """The value of every node of `root` with Variables set from `env` (by name)."""
    vals: dict[UOp, int | bool] = {}
    for u in root.toposort():
        s = [vals[x] for x in u.src]
        op = u.op
        if op is Ops.CONST: v = u.arg
        elif op is Ops.DEFINE_VAR: v = env[u.arg[0]]
        elif op is Ops.ADD: v = s[0] + s[1]
        elif op is Ops.SUB: v = s[0] - s[1]
        elif op is Ops.NEG: v = -s[0]
        elif op is Ops.MUL: v = s[0] * s[1]
        elif op is Ops.IDIV: v = c_div(s[0], s[1])  # a zero divisor raises: simplify must never make one
        elif op is Ops.MOD: v = c_mod(s[0], s[1])
        elif op is Ops.MAX: v = max(s[0], s[1])
        elif op is Ops.CMPLT: v = s[0] < s[1]
        elif op is Ops.CMPNE: v = s[0] != s[1]
        elif op is Ops.CMPEQ: v = s[0] == s[1]
        elif op is Ops.AND: v = (s[0] and s[1]) if isinstance(s[0], bool) else s[0] & s[1]
        elif op is Ops.OR: v = (s[0] or s[1]) if isinstance(s[0], bool) else s[0] | s[1]
        elif op is Ops.XOR: v = (s[0] != s[1]) if isinstance(s[0], bool) else s[0] ^ s[1]
        elif op is Ops.NOT: v = not s[0]
        elif op is Ops.WHERE: v = s[1] if s[0] else s[2]
        elif op is Ops.CAST: v = bool(s[0]) if u.dtype == dtypes.bool else int(s[0])
        else: raise NotImplementedError(f"evaluator has no {op}")
        if u.dtype.scalar() != dtypes.bool: v = wrap(int(v), u.dtype)
        vals[u] = v
    return vals

# *** random expressions ***

# (name, min, max): small, nonnegative, negative, mixed and single-valued ranges
VAR_SPECS = [("a", 0, 7), ("b", 0, 63), ("c", -8, 8), ("d", -20, -1), ("e", 1, 300), ("f", 5, 5), ("g", -3, 40)]
DIVISORS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64, -1, -2, -3, -4, -8]

class Gen:
    def __init__(self, rng: random.Random, dt: DType, specs=VAR_SPECS, consts=(-10, 10), mults=(-5, 9)):
        self.rng, self.dt, self.consts, self.mults = rng, dt, consts, mults
        self.vars = [Variable(n, lo, hi, dt) for n, lo, hi in specs]

    def const(self, lo=None, hi=None) -> UOp:
        return UOp.const(self.dt, self.rng.randint(lo if lo is not None else self.consts[0],
                                                   hi if hi is not None else self.consts[1]))

    def leaf(self) -> UOp: return self.rng.choice(self.vars) if self.rng.random() < 0.75 else self.const()

    def cond(self, depth: int) -> UOp:
        r = self.rng
        if r.random() < 0.3:  # a linear form against a constant, as index bounds checks are
            v1, v2 = r.sample(self.vars, 2)
            t1, t2, k = v1 * r.randint(*self.mults), v2 * r.randint(*self.mults), self.const()
            x = t1 + t2 + k if r.random() < 0.5 else t1 + k + t2  # not always in canonical order
        else: x = self.expr(depth)
        if r.random() < 0.2: x = x // r.choice(DIVISORS[1:11])
        y = self.expr(depth - 1) if r.random() < 0.3 else self.const()
        c = r.choice([lambda: x < y, lambda: y < x, lambda: x.ne(y), lambda: x.eq(y), lambda: x <= y, lambda: x >= y])()
        k = r.random()
        if k < 0.15: return c & self.cond(depth - 1)
        if k < 0.3: return c | self.cond(depth - 1)
        if k < 0.4: return c.logical_not()
        if k < 0.45: return self.expr(depth - 1).cast(dtypes.bool)  # != 0
        return c

    def expr(self, depth: int) -> UOp:
        r = self.rng
        if depth <= 0 or r.random() < 0.15: return self.leaf()
        d = depth - 1
        kind = r.randrange(16)
        if kind == 0: return self.expr(d) + self.expr(d)
        if kind == 1: return self.expr(d) - self.expr(d)
        if kind == 2: return self.expr(d) * r.randint(*self.mults)
        if kind == 3: return self.expr(d) * self.leaf()
        if kind == 4: return self.expr(d) // r.choice(DIVISORS)
        if kind == 5: return self.expr(d) % r.choice(DIVISORS)
        if kind == 6: return self.expr(d).maximum(self.expr(d))
        if kind == 7: return self.expr(d).minimum(self.expr(d))
        if kind == 8: return self.cond(d).where(self.expr(d), self.expr(d))
        if kind == 9: return -self.expr(d)
        if kind == 14: return self.cond(d).cast(self.dt)  # 0 or 1
        # nested div/mod shapes that index math produces
        x, a, b = self.expr(d), r.choice(DIVISORS[:11]), r.choice(DIVISORS[:11])
        while wrap(a * b, self.dt) != a * b: a, b = a // 2 or 1, b // 2 or 1  # keep a*b a nonzero constant in int8
        if kind == 10: return x // a // b
        if kind == 11: return (x % (a * b)) // a
        if kind == 12: return (x % (a * b)) % a
        if kind == 15:
            # a split index put back together, k*(x//a)*a + k*(x%a) (= k*x), sometimes with a coefficient off by one
            m, m2 = r.randint(-3, 3), r.choice([0, 0, 0, 1, -1])
            if r.random() < 0.5: return (x // a) * (a * m + m2) + (x % a) * m
            return ((x // a) % b) * (a * m + m2) + (x % a) * m + (x // (a * b)) * (a * b * m)
        # a linear combination as made by reshapes: (v1*s1 + v2*s2 + c) // s % n
        v1, v2 = r.sample(self.vars, 2)
        return ((v1 * a * b + v2 * r.randint(0, a * b) + r.randint(-3, 9)) // a) % b

def env_points(rng: random.Random, specs, n: int) -> list[dict[str, int]]:
    pts = [{nm: lo for nm, lo, _ in specs}, {nm: hi for nm, _, hi in specs}]
    pts += [{nm: rng.randint(lo, hi) for nm, lo, hi in specs} for _ in range(n)]
    return pts

def check_ranges(vals: dict[UOp, int | bool], what):
    for u, v in vals.items():
        assert u.vmin <= v <= u.vmax, f"{what()}: {u.render()} = {v} outside [{u.vmin}, {u.vmax}]"

def fuzz(seed: int, count: int, dt: DType, depth: int, specs=VAR_SPECS, conds: bool = False, **kw) -> int:
    """Simplify `count` random expressions; returns how many simplified to something else (to check the test bites)."""
    rng = random.Random(seed)
    gen = Gen(rng, dt, specs, **kw)
    changed = 0
    for i in range(count):
        e = gen.cond(depth) if conds else gen.expr(depth)
        s = e.simplify()
        changed += s is not e
        for env in env_points(rng, specs, 6):
            ve, vs = evaluate(e, env), evaluate(s, env)
            ctx = lambda: f"seed {seed} #{i} at {env}:\n  {e.render()}\n  -> {s.render()}"
            assert ve[e] == vs[s], f"{ctx()}\n  before {ve[e]} after {vs[s]}"
            check_ranges(ve, lambda: ctx() + "\n  original")
            check_ranges(vs, lambda: ctx() + "\n  simplified")
        # simplifying again changes nothing (the rewrite reached a fixed point)
        assert s.simplify() is s, f"seed {seed} #{i}: {s.render()} -> {s.simplify().render()}"
    return changed

@pytest.mark.parametrize("seed", range(6))
def test_fuzz_index(seed):
    # 6 x 600 index expressions (no wrap-around), depth up to 4
    assert fuzz(1000 + seed, 600, dtypes.index, 4) > 300

@pytest.mark.parametrize("seed", range(2))
def test_fuzz_conditions(seed):
    # boolean roots: comparisons of sums and quotients against constants, combined with & | !
    assert fuzz(1500 + seed, 500, dtypes.index if seed == 0 else dtypes.int32, 3, conds=True) > 250

@pytest.mark.parametrize("seed", range(2))
def test_fuzz_int32_small(seed):
    # int32 expressions over small ranges: they never overflow, every rule may fire
    assert fuzz(2000 + seed, 600, dtypes.int32, 4) > 300

def test_fuzz_int32_wraps():
    # int32 with large ranges and multipliers: sums overflow and wrap, rules that need exact values must stay away
    specs = [("a", 0, 2**20), ("b", -2**30, 2**30), ("c", -8, 8), ("d", 2**31 - 100, 2**31 - 1),
             ("e", -2**31, -2**31 + 50)]
    assert fuzz(3000, 500, dtypes.int32, 3, specs, consts=(-2**31, 2**31 - 1), mults=(-2**20, 2**20)) > 200

@pytest.mark.parametrize("conds", [False, True])
def test_fuzz_int8_wraps(conds):
    # int8 wraps after 127: small constants already overflow
    specs = [("a", 0, 15), ("b", -128, 127), ("c", -8, 8), ("d", 100, 127), ("e", -128, -120)]
    assert fuzz(3500 + conds, 500, dtypes.int8, 3, specs, conds, consts=(-128, 127), mults=(-20, 20)) > 200

def test_fuzz_index_huge():
    # index values beyond 64 bits: index math must not wrap anywhere (range analysis included)
    specs = [("a", 0, 2**62), ("b", -2**70, 2**70), ("c", -8, 8), ("d", 1, 2**40)]
    assert fuzz(4000, 400, dtypes.index, 3, specs, consts=(-2**66, 2**66), mults=(-2**33, 2**33)) > 150

def test_fuzz_int8_linear_comparisons():
    # sums of small multiples of int8 variables near the limits, the constant not always last, compared with
    # constants: the comparison rules must notice when a rebuilt part of the sum would wrap
    rng = random.Random(5000)
    specs = [("p", 50, 70), ("q", 40, 80), ("r", -70, -50), ("s", -128, -100), ("t", 100, 127)]
    vs = [Variable(nm, lo, hi, dtypes.int8) for nm, lo, hi in specs]
    for i in range(1500):
        v1, v2 = rng.sample(vs, 2)
        m1, m2 = rng.choice([1, 2, -1, -2]), rng.choice([1, 2, -1, -2, 3])
        # the true range of m1*v1 + m2*v2, then k so that the whole sum fits int8 while the part without k may not
        ends = [m * b for m, v in ((m1, v1), (m2, v2)) for b in (v.arg[1], v.arg[2])]
        lo = min(ends[0], ends[1]) + min(ends[2], ends[3])
        hi = max(ends[0], ends[1]) + max(ends[2], ends[3])
        k = rng.randint(-128 - lo, 127 - hi) if -128 - lo <= 127 - hi and rng.random() < 0.8 else rng.randint(-128, 127)
        x = (v1 * m1 + k) + v2 * m2 if rng.random() < 0.7 else v1 * m1 + v2 * m2 + k
        if rng.random() < 0.3: x = x * -1
        c = UOp.const(dtypes.int8, max(-128, min(127, rng.randint(x.vmin, x.vmax))))
        e = rng.choice([lambda: x < c, lambda: c < x, lambda: x.ne(c), lambda: x.alu(Ops.CMPEQ, c)])()
        s = e.simplify()
        for env in env_points(rng, specs, 12):
            assert evaluate(e, env)[e] == evaluate(s, env)[s], f"#{i} {env}: {e.render()} -> {s.render()}"
