"""Sequence and optional values against onnxruntime on hand-built graphs (ONNX's node cases cover SequenceInsert,
SequenceMap, SplitToSequence and the optional ops; these cover the other sequence ops and Loop carrying a sequence)."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _t(name, elem=TensorProto.FLOAT, shape=None): return helper.make_tensor_value_info(name, elem, shape)


def _seq(name, elem=TensorProto.FLOAT):
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(elem, None)))


def _i64(name, v): return helper.make_tensor(name, TensorProto.INT64, [], [v])


def _compare(m, feed):
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = OnnxRunner(m)(feed)
    for (name, g), w in zip(got.items(), want):
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w), name
            for gi, wi in zip(g, w): np.testing.assert_array_equal(gi.numpy(), wi, err_msg=name)
        else:
            assert isinstance(g, Tensor)
            np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    return got


@pytest.mark.parametrize("at,erase", [(0, 1), (-1, -3), (2, 0)])
def test_construct_at_erase_length_concat(at, erase):
    # a sequence of three tensors of different first dims: read one back, erase one, count, concatenate and stack
    nodes = [helper.make_node("SequenceConstruct", ["a", "b", "c"], ["s"]),
             helper.make_node("SequenceAt", ["s", "at"], ["picked"]),
             helper.make_node("SequenceErase", ["s", "erase"], ["s2"]),
             helper.make_node("SequenceErase", ["s2"], ["s3"]),  # (no position: the last one)
             helper.make_node("SequenceLength", ["s2"], ["n"]),
             helper.make_node("ConcatFromSequence", ["s"], ["cat"], axis=0),
             helper.make_node("SequenceConstruct", ["a", "a"], ["same"]),
             helper.make_node("ConcatFromSequence", ["same"], ["stacked"], axis=-1, new_axis=1)]
    m = _model(nodes, [_t("a", shape=[2, 3]), _t("b", shape=[1, 3]), _t("c", shape=[4, 3])],
               [_t("picked"), _seq("s2"), _seq("s3"), _t("n", TensorProto.INT64), _t("cat"), _t("stacked")],
               [_i64("at", at), _i64("erase", erase)])
    feed = {"a": RNG.standard_normal((2, 3)).astype(np.float32), "b": RNG.standard_normal((1, 3)).astype(np.float32),
            "c": RNG.standard_normal((4, 3)).astype(np.float32)}
    got = _compare(m, feed)
    assert got["stacked"].shape == (2, 3, 2)


def test_empty_insert_and_sequence_input():
    # SequenceEmpty, inserts at the end and at the front, and a sequence given as an input
    nodes = [helper.make_node("SequenceEmpty", [], ["e"], dtype=TensorProto.INT32),
             helper.make_node("SequenceInsert", ["e", "x"], ["s1"]),
             helper.make_node("SequenceInsert", ["s1", "y", "front"], ["s2"]),
             helper.make_node("SequenceLength", ["e"], ["n0"]),
             helper.make_node("SequenceInsert", ["given", "x", "one"], ["g2"])]
    m = _model(nodes, [_t("x", TensorProto.INT32, [2]), _t("y", TensorProto.INT32, [3]),
                       _seq("given", TensorProto.INT32)],
               [_seq("s2", TensorProto.INT32), _t("n0", TensorProto.INT64), _seq("g2", TensorProto.INT32)],
               [_i64("front", 0), _i64("one", 1)])
    feed = {"x": np.array([1, 2], np.int32), "y": np.array([7, 8, 9], np.int32),
            "given": [np.array([5], np.int32), np.array([6, 6], np.int32)]}
    got = _compare(m, feed)
    assert [t.numpy().tolist() for t in got["g2"]] == [[5], [1, 2], [6, 6]]


@pytest.mark.parametrize("split,keepdims", [(None, 1), (None, 0), (2, 1), ([1, 3, 1], 1)])
def test_split_to_sequence(split, keepdims):
    inits = []
    ins = ["x"]
    if split is not None:
        inits.append(helper.make_tensor("split", TensorProto.INT64, [] if isinstance(split, int) else [len(split)],
                                        [split] if isinstance(split, int) else split))
        ins.append("split")
    m = _model([helper.make_node("SplitToSequence", ins, ["s"], axis=1, keepdims=keepdims)],
               [_t("x", shape=[2, 5])], [_seq("s")], inits)
    _compare(m, {"x": np.arange(10, dtype=np.float32).reshape(2, 5)})


def test_loop_accumulates_a_sequence():
    # each iteration appends x * i to a carried sequence; the result is concatenated after the loop
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "fi"], ["xi"]),
         helper.make_node("SequenceInsert", ["seq_in", "xi"], ["seq_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body", [_t("i", TensorProto.INT64, []), _t("cond", TensorProto.BOOL, []), _seq("seq_in")],
        [_t("cond_out", TensorProto.BOOL, []), _seq("seq_out")])
    nodes = [helper.make_node("SequenceEmpty", [], ["empty"]),
             helper.make_node("Loop", ["n", "", "empty"], ["seq"], body=body),
             helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0, new_axis=1)]
    m = _model(nodes, [_t("x", shape=[3])], [_t("y", shape=[4, 3])], [_i64("n", 4)])
    _compare(m, {"x": np.array([1.0, -2.0, 0.5], np.float32)})


def test_bad_positions_name_the_node():
    nodes = [helper.make_node("SequenceConstruct", ["a", "a"], ["s"]),
             helper.make_node("SequenceAt", ["s", "at"], ["y"], name="pick")]
    m = _model(nodes, [_t("a", shape=[2])], [_t("y")], [_i64("at", 2)])
    with pytest.raises(OnnxNodeError, match=r"'pick' \(SequenceAt\).*position 2 is out of range for a sequence of 2"):
        OnnxRunner(m)({"a": np.zeros(2, np.float32)})
    m = _model([helper.make_node("SequenceEmpty", [], ["e"]), helper.make_node("SequenceErase", ["e"], ["s"])],
               [], [_seq("s")])
    with pytest.raises(OnnxNodeError, match="erase from an empty sequence"): OnnxRunner(m)({})
    m = _model([helper.make_node("SequenceLength", ["s"], ["n"])], [_seq("s")], [_t("n", TensorProto.INT64)])
    with pytest.raises(ValueError, match="'s' is a sequence: give a list"): OnnxRunner(m)({"s": np.zeros(2)})
