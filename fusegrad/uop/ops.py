"""The one IR: `UOp(op, dtype, src, arg)`, immutable and hash-consed, with the `Ops` every stage uses."""
from __future__ import annotations
import gc
import itertools
import math
import struct
import threading
import weakref
from enum import Enum, auto
from typing import Any, Callable
from fusegrad.device import Buffer
from fusegrad.dtype import ConstType, DType, PtrDType, dtypes, truncate_float
from fusegrad.helpers import prod

class Ops(Enum):
    """Every operation of every stage. Tensor graph, kernel AST and linearized programs share them."""
    # graph structure
    SINK = auto(); NOOP = auto(); UNIQUE = auto(); DEVICE = auto(); KERNEL = auto()
    # tensor level
    BUFFER = auto(); BUFFER_VIEW = auto(); COPY = auto(); ASSIGN = auto(); CONTIGUOUS = auto(); DETACH = auto()
    CONTIGUOUS_BACKWARD = auto(); CUSTOM_GRAD = auto()
    # an elementwise function of many operations as one node: COMPOSITE(*operands), arg a tensor/composite.py Composite,
    # whose graph the node becomes when scheduled or differentiated (arg.expand(src), arg.gradients(grad, src))
    COMPOSITE = auto()
    # a tensor split over several devices: one source per device (its shard), arg the split axis (None: replicas)
    MULTI = auto()
    REDUCE_AXIS = auto()
    # movement ops (tensor level; turned into index expressions by the scheduler)
    RESHAPE = auto(); PERMUTE = auto(); EXPAND = auto(); PAD = auto(); SHRINK = auto(); FLIP = auto()
    # kernel level
    DEFINE_GLOBAL = auto(); DEFINE_LOCAL = auto(); DEFINE_REG = auto(); DEFINE_VAR = auto(); BIND = auto()
    RANGE = auto(); END = auto(); REDUCE = auto(); INDEX = auto(); LOAD = auto(); STORE = auto()
    VECTORIZE = auto(); GEP = auto(); CAT = auto(); UNROLL = auto(); CONTRACT = auto(); BARRIER = auto()
    IF = auto(); ENDIF = auto(); SPECIAL = auto(); CUSTOM = auto()
    # a warp's matrix multiply-accumulate on tensor cores: WMMA(A fragment, B fragment, C accumulator), each a vector of
    # the lane's elements; arg: the instruction (renderer/__init__.py TensorCore.wmma_arg, lane layout included)
    WMMA = auto()
    # a CPU kernel's copy of a w x w block transposed: TRANSPOSED_COPY(dst INDEX, src INDEX), arg (w, dst_step,
    # src_step), is dst[j * dst_step + i] = src[i * src_step + j] for i, j < w, where the INDEXes point (a PACK copy of
    # `x @ W.T`'s W, codegen/opt/__init__.py; renderers with `transposed_copy`)
    TRANSPOSED_COPY = auto()
    # values
    CONST = auto(); VCONST = auto(); CAST = auto(); BITCAST = auto()
    # unary ALU
    NEG = auto(); RECIP = auto(); SQRT = auto(); EXP2 = auto(); LOG2 = auto(); SIN = auto(); TRUNC = auto()
    NOT = auto()
    # binary ALU
    ADD = auto(); SUB = auto(); MUL = auto(); FDIV = auto(); IDIV = auto(); MOD = auto(); MAX = auto(); POW = auto()
    CMPLT = auto(); CMPNE = auto(); CMPEQ = auto(); AND = auto(); OR = auto(); XOR = auto(); SHL = auto(); SHR = auto()
    THREEFRY = auto()
    # ternary ALU
    WHERE = auto(); MULACC = auto()
    # tensor level: SCATTER(target, positions, values, arg=combine) is the target with each value combined into (arg
    # None: written over) the flat position beside it, in the values' row-major order; positions outside: nowhere
    SCATTER = auto()
    # lowered kernels: PREFETCH(INDEX) asks for the memory at the index to be brought into the cache, reading nothing
    # (an address past the buffer's end is allowed: codegen/prefetch.py)
    PREFETCH = auto()

    def __repr__(self) -> str: return f"Ops.{self.name}"
    # members are singletons compared by identity; Enum's default hashes the name in Python, which is slow on the
    # hot paths (UOp cache keys, pattern dispatch)
    __hash__ = object.__hash__

# the arg of a BARRIER that only orders: its value is its first source (a local buffer) after its other sources, with
# no synchronization of the work-items (renderers write nothing for it; codegen/opt/tc.py's double buffering)
ORDER_ONLY = "order"

class GroupOp:
    """Named sets of Ops, so passes can talk about families of operations."""
    Unary = {Ops.NEG, Ops.RECIP, Ops.SQRT, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.TRUNC, Ops.NOT}
    Binary = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.POW, Ops.CMPLT, Ops.CMPNE, Ops.CMPEQ,
              Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR, Ops.THREEFRY}
    Ternary = {Ops.WHERE, Ops.MULACC}
    ALU = Unary | Binary | Ternary
    Elementwise = ALU | {Ops.CAST, Ops.BITCAST}
    Movement = {Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.PAD, Ops.SHRINK, Ops.FLIP}
    Commutative = {Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPNE, Ops.CMPEQ, Ops.AND, Ops.OR, Ops.XOR}
    Associative = {Ops.ADD, Ops.MUL, Ops.AND, Ops.OR, Ops.MAX}
    Comparison = {Ops.CMPLT, Ops.CMPNE, Ops.CMPEQ}
    Idempotent = {Ops.AND, Ops.OR, Ops.MAX}
    Buffer = {Ops.LOAD, Ops.STORE}

# *** constant folding: what every ALU op computes, with C semantics for integers ***

def _c_idiv(x: int, y: int) -> int:
    """Integer division truncating toward zero, as C does (division by zero gives 0 rather than raising)."""
    if y == 0: return 0
    q = abs(x) // abs(y)
    return q if (x < 0) == (y < 0) else -q

def _c_mod(x: int, y: int) -> int:
    """The remainder with the sign of the dividend, as C's % (modulo by zero gives 0)."""
    return x - _c_idiv(x, y) * y if y != 0 else 0

def _safe_exp2(x: float) -> float:
    try: return 2.0 ** x
    except OverflowError: return math.inf

def _safe_log2(x: float) -> float:
    if x == 0: return -math.inf
    return math.log2(x) if x > 0 else math.nan

def _safe_sqrt(x: float) -> float: return math.sqrt(x) if x >= 0 else math.nan
def _safe_recip(x: float) -> float: return 1 / x if x != 0 else math.copysign(math.inf, x)
def _safe_sin(x: float) -> float: return math.sin(x) if not math.isinf(x) else math.nan
def _safe_fdiv(x: float, y: float) -> float:
    if y != 0: return x / y
    return math.nan if x == 0 or math.isnan(x) else math.copysign(math.inf, x) * math.copysign(1, y)

python_alu: dict[Ops, Callable[..., Any]] = {
    Ops.NEG: lambda x: (not x) if isinstance(x, bool) else -x, Ops.RECIP: _safe_recip, Ops.SQRT: _safe_sqrt,
    Ops.EXP2: _safe_exp2, Ops.LOG2: _safe_log2, Ops.SIN: _safe_sin,
    Ops.TRUNC: lambda x: x if math.isinf(x) or math.isnan(x) else float(math.trunc(x)), Ops.NOT: lambda x: not x,
    Ops.ADD: lambda x, y: x + y, Ops.SUB: lambda x, y: x - y, Ops.MUL: lambda x, y: x * y, Ops.FDIV: _safe_fdiv,
    Ops.IDIV: _c_idiv, Ops.MOD: _c_mod, Ops.MAX: max, Ops.POW: lambda x, y: x ** y,
    Ops.CMPLT: lambda x, y: x < y, Ops.CMPNE: lambda x, y: x != y, Ops.CMPEQ: lambda x, y: x == y,
    Ops.AND: lambda x, y: x & y, Ops.OR: lambda x, y: x | y, Ops.XOR: lambda x, y: x ^ y,
    Ops.SHL: lambda x, y: x << y, Ops.SHR: lambda x, y: x >> y,
    Ops.WHERE: lambda c, x, y: x if c else y, Ops.MULACC: lambda x, y, z: x * y + z,
}

