"""All-reduce between MPI ranks: fusegrad.distributed against raw mpi4py, and data-parallel training step time.

1. Bandwidth of a float32 sum over 2 ranks, 1 KB .. 64 MB: mpi4py's `comm.Allreduce` on numpy arrays (send and
   receive buffers allocated once) against fusegrad's `all_reduce` (a new result tensor each call; with and without
   its cross-rank argument check) and `all_reduce_` (in place) on tensors holding the same values. GB/s is the
   payload (the array's bytes) per second; the ratio is mpi4py's time over fusegrad's (target >= 0.8).
2. The 784-512-10 MLP with Adam at batch 128 under TinyJit: ms per step on 1 rank (rank 0 alone, the whole batch, all
   cores, no MPI call) and on 2 ranks (64 samples each, gradients averaged by DataParallel inside the jitted step).

Each side runs in blocks (A B A B), never alternating call by call; the first call of each side is reported on its
own (the cold figure: first allocation, or compiling kernels), the steady figure is the best block's mean.

Run from the repository root (as root, Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1):

    mpirun -n 2 .venv/bin/python bench/bench_allreduce.py  [--quick]
"""
from __future__ import annotations
import math
import sys
import time
from typing import Callable
import numpy as np
from mpi4py import MPI
from fusegrad import Context, Tensor, TinyJit, nn
from fusegrad.hostcpu import host_cpu_count
from fusegrad.nn.state import get_parameters
import fusegrad.distributed as dist

QUICK = "--quick" in sys.argv
SIZES = [1 << k for k in range(10, 27, 4 if QUICK else 2)]   # bytes: 1 KB, 4 KB, ... 64 MB
BLOCK_SECONDS = 0.05 if QUICK else 0.25

def say(*args: object) -> None:
    if dist.rank() == 0: print(*args, flush=True)

