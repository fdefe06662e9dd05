"""Reading a value (numpy, item, tolist, kernelize of another tensor) doesn't change what a later backward() gives, as
in torch and tinygrad: the lazy tensors whose nodes the read's schedule only rewrote (a DETACH dropped, relu's or
sigmoid's own derivative gone, softmax's detached max) keep their graphs. (A node one of its kernels computes becomes
a buffer for every graph holding it, as in tinygrad: see the last test.) Each case runs twice, the second time from
the schedule cache's replay plan."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor

_A = (np.arange(16, dtype=np.float32).reshape(4, 4) / 16 - 0.3).astype(np.float32)

def _detach_product(T, read):
    x = T(_A[0]); y = x.detach() * x
    read(y)
    return y.sum(), x

def _relu_at_zero(T, read):
    x = T(np.array([-1.0, 0.0, 3.0], np.float32)); y = x.relu() * 2; z = y + 1
    read(y)
    return z.sum(), x

def _sigmoid_and_softmax(T, read):
    a = T(_A); y = a.sigmoid() * a.softmax(-1); z = (y * a).sum(1)
    read(y)
    return z.sum(), a

def _detach_inside_a_chain(T, read):
    a = T(_A); m = (a * 2).detach(); y = (a * m).exp(); z = y + a.square()
    read(z)
    return (z * a).sum(), a

CASES = [_detach_product, _relu_at_zero, _sigmoid_and_softmax, _detach_inside_a_chain]

def _ours(case, how):
    def read(t):
        if how == "numpy": t.numpy()
        elif how == "tolist": t.tolist()
        elif how == "sum item": t.sum().item()
        elif how == "kernelize of another": (t * 1).kernelize()
    loss, leaf = case(lambda v: Tensor(v, requires_grad=True), read)
    loss.backward()
    return leaf.grad.numpy()

def _torch(case):
    loss, leaf = case(lambda v: torch.tensor(v, requires_grad=True), lambda t: t.detach().numpy())
    loss.backward()
    return leaf.grad.numpy()

@pytest.mark.parametrize("how", ["numpy", "tolist", "sum item", "kernelize of another"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
def test_read_keeps_later_gradients(case, how):
    want = _torch(case)
    for _ in range(2):   # (the second time from the replay plan of the same structure)
        np.testing.assert_allclose(_ours(case, how), want, rtol=1e-5, atol=1e-6)

def test_a_node_a_kernel_computes_becomes_a_buffer():
    # (tinygrad 0.14's rule, kept: a graph holding it reads the buffer from then on, so autodiff stops there)
    a = Tensor(_A, requires_grad=True)
    s = (a * a).sum().contiguous()
    z = (s * a).exp().sum(0)
    np.testing.assert_allclose(z.numpy(), np.exp(float((_A * _A).sum()) * _A).sum(0), rtol=1e-5)
    assert s.uop.base.op.name == "BUFFER"
    np.testing.assert_allclose(s.numpy(), (_A * _A).sum(), rtol=1e-5)

def test_realize_still_cuts_its_own_graph():
    # (tinygrad's rule, kept: realize() makes the tensor a buffer, also inside the graphs that hold it)
    a = Tensor(_A, requires_grad=True)
    h = a * 2
    z = h.sum()
    h.realize()
    z.backward()
    assert a.grad is None and h.grad is not None
