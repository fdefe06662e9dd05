"""An eager op's realize keeps the walk of its graph by the op and its sources (tensor/__init__.py _eager_walks): a
later realize of the same op over the same source nodes skips the walk. These tests check that it is taken, that it
holds no node or buffer alive, that a source node freed and another made at its address is not taken for it, and
that it finds the schedule cache as the walk does. Values against NumPy."""
import gc
import weakref
import numpy as np
from fusegrad import Tensor, dtypes
from fusegrad.schedule.kernelize import schedule_cache, schedule_cache_stats
from fusegrad.uop import graph

rng = np.random.default_rng(5)

def test_a_repeated_eager_op_skips_the_walk(monkeypatch):
    x, y = rng.standard_normal((2, 16, 16)).astype(np.float32)
    a, b = Tensor(x).realize(), Tensor(y).realize()
    for _ in range(3): np.testing.assert_array_equal((a + b).realize().numpy(), x + y)
    walks = []
    original = graph.StructureWalk.walk
    monkeypatch.setattr(graph.StructureWalk, "walk", lambda self, roots: walks.append(1) or original(self, roots))
    for _ in range(3): np.testing.assert_array_equal((a + b).realize().numpy(), x + y)
    assert not walks
    # another op over the same sources is another graph: walked
    np.testing.assert_array_equal((a * b).realize().numpy(), x * y)
    assert walks

def test_no_node_or_buffer_is_kept_alive():
    x = rng.standard_normal(64).astype(np.float32)
    a, b = Tensor(x).realize(), Tensor(x).realize()
    for _ in range(4): (a - b).realize()
    node, buf = weakref.ref(a.uop.base), weakref.ref(a._buffer())
    del a
    assert node() is None and buf() is None   # (freed by reference counting, no collection needed)
    np.testing.assert_array_equal((b * 2).realize().numpy(), x * 2)

def test_a_new_source_at_a_freed_one_s_address():
    # each source dies after its op is realized; the next one (another dtype, size or value) is often made at the
    # same address, and must never be taken for it
    for i in range(40):
        dt, npdt = ((dtypes.float32, np.float32), (dtypes.int32, np.int32), (dtypes.float16, np.float16))[i % 3]
        x = rng.integers(-20, 20, 10 + i % 2).astype(npdt)
        t = Tensor(x, dtype=dt).realize()
        for _ in range(3):
            out = (t + t).realize().numpy()
            assert out.dtype == npdt
            np.testing.assert_array_equal(out, x + x)
        del t

def test_a_kept_walk_still_looks_up_the_schedule_cache():
    x = rng.standard_normal(24).astype(np.float32)
    a = Tensor(x).realize()
    for _ in range(3): np.testing.assert_array_equal((a * 3).realize().numpy(), x * 3)
    schedule_cache.clear()
    misses = schedule_cache_stats["misses"]
    for _ in range(3): np.testing.assert_array_equal((a * 3).realize().numpy(), x * 3)
    assert schedule_cache_stats["misses"] == misses + 1   # scheduled again once, then replayed
    gc.collect()
