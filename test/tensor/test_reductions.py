"""Statistics, scans, sorting and selection compared with torch (CPU): values, dtypes, indices and gradients on random
inputs, long rows (the blocked scan), nan/inf, ties (stability), empty and 0-d tensors, negative and non-last dims,
non-contiguous inputs and errors.

Compiles dominate the run time, so the main cases are built lazily and realized in one batch by a fixture."""
from __future__ import annotations
from typing import Callable
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes

torch.set_num_threads(1)

def _rand(shape: tuple[int, ...], seed: int, low: float = -2.0, high: float = 2.0, dt: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(dt)


# (name, fusegrad fn, torch fn, input shape, input range): differentiable reductions and scans, checked in float32
# and float64 with gradients
CASES: list[tuple[str, Callable, Callable, tuple[int, ...], tuple[float, float]]] = [
    ("prod", lambda x: x.prod(), lambda x: x.prod(), (2, 3), (0.5, 1.5)),
    ("prod_axis", lambda x: x.prod(1, keepdim=True), lambda x: x.prod(1, keepdim=True), (3, 4), (-2, 2)),
    ("prod_neg_axis", lambda x: x.prod(-2), lambda x: x.prod(-2), (3, 4, 2), (-2, 2)),
    ("var", lambda x: x.var(), lambda x: x.var(), (3, 4), (-2, 2)),
    ("var_axis", lambda x: x.var((0, 2), keepdim=True), lambda x: x.var((0, 2), keepdim=True), (3, 4, 2), (-2, 2)),
    ("var_corr0", lambda x: x.var(1, correction=0), lambda x: x.var(1, correction=0), (3, 4), (-2, 2)),
    ("std", lambda x: x.std(0), lambda x: x.std(0), (5, 3), (-2, 2)),
    ("std_corr2", lambda x: x.std(-1, correction=2), lambda x: x.std(-1, correction=2), (3, 6), (-2, 2)),
    ("var_mean", lambda x: x.var_mean(1)[0] * 2 + x.var_mean(1)[1],
     lambda x: torch.var_mean(x, 1)[0] * 2 + torch.var_mean(x, 1)[1], (3, 4), (-2, 2)),
    ("std_mean", lambda x: x.std_mean(0, correction=0)[0] + 3 * x.std_mean(0, correction=0)[1],
     lambda x: torch.std_mean(x, 0, correction=0)[0] + 3 * torch.std_mean(x, 0, correction=0)[1], (4, 3), (-2, 2)),
    ("logsumexp", lambda x: x.logsumexp(), lambda x: x.logsumexp((0, 1)), (3, 4), (-50, 50)),
    ("logsumexp_axis", lambda x: x.logsumexp(1, keepdim=True), lambda x: x.logsumexp(1, keepdim=True), (3, 4),
     (-50, 50)),
    ("softmin", lambda x: x.softmin(0), lambda x: torch.nn.functional.softmin(x, 0), (3, 4), (-2, 2)),
    ("cumsum", lambda x: x.cumsum(1), lambda x: x.cumsum(1), (3, 7), (-2, 2)),
    ("cumsum_axis0", lambda x: x.cumsum(), lambda x: x.cumsum(0), (5, 3), (-2, 2)),
    ("cumsum_long", lambda x: x.cumsum(-1), lambda x: x.cumsum(-1), (2, 300), (-2, 2)),
    ("cumprod", lambda x: x.cumprod(0), lambda x: x.cumprod(0), (6, 2), (0.5, 1.5)),
    ("cumprod_long", lambda x: x.cumprod(1), lambda x: x.cumprod(1), (2, 100), (0.9, 1.1)),
    ("cummax", lambda x: x.cummax(1)[0], lambda x: x.cummax(1)[0], (3, 9), (-2, 2)),
    ("cummin", lambda x: x.cummin(0)[0], lambda x: x.cummin(0)[0], (9, 2), (-2, 2)),
    ("logcumsumexp", lambda x: x.logcumsumexp(1), lambda x: x.logcumsumexp(1), (3, 8), (-30, 30)),
    ("logcumsumexp_long", lambda x: x.logcumsumexp(), lambda x: x.logcumsumexp(0), (150, 2), (-30, 30)),
    ("sort", lambda x: x.sort()[0] * Tensor.arange(6).float().cast(x.dtype),
     lambda x: x.sort()[0] * torch.arange(6).to(x.dtype), (3, 6), (-2, 2)),
    ("sort_desc_dim0", lambda x: x.sort(0, descending=True)[0][:2], lambda x: x.sort(0, descending=True)[0][:2],
     (5, 3), (-2, 2)),
    ("topk", lambda x: x.topk(3)[0] * 2, lambda x: x.topk(3)[0] * 2, (3, 7), (-2, 2)),
    ("topk_smallest_dim0", lambda x: x.topk(2, 0, largest=False)[0], lambda x: x.topk(2, 0, largest=False)[0],
     (5, 3), (-2, 2)),
]

# (name, fusegrad fn, torch fn, input): results with indices or integer values, compared exactly
INT_DATA = np.random.default_rng(7).integers(-3, 4, size=(4, 12)).astype(np.int32)
TIES = np.array([[2.0, 1.0, 2.0, float("nan"), 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1.0]])
LONG = np.random.default_rng(8).integers(-50, 50, size=(2, 5000)).astype(np.int32)
EXACT: list[tuple[str, Callable, Callable, np.ndarray]] = [
    ("cummax_idx", lambda x: x.cummax(1), lambda x: x.cummax(1), INT_DATA),
    ("cummin_idx", lambda x: x.cummin(-1), lambda x: x.cummin(-1), INT_DATA),
    ("cummax_nan", lambda x: x.cummax(1), lambda x: x.cummax(1), TIES),
    ("cummin_nan", lambda x: x.cummin(1), lambda x: x.cummin(1), TIES),
    ("cummax_long", lambda x: x.cummax(1), lambda x: x.cummax(1), LONG),
    ("cumsum_int", lambda x: x.cumsum(1), lambda x: x.cumsum(1).int(), INT_DATA),
    ("cumsum_long", lambda x: x.cumsum(1), lambda x: x.cumsum(1).int(), LONG),
    ("cumprod_int", lambda x: x.cumprod(1), lambda x: x.cumprod(1).int(), INT_DATA[:, :6]),
    ("sort_int", lambda x: x.sort(1), lambda x: x.sort(stable=True, dim=1), INT_DATA),
    ("sort_int_desc", lambda x: x.sort(0, descending=True), lambda x: x.sort(stable=True, dim=0, descending=True),
     INT_DATA),
    ("sort_nan", lambda x: x.sort(), lambda x: x.sort(stable=True), TIES),
    ("sort_nan_desc", lambda x: x.sort(descending=True), lambda x: x.sort(stable=True, descending=True), TIES),
    ("argsort", lambda x: x.argsort(), lambda x: torch.sort(x, stable=True)[1], INT_DATA),
    ("argsort_desc", lambda x: x.argsort(0, True), lambda x: torch.sort(x, stable=True, dim=0, descending=True)[1],
     INT_DATA),
    ("sort_view", lambda x: x.T.flip(1).sort(-1), lambda x: x.T.flip(1).sort(stable=True, dim=-1), INT_DATA),
    # among equal values topk keeps the first ones (as a stable descending sort)
    ("topk_int", lambda x: x.topk(2, 1), lambda x: tuple(r[:, :2] for r in torch.sort(x, stable=True, dim=1,
                                                                                        descending=True)), INT_DATA),
    ("prod_int", lambda x: x.prod(1), lambda x: x.prod(1).int(), INT_DATA[:, :5]),
    ("any", lambda x: (x > 2).any(1), lambda x: (x > 2).any(1), INT_DATA),
    ("all", lambda x: (x > -3).all(0), lambda x: (x > -3).all(0), INT_DATA),
    ("any_all_float", lambda x: x.any(), lambda x: x.any(), TIES),
    ("cumsum_bool", lambda x: (x > 0).cumsum(1), lambda x: (x > 0).cumsum(1).int(), INT_DATA),
    ("cummax_bool", lambda x: (x > 0).cummax(1)[0], lambda x: (x > 0).cummax(1)[0], INT_DATA),
]

def _torch_grad(fn: Callable, x_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    t = torch.tensor(x_np, requires_grad=True)
    out = fn(t)
    # a fixed, non-uniform seed so permutations of the gradient show
    seed = torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape)
    (g,) = torch.autograd.grad(out, t, grad_outputs=seed)
    return out.detach().numpy(), g.numpy()

@pytest.fixture(scope="module")
def realized() -> dict:
    res: dict = {}
    for i, (name, fg, _, shape, (lo, hi)) in enumerate(CASES):
        for dt in ("float32", "float64"):
            x_np = _rand(shape, i, lo, hi, dt)
            x = Tensor(x_np)
            out = fg(x)
            seed = Tensor.arange(1, out.numel() + 1).cast(out.dtype).reshape(out.shape)
            res[(name, dt)] = (x_np, out, (out * seed).sum().gradient(x)[0])
    for name, fg, _, data in EXACT:
        r = fg(Tensor(data))
        res[name] = r if isinstance(r, tuple) else (r,)
    Tensor.realize(*[t for v in res.values() for t in v if isinstance(t, Tensor)])
    return res

@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_differentiable(realized, case, dt):
    name, _, tfn, _, _ = case
    x_np, out, grad = realized[(name, dt)]
    exp, exp_g = _torch_grad(tfn, x_np)
    tol = 1e-5 if dt == "float32" else 1e-10
    assert out.shape == exp.shape and out.dtype == (dtypes.float32 if dt == "float32" else dtypes.float64)
    np.testing.assert_allclose(out.numpy(), exp, rtol=tol, atol=tol)
    np.testing.assert_allclose(grad.numpy(), exp_g, rtol=tol * 10, atol=tol * 10)

@pytest.mark.parametrize("case", EXACT, ids=[c[0] for c in EXACT])
def test_exact(realized, case):
    name, _, tfn, data = case
    exp = tfn(torch.tensor(data))
    exp = tuple(exp) if isinstance(exp, tuple) else (exp,)
    got = realized[name]
    assert len(got) == len(exp)
    for g, e in zip(got, exp):
        assert g.shape == tuple(e.shape)
        if e.dtype == torch.int64: assert g.dtype == dtypes.int32  # indices are int32, as argmax's
        np.testing.assert_array_equal(g.numpy(), e.numpy())

def test_scan_sort_on_special_values():
    x_np = np.array([1.0, float("inf"), -2.0, float("-inf"), float("nan"), 3.0])
    x, t = Tensor(x_np), torch.tensor(x_np)
    outs = [x.cumsum(), x.logcumsumexp(), x.logsumexp(), Tensor(x_np[:4]).logsumexp(), x.cumprod(0),
            Tensor([float("-inf")] * 3).logsumexp(), Tensor([float("-inf"), 1.0]).logcumsumexp()]
    Tensor.realize(*outs)
    exps = [t.cumsum(0), t.logcumsumexp(0), t.logsumexp(0), t[:4].logsumexp(0), t.cumprod(0),
            torch.tensor([float("-inf")] * 3).logsumexp(0), torch.tensor([float("-inf"), 1.0]).logcumsumexp(0)]
    for o, e in zip(outs, exps): np.testing.assert_allclose(o.numpy(), e.numpy(), rtol=1e-12, equal_nan=True)

@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
def test_empty_and_0d():
    e, s = Tensor.zeros(0, 3), Tensor(2.5)
    outs = [e.prod(0), e.any(0), e.all(0), e.cumsum(0), e.sort(0)[0], e.logsumexp(0), s.cumsum(), s.cummax()[1],
            s.sort()[0], s.topk(1)[0], s.prod(), e.var(0), Tensor.zeros(1, 3).std(0)]
    Tensor.realize(*outs)
    te, ts = torch.zeros(0, 3), torch.tensor(2.5)
    exps = [te.prod(0), te.any(0), te.all(0), te.cumsum(0), te.sort(0)[0], te.logsumexp(0), ts.cumsum(0),
            ts.cummax(0)[1], ts.sort()[0], ts.topk(1)[0], ts.prod(), te.var(0), torch.zeros(1, 3).std(0)]
    for o, ex in zip(outs, exps):
        assert o.shape == tuple(ex.shape)
        np.testing.assert_allclose(o.numpy(), ex.numpy(), equal_nan=True)

def test_dtypes():
    i8, b, h = Tensor([1, 2, 3], dtype=dtypes.int8), Tensor([True, False, True]), Tensor([0.5, 1.5], dtype=dtypes.half)
    assert i8.prod().dtype == dtypes.int8 and b.prod().dtype == dtypes.bool and b.cumsum().dtype == dtypes.int32
    # the product stays in the tensor's dtype, wrapping as numpy's product in that dtype does
    big = np.array([[100, 100, 3], [-7, 5, 0], [127, 127, 127]], dtype=np.int8)
    for dt in (np.int8, np.uint8, np.int16):
        assert Tensor(big.astype(dt)).prod(1).tolist() == np.prod(big.astype(dt), axis=1, dtype=dt).tolist()
    bools = np.array([[True, True], [True, False], [False, False]])
    assert Tensor(bools).prod(1).tolist() == np.prod(bools, axis=1).astype(bool).tolist()
    assert Tensor(bools[:0]).prod(0).tolist() == [True, True]
    assert i8.prod(dtype=dtypes.int64).item() == 6 and i8.prod(dtype=dtypes.int64).dtype == dtypes.int64
    assert i8.prod(dtype=dtypes.float32).dtype == dtypes.float32
    assert h.prod().dtype == h.cumsum().dtype == h.var().dtype == h.std_mean()[1].dtype == dtypes.half
    assert h.logsumexp().dtype == h.logcumsumexp().dtype == h.sort()[0].dtype == dtypes.half
    assert i8.logsumexp().dtype == dtypes.float32 and i8.sort()[0].dtype == dtypes.int8
    assert b.sort()[0].dtype == dtypes.bool and b.sort()[0].tolist() == [False, True, True]
    np.testing.assert_allclose(h.var().float().numpy(), torch.tensor([0.5, 1.5]).half().var().float().numpy())
    np.testing.assert_allclose(i8.logsumexp().numpy(), torch.tensor([1.0, 2, 3]).logsumexp(0).numpy(), rtol=1e-6)
    assert Tensor([[1, 2], [3, 4]]).prod(1).tolist() == [2, 12]

def test_errors():
    x = Tensor([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(IndexError, match="axis"): x.cumsum(2)
    with pytest.raises(IndexError, match="axis"): x.sort(-3)
    with pytest.raises(IndexError, match="axis"): x.cummax(5)
    with pytest.raises(ValueError, match="k=3"): x.topk(3)
    with pytest.raises(ValueError, match="k=-1"): x.topk(-1)
    with pytest.raises(TypeError, match="int"): x.cumsum(1.0)
    with pytest.raises(TypeError, match="floating point"): Tensor([1, 2]).var()
    with pytest.raises(TypeError, match="floating point"): Tensor([1, 2]).std_mean()
    with pytest.raises(ValueError, match="repeated"): x.prod((0, 0))

@pytest.mark.parametrize("dt", ["float32", "int8"])
def test_bitonic_sort_network(monkeypatch, dt):
    # rows above the counting limit take the bitonic network: lower the limit to check it on short rows
    import fusegrad.tensor.reduce as reduce_mod
    monkeypatch.setattr(reduce_mod, "_SORT_COUNT_LIMIT", 4)
    rng = np.random.default_rng(3)
    x_np = rng.integers(0 if dt == "uint32" else -4, 5, size=(2, 13)).astype(dt)
    if dt.startswith("float"):
        x_np[0, 3] = x_np[1, 5] = x_np[1, 7] = np.nan
        x_np[0, 0], x_np[0, 1] = -0.0, 0.0
    x, t = Tensor(x_np), torch.tensor(x_np.astype(np.int64) if dt == "uint32" else x_np)
    outs = [*x.sort(1), *x.sort(-1, descending=True), *x.topk(4, 1), *x.T.sort(0)]
    Tensor.realize(*outs)
    exps = [*t.sort(stable=True, dim=1), *t.sort(stable=True, dim=-1, descending=True),
            *(r[:, :4] for r in t.sort(stable=True, dim=1, descending=True)), *t.T.sort(stable=True, dim=0)]
    for o, e in zip(outs, exps):
        assert o.dtype == (x.dtype if e.dtype != torch.int64 or o is outs[0] else dtypes.int32) or o.dtype == x.dtype
        np.testing.assert_array_equal(o.numpy().astype(np.float64), e.numpy().astype(np.float64))
    np.testing.assert_array_equal(np.signbit(outs[0].numpy()), np.signbit(exps[0].numpy()))

@pytest.mark.slow  # scheduling this backward graph takes about a minute
def test_bitonic_sort_gradient(monkeypatch):
    import fusegrad.tensor.reduce as reduce_mod
    monkeypatch.setattr(reduce_mod, "_SORT_COUNT_LIMIT", 4)
    x_np = _rand((2, 6), 11)
    x = Tensor(x_np)
    out = x.sort(1, descending=True)[0] * Tensor.arange(6).float()
    (g,) = out.sum().gradient(x)
    t = torch.tensor(x_np, requires_grad=True)
    (tg,) = torch.autograd.grad((t.sort(1, descending=True)[0] * torch.arange(6)).sum(), t)
    np.testing.assert_allclose(g.numpy(), tg.numpy())

def test_outputs_realized_one_at_a_time():
    # values and indices realized separately (each realization plans memory for its own kernels only)
    x_np = np.random.default_rng(5).integers(-50, 50, size=(2, 300)).astype(np.int32)
    t = torch.tensor(x_np)
    v, i = Tensor(x_np).cummax(1)
    assert v.tolist() == t.cummax(1)[0].tolist() and i.tolist() == t.cummax(1)[1].tolist()
    v, i = Tensor(x_np).sort(1)
    assert i.tolist() == t.sort(stable=True, dim=1)[1].tolist() and v.tolist() == t.sort(stable=True, dim=1)[0].tolist()

def test_signed_zeros_and_zero_gradients():
    x_np = np.array([[0.0, -0.0, 2.0, -1.0], [3.0, 0.0, -2.0, 0.5]])
    x, t = Tensor(x_np), torch.tensor(x_np, requires_grad=True)
    for desc in (False, True):
        v = x.sort(1, descending=desc)[0].numpy()
        exp = torch.sort(t, stable=True, dim=1, descending=desc)[0].detach().numpy()
        np.testing.assert_array_equal(np.signbit(v), np.signbit(exp))
    # products with zeros: the gradient of the zero factor is the product of the others
    outs = [x.prod(1), x.cumprod(1), x.prod()]
    seeds = [np.arange(1.0, 3.0), np.arange(1.0, 9.0).reshape(2, 4), np.array(2.0)]
    grads = [(o * Tensor(s)).sum().gradient(x)[0] for o, s in zip(outs, seeds)]
    Tensor.realize(*outs, *grads)
    touts = [t.prod(1), t.cumprod(1), t.prod()]
    for o, g, to, s in zip(outs, grads, touts, seeds):
        (tg,) = torch.autograd.grad((to * torch.tensor(s)).sum(), t)
        np.testing.assert_allclose(o.numpy(), to.detach().numpy())
        np.testing.assert_allclose(g.numpy(), tg.numpy())
