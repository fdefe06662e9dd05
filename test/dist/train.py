"""Run by test/test_distributed.py under `mpirun -n 2`: data-parallel training of a two-layer MLP for 20 steps, each
rank on its share of every batch, must end with the parameters one process gets training on the whole batches.

Two runs: SGD with momentum called eagerly, and Adam with the whole step (sync_gradients included) under TinyJit.
Rank 0 then trains the same model on the full batches without MPI and compares. Any failed check raises, which
aborts all ranks."""
import numpy as np
from fusegrad import Tensor, TinyJit, nn
from fusegrad.nn.state import get_parameters
import fusegrad.distributed as dist

STEPS, BATCH, FEATURES, CLASSES = 20, 32, 10, 4

class MLP:
    def __init__(self): self.l1, self.l2 = nn.Linear(FEATURES, 32), nn.Linear(32, CLASSES)
    def __call__(self, x: Tensor) -> Tensor: return self.l2(self.l1(x).relu())

def make_model(seed: int) -> MLP:
    Tensor.manual_seed(seed)
    return MLP()

def weights(model: MLP) -> list[np.ndarray]: return [p.numpy() for p in get_parameters(model)]

def train(model: MLP, opt, xs: np.ndarray, ys: np.ndarray, dp=None, jit: bool = False) -> list[np.ndarray]:
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = model(x).sparse_categorical_crossentropy(y)
        loss.backward()
        if dp is not None: dp.sync_gradients()
        opt.step()
        return loss
    run = TinyJit(Tensor.train()(step)) if jit else Tensor.train()(step)
    for x, y in zip(xs, ys): run(Tensor(x), Tensor(y))
    if jit: assert run.cnt == 2, "the jitted step should have been captured and replayed"
    return weights(model)

OPTIMIZERS = {"sgd": (lambda ps: nn.optim.SGD(ps, lr=0.1, momentum=0.9), False),
              "adam, jitted": (lambda ps: nn.optim.Adam(ps, lr=1e-2), True)}

if __name__ == "__main__":
    dist.init()
    me, n = dist.rank(), dist.world_size()
    assert n >= 2 and BATCH % n == 0
    rng = np.random.default_rng(7)
    X = rng.standard_normal((STEPS, BATCH, FEATURES)).astype(np.float32)
    Y = rng.integers(0, CLASSES, (STEPS, BATCH)).astype(np.int32)
    lo, hi = me * BATCH // n, (me + 1) * BATCH // n
    for name, (make_opt, jit) in OPTIMIZERS.items():
        start = weights(make_model(100))            # rank 0's initial weights, computed here independently
        model = make_model(100 + me)                # each rank starts elsewhere: DataParallel must broadcast
        if me: assert not np.array_equal(weights(model)[0], start[0])
        dp = dist.DataParallel(model)
        for got, want in zip(weights(model), start): np.testing.assert_array_equal(got, want, err_msg="broadcast")
        got = train(model, make_opt(get_parameters(model)), X[:, lo:hi], Y[:, lo:hi], dp, jit)
        # every rank took the same steps: bit for bit the same parameters everywhere
        for w in got:
            everyone = dist.all_gather(Tensor(w[None])).numpy()
            for r in range(n): np.testing.assert_array_equal(everyone[r], w, err_msg=f"{name}: rank {r} differs")
        if me == 0:
            ref = make_model(100)
            want = train(ref, make_opt(get_parameters(ref)), X, Y)
            diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
            moved = min(float(np.abs(w - s).max()) for w, s in zip(want, start))
            assert moved > 1e-2, f"{name}: training hardly changed the weights ({moved})"
            for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
            print(f"{name}: data-parallel weights match one process on the full batch (max diff {diff:.2e})")
    print(f"rank {me}/{n}: training checks passed", flush=True)
