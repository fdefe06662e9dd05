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
        from fusegrad.tensor import lazy_tensors
        tensors = (self,) + others
        roots = _roots(tensors)
        ids = {id(t) for t in tensors}
        held = [u for t in lazy_tensors() if id(t) not in ids for u in _roots((t,))]
        return _explain.estimate(roots, held, GlobalCounters.mem_used, roofline(self.device) if predict else None)

def _roots(tensors: tuple) -> list[UOp]:
    from fusegrad.tensor import Tensor, _shards
    graph = list(_shards(tensors))
    readers = Tensor._readers_of_overwritten(*tensors)
    return graph + list(_shards(readers))

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

def _best(fn: Any, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        st = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - st)
    return best

def measure_roofline(device: str) -> _explain.Roofline:
    """Time a big matmul (FLOP/s), a big elementwise kernel (bytes/s) and a realize of many tiny kernels (per
    kernel), each as a whole realize, as the workloads it predicts are timed."""
    from fusegrad.tensor import Tensor
    n = 512
    a, b = Tensor.rand(n, n, device=device).realize(), Tensor.rand(n, n, device=device).realize()
    (a @ b).realize()
    flops = 2 * n ** 3 / _best(lambda: (a @ b).realize())
    m = 1 << 22
    x = Tensor.rand(m, device=device).realize()
    (x * 2).realize()
    bw = 2 * 4 * m / _best(lambda: (x * 2).realize())
    small = [Tensor.rand(16, device=device).realize() for _ in range(32)]
    def tiny() -> None: Tensor.realize(*[(s * 3 + i) for i, s in enumerate(small)])
    tiny()
    launch = _best(tiny) / len(small)
    return _explain.Roofline(flops, bw, launch)

def roofline(device: str) -> _explain.Roofline:
    """The device's roofline: measured once per machine and device kind, then read from the cache folder."""
    kind = Device.canonicalize(device).partition(":")[0]
    if (r := _rooflines.get(kind)) is not None: return r
    path = os.path.join(cache_dir(), "roofline.json")
    try:
        with open(path) as f: saved = json.load(f)
    except (OSError, ValueError): saved = {}
    if isinstance(saved.get(kind), dict):
        try: r = _rooflines[kind] = _explain.Roofline(**saved[kind])
        except TypeError: r = None
        if r is not None: return r
    r = _rooflines[kind] = measure_roofline(device)
    saved[kind] = {"flops_per_s": r.flops_per_s, "bytes_per_s": r.bytes_per_s, "launch_s": r.launch_s}
    with contextlib.suppress(OSError), atomic_write(path, "w") as f: json.dump(saved, f)
    return r
