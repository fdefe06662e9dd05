"""Tensor.explain and Tensor.estimate (see fusegrad/engine/explain.py), source tracking for them, and the device's
roofline that estimate's predicted time uses (measured once per machine and cached on disk)."""
from __future__ import annotations
import contextlib
import json
import os
import time
from typing import Any
from fusegrad.device import Device, GlobalCounters
from fusegrad.engine import explain as _explain
from fusegrad.helpers import Context, ContextVar, atomic_write, cache_dir, getenv
from fusegrad.uop.ops import UOp
from fusegrad.viz import record as _viz

__all__ = ["ExplainMixin", "TRACK_SOURCES", "track_sources", "roofline"]

class ExplainMixin:
    __slots__ = ()

    def explain(self: Any, *others: Any) -> str:
        """For the schedule that realizing these tensors would run (nothing runs): every kernel, each output with the
        reason the scheduler cut the graph there, what would fuse it, and the line that made it (with source
        tracking on: `TRACK_SOURCES=1` or `fusegrad.track_sources()`). `EXPLAIN=1` also prints it."""
        text = str(_explain.explain(_roots((self,) + others)))
        if getenv("EXPLAIN", 0): print(text)
        return text

    def estimate(self: Any, *others: Any, predict: bool = True) -> _explain.Estimate:
        """What realizing these tensors will cost, without running or compiling it: kernels, FLOPs, bytes moved, the
        peak memory after the memory planner (and what is new at the peak) and, with `predict`, the time predicted by
        the device's roofline (measured once per machine, then read from the cache)."""
        from fusegrad.tensor import _shards, lazy_tensors
        tensors = (self,) + others
        deferred: dict[int, UOp] = {}
        roots = _roots(tensors, deferred)
        ids = {id(t) for t in tensors}
        held = [u for t in lazy_tensors() if id(t) not in ids
                for u in ([deferred[id(t)]] if id(t) in deferred else _shards((t,)))]
        return _explain.estimate(roots, held, GlobalCounters.mem_used, roofline(self.device) if predict else None)

def _roots(tensors: tuple, deferred: dict[int, UOp] | None = None) -> list[UOp]:
    """The graphs a realize of these tensors computes: theirs, and what it computes for the lazy tensors that read a
    buffer they overwrite (those readers, or the copies a deferred one keeps: `deferred` gets its new graph by id)."""
    from fusegrad.tensor import _deferred_readers, _overwritten_reads, _shards
    graph = list(_shards(tensors))
    topo = UOp.sink_of(*graph).toposort()
    readers, reading, targets = _overwritten_reads(tensors, None, topo, None)
    if not readers: return graph
    computed, later, kept = _deferred_readers(readers, reading, targets, topo)
    if deferred is not None: deferred.update((id(t), g) for t, g in later)
    return graph + list(_shards(computed + kept))

# *** source tracking: Tensor creation notes its user's line, only while on ***

# a Context knob: while it is set, Tensor.__init__ is wrapped to record sources; unset, the plain one is back
TRACK_SOURCES = ContextVar("TRACK_SOURCES", 0)
_plain_init: Any = None

def _install(on: Any) -> None:
    global _plain_init
    from fusegrad.tensor import Tensor
    if on and _plain_init is None:
        _plain_init = plain = Tensor.__init__
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            plain(self, *args, **kwargs)
            _explain.record_source(self._uop)
        Tensor.__init__ = init  # type: ignore[method-assign]
    elif not on and _plain_init is not None:
        Tensor.__init__ = _plain_init  # type: ignore[method-assign]
        _plain_init = None

def track_sources() -> Context:
    """Within this block (a `Context(TRACK_SOURCES=1)`), every tensor made notes the line of user code that made it,
    for explain, estimate and DEBUG_NANS. Outside it Tensor creation records nothing and costs nothing extra."""
    return Context(TRACK_SOURCES=1)

def install_source_tracking() -> None:
    """Called once the Tensor class exists: follow the knob from now on, and its value from the environment."""
    TRACK_SOURCES.on_set = _install
    _install(TRACK_SOURCES.value)

# *** the roofline of a device ***

_rooflines: dict[str, _explain.Roofline] = {}

def _best(fn: Any, device: str, runs: int) -> float:
    # (a CPU realize returns once its kernels are queued: the time is until the device has finished them)
    dev = Device[device]
    best = float("inf")
    for _ in range(runs):
        dev.synchronize()
        st = time.perf_counter()
        fn()
        dev.synchronize()
        best = min(best, time.perf_counter() - st)
    return best

