"""Small shared utilities: environment knobs (getenv, Context), sequence helpers and terminal colors."""
from __future__ import annotations
import contextlib
import functools
import gc
import operator
import os
import pathlib
import re
import shutil
import stat
import sys
import tempfile
import time
from typing import IO, Any, Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

def prod(x: Iterable[T], start: Any = 1) -> Any:
    """The product of `x` (works for ints and for symbolic UOps)."""
    return functools.reduce(operator.mul, x, start)

def dedup(x: Iterable[T]) -> list[T]:
    """The items of `x` in first-seen order, without repeats."""
    return list(dict.fromkeys(x))

def flatten(x: Iterable[Iterable[T]]) -> list[T]: return [item for sub in x for item in sub]
def argfix(*x: Any) -> tuple:
    """Accept f(1, 2), f((1, 2)) and f([1, 2]) alike."""
    if x and x[0].__class__ in (tuple, list):
        if len(x) != 1: raise ValueError(f"bad arg {x}")
        return tuple(x[0])
    return x
# The random generator's call counter reaches kernels as the uint64 constant (counter + 1) << 32 (added to the element
# index). The encoding is never 0 (an added 0 would fold away and change the graph), and it is recognisable, so the
# scheduler makes it a kernel parameter from the first call and a captured JIT can move it on at each replay.
def rng_counter_const(counter: int) -> int: return ((counter & 0xFFFFFFFF) + 1) << 32
def rng_counter_of(value: Any) -> int | None:
    """The counter encoded by rng_counter_const, or None if `value` isn't such a constant."""
    if not isinstance(value, int) or value < 1 << 32 or value & 0xFFFFFFFF or value >> 32 > 1 << 32: return None
    return (value >> 32) - 1

def all_int(t: Iterable[Any]) -> bool: return all(isinstance(s, int) for s in t)

# *** environment knobs ***

@functools.cache
def getenv(key: str, default: Any = 0) -> Any:
    """The environment variable `key` converted to the type of `default` (cached; Context overrides it).
    For a bool default, "", "0", "false" and "no" (any case) are False and anything else is True."""
    val = os.getenv(key)
    if val is None: return default
    # bool("0") would be True, so bools are parsed rather than converted
    if isinstance(default, bool): return val.strip().lower() not in ("", "0", "false", "no")
    return type(default)(val)

class ContextVar:
    """An environment knob whose value `Context` can override for the length of a with-block."""
    _cache: dict[str, ContextVar] = {}
    def __init__(self, key: str, default: Any):
        if key in ContextVar._cache: raise RuntimeError(f"ContextVar {key} already exists")
        self.key, self.value = key, getenv(key, default)
        # a knob that mirrors state kept elsewhere (TRAINING and Tensor.training) passes each value set on to it
        self.on_set: Callable[[Any], None] | None = None
        ContextVar._cache[key] = self
    def set(self, value: Any) -> None:
        self.value = value
        if self.on_set is not None: self.on_set(value)
    def __bool__(self) -> bool: return bool(self.value)
    def __ge__(self, x: Any) -> bool: return self.value >= x
    def __gt__(self, x: Any) -> bool: return self.value > x
    def __lt__(self, x: Any) -> bool: return self.value < x
    def __le__(self, x: Any) -> bool: return self.value <= x
    def __int__(self) -> int: return int(self.value)
    def __repr__(self) -> str: return f"{self.key}={self.value}"

    @classmethod
    def get(cls, key: str, default: Any = 0) -> ContextVar:
        return cls._cache[key] if key in cls._cache else ContextVar(key, default)

class Context(contextlib.ContextDecorator):
    """`with Context(DEBUG=2, NOOPT=1): ...` overrides knobs inside the block (and as a decorator)."""
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        # a stack, not one slot: a decorated function may re-enter itself (recursion) before the outer call exits
        self.saved: list[dict[str, Any]] = []
    def __enter__(self):
        self.saved.append({k: ContextVar.get(k).value for k in self.kwargs})
        for k, v in self.kwargs.items(): ContextVar.get(k).set(v)
        return self
    def __exit__(self, *args):
        for k, v in self.saved.pop().items(): ContextVar._cache[k].set(v)

DEBUG, SPEC, NOOPT, BEAM, JIT = ContextVar("DEBUG", 0), ContextVar("SPEC", 0), ContextVar("NOOPT", 0), \
    ContextVar("BEAM", 0), ContextVar("JIT", 1)
CACHELEVEL, CPU_THREADS = ContextVar("CACHELEVEL", 2), ContextVar("CPU_THREADS", 0)
# 0: EXP2/LOG2/SIN are left to the device's math library instead of codegen/transcendental.py's polynomials
TRANSCENDENTAL = ContextVar("TRANSCENDENTAL", 1)
# 0: float32 3x3 stride-1 convolutions are computed directly instead of by Winograd's F(4x4, 3x3) (tensor/nn.py)
WINO = ContextVar("WINO", 1)
# 0: convolutions on a GPU's tensor cores read their windows in place instead of copying them into a matrix (im2col)
IM2COL = ContextVar("IM2COL", 1)
# CPU kernels are queued and run while Python goes on (0: each kernel has run when its call returns)
CPU_ASYNC = ContextVar("CPU_ASYNC", 1)
# BEAM search (codegen/opt/search.py): seconds a search may take, timed runs per candidate, rounds, the bound on the
# product of upcast and unroll amounts, and how much faster than the heuristic a choice must time
BEAM_TIMEOUT_S, BEAM_RUNS, BEAM_ROUNDS = ContextVar("BEAM_TIMEOUT_S", 10.0), ContextVar("BEAM_RUNS", 3), \
    ContextVar("BEAM_ROUNDS", 5)
