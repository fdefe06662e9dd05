"""BEAM search: a kernel's Opts chosen by timing candidates on the device (`BEAM=n`), remembered on disk.

`beam_search(ast, device, amt, runner)` starts from the unoptimized kernel (the reference), the heuristic's choice and
variants of it (one of its opts left out, or given another amount that fits its loop). Each round, every kernel of the
beam (the `amt` fastest so far) is extended by every action `candidate_actions` lists for it. The new candidates of a
round are rendered, deduplicated (by optimized AST and by source), compiled in one batched compiler call and timed on
scratch buffers: the least of `BEAM_RUNS` runs, more (up to 10x, about 20 ms) for short kernels; a candidate over 3x
slower than the best stops being timed. A candidate's first run is on fresh contents and its outputs must match the
reference's within float tolerance, or it is rejected. The search stops when a round improves the best time by less
than 1%, after `BEAM_ROUNDS` rounds, or at `BEAM_TIMEOUT_S` (as many candidates are rendered as the compile time
measured so far lets finish in time). The best kernel replaces the heuristic's only if it is `BEAM_MIN_GAIN` faster in
both the least and the median time of a final interleaved timing of the two (about 0.3 s), so BEAM is not worse than
the default beyond timing noise.

`beam_opts(ast, device, amt, runner, knobs)` is what the engine calls before generating a kernel's code: the opts from
the disk cache (`cache_dir()/beam/..`, keyed by the kernel AST, the code generator's sources, device, machine,
compiler, threads, the codegen `knobs` and `amt`; `CACHELEVEL=0` turns it off), else from a search, whose result it
stores. An entry that doesn't parse, belongs to another key or whose opts don't apply is ignored (and replaced).
`beam_stats` counts searches, cache hits and candidates, for tests and benchmarks; `beam_rejections` says why the
latest rejected candidates were (the first element that differs, and whether a second run differs too).

Candidates are compiled with the device's compiler and run the way the engine runs kernels: `runner(program,
precompiled=binary)` (the engine's CompiledRunner) makes a callable `run(buffers, var_vals, wait=True)` that returns
the seconds a call took, split across as many threads as a real call."""
from __future__ import annotations
import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import platform
import random
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence
from fusegrad.codegen import get_program, optimize
from fusegrad.uop.affine import range_size
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.codegen.opt.tc import tc_candidates, tc_fits, tc_loops
from fusegrad.device import Buffer, CompileError, Device
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import BEAM_MAX_LANES, BEAM_MIN_GAIN, BEAM_ROUNDS, BEAM_RUNS, BEAM_TIMEOUT_S, CACHELEVEL, DEBUG, \
    ContextVar, atomic_write, cache_dir, pads_cheaply
from fusegrad.hostcpu import fingerprint, host_cpu_count
from fusegrad.renderer import ProgramSpec
from fusegrad.uop.ops import Ops, UOp

__all__ = ["beam_search", "beam_opts", "candidate_actions", "beam_stats", "beam_rejections", "beam_cache_path",
           "opts_to_json", "opts_from_json"]

SLOW_FACTOR = 3.0  # a candidate this much slower than the best so far isn't timed further
TIMING_S, FINAL_S = 0.02, 0.3  # about how long a candidate is timed, and the final comparison with the heuristic

# searches: kernels searched; cache_hits: kernels whose opts came from the disk cache; compiled, timed, rejected:
# candidates (rejected: outputs differ from the unoptimized kernel's)
beam_stats: dict[str, int] = {"searches": 0, "cache_hits": 0, "compiled": 0, "timed": 0, "rejected": 0}
# the latest rejected candidates: kernel, opts, the first element that differs and whether a second run differs too
# (what tells a wrong kernel from one whose results vary run to run)
beam_rejections: list[str] = []

# *** candidate actions ***


