"""LLVM IR renderer: linearized UOps -> the text of an LLVM module with one kernel function, for the LLVM device.

It renders what `ClangRenderer` renders, with the same semantics (see cstyle.py): IEEE floats without fast-math flags
(no reassociation, no contraction: fused multiply-adds only where the program has MULACC), integer arithmetic that
wraps (no nsw/nuw), C division (truncating; x/0 gives 0, x/-1 is a wrapping negation), shifts by the width or more
give 0, float MAX propagates nan, half and bfloat16 arithmetic is done in float and rounded after every op.

The kernel ABI is the C one: `void name(ptr noalias <buffer>..., <var>..., i64 core_lo, i64 core_hi)`; an integer
var is passed as i64 and a float var as double, each narrowed inside to the var's dtype."""
from __future__ import annotations
import copy
import math
import re
import struct
from fusegrad import hostcpu
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.renderer import Renderer, transpose_network
from fusegrad.uop.ops import GroupOp, Ops, UOp

_LLVM_SCALAR = {dtypes.bool: "i1", dtypes.int8: "i8", dtypes.uint8: "i8", dtypes.int16: "i16", dtypes.uint16: "i16",
                dtypes.int32: "i32", dtypes.uint32: "i32", dtypes.int64: "i64", dtypes.uint64: "i64",
                dtypes.index: "i64", dtypes.float16: "half", dtypes.bfloat16: "i16", dtypes.float32: "float",
                dtypes.float64: "double"}
_LOWP = (dtypes.float16, dtypes.bfloat16)
_INTRINSIC = {Ops.SQRT: "sqrt", Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.TRUNC: "trunc",
              Ops.POW: "pow"}
_FCMP = {Ops.CMPLT: "olt", Ops.CMPNE: "une", Ops.CMPEQ: "oeq"}
_IDENT = re.compile(r"[A-Za-z_.][A-Za-z0-9_.$]*")
_THREEFRY_ROT = (13, 15, 26, 6, 17, 29, 16, 24)

def _isf(dt: DType) -> bool: return dtypes.is_float(dt)
def _signed(dt: DType) -> bool: return dtypes.is_int(dt) and not dtypes.is_unsigned(dt)

def _f32(v: float) -> float:
    """v rounded to float32 (overflow gives inf, as the C compiler's conversion of the literal does)."""
    try: return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError: return math.copysign(math.inf, v)

def _hex_double(v: float) -> str:
    # LLVM takes float and double constants as the hex bits of a double; nan is the quiet one C's nan() gives
    if math.isnan(v): return "0x7FF8000000000000"
    return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}"

def _f16_bits(v: float) -> int:
    if math.isnan(v): return 0x7E00
    try: return struct.unpack("<H", struct.pack("<e", v))[0]
    except OverflowError: return 0xFC00 if v < 0 else 0x7C00