def exec_alu(op: Ops, dtype: DType, operands: tuple[ConstType, ...]) -> ConstType:
    """Evaluate ALU `op` on Python scalars and wrap/round the result to `dtype`, as the target would."""
    if op in (Ops.SHL, Ops.SHR) and not 0 <= operands[1] < 8 * dtype.itemsize: return 0
    if dtypes.is_int(dtype) and op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.MULACC) and \
            any(isinstance(o, float) for o in operands):
        operands = tuple(int(o) for o in operands)
    if dtypes.is_float(dtype) and op is Ops.POW and operands[0] < 0 and not float(operands[1]).is_integer():
        return math.nan
    try: ret = python_alu[op](*operands)
    except (OverflowError, ZeroDivisionError, ValueError): return math.nan if dtypes.is_float(dtype) else 0
    return dtypes.as_const(ret, dtype)

# *** the UOp ***

def _arg_key(arg: Any) -> Any:
    """A cache key for a UOp arg that tells apart what `==` conflates: 0.0 vs -0.0, 1 vs True vs 1.0, and that finds
    nan again (a nan is != itself, so it could never be looked up by value)."""
    t = type(arg)
    if t is tuple:
        # (a tuple of plain ints, most shapes, is its own key: checked without a call per entry, as this runs for
        # every new node)
        for a in arg:
            if type(a) is not int: return tuple([_arg_key(a) for a in arg])
        return arg
    if t is bool: return (bool, arg)
    if t is float or isinstance(arg, float): return (float, struct.pack("<d", arg))  # numpy floats too
    return arg

class UOpMetaClass(type):
    """Hash-conses UOps: constructing an existing (op, dtype, src, arg) returns that same object.
    `ucache` maps a key to a weak reference, so a UOp nothing else holds is freed; its __del__ drops the entry.
    (A plain dict of weakrefs is a lot faster than a WeakValueDictionary, whose methods are Python code.)"""
    ucache: dict[tuple, weakref.ReferenceType[UOp]] = {}
    # whether a BIND was ever made in this process: until then no graph has a bound Variable to look for
    binds_made = False
    def __call__(cls, op: Ops, dtype: DType = dtypes.void, src: tuple[UOp, ...] = tuple(), arg: Any = None):
        if type(src) is not tuple: raise TypeError(f"src must be a tuple of UOps, got {type(src).__name__}")
        # (most args, None, an int or a str, are their own key: _arg_key is called for the others only)
        key = (op, dtype, src, arg if arg is None or (t := type(arg)) is int or t is str else _arg_key(arg))
        try: wr = _ucache.get(key)
        except TypeError as e: raise TypeError(f"UOp arg must be hashable, got {arg!r} for {op}") from e
        if wr is not None and (ret := wr()) is not None: return ret
        # (checked in C, without a Python step per source: this runs for every new node)
        if not all(map(isinstance, src, _REPEAT_UOP)): raise TypeError(f"src of {op} must hold only UOps, got {src!r}")
        # the fields are set here rather than by an __init__, through their slots' descriptors: a call less per new
        # node, of which a training step makes hundreds
        ret = _new_object(cls)
        _set_op(ret, op)
        _set_dtype(ret, dtype)
        _set_src(ret, src)
        _set_arg(ret, arg)
        _set_ukey(ret, key)
        if op is _BIND_OP: UOpMetaClass.binds_made = True
        _ucache[key] = _weakref(ret)
        return ret

_new_object, _weakref = object.__new__, weakref.ref
_ucache = UOpMetaClass.ucache

def _as_uop(x: Any, like: UOp) -> UOp:
    return x if isinstance(x, UOp) else like.const_like(x)

sint = int  # a shape or index entry: an int, or a symbolic UOp (an expression of bound Variables)

def ssimplify(x: Any) -> Any:
    """A shape entry in its simplest form: an int stays an int, a UOp folds to an int when it is constant."""
    if type(x) is int or not isinstance(x, UOp): return x
    s = x.simplify()
    return s.arg if s.op is Ops.CONST else s

def is_symbolic(x: Any) -> bool:
    """A symbolic shape entry or index: an integer expression of Variables."""
    return isinstance(x, UOp) and x.dtype == dtypes.index

def sym_eq(a: Any, b: Any) -> bool:
    """Whether two shape entries are provably equal (for symbolic ones: their difference simplifies to 0)."""
    if (type(a) is int and type(b) is int) or (not isinstance(a, UOp) and not isinstance(b, UOp)): return a == b
    return a is b or ssimplify(a - b) == 0

def sym_le(a: Any, b: Any) -> bool:
    """Whether a <= b may hold: False only where it provably fails (over every value of the Variables)."""
    if type(a) is int and type(b) is int: return a <= b
    d = ssimplify(b - a)
    return d >= 0 if not isinstance(d, UOp) else d.vmax >= 0

def sym_value(x: Any) -> Any:
    """The value of a shape entry with its bound Variables replaced by their values (an int stays an int)."""
    if not isinstance(x, UOp): return x
    return int(x.substitute({b: b.src[1] for b in x.toposort() if b.op is Ops.BIND}))

def arg_uops(arg: Any) -> list[UOp]:
    """The UOps nested in a tuple arg (a symbolic shape, shrink or pad), outermost first."""
    if isinstance(arg, UOp): return [arg]
    if type(arg) is not tuple: return []
    # (ints, the common entries, are skipped without a call: scheduling looks at every shape of a graph each step)
    out: list[UOp] = []
    for a in arg:
        if type(a) is not int: out.extend(arg_uops(a))
    return out

def map_arg_uops(arg: Any, fxn: Callable[[UOp], Any]) -> Any:
    """A tuple arg with each UOp nested in it replaced by fxn(UOp)."""
    if isinstance(arg, UOp): return fxn(arg)
    if type(arg) is tuple: return tuple(map_arg_uops(a, fxn) for a in arg)
    return arg

def _toposort(root: UOp, gate: Callable[[UOp], bool] | None, known: dict[UOp, None] | None) -> dict[UOp, None]:
    # depth first with an iterator over each open node's sources: a node is added once all its sources are
    visited: dict[UOp, None] = dict(known) if known is not None else {}
    if root in visited: return visited
    if gate is None:
        # (most walks: a loop of its own, without the gate's test per node; the open node is held in locals and its
        # parents on the stack, so going back up is one pop)
        stack: list[tuple[UOp, Any]] = []
        push, pop = stack.append, stack.pop
        node, srcs = root, iter(root.src)
        while True:
            for s in srcs:
                if s not in visited:
                    # (a leaf is added where it is met: no stack entry of its own)
                    if s.src:
                        push((node, srcs))
                        node, srcs = s, iter(s.src)
                        break
                    visited[s] = None
            else:
                visited[node] = None
                if not stack: return visited
                node, srcs = pop()
    stack = []
    push, pop = stack.append, stack.pop
    node, srcs = root, iter(root.src if gate(root) else ())
    while True:
        for s in srcs:
            if s not in visited:
                # (a leaf, or a node the gate stops at, is added where it is met: no stack entry of its own)
                if s.src and gate(s):
                    push((node, srcs))
                    node, srcs = s, iter(s.src)
                    break
                visited[s] = None
        else:
            visited[node] = None
            if not stack: return visited
            node, srcs = pop()

