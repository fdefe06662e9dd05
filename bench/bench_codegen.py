"""Benchmark of generated kernels against numpy (not a test): `PYTHONPATH=. python bench/bench_codegen.py` (it builds
its kernels with test/codegen/helpers.py).

Runs each kernel split across THREADS=2 threads (as the CPU runtime does), best of many runs. Each side is timed in
its own stretch: OpenBLAS threads spin for a while after a call and would steal the cores from a kernel run right
after it."""
import ctypes
import os
import sys
import threading
import time
import numpy as np
from fusegrad.codegen import get_program
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import UOp
from test.codegen.helpers import RENDERER, compile_program, glob, matmul_ast, reduce, rng

THREADS = int(os.getenv("THREADS", "2"))

def runner(ast, bufs):
    p = get_program(ast, RENDERER)
    fn = compile_program(p)
    args = [ctypes.c_void_p(bufs[i].ctypes.data) for i in p.globals]
    gs = p.global_size
    bounds = [(gs * t // THREADS, gs * (t + 1) // THREADS) for t in range(THREADS)] if gs >= THREADS else [(0, gs)]
    def go():
        ts = [threading.Thread(target=fn, args=(*args, lo, hi)) for lo, hi in bounds]
        for t in ts: t.start()
        for t in ts: t.join()
    return p, go

def best(fns, reps=15):
    times = [float("inf")] * len(fns)
    for i, f in enumerate(fns):
        time.sleep(0.2)
        for _ in range(reps):
            t = time.perf_counter(); f(); times[i] = min(times[i], time.perf_counter() - t)
    return times

def main():
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    a, b, c = (np.random.rand(N, N).astype(np.float32) for _ in range(3))
    p, go = runner(matmul_ast(N, N, N), [c, a, b])
    go()
    assert np.allclose(c, a @ b, rtol=1e-3, atol=1e-3)
    t, tn = best([go, lambda: a @ b])
    print(f"matmul {N}: {p.name} {2*N**3/t/1e9:.1f} GFLOPS, numpy {2*N**3/tn/1e9:.1f} GFLOPS, ratio {tn/t:.2f}")
    M = K = 4096
    x, y, z = (np.random.rand(M, K).astype(np.float32) for _ in range(3))
    r0, r1 = rng(M, 0), rng(K, 1)
    idx = r0 * K + r1
    add = UOp.sink_of(glob(0, dtypes.float32, M * K).index(idx).store(glob(1, dtypes.float32, M * K).index(idx).load() +
                                                                      glob(2, dtypes.float32, M * K).index(idx).load()))
    _, go = runner(add, [z, x, y])
    t, tn = best([go, lambda: np.add(x, y, out=z)], 7)
    print(f"add {M}x{K}: {3*M*K*4/t/1e9:.1f} GB/s, numpy (1 thread) {3*M*K*4/tn/1e9:.1f} GB/s")
    for axis in (1, 0):
        out = np.zeros(M, np.float32)
        ro, rr = rng(M, 0), rng(K, 1, "reduce")
        ld = glob(1, dtypes.float32, M * K).index(ro * K + rr if axis == 1 else rr * K + ro).load()
        p, go = runner(UOp.sink_of(glob(0, dtypes.float32, M).index(ro).store(reduce(ld, rr))), [out, x])
        go()
        assert np.allclose(out, x.sum(axis), rtol=1e-3)
        t, tn = best([go, lambda: x.sum(axis)], 7)
        print(f"sum axis={axis} {p.name}: {M*K*4/t/1e9:.1f} GB/s, numpy {M*K*4/tn/1e9:.1f} GB/s")



def bench_matmul_bt(N: int = 1024):
    a, b, c = (np.random.rand(N, N).astype(np.float32) for _ in range(3))
    r0, r1, r2 = rng(N, 0), rng(N, 1), rng(N, 2, "reduce")
    acc = reduce(glob(1, dtypes.float32, N * N).index(r0 * N + r2).load() * glob(2, dtypes.float32, N * N).index(
        r1 * N + r2).load(), r2)
    p, go = runner(UOp.sink_of(glob(0, dtypes.float32, N * N).index(r0 * N + r1).store(acc)), [c, a, b])
    go()
    assert np.allclose(c, a @ b.T, rtol=1e-3, atol=1e-3)
    t, tn = best([go, lambda: a @ b.T])
    print(f"matmul a@b.T {N}: {p.name} {2*N**3/t/1e9:.1f} GFLOPS, numpy {2*N**3/tn/1e9:.1f} GFLOPS, ratio {tn/t:.2f}")

if __name__ == "__main__":
    main()
    bench_matmul_bt()
