"""ONNX's 8-, 6-, 4- and 2-bit element types (FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, FLOAT8E8M0,
FLOAT6E2M3, FLOAT6E3M2, FLOAT4E2M1, INT4, UINT4, INT2, UINT2), which have no fusegrad dtype.

A tensor of such a type is held in a wider fusegrad dtype whose values are always exactly representable in the narrow
type: float32 for the float formats, int8 / uint8 for the integer ones, and the uint8 code for FLOAT8E8M0 (its values
2^-127 ... 2^127 include float32 subnormals, which compiled kernels may flush). The holder is a `NarrowTensor`, a
Tensor that names its ONNX type and whose `numpy()` gives the array in ml_dtypes' type, as `onnx.numpy_helper` does.

Rounding into a narrow type (Cast, QuantizeLinear) is written with Tensor ops, so it runs on the device and under
TinyJit: round to nearest even at the format's precision (subnormals included), then overflow per the `saturate`
attribute and the format (the FN and FNUZ formats have no infinity, the FNUZ ones no negative zero, FLOAT6E2M3,
FLOAT6E3M2 and FLOAT4E2M1 have neither infinity nor NaN and always saturate)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported

try:
    import onnx
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fusegrad.onnx needs the onnx package: pip install 'fusegrad[onnx]'") from e

TP = onnx.TensorProto


@dataclass(frozen=True)
class FloatFormat:
    """A small float format: `mbits` stored mantissa bits, `emin` the exponent of its smallest normal value."""
    mbits: int
    emin: int
    max: float
    inf: bool          # has infinities (else an overflow without saturation is NaN)
    nan: bool          # has NaN (FLOAT6 and FLOAT4E2M1 have none: they always saturate)
    neg_zero: bool     # has a negative zero (the FNUZ formats don't)

    @property
    def emax(self) -> int: return int(np.floor(np.log2(self.max)))


@dataclass(frozen=True)
class Narrow:
    """One narrow element type: its name, the fusegrad dtype holding it, ml_dtypes' NumPy type, and its format (a
    FloatFormat, an integer range (lo, hi), or "e8m0")."""
    name: str
    wide: DType
    np_type: Any
    fmt: FloatFormat | tuple[int, int] | str


NARROW: dict[int, Narrow] = {
    TP.FLOAT8E4M3FN: Narrow("FLOAT8E4M3FN", dtypes.float32, ml_dtypes.float8_e4m3fn,
                            FloatFormat(3, -6, 448.0, inf=False, nan=True, neg_zero=True)),
    TP.FLOAT8E4M3FNUZ: Narrow("FLOAT8E4M3FNUZ", dtypes.float32, ml_dtypes.float8_e4m3fnuz,
                              FloatFormat(3, -7, 240.0, inf=False, nan=True, neg_zero=False)),
    TP.FLOAT8E5M2: Narrow("FLOAT8E5M2", dtypes.float32, ml_dtypes.float8_e5m2,
                          FloatFormat(2, -14, 57344.0, inf=True, nan=True, neg_zero=True)),
    TP.FLOAT8E5M2FNUZ: Narrow("FLOAT8E5M2FNUZ", dtypes.float32, ml_dtypes.float8_e5m2fnuz,
                              FloatFormat(2, -15, 57344.0, inf=False, nan=True, neg_zero=False)),
    TP.FLOAT4E2M1: Narrow("FLOAT4E2M1", dtypes.float32, ml_dtypes.float4_e2m1fn,
                          FloatFormat(1, 0, 6.0, inf=False, nan=False, neg_zero=True)),
    TP.FLOAT6E2M3: Narrow("FLOAT6E2M3", dtypes.float32, ml_dtypes.float6_e2m3fn,
                          FloatFormat(3, 0, 7.5, inf=False, nan=False, neg_zero=True)),
    TP.FLOAT6E3M2: Narrow("FLOAT6E3M2", dtypes.float32, ml_dtypes.float6_e3m2fn,
                          FloatFormat(2, -2, 28.0, inf=False, nan=False, neg_zero=True)),
    TP.FLOAT8E8M0: Narrow("FLOAT8E8M0", dtypes.uint8, ml_dtypes.float8_e8m0fnu, "e8m0"),
    TP.INT4: Narrow("INT4", dtypes.int8, ml_dtypes.int4, (-8, 7)),
    TP.UINT4: Narrow("UINT4", dtypes.uint8, ml_dtypes.uint4, (0, 15)),
    TP.INT2: Narrow("INT2", dtypes.int8, ml_dtypes.int2, (-2, 1)),
    TP.UINT2: Narrow("UINT2", dtypes.uint8, ml_dtypes.uint2, (0, 3)),
}

# the ops that read and write narrow values themselves; others get them only if they just move values (PASS_THROUGH)
NARROW_OPS = frozenset({"Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"})
# ops that move, select or reshape values without arithmetic (sequence ops included: a sequence's tensors are looked
# at too): a narrow input's type carries over to the outputs of the holder's dtype
PASS_THROUGH = frozenset({"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split",
                          "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Where", "DepthToSpace",
                          "SpaceToDepth", "Shape", "Size", "Compress", "ReverseSequence", "Optional",
                          "OptionalGetElement", "OptionalHasElement", "SequenceConstruct", "SequenceInsert",
                          "SequenceAt", "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence"})
# ops whose subgraphs get the values as they are (the subgraphs' nodes check them) and that keep the types of what
# their subgraphs give (ops_control.py retags the values they slice or stack)
CONTROL_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})


class NarrowTensor(Tensor):
    """A Tensor holding values of an ONNX 8-, 6-, 4- or 2-bit element type (`onnx_type`, a TensorProto data type) in a
    wider fusegrad dtype; `numpy()` returns them in ml_dtypes' type."""
    __slots__ = ("onnx_type",)

    def __init__(self, t: Tensor, onnx_type: int):
        super().__init__(t.uop)
        self.onnx_type = onnx_type

    @property
    def narrow(self) -> Narrow: return NARROW[self.onnx_type]

    def numpy(self) -> Any:
        return to_narrow_numpy(Tensor(self.uop).numpy(), self.onnx_type)

    def __repr__(self) -> str:
        return f"<NarrowTensor {self.narrow.name} held as {self.dtype.name}, shape {tuple(self.shape)}>"


