"""A vectorized reduction whose tile loads several channels a multiple of 4 KB apart (planes of 32x32 or 64x64
floats) copies that operand to a contiguous block (PACK, `heuristic._pack_aliased_lanes`): the 64px ResNet stem's
weight gradient. Values against torch, and the opts on both sides of the rule's conditions."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt import heuristic
from test.codegen.helpers import AVX512, captured_asts, renderer_like

RS = np.random.default_rng(1)

def _stem_weight_grad(monkeypatch: pytest.MonkeyPatch, n: int, side: int, co: int = 64):
    """A 7x7 stride-2 convolution's weight gradient (3 input channels, padding 3): ours and torch's, and the
    heuristic's opts for an AVX-512 machine of the kernel that stores it."""
    x = RS.standard_normal((n, 3, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, 3, 7, 7)) * 0.05).astype(np.float32)
    tw = torch.tensor(w, requires_grad=True)
    tout = torch.nn.functional.conv2d(torch.tensor(x), tw, stride=2, padding=3)
    g = RS.standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(g)).sum().backward()
    asts = captured_asts(monkeypatch)
    fw = Tensor(w, requires_grad=True)
    (Tensor(x).conv2d(fw, stride=2, padding=3) * Tensor(g)).sum().backward()
    assert fw.grad is not None and tw.grad is not None
    got = fw.grad.numpy()
    (ast,) = [a for a in asts if any(st.src[0].src[0].dtype.size == w.size for st in a.src)]
    opts = heuristic.hand_coded_optimizations(Kernel(ast, renderer_like(AVX512)))
    monkeypatch.setattr(heuristic, "_pack_aliased_lanes", lambda ctx: None)
    return got, tw.grad.numpy(), opts, heuristic.hand_coded_optimizations(Kernel(ast, renderer_like(AVX512)))

# (batches no other test's stem takes: the kernels are compiled here, not taken from the method cache)
@pytest.mark.parametrize("n,side,co", [(5, 64, 64), (3, 128, 64), (7, 64, 64)])
def test_channels_a_page_apart_are_packed(monkeypatch: pytest.MonkeyPatch, n: int, side: int, co: int):
    """Output-gradient planes of 32x32 and 64x64 floats (4 KB, 16 KB), 4 channels per tile: packed (the opts without
    the rule, and a PACK of the output gradient after them)."""
    got, want, opts, without = _stem_weight_grad(monkeypatch, n, side, co)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    assert opts[:-1] == without and opts[-1].op is OptOps.PACK, (opts, without)

@pytest.mark.parametrize("side", [56, 48])
def test_planes_not_a_page_multiple_are_left(monkeypatch: pytest.MonkeyPatch, side: int):
    """Planes of 28x28 and 24x24 floats (3136 and 2304 bytes: consecutive channels fall at different offsets in a
    page): the rule adds nothing."""
    got, want, opts, without = _stem_weight_grad(monkeypatch, 5, side)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    assert opts == without
