"""RegexFullMatch's patterns are RE2's syntax: `re2_to_python` rewrites one into a pattern of Python's `re` that
matches the same strings, and refuses what the two read differently where no rewrite is simple.

The two share literals, `.`, classes, alternation, groups (`(?:...)`, `(?P<name>...)`), greedy and lazy repetition
and the flags i, m and s. What differs:
- `\\d`, `\\w`, `\\s` and `\\b` are ASCII in RE2 and Unicode in Python: written as ASCII classes (and lookarounds for
  `\\b`, `\\B`). `\\D`, `\\W`, `\\S` inside a class are refused (a class can't hold a negated class).
- POSIX classes `[[:alpha:]]` (RE2 only) become their ASCII ranges; negated ones (`[[:^alpha:]]`) are refused.
- `\\z` (RE2's end of text) is Python's `\\Z`; `$` without the m flag is the end of the text in RE2, where Python's
  also matches before a final newline: written `\\Z` (with the m flag anywhere in the pattern, `$` is kept: both
  read it as the end of a line there). `\\Q...\\E` quotes literally; `\\x{...}` is a code point; `(?<name>...)` a
  named group.
- RE2 has no backreferences, lookaround, conditionals, atomic groups, possessive repetition, comments, the x flag,
  `\\Z` or Python's other escapes (`\\u`, `\\N`...): such a pattern is invalid (ValueError), as in RE2. Octal
  escapes (`\\0`, `\\141`) are their characters. Python has no Unicode classes (`\\p{Greek}`), no ungreedy flag (U)
  and no `\\C`: refused (Unsupported)."""
from __future__ import annotations

import re

from fusegrad.onnx.errors import Unsupported

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": "\\t\\n\\f\\r "}
_POSIX = {"alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\\x00-\\x7f", "blank": "\\t ", "cntrl": "\\x00-\\x1f\\x7f",
          "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~", "punct": "!-/:-@\\[-`{-~",
          "space": "\\t\\n\\v\\f\\r ", "upper": "A-Z", "word": "0-9A-Za-z_", "xdigit": "0-9A-Fa-f"}
_WORD = "[0-9A-Za-z_]"
_BOUNDARY = f"(?:(?<={_WORD})(?!{_WORD})|(?<!{_WORD})(?={_WORD}))"
_NOT_BOUNDARY = f"(?:(?<={_WORD})(?={_WORD})|(?<!{_WORD})(?!{_WORD}))"
_GROUP_INVALID = {"=": "lookahead", "!": "negative lookahead", "<=": "lookbehind", "<!": "negative lookbehind",
                  "P=": "backreferences", "(": "conditional groups", ">": "atomic groups", "#": "comment groups"}
_FLAGS = re.compile(r"([A-Za-z]*)(?:-([A-Za-z]*))?[:)]")
_COUNT = re.compile(r"\{\d+(?:,\d*)?\}")


