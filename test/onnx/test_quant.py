"""The quantization ops on hand-built graphs and on models quantized by onnxruntime's own tools, against
onnxruntime."""
from __future__ import annotations


import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402
from test.onnx import quiet  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ort(model, feed):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


@pytest.mark.parametrize("zp_type,zp", [(TensorProto.UINT8, 10), (TensorProto.INT8, -3)])
def test_quantize_rounds_half_to_even_and_saturates(zp_type, zp):
    # ties at every parity, both signs, and values far outside the range of the type
    x = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49, 1000.0, -1000.0, 126.5, -127.5], dtype=np.float32)
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]), helper.make_tensor("z", zp_type, [], [zp])]
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [12])],
               [helper.make_tensor_value_info("y", zp_type, [12])], inits)
    got = OnnxRunner(m)({"x": x})["y"].numpy()
    want = _ort(m, {"x": x})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_matmul_integer_accumulates_exactly():
    # the largest products of uint8 by int8, summed over 64: far beyond int16, exact in int32
    a = np.full((3, 64), 255, dtype=np.uint8)
    b = np.full((64, 5), 127, dtype=np.int8)
    b[:, 1] = -128
    m = _model([helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
               [helper.make_tensor_value_info("a", TensorProto.UINT8, [3, 64]),
                helper.make_tensor_value_info("b", TensorProto.INT8, [64, 5])],
               [helper.make_tensor_value_info("y", TensorProto.INT32, [3, 5])])
    got = OnnxRunner(m)({"a": a, "b": b})["y"].numpy()
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


def _calibration(n: int):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self): self.data = iter([{"x": _image(i)} for i in range(n)])
        def get_next(self): return next(self.data, None)
    return Reader()


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 3, 32, 32)).astype(np.float32)