# per thread: the memo of toposort() while a toposort_memo() is open (`memo`), and how many are open (`depth`)
_topo_memo = threading.local()

# whether the garbage collector was on when the main thread entered its outermost toposort_memo()
_gc_was_enabled = [False]

class toposort_memo:
    """Within this context every plain `UOp.toposort()` (no gate, no known nodes) of a node on this thread is walked
    once and copied after that. The memo holds its nodes alive, so it lives only as long as the outermost context: a
    schedule's creation, a kernel's code generation.

    While the main thread is inside one, the cyclic garbage collector is off: these passes make and drop tens of
    thousands of nodes, each young-generation collection walks every node still alive (the graphs being built), and
    reference counting frees nearly all of them anyway. What cyclic garbage they leave is collected after the context,
    by the collector's next run. (Only the main thread's contexts, which a first call waits for: background code
    generation, which may run for long, leaves the collector as it is.)"""
    def __enter__(self) -> None:
        st = _topo_memo.__dict__
        if not st.get("depth"):
            st["memo"], st["depth"] = {}, 0
            if threading.current_thread() is threading.main_thread():
                _gc_was_enabled[0] = gc.isenabled()
                gc.disable()
        st["depth"] += 1
    def __exit__(self, *exc: Any) -> None:
        st = _topo_memo.__dict__
        st["depth"] -= 1
        if st["depth"] == 0:
            st["memo"] = None
            if _gc_was_enabled[0] and threading.current_thread() is threading.main_thread(): gc.enable()

# the default of UOp.replace's fields: the field is kept (None is a valid arg)
_KEEP: Any = object()

