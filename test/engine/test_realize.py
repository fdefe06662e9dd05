"""The engine: ExecItems lowered to runners (kernels, copies, views), run by run_schedule, counted in GlobalCounters."""
import sys
import types
import re
import uuid
import numpy as np
import pytest
from fusegrad.device import Buffer, GlobalCounters
from fusegrad.dtype import dtypes
from fusegrad.engine import realize
from fusegrad.engine.realize import (BufferCopy, CompiledRunner, ExecItem, Runner, ViewOp, get_runner,
                                     lower_schedule_item, run_schedule, sym_infer)
from fusegrad.helpers import Context
from fusegrad.renderer import Estimates, ProgramSpec
from fusegrad.uop.ops import Ops, UOp, Variable

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    GlobalCounters.reset()

def buf(arr: np.ndarray) -> Buffer:
    from fusegrad.dtype import from_np_dtype
    return Buffer("CPU", arr.size, from_np_dtype(arr.dtype)).copyin(memoryview(np.ascontiguousarray(arr)))

def empty(n: int, dtype=dtypes.float32) -> Buffer: return Buffer("CPU", n, dtype)

def kernel_ast(tag: str) -> UOp:
    # a distinct (placeholder) kernel AST per tag: hand-made ProgramSpecs carry the code, the AST is only a cache key
    return UOp(Ops.SINK, arg=tag)

ADD_SRC = """void {name}(float* restrict out, const float* restrict a, const float* restrict b,
                   long core_lo, long core_hi) {{
  for (long i = core_lo; i < core_hi; i++) out[i] = a[i] + b[i];
}}"""

def add_spec(n: int, ops: int | None = None, mem: int | None = None, name: str | None = None) -> ProgramSpec:
    name = name or f"add_{uuid.uuid4().hex[:8]}"
    return ProgramSpec(name, ADD_SRC.format(name=name), "CPU", globals=[0, 1, 2], outs=[0], ins=[1, 2], global_size=n,
                       estimates=Estimates(ops=n if ops is None else ops, mem=12 * n if mem is None else mem))

class Recorder(Runner):
    """A stub runner that records what it was called with."""
    def __init__(self): super().__init__("recorder", "CPU", Estimates(ops=10, mem=20)); self.calls = []
    def __call__(self, rawbufs, var_vals, wait=False):
        self.calls.append((list(rawbufs), dict(var_vals), wait))
        return 0.5 if wait else None

def test_stub_runner_gets_allocated_bufs_and_vars():
    r = Recorder()
    a, b = empty(4), empty(4)
    ei = ExecItem(kernel_ast("stub"), [a, b], fixedvars={"j": 3}, prg=r)
    run_schedule([ei], {"i": 1})
    (bufs, vv, wait), = r.calls
    assert bufs[0] is a and bufs[1] is b and a.is_allocated() and b.is_allocated()
    assert vv == {"i": 1, "j": 3} and wait is False
    assert GlobalCounters.global_ops == 10 and GlobalCounters.global_mem == 20
    assert GlobalCounters.kernel_count == 0  # only compiled kernels count as kernels

def test_compiled_runner_runs_and_counts():
    rng = np.random.default_rng(0)
    a, b = rng.random(100, dtype=np.float32), rng.random(100, dtype=np.float32)
    p = add_spec(100)
    runner = CompiledRunner(p)
    assert runner.src == p.src and runner.uops == p.uops and runner.p is p
    out = empty(100)
    items = [ExecItem(kernel_ast("add"), [out, buf(a), buf(b)], prg=runner)] * 3
    run_schedule(items)
    np.testing.assert_allclose(out.numpy(), a + b)
    assert GlobalCounters.kernel_count == 3
    assert GlobalCounters.global_ops == 300 and GlobalCounters.global_mem == 3600
    assert GlobalCounters.time_sum_s == 0.0  # not timed without DEBUG>=2
    run_schedule(items[:1], do_update_stats=False)
    assert GlobalCounters.kernel_count == 3
    GlobalCounters.reset()
    assert (GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem) == (0, 0, 0)

def test_timed_run_counts_time():
    ei = ExecItem(kernel_ast("timed"), [empty(10), buf(np.ones(10, np.float32)), buf(np.ones(10, np.float32))],
                  prg=CompiledRunner(add_spec(10)))
    et = ei.run(wait=True)
    assert et is not None and et > 0 and GlobalCounters.time_sum_s == et
    assert ei.bufs[0].numpy().tolist() == [2.0] * 10