def narrow_type(t: Any) -> int | None:
    """The ONNX element type of a narrow tensor, None for any other value."""
    return t.onnx_type if isinstance(t, NarrowTensor) else None


def retag(t: Tensor, onnx_type: int | None) -> Tensor:
    """A tensor made from values of a narrow type (a slice, a stack) as a NarrowTensor of that type (None: as is)."""
    return t if onnx_type is None or isinstance(t, NarrowTensor) else NarrowTensor(t, onnx_type)


def common_type(ts: Any) -> int | None:
    """The narrow type of tensors that are stacked or sliced together: all of it or none (an error otherwise)."""
    types = {narrow_type(t) for t in ts}
    if len(types) > 1:
        raise TypeError(f"values of different element types together: "
                        f"{sorted(NARROW[t].name if t is not None else 'wider types' for t in types)}")
    return types.pop() if types else None


def plain(t: Tensor) -> Tensor:
    """The holder of a narrow tensor as a plain Tensor (any other tensor as is)."""
    return Tensor(t.uop) if isinstance(t, NarrowTensor) else t


def _bits(n: Narrow) -> int:
    """The bits a code has (ml_dtypes keeps a code in the low bits of a byte)."""
    if n.np_type in (ml_dtypes.float6_e2m3fn, ml_dtypes.float6_e3m2fn): return 6
    return 4 if n.np_type in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn) else \
        2 if n.np_type in (ml_dtypes.int2, ml_dtypes.uint2) else 8


# (ml_dtypes' casts from and to float32 take ~20 ms for a million values; these tables convert exact values by lookup)
_ENCODE: dict[int, np.ndarray] = {}
_DECODE: dict[int, np.ndarray] = {}


def _encode_table(onnx_type: int) -> np.ndarray:
    """The code of a float32 by its top 12 bits (sign, exponent, 3 mantissa bits), which tell apart every value of
    the float formats (at most 3 mantissa bits, normal in float32) and NaN."""
    if onnx_type not in _ENCODE:
        with np.errstate(invalid="ignore", over="ignore"):
            tops = (np.arange(1 << 12, dtype=np.uint32) << np.uint32(20)).view(np.float32)
            _ENCODE[onnx_type] = tops.astype(NARROW[onnx_type].np_type).view(np.uint8)
    return _ENCODE[onnx_type]


def _decode_table(onnx_type: int) -> np.ndarray:
    """The float32 value of each code of a float format."""
    if onnx_type not in _DECODE:
        n = NARROW[onnx_type]
        _DECODE[onnx_type] = np.arange(1 << _bits(n), dtype=np.uint8).view(n.np_type).astype(np.float32)
    return _DECODE[onnx_type]


