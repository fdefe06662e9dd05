"""Tensor.estimate's predicted time against the measured time of realizes (the MLP's Adam step, a convolution, a
matmul, softmax), and the eager MLP step with none of explain's knobs on (compare two checkouts by running this file
in each: the step time is printed first).

Run: .venv/bin/python bench/bench_explain.py
"""
from __future__ import annotations
import time
from typing import Callable
from fusegrad import Device, Tensor, nn
from fusegrad.nn.optim import Adam

def settle() -> None: Device[Device.DEFAULT].synchronize()

def best_block(fn: Callable[[], None], blocks: int = 5, steps: int = 10) -> float:
    best = float("inf")
    for _ in range(blocks):
        settle()
        st = time.perf_counter()
        for _ in range(steps): fn()
        settle()
        best = min(best, (time.perf_counter() - st) / steps)
    return best

def mlp() -> tuple[Callable[[], list[Tensor]], Callable[[list[Tensor]], None]]:
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    opt = Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    x, y = Tensor.randn(128, 784).realize(), Tensor([i % 10 for i in range(128)]).realize()
    def build() -> list[Tensor]:
        with Tensor.train():
            opt.zero_grad()
            loss = l2(l1(x).relu()).sparse_categorical_crossentropy(y)
            loss.backward()
            return [loss, *opt.schedule_step()]
    return build, lambda outs: Tensor.realize(*outs)

def single(make: Callable[[], Tensor]) -> tuple[Callable[[], list[Tensor]], Callable[[list[Tensor]], None]]:
    return lambda: [make()], lambda outs: Tensor.realize(*outs)

def main() -> None:
    build, run = mlp()
    step = best_block(lambda: run(build()))
    print(f"MLP 784-512-10 Adam eager step: {step * 1e3:.3f} ms")
    a, b = Tensor.randn(512, 512).realize(), Tensor.randn(512, 512).realize()
    img, w = Tensor.randn(16, 32, 32, 32).realize(), Tensor.randn(64, 32, 3, 3).realize()
    s = Tensor.randn(1024, 1024).realize()
    workloads = {"MLP Adam step": (build, run), "matmul 512": single(lambda: a @ b),
                 "conv 16x32x32x32 -> 64": single(lambda: img.conv2d(w)),
                 "softmax 1024x1024": single(lambda: s.softmax(-1))}
    for name, (make, go) in workloads.items():
        outs = make()
        est = outs[0].estimate(*outs[1:])
        go(outs)
        measured = best_block(lambda: go(make()))
        assert est.predicted_s is not None
        print(f"{name:24s} kernels {est.kernels:3d}  predicted {est.predicted_s * 1e3:8.3f} ms  measured "
              f"{measured * 1e3:8.3f} ms  ratio {est.predicted_s / measured:5.2f}")

if __name__ == "__main__": main()
