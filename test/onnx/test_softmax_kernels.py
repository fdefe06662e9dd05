"""ONNX Softmax computes each exponential once: one kernel takes the row's max and stores the exponentials, the next
sums and scales them (fused into one kernel, each exp would be computed for the sum and again for the output)."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.engine.realize import run_schedule  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.uop.ops import Ops  # noqa: E402


def _model(shape: tuple[int, ...], axis: int, elem: int = TensorProto.FLOAT):
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], "g",
                              [helper.make_tensor_value_info("x", elem, list(shape))],
                              [helper.make_tensor_value_info("y", elem, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _reference(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("shape,axis", [((4, 8, 128), -1), ((3, 5, 7), 1), ((6, 33), 0)])
def test_softmax_computes_each_exp_once(shape, axis):
    x = np.random.default_rng(len(shape) + axis).standard_normal(shape).astype(np.float32) * 4
    y = OnnxRunner(_model(shape, axis))({"x": x})["y"]
    sched = y.schedule()
    exps = sum(u.op is Ops.EXP2 for ei in sched for u in ei.ast.toposort())
    assert exps == 1, f"the kernels compute exp {exps} times an element"
    run_schedule(sched)
    np.testing.assert_allclose(y.numpy(), _reference(x, axis), rtol=2e-6, atol=1e-7)


def test_softmax_float16_and_extremes():
    x = np.array([[0.0, 1.0, -np.inf, 3.0], [60000.0, 60000.0, -60000.0, 0.0]], np.float16)
    got = OnnxRunner(_model(x.shape, -1, TensorProto.FLOAT16))({"x": x})["y"].numpy()
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), _reference(x, -1), rtol=2e-3, atol=1e-4)
