"""com.microsoft's MultiHeadAttention with past buffers shared with the presents (past_sequence_length) and beam
search's cache_indirection, against onnxruntime's CPU kernel, plainly and under TinyJit."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402

RNG = np.random.default_rng(0)


def _model(b: int, s: int, heads: int, size: int, buf: int, beam: int | None, **attrs):
    d = heads * size
    ins = ["q", "k", "v", "", "", "", "pk", "pv", "psl"] + (["ci"] if beam else [])
    node = helper.make_node("MultiHeadAttention", ins, ["y", "prk", "prv"], domain="com.microsoft", num_heads=heads,
                            **attrs)

    def vi(n, t, shape): return helper.make_tensor_value_info(n, t, shape)
    inputs = [vi("q", TP.FLOAT, [b, s, d]), vi("k", TP.FLOAT, [b, s, d]), vi("v", TP.FLOAT, [b, s, d]),
              vi("pk", TP.FLOAT, [b, heads, buf, size]), vi("pv", TP.FLOAT, [b, heads, buf, size]),
              vi("psl", TP.INT32, [1])] + ([vi("ci", TP.INT32, [b // beam, beam, buf])] if beam else [])
    g = helper.make_graph([node], "g", inputs, [vi("y", TP.FLOAT, None), vi("prk", TP.FLOAT, None),
                                                vi("prv", TP.FLOAT, None)])
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
