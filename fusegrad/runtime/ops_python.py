"""The PYTHON device: kernels are interpreted in Python, one linearized UOp at a time, with the semantics the C
renderer gives them. It is slow, and meant for cross-checking other devices on small kernels.

The renderer (fusegrad/renderer/python.py) serializes the linearized UOps to a text listing, the "compiler" passes it
through, and `PythonProgram` parses it back into nested closures (a loop is a closure over its body) working on a
register file with one slot per UOp. Semantics follow cstyle.py:
  - integers wrap around (two's complement) after every op; IDIV/MOD truncate toward zero, x/0 and x%0 give 0, and
    x/-1 is a wrapping negation; shifts by the width or more (or by a negative amount) give 0, >> is arithmetic on
    signed types
  - float32 ops are done in double and rounded to float32 (exact for + - * / sqrt: double has more than twice the
    bits); half and bfloat16 ops are done in float32 and rounded after every op; MULACC is a correctly rounded fused
    multiply-add; MAX(a, b) is `(a > b || a != a) ? a : b` (nan propagates); x/0 follows IEEE
  - exp2/log2/sin/pow use Python's double-precision math, rounded to the dtype: for float32 that may differ by 1 ulp
    from the C library's float versions (both are within 1 ulp of the exact value)
  - float -> int casts truncate and wrap, nan/inf give 0 (C leaves out-of-range conversions undefined; this is the
    rule constant folding uses, dtypes.as_const)
  - registers are read when their LOAD executes (a snapshot), memory accesses are bounds-checked, a gated LOAD gives 0
    and a gated STORE is skipped, an accumulator read before it is written is an error
  - the outermost ("global") loop runs over [core_lo, core_hi); a call split into chunks (threads on the CPU) runs
    them in reverse order, each with fresh registers, so chunks that aren't independent show up as wrong results.

GPU-style kernels (with SPECIAL ids; the contract is ProgramSpec's and Renderer's in fusegrad/renderer/__init__.py)
are emulated work-group by work-group. A call passes `global_dims` and `local_dims`; the groups run one after
another, the last first, and within a group every work-item has registers of its own while the group's DEFINE_LOCAL
buffers are shared. When the kernel has a BARRIER, each work-item runs in a Python thread, but only one of them at a
time, in a fixed order: work-item 0 (lidx0 fastest) runs until its next barrier or its end, then work-item 1, ...,
and when all wait at the barrier the next phase starts. Runs are deterministic, so whatever the checks below find,
they find every time.
  - checked: within a phase (between two barriers), a local element read by one work-item and written by another, or
    written by two ("missing barrier"); local accesses out of bounds; divergent barriers (some work-items finish or
    wait at another BARRIER uop while others wait at one); SPECIAL names other than gidx0-2/lidx0-2, repeated ones,
    or inside a loop; launch dims that don't match the SPECIALs' sizes (a dim without its SPECIAL must be 1)
  - local memory starts as 0xff bytes (nan for floats, -1 for signed integers), so reading an element before any
    work-item wrote it gives visibly wrong values rather than an error
  - WMMA (a tensor core's warp-wide matrix multiply-accumulate, codegen/opt/tc.py) is a step of the whole warp, like
    a barrier of its 32 (the instruction's `threads`) work-items: consecutive work-items (lidx0 fastest, as a GPU
    numbers a block's threads into warps) are a warp, and when every work-item of the group waits at the WMMA, each
    warp's fragments are gathered per the instruction's lane layout into A, B and C, D = A @ B + C is computed (each
    element's products summed exactly, rounded once to the output dtype; float32 inputs are first rounded to TF32,
    to nearest with ties away from zero, as the tf32 instructions take them) and scattered back to the lanes. It
    orders nothing in local memory (no new phase for the missing-barrier checks). A group that isn't whole warps,
    and a WMMA some work-items don't reach, are errors.
  - not checked: races on global memory (between work-items of a group, or between groups: they show up only when
    the result depends on the order groups run in), the renderer's limits (local_bytes, max_workgroup), and loops
    around a barrier whose trip counts differ between work-items while every work-item still reaches the same
    barriers in the same order (nested loops of 1x2 and 2x1 iterations)"""
from __future__ import annotations
import functools
import math
import operator
import struct
import threading
import time
from fractions import Fraction
from itertools import repeat
from typing import Any, Callable
from fusegrad.device import Allocator, Compiled, Compiler
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.renderer import TensorCore
from fusegrad.renderer.python import PythonRenderer, parse_listing
from fusegrad.uop.ops import ORDER_ONLY, GroupOp, Ops

# *** memory ***

class PythonAllocator(Allocator):
    """Host memory: an allocation is a byte memoryview of a bytearray (views are slices of it)."""
    supports_views = True
    def _alloc(self, size: int, options: Any) -> memoryview: return memoryview(bytearray(size))
    def _offset(self, opaque: memoryview, size: int, offset: int) -> memoryview: return opaque[offset:offset + size]
    def _as_buffer(self, opaque: memoryview) -> memoryview: return opaque
    def _copyin(self, dest: memoryview, src: memoryview) -> None: dest[:] = src
    def _copyout(self, dest: memoryview, src: memoryview) -> None: dest[:] = src

# *** scalar semantics ***

_F32, _U32, _F16, _U16 = struct.Struct("<f"), struct.Struct("<I"), struct.Struct("<e"), struct.Struct("<H")
_D, _Q = struct.Struct("<d"), struct.Struct("<Q")

def round_f32(v: float) -> float:
    """The float32 nearest to v (round to nearest even; inf beyond the range)."""
    try: return _F32.unpack(_F32.pack(v))[0]
    except OverflowError: return math.copysign(math.inf, v)

def round_f16(v: float) -> float:
    """The float16 nearest to v."""
    try: return _F16.unpack(_F16.pack(v))[0]
    except OverflowError: return math.copysign(math.inf, v)

def f32_to_bf16_bits(v: float) -> int:
    """bfloat16 bits of float32 value v, as the C helper fg_f32_to_bf16 computes them (nan is quieted)."""
    u = _U32.unpack(_F32.pack(v))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000: return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16

