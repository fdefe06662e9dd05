"""Functions of many operations (gelu, tanh, erf...) are built as one COMPOSITE node: the node's value and gradients
are torch's, bit for bit those of the same function built operation by operation (track_sources() builds it so),
in as many kernels, and the node is made only where that holds."""
import pickle
import subprocess
import sys
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Tensor, TinyJit, Variable, dtypes, track_sources
from fusegrad.schedule.kernelize import schedule_cache_stats
from fusegrad.schedule.simplify import expand_composites
from fusegrad.uop.ops import Ops

@pytest.fixture(autouse=True)
def _no_sharding_seen(monkeypatch):
    """As in a process that made no sharded tensor (another test of this process may have: then every function is
    built operation by operation, as test_sharded_tensors_build_op_by_op checks)."""
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)

X = np.concatenate([np.random.default_rng(0).standard_normal(60) * 3, [0.0, -0.0, 1e-8, -30.0, 30.0]]) \
    .astype(np.float32).reshape(5, 13)

# name: (fusegrad call, torch call)
FUNCTIONS = {
    "gelu": (lambda t: t.gelu(), lambda t: F.gelu(t, approximate="tanh")),
    "gelu_none": (lambda t: t.gelu(approximate="none"), lambda t: F.gelu(t, approximate="none")),
    "tanh": (lambda t: t.tanh(), torch.tanh),
    "sigmoid": (lambda t: t.sigmoid(), torch.sigmoid),
    "silu": (lambda t: t.silu(), F.silu),
    "exp": (lambda t: t.exp(), torch.exp),
    "erf": (lambda t: t.erf(), torch.erf),
    "sin": (lambda t: t.sin(), torch.sin),
    "softplus": (lambda t: t.softplus(), F.softplus),
    "mish": (lambda t: t.mish(), F.mish),
    "elu": (lambda t: t.elu(), F.elu),
    "asinh": (lambda t: t.asinh(), torch.asinh),
    "abs": (lambda t: t.abs(), torch.abs),
    "sign": (lambda t: t.sign(), torch.sign),
    "floor": (lambda t: t.floor(), torch.floor),
    "round": (lambda t: t.round(), torch.round),
    "log": (lambda t: t.log(), torch.log),
    "rsqrt": (lambda t: t.rsqrt(), torch.rsqrt),
    "softsign": (lambda t: t.softsign(), F.softsign),
    "relu6": (lambda t: t.relu6(), F.relu6),
    "hardtanh": (lambda t: t.hardtanh(), F.hardtanh),
    "hardsigmoid": (lambda t: t.hardsigmoid(), F.hardsigmoid),
    "leaky_relu": (lambda t: t.leaky_relu(), F.leaky_relu),
    "isinf": (lambda t: t.isinf() * t, lambda t: torch.isinf(t) * t),
    # numbers as operands: constants of the operand's shape
    "clip": (lambda t: t.clip(-0.5, 1), lambda t: t.clip(-0.5, 1)),
    "clip_lo": (lambda t: t.clip(-0.5), lambda t: t.clip(-0.5)),
    "clip_hi": (lambda t: t.clip(None, 2), lambda t: t.clip(None, 2)),
    "clip_crossed": (lambda t: t.clip(1.5, -1), lambda t: t.clip(1.5, -1)),
    "leaky_relu_02": (lambda t: t.leaky_relu(0.2), lambda t: F.leaky_relu(t, 0.2)),
}

