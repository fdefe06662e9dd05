"""Training and inference benchmark: fusegrad against PyTorch (CPU, 2 threads) in one process.

Workloads: the 784-512-10 MLP with Adam at batch 128 (ms per step, eager and under TinyJit), the digits CNN of
examples/train_digits.py (ms per Adam step at batch 64, TinyJit), ResNet-18 forward at batch 8 (images per second,
TinyJit; 224px, 64px with --quick) and GPT-2 124M decoding with its KV cache (tokens per second, TinyJit; a 2-layer
model with --quick).

Each side runs its steps in blocks (fusegrad block, torch block, fusegrad block, torch block), never alternating call
by call: a BLAS's idle threads spin after each call and would land in the other side's time. The first call of each
side (fusegrad compiles its kernels there) is reported on its own as the cold figure; the steady figure is the best
block's mean.

Run: .venv/bin/python bench/bench_train.py  [--quick]
"""
from __future__ import annotations
import math
import pathlib
import sys
import time
from typing import Callable
import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)

from fusegrad import Device, Tensor, TinyJit, nn  # noqa: E402  (torch threads are set first)
from fusegrad.nn.state import get_parameters, get_state_dict  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2  # noqa: E402
import resnet  # noqa: E402
from train_digits import DigitsNet  # noqa: E402

QUICK = "--quick" in sys.argv
BLOCK = 3 if QUICK else 10  # steps per block

def settle() -> None:
    """Wait for fusegrad's queued kernels (CPU kernels run asynchronously while Python goes on)."""
    Device[Device.DEFAULT].synchronize()

def blocks(ours: Callable[[], object], theirs: Callable[[], object], nblocks: int = 2) -> dict[str, float]:
    """Cold (first call) and steady (best block mean) seconds per call of each side, timed A B A B."""
    out: dict[str, float] = {}
    steps: dict[str, int] = {}
    for name, fn in (("ours", ours), ("torch", theirs)):
        st = time.perf_counter()
        fn()
        settle()
        out[f"{name}_cold"] = time.perf_counter() - st
        fn()  # a TinyJit captures on its second call
        st = time.perf_counter()
        fn()
        settle()
        # slow workloads (a whole ResNet forward) get short blocks, so the run stays within minutes
        steps[name] = max(1, min(BLOCK, int(2.0 / (time.perf_counter() - st))))
    best = {"ours": math.inf, "torch": math.inf}
    for _ in range(nblocks):
        for name, fn in (("ours", ours), ("torch", theirs)):
            st = time.perf_counter()
            for _ in range(steps[name]): fn()
            settle()  # (the last steps' kernels may still be queued: a block ends when they have run)
            best[name] = min(best[name], (time.perf_counter() - st) / steps[name])
    out["ours"], out["torch"] = best["ours"], best["torch"]
    return out

def adam_step(params: list[Tensor], forward: Callable[[Tensor], Tensor], lr: float, jit: bool) -> Callable:
    """fusegrad's Adam step on cross-entropy, in training mode, TinyJit-ed if `jit`: step(x, y) -> loss."""
    opt = nn.optim.Adam(params, lr=lr)
    @Tensor.train()
    def step(xb: Tensor, yb: Tensor) -> Tensor:
        opt.zero_grad()
        loss = forward(xb).sparse_categorical_crossentropy(yb)
        loss.backward()
        opt.step()
        return loss
    return TinyJit(step) if jit else step

def adam_steps(params: list[Tensor], forward: Callable[[Tensor], Tensor], lr: float, jit: bool,
               torch_model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[Callable, Callable]:
    """One Adam step on cross-entropy for each side: fusegrad (adam_step) and torch."""
    fstep = adam_step(params, forward, lr, jit)
    topt = torch.optim.Adam(torch_model.parameters(), lr=lr)
    tx, ty = torch.tensor(x), torch.tensor(y).long()
    def tstep():
        topt.zero_grad()
        F.cross_entropy(torch_model(tx), ty).backward()
        topt.step()
    return (lambda: fstep(Tensor(x), Tensor(y)).realize()), tstep

def mlp_step(jit: bool) -> tuple[Callable, Callable]:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    tm = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return adam_steps([l1.weight, l1.bias, l2.weight, l2.bias], lambda xb: l2(l1(xb).relu()), 1e-3, jit, tm, x, y)

def digits_step() -> tuple[Callable, Callable]:
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 64).astype(np.int32)
    model = DigitsNet()
    tm = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                             torch.nn.MaxPool2d(2), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64),
                             torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(256, 10))
    return adam_steps(get_parameters(model), model, 3e-3, True, tm, x, y)

def resnet_forward(size: int) -> tuple[Callable, Callable]:
    x = np.random.default_rng(0).standard_normal((8, 3, size, size)).astype(np.float32)
    model = resnet.ResNet(18)
    @TinyJit
    def fwd(img: Tensor) -> Tensor:
        with Tensor.test(): return model(img)
    xt = Tensor(x).realize()
    tm = _torch_resnet18()
    tm.eval()
    tx = torch.tensor(x)
    def tfwd():
        with torch.no_grad(): tm(tx)
    return (lambda: fwd(xt).realize()), tfwd

