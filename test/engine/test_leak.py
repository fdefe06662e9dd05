"""Long-running loops keep a flat memory profile: graphs that differ only by Python numbers, by shapes or by input
buffers reuse cached schedules and kernels, and every cache the process keeps is bounded."""
from __future__ import annotations
import gc
import weakref
import numpy as np
import pytest
from fusegrad import Tensor, gradient
from fusegrad.device import Device
from fusegrad.engine.realize import method_cache
from fusegrad.schedule.kernelize import schedule_cache, schedule_cache_stats
from fusegrad.uop.ops import device_buffer
from fusegrad.uop.ops import UOpMetaClass

RSS_BOUND_MB = 10
SHAPES = [(n, 3 + n % 5) for n in range(1, 201)]   # 200 distinct shapes

def rss_mb() -> float:
    # (after the queued kernels have run: each holds its buffers until then, and a loop that submits faster than the
    # kernels run, with another process on the other core, has up to a queue's worth of steps' inputs in flight)
    Device["CPU"].synchronize()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"): return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")

def cache_sizes() -> dict[str, int]:
    return {"uops": len(UOpMetaClass.ucache), "schedules": len(schedule_cache), "methods": len(method_cache),
            "binaries": len(Device["CPU"].compiler.mem_cache)}

def one_round(x: Tensor, step: int, rng: np.random.Generator) -> None:
    # a changing constant (a step counter) and a changing learning-rate-like float
    ((x * 1.5 + 1).relu().sum(1) + step).realize()
    (x * (0.1 / (1 + step))).realize()
    # a fresh input buffer every step
    Tensor(rng.standard_normal((64, 64), dtype=np.float32)).exp().sum().realize()
    # one of many shapes
    shape = SHAPES[step % len(SHAPES)]
    (Tensor.ones(*shape).contiguous() * 2 + step).realize()

def run_loop(iterations: int) -> tuple[float, float, dict[str, int], dict[str, int]]:
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((256, 256), dtype=np.float32)).realize()
    # warm up: every shape once, all in one schedule so their kernels are compiled together; then each graph
    # structure twice more (the first sighting of a structure bakes its constants in, the next one lifts those that
    # changed into kernel parameters)
    Tensor.realize(*[Tensor.ones(*s).contiguous() * 2 + 1 for s in SHAPES])
    for step in range(len(SHAPES) * 3): one_round(x, step, rng)
    gc.collect()
    rss0, sizes0, misses0 = rss_mb(), cache_sizes(), schedule_cache_stats["misses"]
    for step in range(iterations): one_round(x, step, rng)
    gc.collect()
    return rss0, rss_mb(), sizes0, {**cache_sizes(), "misses": schedule_cache_stats["misses"] - misses0}

def test_loop_memory_is_flat():
    rss0, rss1, sizes0, sizes1 = run_loop(2000)
    assert rss1 - rss0 < RSS_BOUND_MB, f"RSS grew from {rss0:.1f} MB to {rss1:.1f} MB"
    for name, n in sizes0.items():
        # hash-consed UOps may vary a little with what the last iterations left alive; the caches must not grow
        slack = 200 if name == "uops" else 0
        assert sizes1[name] <= n + slack, f"{name} grew from {n} to {sizes1[name]}"
    # changing constants and fresh buffers don't re-schedule after the warm-up
    assert sizes1["misses"] == 0

@pytest.mark.slow
def test_soak_memory_is_flat():
    rss0, rss1, sizes0, sizes1 = run_loop(100_000)
    assert rss1 - rss0 < RSS_BOUND_MB, f"RSS grew from {rss0:.1f} MB to {rss1:.1f} MB"
    assert sizes1["schedules"] <= sizes0["schedules"] and sizes1["methods"] <= sizes0["methods"]
    assert sizes1["uops"] <= sizes0["uops"] + 200

def test_caches_are_bounded():
    # more distinct kernels than the caches hold: each stays at its bound
    from fusegrad.engine import realize
    from fusegrad.schedule import kernelize
    old = (realize.METHOD_CACHE_SIZE, kernelize.SCHEDULE_CACHE_SIZE, Device["CPU"].compiler.MEM_CACHE_SIZE)
    realize.METHOD_CACHE_SIZE, kernelize.SCHEDULE_CACHE_SIZE, Device["CPU"].compiler.MEM_CACHE_SIZE = 8, 8, 8
    try:
        for n in range(1, 30): (Tensor.ones(n, 7).contiguous() * 3).realize()
        assert len(method_cache) <= 8 and len(schedule_cache) <= 8 and len(Device["CPU"].compiler.mem_cache) <= 8
        # evicted kernels still run correctly when they come back
        np.testing.assert_array_equal((Tensor.ones(1, 7).contiguous() * 3).numpy(), np.full((1, 7), 3, np.float32))
    finally:
        realize.METHOD_CACHE_SIZE, kernelize.SCHEDULE_CACHE_SIZE, Device["CPU"].compiler.MEM_CACHE_SIZE = old

def test_gradient_cache_is_bounded_and_holds_no_memory():
    rng = np.random.default_rng(1)
    w = Tensor(rng.standard_normal((64, 64), dtype=np.float32), requires_grad=True).realize()
    def step() -> None:
        # a fresh 1 MB batch every step: a template holding a step's buffers would grow RSS by a MB a step
        x = Tensor(rng.standard_normal((4096, 64), dtype=np.float32))
        w.grad = None
        (x @ w).relu().mean().backward()
        w.grad.realize()
        # (each step's kernels run before the next: queued ones hold their inputs, and on a busy machine a queue's
        # worth of steps in flight left the allocator's cache of freed buffers holding more MB at the end than at the
        # start, 10.9 MB once; what this test looks for is memory kept after the kernels are done)
        Device["CPU"].synchronize()
    for _ in range(20): step()
    # no cached template keeps a step's input alive (it holds placeholders, not the buffers it was built over): a
    # structure new to the cache, seen once, made a template of, then served from it
    v = Tensor(rng.standard_normal((48, 5), dtype=np.float32), requires_grad=True).realize()
    gone = []
    for _ in range(3):
        x = Tensor(rng.standard_normal((2048, 48), dtype=np.float32)).realize()
        gone.append(weakref.ref(device_buffer(x.uop)))
        v.grad = None
        (x @ v).tanh().sum().backward()
        v.grad.realize()
        del x
    v.grad = None
    # (after the queued kernels have run: a launch holds its buffers until a wait sees it done)
    Device["CPU"].synchronize()
    gc.collect()
    assert all(r() is None for r in gone), "a step's input buffer outlived the step"
    gc.collect()
    rss0, size0 = rss_mb(), len(gradient._gradient_cache)
    for _ in range(300): step()
    gc.collect()
    assert rss_mb() - rss0 < RSS_BOUND_MB and len(gradient._gradient_cache) == size0
    # more distinct structures than it holds: it stays at its bound, and an evicted structure's gradients come back
    old, gradient.GRADIENT_CACHE_SIZE = gradient.GRADIENT_CACHE_SIZE, 8
    try:
        for n in range(1, 30):
            for _ in range(2):
                v = Tensor(np.ones((n, 3), np.float32), requires_grad=True)
                (v * 2).sum().backward()
        assert len(gradient._gradient_cache) <= 8
        v = Tensor(np.ones((1, 3), np.float32), requires_grad=True)
        (v * 5).sum().backward()
        np.testing.assert_array_equal(v.grad.numpy(), np.full((1, 3), 5, np.float32))
    finally:
        gradient.GRADIENT_CACHE_SIZE = old
