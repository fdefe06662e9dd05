"""The com.microsoft quantized ops (the QOperator format and dynamic quantization of onnxruntime's tools) against
onnxruntime's CPU kernels on hand-built graphs.

Integer outputs are compared exactly. Where the exact value (computed here in float64 from the float32 scales) is a
tie, x.5, onnxruntime's float32 arithmetic (which differs per op: fused multiply-adds in QLinearAdd, a float sum of
dequantized values in QLinearAveragePool) can land on either side of it, and so can fusegrad's: there, and only
there, the two may differ by 1."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxRunner, OnnxUnsupportedError  # noqa: E402

RNG = np.random.default_rng(0)
TYPES = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}


def _ms(op, ins, outs, **attrs): return helper.make_node(op, ins, outs, domain="com.microsoft", **attrs)


def _model(node, feed: dict, inits: dict, out_type: int):
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feed.items()]
    outs = [helper.make_tensor_value_info(o, out_type if i == 0 else TensorProto.FLOAT, None)
            for i, o in enumerate(node.output) if o]
    graph = helper.make_graph([node], "g", ins, outs,
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(node, feed: dict, inits: dict, out_type: int):
    m = _model(node, feed, inits, out_type)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = OnnxRunner(m)(feed)
    return [got[o].numpy() for o in node.output if o], want


def _assert_quantized(got: np.ndarray, want: np.ndarray, exact: np.ndarray | None = None):
    """Equal, except by 1 where `exact` (the unrounded result, zero point included) is within 1e-3 of a tie."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    diff = got.astype(np.int64) - want.astype(np.int64)
    if exact is None:
        np.testing.assert_array_equal(got, want)
        return
    tie = np.abs(np.abs(exact - np.floor(exact)) - 0.5) < 1e-3
    assert not np.any(diff[~tie]), f"{int(np.count_nonzero(diff[~tie]))} values differ away from ties"
    assert np.abs(diff).max() <= 1


def _params(dt):
    f = np.float32
    z0 = 128 if dt == np.uint8 else 0
    return {"as": np.array(0.02, f), "az": np.array(z0 + 3, dt), "bs": np.array(0.037, f), "bz": np.array(z0 - 5, dt),
            "cs": np.array(0.05, f), "cz": np.array(z0 + 1, dt)}


def _ints(dt, *shape):
    lo, hi = (0, 256) if dt == np.uint8 else (-128, 128)
    return RNG.integers(lo, hi, shape).astype(dt)


def _exact(v, p, dt):
    lo, hi = (0, 255) if dt == np.uint8 else (-128, 127)
    return np.clip(v / np.float64(p["cs"]) + np.float64(p["cz"]), lo, hi)


def _deq(x, s, z): return (x.astype(np.float64) - np.float64(z)) * np.float64(s)


