"""The CPU compiler (caches on disk and in memory, errors) and programs (calling convention, thread split)."""
import ctypes
import os
import uuid
import numpy as np
import pytest
from fusegrad.device import Buffer, CompileError
from fusegrad.dtype import dtypes
from fusegrad.helpers import Context
from fusegrad.runtime.cpu_compiler import CPUCompiler
from fusegrad.runtime.cpu_program import CPUProgram

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

def unique(src: str) -> str:
    # a fresh source text, so no earlier test (or process) has this program cached
    return f"/* {uuid.uuid4().hex} */\n{src}"

MULADD = """void muladd(float* restrict out, const float* restrict a, const float* restrict b, const float* restrict c,
                        long core_lo, long core_hi) {
  for (long i = core_lo; i < core_hi; i++) out[i] = a[i] * b[i] + c[i];
}"""

def np_buf(arr: np.ndarray) -> Buffer:
    return Buffer("CPU", arr.size, dtypes.float32).copyin(memoryview(np.ascontiguousarray(arr, np.float32)))

def test_compile_and_call():
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    prg = CPUProgram("muladd", CPUCompiler().compile_cached(unique(MULADD)))
    out = Buffer("CPU", 1000, dtypes.float32).ensure_allocated()
    assert prg(out._buf, np_buf(a)._buf, np_buf(b)._buf, np_buf(c)._buf, global_size=1000) is None
    np.testing.assert_allclose(out.numpy(), a * b + c, rtol=1e-6, atol=1e-6)
    et = prg(out._buf, np_buf(a)._buf, np_buf(b)._buf, np_buf(c)._buf, global_size=1000, wait=True)
    assert isinstance(et, float) and et > 0

def test_vars_are_64_bit():
    src = unique("""void k(long* restrict out, long n, long m, long core_lo, long core_hi) {
      out[0] = n; out[1] = m; out[2] = core_lo; out[3] = core_hi; }""")
    prg = CPUProgram("k", CPUCompiler().compile_cached(src))
    out = Buffer("CPU", 4, dtypes.int64).ensure_allocated()
    prg(out._buf, vals=(2**40 + 3, -5))
    assert out.numpy().tolist() == [2**40 + 3, -5, 0, 1]

def test_memory_cache_hit():
    comp, src = CPUCompiler(), unique(MULADD)
    lib = comp.compile_cached(src)
    assert comp.compile_cached(src) is lib and comp.compiles == 1

def test_disk_cache_hit_in_fresh_compiler():
    src = unique(MULADD)
    first = CPUCompiler()
    lib = first.compile_cached(src)
    assert os.path.exists(first.cache_path(src))
    second = CPUCompiler()
    assert second.compile_cached(src) == lib
    assert second.compiles == 0 and second.disk_hits == 1

def test_cache_key_depends_on_flags():
    src = unique(MULADD)
    CPUCompiler(["-O1"]).compile_cached(src)
    other = CPUCompiler(["-O2"])
    other.compile_cached(src)
    assert other.compiles == 1

def test_cachelevel_0_bypasses_disk():
    src = unique(MULADD)
    with Context(CACHELEVEL=0):
        comp = CPUCompiler()
        comp.compile_cached(src)
        assert comp.compiles == 1 and not os.path.exists(comp.cache_path(src))
    CPUCompiler().compile_cached(src)  # now it is on disk
    with Context(CACHELEVEL=0):
        comp = CPUCompiler()
        comp.compile_cached(src)
        assert comp.compiles == 1 and comp.disk_hits == 0