class UOp(metaclass=UOpMetaClass):
    """A node of the graph. Immutable; `==` and hash are identity, so build comparisons with .eq()/.ne()/<."""
    __slots__ = ("op", "dtype", "src", "arg", "_ukey", "__weakref__", "__dict__")

    # (no __init__: UOpMetaClass.__call__ sets the fields of a new node)
    op: Ops
    dtype: DType
    src: tuple[UOp, ...]
    arg: Any

    def __del__(self):
        # drop this node's cache entry, but not one a newer equal node took over: when the garbage collector frees
        # a cycle it clears weakrefs before running finalizers, so the key may already hold a different live UOp
        # (popped and put back then: one lookup of the key in the common case)
        try:
            key = self._ukey
            if (wr := _ucache.pop(key, None)) is not None and (u := wr()) is not self and u is not None:
                _ucache[key] = wr
        except (AttributeError, TypeError, KeyError, NameError): pass  # not fully built, or the interpreter is exiting

    def __setattr__(self, name: str, value: Any): raise AttributeError("UOps are immutable; use replace()")
    def __delattr__(self, name: str): raise AttributeError("UOps are immutable; use replace()")
    def __reduce__(self): return (UOp, (self.op, self.dtype, self.src, self.arg))
    def _cached(self, name: str, fxn: Callable[[], Any]) -> Any:
        # per-node memo for derived properties (shape, ranges); allowed despite immutability because it's a pure cache
        d = self.__dict__
        if name not in d: d[name] = fxn()
        return d[name]

    def replace(self, *, op: Any = _KEEP, dtype: Any = _KEEP, src: Any = _KEEP, arg: Any = _KEEP) -> UOp:
        """A UOp like this one with some of op/dtype/src/arg changed (this one is untouched)."""
        # (keyword parameters with a sentinel default, not **kwargs: a rewrite pass calls this for most nodes it
        # rebuilds, and an unknown field is still a TypeError naming it)
        return UOp(self.op if op is _KEEP else op, self.dtype if dtype is _KEEP else dtype,
                   self.src if src is _KEEP else src, self.arg if arg is _KEEP else arg)

    # *** graph walking ***

    def toposort(self, gate: Callable[[UOp], bool] | None = None, known: dict[UOp, None] | None = None) \
            -> dict[UOp, None]:
        """Every node reachable from this one, sources before users (an ordered dict used as an ordered set).
        `gate(u)` returning False stops the walk below u (u itself is still included). `known`: nodes already sorted
        (the toposort of part of this graph, made before): they come first and aren't walked again."""
        if gate is None and known is None and (memo := getattr(_topo_memo, "memo", None)) is not None:
            # (inside toposort_memo(): code generation walks the same kernel graphs from many places; the caller gets
            # a copy, so what it does with its dict leaves the memo alone)
            if (ret := memo.get(self)) is None: ret = memo[self] = _toposort(self, None, None)
            return dict(ret)
        return _toposort(self, gate, known)

    def toposort_list(self) -> list[UOp]: return list(self.toposort())

    def substitute(self, dvars: dict[UOp, UOp]) -> UOp:
        """This graph with every occurrence of each key replaced by its value (no other rewriting)."""
        # (only the nodes that change are kept)
        replaced: dict[UOp, UOp] = {}
        get = replaced.get
        for u in self.toposort():
            if u in dvars: replaced[u] = dvars[u]; continue
            if not u.src: continue
            new_src = tuple(map(get, u.src, u.src))
            if new_src != u.src: replaced[u] = UOp(u.op, u.dtype, new_src, u.arg)  # (checks the values are UOps)
        return get(self, self)

    def substitute_each(self, subs: list[dict[UOp, UOp]]) -> list[UOp]:
        """[self.substitute(d) for d in subs] with one walk of the graph (the lanes of an unrolled axis)."""
        # only the nodes with a key of some substitution at or below them can change: they are found once, and each
        # substitution walks those alone (the lanes of an axis share most of a kernel, which doesn't depend on it)
        keys: set[UOp] = set()
        for dvars in subs: keys.update(dvars)
        below, users = set(keys), []
        for u in self.toposort():
            if u in below: continue
            for s in u.src:
                if s in below:
                    below.add(u)
                    users.append(u)
                    break
        out = []
        for dvars in subs:
            replaced = dict(dvars)
            get = replaced.get
            for u in users:
                if u in replaced: continue
                # (map over a bound get and the node made directly: no Python frame per source nor per new node)
                new_src = tuple(map(get, u.src, u.src))
                if new_src != u.src: replaced[u] = UOp(u.op, u.dtype, new_src, u.arg)
            out.append(get(self, self))
        return out

    def sink(self, *srcs: UOp) -> UOp: return UOp(Ops.SINK, dtypes.void, (self,) + srcs)
    @staticmethod
    def sink_of(*srcs: UOp) -> UOp: return UOp(Ops.SINK, dtypes.void, srcs)

    # *** construction helpers ***

    @staticmethod
    def const(dtype: DType, b: ConstType) -> UOp:
        """A scalar (or, for a vector dtype, broadcast) constant of `dtype`, its value wrapped to the dtype."""
        # (an int of the index dtype, which doesn't wrap, is its own value: most constants code generation makes)
        if dtype is _INDEX_DTYPE and type(b) is int: return UOp(_CONST, dtype, arg=b)
        return UOp(_CONST, dtype, arg=dtypes.as_const(b, dtype))

    def const_like(self, b: ConstType) -> UOp:
        if self.dtype == dtypes.void: raise TypeError(f"can't make a constant like a {self.op} (void dtype)")
        base = self.dtype.base if isinstance(self.dtype, PtrDType) else self.dtype
        return UOp.const(base, b)

    def cast(self, dtype: DType) -> UOp: return self if self.dtype == dtype else UOp(Ops.CAST, dtype, (self,))
    def bitcast(self, dtype: DType) -> UOp: return self if self.dtype == dtype else UOp(Ops.BITCAST, dtype, (self,))
    def index(self, *idx: UOp, valid: UOp | None = None) -> UOp:
        return UOp(Ops.INDEX, self.dtype, (self,) + idx + ((valid,) if valid is not None else ()))
    def load(self, *src: UOp, dtype: DType | None = None) -> UOp:
        dt = dtype if dtype is not None else (self.dtype.base if isinstance(self.dtype, PtrDType) else self.dtype)
        return UOp(Ops.LOAD, dt, (self,) + src)
    def store(self, val: UOp, *src: UOp) -> UOp: return UOp(Ops.STORE, dtypes.void, (self, val) + src)
    @staticmethod
    def range(end: int | UOp, axis_id: int, kind: str = "loop") -> UOp:
        """A loop variable 0 <= r < end; `axis_id` keeps distinct loops distinct, `kind` is 'loop' or 'reduce'."""
        end_u = end if isinstance(end, UOp) else UOp.const(dtypes.index, end)
        return UOp(Ops.RANGE, dtypes.index, (end_u,), (axis_id, kind))
    @staticmethod
    def variable(name: str, min_val: int, max_val: int, dtype: DType = dtypes.index) -> UOp:
        if min_val > max_val: raise ValueError(f"Variable {name}: min {min_val} > max {max_val}")
        return UOp(Ops.DEFINE_VAR, dtype, arg=(name, min_val, max_val))

    def bind(self, val: int) -> UOp:
        """This Variable bound to a value (a BIND node); the value must lie in the variable's range."""
        if self.op is not Ops.DEFINE_VAR: raise TypeError(f"only Variables can be bound, not {self.op}")
        if not self.arg[1] <= val <= self.arg[2]:
            raise ValueError(f"value {val} out of range [{self.arg[1]}, {self.arg[2]}] for Variable {self.arg[0]}")
        return UOp(Ops.BIND, self.dtype, (self, self.const_like(val)))

    def unbind(self) -> tuple[UOp, int]:
        if self.op is not Ops.BIND: raise TypeError(f"can't unbind {self.op}")
        return self.src[0], self.src[1].arg

    @property
    def expr(self) -> str:
        if self.op is not Ops.DEFINE_VAR: raise TypeError(f"{self.op} has no name")
        return self.arg[0]

    # *** ALU construction with Python operators ***

    def alu(self, op: Ops, *src: UOp) -> UOp:
        """Apply ALU `op` to this and `src`; comparisons give bool, the rest keep this node's dtype."""
        out_dtype = dtypes.bool.vec(self.dtype.count) if op in GroupOp.Comparison else \
            (src[-1].dtype if op is Ops.WHERE else self.dtype)
        return UOp(op, out_dtype, (self,) + src)

    def _binop(self, op: Ops, x: Any, reverse: bool) -> UOp:
        other = _as_uop(x, self)
        return other.alu(op, self) if reverse else self.alu(op, other)

    def __add__(self, x: Any) -> UOp: return self._binop(Ops.ADD, x, False)
    def __radd__(self, x: Any) -> UOp: return self._binop(Ops.ADD, x, True)
    def __sub__(self, x: Any) -> UOp: return self._binop(Ops.ADD, -_as_uop(x, self), False)
    def __rsub__(self, x: Any) -> UOp: return _as_uop(x, self) + (-self)
    def __mul__(self, x: Any) -> UOp: return self._binop(Ops.MUL, x, False)
    def __rmul__(self, x: Any) -> UOp: return self._binop(Ops.MUL, x, True)
    def __floordiv__(self, x: Any) -> UOp: return self._binop(Ops.IDIV, x, False)
    def __rfloordiv__(self, x: Any) -> UOp: return self._binop(Ops.IDIV, x, True)
    def __truediv__(self, x: Any) -> UOp:
        if dtypes.is_int(self.dtype): return self._binop(Ops.IDIV, x, False)
        return self * _as_uop(x, self).alu(Ops.RECIP)
    def __rtruediv__(self, x: Any) -> UOp: return _as_uop(x, self) * self.alu(Ops.RECIP)
    def __mod__(self, x: Any) -> UOp: return self._binop(Ops.MOD, x, False)
    def __rmod__(self, x: Any) -> UOp: return self._binop(Ops.MOD, x, True)
    def __lt__(self, x: Any) -> UOp: return self._binop(Ops.CMPLT, x, False)
    def __gt__(self, x: Any) -> UOp: return self._binop(Ops.CMPLT, x, True)
    def __le__(self, x: Any) -> UOp: return (self > x).logical_not()
    def __ge__(self, x: Any) -> UOp: return (self < x).logical_not()
    def __and__(self, x: Any) -> UOp: return self._binop(Ops.AND, x, False)
    def __rand__(self, x: Any) -> UOp: return self._binop(Ops.AND, x, True)
    def __or__(self, x: Any) -> UOp: return self._binop(Ops.OR, x, False)
    def __ror__(self, x: Any) -> UOp: return self._binop(Ops.OR, x, True)
    def __xor__(self, x: Any) -> UOp: return self._binop(Ops.XOR, x, False)
    def __rxor__(self, x: Any) -> UOp: return self._binop(Ops.XOR, x, True)
    def __lshift__(self, x: Any) -> UOp: return self._binop(Ops.SHL, x, False)
    def __rlshift__(self, x: Any) -> UOp: return self._binop(Ops.SHL, x, True)
    def __rshift__(self, x: Any) -> UOp: return self._binop(Ops.SHR, x, False)
    def __rrshift__(self, x: Any) -> UOp: return self._binop(Ops.SHR, x, True)
    def __neg__(self) -> UOp:
        return self.logical_not() if self.dtype.scalar() == dtypes.bool else self * self.const_like(-1)
    def __invert__(self) -> UOp: return self.logical_not() if self.dtype.scalar() == dtypes.bool else self ^ -1
    __hash__ = object.__hash__
    def eq(self, x: Any) -> UOp: return self.ne(x).logical_not()
    def ne(self, x: Any) -> UOp: return self._binop(Ops.CMPNE, x, False)
    def logical_not(self) -> UOp: return self.ne(True) if self.dtype.scalar() == dtypes.bool else self.eq(0)
    def maximum(self, x: Any) -> UOp: return self._binop(Ops.MAX, x, False)
    def minimum(self, x: Any) -> UOp: return -((-self).maximum(-_as_uop(x, self)))
    def where(self, x: Any, y: Any) -> UOp:
        like = x if isinstance(x, UOp) else y if isinstance(y, UOp) else None
        if like is None: raise TypeError("where needs at least one UOp branch")
        return UOp(Ops.WHERE, like.dtype, (self, _as_uop(x, like), _as_uop(y, like)))

    # *** evaluation of constant expressions ***

    def simplify(self) -> UOp:
        """This expression simplified by the symbolic rules (constant folding, identities, range folding)."""
        from fusegrad.uop.pattern import graph_rewrite
        from fusegrad.uop.symbolic import symbolic
        # the rules are deterministic and context-free, so the result is memoized on the node
        # (an already simple node stores False rather than a reference to itself, to avoid a reference cycle)
        if (ret := self.__dict__.get("_simplified")) is None:
            ret = graph_rewrite(self, symbolic, name="simplify")
            self.__dict__["_simplified"] = False if ret is self else ret
        return self if ret is False else ret

    def _eval(self, types: tuple[type, ...]) -> ConstType:
        s = self.simplify()
        if s.op is not Ops.CONST:
            raise ValueError(f"{s.render()} is not a constant, so it has no Python value")
        if not isinstance(s.arg, types): return types[0](s.arg)
        return s.arg
    def __int__(self) -> int: return int(self._eval((int,)))
    def __float__(self) -> float: return float(self._eval((float, int)))
    def __bool__(self) -> bool: return bool(self._eval((bool, int, float)))
    def __index__(self) -> int: return self.__int__()

    def render(self, simplify: bool = False) -> str:
        """A C-like string of this scalar expression, e.g. ((3*5)+2)."""
        return render_expr(self.simplify() if simplify else self)

    # *** range analysis ***

    @property
    def vmin(self) -> ConstType: return self._min_max[0]
    @property
    def vmax(self) -> ConstType: return self._min_max[1]
    @property
    def _min_max(self) -> tuple[ConstType, ConstType]:
        if (d := self.__dict__).get("_mm") is None:
            # (most nodes are asked once their sources are known: no walk)
            for s in self.src:
                if "_mm" not in s.__dict__: break
            else:
                ret = d["_mm"] = _compute_min_max(self)
                return ret
            # compute sources first, iteratively, so deep graphs don't recurse
            for u in self.toposort(gate=lambda u: "_mm" not in u.__dict__):
                if "_mm" not in u.__dict__: u.__dict__["_mm"] = _compute_min_max(u)
        return d["_mm"]

    # *** tensor-level shapes ***

    @property
    def shape(self) -> tuple[sint, ...] | None:
        """The shape of a tensor-level node (None where a node has no shape, e.g. DEVICE or KERNEL)."""
        d = self.__dict__
        if "_shape" in d: return d["_shape"]
        # the common case: a new node over known ones, or over new leaves (a DEVICE, a constant's view)
        for s in self.src:
            if "_shape" not in (sd := s.__dict__):
                if not all("_shape" in x.__dict__ for x in s.src): break
                sd["_shape"] = _compute_shape(s)
        else:
            d["_shape"] = _compute_shape(self)
            return d["_shape"]
        # deeper new nodes (a matmul's chain of views built at once): sources first, without recursion (deep graphs)
        # and without a toposort of the whole graph below (a walk that stops at nodes with shapes is all it needs)
        stack = [self]
        while stack:
            u = stack[-1]
            if "_shape" in (ud := u.__dict__): stack.pop(); continue
            missing = [s for s in u.src if "_shape" not in s.__dict__]
            if missing: stack.extend(missing)
            else:
                ud["_shape"] = _compute_shape(u)
                stack.pop()
        return d["_shape"]

    @property
    def size(self) -> int:
        """Number of elements: of a BUFFER its length, else the product of the shape."""
        if self.op is Ops.BUFFER: return self.arg[1]
        if self.shape is None: raise TypeError(f"{self.op} has no shape")
        return prod(self.shape)

    @property
    def device(self) -> str:
        """The device of a tensor-level node: from its DEVICE source, else from its sources (memoized)."""
        if "_device" not in self.__dict__ and self.op not in _DEVICE_CHANGERS:
            # the common case: a new node over a source whose device is known, or over the DEVICE itself (the
            # sources of any other node share one device)
            for s in self.src:
                if (d := s.__dict__.get("_device")) is not None or (s.op is _DEVICE and (d := s.arg) is not None):
                    self.__dict__["_device"] = d
                    break
            else:
                # a chain of new nodes (a convolution's views): down the first sources to a known device, which every
                # node on the way shares
                path, u = [self], self.src[0] if self.src else None
                while u is not None and "_device" not in u.__dict__ and u.src and u.op not in _DEVICE_CHANGERS:
                    path.append(u)
                    u = u.src[0]
                d = None if u is None else u.__dict__.get("_device", u.arg if u.op is _DEVICE else None)
                if d is not None:
                    for p in path: p.__dict__["_device"] = d
        if "_device" not in self.__dict__:
            for u in self.toposort(gate=lambda u: "_device" not in u.__dict__):
                if "_device" in u.__dict__: continue
                d = u.arg if u.op is Ops.DEVICE else None
                if u.op is Ops.COPY: d = u.src[1].arg
                if u.op is Ops.MULTI: d = tuple(s.__dict__["_device"] for s in u.src)
                for s in u.src if d is None else ():
                    if (d := s.__dict__.get("_device")) is not None: break
                u.__dict__["_device"] = d
        if (d := self.__dict__["_device"]) is None: raise TypeError(f"{self.op} graph has no device")
        return d

    @property
    def base(self) -> UOp:
        """This node with movement ops peeled off."""
        u = self
        while u.op in GroupOp.Movement: u = u.src[0]
        return u

    # *** what tinygrad programs inspect: whether a tensor's value is in memory, and where ***

    @property
    def is_realized(self) -> bool:
        """Whether this node's value (under its movement ops) lives in device memory already: a buffer, or a kernel's
        output that has run (of every shard, for a sharded node)."""
        b = self.base
        if b.op is Ops.MULTI: return all(s.is_realized for s in b.src)
        return is_realized(b)

    @property
    def buffer(self) -> Buffer:
        """The device Buffer that holds this node's base (ValueError if it isn't realized or is sharded)."""
        b = self.base
        if not self.is_realized or b.op is Ops.MULTI:
            raise ValueError(f"{b.op} node has no single buffer: realize it first" if b.op is not Ops.MULTI else
                             "a sharded node has a buffer per shard: use .src[i].buffer")
        return device_buffer(b if b.op is Ops.BUFFER else b.src[0].base)

    @property
    def realized(self) -> Any:
        """The device Buffer when this node itself (not a view of it) is realized, else None."""
        return self.buffer if self.is_realized and self.op is not Ops.MULTI and self.base is self else None

    def reshape(self, shape: tuple[sint, ...]) -> UOp: return UOp(Ops.RESHAPE, self.dtype, (self,), tuple(shape))
    def permute(self, order: tuple[int, ...]) -> UOp: return UOp(Ops.PERMUTE, self.dtype, (self,), tuple(order))
    def expand(self, shape: tuple[sint, ...]) -> UOp: return UOp(Ops.EXPAND, self.dtype, (self,), tuple(shape))
    def pad(self, arg: tuple[tuple[sint, sint], ...]) -> UOp: return UOp(Ops.PAD, self.dtype, (self,), tuple(arg))
    def shrink(self, arg: tuple[tuple[sint, sint], ...]) -> UOp: return UOp(Ops.SHRINK, self.dtype, (self,), tuple(arg))
    def flip(self, arg: tuple[bool, ...]) -> UOp: return UOp(Ops.FLIP, self.dtype, (self,), tuple(arg))
    def r(self, op: Ops, axis: tuple[int, ...]) -> UOp:
        """Reduce over `axis` with `op` (ADD, MAX, MUL); reduced dims keep size 1."""
        return UOp(Ops.REDUCE_AXIS, self.dtype, (self,), (op, tuple(axis)))

    # *** printing ***

    def __repr__(self) -> str:
        if is_symbolic(self) and (r := _symbolic_repr(self)) is not None: return r
        return pretty_print(self)

