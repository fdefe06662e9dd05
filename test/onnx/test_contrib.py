"""The com.microsoft ops against onnxruntime's own kernels on hand-built graphs."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402

RNG = np.random.default_rng(0)


def _f(*shape): return RNG.standard_normal(shape).astype(np.float32)


def _check(node, feed: dict, inits: dict, n_out: int = 1, tol: float = 1e-5):
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feed.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output[:n_out] if o]
    graph = helper.make_graph([node], "g", ins, outs, initializer=[onnx.numpy_helper.from_array(v, k)
                                                                   for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                          ir_version=8)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = OnnxRunner(m)(feed)
    for o, w in zip([o.name for o in outs], want):
        np.testing.assert_allclose(got[o].numpy(), w, rtol=tol, atol=tol, err_msg=f"{node.op_type} {o}")


def _ms(op, ins, outs, **attrs): return helper.make_node(op, ins, outs, domain="com.microsoft", **attrs)


def test_gelus():
    x, b = _f(3, 16) * 3, _f(16)
    _check(_ms("Gelu", ["x"], ["y"]), {"x": x}, {})
    _check(_ms("FastGelu", ["x", "b"], ["y"]), {"x": x}, {"b": b})
    _check(_ms("FastGelu", ["x"], ["y"]), {"x": x}, {})
    _check(_ms("BiasGelu", ["x", "b"], ["y"]), {"x": x}, {"b": b})


@pytest.mark.parametrize("ta,tb,alpha", [(0, 0, 1.0), (1, 0, 0.5), (0, 1, 2.0), (1, 1, -1.0)])
def test_fused_matmul(ta, tb, alpha):
    a = _f(2, 5, 4) if ta else _f(2, 4, 5)
    b = _f(3, 5) if tb else _f(5, 3)
    _check(_ms("FusedMatMul", ["a", "b"], ["y"], alpha=alpha, transA=ta, transB=tb), {"a": a, "b": b}, {})


def test_skip_layer_norms():
    x, skip, g, be, bias = _f(2, 5, 16), _f(2, 5, 16), _f(16), _f(16), _f(16)
    _check(_ms("SkipLayerNormalization", ["x", "skip", "g", "be", "bias"], ["y", "", "", "sum"], epsilon=1e-5),
           {"x": x, "skip": skip}, {"g": g, "be": be, "bias": bias}, n_out=4, tol=1e-4)
    _check(_ms("SkipLayerNormalization", ["x", "skip", "g"], ["y"]), {"x": x, "skip": skip}, {"g": g}, tol=1e-4)
    _check(_ms("SkipSimplifiedLayerNormalization", ["x", "skip", "g"], ["y"], epsilon=1e-6), {"x": x, "skip": skip},
           {"g": g}, tol=1e-4)
    _check(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], epsilon=1e-6), {"x": x}, {"g": g},
           tol=1e-4)


@pytest.mark.parametrize("mask,causal", [(False, 0), (True, 0), (False, 1)])
def test_attention(mask, causal):
    b, s, hidden, heads = 2, 6, 16, 4
    feed = {"x": _f(b, s, hidden)}
    inits = {"w": _f(hidden, 3 * hidden) * 0.3, "bias": _f(3 * hidden) * 0.1}
    ins = ["x", "w", "bias"]
    if mask:
        m = np.ones((b, s), np.int32)
        m[0, 4:] = 0
        m[1, 2] = 0
        feed["mask"] = m
        ins.append("mask")
    _check(_ms("Attention", ins, ["y"], num_heads=heads, unidirectional=causal), feed, inits, tol=1e-4)
