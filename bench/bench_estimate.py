"""Tensor.estimate's predicted time against the measured time on the training benchmark's workloads (bench_train.py:
the MLP's and the digits CNN's Adam steps, ResNet-18's forward) and a big matmul, with the device's roofline checked
against a quick probe first (tensor/explain.py roofline).

Each workload's graph is built untimed; what is timed is the realize (scheduling, launching and the kernels until the
device is done), the best of several blocks, as the roofline's own measurements are. A ratio is predicted / measured.

Run: .venv/bin/python bench/bench_estimate.py  [--full]   (--full: ResNet-18 at 224 px rather than 64)
"""
from __future__ import annotations
import pathlib
import sys
import time
from typing import Callable
import numpy as np
from fusegrad import Device, Tensor, nn
from fusegrad.nn.optim import Adam
from fusegrad.nn.state import get_parameters
from fusegrad.tensor.explain import roofline

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import resnet  # noqa: E402
from train_digits import DigitsNet  # noqa: E402

Build = Callable[[], list[Tensor]]

def adam_step(params: list[Tensor], forward: Callable[[Tensor], Tensor], x: np.ndarray, y: np.ndarray,
              lr: float) -> Build:
    """The lazy tensors of one Adam step on cross-entropy (loss and updated state), not realized."""
    opt = Adam(params, lr=lr)
    xt, yt = Tensor(x).realize(), Tensor(y).realize()
    def build() -> list[Tensor]:
        with Tensor.train():
            opt.zero_grad()
            loss = forward(xt).sparse_categorical_crossentropy(yt)
            loss.backward()
            return [loss, *opt.schedule_step()]
    return build

def mlp() -> Build:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    return adam_step([l1.weight, l1.bias, l2.weight, l2.bias], lambda xb: l2(l1(xb).relu()), x, y, 1e-3)

def digits() -> Build:
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 64).astype(np.int32)
    model = DigitsNet()
    return adam_step(get_parameters(model), model, x, y, 3e-3)

def resnet18(size: int) -> Build:
    model = resnet.ResNet(18)
    img = Tensor(np.random.default_rng(0).standard_normal((8, 3, size, size)).astype(np.float32)).realize()
    def build() -> list[Tensor]:
        with Tensor.test(): return [model(img)]
    return build

def matmul(n: int) -> Build:
    a, b = Tensor.randn(n, n).realize(), Tensor.randn(n, n).realize()
    return lambda: [a @ b]

def measure(build: Build, blocks: int = 5) -> float:
    """The best time of realizing a freshly built graph, until the device is done."""
    dev = Device[Device.DEFAULT]
    Tensor.realize(*build())  # compiled, and the schedule cached, as in a training loop
    best = float("inf")
    for _ in range(blocks):
        outs = build()
        dev.synchronize()
        st = time.perf_counter()
        Tensor.realize(*outs)
        dev.synchronize()
        best = min(best, time.perf_counter() - st)
    return best

def main() -> None:
    st = time.perf_counter()
    roof = roofline(Device.DEFAULT)
    print(f"roofline ({Device.DEFAULT}, checked against a probe in {time.perf_counter() - st:.2f} s): "
          f"{roof.flops_per_s / 1e9:.1f} GFLOP/s, {roof.bytes_per_s / 1e9:.1f} GB/s, {roof.launch_s * 1e6:.1f} us "
          "per kernel")
    size = 224 if "--full" in sys.argv else 64
    workloads = {"MLP 784-512-10 Adam step": mlp(), "digits CNN Adam step": digits(),
                 f"ResNet-18 forward 8x3x{size}x{size}": resnet18(size), "matmul 1024": matmul(1024)}
    for name, build in workloads.items():
        outs = build()
        est = outs[0].estimate(*outs[1:])
        Tensor.realize(*outs)
        measured = measure(build)
        assert est.predicted_s is not None
        print(f"{name:28s} kernels {est.kernels:3d}  predicted {est.predicted_s * 1e3:8.3f} ms  measured "
              f"{measured * 1e3:8.3f} ms  ratio {est.predicted_s / measured:5.2f}")

if __name__ == "__main__": main()
