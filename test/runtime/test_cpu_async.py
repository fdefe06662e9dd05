"""CPU kernels are queued on the C pool and run while Python goes on: every way of looking at a buffer from the host
sees what the kernels before it wrote, memory a queued kernel uses is neither freed nor handed to another buffer, and
CPU_ASYNC=0 makes every kernel finish before its call returns. References are numpy's."""
import ctypes
import gc
import numpy as np
import pytest
from fusegrad import Context, Device, Tensor, Variable, dtypes
from fusegrad.device import Buffer
from fusegrad.runtime import cpu_compiler, cpu_pool

pool = cpu_pool.c_pool()
pytestmark = [pytest.mark.skipif(pool is None, reason="the C thread pool could not be compiled here"),
              pytest.mark.skipif(cpu_pool.cores() < 2, reason="kernels only run asynchronously with 2+ cores")]

def _slow_matmul(n: int = 1024) -> tuple[Tensor, np.ndarray]:
    """A lazy product that takes a few milliseconds or more, and its inputs as numpy arrays."""
    rng = np.random.default_rng(n)
    a = rng.standard_normal((n, n), dtype=np.float32)
    return Tensor(a).realize(), a

def test_realize_returns_before_the_kernels_ran():
    t, a = _slow_matmul(2048)
    Device["CPU"].synchronize()
    # ~0.1 s of work on one thread (a kernel split across threads may have the caller run part of it)
    with Context(CPU_THREADS=1): out = (t @ t).realize()
    assert not pool.done(pool.submitted)
    Device["CPU"].synchronize()
    assert pool.done(pool.submitted)
    np.testing.assert_allclose(out.numpy()[:64], a[:64].astype(np.float64) @ a, rtol=1e-3, atol=1e-2)

def test_cpu_async_off_waits_for_each_kernel():
    t, a = _slow_matmul(1024)
    with Context(CPU_ASYNC=0):
        for f in (lambda x: x * 2 + 1, lambda x: x @ x):  # one thread, and split across the cores
            f(t).realize()
            assert pool.done(pool.submitted)

def test_reads_see_the_queued_kernels_results():
    t, a = _slow_matmul(512)
    want = a.astype(np.float64)
    x, ref = t, want
    for _ in range(6):  # a chain of kernels, each reading the last one's output, none waited for
        x, ref = (x @ t) * 0.01, (ref @ want) * 0.01
    np.testing.assert_allclose(x.numpy(), ref, rtol=1e-3, atol=1e-6)
    s = (t.sum(1) * 3).realize()
    assert s.tolist() == pytest.approx((a.astype(np.float64).sum(1) * 3).tolist(), rel=1e-4, abs=1e-3)
    assert (t[3, 5] + 1).item() == pytest.approx(float(a[3, 5]) + 1, rel=1e-6)

def test_copyin_into_a_buffer_a_queued_kernel_reads():
    t, a = _slow_matmul(1024)
    out = (t @ t).realize()           # queued: reads t
    t.assign(Tensor.zeros(1024, 1024)).realize()   # then t is overwritten in place: after the product
    b = np.ones((1024, 1024), np.float32)
    t._buffer().copyin(memoryview(b))  # a host write into t: after both kernels
    np.testing.assert_allclose(out.numpy(), a.astype(np.float64) @ a, rtol=1e-3, atol=1e-2)
    np.testing.assert_array_equal(t.numpy(), b)

def test_freed_memory_is_not_reused_while_a_kernel_reads_it():
    # the input's memory goes back to the allocator's cache while the product reading it is still queued: a new
    # buffer of that size must not get it (its copyin would race the kernel's reads)
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rng.standard_normal((768, 768), dtype=np.float32)
        t = Tensor(a).realize()
        out = (t @ t).realize()
        del t
        gc.collect()
        Tensor(np.full((768, 768), 7.0, np.float32)).realize()  # same size, right after the free
        np.testing.assert_allclose(out.numpy(), a.astype(np.float64) @ a, rtol=1e-3, atol=1e-2)

def test_memory_freed_under_a_queued_kernel_stays_mapped():
    # nothing holds the input or the intermediate but the queued kernels: their memory must outlive them (a free to
    # the C heap here would be a use after free, a crash or garbage)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    alloc = Device["CPU"].allocator
    with Context(LRU=0):
        out = (Tensor(a) @ Tensor(a)).relu().sum(1).realize()
        gc.collect()
        alloc.free_cache()
    np.testing.assert_allclose(out.numpy(), np.maximum(a.astype(np.float64) @ a, 0).sum(1), rtol=1e-3, atol=1e-1)

