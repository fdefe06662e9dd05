"""Core benchmark: fusegrad against NumPy and PyTorch (CPU, 2 threads) in one process.

Workloads: 1024x1024 float32 matmul (GFLOPS), the fused elementwise ((x*y+z).relu()*0.5) on 2^24 floats (GB/s,
4 arrays x 4 bytes per element), row sums of a 4096x4096 float32 matrix (GB/s), the cost of scheduling a 200-op
elementwise graph (ms, cold and cached), a loop whose graph changes only by a Python number against the same loop
with a fixed number (ms per iteration, RSS), and the first run of a 200-op graph in a fresh process with an empty
program cache, for each compile path (C through the system compiler, LLVM through llvmlite).

The memory-bound workloads also get a "C" column: the figure to beat, a plain hand-written C loop (bench/ref_kernels.c,
built at start with the system C compiler at -O3 -march=native and called through ctypes) split across 2 pthreads
over the same numpy arrays, writing into an output allocated once. A one-line "machine bandwidth" figure (a 256 MB
copy by the same kind of loop, read+write bytes counted) says how close any of this is to the memory system's limit.
Without a C compiler the column is skipped with a note.

For fusegrad every timed run realizes a fresh lazy expression over inputs realized beforehand, so the time includes
building and scheduling the graph (as a user pays it) but not creating the inputs. Each measurement warms up once
(kernel compiles happen there), then repeats while it stays inside a small time budget and reports the best run (the
median is shown too). A failing fusegrad part prints its error and the rest still runs.

Run: .venv/bin/python bench/bench_core.py  [--quick]
"""
from __future__ import annotations
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable
import numpy as np
import torch

from torch_cpu import setup as torch_setup  # noqa: E402  (bench/ is the script's folder)

torch_setup()

from fusegrad import Device, GlobalCounters, Tensor  # noqa: E402  (torch threads are set first)

QUICK = "--quick" in sys.argv
BUDGET_S = 1.0 if QUICK else 3.0   # per (workload, framework) after warm-up
MAX_REPS = 3 if QUICK else 7
C_THREADS = 2                      # threads of the hand-written C reference (the CPU count the project targets)
C_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]

def bench(fn: Callable[[], object], budget_s: float = BUDGET_S, max_reps: int = MAX_REPS) -> tuple[float, float]:
    """(best, median) wall time in seconds of fn() after one warm-up call; stops early when over the budget."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        Device[Device.DEFAULT].synchronize()  # (fusegrad's CPU kernels run asynchronously: wait for them)
        times.append(time.perf_counter() - t0)
        if times[-1] > budget_s: break  # a very slow implementation gets one timed run
    return min(times), statistics.median(times)

def load_c_reference() -> tuple[ctypes.CDLL | None, str]:
    """The hand-written C kernels (bench/ref_kernels.c) compiled and loaded, or None and the reason they aren't."""
    try:
        from fusegrad.device import find_cc   # the same compiler discovery as fusegrad: $CC, cc, gcc, clang
        cc = find_cc()
    except Exception as e:
        return None, f"no C compiler ({type(e).__name__}: {e})"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref_kernels.c")
    with tempfile.TemporaryDirectory(prefix="bench-core-") as d:
        so = os.path.join(d, "ref_kernels.so")
        try:
            res = subprocess.run([*cc, *C_FLAGS, src, "-o", so], capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                return None, f"compiling {src} failed (exit {res.returncode}): {res.stderr.strip()[:300]}"
            lib = ctypes.CDLL(so)   # the loaded object stays mapped after its file is removed
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"can't build {src}: {type(e).__name__}: {e}"
    fp, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    for name, args in (("ref_elementwise", [fp, fp, fp, fp, i64, i32]), ("ref_rowsum", [fp, fp, i64, i64, i32]),
                       ("ref_copy", [fp, fp, i64, i32])):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    return lib, ""

def ptr(a: np.ndarray) -> int:
    """The data address of a C-contiguous float32 array, for the C reference."""
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return a.ctypes.data

class Row:
    """One workload: best/median seconds per framework and how to turn seconds into a throughput."""
    def __init__(self, name: str, unit: str, work: float):
        self.name, self.unit, self.work = name, unit, work   # work: FLOPs or bytes per run
        self.t: dict[str, tuple[float, float] | None] = {}
        self.note = ""

    def run(self, framework: str, fn: Callable[[], object]) -> None:
        try:
            self.t[framework] = bench(fn)
            if framework == "fusegrad":  # a timed run that ran no kernel measured a cache, not the computation
                k0 = GlobalCounters.kernel_count
                fn()
                if GlobalCounters.kernel_count == k0: self.note += " fusegrad ran no kernel per run: timing is invalid!"
        except Exception as e:  # keep going: one broken part must not hide the other numbers
            self.t[framework] = None
            self.note += f" {framework} failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            if "-v" in sys.argv: traceback.print_exc()

    def throughput(self, framework: str) -> str:
        t = self.t.get(framework)
        if t is None: return "n/a"
        return f"{self.work / t[0] / 1e9:8.1f}"

def check(name: str, got: np.ndarray, exp: np.ndarray, rtol: float = 1e-4, atol: float = 1e-4) -> str:
    """An empty string when fusegrad's answer matches the reference, else a warning for the table."""
    try:
        np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol)
        return ""
    except AssertionError:
        return f" WRONG RESULT in {name}!"

