"""Cast and CastLike to and from STRING (on the host): numbers written as onnx's reference writes them, strings read
as onnx's reference reads them into float types and as onnxruntime reads them into integer and bool types (the
reference's NumPy can't read "100.5" as an integer and takes any non-empty string for True)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as TP, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402


def _cast(src: int, dst: int) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=dst, name="the_cast")], "g",
                          [helper.make_tensor_value_info("x", src, None)],
                          [helper.make_tensor_value_info("y", dst, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


FLOATS = np.array([0.1, 1e-5, 1e20, 123456789, np.inf, -np.inf, np.nan, -0.0, 3.0, 1 / 3, 1e-40, 65504], np.float32)
HALVES = FLOATS[np.abs(np.nan_to_num(FLOATS, posinf=0, neginf=0)) <= 65504].astype(np.float16)


@pytest.mark.parametrize("src,x", [(TP.FLOAT, FLOATS), (TP.DOUBLE, FLOATS.astype(np.float64) / 3),
                                   (TP.FLOAT16, HALVES), (TP.BOOL, np.array([True, False])),
                                   (TP.INT64, np.array([-5, 2 ** 63 - 1])), (TP.UINT8, np.array([0, 255], np.uint8))],
                         ids=["float", "double", "float16", "bool", "int64", "uint8"])
def test_to_string_against_reference(src, x):
    model = _cast(src, TP.STRING)
    got = OnnxRunner(model)({"x": x})["y"]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert isinstance(got, np.ndarray) and got.dtype == object and got.tolist() == want.tolist()


def test_narrow_to_string():
    # (onnx's reference can't write ml_dtypes' types: each value by ml_dtypes' str, which reads back the same)
    for t, arr in ((TP.FLOAT8E4M3FN, np.array([0.3125, -448, 0.001953125], ml_dtypes.float8_e4m3fn)),
                   (TP.INT4, np.array([-8, 7, 0], ml_dtypes.int4))):
        got = OnnxRunner(_cast(t, TP.STRING))({"x": arr})["y"]
        assert got.tolist() == [str(v) for v in arr]
        assert np.array_equal(np.array([float(s) for s in got]).astype(arr.dtype), arr)


STRINGS = np.array(["+INF", "INF", "-Inf", "NaN", "nan", "1e-5", "1E8", "3.14", "  2 ", "-0", "100.5", "0.1"],
                   dtype=object)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")   # (the reference's float16 "1E8")
@pytest.mark.parametrize("dst", [TP.FLOAT, TP.DOUBLE, TP.FLOAT16], ids=lambda t: TP.DataType.Name(t))
def test_from_string_to_floats_against_reference(dst):
    model = _cast(TP.STRING, dst)
    got = OnnxRunner(model)({"x": STRINGS})["y"].numpy()
    want = ReferenceEvaluator(model).run(None, {"x": STRINGS})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dst", [TP.INT64, TP.INT8, TP.UINT8, TP.BOOL], ids=lambda t: TP.DataType.Name(t))
def test_from_string_to_integers_against_onnxruntime(dst):
    # decimals truncate toward zero, integers out of range keep their low bits, "0" is False
    x = np.array(["0", "1", "-1", "300", "100.5", "-2.7", " 7 ", "9223372036854775807"], dtype=object)
    model = _cast(TP.STRING, dst)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(OnnxRunner(model)({"x": x})["y"].numpy(), sess.run(None, {"x": x})[0])


def test_from_string_to_narrow_types():
    # read as a number, then rounded as Cast rounds a float64 (saturating)
    x = np.array(["0.3", "-1000", "nan", "1e-9"], dtype=object)
    got = OnnxRunner(_cast(TP.STRING, TP.FLOAT8E4M3FN))({"x": x})["y"].numpy()
    assert got.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got.astype(np.float32), [0.3125, -448, np.nan, 0])
    got = OnnxRunner(_cast(TP.STRING, TP.INT4))({"x": np.array(["7", "9", "-2.5"], dtype=object)})["y"].numpy()
    np.testing.assert_array_equal(got.astype(np.int32), [7, -7, -2])


def test_cast_like_strings():
    nodes = [helper.make_node("CastLike", ["x", "s"], ["as_str"]),
             helper.make_node("CastLike", ["as_str", "x"], ["back"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3]),
                                       helper.make_tensor_value_info("s", TP.STRING, [1])],
                          [helper.make_tensor_value_info("as_str", TP.STRING, None),
                           helper.make_tensor_value_info("back", TP.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    feed = {"x": np.array([0.1, -2, np.inf], np.float32), "s": np.array(["a"], dtype=object)}
    want = ReferenceEvaluator(model).run(None, feed)
    got = OnnxRunner(model)(feed)
    assert got["as_str"].tolist() == want[0].tolist()
    np.testing.assert_array_equal(got["back"].numpy(), want[1])


def test_string_cast_errors():
    with pytest.raises(OnnxNodeError, match=r"'the_cast' \(Cast\).*'hello' is not a number"):
        OnnxRunner(_cast(TP.STRING, TP.FLOAT))({"x": np.array(["1", "hello"], dtype=object)})
    with pytest.raises(OnnxNodeError, match="'nan' to an integer type"):
        OnnxRunner(_cast(TP.STRING, TP.INT32))({"x": np.array(["nan"], dtype=object)})
    # a replay runs no host code: a capture refuses the cast, naming the node
    runner = OnnxRunner(_cast(TP.FLOAT, TP.STRING))

    @TinyJit
    def step(x: Tensor) -> list: return [runner({"x": x})["y"]]
    step(Tensor(np.ones(2, np.float32)))
    with pytest.raises(OnnxUnsupportedError, match=r"'the_cast' \(Cast\).*TinyJit capture"):
        step(Tensor(np.ones(2, np.float32)))


def _ort_run(model, feed):
    model.ir_version = 10   # (onnxruntime reads up to its own IR version)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("src,x", [(TP.FLOAT, FLOATS), (TP.DOUBLE, FLOATS.astype(np.float64) / 3),
                                   (TP.FLOAT16, HALVES), (TP.BOOL, np.array([True, False])),
                                   (TP.INT64, np.array([-5, 2 ** 63 - 1])), (TP.INT8, np.array([-128, 7], np.int8))],
                         ids=["float", "double", "float16", "bool", "int64", "int8"])
def test_to_string_as_onnxruntime_writes(src, x):
    model = _cast(src, TP.STRING)
    got = OnnxRunner(model, cast_strings="onnxruntime")({"x": x})["y"]
    assert got.tolist() == _ort_run(model, {"x": x}).tolist()


def test_hexadecimal_strings_to_floats_as_onnxruntime_reads_them():
    x = np.array(["0x10", "0x1p3", "-0x1.8p1", "0X.8", " 0x1F ", "0x1p-149", "1e3"], dtype=object)
    for dst in (TP.FLOAT, TP.DOUBLE):
        model = _cast(TP.STRING, dst)
        np.testing.assert_array_equal(OnnxRunner(model)({"x": x})["y"].numpy(), _ort_run(model, {"x": x}))
    with pytest.raises(OnnxNodeError, match=r"'the_cast' \(Cast\).*'0x10' is a hexadecimal literal, read for float"):
        OnnxRunner(_cast(TP.STRING, TP.INT32))({"x": np.array(["0x10"], dtype=object)})
    with pytest.raises(ValueError, match="cast_strings must be one of 'onnx', 'onnxruntime', got 'c'"):
        OnnxRunner(_cast(TP.FLOAT, TP.STRING), cast_strings="c")
