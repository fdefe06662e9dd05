"""Several processes working as one over MPI: collectives on tensors and data-parallel training.

Start the processes with MPI's launcher, e.g. `mpirun -n 2 python train.py`; each one runs the same program and
`rank()` tells them apart. Needs mpi4py and an MPI library (`pip install 'fusegrad[dist]'` installs both as wheels);
`import fusegrad` never imports mpi4py, this module does on the first call that needs it.

    import fusegrad.distributed as dist
    total = dist.all_reduce(Tensor([float(dist.rank())]))       # the sum over every rank, on every rank
    dp = dist.DataParallel(model)                                # parameters from rank 0 to all
    loss.backward(); dp.sync_gradients(); opt.step()             # gradients averaged over the ranks

Collectives hand the tensor's own host memory to MPI (no copy through Python objects) and return a new realized
tensor; the variants ending in `_` overwrite their argument. They run as steps of fusegrad's schedules (ExecItems
with a runner of their own), so a TinyJit function that calls them replays them on every call like its kernels:
`sync_gradients()` may sit inside a jitted training step.

Every rank must make the same calls in the same order with tensors of the same shape and dtype, as with any MPI
collective. Before any data moves, each call (replays under TinyJit too) compares with the other ranks what it is
about to do, in one all-reduce of four numbers: the collective's kind and what bounds its transfer (dtype, element
count, op, root), and with `check=True` (the default) a hash of all its arguments, shapes included. A mismatch raises
ValueError on every rank, naming what each rank called, instead of hanging, reading or writing past a buffer's end, or
mixing up bytes. `check=False` only skips hashing the shapes, so ranks may pass the same elements in different shapes.

No rank is left waiting forever for one that is gone: a rank that dies of an uncaught exception aborts all of them
(`init()` chains a `sys.excepthook` that calls MPI_Abort); one that leaves normally (the end of its script, or
`sys.exit` with any code) first meets the others at exit, and aborts the job if any of them is in a collective
instead; one killed by a signal or `os._exit` is noticed by mpirun, which ends the job."""
from __future__ import annotations
import array
import atexit
import hashlib
import os
import sys
import time
from typing import Any, Callable
from fusegrad.device import Buffer
from fusegrad.dtype import DType, dtypes
from fusegrad.engine.realize import ExecItem, Runner, run_schedule
from fusegrad.helpers import CPU_THREADS, prod
from fusegrad.hostcpu import host_cpu_count
from fusegrad.renderer import Estimates
from fusegrad.tensor import Tensor
from fusegrad.uop.graph import new_buffer
from fusegrad.uop.ops import Ops, UOp, buffer_node, device_buffer

__all__ = ["init", "is_initialized", "rank", "world_size", "communicator", "all_reduce", "all_reduce_", "broadcast",
           "broadcast_", "all_gather", "barrier", "DataParallel"]

REDUCE_OPS = ("sum", "mean", "max")
# MPI has no standard half-precision type to reduce on: these are reduced in float32 and rounded back once
_WIDENED = (dtypes.float16, dtypes.bfloat16)

_state: dict[str, Any] = {}   # once initialized: "MPI" (the mpi4py module), "comm", "types" (dtype -> MPI datatype),
#                               and with several ranks "pid" (the rank's process)

# *** setup ***

def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # RuntimeError: mpi4py is there but can't load an MPI library
        raise ImportError(f"fusegrad.distributed needs mpi4py and an MPI library ({e}); install them with "
                          "pip install 'fusegrad[dist]'") from e
    return MPI

