"""Data types: scalar, vector and pointer forms, the promotion lattice and conversions to numpy/torch/Python."""
from __future__ import annotations
import math
import struct
import threading
import weakref
from dataclasses import dataclass, fields
from functools import cache
from typing import Any, Final

ConstType = float | int | bool

class _Interned(type):
    """Makes one instance per dtype value: constructing an equal dtype returns the existing one. Equality is then
    identity and the hash the object's, both done in C: dtypes are hashed and compared in every UOp's cache key, every
    structure key and pattern match. (Weak references: a dtype nothing uses, a pointer of a size no kernel takes any
    more, is freed.)"""
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # every field given in order (what ptr() and the other methods here pass): the key without making one first
        key = (cls, args) if not kwargs and len(args) == cls._nfields else None  # type: ignore[attr-defined]
        if key is not None and (ref := _interned.get(key)) is not None and (made := ref()) is not None: return made
        made = super().__call__(*args, **kwargs)
        # (under a lock: two threads making one new dtype at once, background code generation and the main thread,
        # must both get the same instance)
        with _intern_lock:
            if (ref := _interned.get(made._key)) is not None and (old := ref()) is not None: return old
            _interned[made._key] = weakref.ref(made)
            if len(_interned) > _intern_limit[0]:
                for k in [k for k, r in _interned.items() if r() is None]: del _interned[k]
                _intern_limit[0] = max(1024, 2 * len(_interned))
        return made

_interned: dict[tuple, weakref.ref] = {}
_intern_lock = threading.Lock()
_intern_limit = [1024]

@dataclass(frozen=True, eq=True)
class DType(metaclass=_Interned):
    """A scalar type (count == 1) or a vector of `count` scalars. Compare with ==; there is one instance per value."""
    priority: int   # orders dtypes of equal rank in the promotion lattice; higher is "bigger"
    itemsize: int   # bytes per element (for vectors: the whole vector)
    name: str
    fmt: str | None  # struct module format character, None when struct has none (bfloat16)
    count: int = 1
    _scalar: DType | None = None

    def __post_init__(self):
        # the value that names the one instance (see _Interned)
        object.__setattr__(self, "_key", (type(self), tuple(getattr(self, f.name) for f in fields(self))))
    # (one instance per value: identity is equality)
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @staticmethod
    def new(priority: int, itemsize: int, name: str, fmt: str | None) -> DType:
        return DType(priority, itemsize, name, fmt)

    def __repr__(self) -> str:
        # the canonical attribute name (self.name is the C type, e.g. "unsigned char", which isn't an attribute)
        base = f"dtypes.{_CANONICAL_NAMES.get(self.scalar().name, self.scalar().name)}"
        return base if self.count == 1 else f"{base}.vec({self.count})"
    def __reduce__(self): return (type(self), self._key[1])
    def __lt__(self, other: DType) -> bool: return (self.priority, self.itemsize, self.name, self.count) < \
        (other.priority, other.itemsize, other.name, other.count)

    @property
    def base(self) -> DType: return self
    @property
    def vcount(self) -> int: return self.count

    def scalar(self) -> DType: return self._scalar if self._scalar is not None else self

    def vec(self, size: int) -> DType:
        assert self.count == 1, f"can't vectorize {self} with size {size}"
        if size == 1 or self == dtypes.void: return self
        return _vec(self, size)

    def ptr(self, size: int = -1, addrspace: str = "global") -> PtrDType:
        return PtrDType(self.priority, self.itemsize, self.name, self.fmt, self.count, None, self, 1, size, addrspace)

    @property
    def min(self) -> ConstType: return dtypes.min(self)
    @property
    def max(self) -> ConstType: return dtypes.max(self)

@cache
def _vec(dt: DType, size: int) -> DType:
    return DType(dt.priority, dt.itemsize * size, f"{dt.name}{size}", None, size, dt)

