"""DeformConv: ONNX's node cases (test_node_cases.py) check the documented examples; here a random case with groups,
offset groups, a mask, strides, dilations and pads against onnxruntime, and bad inputs that name the node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402


def _model(feed: dict[str, np.ndarray], **attrs) -> onnx.ModelProto:
    node = helper.make_node("DeformConv", list(feed), ["y"], name="dc_node", **attrs)
    ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feed.items()]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_deform_conv_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    n, c, h, w, oc, kh, kw, g, og = 2, 4, 9, 8, 6, 3, 2, 2, 2
    oh, ow = (h + 1 + 2 - 2 * (kh - 1) - 1) // 2 + 1, (w + 0 + 1 - (kw - 1) - 1) // 1 + 1
    feed = {"x": rng.standard_normal((n, c, h, w)).astype(np.float32),
            "w": rng.standard_normal((oc, c // g, kh, kw)).astype(np.float32),
            "offset": (rng.standard_normal((n, og * kh * kw * 2, oh, ow)) * 2).astype(np.float32),
            "b": rng.standard_normal(oc).astype(np.float32),
            "mask": rng.random((n, og * kh * kw, oh, ow)).astype(np.float32)}
    model = _model(feed, group=g, offset_group=og, strides=[2, 1], dilations=[2, 1], pads=[1, 0, 2, 1])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = OnnxRunner(model)({k: Tensor(v).realize() for k, v in feed.items()})["y"].numpy()
    assert got.shape == want.shape == (n, oc, oh, ow)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_shapes_name_the_node():
    feed = {"x": np.zeros((1, 3, 5, 5), np.float32), "w": np.zeros((2, 3, 3, 3), np.float32),
            "offset": np.zeros((1, 10, 3, 3), np.float32)}
    with pytest.raises(OnnxNodeError, match=r"dc_node.*DeformConv.*offset must be \(1, 18, out_h, out_w\)"):
        OnnxRunner(_model(feed))(feed)
