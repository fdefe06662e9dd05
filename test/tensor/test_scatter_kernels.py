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

@pytest.mark.parametrize("op", ["gather", "scatter", "scatter_reduce", "getitem", "embedding_backward"])
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
        w = Tensor(rng.standard_normal((n, 4)).astype(np.float32), requires_grad=True).realize()
        (w[idx[:, 0]] * src).sum().backward()
        return _work(lambda: w.grad)
    (small_ops, small_mem), (big_ops, big_mem) = run(100), run(100000)
    assert big_ops <= small_ops * 1.1 + 100
    assert big_mem <= small_mem + 3 * 100000 * 4 * 4

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