@dataclass(frozen=True, eq=False)  # eq=False keeps DType's identity __eq__/__hash__ (one instance per value)
class PtrDType(DType):
    """A pointer to `_base` elements; `size` is the number of elements addressed (-1 when unknown)."""
    _base: DType | None = None
    v: int = 1
    size: int = -1
    addrspace: str = "global"

    @property
    def base(self) -> DType: return self._base  # type: ignore[return-value]
    @property
    def vcount(self) -> int: return self.v
    def vec(self, size: int) -> PtrDType:
        assert self.v == 1, f"can't vectorize {self}"
        return PtrDType(self.priority, self.itemsize, self.name, self.fmt, self.count, None, self._base, size,
                        self.size, self.addrspace)
    def ptr(self, size: int = -1, addrspace: str = "global") -> PtrDType:
        raise TypeError("can't make a pointer to a pointer")
    def scalar(self) -> PtrDType:
        return PtrDType(self.priority, self.itemsize, self.name, self.fmt, self.count, None, self._base, 1, self.size,
                        self.addrspace) if self.v != 1 else self
    def __repr__(self) -> str:
        return f"{self.base!r}.ptr({self.size}{', ' + repr(self.addrspace) if self.addrspace != 'global' else ''})" + \
            (f".vec({self.v})" if self.v != 1 else "")

DType._nfields, PtrDType._nfields = len(fields(DType)), len(fields(PtrDType))  # type: ignore[attr-defined]