def test_host_view_sees_in_place_updates():
    # a live memoryview of a buffer: a kernel that writes it has run by the time the call returns (its reader can't
    # know to wait)
    t = Tensor(np.arange(4096, dtype=np.float32)).realize()
    view = t._buffer().as_buffer()
    arr = np.frombuffer(view, dtype=np.float32)
    for step in range(1, 4):
        t.assign(t + 1).realize()
        np.testing.assert_array_equal(arr, np.arange(4096, dtype=np.float32) + step)

def test_variables_of_queued_kernels_keep_their_values():
    n = Variable("n", 1, 4096)
    a = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
    t = Tensor(a).realize()
    outs = [(t[:n.bind(v)] * 3.0 + v).realize() for v in (4096, 1000, 17, 4095, 1)]  # all queued back to back
    for v, o in zip((4096, 1000, 17, 4095, 1), outs):
        np.testing.assert_allclose(o.numpy(), a[:v] * 3.0 + v, rtol=1e-6)

def test_program_dropped_while_its_kernel_is_queued():
    # a runner nothing refers to after its call: its code must stay loaded until the queued job has run
    from fusegrad.codegen import get_program
    from fusegrad.engine.realize import CompiledRunner
    x = Tensor.rand(1 << 20).realize()
    (ei,) = (x * 2 + 1).schedule()
    p = get_program(ei.ast, Device["CPU"].renderer)
    want = x.numpy() * 2 + 1
    for _ in range(10):
        bufs = [Buffer("CPU", 1 << 20, dtypes.float32), ei.bufs[1]]
        CompiledRunner(p)([b.ensure_allocated() for b in bufs], {})
        gc.collect()
        np.testing.assert_allclose(bufs[0].numpy(), want, rtol=1e-6)

def test_timed_runs_wait_for_their_kernel():
    from fusegrad.engine.realize import lower_schedule_item
    t, _ = _slow_matmul(1024)
    (ei,) = [lower_schedule_item(si) for si in (t @ t).schedule()]
    et = ei.run(wait=True)
    assert et is not None and et > 0 and pool.done(pool.submitted)

def test_many_jobs_beyond_the_queue_length():
    # more jobs than the queue holds (a submit then waits for the oldest): each still runs once, in order
    t = Tensor.zeros(1000).contiguous().realize()
    for _ in range(300): t.assign(t + 1).realize()
    np.testing.assert_array_equal(t.numpy(), np.full(1000, 300, np.float32))

def test_every_chunk_of_queued_jobs_runs_once():
    src = r"""
void fg_test_count(void **args, long lo, long hi) {
  int *hits = (int *)args[0];
  for (long i = lo; i < hi; i++) __atomic_fetch_add(&hits[i], 1, __ATOMIC_RELAXED);
}"""
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(src))
    entry = ctypes.cast(lib.fg_test_count, ctypes.c_void_p).value
    rng = np.random.default_rng(3)
    jobs = []
    for _ in range(500):  # submitted without waiting: several times the queue's length
        size, chunks = int(rng.integers(1, 200)), int(rng.integers(1, 5))
        hits = (ctypes.c_int * size)()
        args = (ctypes.c_void_p * 1)(ctypes.addressof(hits))
        pool.submit(entry, args, size, chunks, 1, (hits, args))
        jobs.append(hits)
    pool.wait()
    for hits in jobs: assert list(hits) == [1] * len(hits)

_WHO_SRC = r"""
#include <pthread.h>
#include <time.h>
static long fg_test_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}
/* each chunk notes the thread that ran it. With args[1] set (a thread id), a chunk run by any other thread first waits
   (up to 10 s) until that thread has run a chunk: only a caller that joins lets the worker's chunks finish early */
void fg_test_who(void **args, long lo, long hi) {
  unsigned long *who = (unsigned long *)args[0], caller = (unsigned long)args[1];
  int *caller_ran = (int *)args[2];
  unsigned long me = (unsigned long)pthread_self();
  if (caller && me == caller) __atomic_store_n(caller_ran, 1, __ATOMIC_RELEASE);
  else if (caller) {
    long start = fg_test_ns();
    while (!__atomic_load_n(caller_ran, __ATOMIC_ACQUIRE) && fg_test_ns() - start < 10000000000L) {}
  }
  for (long i = lo; i < hi; i++) who[i] = me;
}
unsigned long fg_test_me(void) { return (unsigned long)pthread_self(); }"""

CHUNKS = 256

