"""BEAM search against the heuristic: kernel time of each case with the default opts and with BEAM=2, the time the
search takes (first run, empty caches) and the first run of a second process that finds the choice in the disk cache.

Run: .venv/bin/python bench/bench_beam.py  [--only NAME] [--amt 2] [--reps 20]

Columns:
  heur ms     kernel time with the heuristic's opts (least of --reps runs, interleaved with the BEAM kernels)
  beam ms     kernel time with the opts BEAM chose
  heur/beam   > 1: BEAM's kernels are faster
  search s    the first realize under BEAM (search, then compile) in this process, kernels searched in brackets
  cached s    the first realize under BEAM in a fresh process sharing the disk cache (no search: the count of
              searches it did is in brackets, and must be 0)
The search's budget is BEAM_TIMEOUT_S per kernel (environment, default 10 s); the machine's noise shows in how much
heur/beam moves between runs of this script."""
from __future__ import annotations
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CACHE = os.environ.get("BENCH_BEAM_CACHE") or tempfile.mkdtemp(prefix="bench-beam-cache-")
if "BENCH_BEAM_CACHE" not in os.environ: atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = CACHE

import numpy as np  # noqa: E402
from fusegrad import Tensor  # noqa: E402
from fusegrad.engine.realize import lower_schedule_item  # noqa: E402
from fusegrad.codegen.opt import search  # noqa: E402
from fusegrad.helpers import Context  # noqa: E402

def _rand(*shape: int) -> np.ndarray: return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)

# name -> (input shapes, function of the input tensors)
CASES = {
    "matmul 1000": ([(1000, 1000), (1000, 1000)], lambda a, b: a @ b),
    "matmul 1023": ([(1023, 1023), (1023, 1023)], lambda a, b: a @ b),
    "matmul 128x784x512": ([(128, 784), (784, 512)], lambda a, b: a @ b),
    "softmax 4096^2": ([(4096, 4096)], lambda x: x.softmax(-1)),
    "row sum 4096^2": ([(4096, 4096)], lambda x: x.sum(1)),
    "matmul 64x96x80 (small)": ([(64, 96), (96, 80)], lambda a, b: a @ b),
}

def _inputs(name: str) -> list[Tensor]: return [Tensor(_rand(*s)).realize() for s in CASES[name][0]]

def _items(name: str, ins: list[Tensor]) -> tuple[list, float, dict]:
    """The lowered schedule of a case (compiled under the current knobs), the seconds that took, the search stats."""
    before = dict(search.beam_stats)
    st = time.perf_counter()
    items = [lower_schedule_item(si) for si in CASES[name][1](*ins).schedule()]
    for ei in items: ei.run(do_update_stats=False)
    return items, time.perf_counter() - st, {k: search.beam_stats[k] - before[k] for k in before}

def _time(items: list) -> float:
    return sum(ei.run(wait=True, do_update_stats=False) or 0.0 for ei in items)

def child(name: str, amt: int) -> None:
    """The second process: the first realize under BEAM, with the disk cache the parent filled."""
    ins = _inputs(name)
    with Context(BEAM=amt): _, secs, stats = _items(name, ins)
    print("CHILD", json.dumps({"secs": secs, "searches": stats["searches"], "hits": stats["cache_hits"]}))

def run(name: str, amt: int, reps: int) -> dict:
    ins = _inputs(name)
    heur, _, _ = _items(name, ins)
    with Context(BEAM=amt): beam, search_s, stats = _items(name, ins)
    th, tb = [], []
    for _ in range(reps):  # interleaved, so the machine's load hits both alike
        th.append(_time(heur)); tb.append(_time(beam))
    out = subprocess.run([sys.executable, __file__, "--child", name, "--amt", str(amt)], capture_output=True, text=True,
                         env={**os.environ, "BENCH_BEAM_CACHE": CACHE})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("CHILD ")), None)
    if line is None: raise RuntimeError(f"the second process failed:\n{out.stderr}")
    cached = json.loads(line[len("CHILD "):])
    opts = [list(ei.prg.p.applied_opts) for ei in beam if hasattr(ei.prg, "p")]
    return dict(name=name, heur=min(th), beam=min(tb), search_s=search_s, searched=stats["searches"],
                cached_s=cached["secs"], cached_searches=cached["searches"], opts=opts)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--amt", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--child")
    ap.add_argument("--verbose", action="store_true", help="print the opts BEAM chose")
    args = ap.parse_args()
    if args.child: return child(args.child, args.amt)
    names = [n for n in CASES if not args.only or any(o.lower() in n.lower() for o in args.only)]
    print(f"BEAM={args.amt}, BEAM_TIMEOUT_S={search.BEAM_TIMEOUT_S.value}, {os.cpu_count()} cores")
    print(f"{'case':24s} {'heur ms':>9s} {'beam ms':>9s} {'heur/beam':>9s} {'search s':>12s} {'cached s':>12s}")
    for name in names:
        r = run(name, args.amt, args.reps)
        print(f"{name:24s} {r['heur'] * 1e3:9.3f} {r['beam'] * 1e3:9.3f} {r['heur'] / r['beam']:9.2f} "
              f"{r['search_s']:8.2f} ({r['searched']}) {r['cached_s']:8.2f} ({r['cached_searches']})", flush=True)
        if args.verbose: print(f"    {r['opts']}")

if __name__ == "__main__":
    main()
