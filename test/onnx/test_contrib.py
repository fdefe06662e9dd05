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


def _slow(*values): return pytest.param(*values, marks=pytest.mark.slow)


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


def _run_both(nodes, feed: dict, inits: dict, outs: list[str], opset: int = 17):
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feed.items()]
    outs_vi = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs]
    graph = helper.make_graph(nodes, "g", ins, outs_vi,
                              initializer=[onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = OnnxRunner(m)(feed)
    return [got[o].numpy() for o in outs], want


def _assert_close(got, want, tol=1e-4):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"output {i}")


@pytest.mark.parametrize("causal,mask", [_slow(0, None), _slow(1, None), (1, "keys"),
                                         (0, "lengths"), _slow(0, "ends_starts"), (1, "per_query")])
def test_attention_with_past(causal, mask):
    # a decoder step: 2 new positions after 3 cached ones; `present` is the cache for the next step. mask_index in
    # each of its forms: 0/1 per key, key lengths, ends and starts, 0/1 per query and key
    b, s, past, hidden, heads = 2, 2, 3, 16, 4
    total = past + s
    feed = {"x": _f(b, s, hidden), "past": _f(2, b, heads, past, hidden // heads)}
    ins = ["x", "w", "bias", ""]
    if mask:
        m = {"keys": np.array([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32), "lengths": np.array([4, 5], np.int32),
             "ends_starts": np.array([5, 4, 1, 0], np.int32),
             "per_query": (RNG.random((b, s, total)) > 0.3).astype(np.int32)}[mask]
        if mask == "per_query": m[..., 0] = 1  # (every query keeps a key)
        feed["mask"] = m
        ins[3] = "mask"
    ins.append("past")
    node = _ms("Attention", ins, ["y", "present"], num_heads=heads, unidirectional=causal)
    got, want = _run_both([node], feed, {"w": _f(hidden, 3 * hidden) * 0.3, "bias": _f(3 * hidden) * 0.1},
                          ["y", "present"])
    assert got[1].shape == (2, b, heads, past + s, hidden // heads)
    _assert_close(got, want)


@pytest.mark.parametrize("layout", ["self_bias_mask", "past_causal", "per_head_kv"])
def test_multi_head_attention(layout):
    b, s, kv, hidden, heads = 2, 3, 5, 16, 2
    hs = hidden // heads
    feed: dict = {}
    ins: list[str] = []
    attrs: dict = {}
    outs = ["y"]
    if layout == "self_bias_mask":
        feed = {"q": _f(b, s, hidden), "k": _f(b, kv, hidden), "v": _f(b, kv, hidden), "bias": _f(3 * hidden),
                "mask": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)}
        ins, outs = ["q", "k", "v", "bias", "mask"], ["y", "", "", "qk"]
    elif layout == "past_causal":
        feed = {"q": _f(b, s, hidden), "k": _f(b, s, hidden), "v": _f(b, s, hidden),
                "pk": _f(b, heads, 4, hs), "pv": _f(b, heads, 4, hs)}
        ins, attrs, outs = ["q", "k", "v", "", "", "", "pk", "pv"], {"unidirectional": 1}, ["y", "pko", "pvo"]
    else:
        feed = {"q": _f(b, s, hidden), "k": _f(b, heads, kv, hs), "v": _f(b, heads, kv, hs),
                "ab": _f(1, heads, s, kv)}
        ins = ["q", "k", "v", "", "", "ab"]
    node = _ms("MultiHeadAttention", ins, outs, num_heads=heads, **attrs)
    _assert_close(*_run_both([node], feed, {}, [o for o in outs if o]))


@pytest.mark.parametrize("case", ["prompt", "decode", _slow("window_softcap"),
                                  _slow("packed"), _slow("rotary_prompt"),
                                  "rotary_interleaved_decode", "smooth_softmax", _slow("head_sink"),
                                  "ragged_decode"])
def test_group_query_attention(case):
    # 4 query heads share 2 key/value heads; a prompt of 4 positions, or one new position after 5 cached ones
    # (onnxruntime's rotary kernel wants a head size that is a multiple of 16)
    b, heads, kv_heads, hs = 2, 4, 2, 16 if case.startswith("rotary") else 8
    s, past = (4, 0) if case in ("prompt", "packed", "rotary_prompt") else (1, 5)
    feed = {"q": _f(b, s, heads * hs), "k": _f(b, s, kv_heads * hs), "v": _f(b, s, kv_heads * hs)}
    if past: feed |= {"pk": _f(b, kv_heads, past, hs), "pv": _f(b, kv_heads, past, hs)}
    feed |= {"seqlens_k": np.full(b, past + s - 1, np.int32), "total": np.array(past + s, np.int32)}
    if case == "ragged_decode":
        # a static cache of 8 positions, of which the first batch uses 5 and the second 3
        feed["seqlens_k"][1] = 3
        feed["pk"], feed["pv"] = (np.concatenate([feed[n], _f(b, kv_heads, 3, hs)], 2) for n in ("pk", "pv"))
    ins = ["q", "k", "v", "pk" if past else "", "pv" if past else "", "seqlens_k", "total"]
    if case == "packed":
        feed["q"] = np.concatenate([feed.pop("q"), feed.pop("k"), feed.pop("v")], -1)
        ins[1:3] = ["", ""]
    attrs = {"local_window_size": 2, "softcap": 2.0} if case == "window_softcap" else {}
    if case == "smooth_softmax": attrs = {"smooth_softmax": 1}
    if case == "head_sink":
        feed["sink"] = _f(heads)
        ins += ["", "", "", "", "sink"]
    if case.startswith("rotary"):
        # the angles of positions 0..15 (the caches are (max position, head_size / 2))
        ang = np.arange(16, dtype=np.float32)[:, None] * (10000.0 ** (-np.arange(hs // 2) / (hs // 2)))[None, :]
        feed |= {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
        ins += ["cos", "sin"]
        attrs = {"do_rotary": 1, "rotary_interleaved": int("interleaved" in case)}
    node = _ms("GroupQueryAttention", ins, ["y", "pko", "pvo"], num_heads=heads, kv_num_heads=kv_heads, **attrs)
    got, want = _run_both([node], feed, {}, ["y", "pko", "pvo"])
    assert got[1].shape == (b, kv_heads, 8 if case == "ragged_decode" else past + s, hs)
    _assert_close(got, want)


@pytest.mark.parametrize("mode,case", [(1, "ragged_bias"), (2, "ragged_bias"), (1, "prompt_window_softcap"),
                                       _slow(2, "prompt_window_softcap")])
def test_group_query_attention_scores(mode, case):
    # qk_output 1: the scaled scores with attention_bias, 0 where a key is hidden; 2: the probabilities. A static cache
    # of 8 positions of which 3 and 5 are used (present and scores as long as total_sequence_length, 6), or a prompt
    b, heads, kv_heads, hs = 2, 4, 2, 8
    s, buf, total = (1, 8, 6) if case == "ragged_bias" else (4, 0, 4)
    feed = {"q": _f(b, s, heads * hs), "k": _f(b, s, kv_heads * hs), "v": _f(b, s, kv_heads * hs)}
    if buf: feed |= {"pk": _f(b, kv_heads, buf, hs), "pv": _f(b, kv_heads, buf, hs)}
    feed |= {"seqlens_k": np.array([3, 5] if buf else [3, 3], np.int32), "total": np.array(total, np.int32)}
    ins = ["q", "k", "v", "pk" if buf else "", "pv" if buf else "", "seqlens_k", "total"]
    attrs = {"local_window_size": 2, "softcap": 2.0} if "softcap" in case else {}
    if case == "ragged_bias":
        feed["ab"] = _f(b, 1, s, total)
        ins += ["", "", "", "ab"]
    node = _ms("GroupQueryAttention", ins, ["y", "pko", "pvo", "qk"], num_heads=heads, kv_num_heads=kv_heads,
               qk_output=mode, **attrs)
    _assert_close(*_run_both([node], feed, {}, ["y", "pko", "pvo", "qk"]))


@pytest.mark.parametrize("case", ["causal_past_gqa_3d", "bool_mask_4d", "softcap_scale"])
def test_onnx_attention(case):
    """The default domain's Attention (opset 23) against onnxruntime's kernel (ONNX's node cases run with -m slow)."""
    b, s, past, hs = 2, 3, 4, 8
    if case == "causal_past_gqa_3d":
        # 4 query heads over 2 key/value heads, (batch, seq, hidden) inputs, a cache of 4 positions
        feed = {"q": _f(b, s, 4 * hs), "k": _f(b, s, 2 * hs), "v": _f(b, s, 2 * hs), "pk": _f(b, 2, past, hs),
                "pv": _f(b, 2, past, hs)}
        node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "pko", "pvo"], is_causal=1,
                                q_num_heads=4, kv_num_heads=2)
        outs = ["y", "pko", "pvo"]
    elif case == "bool_mask_4d":
        mask = RNG.random((s, 5)) > 0.3
        mask[:, 0] = True
        feed = {"q": _f(b, 2, s, hs), "k": _f(b, 2, 5, hs), "v": _f(b, 2, 5, hs), "m": mask}
        node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"])
        outs = ["y"]
    else:
        feed = {"q": _f(b, 2, s, hs) * 3, "k": _f(b, 2, 5, hs), "v": _f(b, 2, 5, hs), "m": _f(b, 1, s, 5)}
        node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y", "", "", "qk"], scale=0.3, softcap=2.0,
                                qk_matmul_output_mode=2)
        outs = ["y", "qk"]
    _assert_close(*_run_both([node], feed, {}, outs, opset=23))


@pytest.mark.parametrize("interleaved,rot_dim", [(0, 0), (1, 4)])
def test_rotary_embedding(interleaved, rot_dim):
    # the default domain's RotaryEmbedding (opset 23) with position ids into the caches, on (batch, seq, hidden)
    b, s, heads, hs = 2, 5, 2, 8
    half = (rot_dim or hs) // 2
    feed = {"x": _f(b, s, heads * hs), "pos": np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], np.int64),
            "cos": _f(10, half), "sin": _f(10, half)}
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=interleaved,
                            num_heads=heads, rotary_embedding_dim=rot_dim)
    _assert_close(*_run_both([node], feed, {}, ["y"], opset=23), tol=1e-5)


def test_unsupported_and_bad_attention_inputs_name_the_node():
    from fusegrad.onnx import OnnxNodeError, OnnxUnsupportedError

    def model(node, feed):
        ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in feed.items()]
        graph = helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                       helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    feed = {"qkv": _f(1, 3, 2, 3, 4)}
    m = model(_ms("MultiHeadAttention", ["qkv"], ["y"], num_heads=3, name="mha"), feed)
    with pytest.raises(OnnxNodeError, match=r"'mha' \(MultiHeadAttention\).*packed QKV query must have shape"):
        OnnxRunner(m)(feed)
    feed = {"x": _f(1, 3, 8), "w": _f(8, 24)}
    m = model(_ms("Attention", ["x", "w"], ["y"], num_heads=2, do_rotary=1, name="att"), feed)
    with pytest.raises(OnnxUnsupportedError, match=r"'att' \(Attention\).*rotary"): OnnxRunner(m)(feed)
    feed = {"q": _f(1, 3, 8), "k": _f(1, 3, 8), "v": _f(1, 3, 8)}
    m = model(helper.make_node("Attention", ["q", "k", "v"], ["y"], name="a23"), feed)
    with pytest.raises(OnnxNodeError, match=r"'a23' \(Attention\).*q_num_heads and kv_num_heads"): OnnxRunner(m)(feed)
    m = model(helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=2, kv_num_heads=2,
                               qk_matmul_output_mode=4, name="a23"), feed)
    with pytest.raises(OnnxUnsupportedError, match=r"qk_matmul_output_mode=4"): OnnxRunner(m)(feed)


@pytest.mark.parametrize("layout,interleaved,offset", [_slow("3d", 0, False), ("4d", 1, False),
                                                       ("3d", 1, True)])
def test_ms_rotary_embedding(layout, interleaved, offset):
    # com.microsoft's RotaryEmbedding: position ids per token, or one offset for all (the next decode steps)
    b, s, heads, hs = 2, 3, 2, 16
    x = _f(b, s, heads * hs) if layout == "3d" else _f(b, heads, s, hs)
    pos = np.array([4], np.int64) if offset else np.array([[0, 1, 2], [5, 6, 7]], np.int64)
    feed = {"x": x, "pos": pos, "cos": _f(12, hs // 2), "sin": _f(12, hs // 2)}
    node = _ms("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], interleaved=interleaved,
               num_heads=heads if layout == "3d" else 0)
    _assert_close(*_run_both([node], feed, {}, ["y"]), tol=1e-5)
