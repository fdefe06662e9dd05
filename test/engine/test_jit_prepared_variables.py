"""TinyJit replays of kernels with Variables through prepared launches: each replay sets its values (and the sizes
they give) into the launches, and computes what the plain path computes."""
import numpy as np
import pytest
from fusegrad import GlobalCounters, Tensor, TinyJit, Variable
from fusegrad.engine import realize
from fusegrad.runtime import cpu_pool, cpu_program

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                                reason="no prepared CPU launch without the C pool and 2 cores")

MAXLEN, D = 16, 8

def _decode_step():
    """A decode-like step over a cache of MAXLEN rows of which the first `pos` are used."""
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((MAXLEN, D)).astype(np.float32)
    k = Tensor(cache).realize()
    @TinyJit
    def f(x, pos):
        rows = k[0:pos]
        scores = (rows * x).sum(1)                 # (pos,): a grid that follows pos
        pooled = (rows * 0.5).sum(0)                # (D,): a loop over pos rows (empty for pos=0)
        out = (pooled * 2 + x).relu()
        return scores * 3, out, out.sum() + pooled.max()
    def ref(x, n):
        rows = cache[:n].astype(np.float64)
        scores, pooled = (rows * x).sum(1), (rows * 0.5).sum(0)
        out = np.maximum(pooled * 2 + x, 0)
        return scores * 3, out, out.sum() + pooled.max()
    return f, ref

class _Runs:
    """Counts the captured items a replay runs the plain way (ExecItem.run)."""
    def __init__(self, monkeypatch):
        self.n = 0
        run = realize.ExecItem.run
        def counted(ei, *a, **kw):
            self.n += 1
            return run(ei, *a, **kw)
        monkeypatch.setattr(realize.ExecItem, "run", counted)

@pytest.mark.parametrize("inline", [False, True])
def test_replays_with_other_values_match_numpy(inline, monkeypatch):
    monkeypatch.setattr(cpu_program, "INLINE_MAX_OPS", 1 << 40 if inline else 0)
    f, ref = _decode_step()
    pos = Variable("pos", 0, MAXLEN)
    rng = np.random.default_rng(1)
    runs = _Runs(monkeypatch)
    kept = []
    # (0: the reduction over rows runs an empty loop and the scores are empty; the last two repeat values)
    for i, n in enumerate((5, 3, 0, 16, 7, 1, 12, 7, 7)):
        x = rng.standard_normal(D).astype(np.float32)
        before, k0 = runs.n, GlobalCounters.kernel_count
        outs = f(Tensor(x), pos.bind(n))
        if i >= 2:
            assert runs.n == before, "a replay ran a kernel the plain way"
            assert GlobalCounters.kernel_count - k0 == len(f.captured)
        kept.append((outs, ref(x.astype(np.float64), n)))
    # (read after all the replays: an earlier output keeps its values while later replays run with other sizes)
    for outs, want in kept:
        assert outs[0].numpy().shape == want[0].shape
        for got, ref in zip(outs, want): np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-5)
    graphs = [step[0] for ei, step in f._launches[0] if ei is None]
    assert f._dynamic and graphs and any(g.dynamic for g in graphs)
    if inline: assert all(g._inline_now() for g in graphs)

def test_work_counted_per_replay_as_the_plain_path_counts_it(monkeypatch):
    f, _ = _decode_step()
    pos = Variable("pos", 0, MAXLEN)
    x = Tensor(np.ones(D, np.float32)).realize()
    f(x, pos.bind(4)), f(x, pos.bind(9))
    for n in (2, 11, 0, 11):
        g0, m0 = GlobalCounters.global_ops, GlobalCounters.global_mem
        f(x, pos.bind(n))
        prepared = (GlobalCounters.global_ops - g0, GlobalCounters.global_mem - m0)
        with monkeypatch.context() as m:
            m.setattr(realize, "DEBUG", 2)   # (every kernel the plain way, timed)
            m.setattr(realize, "_update_stats", _quiet(realize._update_stats))
            g0, m0 = GlobalCounters.global_ops, GlobalCounters.global_mem
            f(x, pos.bind(n))
            plain = (GlobalCounters.global_ops - g0, GlobalCounters.global_mem - m0)
        assert prepared == plain, (n, prepared, plain)

