"""A kernel the engine runs on one thread (too little work to wake a worker for) is split across the threads where it
runs in a queued launch graph of a TinyJit replay (PreparedLaunch.note_work): the split kernels compute what NumPy
computes on every call, kernels below the graph's threshold and every kernel under CPU_THREADS=1 stay whole."""
from typing import Any
import numpy as np
import pytest
from fusegrad import Context, Tensor, TinyJit
from fusegrad.engine.realize import THREAD_MIN_MEM, THREAD_MIN_OPS
from fusegrad.helpers import CPU_THREADS
from fusegrad.hostcpu import CHUNKS_PER_THREAD
from fusegrad.runtime import cpu_pool, cpu_program

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                                reason="no kernel queue without the C pool and 2 cores")

def _r(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

def _graph_rows(jit: TinyJit) -> list[tuple[Any, int, int, int]]:
    """(ExecItem, global size, threads the engine gives it, chunks in the graph) of each launch of the replay's one
    queued graph."""
    graphs = [step[0] for ei, step in jit._launches[0] if ei is None]
    assert len(graphs) == 1 and not graphs[0].inline
    (piece,) = graphs[0].pieces
    items = {id(ei.prg._prg): ei for ei in jit.captured}
    rows = []
    for k, program in enumerate(piece.held[0]):
        ei = items[id(program)]
        launch = ei.prg.launch_args(ei.fixedvars)[0]
        threads = max(1, min(launch["threads"], launch["global_size"], CPU_THREADS.value or launch["threads"]))
        rows.append((ei, piece.arrays[2][k], threads, piece.arrays[3][k]))
    return rows

def _model(w: Tensor):
    @TinyJit
    def f(x: Tensor, y: Tensor):
        a = (x * 2.0 + y).relu().contiguous()   # elementwise over 64x512: 256 KB read, below THREAD_MIN_MEM
        s = (a - 0.5).exp().sum(1)              # a reduction of rows
        t = (a.max(1) + s).contiguous()
        tiny = (t[:8] * 3.0).contiguous()       # 8 elements: below the graph's threshold too
        return s, t, tiny, (a[:16] @ w).relu()
    return f

def test_small_kernels_split_in_a_queued_graph_equal_numpy(monkeypatch):
    monkeypatch.setattr(cpu_program, "INLINE_MAX_OPS", 0)   # (a queued graph, not one run on the calling thread)
    monkeypatch.setattr(cpu_program, "INLINE_MAX_MEM", 0)
    w = _r(512, 16, seed=9)
    f = _model(Tensor(w).realize())
    for i in range(6):
        x, y = _r(64, 512, seed=2 * i), _r(64, 512, seed=2 * i + 1)
        s, t, tiny, m = f(Tensor(x), Tensor(y))
        a = np.maximum(x.astype(np.float64) * 2 + y, 0)
        ws = np.exp(a - 0.5).sum(1)
        wt = a.max(1) + ws
        np.testing.assert_allclose(s.numpy(), ws, rtol=1e-5)
        np.testing.assert_allclose(t.numpy(), wt, rtol=1e-5)
        np.testing.assert_allclose(tiny.numpy(), wt[:8] * 3, rtol=1e-5)
        np.testing.assert_allclose(m.numpy(), np.maximum(a[:16] @ w, 0), rtol=1e-4, atol=1e-4)
    rows = _graph_rows(f)
    names = [(ei.prg.p.name, size, threads, chunks) for ei, size, threads, chunks in rows]
    assert [r for r in rows if r[2] == 1 and r[3] > 1], names   # (the elementwise kernel: one thread, two chunks)
    assert [r for r in rows if r[3] == 1], names                # (the 8 elements stay whole)
    for ei, size, threads, chunks in rows:
        ops, mem = ei.prg._work(ei.fixedvars)
        # (a kernel split by the engine: a chunk per iteration of a parallel loop the optimizer cut into pieces, else
        # one per thread)
        if threads > 1: assert chunks == (size if size <= threads * CHUNKS_PER_THREAD else threads), names
        elif ops >= cpu_program.GRAPH_SPLIT_OPS or mem >= cpu_program.GRAPH_SPLIT_MEM:
            assert ops < THREAD_MIN_OPS and mem < THREAD_MIN_MEM and chunks == min(size, cpu_pool.cores()), names
        else: assert chunks == 1, names

def test_one_thread_knob_keeps_graph_kernels_whole(monkeypatch):
    # set after the capture too: the replay's plan is made again under the knob
    monkeypatch.setattr(cpu_program, "INLINE_MAX_OPS", 0)
    monkeypatch.setattr(cpu_program, "INLINE_MAX_MEM", 0)
    w = _r(512, 16, seed=3)
    f = _model(Tensor(w).realize())
    def check(i: int) -> None:
        x, y = _r(64, 512, seed=i), _r(64, 512, seed=i + 10)
        s = f(Tensor(x), Tensor(y))[0]
        np.testing.assert_allclose(s.numpy(), np.exp(np.maximum(x.astype(np.float64) * 2 + y, 0) - 0.5).sum(1),
                                   rtol=1e-5)
    for i in range(3): check(i)
    assert any(chunks > 1 for _, _, threads, chunks in _graph_rows(f) if threads == 1)
    with Context(CPU_THREADS=1):
        for i in range(3, 6): check(i)
        assert all(chunks == 1 for _, _, _, chunks in _graph_rows(f))

def test_eager_replays_split_small_kernels_and_equal_numpy(monkeypatch):
    """An eager step's later replays queue their kernels through launch graphs too (engine/realize.py's
    _launch_graphs): each launch there is given its work, and the small kernels split across threads still compute
    what NumPy computes."""
    monkeypatch.setattr(cpu_program, "INLINE_MAX_OPS", 0)
    monkeypatch.setattr(cpu_program, "INLINE_MAX_MEM", 0)
    noted: list[tuple[int, int]] = []
    original = cpu_program.PreparedLaunch.note_work
    def note_work(self, work):
        noted.append(work)
        original(self, work)
    monkeypatch.setattr(cpu_program.PreparedLaunch, "note_work", note_work)
    w = Tensor(_r(512, 16, seed=9)).realize()
    for i in range(8):
        x, y = _r(64, 512, seed=2 * i), _r(64, 512, seed=2 * i + 1)
        tx, ty = Tensor(x), Tensor(y)
        a = (tx * 2.0 + ty).relu().contiguous()
        s = (a - 0.5).exp().sum(1)
        m = (a[:16] @ w).relu()
        s.realize(), m.realize()
        wa = np.maximum(x.astype(np.float64) * 2 + y, 0)
        np.testing.assert_allclose(s.numpy(), np.exp(wa - 0.5).sum(1), rtol=1e-5)
        np.testing.assert_allclose(m.numpy(), np.maximum(wa[:16] @ w.numpy(), 0), rtol=1e-4, atol=1e-4)
    assert any(ops >= THREAD_MIN_OPS // 8 or mem >= THREAD_MIN_MEM // 8 for ops, mem in noted), noted
