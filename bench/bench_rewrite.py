"""Benchmark of the IR and rewrite engine: building + simplifying random index expressions, and rewriting a big graph.

Run: python bench/bench_rewrite.py [--profile]  (prints nodes per second for each part; --profile adds cProfile tops)
"""
from __future__ import annotations
import argparse
import cProfile
import gc
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fusegrad.dtype import dtypes  # noqa: E402
from fusegrad.uop.ops import Ops, UOp, Variable  # noqa: E402
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite  # noqa: E402

def random_index_expr(rng: random.Random, variables: list[UOp], n_terms: int) -> UOp:
    """An index expression like the ones lowering makes: a sum of `n_terms` affine terms of loop variables, each maybe
    split with // and %, sometimes compared against a bound (a validity mask)."""
    def term() -> UOp:
        t = rng.choice(variables) * rng.choice([1, 2, 3, 4, 8, 16, 32, 64])
        if rng.random() < 0.4: t = t + rng.randint(-4, 16)
        if rng.random() < 0.3: t = t // rng.choice([2, 4, 8, 16])
        if rng.random() < 0.3: t = t % rng.choice([3, 4, 8, 16, 32])
        return t
    expr = term()
    for _ in range(n_terms - 1): expr = expr + term() if rng.random() < 0.8 else expr - term()
    if rng.random() < 0.2: expr = expr < rng.randint(16, 4096)
    return expr

def bench_index_exprs(n: int = 10_000, seed: int = 0) -> None:
    rng = random.Random(seed)
    variables = [Variable(f"v{i}", 0, hi) for i, hi in enumerate([3, 7, 15, 31, 63, 127, 255, 1023])]
    # build: every construction goes through hash-consing, so this measures UOp creation and the operator overloads
    gc.collect()
    st = time.perf_counter()
    exprs = [random_index_expr(rng, variables, rng.randint(1, 3)) for _ in range(n)]
    t_build = time.perf_counter() - st
    nodes = sum(len(e.toposort()) for e in exprs)
    st = time.perf_counter()
    simplified = [e.simplify() for e in exprs]
    t_simplify = time.perf_counter() - st
    nodes_after = sum(len(e.toposort()) for e in simplified)
    print(f"index exprs: {n} expressions, {nodes} nodes (avg {nodes / n:.1f}), {nodes_after} after simplify")
    print(f"  build     {t_build * 1e3:8.1f} ms  {nodes / t_build:12,.0f} nodes/s")
    print(f"  simplify  {t_simplify * 1e3:8.1f} ms  {nodes / t_simplify:12,.0f} nodes/s")

# the small rule set of the big-graph benchmark: multiplicative and additive identities
identities = PatternMatcher([
    (UPat.var("x") * 1, lambda x: x),
    (UPat.var("x") + 0, lambda x: x),
], name="identities")

def big_graph(n_nodes: int, seed: int = 0) -> UOp:
    """A DAG of about `n_nodes` distinct nodes: random ADD/MUL/MAX of earlier nodes, a quarter of them wrapped in *1 or
    +0 so the rules have work to do; every node nothing else uses goes into the SINK, so all are reachable."""
    rng = random.Random(seed)
    pool = [Variable(f"a{i}", 0, 100) for i in range(64)]
    unused = dict.fromkeys(pool)
    made = len(pool)
    while made < n_nodes:
        # mostly recent nodes, so the graph is deep as well as wide
        a, b = rng.choice(pool[-256:]), rng.choice(pool)
        # a fresh constant keeps each new node distinct (hash-consing would merge repeats)
        u = a.alu(rng.choice([Ops.ADD, Ops.MUL, Ops.MAX]), b).alu(Ops.ADD, UOp.const(dtypes.index, made))
        made += 3
        r = rng.random()
        if r < 0.125: u, made = u * 1, made + 1
        elif r < 0.25: u, made = u + 0, made + 1
        unused.pop(a, None); unused.pop(b, None)
        unused[u] = None
        pool.append(u)
    return UOp.sink_of(*unused)

def bench_big_graph(n_nodes: int = 100_000, bottom_up: bool = False) -> None:
    gc.collect()
    st = time.perf_counter()
    sink = big_graph(n_nodes)
    t_build = time.perf_counter() - st
    nodes = len(sink.toposort())
    st = time.perf_counter()
    out = graph_rewrite(sink, identities, bottom_up=bottom_up)
    t_rewrite = time.perf_counter() - st
    mode = "bottom-up" if bottom_up else "top-down"
    print(f"big graph ({mode}): {nodes} nodes, {len(out.toposort())} after rewrite")
    print(f"  build     {t_build * 1e3:8.1f} ms  {nodes / t_build:12,.0f} nodes/s")
    print(f"  rewrite   {t_rewrite * 1e3:8.1f} ms  {nodes / t_rewrite:12,.0f} nodes/s")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print the top functions by cumulative/own time")
    parser.add_argument("--exprs", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=100_000)
    args = parser.parse_args()
    prof = cProfile.Profile() if args.profile else None
    if prof: prof.enable()
    bench_index_exprs(args.exprs)
    bench_big_graph(args.nodes, bottom_up=False)
    bench_big_graph(args.nodes, bottom_up=True)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)

if __name__ == "__main__":
    main()