@pytest.mark.parametrize("how", ["static_qdq", "static_qoperator", "dynamic"])
def test_quantized_resnet_matches_onnxruntime(how, resnet_path, tmp_path):
    """The exported CNN quantized by onnxruntime.quantization: QDQ (Quantize/DequantizeLinear around float ops, weights
    per channel), QOperator (QLinearConv, and com.microsoft's QLinearAdd for the residual sums and QGemm for the
    classifier) and dynamic (DynamicQuantizeLinear, ConvInteger, MatMulInteger).

    The weights are quantized to 7 bits (reduce_range): onnxruntime's uint8 x int8 kernels on CPUs without VNNI sum
    pairs of products in int16 with saturation, so with full 8-bit weights its results are not the exact int32 sums
    that ONNX specifies (and that fusegrad computes). With 7 bits they are exact, every integer and quantized tensor
    agrees, and the outputs differ only by the float32 rounding of the float ops left (the Gemm, the mean) and of
    the final DequantizeLinear: an absolute tolerance of 1e-5 on logits of size ~0.5 bounds that with room."""
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static
    out = str(tmp_path / f"{how}.onnx")
    with quiet():
        if how == "dynamic": quantize_dynamic(resnet_path, out, reduce_range=True)
        else:
            fmt = QuantFormat.QDQ if how == "static_qdq" else QuantFormat.QOperator
            quantize_static(resnet_path, out, _calibration(4), quant_format=fmt, per_channel=how == "static_qdq",
                            reduce_range=True)
    ops = {n.op_type for n in onnx.load(out).graph.node}
    wanted = {"static_qdq": {"QuantizeLinear", "DequantizeLinear"},
              "static_qoperator": {"QLinearConv", "QLinearAdd", "QGemm"},
              "dynamic": {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"}}[how]
    assert wanted <= ops, ops
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    runner = OnnxRunner(out)
    for seed in (10, 11):
        x = _image(seed)
        want = sess.run(None, {"x": x})[0]
        got = next(iter(runner({"x": x}).values())).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # the quantized model is still close to the float one (so the comparison above is of a working model)
    ref = ort.InferenceSession(resnet_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(got - ref).max() < 0.2 * np.abs(ref).max()


def _ids(seed: int) -> np.ndarray: return np.random.default_rng(seed).integers(0, 100, (2, 16)).astype(np.int64)


@pytest.fixture(scope="module")
def encoder_path(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from test.onnx.models import export
    path = str(tmp_path_factory.mktemp("encoder") / "encoder.onnx")
    export("encoder", path, 2)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["static_qoperator", "dynamic"])
def test_quantized_encoder_matches_onnxruntime(how, encoder_path, tmp_path):
    """The exported BERT-style encoder quantized by onnxruntime.quantization: QOperator (QLinearMatMul, and
    com.microsoft's QGemm, QLinearAdd, QLinearMul and QLinearSoftmax) and dynamic (DynamicQuantizeLinear,
    MatMulInteger), weights in 7 bits as above. Every quantized tensor agrees, so the outputs (layer-normed hidden
    states of size ~3, a tanh pooler) differ only by the float32 rounding of the float ops between them."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_dynamic, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self): self.data = iter([{"x": _ids(i)} for i in range(4)])
        def get_next(self): return next(self.data, None)
    out = str(tmp_path / f"{how}.onnx")
    with quiet():
        if how == "dynamic": quantize_dynamic(encoder_path, out, reduce_range=True)
        else: quantize_static(encoder_path, out, Reader(), quant_format=QuantFormat.QOperator, reduce_range=True)
    ops = {n.op_type for n in onnx.load(out).graph.node}
    wanted = {"static_qoperator": {"QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearSoftmax"},
              "dynamic": {"DynamicQuantizeLinear", "MatMulInteger"}}[how]
    assert wanted <= ops, ops
    x = _ids(10)
    want = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = list(OnnxRunner(out)({"x": x}).values())
    for g, w in zip(got, want): np.testing.assert_allclose(g.numpy(), w, rtol=0, atol=1e-5)
    ref = ort.InferenceSession(encoder_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(got[1].numpy() - ref[1]).max() < 0.2 * np.abs(ref[1]).max()


def test_quantized_qoperator_ops_match_onnxruntime(tmp_path):
    """A small CNN built here (conv, LeakyReLU, a sigmoid gate, concat, average and global average pools, a residual
    add) quantized to QOperator: onnxruntime's tool writes com.microsoft's QLinearLeakyRelu, QLinearSigmoid,
    QLinearMul, QLinearConcat, QLinearAveragePool, QLinearGlobalAveragePool and QLinearAdd. Every quantized value
    agrees (none of these inputs meets a tie), so the dequantized outputs are equal."""
    from onnx import numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
    w = (np.random.default_rng(0).standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("LeakyRelu", ["c"], ["l"], alpha=0.1),
             helper.make_node("Sigmoid", ["l"], ["s"]),
             helper.make_node("Mul", ["l", "s"], ["m"]),
             helper.make_node("Concat", ["m", "l"], ["cat"], axis=1),
             helper.make_node("AveragePool", ["cat"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"]),
             helper.make_node("Add", ["p", "g"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(w, "w")],
                   opset=17)
    src, out = str(tmp_path / "cnn.onnx"), str(tmp_path / "cnn_q.onnx")
    onnx.save(model, src)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.data = iter([{"x": np.random.default_rng(i).standard_normal((2, 3, 8, 8)).astype(np.float32)}
                              for i in range(4)])
        def get_next(self): return next(self.data, None)
    with quiet():
        quantize_static(src, out, Reader(), quant_format=QuantFormat.QOperator, reduce_range=True)
    ops = {n.op_type for n in onnx.load(out).graph.node}
    assert {"QLinearLeakyRelu", "QLinearSigmoid", "QLinearMul", "QLinearConcat", "QLinearAveragePool",
            "QLinearGlobalAveragePool", "QLinearAdd"} <= ops, ops
    x = np.random.default_rng(9).standard_normal((2, 3, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(OnnxRunner(out)({"x": x})["y"].numpy(), want, rtol=0, atol=1e-6)


def test_dynamically_quantized_attention_matches_onnxruntime(tmp_path):
    """com.microsoft's Attention (with a key mask) and an output projection, quantized by quantize_dynamic: QAttention,
    DynamicQuantizeLinear and MatMulInteger, equal to onnxruntime."""
    from onnx import numpy_helper
    from onnxruntime.quantization import quantize_dynamic
    rng, h = np.random.default_rng(0), 32
    inits = [numpy_helper.from_array((rng.standard_normal((h, 3 * h)) * 0.2).astype(np.float32), "wqkv"),
             numpy_helper.from_array((rng.standard_normal(3 * h) * 0.1).astype(np.float32), "bqkv"),
             numpy_helper.from_array((rng.standard_normal((h, h)) * 0.2).astype(np.float32), "wo")]
    nodes = [helper.make_node("Attention", ["x", "wqkv", "bqkv", "mask"], ["a"], domain="com.microsoft", num_heads=4),
             helper.make_node("MatMul", ["a", "wo"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, h]),
                                           helper.make_tensor_value_info("mask", TensorProto.INT32, [2, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    src, out = str(tmp_path / "att.onnx"), str(tmp_path / "att_q.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)], ir_version=8), src)
    with quiet():
        quantize_dynamic(src, out, reduce_range=True)
    assert {"QAttention", "DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in onnx.load(out).graph.node}
    x = rng.standard_normal((2, 5, h)).astype(np.float32)
    mask = np.ones((2, 5), np.int32)
    mask[1, 3:] = 0
    want = ort.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x, "mask": mask})[0]
    np.testing.assert_allclose(OnnxRunner(out)({"x": x, "mask": mask})["y"].numpy(), want, rtol=0, atol=1e-5)


def _quantize(src: str, out: str, how: str, reader, per_channel: bool) -> None:
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static
    with quiet():
        if how == "dynamic": quantize_dynamic(src, out, per_channel=per_channel, reduce_range=True)
        else:
            fmt = QuantFormat.QDQ if how == "static_qdq" else QuantFormat.QOperator
            quantize_static(src, out, reader, quant_format=fmt, per_channel=per_channel, reduce_range=True)


def _per_axis_scales(path: str) -> int:
    """How many of the model's scale initializers hold one value per channel."""
    from onnx import numpy_helper
    return sum(1 for i in onnx.load(path).graph.initializer
               if i.name.endswith("scale") and numpy_helper.to_array(i).size > 1)


def _slow(*values): return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize("name,how", [("resnet", "static_qoperator"), ("resnet", "dynamic"),
                                      _slow("encoder", "static_qdq"), _slow("encoder", "static_qoperator"),
                                      _slow("encoder", "dynamic")])
def test_per_channel_quantized_models_match_onnxruntime(name, how, resnet_path, tmp_path, request):
    """The CNN and the encoder quantized with per_channel=True: the weights of the convs and matmuls have a scale (and
    zero point) per output channel, in QLinearConv, QLinearMatMul, QGemm, MatMulInteger with a rescaling Mul, or
    DequantizeLinear with an axis (onnxruntime's dynamic quantization keeps a ConvInteger's weights per tensor).
    Weights in 7 bits as above. Every quantized tensor agrees with onnxruntime's with its optimizations off (the
    model's own ops) and as it runs the model: its optimizer turns QDQ groups into QLinearMatMul, QGemm and
    QLinearSoftmax, and its QLinearSoftmax rounds differently from Softmax and QuantizeLinear (see test_quant_ms's
    test_softmax), so for QDQ that optimized graph is saved and run by both."""
    src = resnet_path if name == "resnet" else request.getfixturevalue("encoder_path")
    make = _image if name == "resnet" else _ids
    out = str(tmp_path / f"{name}_{how}.onnx")

    class Reader:
        def __init__(self): self.data = iter([{"x": make(i)} for i in range(4)])
        def get_next(self): return next(self.data, None)
    _quantize(src, out, how, Reader(), per_channel=True)
    assert _per_axis_scales(out) >= 1, "no weights quantized per channel"
    x = make(10)

    def compare(path: str, level) -> list[np.ndarray]:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        fused = path != out
        if fused: opts.optimized_model_filepath = path
        want = ort.InferenceSession(out, opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        got = [g.numpy() for g in OnnxRunner(path)({"x": x}).values()]
        for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
        return got
    got = compare(out, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    if how == "static_qdq": compare(str(tmp_path / "fused.onnx"), ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    else: compare(out, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[-1]
    assert np.abs(got[-1] - ref).max() < 0.2 * np.abs(ref).max()


@pytest.mark.parametrize("zp_type", [TensorProto.UINT8, TensorProto.INT8, TensorProto.INT16, TensorProto.INT4,
                                     TensorProto.UINT4])
def test_quantize_nan_goes_to_the_bottom_of_the_range(zp_type):
    # a NaN is quantized to the type's lowest value, as onnx's reference evaluator does (and onnxruntime, where it
    # runs the type), not left to an undefined C cast; the integers that follow it see that value too
    x = np.array([np.nan, 1.0, -np.nan, 1e6], dtype=np.float32)
    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]), helper.make_tensor("z", zp_type, [], [0])]
    m = _model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
               [helper.make_tensor_value_info("q", zp_type, [4]), helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                               [4])], inits)
    from onnx.reference import ReferenceEvaluator
    with np.errstate(invalid="ignore"):
        want_q, want_y = ReferenceEvaluator(m).run(None, {"x": x})
    got = OnnxRunner(m)({"x": x})
    np.testing.assert_array_equal(np.asarray(got["q"].numpy()).astype(np.int64), want_q.astype(np.int64))
    np.testing.assert_array_equal(got["y"].numpy(), want_y)
