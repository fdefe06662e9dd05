"""Setitem with tensor indices: values against torch, and the work of its kernels (GlobalCounters), not time.

A setitem with tensor indices over whole dims scatters over the indexed dims alone: its work is bounded by
(the other dims' elements) x (the index's elements) x (the indexed dims' elements), not by the whole tensor's
elements times the written elements."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.engine.realize import GlobalCounters

def _both(shape, idx, vals, dt=np.float32):
    """(fusegrad's result, torch's) of base[idx] = vals on a realized tensor; idx is a function of a tensor maker."""
    base = np.arange(np.prod(shape)).reshape(shape).astype(dt)
    t, tt = Tensor(base).contiguous().realize(), torch.tensor(base)
    t[idx(Tensor)] = Tensor(np.asarray(vals, dt))
    tt[idx(torch.tensor)] = torch.tensor(np.asarray(vals, dt))
    return t.numpy(), tt.numpy()

@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int32, np.int64, np.uint8, np.int8, np.float64, np.bool_])
def test_values_against_torch(dt):
    rng = np.random.default_rng(1)
    cases = [  # (shape, index, value shape): duplicates (the last wins, as torch on the CPU), negatives, broadcasting
        ((5, 6), lambda T: (slice(None), T([0, 2, 2, -1])), (5, 4)),
        ((5, 6, 7), lambda T: (T([[0], [3]]), slice(None), T([1, 2, 1])), (2, 3, 6)),
        ((5, 6, 7), lambda T: (slice(None), T([[0], [3]]), T([1, -2, 1])), (3,)),
        ((4, 3, 5, 2), lambda T: (T([1, 1, 0]), slice(None), T([4, -1, 4]), slice(None)), (3, 1, 2)),
        ((6,), lambda T: T([5, 0, 5, -6]), ()),
    ]
    for shape, idx, vshape in cases:
        vals = rng.integers(0, 2, vshape) if dt is np.bool_ else rng.integers(-50, 50, vshape) if \
            np.issubdtype(dt, np.signedinteger) else rng.integers(0, 200, vshape)
        got, want = _both(shape, idx, vals, dt)
        np.testing.assert_array_equal(got, want)

def test_out_of_range_indices_still_raise():
    t = Tensor.zeros(3, 4).contiguous().realize()
    with pytest.raises(IndexError, match="out of bounds"): t[:, Tensor([0, 4])] = Tensor([1.0, 2.0])
    with pytest.raises(IndexError, match="out of bounds"): t[:, [0, -5]] = 1.0

def test_work_is_bounded_by_the_indexed_dims():
    # rest = 4 * 6 * 5 elements, an index of 4 * 6 = 24 entries over 20 * 40 = 800 positions
    t = Tensor.zeros(4, 20, 6, 40, 5, dtype=dtypes.int).contiguous().realize()
    i0, i1 = Tensor([5, 3, 7, 8]).realize(), Tensor([[[0], [1], [2]], [[3], [4], [5]]]).realize()
    v = Tensor.arange(2 * 3 * 4 * 4 * 6 * 5).reshape(2, 3, 4, 4, 6, 5).contiguous().realize()
    GlobalCounters.reset()
    t[:, i0, :, i1, :] = v
    t.realize()
    rest, index, positions = 4 * 6 * 5, 24, 800
    assert GlobalCounters.global_ops < 40 * rest * index * positions
    # the scatter into the flattened tensor did several ops per pair of (element, written element)
    assert GlobalCounters.global_ops < (4 * 20 * 6 * 40 * 5) * (2 * 3 * 4 * 4 * 6 * 5) / 10
    tt = torch.zeros(4, 20, 6, 40, 5, dtype=torch.int32)
    tt[:, torch.tensor([5, 3, 7, 8]), :, torch.tensor([[[0], [1], [2]], [[3], [4], [5]]]), :] = \
        torch.arange(2 * 3 * 4 * 4 * 6 * 5, dtype=torch.int32).reshape(2, 3, 4, 4, 6, 5)
    np.testing.assert_array_equal(t.numpy(), tt.numpy())

def test_linear_index_past_int32_is_int64():
    # dims of 70000 x 70000 positions: an int32 linear index would wrap (to another position, or -1: nowhere)
    from fusegrad.tensor.indexing import _flat_position
    i, j = Tensor([69999, 1], dtype=dtypes.int32), Tensor([69999, 2], dtype=dtypes.int32)
    lin = _flat_position((70000, 70000), [i, j], (2,), wrap=True)
    assert lin.dtype == dtypes.int64
    assert lin.tolist() == [69999 * 70000 + 69999, 70000 + 2]
    assert _flat_position((70000, 3), [i, j], (2,), wrap=True).tolist() == [-1, 1 * 3 + 2]
