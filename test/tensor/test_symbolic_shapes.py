"""Symbolic shapes: tensors whose sizes are bound Variables, checked against NumPy for every value, with one compiled
kernel (and one schedule-cache entry) serving them all; TinyJit replays with new Variable values; the errors."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor, TinyJit, Variable
from fusegrad.engine.realize import method_cache
from fusegrad.schedule.kernelize import schedule_cache_stats

rng = np.random.default_rng(0)
A = rng.standard_normal((10, 4)).astype(np.float32)
Q = rng.standard_normal((1, 4)).astype(np.float32)
N = Variable("n", 1, 10)

def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

def _attention(n):
    keys = A[:n]
    return _softmax(Q @ keys.T / 2) @ keys

# (name, fusegrad function of (a, q, bound n), numpy function of (int n))
CASES = [
    ("shrink_sum_rows", lambda a, q, n: a.shrink(((0, n), None)).sum(0), lambda n: A[:n].sum(0)),
    ("shrink_sum_cols", lambda a, q, n: a.shrink(((0, n), None)).sum(1), lambda n: A[:n].sum(1)),
    ("slice_elementwise", lambda a, q, n: a[:n] * 2 + 1, lambda n: A[:n] * 2 + 1),
    ("slice_window", lambda a, q, n: a[n - 1:n], lambda n: A[n - 1:n]),
    ("index_by_variable", lambda a, q, n: a[n - 1], lambda n: A[n - 1]),
    ("reshape_flat", lambda a, q, n: a[:n].reshape(n * 4).sum(), lambda n: A[:n].sum()),
    ("reshape_split", lambda a, q, n: a[:n].reshape(n, 2, 2).sum((1, 2)), lambda n: A[:n].sum(1)),
    ("mean", lambda a, q, n: a[:n].mean(0), lambda n: A[:n].mean(0)),
    ("var", lambda a, q, n: a[:n].var(0, correction=0), lambda n: A[:n].var(0)),
    ("max", lambda a, q, n: a[:n].max(0), lambda n: A[:n].max(0)),
    ("matmul", lambda a, q, n: q @ a[:n].T, lambda n: Q @ A[:n].T),
    ("matmul_reduce_symbolic", lambda a, q, n: a[:n].T @ a[:n], lambda n: A[:n].T @ A[:n]),
    ("softmax", lambda a, q, n: (q @ a[:n].T).softmax(-1), lambda n: _softmax(Q @ A[:n].T)),
    ("attention", lambda a, q, n: (q @ a[:n].T / 2).softmax(-1) @ a[:n], _attention),
    ("sdpa", lambda a, q, n: q.reshape(1, 1, 1, 4).scaled_dot_product_attention(
        a[:n].reshape(1, 1, n, 4), a[:n].reshape(1, 1, n, 4)).reshape(1, 4), _attention),
    ("ones", lambda a, q, n: Tensor.ones(n, 4).sum(0), lambda n: np.full(4, n, np.float32)),
    ("pad", lambda a, q, n: a[:n].pad(((1, 10 - n), None)), lambda n: np.pad(A[:n], ((1, 10 - n), (0, 0)))),
    ("cat", lambda a, q, n: a[:n].cat(a[:2], dim=0).sum(0), lambda n: np.concatenate([A[:n], A[:2]]).sum(0)),
    ("value", lambda a, q, n: Tensor(n) * a[0], lambda n: n * A[0]),
    ("scalar_operand", lambda a, q, n: a[0] + n, lambda n: A[0] + n),
    ("arange", lambda a, q, n: Tensor.arange(n + 2).float().sum(), lambda n: np.float32(sum(range(n + 2)))),
]

@pytest.mark.parametrize("name,fxn,ref", CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_and_compiles_once(name, fxn, ref):
    a, q = Tensor(A).realize(), Tensor(Q).realize()
    compiled = []
    for n in (3, 7, 1, 10, 5):
        before = len(method_cache)
        out = fxn(a, q, N.bind(n))
        got, want = out.numpy(), ref(n)
        assert got.shape == np.shape(want)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"n={n}")
        compiled.append(len(method_cache) - before)
    assert compiled[1:] == [0, 0, 0, 0], f"kernels compiled per value: {compiled}"

def test_schedule_cache_serves_every_value():
    a = Tensor(A).realize()
    (a[:N.bind(2)] * 3).sum(0).numpy()
    hits, misses = schedule_cache_stats["hits"], schedule_cache_stats["misses"]
    for n in range(3, 9): (a[:N.bind(n)] * 3).sum(0).numpy()
    assert schedule_cache_stats["misses"] == misses and schedule_cache_stats["hits"] >= hits + 6

def test_symbolic_shape_shows_and_converts():
    x = Tensor(A)[:N.bind(4)] + 1
    assert x.shape[1] == 4 and repr(x.shape[0]) == "<n n=4>"
    assert x.numpy().shape == (4, 4) and len(x.tolist()) == 4
    np.testing.assert_allclose(np.array(x.tolist()), A[:4] + 1, rtol=1e-6)

def test_realized_symbolic_tensor_is_reused():
    for n in (3, 6):
        b = (Tensor(A)[:N.bind(n)] + 1).realize()  # a buffer sized for n's maximum, holding n rows
        np.testing.assert_allclose((b * 2).sum(0).numpy(), (A[:n] + 1).sum(0) * 2, rtol=1e-5)

def test_gradient_through_symbolic_slice():
    for n in (2, 9):
        a = Tensor(A, requires_grad=True)
        (a[:N.bind(n)] * Tensor(Q)).sum().backward()
        want = np.zeros_like(A)
        want[:n] = Q
        np.testing.assert_allclose(a.grad.numpy(), want)

@pytest.mark.parametrize("device", ["PYTHON", "LLVM"])
def test_other_backends(device):
    for n in (2, 5):
        got = Tensor(A, device=device)[:N.bind(n)].softmax(0).max(0).numpy()
        e = np.exp(A[:n] - A[:n].max(0))
        np.testing.assert_allclose(got, (e / e.sum(0)).max(0), rtol=1e-5)

def test_kv_cache_under_tinyjit_replays_with_new_positions(monkeypatch):
    maxlen, d = 16, 8
    pos_var = Variable("pos", 0, maxlen - 1)
    cache = Tensor.zeros(maxlen, d).contiguous().realize()
    W = rng.standard_normal((d, d)).astype(np.float32)
    w = Tensor(W).realize()
    @TinyJit
    def step(x, pos):
        cache[pos:pos + 1].assign(x @ w).realize()
        keys = cache[0:pos + 1]
        return ((x @ keys.T / 2).softmax(-1) @ keys).realize()
    scheduled = []
    orig = Tensor.schedule_with_vars
    monkeypatch.setattr(Tensor, "schedule_with_vars", lambda t, *lst: scheduled.append(1) or orig(t, *lst))
    ref_cache = np.zeros((maxlen, d), np.float32)
    for p in range(12):
        X = rng.standard_normal((1, d)).astype(np.float32)
        before, kernels = len(scheduled), len(method_cache)
        out = step(Tensor(X), pos_var.bind(p))
        if p >= 2: assert len(scheduled) == before and len(method_cache) == kernels, f"position {p} re-traced"
        ref_cache[p] = X @ W
        keys = ref_cache[:p + 1]
        np.testing.assert_allclose(out.numpy(), _softmax(X @ keys.T / 2) @ keys, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cache.numpy(), ref_cache, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("bad,error,words", [
    (lambda: Tensor(A)[:N].sum(0).numpy(), ValueError, "needs a value for Variable n"),
    (lambda: (Tensor(A)[:N.bind(3)].sum(0) + Tensor(A)[:N.bind(4)].sum(0)).numpy(), ValueError, "bound to both"),
    (lambda: Tensor(A)[0:N.bind(3):2], IndexError, "step 1"),
    (lambda: Tensor(A)[:N.bind(3) + 20], IndexError, "out of bounds"),
    (lambda: Tensor(A)[:N.bind(3)][-1], IndexError, "negative index"),
    (lambda: Tensor(A)[:N.bind(3)].reshape(12), ValueError, "can't reshape"),
    (lambda: Tensor(A).shrink(((0, N.bind(3) + 1), (0, N.bind(3) + 1))).shrink(((0, 20), None)), ValueError,
     "out of bounds"),
    (lambda: N.bind(11), ValueError, "out of range"),
    (lambda: Tensor(A)[:N.bind(3)].pad(((0, 1), None), mode="reflect"), ValueError, "int amounts"),
])
def test_errors(bad, error, words):
    with pytest.raises(error, match=words): bad()

@pytest.mark.parametrize("op", ["conv2d", "max_pool2d"])
def test_padded_window_over_a_symbolic_batch(op):
    """A padded convolution or pooling over a batch bound by a Variable runs (the bounds check reads the padding's
    gate: the window's index is spelled 8*oy + 8*kh - 9 where the gate bounds oy + kh), equal to the same op on the
    concrete batch."""
    v = Variable("pad_batch", 1, 8)
    rng = np.random.default_rng(0)
    data = rng.standard_normal(8 * 3 * 8 * 8).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    f = (lambda t: t.conv2d(Tensor(w), padding=1)) if op == "conv2d" else \
        (lambda t: t.max_pool2d(kernel_size=3, stride=1, padding=1))
    for n in (2, 5):
        x = Tensor(data).realize().shrink(((0, v.bind(n) * 192),)).reshape(v.bind(n), 3, 8, 8)
        want = f(Tensor(data[:n * 192].reshape(n, 3, 8, 8))).numpy()
        np.testing.assert_allclose(f(x).numpy(), want, rtol=1e-5, atol=1e-5)

def test_empty_with_a_bound_variable_is_memory_for_its_largest_value():
    """Tensor.empty of a bound Variable's size holds memory for the Variable's largest value, viewed at the bound one,
    and kernels read it at every value (its contents are whatever was there: only shapes are checked, and a write
    through assign reads back as written)."""
    v = Variable("empty_rows", 1, 16)
    for n in (2, 5):
        t = Tensor.empty(v.bind(n), 4)
        assert t.shape[0].unbind()[1] == n and (t @ Tensor.ones(4, 3)).numpy().shape == (n, 3)
        t.assign(Tensor.arange(4 * n).reshape(n, 4).float().shrink(((0, v.bind(n)), None)).contiguous()).realize()
        np.testing.assert_array_equal(t.numpy(), np.arange(4 * n, dtype=np.float32).reshape(n, 4))

@pytest.mark.parametrize("k", [1, 2, 3])
def test_flip_of_a_variable_bounded_view(k: int):
    # a flip is dropped as a no-op only where every flipped axis has at most one element: a symbolic size that may be
    # above 1 keeps it (deciding `n > 1` for the Variable raised)
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    x = Tensor(base).contiguous().realize()[:Variable("n", 1, 8).bind(k)]
    np.testing.assert_array_equal(x.flip(1).numpy(), base[:k, ::-1])
    np.testing.assert_array_equal(x.flip(0).numpy(), base[:k][::-1])
    np.testing.assert_array_equal(x.flip((0, 1)).numpy(), base[:k][::-1, ::-1])

@pytest.mark.parametrize("k", [1, 3])
def test_empty_with_a_bound_variable_and_no_elements(k: int):
    # a symbolic shape with a 0 dim holds no elements for any value (its size simplified to the int 0, which the
    # memory sizing took for a symbolic one: AttributeError)
    for shape, want in (((Variable("n", 1, 8).bind(k), 0), (k, 0)), ((0, Variable("m", 1, 8).bind(k), 3), (0, k, 3))):
        t = Tensor.empty(*shape)
        assert t.numpy().shape == want and (t + 1).numpy().shape == np.zeros(want).shape