def test_globals_order_maps_bufs():
    # the kernel's parameters are bufs[globals[0]], bufs[globals[1]], ...; other buffers (or None) may sit between
    name = f"sub_{uuid.uuid4().hex[:8]}"
    src = f"""void {name}(float* restrict out, const float* restrict a, const float* restrict b, long lo, long hi) {{
      for (long i = lo; i < hi; i++) out[i] = a[i] - b[i]; }}"""
    p = ProgramSpec(name, src, "CPU", globals=[2, 0, 3], global_size=4, estimates=Estimates(ops=4, mem=48))
    a, b, out = np.arange(4, dtype=np.float32), np.full(4, 10, np.float32), empty(4)
    run_schedule([ExecItem(kernel_ast("order"), [buf(a), None, out, buf(b)], prg=CompiledRunner(p))])
    np.testing.assert_array_equal(out.numpy(), a - b)

def test_variables_are_passed_by_name():
    name = f"prefix_{uuid.uuid4().hex[:8]}"
    src = f"""void {name}(int* restrict out, long n, long k, long lo, long hi) {{
      for (long i = 0; i < n; i++) out[i] = (int)(k * i); }}"""
    n, k = Variable("n", 1, 16), Variable("k", 0, 9)
    p = ProgramSpec(name, src, "CPU", globals=[0], vars=[n, k], estimates=Estimates(ops=n * 2, mem=n * 4))
    out = buf(np.full(16, -1, np.int32))
    ei = ExecItem(kernel_ast("vars"), [out], fixedvars={"k": 3}, prg=CompiledRunner(p))
    run_schedule([ei], {"n": 5})
    assert out.numpy().tolist() == [0, 3, 6, 9, 12] + [-1] * 11
    assert GlobalCounters.global_ops == 10 and GlobalCounters.global_mem == 20  # symbolic estimates, n=5
    with pytest.raises(ValueError, match="n"): run_schedule([ExecItem(kernel_ast("vars"), [out], prg=ei.prg)])

def test_sym_infer():
    n, m = Variable("n", 1, 100), Variable("m", 1, 100)
    assert sym_infer(7, {}) == 7
    assert sym_infer(n * 3 + m, {"n": 4, "m": 2}) == 14

def test_thread_choice():
    small, big = CompiledRunner(add_spec(1000)), CompiledRunner(add_spec(1 << 20, ops=1 << 20, mem=12 << 20))
    scalar = CompiledRunner(add_spec(1, ops=1 << 30, mem=1 << 30))
    assert small.threads({}) == 1 and scalar.threads({}) == 1
    with Context(CPU_THREADS=2): assert big.threads({}) == 2
    with Context(CPU_THREADS=1): assert big.threads({}) == 1

def test_big_kernel_split_matches_numpy():
    n = 1 << 20
    rng = np.random.default_rng(2)
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    out = empty(n)
    with Context(CPU_THREADS=2):
        run_schedule([ExecItem(kernel_ast("big"), [out, buf(a), buf(b)], prg=CompiledRunner(add_spec(n)))])
    np.testing.assert_allclose(out.numpy(), a + b)

# *** copies and views ***

def test_buffer_copy():
    src = buf(np.arange(10, dtype=np.int32))
    dest = empty(10, dtypes.int32)
    run_schedule([ExecItem(UOp(Ops.COPY), [dest, src])])
    assert dest.numpy().tolist() == list(range(10))
    assert GlobalCounters.global_mem == 40 and GlobalCounters.kernel_count == 0

def test_buffer_copy_between_views():
    base = buf(np.arange(20, dtype=np.float32))
    dest = empty(5)
    run_schedule([ExecItem(UOp(Ops.COPY), [dest, base.view(5, dtypes.float32, 40)])])
    assert dest.numpy().tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]

