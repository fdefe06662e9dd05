"""Values that don't fit their dtype, arrays in a foreign byte order, out-of-range tensor indices and sizes no device
can hold: each is refused with a clear exception or handled exactly, never a silently wrong result."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes, nn
from fusegrad.device import Device
from fusegrad.dtype import to_torch_dtype
from fusegrad.helpers import Context

def torch_raises(fn) -> bool:
    try: fn()
    except (RuntimeError, OverflowError, ValueError, IndexError): return True
    return False

# *** Python numbers that don't fit the dtype ***

# (value, dtype): torch refuses each of these at creation
TOO_BIG = [(2**31, dtypes.int32), (-2**31 - 1, dtypes.int32), (300, dtypes.uint8), (128, dtypes.int8),
           (-129, dtypes.int8), (70000, dtypes.int16), (2**63, dtypes.int64), (2**64, dtypes.uint64),
           (-1, dtypes.uint64), (1e40, dtypes.int32), (float("nan"), dtypes.int32), (float("inf"), dtypes.int64),
           (-float("inf"), dtypes.int16)]

@pytest.mark.parametrize("value,dt", TOO_BIG)
def test_list_creation_refuses_what_torch_refuses(value, dt):
    assert torch_raises(lambda: torch.tensor([value], dtype=to_torch_dtype(dt)))
    with pytest.raises(OverflowError, match=dt.__repr__().split(".")[1]):
        Tensor([1, value], dtype=dt)
    with pytest.raises(OverflowError): Tensor(value, dtype=dt)

@pytest.mark.parametrize("value,dt", TOO_BIG)
def test_full_refuses_what_torch_refuses(value, dt):
    # (torch.full wraps a negative into an unsigned dtype: see test_negative_into_unsigned_is_refused_not_wrapped)
    if not (value == -1 and dt in dtypes.uints):
        assert torch_raises(lambda: torch.full((2,), value, dtype=to_torch_dtype(dt)))
    with pytest.raises(OverflowError): Tensor.full((2,), value, dtype=dt)
    with pytest.raises(OverflowError): Tensor.zeros(2, dtype=dt).full_like(value)

def test_negative_into_unsigned_is_refused_not_wrapped():
    # torch wraps -1 to 255 here; NumPy 2 refuses it, and a wrapped value at creation is never what was meant
    assert torch.tensor([-1], dtype=torch.uint8).tolist() == [255]
    with pytest.raises(OverflowError, match="-1"): np.array([-1], dtype=np.uint8)
    with pytest.raises(OverflowError, match="-1"): Tensor([-1], dtype=dtypes.uint8)
    with pytest.raises(OverflowError): Tensor.full((3,), -1, dtype=dtypes.uint16)
    with pytest.raises(OverflowError): Tensor.zeros(3, dtype=dtypes.uint8).full_like(-1)

@pytest.mark.parametrize("value,dt", [(2**31 - 1, dtypes.int32), (-2**31, dtypes.int32), (255, dtypes.uint8),
                                      (2**64 - 1, dtypes.uint64), (-2**63, dtypes.int64), (2**63 - 1, dtypes.int64),
                                      (3.7, dtypes.int32), (-3.7, dtypes.int8), (True, dtypes.int32),
                                      (5, dtypes.bool)])
def test_edges_that_fit(value, dt):
    want = torch.tensor([value, value], dtype=to_torch_dtype(dt)).tolist()
    assert Tensor([value, value], dtype=dt).tolist() == want
    assert Tensor.full((2,), value, dtype=dt).tolist() == want
    assert Tensor(value, dtype=dt).item() == want[0]

def test_inferred_int_dtype_widens_to_int64():
    # torch infers int64 for every int list; the default int here is int32, widened where a value needs it
    for data in ([2**31], [-2**31 - 1, 0], [1, 2**63 - 1], [[1, 2], [3, 2**40]]):
        t = Tensor(data)
        assert t.dtype == dtypes.int64
        assert t.tolist() == torch.tensor(data).tolist()
    assert Tensor([1, 2]).dtype == dtypes.int32
    assert Tensor(2**40).item() == 2**40 and Tensor(2**40).dtype == dtypes.int64
    assert Tensor.full((2,), 2**40).tolist() == torch.full((2,), 2**40).tolist()
    assert Tensor.arange(2**31, 2**31 + 3).tolist() == torch.arange(2**31, 2**31 + 3).tolist()

@pytest.mark.parametrize("data", [[2**70], [2**63], [1, -2**63 - 1], 2**64])
def test_ints_no_dtype_holds_are_refused(data):
    assert torch_raises(lambda: torch.tensor(data))
    with pytest.raises(OverflowError, match="int64"): Tensor(data)

def test_floats_beyond_a_float_dtype_round_to_inf_as_torch():
    for v, dt in ((1e6, dtypes.float16), (1e300, dtypes.float32), (-1e40, dtypes.float32), (2**200, dtypes.float32)):
        want = torch.tensor([v], dtype=to_torch_dtype(dt)).tolist()
        assert Tensor([v], dtype=dt).tolist() == want
    assert Tensor([2, 3.5, 2**70]).tolist() == torch.tensor([2, 3.5, 2**70]).tolist()
    with pytest.raises(OverflowError): Tensor([2**1100], dtype=dtypes.float64)

def test_numpy_array_cast_to_a_narrower_int_refuses_what_wraps():
    with pytest.raises(OverflowError, match="int32"): Tensor(np.array([1, 2**40]), dtype=dtypes.int32)
    with pytest.raises(OverflowError): Tensor(np.array([np.nan, 1.0]), dtype=dtypes.int64)
    with pytest.raises(OverflowError): Tensor(np.array([-1, 2], dtype=np.int16), dtype=dtypes.uint8)
    a = np.array([[-7, 300], [5, 2**20]], dtype=np.int64)
    assert Tensor(a, dtype=dtypes.int32).tolist() == a.astype(np.int32).tolist()
    f = np.array([1.9, -2.9, 1e30], dtype=np.float64)
    assert Tensor(f, dtype=dtypes.float32).numpy().tolist() == f.astype(np.float32).tolist()

# arithmetic with Python ints: torch wraps the operand within int64 (1 + 2**40 in int32 is 1) and refuses beyond it;
# NumPy 2 refuses every operand its dtype can't hold. A wrapped operand is a silently wrong result, so it is refused.
@pytest.mark.parametrize("dt,value", [(dtypes.int32, 2**40), (dtypes.int32, 2**31), (dtypes.int32, -2**31 - 1),
                                      (dtypes.uint8, -1), (dtypes.uint8, 256), (dtypes.int8, 200),
                                      (dtypes.int16, 70000), (dtypes.int64, 2**63), (dtypes.uint64, 2**64),
                                      (dtypes.uint32, -5)])
def test_scalar_operand_that_doesnt_fit_is_refused(dt, value):
    npdt = np.dtype(dt.__repr__().split(".")[1])
    with pytest.raises(OverflowError): np.array([1], dtype=npdt) + value
    x = Tensor([1, 2], dtype=dt)
    for op in (lambda: x + value, lambda: value + x, lambda: x - value, lambda: value - x, lambda: x * value,
               lambda: x // value, lambda: x % value, lambda: x & value, lambda: x | value, lambda: x ^ value,
               lambda: x.maximum(value), lambda: x.minimum(value), lambda: x.where(x, value)):
        with pytest.raises(OverflowError, match=str(value)): op()

@pytest.mark.parametrize("dt,value", [(dtypes.int32, 2**40), (dtypes.int32, -2**40), (dtypes.int8, 2**70),
                                      (dtypes.uint8, -1), (dtypes.uint8, 256), (dtypes.int64, 2**63),
                                      (dtypes.uint64, -2**64)])
def test_comparison_with_an_int_beyond_the_dtype_is_by_value(dt, value):
    # NumPy 2 compares by value (torch wraps the int: int32 1 < 2**40 is False there)
    a = np.array([0, 1, 100], dtype=np.dtype(dt.__repr__().split(".")[1]))
    x = Tensor(a)
    out = [x < value, x <= value, x > value, x >= value, x == value, x != value, value < x, value >= x]
    want = [a < value, a <= value, a > value, a >= value, a == value, a != value, value < a, value >= a]
    Tensor.realize(*out)
    for o, w in zip(out, want): assert o.tolist() == w.tolist()

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.uint8, dtypes.int64, dtypes.bool])
@pytest.mark.parametrize("value", [2**40, -1, 2**63, -2**70])
def test_true_division_by_an_int_beyond_the_dtype_as_torch(dt, value):
    # true division is a float operation: the int is divided as a float, as in torch (not refused, not wrapped)
    x = Tensor([1, 0, 1], dtype=dt)
    np.testing.assert_allclose((x / value).numpy(), [v / value for v in (1, 0, 1)], rtol=1e-6)
    if abs(value) < 2**63:
        tx = torch.tensor([1, 0, 1], dtype=to_torch_dtype(dt))
        np.testing.assert_allclose((x / value).numpy(), (tx / value).numpy(), rtol=1e-6)
        np.testing.assert_allclose((value / x).numpy(), (value / tx).numpy(), rtol=1e-6)

def test_where_and_clamp_refuse_as_torch():
    x = torch.tensor([1], dtype=torch.int32)
    assert torch_raises(lambda: torch.where(torch.tensor([True]), x, 2**40))
    assert torch_raises(lambda: x.clamp(0, 2**40))
    t = Tensor([1], dtype=dtypes.int32)
    with pytest.raises(OverflowError): Tensor([True]).where(t, 2**40)
    with pytest.raises(OverflowError): t.clamp(0, 2**40)
    with pytest.raises(OverflowError): t.masked_fill(Tensor([True]), 2**40)

def test_scalar_operands_that_fit_match_torch():
    for dt, value in ((dtypes.int32, 2**31 - 1), (dtypes.uint8, 255), (dtypes.int8, -128), (dtypes.int64, -2**63),
                      (dtypes.uint64, 2**64 - 1), (dtypes.int32, 2.5)):
        x = Tensor([0, 1], dtype=dt)
        tx = torch.tensor([0, 1], dtype=to_torch_dtype(dt))
        if dt == dtypes.uint64: assert (x + value).tolist() == [2**64 - 1, 0]
        else: assert (x + value).tolist() == pytest.approx((tx + value).tolist())
        assert (x * 1).tolist() == tx.tolist()
    # results that overflow from operands that fit wrap, as in torch and NumPy
    assert (Tensor([200], dtype=dtypes.uint8) + 100).tolist() == (torch.tensor([200], dtype=torch.uint8) + 100).tolist()
    assert (Tensor([2**31 - 1], dtype=dtypes.int32) + 1).tolist() == [-2**31]

# *** NumPy arrays in another byte order ***

@pytest.mark.parametrize("npdt", ["i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8"])
@pytest.mark.parametrize("order", [">", "<"])
def test_numpy_byte_orders(npdt, order):
    a = np.array([[1, 2, 3], [100, 7, 0]], dtype=order + npdt)
    t = Tensor(a)
    assert t.dtype.itemsize == a.dtype.itemsize
    np.testing.assert_array_equal(t.numpy(), a)
    # non-contiguous and in another byte order at once
    np.testing.assert_array_equal(Tensor(a.T).numpy(), a.T)
    np.testing.assert_array_equal(Tensor(a[:, ::2]).numpy(), a[:, ::2])
    np.testing.assert_array_equal(Tensor(a, dtype=dtypes.float64).numpy(), a.astype(np.float64))

def test_numpy_byte_order_scalars_and_empty():
    np.testing.assert_array_equal(Tensor(np.array(2.5, dtype=">f8")).numpy(), 2.5)
    assert Tensor(np.array([], dtype=">i4")).shape == (0,)
    assert Tensor(np.array([True, False], dtype="|b1")).tolist() == [True, False]

# *** out-of-range tensor indices ***

def test_setitem_out_of_range_tensor_index_raises():
    t = Tensor.zeros(5).contiguous().realize()
    with pytest.raises(IndexError, match="index 9 is out of bounds for dimension 0 with size 5"):
        t[Tensor([9])] = 1.0
    assert t.tolist() == [0.0] * 5
    with pytest.raises(IndexError, match="-6"): t[Tensor([-6])] = 1.0
    tt = torch.zeros(5)
    with pytest.raises(IndexError): tt[torch.tensor([9])] = 1.0

def test_setitem_negative_tensor_index_as_torch():
    t, tt = Tensor.zeros(2, 5).contiguous().realize(), torch.zeros(2, 5)
    t[Tensor([-1, 0]), Tensor([-5, -1])] = Tensor([1.0, 2.0])
    tt[torch.tensor([-1, 0]), torch.tensor([-5, -1])] = torch.tensor([1.0, 2.0])
    assert t.tolist() == tt.tolist()

def test_unchecked_lazy_index_writes_nowhere_and_reads_zero():
    # a lazy index isn't read under the default CHECK_OOB=1: out of range it must not land on another element
    t = Tensor.arange(5).float().contiguous().realize()
    idx = Tensor([6]) + 3
    t[idx] = 100.0
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    lazy = Tensor.arange(5).float()
    lazy[Tensor([4]) + 5] = 100.0
    assert lazy.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert Tensor.arange(5)[Tensor([2, 9]) + 0].tolist() == [2, 0]
    assert Tensor.arange(5).gather(0, Tensor([1, 7]) + 0).tolist() == [1, 0]
    assert Tensor.arange(5).scatter(0, Tensor([1, 7]) + 0, Tensor([50, 60])).tolist() == [0, 50, 2, 3, 4]

def test_check_oob_2_reads_lazy_indices():
    with Context(CHECK_OOB=2):
        with pytest.raises(IndexError, match="9"): Tensor.arange(5)[Tensor([2, 9]) + 0].realize()
        t = Tensor.zeros(5).contiguous().realize()
        with pytest.raises(IndexError): t[Tensor([4]) + 5] = 1.0
        with pytest.raises(IndexError): Tensor.arange(5).gather(0, Tensor([1, 7]) + 0)
        # in-range lazy indices still work (negatives wrap in getitem)
        t[Tensor([1, -1]) + 0] = 1.0
        assert t.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]

def test_check_oob_0_reads_nothing():
    with Context(CHECK_OOB=0):
        assert Tensor.arange(5)[Tensor([9])].tolist() == [0]
        t = Tensor.zeros(5).contiguous().realize()
        t[Tensor([9])] = 1.0
        assert t.tolist() == [0.0] * 5

def test_getitem_tensor_index_bounds_as_torch():
    x, tx = Tensor.arange(12).reshape(3, 4), torch.arange(12).reshape(3, 4)
    for idx in ([3], [-4], [0, 5]):
        with pytest.raises(IndexError): tx[torch.tensor(idx)]
        with pytest.raises(IndexError, match="size 3"): x[Tensor(idx)]
    with pytest.raises(IndexError, match="dimension 1 with size 4"): x[:, Tensor([4])]
    want = tx[torch.tensor([-1, -3]), torch.tensor([[0], [-1]])].tolist()
    assert x[Tensor([-1, -3]), Tensor([[0], [-1]])].tolist() == want

def test_empty_result_reads_no_index_as_torch():
    x, tx = Tensor.arange(6).reshape(3, 2), torch.arange(6).reshape(3, 2)
    assert tx[0:0, torch.tensor([9])].shape == (0, 1)
    assert x[0:0, Tensor([9])].shape == (0, 1)

@pytest.mark.parametrize("bad", [5, -1])
def test_gather_scatter_out_of_range_as_torch(bad):
    x, tx = Tensor.arange(10).reshape(2, 5), torch.arange(10).reshape(2, 5)
    idx = [[0, bad], [1, 2]]
    with pytest.raises(RuntimeError): tx.gather(1, torch.tensor(idx))
    with pytest.raises(IndexError, match=f"gather: index {bad} is out of bounds for dimension 1 with size 5"):
        x.gather(1, Tensor(idx))
    with pytest.raises(RuntimeError): tx.scatter(1, torch.tensor(idx), 7)
    with pytest.raises(IndexError, match="scatter"): x.scatter(1, Tensor(idx), 7)
    with pytest.raises(IndexError, match="scatter"): x.scatter(1, Tensor(idx), 7, reduce="add")
    with pytest.raises(RuntimeError): tx.scatter_reduce(1, torch.tensor(idx), torch.ones(2, 2, dtype=torch.long), "sum")
    with pytest.raises(IndexError, match="scatter_reduce"):
        x.scatter_reduce(1, Tensor(idx), Tensor.ones(2, 2, dtype=dtypes.int32), "sum")

def test_gather_scatter_in_range_match_torch():
    x, tx = Tensor.arange(10).reshape(2, 5), torch.arange(10).reshape(2, 5)
    idx = [[0, 4], [4, 2]]
    assert x.gather(1, Tensor(idx)).tolist() == tx.gather(1, torch.tensor(idx)).tolist()
    assert x.scatter(1, Tensor(idx), 7).tolist() == tx.scatter(1, torch.tensor(idx), 7).tolist()

@pytest.mark.parametrize("bad", [5, -1, 99])
def test_embedding_out_of_range_as_torch(bad):
    emb = nn.Embedding(5, 3)
    temb = torch.nn.Embedding(5, 3)
    with pytest.raises(IndexError): temb(torch.tensor([[0, bad]]))
    with pytest.raises(IndexError, match=f"Embedding: index {bad} is out of bounds"): emb(Tensor([[0, bad]]))
    # in range: the rows of the weight
    w = emb.weight.numpy()
    np.testing.assert_array_equal(emb(Tensor([[4, 0]])).numpy(), w[[[4, 0]]])

def test_one_hot_out_of_range_as_torch():
    for data in ([1, 7], [1, -1]):
        with pytest.raises(RuntimeError): torch.nn.functional.one_hot(torch.tensor(data), 5)
        with pytest.raises(IndexError): Tensor(data).one_hot(5)
    with pytest.raises(RuntimeError): torch.nn.functional.one_hot(torch.tensor([1, -1]))
    with pytest.raises(IndexError): Tensor([1, -1]).one_hot()
    assert Tensor([1, 4]).one_hot(5).tolist() == torch.nn.functional.one_hot(torch.tensor([1, 4]), 5).tolist()

# *** sizes no device can hold ***

def _too_many(itemsize: int) -> int:
    """More elements of `itemsize` bytes than the default device's memory holds."""
    return Device[Device.DEFAULT].memory_size // itemsize + 1