def measure_roofline(device: str, runs: int = 5) -> _explain.Roofline:
    """Time a big matmul (FLOP/s), a big elementwise kernel (bytes/s) and realizes of one and of many tiny kernels
    (the cost per kernel, and per realize beyond its kernels), each as a whole realize until the device is done, as
    the workloads it predicts are timed; the best of `runs` after one run that compiles."""
    from fusegrad.tensor import Tensor
    n = 1024   # (a 512 matmul reached half the FLOP/s a 1024 one does: the estimate was 2.4x the 1024's time)
    a, b = Tensor.rand(n, n, device=device).realize(), Tensor.rand(n, n, device=device).realize()
    (a @ b).realize()
    flops = 2 * n ** 3 / _best(lambda: (a @ b).realize(), device, runs)
    m = 1 << 22
    x = Tensor.rand(m, device=device).realize()
    (x * 2).realize()
    bw = 2 * 4 * m / _best(lambda: (x * 2).realize(), device, runs)
    small = [Tensor.rand(16, device=device).realize() for _ in range(32)]
    def tiny(k: int) -> None: Tensor.realize(*[(s * 3 + i) for i, s in enumerate(small[:k])])
    tiny(1), tiny(len(small))
    one, many = _best(lambda: tiny(1), device, runs), _best(lambda: tiny(len(small)), device, runs)
    launch = max(many - one, 0.0) / (len(small) - 1)
    # a graph of many nodes in one kernel (an elementwise chain): what its nodes add to a realize
    def chain() -> Tensor:
        y = small[0]
        for i in range(400): y = y * 1.0001 + i if i % 2 else (y - 0.5).maximum(-1.0)
        return y
    chain().realize()
    nodes = len(chain().uop.toposort())
    node = max(_best(lambda: chain().realize(), device, runs) - one, 0.0) / nodes
    return _explain.Roofline(flops, bw, launch, max(one - launch, 0.0), node)

# a cached roofline is measured again when a quick probe of this process differs from it by more than this factor
# (either way): one measured while the machine was busy, or on other hardware under the same cache folder
ROOFLINE_TOLERANCE = 2.0

def _disagrees(cached: _explain.Roofline, probe: _explain.Roofline) -> bool:
    pairs = [(cached.flops_per_s, probe.flops_per_s), (cached.bytes_per_s, probe.bytes_per_s),
             (cached.launch_s, probe.launch_s)]
    return any(not (1 / ROOFLINE_TOLERANCE <= p / c <= ROOFLINE_TOLERANCE) for c, p in pairs if c > 0)

def _saved_rooflines() -> dict[str, Any]:
    try:
        with open(os.path.join(cache_dir(), "roofline.json")) as f: saved = json.load(f)
    except (OSError, ValueError): saved = {}
    return saved if isinstance(saved, dict) else {}

def _from_cache(kind: str, saved: dict[str, Any]) -> _explain.Roofline | None:
    if not isinstance(saved.get(kind), dict): return None
    try: return _explain.Roofline(**saved[kind])
    except TypeError: return None

def cached_roofline(device: str) -> _explain.Roofline | None:
    """The device's roofline if this process or the cache folder has one; measures nothing."""
    kind = Device.canonicalize(device).partition(":")[0]
    return _rooflines.get(kind) or _from_cache(kind, _saved_rooflines())

def roofline(device: str) -> _explain.Roofline:
    """The device's roofline: measured once per machine and device kind, then read from the cache folder; a cached
    one that a quick probe disagrees with (by more than ROOFLINE_TOLERANCE) is measured again and saved."""
    kind = Device.canonicalize(device).partition(":")[0]
    if (r := _rooflines.get(kind)) is not None: return r
    saved = _saved_rooflines()
    if (r := _from_cache(kind, saved)) is not None:
        # checked once per process: a single timed run of each workload
        if not _disagrees(r, measure_roofline(device, runs=1)):
            _rooflines[kind] = r
            return r
    r = _rooflines[kind] = measure_roofline(device)
    saved[kind] = {"flops_per_s": r.flops_per_s, "bytes_per_s": r.bytes_per_s, "launch_s": r.launch_s,
                   "realize_s": r.realize_s, "node_s": r.node_s}
    with contextlib.suppress(OSError), atomic_write(os.path.join(cache_dir(), "roofline.json"), "w") as f:
        json.dump(saved, f)
    return r

# *** what VIZ shows with each schedule ***

# kernels of a schedule (their ASTs, in order) -> its notes: a training loop's every step schedules the same kernels,
# and explaining them again would kernelize the graph once more per step
_notes_cache: dict[tuple, dict[str, Any]] = {}

def schedule_notes(graph: UOp, items: list[Any]) -> dict[str, Any]:
    """Why each kernel of a schedule is cut where it is, and its estimate, as plain data for the VIZ trace. The
    predicted time uses a roofline measured before (none is measured in the middle of a schedule)."""
    key = tuple(si.ast for si in items)
    if (notes := _notes_cache.get(key)) is None:
        roots = list(graph.src)
        device = next((r.device for r in roots if isinstance(r.device, str)), Device.DEFAULT)
        roof = cached_roofline(device)
        ex, est = _explain.explain_and_estimate(roots, [], 0, roof)
        notes = {
            "explain": {"tracked": ex.tracked, "kernels": [
                {"kind": k.kind, "merged": k.merged,
                 "outputs": [[desc, reason, fix, None if src is None else str(src)] for desc, reason, fix, src in
                             k.outputs]} for k in ex.kernels]},
            "estimate": {"kernels": est.kernels, "flops": est.flops, "bytes": est.bytes,
                         "new_memory": est.peak_memory, "predicted_s": est.predicted_s,
                         "live_at_peak": [list(x) for x in est.live_at_peak[:10]],
                         "per_kernel": [[kind, f, b, None if roof is None else roof.time(f, b)]
                                        for kind, f, b in est.per_kernel]}}
        while len(_notes_cache) >= 256: _notes_cache.pop(next(iter(_notes_cache)))
        _notes_cache[key] = notes
    # (the peak is what the schedule adds to the memory in use now)
    return notes | {"estimate": notes["estimate"] | {"peak_memory": GlobalCounters.mem_used +
                                                      notes["estimate"]["new_memory"]}}

_viz.schedule_notes = schedule_notes