def _torch_resnet18() -> torch.nn.Module:
    """A torch ResNet-18 built from the test's reference modules (torchvision isn't a dependency)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "test"))
    from test_resnet import TBlock
    class R18(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64)
            cin, layers = 64, []
            for i in range(4):
                w = 64 * 2 ** i
                layers.append(torch.nn.Sequential(TBlock(cin, w, 2 if i else 1), TBlock(w, w, 1)))
                cin = w
            self.layers, self.fc = torch.nn.Sequential(*layers), torch.nn.Linear(512, 1000)
        def forward(self, x):
            x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
            return self.fc(self.layers(x).mean((2, 3)))
    return R18()

def gpt2_decode(cfg: gpt2.Config) -> tuple[Callable, Callable]:
    model = gpt2.GPT2(cfg)
    sd = {k: torch.tensor(v.numpy()) for k, v in get_state_dict(model).items() if "cache" not in k}
    toks = [464, 3616, 286, 1204, 318]
    model(Tensor([toks]), 0).realize()
    pos = [len(toks)]
    def ours():
        model(Tensor([[toks[-1] % cfg.vocab_size]]), pos[0] % (cfg.max_context - 1) + 1).realize()
        pos[0] += 1
    hd = cfg.dim // cfg.n_head
    kcache = [torch.zeros(1, cfg.n_head, cfg.max_context, hd) for _ in range(cfg.n_layer)]
    vcache = [torch.zeros(1, cfg.n_head, cfg.max_context, hd) for _ in range(cfg.n_layer)]
    tpos = [len(toks)]
    @torch.no_grad()
    def theirs():
        p = tpos[0] % (cfg.max_context - 1) + 1
        x = sd["wte.weight"][toks[-1] % cfg.vocab_size].reshape(1, 1, -1) + sd["wpe.weight"][p]
        for i in range(cfg.n_layer):
            g = lambda n: sd[f"h.{i}.{n}"]  # noqa: E731
            h = F.layer_norm(x, (cfg.dim,), g("ln_1.weight"), g("ln_1.bias"))
            q, k, v = F.linear(h, g("attn.c_attn.weight"), g("attn.c_attn.bias")).split(cfg.dim, dim=-1)
            q, k, v = (t.reshape(1, 1, cfg.n_head, hd).transpose(1, 2) for t in (q, k, v))
            kcache[i][:, :, p], vcache[i][:, :, p] = k[:, :, 0], v[:, :, 0]
            att = F.scaled_dot_product_attention(q, kcache[i][:, :, :p + 1], vcache[i][:, :, :p + 1])
            x = x + F.linear(att.transpose(1, 2).reshape(1, 1, cfg.dim), g("attn.c_proj.weight"), g("attn.c_proj.bias"))
            h = F.layer_norm(x, (cfg.dim,), g("ln_2.weight"), g("ln_2.bias"))
            x = x + F.linear(F.gelu(F.linear(h, g("mlp.c_fc.weight"), g("mlp.c_fc.bias")), approximate="tanh"),
                             g("mlp.c_proj.weight"), g("mlp.c_proj.bias"))
        F.layer_norm(x, (cfg.dim,), sd["ln_f.weight"], sd["ln_f.bias"]) @ sd["wte.weight"].T
        tpos[0] += 1
    return ours, theirs

def main() -> None:
    rows = []
    def run(name: str, unit: str, make: Callable[[], tuple[Callable, Callable]], per_call: float = 1.0) -> None:
        try: r = blocks(*make())
        except Exception as e:  # one failing workload doesn't hide the others
            print(f"{name}: failed: {type(e).__name__}: {e}")
            return
        rows.append((name, unit, r, per_call))
        print(f"  done: {name}", flush=True)
    run("MLP 784-512-10 Adam b128, eager", "ms/step", lambda: mlp_step(False))
    run("MLP 784-512-10 Adam b128, TinyJit", "ms/step", lambda: mlp_step(True))
    run("digits CNN Adam b64, TinyJit", "ms/step", digits_step)
    size = 64 if QUICK else 224
    run(f"ResNet-18 forward b8 {size}px, TinyJit", "img/s", lambda: resnet_forward(size), per_call=8)
    cfg = gpt2.Config(n_layer=2) if QUICK else gpt2.Config()
    run(f"GPT-2 {'2-layer' if QUICK else '124M'} decode, TinyJit", "tok/s", lambda: gpt2_decode(cfg))
    print(f"\n{'workload':42s} {'unit':8s} {'fusegrad':>10s} {'torch':>10s} {'ratio':>7s}  {'cold fg':>9s} "
          f"{'cold torch':>10s}")
    for name, unit, r, per_call in rows:
        ratio = r["torch"] / r["ours"]
        if unit.endswith("/s"): ours, theirs = per_call / r["ours"], per_call / r["torch"]
        else: ours, theirs = r["ours"] * 1e3, r["torch"] * 1e3
        print(f"{name:42s} {unit:8s} {ours:10.2f} {theirs:10.2f} {ratio:6.2f}x  {r['ours_cold']:8.2f}s "
              f"{r['torch_cold']:9.2f}s")
    print("ratio > 1: fusegrad faster (torch time / fusegrad time)")

if __name__ == "__main__":
    main()
