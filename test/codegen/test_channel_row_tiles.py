"""Convolutions along their output channels over 16-pixel rows: on AVX-512 (one vector of channels leaves the
accumulators for it) the register tile spans the row; and an RGB stem of 27 taps whose weights are laid out with the
output channels innermost takes the channels as its vector, where its stride-2 row would gather. Values against torch
and the tiles on AVX2 and AVX-512."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX2, AVX512, captured_asts, register_tile as _tile

RS = np.random.default_rng(5)


def _conv_ast(monkeypatch, n: int, ci: int, co: int, side: int, stride: int, channels_last_weight: bool) -> UOp:
    """The AST of conv2d(x, w, padding=1, stride) (its values checked against torch), with w read through a view of a
    copy whose output channels are innermost where `channels_last_weight`."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci, 3, 3)) * 0.2).astype(np.float32)
    tw = Tensor(np.ascontiguousarray(w.transpose(1, 2, 3, 0))).permute(3, 0, 1, 2) if channels_last_weight \
        else Tensor(w)
    ours = Tensor(x).conv2d(tw, padding=1, stride=stride).numpy()
    ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1, stride=stride).numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    convs = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    assert len(convs) == 1
    return convs[0]


@pytest.mark.parametrize("n,ci,co", [(2, 48, 32), (1, 16, 32)])
def test_sixteen_pixel_row_tile(monkeypatch: pytest.MonkeyPatch, n: int, ci: int, co: int):
    """16 pixels x a vector of 16 channels on AVX-512 (the 8-pixel tile before); AVX2 keeps 8 pixels x 2 vectors."""
    ast = _conv_ast(monkeypatch, n, ci, co, 16, 1, False)
    assert _tile(ast, AVX512) == (16 * 16, 16)
    assert _tile(ast, AVX2)[0] == 8 * 2 * 8


def test_rgb_stem_takes_its_channels(monkeypatch: pytest.MonkeyPatch):
    """3 -> 16 channels at stride 2 over 32x32 at batch 1 with the weights laid out channels innermost: the 16 output
    channels are the SIMD axis, the tile the whole 16-pixel output row, on AVX-512."""
    ast = _conv_ast(monkeypatch, 1, 3, 16, 32, 2, True)
    assert _tile(ast, AVX512) == (16 * 16, 16)
