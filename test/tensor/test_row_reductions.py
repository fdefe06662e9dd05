"""Row reductions that keep several vector accumulators per row (max, sums, argmax, and softmax, log_softmax and
layernorm, which hold two or three reductions per row), checked against torch and NumPy: long rows, rows no vector
width divides (padded), short rows, and rows holding nan, -inf or +inf, whose results must be what torch gives."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.tensor.extras import EmptyReductionError

# 1024: 4 accumulators of whole vectors; 1000 and 1030: vectors that no group of 4 divides; 2053 (prime): padded to
# whole groups of vectors; 36 and 7: short rows
COLS = (1024, 1000, 1030, 2053, 36, 7)

def rows(cols: int) -> np.ndarray:
    """Six rows: random values, a nan (in the last columns, where padding and the last accumulator meet), all -inf,
    -inf and +inf among random values, a nan in the first column, and a max repeated (argmax takes the first)."""
    x = np.random.default_rng(cols).standard_normal((6, cols)).astype(np.float32)
    x[1, cols - 1] = np.nan
    x[2] = -np.inf
    x[3, cols // 3], x[3, cols // 2] = -np.inf, np.inf
    x[4, 0] = np.nan
    x[5, cols // 4] = x[5, cols - 1] = 100.0
    return x

@pytest.mark.parametrize("cols", COLS)
def test_max_min_argmax_like_torch(cols: int):
    x = rows(cols)
    t = torch.from_numpy(x)
    np.testing.assert_array_equal(Tensor(x).max(axis=1).numpy(), t.amax(1).numpy())
    np.testing.assert_array_equal(Tensor(x).min(axis=1).numpy(), t.amin(1).numpy())
    np.testing.assert_array_equal(Tensor(x).argmax(axis=1).numpy(), t.argmax(1).numpy())
    np.testing.assert_array_equal(Tensor(x).argmin(axis=1).numpy(), t.argmin(1).numpy())
    assert np.isnan(Tensor(x).max(axis=1).numpy()[[1, 4]]).all()

@pytest.mark.parametrize("cols", COLS)
def test_softmax_and_log_softmax_like_torch(cols: int):
    x = rows(cols)
    t = torch.from_numpy(x).double()
    for ours, theirs in ((Tensor(x).softmax(-1), t.softmax(-1)), (Tensor(x).log_softmax(-1), t.log_softmax(-1))):
        got, exp = ours.numpy(), theirs.numpy()
        # (the same rows nan: the nan rows, the all -inf row, and the +inf row, whose inf - inf is nan)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(exp))
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("cols", COLS)
def test_sums_and_layernorm_like_numpy(cols: int):
    x = np.random.default_rng(cols + 1).standard_normal((5, cols)).astype(np.float32) + 3
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(Tensor(x).sum(axis=1).numpy(), x64.sum(1), rtol=1e-5)
    exp = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(Tensor(x).layernorm(-1).numpy(), exp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(Tensor(x).mean(axis=1).numpy(), x64.mean(1), rtol=1e-5)
    np.testing.assert_allclose(Tensor(x).var(axis=1).numpy(), x64.var(1, ddof=1), rtol=1e-4)

def test_whole_tensor_max_with_nan_and_inf():
    x = np.random.default_rng(3).standard_normal(1 << 18).astype(np.float32)
    assert Tensor(x).max().item() == x.max()
    x[12345] = np.inf
    assert Tensor(x).max().item() == np.inf
    x[(1 << 18) - 1] = np.nan
    assert np.isnan(Tensor(x).max().item())
    assert Tensor(x).argmax().item() == torch.from_numpy(x).argmax().item()

def test_empty_rows():
    x = np.zeros((3, 0), np.float32)
    np.testing.assert_array_equal(Tensor(x).sum(axis=1).numpy(), np.zeros(3, np.float32))
    assert Tensor(x).softmax(-1).numpy().shape == (3, 0)
    with pytest.raises(EmptyReductionError, match="empty dimension"): Tensor(x).max(axis=1)
    with pytest.raises(EmptyReductionError, match="empty dimension"): Tensor(x).argmax(axis=1)