def candidate_actions(k: Kernel, max_lanes: int | None = None) -> list[Opt]:
    """The opts worth trying next on `k` (not all apply: `apply_opt` decides): UPCAST and UNROLL by 2, 3, 4, 8, 16
    and vector-width multiples (or the whole loop when it is short) while the product of expanded lanes stays within
    `max_lanes`; on output loops PADTO to vector multiples that waste at most an eighth, SPLIT into one to four chunks
    per core, SWAP with every later output loop and PACK of every loaded buffer; on reduce loops KBLOCK by powers of
    two from 16 and by the largest divisor from 128 to 512. A GPU-style kernel gets its work-item actions instead of
    the CPU loop shapes, and, as its first opt, TC in each way one of the renderer's tensor cores fits; after TC,
    LTILE of its K loop (its operands staged through local memory)."""
    max_lanes = int(BEAM_MAX_LANES.value) if max_lanes is None else max_lanes
    ren = k.renderer
    acc = k.reduceops[-1].dtype if k.reduceops else dtypes.float32
    width = getattr(ren, "simd_bytes", 0) // acc.itemsize if acc in getattr(ren, "vector_dtypes", ()) else 0
    cores = host_cpu_count()
    lanes = math.prod(s for s in (range_size(r) for r in k.expanded) if isinstance(s, int))
    amts = sorted({2, 3, 4, 8, 16} | ({width, 2 * width} if width >= 2 else set()))
    loaded = sorted({idx.src[0].arg for idx, st in k.accesses() if not st and idx.src[0].op is Ops.DEFINE_GLOBAL})
    nout, acts = k.first_reduce, []
    if k.gpu and k.tc is None and getattr(ren, "tensor_cores", None) and \
            all(o.op is OptOps.PADTO for o in k.applied_opts):
        cands = tc_candidates(k, ren.tensor_cores)
        acts += [Opt(OptOps.TC, i, (-1, 0, 1)) for i in range(len(tc_fits(cands)))]
        # (and padded to the tile where it doesn't divide a loop: tc_opt 2 numbers every way with fixed sizes)
        ways = [c for c in cands if all(isinstance(range_size(r), int) for r in c[1:])]
        acts += [Opt(OptOps.TC, i, (-1, 2, 1)) for i, c in enumerate(ways) if c not in tc_fits([c])]
    if k.tc is not None and k.tc_frame is not None and not k.tiles and (rk := tc_loops(k)[2]) is not None:
        # (the tensor core's operands staged through local memory, in blocks of 2 to 8 tiles of K)
        acts += [Opt(OptOps.LTILE, k.loops.index(rk), a) for a in (2, 4, 8)
                 if isinstance(sz := range_size(rk), int) and sz % a == 0 and sz > a]
    for ax, r in enumerate(k.loops):
        sz = range_size(r)
        if not isinstance(sz, int) or sz < 2: continue
        red = ax >= nout
        for a in amts + ([0] if sz <= 16 else []):
            if sz % (a or sz) or lanes * (a or sz) > max_lanes: continue
            acts.append(Opt(OptOps.UNROLL if red else OptOps.UPCAST, ax, a))
            if red: acts.append(Opt(OptOps.UPCAST, ax, a))
        if k.gpu:
            acts += _gpu_actions(k, ax, sz, red)
            continue
        if red:
            blocks = {b for b in (16, 32, 64, 128, 256, 512) if sz % b == 0 and sz > b}
            blocks |= {b for b in [next((b for b in range(512, 127, -1) if sz % b == 0 and sz > b), None)] if b}
            acts += [Opt(OptOps.KBLOCK, ax, b) for b in sorted(blocks)]
            continue
        pads = {a for a in (4, 8, 16, width, 2 * width) if a >= 2 and sz % a and pads_cheaply(sz, a)}
        acts += [Opt(OptOps.PADTO, ax, a) for a in sorted(pads)]
        acts += [Opt(OptOps.SPLIT, ax, a) for a in sorted({cores, 2 * cores, 4 * cores}) if sz % a == 0 and sz > a]
        acts += [Opt(OptOps.SWAP, ax, o) for o in range(ax + 1, nout)]
        acts += [Opt(OptOps.PACK, ax, b) for b in loaded]
    return list(dict.fromkeys(acts))

def _gpu_actions(k: Kernel, ax: int, sz: int, red: bool) -> list[Opt]:
    """A GPU-style kernel's work-item actions on loop `ax` of `sz` iterations: GROUP and GROUPTOP of a reduce loop,
    LOCAL of an output loop, by powers of two that fit the work-group; PADTO to those that waste at most an eighth."""
    room = k.renderer.max_workgroup // math.prod(range_size(r) for r in k.locals)
    amts = [a for a in (2, 4, 8, 16, 32, 64, 128, 256) if a <= room]
    ops = (OptOps.GROUP, OptOps.GROUPTOP) if red else (OptOps.LOCAL,)
    acts = [Opt(op, ax, a) for op in ops for a in amts if sz % a == 0]
    return acts + [Opt(OptOps.PADTO, ax, a) for a in amts if a >= 8 and sz % a and pads_cheaply(sz, a)]

