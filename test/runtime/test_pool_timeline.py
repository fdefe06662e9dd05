"""The C pool's timeline records every chunk that runs while it is on, once, with its job, chunk and thread, and
nothing once it is off: checked against the jobs and chunks queued (counted in Python) and the kernels' results."""
import numpy as np
import pytest
from fusegrad import Context, Tensor
from fusegrad.runtime import cpu_pool

pytestmark = pytest.mark.skipif(cpu_pool.c_pool() is None or cpu_pool.cores() < 2,
                                reason="no kernel queue without the C pool and 2 cores")

def test_timeline_records_each_chunk_once():
    pool = cpu_pool.c_pool()
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    a = Tensor(x).realize()
    before = pool.submitted
    outs = []
    def run() -> None:
        with Context(CPU_THREADS=2):
            for _ in range(5): outs.append((a * 3 + 1).sum(1).realize())   # split kernels (1 MB read each)
    rows = pool.timeline(run)
    jobs = pool.submitted - before
    for o in outs: np.testing.assert_allclose(o.numpy(), (x.astype(np.float64) * 3 + 1).sum(1), rtol=1e-4)
    assert jobs >= 5 and rows
    seen = {(job, chunk) for job, chunk, *_ in rows}
    assert len(seen) == len(rows)   # each chunk once
    # every job queued in the call, each with all of its chunks (0 .. n-1), and no other job
    by_job: dict[int, set[int]] = {}
    for job, chunk, *_ in rows: by_job.setdefault(job, set()).add(chunk)
    assert sorted(by_job) == list(range(before, before + jobs))
    assert all(chunks == set(range(len(chunks))) for chunks in by_job.values())
    assert any(len(chunks) == 2 for chunks in by_job.values())
    assert all(lane >= 0 and start <= end for _, _, lane, start, end in rows)
    # off: later kernels leave no records
    assert pool.timeline(lambda: None) == []
    (a * 2).sum(1).realize()
    pool.wait()
    assert pool.timeline(lambda: None) == []