# (UOp.__call__'s test of the sources: map's second iterable, endless)
_REPEAT_UOP = itertools.repeat(UOp)

# the fields of a new node, set through their slots (UOpMetaClass.__call__)
_set_op, _set_dtype, _set_src, _set_arg, _set_ukey = (UOp.__dict__[f].__set__ for f in ("op", "dtype", "src", "arg",
                                                                                          "_ukey"))
_BIND_OP = Ops.BIND
_BUFFER_OP, _ASSIGN_OP, _KERNEL_OP = Ops.BUFFER, Ops.ASSIGN, Ops.KERNEL
_INDEX_DTYPE = dtypes.index

def new_node(op: Ops, dtype: DType, src: tuple[UOp, ...], arg: Any) -> UOp:
    """UOp(op, dtype, src, arg) for a node that can't exist yet (a fresh buffer, or a node over one) and whose arg
    is its own key (None, an int, a str, a tuple of ints): the node made without looking for an equal one."""
    ret = _new_object(UOp)
    _set_op(ret, op)
    _set_dtype(ret, dtype)
    _set_src(ret, src)
    _set_arg(ret, arg)
    _set_ukey(ret, key := (op, dtype, src, arg))
    _ucache[key] = _weakref(ret)
    return ret

def with_src(u: UOp, src: tuple[UOp, ...]) -> UOp:
    """UOp(u.op, u.dtype, src, u.arg) (hash-consed: an equal node is returned), for a caller whose `src` is a tuple of
    UOps (a graph's nodes substituted): u's key already holds its arg's key, so it isn't worked out again."""
    return _keyed(u.op, u.dtype, src, u.arg, (u.op, u.dtype, src, u._ukey[3]))

