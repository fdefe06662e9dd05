"""ONNX's element types and their fusegrad dtypes, which both the runner (initializers, inputs) and the ops (Cast,
EyeLike, the random ops' dtype attributes) need."""
from __future__ import annotations

from fusegrad import dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported

try:
    import onnx
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fusegrad.onnx needs the onnx package: pip install 'fusegrad[onnx]'") from e

# ONNX's TensorProto element types that have a fusegrad dtype
ONNX_DTYPES: dict[int, DType] = {
    onnx.TensorProto.FLOAT: dtypes.float32, onnx.TensorProto.UINT8: dtypes.uint8, onnx.TensorProto.INT8: dtypes.int8,
    onnx.TensorProto.UINT16: dtypes.uint16, onnx.TensorProto.INT16: dtypes.int16, onnx.TensorProto.INT32: dtypes.int32,
    onnx.TensorProto.INT64: dtypes.int64, onnx.TensorProto.BOOL: dtypes.bool, onnx.TensorProto.FLOAT16: dtypes.float16,
    onnx.TensorProto.DOUBLE: dtypes.float64, onnx.TensorProto.UINT32: dtypes.uint32,
    onnx.TensorProto.UINT64: dtypes.uint64, onnx.TensorProto.BFLOAT16: dtypes.bfloat16,
}


def onnx_dtype(elem_type: int) -> DType:
    """The fusegrad dtype of an ONNX element type; an error naming the type where there is none."""
    if elem_type not in ONNX_DTYPES:
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() \
            else str(elem_type)
        raise Unsupported(f"element type {name} has no fusegrad dtype")
    return ONNX_DTYPES[elem_type]


def np_name(dt: DType) -> str:
    """The NumPy dtype name of a fusegrad dtype (bfloat16 has none)."""
    return {"char": "int8", "unsigned char": "uint8", "short": "int16", "unsigned short": "uint16", "int": "int32",
            "unsigned int": "uint32", "long": "int64", "unsigned long": "uint64", "half": "float16",
            "float": "float32", "double": "float64", "bool": "bool"}[dt.name]
