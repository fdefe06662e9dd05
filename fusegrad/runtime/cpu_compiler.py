"""C source -> shared object bytes with the system C compiler (a batch of kernels per compiler process, the batches
in parallel), and shared object bytes -> a library loaded into the process. New kernels can be compiled in two tiers
(TieredCompiler): quickly first, and optimized on a background thread, the optimized code then taking over."""
from __future__ import annotations
import _ctypes
import atexit
import ctypes
import functools
import itertools
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Any, Callable
from fusegrad.device import CompileError, Compiler, find_cc, numbered
from fusegrad.helpers import CACHELEVEL, DEBUG, remove_stale
from fusegrad.hostcpu import fingerprint, host_cpu_count
from fusegrad.runtime.elf import ET_DYN, elf_is_whole

DEFAULT_FLAGS = ["-O2", "-march=native", "-fno-math-errno"]

@functools.cache
def _cc_version_text(cc: tuple[str, ...]) -> str:
    """What `cc --version` prints ("" where it can't be run)."""
    try: return subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired): return ""

def _cc_version(cc: tuple[str, ...]) -> str:
    out = _cc_version_text(cc)
    return out.splitlines()[0] if out else "unknown"

# what a compile (a folder) and a program load (a shared object, deleted once loaded) put in the temp folder
_STALE_TEMPS = re.compile(r"fusegrad-cc-(?:(\d+)-)?|fusegrad-(\d+)-\d+-.*\.so$")

@functools.cache
def _remove_stale_temps() -> None:
    """Once per process: remove what killed processes left in the temp folder (see remove_stale)."""
    remove_stale(tempfile.gettempdir(), _STALE_TEMPS)

BATCH_KERNELS = 24  # kernels per compiler process when a schedule has many new ones

# How a translation unit of kernels is linked. The rendered kernels include no header: they call compiler builtins,
# which become at most a few libc and libm functions (memset, memcpy, sqrtf). The linker spends most of a small
# compile's link reading libc's and libm's symbol tables (gcc 12: 25-35 ms of CPU per compiler run with them, 7-9 ms
# without: a third of a run's fixed cost), so with GCC on Linux such a unit is linked without the C library and its
# start files (`-nostdlib`; libgcc, a static archive, stays for the arithmetic it may provide), its undefined
# symbols bound at load time to the libc and libm the interpreter has already loaded. Sources with an #include (the C
# pool, which uses pthreads) are linked as usual. The loader binds every symbol when a binary is loaded (ctypes
# loads with RTLD_NOW), so a missing one fails the load, it never crashes a kernel.
LEAN_LINK = ["-nostdlib", "-lgcc"]
FULL_LINK = ["-lm"]

@functools.cache
def _libm_loaded() -> bool:
    """Whether the process's global symbols include libc's and libm's (a lean-linked kernel is bound to those)."""
    try:
        process = ctypes.CDLL(None)
        return all(hasattr(process, name) for name in ("memset", "memcpy", "memmove", "sqrtf", "sqrt"))
    except OSError: return False

def lean_link_ok(cc: tuple[str, ...]) -> bool:
    """Whether units without an #include are linked without the C library (see LEAN_LINK): GCC on Linux, the
    process having libc and libm loaded, and LEAN_LINK not set to 0."""
    return os.getenv("LEAN_LINK", "1") != "0" and sys.platform.startswith("linux") and _is_gcc(cc) and _libm_loaded()

def link_flags(src: str, lean: bool) -> list[str]:
    """The link flags of the translation unit `src` for a compiler that links lean (`lean`) or not."""
    return LEAN_LINK if lean and "#include" not in src else FULL_LINK

def _kernel_name(src: str) -> str | None:
    """The name of the (last) exported function of a kernel's C source."""
    names = re.findall(r"^void (\w+)\(", src, flags=re.MULTILINE)
    return names[-1] if names else None

# the compiler processes of background compiles (each with the pid of the process that started it), ended when the
# interpreter exits: nobody waits for their binaries
_background_procs: dict[subprocess.Popen, int] = {}
_exiting = threading.Event()

@atexit.register
def _end_background_compiles() -> None:
    _exiting.set()
    for proc, owner in list(_background_procs.items()):
        if owner != os.getpid(): continue   # (a forked child's exit leaves its parent's compiles alone)
        # (the whole process group: the compiler driver's own children, cc1 and as, too)
        try: os.killpg(proc.pid, signal.SIGKILL)
        except OSError: pass