def _value_and_grad(fn, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = Tensor(x, requires_grad=True)
    y = fn(t)
    (y * Tensor(np.linspace(-1, 1, x.size, dtype=np.float32).reshape(x.shape))).sum().backward()
    return y.numpy(), t.grad.numpy()

@pytest.mark.parametrize("name", FUNCTIONS)
def test_one_node_with_torchs_value_and_gradient(name):
    ours, theirs = FUNCTIONS[name]
    y = ours(Tensor(X)) if name != "isinf" else Tensor(X).isinf()
    # (the node, its operand's buffer and device, a number's constant broadcast to the operand's shape)
    assert y.uop.op is Ops.COMPOSITE and [u.op for u in y.uop.toposort()].count(Ops.COMPOSITE) == 1
    leaves = {Ops.COMPOSITE, Ops.BUFFER, Ops.DEVICE, Ops.CONST, Ops.RESHAPE, Ops.EXPAND}
    assert {u.op for u in y.uop.toposort()} <= leaves
    value, grad = _value_and_grad(ours, X)
    tx = torch.tensor(X, requires_grad=True)
    ty = theirs(tx)
    (ty * torch.linspace(-1, 1, X.size).reshape(X.shape)).sum().backward()
    np.testing.assert_allclose(value, ty.detach().numpy(), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("name", FUNCTIONS)
def test_same_bits_and_kernels_as_built_op_by_op(name):
    ours, _ = FUNCTIONS[name]
    with track_sources():   # (each operation built as it is written: no COMPOSITE node)
        direct = ours(Tensor(X))
        assert all(u.op is not Ops.COMPOSITE for u in direct.uop.toposort())
        direct_value, direct_grad = _value_and_grad(ours, X)
        direct_kernels = len((ours(Tensor(X)) + 1).schedule())
    value, grad = _value_and_grad(ours, X)
    np.testing.assert_array_equal(value.view(np.uint32), direct_value.view(np.uint32))
    np.testing.assert_array_equal(grad.view(np.uint32), direct_grad.view(np.uint32))
    assert len((ours(Tensor(X)) + 1).schedule()) == direct_kernels
    # expanded, the node is the graph the operations make (UOps are hash-consed: the very same nodes)
    operand = Tensor(X[:2]).realize()
    with track_sources(): built = ours(Tensor(operand.uop))
    assert expand_composites(ours(operand).uop) is built.uop

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float64])
def test_other_float_dtypes(dt):
    x = Tensor(X).cast(dt)
    y = x.tanh()
    assert y.uop.op is Ops.COMPOSITE and y.dtype == dt
    want = torch.tanh(torch.tensor(X).to({dtypes.float16: torch.float16, dtypes.bfloat16: torch.bfloat16,
                                          dtypes.float64: torch.float64}[dt]))
    # (half types: the same bits; float64: within an ulp of libm's)
    np.testing.assert_allclose(y.cast(dtypes.float64).numpy(), want.double().numpy(), rtol=3e-16, atol=0)

def test_second_order_gradients():
    for ours, theirs in (FUNCTIONS["tanh"], FUNCTIONS["gelu"], FUNCTIONS["sigmoid"]):
        x = Tensor(X, requires_grad=True)
        g, = ours(x).sum().gradient(x)
        g2, = (g * g).sum().gradient(x)
        tx = torch.tensor(X, requires_grad=True)
        tg, = torch.autograd.grad(theirs(tx).sum(), tx, create_graph=True)
        tg2, = torch.autograd.grad((tg * tg).sum(), tx)
        np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g2.numpy(), tg2.numpy(), rtol=1e-4, atol=1e-5)

def test_a_gradient_seeded_with_the_operand_itself():
    # d/dx sum(tanh'(x) * x) = tanh''(x) * x + tanh'(x): the derivative node's two sources are one node
    x = Tensor(X, requires_grad=True)
    g, = x.tanh().gradient(x, gradient=x)
    g2, = g.sum().gradient(x)
    tx = torch.tensor(X, requires_grad=True)
    tg, = torch.autograd.grad(torch.tanh(tx), tx, grad_outputs=tx, create_graph=True)
    tg2, = torch.autograd.grad(tg.sum(), tx)
    np.testing.assert_allclose(g.numpy(), tg.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g2.numpy(), tg2.numpy(), rtol=1e-4, atol=1e-5)

