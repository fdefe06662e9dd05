"""helpers.py: environment knobs (getenv, ContextVar, Context), sequence helpers and terminal colors."""
import functools
import itertools
import math
import operator
import os
import uuid
import pytest
from fusegrad.helpers import DEBUG, Context, ContextVar, all_int, ansistrip, colored, dedup, flatten, getenv, prod

def fresh_key() -> str:
    # getenv is cached per key, so every test reads a key nothing has read before
    return f"FUSEGRAD_TEST_{uuid.uuid4().hex.upper()}"

class TestGetenv:
    def test_unset_gives_default(self):
        assert getenv(fresh_key()) == 0
        assert getenv(fresh_key(), 7) == 7 and getenv(fresh_key(), "abc") == "abc" and getenv(fresh_key(), 1.5) == 1.5

    def test_converts_to_type_of_default(self, monkeypatch):
        k1, k2, k3 = fresh_key(), fresh_key(), fresh_key()
        monkeypatch.setenv(k1, "3"); monkeypatch.setenv(k2, "0.25"); monkeypatch.setenv(k3, "hello")
        assert getenv(k1) == 3 and type(getenv(k1)) is int
        assert getenv(k2, 0.0) == 0.25
        assert getenv(k3, "") == "hello"

    def test_bool_default_parses_words(self, monkeypatch):
        for val, want in [("1", True), ("0", False), ("", False), ("false", False), ("False", False), ("no", False),
                          ("yes", True), ("2", True)]:
            k = fresh_key()
            monkeypatch.setenv(k, val)
            assert getenv(k, False) is want, val

    def test_cached(self, monkeypatch):
        k = fresh_key()
        monkeypatch.setenv(k, "5")
        assert getenv(k) == 5
        monkeypatch.setenv(k, "6")
        assert getenv(k) == 5  # read once, as documented

class TestContext:
    def test_overrides_and_restores(self):
        before = DEBUG.value
        with Context(DEBUG=before + 3):
            assert DEBUG.value == before + 3 and DEBUG >= before + 3 and int(DEBUG) == before + 3
        assert DEBUG.value == before

    def test_nesting(self):
        before = DEBUG.value
        with Context(DEBUG=4):
            with Context(DEBUG=6):
                assert DEBUG.value == 6
                with Context(DEBUG=1): assert DEBUG.value == 1
                assert DEBUG.value == 6
            assert DEBUG.value == 4
        assert DEBUG.value == before

    def test_several_knobs_and_new_ones(self):
        key = fresh_key()
        with Context(DEBUG=2, **{key: 9}):
            assert DEBUG.value == 2 and ContextVar.get(key).value == 9
        assert ContextVar.get(key).value == 0

    def test_restores_on_exception(self):
        before = DEBUG.value
        with pytest.raises(KeyError):
            with Context(DEBUG=5):
                raise KeyError("boom")
        assert DEBUG.value == before

    def test_decorator(self):
        before = DEBUG.value
        @Context(DEBUG=3)
        def f(): return DEBUG.value
        assert f() == 3 and DEBUG.value == before
        assert f() == 3 and DEBUG.value == before  # reusable

    def test_decorator_on_recursive_function(self):
        # the same Context object is entered again before it exits: each exit must restore its own entry's values
        before = DEBUG.value
        seen = []
        @Context(DEBUG=7)
        def f(n):
            seen.append(DEBUG.value)
            if n: f(n - 1)
            seen.append(DEBUG.value)
        f(3)
        assert seen == [7] * 8 and DEBUG.value == before

    def test_contextvar_comparisons(self):
        v = ContextVar.get(fresh_key(), 0)
        with Context(**{v.key: 2}):
            assert v > 1 and v >= 2 and v < 3 and v <= 2 and bool(v)
        assert not bool(v)
        with pytest.raises(RuntimeError): ContextVar(v.key, 0)  # a knob exists once