def _c_array(arr: np.ndarray, dtype: Any = None) -> np.ndarray:
    """The array in C order (of `dtype`), its shape kept: np.ascontiguousarray makes a 0-d array 1-d."""
    return np.require(np.asarray(arr, dtype), requirements="C")


def to_narrow_numpy(arr: np.ndarray, onnx_type: int) -> np.ndarray:
    """The values of a holder (a NumPy array of its fusegrad dtype) as an array of ml_dtypes' type."""
    n = NARROW[onnx_type]
    arr = np.asarray(arr)
    if n.fmt == "e8m0": return _c_array(arr, np.uint8).view(n.np_type)
    if isinstance(n.fmt, tuple):
        # two's complement in the low bits
        return (arr.astype(np.uint8) & np.uint8((1 << _bits(n)) - 1)).view(n.np_type)
    bits = _c_array(arr, np.float32).view(np.uint32)
    return _encode_table(onnx_type)[bits >> np.uint32(20)].view(n.np_type)


def from_narrow_numpy(arr: np.ndarray, onnx_type: int) -> np.ndarray:
    """An array of ml_dtypes' type as the NumPy array of the holder's dtype (exact)."""
    n = NARROW[onnx_type]
    if arr.dtype != np.dtype(n.np_type):
        raise Unsupported(f"an array of {arr.dtype} for element type {n.name} (give one of "
                          f"ml_dtypes.{n.np_type.__name__})")
    codes = _c_array(arr).view(np.uint8)
    if n.fmt == "e8m0": return codes
    codes = codes & np.uint8((1 << _bits(n)) - 1)
    if isinstance(n.fmt, FloatFormat): return _decode_table(onnx_type)[codes]
    if n.fmt[0] >= 0: return codes
    half = 1 << (_bits(n) - 1)
    return ((codes ^ half).astype(np.int8) - np.int8(half)).astype(np.int8)


def inexact(arr: np.ndarray, onnx_type: int) -> np.ndarray:
    """A mask of the values of a holder array (NumPy, of the holder's dtype) that are not values of the narrow type: a
    float the format doesn't have (bit for bit: a negative zero where the format has none; any NaN where it has NaN),
    an integer out of the type's range. Every code of FLOAT8E8M0 is a value."""
    n = NARROW[onnx_type]
    arr = np.asarray(arr)
    if n.fmt == "e8m0": return np.zeros(arr.shape, bool)
    if isinstance(n.fmt, tuple): return (arr < n.fmt[0]) | (arr > n.fmt[1])
    held = _c_array(arr, np.float32)
    back = from_narrow_numpy(to_narrow_numpy(held, onnx_type), onnx_type)
    same = back.view(np.uint32) == held.view(np.uint32)
    return ~(same | (np.isnan(back) & np.isnan(held)))


def numpy_type_of(arr: np.ndarray) -> int | None:
    """The ONNX element type of an array of one of ml_dtypes' narrow types, else None."""
    return next((k for k, n in NARROW.items() if arr.dtype == np.dtype(n.np_type)), None)


# *** values ***

def _pow2(e: Tensor) -> Tensor:
    """2**e as float32 for an int32 tensor of exponents in [-126, 127] (exact: built from the bits)."""
    return ((e + 127) * (1 << 23)).bitcast(dtypes.float32)


def values(t: Tensor) -> Tensor:
    """The values of a tensor as a computable Tensor: a narrow tensor's holder decoded (FLOAT8E8M0's codes to float32),
    any other tensor as is."""
    if not isinstance(t, NarrowTensor): return t
    if t.narrow.fmt != "e8m0": return plain(t)
    code = plain(t).cast(dtypes.int32)
    # code c is 2^(c-127); code 0 is the float32 subnormal 2^-127 (bits 0x400000), code 255 NaN
    bits = (code == 0).where(0x400000, (code == 255).where(0x7FC00000, code * (1 << 23)))
    return bits.bitcast(dtypes.float32)


def round_to(x: Tensor, onnx_type: int, saturate: bool = True, round_mode: str = "up") -> NarrowTensor:
    """Cast to a narrow type: RNE for the float formats (overflow per `saturate`), truncation and wrap-around for the
    integer ones (as for any integer cast out of range), FLOAT8E8M0 per `round_mode`."""
    n = NARROW[onnx_type]
    if isinstance(n.fmt, FloatFormat): out = _round_float(x, n.fmt, saturate)
    elif isinstance(n.fmt, tuple): out = _wrap_int(x, n.fmt).cast(n.wide)
    else: out = _round_e8m0(x, saturate, round_mode)
    return NarrowTensor(out, onnx_type)


