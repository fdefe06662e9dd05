"""conv2d's gradients (a transposed convolution for the input, a window reduction for the weight) against torch for
strides, dilations, groups, asymmetric padding, 1-3 spatial dims, dropped edge rows; a gradient of a gradient; and the
speed-relevant structure: the input gradient of a 3x3 convolution is one vectorized kernel."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, Opt, OptOps

torch.set_num_threads(1)
CASES = [
    ((2, 4, 9, 9), (6, 4, 3, 3), dict(stride=2, padding=1)),
    ((2, 4, 10, 7), (6, 2, 3, 2), dict(groups=2, dilation=2, padding=(1, 2))),
    ((1, 3, 8), (5, 3, 4), dict(stride=3, padding=2)),          # the last input rows reach no window
    ((1, 2, 5, 5, 5), (3, 2, 2, 2, 2), dict(stride=(1, 2, 1))),
    ((2, 6, 8, 8), (6, 1, 3, 3), dict(groups=6, padding=1)),    # depthwise
    ((2, 3, 7, 7), (4, 3, 1, 1), dict(stride=2)),
    ((1, 2, 6, 6), (2, 2, 3, 3), dict(padding=[1, 0, 2, 1])),   # flat (left, right, top, bottom)
    # strided: the weight gradient reads the input split into its phases, the input gradient convolves per phase
    ((2, 4, 8, 8), (6, 4, 1, 1), dict(stride=2)),                # a downsampling 1x1
    ((2, 6, 9, 7), (6, 1, 3, 3), dict(groups=6, stride=2, padding=1)),   # depthwise
    ((1, 3, 11, 10), (4, 3, 5, 2), dict(stride=(3, 2), padding=(2, 1))),
    ((1, 2, 7, 7), (3, 2, 2, 2), dict(stride=2)),
]
TORCH_CONV = {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}

def _torch_padding(kw: dict, xt: torch.Tensor) -> tuple[dict, torch.Tensor]:
    if isinstance(kw.get("padding"), list):  # torch takes only symmetric padding: pad the input itself
        return {k: v for k, v in kw.items() if k != "padding"}, torch.nn.functional.pad(xt, kw["padding"])
    return kw, xt

@pytest.mark.parametrize("xs,ws,kw", CASES)
def test_gradients_match_torch(xs, ws, kw):
    rng = np.random.default_rng(len(xs) + sum(ws))
    X, W = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    x, w = Tensor(X, requires_grad=True), Tensor(W, requires_grad=True)
    out = x.conv2d(w, **kw)
    G = rng.standard_normal(out.shape).astype(np.float32)
    (out * Tensor(G)).sum().backward()
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    tkw, txp = _torch_padding(kw, tx)
    tout = TORCH_CONV[len(xs)](txp, tw, **tkw)
    (tout * torch.tensor(G)).sum().backward()
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-4)

def test_gradient_of_gradient_matches_torch():
    rng = np.random.default_rng(7)
    X, W = rng.standard_normal((2, 3, 6, 6)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    x, w = Tensor(X, requires_grad=True), Tensor(W, requires_grad=True)
    gx, = x.conv2d(w, stride=2, padding=1).square().sum().gradient(x)
    gw2, = gx.square().sum().gradient(w)
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    tgx, = torch.autograd.grad(torch.nn.functional.conv2d(tx, tw, stride=2, padding=1).square().sum(), tx,
                               create_graph=True)
    tgw2, = torch.autograd.grad(tgx.square().sum(), tw)
    np.testing.assert_allclose(gx.numpy(), tgx.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw2.numpy(), tgw2.numpy(), rtol=1e-3, atol=1e-3)

def test_input_gradient_is_one_vectorized_convolution():
    x, w = Tensor.rand(2, 16, 16, 16, requires_grad=True).realize(), Tensor.rand(16, 16, 3, 3).realize()
    g = Tensor.rand(2, 16, 16, 16).realize()
    gx, = (x.conv2d(w, padding=1) * g).sum().gradient(x)
    from fusegrad.codegen import get_program
    from fusegrad.device import Device
    (si,) = [si for si in gx.schedule() if si.ast.op.name == "SINK"][-1:]
    p = get_program(si.ast, Device["CPU"].renderer)
    assert OptOps.UPCAST in {o.op for o in p.applied_opts} and OptOps.UNROLL in {o.op for o in p.applied_opts}
    assert any(u.dtype.count > 1 for u in p.uops if u.op.name == "DEFINE_REG"), "accumulators are vectors"

def test_weight_gradient_vectorizes_its_image_rows():
    # the weight gradient sums over batch and image: its reduction is contiguous in both loads, so the image row is
    # the vector axis (a vector over output channels would store per lane and read strided, 5x slower)
    x, w = Tensor.rand(2, 16, 16, 16).realize(), Tensor.rand(16, 16, 3, 3, requires_grad=True).realize()
    g = Tensor.rand(2, 16, 16, 16).realize()
    gw, = (x.conv2d(w, padding=1) * g).sum().gradient(w)
    np.testing.assert_allclose(gw.numpy(), torch.nn.grad.conv2d_weight(
        torch.tensor(x.numpy()), (16, 16, 3, 3), torch.tensor(g.numpy()), padding=1).numpy(), rtol=1e-4, atol=1e-3)
    gw, = (x.conv2d(w, padding=1) * g).sum().gradient(w)
    from fusegrad.codegen import get_program
    from fusegrad.device import Device
    (si,) = [si for si in gw.schedule() if si.ast.op.name == "SINK"][-1:]
    p = get_program(si.ast, Device["CPU"].renderer)
    vector = p.applied_opts[0]
    assert vector.op is OptOps.UPCAST and vector.axis >= Kernel(si.ast).first_reduce, p.applied_opts

@pytest.mark.parametrize("bs,cout", [(8, 32), (1, 64)])
def test_strided_stem_vectorizes_output_channels(bs: int, cout: int):
    # a stride-2 convolution over a 3-channel image: a vector along the output row would gather every other pixel of
    # the image; along the output channels it gathers the weights, a smaller buffer (at batch 1 by a little: 9408
    # floats against 12288), once per tile of pixels that reuses them
    x, w = Tensor.rand(bs, 3, 64, 64).realize(), Tensor.rand(cout, 3, 7, 7).realize()
    out = x.conv2d(w, padding=3, stride=2)
    from fusegrad.codegen import get_program
    from fusegrad.device import Device
    sched = [si for si in out.schedule() if si.ast.op.name == "SINK"]
    # one kernel, which copies each tile's weights with the output channels innermost (PACK), so the vector loads them
    # contiguously
    assert len(sched) == 1
    p = get_program(sched[0].ast, Device["CPU"].renderer)
    if Device["CPU"].renderer.simd_bytes >= 64:
        # (the output channels' loop is the first at batch 1: a loop of 1 is dropped)
        assert p.applied_opts[0] == Opt(OptOps.UPCAST, int(bs > 1), 16), p.applied_opts
        assert any(o.op is OptOps.PACK for o in p.applied_opts), p.applied_opts
        assert any(u.dtype.count == 16 for u in p.uops if u.op.name == "LOAD"), "weights loaded as vectors"
    ref = torch.nn.functional.conv2d(torch.tensor(x.numpy()), torch.tensor(w.numpy()), padding=3, stride=2)
    np.testing.assert_allclose(x.conv2d(w, padding=3, stride=2).numpy(), ref.numpy(), rtol=1e-4, atol=1e-4)
