"""Sums past float32's 2^24 and indices past int32's 2^31, against float64 NumPy and Python's integers."""
import numpy as np
import pytest
from fusegrad import Tensor, dtypes

N = 10**6 + 1   # no vector width divides it: one scalar accumulator per row unless the sum is blocked

def _rel_err(got, x: np.ndarray, axis=None) -> float:
    """The error of a sum of x over axis, relative to the sum of |x| (the scale its rounding errors have)."""
    x64 = x.astype(np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - x64.sum(axis)) / np.abs(x64).sum(axis)))

def _values(kind: str, shape, seed: int = 0) -> np.ndarray:
    if kind == "tenths": return np.full(shape, 0.1, np.float32)
    return (np.random.default_rng(seed).standard_normal(shape) + 1).astype(np.float32)   # (a drifting sum)

# *** float sums ***

def test_sum_of_ones_past_2_24():
    # 2^25 + 3 rounds to 2^25 + 4 in float32 (numpy's float32 sum); an accumulator alone stops at 2^24
    assert Tensor.ones(2**25 + 3).sum().item() == float(np.float32(2**25 + 3)) == 33554436.0
    assert Tensor.ones(2**25 + 1).mean().item() == 1.0

@pytest.mark.parametrize("kind", ["tenths", "normal"])
def test_full_sum(kind):
    x = _values(kind, N)
    assert _rel_err(Tensor(x).sum().item(), x) < 1e-5
    assert abs(Tensor(x).mean().item() - x.astype(np.float64).mean()) <= 1e-5 * np.abs(x.astype(np.float64)).mean()

@pytest.mark.parametrize("kind", ["tenths", "normal"])
def test_row_sums(kind):
    x = _values(kind, (3, N))
    assert _rel_err(Tensor(x).sum(1).numpy(), x, 1) < 1e-5

@pytest.mark.parametrize("kind", ["tenths", "normal"])
def test_column_sums(kind):
    x = _values(kind, (N, 3))
    assert _rel_err(Tensor(x).sum(0).numpy(), x, 0) < 1e-5

def test_sum_over_two_axes():
    x = _values("tenths", (3, 1001, 999))
    assert _rel_err(Tensor(x).sum((1, 2)).numpy(), x, (1, 2)) < 1e-5
    x = _values("tenths", (5, 1001, 99))
    assert _rel_err(Tensor(x).sum((0, 1)).numpy(), x, (0, 1)) < 1e-5

def test_sum_in_chunks_split_across_cores():
    # a big sum to one number is partial sums of 64 chunks first (one per core's share), 65537 terms each
    x = _values("tenths", 64 * 65537)
    assert _rel_err(Tensor(x).sum().item(), x) < 1e-5

def test_vectorized_row_sums():
    x = _values("tenths", (4, 2**20))
    assert _rel_err(Tensor(x).sum(1).numpy(), x, 1) < 1e-5

def test_variance_of_long_rows():
    x = _values("normal", (2, N)) + 3
    np.testing.assert_allclose(Tensor(x).var(1).numpy(), x.astype(np.float64).var(1, ddof=1), rtol=1e-5)

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_half_sums_accumulate_in_float32(dt):
    x = Tensor(_values("tenths", (2, N))).cast(dt)
    exact = x.float().numpy().astype(np.float64)   # the values as rounded to half precision
    assert _rel_err(x.sum(1, dtype=dtypes.float32).numpy(), exact, 1) < 1e-5
    # the sum's own dtype: the float32 sum rounded once (half's largest finite is 65504: 1e5 would be inf)
    got = (x * 0.5).sum(1).float().numpy() if dt == dtypes.float16 else x.sum(1).float().numpy()
    want = (exact * (0.5 if dt == dtypes.float16 else 1)).sum(1)
    ulp = 2.0 ** (np.floor(np.log2(want)) - (10 if dt == dtypes.float16 else 7))
    assert np.all(np.abs(got - want) <= ulp)

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_half_mean_of_a_sum_past_its_range(dt):
    # torch divides the float32 sum: 2^20 halves of 1 sum to 1048576, which half can't hold
    assert Tensor.ones(2**20, dtype=dt).mean().item() == 1.0
    x = Tensor(_values("normal", (2, N)) + 8).cast(dt)
    want = x.float().numpy().astype(np.float64).mean(1)
    np.testing.assert_allclose(x.mean(1).float().numpy(), want, rtol=2.0 ** -7)

