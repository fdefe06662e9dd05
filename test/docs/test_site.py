"""The documentation site builds without a warning (`mkdocs build --strict`: a broken link or an API entry naming an
object that no longer exists fails), and every file, module and code name the pages mention exists."""
from __future__ import annotations
import builtins
import importlib
import pathlib
import re
import shutil
import subprocess
import sys
import pytest
from fusegrad.codegen.opt import OptOps
from fusegrad.uop.ops import Ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "DESIGN.md"]
MKDOCS = pathlib.Path(sys.executable).parent / "mkdocs"

@pytest.mark.skipif(not MKDOCS.exists() and shutil.which("mkdocs") is None,
                    reason="needs mkdocs: pip install -e '.[docs]' (the test extra has it)")
def test_site_builds_strict(tmp_path: pathlib.Path):
    cmd = [str(MKDOCS) if MKDOCS.exists() else "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WARNING" not in p.stderr, p.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()

def spans(page: pathlib.Path) -> list[str]:
    """The code spans of a page's text (fenced blocks left out)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)

def test_paths_exist():
    # every repository path a page names (fusegrad/..., examples/..., a bare module file name) is there
    files = {p.name for d in ("fusegrad", "examples", "bench", "test") for p in (ROOT / d).rglob("*.py")}
    missing = []
    for page in PAGES:
        for span in spans(page):
            for path in re.findall(r"(?:^|[\s(])((?:fusegrad|examples|bench|test|docs)/[\w/.]*)", " " + span):
                if not (ROOT / path.rstrip(".")).exists(): missing.append((page.name, path))
            if re.fullmatch(r"[\w]+\.py", span) and span not in files: missing.append((page.name, span))
            # a path relative to fusegrad/ (DESIGN.md's `schedule/replay.py`)
            if (m := re.fullmatch(r"((?:[a-z_]+/)+[\w]+\.py)(?: \w+)?", span)) and not m[1].startswith(
                    ("fusegrad/", "examples/", "bench/", "test/", "docs/")) and not (ROOT / "fusegrad" / m[1]).exists():
                missing.append((page.name, m[1]))
    assert not missing, f"paths that don't exist: {missing}"

def test_modules_import():
    # every dotted fusegrad name a page mentions imports (a module) or resolves (an attribute of one)
    bad = []
    for page in PAGES:
        for name in sorted({m for s in spans(page) for m in re.findall(r"\bfusegrad(?:\.\w+)+", s)}):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try: obj = importlib.import_module(".".join(parts[:i]))
                except ImportError: continue
                try:
                    for attr in parts[i:]: obj = getattr(obj, attr)
                except AttributeError: bad.append((page.name, name))
                break
            else: bad.append((page.name, name))
    assert not bad, f"names that don't resolve: {bad}"

def defined_names() -> set[str]:
    """Every function, class and module-level or class-level assignment target of the package, and the op names."""
    names = set(Ops.__members__) | set(OptOps.__members__)
    for path in (ROOT / "fusegrad").rglob("*.py"):
        src = path.read_text()
        names |= set(re.findall(r"^\s*(?:def|class)\s+(\w+)", src, flags=re.M))
        for lhs in re.findall(r"^\s*(\w+(?:\s*,\s*\w+)*)\s*(?::[^=\n]*)?=", src, flags=re.M):
            names |= {n.strip() for n in lhs.split(",")}
    return names

def test_architecture_names_exist():
    # the functions, classes and constants the architecture page names are still defined in the package (or are
    # Python's, or in the output the page shows: a kernel's name)
    page = ROOT / "docs" / "architecture.md"
    known, stale = defined_names() | set(dir(builtins)), []
    shown = "".join(re.findall(r"^```.*?^```", page.read_text(), flags=re.S | re.M))
    for span in spans(page):
        for name in re.findall(r"^([A-Za-z_][\w.]*)(?:\(\))?$", span):
            last = name.split(".")[-1]
            if "_" not in last and not re.search(r"[a-z][A-Z]|^[A-Z][a-z]+[A-Z]", last): continue  # a plain word
            if last not in known and last not in shown: stale.append(name)
    assert not stale, f"docs/architecture.md names what the package no longer defines: {stale}"
