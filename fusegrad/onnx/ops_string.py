"""String tensors and the ops on them: StringNormalizer, StringConcat, StringSplit, RegexFullMatch, Equal of strings,
Cast and CastLike to and from STRING, and ai.onnx.ml's LabelEncoder (which maps numbers to numbers on the device).

fusegrad has no string dtype: a string tensor is a NumPy array of Python strings (dtype object) that stays on the
host, and these ops run there. Their numeric results (RegexFullMatch's, StringSplit's counts, LabelEncoder's values)
become Tensors. Inside a TinyJit capture nothing runs on the host on a replay, so these ops refuse to run there."""
from __future__ import annotations

import math
import re
from typing import Any, Sequence

import ml_dtypes
import numpy as np

import fusegrad.engine.realize as _realize
from fusegrad import Tensor, dtypes
from fusegrad.onnx import narrow
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.re2 import re2_to_python
from fusegrad.onnx.onnx_dtypes import ONNX_DTYPES
from fusegrad.onnx.ops import OPS, host_value, op, with_host

ML = "ai.onnx.ml"
# the ops that take string tensors (NumPy arrays of str); any other op refuses them
STRING_OPS = frozenset({("", "StringNormalizer"), ("", "StringConcat"), ("", "StringSplit"), ("", "RegexFullMatch"),
                        ("", "Equal"), ("", "Identity"), ("", "Cast"), ("", "CastLike"), (ML, "LabelEncoder")})
STRING = narrow.TP.STRING


def is_strings(v: Any) -> bool:
    """Whether a value is a string tensor (a NumPy array of str objects)."""
    return isinstance(v, np.ndarray) and v.dtype == object


def strings(arr: Any, what: str) -> np.ndarray:
    """An array of strings as a NumPy object array, checked to hold only str."""
    a = np.asarray(arr)
    if a.dtype.kind == "U": return a.astype(object)
    if a.dtype != object or not all(isinstance(s, str) for s in a.reshape(-1)):
        raise ValueError(f"{what} must be an array of str, got {a.dtype}")
    return a


def _on_host(op_type: str) -> None:
    if _realize.capturing:
        raise Unsupported(f"{op_type} on string tensors runs on the host, which a TinyJit capture can't replay: call "
                          f"the runner itself (string tensors can't live on the device)")


def _tensor(arr: np.ndarray) -> Tensor:
    """A numeric host result as a realized Tensor (its host copy kept)."""
    return with_host(Tensor(np.require(arr, requirements="C")).realize(), arr)


def _need_strings(v: Any, op_type: str, what: str) -> np.ndarray:
    if not is_strings(v): raise Unsupported(f"{op_type}'s {what} must be a string tensor")
    return v