def test_changing_bounds_are_kernel_parameters():
    a = Tensor(X).realize()
    for lo, hi in ((0.0, 1.0), (-1.0, 0.5)): np.testing.assert_array_equal(a.clip(lo, hi).numpy(), X.clip(lo, hi))
    misses = schedule_cache_stats["misses"]
    for lo, hi in ((-2.0, 2.0), (0.25, 0.75), (-0.1, 3.0)):
        np.testing.assert_array_equal(a.clip(lo, hi).numpy(), X.clip(lo, hi))
    assert schedule_cache_stats["misses"] == misses

def test_made_only_where_it_holds():
    # an int operand: its result dtype follows the default float, which may change before the node is scheduled
    assert Tensor([1, 2, 3]).exp().uop.op is not Ops.COMPOSITE
    np.testing.assert_allclose(Tensor([1, 2, 3]).exp().numpy(), np.exp([1.0, 2.0, 3.0]).astype(np.float32), rtol=1e-6)
    # a number setting (a loop may change it every step: as a constant of the graph it becomes a kernel parameter)
    assert Tensor(X).elu(0.5).uop.op is not Ops.COMPOSITE
    np.testing.assert_allclose(Tensor(X).elu(0.5).numpy(), F.elu(torch.tensor(X), 0.5).numpy(), rtol=1e-6, atol=1e-7)
    # an int tensor clipped, a tensor bound, a bound the dtype can't hold: built operation by operation
    assert Tensor([1, 5, 9]).clip(2, 8).uop.op is not Ops.COMPOSITE
    assert Tensor([1, 5, 9]).clip(2, 8).tolist() == [2, 5, 8]
    assert Tensor(X).clip(Tensor(0.0), 1).uop.op is not Ops.COMPOSITE
    np.testing.assert_array_equal(Tensor(X).cast(dtypes.float16).clip(-1e6, 1e6).numpy(), X.astype(np.float16))
    # a bad setting is refused at the call, every time
    for _ in range(2):
        with pytest.raises(ValueError, match="approximate"): Tensor(X).gelu(approximate="erf")

def test_empty_zero_d_and_symbolic_shapes():
    assert Tensor.zeros(0, 3).gelu().numpy().shape == (0, 3)
    np.testing.assert_allclose(Tensor(0.5).tanh().numpy(), np.tanh(np.float32(0.5)), rtol=1e-7)
    n = Variable("n", 1, 5).bind(3)
    rows = Tensor(X)[:n].sigmoid()
    assert rows.uop.op is Ops.COMPOSITE
    np.testing.assert_allclose(rows.numpy(), torch.sigmoid(torch.tensor(X[:3])).numpy(), rtol=1e-6)

def test_schedule_cache_hit_and_tinyjit():
    a = Tensor(X).realize()
    a.gelu().realize()
    hits = schedule_cache_stats["hits"]
    out = a.gelu().realize()
    assert schedule_cache_stats["hits"] == hits + 1
    np.testing.assert_allclose(out.numpy(), F.gelu(torch.tensor(X), approximate="tanh").numpy(), rtol=2e-6, atol=1e-7)
    step = TinyJit(lambda t: (t.tanh() * 2).realize())
    for i in range(4):
        v = X * (i + 1)
        np.testing.assert_allclose(step(Tensor(v)).numpy(), np.tanh(v) * 2, rtol=2e-6, atol=1e-7)

def test_pickles_as_the_same_node():
    y = Tensor(X).gelu(approximate="none")
    assert pickle.loads(pickle.dumps(y.uop)) is y.uop

def test_nan_inside_is_named_by_debug_nans():
    from fusegrad import Context
    x = Tensor(np.array([2.0, 0.5], dtype=np.float32))
    assert x.acosh().uop.op is Ops.COMPOSITE
    with Context(DEBUG_NANS=1), pytest.raises(FloatingPointError, match="produced NaN"): (x.acosh() + 1).numpy()

