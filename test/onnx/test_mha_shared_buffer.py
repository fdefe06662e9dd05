"""com.microsoft's MultiHeadAttention with past buffers shared with the presents (past_sequence_length) and beam
search's cache_indirection, against onnxruntime's CPU kernel, plainly and under TinyJit."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402

RNG = np.random.default_rng(0)


def _model(b: int, s: int, heads: int, size: int, buf: int, beam: int | None, scores: bool = False, **attrs):
    d = heads * size
    ins = ["q", "k", "v", "", "", "", "pk", "pv", "psl"] + (["ci"] if beam else [])
    outs = ["y", "prk", "prv"] + (["qk"] if scores else [])
    node = helper.make_node("MultiHeadAttention", ins, outs, domain="com.microsoft", num_heads=heads, **attrs)

    def vi(n, t, shape): return helper.make_tensor_value_info(n, t, shape)
    inputs = [vi("q", TP.FLOAT, [b, s, d]), vi("k", TP.FLOAT, [b, s, d]), vi("v", TP.FLOAT, [b, s, d]),
              vi("pk", TP.FLOAT, [b, heads, buf, size]), vi("pv", TP.FLOAT, [b, heads, buf, size]),
              vi("psl", TP.INT32, [1])] + ([vi("ci", TP.INT32, [b // beam, beam, buf])] if beam else [])
    g = helper.make_graph([node], "g", inputs, [vi(o, TP.FLOAT, None) for o in outs])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _feed(b, s, heads, size, buf, beam, past_len):
    d = heads * size
    f = {"q": RNG.standard_normal((b, s, d)), "k": RNG.standard_normal((b, s, d)), "v": RNG.standard_normal((b, s, d)),
         "pk": RNG.standard_normal((b, heads, buf, size)), "pv": RNG.standard_normal((b, heads, buf, size))}
    f = {k: v.astype(np.float32) for k, v in f.items()}
    f["psl"] = np.array([past_len], np.int32)
    if beam: f["ci"] = RNG.integers(0, beam, (b // beam, beam, buf)).astype(np.int32)
    return f


@pytest.mark.parametrize("b,s,beam,attrs", [(2, 1, None, {}), (4, 1, 2, {}), (6, 1, 3, {"scale": 0.3}),
                                            (2, 3, None, {"unidirectional": 1})])
def test_against_onnxruntime(b, s, beam, attrs):
    heads, size, buf = 2, 4, 8
    model = _model(b, s, heads, size, buf, beam, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jit = OnnxRunner(model).jit()
    for past_len in (0, 3, buf - s):   # the first call captures, the others replay with other past lengths
        feed = _feed(b, s, heads, size, buf, beam, past_len)
        want = sess.run(None, feed)
        for got in (OnnxRunner(model)(feed), jit(feed)):
            for name, w in zip(("y", "prk", "prv"), want):
                g = got[name] if isinstance(got[name], np.ndarray) else got[name].numpy()
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{name}, past length {past_len}")


@pytest.mark.parametrize("b,s,beam,attrs", [(2, 1, None, {}), (4, 1, 2, {"unidirectional": 1}),
                                            (2, 3, None, {"unidirectional": 1}), (2, 3, None, {"scale": 0.5})])
def test_scores_against_onnxruntime(b, s, beam, attrs):
    # the fourth output is (batch, heads, seq, past length + seq), its causally hidden entries float's lowest value
    heads, size, buf = 2, 4, 8
    model = _model(b, s, heads, size, buf, beam, scores=True, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    runner = OnnxRunner(model)
    for past_len in (0, 2, buf - s):
        feed = _feed(b, s, heads, size, buf, beam, past_len)
        want, got = sess.run(None, feed)[3], runner(feed)["qk"].numpy()
        assert got.shape == want.shape == (b, heads, s, past_len + s)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"past length {past_len}")


def test_scores_under_jit_need_a_host_past_length():
    model = _model(2, 1, 2, 4, 8, None, scores=True)
    jit = OnnxRunner(model).jit()
    jit(_feed(2, 1, 2, 4, 8, None, 3))   # (TinyJit's first call runs plainly)
    with pytest.raises(OnnxUnsupportedError, match="scores output with past_sequence_length"):
        jit(_feed(2, 1, 2, 4, 8, None, 3))


@pytest.mark.parametrize("s,past_len", [(1, 8), (1, -1), (3, 6)])
def test_past_length_out_of_range(s, past_len):
    # onnxruntime refuses these too; new keys past the buffer's end would be dropped
    runner = OnnxRunner(_model(2, s, 2, 4, 8, None))
    with pytest.raises(OnnxNodeError, match=f"past_sequence_length {past_len} with {s} new positions"):
        runner(_feed(2, s, 2, 4, 8, None, past_len))


@pytest.mark.parametrize("value", [2, -1])
def test_cache_indirection_out_of_range(value):
    runner = OnnxRunner(_model(4, 1, 2, 4, 8, 2))
    feed = _feed(4, 1, 2, 4, 8, 2, 3)
    feed["ci"][:] = 0
    feed["ci"][1, 0, 5] = value          # past the valid positions: not read, so not checked (as onnxruntime)
    runner(feed)["y"].realize()
    feed["ci"][1, 1, 2] = value
    with pytest.raises(OnnxNodeError, match=rf"at \(1, 1, 2\) \(batch, beam, position\) it holds {value}"):
        runner(feed)


@pytest.mark.parametrize("unidirectional", [0, 1])
def test_masks_as_long_as_the_valid_keys(unidirectional):
    # onnxruntime's key_padding_mask and attention_bias cover past length + S keys, not the whole buffer
    b, heads, size, buf, past_len = 2, 2, 4, 8, 3
    d, total = heads * size, past_len + 1
    ins = ["q", "k", "v", "", "kpm", "ab", "pk", "pv", "psl"]
    node = helper.make_node("MultiHeadAttention", ins, ["y", "prk", "prv", "qk"], domain="com.microsoft",
                            num_heads=heads, unidirectional=unidirectional)

    def vi(n, t, shape): return helper.make_tensor_value_info(n, t, shape)
    inputs = [vi("q", TP.FLOAT, [b, 1, d]), vi("k", TP.FLOAT, [b, 1, d]), vi("v", TP.FLOAT, [b, 1, d]),
              vi("kpm", TP.INT32, [b, total]), vi("ab", TP.FLOAT, [1, heads, 1, total]),
              vi("pk", TP.FLOAT, [b, heads, buf, size]), vi("pv", TP.FLOAT, [b, heads, buf, size]),
              vi("psl", TP.INT32, [1])]
    g = helper.make_graph([node], "g", inputs, [vi(o, TP.FLOAT, None) for o in ("y", "prk", "prv", "qk")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    feed = _feed(b, 1, heads, size, buf, None, past_len)
    feed["kpm"] = np.array([[1, 1, 0, 1], [1, 0, 1, 1]], np.int32)
    feed["ab"] = RNG.standard_normal((1, heads, 1, total)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = OnnxRunner(model)(feed)
    for name, w in zip(("y", "prk", "prv", "qk"), want):
        np.testing.assert_allclose(got[name].numpy(), w, rtol=1e-5, atol=1e-5, err_msg=name)
    feed["psl"] = np.array([2], np.int32)   # (a mask of 4 keys where 3 are valid)
    with pytest.raises(OnnxNodeError, match="key_padding_mask's last dim 4 is neither"):
        OnnxRunner(model)(feed)


def test_jit_checks_past_length_and_beam_indices_on_every_replay():
    """Under jit() the past length and the beam indices come from the device; they are checked after each replay
    (the replay runs no Python of the op) with the same errors as a plain call, and a valid call after a refused one
    is right again."""
    model = _model(4, 1, 2, 4, 8, 2)
    jit = OnnxRunner(model).jit()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for past_len in (2, 5, 7, 3):   # (the first call runs plainly, the second captures, the rest replay)
        feed = _feed(4, 1, 2, 4, 8, 2, past_len)
        want = sess.run(["y"], feed)[0]
        np.testing.assert_allclose(jit(feed)["y"], want, rtol=1e-5, atol=1e-5)
    assert len(jit.captured) > 0
    with pytest.raises(OnnxNodeError, match="past_sequence_length 8 with 1 new positions"):
        jit(_feed(4, 1, 2, 4, 8, 2, 8))
    with pytest.raises(OnnxNodeError, match="past_sequence_length -1 with 1 new positions"):
        jit(_feed(4, 1, 2, 4, 8, 2, -1))
    feed = _feed(4, 1, 2, 4, 8, 2, 3)
    feed["ci"][1, 0, 5] = 7   # (past the valid positions: not read, so not checked)
    np.testing.assert_allclose(jit(feed)["y"], sess.run(["y"], feed)[0], rtol=1e-5, atol=1e-5)
    feed["ci"][0, 1, 1] = -1
    with pytest.raises(OnnxNodeError, match=r"at \(0, 1, 1\) \(batch, beam, position\) it holds -1"):
        jit(feed)
    feed["ci"][0, 1, 1] = 1
    np.testing.assert_allclose(jit(feed)["y"], sess.run(["y"], feed)[0], rtol=1e-5, atol=1e-5)
