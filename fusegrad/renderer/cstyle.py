"""C-style renderers: linearized UOps -> C source. `CStyleLanguage` holds what C dialects share (expressions, loops,
literals); `ClangRenderer` is plain C for the CPU, compiled by gcc/clang into a shared object.

Semantics follow C/IEEE without fast-math: nan and inf propagate, float MAX propagates nan (as torch.max does),
integer division truncates toward zero and gives 0 for a zero divisor (and never traps on INT_MIN / -1), shifts by
the width or more give 0, half and bfloat16 arithmetic is done in float and rounded (to nearest even) after every op."""
from __future__ import annotations
import copy
import hashlib
import itertools
import math
import operator
import platform
import struct
from typing import Any, Callable, Iterator
from fusegrad import hostcpu
from fusegrad.renderer.cpu_dot import AMX_TILE, DOT_LANES, AmxPlan, Bf16Pair, bf16_pairs, whole_matmul_plan
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.renderer import Renderer, transpose_network
from fusegrad.uop.affine import base_and_offset, coeff
from fusegrad.uop.ops import GroupOp, Ops, UOp

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _AND, _FDIV, _GEP, _IDIV, _MAX, _MOD = Ops.ADD, Ops.AND, Ops.FDIV, Ops.GEP, Ops.IDIV, Ops.MAX, Ops.MOD
_MUL, _MULACC, _NEG, _NOOP, _NOT, _OR, _POW = Ops.MUL, Ops.MULACC, Ops.NEG, Ops.NOOP, Ops.NOT, Ops.OR, Ops.POW
_RECIP, _SHL, _SHR, _SQRT, _SUB, _THREEFRY = Ops.RECIP, Ops.SHL, Ops.SHR, Ops.SQRT, Ops.SUB, Ops.THREEFRY
_BITCAST, _CAST, _TRUNC = Ops.BITCAST, Ops.CAST, Ops.TRUNC
_VECTORIZE, _WHERE, _XOR = Ops.VECTORIZE, Ops.WHERE, Ops.XOR

_SHORT = {dtypes.bool: "bool", dtypes.int8: "i8", dtypes.uint8: "u8", dtypes.int16: "i16", dtypes.uint16: "u16",
          dtypes.int32: "i32", dtypes.uint32: "u32", dtypes.int64: "i64", dtypes.uint64: "u64", dtypes.float16: "f16",
          dtypes.bfloat16: "bf16", dtypes.float32: "f32", dtypes.float64: "f64", dtypes.index: "i64"}
_UNSIGNED_OF = {dtypes.int8: "unsigned char", dtypes.int16: "unsigned short", dtypes.int32: "unsigned int",
                dtypes.int64: "unsigned long", dtypes.index: "unsigned long"}
# the unsigned dtype of each integer dtype's width (vector shifts compare and shift their counts unsigned)
_UNSIGNED_DT = {dtypes.int8: dtypes.uint8, dtypes.int16: dtypes.uint16, dtypes.int32: dtypes.uint32,
                dtypes.int64: dtypes.uint64, dtypes.uint8: dtypes.uint8, dtypes.uint16: dtypes.uint16,
                dtypes.uint32: dtypes.uint32, dtypes.uint64: dtypes.uint64}
_MASK_INT = {1: dtypes.int8, 2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}   # lanes of bool vectors (masks)
_SMALL = (dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16)   # promoted to int by C arithmetic
_LOWP = (dtypes.float16, dtypes.bfloat16)                                        # computed in float
_UNARY_FN = {Ops.SQRT: "sqrt", Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.TRUNC: "trunc"}
_INFIX = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.CMPLT: "<", Ops.CMPNE: "!=", Ops.CMPEQ: "==", Ops.AND: "&",
          Ops.OR: "|", Ops.XOR: "^"}

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the passes over every uop
# of a kernel compare against module-level names)
_STORE, _INDEX, _LOAD, _DEFINE_REG, _SPECIAL, _DEFINE_GLOBAL, _END, _RANGE = Ops.STORE, Ops.INDEX, Ops.LOAD, \
    Ops.DEFINE_REG, Ops.SPECIAL, Ops.DEFINE_GLOBAL, Ops.END, Ops.RANGE
_MASK_USERS = GroupOp.ALU | {Ops.CAST, Ops.VECTORIZE, Ops.GEP}   # ops that may make or read a bool vector
STREAM_BYTES = 16 << 20   # outputs at least this big are written past the caches (ClangRenderer._streamed_buffers)

def _short_hash(text: str) -> str: return hashlib.sha256(text.encode()).hexdigest()[:8]

