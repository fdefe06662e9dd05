"""A TinyJit replay checks each distinct set of Variable values once (the captured views and the kernels' buffers) and
sets the prepared launches' values only when they differ from the last replay's: values that change between replays,
repeat, or come back after a refused one compute what NumPy computes, and a value out of range is refused every time,
before any kernel runs."""
import numpy as np
import pytest
from fusegrad import Tensor, TinyJit, Variable
from fusegrad.engine import realize
from fusegrad.runtime import cpu_pool, cpu_program

ROWS, D = 12, 4
DATA = np.arange(ROWS * D, dtype=np.float32).reshape(ROWS, D) / 7

def _layers(small: Tensor, big: Tensor):
    """A step that shrinks two caches by one Variable the way a model's layers do: the same kernels on buffers of two
    sizes (rows 0..p of an 8-row and of a 12-row cache)."""
    @TinyJit
    def f(x: Tensor, p):
        a = (small[0:p] * x).sum(0)
        b = (big[0:p] * x).sum(0)
        c = (big[0:p] * 2).sum(0)
        return (a + b + c).contiguous()
    return f

def _ref(x: np.ndarray, n: int) -> np.ndarray:
    d = DATA.astype(np.float64)
    return (d[:8][:n] * x).sum(0) + (d[:n] * x).sum(0) + (d[:n] * 2).sum(0)

def test_changing_and_repeated_values_match_numpy():
    small, big = Tensor(DATA[:8]).realize(), Tensor(DATA).realize()
    f, v = _layers(small, big), Variable("p", 0, ROWS)
    rng = np.random.default_rng(0)
    kept = []
    for n in (3, 5, 5, 0, 8, 5, 3, 3, 1, 8, 0):
        x = rng.standard_normal(D).astype(np.float32)
        kept.append((f(Tensor(x), v.bind(n)), _ref(x, n)))
    for got, want in kept: np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)

def test_value_out_of_range_after_cached_ones_is_refused_each_time():
    small, big = Tensor(DATA[:8]).realize(), Tensor(DATA).realize()
    f, v = _layers(small, big), Variable("p", 0, ROWS)
    x = np.ones(D, np.float32)
    for n in (2, 6, 2, 6):
        np.testing.assert_allclose(f(Tensor(x), v.bind(n)).numpy(), _ref(x, n), rtol=1e-5, atol=1e-5)
    # 9..12 fit the 12-row cache, not the 8-row one: refused though a kernel of the same program took them
    for bad in (9, 12, 9):
        with pytest.raises(IndexError, match=rf"Variable p={bad} puts a view out of range: shrink of dimension 0 to "
                                             rf"0\.\.{bad}, which holds 8 elements"):
            f(Tensor(x), v.bind(bad))
    for n in (6, 8, 6):
        np.testing.assert_allclose(f(Tensor(x), v.bind(n)).numpy(), _ref(x, n), rtol=1e-5, atol=1e-5)

def test_kernel_bounds_refused_after_cached_values():
    # views made below Tensor.shrink (which would check them): only the kernels' own bounds stop a value, and the
    # program read through two buffers of different sizes is checked against each
    n8, n12 = Tensor(np.arange(8, dtype=np.float32)).realize(), Tensor(np.arange(12, dtype=np.float32)).realize()
    v = Variable("p", 0, 20)
    @TinyJit
    def f(x: Tensor, p):
        return ((Tensor(n8.uop.shrink(((p, p + 4),))) + x).contiguous() +
                (Tensor(n12.uop.shrink(((p, p + 4),))) + x).contiguous()).contiguous()
    x = np.ones(4, np.float32)
    want = lambda n: np.arange(n, n + 4) * 2 + 2.0  # noqa: E731
    for n in (0, 4, 1, 4):
        np.testing.assert_array_equal(f(Tensor(x), v.bind(n)).numpy(), want(n))
    for bad in (5, 8, 5):
        with pytest.raises(IndexError, match=rf"p={bad} .*read elements {bad}\.\.{bad + 3} .*holds 8 elements"):
            f(Tensor(x), v.bind(bad))
    np.testing.assert_array_equal(f(Tensor(x), v.bind(4)).numpy(), want(4))
    # the grouped check refuses exactly the values check_bounds refuses, with its message
    checks = f._checks[2]
    for n in range(0, 21):
        try: realize.check_bounds(f._bounded, {"p": n})
        except IndexError as e: expected = str(e)
        else: expected = None
        try: checks.check({"p": n})
        except IndexError as e: got = str(e)
        else: got = None
        assert got == expected, n

@pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                    reason="no prepared CPU launch without the C pool and 2 cores")
def test_launch_values_set_only_when_they_change(monkeypatch):
    small, big = Tensor(DATA[:8]).realize(), Tensor(DATA).realize()
    f, v = _layers(small, big), Variable("p", 0, ROWS)
    x = np.ones(D, np.float32)
    f(Tensor(x), v.bind(1)), f(Tensor(x), v.bind(2)), f(Tensor(x), v.bind(3))
    assert f._dynamic
    calls = []
    original = cpu_program.PreparedLaunch.set_values
    def counted(self, launch, work):
        calls.append(launch["vals"])
        original(self, launch, work)
    monkeypatch.setattr(cpu_program.PreparedLaunch, "set_values", counted)
    for n, changed in ((3, False), (3, False), (7, True), (7, False), (3, True)):
        before = len(calls)
        np.testing.assert_allclose(f(Tensor(x), v.bind(n)).numpy(), _ref(x, n), rtol=1e-5, atol=1e-5)
        assert (len(calls) > before) == changed, (n, calls[before:])
        assert all(vals == (n,) for vals in calls[before:])
