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


def _attention_model(q: tuple[int, ...], v: tuple[int, ...], probs_out: bool):
    """y = Softmax(x, -1) @ v (and the probabilities p as an output too when `probs_out`)."""
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if probs_out: outs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(q)),
                                           helper.make_tensor_value_info("v", TensorProto.FLOAT, list(v))], outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("q,v,probs_out", [((2, 3, 16, 24), (2, 3, 24, 5), False), ((4, 9, 7), (7, 6), False),
                                           ((2, 1, 5, 8), (3, 8, 4), True)])
def test_softmax_matmul_scales_the_product_rows(q, v, probs_out):
    """softmax(x) @ v is (exp @ v) scaled per row: the probabilities are not written by a kernel (unless they are an
    output themselves), and the product is softmax's times v, broadcast batches included."""
    rng = np.random.default_rng(sum(q))
    x, w = (rng.standard_normal(q) * 3).astype(np.float32), rng.standard_normal(v).astype(np.float32)
    out = OnnxRunner(_attention_model(q, v, probs_out))({"x": x, "v": w})
    sched = out["y"].schedule(*([out["p"]] if probs_out else []))
    rows_keys = int(np.prod(q))
    # (a kernel writes its first len(ast.src) buffers; the exponentials are stored once, the normalized
    # probabilities only for the output that asks for them)
    stored = sum(1 for ei in sched for b in ei.bufs[:len(ei.ast.src)] if b.size == rows_keys)
    assert stored == (2 if probs_out else 1), f"{stored} kernels write a (rows, keys) tensor"
    run_schedule(sched)
    p = _reference(x, -1)
    np.testing.assert_allclose(out["y"].numpy(), p @ w.astype(np.float64), rtol=1e-5, atol=1e-6)
    if probs_out: np.testing.assert_allclose(out["p"].numpy(), p, rtol=2e-6, atol=1e-7)
