"""Two compile tiers for the CPU: new kernels run a quick build first (cpu_compiler.TieredCompiler), then their
optimized build takes over, with the same results."""
import ctypes
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import uuid
import numpy as np
import pytest
from fusegrad import Device, Tensor, TinyJit
from fusegrad.device import Buffer, CompileError
from fusegrad.dtype import dtypes
from fusegrad.engine import realize
from fusegrad.helpers import Context
from fusegrad.runtime.cpu_compiler import DEFAULT_FLAGS, CPUCompiler, TieredCompiler, forwarding, quick_flags, \
    quick_source
from fusegrad.runtime.ops_cpu import TieredCPUProgram

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

@pytest.fixture
def small_schedules_tiered(monkeypatch):
    # (the schedules of these tests have fewer new kernels than a model's first call)
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 1)

def entry_kernel(name: str, value: float) -> str:
    """A kernel with the C renderer's calling convention (and entry point) that writes `value` * a into out."""
    return (f"/* {uuid.uuid4().hex} */\n"
            f"void {name}(float* restrict out, const float* restrict a, long core_lo, long core_hi) {{\n"
            f"  for (long i = core_lo; i < core_hi; i++) out[i] = a[i] * {value}f;\n}}\n"
            f"void {name}_entry(void **a, long core_lo, long core_hi) {{ {name}((float*)a[0], (const float*)a[1], "
            "core_lo, core_hi); }\n")

def test_quick_flags_keep_what_fixes_the_arithmetic():
    flags = ["-O2", "-fvect-cost-model=dynamic", "-march=native", "-ffp-contract=off", "-fwrapv", "-fno-math-errno"]
    assert quick_flags(flags) == ["-Og", "-march=native", "-ffp-contract=off", "-fwrapv", "-fno-math-errno"]
    assert quick_flags(["-march=native"]) == ["-Og", "-march=native"]
    assert quick_flags(DEFAULT_FLAGS)[0] == "-Og"

def test_the_renderers_entry_points_get_forwarding():
    # the pattern forwarding() rewrites is the entry the C renderer writes: a kernel it rendered gets a _next pointer
    src = realize.get_runner("CPU", (Tensor.ones(16).contiguous() * 3).schedule()[-1].ast).p.src
    fwd = forwarding(src)
    assert fwd is not None and fwd.count("_next") == 2 and "_next)(void **, long, long);\n" in fwd
    assert forwarding("void k(float* a, long core_lo, long core_hi) { }") is None

NO_LOOP_VECTORIZE = '#pragma GCC optimize("no-tree-loop-vectorize")'

def test_the_quick_source_drops_the_loop_vectorizer_pragma_where_its_level_doesnt_vectorize():
    src = f"#if defined(__GNUC__) && !defined(__clang__)\n{NO_LOOP_VECTORIZE}\n#endif\n" + entry_kernel("kq", 2.0)
    quick = quick_source(src, quick_flags(DEFAULT_FLAGS))
    assert quick == forwarding(src).replace(NO_LOOP_VECTORIZE + "\n", "")   # type: ignore[union-attr]
    assert NO_LOOP_VECTORIZE not in quick
    # a level or a flag that runs the loop vectorizer keeps it; a source without an entry point is not a quick one
    assert NO_LOOP_VECTORIZE in quick_source(src, ["-O2", "-march=native"])   # type: ignore[operator]
    assert NO_LOOP_VECTORIZE in quick_source(src, ["-Og", "-ftree-vectorize"])   # type: ignore[operator]
    assert quick_source(f"{NO_LOOP_VECTORIZE}\nvoid k(float* a) {{ }}\n", ["-Og"]) is None
    # without it, kernels that had it share one compiler run
    a = quick_source(src, ["-Og"])
    b = quick_source(src.replace("kq", "kr"), ["-Og"])
    assert a is not None and b is not None and "#pragma" not in a + b
    lib = CPUCompiler(["-Og"]).compile(a + b)
    assert all(name.encode() in lib for name in ("kq_entry", "kr_entry"))

def test_only_the_quick_tier_gets_gccs_one_region_register_allocation():
    tiered = TieredCompiler(CPUCompiler(DEFAULT_FLAGS))
    gcc = "Free Software Foundation" in subprocess.run([*tiered.final.cc, "--version"], capture_output=True,
                                                        text=True).stdout
    assert ("-fira-region=one" in tiered.quick.flags) == gcc and "-fira-region=one" not in tiered.background.flags
    assert tiered.quick.flags[:len(quick_flags(DEFAULT_FLAGS))] == quick_flags(DEFAULT_FLAGS)