def saturate_int(q: Tensor, onnx_type: int) -> NarrowTensor:
    """A float tensor of whole numbers clamped to the range of a narrow integer type (QuantizeLinear)."""
    lo, hi = NARROW[onnx_type].fmt  # type: ignore[misc]
    # (a NaN to the bottom of the range, as saturate_to does)
    return NarrowTensor(q.isnan().where(lo, q).maximum(lo).minimum(hi).cast(NARROW[onnx_type].wide), onnx_type)


def _round_float(x: Tensor, f: FloatFormat, saturate: bool) -> Tensor:
    # float64 rounds in float64 (no double rounding through float32); every other dtype is exact in float32
    work = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    if x.dtype == dtypes.bool: x = x.cast(dtypes.float32)
    xw = x.cast(work)
    a = xw.abs()
    # the exponent of |x|: from float32's bits (a float64 that rounds up to a power of two in float32 gets the larger
    # exponent, which rounds it to that same power of two), clamped to the format's range
    a32 = a.cast(dtypes.float32)
    e = (a32.bitcast(dtypes.int32) >> 23) - 127
    e = e.maximum(f.emin).minimum(f.emax + 1)
    quantum = _pow2(e - f.mbits).cast(work)
    y = (a / quantum).round() * quantum
    over = y > f.max    # (an infinite input too; NaN compares false)
    if saturate or not f.nan: y = over.where(f.max, y)
    else: y = over.where(float("inf") if f.inf else float("nan"), y)
    if not f.nan: y = a.isnan().where(0.0, y)
    # the sign: from the input's bits, so that -0.0 stays negative where the format has a negative zero (a zero of
    # the magnitude is made +0 first: the rounding may give -0)
    neg = x.cast(dtypes.float32).bitcast(dtypes.int32) < 0
    # (a format without NaN makes NaN a zero of the opposite sign, as ml_dtypes, ONNX's reference, does)
    if not f.nan: neg = neg != a.isnan()
    if f.neg_zero: y = neg.where(-((y == 0).where(0.0, y)), (y == 0).where(0.0, y))
    else: y = (y == 0).where(0.0, neg.where(-y, y))
    return y.cast(dtypes.float32)


def _wrap_int(x: Tensor, rng: tuple[int, int]) -> Tensor:
    """An integer cast to a type of range `rng`: floats truncate toward zero (NaN and infinities give 0), and the
    low bits are kept (two's complement), as ml_dtypes does."""
    lo, hi = rng
    size = hi - lo + 1
    if x.dtype == dtypes.bool: return x.cast(dtypes.int32)
    if dtypes.is_float(x.dtype):
        t = x.cast(dtypes.float64).trunc()
        t = (t.isnan() | t.isinf()).where(0.0, t)
        r = t - (t / size).floor() * size
        r = r.cast(dtypes.int32)
    else:
        r = x.cast(dtypes.int64).bitwise_and(size - 1).cast(dtypes.int32)
    return (r > hi).where(r - size, r) if lo < 0 else r


def _round_e8m0(x: Tensor, saturate: bool, round_mode: str) -> Tensor:
    """FLOAT8E8M0 (a power of two 2^(c-127), code c; 255 is NaN) from float32's exponent bits, rounding up, down or
    to nearest per `round_mode`; the sign is ignored."""
    if round_mode not in ("up", "down", "nearest"):
        raise Unsupported(f"round_mode {round_mode!r} (supported: up, down, nearest)")
    bits = x.cast(dtypes.float32).bitcast(dtypes.int32)
    exp = (bits >> 23).bitwise_and(0xFF)
    mant = bits.bitwise_and(0x7FFFFF)
    special = exp == 0xFF
    if round_mode == "up": up = mant > 0
    elif round_mode == "down": up = mant < 0   # (never)
    else:
        # the guard bit set, and the bits below it or the exponent nonzero (a tie rounds up except in subnormals)
        guard = mant.bitwise_and(0x400000) > 0
        up = guard & ((mant.bitwise_and(0x3FFFFF) > 0) | (exp > 0))
    if saturate: up = up & (exp != 0xFE)
    code = special.where(0xFF, exp + up.cast(dtypes.int32))
    return code.cast(dtypes.uint8)
