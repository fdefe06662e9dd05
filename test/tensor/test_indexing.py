"""Indexing compared with torch (CPU) and numpy: basic and advanced __getitem__ (where the advanced dims go), bool
masks, __setitem__ in place and through autodiff, gather/scatter/scatter_reduce, masks, triangles and diagonals,
roll/repeat/split/chunk, one_hot, rearrange; forward values, shapes, dtypes and gradients of every input, plus the
error cases.

Kernel compiles dominate the run time, so the cases are built lazily and realized in one schedule (compiled in
batches) by a module fixture; each case then checks its own results."""
from __future__ import annotations
from typing import Any, Callable
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.helpers import Context

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")

def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 7919 + sum(shape) * 31 + len(shape))
    return rng.uniform(-3, 3, size=shape).astype(np.float32)

class FG:
    """Helpers that make index tensors in fusegrad."""
    @staticmethod
    def s(x: float) -> Tensor: return Tensor(x)
    @staticmethod
    def i(x: Any) -> Tensor: return Tensor(np.asarray(x, dtype=np.int64))
    @staticmethod
    def b(x: Any) -> Tensor: return Tensor(np.asarray(x, dtype=bool))

class TH:
    """The same helpers in torch."""
    @staticmethod
    def s(x: float) -> torch.Tensor: return torch.tensor(x)
    @staticmethod
    def i(x: Any) -> torch.Tensor: return torch.tensor(np.asarray(x, dtype=np.int64))
    @staticmethod
    def b(x: Any) -> torch.Tensor: return torch.tensor(np.asarray(x, dtype=bool))

M4 = np.array([[True, False, True, False], [False, False, True, True], [True, True, False, False]])
IDX = np.array([[0, 2, 1, 0], [2, 1, 1, 0]])
PERM_IDX = np.array([[2, 0, 1, 1], [0, 1, 0, 2]])  # scatter without duplicates along dim 0 of a (3, 4)

