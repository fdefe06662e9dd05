"""8-, 4- and 2-bit values carried through Loop and Scan and held in sequences, against onnx's reference evaluator
(onnxruntime's Python API takes no arrays of ml_dtypes' types)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxInputError, OnnxNodeError, OnnxRunner  # noqa: E402
from fusegrad.onnx.narrow import NarrowTensor  # noqa: E402

vi = helper.make_tensor_value_info
F8 = TP.FLOAT8E4M3FN


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                             opset_imports=[helper.make_opsetid("", 21)])


def _same(got, want) -> None:
    """Same element type and values (any NaN matching any NaN); `want` reshaped to `got`'s shape (onnx's reference
    stacks a Loop's scan outputs with vstack, which concatenates)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.astype(np.float32), want.reshape(got.shape).astype(np.float32))


def _loop_model() -> onnx.ModelProto:
    # a FLOAT8E4M3FN value carried and transposed in each of 3 iterations, and stacked as a scan output
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Transpose", ["x"], ["x_out"]),
         helper.make_node("Identity", ["x"], ["scan"])], "body",
        [vi("i", TP.INT64, []), vi("c", TP.BOOL, []), vi("x", F8, [2, 2])],
        [vi("c_out", TP.BOOL, []), vi("x_out", F8, None), vi("scan", F8, None)])
    nodes = [helper.make_node("Loop", ["n", "cond", "x0"], ["xf", "scans"], body=body),
             helper.make_node("Cast", ["xf"], ["xf32"], to=TP.FLOAT)]
    return _model(nodes, [vi("x0", F8, [2, 2])], [vi("xf", F8, None), vi("scans", F8, None),
                                                  vi("xf32", TP.FLOAT, None)],
                  [numpy_helper.from_array(np.array(3, np.int64), "n"),
                   numpy_helper.from_array(np.array(True), "cond")])


def test_loop_carries_narrow_values():
    model = _loop_model()
    x = np.array([[0.5, -2], [448, 0.015625]], np.float32).astype(ml_dtypes.float8_e4m3fn)
    want = ReferenceEvaluator(model).run(None, {"x0": x})
    got = OnnxRunner(model)({"x0": x})
    assert isinstance(got["scans"], NarrowTensor) and tuple(got["scans"].shape) == (3, 2, 2)
    for w, v in zip(want, got.values()): _same(v.numpy(), w)
    jit = OnnxRunner(model).jit()
    for k in range(3):   # plain, capture, replay
        xk = (x.astype(np.float32) * (k + 1) / 4).astype(ml_dtypes.float8_e4m3fn)
        want = ReferenceEvaluator(model).run(None, {"x0": xk})
        for w, v in zip(want, jit({"x0": xk}).values()): _same(v, w)


@pytest.mark.parametrize("direction", [0, 1])
def test_scan_over_narrow_values(direction):
    # an INT4 scan input sliced per step (in reverse for direction 1), an INT4 state replaced by each slice, the
    # slices stacked (onnx's reference runs only direction 0; the spec's result for 1 is the input reversed)
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["s_out"]),
                              helper.make_node("Identity", ["x"], ["y"])], "body",
                             [vi("s", TP.INT4, [3]), vi("x", TP.INT4, [3])],
                             [vi("s_out", TP.INT4, [3]), vi("y", TP.INT4, [3])])
    node = helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], body=body, num_scan_inputs=1,
                            scan_input_directions=[direction])
    model = _model([node], [vi("s0", TP.INT4, [3]), vi("xs", TP.INT4, [4, 3])],
                   [vi("s", TP.INT4, None), vi("ys", TP.INT4, None)])
    xs = (np.arange(12).reshape(4, 3) % 16 - 8).astype(ml_dtypes.int4)
    feed = {"s0": np.array([7, -8, 0], ml_dtypes.int4), "xs": xs}
    want = ReferenceEvaluator(model).run(None, feed) if direction == 0 else [xs[0], xs[::-1]]
    got = OnnxRunner(model)(feed)
    for w, v in zip(want, got.values()): _same(v.numpy(), w)


