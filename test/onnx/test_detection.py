"""NonMaxSuppression and RoiAlign: ONNX's node cases (test_node_cases.py) check the documented examples; here random
cases against onnxruntime, NonMaxSuppression under TinyJit, and bad inputs that name the node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402


def _model(op: str, inputs: dict[str, np.ndarray], out_type: int, opset: int = 16, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), ["y"], name="det_node", **attrs)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items()]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _nms_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 10, (2, 30, 2)).astype(np.float32)
    size = rng.uniform(0.5, 4, (2, 30, 2)).astype(np.float32)
    boxes = np.concatenate([corner, corner + size], -1)
    scores = rng.random((2, 3, 30)).astype(np.float32)
    scores[0, 0, :4] = 0.5  # equal scores keep the lower index first
    return {"boxes": boxes, "scores": scores, "max": np.array([7], np.int64), "iou": np.array([0.3], np.float32),
            "score": np.array([0.2], np.float32)}


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_nms_random_matches_onnxruntime(center_point_box):
    feed = _nms_inputs(center_point_box)
    model = _model("NonMaxSuppression", feed, TensorProto.INT64, 11, center_point_box=center_point_box)
    want = _ort(model, feed)
    got = OnnxRunner(model)({k: Tensor(v).realize() for k, v in feed.items()})["y"].numpy()
    assert got.dtype == np.int64 and len(want) > 10
    np.testing.assert_array_equal(got, want)


def test_nms_under_tinyjit_needs_host_known_boxes():
    feed = _nms_inputs(2)
    runner = OnnxRunner(_model("NonMaxSuppression", feed, TensorProto.INT64, 11))
    step = TinyJit(lambda b, s: runner({"boxes": b, "scores": s, "max": feed["max"], "iou": feed["iou"],
                                        "score": feed["score"]})["y"].realize())
    with pytest.raises(OnnxUnsupportedError, match=r"det_node.*NonMaxSuppression.*boxes computed on the device under "
                                                   r"TinyJit"):
        for _ in range(3): step(Tensor(feed["boxes"]).realize(), Tensor(feed["scores"]).realize())


@pytest.mark.parametrize("mode,sampling_ratio,ctm", [("avg", 0, "half_pixel"), ("avg", 2, "output_half_pixel"),
                                                     ("max", 2, "half_pixel"), ("max", 0, "output_half_pixel")])
def test_roi_align_random_matches_onnxruntime(mode, sampling_ratio, ctm):
    rng = np.random.default_rng(sampling_ratio)
    x = rng.standard_normal((2, 3, 12, 10)).astype(np.float32)
    start = rng.uniform(-2, 8, (6, 2))
    rois = np.concatenate([start, start + rng.uniform(0.5, 12, (6, 2))], 1).astype(np.float32)
    feed = {"x": x, "rois": rois, "bi": np.array([0, 1, 1, 0, 1, 0], np.int64)}
    model = _model("RoiAlign", feed, TensorProto.FLOAT, mode=mode, sampling_ratio=sampling_ratio,
                   coordinate_transformation_mode=ctm, output_height=3, output_width=4, spatial_scale=0.8)
    want = _ort(model, feed)
    got = OnnxRunner(model)({k: Tensor(v).realize() for k, v in feed.items()})["y"].numpy()
    assert got.shape == want.shape == (6, 3, 3, 4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_roi_align_under_jit_follows_each_calls_rois():
    # a fixed sampling grid runs wholly on the device: one capture serves rois that change between calls; the
    # adaptive grid (sampling_ratio 0) sizes its samples from the rois and is refused there
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 8, 8)).astype(np.float32)
    feed = {"x": x, "rois": np.zeros((3, 4), np.float32), "bi": np.zeros(3, np.int64)}
    model = _model("RoiAlign", feed, TensorProto.FLOAT, sampling_ratio=2, output_height=2, output_width=2)
    run = OnnxRunner(model).jit()
    for _ in range(4):
        start = rng.uniform(0, 4, (3, 2))
        feed["rois"] = np.concatenate([start, start + rng.uniform(1, 4, (3, 2))], 1).astype(np.float32)
        np.testing.assert_allclose(run(feed)["y"], _ort(model, feed), rtol=1e-4, atol=1e-5)
    adaptive = OnnxRunner(_model("RoiAlign", feed, TensorProto.FLOAT, output_height=2, output_width=2)).jit()
    with pytest.raises(OnnxUnsupportedError, match=r"det_node.*RoiAlign.*rois \(with sampling_ratio 0\) computed on "
                                                   r"the device under TinyJit"):
        for _ in range(3): adaptive(feed)


def test_bad_inputs_name_the_node():
    feed = _nms_inputs(3)
    feed["scores"] = feed["scores"][:, :, :5]
    with pytest.raises(OnnxNodeError, match=r"det_node.*NonMaxSuppression.*scores must be \(batches, classes, boxes\)"):
        OnnxRunner(_model("NonMaxSuppression", feed, TensorProto.INT64, 11))(feed)
    feed = {"x": np.zeros((1, 1, 4, 4), np.float32), "rois": np.zeros((2, 4), np.float32),
            "bi": np.zeros(2, np.int64)}
    with pytest.raises(OnnxNodeError, match=r"det_node.*RoiAlign.*mode must be avg or max"):
        OnnxRunner(_model("RoiAlign", feed, TensorProto.FLOAT, mode="min"))(feed)
