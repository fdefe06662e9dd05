"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss: ONNX's node cases (test_node_cases.py, with -m slow) check
every reduction, weights and ignored targets; here, one case of each against PyTorch, and bad inputs that name the
node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402


def _model(op: str, x_shape, t_shape, outputs=("loss",), **attrs):
    node = helper.make_node(op, ["x", "t", "w"], list(outputs), name="loss_node", **attrs)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
           helper.make_tensor_value_info("t", TensorProto.INT64, t_shape),
           helper.make_tensor_value_info("w", TensorProto.FLOAT, [x_shape[1]])]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    return helper.make_model(helper.make_graph([node], "g", ins, outs), opset_imports=[helper.make_opsetid("", 13)])


def test_weighted_cross_entropy_with_ignored_targets_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 4)).astype(np.float32)
    t = rng.integers(0, 5, (3, 4)).astype(np.int64)
    t[0, 1] = t[2, 3] = -100
    w = rng.random(5).astype(np.float32) + 0.5
    out = OnnxRunner(_model("SoftmaxCrossEntropyLoss", x.shape, t.shape, ("loss", "logp"), ignore_index=-100))(
        {"x": x, "t": t, "w": w})
    want = torch.nn.functional.cross_entropy(torch.from_numpy(x), torch.from_numpy(t), weight=torch.from_numpy(w),
                                             ignore_index=-100)
    np.testing.assert_allclose(out["loss"].numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["logp"].numpy(), torch.log_softmax(torch.from_numpy(x), 1).numpy(), rtol=1e-5,
                               atol=1e-6)
    out = OnnxRunner(_model("NegativeLogLikelihoodLoss", x.shape, t.shape, reduction="none", ignore_index=-100))(
        {"x": x, "t": t, "w": w})
    want = torch.nn.functional.nll_loss(torch.from_numpy(x), torch.from_numpy(t), weight=torch.from_numpy(w),
                                        ignore_index=-100, reduction="none")
    np.testing.assert_allclose(out["loss"].numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_bad_inputs_name_the_node():
    feed = {"x": np.zeros((2, 3), np.float32), "t": np.zeros(3, np.int64), "w": np.ones(3, np.float32)}
    with pytest.raises(OnnxNodeError, match=r"'loss_node' \(NegativeLogLikelihoodLoss\).*target must have shape "
                                            r"\(2,\)"):
        OnnxRunner(_model("NegativeLogLikelihoodLoss", [2, 3], [3]))(feed)
    feed["t"] = np.zeros(2, np.int64)
    with pytest.raises(OnnxUnsupportedError, match=r"'loss_node' \(SoftmaxCrossEntropyLoss\).*reduction 'max'"):
        OnnxRunner(_model("SoftmaxCrossEntropyLoss", [2, 3], [2], reduction="max"))(feed)