def bf16_bits_to_float(b: int) -> float: return _F32.unpack(_U32.pack(b << 16))[0]
def round_bf16(v: float) -> float:
    """v rounded to float32, then to bfloat16 (as C converts: through float)."""
    return bf16_bits_to_float(f32_to_bf16_bits(round_f32(v)))

def int_to_float(v: int, mant: int) -> float:
    """Integer v correctly rounded to a float with `mant` significand bits (24: float32), as a Python float."""
    n = abs(v)
    if (shift := n.bit_length() - mant) > 0:
        q, rem = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and q & 1): q += 1
        n = q << shift
    try: f = float(n)
    except OverflowError: f = math.inf
    return -f if v < 0 else f

def fma_f32(a: float, b: float, c: float) -> float:
    """float32 fused multiply-add, correctly rounded. The product of two float32s is exact in double; the sum is
    made exact with TwoSum and rounded to odd in double, which then rounds to float32 like the exact value does."""
    if not (math.isfinite(a) and math.isfinite(b)): return round_f32(a * b + c)
    if not math.isfinite(c): return c    # the exact product is finite
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    if err != 0 and not _Q.unpack(_D.pack(s))[0] & 1: s = math.nextafter(s, math.copysign(math.inf, err))
    return round_f32(s)

def fma_f64(a: float, b: float, c: float) -> float:
    """float64 fused multiply-add, correctly rounded (exact rational arithmetic)."""
    if not (math.isfinite(a) and math.isfinite(b)): return a * b + c
    if not math.isfinite(c): return c    # the exact product is finite, even when it overflows double
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0: return a * b + c if a * b == 0 and c == 0 else 0.0   # the sign of an exact zero as IEEE says
    try: return float(exact)
    except OverflowError: return math.inf if exact > 0 else -math.inf

def _fdiv(a: float, b: float) -> float:
    try: return a / b
    except ZeroDivisionError:
        if a == 0 or math.isnan(a): return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)

def _fsqrt(x: float) -> float:
    try: return math.sqrt(x)
    except ValueError: return math.nan

def _fexp2(x: float) -> float:
    try: return math.exp2(x)
    except OverflowError: return math.inf

def _flog2(x: float) -> float:
    try: return math.log2(x)
    except ValueError: return -math.inf if x == 0 else math.nan

def _fsin(x: float) -> float:
    try: return math.sin(x)
    except ValueError: return math.nan

def _ftrunc(x: float) -> float: return math.copysign(float(math.trunc(x)), x) if math.isfinite(x) else x

def _odd_int(y: float) -> bool: return math.isfinite(y) and y.is_integer() and int(y) % 2 == 1

def _fpow(x: float, y: float) -> float:
    """C pow: pow(x, 0) = 1 and pow(1, y) = 1 even for nan, a pole at 0 gives inf, a negative base with a
    non-integer exponent gives nan, overflow gives inf."""
    try: return math.pow(x, y)
    except OverflowError: return -math.inf if x < 0 and _odd_int(y) else math.inf
    except ValueError:
        if x == 0: return -math.inf if math.copysign(1.0, x) < 0 and _odd_int(y) else math.inf
        return math.nan

def _fmod(x: float, y: float) -> float:
    try: return math.fmod(x, y)
    except ValueError: return math.nan

def _fmax(a: float, b: float) -> float: return a if (a > b or a != a) else b

def _c_idiv(a: int, b: int) -> int:
    if b == 0: return 0
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q

def _c_mod(a: int, b: int) -> int: return a - _c_idiv(a, b) * b if b != 0 else 0

_ROT = (13, 15, 26, 6, 17, 29, 16, 24)
_M32 = 0xFFFFFFFF

def threefry(x: int, key: int) -> int:
    """Threefry-2x32 with 20 rounds, as the C helper fg_threefry (x and key: two 32-bit words, low word first)."""
    ks = [key & _M32, (key >> 32) & _M32, 0]
    ks[2] = ks[0] ^ ks[1] ^ 0x1BD11BDA
    x0, x1 = ((x & _M32) + ks[0]) & _M32, (((x >> 32) & _M32) + ks[1]) & _M32
    for r in range(20):
        rot = _ROT[r % 8]
        x0 = (x0 + x1) & _M32
        x1 = (((x1 << rot) | (x1 >> (32 - rot))) & _M32) ^ x0
        if r % 4 == 3:
            i = r // 4 + 1
            x0 = (x0 + ks[i % 3]) & _M32
            x1 = (x1 + ks[(i + 1) % 3] + i) & _M32
    return (x1 << 32) | x0

def _bits(dt: DType) -> int: return 8 * dt.itemsize

def wrap_fn(dt: DType) -> Callable[[int], Any]:
    """Reduce a Python int to integer dtype `dt` as C stores it (bool: != 0; index is a 64-bit long)."""
    if dt == dtypes.bool: return bool
    bits, signed = _bits(dt), not dtypes.is_unsigned(dt)
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    if signed: return lambda v: ((v + half) & mask) - half
    return lambda v: v & mask

def float_to_int_fn(dt: DType) -> Callable[[float], Any]:
    """C's float -> integer conversion for in-range values (truncation); out of range it wraps, nan/inf give 0."""
    if dt == dtypes.bool: return bool
    wrap = wrap_fn(dt)
    return lambda v: wrap(math.trunc(v)) if math.isfinite(v) else 0

def round_fn(dt: DType) -> Callable[[float], float]:
    """Rounding of an exact (double) result of an op carried out in float dtype `dt`: half and bfloat16 ops are
    computed in float32 and rounded to the dtype."""
    if dt == dtypes.float64: return float
    if dt == dtypes.float32: return round_f32
    if dt == dtypes.float16: return lambda v: round_f16(round_f32(v))
    if dt == dtypes.bfloat16: return round_bf16
    raise TypeError(f"{dt} is not a float dtype")

