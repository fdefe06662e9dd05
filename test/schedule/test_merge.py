"""Kernels with several outputs: a kernel read by another at loops they share is folded into it, element for element
(the optimizer updates) or across a reduction (a row's statistic stored once per row beside the row), and the merges
that would reorder reads and writes, or compute a value once per iteration of a loop, are refused. Values against
numpy and torch."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, nn
from fusegrad.engine.realize import run_schedule
from fusegrad.uop.ops import Ops

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

# *** across a reduction: a value stored at fewer loops than the kernel runs ***

def _loops_of_stores(sched) -> list[list[int]]:
    """For each compiled kernel, the number of loops each store's index depends on."""
    from fusegrad.uop.ops import Ops
    return [[len({r for r in st.src[0].src[1].toposort() if r.op is Ops.RANGE}) for st in si.ast.src]
            for si in sched if si.ast.op is Ops.SINK]

def test_row_statistic_stored_beside_the_row_and_read_at_fewer_loops():
    # m is read row by row by y and at its own loop by z: y's kernel computes it once per row and stores it there,
    # and z (fewer loops than y's kernel) is computed in that kernel too, once per row
    A = rng.standard_normal((16, 64)).astype(np.float32)
    x = Tensor(A)
    m = x.mean(1)
    y = x - m.reshape(16, 1)
    z = m * 3 + 1
    sched = Tensor.schedule(y, z, m)
    assert [sorted(k) for k in _loops_of_stores(sched)] == [[1, 1, 2]]
    run_schedule(sched)
    np.testing.assert_allclose(m.numpy(), A.mean(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), A - A.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(z.numpy(), A.mean(1) * 3 + 1, rtol=1e-5, atol=1e-6)

def test_running_statistic_updated_in_the_kernel_of_the_statistic():
    # the running mean's update reads the mean at its one loop: it runs in the loops of the kernel that computes the
    # mean for y, once per row, and reads its buffer's old value before it stores the new one
    A = rng.standard_normal((16, 64)).astype(np.float32)
    x = Tensor(A)
    m = x.mean(1)
    y = x - m.reshape(16, 1)
    R = rng.standard_normal(16).astype(np.float32)
    running = Tensor(R).contiguous().realize()
    running.assign(running * 0.9 + m * 0.1)
    sched = Tensor.schedule(y, running)
    assert [sorted(k) for k in _loops_of_stores(sched)] == [[1, 1, 2]]
    run_schedule(sched)
    np.testing.assert_allclose(running.numpy(), R * 0.9 + A.mean(1) * 0.1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), A - A.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)

def test_statistic_along_a_middle_axis_reorders_its_readers_loops():
    # a channel's mean, read by every element of (N, C, H, W): the elementwise reader runs its channel loop outermost
    # so the mean is computed once per channel
    X = rng.standard_normal((4, 6, 5, 7)).astype(np.float32)
    x = Tensor(X)
    mean = x.mean((0, 2, 3))
    y = x - mean.reshape(1, 6, 1, 1)
    sched = Tensor.schedule(y, mean)
    assert _loops_of_stores(sched) == [[4, 1]]
    run_schedule(sched)
    np.testing.assert_allclose(mean.numpy(), X.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), X - X.mean((0, 2, 3), keepdims=True), rtol=1e-5, atol=1e-5)

def test_no_merge_into_a_reduction_loop():
    # each stage is read inside the next one's reduction loop: computed there, it would run once per iteration
    A = rng.standard_normal((32, 32)).astype(np.float32)
    a = Tensor(A)
    s1 = (a + 1).sum(0)
    s2 = (a * s1).sum(1)
    sched = Tensor.schedule(s2, s1)
    assert len(sched) == 2 and _loops_of_stores(sched)[-1] == [1]
    run_schedule(sched)
    np.testing.assert_allclose(s2.numpy(), (A * (A + 1).sum(0)).sum(1), rtol=1e-4)

