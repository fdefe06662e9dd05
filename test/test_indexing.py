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

torch.set_num_threads(1)

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
