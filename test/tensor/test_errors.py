"""Misuse of the Tensor API raises a clear Python exception (a standard type, a message naming the problem) at the
point of the mistake -- while the lazy graph is built, not later inside the compiler."""
from __future__ import annotations
import pytest
import torch
from fusegrad import Tensor

def raises(exc: type[BaseException] | tuple[type[BaseException], ...], *words: str):
    """pytest.raises that also checks the message names the problem (any of `words`, case-insensitive)."""
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(exc)
            self.info = self.ctx.__enter__()
            return self.info
        def __exit__(self, *args):
            ret = self.ctx.__exit__(*args)  # raises if nothing was raised; False if another type was raised
            if not ret: return ret
            msg = str(self.info.value).lower()
            assert any(w.lower() in msg for w in words), f"message {msg!r} names none of {words}"
            return ret
    return _Check()

SHAPE_ERR = (ValueError, RuntimeError)

def test_broadcast_shape_mismatch():
    a, b = Tensor([1.0, 2.0, 3.0]), Tensor([1.0, 2.0, 3.0, 4.0])
    with raises(SHAPE_ERR, "shape", "broadcast"):
        a + b
    with raises(SHAPE_ERR, "shape", "broadcast"):
        Tensor.ones(2, 3) * Tensor.ones(3, 2)
    with raises(SHAPE_ERR, "shape", "broadcast"):
        (Tensor.ones(3) > 0).where(Tensor.ones(4), 0.0)

def test_matmul_inner_dim_mismatch():
    with raises(SHAPE_ERR, "shape", "dim", "matmul", "mismatch"):
        Tensor.ones(3, 4) @ Tensor.ones(5, 2)
    with raises(SHAPE_ERR, "shape", "dim", "matmul", "mismatch"):
        Tensor.ones(4) @ Tensor.ones(3)
    with raises(SHAPE_ERR, "shape", "dim", "matmul", "mismatch"):
        Tensor.ones(2, 3, 4).matmul(Tensor.ones(2, 3, 4))

def test_matmul_zero_dim():
    with raises(SHAPE_ERR, "dim", "0-d", "scalar", "shape", "matmul"):
        Tensor(2.0) @ Tensor.ones(3)

@pytest.mark.parametrize("op", ["sum", "max", "min", "mean"])
def test_bad_reduce_axis(op):
    t = Tensor.ones(2, 3, 4)
    for axis in (5, 3, -4, (0, 7)):
        with raises((IndexError, ValueError), "axis", "dim", "range"):
            getattr(t, op)(axis=axis)

def test_bad_axis_other_ops():
    t = Tensor.ones(2, 3)
    with raises((IndexError, ValueError), "axis", "dim", "range"):
        t.softmax(axis=2)
    with raises((IndexError, ValueError), "axis", "dim", "range"):
        t.flip(2)
    with raises((IndexError, ValueError), "axis", "dim", "range"):
        t.transpose(0, 3)

def test_reshape_wrong_size():
    t = Tensor.ones(2, 3)
    with raises(SHAPE_ERR, "reshape", "size", "shape"):
        t.reshape(4, 2)
    with raises(SHAPE_ERR, "reshape", "size", "shape"):
        t.reshape(7)
    with raises(SHAPE_ERR, "reshape", "size", "shape", "-1"):
        t.reshape(4, -1)  # 6 is not a multiple of 4

def test_reshape_two_minus_one():
    with raises(SHAPE_ERR, "-1", "one", "infer"):
        Tensor.ones(2, 3).reshape(-1, -1)

def test_reshape_negative_dim():
    with raises(SHAPE_ERR, "reshape", "negative", "shape", "-2"):
        Tensor.ones(2, 3).reshape(-2, -3)

@pytest.mark.parametrize("order", [(0, 1), (0, 1, 1), (0, 1, 3), (2, 2, 0), (0, 1, 2, 3)], ids=str)
def test_permute_bad_order(order):
    with raises(SHAPE_ERR + (IndexError,), "permut", "order", "dim", "axis", "range"):
        Tensor.ones(2, 3, 4).permute(order)

def test_expand_non_one_dim():
    with raises(SHAPE_ERR, "expand", "shape", "broadcast"):
        Tensor.ones(2, 3).expand(4, 3)
    with raises(SHAPE_ERR, "expand", "shape", "broadcast"):
        Tensor.ones(3, 1).expand(3)

