"""A replayed realize (engine/realize.py run_replayed) queues runs of consecutive prepared launches through one launch
graph (_launch_graphs). These check that the results equal torch's and NumPy's step after step with new inputs, with
a kernel that has no prepared launch (a copy) between graphed ones, that the graph is the path taken, and that it
counts the work the per-kernel launches count."""
from __future__ import annotations
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Device, GlobalCounters, Tensor, nn
from fusegrad.engine import realize
from fusegrad.runtime.cpu_pool import c_pool, cores

rng = np.random.default_rng(11)

def _arr(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)

needs_pool = pytest.mark.skipif(cores() < 2 or c_pool() is None,
                                reason="launch graphs queue on the C pool, which needs two cores and a C compiler")

@pytest.fixture
def graph_calls(monkeypatch):
    """How many launch graphs a replay ran (their calls, counted)."""
    calls = [0]
    real = realize._launch_graphs
    def counted(plan, ready):
        made = real(plan, ready)
        if made:
            for seg in made[2]:
                if type(seg) is tuple:
                    graph = seg[0]
                    class Counted(type(graph)):
                        def __call__(self, allocations):
                            calls[0] += 1
                            return super().__call__(allocations)
                    graph.__class__ = Counted
        return made
    monkeypatch.setattr(realize, "_launch_graphs", counted)
    return calls

def _mlp(din: int, dh: int):
    # (seeded: Adam's first steps move a weight whose gradient sums to nearly zero by a whole step either way, so
    # some initial weights leave one element beyond the tolerance of torch's, whose sums run in another order)
    Tensor.manual_seed(0)
    l1, l2 = nn.Linear(din, dh), nn.Linear(dh, 10)
    tm = torch.nn.Sequential(torch.nn.Linear(din, dh), torch.nn.ReLU(), torch.nn.Linear(dh, 10))
    with torch.no_grad():
        for p, q in zip([l1.weight, l1.bias, l2.weight, l2.bias], tm.parameters()): q.copy_(torch.tensor(p.numpy()))
    return l1, l2, tm

@needs_pool
def test_eager_adam_steps_match_torch_through_launch_graphs(graph_calls):
    l1, l2, tm = _mlp(256, 128)
    opt = nn.optim.Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-2)
    topt = torch.optim.Adam(tm.parameters(), lr=1e-2)
    data = np.random.default_rng(11)   # (its own: the module's generator's state depends on the tests run before)
    for step in range(6):
        x, y = data.standard_normal((64, 256)).astype(np.float32), data.integers(0, 10, 64).astype(np.int32)
        with Tensor.train():
            opt.zero_grad()
            loss = l2(l1(Tensor(x)).relu()).sparse_categorical_crossentropy(Tensor(y))
            loss.backward()
            opt.step()
        topt.zero_grad()
        tloss = F.cross_entropy(tm(torch.tensor(x)), torch.tensor(y).long())
        tloss.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tloss.item(), rtol=1e-4, err_msg=f"loss of step {step}")
    np.testing.assert_allclose(l1.weight.numpy(), tm[0].weight.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l2.bias.numpy(), tm[2].bias.detach().numpy(), rtol=1e-4, atol=1e-5)
    # steps 1 and 2 schedule and lower the structure, step 3 replays kernel by kernel and makes the graph
    assert graph_calls[0] >= 3

def _chain(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Kernels on CPU, a copy to CPU:1 (a kernel without a prepared launch), kernels on CPU:1."""
    h = (a @ b).relu() + 1
    moved = h.to("CPU:1")
    return h.sum(0), (moved * 2).exp2().sum(1) + moved.max(1)

@needs_pool
def test_copy_between_graphed_kernels_keeps_order_and_values(graph_calls):
    for _ in range(6):
        an, bn = _arr(96, 128), _arr(128, 80)
        a, b = Tensor(an).realize(), Tensor(bn).realize()
        s, t = _chain(a, b)
        Tensor.realize(s, t)
        h = np.maximum(an @ bn, 0) + 1
        np.testing.assert_allclose(s.numpy(), h.sum(0), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(t.numpy(), np.exp2(h * 2).sum(1) + h.max(1), rtol=1e-4)
    assert graph_calls[0] >= 2

@needs_pool
def test_launch_graph_counts_the_work_of_kernel_by_kernel_launches(monkeypatch):
    a, b = Tensor(_arr(128, 256)).realize(), Tensor(_arr(256, 192)).realize()
    def counted(times: int) -> tuple[int, int, int]:
        for _ in range(3): ((a @ b).relu().sum(1) + (a * 2).sum(1)).realize()   # (lowered, launches prepared)
        Device["CPU"].synchronize()
        k, ops, mem = GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem
        outs = [((a @ b).relu().sum(1) + (a * 2).sum(1)).realize() for _ in range(times)]
        for out in outs:
            np.testing.assert_allclose(out.numpy(), np.maximum(a.numpy() @ b.numpy(), 0).sum(1) +
                                       (a.numpy() * 2).sum(1), rtol=1e-4, atol=1e-3)
        return GlobalCounters.kernel_count - k, GlobalCounters.global_ops - ops, GlobalCounters.global_mem - mem
    graphed = counted(4)
    monkeypatch.setattr(realize, "_launch_graphs", lambda plan, ready: None)
    from fusegrad.schedule.kernelize import schedule_cache
    schedule_cache.clear()   # (a new plan, whose launches are never graphed)
    assert counted(4) == graphed and graphed[0] >= 8

@needs_pool
def test_launch_knobs_changed_between_replays_fall_back_and_match_numpy(graph_calls):
    # each value of the launch knobs has launches (and graphs) of its own; with CPU_ASYNC=0 nothing is queued, so no
    # launch is prepared and the kernels run one by one
    from fusegrad import Context
    an, bn = _arr(96, 128), _arr(128, 80)
    a, b = Tensor(an).realize(), Tensor(bn).realize()
    want = (np.maximum(an @ bn, 0) + 1).sum(0)
    counts = []
    for knobs in [{}, {"CPU_THREADS": 1}, {"CPU_ASYNC": 0}, {}, {"CPU_THREADS": 1}, {"CPU_ASYNC": 0}] * 2:
        with Context(**knobs):
            for _ in range(4):
                s, t = _chain(a, b)
                Tensor.realize(s, t)
                np.testing.assert_allclose(s.numpy(), want, rtol=1e-4, atol=1e-3)
        counts.append(graph_calls[0])
    # the graphs ran under the default knobs and CPU_THREADS=1, never with CPU_ASYNC=0
    assert counts[0] > 0 and counts[1] > counts[0] and counts[2] == counts[1] and counts[-1] == counts[-2]
