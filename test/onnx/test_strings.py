"""String tensors (NumPy arrays of str, on the host) through the string ops, against onnx's reference evaluator, and
the errors where a string value would have to live on the device."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from fusegrad.onnx import OnnxInputError, OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 4)])


def _vi(n, t, shape=None): return helper.make_tensor_value_info(n, t, shape)


def _check(model, feed):
    want = ReferenceEvaluator(model).run(None, feed)
    got = OnnxRunner(model)(feed)
    for o, w in zip(model.graph.output, want):
        g = got[o.name]
        if isinstance(g, np.ndarray): assert g.tolist() == w.tolist(), o.name
        else: np.testing.assert_array_equal(g.numpy(), w, err_msg=o.name)
    return got


def test_a_chain_of_string_ops():
    # split, concatenate with a constant, match, compare, encode
    nodes = [helper.make_node("StringSplit", ["x"], ["parts", "n"], delimiter="-", maxsplit=1),
             helper.make_node("Constant", [], ["suffix"], value_strings=["!"]),
             helper.make_node("StringConcat", ["parts", "suffix"], ["loud"]),
             helper.make_node("RegexFullMatch", ["x"], ["m"], pattern=r"[a-z]+-\d+"),
             helper.make_node("Equal", ["x", "y"], ["eq"]),
             helper.make_node("LabelEncoder", ["x"], ["code"], domain="ai.onnx.ml", keys_strings=["ab-1", "cd"],
                              values_int64s=[7, 9], default_int64=-5)]
    model = _model(nodes, [_vi("x", TP.STRING, [4]), _vi("y", TP.STRING, [4])],
                   [_vi("parts", TP.STRING), _vi("n", TP.INT64), _vi("loud", TP.STRING), _vi("m", TP.BOOL),
                    _vi("eq", TP.BOOL), _vi("code", TP.INT64)])
    feed = {"x": np.array(["ab-1", "cd", "e-f-g", "été-3"], dtype=object),
            "y": np.array(["ab-1", "x", "e-f-g", "ete-3"], dtype=object)}
    got = _check(model, feed)
    assert got["code"].numpy().tolist() == [7, 9, -5, -5]


def test_label_encoder_numbers_to_strings():
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_floats=[0.5, float("nan"), 2.0],
                            values_strings=["half", "none", "two"], default_string="?")
    model = _model([node], [_vi("x", TP.FLOAT, [5])], [_vi("y", TP.STRING)])
    # a NaN key matches NaN (onnx's reference evaluator misses that: onnxruntime)
    ort = pytest.importorskip("onnxruntime")
    feed = {"x": np.array([0.5, 2.0, np.nan, 3.0, 0.5], np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = OnnxRunner(model)(feed)["y"]
    assert got.tolist() == want.tolist() == ["half", "two", "none", "?", "half"]


def test_string_values_never_reach_the_device():
    model = _model([helper.make_node("RegexFullMatch", ["x"], ["m"], pattern="a+")], [_vi("x", TP.STRING, [2])],
                   [_vi("m", TP.BOOL)])
    with pytest.raises(OnnxInputError, match="string tensors"):
        OnnxRunner(model).jit()({"x": np.array(["a", "b"], dtype=object)})
    # a string constant inside a captured model: refused when the capture runs the op
    nodes = [helper.make_node("Constant", [], ["s"], value_strings=["aa", "b"]),
             helper.make_node("RegexFullMatch", ["s"], ["m"], pattern="a+", name="rx"),
             helper.make_node("Cast", ["m"], ["f"], to=TP.FLOAT), helper.make_node("Add", ["f", "z"], ["y"])]
    model = _model(nodes, [_vi("z", TP.FLOAT, [2])], [_vi("y", TP.FLOAT)])
    np.testing.assert_array_equal(OnnxRunner(model)({"z": np.ones(2, np.float32)})["y"].numpy(), [2.0, 1.0])
    run = OnnxRunner(model).jit()
    run({"z": np.ones(2, np.float32)})
    with pytest.raises(OnnxUnsupportedError, match=r"'rx' \(RegexFullMatch\).*TinyJit"):
        run({"z": np.ones(2, np.float32)})
    # an op that works on the device refuses strings, naming the node
    model = _model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")],
                   [_vi("x", TP.STRING, [2]), _vi("shape", TP.INT64, [1])], [_vi("y", TP.STRING)])
    with pytest.raises(OnnxUnsupportedError, match=r"'r' \(Reshape\): string inputs"):
        OnnxRunner(model)({"x": np.array(["a", "b"], dtype=object), "shape": np.array([2], np.int64)})
    with pytest.raises(OnnxInputError, match="array of str"):
        OnnxRunner(model)({"x": np.array([1, 2]), "shape": np.array([2], np.int64)})


def test_label_encoder_numbers_on_the_device_under_jit():
    # integers to floats with a NaN-free table: a select per key, so a capture replays it
    ort = pytest.importorskip("onnxruntime")
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_int64s=[3, -1, 7],
                            values_floats=[0.5, 2.0, -4.0], default_float=9.0)
    model = _model([node], [_vi("x", TP.INT64, [6])], [_vi("y", TP.FLOAT)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    run = OnnxRunner(model).jit()
    for k in range(3):
        feed = {"x": np.array([3, -1, 7, 0, 3, k], np.int64)}
        np.testing.assert_array_equal(run(feed)["y"], sess.run(None, feed)[0])
    # float keys with NaN
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_floats=[1.5, float("nan")],
                            values_int64s=[10, 20])
    model = _model([node], [_vi("x", TP.FLOAT, [4])], [_vi("y", TP.INT64)])
    feed = {"x": np.array([1.5, np.nan, 0.0, 1.5], np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_array_equal(OnnxRunner(model).jit()(feed)["y"], want)


@pytest.mark.parametrize("n_keys", [2, 70])   # (a select per key on the device; a table on the host past 64 keys)
def test_label_encoder_repeated_key_takes_the_last_value_wherever_it_runs(n_keys):
    keys = [1, 1] + list(range(100, 100 + n_keys - 2))
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", keys_int64s=keys,
                            values_int64s=[10 * (i + 1) for i in range(n_keys)], default_int64=-1)
    model = _model([node], [_vi("x", TP.INT64, [3])], [_vi("y", TP.INT64)])
    _check(model, {"x": np.array([1, 5, 100 if n_keys > 2 else 1], np.int64)})


def test_string_normalizer_stopwords_ignore_case_by_lowering():
    # (lower-cased, not case-folded: "SS" isn't the stop word "ß")
    node = helper.make_node("StringNormalizer", ["x"], ["y"], stopwords=["ß"], is_case_sensitive=0)
    model = _model([node], [_vi("x", TP.STRING, [3])], [_vi("y", TP.STRING)])
    _check(model, {"x": np.array(["SS", "ß", "cat"], dtype=object)})


def _normalizer(action: str, locale: str | None, stopwords=(), case_sensitive: int = 0):
    attrs = {"case_change_action": action, "is_case_sensitive": case_sensitive}
    if locale is not None: attrs["locale"] = locale
    if stopwords: attrs["stopwords"] = list(stopwords)
    node = helper.make_node("StringNormalizer", ["x"], ["y"], name="norm", **attrs)
    return _model([node], [_vi("x", TP.STRING, [None])], [_vi("y", TP.STRING)])


WORDS = np.array(["istanbul", "I\u0130\u0131i", "stra\u00dfe", "\u01c6", "\u01c4emal", "\u00c9t\u00c9"], dtype=object)


@pytest.mark.parametrize("action", ["UPPER", "LOWER"])
def test_normalizer_c_locale_as_onnxruntime(action):
    """The C locale changes ASCII letters only (onnxruntime's kernel, through C++'s ctype facet)."""
    ort = pytest.importorskip("onnxruntime")
    model = _normalizer(action, "C")
    model.ir_version = 10
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": WORDS})
    assert OnnxRunner(model)({"x": WORDS})["y"].tolist() == want[0].tolist()


@pytest.mark.parametrize("locale,upper,lower", [
    # (C++'s facets map one character to one: ß and other characters whose Unicode mapping is longer keep their case)
    ("", ["ISTANBUL", "I\u0130II", "STRA\u00dfE", "\u01c4", "\u01c4EMAL", "\u00c9T\u00c9"],
     ["istanbul", "iiıi", "stra\u00dfe", "\u01c6", "\u01c6emal", "\u00e9t\u00e9"]),
    ("tr_TR.UTF-8", ["\u0130STANBUL", "I\u0130I\u0130", "STRA\u00dfE", "\u01c4", "\u01c4EMAL", "\u00c9T\u00c9"],
     ["istanbul", "\u0131i\u0131i", "stra\u00dfe", "\u01c6", "\u01c6emal", "\u00e9t\u00e9"])])
def test_normalizer_locales(locale, upper, lower):
    assert OnnxRunner(_normalizer("UPPER", locale))({"x": WORDS})["y"].tolist() == upper
    assert OnnxRunner(_normalizer("LOWER", locale))({"x": WORDS})["y"].tolist() == lower
    # (stop words compared without case in the locale: Turkish "I" is the lower case of "ı", not of "i")
    got = OnnxRunner(_normalizer("NONE", locale, ["ISTANBUL"]))({"x": WORDS})["y"].tolist()
    assert got == (WORDS.tolist()[1:] if locale == "" else WORDS.tolist())


def test_normalizer_bad_locale_names_the_node():
    with pytest.raises(OnnxNodeError, match=r"'norm' \(StringNormalizer\).*locale 'en US!' is no locale name"):
        OnnxRunner(_normalizer("UPPER", "en US!"))({"x": WORDS})