def test_upgrade_forwards_callers_of_the_quick_entry():
    # the quick binary (entry forwarding) computes 2*a, its "optimized" stand-in 3*a: once upgraded, a call through
    # the program and a launch prepared before the upgrade (which holds the quick entry's address) both run the new code
    quick_src, final_src = entry_kernel("kfw", 2.0), entry_kernel("kfw", 3.0)
    prg = TieredCPUProgram("kfw", CPUCompiler(quick_flags(DEFAULT_FLAGS)).compile(forwarding(quick_src)))
    a = np.arange(64, dtype=np.float32)
    inp = Buffer("CPU", 64, dtypes.float32).copyin(memoryview(a))
    out = Buffer("CPU", 64, dtypes.float32).ensure_allocated()
    prg(out._buf, inp._buf, global_size=64, wait=True)
    np.testing.assert_array_equal(out.numpy(), 2 * a)
    prepared = prg.prepare(out._buf, inp._buf, global_size=64, threads=2)
    quick_entry = prg._entry
    prg.upgrade(CPUCompiler().compile(final_src))
    assert prg._entry != quick_entry
    prg(out._buf, inp._buf, global_size=64, wait=True)
    np.testing.assert_array_equal(out.numpy(), 3 * a)
    if prepared is not None:   # (no prepared launches without the C pool)
        out2 = Buffer("CPU", 64, dtypes.float32).ensure_allocated()
        assert prepared.program._entry == prg._entry
        prepared()
        np.testing.assert_array_equal(out.numpy(), 3 * a)
        # a raw call of the quick entry point, as a launch graph built before the upgrade makes it
        fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_long, ctypes.c_long)(quick_entry)
        args = (ctypes.c_void_p * 2)(ctypes.addressof(out2._buf), ctypes.addressof(inp._buf))
        fn(args, 0, 64)
        np.testing.assert_array_equal(out2.numpy(), 3 * a)