_FLOAT_ALU: dict[Ops, Callable[..., Any]] = {
    Ops.ADD: operator.add, Ops.SUB: operator.sub, Ops.MUL: operator.mul, Ops.FDIV: _fdiv,
    Ops.RECIP: lambda x: _fdiv(1.0, x), Ops.NEG: operator.neg, Ops.MAX: _fmax, Ops.SQRT: _fsqrt, Ops.EXP2: _fexp2,
    Ops.LOG2: _flog2, Ops.SIN: _fsin, Ops.TRUNC: _ftrunc, Ops.POW: _fpow, Ops.MOD: _fmod,
    Ops.CMPLT: operator.lt, Ops.CMPNE: operator.ne, Ops.CMPEQ: operator.eq,
}
_INT_ALU: dict[Ops, Callable[..., Any]] = {
    Ops.ADD: operator.add, Ops.SUB: operator.sub, Ops.MUL: operator.mul, Ops.IDIV: _c_idiv, Ops.FDIV: _c_idiv,
    Ops.MOD: _c_mod, Ops.RECIP: lambda x: _c_idiv(1, x), Ops.MAX: lambda a, b: a if a > b else b,
    Ops.AND: operator.and_, Ops.OR: operator.or_, Ops.XOR: operator.xor, Ops.NOT: operator.not_,
    Ops.CMPLT: operator.lt, Ops.CMPNE: operator.ne, Ops.CMPEQ: operator.eq, Ops.TRUNC: lambda x: x,
    Ops.MULACC: lambda a, b, c: a * b + c, Ops.THREEFRY: threefry,
}
# integer ops C computes through double: (t)f((double)x)
_INT_VIA_DOUBLE = {Ops.SQRT: _fsqrt, Ops.EXP2: _fexp2, Ops.LOG2: _flog2, Ops.SIN: _fsin, Ops.POW: _fpow}

def alu_fn(op: Ops, dt: DType, src_dts: tuple[DType, ...]) -> Callable[..., Any]:
    """A function of Python scalars computing ALU `op` with result dtype `dt` (scalar) as the C renderer does."""
    if op is Ops.WHERE: return lambda c, a, b: a if c else b
    odt = src_dts[-1].scalar() if op in GroupOp.Comparison else dt   # the dtype the operation is carried out in
    if dtypes.is_float(odt):
        if op in GroupOp.Comparison: return _FLOAT_ALU[op]
        rnd = round_fn(odt)
        if op is Ops.MULACC: return fma_f64 if odt == dtypes.float64 else \
            (fma_f32 if odt == dtypes.float32 else lambda a, b, c: rnd(fma_f32(a, b, c)))
        if op is Ops.IDIV:   # trunc of the quotient rounded to the dtype computed in (float32 for half and bfloat16)
            q = round_f32 if odt in (dtypes.float16, dtypes.bfloat16) else rnd
            return lambda a, b: rnd(_ftrunc(q(_fdiv(a, b))))
        if op not in _FLOAT_ALU: raise NotImplementedError(f"no {op} on {odt}")
        f = _FLOAT_ALU[op]
        if len(src_dts) == 1: return lambda a: rnd(f(a))
        return lambda a, b: rnd(f(a, b))
    if op in GroupOp.Comparison: return _INT_ALU[op]
    wrap = wrap_fn(dt)
    if op is Ops.NEG: return operator.not_ if dt == dtypes.bool else lambda a: wrap(-a)
    if op in (Ops.SHL, Ops.SHR):
        bits = _bits(dt)
        if op is Ops.SHL: return lambda a, b: wrap(a << b) if 0 <= b < bits else wrap(0)
        return lambda a, b: wrap(a >> b) if 0 <= b < bits else wrap(0)
    if op in _INT_VIA_DOUBLE:
        f, to_int = _INT_VIA_DOUBLE[op], float_to_int_fn(dt)
        return (lambda a: to_int(f(float(a)))) if len(src_dts) == 1 else lambda a, b: to_int(f(float(a), float(b)))
    if op not in _INT_ALU: raise NotImplementedError(f"no {op} on {dt}")
    g = _INT_ALU[op]
    if len(src_dts) == 1: return lambda a: wrap(g(a))
    if len(src_dts) == 2: return lambda a, b: wrap(g(a, b))
    return lambda a, b, c: wrap(g(a, b, c))

def cast_fn(src: DType, dst: DType) -> Callable[[Any], Any]:
    """Scalar C conversion from `src` to `dst` (bfloat16 goes through float32 both ways)."""
    src, dst = src.scalar(), dst.scalar()
    if src == dst: return lambda v: v
    if src == dtypes.bfloat16: src = dtypes.float32   # its value is exactly a float32
    if dst == dtypes.bool: return bool
    isf = dtypes.is_float(src)
    if dst == dtypes.bfloat16:
        to32 = cast_fn(src, dtypes.float32)
        return lambda v: bf16_bits_to_float(f32_to_bf16_bits(to32(v)))
    if dst == dtypes.float32:
        if isf: return round_f32
        return lambda v: int_to_float(int(v), 24)
    if dst == dtypes.float64: return float if isf else lambda v: int_to_float(int(v), 53)
    if dst == dtypes.float16:
        # ints beyond float16's range are inf however they are rounded, so going through double is exact enough
        return round_f16 if isf else lambda v: round_f16(float(v))
    if isf: return float_to_int_fn(dst)
    wrap = wrap_fn(dst)
    return lambda v: wrap(int(v))

def _fmt(dt: DType) -> str:
    if dt == dtypes.bfloat16: return "H"
    if dt.fmt is None: raise TypeError(f"{dt} has no memory format")
    return dt.fmt

def to_bits_fn(dt: DType) -> Callable[[Any], Any]:
    """Python value of scalar dtype `dt` -> what struct packs with `_fmt(dt)`."""
    return (lambda v: f32_to_bf16_bits(v)) if dt == dtypes.bfloat16 else (lambda v: v)

def from_bits_fn(dt: DType) -> Callable[[Any], Any]:
    return bf16_bits_to_float if dt == dtypes.bfloat16 else (lambda v: v)