# (name, fn(lib, *inputs), input shapes, differentiable): fn runs on fusegrad tensors with lib=FG, torch with lib=TH
CASES: list[tuple[str, Callable, list[tuple[int, ...]], bool]] = [
    ("int", lambda L, a: a[1], [(3, 4)], True),
    ("neg_int", lambda L, a: a[-1, -2], [(3, 4)], True),
    ("slices", lambda L, a: a[1:, ::2], [(3, 5)], True),
    ("slice_steps", lambda L, a: a[::3, 1:5:2, -4:], [(7, 6, 5)], True),
    ("slice_out_of_range", lambda L, a: a[2:100, -100:2], [(4, 5)], True),
    ("empty_slice", lambda L, a: a[3:1], [(4, 5)], True),
    ("none_ellipsis", lambda L, a: a[None, ..., None, 0], [(2, 3, 4)], True),
    ("zero_d_ellipsis", lambda L, a: a[...], [()], True),
    ("zero_d_none", lambda L, a: a[None], [()], True),
    ("true", lambda L, a: a[True], [(2, 3)], True),
    ("false", lambda L, a: a[False], [(2, 3)], True),
    ("list", lambda L, a: a[[2, 0, 2, -1]], [(4, 3)], True),
    ("tensor_2d", lambda L, a: a[L.i([[1, -1], [0, 0]])], [(3, 4)], True),
    ("tensor_0d", lambda L, a: a[:, L.i(2)], [(3, 4)], True),
    ("two_adjacent", lambda L, a: a[:, L.i([0, 1, 2]), L.i([[3], [0]])], [(2, 3, 4, 5)], True),
    ("int_between", lambda L, a: a[L.i([0, 1]), 0, L.i([3, 2])], [(2, 3, 4, 5)], True),
    ("int_before", lambda L, a: a[:, 0, :, L.i([1, 4])], [(2, 3, 4, 5)], True),
    ("separated_by_slice", lambda L, a: a[:, L.i([0, 2]), :, L.i([1, 4])], [(2, 3, 4, 5)], True),
    ("separated_by_none", lambda L, a: a[L.i([1, 0]), None, L.i([2, 2])], [(2, 3, 4)], True),
    ("ellipsis_tensor", lambda L, a: a[..., L.i([3, 0]), 1], [(2, 3, 4, 5)], True),
    ("slice_and_tensor", lambda L, a: a[1:, L.i([0, 0, 3])], [(3, 4)], True),
    ("mask_full", lambda L, a: a[L.b(M4)], [(3, 4)], True),
    ("mask_rows", lambda L, a: a[L.b([True, False, True])], [(3, 4)], True),
    ("mask_after_slice", lambda L, a: a[:, L.b(M4)], [(2, 3, 4)], True),
    ("mask_list", lambda L, a: a[[False, True, True]], [(3, 2)], True),
    ("mask_and_tensor", lambda L, a: a[L.b([True, False, True]), L.i([1, 3])], [(3, 4)], True),
    ("empty_list", lambda L, a: a[[]], [(3, 4)], True),
    ("empty_input", lambda L, a: a[:, L.i([0, 0])], [(0, 3)], True),
    ("permuted", lambda L, a: a.permute(1, 0)[L.i([3, 1]), 1:], [(3, 4)], True),
    ("flipped", lambda L, a: a.flip(0)[L.i([0, 2])][:, L.i([1])], [(3, 4)], True),
    ("sliced_then_index", lambda L, a: a[1:, 1:][L.i([1, 0]), L.i([2, 2])], [(3, 4)], True),
    ("gather_0", lambda L, a: a.gather(0, L.i(IDX)), [(3, 4)], True),
    ("gather_1", lambda L, a: a.gather(1, L.i(IDX[:, :3].T)), [(3, 4)], True),
    ("gather_neg_dim_smaller", lambda L, a: a.gather(-1, L.i([[3, 0], [1, 1]])), [(3, 4)], True),
    ("gather_3d", lambda L, a: a.gather(1, L.i(np.arange(12).reshape(2, 2, 3) % 3)), [(2, 3, 3)], True),
    ("gather_permuted", lambda L, a: a.T.gather(0, L.i(IDX.T[:3] % 3)), [(3, 4)], True),
    ("scatter", lambda L, a, b: a.scatter(0, L.i(PERM_IDX), b), [(3, 4), (2, 4)], True),
    ("scatter_dim1", lambda L, a, b: a.scatter(1, L.i([[3, 0], [1, 2]]), b), [(3, 4), (2, 2)], True),
    ("scatter_scalar", lambda L, a: a.scatter(0, L.i(IDX), 1.5), [(3, 4)], True),
    ("scatter_add", lambda L, a, b: a.scatter(0, L.i(IDX), b, reduce="add"), [(3, 4), (2, 4)], False),
    ("scatter_multiply", lambda L, a, b: a.scatter(0, L.i(IDX), b, reduce="multiply"), [(3, 4), (2, 4)], False),
    ("masked_fill", lambda L, a: a.masked_fill(L.b(M4[0]), -2.0), [(3, 4)], True),
    ("masked_fill_tensor", lambda L, a: a.masked_fill(L.b(M4), L.s(7.0)), [(3, 4)], True),
    ("masked_select", lambda L, a: a.masked_select(L.b(M4)), [(3, 4)], True),
    ("masked_select_bcast", lambda L, a: a.masked_select(L.b(M4[1])), [(2, 3, 4)], True),
    ("tril", lambda L, a: a.tril(), [(4, 5)], True),
    ("tril_neg", lambda L, a: a.tril(-1), [(2, 4, 3)], True),
    ("triu", lambda L, a: a.triu(), [(4, 5)], True),
    ("triu_pos", lambda L, a: a.triu(2), [(2, 3, 5)], True),
    ("diag_1d", lambda L, a: a.diag(), [(4,)], True),
    ("diag_2d", lambda L, a: a.diag(), [(3, 5)], True),
    ("diagonal", lambda L, a: a.diagonal(), [(4, 3)], True),
    ("diagonal_offset", lambda L, a: a.diagonal(1, -1, 0), [(4, 3, 5)], True),
    ("diagonal_neg_offset", lambda L, a: a.diagonal(-2, 1, 2), [(2, 5, 4)], True),
    ("diagonal_empty", lambda L, a: a.diagonal(7), [(3, 4)], True),
    ("roll", lambda L, a: a.roll(2, 1), [(3, 5)], True),
    ("roll_multi", lambda L, a: a.roll((1, -7), (0, -1)), [(3, 5)], True),
    ("roll_flat", lambda L, a: a.roll(4), [(3, 5)], True),
    ("repeat", lambda L, a: a.repeat(2, 1, 3), [(3, 2)], True),
    ("repeat_zero", lambda L, a: a.repeat(0, 2), [(3, 2)], True),
    ("repeat_interleave", lambda L, a: a.repeat_interleave(3, 1), [(2, 3)], True),
    ("numpy_index", lambda L, a: a[np.array([1, -1]), np.int64(2)], [(3, 4)], True),
    ("bool_0d_tensor", lambda L, a: a[L.b(True), 1:], [(3, 4)], True),
    ("true_with_tensors", lambda L, a: a[:, L.i([0, 1]), True, L.i([2, 2])], [(2, 3, 4, 5)], True),
    ("gather_0d", lambda L, a: a.gather(0, L.i(0)), [()], True),
    ("scatter_0d", lambda L, a, b: a.scatter(0, L.i(0), b), [(), ()], True),
    ("roll_0d", lambda L, a: a.roll(1), [()], True),
    ("repeat_interleave_flat", lambda L, a: a.repeat_interleave(2), [(2, 3)], True),
]