class dtypes:
    """The namespace of all dtypes, with helpers to classify, bound and convert them."""
    void: Final[DType] = DType.new(-1, 0, "void", None)
    bool: Final[DType] = DType.new(0, 1, "bool", "?")
    int8: Final[DType] = DType.new(1, 1, "char", "b")
    uint8: Final[DType] = DType.new(2, 1, "unsigned char", "B")
    int16: Final[DType] = DType.new(3, 2, "short", "h")
    uint16: Final[DType] = DType.new(4, 2, "unsigned short", "H")
    int32: Final[DType] = DType.new(5, 4, "int", "i")
    uint32: Final[DType] = DType.new(6, 4, "unsigned int", "I")
    int64: Final[DType] = DType.new(7, 8, "long", "q")
    uint64: Final[DType] = DType.new(8, 8, "unsigned long", "Q")
    float16: Final[DType] = DType.new(9, 2, "half", "e")
    bfloat16: Final[DType] = DType.new(10, 2, "__bf16", None)
    float32: Final[DType] = DType.new(11, 4, "float", "f")
    float64: Final[DType] = DType.new(12, 8, "double", "d")
    index: Final[DType] = DType.new(-2, 8, "index", None)  # symbolic integers of index math, rendered as a wide int

    # aliases
    half = float16; float = float32; double = float64
    uchar = uint8; ushort = uint16; uint = uint32; ulong = uint64
    char = int8; short = int16; int = int32; long = int64

    default_float: DType = float32
    default_int: DType = int32

    floats: tuple[DType, ...] = (float16, bfloat16, float32, float64)
    uints: tuple[DType, ...] = (uint8, uint16, uint32, uint64)
    sints: tuple[DType, ...] = (int8, int16, int32, int64)
    ints: tuple[DType, ...] = uints + sints

    @staticmethod
    def is_float(x: DType) -> bool: return x.scalar() in _FLOATS
    @staticmethod
    def is_int(x: DType) -> bool: return x.scalar() in _INTS_AND_INDEX
    @staticmethod
    def is_unsigned(x: DType) -> bool: return x.scalar() in _UINTS
    @staticmethod
    def is_bool(x: DType) -> bool: return x.scalar() == dtypes.bool

    @staticmethod
    def from_py(x: Any) -> DType:
        """The dtype a Python value, or a (nested) list or tuple of them, becomes, as tinygrad and torch infer it: a
        float anywhere -> the default float; else an int anywhere (bools beside ints count as ints) -> the default int,
        or int64 where a value doesn't fit it; else (all bools) bool. An empty list, at any depth, is the default float.
        An int that int64 can't hold is an OverflowError (torch refuses it too) rather than a wrapped value, except
        beside a float, which makes them all floats. A ragged nesting (sub-lists of different shapes, or scalars
        beside lists) is a ValueError, as Tensor() gives for it."""
        if isinstance(x, float): return dtypes.default_float
        if isinstance(x, bool): return dtypes.bool
        if isinstance(x, int): return _int_dtype_of(x, x)
        if isinstance(x, (list, tuple)):
            flat = _nested_scalars(x)
            if not flat: return dtypes.default_float
            kinds = {type(v) for v in flat}
            if float in kinds: return dtypes.default_float  # (before any int is checked: [0.5, 2**70] is fine)
            if kinds <= {int, bool}:
                ints = [v for v in flat if type(v) is int]
                return _int_dtype_of(min(ints), max(ints)) if ints else dtypes.bool
            # other scalar types (subclasses of float, int or bool): each by its own rule, the widest wins
            return max((dtypes.from_py(v) for v in flat), key=lambda d: d.priority)
        raise TypeError(f"can't infer a dtype from {type(x).__name__} {x!r}")

    @staticmethod
    def as_const(val: Any, dtype: DType) -> ConstType:
        """`val` as the Python scalar a constant of `dtype` holds (ints wrap as in C, floats round to the dtype)."""
        if isinstance(val, tuple): return tuple(dtypes.as_const(v, dtype) for v in val)  # type: ignore[return-value]
        sc = dtype.scalar()
        if sc == dtypes.bool: return bool(val)
        if dtypes.is_int(sc):
            if isinstance(val, float):
                if math.isnan(val) or math.isinf(val): return 0
                val = math.trunc(val)
            return truncate_int(int(val), sc)
        if dtypes.is_float(sc): return truncate_float(float(val), sc)
        return val

    @staticmethod
    def fits(val: ConstType, dtype: DType) -> bool:
        """Whether the Python number `val` becomes a constant of `dtype` without wrapping: an int or a finite float in
        the integer dtype's range; anything in a float or bool dtype (floats too large for the dtype round to inf, as
        in IEEE). `dtype` is a scalar dtype (a tensor's)."""
        # (every Python scalar operand of a tensor operation asks: the common answers come first)
        if (r := _INT_RANGE.get(dtype)) is None or val.__class__ is bool: return True
        if val.__class__ is int: return r[0] <= val <= r[1]
        # (a float is compared before its truncation, as torch does: 127.5 doesn't fit int8)
        if isinstance(val, float) and not math.isfinite(val): return False
        return r[0] <= val <= r[1]

    @staticmethod
    def checked_const(val: Any, dtype: DType) -> ConstType:
        """as_const for values that come from the user (tensor data, fill values, scalar operands): a number that
        would wrap in `dtype` (2**40 in int32, -1 in uint8, nan in an integer dtype) is an OverflowError naming the
        value and the dtype instead, as torch and NumPy 2 refuse it."""
        if type(val) not in (int, float, bool) and hasattr(val, "item"): val = val.item()  # (numpy scalars)
        if isinstance(dtype, DType): dtype = dtype.scalar()
        if not dtypes.fits(val, dtype):
            raise OverflowError(f"{val!r} doesn't fit {dtype!r} (range [{dtypes.min(dtype)}, {dtypes.max(dtype)}]); "
                                "give a wider dtype, or cast a tensor explicitly to wrap")
        try: return dtypes.as_const(val, dtype)
        except OverflowError:  # an int too large for a float64 conversion
            raise OverflowError(f"{val!r} is too large to convert to {dtype!r}") from None

    @staticmethod
    def min(dtype: DType) -> ConstType:
        dt = dtype.scalar()
        if dt == dtypes.bool: return False
        if dt == dtypes.index: return -2**63
        if dtypes.is_unsigned(dt): return 0
        if dtypes.is_int(dt): return -2**(8*dt.itemsize-1)
        return -math.inf

    @staticmethod
    def max(dtype: DType) -> ConstType:
        dt = dtype.scalar()
        if dt == dtypes.bool: return True
        if dt == dtypes.index: return 2**63-1
        if dtypes.is_unsigned(dt): return 2**(8*dt.itemsize)-1
        if dtypes.is_int(dt): return 2**(8*dt.itemsize-1)-1
        return math.inf

    @staticmethod
    def finfo(dtype: DType) -> tuple[int, int]:
        """(exponent bits, mantissa bits) of a float dtype."""
        table = {dtypes.float16: (5, 10), dtypes.bfloat16: (8, 7), dtypes.float32: (8, 23), dtypes.float64: (11, 52)}
        if dtype.scalar() not in table: raise TypeError(f"{dtype} is not a float dtype")
        return table[dtype.scalar()]

    @staticmethod
    def fields() -> dict[str, DType]: return DTYPES_DICT

# sets for the is_* tests, which run on every constant and range computation (a tuple scan compares one by one)
_FLOATS, _UINTS = frozenset(dtypes.floats), frozenset(dtypes.uints)
_INTS_AND_INDEX = frozenset(dtypes.ints + (dtypes.index,))

