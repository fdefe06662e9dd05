"""The code generator's gather collapse (codegen/gather.py): a one-hot selection summed over the indexed dim becomes
one load, for every integer dtype of the index, with out-of-range indices reading the reduction's identity."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import GlobalCounters, Tensor, dtypes

def _select(x: np.ndarray, idx: np.ndarray, dt) -> Tensor:
    """sum_n where(idx == n, x[n], 0) written with tensor ops, the index and the positions in `dt`."""
    n = x.shape[0]
    hit = Tensor(idx, dtype=dt).unsqueeze(-1) == Tensor.arange(n).cast(dt)
    return hit.where(Tensor(x), 0).sum(-1)

@pytest.mark.parametrize("dt", [dtypes.uint8, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint32])
def test_selection_is_one_load_for_every_index_dtype(dt):
    n = 100
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    lo = dtypes.min(dt)
    raw = [0, 5, 99, 100, 127] + ([-1, -5, lo] if lo < 0 else [200])
    idx = np.array(raw)
    want = np.array([x[i] if 0 <= i < n else 0.0 for i in idx], np.float32)
    GlobalCounters.reset()
    got = _select(x, idx, dt).numpy()
    np.testing.assert_array_equal(got, want)
    # one selection per output element, not one compare per position of the indexed dim
    assert GlobalCounters.global_ops < 20 * len(idx)

def test_int8_positions_of_a_dim_past_its_range():
    # 128 positions compared in int8 (every int8 value is below 128): the bound check is the lower one alone
    x = np.arange(128, dtype=np.float32) + 1
    idx = np.array([0, 127, -1, -128, 64])
    want = np.array([x[i] if i >= 0 else 0.0 for i in idx], np.float32)
    np.testing.assert_array_equal(_select(x, idx, dtypes.int8).numpy(), want)