def test_caller_joins_only_when_asked():
    # a split kernel (join=True) with nothing queued ahead: the calling thread runs chunks before returning. The
    # worker's chunks wait for the caller to have run one (whatever the machine's load, the worker can't take them
    # all: a caller that doesn't join leaves it waiting 10 s, and the check below fails); without join the call
    # returns having run none (the wait after it may help)
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(_WHO_SRC))
    entry = ctypes.cast(lib.fg_test_who, ctypes.c_void_p).value
    lib.fg_test_me.restype = ctypes.c_ulong
    me = lib.fg_test_me()
    for join in (True, False):
        pool.wait()   # (every job submitted so far, whatever device or test queued it: nothing is ahead of this one)
        # (more chunks than the pool has workers, however many earlier tests started: each worker holds one while it
        # waits, and the caller claims the others)
        who, caller_ran = (ctypes.c_ulong * CHUNKS)(), ctypes.c_int(0)
        args = (ctypes.c_void_p * 3)(ctypes.addressof(who), me if join else 0, ctypes.addressof(caller_ran))
        count = pool.submit(entry, args, CHUNKS, CHUNKS, 1, (who, args, caller_ran), join)
        if join: assert me in list(who) and caller_ran.value == 1, (count, list(who), me)
        else: assert me not in list(who)
        pool.wait(count)
        assert all(list(who))

