"""All-reduce between devices of one process, and a data-parallel training step over them.

    .venv/bin/python bench/bench_multi.py [--quick]

All-reduce: a float32 tensor of n elements per device, split over ("CPU", "CPU:1") as two rows, summed over the split
axis: each device ends up with the total (the schedule: a per-device copy of the partial row, a copy of the other
device's row, and an add). The reference does the same on the same host memory with NumPy: `np.add(a, b, out=r0)`
and a copy of the result for the second device, the least memory traffic an all-reduce of two buffers in one address
space needs. Bandwidth counts the bytes of one buffer per all-reduce (the algorithm bandwidth).

Data-parallel step: the MLP 784-512-10 with Adam on a batch of 128, on one device and with the batch split over two
(parameters replicated), each under TinyJit. Both "devices" share the machine's 2 cores, so splitting can't make the
step faster here; the figure is the overhead of the split (the copies and all-reduces of the gradients).

Each side is timed in its own block (A B A B), the first run is reported separately."""
from __future__ import annotations
import argparse
import time
import numpy as np
from fusegrad import Device, Tensor, TinyJit, nn
from fusegrad.nn.state import get_parameters

D2 = ("CPU", "CPU:1")

def _block(fn, reps: int) -> float:
    st = time.perf_counter()
    for _ in range(reps): fn()
    for d in D2: Device[d].synchronize()  # (CPU kernels run asynchronously: a block ends when they have run)
    return (time.perf_counter() - st) / reps

def allreduce_table(sizes: list[int], rounds: int) -> None:
    print(f"{'bytes':>10s} {'first ms':>9s} {'eager GB/s':>11s} {'jit GB/s':>9s} {'numpy GB/s':>11s} "
          f"{'jit/numpy':>9s}")
    for n in sizes:
        data = np.random.default_rng(0).standard_normal((2, n)).astype(np.float32)
        x = Tensor(data).shard(D2, 0).realize()
        st = time.perf_counter()
        out = x.sum(0).realize()
        for d in D2: Device[d].synchronize()
        first = time.perf_counter() - st
        np.testing.assert_allclose(out.numpy(), data.sum(0), rtol=1e-6, atol=1e-6)

        @TinyJit
        def jitted(t: Tensor) -> Tensor: return t.sum(0).realize()
        for _ in range(3): jitted(x)
        a, b = data[0].copy(), data[1].copy()
        r0, r1 = np.empty_like(a), np.empty_like(a)
        def numpy_allreduce() -> None:
            np.add(a, b, out=r0)
            r1[:] = r0
        reps = max(3, min(2000, (1 << 26) // max(n * 4, 1)))
        best = {"eager": 1e9, "jit": 1e9, "numpy": 1e9}
        for _ in range(rounds):  # A B C A B C: each side in its own block
            best["eager"] = min(best["eager"], _block(lambda: x.sum(0).realize(), reps))
            best["jit"] = min(best["jit"], _block(lambda: jitted(x), reps))
            best["numpy"] = min(best["numpy"], _block(numpy_allreduce, reps))
        gb = lambda s: n * 4 / s * 1e-9
        print(f"{n * 4:10d} {first * 1e3:9.2f} {gb(best['eager']):11.2f} {gb(best['jit']):9.2f} "
              f"{gb(best['numpy']):11.2f} {best['numpy'] / best['jit']:8.2f}x")

def dp_step_table(rounds: int, steps: int) -> None:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((128, 784)).astype(np.float32)
    Y = rng.integers(0, 10, 128)
    results = {}
    for name, devices in (("1 device", None), ("2 devices", D2)):
        Tensor.manual_seed(0)
        model = [nn.Linear(784, 512), Tensor.relu, nn.Linear(512, 10)]
        params = get_parameters(model)
        if devices is not None:
            for p in params: p.shard_(devices).realize()
        opt = nn.optim.Adam(params, lr=1e-3)

        @TinyJit
        @Tensor.train()
        def step(x: Tensor, y: Tensor) -> Tensor:
            opt.zero_grad()
            loss = x.sequential(model).sparse_categorical_crossentropy(y)
            loss.backward()
            opt.step()
            return loss.realize()
        x, y = Tensor(X), Tensor(Y)
        if devices is not None: x, y = x.shard(devices, 0).realize(), y.shard(devices, 0).realize()
        st = time.perf_counter()
        step(x, y).item()
        first = time.perf_counter() - st
        for _ in range(3): step(x, y)
        results[name] = (first, step, x, y)
    best = {k: 1e9 for k in results}
    for _ in range(rounds):
        for name, (_, step, x, y) in results.items():
            best[name] = min(best[name], _block(lambda: step(x, y), steps))
    for name, (first, *_) in results.items():
        print(f"MLP Adam step, {name:9s}: first call {first * 1e3:8.1f} ms, steady {best[name] * 1e3:7.2f} ms")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    args = ap.parse_args()
    sizes = [1 << 8, 1 << 14, 1 << 20, 1 << 24] if args.quick else [1 << k for k in range(8, 25, 2)]
    allreduce_table(sizes, 2 if args.quick else 4)
    dp_step_table(2 if args.quick else 4, 10 if args.quick else 30)
