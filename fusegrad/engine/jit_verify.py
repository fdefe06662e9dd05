"""TinyJit(fn, verify=n) and JIT_VERIFY=n: a replay that also runs the function eagerly and compares.

The replay runs first; the buffers it wrote that outlive it (state the function updates in place, its inputs) are
put back as they were, the random counter too, and the function runs eagerly, its kernels recorded. Outputs and
updated state must agree; where they don't, the eager kernels are compared with the captured ones to name the likely
cause: other kernels (a branch taken differently), the same kernels with other constants (a Python value frozen at
capture), or the same kernels reading a buffer from outside the arguments that changed since the capture, or that
the eager call made anew (a tensor built from Python data inside the function)."""
from __future__ import annotations
from typing import Any
from fusegrad.device import Buffer
from fusegrad.dtype import dtypes
from fusegrad.engine import realize as _realize
from fusegrad.engine.capture import CaptureRecorder, JitError
from fusegrad.helpers import ContextVar, rng_counter_of
from fusegrad.uop.ops import Ops
from fusegrad.viz import record as _viz

__all__ = ["JIT_VERIFY", "JitVerifyError", "verified_replay", "note_external"]

JIT_VERIFY = ContextVar("JIT_VERIFY", 0)

class JitVerifyError(JitError):
    """A TinyJit replay computed something else than the function run eagerly."""

def _outputs(k: Any) -> list[Buffer]:
    """The buffers an ExecItem writes (one per STORE of its kernel; a copy's destination)."""
    n = sum(1 for x in k.ast.src if x.op is Ops.STORE) if k.ast.op is Ops.SINK else 1
    return [b for b in k.bufs[:n] if b is not None]

def _tensors(ret: Any, Tensor: Any) -> list[Any]:
    if isinstance(ret, (tuple, list)): return [t for x in ret for t in _tensors(x, Tensor)]
    if isinstance(ret, dict): return [t for k in sorted(ret, key=repr) for t in _tensors(ret[k], Tensor)]
    return [ret] if isinstance(ret, Tensor) else []

def _host(b: Buffer) -> Any: return b.numpy().copy()

def note_external(jit: Any, inputs: Any) -> None:
    """At capture: the buffers the captured kernels read that are neither arguments nor written by the kernels, with
    their contents, so a later verification can tell which of them changed."""
    written = {id(b) for ei in jit.jit_cache for b in _outputs(ei)}
    args = {id(b) for b in inputs.buffers}
    seen: set[int] = set()
    jit._external = []
    for ei in jit.jit_cache:
        for b in ei.bufs:
            if b is None or id(b) in written or id(b) in args or id(b) in seen or not b.is_allocated(): continue
            seen.add(id(b))
            jit._external.append((b, _host(b)))

def verified_replay(jit: Any, inputs: Any, args: tuple, kwargs: dict, Tensor: Any) -> Any:
    """A replay checked against an eager call of the function (see the module's docstring). (`Tensor`: the class,
    passed by TinyJit, which sits above it.)"""
    import numpy as np
    state = {id(b): b for ei in jit.jit_cache for b in _outputs(ei) if id(b) in jit._state_ids and b.is_allocated()}
    state.update({id(b): b for b in inputs.buffers if b.is_allocated()})
    saved = [(b, _host(b)) for b in state.values()]
    rng = Tensor._rng_counter
    replayed = jit._replay(inputs, Tensor)
    got = [t.numpy().copy() for t in _tensors(replayed, Tensor)]
    got_state = [_host(b) for b, _ in saved]
    for b, data in saved: b.copyin(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
    Tensor._rng_counter = rng
    rec = CaptureRecorder()
    _realize.capturing.append(rec)
    try: eager = jit._run_plain(args, kwargs)
    finally: _realize.capturing.remove(rec)
    want = [t.numpy() for t in _tensors(eager, Tensor)]
    diff = None
    if len(got) != len(want): diff = f"the replay returned {len(got)} tensors, the eager call {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if diff is None and not _close(a, b): diff = f"output {i} differs: replay {_show(a, b)}"
    for (buf, _), a in zip(saved, got_state):
        if diff is None and not _close(a, b := _host(buf)):
            diff = f"a buffer the function updates in place ({buf.size} x {buf.dtype}) differs: replay {_show(a, b)}"
    if diff is not None:
        message = f"TinyJit replay {jit._replays} does not match the function run eagerly: {diff}. " \
                  f"Likely cause: {_cause(jit, rec.items, inputs)}"
        if _viz.TIMED: _viz.record_finding("JIT_VERIFY", message)
        raise JitVerifyError(message)
    return eager

def _close(a: Any, b: Any) -> bool:
    import numpy as np
    if a.shape != b.shape: return False
    if a.dtype.kind != "f": return bool((a == b).all())
    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))

