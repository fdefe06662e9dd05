"""StringNormalizer in locales other than C against onnxruntime, whose kernel builds a C++ std::locale of the name: the
locales must exist on the machine. CI compiles them (.ci/run); where one is missing it is compiled here with glibc's
localedef (seconds per locale) into a folder that LOCPATH names, in pytest's cache, kept for later runs."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402

# (en_US.UTF-8 is onnxruntime's default, the locale "")
LOCALES = ["tr_TR.UTF-8", "el_GR.UTF-8", "en_US.UTF-8"]
# Turkish i, German ß, Greek final sigma, titlecase digraphs, a ligature, Cyrillic, a letter whose upper case is two
WORDS = np.array(["istanbul", "Istanbul", "\u0130STANBUL", "\u0131i", "Stra\u00dfe", "\u00c9COLE", "\u01c5",
                  "\u01c6emal", "\u03a3\u038a\u03a3\u03a5\u03a6\u039f\u03a3", "\ufb03",
                  "\u041f\u0420\u0418\u0412\u0415\u0422",
                  "\u00c0\u00c9\u00ce\u00f5\u00fc", "\u01f0", "abc"], dtype=object)


def _model(action: str, locale: str, stopwords: list[str] | None = None) -> onnx.ModelProto:
    attrs = {"stopwords": stopwords} if stopwords else {}
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action=action, locale=locale, **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.STRING, [None])],
                              [helper.make_tensor_value_info("y", TP.STRING, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _exists(name: str) -> bool:
    try: _session(_model("UPPER", name))
    except Exception: return False
    return True


@pytest.fixture(scope="module")
def locales(request, tmp_path_factory):
    """The locales, compiled into a LOCPATH folder where the machine lacks them (glibc reads LOCPATH whenever a locale
    is made, onnxruntime's too)."""
    missing = [n for n in LOCALES if not _exists(n)]
    if not missing:
        yield LOCALES
        return
    assert shutil.which("localedef"), f"locales {missing} are missing and glibc's localedef is not installed " \
        f"(apt-get install locales)"
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("onnx_locales") if cache is not None else tmp_path_factory.mktemp("locales")
    # (parallel workers share the folder: one compiles, under the lock, what the others then find)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for n in missing:
            if not (folder / n).is_dir():
                subprocess.run(["localedef", "-i", n.split(".")[0], "-f", "UTF-8", str(folder / f"{n}.tmp")],
                               check=True, capture_output=True)
                os.replace(folder / f"{n}.tmp", folder / n)
    old = os.environ.get("LOCPATH")
    os.environ["LOCPATH"] = str(folder)
    try:
        assert all(_exists(n) for n in missing), f"onnxruntime finds no locale of {missing} in {folder}"
        yield LOCALES
    finally:
        if old is None: del os.environ["LOCPATH"]
        else: os.environ["LOCPATH"] = old


@pytest.mark.parametrize("action", ["UPPER", "LOWER"])
def test_normalizer_in_locales_as_onnxruntime(locales, action):
    for name in locales:
        model = _model(action, name)
        want = _session(model).run(None, {"x": WORDS})[0].tolist()
        assert OnnxRunner(model)({"x": WORDS})["y"].tolist() == want, name


def test_normalizer_stopwords_in_turkish_as_onnxruntime(locales):
    """Stop words are compared with the words lowered in the locale: Turkish lowers "ISTANBUL" to "ıstanbul" (as it
    does "Istanbul" alone), other locales to "istanbul" (as "istanbul", "Istanbul" and "İSTANBUL")."""
    for name, dropped in (("tr_TR.UTF-8", 1), ("en_US.UTF-8", 3)):
        model = _model("NONE", name, ["ISTANBUL", "STRASSE"])
        want = _session(model).run(None, {"x": WORDS})[0].tolist()
        assert OnnxRunner(model)({"x": WORDS})["y"].tolist() == want, name
        assert len(want) == len(WORDS) - dropped, name