def _run_fg(fn: Callable, arrays: list[np.ndarray], grad: bool, seed: np.ndarray | None):
    ins = [Tensor(a) for a in arrays]
    out = fn(FG, *ins)
    if not grad or out.numel() == 0: return out, []
    return out, (out * Tensor(seed)).sum().gradient(*ins)

def _run_torch(fn: Callable, arrays: list[np.ndarray], grad: bool, seed: np.ndarray | None):
    ins = [torch.tensor(a, requires_grad=grad) for a in arrays]
    out = fn(TH, *ins)
    if not grad or out.numel() == 0: return out.detach().numpy(), []
    gs = torch.autograd.grad((out * torch.tensor(seed)).sum(), ins, allow_unused=True)
    return out.detach().numpy(), [np.zeros_like(a) if g is None else g.numpy() for a, g in zip(arrays, gs)]

@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    res, pending = {}, []
    for k, (name, fn, shapes, grad) in enumerate(CASES):
        arrays = [_rand(*s, seed=k * 3 + j) for j, s in enumerate(shapes)]
        with torch.no_grad(): shape = fn(TH, *[torch.tensor(a) for a in arrays]).shape
        seed = _rand(*shape, seed=1000 + k)
        exp, exp_grads = _run_torch(fn, arrays, grad, seed)
        out, grads = _run_fg(fn, arrays, grad, seed)
        res[name] = (out, grads, exp, exp_grads)
        pending += [out] + list(grads)
    Tensor.realize(*[t for t in pending if t.numel()])
    return res

@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_case(results: dict[str, Any], name: str):
    out, grads, exp, exp_grads = results[name]
    got = out.numpy()
    assert got.shape == exp.shape and out.dtype == dtypes.float32
    np.testing.assert_allclose(got, exp, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(exp_grads)
    for g, e in zip(grads, exp_grads): np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-5)

# *** negative steps (torch has none: compared with numpy, the gradient is the seed put back in place) ***

NEG_STEPS = [(np.s_[::-1], (5,)), (np.s_[::-2, 1], (5, 3)), (np.s_[-1:0:-3, ::-1], (7, 4)),
             (np.s_[3:0:-1, None, ..., 1::-1], (5, 2, 3)), (np.s_[1::-5], (4,))]

def test_negative_steps():
    outs, grads, exp = [], [], []
    for k, (idx, shape) in enumerate(NEG_STEPS):
        x = _rand(*shape, seed=k)
        t = Tensor(x).flip(0)  # a non-contiguous input
        out = t[idx]
        seed = _rand(*out.shape, seed=50 + k)
        outs.append(out); grads.append((out * Tensor(seed)).sum().gradient(t)[0])
        g = np.zeros(shape, np.float32)
        g[idx] = seed
        exp.append((x[::-1][idx], g))
    Tensor.realize(*outs, *grads)
    for o, g, (eo, eg) in zip(outs, grads, exp):
        np.testing.assert_array_equal(o.numpy(), eo)
        np.testing.assert_array_equal(g.numpy(), eg)