def test_sharded_tensors_build_op_by_op():
    # (in a process of its own: the first sharded tensor switches the node off for the rest of the process)
    code = """
import numpy as np
from fusegrad import Tensor
from fusegrad.uop.ops import Ops
x = np.arange(8, dtype=np.float32) / 4
t = Tensor(x).shard(("CPU:0", "CPU:1"), axis=0)
y = t.tanh()
assert all(u.op is not Ops.COMPOSITE for u in y.uop.toposort())
assert Tensor(x).tanh().uop.op is not Ops.COMPOSITE
np.testing.assert_allclose(y.numpy(), np.tanh(x), rtol=1e-6)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

# name: (fusegrad call, torch call) of operands a and b
TWO_OPERANDS = {
    "pow": (lambda a, b: a.pow(b), torch.pow),
    "pow_self": (lambda a, b: a ** a, lambda a, b: a ** a),
    "pow_scalar": (lambda a, b: a ** -1.5, lambda a, b: a ** -1.5),
    "rpow": (lambda a, b: 2.5 ** a, lambda a, b: 2.5 ** a),
    "logaddexp": (lambda a, b: a.logaddexp(b), torch.logaddexp),
}

@pytest.mark.parametrize("name", TWO_OPERANDS)
def test_two_operands(name):
    # operands broadcast first, then one node over both; each operand's gradient is a node of its own (the same
    # operand twice: its whole gradient once)
    A = np.abs(X) + 0.25
    B = np.random.default_rng(1).standard_normal(13).astype(np.float32)
    ours, theirs = TWO_OPERANDS[name]
    a, b = Tensor(A, requires_grad=True), Tensor(B, requires_grad=True)
    y = ours(a, b)
    assert y.uop.op is Ops.COMPOSITE
    y.sum().backward()
    ta, tb = torch.tensor(A, requires_grad=True), torch.tensor(B, requires_grad=True)
    ty = theirs(ta, tb)
    ty.sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    if tb.grad is not None: np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)
    with track_sources():
        a2, b2 = Tensor(A, requires_grad=True), Tensor(B, requires_grad=True)
        direct = ours(a2, b2)
        direct.sum().backward()
        direct_value, direct_grad = direct.numpy(), a2.grad.numpy()
    np.testing.assert_array_equal(y.numpy().view(np.uint32), direct_value.view(np.uint32))
    np.testing.assert_array_equal(a.grad.numpy().view(np.uint32), direct_grad.view(np.uint32))

def test_a_changing_exponent_is_a_kernel_parameter():
    # the exponent is an operand (a constant of the graph), not a setting: once it changes, the schedule cache makes
    # it a parameter, and later values reuse the kernels
    a = Tensor(np.abs(X) + 0.5).realize()
    for p in (0.5, 0.75):
        np.testing.assert_allclose((a ** p).numpy(), (np.abs(X) + 0.5) ** np.float32(p), rtol=2e-6)
    misses = schedule_cache_stats["misses"]
    for p in (1.25, -0.5, 2.5):
        np.testing.assert_allclose((a ** p).numpy(), (np.abs(X) + 0.5) ** np.float32(p), rtol=2e-6)
    assert schedule_cache_stats["misses"] == misses

# name: (fusegrad call, torch call) of operands a (5, 13) and b (3, 13)
SHAPED = {
    "mean": (lambda a, b: a.mean(1), lambda a, b: a.mean(1)),
    "mean_all": (lambda a, b: a.mean(), lambda a, b: a.mean()),
    "mean_axes_keepdim": (lambda a, b: a.mean((0, 1), keepdim=True), lambda a, b: a.mean((0, 1), keepdim=True)),
    "var": (lambda a, b: a.var(0), lambda a, b: a.var(0)),
    "var_correction_0": (lambda a, b: a.var(1, correction=0), lambda a, b: a.var(1, correction=0)),
    "std": (lambda a, b: a.std(), lambda a, b: a.std()),
    "logsumexp": (lambda a, b: a.logsumexp(1), lambda a, b: a.logsumexp(1)),
    "cumsum": (lambda a, b: a.cumsum(1), lambda a, b: a.cumsum(1)),
    "cat": (lambda a, b: a.cat(b), lambda a, b: torch.cat([a, b])),
    "cat_three": (lambda a, b: b.cat(a, b, dim=0), lambda a, b: torch.cat([b, a, b])),
    "argmax": (lambda a, b: a.argmax(1).float() * a.sum(1), lambda a, b: a.argmax(1).float() * a.sum(1)),
    "argmin": (lambda a, b: a.argmin().float() * a.sum(), lambda a, b: a.argmin().float() * a.sum()),
}

@pytest.mark.parametrize("name", SHAPED)
def test_reductions_and_concatenation(name):
    # a result of another shape than the operand's: the node's arg holds it
    A = X
    B = np.random.default_rng(2).standard_normal((3, 13)).astype(np.float32)
    ours, theirs = SHAPED[name]
    a, b = Tensor(A, requires_grad=True), Tensor(B, requires_grad=True)
    y = ours(a, b)
    ta, tb = torch.tensor(A, requires_grad=True), torch.tensor(B, requires_grad=True)
    ty = theirs(ta, tb)
    assert y.shape == tuple(ty.shape)
    assert any(u.op is Ops.COMPOSITE for u in y.uop.toposort())
    w = np.linspace(-1, 1, max(1, ty.numel()), dtype=np.float32).reshape(tuple(ty.shape))
    (y * Tensor(w)).sum().backward()
    (ty * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy(), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    if tb.grad is not None: np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)
    # the same bits as built op by op, value and gradient each realized alone (a node realized by an earlier realize,
    # the mean inside var, is read by a graph that holds it and recomputed by one that holds the composite: its
    # rounding may differ by an ulp)
    def value_and_grad(a, b):
        value = ours(a, b).numpy()
        a2 = Tensor(A, requires_grad=True)
        (ours(a2, b) * Tensor(w)).sum().backward()
        return value, a2.grad.numpy()
    value, grad = value_and_grad(Tensor(A), Tensor(B))
    with track_sources(): direct_value, direct_grad = value_and_grad(Tensor(A), Tensor(B))
    np.testing.assert_array_equal(value.view(np.uint32), direct_value.view(np.uint32))
    np.testing.assert_array_equal(grad.view(np.uint32), direct_grad.view(np.uint32))

def test_shaped_entries_are_per_shape_and_bounded(monkeypatch):
    import sys
    comp = sys.modules["fusegrad.tensor.composite"]   # (the module: fusegrad.tensor.composite names the decorator)
    monkeypatch.setattr(comp, "KNOWN_SIZE", 8)
    for n in range(1, 20):
        x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
        m = Tensor(x).mean(0)
        assert m.uop.op is Ops.COMPOSITE and m.shape == (3,)
        np.testing.assert_allclose(m.numpy(), x.mean(0), rtol=1e-6)
        assert len(comp._known) <= 8
    # an axis list (unhashable) and a symbolic size: built operation by operation
    assert Tensor(X).mean([0, 1]).uop.op is not Ops.COMPOSITE
    rows = Tensor(X)[:Variable("n", 1, 5).bind(3)]
    assert rows.mean(0).uop.op is not Ops.COMPOSITE
    np.testing.assert_allclose(rows.mean(0).numpy(), X[:3].mean(0), rtol=1e-6)

def test_int_and_bool_results_pass_no_gradient():
    # argmax's and isinf's results carry no gradient (their operations' wouldn't): the input's gradient is the other
    # term's alone, -0.0 kept, as torch's
    x = np.array([[1.0, -2.0, 3.0], [0.0, 5.0, -1.0]], dtype=np.float32)
    a = Tensor(x, requires_grad=True)
    assert a.argmax(1).uop.op is Ops.COMPOSITE and a.isinf().uop.op is Ops.COMPOSITE
    ((a.argmax(1).float() * 2).sum() + a.isinf().float().sum() + (a * -0.0).sum()).backward()
    ta = torch.tensor(x, requires_grad=True)
    ((ta.argmax(1).float() * 2).sum() + ta.isinf().float().sum() + (ta * -0.0).sum()).backward()
    np.testing.assert_array_equal(a.grad.numpy().view(np.uint32), ta.grad.numpy().view(np.uint32))
