"""CPU memory: alignment, host copies, zero-copy views, Buffer views at offsets, size 0, the free-list cache."""
import ctypes
import gc
import numpy as np
import pytest
from fusegrad.device import Buffer, Device, GlobalCounters, LRUAllocator
from fusegrad.dtype import dtypes

def addr(b: Buffer) -> int: return ctypes.addressof(b._buf)

def filled(n: int, dtype=dtypes.float32, start: float = 0) -> tuple[Buffer, np.ndarray]:
    ref = (np.arange(n) + start).astype(np.dtype(dtype.name if dtype != dtypes.float32 else "float32"))
    return Buffer("CPU", n, dtype).copyin(memoryview(ref)), ref

@pytest.mark.parametrize("size", [1, 3, 17, 100, 4096, 100003])
def test_alignment(size):
    bufs = [Buffer("CPU", size, dtypes.uint8).ensure_allocated() for _ in range(4)]
    assert all(addr(b) % 64 == 0 for b in bufs)

def test_lazy_allocation():
    b = Buffer("CPU", 10, dtypes.float32)
    assert not b.is_allocated() and "unallocated" in repr(b)
    assert b.ensure_allocated() is b and b.is_allocated()
    with pytest.raises(RuntimeError): b.allocate()

@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.int8, dtypes.int64, dtypes.float16, dtypes.uint16])
def test_copyin_copyout_roundtrip(dtype):
    ref = (np.random.default_rng(0).random(37) * 100).astype(np.dtype({dtypes.int8: "int8", dtypes.int64: "int64",
                                                                      dtypes.float16: "float16",
                                                                      dtypes.uint16: "uint16"}.get(dtype, "float32")))
    b = Buffer("CPU", 37, dtype).copyin(memoryview(ref))
    out = np.zeros_like(ref)
    b.copyout(memoryview(out))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(b.numpy(), ref)
    assert b.nbytes == 37 * dtype.itemsize

def test_copy_size_mismatch():
    b = Buffer("CPU", 4, dtypes.float32)
    with pytest.raises(ValueError): b.copyin(memoryview(np.zeros(5, np.float32)))
    with pytest.raises(ValueError): b.copyout(memoryview(np.zeros(3, np.float32)))

def test_numpy_is_a_copy():
    b, ref = filled(8)
    arr = b.numpy()
    arr[0] = 42
    np.testing.assert_array_equal(b.numpy(), ref)

def test_zero_copy_numpy_view():
    b, ref = filled(16)
    mv = b.as_buffer()
    view = np.frombuffer(mv, dtype=np.float32)
    np.testing.assert_array_equal(view, ref)
    # writes through the numpy array are writes to the buffer's memory, and the other way round
    view[3] = -1.0
    assert b.numpy()[3] == -1.0
    b.copyin(memoryview(np.full(16, 7.0, np.float32)))
    assert view[0] == 7.0 and view[15] == 7.0
    assert np.frombuffer(mv, dtype=np.uint8).ctypes.data == addr(b)

def test_exported_memory_is_not_recycled():
    # memory a live memoryview still reads must not be handed to a new Buffer by the free-list cache
    b, _ = filled(1000, start=5)
    view = np.frombuffer(b.as_buffer(), dtype=np.float32)
    old = view.ctypes.data
    del b
    gc.collect()
    others = [Buffer("CPU", 1000, dtypes.float32).ensure_allocated() for _ in range(3)]
    assert all(addr(o) != old for o in others)
    for o in others: o.copyin(memoryview(np.zeros(1000, np.float32)))
    np.testing.assert_array_equal(view, np.arange(1000, dtype=np.float32) + 5)

def test_freed_memory_is_recycled():
    alloc = Device["CPU"].allocator
    b = Buffer("CPU", 12345, dtypes.uint8).ensure_allocated()
    old = addr(b)
    del b
    gc.collect()
    assert addr(Buffer("CPU", 12345, dtypes.uint8).ensure_allocated()) == old
    c = Buffer("CPU", 12347, dtypes.uint8).ensure_allocated()
    del c
    gc.collect()
    assert alloc.cached_bytes >= 12347
    alloc.free_cache()
    assert alloc.cached_bytes == 0 and not alloc.cache