# *** dtypes, special values, out-of-range tensor indices ***

@pytest.mark.parametrize("dt", ["float16", "bfloat16", "int8", "int64", "uint8", "bool"])
def test_dtypes(dt: str):
    x = (np.arange(24).reshape(4, 6) % 5 - 2)
    tx = torch.tensor(x).to(getattr(torch, dt))
    t = Tensor(tx.float().numpy() if dt == "bfloat16" else tx.numpy()).cast(dt)
    idx = np.array([[3, 0], [1, 1]])
    outs = [t[Tensor(idx)], t.gather(1, Tensor(idx)), t.scatter(0, Tensor(idx), t[:2, :2]), t.tril(1),
            t.masked_fill(Tensor(x > 0), 1), t.roll(1, 0), t.diagonal()]
    exps = [tx[torch.tensor(idx)], tx.gather(1, torch.tensor(idx)), tx.scatter(0, torch.tensor(idx), tx[:2, :2]),
            tx.tril(1), tx.masked_fill(torch.tensor(x > 0), 1), tx.roll(1, 0), tx.diagonal()]
    Tensor.realize(*outs)
    for o, e in zip(outs, exps):
        assert o.dtype == t.dtype and o.shape == tuple(e.shape)
        np.testing.assert_array_equal(o.float().numpy() if dt == "bfloat16" else o.numpy(),
                                      e.float().numpy() if dt == "bfloat16" else e.numpy())

def test_special_values_dont_leak():
    x = np.array([[np.nan, 1.0, np.inf], [-np.inf, 3e38, -0.0]], np.float32)
    t = Tensor(x)
    outs = [t[:, Tensor([1, 2])], t[Tensor([1, 0]), Tensor([1, 0])], t.gather(1, Tensor([[1], [1]])),
            t.scatter(1, Tensor([[0], [2]]), Tensor([[5.0], [6.0]]))]
    exp = [x[:, [1, 2]], x[[1, 0], [1, 0]], x[:, [1]], np.array([[5.0, 1.0, np.inf], [-np.inf, 3e38, 6.0]], np.float32)]
    Tensor.realize(*outs)
    for o, e in zip(outs, exp): np.testing.assert_array_equal(o.numpy(), e)

@pytest.mark.parametrize("lazy", [False, True])
def test_out_of_range_tensor_indices_read_zero_and_write_nowhere(lazy):
    # index tensors that aren't read (CHECK_OOB=0, or a lazy index under the default): out of range reads 0 and
    # writes nothing (documented); test_value_safety.py has the IndexErrors of the indices that are read
    t = Tensor(np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    def ix(data): return Tensor(data) + 0 if lazy else Tensor(data)
    with Context(CHECK_OOB=1 if lazy else 0):
        outs = [t[ix([0, 2, -3])], t[:, ix([3, -1, -4])], t.gather(1, ix([[5], [-1]])),
                t.scatter(1, ix([[7], [1]]), Tensor([[9.0], [8.0]])), ix([0, 7]).one_hot(3)]
    exp = [[[1, 2, 3], [0, 0, 0], [0, 0, 0]], [[0, 3, 0], [0, 6, 0]], [[0], [0]], [[1, 2, 3], [4, 8, 6]],
           [[1, 0, 0], [0, 0, 0]]]
    Tensor.realize(*outs)
    for o, e in zip(outs, exp): assert o.tolist() == e

def test_index_is_one_fused_kernel():
    x, i, j = Tensor(_rand(8, 9)).realize(), Tensor([[1, 7], [0, 3]]).realize(), Tensor([2, 8]).realize()
    # a fixed number of kernels whatever the sizes: the gather itself is one reduction, the index arithmetic (wrapping
    # negatives, combining two indices) may be realized first by the fusion decision
    assert len(x[i, j].schedule()) <= 3
    assert len(x.gather(0, i).schedule()) == 1
    big = Tensor.arange(200).reshape(2, 100).realize()
    assert len(x[big % 8, big % 9].schedule()) <= 3

# *** __setitem__ ***

def _setitem_cases():
    x = _rand(4, 5, 3)
    return x, [(np.s_[1], 2.5), (np.s_[:, 1:4:2], _rand(2, 1)), (np.s_[..., -1], _rand(4, 5)),
               (np.s_[[0, 3], 1], _rand(3)), (np.s_[np.array([[1], [2]]), :, np.array([0, 2])], -1.0),
               (np.s_[x > 1], 0.0), (np.s_[None, 2, [4, 0]], _rand(2, 3)), (np.s_[[1, 1, 2]], 7.0)]

def test_setitem_in_place():
    x, cases = _setitem_cases()
    for idx, v in cases:
        t = Tensor(x.copy()).realize()
        buf = t.uop
        ti = tuple(Tensor(i) if isinstance(i, np.ndarray) else i for i in (idx if isinstance(idx, tuple) else (idx,)))
        t[ti] = Tensor(v) if isinstance(v, np.ndarray) else v
        e = torch.tensor(x.copy())
        e[idx] = torch.tensor(v) if isinstance(v, np.ndarray) else v
        np.testing.assert_array_equal(t.numpy(), e.numpy())
        assert t.uop.base is buf.base  # still the same memory

def test_setitem_through_a_view_and_reading_itself():
    a = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)).realize()
    row = a[1]
    row[1:3] = -1.0
    a[0, :] = a[2]
    a[2, 1:] = a[2, :-1]
    e = np.arange(12, dtype=np.float32).reshape(3, 4)
    e[1, 1:3] = -1
    e[0, :] = e[2]
    e[2, 1:] = e[2, :-1].copy()
    np.testing.assert_array_equal(a.numpy(), e)