class CStyleLanguage(Renderer):
    """What C-like languages share. Subclasses set the type names, the kernel signature and the vector syntax."""
    kernel_prefix: str = "void"
    buffer_suffix: str = " restrict"
    entry_point: bool = False  # also render `void <name>_entry(void **args, long core_lo, long core_hi)`
    type_map: dict[DType, str] = {dtypes.bool: "_Bool", dtypes.int8: "signed char", dtypes.uint8: "unsigned char",
                                  dtypes.int16: "short", dtypes.uint16: "unsigned short", dtypes.int32: "int",
                                  dtypes.uint32: "unsigned int", dtypes.int64: "long", dtypes.uint64: "unsigned long",
                                  dtypes.float16: "half", dtypes.bfloat16: "bf16", dtypes.float32: "float",
                                  dtypes.float64: "double", dtypes.index: "long"}
    vector_dtypes: tuple[DType, ...] = ()
    bf16_dot: bool = False        # whether pairs of bfloat16 multiply-adds are one dot product (`_bf16_dot`)
    amx: bool = False             # whether a kernel that is only a bfloat16 matmul runs on AMX tiles (`_render_amx`)
    stream_stores: bool = False   # whether big outputs are written past the caches (`_streamed_buffers`)
    strided_lanes: bool = False   # whether `_scatter`, `_gather` may have helpers (single-lane accesses are looked at)

    # *** dialect points of GPU-style kernels (a kernel with SPECIAL ids: a grid of work-groups, see
    # docs/architecture.md). A dialect sets these spellings; the C renderer never sees such a kernel ***
    global_space: str = ""    # written before the type of a buffer parameter (OpenCL: "__global ")
    local_space: str = ""     # written before a DEFINE_LOCAL array shared by a group (OpenCL: "__local ")
    barrier: str = ""         # the statement of a BARRIER (OpenCL: "barrier(CLK_LOCAL_MEM_FENCE);")

    def id_expr(self, kind: str, dim: int) -> str:
        """The expression of a work-item's id along launch dimension `dim`: its group's (`kind` "group") or its own
        within the group (`kind` "local")."""
        raise NotImplementedError(f"{type(self).__name__} has no work-group ids ({kind} id {dim})")

    # *** dialect points of vectors (the C renderer's: GCC vector extensions). Vector values are built, read lane by
    # lane, loaded, stored, converted and reinterpreted only through these, so a dialect with its own vector types
    # (OpenCL's float4, CUDA's float4 structs) overrides them ***

    def vector_type(self, dt: DType) -> str:
        """The name of the vector type `dt` (declaring it if it needs a typedef)."""
        name = f"{_SHORT[dt.scalar()]}x{dt.count}"
        sc = self.dtype_name(dt.scalar())
        # aligned to the element so a vector can be loaded from any element address
        return self._need(name, f"typedef {sc} {name} __attribute__((vector_size({dt.itemsize}), "
                                f"aligned({dt.scalar().itemsize})));")

    def vector_literal(self, dt: DType, lanes: list[str]) -> str:
        """A `dt` vector of the lanes' expressions."""
        return f"(({self.dtype_name(dt)}){{{', '.join(lanes)}}})"

    def vector_zero(self, dt: DType) -> str:
        """A `dt` vector of zeros."""
        return f"(({self.dtype_name(dt)}){{0}})"

    def vector_splat(self, dt: DType, x: str) -> str:
        """A `dt` vector whose lanes are all the scalar `x`."""
        return f"{self._broadcast(dt)}({x})"

    def lane(self, x: str, i: int | str) -> str:
        """Lane `i` of vector `x` (`i` is a number, or in a lane loop the name of its counter)."""
        return f"{x}[{i}]"

    def vector_load(self, ptr: str, dt: DType) -> str:
        """The `dt` vector of the elements from address `ptr` on (aligned to the element only)."""
        return f"(*(({self.dtype_name(dt)}*)({ptr})))"

    def vector_store(self, ptr: str, val: str, dt: DType) -> str:
        """The statement storing the `dt` vector `val` at address `ptr` (aligned to the element only)."""
        return f"{self.vector_load(ptr, dt)} = {val};"

    def convert_vector(self, x: str, dst: DType) -> str:
        """Vector `x` with each lane converted (as a C cast converts) to the lanes of `dst`."""
        return f"__builtin_convertvector({x}, {self.dtype_name(dst)})"

    def reinterpret_vector(self, x: str, dst: DType) -> str:
        """The bits of vector `x` as a `dst` vector of the same size."""
        return f"(({self.dtype_name(dst)}){x})"

    def vector_select(self, m: str, a: str, b: str, dt: DType, width: int) -> str:
        """Lanes of the `dt` vectors a where mask `m` (lanes `width` bytes wide) is set, else of b."""
        it = _MASK_INT[width].vec(dt.count)
        sel = self._select(m, self.reinterpret_vector(a, it), self.reinterpret_vector(b, it), dt.count, width)
        return self.reinterpret_vector(sel, dt)

    # *** per-render state: typedefs and helper functions, emitted only when used ***

    def _need(self, name: str, code: str) -> str:
        if name not in self._helpers: self._helpers[name] = code
        return name

    def dtype_name(self, dt: DType) -> str:
        if isinstance(dt, PtrDType): return self.dtype_name(dt.base) + "*"
        if dt.count > 1: return self.vector_type(dt)
        if dt == dtypes.float16 and self.half_as_bits:
            self._half()
            return "fg_half"
        if dt == dtypes.float16: self._need("half", "typedef _Float16 half;")
        if dt == dtypes.bfloat16: self._bf16()
        return self.type_map[dt]

    # a GPU dialect's bit casts between float and a 32-bit unsigned int, as format strings (None: C's memcpy)
    float_of_bits: str | None = None   # OpenCL: "as_float({})"
    bits_of_float: str | None = None   # OpenCL: "as_uint({})"
    half_as_bits: bool = False   # half is 16-bit integers computed in float, converted by the dialect's `_half()`

    def _half(self) -> None: raise NotImplementedError(f"{type(self).__name__} has no half conversions")
    def f64_to_f16(self, x: str) -> str:
        """A half (bits) expression of a double rounded once (for `half_as_bits` dialects)."""
        raise NotImplementedError(f"{type(self).__name__} has no double to half conversion")

    def _bf16(self) -> None:
        ushort, uint = self.type_map[dtypes.uint16], self.type_map[dtypes.uint32]
        self._need("bf16", f"typedef {ushort} bf16;  /* bfloat16 bits */")
        if self.float_of_bits is None or self.bits_of_float is None:
            to_f32 = "{\n  unsigned int u = (unsigned int)x << 16; float f; __builtin_memcpy(&f, &u, 4); return f;\n}"
            get_bits = "unsigned int u; __builtin_memcpy(&u, &f, 4);"
        else:
            to_f32 = f"{{ return {self.float_of_bits.format(f'({uint})x << 16')}; }}"
            get_bits = f"{uint} u = {self.bits_of_float.format('f')};"
        self._need("fg_bf16_to_f32", f"static inline float fg_bf16_to_f32(bf16 x) {to_f32}")
        self._need("fg_f32_to_bf16", "static inline bf16 fg_f32_to_bf16(float f) {  /* round to nearest even */\n"
                   f"  {get_bits}\n"
                   "  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  /* quiet nan */\n"
                   "  return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n}")

    # *** literals and conversions ***

    def render_const(self, v, dt: DType) -> str:
        if dt.count > 1: raise ValueError(f"no vector constants: {dt}")
        if dt == dtypes.bool: return "1" if v else "0"
        if dtypes.is_float(dt):
            if dt == dtypes.bfloat16:
                self._bf16()
                return f"((bf16)0x{struct.unpack('I', struct.pack('f', v))[0] >> 16:04x})"
            f, sfx = ("", "") if dt == dtypes.float64 else ("f", "f")
            if math.isnan(v): s = f"__builtin_nan{f}(\"\")"
            elif math.isinf(v): s = f"__builtin_inf{f}()" if v > 0 else f"(-__builtin_inf{f}())"
            else: s = repr(float(v)) + sfx
            if s.startswith("-"): s = f"({s})"
            if dt == dtypes.float16: return f"(({self.dtype_name(dt)}){s})"
            return s
        bits = 8 * dt.itemsize
        if dtypes.is_unsigned(dt): return f"{v}u" if bits <= 32 else f"{v}ul"
        if v == -2 ** (bits - 1) and bits >= 32: return f"({v + 1}{'L' if bits == 64 else ''}-1)"
        s = f"{v}L" if bits == 64 and dt != dtypes.index else str(v)
        return f"({s})" if v < 0 else s

    def to_float(self, x: str, dt: DType) -> str:
        """A float32 C expression of a half/bfloat16 value."""
        if dt == dtypes.float16 and self.half_as_bits:
            self._half()
            return f"fg_f16_to_f32({x})"
        return f"fg_bf16_to_f32({x})" if dt == dtypes.bfloat16 else f"((float){x})"

    def from_float(self, x: str, dt: DType) -> str:
        """A float32 C expression rounded to half/bfloat16."""
        if dt == dtypes.float16 and self.half_as_bits:
            self._half()
            return f"fg_f32_to_f16({x})"
        self.dtype_name(dt)
        return f"fg_f32_to_bf16({x})" if dt == dtypes.bfloat16 else f"((half)({x}))"

    # *** half/bfloat16 vectors: explicit conversions to and from float vectors ***

    f16_chunk: int = 0   # lanes of the widest float->half vector conversion instruction (0: none)

    def vec_to_float(self, x: str, dt: DType) -> str:
        """A float32 vector C expression of a half/bfloat16 vector (exact)."""
        n, vt, ft = dt.count, self.dtype_name(dt), self.dtype_name(dtypes.float32.vec(dt.count))
        name = f"fg_{_SHORT[dt.scalar()]}x{n}_to_f32"
        if dt.scalar() == dtypes.bfloat16:
            body = f"  return ({ft})({self.convert_vector('x', dtypes.uint32.vec(n))} << 16);"
        else: body = self._f16_convert(n, to_float=True)
        return f"{self._inline_fn(name, ft, vt, body)}({x})"

    def vec_from_float(self, x: str, dt: DType) -> str:
        """A float32 vector C expression rounded (to nearest even) to the half/bfloat16 vector dtype `dt`."""
        n, vt, ft = dt.count, self.dtype_name(dt), self.dtype_name(dtypes.float32.vec(dt.count))
        name = f"fg_f32x{n}_to_{_SHORT[dt.scalar()]}"
        if dt.scalar() == dtypes.bfloat16:
            ut = self.dtype_name(dtypes.uint32.vec(n))
            # as fg_f32_to_bf16 lane by lane, with a mask instead of a branch (nan: quiet it, keep the sign)
            body = (f"  {ut} u = ({ut})x, nan = ({ut})((u & 0x7fffffffu) > 0x7f800000u);\n"
                    f"  {ut} r = (((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (((u >> 16) | 0x40u) & nan);\n"
                    f"  return {self.convert_vector('r', dt)};")
        else: body = self._f16_convert(n, to_float=False)
        return f"{self._inline_fn(name, vt, ft, body)}({x})"

    def _inline_fn(self, name: str, ret: str, arg: str, body: str) -> str:
        return self._need(name, f"static inline __attribute__((always_inline)) {ret} {name}({arg} x) {{\n{body}\n}}")

    def _f16_convert(self, n: int, to_float: bool) -> str:
        """The body of a conversion of `n` lanes between half and float vectors: F16C/AVX-512 instructions (called as
        GCC builtins, so no header), `chunk` lanes at a time. Written explicitly because gcc 12 drops the rounding
        of the vector float->half->float pairs its own vectorizer makes (see `ClangRenderer.prelude`)."""
        chunk = min(self.f16_chunk, n)
        if chunk < 4 or n % chunk:   # no instruction for it: lane by lane
            t = "float" if to_float else self.dtype_name(dtypes.float16)
            return f"  {self.dtype_name((dtypes.float32 if to_float else dtypes.float16).vec(n))} r;\n" \
                   f"  for (int i = 0; i < {n}; i++) r[i] = ({t})x[i];\n  return r;"
        hw, fw = max(chunk, 8), chunk   # lanes of the half (at least 128 bits) and float registers
        self._need(f"fg_v{hw}hi", f"typedef short fg_v{hw}hi __attribute__((vector_size({2 * hw})));")
        self._need(f"fg_v{fw}sf", f"typedef float fg_v{fw}sf __attribute__((vector_size({4 * fw})));")
        if to_float:
            cvt = {4: "__builtin_ia32_vcvtph2ps(h)", 8: "__builtin_ia32_vcvtph2ps256(h)",
                   16: "__builtin_ia32_vcvtph2ps512_mask(h, (fg_v16sf){0}, (unsigned short)-1, 4)"}[chunk]
            step = f"fg_v{hw}hi h = {{0}}; __builtin_memcpy(&h, (const char*)&x + {2} * k, {2 * chunk}); " \
                   f"fg_v{fw}sf f = {cvt}; __builtin_memcpy((char*)&r + 4 * k, &f, {4 * chunk});"
            rt = self.dtype_name(dtypes.float32.vec(n))
        else:
            # immediate 0: round to nearest even
            cvt = {4: "__builtin_ia32_vcvtps2ph(f, 0)", 8: "__builtin_ia32_vcvtps2ph256(f, 0)",
                   16: "__builtin_ia32_vcvtps2ph512_mask(f, 0, (fg_v16hi){0}, (unsigned short)-1)"}[chunk]
            step = f"fg_v{fw}sf f; __builtin_memcpy(&f, (const char*)&x + 4 * k, {4 * chunk}); " \
                   f"fg_v{hw}hi h = {cvt}; __builtin_memcpy((char*)&r + 2 * k, &h, {2 * chunk});"
            rt = self.dtype_name(dtypes.float16.vec(n))
        return f"  {rt} r;\n  for (int k = 0; k < {n}; k += {chunk}) {{ {step} }}\n  return r;"

    def render_cast(self, x: str, src: DType, dst: DType) -> str:
        if src == dst: return x
        if self.half_as_bits and src.count == 1 and dst.count == 1 and dtypes.float16 in (src, dst):
            # (16-bit integers: a C cast would convert the number that holds the bits)
            if src == dtypes.float16: x, src = self.to_float(x, src), dtypes.float32
            if dst == dtypes.float16:
                # (a double is rounded to half once, as the C renderer's (half)x does)
                return self.f64_to_f16(x) if src == dtypes.float64 else self.from_float(f"(float)({x})", dst)
        if dst.count > 1:
            if src.scalar() in _LOWP: x, src = self.vec_to_float(x, src), dtypes.float32.vec(src.count)
            if dst.scalar() in _LOWP:
                if src.scalar() == dtypes.float64:   # lane by lane: half rounded once, directly; bfloat16 through
                    # float as the scalar cast does (bf16 is an integer type in C: a C cast would convert the value)
                    def lane(i: int | str) -> str:
                        a = self.lane("a", i)
                        return f"fg_f32_to_bf16((float){a})" if dst.scalar() == dtypes.bfloat16 else \
                            f"({self.dtype_name(dst.scalar())}){a}"
                    return f"{self._lane_helper('cast_f64', dst, lane, [src])}({x})"
                if src.scalar() != dtypes.float32:   # integers are exact in float wherever they fit in half
                    x = self.convert_vector(x, dtypes.float32.vec(src.count))
                return self.vec_from_float(x, dst)
            return x if src == dst else self.convert_vector(x, dst)
        if src == dtypes.bfloat16: x, src = self.to_float(x, src), dtypes.float32
        if dst == dtypes.bool: return f"((_Bool)({x}))"
        if dst == dtypes.bfloat16: return self.from_float(f"(float)({x})", dst)
        return f"(({self.dtype_name(dst)})({x}))"

    def render_bitcast(self, x: str, src: DType, dst: DType) -> str:
        if dst.count > 1: return self.reinterpret_vector(f"({x})", dst)
        t, s = self.dtype_name(dst), self.dtype_name(src)
        return f"({{ {t} fg_r; {s} fg_s = {x}; __builtin_memcpy(&fg_r, &fg_s, sizeof(fg_r)); fg_r; }})"

    # *** ALU ***

    def render_alu(self, op: Ops, dt: DType, srcs: list[str], src_dts: list[DType]) -> str:
        """A C expression computing `op` on scalars or vectors (vectors use native operators or a lane loop)."""
        if op is _WHERE and src_dts[0].count == 1: return f"({srcs[0]}?{srcs[1]}:{srcs[2]})"
        odt = src_dts[-1] if op in GroupOp.Comparison else dt    # the dtype the operation is carried out in
        if dt.count > 1 and odt.scalar() in _LOWP and op is not _WHERE:
            # half/bfloat16 vectors: converted to float vectors, computed, rounded back
            f32 = lambda d: dtypes.float32.vec(d.count) if d.scalar() in _LOWP else d
            fs = [self.vec_to_float(s, d) if d.scalar() in _LOWP else s for s, d in zip(srcs, src_dts)]
            ret = self._vector_alu(op, dt if op in GroupOp.Comparison else f32(dt), fs, [f32(d) for d in src_dts])
            return ret if op in GroupOp.Comparison else self.vec_from_float(ret, dt)
        if dt.count > 1: return self._vector_alu(op, dt, srcs, src_dts)
        if odt in _LOWP:
            fs = [self.to_float(s, d) if d in _LOWP else s for s, d in zip(srcs, src_dts)]
            ret = self.render_alu(op, dtypes.bool if op in GroupOp.Comparison else dtypes.float32, fs,
                                  [dtypes.float32 if d in _LOWP else d for d in src_dts])
            return ret if op in GroupOp.Comparison else self.from_float(ret, dt)
        ret = self._scalar_alu(op, odt, srcs)
        return f"(({self.dtype_name(dt)}){ret})" if dt in _SMALL and op not in GroupOp.Comparison else ret

    def _scalar_alu(self, op: Ops, dt: DType, s: list[str]) -> str:
        isf, t = dtypes.is_float(dt), self.dtype_name(dt)
        fsfx = "f" if dt == dtypes.float32 else ""
        if op in _INFIX:
            if dt == dtypes.bool and op is _SUB: op = _XOR
            return f"({s[0]}{_INFIX[op]}{s[1]})"
        if op is _NEG: return f"(!{s[0]})" if dt == dtypes.bool else f"(-{s[0]})"
        if op is _NOT: return f"(!{s[0]})"
        if op is _RECIP: return f"(1.0{fsfx}/{s[0]})" if isf else self._scalar_alu(_IDIV, dt, ["1", s[0]])
        if op in _UNARY_FN:
            if not isf: return s[0] if op is _TRUNC else f"(({t})__builtin_{_UNARY_FN[op]}((double){s[0]}))"
            return f"__builtin_{_UNARY_FN[op]}{fsfx}({s[0]})"
        if op is _MULACC:
            return f"__builtin_fma{fsfx}({s[0]}, {s[1]}, {s[2]})" if isf else f"(({s[0]}*{s[1]})+{s[2]})"
        if op is _POW:
            if isf: return f"__builtin_pow{fsfx}({s[0]}, {s[1]})"
            return f"(({t})__builtin_pow((double){s[0]}, (double){s[1]}))"
        if op is _FDIV and isf: return f"({s[0]}/{s[1]})"
        if op in (_IDIV, _FDIV) and isf: return f"__builtin_trunc{fsfx}({s[0]}/{s[1]})"
        if op is _MOD and isf: return f"__builtin_fmod{fsfx}({s[0]}, {s[1]})"
        if op in (_IDIV, _FDIV, _MOD): return self._int_div(op, dt, s)
        if op is _MAX:
            name = f"fg_max_{_SHORT[dt]}"
            # for floats a nan on either side wins, as in torch.maximum. Written so that gcc 12 at -O3 compiles a > b
            # to a max instruction and branches only on a nan (rare, so predicted): `(a > b || a != a) ? a : b`
            # became branches on a > b, which relu's input mispredicts half the time (a max pool of relu ran three
            # times slower), and the loop vectorizer still vectorizes this form (one computed in SIMD registers it
            # didn't)
            body = f"{t} m = a > b ? a : b; return a != a ? a : m;" if isf else "return a > b ? a : b;"
            return f"{self._need(name, f'static inline {t} {name}({t} a, {t} b) {{ {body} }}')}({s[0]}, {s[1]})"
        if op in (_SHL, _SHR): return self._shift(op, dt, s)
        if op is _THREEFRY: return f"{self._threefry()}({s[0]}, {s[1]})"
        raise NotImplementedError(f"no C for {op} on {dt}")

    def _int_div(self, op: Ops, dt: DType, s: list[str]) -> str:
        signed = not dtypes.is_unsigned(dt) and dt != dtypes.bool
        try: d = int(s[1].strip("()").rstrip("uUlL"))
        except ValueError: d = None
        if d is not None and d != 0 and not (signed and d == -1):
            return f"({s[0]}{'/' if op is not Ops.MOD else '%'}{s[1]})"
        t, name = self.dtype_name(dt), f"fg_{'mod' if op is Ops.MOD else 'div'}_{_SHORT[dt]}"
        # x/0 gives 0 and x/-1 is a negation (INT_MIN/-1 traps in hardware)
        if op is Ops.MOD: body = "return b == 0" + (" || b == -1" if signed else "") + " ? 0 : a % b;"
        else:
            neg = f"b == -1 ? ({t})(0 - ({_UNSIGNED_OF.get(dt, t)})a) : " if signed else ""
            body = f"return b == 0 ? 0 : {neg}a / b;"
        return f"{self._need(name, f'static inline {t} {name}({t} a, {t} b) {{ {body} }}')}({s[0]}, {s[1]})"

    def _shift(self, op: Ops, dt: DType, s: list[str]) -> str:
        bits, t = 8 * dt.itemsize, self.dtype_name(dt)
        ut = _UNSIGNED_OF.get(dt, t)
        def shifted(n: str) -> str: return f"({t})(({ut}){s[0]} << {n})" if op is Ops.SHL else f"({s[0]} >> {n})"
        try:
            n = int(s[1].strip("()").rstrip("uUlL"))
            return f"({shifted(s[1])})" if 0 <= n < bits else "0"
        except ValueError:
            # a count of the width or more gives 0: the count is masked into range and the result masked to 0, without
            # a branch (a ?: here keeps gcc's loop vectorizer from if-converting the code around it)
            ok = f"(0-({ut})((unsigned long)({s[1]}) < {bits}))"
            return f"(({t})({shifted(f'(({s[1]})&{bits - 1})')}&{ok}))"

    def _threefry(self) -> str:
        return self._need("fg_threefry", """\
static inline unsigned long fg_threefry(unsigned long x, unsigned long key) {
  /* Threefry-2x32 with 20 rounds: x and key are each two 32-bit words (low word first) */
  static const int rot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
  unsigned int k[3] = {(unsigned int)key, (unsigned int)(key >> 32), 0};
  k[2] = k[0] ^ k[1] ^ 0x1BD11BDAu;
  unsigned int x0 = (unsigned int)x + k[0], x1 = (unsigned int)(x >> 32) + k[1];
  for (int r = 0; r < 20; r++) {
    x0 += x1; x1 = (x1 << rot[r % 8]) | (x1 >> (32 - rot[r % 8])); x1 ^= x0;
    if (r % 4 == 3) { int i = r / 4 + 1; x0 += k[i % 3]; x1 += k[(i + 1) % 3] + (unsigned int)i; }
  }
  return ((unsigned long)x1 << 32) | x0;
}""")

    def _vector_alu(self, op: Ops, dt: DType, srcs: list[str], src_dts: list[DType]) -> str:
        sc = dt.scalar()
        if op is _MULACC and (fma := self._native_fma(dt)) is not None: return f"{fma}({', '.join(srcs)})"
        if op is _SQRT and (sqrt := self._native_sqrt(dt)) is not None: return f"{sqrt}({srcs[0]})"
        if op in (_ADD, _SUB, _MUL) or (op in (_AND, _OR, _XOR) and not dtypes.is_float(sc)):
            return f"({srcs[0]}{_INFIX[op]}{srcs[1]})"
        if op is _NEG: return f"(-{srcs[0]})"
        if op is _FDIV and dtypes.is_float(sc): return f"({srcs[0]}/{srcs[1]})"
        if op is _MAX: return f"{self._vector_max(dt)}({srcs[0]}, {srcs[1]})"
        if op in (_SHL, _SHR) and sc in _UNSIGNED_DT and src_dts[1] == dt and \
                (shift := self._vector_shift(op, dt)) is not None:
            return f"{shift}({srcs[0]}, {srcs[1]})"
        # everything else: a lane loop in an inlined helper; gcc vectorizes it when the lanes' op has a SIMD form
        def lane(i: int | str) -> str:
            return self.render_alu(op, sc, [self.lane(chr(97 + j), i) for j in range(len(srcs))],
                                   [d.scalar() for d in src_dts])
        return f"{self._lane_helper(op.name.lower(), dt, lane, src_dts)}({', '.join(srcs)})"

    def _vector_shift(self, op: Ops, dt: DType) -> str | None:
        """An inlined function shifting each lane of an integer vector by the count in the same lane of another, as
        one vector operation; None where the dialect writes the lanes one by one (`_lane_helper`)."""
        return None

    def _vector_max(self, dt: DType) -> str:
        """An inlined function of two `dt` vectors giving each lane's max as `fg_max_<type>` does (a where a > b, or for
        floats where a is nan; else b: a nan on either side wins, max(0.0, -0.0) is -0.0 and max(-0.0, 0.0) is 0.0)
        with vector comparisons and a bitwise select (gcc 12 left the lane loop of fg_max_f32 scalar)."""
        n, w = dt.count, dt.scalar().itemsize
        vt, mt, name = self.dtype_name(dt), self._mask_type(n, w), f"fg_vmax_{_SHORT[dt.scalar()]}x{n}"
        m = self._vector_compare(Ops.CMPLT, dt, "b", "a")
        if dtypes.is_float(dt.scalar()): m = f"{m}|{self._vector_compare(Ops.CMPNE, dt, 'a', 'a')}"
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}({vt} a, {vt} b) {{\n"
                                f"  return ({vt}){self._select(m, f'(({mt})a)', f'(({mt})b)', n, w)};\n}}")

    @staticmethod
    def _x86_float_vector(dt: DType) -> tuple[str, int, str] | None:
        """For a float32/float64 vector on x86: the builtins' suffix (ps/pd), its width in bits and the C type of a
        lane mask; else None."""
        sc = dt.scalar()
        if sc not in (dtypes.float32, dtypes.float64) or platform.machine() not in ("x86_64", "AMD64"): return None
        return ("ps" if sc == dtypes.float32 else "pd", dt.count * sc.itemsize * 8,
                "unsigned short" if dt.count == 16 else "unsigned char")

    def _masked_load(self, dt: DType) -> str | None:
        """A helper loading a float vector with an AVX-512 lane mask (zero where masked off), if the CPU has one."""
        if (x86 := self._x86_float_vector(dt)) is None: return None
        (sfx, bits, mt), flags = x86, hostcpu.cpu().features
        if not ("avx512f" in flags and (bits == 512 or (bits in (128, 256) and "avx512vl" in flags))): return None
        vt, st = self.dtype_name(dt), self.dtype_name(dt.scalar())
        name = f"fg_maskload_{_SHORT[dt.scalar()]}x{dt.count}"
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}(const {st}* p, unsigned m) "
                                f"{{ return __builtin_ia32_loadu{sfx}{bits}_mask(p, ({vt}){{0}}, ({mt})m); }}")

    def _scatter(self, dt: DType) -> str | None:
        """A helper storing each lane of a `dt` vector at its own offset from a pointer in one instruction; None
        where the dialect has none (the lanes are stored one by one)."""
        return None

    def _gather(self, dt: DType) -> str | None:
        """A helper loading a `dt` vector whose lanes are at their own offsets from a pointer in one instruction;
        None where the dialect has none (the lanes are loaded one by one)."""
        return None

    def _transposed_copy(self, k: KernelText, u: UOp) -> None:
        dst, src = u.src
        w, dst_step, src_step = u.arg
        k.line(f"{self._transpose_helper(dst.src[0].dtype.base, w)}({k.r[dst.src[0]]}+({k.r[dst.src[1]]}), {dst_step}, "
               f"{k.r[src.src[0]]}+({k.r[src.src[1]]}), {src_step});")

    def _transpose_helper(self, dt: DType, w: int) -> str:
        """The helper `f(d, ds, s, ss)` copying the w x w block of `dt` elements at s (rows ss apart) transposed to
        d (rows ds apart): its rows loaded as vectors and transposed in registers (`transpose_network`), where the
        compiler has __builtin_shufflevector (gcc 12, clang); element by element where it hasn't. Not inlined: a
        kernel calls it from each copy it makes (two for a tile of two vectors' columns), and one body of its 64
        shuffles compiles in a third less time than two (the MLP's layer at -O2: 0.11 -> 0.08 s, the same speed)."""
        vt, st, name = self.dtype_name(dt.vec(w)), self.dtype_name(dt), f"fg_transpose_{_SHORT[dt]}x{w}"
        if name in self._helpers: return name   # (a kernel's copies share it: its text is made once per kernel)
        body = [f"  {vt} r{i}_0 = *(const {vt}*)(s + {i} * ss);" for i in range(w)]
        steps = transpose_network(w)
        for n, step in enumerate(steps, 1):
            body += [f"  {vt} r{r}_{n} = __builtin_shufflevector(r{x}_{n - 1}, r{y}_{n - 1}, "
                     f"{', '.join(map(str, lanes))});" for r, x, y, lanes in step]
        body += [f"  *({vt}*)(d + {j} * ds) = r{j}_{len(steps)};" for j in range(w)]
        return self._need(name, "\n".join([
            "#ifndef __has_builtin", "#define __has_builtin(x) 0", "#endif",
            f"static __attribute__((noinline)) void {name}({st}* restrict d, long ds, "
            f"const {st}* restrict s, long ss) {{", "#if __has_builtin(__builtin_shufflevector)", *body, "#else",
            f"  for (int i = 0; i < {w}; i++) for (int j = 0; j < {w}; j++) d[j * ds + i] = s[i * ss + j];", "#endif",
            "}"]))

    def _native_fma(self, dt: DType) -> str | None:
        """The x86 fused multiply-add builtin for a float vector that fills a whole register, if the CPU has one. (A
        lane loop of fmaf is left scalar by gcc 12 at -O2, which made 16-lane kernels 16x slower.)"""
        if (x86 := self._x86_float_vector(dt)) is None: return None
        (sfx, bits, _), flags = x86, hostcpu.cpu().features
        if bits == 512 and "avx512f" in flags: return self._avx512_unmasked(dt, "fma", f"vfmadd{sfx}", "a, b, c", 3)
        if bits in (128, 256) and "fma" in flags: return f"__builtin_ia32_vfmadd{sfx}{'256' if bits == 256 else ''}"
        return None

    def _avx512_unmasked(self, dt: DType, what: str, builtin: str, operands: str, nargs: int) -> str:
        """An inlined function `fg_<what>_<ps|pd>512` of `nargs` `dt` vectors calling the AVX-512 builtin
        `__builtin_ia32_<builtin>512_mask` on `operands` with every lane in the mask and the current rounding mode."""
        (sfx, _, mt), vt = self._x86_float_vector(dt), self.dtype_name(dt)  # type: ignore[misc]
        name, params = f"fg_{what}_{sfx}512", ", ".join(f"{vt} {chr(97 + i)}" for i in range(nargs))
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}({params}) "
                                f"{{ return __builtin_ia32_{builtin}512_mask({operands}, ({mt})-1, 4); }}")

    def _native_scalef(self, dt: DType) -> str | None:
        """The x86 `a * 2^floor(b)` of a float vector that fills a 512-bit register (vscalefps/pd), if the CPU has it:
        one instruction for the two factors that transcendental.py's exp2 multiplies its polynomial by (`_ldexp`:
        exponent bits shifted into place, twice), with the same single rounding of a denormal result. None elsewhere
        (a dialect without it renders the factors as they are)."""
        if (x86 := self._x86_float_vector(dt)) is None: return None
        (sfx, bits, _), flags = x86, hostcpu.cpu().features
        if bits == 512 and "avx512f" in flags: return self._avx512_unmasked(dt, "scalef", f"scalef{sfx}", "a, b, a", 2)
        return None

    def _native_sqrt(self, dt: DType) -> str | None:
        """The x86 square root of a float vector that fills a whole register, if the CPU has one: correctly rounded as
        each lane's sqrt is. (The lane helper's initializer becomes one instruction only where gcc's SLP vectorizer
        runs: at the quick tier's -Og it stayed 16 scalar roots, and took a third of an Adam kernel's compile time.)"""
        if (x86 := self._x86_float_vector(dt)) is None: return None
        (sfx, bits, _), flags = x86, hostcpu.cpu().features
        if bits == 512 and "avx512f" in flags: return self._avx512_unmasked(dt, "sqrt", f"sqrt{sfx}", "a, a", 1)
        if bits == 256 and "avx" in flags: return f"__builtin_ia32_sqrt{sfx}256"
        if bits == 128: return f"__builtin_ia32_sqrt{sfx}"   # (SSE and SSE2 are part of x86-64)
        return None

    def _lane_helper(self, what: str, dt: DType, lane: Callable[[int | str], str], src_dts: list[DType]) -> str:
        """An inlined function of vectors a, b, ... that computes each lane i of its `dt` result as `lane(i)`.

        The lanes are written out as one vector initializer, which gcc's SLP vectorizer makes one instruction where the
        op has a SIMD form (a square root). A loop over the lanes was left to the loop vectorizer, which kernels with
        gated accesses are compiled without: Adam's update then took eight scalar square roots per vector."""
        vt, n = self.dtype_name(dt), dt.count
        args = [f"{self.dtype_name(d)} {chr(97 + i)}" for i, d in enumerate(src_dts)]
        name = f"fg_v{what}_{_SHORT[dt.scalar()]}x{n}"
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}({', '.join(args)}) {{\n"
                                f"  return {self.vector_literal(dt, [lane(i) for i in range(n)])};\n}}")

    def _broadcast(self, dt: DType) -> str:
        vt, name = self.dtype_name(dt), f"fg_bcast_{_SHORT[dt.scalar()]}x{dt.count}"
        st = self.dtype_name(dt.scalar())
        # an initializer of equal elements: gcc makes it one broadcast instruction (a lane loop became n loads)
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}({st} x) {{ "
                                f"return ({vt}){{{', '.join(['x'] * dt.count)}}}; }}")

    def _streamed_buffers(self, uops: list[UOp]) -> set[UOp]:
        """The global buffers this kernel stores whole-register vectors to that bypass the caches (`_stream`); none by
        default."""
        return set()

    def _stream(self, dt: DType) -> str:
        """The helper `f(ptr, v)` storing the vector `v` at `ptr` past the caches (where `ptr` is aligned to it)."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming stores")

    def _bf16_dot(self, k: KernelText, p: Bf16Pair) -> str:
        """The C of a pair of bfloat16 multiply-add links as one dot product (renderer/cpu_dot.py)."""
        idx = p.lo
        return f"{self.bf16_dot_helper()}({k.r[p.acc]}, {k.r[idx.src[0]]}+({k.r[idx.src[1]]}), {k.r[p.lo_vec]}, " \
               f"{k.r[p.hi_vec]})"

    def bf16_dot_helper(self) -> str:
        """The helper `f(acc, a, lo, hi)` of float32 vectors acc, lo and hi (bfloat16 values in float32 lanes) and a
        pointer `a` to two adjacent bfloat16 values: acc + a[1] * hi, then + a[0] * lo, each product exact and each
        sum rounded once (`_dot_of_pairs`, with B's rows k and k+1 interleaved per lane and A's pair one word)."""
        vt, ut = self.dtype_name(dtypes.float32.vec(DOT_LANES)), self.dtype_name(dtypes.uint32.vec(DOT_LANES))
        bt, name, dot = self.dtype_name(dtypes.bfloat16), f"fg_dot2_bf16x{DOT_LANES}", self._dot_of_pairs()
        # (the upper halves of bfloat16 values in float32 are the values; the lower halves, zero, are masked anyway:
        # the packed copy's lanes no store reached hold whatever was there)
        return self._need(name, "\n".join([
            f"static inline __attribute__((always_inline)) {vt} {name}({vt} acc, const {bt}* a, {vt} lo, {vt} hi) {{",
            "  unsigned int p; __builtin_memcpy(&p, a, 4);",
            f"  return {dot}(acc, p, (({ut})hi & 0xffff0000u) | (({ut})lo >> 16));", "}"]))

    def _dot_of_pairs(self) -> str:
        """The helper `f(acc, p, b)`: acc plus, per lane, the products of the bfloat16 pair in the 32-bit word `p`
        with the pair in that lane of `b` (the high halves first, then the low ones, each product exact and each sum
        rounded once). With AVX512_BF16 one vdpbf16ps, which also reads bfloat16 denormals as zero and flushes a
        denormal sum to zero; without it (another compiler, a CPU without it) IEEE arithmetic in the same order: each
        product of two bfloat16 values is exact in float32, so a multiply and an add are the fused multiply-add."""
        vt, ut = self.dtype_name(dtypes.float32.vec(DOT_LANES)), self.dtype_name(dtypes.uint32.vec(DOT_LANES))
        name, bh, ones = f"fg_dot_pairs_x{DOT_LANES}", f"fg_bh{2 * DOT_LANES}", ", ".join(["p"] * DOT_LANES)
        self._need(bh, f"typedef short {bh} __attribute__((vector_size({4 * DOT_LANES})));")
        return self._need(name, "\n".join([
            f"static inline __attribute__((always_inline)) {vt} {name}({vt} acc, unsigned int p, {ut} b) {{",
            "#if defined(__AVX512BF16__) && defined(__GNUC__) && !defined(__clang__)",
            f"  return __builtin_ia32_dpbf16ps_v{DOT_LANES}sf(acc, ({bh})({ut}){{{ones}}}, ({bh})b);",
            "#else",
            "  unsigned int ul = p << 16, uh = p & 0xffff0000u; float al, ah;",
            "  __builtin_memcpy(&al, &ul, 4); __builtin_memcpy(&ah, &uh, 4);",
            f"  acc = acc + ah * ({vt})(b & 0xffff0000u);",
            f"  return acc + al * ({vt})(b << 16);",
            "#endif", "}"]))

    def _render_amx(self, k: KernelText, p: AmxPlan, name: str, uops: list[UOp]) -> str:
        """A kernel that is only a bfloat16 matmul (renderer/cpu_dot.py `amx_plan`) on AMX tiles: per 32 columns of
        the output, B's 32 x K panel packed as pairs of rows (B[2i, n] and B[2i+1, n] side by side: the layout the
        tile product takes); per 32 rows of the part of M this call runs, 2 x 2 float32 tiles of 16 x 16 summed over
        K 32 at a time (TDPBF16PS: 16 x 16 x 32 products each), then stored, rounded to bfloat16 for a bfloat16
        output. The call's rows [core_lo, core_hi) are rounded down to whole blocks of 32 (every boundary the same
        way, so the calls of a split still cover every block once)."""
        for u in uops:
            if u.op is Ops.DEFINE_GLOBAL: self._define_global(k, u)
        bf16_out = p.out.dtype.base == dtypes.bfloat16
        self._bf16()
        half = p.k // 2
        def tile(op: str, t: int, ptr: str = "", stride: str = "") -> str:
            return f'__asm__ volatile("{op} (%0,%1,1), %%tmm{t}" :: "r"({ptr}), "r"((long)({stride})) : "memory");' \
                if op == "tileloadd" else \
                f'__asm__ volatile("{op} %%tmm{t}, (%0,%1,1)" :: "r"({ptr}), "r"((long)({stride})) : "memory");'
        def dot(c: int, x: int, y: int) -> str:   # (AT&T order: B's tile, A's tile, the accumulator)
            return f'__asm__ volatile("tdpbf16ps %%tmm{y}, %%tmm{x}, %%tmm{c}" ::: "memory");'
        # each C tile to its 16 x 16 place in the output, or for a bfloat16 output in a float32 block of 32 x 32,
        # rounded a row of 16 lanes at a time as `vec_from_float` rounds (loaded as vectors: a memcpy to a vector went
        # through the stack in two halves and waited for them: 1024x128x2048 on one core 2.4 -> 0.8 ms)
        if bf16_out:
            ft, bt16 = self.dtype_name(dtypes.float32.vec(16)), self.dtype_name(dtypes.bfloat16.vec(16))
            store = [tile("tilestored", t, f"ct+{16 * (t // 2) * 32 + 16 * (t % 2)}", 128) for t in range(4)] + [
                "for (int r = 0; r < 32; r++) for (int h = 0; h < 32; h += 16) {",
                f"  {ft} v = *({ft}*)(ct+r*32+h);",
                f"  *({bt16}*)(oc+r*{p.o_row}+h) = {self.vec_from_float('v', dtypes.bfloat16.vec(16))};", "}"]
        else: store = [tile("tilestored", t, f"oc+{16 * (t // 2) * p.o_row + 16 * (t % 2)}", p.o_row * 4)
                       for t in range(4)]
        body = [
            "struct { unsigned char palette, start, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; } "
            "cfg = {1};",
            "for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }",
            '__asm__ volatile("ldtilecfg %0" :: "m"(cfg));',
            *(["float ct[1024] __attribute__((aligned(64)));"] if bf16_out else []),
            *self._panel_loops(k, p, 32, [
                *[f'__asm__ volatile("tilezero %%tmm{t}" ::: "memory");' for t in range(4)],
                f"for (long k0 = 0; k0 < {p.k}; k0 += 32) {{",
                "  " + tile("tileloadd", 4, "ac+k0", p.a_row * 2),
                "  " + tile("tileloadd", 5, f"ac+{16 * p.a_row}+k0", p.a_row * 2),
                "  " + tile("tileloadd", 6, "bp+k0/2*16", 64),
                "  " + tile("tileloadd", 7, f"bp+{half * 16}+k0/2*16", 64),
                *["  " + dot(c, x, y) for c, x, y in ((0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7))],
                "}",
                *store]),
            '__asm__ volatile("tilerelease" ::: "memory");']
        k.body = ["  " + line for line in body]
        return self._render_function(k, name, uops)

    def _panel_loops(self, k: KernelText, p: AmxPlan, rows: int, block: list[str]) -> list[str]:
        """The loops of a whole bfloat16 matmul's template: per 32 columns of the output, B's K x 32 panel at `bc`
        copied into `bp` as pairs of rows (B[2i, n] in the low half of a 32-bit word, B[2i+1, n] in the high half),
        16 columns at a time, the layout AMX tiles and vdpbf16ps take; then `block` per `rows` rows of the part of M
        this call runs (A's rows at `ac`, the output's at `oc`). The call's rows [core_lo, core_hi) are rounded down
        to whole blocks of AMX_TILE (every boundary the same way, so the calls of a split still cover every block
        once)."""
        half = p.k // 2
        if p.b_col == 1: pack = [   # (B along n: rows k and k+1 interleaved, 16 columns at a time)
            f"  for (long i = 0; i < {half}; i++) {{",
            f"    const bf16* r0 = bc + 2*i*{p.b_row}; const bf16* r1 = r0 + {p.b_row};",
            "    for (int j = 0; j < 16; j++) {",
            "      bp[i*16+j] = r0[j] | ((unsigned int)r1[j] << 16);",
            f"      bp[{half * 16}+i*16+j] = r0[16+j] | ((unsigned int)r1[16+j] << 16);",
            "    }", "  }"]
        else: pack = [   # (B along k, a transposed weight: each column's pairs are adjacent already)
            "  for (int j = 0; j < 32; j++) {",
            f"    const bf16* col = bc + j*{p.b_col};",
            f"    for (long i = 0; i < {half}; i++) bp[(j/16)*{half * 16}+i*16+j%16] = col[2*i] | "
            "((unsigned int)col[2*i+1] << 16);", "  }"]
        return [
            f"unsigned int bp[{2 * half * 16}] __attribute__((aligned(64)));",
            f"long lo = core_lo / {AMX_TILE} * {AMX_TILE}, hi = core_hi / {AMX_TILE} * {AMX_TILE};",
            f"for (long n0 = 0; n0 < {p.n} && lo < hi; n0 += 32) {{",
            f"  const bf16* bc = {k.r[p.b]} + {p.b_off} + n0*{p.b_col};",
            *pack,
            f"  for (long m0 = lo; m0 < hi; m0 += {rows}) {{",
            f"    const bf16* ac = {k.r[p.a]} + {p.a_off} + m0*{p.a_row};",
            f"    {self.dtype_name(p.out.dtype.base)}* oc = {k.r[p.out]} + {p.o_off} + m0*{p.o_row} + n0;",
            *["    " + line for line in block],
            "  }", "}"]

    DOT_ROWS = 8   # rows of output the dot-product template sums in registers at a time (8 x 2 vectors of 16 lanes)

    def _render_dot_matmul(self, k: KernelText, p: AmxPlan, name: str, uops: list[UOp]) -> str:
        """A kernel that is only a bfloat16 matmul (renderer/cpu_dot.py `amx_plan`) on a CPU with AVX512_BF16 but no
        AMX: per 32 columns of the output, B's K x 32 panel packed as pairs of rows (`_panel_loops`, as for AMX); per
        DOT_ROWS rows of the part of M this call runs, DOT_ROWS x 2 vectors of 16 float32 sums in registers, each
        step of 2 along K one vdpbf16ps per vector (A's pair broadcast to every lane); then stored, rounded to
        bfloat16 for a bfloat16 output. The register-tiled form (pairs found in the loop nest, `bf16_pairs`) read B
        from a float32 panel twice the size and interleaved its rows in the loop. The call's rows are rounded to
        blocks of AMX_TILE as `_render_amx` rounds them."""
        for u in uops:
            if u.op is Ops.DEFINE_GLOBAL: self._define_global(k, u)
        self._bf16()
        half, rows = p.k // 2, self.DOT_ROWS
        vt, ut = self.dtype_name(dtypes.float32.vec(DOT_LANES)), self.dtype_name(dtypes.uint32.vec(DOT_LANES))
        dot = self._dot_of_pairs()
        sums = [f"c{r}_{h}" for r in range(rows) for h in range(2)]
        if p.out.dtype.base == dtypes.bfloat16:
            bt = self.dtype_name(dtypes.bfloat16.vec(DOT_LANES))
            store = [f"*({bt}*)(oc+{r * p.o_row + 16 * h}) = "
                     f"{self.vec_from_float(f'c{r}_{h}', dtypes.bfloat16.vec(DOT_LANES))};"
                     for r in range(rows) for h in range(2)]
        else: store = [f"*({vt}*)(oc+{r * p.o_row + 16 * h}) = c{r}_{h};" for r in range(rows) for h in range(2)]
        body = self._panel_loops(k, p, rows, [
            f"{vt} " + ", ".join(f"{c} = {self.vector_zero(dtypes.float32.vec(DOT_LANES))}" for c in sums) + ";",
            f"for (long i = 0; i < {half}; i++) {{",
            f"  {ut} b0 = *({ut}*)(bp+i*16), b1 = *({ut}*)(bp+{half * 16}+i*16);",
            *[f"  {{ unsigned int pr; __builtin_memcpy(&pr, ac+{r * p.a_row}+2*i, 4); "
              f"c{r}_0 = {dot}(c{r}_0, pr, b0); c{r}_1 = {dot}(c{r}_1, pr, b1); }}" for r in range(rows)],
            "}",
            *store])
        k.body = ["  " + line for line in body]
        return self._render_function(k, name, uops)

    # *** vectors of bools: masks ***
    # A vector of bools lives in a register as a mask: integer lanes of all ones (true) or zeros, as wide as the lanes
    # of the values compared (what GCC's vector comparisons give), widened or narrowed where it meets another width.

    def _mask_type(self, n: int, width: int) -> str: return self.dtype_name(_MASK_INT[width].vec(n))

    def _mask_conv(self, m: str, n: int, frm: int, to: int) -> str:
        return m if frm == to else self.convert_vector(m, _MASK_INT[to].vec(n))

    def _select(self, m: str, a: str, b: str, n: int, width: int) -> str:
        """Lanes of integer vectors a where mask m is set, else of b."""
        t = self._mask_type(n, width)
        name = f"fg_vselect_{_SHORT[_MASK_INT[width]]}x{n}"
        self._need(name, f"static inline __attribute__((always_inline)) {t} {name}({t} m, {t} a, {t} b) {{\n"
                         f"  return (a & m) | (b & ~m);\n}}")
        return f"{name}({m}, {a}, {b})"

    def _vector_compare(self, op: Ops, dt: DType, a: str, b: str) -> str:
        """The mask of a comparison of two `dt` vectors. GCC makes scalar code of comparisons of vectors wider than a
        register, so those are done in halves (copied out and back: __builtin_shufflevector is too new)."""
        n, sz = dt.count, dt.scalar().itemsize
        w = sz
        if n * sz <= max(getattr(self, "simd_bytes", 0), 16) or n % 2:
            return f"(({self._mask_type(n, w)})({a}{_INFIX[op]}{b}))"
        h, half, mt = n // 2, n * sz // 2, self._mask_type(n, w)
        ht, hm = self.dtype_name(dt.scalar().vec(n // 2)), self._mask_type(n // 2, w)
        name = f"fg_v{op.name.lower()}_{_SHORT[dt.scalar()]}x{n}"
        self._need(name, f"static inline __attribute__((always_inline)) {mt} {name}({self.dtype_name(dt)} a, "
                         f"{self.dtype_name(dt)} b) {{\n  {ht} a0, a1, b0, b1; {mt} r;\n"
                         f"  __builtin_memcpy(&a0, &a, {half}); __builtin_memcpy(&a1, (char*)&a + {half}, {half});\n"
                         f"  __builtin_memcpy(&b0, &b, {half}); __builtin_memcpy(&b1, (char*)&b + {half}, {half});\n"
                         f"  {hm} r0 = {self._vector_compare(op, dt.scalar().vec(h), 'a0', 'b0')}, "
                         f"r1 = {self._vector_compare(op, dt.scalar().vec(h), 'a1', 'b1')};\n"
                         f"  __builtin_memcpy(&r, &r0, {half * w // sz}); "
                         f"__builtin_memcpy((char*)&r + {half * w // sz}, &r1, {half * w // sz});\n  return r;\n}}")
        return f"{name}({a}, {b})"

    def render_mask_op(self, u: UOp, r: dict[UOp, str], mw: dict[UOp, int]) -> tuple[str, int | None]:
        """The C expression of `u`, an op making or using a bool vector, and the mask width of its result (None when
        the result isn't a mask). `mw` holds the widths of the masks rendered so far."""
        op, src, n = u.op, u.src, u.dtype.count
        is_mask = lambda x: x.dtype.count > 1 and x.dtype.scalar() == dtypes.bool
        if op is Ops.GEP: return f"((_Bool)({self.lane(r[src[0]], u.arg)}))", None
        if op is Ops.VECTORIZE:
            t = dtypes.int32.vec(n)
            if all(s is src[0] for s in src): return f"({self.vector_zero(t)}-(int)({r[src[0]]}))", 4
            return self.vector_literal(t, [f"-(int)({r[s]})" for s in src]), 4
        if op is Ops.CAST:
            s = src[0]
            if is_mask(s) and is_mask(u): return r[s], mw[s]
            if is_mask(s): return self.render_cast(f"(-{r[s]})", _MASK_INT[mw[s]].vec(n), u.dtype), None  # true is 1
            x, dt = r[s], s.dtype
            if dt.scalar() in _LOWP: x, dt = self.vec_to_float(x, dt), dtypes.float32.vec(n)
            return self.reinterpret_vector(f"({x}!=0)", _MASK_INT[dt.scalar().itemsize].vec(n)), dt.scalar().itemsize
        if op is Ops.WHERE:
            c, a, b = src
            if is_mask(u):
                w = mw[a]
                return self._select(self._mask_conv(r[c], n, mw[c], w), r[a], self._mask_conv(r[b], n, mw[b], w), n,
                                    w), w
            w = u.dtype.scalar().itemsize
            return self.vector_select(self._mask_conv(r[c], n, mw[c], w), r[a], r[b], u.dtype, w), None
        if op in GroupOp.Comparison and not is_mask(src[0]):
            xs, dt = [r[s] for s in src], src[0].dtype
            if dt.scalar() in _LOWP: xs, dt = [self.vec_to_float(x, dt) for x in xs], dtypes.float32.vec(n)
            return self._vector_compare(op, dt, xs[0], xs[1]), dt.scalar().itemsize
        # logic on masks (C arithmetic on bools: + and max are or, * is and, - is xor)
        w = mw[src[0]]
        ms = [r[src[0]]] + [self._mask_conv(r[s], n, mw[s], w) for s in src[1:]]
        if op in (Ops.NOT, Ops.NEG): return f"(~{ms[0]})", w
        if op is Ops.CMPEQ: return f"(~({ms[0]}^{ms[1]}))", w
        if op is Ops.CMPLT: return f"(~{ms[0]}&{ms[1]})", w
        sym = {Ops.AND: "&", Ops.MUL: "&", Ops.OR: "|", Ops.ADD: "|", Ops.MAX: "|", Ops.XOR: "^", Ops.SUB: "^",
               Ops.CMPNE: "^"}[op]
        return f"({ms[0]}{sym}{ms[1]})", w

    # *** the kernel ***

    def prelude(self, uops: list[UOp]) -> list[str]:
        """Lines that go before everything else in the source of a kernel made of `uops` (none by default)."""
        return []

    def keep_in_register(self, var: str) -> str | None:
        """A statement that keeps the loaded vector `var` in a register for all its uses, or None (the default)."""
        return None

    def render_kernel(self, name: str, params: list[str], body: list[str], prelude: list[str] | None = None) -> str:
        # each helper is guarded (by its name and text), so several kernels can be compiled as one translation unit
        guarded = [f"#ifndef FG_DEF_{n}_{_short_hash(code)}\n#define FG_DEF_{n}_{_short_hash(code)}\n{code}\n#endif"
                   for n, code in self._helpers.items()]
        helpers = "\n".join((prelude or []) + guarded)
        return (helpers + "\n" if helpers else "") + f"{self.kernel_prefix} {name}({', '.join(params)}) {{\n" + \
            "\n".join(body) + "\n}\n"

    def render(self, uops: list[UOp], name: str) -> str:
        # the helpers a kernel needs are collected on a copy, so one renderer can render in several threads
        return copy.copy(self)._render(uops, name)

    def _render(self, uops: list[UOp], name: str) -> str:
        self._helpers: dict[str, str] = {}
        k = KernelText(self, uops)
        if (plan := whole_matmul_plan(self, uops)) is not None:
            return (self._render_amx if self.amx else self._render_dot_matmul)(k, plan, name, uops)
        if self.strided_lanes: self._find_lane_runs(k, uops)
        if self.bf16_dot:
            k.pairs = bf16_pairs(uops, k.users)
            k.unwritten.update(p.inner for p in k.pairs.values())
        k.streamed = self._streamed_buffers(uops)
        # the bool vector dtypes of the kernel's values and their sources (most kernels have none: no test per node)
        dts = set(map(_DTYPE_OF, itertools.chain(uops, itertools.chain.from_iterable(map(_SRC_OF, uops)))))
        masks = {dt for dt in dts if _is_mask_dtype(dt)}
        for u in uops:
            if u in k.unwritten: continue
            if masks and u.op in _MASK_USERS and (u.dtype in masks or not masks.isdisjoint(map(_DTYPE_OF, u.src))):
                self._render_mask_op(k, u)
            elif (render_op := self.op_renderers.get(u.op)) is not None: render_op(self, k, u)
            else: raise NotImplementedError(f"can't render {u.op}")
        # (streaming stores are weakly ordered: they are made visible before the kernel returns, to whoever waits on it)
        if k.streamed: k.body.append("  __builtin_ia32_sfence();")
        return self._render_function(k, name, uops)

    # *** one UOp: each names its value in k.r, or writes the lines it needs ***

    def _define_global(self, k: KernelText, u: UOp) -> None:
        k.r[u] = f"data{u.arg}"
        const = "" if u in k.stored else "const "
        ctype = f"{self.global_space}{const}{self.dtype_name(u.dtype.base)}*"
        k.bufs.append((u.arg, f"{ctype}{self.buffer_suffix} {k.r[u]}"))

    def _define_var(self, k: KernelText, u: UOp) -> None:
        # parameters arrive as double (floats) or long (integers), narrowed here to the var's dtype
        wide = "double" if dtypes.is_float(u.dtype) else "long"
        k.var_params.append((u.arg[0], f"{wide} {u.arg[0]}"))
        narrow = u.dtype.scalar() not in (dtypes.float64, dtypes.int64, dtypes.index)
        k.r[u] = f"(({self.dtype_name(u.dtype)}){u.arg[0]})" if narrow else u.arg[0]

    def _same_as_source(self, k: KernelText, u: UOp) -> None:
        # (BIND is its var; BARRIER is the local buffer once its copy loop is done)
        k.r[u] = k.r[u.src[0]]

    def _define_local(self, k: KernelText, u: UOp) -> None:
        k.r[u] = f"local{u.arg}"
        if not k.gpu:   # (a CPU kernel's copy of what it packs: an array of the one thread's)
            k.line(f"{self.dtype_name(u.dtype.base)} {k.r[u]}[{u.dtype.size}] __attribute__((aligned(64)));")
            return
        # memory of the group: declared at the kernel's scope (OpenCL allows __local variables nowhere else)
        k.body.insert(k.top, f"  {self.local_space}{self.dtype_name(u.dtype.base)} {k.r[u]}[{u.dtype.size}];")
        k.top += 1

    def _barrier(self, k: KernelText, u: UOp) -> None:
        # in a CPU kernel the copy is done once its loop ends: nothing to wait for
        if k.gpu: k.line(self.barrier)
        k.r[u] = k.r[u.src[0]]

    def _special(self, k: KernelText, u: UOp) -> None:
        name = u.arg
        if not (isinstance(name, str) and len(name) == 5 and name[:4] in ("gidx", "lidx") and name[4] in "012"):
            raise ValueError(f"SPECIAL {name!r}: the ids are named gidx0-2 (work-group) and lidx0-2 (work-item)")
        if name in k.specials: raise ValueError(f"SPECIAL {name} appears twice in the kernel")
        k.specials.add(name)
        k.r[u] = name
        expr = self.id_expr("group" if name[0] == "g" else "local", int(name[4]))
        k.line(f"{self.dtype_name(u.dtype)} {name} = {expr};")

    def _define_reg(self, k: KernelText, u: UOp) -> None:
        k.r[u] = f"acc{u.arg}"
        k.line(f"{self.dtype_name(u.dtype)} {k.r[u]};")

    def _const(self, k: KernelText, u: UOp) -> None: k.r[u] = self.render_const(u.arg, u.dtype)

    def _range(self, k: KernelText, u: UOp) -> None:
        v = k.r[u] = f"ridx{u.arg[0]}"
        if k.gpu and u.arg[1] == "global":
            raise ValueError(f"loop {v} is a parallel (global) loop in a kernel with work-group ids: its place in the "
                             "grid is a SPECIAL id")
        k.loops.append(u)
        lo, hi = ("core_lo", "core_hi") if u.arg[1] == "global" else ("0", k.r[u.src[0]])
        k.line(f"for (long {v} = {lo}; {v} < {hi}; {v}++) {{")
        k.depth += 1

    def _end(self, k: KernelText, u: UOp) -> None:
        k.depth -= 1
        k.line("}")
        k.loops.pop()

    def _index(self, k: KernelText, u: UOp) -> None:
        # the lvalue of the element (or of the vector starting there)
        buf, off = k.r[u.src[0]], k.r[u.src[1]]
        if u.dtype.vcount == 1: k.r[u] = f"{buf}[{off}]"
        else: k.r[u] = self.vector_load(f"{buf}+{off}", u.dtype.base.vec(u.dtype.vcount))

    def _load(self, k: KernelText, u: UOp) -> None:
        if u in k.gathered: return   # (its VECTORIZE loads it)
        idx = u.src[0]
        if idx.op is Ops.DEFINE_REG:
            k.r[u] = k.r[idx]
            return
        val = k.r[idx] if len(u.src) == 1 else f"({k.r[u.src[1]]}?{k.r[idx]}:{self._edge_load(k, u)})"
        if len(idx.src) > 2:
            zero = self.render_const(0, u.dtype) if u.dtype.count == 1 else self.vector_zero(u.dtype)
            val = f"({k.r[idx.src[2]]}?{val}:{zero})"
            if self._load_where_used(k, u):
                k.r[u] = val   # (nothing writes the buffer in between: the kernel never writes it)
                return
        k.assign(u, val, "val")
        # a vector that several accumulators of a vector reduction share (a register tile's operand) is kept in a
        # register (one that fits a register: asm can't pin a wider one, and gcc refuses the constraint)
        if 1 < u.dtype.count and u.dtype.itemsize <= self.simd_bytes and \
                sum(1 for x in k.users.get(u, []) if x.op is _MULACC and
                                     any(st.op is Ops.STORE and st.src[0] in k.lane_summed
                                         for st in k.users.get(x, []))) >= 2 and \
                (keep := self.keep_in_register(k.r[u])) is not None:
            k.line(keep)

    def _edge_load(self, k: KernelText, u: UOp) -> str:
        """A vector load on a padded edge, each lane gated by its own condition (u.src[2:])."""
        buf, base = k.r[u.src[0].src[0]], k.r[u.src[0].src[1]]
        if (masked := self._masked_load(u.dtype)) is not None:
            # one masked load (masked-off lanes read nothing, so no fault past the edge)
            bits = "|".join(f"((unsigned)({k.r[m]})<<{i})" for i, m in enumerate(u.src[2:]))
            return f"{masked}({buf}+{base}, ({bits}))"
        return self.vector_literal(u.dtype, [f"({k.r[m]}?{buf}[{base}+{i}]:{self.render_const(0, u.dtype.scalar())})"
                                             for i, m in enumerate(u.src[2:])])

    @staticmethod
    def _load_where_used(k: KernelText, u: UOp) -> bool:
        """Whether gated load `u` is written where it is used: used once, inside a select (a branch of a concatenation
        or of a reflecting pad), C evaluates it only when the select takes it. Not one contiguous along the innermost
        loop whose gate varies along it (a concatenation along the columns): there loading every branch without
        branching measured faster."""
        idx, loops = u.src[0], k.loops
        # (a group's memory changes at barriers, which may come between a load and where it is used)
        if k.gpu and idx.src[0].op in (Ops.DEFINE_LOCAL, Ops.BARRIER): return False
        return len(us := k.users.get(u, [])) == 1 and us[0].op is not Ops.RANGE and \
            k.depth_of[us[0]] == k.depth_of[u] and u.dtype.count == 1 and idx.src[0] not in k.stored and \
            not (loops and coeff(idx.src[1], loops[-1]) == 1 and loops[-1] in idx.src[2].toposort())

    def _store(self, k: KernelText, u: UOp) -> None:
        dest = u.src[0]
        if (lanes := k.scattered.get(u)) is not None:
            if lanes: k.line(self._scatter_lanes(k, lanes))   # (the others of the lanes' stores write nothing)
            return
        if dest.op is Ops.INDEX and dest.dtype.vcount > 1 and dest.src[0] in k.streamed:
            st = f"{self._stream(dest.dtype.base.vec(dest.dtype.vcount))}({k.r[dest.src[0]]}+{k.r[dest.src[1]]}, " \
                 f"{k.r[u.src[1]]});"
        elif dest.op is Ops.INDEX and dest.dtype.vcount > 1:
            st = self.vector_store(f"{k.r[dest.src[0]]}+{k.r[dest.src[1]]}", k.r[u.src[1]],
                                   dest.dtype.base.vec(dest.dtype.vcount))
        else: st = f"{k.r[dest]} = {k.r[u.src[1]]};"
        k.line(f"if ({k.r[dest.src[2]]}) {st}" if dest.op is not Ops.DEFINE_REG and len(dest.src) > 2 else st)

    def _find_lane_runs(self, k: KernelText, uops: list[UOp]) -> None:
        """A vector's lanes stored one by one (a NOOP groups the stores) and a vector made of lanes loaded one by one
        (a VECTORIZE of loads used nowhere else), each lane of one buffer at offsets a constant apart: one scatter or
        gather where the dialect has it (`k.scattered`: the first store -> the lanes' stores, the others -> ();
        `k.gathered`: the VECTORIZE -> its loads, the loads -> ()). Not where another access to that buffer that could
        see the difference comes between (a load between stores, a store between loads), nor a loop's start or end."""
        for i in sorted([*_positions_of(uops, _NOOP), *_positions_of(uops, _VECTORIZE)]):
            g = uops[i]
            if g.op is _NOOP and len(g.src) >= 4 and all(st.op is Ops.STORE for st in g.src):
                vals = [st.src[1] for st in g.src]
                v = vals[0].src[0] if vals[0].op is _GEP else None
                if v is None or v.dtype.count != len(vals) or \
                        any(x.op is not _GEP or x.src[0] is not v or x.arg != n for n, x in enumerate(vals)):
                    continue
                lanes, found = g.src, k.scattered
            elif g.op is _VECTORIZE and len(g.src) == g.dtype.count >= 4 and g.src[0].op is Ops.LOAD and \
                    len(set(g.src)) == len(g.src) and all(ld.op is Ops.LOAD and ld.dtype.count == 1 and
                                                          len(ld.src) == 1 and k.users[ld] == [g] for ld in g.src):
                lanes, found, v = g.src, k.gathered, g
            else: continue
            if (first := lanes[0].src[0]).op is not Ops.INDEX or (g.op is _VECTORIZE and len(first.src) > 2):
                continue
            buf, gate, base = first.src[0], first.src[2:], base_and_offset(first.src[1])[0]
            if not all(_in_run(x.src[0], buf, gate, base) for x in lanes): continue
            # back from the group's node (after its lanes) to its first lane, through what comes between
            seen_by, todo, j = (Ops.LOAD, Ops.STORE) if g.op is _NOOP else (Ops.STORE,), set(lanes), i
            while todo and j > 0:
                j -= 1
                if (x := uops[j]) in todo: todo.discard(x)
                elif x.op in (Ops.RANGE, Ops.END) or (x.op in seen_by and x.src[0].op is Ops.INDEX and
                                                      x.src[0].src[0] is buf): break
            if todo or (self._scatter(v.dtype) if g.op is _NOOP else self._gather(v.dtype)) is None: continue
            found.update(dict.fromkeys(lanes, ()))
            found[uops[j] if g.op is _NOOP else g] = lanes
            # what only the lanes' accesses used (a lane's position and its value's pick) isn't written either
            for x in lanes:
                if g.op is _NOOP and k.users[x.src[1]] == [x]: k.unwritten.add(x.src[1])
                if k.users[idx := x.src[0]] != [x]: continue
                k.unwritten.add(idx)
                if idx.src[1] is not base and k.users[idx.src[1]] == [idx]: k.unwritten.add(idx.src[1])

    def _lanes_at(self, k: KernelText, lanes: tuple[UOp, ...]) -> tuple[str, str]:
        """The pointer and the vector of 32-bit offsets from it that the lanes' accesses (found by _find_lane_runs)
        address."""
        idx = lanes[0].src[0]
        base, _ = base_and_offset(idx.src[1])
        offsets = [str(base_and_offset(x.src[0].src[1])[1]) for x in lanes]
        ptr = k.r[idx.src[0]] if base is None else f"{k.r[idx.src[0]]}+{k.r[base]}"
        return ptr, self.vector_literal(dtypes.int32.vec(len(lanes)), offsets)

    def _scatter_lanes(self, k: KernelText, stores: tuple[UOp, ...]) -> str:
        """The statement storing the lanes of `stores` with one scatter."""
        dest, v = stores[0].src[0], stores[0].src[1].src[0]
        st = f"{self._scatter(v.dtype)}({', '.join(self._lanes_at(k, stores))}, {k.r[v]});"
        return f"if ({k.r[dest.src[2]]}) {st}" if len(dest.src) > 2 else st

    def _render_mask_op(self, k: KernelText, u: UOp) -> None:
        expr, width = self.render_mask_op(u, k.r, k.mask_width)
        if width is None: k.assign(u, expr, "alu")
        else:
            k.mask_width[u] = width
            k.assign(u, expr, "mask", self._mask_type(u.dtype.count, width))

    def _vectorize(self, k: KernelText, u: UOp) -> None:
        if (loads := k.gathered.get(u)) is not None:
            k.assign(u, f"{self._gather(u.dtype)}({', '.join(self._lanes_at(k, loads))})", "vec")
            return
        if all(s is u.src[0] for s in u.src): k.assign(u, self.vector_splat(u.dtype, k.r[u.src[0]]), "vec")
        else: k.assign(u, self.vector_literal(u.dtype, [k.r[s] for s in u.src]), "vec")

    def _gep(self, k: KernelText, u: UOp) -> None: k.assign(u, self.lane(k.r[u.src[0]], u.arg), "gep")

    def _cast(self, k: KernelText, u: UOp) -> None:
        k.assign(u, self.render_cast(k.r[u.src[0]], u.src[0].dtype, u.dtype), "cast")

    def _bitcast(self, k: KernelText, u: UOp) -> None:
        k.assign(u, self.render_bitcast(k.r[u.src[0]], u.src[0].dtype, u.dtype), "cast")

    def _alu(self, k: KernelText, u: UOp) -> None:
        if (pair := k.pairs.get(u)) is not None:
            k.assign(u, self._bf16_dot(k, pair), "alu")
            return
        if u.op is _MUL and u.src[1].op is _BITCAST and (scalef := self._native_scalef(u.dtype)) is not None and \
                (pn := _ldexp_operands(u)) is not None:
            # (the exponent as the float it was cast from, where it was one: exact, no conversion back)
            p, n = pn
            nf = k.r[n.src[0]] if n.op is _CAST and n.src[0].dtype == u.dtype else \
                f"__builtin_convertvector({k.r[n]}, {self.dtype_name(u.dtype)})"
            k.assign(u, f"{scalef}({k.r[p]}, {nf})", "alu")
            return
        k.assign(u, self.render_alu(u.op, u.dtype, [k.r[s] for s in u.src], [s.dtype for s in u.src]), "alu")

    def _nothing(self, k: KernelText, u: UOp) -> None: pass   # (NOOP groups stores)

    def _prefetch(self, k: KernelText, u: UOp) -> None:
        # (the address as an integer sum: it may lie past the buffer's end, where a pointer sum would be undefined)
        idx = u.src[0]
        size = idx.src[0].dtype.base.itemsize
        k.line(f"__builtin_prefetch((const void*)((__UINTPTR_TYPE__){k.r[idx.src[0]]} + "
               f"(__UINTPTR_TYPE__)({k.r[idx.src[1]]})*{size}));")

    # how each op is rendered; a dialect overrides entries with its own. (ops that make or read a bool vector are
    # rendered by render_mask_op first)
    op_renderers: dict[Ops, Callable[[CStyleLanguage, KernelText, UOp], None]] = {
        Ops.DEFINE_GLOBAL: _define_global, Ops.DEFINE_VAR: _define_var, Ops.NOOP: _nothing, Ops.BIND: _same_as_source,
        Ops.DEFINE_LOCAL: _define_local, Ops.BARRIER: _barrier, Ops.SPECIAL: _special, Ops.DEFINE_REG: _define_reg,
        Ops.CONST: _const, Ops.RANGE: _range, Ops.END: _end, Ops.INDEX: _index, Ops.LOAD: _load, Ops.STORE: _store,
        Ops.VECTORIZE: _vectorize, Ops.GEP: _gep, Ops.CAST: _cast, Ops.BITCAST: _bitcast, Ops.PREFETCH: _prefetch,
        Ops.TRANSPOSED_COPY: _transposed_copy, **dict.fromkeys(GroupOp.ALU, _alu)}

    def _render_function(self, k: KernelText, name: str, uops: list[UOp]) -> str:
        """The kernel function around the rendered body, and with `entry_point` its entry taking pointers."""
        params = [p for _, p in sorted(k.bufs)] + [p for _, p in sorted(k.var_params)]
        # (a GPU-style kernel finds its place from its ids, not from a range of the parallel loop)
        if not k.gpu: params += ["long core_lo", "long core_hi"]
        src = self.render_kernel(name, params, k.body, self.prelude(uops))
        if not self.entry_point: return src
        # one signature for every kernel, so a thread pool written in C can call any of them: the buffers and the
        # Variables' values by pointer in `a`, in the order of the parameters
        casts = [f"({p.rsplit(' ', 1)[0].replace(self.buffer_suffix, '')})a[{i}]"
                 for i, (_, p) in enumerate(sorted(k.bufs))]
        casts += [f"*({p.split(' ', 1)[0]}*)a[{len(k.bufs) + i}]" for i, (_, p) in enumerate(sorted(k.var_params))]
        return src + f"void {name}_entry(void **a, long core_lo, long core_hi) {{ {name}(" + \
            ", ".join(casts + ["core_lo", "core_hi"]) + "); }\n"

def _lane_const(x: UOp) -> Any:
    """The value of a constant or of a vector of one constant in every lane, else None."""
    if x.op is Ops.CONST: return x.arg
    if x.op is _VECTORIZE and x.src and all(s.op is Ops.CONST and s.arg == x.src[0].arg for s in x.src):
        return x.src[0].arg
    return None

def _exponent_of(f: UOp) -> UOp | None:
    """e where `f` is 2^e made from its exponent bits, BITCAST(SHL(ADD(e, bias), mantissa bits)) of f's float type
    (transcendental.py _pow2), else None."""
    mant, bias = (23, 127) if f.dtype.scalar() == dtypes.float32 else (52, 1023)
    if f.op is not _BITCAST or (sh := f.src[0]).op is not _SHL or _lane_const(sh.src[1]) != mant or \
            (add := sh.src[0]).op is not _ADD or _lane_const(add.src[1]) != bias:
        return None
    return add.src[0]

def _ldexp_operands(u: UOp) -> tuple[UOp, UOp] | None:
    """(p, n) where `u` is p * 2^n as transcendental.py's _ldexp writes it, two factors made from n's exponent bits:
    p * 2^(n >> 1) * 2^(n - (n >> 1)); else None."""
    if u.op is not _MUL or (a := u.src[0]).op is not _MUL: return None
    e1, e2 = _exponent_of(a.src[1]), _exponent_of(u.src[1])
    if e1 is None or e2 is None or e1.op is not _SHR or _lane_const(e1.src[1]) != 1: return None
    n = e1.src[0]
    if e2.op is not _SUB or e2.src[0] is not n or e2.src[1] is not e1: return None
    return a.src[0], n

def _positions_of(uops: list[UOp], op: Ops) -> Iterator[int]:
    """The positions of the nodes of `op` in `uops`, compared without a Python step per node (a kernel has thousands
    of nodes, few of them of `op`)."""
    return itertools.compress(itertools.count(), map(operator.is_, map(_OP_OF, uops), itertools.repeat(op)))

_OP_OF = operator.attrgetter("op")

def _in_run(idx: UOp, buf: UOp, gate: tuple[UOp, ...], base: UOp | None) -> bool:
    """Whether `idx` is an INDEX of `buf` under `gate` at `base` plus a 32-bit constant."""
    if idx.op is not Ops.INDEX or idx.src[0] is not buf or idx.src[2:] != gate: return False
    b, offset = base_and_offset(idx.src[1])
    return b is base and abs(offset) < 2**31

def _is_mask(x: UOp) -> bool: return _is_mask_dtype(x.dtype)
def _is_mask_dtype(dt: DType) -> bool: return dt.count > 1 and dt.scalar() == dtypes.bool
_DTYPE_OF, _SRC_OF = operator.attrgetter("dtype"), operator.attrgetter("src")

class KernelText:
    """What rendering one kernel tracks: the C expression or variable of each value, the lines of the body, the
    parameters, the loops open at this point, and facts about the uops read before rendering them."""
    def __init__(self, renderer: CStyleLanguage, uops: list[UOp]):
        self.renderer = renderer
        self.users: dict[UOp, list[UOp]] = {}
        self.depth_of: dict[UOp, int] = {}
        depth, depth_of, users = 0, self.depth_of, self.users
        for u in uops:
            if u.op is _END: depth -= 1
            depth_of[u] = depth
            if u.op is _RANGE: depth += 1
            for s in u.src: users.setdefault(s, []).append(u)
        self.stored = {u.src[0].src[0] for u in uops if u.op is _STORE and u.src[0].op is _INDEX}
        # (a kernel with accumulators in registers: a reduction)
        self.accumulates = any(u.op is _DEFINE_REG for u in uops)
        # vector accumulators whose lanes are combined after their loop (a reduction vectorized along its own axis)
        self.lane_summed = {u.src[0] for u in uops if u.op is _LOAD and u.src[0].op is _DEFINE_REG and
                            u.dtype.count > 1 and self._lanes_combined(u)}
        self.r: dict[UOp, str] = {}
        self.bufs: list[tuple[int, str]] = []
        self.var_params: list[tuple[str, str]] = []
        self.body: list[str] = []
        self.counter: dict[str, int] = {}
        self.depth = 1
        self.mask_width: dict[UOp, int] = {}
        self.loops: list[UOp] = []   # the loops open at this point, innermost last
        # GPU-style: launched as a grid of work-groups (it has SPECIAL ids); its group's local arrays go at the top
        self.gpu = any(u.op is _SPECIAL for u in uops)
        self.top = 0                  # where the next local array is declared
        self.specials: set[str] = set()
        # stores of a vector's lanes written as one scatter, loads of a vector's lanes as one gather
        # (CStyleLanguage._find_lane_runs)
        self.scattered: dict[UOp, tuple[UOp, ...]] = {}
        self.gathered: dict[UOp, tuple[UOp, ...]] = {}
        self.unwritten: set[UOp] = set()
        # the global buffers whose whole-register vector stores bypass the caches (ClangRenderer._streamed_buffers)
        self.streamed: set[UOp] = set()
        # multiply-add links computed two at a time by a bfloat16 dot product (renderer/cpu_dot.py): the second link
        # of each pair -> the pair (the first isn't written)
        self.pairs: dict[UOp, Bf16Pair] = {}

    def _lanes_combined(self, acc: UOp) -> bool:
        lanes = {x for x in self.users.get(acc, []) if x.op is Ops.GEP}
        return any(y.op in GroupOp.ALU and sum(s in lanes for s in y.src) >= 2 for g in lanes for y in self.users[g])

    def line(self, s: str) -> None: self.body.append("  " * self.depth + s)

    def new_var(self, prefix: str) -> str:
        self.counter[prefix] = self.counter.get(prefix, -1) + 1
        return f"{prefix}{self.counter[prefix]}"

    def assign(self, u: UOp, expr: str, prefix: str, ctype: str | None = None) -> None:
        """Name u's value `expr`: written inline where its only user is at the same depth, else in a new variable."""
        us = self.users.get(u, [])
        if prefix != "val" and len(us) == 1 and self.depth_of[us[0]] == self.depth_of[u] and us[0].op is not Ops.RANGE:
            self.r[u] = expr
        else:
            self.r[u] = self.new_var(prefix)
            self.line(f"{ctype or self.renderer.dtype_name(u.dtype)} {self.r[u]} = {expr};")


def _chained_float_reduction(st: UOp) -> bool:
    """Whether `st` updates a scalar float accumulator with more than one operation per iteration, or inside more
    than one loop (the compiler may unroll the inner ones into a chain)."""
    if st.op is not _STORE or (acc := st.src[0]).op is not _DEFINE_REG or acc.dtype.count > 1 or \
            not dtypes.is_float(acc.dtype): return False
    reads = [x for x in st.src[1].toposort() if x.op is Ops.LOAD and x.src[0] is acc and len(x.src) > 1]
    if not reads: return False   # a reset
    if len(reads[0].src) > 3: return True   # LOAD(acc, reset, *loops)
    steps, v = 0, st.src[1]
    while v is not reads[0]:
        v = next(s for s in v.src if reads[0] in s.toposort())
        steps += 1
    return steps > 1

def _index_select(uops: list[UOp]) -> bool:
    """Whether the kernel computes a scalar select (WHERE, of any dtype: int32, int64 and int16 setitems were
    miscompiled as well as floats) on the loop indices alone, not on loaded data (a setitem's mask). Vector selects
    are our own vector code, which the loop vectorizer leaves alone."""
    for u in uops:
        if u.op is Ops.WHERE and u.dtype.count == 1:
            deps = u.src[0].toposort()
            if any(x.op is Ops.RANGE for x in deps) and not any(x.op is _LOAD for x in deps): return True
    return False

class ClangRenderer(CStyleLanguage):
    """C for the CPU: one function per kernel, loops over [core_lo, core_hi) of the outermost output loop."""
    device = "CPU"
    has_threads = True
    unique_symbols = True
    entry_point = True
    supports_prefetch = True
    transposed_copy = True
    # code generation flags (the runtime adds -shared -fPIC -lm). No fast-math: IEEE semantics (nan/inf, no
    # reassociation, no contraction of a*b+c: fused multiply-adds are explicit); -fwrapv makes integer overflow wrap
    # as the Python reference does; -fno-math-errno lets sqrt be one instruction (errno is never read);
    # -fno-trapping-math (floating-point exception flags are never read either; values don't change) lets the loop
    # vectorizer if-convert a?b:c on floats, which it otherwise keeps as a branch since a comparison may trap.
    # -O2 with -O3's vectorizer cost model (gcc 12's -O2 vectorizes only loops that need no epilogue, and a kernel's
    # loops run over [core_lo, core_hi)): the same kernel speed as -O3 (elementwise, sums, softmax, matmul, conv), a
    # third less compile time (a first run is mostly compiling). -mprefer-vector-width=512: gcc's own vectorization (the
    # elementwise kernels) in a whole AVX-512 register where -march=native picks 256 bits; our vector code uses the full
    # width already. A GPT-2 gelu over 512x3072 1.48 -> 1.06 ms, tanh 1.10 -> 0.90, exp 0.36 -> 0.30; an add the same
    # (memory-bound). The same arithmetic per element: the same bits. (Ignored where the CPU has no AVX-512.)
    compile_flags: list[str] = ["-O2", "-fvect-cost-model=dynamic", "-march=native", "-mprefer-vector-width=512",
                                "-ffp-contract=off", "-fwrapv", "-fno-math-errno", "-fno-trapping-math",
                                "-fno-strict-aliasing"]

    def _where(self, k: KernelText, u: UOp) -> None:
        # a scalar select of floats on loaded data (a relu's gradient: is the input positive?) as bit operations: gcc
        # compiled `c ? a : b` to a conditional branch, which the data takes either way at random, and a batch norm's
        # weight gradient summed over 7x7 images (scalar code) ran 3.5 ns an element, mostly mispredicted branches.
        # In a reduction, a condition loaded as a bool (a relu mask the forward stored) masks the values in a vector
        # register instead: in the integer registers each select moved its values there and back, and a batch norm's
        # gradient over a strided convolution's phases ran 0.25 -> 0.10 ms. (Not with a condition computed by a
        # comparison, which gcc then vectorizes across the upcast outputs itself, nor in an elementwise kernel: both
        # ran slower that way, 0.04 -> 0.08 and 0.04 -> 0.06 ms)
        if u.op is _WHERE and u.dtype in (dtypes.float32, dtypes.float64) and \
                any(x.op is _LOAD for x in u.src[0].toposort()):
            helper = self._bit_select(u.dtype, in_vector=u.src[0].op is _LOAD and k.accumulates)
            k.assign(u, f"{helper}({k.r[u.src[0]]}, {k.r[u.src[1]]}, {k.r[u.src[2]]})", "alu")
            return
        CStyleLanguage._alu(self, k, u)

    def _bit_select(self, dt: DType, in_vector: bool = False) -> str:
        """A helper choosing between two floats of `dt` by a condition without a branch: their bits masked, in the
        integer registers or, `in_vector`, in a vector register (the values stay in the float registers)."""
        t, it = self.dtype_name(dt), "unsigned long long" if dt.itemsize == 8 else "unsigned int"
        if in_vector:
            name = f"fg_vsel1_{_SHORT[dt]}"
            body = (f"  typedef {t} fv __attribute__((vector_size(16)));\n"
                    f"  typedef {it} uv __attribute__((vector_size(16)));\n"
                    f"  uv m = {{-({it})c}}; uv x = (uv)(fv){{a}}, y = (uv)(fv){{b}};\n"
                    f"  return ((fv)((x & m) | (y & ~m)))[0];")
        else:
            name = f"fg_bitsel_{_SHORT[dt]}"
            body = (f"  {it} m = -({it})c, x, y; __builtin_memcpy(&x, &a, sizeof x); "
                    f"__builtin_memcpy(&y, &b, sizeof y);\n"
                    f"  x = (x & m) | (y & ~m); {t} r; __builtin_memcpy(&r, &x, sizeof r); return r;")
        return self._need(name, f"static inline __attribute__((always_inline)) {t} {name}(_Bool c, {t} a, {t} b) "
                                f"{{\n{body}\n}}")

    op_renderers = {**CStyleLanguage.op_renderers, Ops.WHERE: _where}

    def _vector_shift(self, op: Ops, dt: DType) -> str | None:
        """GCC's vector operators (shift instructions); a count of the lanes' width or more gives 0, as the scalar
        form. Written lane by lane, gcc vectorized it in quarter vectors that went through the stack, and every exp of
        a softmax's 16 lanes waited on reloading them (an encoder's attention softmax about 5 times as slow)."""
        sc, n = dt.scalar(), dt.count
        bits, vt, ut = 8 * sc.itemsize, self.dtype_name(dt), self.dtype_name(_UNSIGNED_DT[sc].vec(n))
        name = f"fg_v{op.name.lower()}_{_SHORT[sc]}x{n}"
        shifted = f"(({ut})a << (({ut})b & {bits - 1}))" if op is Ops.SHL else f"(a >> (b & {bits - 1}))"
        return self._need(name, f"static inline __attribute__((always_inline)) {vt} {name}({vt} a, {vt} b) {{\n"
                                f"  return ({vt}){shifted} & ({vt})(({ut})b < {bits});\n}}")

    def prelude(self, uops: list[UOp]) -> list[str]:
        # Workarounds for GCC 12 (reproduced with 12.2 at -O3 -march=native), which miscompiles valid C:
        # - with AVX512-FP16, vectorized code drops the rounding of float->_Float16->float conversion pairs (SLP makes
        #   them vector conversions, which a later value-numbering pass folds away). Our half arithmetic is done in
        #   float anyway, so kernels that use half are compiled without the extension.
        # - the loop vectorizer gives every vector copy of a masked (conditional) load the first copy's mask, and
        #   adds the elements of an in-order float reduction in memory order instead of the order the loop says
        #   (when it reduces a chain of several additions per iteration: unrolled, or inner loops fully unrolled).
        #   Kernels with conditional memory accesses or with such float reductions are left to the SLP vectorizer
        #   and our own vector code.
        # - at -O2 with the dynamic cost model (not at -O3), the loop vectorizer stores wrong lanes in loops that
        #   compute a scalar select on the loop indices (a setitem's mask, alone or stacked with itself; float, int
        #   and double values alike): some elements of the output were left unwritten. Those kernels too are left
        #   to the SLP vectorizer.
        out: list[str] = []
        def elem(u: UOp) -> DType: return (u.dtype.base if isinstance(u.dtype, PtrDType) else u.dtype).scalar()
        if any(elem(u) == dtypes.float16 for u in uops):
            out += ["#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512FP16__)",
                    "#pragma GCC target(\"no-avx512fp16\")", "#endif"]
        gated = any((u.op is _INDEX and len(u.src) > 2) or (u.op is _LOAD and len(u.src) > 1 and
                                                               u.src[0].op is _INDEX) for u in uops)
        if gated or any(_chained_float_reduction(u) for u in uops) or _index_select(uops):
            out += ["#if defined(__GNUC__) && !defined(__clang__)", "#pragma GCC optimize(\"no-tree-loop-vectorize\")",
                    "#endif"]
        return out

    def _scatter(self, dt: DType) -> str | None:
        # (a strided store: a convolution's output vectorized along its channels; sixteen lane stores took an extract
        # and a store each of gcc's time)
        return self._avx512_strided(dt, "scatter")

    def _gather(self, dt: DType) -> str | None:
        # (a strided load: a convolution's weights packed along its output channels)
        return self._avx512_strided(dt, "gather")

    def _avx512_strided(self, dt: DType, kind: str) -> str | None:
        """The helper of AVX-512's `kind` ("scatter" or "gather") of a float32/float64 vector filling a 512-bit
        register, its lanes at 32-bit offsets from a pointer; None without AVX-512."""
        if (x86 := self._x86_float_vector(dt)) is None or x86[1] != 512 or "avx512f" not in hostcpu.cpu().features:
            return None
        vt, st, mt = self.dtype_name(dt), self.dtype_name(dt.scalar()), x86[2]
        it = self.dtype_name(dtypes.int32.vec(dt.count))
        name = f"fg_{kind}_{_SHORT[dt.scalar()]}x{dt.count}"
        builtin = f"__builtin_ia32_{kind}siv{dt.count}{'sf' if dt.scalar() == dtypes.float32 else 'df'}"
        mask, scale = f"({mt})-1", dt.scalar().itemsize
        if kind == "scatter": body = f"void {name}({st}* p, {it} i, {vt} v) {{ {builtin}(p, {mask}, i, v, {scale}); }}"
        else: body = f"{vt} {name}(const {st}* p, {it} i) {{ return {builtin}(({vt}){{0}}, p, i, {mask}, {scale}); }}"
        return self._need(name, f"static inline __attribute__((always_inline)) {body}")

    def _streamed_buffers(self, uops: list[UOp]) -> set[UOp]:
        # A kernel's output of at least STREAM_BYTES, written in whole 64-byte vectors and not read by the kernel, is
        # written past the caches (non-temporal stores): its lines are not read from memory first to be overwritten,
        # and it doesn't evict what the caches hold. Such an output outgrows what the caches keep for the kernel that
        # reads it next anyway: softmax of 4096x4096 on one core 17 -> 13 ms, a sum over its output right after took
        # the same 4.2-4.6 ms either way.
        if not self.stream_stores: return set()
        loaded = {u.src[0].src[0] for u in uops if u.op is _LOAD and u.src[0].op is _INDEX}
        # (every store of the buffer an ungated whole 64-byte vector: a kernel storing some lanes on their own keeps
        # its stores)
        whole: dict[UOp, bool] = {}
        for u in uops:
            if u.op is _STORE and (idx := u.src[0]).op is _INDEX and (buf := idx.src[0]).op is _DEFINE_GLOBAL:
                whole[buf] = whole.get(buf, True) and len(idx.src) == 2 and idx.dtype.vcount > 1 and \
                    u.src[1].dtype.itemsize == 64
        return {b for b, ok in whole.items()
                if ok and b not in loaded and b.dtype.size * b.dtype.base.itemsize >= STREAM_BYTES}

    def _stream(self, dt: DType) -> str:
        # (at an address not aligned to 64 bytes, a view's, an ordinary store: the instruction needs the alignment)
        vt, st, name = self.dtype_name(dt), self.dtype_name(dt.scalar()), f"fg_stream_{_SHORT[dt.scalar()]}x{dt.count}"
        ft = self.dtype_name(dtypes.float32.vec(16))
        return self._need(name, f"static inline __attribute__((always_inline)) void {name}({st}* p, {vt} v) {{\n"
                                f"  if (((unsigned long)p & 63) == 0) __builtin_ia32_movntps512((float*)p, ({ft})v);\n"
                                f"  else *({vt}*)p = v;\n}}")

    def keep_in_register(self, var: str) -> str | None:
        # GCC 12 reloads a vector that several multiply-adds share as each one's memory operand (an x86 FMA takes
        # one) instead of keeping it in a register: the 4x4 tile of a weight gradient then loads about once per FMA
        # where it should load once per two. An empty asm that "changes" the value pins it to a register, which makes
        # weight gradients and the MLP's small products faster. Only for reductions vectorized along their own axis:
        # where the vectors are outputs (a convolution along its output channels, a 1x1 one) GCC keeps them in
        # registers anyway and the pinned order measured slower.
        # Other compilers and architectures get nothing.
        self._helpers["FG_KEEP"] = "\n".join([
            "#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))",
            "#define FG_KEEP(x) __asm__(\"\" : \"+v\"(x))", "#else", "#define FG_KEEP(x) ((void)0)", "#endif"])
        return f"FG_KEEP({var});"

    def __init__(self) -> None:
        host = hostcpu.cpu()
        self.simd_bytes, self.vector_registers, self.has_fma = host.simd_bytes, host.vector_registers, host.has_fma
        # half vectors need the F16C conversion instructions; bfloat16 vectors are converted with integer operations
        self.f16_chunk, self.vector_dtypes = host.f16_lanes, host.vector_dtypes
        x86_avx512 = "avx512f" in host.features and platform.machine() in ("x86_64", "AMD64")
        self.strided_lanes = self.stream_stores = x86_avx512
        self.bf16_dot, self.full_rate_512 = host.bf16_dot, host.full_rate_512
        # (where the CPU has AMX and Linux grants this process its tile state; see DESIGN.md "bfloat16 products")
        self.amx = hostcpu.amx_usable()
