"""What the disk cache of compiled programs and the temp folder may hold when something went wrong (a truncated shared
object under a valid checksum, a FIFO, a link to /dev/zero, garbage, an empty file, a folder, leftovers of a killed
process), and Ctrl-C while Python waits for a kernel. Anything that could hang or crash runs in a subprocess."""
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
import pytest
from fusegrad.device import CompileError, Compiler
from fusegrad.hostcpu import host_cpu_count
from fusegrad.runtime.cpu_compiler import CPUCompiler
from fusegrad.runtime.elf import ET_DYN, ET_REL, elf_is_whole

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

def run_child(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": ROOT, **env}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)

def wrapped(payload: bytes) -> bytes:
    """A cache entry with a valid checksum around `payload`."""
    return Compiler.MAGIC + hashlib.sha256(payload).digest() + payload

def fill(n: int) -> str:
    # a kernel only this test compiles: out[i] = i * n + 1
    return f"""/* {uuid.uuid4().hex} */
void fill(float* restrict out, long core_lo, long core_hi) {{
  for (long i = core_lo; i < core_hi; i++) out[i] = (float)(i * {n} + 1);
}}"""

def make_hostile(path: str, case: str, lib: bytes) -> None:
    os.unlink(path)
    if case == "truncated_so": data = wrapped(lib[:len(lib) * 3 // 10])       # (was: SIGBUS in dlopen)
    elif case == "truncated_so_tail": data = wrapped(lib[:len(lib) - 200])   # section headers cut
    elif case == "wrapped_garbage": data = wrapped(b"\x7fELF" + os.urandom(len(lib)))
    elif case == "garbage": data = os.urandom(len(lib))
    elif case == "empty": data = b""
    elif case == "fifo": return os.mkfifo(path)                               # (was: a hang)
    elif case == "symlink_dev_zero": return os.symlink("/dev/zero", path)    # (was: reading without end)
    elif case == "symlink_to_entry":
        with open(path + ".real", "wb") as f: f.write(wrapped(lib))
        return os.symlink(path + ".real", path)
    elif case == "directory":
        os.mkdir(path)
        with open(os.path.join(path, "x"), "wb") as f: f.write(b"x")
        return None
    elif case == "oversized":
        with open(path, "wb") as f: f.truncate(Compiler.MAX_ENTRY_BYTES + 1)  # (sparse: no disk used)
        return None
    else: raise ValueError(case)
    with open(path, "wb") as f: f.write(data)

CASES = ["truncated_so", "truncated_so_tail", "wrapped_garbage", "garbage", "empty", "fifo", "symlink_dev_zero",
         "symlink_to_entry", "directory", "oversized"]

_CHILD = """
import json, sys
import numpy as np
from fusegrad.device import Buffer
from fusegrad.dtype import dtypes
from fusegrad.runtime.cpu_compiler import CPUCompiler
from fusegrad.runtime.cpu_program import CPUProgram
out = {}
for case, (n, src) in json.loads(sys.argv[1]).items():
    comp = CPUCompiler()
    prg = CPUProgram("fill", comp.compile_cached(src))
    buf = Buffer("CPU", 100, dtypes.float32).ensure_allocated()
    prg(buf._buf, global_size=100)
    out[case] = {"ok": bool((buf.numpy() == np.arange(100, dtype=np.float32) * n + 1).all()),
                 "compiles": comp.compiles, "disk_hits": comp.disk_hits}
print(json.dumps(out))
"""

def test_hostile_cache_entries_are_evicted_and_recompiled(tmp_path):
    srcs, libs = {}, {}
    for n, case in enumerate(CASES, start=2):
        src = fill(n)
        comp = CPUCompiler()
        libs[case] = comp.compile_cached(src)
        make_hostile(comp.cache_path(src), case, libs[case])
        srcs[case] = (n, src)
    r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(srcs)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    for case in CASES:
        assert report[case] == {"ok": True, "compiles": 1, "disk_hits": 0}, case
        # the bad entry was replaced by a good one: a regular file that the next process loads from disk
        path = CPUCompiler().cache_path(srcs[case][1])
        assert os.path.isfile(path) and not os.path.islink(path), case
        again = CPUCompiler()
        lib = again.compile_cached(srcs[case][1])
        assert again.disk_hits == 1 and again.compiles == 0 and elf_is_whole(lib, ET_DYN), case

@pytest.mark.slow
def test_truncated_program_cache_end_to_end(tmp_path):
    # every cached binary of a computation (its kernels and the C pool) truncated under a valid checksum: the next
    # process recomputes the right answer (it crashed with SIGBUS) and leaves whole binaries in the cache
    code = """
import numpy as np
from fusegrad import Tensor
x = np.arange(4096, dtype=np.float32).reshape(64, 64) / 7
got = ((Tensor(x) @ Tensor(x)).relu().sum(axis=1) * 0.5 + 2).numpy()
want = (np.maximum(x.astype(np.float64) @ x, 0).sum(axis=1) * 0.5 + 2)
np.testing.assert_allclose(got, want, rtol=1e-4)
print("ok")
"""
    cache = tmp_path / "e2e"
    first = run_child(code, XDG_CACHE_HOME=str(cache))
    assert first.returncode == 0 and first.stdout.strip() == "ok", first.stderr
    entries = [p for p in (cache / "fusegrad" / "compiled").rglob("*") if p.is_file()]
    assert entries
    for p in entries:
        lib = p.read_bytes()[len(Compiler.MAGIC) + 32:]
        p.write_bytes(wrapped(lib[:len(lib) // 3]))
    second = run_child(code, XDG_CACHE_HOME=str(cache))
    assert second.returncode == 0 and second.stdout.strip() == "ok", (second.returncode, second.stderr)
    for p in entries:
        assert elf_is_whole(p.read_bytes()[len(Compiler.MAGIC) + 32:], ET_DYN), p

def test_cache_read_refuses_what_is_not_a_regular_file(tmp_path):
    # in process, with a bound on the time: the read neither blocks on a FIFO nor follows a link to a device
    comp, src = CPUCompiler(), fill(3)
    lib = comp.compile_cached(src)
    path = comp.cache_path(src)
    for case in ("fifo", "symlink_dev_zero", "directory", "oversized"):
        if not os.path.lexists(path):
            with open(path, "wb") as f: f.write(wrapped(lib))
        make_hostile(path, case, lib)
        st = time.perf_counter()
        assert comp._read(path) is None, case
        assert time.perf_counter() - st < 5, case
        assert not os.path.lexists(path), case   # evicted

def test_elf_check_rejects_every_truncation():
    lib = CPUCompiler().compile(fill(4))
    assert elf_is_whole(lib, ET_DYN) and not elf_is_whole(lib, ET_REL)
    passing = [n for n in range(0, len(lib), 7) if elf_is_whole(lib[:n], ET_DYN)]
    assert passing == []
    # a header pointing past the end of the file
    bad = bytearray(lib)
    bad[40:48] = (len(lib) + 64).to_bytes(8, "little")   # e_shoff
    assert not elf_is_whole(bytes(bad), ET_DYN)

def test_llvm_cache_rejects_truncated_object():
    pytest.importorskip("llvmlite")
    from fusegrad.runtime.ops_llvm import LLVMCompiler
    src = f"; {uuid.uuid4().hex}\ndefine void @f(ptr %p) {{\n  store float 1.0, ptr %p\n  ret void\n}}\n"
    comp = LLVMCompiler()
    obj = comp.compile_cached(src)
    assert elf_is_whole(obj, ET_REL)
    with open(comp.cache_path(src), "wb") as f: f.write(wrapped(obj[:len(obj) // 2]))
    fresh = LLVMCompiler()
    assert fresh.compile_cached(src) == obj and fresh.compiles == 1 and fresh.disk_hits == 0
    again = LLVMCompiler()
    assert again.compile_cached(src) == obj and again.disk_hits == 1

def test_broken_compiler_output_is_an_error_and_not_cached(monkeypatch):
    # a compiler that writes half a shared object (a full disk, say): an error, nothing loaded, nothing cached
    comp, src = CPUCompiler(), fill(5)
    whole = CPUCompiler.compile
    monkeypatch.setattr(CPUCompiler, "compile", lambda self, s: whole(self, s)[:2000])
    with pytest.raises(CompileError, match="invalid binary"): comp.compile_cached(src)
    assert not os.path.lexists(comp.cache_path(src))

# *** leftovers of killed processes ***

def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid

def test_stale_temp_files_are_removed(tmp_path):
    tmp, cache = tmp_path / "tmp", tmp_path / "cache2"
    tmp.mkdir()
    dead, alive, old, ancient = dead_pid(), os.getpid(), time.time() - 3600, time.time() - 3 * 86400
    made = {}
    def mk(name: str, mtime: float, folder: bool = True, where=tmp):
        p = where / name
        if folder:
            p.mkdir()
            (p / "k.so").write_bytes(b"x")
        else: p.write_bytes(b"x")
        os.utime(p, (mtime, mtime))
        made[name] = p
    mk(f"fusegrad-cc-{dead}-abc", old)                        # a killed compile: removed
    mk(f"fusegrad-{dead}-7-xyz.so", old, folder=False)        # a killed program load: removed
    mk("fusegrad-cc-oldname1", ancient)                       # no pid in the name, days old: removed
    mk(f"fusegrad-cc-{alive}-def", old)                       # its process is alive: kept
    mk(f"fusegrad-cc-{dead}-new", time.time())                # dead, but just made (another pid namespace?): kept
    mk("unrelated-dir", ancient)                              # not ours: kept
    src = fill(6)
    path = CPUCompiler().cache_path(src).replace(str(tmp_path / "cache"), str(cache))
    os.makedirs(os.path.dirname(path))
    mk(f".tmp-{dead}-qq", old, folder=False, where=pathlib.Path(path).parent)   # a killed cache write
    mk(f".tmp-{alive}-rr", old, folder=False, where=pathlib.Path(path).parent)  # a live one's
    code = f"from fusegrad.runtime.cpu_compiler import CPUCompiler\nCPUCompiler().compile_cached({src!r})\nprint('ok')"
    r = run_child(code, TMPDIR=str(tmp), XDG_CACHE_HOME=str(cache))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    gone = {n for n, p in made.items() if not os.path.lexists(p)}
    assert gone == {f"fusegrad-cc-{dead}-abc", f"fusegrad-{dead}-7-xyz.so", "fusegrad-cc-oldname1", f".tmp-{dead}-qq"}
    assert os.path.isfile(path)
    # the compile left nothing of its own behind
    assert sorted(os.listdir(tmp)) == sorted(n for n in made if not n.startswith(".") and n not in gone)

def test_compile_folder_of_a_killed_process_is_removed_by_the_next(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    slow_cc = tmp_path / "slow_cc.sh"
    # (a compiler that takes a minute to compile, not to say its version)
    slow_cc.write_text('#!/bin/sh\ncase "$1" in --version) ;; *) sleep 60 ;; esac\nexec cc "$@"\n')
    slow_cc.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp), "CC": str(slow_cc)}
    code = f"from fusegrad.runtime.cpu_compiler import CPUCompiler\nCPUCompiler().compile_cached({fill(7)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not (left := [n for n in os.listdir(tmp) if n.startswith(f"fusegrad-cc-{child.pid}-")]):
            assert time.time() < deadline and child.poll() is None, "the compile never started"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)   # (the child and its compiler, as a kill -9 of the session)
        child.wait()
    assert os.path.isdir(tmp / left[0])
    old = time.time() - 3600
    os.utime(tmp / left[0], (old, old))
    r = run_child(f"from fusegrad.runtime.cpu_compiler import CPUCompiler\nCPUCompiler().compile_cached({fill(8)!r})",
                  TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(tmp / left[0])

# *** Ctrl-C while waiting for kernels ***

needs_queue = pytest.mark.skipif(host_cpu_count() < 2, reason="kernels are queued only with two cores or more")

# a kernel that runs `ms` milliseconds per chunk, then writes its element indices plus one
_SPIN = r"""
#include <time.h>
static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}
void spin(float* restrict out, long ms, long lo, long hi) {
  long end = now_ns() + ms * 1000000L;
  while (now_ns() < end) {}
  for (long i = lo; i < hi; i++) out[i] = (float)(i + 1);
}
void spin_entry(void **args, long lo, long hi) { spin((float*)args[0], *(long*)args[1], lo, hi); }
"""

_SIGINT_PRELUDE = f"""
import os, signal, threading, time
import numpy as np
from fusegrad.device import Buffer, Device
from fusegrad.dtype import dtypes
from fusegrad.runtime import cpu_pool, cpu_program
prg = cpu_program.CPUProgram("spin", Device["CPU"].compiler.compile_cached({_SPIN!r}))
pool = cpu_pool.c_pool()
assert pool is not None
def interrupt_after(s):
    sent = []
    def fire():
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(s, fire).start()
    return sent
"""

@needs_queue
def test_ctrl_c_stops_waiting_for_queued_kernels():
    code = _SIGINT_PRELUDE + """
bufs = [Buffer("CPU", 64, dtypes.float32).ensure_allocated() for _ in range(8)]
for b in bufs: prg(b._buf, vals=(200,), global_size=64)    # 8 queued kernels of 200 ms
sent = interrupt_after(0.25)
try:
    bufs[-1].numpy()
    raise SystemExit("the wait was not interrupted")
except KeyboardInterrupt:
    late = time.perf_counter() - sent[0]
    assert not pool.done(pool.submitted), "the kernels had all run: nothing was interrupted"
print(f"late {late:.3f}")
# the kernels ran on: every result is there and right
for b in bufs: assert (b.numpy() == np.arange(1, 65, dtype=np.float32)).all()
print("ok")
"""
    r = run_child(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr)
    late = float(r.stdout.split()[1])
    assert late < 1.0, late   # a slice (50 ms) after the chunk this thread ran (200 ms)

@needs_queue
def test_ctrl_c_while_the_caller_runs_a_chunk_keeps_the_job_tracked():
    # the calling thread runs a chunk of a joined kernel inside submit; the Ctrl-C is raised as the call returns,
    # before Python saw the job's count: the job's buffer must still be stamped (a read waits for it) and its
    # arguments held (no use after free)
    code = _SIGINT_PRELUDE + """
buf = Buffer("CPU", 64, dtypes.float32).ensure_allocated()
buf.copyin(memoryview(np.zeros(64, np.float32)))
sent = interrupt_after(0.15)
try:
    prg(buf._buf, vals=(500,), global_size=64, threads=2, join=True)
    raise SystemExit("not interrupted")
except KeyboardInterrupt: pass
# stamped with its job: else a read would not wait for the chunk the other thread runs
assert getattr(buf._buf, "_fg_job", 0) > 0, "the interrupted job was lost"
import gc; gc.collect()
assert (buf.numpy() == np.arange(1, 65, dtype=np.float32)).all(), buf.numpy()
print("ok")
"""
    r = run_child(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)

@needs_queue
def test_ctrl_c_during_a_long_chunk_comes_back_at_once():
    # a 3 s chunk the calling thread must not run (helpable=False: the workers' alone), queued behind a short job that
    # the calling thread helps with: Ctrl-C while it waits comes back within a wait slice, and the kernel runs on
    code = _SIGINT_PRELUDE + """
short, long_ = (Buffer("CPU", 64, dtypes.float32).ensure_allocated() for _ in range(2))
prg(short._buf, vals=(100,), global_size=64, threads=2)
prg(long_._buf, vals=(3000,), global_size=64, threads=1, helpable=False)
sent = interrupt_after(0.4)
try:
    long_.numpy()
    raise SystemExit("not interrupted")
except KeyboardInterrupt:
    late = time.perf_counter() - sent[0]
print(f"late {late:.3f}")
assert (long_.numpy() == np.arange(1, 65, dtype=np.float32)).all()
print("ok")
"""
    r = run_child(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stdout, r.stderr)
    assert float(r.stdout.split()[1]) < 0.5, r.stdout   # (a slice: 50 ms; the chunk would hold it 2.6 s more)

def test_kernels_with_long_chunks_are_left_to_the_workers():
    from fusegrad import Tensor
    from fusegrad.engine.realize import LONG_CHUNK_OPS, get_runner
    a, b = Tensor.empty(2048, 2048), Tensor.empty(2048, 2048)
    big = get_runner("CPU", (a @ b).schedule()[-1].ast)
    small = get_runner("CPU", (Tensor.empty(64) + 1).schedule()[-1].ast)
    launch = big._launch({})
    assert big.estimates.ops >= LONG_CHUNK_OPS * launch["threads"] and launch["helpable"] is False
    assert launch["join"] is False   # (the calling thread would run a long chunk)
    assert small._launch({})["helpable"] is True

@needs_queue
@pytest.mark.slow
def test_ctrl_c_stops_waiting_for_matmuls():
    # the user's view: a loop of big matmuls, Ctrl-C while .numpy() waits; control comes back, the process exits 0
    code = """
import os, signal, threading, time
import numpy as np
from fusegrad import Tensor
x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
a = Tensor(x).realize()
(a @ a).numpy()   # compiled
outs = [(a + i) @ a for i in range(16)]
Tensor.realize(*outs)
sent = []
threading.Timer(0.3, lambda: (sent.append(time.perf_counter()), os.kill(os.getpid(), signal.SIGINT))).start()
try:
    outs[-1].numpy()
    print("not interrupted")
except KeyboardInterrupt:
    print(f"late {time.perf_counter() - sent[0]:.3f}")
np.testing.assert_allclose(outs[3].numpy(), (x.astype(np.float64) + 3) @ x, rtol=1e-3, atol=1e-2)
"""
    r = run_child(code, timeout=120)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[0] == "late" and float(words[1]) < 2.0, r.stdout
