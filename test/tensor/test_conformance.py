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
    ("max_nan_dim", lambda x: x.max(1), lambda x: x.max(1)[0],
     [[[1.0, NAN, 2.0], [3.0, 1.0, NAN]]]),
    ("amax_ties_dim", lambda x: x.max(1), lambda x: x.amax(1),
     [[[1.0, 3.0, 3.0], [2.0, 2.0, 1.0]]]),
    ("maximum_ties_nan", lambda x, y: x.maximum(y), torch.maximum,
     [[1.0, 2.0, 3.0, NAN, 1.0], [1.0, 5.0, 0.0, 1.0, NAN]]),
    ("minimum_ties_nan", lambda x, y: x.minimum(y), torch.minimum,
     [[1.0, 2.0, 3.0, NAN, 1.0], [1.0, 5.0, 0.0, 1.0, NAN]]),
    ("pow_base_0", lambda x, y: x.pow(y), torch.pow, [[0.0, 0.0, 0.0, 2.0, 0.0, 0.0], [2.0, 0.0, -1.0, 0.0, 0.5, 1.5]]),
    ("pow_neg_inf_fraction", lambda x, y: x.pow(y), torch.pow, [[-INF, -INF, -2.0], [0.5, -0.5, 0.5]]),
    ("pow_const_sqrt", lambda x: x ** 0.5, lambda x: x ** 0.5, [[0.0, 1.0, 2.0]]),
    ("pow_const_square", lambda x: x ** 2.0, lambda x: x ** 2.0, [[0.0, -1.0, 2.0]]),
    ("pow_const_0", lambda x: x ** 0, lambda x: x ** 0, [[0.0, 1.0, 2.0]]),
    ("rpow_0", lambda x: 0 ** x, lambda x: 0 ** x, [[0.0, 1.0, -2.0]]),
    ("rpow_2_at_0", lambda x: 2 ** x, lambda x: 2 ** x, [[0.0, 1.0, -2.0]]),
    ("copysign_zero", lambda x, y: x.copysign(y), torch.copysign,
     [[1.0, -2.0, 0.0, -0.0, 3.0], [-1.0, 1.0, -1.0, 1.0, 0.0]]),
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

def test_gradient_of_unconnected_target_is_zeros():
    # tinygrad: a target the output doesn't depend on, or reaches only through a comparison or detach, gets zeros
    x = Tensor([1.0, -2.0, 3.0], requires_grad=True)
    for out in (Tensor([4.0]).sum() * 2, x.detach().sum(), (x > 0).float().sum()):
        g, = out.gradient(x)
        np.testing.assert_array_equal(g.numpy(), np.zeros(3, np.float32))
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(3, np.float32))

# *** error types: torch's and tinygrad's (each also an instance of the type raised before, ValueError or TypeError)

X = np.arange(6, dtype=np.float32).reshape(2, 3)
ERRORS = [
    ("cumsum_axis", lambda t: t.cumsum(5), lambda e: e.cumsum(5), IndexError),
    ("cumprod_axis", lambda t: t.cumprod(5), lambda e: e.cumprod(5), IndexError),
    ("flip_axis", lambda t: t.flip(5), lambda e: e.flip(5), IndexError),
    ("permute_axis", lambda t: t.permute(0, 5), lambda e: e.permute(0, 5), IndexError),
    ("squeeze_axis", lambda t: t.squeeze(5), lambda e: e.squeeze(5), IndexError),
    ("roll_axis", lambda t: t.roll(1, 5), lambda e: e.roll(1, 5), IndexError),
    ("diagonal_axis", lambda t: t.diagonal(dim1=0, dim2=5), lambda e: e.diagonal(dim1=0, dim2=5), IndexError),
    ("unfold_axis", lambda t: t.unfold(5, 1, 1), lambda e: e.unfold(5, 1, 1), IndexError),
    ("stack_axis", lambda t: Tensor.stack(t, t, dim=5), lambda e: torch.stack((e, e), dim=5), IndexError),
    ("permute_repeated", lambda t: t.permute(0, 0), lambda e: e.permute(0, 0), RuntimeError),
    ("matmul_shapes", lambda t: t @ t, lambda e: e @ e, RuntimeError),
    ("dot_0d", lambda t: Tensor(2.0).dot(Tensor(3.0)), lambda e: torch.tensor(2.0).dot(torch.tensor(3.0)),
     RuntimeError),
    ("matmul_0d", lambda t: Tensor(2.0) @ t[0], lambda e: torch.tensor(2.0) @ e[0], RuntimeError),
    ("reshape_size", lambda t: t.reshape(4, 2), lambda e: e.reshape(4, 2), RuntimeError),
    ("max_empty_dim", lambda t: Tensor.zeros(0, 3).max(0), lambda e: torch.zeros(0, 3).amax(0), IndexError),
    ("min_empty_dim", lambda t: Tensor.zeros(0, 3).min(0), lambda e: torch.zeros(0, 3).amin(0), IndexError),
    ("argmax_empty_dim", lambda t: Tensor.zeros(0, 3).argmax(0), lambda e: torch.zeros(0, 3).argmax(0), IndexError),
    ("int_pow_negative", lambda t: Tensor([1, 2]) ** -1, lambda e: torch.tensor([1, 2]) ** -1, RuntimeError),
]