def plain_node(op: Ops, dtype: DType, src: tuple[UOp, ...], arg: Any = None) -> UOp:
    """UOp(op, dtype, src, arg) (hash-consed) for a caller that knows `src` is a tuple of UOps, `arg` its own cache key
    (None, an int, a str, a tuple of plain ints, an object that is neither a float, a bool nor a tuple: see _arg_key)
    and `op` not BIND: nothing of them is checked (the tensor operations' fast paths, ~0.3 us a node less)."""
    return _keyed(op, dtype, src, arg, (op, dtype, src, arg))

def elementwise_node(op: Ops, dtype: DType, src: tuple[UOp, ...]) -> UOp:
    """plain_node(op, dtype, src) of an op that keeps its first source's shape and device (an elementwise op, a cast):
    a new node notes them at once where that source knows them, as the shape and device properties would (an eager
    chain of operations reads each result's shape and device as the next one's operand)."""
    return note_shape(plain_node(op, dtype, src), src[0], None)

def view_node(op: Ops, src: UOp, shape: tuple[int, ...]) -> UOp:
    """plain_node(op, src.dtype, (src,), shape) of a RESHAPE or EXPAND to `shape`, a tuple of plain ints: a new node
    notes its shape, and its source's device where that is known."""
    return note_shape(plain_node(op, src.dtype, (src,), shape), src, shape)

def note_shape(u: UOp, src: UOp, shape: tuple[int, ...] | None = None) -> UOp:
    """u with its shape (`shape`, else src's) and src's device noted, if u is new and src knows what is needed: for a
    caller that knows u has them (what u's shape and device properties would work out)."""
    if "_shape" not in (d := u.__dict__) and "_device" in (sd := src.__dict__):
        if shape is None:
            if "_shape" not in sd: return u
            shape = sd["_shape"]
        d["_shape"], d["_device"] = shape, sd["_device"]
    return u

def _keyed(op: Ops, dtype: DType, src: tuple[UOp, ...], arg: Any, key: tuple) -> UOp:
    """The node of cache key `key` (made of the other arguments): the one that exists, else a new one."""
    if (wr := _ucache.get(key)) is not None and (ret := wr()) is not None: return ret
    ret = _new_object(UOp)
    _set_op(ret, op)
    _set_dtype(ret, dtype)
    _set_src(ret, src)
    _set_arg(ret, arg)
    _set_ukey(ret, key)
    _ucache[key] = _weakref(ret)
    return ret

# *** buffer identity: which BUFFER node holds a value, and the device memory behind a BUFFER node ***

def is_realized(u: UOp) -> bool:
    """A node whose value lives in a buffer: a BUFFER or a kernel's output ASSIGN(BUFFER, KERNEL)."""
    return (op := u.op) is _BUFFER_OP or (op is _ASSIGN_OP and len(u.src) == 2 and u.src[1].op is _KERNEL_OP)

def buffer_node(u: UOp) -> UOp | None:
    """The BUFFER node holding a realized node or a reshape view of one (None for anything else)."""
    while u.op is Ops.RESHAPE: u = u.src[0]
    if u.op is Ops.ASSIGN and is_realized(u): u = u.src[0]
    return u if u.op is Ops.BUFFER else None

class _BufferMap:
    """The device Buffer behind every BUFFER node, kept in the node itself: an entry goes with its node (its Buffer
    freed as the node is, by reference counting, without a weak reference's callback per buffer)."""
    def get(self, u: UOp, default: Buffer | None = None) -> Buffer | None: return u.__dict__.get("_buffer", default)
    def __getitem__(self, u: UOp) -> Buffer: return u.__dict__["_buffer"]
    def __setitem__(self, u: UOp, b: Buffer) -> None:
        if u.op is not Ops.BUFFER: raise TypeError(f"only a BUFFER node has a device Buffer, not {u.op}")
        u.__dict__["_buffer"] = b
    def __contains__(self, u: UOp) -> bool: return "_buffer" in u.__dict__
    def items(self) -> list[tuple[UOp, Buffer]]:
        """Every live BUFFER node that has its Buffer, with it (a walk of every live node: not for hot paths)."""
        nodes = [u for wr in list(UOpMetaClass.ucache.values()) if (u := wr()) is not None and u.op is Ops.BUFFER]
        return [(u, b) for u in nodes if (b := u.__dict__.get("_buffer")) is not None]
    def values(self) -> list[Buffer]: return [b for _, b in self.items()]
    def __len__(self) -> int: return len(self.items())

buffer_map = _BufferMap()

def device_buffer(u: UOp) -> Buffer:
    """The device Buffer of a BUFFER node (or of the one holding a realized node or a reshape view of one), created
    unallocated on first use."""
    buf = u if u.op is _BUFFER else buffer_node(u)
    if buf is None: raise RuntimeError(f"{u.op} is not a buffer")
    if (b := (d := buf.__dict__).get("_buffer")) is None: b = d["_buffer"] = Buffer(buf.device, buf.arg[1], buf.dtype)
    return b

# nodes whose device isn't their sources' (a copy's is its target, a sharded tensor's the tuple of its shards')
_DEVICE_CHANGERS = frozenset({Ops.COPY, Ops.MULTI, Ops.DEVICE})

def Variable(name: str, min_val: int, max_val: int, dtype: DType = dtypes.index) -> UOp:
    """A named symbolic integer with an inclusive range [min_val, max_val]; `.bind(v)` gives it a value."""
    return UOp.variable(name, min_val, max_val, dtype)

# *** shapes of tensor-level nodes ***

_SHAPELESS = {Ops.DEVICE, Ops.UNIQUE, Ops.KERNEL, Ops.SINK, Ops.NOOP, Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR, Ops.BIND}

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the per-node shape rule
# below compares against module-level names instead)
_DEFINE_VAR, _BUFFER, _BUFFER_VIEW, _CONST, _RANGE, _RESHAPE, _EXPAND, _MULTI, _ASSIGN, _PERMUTE, _PAD, _SHRINK, \
    _REDUCE_AXIS, _DEVICE, _COMPOSITE = Ops.DEFINE_VAR, Ops.BUFFER, Ops.BUFFER_VIEW, Ops.CONST, Ops.RANGE, \
    Ops.RESHAPE, Ops.EXPAND, Ops.MULTI, Ops.ASSIGN, Ops.PERMUTE, Ops.PAD, Ops.SHRINK, Ops.REDUCE_AXIS, Ops.DEVICE, \
    Ops.COMPOSITE