@pytest.mark.parametrize("asynchronous", [1, 0])
def test_host_copy_is_queued_in_order(asynchronous):
    # a copy between CPU buffers runs as a queued kernel: after the kernels before it (it reads what they wrote), before
    # the ones after it (a write to its source after the copy doesn't reach the copy), in whole and in parts
    from fusegrad import Tensor
    a = np.random.default_rng(3).random(3 << 18, dtype=np.float32)   # 3 MiB: the copy is split across threads
    with Context(CPU_ASYNC=asynchronous):
        x = Tensor(a).realize()
        y = (x * 2).realize()
        whole, part = y.to("CPU:1"), y[1000:5000].to("CPU:1")
        Tensor.realize(whole, part)
        y.assign(y + 1).realize()
        assert realize._host_copy_program(whole.uop.buffer, y.uop.buffer) is not None
        np.testing.assert_equal(whole.numpy(), a * 2)
        np.testing.assert_equal(part.numpy(), (a * 2)[1000:5000])
        np.testing.assert_equal(y.numpy(), a * 2 + 1)

def test_host_copy_between_overlapping_views():
    # views of one buffer that overlap (2 MiB: a copy that size is otherwise split across threads) move as memmove does
    a = np.arange(1 << 19, dtype=np.float32)
    n = a.size
    for dest_at, src_at in ((0, 1000), (1000, 0)):
        base = buf(a)
        dest, src = base.view(n - 1000, dtypes.float32, 4 * dest_at), base.view(n - 1000, dtypes.float32, 4 * src_at)
        run_schedule([ExecItem(UOp(Ops.COPY), [dest, src])])
        expected = a.copy()
        expected[dest_at:dest_at + n - 1000] = a[src_at:src_at + n - 1000]
        np.testing.assert_equal(base.numpy(), expected)

@pytest.mark.parametrize("asynchronous", [1, 0])
def test_empty_host_copy_writes_nothing(asynchronous):
    # a copy of no bytes into an empty view inside a buffer leaves the bytes around the view as they were
    with Context(CPU_ASYNC=asynchronous):
        base = buf(np.zeros(16, np.uint8))
        src = buf(np.full(16, 7, np.uint8))
        dest = base.view(0, dtypes.uint8, 5).ensure_allocated()
        run_schedule([ExecItem(UOp(Ops.COPY), [dest, src.view(0, dtypes.uint8, 3)])])
        np.testing.assert_equal(base.numpy(), np.zeros(16, np.uint8))

def test_buffer_copy_size_mismatch():
    with pytest.raises(ValueError): run_schedule([ExecItem(UOp(Ops.COPY), [empty(3), empty(4)])])

def test_buffer_view_item():
    base = buf(np.arange(8, dtype=np.float32))
    v = base.view(4, dtypes.float32, 8)
    ei = lower_schedule_item(ExecItem(UOp(Ops.BUFFER_VIEW), [v, base]))
    assert isinstance(ei.prg, ViewOp)
    run_schedule([ei])
    assert v.numpy().tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(RuntimeError): run_schedule([ExecItem(UOp(Ops.BUFFER_VIEW), [empty(4), base])])

def test_lower_kinds():
    assert isinstance(lower_schedule_item(ExecItem(UOp(Ops.COPY), [empty(2), empty(2)])).prg, BufferCopy)
    si = ExecItem(UOp(Ops.COPY), [empty(2), empty(2)])
    lowered = lower_schedule_item(si)
    assert si.prg is None and lowered.prg is not None and lower_schedule_item(lowered) is lowered
    with pytest.raises(ValueError): lower_schedule_item(ExecItem(UOp(Ops.NOOP), [empty(2)]))

# *** the method cache (with a stand-in code generator, so this doesn't depend on codegen's internals) ***

@pytest.fixture
def fake_codegen(monkeypatch):
    calls = []
    def get_program(ast, renderer, name=None, quick=False):
        calls.append(ast)
        return add_spec(4, name=f"fake_{uuid.uuid4().hex[:8]}")
    import fusegrad
    mod = types.ModuleType("fusegrad.codegen")
    mod.get_program = get_program
    mod.quick_codegen_ok = lambda ast, renderer: False
    monkeypatch.setitem(sys.modules, "fusegrad.codegen", mod)
    monkeypatch.setattr(fusegrad, "codegen", mod, raising=False)
    monkeypatch.setattr(realize, "method_cache", {})
    monkeypatch.setattr(type(realize.Device["CPU"]), "renderer", None)
    return calls

def test_method_cache(fake_codegen):
    ast1, ast2 = kernel_ast(f"m1-{uuid.uuid4()}"), kernel_ast(f"m2-{uuid.uuid4()}")
    r1 = get_runner("CPU", ast1)
    assert get_runner("cpu", ast1) is r1 and fake_codegen == [ast1]
    assert get_runner("CPU", ast2) is not r1 and fake_codegen == [ast1, ast2]
    with Context(NOOPT=1): assert get_runner("CPU", ast1) is not r1  # different optimization settings, new kernel
    assert len(fake_codegen) == 3