@pytest.mark.parametrize("corrupt", ["garbage", "truncated", "empty"])
def test_corrupt_cache_entry_is_recompiled(corrupt):
    src = unique(MULADD)
    comp = CPUCompiler()
    good = comp.compile_cached(src)
    path = comp.cache_path(src)
    data = open(path, "rb").read()
    bad = {"garbage": os.urandom(len(data)), "truncated": data[:len(data) // 2], "empty": b""}[corrupt]
    with open(path, "wb") as f: f.write(bad)
    fresh = CPUCompiler()
    lib = fresh.compile_cached(src)
    assert fresh.compiles == 1 and lib[:4] == b"\x7fELF"
    # the entry was replaced by a good one
    again = CPUCompiler()
    assert again.compile_cached(src) == lib and again.disk_hits == 1 and again.compiles == 0
    a = np.arange(8, dtype=np.float32)
    out = Buffer("CPU", 8, dtypes.float32).ensure_allocated()
    CPUProgram("muladd", lib)(out._buf, np_buf(a)._buf, np_buf(a)._buf, np_buf(a)._buf, global_size=8)
    np.testing.assert_array_equal(out.numpy(), a * a + a)
    assert len(good) > 0

def test_no_temp_files_left(tmp_path):
    comp = CPUCompiler()
    comp.compile_cached(unique(MULADD))
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.startswith(".tmp-")]
    assert leftovers == []

def test_compile_error():
    src = unique("void broken(float* out, long core_lo, long core_hi) {\n  out[0] = undefined_thing + ;\n}")
    with pytest.raises(CompileError) as e: CPUCompiler().compile_cached(src)
    msg = str(e.value)
    assert "error" in msg and "undefined_thing" in msg
    assert "   3   out[0] = undefined_thing + ;" in msg  # the numbered source (line 3 after the unique comment)

def test_missing_function():
    lib = CPUCompiler().compile_cached(unique(MULADD))
    with pytest.raises(RuntimeError, match="no function"): CPUProgram("not_there", lib)

# *** splitting a kernel across threads ***

COVER = """void cover(int* restrict idx, int* restrict hits, long* restrict chunk, long core_lo, long core_hi) {
  for (long i = core_lo; i < core_hi; i++) { idx[i] = (int)i; hits[i] += 1; chunk[i] = core_lo; }
}"""

@pytest.mark.parametrize("global_size,threads", [(1000, 2), (1000, 1), (1000, 7), (3, 8), (1, 4)])
def test_threaded_split_covers_each_index_once(global_size, threads):
    prg = CPUProgram("cover", CPUCompiler().compile_cached(COVER))
    idx, hits, chunk = Buffer("CPU", global_size, dtypes.int32), Buffer("CPU", global_size, dtypes.int32), \
        Buffer("CPU", global_size, dtypes.int64)
    hits.copyin(memoryview(np.zeros(global_size, np.int32)))
    prg(idx.ensure_allocated()._buf, hits._buf, chunk.ensure_allocated()._buf, global_size=global_size, threads=threads)
    assert idx.numpy().tolist() == list(range(global_size))
    assert hits.numpy().tolist() == [1] * global_size
    n = min(threads, global_size)
    starts = sorted(set(chunk.numpy().tolist()))
    assert starts == [global_size * i // n for i in range(n)]  # n contiguous chunks

def test_cpu_threads_caps_split():
    prg = CPUProgram("cover", CPUCompiler().compile_cached(COVER))
    bufs = [Buffer("CPU", 100, dt).ensure_allocated() for dt in (dtypes.int32, dtypes.int32, dtypes.int64)]
    bufs[1].copyin(memoryview(np.zeros(100, np.int32)))
    with Context(CPU_THREADS=1): prg(*[b._buf for b in bufs], global_size=100, threads=4)
    assert set(bufs[2].numpy().tolist()) == {0} and bufs[1].numpy().tolist() == [1] * 100

RENDEZVOUS = """#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
void meet(int* restrict arrived, int* restrict saw, long core_lo, long core_hi) {
  __atomic_add_fetch(arrived, 1, __ATOMIC_SEQ_CST);
  double end = now() + 5.0;
  while (__atomic_load_n(arrived, __ATOMIC_SEQ_CST) < 2 && now() < end) {}
  saw[core_lo] = __atomic_load_n(arrived, __ATOMIC_SEQ_CST);
}"""

def test_threads_run_concurrently():
    # each half waits until the other has started: only possible if they run at the same time (GIL released)
    prg = CPUProgram("meet", CPUCompiler().compile_cached(RENDEZVOUS))
    arrived, saw = Buffer("CPU", 1, dtypes.int32), Buffer("CPU", 2, dtypes.int32)
    arrived.copyin(memoryview(np.zeros(1, np.int32)))
    saw.copyin(memoryview(np.zeros(2, np.int32)))
    et = prg(arrived._buf, saw._buf, global_size=2, threads=2, wait=True)
    assert saw.numpy().tolist() == [2, 2] and et < 4.0

def test_pool_reports_errors():
    from fusegrad.runtime.cpu_pool import python_pool
    def boom(x):
        if x == 1: raise ZeroDivisionError("in a worker")
    with pytest.raises(ZeroDivisionError): python_pool.run(boom, [(0,), (1,)])
    ran = []
    python_pool.run(lambda x: ran.append(x), [(0,), (1,), (2,)])  # the pool still works afterwards
    assert sorted(ran) == [0, 1, 2]

def test_address_helper():
    from fusegrad.runtime.cpu_memory import address
    b = Buffer("CPU", 4, dtypes.float32).ensure_allocated()
    assert address(b._buf) == ctypes.addressof(b._buf)