def _quiet(update):
    """_update_stats without its DEBUG line."""
    def quiet(prg, var_vals, et, device):
        old, realize.DEBUG = realize.DEBUG, 0
        try: update(prg, var_vals, et, device)
        finally: realize.DEBUG = old
    return quiet

def test_out_of_range_values_are_still_refused():
    # the cache's view declares more rows than it has: a replay's value past them is refused before any kernel runs,
    # and the next replay computes as before
    rng = np.random.default_rng(2)
    data = rng.standard_normal((MAXLEN, D)).astype(np.float32)
    k = Tensor(data).realize()
    pos = Variable("pos", 0, MAXLEN + 8)
    f = TinyJit(lambda x, p: (k[0:p] * x).sum(0) + 1)
    x = np.ones(D, np.float32)
    for n in (3, 6, 0, 10):
        np.testing.assert_allclose(f(Tensor(x), pos.bind(n)).numpy(), data[:n].sum(0) + 1, rtol=1e-5, atol=1e-5)
    for bad in (MAXLEN + 1, MAXLEN + 8):
        with pytest.raises(IndexError, match=f"pos={bad}"): f(Tensor(x), pos.bind(bad))
    np.testing.assert_allclose(f(Tensor(x), pos.bind(MAXLEN)).numpy(), data.sum(0) + 1, rtol=1e-5, atol=1e-5)
    assert f._dynamic

def test_launch_args_are_the_same_objects_for_the_same_values():
    f, _ = _decode_step()
    pos = Variable("pos", 0, MAXLEN)
    x = Tensor(np.ones(D, np.float32)).realize()
    f(x, pos.bind(2)), f(x, pos.bind(3)), f(x, pos.bind(4))
    ei = f._dynamic[0][0]
    a, b, c = (ei.prg.launch_args({"pos": n}) for n in (5, 6, 5))
    assert a is c and a is not b and a[0]["vals"] == (5,) and b[0]["vals"] == (6,)

def test_sym_infer_folds_as_the_graph_does():
    # the function sym_infer makes per expression gives what substituting the values and simplifying gives, negative
    # values, C division and remainder, max and comparisons included
    from fusegrad.uop.ops import Ops
    a, b = Variable("a", -20, 20), Variable("b", 1, 9)
    exprs = [(a * 3 + 7) // 4, a % 5, (a + b) * (b - 2), a.maximum(b * 2), (a < b).where(a * b, a - b), a // b + a % b,
             (a * 1000 + b) * 4096]
    for e in exprs:
        for va in (-20, -7, -1, 0, 3, 19):
            for vb in (1, 4, 9):
                vv = {"a": va, "b": vb}
                subs = {u: u.const_like(vv[u.arg[0]]) for u in e.toposort() if u.op is Ops.DEFINE_VAR}
                assert realize.sym_infer(e, vv) == int(e.substitute(subs)), (e, vv)
    assert all(realize._evaluators[e] is not False for e in exprs)

def test_kernels_differing_in_a_zeros_sign_keep_their_own_values():
    # two kernels of one program with a Variable, whose lifted constants are 0.0 and -0.0 (equal and of one hash in
    # Python): each replay launches each with its own, so 1/(x*0) and 1/(x*-0) keep their signs, as NumPy's
    v = Variable("v", 1, 8)

    @TinyJit
    def f(x: Tensor, n):
        p, q = x.shrink(((0, n),)) * 0.0, x.shrink(((0, n),)) * -0.0
        return (1.0 / p.contiguous()).realize(), (1.0 / q.contiguous()).realize()
    for i in range(4):
        x = np.arange(1, 9, dtype=np.float32) * (i + 1)
        p, q = f(Tensor(x), v.bind(4))
        with np.errstate(divide="ignore"):
            np.testing.assert_array_equal(p.numpy()[:4], 1.0 / (x[:4] * np.float32(0.0)))
            np.testing.assert_array_equal(q.numpy()[:4], 1.0 / (x[:4] * np.float32(-0.0)))
