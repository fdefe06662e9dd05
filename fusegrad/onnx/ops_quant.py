"""The quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, the integer matmul and conv
(MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv), and the com.microsoft ops of onnxruntime's quantization
tools (QLinearAdd, QLinearMul, QLinearSigmoid, QLinearLeakyRelu, QLinearAveragePool, QLinearGlobalAveragePool,
QLinearConcat, QLinearWhere, QLinearSoftmax, QGemm, MatMulIntegerToFloat, DynamicQuantizeMatMul, QAttention).

Integer products accumulate in int32, as ONNX specifies. Rounding is half to even (Tensor.round) and results
saturate to the range of the output type. Float products of scales are computed in float32, as onnxruntime does."""
from __future__ import annotations

from typing import Sequence

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx import narrow
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import onnx_dtype
from fusegrad.onnx.ops import avg_pool, axis_of, conv, op
from fusegrad.onnx.ops_contrib import packed_attention

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
    # (a NaN goes to the bottom of the range, as in onnx's reference and onnxruntime: the clamps would keep it, and a
    # NaN cast to an integer type is undefined in C)
    return v.isnan().where(lo, v).maximum(lo).minimum(hi).cast(dt)


def _quant_type(zero_point: Tensor | None, output_dtype: int) -> DType | int:
    """The quantized type: a fusegrad dtype, or the ONNX type of an 8-, 6-, 4- or 2-bit one."""
    zp_type: DType | int | None = None
    if zero_point is not None:
        zp_type = t if (t := narrow.narrow_type(zero_point)) is not None else zero_point.dtype
    if output_dtype:
        out: DType | int = output_dtype if output_dtype in narrow.NARROW else onnx_dtype(output_dtype)
        if zp_type is not None and zp_type != out:
            raise ValueError(f"output_dtype {_type_name(out)} differs from the zero point's {_type_name(zp_type)}")
        return out
    return zp_type if zp_type is not None else dtypes.uint8


def _type_name(t: DType | int) -> str: return narrow.NARROW[t].name if isinstance(t, int) else t.name


@op("QuantizeLinear")
def quantize_linear(x: Tensor, scale: Tensor, zero_point: Tensor | None = None, *, axis: int = 1, block_size: int = 0,
                    output_dtype: int = 0, saturate: int = 1, precision: int = 0) -> Tensor:
    # `saturate` only changes float8 outputs: integer outputs always saturate
    dt = _quant_type(zero_point, output_dtype)
    if isinstance(dt, DType) and dt not in QUANT_RANGES:
        raise Unsupported(f"quantized type {dt.name} (supported: uint8, int8, uint16, int16 and the 8-, 6-, 4- and "
                          f"2-bit types)")
    if isinstance(dt, int) and narrow.NARROW[dt].fmt == "e8m0":
        # (FLOAT8E8M0 is a type of scales: the spec's output types don't include it, nor does onnx's reference)
        raise ValueError("QuantizeLinear can't quantize to FLOAT8E8M0, which the spec allows only as a scale's type")
    work = onnx_dtype(precision) if precision else x.dtype
    q = x.cast(work) / quant_param(narrow.values(scale), x, axis, block_size).cast(work)
    zp = None if zero_point is None else quant_param(narrow.values(zero_point), x, axis, block_size)
    if isinstance(dt, int) and isinstance(narrow.NARROW[dt].fmt, narrow.FloatFormat):
        # a float format: x / scale + zero point, rounded to the format
        return narrow.round_to(q if zp is None else q + zp.cast(q.dtype), dt, bool(saturate))
    q = q.round().cast(dtypes.float32)
    if zp is not None: q = q + zp.cast(dtypes.float32)
    return narrow.saturate_int(q, dt) if isinstance(dt, int) else saturate_to(q, dt)


