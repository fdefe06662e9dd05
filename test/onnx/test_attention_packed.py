"""com.microsoft's MultiHeadAttention with packed inputs: q, k and v in one query of (batch, seq, heads, 3, head_size),
or k and v in one key of (batch, kv_seq, heads, 2, head_size). onnxruntime's CPU kernel refuses both ("not
implemented for CPU"), so the reference is NumPy written from the op's definition, and onnxruntime's kernel run on
the same values given unpacked."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner  # noqa: E402

B, S, L, N, H = 2, 3, 5, 2, 4
RNG = np.random.default_rng(0)


def _f(*shape): return RNG.standard_normal(shape).astype(np.float32)


def _model(ins: list[str], feed: dict, **attrs):
    node = helper.make_node("MultiHeadAttention", ins, ["y"], domain="com.microsoft", num_heads=N, name="mha",
                            **attrs)
    vis = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feed.items()]
    graph = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _reference(q, k, v, key_lengths=None, causal=False) -> np.ndarray:
    """softmax(q k^T / sqrt(H) + mask) v per head, from (batch, seq, heads * H) inputs; masked keys get -10000 (the
    op's default mask_filter_value)."""
    def heads(x): return x.reshape(x.shape[0], x.shape[1], N, H).transpose(0, 2, 1, 3).astype(np.float64)
    scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / np.sqrt(H)
    j = np.arange(k.shape[1])
    if key_lengths is not None: scores += np.where(j[None, :] < key_lengths[:, None], 0, -10000.0)[:, None, None]
    if causal: scores += np.where(j[None, :] <= np.arange(q.shape[1])[:, None], 0, -10000.0)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ heads(v)
    return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], N * H)


def _ort_unpacked(ins: list[str], feed: dict, **attrs) -> np.ndarray:
    return ort.InferenceSession(_model(ins, feed, **attrs).SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_packed_qkv_with_bias_and_causal_mask():
    qkv, bias = _f(B, S, N, 3, H), _f(3 * N * H)
    feed = {"qkv": qkv, "bias": bias}
    got = OnnxRunner(_model(["qkv", "", "", "bias"], feed, unidirectional=1))(feed)["y"].numpy()
    q, k, v = (qkv[:, :, :, i].reshape(B, S, N * H) + bias[i * N * H:(i + 1) * N * H] for i in range(3))
    np.testing.assert_allclose(got, _reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    unpacked = {"q": q, "k": k, "v": v}
    np.testing.assert_allclose(got, _ort_unpacked(["q", "k", "v"], unpacked, unidirectional=1), rtol=1e-5, atol=1e-5)


def test_packed_kv_cross_attention_with_key_lengths():
    q, kv = _f(B, S, N * H), _f(B, L, N, 2, H)
    lengths = np.array([3, 5], np.int32)
    got = OnnxRunner(_model(["q", "kv", "", "", "lengths"], {"q": q, "kv": kv, "lengths": lengths}))(
        {"q": q, "kv": kv, "lengths": lengths})["y"].numpy()
    k, v = (kv[:, :, :, i].reshape(B, L, N * H) for i in range(2))
    np.testing.assert_allclose(got, _reference(q, k, v, key_lengths=lengths), rtol=1e-5, atol=1e-5)
    feed = {"q": q, "k": k, "v": v, "lengths": lengths}
    np.testing.assert_allclose(got, _ort_unpacked(["q", "k", "v", "", "lengths"], feed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ins,feed,match", [
    (["qkv"], {"qkv": _f(B, S, N + 1, 3, H)}, r"packed QKV query must have shape \(batch, seq, 2, 3, head_size\)"),
    (["qkv", "k"], {"qkv": _f(B, S, N, 3, H), "k": _f(B, S, N * H)}, "a packed QKV query takes no key or value"),
    (["q", "kv"], {"q": _f(B, S, N * H), "kv": _f(B, L, N, 3, H)}, r"packed KV key must have shape"),
    (["q", "kv", "v"], {"q": _f(B, S, N * H), "kv": _f(B, L, N, 2, H), "v": _f(B, L, N * H)},
     "a packed KV key takes no value")])
def test_bad_packed_shapes_name_the_node(ins, feed, match):
    with pytest.raises(OnnxNodeError, match=rf"'mha' \(MultiHeadAttention\).*{match}"):
        OnnxRunner(_model(ins, feed))(feed)
