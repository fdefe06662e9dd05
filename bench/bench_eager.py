"""Eager speed: the Python a program pays between kernels, fusegrad against PyTorch's eager mode in one process.

Rows (microseconds per call unless marked):
- build of one elementwise op, `c = a + b` on realized 64x64 float32 tensors (fusegrad only builds the node; torch
  computes the sum, so its figure is its whole eager op);
- build of a matmul, 64x64 @ 64x64 and the MLP's 128x784 @ 784x512 (torch: the product itself);
- build of the MLP's other operations: a bias add broadcast over the batch, relu, log_softmax and the
  cross-entropy loss of 128x10 logits against integer labels (torch: the operation itself);
- build of functions of many operations, each one node: gelu (tanh form), tanh and sigmoid of 64x64 (torch: the
  function itself), and gelu's realize on a schedule cache hit;
- a realize that hits the schedule cache, `(a + b).realize()` repeated, kernel launch included, and the same for the
  64x64 matmul (torch: the same eager op);
- reading a realized tensor of 10 float32s with `numpy()` (torch: a copy of its `numpy()` view, the same copy);
- one Adam step of the 784-512-10 MLP at batch 128, eager (no TinyJit), in ms.

Each side runs its calls in blocks (fusegrad block, torch block, fusegrad block, torch block), never alternating call
by call (a BLAS's idle threads spin after each call and would land in the other side's time); the figure is the best
block's mean, wall time. fusegrad's blocks end when its queued kernels have run. The last column is fusegrad's
main-thread CPU time per call (best block): on a machine shared with other work it moves less than wall time (time
spent waiting for a core is not in it; kernel chunks run by the workers are not either). Ratio: torch's time over
fusegrad's (above 1: fusegrad faster).

With `--bytecodes N`, the MLP step's Python is also counted: the bytecodes the main thread executes in one step, in
total and for the N functions that execute most (a count moves with the code alone, where times move with the load).

Run: .venv/bin/python bench/bench_eager.py  [--quick] [--bytecodes N]
"""
from __future__ import annotations
import math
import sys
import time
from typing import Callable
import numpy as np
import torch
import torch.nn.functional as F

from torch_cpu import setup as torch_setup  # noqa: E402  (bench/ is the script's folder)

torch_setup()

from fusegrad import Device, GlobalCounters, Tensor, nn  # noqa: E402  (torch threads are set first)

QUICK = "--quick" in sys.argv
BYTECODES = int(sys.argv[sys.argv.index("--bytecodes") + 1]) if "--bytecodes" in sys.argv else 0

def settle() -> None:
    """Wait for fusegrad's queued kernels (CPU kernels run asynchronously while Python goes on)."""
    Device[Device.DEFAULT].synchronize()

def blocks(ours: Callable[[], object], theirs: Callable[[], object], calls: int, nblocks: int) \
        -> tuple[float, float, float]:
    """Seconds per call of each side (best block mean, wall) and fusegrad's main-thread CPU seconds per call (best
    block), blocks of `calls` calls timed A B A B."""
    best = {"ours": math.inf, "torch": math.inf, "cpu": math.inf}
    sides = [("ours", ours), ("torch", theirs)]
    for _, fn in sides:  # warm up: compiles, caches, the schedule cache's replay plan
        for _ in range(3): fn()
        settle()
    for _ in range(nblocks):
        for name, fn in sides:
            st, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls): fn()
            settle()
            best[name] = min(best[name], (time.perf_counter() - st) / calls)
            if name == "ours": best["cpu"] = min(best["cpu"], (time.thread_time() - cpu) / calls)
    return best["ours"], best["torch"], best["cpu"]

def count_bytecodes(fn: Callable[[], object], top: int) -> None:
    """Print the Python bytecodes the main thread executes in one call of fn, in total and for the `top` functions that
    execute most. (The collector is off meanwhile: where a collection falls would move the count; set PYTHONHASHSEED
    for the same count run after run.)"""
    import collections
    import gc
    per: collections.Counter = collections.Counter()
    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode": per[(frame.f_code.co_filename.rsplit("fusegrad/", 1)[-1], frame.f_code.co_name)] += 1
        return trace
    settle()
    was = gc.isenabled()
    gc.disable()
    sys.settrace(trace)
    try: fn()
    finally:
        sys.settrace(None)
        if was: gc.enable()
    settle()
    total = sum(per.values())
    print(f"  bytecodes per call: {total}")
    for (where, name), n in per.most_common(top): print(f"    {n:7d} {n / total:6.1%}  {where}:{name}")

def row(name: str, ours: float, theirs: float, cpu: float, unit: str = "us") -> None:
    scale = 1e6 if unit == "us" else 1e3
    print(f"{name:52s} {ours * scale:10.2f} {theirs * scale:10.2f} {unit:>4s} {theirs / ours:8.2f}x "
          f"{cpu * scale:10.2f}")

