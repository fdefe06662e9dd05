"""Bound Variables that would put a view out of range: every kernel whose memory depends on Variables checks the
values of each call against its buffers before any kernel runs (realize, TinyJit replay), and raises IndexError
naming the Variable, its value and the buffer's size; values in range give NumPy's results."""
from __future__ import annotations
import itertools
import subprocess
import sys
from types import SimpleNamespace
import numpy as np
import pytest
from fusegrad import Tensor, TinyJit, Variable
from fusegrad.engine.realize import lower_schedule_item
from fusegrad.uop.ops import device_buffer
from fusegrad.uop.ops import Ops, exec_alu

N = 10
REF = np.arange(N, dtype=np.float32)
A = np.arange(40, dtype=np.float32).reshape(10, 4)

def _ten() -> Tensor: return Tensor.arange(N).float().contiguous().realize()

def test_slice_past_the_end_raises():
    c, v = _ten(), Variable("p", 0, 100)
    with pytest.raises(IndexError, match=r"Variable p=20 puts a view out of range: shrink of dimension 0 to "
                                         r"20\.\.21, which holds 10 elements"):
        c[v.bind(20):v.bind(20) + 1].tolist()

def test_far_out_of_range_raises_instead_of_crashing():
    # a read 10**8 elements past a 10-element buffer used to crash the process: run it in its own
    code = ("from fusegrad import Tensor, Variable\n"
            "c = Tensor.arange(10).float().contiguous().realize()\n"
            "v = Variable('p', 0, 10**9)\n"
            "try: c[v.bind(10**8):v.bind(10**8) + 1].tolist()\n"
            "except IndexError as e: print('raised:', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "raised: Variable p=100000000" in res.stdout and "holds 10 elements" in res.stdout

def test_assign_past_the_end_raises_and_writes_nothing():
    c, v = _ten(), Variable("p", 0, 100000)
    with pytest.raises(IndexError, match=r"p=60000 .*dimension 0 to 0\.\.60000, which holds 10 elements"):
        c[0:v.bind(60000)].assign(Tensor.ones(v.bind(60000))).realize()
    np.testing.assert_array_equal(c.numpy(), REF)

def test_assign_through_variable_slice_in_range():
    c, v = _ten(), Variable("p", 0, 100000)
    want = REF.copy()
    for n in (3, 10, 0):
        c[0:v.bind(n)].assign(Tensor.full((v.bind(n),), -float(n))).realize()
        want[:n] = -n
        np.testing.assert_array_equal(c.numpy(), want)

@pytest.mark.parametrize("name,fxn,ref", [
    ("window", lambda c, p: c[p:p + 1], lambda n: REF[n:n + 1]),
    ("window3", lambda c, p: c[p:p + 3] * 2, lambda n: REF[n:n + 3] * 2),
    ("prefix", lambda c, p: c[:p] + 1, lambda n: REF[:n] + 1),
    ("suffix_sum", lambda c, p: c[p:].sum(), lambda n: REF[n:].sum()),
], ids=lambda x: x if isinstance(x, str) else "")
def test_in_range_binds_match_numpy(name, fxn, ref):
    c, v = _ten(), Variable("p", 0, 100)  # the declared maximum is past the dimension; the values are not
    for n in (0, 5, 7):
        np.testing.assert_allclose(fxn(c, v.bind(n)).numpy(), ref(n), err_msg=f"p={n}")

def test_declared_max_beyond_dimension_works_at_the_edges():
    c, v = _ten(), Variable("p", 0, 100)
    assert c[v.bind(5):v.bind(5) + 1].tolist() == [5.0]
    assert c[v.bind(9):v.bind(9) + 1].tolist() == [9.0]
    assert c[:v.bind(10)].tolist() == REF.tolist()
    with pytest.raises(IndexError, match="p=10 .*holds 10 elements"): c[v.bind(10):v.bind(10) + 1].tolist()
    with pytest.raises(IndexError, match="p=11 "): c[:v.bind(11)].tolist()

def test_pad_with_variable():
    c, v = _ten(), Variable("p", 0, 100)
    for n in (0, 4, 10):
        np.testing.assert_array_equal(c[:v.bind(n)].pad(((1, 2),)).numpy(), np.pad(REF[:n], (1, 2)))
        np.testing.assert_array_equal((c.pad(((v.bind(n), 0),)) + 1).numpy(), np.pad(REF, (n, 0)) + 1)
    # the padding's loads are gated: the analysis must not count them, but the rows it reads still must fit
    with pytest.raises(IndexError, match="p=12 "): c[:v.bind(12)].pad(((1, 2),)).numpy()

def test_reshape_of_variable_view():
    c, v = _ten(), Variable("p", 0, 100)
    for n in (1, 3, 5):
        got = c.reshape(2, 5)[:, :v.bind(n)].reshape(2 * v.bind(n)).numpy()
        np.testing.assert_array_equal(got, REF.reshape(2, 5)[:, :n].reshape(-1))
    with pytest.raises(IndexError, match=r"p=6 .*dimension 1 to 0\.\.6, which holds 5 elements"):
        c.reshape(2, 5)[:, :v.bind(6)].reshape(2 * v.bind(6)).numpy()

def test_rows_of_a_matrix_and_reductions():
    a, v = Tensor(A).realize(), Variable("r", 0, 50)
    np.testing.assert_array_equal(a[v.bind(8):v.bind(8) + 2].numpy(), A[8:10])
    np.testing.assert_array_equal(a[:v.bind(10)].sum(0).numpy(), A.sum(0))
    with pytest.raises(IndexError, match=r"r=9 .*dimension 0 to 9\.\.11, which holds 10 elements"):
        a[v.bind(9):v.bind(9) + 2].numpy()
    with pytest.raises(IndexError, match="r=11 "): a[:v.bind(11)].sum(0).numpy()

def test_two_variables_named():
    c, p, q = _ten(), Variable("p", 0, 100), Variable("q", 0, 100)
    np.testing.assert_array_equal(c[p.bind(2):q.bind(6)].numpy(), REF[2:6])
    with pytest.raises(IndexError, match="Variables p=4, q=12 put a view out of range"):
        c[p.bind(4):q.bind(12)].numpy()

def test_nothing_runs_when_one_kernel_is_out_of_range():
    c, d, v = _ten(), _ten(), Variable("p", 0, 100)
    d_memory = device_buffer(d.uop.base)
    good = d.assign(d * 0 - 1)  # an in-place write scheduled with the kernel that is out of range
    # (a view made below Tensor.shrink, which would refuse it: the kernels' own check is what stops it here)
    bad = Tensor(c.uop.shrink(((v.bind(3), v.bind(3) + 8),))) * 2
    with pytest.raises(IndexError, match=r"p=3 .*read elements 3\.\.10 .*holds 10 elements"): Tensor.realize(good, bad)
    np.testing.assert_array_equal(np.frombuffer(d_memory.as_buffer(), np.float32), REF)
    # the tensors keep their graphs (not buffers no kernel wrote): the write still happens when next realized
    np.testing.assert_array_equal(good.numpy(), np.full(N, -1, np.float32))
    with pytest.raises(IndexError, match="p=3 "): bad.numpy()

def test_tinyjit_replay_in_range_then_out_of_range():
    c, v = _ten(), Variable("p", 0, 100)
    cache = Tensor.zeros(N).contiguous().realize()
    @TinyJit
    def step(x: Tensor, p) -> Tensor:
        cache[p:p + 1].assign(x[p:p + 1] * 2).realize()
        return (cache[0:p + 1].sum() + x[p:p + 1]).realize()
    want = np.zeros(N, np.float32)
    for n in range(6):  # captured on the second call, replayed from the third
        out = step(c, v.bind(n))
        want[n] = 2 * n
        np.testing.assert_allclose(out.numpy(), want[:n + 1].sum() + n)
    assert step.cnt >= 2 and step.captured
    with pytest.raises(IndexError, match=r"Variable p=10 .*holds 10 elements"): step(c, v.bind(10))
    with pytest.raises(IndexError, match=r"Variable p=60 "): step(c, v.bind(60))
    np.testing.assert_array_equal(cache.numpy(), want)  # the failed replays wrote nothing
    out = step(c, v.bind(9))
    want[9] = 18
    np.testing.assert_allclose(out.numpy(), want.sum() + 9)
    np.testing.assert_array_equal(cache.numpy(), want)

def test_negative_values():
    c, q = _ten(), Variable("q", -5, 5)
    np.testing.assert_array_equal(c.shrink(((q.bind(0) + 5, q.bind(0) + 6),)).numpy(), REF[5:6])
    with pytest.raises(IndexError, match=r"q=-3 .*dimension 0 to -3\.\.-2,"):
        c.shrink(((q.bind(-3), q.bind(-3) + 1),)).numpy()

# *** the bounds against every index the kernel computes, enumerated with Python's arithmetic ***

def _evaluate(u, env: dict) -> int:
    vals: dict = {}
    for x in u.toposort():
        if x in env: vals[x] = env[x]
        elif x.op is Ops.CONST: vals[x] = x.arg
        elif x.op is Ops.CAST: vals[x] = int(vals[x.src[0]])
        elif x.op is not Ops.RANGE: vals[x] = exec_alu(x.op, x.dtype, tuple(vals[s] for s in x.src))
    return vals[u]

def _touched(idx, gate, var_vals: dict) -> tuple[int, int] | None:
    """The lowest and highest index an access computes over its loops where its gate holds (None: never)."""
    deps = idx.toposort() | (gate.toposort() if gate is not None else {})
    env = {d: var_vals[d.arg[0]] for d in deps if d.op is Ops.DEFINE_VAR}
    ranges = [d for d in deps if d.op is Ops.RANGE]
    seen = []
    for combo in itertools.product(*[range(_evaluate(r.src[0], env)) for r in ranges]):
        at = {**env, **dict(zip(ranges, combo))}
        if gate is None or _evaluate(gate, at): seen.append(_evaluate(idx, at))
    return (min(seen), max(seen)) if seen else None

M = Tensor.arange(24).float().reshape(4, 6).contiguous().realize()
PROGRAMS = [
    ("window", lambda p: M[p:p + 1] * 2, (0, 3)),
    ("columns", lambda p: M[:, p:p + 2] + 1, (0, 4)),
    ("prefix_sum", lambda p: M[:p].sum(0), (1, 4)),
    ("pad", lambda p: M[:p].pad(((1, 2), (2, 0))), (0, 4)),
    ("pad_left", lambda p: M.pad(((p, 0), None)) * 3, (0, 5)),
    ("cat", lambda p: M[:p].cat(M[:2], dim=0).sum(0), (1, 4)),
    ("reshape", lambda p: M.reshape(2, 12)[:, :p].reshape(2 * p) + 0, (1, 12)),
    ("attention", lambda p: (M[:1] @ M[:p].T).softmax(-1) @ M[:p], (1, 4)),
]

@pytest.mark.parametrize("name,fxn,values", PROGRAMS, ids=[p[0] for p in PROGRAMS])
def test_bounds_are_the_enumerated_ones(name, fxn, values):
    v = Variable("p", 0, 50)
    for n in values:
        schedule, var_vals = fxn(v.bind(n)).schedule_with_vars()
        checked = 0
        for ei in (lower_schedule_item(si) for si in schedule):
            if (bounds := ei.prg.bounds) is None: continue
            # per buffer, the highest element its accesses touch (two views of one buffer: one size for both)
            top: dict[int, int] = {}
            for pos, _, idx, gate, _ in bounds.accesses:
                if (touched := _touched(idx, gate, var_vals)) is None: continue
                assert touched[0] >= 0
                top[pos] = max(top.get(pos, 0), touched[1])
            for pos, hi in top.items():
                sizes = [SimpleNamespace(size=1 << 40)] * (max(bounds.positions) + 1)
                sizes[pos] = SimpleNamespace(size=hi + 1)
                bounds.check(sizes, var_vals)  # exactly large enough: no error
                sizes[pos] = SimpleNamespace(size=hi)
                with pytest.raises(IndexError, match=f"elements -?[0-9]+\\.\\.{hi} "):
                    bounds.check(sizes, var_vals)
                checked += 1
        assert checked, f"{name} p={n}: no access depends on p"

@pytest.mark.parametrize("k", [1, 2, 3])
def test_gated_access_the_range_analysis_overestimates(k: int):
    # a depthwise convolution's padding over a pool of a Variable-bounded batch: its loads' indices go through
    # divisions by the view's sizes, which the range analysis can't narrow by the padding's gate (it put the reads at
    # elements -1..79 for n=1); the accesses are then evaluated at every loop point, which shows them in range
    data = np.random.default_rng(k).standard_normal(2560).astype(np.float32)
    weight = np.random.default_rng(9).standard_normal((5, 1, 3)).astype(np.float32)
    def model(x: Tensor) -> Tensor: return x.max_pool2d((1,), 1, 2, 0).conv2d(Tensor(weight), groups=5, padding=1)
    n = Variable("n", 1, 64).bind(k)
    got = model(Tensor(data).realize()[:n * 40].reshape(n, 5, 8)).numpy()
    x = data[:k * 40].reshape(k, 5, 8)
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1)))
    want = np.stack([sum(padded[:, :, j:j + 8] * weight[:, 0, j][None, :, None] for j in range(3))], 0)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # an access truly out of range is still an error
    short = Tensor(data[:40]).realize()
    with pytest.raises(IndexError, match="out of range"): short[:Variable("m", 1, 64).bind(2) * 40].numpy()
