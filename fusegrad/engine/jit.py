"""TinyJit: capture the kernels a function runs, then replay them on new inputs without building graphs.

Call 1 runs the function as it is (its kernels compile). Call 2 runs it again while `run_schedule` hands every
ExecItem it runs to the JIT. From call 3 on the JIT runs those ExecItems directly: the buffers of this call's input
tensors take the place of the captured inputs' buffers, outputs get fresh buffers (a result the caller kept from an
earlier call is never overwritten), and nothing is traced, scheduled or compiled.

What is baked at capture: Python values the function computes with (as in any trace), the graph's structure and
shapes. What changes per replay: the input tensors' data, the values of bound `Variable`s (arguments, or in the shapes
of input views), and the random-number counter (each replay draws new numbers, exactly as eager calls would)."""
from __future__ import annotations
import functools
import numbers
from itertools import repeat
import weakref
from sys import getrefcount
from typing import Any, Callable, Generic, TypeVar
from fusegrad.device import Buffer, Device, unwritten_buffers
from fusegrad.engine import realize as _realize
from fusegrad.engine.capture import CaptureRecorder, JitError, ViewChecks, check_view_bounds, running_jits, \
    snapshot_nodes
from fusegrad.engine.realize import BoundsCheck, BufferCopy, CompiledRunner, ExecItem
from fusegrad.engine import jit_verify as _verify
from fusegrad.engine.jit_verify import JIT_VERIFY
from fusegrad.helpers import JIT, rng_counter_const, rng_counter_of
from fusegrad.schedule.multi import shards_of
from fusegrad.tensor import Tensor, lazy_tensors
from fusegrad.uop.graph import bound_variables, buffer_stand_in, new_buffer, substitute_map, var_values
from fusegrad.uop.ops import GroupOp, Ops, UOp, _arg_key, buffer_map, device_buffer
from fusegrad.viz import record as _viz

__all__ = ["TinyJit", "JitError"]

R = TypeVar("R")

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
    # (the common results without the recursion: one tensor, or a flat tuple or list of them)
    if structure == "*": return leaves[0]
    if structure[0] != "dict" and all(sub == "*" for sub in structure[1]):
        return tuple(leaves) if structure[0] == "tuple" else leaves
    it = iter(leaves)
    def build(s: Any) -> Any:
        if s == "*": return next(it)
        if s[0] == "dict": return {k: build(sub) for k, sub in zip(s[1], s[2])}
        vals = [build(sub) for sub in s[1]]
        return tuple(vals) if s[0] == "tuple" else vals
    return build(structure)

def _rebound(arg: Any, var_vals: dict[str, int]) -> Any:
    """`arg` (a view's shape or bounds: UOps inside tuples) with every bound Variable of `var_vals` bound to its value
    there; the same object where nothing changes."""
    if isinstance(arg, tuple):
        new = tuple(_rebound(a, var_vals) for a in arg)
        return arg if all(a is b for a, b in zip(new, arg)) else new
    if isinstance(arg, UOp):
        binds = {u: u.src[0].bind(var_vals[u.src[0].arg[0]]) for u in arg.toposort()
                 if u.op is Ops.BIND and u.src[0].arg[0] in var_vals and u.src[1].arg != var_vals[u.src[0].arg[0]]}
        return arg.substitute(binds) if binds else arg
    return arg

def _rebound_graph(root: UOp, var_vals: dict[str, int]) -> UOp:
    """`root` with _rebound applied to the args of its nodes (and to the BIND nodes themselves)."""
    memo: dict[UOp, UOp] = {}
    for u in root.toposort():
        src = tuple(memo[x] for x in u.src)
        arg = _rebound(u.arg, var_vals)
        if u.op is Ops.BIND and u.src[0].arg[0] in var_vals: memo[u] = _rebound(u, var_vals); continue
        memo[u] = u if arg is u.arg and all(a is b for a, b in zip(src, u.src)) else u.replace(src=src, arg=arg)
    return memo[root]

def _in_buffers(t: Any) -> bool: return all(u.base.op is Ops.BUFFER for u in shards_of(t.uop))

def _base_buffers(t: Any) -> list[Buffer]:
    return [device_buffer(u.base) for u in shards_of(t.uop)]

# *** bound Variables in views: each value is checked against the dimension it shrinks ***

# *** arguments ***

