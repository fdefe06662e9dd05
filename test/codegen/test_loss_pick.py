"""The cross-entropy's pick of the label's log-probability is a load at the label (codegen/gather.py), in the forward
kernel (also where the loss is one big sum computed in chunks) and in the backward one (where the pick is summed
together with the softmax): losses and gradients against torch, and no reduction over the classes left for a pick."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import GlobalCounters, Tensor, dtypes
from fusegrad.codegen.gather import collapse_gathers
from fusegrad.helpers import Context
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import captured_asts

RS = np.random.default_rng(0)

def _is_range(u: UOp, r: UOp) -> bool:
    while u.op is Ops.CAST: u = u.src[0]
    return u is r or (u.op is Ops.MOD and u.src[0] is r)

def _one_hot_reduces(ast: UOp) -> int:
    """How many reductions compare one of their own ranges (or it modulo a size) for equality: one-hot picks."""
    return sum(1 for u in ast.toposort() if u.op is Ops.REDUCE and any(
        c.op is Ops.CMPEQ and any(_is_range(s, r) for s in c.src for r in u.src[1:]) for c in u.src[0].toposort()))

def _case(rows: int, vocab: int, monkeypatch: pytest.MonkeyPatch, **kw) -> list[UOp]:
    """Loss and logits gradient of sparse_categorical_crossentropy against torch's cross_entropy; the kernels' ASTs."""
    x = (RS.standard_normal((rows, vocab)) * 3).astype(np.float32)
    y = RS.integers(0, vocab, rows).astype(np.int32)
    ignore = kw.pop("ignore_index", -1)
    if ignore >= 0: y[::3] = ignore
    asts = captured_asts(monkeypatch)
    xt = Tensor(x, requires_grad=True)
    loss = xt.sparse_categorical_crossentropy(Tensor(y), ignore_index=ignore, **kw)
    loss.sum().backward()
    assert xt.grad is not None
    got, grad = loss.numpy(), xt.grad.numpy()
    tx = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(tx, torch.tensor(y).long(), ignore_index=ignore, **kw)
    want.sum().backward()
    assert tx.grad is not None
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-4, atol=1e-7)
    return asts

@pytest.mark.parametrize("rows,vocab,kw", [
    (6, 1001, {}), (3, 50257, {}), (6, 1001, {"ignore_index": 7}), (6, 1001, {"label_smoothing": 0.1}),
    (6, 1001, {"reduction": "sum"}), (6, 1001, {"reduction": "none", "ignore_index": 3}),
    # a mean over 512 rows is one sum of 512 x 1001 terms, computed in chunks of 8 rows
    (512, 1001, {})])
def test_pick_is_a_load(rows, vocab, kw, monkeypatch: pytest.MonkeyPatch):
    asts = _case(rows, vocab, monkeypatch, **kw)
    before = sum(_one_hot_reduces(a) for a in asts)
    assert before > 0, "the loss's kernels have no one-hot pick: the test no longer sees what it checks"
    assert sum(_one_hot_reduces(collapse_gathers(a)) for a in asts) == 0

def test_gpt2_shaped_backward_keeps_the_pick_elementwise(monkeypatch: pytest.MonkeyPatch):
    """The logits' gradient (softmax minus the one-hot) is stored elementwise; only its sums over the classes reduce,
    and those sums no longer hold a pick."""
    asts = _case(4, 50257, monkeypatch)
    grads = [a for a in asts if any(st.src[0].src[0].dtype.size == 4 * 50257 for st in a.src)]
    assert grads
    for a in grads:
        stored = [st.src[1] for st in a.src if st.src[0].src[0].dtype.size == 4 * 50257]
        # the one-hot compare in the stored value is on the output's own loop, not on a reduction's range
        assert any(u.op is Ops.CMPEQ for v in stored for u in v.toposort())
        assert _one_hot_reduces(collapse_gathers(a)) == 0

def test_chunked_mean_with_sliced_labels(monkeypatch: pytest.MonkeyPatch):
    """A language model's loss: logits (4, 128, classes) against the tokens shifted by one (a slice of a (4, 129)
    tensor), a mean summed in chunks of 8 rows whose labels are found through the batch and position of the row."""
    v = 1001
    x = RS.standard_normal((4, 128, v)).astype(np.float32)
    toks = RS.integers(0, v, (4, 129)).astype(np.int32)
    asts = captured_asts(monkeypatch)
    got = (Tensor(x) * 1.0).sparse_categorical_crossentropy(Tensor(toks)[:, 1:]).numpy()
    labels = torch.tensor(toks[:, 1:]).reshape(-1).long()
    want = torch.nn.functional.cross_entropy(torch.tensor(x).reshape(-1, v), labels)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5)
    assert sum(_one_hot_reduces(a) for a in asts) > 0
    assert sum(_one_hot_reduces(collapse_gathers(a)) for a in asts) == 0

def test_forms_of_a_pick():
    """A sum of a negated selection, an integer product by a one-hot and a masked max, each next to another reduction
    of the same rows: each pick is one load per row. A float product by a one-hot stays a sum: another class's inf
    makes it nan, as torch computes it."""
    n, v = 64, 4001
    x = RS.standard_normal((n, v)).astype(np.float32)
    x[:, 5] = np.inf   # (a selection picks its value: another class's inf is no nan)
    y = RS.integers(6, v, n).astype(np.int32)
    xi = RS.integers(-1000, 1000, (n, v)).astype(np.int32)
    hot_t = torch.tensor(y).long().unsqueeze(-1) == torch.arange(v).reshape(1, v)
    got = ((Tensor(y).unsqueeze(-1) == Tensor.arange(v).reshape(1, v)).cast(Tensor(x).dtype) * Tensor(x)).sum(-1)
    np.testing.assert_array_equal(got.numpy(), (hot_t.float() * torch.tensor(x)).sum(-1).numpy())
    xt, yt = Tensor(x), Tensor(y)
    hot = yt.unsqueeze(-1) == Tensor.arange(v).reshape(1, v)
    finite = np.where(np.isinf(x), 0, x)
    want = x[np.arange(n), y]
    # (most forms: a few operations per row; the last one sums the dense rows, n x v additions and negations, and
    # computed as written its pick costs 3 more per element)
    for form, ref, most_ops in [
            (lambda: -(hot.where(xt, 0.0)).sum(-1), -want, 10 * n),
            (lambda: (hot.cast(dtypes.int32) * Tensor(xi)).sum(-1), xi[np.arange(n), y], 10 * n),
            (lambda: hot.where(xt, float("-inf")).max(-1), want, 10 * n),
            (lambda: (hot.where(xt, 0.0) - Tensor(finite)).sum(-1), want - finite.sum(-1), 4 * n * v)]:
        GlobalCounters.reset()
        got = form().numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
        assert GlobalCounters.global_ops < most_ops

def test_out_of_range_label():
    """A label outside the classes: an IndexError where its values are read (the default for a realized tensor);
    unread, its row picks nothing (the loss of that row is 0), never another position."""
    x = RS.standard_normal((4, 1001)).astype(np.float32)
    y = np.array([3, 1001, 5000, 7], np.int32)
    with pytest.raises(IndexError, match="1001"):
        Tensor(x).sparse_categorical_crossentropy(Tensor(y))
    with Context(CHECK_OOB=0):
        got = Tensor(x).sparse_categorical_crossentropy(Tensor(y), reduction="none").numpy()
    logp = torch.log_softmax(torch.tensor(x), -1).numpy()
    np.testing.assert_allclose(got, [-logp[0, 3], 0.0, 0.0, -logp[3, 7]], rtol=1e-5, atol=1e-6)