def workload(salt: float) -> tuple[list[Tensor], list[np.ndarray]]:
    """Kernels of several kinds (elementwise with transcendentals, reductions, a matmul, a convolution, softmax) and
    their NumPy results; `salt` makes them kernels no earlier test compiled."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((48, 24)).astype(np.float32)
    img = rng.standard_normal((2, 3, 10, 10)).astype(np.float32)
    k = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    tx, tw, ti, tk = Tensor(x), Tensor(w), Tensor(img), Tensor(k)
    outs = [((tx * salt).exp() + 1).log() + tx.sin(), (tx + salt).relu().sum(1), (tx * salt) @ tw,
            ti.conv2d(tk * salt, padding=1), (tx * salt).softmax(1)]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    conv = np.zeros((2, 4, 10, 10))
    pad = np.pad(img.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    for i in range(3):
        for j in range(3): conv += np.einsum("bchw,oc->bohw", pad[:, :, i:i + 10, j:j + 10], k[:, :, i, j] * salt)
    e = np.exp(x64 * salt - (x64 * salt).max(1, keepdims=True))
    want = [np.log1p(np.exp(x64 * salt)) + np.sin(x64), np.maximum(x64 + salt, 0).sum(1), (x64 * salt) @ w64, conv,
            e / e.sum(1, keepdims=True)]
    return outs, want

def hold_upgrades() -> list:
    """Keep the background compiles asked for from now on in a list, until release_upgrades."""
    held: list = []
    Device["CPU"].tiered.later = lambda srcs, done: held.append((srcs, done))
    return held

def release_upgrades(held: list) -> None:
    """Start the background compiles held back, and wait for them."""
    tiered = Device["CPU"].tiered
    del tiered.later
    for srcs, done in held: tiered.later(srcs, done)
    tiered.wait()

def test_both_tiers_give_the_same_results(small_schedules_tiered):
    # the kernels of a schedule run their quick build first (held back from the upgrade here), then the optimized
    # one: the results of both are the same bits, and right against NumPy
    held = hold_upgrades()
    salt = 1 + uuid.uuid4().int % 1000 / 1000
    outs, want = workload(salt)
    try:
        # (the kernels' full programs: test/codegen/test_quick_codegen.py has the quick ones)
        with Context(QUICK_COMPILE=1, QUICK_CODEGEN=0): Tensor.realize(*outs)
        first = [o.numpy() for o in outs]
    finally: release_upgrades(held)
    for got, ref in zip(first, want): np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    assert held and sum(len(srcs) for srcs, _ in held) >= len(outs)
    # (the padded convolution's gated loads keep gcc's loop vectorizer off its optimized build; its quick build,
    # without that pragma, gave the same bits)
    assert any(NO_LOOP_VECTORIZE in src for srcs, _ in held for src in srcs)
    runners = [r for r in realize.method_cache.values() if r.p.src in {s for srcs, _ in held for s in srcs}]
    assert runners and all(r._prg._kept for r in runners)   # every one upgraded
    outs2, _ = workload(salt)   # (the same kernels again: from the method cache, now optimized)
    Tensor.realize(*outs2)
    for a, b in zip(first, [o.numpy() for o in outs2]): np.testing.assert_array_equal(a, b)

def test_a_jit_captured_on_the_quick_build_runs_the_optimized_one(small_schedules_tiered):
    held = hold_upgrades()
    salt = 2 + uuid.uuid4().int % 1000 / 1000
    rng = np.random.default_rng(4)
    w = Tensor(rng.standard_normal((16, 8)).astype(np.float32)).realize()
    @TinyJit
    def step(x: Tensor) -> Tensor: return ((x @ w) * salt).relu().sum(1) + (x * salt).exp().sum(1)
    xs = [rng.standard_normal((4, 16)).astype(np.float32) for _ in range(6)]
    def want(x: np.ndarray) -> np.ndarray:
        x64, w64 = x.astype(np.float64), w.numpy().astype(np.float64)
        return np.maximum((x64 @ w64) * salt, 0).sum(1) + np.exp(x64 * salt).sum(1)
    try:   # captured and replayed on the quick builds
        for x in xs[:3]: np.testing.assert_allclose(step(Tensor(x)).numpy(), want(x), rtol=1e-5)
    finally: release_upgrades(held)
    assert held
    for x in xs[3:]: np.testing.assert_allclose(step(Tensor(x)).numpy(), want(x), rtol=1e-5)

def test_a_failed_optimized_compile_keeps_the_quick_build(monkeypatch):
    tiered = TieredCompiler(CPUCompiler())
    src = entry_kernel("kfail", 2.0)
    (lib, final), = tiered.first([src])
    assert not final and b"kfail_next" in lib
    def fail(self, src): raise CompileError("no")
    monkeypatch.setattr(tiered.background, "compile", fail.__get__(tiered.background))
    got: list = []
    tiered.later([src], [got.append])
    tiered.wait()
    assert got == []

def test_the_optimized_build_is_cached_for_the_next_process():
    # what the background compiled is on disk under the optimized configuration: a new compiler (a new process)
    # gets it as final at once
    src = entry_kernel("kcache", 2.0)
    tiered = TieredCompiler(CPUCompiler())
    assert [final for _, final in tiered.first([src])] == [False]
    got: list = []
    tiered.later([src], [got.append])
    tiered.wait()
    again = TieredCompiler(CPUCompiler())
    (lib, final), = again.first([src])
    assert final and got == [lib] and again.final.compiles == 0 and again.quick.compiles == 0

def test_small_schedules_and_quick_compile_off_get_the_optimized_build_at_once(monkeypatch):
    calls: list = []
    tiered = Device["CPU"].tiered
    monkeypatch.setattr(tiered, "first", lambda *a: calls.append(a))
    salt = 3 + uuid.uuid4().int % 1000 / 1000
    x = np.arange(12, dtype=np.float32)
    np.testing.assert_allclose((Tensor(x) * salt).numpy(), x * salt, rtol=1e-6)
    small = [(Tensor(x) * salt).exp(), (Tensor(x) * salt).sum()]
    Tensor.realize(*small)
    assert len(small) < realize.QUICK_MIN_KERNELS
    np.testing.assert_allclose(small[1].numpy(), (x * salt).sum(), rtol=1e-5)
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 2)
    with Context(QUICK_COMPILE=0):
        outs = [(Tensor(x) + salt).exp(), (Tensor(x) - salt).sum()]
        Tensor.realize(*outs)
    np.testing.assert_allclose(outs[0].numpy(), np.exp(x + salt), rtol=1e-5)
    assert calls == []

def test_exit_ends_the_background_compilers(tmp_path):
    # a compiler that takes a minute when run at nice 19 (the background's builds): the process's exit neither waits
    # for them nor leaves them running
    slow_cc = tmp_path / "slow_cc.sh"
    slow_cc.write_text('#!/bin/sh\n[ "$(cut -d" " -f19 /proc/$$/stat)" = 19 ] && sleep 60\nexec cc "$@"\n')
    slow_cc.chmod(0o755)
    code = textwrap.dedent("""
        import os, time
        import numpy as np
        from fusegrad import Tensor
        from fusegrad.runtime.cpu_compiler import _background_procs
        xs = [Tensor(np.full((16, 16 + i), i, np.float32)) for i in range(10)]   # (ten kernels: nothing to merge)
        Tensor.realize(*[((x * 2.5).exp() + 1).sum(1) for x in xs])
        deadline = time.time() + 30
        while not _background_procs and time.time() < deadline: time.sleep(0.05)
        print(os.getpid(), len(_background_procs), flush=True)
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": str(slow_cc), "CPU_ASYNC": "0", "QUICK_CODEGEN": "0",
           "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    st = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    pid, in_flight = out.stdout.split()
    assert int(in_flight) == 1 and time.time() - st < 45
    time.sleep(0.2)
    left = []
    for proc in pathlib.Path("/proc").iterdir():
        try: cmdline = (proc / "cmdline").read_bytes()
        except OSError: continue
        if f"fusegrad-cc-{pid}-".encode() in cmdline: left.append(proc.name)
    assert left == []
