"""Kernels split across threads by the C thread pool compute what one thread computes, dispatch after dispatch, with
the workers awake or asleep, with Variables passed by pointer, and in a forked child (forked with a kernel queued)."""
import multiprocessing
import time
import numpy as np
import pytest
from fusegrad import Context, Tensor, Variable
from fusegrad.runtime import cpu_compiler, cpu_pool

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None, reason="the C thread pool could not be compiled here")

def _programs(t: Tensor) -> list:
    from fusegrad.engine.realize import lower_schedule_item
    return [lower_schedule_item(si) for si in t.schedule()]

def test_entry_points_exist():
    a = Tensor.rand(256, 256).realize()
    (ei,) = _programs(a.sum(1))
    assert ei.prg._prg._entry is not None

@pytest.mark.parametrize("threads", [2, 3, 7])
def test_split_equals_one_thread(threads):
    rng = np.random.default_rng(threads)
    x, w = rng.standard_normal((300, 200)).astype(np.float32), rng.standard_normal((200, 130)).astype(np.float32)
    cases = [lambda a, b: (a @ b).relu(), lambda a, b: a.exp().sum(1), lambda a, b: (a * 2 + 1).softmax(1)]
    for f in cases:
        with Context(CPU_THREADS=1): one = f(Tensor(x), Tensor(w)).numpy()
        with Context(CPU_THREADS=threads):
            for _ in range(20):  # back to back: the workers are still spinning
                np.testing.assert_array_equal(f(Tensor(x), Tensor(w)).numpy(), one)

def test_after_workers_fell_asleep():
    a = Tensor.rand(512, 512).realize()
    want = a.numpy().sum(1)
    for _ in range(5):
        time.sleep(0.01)  # long past the spinning: the workers wait on the condition variable
        np.testing.assert_allclose(a.sum(1).numpy(), want, rtol=1e-5)

def test_variables_by_pointer():
    n = Variable("n", 1, 4096)
    a = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    t = Tensor(a).realize()
    for v in (4096, 1000, 17):
        out = (t[:n.bind(v)] * 3.0 + v).numpy()
        np.testing.assert_allclose(out, a[:v] * 3.0 + v, rtol=1e-6)

def _child(q):
    import faulthandler
    faulthandler.dump_traceback_later(20, exit=True)
    a = Tensor.ones(1024, 1024).contiguous().realize()
    q.put(float(a.sum().item()))

def test_forked_child_runs_threaded_kernels():
    # the parent's workers exist and a product is queued when it forks: the queue drains first, so the child starts
    # with no half-run job, and both the child's kernels and the parent's product give the right values
    a = np.random.default_rng(5).standard_normal((1536, 1536), dtype=np.float32)
    t = Tensor(a).realize()
    out = (t @ t).realize()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        pytest.fail("a threaded kernel in a forked child hung")
    assert p.exitcode == 0 and q.get(timeout=5) == 1024 * 1024
    np.testing.assert_allclose(out.numpy()[:64], a[:64].astype(np.float64) @ a, rtol=1e-3, atol=1e-2)

_MARK_SRC = r"""
void fg_test_mark(void **args, long lo, long hi) {
  int *hits = (int *)args[0];
  for (long i = lo; i < hi; i++) __atomic_fetch_add(&hits[i], 1, __ATOMIC_RELAXED);
}
"""

def test_every_chunk_runs_once_whoever_claims_it():
    # the calling thread claims the chunks no worker took in time: each element of every job is still visited once,
    # with the workers spinning, asleep, or held up by another pool's spinning threads (numpy's BLAS)
    import ctypes
    from fusegrad.device import Device
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(_MARK_SRC))
    entry = ctypes.cast(lib.fg_test_mark, ctypes.c_void_p).value
    pool = cpu_pool.c_pool()
    rng = np.random.default_rng(0)
    m = rng.standard_normal((256, 256)).astype(np.float32)
    for job in range(300):
        size, n = int(rng.integers(1, 64)), int(rng.integers(2, 8))
        hits = (ctypes.c_int * size)()
        args = (ctypes.c_void_p * 1)(ctypes.addressof(hits))
        if job % 50 == 25: time.sleep(0.01)  # the workers fall asleep
        if job % 7 == 0: m @ m  # numpy's threads spin for a while after this
        pool.run(entry, args, size, n)
        assert list(hits) == [1] * size, (job, size, n, list(hits))

_BEFORE_BEGIN_SRC = r"""
int fg_test_first_job_claimable_early(void) {
  /* what fg_pool_submit does for a process's first job before fg_begin: the job's slot is written (a worker spawned
     by then spins on fg_claimable meanwhile) */
  fg_q[0] = (fg_job){0, 0, 2, 2, 1, 0};
  return fg_claimable() || fg_claimable_by_waiter();
}
"""

def test_first_job_is_not_claimable_before_it_begins():
    # a fresh pool's ticket must not name a claimable chunk of job 0 before job 0 begins: a worker claiming it then
    # ran chunk 0 twice (once more after fg_begin reset the ticket) and the job ended before its last chunk had run,
    # which gave a first matmul of a process wrong values now and then. (The pool's own source, with its state fresh.)
    from fusegrad.device import Device
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(cpu_pool.POOL_SOURCE + _BEFORE_BEGIN_SRC))
    assert lib.fg_test_first_job_claimable_early() == 0
