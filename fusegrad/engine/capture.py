"""What a TinyJit capture records besides the kernels it runs, kept below the Tensor so both the Tensor and the JIT
import it: the recorder `run_schedule` hands every item to (engine/realize.py `capturing`), the shrinks by bound
Variables each replay checks again, and the error for what a replay can't honour."""
from __future__ import annotations
import weakref
from typing import Any
from fusegrad.engine import realize as _realize
from fusegrad.engine.realize import sym_infer
from fusegrad.uop.graph import var_values
from fusegrad.uop.ops import Ops, UOp, arg_uops, is_symbolic

__all__ = ["JitError", "CaptureRecorder", "ViewChecks", "check_shrink", "check_view_bounds", "running_jits",
           "snapshot_nodes"]

# the BUFFER nodes of the copies a realize took for lazy readers of buffers it overwrote (tensor/__init__.py
# _deferred_readers): a capture that took such a copy doesn't replay it where no later kernel of the capture reads it,
# as the reader belongs to the capture call (a replay makes none).
snapshot_nodes: weakref.WeakSet[UOp] = weakref.WeakSet()

# the TinyJits whose function is running (engine/jit.py: a TinyJit called inside one is an error). A snapshot taken
# meanwhile stays a copy of its own (tensor/__init__.py _snapshot), as in the capture of the same function: the
# first call's kernels are the capture's, not a variant compiled for one call
running_jits: list[Any] = []

class JitError(RuntimeError):
    """A jitted function was called or written in a way its captured kernels can't replay."""

class CaptureRecorder:
    """Collects the ExecItems run while a function is captured, and the shrinks by bound Variables made meanwhile
    (each replay checks them with its own values: see check_shrink)."""
    def __init__(self) -> None:
        self.items: list[Any] = []
        self.constraints: list[tuple[tuple, dict[str, int]]] = []
    def add(self, ei: Any, var_vals: dict[str, int]) -> None: self.items.append(ei)

def check_view_bounds(dims: list[tuple], var_vals: dict[str, int]) -> None:
    """`dims`: (dimension, begin, end, size, names of the Variables in them), as check_shrink makes them."""
    for d, b, e, s, names in dims:
        if not names or any(n not in var_vals for n in names): continue  # (an unbound Variable: no value to check)
        lo, hi, size = (sym_infer(x, var_vals) for x in (b, e, s))
        if not 0 <= lo <= hi <= size:
            many = len(names) > 1
            raise IndexError(f"Variable{'s' if many else ''} {', '.join(f'{n}={var_vals[n]}' for n in names)} "
                             f"put{'' if many else 's'} a view out of range: shrink of dimension {d} to {lo}..{hi}, "
                             f"which holds {size} elements")

class ViewChecks:
    """The checks of a capture's shrinks by bound Variables (`constraints`: (dims, the capture's values) as
    CaptureRecorder keeps them) with a replay's values of the Variables `names` over the capture's: each distinct
    dimension (the layers of a model make the same shrink, each its own constraint) is computed once per call."""
    def __init__(self, constraints: list[tuple[list[tuple], dict[str, int]]], names: frozenset[str]):
        self.constraints, self.names = constraints, names
        distinct: dict[tuple, dict[str, int]] = {}
        for dims, values in constraints:
            for _, b, e, s, dim_names in dims:
                # (a Variable with neither a value of the call nor of the capture: check_view_bounds skips the dim)
                if not dim_names or any(n not in names and n not in values for n in dim_names): continue
                fixed = tuple([(n, values[n]) for n in dim_names if n not in names])
                distinct.setdefault((b, e, s, fixed), dict(fixed))
        self.dims = [(b, e, s, fixed) for (b, e, s, _), fixed in distinct.items()]

    def check(self, var_vals: dict[str, int]) -> None:
        """What `check_view_bounds(dims, {**values, **var_vals})` for every constraint checks (var_vals: a value for
        each of `names`), raising the same error."""
        for b, e, s, fixed in self.dims:
            vv = {**fixed, **var_vals} if fixed else var_vals
            lo, hi, size = (sym_infer(x, vv) for x in (b, e, s))
            if not 0 <= lo <= hi <= size:
                for dims, values in self.constraints: check_view_bounds(dims, {**values, **var_vals})
                raise AssertionError("the bounds of a view differ between two checks of the same values")

def check_shrink(arg: tuple, shape: tuple) -> None:
    """Raise IndexError when the values of the bound Variables in a shrink's bounds (or in the shape it shrinks) put
    it outside a dimension: the view would read other rows' elements while staying inside the buffer. While a TinyJit
    captures, the condition is kept, and each replay checks it with that replay's values before any kernel runs."""
    dims = [(d, b, e, s) for d, ((b, e), s) in enumerate(zip(arg, shape)) if any(is_symbolic(x) for x in (b, e, s))]
    if not dims: return
    binds = {u: u.src[0] for x in arg_uops(tuple(x for dim in dims for x in dim[1:])) for u in x.toposort()
             if u.op is Ops.BIND}
    free = []
    for d, *bes in dims:
        b, e, s = (x.substitute(binds) if isinstance(x, UOp) else x for x in bes)
        # (the names are found once here: a replay checks the same dimensions with each call's values)
        names = sorted({u.arg[0] for x in (b, e, s) if isinstance(x, UOp) for u in x.toposort()
                        if u.op is Ops.DEFINE_VAR})
        free.append((d, b, e, s, names))
    values = var_values(binds)
    check_view_bounds(free, values)
    if _realize.capturing and isinstance(rec := _realize.capturing[0], CaptureRecorder):
        rec.constraints.append((free, values))
