"""Reading a value (numpy, item, tolist, realize of another tensor) leaves the graphs of the other lazy tensors as
they were, so a later backward() gives the gradients it would have given without the read, as torch and tinygrad do:
a DETACH, relu's own derivative and the nodes computed inside the read's kernels stay in those graphs. Each case runs
twice, the second time from the schedule cache's replay plan."""
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

def _reduction_inside(T, read):
    a = T(_A); s = (a * a).sum(); m = s * a; z = m.exp().sum(0) * a.max()
    read(z)
    return z.sum(), a

def _intermediate_read(T, read):
    a = T(_A); h = (a * 3).relu(); s = h.sum(1, keepdim=True); z = (h / s).square()
    read(s)
    return z.sum(), a

CASES = [_detach_product, _relu_at_zero, _reduction_inside, _intermediate_read]

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

def test_realize_still_cuts_its_own_graph():
    # (tinygrad's rule, kept: realize() makes the tensor a buffer, also inside the graphs that hold it)
    a = Tensor(_A, requires_grad=True)
    h = a * 2
    z = h.sum()
    h.realize()
    z.backward()
    assert a.grad is None and h.grad is not None
