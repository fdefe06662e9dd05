"""Quantized ops with scales and zero points per channel (per axis), as onnxruntime's quantizer writes them with
per_channel=True, and blocked ones, on hand-built graphs against onnxruntime's kernels: integers compared exactly
(none of these inputs meets a tie)."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402

RNG = np.random.default_rng(3)
F = np.float32


def _run(node, feed: dict, inits: dict, opset: int = 21):
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feed.items()]
    graph = helper.make_graph([node], "g", ins, [helper.make_value_info("y", onnx.TypeProto())],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    m = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    return OnnxRunner(m)(feed)["y"].numpy(), want


def _equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("wt", [np.int8, np.uint8])
def test_qlinear_matmul_per_column(wt):
    """B's scale and zero point per output column (a uint8 B with zero points away from 0), A per tensor, and a
    batch of A matrices."""
    k, n = 24, 6
    lo, hi = (-64, 64) if wt == np.int8 else (0, 128)
    inits = {"as": np.array(0.02, F), "az": np.array(120, np.uint8), "b": RNG.integers(lo, hi, (k, n)).astype(wt),
             "bs": (RNG.random(n) * 0.01 + 0.002).astype(F),
             "bz": (np.zeros(n) if wt == np.int8 else RNG.integers(50, 80, n)).astype(wt),
             "ys": np.array(0.3, F), "yz": np.array(100, np.uint8)}
    a = RNG.integers(0, 256, (2, 5, k)).astype(np.uint8)
    _equal(*_run(helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"]), {"a": a},
                 inits))


def test_qlinear_conv_per_output_channel():
    """The weights' scale per output channel, with a bias and a grouped conv."""
    w = RNG.integers(-60, 60, (8, 2, 3, 3)).astype(np.int8)
    inits = {"xs": np.array(0.05, F), "xz": np.array(128, np.uint8), "w": w,
             "ws": (RNG.random(8) * 0.01 + 0.002).astype(F), "wz": np.zeros(8, np.int8), "ys": np.array(0.2, F),
             "yz": np.array(90, np.uint8), "bias": RNG.integers(-500, 500, 8).astype(np.int32)}
    x = RNG.integers(0, 256, (2, 4, 7, 7)).astype(np.uint8)
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "bias"], ["y"], group=2,
                            pads=[1, 1, 1, 1], strides=[2, 1])
    _equal(*_run(node, {"x": x}, inits))


@pytest.mark.parametrize("axis,block", [(0, 0), (1, 0), (-1, 0), (1, 4), (0, 3)])
def test_quantize_dequantize_per_axis_and_blocked(axis, block):
    x = (RNG.standard_normal((6, 10)) * 3).astype(F)
    dim = x.shape[axis]
    count = dim if not block else -(-dim // block)
    pshape = (count,) if not block else tuple(count if i == axis % 2 else s for i, s in enumerate(x.shape))
    inits = {"s": (RNG.random(pshape) * 0.05 + 0.01).astype(F), "z": RNG.integers(-20, 20, pshape).astype(np.int8)}
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    q, want_q = _run(helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], **attrs), {"x": x}, inits)
    _equal(q, want_q)
    d, want_d = _run(helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], **attrs), {"q": want_q}, inits)
    np.testing.assert_array_equal(d, want_d)


def test_per_channel_errors_name_the_node():
    x = np.zeros((2, 4, 5), np.uint8)
    inits = {"s": np.full(3, 0.1, F), "z": np.zeros(3, np.uint8), "one": np.array(0.1, F), "z0": np.array(0, np.uint8)}

    def run(node):
        m = helper.make_model(helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, x.shape)],
            [helper.make_value_info("y", onnx.TypeProto())],
            initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()]),
            opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
        OnnxRunner(m)({"x": x})
    # a per-axis scale whose length is not the axis' size
    with pytest.raises(OnnxNodeError, match=r"'dq' \(DequantizeLinear\).*must have shape \(4,\)"):
        run(helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"], axis=1, name="dq"))
    # onnxruntime's QLinearAdd takes scales and zero points per tensor only
    with pytest.raises(OnnxUnsupportedError, match=r"'add' \(QLinearAdd\).*only per-tensor"):
        run(helper.make_node("QLinearAdd", ["x", "s", "z", "x", "one", "z0", "one", "z0"], ["y"],
                             domain="com.microsoft", name="add"))