def re2_to_python(pattern: str) -> str:
    """A Python `re` pattern matching the strings the RE2 pattern matches; ValueError for a pattern that isn't valid
    RE2, Unsupported for RE2 syntax that has no simple Python equivalent."""
    def refuse(what: str) -> None:
        raise Unsupported(f"pattern {pattern!r}: {what} is RE2 syntax that has no simple equivalent in Python's re, "
                          f"which runs the patterns")

    def invalid(what: str) -> None:
        raise ValueError(f"pattern {pattern!r} is not a valid RE2 pattern: {what}")

    multiline = any("m" in (m.group(1) or "") for m in re.finditer(r"\(\?([A-Za-z]*)[-:)]", pattern))
    out: list[str] = []
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 >= n: invalid("it ends with a backslash")
            e = pattern[i + 1]
            i += 2
            if e in _ASCII: out.append(_ASCII[e] if in_class else f"[{_ASCII[e]}]")
            elif e in "DWS":
                if in_class: refuse(f"\\{e} inside a class")
                out.append(f"[^{_ASCII[e.lower()]}]")
            elif e in "bB" and not in_class: out.append(_BOUNDARY if e == "b" else _NOT_BOUNDARY)
            elif e == "z" and not in_class: out.append("\\Z")
            elif e == "Q":
                end = pattern.find("\\E", i)
                text = pattern[i:] if end < 0 else pattern[i:end]
                out.append(re.escape(text))
                i = n if end < 0 else end + 2
            elif e == "E": pass   # (an \E without a \Q: RE2 ignores it)
            elif e == "x" and pattern.startswith("{", i):
                end = pattern.find("}", i)
                try: code = int(pattern[i + 1:end], 16) if end > i + 1 else -1
                except ValueError: code = -1
                if not 0 <= code <= 0x10FFFF: invalid(f"bad hexadecimal escape at {i - 2}")
                out.append(re.escape(chr(code)))
                i = end + 1
            elif e in "pP": refuse(f"the Unicode class \\{e}")
            elif e == "C": refuse("\\C (any byte)")
            elif e.isdigit():
                # (an octal code: \0 with up to two more octal digits, \1-\7 with one or two; a lone \1 would be a
                # backreference, which RE2 doesn't have)
                m = re.match(r"[0-7]{1,2}", pattern[i:]) if e in "01234567" else None
                if e != "0" and m is None: invalid(f"\\{e} (RE2 has no backreferences)")
                digits = e + (m.group() if m is not None else "")
                out.append(re.escape(chr(int(digits, 8))))
                i += len(digits) - 1
            elif e.isalpha() and (e not in "afnrtvxA" or in_class and e == "A"):
                invalid(f"the escape \\{e}" + (" inside a class" if in_class else ""))
            else: out.append("\\" + e)
            continue
        if in_class:
            if pattern.startswith("[:", i):
                end = pattern.find(":]", i + 2)
                name = pattern[i + 2:end] if end >= 0 else ""
                if name.startswith("^"): refuse(f"the negated POSIX class [:{name}:]")
                if name not in _POSIX: invalid(f"unknown POSIX class [:{name}:]")
                out.append(_POSIX[name])
                i = end + 2
                continue
            if c == "]": in_class = False
            # (Python warns of a set operation at these characters inside a class: RE2 reads them as themselves)
            out.append("\\" + c if c in "[&~|" or c == "-" and pattern.startswith("-", i + 1) else c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pattern.startswith("^", i): out.append("^"); i += 1
            if pattern.startswith("]", i): out.append("\\]"); i += 1   # (a leading ] is a member)
            continue
        if c == "(" and pattern.startswith("(?", i):
            rest = pattern[i + 2:]
            for start, what in _GROUP_INVALID.items():
                if rest.startswith(start): invalid(f"RE2 has no {what}")
            if rest.startswith("<") or rest.startswith("P<"):
                out.append("(?P<")
                i += 3 if rest.startswith("<") else 4
                continue
            m = _FLAGS.match(rest)
            if m is None: invalid(f"unknown group syntax at {i}")
            flags = (m.group(1) or "") + (m.group(2) or "")
            if "U" in flags: refuse("the ungreedy flag U")
            if bad := sorted(set(flags) - set("ims")): invalid(f"unknown flag {bad[0]!r}")
            out.append(pattern[i:i + 2 + m.end()])
            i += 2 + m.end()
            continue
        if c in "*+?" or c == "{" and _COUNT.match(pattern, i):
            end = i + 1 if c != "{" else _COUNT.match(pattern, i).end()  # type: ignore[union-attr]
            if c == "{":
                counts = [int(x) for x in pattern[i + 1:end - 1].split(",") if x]
                if any(k > 1000 for k in counts): invalid("a repetition count above 1000")
            if pattern.startswith("+", end): invalid("RE2 has no possessive repetition")
            out.append(pattern[i:end])
            i = end
            continue
        if c == "{" and re.match(r"\{,\d*\}", pattern[i:]): out.append("\\{")   # (a literal in RE2, {0,n} in Python)
        else: out.append("\\Z" if c == "$" and not multiline else c)
        i += 1
    if in_class: invalid("a class is not closed")
    return "".join(out)