BEAM_MAX_LANES, BEAM_MIN_GAIN = ContextVar("BEAM_MAX_LANES", 1024), ContextVar("BEAM_MIN_GAIN", 0.05)
# tinygrad's name for training mode: `Context(TRAINING=1)` and `Tensor.train()` set the same state (Tensor.training)
TRAINING = ContextVar("TRAINING", 0)

# The garbage collector's first-generation threshold (objects allocated and still alive) while it is still CPython's
# default of 700. A training step keeps thousands of graph nodes, tensors and tuples alive until it ends, so at 700
# every step ran a collection that found nothing to free and moved the step's live objects into the older generations;
# those then set off a full collection of the process every few hundred steps (150 ms with torch loaded). At 5000 a
# step's objects are freed by their reference counts before any collection (DESIGN.md, "The garbage collector").
# 0 leaves the collector as it is; a threshold the program set itself is never changed.
GC_THRESHOLD = ContextVar("GC_THRESHOLD", 5000)

def tune_gc() -> None:
    """Raise the collector's first-generation threshold to GC_THRESHOLD when it is still CPython's default."""
    first, *older = gc.get_threshold()
    if first == 700 and GC_THRESHOLD.value > first: gc.set_threshold(GC_THRESHOLD.value, *older)

def pads_cheaply(size: int, multiple: int) -> bool:
    """Whether rounding `size` up to a multiple of `multiple` wastes at most an eighth of the padded size."""
    return -size % multiple * 8 <= size + -size % multiple

# *** terminal output ***

def colored(st: str, color: str | None, background: bool = False) -> str:
    """`st` wrapped in an ANSI color code (color names as in termcolor; None leaves it plain)."""
    if color is None: return st
    colors = ["black", "red", "green", "yellow", "blue", "magenta", "cyan", "white"]
    code = 10 * background + 60 * (color.upper() == color) + 30 + colors.index(color.lower())
    return f"\u001b[{code}m{st}\u001b[0m"

class Timing(contextlib.ContextDecorator):
    """`with Timing("step: "):` prints the block's wall time in ms on exit; `on_exit(ns)` may add a suffix."""
    def __init__(self, prefix: str = "", on_exit: Callable[[int], str] | None = None, enabled: bool = True):
        self.prefix, self.on_exit, self.enabled = prefix, on_exit, enabled
    def __enter__(self) -> Timing:
        self.st = time.perf_counter_ns()
        return self
    def __exit__(self, *exc: object) -> None:
        self.et = time.perf_counter_ns() - self.st
        suffix = self.on_exit(self.et) if self.on_exit else ""
        if self.enabled: print(f"{self.prefix}{self.et * 1e-6:6.2f} ms{suffix}")

class tqdm(Generic[T]):
    """A dependency-free progress bar on stderr with tqdm's common surface: iterate it, `update(n)`,
    `set_description(desc)`, `write(s)`, use it as a context manager. disable=None shows it only on a terminal."""
    def __init__(self, iterable: Iterable[T] | None = None, desc: str = "", disable: bool | None = False,
                 unit: str = "it", unit_scale: bool = False, total: int | None = None, rate: int = 100):
        self.iterable, self.unit, self.unit_scale, self.rate = iterable, unit, unit_scale, rate
        self.disable = not sys.stderr.isatty() if disable is None else disable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else 0)
        self.n, self.st, self.last = 0, time.perf_counter(), 0.0
        self.desc = ""
        self.set_description(desc)
    def __iter__(self) -> Iterator[T]:
        if self.iterable is None: raise TypeError("tqdm: nothing to iterate (made without an iterable)")
        for item in self.iterable:
            yield item
            self.update(1)
        self.update(0, close=True)
    def __enter__(self) -> tqdm[T]: return self
    def __exit__(self, *exc: object) -> None: self.update(0, close=True)
    def set_description(self, desc: str) -> None:
        self.desc = f"{desc}: " if desc else ""
        self._draw(force=True)
    def update(self, n: int = 0, close: bool = False) -> None:
        self.n += n
        self._draw(force=close)
        if close and not self.disable: print(file=sys.stderr)
    def write(self, s: str) -> None:
        if not self.disable: print("\r\033[K" + s, file=sys.stderr)
        self._draw(force=True)
    def _draw(self, force: bool) -> None:
        now = time.perf_counter()
        # redraw at most `rate` times a second: a bar over a fast loop must not cost more than the loop
        if self.disable or (not force and now - self.last < 1 / self.rate): return
        self.last = now
        elapsed = now - self.st
        speed = self.n / elapsed if elapsed > 0 else 0.0
        shown = f"{self.n / 1000:.1f}k" if self.unit_scale and self.n >= 1000 else str(self.n)
        frac = f"{100 * self.n / self.total:3.0f}%|{shown}/{self.total}" if self.total else shown
        print(f"\r\033[K{self.desc}{frac} [{elapsed:.1f}s, {speed:.2f} {self.unit}/s]", end="", file=sys.stderr)

