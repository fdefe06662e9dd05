"""Programs compiled in one compiler run share one loaded shared object (cpu_program.shared_library)."""
import gc
import multiprocessing
import uuid
import weakref
import numpy as np
import pytest
from fusegrad.device import Buffer, Device
from fusegrad.dtype import dtypes
from fusegrad.runtime.cpu_compiler import CPUCompiler, forwarding
from fusegrad.runtime import cpu_program
from fusegrad.runtime.cpu_program import CPUProgram
from fusegrad.runtime.ops_cpu import TieredCPUProgram

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

def kernel(name: str, body: str) -> str:
    # (the entry point as the C renderer writes it, which cpu_compiler.forwarding finds)
    return f"""void {name}(float* restrict out, float* restrict a, long core_lo, long core_hi) {{
  for (long i = core_lo; i < core_hi; i++) out[i] = {body};
}}
void {name}_entry(void **a, long core_lo, long core_hi) {{ {name}((float*)a[0], (float*)a[1], core_lo, core_hi); }}
"""

def run(prg: CPUProgram, a: np.ndarray) -> np.ndarray:
    out = Buffer("CPU", a.size, dtypes.float32).ensure_allocated()
    prg(out._buf, Buffer("CPU", a.size, dtypes.float32).copyin(memoryview(a))._buf, global_size=a.size, threads=2)
    return out.numpy()

def _settle() -> None:
    """Let go of what the C pool keeps of finished launches (it holds a queued launch's program until a later wait
    sees the launch done), then collect."""
    Device["CPU"].synchronize()
    gc.collect()

def names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"twice_{tag}", f"plus_{tag}"

def test_one_load_per_binary():
    twice, plus = names()
    comp = CPUCompiler()
    srcs = [kernel(twice, "a[i] * 2.0f"), kernel(plus, "a[i] + 1.0f")]
    libs = comp.compile_cached_many(srcs, 1)
    assert libs[0] is libs[1]   # (one compiler run, one binary)
    p1, p2 = CPUProgram(twice, libs[0]), CPUProgram(plus, libs[1])
    assert p1._dll is p2._dll
    a = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(run(p1, a), a * 2)
    np.testing.assert_array_equal(run(p2, a), a + 1)
    # the same bytes read again (a disk cache entry per kernel) are the same binary: loaded once as well
    assert CPUProgram(twice, bytes(libs[0]))._dll is p1._dll
    dll = weakref.ref(p1._dll)
    del p1
    gc.collect()
    assert dll() is not None   # (p2 runs from it)
    np.testing.assert_array_equal(run(p2, a), a + 1)
    del p2
    _settle()
    assert dll() is None       # unloaded once no program holds it

def test_upgrade_keeps_the_forward_target_loaded():
    # two programs of one kernel share its quick binary; once one of them is upgraded, the quick binary's entry point
    # forwards to the optimized one, which must stay loaded while anyone may call the quick entry
    twice, _ = names()
    src = kernel(twice, "a[i] * 2.0f")
    quick = CPUCompiler(["-O0"]).compile(forwarding(src))
    a, b = TieredCPUProgram(twice, quick), TieredCPUProgram(twice, quick)
    assert a._dll is b._dll
    a.upgrade(CPUCompiler().compile(src))
    target = weakref.ref(a.fxn)
    optimized = weakref.ref(a._dll)
    assert optimized() is not b._dll
    del a
    gc.collect()
    assert optimized() is not None and target() is None
    x = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(run(b, x), x * 2)   # (b's entry forwards to the optimized code)
    del b
    _settle()
    assert optimized() is None

def _load_in_child(lib: bytes, name: str, q) -> None:
    import faulthandler
    faulthandler.dump_traceback_later(20, exit=True)
    x = np.arange(100, dtype=np.float32)
    q.put(run(CPUProgram(name, lib), x).tolist() == (x * 2).tolist())

def test_forked_child_loads_while_the_parent_loads():
    # a fork while another thread of the parent is loading a library (holding the lock of the loaded libraries): the
    # child loads its own without waiting for a lock nobody in it will release
    twice, _ = names()
    lib = CPUCompiler().compile(kernel(twice, "a[i] * 2.0f"))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    with cpu_program._libraries_lock:
        p = ctx.Process(target=_load_in_child, args=(lib, twice, q))
        p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("a forked child's library load hung")
    assert p.exitcode == 0 and q.get(timeout=5)