def test_one_pool_when_threads_race_to_make_it(tmp_path):
    # a fresh process with an empty disk cache: the pool is compiled on a thread of its own once the CPU device
    # exists, while other threads (and the first kernel) ask for it; all of them get the one pool, whose queue runs
    # the kernels (results against numpy)
    import os
    import subprocess
    import sys
    code = """
import threading, numpy as np
from fusegrad import Device, Tensor
from fusegrad.runtime import cpu_compiler, cpu_pool
dev = Device["CPU"]
got = []
threads = [threading.Thread(target=lambda: got.append(cpu_pool.c_pool())) for _ in range(4)]
for t in threads: t.start()
a = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64) / 1000
out = (Tensor(a) * 2 + 1).sum(1).numpy()
for t in threads: t.join()
assert len(got) == 4 and len({id(p) for p in got + [cpu_pool.c_pool()]}) == 1 and got[0] is not None
np.testing.assert_allclose(out, (a.astype(np.float64) * 2 + 1).sum(1), rtol=1e-5)
print("ok", got[0].submitted)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    ok, submitted = res.stdout.split()
    assert ok == "ok" and int(submitted) >= 1   # the kernels went through that pool's queue

_ORDER_SRC = r"""
void fg_test_order(void **args, long lo, long hi) {
  long *counter = (long *)args[0], *seen = (long *)args[1], *hits = (long *)args[2];
  if (lo == 0) *seen = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);   /* when this job ran, among all */
  for (long i = lo; i < hi; i++) __atomic_fetch_add(&hits[i], 1, __ATOMIC_RELAXED);
}"""

def test_jobs_queued_many_at_once_run_once_in_order():
    # runs of jobs queued in one call (submit_many), some longer than the queue, between single submits, and a run of
    # jobs run on the calling thread (run_many): every chunk runs once, and the jobs run in submission order (each
    # records its place in a shared counter)
    lib = cpu_compiler.load_library(Device["CPU"].compiler.compile_cached(_ORDER_SRC))
    entry = ctypes.cast(lib.fg_test_order, ctypes.c_void_p).value
    rng = np.random.default_rng(5)
    counter = ctypes.c_long(0)
    jobs, keep = [], []
    for run in range(12):
        count = 1 if run % 3 == 2 else int(rng.integers(2, pool.QUEUE + 1))
        sizes = [int(rng.integers(1, 300)) for _ in range(count)]
        chunks = [int(rng.integers(1, 4)) for _ in range(count)]
        hits = [(ctypes.c_long * s)() for s in sizes]
        seen = [ctypes.c_long(-1) for _ in range(count)]
        args = (ctypes.c_void_p * (3 * count))(*[a for k in range(count) for a in (
            ctypes.addressof(counter), ctypes.addressof(seen[k]), ctypes.addressof(hits[k]))])
        arrays = ((ctypes.c_void_p * count)(*[entry] * count), (ctypes.c_long * count)(*range(0, 3 * count, 3)),
                  (ctypes.c_long * count)(*sizes), (ctypes.c_long * count)(*chunks),
                  (ctypes.c_int * count)(*[int(rng.integers(0, 2)) for _ in range(count)]))
        fns, offsets, *rest = arrays
        keep.append((args, hits, seen, arrays))
        if count == 1: pool.submit(entry, args, sizes[0], chunks[0], 1, (args, hits, seen))
        elif run == 10:   # jobs run on this thread, each whole: after all those queued before them
            pool.run_many(count, fns, args, offsets, rest[0])
            assert all(s.value >= 0 for s, _ in jobs + list(zip(seen, hits)))
        else: pool.submit_many(count, fns, args, offsets, *rest, 1, (args, hits, seen, arrays))
        jobs += list(zip(seen, hits))
    pool.wait()
    assert [s.value for s, _ in jobs] == list(range(len(jobs)))
    for _, hits in jobs: assert list(hits) == [1] * len(hits)
    with pytest.raises(ValueError, match="at most"):
        pool.submit_many(pool.QUEUE + 1, fns, args, offsets, *rest, 1, None)

def test_host_reads_wait_only_for_the_kernels_that_write():
    # a long product reads a small tensor s (fused into its epilogue): reading s back doesn't wait for it; reading the
    # product does; an in-place update of s queued after it (a kernel writing s) is waited for
    t, a = _slow_matmul(2048)
    s_np = np.arange(2048, dtype=np.float32)
    s = Tensor(s_np).realize()
    Device["CPU"].synchronize()
    with Context(CPU_THREADS=1): out = (t @ t + s).realize()   # ~0.1 s of work on one thread
    product_job = pool.submitted
    np.testing.assert_array_equal(s.numpy(), s_np)
    assert s.tolist()[:3] == [0.0, 1.0, 2.0]
    assert not pool.done(product_job), "reading a tensor the queued kernel only reads waited for it"
    s.assign(s * 2 + 1).realize()   # queued behind the product
    update_job = pool.submitted
    np.testing.assert_array_equal(s.numpy(), s_np * 2 + 1)
    assert pool.done(update_job)
    np.testing.assert_allclose(out.numpy()[:8], a[:8].astype(np.float64) @ a + s_np, rtol=1e-3, atol=1e-2)

def test_reads_between_in_place_updates_see_every_write():
    # products read a and b while a is updated in place now and then: every host read of a, b and the products sees
    # exactly the writes queued before it (numpy keeps the reference)
    rng = np.random.default_rng(9)
    a_np, b_np = rng.standard_normal((256, 256), dtype=np.float32), rng.standard_normal((256, 64), dtype=np.float32)
    a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
    ref = a_np.astype(np.float64)
    for i in range(24):
        c = (a @ b).realize()
        want = ref @ b_np
        if i % 3 == 0:
            a.assign(a * 0.5 + 1).realize()
            ref = ref * 0.5 + 1
        if i % 2 == 0: np.testing.assert_allclose(a.numpy(), ref, rtol=1e-6, err_msg=f"a after step {i}")
        np.testing.assert_array_equal(b.numpy(), b_np)
        np.testing.assert_allclose(c.numpy(), want, rtol=1e-4, atol=1e-3, err_msg=f"product of step {i}")

def test_a_stamp_without_what_it_writes_makes_reads_wait_for_it():
    # the write floor holds only for the stamp it was made with: a job noted the old way (its count alone, by a site
    # that doesn't know what the job writes) counts as a write
    class Alloc: pass
    root = Alloc()
    cpu_pool.stamp(root, 5, 3)
    assert cpu_pool.write_floor(root) == 3
    cpu_pool.stamp(root, 7, 0)   # a job that only reads it
    assert (root._fg_job, cpu_pool.write_floor(root)) == (7, 3)
    root._fg_job = 9
    assert cpu_pool.write_floor(root) == 9
    cpu_pool.stamp(root, 8, 0)   # an earlier job (a second view of the allocation in one graph): the later one stays
    assert (root._fg_job, cpu_pool.write_floor(root)) == (9, 9)

def test_launch_graph_stamps_what_its_kernels_write():
    # a TinyJit replay's launch graph: the weight its kernels only read keeps its write floor, the output's floor is
    # the graph's job
    from fusegrad import TinyJit
    rng = np.random.default_rng(4)
    w_np = rng.standard_normal((512, 512), dtype=np.float32)   # (work enough that the graph is queued)
    w = Tensor(w_np).realize()
    f = TinyJit(lambda x: ((x @ w).relu() * 2).sum(1).realize())
    for _ in range(4):
        x_np = rng.standard_normal((256, 512), dtype=np.float32)
        with Context(CPU_THREADS=2): out = f(Tensor(x_np))
        np.testing.assert_allclose(out.numpy(), (np.maximum(x_np @ w_np, 0) * 2).sum(1), rtol=1e-4, atol=1e-2)
    root_w = cpu_pool.allocation_root(w._buffer()._buf)
    floor_w = cpu_pool.write_floor(root_w)
    out = f(Tensor(x_np))
    root_out = cpu_pool.allocation_root(out._buffer()._buf)
    assert cpu_pool.write_floor(root_out) == root_out._fg_job > floor_w
    assert cpu_pool.write_floor(root_w) == floor_w < root_w._fg_job
    np.testing.assert_array_equal(w.numpy(), w_np)
