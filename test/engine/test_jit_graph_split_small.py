"""Kernels of little work (from GRAPH_SPLIT_OPS ops, 1 << 14: a small pool or row sum after a split convolution) are
split across the threads of a queued launch graph: what they compute equals NumPy's for global sizes the thread count
doesn't divide, on as many threads as the cores (2), on more threads than cores (7), and whole under CPU_THREADS=1."""
from __future__ import annotations

import numpy as np
import pytest

from fusegrad import Context, Tensor, TinyJit
from fusegrad.runtime import cpu_pool, cpu_program

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                                reason="no kernel queue without the C pool and 2 cores")


def _step():
    @TinyJit
    def f(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        h = (x @ w).relu().contiguous()            # a matmul: split by the engine
        return (h * 2.0 + 1.0).sum(1), h.max(1)   # row sums of h: kernels of little work
    return f


@pytest.mark.parametrize("rows,threads", [(33, 0), (47, 0), (33, 1), (45, 7)])
def test_small_kernels_split_in_a_graph_equal_numpy(monkeypatch, rows: int, threads: int):
    monkeypatch.setattr(cpu_program, "INLINE_MAX_OPS", 0)   # (a queued graph, not one run on the calling thread)
    monkeypatch.setattr(cpu_program, "INLINE_MAX_MEM", 0)
    if threads > 2: monkeypatch.setattr(cpu_program, "cores", lambda: threads)   # (more chunks than cores)
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    f, wt = _step(), Tensor(w).realize()
    with Context(CPU_THREADS=1 if threads == 1 else 0):
        for i in range(5):
            x = rng.standard_normal((rows, 96)).astype(np.float32)
            s, m = f(Tensor(x), wt)
            h = np.maximum(x.astype(np.float64) @ w, 0)
            np.testing.assert_allclose(s.numpy(), (h * 2 + 1).sum(1), rtol=1e-4, atol=1e-3)
            np.testing.assert_allclose(m.numpy(), h.max(1), rtol=1e-5, atol=1e-5)
    graphs = [step[0] for ei, step in f._launches[0] if ei is None]
    assert len(graphs) == 1 and not graphs[0].inline
    (piece,) = graphs[0].pieces
    items = {id(ei.prg._prg): ei for ei in f.captured}
    split = 0
    for k, program in enumerate(piece.held[0]):
        ei = items[id(program)]
        ops, mem = ei.prg._work(ei.fixedvars)
        size, chunks = piece.arrays[2][k], piece.arrays[3][k]
        if ei.prg.threads(ei.fixedvars) > 1: continue   # (the engine's own split)
        if threads == 1: assert chunks == 1
        elif ops >= cpu_program.GRAPH_SPLIT_OPS or mem >= cpu_program.GRAPH_SPLIT_MEM:
            assert chunks == min(size, threads or cpu_pool.cores())
            split += 1
        else: assert chunks == 1
    if threads != 1: assert split >= 1   # (a kernel of little work was split)
