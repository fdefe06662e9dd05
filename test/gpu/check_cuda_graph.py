"""TinyJit through CUDA graphs and copies between GPUs, on a machine with NVIDIA GPUs (run by test/gpu/check.sh):

1. a jitted function of several kernels replays through one CUDA graph per replay and computes what numpy computes,
   also when its input and output buffers change between replays (the graph's nodes updated);
2. the time of a replay through a graph against the same kernels launched one by one (printed, not checked);
3. with two GPUs or more: a tensor moved from the first to the second (peer to peer where the driver allows it, else
   through the host), a tensor split over both and summed, and a replica copied to each."""
from __future__ import annotations
import ctypes
import time
import numpy as np
from fusegrad import Device, Tensor, TinyJit
from fusegrad.runtime import ops_cuda

graph_calls = 0
_graph_call = ops_cuda.CUDAGraph.__call__

def _counted(self: ops_cuda.CUDAGraph, allocations: list) -> None:
    global graph_calls
    graph_calls += 1
    _graph_call(self, allocations)

ops_cuda.CUDAGraph.__call__ = _counted  # type: ignore[method-assign]

rng = np.random.default_rng(0)
w = rng.standard_normal((64, 32)).astype(np.float32)
wt = Tensor(w, device="CUDA").realize()

def model(x: Tensor) -> Tensor:
    h = (x @ wt).relu()
    b = (h * h.sum(axis=0)).sum(axis=1)
    return (h / b.reshape(-1, 1)) @ wt.T

def reference(x: np.ndarray) -> np.ndarray:
    h = np.maximum(x @ w, 0)
    b = (h * h.sum(axis=0)).sum(axis=1)
    return (h / b[:, None]) @ w.T

def check_graph_replays() -> None:
    f = TinyJit(model)
    kept = []
    for i in range(8):
        x = rng.standard_normal((16, 64)).astype(np.float32) + 1
        out = f(Tensor(x, device="CUDA").realize())
        if i % 2: kept.append(out)   # (a kept output: the next replay writes another buffer)
        np.testing.assert_allclose(out.numpy(), reference(x), rtol=1e-4, atol=1e-6)
    assert graph_calls == 6, f"{graph_calls} graph launches in 6 replays"
    print(f"TinyJit: {len(f.captured)} kernels, 6 replays through a CUDA graph match numpy")

def replay_time(graphs: bool) -> float:
    dev = Device["CUDA"]
    before, dev.graphs = dev.graphs, graphs   # (read when a launch is prepared: a new TinyJit prepares its own)
    try:
        f = TinyJit(model)
        x = Tensor(rng.standard_normal((16, 64)).astype(np.float32), device="CUDA").realize()
        for _ in range(3): f(x)
        best = float("inf")
        for _ in range(5):
            dev.synchronize()
            st = time.perf_counter()
            for _ in range(100): f(x)
            dev.synchronize()
            best = min(best, (time.perf_counter() - st) / 100)
        return best
    finally: dev.graphs = before

def check_two_gpus() -> None:
    count = ctypes.c_int()
    ops_cuda.check(ops_cuda.libcuda().cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    if count.value < 2:
        print(f"{count.value} GPU: no copy between GPUs to check")
        return
    x = rng.standard_normal((1000, 100)).astype(np.float32)
    moved = Tensor(x, device="CUDA").to("CUDA:1").realize()
    assert moved.device == "CUDA:1" and (moved.numpy() == x).all()
    peer = Device["CUDA:1"].peer_access(Device["CUDA"])
    split = Tensor(x, device="CUDA").shard(("CUDA:0", "CUDA:1"), axis=0)
    np.testing.assert_allclose(split.sum(axis=0).numpy(), x.sum(axis=0), rtol=1e-4, atol=1e-3)
    copies = Tensor(x, device="CUDA").shard(("CUDA:0", "CUDA:1")) * 2
    np.testing.assert_allclose(copies.to("CUDA:1").numpy(), x * 2)
    print(f"two GPUs ({'peer to peer' if peer else 'through the host'}): a copy, a split sum and replicas match numpy")

if __name__ == "__main__":
    check_graph_replays()
    on, off = replay_time(True), replay_time(False)
    print(f"a replay: {on * 1e6:.1f} us through a graph, {off * 1e6:.1f} us with the kernels launched one by one")
    check_two_gpus()