@pytest.mark.parametrize("dt", [np.uint8, pytest.param(np.int8, marks=pytest.mark.slow)])
def test_elementwise(dt):
    p, t = _params(dt), TYPES[dt]
    a, b = _ints(dt, 4, 9, 7), _ints(dt, 9, 7)  # (b broadcasts)
    da, db = _deq(a, p["as"], p["az"]), _deq(b, p["bs"], p["bz"])
    ins = ["a", "as", "az", "b", "bs", "bz", "cs", "cz"]
    got, want = _run(_ms("QLinearAdd", ins, ["y"]), {"a": a, "b": b}, p, t)
    _assert_quantized(got[0], want[0], _exact(da + db, p, dt))
    got, want = _run(_ms("QLinearMul", ins, ["y"]), {"a": a, "b": b}, p, t)
    _assert_quantized(got[0], want[0], _exact(da * db, p, dt))
    for node in (_ms("QLinearSigmoid", ["a", "as", "az", "cs", "cz"], ["y"]),
                 _ms("QLinearLeakyRelu", ["a", "as", "az", "cs", "cz"], ["y"], alpha=0.13)):
        got, want = _run(node, {"a": a}, p, t)
        _assert_quantized(got[0], want[0])
    c = RNG.random((4, 9, 7)) > 0.5
    got, want = _run(_ms("QLinearWhere", ["c", "a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["y"]),
                     {"c": c, "a": a, "b": b}, p, t)
    _assert_quantized(got[0], want[0])
    got, want = _run(_ms("QLinearConcat", ["cs", "cz", "a", "as", "az", "a2", "bs", "bz"], ["y"], axis=1),
                     {"a": a, "a2": a[:, :5]}, p, t)
    _assert_quantized(got[0], want[0])


@pytest.mark.parametrize("dt,ys", [(np.uint8, 1 / 256), (np.uint8, 1 / 255),
                                   pytest.param(np.int8, 1 / 256, marks=pytest.mark.slow),
                                   pytest.param(np.int8, 0.0071, marks=pytest.mark.slow)])
def test_softmax(dt, ys):
    """onnxruntime multiplies the probabilities by the reciprocal of y_scale truncated to an integer: with 1/255 (the
    scale its quantizer gives a uint8 softmax output) by 254, so that some values are 1 below round(p / y_scale);
    fusegrad does the same and agrees exactly."""
    p, t = _params(dt), TYPES[dt]
    p |= {"ys": np.array(ys, np.float32), "yz": np.array(0 if dt == np.uint8 else -128, dt)}
    a = _ints(dt, 3, 4, 20)
    for axis, opset in ((-1, 13), (1, 11)):
        got, want = _run(_ms("QLinearSoftmax", ["a", "as", "az", "ys", "yz"], ["y"], axis=axis, opset=opset), {"a": a},
                         p, t)
        _assert_quantized(got[0], want[0])


@pytest.mark.parametrize("attrs", [pytest.param({"kernel_shape": [2, 2]}, marks=pytest.mark.slow),
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                                   pytest.param({"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                                 "count_include_pad": 1}, marks=pytest.mark.slow),
                                   {"kernel_shape": [2, 2], "channels_last": 1}])
def test_average_pools(attrs):
    dt = np.uint8
    p = _params(dt)
    x = _ints(dt, 2, 5, 9, 9)
    got, want = _run(_ms("QLinearAveragePool", ["x", "as", "az", "cs", "cz"], ["y"], **attrs), {"x": x}, p,
                     TensorProto.UINT8)
    # the exact averages, from the centered integers (windows summed by a convolution with ones)
    cl = attrs.get("channels_last", 0)
    xc = x.transpose(0, 3, 1, 2) if cl else x
    k, s, pad = attrs["kernel_shape"][0], attrs.get("strides", [1])[0], attrs.get("pads", [0])[0]
    xp = np.pad(_deq(xc, p["as"], p["az"]), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ones = np.pad(np.ones(xc.shape[2:]), pad)
    nh, nw = ((d - k) // s + 1 for d in xp.shape[2:])
    sums = np.stack([np.stack([xp[:, :, i * s:i * s + k, j * s:j * s + k].sum((2, 3)) for j in range(nw)], -1)
                     for i in range(nh)], -2)
    counts = np.array([[k * k if attrs.get("count_include_pad") else ones[i * s:i * s + k, j * s:j * s + k].sum()
                        for j in range(nw)] for i in range(nh)])
    exact = _exact(sums / counts, p, dt)
    _assert_quantized(got[0], want[0], exact.transpose(0, 2, 3, 1) if cl else exact)
    got, want = _run(_ms("QLinearGlobalAveragePool", ["x", "as", "az", "cs", "cz"], ["y"], channels_last=cl),
                     {"x": x}, p, TensorProto.UINT8)
    _assert_quantized(got[0], want[0])


def test_qgemm_and_integer_matmuls_to_float():
    # B with 7-bit values: onnxruntime's uint8 x int8 kernels without VNNI saturate pairs of 8-bit products
    a, b = RNG.integers(0, 256, (5, 32)).astype(np.uint8), RNG.integers(-64, 64, (32, 6)).astype(np.int8)
    f = np.float32
    inits = {"as": np.array(0.02, f), "az": np.array(130, np.uint8), "bs": np.array(0.01, f),
             "bz": np.array(0, np.int8), "ys": np.array(0.3, f), "yz": np.array(128, np.uint8),
             "c": RNG.integers(-2000, 2000, 6).astype(np.int32), "bsc": (RNG.random(6) * 0.02 + 0.005).astype(f),
             "bzc": np.zeros(6, np.int8), "bias": RNG.standard_normal(6).astype(f)}
    feed = {"a": a, "b": b}
    got, want = _run(_ms("QGemm", ["a", "as", "az", "b", "bs", "bz", "c", "ys", "yz"], ["y"]), feed, inits,
                     TensorProto.UINT8)
    _assert_quantized(got[0], want[0])
    # per-column scales of a transposed B
    got, want = _run(_ms("QGemm", ["a", "as", "az", "bt", "bsc", "bzc", "c", "ys", "yz"], ["y"], transB=1),
                     {"a": a, "bt": np.ascontiguousarray(b.T)}, inits, TensorProto.UINT8)
    _assert_quantized(got[0], want[0])
    # a float result (no y_scale); float32 products of exact integer sums
    for node, fd in ((_ms("QGemm", ["a", "as", "az", "b", "bs", "bz", "c"], ["y"], alpha=0.5), feed),
                     (_ms("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az", "bz", "bias"], ["y"]), feed),
                     (_ms("MatMulIntegerToFloat", ["a", "b", "as", "bsc", "az", "bzc"], ["y"]), feed),
                     (_ms("DynamicQuantizeMatMul", ["af", "b", "bs", "bz", "bias"], ["y"]),
                      {"af": RNG.standard_normal((3, 5, 32)).astype(f), "b": b}),
                     (_ms("DynamicQuantizeMatMul", ["af", "b", "bsc"], ["y"]),
                      {"af": RNG.standard_normal((2, 32)).astype(f), "b": b})):
        got, want = _run(node, fd, inits, TensorProto.FLOAT)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6, err_msg=node.op_type)


@pytest.mark.parametrize("past", [False, True])
def test_qattention(past):
    b, s, hidden, heads = 2, 4, 16, 4
    f = np.float32
    inits = {"w": RNG.integers(-60, 60, (hidden, 3 * hidden)).astype(np.int8),
             "bias": RNG.standard_normal(3 * hidden).astype(f) * 0.1, "xs": np.array(0.01, f),
             "ws": np.array(0.01, f), "xz": np.array(128, np.uint8), "wz": np.array(0, np.int8)}
    feed = {"x": RNG.integers(0, 256, (b, s, hidden)).astype(np.uint8)}
    ins, outs, attrs = ["x", "w", "bias", "xs", "ws", "", "xz", "wz"], ["y"], {}
    if past:
        feed |= {"m": np.ones((b, 3 + s), np.int32), "past": RNG.standard_normal((2, b, heads, 3, 4)).astype(f)}
        feed["m"][1, 2] = 0
        ins[5], outs, attrs = "m", ["y", "present"], {"unidirectional": 1}
        ins.append("past")
    got, want = _run(_ms("QAttention", ins, outs, num_heads=heads, **attrs), feed, inits, TensorProto.FLOAT)
    for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_unsupported_values_name_the_node():
    p = _params(np.uint8)
    p["az"] = np.array([1, 2, 3], np.uint8)
    node = _ms("QLinearSigmoid", ["a", "as", "az", "cs", "cz"], ["y"], name="sig")
    m = _model(node, {"a": _ints(np.uint8, 2, 3)}, p, TensorProto.UINT8)
    with pytest.raises(OnnxUnsupportedError, match=r"'sig' \(QLinearSigmoid\).*zero point of shape \(3,\)"):
        OnnxRunner(m)({"a": _ints(np.uint8, 2, 3)})


@pytest.mark.parametrize("trans_a", [0, 1])
def test_qgemm_zero_point_of_a_per_row(trans_a):
    # onnxruntime's CPU kernel takes one zero point for A: NumPy from the definition, in int64 and float64
    m, k, n = 5, 12, 7
    a = RNG.integers(0, 256, (m, k)).astype(np.uint8)
    b = RNG.integers(-128, 128, (k, n)).astype(np.int8)
    azp = RNG.integers(100, 160, m).astype(np.uint8)
    bzp = RNG.integers(-4, 4, n).astype(np.int8)
    c = RNG.integers(-500, 500, n).astype(np.int32)
    f = np.float32
    inits = {"as": np.array(0.02, f), "az": azp, "bs": np.array(0.01, f), "bz": bzp, "c": c,
             "ys": np.array(0.5, f), "yz": np.array(3, np.int8)}
    feed = {"a": np.ascontiguousarray(a.T) if trans_a else a, "b": b}
    acc = (a.astype(np.int64) - azp.astype(np.int64)[:, None]) @ (b.astype(np.int64) - bzp.astype(np.int64)) + c
    node = _ms("QGemm", ["a", "as", "az", "b", "bs", "bz", "c"], ["y"], transA=trans_a, alpha=0.5)
    got = OnnxRunner(_model(node, feed, inits, TensorProto.FLOAT))(feed)["y"].numpy()
    np.testing.assert_allclose(got, acc * (0.02 * 0.01 * 0.5), rtol=1e-5)
    node = _ms("QGemm", ["a", "as", "az", "b", "bs", "bz", "c", "ys", "yz"], ["y"], transA=trans_a)
    got = OnnxRunner(_model(node, feed, inits, TensorProto.INT8))(feed)["y"].numpy()
    exact = acc * (f(0.02) * f(0.01) / f(0.5)).astype(np.float64) + 3
    _assert_quantized(got, np.clip(np.round(exact), -128, 127).astype(np.int8), exact)
    # a zero point of the wrong length is named
    inits["az"] = azp[:3]
    with pytest.raises(Exception, match="one per row of A'"):
        OnnxRunner(_model(node, feed, inits, TensorProto.INT8))(feed)
