"""The quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, and the integer matmul and conv
(MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv).

Integer products accumulate in int32, as ONNX specifies. Rounding is half to even (Tensor.round) and results
saturate to the range of the output type. Float products of scales are computed in float32, as onnxruntime does."""
from __future__ import annotations

from typing import Sequence

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import onnx_dtype
from fusegrad.onnx.ops import axis_of, conv, op

# the integer types a value can be quantized to, and their ranges
QUANT_RANGES: dict[DType, tuple[int, int]] = {
    dtypes.uint8: (0, 255), dtypes.int8: (-128, 127), dtypes.uint16: (0, 65535), dtypes.int16: (-32768, 32767),
}


def quant_param(v: Tensor, x: Tensor, axis: int, block_size: int = 0) -> Tensor:
    """A scale or zero point broadcastable against x: one value (per tensor), one per index of `axis` (per axis), or
    one per block of `block_size` indices along `axis` (blocked: v has x's shape with that dim divided, rounded up)."""
    if v.ndim == 0 or v.ndim == 1 and v.shape[0] == 1: return v.reshape(())
    a = axis_of(axis, x.ndim)
    if not block_size:
        if v.ndim != 1 or v.shape[0] != x.shape[a]:
            raise ValueError(f"a per-axis scale or zero point must have shape ({x.shape[a]},) (dim {a} of the input "
                             f"{tuple(x.shape)}), got {tuple(v.shape)}")
        return v.reshape(tuple(-1 if i == a else 1 for i in range(x.ndim)))
    if block_size < 0: raise ValueError(f"block_size must be positive, got {block_size}")
    want = tuple(-(-s // block_size) if i == a else s for i, s in enumerate(x.shape))
    if tuple(v.shape) != want:
        raise ValueError(f"a blocked scale or zero point for input {tuple(x.shape)} with block_size {block_size} on "
                         f"axis {a} must have shape {want}, got {tuple(v.shape)}")
    full = v.repeat_interleave(block_size, a)
    return full.shrink(tuple((0, x.shape[a]) if i == a else None for i in range(x.ndim)))


def saturate_to(v: Tensor, dt: DType) -> Tensor:
    """Clamp a float tensor of whole numbers to the range of the integer type dt and cast to it."""
    if dt not in QUANT_RANGES: raise Unsupported(f"quantized type {dt.name} (supported: uint8, int8, uint16, int16)")
    lo, hi = QUANT_RANGES[dt]
    return v.maximum(lo).minimum(hi).cast(dt)


def _quant_dtype(zero_point: Tensor | None, output_dtype: int) -> DType:
    if zero_point is not None:
        if output_dtype and onnx_dtype(output_dtype) != zero_point.dtype:
            raise ValueError(f"output_dtype {onnx_dtype(output_dtype).name} differs from the zero point's "
                             f"{zero_point.dtype.name}")
        return zero_point.dtype
    return onnx_dtype(output_dtype) if output_dtype else dtypes.uint8


@op("QuantizeLinear")
def quantize_linear(x: Tensor, scale: Tensor, zero_point: Tensor | None = None, *, axis: int = 1, block_size: int = 0,
                    output_dtype: int = 0, saturate: int = 1, precision: int = 0) -> Tensor:
    # `saturate` only changes float8 outputs, which have no fusegrad dtype: integer outputs always saturate
    dt = _quant_dtype(zero_point, output_dtype)
    if dt not in QUANT_RANGES: raise Unsupported(f"quantized type {dt.name} (supported: uint8, int8, uint16, int16)")
    work = onnx_dtype(precision) if precision else x.dtype
    q = (x.cast(work) / quant_param(scale, x, axis, block_size).cast(work)).round().cast(dtypes.float32)
    if zero_point is not None: q = q + quant_param(zero_point, x, axis, block_size).cast(dtypes.float32)
    return saturate_to(q, dt)


@op("DequantizeLinear")
def dequantize_linear(x: Tensor, scale: Tensor, zero_point: Tensor | None = None, *, axis: int = 1,
                      block_size: int = 0, output_dtype: int = 0) -> Tensor:
    if zero_point is not None and zero_point.dtype != x.dtype:
        raise ValueError(f"the zero point's dtype {zero_point.dtype.name} differs from the input's {x.dtype.name}")
    v = x.cast(dtypes.float32)
    if zero_point is not None: v = v - quant_param(zero_point, x, axis, block_size).cast(dtypes.float32)
    out = v * quant_param(scale, x, axis, block_size).cast(dtypes.float32)
    return out.cast(onnx_dtype(output_dtype) if output_dtype else scale.dtype)


@op("DynamicQuantizeLinear")
def dynamic_quantize_linear(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # the range always includes 0, so that 0 is exact; uint8 only
    xf = x.cast(dtypes.float32)
    hi, lo = xf.max().maximum(0.0), xf.min().minimum(0.0)
    scale = (hi == lo).where(1.0, hi - lo) / 255.0
    zp = (0.0 - lo / scale).maximum(0.0).minimum(255.0).round()
    y = saturate_to((xf / scale).round() + zp, dtypes.uint8)
    return y, scale.cast(x.dtype), zp.cast(dtypes.uint8)


def _centered(v: Tensor, zero_point: Tensor | None, per: str, dim: int) -> Tensor:
    """v - zero_point in int32. A 1-D zero point with more than one value is per row of the left operand of a matmul
    (per="row"), per column of the right one (per="col"), or per output channel of a conv weight (per="channel")."""
    out = v.cast(dtypes.int32)
    if zero_point is None: return out
    zp = zero_point.cast(dtypes.int32)
    if zp.ndim == 1 and zp.shape[0] > 1:
        if zp.shape[0] != v.shape[dim]:
            raise ValueError(f"a zero point of shape {tuple(zp.shape)} must have one value per {per} "
                             f"({v.shape[dim]}) of the input {tuple(v.shape)}")
        if per == "row": zp = zp.reshape(-1, 1)
        elif per == "channel": zp = zp.reshape((-1,) + (1,) * (v.ndim - 1))
    elif zp.numel() == 1: zp = zp.reshape(())
    return out - zp


@op("MatMulInteger")
def matmul_integer(a: Tensor, b: Tensor, a_zero_point: Tensor | None = None,
                   b_zero_point: Tensor | None = None) -> Tensor:
    return _centered(a, a_zero_point, "row", -2 if a.ndim > 1 else 0) @ \
        _centered(b, b_zero_point, "col", -1)


def _conv_attrs(auto_pad: str, dilations: Sequence[int] | None, group: int, kernel_shape: Sequence[int] | None,
                pads: Sequence[int] | None, strides: Sequence[int] | None) -> dict:
    return {"auto_pad": auto_pad, "dilations": dilations, "group": group, "kernel_shape": kernel_shape,
            "pads": pads, "strides": strides}


@op("ConvInteger")
def conv_integer(x: Tensor, w: Tensor, x_zero_point: Tensor | None = None, w_zero_point: Tensor | None = None, *,
                 auto_pad: str = "NOTSET", dilations: Sequence[int] | None = None, group: int = 1,
                 kernel_shape: Sequence[int] | None = None, pads: Sequence[int] | None = None,
                 strides: Sequence[int] | None = None) -> Tensor:
    # the zero point is subtracted before padding, so padded positions count as the real value 0
    return conv(_centered(x, x_zero_point, "tensor", 0), _centered(w, w_zero_point, "channel", 0),
                **_conv_attrs(auto_pad, dilations, group, kernel_shape, pads, strides))


def _requantize(acc: Tensor, multiplier: Tensor, y_zero_point: Tensor | None, dt: DType) -> Tensor:
    q = (acc.cast(dtypes.float32) * multiplier).round()
    if y_zero_point is not None: q = q + y_zero_point.cast(dtypes.float32).reshape(())
    return saturate_to(q, dt)


def _scale(s: Tensor) -> Tensor: return s.cast(dtypes.float32)


@op("QLinearMatMul")
def qlinear_matmul(a: Tensor, a_scale: Tensor, a_zero_point: Tensor | None, b: Tensor, b_scale: Tensor,
                   b_zero_point: Tensor | None, y_scale: Tensor, y_zero_point: Tensor | None = None) -> Tensor:
    acc = matmul_integer(a, b, a_zero_point, b_zero_point)
    sa, sb = _scale(a_scale), _scale(b_scale)
    if sa.ndim == 1 and sa.shape[0] > 1: sa = sa.reshape(-1, 1)  # per row of a
    mult = sa * sb / _scale(y_scale).reshape(())
    return _requantize(acc, mult, y_zero_point, y_zero_point.dtype if y_zero_point is not None else a.dtype)


@op("QLinearConv")
def qlinear_conv(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, w: Tensor, w_scale: Tensor,
                 w_zero_point: Tensor | None, y_scale: Tensor, y_zero_point: Tensor | None = None,
                 bias: Tensor | None = None, *, auto_pad: str = "NOTSET", dilations: Sequence[int] | None = None,
                 group: int = 1, kernel_shape: Sequence[int] | None = None, pads: Sequence[int] | None = None,
                 strides: Sequence[int] | None = None) -> Tensor:
    acc = conv_integer(x, w, x_zero_point, w_zero_point,
                       **_conv_attrs(auto_pad, dilations, group, kernel_shape, pads, strides))
    if bias is not None: acc = acc + bias.cast(dtypes.int32).reshape((-1,) + (1,) * (acc.ndim - 2))
    sw = _scale(w_scale)
    if sw.numel() > 1:
        if sw.ndim != 1 or sw.shape[0] != w.shape[0]:
            raise ValueError(f"w_scale of shape {tuple(sw.shape)} must have one value per output channel "
                             f"({w.shape[0]})")
        sw = sw.reshape((-1,) + (1,) * (acc.ndim - 2))
    else: sw = sw.reshape(())
    mult = _scale(x_scale).reshape(()) * sw / _scale(y_scale).reshape(())
    return _requantize(acc, mult, y_zero_point, y_zero_point.dtype if y_zero_point is not None else x.dtype)
