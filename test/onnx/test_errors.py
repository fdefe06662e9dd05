"""Bad models and bad inputs: each is a clear OnnxError naming the file, the input or the node (name and op type)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import (OnnxError, OnnxInputError, OnnxLoadError, OnnxNodeError, OnnxRunner,  # noqa: E402
                           OnnxUnsupportedError)


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _relu_model():
    return _model([helper.make_node("Relu", ["x"], ["y"], name="act")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "n"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "n"])])


def test_runs_and_matches():
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], dtype=np.float32)
    np.testing.assert_array_equal(OnnxRunner(_relu_model())({"x": x})["y"].numpy(), np.maximum(x, 0))


def test_truncated_file(tmp_path):
    data = _relu_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxLoadError, match="cut.onnx"): OnnxRunner(str(path))


def test_corrupt_bytes_and_missing_file(tmp_path):
    with pytest.raises(OnnxLoadError): OnnxRunner(b"\xff\x00 this is not protobuf \x13\x37" * 5)
    with pytest.raises(OnnxLoadError, match="no such model file"): OnnxRunner(str(tmp_path / "missing.onnx"))


def test_unknown_op_names_node():
    m = _model([helper.make_node("FancyOp", ["x"], ["y"], name="mystery")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxUnsupportedError, match=r"node 'mystery' \(FancyOp\).*not supported") as e: OnnxRunner(m)
    assert e.value.node_name == "mystery" and e.value.op_type == "FancyOp"


def test_unknown_domain():
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="r", domain="com.example")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxUnsupportedError, match="com.example"): OnnxRunner(m)


def test_unsupported_attribute():
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="act", alpha=0.5)],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxUnsupportedError, match=r"node 'act' \(Relu\): attribute 'alpha' is not supported"):
        OnnxRunner(m)


def test_unsupported_attribute_value():
    m = _model([helper.make_node("Pad", ["x", "p"], ["y"], name="padder", mode="mirror")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
               [helper.make_tensor("p", TensorProto.INT64, [2], [1, 1])])
    with pytest.raises(OnnxUnsupportedError, match=r"node 'padder' \(Pad\): Pad mode 'mirror'"):
        OnnxRunner(m)({"x": np.zeros(2, np.float32)})


def test_bad_node_input_names_node():
    m = _model([helper.make_node("Reshape", ["x", "s"], ["y"], name="reshaper")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
               [helper.make_tensor("s", TensorProto.INT64, [2], [4, 2])])
    with pytest.raises(OnnxNodeError, match=r"node 'reshaper' \(Reshape\).*can't reshape \(2, 3\) to \[4, 2\]"):
        OnnxRunner(m)({"x": np.zeros((2, 3), np.float32)})


def test_undefined_value():
    m = _model([helper.make_node("Add", ["x", "nowhere"], ["y"], name="adder")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(OnnxNodeError, match=r"node 'adder' \(Add\): input 'nowhere'"):
        OnnxRunner(m)({"x": np.zeros(2, np.float32)})


def test_wrong_input_name():
    with pytest.raises(OnnxInputError, match=r"unknown input names \['X'\].*inputs are \['x'\]"):
        OnnxRunner(_relu_model())({"X": np.zeros((2, 3), np.float32)})
    with pytest.raises(OnnxInputError, match=r"missing inputs \['x'\]"): OnnxRunner(_relu_model())({})


def test_wrong_input_shape():
    r = OnnxRunner(_relu_model())
    with pytest.raises(OnnxInputError, match=r"input 'x' must have shape \(2, n\), got \(3, 3\)"):
        r({"x": np.zeros((3, 3), np.float32)})
    with pytest.raises(OnnxInputError, match="must have 2 dims"): r({"x": np.zeros(3, np.float32)})


def test_symbolic_dim_must_agree():
    m = _model([helper.make_node("Add", ["a", "b"], ["y"], name="adder")],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
                helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    with pytest.raises(OnnxInputError, match="'n'"):
        OnnxRunner(m)({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})


def test_wrong_input_dtype():
    with pytest.raises(OnnxInputError, match="input 'x' must have dtype float, got a NumPy array of float64"):
        OnnxRunner(_relu_model())({"x": np.zeros((2, 3))})


def test_errors_share_a_base():
    for cls in (OnnxLoadError, OnnxInputError, OnnxNodeError, OnnxUnsupportedError): assert issubclass(cls, OnnxError)
