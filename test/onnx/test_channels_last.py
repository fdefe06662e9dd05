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
    """x -> strided conv (bias) -> clip -> max pool (ceil mode) -> strided conv -> hard swish -> average pool, with the
    first conv and the clip also read by ops outside the region and given as outputs."""
    f32 = np.float32
    inits = [_init("w1", RNG.standard_normal((8, 3, 3, 3)).astype(f32)),
             _init("b1", RNG.standard_normal(8).astype(f32)),
             _init("lo", np.array(-0.5, f32)), _init("hi", np.array(1.5, f32)),
             _init("w2", RNG.standard_normal((16, 8, 3, 3)).astype(f32) * 0.3),
             _init("scale", RNG.random(16).astype(f32) + 0.5), _init("bias", RNG.standard_normal(16).astype(f32)),
             _init("mean", RNG.standard_normal(16).astype(f32)), _init("var", RNG.random(16).astype(f32) + 0.1),
             _init("k", np.array(2.0, f32))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["conv"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["conv", "lo", "hi"], ["act"]),
             helper.make_node("MaxPool", ["act"], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                              ceil_mode=1),
             helper.make_node("Conv", ["pool", "w2"], ["conv2"], strides=[2, 1], pads=[0, 1, 1, 0]),
             helper.make_node("BatchNormalization", ["conv2", "scale", "bias", "mean", "var"], ["bn"]),
             helper.make_node("HardSwish", ["bn"], ["hs"]),
             helper.make_node("AveragePool", ["hs"], ["avg"], kernel_shape=[2, 2], pads=[0, 0, 1, 1]),
             helper.make_node("Mul", ["act", "k"], ["twice"]),
             helper.make_node("ReduceSum", ["pool"], ["total"], keepdims=0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 19, 17])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("avg", "conv", "twice", "total")]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_region_values_match_onnxruntime(monkeypatch):
    model = _model()
    recorded: list[str] = []
    original = layout.Region.output

    def spy(self, name, out):
        recorded.append(name)
        return original(self, name, out)
    monkeypatch.setattr(layout.Region, "output", spy)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = OnnxRunner(model)
    jitted = runner.jit()
    x = RNG.standard_normal((2, 3, 19, 17)).astype(np.float32)
    for name, g in runner({"x": x}).items():
        np.testing.assert_allclose(g.numpy(), sess.run([name], {"x": x})[0], rtol=1e-5, atol=1e-5, err_msg=name)
    # (under jit(): captured on the second call, replayed on the third)
    for i in range(3):
        x = RNG.standard_normal((2, 3, 19, 17)).astype(np.float32)
        for (name, g), w in zip(jitted({"x": x}).items(), sess.run(None, {"x": x})):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"call {i}: {name}")
    # (the ops of the region computed there; the Mul and ReduceSum outside it)
    assert set(recorded) == {"conv", "act", "pool", "conv2", "bn", "hs", "avg"}


@pytest.mark.parametrize("attrs,weight,region", [
    ({"strides": [2, 2]}, (8, 3, 3, 3), True),
    ({"strides": [1, 2], "pads": [1, 1, 1, 1]}, (16, 4, 3, 3), True),
    ({"strides": [1, 1]}, (8, 3, 3, 3), False),          # stride 1
    ({"strides": [2, 2]}, (4, 3, 3, 3), False),          # fewer output channels than a vector
    ({"strides": [2, 2]}, (8, 3, 1, 1), False),          # a 1x1 window
    ({"strides": [2, 2], "group": 3}, (9, 1, 3, 3), False),   # grouped
])
def test_which_convolutions_start_a_region(attrs, weight, region):
    x = Tensor.ones(1, weight[1] * attrs.get("group", 1), 9, 9)
    assert layout.starts_region("Conv", [x, Tensor.ones(*weight)], attrs) is region
    assert not layout.starts_region("Conv", [x.cast("float16"), Tensor.ones(*weight).cast("float16")], attrs)
