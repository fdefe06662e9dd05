"""Reading a tensor's values (numpy, tolist, item) for every dtype, against NumPy: realized plain tensors are copied
straight out of their buffer, everything else (views, lazy tensors) is computed first."""
import numpy as np
import pytest
from fusegrad import GlobalCounters, Tensor, dtypes
from fusegrad.uop.ops import UOpMetaClass

INTS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
FLOATS = [np.float16, np.float32, np.float64]

def sample(npdt, shape, seed=0) -> np.ndarray:
    """Values of `npdt` covering its extremes (ints) or its signs, zeros and fractions (floats)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if npdt is np.bool_: return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    if npdt in INTS:
        info = np.iinfo(npdt)
        vals = rng.integers(info.min, info.max, n, dtype=npdt, endpoint=True)
        vals[:2] = [info.min, info.max][:n]
        return vals.reshape(shape)
    vals = (rng.standard_normal(n) * 100).astype(npdt)
    vals[:2] = [-0.0, 0.5][:n]
    return vals.reshape(shape)

def flat(x) -> list: return [z for y in x for z in flat(y)] if isinstance(x, list) else [x]

@pytest.mark.parametrize("npdt", [np.bool_, *INTS, *FLOATS])
@pytest.mark.parametrize("shape", [(10,), (3, 4), (), (1,), (2, 1, 3)])
def test_realized_values(npdt, shape):
    ref = sample(npdt, shape)
    t = Tensor(ref).realize()
    out = t.numpy()
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)
    # the bits too: -0.0 stays -0.0
    assert out.tobytes() == ref.tobytes()
    lst = t.tolist()
    assert lst == ref.tolist()
    assert [type(v) for v in flat(lst)] == [type(v) for v in flat(ref.tolist())]  # Python bools, ints, floats
    if ref.size == 1:
        assert t.item() == ref.item() and type(t.item()) is type(ref.item())

@pytest.mark.parametrize("npdt", [np.bool_, np.int32, np.uint64, np.float16, np.float64])
def test_empty(npdt):
    for shape in [(0,), (2, 0), (0, 3, 1)]:
        t = Tensor(np.zeros(shape, npdt)).realize()
        out = t.numpy()
        assert out.shape == shape and out.dtype == np.dtype(npdt)
        assert t.tolist() == np.zeros(shape, npdt).tolist()
    with pytest.raises(ValueError, match="one element"): Tensor(np.zeros((0,), npdt)).item()
    with pytest.raises(ValueError, match="one element"): Tensor(np.zeros((2,), npdt)).realize().item()

def test_bfloat16():
    # bfloat16 values are widened to float32 (numpy has none): exact, as every bfloat16 is a float32
    ref = np.array([1.5, -2.0, 0.0, 3.140625, -2.0 ** 100, 65280.0], np.float32)
    t = Tensor(ref, dtype=dtypes.bfloat16).realize()
    out = t.numpy()
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(t.reshape(2, 3).numpy(), ref.reshape(2, 3))
    assert t.tolist() == ref.tolist()
    assert t[1].item() == -2.0

def test_realized_read_makes_no_node():
    t = Tensor(np.arange(6, dtype=np.float32)).reshape(2, 3).contiguous().realize()
    one = Tensor(np.array([7], np.int64)).realize()
    t.numpy(), one.item(), t.tolist()   # (anything made once is made now)
    nodes, kernels = len(UOpMetaClass.ucache), GlobalCounters.kernel_count
    for _ in range(3):
        np.testing.assert_array_equal(t.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert one.item() == 7 and t.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert len(UOpMetaClass.ucache) == nodes and GlobalCounters.kernel_count == kernels

@pytest.mark.parametrize("npdt", [np.bool_, np.int8, np.uint16, np.int64, np.float16, np.float32])
def test_views_and_lazy(npdt):
    # views of a realized tensor and lazy tensors take the general path: computed, then read
    ref = sample(npdt, (4, 6), seed=1)
    t = Tensor(ref).realize()
    np.testing.assert_array_equal(t.T.numpy(), ref.T)
    np.testing.assert_array_equal(t[1:3, ::2].numpy(), ref[1:3, ::2])
    np.testing.assert_array_equal(t[2].numpy(), ref[2])
    np.testing.assert_array_equal(t.reshape(24)[5:6].numpy(), ref.reshape(24)[5:6])
    assert t.T.tolist() == ref.T.tolist()
    assert t[3, 5].item() == ref[3, 5].item()
    assert t.flip(0).tolist() == ref[::-1].tolist()
    np.testing.assert_array_equal(t.expand(2, 4, 6).numpy(), np.broadcast_to(ref, (2, 4, 6)))

def test_values_written_by_a_queued_kernel():
    # a kernel big enough to be queued on the pool: reading its output waits for it
    a = np.random.default_rng(2).standard_normal((512, 1024)).astype(np.float32)
    x = Tensor(a).realize()
    for i in range(3):
        y = (x * (i + 2) + 1).realize()
        np.testing.assert_allclose(y.numpy(), a * (i + 2) + 1, rtol=1e-6)
        assert y[-1, -1].item() == pytest.approx(float(a[-1, -1] * (i + 2) + 1), rel=1e-6)

def test_after_assign():
    t = Tensor(np.zeros((2, 3), np.float32)).realize()
    t.assign(Tensor(np.full((2, 3), 4.0, np.float32)))
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 4.0, np.float32))
    t.assign(t + 1).realize()
    assert t.tolist() == [[5.0] * 3] * 2
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 5.0, np.float32))

def test_copy_is_independent():
    # the array is a copy: later writes to the tensor don't show in it, writes to it don't reach the tensor
    t = Tensor(np.ones(4, np.float32)).realize()
    out = t.numpy()
    out[0] = 9.0
    t.assign(Tensor(np.full(4, 2.0, np.float32))).realize()
    np.testing.assert_array_equal(out, [9.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(t.numpy(), np.full(4, 2.0, np.float32))

def test_buffer_numpy_shape_checked():
    buf = Tensor(np.arange(6, dtype=np.int32)).realize().uop.buffer
    np.testing.assert_array_equal(buf.numpy((2, 3)), np.arange(6, dtype=np.int32).reshape(2, 3))
    with pytest.raises(ValueError, match="shape"): buf.numpy((4,))

@pytest.mark.parametrize("npdt", [np.bool_, np.int8, np.uint64, np.float16, np.float64])
def test_other_device(npdt):
    # the copy out of another device's memory (the PYTHON emulator's allocator), after a kernel there
    ref = sample(npdt, (3, 5), seed=3)
    t = Tensor(ref, device="PYTHON").realize()
    np.testing.assert_array_equal(t.numpy(), ref)
    assert t.tolist() == ref.tolist() and t[2, 4].item() == ref[2, 4].item()
    if npdt is not np.bool_:
        np.testing.assert_array_equal((t * 1).realize().numpy(), ref)
