"""Channels-last regions through residual blocks (fusegrad/onnx/layout.py): a dense convolution on short rows and a
residual join continue a region, so a ResNet-style block computes and stores channels-last; the values read anywhere,
graph outputs included, are those of onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.onnx import layout  # noqa: E402

RNG = np.random.default_rng(11)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto: return numpy_helper.from_array(arr, name)


def _model(batch: int) -> onnx.ModelProto:
    """x -> strided conv -> relu -> max pool -> [3x3 conv -> relu -> 3x3 conv (bias)] + pool -> relu -> [strided 3x3
    conv] + [strided 1x1 conv] -> relu -> global average pool; also read outside the region: the first block's sum
    by a Mul with a full image that isn't the region's (computed as usual), and by a stride-1 conv of 24 output
    channels (a copy into ONNX's layout), and the second block's sum as a graph output (a copy)."""
    f32 = np.float32
    def w(*shape: int) -> np.ndarray:
        return (RNG.standard_normal(shape) * (2.0 / np.prod(shape[1:])) ** 0.5).astype(f32)
    inits = [_init("w0", w(16, 3, 3, 3)), _init("w1", w(16, 16, 3, 3)), _init("w2", w(16, 16, 3, 3)),
             _init("b2", RNG.standard_normal(16).astype(f32)), _init("w3", w(32, 16, 3, 3)),
             _init("wp", w(32, 16, 1, 1)), _init("w4", w(24, 16, 3, 3)),
             _init("other", RNG.standard_normal((1, 16, 8, 8)).astype(f32))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["p0", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "p0"], ["s1"]),
             helper.make_node("Relu", ["s1"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["r2", "wp"], ["proj"], strides=[2, 2]),
             helper.make_node("Add", ["proj", "c3"], ["s2"]),
             helper.make_node("Relu", ["s2"], ["r3"]),
             helper.make_node("GlobalAveragePool", ["r3"], ["avg"]),
             helper.make_node("Mul", ["s1", "other"], ["scaled"]),
             helper.make_node("Conv", ["r2", "w4"], ["c4"], pads=[1, 1, 1, 1])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 32, 32])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("avg", "s2", "scaled", "c4")]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_residual_blocks_match_onnxruntime(region_outputs):
    model = _model(8)
    recorded = region_outputs
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted = OnnxRunner(model).jit()
    # (jit()'s first call runs the graph plainly, its second captures, its third replays)
    for i in range(3):
        x = RNG.standard_normal((8, 3, 32, 32)).astype(np.float32)
        for (name, g), want in zip(jitted({"x": x}).items(), sess.run(None, {"x": x})):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"call {i}: {name}")
    # (the stride-1 convolutions of 16 channels over 8x8 images, the strided 1x1 projection and both residual joins
    # computed in the region; the Mul with a full image of its own and the 24-channel convolution outside it)
    assert set(recorded) == {"c0", "r0", "p0", "c1", "r1", "c2", "s1", "r2", "c3", "proj", "s2", "r3"}


@pytest.mark.parametrize("shape,weight,attrs,stays", [
    ((16, 16, 8, 8), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    ((2, 32, 4, 4), (32, 32, 3, 3), {"pads": [1, 1, 1, 1]}, True),
    ((2, 16, 8, 8), (32, 16, 1, 1), {"strides": [2, 2]}, True),            # a strided 1x1 projection
    ((2, 64, 8, 8), (64, 64, 1, 1), {}, True),                             # 1x1: no Winograd
    ((2, 16, 31, 31), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}, True),       # 31 wide
    ((2, 16, 8, 8), (32, 16, 3, 3), {"strides": [2, 2]}, True),            # strided: as starts_region
    ((2, 16, 32, 32), (16, 16, 3, 3), {"pads": [1, 1, 1, 1]}, False),      # 32 wide
    ((2, 16, 8, 8), (24, 16, 3, 3), {"pads": [1, 1, 1, 1]}, False),        # not whole vectors of channels
    ((2, 64, 8, 8), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}, False),        # Winograd's size
    ((2, 16, 8, 8), (16, 8, 3, 3), {"pads": [1, 1, 1, 1], "group": 2}, False),
    ((2, 16, 8, 8), (16, 16, 3, 3), {"auto_pad": "SAME_UPPER"}, False),
])
def test_which_convolutions_continue_a_region(shape, weight, attrs, stays):
    args = [Tensor.ones(*shape), Tensor.ones(*weight)]
    assert layout.continues_region("Conv", args, attrs) is stays
    assert not layout.continues_region("Conv", [a.cast("float16") for a in args], attrs)
    # (an elementwise op or a pool always does)
    assert layout.continues_region("Relu", args[:1], {}) and layout.continues_region("MaxPool", args[:1], {})


def test_binary_ops_join_only_region_values():
    region = layout.Region(set())
    a, b = Tensor.randn(2, 16, 4, 4), Tensor.randn(2, 16, 4, 4)
    for name, t in (("a", a), ("b", b)): region.output(name, t)
    scale, full = Tensor.randn(1, 16, 1, 1), Tensor.randn(2, 16, 4, 4)
    # (two values of the region and a per-channel scale: in the region, each read through a channel-first view)
    got = region.inputs("Add", ["a", "b"], [region.views["a"], region.views["b"]], {})
    assert got is not None and len(got) == 2
    np.testing.assert_allclose((got[0] + got[1]).numpy(), a.numpy() + b.numpy(), rtol=1e-6)
    assert region.inputs("Sum", ["a", "b", "s"], [a, b, scale], {}) is not None
    # (one value of the region, or a full image that isn't the region's: computed as usual)
    assert region.inputs("Add", ["a", "s"], [a, scale], {}) is None
    assert region.inputs("Add", ["a", "b", "f"], [a, b, full], {}) is None
    assert region.inputs("Mul", ["x", "y"], [full, full], {}) is None