def test_max_and_integer_sums_stay_exact():
    # (rounding is monotone: the largest of the float32 values of 0..n-1 is that of n-1)
    assert Tensor.arange(2**25 + 3, dtype=dtypes.float32).max().item() == float(np.float32(2**25 + 2))
    assert Tensor.ones(2**25 + 3, dtype=dtypes.int32).sum().item() == 2**25 + 3

@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tenths", "normal"])
@pytest.mark.parametrize("shape,axis", [((2**25 + 1,), None), ((4, 2**23 + 1), 1), ((2**23 + 1, 4), 0)])
def test_sums_past_2_25(kind, shape, axis):
    x = _values(kind, shape)
    assert _rel_err(Tensor(x).sum(axis).numpy(), x, axis) < 1e-5

@pytest.mark.slow
@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_half_sums_past_2_25(dt):
    x = Tensor(_values("normal", 2**25 + 1)).cast(dt)
    exact = x.float().numpy()
    assert _rel_err(x.sum(dtype=dtypes.float32).item(), exact) < 1e-5

# *** 64-bit indices ***

def test_arange_int64_past_int32():
    n = 2**31 + 10
    t = Tensor.arange(n, dtype=dtypes.int64)
    assert t[-1].item() == n - 1
    assert t[2**31 - 2:2**31 + 2].tolist() == [2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1]
    assert Tensor.arange(2**32 + 5, dtype=dtypes.int64)[2**32 + 1].item() == 2**32 + 1
    # a value made from the index in int64 arithmetic
    assert (Tensor.arange(n, dtype=dtypes.int64)[-3:] * 3 + 1).tolist() == [3 * v + 1 for v in range(n - 3, n)]
    assert Tensor.arange(10, n, 2**30, dtype=dtypes.int64).tolist() == list(range(10, n, 2**30))

def test_arange_int32_stays_int32():
    # below 2^31 elements the index is an int32, as before
    t = Tensor.arange(2**31 - 1, 2**31 - 4, -1, dtype=dtypes.int32)
    assert t.tolist() == [2**31 - 1, 2**31 - 2, 2**31 - 3]

@pytest.mark.slow
def test_uint8_buffer_past_2_31():
    n = 2**31 + 16
    t = (Tensor.arange(n, dtype=dtypes.int64) % 251).cast(dtypes.uint8).contiguous().realize()
    want = lambda lo, hi: [i % 251 for i in range(lo, hi)]
    assert t[-5:].tolist() == want(n - 5, n)
    assert t[2**31 - 2:2**31 + 2].tolist() == want(2**31 - 2, 2**31 + 2)
    assert t.shrink(((n - 300, n - 290),)).contiguous().tolist() == want(n - 300, n - 290)
    assert t[n - 1].item() == (n - 1) % 251
    assert t.reshape(2, n // 2)[1, -3:].tolist() == want(n - 3, n)
    assert t.reshape(2, n // 2)[:, -1].tolist() == [(n // 2 - 1) % 251, (n - 1) % 251]
    assert t.cast(dtypes.int64).sum().item() == sum(range(251)) * (n // 251) + sum(range(n % 251))

@pytest.mark.slow
def test_uint8_buffer_of_3_gb():
    n = 3 * 2**30 + 7
    t = Tensor.full(n, 7, dtype=dtypes.uint8).contiguous().realize()
    t[n - 3:] = Tensor([1, 2, 3], dtype=dtypes.uint8)
    assert t[-4:].tolist() == [7, 1, 2, 3]
    assert t.flip(0)[:3].tolist() == [3, 2, 1]
    assert t.max().item() == 7 and t.min().item() == 1

def test_sums_of_symbolic_length():
    # one kernel for every length up to 10^6: its blocks are loops of symbolic counts, some of them empty
    from fusegrad import Variable
    n = Variable("n", 1, 10**6)
    x = _values("tenths", (10**6, 3))
    xt = np.ascontiguousarray(x.T)
    for v in (10**6 - 7, 4097, 64, 3):
        assert _rel_err(Tensor(x)[:n.bind(v)].sum(0).numpy(), x[:v], 0) < 1e-5
        assert _rel_err(Tensor(xt)[:, :n.bind(v)].sum(1).numpy(), xt[:, :v], 1) < 1e-5
        assert _rel_err(Tensor(x[:, 0].copy())[:n.bind(v)].sum().item(), x[:v, 0]) < 1e-5
