"""ImageDecoder against the pixels that were encoded (lossless PNG and BMP, whatever mode the file has), and its
errors naming the node. ONNX's own cases (JPEG, JPEG 2000, TIFF, WebP...) run in test_node_cases.py."""
from __future__ import annotations

import io
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
Image = pytest.importorskip("PIL.Image")
from onnx import TensorProto as TP, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402

RNG = np.random.default_rng(0)


def _model(pixel_format: str):
    node = helper.make_node("ImageDecoder", ["x"], ["y"], pixel_format=pixel_format, name="dec")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.UINT8, [None])],
                          [helper.make_tensor_value_info("y", TP.UINT8, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _encoded(pixels: np.ndarray, fmt: str) -> np.ndarray:
    """The pixels (gray, RGB or RGBA by their channels) encoded in the format."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return np.frombuffer(buf.getvalue(), np.uint8)


@pytest.mark.parametrize("fmt", ["PNG", "BMP"])
def test_rgb_bgr_and_alpha_dropped(fmt):
    rgba = RNG.integers(0, 256, (5, 7, 4), dtype=np.uint8)
    rgba[..., 3] = 255 if fmt == "BMP" else rgba[..., 3]
    stream = _encoded(rgba if fmt == "PNG" else rgba[..., :3], fmt)
    rgb = OnnxRunner(_model("RGB"))({"x": stream})["y"].numpy()
    bgr = OnnxRunner(_model("BGR"))({"x": stream})["y"].numpy()
    assert rgb.dtype == np.uint8 and rgb.shape == (5, 7, 3)
    np.testing.assert_array_equal(rgb, rgba[..., :3])
    np.testing.assert_array_equal(bgr, rgba[..., 2::-1])


def test_grayscale_of_a_gray_image_and_of_rgb():
    gray = RNG.integers(0, 256, (4, 6), dtype=np.uint8)
    got = OnnxRunner(_model("Grayscale"))({"x": _encoded(gray, "PNG")})["y"].numpy()
    np.testing.assert_array_equal(got, gray[:, :, None])
    rgb = RNG.integers(0, 256, (4, 6, 3), dtype=np.uint8)
    got = OnnxRunner(_model("Grayscale"))({"x": _encoded(rgb, "PNG")})["y"].numpy()
    # ITU-R 601-2 luma, L = (299 R + 587 G + 114 B) / 1000, rounded (Pillow's conversion, within one level)
    want = (rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114]))[:, :, None]
    assert got.shape == (4, 6, 1) and np.abs(got - want).max() <= 1


def test_errors_name_the_node():
    with pytest.raises(OnnxNodeError, match=r"'dec' \(ImageDecoder\).*no image Pillow can decode"):
        OnnxRunner(_model("RGB"))({"x": np.arange(40, dtype=np.uint8)})
    with pytest.raises(OnnxNodeError, match=r"'dec' \(ImageDecoder\).*pixel_format must be RGB, BGR or Grayscale"):
        OnnxRunner(_model("CMYK"))({"x": _encoded(np.zeros((2, 2), np.uint8), "PNG")})


def test_without_pillow_the_node_says_what_to_install(monkeypatch):
    stream = _encoded(np.zeros((2, 2), np.uint8), "PNG")
    monkeypatch.setitem(sys.modules, "PIL", None)   # (an import of PIL now fails, as without the package)
    with pytest.raises(OnnxUnsupportedError, match=r"'dec' \(ImageDecoder\).*needs Pillow: pip install "
                                                   r"'fusegrad\[onnx-image\]'"):
        OnnxRunner(_model("RGB"))({"x": stream})