# the inclusive range of each integer dtype (index excepted: it is never user data)
_INT_RANGE: dict[DType, tuple[int, int]] = {dt: (int(dtypes.min(dt)), int(dtypes.max(dt))) for dt in dtypes.ints}

def _nested_scalars(x: list | tuple) -> list:
    """The scalars of a nested list/tuple in row-major order. ValueError where the nesting is ragged: every element
    of a list must have the same shape (a scalar's is ())."""
    if not any(isinstance(v, (list, tuple)) for v in x): return list(x)  # (the common case: already flat)
    def walk(v: Any) -> tuple[list, tuple[int, ...]]:
        if not isinstance(v, (list, tuple)): return [v], ()
        if not v: return [], (0,)
        parts = [walk(e) for e in v]
        shape = parts[0][1]
        if any(p[1] != shape for p in parts):
            raise ValueError(f"ragged nested sequence: sub-sequences have shapes {sorted({p[1] for p in parts})}")
        return [s for p in parts for s in p[0]], (len(v),) + shape
    return walk(x)[0]

def _int_dtype_of(lo: int, hi: int) -> DType:
    """The dtype of Python ints from `lo` to `hi` given without a dtype: the default int, else int64."""
    for dt in (dtypes.default_int, dtypes.int64):
        if _INT_RANGE[dt][0] <= lo and hi <= _INT_RANGE[dt][1]: return dt
    bad = hi if hi > _INT_RANGE[dtypes.int64][1] else lo
    raise OverflowError(f"{bad} doesn't fit int64, the widest integer dtype inferred from Python ints; give "
                        "dtype=dtypes.uint64 or a float dtype")

DTYPES_DICT: dict[str, DType] = {k: v for k, v in vars(dtypes).items() if isinstance(v, DType) and not k.startswith("_")
                                 and k not in ("default_float", "default_int")}
# C type name -> canonical attribute of `dtypes` (the first name each dtype has in the class body; aliases come later)
_CANONICAL_NAMES: dict[str, str] = {}
for _k, _v in DTYPES_DICT.items(): _CANONICAL_NAMES.setdefault(_v.name, _k)
# canonical (non-alias) dtypes users can make tensors of
ALL_DTYPES: tuple[DType, ...] = (dtypes.bool,) + dtypes.ints + dtypes.floats

def to_dtype(x: DType | str) -> DType:
    """A DType from a DType or its name ('float32', 'half', 'int', ...)."""
    if isinstance(x, DType): return x
    if isinstance(x, str) and x in DTYPES_DICT: return DTYPES_DICT[x]
    raise TypeError(f"unknown dtype {x!r}; expected one of {sorted(DTYPES_DICT)}")

def truncate_int(v: int, dt: DType) -> int:
    """Wrap `v` to the range of integer dtype `dt`, as C does (two's complement)."""
    if dt == dtypes.index: return v
    bits = 8 * dt.itemsize
    v &= (1 << bits) - 1
    return v - (1 << bits) if not dtypes.is_unsigned(dt) and v >= 1 << (bits - 1) else v

def truncate_float(v: float, dt: DType) -> float:
    """Round `v` to the nearest value representable in float dtype `dt`."""
    if dt == dtypes.float64 or math.isnan(v) or math.isinf(v): return v
    if dt == dtypes.float32:
        try: return struct.unpack("f", struct.pack("f", v))[0]
        except OverflowError: return math.copysign(math.inf, v)
    if dt == dtypes.float16:
        try: return struct.unpack("e", struct.pack("e", v))[0]
        except OverflowError: return math.copysign(math.inf, v)
    if dt == dtypes.bfloat16: return float_to_bf16(v)
    return v

def float_to_bf16(v: float) -> float:
    """Round to bfloat16 (round to nearest even on the top 16 bits of a float32)."""
    try: bits = struct.unpack("I", struct.pack("f", v))[0]
    except OverflowError: return math.copysign(math.inf, v)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("f", struct.pack("I", bits))[0]

# *** promotion: the least upper bound in a lattice where every dtype knows the smallest types holding it ***

