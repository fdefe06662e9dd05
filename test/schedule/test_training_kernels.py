"""Kernel counts of forward+backward steps with normalizations (kernels with several outputs across a reduction: the
statistics a backward reads are stored by the kernel that computes them for the forward's output), and an optimizer
step, each run and checked against torch."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, nn
from fusegrad.engine.realize import run_schedule
from fusegrad.uop.ops import Ops

rng = np.random.default_rng(7)

def _kernels(sched) -> list[int]:
    """The number of outputs of each compiled kernel of a schedule."""
    return [len(si.ast.src) for si in sched if si.ast.op is Ops.SINK]

def _check(pairs, rtol=1e-4, atol=1e-4):
    for ours, ref in pairs: np.testing.assert_allclose(ours.numpy(), ref.detach().numpy(), rtol=rtol, atol=atol)

def layernorm_step():
    X, W = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    x, w = Tensor(X, requires_grad=True), Tensor(W, requires_grad=True)
    y = x.layernorm() * w
    y.sum().backward()
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    ty = torch.nn.functional.layer_norm(tx, (512,), eps=1e-5) * tw
    ty.sum().backward()
    return [y, x.grad, w.grad], [ty, tx.grad, tw.grad]

def batchnorm_step():
    X = rng.standard_normal((8, 16, 32, 32)).astype(np.float32)
    bn, tbn = nn.BatchNorm2d(16), torch.nn.BatchNorm2d(16)
    Tensor.realize(bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked)
    x, tx = Tensor(X, requires_grad=True), torch.tensor(X, requires_grad=True)
    before, Tensor.training = Tensor.training, True
    try: y = bn(x)
    finally: Tensor.training = before
    (y * y).sum().backward()
    ty = tbn(tx)
    (ty * ty).sum().backward()
    return [y, x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var], \
        [ty, tx.grad, tbn.weight.grad, tbn.bias.grad, tbn.running_mean, tbn.running_var]

def softmax_step():
    X, D = rng.standard_normal((64, 100)).astype(np.float32), rng.standard_normal((64, 100)).astype(np.float32)
    x, tx = Tensor(X, requires_grad=True), torch.tensor(X, requires_grad=True)
    y = x.softmax(1)
    (y * Tensor(D)).sum().backward()
    ty = tx.softmax(1)
    (ty * torch.tensor(D)).sum().backward()
    return [y, x.grad], [ty, tx.grad]

# (a step, its kernels: the outputs of each, in schedule order). Before kernels stored more than one buffer across a
# reduction these were 8, 11 and 6 kernels, one output each.
STEPS = {
    # the row kernel stores y with the mean and inverse std (and a sum of the backward); the input gradient's kernel
    # computes the sums over the row it reads itself; the weight's gradient sums over the rows: a kernel of its own
    "layernorm 256x512 fwd+bwd": (layernorm_step, [4, 1, 1]),
    # the output with the channel statistics, the input gradient with its sums; the parameters' gradients and the
    # running statistics (at most 4 outputs a kernel) on their own
    "batchnorm2d 8x16x32x32 fwd+bwd": (batchnorm_step, [4, 3, 1, 1, 1, 1]),
    # the forward with its max and sum, then the gradient, computing the backward's sum over the row itself
    "softmax 64x100 fwd+bwd": (softmax_step, [3, 1]),
}

@pytest.mark.parametrize("name", list(STEPS))
def test_training_step_kernels(name):
    build, kernels = STEPS[name]
    ours, refs = build()
    sched = Tensor.schedule(*ours)
    assert _kernels(sched) == kernels, f"{name}: kernels with {_kernels(sched)} outputs, expected {kernels}"
    run_schedule(sched)
    _check(zip(ours, refs), rtol=1e-3, atol=1e-3)

def test_adam_step_is_one_kernel_per_parameter():
    # a linear layer with a layernorm: the gradients, then each parameter with its two moments in one kernel
    X, T = rng.standard_normal((32, 24)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32)
    lin, tlin = nn.Linear(24, 16), torch.nn.Linear(24, 16)
    tlin.weight.data[:], tlin.bias.data[:] = torch.tensor(lin.weight.numpy()), torch.tensor(lin.bias.numpy())
    opt = nn.optim.Adam([lin.weight, lin.bias], lr=1e-2)
    topt = torch.optim.Adam(tlin.parameters(), lr=1e-2)
    for _ in range(2):
        (lin(Tensor(X)).layernorm() * Tensor(T)).sum().backward()
        Tensor.realize(lin.weight.grad, lin.bias.grad)
        sched = Tensor.schedule(*opt.schedule_step())
        # two parameters: a kernel each, storing the parameter and its moments; the rest are the step's scalars
        assert sorted(_kernels(sched))[-2:] == [3, 3] and sum(n == 3 for n in _kernels(sched)) == 2
        run_schedule(sched)
        topt.zero_grad()
        (torch.nn.functional.layer_norm(tlin(torch.tensor(X)), (16,), eps=1e-5) * torch.tensor(T)).sum().backward()
        topt.step()
        opt.zero_grad()
    _check([(lin.weight, tlin.weight), (lin.bias, tlin.bias)], rtol=1e-4, atol=1e-5)

def test_explain_names_the_statistics_stored_with_the_output():
    ours, _ = layernorm_step()
    lines = ours[0].explain(*ours[1:]).splitlines()
    assert lines[0] == "3 kernels" and lines[1] == "kernel 1: reduce, 4 outputs merged into one kernel"
    # the row's statistics (256x1) are stored where they are computed; the output itself is not
    notes = [(desc, "stored where it is computed" in cut) for desc, cut in zip(lines, lines[1:])
             if desc.startswith("  ") and cut.startswith("    cut:")]
    assert any("256x1" in d and stored for d, stored in notes)
    assert all(stored == ("256x1" in d) for d, stored in notes)

@pytest.mark.parametrize("conv", [True, False])
def test_sgd_update_merges_only_where_the_gradient_stores_contiguously(conv):
    """A short contraction's gradient merges its parameter's SGD update unless it stores along no long contiguous loop:
    a 3x3 convolution's weight gradient over 2x2 images (contiguous only along its 3 columns, so vectorized along the
    output channels: the update would read and write the weights through gathers and scatters) stays apart from its
    update; a Linear layer's (contiguous along its 24 inputs) stores the weights and momentum in the same kernel."""
    shape = (16, 24, 3, 3) if conv else (16, 24)
    W = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    X = rng.standard_normal((4, 24, 2, 2) if conv else (4, 24)).astype(np.float32)
    w, tw = Tensor(W, requires_grad=True), torch.tensor(W, requires_grad=True)
    opt, topt = nn.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    f = (lambda x, w: x.conv2d(w, padding=1)) if conv else (lambda x, w: x @ w.T)
    tf = (lambda x, w: torch.nn.functional.conv2d(x, w, padding=1)) if conv else (lambda x, w: x @ w.T)
    for _ in range(2):
        opt.zero_grad()
        f(Tensor(X), w).square().sum().backward()
        sched = Tensor.schedule(*opt.schedule_step())
        # (the last contraction is the weight gradient's: the forward's comes first)
        gradient = [si for si in sched if si.ast.op is Ops.SINK and any(u.op is Ops.REDUCE for u in si.ast.toposort())]
        assert (len(gradient[-1].ast.src) == 1) == conv, _kernels(sched)
        run_schedule(sched)
        topt.zero_grad()
        tf(torch.tensor(X), tw).square().sum().backward()
        topt.step()
    _check([(w, tw)], rtol=1e-4, atol=1e-5)
