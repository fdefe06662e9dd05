"""Run ONNX models with fusegrad: `OnnxRunner(path_or_model)({"input": array})` returns a dict of output Tensors."""
from fusegrad.onnx.errors import OnnxError, OnnxLoadError, OnnxInputError, OnnxNodeError, OnnxUnsupportedError
from fusegrad.onnx.runner import OnnxRunner, supported_ops

__all__ = ["OnnxRunner", "OnnxError", "OnnxLoadError", "OnnxInputError", "OnnxNodeError", "OnnxUnsupportedError",
           "supported_ops"]