def test_views_with_offsets():
    base, ref = filled(64)
    v = base.view(10, dtypes.float32, 4 * 8)  # elements 8..17
    np.testing.assert_array_equal(v.numpy(), ref[8:18])
    assert addr(v) == addr(base) + 32 and v.base is base and v.offset == 32
    v.copyin(memoryview(np.full(10, -3.0, np.float32)))
    expected = ref.copy()
    expected[8:18] = -3.0
    np.testing.assert_array_equal(base.numpy(), expected)
    # a view of a view is a view of the base at the summed offset, and may reinterpret the dtype
    vv = v.view(2, dtypes.int32, 4)
    assert vv.base is base and vv.offset == 36
    np.testing.assert_array_equal(vv.numpy(), np.full(2, -3.0, np.float32).view(np.int32))

def test_view_allocates_base():
    base = Buffer("CPU", 32, dtypes.float32)
    v = base.view(8, dtypes.float32, 16)
    v.copyin(memoryview(np.ones(8, np.float32)))
    assert base.is_allocated()
    assert base.numpy()[4:12].tolist() == [1.0] * 8

def test_view_bounds():
    base = Buffer("CPU", 8, dtypes.float32)
    with pytest.raises(ValueError): base.view(3, dtypes.float32, 24)
    with pytest.raises(ValueError): base.view(1, dtypes.float32, -4)
    base.view(2, dtypes.float32, 24)

def test_view_keeps_memory_alive():
    base, ref = filled(256)
    v = base.view(4, dtypes.float32, 400)
    del base
    gc.collect()
    for _ in range(3): Buffer("CPU", 256, dtypes.float32).copyin(memoryview(np.zeros(256, np.float32)))
    np.testing.assert_array_equal(v.numpy(), ref[100:104])

def test_size_zero():
    b = Buffer("CPU", 0, dtypes.float32)
    b.copyin(memoryview(np.zeros(0, np.float32)))
    assert b.is_allocated() and b.nbytes == 0
    assert b.numpy().shape == (0,) and len(b.as_buffer()) == 0
    b.copyout(memoryview(bytearray(0)))
    assert Buffer("CPU", 4, dtypes.float32).view(0, dtypes.float32, 16).numpy().shape == (0,)

def test_mem_used_accounting():
    gc.collect()
    start = GlobalCounters.mem_used
    b = Buffer("CPU", 1000, dtypes.float32).ensure_allocated()
    v = b.view(10, dtypes.float32, 0).ensure_allocated()  # views own no memory
    assert GlobalCounters.mem_used == start + 4000
    del v
    b.deallocate()
    assert GlobalCounters.mem_used == start and not b.is_allocated()
    c = Buffer("CPU", 10, dtypes.float32).ensure_allocated()
    assert GlobalCounters.mem_used == start + 40
    del c
    gc.collect()
    assert GlobalCounters.mem_used == start

def test_external_opaque():
    # memory handed in isn't the buffer's to free or count
    mem = Device["CPU"].allocator.alloc(16)
    used = GlobalCounters.mem_used
    b = Buffer("CPU", 4, dtypes.float32, opaque=mem)
    assert b.is_allocated() and GlobalCounters.mem_used == used
    b.copyin(memoryview(np.arange(4, dtype=np.float32)))
    assert list(bytes(mem)) == list(np.arange(4, dtype=np.float32).tobytes())

def test_bad_sizes():
    with pytest.raises(ValueError): Buffer("CPU", -1, dtypes.float32)
    with pytest.raises(ValueError): Device["CPU"].allocator.alloc(-5)

def test_buffer_dying_in_a_reference_cycle_is_not_recycled_after_its_memory_is_freed():
    """In cyclic garbage the memory's finalizer runs before Buffer.__del__ returns the allocation to the LRU cache;
    that allocation must not be handed out again (it would be a use after free)."""
    import gc
    from fusegrad.device import Buffer, Device
    from fusegrad.dtype import dtypes
    alloc = Device["CPU"].allocator
    b = Buffer("CPU", 1000003, dtypes.uint8).ensure_allocated()
    cycle: list = [b]
    cycle.append(cycle)
    del b, cycle
    gc.collect()
    for lst in alloc.cache.values():
        for opaque in lst: assert opaque._finalizer.alive

class _Counted(LRUAllocator):
    """An LRU allocator over names: fresh allocations are counted ("fresh1", ...), `busy` ones are in use by queued
    kernels; `ordered`: whether its queue runs in order (Allocator.queue_ordered)."""
    def __init__(self, ordered: bool = False):
        super().__init__()
        self.busy, self.fresh, self.queue_ordered = set(), 0, ordered
    def _alloc(self, size, options):
        self.fresh += 1
        return f"fresh{self.fresh}"
    def _idle(self, opaque): return opaque not in self.busy