def _variants(ast: UOp, ren: Any, opts: tuple[Opt, ...]) -> list[tuple[Opt, ...]]:
    """The heuristic's opts with one left out, or with another amount for one of them that fits its loop (the later
    ones kept where they still apply)."""
    out = [opts[:i] + opts[i + 1:] for i in range(len(opts))]
    cores, k = host_cpu_count(), Kernel(ast, ren)
    for i, o in enumerate(opts):
        sz = range_size(k.loops[o.axis]) if o.axis < len(k.loops) else None
        alts: list[int] = []
        if isinstance(sz, int):
            if o.op in (OptOps.UPCAST, OptOps.UNROLL): alts = [a for a in (2, 3, 4, 6, 8, 16, 32) if sz % a == 0]
            elif o.op is OptOps.KBLOCK:
                blocks = [b for b in range(32, min(sz, 1025)) if sz % b == 0]
                alts = blocks[::max(1, len(blocks) // 6)]
            elif o.op is OptOps.PADTO: alts = [a for a in (8, 16, 32, 64) if sz % a and pads_cheaply(sz, a)]
            elif o.op in (OptOps.LOCAL, OptOps.GROUP, OptOps.GROUPTOP):
                alts = [a for a in (4, 8, 16, 32, 64, 128, 256) if sz % a == 0]
            elif o.op is OptOps.SPLIT: alts = [c for c in (cores, 2 * cores, 4 * cores, 8 * cores) if sz % c == 0]
        out += [opts[:i] + (Opt(o.op, o.axis, a),) + opts[i + 1:] for a in alts if a != o.arg]
        try: k.apply_opt(o)
        except KernelOptError: break
    return out

# *** candidates ***

@dataclass(eq=False)
class _Cand:
    opts: tuple[Opt, ...]
    k: Kernel
    p: ProgramSpec | None = None
    runner: Any = None   # the compiled kernel, ready to time (see the module docstring)
    times: list[float] = field(default_factory=list)
    bad: bool = False   # failed to compile or run, or its outputs differ
    @property
    def time(self) -> float: return min(self.times) if self.times and not self.bad else math.inf

def _kernel(ast: UOp, ren: Any, opts: tuple[Opt, ...], lenient: bool = False) -> _Cand | None:
    """A candidate with `opts` applied (lenient: the ones that don't apply are dropped), None if one doesn't apply."""
    k, done = Kernel(ast, ren), []
    for o in opts:
        try: k.apply_opt(o)
        except KernelOptError:
            if not lenient: return None
            k = Kernel(ast, ren)  # a failed opt may have been half applied: start again with the ones that applied
            for d in done: k.apply_opt(d)
            continue
        except Exception: return None
        done.append(o)
    return _Cand(tuple(done), k)

def _extend(c: _Cand, opt: Opt) -> _Cand | None:
    """`c` with one more opt, or None if it doesn't apply."""
    k = copy.copy(c.k)
    k._restore(k._state())   # (its own copies of the lists it changes)
    k.applied_opts = list(k.applied_opts)
    try: k.apply_opt(opt)
    except Exception: return None
    return _Cand(c.opts + (opt,), k)

# *** scratch buffers ***

# per-byte (and, or) masks that turn random bytes into values of magnitude 0.5 to 1 with random signs (no zeros,
# infinities, nans or denormals), and integers into 0..7 (so divisions, shifts and indices stay tame)
_FLOAT_MASKS: dict[DType, tuple[tuple[int, int], ...]] = {
    dtypes.float16: ((0xFF, 0), (0x83, 0x38)),
    dtypes.bfloat16: ((0x7F, 0), (0x80, 0x3F)),
    dtypes.float32: ((0xFF, 0), (0xFF, 0), (0x7F, 0), (0x80, 0x3F)),
    dtypes.float64: ((0xFF, 0),) * 6 + ((0x0F, 0xE0), (0x80, 0x3F)),
}

@functools.cache
def _table(a: int, o: int) -> bytes: return bytes((b & a) | o for b in range(256))

def _np() -> Any:
    try:
        import numpy
        return numpy
    except ImportError: return None

def _random_bytes(dt: DType, n: int, rng: random.Random) -> bytes:
    """n elements of dtype dt as bytes (little-endian hosts)."""
    size = dt.itemsize
    data = rng.randbytes(n * size)
    masks = _FLOAT_MASKS.get(dt) or ((0x01 if dt == dtypes.bool else 0x07, 0),) + ((0, 0),) * (size - 1)
    if sys.byteorder == "big": masks = masks[::-1]
    if (np := _np()) is not None:
        arr = np.frombuffer(data, np.uint8).reshape(n, size)
        return ((arr & np.array([a for a, _ in masks], np.uint8)) | np.array([o for _, o in masks], np.uint8)).tobytes()
    buf = bytearray(data)
    for i, (a, o) in enumerate(masks): buf[i::size] = buf[i::size].translate(_table(a, o))
    return bytes(buf)

def _var_value(v: UOp) -> int | float:
    lo, hi = v.arg[1], v.arg[2]
    # a size (index dtype) at its largest, so every buffer is used as allocated; a lifted constant a tame value
    if v.dtype == dtypes.index: return hi
    if dtypes.is_float(v.dtype): return float(min(max(1.0, lo), hi))
    return int(min(max(1, lo), hi))

class _Scratch:
    """Buffers for every DEFINE_GLOBAL of a kernel with random contents, and the values of its Variables."""
    def __init__(self, ast: UOp, device: str):
        sizes: dict[int, tuple[int, DType]] = {}
        for u in ast.toposort():
            if u.op is Ops.DEFINE_GLOBAL:
                size = getattr(u.dtype, "size", -1)
                if not isinstance(size, int) or size <= 0: raise ValueError(f"buffer {u.arg} has no fixed size")
                prev = sizes.get(u.arg, (0, u.dtype.base))[0]
                sizes[u.arg] = (max(prev, size), u.dtype.base)
        self.stored = sorted({st.src[0].src[0].arg for st in ast.src if st.src[0].src[0].op is Ops.DEFINE_GLOBAL})
        rng = random.Random(0)
        self.bufs: list[Buffer | None] = [None] * (max(sizes) + 1 if sizes else 0)
        self.init: dict[int, bytes] = {}  # the first contents of the buffers the kernel writes
        for i, (n, dt) in sorted(sizes.items()):
            data = _random_bytes(dt, n, rng)
            self.bufs[i] = Buffer(device, n, dt).copyin(memoryview(data))
            if i in self.stored: self.init[i] = data
        self.dtypes = {i: dt for i, (n, dt) in sizes.items()}
        self.var_vals = {v.arg[0]: _var_value(v) for v in ast.toposort() if v.op is Ops.DEFINE_VAR}

    def reset(self) -> None:
        """The stored buffers back to their first contents (a kernel may read what it writes)."""
        for i in self.stored: self.bufs[i].copyin(memoryview(self.init[i]))  # type: ignore[union-attr]

    def outputs(self) -> dict[int, memoryview]: return {i: self.bufs[i].as_buffer() for i in self.stored}  # type: ignore

def _tolerance(dt: DType) -> float: return 1e-6 if dt == dtypes.float64 else 1e-3 if dt == dtypes.float32 else 2e-2

class _Reference:
    """The unoptimized kernel's outputs, and `matches`: whether another kernel's output is the same within float
    tolerance (other dtypes exactly; nans where the reference has them). The tolerance is relative to the reference's
    largest finite magnitude: reordered sums and fused multiply-adds move values by far less, wrong indexing by far
    more."""
    def __init__(self, outs: dict[int, memoryview], dts: dict[int, DType]):
        self.raw = {i: bytes(b) for i, b in outs.items()}
        self.dts, self.np = dts, _np()
        self.prepared: dict[int, tuple[Any, Any]] = {}
        if self.np is None: return
        for i, raw in self.raw.items():
            if not dtypes.is_float(dts[i]): continue
            y = self._floats(raw, dts[i])
            fin = self.np.isfinite(y)
            scale = float(self.np.abs(y[fin]).max()) if fin.any() else 0.0
            tol = _tolerance(dts[i])
            self.prepared[i] = (y, (tol * scale + tol * self.np.abs(y)).astype(y.dtype))

    def _floats(self, b: Any, dt: DType) -> Any:
        np = self.np
        if dt == dtypes.bfloat16: return (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32)
        x = np.frombuffer(b, {2: np.float16, 4: np.float32, 8: np.float64}[dt.itemsize])
        return x.astype(np.float32) if dt.itemsize == 2 else x

    def first_difference(self, i: int, out: memoryview) -> str:
        """Where output `i` first differs from the reference's (float outputs, with numpy), in words."""
        if i not in self.prepared: return f"buffer {i} differs"
        np, (y, bound) = self.np, self.prepared[i]
        x = self._floats(out, self.dts[i])
        with np.errstate(invalid="ignore"): bad = ~(np.abs(x - y) <= bound) & ~(np.isnan(x) & np.isnan(y))
        bad = np.flatnonzero(bad)
        if not len(bad): return f"buffer {i}: no element differs on this run"
        j = int(bad[0])
        return f"buffer {i}: {len(bad)} of {len(y)} elements differ, the first [{j}] {x[j]} where the reference has " \
               f"{y[j]} (allowed {bound[j]})"

    def matches(self, i: int, out: memoryview) -> bool:
        if i in self.prepared:
            np, (y, bound) = self.np, self.prepared[i]
            x = self._floats(out, self.dts[i])
            with np.errstate(invalid="ignore"): bad = ~(np.abs(x - y) <= bound)
            if not bad.any(): return True
            xb, yb = x[bad], y[bad]  # equal infinities, nans where the reference has nans
            return bool(((xb == yb) | (np.isnan(xb) & np.isnan(yb))).all())
        ref = self.raw[i]
        if bytes(out) == ref: return True
        return dtypes.is_float(self.dts[i]) and _close_slow(bytes(out), ref, self.dts[i])

def _close_slow(out: bytes, ref: bytes, dt: DType) -> bool:
    """`_Reference.matches` without numpy: every element of outputs up to 2^20 elements, a strided sample of bigger
    ones."""
    tol, n = _tolerance(dt), len(ref) // dt.itemsize
    def val(b: bytes, i: int) -> float:
        if dt == dtypes.bfloat16: return struct.unpack("<f", b"\0\0" + b[2 * i:2 * i + 2])[0]
        return struct.unpack_from("=" + (dt.fmt or "f"), b, i * dt.itemsize)[0]
    idxs = range(0, n, max(1, n >> 20))
    ys = [val(ref, i) for i in idxs]
    scale = max((abs(y) for y in ys if math.isfinite(y)), default=0.0)
    for i, y in zip(idxs, ys):
        x = val(out, i)
        if x == y or (math.isnan(y) and math.isnan(x)): continue
        if not abs(x - y) <= tol * scale + tol * abs(y): return False
    return True

# *** compiling and timing ***

def _compile(cands: list[_Cand], dev: Any, runner: Callable[..., Any]) -> float:
    """Compile the candidates' sources in one batched compiler call (one by one if the batch fails) and load them with
    `runner`. Returns the wall time this took per byte of source, as an estimate for the next batch."""
    srcs = [c.p.src for c in cands if c.p is not None]
    if not srcs: return 0.0
    st = time.perf_counter()
    try: libs = dev.compiler._compile_all(srcs)
    except CompileError:
        libs = []
        for s in srcs:
            try: libs.append(dev.compiler.compile(s))
            except CompileError: libs.append(None)
    beam_stats["compiled"] += len(srcs)
    for c, lib in zip([c for c in cands if c.p is not None], libs):
        try: c.runner = runner(c.p, precompiled=lib) if lib is not None else None
        except Exception: c.runner = None
        if c.runner is None: c.bad = True
    # compile time grows with the source (a variant with twice the lanes has twice the code); sources compile
    # in parallel on every core
    cores = host_cpu_count()
    return (time.perf_counter() - st) * min(len(srcs), cores) / cores / sum(len(s) for s in srcs)

class _Timer:
    """Runs candidates on the scratch buffers: the first run of each checks its outputs against the reference."""
    def __init__(self, scratch: _Scratch, runs: int, deadline: float):
        self.s, self.runs, self.deadline = scratch, runs, deadline
        self.ref: _Reference | None = None
        self.best = math.inf

    def run(self, c: _Cand) -> float:
        assert c.runner is not None
        return float(c.runner(self.s.bufs, self.s.var_vals, wait=True) or 0.0)  # type: ignore[arg-type]

    def reference(self, c: _Cand) -> bool:
        """Run the unoptimized kernel once: its outputs are what every candidate must reproduce."""
        try:
            self.s.reset()
            c.times.append(self.run(c))
            self.ref = _Reference(self.s.outputs(), self.s.dtypes)
        except Exception as e:
            if DEBUG >= 1: print(f"BEAM: the unoptimized kernel failed to run ({e}); keeping the heuristic")
            return False
        return True

    def _record_rejection(self, c: _Cand) -> None:
        """Note why `c` was rejected, and whether a second run on fresh contents differs too."""
        assert self.ref is not None
        ref = self.ref
        first = "; ".join(ref.first_difference(i, o) for i, o in self.s.outputs().items() if not ref.matches(i, o))
        try:
            self.s.reset()
            self.run(c)
            again = "differs again" if not all(ref.matches(i, o) for i, o in self.s.outputs().items()) else \
                "matches on a second run"
        except Exception as e: again = f"a second run failed ({type(e).__name__}: {e})"
        name = c.p.name if c.p is not None else "kernel"
        beam_rejections.append(f"{name} {list(c.opts)}: {first}; {again}")
        del beam_rejections[:-20]
        if DEBUG >= 2: print(f"BEAM: rejected {beam_rejections[-1]}")

    def time(self, c: _Cand, runs: int | None = None, check: bool = True) -> None:
        """Time `c` (checked against the reference on its first run) until it has `runs` runs or is too slow."""
        if c.bad or c.runner is None: return
        try:
            if check and not c.times:
                assert self.ref is not None
                self.s.reset()
                c.times.append(self.run(c))
                if not all(self.ref.matches(i, o) for i, o in self.s.outputs().items()):
                    c.bad = True
                    beam_stats["rejected"] += 1
                    self._record_rejection(c)
                    return
                beam_stats["timed"] += 1
            # short kernels are timed more often (up to 10x), for about TIMING_S: their runs are cheap, and on a
            # busy machine their times are noisy, often bimodal (a thread waiting for a core)
            runs = self.runs if runs is None else runs
            want = max(runs, min(10 * runs, math.ceil(TIMING_S / max(c.time, 1e-7))))
            while len(c.times) < want and c.time <= SLOW_FACTOR * self.best and time.perf_counter() < self.deadline:
                c.times.append(self.run(c))
        except Exception as e:
            c.bad = True
            if DEBUG >= 2: print(f"BEAM: {list(c.opts)} failed to run: {e}")
            return
        self.best = min(self.best, c.time)

# *** the search ***

def _render(ast: UOp, ren: Any, cands: list[_Cand], seen: set, deadline: float, est: float = 0.0,
            run: float = 0.0) -> list[_Cand]:
    """Candidates whose optimized AST and source are new, rendered (those that fail to render are dropped), as many
    as can be rendered, compiled (`est` seconds per byte of source) and timed (`run` seconds each) before the
    deadline."""
    out: list[_Cand] = []
    nbytes = 0
    for c in cands:
        if time.perf_counter() + est * nbytes + run * (len(out) + 1) > deadline: break
        try: key = c.k.get_optimized_ast()
        except Exception: continue
        if key in seen: continue
        seen.add(key)
        try: c.p = get_program(ast, ren, opts=list(c.opts))
        except Exception as e:
            if DEBUG >= 3: print(f"BEAM: {list(c.opts)} doesn't render: {type(e).__name__}: {e}")
            continue
        if c.p.src in seen: continue
        seen.add(c.p.src)
        if time.perf_counter() + est * (nbytes + len(c.p.src)) + run * (len(out) + 1) > deadline: break
        nbytes += len(c.p.src)
        out.append(c)
    return out

class _Spent(dict):
    """Seconds spent per phase of a search: `with spent("compile"): ...`."""
    @contextlib.contextmanager
    def __call__(self, phase: str):
        st = time.perf_counter()
        try: yield
        finally: self[phase] = self.get(phase, 0.0) + time.perf_counter() - st

def _fmt(s: float) -> str: return "inf" if s == math.inf else f"{s * 1e6:.1f}us" if s < 1e-3 else f"{s * 1e3:.3f}ms"

def _final_choice(heur: _Cand, beam: list[_Cand], timer: _Timer) -> tuple[_Cand, float, float]:
    """The best candidates timed again, interleaved with the heuristic's kernel, so that a lucky timing of one
    candidate doesn't decide: the heuristic's is kept unless the best is clearly faster in its least and median time.
    Returns the choice, and the least times of the best and of the heuristic's."""
    finalists = list(dict.fromkeys([heur] + beam))
    fin: dict[int, list[float]] = {id(c): [] for c in finalists}
    rounds = max(3, min(30, math.ceil(FINAL_S / max(sum(c.time for c in finalists), 1e-7))))
    for _ in range(rounds):
        for c in finalists:
            try: fin[id(c)].append(timer.run(c))
            except Exception: fin[id(c)].append(math.inf)
    best = min(finalists, key=lambda c: min(fin[id(c)]))
    med = lambda c: sorted(fin[id(c)])[len(fin[id(c)]) // 2]
    heur_t, best_t, gain = min(fin[id(heur)]), min(fin[id(best)]), 1 - float(BEAM_MIN_GAIN.value)
    return (best if best_t < heur_t * gain and med(best) < med(heur) * gain else heur), best_t, heur_t

def beam_search(ast: UOp, device: str, amt: int, runner: Callable[..., Any], timeout_s: float | None = None) \
        -> list[Opt]:
    """The fastest opts for kernel `ast` on `device` found by a beam search of width `amt`, timing candidates loaded
    with `runner` (see the module docstring); the heuristic's opts if nothing times clearly faster or the kernel can't
    be timed."""
    st = time.perf_counter()
    # (the final comparison with the heuristic comes after the deadline)
    deadline = st + (float(BEAM_TIMEOUT_S.value) if timeout_s is None else timeout_s) - FINAL_S
    dev = Device[device]
    ren = dev.renderer
    heur_opts = tuple(optimize(ast, ren)[1])
    beam_stats["searches"] += 1
    spent = _Spent()
    try:
        with spent("buffers"): scratch = _Scratch(ast, device)
    except ValueError as e:
        if DEBUG >= 2: print(f"BEAM: not searching ({e}); keeping the heuristic")
        return list(heur_opts)
    timer = _Timer(scratch, max(1, int(BEAM_RUNS.value)), deadline)
    seen: set = set()
    # the unoptimized kernel (the reference) and the heuristic's, compiled first: their compile time estimates the
    # cost of the other candidates
    plain, heur = _kernel(ast, ren, ()), _kernel(ast, ren, heur_opts)
    assert plain is not None and heur is not None, "the heuristic's opts must apply"
    with spent("render"): first = _render(ast, ren, [plain, heur], seen, math.inf)
    with spent("compile"): est = _compile(first, dev, runner)
    with spent("run"): ok = plain in first and plain.runner is not None and timer.reference(plain)
    if not ok: return list(heur_opts)
    name = plain.p.name if plain.p is not None else "kernel"
    if heur not in first: heur = plain  # the heuristic chose no opts
    with spent("run"): timer.time(heur)
    if heur.bad:
        if DEBUG >= 1: print(f"BEAM {name}: the heuristic's kernel doesn't match the unoptimized one; keeping it")
        return list(heur_opts)
    with spent("run"): timer.time(plain)
    # round 0: variants of the heuristic
    variants = [v for o in _variants(ast, ren, heur_opts) if (v := _kernel(ast, ren, o, lenient=True)) is not None]
    run = (timer.runs + 1) * heur.time  # timing a candidate about as fast as the heuristic's
    with spent("render"): cands = _render(ast, ren, variants, seen, deadline, est, run)
    with spent("compile"):
        if cands: est = _compile(cands, dev, runner)
    with spent("run"):
        for c in cands: timer.time(c)
    everything = [c for c in [plain, heur] + cands if c.time < math.inf]
    tried = len(first) + len(cands)
    beam = sorted(everything, key=lambda c: c.time)[:amt]
    if DEBUG >= 2:
        print(f"BEAM {name}: round 0, {tried} candidates, best {_fmt(beam[0].time)}, heuristic {_fmt(heur.time)}, "
              f"unoptimized {_fmt(plain.time)}")
    for rnd in range(1, int(BEAM_ROUNDS.value) + 1):
        if time.perf_counter() + est * max(len(c.p.src) for c in beam if c.p is not None) > deadline: break
        best_before = beam[0].time
        new = [c for b in beam for a in candidate_actions(b.k) if (c := _extend(b, a)) is not None]
        with spent("render"): cands = _render(ast, ren, new, seen, deadline, est, run)
        if not cands: break
        with spent("compile"): est = _compile(cands, dev, runner)
        with spent("run"):
            for c in cands: timer.time(c)
        tried += len(cands)
        everything += [c for c in cands if c.time < math.inf]
        for c in cands:
            if c.time == math.inf: c.runner = None  # unload what can't be chosen
        beam = sorted(everything, key=lambda c: c.time)[:amt]
        if DEBUG >= 2: print(f"BEAM {name}: round {rnd}, {len(cands)} candidates, best {_fmt(beam[0].time)}")
        if beam[0].time >= best_before * 0.99: break
    with spent("run"): chosen, best_t, heur_t = _final_choice(heur, beam, timer)
    if DEBUG >= 2:
        print(f"BEAM {name}: {tried} candidates in {time.perf_counter() - st:.2f} s, best {_fmt(best_t)} vs heuristic "
              f"{_fmt(heur_t)} ({heur_t / best_t if best_t else 1:.2f}x): "
              f"{'heuristic' if chosen is heur else list(chosen.opts)}")
        print(f"BEAM {name}: seconds spent " + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()))
    return list(chosen.opts)

# *** the disk cache ***

@functools.cache
def _codegen_digest() -> str:
    """A digest of the code generator's sources: when it changes, the kernels it makes do, and earlier choices are
    stale (their opts may not even apply). The codegen and renderer packages, the index algebra they build loops with
    and the host CPU's vector facts the renderers declare."""
    import fusegrad.codegen, fusegrad.hostcpu, fusegrad.renderer, fusegrad.uop.affine
    paths = [os.path.join(d, f) for pkg in (fusegrad.codegen, fusegrad.renderer)
             for d, _, files in sorted(os.walk(os.path.dirname(pkg.__file__ or ""))) for f in sorted(files)
             if f.endswith(".py")]
    h = hashlib.sha256()
    for path in paths + [fusegrad.uop.affine.__file__ or "", fusegrad.hostcpu.__file__ or ""]:
        with open(path, "rb") as fh: h.update(os.path.basename(path).encode() + b"\0" + fh.read())
    return h.hexdigest()[:16]

def ast_key(ast: UOp) -> str:
    """A digest of a kernel AST that is the same in every process."""
    nodes = list(ast.toposort())
    pos = {u: i for i, u in enumerate(nodes)}
    text = "\n".join(f"{u.op.name} {u.dtype!r} {[pos[s] for s in u.src]} {u.arg!r}" for u in nodes)
    return hashlib.sha256(text.encode()).hexdigest()

def _cache_key(ast: UOp, device: str, amt: int, knobs: Sequence[ContextVar]) -> str:
    dev = Device[device]
    knob_values = ",".join(f"{k.key}={k.value}" for k in knobs if k.key != "BEAM")
    return "|".join(["beam-v1", _codegen_digest(), Device.canonicalize(device), type(dev.renderer).__name__,
                     str(getattr(dev.compiler, "cachekey", None)),
                     f"{platform.machine()}-{fingerprint()}", f"threads={dev.max_threads}",
                     knob_values, f"amt={amt}", ast_key(ast)])

def beam_cache_path(ast: UOp, device: str, amt: int, knobs: Sequence[ContextVar]) -> str:
    """Where the chosen opts for `ast` on `device` with beam width `amt` (and the codegen `knobs`' values) are
    stored."""
    h = hashlib.sha256(_cache_key(ast, device, amt, knobs).encode()).hexdigest()
    return os.path.join(cache_dir(), "beam", h[:2], h)

def opts_to_json(opts: list[Opt]) -> list[list]:
    return [[o.op.name, o.axis, list(o.arg) if isinstance(o.arg, tuple) else o.arg] for o in opts]

def opts_from_json(data: Any) -> list[Opt]:
    """Opts from `opts_to_json`'s form; ValueError if it isn't that."""
    if not isinstance(data, list): raise ValueError("opts must be a list")
    out = []
    for o in data:
        # (TC's arg is a list of ints: (tc_select, tc_opt, use_tc))
        if not (isinstance(o, list) and len(o) == 3 and isinstance(o[0], str) and o[0] in OptOps.__members__ and
                type(o[1]) is int and (type(o[2]) is int or (o[0] == "TC" and isinstance(o[2], list) and
                                                               all(type(x) is int for x in o[2])))):
            raise ValueError(f"bad opt {o!r}")
        out.append(Opt(OptOps[o[0]], o[1], tuple(o[2]) if isinstance(o[2], list) else o[2]))
    return out

def _read_cache(path: str, key: str) -> list[Opt] | None:
    try:
        with open(path, encoding="utf-8") as f: data = json.load(f)
        if not isinstance(data, dict) or data.get("key") != key: raise ValueError("another key")
        return opts_from_json(data.get("opts"))
    except FileNotFoundError: return None
    except Exception as e:  # whatever is in the file, it only costs a search
        if DEBUG >= 1: print(f"BEAM cache: ignoring bad entry {path}: {e}")
        return None

def _write_cache(path: str, key: str, opts: list[Opt]) -> None:
    try:
        with atomic_write(path, "w") as f: json.dump({"key": key, "opts": opts_to_json(opts)}, f)
    except OSError as e:
        if DEBUG >= 1: print(f"BEAM cache: can't write {path}: {e}")

def _applies(ast: UOp, ren: Any, opts: list[Opt]) -> bool:
    k = Kernel(ast, ren)
    try:
        for o in opts: k.apply_opt(o)
    except KernelOptError: return False
    return True

def beam_opts(ast: UOp, device: str, amt: int, runner: Callable[..., Any], knobs: Sequence[ContextVar]) -> list[Opt]:
    """The opts BEAM=amt chooses for `ast` on `device`: from the disk cache, else searched (and stored). `runner` loads
    a candidate to time (see the module docstring); `knobs` are the knobs that change generated code, whose values
    are part of the cache key."""
    device = Device.canonicalize(device)
    key = _cache_key(ast, device, amt, knobs)
    path = beam_cache_path(ast, device, amt, knobs)
    if CACHELEVEL >= 1 and (opts := _read_cache(path, key)) is not None:
        if _applies(ast, Device[device].renderer, opts):
            beam_stats["cache_hits"] += 1
            if DEBUG >= 2: print(f"BEAM cache hit: {opts}")
            return opts
        if DEBUG >= 1: print(f"BEAM cache: ignoring stale entry {path}")
    try: opts = beam_search(ast, device, amt, runner)
    except Exception as e:  # a search that fails costs the kernel its search, not the program
        if DEBUG >= 1: print(f"BEAM: search failed ({type(e).__name__}: {e}); using the heuristic")
        return list(optimize(ast, Device[device].renderer)[1])
    if CACHELEVEL >= 1: _write_cache(path, key, opts)
    return opts
