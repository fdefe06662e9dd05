"""TinyJit(prune=True) runs the kernels that don't depend on the inputs once (a Winograd convolution's weight transform,
a constant subgraph), and keeps every kernel whose result can change; a replay reuses the memory of outputs the caller
dropped and skips the checks of arguments it has seen. References: NumPy and torch."""
from __future__ import annotations
import numpy as np
import torch
from fusegrad import Tensor, TinyJit
from fusegrad.schedule import create as _create
import fusegrad.tensor.nn as _nn

rng = np.random.default_rng(1)

def _r(*shape):
    return rng.standard_normal(shape).astype(np.float32)

def _torch_conv(x, w, stride):
    return torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=stride, padding=1).numpy()

def test_prune_runs_a_winograd_weight_transform_once(monkeypatch):
    # (the sizes where conv2d takes Winograd's form lowered to this small convolution)
    monkeypatch.setattr(_nn, "WINO_MIN_CHANNELS", 4)
    monkeypatch.setattr(_nn, "WINO_MIN_TILES", 1)
    monkeypatch.setattr(_nn, "WINO_MIN_FLOPS", 0)
    w = _r(16, 4, 3, 3)
    wt = Tensor(w).realize()
    plain = TinyJit(lambda x: x.conv2d(wt, padding=1).relu().realize())
    pruned = TinyJit(lambda x: x.conv2d(wt, padding=1).relu().realize(), prune=True)
    for _ in range(5):
        x = _r(2, 4, 9, 9)
        want = np.maximum(_torch_conv(x, w, 1), 0)
        for f in (plain, pruned):
            np.testing.assert_allclose(f(Tensor(x)).numpy(), want, rtol=1e-4, atol=1e-4)
    # the transform of the weights (G w G^T, read by the products of every call) is the kernel that goes
    assert len(pruned.captured) == len(plain.captured) - 1

def test_pruned_result_keeps_its_memory_when_its_storage_was_shared(monkeypatch):
    # the constant (w * 2) is dead after the matmul, so the memory planner hands its storage to a later intermediate of
    # the same size: a replay must still read the constant, not what that intermediate left there
    shared = []
    plan = _create.plan_memory
    def counted(items, keep):
        n = plan(items, keep)
        shared.append(n)
        return n
    monkeypatch.setattr(_create, "plan_memory", counted)
    w = _r(8, 8)
    wt = Tensor(w).realize()

    def f(x):
        t = (x @ (wt * 2).contiguous()).contiguous()
        u = (t.exp() * 0.5).contiguous()
        return (u @ t.T).sum(1).realize()
    jf = TinyJit(f, prune=True)
    for _ in range(5):
        x = _r(8, 8) * 0.1
        t = x @ (w * 2)
        np.testing.assert_allclose(jf(Tensor(x)).numpy(), ((np.exp(t) * 0.5) @ t.T).sum(1), rtol=1e-4, atol=1e-5)
    assert any(shared), "the planner shared no storage: the case isn't exercised"
    assert len(jf.captured) == 3

def test_prune_keeps_state_updates_and_what_reads_updated_state():
    s = Tensor(np.zeros(4, np.float32)).contiguous().realize()

    def f(x):
        twice = (s * 2).realize()   # a kernel of its own that reads only s, which a later kernel updates
        out = (x + twice).realize()
        s.assign(s + x).realize()
        return out, s
    jf = TinyJit(f, prune=True)
    ref = np.zeros(4, np.float32)
    for i in range(6):
        x = np.full(4, float(i + 1), np.float32)
        out, state = jf(Tensor(x))
        np.testing.assert_allclose(out.numpy(), x + 2 * ref)
        ref = ref + x
        np.testing.assert_allclose(state.numpy(), ref)

def test_dropped_outputs_memory_is_reused_and_held_outputs_are_not_overwritten():
    f = TinyJit(lambda x: (x * 2 + 1).realize())
    xs = [_r(6) for _ in range(8)]
    for x in xs[:3]: f(Tensor(x))
    buffers = []
    for x in xs[3:6]:
        out = f(Tensor(x))
        np.testing.assert_allclose(out.numpy(), x * 2 + 1)
        buffers.append(id(out.uop.base))
        del out
    assert len(set(buffers)) == 1, "an output nothing held got new memory"
    held = f(Tensor(xs[6]))
    lazy = held * 10   # a graph reading the output holds it too
    del held
    again = f(Tensor(xs[7]))
    np.testing.assert_allclose(lazy.numpy(), (xs[6] * 2 + 1) * 10, rtol=1e-6)
    np.testing.assert_allclose(again.numpy(), xs[7] * 2 + 1)

def test_the_same_input_tensor_again_sees_its_new_contents():
    f = TinyJit(lambda x: (x - 1).realize())
    x = Tensor(np.zeros(5, np.float32)).contiguous().realize()
    for i in range(6):
        x.assign(Tensor(np.full(5, float(i), np.float32))).realize()
        np.testing.assert_allclose(f(x).numpy(), np.full(5, i - 1.0))
    other = Tensor(np.arange(5, dtype=np.float32)).realize()
    np.testing.assert_allclose(f(other).numpy(), np.arange(5) - 1.0)
    np.testing.assert_allclose(f(x).numpy(), np.full(5, 4.0))
