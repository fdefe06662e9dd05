"""TinyJit: capture the kernels a function runs, then replay them on new inputs without building graphs.

Call 1 runs the function as it is (its kernels compile). Call 2 runs it again while `run_schedule` hands every
ExecItem it runs to the JIT. From call 3 on the JIT runs those ExecItems directly: the buffers of this call's input
tensors take the place of the captured inputs' buffers, outputs get fresh buffers (a result the caller kept from an
earlier call is never overwritten), and nothing is traced, scheduled or compiled.

What is baked at capture: Python values the function computes with (as in any trace), the graph's structure and
shapes. What changes per replay: the input tensors' data, bound `Variable` arguments (their values reach the kernels
as var_vals), and the random-number counter (each replay draws new numbers, exactly as eager calls would)."""
from __future__ import annotations
import functools
from typing import Any, Callable, Generic, TypeVar
from fusegrad.device import Buffer
from fusegrad.engine import realize as _realize
from fusegrad.engine.multi import shards_of
from fusegrad.engine.realize import ExecItem
from fusegrad.helpers import getenv, rng_counter_const, rng_counter_of
from fusegrad.uop.ops import Ops, UOp

__all__ = ["TinyJit", "JitError"]

R = TypeVar("R")

class JitError(RuntimeError):
    """A jitted function was called or written in a way its captured kernels can't replay."""

def _flatten(obj: Any) -> tuple[list[Any], Any]:
    """(leaves, structure) of nested tuples/lists/dicts; the structure compares equal for equal nestings."""
    if isinstance(obj, (tuple, list)):
        parts = [_flatten(x) for x in obj]
        return [leaf for p in parts for leaf in p[0]], (type(obj).__name__, tuple(p[1] for p in parts))
    if isinstance(obj, dict):
        keys = sorted(obj, key=repr)
        parts = [_flatten(obj[k]) for k in keys]
        return [leaf for p in parts for leaf in p[0]], ("dict", tuple(keys), tuple(p[1] for p in parts))
    return [obj], "*"

def _unflatten(leaves: list[Any], structure: Any) -> Any:
    it = iter(leaves)
    def build(s: Any) -> Any:
        if s == "*": return next(it)
        if s[0] == "dict": return {k: build(sub) for k, sub in zip(s[1], s[2])}
        vals = [build(sub) for sub in s[1]]
        return tuple(vals) if s[0] == "tuple" else vals
    return build(structure)

class _Recorder:
    """Collects the ExecItems run while a function is captured."""
    def __init__(self) -> None: self.items: list[ExecItem] = []
    def add(self, ei: ExecItem, var_vals: dict[str, int]) -> None: self.items.append(ei)

def _in_buffers(t: Any) -> bool: return all(u.base.op is Ops.BUFFER for u in shards_of(t.uop))

def _base_buffers(t: Any) -> list[Buffer]:
    from fusegrad.schedule.linear import get_buffer
    return [get_buffer(u.base) for u in shards_of(t.uop)]

