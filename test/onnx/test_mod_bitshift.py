"""Mod and BitShift at their edges: the float floor remainder by 0 and by +-inf and the sign of a zero remainder
(NumPy's np.mod, which ONNX's reference and onnxruntime's opset-28 kernel follow), and shifts by the bit width or more
or by a negative amount (every bit shifted out: 0, or -1 for a right shift of a negative value, as NumPy gives)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402


def _model(op: str, dtype: np.dtype, opset: int = 21, **attrs) -> onnx.ModelProto:
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = helper.make_node(op, ["x", "y"], ["z"], name="the_node", **attrs)
    ins = [helper.make_tensor_value_info(n, t, None) for n in ("x", "y")]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("z", t, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return OnnxRunner(model)({"x": x, "y": y})["z"].numpy()


EDGE_X = [0.0, -0.0, 0.0, -0.0, -3.0, 3.0, -1.0, 1.0, np.inf, -np.inf, 1.0, 1.0, np.nan, 1.0, 5.5, -5.5, 4.0, -4.0]
EDGE_Y = [-2.0, 2.0, 2.0, -2.0, np.inf, np.inf, -np.inf, -np.inf, 2.0, 2.0, 0.0, -0.0, 2.0, np.nan, -2.0, 2.0, -2.0,
          2.0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("fmod", [0, 1])
def test_float_mod_edges_match_numpy_with_signed_zeros(dtype, fmod):
    x, y = np.array(EDGE_X, dtype), np.array(EDGE_Y, dtype)
    with np.errstate(all="ignore"): want = np.fmod(x, y) if fmod else np.mod(x, y)
    got = _run(_model("Mod", dtype, fmod=fmod), x, y)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg="the signs of the zeros")


def test_float_mod_random_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 33)) * 10).astype(np.float32)
    y = (rng.standard_normal((1, 33)) * 3).astype(np.float32)
    y[0, :3] = [np.inf, -np.inf, 0.0]
    for fmod in (0, 1):
        # onnxruntime takes the floor remainder of floats from opset 28 on
        model = _model("Mod", np.float32, opset=28, fmod=fmod)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x, "y": y})[0]
        got = _run(model, x, y)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_shift_by_any_amount_matches_numpy(dtype, direction):
    info = np.iinfo(dtype)
    width = info.bits
    rng = np.random.default_rng(width)
    x = rng.integers(info.min, info.max, 40, dtype=dtype, endpoint=True)
    lo = -2 * width if info.min < 0 else 0
    y = np.resize(np.array([*range(lo, min(2 * width, int(info.max))), int(info.max)], dtype), 40)
    x[:4] = [info.min, info.max, 0, 1] if info.min < 0 else [info.max, info.max - 1, 0, 1]
    # NumPy's shifts give every bit shifted out for amounts of the width or more (and negative ones)
    want = np.left_shift(x, y) if direction == "LEFT" else np.right_shift(x, y)
    np.testing.assert_array_equal(_run(_model("BitShift", dtype, direction=direction), x, y), want)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.uint64])
def test_unsigned_shift_matches_onnxruntime(dtype):
    # onnxruntime takes only unsigned BitShift; it too gives 0 for a shift by the bit width or more
    ort = pytest.importorskip("onnxruntime")
    width = np.iinfo(dtype).bits
    rng = np.random.default_rng(1)
    x = rng.integers(0, np.iinfo(dtype).max, (3, 16), dtype=dtype, endpoint=True)
    y = rng.integers(0, 2 * width, (1, 16)).astype(dtype)
    y[0, :2] = [width, width - 1]
    for direction in ("LEFT", "RIGHT"):
        model = _model("BitShift", dtype, direction=direction)
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x, "y": y})[0]
        np.testing.assert_array_equal(_run(model, x, y), want)


def test_bad_attributes_name_the_node():
    x = np.array([1, 2], np.int32)
    with pytest.raises(OnnxNodeError, match=r"the_node.*BitShift.*direction must be LEFT or RIGHT"):
        _run(_model("BitShift", np.int32, direction="UP"), x, x)
    with pytest.raises(OnnxNodeError, match=r"the_node.*BitShift.*integers"):
        _run(_model("BitShift", np.float32, direction="LEFT"), x.astype(np.float32), x.astype(np.float32))
    with pytest.raises(OnnxNodeError, match=r"the_node.*Mod.*fmod must be 0 or 1"):
        _run(_model("Mod", np.float32, fmod=2), x.astype(np.float32), x.astype(np.float32))
