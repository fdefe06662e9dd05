"""OnnxRunner calls (jit(), and plain calls inside a TinyJit function) on models whose outputs are their inputs or views
of them: each call returns a copy of that call's input (as onnxruntime's run does), never the memory the next call's
input is written to."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402


def _model(with_relu: bool, reshape: bool = False, batch: int | str = 2):
    """y = Identity(x) (or Reshape(x) to (batch*3,)), and z = Relu(x) beside it when `with_relu`."""
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    inits = []
    if reshape:
        nodes = [helper.make_node("Reshape", ["x", "flat"], ["y"])]
        inits.append(helper.make_tensor("flat", TensorProto.INT64, [1], [-1]))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if with_relu:
        nodes.append(helper.make_node("Relu", ["x"], ["z"]))
        outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])], outs,
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("with_relu,reshape", [(False, False), (True, False), (False, True), (True, True)])
def test_output_that_is_an_input_is_each_calls_copy(with_relu, reshape):
    run = OnnxRunner(_model(with_relu, reshape)).jit()
    rng = np.random.default_rng(1)
    kept = []
    for _ in range(5):   # (TinyJit captures on the second call and replays from the third)
        x = rng.standard_normal((2, 3)).astype(np.float32)
        got = run({"x": x})
        np.testing.assert_array_equal(got["y"], x.reshape(-1) if reshape else x)
        if with_relu: np.testing.assert_array_equal(got["z"], np.maximum(x, 0))
        assert not np.shares_memory(got["y"], x)
        kept.append((x.copy(), got["y"]))
    for x, y in kept:   # earlier results are not overwritten by later calls
        np.testing.assert_array_equal(y, x.reshape(-1) if reshape else x)


def test_output_that_is_an_input_with_a_symbolic_dim():
    run = OnnxRunner(_model(True, batch="n")).jit()
    rng = np.random.default_rng(2)
    for n in [2, 2, 2, 5, 1, 5]:
        x = rng.standard_normal((n, 3)).astype(np.float32)
        got = run({"x": x})
        np.testing.assert_array_equal(got["y"], x)
        np.testing.assert_array_equal(got["z"], np.maximum(x, 0))


def test_output_that_is_an_input_under_tinyjit():
    # the runner called inside a TinyJit function: its Identity output is a copy, so the replays return each call's
    runner = OnnxRunner(_model(False))
    step = TinyJit(lambda x: runner({"x": x})["y"].realize())
    rng = np.random.default_rng(3)
    for _ in range(5):
        x = rng.standard_normal((2, 3)).astype(np.float32)
        t = Tensor(x).realize()
        got = step(t)
        assert got.uop.base is not t.uop.base
        np.testing.assert_array_equal(got.numpy(), x)


def test_plain_call_returns_a_copy_of_an_input_tensor():
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)).realize()
    y = OnnxRunner(_model(False))({"x": x})["y"].realize()
    assert y.uop.base is not x.uop.base
    np.testing.assert_array_equal(y.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_outputs_without_elements_under_jit():
    # a Slice past the end of every output: a capture would run no kernel, so these shapes run plainly each call
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Slice", ["r", "s", "e"], ["y"])]
    inits = [helper.make_tensor("s", TensorProto.INT64, [1], [5]), helper.make_tensor("e", TensorProto.INT64, [1], [9])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    run = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).jit()
    for _ in range(4):
        got = run({"x": np.ones((2, 3), np.float32)})["y"]
        assert got.shape == (0, 3) and got.dtype == np.float32


@pytest.mark.parametrize("op", ["Identity", "Slice"])
def test_output_that_is_an_initializer_under_jit(op):
    # the output is the initializer or a view of it, read by no kernel: jit() copies it, as it copies an input
    w = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [2, 3], w.ravel()),
             helper.make_tensor("s", TensorProto.INT64, [1], [1]), helper.make_tensor("e", TensorProto.INT64, [1], [3])]
    node = helper.make_node(op, ["w", "s", "e"] if op == "Slice" else ["w"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    run = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).jit()
    for _ in range(4):
        np.testing.assert_array_equal(run({"x": np.ones(2, np.float32)})["y"], w[1:3] if op == "Slice" else w)


def test_reduction_of_a_0d_input_under_jit():
    # the sum of a 0-d input realizes as a view of it: each call still returns that call's value
    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    run = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])).jit()
    for i in range(5): assert run({"x": np.array(i - 2, np.int64)})["y"] == i - 2


def test_output_computed_on_the_host_under_jit():
    # Cast of a Shape is folded on the host into a tensor no kernel writes: each replay must still return its values
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=TensorProto.DOUBLE),
             helper.make_node("Relu", ["x"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    run = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])).jit()
    for _ in range(5):
        np.testing.assert_array_equal(run({"x": np.ones((1, 4, 4, 8), np.float32)})["y"], [1.0, 4.0, 4.0, 8.0])


def test_empty_output_of_a_named_dim_under_jit():
    # Split of (N, 3) into 3 and 0 columns: the empty part (N, 0) is a view of the input, left as it is (no memory)
    nodes = [helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
                              initializer=[helper.make_tensor("sizes", TensorProto.INT64, [2], [3, 0])])
    run = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])).jit()
    rng = np.random.default_rng(3)
    for n in [2, 2, 2, 4]:
        x = rng.standard_normal((n, 3)).astype(np.float32)
        got = run({"x": x})
        np.testing.assert_array_equal(got["a"], x)
        assert got["b"].shape == (n, 0)
