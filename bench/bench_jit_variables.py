"""TinyJit replays of kernels with Variables: prepared launches that take each replay's values, against the plain path
(each such kernel run through ExecItem.run), alternated in one process (A B A B ...).

Rows: a decode-like chain of kernels over a symbolic length (small: the per-replay Python is what is timed), and
bench_train's GPT-2 124M decode (--gpt2). Reported per call, min and median over the blocks: the main thread's CPU
time, that time outside the C pool's calls (where the thread waits for room in the queue or for results and runs
kernel chunks meanwhile: what is left is the Python of the call) and the wall time.

Run: .venv/bin/python bench/bench_jit_variables.py [--kernels 20] [--blocks 6] [--gpt2]"""
from __future__ import annotations
import argparse
import gc
import pathlib
import statistics
import sys
import time
from typing import Any, Callable
import numpy as np
from fusegrad import Tensor, TinyJit, Variable
from fusegrad.engine import jit as _jit
from fusegrad.engine import realize
from fusegrad.runtime import cpu_pool

_prepared = realize.ExecItem.prepared

def use(new: bool) -> None:
    """Prepared launches for kernels with Variables (new) or the plain path for them (old); every TinyJit's plan is
    made again on its next replay."""
    if new: realize.ExecItem.prepared = _prepared  # type: ignore[method-assign]
    else: realize.ExecItem.prepared = lambda self, varying, var_vals=None: _prepared(self, varying)  # type: ignore
    for obj in gc.get_objects():
        if isinstance(obj, _jit.TinyJit): obj._launches, obj._dynamic = None, []

def chain(kernels: int, maxlen: int = 256, dim: int = 64) -> Callable[[], Any]:
    """A jitted step of `kernels` kernels, each reading the first `pos` rows of a cache (pos moves on per call)."""
    rng = np.random.default_rng(0)
    cache = Tensor(rng.standard_normal((maxlen, dim)).astype(np.float32)).realize()
    pos = Variable("pos", 1, maxlen)
    @TinyJit
    def step(x: Tensor, p: Any) -> Tensor:
        rows = cache[0:p]
        for i in range(kernels):
            x = ((rows * x).sum(0) * (0.5 / (i + 1)) + x).realize()   # (a kernel each)
        return x
    x = Tensor(np.ones(dim, np.float32)).realize()
    state = {"n": 0}
    def call() -> Any:
        state["n"] += 1
        return step(x, pos.bind(1 + state["n"] % (maxlen - 1))).numpy()
    return call

def gpt2_decode() -> Callable[[], Any]:
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_train
    ours, _, _ = bench_train.gpt2_decode(bench_train.gpt2.Config())
    return ours

_in_pool = [0.0]   # main-thread CPU seconds spent inside the pool's C calls and waits

def _counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try: return fn(*args, **kwargs)
        finally: _in_pool[0] += time.thread_time() - t
    return inner

def count_pool_time() -> None:
    if (pool := cpu_pool.c_pool()) is None: return
    cpu_pool.CPool.wait = _counted(cpu_pool.CPool.wait)  # type: ignore[method-assign]
    for name in ("_submit", "_submit_many", "_run_many"): setattr(pool, name, _counted(getattr(pool, name)))

def measure(name: str, call: Callable[[], Any], calls: int, blocks: int) -> None:
    for _ in range(3): call()   # (capture and the first replay)
    times: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for b in range(2 * blocks):
        new = b % 2 == 1
        use(new)
        call()   # (the plan made again, outside the timing)
        _in_pool[0] = 0.0
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(calls): call()
        cpu = time.thread_time() - c0
        times[new].append((cpu / calls, (cpu - _in_pool[0]) / calls, (time.perf_counter() - w0) / calls))
    use(True)
    for new in (False, True):
        cols = [[t[k] * 1e3 for t in times[new]] for k in range(3)]
        print(f"{name:24s} {'new' if new else 'old'} ms/call (min / median): main-thread CPU "
              f"{min(cols[0]):7.3f} / {statistics.median(cols[0]):7.3f}, outside the pool {min(cols[1]):7.3f} / "
              f"{statistics.median(cols[1]):7.3f}, wall {min(cols[2]):7.3f} / {statistics.median(cols[2]):7.3f}")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=20, help="kernels in the chain")
    ap.add_argument("--blocks", type=int, default=6, help="blocks per side")
    ap.add_argument("--calls", type=int, default=100, help="calls per block of the chain")
    ap.add_argument("--gpt2", action="store_true", help="also GPT-2 124M decode (bench_train's gpt2-decode)")
    args = ap.parse_args()
    count_pool_time()
    measure(f"chain of {args.kernels} kernels", chain(args.kernels), args.calls, args.blocks)
    if args.gpt2: measure("gpt2-decode (per token)", gpt2_decode(), 5, args.blocks)

if __name__ == "__main__":
    main()