def fmt_ms(t: tuple[float, float] | None) -> str:
    return "       n/a        " if t is None else f"{t[0] * 1e3:8.2f} ({t[1] * 1e3:7.2f})"

def ratio(rows: Row, ref: str) -> str:
    if ref not in rows.t: return "     -"   # no such reference for this workload
    a, b = rows.t.get("fusegrad"), rows.t.get(ref)
    return "  n/a" if a is None or b is None else f"{a[0] / b[0]:6.2f}x"

def bench_matmul(n: int = 1024) -> Row:
    row = Row(f"matmul {n}x{n} f32", "GFLOPS", 2.0 * n ** 3)
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a_t, b_t = torch.from_numpy(a_np), torch.from_numpy(b_np)
    row.run("numpy", lambda: a_np @ b_np)
    row.run("torch", lambda: a_t @ b_t)
    try:
        a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
        row.run("fusegrad", lambda: (a @ b).realize())
        if row.t.get("fusegrad") is not None:
            row.note += check("matmul", (a @ b).numpy(), a_np @ b_np, rtol=1e-3, atol=1e-3)
    except Exception as e:
        row.note += f" fusegrad setup failed: {type(e).__name__}: {e}"
    return row

def bench_elementwise(clib: ctypes.CDLL | None, n: int = 1 << 24) -> Row:
    row = Row("((x*y+z).relu()*0.5) 2^24", "GB/s", 4.0 * 4 * n)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    x_np, y_np, z_np = xs
    x_t, y_t, z_t = (torch.from_numpy(v) for v in xs)
    row.run("numpy", lambda: np.maximum(x_np * y_np + z_np, 0) * np.float32(0.5))
    row.run("torch", lambda: ((x_t * y_t + z_t).relu() * 0.5))
    if clib is not None:
        out_c = np.empty(n, dtype=np.float32)
        row.run("C", lambda: clib.ref_elementwise(ptr(x_np), ptr(y_np), ptr(z_np), ptr(out_c), n, C_THREADS))
        if row.t.get("C") is not None:
            row.note += check("C elementwise", out_c, np.maximum(x_np * y_np + z_np, 0) * np.float32(0.5))
    try:
        x, y, z = (Tensor(v).realize() for v in xs)
        row.run("fusegrad", lambda: ((x * y + z).relu() * 0.5).realize())
        if row.t.get("fusegrad") is not None:
            ref = np.maximum(x_np * y_np + z_np, 0) * 0.5
            row.note += check("elementwise", ((x * y + z).relu() * 0.5).numpy(), ref)
    except Exception as e:
        row.note += f" fusegrad setup failed: {type(e).__name__}: {e}"
    return row