def init() -> None:
    """Initialize MPI (once; later calls do nothing). Without mpirun the process is a world of one rank.

    With more than one rank it also installs a `sys.excepthook` (after the previous one has printed the traceback)
    that aborts every rank: otherwise the others would wait forever in their next collective. And when several
    ranks share a machine and CPU_THREADS is not set, each rank's kernels use its share of the cores (ranks that
    each run kernels on every core oversubscribe them, and a collective waits for the slowest)."""
    if "comm" in _state: return
    MPI = _import_mpi()
    if not MPI.Is_initialized(): MPI.Init()
    comm = MPI.COMM_WORLD
    _state["MPI"], _state["comm"], _state["types"] = MPI, comm, _type_table(MPI)
    if comm.Get_size() > 1:
        _install_excepthook(comm)
        _state["pid"] = os.getpid()
        atexit.register(_leave)  # runs before mpi4py finalizes MPI (that is a C-level exit hook)
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        if CPU_THREADS.value <= 0 and local.Get_size() > 1:
            CPU_THREADS.value = max(1, host_cpu_count() // local.Get_size())
        local.Free()

def _install_excepthook(comm: Any) -> None:
    previous = sys.excepthook
    def abort_all(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(tp, value, tb)
            print(f"fusegrad.distributed: rank {comm.Get_rank()} raised {tp.__name__}; aborting all ranks",
                  file=sys.stderr)
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            comm.Abort(1)
    sys.excepthook = abort_all

def is_initialized() -> bool:
    """Whether `init()` has run in this process."""
    return "comm" in _state

def communicator() -> Any:
    """The mpi4py communicator the collectives use (COMM_WORLD), initializing MPI if needed."""
    init()
    return _state["comm"]

def rank() -> int:
    """This process's number, 0 .. world_size() - 1 (initializes MPI if needed)."""
    return communicator().Get_rank()

def world_size() -> int:
    """The number of processes (initializes MPI if needed)."""
    return communicator().Get_size()

# *** buffers and MPI datatypes ***

def _type_table(MPI: Any) -> dict[DType, Any]:
    """fusegrad dtype -> MPI datatype. float16 and bfloat16 move as 16-bit integers (bit for bit)."""
    return {dtypes.bool: MPI.C_BOOL, dtypes.int8: MPI.INT8_T, dtypes.uint8: MPI.UINT8_T, dtypes.int16: MPI.INT16_T,
            dtypes.uint16: MPI.UINT16_T, dtypes.int32: MPI.INT32_T, dtypes.uint32: MPI.UINT32_T,
            dtypes.int64: MPI.INT64_T, dtypes.uint64: MPI.UINT64_T, dtypes.float16: MPI.UINT16_T,
            dtypes.bfloat16: MPI.UINT16_T, dtypes.float32: MPI.FLOAT, dtypes.float64: MPI.DOUBLE}

def _mpi_type(dt: DType) -> Any:
    if (t := _state["types"].get(dt)) is None: raise TypeError(f"fusegrad.distributed has no MPI datatype for {dt}")
    return t

def _mpi_op(op: str, dt: DType) -> Any:
    """The MPI reduction for `op` on `dt` (validated: a bad op or dtype raises before anything is sent)."""
    if op not in REDUCE_OPS: raise ValueError(f"unknown reduction {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    MPI = _state["MPI"]
    if dt == dtypes.bool:
        # MPI reduces C_BOOL only with logical ops; the max of booleans is their or
        if op != "max": raise TypeError(f"all_reduce {op!r} of a bool tensor: cast it to an integer dtype first")
        return MPI.LOR
    return MPI.MAX if op == "max" else MPI.SUM

def _check_tensor(t: Any, what: str) -> None:
    if not isinstance(t, Tensor): raise TypeError(f"{what} takes a Tensor, got {type(t).__name__}")
    if not all(isinstance(s, int) for s in t.shape):
        raise ValueError(f"{what} needs a concrete shape, got the symbolic shape {t.shape}")

def _realized(t: Tensor) -> tuple[Tensor, Buffer]:
    """`t` as a realized tensor with its elements in one buffer in row-major order (a kernel copies views), and
    that buffer. (Not Tensor._buffer: this also works while TinyJit captures, the buffer read happens at run time.)"""
    if not _is_plain(t):
        if buffer_node(t.uop) is None: t = t.contiguous()
        t.realize()
    buf = device_buffer(t.uop)
    assert buf.size == prod(t.shape), f"{buf} holds {buf.size} elements for a tensor of shape {t.shape}"
    return t, buf

def _is_plain(t: Tensor) -> bool:
    """Whether `t` is its own buffer (possibly reshaped): writing that buffer in place changes exactly `t`."""
    u = t.uop
    while u.op is Ops.RESHAPE: u = u.src[0]
    return u.op is Ops.BUFFER

def _fresh(shape: tuple[int, ...], dtype: DType, device: str) -> tuple[Tensor, Buffer]:
    """A new allocated tensor of `shape` (its contents are whatever the collective writes)."""
    node = new_buffer(UOp(Ops.DEVICE, arg=device), prod(shape), dtype)
    buf = device_buffer(node).ensure_allocated()
    return Tensor(node.reshape(shape) if shape != (prod(shape),) else node), buf

# *** collectives as schedule steps ***

_MPI_AST = UOp(Ops.NOOP, arg="mpi")

class _Collective(Runner):
    """Runs an MPI call on host views of its buffers. bufs[0] is written: on a device without host memory its view
    is a copy, written back afterwards. `profile_args` is what PROFILE's timeline shows of it: its kind, the bytes
    it moves, this rank, the world's size and the call's op, root and dtype where it has them."""
    def __init__(self, call: _Call, device: str, nbytes: int, fn: Callable[..., None]):
        super().__init__(f"mpi {call.kind} {nbytes:8d}", device, Estimates(mem=nbytes))
        self.fn = fn
        comm = _state["comm"]
        self.profile_args = {"kind": call.kind, "bytes": nbytes, "rank": comm.Get_rank(),
                             "world_size": comm.Get_size(),
                             **{k: v if isinstance(v, (int, str)) else str(v) for k, v in call.args.items()
                                if k in ("op", "root", "dtype")}}

    def __call__(self, rawbufs: list[Buffer], var_vals: dict[str, int], wait: bool = False) -> float | None:
        st = time.perf_counter()
        views = [b.as_buffer() for b in rawbufs]
        self.fn(*views)
        if rawbufs and not hasattr(rawbufs[0].allocator, "_as_buffer"): rawbufs[0].copyin(views[0])
        return time.perf_counter() - st if wait else None

def _digest(obj: Any) -> int:
    """A 56-bit hash of `obj`'s repr, the same in every process (Python's own hash of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")

_NONE = -(1 << 63)  # a rank that doesn't check the full arguments sends this (the least int64) in their place

class _Call:
    """One collective as this rank calls it: its kind and arguments. `key` hashes what the ranks must agree on for
    the transfer to stay inside every buffer (the kind, the element count, every argument but shapes); `full` hashes
    all arguments when checked."""
    def __init__(self, kind: str, count: int, check: bool, **args: Any):
        self.kind, self.args = kind, args
        self.key = _digest((kind, count, [(k, v) for k, v in args.items() if k not in ("shape", "shapes")]))
        self.full = _digest((kind, args)) if check else None

    def __repr__(self) -> str:
        if self.kind == "exit": return "no collective, leaving the program (the end of its script or sys.exit)"
        return f"{self.kind}({', '.join(f'{k}={v}' for k, v in self.args.items())})"

_EXIT = _Call("exit", 0, False)

def _agree(call: _Call) -> None:
    """Compare `call` with what every other rank is calling now, before any data moves; on a mismatch every rank
    learns what each called, and raises ValueError (or, where a rank is leaving the program, aborts the job)."""
    comm, MPI = _state["comm"], _state["MPI"]
    if comm.Get_size() == 1: return
    checked = call.full is not None
    both = array.array("q", [call.key, -call.key, call.full if checked else _NONE, -call.full if checked else _NONE])
    comm.Allreduce(MPI.IN_PLACE, [both, MPI.INT64_T], op=MPI.MAX)
    # each pair is (the max of x, the max of -x): they agree only if x is the same on every rank sending one
    if both[0] == -both[1] and (both[3] == _NONE or both[2] == -both[3]): return
    calls = comm.allgather((call.kind, repr(call)))  # only on a mismatch: the readable reason, for every rank
    detail = "; ".join(f"rank {r}: {desc}" for r, (_, desc) in enumerate(calls))
    if any(kind == "exit" for kind, _ in calls):
        # the job can't go on without the ranks that leave: every rank says why and aborts (whichever is first)
        gone = ", ".join(str(r) for r, (kind, _) in enumerate(calls) if kind == "exit")
        print(f"fusegrad.distributed: rank {gone} is leaving the program while other ranks are in a collective "
              f"({detail}); aborting all ranks", file=sys.stderr)
        sys.stdout.flush(); sys.stderr.flush()
        comm.Abort(1)
    if len({kind for kind, _ in calls}) > 1:
        raise ValueError(f"{call.kind}: the ranks called different collectives ({detail}); every rank must make the "
                         "same collective calls in the same order")
    raise ValueError(f"{call.kind}: the ranks' arguments differ ({detail}); every rank must pass tensors of the same "
                     "shape and dtype (and the same op and root)")

def _leave() -> None:
    """At exit: meet the other ranks, which are leaving too unless one is still in a collective (then `_agree` aborts
    the job: otherwise that rank would wait forever for this one)."""
    # (a process forked from a rank inherits this hook, but it is no rank)
    if os.getpid() == _state["pid"] and not _state["MPI"].Is_finalized(): _agree(_EXIT)

def _check_same(what: str, **args: Any) -> None:
    """Raise ValueError on every rank unless every rank calls `what` now with equal `args` (one all-reduce)."""
    _agree(_Call(what, 0, True, **args))

def _run(call: _Call, bufs: list[Buffer], fn: Callable[..., None]) -> None:
    """Run `fn` on the buffers' memory as a schedule step, so TinyJit captures it and replays it with the kernels.
    The step first agrees on `call` with the other ranks (each replay too); `fn` runs only if the buffers hold
    anything."""
    if not all(b.size for b in bufs): bufs, fn = [], lambda *_: None
    def step(*views: memoryview) -> None:
        _agree(call)
        fn(*views)
    device = bufs[0].device if bufs else "CPU"
    nbytes = bufs[0].nbytes if bufs else 0
    run_schedule([ExecItem(_MPI_AST, list(bufs), prg=_Collective(call, device, nbytes, step))])

def all_reduce(t: Tensor, op: str = "sum", check: bool = True) -> Tensor:
    """A new tensor of the element-wise `op` ("sum", "mean" or "max") over every rank's `t`, the same on all ranks.

    "mean" is the sum divided by world_size() (an integer tensor gives a float one, as `t / n` does). float16 and
    bfloat16 are reduced in float32 and rounded back once. bool tensors take only "max" (a logical or)."""
    init()
    _check_tensor(t, "all_reduce")
    wide = t.dtype in _WIDENED
    src = t.float() if wide else t
    mpi_op, mpi_type = _mpi_op(op, src.dtype), _mpi_type(src.dtype)
    call = _Call("all_reduce", prod(t.shape), check, op=op, shape=t.shape, dtype=t.dtype)
    src, sbuf = _realized(src)
    out, obuf = _fresh(t.shape, src.dtype, src.device)
    comm = _state["comm"]
    _run(call, [obuf, sbuf], lambda o, s: comm.Allreduce([s, mpi_type], [o, mpi_type], op=mpi_op))
    if op == "mean": out = out / world_size()
    if wide: out = out.cast(t.dtype)
    return out.realize() if op == "mean" or wide else out

def all_reduce_(t: Tensor, op: str = "sum", check: bool = True) -> Tensor:
    """`all_reduce` written into `t` itself (a lazy `t` is realized first); returns `t`. Lazy tensors built from `t`
    earlier and realized later see the reduced values. "mean" needs a float tensor."""
    init()
    _check_tensor(t, "all_reduce_")
    if op == "mean" and not dtypes.is_float(t.dtype):
        raise TypeError(f"in-place all_reduce_ 'mean' of a {t.dtype} tensor can't hold the quotient; use all_reduce")
    if t.dtype in _WIDENED:  # reduced through a float32 copy anyway
        out = all_reduce(t, op, check)
        if prod(t.shape): t.assign(out).realize()  # (there is nothing to write into an empty tensor)
        return t
    _mpi_op(op, t.dtype)
    return _all_reduce_inplace(t, op, _Call("all_reduce", prod(t.shape), check, op=op, shape=t.shape,
                                            dtype=t.dtype))

def _all_reduce_inplace(t: Tensor, op: str, call: _Call) -> Tensor:
    mpi_op, mpi_type = _mpi_op(op, t.dtype), _mpi_type(t.dtype)
    if not _is_plain(t): t.replace(t.contiguous())
    t, buf = _realized(t)
    comm, MPI = _state["comm"], _state["MPI"]
    _run(call, [buf], lambda b: comm.Allreduce(MPI.IN_PLACE, [b, mpi_type], op=mpi_op))
    if op == "mean" and buf.size: t.assign(t / world_size()).realize()
    return t

def _check_root(root: int) -> None:
    n = world_size()
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < n:
        raise ValueError(f"broadcast root must be a rank in 0..{n - 1}, got {root!r}")

def broadcast(t: Tensor, root: int = 0, check: bool = True) -> Tensor:
    """A new tensor holding rank `root`'s `t`, on every rank. Every rank passes a tensor of the same shape and dtype
    (the non-root ranks' values are not read)."""
    init()
    _check_tensor(t, "broadcast")
    _check_root(root)
    mpi_type = _mpi_type(t.dtype)
    call = _Call("broadcast", prod(t.shape), check, root=root, shape=t.shape, dtype=t.dtype)
    src, sbuf = _realized(t)
    out, obuf = _fresh(t.shape, t.dtype, t.device)
    comm = _state["comm"]
    def bcast(o: memoryview, s: memoryview) -> None:
        if comm.Get_rank() == root: o[:] = s  # one memcpy into the result, which is what gets sent
        comm.Bcast([o, mpi_type], root=root)
    _run(call, [obuf, sbuf], bcast)
    return out

def broadcast_(t: Tensor, root: int = 0, check: bool = True) -> Tensor:
    """`broadcast` into `t` itself (a lazy `t` is realized first): afterwards every rank's `t` is rank `root`'s."""
    init()
    _check_tensor(t, "broadcast_")
    _check_root(root)
    _mpi_type(t.dtype)
    return _broadcast_inplace(t, root, _Call("broadcast", prod(t.shape), check, root=root, shape=t.shape,
                                             dtype=t.dtype))

def _broadcast_inplace(t: Tensor, root: int, call: _Call) -> Tensor:
    mpi_type = _mpi_type(t.dtype)
    if not _is_plain(t): t.replace(t.contiguous())
    t, buf = _realized(t)
    comm = _state["comm"]
    _run(call, [buf], lambda b: comm.Bcast([b, mpi_type], root=root))
    return t

def all_gather(t: Tensor, check: bool = True) -> Tensor:
    """Every rank's `t` concatenated along axis 0 in rank order, on every rank: shape (n * d0, d1, ...) for n ranks
    (a 0-d tensor gives shape (n,)). All ranks pass the same shape and dtype."""
    init()
    _check_tensor(t, "all_gather")
    mpi_type = _mpi_type(t.dtype)
    call = _Call("all_gather", prod(t.shape), check, shape=t.shape, dtype=t.dtype)
    n = world_size()
    shape = (n,) if t.ndim == 0 else (n * t.shape[0],) + t.shape[1:]
    src, sbuf = _realized(t)
    out, obuf = _fresh(shape, t.dtype, t.device)
    comm = _state["comm"]
    _run(call, [obuf, sbuf], lambda o, s: comm.Allgather([s, mpi_type], [o, mpi_type]))
    return out

def barrier() -> None:
    """Wait until every rank has called barrier() (a schedule step too, so a jitted function keeps it). The
    all-reduce that compares the ranks' calls is the barrier: no rank leaves it before every rank has entered it."""
    init()
    _run(_Call("barrier", 0, True), [], lambda: None)

# *** data-parallel training ***

class DataParallel:
    """Data-parallel training: every rank holds the whole model, trains on its own share of each batch, and the
    gradients are averaged before each optimizer step, so all ranks take the same step.

        dp = DataParallel(model)     # or a list of tensors; rank 0's values are broadcast to every rank
        ...
        loss.backward()
        dp.sync_gradients()          # every .grad becomes the mean over the ranks
        opt.step()

    With equal local batches and a loss that is a mean over the batch, the averaged gradient is the full batch's, so
    training matches one process on the whole batch (up to rounding). `sync_gradients` works inside a TinyJit step
    (its MPI call is captured and replayed). Tensors without gradients (batchnorm running statistics) are not
    averaged: each rank keeps its own unless `broadcast_parameters()` is called again."""

    def __init__(self, model: Any, root: int = 0):
        from fusegrad.nn.state import get_parameters
        init()
        if isinstance(model, (list, tuple)) and all(isinstance(p, Tensor) for p in model):
            params = list(dict.fromkeys(model))
        else: params = get_parameters(model)
        self.params = [p for p in params if prod(p.shape)]  # an empty tensor has nothing to send
        if not self.params: raise ValueError("DataParallel found no tensors in the model")
        self.root = root
        self.broadcast_parameters(root)

    def broadcast_parameters(self, root: int | None = None) -> None:
        """Overwrite every rank's parameters (all tensors of the model) with rank `root`'s: one broadcast per dtype."""
        root = self.root if root is None else root
        _check_root(root)
        _check_same("broadcast_parameters", root=root, shapes=[(p.shape, p.dtype) for p in self.params])
        for dt, group in _by_dtype(self.params, lambda p: p.dtype).items():
            count = sum(prod(p.shape) for p in group)
            flat = _broadcast_inplace(_pack(group, dt), root, _Call("broadcast_parameters", count, False, root=root,
                                                                   dtype=dt))
            Tensor.realize(*[p.assign(v) for p, v in zip(group, _unpack(flat, group))])

    def sync_gradients(self) -> None:
        """Replace every parameter's gradient by its mean over the ranks: the gradients of each dtype are packed
        into one buffer and reduced by one MPI all-reduce (half precision is reduced in float32). Parameters without
        a gradient are skipped (the same ones on every rank)."""
        n = world_size()
        if n == 1: return
        with_grad = [p for p in self.params if p.grad is not None]
        groups = _by_dtype(with_grad, lambda p: dtypes.float32 if p.grad.dtype in _WIDENED else p.grad.dtype)
        packed = {dt: _pack([p.grad for p in group], dt) for dt, group in groups.items()}
        # the gradients and their packed copies in one schedule; the gradients are realized on their own, as packing
        # lazy ones fused every gradient's reduction into the concatenation's kernel (20 ms instead of 1 for an MLP)
        Tensor.realize(*[p.grad for p in with_grad], *packed.values())
        for dt, group in groups.items():
            # every group's all-reduce checks its gradients' shapes before it moves them
            call = _Call("sync_gradients", prod(packed[dt].shape), True, dtype=dt,
                         shapes=[(p.grad.shape, p.grad.dtype) for p in group])
            total = _all_reduce_inplace(packed[dt], "sum", call)
            for p, g in zip(group, _unpack(total, [p.grad for p in group])):
                # the division fuses into the optimizer's kernels
                p.grad = (g / n).cast(p.grad.dtype)

def _by_dtype(ts: list[Tensor], key: Callable[[Tensor], DType]) -> dict[DType, list[Tensor]]:
    groups: dict[DType, list[Tensor]] = {}
    for t in ts: groups.setdefault(key(t), []).append(t)
    return groups

def _pack(ts: list[Tensor], dt: DType) -> Tensor:
    """The tensors flattened and concatenated into one `dt` tensor (lazy)."""
    flat = [t.flatten().cast(dt) for t in ts]
    return flat[0].cat(*flat[1:]) if len(flat) > 1 else flat[0].contiguous()

def _unpack(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Views of `flat` shaped like each of `like` (the inverse of _pack, before casting back)."""
    out, at = [], 0
    for t in like:
        n = prod(t.shape)
        out.append(flat[at:at + n].reshape(t.shape))
        at += n
    return out
