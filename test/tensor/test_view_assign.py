"""Assigning through a view (slice, permute, flip, reshape, strided, a Variable's shrink) writes into the tensor it
views, and every later read of that tensor or of its other views sees the write in program order, as PyTorch's
`t[...].copy_(...)` and tinygrad do; checked against NumPy doing the same writes in the same order."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor, TinyJit, Variable, dtypes
from fusegrad.uop.ops import Ops

def _int(n: int) -> tuple[Tensor, np.ndarray]:
    ref = np.arange(n, dtype=np.int32) * 3 + 1
    return Tensor(ref.copy()).contiguous().realize(), ref

def test_slice_assign_is_seen_by_the_base():
    a = Tensor([1, 2, 3, 4]).contiguous().realize()
    a[1:3].assign(Tensor([4, 5]))
    assert a.tolist() == [1, 4, 5, 4]

def test_assign_of_a_value_reading_its_own_view():
    a = Tensor([1, 2, 3, 4]).contiguous().realize()
    v = a[1:3]
    v.assign(v * 10)
    assert a.tolist() == [1, 20, 30, 4] and v.tolist() == [20, 30]

@pytest.mark.parametrize("view", ["slice", "permute", "flip", "reshape", "strided", "shrink2d"])
def test_assign_through_each_kind_of_view(view):
    t, ref = Tensor(np.arange(24, dtype=np.float32).reshape(4, 6)).contiguous().realize(), \
        np.arange(24, dtype=np.float32).reshape(4, 6)
    pick = {"slice": lambda x: x[1:3], "permute": lambda x: x.permute(1, 0)[2:5] if isinstance(x, Tensor) else
            x.transpose(1, 0)[2:5], "flip": lambda x: x.flip(1)[:, :2] if isinstance(x, Tensor) else x[:, ::-1][:, :2],
            "reshape": lambda x: x.reshape(2, 12)[1, 3:9], "strided": lambda x: x[::2, 1::3],
            "shrink2d": lambda x: x.shrink(((1, 4), (2, 5))) if isinstance(x, Tensor) else x[1:4, 2:5]}[view]
    target = pick(t)
    value = np.random.default_rng(0).standard_normal(target.shape).astype(np.float32)
    target.assign(Tensor(value))
    pick(ref)[...] = value
    np.testing.assert_array_equal(t.numpy(), ref)

def test_reads_before_the_write_keep_old_values_and_reads_after_see_new_ones():
    a, ref = _int(8)
    before, before_view, before_sum = a * 2, a[2:6] + 0, a.sum()   # lazy reads made before the write (WAR)
    a[3:5].assign(Tensor([-1, -2], dtype=dtypes.int32))
    after, after_sum = a[2:6] + 0, a.sum()
    np.testing.assert_array_equal(before.numpy(), ref * 2)
    np.testing.assert_array_equal(before_view.numpy(), ref[2:6])
    assert before_sum.item() == ref.sum()
    ref[3:5] = [-1, -2]
    np.testing.assert_array_equal(after.numpy(), ref[2:6])
    assert after_sum.item() == ref.sum()

@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_overlapping_slice_writes_in_either_order(order):
    a, ref = _int(10)
    writes = [(slice(1, 6), 100), (slice(4, 9), 200)]
    if order == "high_first": writes = writes[::-1]
    for sl, v in writes:
        a[sl].assign(Tensor.full((sl.stop - sl.start,), v, dtype=dtypes.int32))
        ref[sl] = v
    np.testing.assert_array_equal(a.numpy(), ref)

def test_overlapping_self_copies_read_the_old_values():
    a, ref = _int(12)
    a[1:12].assign(a[0:11])                 # shift right by one: numpy reads before it writes too
    ref[1:12] = ref[0:11].copy()
    a[0:6].assign(a[6:12].flip(0))
    ref[0:6] = ref[6:12][::-1].copy()
    np.testing.assert_array_equal(a.numpy(), ref)

def test_chain_of_slice_copies_between_tensors():
    a, ra = _int(6)
    b, rb = Tensor.zeros(6, dtype=dtypes.int32).contiguous().realize(), np.zeros(6, np.int32)
    b[0:3].assign(a[3:6]); rb[0:3] = ra[3:6]
    a[3:6].assign(b[0:3] * 2); ra[3:6] = rb[0:3] * 2
    b[3:6].assign(a[3:6] + b[0:3]); rb[3:6] = ra[3:6] + rb[0:3]
    np.testing.assert_array_equal(a.numpy(), ra)
    np.testing.assert_array_equal(b.numpy(), rb)

def test_random_program_of_slice_writes_and_reads_matches_numpy():
    rng = np.random.default_rng(5)
    a, ref = _int(16)
    pending: list[tuple[Tensor, np.ndarray]] = []
    for _ in range(40):
        lo = int(rng.integers(0, 15)); hi = int(rng.integers(lo + 1, 17))
        if rng.random() < 0.5:
            v = rng.integers(-50, 50, hi - lo).astype(np.int32)
            a[lo:hi].assign(Tensor(v)); ref[lo:hi] = v
        else:
            pending.append((a[lo:hi] * 1, ref[lo:hi].copy()))   # read lazily, checked at the end
    for got, want in pending: np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(a.numpy(), ref)

def test_assign_to_a_view_of_an_unrealized_tensor():
    b = Tensor([1, 2, 3, 4]).contiguous()
    b[1:3].assign(Tensor([7, 8]))
    assert b.tolist() == [1, 7, 8, 4]
    c = Tensor.arange(6).reshape(2, 3) + 1
    c[:, 1].assign(Tensor([0, 0]))
    np.testing.assert_array_equal(c.numpy(), [[1, 0, 3], [4, 0, 6]])

def test_assign_to_a_reshape_of_an_unrealized_graph():
    base = Tensor([1.0, 2.0, 3.0, 4.0]) + 1
    v = base.reshape(2, 2)
    v.assign(Tensor([[0.0, 1.0], [2.0, 3.0]])).realize()
    np.testing.assert_array_equal(v.numpy(), [[0.0, 1.0], [2.0, 3.0]])
    np.testing.assert_array_equal(base.numpy(), [0.0, 1.0, 2.0, 3.0])

def test_assign_through_a_variable_shrink():
    cache, ref = Tensor.zeros(8, 2).contiguous().realize(), np.zeros((8, 2), np.float32)
    v = Variable("pos", 0, 7)
    for pos in (0, 3, 5):
        row = np.full((1, 2), pos + 1, np.float32)
        cache[v.bind(pos):v.bind(pos) + 1].assign(Tensor(row))
        ref[pos:pos + 1] = row
        np.testing.assert_array_equal(cache.numpy(), ref)

def test_slice_assign_inside_tinyjit_replays():
    buf = Tensor.zeros(4, 3).contiguous().realize()
    ref = np.zeros((4, 3), np.float32)
    @TinyJit
    def write(x: Tensor) -> Tensor:
        buf[1:3].assign(x)
        return (buf * 1).realize()
    for i in range(4):
        x = np.full((2, 3), i + 1, np.float32)
        out = write(Tensor(x))
        ref[1:3] = x
        np.testing.assert_array_equal(out.numpy(), ref)
        np.testing.assert_array_equal(buf.numpy(), ref)

def test_write_through_a_view_then_realize_runs_one_kernel():
    # the KV-cache pattern `cache[:, a:b].assign(x).realize()`: the write, and nothing more (realizing a view of
    # memory runs nothing, as in tinygrad)
    from fusegrad import GlobalCounters
    cache, ref = Tensor.zeros(3, 8).contiguous().realize(), np.zeros((3, 8), np.float32)
    x = Tensor(np.ones((3, 2), np.float32)).realize()
    k0 = GlobalCounters.kernel_count
    view = cache[:, 2:4].assign(x).realize()
    assert GlobalCounters.kernel_count - k0 == 1
    ref[:, 2:4] = 1
    k1 = GlobalCounters.kernel_count
    assert view.realize() is view and cache[::2, 1:].realize().uop.base is cache.uop.base
    assert GlobalCounters.kernel_count == k1
    np.testing.assert_array_equal(view.numpy(), ref[:, 2:4])
    np.testing.assert_array_equal(cache.numpy(), ref)

@pytest.mark.parametrize("projection", ["matmul", "linear"])
def test_writing_part_of_a_lazy_matmul_computes_it_once(projection, monkeypatch):
    # attention's pattern: q, k and v are chunks of one projection; k and v are written into caches first. Each
    # write computing only its chunk would leave q's reader to compute the projection again (its weights read twice).
    # A matmul and a Linear layer's projection are one COMPOSITE node each (tensor/composite.py) holding the reduction
    import fusegrad.tensor
    from fusegrad import GlobalCounters
    from fusegrad.tensor.nn import linear_layer
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)   # (composites are made in this process)
    rng = np.random.default_rng(0)
    x_np, w_np = rng.standard_normal((2, 16), np.float32), rng.standard_normal((48, 16), np.float32)
    x, w = Tensor(x_np).realize(), Tensor(w_np).realize()
    project = (lambda: x @ w.T) if projection == "matmul" else (lambda: linear_layer(x, w, None))
    kcache, vcache = Tensor.zeros(4, 16).contiguous().realize(), Tensor.zeros(4, 16).contiguous().realize()
    GlobalCounters.reset()
    project().realize()
    projection_ops = GlobalCounters.global_ops
    GlobalCounters.reset()
    whole = project()
    assert whole.uop.op is Ops.COMPOSITE   # (a matmul and a Linear layer: each one node, tensor/composite.py)
    q, k, v = whole.chunk(3, dim=1)
    kcache[1:3].assign(k)
    vcache[1:3].assign(v)
    scores = (q @ kcache.T).numpy()
    ref = x_np @ w_np.T
    ref_k = np.zeros((4, 16), np.float32)
    ref_k[1:3] = ref[:, 16:32]
    np.testing.assert_allclose(kcache.numpy(), ref_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vcache.numpy()[1:3], ref[:, 32:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scores, ref[:, :16] @ ref_k.T, rtol=1e-4, atol=1e-4)
    ops = GlobalCounters.global_ops
    GlobalCounters.reset()
    (Tensor(ref[:, :16]) @ kcache.T).realize()
    # the projection's work once and the scores': not the projection's again for q
    assert ops == projection_ops + GlobalCounters.global_ops
