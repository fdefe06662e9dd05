"""A 3x3 convolution's weight gradient vectorized along its image rows: with 32 vector registers its column taps are
upcast whole and the tile holds 24 sums (taps x 4 output channels x 2 input channels), and rows of 28 are padded to
two full vectors (`_tile_dot_products`, `_pad_short_reduce`). The loop shapes on AVX-512 and AVX2, and the values
against torch."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import UOp
from test.codegen.helpers import AVX2, AVX512, captured_asts, renderer_like

RS = np.random.default_rng(0)

def weight_gradient(n: int, c: int, hw: int, monkeypatch: pytest.MonkeyPatch) -> UOp | None:
    """The AST of the kernel storing the weight gradient of a 3x3, padding 1 convolution of n x c x hw x hw to c
    channels, after checking the gradient's values against torch."""
    seen = captured_asts(monkeypatch)
    x = RS.standard_normal((n, c, hw, hw)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    g = RS.standard_normal((n, c, hw, hw)).astype(np.float32)
    wt = Tensor(w, requires_grad=True)
    (Tensor(x).conv2d(wt, padding=1) * Tensor(g)).sum().backward()
    tw = torch.tensor(w, requires_grad=True)
    (torch.nn.functional.conv2d(torch.tensor(x), tw, padding=1) * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(wt.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=2e-3)
    grads = [a for a in seen if any(st.src[0].src[0].dtype.size == w.size for st in a.src)]
    return grads[0] if grads else None

def optimized(ast: UOp | None, facts: tuple[int, int], full_rate_512: bool = False) -> Kernel:
    """The kernel as the heuristic shapes it for a CPU with these vector facts, whose 512-bit FMAs run at the 256-bit
    ones' rate (Zen 5) or at half (Zen 4)."""
    assert ast is not None, "no kernel stores the weight gradient"
    ren = renderer_like(facts)
    ren.full_rate_512 = full_rate_512
    k = Kernel(ast, ren)
    hand_coded_optimizations(k)
    return k

def test_taps_tile_on_avx512(monkeypatch: pytest.MonkeyPatch):
    """Rows of 56 (seven vectors of 8): on AVX-512 the 3 column taps x 4 output x 2 input channels; on AVX2 (16
    registers) the 4 x 4 channels as before."""
    ast = weight_gradient(2, 8, 56, monkeypatch)
    k = optimized(ast, AVX512)
    assert 3 in [o.arg for o in k.applied_opts if o.op is OptOps.UPCAST], k.applied_opts
    assert not any(o.op is OptOps.UNROLL for o in k.applied_opts), k.applied_opts
    tile = [o.arg for o in k.applied_opts if o.op is OptOps.UPCAST and o.arg not in (8, 16)]
    assert sorted(tile) == [2, 3, 4], k.applied_opts
    k2 = optimized(ast, AVX2)
    assert sorted(o.arg for o in k2.applied_opts if o.op is OptOps.UPCAST and o.arg != 8) == [4, 4], k2.applied_opts

def test_rows_of_28_padded_to_full_vectors(monkeypatch: pytest.MonkeyPatch):
    """Rows of 28 are padded to whole vectors (an eighth of them padding) rather than summed in seven vectors of 4:
    two of 16 on AVX-512 (14 useful lanes a step), four of 8 on AVX2 (7 useful lanes, two steps a cycle)."""
    ast = weight_gradient(2, 8, 28, monkeypatch)
    for facts, lanes in ((AVX512, 16), (AVX2, 8)):
        k = optimized(ast, facts)
        assert any(o.op is OptOps.PADTO for o in k.applied_opts), k.applied_opts
        assert lanes in [o.arg for o in k.applied_opts if o.op is OptOps.UPCAST], k.applied_opts

def test_rows_of_56_by_the_rate_of_512_bit_fmas(monkeypatch: pytest.MonkeyPatch):
    """Rows of 56: padded to 64 they are 14 useful lanes of 16. Where a 512-bit FMA takes the time of two 256-bit ones
    (Zen 4) that is less than the 8-lane vectors that divide 56 (two a cycle): kept as 7 x 8; at full rate (Zen 5)
    it is 28 lanes a cycle against 16: padded, 4 x 16."""
    ast = weight_gradient(3, 8, 56, monkeypatch)   # (a shape of its own: kernels compile once)
    half = optimized(ast, AVX512, full_rate_512=False)
    assert not any(o.op is OptOps.PADTO for o in half.applied_opts), half.applied_opts
    assert 8 in [o.arg for o in half.applied_opts if o.op is OptOps.UPCAST], half.applied_opts
    full = optimized(ast, AVX512, full_rate_512=True)
    assert any(o.op is OptOps.PADTO for o in full.applied_opts), full.applied_opts
    assert 16 in [o.arg for o in full.applied_opts if o.op is OptOps.UPCAST], full.applied_opts

@pytest.mark.parametrize("n,c,hw", [(3, 16, 28), (2, 12, 14), (2, 8, 9), (1, 4, 30)])
def test_values(n: int, c: int, hw: int, monkeypatch: pytest.MonkeyPatch):
    """Weight gradients of shapes whose rows pad (28, 14, 30) or not (9), on this machine, against torch."""
    weight_gradient(n, c, hw, monkeypatch)