def test_a_long_contraction_keeps_its_kernel():
    # a matmul of 512 products per output stays alone (the optimizer tiles it); a short one takes its reader along
    for k, kernels in ((512, [1, 1]), (64, [2])):
        A, B = rng.standard_normal((32, k)).astype(np.float32), rng.standard_normal((k, 16)).astype(np.float32)
        h = Tensor(A) @ Tensor(B)
        r = h.relu() * 2
        sched = Tensor.schedule(r, h)
        assert _stores(sched) == kernels, k
        run_schedule(sched)
        np.testing.assert_allclose(h.numpy(), A @ B, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(r.numpy(), np.maximum(A @ B, 0) * 2, rtol=1e-4, atol=1e-4)

def test_channel_statistic_in_gpu_style_kernels(monkeypatch):
    # on the PYTHON device's work-group emulation: the merged kernel's channel loop is launched over work-groups, the
    # loops the statistics are broadcast along (batch and image) are shared by a group's work-items, and one
    # work-item stores the statistics
    from fusegrad.device import Device
    from fusegrad.renderer.python import PythonRenderer
    monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(gpu=True))
    X = rng.standard_normal((2, 6, 4, 20)).astype(np.float32)
    x = Tensor(X, device="PYTHON")
    mean = x.mean((0, 2, 3))
    var = (x - mean.reshape(1, 6, 1, 1)).square().mean((0, 2, 3))
    y = (x - mean.reshape(1, 6, 1, 1)) * (var.reshape(1, 6, 1, 1) + 1e-5).rsqrt()
    sched = Tensor.schedule(y, mean, var)
    assert len(_stores(sched)) == 1
    run_schedule(sched)
    ref_mean, ref_var = X.mean((0, 2, 3), keepdims=True), X.var((0, 2, 3), keepdims=True)
    np.testing.assert_allclose(mean.numpy(), ref_mean.reshape(6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var.numpy(), ref_var.reshape(6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y.numpy(), (X - ref_mean) / np.sqrt(ref_var + 1e-5), rtol=1e-4, atol=1e-5)

def test_in_place_update_read_by_a_broadcast_keeps_its_own_kernel(monkeypatch):
    # x8 += x3, read by a (6, 4, 7) output along its last loop: merged, the new x8 would be stored once per column while
    # every element of the column reads the old one; on a GPU's work-items the store races with those reads (the
    # PYTHON emulation runs the work-items one after another, so the later ones read the new value)
    from fusegrad.device import Device
    from fusegrad.renderer.python import PythonRenderer
    monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(gpu=True))
    X2, X3, X8 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4, 1), (1, 7), (1, 7)))
    for device in ("CPU", "PYTHON"):
        x2, x3, x8 = (Tensor(a, device=device) for a in (X2, X3, X8))
        new = x8.assign(x3 + x8)
        out, flipped = x2 - new, new.flip((0, 1))
        Tensor.realize(out, flipped)
        np.testing.assert_allclose(out.numpy(), X2 - (X3 + X8), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(flipped.numpy(), (X3 + X8)[::-1, ::-1], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(x8.numpy(), X3 + X8, rtol=1e-6, atol=1e-6)

def _gpu_style(monkeypatch) -> None:
    from fusegrad.device import Device
    from fusegrad.renderer.python import PythonRenderer
    monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(gpu=True))

def test_scalar_kernels_merge_with_their_scalar_readers(monkeypatch):
    # an optimizer's step counter and its bias correction, a loss's count of labels and its scale: kernels without
    # loops, each read by another such kernel, are one kernel with both stores (on a GPU's emulation too, where
    # neither reduces)
    _gpu_style(monkeypatch)
    Y = rng.integers(-1, 10, 128).astype(np.int32)
    for device in ("CPU", "PYTHON"):
        c = Tensor([0.5], device=device).contiguous().realize()
        lr = Tensor([0.01], device=device).contiguous().realize()
        new = c.assign(c * 0.9)
        step = -(lr / (1.0 - new))
        sched = Tensor.schedule(new, step)
        assert _stores(sched) == [2], device
        run_schedule(sched)
        np.testing.assert_allclose(c.numpy(), [np.float32(0.5) * np.float32(0.9)], rtol=1e-6)
        np.testing.assert_allclose(step.numpy(), [-0.01 / (1 - 0.45)], rtol=1e-5)
        y = Tensor(Y, device=device)
        count = (y != -1).sum()
        scale = -(1.0 / count.float())
        sched = Tensor.schedule(count, scale)
        # (a scalar's reduction on a GPU-style device is spread over a work-group: it keeps its kernel there)
        assert _stores(sched) == ([2] if device == "CPU" else [1, 1]), device
        run_schedule(sched)
        assert count.item() == int((Y != -1).sum())
        np.testing.assert_allclose(scale.numpy(), -1.0 / (Y != -1).sum(), rtol=1e-6)

def test_scalar_reduction_read_inside_another_scalar_reduction(monkeypatch):
    # the sum, then the sum of squares around the mean: one kernel on the CPU, the first reduction computed once
    # before the second's loop (its value is the same at every iteration); two on a GPU-style device, where each
    # reduction is spread over a work-group's threads
    _gpu_style(monkeypatch)
    X = rng.standard_normal(64).astype(np.float32)
    for device in ("CPU", "PYTHON"):
        x = Tensor(X, device=device)
        s = x.sum()
        v = ((x - s / 64) ** 2).sum()
        sched = Tensor.schedule(s, v)
        assert _stores(sched) == ([2] if device == "CPU" else [1, 1]), device
        run_schedule(sched)
        np.testing.assert_allclose(s.numpy(), X.sum(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v.numpy(), ((X - X.mean()) ** 2).sum(), rtol=1e-5)

def test_big_scalar_reductions_keep_their_kernels():
    # a sum over more than SCALAR_REDUCE_MAX elements stays a kernel of its own (it may be split over the cores)
    from fusegrad.schedule.merge import SCALAR_REDUCE_MAX
    X = rng.standard_normal(4 * SCALAR_REDUCE_MAX).astype(np.float32)
    x = Tensor(X)
    s = x.sum()
    r = s * 2 + 1
    sched = Tensor.schedule(s, r)
    assert len(_stores(sched)) >= 2 and max(_stores(sched)) == 1
    run_schedule(sched)
    np.testing.assert_allclose(r.numpy(), X.astype(np.float64).sum() * 2 + 1, rtol=1e-4)

def test_mlp_adam_step_scalars_share_kernels():
    # the 784-512-10 MLP's Adam step at batch 128 (bench_eager's): b1^t with Adam's step size and b2^t with its bias
    # correction in one kernel, the labels' count with the loss's scale (16 kernels before kernels without loops
    # merged), against torch
    X, Y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    t1, t2 = torch.nn.Linear(20, 16), torch.nn.Linear(16, 5)
    for a, b in ((l1, t1), (l2, t2)):
        b.weight.data, b.bias.data = torch.tensor(a.weight.numpy()), torch.tensor(a.bias.numpy())
    opt = nn.optim.Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-2)
    topt = torch.optim.Adam([*t1.parameters(), *t2.parameters()], lr=1e-2)
    with Tensor.train():
        for step in range(2):
            opt.zero_grad()
            loss = l2(l1(Tensor(X)).relu()).sparse_categorical_crossentropy(Tensor(Y))
            loss.backward()
            sched = Tensor.schedule(*opt.schedule_step(), loss)
            if step == 0: assert len(sched) == 12 and sorted(_stores(sched))[-1] == 4, _stores(sched)
            run_schedule(sched)
            topt.zero_grad()
            tloss = torch.nn.functional.cross_entropy(t2(t1(torch.tensor(X)).relu()), torch.tensor(Y).long())
            tloss.backward()
            topt.step()
            np.testing.assert_allclose(loss.numpy(), tloss.item(), rtol=1e-4)
            # (Adam's update of a weight whose gradient is near 0 is m / sqrt(v) of two rounded tiny numbers: a few
            # of the 400k weights differ from torch's by up to a few percent of an update, lr = 1e-2)
            for a, b in ((l1, t1), (l2, t2)):
                np.testing.assert_allclose(a.weight.numpy(), b.weight.detach().numpy(), rtol=1e-4, atol=1e-3)
                np.testing.assert_allclose(a.bias.numpy(), b.bias.detach().numpy(), rtol=1e-4, atol=1e-3)

def test_scalar_kernels_side_by_side(monkeypatch):
    # two step counters and what each makes, none reading another's: one kernel storing all four (on a GPU's emulation
    # too)
    _gpu_style(monkeypatch)
    for device in ("CPU", "PYTHON"):
        c1, c2 = (Tensor([v], device=device).contiguous().realize() for v in (0.5, 0.25))
        n1, n2 = c1.assign(c1 * 0.9), c2.assign(c2 * 0.999)
        a, b = 1.0 - n1, (1.0 - n2).sqrt().reciprocal()
        sched = Tensor.schedule(n1, n2, a, b)
        assert _stores(sched) == [4], device
        run_schedule(sched)
        f32 = np.float32
        np.testing.assert_allclose(c1.numpy(), [f32(0.5) * f32(0.9)], rtol=1e-6)
        np.testing.assert_allclose(c2.numpy(), [f32(0.25) * f32(0.999)], rtol=1e-6)
        np.testing.assert_allclose(a.numpy(), [1 - 0.45], rtol=1e-6)
        np.testing.assert_allclose(b.numpy(), [1 / np.sqrt(1 - 0.25 * 0.999)], rtol=1e-6)

def test_scalar_kernels_apart_when_one_waits_for_the_other():
    # c's update, then a kernel over 64 elements reading it, then a sum of that: the sum waits for c's kernel through
    # the one between them, so the two scalar kernels can't be one
    X = rng.standard_normal(64).astype(np.float32)
    c = Tensor([0.5]).contiguous().realize()
    new = c.assign(c * 0.9)
    y = (Tensor(X) * new).contiguous()
    t = y.sum()
    sched = Tensor.schedule(new, y, t)
    assert len(sched) == 3
    run_schedule(sched)
    np.testing.assert_allclose(y.numpy(), X * np.float32(0.45), rtol=1e-6)
    np.testing.assert_allclose(t.numpy(), (X * np.float32(0.45)).sum(), rtol=1e-5, atol=1e-6)


def test_empty_outputs_are_never_merged_into_a_kernel():
    # reductions over an empty axis (non-empty results) and results with no elements, in one schedule: a kernel that
    # stores to an empty buffer would run that store at its partner's loops, past the buffer's end
    e = Tensor.zeros(0, 3)
    outs = [e.prod(0), e.cumsum(0), e.var(0), e.logsumexp(0), e.sort(0)[0], e.any(0)]
    sched = Tensor.schedule(*outs)
    for si in sched:
        if si.ast.op is Ops.SINK:
            assert all(b.size > 0 for b in si.bufs[:len(si.ast.src)]), [b.size for b in si.bufs]
    run_schedule(sched)
    te = torch.zeros(0, 3)
    for o, want in zip(outs, [te.prod(0), te.cumsum(0), te.var(0), te.logsumexp(0), te.sort(0)[0], te.any(0)]):
        assert o.shape == tuple(want.shape)
        np.testing.assert_allclose(o.numpy(), want.numpy(), equal_nan=True)

@pytest.mark.parametrize("quick", [False, True])
def test_in_place_update_merged_beside_a_broadcast_output(quick, monkeypatch):
    # an in-place update (x4 += argmin) merged with a broadcast of the same argmin over a loop of 2 that the update's
    # store doesn't move with: the heuristic's upcast of that small loop is refused (its iterations read what the ones
    # before stored) and the kernel keeps the loop, instead of the refusal failing the realize (fuzz_jit seed 8420).
    # As a first call's quick program (every schedule's, here), its register tile can't become a loop either: nested
    # inside that loop of 2, the update would run twice (codegen/lower.py _rollable_tiles)
    from fusegrad.engine import realize
    from fusegrad.helpers import Context
    if quick:
        from fusegrad.schedule.kernelize import schedule_cache
        monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 1)
        monkeypatch.setattr(realize, "method_cache", {})   # (its kernels made anew, not the plain variant's)
        schedule_cache.clear()
    rng = np.random.default_rng(8420)
    for dt in (np.int32, np.float32):
        a = rng.integers(-50, 50, (4, 6, 3)).astype(dt)
        x1, x4 = Tensor(a).realize(), Tensor(np.full((4, 3), 7, dt)).realize()
        x6 = Tensor(np.ones((2, 1, 3), dt)).realize()
        v3 = x1.argmin(axis=1)
        x4.assign(v3 + x4)
        y = x6 + v3
        with Context(QUICK_CODEGEN=int(quick)): Tensor.realize(y, x4)
        want = torch.from_numpy(a).argmin(dim=1).numpy()
        np.testing.assert_array_equal(x4.numpy(), want + 7)
        np.testing.assert_array_equal(y.numpy(), np.ones((2, 1, 3)) + want)
