"""Kernels linked without the C library (cpu_compiler.LEAN_LINK) and the host copy kernel compiled in the C pool's
compiler run."""
import os
import subprocess
import sys
import uuid
import numpy as np
import pytest
from fusegrad.device import Buffer
from fusegrad.dtype import dtypes
from fusegrad.runtime import cpu_compiler
from fusegrad.runtime.cpu_compiler import CPUCompiler, lean_link_ok
from fusegrad.runtime.cpu_program import CPUProgram

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

# builtins that become calls into libc and libm (memset and memcpy of a length known only at run time, expf and
# logf), as a kernel's code may call them: a lean-linked binary gets them from the interpreter's libraries
LIBCALLS = """void libcalls(float* restrict out, const float* restrict a, long n, long core_lo, long core_hi) {
  __builtin_memset(out, 0, (unsigned long)n * sizeof(float));
  __builtin_memcpy(out + n, a, (unsigned long)n * sizeof(float));
  for (long i = 0; i < n; i++) out[2 * n + i] = __builtin_expf(a[i]) + __builtin_logf(a[i] + 2.0f);
}"""

def needed(lib: bytes) -> set[str]:
    """The libraries a shared object names as needed (the names in its dynamic string table)."""
    return {name for name in ("libc.so.6", "libm.so.6") if name.encode() in lib}

def run_libcalls(comp: CPUCompiler, a: np.ndarray) -> np.ndarray:
    prg = CPUProgram("libcalls", comp.compile_cached(f"/* {uuid.uuid4().hex} */\n{LIBCALLS}"))
    out = Buffer("CPU", 3 * a.size, dtypes.float32).ensure_allocated()
    src = Buffer("CPU", a.size, dtypes.float32).copyin(memoryview(a))
    prg(out._buf, src._buf, vals=(a.size,), wait=True)
    return out.numpy()

def test_lean_on_linux_with_gcc():
    # (CI's host: Linux with GCC, whose interpreter has libc and libm loaded)
    comp = CPUCompiler()
    if sys.platform.startswith("linux") and cpu_compiler._is_gcc(tuple(comp.cc)): assert comp.lean
    assert comp.lean == lean_link_ok(tuple(comp.cc))

@pytest.mark.parametrize("lean", ["1", "0"])
def test_library_calls_of_a_kernel(lean, monkeypatch):
    monkeypatch.setenv("LEAN_LINK", lean)
    comp = CPUCompiler()
    assert comp.lean == (lean == "1" and lean_link_ok(tuple(comp.cc)))
    a = np.random.default_rng(0).uniform(0.1, 3, 1000).astype(np.float32)
    out = run_libcalls(comp, a)
    np.testing.assert_array_equal(out[:1000], 0)
    np.testing.assert_array_equal(out[1000:2000], a)
    np.testing.assert_allclose(out[2000:], np.exp(a) + np.log(a + 2), rtol=2e-6)

def test_lean_binary_names_no_library():
    comp = CPUCompiler()
    if not comp.lean: assert os.getenv("LEAN_LINK") == "0" or not sys.platform.startswith("linux") or \
        not cpu_compiler._is_gcc(tuple(comp.cc)); return
    assert needed(comp.compile(LIBCALLS)) == set()
    # a source with an #include (the C pool's pthreads) is linked with the C library as usual
    assert "libc.so.6" in needed(comp.compile("#include <string.h>\nvoid f(char *p, long n) { memset(p, 1, n); }"))

def test_link_mode_is_in_the_cache_key(monkeypatch):
    lean = CPUCompiler()
    monkeypatch.setenv("LEAN_LINK", "0")
    full = CPUCompiler()
    assert not full.lean
    assert (lean.cachekey == full.cachekey) == (not lean.lean)

def test_host_copy_compiled_with_the_pool(tmp_path):
    # a fresh process with an empty cache: once the C pool is built, a copy between CPU devices runs its kernel without
    # another compiler run
    code = """
import numpy as np
from fusegrad import Device, Tensor
from fusegrad.runtime.cpu_pool import HOST_COPY_SOURCE, c_pool
assert c_pool(Device["CPU"]) is not None
def runs(): return Device["CPU"].compiler.compiles + Device["CPU:1"].compiler.compiles
x = (Tensor(np.arange(3 << 16, dtype=np.float32)) * 2).realize()
before = runs()
y = x.to("CPU:1").realize()
z = y.to("CPU").realize()
assert runs() == before, (before, runs())
np.testing.assert_equal(z.numpy(), np.arange(3 << 16, dtype=np.float32) * 2)
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CPU_ASYNC": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
