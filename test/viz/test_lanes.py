"""PROFILE's lanes per worker thread: the C pool's record of which thread ran each chunk of a kernel, and when."""
import ctypes
import threading
import time
import numpy as np
import pytest
from fusegrad import Context, Tensor
from fusegrad.runtime.cpu_pool import c_pool
from fusegrad.viz import record
from test.viz.test_trace import _check_events

pytestmark = pytest.mark.skipif(c_pool() is None, reason="the C pool doesn't compile on this machine")

N = 640  # a matmul of ~0.5 G ops: the caller joins in, and two chunks of a few ms let a worker claim one

def _profiled_matmul(a: np.ndarray, b: np.ndarray) -> list[dict]:
    record.recorder.reset()
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-3)
    return record.trace()["profile"]["traceEvents"]

def test_clocks_agree():
    # chunk records are in the pool's clock (CLOCK_MONOTONIC ns); the timeline in time.perf_counter's
    pool = c_pool()
    before = time.perf_counter_ns()
    c = pool.clock_ns()
    after = time.perf_counter_ns()
    assert abs(pool.clock_offset_ns) < 1_000_000
    assert before - 1000 <= c + pool.clock_offset_ns <= after + 1000
    # (and Python's own monotonic clock is the same one)
    assert abs(time.monotonic_ns() - pool.clock_ns() - pool.clock_offset_ns) < 1_000_000

def test_chunks_on_a_lane_per_thread(recording):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((N, N), dtype=np.float32), rng.standard_normal((N, N), dtype=np.float32)
    lanes_seen = set()
    with Context(CPU_THREADS=2):
        (Tensor(a) @ Tensor(b)).numpy()  # (compiled and warm)
        # the calling thread runs any chunk no worker has claimed yet: on a busy machine it may run both, several
        # calls in a row
        for _ in range(50):
            events = _profiled_matmul(a, b)
            _check_events(events)
            kernels = [e for e in events if e.get("cat") == "kernel" and e["args"]["ops"] >= N * N * N]
            assert len(kernels) == 1 and kernels[0]["args"]["threads"] == 2
            k = kernels[0]
            chunks = [e for e in events if e.get("cat") == "chunk" and e["name"] == k["name"]]
            # every chunk once, their ranges covering the kernel's global size, on the device's process
            assert sorted(e["args"]["chunk"] for e in chunks) == [0, 1]
            ranges = sorted(tuple(e["args"]["range"]) for e in chunks)
            assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] > ranges[1][0]
            for e in chunks:
                assert e["pid"] == k["pid"] and e["tid"] != "kernels"
                assert e["tid"] == "MainThread (caller)" or e["tid"].startswith("worker ")
                # inside the kernel's bar (the chunk's own clock readings are taken inside the timed call)
                assert k["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= k["ts"] + k["dur"] + 1, (e, k)
                assert e["dur"] > 0
            # the lanes are named for the viewer
            names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
            lanes_seen = {e["tid"] for e in chunks}
            assert all(names[t] == t for t in lanes_seen)
            # a thread runs its chunks one after another: chunks on one lane don't overlap (which threads run them
            # depends on the machine's load: on a busy one a worker may run both; test_waiting_chunks_run_on_two_lanes
            # has two threads for certain)
            if len(lanes_seen) == 2: break
            a_, b_ = sorted(chunks, key=lambda e: e["ts"])
            assert a_["ts"] + a_["dur"] <= b_["ts"] + 1, (a_, b_)

def test_no_chunks_without_profile():
    record.recorder.reset()
    record.enable(viz=True, profile=False)
    try:
        with Context(CPU_THREADS=2):
            a = np.ones((N, N), dtype=np.float32)
            assert (Tensor(a) @ Tensor(a)).numpy()[0, 0] == N
        assert record.trace()["profile"]["traceEvents"] == []
    finally: record.enable(viz=False, profile=False)

def test_pool_fills_records_for_each_chunk():
    # the C pool alone: a job of 7 chunks over [0, 70) with a record array; each chunk's row names a thread and a
    # start <= end within the submit-to-wait interval
    pool = c_pool()
    entry_t = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.c_long, ctypes.c_long)
    seen = []
    def entry(args, lo, hi): seen.append((lo, hi))
    fn = entry_t(entry)
    rec = (ctypes.c_long * 21)(*([-1] * 21))
    args = (ctypes.c_void_p * 1)()
    st = pool.clock_ns()
    pool.wait(pool.submit(ctypes.cast(fn, ctypes.c_void_p).value, args, 70, 7, 2, (fn, args), False, (), True, rec))
    et = pool.clock_ns()
    assert sorted(seen) == [(10 * i, 10 * (i + 1)) for i in range(7)]
    for i in range(7):
        lane, cst, cet = rec[3 * i], rec[3 * i + 1], rec[3 * i + 2]
        assert 0 <= lane <= 255 and st <= cst <= cet <= et, (i, lane, cst, cet)

def test_waiting_chunks_run_on_two_lanes(recording):
    # two chunks that each wait for the other to start can only finish on two threads: the caller (lane 0) and a
    # worker, or two workers; the records name different lanes and the chunks overlap in time
    pool = c_pool()
    entry_t = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.c_long, ctypes.c_long)
    both_started = threading.Barrier(2, timeout=20)
    def entry(args, lo, hi): both_started.wait()
    fn = entry_t(entry)
    rec = (ctypes.c_long * 6)(*([-1] * 6))
    args = (ctypes.c_void_p * 1)()
    pool.wait(pool.submit(ctypes.cast(fn, ctypes.c_void_p).value, args, 2, 2, 1, (fn, args), True, (), True, rec))
    assert not both_started.broken
    (lane0, st0, et0), (lane1, st1, et1) = rec[0:3], rec[3:6]
    assert lane0 != lane1 and min(lane0, lane1) >= 0, (lane0, lane1)
    assert st0 < et1 and st1 < et0  # both were running at once
    # and the trace gives each lane its own name
    record.recorder.reset()
    off = pool.clock_offset_ns / 1e9
    record._chunk_events("k", "CPU", [(lane0, 0, 1, st0 / 1e9 + off, et0 / 1e9 + off),
                                      (lane1, 1, 2, st1 / 1e9 + off, et1 / 1e9 + off)])
    events = record.trace()["profile"]["traceEvents"]
    tids = [e["tid"] for e in events if e.get("cat") == "chunk"]
    assert len(set(tids)) == 2 and all(t == "MainThread (caller)" or t.startswith("worker ") for t in tids), tids
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(names[t] == t for t in tids)

def test_a_record_array_too_small_is_refused():
    pool = c_pool()
    with pytest.raises(ValueError, match="a record array for 4 chunks needs 12 longs, got 6"):
        pool.submit(0, None, 8, 4, 1, None, record=(ctypes.c_long * 6)())