def _show(a: Any, b: Any) -> str:
    import numpy as np
    if a.shape != b.shape: return f"shape {a.shape}, eager shape {b.shape}"
    bad = np.flatnonzero(~np.isclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True) if a.dtype.kind == "f" else a != b)
    i = int(bad[0]) if len(bad) else 0
    return f"{a.reshape(-1)[i]!r}, eager {b.reshape(-1)[i]!r} at element {i}"

def _structure(k: Any) -> tuple:
    """A kernel's AST with its values (constants, lifted parameters) left out, and those values in order."""
    key, values = [], []
    for u in k.ast.toposort():
        value = u.op is Ops.CONST and u.dtype.scalar() not in (dtypes.index, dtypes.bool) or \
            u.op is Ops.DEFINE_VAR and str(u.arg[0]).startswith("_p")
        if value:
            v = u.arg if u.op is Ops.CONST else k.fixedvars.get(u.arg[0])
            if rng_counter_of(v) is None: values.append(v)
            key.append(("value", u.dtype.scalar()))
        else: key.append((u.op, u.dtype, u.arg if u.op is not Ops.DEFINE_GLOBAL else None))
    return tuple(key), tuple(values)

def _cause(jit: Any, eager: list[Any], inputs: Any) -> str:
    captured = jit.jit_cache
    shapes = [_structure(k) for k in captured], [_structure(k) for k in eager]
    if len(captured) != len(eager) or any(a[0] != b[0] for a, b in zip(*shapes)):
        first = next((i for i, (a, b) in enumerate(zip(*shapes)) if a[0] != b[0]), min(len(captured), len(eager)))
        return f"a branch taken differently: the eager call ran other kernels than the capture from kernel {first} " \
               f"on ({len(eager)} kernels, the capture {len(captured)}; Python control flow is frozen at capture: " \
               "reset() to capture again, or compute both branches with Tensor.where)"
    for i, (a, b) in enumerate(zip(*shapes)):
        if a[1] != b[1]:
            now = [v for v, w in zip(b[1], a[1]) if v != w]
            then = [w for v, w in zip(b[1], a[1]) if v != w]
            return f"a Python value frozen at capture: kernel {i} computes with {now} now but {then} in the capture " \
                   "(a number read inside the function: a global, an attribute, a closure variable); pass it as a " \
                   "Tensor argument"
    external = {id(b): (b, data) for b, data in jit._external}
    for i, (c, e) in enumerate(zip(captured, eager)):
        for cb, eb in zip(c.bufs, e.bufs):
            if cb is None or id(cb) not in external: continue
            b, data = external[id(cb)]
            if eb is not cb:
                return f"a tensor read from outside the arguments changed: kernel {i} reads the capture's " \
                       f"{b.size} x {b.dtype} buffer where the eager call reads another (a global or attribute now " \
                       "bound to a new tensor, or a tensor made inside the function from Python data, frozen at " \
                       "capture); pass it as an argument"
            if not _close(data, _host(b)):
                return f"a tensor read from outside the arguments changed since the capture (kernel {i} reads a " \
                       f"{b.size} x {b.dtype} buffer that is not an argument, in place); pass it as an argument"
    return "unknown: the eager call ran the same kernels with the same values (a kernel that reads memory it " \
           "should not, or nondeterminism)"
