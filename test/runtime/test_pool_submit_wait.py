"""Jobs queued in one call with `wait` (CPool.submit_many(wait=True), the C pool's fg_pool_submit_many_wait) have all
run when the call returns, each index of each job once, in submission order after the jobs queued before them: for
sizes that the chunk counts don't divide, one chunk, more chunks than threads, and more workers than cores."""
import ctypes

import numpy as np
import pytest

from fusegrad import Device
from fusegrad.runtime import cpu_compiler, cpu_pool
from test.runtime.test_cpu_async import _ORDER_SRC

pool = cpu_pool.c_pool()
pytestmark = [pytest.mark.skipif(pool is None, reason="the C thread pool could not be compiled here"),
              pytest.mark.skipif(cpu_pool.cores() < 2, reason="kernels only run asynchronously with 2+ cores")]

def _jobs(entry: int, counter: ctypes.c_long, sizes: list[int], chunks: list[int], help: list[int]) -> tuple:
    """The arrays of submit_many for jobs of these sizes and chunk counts, and each job's (seen, hits) results."""
    n = len(sizes)
    hits = [(ctypes.c_long * s)() for s in sizes]
    seen = [ctypes.c_long(-1) for _ in range(n)]
    args = (ctypes.c_void_p * (3 * n))(*[a for k in range(n) for a in (
        ctypes.addressof(counter), ctypes.addressof(seen[k]), ctypes.addressof(hits[k]))])
    arrays = ((ctypes.c_void_p * n)(*[entry] * n), args, (ctypes.c_long * n)(*range(0, 3 * n, 3)),
              (ctypes.c_long * n)(*sizes), (ctypes.c_long * n)(*chunks), (ctypes.c_int * n)(*help))
    return arrays, list(zip(seen, hits))


@pytest.mark.parametrize("workers", [1, 2, 7])
def test_submit_many_wait_returns_with_every_chunk_run_once(workers: int):
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(_ORDER_SRC))
    entry = ctypes.cast(lib.fg_test_order, ctypes.c_void_p).value
    rng = np.random.default_rng(workers)
    counter = ctypes.c_long(0)
    pool.wait()
    start = pool.submitted
    done = []
    for run in range(10):
        count = int(rng.integers(1, pool.QUEUE + 1))
        # (sizes the chunk counts don't divide, chunks of one index, more chunks than the size, one chunk)
        sizes = [int(rng.integers(1, 200)) for _ in range(count)]
        chunks = [1 if run == 0 else int(rng.integers(1, 12)) for _ in range(count)]
        help = [int(rng.integers(0, 2)) for _ in range(count)]
        arrays, results = _jobs(entry, counter, sizes, chunks, help)
        fns, args, offsets, *rest = arrays
        # (a run queued before without waiting: the waiting one runs after it)
        if run % 3 == 1:
            early, early_results = _jobs(entry, counter, [97], [5], [1])
            pool.submit_many(1, early[0], early[1], early[2], *early[3:], workers, (early, early_results))
            done += early_results
        end = pool.submit_many(count, fns, args, offsets, *rest, workers, (arrays, results), wait=True)
        assert pool.done(end) and end == pool.submitted
        for seen, hits in results: assert list(hits) == [1] * len(hits)
        done += results
    assert pool.submitted - start == len(done)
    assert [s.value for s, _ in done] == list(range(len(done)))   # (in submission order)
    for _, hits in done: assert list(hits) == [1] * len(hits)
