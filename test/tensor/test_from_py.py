"""dtypes.from_py and Tensor(data) on nested lists and tuples type the data as tinygrad does: a float anywhere makes
the default float, else an int anywhere the default int (int64 where a value needs it), else all bools make bool; an
empty list is the default float; a ragged nesting is a ValueError. The reference is those rules written out over
Python's own types, and numpy for the shapes and raggedness."""
from __future__ import annotations
import random
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.dtype import to_np_dtype

def _scalars(x):
    """Every scalar of a nested list/tuple (numpy says whether it is rectangular)."""
    if isinstance(x, (list, tuple)):
        for v in x: yield from _scalars(v)
    else: yield x

def _expected(x):
    """The rules, written out: float anywhere > int anywhere (bools beside ints are ints) > all bools; empty: float."""
    vals = list(_scalars(x))
    if not vals or any(type(v) is float for v in vals): return dtypes.default_float
    ints = [v for v in vals if type(v) is int]
    if not ints: return dtypes.bool
    return dtypes.int32 if -2**31 <= min(ints) and max(ints) < 2**31 else dtypes.int64

# what tinygrad 0.14 gives for these, shapes included (ints that need 64 bits: int64 here, see the next test)
CASES = [([], dtypes.float32, (0,)), ((), dtypes.float32, (0,)), ([[]], dtypes.float32, (1, 0)),
         ([[], []], dtypes.float32, (2, 0)), ([[[]], [[]]], dtypes.float32, (2, 1, 0)),
         ([True, False], dtypes.bool, (2,)), ([[False]], dtypes.bool, (1, 1)),
         (((True,), (False,)), dtypes.bool, (2, 1)),
         ([True, 1], dtypes.int32, (2,)), ([[True], [2]], dtypes.int32, (2, 1)),
         ([[[1]], [[True]]], dtypes.int32, (2, 1, 1)), ([(1, 2), (3, 4)], dtypes.int32, (2, 2)),
         ([[1], [2.0]], dtypes.float32, (2, 1)), ([True, 1.0], dtypes.float32, (2,)),
         ([[True], [1.5]], dtypes.float32, (2, 1)), ([[[[0.5]]]], dtypes.float32, (1, 1, 1, 1))]

@pytest.mark.parametrize("data,dt,shape", CASES, ids=[repr(c[0]) for c in CASES])
def test_nested_cases(data, dt, shape):
    assert _expected(data) == dt
    assert dtypes.from_py(data) == dt
    t = Tensor(data)
    assert t.dtype == dt and t.shape == shape
    np.testing.assert_array_equal(t.numpy(), np.array(data, dtype=to_np_dtype(dt)).reshape(shape))

def test_ints_that_need_64_bits_anywhere_in_the_nesting():
    assert dtypes.from_py([[1], [2**40]]) == dtypes.int64 and dtypes.from_py([[[True]], [[-2**31 - 1]]]) == dtypes.int64
    assert Tensor([[1], [2**40]]).numpy().tolist() == [[1], [2**40]]
    # beside a float anywhere, a huge int is a float; on its own it is an error, not a wrapped value
    assert dtypes.from_py([[2**70], [0.5]]) == dtypes.float32
    with pytest.raises(OverflowError, match="int64"): dtypes.from_py([[1], [2**63]])

@pytest.mark.parametrize("seed", range(40))
def test_random_nestings_follow_the_rules(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1 if d < 2 else 0, 3) for d in range(rng.randint(1, 6)))   # (up to 6 deep, some empty)
    kinds = rng.choice([("bool",), ("bool", "int"), ("int",), ("int", "float"), ("bool", "float"),
                        ("bool", "int", "float"), ("bigint", "bool")])
    def scalar():
        k = rng.choice(kinds)
        return {"bool": lambda: rng.random() < 0.5, "int": lambda: rng.randint(-9, 9),
                "float": lambda: rng.uniform(-9, 9), "bigint": lambda: rng.choice([2**40, -2**33, 3])}[k]()
    def build(dims):
        seq = tuple if rng.random() < 0.3 else list
        return seq(build(dims[1:]) for _ in range(dims[0])) if dims else scalar()
    data = build(shape)
    if 0 in shape: shape = shape[:shape.index(0) + 1]   # (an empty list holds no deeper dims)
    dt = _expected(data)
    assert dtypes.from_py(data) == dt, data
    t = Tensor(data)
    assert t.dtype == dt and t.shape == np.array(data, dtype=object).shape == shape
    np.testing.assert_array_equal(t.numpy(), np.array(data, dtype=to_np_dtype(dt)).reshape(shape))

RAGGED = [[[1, 2], [3]], [[1], 2], [1, [2]], [[1, 2], [3, [4]]], [[], [1]], [[[1.0]], [[1.0], [2.0]]],
          ([True], (False, True)), [[[[1]]], [[[1], [2]]]]]

@pytest.mark.parametrize("data", RAGGED, ids=[repr(r) for r in RAGGED])
def test_ragged_nestings_are_a_value_error(data):
    with pytest.raises(ValueError): np.array(data)   # (the reference: numpy refuses it too)
    with pytest.raises(ValueError, match="ragged nested sequence"): dtypes.from_py(data)
    with pytest.raises(ValueError, match="ragged nested sequence"): Tensor(data)

def test_other_values_are_a_type_error():
    with pytest.raises(TypeError, match="can't infer a dtype"): dtypes.from_py([[1], ["a"]])
    with pytest.raises(TypeError, match="can't infer a dtype"): dtypes.from_py([[None]])