@op("DequantizeLinear")
def dequantize_linear(x: Tensor, scale: Tensor, zero_point: Tensor | None = None, *, axis: int = 1,
                      block_size: int = 0, output_dtype: int = 0) -> Tensor:
    xt, zt = narrow.narrow_type(x), narrow.narrow_type(zero_point)
    if zero_point is not None and (zero_point.dtype != x.dtype or xt != zt):
        raise ValueError(f"the zero point's type {_type_name(zt if zt is not None else zero_point.dtype)} differs "
                         f"from the input's {_type_name(xt if xt is not None else x.dtype)}")
    # the spec's output types are float, float16 and bfloat16: a FLOAT8E8M0 scale needs output_dtype (onnx's checker
    # refuses the scale's type as the output's)
    if output_dtype in narrow.NARROW:
        raise ValueError(f"output_dtype {narrow.NARROW[output_dtype].name}: DequantizeLinear's output is float, "
                         f"float16 or bfloat16")
    if narrow.narrow_type(scale) is not None and not output_dtype:
        raise ValueError(f"a scale of type {narrow.NARROW[narrow.narrow_type(scale)].name} needs output_dtype "
                         f"(float, float16 or bfloat16): the output's type is the scale's without it")
    v = narrow.values(x).cast(dtypes.float32)
    if zero_point is not None: v = v - quant_param(narrow.values(zero_point), x, axis, block_size).cast(dtypes.float32)
    out = v * quant_param(narrow.values(scale), x, axis, block_size).cast(dtypes.float32)
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


# *** com.microsoft: the ops of onnxruntime's quantization tools (QOperator format and dynamic quantization) ***
#
# onnxruntime computes these in float32 between integer inputs and outputs, and so do they here: a dequantized value is
# (x - zero_point) * scale, a requantized one round_half_even(value / scale) + zero_point, saturated. The integers
# agree with onnxruntime's except where the exact value is a tie (x.5), which the float32 roundings of either (its
# kernels use fused multiply-adds, or sum dequantized values) may put on either side.

MS = "com.microsoft"


def _zp(zp: Tensor | None) -> Tensor | float:
    """A per-tensor zero point as a float32 scalar (0 where it is left out)."""
    if zp is None: return 0.0
    if zp.numel() != 1: raise Unsupported(f"a zero point of shape {tuple(zp.shape)} (only per-tensor ones)")
    return zp.reshape(()).cast(dtypes.float32)


def _s(scale: Tensor) -> Tensor:
    if scale.numel() != 1: raise Unsupported(f"a scale of shape {tuple(scale.shape)} (only per-tensor ones)")
    return scale.reshape(()).cast(dtypes.float32)


def _dequant(x: Tensor, scale: Tensor, zp: Tensor | None) -> Tensor:
    return (x.cast(dtypes.float32) - _zp(zp)) * _s(scale)


def _quant(v: Tensor, scale: Tensor, zp: Tensor | None, dt: DType) -> Tensor:
    return saturate_to((v / _s(scale)).round() + _zp(zp), dt)


def _out_dtype(zp: Tensor | None, like: Tensor) -> DType: return zp.dtype if zp is not None else like.dtype


@op("QLinearAdd", domain=MS)
def qlinear_add(a: Tensor, a_scale: Tensor, a_zero_point: Tensor | None, b: Tensor, b_scale: Tensor,
                b_zero_point: Tensor | None, c_scale: Tensor, c_zero_point: Tensor | None = None) -> Tensor:
    # each operand's scale over the output's, applied to its centered integers
    ra, rb = _s(a_scale) / _s(c_scale), _s(b_scale) / _s(c_scale)
    v = (a.cast(dtypes.float32) - _zp(a_zero_point)) * ra + (b.cast(dtypes.float32) - _zp(b_zero_point)) * rb
    return saturate_to(v.round() + _zp(c_zero_point), _out_dtype(c_zero_point, a))


@op("QLinearMul", domain=MS)
def qlinear_mul(a: Tensor, a_scale: Tensor, a_zero_point: Tensor | None, b: Tensor, b_scale: Tensor,
                b_zero_point: Tensor | None, c_scale: Tensor, c_zero_point: Tensor | None = None) -> Tensor:
    ratio = _s(a_scale) * _s(b_scale) / _s(c_scale)
    v = (a.cast(dtypes.float32) - _zp(a_zero_point)) * (b.cast(dtypes.float32) - _zp(b_zero_point)) * ratio
    return saturate_to(v.round() + _zp(c_zero_point), _out_dtype(c_zero_point, a))


@op("QLinearSigmoid", domain=MS)
def qlinear_sigmoid(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, y_scale: Tensor,
                    y_zero_point: Tensor | None = None) -> Tensor:
    return _quant(_dequant(x, x_scale, x_zero_point).sigmoid(), y_scale, y_zero_point, _out_dtype(y_zero_point, x))


@op("QLinearLeakyRelu", domain=MS)
def qlinear_leaky_relu(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, y_scale: Tensor,
                       y_zero_point: Tensor | None = None, *, alpha: float = 0.01) -> Tensor:
    v = _dequant(x, x_scale, x_zero_point)
    return _quant((v >= 0).where(v, v * alpha), y_scale, y_zero_point, _out_dtype(y_zero_point, x))


