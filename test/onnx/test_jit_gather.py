"""Gather with a single index under TinyJit: a constant index is a slice read without the device (the capture can't
read tensor data), an index that arrives as an input selects on the device and follows each call's value."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402


def _model(index: int | None):
    """y = x[:, index] (Gather on axis 1 with a scalar index): a constant index, or an input `i` when None."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 3])]
    inits = []
    if index is None: inputs.append(helper.make_tensor_value_info("i", TensorProto.INT64, []))
    else: inits.append(numpy_helper.from_array(np.array(index, np.int64), "i"))
    graph = helper.make_graph([helper.make_node("Gather", ["x", "i"], ["y"], axis=1, name="pick")], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("index", [0, 3, -1])
def test_constant_scalar_index_under_tinyjit(index):
    runner = OnnxRunner(_model(index))
    step = TinyJit(lambda x: (runner({"x": x})["y"] * 2).realize())   # (a kernel to capture: the slice is a view)
    rng = np.random.default_rng(index + 7)
    for _ in range(4):
        x = rng.standard_normal((2, 5, 3)).astype(np.float32)
        np.testing.assert_array_equal(step(Tensor(x).realize()).numpy(), x[:, index] * 2)


def test_scalar_index_as_an_input_follows_each_call():
    runner = OnnxRunner(_model(None))
    step = TinyJit(lambda x, i: (runner({"x": x, "i": i})["y"] * 2).realize())
    rng = np.random.default_rng(3)
    for index in [1, 4, -2, 0, 2]:
        x = rng.standard_normal((2, 5, 3)).astype(np.float32)
        got = step(Tensor(x).realize(), Tensor(np.array(index, np.int64)).realize()).numpy()
        np.testing.assert_array_equal(got, x[:, index] * 2)


def test_constant_index_out_of_range_names_the_node():
    with pytest.raises(OnnxNodeError, match="pick.*Gather index 5 is out of range for axis 1 of size 5"):
        OnnxRunner(_model(5))({"x": np.zeros((2, 5, 3), np.float32)})


def _table_model(axis: int):
    """y = Gather(table, ids) with the table an initializer (an embedding) and the ids an input of shape (2, 3)."""
    table = np.random.default_rng(axis).standard_normal((50, 4, 6) if axis == 0 else (4, 50, 6)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Gather", ["t", "ids"], ["y"], axis=axis, name="embed")], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(table, "t")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), table


@pytest.mark.parametrize("axis", [0, 1])
def test_index_tensor_gathers_with_one_load_per_element(axis):
    from fusegrad.engine.realize import GlobalCounters
    model, table = _table_model(axis)
    runner = OnnxRunner(model)
    step = TinyJit(lambda ids: runner({"ids": ids})["y"].realize())
    rng = np.random.default_rng(5)
    for _ in range(4):
        ids = rng.integers(-50, 50, (2, 3)).astype(np.int64)   # negative ids count from the end
        ops = GlobalCounters.global_ops
        got = step(Tensor(ids).realize()).numpy()
        np.testing.assert_array_equal(got, np.take(table, ids, axis=axis))
    # the replay's work is some index arithmetic per element of the result: a one-hot selection would compare and add
    # all 50 positions for each (100 ops)
    assert GlobalCounters.global_ops - ops < 25 * got.size


def test_embedding_lookup_stored_in_the_results_order():
    """An embedding's Gather (axis 0, ids computed per call) followed by a LayerNormalization over the embedding's dim:
    the lookup is one kernel storing (tokens, dim) rows, which the layer norm reads as rows: two kernels a replay (the
    indices normalized inside the lookup), equal to NumPy's."""
    rng = np.random.default_rng(11)
    table = rng.standard_normal((40, 16)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["t", "ids"], ["e"], axis=0),
             helper.make_node("LayerNormalization", ["e", "g", "b"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(table, "t"),
                                           numpy_helper.from_array(np.ones(16, np.float32), "g"),
                                           numpy_helper.from_array(np.zeros(16, np.float32), "b")])
    jitted = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).jit()
    for _ in range(3):
        ids = rng.integers(-40, 40, (1, 24)).astype(np.int64)
        e = np.take(table, ids, axis=0)
        want = (e - e.mean(-1, keepdims=True)) / np.sqrt(e.var(-1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(jitted({"ids": ids})["y"], want, rtol=1e-5, atol=1e-5)
    assert len(jitted.captured) == 2


@pytest.mark.parametrize("axis,bad", [(0, 50), (0, -51), (1, 50)])
def test_index_tensor_out_of_range_names_the_node(axis, bad):
    """An id out of range, given as an array (its values at hand), is an error naming the node, as in onnxruntime."""
    model, _ = _table_model(axis)
    ids = np.zeros((2, 3), np.int64)
    ids[1, 2] = bad
    with pytest.raises(OnnxNodeError, match=f"embed.*index {bad} is out of bounds for dimension {axis}"):
        OnnxRunner(model)({"ids": ids})
