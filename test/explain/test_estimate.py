"""Tensor.estimate: kernels, FLOPs and bytes from the kernels' ASTs, and the planned peak memory equal to the peak the
allocator reaches when the schedule runs."""
from __future__ import annotations
from fusegrad import GlobalCounters, Tensor
from fusegrad.device import Buffer
from fusegrad.engine.explain import Roofline
from fusegrad.nn import Linear
from fusegrad.nn.optim import Adam

def _measured_peak(fn) -> int:
    """The most bytes Buffers held at once while fn ran."""
    peak = [GlobalCounters.mem_used]
    plain = Buffer.allocate
    def allocate(self, opaque=None):
        ret = plain(self, opaque)
        peak[0] = max(peak[0], GlobalCounters.mem_used)
        return ret
    Buffer.allocate = allocate
    try: fn()
    finally: Buffer.allocate = plain
    return peak[0]

def _step_tensors(l1, l2, opt, x, y) -> list[Tensor]:
    with Tensor.train():
        opt.zero_grad()
        loss = l2(l1(x).relu()).sparse_categorical_crossentropy(y)
        loss.backward()
        return [loss, *opt.schedule_step()]

def test_peak_memory_of_a_training_step_is_the_allocators():
    l1, l2 = Linear(64, 128), Linear(128, 10)
    opt = Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    x, y = Tensor.randn(32, 64).realize(), Tensor([i % 10 for i in range(32)]).realize()
    for step in range(3):
        outs = _step_tensors(l1, l2, opt, x, y)
        est = outs[0].estimate(*outs[1:], predict=False)
        assert est.kernels > 3 and est.flops > 2 * 32 * 64 * 128 and est.bytes > 64 * 128 * 4
        assert _measured_peak(lambda: Tensor.realize(*outs)) == est.peak_memory, f"step {step}"

def test_counts_of_a_matmul():
    a, b = Tensor.randn(64, 32).realize(), Tensor.randn(32, 16).realize()
    est = (a @ b).estimate(predict=False)
    assert est.kernels == 1
    # one multiply and one add per product
    assert est.flops == 2 * 64 * 32 * 16
    assert est.bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert est.peak_memory == GlobalCounters.mem_used + 4 * 64 * 16

def test_predicted_time_from_a_roofline():
    a = Tensor.randn(64, 64).realize()
    roof = Roofline(flops_per_s=1e9, bytes_per_s=1e9, launch_s=1e-5)
    est = (a @ a).estimate()
    assert est.predicted_s is not None and est.predicted_s > 0
    from fusegrad.engine.explain import estimate
    from fusegrad.tensor import _shards
    mine = estimate(_shards([a @ a]), [], 0, roof)
    assert mine.predicted_s == max(mine.flops / 1e9, mine.bytes / 1e9) + 1e-5
