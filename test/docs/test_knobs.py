"""Every environment knob the package reads (getenv, os.getenv, ContextVar, a device name set to 1) is on
docs/knobs.md."""
from __future__ import annotations
import ast
import pathlib
import re
from fusegrad import Device

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "knobs.md"
# calls that read the environment variable named by their argument at `position`
READERS = {"getenv": 0, "ContextVar": 0, "get": 0, "_data_root": 1}

def _name(f: ast.expr) -> str | None:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None

def knobs_read() -> dict[str, str]:
    """Each knob named by a string literal in a reading call, with the file that reads it."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "fusegrad").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or (pos := READERS.get(_name(node.func) or "")) is None: continue
            if _name(node.func) == "get":
                # ContextVar.get("X") and os.environ.get("X"), not every .get of a dict
                owner = node.func.value if isinstance(node.func, ast.Attribute) else None
                if _name(owner) not in ("ContextVar", "environ"): continue
            if len(node.args) > pos and isinstance(arg := node.args[pos], ast.Constant) and isinstance(arg.value, str):
                found.setdefault(arg.value, str(path.relative_to(ROOT)))
    return found

def documented() -> set[str]:
    return set(re.findall(r"`([A-Z][A-Z0-9_]*)(?:=[^`]*)?`", PAGE.read_text()))

def test_the_scan_finds_the_knobs():
    # the scan itself works: knobs read in each way are found
    found = knobs_read()
    for knob in ("DEBUG", "BEAM_TIMEOUT_S", "LLVMOPT", "CHECK_OOB", "DEV", "CC", "MNIST_DIR", "XDG_CACHE_HOME"):
        assert knob in found, knob

def test_every_knob_read_is_documented():
    missing = {k: f for k, f in knobs_read().items() if k not in documented()}
    assert not missing, f"knobs read by the package but not on docs/knobs.md: {missing}"

def test_every_device_selector_is_documented():
    # Device picks the default device from NAME=1 for each device it knows (device.py _from_env)
    missing = [d for d in Device.available if d not in documented()]
    assert not missing, f"device selectors missing on docs/knobs.md: {missing}"

def test_every_documented_knob_is_read():
    # a knob removed from the package leaves the page too
    stale = documented() - set(knobs_read()) - set(Device.available)
    assert not stale, f"docs/knobs.md lists knobs the package doesn't read: {stale}"