def bench_rowsum(clib: ctypes.CDLL | None, n: int = 4096) -> Row:
    row = Row(f"row sums {n}x{n} f32", "GB/s", 4.0 * n * n)
    m_np = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    m_t = torch.from_numpy(m_np)
    row.run("numpy", lambda: m_np.sum(axis=1))
    row.run("torch", lambda: m_t.sum(dim=1))
    if clib is not None:
        out_c = np.empty(n, dtype=np.float32)
        row.run("C", lambda: clib.ref_rowsum(ptr(m_np), ptr(out_c), n, n, C_THREADS))
        if row.t.get("C") is not None:
            row.note += check("C row sums", out_c, m_np.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-3)
    try:
        m = Tensor(m_np).realize()
        row.run("fusegrad", lambda: m.sum(axis=1).realize())
        if row.t.get("fusegrad") is not None:
            ref = m_np.astype(np.float64).sum(axis=1)
            row.note += check("row sums", m.sum(axis=1).numpy(), ref, rtol=1e-4, atol=1e-3)
    except Exception as e:
        row.note += f" fusegrad setup failed: {type(e).__name__}: {e}"
    return row

def bench_copy(clib: ctypes.CDLL, nbytes: int = 256 << 20) -> str:
    """The machine bandwidth line: the hand-written C copy of an nbytes buffer on C_THREADS threads."""
    n = nbytes // 4
    src = np.arange(n, dtype=np.float32)
    dst = np.empty_like(src)   # its pages are first touched by the warm-up run, outside the timing
    best, med = bench(lambda: clib.ref_copy(ptr(src), ptr(dst), n, C_THREADS))
    ok = "" if np.array_equal(src, dst) else "  WRONG RESULT in C copy!"
    return (f"machine bandwidth: C copy of {nbytes >> 20} MB on {C_THREADS} threads {2 * nbytes / best / 1e9:.1f} GB/s "
            f"(read+write; best {best * 1e3:.2f} ms, median {med * 1e3:.2f} ms){ok}")

def build_graph(x: Tensor, k: float, n_ops: int = 200) -> Tensor:
    """An elementwise chain of n_ops ALU ops with constants depending on `k`."""
    out = x
    for i in range(n_ops // 2):
        out = out * (1.0 + k * 1e-3 + i * 1e-6) + 0.5 if i % 2 else (out - 0.25).maximum(-1.0 - k)
    return out

def bench_schedule(reps: int = 3 if QUICK else 5) -> tuple[list[float], list[float], int | None, str]:
    """ms to schedule a new 200-op graph (cold) and the same graph rebuilt (cached); also the kernel count. Graphs
    that differ only in constants share a cache entry, so each cold graph is over an input of another size."""
    cold, cached, nkernels, note = [], [], None, ""
    try:
        Tensor(np.arange(1000, dtype=np.float32)).realize()
        build_graph(Tensor(np.arange(1000, dtype=np.float32)).realize(), -1.0).schedule()  # warm the code paths
        for k in range(reps):
            x = Tensor(np.arange(1024 + k, dtype=np.float32)).realize()
            g1 = build_graph(x, float(k))
            t0 = time.perf_counter()
            sched = g1.schedule()
            cold.append((time.perf_counter() - t0) * 1e3)
            nkernels = len(sched)
            g2 = build_graph(x, float(k))   # the same graph again: a schedule-cache hit
            t0 = time.perf_counter()
            g2.schedule()
            cached.append((time.perf_counter() - t0) * 1e3)
    except Exception as e:
        note = f" fusegrad failed: {type(e).__name__}: {e}"
        if "-v" in sys.argv: traceback.print_exc()
    return cold, cached, nkernels, note

def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))

def bench_changing_constant(iters: tuple[int, ...] = (1000, 5000)) -> list[str]:
    """A training-loop-shaped graph whose only change per step is a Python number, against the same loop with a fixed
    number: ms per iteration and RSS after each count of iterations."""
    out = []
    x = Tensor(np.ones((256, 256), np.float32)).realize()
    for label, const in (("fixed constant", lambda i: 3), ("changing constant", lambda i: i)):
        for i in range(20): ((x * 1.5 + 1).relu().sum(1) + const(i)).realize()   # compile and warm up
        rss, done, t0 = [], 0, time.perf_counter()
        for n in iters:
            for i in range(done, n): ((x * 1.5 + 1).relu().sum(1) + const(i)).realize()
            Device[x.device].synchronize()
            done = n
            rss.append(f"RSS after {n}: {rss_mb():.1f} MB")
        ms = (time.perf_counter() - t0) * 1e3 / iters[-1]
        out.append(f"{label:18s} {ms:7.3f} ms/iter   " + "   ".join(rss))
    return out

