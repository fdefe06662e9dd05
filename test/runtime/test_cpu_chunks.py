"""A queued CPU kernel split across threads runs in CHUNKS_PER_THREAD chunks per thread, claimed by whichever thread
is free; a joined one (the caller helps from its start) in one chunk per thread; a matmul's outermost loop has that
many pieces per core; and a graph of such launches starts no more workers than there are extra cores. Each checked
against the chunks the pool's timeline recorded and the results against NumPy."""
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

def test_queued_split_kernel_runs_in_chunks_per_thread():
    x = _r(512, 512)
    a = Tensor(x).realize()
    outs = []
    def run() -> None:
        with Context(CPU_THREADS=2):
            for _ in range(4): outs.append((a * 3 + 1).sum(1).realize())   # 1 MB read: split, not joined
    jobs = _chunks_per_job(run)
    for o in outs: np.testing.assert_allclose(o.numpy(), (x.astype(np.float64) * 3 + 1).sum(1), rtol=1e-4)
    split = [sorted(c) for c in jobs.values() if len(c) > 1]
    assert split and all(c == list(range(2 * CHUNKS_PER_THREAD)) for c in split), jobs

def test_chunk_count_rule():
    assert cpu_program._chunks(1, 1000, False) == 1
    assert cpu_program._chunks(2, 1000, False) == 2 * CHUNKS_PER_THREAD
    assert cpu_program._chunks(2, 3, False) == 3          # at most one per iteration of the outermost loop
    assert cpu_program._chunks(2, 1000, True) == 2        # joined: the caller helps from the start

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
