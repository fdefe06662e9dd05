"""CenterCropPad and AffineGrid: their values are checked by ONNX's node cases (test_node_cases.py); here, bad inputs
name the node."""
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
