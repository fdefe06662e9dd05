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

def test_sym_infer_written_out_computes_what_substitution_computes():
    # the function sym_infer writes per expression (each node once, in Python) against substituting the values and
    # folding the graph, over random expressions of C division, remainder, max and comparisons with negative values
    import random
    from fusegrad.uop.ops import Ops, UOp
    a, b = Variable("a", -50, 50), Variable("b", -9, 9)
    rng = random.Random(0)
    def expr(depth: int):
        if depth == 0: return rng.choice([a, b, rng.randint(-7, 7)])
        x, y = expr(depth - 1), expr(depth - 1)
        if not isinstance(x, UOp): x, y = y, x
        if not isinstance(x, UOp): return a + x
        op = rng.choice(["+", "*", "-", "//", "%", "max", "where"])
        if op in ("//", "%") and isinstance(y, int) and y == 0: y = b
        return {"+": lambda: x + y, "*": lambda: x * y, "-": lambda: x - y, "//": lambda: x // y,
                "%": lambda: x % y, "max": lambda: x.maximum(y), "where": lambda: (x < y).where(x, y)}[op]()
    tried = 0
    for _ in range(150):
        e = expr(rng.randint(1, 4))
        if realize._evaluator(e) is False: continue
        tried += 1
        for va, vb in ((-50, -9), (-13, -2), (-1, 0), (0, 3), (7, 9), (50, 1)):
            vv = {"a": va, "b": vb}
            subs = {u: u.const_like(vv[u.arg[0]]) for u in e.toposort() if u.op is Ops.DEFINE_VAR}
            assert realize.sym_infer(e, vv) == int(e.substitute(subs)), (e, vv)
            # (a value that is no int takes the walk over the nodes, as before)
            assert realize.sym_infer(e, {"a": float(va), "b": vb}) == realize.sym_infer(e, vv), (e, vv)
    assert tried > 100

def test_another_variable_as_argument_is_named_in_the_error():
    from fusegrad.engine.jit import JitError
    a, b = Variable("a", 0, 8), Variable("b", 0, 8)
    data = np.arange(8, dtype=np.float32)
    t = Tensor(data).realize()
    f = TinyJit(lambda x, n: (x[0:n] * 2).sum())
    for k in (2, 5, 7):
        np.testing.assert_allclose(f(t, a.bind(k)).numpy(), data[:k].sum() * 2)
    with pytest.raises(JitError, match=r"argument 1 changed from .*\ba\b.* to .*\bb\b.* since the first call"):
        f(t, b.bind(3))

@pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                    reason="no prepared CPU launch without the C pool and 2 cores")
def test_set_values_shared_per_launch_args_follow_the_thread_knob():
    from fusegrad.helpers import Context
    small, big = Tensor(DATA[:8]).realize(), Tensor(DATA).realize()
    f, v = _layers(small, big), Variable("p", 0, ROWS)
    x = np.ones(D, np.float32)
    f(Tensor(x), v.bind(1)), f(Tensor(x), v.bind(2)), f(Tensor(x), v.bind(3))
    (_, launch, kw), (_, other, _) = f._dynamic[0], f._dynamic[-1]
    wide = dict(kw, threads=4, global_size=100, vals=(5,) * len(kw["vals"]))
    for knob in (1, 3, 0, 1):
        with Context(CPU_THREADS=knob):
            launch.set_values(wide, (1, 1))
            other.set_values(wide, (1, 1))
            assert launch.threads == other.threads == cpu_program._clamped_threads(4, 100)
            assert launch.global_size == 100 and launch.dynamic
    # (one dict's values are one set of C variables, read only)
    assert launch.boxed is other.boxed and [b.value for b in launch.boxed] == [5] * len(kw["vals"])
    for entry in f._dynamic: entry[1].set_values(entry[2], (0, 0))
    np.testing.assert_allclose(f(Tensor(x), v.bind(6)).numpy(), _ref(x, 6), rtol=1e-5, atol=1e-5)

def test_view_with_a_variable_the_function_binds_itself_keeps_its_capture_value():
    # a window of width w, bound inside the function (its capture value, 3, holds on every replay), next to the row
    # the kernel reads: the window's condition is checked with each call's p
    data = np.arange(8, dtype=np.float32)
    t = Tensor(data).realize()
    p, w = Variable("p", 0, 10), Variable("w", 0, 10)
    def step(x, q):
        x[q:q + w.bind(3)]
        return (x[q:q + 1] * 2).contiguous()
    f = TinyJit(step)
    for k in (0, 2, 5, 2):
        np.testing.assert_array_equal(f(t, p.bind(k)).numpy(), data[k:k + 1] * 2)
    for bad in (6, 10, 6):
        with pytest.raises(IndexError, match=rf"Variables p={bad}, w=3 put a view out of range: shrink of dimension 0 "
                                             rf"to {bad}\.\.{bad + 3}, which holds 8 elements"):
            f(t, p.bind(bad))
    np.testing.assert_array_equal(f(t, p.bind(5)).numpy(), data[5:6] * 2)

def test_values_forgotten_past_the_bound_are_checked_again(monkeypatch):
    from fusegrad.engine import jit
    monkeypatch.setattr(jit, "VALUES_KEPT", 2)
    small, big = Tensor(DATA[:8]).realize(), Tensor(DATA).realize()
    f, v = _layers(small, big), Variable("p", 0, ROWS)
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 4, 5, 3, 8, 1, 2, 8, 4):
        x = rng.standard_normal(D).astype(np.float32)
        np.testing.assert_allclose(f(Tensor(x), v.bind(n)).numpy(), _ref(x, n), rtol=1e-5, atol=1e-5)
        assert len(f._values_seen) <= 2
        with pytest.raises(IndexError, match="p=10 "): f(Tensor(x), v.bind(10))
