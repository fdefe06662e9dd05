"""The other ops added beyond the detection and signal ones (BitCast, SwiGLU, ReverseSequence, Unique, Det, Col2Im,
MaxUnpool, TensorScatter, CausalConvWithState, LinearAttention, FlexAttention, TfIdfVectorizer, the training
optimizers): ONNX's node cases (test_node_cases.py) check the documented examples; here random cases against
onnxruntime, or NumPy or torch where onnxruntime lacks the op, Unique under TinyJit, and bad inputs that name the
node."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402


def _model(op: str, inputs: dict[str, np.ndarray], outputs: dict[str, int], opset: int, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), list(outputs), name="the_node", **attrs)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for n, v in inputs.items()]
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()]
    return helper.make_model(helper.make_graph([node], "g", ins, outs), opset_imports=[helper.make_opsetid("", opset)])


def _ort(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize("time_axis", [0, 1])
def test_reverse_sequence_matches_onnxruntime(time_axis):
    rng = np.random.default_rng(time_axis)
    x = rng.standard_normal((6, 5, 3) if time_axis == 0 else (5, 6, 3)).astype(np.float32)
    feed = {"x": x, "lens": np.array([6, 1, 3, 2, 5], np.int64)}
    model = _model("ReverseSequence", feed, {"y": TensorProto.FLOAT}, 10, time_axis=time_axis,
                   batch_axis=1 - time_axis)
    np.testing.assert_array_equal(OnnxRunner(model)(feed)["y"].numpy(), _ort(model, feed)[0])


@pytest.mark.parametrize("axis,is_sorted", [(None, 1), (None, 0), (0, 0), (1, 1)])
def test_unique_matches_onnxruntime(axis, is_sorted):
    x = np.random.default_rng(4).integers(0, 3, (7, 2)).astype(np.float32)
    feed = {"x": x}
    outs = {"y": TensorProto.FLOAT, "first": TensorProto.INT64, "inverse": TensorProto.INT64,
            "counts": TensorProto.INT64}
    attrs = {"sorted": is_sorted} if axis is None else {"sorted": is_sorted, "axis": axis}
    model = _model("Unique", feed, outs, 11, **attrs)
    got = OnnxRunner(model)({"x": Tensor(x).realize()})
    for name, want in zip(outs, _ort(model, feed)):
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=name)


def test_unique_under_tinyjit_is_refused_for_device_values():
    model = _model("Unique", {"x": np.zeros(4, np.float32)}, {"y": TensorProto.FLOAT}, 11)
    runner = OnnxRunner(model)
    step = TinyJit(lambda x: runner({"x": x})["y"].realize())
    with pytest.raises(OnnxUnsupportedError, match=r"the_node.*Unique.*under TinyJit"):
        for _ in range(3): step(Tensor(np.arange(4, dtype=np.float32)).realize())


def test_bitcast_and_swiglu_match_onnxruntime_and_numpy():
    # (onnxruntime has BitCast but no SwiGLU kernel)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    model = _model("BitCast", {"x": x}, {"y": TensorProto.UINT32}, 26, to=TensorProto.UINT32)
    got = OnnxRunner(model)({"x": Tensor(x).realize()})["y"].numpy()
    np.testing.assert_array_equal(got, x.view(np.uint32))
    np.testing.assert_array_equal(got, _ort(model, {"x": x})[0])
    a, b = rng.standard_normal((2, 8)).astype(np.float16), rng.standard_normal((2, 8)).astype(np.float16)
    model = _model("SwiGLU", {"a": a, "b": b}, {"y": TensorProto.FLOAT16}, 28, alpha=1.7)
    af, bf = a.astype(np.float64), b.astype(np.float64)
    want = af / (1 + np.exp(-1.7 * af)) * bf
    got = OnnxRunner(model)({"a": a, "b": b})["y"].numpy()
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_det_matches_onnxruntime_and_numpy(dtype):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    x[0, 0, 0] = 0  # a zero first pivot needs a row swap
    x[1, 2, 3] = x[1, 2, 1]  # a singular matrix
    model = _model("Det", {"x": x}, {"y": helper.np_dtype_to_tensor_dtype(np.dtype(dtype))}, 11)
    got = OnnxRunner(model)({"x": Tensor(x).realize()})["y"].numpy()
    assert got.shape == (2, 3) and got.dtype == dtype
    if dtype == np.float32:  # onnxruntime's CPU kernel takes float32 only
        np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, np.linalg.det(x.astype(np.float64)), rtol=1e-4, atol=1e-5)


def test_col2im_matches_torch_fold():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    # 2 channels, 3x2 blocks, stride (2, 1), dilation (1, 2), pads (1, 0, 2, 1) on a 7x6 image
    n_h, n_w = (7 + 1 + 2 - 3) // 2 + 1, (6 + 0 + 1 - 2 * (2 - 1) - 1) // 1 + 1
    x = rng.standard_normal((2, 2 * 6, n_h * n_w)).astype(np.float32)
    feed = {"x": x, "image": np.array([7, 6], np.int64), "block": np.array([3, 2], np.int64)}
    model = _model("Col2Im", feed, {"y": TensorProto.FLOAT}, 18, strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1])
    got = OnnxRunner(model)({**feed, "x": Tensor(x).realize()})["y"].numpy()
    # torch pads both sides alike: fold onto the image padded to (1 + 7 + 2, 0 + 6 + 1) and crop
    full = torch.nn.functional.fold(torch.from_numpy(x), (10, 7), (3, 2), dilation=(1, 2), stride=(2, 1)).numpy()
    np.testing.assert_allclose(got, full[:, :, 1:8, 0:6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-5, atol=1e-5)


def test_max_pool_then_unpool_matches_onnxruntime():
    x = np.random.default_rng(8).standard_normal((2, 3, 6, 8)).astype(np.float32)
    pool = helper.make_node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])
    unpool = helper.make_node("MaxUnpool", ["p", "i"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    graph = helper.make_graph([pool, unpool], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    want = _ort(model, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    # each 2x2 window keeps its maximum in place, the rest is 0
    windows = x.reshape(2, 3, 3, 2, 4, 2)
    np.testing.assert_array_equal(got.reshape(windows.shape).sum((3, 5)), windows.max((3, 5)))
    assert (got != 0).sum() == 2 * 3 * 3 * 4 and np.array_equal(got[got != 0], x[got != 0])


def test_max_unpool_output_shape_adds_zeros_after_the_unpooled_shape():
    # ONNX's reference places the values by their indices in the unpooled (4, 4) shape and pads it to output_shape
    # (onnxruntime reads the indices in output_shape's layout instead)
    x = np.array([[[[1, 2], [3, 4]]], [[[5, 6], [7, 8]]]], np.float32)
    idx = np.array([[[[0, 3], [12, 10]]], [[[21, 23], [25, 31]]]], np.int64)
    feed = {"x": x, "i": idx, "shape": np.array([2, 1, 5, 6], np.int64)}
    model = _model("MaxUnpool", feed, {"y": TensorProto.FLOAT}, 12, kernel_shape=[2, 2], strides=[2, 2])
    want = np.zeros(32, np.float32)
    want[idx.reshape(-1)] = x.reshape(-1)
    want = np.pad(want.reshape(2, 1, 4, 4), [(0, 0), (0, 0), (0, 1), (0, 2)])
    np.testing.assert_array_equal(OnnxRunner(model)(feed)["y"].numpy(), want)


def test_adam_steps_match_numpy():
    # ONNX's Adam: the bias correction folded into the rate, epsilon added to sqrt(h)
    rng = np.random.default_rng(9)
    x, g = rng.standard_normal((2, 5)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32)
    v, h = np.zeros_like(x), np.zeros_like(x)
    inputs = {"r": np.array(0.1, np.float32), "t": np.array(0, np.int64), "x": x, "g": g, "v": v, "h": h}
    node = helper.make_node("Adam", list(inputs), ["x2", "v2", "h2"], domain="ai.onnx.preview.training", alpha=0.8,
                            beta=0.95, epsilon=1e-3, norm_coefficient=0.01, norm_coefficient_post=0.02)
    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in inputs.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x2", "v2", "h2")]
    model = helper.make_model(helper.make_graph([node], "g", ins, outs), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.preview.training", 1)])
    runner = OnnxRunner(model)
    wx, wv, wh = x.astype(np.float64), v.astype(np.float64), h.astype(np.float64)
    for step in range(3):
        gr = g + 0.01 * wx
        wv, wh = 0.8 * wv + 0.2 * gr, 0.95 * wh + 0.05 * gr * gr
        rate = 0.1 * np.sqrt(1 - 0.95 ** step) / (1 - 0.8 ** step) if step else 0.1
        wx = 0.98 * (wx - rate * wv / (np.sqrt(wh) + 1e-3))
        out = runner({**inputs, "t": np.array(step, np.int64)})
        inputs.update(x=out["x2"].numpy(), v=out["v2"].numpy(), h=out["h2"].numpy())
        np.testing.assert_allclose(inputs["x"], wx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(inputs["h"], wh, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_matches_onnxruntime(mode):
    rng = np.random.default_rng(10)
    past = rng.standard_normal((3, 2, 8, 4)).astype(np.float32)
    update = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
    idx = np.array([0, 5, 7] if mode == "circular" else [0, 5, 2], np.int64)
    feed = {"past": past, "update": update, "idx": idx}
    model = _model("TensorScatter", feed, {"y": TensorProto.FLOAT}, 24, mode=mode)
    got = OnnxRunner(model)({k: Tensor(v).realize() for k, v in feed.items()})["y"].numpy()
    want = past.copy()
    for b in range(3):
        for s in range(3): want[b, :, (idx[b] + s) % 8] = update[b, :, s]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, _ort(model, feed)[0])


def test_causal_conv_with_state_matches_torch_and_carries_its_state():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 10)).astype(np.float32)
    w, bias = rng.standard_normal((3, 1, 4)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    state = np.zeros((2, 3, 3), np.float32)
    feed = {"x": x[:, :, :6], "w": w, "b": bias, "s": state}
    node = helper.make_node("CausalConvWithState", list(feed), ["y", "s2"], activation="silu")
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in feed]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "s2")]
    runner = OnnxRunner(helper.make_model(helper.make_graph([node], "g", ins, outs),
                                          opset_imports=[helper.make_opsetid("", 26)]))
    first = runner(feed)
    second = runner({**feed, "x": x[:, :, 6:], "s": first["s2"].numpy()})
    got = np.concatenate([first["y"].numpy(), second["y"].numpy()], 2)
    conv = torch.nn.functional.conv1d(torch.nn.functional.pad(torch.from_numpy(x), (3, 0)), torch.from_numpy(w),
                                      torch.from_numpy(bias), groups=3)
    np.testing.assert_allclose(got, torch.nn.functional.silu(conv).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(second["s2"].numpy(), x[:, :, 7:])


def test_gated_delta_linear_attention_matches_numpy():
    # 4 query heads over 2 kv heads, per-channel decay, per-head beta, a past state, 3 steps
    rng = np.random.default_rng(12)
    b, t, hq, hk, dk, dv = 2, 3, 4, 2, 3, 5
    feed = {"q": rng.standard_normal((b, t, hq * dk)).astype(np.float32),
            "k": rng.standard_normal((b, t, hk * dk)).astype(np.float32),
            "v": rng.standard_normal((b, t, hk * dv)).astype(np.float32),
            "s": rng.standard_normal((b, hk, dk, dv)).astype(np.float32),
            "g": -rng.random((b, t, hk * dk)).astype(np.float32), "beta": rng.random((b, t, hk)).astype(np.float32)}
    model = _model("LinearAttention", feed, {"y": TensorProto.FLOAT, "s2": TensorProto.FLOAT}, 27, q_num_heads=hq,
                   kv_num_heads=hk)
    got = OnnxRunner(model)(feed)
    state = feed["s"].astype(np.float64).copy()
    want = np.zeros((b, t, hq, dv))
    for i in range(t):
        for n in range(b):
            for h in range(hk):
                kv = feed["k"][n, i].reshape(hk, dk)[h]
                state[n, h] *= np.exp(feed["g"][n, i].reshape(hk, dk)[h])[:, None]
                new_v = feed["beta"][n, i, h] * (feed["v"][n, i].reshape(hk, dv)[h] - kv @ state[n, h])
                state[n, h] += np.outer(kv, new_v)
            for h in range(hq):
                want[n, i, h] = feed["q"][n, i].reshape(hq, dk)[h] @ state[n, h // 2] / np.sqrt(dk)
    np.testing.assert_allclose(got["y"].numpy(), want.reshape(b, t, hq * dv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["s2"].numpy(), state, rtol=1e-4, atol=1e-5)


def test_flex_attention_with_a_causal_score_mod_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 5, 8)).astype(np.float32), rng.standard_normal((2, 2, 5, 6)).astype(np.float32)
    causal = np.triu(np.full((5, 5), -np.inf, np.float32), 1)
    mod = helper.make_graph([helper.make_node("Add", ["s", "m"], ["o"])], "causal",
                            [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
                            [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)],
                            [helper.make_tensor("m", TensorProto.FLOAT, [5, 5], causal.reshape(-1))])
    node = helper.make_node("FlexAttention", ["q", "k", "v"], ["y"], domain="ai.onnx.preview", score_mod=mod)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "v")]
    model = helper.make_model(helper.make_graph([node], "g", ins, [helper.make_tensor_value_info("y", 1, None)]),
                              opset_imports=[helper.make_opsetid("", 26), helper.make_opsetid("ai.onnx.preview", 1)])
    got = OnnxRunner(model)({"q": q, "k": k, "v": v})["y"].numpy()
    tk, tv = (torch.from_numpy(a).repeat_interleave(2, dim=1) for a in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(torch.from_numpy(q), tk, tv, is_causal=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_tfidf_vectorizer_matches_onnxruntime(mode):
    x = np.random.default_rng(14).integers(0, 5, (3, 12)).astype(np.int64)
    model = _model("TfIdfVectorizer", {"x": x}, {"y": TensorProto.FLOAT}, 9, mode=mode, min_gram_length=1,
                   max_gram_length=2, max_skip_count=2, ngram_counts=[0, 3], ngram_indexes=[0, 1, 2, 3, 4, 5],
                   pool_int64s=[1, 2, 3, 1, 2, 3, 4, 0, 0], weights=[0.5, 1.0, 2.0, 1.5, 3.0, 0.25])
    got = OnnxRunner(model)({"x": Tensor(x).realize()})["y"].numpy()
    want = _ort(model, {"x": x})[0]
    assert got.shape == want.shape == (3, 6) and want.any()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bad_attributes_name_the_node():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(OnnxNodeError, match=r"the_node.*BitCast.*one size"):
        OnnxRunner(_model("BitCast", {"x": x}, {"y": TensorProto.INT64}, 26, to=TensorProto.INT64))({"x": x})
    with pytest.raises(OnnxNodeError, match=r"the_node.*ReverseSequence.*sequence_lens must have shape \(3,\)"):
        OnnxRunner(_model("ReverseSequence", {"x": x, "lens": np.array([1, 2], np.int64)}, {"y": TensorProto.FLOAT},
                          10))({"x": x, "lens": np.array([1, 2], np.int64)})
    with pytest.raises(OnnxNodeError, match=r"the_node.*Unique.*sorted must be 0 or 1"):
        OnnxRunner(_model("Unique", {"x": x}, {"y": TensorProto.FLOAT}, 11, sorted=2))({"x": x})


@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
                                "ReduceSum", "ReduceMax"])
def test_reduction_over_no_axes_with_noop_is_its_function_body(op):
    # noop_with_empty_axes without axes reduces nothing, but the function bodies (ReduceSum of |x|, of x * x, Log of
    # ReduceSum ...) still apply their elementwise part: |x| for ReduceL1, x * x for ReduceSumSquare (not x itself)
    x = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32)
    if op == "ReduceLogSum": x = np.abs(x) + 0.5
    expect = {"ReduceL1": np.abs, "ReduceL2": np.abs, "ReduceSumSquare": np.square, "ReduceLogSum": np.log}
    model = _model(op, {"x": x}, {"y": TensorProto.FLOAT}, 18, keepdims=0, noop_with_empty_axes=1)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    np.testing.assert_allclose(got, expect.get(op, lambda v: v)(x), rtol=1e-6)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-6)


@pytest.mark.parametrize("op,keepdims", [("ArgMax", 1), ("ArgMin", 0)])
def test_arg_reduction_over_an_empty_axis_without_results_is_empty(op, keepdims):
    # (0, 0) along axis 1: there is no result to pick, so no error (onnxruntime gives (0, 1) or (0,))
    x = np.zeros((0, 0), np.float32)
    model = _model(op, {"x": x}, {"y": TensorProto.INT64}, 13, axis=1, keepdims=keepdims, select_last_index=1)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    assert got.shape == _ort(model, {"x": x})[0].shape == ((0, 1) if keepdims else (0,)) and got.dtype == np.int64


@pytest.mark.parametrize("start,end,step", [(-(2**62), -(2**62), -1), (-7, -9, -1), (-5, 0, -2), (-1, -(2**62), -1)])
def test_slice_with_a_negative_step_from_before_the_start(start, end, step):
    # ONNX clamps a start before the dim's beginning to its first element for a negative step (Python's slice gives
    # nothing); x[0:...:-1] is then the first element alone
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    feed = {"x": x, "s": np.array([start], np.int64), "e": np.array([end], np.int64),
            "a": np.array([-1], np.int64), "p": np.array([step], np.int64)}
    model = _model("Slice", feed, {"y": TensorProto.FLOAT}, 13)
    got = OnnxRunner(model)(feed)["y"].numpy()
    np.testing.assert_array_equal(got, _ort(model, feed)[0])
    s = min(max(start + 4 if start < 0 else start, 0), 3)
    e = end + 4 if end < 0 else end
    np.testing.assert_array_equal(got, x[:, s::step] if e < 0 else x[:, s:e:step])


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_to_no_elements(mode):
    # a scale of 0.5 floors an axis of 1 to 0: an empty output, as onnxruntime gives, not an error
    feed = {"x": np.ones((1, 3, 1, 4), np.float32), "roi": np.zeros(0, np.float32),
            "scales": np.array([1, 1, 0.5, 0.5], np.float32)}
    model = _model("Resize", feed, {"y": TensorProto.FLOAT}, 13, mode=mode)
    got = OnnxRunner(model)(feed)["y"].numpy()
    assert got.shape == _ort(model, feed)[0].shape == (1, 3, 0, 2)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_with_a_window_longer_than_the_padded_input(op):
    # a 3x1 window dilated (2, 1) spans 5 rows of 3 (4 with the pad): the spec's floor((3 + 1 - 5) / 3) + 1 = 0 rows,
    # as onnx's reference gives (onnxruntime pools one window); the runner raised
    from onnx.reference import ReferenceEvaluator
    x = np.random.default_rng(4).standard_normal((1, 4, 3, 6)).astype(np.float32)
    model = _model(op, {"x": x}, {"y": TensorProto.FLOAT}, 19, pads=[1, 0, 0, 0], dilations=[2, 1],
                   kernel_shape=[3, 1], strides=[3, 3])
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    assert got.shape == ReferenceEvaluator(model).run(None, {"x": x})[0].shape == (1, 4, 0, 2)


@pytest.mark.parametrize("mode", ["cubic", "linear"])
def test_resize_pytorch_half_pixel_to_one_sample(mode):
    # the spec: x_original = length_resized > 1 ? (x_resized + 0.5) / scale - 0.5 : 0, with the integer length (2 rows
    # scaled by 0.75 are 1): the first row itself, as onnxruntime gives (onnx's reference samples at 1/6 there)
    x = np.random.default_rng(5).standard_normal((3, 1, 2, 1)).astype(np.float32)
    feed = {"x": x, "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 0.75, 2], np.float32)}
    model = _model("Resize", feed, {"y": TensorProto.FLOAT}, 13, mode=mode,
                   coordinate_transformation_mode="pytorch_half_pixel")
    got = OnnxRunner(model)(feed)["y"].numpy()
    np.testing.assert_allclose(got, np.repeat(x[:, :, :1], 2, axis=3), rtol=1e-6)
    np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-6)


@pytest.mark.parametrize("mode", ["linear", "cubic"])
def test_resize_align_corners_divides_by_the_resized_length(mode):
    # the spec: x_original = x_resized * (length_original - 1) / (length_resized - 1), length_resized the integer
    # length (4 * 0.6 -> 2): the last sample is the last column, as onnxruntime gives ([1, 4] for the first row)
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 2, 4)
    feed = {"x": x, "roi": np.zeros(0, np.float32), "scales": np.array([1, 1, 0.6, 0.6], np.float32)}
    model = _model("Resize", feed, {"y": TensorProto.FLOAT}, 13, mode=mode,
                   coordinate_transformation_mode="align_corners")
    got = OnnxRunner(model)(feed)["y"].numpy()
    np.testing.assert_allclose(got, [[[[1, 4]]]], rtol=1e-6)
    np.testing.assert_allclose(got, _ort(model, feed)[0], rtol=1e-6)


@pytest.mark.parametrize("shape,attrs", [((1, 1, 2, 5), dict(kernel_shape=[1, 2], strides=[1, 2])),
                                         ((1, 2, 5), dict(kernel_shape=[2], pads=[0, 1], strides=[3])),
                                         ((1, 2, 6), dict(kernel_shape=[3], pads=[1, 1], strides=[2]))])
def test_lp_pool_ceil_mode_windows_past_the_end(shape, attrs):
    # a window ceil_mode adds past the end is the p-norm of what it covers (one element: its magnitude), and none
    # starts in the right padding; onnx's reference scales the partial window as an average, so onnxruntime checks
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    model = _model("LpPool", {"x": x}, {"y": TensorProto.FLOAT}, 18, ceil_mode=1, p=3, **attrs)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5)
    if len(shape) == 4: np.testing.assert_allclose(got[..., -1], np.abs(x[..., -1]), rtol=1e-5)


@pytest.mark.parametrize("op,attrs", [("AveragePool", dict(count_include_pad=1)), ("AveragePool", {}),
                                      ("MaxPool", {})])
def test_pool_ceil_mode_with_pads_beyond_half_the_kernel(op, attrs):
    # pads beyond half the kernel are applied by hand: ceil_mode must still make no window that starts in the right
    # padding (width 5, kernel 2, pads (0, 1), stride 3: 2 windows, not 3)
    x = np.random.default_rng(7).standard_normal((1, 6, 9, 5)).astype(np.float32)
    model = _model(op, {"x": x}, {"y": TensorProto.FLOAT}, 13, ceil_mode=1, kernel_shape=[3, 2], pads=[1, 0, 2, 1],
                   strides=[1, 3], **attrs)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    assert got.shape == (1, 6, 10, 2)
    np.testing.assert_allclose(got, _ort(model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_hardmax_over_an_empty_axis():
    x = np.zeros((2, 0, 3), np.float32)
    model = _model("Hardmax", {"x": x}, {"y": TensorProto.FLOAT}, 13, axis=1)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    assert got.shape == _ort(model, {"x": x})[0].shape == (2, 0, 3)


@pytest.mark.parametrize("op,opset", [("Softmax", 13), ("LogSoftmax", 11), ("Softmax", 11)])
def test_softmax_of_an_empty_tensor(op, opset):
    # (0, 1, 0) along axis 0: no row to normalize, an empty result as onnxruntime gives
    x = np.zeros((0, 1, 0), np.float32)
    model = _model(op, {"x": x}, {"y": TensorProto.FLOAT}, opset, axis=0)
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    assert got.shape == _ort(model, {"x": x})[0].shape == (0, 1, 0)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("rows,kernel,dilation,stride", [(2, 2, 2, 1), (3, 3, 2, 2), (3, 2, 3, 2)])
def test_pool_ceil_mode_with_a_window_longer_than_the_input(op, rows, kernel, dilation, stride):
    # ceil((rows - span) / stride) + 1 windows: none for a span longer by a stride or more, else one (onnxruntime and
    # onnx's reference agree); the runner raised 'kernel is larger than the padded input' for none
    x = np.random.default_rng(8).standard_normal((1, 2, rows, 3)).astype(np.float32)
    model = _model(op, {"x": x}, {"y": TensorProto.FLOAT}, 19, ceil_mode=1, dilations=[dilation, 1],
                   kernel_shape=[kernel, 1], strides=[stride, 1])
    got = OnnxRunner(model)({"x": x})["y"].numpy()
    want = _ort(model, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5)