G200_PROGRAM = """
import time
t0 = time.perf_counter()
from fusegrad import Device, Tensor, GlobalCounters
t1 = time.perf_counter()
x = Tensor.ones(77, 77).contiguous().realize()
for i in range(200): x = (x*1.01+0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(77, 77)*0.001 + x
x.realize()
Device[x.device].synchronize()
t2 = time.perf_counter()
print(f"{(t2 - t1) * 1e3:.0f} {(t1 - t0) * 1e3:.0f} {GlobalCounters.kernel_count}")
"""

def bench_first_run(devices: tuple[str, ...] = ("CPU", "LLVM")) -> list[str]:
    """The 200-op graph of elementwise ops and row reductions broadcast back, run once in a fresh process with an empty
    program cache (cold), then again with the cache that run left (warm), for each compile path."""
    out = []
    for dev in devices:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "XDG_CACHE_HOME": cache, "DEV": dev}
            runs = []
            for _ in ("cold", "warm"):
                t0 = time.perf_counter()
                res = subprocess.run([sys.executable, "-c", G200_PROGRAM], env=env, capture_output=True, text=True)
                wall = (time.perf_counter() - t0) * 1e3
                if res.returncode != 0:
                    runs.append(f"failed: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else '?'}")
                    break
                run_ms, import_ms, kernels = res.stdout.split()
                runs.append(f"{run_ms} ms ({kernels} kernels; process {wall:.0f} ms, import {import_ms} ms)")
            out.append(f"200-op graph first run, DEV={dev:5s}: cold " + "; warm ".join(runs))
    return out

def main() -> None:
    t_start = time.perf_counter()
    print(f"bench_core: numpy {np.__version__} torch {torch.__version__} (threads={torch.get_num_threads()})"
          f"{' [quick]' if QUICK else ''}")
    print("times: best (median) ms over the timed runs after one warm-up; ratio = fusegrad time / reference time\n")
    clib, c_note = load_c_reference()
    rows = [bench_matmul(), bench_elementwise(clib), bench_rowsum(clib)]
    hdr = (f"{'workload':28s} {'unit':>6s} | {'fusegrad ms':>18s} {'numpy ms':>18s} {'torch ms':>18s} "
           f"{'C (hand) ms':>18s} | {'fg':>8s} {'np':>8s} {'torch':>8s} {'C':>8s} | "
           f"{'fg/np':>7s} {'fg/torch':>8s} {'fg/C':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        c_ms = fmt_ms(r.t["C"]) if "C" in r.t else f"{'-':>18s}"
        c_tp = r.throughput("C") if "C" in r.t else "-"
        print(f"{r.name:28s} {r.unit:>6s} | {fmt_ms(r.t.get('fusegrad'))} {fmt_ms(r.t.get('numpy'))} "
              f"{fmt_ms(r.t.get('torch'))} {c_ms} | {r.throughput('fusegrad'):>8s} {r.throughput('numpy'):>8s} "
              f"{r.throughput('torch'):>8s} {c_tp:>8s} | {ratio(r, 'numpy'):>7s} {ratio(r, 'torch'):>8s} "
              f"{ratio(r, 'C'):>7s}")
    print()
    if clib is not None:
        try: print(bench_copy(clib))
        except Exception as e: print(f"machine bandwidth: n/a ({type(e).__name__}: {e})")
    else: print(f"machine bandwidth: n/a; C (hand) column skipped: {c_note}")
    cold, cached, nk, note = bench_schedule()
    if cold:
        print(f"schedule 200-op elementwise graph: cold {min(cold):.2f} ms (median {statistics.median(cold):.2f}), "
              f"cached {min(cached):.2f} ms (median {statistics.median(cached):.2f}), "
              f"cold/cached {min(cold) / max(min(cached), 1e-9):.1f}x, {nk} kernel(s)")
    else:
        print("schedule 200-op elementwise graph: n/a")
    for line in bench_changing_constant((200, 1000) if QUICK else (1000, 5000)): print(line)
    for line in bench_first_run(): print(line)
    for r in rows:
        if r.note: print(f"note [{r.name}]:{r.note}")
    if note: print(f"note [schedule]:{note}")
    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s")

if __name__ == "__main__":
    main()