def test_run_schedule_lowers_through_method_cache(fake_codegen):
    ast = kernel_ast(f"run-{uuid.uuid4()}")
    a, b = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    outs = [empty(4) for _ in range(3)]
    schedule = [ExecItem(ast, [o, buf(a), buf(b)]) for o in outs]
    run_schedule(schedule)
    assert len(fake_codegen) == 1 and GlobalCounters.kernel_count == 3
    assert all(o.numpy().tolist() == [1.0, 2.0, 3.0, 4.0] for o in outs)
    assert all(si.prg is None for si in schedule)  # the caller's items are left as they were

# *** DEBUG output ***

def test_debug_output(capsys):
    p = add_spec(64)
    items = [ExecItem(kernel_ast("dbg"), [empty(64), buf(np.ones(64, np.float32)), buf(np.ones(64, np.float32))],
                      prg=CompiledRunner(p)),
             ExecItem(UOp(Ops.COPY), [empty(64), buf(np.ones(64, np.float32))])]
    with Context(DEBUG=0): run_schedule(items)
    assert capsys.readouterr().out == ""
    with Context(DEBUG=1): run_schedule(items)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "1 kernels" in out[0] and "2 items" in out[0]
    with Context(DEBUG=2): run_schedule(items)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert p.name in lines[0] and "gs=64" in lines[0] and "GFLOPS" in lines[0] and "GB/s" in lines[0]
    assert "us" in lines[0] or "ms" in lines[0]
    assert "copy" in lines[1] and "run_schedule" in lines[2]
    assert GlobalCounters.time_sum_s > 0  # DEBUG=2 times every kernel

def test_debug2_reports_python_time_per_item(capsys):
    from fusegrad import Context, Tensor
    a = Tensor.rand(16, 16).realize()
    (a + 1).realize()  # compiled and cached, so the next realize is only Python and the kernel
    with Context(DEBUG=2): (a + 1).realize()
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("realize:"))
    assert "1 items" in line and "us per item" in line
    assert float(line.split("the rest (Python, compiling) ")[1].split(" us")[0]) > 0

def _six_reductions(t, salt: float) -> list:
    """Six reductions of t, each its own kernel (exp sums and relu maxima with constants from `salt`)."""
    return [(t * (salt + i)).exp().sum(1) if i % 2 else (t + salt - i).relu().max(0) for i in range(6)]

def _check_six_reductions(outs: list, x: np.ndarray, salt: float) -> None:
    for i, o in enumerate(outs):
        want = np.exp(x.astype(np.float64) * (salt + i)).sum(1) if i % 2 else np.maximum(x + salt - i, 0).max(0)
        np.testing.assert_allclose(o.numpy(), want, rtol=1e-5)

def _kernel_entries(src: str) -> int:
    """The kernels a C source handed to the compiler defines: their entry points as the C renderer writes them. (Not
    the C pool's own copy routine, `fg_copy_entry`: the pool's source is compiled the first time a process makes the
    pool, in whichever test that is, and a fresh disk cache makes that a compiler run.)"""
    return len(re.findall(r"^void (?!fg_)\w+_entry\(void", src, flags=re.MULTILINE))

def test_kernels_compiled_while_others_are_generated(monkeypatch, tmp_path):
    # each kernel its own compile group (sent to the compiler while the next is generated): every runner still gets
    # its own kernel's binary (results against numpy), and one compiler run was made per group (the last one
    # may be split across cores)
    from fusegrad import Tensor
    from fusegrad.runtime import ops_cpu
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))   # (a fresh disk cache: nothing is served from it)
    monkeypatch.setattr(realize, "PIPELINE_SMALL_GROUP_S", 0.0)
    monkeypatch.setattr(realize, "PIPELINE_SLOTS", 6)   # (a group is sent whatever the ones before it are doing)
    runs: list[int] = []
    compile_one = ops_cpu.CPUCompiler.compile
    # (kernels' entry points as the C renderer writes them)
    monkeypatch.setattr(ops_cpu.CPUCompiler, "compile", lambda self, src:
                        runs.append(_kernel_entries(src)) or compile_one(self, src))
    salt = uuid.uuid4().int % 1000 / 1000   # (constants no earlier test compiled: new kernels)
    x = np.linspace(-3, 3, 4096, dtype=np.float32).reshape(64, 64)
    t = Tensor(x)
    outs = _six_reductions(t, salt)
    # (the optimized build at once, with no quick tier: every compiler run counted here is one of the groups)
    with Context(CACHELEVEL=0, QUICK_COMPILE=0): Tensor.realize(*outs)
    _check_six_reductions(outs, x, salt)
    kernel_runs = [n for n in runs if n]
    assert sum(kernel_runs) == 6 and kernel_runs[:5] == [1] * 5

