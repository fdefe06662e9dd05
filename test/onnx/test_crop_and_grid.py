"""CenterCropPad, AffineGrid and GridSample: ONNX's node cases (test_node_cases.py) check their values; here, GridSample
at points far outside the image against onnxruntime, and bad inputs that name the node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402


def _run(node, x: np.ndarray, const: np.ndarray) -> None:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(const, "c")])
    OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))({"x": x})


def test_center_crop_pad_bad_shape_names_the_node():
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(OnnxNodeError, match=r"'crop' \(CenterCropPad\).*shape has 1 sizes for 2 axes"):
        _run(helper.make_node("CenterCropPad", ["x", "c"], ["y"], name="crop"), x, np.array([3], np.int64))
    with pytest.raises(OnnxNodeError, match=r"'crop' \(CenterCropPad\).*size -1 for axis 1 is negative"):
        _run(helper.make_node("CenterCropPad", ["x", "c"], ["y"], axes=[1], name="crop"), x, np.array([-1], np.int64))


def test_affine_grid_bad_theta_names_the_node():
    theta = np.zeros((2, 3, 4), np.float32)   # a 3-D transform for a 2-D size
    with pytest.raises(OnnxNodeError, match=r"'grid' \(AffineGrid\).*theta must have shape \(2, 2, 3\)"):
        _run(helper.make_node("AffineGrid", ["x", "c"], ["y"], name="grid"), theta, np.array([2, 1, 4, 5], np.int64))


@pytest.mark.parametrize("mode", ["linear", "nearest", pytest.param("cubic", marks=pytest.mark.slow)])
def test_grid_sample_far_outside_matches_onnxruntime(mode):
    """Grid points up to three widths outside the image (reflected several times, clamped, or zero), against
    onnxruntime's kernel, for every padding mode and both corner alignments. Cubic with border padding is compared
    with ONNX's reference implementation instead: it moves only positions beyond the borders (-0.5 and size - 0.5
    without align_corners) to the edge pixels, so a position between a border and its pixel keeps taps outside, read
    as the edge pixel; onnxruntime's kernel gives other values there."""
    ort = pytest.importorskip("onnxruntime")
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    grid = rng.uniform(-3, 3, (2, 4, 6, 2)).astype(np.float32)
    for padding in ("zeros", "border", "reflection"):
        for align in (0, 1):
            node = helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode, padding_mode=padding,
                                    align_corners=align)
            graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                                                    helper.make_tensor_value_info("grid", TensorProto.FLOAT,
                                                                                  grid.shape)],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
            m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
            if mode == "cubic" and padding == "border":
                want = ReferenceEvaluator(m).run(None, {"x": x, "grid": grid})[0]
            else: want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
                None, {"x": x, "grid": grid})[0]
            got = OnnxRunner(m)({"x": x, "grid": grid})["y"].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{padding} align_corners={align}")


def test_grid_sample_bad_grid_names_the_node():
    x = np.zeros((1, 2, 4, 4), np.float32)
    with pytest.raises(OnnxNodeError, match=r"'gs' \(GridSample\).*grid must be \(N, \*out, 2\)"):
        _run(helper.make_node("GridSample", ["x", "c"], ["y"], name="gs"), x, np.zeros((1, 3, 3, 3), np.float32))
