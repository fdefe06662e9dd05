"""Op-level conformance with tinygrad 0.14 and PyTorch: gradients at ties and kinks (torch's conventions), error types,
result dtypes and accepted inputs. Values and gradients are checked against torch; dtypes and error types against
tinygrad's documented behaviour."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Tensor, dtypes

NAN, INF = float("nan"), float("inf")

def _grads(f, tf, *vals):
    """Value and gradients of sum(f(*inputs)) in fusegrad and in torch, for float32 inputs `vals`."""
    ins = [Tensor(np.array(v, dtype=np.float32), requires_grad=True) for v in vals]
    out = f(*ins)
    out.sum().backward()
    tins = [torch.tensor(np.array(v, dtype=np.float32), requires_grad=True) for v in vals]
    tout = tf(*tins)
    tout.sum().backward()
    return (out.numpy(), [t.grad.numpy() for t in ins]), (tout.detach().numpy(), [t.grad.numpy() for t in tins])

# (name, fusegrad function, torch function, inputs): each at the ties, bounds and special values where the derivative
# is a convention
KINKS = [
    ("clip_bounds", lambda x: x.clip(0.0, 2.0), lambda x: x.clamp(0.0, 2.0), [[-1.0, 0.0, 1.0, 2.0, 3.0, NAN]]),
    ("clip_min_only", lambda x: x.clip(min_=1.0), lambda x: x.clamp(min=1.0), [[0.0, 1.0, 2.0]]),
    ("clip_max_only", lambda x: x.clip(max_=1.0), lambda x: x.clamp(max=1.0), [[0.0, 1.0, 2.0]]),
    ("clip_tensor_bounds", lambda x, lo, hi: x.clip(lo, hi), lambda x, lo, hi: x.clamp(lo, hi),
     [[1.0, 2.0, 3.0, 4.0, 2.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0, 4.0], [3.0, 3.0, 3.0, 3.0, 3.0, 2.0]]),
    ("relu_at_0", lambda x: x.relu(), lambda x: x.relu(), [[-1.0, 0.0, -0.0, 1.0]]),
    ("relu6_bounds", lambda x: x.relu6(), F.relu6, [[-1.0, 0.0, 3.0, 6.0, 7.0]]),
    ("hardtanh_bounds", lambda x: x.hardtanh(), F.hardtanh, [[-2.0, -1.0, 0.0, 1.0, 2.0]]),
    ("hardsigmoid_bounds", lambda x: x.hardsigmoid(), F.hardsigmoid, [[-4.0, -3.0, 0.0, 3.0, 4.0]]),
    ("hardswish_bounds", lambda x: x.hardswish(), F.hardswish, [[-4.0, -3.0, 0.0, 3.0, 4.0]]),
    ("leaky_relu_at_0", lambda x: x.leaky_relu(0.1), lambda x: F.leaky_relu(x, 0.1), [[-1.0, 0.0, 1.0]]),
    ("softplus_at_0", lambda x: x.softplus(), F.softplus, [[-100.0, 0.0, 100.0]]),
    ("max_ties", lambda x: x.max(), lambda x: x.max(), [[1.0, 3.0, 3.0, 2.0]]),
    ("min_ties", lambda x: x.min(), lambda x: x.min(), [[1.0, 1.0, 3.0, 2.0]]),
    ("max_nan", lambda x: x.max(), lambda x: x.max(), [[1.0, NAN, 2.0, NAN]]),
    # (torch's amax(dim) gives nan gradients where the maximum is nan; max(dim) the nan itself, as here)
    ("max_nan_dim", lambda x: x.max(1), lambda x: x.max(1)[0], [[[1.0, NAN, 2.0], [3.0, 1.0, NAN]]]),
    ("amax_ties_dim", lambda x: x.max(1), lambda x: x.amax(1), [[[1.0, 3.0, 3.0], [2.0, 2.0, 1.0]]]),
    ("maximum_ties_nan", lambda x, y: x.maximum(y), torch.maximum, [[1.0, 2.0, 3.0, NAN, 1.0], [1.0, 5.0, 0.0, 1.0, NAN]]),
    ("minimum_ties_nan", lambda x, y: x.minimum(y), torch.minimum, [[1.0, 2.0, 3.0, NAN, 1.0], [1.0, 5.0, 0.0, 1.0, NAN]]),
    ("pow_base_0", lambda x, y: x.pow(y), torch.pow, [[0.0, 0.0, 0.0, 2.0, 0.0, 0.0], [2.0, 0.0, -1.0, 0.0, 0.5, 1.5]]),
    ("pow_neg_inf_fraction", lambda x, y: x.pow(y), torch.pow, [[-INF, -INF, -2.0], [0.5, -0.5, 0.5]]),
    ("pow_const_sqrt", lambda x: x ** 0.5, lambda x: x ** 0.5, [[0.0, 1.0, 2.0]]),
    ("pow_const_square", lambda x: x ** 2.0, lambda x: x ** 2.0, [[0.0, -1.0, 2.0]]),
    ("pow_const_0", lambda x: x ** 0, lambda x: x ** 0, [[0.0, 1.0, 2.0]]),
    ("rpow_0", lambda x: 0 ** x, lambda x: 0 ** x, [[0.0, 1.0, -2.0]]),
    ("rpow_2_at_0", lambda x: 2 ** x, lambda x: 2 ** x, [[0.0, 1.0, -2.0]]),
    ("copysign_zero", lambda x, y: x.copysign(y), torch.copysign, [[1.0, -2.0, 0.0, -0.0, 3.0], [-1.0, 1.0, -1.0, 1.0, 0.0]]),
    ("sign", lambda x: x.sign(), torch.sign, [[-1.0, 0.0, 2.0]]),
    ("comparison_only", lambda x, y: (x < y).float() * x + (x == y).float() * y,
     lambda x, y: (x < y).float() * x + (x == y).float() * y, [[1.0, 2.0, 3.0], [1.0, 0.0, 4.0]]),
    ("cummax_ties", lambda x: x.cummax(0)[0], lambda x: x.cummax(0)[0], [[1.0, 3.0, 3.0, 2.0, 5.0]]),
    ("cummin_ties", lambda x: x.cummin(0)[0], lambda x: x.cummin(0)[0], [[3.0, 1.0, 1.0, 2.0, 0.0]]),
    ("sigmoid_extreme", lambda x: x.sigmoid(), torch.sigmoid, [[-1000.0, 1000.0, -100.0, 100.0]]),
    ("tanh_extreme", lambda x: x.tanh(), torch.tanh, [[-1000.0, 1000.0, 0.0]]),
    ("gelu_extreme", lambda x: x.gelu(), lambda x: F.gelu(x, approximate="tanh"), [[-1e4, -100.0, 100.0, 1e4]]),
    ("mish_extreme", lambda x: x.mish(), F.mish, [[-1000.0, 1000.0]]),
    ("swish_extreme", lambda x: x.silu(), F.silu, [[-1000.0, 1000.0]]),
]

@pytest.mark.parametrize("name,f,tf,vals", KINKS, ids=[k[0] for k in KINKS])
def test_gradient_conventions(name, f, tf, vals):
    (v, g), (tv, tg) = _grads(f, tf, *vals)
    np.testing.assert_allclose(v, tv, rtol=1e-5, atol=1e-6, equal_nan=True)
    for a, b in zip(g, tg): np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)

def test_cummin_gradient_long_rows():
    # rows longer than one scan window, many ties: each running value's gradient goes to torch's index
    a = np.random.RandomState(0).randint(0, 5, (3, 100)).astype(np.float32)
    w = np.arange(100, dtype=np.float32)
    x = Tensor(a, requires_grad=True)
    v, i = x.cummin(1)
    (v * Tensor(w)).sum().backward()
    t = torch.tensor(a, requires_grad=True)
    tv, ti = t.cummin(1)
    (tv * torch.tensor(w)).sum().backward()
    np.testing.assert_array_equal(i.numpy(), ti.numpy())
    np.testing.assert_array_equal(x.grad.numpy(), t.grad.numpy())

def test_second_order_through_conventional_rules():
    # the rules are built from differentiable ops: d2/dx2 of sigmoid, tanh and x**y against torch's double backward
    a = np.array([-2.0, -0.5, 0.3, 1.7], dtype=np.float32)
    for f in (lambda x: x.sigmoid(), lambda x: x.tanh(), lambda x: x.abs() ** 1.5, lambda x: 1.5 ** x):
        x = Tensor(a, requires_grad=True)
        g, = f(x).sum().gradient(x)
        gg, = g.sum().gradient(x)
        t = torch.tensor(a, requires_grad=True)
        tg, = torch.autograd.grad(f(t).sum(), t, create_graph=True)
        tgg, = torch.autograd.grad(tg.sum(), t)
        np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gg.numpy(), tgg.numpy(), rtol=1e-4, atol=1e-5)
