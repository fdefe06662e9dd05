"""The random ops (shape, dtype and statistics, since their values are random) and If, Loop and Scan against
onnxruntime on hand-built graphs."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _out(name, elem=TensorProto.FLOAT, shape=None): return helper.make_tensor_value_info(name, elem, shape)


@pytest.mark.parametrize("op,attrs,mean,std", [
    ("RandomNormal", {"mean": 2.0, "scale": 3.0}, 2.0, 3.0),
    ("RandomUniform", {"low": -1.0, "high": 3.0}, 1.0, 4 / 12 ** 0.5),
])
def test_random_statistics(op, attrs, mean, std):
    n = 40000
    m = _model([helper.make_node(op, [], ["y"], shape=[200, 200], dtype=TensorProto.DOUBLE, **attrs)], [],
               [_out("y", TensorProto.DOUBLE, [200, 200])])
    y = OnnxRunner(m)({})["y"].numpy()
    assert y.shape == (200, 200) and y.dtype == np.float64
    # the sample mean's standard error is std / sqrt(n) = std / 200: 5 of them is a bound no correct draw misses
    assert abs(y.mean() - mean) < 5 * std / n ** 0.5
    assert abs(y.std() - std) < 0.02 * std
    if op == "RandomUniform": assert y.min() >= -1.0 and y.max() < 3.0
    else: assert abs(((y - mean) / std > 1).mean() - 0.1587) < 0.01  # the normal's tail above one sigma


def test_random_like_seed_and_dtype():
    def model(seed):
        node = helper.make_node("RandomUniformLike", ["x"], ["y"], seed=seed, low=5.0, high=6.0)
        return _model([node], [_out("x", TensorProto.FLOAT16, [3, 7])], [_out("y", TensorProto.FLOAT16, [3, 7])])
    x = np.zeros((3, 7), np.float16)
    a, b, c = (OnnxRunner(model(s))({"x": x})["y"].numpy() for s in (1.0, 1.0, 2.0))
    assert a.dtype == np.float16 and a.shape == (3, 7) and ((a >= 5) & (a <= 6)).all()
    np.testing.assert_array_equal(a, b)  # a seeded node repeats its values
    assert not np.array_equal(a, c)


def test_bernoulli_and_multinomial():
    p = np.linspace(0, 1, 11, dtype=np.float32).reshape(11, 1).repeat(4000, 1)
    m = _model([helper.make_node("Bernoulli", ["p"], ["y"], dtype=TensorProto.INT32)],
               [_out("p", shape=[11, 4000])], [_out("y", TensorProto.INT32, [11, 4000])])
    y = OnnxRunner(m)({"p": p})["y"].numpy()
    assert y.dtype == np.int32 and set(np.unique(y)) <= {0, 1}
    assert y[0].sum() == 0 and y[-1].sum() == 4000  # probabilities 0 and 1 are exact
    # each row's frequency within 5 standard errors (sqrt(p(1-p)/4000) <= 0.008) of its probability
    np.testing.assert_allclose(y.mean(1), p[:, 0], atol=0.04)

    probs = np.array([[0.1, 0.2, 0.7], [0.5, 0.0, 0.5]], dtype=np.float32)
    m = _model([helper.make_node("Multinomial", ["x"], ["y"], sample_size=20000, dtype=TensorProto.INT64)],
               [_out("x", shape=[2, 3])], [_out("y", TensorProto.INT64, [2, 20000])])
    # the input is log-probabilities, unnormalized: a constant added to a row changes nothing
    y = OnnxRunner(m)({"x": np.log(np.maximum(probs, 1e-30)) + 3.0})["y"].numpy()
    assert y.dtype == np.int64 and y.shape == (2, 20000)
    freq = np.stack([np.bincount(r, minlength=3) / 20000 for r in y])
    assert freq[1, 1] == 0
    np.testing.assert_allclose(freq, probs, atol=0.02)


def _ort(model, feed):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_if_reads_outer_values():
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [], [_out("t", shape=[3])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [_out("e", shape=[3])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    m = _model(nodes, [_out("x", shape=[3])], [_out("y", shape=[3])],
               [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    for x in (np.array([1, 2, -0.5], np.float32), np.array([-1, 2, -3], np.float32)):
        np.testing.assert_allclose(OnnxRunner(m)({"x": x})["y"].numpy(), _ort(m, {"x": x})[0])


def test_loop_fixed_trip_count_with_scan_outputs():
    # acc = acc * 0.5 + x * i for 5 iterations, also emitting each acc (a scan output)
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["fi"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["x", "fi"], ["xi"]),
         helper.make_node("Mul", ["acc", "half"], ["ah"]),
         helper.make_node("Add", ["ah", "xi"], ["acc_out"]),
         helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Identity", ["acc_out"], ["scan"])],
        "body", [_out("i", TensorProto.INT64, []), _out("cond", TensorProto.BOOL, []), _out("acc", shape=[4])],
        [_out("cond_out", TensorProto.BOOL, []), _out("acc_out", shape=[4]), _out("scan", shape=[4])])
    nodes = [helper.make_node("Loop", ["n", "", "acc0"], ["acc", "all"], body=body)]
    inits = [helper.make_tensor("n", TensorProto.INT64, [], [5]),
             helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])]
    m = _model(nodes, [_out("x", shape=[4]), _out("acc0", shape=[4])],
               [_out("acc", shape=[4]), _out("all", shape=[5, 4])], inits)
    feed = {"x": np.arange(4, dtype=np.float32), "acc0": np.ones(4, np.float32)}
    got = OnnxRunner(m)(feed)
    want = _ort(m, feed)
    np.testing.assert_allclose(got["acc"].numpy(), want[0], rtol=1e-6)
    np.testing.assert_allclose(got["all"].numpy(), want[1], rtol=1e-6)


@pytest.mark.parametrize("in_dir,out_dir,out_axis", [(0, 0, 0), (1, 0, 1), (0, 1, -1)])
def test_scan_directions_and_axes(in_dir, out_dir, out_axis):
    # a running sum over the rows of x (scanned along axis 1, in either direction), also emitting each partial sum
    # scaled by the row (stacked along out_axis, in either order)
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "row"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "row"], ["scan_out"])],
        "body", [_out("s", shape=[3]), _out("row", shape=[3])], [_out("s_out", shape=[3]), _out("scan_out", shape=[3])])
    node = helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1, scan_input_axes=[1],
                            scan_input_directions=[in_dir], scan_output_axes=[out_axis],
                            scan_output_directions=[out_dir])
    m = _model([node], [_out("s0", shape=[3]), _out("x", shape=[3, 4])], [_out("s", shape=[3]), _out("ys")])
    feed = {"s0": np.array([1.0, -1.0, 0.5], np.float32),
            "x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    got = OnnxRunner(m)(feed)
    want = _ort(m, feed)
    np.testing.assert_allclose(got["s"].numpy(), want[0], rtol=1e-6)
    np.testing.assert_allclose(got["ys"].numpy(), want[1], rtol=1e-6)
