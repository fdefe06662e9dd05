"""C source -> shared object bytes with the system C compiler (a batch of kernels per compiler process, the batches
in parallel), and shared object bytes -> a library loaded into the process."""
from __future__ import annotations
import _ctypes
import ctypes
import functools
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Any
from fusegrad.device import CompileError, Compiler, find_cc, numbered
from fusegrad.helpers import remove_stale
from fusegrad.hostcpu import fingerprint, host_cpu_count
from fusegrad.runtime.elf import ET_DYN, elf_is_whole

DEFAULT_FLAGS = ["-O2", "-march=native", "-fno-math-errno"]

@functools.cache
def _cc_version(cc: tuple[str, ...]) -> str:
    try: out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired): return "unknown"
    return out.splitlines()[0] if out else "unknown"

# what a compile (a folder) and a program load (a shared object, deleted once loaded) put in the temp folder
_STALE_TEMPS = re.compile(r"fusegrad-cc-(?:(\d+)-)?|fusegrad-(\d+)-\d+-.*\.so$")

@functools.cache
def _remove_stale_temps() -> None:
    """Once per process: remove what killed processes left in the temp folder (see remove_stale)."""
    remove_stale(tempfile.gettempdir(), _STALE_TEMPS)

BATCH_KERNELS = 24  # kernels per compiler process when a schedule has many new ones

def _kernel_name(src: str) -> str | None:
    """The name of the (last) exported function of a kernel's C source."""
    names = re.findall(r"^void (\w+)\(", src, flags=re.MULTILINE)
    return names[-1] if names else None

class CPUCompiler(Compiler):
    """C source -> shared object bytes, with the system C compiler. `flags` are the code generation flags (the
    renderer's `compile_flags` when it has them); the flags that make a shared object are always added."""
    parallel = True  # every compile is its own process
    def __init__(self, flags: list[str] | None = None):
        self.flags = list(DEFAULT_FLAGS if flags is None else flags)
        self.cc = find_cc()
        host = fingerprint() if any("native" in f for f in self.flags) else ""
        super().__init__(f"{self.cc}|{_cc_version(tuple(self.cc))}|{self.flags}|{host}")

    def compile(self, src: str) -> bytes:
        _remove_stale_temps()
        # (named with the pid: a folder a killed process left behind is told from a live one's, see remove_stale)
        with tempfile.TemporaryDirectory(prefix=f"fusegrad-cc-{os.getpid()}-") as d:
            out = os.path.join(d, "k.so")
            cmd = [*self.cc, *self.flags, "-shared", "-fPIC", "-x", "c", "-", "-o", out, "-lm"]
            try: res = subprocess.run(cmd, input=src.encode(), capture_output=True)
            except OSError as e: raise CompileError(f"can't run {shlex.join(cmd)}: {e}\n{numbered(src)}") from e
            if res.returncode != 0:
                raise CompileError(f"{shlex.join(cmd)} failed:\n{res.stderr.decode(errors='replace').strip()}\n"
                                   f"--- source ---\n{numbered(src)}")
            with open(out, "rb") as f: return f.read()

    def _compile_all(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        # starting the compiler costs more than compiling a small kernel, so kernels are compiled a batch at a time:
        # one translation unit (one shared object) per batch, the batches in parallel. Kernels with pragmas of their
        # own, and kernels named like one already in the batch, go to other batches.
        if len(srcs) < 2: return super()._compile_all(srcs)
        nbatches = units if units is not None else max(host_cpu_count(), -(-len(srcs) // BATCH_KERNELS))
        batches: list[list[int]] = [[] for _ in range(nbatches)]
        names: list[set[str]] = [set() for _ in range(nbatches)]
        for i, src in enumerate(srcs):
            name = _kernel_name(src)
            fits = [b for b in range(len(batches)) if name is not None and "#pragma" not in src and name not in names[b]
                    and all("#pragma" not in srcs[j] for j in batches[b])]
            if not fits: batches.append([i]); names.append({name or ""}); continue
            b = min(fits, key=lambda b: len(batches[b]))
            batches[b].append(i)
            names[b].add(name)  # type: ignore[arg-type]
        batches = [b for b in batches if b]
        units = ["\n".join(srcs[i] for i in b) for b in batches]
        try: libs = super()._compile_all(units)
        except CompileError:
            if all(len(b) == 1 for b in batches): raise
            return super()._compile_all(srcs)  # one by one, so the error names the kernel that failed
        out: list[bytes] = [b""] * len(srcs)
        for b, lib in zip(batches, libs):
            for i in b: out[i] = lib
        return out

    def validate(self, lib: bytes) -> bool:
        return elf_is_whole(lib, ET_DYN) if sys.platform.startswith("linux") else len(lib) > 0

_load_counter = itertools.count()

def load_library(lib: bytes) -> ctypes.CDLL:
    """The shared object `lib` loaded into the process."""
    # dlopen needs a file; the name must never repeat in this process (the loader reuses objects by name)
    fd, path = tempfile.mkstemp(prefix=f"fusegrad-{os.getpid()}-{next(_load_counter)}-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f: f.write(lib)
        return ctypes.CDLL(path)
    finally: os.unlink(path)

def unload_library(handle: int, dlclose: Any = _ctypes.dlclose, error: type = OSError) -> None:
    """dlclose a library `load_library` loaded. What it calls is bound as defaults, so it works as a finalizer at
    interpreter shutdown, after this module's globals are gone."""
    try: dlclose(handle)
    except error: pass
