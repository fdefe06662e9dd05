"""The Tensor front end: a lazy n-dimensional array. Operations build a graph of UOps; nothing runs until a value is
needed (.numpy(), .tolist(), .item(), .realize()).

The class is assembled from one module per family of methods: this one holds construction, realization, movement,
elementwise arithmetic and the basic reductions; autograd.py, creation.py (random numbers and more constructors),
indexing.py, elementwise.py (activations and math functions), reduce.py (scans, sorting, statistics) and nn.py
(convolution, pooling, losses, attention) each add theirs as a mixin."""
from __future__ import annotations
import itertools, math, operator, struct, time, weakref
from typing import Any, Callable, Container, Sequence
from fusegrad.dtype import DTYPES_DICT, ConstType, DType, dtypes, from_np_dtype, least_upper_dtype, least_upper_float, \
    sum_acc_dtype, to_dtype, truncate_float
from fusegrad.helpers import DEBUG, TRAINING, argfix, prod
from fusegrad.device import GlobalCounters, UnrunScheduleError, unwritten_buffers
from fusegrad.schedule.multi import shards_of
from fusegrad.gradient import ClampGradient, PowGradient, UnaryGradient, clamped, with_gradient
from fusegrad.schedule.create import create_schedule_with_vars, replay_buffers, replay_plan, replay_plan_for
from fusegrad.schedule.kernelize import kernelize_map_cached, walked_lookup
from fusegrad.schedule.merge import SNAPSHOT
from fusegrad.schedule.replay import shared_replacements
from fusegrad.schedule.simplify import const_view
from fusegrad.tensor.autograd import AutogradMixin
from fusegrad.tensor.composite import composite, reduction_work
from fusegrad.tensor.creation import CreationMixin, check_size
from fusegrad.tensor.indexing import IndexingMixin
from fusegrad.tensor.elementwise import ElementwiseMixin
from fusegrad.tensor.nn import NNMixin, matmul_nodes, renderer_says, templated
from fusegrad.tensor.reduce import ReduceMixin
from fusegrad.tensor.extras import EmptyReductionError, ExtrasMixin, OperandTypeError, ShapeError
from fusegrad.engine.capture import running_jits, snapshot_nodes
from fusegrad.engine.explain import DEBUG_NANS, NanWatch
from fusegrad.engine.realize import capturing, exec_items, expect_writes, replay_runners, run_replayed, run_schedule
from fusegrad.tensor.explain import ExplainMixin, install_source_tracking as _install_source_tracking
from fusegrad.uop.graph import BuffersBelow, SharedSubstitution, StructureWalk, bound_variables, new_buffer
from fusegrad.uop.ops import GroupOp, Ops, UOp, UOpMetaClass, buffer_node, device_buffer, is_realized, is_symbolic, \
    elementwise_node, sint, view_node, ssimplify, sym_eq, sym_le, sym_value, with_src
from fusegrad.viz import record as _viz

# Registries of live tensors, as id -> weak reference (cheaper to add to than a WeakSet, which would also compare two
# references to one tensor with Tensor.__eq__; an entry whose tensor died dereferences to None even if its id is
# reused). Dead entries are dropped when a registry is listed, and when they could pile up (see _register).
# Every live Tensor: backward() looks for the ones that require gradients.
_all_refs: dict[int, weakref.ref] = {}
# The live tensors whose graph may be more than a buffer: only these can change when a schedule runs, so a realize
# walks them instead of every live tensor (a model's hundreds of realized parameters). Every tensor given a graph that
# is not a plain buffer is added (Tensor.uop's setter); realized ones are dropped after each schedule.
_lazy_refs: dict[int, weakref.ref] = {}
_prune_above = 1 << 14
# while a realize schedules: (tensor, its node before) for each tensor _apply_map re-points, to undo on an error
_undo: list | None = None

def _listed(refs: dict[int, weakref.ref]) -> list[Tensor]:
    out, dead = [], []
    for key, ref in refs.items():
        if (t := ref()) is None: dead.append(key)
        else: out.append(t)
    for key in dead: del refs[key]
    return out

def live_tensors() -> list[Tensor]:
    """Every live tensor."""
    return _listed(_all_refs)

def lazy_tensors() -> list[Tensor]:
    """The live tensors that may be lazy (a superset: some may have been realized since)."""
    return _listed(_lazy_refs)

def _register(t: Tensor, ref: weakref.ref) -> None:
    global _prune_above
    _all_refs[id(t)] = ref
    if len(_all_refs) > _prune_above:  # (a program that never realizes or differentiates still frees its entries)
        live_tensors(), lazy_tensors()
        _prune_above = max(1 << 14, 2 * len(_all_refs))
_tensor_serials = itertools.count()

def _device_uop(device: str | tuple[str, ...]) -> UOp: return UOp(Ops.DEVICE, arg=device)

# set once a tensor is sharded over several devices: until then no graph can hold a MULTI, and making a tensor skips
# the check for one
_sharding_used = False

def _has_tensor_cores(device: str) -> bool: return renderer_says(device, "tensor_cores")

def _long_half(operands: DType | None, k: sint, m: sint, device: Any) -> bool:
    """Whether a matmul with a half-precision result (summed in float32) over K = k and M = m runs as a float32 one
    (Tensor.dot): K and M long enough, and no instruction of the device takes the half values themselves (tensor
    cores; a CPU's bfloat16 dot product where both operands, of dtype `operands` (None: two dtypes), are bfloat16)."""
    if type(k) is not int or k < 256 or type(m) is not int or m < 16: return False
    return not (type(device) is str and (_has_tensor_cores(device) or operands == dtypes.bfloat16 and
                                         renderer_says(device, "bf16_dot")))

def _canonical_device(device: str | tuple[str, ...] | None) -> Any:
    """A device name in canonical form ("cpu:0" -> "CPU"); a tuple of names (several devices) is canonicalized
    name by name."""
    from fusegrad.device import Device
    if isinstance(device, (tuple, list)):
        global _sharding_used
        if not device: raise ValueError("a tuple of devices needs at least one device")
        _sharding_used = True
        devs = tuple(Device.canonicalize(d) for d in device)
        for d in devs: Device._check(d)
        return devs
    return Device.canonicalize(device) if device is not None else Device.DEFAULT

# numpy's array type, once an array has been given (numpy is optional: it is known by name until then)
_ndarray: type | None = None

def _is_ndarray_type(ty: type) -> bool:
    """Whether `ty` is numpy's ndarray (remembered in _ndarray once it is)."""
    global _ndarray
    if ty.__module__ != "numpy" or ty.__name__ != "ndarray": return False
    _ndarray = ty
    return True

def _multi(u: UOp) -> UOp:
    """`u` with its operations over sharded tensors rewritten into per-shard ones (see schedule/multi.py)."""
    if not _sharding_used: return u
    from fusegrad.schedule.multi import needs_multi, to_multi
    return to_multi(u) if needs_multi(u) else u

def _flatten_nested(data: Any) -> tuple[list, tuple[int, ...]]:
    """Flatten a nested list/tuple of scalars, checking it is rectangular."""
    if not isinstance(data, (list, tuple)): return [data], ()
    if len(data) == 0: return [], (0,)
    parts = [_flatten_nested(d) for d in data]
    shape = parts[0][1]
    if any(p[1] != shape for p in parts):
        raise ValueError(f"ragged nested sequence: sub-sequences have shapes {sorted({p[1] for p in parts})}")
    return [x for p in parts for x in p[0]], (len(data),) + shape

def _pack(values: list, dtype: DType) -> bytes:
    if dtype == dtypes.bfloat16:
        # bfloat16 is the top half of a float32 (little endian: bytes 2 and 3), rounded to nearest even first
        return b"".join(struct.pack("<f", truncate_float(float(v), dtype))[2:] for v in values)
    return struct.pack(f"<{len(values)}{dtype.fmt}", *[dtypes.checked_const(v, dtype) for v in values])

def _resolve_axis(axis: int, ndim: int) -> int:
    if not isinstance(axis, int): raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise IndexError(f"axis {axis} is out of range for a tensor with {ndim} dimensions")
    return axis + ndim if axis < 0 else axis

def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    nd = max(len(s) for s in shapes)
    padded = [(1,) * (nd - len(s)) + tuple(s) for s in shapes]
    out = []
    for dims in zip(*padded):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1: raise ValueError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} can't be broadcast "
                                            f"together (mismatch in a dimension of sizes {sorted(sizes)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)