class TestSequences:
    @pytest.mark.parametrize("xs", [[], [5], [2, 3, 4], [1.5, -2], list(range(1, 12)), [0, 10**20]])
    def test_prod(self, xs):
        assert prod(xs) == math.prod(xs) == functools.reduce(operator.mul, xs, 1)

    def test_prod_of_generator_and_start(self):
        assert prod(x for x in (2, 3)) == 6 and prod([2, 3], start=10) == 60

    def test_prod_symbolic(self):
        from fusegrad.uop.ops import Variable
        n = Variable("n", 1, 8)
        p = prod([n, 4])
        assert int(p.substitute({n: n.const_like(3)})) == 12

    def test_dedup(self):
        assert dedup([3, 1, 3, 2, 1]) == [3, 1, 2]
        assert dedup([]) == [] and dedup("abca") == ["a", "b", "c"]
        xs = [7, 7, 5, 9, 5]
        assert dedup(xs) == sorted(set(xs), key=xs.index)

    def test_flatten(self):
        assert flatten([[1, 2], [], [3], (4, 5)]) == [1, 2, 3, 4, 5]
        nested = [[i] * i for i in range(5)]
        assert flatten(nested) == list(itertools.chain.from_iterable(nested))
        assert flatten([[[1]], [[2]]]) == [[1], [2]]  # one level only

    def test_all_int(self):
        assert all_int([1, 2, 3]) and all_int(()) and all_int([True])
        assert not all_int([1, 2.0]) and not all_int([1, "2"])
        from fusegrad.uop.ops import Variable
        assert not all_int([1, Variable("n", 1, 8)])

class TestColored:
    # ANSI SGR codes: 30-37 foreground, 40-47 background, +60 for the bright variants; 0 resets
    @pytest.mark.parametrize("name, code", [("black", 30), ("red", 31), ("green", 32), ("yellow", 33), ("blue", 34),
                                            ("magenta", 35), ("cyan", 36), ("white", 37)])
    def test_codes(self, name, code):
        assert colored("hi", name) == f"\x1b[{code}mhi\x1b[0m"
        assert colored("hi", name.upper()) == f"\x1b[{code + 60}mhi\x1b[0m"
        assert colored("hi", name, background=True) == f"\x1b[{code + 10}mhi\x1b[0m"

    def test_none_is_plain(self):
        assert colored("plain", None) == "plain"

    def test_strip(self):
        assert ansistrip(colored("a", "red") + "b" + colored("c", "BLUE", background=True)) == "abc"

    def test_unknown_color_raises(self):
        with pytest.raises(ValueError): colored("x", "purple")

def test_environment_is_not_leaked():
    # the tests above set variables only through monkeypatch
    assert not any(k.startswith("FUSEGRAD_TEST_") for k in os.environ)

class TestGarbageCollectorThreshold:
    """Importing fusegrad raises the collector's first threshold from CPython's default only (checked in fresh
    interpreters against the gc module itself)."""
    @staticmethod
    def thresholds_after_import(env: dict[str, str], before: str = "") -> tuple[int, ...]:
        import subprocess
        import sys
        code = f"import gc\n{before}\nimport fusegrad\nprint(*gc.get_threshold())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, **env}, timeout=120).stdout
        return tuple(int(v) for v in out.split())

    def test_default_threshold_is_raised(self):
        import gc
        default = self.thresholds_after_import({"GC_THRESHOLD": "0"})
        assert default[0] == 700 and default[1:] == gc.get_threshold()[1:]   # the interpreter's own default
        assert self.thresholds_after_import({}) == (5000,) + default[1:]
        assert self.thresholds_after_import({"GC_THRESHOLD": "3000"}) == (3000,) + default[1:]

    def test_a_threshold_the_program_set_is_kept(self):
        assert self.thresholds_after_import({}, "gc.set_threshold(100, 5, 5)") == (100, 5, 5)
        assert self.thresholds_after_import({"GC_THRESHOLD": "300"})[0] == 700   # (only ever raised)
