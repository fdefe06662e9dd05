"""relu's gradient read off its value (max(x, 0) > 0, or nan where x is): the same gradient as torch's for every input,
zeros, negative zeros, nans and infinities included, and the value's kernel no longer needs x in a buffer of its own."""
import numpy as np
import torch
from fusegrad import Tensor, nn

def test_relu_gradient_at_the_kinks_and_nans():
    X = np.array([[-2.0, -0.0, 0.0, 1e-30, -1e-30, 3.0], [np.nan, np.inf, -np.inf, 0.5, -0.5, np.nan]], np.float32)
    G = np.arange(1, 13, dtype=np.float32).reshape(2, 6)
    x = Tensor(X, requires_grad=True)
    (x.relu() * Tensor(G)).sum().backward()
    tx = torch.tensor(X, requires_grad=True)
    (tx.relu() * torch.tensor(G)).sum().backward()
    np.testing.assert_array_equal(x.relu().numpy(), tx.relu().detach().numpy())
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())

def test_relu_gradient_of_a_computed_value():
    # relu over a product with a bias: the mask comes from the stored relu, against torch
    rng = np.random.default_rng(0)
    X, W, B = (rng.standard_normal(s).astype(np.float32) for s in ((16, 24), (24, 32), (32,)))
    x, w, b = (Tensor(a, requires_grad=True) for a in (X, W, B))
    h = (x @ w + b).relu()
    (h * h).sum().backward()
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (X, W, B))
    th = (tx @ tw + tb).relu()
    (th * th).sum().backward()
    for ours, theirs in ((x, tx), (w, tw), (b, tb)):
        np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-4)

def test_linear_relu_layer_is_one_kernel_with_its_backward():
    # the first layer's product, bias and relu: one kernel storing only the relu (the backward's mask reads it),
    # where the product was stored for the mask and the relu computed by a kernel of its own
    rng = np.random.default_rng(1)
    X, T = rng.standard_normal((32, 784)).astype(np.float32), rng.standard_normal((32, 10)).astype(np.float32)
    l1, l2 = nn.Linear(784, 256), nn.Linear(256, 10)
    params = [l1.weight, l1.bias, l2.weight, l2.bias]
    for p in params: p.requires_grad_(True)
    Tensor.realize(*params)
    loss = ((l2(l1(Tensor(X)).relu()) - Tensor(T)) ** 2).mean()
    loss.backward()
    sched = Tensor.schedule(loss, l1.weight.grad, l1.bias.grad, l2.weight.grad, l2.bias.grad)
    # (each 32x256 value stored: the relu and the gradient into it; none is the bare product)
    values = [st.src[1] for si in sched if si.ast.op.name == "SINK" for st, buf in zip(si.ast.src, si.bufs)
              if buf.size == 32 * 256]
    assert len(values) == 2 and not any(v.op.name == "REDUCE" for v in values), [v.op for v in values]
    assert any(v.op.name == "MAX" for v in values)
