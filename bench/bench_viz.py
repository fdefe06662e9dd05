"""What recording costs: the MLP Adam step (eager) and the 200-op graph with VIZ and PROFILE off, with VIZ on and with
PROFILE on, in one process, in alternating blocks (off, VIZ, PROFILE, off, VIZ, PROFILE, ...). Prints the best time
per call of each mode and its ratio to "off". The target for "off": within noise of a build without the hooks.

    .venv/bin/python bench/bench_viz.py            # --quick: fewer blocks
    .venv/bin/python bench/bench_viz.py --pool REV  # also: the C pool of git revision REV against today's

With --pool, the C pool's cost per job (submit and wait of a two-chunk job) is compared with REV's, both compiled in
this process: today's without chunk records (PROFILE unset) and with them. Target: within noise of REV's.
"""
from __future__ import annotations
import ctypes
import pathlib
import subprocess
import sys
import time
from typing import Callable
import numpy as np
from fusegrad import Tensor, nn, viz
from fusegrad.viz import record

MODES = {"off": (False, False), "VIZ": (True, False), "PROFILE": (False, True)}

def mlp_step() -> Callable[[], object]:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    opt = nn.optim.Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    def step() -> object:
        with Tensor.train():
            opt.zero_grad()
            loss = l2(l1(Tensor(x)).relu()).sparse_categorical_crossentropy(Tensor(y))
            loss.backward()
            opt.step()
        return loss.numpy()
    return step

def graph200() -> Callable[[], object]:
    x0 = Tensor.ones(77, 77).contiguous().realize()
    def run() -> object:
        x = x0
        for i in range(200): x = (x * 1.01 + 0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(77, 77) * 0.001 + x
        return x.numpy()
    return run

def timed_blocks(fn: Callable[[], object], calls: int, blocks: int) -> dict[str, float]:
    best = {m: float("inf") for m in MODES}
    for _ in range(blocks):
        for mode, (v, p) in MODES.items():
            viz.enable(viz=v, profile=p)
            fn()  # (a call to settle the mode: the first one after a switch may record a new schedule)
            st = time.perf_counter()
            for _ in range(calls): fn()
            best[mode] = min(best[mode], (time.perf_counter() - st) / calls)
    viz.enable(viz=False, profile=False)
    return best

def pool_jobs(rev: str, jobs: int = 3000, blocks: int = 7) -> None:
    """Per-job time of `rev`'s C pool and today's, in alternating blocks (the best block of each)."""
    from fusegrad.device import Device
    from fusegrad.runtime.cpu_compiler import load_library
    from fusegrad.runtime.cpu_pool import POOL_SOURCE_PATH
    root = pathlib.Path(__file__).resolve().parents[1]
    old_src = subprocess.run(["git", "show", f"{rev}:{POOL_SOURCE_PATH.relative_to(root)}"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    compiler = Device["CPU"].compiler
    # (two pools in one process: the old one's symbols renamed)
    old = load_library(compiler.compile(old_src.replace("fg_", "old_fg_")))
    new = load_library(compiler.compile(POOL_SOURCE_PATH.read_text()))
    kern = load_library(compiler.compile("void work(void **a, long lo, long hi) { volatile double s = 0; "
                                         "for (long i = lo * 2000; i < hi * 2000; i++) s += i * 0.5; }"))
    fn, args, rec = ctypes.cast(kern.work, ctypes.c_void_p).value, (ctypes.c_void_p * 1)(), (ctypes.c_long * 6)()
    old_submit, new_submit = old.old_fg_pool_submit, new.fg_pool_submit
    old_submit.restype = new_submit.restype = ctypes.c_ulong
    old_submit.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_int] * 3
    new_submit.argtypes = old_submit.argtypes + [ctypes.c_void_p]
    old_wait, new_wait = old.old_fg_pool_wait, new.fg_pool_wait
    old_wait.argtypes = new_wait.argtypes = [ctypes.c_ulong, ctypes.c_long]
    runs = {rev: lambda: old_wait(old_submit(fn, args, 2, 2, 1, 1, 1), -1),
            "today": lambda: new_wait(new_submit(fn, args, 2, 2, 1, 1, 1, None), -1),
            "today, records": lambda: new_wait(new_submit(fn, args, 2, 2, 1, 1, 1, rec), -1)}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(blocks):
        for name, run in runs.items():
            st = time.perf_counter()
            for _ in range(jobs): run()
            best[name] = min(best[name], (time.perf_counter() - st) / jobs)
    for name, t in best.items(): print(f"C pool job, {name:16s} {t * 1e6:7.2f} us   {t / best[rev]:5.3f}x {rev}'s")

def main() -> None:
    quick = "--quick" in sys.argv
    blocks = 2 if quick else 5
    print(f"{'workload':28s} {'off':>10s} {'VIZ':>10s} {'PROFILE':>10s}   VIZ/off  PROFILE/off")
    for name, make, calls in (("MLP Adam step b128, eager", mlp_step, 10), ("200-op graph 77x77", graph200, 10)):
        fn = make()
        for _ in range(3): fn()  # (compile everything first: the modes are compared on warm caches)
        best = timed_blocks(fn, calls, blocks)
        print(f"{name:28s} " + " ".join(f"{best[m] * 1e3:8.2f}ms" for m in MODES) +
              f"   {best['VIZ'] / best['off']:6.2f}x  {best['PROFILE'] / best['off']:6.2f}x")
    # the recording itself, so the numbers above can be read: what a VIZ run kept
    kept = record.trace()
    print(f"(recorded while on: {len(kept.get('rewrites', []))} rewrites, {len(kept.get('kernels', []))} kernels, "
          f"{len(kept.get('profile', {}).get('traceEvents', []) if isinstance(kept.get('profile'), dict) else [])} "
          "profile events)")
    if "--pool" in sys.argv: pool_jobs(sys.argv[sys.argv.index("--pool") + 1])

if __name__ == "__main__":
    main()