def test_memory_size_is_the_machines():
    import os
    assert Device[Device.DEFAULT].memory_size == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

@pytest.mark.parametrize("make", [lambda: Tensor.ones(2**63), lambda: Tensor.zeros(2**40, 2**30),
                                  lambda: Tensor.full((2**47,), 2.0), lambda: Tensor.arange(2**62),
                                  lambda: Tensor.arange(0, 1e30, 1e-30), lambda: Tensor.ones(1).expand(2**50),
                                  lambda: Tensor.ones(1, 1).expand(2**30, 2**30).reshape(2**60),
                                  lambda: Tensor.ones(1).pad(((0, 2**50),)), lambda: Tensor.ones(4).repeat(2**50),
                                  lambda: Tensor.ones(1, 2**25) + Tensor.ones(2**25, 1),
                                  lambda: Tensor.ones(2**30).sum() + Tensor.ones(2**30, 2**30).sum()])
def test_sizes_no_device_holds_are_refused_when_made(make):
    with pytest.raises(MemoryError, match=f"more than any device holds .* of memory of device {Device.DEFAULT}"):
        make()

def test_tensors_with_memory_must_fit_the_device():
    n = _too_many(4)
    with pytest.raises(MemoryError, match=f"{4 * n} bytes .* more than the .* of memory of device {Device.DEFAULT}"):
        Tensor.empty(n)
    # a view of a constant takes no memory, but computing all of it would need its buffer
    for t in (Tensor.ones(n).contiguous(), Tensor.ones(n) + Tensor.ones(n), Tensor.ones(1).expand(n) * 2):
        with pytest.raises(MemoryError, match=f"needs {4 * n} bytes, more than"): t.realize()