def _nchw(x: Tensor, channels_last: int) -> Tensor:
    return x.permute((0, x.ndim - 1) + tuple(range(1, x.ndim - 1))) if channels_last else x


def _back(y: Tensor, channels_last: int) -> Tensor:
    return y.permute((0,) + tuple(range(2, y.ndim)) + (1,)) if channels_last else y


@op("QLinearAveragePool", domain=MS)
def qlinear_average_pool(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, y_scale: Tensor,
                         y_zero_point: Tensor | None = None, *, auto_pad: str = "NOTSET", ceil_mode: int = 0,
                         channels_last: int = 0, count_include_pad: int = 0, kernel_shape: Sequence[int],
                         pads: Sequence[int] | None = None, strides: Sequence[int] | None = None) -> Tensor:
    # the average of the centered integers (padding counts as the real value 0), then rescaled
    centered = _nchw(x, channels_last).cast(dtypes.float32) - _zp(x_zero_point)
    avg = avg_pool(centered, auto_pad=auto_pad, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                   kernel_shape=kernel_shape, pads=pads, strides=strides)
    y = _quant(avg * _s(x_scale), y_scale, y_zero_point, _out_dtype(y_zero_point, x))
    return _back(y, channels_last)


@op("QLinearGlobalAveragePool", domain=MS)
def qlinear_global_average_pool(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, y_scale: Tensor,
                                y_zero_point: Tensor | None = None, *, channels_last: int = 0) -> Tensor:
    xc = _nchw(x, channels_last)
    axes = tuple(range(2, xc.ndim))
    n = 1
    for a in axes: n *= xc.shape[a]
    # the exact integer sum, rescaled once by x_scale / (y_scale * count)
    acc = (xc.cast(dtypes.int32) - _zp(x_zero_point).cast(dtypes.int32) if x_zero_point is not None
           else xc.cast(dtypes.int32)).sum(axes, keepdim=True, dtype=dtypes.int32)
    mult = _s(x_scale) / (_s(y_scale) * n)
    y = saturate_to((acc.cast(dtypes.float32) * mult).round() + _zp(y_zero_point), _out_dtype(y_zero_point, x))
    return _back(y, channels_last)


def _requant(x: Tensor, x_scale: Tensor, x_zp: Tensor | None, y_scale: Tensor, y_zp: Tensor | None,
             dt: DType) -> Tensor:
    return _quant(_dequant(x, x_scale, x_zp), y_scale, y_zp, dt)


@op("QLinearConcat", domain=MS)
def qlinear_concat(y_scale: Tensor, y_zero_point: Tensor, *inputs: Tensor, axis: int) -> Tensor:
    if not inputs or len(inputs) % 3: raise ValueError(f"QLinearConcat takes (X, scale, zero point) triples after the "
                                                       f"output's scale and zero point, got {len(inputs)} inputs")
    dt = y_zero_point.dtype
    parts = [_requant(inputs[i], inputs[i + 1], inputs[i + 2], y_scale, y_zero_point, dt)
             for i in range(0, len(inputs), 3)]
    return parts[0].cat(*parts[1:], dim=axis_of(axis, parts[0].ndim))


@op("QLinearWhere", domain=MS)
def qlinear_where(cond: Tensor, x: Tensor, x_scale: Tensor, x_zero_point: Tensor, y: Tensor, y_scale: Tensor,
                  y_zero_point: Tensor, z_scale: Tensor, z_zero_point: Tensor) -> Tensor:
    dt = z_zero_point.dtype
    return cond.where(_requant(x, x_scale, x_zero_point, z_scale, z_zero_point, dt),
                      _requant(y, y_scale, y_zero_point, z_scale, z_zero_point, dt))


@op("QLinearSoftmax", domain=MS)
def qlinear_softmax(x: Tensor, x_scale: Tensor, x_zero_point: Tensor | None, y_scale: Tensor,
                    y_zero_point: Tensor, *, axis: int = -1, opset: int) -> Tensor:
    # `opset` is the Softmax opset the op stands for: before 13 the input is flattened to 2D at `axis`. onnxruntime
    # requantizes the probabilities with the reciprocal of y_scale truncated to an integer (for the 1/255 that its
    # quantizer gives a uint8 softmax output, 254, not 255), and so does this: the op is onnxruntime's own
    v = _dequant(x, x_scale, x_zero_point)
    if opset >= 13: p = v.softmax(axis_of(axis, x.ndim))
    else:
        a = axis_of(axis, x.ndim)
        rows = 1
        for d in x.shape[:a]: rows *= d
        p = v.reshape(rows, -1).softmax(1).reshape(x.shape)
    steps = (Tensor(1.0, dtype=dtypes.float32) / _s(y_scale)).trunc()
    return saturate_to((p * steps).round() + _zp(y_zero_point), y_zero_point.dtype)


