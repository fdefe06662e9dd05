"""OpenCL C for the CL device: the C renderer's kernels (same expressions, same semantics: see cstyle.py) with an
OpenCL signature. Two kinds of kernel:
- GPU-style (it has SPECIAL ids, docs/architecture.md "GPU-style kernels"): launched as a grid of work-groups; the ids
  are `get_group_id(d)` / `get_local_id(d)`, a DEFINE_LOCAL is a `__local` array of the group, a BARRIER is
  `barrier(CLK_LOCAL_MEM_FENCE)`. The renderer declares the device's limits (`max_workgroup`, `local_max`,
  `local_bytes`) for the code generator to fit them.
- CPU-style (no SPECIAL): the kernel's parallel outermost loop becomes the global work-item index: work-item i runs
  the body of iteration i, so the runtime launches `global_size` work-items. A DEFINE_LOCAL there is an array of the
  work-item's own (the CPU's PACK copy), and a BARRIER is nothing.

Vectors: float, double (with cl_khr_fp64) and integer vectors are OpenCL C's own types (`float4`), built with
`(float4)(a, b, c, d)`, read with `.s0`-`.sf`, loaded and stored with `vload4`/`vstore4` (aligned to the element only),
converted with `convert_float4`, reinterpreted with `as_int4`; a vector of bools is an integer vector of all-ones or
zero lanes (what OpenCL's vector comparisons give and its `select` reads). The renderer declares 16-byte vectors, so
the GPU heuristic gives an elementwise kernel 4 lanes per work-item. exp2, log2 and sin are OpenCL's builtins (within
a few ulp) rather than the code generator's polynomials, and a float32 exp is OpenCL's float exp.

Half and bfloat16 are computed in float and stored as 16-bit integers (converted with integer operations on their
bits, so no cl_khr_fp16 is needed; not vectorized), and a Variable is a kernel argument (`long` for integers, `double`
for floats where the device has doubles, else `float`)."""
from __future__ import annotations
import math
import re
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.renderer.cstyle import _INFIX, _LOWP, _SHORT, CStyleLanguage
from fusegrad.uop.ops import Ops, UOp

# the C renderer's GCC builtins that have an OpenCL builtin of the same meaning (overloaded on the argument type)
_BUILTINS = re.compile(r"__builtin_(sqrt|exp2|log2|sin|trunc|pow|fmod|fma)f?\(")
# the parallel loop as the C renderer writes it (over the [core_lo, core_hi) a CPU thread is given)
_GLOBAL_LOOP = re.compile(r"^(\s*)for \(long (ridx\d+) = core_lo; \2 < core_hi; \2\+\+\) \{$")
_AS_TYPE = {dtypes.int8: "char", dtypes.uint8: "uchar", dtypes.int16: "short", dtypes.uint16: "ushort",
            dtypes.int32: "int", dtypes.uint32: "uint", dtypes.int64: "long", dtypes.uint64: "ulong",
            dtypes.float32: "float", dtypes.float64: "double", dtypes.float16: "ushort", dtypes.bfloat16: "ushort",
            dtypes.index: "long"}

# dtypes held in OpenCL vectors (half and bfloat16 are integers in memory here: not vectorized)
_VECTOR_DTYPES = (dtypes.float32, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32,
                  dtypes.int64, dtypes.uint64)
_LANES = (2, 3, 4, 8, 16)   # OpenCL C's vector sizes
_IDENT = re.compile(r"[A-Za-z_]\w*")

_VECTOR_FN = {Ops.SQRT: "sqrt", Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.TRUNC: "trunc"}

def _exp_argument(u: UOp) -> UOp | None:
    """x when `u` is EXP2(CAST(x, float64) * (1/ln 2)) of a float32 x (scalar or vector), else None."""
    if u.dtype.scalar() != dtypes.float64 or (m := u.src[0]).op is not Ops.MUL: return None
    for a, c in (m.src, m.src[::-1]):
        if c.op is Ops.VECTORIZE and all(s is c.src[0] for s in c.src): c = c.src[0]
        if a.op is Ops.CAST and a.src[0].dtype.scalar() == dtypes.float32 and c.op is Ops.CONST and \
                c.arg == 1 / math.log(2):
            return a.src[0]
    return None

class UnsupportedDType(TypeError):
    """A kernel uses a dtype the OpenCL device can't compute in (float64 without cl_khr_fp64)."""