@pytest.mark.parametrize("name,f,tf,exc", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_types(name, f, tf, exc):
    with pytest.raises(exc): tf(torch.tensor(X))
    with pytest.raises(exc): f(Tensor(X))

def test_error_types_keep_old_bases():
    # programs written against the earlier types still catch these
    with pytest.raises(ValueError, match="matmul shape mismatch"): Tensor(X) @ Tensor(X)
    with pytest.raises(ValueError, match="reshape"): Tensor(X).reshape(4, 2)
    with pytest.raises(ValueError, match="empty"): Tensor.zeros(0).argmax()
    # tinygrad: a shift (or bitwise op) with a float operand is a RuntimeError
    for f in (lambda t: t << 1, lambda t: t >> 1, lambda t: Tensor([1, 2]) << 1.5, lambda t: t & 1):
        with pytest.raises(RuntimeError, match="integer"): f(Tensor(X))
        with pytest.raises(TypeError, match="integer"): f(Tensor(X))

# *** result dtypes: tinygrad's

def test_index_dtypes_default_int():
    x = Tensor(np.array([[0.0, 1.5, 0.0], [2.0, 0.0, -2.0]], np.float32))
    assert Tensor.arange(5).dtype == dtypes.default_int == dtypes.int32
    assert Tensor.arange(1, 5, 2).dtype == dtypes.int32 and Tensor.arange(0, 2, 0.5).dtype == dtypes.default_float
    assert x.argmax().dtype == x.argmin(1).dtype == dtypes.int32
    nz = x.nonzero()
    assert nz.dtype == dtypes.int32
    assert nz.tolist() == torch.tensor(x.numpy()).nonzero().tolist()
    nz4 = Tensor([0, 1, 2]).nonzero(size=4)
    assert nz4.dtype == dtypes.int32 and nz4.tolist() == [[1], [2], [0], [0]]
    img = np.random.RandomState(1).randn(1, 2, 4, 6).astype(np.float32)
    out, ind = Tensor(img).max_pool2d(2, return_indices=True)
    tout, tind = F.max_pool2d(torch.tensor(img), 2, return_indices=True)
    assert ind.dtype == dtypes.int32
    np.testing.assert_array_equal(ind.numpy(), tind.numpy())
    np.testing.assert_array_equal(out.numpy(), tout.numpy())
    assert Tensor([0.5, 0.5]).multinomial(3, replacement=True).dtype == dtypes.int32

def test_sum_prod_dtype_argument():
    assert Tensor([1, 2, 3]).sum(dtype=dtypes.float32).dtype == dtypes.float32
    s = Tensor([100, 100, 100], dtype=dtypes.int8).sum(dtype=dtypes.int16)
    assert s.dtype == dtypes.int16 and s.item() == 300
    p = Tensor([1, 2, 3]).prod(dtype=dtypes.float32)
    assert p.dtype == dtypes.float32 and p.item() == 6.0
    assert (Tensor([1, 2, 3]) ** 2).dtype == dtypes.int32 and (Tensor([1, 2, 3]) ** 2).tolist() == [1, 4, 9]
    assert (2 ** Tensor([1, 2, 3])).tolist() == [2, 4, 8]
    assert (Tensor([1, 2, 3], dtype=dtypes.int8) ** 2).dtype == dtypes.int8

# *** accepted inputs

def test_reshape_none_keeps_dim():
    t = Tensor(X)
    assert t.reshape(None, 3).shape == (2, 3) and t.reshape(2, None).shape == (2, 3)
    assert t.reshape(None, 3, 1).tolist() == X.reshape(2, 3, 1).tolist()
    with pytest.raises(IndexError, match="None"): t.reshape(6, 1, None)

@pytest.mark.parametrize("shape,size,mode", [((1, 2, 5, 7), (3, 9), "nearest"), ((1, 1, 5, 5), (7, 3), "nearest-exact"),
                                             ((2, 1, 4, 6), (8, 3), "nearest")])
def test_interpolate_uint8_nearest(shape, size, mode):
    a = np.random.RandomState(0).randint(0, 256, shape).astype(np.uint8)
    out = Tensor(a).interpolate(size, mode=mode)
    ref = F.interpolate(torch.tensor(a), size=size, mode=mode).numpy()
    assert out.dtype == dtypes.uint8
    np.testing.assert_array_equal(out.numpy(), ref)

def test_interpolate_uint8_linear():
    a = np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4)
    out = Tensor(a).interpolate((3, 3))
    assert out.dtype == dtypes.uint8
    np.testing.assert_array_equal(out.numpy(), F.interpolate(torch.tensor(a), size=(3, 3), mode="bilinear").numpy())

def test_interpolate_uint8_within_one_of_torch():
    # torch's uint8 kernel rounds fixed-point weights; a rounding of the exact weights is at most 1 away from it
    a = np.random.RandomState(0).randint(0, 256, (2, 2, 6, 8)).astype(np.uint8)
    out = Tensor(a).interpolate((9, 13)).numpy()
    ref = F.interpolate(torch.tensor(a), size=(9, 13), mode="bilinear").numpy()
    assert out.dtype == np.uint8 and np.abs(out.astype(np.int32) - ref).max() <= 1