def _leaves(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) of every argument, those inside tuples, lists and dicts included (positional, then keywords by
    name)."""
    out: list[tuple[str, Any]] = []
    def walk(name: str, x: Any) -> None:
        if isinstance(x, (tuple, list)):
            for i, y in enumerate(x): walk(f"{name}[{i}]", y)
        elif isinstance(x, dict):
            for k in sorted(x, key=repr): walk(f"{name}[{k!r}]", x[k])
        else: out.append((name, x))
    for i, a in enumerate(args): walk(f"argument {i}", a)
    for k in sorted(kwargs): walk(f"argument {k!r}", kwargs[k])
    return out

@functools.cache
def _arg_names(n: int) -> tuple[str, ...]:
    """The names _leaves gives n positional arguments that are not nested."""
    return tuple(f"argument {i}" for i in range(n))

def _value_key(x: Any) -> tuple[Any, str | UOp]:
    """What must stay the same in a non-Tensor argument for the captured kernels to fit, and how to name it: numbers
    and strings by value, a bound Variable by its Variable (its value is passed), any other object by identity. (A
    UOp is named by itself: its text, made only for an error, costs more than the rest of a replay's checks.)"""
    if isinstance(x, UOp): return (("variable", x.src[0]) if x.op is Ops.BIND else ("uop", x)), x
    if x is None or isinstance(x, (numbers.Number, str, bytes)): return (type(x).__name__, repr(x)), repr(x)[:80]
    return ("object", type(x).__qualname__, id(x)), f"a {type(x).__qualname__} object at {id(x):#x}"

class _Inputs:
    """One call's arguments as the JIT sees them: the input tensors (realized), their signatures, the values of the
    bound Variables in their views and in the arguments, and the keys of the other arguments."""
    def __init__(self, args: tuple, kwargs: dict):
        if not kwargs and self._plain(args): return
        leaves = _leaves(args, kwargs)
        self.structure = tuple([n for n, _ in leaves])  # (the names are the paths into the nesting)
        self.tensors: list[tuple[str, Any]] = []
        self.values: list[tuple[str, Any, str | UOp]] = []
        binds: dict[UOp, UOp] = {}
        for n, x in leaves:
            if isinstance(x, Tensor): self.tensors.append((n, x))
            else:
                self.values.append((n, *_value_key(x)))
                if isinstance(x, UOp) and x.op is Ops.BIND: binds[x] = x.src[0]
        if any(u.base.op is not Ops.BUFFER for _, t in self.tensors for u in shards_of(t.uop)):
            self._realize_lazy(Tensor)
        self.buffers: list[Buffer] = []
        self.sig: list[tuple] = []
        owner: dict[int, str] = {}
        for n, t in self.tensors:
            views: list[Any] = []
            for u in shards_of(t.uop):
                b = device_buffer(u.base)
                if id(b) in owner:
                    raise JitError(f"TinyJit {owner[id(b)]} and {n} are the same tensor (or views of one buffer): the "
                                   "captured kernels would take one buffer for both; pass a copy (clone()) as one of "
                                   "them")
                owner[id(b)] = n
                self.buffers.append(b)
                # (a buffer or a reshape of one, the common input, is told by its sizes alone)
                if u.op is Ops.BUFFER: views.append(u.arg[1])
                elif u.op is Ops.RESHAPE and u.src[0].op is Ops.BUFFER and all(type(x) is int for x in u.arg):
                    views.append((u.src[0].arg[1], u.arg))
                else: views.append(self._view(u, binds))
            shape = views[0].shape if len(views) == 1 and isinstance(views[0], UOp) else t.shape
            self.sig.append((n, shape, t.dtype, t.device, tuple(views)))
        if binds:
            self.var_vals = var_values(binds)
        else: self.var_vals = {}

    def _plain(self, args: tuple) -> bool:
        """The common call, made without the general walk: positional arguments that are tensors, each a buffer or a
        reshape of one (with integer sizes) on one device, or bound Variables (a decoder's position). Sets what
        __init__ sets, the same values; False (nothing set) for any other call."""
        views, buffers, tensors, values, binds = [], [], [], [], {}
        names = _arg_names(len(args))
        for n, t in zip(names, args):
            if type(t) is UOp and t.op is Ops.BIND:
                values.append((n, ("variable", t.src[0]), t))
                binds[t] = t.src[0]
                continue
            if not isinstance(t, Tensor): return False
            tensors.append((n, t))
            u = t.uop
            if u.op is Ops.BUFFER: views.append(u.arg[1])
            elif u.op is Ops.RESHAPE and u.src[0].op is Ops.BUFFER and all(type(x) is int for x in u.arg):
                views.append((u.src[0].arg[1], u.arg))
            else: return False
            buffers.append(device_buffer(u))
        if len({id(b) for b in buffers}) != len(buffers): return False   # (the general path names the two)
        self.structure, self.values, self.buffers, self.tensors = names, values, buffers, tensors
        self.var_vals = var_values(binds) if binds else {}
        self.sig = [(n, t.shape, t.dtype, t.device, (v,)) for (n, t), v in zip(tensors, views)]
        return True

    @staticmethod
    def _view(u: UOp, binds: dict[UOp, UOp]) -> UOp:
        """The view `u` makes of its buffer, over a stand-in for the buffer and with its bound Variables unbound (the
        BINDs go to `binds`)."""
        found = bound_variables(u.toposort())
        binds.update(found)
        return substitute_map(u, {u.base: buffer_stand_in(0, u.base), **found}, in_args=True)[u]

    def _realize_lazy(self, Tensor: Any) -> None:
        """Inputs that are computations are computed now, as a call without the JIT would; views keep viewing their
        buffer (a view of a computation has that computation realized). A constant has no buffer to pass."""
        whole, bases = [], {}
        for n, t in self.tensors:
            shards = shards_of(t.uop)
            if any(u.base.op is Ops.CONST for u in shards):
                raise JitError(f"TinyJit {n} is a constant (no buffer holds it); inputs must be real buffers: pass "
                               "a realized copy (x.contiguous().realize()) or make it a constant inside the function")
            if all(u.base.op is Ops.BUFFER for u in shards): continue
            if t.uop.op is Ops.MULTI or t.uop.op not in GroupOp.Movement:
                if t.uop.op is Ops.MULTI: t.replace(t.contiguous())
                whole.append(t)
            else: bases[t.uop.base] = None
        if whole or bases:
            computed = [Tensor(b) for b in bases]
            Tensor.realize(*whole, *computed)
            done = {b: c.uop for b, c in zip(bases, computed)}
            for _, t in self.tensors:
                if t.uop.op in GroupOp.Movement and (base := t.uop.base) in done: t.uop = t.uop.substitute(
                    {base: done[base]})

class _Same:
    """The inputs of a call whose arguments are those of the last checked one (TinyJit._same_inputs)."""
    __slots__ = ("buffers", "var_vals")
    def __init__(self, buffers: list[Buffer]): self.buffers, self.var_vals = buffers, {}

class _KeptReplay:
    """What TinyJit.replay_kept runs: the launches with their arguments bound, valid while the plan they come from
    is (the same launch knobs, the same memory of every buffer they take, the inputs' included)."""
    __slots__ = ("same", "launches", "knobs", "dicts", "opaques", "calls", "subst", "outputs", "slots", "joins",
                 "devices")
    def __init__(self, same: Any, launches: Any, dicts: list, opaques: list, calls: list, subst: dict[int, Buffer],
                 outputs: list[Buffer], slots: list[list[tuple[int, int]] | None]):
        self.same, self.launches, self.dicts, self.opaques = same, launches, dicts, opaques
        self.knobs = [k.value for k in _realize.LAUNCH_KNOBS]
        self.calls, self.subst, self.outputs = calls, subst, outputs
        # per input: (call, position in its allocations) of each place a launch takes the input's memory; None for
        # an input that may not be read from other memory (reads_in_place)
        self.slots = slots
        # whether the last call is a launch graph that waits for its kernels itself (the CPU's: its calling thread
        # runs their chunks as soon as they are queued); else a waiting replay synchronizes `devices` after
        self.joins = bool(calls) and getattr(calls[-1][0], "waits", False)
        self.devices = sorted({b.device for b in subst.values()})

    def with_inputs(self, inputs: list[Any]) -> list[tuple[Any, tuple]]:
        """The calls with the allocation `inputs[k]` in place of input k's memory (where it is not None)."""
        if len(inputs) != len(self.slots): raise ValueError(f"replay_kept takes {len(self.slots)} inputs in place")
        calls = list(self.calls)
        for slots, a in zip(self.slots, inputs):
            if a is None: continue
            if slots is None: raise ValueError("replay_kept: an input given in place that reads_in_place doesn't allow")
            for ci, pos in slots:
                fn, fn_args = calls[ci]
                if isinstance(fn_args[0], list):   # (a graph's: one list of allocations)
                    allocations = list(fn_args[0])
                    allocations[pos] = a
                    calls[ci] = (fn, (allocations,))
                else: calls[ci] = (fn, fn_args[:pos] + (a,) + fn_args[pos + 1:])
        return calls

    def valid(self, launches: Any) -> bool:
        # (== of the lists compares the allocations by identity, in C: they define no __eq__)
        return launches is self.launches and [k.value for k in _realize.LAUNCH_KNOBS] == self.knobs and \
            list(map(dict.get, self.dicts, repeat("_buf"))) == self.opaques

def _without_unread_snapshots(items: list[ExecItem]) -> list[ExecItem]:
    """The captured items without the copies taken for lazy readers of overwritten buffers (capture.snapshot_nodes)
    that no later item reads: only the capture call's readers read them."""
    snaps = {id(b) for n in list(snapshot_nodes) if (b := n.__dict__.get("_buffer")) is not None}
    if not snaps: return items
    kept: list[ExecItem] = []
    for i, ei in enumerate(items):
        dest = ei.bufs[0]
        if isinstance(ei.prg, BufferCopy) and dest is not None and id(dest) in snaps and \
                not any(b is dest for later in items[i + 1:] for b in later.bufs): continue
        kept.append(ei)
    return kept

# the sets of Variable values a TinyJit keeps checked (with their launch values) before it forgets them all: bounded
# for a long run of ever new values; a decoder of 1024 positions keeps all of its own
VALUES_KEPT = 1024

def _writes(t: Tensor) -> bool:
    """Whether the lazy tensor `t` writes to memory in place (its graph has an ASSIGN not run yet)."""
    return any(u.base.op is not Ops.BUFFER and any(x.op is Ops.ASSIGN for x in u.toposort()) for u in shards_of(t.uop))

def _reads_memory(u: UOp) -> bool:
    """Whether the graph `u` reads a buffer."""
    return any(x.op is Ops.BUFFER for x in u.toposort())

class TinyJit(Generic[R]):
    """Decorator: `@TinyJit def step(x, y): ...` captures the kernels of `step` and replays them on later calls.

    Inputs are the Tensor arguments, also inside tuples, lists and dicts; a computed (lazy) input is realized before
    the call, a view of a buffer stays a view (a slice bounded by a bound Variable replays with each call's value).
    `Context(JIT=0)` (or the environment's JIT=0) runs the function itself on every call.

    Errors (JitError) for what a replay could not honour: a shape, dtype, device or view of an input that differs from
    the capture's, one tensor passed as two arguments, a constant input, a non-Tensor argument (a number, a string,
    any other object) that differs from the first call's, a function that runs no kernels, returns one of its inputs,
    reads tensor data while captured, or calls another TinyJit.

    What no check can see: Python the function runs is frozen at the capture. A global, an attribute or a closure
    variable read inside (a learning rate in a Python float, `if step > 100:`) keeps its value of the capture call;
    so do tensors the function creates from Python data (`Tensor(np_array)` inside). Pass such values as Tensors (or
    bound Variables), or call reset() to capture again."""

    def __init__(self, fxn: Callable[..., R] | None = None, captured: Any = None, prune: bool = False,
                 optimize: bool = False, verify: int | None = None):
        if fxn is None and captured is None: raise ValueError("TinyJit needs a function")
        if verify is not None and (not isinstance(verify, int) or verify < 0):
            raise ValueError(f"TinyJit verify must be a number of calls >= 0, got {verify!r}")
        self.fxn, self.prune, self.optimize = fxn, prune, optimize
        # every verify-th replay (and the first) also runs the function eagerly and compares (see _verified_replay)
        self.verify = verify
        self.reset()
        if fxn is not None: functools.update_wrapper(self, fxn)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Forget the capture: the next two calls warm up and capture again."""
        self.cnt = 0
        self.jit_cache: list[ExecItem] = []
        self._bounded: list[ExecItem] = []  # the captured kernels whose memory depends on Variables
        self._constraints: list[tuple[tuple, dict[str, int]]] = []  # shrinks by Variables made inside the function
        self._launches: tuple[list, tuple[list, list], list] | None = None
        self._fresh_devices: dict[int, UOp] = {}
        self._out_chains: list[Any] = []
        self._prepared_work = (0, 0, 0)
        self._dynamic: list[list[Any]] = []   # [item, launch, its last launch_args] of the kernels with Variables
        # per kernel of _dynamic, the index of the first one with its program and fixed parameters (which gets the
        # same launch_args for the same values), and those first ones
        self._dynamic_groups: list[int] = []
        self._group_items: list[ExecItem] = []
        # the checks of a replay's values (_checked): (names of the Variables, ViewChecks, BoundsCheck, input sizes)
        self._checks: tuple[frozenset[str], ViewChecks, BoundsCheck, list[int]] | None = None
        # the values (by _values_key) checked already, each with what _launch_values gave for them (None until asked)
        self._values_seen: dict[tuple, Any] = {}
        # the values the prepared launches hold (None: unknown) and the work of the kernels with Variables under them
        self._values_set: tuple | None = None
        self._values_work = (0, 0)
        self._first: _Inputs | None = None
        self._out_structure: Any = None
        self._out_leaves: list[Any] = []
        self._replays = 0
        self._state_ids: set[int] = set()
        self._external: list[tuple[Buffer, Any]] = []
        # per fresh output buffer: the BUFFER node, Buffer and its allocator that the last replay returned (_replay)
        self._last_outputs: dict[int, tuple[UOp, Buffer, Any]] = {}
        self._same: tuple[list[weakref.ref], list[weakref.ref]] | None = None
        self._kept: _KeptReplay | None = None
        self._in_place: tuple[list, list[bool]] | None = None   # (reads_in_place, for the jit_cache it was found of)

    @property
    def captured(self) -> list[ExecItem]:
        """The captured ExecItems (kernels and copies), in order."""
        return self.jit_cache

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)  # methods keep their self

    # *** calls ***

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        if not JIT.value or self.fxn is None: return self.fxn(*args, **kwargs)  # type: ignore[misc]
        if _realize.capturing or running_jits:
            raise JitError("having TinyJit inside another TinyJit is not supported: the outer one captures the inner "
                           "one's kernels itself; call the inner function undecorated")
        inputs = self._same_inputs(args) if self._same is not None and not kwargs else None
        if inputs is None:
            inputs = _Inputs(args, kwargs)
            if self.cnt == 0:
                ret = self._run_plain(args, kwargs)
                self._first, self._out_structure = inputs, _flatten(ret)[1]
                self.cnt = 1
                return ret
            self._check_inputs(inputs)
            if self.cnt == 1: return self._capture(args, kwargs, inputs) if not _viz.PROFILE else \
                _viz.profiled("TinyJit capture", self._capture, args, kwargs, inputs)
            self._remember(args, inputs)
        self._replays += 1
        every = self.verify if self.verify is not None else int(JIT_VERIFY.value)
        if every and (self._replays == 1 or self._replays % every == 0):
            return _verify.verified_replay(self, inputs, args, kwargs, Tensor)
        return self._replay(inputs, Tensor) if not _viz.PROFILE else \
            _viz.profiled("TinyJit replay", self._replay, inputs, Tensor)

    def replay_kept(self, *args: Any, wait: bool = False, inputs: list[Any] | None = None) -> list[Buffer] | None:
        """A replay for a caller that wants the outputs' contents, not tensors: the kernels write into output memory
        this TinyJit keeps (the same Buffers on every such call, so each call overwrites the last one's results) and
        the Buffers are returned, one per returned tensor in flattened order. Each argument must be the same tensor
        (the same node) as in the last call that checked its inputs, so nothing is checked again.

        `wait`: return once the kernels have run (on the CPU the calling thread runs their chunks from the moment
        they are queued). `inputs` (only with `wait`): per argument, None or an allocation of its device (a CPU
        allocation: a ctypes array, which may be of the caller's own memory) of the argument's size that this call's
        kernels read in place of the argument's memory, for an argument `reads_in_place` allows. The caller's memory
        is read only while this call runs: it has finished when the call returns.

        None, with nothing run, where the call needs `__call__` instead: before the capture, for other arguments,
        for returned tensors that are views other than reshapes of a fresh buffer or values other than tensors, for
        captures with Variables or random numbers, a replay due to be verified (verify / JIT_VERIFY), and under
        DEBUG>=2 or the viz recorder's timing."""
        if not JIT.value or self.cnt < 2 or self._same is None or _realize.capturing or running_jits: return None
        every = self.verify if self.verify is not None else int(JIT_VERIFY.value)
        n = self._replays + 1
        if every and (n == 1 or n % every == 0): return None
        if _realize.DEBUG.value >= 2 or _viz.TIMED or _viz.PROFILE: return None
        if unwritten_buffers: return None   # (__call__ checks the inputs are written)
        kept = self._kept
        if kept is None or kept.same is not self._same or not kept.valid(self._launches):
            kept = self._kept = self._kept_replay()
            if kept is None: return None
        uops = kept.same[0]
        if len(args) != len(uops): return None
        for a, r in zip(args, uops):
            if type(a) is not Tensor or a._uop is not r(): return None
        calls = kept.calls
        if inputs is not None:
            if not wait: raise ValueError("replay_kept reads inputs in place only with wait=True")
            calls = kept.with_inputs(inputs)
        self._replays = n
        if self._constraints:
            for dims, values in self._constraints: check_view_bounds(dims, values)
        if self._bounded: _realize.check_bounds(self._bounded, {}, kept.subst)
        if wait and kept.joins:
            for fn, fn_args in calls[:-1]: fn(*fn_args)
            fn, fn_args = calls[-1]
            fn(*fn_args, wait=True)
        else:
            for fn, fn_args in calls: fn(*fn_args)
            if wait:
                for d in kept.devices: Device[d].synchronize()
        ops, mem, count = self._prepared_work
        _realize.GlobalCounters.global_ops += ops
        _realize.GlobalCounters.global_mem += mem
        _realize.GlobalCounters.kernel_count += count
        return kept.outputs

    def _kept_replay(self) -> _KeptReplay | None:
        """The launches of replay_kept with every argument bound (the inputs of the last checked call, output memory
        of its own), or None where it doesn't apply."""
        assert self._same is not None
        if self._rng_calls or any(c is None or any(op is not Ops.RESHAPE for op, _, _ in c[1])
                                  for c in self._out_chains): return None
        inputs = [r() for r in self._same[1]]
        if any(b is None or not b.is_allocated() for b in inputs): return None
        plan = self._prepared_plan({})
        if self._dynamic or any(step is None for _, step in plan): return None
        subst: dict[int, Buffer] = {id(old): b for old, b in zip(self._inputs_at_capture, inputs)}  # type: ignore[misc]
        for bid, b in self._fresh.items(): subst[bid] = Buffer(b.device, b.size, b.dtype).ensure_allocated()
        calls: list[tuple[Any, tuple]] = []
        for ei, step in plan:
            if ei is None:
                graph, ids = step
                calls.append((graph, ([subst[bid]._buf for bid in ids],)))  # type: ignore[union-attr]
            else:
                launch, order = step
                calls.append((launch, tuple(subst[id(ei.bufs[i])]._buf for i in order)))  # type: ignore[union-attr]
        assert self._launches is not None
        dicts, opaques = self._launches[1]
        dicts = dicts + [b.__dict__ for b in inputs]  # type: ignore[union-attr]
        opaques = opaques + [b._buf for b in inputs]  # type: ignore[union-attr]
        outputs = [subst[c[0]] for c in self._out_chains]  # type: ignore[index]
        # where each input's allocation goes in the calls (an input passed twice is substituted at both)
        slots: list[list[tuple[int, int]] | None] = []
        for b, ok in zip(inputs, self.reads_in_place()):
            opaque = b._buf  # type: ignore[union-attr]
            slots.append([(ci, pos) for ci, (_, fn_args) in enumerate(calls)
                          for pos, a in enumerate(fn_args[0] if isinstance(fn_args[0], list) else fn_args)
                          if a is opaque] if ok else None)
        return _KeptReplay(self._same, self._launches, dicts, opaques, calls, subst, outputs, slots)

    def reads_in_place(self) -> list[bool]:
        """Per input of the capture (in argument order): whether replay_kept may read it from other memory (`inputs`):
        it is a buffer of its own (not a view), and no captured item writes it or takes a view of it (those would
        still use the argument's memory)."""
        if self._in_place is not None and self._in_place[0] is self.jit_cache: return self._in_place[1]
        inputs = self._inputs_at_capture
        ids = {id(b) for b in inputs}
        bad: set[int] = set()
        for ei in self.jit_cache:
            prg = ei.prg
            written = prg.p.outs if isinstance(prg, CompiledRunner) else (0,) if isinstance(prg, BufferCopy) else \
                range(len(ei.bufs))
            for k, b in enumerate(ei.bufs):
                if b is None: continue
                if k in written: bad.add(id(b.base))
                elif id(b) not in ids: bad.add(id(b.base))   # (a view: of an input's memory, maybe)
        ok = [b is not None and b._base is None and id(b) not in bad for b in inputs]
        self._in_place = (self.jit_cache, ok)
        return ok

    def _remember(self, args: tuple, inputs: _Inputs) -> None:
        """Keep (weakly) the nodes of checked plain positional arguments and their buffers: a next call with the same
        nodes (the same tensors, or others of the same realized value) needs no check again."""
        plain = not inputs.var_vals and len(inputs.tensors) == len(args) == len(inputs.buffers) and \
            all(type(t) is Tensor for t in args)
        self._same = ([weakref.ref(t._uop) for t in args], [weakref.ref(b) for b in inputs.buffers]) if plain else None

    def _same_inputs(self, args: tuple) -> _Same | None:
        """This call's inputs without a check, if they are the nodes of the last checked call (see _remember)."""
        uops, bufs = self._same  # type: ignore[misc]
        if len(args) != len(uops): return None
        for a, r in zip(args, uops):
            if type(a) is not Tensor or a._uop is not r(): return None
        buffers = [r() for r in bufs]
        return None if None in buffers else _Same(buffers)

    def _run_plain(self, args: tuple, kwargs: dict) -> Any:
        running_jits.append(self)
        lazy_before = {id(t): t.uop for t in lazy_tensors()}
        try:
            ret = self.fxn(*args, **kwargs)  # type: ignore[misc]
            outs = [x for x in _flatten(ret)[0] if isinstance(x, Tensor)]
            # in-place writes the function left lazy (an assign it doesn't realize) are done with its outputs: a replay
            # runs what the capture ran, so one done later, where the tensor is read, would run once and then never
            writes = [t for t in lazy_tensors() if lazy_before.get(id(t)) is not t.uop and _writes(t)]
            if outs or writes: Tensor.realize(*outs, *writes)
        finally: running_jits.remove(self)
        return ret

    def _check_inputs(self, now: _Inputs) -> None:
        then = self._first
        assert then is not None
        if len(now.sig) != len(then.sig):
            raise JitError(f"TinyJit function was captured with {len(then.sig)} tensor arguments, called with "
                           f"{len(now.sig)}")
        for a, b in zip(now.sig, then.sig):
            if a[:4] != b[:4]:
                raise JitError(f"TinyJit input {a[0]} changed from shape {b[1]} {b[2]} on {b[3]} to shape "
                               f"{a[1]} {a[2]} on {a[3]}; the captured kernels only fit the first (reset() or "
                               "a new TinyJit for other shapes)")
            if a[4] != b[4]:
                raise JitError(f"TinyJit input {a[0]} is another view of its buffer than at the capture (a slice, "
                               "permute or reshape that differs): the captured kernels read it through the first one")
        if now.structure != then.structure:
            raise JitError("TinyJit arguments are nested differently than on the first call (another length of a "
                           "list or tuple, other dict keys)")
        for (name, key, text), (_, key0, text0) in zip(now.values, then.values):
            if key != key0:
                text0, text = (repr(t)[:80] if isinstance(t, UOp) else t for t in (text0, text))
                raise JitError(f"TinyJit {name} changed from {text0} to {text} since the first call: a non-Tensor "
                               "argument is frozen into the captured kernels; pass a Tensor (or a bound Variable for "
                               "an integer), or reset() to capture again")

    def _capture(self, args: tuple, kwargs: dict, inputs: _Inputs) -> Any:
        # (weak references, not ids alone: a buffer alive now may die during the call, and a buffer made in the call
        # may then get its id)
        before = {id(b): weakref.ref(b) for b in buffer_map.values()}
        def existed(b: Buffer) -> bool: return (r := before.get(id(b))) is not None and r() is b
        # lazy work from before the call (an assign the caller left lazy, a value reading state the function
        # overwrites) is done now, outside the capture: inside it, where a write of the function to a buffer such work
        # reads forces it first, it would be captured, and every replay would compute it again into that tensor's
        # buffer. Only those that read memory: a value computed from constants alone (an arange, a lazy random draw)
        # reads no buffer the function could overwrite, and may never be needed (or be larger than memory, as a lazy
        # view may). One at a time, as they were made: two of them may bind one Variable to two values
        for t in lazy_tensors():
            if any(u.base.op not in (Ops.BUFFER, Ops.CONST) and _reads_memory(u) for u in shards_of(t.uop)): t.realize()
        rng_before = Tensor._rng_counter
        rec = CaptureRecorder()
        _realize.capturing.append(rec)
        try: ret = self._run_plain(args, kwargs)
        finally: _realize.capturing.remove(rec)
        leaves, structure = _flatten(ret)
        if structure != self._out_structure:
            raise JitError(f"TinyJit function returned {structure} on its first call but {self._out_structure} on its "
                           "second: it must return the same structure (of tensors and constants) on every call")
        if not rec.items:
            raise JitError("TinyJit function ran no kernels while it was captured, so there is nothing to replay "
                           "(its results were all computed before the call, or are its inputs): call it undecorated")
        # (the buffers the inputs had before the call: an input the function assigned to without realizing it is an
        # ASSIGN now, no buffer)
        owner = {id(b): n for b, n in zip(inputs.buffers, [s[0] for s in inputs.sig for _ in s[4]])}
        for x in leaves:
            if isinstance(x, Tensor) and _in_buffers(x) and (hit := [owner[id(b)] for b in _base_buffers(x)
                                                                     if id(b) in owner]):
                raise JitError(f"TinyJit function returns its input {hit[0]} (or a view of it): a replay would hand "
                               "back the capture call's tensor, not this call's; return a copy (x.clone()) or "
                               "use the argument itself")
        self.jit_cache = _without_unread_snapshots(rec.items)
        self._bounded = [ei for ei in self.jit_cache if ei.prg is not None and ei.prg.bounds is not None]
        self._constraints = rec.constraints
        self._inputs_at_capture = inputs.buffers
        # outputs computed during the capture get fresh buffers on each replay; outputs that existed before (state
        # the function updates in place) are returned as they are
        self._out_leaves = leaves
        self._fresh = {}
        for x in leaves:
            if isinstance(x, Tensor) and _in_buffers(x):
                for b in _base_buffers(x):
                    if not existed(b): self._fresh[id(b)] = b
        self._fresh_devices = {bid: UOp(Ops.DEVICE, arg=b.device) for bid, b in self._fresh.items()}
        # an output made from host data inside the function (a Tensor of a NumPy array) is written by no captured
        # kernel: each replay copies the value the capture made into its fresh buffer (frozen at capture, as every
        # Python value the function reads), where a replay returned whatever memory the fresh buffer held. The copies
        # come first: a captured kernel may read that output (they depend on nothing the call is given)
        written = {id(b) for ei in self.jit_cache for b in ei.outputs()}
        copies = []
        for bid, b in self._fresh.items():
            if bid in written: continue
            frozen = Buffer(b.device, b.size, b.dtype).ensure_allocated().copyin(b.as_buffer(allow_zero_copy=False))
            copies.append(ExecItem(UOp(Ops.COPY, b.dtype, (), (b.nbytes, 0)), [b, frozen]).lower())
        self.jit_cache = copies + self.jit_cache
        self._out_chains = [self._chain(x) for x in leaves]
        # random calls made inside the function: each replay advances the generator by as many calls
        self._rng_calls = Tensor._rng_counter - rng_before
        self._rng_first = rng_before
        # the captured buffers that existed before the call (state), by id: the items hold them, so no other buffer
        # has one of these ids while the TinyJit keeps them
        self._state_ids = {id(b) for ei in self.jit_cache for b in ei.bufs if b is not None and existed(b)}
        if self.prune:
            self.jit_cache = self._pruned(self.jit_cache, self._state_ids)
            self._bounded = [ei for ei in self.jit_cache if ei.prg is not None and ei.prg.bounds is not None]
        if self.verify or (self.verify is None and JIT_VERIFY): _verify.note_external(self, inputs)
        self.cnt = 2
        return ret

    def _replay(self, inputs: _Inputs | _Same, Tensor: Any) -> Any:
        # (an input a schedule handed out by Tensor.schedule() has yet to write holds no values: an error, as for any
        # read of it; the dict is empty unless such a schedule waits)
        if unwritten_buffers:
            for b in inputs.buffers: b.check_written("TinyJit reading its input")
        var_vals = inputs.var_vals
        # the views the function made with bound Variables hold with this call's values (Variables the function bound
        # itself keep their capture values), and the Variables' values are checked against every kernel's buffers,
        # before any kernel runs
        key = self._checked(inputs, var_vals)
        subst: dict[int, Buffer] = {id(old): b for old, b in zip(self._inputs_at_capture, inputs.buffers)}
        # fresh output buffers, as BUFFER nodes so the returned tensors own them
        new_nodes: dict[int, UOp] = {}
        last = self._last_outputs
        for bid, b in self._fresh.items():
            node, nb, allocator = last.get(bid, (None, None, None))
            # the last replay's output, if nothing holds it any more (the caller dropped the tensor and every graph
            # reading it: the node is referenced by the entry here, `node` and getrefcount's argument, the Buffer by
            # those and buffer_map), is this one's: no new node, Buffer or allocation. A host view of its memory (a
            # NumPy array without a copy) keeps it too
            if node is None or getrefcount(node) > 3 or getrefcount(nb) > 4 or \
                    not allocator._reusable(nb._buf):  # type: ignore[union-attr]
                node = new_buffer(self._fresh_devices[bid], b.size, b.dtype)
                nb = buffer_map[node] = Buffer(b.device, b.size, b.dtype).ensure_allocated()
                last[bid] = (node, nb, nb.allocator)
            subst[bid], new_nodes[bid] = nb, node  # type: ignore[assignment]
        rng_shift = Tensor._rng_counter - self._rng_first
        # (DEBUG=2 times each kernel: every one takes the plain path)
        prepared = _realize.DEBUG < 2 and not _viz.TIMED
        plan = self._prepared_plan(var_vals) if prepared else [(ei, None) for ei in self.jit_cache]
        dyn_ops = dyn_mem = 0
        if prepared and self._dynamic:
            # the prepared kernels with Variables take this call's values, unless they hold them from the last call
            # (their launches change only where the values differ from the last call's: the same values give the same
            # launch_args objects)
            if key is None or key != self._values_set:
                made = self._values_seen.get(key) if key is not None else None
                if made is None or made[0] is not self._dynamic:
                    made = self._launch_values(var_vals)
                    if key is not None: self._values_seen[key] = made
                for entry, (launch_kw, work) in zip(self._dynamic, made[1]):
                    if launch_kw is not entry[2]:
                        entry[1].set_values(launch_kw, work)
                        entry[2] = launch_kw
                self._values_set, self._values_work = key, made[2]
            dyn_ops, dyn_mem = self._values_work
        for ei, step in plan:
            if step is not None:
                if ei is None:   # a graph of launches: the allocations of the buffers they take per replay
                    graph, ids = step
                    graph([subst[bid].ensure_allocated()._buf for bid in ids])  # type: ignore[union-attr]
                    continue
                launch, order = step
                launch(*[subst[id(ei.bufs[i])].ensure_allocated()._buf for i in order])  # type: ignore[union-attr]
                continue
            bufs = [subst.get(id(b), b) if b is not None else None for b in ei.bufs]
            fixed = ei.fixedvars
            if self._rng_calls and rng_shift and fixed: fixed = self._shift_rng(fixed, rng_shift)
            ExecItem(ei.ast, bufs, ei.metadata, fixed, ei.prg).run(var_vals)
        if prepared:
            ops, mem, count = self._prepared_work
            _realize.GlobalCounters.global_ops += ops + dyn_ops
            _realize.GlobalCounters.global_mem += mem + dyn_mem
            _realize.GlobalCounters.kernel_count += count + len(self._dynamic)
        Tensor._rng_counter += self._rng_calls
        outs = []
        for x, chain in zip(self._out_leaves, self._out_chains):
            if chain is None: out = self._output(x, new_nodes, Tensor)
            else:
                u = new_nodes[chain[0]]
                for op, dtype, arg in chain[1]: u = UOp(op, dtype, (u,), _rebound(arg, var_vals) if var_vals else arg)
                out = Tensor(u)
            # (an output's shape that holds an input's bound Variable holds this call's value)
            if var_vals and chain is None and isinstance(out, Tensor): out = Tensor(_rebound_graph(out.uop, var_vals))
            outs.append(out)
        return _unflatten(outs, self._out_structure)

    @staticmethod
    def _values_key(var_vals: dict[str, int]) -> tuple:
        """The values of the Variables as a key: by name, and by value and type (as launch_args tells them apart)."""
        return tuple(sorted([(n, _arg_key(v)) for n, v in var_vals.items()])) if var_vals else ()

    def _checked(self, inputs: _Inputs | _Same, var_vals: dict[str, int]) -> tuple | None:
        """Check this call's values of the Variables against the captured views and kernels' buffers (raising what
        check_view_bounds and check_bounds raise), once per distinct set of values; their key (see _values_key), or
        None where the input buffers' sizes differ from the capture's (checked every time then)."""
        checks = self._checks
        if checks is None or checks[0] != var_vals.keys():
            names = frozenset(var_vals)
            checks = self._checks = (names, ViewChecks(self._constraints, names), BoundsCheck(self._bounded),
                                     [b.size for b in self._inputs_at_capture])
        # (the checks were made on the capture's buffers; an input's buffer of another size, which the inputs'
        # signature rules out, is checked as it is)
        if [b.size for b in inputs.buffers] != checks[3]:
            for dims, values in self._constraints: check_view_bounds(dims, {**values, **var_vals})
            _realize.check_bounds(self._bounded, var_vals, dict(zip(map(id, self._inputs_at_capture), inputs.buffers)))
            return None
        key = self._values_key(var_vals)
        if key in self._values_seen: return key
        checks[1].check(var_vals)
        checks[2].check(var_vals)
        if len(self._values_seen) >= VALUES_KEPT: self._values_seen.clear()
        self._values_seen[key] = None
        return key

    def _launch_values(self, var_vals: dict[str, int]) -> tuple[list, list[tuple[dict, tuple[int, int]]], tuple]:
        """(self._dynamic, the launch_args of each of its kernels, their work in all) for these values: computed once
        per program and fixed parameters (the layers of a model run one program each)."""
        made = [ei.prg.launch_args({**var_vals, **ei.fixedvars} if ei.fixedvars else var_vals)  # type: ignore[union-attr]
                for ei in self._group_items]
        pairs = [made[g] for g in self._dynamic_groups]
        return self._dynamic, pairs, (sum([w[0] for _, w in pairs]), sum([w[1] for _, w in pairs]))

    def _prepared_plan(self, var_vals: dict[str, int]) -> list[tuple[ExecItem | None, Any]]:
        """How a replay runs the captured items: (item, None) the plain way; (item, (launch, order)) through a launch
        prepared once with its arguments converted (see CompiledRunner.prepare), for a kernel without a random counter,
        taking the input and fresh output buffers at `order` per replay; (None, (graph, ids)) for consecutive prepared
        launches that their device runs as one call (the launch's `graph`, e.g. the CPU's LaunchGraph), taking the
        allocations of the buffers `ids` per replay. A kernel with Variables is prepared where its device's launch
        takes their values per call (`set_values`, listed in self._dynamic: each replay gives it that replay's values,
        the first ones `var_vals`); else it runs the plain way. (Made on the first replay; made again if another
        buffer's memory or a launch knob changed.)"""
        # (the knobs' raw values: a value that differs only in its type makes the plan again, which is harmless)
        cached, knobs = self._launches, [k.value for k in _realize.LAUNCH_KNOBS]
        # (== of the lists compares the allocations by identity, in C: they define no __eq__)
        if cached is not None and cached[2] == knobs and \
                list(map(dict.get, cached[1][0], repeat("_buf"))) == cached[1][1]: return cached[0]
        varying_ids = {id(b) for b in self._inputs_at_capture} | set(self._fresh)
        steps: list[tuple[ExecItem, Any]] = []
        memory: list[tuple[Buffer, Any]] = []
        seen: set[int] = set()
        ops = mem = count = 0
        dynamic: list[list[Any]] = []
        for ei in self.jit_cache:
            made = None
            if all(b is not None and b.is_allocated() for b in ei.bufs) and not (self._rng_calls and ei.fixedvars):
                made = ei.prepared(tuple(i for i, b in enumerate(ei.bufs) if id(b) in varying_ids), var_vals)
            if made is not None:
                memory += [(b, b._buf) for b in ei.bufs if id(b) not in varying_ids and id(b) not in seen]  # type: ignore[union-attr]
                seen.update(id(b) for b in ei.bufs)
                if self._has_variables(ei):
                    # (its values are set here, before a graph of launches is made over it)
                    launch_kw, work = ei.prg.launch_args({**var_vals, **ei.fixedvars})  # type: ignore[union-attr]
                    made[0].set_values(launch_kw, work)  # type: ignore[attr-defined]
                    dynamic.append([ei, made[0], launch_kw])
                else:
                    work = ei.prg._work(ei.fixedvars)  # type: ignore[union-attr]
                    ops, mem, count = ops + work[0], mem + work[1], count + ei.prg.kernels  # type: ignore[union-attr]
                    # (a device's launch may split a kernel by its work where it runs in a graph: the CPU's)
                    if (note := getattr(made[0], "note_work", None)) is not None: note(work)
            steps.append((ei, made))
        plan: list[tuple[ExecItem | None, Any]] = []
        i = 0
        while i < len(steps):
            graph = getattr(steps[i][1][0], "graph", None) if steps[i][1] is not None else None
            j = i + 1
            while graph is not None and j < len(steps) and steps[j][1] is not None and \
                    getattr(steps[j][1][0], "graph", None) is graph: j += 1
            if j - i == 1: plan.append(steps[i])
            else:
                group = steps[i:j]
                ids = list(dict.fromkeys(id(ei.bufs[k]) for ei, (_, order) in group for k in order))
                index = {bid: n for n, bid in enumerate(ids)}
                calls = [(launch, tuple(index[id(ei.bufs[k])] for k in order)) for ei, (launch, order) in group]
                # (the work of the launches with Variables the graph reads per call from them)
                works = [ei.prg._work(ei.fixedvars) for ei, _ in group if not self._has_variables(ei)]  # type: ignore[union-attr]
                plan.append((None, (graph(calls, (sum(w[0] for w in works), sum(w[1] for w in works))), ids)))
            i = j
        self._launches = (plan, ([b.__dict__ for b, _ in memory], [opaque for _, opaque in memory]), knobs)
        self._prepared_work = (ops, mem, count)
        self._dynamic = dynamic
        first: dict[tuple, int] = {}
        self._dynamic_groups = [first.setdefault((id(ei.prg), self._values_key(ei.fixedvars)), i)
                                for i, (ei, _, _) in enumerate(dynamic)]
        # (the index into _dynamic of each group's first kernel, renumbered into _group_items)
        order = {i: n for n, i in enumerate(dict.fromkeys(self._dynamic_groups))}
        self._group_items = [dynamic[i][0] for i in order]
        self._dynamic_groups = [order[i] for i in self._dynamic_groups]
        self._values_set = None   # (the new launches hold the values given here)
        return plan

    @staticmethod
    def _has_variables(ei: ExecItem) -> bool:
        """Whether a kernel takes values of Variables that are not its fixed parameters (each replay's values)."""
        return isinstance(ei.prg, CompiledRunner) and any(n not in ei.fixedvars for n in ei.prg._vnames)

    def _pruned(self, items: list[ExecItem], before: set[int]) -> list[ExecItem]:
        """prune=True: the captured items without the kernels that compute the same values on every call (they read
        none of the inputs nor anything computed from them, and have no Variable or random counter: a weight laid out
        for a kernel, a constant subgraph). Those run once more here, into memory of their own (an intermediate's
        memory is shared with later ones), and the kept items read that memory from then on."""
        dynamic = {id(b) for b in self._inputs_at_capture}   # buffers whose contents may differ between calls
        kept_writes: set[int] = set()
        once: list[int] = []
        for i, ei in enumerate(items):
            touched = {id(b) for b in ei.bufs if b is not None}
            prg = ei.prg
            if isinstance(prg, CompiledRunner) and all(n in ei.fixedvars for n in prg._vnames) and \
                    not (self._rng_calls and ei.fixedvars) and not touched & dynamic:
                writes = {id(ei.bufs[k]) for k in prg.p.outs}
                # (state the function updates, and its fresh outputs, are written on every call)
                if not writes & before and not writes & self._fresh.keys() and not touched & kept_writes:
                    once.append(i)
                    continue
            writes = {id(ei.bufs[k]) for k in prg.p.outs} if isinstance(prg, CompiledRunner) else touched
            dynamic |= writes
            kept_writes |= writes
        # an item kept only later may still write what a one-time kernel reads or writes: that one is kept too
        while True:
            late = [i for i in once if any(id(b) in kept_writes for b in items[i].bufs if b is not None)]
            if not late: break
            for i in late:
                once.remove(i)
                kept_writes |= {id(items[i].bufs[k]) for k in items[i].prg.p.outs}  # type: ignore[union-attr]
        if not once: return items
        own: dict[int, Buffer] = {}
        for i in once:
            for k in items[i].prg.p.outs:  # type: ignore[union-attr]
                b = items[i].bufs[k]
                assert b is not None
                own.setdefault(id(b), Buffer(b.device, b.size, b.dtype))
        moved = [ExecItem(ei.ast, [own.get(id(b), b) if b is not None else None for b in ei.bufs], ei.metadata,
                          ei.fixedvars, ei.prg) for ei in items]
        for i in once: moved[i].run({}, do_update_stats=False)
        skip = set(once)
        return [ei for i, ei in enumerate(moved) if i not in skip]

    def _shift_rng(self, fixed: dict[str, Any], shift: int) -> dict[str, Any]:
        """The kernel parameters with each random counter of the capture moved on by `shift` calls."""
        lo, hi = self._rng_first, self._rng_first + self._rng_calls
        out = {}
        for k, v in fixed.items():
            c = rng_counter_of(v)
            out[k] = rng_counter_const(c + shift) if c is not None and lo <= c < hi else v
        return out

    def _chain(self, x: Any) -> tuple[int, list[tuple[Ops, Any, Any]]] | None:
        """For an output that is one fresh buffer, or a chain of views of one (the common output), that buffer's id and
        the (op, dtype, arg) of the views from the buffer up: a replay rebuilds it on the new buffer without a graph
        walk. None for any other leaf (see _output)."""
        if not isinstance(x, Tensor) or not _in_buffers(x) or x.uop.op is Ops.MULTI: return None
        chain, u = [], x.uop
        while u.op is not Ops.BUFFER:
            if len(u.src) != 1: return None
            chain.append((u.op, u.dtype, u.arg))
            u = u.src[0]
        bid = id(device_buffer(u))
        return (bid, chain[::-1]) if bid in self._fresh else None

    def _output(self, x: Any, new_nodes: dict[int, UOp], Tensor: Any) -> Any:
        if not isinstance(x, Tensor) or not _in_buffers(x): return x
        swap = {u.base: new_nodes[id(b)] for u, b in zip(shards_of(x.uop), _base_buffers(x)) if id(b) in new_nodes}
        return Tensor(x.uop.substitute(swap)) if swap else x
