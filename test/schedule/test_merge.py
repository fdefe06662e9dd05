"""Kernels with several outputs: an elementwise kernel read element for element by another is folded into it (the
optimizer updates), and the merges that would reorder reads and writes are refused. Values against numpy and torch."""
import numpy as np
import torch
from fusegrad import Tensor, nn
from fusegrad.engine.realize import run_schedule

rng = np.random.default_rng(3)

def _stores(sched) -> list[int]:
    return [len(si.ast.src) for si in sched if si.ast.op.name == "SINK"]

def test_adam_update_is_one_kernel_per_parameter():
    W, G = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    w = Tensor(W).realize()
    w.requires_grad_(True)
    opt = nn.optim.Adam([w], lr=1e-2)
    tw = torch.tensor(W, requires_grad=True)
    topt = torch.optim.Adam([tw], lr=1e-2)
    for step in range(3):
        w.grad, tw.grad = Tensor(G * (step + 1)).realize(), torch.tensor(G * (step + 1))
        sched = Tensor.schedule(*opt.schedule_step())
        # the moments and the parameter in one kernel (three outputs); the rest are the step's scalars
        assert sorted(_stores(sched))[-1] == 3 and sum(n > 1 and n != 3 for n in _stores(sched)) <= 2
        run_schedule(sched)
        topt.step()
        np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(opt.m[0].numpy(), topt.state[tw]["exp_avg"].numpy(), rtol=1e-5, atol=1e-6)

def test_sgd_momentum_update_is_one_kernel():
    W, G = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32)
    w = Tensor(W).realize()
    w.requires_grad_(True)
    opt = nn.optim.SGD([w], lr=0.1, momentum=0.9)
    tw = torch.tensor(W, requires_grad=True)
    topt = torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    for step in range(3):
        w.grad, tw.grad = Tensor(G - step).realize(), torch.tensor(G - step)
        sched = Tensor.schedule(*opt.schedule_step())
        assert _stores(sched) == [2]
        run_schedule(sched)
        topt.step()
        np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)

def test_producer_reading_an_overwritten_buffer_keeps_the_old_value():
    X = rng.standard_normal((4, 6)).astype(np.float32)
    x = Tensor(X).realize()
    y = (x * 2).contiguous()
    z = y + 1
    x.assign(x + 10)
    Tensor.realize(z, x, y)
    np.testing.assert_allclose(y.numpy(), X * 2, rtol=1e-6)
    np.testing.assert_allclose(z.numpy(), X * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose(x.numpy(), X + 10, rtol=1e-6)

def test_no_merge_across_a_kernel_between_them():
    # p reads m element for element and also s = m.sum(), which needs all of m first: m can't run inside p's kernel
    A = rng.standard_normal((16, 16)).astype(np.float32)
    m = (Tensor(A) * 2).contiguous()
    p = m + m.sum()
    sched = p.schedule()
    assert len(sched) >= 2
    run_schedule(sched)
    np.testing.assert_allclose(p.numpy(), A * 2 + (A * 2).sum(), rtol=1e-4, atol=1e-4)

def test_several_readers_and_a_chain():
    # a chain a -> b -> c of kernels read element for element folds into one kernel storing all three
    A = rng.standard_normal((3, 33)).astype(np.float32)
    a = (Tensor(A) + 1).contiguous()
    b = (a * 3).contiguous()
    c = b - a
    sched = Tensor.schedule(c, a, b)
    assert _stores(sched) == [3]
    run_schedule(sched)
    np.testing.assert_allclose(a.numpy(), A + 1, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), (A + 1) * 3, rtol=1e-6)
    np.testing.assert_allclose(c.numpy(), (A + 1) * 2, rtol=1e-5)

def test_merged_kernels_keep_their_changing_constants_apart():
    # Python numbers that change every call become kernel parameters of both kernels; merged, each keeps its own
    X = rng.standard_normal((4, 20)).astype(np.float32)
    for i in range(5):
        c1, c2 = 1.5 + i, -0.25 * i
        y = (Tensor(X) * c1).contiguous()
        z = y + c2
        Tensor.realize(z, y)
        np.testing.assert_allclose(y.numpy(), X * np.float32(c1), rtol=1e-6)
        np.testing.assert_allclose(z.numpy(), X * np.float32(c1) + np.float32(c2), rtol=1e-6)