class LLVMRenderer(Renderer):
    """LLVM IR for the host CPU, compiled in process by llvmlite (fusegrad/runtime/ops_llvm.py)."""
    device = "LLVM"
    has_threads = True
    supports_prefetch = True
    transposed_copy = True

    def __init__(self) -> None:
        # the host CPU's SIMD facts, as the C renderer has them, so the optimizer shapes the same kernels for both
        host = hostcpu.cpu()
        self.simd_bytes, self.vector_registers, self.has_fma = host.simd_bytes, host.vector_registers, host.has_fma
        self.vector_dtypes, self.full_rate_512 = host.vector_dtypes, host.full_rate_512

    # *** types and constants ***

    def ty(self, dt: DType) -> str:
        """The LLVM type of a register value of dtype `dt` (bool is i1, bfloat16 is its i16 bits)."""
        if isinstance(dt, PtrDType): return "ptr"
        if dt.scalar() not in _LLVM_SCALAR: raise NotImplementedError(f"no LLVM type for {dt}")
        sc = _LLVM_SCALAR[dt.scalar()]
        return sc if dt.count == 1 else f"<{dt.count} x {sc}>"

    def mty(self, dt: DType) -> str:
        """The LLVM type of `dt` in memory (bools are bytes)."""
        if dt.scalar() != dtypes.bool: return self.ty(dt)
        return "i8" if dt.count == 1 else f"<{dt.count} x i8>"

    def const(self, v, dt: DType) -> str:
        """A scalar literal of dtype `dt` (bfloat16: its bits, truncated from float32 as the C renderer does)."""
        if dt.count > 1: return self.splat(self.const(v, dt.scalar()), dt)
        if dt == dtypes.bool: return "true" if v else "false"
        if dt == dtypes.float16: return f"0xH{_f16_bits(_f32(float(v))):04X}"
        if dt == dtypes.bfloat16:
            f = _f32(float(v))
            bits = 0x7FC0 if math.isnan(f) else struct.unpack("<I", struct.pack("<f", f))[0] >> 16
            return str(bits - (1 << 16) if bits >= 1 << 15 else bits)
        if dt == dtypes.float32: return _hex_double(_f32(float(v)))
        if dt == dtypes.float64: return _hex_double(float(v))
        bits = 8 * dt.itemsize
        v = int(v) & ((1 << bits) - 1)
        return str(v - (1 << bits) if v >= 1 << (bits - 1) else v)   # LLVM integers are written signed

    def splat(self, lit: str, dt: DType) -> str:
        """`lit` (a scalar literal) in every lane of `dt`, or just `lit` when `dt` is a scalar."""
        return lit if dt.count == 1 else f"splat ({self.ty(dt.scalar())} {lit})"

    # *** instruction emission ***

    def _val(self, expr: str) -> str:
        self._n += 1
        name = f"%v{self._n}"
        self._lines.append(f"  {name} = {expr}")
        return name

    def _label(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def _start_block(self, label: str) -> None:
        self._lines.append(f"{label}:")
        self._block = label

    def _intrinsic(self, name: str, dt: DType, args: list[str]) -> str:
        t = self.ty(dt)
        suffix = {"float": "f32", "double": "f64", "half": "f16"}.get(self.ty(dt.scalar()), self.ty(dt.scalar()))
        full = f"llvm.{name}.{'v' + str(dt.count) if dt.count > 1 else ''}{suffix}"
        self._decls[full] = f"declare {t} @{full}({', '.join([t] * len(args))})"
        return self._val(f"call {t} @{full}({', '.join(f'{t} {a}' for a in args)})")

    # *** half and bfloat16 ***

    def to_f32(self, x: str, dt: DType) -> str:
        """A float32 value (vector) of the half/bfloat16 value `x` (exact)."""
        f = dtypes.float32.vec(dt.count)
        if dt.scalar() == dtypes.float16: return self._val(f"fpext {self.ty(dt)} {x} to {self.ty(f)}")
        u = dtypes.uint32.vec(dt.count)
        w = self._val(f"zext {self.ty(dt)} {x} to {self.ty(u)}")
        sh = self._val(f"shl {self.ty(u)} {w}, {self.splat('16', u)}")
        return self._val(f"bitcast {self.ty(u)} {sh} to {self.ty(f)}")

    def from_f32(self, x: str, dt: DType) -> str:
        """The float32 value (vector) `x` rounded to nearest even to the half/bfloat16 dtype `dt`."""
        f = dtypes.float32.vec(dt.count)
        if dt.scalar() == dtypes.float16: return self._val(f"fptrunc {self.ty(f)} {x} to {self.ty(dt)}")
        u = dtypes.uint32.vec(dt.count)
        ut, c = self.ty(u), lambda n: self.splat(str(n), u)
        b = self._val(f"bitcast {self.ty(f)} {x} to {ut}")
        hi = self._val(f"lshr {ut} {b}, {c(16)}")
        mag = self._val(f"and {ut} {b}, {c(0x7FFFFFFF)}")
        isnan = self._val(f"icmp ugt {ut} {mag}, {c(0x7F800000)}")
        quiet = self._val(f"or {ut} {hi}, {c(0x40)}")   # nan stays nan (quieted), sign kept
        odd = self._val(f"and {ut} {hi}, {c(1)}")
        r1 = self._val(f"add {ut} {b}, {c(0x7FFF)}")
        r2 = self._val(f"add {ut} {r1}, {odd}")
        r3 = self._val(f"lshr {ut} {r2}, {c(16)}")
        sel = self._val(f"select {self.ty(dtypes.bool.vec(dt.count))} {isnan}, {ut} {quiet}, {ut} {r3}")
        return self._val(f"trunc {ut} {sel} to {self.ty(dt)}")

    # *** conversions ***

    def cast(self, x: str, src: DType, dst: DType) -> str:
        """`x` converted as C converts a `src` value to `dst` (lane by lane for vectors)."""
        if src == dst: return x
        n = dst.count
        if src.scalar() == dtypes.bfloat16: x, src = self.to_f32(x, src), dtypes.float32.vec(n)
        if src == dst: return x
        s, d, st, dt_ = src.scalar(), dst.scalar(), self.ty(src), self.ty(dst)
        if d == dtypes.bool:
            if _isf(s): return self._val(f"fcmp une {st} {x}, {self.splat('0.0', src)}")
            return self._val(f"icmp ne {st} {x}, {self.splat('0' if s != dtypes.bool else 'false', src)}")
        if d == dtypes.bfloat16:   # through float32, as the C renderer does
            return self.from_f32(self.cast(x, src, dtypes.float32.vec(n)), dst)
        if d == dtypes.float16 and not _isf(s):   # integers go through float (exact wherever they fit in half)
            x, src, s, st = self.cast(x, src, dtypes.float32.vec(n)), dtypes.float32.vec(n), dtypes.float32, \
                self.ty(dtypes.float32.vec(n))
        if s == dtypes.float16 and not _isf(d):   # half to an integer: through float (exact)
            x, src, s, st = self.to_f32(x, src), dtypes.float32.vec(n), dtypes.float32, self.ty(dtypes.float32.vec(n))
        if _isf(s) and _isf(d):
            if s.itemsize == d.itemsize: return x
            return self._val(f"{'fpext' if d.itemsize > s.itemsize else 'fptrunc'} {st} {x} to {dt_}")
        if _isf(s):
            # out of range (inf, nan, too big) C leaves undefined and LLVM makes poison; frozen, the result is what
            # the CPU's conversion instruction gives, as in the C path, and no later fold may assume it in range
            r = self._val(f"{'fptoui' if dtypes.is_unsigned(d) else 'fptosi'} {st} {x} to {dt_}")
            return self._val(f"freeze {dt_} {r}")
        if _isf(d): return self._val(f"{'sitofp' if _signed(s) else 'uitofp'} {st} {x} to {dt_}")
        sb, db = (1 if s == dtypes.bool else 8 * s.itemsize), 8 * d.itemsize
        if sb == db: return x
        if sb > db: return self._val(f"trunc {st} {x} to {dt_}")
        return self._val(f"{'sext' if _signed(s) else 'zext'} {st} {x} to {dt_}")

    def bitcast(self, x: str, src: DType, dst: DType) -> str:
        if src.scalar() == dtypes.bool or dst.scalar() == dtypes.bool: return self.cast(x, src, dst)
        if self.ty(src) == self.ty(dst): return x
        return self._val(f"bitcast {self.ty(src)} {x} to {self.ty(dst)}")

    # *** ALU ***

    def alu(self, op: Ops, dt: DType, srcs: list[str], src_dts: list[DType]) -> str:
        """`op` on scalars or vectors with C semantics; half/bfloat16 are computed in float and rounded back."""
        odt = src_dts[-1] if op in GroupOp.Comparison else dt   # the dtype the operation is carried out in
        if odt.scalar() in _LOWP and op is not Ops.WHERE:
            fs = [self.to_f32(s, d) if d.scalar() in _LOWP else s for s, d in zip(srcs, src_dts)]
            f32 = [dtypes.float32.vec(d.count) if d.scalar() in _LOWP else d for d in src_dts]
            if op in GroupOp.Comparison: return self._alu(op, dt, fs, f32)
            return self.from_f32(self._alu(op, dtypes.float32.vec(dt.count), fs, f32), dt)
        return self._alu(op, dt, srcs, src_dts)

    def _alu(self, op: Ops, dt: DType, s: list[str], src_dts: list[DType]) -> str:
        odt = src_dts[-1] if op in GroupOp.Comparison else dt
        t, sc = self.ty(odt), odt.scalar()
        isf, isb = _isf(sc), sc == dtypes.bool
        zero, one = self.const(0, odt), self.const(1, odt)
        if op is Ops.WHERE:
            return self._val(f"select {self.ty(src_dts[0])} {s[0]}, {t} {s[1]}, {t} {s[2]}")
        if op in GroupOp.Comparison:
            if isf: return self._val(f"fcmp {_FCMP[op]} {t} {s[0]}, {s[1]}")
            pred = {Ops.CMPNE: "ne", Ops.CMPEQ: "eq"}.get(op, "slt" if _signed(sc) else "ult")
            return self._val(f"icmp {pred} {t} {s[0]}, {s[1]}")
        if op in (Ops.ADD, Ops.SUB, Ops.MUL):
            if isf: return self._val(f"f{op.name.lower()} {t} {s[0]}, {s[1]}")
            # C computes bools as ints and converts the result back: + is or, * is and, - is xor
            name = {Ops.ADD: "or", Ops.SUB: "xor", Ops.MUL: "and"}[op] if isb else op.name.lower()
            return self._val(f"{name} {t} {s[0]}, {s[1]}")
        if op in (Ops.AND, Ops.OR, Ops.XOR):
            if isf: raise NotImplementedError(f"no bitwise {op} on {dt}")
            return self._val(f"{op.name.lower()} {t} {s[0]}, {s[1]}")
        if op is Ops.NEG:
            if isf: return self._val(f"fneg {t} {s[0]}")
            return self._val(f"xor {t} {s[0]}, {self.const(True, odt)}" if isb else f"sub {t} {zero}, {s[0]}")
        if op is Ops.NOT:
            z = self._alu(Ops.CMPEQ, dt if dt.scalar() == dtypes.bool else dtypes.bool.vec(dt.count), [s[0], zero],
                          [odt, odt])
            return self.cast(z, dtypes.bool.vec(dt.count), dt)
        if op is Ops.RECIP:
            if isf: return self._val(f"fdiv {t} {one}, {s[0]}")
            return self._int_div(Ops.IDIV, odt, [one, s[0]])
        if op in _INTRINSIC:
            if isf: return self._intrinsic(_INTRINSIC[op], odt, s)
            if op is Ops.TRUNC: return s[0]
            # integers: computed in double and converted back, as C's (T)sqrt((double)x)
            f64 = dtypes.float64.vec(dt.count)
            r = self._intrinsic(_INTRINSIC[op], f64, [self.cast(x, d, f64) for x, d in zip(s, src_dts)])
            return self.cast(r, f64, odt)
        if op is Ops.MULACC:
            if isf: return self._intrinsic("fma", odt, s)
            return self._alu(Ops.ADD, dt, [self._alu(Ops.MUL, dt, s[:2], src_dts[:2]), s[2]], src_dts[1:])
        if op is Ops.FDIV and isf: return self._val(f"fdiv {t} {s[0]}, {s[1]}")
        if op is Ops.IDIV and isf:
            return self._intrinsic("trunc", odt, [self._val(f"fdiv {t} {s[0]}, {s[1]}")])
        if op is Ops.MOD and isf: return self._val(f"frem {t} {s[0]}, {s[1]}")
        if op in (Ops.IDIV, Ops.FDIV, Ops.MOD): return self._int_div(op, odt, s)
        if op is Ops.MAX:
            bt = self.ty(dtypes.bool.vec(dt.count))
            if isf:   # a nan on either side wins, as in torch.maximum: (a > b || a != a) ? a : b
                gt = self._val(f"fcmp ogt {t} {s[0]}, {s[1]}")
                nan = self._val(f"fcmp uno {t} {s[0]}, {s[0]}")
                c = self._val(f"or {bt} {gt}, {nan}")
            else: c = self._val(f"icmp {'sgt' if _signed(sc) else 'ugt'} {t} {s[0]}, {s[1]}")
            return self._val(f"select {bt} {c}, {t} {s[0]}, {t} {s[1]}")
        if op in (Ops.SHL, Ops.SHR): return self._shift(op, odt, s[0], s[1], src_dts[1])
        if op is Ops.THREEFRY:
            if sc != dtypes.uint64: raise NotImplementedError(f"THREEFRY on {dt}")
            return self._val(f"call {t} @{self._threefry(odt)}({t} {s[0]}, {t} {s[1]})")
        raise NotImplementedError(f"no LLVM IR for {op} on {dt}")

    def _int_div(self, op: Ops, dt: DType, s: list[str]) -> str:
        t, bt = self.ty(dt), self.ty(dtypes.bool.vec(dt.count))
        signed = _signed(dt.scalar())
        zero, one = self.const(0, dt), self.const(1, dt)
        # the divisor is made 1 where C's helper doesn't divide (0, and -1 which traps on INT_MIN / -1)
        bad = isz = self._val(f"icmp eq {t} {s[1]}, {zero}")
        if signed:
            ism1 = self._val(f"icmp eq {t} {s[1]}, {self.const(-1, dt)}")
            bad = self._val(f"or {bt} {isz}, {ism1}")
        d = self._val(f"select {bt} {bad}, {t} {one}, {t} {s[1]}")
        kind = ("s" if signed else "u") + ("rem" if op is Ops.MOD else "div")
        r = self._val(f"{kind} {t} {s[0]}, {d}")
        if op is Ops.MOD: return self._val(f"select {bt} {bad}, {t} {zero}, {t} {r}")
        if signed:
            neg = self._val(f"sub {t} {zero}, {s[0]}")
            r = self._val(f"select {bt} {ism1}, {t} {neg}, {t} {r}")
        return self._val(f"select {bt} {isz}, {t} {zero}, {t} {r}")

    def _shift(self, op: Ops, dt: DType, x: str, n: str, ndt: DType) -> str:
        t, bt, bits = self.ty(dt), self.ty(dtypes.bool.vec(dt.count)), 8 * dt.scalar().itemsize
        # the count compared as C's (unsigned long)n < bits: a negative count is huge, so it gives 0 too
        wide = dtypes.uint64.vec(dt.count)
        nw = self.cast(n, ndt, dtypes.int64.vec(dt.count) if _signed(ndt.scalar()) else wide)
        ok = self._val(f"icmp ult {self.ty(wide)} {nw}, {self.splat(str(bits), wide)}")
        cnt = n if self.ty(ndt) == t else self.cast(nw, wide, dt)
        kind = "shl" if op is Ops.SHL else "ashr" if _signed(dt.scalar()) else "lshr"
        r = self._val(f"{kind} {t} {x}, {cnt}")
        return self._val(f"select {bt} {ok}, {t} {r}, {t} {self.const(0, dt)}")

    def _threefry(self, dt: DType) -> str:
        """An always-inlined function: Threefry-2x32 with 20 rounds of x under key (each two 32-bit words)."""
        name = f"fg_threefry_{dt.count}"
        if name in self._helpers: return name
        t, n = self.ty(dt), dt.count
        w = self.ty(dtypes.uint32.vec(n))
        c = lambda v, d=dtypes.uint32: self.splat(str(v - (1 << 32) if d == dtypes.uint32 and v >= 1 << 31 else v),
                                                 d.vec(n))
        body: list[str] = []
        cnt = [0]
        def v(expr: str) -> str:
            cnt[0] += 1
            body.append(f"  %t{cnt[0]} = {expr}")
            return f"%t{cnt[0]}"
        c64 = c(32, dtypes.uint64)
        k0 = v(f"trunc {t} %key to {w}")
        khi = v(f"lshr {t} %key, {c64}")
        k1 = v(f"trunc {t} {khi} to {w}")
        k01 = v(f"xor {w} {k0}, {k1}")
        k = [k0, k1, v(f"xor {w} {k01}, {c(0x1BD11BDA)}")]
        xlo = v(f"trunc {t} %x to {w}")
        xsh = v(f"lshr {t} %x, {c64}")
        xhi = v(f"trunc {t} {xsh} to {w}")
        x0, x1 = v(f"add {w} {xlo}, {k[0]}"), v(f"add {w} {xhi}, {k[1]}")
        for r in range(20):
            rot = _THREEFRY_ROT[r % 8]
            x0 = v(f"add {w} {x0}, {x1}")
            left, right = v(f"shl {w} {x1}, {c(rot)}"), v(f"lshr {w} {x1}, {c(32 - rot)}")
            x1 = v(f"xor {w} {v(f'or {w} {left}, {right}')}, {x0}")
            if r % 4 == 3:
                i = r // 4 + 1
                x0 = v(f"add {w} {x0}, {k[i % 3]}")
                x1k = v(f"add {w} {x1}, {k[(i + 1) % 3]}")
                x1 = v(f"add {w} {x1k}, {c(i)}")
        w1, w0 = v(f"zext {w} {x1} to {t}"), v(f"zext {w} {x0} to {t}")
        hi = v(f"shl {t} {w1}, {c64}")
        ret = v(f"or {t} {hi}, {w0}")
        self._helpers[name] = f"define internal {t} @{name}({t} %x, {t} %key) alwaysinline {{\n" + \
            "\n".join(body) + f"\n  ret {t} {ret}\n}}"
        return name

    # *** memory ***

    def _addr(self, buf: str, elem: DType, idx: str, idx_dt: DType) -> str:
        i = self.cast(idx, idx_dt, dtypes.int64) if self.ty(idx_dt) != "i64" else idx
        return self._val(f"getelementptr inbounds {self.mty(elem)}, ptr {buf}, i64 {i}")

    def _prefetch(self, idx: UOp, v: dict[UOp, str]) -> None:
        # (a getelementptr without inbounds: the address may lie past the buffer's end; read, keep in every cache)
        elem, off, off_dt = idx.src[0].dtype.base.scalar(), v[idx.src[1]], idx.src[1].dtype
        if self.ty(off_dt) != "i64": off = self.cast(off, off_dt, dtypes.int64)
        ptr = self._val(f"getelementptr {self.mty(elem)}, ptr {v[idx.src[0]]}, i64 {off}")
        self._decls["llvm.prefetch"] = "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)"
        self._lines.append(f"  call void @llvm.prefetch.p0(ptr {ptr}, i32 0, i32 3, i32 1)")

    def _transposed_copy(self, u: UOp, v: dict[UOp, str]) -> None:
        """The w x w block at the source (rows src_step apart) stored transposed at the destination (rows dst_step
        apart): its rows loaded as vectors, log2(w) steps of shufflevector (the C renderer's `transpose_network`),
        the columns stored."""
        (dst, src), (w, dst_step, src_step) = u.src, u.arg
        elem = dst.src[0].dtype.base
        vt, et = self.mty(elem.vec(w)), self.mty(elem)
        def row(ptr: str, i: int, step: int) -> str:
            return ptr if i == 0 else self._val(f"getelementptr inbounds {et}, ptr {ptr}, i64 {i * step}")
        rows = [self._load(row(v[src], i, src_step), elem.vec(w)) for i in range(w)]
        for step in transpose_network(w):
            made = list(rows)
            for r, x, y, lanes in step:
                mask = ", ".join(f"i32 {k}" for k in lanes)
                made[r] = self._val(f"shufflevector {vt} {rows[x]}, {vt} {rows[y]}, <{w} x i32> <{mask}>")
            rows = made
        for j, col in enumerate(rows): self._store(row(v[dst], j, dst_step), col, elem.vec(w))

    def _load(self, ptr: str, dt: DType) -> str:
        v = self._val(f"load {self.mty(dt)}, ptr {ptr}, align {dt.scalar().itemsize}")
        if dt.scalar() != dtypes.bool: return v
        return self._val(f"icmp ne {self.mty(dt)} {v}, {self.splat('0', dtypes.uint8.vec(dt.count))}")

    def _store(self, ptr: str, val: str, dt: DType) -> None:
        if dt.scalar() == dtypes.bool: val = self._val(f"zext {self.ty(dt)} {val} to {self.mty(dt)}")
        self._lines.append(f"  store {self.mty(dt)} {val}, ptr {ptr}, align {dt.scalar().itemsize}")

    def _guarded(self, cond: str, fn, dt: DType | None) -> str | None:
        """Runs `fn` (which emits code and returns a value of `dt`, or None) only when `cond` holds; the value is 0
        where it doesn't (memory is only touched when the gate is open)."""
        then, join, before = self._label("gate"), self._label("join"), self._block
        self._lines.append(f"  br i1 {cond}, label %{then}, label %{join}")
        self._start_block(then)
        v = fn()
        end = self._block
        self._lines.append(f"  br label %{join}")
        self._start_block(join)
        if dt is None: return None
        return self._val(f"phi {self.ty(dt)} [ {v}, %{end} ], [ {self.const(0, dt)}, %{before} ]")

    # *** the kernel ***

    def render(self, uops: list[UOp], name: str) -> str:
        """The LLVM module (text) of a kernel `name` made of the linearized `uops`."""
        # per-kernel state (names, blocks, declarations) lives on a copy, so one renderer can render in several threads
        return copy.copy(self)._render(uops, name)

    def _render(self, uops: list[UOp], name: str) -> str:
        self._n, self._lines, self._decls, self._helpers, self._block = 0, [], {}, {}, "entry"
        v: dict[UOp, str] = {}
        params: list[tuple[int, str]] = []
        var_params: list[tuple[str, str]] = []
        entry: list[str] = []          # allocas (accumulators, local buffers) and the narrowing of vars
        loops: list[tuple[UOp, str, str, str, str]] = []   # open loops: (range, counter, header, latch, exit)
        for u in uops:
            op, src = u.op, u.src
            if op is Ops.DEFINE_GLOBAL:
                v[u] = f"%data{u.arg}"
                params.append((u.arg, f"ptr noalias {v[u]}"))
            elif op is Ops.DEFINE_VAR:
                param, v[u] = self._define_var(u, entry)
                var_params.append((u.arg[0], param))
            elif op in (Ops.NOOP, Ops.SINK): continue
            elif op in (Ops.BIND, Ops.BARRIER): v[u] = v[src[0]]
            elif op is Ops.DEFINE_REG:
                v[u] = f"%acc{u.arg}"
                entry.append(f"  {v[u]} = alloca {self.ty(u.dtype.base if isinstance(u.dtype, PtrDType) else u.dtype)}")
            elif op is Ops.DEFINE_LOCAL:
                v[u] = f"%local{u.arg}"
                entry.append(f"  {v[u]} = alloca [{u.dtype.size} x {self.mty(u.dtype.base)}], align 64")
            elif op is Ops.CONST: v[u] = self.const(u.arg, u.dtype)
            elif op is Ops.RANGE: v[u] = self._open_loop(u, v, loops)
            elif op is Ops.END: self._close_loop(u, loops)
            elif op is Ops.INDEX:
                elem = src[0].dtype.base if isinstance(src[0].dtype, PtrDType) else src[0].dtype
                v[u] = self._addr(v[src[0]], elem.scalar(), v[src[1]], src[1].dtype)
            elif op is Ops.LOAD:
                if src[0].op is Ops.DEFINE_REG: v[u] = self._val(f"load {self.ty(u.dtype)}, ptr {v[src[0]]}")
                elif len(src) > 1: v[u] = self._lane_gated_load(u, v)
                elif len(src[0].src) > 2:
                    v[u] = self._guarded(v[src[0].src[2]], lambda p=v[src[0]], d=u.dtype: self._load(p, d), u.dtype)
                else: v[u] = self._load(v[src[0]], u.dtype)
            elif op is Ops.STORE:
                if src[0].op is Ops.DEFINE_REG:
                    self._lines.append(f"  store {self.ty(src[1].dtype)} {v[src[1]]}, ptr {v[src[0]]}")
                elif len(src[0].src) > 2:
                    self._guarded(v[src[0].src[2]], lambda p=v[src[0]], x=v[src[1]], d=src[1].dtype:
                                  self._store(p, x, d), None)
                else: self._store(v[src[0]], v[src[1]], src[1].dtype)
            elif op is Ops.PREFETCH: self._prefetch(src[0], v)
            elif op is Ops.TRANSPOSED_COPY: self._transposed_copy(u, v)
            elif op is Ops.VECTORIZE: v[u] = self._vectorize(u, v)
            elif op is Ops.GEP:
                g = u.arg[0] if isinstance(u.arg, tuple) else u.arg
                v[u] = self._val(f"extractelement {self.ty(src[0].dtype)} {v[src[0]]}, i64 {g}")
            elif op is Ops.CAST: v[u] = self.cast(v[src[0]], src[0].dtype, u.dtype)
            elif op is Ops.BITCAST: v[u] = self.bitcast(v[src[0]], src[0].dtype, u.dtype)
            elif op in GroupOp.ALU: v[u] = self.alu(op, u.dtype, [v[s] for s in src], [s.dtype for s in src])
            else: raise NotImplementedError(f"can't render {op} to LLVM IR")
        if loops: raise RuntimeError(f"range {loops[-1][0].arg} is never closed")
        return self._module(name, [p for _, p in sorted(params)] + [p for _, p in sorted(var_params)], entry)

    def _module(self, name: str, params: list[str], entry: list[str]) -> str:
        """The module: declarations, helpers, and the kernel function with `entry` (its allocas) before the body."""
        fname = name if _IDENT.fullmatch(name) else '"' + name.replace('"', "").replace("\\", "") + '"'
        args = params + ["i64 %core_lo", "i64 %core_hi"]
        head = [f"define void @{fname}({', '.join(args)}) nounwind {{", "entry:"] + entry
        return "\n".join(list(self._decls.values()) + list(self._helpers.values()) + head + self._lines +
                         ["  ret void", "}"]) + "\n"

    def _define_var(self, u: UOp, entry: list[str]) -> tuple[str, str]:
        """A Variable's parameter (double for floats, i64 for integers) and its value narrowed to its dtype, computed
        in the entry block."""
        if u.dtype.count != 1: raise NotImplementedError(f"vector variable {u}")
        wide = dtypes.float64 if dtypes.is_float(u.dtype) else dtypes.int64
        raw = f'%"var.{u.arg[0]}"'
        saved, self._lines = self._lines, entry
        if u.dtype == dtypes.bool: val = self._val(f"icmp ne i64 {raw}, 0")
        elif u.dtype == dtypes.bfloat16: val = self.from_f32(self.cast(raw, wide, dtypes.float32), u.dtype)
        else: val = self.cast(raw, wide, u.dtype) if self.ty(u.dtype) != self.ty(wide) else raw
        self._lines = saved
        return f"{self.ty(wide)} {raw}", val

    def _open_loop(self, u: UOp, v: dict[UOp, str], loops: list[tuple[UOp, str, str, str, str]]) -> str:
        """Start loop `u` (header, body; the latch and exit come with its END); its counter in u's dtype."""
        head, body, latch, exit_ = (self._label(s) for s in ("loop", "body", "latch", "exit"))
        if u.arg[1] == "global": lo, hi = "%core_lo", "%core_hi"
        else: lo, hi = "0", self.cast(v[u.src[0]], u.src[0].dtype, dtypes.int64)
        before = self._block
        self._lines.append(f"  br label %{head}")
        self._start_block(head)
        self._n += 1
        ctr = f"%i{self._n}"
        self._lines.append(f"  {ctr} = phi i64 [ {lo}, %{before} ], [ {ctr}.next, %{latch} ]")
        cond = self._val(f"icmp slt i64 {ctr}, {hi}")
        self._lines.append(f"  br i1 {cond}, label %{body}, label %{exit_}")
        self._start_block(body)
        loops.append((u, ctr, head, latch, exit_))
        return self.cast(ctr, dtypes.int64, u.dtype)

    def _close_loop(self, u: UOp, loops: list[tuple[UOp, str, str, str, str]]) -> None:
        """End the innermost open loop: its latch increments the counter and branches back to the header."""
        if not loops: raise RuntimeError("END without an open loop")
        r, ctr, head, latch, exit_ = loops.pop()
        if u.src and u.src[0].op is Ops.RANGE and u.src[0] is not r:
            raise RuntimeError(f"END of range {u.src[0].arg} closes range {r.arg}")
        self._lines.append(f"  br label %{latch}")
        self._start_block(latch)
        self._lines += [f"  {ctr}.next = add i64 {ctr}, 1", f"  br label %{head}"]
        self._start_block(exit_)

    def _vectorize(self, u: UOp, v: dict[UOp, str]) -> str:
        """A vector of u's sources: a broadcast as a shuffle of one lane, else lane by lane insertions."""
        t, st = self.ty(u.dtype), self.ty(u.dtype.scalar())
        if all(s is u.src[0] for s in u.src):
            one = self._val(f"insertelement <1 x {st}> poison, {st} {v[u.src[0]]}, i64 0")
            return self._val(f"shufflevector <1 x {st}> {one}, <1 x {st}> poison, <{len(u.src)} x i32> "
                             "zeroinitializer")
        acc = "poison"
        for k, s in enumerate(u.src): acc = self._val(f"insertelement {t} {acc}, {st} {v[s]}, i64 {k}")
        return acc

    def _lane_gated_load(self, u: UOp, v: dict[UOp, str]) -> str:
        """LOAD(INDEX(vector pointer), all_valid, *lane_valid): one vector load when every lane is valid, else one
        gated scalar load per lane (a padded edge)."""
        idx, src = u.src[0], u.src
        if len(idx.src) > 2: raise NotImplementedError("a lane-gated load behind an index gate")
        full, part, join = self._label("all"), self._label("lanes"), self._label("done")
        self._lines.append(f"  br i1 {v[src[1]]}, label %{full}, label %{part}")
        self._start_block(full)
        a, a_end = self._load(v[idx], u.dtype), self._block
        self._lines.append(f"  br label %{join}")
        self._start_block(part)
        sc, b = u.dtype.scalar(), "zeroinitializer"
        for k, m in enumerate(src[2:]):
            lane_ptr = self._val(f"getelementptr inbounds {self.mty(sc)}, ptr {v[idx]}, i64 {k}")
            x = self._guarded(v[m], lambda p=lane_ptr: self._load(p, sc), sc)
            b = self._val(f"insertelement {self.ty(u.dtype)} {b}, {self.ty(sc)} {x}, i64 {k}")
        b_end = self._block
        self._lines.append(f"  br label %{join}")
        self._start_block(join)
        return self._val(f"phi {self.ty(u.dtype)} [ {a}, %{a_end} ], [ {b}, %{b_end} ]")