def test_setitem_casts_and_broadcasts_like_torch():
    a = Tensor([[1, 2, 3], [4, 5, 6]]).realize()
    a[:, 1] = Tensor([2.7, -3.9])
    a[Tensor([True, False])] = 9
    b = Tensor([1.0, 2.0, 3.0], dtype=dtypes.float16).realize()
    b[Tensor([2, 0])] = 0.1
    c = Tensor([True, False, True]).realize()
    c[1:] = Tensor([True, False])
    z = Tensor(5.0).realize()
    z[...] = 3
    d = Tensor([[1.0, 2.0]]).realize()
    d[True] = Tensor([[[5.0, 6.0]]])
    d[False] = 7.0
    e = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    e[:, 1] = torch.tensor([2.7, -3.9])
    e[torch.tensor([True, False])] = 9
    eb = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)
    eb[torch.tensor([2, 0])] = 0.1
    assert a.tolist() == e.tolist() and a.dtype == dtypes.int32
    assert b.tolist() == eb.tolist() and b.dtype == dtypes.float16
    assert c.tolist() == [True, True, False] and z.item() == 3.0 and d.tolist() == [[5.0, 6.0]]

def test_setitem_gradient():
    x, cases = _setitem_cases()
    outs, exps = [], []
    for k, (idx, v) in enumerate(cases[:-1]):  # no duplicate indices: torch's gradient there is arbitrary
        varr = np.asarray(v, np.float32)
        w = _rand(*x.shape, seed=k + 100)
        tx, tv = Tensor(x), Tensor(varr)
        y = tx * 2
        ti = tuple(Tensor(i) if isinstance(i, np.ndarray) else i for i in (idx if isinstance(idx, tuple) else (idx,)))
        y[ti] = tv * 3
        outs += [y, *(y * Tensor(w)).sum().gradient(tx, tv)]
        ex, ev = torch.tensor(x, requires_grad=True), torch.tensor(varr, requires_grad=True)
        ey = ex * 2
        ey[idx] = ev * 3
        exps += [ey.detach().numpy(), *[g.numpy() for g in torch.autograd.grad((ey * torch.tensor(w)).sum(), [ex, ev])]]
    Tensor.realize(*outs)
    for o, e in zip(outs, exps): np.testing.assert_allclose(o.numpy(), e, rtol=1e-6, atol=1e-6)

# *** splits, nonzero, one_hot, scatter_reduce, rearrange ***

