"""Tensor.estimate: kernels, FLOPs and bytes from the kernels' ASTs, and the planned peak memory equal to the peak the
allocator reaches when the schedule runs."""
from __future__ import annotations
import pytest
from fusegrad import GlobalCounters, Tensor
from fusegrad.device import Buffer
from fusegrad.engine.explain import Roofline
from fusegrad.nn import Linear
from fusegrad.nn.optim import Adam

def _measured_peak(fn) -> int:
    """The most bytes Buffers held at once while fn ran."""
    peak = [GlobalCounters.mem_used]
    plain = Buffer.allocate
    def allocate(self, opaque=None, queued=False):
        ret = plain(self, opaque, queued)
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
    # a realize's own cost is counted once, whatever the kernels
    once = estimate(_shards([a @ a]), [], 0, Roofline(1e9, 1e9, 1e-5, realize_s=1e-3))
    assert once.predicted_s == pytest.approx(mine.predicted_s + 1e-3)

def test_a_cached_roofline_far_from_a_probe_is_measured_again(tmp_path, monkeypatch):
    import json
    from fusegrad.tensor import explain as tex
    monkeypatch.setattr(tex, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(tex, "_rooflines", {})
    # as if measured on a machine a thousand times slower (or while busy): the probe disagrees, so it is measured again
    slow = {"flops_per_s": 1e6, "bytes_per_s": 1e6, "launch_s": 1.0}
    (tmp_path / "roofline.json").write_text(json.dumps({"CPU": slow, "OTHER": slow}))
    r = tex.roofline("CPU")
    assert r.flops_per_s > 1e8 and r.bytes_per_s > 1e8 and r.launch_s < 0.01
    saved = json.loads((tmp_path / "roofline.json").read_text())
    assert saved["CPU"] == {"flops_per_s": r.flops_per_s, "bytes_per_s": r.bytes_per_s, "launch_s": r.launch_s,
                            "realize_s": r.realize_s, "node_s": r.node_s}
    assert saved["OTHER"] == slow
    # within the process the checked roofline is kept
    assert tex.roofline("CPU") is r and tex.cached_roofline("CPU") is r

def test_roofline_agreement_within_the_tolerance():
    from fusegrad.tensor.explain import ROOFLINE_TOLERANCE, _disagrees
    base = Roofline(1e10, 1e10, 1e-5)
    assert ROOFLINE_TOLERANCE == 2.0
    assert not _disagrees(base, Roofline(1.9e10, 0.6e10, 1.5e-5))
    assert _disagrees(base, Roofline(2.1e10, 1e10, 1e-5))
    assert _disagrees(base, Roofline(1e10, 0.45e10, 1e-5))
    assert _disagrees(base, Roofline(1e10, 1e10, 2.5e-5))