class OpenCLRenderer(CStyleLanguage):
    """OpenCL C: a `__kernel` named after its source (so any set of kernels is one program); `has_fp64`: whether the
    device has doubles (cl_khr_fp64)."""
    half_as_bits = True   # (16-bit floats are integers in memory and registers, computed in float)
    float_of_bits, bits_of_float = "as_float({})", "as_uint({})"
    device = "CL"
    kernel_prefix = "__kernel void"
    buffer_suffix = " restrict"
    supports_float4 = True
    simd_bytes = 16   # (float4: what OpenCL implementations load and compute as one)
    has_fma = True
    # OpenCL C's names (vload/vstore of `char` take `char*`, not `signed char*`)
    type_map = {**CStyleLanguage.type_map, dtypes.int8: "char", dtypes.uint8: "uchar", dtypes.uint16: "ushort",
                dtypes.uint32: "uint", dtypes.uint64: "ulong"}
    unique_symbols = True   # (kernels are built many to a program)
    # GPU-style kernels
    has_local = True
    global_max = (2 ** 31 - 1,) * 3   # (OpenCL bounds only the global work size, by size_t)
    global_space = "__global "
    local_space = "__local "
    barrier = "barrier(CLK_LOCAL_MEM_FENCE);"

    def __init__(self, has_fp64: bool = True, device_name: str = "the OpenCL device", max_workgroup: int = 256,
                 local_max: tuple[int, ...] = (256, 256, 256), local_bytes: int = 32 * 1024,
                 fast_local_memory: bool = True, vload: bool | None = None) -> None:
        """`max_workgroup`, `local_max` and `local_bytes` are the device's CL_DEVICE_MAX_WORK_GROUP_SIZE,
        CL_DEVICE_MAX_WORK_ITEM_SIZES and CL_DEVICE_LOCAL_MEM_SIZE (the defaults: what about every OpenCL GPU has);
        `fast_local_memory`: whether its local memory is faster than global memory (a GPU's; a CPU's is not);
        `vload`: whether a vector is loaded and stored with vload/vstore (default: on a GPU, where local memory is
        fast), else element by element: PoCL's compiler makes one vector access of a vector's element accesses, but
        not of vload4's (a float4 elementwise kernel on it took three times as long as the scalar kernel)."""
        self.has_fp64, self.device_name = has_fp64, device_name
        self.max_workgroup, self.local_max, self.local_bytes = max_workgroup, tuple(local_max), local_bytes
        self.fast_local_memory = fast_local_memory
        self.vload = fast_local_memory if vload is None else vload
        self.vector_dtypes = _VECTOR_DTYPES + ((dtypes.float64,) if has_fp64 else ())
        # OpenCL's exp2, log2 and sin (within 3, 3 and 4 ulp in the full profile) instead of the code generator's
        # polynomials (codegen/transcendental.py), for the float dtypes the device computes in
        self.native_math = frozenset((op, dt) for op in (Ops.EXP2, Ops.LOG2, Ops.SIN)
                                     for dt in (dtypes.float32,) + ((dtypes.float64,) if has_fp64 else ()))

    def id_expr(self, kind: str, dim: int) -> str:
        return f"(long)get_{'group' if kind == 'group' else 'local'}_id({dim})"

    # *** vectors: OpenCL C's types (float4), constructors, .s0-.sf lanes, vload/vstore, convert_ and as_ ***

    def vector_type(self, dt: DType) -> str:
        if dt.count not in _LANES or dt.scalar() not in _AS_TYPE or dt.scalar() in (dtypes.float16, dtypes.bfloat16):
            raise ValueError(f"OpenCL C has no vector type for {dt} (vectors of 2, 3, 4, 8 or 16 lanes of integers, "
                             "float or double)")
        return f"{_AS_TYPE[dt.scalar()]}{dt.count}"

    def vector_literal(self, dt: DType, lanes: list[str]) -> str:
        return f"(({self.dtype_name(dt)})({', '.join(lanes)}))"
    def vector_zero(self, dt: DType) -> str: return f"(({self.dtype_name(dt)})(0))"
    def vector_splat(self, dt: DType, x: str) -> str: return f"(({self.dtype_name(dt)})({x}))"

    def lane(self, x: str, i: int | str) -> str:
        if not isinstance(i, int): raise ValueError(f"OpenCL C reads vector lanes by number only, not {i!r}")
        return f"{x if _IDENT.fullmatch(x) else f'({x})'}.s{i:x}"

    def vector_load(self, ptr: str, dt: DType) -> str:
        if self.vload: return f"vload{dt.count}(0, {ptr})"
        return self.vector_literal(dt, [f"({ptr})[{i}]" for i in range(dt.count)])

    def vector_store(self, ptr: str, val: str, dt: DType) -> str:
        if self.vload: return f"vstore{dt.count}({val}, 0, {ptr});"
        return f"{{ {self.dtype_name(dt)} fg_v = {val}; " + \
            " ".join(f"({ptr})[{i}] = {self.lane('fg_v', i)};" for i in range(dt.count)) + " }"
    def convert_vector(self, x: str, dst: DType) -> str: return f"convert_{self.dtype_name(dst)}({x})"
    def reinterpret_vector(self, x: str, dst: DType) -> str: return f"as_{self.dtype_name(dst)}({x})"

    # masks (vectors of bools) are integer vectors of all-ones or zero lanes as wide as the values' lanes: what
    # OpenCL's vector comparisons give and its select reads
    def vector_select(self, m: str, a: str, b: str, dt: DType, width: int) -> str: return f"select({b}, {a}, {m})"
    def _select(self, m: str, a: str, b: str, n: int, width: int) -> str: return f"select({b}, {a}, {m})"

    def _vector_compare(self, op: Ops, dt: DType, a: str, b: str) -> str: return f"({a}{_INFIX[op]}{b})"

    def _vector_max(self, dt: DType) -> str:
        # as the C renderer's: a where a > b (or, for floats, a is nan), else b
        vt, name = self.dtype_name(dt), f"fg_vmax_{_SHORT[dt.scalar()]}x{dt.count}"
        m = "(b<a)|(a!=a)" if dtypes.is_float(dt.scalar()) else "(b<a)"
        return self._need(name, f"static inline {vt} {name}({vt} a, {vt} b) {{ return select(b, a, {m}); }}")

    def _lane_helper(self, what: str, dt: DType, lane, src_dts: list[DType]) -> str:
        # (OpenCL C has no subscripts of vectors: the lanes are written out)
        vt = self.dtype_name(dt)
        args = [f"{self.dtype_name(d)} {chr(97 + i)}" for i, d in enumerate(src_dts)]
        name = f"fg_v{what}_{_SHORT[dt.scalar()]}x{dt.count}"
        return self._need(name, f"static inline {vt} {name}({', '.join(args)}) {{\n"
                                f"  return {self.vector_literal(dt, [lane(i) for i in range(dt.count)])};\n}}")

    def _vector_alu(self, op: Ops, dt: DType, srcs: list[str], src_dts: list[DType]) -> str:
        # OpenCL's math builtins take float and double vectors
        if op in _VECTOR_FN and dtypes.is_float(dt.scalar()) and dt.scalar() not in _LOWP:
            return f"{_VECTOR_FN[op]}({srcs[0]})"
        return super()._vector_alu(op, dt, srcs, src_dts)

    def _exp2(self, k, u: UOp) -> None:
        # e^x of a float32 x, which the tensor computes as the float64 exp2(x * (1/ln 2)) rounded to float32: OpenCL's
        # float exp of x (within 3 ulp), without float64 work
        x = _exp_argument(u)
        if x is not None and all(v.op is Ops.CAST and v.dtype.scalar() == dtypes.float32 for v in k.users.get(u, [])):
            # (a float expression standing for the double: its users only round it to float)
            k.r[u] = f"exp({k.r[x]})"
        else: CStyleLanguage._alu(self, k, u)

    op_renderers = {**CStyleLanguage.op_renderers, Ops.EXP2: _exp2}

    def _native_fma(self, dt: DType) -> str | None: return "fma" if dt.scalar() in (dtypes.float32, dtypes.float64) \
        else None
    def _native_sqrt(self, dt: DType) -> str | None: return None  # (sqrt of a vector: _VECTOR_FN)
    def _masked_load(self, dt: DType) -> str | None: return None

    # *** 16-bit floats: float in registers, 16-bit integers in memory ***

    # The conversions are integer operations on the bits rather than vload_half/vstore_half through the address of a
    # private variable: in a kernel with barriers PoCL's code for a work-group mixed up its work-items' copies of such
    # a variable (each got the last one's value).

    def _half(self) -> None:
        self._need("fg_half", "typedef ushort fg_half;  /* half bits */")
        self._need("fg_f16_to_f32", "static inline float fg_f16_to_f32(fg_half h) {  /* exact */\n"
                   "  uint s = (uint)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;\n"
                   "  if (e == 0x1fu) return as_float(s | 0x7f800000u | (m << 13));  /* inf, nan */\n"
                   "  if (e == 0u) return as_float(s | as_uint((float)m * 0x1p-24f));  /* zero, subnormal */\n"
                   "  return as_float(s | ((e + 112u) << 23) | (m << 13));\n}")
        # (round to nearest even, as the C renderer's conversions)
        self._need("fg_f32_to_f16", "static inline fg_half fg_f32_to_f16(float f) {  /* round to nearest even */\n"
                   "  uint u = as_uint(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;\n"
                   "  if (a > 0x7f800000u) return (fg_half)(s | 0x7e00u | ((a >> 13) & 0x3ffu));  /* quiet nan */\n"
                   "  if (a >= 0x477ff000u) return (fg_half)(s | 0x7c00u);  /* from 65520 on: inf */\n"
                   "  if (a < 0x38800000u) return (fg_half)(s | (uint)rint(as_float(a) * 0x1p24f));  /* subnormal */\n"
                   "  a -= 0x38000000u;\n"
                   "  return (fg_half)(s | ((a + 0xfffu + ((a >> 13) & 1u)) >> 13));\n}")


    def render_const(self, v, dt: DType) -> str:
        if dt == dtypes.float16 and dt.count == 1: return self.from_float(super().render_const(v, dtypes.float32), dt)
        return super().render_const(v, dt)

    def f64_to_f16(self, x: str) -> str:
        self._half()
        name = self._need("fg_f64_to_f16", "static inline fg_half fg_f64_to_f16(double d) {\n"
                          "  ulong u = as_ulong(d), a = u & 0x7ffffffffffffffful;\n"
                          "  uint s = (uint)(u >> 48) & 0x8000u;\n"
                          "  if (a > 0x7ff0000000000000ul)\n"
                          "    return (fg_half)(s | 0x7e00u | ((uint)(a >> 42) & 0x3ffu));  /* quiet nan */\n"
                          "  if (a >= 0x40effe0000000000ul) return (fg_half)(s | 0x7c00u);\n"
                          "  if (a < 0x3f10000000000000ul) return (fg_half)(s | (uint)rint(as_double(a) * "
                          "0x1p24));\n"
                          "  a -= 0x3f00000000000000ul;\n"
                          "  return (fg_half)(s | (uint)((a + 0x1fffffffffful + ((a >> 42) & 1ul)) >> 42));\n}")
        return f"{name}({x})"

    def render_bitcast(self, x: str, src: DType, dst: DType) -> str:
        if dst.count > 1 or src.count > 1: return super().render_bitcast(x, src, dst)
        if src.itemsize != dst.itemsize: raise ValueError(f"bitcast of {src} to {dst}: not the same size")
        return f"as_{_AS_TYPE[dst]}({x})"

    def _threefry(self) -> str:
        name = super()._threefry()
        # (OpenCL C has no static variables in functions)
        self._helpers[name] = self._helpers[name].replace("static const int rot", "const int rot")
        return name

    # *** the kernel ***

    def render(self, uops: list[UOp], name: str) -> str:
        if not self.has_fp64:
            for u in uops:
                dt = u.dtype.base if isinstance(u.dtype, PtrDType) else u.dtype
                if dt.scalar() == dtypes.float64:
                    raise UnsupportedDType(f"kernel {name} computes in float64, which {self.device_name} doesn't have "
                                           "(no cl_khr_fp64)")
        return super().render(uops, name)

    def _render(self, uops: list[UOp], name: str) -> str:
        # (on the copy `render` makes) half and bfloat16 Variables: their values arrive as float or double
        self._lowp_vars = {u.arg[0]: u.dtype for u in uops if u.op is Ops.DEFINE_VAR and u.dtype in _LOWP}
        self._cpu_style = not any(u.op is Ops.SPECIAL for u in uops)
        return super()._render(uops, name)

    def render_kernel(self, name: str, params: list[str], body: list[str], prelude: list[str] | None = None) -> str:
        cpu_style = getattr(self, "_cpu_style", True)
        out_params = []
        for p in params:
            if p in ("long core_lo", "long core_hi"): continue
            # (a kernel may not take a pointer to bool: bools are bytes of 0 or 1)
            if "*" in p: out_params.append(re.sub(r"\b_Bool\*", "uchar*", p))
            elif p.startswith("double ") and not self.has_fp64: out_params.append("float " + p[len("double "):])
            else: out_params.append(p)
        # a narrowing C cast of a 16-bit float Variable would convert the value to the integer that holds its bits
        narrowed = {f"(({self.dtype_name(dt)}){v})": self.from_float(f"(float){v}", dt)
                    for v, dt in getattr(self, "_lowp_vars", {}).items()}
        lines = []
        for line in body:
            # a CPU-style kernel's parallel loop (over the [core_lo, core_hi) of a CPU thread) is the global work-item
            # index. (Only while the code generator still gives the CL device such kernels)
            if cpu_style and (m := _GLOBAL_LOOP.match(line)):
                line = f"{m.group(1)}{{ long {m.group(2)} = (long)get_global_id(0);"
            for cast, value in narrowed.items(): line = line.replace(cast, value)
            lines.append(line)
        if any("core_lo" in line or "core_hi" in line for line in lines):
            raise RuntimeError(f"kernel {name}: the parallel loop isn't in the form this renderer rewrites")
        # OpenCL C lets the compiler contract a*b+c into a fused multiply-add by default; our fused multiply-adds
        # are explicit (MULACC), as in the C renderer
        pre = ["#pragma OPENCL FP_CONTRACT OFF"] + list(prelude or [])
        src = super().render_kernel(name, out_params, lines, None)
        if "double" in src: pre.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        return "\n".join(pre + [_BUILTINS.sub(lambda m: f"{m.group(1)}(", src)])