def test_split_chunk():
    x = _rand(5, 7)
    t, e = Tensor(x), torch.tensor(x)
    for got, exp in [(t.split(2), e.split(2)), (t.split([3, 0, 4], dim=-1), e.split([3, 0, 4], dim=-1)),
                     (t.chunk(3, 1), e.chunk(3, 1)), (t.chunk(5), e.chunk(5)), (t.chunk(9, 0), e.chunk(9, 0)),
                     (Tensor.zeros(0, 2).split(3), torch.zeros(0, 2).split(3))]:
        assert len(got) == len(exp)
        for g, ex in zip(got, exp): np.testing.assert_array_equal(g.numpy(), ex.numpy())

def test_nonzero_masked_select_one_hot():
    x = np.array([[0.0, 1.5, 0.0], [np.nan, 0.0, -2.0]], np.float32)
    t, e = Tensor(x), torch.tensor(x)
    nz = t.nonzero()
    assert nz.dtype == dtypes.int32 and nz.tolist() == e.nonzero().tolist()
    assert t.nonzero(size=5, fill_value=-1).tolist() == e.nonzero().tolist() + [[-1, -1]] * 2
    assert Tensor(3.0).nonzero().shape == (1, 0) and Tensor.zeros(0, 4).nonzero().shape == (0, 2)
    m = Tensor(x != 0)
    np.testing.assert_array_equal(t.masked_select(m).numpy(), e.masked_select(torch.tensor(x != 0)).numpy())
    assert t.masked_select(m, size=4, fill_value=9).numpy()[3] == 9
    c = np.array([[2, 0], [1, 3]])
    oh = Tensor(c).one_hot(4)
    assert oh.dtype == dtypes.default_int == dtypes.int32
    assert oh.tolist() == torch.nn.functional.one_hot(torch.tensor(c), 4).tolist()
    assert Tensor(c).one_hot().tolist() == torch.nn.functional.one_hot(torch.tensor(c)).tolist()

@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce: str):
    x, src = _rand(4, 3), _rand(5, 3, seed=1)
    idx = np.array([[0, 1, 3], [3, 1, 0], [0, 1, 0], [2, 0, 0], [3, 3, 0]])
    outs, exps = [], []
    for inc in (True, False):
        outs.append(Tensor(x).scatter_reduce(0, Tensor(idx), Tensor(src), reduce, include_self=inc))
        exps.append(torch.tensor(x).scatter_reduce(0, torch.tensor(idx), torch.tensor(src), reduce, include_self=inc))
    ix = np.array([[5, 2, 7], [1, 4, 2]])
    outs.append(Tensor(ix).scatter_reduce(1, Tensor(idx[:2] % 2), Tensor(ix * 3), reduce))
    exps.append(torch.tensor(ix).scatter_reduce(1, torch.tensor(idx[:2] % 2), torch.tensor(ix * 3), reduce))
    Tensor.realize(*outs)
    for o, e in zip(outs, exps): np.testing.assert_allclose(o.numpy(), e.numpy(), rtol=1e-5, atol=1e-5)

def test_rearrange():
    x = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    t = Tensor(x)
    assert np.array_equal(t.rearrange("b (h w) c -> b h w c", h=2).numpy(), x.reshape(2, 2, 3, 4))
    assert np.array_equal(t.rearrange("b s c -> c (b s)").numpy(), x.transpose(2, 0, 1).reshape(4, 12))
    assert np.array_equal(t.rearrange("b (h w) c -> (c w) b h", w=3).numpy(),
                          x.reshape(2, 2, 3, 4).transpose(3, 2, 0, 1).reshape(12, 2, 2))
    assert np.array_equal(t.rearrange("b ... -> ... b").numpy(), x.transpose(1, 2, 0))
    assert t.rearrange("a b c -> a b () c").shape == (2, 6, 1, 4)
    assert t.rearrange("a b c -> a 1 (b 1 c)").shape == (2, 1, 24)
    assert Tensor.zeros(1, 3).rearrange("1 b -> b").shape == (3,)

