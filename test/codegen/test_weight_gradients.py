"""Convolution weight gradients and reductions over sizes no vector divides: the CPU heuristic's loop shapes for
them, and their values against torch."""
from __future__ import annotations
import numpy as np
import pytest
import torch
import fusegrad.codegen as codegen
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import UOp
from test.codegen.helpers import AVX2, AVX512, renderer_like

RS = np.random.default_rng(0)

def _captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, UOp]:
    """The ASTs of the kernels compiled from now on, by kernel name."""
    seen: dict[str, UOp] = {}
    plain = codegen.get_program
    def record(ast, renderer, name=None, opts=None):
        p = plain(ast, renderer, name, opts)
        seen.setdefault(p.name, ast)
        return p
    monkeypatch.setattr(codegen, "get_program", record)
    return seen

def _conv_weight_grad(x: np.ndarray, w: np.ndarray, stride: int, padding: int) -> tuple[np.ndarray, np.ndarray]:
    """The weight gradient of sum(conv2d(x, w) * g) for a random g: fusegrad's and torch's."""
    out_shape = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=stride, padding=padding).shape
    g = RS.standard_normal(tuple(out_shape)).astype(np.float32)
    wt = Tensor(w, requires_grad=True)
    (Tensor(x).conv2d(wt, stride=stride, padding=padding) * Tensor(g)).sum().backward()
    tw = torch.tensor(w, requires_grad=True)
    (torch.nn.functional.conv2d(torch.tensor(x), tw, stride=stride, padding=padding) * torch.tensor(g)).sum().backward()
    assert wt.grad is not None and tw.grad is not None
    return wt.grad.numpy(), tw.grad.numpy()

def _reduce_upcasts(k: Kernel) -> list[int]:
    """The amounts of the UPCASTs applied to reduce loops."""
    return [o.arg for o in k.applied_opts
            if o.op is OptOps.UPCAST and isinstance(o.arg, int) and o.axis >= k.first_reduce]

def test_stem_weight_gradient(monkeypatch: pytest.MonkeyPatch):
    """A 7x7 stride-2 convolution's weight gradient (a ResNet stem's, on 4 images of 64x64): 3 x 64 x 7 x 7 outputs,
    each a sum over 4 x 32 x 32 products, is vectorized along the reduction's image rows (contiguous in both loads),
    not along the 7-wide window padded to a vector, which gathered the output gradient lane by lane."""
    asts = _captured(monkeypatch)
    x = RS.standard_normal((4, 3, 64, 64)).astype(np.float32)
    w = (RS.standard_normal((64, 3, 7, 7)) * 0.1).astype(np.float32)
    ours, ref = _conv_weight_grad(x, w, 2, 3)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-3)
    # the kernel that stores the 64*3*7*7 gradient
    grads = [a for a in asts.values() if any(st.src[0].src[0].dtype.size == w.size for st in a.src)]
    assert grads, "no kernel stores the weight gradient"
    for facts, lanes in ((AVX2, 8), (AVX512, 16)):
        k = Kernel(codegen.collapse_gathers(grads[0]), renderer_like(facts))
        hand_coded_optimizations(k)
        assert _reduce_upcasts(k) == [lanes], k.applied_opts
        assert not any(o.op is OptOps.PADTO for o in k.applied_opts), k.applied_opts

@pytest.mark.parametrize("shape", [(2, 4, 9, 9, 8, 3, 1, 1), (2, 3, 17, 17, 5, 7, 2, 3), (1, 2, 5, 5, 3, 1, 1, 0)])
def test_small_weight_gradients(shape):
    """Weight gradients of convolutions too small for the long-reduction shape (odd sizes, 1x1, a 7x7 stride 2)."""
    n, ci, h, w_, co, kk, stride, pad = shape
    x = RS.standard_normal((n, ci, h, w_)).astype(np.float32)
    w = RS.standard_normal((co, ci, kk, kk)).astype(np.float32)
    ours, ref = _conv_weight_grad(x, w, stride, pad)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