def main() -> None:
    rng = np.random.default_rng(0)
    calls, nblocks = (200, 6) if QUICK else (1000, 10)
    a_np, b_np = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
    a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
    ta, tb = torch.tensor(a_np), torch.tensor(b_np)
    x_np, w_np = rng.standard_normal((128, 784)).astype(np.float32), rng.standard_normal((784, 512)).astype(np.float32)
    x, w = Tensor(x_np).realize(), Tensor(w_np).realize()
    tx, tw = torch.tensor(x_np), torch.tensor(w_np)

    # the results agree with torch's (a wrong fast path would show here first)
    np.testing.assert_allclose((a + b).realize().numpy(), (ta + tb).numpy(), rtol=1e-6)
    np.testing.assert_allclose((a @ b).realize().numpy(), (ta @ tb).numpy(), rtol=1e-4, atol=1e-4)

    print(f"{'':52s} {'fusegrad':>10s} {'torch':>10s} {'':>4s} {'ratio':>9s} {'main CPU':>10s}")
    row("build a + b (64x64; torch computes it)", *blocks(lambda: a + b, lambda: ta + tb, calls, nblocks))
    row("build a @ b (64x64; torch computes it)", *blocks(lambda: a @ b, lambda: ta @ tb, calls, nblocks))
    row("build x @ w (128x784 @ 784x512; torch computes it)",
        *blocks(lambda: x @ w, lambda: tx @ tw, max(10, calls // 20), nblocks))
    layer, tlayer = nn.Linear(784, 512), torch.nn.Linear(784, 512)
    with torch.no_grad():
        tlayer.weight.copy_(torch.tensor(layer.weight.numpy()))
        tlayer.bias.copy_(torch.tensor(layer.bias.numpy()))
    np.testing.assert_allclose(layer(x).numpy(), tlayer(tx).detach().numpy(), rtol=1e-4, atol=1e-4)
    row("build Linear(784, 512)(x) (x 128x784; torch computes it)",
        *blocks(lambda: layer(x), lambda: tlayer(tx), max(10, calls // 20), nblocks))
    bias_np, lg_np = rng.standard_normal(64).astype(np.float32), rng.standard_normal((128, 10)).astype(np.float32)
    y_np = rng.integers(0, 10, 128).astype(np.int32)
    bias, lg, y = Tensor(bias_np).realize(), Tensor(lg_np).realize(), Tensor(y_np).realize()
    tbias, tlg, ty = torch.tensor(bias_np), torch.tensor(lg_np), torch.tensor(y_np).long()
    np.testing.assert_allclose((a + bias).numpy(), (ta + tbias).numpy(), rtol=1e-6)
    np.testing.assert_allclose(a.relu().numpy(), ta.relu().numpy())
    np.testing.assert_allclose(lg.log_softmax(-1).numpy(), tlg.log_softmax(-1).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lg.sparse_categorical_crossentropy(y).numpy(), F.cross_entropy(tlg, ty).numpy(),
                               rtol=1e-5)
    row("build a + bias (64x64 + 64; torch computes it)", *blocks(lambda: a + bias, lambda: ta + tbias, calls, nblocks))
    row("build a.relu() (64x64; torch computes it)", *blocks(a.relu, ta.relu, calls, nblocks))
    row("build log_softmax(-1) (128x10; torch computes it)",
        *blocks(lambda: lg.log_softmax(-1), lambda: tlg.log_softmax(-1), calls, nblocks))
    row("build cross-entropy (128x10; torch computes it)",
        *blocks(lambda: lg.sparse_categorical_crossentropy(y), lambda: F.cross_entropy(tlg, ty), calls, nblocks))
    # functions of many operations, built as one node each (tensor/composite.py)
    np.testing.assert_allclose(a.gelu().numpy(), F.gelu(ta, approximate="tanh").numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.tanh().numpy(), ta.tanh().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.sigmoid().numpy(), ta.sigmoid().numpy(), rtol=1e-5, atol=1e-6)
    row("build a.gelu() (64x64, tanh form; torch computes it)",
        *blocks(a.gelu, lambda: F.gelu(ta, approximate="tanh"), calls, nblocks))
    row("build a.tanh() (64x64; torch computes it)", *blocks(a.tanh, ta.tanh, calls, nblocks))
    row("build a.sigmoid() (64x64; torch computes it)", *blocks(a.sigmoid, ta.sigmoid, calls, nblocks))
    k0 = GlobalCounters.kernel_count
    row("a.gelu().realize(), schedule cache hit (64x64)",
        *blocks(lambda: a.gelu().realize(), lambda: F.gelu(ta, approximate="tanh"), calls, nblocks))
    row("(a + b).realize(), schedule cache hit (64x64)",
        *blocks(lambda: (a + b).realize(), lambda: ta + tb, calls, nblocks))
    assert GlobalCounters.kernel_count > k0, "the realizes ran no kernel"
    row("(a @ b).realize(), schedule cache hit (64x64)",
        *blocks(lambda: (a @ b).realize(), lambda: ta @ tb, calls, nblocks))

    s_np = rng.standard_normal(10).astype(np.float32)
    s, ts = Tensor(s_np).realize(), torch.tensor(s_np)
    np.testing.assert_array_equal(s.numpy(), s_np)
    row("numpy() of 10 float32s (torch: numpy().copy())", *blocks(s.numpy, lambda: ts.numpy().copy(), calls, nblocks))

    # the MLP's eager Adam step (as bench_train.py's MLP eager row)
    xb_np, yb_np = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    opt = nn.optim.Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    tm = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    topt = torch.optim.Adam(tm.parameters(), lr=1e-3)
    txb, tyb = torch.tensor(xb_np), torch.tensor(yb_np).long()

    @Tensor.train()
    def step() -> None:
        opt.zero_grad()
        loss = l2(l1(Tensor(xb_np)).relu()).sparse_categorical_crossentropy(Tensor(yb_np))
        loss.backward()
        opt.step()
        loss.realize()

    def tstep() -> None:
        topt.zero_grad()
        F.cross_entropy(tm(txb), tyb).backward()
        topt.step()
    row("MLP 784-512-10 Adam step, batch 128, eager", *blocks(step, tstep, 3 if QUICK else 10, nblocks), unit="ms")
    if BYTECODES: count_bytecodes(step, BYTECODES)

if __name__ == "__main__":
    main()