def bitcast_fn(src: DType, dst: DType) -> Callable[[Any], Any]:
    """Reinterpret the bytes of a `src` value (scalar or vector tuple) as `dst`."""
    if src.itemsize != dst.itemsize: raise TypeError(f"BITCAST between sizes: {src} -> {dst}")
    ps = struct.Struct("<" + _fmt(src.scalar()) * src.count)
    pd = struct.Struct("<" + _fmt(dst.scalar()) * dst.count)
    tb, fb = to_bits_fn(src.scalar()), from_bits_fn(dst.scalar())
    def f(v):
        out = tuple(fb(x) for x in pd.unpack(ps.pack(*[tb(x) for x in (v if src.count > 1 else (v,))])))
        return out if dst.count > 1 else out[0]
    return f

def const_value(v: Any, dt: DType) -> Any:
    """The value a CONST of scalar dtype `dt` has in C (the C renderer truncates bfloat16 constants' float32 bits)."""
    if dt == dtypes.bool: return bool(v)
    if dt == dtypes.bfloat16:
        return v if math.isnan(v) else bf16_bits_to_float(_U32.unpack(_F32.pack(v))[0] >> 16)
    if dtypes.is_float(dt): return round_fn(dt)(float(v))
    return wrap_fn(dt)(int(v))

def zero_of(dt: DType) -> Any:
    z = const_value(0, dt.scalar())
    return tuple(repeat(z, dt.count)) if dt.count > 1 else z

# *** memory views of one dtype ***

class _Mem:
    """Elements of one dtype in a byte buffer, with bounds-checked scalar and vector access."""
    def __init__(self, raw: memoryview, dt: DType, what: str):
        self.dt, self.what = dt, what
        self.n = raw.nbytes // dt.itemsize
        mv = raw[:self.n * dt.itemsize]
        if dt == dtypes.float16:
            self.mv = mv.cast("H")
            self.dec: Callable | None = lambda b: _F16.unpack(_U16.pack(b))[0]
            self.enc: Callable | None = lambda v: _U16.unpack(_F16.pack(v))[0]
        elif dt == dtypes.bfloat16:
            self.mv = mv.cast("H")
            self.dec, self.enc = bf16_bits_to_float, f32_to_bf16_bits
        else:
            self.mv = mv.cast(_fmt(dt))
            self.dec = self.enc = None

    def _oob(self, i: int, count: int) -> IndexError:
        return IndexError(f"{self.what}: access to elements [{i}, {i + count}) of {self.n}")

    def load(self, i: int) -> Any:
        if i < 0 or i >= self.n: raise self._oob(i, 1)
        v = self.mv[i]
        return v if self.dec is None else self.dec(v)

    def loadv(self, i: int, count: int) -> tuple:
        if i < 0 or i + count > self.n: raise self._oob(i, count)
        vs = self.mv[i:i + count].tolist()
        return tuple(vs) if self.dec is None else tuple(map(self.dec, vs))

    def store(self, i: int, v: Any) -> None:
        if i < 0 or i >= self.n: raise self._oob(i, 1)
        self.mv[i] = v if self.enc is None else self.enc(v)

    def storev(self, i: int, vs: tuple) -> None:
        if i < 0 or i + len(vs) > self.n: raise self._oob(i, len(vs))
        for k, v in enumerate(vs): self.mv[i + k] = v if self.enc is None else self.enc(v)

class _LocalMem(_Mem):
    """A work-group's local memory, shared by its work-items, with accesses checked for missing barriers: within a
    phase (between two barriers) no element may be read by one work-item and written by another, or written by two.
    `item` is the work-item running now (one runs at a time); `who(k, with_group)` names work-item k in messages."""
    def __init__(self, raw: memoryview, dt: DType, what: str, who: Callable[[int, bool], str]):
        super().__init__(raw, dt, what)
        self.who, self.item = who, 0
        self.writer: dict[int, int] = {}   # element -> the work-item that wrote it in this phase
        self.reader: dict[int, tuple[int, ...]] = {}   # element -> the first two work-items that read it in this phase

    def new_phase(self) -> None:
        self.writer.clear()
        self.reader.clear()

    def _race(self, i: int, k: int, did: str, other: int, other_did: str) -> IndexError:
        return IndexError(f"{self.what}: missing barrier: {self.who(k, True)} {did} element {i}, which "
                          f"{self.who(other, False)} {other_did} since the last barrier")

    def _check_load(self, i: int) -> None:
        k = self.item
        if (w := self.writer.get(i, k)) != k: raise self._race(i, k, "reads", w, "wrote")
        rd = self.reader.get(i, ())
        if len(rd) < 2 and k not in rd: self.reader[i] = rd + (k,)

    def _check_store(self, i: int) -> None:
        k = self.item
        if (w := self.writer.get(i, k)) != k: raise self._race(i, k, "writes", w, "wrote")
        for rd in self.reader.get(i, ()):
            if rd != k: raise self._race(i, k, "writes", rd, "read")
        self.writer[i] = k

    def load(self, i: int) -> Any:
        v = super().load(i)
        self._check_load(i)
        return v

    def loadv(self, i: int, count: int) -> tuple:
        v = super().loadv(i, count)
        for x in range(i, i + count): self._check_load(x)
        return v

    def store(self, i: int, v: Any) -> None:
        if 0 <= i < self.n: self._check_store(i)
        super().store(i, v)

    def storev(self, i: int, vs: tuple) -> None:
        if 0 <= i and i + len(vs) <= self.n:
            for x in range(i, i + len(vs)): self._check_store(x)
        super().storev(i, vs)

# *** programs ***

Step = Callable[[list], None]

_SPECIAL_NAMES = ("gidx0", "gidx1", "gidx2", "lidx0", "lidx1", "lidx2")

class _Abort(BaseException):
    """Unwinds a work-item's thread when its group's launch failed (BaseException: no step catches it)."""