@op("StringNormalizer")
def string_normalizer(x: Any, *, case_change_action: str = "NONE", is_case_sensitive: int = 0, locale: str = "",
                      stopwords: Sequence[str] = ()) -> np.ndarray:
    """Drops the elements that are stop words (compared ignoring case unless is_case_sensitive), then changes the
    case of the rest, character by character in `locale` as onnxruntime's C++ locale does (`_case_map`). An input of
    [C] or [1, C]; all dropped gives [""] (shape [1] or [1, 1])."""
    _on_host("StringNormalizer")
    x = _need_strings(x, "StringNormalizer", "input")
    if x.ndim not in (1, 2) or x.ndim == 2 and x.shape[0] != 1:
        raise ValueError(f"the input must be [C] or [1, C], got shape {x.shape}")
    if case_change_action not in ("NONE", "LOWER", "UPPER"):
        raise ValueError(f"case_change_action must be NONE, LOWER or UPPER, got {case_change_action!r}")
    lower, upper = _case_map(locale, False), _case_map(locale, True)
    if is_case_sensitive: stops = set(stopwords)
    else: stops = {lower(w) for w in stopwords}
    kept = [s for s in x.reshape(-1) if (s if is_case_sensitive else lower(s)) not in stops]
    if case_change_action == "LOWER": kept = [lower(s) for s in kept]
    elif case_change_action == "UPPER": kept = [upper(s) for s in kept]
    out = np.array(kept or [""], dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


_LOCALE = re.compile(r"[A-Za-z]{2,3}(?:[_-][A-Za-z0-9]{2,4})?(?:\.[A-Za-z0-9_-]+)?(?:@[A-Za-z0-9_]+)?")
# Turkish and Azeri case the dotted and dotless i apart
_TURKIC_UPPER = str.maketrans({"i": "\u0130", "\u0131": "I"})
_TURKIC_LOWER = str.maketrans({"I": "\u0131", "\u0130": "i"})
_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _case_map(locale: str, upper: bool) -> Any:
    """A string's case changed one character at a time, as C++'s ctype facet of `locale` does (onnxruntime's kernel;
    "" is its default, en_US.UTF-8): Unicode's simple mapping, where a character whose mapping is several characters
    (ß, ligatures) keeps its case and İ lowers to i; Turkish and Azeri locales (tr, az) map i to İ and I to ı; the C and
    POSIX locales change ASCII letters only. Another name that is no locale name is an error."""
    name = locale.strip()
    if name in ("C", "POSIX"):
        table = _ASCII_UPPER if upper else _ASCII_LOWER
        return lambda s: s.translate(table)
    if name and not _LOCALE.fullmatch(name):
        raise ValueError(f"locale {locale!r} is no locale name (such as en_US, tr_TR.UTF-8, C)")
    turkic = name[:2].lower() in ("tr", "az") and (len(name) == 2 or not name[2].isalpha())
    special = _TURKIC_UPPER if upper and turkic else _TURKIC_LOWER if turkic else None

    def one(c: str) -> str:
        m = c.upper() if upper else c.lower()
        return m if len(m) == 1 else "i" if c == "\u0130" else c

    def change(s: str) -> str:
        if special is not None: s = s.translate(special)
        if s.isascii(): return s.upper() if upper else s.lower()
        return "".join(map(one, s))
    return change


@op("StringConcat")
def string_concat(a: Any, b: Any) -> np.ndarray:
    _on_host("StringConcat")
    a, b = _need_strings(a, "StringConcat", "first input"), _need_strings(b, "StringConcat", "second input")
    x, y = np.broadcast_arrays(a, b)
    return np.array([p + q for p, q in zip(x.reshape(-1), y.reshape(-1))], dtype=object).reshape(x.shape)


@op("StringSplit")
def string_split(x: Any, *, delimiter: str = "", maxsplit: int | None = None) -> tuple[np.ndarray, Tensor]:
    """Each string split at `delimiter` (runs of whitespace where it is empty or absent, leading and trailing ones
    ignored), at most `maxsplit` times; the pieces padded with "" to the most any string gave, and their counts."""
    _on_host("StringSplit")
    x = _need_strings(x, "StringSplit", "input")
    if maxsplit is not None and maxsplit < 0: raise ValueError(f"maxsplit must be >= 0, got {maxsplit}")
    limit = -1 if maxsplit is None else maxsplit
    parts = [s.split(delimiter or None, limit) for s in x.reshape(-1)]
    width = max((len(p) for p in parts), default=0)
    out = np.array([p + [""] * (width - len(p)) for p in parts], dtype=object).reshape(x.shape + (width,)) \
        if parts else np.empty(x.shape + (0,), dtype=object)
    return out, _tensor(np.array([len(p) for p in parts], np.int64).reshape(x.shape))


@op("RegexFullMatch")
def regex_full_match(x: Any, *, pattern: str) -> Tensor:
    """Whether each string matches `pattern`, in RE2's syntax, as a whole: the pattern is rewritten for Python's re
    (`re2.re2_to_python`, which refuses what the two read differently)."""
    _on_host("RegexFullMatch")
    x = _need_strings(x, "RegexFullMatch", "input")
    try: rx = re.compile(re2_to_python(pattern))
    except re.error as e: raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from None
    return _tensor(np.array([rx.fullmatch(s) is not None for s in x.reshape(-1)], bool).reshape(x.shape))


def equal_strings(a: Any, b: Any) -> Tensor:
    """Equal of two string tensors (the Equal op calls this for strings)."""
    _on_host("Equal")
    if not (is_strings(a) and is_strings(b)): raise Unsupported("Equal of a string tensor and a numeric one")
    x, y = np.broadcast_arrays(a, b)
    return _tensor(np.array([p == q for p, q in zip(x.reshape(-1), y.reshape(-1))], bool).reshape(x.shape))


@op("LabelEncoder", domain=ML)
def label_encoder(x: Any, *, keys_strings: Sequence[str] | None = None, keys_int64s: Sequence[int] | None = None,
                  keys_floats: Sequence[float] | None = None, keys_tensor: Tensor | None = None,
                  values_strings: Sequence[str] | None = None, values_int64s: Sequence[int] | None = None,
                  values_floats: Sequence[float] | None = None, values_tensor: Tensor | None = None,
                  default_string: str = "_Unused", default_int64: int = -1, default_float: float = -0.0,
                  default_tensor: Tensor | None = None) -> Any:
    """Maps each value to the value of the equal key (the default where none is equal). Numbers to numbers run on the
    device (a select per key, up to DEVICE_KEYS keys); strings, in or out, on the host."""
    given_keys = [k for k in (keys_strings, keys_int64s, keys_floats, keys_tensor) if k is not None]
    given_vals = [v for v in (values_strings, values_int64s, values_floats, values_tensor) if v is not None]
    if len(given_keys) != 1 or len(given_vals) != 1:
        raise ValueError("LabelEncoder needs exactly one keys_* and one values_* attribute")
    keys = _attr_list(given_keys[0])
    vals = _attr_list(given_vals[0])
    if len(keys) != len(vals): raise ValueError(f"{len(keys)} keys but {len(vals)} values")
    if values_strings is not None: default: Any = default_string
    elif values_int64s is not None: default = default_int64
    elif values_floats is not None: default = default_float
    else: default = _attr_list(default_tensor)[0] if default_tensor is not None else _tensor_default(values_tensor)
    string_out = values_strings is not None or values_tensor is not None and is_strings(values_tensor)
    if not is_strings(x) and not string_out and len(keys) <= DEVICE_KEYS:
        return _encode_on_device(x, keys, vals, default, values_int64s, values_floats, values_tensor)
    _on_host("LabelEncoder")
    xs = x if is_strings(x) else host_value(x)
    table = dict(zip(keys, vals))
    # a NaN key matches every NaN (NaN equals nothing in the dict); the last one wins, as for the other keys
    nan_val = next((v for k, v in reversed(list(zip(keys, vals))) if isinstance(k, float) and k != k), default)

    def look(v: Any) -> Any:
        v = v.item() if isinstance(v, np.generic) else v
        return nan_val if isinstance(v, float) and v != v else table.get(v, default)
    out = [look(v) for v in np.asarray(xs).reshape(-1)]
    shape = np.asarray(xs).shape
    if string_out: return np.array(out, dtype=object).reshape(shape)
    if values_int64s is not None: return _tensor(np.array(out, np.int64).reshape(shape))
    if values_floats is not None: return _tensor(np.array(out, np.float32).reshape(shape))
    arr = np.array(out, dtype=np.asarray(host_value(values_tensor)).dtype).reshape(shape)  # type: ignore[arg-type]
    return _tensor(arr)


# the most keys a LabelEncoder of numbers maps on the device (one select each)
DEVICE_KEYS = 64


def _encode_on_device(x: Tensor, keys: list[Any], vals: list[Any], default: Any, values_int64s: Any,
                      values_floats: Any, values_tensor: Any) -> Tensor:
    dt = dtypes.int64 if values_int64s is not None else dtypes.float32 if values_floats is not None else \
        values_tensor.dtype
    out = Tensor.full(x.shape, default, dtype=dt)
    # the last equal key wins, as in the host's table: each key's select wraps the ones before it
    for k, v in zip(keys, vals):
        hit = x.isnan() if isinstance(k, float) and k != k else x == k
        out = hit.where(Tensor(v, dtype=dt), out)
    return out


def _attr_list(v: Any) -> list[Any]:
    """An attribute's values as a list of Python values (a string tensor attribute is a NumPy array already)."""
    if isinstance(v, np.ndarray): return [s for s in v.reshape(-1)]
    if isinstance(v, Tensor): return host_value(v).reshape(-1).tolist()
    return list(v)



def _tensor_default(values: Any) -> Any:
    """LabelEncoder's default for values given as a tensor without default_tensor: "_Unused", -1 or -0.0."""
    if is_strings(values): return "_Unused"
    return -1 if dtypes.is_int(values.dtype) else -0.0


# *** Cast and CastLike with STRING ***

# ops.py's Cast and CastLike, which these wrap (numbers to numbers stay theirs)
_NUMERIC_CAST, _NUMERIC_CAST_LIKE = OPS[("", "Cast")].fn, OPS[("", "CastLike")].fn
_ONNX_TYPE_OF = {dt: t for t, dt in ONNX_DTYPES.items()}


@op("Cast")
def cast(x: Any, *, to: int, saturate: int = 1, round_mode: str = "up", ctx: Any = None) -> Any:
    """Cast, with STRING as the input's or the output's type (on the host). Numbers are written as the runner's
    `cast_strings` says: "onnx" (the reference's text) or "onnxruntime" (its text)."""
    if is_strings(x) or to == STRING:
        _on_host("Cast to or from STRING")
        if is_strings(x): return _from_strings(x, to, saturate, round_mode)
        return _to_strings(x, getattr(ctx.runner, "cast_strings", "onnx") if ctx is not None else "onnx")
    return _NUMERIC_CAST(x, to=to, saturate=saturate, round_mode=round_mode)


@op("CastLike")
def cast_like(x: Any, like: Any, *, saturate: int = 1, round_mode: str = "up", ctx: Any = None) -> Any:
    if not is_strings(x) and not is_strings(like):
        return _NUMERIC_CAST_LIKE(x, like, saturate=saturate, round_mode=round_mode)
    to = STRING if is_strings(like) else narrow.narrow_type(like) or _ONNX_TYPE_OF[like.dtype]
    return cast(x, to=to, saturate=saturate, round_mode=round_mode, ctx=ctx)


CAST_STRINGS = ("onnx", "onnxruntime")


def _to_strings(x: Tensor, style: str = "onnx") -> np.ndarray:
    """Numbers as strings. "onnx": the way onnx's reference writes them (NumPy's str of each value in its own type: the
    shortest text that reads back as the same value, "inf", "nan", "True"), ml_dtypes' types (bfloat16, the 8-, 6-, 4-
    and 2-bit ones) by their own str. "onnxruntime": as its CPU kernel does, floats of every width as printf's "%.8g"
    of the value ("0.1", "9.9999997e-06", "3", "-0", "1e+20"; float64 too, so rounded to 8 digits) with "INF", "-INF"
    and "NaN", integers in decimal, bools as "1" and "0"."""
    if x.dtype == dtypes.bfloat16: arr = np.asarray(host_value(x)).astype(ml_dtypes.bfloat16)
    elif isinstance(x, narrow.NarrowTensor): arr = x.numpy()
    else: arr = np.asarray(host_value(x))
    if style == "onnxruntime":
        if arr.dtype == np.bool_: return np.where(arr, "1", "0").astype(object)
        if arr.dtype.kind in "iu": return arr.astype(np.str_).astype(object)
        return np.array([_ort_float(float(v)) for v in arr.reshape(-1)], dtype=object).reshape(arr.shape)
    # (ml_dtypes' types are NumPy's kind "V", which NumPy can't write as str)
    if arr.dtype.kind != "V": return arr.astype(np.str_).astype(object)
    return np.array([str(v) for v in arr.reshape(-1)], dtype=object).reshape(arr.shape)


def _ort_float(v: float) -> str:
    if v != v: return "NaN"
    if v in (math.inf, -math.inf): return "INF" if v > 0 else "-INF"
    return "%.8g" % v


_HEX_FLOAT = re.compile(r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?[0-9]+)?")


def _number(s: str, integer: bool) -> Any:
    """The number a string writes: plain or scientific decimals, "INF", "+INF", "-INF" and "NaN" in any case (and
    Python's "infinity"); for an integer type an integer literal exactly, else a decimal truncated toward zero (the
    spec leaves that undefined; onnxruntime truncates). For a float type also C's hexadecimal floats ("0x10",
    "0x1.8p3"), which onnxruntime reads (with strtod); for an integer type they are an error (onnxruntime reads the
    "0" before the "x", and onnx's reference refuses them)."""
    t = s.strip()
    if integer:
        try: return int(t)
        except ValueError: pass
    if _HEX_FLOAT.fullmatch(t):
        if integer: raise ValueError(f"Cast from STRING: {s!r} is a hexadecimal literal, read for float types only")
        return float.fromhex(t)
    try:
        if "_" in t: raise ValueError
        v = float(t)
    except ValueError:
        raise ValueError(f"Cast from STRING: {s!r} is not a number") from None
    if not integer: return v
    if v != v or v in (float("inf"), float("-inf")): raise ValueError(f"Cast from STRING: {s!r} to an integer type")
    return int(v)


def _from_strings(x: np.ndarray, to: int, saturate: int, round_mode: str) -> Any:
    """Strings read as numbers, then cast to the type as a number would be (integers keep their low bits when out of
    range, floats round to nearest even, bool is "nonzero")."""
    if to == STRING: return x.copy()
    n = narrow.NARROW.get(to)
    integer = isinstance(n.fmt, tuple) if n is not None else \
        to in ONNX_DTYPES and dtypes.is_int(ONNX_DTYPES[to]) and ONNX_DTYPES[to] != dtypes.bool
    vals = [_number(s, integer) for s in x.reshape(-1)]
    if integer:
        # (two's complement in 64 bits; the cast keeps the target's low bits)
        arr = np.array([(v + (1 << 63)) % (1 << 64) - (1 << 63) for v in vals], np.int64).reshape(x.shape)
    else: arr = np.array(vals, np.float64).reshape(x.shape)
    return _NUMERIC_CAST(_tensor(arr), to=to, saturate=saturate, round_mode=round_mode)