class Tensor(AutogradMixin, CreationMixin, IndexingMixin, ElementwiseMixin, ReduceMixin, NNMixin, ExtrasMixin,
             ExplainMixin):
    """A lazy n-dimensional array on a device, with tinygrad's API (and PyTorch's names where they agree)."""
    __slots__ = ("_uop", "requires_grad", "grad", "_serial", "__weakref__")
    training: bool = False

    def _set_uop(self, u: UOp) -> None:
        self._uop = u
        if not _is_plain_buffer(u): _lazy_refs[id(self)] = weakref.ref(self)

    @staticmethod
    def _of(u: UOp) -> Tensor:
        """A new tensor of graph `u` (not a sharded one, not of dtype index): what Tensor(u) makes of a tensor
        operation's result, without the constructor's checks (the op building paths know them to hold)."""
        if Tensor.__init__ is not _plain_init: return Tensor(u)  # (a wrapped constructor notes sources: it is called)
        t = _new_tensor(Tensor)
        t.requires_grad = t.grad = None
        t._serial = next(_tensor_serials)
        t._uop = u
        # registered as lazy without a look (a superset is fine), as Tensor(u) does
        ref = _all_refs[i := id(t)] = _lazy_refs[i] = weakref.ref(t)
        if len(_all_refs) > _prune_above: _register(t, ref)
        return t
    # (a C getter: Tensor.shape, dtype and device read it for every operation)
    uop = property(operator.attrgetter("_uop"), _set_uop,
                   doc="The node this tensor's value is: a buffer once realized, else the lazy graph computing it.")

    def __init__(self, data: Any, device: str | None = None, dtype: DType | str | None = None,
                 requires_grad: bool | None = None):
        self.requires_grad, self.grad = requires_grad, None
        self._serial = next(_tensor_serials)  # creation order: a deterministic order for sets of tensors
        if type(data) is UOp and dtype is None and not requires_grad and \
                ((dt := data.dtype) is _FLOAT32 or dt != dtypes.index):
            # the common case, every tensor operation's result: the node as is (what the branches below do for it),
            # registered as lazy without a look (a superset is fine)
            self._uop = _multi(data) if _sharding_used else data
            _register(self, ref := weakref.ref(self))
            _lazy_refs[id(self)] = ref
            return
        dt = to_dtype(dtype) if dtype is not None else None
        dev = _canonical_device(device) if not isinstance(data, (UOp, Tensor)) or is_symbolic(data) else ""
        if isinstance(dev, tuple):
            # data for several devices: made on the first, then copied to the others
            self.__init__(Tensor(data, dev[0], dtype).shard(dev).uop, requires_grad=requires_grad)
            return
        if (ty := type(data)) is _ndarray or _is_ndarray_type(ty):
            src_dt = from_np_dtype(data.dtype)
            # (np.ascontiguousarray would turn a 0-d array into a 1-d one)
            arr = data if data.flags.c_contiguous else data.copy(order="C")
            if not arr.dtype.isnative: arr = arr.astype(arr.dtype.newbyteorder("="))  # (bytes are copied as they lie)
            self.uop = Tensor._from_bytes(memoryview(arr.reshape(-1).view("u1")) if arr.size else b"",
                                          tuple(data.shape), src_dt, dev)
            if dt is not None and dt != src_dt: self.uop = _checked_cast(self.uop, arr, dt)
        elif is_symbolic(data):
            # the value of a symbolic integer: element `data` of the iota 0, 1, ..., data (a loop index, no memory)
            n = ssimplify(data)
            self.uop = Tensor._iota(n + 1, dev).shrink(((n, n + 1),)).reshape(()).uop.cast(dt or dtypes.default_int)
        elif isinstance(data, UOp):
            self.uop = data if dt is None or data.dtype == dt else data.cast(dt)
        elif isinstance(data, Tensor):
            self.uop = data.uop if dt is None else data.uop.cast(dt)
        elif isinstance(data, (bool, int, float)):
            dt = dt or dtypes.from_py(data)
            self.uop = const_view(dtypes.checked_const(data, dt), dt, _device_uop(dev), ())
        elif isinstance(data, (list, tuple)):
            flat, shape = _flatten_nested(data)
            for v in flat:
                if not isinstance(v, (bool, int, float)) and not _is_numpy_scalar(v):
                    raise TypeError(f"can't make a Tensor from a sequence containing {type(v).__name__}")
            dt = dt or (dtypes.from_py(flat) if flat else dtypes.default_float)
            self.uop = Tensor._from_bytes(_pack(flat, dt), shape, dt, dev)
        elif isinstance(data, (bytes, bytearray, memoryview)):
            dt = dt or dtypes.uint8
            raw = bytes(data)
            if len(raw) % dt.itemsize: raise ValueError(f"{len(raw)} bytes is not a whole number of {dt} elements")
            self.uop = Tensor._from_bytes(raw, (len(raw) // dt.itemsize,), dt, dev)
        elif _is_numpy_scalar(data):
            self.__init__(data.item(), device, dt or from_np_dtype(data.dtype))
            return
        else:
            raise TypeError(f"can't make a Tensor from {type(data).__name__}")
        if _sharding_used: self.uop = _multi(self.uop)
        if requires_grad: self._own_storage()
        _register(self, weakref.ref(self))

    @staticmethod
    def _from_bytes(raw: bytes | memoryview, shape: tuple[int, ...], dtype: DType, device: str) -> UOp:
        buf = new_buffer(_device_node(device), n := prod(shape), dtype)
        b = device_buffer(buf)
        b.allocate()
        if len(raw): b.copyin(memoryview(raw))
        return view_node(_RESHAPE, buf, shape) if shape != (n,) else buf

    # *** properties ***

    @property
    def lazydata(self) -> UOp: return self.uop
    @property
    def shape(self) -> tuple[int, ...]: return self._uop.shape
    @property
    def dtype(self) -> DType: return self._uop.dtype
    @property
    def device(self) -> str: return self._uop.device
    @property
    def ndim(self) -> int: return len(self.shape)
    def numel(self) -> sint: return ssimplify(prod(self.shape))
    def element_size(self) -> int: return self.dtype.itemsize
    def nbytes(self) -> int: return self.numel() * self.element_size()
    def is_floating_point(self) -> bool: return dtypes.is_float(self.dtype)
    def size(self, dim: int | None = None) -> int | tuple[int, ...]:
        return self.shape if dim is None else self.shape[_resolve_axis(dim, self.ndim)]
    def __len__(self) -> int:
        if not self.shape: raise TypeError("len() of a 0-d tensor")
        return self.shape[0]
    def __repr__(self) -> str:
        return f"<Tensor {self.uop.op.name} shape={self.shape} dtype={self.dtype} device={self.device!r}>"
    __hash__ = object.__hash__
    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise RuntimeError(f"the truth value of a tensor with {self.numel()} elements is ambiguous")
        return bool(self.item())

    # *** realization ***

    @staticmethod
    def _apply_map(kmap: dict[UOp, UOp], lazy: list[Tensor] | None = None) -> None:
        """Point every live tensor at its node's replacement, rebuilding graphs that contain replaced nodes (`lazy`: a
        snapshot of lazy_tensors)."""
        changed = {k: v for k, v in kmap.items() if k is not v}
        if not changed: return
        # a realized tensor (a buffer, or a reshape of one) holds no replaced node unless a BUFFER itself is replaced:
        # only the lazy tensors are walked then
        buffers_stay = not any(k.op is Ops.BUFFER for k in changed)
        if not buffers_stay: tensors = live_tensors()
        else: tensors = lazy if lazy is not None else lazy_tensors()
        # (the walk stops at replaced nodes: what lies under them, a whole kernelized graph, is not rebuilt)
        sub = SharedSubstitution(changed)
        for t in tensors:
            u = t.uop
            if buffers_stay and u not in changed and \
                    (u.op is Ops.BUFFER or (u.op is Ops.RESHAPE and u.src[0].op is Ops.BUFFER)): continue
            if (v := sub(u)) is not u:
                if _undo is not None: _undo.append((t, u))
                t.uop = v

    def kernelize(self, *lst: Tensor) -> Tensor:
        """Decide the kernels for these tensors: afterwards each computed one is ASSIGN(BUFFER, KERNEL(...))."""
        sink = UOp.sink_of(*_shards((self,) + lst))
        Tensor._apply_map(shared_replacements(kernelize_map_cached(sink), sink.toposort(), sink.src))
        return self

    def schedule(self, *lst: Tensor) -> list:
        """The ExecItems (kernels, in order) that compute these tensors; afterwards they point at their buffers.
        (Kernels over symbolic shapes also need the Variables' values: see schedule_with_vars.)"""
        return self.schedule_with_vars(*lst)[0]

    def schedule_with_vars(self, *lst: Tensor) -> tuple[list, dict[str, int]]:
        """The ExecItems that compute these tensors and the values of the bound Variables they use (by name)."""
        if all(_is_plain_buffer(u) for u in _shards((self,) + lst)): return [], {}  # realized already: nothing to do
        live, walk = _walked((self,) + lst)
        graph = UOp.sink_of(*walk.roots)
        lookup = walked_lookup(walk, graph)
        items, var_vals, plan = create_schedule_with_vars(graph, walk.position, live, lookup)  # type: ignore[arg-type]
        out = exec_items(items, plan)
        # the tensors point at the buffers now, which hold nothing until the items run: handed out to run later, the
        # buffers are marked so a read before then raises (a realize, which sets _undo around this, runs them at once)
        if _undo is None: expect_writes(out)
        return out, var_vals

    def realize(self, *lst: Tensor, do_update_stats: bool = True) -> Tensor:
        """Compute these tensors now; afterwards each one's graph is just its buffer. A view of memory (a slice of a
        realized tensor) is computed already: it stays a view, and nothing runs for it (as in tinygrad)."""
        global _undo
        if not lst and (u := self._uop).op is not _MULTI:   # (the common case, one single-device tensor)
            if u.base.op is _BUFFER: return self
            todo = [self]
        else:
            todo = [t for t in (self,) + lst if not all(s.base.op is _BUFFER for s in shards_of(t.uop))]
            if not todo: return self
        # (a structure seen before runs from its replay plan, unless something watches each kernel or item)
        # (and not while a schedule handed out waits to run: run_schedule checks the kernels don't read its buffers)
        if not (DEBUG.value or DEBUG_NANS.value or capturing or _viz.TIMED or unwritten_buffers) and \
                _realize_replayed(todo, do_update_stats):
            return self
        t0, k0 = time.perf_counter(), GlobalCounters.time_sum_s
        if DEBUG_NANS: NanWatch.current = NanWatch(_shards(todo))  # (the graph and its inputs, before anything runs)
        _undo = undo = []
        try: items, var_vals = todo[0].schedule_with_vars(*todo[1:])
        finally: _undo = None
        t1 = time.perf_counter()
        try: run_schedule(items, var_vals, do_update_stats=do_update_stats)
        except (IndexError, UnrunScheduleError):
            # a bound Variable out of range (engine/realize.py check_bounds) or a read of a buffer that a schedule
            # handed out has yet to write (check_unwritten), found before any kernel runs: every tensor scheduling
            # re-pointed gets its graph back, so none is left holding a buffer no kernel wrote
            for t, u in reversed(undo): t.uop = u
            raise
        NanWatch.current = None
        if _viz.PROFILE: _viz.record_realize(t0, t1, time.perf_counter(), len(items))
        if DEBUG >= 2 and items:
            # where the time of a realize goes, Python's share per item included (scheduling, launching)
            t2, kernel_s = time.perf_counter(), GlobalCounters.time_sum_s - k0
            python_s = (t1 - t0) + max(0.0, (t2 - t1) - kernel_s)
            print(f"realize: {len(items)} items, schedule {(t1 - t0) * 1e3:.2f} ms, run {(t2 - t1) * 1e3:.2f} ms "
                  f"({kernel_s * 1e3:.2f} ms in kernels and copies), the rest (Python, compiling) "
                  f"{python_s / len(items) * 1e6:.0f} us per item")
        return self

    def _buffer(self):
        """The device Buffer holding this tensor's elements in row-major order (computing it if needed)."""
        from fusegrad.engine.realize import capturing
        if capturing:
            from fusegrad.engine.capture import JitError
            raise JitError("reading tensor data (numpy, item, tolist, data) inside a TinyJit function while it is "
                           "captured: replays would not run that Python code; return the tensor instead")
        if self.uop.op is Ops.MULTI:  # a sharded tensor: its shards gathered on the first device
            from fusegrad.schedule.multi import gather
            return Tensor(gather(self.uop, self.device[0]))._buffer()
        t = (self if buffer_node(self.uop) is not None else self.contiguous()).realize()
        return device_buffer(t.uop)

    def data(self) -> memoryview:
        """A memoryview (a copy) of the values, shaped like the tensor."""
        if self.dtype == dtypes.bfloat16: raise TypeError("bfloat16 has no memoryview format; use .float() first")
        raw = memoryview(bytearray(self._buffer().as_buffer()) if self.numel() else bytearray(0))
        return raw.cast(self.dtype.fmt, self.shape) if self.numel() else raw.cast(self.dtype.fmt)

    def _concrete_shape(self) -> tuple[int, ...]:
        """The shape with each symbolic entry replaced by its value under the bound Variables."""
        return tuple(sym_value(s) for s in self.shape)

    def _plain_buffer(self) -> tuple[Any, tuple[int, ...]] | None:
        """The device Buffer holding exactly this tensor's elements in row-major order, and the shape, when the tensor
        is realized and plain (a buffer or a reshape of one) and the Buffer exists: reading its values then builds no
        graph node (None otherwise: views, lazy tensors, sharded ones, and inside a TinyJit capture, which
        _buffer reports)."""
        u = self._uop
        if (op := u.op) is _BUFFER: base, shape = u, (u.arg[1],)
        elif op is _RESHAPE and _is_plain_buffer(u): base, shape = u.src[0], u.arg
        else: return None
        if capturing or (buf := base.__dict__.get("_buffer")) is None: return None
        return buf, shape

    def numpy(self) -> Any:
        """A numpy array copy of the values (numpy must be installed)."""
        if (plain := self._plain_buffer()) is not None: return plain[0].numpy(plain[1])
        import numpy as np
        from fusegrad.dtype import to_np_dtype
        if self.dtype == dtypes.bfloat16: return self.float().numpy()
        shape = self._concrete_shape()
        if prod(shape) == 0: return np.zeros(shape, dtype=to_np_dtype(self.dtype))
        # one copy out of the device buffer: it may be overwritten later (assign, reuse), so no view is handed out;
        # a symbolic tensor's buffer is sized for the Variables' maxima and holds its elements at the start
        return self._buffer().numpy()[:prod(shape)].reshape(shape)

    def tolist(self) -> Any:
        """The values as (nested) Python lists of Python scalars."""
        if (plain := self._plain_buffer()) is not None and (fmt := self.dtype.fmt) is not None:
            return _nest(_unpacked(plain[0], plain[0].size, fmt), plain[1])
        if self.dtype == dtypes.bfloat16: return self.float().tolist()
        shape = self._concrete_shape()
        if prod(shape) == 0:
            return _nest([], shape)
        vals = _unpacked(self._buffer(), prod(shape), self.dtype.fmt)
        return vals[0] if shape == () else _nest(vals, shape)

    def item(self) -> ConstType:
        """The single value of a one-element tensor as a Python scalar."""
        if (plain := self._plain_buffer()) is not None and plain[0].size == 1 and (fmt := self.dtype.fmt) is not None:
            return _unpacked(plain[0], 1, fmt)[0]
        if self.numel() != 1: raise ValueError(f"item() needs a tensor with one element, this one has {self.numel()}")
        return self.reshape(()).tolist()

    def clone(self, device: str | tuple[str, ...] | None = None) -> Tensor:
        """A copy in new memory (on `device` if given), which a later write to this tensor leaves alone. Not
        `contiguous()`: that is the tensor itself where it is realized contiguously, or becomes it once it is."""
        if device is not None and (moved := self.to(device)) is not self: return moved   # (a copy already)
        # (a copy to the same device, which no rule removes; a sharded tensor's shards each copied on their device)
        def copied(u: UOp) -> UOp: return UOp(Ops.COPY, u.dtype, (u, _device_uop(u.device)))
        if self.uop.op is Ops.MULTI: return Tensor(self.uop.replace(src=tuple(copied(s) for s in self.uop.src)))
        return Tensor(copied(self.uop))
    def detach(self) -> Tensor: return Tensor(UOp(Ops.DETACH, self.dtype, (self.uop,)))
    def contiguous(self) -> Tensor: return Tensor(UOp(Ops.CONTIGUOUS, self.dtype, (self.uop,)))
    def to(self, device: str | tuple[str, ...] | None) -> Tensor:
        """This tensor on `device` (itself if it is there already). A sharded tensor moved to one device is gathered
        there; a tuple of devices shards a tensor (replicas for a single-device one, the same split axis for a
        sharded one)."""
        dev = _canonical_device(device)
        if dev == self.device: return self
        if isinstance(dev, tuple): return self.shard(dev, self.uop.arg if self.uop.op is Ops.MULTI else None)
        return Tensor(UOp(Ops.COPY, self.dtype, (self.uop, _device_uop(dev))))
    def shard(self, devices: tuple[str, ...], axis: int | None = None) -> Tensor:
        """This tensor split over `devices` along `axis` (in shards of ceil(size/n), so the last ones may be smaller
        or empty), or whole on each of them when `axis` is None. Operations on the result run shard by shard, with
        copies and all-reduces where they cross shards."""
        from fusegrad.schedule.multi import shard_uop
        if not isinstance(devices, (tuple, list)) or not devices or not all(isinstance(d, str) for d in devices):
            raise TypeError(f"shard needs a non-empty tuple of device names, got {devices!r}")
        devs = _canonical_device(tuple(devices))
        if len(set(devs)) != len(devs): raise ValueError(f"shard: a device appears twice in {devs}")
        ax = _resolve_axis(axis, self.ndim) if axis is not None else None
        if ax is not None and self.ndim == 0: raise IndexError("can't split a 0-d tensor along an axis")
        if any(is_symbolic(s) for s in self.shape): raise NotImplementedError("sharding a tensor of symbolic shape")
        return Tensor(shard_uop(self.uop, devs, ax))
    def shard_(self, devices: tuple[str, ...], axis: int | None = None) -> Tensor:
        """Shard this tensor in place (see shard); returns it."""
        self.uop = self.shard(devices, axis).uop
        return self
    def shard_like(self, y: Tensor) -> Tensor:
        """This tensor laid out as `y` is: on y's devices, split along y's axis (as is, if y is on one device)."""
        if y.uop.op is not Ops.MULTI: return self.to(y.device)
        from fusegrad.schedule.multi import multi_bounds, shard_uop
        if self.shape != y.shape: raise ValueError(f"shard_like: shapes {self.shape} and {y.shape} differ")
        return Tensor(shard_uop(self.uop, y.device, y.uop.arg, multi_bounds(y.uop)))
    def to_(self, device: str | None) -> Tensor:
        """Move this tensor to `device` in place (its graph becomes a copy there); returns it."""
        self.uop = self.to(device).uop
        return self

    def assign(self, x: Any) -> Tensor:
        """Write `x` into this (realized) tensor's memory in place; returns this tensor."""
        if not isinstance(x, Tensor): x = Tensor(x, device=self.device, dtype=self.dtype)
        if x.shape != self.shape: raise ValueError(f"assign shape mismatch: target {self.shape}, value {x.shape}")
        if x.dtype != self.dtype: raise TypeError(f"assign dtype mismatch: target {self.dtype}, value {x.dtype}")
        if x.device != self.device and not (isinstance(self.device, tuple) and isinstance(x.device, tuple)):
            raise ValueError(f"assign device mismatch: {self.device} and {x.device}")
        if any(type(s) is int and s == 0 for s in self.shape): return self  # no element to write
        if not _is_realized_view(self.uop):
            if self.uop.op in GroupOp.Movement:
                # a view of a lazy tensor: the tensor it views is computed now, and the view is taken of that memory
                self.uop = _with_base_realized(self.uop)
            # a lazy target (e.g. a parameter or state buffer not computed yet) gets its memory now
            else: self.realize()
        if self.uop.op is not Ops.MULTI and self.uop.op in GroupOp.Movement and buffer_node(self.uop) is None:
            # a write into part of a buffer is done now, so that every later read of the buffer and of its other
            # views sees it in program order (lazy readers of the old values are computed first, in the same
            # schedule); a value that reads the buffer is computed before the write, so overlapping views read
            # the old values
            if _part_of_lazy_reduction(x.uop):
                # a value that is part of a lazy reduction's result (a chunk of a fused projection, as attention's
                # keys are of its q/k/v matmul) has that result computed whole now: the other parts, read later,
                # then read its buffer instead of repeating the reduction for their part
                x = Tensor(_with_base_realized(x.uop))
            reads_target = self.uop.base in x.uop.toposort()
            Tensor(UOp(Ops.ASSIGN, self.dtype, (self.uop, (x.contiguous() if reads_target else x).uop))).realize()
            return self  # (still the view of the buffer, now holding x: reading it or realizing it runs nothing)
        self.uop = _multi(UOp(Ops.ASSIGN, self.dtype, (self.uop, x.uop)))
        return self

    def replace(self, x: Tensor) -> Tensor:
        if x.shape != self.shape: raise ValueError(f"replace shape mismatch: {self.shape} vs {x.shape}")
        self.uop = x.uop
        return self

    # *** creation ***

    @staticmethod
    def full(shape: int | Sequence[int], fill_value: ConstType, dtype: DType | str | None = None,
             device: str | None = None) -> Tensor:
        shp = _shape_arg(shape)
        dt = to_dtype(dtype) if dtype is not None else dtypes.from_py(fill_value)
        fill, dev = dtypes.checked_const(fill_value, dt), _canonical_device(device)
        check_size(shp, dt, dev)
        return Tensor(const_view(fill, dt, _device_uop(dev), shp))
    @staticmethod
    def zeros(*shape: Any, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        return Tensor.full(argfix(*shape), 0.0, dtype=dtype or dtypes.default_float, device=device)
    @staticmethod
    def ones(*shape: Any, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        return Tensor.full(argfix(*shape), 1.0, dtype=dtype or dtypes.default_float, device=device)
    @staticmethod
    def empty(*shape: Any, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        shp = _shape_arg(argfix(*shape))
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        check_size(shp, dt, dev := _canonical_device(device), memory=True)
        if isinstance(dev, tuple):  # memory on each device, one replica each
            return Tensor(UOp(Ops.MULTI, dt, tuple(Tensor.empty(shp, dtype=dt, device=d).uop for d in dev)))
        n = prod(shp)
        if is_symbolic(n):
            # memory for the Variables' largest values, viewed at their bound ones: one buffer (and the kernels that
            # read it) serves every value
            size = int(m.vmax) if isinstance(m := ssimplify(n), UOp) else int(m)   # (n * 0 simplifies to 0)
            return Tensor(new_buffer(_device_uop(dev), size, dt).shrink(((0, n),)).reshape(shp))
        buf = new_buffer(_device_uop(dev), n, dt)
        return Tensor(buf.reshape(shp) if shp != (n,) else buf)
    @staticmethod
    def arange(start: int | float, stop: int | float | None = None, step: int | float = 1,
               dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        if stop is None: start, stop = 0, start
        if step == 0: raise ValueError("arange step must not be zero")
        if is_symbolic(start) or is_symbolic(stop):
            if step != 1 or isinstance(start, float) or isinstance(stop, float):
                raise ValueError(f"arange with a symbolic bound needs int bounds and step 1: {start}, {stop}, {step}")
            n = ssimplify(stop - start)
            if is_symbolic(n) and n.vmin < 0: raise ValueError(f"arange({start}, {stop}) may have a negative length")
            dt = to_dtype(dtype) if dtype is not None else dtypes.default_int
            return (Tensor._iota(n, device).cast(dt) + start).cast(dt)
        n = max(0, math.ceil((stop - start) / step))
        dt = to_dtype(dtype) if dtype is not None else dtypes.from_py([start, stop, step])
        idx = Tensor._iota(n, device)
        if not n: return Tensor.zeros(0, dtype=dt, device=device)
        # (0, 1, ...: the index itself, without the multiply and add the general case builds and folds away later)
        if step == 1 and start == 0: return idx.cast(dt)
        return (idx.cast(dt) * step + start).cast(dt)
    @staticmethod
    def _iota(n: int, device: str | None) -> Tensor:
        """0, 1, ..., n-1 (int32, int64 past 2^31 elements): the loop index itself, so it costs no memory traffic."""
        # (int64 where the last index doesn't fit an int32: arange(2**31 + 10, dtype=int64)[-1] wrapped)
        dt = dtypes.int64 if (n.vmax if isinstance(n, UOp) else n) > 2**31 else dtypes.int32
        check_size((n,), dt, dev := _canonical_device(device))
        return Tensor(UOp(Ops.RANGE, dt, (_device_uop(dev),), n))
    @staticmethod
    def eye(n: int, m: int | None = None, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        m = n if m is None else m
        if n < 0 or m < 0: raise ValueError(f"eye needs nonnegative sizes, got {n}, {m}")
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        if n == 0 or m == 0: return Tensor.zeros(n, m, dtype=dt, device=device)
        return (Tensor.arange(n, device=device).reshape(n, 1) == Tensor.arange(m, device=device).reshape(1, m)).cast(dt)

    # *** movement ***

    def reshape(self, shape: Any, *args: int) -> Tensor:
        new = _infer_shape(argfix(shape, *args), self.numel(), self.shape)
        return self if new == self.shape else Tensor(self.uop.reshape(new))
    def view(self, shape: Any, *args: int) -> Tensor: return self.reshape(shape, *args)
    def permute(self, order: Any, *args: int) -> Tensor:
        order_t = tuple(_resolve_axis(a, self.ndim) for a in argfix(order, *args))
        if sorted(order_t) != list(range(self.ndim)):
            raise ShapeError(f"permute order {argfix(order, *args)} is not a permutation of {self.ndim} dims")
        return Tensor(self.uop.permute(order_t))
    def expand(self, shape: Any, *args: int) -> Tensor:
        new = argfix(shape, *args)
        if len(new) < self.ndim: raise ValueError(f"can't expand shape {self.shape} to fewer dims {new}")
        old = (1,) * (len(new) - self.ndim) + self.shape
        out = tuple(o if n == -1 else n for o, n in zip(old, new))
        for o, n in zip(old, out):
            if o != n and o != 1: raise ValueError(f"can't expand shape {self.shape} to {new}: dim of size {o} isn't 1")
            if isinstance(n, int) and n < 0: raise ValueError(f"bad size {n} in expand to {new}")
        check_size(out, self.dtype, self.device)
        x = self.reshape(old) if old != self.shape else self
        return x if out == x.shape else Tensor(x.uop.expand(out))
    def shrink(self, arg: Sequence) -> Tensor:
        if len(arg) != self.ndim: raise ValueError(f"shrink {arg} needs one (start, end) per dim ({self.ndim})")
        full = tuple((0, s) if a is None else tuple(a) for a, s in zip(arg, self.shape))
        full = tuple((ssimplify(b), ssimplify(e)) for b, e in full)
        for (b, e), s in zip(full, self.shape):
            if not (sym_le(0, b) and sym_le(b, e) and sym_le(e, s)):
                raise ValueError(f"shrink {arg} is out of bounds for shape {self.shape}")
        if any(type(x) is not int for (b, e), s in zip(full, self.shape) for x in (b, e, s)):
            from fusegrad.engine.capture import check_shrink  # (bound values against each dimension)
            check_shrink(full, self.shape)
        if all(sym_eq(b, 0) and sym_eq(e, s) for (b, e), s in zip(full, self.shape)): return self
        return Tensor(self.uop.shrink(full))
    def flip(self, axis: Any, *args: int) -> Tensor:
        axes = {_resolve_axis(a, self.ndim) for a in argfix(axis, *args)}
        return Tensor(self.uop.flip(tuple(i in axes for i in range(self.ndim))))
    def transpose(self, dim0: int = 1, dim1: int = 0) -> Tensor:
        order = list(range(self.ndim))
        a, b = _resolve_axis(dim0, self.ndim), _resolve_axis(dim1, self.ndim)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)
    @property
    def T(self) -> Tensor: return self.permute(tuple(range(self.ndim))[::-1])
    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        if self.ndim == 0: return self.reshape(1)
        s, e = _resolve_axis(start_dim, self.ndim), _resolve_axis(end_dim, self.ndim)
        return self.reshape(self.shape[:s] + (prod(self.shape[s:e + 1]),) + self.shape[e + 1:])
    def unflatten(self, dim: int, sizes: tuple[int, ...]) -> Tensor:
        """Split dimension `dim` into `sizes` (one entry may be -1)."""
        d = _resolve_axis(dim, self.ndim)
        return self.reshape(self.shape[:d] + _infer_shape(tuple(sizes), self.shape[d], (self.shape[d],)) +
                            self.shape[d + 1:])
    def shrink_to(self, shape: Any, *args: int) -> Tensor:
        """The leading `shape` corner of this tensor (None keeps a dimension)."""
        new = self._target_shape(argfix(shape, *args), "shrink_to", lambda n, s: n <= s)
        return self.shrink(tuple((0, n) for n in new))
    def pad_to(self, shape: Any, *args: int, value: ConstType = 0) -> Tensor:
        """This tensor padded at the end of each dimension to `shape` (None keeps a dimension) with `value`."""
        new = self._target_shape(argfix(shape, *args), "pad_to", lambda n, s: n >= s)
        return self.pad(tuple((0, n - s) for n, s in zip(new, self.shape)), value=value)
    def _target_shape(self, shape: tuple, name: str, ok: Callable[[int, int], bool]) -> tuple[int, ...]:
        if len(shape) != self.ndim:
            raise ValueError(f"{name}: shape {shape} has {len(shape)} dims, the tensor {self.ndim}")
        new = tuple(s if n is None else n for n, s in zip(shape, self.shape))
        if not all(isinstance(n, int) and ok(n, s) for n, s in zip(new, self.shape)):
            raise ValueError(f"{name}: can't go from shape {self.shape} to {shape}")
        return new
    def squeeze(self, dim: int | None = None) -> Tensor:
        if dim is None: return self.reshape(tuple(s for s in self.shape if s != 1))
        d = _resolve_axis(dim, self.ndim)
        return self if self.shape[d] != 1 else self.reshape(self.shape[:d] + self.shape[d + 1:])
    def unsqueeze(self, dim: int) -> Tensor:
        d = _resolve_axis(dim, self.ndim + 1)
        return self.reshape(self.shape[:d] + (1,) + self.shape[d:])

    @composite(shaped=True)
    def cat(self, *args: Tensor, dim: int = 0) -> Tensor:
        """Concatenate along `dim`: each piece is padded to the full length there and selected by position (one
        fused kernel, no copies; a select rather than a sum keeps -0.0)."""
        tensors = (self,) + args
        d = _resolve_axis(dim, self.ndim)
        for t in args:
            if t.ndim != self.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, self.shape)) if i != d):
                raise ValueError(f"cat: shapes {self.shape} and {t.shape} differ outside dim {dim}")
        dt = least_upper_dtype(*(t.dtype for t in tensors))
        total, ret, offset = sum(t.shape[d] for t in tensors), None, 0
        position = Tensor._iota(total, self.device).reshape(tuple(total if i == d else 1 for i in range(self.ndim)))
        for t in tensors:
            pad = tuple((offset, total - offset - t.shape[d]) if i == d else (0, 0) for i in range(self.ndim))
            piece = t.cast(dt).pad(pad)
            ret = piece if ret is None else (position < offset).where(ret, piece)
            offset += t.shape[d]
        return ret
    @staticmethod
    def stack(*args: Tensor, dim: int = 0) -> Tensor:
        """Stack equal-shaped tensors along a new dim."""
        if not args: raise ValueError("stack needs at least one tensor")
        d = _resolve_axis(dim, args[0].ndim + 1)
        return args[0].unsqueeze(d).cat(*[t.unsqueeze(d) for t in args[1:]], dim=d)

    # *** elementwise ***

    def _const_operand_dtype(self, y: ConstType) -> DType:
        """The dtype of a Python scalar operand: this tensor's dtype when that dtype can hold its kind."""
        if isinstance(y, float) and not dtypes.is_float(self.dtype): return dtypes.default_float
        if isinstance(y, bool): return self.dtype
        if isinstance(y, int) and self.dtype == dtypes.bool: return dtypes.default_int
        return self.dtype

    def _const_like_operand(self, y: ConstType) -> Tensor:
        """A Python scalar as a tensor operand: it adopts this tensor's dtype when that dtype can hold its kind (an
        int it can't hold is an OverflowError, as in NumPy 2, not a wrapped value)."""
        dt = self._const_operand_dtype(y)
        return Tensor(const_view(dtypes.checked_const(y, dt), dt, _device_uop(self.device), ()))

    def _broadcast_nodes(self, y: Any, reverse: bool) -> tuple[UOp, UOp] | None:
        """The two operands' nodes, broadcast, in the common cases: a Python number this tensor's dtype holds, or a
        tensor of this dtype on the same single device, plain int shapes both. None for anything else (casts,
        symbolic sizes, several devices, shapes that don't broadcast), which _broadcasted's general path handles. The
        nodes are the ones the general path makes, without its Tensors and checks in between."""
        if _sharding_used: return None
        u = self._uop
        if (ty := type(y)) is Tensor:
            v = y._uop
            # (the shapes and devices that note_shape keeps in the nodes' dicts read there: two property calls less
            # per operand)
            ud, vd = u.__dict__, v.__dict__
            if (dt := u.dtype) is not v.dtype or type(d := ud.get("_device") or u.device) is not str or \
                    d != (vd.get("_device") or v.device):
                return None
            if (xs := ud.get("_shape")) is None: xs = u.shape
            if (ys := vd.get("_shape")) is None: ys = v.shape
            if xs == ys: return (v, u) if reverse else (u, v)
            if reverse: u, v, xs, ys = v, u, ys, xs
            if (shape := _plain_broadcast(xs, ys)) is None: return None
            if shape != xs and shape != ys: check_size(shape, dt, d)  # (both grow)
            return _expanded(u, shape, xs), _expanded(v, shape, ys)
        if (ty is float or ty is int or ty is bool) and (dt := u.dtype) is self._const_operand_dtype(y) and \
                dtypes.fits(y, dt) and type(d := (ud := u.__dict__).get("_device") or u.device) is str:
            # a Python number of this tensor's dtype (most `2 * x`, `x - 1.0`): the constant at this tensor's shape at
            # once, the same nodes the general path makes through reshape and expand
            if (shape := ud.get("_shape")) is None: shape = u.shape
            for s in shape:
                if type(s) is not int: return None
            c = const_view(y, dt, _device_node(d), shape)
            return (c, u) if reverse else (u, c)
        return None

    def _broadcasted(self, y: Any, reverse: bool = False, match_dtype: bool = True) -> tuple[Tensor, Tensor]:
        if (nodes := self._broadcast_nodes(y, reverse)) is not None:
            # (an operand left as it was is returned itself)
            held = {self._uop: self, y._uop: y} if type(y) is Tensor else {self._uop: self}
            return tuple(t if (t := held.get(n)) is not None else Tensor._of(n) for n in nodes)  # type: ignore
        x = self
        if type(y) in (int, float, bool) and x._const_operand_dtype(y) == x.dtype and \
                all(type(s) is int for s in x.shape) and dtypes.fits(y, x.dtype):
            # (as in _broadcast_nodes, for a sharded tensor too)
            c = Tensor(const_view(y, x.dtype, _device_uop(x.device), x.shape))
            return (c, x) if reverse else (x, c)
        if is_symbolic(y):  # a symbolic integer: an int tensor, or a float one next to floats
            y = Tensor(y, x.device, x.dtype if dtypes.is_float(x.dtype) else dtypes.default_int)
        elif not isinstance(y, Tensor):
            if not isinstance(y, (bool, int, float)) and not _is_numpy_scalar(y):
                raise TypeError(f"unsupported operand type {type(y).__name__} for a Tensor operation")
            y = x._const_like_operand(y.item() if _is_numpy_scalar(y) else y)
        if x.device != y.device: raise ValueError(f"tensors are on different devices: {x.device} and {y.device}")
        if reverse: x, y = y, x
        if match_dtype and x.dtype != y.dtype:
            out = least_upper_dtype(x.dtype, y.dtype)
            x, y = x.cast(out), y.cast(out)
        shape = _broadcast_shape(x.shape, y.shape)
        if shape != x.shape and shape != y.shape: check_size(shape, x.dtype, x.device)  # (both grow)
        return x._broadcast_unchecked(shape), y._broadcast_unchecked(shape)

    def _broadcast_to(self, shape: tuple[int, ...]) -> Tensor:
        if self.shape == shape: return self
        return self.reshape((1,) * (len(shape) - self.ndim) + self.shape).expand(shape)

    def _broadcast_unchecked(self, shape: tuple[int, ...]) -> Tensor:
        """This tensor broadcast to `shape`, which _broadcast_shape made from its shape (so nothing to check): the nodes
        made directly, not through reshape() and expand(), as every elementwise op between different shapes does."""
        u = self.uop
        if (have := u.shape) == shape: return self
        if len(have) < len(shape): u = u.reshape((1,) * (len(shape) - len(have)) + have)
        return Tensor(u.expand(shape) if u.shape != shape else u)

    def _alu(self, op: Ops, *srcs: Tensor, dtype: DType | None = None) -> Tensor:
        u = elementwise_node(op, dtype or self._uop.dtype, (self._uop, *[s._uop for s in srcs]))
        return Tensor(u) if _sharding_used else Tensor._of(u)

    def cast(self, dtype: DType | str) -> Tensor:
        dt = to_dtype(dtype)
        if dt is (u := self._uop).dtype: return self
        if _sharding_used or dt is _INDEX: return Tensor(u.cast(dt))
        return Tensor._of(elementwise_node(_CAST, dt, (u,)))
    def bitcast(self, dtype: DType | str) -> Tensor:
        dt = to_dtype(dtype)
        if dt.itemsize != self.dtype.itemsize: raise ValueError(f"bitcast needs equal sizes: {self.dtype} -> {dt}")
        return self if dt == self.dtype else Tensor(self.uop.bitcast(dt))
    def float(self) -> Tensor: return self.cast(dtypes.float32)
    def half(self) -> Tensor: return self.cast(dtypes.float16)
    def double(self) -> Tensor: return self.cast(dtypes.float64)
    def int(self) -> Tensor: return self.cast(dtypes.int32)
    def long(self) -> Tensor: return self.cast(dtypes.int64)
    def bool(self) -> Tensor: return self.cast(dtypes.bool)
    def bfloat16(self) -> Tensor: return self.cast(dtypes.bfloat16)
    def short(self) -> Tensor: return self.cast(dtypes.int16)

    # (add, sub, mul, true division and comparisons of operands _broadcast_nodes takes make their node directly: the
    # same node as the general path)
    def add(self, x: Any, reverse: bool = False) -> Tensor:
        if (n := self._broadcast_nodes(x, reverse)) is not None and (dt := n[0].dtype) is not _BOOL:
            return Tensor._of(elementwise_node(_ADD, dt, n))
        a, b = self._broadcasted(x, reverse)
        if a.dtype == dtypes.bool: return a._alu(Ops.OR, b)
        return a._alu(Ops.ADD, b)
    def sub(self, x: Any, reverse: bool = False) -> Tensor:
        if (n := self._broadcast_nodes(x, reverse)) is not None and (dt := n[0].dtype) is not _BOOL:
            return Tensor._of(elementwise_node(_ADD, dt, (n[0], elementwise_node(_NEG, dt, (n[1],)))))
        a, b = self._broadcasted(x, reverse)
        if a.dtype == dtypes.bool: raise TypeError("subtraction of bool tensors is not supported; use logical_xor")
        return a._alu(Ops.ADD, b._alu(Ops.NEG))
    def mul(self, x: Any, reverse: bool = False) -> Tensor:
        if (n := self._broadcast_nodes(x, reverse)) is not None and (dt := n[0].dtype) is not _BOOL:
            return Tensor._of(elementwise_node(_MUL, dt, n))
        a, b = self._broadcasted(x, reverse)
        if a.dtype == dtypes.bool: return a._alu(Ops.AND, b)
        return a._alu(Ops.MUL, b)
    def div(self, x: Any, reverse: bool = False, rounding_mode: str | None = None) -> Tensor:
        """True division (ints give floats); rounding_mode 'trunc' or 'floor' as torch.div."""
        if rounding_mode is None and (dt := self._uop.dtype) in _FLOATS_ONLY and \
                (n := self._broadcast_nodes(x, reverse)) is not None:
            return Tensor._of(elementwise_node(_FDIV, dt, n))   # (a float dtype: the general path's casts are no-ops)
        if rounding_mode is None and type(x) is int and not dtypes.fits(x, self._const_operand_dtype(x)):
            return self.cast(least_upper_float(self.dtype)).div(x, reverse)  # (the int is divided as a float)
        a, b = self._broadcasted(x, reverse)
        if rounding_mode == "trunc":
            if dtypes.is_int(a.dtype): return a._alu(Ops.IDIV, b)
            return a._alu(Ops.FDIV, b).trunc()
        if rounding_mode == "floor": return a.__floordiv__(b)
        if rounding_mode is not None:
            raise ValueError(f"rounding_mode must be None, 'trunc' or 'floor', not {rounding_mode!r}")
        ft = least_upper_float(a.dtype)
        return a.cast(ft)._alu(Ops.FDIV, b.cast(ft))
    def __floordiv__(self, x: Any) -> Tensor: return self._floordiv(x, False)
    def __rfloordiv__(self, x: Any) -> Tensor: return self._floordiv(x, True)
    def _floordiv(self, x: Any, reverse: bool) -> Tensor:
        a, b = self._broadcasted(x, reverse)
        if dtypes.is_float(a.dtype): return a._alu(Ops.FDIV, b).floor()
        if a.dtype == dtypes.bool: raise TypeError("floor division of bool tensors is not supported")
        q = a._alu(Ops.IDIV, b)
        if dtypes.is_unsigned(a.dtype): return q
        # C truncates toward zero; step down when the signs differ and the division wasn't exact
        inexact = a._alu(Ops.MOD, b)._alu(Ops.CMPNE, b.zeros_like(), dtype=dtypes.bool)
        signs_differ = (a < 0)._alu(Ops.CMPNE, b < 0, dtype=dtypes.bool)
        return (inexact & signs_differ).where(q - 1, q)
    def mod(self, x: Any, reverse: bool = False) -> Tensor:
        """Remainder with the sign of the divisor (Python's % and torch.remainder)."""
        a, b = self._broadcasted(x, reverse)
        if dtypes.is_float(a.dtype): return a - (a / b).floor() * b
        if a.dtype == dtypes.bool: raise TypeError("% of bool tensors is not supported")
        r = a._alu(Ops.MOD, b)
        if dtypes.is_unsigned(a.dtype): return r
        fix = r._alu(Ops.CMPNE, r.zeros_like(), dtype=dtypes.bool) & (r < 0)._alu(Ops.CMPNE, b < 0, dtype=dtypes.bool)
        return fix.where(r + b, r)
    def pow(self, x: Any, reverse: bool = False) -> Tensor:
        if not reverse and isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 8:
            if x == 0: return with_gradient(self.ones_like(), (self, self.zeros_like()), PowGradient())
            ret = self
            for _ in range(x - 1): ret = ret * self
            return ret
        a, b = self._broadcasted(x, reverse)
        if not dtypes.is_float(a.dtype):
            if not reverse and isinstance(x, int) and x < 0:
                raise RuntimeError(f"integers to negative integer powers are not allowed ({a.dtype} ** {x})")
            ft = dtypes.default_float
            return a.cast(ft).pow(b.cast(ft)).round_half().cast(a.dtype)
        return a._float_pow(b)
    @composite
    def _float_pow(a, b: Tensor) -> Tensor:
        """a ** b of float tensors of one shape: |a|^b, with the sign of a for odd integer b, nan for negative a and
        non-integer b."""
        mag = (b * a.abs().log2()).exp2()
        b_int = b.trunc()._alu(Ops.CMPEQ, b, dtype=dtypes.bool)
        b_odd = (b.abs() - (b.abs() / 2).floor() * 2)._alu(Ops.CMPEQ, b.ones_like(), dtype=dtypes.bool)
        neg = a < 0
        signed = (neg & b_odd).where(-mag, mag)
        ret = (neg & b_int.logical_not() & (a != float("-inf"))).where(float("nan"), signed)
        # x**0 and 1**y are 1 even where the formula meets 0*inf or nan (IEEE pow, as torch)
        return with_gradient((b._alu(Ops.CMPEQ, b.zeros_like(), dtype=dtypes.bool) | a._alu(Ops.CMPEQ, a.ones_like(),
                             dtype=dtypes.bool)).where(1.0, ret), (a, b), PowGradient())
    def round_half(self) -> Tensor: return (self + 0.5).floor() * (self >= 0).cast(self.dtype) + \
        (self - 0.5).ceil() * (self < 0).cast(self.dtype)

    def __add__(self, x: Any) -> Tensor: return self.add(x)
    def __radd__(self, x: Any) -> Tensor: return self.add(x, True)
    def __sub__(self, x: Any) -> Tensor: return self.sub(x)
    def __rsub__(self, x: Any) -> Tensor: return self.sub(x, True)
    def __mul__(self, x: Any) -> Tensor: return self.mul(x)
    def __rmul__(self, x: Any) -> Tensor: return self.mul(x, True)
    def __truediv__(self, x: Any) -> Tensor: return self.div(x)
    def __rtruediv__(self, x: Any) -> Tensor: return self.div(x, True)
    def __mod__(self, x: Any) -> Tensor: return self.mod(x)
    def __rmod__(self, x: Any) -> Tensor: return self.mod(x, True)
    def __pow__(self, x: Any) -> Tensor: return self.pow(x)
    def __rpow__(self, x: Any) -> Tensor: return self.pow(x, True)
    def __matmul__(self, x: Tensor) -> Tensor: return self.matmul(x)
    def __rmatmul__(self, x: Any) -> Tensor: return (x if isinstance(x, Tensor) else Tensor(x)).matmul(self)
    def __neg__(self) -> Tensor: return self.neg()
    def __invert__(self) -> Tensor: return self.bitwise_not()
    def __and__(self, x: Any) -> Tensor: return self.bitwise_and(x)
    def __rand__(self, x: Any) -> Tensor: return self.bitwise_and(x, True)
    def __or__(self, x: Any) -> Tensor: return self.bitwise_or(x)
    def __ror__(self, x: Any) -> Tensor: return self.bitwise_or(x, True)
    def __xor__(self, x: Any) -> Tensor: return self.bitwise_xor(x)
    def __rxor__(self, x: Any) -> Tensor: return self.bitwise_xor(x, True)
    def __lshift__(self, x: int) -> Tensor: return self._int_op(Ops.SHL, x)
    def __rshift__(self, x: int) -> Tensor: return self._int_op(Ops.SHR, x)
    def __iadd__(self, x: Any) -> Tensor: return self.assign(self + x) if _is_realized_view(self.uop) else self + x
    def __isub__(self, x: Any) -> Tensor: return self.assign(self - x) if _is_realized_view(self.uop) else self - x
    def __imul__(self, x: Any) -> Tensor: return self.assign(self * x) if _is_realized_view(self.uop) else self * x
    def __itruediv__(self, x: Any) -> Tensor: return self.assign(self / x) if _is_realized_view(self.uop) else self / x

    def _int_op(self, op: Ops, x: Any, reverse: bool = False) -> Tensor:
        a, b = self._broadcasted(x, reverse)
        if not (dtypes.is_int(a.dtype) or a.dtype == dtypes.bool):
            raise OperandTypeError(f"{op.name.lower()} needs integer or bool tensors, got {a.dtype}")
        return a._alu(op, b)
    def bitwise_and(self, x: Any, reverse: bool = False) -> Tensor: return self._int_op(Ops.AND, x, reverse)
    def bitwise_or(self, x: Any, reverse: bool = False) -> Tensor: return self._int_op(Ops.OR, x, reverse)
    def bitwise_xor(self, x: Any, reverse: bool = False) -> Tensor: return self._int_op(Ops.XOR, x, reverse)
    def bitwise_not(self) -> Tensor:
        if self.dtype == dtypes.bool: return self.logical_not()
        if not dtypes.is_int(self.dtype):
            raise TypeError(f"bitwise_not needs an integer or bool tensor, got {self.dtype}")
        return self ^ -1 if not dtypes.is_unsigned(self.dtype) else self ^ int(dtypes.max(self.dtype))
    def logical_not(self) -> Tensor: return self.cast(dtypes.bool)._alu(Ops.CMPNE, Tensor(True, device=self.device)
                                                                       ._broadcast_to(self.shape), dtype=dtypes.bool)
    def logical_and(self, x: Any) -> Tensor: return self.bool() & (x.bool() if isinstance(x, Tensor) else bool(x))
    def logical_or(self, x: Any) -> Tensor: return self.bool() | (x.bool() if isinstance(x, Tensor) else bool(x))

    # comparisons: nan compares unequal and unordered, as in IEEE
    def _cmp(self, op: Ops, x: Any, reverse: bool = False) -> Tensor:
        if (n := self._broadcast_nodes(x, reverse)) is not None: return Tensor._of(elementwise_node(op, _BOOL, n))
        if type(x) is int and not dtypes.fits(x, self._const_operand_dtype(x)): return self._cmp_beyond(op, x, reverse)
        a, b = self._broadcasted(x, reverse)
        return a._alu(op, b, dtype=dtypes.bool)
    def __lt__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPLT, x)
    def __gt__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPLT, x, True)
    def __le__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPLT, x) | self._cmp(Ops.CMPEQ, x)
    def __ge__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPLT, x, True) | self._cmp(Ops.CMPEQ, x)
    def __eq__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPEQ, x)  # type: ignore[override]
    def __ne__(self, x: Any) -> Tensor: return self._cmp(Ops.CMPNE, x)  # type: ignore[override]
    def eq(self, x: Any) -> Tensor: return self == x
    def ne(self, x: Any) -> Tensor: return self != x
    def lt(self, x: Any) -> Tensor: return self < x
    def gt(self, x: Any) -> Tensor: return self > x
    def le(self, x: Any) -> Tensor: return self <= x
    def ge(self, x: Any) -> Tensor: return self >= x

    def where(self, x: Any, y: Any) -> Tensor:
        """Elementwise `x if self else y` (self is the condition)."""
        if type(x) is Tensor and (n := x._broadcast_nodes(y, False)) is not None or \
                type(y) is Tensor and type(x) is not Tensor and (n := y._broadcast_nodes(x, True)) is not None:
            # (the common cases: x and y of one dtype, or a number y's dtype holds; the general path's nodes)
            c = self._uop if (cd := self._uop.dtype) is _BOOL else elementwise_node(_CAST, _BOOL, (self._uop,))
            if cd is not _INDEX and (shape := _plain_broadcast(c.shape, (xn := n[0]).shape)) is not None:
                return Tensor._of(elementwise_node(_WHERE, xn.dtype, (_expanded(c, shape), _expanded(xn, shape),
                                                                      _expanded(n[1], shape))))
        cond = self.cast(dtypes.bool)
        if not isinstance(x, Tensor) and not isinstance(y, Tensor):
            dt = dtypes.from_py([x, y]) if type(x) is not type(y) else dtypes.from_py(x)
            x, y = Tensor(x, device=self.device, dtype=dt), Tensor(y, device=self.device, dtype=dt)
        elif not isinstance(x, Tensor): x = y._const_like_operand(x)
        elif not isinstance(y, Tensor): y = x._const_like_operand(y)
        x, y = x._broadcasted(y)
        shape = _broadcast_shape(cond.shape, x.shape)
        cond, x, y = cond._broadcast_unchecked(shape), x._broadcast_unchecked(shape), y._broadcast_unchecked(shape)
        return cond._alu(Ops.WHERE, x, y, dtype=x.dtype)

    def maximum(self, x: Any) -> Tensor:
        a, b = self._broadcasted(x)
        if a.dtype == dtypes.bool: return a | b
        return a._alu(Ops.MAX, b)
    def minimum(self, x: Any) -> Tensor:
        a, b = self._broadcasted(x)
        if a.dtype == dtypes.bool: return a & b
        if dtypes.is_float(a.dtype): return -((-a).maximum(-b))
        return (a < b).where(a, b)
    def clip(self, min_: Any = None, max_: Any = None) -> Tensor:
        if min_ is None and max_ is None: raise ValueError("clip needs at least one of min_ or max_")
        bounds = [self._number_operand(b) for b in (min_, max_) if b is not None]
        if all(b is not None for b in bounds):
            return self._clamped(*bounds, has_lo=min_ is not None, has_hi=max_ is not None)
        return clamped(self, min_, max_, closed=True)
    clamp = clip
    @composite
    def _clamped(self, *bounds: Tensor, has_lo: bool, has_hi: bool) -> Tensor:
        """clip with bounds given as operands (constants of this tensor's shape and dtype): the bounds stay constants
        of the graph, which the schedule cache makes kernel parameters once they change."""
        lo, hi = (bounds[0] if has_lo else None), (bounds[-1] if has_hi else None)
        return clamped(self, lo, hi, closed=True)
    def _number_operand(self, v: Any) -> Tensor | None:
        """A Python number as a constant of this float tensor's shape and dtype (an operand of a composite), or None
        where it isn't one (a Tensor, an int tensor, a value the dtype can't hold)."""
        if type(v) not in (int, float) or not dtypes.is_float(self.dtype) or \
                (nodes := self._broadcast_nodes(v, False)) is None:
            return None
        return Tensor._of(nodes[1])

    # *** unary math ***

    def _float_unary(self, op: Ops) -> Tensor:
        return self._in_float32(lambda x: x._alu(op))
    def _in_float32(self, fxn: Callable[[Tensor], Tensor]) -> Tensor:
        """fxn computed in at least float32 and returned in this tensor's float dtype: half-precision math rounds
        only once, at the end, as torch does."""
        out = least_upper_float(self.dtype)
        if out.itemsize >= 4: return fxn(self.cast(out))
        return fxn(self.cast(dtypes.float32)).cast(out)
    def neg(self) -> Tensor:
        if self.dtype == dtypes.bool: raise TypeError("negation of a bool tensor is not supported; use logical_not")
        return self._alu(Ops.NEG)
    @composite
    def relu(self) -> Tensor:
        if (dt := (u := self._uop).dtype) in _FLOATS_ONLY and (c := self._broadcast_nodes(0, False)) is not None:
            # (what clamped builds for a float tensor, made directly)
            zero = c[1]
            value = UOp(_DETACH, dt, (UOp(_MAX, dt, (u, zero)),))
            return Tensor._of(UOp(_CUSTOM_GRAD, dt, (value, u, zero), _RELU_GRADIENT))
        return clamped(self, 0, None, closed=False, nan_passes=True) if self.dtype != dtypes.bool else self
    def exp2(self) -> Tensor: return self._float_unary(Ops.EXP2)
    @composite
    def log(self) -> Tensor: return self._in_float32(lambda x: x._alu(Ops.LOG2) * math.log(2))
    def log2(self) -> Tensor: return self._float_unary(Ops.LOG2)
    def sqrt(self) -> Tensor: return self._float_unary(Ops.SQRT)
    @composite
    def rsqrt(self) -> Tensor: return self.sqrt().reciprocal()
    def reciprocal(self) -> Tensor: return self._float_unary(Ops.RECIP)
    def square(self) -> Tensor: return self * self
    @composite
    def abs(self) -> Tensor:
        if self.dtype == dtypes.bool or dtypes.is_unsigned(self.dtype): return self
        return (self < 0).where(-self, self) if not dtypes.is_float(self.dtype) else self.maximum(-self)
    @composite
    def sign(self) -> Tensor:
        return (self > 0).cast(self.dtype) - (self < 0).cast(self.dtype) if self.dtype != dtypes.bool else self
    def trunc(self) -> Tensor: return self if not dtypes.is_float(self.dtype) else self._alu(Ops.TRUNC)
    @composite
    def floor(self) -> Tensor:
        if not dtypes.is_float(self.dtype): return self
        t = self.trunc()
        return (t > self).where(t - 1, t)
    @composite
    def ceil(self) -> Tensor:
        if not dtypes.is_float(self.dtype): return self
        t = self.trunc()
        return (t < self).where(t + 1, t)
    @composite
    def sigmoid(self) -> Tensor:
        return with_gradient((1 + (-self).exp()).reciprocal(), (self,), UnaryGradient("sigmoid"))
    def isnan(self) -> Tensor: return self != self
    def leaky_relu(self, neg_slope: float = 0.01) -> Tensor:
        if (slope := self._number_operand(neg_slope)) is not None: return self._leaky_relu(slope)
        return (self > 0).where(self, self * neg_slope)
    @composite
    def _leaky_relu(self, slope: Tensor) -> Tensor: return (self > 0).where(self, self * slope)
    @composite
    def silu(self) -> Tensor: return self * self.sigmoid()
    swish = silu

    # *** reductions ***

    def _reduce_axes(self, axis: Any) -> tuple[int, ...]:
        if type(axis) is int and -(nd := len(self._uop.shape)) <= axis < nd: return (axis % nd,)  # (the common case)
        if axis is None: return tuple(range(self.ndim))
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        resolved = tuple(_resolve_axis(a, self.ndim) for a in axes)
        if len(set(resolved)) != len(resolved): raise ValueError(f"axis {axis} has repeated dims")
        return tuple(sorted(a for a in resolved if self.ndim > 0))

    def _reduce(self, op: Ops, axis: Any, keepdim: bool) -> Tensor:
        axes = self._reduce_axes(axis)
        shape = self._uop.shape
        out_keep = tuple(1 if i in axes else s for i, s in enumerate(shape))
        n = prod(shape)
        if axes and not _sharding_used and type(n) is int and n < 1 << 18:
            # the common case (plain sizes, one device, not the two-step reduction below): the nodes made directly
            u = self._uop
            r = UOp(_REDUCE_AXIS, u.dtype, (u,), (op, axes))
            if keepdim or (squeezed := tuple(s for i, s in enumerate(shape) if i not in axes)) == out_keep:
                return Tensor._of(r)
            return Tensor._of(UOp(_RESHAPE, u.dtype, (r,), squeezed))
        if axes and prod(out_keep) == 1 and isinstance(n, int) and n >= 1 << 18 and \
                (chunks := next((c for c in (64, 32, 16) if n % c == 0), None)):
            # a big reduction to one number is done in two steps, partial results of chunks first: the first kernel has
            # an output loop to split across cores (one output alone runs on one core)
            part = Tensor(self.reshape(chunks, n // chunks).uop.r(op, (1,)))
            ret = Tensor(part.uop.r(op, (0,))).reshape(out_keep)
            return ret if keepdim else ret.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))
        ret = Tensor(self.uop.r(op, axes)) if axes else self
        return ret if keepdim else ret.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes)) \
            if ret.shape == out_keep else ret

    def sum(self, axis: Any = None, keepdim: bool = False, dtype: DType | str | None = None) -> Tensor:
        own = self._uop.dtype
        if dtype is not None: acc = to_dtype(dtype)
        elif (acc := _sum_acc.get(own)) is None: acc = _sum_acc[own] = sum_acc_dtype(own)
        ret = self.cast(acc)._reduce(_ADD, axis, keepdim)
        # half precision sums accumulate in float32 but return the input dtype, as tinygrad does
        return ret.cast(own) if dtype is None and (own is dtypes.float16 or own is dtypes.bfloat16) else ret
    def max(self, axis: Any = None, keepdim: bool = False) -> Tensor:
        axes = self._reduce_axes(axis)
        if any(self.shape[a] == 0 for a in axes):
            raise EmptyReductionError(f"max/min over an empty dimension (shape {self.shape}, axis {axis}) has no "
                                      "identity")
        return self._reduce(Ops.MAX, axis, keepdim)
    def min(self, axis: Any = None, keepdim: bool = False) -> Tensor:
        if dtypes.is_unsigned(self.dtype): return ~((~self).max(axis, keepdim))
        if self.dtype == dtypes.bool: return self.logical_not().max(axis, keepdim).logical_not()
        if dtypes.is_int(self.dtype): return ~((~self).max(axis, keepdim))
        return -((-self).max(axis, keepdim))
    @composite(shaped=True)
    def mean(self, axis: Any = None, keepdim: bool = False) -> Tensor:
        axes = self._reduce_axes(axis)
        shape = self._uop.shape
        n = ssimplify(prod(shape[a] for a in axes))
        out_dt = least_upper_float(self._uop.dtype)
        if (acc := _sum_acc.get(out_dt)) is None: acc = _sum_acc[out_dt] = sum_acc_dtype(out_dt)
        # (half precision divides its float32 sum: the sum of 2^20 halves overflowed to inf before the division)
        s = self.cast(out_dt).sum(axis, keepdim, dtype=acc)
        if is_symbolic(n): return (s / Tensor(n, self.device, s.dtype)).cast(out_dt)
        return (s / n if n else s * float("nan")).cast(out_dt)
    @composite(shaped=True)
    def argmax(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
        """Index of the first maximum along `axis` (of the flattened tensor when None), as int32."""
        if axis is None: return self.flatten().argmax(0)
        ax = _resolve_axis(axis, self.ndim)
        n = self.shape[ax] if self.ndim else 1
        if n == 0: raise EmptyReductionError(f"argmax over an empty dimension (shape {self.shape}, axis {axis})")
        x = self if self.ndim else self.reshape(1)
        # mark each maximum with n - index, so the largest mark is the first maximum; nan counts as the maximum
        is_max = x == x.max(ax, keepdim=True)
        if dtypes.is_float(x.dtype): is_max = is_max | x.isnan()
        marks = Tensor.arange(n, 0, -1, dtype=dtypes.int32, device=self.device).reshape(
            tuple(n if i == ax else 1 for i in range(x.ndim)))
        ret = n - (is_max.cast(dtypes.int32) * marks).max(ax, keepdim=keepdim)
        return ret if self.ndim else ret.reshape(())
    @composite(shaped=True)
    def argmin(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
        """Index of the first minimum along `axis` (of the flattened tensor when None), as int32."""
        if dtypes.is_float(self.dtype): return (-self).argmax(axis, keepdim)
        return (~self if self.dtype != dtypes.bool else self.logical_not()).argmax(axis, keepdim)

    def softmax(self, axis: int = -1, dtype: DType | str | None = None) -> Tensor:
        return templated(Tensor._softmax_graph, (self,), (axis, dtype))
    def _softmax_graph(self, axis: int, dtype: DType | str | None) -> Tensor:
        x = self.cast(dtype) if dtype is not None else self.cast(least_upper_float(self.dtype))
        # (over an empty axis there is nothing to normalize: the result is as empty, as torch's)
        if any(isinstance(n := x.shape[a], int) and n == 0 for a in x._reduce_axes(axis)): return x
        # (both are unchanged by the shift, so it carries no gradient: without the detach the backward computed the
        # max's, two more sums over the row that add up to zero)
        e = (x - x.max(axis, keepdim=True).detach()).exp()
        # times the reciprocal of the sum, computed once per row: a vector division per element costs about as much
        # as the exp (within an ulp of dividing, as torch's CPU kernel does)
        return e * e.sum(axis, keepdim=True).reciprocal()
    def log_softmax(self, axis: int = -1, dtype: DType | str | None = None) -> Tensor:
        return templated(Tensor._log_softmax_graph, (self,), (axis, dtype))
    def _log_softmax_graph(self, axis: int, dtype: DType | str | None) -> Tensor:
        x = self.cast(dtype) if dtype is not None else self.cast(least_upper_float(self.dtype))
        if any(isinstance(n := x.shape[a], int) and n == 0 for a in x._reduce_axes(axis)): return x
        m = x - x.max(axis, keepdim=True).detach()   # (see _softmax_graph)
        return m - m.exp().sum(axis, keepdim=True).log()
    def _squeeze_axes(self, like: Tensor, axis: Any, keepdim: bool) -> Tensor:
        if keepdim: return self
        axes = like._reduce_axes(axis)
        return self.reshape(tuple(s for i, s in enumerate(like.shape) if i not in axes))

    # *** linear algebra ***

    def dot(self, w: Tensor, dtype: DType | str | None = None) -> Tensor:
        """Matrix product with numpy/torch broadcasting rules, as a broadcast multiply and a sum (one kernel).
        `dtype`: the result's dtype (by default the operands' common one); the products and their sum are formed in
        its accumulation dtype (float32 for half types)."""
        if type(w) is Tensor and dtype is None and (xu := self._uop).dtype is (wu := w._uop).dtype and \
                ((dt := xu.dtype) in _OWN_ACCUMULATOR or dt in _HALF_TYPES) and not _sharding_used:
            # the common case first (see below), its conditions checked on the nodes without the shape queries
            xs, ws = xu.shape, wu.shape
            if len(xs) >= 2 and len(xs) == len(ws) and xs[-1] == ws[-2] and xs[:-2] == ws[:-2] and \
                    all(type(v) is int for v in xs) and all(type(v) is int for v in ws) and xs[-2] * ws[-1] > 1 and \
                    type(d := xu.device) is str and d == wu.device:
                if dt not in _HALF_TYPES or not _long_half(dt, xs[-1], ws[-1], d): return self._product(w)
        if not isinstance(w, Tensor): raise TypeError(f"matmul needs a Tensor, got {type(w).__name__}")
        if self.ndim == 0 or w.ndim == 0: raise ShapeError("matmul needs tensors with at least 1 dim, got a 0-d one")
        x, y = self, w
        if x.shape[-1] != y.shape[-2 if y.ndim >= 2 else -1]:
            raise ShapeError(f"matmul shape mismatch: {x.shape} @ {y.shape} (inner dims "
                             f"{x.shape[-1]} and {y.shape[-2 if y.ndim >= 2 else -1]} differ)")
        squeeze_x, squeeze_y = x.ndim == 1, y.ndim == 1
        # (a tensor on one device holds no sharded node, whether or not others were sharded before)
        if x.ndim > 2 and y.ndim == 2 and all(type(v) is int for v in x.shape) and x.shape[-1] and \
                type(x.device) is str and type(y.device) is str:
            # batched rows times one matrix (a Linear layer on (batch, seq, features)) as a single matmul over all the
            # rows: the matrix's gradient is then one sum over batch x rows, where the broadcast made a sum per batch
            # (each a full-size partial gradient written out) and a second kernel adding them up (an empty inner
            # dimension has no -1 to reshape by: the broadcast form gives its zeros)
            return x.reshape(-1, x.shape[-1]).dot(y, dtype).reshape(*x.shape[:-1], y.shape[-1])
        if squeeze_x: x = x.reshape(1, -1)
        if squeeze_y: y = y.reshape(-1, 1)
        n, k, m = x.shape[-2], x.shape[-1], y.shape[-1]
        out_dt = least_upper_dtype(x.dtype, y.dtype) if dtype is None else to_dtype(dtype)
        # products are formed in the accumulation dtype (half inputs: exact float32 products, as BLAS does)
        acc_dt = sum_acc_dtype(out_dt) if dtypes.is_float(out_dt) else out_dt
        # a long half-precision product runs as a float32 one: x (read once per output column tile, as broadcast
        # scalars) converted beforehand, which costs 1/m of the product, and the sum kept in a float32 buffer, so the
        # optimizer can block K through the output (adding partial sums into it), then rounded once
        # (not on a device with tensor cores: they take the half values themselves, DESIGN.md "Tensor cores")
        # (nor where bfloat16 products have an instruction of their own, a CPU's dot product or tile: it takes the
        # bfloat16 values themselves)
        long_half = acc_dt != out_dt and _long_half(x.dtype if x.dtype == y.dtype else None, k, m, x.device)
        if long_half: x = x.cast(acc_dt).contiguous()
        xs, ys = x.shape, y.shape
        if not (squeeze_x or squeeze_y) and all(type(v) is int for v in xs + ys) and xs[:-2] == ys[:-2] and \
                n * m > 1 and x.dtype == y.dtype == out_dt and acc_dt == sum_acc_dtype(out_dt) and \
                type(x.device) is str and x.device == y.device:
            # the common case (equal batch dims, one dtype: its own accumulator, or a half type summed in float32) as
            # nodes directly: the same graph as the tensor ops below make, without their checks and shape queries (a
            # third of the Python time)
            return Tensor(matmul_nodes(x.uop, y.uop, acc_dt))
        batch = _broadcast_shape(x.shape[:-2], y.shape[:-2])
        xb = x._broadcast_to(batch + (n, k)).reshape(batch + (n, 1, k))
        yb = y._broadcast_to(batch + (k, m)).transpose(-1, -2).reshape(batch + (1, m, k))
        ret = (xb.cast(acc_dt) * yb.cast(acc_dt)).sum(-1, dtype=sum_acc_dtype(out_dt))
        ret = (ret.contiguous() if long_half else ret).cast(out_dt)
        if squeeze_x: ret = ret.reshape(ret.shape[:-2] + ret.shape[-1:])
        if squeeze_y: ret = ret.reshape(ret.shape[:-1])
        return ret

    @composite(shaped=True)
    def _product(self, w: Tensor) -> Tensor:
        """self @ w of dot's common case (equal batch dims, one dtype, int sizes, one device; a half type summed in
        float32 without a float32 copy of self): one COMPOSITE node, the nodes of matmul_nodes when expanded."""
        xu = self._uop
        return Tensor._of(matmul_nodes(xu, w._uop, dtypes.float32 if xu.dtype in _HALF_TYPES else None))

    def matmul(self, x: Tensor, reverse: bool = False, dtype: DType | str | None = None) -> Tensor:
        """`self @ x` (with `reverse`, `x @ self`); see dot."""
        return x.dot(self, dtype) if reverse else self.dot(x, dtype)

# *** helpers ***

def _plain_broadcast(xs: tuple, ys: tuple) -> tuple[int, ...] | None:
    """The shape two shapes of plain ints broadcast to; None if a size is symbolic or the shapes don't broadcast (the
    general path says why)."""
    nx, ny = len(xs), len(ys)
    # (the common case first, a bias over a batch: one shape ends with the other)
    if nx >= ny and xs[nx - ny:] == ys: longer = xs
    elif nx < ny and ys[ny - nx:] == xs: longer = ys
    else: longer = None
    if longer is not None:
        for s in longer:
            if type(s) is not int: return None
        return longer
    if nx < ny: xs = (1,) * (ny - nx) + xs
    elif ny < nx: ys = (1,) * (nx - ny) + ys
    out = []
    for a, b in zip(xs, ys):
        if type(a) is not int or type(b) is not int: return None
        if a == b or b == 1: out.append(a)
        elif a == 1: out.append(b)
        else: return None
    return tuple(out)

def _expanded(u: UOp, shape: tuple[int, ...], have: tuple[int, ...] | None = None) -> UOp:
    """Node `u` (of shape `have`, if the caller knows it) broadcast to `shape` (which it broadcasts to): the nodes
    Tensor._broadcast_unchecked makes."""
    if have is None: have = u.shape
    if have == shape: return u
    if len(have) < len(shape): u = view_node(_RESHAPE, u, have := (1,) * (len(shape) - len(have)) + have)
    return view_node(_EXPAND, u, shape) if have != shape else u

def _is_numpy_scalar(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and getattr(x, "shape", None) == ()

def _checked_cast(u: UOp, arr: Any, dt: DType) -> UOp:
    """The array `arr` (already in `u`) cast to `dt`, refusing values that would wrap there, as tensor data given
    with that dtype is refused."""
    if dtypes.is_int(dt) and arr.size and arr.dtype.kind in "iuf":
        lo, hi = arr.min().item(), arr.max().item()
        for v in (lo, hi): dtypes.checked_const(v, dt)
    return u.cast(dt)

def _nest(flat: list, shape: tuple[int, ...]) -> Any:
    if len(shape) <= 1: return list(flat) if shape else flat[0]
    step = prod(shape[1:])
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]

def _is_realized_view(u: UOp) -> bool:
    if u.op is Ops.MULTI: return all(is_realized(s.base) for s in u.src)
    return is_realized(u.base)

def _with_base_realized(u: UOp) -> UOp:
    """View `u` of a lazy tensor, taken of that tensor's memory once it is computed (every live tensor holding its
    graph then holds the buffer)."""
    base = u.base
    return u.substitute({base: Tensor(base).realize().uop})

def _part_of_lazy_reduction(u: UOp) -> bool:
    """Whether `u` views part of a lazy (unrealized) result that holds a reduction."""
    if u.op not in GroupOp.Movement or is_realized(base := u.base): return False
    sizes = prod(u.shape), prod(base.shape)
    if any(is_symbolic(n) for n in sizes) or sizes[0] >= sizes[1]: return False
    # (a symbolic or unknown amount counts as a reduction)
    return any(not isinstance(w := reduction_work(n), int) or w != 0 for n in base.toposort())

def _shards(tensors: Sequence[Tensor]) -> list[UOp]:
    """The graphs of these tensors, a sharded one's being its shards'."""
    return [s for t in tensors for s in shards_of(t.uop)]

def _held_buffers(lazy: list[Tensor], among: Container[UOp]) -> set[UOp]:
    """The BUFFER nodes `among` this schedule's that live tensors hold, so they keep their memory: those a tensor is
    (its base) and, for a tensor that is still lazy, every buffer its graph loads from. (`lazy`: the tensors that
    were lazy before the schedule; one realized before it holds none of these.) Tensors that are now plain buffers
    leave the lazy set."""
    below = BuffersBelow(among)
    for t in lazy:
        u = t.uop
        if (base := u.base).op is Ops.BUFFER:
            if base in among: below.found.add(base)
        else: below.walk(u)
        if _is_plain_buffer(u): _lazy_refs.pop(id(t), None)
    return below.found

def _overwritten_reads(tensors: Sequence[Tensor], lazy: list[Tensor] | None, topo: dict[UOp, Any] | None,
                       assigns: list[UOp] | None) -> tuple[tuple[Tensor, ...], Container[UOp], set[UOp]]:
    """The other live lazy tensors that read a buffer these tensors assign to (the readers), the nodes of the graphs
    walked that read such a buffer (directly or not), and those BUFFERs (the targets). A reader keeps the value it had
    when it was built, as in eager execution (a loss computed before an optimizer step isn't evaluated with the
    updated weights): it is computed in the same schedule, before the write, or left lazy over copies taken before it
    (_deferred_readers). (`topo`: the toposort of these tensors' graph, if the caller made it; `assigns`: its ASSIGN
    nodes, if the caller has them.)"""
    if topo is None: topo = UOp.sink_of(*_shards(tensors)).toposort()
    targets = {u.src[0].base for u in (topo if assigns is None else assigns)
               if u.op is _ASSIGN and u.src[0].base.op is _BUFFER}
    if not targets: return (), set(), targets
    ids = {id(t) for t in tensors}
    lazy = [t for t in (lazy if lazy is not None else lazy_tensors()) if id(t) not in ids and
            any(u.base.op is not _BUFFER and not is_realized(u) for u in _shards((t,)))]
    if not lazy: return (), set(), targets
    # (the graphs below the lazy tensors are walked only as far as a target: most read one a few nodes down)
    reading = _Reads(targets)
    # in creation order, so the same program gives the same graph (and hits the schedule cache) every step
    readers = tuple(sorted((t for t in lazy if any(u in reading for u in _shards((t,)))), key=lambda t: t._serial))
    return readers, reading, targets

class _Reads:
    """The nodes that read one of `targets` (directly or through their sources), as a container: `u in reads` is
    worked out when asked, by a walk below u that stops at the first target it meets, and remembered."""
    def __init__(self, targets: set[UOp]) -> None: self.known: dict[UOp, bool] = dict.fromkeys(targets, True)
    def __contains__(self, u: UOp) -> bool:
        known = self.known
        if (r := known.get(u)) is not None: return r
        # depth first, an iterator over each open node's sources
        stack = [(u, iter(u.src))]
        while stack:
            node, srcs = stack[-1]
            for s in srcs:
                if (r := known.get(s)) is None:
                    stack.append((s, iter(s.src)))
                    break
                if r:
                    # each open node reads it through the one above it
                    for n, _ in stack: known[n] = True
                    return True
            else:
                stack.pop()
                known[node] = False
        return False

# A reader of an overwritten buffer is deferred when computing it now would cost this many times more than keeping
# what it needs (see _deferred_readers)
DEFER_READER_RATIO = 4

def _deferred_readers(readers: tuple[Tensor, ...], reading: Container[UOp], targets: set[UOp],
                      topo: dict[UOp, Any]) -> tuple[list[Tensor], list[tuple[Tensor, UOp]], list[Tensor]]:
    """Which readers of overwritten buffers to compute now, and how to keep the others lazy. A reader's own part
    (the nodes of its graph that the schedule doesn't compute) may be far more work than what it reads from the
    scheduled graph: the gradient into a model's input, which nobody may ever read, is a whole matmul over weights the
    optimizer overwrites. Such a reader stays lazy if its own part can read copies instead: each target buffer it reads
    there (through views, rebuilt) is copied before the write (a snapshot), and each computed node of the scheduled
    graph it reads there that depends on a target is kept in memory. Returns the readers to compute, the deferred
    readers with their new graphs, and the tensors to compute with the schedule for them (snapshots and kept nodes)."""
    computed: list[Tensor] = []
    deferred: list[tuple[Tensor, UOp]] = []
    keep: dict[UOp, UOp] = {}   # a kept node or target buffer -> what the schedule computes for it
    def target_view(x: UOp) -> bool: return x.op in GroupOp.Movement and x.base in targets
    for t in readers:
        u = t.uop
        if u.op is Ops.MULTI or u in topo or (plan := _deferral_plan(u, reading, targets, topo, target_view)) is None:
            computed.append(t)
            continue
        own, kept, work, cost = plan
        if work <= DEFER_READER_RATIO * cost:
            computed.append(t)
            continue
        for f in kept:
            if f not in keep: keep[f] = _snapshot(f) if f.op is Ops.BUFFER else f
        new: dict[UOp, UOp] = {}
        for x in own:   # the reader's own part, rebuilt over the snapshots (sources before users)
            if x in topo and not target_view(x): new[x] = keep[x] if x in targets else x
            else:
                src = tuple(new[s] for s in x.src)
                new[x] = x if src == x.src else with_src(x, src)
        deferred.append((t, new[u]))
    return computed, deferred, [Tensor(v) for v in keep.values()]

# the graphs of the readers deferred so far, as the schedule that deferred them left them (weakly)
_deferred_graphs: weakref.WeakSet[UOp] = weakref.WeakSet()

def _snapshot(buf: UOp) -> UOp:
    """A copy of a BUFFER's elements into new memory (a copy to the same device, which no rule removes), marked as a
    snapshot: the kernel that overwrites the buffer may store it (schedule/merge.py). Not inside a TinyJit's function
    (its first call or its capture): replays drop a copy that nothing they run reads (jit.py _without_unread_snapshots),
    and a store merged into the optimizer's kernel would run in every replay."""
    return UOp(Ops.COPY, buf.dtype, (buf, UOp(Ops.DEVICE, arg=buf.device)),
               None if capturing or running_jits else SNAPSHOT)

def _deferral_plan(u: UOp, reading: Container[UOp], targets: set[UOp], topo: dict[UOp, Any],
                   target_view: Callable[[UOp], bool]) -> tuple[dict[UOp, None], list[UOp], int, int] | None:
    """The reader graph `u`'s own part (its nodes the schedule doesn't compute and the views of target buffers it
    reads, with the scheduled nodes they read), the scheduled nodes to keep for it (the target buffers it reads, the
    bases of the computed nodes it reads that depend on a target), the elements its reductions read, and the elements
    keeping those nodes costs. None where a size is symbolic."""
    def walked(x: UOp) -> bool: return x not in topo or target_view(x)
    own = u.toposort(gate=walked)
    # a reader over a reader deferred before (a gradient accumulated into a tensor step after step) is computed: its
    # graph and copies would otherwise grow by one step's with every step
    if any(x in _deferred_graphs for x in own): return None
    work, frontier = 0, {}
    for x in own:
        if not walked(x): continue
        if not isinstance(n := reduction_work(x), int): return None
        work += n
        for s in x.src:
            if not walked(s) and s in reading: frontier[s.base] = None
    kept: list[UOp] = []
    cost = 0
    for base in frontier:
        if base.op is Ops.BUFFER and base not in targets: continue
        if not isinstance(n := prod(base.shape), int): return None
        cost += n
        kept.append(base)
    return own, kept, work, cost

def _walked(tensors: tuple[Tensor, ...]) -> tuple[_LiveTensors, StructureWalk]:
    """The live tensors for a schedule of `tensors`, and the walk of its graph: these tensors' and what is computed
    with them for the other lazy tensors that read a buffer they overwrite (_overwritten_reads): those readers, or the
    copies and kept nodes of the readers left lazy (_deferred_readers)."""
    live = _LiveTensors(tensors)   # (one snapshot of the lazy tensors serves: the tensors made below are added to it)
    walk = StructureWalk().walk(live.roots())
    if walk.assigns:
        readers, reading, targets = _overwritten_reads(tensors, live.lazy, walk.position, walk.assigns)
        if readers:
            computed, deferred, kept = _deferred_readers(readers, reading, targets, walk.position)
            for t, graph in deferred:
                if _undo is not None: _undo.append((t, t.uop))
                t.uop = graph
            live.deferred = [t for t, _ in deferred]
            live.snapshots = [t for t in kept if t.uop.op is Ops.COPY]
            # (the walk goes on from the graph walked: the toposort continues as toposort(known=...) would)
            live.tensors += tuple(computed) + tuple(kept)
            live.lazy += kept   # (made after the snapshot of the lazy tensors: scheduling re-points them too)
            walk.walk(_shards(computed + kept))
    return live, walk

def _realize_replayed(todo: list[Tensor], do_update_stats: bool) -> bool:
    """Realize `todo` straight from the replay plan the schedule cache holds for its graph's structure, the kernels
    launched from the plan without ScheduleItems or ExecItems (a training loop's steps, an eager loop's ops); the same
    buffers, tensors re-pointed and GlobalCounters as the general path. False, with nothing done, where there is no
    plan ready for it (a structure seen for the first time or twice, bound Variables, a kernel whose memory
    depends on Variables)."""
    if len(todo) == 1 and (u := todo[0]._uop).op is not _MULTI and \
            (walked := _template_walk(u, made) if (made := u.__dict__.get("_template")) is not None
             else _eager_walk(u)) is not None:
        topo, skey, consts = walked
        if (plan := replay_plan_for(skey, consts)) is None or (runners := replay_runners(plan)) is None: return False
        run_replayed(plan, runners, topo, replay_buffers(plan, topo, _LiveTensors((todo[0],))), do_update_stats)
        return True
    return _realize_walked(todo, do_update_stats)

def _realize_walked(todo: list[Tensor], do_update_stats: bool) -> bool:
    """_realize_replayed by a walk of the graph."""
    live, walk = _walked(tuple(todo))
    if UOpMetaClass.binds_made and bound_variables(walk.position): return False
    if (plan := replay_plan(walk)) is None or (runners := replay_runners(plan)) is None: return False
    topo = list(walk.position)
    if len(todo) == 1 and (u := todo[0]._uop).op is not _MULTI and not walk.assigns:
        if (made := u.__dict__.get("_template")) is not None: _remember_template_walk(made, walk, topo)
        elif all([(b := s.base.op) is _BUFFER or b is _CONST for s in u.src]): _remember_walk(u, walk, topo)
    run_replayed(plan, runners, topo, replay_buffers(plan, topo, live), do_update_stats)
    return True

# The walk of an eager op's graph (`(a + b).realize()` in a loop: an op over realized tensors or constants), kept by
# the root's op, dtype, arg and its sources' ids: the sources (checked by weak reference, as an id may be reused), the
# other nodes of the toposort, the structure key and the constants' positions. The same source nodes are the same
# graph below the root (nodes are immutable), so the same toposort, structure and constants' values; only weak
# references are kept, so no node or buffer is held alive by it.
_eager_walks: dict[tuple, tuple[list[int], list[weakref.ref], tuple, list[int]]] = {}

def _eager_walk(u: UOp) -> tuple[list[UOp], tuple, list[UOp]] | None:
    """(toposort, structure key, liftable constants) of `u`'s graph from _eager_walks, or None where it has none for
    u's op and sources."""
    k = u._ukey
    if (seen := _eager_walks.get((k[0], k[1], k[3], *map(id, u.src)))) is None: return None
    topo = [r() for r in seen[1]]
    # the same sources are the same graph below the root, so the walk's results hold as they were (a source freed
    # since, whose address another node took, has a dead reference: no match)
    if [topo[i] for i in seen[0]] != list(u.src): return None
    topo.append(u)
    return topo, seen[2], [topo[i] for i in seen[3]]

def _remember_walk(u: UOp, walk: StructureWalk, topo: list[UOp]) -> None:
    """Keep the walk of `u`'s graph (`topo`: its toposort) for _realize_replayed: the sources' positions, weak
    references to every node but the root, the structure key and the constants' positions."""
    if len(_eager_walks) >= 4096: _eager_walks.clear()   # (entries of sources that died are dropped with the rest)
    k, at = u._ukey, walk.position
    _eager_walks[(k[0], k[1], k[3], *map(id, u.src))] = ([at[s] for s in u.src], [weakref.ref(x) for x in topo[:-1]],
                                                         walk.key(), [at[c] for c in walk.consts])

# The walk of a graph made from an operation's template (tensor/nn.py _from_template: `conv2d(x, w).realize()` in an
# eager loop), kept by the template and its operands' ids: the graph is the template's nodes made again over the
# same operands, so its toposort is the same sequence, each position either the n-th node made from the template
# (new objects every call: the instance's list, which the result carries) or a node below an operand or one of the
# template's own (the same objects, by weak reference). The template itself and the operands are checked by identity
# (an id may be reused once they are gone).
_template_walks: dict[tuple, tuple[Any, tuple[weakref.ref, ...], list, tuple, list[int]]] = {}

def _template_walk(u: UOp, made: tuple) -> tuple[list[UOp], tuple, list[UOp]] | None:
    """(toposort, structure key, liftable constants) of `u`'s graph from _template_walks, or None where it has none for
    u's template and operands."""
    template, operands, nodes = made
    if (seen := _template_walks.get((id(template), *map(id, operands)))) is None or seen[0] is not template or \
            any(r() is not o for r, o in zip(seen[1], operands)):
        return None
    topo = [nodes[r] if type(r) is int else r() for r in seen[2]]
    if None in topo: return None
    topo.append(u)
    return topo, seen[3], [topo[i] for i in seen[4]]

def _remember_template_walk(made: tuple, walk: StructureWalk, topo: list[UOp]) -> None:
    """Keep the walk of a graph made from a template (`made`: the template, its operands and the nodes made, in the
    order the template makes them; `topo`: the graph's toposort) for _template_walk."""
    if len(_template_walks) >= 1024: _template_walks.clear()
    template, operands, nodes = made
    made_at = {n: i for i, n in enumerate(nodes)}
    recipe = [made_at[x] if x in made_at else weakref.ref(x) for x in topo[:-1]]
    at = walk.position
    _template_walks[(id(template), *map(id, operands))] = (template, tuple(map(weakref.ref, operands)), recipe,
                                                           walk.key(), [at[c] for c in walk.consts])

class _LiveTensors:
    """The live tensors as scheduling sees them (schedule/create.py LiveGraphs): `tensors` those being scheduled,
    `lazy` a snapshot of the lazy ones."""
    def __init__(self, tensors: tuple[Tensor, ...]):
        self.tensors, self.lazy = tensors, lazy_tensors()
        self.deferred: list[Tensor] = []   # readers of overwritten buffers left lazy over copies (_deferred_readers)
        self.snapshots: list[Tensor] = []  # and those copies
    def apply(self, replacements: dict[UOp, UOp]) -> None:
        Tensor._apply_map(replacements, self.lazy)
        # a replaced buffer re-points realized tensors too: they are lazy now
        if any(k.op is Ops.BUFFER and k is not v for k, v in replacements.items()): self.lazy = lazy_tensors()
        self._mark_deferred()
    def _mark_deferred(self) -> None:
        for t in self.deferred: _deferred_graphs.add(t._uop)
        for t in self.snapshots:
            if (b := buffer_node(t._uop)) is not None: snapshot_nodes.add(b)
    def roots(self) -> list[UOp]: return _shards(self.tensors)
    def held_buffers(self, among: Container[UOp]) -> set[UOp]: return _held_buffers(self.lazy, among)
    def apply_and_hold(self, replacements: dict[UOp, UOp], among: Container[UOp]) -> set[UOp]:
        """apply(replacements), then held_buffers(among), in one pass over the lazy tensors (a replay's common case:
        no BUFFER is replaced, and the tensors realized are re-pointed straight at their buffers)."""
        if any(k.op is _BUFFER for k in replacements):  # (a replaced buffer makes realized tensors lazy: see apply)
            self.apply(replacements)
            return self.held_buffers(among)
        changed = {k: v for k, v in replacements.items() if k is not v}
        sub, below = SharedSubstitution(changed), BuffersBelow(among)
        for t in self.lazy:
            u = t._uop
            if (v := changed.get(u)) is not None:
                if _undo is not None: _undo.append((t, u))
                # (the setter's registration is not needed: a tensor of self.lazy is registered as lazy already, and
                # leaves the registry below once it is a plain buffer)
                t._uop = u = v
            elif not (u.op is _BUFFER or (u.op is _RESHAPE and u.src[0].op is _BUFFER)) and changed:
                # (as _apply_map)
                if (v := sub(u)) is not u:
                    if _undo is not None: _undo.append((t, u))
                    t.uop = u = v
            # (as _held_buffers)
            if (base := u.base).op is _BUFFER:
                if base in among: below.found.add(base)
            else: below.walk(u)
            if _is_plain_buffer(u): _lazy_refs.pop(id(t), None)
        self._mark_deferred()
        return below.found

def _unpacked(buf: Any, n: int, fmt: str) -> list:
    """The first `n` values of a device Buffer as Python scalars (`fmt`: their struct format), copied out of the
    device (no host view of its memory is made)."""
    raw = buf.copyout(memoryview(bytearray(buf.nbytes))) if buf.nbytes else b""
    return list(struct.unpack_from(f"<{n}{fmt}", raw))

def _is_plain_buffer(u: UOp) -> bool:
    """A buffer, or a reshape of one to another non-empty shape (what a realized tensor is): its graph has nothing to
    schedule or simplify, and no Variables. (A training loop realizes its loss after the step has computed it.)"""
    if (op := u.op) is _BUFFER: return True
    if op is not _RESHAPE or u.src[0].op is not _BUFFER: return False
    # (memoized in the node: every realized tensor is asked when it is re-pointed and when its schedule ends)
    if (plain := (d := u.__dict__).get("_plain")) is None:
        plain = d["_plain"] = u.arg != u.src[0].shape and all(type(s) is int for s in u.arg) and prod(u.arg) != 0
    return plain

_BUFFER, _RESHAPE, _MULTI, _ADD, _MUL, _NEG, _CONST = Ops.BUFFER, Ops.RESHAPE, Ops.MULTI, Ops.ADD, Ops.MUL, Ops.NEG, \
    Ops.CONST
_FLOAT32, _BOOL = dtypes.float32, dtypes.bool
_EXPAND, _REDUCE_AXIS, _MAX, _DETACH, _CUSTOM_GRAD, _FDIV = Ops.EXPAND, Ops.REDUCE_AXIS, Ops.MAX, Ops.DETACH, \
    Ops.CUSTOM_GRAD, Ops.FDIV
_CAST, _INDEX, _WHERE, _ASSIGN = Ops.CAST, dtypes.index, Ops.WHERE, Ops.ASSIGN
_RELU_GRADIENT = ClampGradient(True, False, False, True)
_sum_acc: dict[DType, DType] = {}   # sum_acc_dtype of each dtype asked (every sum asks)
_FLOATS_ONLY = frozenset(d for d in DTYPES_DICT.values() if dtypes.is_float(d))

# the DEVICE node of each device name an operation has used (kept: there are few, and every constant operand needs one)
_device_nodes: dict[str, UOp] = {}

def _device_node(device: str) -> UOp:
    if (u := _device_nodes.get(device)) is None: u = _device_nodes[device] = _device_uop(device)
    return u
# the dtypes that are their own sum's accumulator and their own promotion with themselves (matmul's common case)
_HALF_TYPES = (dtypes.float16, dtypes.bfloat16)   # (summed in float32)
_OWN_ACCUMULATOR = tuple(d for d in (dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int64, dtypes.uint32,
                                     dtypes.uint64) if sum_acc_dtype(d) == d and least_upper_dtype(d, d) == d)
_new_tensor = object.__new__

def _shape_arg(shape: Any) -> tuple[sint, ...]:
    shp = (shape,) if isinstance(shape, (int, UOp)) else tuple(shape)
    for s in shp:
        if is_symbolic(s): continue
        if not isinstance(s, int) or isinstance(s, bool): raise TypeError(f"shape entries must be ints, got {shape!r}")
        if s < 0: raise ValueError(f"negative dimension in shape {shp}")
    return tuple(ssimplify(s) for s in shp)

def _infer_shape(shape: tuple, numel: sint, old: tuple[sint, ...]) -> tuple[sint, ...]:
    # the common case first: plain non-negative ints of the right product (every reshape inside matmul, conv, ...)
    if all(type(s) is int and s >= 0 for s in shape) and type(numel) is int and prod(shape) == numel: return shape
    if any(s is None for s in shape):
        # None keeps the size of that dim, as tinygrad
        if any(s is None for s in shape[len(old):]): raise IndexError(f"reshape {shape}: None past the {len(old)} dims")
        shape = tuple(old[i] if s is None else s for i, s in enumerate(shape))
    if any(not is_symbolic(s) and (not isinstance(s, int) or isinstance(s, bool)) for s in shape):
        raise TypeError(f"reshape sizes must be ints, got {shape}")
    shape = tuple(ssimplify(s) for s in shape)
    fixed = [s for s in shape if isinstance(s, int)]
    if sum(s == -1 for s in fixed) > 1: raise ValueError(f"reshape {shape}: only one dimension can be -1")
    if any(s < -1 for s in fixed): raise ValueError(f"reshape {shape}: negative size")
    if -1 in fixed:
        known = prod(s for s in shape if not isinstance(s, int) or s != -1)
        rest = ssimplify(numel // known) if not sym_eq(known, 0) else None
        if rest is None or not sym_eq(rest * known, numel):
            raise ShapeError(f"can't reshape {old} ({numel} elements) to {shape}")
        shape = tuple(rest if isinstance(s, int) and s == -1 else s for s in shape)
    if not sym_eq(prod(shape), numel):
        raise ShapeError(f"can't reshape {old} ({numel} elements) to {shape} ({prod(shape)})")
    return tuple(shape)

# the constructor as defined here (tensor/explain.py wraps it while sources are tracked: Tensor._of then calls it)
_plain_init = Tensor.__init__

# Context(TRAINING=1) (tinygrad's way) switches the same training mode that Tensor.train() does
Tensor.training = bool(TRAINING.value)
TRAINING.on_set = lambda value: setattr(Tensor, "training", bool(value))
_install_source_tracking()

__all__ = ["Tensor"]