class CPUCompiler(Compiler):
    """C source -> shared object bytes, with the system C compiler. `flags` are the code generation flags (the
    renderer's `compile_flags` when it has them); the flags that make a shared object are always added. A
    `background` compiler runs its compiler processes at a low priority and ends them when the interpreter exits."""
    parallel = True  # every compile is its own process
    def __init__(self, flags: list[str] | None = None, background: bool = False):
        self.flags = list(DEFAULT_FLAGS if flags is None else flags)
        self.cc, self.background = find_cc(), background
        self.lean = lean_link_ok(tuple(self.cc))
        host = fingerprint() if any("native" in f for f in self.flags) else ""
        # (the link mode is part of the configuration: a lean-linked binary loads only where libm is loaded already)
        lean = "|lean" if self.lean else ""
        super().__init__(f"{self.cc}|{_cc_version(tuple(self.cc))}|{self.flags}|{host}{lean}")

    def compile(self, src: str) -> bytes:
        _remove_stale_temps()
        # (named with the pid: a folder a killed process left behind is told from a live one's, see remove_stale)
        with tempfile.TemporaryDirectory(prefix=f"fusegrad-cc-{os.getpid()}-") as d:
            out = os.path.join(d, "k.so")
            cmd = [*self.cc, *self.flags, "-shared", "-fPIC", "-x", "c", "-", "-o", out, *link_flags(src, self.lean)]
            nice = ["nice", "-n", "19"] if self.background and shutil.which("nice") else []
            try: proc = subprocess.Popen(nice + cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=self.background)
            except OSError as e: raise CompileError(f"can't run {shlex.join(cmd)}: {e}\n{numbered(src)}") from e
            if self.background: _background_procs[proc] = os.getpid()
            try: _, err = proc.communicate(src.encode())
            finally: _background_procs.pop(proc, None)
            if proc.returncode != 0:
                raise CompileError(f"{shlex.join(cmd)} failed:\n{err.decode(errors='replace').strip()}\n"
                                   f"--- source ---\n{numbered(src)}")
            with open(out, "rb") as f: return f.read()

    def lookup(self, src: str) -> bytes | None:
        """The binary of `src` from the memory or disk cache, or None (nothing is compiled)."""
        if self.cachekey is None: return None
        if (lib := self.mem_cache.get(key := self._key(src))) is not None: return lib
        if CACHELEVEL >= 1 and (lib := self._read(self.cache_path(src))) is not None:
            self.disk_hits += 1
            self.mem_cache[key] = lib
            while len(self.mem_cache) > self.MEM_CACHE_SIZE: self.mem_cache.popitem(last=False)
        return lib

    def _compile_all(self, srcs: list[str], units: int | None = None) -> list[bytes]:
        # starting the compiler costs more than compiling a small kernel, so kernels are compiled a batch at a time:
        # one translation unit (one shared object) per batch, the batches in parallel. Kernels with pragmas of their
        # own, and kernels named like one already in the batch, go to other batches. The batches run in parallel and
        # the caller waits for the longest, so they are balanced by their C's length (the compile time goes with it):
        # the longest source first, each to the batch with the least C so far.
        if len(srcs) < 2: return super()._compile_all(srcs)
        nbatches = units if units is not None else max(host_cpu_count(), -(-len(srcs) // BATCH_KERNELS))
        batches: list[list[int]] = [[] for _ in range(nbatches)]
        names: list[set[str]] = [set() for _ in range(nbatches)]
        sizes = [0] * nbatches
        for i in sorted(range(len(srcs)), key=lambda i: -len(srcs[i])):
            src, name = srcs[i], _kernel_name(srcs[i])
            fits = [b for b in range(len(batches)) if name is not None and "#pragma" not in src and name not in names[b]
                    and all("#pragma" not in srcs[j] for j in batches[b])]
            if not fits: batches.append([i]); names.append({name or ""}); sizes.append(len(src)); continue
            b = min(fits, key=lambda b: (sizes[b], len(batches[b])))
            batches[b].append(i)
            names[b].add(name)  # type: ignore[arg-type]
            sizes[b] += len(src)
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

# *** two tiers: a quick compile first, the optimized one in the background ***

# the quick tier's optimization level: a fraction of -O2's compile time (the 200-op graph's kernels: 0.17 s of gcc
# against 1.5 s), with code that is not far behind for the kernels of one call (ResNet-18's are vectorized by the
# renderer); -O1 compiles 1.6-2.6x slower than -Og (DESIGN.md, "Compile paths and the default")
QUICK_LEVEL = "-Og"

def quick_flags(flags: list[str]) -> list[str]:
    """`flags` at the quick tier's optimization level: the flags that fix what the code computes (-ffp-contract,
    -fwrapv, ...) stay, so both tiers give the same results; the vectorizer's are dropped."""
    out = [QUICK_LEVEL if re.fullmatch(r"-O[0-9sgz]?|-Ofast", f) else f for f in flags
           if not f.startswith("-fvect-cost-model")]
    return out if QUICK_LEVEL in out else [QUICK_LEVEL, *out]

# gcc's register allocator at the quick tier works on each function as one region rather than loop by loop: about a
# fifth to a third less compile time (the MLP step's 18 kernels at -Og 1.04-1.53 -> 0.89-1.19 s for three builds,
# ResNet-18's first call 3.3 -> 2.2-2.5 s of compiler CPU), the kernels' speed within the noise, and what they compute
# the same (it allocates registers, nothing else)
QUICK_GCC_FLAGS = ["-fira-region=one"]

def _is_gcc(cc: tuple[str, ...]) -> bool:
    """Whether the C compiler `cc` is GCC (clang, which answers to gcc's name on some systems, is not)."""
    out = _cc_version_text(cc)
    return "Free Software Foundation" in out and "clang" not in out.lower()

# a kernel's entry point as the C renderer writes it (renderer/cstyle.py _render_function)
_ENTRY = re.compile(r"^void (\w+)_entry\(void \*\*a, long core_lo, long core_hi\) \{ ", flags=re.MULTILINE)

def forwarding(src: str) -> str | None:
    """The quick tier's source of a kernel: each entry point calls the function in its `<name>_next` pointer once
    one is set there (the optimized code's entry), so whoever holds the quick entry's address (a launch graph of a
    TinyJit replay, a queued job) runs the optimized code from then on. None where the source has no entry point."""
    if not _ENTRY.search(src): return None
    def forward(m: re.Match) -> str:
        nxt = f"{m[1]}_next"
        return f"void (*{nxt})(void **, long, long);\n{m[0]}void (*next)(void **, long, long) = " \
               f"__atomic_load_n(&{nxt}, __ATOMIC_ACQUIRE); if (next) {{ next(a, core_lo, core_hi); return; }} "
    return _ENTRY.sub(forward, src)

# the pragma the C renderer puts before a kernel to keep gcc's loop vectorizer off it (renderer/cstyle.py prelude). A
# kernel with a pragma is compiled alone (it would apply to the kernels after it in a translation unit); at a level
# that doesn't run the loop vectorizer it changes nothing (-Og: the same machine code with and without it for each of
# the 91 kernels with it in bench/dump_kernels.py), so the quick tier drops it and batches those kernels too
_NO_LOOP_VECTORIZE = '#pragma GCC optimize("no-tree-loop-vectorize")\n'

def quick_source(src: str, flags: list[str]) -> str | None:
    """The quick tier's source of a kernel (compiled with `flags`): `forwarding` entry points, and without the pragma
    that keeps the loop vectorizer off where `flags` don't run it. None where the source has no entry point."""
    out = forwarding(src)
    if out is None or _NO_LOOP_VECTORIZE not in out: return out
    level = [f for f in flags if re.fullmatch(r"-O[0-9sgz]?|-Ofast", f)]
    vectorizes = any(f in ("-ftree-vectorize", "-ftree-loop-vectorize") for f in flags)
    return out.replace(_NO_LOOP_VECTORIZE, "") if level and level[-1] in ("-O0", "-Og", "-O1") and not vectorizes \
        else out

# (weak: a device's compiler lives as long as its device)
_tiered_compilers: weakref.WeakSet[TieredCompiler] = weakref.WeakSet()

class TieredCompiler:
    """Compiles new kernels in two tiers: `first` gives each source its optimized binary where a cache has it, else
    a quick one (`quick_flags`, `forwarding` entry points); `later` compiles the optimized binaries on a background
    thread (its compiler processes at a low priority, a batch at a time) and hands each to a callback, which puts it
    in place of the quick one. Both tiers give the same results: they differ only in optimization, and the flags
    that fix the arithmetic are the same."""
    def __init__(self, final: CPUCompiler):
        self.final = final
        self.quick = CPUCompiler(quick_flags(final.flags) + (QUICK_GCC_FLAGS if _is_gcc(tuple(final.cc)) else []))
        # (the same configuration as `final`, so the same cache entries: what it compiles a later process finds)
        self.background = CPUCompiler(final.flags, background=True)
        self._jobs: queue.Queue[tuple[list[str], list[Callable[[bytes], None]]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()   # (a forked child has no thread of its parent's: it starts its own)
        self._lock = threading.Lock()
        _tiered_compilers.add(self)

    def first(self, srcs: list[str], units: int | None = None) -> list[tuple[bytes, bool]]:
        """(binary, whether it is the optimized one) of each source, compiling those no cache has at the quick tier
        (`units`: as in Compiler.compile_cached_many)."""
        out: dict[str, tuple[bytes, bool]] = {}
        for src in dict.fromkeys(srcs):
            if (lib := self.final.lookup(src)) is not None: out[src] = (lib, True)
        todo = {src: quick_source(src, self.quick.flags) for src in dict.fromkeys(srcs) if src not in out}
        quick = [src for src, fwd in todo.items() if fwd is not None]
        for src, lib in zip(quick, self.quick.compile_cached_many([todo[src] for src in quick], units)):  # type: ignore
            out[src] = (lib, False)
        final = [src for src, fwd in todo.items() if fwd is None]
        for src, lib in zip(final, self.final.compile_cached_many(final, units)): out[src] = (lib, True)
        return [out[src] for src in srcs]

    def later(self, srcs: list[str], done: list[Callable[[bytes], None]]) -> None:
        """Compile `srcs` with the optimized flags in the background; `done[i](binary)` is called on the background
        thread once srcs[i] is compiled. A source that fails to compile keeps its quick binary."""
        if not srcs: return
        with self._lock:
            if self._pid != os.getpid(): self._jobs, self._thread, self._pid = queue.Queue(), None, os.getpid()
            self._jobs.put((srcs, done))
            if self._thread is None:
                # (a daemon: the interpreter's exit doesn't wait for binaries nobody will run)
                self._thread = threading.Thread(target=self._work, name="fusegrad-compile", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Wait until every background compile asked for so far has been handed to its callback."""
        self._jobs.join()

    @staticmethod
    def wait_all() -> None:
        """`wait` of every TieredCompiler of the process."""
        for tiered in list(_tiered_compilers): tiered.wait()

    def _work(self) -> None:
        jobs = self._jobs
        while not _exiting.is_set():
            srcs, done = jobs.get()
            try:
                for i in range(0, len(srcs), BATCH_KERNELS):
                    if _exiting.is_set(): break
                    self._compile(srcs[i:i + BATCH_KERNELS], done[i:i + BATCH_KERNELS])
            except Exception as e:  # (e.g. no room for the temp files: the kernels keep their quick binaries)
                if DEBUG >= 1: print(f"background compile failed: {type(e).__name__}: {e}")
            finally: jobs.task_done()

    def _compile(self, srcs: list[str], done: list[Callable[[bytes], None]]) -> None:
        try: libs: list[bytes | None] = list(self.background.compile_cached_many(srcs, 1))
        except CompileError:
            libs = []
            for src in srcs:  # one by one: the others still get their optimized binary
                try: libs.append(self.background.compile_cached(src))
                except CompileError as e:
                    if DEBUG >= 1: print(f"background compile failed, the quick binary stays: {e}")
                    libs.append(None)
        for lib, fn in zip(libs, done):
            if lib is None: continue
            try: fn(lib)
            except Exception as e:  # (a callback's failure leaves that kernel on its quick binary)
                if DEBUG >= 1: print(f"the optimized binary could not take over: {type(e).__name__}: {e}")

_load_counter = itertools.count()

def load_library(lib: bytes, cls: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL:
    """The shared object `lib` loaded into the process (as a `cls`)."""
    # dlopen needs a file; the name must never repeat in this process (the loader reuses objects by name)
    fd, path = tempfile.mkstemp(prefix=f"fusegrad-{os.getpid()}-{next(_load_counter)}-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f: f.write(lib)
        return cls(path)
    finally: os.unlink(path)

def unload_library(handle: int, dlclose: Any = _ctypes.dlclose, error: type = OSError) -> None:
    """dlclose a library `load_library` loaded. What it calls is bound as defaults, so it works as a finalizer at
    interpreter shutdown, after this module's globals are gone."""
    try: dlclose(handle)
    except error: pass