# the ops with a shape rule of their own below: any other keeps its first source's shape (an elementwise op, a cast,
# DETACH, CONTIGUOUS, COPY...), the common case, which is looked up first
_OWN_SHAPE_RULE = frozenset(_SHAPELESS | {_BUFFER, _BUFFER_VIEW, _CONST, _RANGE, _RESHAPE, _EXPAND, _COMPOSITE, _MULTI,
                                          _ASSIGN, _PERMUTE, _PAD, _SHRINK, _REDUCE_AXIS})

def _compute_shape(u: UOp) -> tuple[int, ...] | None:
    op, arg = u.op, u.arg
    if op not in _OWN_SHAPE_RULE: return u.src[0].shape if u.src else None
    if op is _DEFINE_VAR and u.src: return ()  # a tensor-level scalar parameter (a lifted constant)
    if op in _SHAPELESS: return None
    if op is _BUFFER: return (arg[1],)
    if op is _BUFFER_VIEW: return (arg[0],)
    if op is _CONST: return ()
    if op is _RANGE: return (arg,) if u.src and u.src[0].op is _DEVICE else None
    if op is _RESHAPE or op is _EXPAND: return arg
    # (a function whose result isn't its first operand's shape, a reduction, names it: tensor/composite.py)
    if op is _COMPOSITE and arg.shape is not None: return arg.shape
    ss = u.src[0].shape if u.src else None
    if op is _MULTI and ss is not None and arg is not None:
        return tuple(sum(s.shape[arg] for s in u.src) if i == arg else d for i, d in enumerate(ss))
    if op is _ASSIGN and arg is not None: return arg
    if ss is None: return None
    if op is _PERMUTE: return tuple(ss[i] for i in arg)
    if op is _PAD: return tuple(ssimplify(s + b + e) for s, (b, e) in zip(ss, arg))
    if op is _SHRINK: return tuple(ssimplify(e - b) for b, e in arg)
    if op is _REDUCE_AXIS: return tuple(1 if i in arg[1] else s for i, s in enumerate(ss))
    # elementwise ops and FLIP/CONTIGUOUS/COPY/ASSIGN/DETACH keep the (common) shape of their sources
    return ss

# *** range analysis (vmin/vmax) ***

_INT_DTYPES = frozenset(dtypes.ints + (dtypes.index,))

def _minmax_of_products(a: tuple, b: tuple) -> tuple:
    vals = [x * y for x in a for y in b]
    return min(vals), max(vals)

def _compute_min_max(u: UOp) -> tuple[ConstType, ConstType]:
    """Bounds [vmin, vmax] of the value of `u` over every assignment of its variables (conservative: always sound).

    Fixed-width ints get their full dtype range when a result could have wrapped around, so rules may trust a range
    that is narrower than the dtype's. dtypes.index doesn't wrap (constant folding never truncates it), so its bounds
    are exact Python ints and may lie outside 64 bits. Float values that could be NaN get (-inf, inf), which decides
    no comparison."""
    op, s = u.op, u.src
    # the two leaves first: they are most of the nodes, and need nothing else
    if op is _CONST and not (isinstance(u.arg, float) and math.isnan(u.arg)): return (u.arg, u.arg)
    if op is _DEFINE_VAR: return (u.arg[1], u.arg[2])
    if isinstance(u.dtype, PtrDType): return (dtypes.min(dtypes.index), dtypes.max(dtypes.index))
    dt = u.dtype.scalar()
    if dt == dtypes.void: return (-math.inf, math.inf)
    if dt in _INT_DTYPES:
        if op in GroupOp.ALU and op is not Ops.WHERE or op is Ops.CAST:
            ret = _int_min_max(u, dt)
            lo, hi = dtypes.min(dt), dtypes.max(dt)
            # a fixed-width result outside the dtype's range may have wrapped around, so nothing is known
            if ret is None or (dt != dtypes.index and (ret[0] < lo or ret[1] > hi)): return (lo, hi)
            return ret
    full = (dtypes.min(dt), dtypes.max(dt))
    if op is Ops.CONST or op is Ops.VCONST:
        vals = u.arg if isinstance(u.arg, tuple) else (u.arg,)
        if any(isinstance(v, float) and math.isnan(v) for v in vals): return full
        return (min(vals), max(vals))
    if op is Ops.BIND or op is Ops.GEP: return s[0]._min_max
    if op is Ops.VECTORIZE and s: return (min(x.vmin for x in s), max(x.vmax for x in s))
    if op is Ops.RANGE or op is Ops.SPECIAL:
        # an empty loop never runs its body, so any range is sound there; keep vmin <= vmax
        end = s[0].vmax if s else None
        return (0, max(end - 1, 0)) if isinstance(end, int) else full
    if op is Ops.WHERE:
        c0, c1 = s[0]._min_max
        if c0 == c1: return s[1]._min_max if c0 else s[2]._min_max
        return (min(s[1].vmin, s[2].vmin), max(s[1].vmax, s[2].vmax))
    if dt == dtypes.bool:
        ret = _bool_min_max(u)
        return ret if ret is not None else (False, True)
    if dtypes.is_float(dt) and op is Ops.CAST and (dtypes.is_int(s[0].dtype) or s[0].dtype.scalar() == dtypes.bool):
        # rounding to the float dtype is monotonic, so rounded bounds stay bounds
        return (truncate_float(float(s[0].vmin), dt), truncate_float(float(s[0].vmax), dt))
    return full

def _bool_min_max(u: UOp) -> tuple[bool, bool] | None:
    op, s = u.op, u.src
    if op in GroupOp.Comparison:
        (a0, a1), (b0, b1) = s[0]._min_max, s[1]._min_max
        if op is Ops.CMPLT:
            if a1 < b0: return (True, True)
            if a0 >= b1: return (False, False)
            return None
        differ, same = a1 < b0 or a0 > b1, a0 == a1 == b0 == b1
        if differ or same: return (differ, differ) if op is Ops.CMPNE else (same, same)
        return None
    if op in (Ops.AND, Ops.MUL, Ops.OR, Ops.ADD, Ops.MAX, Ops.XOR, Ops.NOT, Ops.CAST) and \
            any(x.dtype.scalar() != dtypes.bool for x in s):
        if op is not Ops.CAST: return None
        lo, hi = s[0]._min_max  # a cast to bool is "!= 0"
        if lo > 0 or hi < 0: return (True, True)
        if lo == hi == 0: return (False, False)
        return None
    if op is Ops.AND or op is Ops.MUL: return (bool(s[0].vmin and s[1].vmin), bool(s[0].vmax and s[1].vmax))
    if op is Ops.OR or op is Ops.ADD or op is Ops.MAX:
        return (bool(s[0].vmin or s[1].vmin), bool(s[0].vmax or s[1].vmax))
    if op is Ops.NOT: return (not s[0].vmax, not s[0].vmin)
    if op is Ops.XOR and s[0].vmin == s[0].vmax and s[1].vmin == s[1].vmax:
        v = bool(s[0].vmin) != bool(s[1].vmin)
        return (v, v)
    if op is Ops.CAST: return (bool(s[0].vmin), bool(s[0].vmax))
    return None