class TinyJit(Generic[R]):
    """Decorator: `@TinyJit def step(x, y): ...` captures the kernels of `step` and replays them on later calls."""

    def __init__(self, fxn: Callable[..., R] | None = None, captured: Any = None, prune: bool = False,
                 optimize: bool = False):
        if fxn is None and captured is None: raise ValueError("TinyJit needs a function")
        self.fxn, self.prune, self.optimize = fxn, prune, optimize
        self.reset()
        if fxn is not None: functools.update_wrapper(self, fxn)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Forget the capture: the next two calls warm up and capture again."""
        self.cnt = 0
        self.jit_cache: list[ExecItem] = []
        self._bounded: list[ExecItem] = []  # the captured kernels whose memory depends on Variables
        self._launches: tuple[list, list, tuple] | None = None
        self._prepared_work = (0, 0, 0)
        self._in_sig: list[tuple] = []
        self._out_structure: Any = None
        self._out_leaves: list[Any] = []

    @property
    def captured(self) -> list[ExecItem]:
        """The captured ExecItems (kernels and copies), in order."""
        return self.jit_cache

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)  # methods keep their self

    # *** inputs ***

    @staticmethod
    def _inputs(args: tuple, kwargs: dict) -> tuple[list[Any], dict[str, int]]:
        """The input tensors (positional, then keywords by name), realized as buffers, and the bound Variables."""
        from fusegrad.tensor import Tensor
        flat = list(args) + [kwargs[k] for k in sorted(kwargs)]
        tensors, var_vals = [], {}
        for x in flat:
            if isinstance(x, Tensor): tensors.append(x)
            elif isinstance(x, UOp) and x.op is Ops.BIND:
                var, val = x.unbind()
                var_vals[var.arg[0]] = val
        # every input must be a plain buffer: its memory is what the captured kernels read
        pending = [t for t in tensors if any(u.op is not Ops.BUFFER and (u.base.op is not Ops.BUFFER or
                                                                         u.op is not Ops.RESHAPE)
                                             for u in shards_of(t.uop))]
        for t in pending: t.replace(t.contiguous())
        if pending: Tensor.realize(*pending)
        return tensors, var_vals

    @staticmethod
    def _signature(tensors: list[Any]) -> list[tuple]: return [(t.shape, t.dtype, t.device) for t in tensors]

    # *** calls ***

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if getenv("JIT", 1) == 0 or self.fxn is None: return self.fxn(*args, **kwargs)  # type: ignore[misc]
        if _realize.capturing: raise JitError("a TinyJit function was called while another one is being captured")
        from fusegrad.tensor import Tensor
        tensors, var_vals = self._inputs(args, kwargs)
        if self.cnt == 0:
            ret = self._run_plain(args, kwargs)
            self._in_sig, self._out_structure = self._signature(tensors), _flatten(ret)[1]
            self.cnt = 1
            return ret
        self._check_inputs(tensors)
        if self.cnt == 1: return self._capture(args, kwargs, tensors)
        return self._replay(tensors, var_vals, Tensor)

    def _run_plain(self, args: tuple, kwargs: dict) -> Any:
        from fusegrad.tensor import Tensor
        ret = self.fxn(*args, **kwargs)  # type: ignore[misc]
        outs = [x for x in _flatten(ret)[0] if isinstance(x, Tensor)]
        if outs: Tensor.realize(*outs)
        return ret

    def _check_inputs(self, tensors: list[Any]) -> None:
        sig = self._signature(tensors)
        if len(sig) != len(self._in_sig):
            raise JitError(f"TinyJit function was captured with {len(self._in_sig)} tensor arguments, called with "
                           f"{len(sig)}")
        for i, (now, then) in enumerate(zip(sig, self._in_sig)):
            if now != then:
                raise JitError(f"TinyJit input {i} changed from shape {then[0]} {then[1]} on {then[2]} to shape "
                               f"{now[0]} {now[1]} on {now[2]}; the captured kernels only fit the first (reset() or "
                               "a new TinyJit for other shapes)")

    def _capture(self, args: tuple, kwargs: dict, tensors: list[Any]) -> Any:
        from fusegrad.schedule.linear import buffer_map
        from fusegrad.tensor import Tensor
        before = {id(b) for b in buffer_map.values()}
        rng_before = Tensor._rng_counter
        rec = _Recorder()
        _realize.capturing.append(rec)
        try: ret = self._run_plain(args, kwargs)
        finally: _realize.capturing.remove(rec)
        leaves, structure = _flatten(ret)
        if structure != self._out_structure:
            raise JitError(f"TinyJit function returned {structure} on its first call but {self._out_structure} on its "
                           "second: it must return the same structure (of tensors and constants) on every call")
        self.jit_cache = rec.items
        self._bounded = [ei for ei in rec.items if ei.prg is not None and ei.prg.bounds is not None]
        self._inputs_at_capture = [b for t in tensors for b in _base_buffers(t)]
        # outputs computed during the capture get fresh buffers on each replay; outputs that existed before (state
        # the function updates in place, or an input handed back) are returned as they are
        self._out_leaves = leaves
        self._fresh = {}
        for x in leaves:
            if isinstance(x, Tensor) and _in_buffers(x):
                for b in _base_buffers(x):
                    if id(b) not in before and all(b is not i for i in self._inputs_at_capture): self._fresh[id(b)] = b
        # random calls made inside the function: each replay advances the generator by as many calls
        self._rng_calls = Tensor._rng_counter - rng_before
        self._rng_first = rng_before
        self.cnt = 2
        return ret

    def _replay(self, tensors: list[Any], var_vals: dict[str, int], Tensor: Any) -> Any:
        from fusegrad.schedule.kernelize import new_buffer
        from fusegrad.schedule.linear import buffer_map
        now = [b for t in tensors for b in _base_buffers(t)]
        subst: dict[int, Buffer] = {id(old): b for old, b in zip(self._inputs_at_capture, now)}
        # fresh output buffers, as BUFFER nodes so the returned tensors own them
        new_nodes: dict[int, UOp] = {}
        for bid, b in self._fresh.items():
            node = new_buffer(UOp(Ops.DEVICE, arg=b.device), b.size, b.dtype)
            nb = buffer_map[node] = Buffer(b.device, b.size, b.dtype)
            subst[bid], new_nodes[bid] = nb, node
        # the Variables' values are checked against every kernel's buffers before any kernel runs
        for ei in self._bounded:
            ei.prg.bounds.check([subst.get(id(b), b) for b in ei.bufs],  # type: ignore[union-attr]
                                {**var_vals, **ei.fixedvars} if ei.fixedvars else var_vals)
        rng_shift = Tensor._rng_counter - self._rng_first
        # (DEBUG=2 times each kernel: every one takes the plain path)
        prepared = _realize.DEBUG < 2
        launches = self._prepared_launches() if prepared else [None] * len(self.jit_cache)
        for ei, prepared_launch in zip(self.jit_cache, launches):
            if prepared_launch is not None:
                launch, order = prepared_launch
                launch(*[subst[id(ei.bufs[i])].ensure_allocated()._buf for i in order])  # type: ignore[union-attr]
                continue
            bufs = [subst.get(id(b), b) if b is not None else None for b in ei.bufs]
            fixed = ei.fixedvars
            if self._rng_calls and rng_shift and fixed: fixed = self._shift_rng(fixed, rng_shift)
            ExecItem(ei.ast, bufs, ei.metadata, fixed, ei.prg).run(var_vals)
        if prepared:
            ops, mem, count = self._prepared_work
            _realize.GlobalCounters.global_ops += ops
            _realize.GlobalCounters.global_mem += mem
            _realize.GlobalCounters.kernel_count += count
        Tensor._rng_counter += self._rng_calls
        return _unflatten([self._output(x, new_nodes, Tensor) for x in self._out_leaves], self._out_structure)

    def _prepared_launches(self) -> list[tuple[Callable[..., None], tuple[int, ...]] | None]:
        """Per captured kernel that every replay runs with the same values (no Variable, no random counter), its launch
        prepared once with its arguments converted (see CompiledRunner.prepare); the input and fresh output buffers
        are passed to it per replay. (Made on the first replay; made again if another buffer's memory changed.)"""
        cached, knobs = self._launches, _realize.launch_knob_values()
        if cached is not None and cached[2] == knobs and \
                all(b.__dict__.get("_buf") is opaque for b, opaque in cached[1]): return cached[0]
        varying_ids = {id(b) for b in self._inputs_at_capture} | set(self._fresh)
        launches: list[tuple[Callable[..., None], tuple[int, ...]] | None] = []
        memory: list[tuple[Buffer, Any]] = []
        ops = mem = count = 0
        for ei in self.jit_cache:
            launch = None
            if all(b is not None and b.is_allocated() for b in ei.bufs) and not (self._rng_calls and ei.fixedvars):
                launch = ei.prepared(tuple(i for i, b in enumerate(ei.bufs) if id(b) in varying_ids))
            if launch is not None:
                memory += [(b, b._buf) for b in ei.bufs if id(b) not in varying_ids]  # type: ignore[union-attr]
                work = ei.prg._work(ei.fixedvars)  # type: ignore[union-attr]
                ops, mem, count = ops + work[0], mem + work[1], count + 1
            launches.append(launch)
        self._launches = (launches, memory, knobs)
        self._prepared_work = (ops, mem, count)
        return launches

    def _shift_rng(self, fixed: dict[str, Any], shift: int) -> dict[str, Any]:
        """The kernel parameters with each random counter of the capture moved on by `shift` calls."""
        lo, hi = self._rng_first, self._rng_first + self._rng_calls
        out = {}
        for k, v in fixed.items():
            c = rng_counter_of(v)
            out[k] = rng_counter_const(c + shift) if c is not None and lo <= c < hi else v
        return out

    def _output(self, x: Any, new_nodes: dict[int, UOp], Tensor: Any) -> Any:
        if not isinstance(x, Tensor) or not _in_buffers(x): return x
        swap = {u.base: new_nodes[id(b)] for u, b in zip(shards_of(x.uop), _base_buffers(x)) if id(b) in new_nodes}
        return Tensor(x.uop.substitute(swap)) if swap else x