@pytest.mark.parametrize("self_shape, mask_shape", [((6, 3, 1), (6, 3, 4)), ((3, 4), (2, 1, 4)), ((1,), (5,))])
def test_masked_fill_broadcasts_self_and_mask(self_shape, mask_shape):
    # self and mask broadcast together, as in torch and tinygrad (a mask larger than self raised)
    rng = np.random.default_rng(3)
    x, m = rng.standard_normal(self_shape).astype(np.float32), rng.random(mask_shape) < 0.5
    want = torch.from_numpy(x).masked_fill(torch.from_numpy(m), 0.5)
    got = Tensor(x).masked_fill(Tensor(m), 0.5)
    assert got.shape == tuple(want.shape)
    np.testing.assert_array_equal(got.numpy(), want.numpy())

def test_masked_fill_with_a_tensor_of_values():
    # a value tensor that broadcasts (tinygrad's documented example: one value per element)
    t, mask = Tensor([1, 2, 3, 4, 5]), Tensor([True, False, True, False, False])
    assert t.masked_fill(mask, Tensor([-1, -2, -3, -4, -5])).tolist() == [-1, 2, -3, 4, 5]

# *** errors ***

@pytest.mark.parametrize("fn, exc", [
    (lambda t: t[3], IndexError), (lambda t: t[0, -5], IndexError), (lambda t: t[0, 0, 0], IndexError),
    (lambda t: t[..., ...], IndexError), (lambda t: t[Tensor([0.5])], IndexError), (lambda t: t["a"], TypeError),
    (lambda t: t[Tensor([True, False])], IndexError), (lambda t: t[::0], ValueError),
    (lambda t: t[Tensor([0, 1]), Tensor([0, 1, 2])], IndexError),
    (lambda t: t.gather(2, Tensor([[0]])), IndexError), (lambda t: t.gather(0, Tensor([[0.0]])), TypeError),
    (lambda t: t.gather(0, Tensor([0])), ValueError), (lambda t: t.gather(0, Tensor([[0] * 5])), ValueError),
    (lambda t: t.scatter(0, Tensor([[0]]), 1.0, reduce="max"), ValueError),
    (lambda t: t.scatter_reduce(0, Tensor([[0]]), Tensor([[1.0]]), "median"), ValueError),
    (lambda t: t.masked_fill(Tensor([1, 0, 1, 1]), 0), TypeError),
    (lambda t: t.masked_fill(Tensor([True, False]), 0), ValueError),
    (lambda t: t.masked_fill(Tensor([True] * 4), Tensor([1.0, 2.0])), ValueError),
    (lambda t: t[0].tril(), ValueError), (lambda t: t.diagonal(0, 1, -1), ValueError),
    (lambda t: t.reshape(1, 3, 4).diag(), ValueError), (lambda t: t.repeat(2), ValueError),
    (lambda t: t.repeat_interleave(-1), ValueError), (lambda t: t.split([1, 1]), ValueError),
    (lambda t: t.split(0), ValueError), (lambda t: t.chunk(0), ValueError), (lambda t: t.roll((1, 2), 0), ValueError),
    (lambda t: t.one_hot(3), TypeError), (lambda t: t.rearrange("a b"), ValueError),
    (lambda t: t.rearrange("a b -> a c"), ValueError), (lambda t: t.rearrange("(a b) c -> a b c"), ValueError),
    (lambda t: t.rearrange("a b c -> a b c"), ValueError), (lambda t: t.rearrange("(a b c -> a b c"), ValueError),
])
def test_errors(fn: Callable, exc: type):
    with pytest.raises(exc): fn(Tensor(np.zeros((3, 4), np.float32)))

def test_setitem_errors():
    t = Tensor(np.zeros((3, 4), np.float32)).realize()
    with pytest.raises(ValueError, match="shape mismatch"): t[0] = Tensor([1.0, 2.0])
    with pytest.raises(IndexError): t[5] = 1.0
    p = Tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad"): p[0] = 3.0

# *** random combinations of index kinds against torch ***

