"""Gathers and scatters cost the size of what they read or write, not that size times the indexed dimension.

Values against torch and NumPy (duplicates in order: NumPy's ufunc.at and last-write-wins), gradients against torch,
and the work of the kernels (GlobalCounters' ops and bytes), never time."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Context, Tensor, dtypes, nn
from fusegrad.engine.realize import GlobalCounters

RNG = np.random.default_rng(7)

def _work(fn) -> tuple[int, int]:
    """(ALU ops, bytes) of the kernels that realizing fn() runs."""
    GlobalCounters.reset()
    fn().realize()
    return GlobalCounters.global_ops, GlobalCounters.global_mem

# *** values ***

@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dt", [np.float32, np.int32, np.bool_])
def test_scatter_against_torch(dim, dt):
    base = RNG.integers(0, 2, (6, 7)).astype(dt) if dt is np.bool_ else RNG.integers(-9, 9, (6, 7)).astype(dt)
    size = base.shape[dim]
    index = RNG.integers(0, size, (4, 5))   # duplicates along dim: the last one wins, as torch on the CPU
    src = RNG.integers(0, 2, (5, 6)).astype(dt) if dt is np.bool_ else RNG.integers(-9, 9, (5, 6)).astype(dt)
    got = Tensor(base).scatter(dim, Tensor(index), Tensor(src)).numpy()
    want = torch.tensor(base).scatter(dim, torch.tensor(index), torch.tensor(src)).numpy()
    np.testing.assert_array_equal(got, want)

@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dt", [np.float32, np.int32])
def test_scatter_reduce_against_torch(reduce, include_self, dt):
    base = RNG.integers(-5, 6, (5, 8)).astype(dt)
    index = RNG.integers(0, 8, (5, 6))
    src = RNG.integers(-5, 6, (5, 6)).astype(dt)
    got = Tensor(base).scatter_reduce(1, Tensor(index), Tensor(src), reduce, include_self=include_self).numpy()
    want = torch.tensor(base).scatter_reduce(1, torch.tensor(index), torch.tensor(src), reduce,
                                             include_self=include_self).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)

def test_many_duplicates_accumulate_in_order():
    # 20000 values into 3 positions: every read-modify-write sees the one before it (no lost updates)
    pos = RNG.integers(0, 3, 20000)
    vals = RNG.integers(-3, 4, 20000).astype(np.int32)
    want = np.zeros(3, np.int32)
    np.add.at(want, pos, vals)
    got = Tensor.zeros(3, dtype=dtypes.int32).scatter_reduce(0, Tensor(pos), Tensor(vals), "sum")
    np.testing.assert_array_equal(got.numpy(), want)
    # and the last of duplicate writes wins, in the index's order
    last = np.zeros(3, np.int32)
    for p, v in zip(pos, vals): last[p] = v
    np.testing.assert_array_equal(Tensor.zeros(3, dtype=dtypes.int32).scatter(0, Tensor(pos), Tensor(vals)).numpy(),
                                  last)

def test_unchecked_out_of_range_indices_touch_nothing():
    with Context(CHECK_OOB=0):
        base = Tensor.arange(6).float()
        out = base.scatter(0, Tensor([7, -1, 2]), Tensor([10.0, 20.0, 30.0]))
        assert out.tolist() == [0.0, 1.0, 30.0, 3.0, 4.0, 5.0]
        assert base.gather(0, Tensor([7, -1, 2])).tolist() == [0.0, 0.0, 2.0]
        added = base.scatter_reduce(0, Tensor([9, 1]), Tensor([5.0, 5.0]), "sum")
        assert added.tolist() == [0.0, 6.0, 2.0, 3.0, 4.0, 5.0]

@pytest.mark.parametrize("pdt", [dtypes.uint8, dtypes.int8, dtypes.int64])
def test_scatter_node_positions_of_any_integer_dtype(pdt):
    # the SCATTER node itself: positions past the target (or negative) write nothing, whatever their dtype
    from fusegrad.uop.ops import Ops, UOp
    raw = [1, 3, 3, 9, 100] + ([-1, -100] if dtypes.is_int(pdt) and dtypes.min(pdt) < 0 else [255])
    vals = np.arange(1, len(raw) + 1, dtype=np.float32)
    want = np.zeros(10, np.float32)
    for p, v in zip(raw, vals):
        if 0 <= p < 10: want[p] += v
    node = UOp(Ops.SCATTER, dtypes.float32, (Tensor.zeros(10).uop, Tensor(raw, dtype=pdt).uop, Tensor(vals).uop), "add")
    np.testing.assert_array_equal(Tensor(node).numpy(), want)

@pytest.mark.parametrize("device", ["LLVM", "PYTHON"])
def test_other_devices(device):
    base = np.arange(10, dtype=np.float32)
    index, src = np.array([1, 3, 3, 9]), np.array([1.0, 2.0, 5.0, 7.0], np.float32)
    want = base.copy()
    np.add.at(want, index, src)
    got = Tensor(base, device=device).scatter_reduce(0, Tensor(index, device=device), Tensor(src, device=device), "sum")
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(Tensor(base, device=device)[Tensor([3, 9, -1], device=device)].numpy(),
                                  base[[3, 9, -1]])

# *** gradients ***

def _grads(fn_ours, fn_torch, *arrays):
    ours = [Tensor(a, requires_grad=True) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
    w = RNG.standard_normal(tuple(fn_torch(*theirs).shape)).astype(np.float32)
    (fn_ours(*ours) * Tensor(w)).sum().backward()
    (fn_torch(*theirs) * torch.tensor(w)).sum().backward()
    for o, t in zip(ours, theirs): np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)

def test_gather_and_getitem_gradients():
    x = RNG.standard_normal((6, 5)).astype(np.float32)
    idx = RNG.integers(0, 5, (6, 3))
    _grads(lambda a: a.gather(1, Tensor(idx)), lambda a: a.gather(1, torch.tensor(idx)), x)
    rows = np.array([4, 0, 4, 2])
    _grads(lambda a: a[Tensor(rows)], lambda a: a[torch.tensor(rows)], x)
    _grads(lambda a: a[Tensor(rows), Tensor(rows % 5)], lambda a: a[torch.tensor(rows), torch.tensor(rows % 5)], x)

def test_embedding_gradient():
    w = RNG.standard_normal((50, 8)).astype(np.float32)
    toks = RNG.integers(0, 50, (3, 7))
    emb = nn.Embedding(50, 8)
    emb.weight = Tensor(w, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    g = RNG.standard_normal((3, 7, 8)).astype(np.float32)
    (emb(Tensor(toks)) * Tensor(g)).sum().backward()
    (torch.nn.functional.embedding(torch.tensor(toks), tw) * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(emb.weight.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)

def test_scatter_gradients():
    base = RNG.standard_normal((4, 6)).astype(np.float32)
    src = RNG.standard_normal((4, 3)).astype(np.float32)
    idx = np.array([[0, 2, 5], [1, 1, 3], [5, 0, 4], [2, 3, 2]])   # (duplicates in a row)
    _grads(lambda a, s: a.scatter(1, Tensor(idx), s), lambda a, s: a.scatter(1, torch.tensor(idx), s), base, src)

@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_gradients(reduce, include_self):
    base = RNG.standard_normal((4, 6)).astype(np.float32)
    src = RNG.standard_normal((4, 3)).astype(np.float32)
    idx = np.array([[0, 2, 5], [1, 1, 3], [5, 0, 4], [2, 3, 2]])
    _grads(lambda a, s: a.scatter_reduce(1, Tensor(idx), s, reduce, include_self=include_self),
           lambda a, s: a.scatter_reduce(1, torch.tensor(idx), s, reduce, include_self=include_self), base, src)

# *** work ***

def test_advanced_setitem_work_is_what_is_written():
    # 12M elements, 360k of them written: the old one-hot scatter did ~10^12 operations; now a copy and one loop
    t = Tensor.zeros(10, 20, 30, 40, 50, dtype=dtypes.int).contiguous().realize()
    i0, i1 = Tensor([5, 3, 7, 8]).realize(), Tensor([[[0], [1], [2]], [[3], [4], [5]]]).realize()
    v = Tensor.arange(2 * 3 * 4 * 10 * 30 * 50).reshape(2, 3, 4, 10, 30, 50).contiguous().realize()
    written = 2 * 3 * 4 * 10 * 30 * 50
    GlobalCounters.reset()
    t[:, i0, :, i1, :] = v
    t.realize()
    assert GlobalCounters.global_ops < 100 * written   # (the address arithmetic of 5 dims, then the loop)
    tt = torch.zeros(10, 20, 30, 40, 50, dtype=torch.int32)
    tt[:, torch.tensor([5, 3, 7, 8]), :, torch.tensor([[[0], [1], [2]], [[3], [4], [5]]]), :] = \
        torch.arange(written, dtype=torch.int32).reshape(2, 3, 4, 10, 30, 50)
    np.testing.assert_array_equal(t.numpy(), tt.numpy())

@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_reduce", "getitem", "embedding_backward",
                                "scatter_reduce_backward"])
def test_work_does_not_grow_with_the_indexed_dim(op):
    """The same gather or scatter over an indexed dim of 100 and of 100000: the ops stay the same (the one-hot
    formulation's grew 1000x), the bytes grow only by the copy of the target."""
    def run(n: int) -> tuple[int, int]:
        rng = np.random.default_rng(0)
        idx = Tensor(rng.integers(0, 100, (16, 4))).realize()
        x = Tensor(rng.standard_normal((n, 4)).astype(np.float32)).realize()
        src = Tensor(rng.standard_normal((16, 4)).astype(np.float32)).realize()
        if op == "gather": return _work(lambda: x.gather(0, idx))
        if op == "scatter": return _work(lambda: x.scatter(0, idx, src))
        if op == "scatter_reduce": return _work(lambda: x.scatter_reduce(0, idx, src, "amax"))
        if op == "getitem": return _work(lambda: x[idx[:, 0]])
        if op == "scatter_reduce_backward":   # (amax's gradient of the values: gathers and a scatter-add)
            s = src.detach().requires_grad_()
            x.scatter_reduce(0, idx, s, "amax", include_self=False).sum().backward()
            return _work(lambda: s.grad)
        w = Tensor(rng.standard_normal((n, 4)).astype(np.float32), requires_grad=True).realize()
        (w[idx[:, 0]] * src).sum().backward()
        return _work(lambda: w.grad)
    (small_ops, small_mem), (big_ops, big_mem) = run(100), run(100000)
    assert big_ops <= small_ops * 1.1 + 100
    # (amax's gradient recomputes the result and counts the ties in target-sized buffers: copies, no ops; the bytes
    # of a kernel count every buffer it reads whole, also one it gathers 64 elements from)
    copies = 12 if op == "scatter_reduce_backward" else 3
    assert big_mem <= small_mem + copies * 100000 * 4 * 4

# *** more than 2**31 positions ***

@pytest.mark.parametrize("idt", [dtypes.int64, dtypes.uint64, dtypes.uint32, dtypes.int32])
def test_one_hot_of_more_than_2_31_classes(idt):
    # only a window of the one-hot past 2**31 is computed (a lazy shrink): no gigabytes, but the int64 comparison
    n, lo = 2**31 + 10, 2**31 - 4
    vals = [2**31 + 5, 3, 2**31 + 1, 2**31 - 1, 2**31 + 9, 2**31 + 10, 2**32 + 2**31 + 1]   # (the last two: past n)
    vals = [v for v in vals if v <= dtypes.max(idt)] if idt != dtypes.int32 else [2**31 - 1, 3, -1, -2**31]
    with Context(CHECK_OOB=0):
        got = Tensor(vals, dtype=idt).one_hot(n)[:, lo:lo + 16].numpy()
    want = np.array([[v == c for c in range(lo, n)] for v in vals], np.int32)   # (the window ends at n)
    np.testing.assert_array_equal(got, want)

def test_gather_past_2_31_positions():
    x = Tensor.arange(2**31 + 10, dtype=dtypes.int64)   # (lazy: never in memory)
    assert x[Tensor([2**31 + 5, 7, -2])].tolist() == [2**31 + 5, 7, 2**31 + 8]
    assert x.gather(0, Tensor([2**31 + 9, 2**31 - 1])).tolist() == [2**31 + 9, 2**31 - 1]

# *** sharded tensors: each shard scatters what falls in it ***

D2 = ("CPU", "CPU:1")

def _sharded_case(op: str, x: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    """The gather or scatter `op` along dim 0 (scatters: of src at idx into x; gathers: of x at idx)."""
    if op == "scatter": return x.scatter(0, idx, src)
    if op == "scatter_reduce": return x.scatter_reduce(0, idx, src, "amax")
    if op == "gather": return x.gather(0, idx)
    if op == "setitem":
        out = x.contiguous()   # (a lazy copy: a realized tensor that requires grad can't be written in place)
        out[idx[:, 0]] = src
        return out
    raise ValueError(op)

@pytest.mark.parametrize("op,axis", [("scatter", 0), ("scatter", 1), ("embedding_backward", 0),
                                     ("embedding_backward", 1), ("setitem", 1), ("scatter_reduce", 0),
                                     pytest.param("setitem", 0, marks=pytest.mark.slow),
                                     pytest.param("scatter_reduce", 1, marks=pytest.mark.slow)])
def test_sharded_work_does_not_grow_with_the_target(op, axis):
    """A 2-shard target of 100 and of 100000 rows, the same 64 values written: the ops stay the same (the one-hot
    formulation's grew with the target, 1000x), the bytes grow only by the copy of the target."""
    def run(n: int) -> tuple[int, int]:
        rng = np.random.default_rng(0)
        idx = Tensor(rng.integers(0, 100, (16, 4))).shard(D2).realize()
        x = Tensor(rng.standard_normal((n, 4)).astype(np.float32)).shard(D2, axis).realize()
        src = Tensor(rng.standard_normal((16, 4)).astype(np.float32)).shard(D2).realize()
        if op != "embedding_backward": return _work(lambda: _sharded_case(op, x, idx, src))
        x.requires_grad_()
        (x[idx[:, 0]] * src).sum().backward()
        return _work(lambda: x.grad)
    (small_ops, small_mem), (big_ops, big_mem) = run(100), run(100000)
    assert big_ops <= small_ops * 1.1 + 100
    assert big_mem <= small_mem + 3 * 100000 * 4 * 4

_DEFAULT_SHARDED = {("scatter", 1, None), ("setitem", 0, 0), ("gather", 1, 1), ("scatter_reduce", None, 0),
                    ("scatter", 0, 0)}

@pytest.mark.parametrize("op,axis,index_axis", [
    pytest.param(op, ax, iax, marks=() if (op, ax, iax) in _DEFAULT_SHARDED else pytest.mark.slow)
    for op in ["scatter", "scatter_reduce", "setitem", "gather"]
    for ax, iax in [(0, None), (1, None), (0, 0), (1, 1), (None, 0)]])
def test_sharded_values_and_gradients_against_torch(op, axis, index_axis):
    # (7 rows over 3 devices: shards of 3, 3 and 1; 5 columns: 2, 2, 1) duplicates in every column of the index
    devices = ("CPU", "CPU:1", "CPU:2")
    base = RNG.standard_normal((7, 5)).astype(np.float32)
    src = RNG.standard_normal((6, 5)).astype(np.float32)
    idx = RNG.integers(0, 7, (6, 5))
    idx[1] = idx[4]
    if op == "setitem": idx[:, 0] = [6, 2, 0, 2, 5, 6]
    tb, ts = torch.tensor(base, requires_grad=True), torch.tensor(src, requires_grad=True)
    ti = torch.tensor(idx)
    if op == "scatter": want = tb.scatter(0, ti, ts)
    elif op == "scatter_reduce": want = tb.scatter_reduce(0, ti, ts, "amax")
    elif op == "gather": want = tb.gather(0, ti)
    else: want = tb.clone().index_put((ti[:, 0],), ts)   # (the last of duplicate rows wins, as torch on the CPU)
    w = RNG.standard_normal(tuple(want.shape)).astype(np.float32)
    (want * torch.tensor(w)).sum().backward()
    x = Tensor(base).shard(devices, axis).realize().requires_grad_()
    s = Tensor(src).shard(devices, index_axis).realize().requires_grad_()
    i = Tensor(idx).shard(devices, index_axis).realize()
    got = _sharded_case(op, x, i, s)
    assert got.device == devices and (op == "gather" or got.uop.arg == axis)   # (laid out as the target)
    np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-6)
    (_sharded_case(op, x, i, s) * Tensor(w).shard(devices)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert x.grad.uop.arg == axis
    if op != "gather": np.testing.assert_allclose(s.grad.numpy(), ts.grad.numpy(), rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("reduce,include_self", [("sum", True), ("prod", False), ("mean", False), ("amin", True),
                                                 *[pytest.param(r, i, marks=pytest.mark.slow) for r, i in
                                                   [("sum", False), ("prod", True), ("mean", True), ("amin", False)]]])
def test_sharded_integer_scatter_reduce_against_torch(reduce, include_self):
    # integer values, split along the scattered axis: every duplicate counts once, whichever shard holds its position
    base = RNG.integers(-5, 6, (3, 9)).astype(np.int32)
    idx = RNG.integers(0, 9, (3, 12))
    src = RNG.integers(-3, 4, (3, 12)).astype(np.int32)
    got = Tensor(base).shard(D2, 1).scatter_reduce(1, Tensor(idx).shard(D2, 0), Tensor(src).shard(D2, 0), reduce,
                                                   include_self=include_self)
    want = torch.tensor(base).scatter_reduce(1, torch.tensor(idx), torch.tensor(src), reduce,
                                             include_self=include_self).numpy()
    assert got.uop.arg == 1
    np.testing.assert_array_equal(got.numpy(), want)

@pytest.mark.parametrize("axis", [0, 1])
def test_sharded_gather_keeps_the_sign_of_zero(axis):
    """A gather from a split tensor reads -0.0 as -0.0 (the partial results of the shards are summed over the
    devices: where a shard doesn't hold a position its part is -0.0, the sum's identity), as numpy."""
    x = np.array([[-0.0, 1.0], [2.0, -0.0], [0.0, -3.0], [-0.0, -0.0]], dtype=np.float32)
    ii = np.array([[0, 1], [1, 0], [0, 0], [1, 1]])
    t = Tensor(x).shard(D2, axis=axis)
    for got, ref in [(t.gather(1, Tensor(ii).shard(D2)).numpy(), np.take_along_axis(x, ii, 1)),
                     (t[Tensor([3, 0, 1]).shard(D2)].numpy(), x[[3, 0, 1]])]:
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))

def test_sharded_embedding_against_torch():
    # the weight split along the vocabulary, the tokens along the batch (tensor and data parallel at once)
    w = RNG.standard_normal((13, 6)).astype(np.float32)
    toks = RNG.integers(0, 13, (4, 5))
    toks[0, :3] = 12
    g = RNG.standard_normal((4, 5, 6)).astype(np.float32)
    tw = torch.tensor(w, requires_grad=True)
    (torch.nn.functional.embedding(torch.tensor(toks), tw) * torch.tensor(g)).sum().backward()
    emb = nn.Embedding(13, 6)
    emb.weight = Tensor(w).shard(D2, 0).realize().requires_grad_()
    out = emb(Tensor(toks).shard(D2, 0))
    np.testing.assert_allclose(out.numpy(), w[toks], rtol=1e-6)
    (emb(Tensor(toks).shard(D2, 0)) * Tensor(g).shard(D2, 0)).sum().backward()
    assert emb.weight.grad.uop.arg == 0
    np.testing.assert_allclose(emb.weight.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-6)

def test_sharded_setitem_in_place_keeps_the_layout():
    base = np.arange(40, dtype=np.float32).reshape(5, 8)
    t = Tensor(base).shard(D2, 1).realize()
    rows, cols = np.array([4, 0, 4]), np.array([7, 1, 7])
    t[Tensor(rows).shard(D2), Tensor(cols).shard(D2)] = Tensor([-1.0, -2.0, -3.0]).shard(D2)
    want = base.copy()
    want[rows, cols] = [-1.0, -2.0, -3.0]   # (numpy: the last of duplicates wins)
    assert t.uop.arg == 1
    np.testing.assert_array_equal(t.numpy(), want)

def test_sharded_scatter_on_other_devices_is_an_error():
    x = Tensor.zeros(4, 3).contiguous().shard(D2, 0)
    with pytest.raises(ValueError, match="different devices"):
        x.scatter(0, Tensor([[0, 1, 2]]).shard(("CPU", "CPU:2")), 1.0)
