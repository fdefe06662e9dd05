"""ImageDecoder: an encoded image (JPEG, PNG, BMP, TIFF, WebP, JPEG 2000, PNM: what Pillow reads) decoded on the host
into a (height, width, channels) uint8 tensor. Pillow is an optional dependency (the `onnx-image` extra): a model with
the op loads without it, and the node says what to install when it runs."""
from __future__ import annotations

import io

import numpy as np

import fusegrad.engine.realize as _realize
from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import host_value, op, with_host

_MODES = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}


@op("ImageDecoder")
def image_decoder(encoded_stream: Tensor, *, pixel_format: str = "RGB") -> Tensor:
    """The image's pixels in `pixel_format`: RGB or BGR (three channels, converted from the file's own mode, alpha
    dropped) or Grayscale (one channel, ITU-R 601-2 luma as Pillow converts)."""
    if pixel_format not in _MODES:
        raise ValueError(f"pixel_format must be RGB, BGR or Grayscale, got {pixel_format!r}")
    if encoded_stream.dtype != dtypes.uint8 or encoded_stream.ndim != 1:
        raise ValueError(f"the encoded stream must be a 1-D uint8 tensor, got {encoded_stream.dtype.name} of shape "
                         f"{tuple(encoded_stream.shape)}")
    if _realize.capturing:
        raise Unsupported("ImageDecoder decodes on the host, which a TinyJit capture can't replay: call the runner "
                          "itself")
    try: from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise Unsupported("ImageDecoder needs Pillow: pip install 'fusegrad[onnx-image]'") from None
    data = np.asarray(host_value(encoded_stream), np.uint8).tobytes()
    try:
        with Image.open(io.BytesIO(data)) as img: pixels = np.asarray(img.convert(_MODES[pixel_format]))
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"the encoded stream ({len(data)} bytes) is no image Pillow can decode: {e}") from None
    if pixel_format == "BGR": pixels = pixels[:, :, ::-1]
    if pixels.ndim == 2: pixels = pixels[:, :, None]
    arr = np.ascontiguousarray(pixels, np.uint8)
    return with_host(Tensor(arr).realize(), arr)