def timed(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of n calls, started together on all ranks; the slowest rank's time (a collective is done
    when the last rank is)."""
    comm = dist.communicator()
    comm.Barrier()
    st = time.perf_counter()
    for _ in range(n): fn()
    return comm.allreduce((time.perf_counter() - st) / n, op=MPI.MAX)

def blocks(sides: dict[str, Callable[[], object]], nblocks: int = 2) -> dict[str, tuple[float, float]]:
    """{name: (cold, steady)} seconds per call of each side, timed in blocks A B A B."""
    cold, calls = {}, {}
    for name, fn in sides.items():
        cold[name] = timed(fn, 1)
        fn()  # (a TinyJit captures on its second call)
        one = timed(fn, 1)
        # every rank must run the same number of calls: rank 0's estimate decides
        calls[name] = dist.communicator().bcast(max(2, min(5000, int(BLOCK_SECONDS / max(one, 1e-7)))), root=0)
    best = {name: math.inf for name in sides}
    for _ in range(nblocks):
        for name, fn in sides.items(): best[name] = min(best[name], timed(fn, calls[name]))
    return {name: (cold[name], best[name]) for name in sides}

def fmt_size(n: int) -> str: return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"

SIDES = ("mpi4py", "all_reduce", "check=False", "all_reduce_")

def bench_allreduce() -> None:
    comm = dist.communicator()
    say(f"float32 sum over {dist.world_size()} ranks: GB/s of payload, steady (cold = first call); x = mpi4py's time "
        "over fusegrad's")
    say("all_reduce: a new result tensor, the arguments checked across ranks first; check=False: without that check; "
        "all_reduce_: in place, check=False")
    say(f"{'size':>6s} | {'mpi4py':>13s} | " + " | ".join(f"{name:>19s}" for name in SIDES[1:]))
    for nbytes in SIZES:
        n = nbytes // 4
        send = np.random.default_rng(dist.rank()).standard_normal(n).astype(np.float32)
        recv = np.empty_like(send)
        t, t_inplace = Tensor(send).realize(), Tensor(send).realize()
        res = blocks({"mpi4py": lambda: comm.Allreduce(send, recv, op=MPI.SUM),
                      "all_reduce": lambda: dist.all_reduce(t, "sum"),
                      "check=False": lambda: dist.all_reduce(t, "sum", check=False),
                      "all_reduce_": lambda: dist.all_reduce_(t_inplace, "sum", check=False)})
        # (the in-place side sums into its own input over and over: fine for timing, so only the others' values are
        # checked)
        np.testing.assert_allclose(dist.all_reduce(t).numpy(), recv, rtol=1e-6)
        cells = []
        for name in SIDES:
            cold, steady = res[name]
            cell = f"{nbytes / steady / 1e9:6.2f} ({nbytes / cold / 1e9:5.2f})"
            cells.append(cell if name == "mpi4py" else f"{cell} {res['mpi4py'][1] / steady:4.2f}x")
        say(f"{fmt_size(nbytes):>6s} | " + " | ".join(cells))

def mlp_step(batch: int, dp: bool) -> Callable[[], object]:
    """A jitted Adam step of the 784-512-10 MLP on `batch` samples (the same start weights on every rank)."""
    Tensor.manual_seed(0)
    model = [nn.Linear(784, 512), Tensor.relu, nn.Linear(512, 10)]
    params = get_parameters(model)
    opt = nn.optim.Adam(params, lr=1e-3)
    sync = dist.DataParallel(params) if dp else None
    rng = np.random.default_rng(dist.rank())
    x = Tensor(rng.standard_normal((batch, 784)).astype(np.float32)).realize()
    y = Tensor(rng.integers(0, 10, batch).astype(np.int32)).realize()

    @TinyJit
    @Tensor.train()
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = x.sequential(model).sparse_categorical_crossentropy(y)
        loss.backward()
        if sync is not None: sync.sync_gradients()
        opt.step()
        return loss
    return lambda: step(x, y)

def idle_until_rank0() -> None:
    """Wait for rank 0 without spinning a core (a blocking MPI wait busy-polls)."""
    req = dist.communicator().Ibarrier()
    while not req.Test(): time.sleep(0.005)

def bench_training(batch: int = 128) -> None:
    comm, n = dist.communicator(), dist.world_size()
    say(f"\n784-512-10 MLP, Adam, batch {batch}, TinyJit: ms per step (cold = first call, compiles)")
    # one rank: rank 0 trains on the whole batch with every core while the others sleep
    if dist.rank() == 0:
        with Context(CPU_THREADS=host_cpu_count()):
            single = mlp_step(batch, dp=False)
            st = time.perf_counter()
            single()
            cold1 = time.perf_counter() - st
            single()
            times = []
            for _ in range(2 if QUICK else 4):
                st = time.perf_counter()
                for _ in range(20): single()
                times.append((time.perf_counter() - st) / 20)
        idle_until_rank0()
    else: idle_until_rank0()
    # n ranks: each its share of the batch, gradients averaged in the jitted step
    res = blocks({"dp": mlp_step(batch // n, dp=True)}, nblocks=2 if QUICK else 4)
    if dist.rank() == 0:
        steady1 = min(times)
        cold_n, steady_n = res["dp"]
        say(f"  1 rank : {steady1 * 1e3:7.2f} ms/step (cold {cold1 * 1e3:7.1f} ms)")
        say(f"  {n} ranks: {steady_n * 1e3:7.2f} ms/step (cold {cold_n * 1e3:7.1f} ms), {batch // n} samples each; "
            f"speedup {steady1 / steady_n:.2f}x")
    comm.Barrier()

# --- an in-process all-reduce between two devices (a tensor sharded over CPU:0 and CPU:1, summed across its shards)
# --- belongs here, timed the same way against bench_allreduce's figures, once sharded tensors exist.

if __name__ == "__main__":
    dist.init()
    if dist.world_size() < 2: say("(one rank: start with mpirun -n 2 for a real all-reduce)")
    bench_allreduce()
    bench_training()