def _int_min_max(u: UOp, dt: DType) -> tuple[int, int] | None:
    """Exact integer bounds of `u` from its sources' bounds (before any wrap-around check), or None if unknown."""
    op, s = u.op, u.src
    if op is Ops.ADD: return (s[0].vmin + s[1].vmin, s[0].vmax + s[1].vmax)
    if op is Ops.SUB: return (s[0].vmin - s[1].vmax, s[0].vmax - s[1].vmin)
    if op is Ops.NEG: return (-s[0].vmax, -s[0].vmin)
    if op is Ops.MUL: return _minmax_of_products(s[0]._min_max, s[1]._min_max)
    if op is Ops.MULACC:
        lo, hi = _minmax_of_products(s[0]._min_max, s[1]._min_max)
        return (lo + s[2].vmin, hi + s[2].vmax)
    if op is Ops.MAX: return (max(s[0].vmin, s[1].vmin), max(s[0].vmax, s[1].vmax))
    if op is Ops.CAST:
        src_dt = s[0].dtype.scalar()
        if src_dt == dtypes.bool or dtypes.is_int(src_dt): return (int(s[0].vmin), int(s[0].vmax))
        lo, hi = s[0]._min_max
        # float -> int truncates toward zero; monotonic, so truncated bounds are bounds (when finite)
        if dtypes.is_float(src_dt) and math.isfinite(lo) and math.isfinite(hi): return (math.trunc(lo), math.trunc(hi))
        return None
    (a0, a1), (b0, b1) = s[0]._min_max, s[1]._min_max if len(s) > 1 else (0, 0)
    if op is Ops.IDIV:
        # C division is monotonic in each operand while the divisor keeps its sign, so the extremes are at corners of
        # the positive and the negative part of the divisor's range; a zero divisor folds to 0 (as exec_alu does)
        vals = [0] if b0 <= 0 <= b1 else []
        for lo, hi in ((max(b0, 1), b1), (b0, min(b1, -1))):
            if lo <= hi: vals += [_c_idiv(x, y) for x in (a0, a1) for y in (lo, hi)]
        return (min(vals), max(vals))
    if op is Ops.MOD:
        if b0 == b1 == 0: return (0, 0)
        m = max(abs(b0), abs(b1)) - 1  # the largest possible |remainder|
        if b0 > 0 or b1 < 0:
            # |x| below every |divisor|: the remainder is x itself
            if max(abs(a0), abs(a1)) < min(abs(b0), abs(b1)): return (a0, a1)
        # the remainder has the sign of the dividend (or is 0)
        return (max(min(a0, 0), -m), min(max(a1, 0), m))
    if op is Ops.AND:
        if a0 >= 0 and b0 >= 0: return (0, min(a1, b1))
        if a0 >= 0: return (0, a1)
        if b0 >= 0: return (0, b1)
        return None
    if op is Ops.OR or op is Ops.XOR:
        if a0 < 0 or b0 < 0: return None
        top = (1 << max(a1, b1).bit_length()) - 1
        return (max(a0, b0), top) if op is Ops.OR else (0, top)
    if op is Ops.SHL or op is Ops.SHR:
        # shifts are monotonic in each operand; an out-of-range shift amount gives 0 (exec_alu), so require in-range
        if not 0 <= b0 <= b1 < 8 * dt.itemsize: return None
        vals = [x << y if op is Ops.SHL else x >> y for x in (a0, a1) for y in (b0, b1)]
        return (min(vals), max(vals))
    return None

# *** printing a whole graph with shared nodes named once ***

def pretty_print(root: UOp) -> str:
    """Python-like text for a whole graph: `UOp(op, dtype, arg=..., src=(...))`, one node per line, sources indented.
    A non-constant node used more than once is written `x0:=UOp(...)` where it first appears and `x0` after, so the
    text is valid Python that rebuilds the same graph (with Ops, dtypes, UOp and math in scope)."""
    topo = root.toposort()
    users: dict[UOp, int] = {}
    for u in topo:
        for s in u.src: users[s] = users.get(s, 0) + 1
    shared = {u for u, n in users.items() if n > 1 and u.op is not Ops.CONST}
    names: dict[UOp, str] = {}  # shared nodes already written, named in the order they appear in the text
    out: list[str] = []
    # explicit stack (deep graphs must not recurse): ("open", node, depth, comma) writes a node, ("close", comma) ends
    # the source tuple of the node opened last by appending "))" to the last line written
    stack: list[tuple] = [("open", root, 0, "")]
    while stack:
        item = stack.pop()
        if item[0] == "close":
            out[-1] += "))" + item[1]
            continue
        _, u, depth, comma = item
        pad = "  " * depth
        if u in names:
            out.append(f"{pad}{names[u]}{comma}")
            continue
        prefix = ""
        if u in shared:
            names[u] = f"x{len(names)}"
            prefix = names[u] + ":="
        head = f"{pad}{prefix}UOp({u.op!r}, {u.dtype!r}, arg={_repr_arg(u.arg)}, src=("
        if not u.src:
            out.append(head + "))" + comma)
            continue
        out.append(head)
        stack.append(("close", comma))
        # every source gets a trailing comma so a single source still makes a tuple
        for s in reversed(u.src): stack.append(("open", s, depth + 1, ","))
    return "\n".join(out)

def _repr_arg(arg: Any) -> str:
    # inf and nan have no literal; write them as the math constants so the text stays valid Python
    if isinstance(arg, float) and not math.isfinite(arg):
        return "math.nan" if math.isnan(arg) else ("math.inf" if arg > 0 else "-math.inf")
    if isinstance(arg, tuple):
        return f"({_repr_arg(arg[0])},)" if len(arg) == 1 else f"({', '.join(map(_repr_arg, arg))})"
    return repr(arg)

_INFIX = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.IDIV: "//", Ops.FDIV: "/", Ops.MOD: "%", Ops.CMPLT: "<",
          Ops.CMPNE: "!=", Ops.CMPEQ: "==", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^", Ops.SHL: "<<", Ops.SHR: ">>"}

def render_expr(root: UOp) -> str:
    """A C-like string for a scalar expression: infix ops parenthesized, variables by name, ranges as ridxN."""
    r: dict[UOp, str] = {}
    for u in root.toposort():
        s = [r[x] for x in u.src]
        if u.op is Ops.CONST:
            r[u] = str(u.arg) if not isinstance(u.arg, bool) else ("1" if u.arg else "0")
        elif u.op is Ops.DEFINE_VAR: r[u] = u.arg[0]
        elif u.op is Ops.BIND: r[u] = s[0]
        elif u.op is Ops.RANGE: r[u] = f"ridx{u.arg[0]}"
        elif u.op in _INFIX: r[u] = f"({s[0]}{_INFIX[u.op]}{s[1]})"
        elif u.op is Ops.NEG: r[u] = f"(-{s[0]})"
        elif u.op is Ops.NOT: r[u] = f"(!{s[0]})"
        elif u.op is Ops.MAX: r[u] = f"max({s[0]}, {s[1]})"
        elif u.op is Ops.WHERE: r[u] = f"({s[0]}?{s[1]}:{s[2]})"
        elif u.op is Ops.CAST: r[u] = f"({u.dtype.name})({s[0]})"
        else: r[u] = f"{u.op.name.lower()}({', '.join(s)})"
    return r[root]

_SCALAR_EXPR = {Ops.DEFINE_VAR, Ops.BIND, Ops.CONST} | set(GroupOp.ALU)

def _symbolic_repr(x: UOp) -> str | None:
    """A symbolic shape entry as short text, e.g. <(pos+1) pos=3>, or None for anything else (a kernel's index math)."""
    topo = x.toposort()
    if any(u.op not in _SCALAR_EXPR or u.src and u.op is Ops.DEFINE_VAR for u in topo): return None
    binds = ", ".join(f"{b.src[0].arg[0]}={b.src[1].arg}" for b in topo if b.op is Ops.BIND)
    return f"<{render_expr(x)}{' ' + binds if binds else ''}>"

def resolve(x: Any, default: bool = True) -> bool:
    """A Python bool for `x`: itself if not a UOp, else decided by range analysis, else `default`."""
    if not isinstance(x, UOp): return bool(x)
    if x.dtype.scalar() != dtypes.bool: raise TypeError(f"resolve needs a bool UOp, got {x.dtype}")
    return bool(x.vmin) if x.vmin == x.vmax else default



