"""Write the rendered source of every kernel of a fixed set of workloads to a folder, one file per workload.

Used to check that a change meant to move code around leaves the generated code byte-identical:

    python bench/dump_kernels.py /tmp/before      # on the old commit
    python bench/dump_kernels.py /tmp/after       # on the new one
    diff -r /tmp/before /tmp/after

Workloads: the MLP training step (eager and under TinyJit), ResNet-18 forward at 64x64, the digits CNN training step,
a convolution forward and backward, softmax / layernorm / gelu, a data-parallel step sharded over two CPU devices, the
rows of bench/bench_first_call.py (ResNet-18 forward at batch 8, the 200-op graph) and test/test_resnet.py's small
ResNet in eval and training mode.
"""
from __future__ import annotations
import os
import pathlib
import sys
from typing import Callable

os.environ.setdefault("CACHELEVEL", "0")  # every kernel is compiled here, none comes from the disk cache
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import numpy as np  # noqa: E402

from fusegrad import Tensor, nn  # noqa: E402
from fusegrad.engine import realize  # noqa: E402
from fusegrad.nn.state import get_parameters  # noqa: E402
from fusegrad.schedule.kernelize import schedule_cache  # noqa: E402
from bench_train import train_step  # noqa: E402  (bench/ is the script's folder)

SEEN: list[str] = []
_original_init = realize.CompiledRunner.__init__

def _recording_init(self, p, *args, **kwargs) -> None:
    SEEN.append(f"// {p.name}\n{p.src}")
    _original_init(self, p, *args, **kwargs)

def adam_step(params: list[Tensor], forward: Callable[[Tensor], Tensor], lr: float, jit: bool) -> Callable:
    return train_step(nn.optim.Adam(params, lr=lr), lambda xb, yb: forward(xb).sparse_categorical_crossentropy(yb), jit)

def mlp(jit: bool) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    Tensor.manual_seed(0)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    step = adam_step([l1.weight, l1.bias, l2.weight, l2.bias], lambda xb: l2(l1(xb).relu()), 1e-3, jit)
    for _ in range(3): step(Tensor(x), Tensor(y)).realize()

def resnet18() -> None:
    import resnet
    Tensor.manual_seed(0)
    model = resnet.ResNet(18)
    img = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    with Tensor.test(): model(Tensor(img)).realize()

def digits() -> None:
    from train_digits import DigitsNet
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 64).astype(np.int32)
    Tensor.manual_seed(0)
    model = DigitsNet()
    step = adam_step(get_parameters(model), model, 1e-3, True)
    for _ in range(3): step(Tensor(x), Tensor(y)).realize()

def conv() -> None:
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((4, 8, 16, 16)).astype(np.float32), requires_grad=True)
    w = Tensor(rng.standard_normal((16, 8, 3, 3)).astype(np.float32), requires_grad=True)
    x.conv2d(w, padding=1).relu().sum().backward()
    Tensor.realize(x.grad, w.grad)

def norms() -> None:
    x = Tensor(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)).realize()
    Tensor.realize(x.softmax(), x.layernorm(), x.gelu(), x.log_softmax())

def first_call_rows() -> None:
    # the rows of bench/bench_first_call.py: ResNet-18 forward at batch 8, the 200-op elementwise graph
    import resnet
    Tensor.manual_seed(0)
    model = resnet.ResNet(18)
    img = np.random.default_rng(0).standard_normal((8, 3, 64, 64)).astype(np.float32)
    with Tensor.test(): model(Tensor(img)).realize()
    x = Tensor.ones(77, 77).contiguous().realize()
    for i in range(200): x = (x * 1.01 + 0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(77, 77) * 0.001 + x
    x.realize()

def tiny_resnet_train() -> None:
    # test/test_resnet.py's model: forward in eval and training mode, and a backward
    import resnet
    Tensor.manual_seed(0)
    model = resnet.ResNet(18, num_classes=10, width=8, blocks=[1, 1, 1, 1])
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with Tensor.test(): model(Tensor(x)).realize()
    params = [model.conv1.weight, model.layer3[0].conv2.weight, model.fc.weight]
    for p in params: p.requires_grad_(True)
    with Tensor.train():
        model(Tensor(x)).square().sum().backward()
        Tensor.realize(*[p.grad for p in params])

def sharded() -> None:
    devices = ("CPU:0", "CPU:1")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 64)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int32)
    Tensor.manual_seed(0)
    l1 = nn.Linear(64, 10)
    for p in (l1.weight, l1.bias): p.to_(devices)
    opt = nn.optim.SGD([l1.weight, l1.bias], lr=0.1)
    with Tensor.train():
        for _ in range(2):
            opt.zero_grad()
            xb, yb = Tensor(x).shard(devices, axis=0), Tensor(y).shard(devices, axis=0)
            loss = l1(xb).sparse_categorical_crossentropy(yb)
            loss.backward()
            opt.step()
            loss.realize()

WORKLOADS: dict[str, Callable[[], None]] = {
    "mlp_eager": lambda: mlp(False), "mlp_jit": lambda: mlp(True), "resnet18": resnet18, "digits": digits,
    "conv": conv, "norms": norms, "sharded": sharded, "first_call_rows": first_call_rows,
    "tiny_resnet_train": tiny_resnet_train}

def main() -> None:
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        raise SystemExit(f"usage: python {sys.argv[0]} [FOLDER]  (default: kernels)\n\n{__doc__}")
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "kernels")
    out.mkdir(parents=True, exist_ok=True)
    realize.CompiledRunner.__init__ = _recording_init
    for name, run in WORKLOADS.items():
        SEEN.clear()
        # each workload compiles all of its kernels: none comes from an earlier workload's runners, nor from a replay
        # plan an earlier workload left in the schedule cache (whether its runners were still there varied from run to
        # run, and with it the kernels a workload recorded)
        realize.method_cache.clear()
        schedule_cache.clear()
        run()
        (out / f"{name}.c").write_text("\n".join(SEEN))
        print(f"{name}: {len(SEEN)} kernels")

if __name__ == "__main__":
    main()
