"""A tiled matmul's outermost loop is cut into CHUNKS_PER_THREAD pieces per core, and a queued kernel whose parallel
loop is such pieces runs a chunk per piece, claimed by whichever thread is free; a kernel with a long parallel loop or
a joined one (the caller helps from its start) runs in one chunk per thread; a graph of such launches starts no more
workers than there are extra cores. Checked against the chunks the pool's timeline recorded, results against NumPy."""
import numpy as np
import pytest
from fusegrad import Context, Tensor, TinyJit
from fusegrad.engine.realize import JOIN_MIN_OPS
from fusegrad.hostcpu import CHUNKS_PER_THREAD
from fusegrad.runtime import cpu_pool, cpu_program

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                                reason="no kernel queue without the C pool and 2 cores")

def _r(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

def _chunks_per_job(fn) -> dict[int, list[int]]:
    """job -> the chunks of it that ran while fn ran (each chunk's index, in the order recorded)."""
    jobs: dict[int, list[int]] = {}
    for job, chunk, *_ in cpu_pool.c_pool().timeline(fn): jobs.setdefault(job, []).append(chunk)
    return jobs

def test_matmul_pieces_run_as_chunks_and_rows_as_one_chunk_per_thread():
    x, w, e = _r(128, 784, seed=1), _r(512, 784, seed=2), _r(512, 512, seed=3)
    a, b, c = Tensor(x).realize(), Tensor(w).realize(), Tensor(e).realize()
    outs = []
    def run() -> None:
        with Context(CPU_THREADS=2):
            for _ in range(3):
                outs.append((a @ b.T).realize())               # 103M ops: split, not joined; its loop cut in pieces
                outs.append((c * 3 + 1).sum(1).realize())      # 1 MB read: split over its 512 rows
    jobs = _chunks_per_job(run)
    for k, o in enumerate(outs):
        want = x.astype(np.float64) @ w.T if k % 2 == 0 else (e.astype(np.float64) * 3 + 1).sum(1)
        np.testing.assert_allclose(o.numpy(), want, rtol=1e-4, atol=1e-3)
    counts = sorted(len(c) for c in jobs.values() if len(c) > 1)
    # (the rows: one chunk per thread; the matmul: a chunk per piece, more than the threads and at most
    # CHUNKS_PER_THREAD each: 2 * CHUNKS_PER_THREAD on a 2-core machine, as many as the heuristic's cores allow else)
    assert counts[:3] == [2, 2, 2] and len(set(counts[3:])) == 1 and len(counts) == 6, jobs
    assert 2 < counts[3] <= 2 * CHUNKS_PER_THREAD, jobs
    assert all(sorted(c) == list(range(len(c))) for c in jobs.values())   # each chunk once

def test_chunk_count_rule():
    assert cpu_program._chunks(1, 8, False) == 1
    assert cpu_program._chunks(2, 2 * CHUNKS_PER_THREAD, False) == 2 * CHUNKS_PER_THREAD   # pieces: a chunk each
    assert cpu_program._chunks(2, 3, False) == 3
    assert cpu_program._chunks(2, 512, False) == 2        # a long parallel loop: one chunk per thread
    assert cpu_program._chunks(2, 8, True) == 2           # joined: the caller helps from the start

def test_joined_kernel_keeps_one_chunk_per_thread():
    n = 512   # 2 * 512^3 ops: at the join threshold
    assert 2 * n ** 3 >= JOIN_MIN_OPS
    x, w = _r(n, n, seed=1), _r(n, n, seed=2)
    a, b = Tensor(x).realize(), Tensor(w).realize()
    out = []
    def run() -> None:
        with Context(CPU_THREADS=2): out.append((a @ b).realize())
    cpu_pool.c_pool().wait()   # (nothing queued ahead: the call is joined)
    jobs = _chunks_per_job(run)
    np.testing.assert_allclose(out[0].numpy(), x.astype(np.float64) @ w, rtol=1e-3, atol=1e-3)
    assert [sorted(c) for c in jobs.values() if len(c) > 1] == [[0, 1]], jobs

def test_matmul_outer_loop_has_pieces_per_core_and_graph_workers_per_core():
    x, w1, w2 = _r(128, 784, seed=3), _r(512, 784, seed=4), _r(512, 256, seed=5)
    t1, t2 = Tensor(w1).realize(), Tensor(w2).realize()
    @TinyJit
    def f(inp: Tensor) -> Tensor: return (inp @ t1.T).relu().contiguous() @ t2   # two matmul kernels: a graph
    with Context(CPU_THREADS=2):
        for i in range(3):
            xi = x + i
            want = np.maximum(xi.astype(np.float64) @ w1.T, 0) @ w2
            np.testing.assert_allclose(f(Tensor(xi)).numpy(), want, rtol=1e-4, atol=1e-2)
    mm = [ei for ei in f.captured if ei.prg.p.name.startswith("r_")]
    assert len(mm) == 2 and all(ei.prg.p.global_size > cpu_pool.cores() for ei in mm), [ei.prg.p.name for ei in mm]
    graphs = [step[0] for ei, step in f._launches[0] if ei is None]
    assert graphs
    for g in graphs:
        # the chunks of every launch, but no more workers than the threads a kernel is split across (one fewer: the
        # waiting caller runs chunks too)
        assert all(p.workers <= max(1, min(2, cpu_pool.cores()) - 1) for p in g.pieces), [p.workers for p in g.pieces]
