"""Reductions whose loads disagree on the contiguous axis (a layernorm's weight gradient whose input arrives
transposed): the CPU heuristic vectorizes the output loop the stores are contiguous along and gathers the strided
loads lane by lane. Values against torch and NumPy, and the opts."""
from __future__ import annotations
import numpy as np
import pytest
import torch
import fusegrad.codegen as codegen
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.lower import choose_vector_axis
from fusegrad.codegen.opt.heuristic import GATHER_VECTORS, hand_coded_optimizations
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX2, captured_asts, renderer_like

RS = np.random.default_rng(0)


def _layernorm_weight_grad(features: int, rows: int, residual: bool) -> tuple[np.ndarray, np.ndarray]:
    """The gradient into a layernorm's weight of sum(layernorm(x) * w * g), x given as its transpose (features, rows),
    plus a contiguous residual (rows, features) when `residual`: ours and torch's."""
    xt = RS.standard_normal((features, rows)).astype(np.float32)
    res = RS.standard_normal((rows, features)).astype(np.float32)
    w = RS.standard_normal(features).astype(np.float32)
    g = RS.standard_normal((rows, features)).astype(np.float32)
    fw = Tensor(w, requires_grad=True)
    x = Tensor(xt).T + (Tensor(res) if residual else 0)
    (x.layernorm() * fw * Tensor(g)).sum().backward()
    assert fw.grad is not None
    tw = torch.tensor(w, requires_grad=True)
    tx = torch.tensor(xt).T + (torch.tensor(res) if residual else 0)
    (torch.nn.functional.layer_norm(tx, (features,)) * tw * torch.tensor(g)).sum().backward()
    assert tw.grad is not None
    return fw.grad.numpy(), tw.grad.numpy()


@pytest.mark.parametrize("features, rows", [(96, 40), (24, 37), (40, 513), (100, 7), (8, 1), (13, 5)])
@pytest.mark.parametrize("residual", [False, True])
def test_transposed_layernorm_weight_grad(features: int, rows: int, residual: bool):
    """Features that two vectors divide, one vector only (24, 40), none (100, 13: scalar as before); rows of odd
    counts; with and without a contiguous residual beside the transposed input."""
    ours, ref = _layernorm_weight_grad(features, rows, residual)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.sqrt(rows))


def test_gathered_sum_of_several_products():
    """sum over rows of a[r, f] * b.T[r, f] + c[r] * d[r, f], b stored (features, rows): two contiguous loads, one
    strided, one broadcast along the features; against NumPy in float64."""
    a = RS.standard_normal((33, 48)).astype(np.float32)
    b = RS.standard_normal((48, 33)).astype(np.float32)
    c = RS.standard_normal((33, 1)).astype(np.float32)
    d = RS.standard_normal((33, 48)).astype(np.float32)
    ours = (Tensor(a) * Tensor(b).T + Tensor(c) * Tensor(d)).sum(0).numpy()
    ref = (a.astype(np.float64) * b.T + c.astype(np.float64) * d).sum(0)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_gathered_output_opts(monkeypatch: pytest.MonkeyPatch):
    """The weight gradient's kernel (64 features, 29 rows: a shape no other test compiles) gets its features upcast
    by a vector on AVX2 and by GATHER_VECTORS more, and the lowering keeps the vector's lanes as the SIMD axis."""
    asts = captured_asts(monkeypatch)
    ours, ref = _layernorm_weight_grad(64, 29, False)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.sqrt(29))
    (ast,) = [a for a in asts if any(st.src[0].src[0].dtype.size == 64 for st in a.src) and
              any(u.op is Ops.REDUCE for u in a.toposort())]
    ren = renderer_like(AVX2)
    k = Kernel(codegen.collapse_gathers(ast), ren)
    opts = hand_coded_optimizations(k)
    assert [(o.op, o.arg) for o in opts] == [(OptOps.UPCAST, 8), (OptOps.UPCAST, GATHER_VECTORS)], opts
    vec = choose_vector_axis(k.get_optimized_ast(), ren)
    assert vec is not None and range_size(vec) == 8
