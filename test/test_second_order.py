"""Gradients of gradients against torch.autograd for the functions whose first derivative is written by hand (erf,
the inverse trigonometric and hyperbolic functions, fmod, copysign): the hand-written derivative must itself be
differentiable."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor

@pytest.mark.parametrize("name,lo,hi", [("erf", -2, 2), ("asin", -0.9, 0.9), ("acos", -0.9, 0.9), ("asinh", -3, 3),
                                        ("acosh", 1.1, 4), ("atanh", -0.9, 0.9)])
def test_unary_grad_of_grad(name, lo, hi):
    a = np.random.default_rng(0).uniform(lo, hi, 9).astype(np.float32)
    x = Tensor(a, requires_grad=True)
    (g,) = (getattr(x, name)() * x).sum().gradient(x)
    (gg,) = g.square().sum().gradient(x)
    t = torch.tensor(a, requires_grad=True)
    (tg,) = torch.autograd.grad((getattr(t, name)() * t).sum(), t, create_graph=True)
    (tgg,) = torch.autograd.grad(tg.square().sum(), t)
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gg.numpy(), tgg.numpy(), rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("name", ["fmod", "copysign"])
def test_binary_grad_of_grad(name):
    a, b = np.array([1.5, -2.5, 3.0, 0.7], np.float32), np.array([1.0, 1.0, -2.0, -0.3], np.float32)
    x, y = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
    gx, gy = (getattr(x, name)(y) * x * y).sum().gradient(x, y)
    ggx, ggy = (gx.square() + gy).sum().gradient(x, y)
    tx, ty = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    tgx, tgy = torch.autograd.grad((getattr(torch, name)(tx, ty) * tx * ty).sum(), (tx, ty), create_graph=True)
    tggx, tggy = torch.autograd.grad((tgx.square() + tgy).sum(), (tx, ty))
    for got, ref in ((gx, tgx), (gy, tgy), (ggx, tggx), (ggy, tggy)):
        np.testing.assert_allclose(got.numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-5)

def test_values_stay_exact_at_signed_zeros():
    z = Tensor([-0.0, 0.0])
    assert [np.signbit(v) for v in z.asinh().numpy()] == [True, False]
    assert [np.signbit(v) for v in z.erf().numpy()] == [True, False]