def test_views_larger_than_memory_can_be_computed_in_part():
    # only part of a view may ever be computed (its slices, its elements): that takes no more memory than the part
    n = _too_many(4)
    assert Tensor.ones(n)[n - 3:].tolist() == [1.0, 1.0, 1.0]
    assert Tensor.arange(n)[n - 1].item() == n - 1
    assert Tensor.ones(2**28).expand(2, 2**28).shape == (2, 2**28)

# *** loss targets out of range ***

@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "cross_entropy", "nll_loss"])
def test_loss_targets_out_of_range_raise_as_torch(loss):
    import torch
    x_np = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x = Tensor(x_np)
    call = {"sparse_categorical_crossentropy": lambda y: x.sparse_categorical_crossentropy(y),
            "cross_entropy": lambda y: x.cross_entropy(y), "nll_loss": lambda y: x.log_softmax(-1).nll_loss(y)}[loss]
    ref = {"sparse_categorical_crossentropy": lambda y: torch.nn.functional.cross_entropy(torch.tensor(x_np), y),
           "cross_entropy": lambda y: torch.nn.functional.cross_entropy(torch.tensor(x_np), y),
           "nll_loss": lambda y: torch.nn.functional.nll_loss(torch.log_softmax(torch.tensor(x_np), -1), y)}[loss]
    for bad in ([0, 1, 3, 2], [0, -2, 1, 1]):
        with pytest.raises(IndexError): ref(torch.tensor(bad))
        with pytest.raises(IndexError, match="target .* out of bounds"): call(Tensor(bad).realize())
    good = [0, 2, 1, 1]
    np.testing.assert_allclose(call(Tensor(good)).item(), ref(torch.tensor(good)).item(), rtol=1e-5)
    # the ignored label is no error (torch ignores -100 by default, ours -1 for the sparse form)
    ignored = -1 if loss == "sparse_categorical_crossentropy" else -100
    if loss == "nll_loss":
        got = x.log_softmax(-1).nll_loss(Tensor([0, ignored, 1, 1]), ignore_index=-100).item()
    else: got = call(Tensor([0, ignored, 1, 1])).item()
    want = ref(torch.tensor([0, -100, 1, 1])).item()
    np.testing.assert_allclose(got, want, rtol=1e-5)
