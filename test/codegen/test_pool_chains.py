"""Pools over channels-last data (the channels the vector, as after a strided convolution in an ONNX model's
channels-last region): the CPU heuristic upcasts the output row by up to 4, so that many windows' chains of maxes run
side by side; strided pools stored channel-first (their output row the vector) do so with their output rows. Values
against torch (padding, strides 1 and 2, an average pool, NaN and -inf propagation) and the opts on AVX2 and
AVX-512."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX2, AVX512, captured_asts, renderer_like

RS = np.random.default_rng(3)


def _channels_last(shape: tuple[int, int, int, int], specials: bool) -> tuple[np.ndarray, Tensor]:
    """An (N, C, H, W) array and a Tensor of it stored as (N, H, W, C), read through a channel-first view."""
    x = RS.standard_normal(shape).astype(np.float32)
    if specials:
        flat = x.reshape(-1)
        flat[RS.choice(flat.size, 40, replace=False)] = np.nan
        flat[RS.choice(flat.size, 40, replace=False)] = -np.inf
    return x, Tensor(np.ascontiguousarray(x.transpose(0, 2, 3, 1))).permute(0, 3, 1, 2)


def _stored_channels_last(t: Tensor) -> np.ndarray:
    """The values of `t`, an (N, C, H, W) result computed into an (N, H, W, C) buffer (as a region of an ONNX model
    stores it), in (N, C, H, W) order."""
    return t.permute(0, 2, 3, 1).contiguous().numpy().transpose(0, 3, 1, 2)


@pytest.mark.parametrize("shape,kernel,stride,padding", [((16, 16, 16, 16), 3, 2, 1), ((1, 32, 9, 12), 3, 1, 1),
                                                         ((2, 16, 7, 7), 2, 2, 0), ((3, 48, 10, 10), 3, 2, 0)])
@pytest.mark.parametrize("specials", [False, True])
def test_channels_last_max_pool_values(shape, kernel, stride, padding, specials):
    x, t = _channels_last(shape, specials)
    ours = _stored_channels_last(t.max_pool2d(kernel_size=kernel, stride=stride, padding=padding))
    ref = torch.nn.functional.max_pool2d(torch.tensor(x), kernel, stride, padding).numpy()
    np.testing.assert_array_equal(ours, ref)


def test_channels_last_avg_pool_values():
    x, t = _channels_last((4, 16, 8, 8), False)
    ours = _stored_channels_last(t.avg_pool2d(kernel_size=3, stride=1, padding=1, count_include_pad=True))
    ref = torch.nn.functional.avg_pool2d(torch.tensor(x), 3, 1, 1, count_include_pad=True).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_channels_last_pool_takes_chains(monkeypatch):
    """A stem pool over channels-last data (16 channels, a 3x3 window at stride 2; a shape no other test compiles):
    one vector of channels and 4 output pixels of a row side by side on AVX-512; on AVX2 the two vectors of its 16
    channels already are two chains, and the row stays a loop."""
    asts = captured_asts(monkeypatch)
    _, t = _channels_last((8, 16, 12, 16), False)
    _stored_channels_last(t.max_pool2d(kernel_size=3, stride=2, padding=1))
    (ast,) = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    for facts, want in ((AVX512, [16, 4]), (AVX2, [8, 2])):
        k = Kernel(ast, renderer_like(facts))
        hand_coded_optimizations(k)
        assert [o.arg for o in k.applied_opts if o.op is OptOps.UPCAST] == want, (facts, k.applied_opts)



def test_strided_pool_takes_chains(monkeypatch):
    """A 3x3 stride-2 max pool stored channel-first (batch 1, 12 channels of 16x16: a shape no other test compiles):
    its output row of 8 is the vector (each lane's taps gathered, the window's row unrolled), and 4 of its output
    rows run side by side; values against torch."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((1, 12, 16, 16)).astype(np.float32)
    x.reshape(-1)[RS.choice(x.size, 20, replace=False)] = np.nan
    ours = Tensor(x).max_pool2d(kernel_size=3, stride=2, padding=1).numpy()
    np.testing.assert_array_equal(ours, torch.nn.functional.max_pool2d(torch.tensor(x), 3, 2, 1).numpy())
    (ast,) = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    for facts in (AVX512, AVX2):
        k = Kernel(ast, renderer_like(facts))
        hand_coded_optimizations(k)
        assert [o.arg for o in k.applied_opts if o.op is OptOps.UPCAST] == [8, 4], (facts, k.applied_opts)