@op("QGemm", domain=MS)
def qgemm(a: Tensor, a_scale: Tensor, a_zero_point: Tensor, b: Tensor, b_scale: Tensor, b_zero_point: Tensor,
          c: Tensor | None = None, y_scale: Tensor | None = None, y_zero_point: Tensor | None = None, *,
          alpha: float = 1.0, transA: int = 0, transB: int = 0) -> Tensor:
    """alpha * A' B' + C with A and B quantized and C an int32 bias of scale a_scale * b_scale; the result is float32
    without y_scale, else requantized. A's zero point is per tensor or per row of A' (one per output row; onnxruntime's
    CPU kernel takes only one); B may be quantized per output column (per row where transB)."""
    if transA: a = a.T
    if transB: b = b.T
    if a_zero_point.ndim > 1 or a_zero_point.numel() not in (1, a.shape[0]):
        raise ValueError(f"A's zero point must be one value or one per row of A' ({a.shape[0]}), got shape "
                         f"{tuple(a_zero_point.shape)}")
    # B's zero point is per tensor or per output column
    bzp = b_zero_point.cast(dtypes.int32).reshape(-1 if b_zero_point.numel() > 1 else ())
    acc = _centered(a, a_zero_point.reshape(-1), "row", 0) @ (b.cast(dtypes.int32) - bzp)
    if c is not None: acc = acc + c.cast(dtypes.int32)
    sb = _s(b_scale) if b_scale.numel() == 1 else b_scale.cast(dtypes.float32).reshape(-1)
    mult = _s(a_scale) * sb * alpha
    if y_scale is None: return acc.cast(dtypes.float32) * mult
    return saturate_to((acc.cast(dtypes.float32) * (mult / _s(y_scale))).round() + _zp(y_zero_point),
                       _out_dtype(y_zero_point, a))


@op("MatMulIntegerToFloat", domain=MS)
def matmul_integer_to_float(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                            a_zero_point: Tensor | None = None, b_zero_point: Tensor | None = None,
                            bias: Tensor | None = None) -> Tensor:
    acc = matmul_integer(a, b, a_zero_point, b_zero_point)
    sb = _s(b_scale) if b_scale.numel() == 1 else b_scale.cast(dtypes.float32).reshape(-1)
    out = acc.cast(dtypes.float32) * (_s(a_scale) * sb)
    return (out + bias if bias is not None else out).cast(a_scale.dtype)


@op("DynamicQuantizeMatMul", domain=MS)
def dynamic_quantize_matmul(a: Tensor, b: Tensor, b_scale: Tensor, b_zero_point: Tensor | None = None,
                            bias: Tensor | None = None) -> Tensor:
    # A is quantized to uint8 over its whole range, as DynamicQuantizeLinear does
    qa, sa, zpa = dynamic_quantize_linear(a)
    return matmul_integer_to_float(qa, b, sa, b_scale, zpa, b_zero_point, bias)


@op("QAttention", domain=MS)
def qattention(x: Tensor, weight: Tensor, bias: Tensor, input_scale: Tensor, weight_scale: Tensor,
               mask_index: Tensor | None = None, input_zero_point: Tensor | None = None,
               weight_zero_point: Tensor | None = None, past: Tensor | None = None, *, num_heads: int,
               unidirectional: int = 0, scale: float | None = None, mask_filter_value: float = -10000.0,
               do_rotary: int = 0, past_present_share_buffer: int = 0) -> tuple[Tensor, Tensor]:
    """com.microsoft's Attention with a quantized input and weights: the projection is an integer matmul, rescaled to
    float32 with the bias added; the attention itself is in float32."""
    if do_rotary or past_present_share_buffer: raise Unsupported("QAttention with rotary embeddings or a shared buffer")
    qkv = matmul_integer_to_float(x, weight, input_scale, weight_scale, input_zero_point, weight_zero_point, bias)
    return packed_attention(qkv, mask_index, past, None, num_heads=num_heads, unidirectional=unidirectional,
                            scale=scale, mask_filter_value=mask_filter_value, qkv_hidden_sizes=None,
                            dtype=dtypes.float32)
