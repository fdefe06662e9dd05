"""What recording costs: the MLP Adam step (eager) and the 200-op graph with VIZ and PROFILE off, with VIZ on and with
PROFILE on, in one process, in alternating blocks (off, VIZ, PROFILE, off, VIZ, PROFILE, ...). Prints the best time
per call of each mode and its ratio to "off". The target for "off": within noise of a build without the hooks.

    .venv/bin/python bench/bench_viz.py            # --quick: fewer blocks
"""
from __future__ import annotations
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

if __name__ == "__main__":
    main()
