"""Every ```python block of docs/*.md and README.md runs, and every output the docs show under a block is what that
block prints.

The blocks of one page run in order in one fresh interpreter (a page's examples build on each other), each compiled
under the page's name and its own line numbers, so a failure points at the Markdown. A block's printed output is shown
as the next fenced block after a `<!-- output -->` comment; one that depends on the host CPU (the C source, the
optimizer's choices) is marked `<!-- output on HOST -->` and compared only on a host with the same SIMD features.

After a deliberate change, `.venv/bin/python test/docs/test_snippets.py --update` rewrites the shown outputs (those of
other hosts stay as they are)."""
from __future__ import annotations
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
END = "\x00end of block\x00"
OUTPUT = re.compile(r"<!-- output(?: on (?P<host>[^>]+?))? -->")
# knobs a developer may have set that would change what the examples print or how they run
UNSET = ("DEBUG", "BEAM", "NOOPT", "JIT", "DEV", "CPU", "LLVM", "PYTHON", "CL", "CACHELEVEL", "TRANSCENDENTAL", "WINO")

# the driver: read the blocks from stdin, run each in one namespace, mark where each one's output ends
DRIVER = f"""
import json, sys
ns = {{"__name__": "__main__"}}
for page, line, code in json.load(sys.stdin):
    exec(compile("\\n" * line + code, page, "exec"), ns)
    print({END!r}, flush=True)
"""

@dataclass
class Block:
    line: int                        # the line of the code's first row (0-based)
    code: str
    shown: tuple[int, int] | None = None  # the lines of the output shown for it (the rows inside its fence)
    host: str | None = None          # the host an output shown for it was made on (None: any host)

def host_signature() -> str:
    """The machine and the SIMD features the C renderer's choices depend on (vector widths, FMA)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError: pass
    return " ".join([platform.machine()] + sorted(flags & {"avx", "avx2", "fma", "f16c", "avx512f", "avx512vl"}))

def parse(lines: list[str]) -> list[Block]:
    """The python blocks of a page, each with the output shown for it (the fenced block after an output marker)."""
    blocks: list[Block] = []
    i, marker = 0, None
    while i < len(lines):
        if (m := OUTPUT.fullmatch(lines[i].strip())): marker = m
        elif lines[i].startswith("```"):
            info, start = lines[i][3:].strip(), i + 1
            i = start
            while not lines[i].startswith("```"): i += 1
            if info == "python": blocks.append(Block(start, "\n".join(lines[start:i]) + "\n"))
            elif marker is not None:
                assert blocks, f"output shown before any python block (line {start})"
                blocks[-1].shown, blocks[-1].host = (start, i), marker["host"]
            marker = None
        elif lines[i].strip(): marker = None
        i += 1
    return blocks

def run_page(page: pathlib.Path, blocks: list[Block]) -> list[str]:
    """What each block printed, running them in order in a fresh interpreter from the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    # a plain interpreter is an MPI world of one; Open MPI wants this to start as root
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    todo = json.dumps([(str(page.relative_to(ROOT)), b.line, b.code) for b in blocks])
    p = subprocess.run([sys.executable, "-c", DRIVER], input=todo, capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)
    assert p.returncode == 0, f"{page.name}: a block failed\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    outs = p.stdout.split(END + "\n")
    assert len(outs) == len(blocks) + 1, p.stdout
    return outs[:-1]

def shown_text(lines: list[str], b: Block) -> str:
    assert b.shown is not None
    return "".join(ln + "\n" for ln in lines[b.shown[0]:b.shown[1]])

@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs_and_shows_its_output(page: pathlib.Path):
    lines = page.read_text().splitlines()
    blocks = parse(lines)
    if not blocks: pytest.skip("no python blocks")
    outs = run_page(page, blocks)
    for b, out in zip(blocks, outs):
        if b.shown is None or (b.host is not None and b.host != host_signature()): continue
        assert out == shown_text(lines, b), (
            f"{page.name}:{b.shown[0]}: the output shown differs from what the block at line {b.line} prints now "
            f"(update with: .venv/bin/python test/docs/test_snippets.py --update)\n--- prints now:\n{out}")

def test_output_markers_follow_a_python_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        marked = sum(1 for ln in lines if OUTPUT.fullmatch(ln.strip()))
        assert marked == sum(b.shown is not None for b in parse(lines)), f"{page.name}: an output marker shows nothing"

def update() -> None:
    """Rewrite every output shown in the docs with what its block prints now (on this host)."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        blocks = parse(lines)
        if not any(b.shown for b in blocks): continue
        outs = run_page(page, blocks)
        # from the end, so earlier line numbers stay valid
        for b, out in reversed(list(zip(blocks, outs))):
            if b.shown is None or (b.host is not None and b.host != host_signature()): continue
            lines[b.shown[0]:b.shown[1]] = out.splitlines()
        page.write_text("\n".join(lines) + "\n")
        print(f"updated {page.relative_to(ROOT)}")

if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]: sys.exit("usage: test_snippets.py --update")
    update()
