"""Reduce loops that every access addresses as one are one loop (`merge_contiguous_reduce_loops`): a batch norm's
sums over small images reduce over the pixels in one contiguous loop, which the heuristic vectorizes. Which loops
merge, and the values against torch where they do and where they must not (padding, loops used in values)."""
from __future__ import annotations
from typing import Callable
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX512, renderer_like

RS = np.random.default_rng(0)

def reduce_loop_sizes(make: Callable[[], Tensor]) -> list[list[int]]:
    """The sizes of each reduction's loops in the last kernel of the schedule of `make()`, after the kernel's loop
    merging. (A tensor of its own: a scheduled tensor can't be read until its schedule runs.)"""
    ast = [ei.ast for ei in make().schedule() if ei.ast.op is Ops.SINK][-1]
    k = Kernel(ast, renderer_like(AVX512))
    return [[range_size(r) for r in red.src[1:]] for red in k.ast.toposort() if red.op is Ops.REDUCE]

@pytest.mark.parametrize("hw", [2, 4, 7, 14])
def test_channel_sum_over_small_images_is_one_pixel_loop(hw: int):
    """Summing NCHW over (batch, pixels) per channel: the pixels are one loop of h*w (the batch stays a loop of its
    own: it is a plane of channels apart), and the sums match torch."""
    x = RS.standard_normal((16, 32, hw, hw)).astype(np.float32)
    xt = Tensor(x).realize()
    assert reduce_loop_sizes(lambda: xt.sum((0, 2, 3))) == [[16, hw * hw]]
    np.testing.assert_allclose(xt.sum((0, 2, 3)).numpy(), torch.tensor(x).sum((0, 2, 3)).numpy(), rtol=1e-5, atol=1e-4)

def test_pixel_rows_of_whole_vectors_stay_apart():
    """Rows of 16 floats are whole AVX-512 vectors already: the loops are left as they are."""
    x = RS.standard_normal((4, 8, 3, 16)).astype(np.float32)
    xt = Tensor(x).realize()
    assert reduce_loop_sizes(lambda: xt.sum((0, 2, 3))) == [[4, 3, 16]]

def test_batch_norm_backward_values():
    """A training batch norm (2x2 and 7x7 images) followed by relu, its input, weight and bias gradients against
    torch: the sums of its backward merge their pixel loops, some of them beside other reductions of the kernel."""
    for hw in (2, 7):
        x = RS.standard_normal((16, 24, hw, hw)).astype(np.float32)
        g = RS.standard_normal((16, 24, hw, hw)).astype(np.float32)
        w, b = RS.standard_normal(24).astype(np.float32), RS.standard_normal(24).astype(np.float32)
        xt, wt, bt = (Tensor(a, requires_grad=True) for a in (x, w, b))
        y = ((xt - xt.mean((0, 2, 3), keepdim=True)) * (xt.var((0, 2, 3), keepdim=True, correction=0) + 1e-5).rsqrt()
             * wt.reshape(1, -1, 1, 1) + bt.reshape(1, -1, 1, 1)).relu()
        (y * Tensor(g)).sum().backward()
        tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
        ty = torch.relu(torch.nn.functional.batch_norm(tx, None, None, tw, tb, training=True, eps=1e-5))
        (ty * torch.tensor(g)).sum().backward()
        for ours, ref in ((xt, tx), (wt, tw), (bt, tb)):
            np.testing.assert_allclose(ours.grad.numpy(), ref.grad.numpy(), rtol=1e-4, atol=1e-4)

def test_padded_window_keeps_its_loops():
    """A 2x2 average pool with padding 1 (the window's loops feed the padding check): the values against torch."""
    x = RS.standard_normal((2, 3, 5, 5)).astype(np.float32)
    got = Tensor(x).avg_pool2d(kernel_size=(2, 2), stride=1, padding=1, count_include_pad=True).numpy()
    want = torch.nn.functional.avg_pool2d(torch.tensor(x), 2, stride=1, padding=1, count_include_pad=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

def test_loop_used_in_a_value_keeps_its_own():
    """A sum of x * its column position over rows of 4 (the position is the inner loop's value): not merged, and the
    sums match."""
    x = RS.standard_normal((8, 3, 4)).astype(np.float32)
    xt = Tensor(x).realize()
    assert reduce_loop_sizes(lambda: (xt * Tensor.arange(4)).sum((1, 2))) == [[3, 4]]
    np.testing.assert_allclose((xt * Tensor.arange(4)).sum((1, 2)).numpy(), (x * np.arange(4)).sum((1, 2)),
                               rtol=1e-5, atol=1e-5)

def test_empty_batch():
    """A batch of none: the channel sums are zeros (a loop of 0 merges with nothing)."""
    x = np.zeros((0, 4, 2, 2), np.float32)
    np.testing.assert_array_equal(Tensor(x).sum((0, 2, 3)).numpy(), np.zeros(4, np.float32))