class PythonProgram:
    """A kernel listing turned into closures; called like CPUProgram: buffers in DEFINE_GLOBAL order, then `vals` in
    DEFINE_VAR name order, the outermost loop over [0, global_size) split into `threads` chunks. A GPU-style kernel
    (one with SPECIAL ids) is launched over `global_dims` work-groups of `local_dims` work-items instead."""
    def __init__(self, name: str, lib: bytes):
        self.name = name
        _, self.instrs = parse_listing(lib.decode())
        n = len(self.instrs)
        # registers past the UOps' own: the CPU-style core range; a work-item's ids (gidx0-2, lidx0-2), the launch
        # dims in the same order, its group (None when it runs alone) and its index in the group
        self.core_lo, self.core_hi = n, n + 1
        self.ids, self.dims, self.group, self.item = n + 2, n + 3, n + 4, n + 5
        self.template: list[Any] = [None] * (n + 6)
        self.globals: list[tuple[int, int, DType]] = []   # (arg, slot, element dtype) in argument order
        self.vars: list[tuple[str, int]] = []          # (name, slot) in argument order
        self.specials: dict[str, int] = {}             # SPECIAL name -> its uop
        self.locals: list[tuple[int, int, DType, str]] = []   # GPU-style: (slot, bytes, element dtype, name)
        self.global_loop: int | None = None            # the CPU-style "global" RANGE
        self.has_barrier = False   # (or a WMMA: a step of all the work-items of a warp)
        self.wmmas: dict[int, TensorCore] = {}   # WMMA uop -> its instruction
        for i, (op, dt, srcs, arg) in enumerate(self.instrs):
            if op is not Ops.SPECIAL: continue
            if arg not in _SPECIAL_NAMES: raise self._err(i, f"malformed SPECIAL name {arg!r}: not one of "
                                                             f"{', '.join(_SPECIAL_NAMES)}")
            if arg in self.specials: raise self._err(i, f"SPECIAL {arg} repeated (uop {self.specials[arg]} is one)")
            if dt != dtypes.index or len(srcs) != 1:
                raise self._err(i, "a SPECIAL is an index with one source, its size")
            self.specials[arg] = i
        self.gpu = bool(self.specials)
        self.body = self._build()

    def _err(self, i: int, msg: str) -> RuntimeError:
        op, dt, _, arg = self.instrs[i]
        return RuntimeError(f"PYTHON kernel {self.name}: uop {i} ({op.name} {dt!r} {arg!r}): {msg}")

    def _build(self) -> list[Step]:
        ins = self.instrs
        gl: list[tuple[int, int, DType]] = []
        blocks: list[list[Step]] = [[]]
        open_loops: list[int] = []
        for i, (op, dt, srcs, arg) in enumerate(ins):
            if op is Ops.DEFINE_GLOBAL:
                assert isinstance(dt, PtrDType)
                gl.append((arg, i, dt.base))
            elif op is Ops.DEFINE_VAR: self.vars.append((arg[0], i))
            elif op is Ops.CONST: self.template[i] = const_value(arg, dt)
            elif op is Ops.RANGE:
                if arg[1] == "global": self.global_loop = i
                blocks.append([])
                open_loops.append(i)
            elif op is Ops.END:
                if not open_loops or srcs[0] != open_loops[-1]: raise self._err(i, "END doesn't close the open loop")
                body = blocks.pop()
                blocks[-1].append(self._loop(open_loops.pop(), body))
            else:
                if open_loops and (op is Ops.SPECIAL or (self.gpu and op is Ops.DEFINE_LOCAL)):
                    raise self._err(i, f"a {op.name} inside a loop (uop {open_loops[-1]})")
                if (step := self._step(i, op, dt, srcs, arg)) is not None: blocks[-1].append(step)
        if open_loops: raise self._err(open_loops[-1], "loop never closed")
        self.globals = sorted(gl)
        self.vars.sort()
        return blocks[0]

    def _src(self, i: int, srcs: tuple[int | None, ...], k: int) -> int:
        if k >= len(srcs) or srcs[k] is None: raise self._err(i, f"source {k} is not in the program")
        return srcs[k]   # type: ignore[return-value]

    def _loop(self, i: int, body: list[Step]) -> Step:
        _, _, srcs, arg = self.instrs[i]
        if arg[1] == "global":
            lo, hi, end = self.core_lo, self.core_hi, self._src(i, srcs, 0)
            def run_global(r: list) -> None:
                if r[lo] < 0 or r[hi] > r[end]:
                    raise self._err(i, f"core range [{r[lo]}, {r[hi]}) exceeds the loop's [0, {r[end]})")
                for x in range(r[lo], r[hi]):
                    r[i] = x
                    for s in body: s(r)
            return run_global
        end = self._src(i, srcs, 0)
        def run_loop(r: list) -> None:
            for x in range(r[end]):
                r[i] = x
                for s in body: s(r)
        return run_loop

    def _step(self, i: int, op: Ops, dt: DType, srcs: tuple[int | None, ...], arg: Any) -> Step | None:
        ins = self.instrs
        s = lambda k: self._src(i, srcs, k)
        if op in (Ops.NOOP, Ops.DEFINE_REG): return None   # registers start unset (None): reading one is an error
        if op is Ops.DEFINE_LOCAL:
            assert isinstance(dt, PtrDType)
            nbytes, base, what = dt.size * dt.base.itemsize, dt.base, f"{self.name} local{arg}"
            if self.gpu:   # shared by a work-group: made when the group starts
                self.locals.append((i, nbytes, base, what))
                return None
            def define_local(r: list) -> None: r[i] = _Mem(memoryview(bytearray(nbytes)), base, what)
            return define_local
        if op is Ops.BARRIER and self.gpu and arg != ORDER_ONLY:
            self.has_barrier = True
            a, grp, item = s(0), self.group, self.item
            def barrier(r: list) -> None:
                if (g := r[grp]) is not None: g.wait(r[item], i)
                r[i] = r[a]
            return barrier
        if op is Ops.WMMA: return self._wmma(i, dt, srcs, arg)
        if op in (Ops.BIND, Ops.BARRIER):
            a = s(0)
            def alias(r: list) -> None: r[i] = r[a]
            return alias
        if op is Ops.SPECIAL:
            size, ids, dims, j = s(0), self.ids, self.dims, _SPECIAL_NAMES.index(arg)
            which = f"{'global' if j < 3 else 'local'}_dims[{j % 3}]"
            def special(r: list) -> None:
                if r[size] != r[dims][j]: raise self._err(i, f"its size {r[size]} doesn't match the launch's "
                                                             f"{which} = {r[dims][j]}")
                r[i] = r[ids][j]
            return special
        if op is Ops.INDEX: return self._index(i, dt, srcs)
        if op is Ops.LOAD: return self._load(i, dt, srcs)
        if op is Ops.STORE: return self._store(i, srcs)
        if op is Ops.VECTORIZE:
            xs = tuple(s(k) for k in range(len(srcs)))
            def vectorize(r: list) -> None: r[i] = tuple([r[x] for x in xs])
            return vectorize
        if op is Ops.GEP:
            a, k = s(0), arg
            if not isinstance(k, int): raise self._err(i, "GEP arg must be one lane")
            def gep(r: list) -> None: r[i] = r[a][k]
            return gep
        if op in (Ops.CAST, Ops.BITCAST):
            a = s(0)
            sdt = ins[a][1]
            if op is Ops.BITCAST: f = bitcast_fn(sdt, dt)
            else:
                f = cast_fn(sdt, dt)
                if dt.count > 1: f = _lanes(f, (True,), dt.count)
            def cast(r: list) -> None: r[i] = f(r[a])
            return cast
        if op in GroupOp.ALU: return self._alu(i, op, dt, srcs)
        raise self._err(i, f"{op.name} can't be interpreted")

    def _alu(self, i: int, op: Ops, dt: DType, srcs: tuple[int | None, ...]) -> Step:
        xs = tuple(self._src(i, srcs, k) for k in range(len(srcs)))
        sdts = tuple(self.instrs[x][1] for x in xs)
        # operands must agree on their dtype, except a WHERE's condition and a shift amount
        same = sdts[1:] if op is Ops.WHERE else sdts[:1] if op in (Ops.SHL, Ops.SHR) else sdts
        if len({d.scalar() for d in same}) > 1: raise self._err(i, f"operands of mixed dtypes {sdts}")
        f = alu_fn(op, dt.scalar(), tuple(d.scalar() for d in sdts))
        if dt.count > 1:
            if op is Ops.WHERE and sdts[0].count == 1: pass    # a scalar condition selects a whole vector
            else: f = _lanes(f, tuple(d.count > 1 for d in sdts), dt.count)
        if len(xs) == 1:
            a = xs[0]
            def alu1(r: list) -> None: r[i] = f(r[a])
            return alu1
        if len(xs) == 2:
            a, b = xs
            def alu2(r: list) -> None: r[i] = f(r[a], r[b])
            return alu2
        a, b, c = xs
        def alu3(r: list) -> None: r[i] = f(r[a], r[b], r[c])
        return alu3

    def _wmma(self, i: int, dt: DType, srcs: tuple[int | None, ...], arg: Any) -> Step:
        try: tc = TensorCore.from_wmma_arg(arg)
        except (TypeError, ValueError, KeyError) as e: raise self._err(i, f"malformed WMMA arg: {e}") from None
        xs = tuple(self._src(i, srcs, k) for k in range(3))
        want = (tc.dtype_in.vec(tc.elements("A")), tc.dtype_in.vec(tc.elements("B")),
                tc.dtype_out.vec(tc.elements("C")))
        got = tuple(self.instrs[x][1] for x in xs)
        if len(srcs) != 3 or got != want or dt != want[2]:
            raise self._err(i, f"WMMA of {tc.name} takes {want} and gives {want[2]!r}, got {got} and {dt!r}")
        self.wmmas[i] = tc
        self.has_barrier = True
        grp, item = self.group, self.item
        def wmma(r: list) -> None:
            if (g := r[grp]) is None:
                raise self._err(i, f"a WMMA is a step of a warp of {tc.threads} work-items; this one runs alone")
            r[i] = g.wait(r[item], i, tuple(r[x] for x in xs))
        return wmma

    def _index(self, i: int, dt: DType, srcs: tuple[int | None, ...]) -> Step:
        # an INDEX is (memory, element) or None when its gate is off
        b, x = self._src(i, srcs, 0), self._src(i, srcs, 1)
        if len(srcs) > 2:
            g = self._src(i, srcs, 2)
            def index_gated(r: list) -> None: r[i] = (r[b], r[x]) if r[g] else None
            return index_gated
        def index(r: list) -> None: r[i] = (r[b], r[x])
        return index

    def _load(self, i: int, dt: DType, srcs: tuple[int | None, ...]) -> Step:
        ins = self.instrs
        a = self._src(i, srcs, 0)
        if ins[a][0] is Ops.DEFINE_REG:
            def load_reg(r: list) -> None:
                if (v := r[a]) is None: raise self._err(i, "accumulator read before it was written")
                r[i] = v
            return load_reg
        if ins[a][0] is not Ops.INDEX: raise self._err(i, f"LOAD from {ins[a][0].name}")
        idt = ins[a][1]
        assert isinstance(idt, PtrDType)
        n, zero = idt.vcount, zero_of(dt)
        if n != dt.count: raise self._err(i, f"LOAD of {dt!r} through a pointer to {n} elements")
        err = self._err
        if len(srcs) > 1:
            # a vector load on a padded edge: one vector access when every lane is valid, else a gated load per lane
            every, lanes = self._src(i, srcs, 1), tuple(self._src(i, srcs, k) for k in range(2, len(srcs)))
            z1 = zero_of(dt.scalar())
            def load_lanes(r: list) -> None:
                if (p := r[a]) is None: r[i] = zero; return
                mem, base = p
                try:
                    if r[every]: r[i] = mem.loadv(base, n)
                    else: r[i] = tuple([mem.load(base + k) if r[m] else z1 for k, m in enumerate(lanes)])
                except IndexError as e: raise err(i, str(e)) from None
            return load_lanes
        if n > 1:
            def loadv(r: list) -> None:
                if (p := r[a]) is None: r[i] = zero; return
                try: r[i] = p[0].loadv(p[1], n)
                except IndexError as e: raise err(i, str(e)) from None
            return loadv
        def load(r: list) -> None:
            if (p := r[a]) is None: r[i] = zero; return
            try: r[i] = p[0].load(p[1])
            except IndexError as e: raise err(i, str(e)) from None
        return load

    def _store(self, i: int, srcs: tuple[int | None, ...]) -> Step:
        ins = self.instrs
        a, v = self._src(i, srcs, 0), self._src(i, srcs, 1)
        vdt = ins[v][1]
        if ins[a][0] is Ops.DEFINE_REG:
            if ins[a][1] != vdt: raise self._err(i, f"store of {vdt!r} to a {ins[a][1]!r} register")
            def store_reg(r: list) -> None: r[a] = r[v]
            return store_reg
        if ins[a][0] is not Ops.INDEX: raise self._err(i, f"STORE to {ins[a][0].name}")
        idt = ins[a][1]
        assert isinstance(idt, PtrDType)
        if idt.base != vdt.scalar() or idt.vcount != vdt.count:
            raise self._err(i, f"store of {vdt!r} through {idt!r}")
        err = self._err
        if vdt.count > 1:
            def storev(r: list) -> None:
                if (p := r[a]) is None: return
                try: p[0].storev(p[1], r[v])
                except IndexError as e: raise err(i, str(e)) from None
            return storev
        def store(r: list) -> None:
            if (p := r[a]) is None: return
            try: p[0].store(p[1], r[v])
            except IndexError as e: raise err(i, str(e)) from None
        return store

    def __call__(self, *bufs: memoryview, vals: tuple[int, ...] = (), global_size: int = 1, threads: int = 1,
                 wait: bool = False, join: bool = False, helpable: bool = True, global_dims: tuple[int, ...] = (),
                 local_dims: tuple[int, ...] = ()) -> float | None:
        if len(bufs) != len(self.globals) or len(vals) != len(self.vars):
            raise TypeError(f"PYTHON kernel {self.name} takes {len(self.globals)} buffers and {len(self.vars)} vars, "
                            f"got {len(bufs)} and {len(vals)}")
        st = time.perf_counter()
        init = list(self.template)
        for (arg, slot, dt), buf in zip(self.globals, bufs): init[slot] = _Mem(buf, dt, f"{self.name} data{arg}")
        for (_, slot), v in zip(self.vars, vals): init[slot] = v
        if self.gpu or global_dims or local_dims:
            self._launch(init, tuple(global_dims), tuple(local_dims))
            return time.perf_counter() - st if wait else None
        gs = max(global_size, 1)
        threads = max(1, min(threads, gs))
        bounds = [gs * k // threads for k in range(threads + 1)]
        for k in reversed(range(threads)):
            regs = list(init)   # each chunk (a thread on the CPU) has its own registers and local buffers
            regs[self.core_lo], regs[self.core_hi] = bounds[k], bounds[k + 1]
            for s in self.body: s(regs)
        return time.perf_counter() - st if wait else None

    def _check_launch(self, global_dims: tuple[int, ...], local_dims: tuple[int, ...]) -> tuple[int, ...]:
        """The six launch dims (global 0-2, local 0-2, missing ones 1) after checking them against the kernel."""
        me = f"PYTHON kernel {self.name}"
        if not global_dims: raise RuntimeError(f"{me} is GPU-style (it has SPECIAL ids): it needs global_dims and "
                                               f"local_dims to launch")
        if len(global_dims) != len(local_dims) or len(global_dims) > 3:
            raise RuntimeError(f"{me}: global_dims {global_dims} and local_dims {local_dims} must have the same "
                               f"length, at most 3")
        if not all(isinstance(d, int) and d >= 1 for d in global_dims + local_dims):
            raise RuntimeError(f"{me}: launch dims must be positive ints, got global_dims {global_dims} and "
                               f"local_dims {local_dims}")
        if self.global_loop is not None:
            raise self._err(self.global_loop, "a CPU-style global loop in a kernel launched over work-groups")
        pad = (1,) * (3 - len(global_dims))
        dims = global_dims + pad + local_dims + pad
        for j, name in enumerate(_SPECIAL_NAMES):
            which = f"{'global' if j < 3 else 'local'}_dims[{j % 3}]"
            if name in self.specials and j % 3 >= len(global_dims):
                raise self._err(self.specials[name], f"the launch has no {which} (global_dims {global_dims}, "
                                                     f"local_dims {local_dims})")
            if name not in self.specials and dims[j] != 1:
                raise RuntimeError(f"{me}: launched with {which} = {dims[j]}, but the kernel has no {name}")
        return dims

    def _launch(self, init: list, global_dims: tuple[int, ...], local_dims: tuple[int, ...]) -> None:
        """Run every work-group, the last first (groups may run in any order, so results mustn't depend on it)."""
        dims = self._check_launch(global_dims, local_dims)
        nd = len(global_dims)
        g0, g1, g2, l0, l1, l2 = dims
        n_items = l0 * l1 * l2
        init[self.dims] = dims
        for g in reversed(range(g0 * g1 * g2)):
            gid = (g % g0, g // g0 % g1, g // (g0 * g1))
            lids = [(k % l0, k // l0 % l1, k // (l0 * l1)) for k in range(n_items)]
            def who(k: int, with_group: bool = True, gid: tuple = gid, lids: list = lids) -> str:
                return f"work-item lidx {lids[k][:nd]}" + (f" of group gidx {gid[:nd]}" if with_group else "")
            # local memory starts as 0xff bytes (nan, -1): values read before they are written show up
            mems = [(slot, _LocalMem(memoryview(bytearray(b"\xff" * nbytes)), dt, what, who))
                    for slot, nbytes, dt, what in self.locals]
            regs = []
            for k in range(n_items):
                r = list(init)
                r[self.ids], r[self.item] = gid + lids[k], k
                for slot, m in mems: r[slot] = m
                regs.append(r)
            if self.has_barrier and n_items > 1: _Group(self, regs, [m for _, m in mems], who).run()
            else:   # no barrier to wait at: the work-items run one after the other
                for k, r in enumerate(regs):
                    for _, m in mems: m.item = k
                    for s in self.body: s(r)

class _Group:
    """The work-items of one work-group, each in a thread of its own, of which exactly one runs at a time: it holds
    the baton until it reaches a barrier or its end, then hands it to the next work-item (the last one hands it back
    to the launching thread). When all of them wait at the same barrier, the next phase starts the same way."""
    def __init__(self, prog: PythonProgram, regs: list[list], mems: list[_LocalMem], who: Callable[..., str]):
        self.prog, self.regs, self.mems, self.who = prog, regs, mems, who
        self.go = [threading.Semaphore(0) for _ in regs]   # released to give work-item k the baton
        self.back = threading.Semaphore(0)                   # released to give it back to the launching thread
        # what each work-item did with the baton: the BARRIER (or WMMA) uop it waits at, None when it finished, or its
        # error
        self.where: list[int | BaseException | None] = [None] * len(regs)
        # at a WMMA: each work-item's fragments, then its result
        self.operands: list[tuple] = [()] * len(regs)
        self.results: list[Any] = [None] * len(regs)
        self.abort = False
        for r in regs: r[prog.group] = self

    def _take(self, k: int) -> None:
        self.go[k].acquire()
        if self.abort: raise _Abort
        for m in self.mems: m.item = k

    def _pass(self, k: int) -> None:
        (self.go[k + 1] if k + 1 < len(self.go) else self.back).release()

    def wait(self, k: int, barrier: int, operands: tuple = ()) -> Any:
        """Called by work-item k at BARRIER (or WMMA) uop `barrier`: pass the baton on, wait for the next phase; a
        WMMA's `operands` are the work-item's fragments, and its result is returned."""
        self.where[k], self.operands[k] = barrier, operands
        self._pass(k)
        self._take(k)
        return self.results[k]

    def _work(self, k: int) -> None:
        try:
            self._take(k)
            for s in self.prog.body: s(self.regs[k])
            self.where[k] = None
        except _Abort: return
        except BaseException as e:   # the launch fails: straight back to the launching thread, which raises it
            self.where[k] = e
            self.back.release()
            return
        self._pass(k)

    def run(self) -> None:
        threads = [threading.Thread(target=self._work, args=(k,), daemon=True) for k in range(len(self.regs))]
        for t in threads: t.start()
        try:
            while True:
                self.go[0].release()
                self.back.acquire()
                for e in self.where:
                    if isinstance(e, BaseException): raise e
                if all(w is None for w in self.where): return
                at = self._check_converged()
                if at in self.prog.wmmas: self._warp_mma(at)
                else:
                    for m in self.mems: m.new_phase()
        finally:
            # work-items still waiting (at a barrier, or to start) wake up and unwind
            self.abort = True
            for sem in self.go: sem.release()
            for t in threads: t.join()

    def _check_converged(self) -> int:
        """The barrier every work-item waits at: else some would wait forever on a GPU (or skip one)."""
        at = min(w for w in self.where if isinstance(w, int))
        waiting = [k for k, w in enumerate(self.where) if w == at]
        if len(waiting) == len(self.where): return at
        other = next(k for k, w in enumerate(self.where) if w != at)
        did = "finished" if self.where[other] is None else f"waits at the BARRIER uop {self.where[other]}"
        raise self.prog._err(at, f"divergent barrier: {len(waiting)} of {len(self.where)} work-items wait here "
                                 f"({self.who(waiting[0], False)} ...) while {self.who(other)} {did}")

    def _warp_mma(self, at: int) -> None:
        """The WMMA uop `at` of every warp of the group (see the module docstring)."""
        tc, n = self.prog.wmmas[at], len(self.regs)
        if n % tc.threads:
            raise self.prog._err(at, f"a WMMA needs whole warps of {tc.threads} work-items; the group has {n}")
        m, nn, kk = tc.dims
        rin = round_tf32 if tc.dtype_in == dtypes.float32 else (lambda v: v)
        rout = round_fn(tc.dtype_out)
        for w in range(0, n, tc.threads):
            a = [[0.0] * kk for _ in range(m)]
            b = [[0.0] * nn for _ in range(kk)]
            c = [[0.0] * nn for _ in range(m)]
            for lane in range(tc.threads):
                for mat, which, vals in zip((a, b, c), "ABC", self.operands[w + lane]):
                    for i, v in enumerate(vals):
                        row, col = tc.coords(which, lane, i)
                        mat[row][col] = rin(v) if which != "C" else v
            d = [[rout(math.fsum([a[i][x] * b[x][j] for x in range(kk)] + [c[i][j]])) for j in range(nn)]
                 for i in range(m)]
            for lane in range(tc.threads):
                self.results[w + lane] = tuple(d[r][col] for r, col in (tc.coords("C", lane, e)
                                                                        for e in range(tc.elements("C"))))

def round_tf32(v: float) -> float:
    """float32 `v` rounded to TF32 (10 bits of significand) to nearest, ties away from zero (PTX cvt.rna.tf32.f32)."""
    if not math.isfinite(v): return v
    u = _U32.unpack(_F32.pack(v))[0]
    return _F32.unpack(_U32.pack(((u + 0x1000) & 0xFFFFE000) & _M32))[0]

def _lanes(f: Callable[..., Any], is_vec: tuple[bool, ...], count: int) -> Callable[..., tuple]:
    """`f` applied lane by lane; scalar operands are broadcast."""
    if all(is_vec):
        if len(is_vec) == 1: return lambda a: tuple(map(f, a))
        if len(is_vec) == 2: return lambda a, b: tuple(map(f, a, b))
        return lambda a, b, c: tuple(map(f, a, b, c))
    return lambda *xs: tuple(map(f, *[x if v else repeat(x, count) for x, v in zip(xs, is_vec)]))

# *** the device ***

class PythonCompiler(Compiler):
    """Nothing to compile: the listing is the program. No cache (parsing is cheaper than reading a file)."""
    def __init__(self) -> None: super().__init__(None)
    def compile(self, src: str) -> bytes: return src.encode()

class PYTHONDevice(Compiled):
    """Kernels interpreted in Python on host memory."""
    def __init__(self, device: str = "PYTHON"):
        super().__init__(device, PythonAllocator(), None, PythonCompiler(), PythonProgram)

    @functools.cached_property
    def renderer(self) -> PythonRenderer:
        # made on first use: it reads the CPU's features, which allocating memory doesn't need
        return PythonRenderer()
