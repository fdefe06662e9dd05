"""ONNX Gelu (approximate='none'): x Phi(x) in float32 from one exponential and a rational function, against the
float64 value from math.erfc, over the whole float32 range that matters, the special values and the narrower and
wider float types; and against onnxruntime on a random tensor."""
from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402


def _gelu_model(elem: int, opset: int = 20, **attrs) -> onnx.ModelProto:
    node = helper.make_node("Gelu", ["x"], ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", elem, None)],
                          [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _reference(x: np.ndarray) -> np.ndarray:
    """x Phi(x) in float64, Phi(x) = erfc(-x / sqrt 2) / 2 (no cancellation in the negative tail)."""
    x64 = x.astype(np.float64)
    return x64 * 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x64 / math.sqrt(2))


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def test_gelu_float32_against_erfc():
    x = np.concatenate([np.linspace(-14, 14, 120_001), -np.logspace(-30, 1.1, 4001),
                        np.logspace(-30, 1.1, 4001)]).astype(np.float32)
    got = OnnxRunner(_gelu_model(onnx.TensorProto.FLOAT))({"x": x})["y"].numpy()
    want = _reference(x)
    assert got.dtype == np.float32
    ulps = _ulps(got, want)
    near = np.abs(x) <= 5
    # (in the far negative tail the rounding of x^2 / 2 inside the exponential dominates)
    assert ulps[near].max() <= 40, f"{ulps[near].max()} ulp at x={x[near][np.argmax(ulps[near])]}"
    tail = ~near & (np.abs(want) > 1e-30)
    assert ulps[tail].max() <= 400, f"{ulps[tail].max()} ulp at x={x[tail][np.argmax(ulps[tail])]}"
    # below that the result is a float32 subnormal or zero
    assert np.abs(got[np.abs(want) <= 1e-30]).max() <= 1e-30


def test_gelu_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3e38, -3e38], np.float32)
    got = OnnxRunner(_gelu_model(onnx.TensorProto.FLOAT))({"x": x})["y"].numpy()
    # what 0.5 x (1 + erf(x / sqrt 2)) gives in float64: -inf times 0 is nan, as in ONNX's reference
    with np.errstate(invalid="ignore"):
        want = (x.astype(np.float64) * 0.5 * (1 + np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2))))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok].astype(np.float32), rtol=1e-6, atol=1e-45)
    assert np.signbit(got[1]) and got[1] == 0   # gelu(-0) is -0


def test_gelu_float16_and_float64():
    x = np.linspace(-9, 9, 4001)
    got16 = OnnxRunner(_gelu_model(onnx.TensorProto.FLOAT16))({"x": x.astype(np.float16)})["y"].numpy()
    assert got16.dtype == np.float16
    np.testing.assert_array_equal(got16, _reference(x.astype(np.float16)).astype(np.float16))
    # float64 keeps the double-precision erf (the float32 formula would be off by ~1e-7)
    got64 = OnnxRunner(_gelu_model(onnx.TensorProto.DOUBLE))({"x": x})["y"].numpy()
    assert got64.dtype == np.float64
    np.testing.assert_allclose(got64, _reference(x), rtol=1e-12, atol=1e-12)


def test_gelu_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    x = (np.random.default_rng(0).standard_normal((64, 96)) * 3).astype(np.float32)
    model = _gelu_model(onnx.TensorProto.FLOAT)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(OnnxRunner(model)({"x": x})["y"].numpy(), want, rtol=2e-6, atol=2e-7)


def test_gelu_tanh_unchanged():
    x = np.linspace(-6, 6, 1001).astype(np.float32)
    got = OnnxRunner(_gelu_model(onnx.TensorProto.FLOAT, approximate="tanh"))({"x": x})["y"].numpy()
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
