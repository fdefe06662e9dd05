"""RegexFullMatch reads its pattern in RE2's syntax: through the rewrite for Python's re (`fusegrad.onnx.re2`) it
matches what RE2 itself (google-re2) matches, where the two differ too (ASCII classes, POSIX classes, `$`, `\\z`,
`\\Q...\\E`), and a pattern RE2 rejects or that has no Python equivalent is an error naming the node."""
from __future__ import annotations

import numpy as np
import pytest

re2 = pytest.importorskip("re2")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper  # noqa: E402

from fusegrad.onnx import OnnxNodeError, OnnxRunner, OnnxUnsupportedError  # noqa: E402

STRINGS = ["", "abc", "ABC", "a1_b", "12", "١٢", "naïve", "a b", "a\tb", "a\n", "a\nb", "foo.bar", "x-y", "a.b+",
           "AB", "e\u00e9", "word word", "[x]", "a{,3}", "aaa", "a\\b", "$", "a$", "k\u212a"]
PATTERNS = [r"[a-z]+", r"\d+", r"\w+", r"\W+", r"\s", r"a\sb", r"\S+", r"\bword\b \bword\b", r"wo\Brd.*",
            r"[[:alpha:]]+", r"[[:alnum:]_]+", r"[[:upper:][:digit:]]+", r"[[:punct:]]+", r"[[:space:]a-z]+",
            r"a$", r"a$\n", r"(?m)a$\n", r"a\n?\z", r"\Qa.b+\E", r"\x{61}.c", r"(?i)abc", r"(?s)a.b", r"a.b",
            r"(?<name>a)(?P<other>b)c", r"a{,3}", r"a{2,3}", r"a*?b?", r"[]a]+", r"[^\d\s]+", r"[\d.]+", r"a|ab|abc",
            r"(?i:A)bc", r"\[x\]", r"a\\b", r"\$", r"(?i)k+", r"[a-c-]+", r"x[-]y",
            r"\141+", r"[\141-\143]+", r"\0?a", r"\12"]


def _model(pattern: str, name: str = "rx"):
    node = helper.make_node("RegexFullMatch", ["x"], ["m"], pattern=pattern, name=name)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.STRING, [len(STRINGS)])],
                          [helper.make_tensor_value_info("m", TP.BOOL, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_what_re2_matches(pattern):
    got = OnnxRunner(_model(pattern))({"x": np.array(STRINGS, dtype=object)})["m"].numpy()
    want = [re2.fullmatch(pattern, s) is not None for s in STRINGS]
    assert got.tolist() == want, [(s, g) for s, g, w in zip(STRINGS, got.tolist(), want) if g != w]


@pytest.mark.parametrize("pattern", [r"(?=a)a", r"(a)\1", r"(a)\8", r"(?P<n>a)(?P=n)", r"a*+", r"(?>a)", r"a\Z",
                                     r"\u0061", r"a{1001}", r"(?x)a", r"[a", r"(?#c)a"])
def test_patterns_re2_rejects_are_errors(pattern):
    with pytest.raises(Exception): re2.compile(pattern)   # noqa: B017 - (the reference: RE2 rejects it too)
    with pytest.raises(OnnxNodeError, match=r"'rx' \(RegexFullMatch\).*not a valid"):
        OnnxRunner(_model(pattern))({"x": np.array(STRINGS, dtype=object)})


@pytest.mark.parametrize("pattern,what", [(r"\p{Greek}+", r"Unicode class \\p"), (r"(?U)a+", "ungreedy flag"),
                                          (r"[[:^alpha:]]", "negated POSIX class"), (r"[\D]", r"\\D inside a class"),
                                          (r"\C", r"\\C")])
def test_re2_syntax_python_lacks_is_refused(pattern, what):
    re2.compile(pattern)   # (valid RE2)
    with pytest.raises(OnnxUnsupportedError, match=rf"'rx' \(RegexFullMatch\).*{what}"):
        OnnxRunner(_model(pattern))({"x": np.array(STRINGS, dtype=object)})
