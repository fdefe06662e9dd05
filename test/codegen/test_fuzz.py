"""Random kernels (elementwise math, broadcasts, padding, reductions, nested reductions) run as C, optimized and not,
against a direct Python interpreter of the kernel AST (exec_alu over every loop iteration)."""
import itertools
import math
import random
import numpy as np
import pytest
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp, exec_alu
from test.codegen.helpers import glob, reduce, rng, run

def interpret(ast: UOp, bufs: list[np.ndarray]) -> None:
    """Execute a kernel AST in Python: every STORE over every assignment of its output ranges."""
    def ev(u: UOp, env: dict[UOp, int]):
        if u.op is Ops.RANGE: return env[u]
        if u.op is Ops.CONST: return u.arg
        if u.op is Ops.LOAD:
            idx = u.src[0]
            if len(idx.src) > 2 and not ev(idx.src[2], env): return 0.0
            return float(bufs[idx.src[0].arg][ev(idx.src[1], env)])
        if u.op is Ops.REDUCE:
            acc = {Ops.ADD: 0.0, Ops.MUL: 1.0, Ops.MAX: -math.inf}[u.arg]
            for vals in itertools.product(*[range(r.src[0].arg) for r in u.src[1:]]):
                x = ev(u.src[0], {**env, **dict(zip(u.src[1:], vals))})
                acc = exec_alu(u.arg, u.dtype, (acc, x)) if u.arg is not Ops.MAX else \
                    (acc if acc > x or math.isnan(acc) else x)
            return acc
        srcs = [ev(s, env) for s in u.src]
        if u.op is Ops.MAX and dtypes.is_float(u.dtype): return math.nan if any(map(math.isnan, srcs)) else max(srcs)
        if u.op is Ops.CAST: return dtypes.as_const(srcs[0], u.dtype)
        return exec_alu(u.op, u.dtype, tuple(srcs))
    for st in ast.src:
        rngs = sorted({x for x in st.src[0].toposort() if x.op is Ops.RANGE}, key=lambda r: r.arg[0])
        for vals in itertools.product(*[range(r.src[0].arg) for r in rngs]):
            env = dict(zip(rngs, vals))
            idx = st.src[0]
            if len(idx.src) > 2 and not ev(idx.src[2], env): continue
            bufs[idx.src[0].arg][ev(idx.src[1], env)] = ev(st.src[1], env)

def random_kernel(rs: random.Random) -> tuple[UOp, list[np.ndarray]]:
    M, N, K = rs.choice([3, 16, 5]), rs.choice([16, 32, 7]), rs.choice([4, 16, 9])
    i, j, k, k2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce"), rng(K, 3, "reduce")
    a, b, c = glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, K * N), glob(3, dtypes.float32, M * N)
    def leaf(red: UOp | None) -> UOp:
        choice = rs.randrange(5)
        if red is not None and choice == 0: return a.index(i * K + red).load()
        if red is not None and choice == 1: return b.index(red * N + j).load()
        if choice == 2:   # shifted by one with zero padding on the left
            return c.index(i * N + j - 1, valid=(j < 1).logical_not()).load()
        if choice == 3: return UOp.const(dtypes.float32, rs.choice([0.5, -2.0, 3.0]))
        return c.index(i * N + j).load()
    def expr(depth: int, red: UOp | None) -> UOp:
        if depth == 0: return leaf(red)
        op = rs.choice(["add", "mul", "max", "where", "neg", "reduce"] if red is None else
                       ["add", "mul", "max", "neg", "nested", "arange"])
        x = expr(depth - 1, red)
        if op == "neg": return -x
        if op == "arange": return x + red.cast(dtypes.float32)
        if op == "nested":   # a reduce over the other range inside this one (or over the same one: it gets renamed)
            r = rs.choice([k2 if red is k else k, red])
            val = a.index(i * K + r).load() + (r < red).where(UOp.const(dtypes.float32, 1.0), 0.0)
            return x * reduce(val, r, op=rs.choice([Ops.ADD, Ops.MAX]))
        if op == "reduce":
            r = k if rs.random() < 0.5 else k2
            inner = expr(rs.randrange(2) + 1, r)
            return x + reduce(inner * a.index(i * K + r).load(), r, op=rs.choice([Ops.ADD, Ops.MAX]))
        y = expr(depth - 1, red)
        if op == "add": return x + y
        if op == "mul": return x * y
        if op == "max": return x.maximum(y)
        return (x < y).where(x, y * 0.5)
    val = expr(3, None)
    ast = UOp.sink_of(glob(0, dtypes.float32, M * N).index(i * N + j).store(val))
    bufs = [np.random.RandomState(rs.randrange(1000)).randint(-4, 5, n).astype(np.float32) / 2
            for n in (M * K, K * N, M * N)]
    return ast, bufs

@pytest.mark.parametrize("seed", range(16))
def test_random_kernel(seed: int):
    rs = random.Random(seed)
    ast, ins = random_kernel(rs)
    n_out = ast.src[0].src[0].src[0].dtype.size
    want = [np.zeros(n_out, np.float32), *[x.copy() for x in ins]]
    interpret(ast, want)
    for noopt in (False, True):
        out = np.zeros(n_out, np.float32)
        run(ast, [out, *ins], noopt=noopt)
        np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-5, err_msg=f"noopt={noopt}")