def _random_index(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple:
    idx: list[Any] = []
    for s in shape:
        kind = rng.integers(6)
        if kind == 0: idx.append(int(rng.integers(-s, s)))
        elif kind == 1:
            a, b = sorted(rng.integers(-s - 1, s + 2, size=2).tolist())
            idx.append(slice(a, b, int(rng.integers(1, 4))))
        elif kind == 2: idx.append(slice(None))
        elif kind == 3: idx.append(rng.integers(-s, s, size=tuple(rng.integers(1, 3, size=int(rng.integers(1, 3))))))
        elif kind == 4: idx.append(rng.integers(-s, s, size=(2,)))
        else: idx.append(rng.random(s) > 0.5)
        if rng.random() < 0.2: idx.append(None)
    while len(idx) > 1 and rng.random() < 0.3: idx.pop()
    if rng.random() < 0.3: idx.insert(int(rng.integers(len(idx) + 1)), Ellipsis)
    return tuple(idx)

def test_random_indices_against_torch():
    rng = np.random.default_rng(0)
    outs, grads, exps = [], [], []
    while len(outs) < 30:
        shape = tuple(int(s) for s in rng.integers(1, 5, size=int(rng.integers(1, 4))))
        x = _rand(*shape, seed=len(outs))
        idx = _random_index(rng, shape)
        ex = torch.tensor(x, requires_grad=True)
        try: e = ex[tuple(torch.tensor(i) if isinstance(i, np.ndarray) else i for i in idx)]
        except (IndexError, RuntimeError): continue  # e.g. index tensors that don't broadcast together
        seed = _rand(*e.shape, seed=500 + len(outs))
        eg = torch.autograd.grad((e * torch.tensor(seed)).sum(), ex)[0] if e.numel() else torch.zeros(shape)
        t = Tensor(x)
        out = t[tuple(Tensor(i) if isinstance(i, np.ndarray) else i for i in idx)]
        outs.append(out)
        grads.append((out * Tensor(seed)).sum().gradient(t)[0] if out.numel() else Tensor.zeros(*shape))
        exps.append((idx, e.detach().numpy(), eg.numpy()))
    Tensor.realize(*[t for t in outs + grads if t.numel()])
    for o, g, (idx, e, eg) in zip(outs, grads, exps):
        assert o.shape == e.shape, idx
        np.testing.assert_array_equal(o.numpy(), e, err_msg=str(idx))
        np.testing.assert_allclose(g.numpy(), eg, rtol=1e-6, atol=1e-6, err_msg=str(idx))

def test_setitem_on_lazy_tensors_and_half_gradients():
    x = Tensor.zeros(3)
    x[0] = 1
    x[Tensor([2, -1])] = 5
    y = Tensor.arange(6).reshape(2, 3)
    y[:, 1] = -1
    h = Tensor(np.ones((2, 3), np.float16))
    g = (h.gather(1, Tensor([[0, 0], [2, 1]])) * 2).sum().gradient(h)[0]
    eh = torch.ones(2, 3, dtype=torch.float16, requires_grad=True)
    (eh.gather(1, torch.tensor([[0, 0], [2, 1]])) * 2).sum().backward()
    assert x.tolist() == [1.0, 0.0, 5.0] and y.tolist() == [[0, -1, 2], [3, -1, 5]]
    assert g.dtype == dtypes.float16 and g.tolist() == eh.grad.tolist()

def test_gather_is_built_in_output_order():
    """Integer-tensor indexing computes its gather in the output's own dim order (no permute after it), so the kernel
    stores the result contiguously (an embedding's rows row by row), and the values match NumPy for adjacent,
    non-adjacent and lower-rank broadcast indices."""
    from fusegrad.uop.ops import Ops
    x = np.arange(3 * 4 * 5 * 6, dtype=np.float32).reshape(3, 4, 5, 6)
    i2 = np.array([[0, 3], [2, 1]])
    i1 = np.array([2, 0])
    xt = Tensor(x)
    for got, want in ((xt[:, Tensor(i2)], x[:, i2]), (xt[:, Tensor(i2), Tensor(i1)], x[:, i2, i1]),
                      (xt[Tensor(i1), :, Tensor(i2)], x[i1, :, i2]), (xt[..., Tensor(i1)], x[..., i1]),
                      (Tensor(x[0, 0])[Tensor(i2)], x[0, 0][i2])):
        assert not [u for u in got.uop.toposort() if u.op is Ops.PERMUTE], got.shape
        np.testing.assert_array_equal(got.numpy(), want)
