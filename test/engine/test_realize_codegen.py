"""run_schedule on kernel ASTs built by hand and compiled by the real code generator, checked against numpy."""
import math
import re
import numpy as np
import pytest
from fusegrad.device import Buffer, GlobalCounters
from fusegrad.dtype import dtypes
from fusegrad.engine.realize import CompiledRunner, ExecItem, get_runner, lower_schedule_item, run_schedule
from fusegrad.helpers import Context
from fusegrad.uop.ops import Ops, UOp, Variable

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    GlobalCounters.reset()

def glob(i: int, size: int, dtype=dtypes.float32) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dtype.ptr(size), arg=i)

def buf(arr: np.ndarray) -> Buffer:
    return Buffer("CPU", arr.size, dtypes.float32).copyin(memoryview(np.ascontiguousarray(arr, np.float32)))

def muladd_ast(n: int) -> UOp:
    # out[i] = a[i] * b[i] + 1
    out, a, b = glob(0, n), glob(1, n), glob(2, n)
    i = UOp.range(n, 0, "loop")
    return UOp.sink_of(out.index(i).store(a.index(i).load() * b.index(i).load() + 1.0))

def rowsum_ast(n: int, m: int) -> UOp:
    # out[i] = sum_j x[i*m + j]
    out, x = glob(0, n), glob(1, n * m)
    i, j = UOp.range(n, 0, "loop"), UOp.range(m, 1, "reduce")
    return UOp.sink_of(out.index(i).store(UOp(Ops.REDUCE, dtypes.float32, (x.index(i * m + j).load(), j), Ops.ADD)))

def test_elementwise_kernel():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    out = Buffer("CPU", 100, dtypes.float32)
    ei = lower_schedule_item(ExecItem(muladd_ast(100), [out, buf(a), buf(b)]))
    assert isinstance(ei.prg, CompiledRunner)
    assert ei.prg.p.name in ei.prg.src and "core_lo" in ei.prg.src
    assert ei.prg.uops and all(isinstance(u, UOp) for u in ei.prg.uops)
    assert any(u.op is Ops.STORE for u in ei.prg.uops)
    run_schedule([ei])
    np.testing.assert_allclose(out.numpy(), a * b + 1, rtol=1e-6)
    assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_mem == ei.prg.estimates.mem > 0
    assert GlobalCounters.global_ops == ei.prg.estimates.ops > 0

def test_reduce_kernel_and_method_cache():
    x = np.random.default_rng(1).standard_normal((16, 48)).astype(np.float32)
    ast = rowsum_ast(16, 48)
    outs = [Buffer("CPU", 16, dtypes.float32) for _ in range(2)]
    run_schedule([ExecItem(ast, [o, buf(x)]) for o in outs])
    for o in outs: np.testing.assert_allclose(o.numpy(), x.sum(axis=1), rtol=1e-5, atol=1e-5)
    assert get_runner("CPU", ast) is get_runner("CPU", ast)
    assert GlobalCounters.kernel_count == 2

def test_noopt_is_a_different_kernel():
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    ast = rowsum_ast(64, 32)
    with Context(NOOPT=1):
        plain = get_runner("CPU", ast)
        out = Buffer("CPU", 64, dtypes.float32)
        run_schedule([ExecItem(ast, [out, buf(x)])])
    assert plain.p.applied_opts == () and plain is not get_runner("CPU", ast)
    np.testing.assert_allclose(out.numpy(), x.sum(axis=1))

def test_transcendental_knob_is_a_different_kernel():
    # the same exp kernel with the polynomial pass and with TRANSCENDENTAL=0 in one process: the method cache must not
    # serve the first one's code to the second
    n = 256
    out_g, a_g = glob(0, n), glob(1, n)
    i = UOp.range(n, 0, "loop")
    ast = UOp.sink_of(out_g.index(i).store((a_g.index(i).load() * (1 / math.log(2))).alu(Ops.EXP2)))
    x = np.linspace(-80, 80, n, dtype=np.float32)
    want = np.array([math.exp(float(v)) for v in x])
    srcs = {}
    for knob in (1, 0, 1):
        with Context(TRANSCENDENTAL=knob):
            r = get_runner("CPU", ast)
            out = Buffer("CPU", n, dtypes.float32)
            run_schedule([ExecItem(ast, [out, buf(x)])])
        srcs.setdefault(knob, r.p.src)
        assert r.p.src == srcs[knob]
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5)
    libm = re.compile(r"\bexp2f?\(|__builtin_exp2f?\(")
    assert libm.search(srcs[0]) and not libm.search(srcs[1]), "TRANSCENDENTAL=0 calls exp2, the pass doesn't"

def test_symbolic_loop_bound():
    n = Variable("n", 1, 32)
    out_g, a_g = glob(0, 32), glob(1, 32)
    i = UOp.range(n, 0, "loop")
    ast = UOp.sink_of(out_g.index(i).store(a_g.index(i).load() * 2.0))
    out = buf(np.full(32, -1, np.float32))
    a = np.arange(32, dtype=np.float32)
    run_schedule([ExecItem(ast, [out, buf(a)])], {"n": 5})
    np.testing.assert_array_equal(out.numpy(), np.concatenate([a[:5] * 2, np.full(27, -1, np.float32)]))

def test_large_kernel_split_across_threads():
    n = 1 << 20
    rng = np.random.default_rng(2)
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    out = Buffer("CPU", n, dtypes.float32)
    ei = lower_schedule_item(ExecItem(muladd_ast(n), [out, buf(a), buf(b)]))
    with Context(CPU_THREADS=2):
        assert ei.prg.threads({}) == 2
        run_schedule([ei])
    np.testing.assert_allclose(out.numpy(), a * b + 1, rtol=1e-6)

def test_debug_levels_print_ast_and_source(capsys, monkeypatch):
    from fusegrad.engine import realize
    monkeypatch.setattr(realize, "method_cache", {})  # so the kernel is generated (and printed) here
    with Context(DEBUG=4): r = get_runner("CPU", muladd_ast(24))
    out = capsys.readouterr().out
    assert "Ops.STORE" in out and "applied opts" in out and r.p.src in out
