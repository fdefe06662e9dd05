"""Convolutions along their output channels on 4x4 and 8x8 images: on a target of 16 vector registers (AVX2) the
register tile takes another output loop (the batch, else the output rows) up to 16 accumulators, and an 8-pixel row
is tiled by halves so the channels stay the SIMD axis. Values against torch: padding, strides 2 and 3, dilation,
groups, batch 1, channel counts that no vector divides; the tile's opts on AVX2 and AVX-512."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX2, AVX512, captured_asts, register_tile as _tile

RS = np.random.default_rng(0)

# (batch, input channels, output channels, image side, stride, padding, dilation, groups)
SHAPES = [(16, 16, 16, 8, 1, 1, 1, 1),     # the ResNet-style CNN's first stage
          (16, 16, 32, 8, 2, 1, 1, 1),     # its downsampling convolution, to 4x4
          (4, 32, 32, 4, 1, 1, 1, 1),
          (1, 16, 16, 8, 1, 1, 1, 1),      # batch 1: the output rows join the tile, or nothing does
          (3, 13, 24, 8, 1, 1, 1, 1),      # 13 input channels, 24 output channels (three vectors)
          (2, 16, 16, 9, 3, 2, 1, 1),      # stride 3 on an odd image
          (2, 16, 16, 8, 1, 2, 2, 1),      # dilation 2
          (4, 32, 32, 8, 1, 1, 1, 2),      # two groups
          (5, 8, 16, 8, 1, 0, 1, 1)]       # no padding: a 6x6 output


def _conv(x: np.ndarray, w: np.ndarray, stride: int, padding: int, dilation: int, groups: int):
    """conv2d(x, w) and the gradients into x and w of sum(conv2d(x, w) * g) for a random g: ours and torch's."""
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tout = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=padding, dilation=dilation, groups=groups)
    g = RS.standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(g)).sum().backward()
    assert tx.grad is not None and tw.grad is not None
    fx, fw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    fout = fx.conv2d(fw, stride=stride, padding=padding, dilation=dilation, groups=groups)
    (fout * Tensor(g)).sum().backward()
    assert fx.grad is not None and fw.grad is not None
    return [fout.numpy(), fx.grad.numpy(), fw.grad.numpy()], [tout.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()]


@pytest.mark.parametrize("shape", SHAPES)
def test_channel_tile_conv_values(shape):
    n, ci, co, side, stride, pad, dil, groups = shape
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci // groups, 3, 3)) * 0.2).astype(np.float32)
    ours, ref = _conv(x, w, stride, pad, dil, groups)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def _forward_ast(monkeypatch, n: int, ci: int, co: int, side: int) -> UOp:
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci, 3, 3)) * 0.2).astype(np.float32)
    ours = Tensor(x).conv2d(Tensor(w), padding=1).numpy()
    ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    convs = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    assert len(convs) == 1
    return convs[0]


def test_channel_tile_8x8(monkeypatch: pytest.MonkeyPatch):
    """16 -> 16 channels on 8x8 images, batch 8: on AVX2 8 channels x 4 pixels x 4 images (16 accumulators of 8
    lanes), the channels the SIMD axis; on AVX-512 (32 registers) the one vector of 16 channels x 8 pixels x 2 images,
    the channels the SIMD axis too (where the 8-pixel row was, in half vectors).
    (Shapes no other test of this file compiles: a kernel compiled before isn't generated again.)"""
    ast = _forward_ast(monkeypatch, 8, 16, 16, 8)
    assert _tile(ast, AVX2) == (8 * 16, 8)
    assert _tile(ast, AVX512) == (16 * 16, 16)


def test_channel_tile_4x4(monkeypatch: pytest.MonkeyPatch):
    """32 -> 32 channels on 4x4 images, batch 6: two vectors of channels x the 4-pixel row x 2 images on AVX2."""
    ast = _forward_ast(monkeypatch, 6, 32, 32, 4)
    assert _tile(ast, AVX2) == (16 * 8, 8)
    # (on AVX-512: a vector of 16 channels x the 4-pixel row x 4 rows)
    assert _tile(ast, AVX512) == (16 * 16, 16)


def test_channel_tile_batch1(monkeypatch: pytest.MonkeyPatch):
    """Batch 1, 8x8: the 8 output rows left outside the tile must still reuse the packed weights, so the tile takes
    no image rows and the 8-pixel row stays whole (8 accumulators)."""
    ast = _forward_ast(monkeypatch, 1, 8, 16, 8)
    lanes, _ = _tile(ast, AVX2)
    assert lanes == 64
