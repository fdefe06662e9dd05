"""relu's gradient against torch's for every input: zeros, negative zeros, tiny values, nans and infinities included,
and through a product with a bias."""
import numpy as np
import torch
from fusegrad import Tensor

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
    # relu over a product with a bias, against torch
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