class trange(tqdm[int]):
    """tqdm(range(*args))."""
    def __init__(self, *args: int, **kwargs: Any): super().__init__(range(*args), **kwargs)

# Markers a program drops into its timeline (tinygrad's profile_marker); kept in order with their time, so a
# profile or a test can read them back.
profile_markers: list[tuple[float, str, str]] = []

def profile_marker(name: str, color: str = "gray") -> None:
    """Record a named point in time (time.perf_counter(), name, color) in `profile_markers`."""
    profile_markers.append((time.perf_counter(), name, color))

def ansistrip(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)

def ansilen(s: str) -> int: return len(ansistrip(s))

# *** caches ***

def cache_dir() -> str:
    """Where the on-disk caches live ($XDG_CACHE_HOME/fusegrad or ~/.cache/fusegrad)."""
    base = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "fusegrad")

def fetch(url: str, name: str | os.PathLike | None = None, subdir: str | None = None, gunzip: bool = False,
          allow_caching: bool = not getenv("DISABLE_HTTP_CACHE")) -> pathlib.Path:
    """The local path of the file at `url`, downloaded once into the cache directory's downloads/ (under `subdir`,
    named `name` or by a hash of the URL) and found there afterwards; gunzip=True stores it decompressed. A `name`
    that is an absolute path is used as it is. allow_caching=False downloads it again (DISABLE_HTTP_CACHE=1 is the
    default for that). A failed download raises and leaves no file behind."""
    import gzip
    import hashlib
    import urllib.request
    if name is None: name = hashlib.sha256(url.encode()).hexdigest() + (".gunzip" if gunzip else "")
    path = pathlib.Path(name)
    if not path.is_absolute(): path = pathlib.Path(cache_dir()) / "downloads" / (subdir or "") / path
    if allow_caching and path.is_file(): return path
    with urllib.request.urlopen(url, timeout=60) as r, atomic_write(path) as f:
        src = gzip.GzipFile(fileobj=r) if gunzip else r
        while chunk := src.read(1 << 20): f.write(chunk)
    return path

# *** files several processes write ***

STALE_DEAD_S = 600.0      # a temporary file of a process that is gone, left this long, is removed
STALE_ANY_S = 86400.0     # and any of them after this long (its pid may have been reused)
# the temporary files of atomic_write: ".tmp-<pid>-<random>" (without a pid: older versions' BEAM cache writes)
STALE_WRITES = re.compile(r"\.tmp-(?:(\d+)-)?")

@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """`with atomic_write(path) as f:` writes `path` through a temporary file in its folder (made if missing) that
    replaces it when the block ends: readers see the old file or the whole new one, never a part, and a block that
    raises leaves no file behind. The temporary file is private to its owner (mkstemp's mode) and named with the pid,
    so in the cache directory the ones killed writers left are told from a live writer's and removed (remove_stale)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    # (a folder the user chose isn't swept: names like ours there may be theirs)
    if os.path.commonpath([folder, os.path.abspath(cache_dir())]) == os.path.abspath(cache_dir()):
        remove_stale(folder, STALE_WRITES)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".tmp-{os.getpid()}-")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f: yield f
        os.replace(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise

def _pid_alive(pid: int) -> bool:
    try: os.kill(pid, 0)
    except ProcessLookupError: return False
    except OSError: pass   # (another user's process: alive)
    return True

def remove_stale(directory: str, pattern: re.Pattern) -> None:
    """Remove the temporary files and folders in `directory` whose names match `pattern` (its group that matched:
    the pid of the process that made them, when the name has one) and that a killed process left: made by a process
    that no longer exists at least STALE_DEAD_S seconds ago, or made by anyone at least STALE_ANY_S seconds ago. A
    process still working in one (its pid alive) keeps it, whatever the others sharing the directory do."""
    try: entries = list(os.scandir(directory))
    except OSError: return
    now, me = time.time(), os.getpid()
    for entry in entries:
        if not (m := pattern.match(entry.name)): continue
        pid = next((int(g) for g in m.groups() if g), None)
        if pid == me: continue
        try: st = entry.stat(follow_symlinks=False)
        except OSError: continue
        if hasattr(os, "getuid") and st.st_uid != os.getuid(): continue   # (not ours to remove)
        age = now - st.st_mtime
        if age < STALE_ANY_S and (pid is None or age < STALE_DEAD_S or _pid_alive(pid)): continue
        remove_path(entry.path, st)

def remove_path(path: str, st: os.stat_result | None = None) -> None:
    """Remove a file, link, FIFO or (a real one, not a link to one) folder; quietly, as another process may have."""
    try:
        if st is None: st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode): shutil.rmtree(path, ignore_errors=True)
        else: os.unlink(path)
    except OSError: pass
