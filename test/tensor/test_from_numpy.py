"""Tensors made from numpy arrays hold the array's values and dtype, whatever its layout: every dtype numpy and
fusegrad share, 0-d and empty arrays, strided views, big-endian bytes, and a dtype asked for."""
import numpy as np
import pytest
from fusegrad import Tensor, dtypes

_DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float16,
           np.float32, np.float64]

def _values(dt, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dt is np.bool_: return rng.random(shape) > 0.5
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dt)
    return rng.standard_normal(shape).astype(dt)

@pytest.mark.parametrize("dt", _DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (7,), (4, 5), (2, 3, 4)], ids=str)
def test_round_trip(dt, shape):
    a = _values(dt, shape)
    t = Tensor(a)
    assert t.shape == a.shape and t.numpy().dtype == a.dtype
    np.testing.assert_array_equal(t.numpy(), a)

@pytest.mark.parametrize("dt", [np.int32, np.float32, np.float64, np.bool_], ids=lambda d: np.dtype(d).name)
def test_strided_and_transposed_views(dt):
    a = _values(dt, (6, 8))
    for view in (a.T, a[::2, 1::3], a[:, ::-1], a[3]):
        np.testing.assert_array_equal(Tensor(view).numpy(), view)

def test_big_endian_and_asked_dtype():
    a = _values(np.float32, (3, 4))
    np.testing.assert_array_equal(Tensor(a.astype(">f4")).numpy(), a)
    np.testing.assert_array_equal(Tensor(a.astype(">i8").astype(">i8")).numpy(), a.astype(np.int64))
    np.testing.assert_array_equal(Tensor(a, dtype=dtypes.float16).numpy(), a.astype(np.float16))
    i = np.array([1, -2, 300], dtype=np.int32)
    assert Tensor(i, dtype=dtypes.int64).tolist() == [1, -2, 300]
    with pytest.raises(OverflowError): Tensor(i, dtype=dtypes.int8)   # (300 doesn't fit)

def test_array_is_copied_and_grad_flag_kept():
    a = _values(np.float32, (5,))
    t = Tensor(a, requires_grad=True)
    a[:] = 0   # (the tensor holds a copy)
    assert t.requires_grad is True and t.numpy().any()
    (t * t).sum().backward()
    np.testing.assert_allclose(t.grad.numpy(), 2 * t.numpy(), rtol=1e-6)

def test_unsupported_numpy_dtypes_are_refused():
    with pytest.raises(TypeError): Tensor(np.array([1 + 2j]))
    with pytest.raises(TypeError): Tensor(np.array(["a", "b"]))
