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
    def record(ast, renderer, name=None, opts=None, quick=False):
        p = plain(ast, renderer, name, opts, quick)
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

# *** reductions over lengths no vector divides ***

@pytest.mark.parametrize("n", [1001, 2003, 67, 7, 1])
def test_awkward_row_reductions(n: int):
    """Sum, max, logsumexp and an integer sum over rows of lengths no vector divides (padded to whole vectors when
    long enough: the padding adds the reductions' identities), against NumPy."""
    a = RS.standard_normal((5, n)).astype(np.float32)
    i = RS.integers(-1000, 1000, (5, n)).astype(np.int32)
    np.testing.assert_allclose(Tensor(a).sum(1).numpy(), a.sum(1, dtype=np.float64), rtol=1e-5, atol=1e-4)
    np.testing.assert_equal(Tensor(a).max(1).numpy(), a.max(1))
    np.testing.assert_equal(Tensor(-np.abs(a)).max(1).numpy(), (-np.abs(a)).max(1))
    ref = np.log(np.exp(a.astype(np.float64)).sum(1))
    np.testing.assert_allclose(Tensor(a).logsumexp(1).numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_equal(Tensor(i).sum(1).numpy(), i.sum(1))

def test_empty_rows():
    """Rows of length 0 reduce to the identity."""
    np.testing.assert_equal(Tensor(np.zeros((3, 0), np.float32)).sum(1).numpy(), np.zeros(3, np.float32))

def test_awkward_reduction_is_vectorized():
    """A row sum over 1001 elements is padded to whole vectors and vectorized, on both x86 vector widths."""
    from test.codegen.test_reduce import reduce_2d_ast
    from fusegrad.dtype import dtypes
    from fusegrad.uop.ops import Ops
    for facts, lanes in ((AVX2, 8), (AVX512, 16)):
        k = Kernel(reduce_2d_ast(5, 1001, 1, Ops.ADD, dtypes.float32), renderer_like(facts))
        hand_coded_optimizations(k)
        assert [o.arg for o in k.applied_opts if o.op is OptOps.PADTO] == [lanes], k.applied_opts
        assert _reduce_upcasts(k)[:1] == [lanes], k.applied_opts

@pytest.mark.parametrize("vocab", [1001, 515])
def test_awkward_vocabulary_training(vocab: int):
    """A language model's head over a vocabulary no vector or block divides: the logits, the cross-entropy and the
    gradients into the hidden states and the embedding, against torch."""
    x = RS.standard_normal((2, 16, 48)).astype(np.float32)
    w = (RS.standard_normal((vocab, 48)) * 0.1).astype(np.float32)
    y = RS.integers(0, vocab, (2, 16))
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    loss = (xt @ wt.T).reshape(-1, vocab).sparse_categorical_crossentropy(Tensor(y.reshape(-1).astype(np.int32)))
    loss.backward()
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tl = torch.nn.functional.cross_entropy((tx @ tw.T).reshape(-1, vocab), torch.tensor(y.reshape(-1)))
    tl.backward()
    assert xt.grad is not None and wt.grad is not None and tx.grad is not None and tw.grad is not None
    np.testing.assert_allclose(loss.numpy(), tl.item(), rtol=1e-5)
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(wt.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-6)

@pytest.mark.parametrize("k", [1001, 2003])
def test_awkward_contraction(k: int):
    """A matmul whose contraction (of a length no block divides) is padded to whole cache blocks, against NumPy."""
    a = RS.standard_normal((24, k)).astype(np.float32)
    b = RS.standard_normal((k, 64)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), ref, rtol=1e-4, atol=1e-3)

def test_awkward_contraction_is_blocked():
    """A matmul over a contraction of 2003 (prime) is padded to whole blocks of 512 and blocked through the output,
    on both x86 vector widths."""
    from test.codegen.helpers import matmul_ast
    for facts in (AVX2, AVX512):
        k = Kernel(matmul_ast(24, 64, 2003), renderer_like(facts))
        hand_coded_optimizations(k)
        pads = [o.arg for o in k.applied_opts if o.op is OptOps.PADTO]
        assert pads == [512] and any(o.op is OptOps.KBLOCK and o.arg == 512 for o in k.applied_opts), k.applied_opts