def test_kernels_generated_while_a_group_compiles_make_one_group(monkeypatch, tmp_path):
    # with one compile slot, the kernels generated while the first group compiles wait for it and go to the compiler
    # together (here: the first kernel alone, the other five the last group, after code generation); every runner
    # still gets its own kernel's binary (results against numpy)
    import threading
    from fusegrad import Tensor, codegen
    from fusegrad.runtime import ops_cpu
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(realize, "PIPELINE_SMALL_GROUP_S", 0.0)
    monkeypatch.setattr(realize, "PIPELINE_SLOTS", 1)
    generated, all_generated, first_began = [0], threading.Event(), threading.Event()
    get_program = codegen.get_program
    def counting(*args, **kwargs):
        # (the second kernel is generated once the first group's compile has begun: a compiler thread the OS started
        # late, after the last kernel, saw no kernel being generated, and the rest went to the last group)
        if generated[0] == 1: assert first_began.wait(10)
        p = get_program(*args, **kwargs)
        generated[0] += 1
        if generated[0] == 6: all_generated.set()
        return p
    monkeypatch.setattr(codegen, "get_program", counting)
    runs: list[tuple[int, bool]] = []   # (kernels, whether the compile began while kernels were generated)
    compile_one = ops_cpu.CPUCompiler.compile
    def compile_after_codegen(self, src):
        n = _kernel_entries(src)
        during = 0 < generated[0] < 6
        runs.append((n, during))
        if n: first_began.set()
        # (a group sent while the schedule's kernels are generated compiles until the last one was)
        if n and during: assert all_generated.wait(60)
        return compile_one(self, src)
    monkeypatch.setattr(ops_cpu.CPUCompiler, "compile", compile_after_codegen)
    # (a row length no other test uses: kernels that neither the method cache nor the compiler's memory has)
    salt, n = uuid.uuid4().int % 1000 / 1000, 200 + uuid.uuid4().int % 800
    x = np.linspace(-3, 3, 64 * n, dtype=np.float32).reshape(64, n)
    t = Tensor(x)
    outs = _six_reductions(t, salt)
    with Context(CACHELEVEL=0, QUICK_COMPILE=0): Tensor.realize(*outs)
    _check_six_reductions(outs, x, salt)
    kernel_runs = [r for r in runs if r[0]]
    assert sum(n for n, _ in kernel_runs) == 6 and [r for r in kernel_runs if r[1]] == [(1, True)], runs

def test_replayed_schedules_use_prepared_launches():
    # a schedule replayed from its plan gets each kernel's launch prepared once (its buffers passed per step): the
    # results of every step are right, with new inputs, new lifted constants and fresh outputs, and GlobalCounters
    # count the same kernels and work as a plain run
    from fusegrad import Device, Tensor
    from fusegrad.engine.realize import run_schedule
    rs = np.random.default_rng(5)
    w = Tensor(rs.standard_normal((16, 8)).astype(np.float32)).realize()
    counts = []
    for step, c in enumerate((1.5, -2.0, 0.25, 3.0)):
        x = rs.standard_normal((4, 16)).astype(np.float32)
        out = ((Tensor(x) * c) @ w).relu().sum(0)
        sched = out.schedule()
        if step >= 2: assert any(ei.launch is not None for ei in sched), "the replayed kernels have prepared launches"
        before = (GlobalCounters.kernel_count, GlobalCounters.global_ops)
        run_schedule(sched)
        counts.append((GlobalCounters.kernel_count - before[0], GlobalCounters.global_ops - before[1]))
        Device["CPU"].synchronize()
        np.testing.assert_allclose(out.numpy(), np.maximum((x * c) @ w.numpy(), 0).sum(0), rtol=1e-5, atol=1e-5)
    assert len(set(counts)) == 1, counts