def _sequence_model() -> onnx.ModelProto:
    # FLOAT8E5M2 values into a sequence and out: construct, insert, split, erase, at, concat
    nodes = [helper.make_node("SequenceConstruct", ["a", "b"], ["s1"]),
             helper.make_node("SplitToSequence", ["a"], ["parts"], axis=0, keepdims=1),
             helper.make_node("SequenceAt", ["parts", "one"], ["p1"]),
             helper.make_node("SequenceInsert", ["s1", "p1", "zero"], ["s2"]),
             helper.make_node("SequenceErase", ["s2", "one"], ["s3"]),
             helper.make_node("ConcatFromSequence", ["s3"], ["cat"], axis=0),
             helper.make_node("SequenceLength", ["s3"], ["n"]),
             helper.make_node("Cast", ["cat"], ["cat32"], to=TP.FLOAT)]
    seq = helper.make_tensor_sequence_value_info
    return _model(nodes, [vi("a", TP.FLOAT8E5M2, [2, 2]), vi("b", TP.FLOAT8E5M2, [2, 2])],
                  [vi("cat", TP.FLOAT8E5M2, None), vi("cat32", TP.FLOAT, None), vi("n", TP.INT64, None),
                   seq("s3", TP.FLOAT8E5M2, None)],
                  [numpy_helper.from_array(np.array(1, np.int64), "one"),
                   numpy_helper.from_array(np.array(0, np.int64), "zero")])


def test_sequences_of_narrow_values():
    model = _sequence_model()
    feed = {"a": np.array([[1, -2], [57344, 0.5]], np.float32).astype(ml_dtypes.float8_e5m2),
            "b": np.array([[3, 0.25], [-0.0, np.inf]], np.float32).astype(ml_dtypes.float8_e5m2)}
    want = ReferenceEvaluator(model).run(None, feed)
    got = OnnxRunner(model)(feed)
    _same(got["cat"].numpy(), want[0])
    _same(got["cat32"].numpy(), want[1])
    assert int(got["n"].numpy()) == int(want[2])
    assert len(got["s3"]) == len(want[3])
    for v, w in zip(got["s3"], want[3]): _same(v.numpy(), w)
    jit = OnnxRunner(model).jit()
    for _ in range(3):
        out = jit(feed)
        _same(out["cat"], want[0])
        for v, w in zip(out["s3"], want[3]): _same(v, w)


def test_sequence_input_and_output_of_narrow_type():
    seq = helper.make_tensor_sequence_value_info
    nodes = [helper.make_node("SequenceAt", ["s", "zero"], ["first"]),
             helper.make_node("Cast", ["first"], ["f"], to=TP.FLOAT),
             helper.make_node("Identity", ["s"], ["s_out"])]
    model = _model(nodes, [seq("s", TP.UINT4, None)],
                   [vi("f", TP.FLOAT, None), seq("s_out", TP.UINT4, None)],
                   [numpy_helper.from_array(np.array(0, np.int64), "zero")])
    s = [np.array([1, 15, 0], ml_dtypes.uint4), np.array([[3]], ml_dtypes.uint4)]
    want = ReferenceEvaluator(model).run(None, {"s": s})
    runner = OnnxRunner(model)
    got = runner({"s": s})
    _same(got["f"].numpy(), want[0])
    for v, w in zip(got["s_out"], want[1]): _same(v.numpy(), w)
    # a held tensor must hold values of the type; an array of another type is refused
    with pytest.raises(OnnxInputError, match="a tensor of input 's' has element type UINT4, but 1 of the values"):
        runner({"s": [Tensor(np.array([1, 16], np.uint8))]})
    with pytest.raises(OnnxInputError, match="ml_dtypes.uint4"):
        runner({"s": [np.array([1, 2], np.uint8)]})


def test_narrow_and_wide_values_together():
    # a Concat of a FLOAT8E4M3FN value and a float32 one (an invalid model) would take both for float8
    model = _model([helper.make_node("Concat", ["a", "b"], ["y"], axis=0)],
                   [vi("a", F8, [2]), vi("b", TP.FLOAT, [2])], [vi("y", F8, None)])
    with pytest.raises(OnnxNodeError, match="FLOAT8E4M3FN and of float together"):
        OnnxRunner(model)({"a": np.ones(2, ml_dtypes.float8_e4m3fn), "b": np.ones(2, np.float32)})
