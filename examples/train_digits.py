"""Train a small CNN on scikit-learn's 8x8 handwritten digits to about 98% test accuracy in seconds.

    .venv/bin/python examples/train_digits.py [--epochs 15] [--batch 64] [--lr 0.003]
    mpirun -n 2 .venv/bin/python examples/train_digits.py --dist     # data parallel over 2 processes (MPI)

With --dist every rank takes its share of each batch, the gradients are averaged over the ranks before each step
(fusegrad.distributed.DataParallel, which also starts every rank from rank 0's weights) and only rank 0 prints.
"""
from __future__ import annotations
import argparse
import time
import numpy as np
from fusegrad import Tensor, TinyJit, nn
from fusegrad.nn.datasets import digits, progress
from fusegrad.nn.state import get_parameters

class DigitsNet:
    """conv-bn-relu-pool twice, then a linear classifier: 8x8 -> 4x4 -> 2x2 -> 10 classes."""
    def __init__(self):
        self.c1, self.b1 = nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64 * 2 * 2, 10)

    def __call__(self, x: Tensor) -> Tensor:
        x = self.b1(self.c1(x)).relu().max_pool2d(2)
        x = self.b2(self.c2(x)).relu().max_pool2d(2)
        return self.fc(x.flatten(1))

def train(epochs: int = 15, batch: int = 64, lr: float = 3e-3, seed: int = 0, quiet: bool = False,
          distributed: bool = False) -> float:
    """Train and return the test accuracy (`distributed`: data parallel over the MPI ranks, see the docstring)."""
    Tensor.manual_seed(seed)
    X_train, Y_train, X_test, Y_test = digits()
    xtr, ytr = X_train.numpy(), Y_train.numpy()
    model = DigitsNet()
    opt = nn.optim.Adam(get_parameters(model), lr=lr)
    dp, rank, world = None, 0, 1
    if distributed:
        import fusegrad.distributed as dist
        rank, world = dist.rank(), dist.world_size()
        if batch % world: raise SystemExit(f"--batch {batch} must be a multiple of the {world} ranks")
        dp = dist.DataParallel(model)
        quiet = quiet or rank != 0

    @TinyJit
    @Tensor.train()
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = model(x).sparse_categorical_crossentropy(y)
        loss.backward()
        # the mean gradient over the ranks; TinyJit replays the MPI call with the kernels
        if dp is not None: dp.sync_gradients()
        opt.step()
        return loss

    rng = np.random.default_rng(seed)
    steps_per_epoch = len(ytr) // batch
    st = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(len(ytr))
        bar = progress(range(steps_per_epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}/{epochs}") \
            if not quiet else range(steps_per_epoch)
        for i in bar:
            idx = order[i * batch:(i + 1) * batch]
            if dp is not None: idx = idx[rank * batch // world:(rank + 1) * batch // world]  # this rank's share
            loss = step(Tensor(xtr[idx]), Tensor(ytr[idx]))
        if dp is not None: loss = dist.all_reduce(loss, "mean")  # (every rank takes part, rank 0 prints)
        if not quiet: print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    with Tensor.test():
        acc = (model(X_test).argmax(axis=1) == Y_test).mean().item()
    if not quiet: print(f"test accuracy {acc * 100:.2f}% after {time.perf_counter() - st:.1f} s")
    return acc

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dist", action="store_true", help="data parallel over the ranks of mpirun (needs fusegrad[dist])")
    args = ap.parse_args()
    train(args.epochs, args.batch, args.lr, distributed=args.dist)
