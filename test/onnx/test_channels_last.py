"""Channels-last regions (fusegrad/onnx/layout.py): a strided convolution and the pooling and elementwise ops after it
store their results as (N, H, W, C); the values read anywhere, graph outputs included, are those of onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.onnx import layout  # noqa: E402

RNG = np.random.default_rng(7)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto: return numpy_helper.from_array(arr, name)


def _model() -> onnx.ModelProto:
    """x -> strided conv (bias) -> clip -> max pool (ceil mode) -> strided conv -> batch norm -> hard swish -> average
    pool; read outside the region: the first conv (an output: a copy), the clip (by a Mul: in place), the pool (by a
    ReduceSum) and the hard swish (by a stride-1 conv: a copy)."""
    f32 = np.float32
    inits = [_init("w1", RNG.standard_normal((8, 3, 3, 3)).astype(f32)),
             _init("b1", RNG.standard_normal(8).astype(f32)),
             _init("lo", np.array(-0.5, f32)), _init("hi", np.array(1.5, f32)),
             _init("w2", RNG.standard_normal((16, 8, 3, 3)).astype(f32) * 0.3),
             _init("scale", RNG.random(16).astype(f32) + 0.5), _init("bias", RNG.standard_normal(16).astype(f32)),
             _init("mean", RNG.standard_normal(16).astype(f32)), _init("var", RNG.random(16).astype(f32) + 0.1),
             _init("k", np.array(2.0, f32)), _init("w3", RNG.standard_normal((8, 16, 3, 3)).astype(f32) * 0.3)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["conv"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["conv", "lo", "hi"], ["act"]),
             helper.make_node("MaxPool", ["act"], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                              ceil_mode=1),
             helper.make_node("Conv", ["pool", "w2"], ["conv2"], strides=[2, 1], pads=[0, 1, 1, 0]),
             helper.make_node("BatchNormalization", ["conv2", "scale", "bias", "mean", "var"], ["bn"]),
             helper.make_node("HardSwish", ["bn"], ["hs"]),
             helper.make_node("AveragePool", ["hs"], ["avg"], kernel_shape=[2, 2], pads=[0, 0, 1, 1]),
             helper.make_node("Conv", ["hs", "w3"], ["conv3"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["act", "k"], ["twice"]),
             helper.make_node("ReduceSum", ["pool"], ["total"], keepdims=0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 64, 66])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
            for n in ("avg", "conv", "twice", "total", "conv3")]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_region_values_match_onnxruntime(region_outputs):
    model = _model()
    recorded = region_outputs
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = OnnxRunner(model)
    jitted = runner.jit()
    # (jit()'s first call runs the graph plainly, its second captures, its third replays)
    for i in range(3):
        x = RNG.standard_normal((2, 3, 64, 66)).astype(np.float32)
        for (name, g), w in zip(jitted({"x": x}).items(), sess.run(None, {"x": x})):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"call {i}: {name}")
    # (the ops of the region computed there; the Mul, ReduceSum and stride-1 conv outside it)
    assert set(recorded) == {"conv", "act", "pool", "conv2", "bn", "hs", "avg"}
    # (copied into ONNX's layout: the outputs and what the stride-1 conv reads; the pool's copy is marked for the
    # strided conv, which reads the channels-last data, so it is never made; the rest is read in place)
    assert runner.graph.copied & set(recorded) == {"conv", "avg", "hs", "pool"}


@pytest.mark.parametrize("attrs,weight,region", [
    ({"strides": [2, 2]}, (8, 3, 3, 3), True),
    ({"strides": [1, 2], "pads": [1, 1, 1, 1]}, (16, 4, 3, 3), True),
    ({"strides": [2, 2]}, (16, 3, 5, 5), True),
    ({"strides": [1, 1]}, (8, 3, 3, 3), False),          # stride 1
    ({"strides": [2, 2]}, (4, 3, 3, 3), False),          # fewer output channels than a vector
    ({"strides": [2, 2]}, (8, 3, 1, 1), False),          # a 1x1 window
    ({"strides": [2, 2], "group": 3}, (9, 1, 3, 3), False),   # grouped
])
def test_which_convolutions_start_a_region(attrs, weight, region):
    # (2 x 8 x 32 x 32 results of a stride-2 convolution: MIN_RESULTS)
    x = Tensor.ones(2, weight[1] * attrs.get("group", 1), 64, 64)
    assert layout.starts_region("Conv", [x, Tensor.ones(*weight)], attrs) is region
    assert not layout.starts_region("Conv", [x.cast("float16"), Tensor.ones(*weight).cast("float16")], attrs)
    # (too few results to begin a region, unless the convolution reads one)
    small = Tensor.ones(1, weight[1] * attrs.get("group", 1), 16, 16)
    assert not layout.starts_region("Conv", [small, Tensor.ones(*weight)], attrs)
    assert layout.starts_region("Conv", [small, Tensor.ones(*weight)], attrs, 0) is region