# each dtype lists the dtypes it promotes to directly; the result of promoting a set is the lowest common ancestor
PROMOTION_LATTICE: dict[DType, list[DType]] = {
    dtypes.bool: [dtypes.int8, dtypes.uint8],
    dtypes.int8: [dtypes.int16], dtypes.int16: [dtypes.int32], dtypes.int32: [dtypes.int64],
    dtypes.int64: [dtypes.float16, dtypes.bfloat16],
    dtypes.uint8: [dtypes.int16, dtypes.uint16], dtypes.uint16: [dtypes.int32, dtypes.uint32],
    dtypes.uint32: [dtypes.int64, dtypes.uint64], dtypes.uint64: [dtypes.float16, dtypes.bfloat16],
    dtypes.float16: [dtypes.float32], dtypes.bfloat16: [dtypes.float32], dtypes.float32: [dtypes.float64],
}

@cache
def _ancestors(dt: DType) -> set[DType]:
    return {dt}.union(*(_ancestors(p) for p in PROMOTION_LATTICE.get(dt, [])))

def least_upper_dtype(*ds: DType) -> DType:
    """The smallest dtype every one of `ds` promotes to (int64 and uint64 meet at a float, as no integer holds both)."""
    return _least_upper(tuple(d.scalar() for d in ds))

@cache
def _least_upper(scalars: tuple[DType, ...]) -> DType:  # (memoized: every binary tensor operation asks)
    if len(scalars) == 1: return scalars[0]
    if dtypes.index in scalars:
        others = [d for d in scalars if d != dtypes.index]
        return least_upper_dtype(*others) if others else dtypes.index
    common = set.intersection(*(_ancestors(d) for d in scalars))
    if not common: raise TypeError(f"no common dtype for {scalars}")
    return min(common, key=lambda d: d.priority)

def least_upper_float(dt: DType) -> DType:
    """`dt` if it is a float, else the default float (what true division and transcendental functions return)."""
    return dt if dtypes.is_float(dt) else least_upper_dtype(dt, dtypes.default_float)

def sum_acc_dtype(dt: DType) -> DType:
    """The dtype a sum accumulates in: unsigned->uint32+, signed/bool->int32+, floats->at least the default float."""
    if dtypes.is_unsigned(dt): return least_upper_dtype(dt, dtypes.uint32)
    if dtypes.is_int(dt) or dt == dtypes.bool: return least_upper_dtype(dt, dtypes.int32)
    return least_upper_dtype(dt, dtypes.float32)

# *** interop ***

_NP_NAMES: dict[DType, str] = {dtypes.bool: "bool", dtypes.int8: "int8", dtypes.uint8: "uint8", dtypes.int16: "int16",
                               dtypes.uint16: "uint16", dtypes.int32: "int32", dtypes.uint32: "uint32",
                               dtypes.int64: "int64", dtypes.uint64: "uint64", dtypes.float16: "float16",
                               dtypes.float32: "float32", dtypes.float64: "float64"}

def to_np_dtype(dt: DType) -> Any:
    # (memoized per dtype: reading a tensor's values asks for it every time)
    if (npdt := _TO_NP.get(dt)) is not None: return npdt
    import numpy as np
    if dt.scalar() not in _NP_NAMES: raise TypeError(f"{dt} has no numpy equivalent")
    npdt = _TO_NP[dt] = np.dtype(_NP_NAMES[dt.scalar()])
    return npdt

_TO_NP: dict[DType, Any] = {}

def from_np_dtype(npdt: Any) -> DType:
    # (a dtype object is looked up directly: this runs for every tensor made from an array)
    if (dt := _FROM_NP.get(npdt)) is not None: return dt
    import numpy as np
    name = np.dtype(npdt).name
    for dt, n in _NP_NAMES.items():
        if n == name:
            if isinstance(npdt, np.dtype): _FROM_NP[npdt] = dt
            return dt
    raise TypeError(f"numpy dtype {name} is not supported")

_FROM_NP: dict[Any, DType] = {}

_TORCH_NAMES: dict[DType, str] = {**{k: v for k, v in _NP_NAMES.items()}, dtypes.bfloat16: "bfloat16"}

def to_torch_dtype(dt: DType) -> Any:
    import torch
    return getattr(torch, _TORCH_NAMES[dt.scalar()])

def from_torch_dtype(tdt: Any) -> DType:
    name = str(tdt).removeprefix("torch.")
    for dt, n in _TORCH_NAMES.items():
        if n == name: return dt
    raise TypeError(f"torch dtype {tdt} is not supported")