def test_bad_pad_args():
    t = Tensor.ones(2, 3)
    with raises(SHAPE_ERR, "pad"):
        t.pad(((1, 1), (1, 1), (1, 1)))   # more dims than the tensor
    with raises(SHAPE_ERR, "pad", "negative", "size", "shape"):
        t.pad(((-3, 0), (0, 0)))          # removes more than the dim holds

def test_bad_shrink_args():
    t = Tensor.ones(2, 3)
    with raises(SHAPE_ERR, "shrink", "bound", "range"):
        t.shrink(((0, 3), (0, 3)))        # past the end of dim 0
    with raises(SHAPE_ERR, "shrink", "bound", "range"):
        t.shrink(((1, 0), (0, 3)))        # end before start
    with raises(SHAPE_ERR, "shrink", "dim", "shape"):
        t.shrink(((0, 1),))               # wrong number of dims

def test_unknown_dtype_name():
    with raises((TypeError, ValueError), "dtype", "float33"):
        Tensor([1, 2], dtype="float33")
    with raises((TypeError, ValueError), "dtype", "complex"):
        Tensor([1.0]).cast("complex64")
    with raises((TypeError, ValueError), "dtype", "notatype"):
        Tensor.zeros(2, dtype="notatype")

def test_unknown_device():
    with raises((ValueError, RuntimeError, TypeError), "device", "foo"):
        Tensor([1], device="FOO").realize()

def test_item_on_multi_element():
    with raises(SHAPE_ERR, "item", "element", "numel", "one", "size"):
        Tensor([1, 2, 3]).item()
    with raises(SHAPE_ERR, "item", "element", "numel", "one", "size"):
        Tensor.zeros(0).item()

def test_len_of_zero_dim():
    with raises(TypeError, "0-d", "len", "scalar"):
        len(Tensor(1.0))

def test_assign_shape_mismatch():
    a = Tensor([1.0, 2.0, 3.0]).realize()
    with raises(SHAPE_ERR, "shape"):
        a.assign(Tensor([1.0, 2.0]))
    assert a.tolist() == [1.0, 2.0, 3.0], "a failed assign leaves the tensor unchanged"

@pytest.mark.parametrize("data", [[[1, 2], [3]], [[1.0], 2.0], [[[1, 2]], [[3, 4], [5, 6]]], [1, [2, 3]]], ids=str)
def test_ragged_nested_list(data):
    with raises((ValueError, TypeError), "ragged", "inhomogeneous", "shape", "length", "sequence", "nested"):
        Tensor(data)

def test_bad_data_type():
    with raises(TypeError, "str", "type", "data"):
        Tensor("hello")
    with raises(TypeError, "str", "type", "data", "dtype"):
        Tensor([1, "a"])

def test_index_out_of_range():
    t = Tensor.ones(3, 4)
    with raises(IndexError, "index", "range", "bound"):
        t[3]
    with raises(IndexError, "index", "range", "bound"):
        t[0, -5]
    with raises(IndexError, "index", "dim", "too many"):
        t[0, 0, 0]

def test_index_bad_type():
    with raises((TypeError, IndexError), "index", "str", "type"):
        Tensor.ones(3)["a"]

def test_zero_step_slice():
    with raises(ValueError, "step", "zero", "0"):
        Tensor.ones(4)[::0]

def test_arange_zero_step():
    with raises((ValueError, ZeroDivisionError), "step", "zero", "0"):
        Tensor.arange(0, 5, 0)

def test_bool_of_multi_element_tensor():
    # truthiness of a lazy multi-element tensor is ambiguous, as in torch and numpy
    with raises((ValueError, RuntimeError, TypeError), "bool", "ambiguous", "element", "truth"):
        bool(Tensor([1, 2]) > 0)

@pytest.mark.parametrize("index", [[0, 7], ([0], [-4]), (Ellipsis, [1, 3])], ids=str)
def test_out_of_range_host_index_lists(index):
    t = Tensor([[1.0, 2.0, 3.0]] * 3)
    ref = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    with pytest.raises(IndexError): ref[index]
    with raises(IndexError, "out of bounds"):
        t[index]