def test_free_list_hands_out_only_memory_no_queued_kernel_uses():
    # the free list of one size: the most recently freed allocation when no queued kernel uses it (after a
    # synchronizing read all are idle), else the oldest idle one (kernels running behind use the newest), else fresh
    # memory; never one a queued kernel still uses
    alloc = _Counted()
    for name in ("a", "b", "c", "d"): alloc.free(name, 64)
    assert alloc.alloc(64) == "d" and alloc.cached_bytes == 3 * 64
    alloc.free("d", 64)
    alloc.busy = {"c", "d"}
    assert alloc.alloc(64) == "a"
    alloc.busy = {"b", "c", "d"}
    assert alloc.alloc(64) == "fresh1" and alloc.cached_bytes == 3 * 64
    alloc.busy = {"b", "d"}
    assert alloc.alloc(64) == "c"
    alloc.busy = set()
    assert [alloc.alloc(64) for _ in range(2)] == ["d", "b"] and alloc.cached_bytes == 0
    assert alloc.alloc(64) == "fresh2"

def test_memory_for_a_queued_kernel_is_the_most_recently_freed_even_in_use():
    # a kernel queued after all the others, on a device that runs its queue in order, gets the most recently freed
    # allocation even while queued kernels still use it (they finish before it starts); a host copy (not queued) and
    # a device whose queue has no order still get only idle memory
    alloc = _Counted(ordered=True)
    for name in ("a", "b", "c"): alloc.free(name, 64)
    alloc.busy = {"a", "b", "c"}
    assert alloc.alloc(64) == "fresh1"
    assert alloc.alloc(64, queued=True) == "c" and alloc.cached_bytes == 2 * 64
    alloc = _Counted(ordered=False)
    alloc.free("a", 64)
    alloc.busy = {"a"}
    assert alloc.alloc(64, queued=True) == "fresh1" and alloc.cached_bytes == 64
    alloc.busy = set()
    assert alloc.alloc(64, queued=True) == "a"

def _eager_adam_steps(n: int, seen: list) -> tuple[list, object, object]:
    """n eager Adam steps of a small MLP with a fresh input each step (whose gradient keeps a snapshot of the first
    weight), the first weight's and its gradient's allocations noted after each; returns the losses (read after the
    last step, each held lazily until then) and the two layers."""
    from fusegrad import Tensor, nn
    Tensor.manual_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 300)).astype(np.float32), rng.integers(0, 10, 64).astype(np.int32)
    l1, l2 = nn.Linear(300, 400), nn.Linear(400, 10)
    opt = nn.optim.Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-2)
    losses = []
    with Tensor.train():
        for _ in range(n):
            opt.zero_grad()
            loss = l2(l1(Tensor(x)).relu()).sparse_categorical_crossentropy(Tensor(y))
            loss.backward()
            opt.step()
            losses.append(loss)
            seen.append((ctypes.addressof(l1.weight.uop.base.buffer._buf),
                         ctypes.addressof(l1.weight.grad.uop.base.buffer._buf)))
    return [float(v.item()) for v in losses], l1, l2

def test_an_eager_step_keeps_its_buffers_in_a_few_allocations():
    # the Python of an eager step runs ahead of its kernels (they are queued); each step's new weight memory (the
    # snapshot's trade) and gradient take the memory the step before freed, not fresh memory until those kernels
    # have run: a handful of allocations, however far ahead the Python gets
    seen: list = []
    _eager_adam_steps(30, seen)
    assert len({a for pair in seen[5:] for a in pair}) <= 4

def test_memory_reused_behind_queued_kernels_computes_what_torch_does():
    # the steps above, their buffers in memory that queued kernels were still using when it was handed out, against
    # torch's Adam from the same initial weights
    import torch
    from fusegrad import Tensor, nn
    Tensor.manual_seed(0)   # (the initial weights _eager_adam_steps makes)
    first, second = nn.Linear(300, 400), nn.Linear(400, 10)
    init = [t.numpy().copy() for t in (first.weight, first.bias, second.weight, second.bias)]
    losses, l1, l2 = _eager_adam_steps(12, [])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 300)).astype(np.float32), rng.integers(0, 10, 64)
    t1, t2 = torch.nn.Linear(300, 400), torch.nn.Linear(400, 10)
    with torch.no_grad():
        for p, v in zip((t1.weight, t1.bias, t2.weight, t2.bias), init): p.copy_(torch.tensor(v))
    opt = torch.optim.Adam([t1.weight, t1.bias, t2.weight, t2.bias], lr=1e-2)
    want = []
    for _ in range(12):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(t2(torch.relu(t1(torch.tensor(x)))), torch.tensor(y))
        loss.backward()
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(l1.weight.numpy(), t1.weight.detach().numpy(), rtol=1e-4, atol=1e-5)
