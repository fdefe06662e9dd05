"""DFT, STFT and the window functions: ONNX's node cases (test_node_cases.py) check the documented examples; here one
random case of each against onnxruntime (complex signals, padding and cutting to dft_length, inverse transforms, a
batch of frames) and bad inputs that name the node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402


def _model(op: str, inputs: dict[str, np.ndarray], opset: int, out_type: int = TensorProto.FLOAT,
           **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), ["y"], name="sig_node", **attrs)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items() if n]
    graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", out_type, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _both(op: str, inputs: dict[str, np.ndarray], opset: int, out_type: int = TensorProto.FLOAT,
          **attrs) -> tuple[np.ndarray, np.ndarray]:
    """(fusegrad's output, onnxruntime's)."""
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, out_type, **attrs)
    feed = {k: v for k, v in inputs.items() if k}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    return OnnxRunner(model)(feed)["y"].numpy(), want


@pytest.mark.parametrize("inverse,length,axis", [(0, 24, -2), (1, 13, 1), (0, 7, 2)])
def test_complex_dft_matches_onnxruntime(inverse, length, axis):
    rng = np.random.default_rng(length)
    x = rng.standard_normal((2, 16, 5, 2)).astype(np.float32)
    got, want = _both("DFT", {"x": x, "n": np.array(length, np.int64), "axis": np.array(axis, np.int64)}, 20,
                      inverse=inverse)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_real_one_sided_dft_and_its_inverse_match_onnxruntime():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 20, 1)).astype(np.float32)
    got, want = _both("DFT", {"x": x}, 20, onesided=1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # the inverse of a one-sided spectrum is real, and gives the signal back
    back, want_back = _both("DFT", {"s": want}, 20, inverse=1, onesided=1)
    assert back.shape == want_back.shape == x.shape
    np.testing.assert_allclose(back, want_back, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(back, x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("onesided", [0, 1])
def test_stft_with_hann_window_matches_onnxruntime(onesided):
    rng = np.random.default_rng(onesided)
    x = rng.standard_normal((2, 100, 1)).astype(np.float32)
    window = (np.sin(np.pi * np.arange(16) / 16) ** 2).astype(np.float32)
    got, want = _both("STFT", {"x": x, "step": np.array(6, np.int64), "w": window, "n": np.array(16, np.int64)}, 17,
                      onesided=onesided)
    assert got.shape == want.shape == (2, 15, 9 if onesided else 16, 2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows_match_onnxruntime(op, periodic):
    got, want = _both(op, {"size": np.array(37, np.int64)}, 17, TensorProto.DOUBLE, periodic=periodic,
                      output_datatype=TensorProto.DOUBLE)
    assert got.dtype == want.dtype == np.float64
    # onnxruntime computes the window in float32 whatever the output type
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_bad_inputs_name_the_node():
    x = np.zeros((2, 8, 3), np.float32)
    with pytest.raises(OnnxNodeError, match=r"sig_node.*DFT.*dim of 1 \(real\) or 2 \(complex\)"):
        OnnxRunner(_model("DFT", {"x": x}, 20))({"x": x})
    x = np.zeros((1, 8, 1), np.float32)
    with pytest.raises(OnnxNodeError, match=r"sig_node.*STFT.*frame_length 9 must be between 1 and the signal"):
        OnnxRunner(_model("STFT", {"x": x, "s": np.array(1, np.int64), "": None, "n": np.array(9, np.int64)}, 17))(
            {"x": x, "s": np.array(1, np.int64), "n": np.array(9, np.int64)})
    with pytest.raises(OnnxNodeError, match=r"sig_node.*HannWindow.*periodic must be 0 or 1"):
        OnnxRunner(_model("HannWindow", {"size": np.array(4, np.int64)}, 17, periodic=3))({"size": np.array(4)})


def test_mel_weight_matrix_matches_onnxruntime():
    feed = {"bins": np.array(20, np.int64), "n": np.array(256, np.int64), "rate": np.array(16000, np.int64),
            "lo": np.array(30.0, np.float32), "hi": np.array(7600.0, np.float32)}
    got, want = _both("MelWeightMatrix", feed, 17)
    assert got.shape == want.shape == (129, 20)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got.sum(0) > 0).all()
