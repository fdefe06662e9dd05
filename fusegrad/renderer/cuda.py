"""CUDA C for the CUDA device: the C renderer's kernels (same expressions, same semantics: see cstyle.py) as
`extern "C" __global__` functions, compiled by NVRTC (runtime/ops_cuda.py).

- GPU-style kernels (SPECIAL ids, docs/architecture.md "GPU-style kernels") are launched as a grid of thread blocks:
  the ids are `blockIdx.x/y/z` and `threadIdx.x/y/z`, a DEFINE_LOCAL is a `__shared__` array of the block (aligned to
  16 bytes, as vectors are to their size: a vector loads from it in one instruction; above 48 KiB in all, a part of
  the block's dynamic shared memory), a BARRIER is `__syncthreads();` (one whose arg is ORDER_ONLY nothing).
  Each kernel declares `__launch_bounds__(threads per block)`, so the compiler may give each thread the registers
  that block size allows.
- A vector load of a global buffer (a tensor-core operand's 16-byte copy) checks its address's alignment and falls
  back to one load per element; stored to shared memory and read by nothing else, it is an asynchronous `cp.async`
  (sm_80 on), which every barrier of the kernel waits for.
- CPU-style kernels (no SPECIAL) keep their `core_lo`/`core_hi` parameters; their parallel loop becomes a grid-stride
  loop, so any grid runs them (the runtime launches one thread per iteration, up to a block's worth per block).
- A tensor-core fragment of 16-bit elements read from shared memory is one `ldmatrix` per warp (sm_75 on; `.trans`
  where each register's pair lies along a column; two B fragments one after the other in one x4) where the elements
  each lane would load are exactly what ldmatrix gives it from rows 16-byte aligned (`ldmatrix_plan` checks every
  lane); else it is loaded element by element.
- Index arithmetic is 64-bit `long` as in C, or 32-bit `int` where range analysis shows every index value of the
  kernel fits one (`index_fits_int32`: each index node's bounds, a Variable's from its declaration) and the renderer's
  `index32` says so: True for every kernel, False for none, None (the default) for tensor-core kernels (timed on an
  H200: 2-12% faster; a register-tiled float32 matmul 10% slower, the others the same); a
  pointer plus an int offset is formed in 64 bits by C's own conversion. (A CPU-style kernel's parallel loop counter
  stays `long`: its grid-stride step may pass the last index.)

half and bfloat16 are 16-bit integers in memory and in registers, computed in float and rounded after every op as the
C renderer does (no `cuda_fp16.h`: the NVRTC wheel ships no CUDA headers, and `__half` arithmetic would round
differently from the other devices where an expression has several ops). half <-> float conversions are the PTX `cvt`
instructions (exact, round to nearest even, one instruction each, sm_53 and later); bfloat16 is converted with
integer operations on its bits (its `cvt` needs sm_80 and the integer form is as short). No vectors are declared to
the optimizer: a GPU vectorizes across the threads of a warp. exp2, log2 and sin are CUDA's math library's. Floats
follow IEEE: NVRTC compiles with `--fmad=false` (fused multiply-adds are the explicit MULACCs), division and square
root correctly rounded, denormals kept."""
from __future__ import annotations
import math
import operator
import re
import struct
from collections import Counter
from typing import NamedTuple
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.renderer import ALLOW_TF32, TensorCore
from fusegrad.renderer.cstyle import _LOWP, _SHORT, CStyleLanguage, KernelText
from fusegrad.uop.ops import ORDER_ONLY, Ops, UOp

# the C renderer's GCC builtins: CUDA's math library has functions of the same meaning and name
_BUILTINS = re.compile(r"__builtin_(sqrt|exp2|log2|sin|trunc|pow|fmod|fma)(f?)\(")
# the parallel loop as the C renderer writes it (over the [core_lo, core_hi) a CPU thread is given)
_GLOBAL_LOOP = re.compile(r"^(\s*)for \(long (ridx\d+) = core_lo; \2 < core_hi; \2\+\+\) \{$")
_UINT = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
# threads per block of a CPU-style kernel (one thread per iteration of its parallel loop)
CPU_STYLE_BLOCK = 128
# shared memory a block declares statically at most; more is dynamic shared memory (`CUDARenderer._shared_layout`)
STATIC_SHARED_BYTES = 48 * 1024
DYNAMIC_SHARED_SYMBOL = "fg_dynamic_shared_bytes"

def index_fits_int32(uops: list[UOp]) -> bool:
    """Whether every index value of a kernel fits a 32-bit int, by range analysis (`UOp.vmin`/`vmax`: a Variable's
    value within its declared bounds): each index-typed node's value, and the product inside an index multiply-add
    (C computes it before the add), lie in [-2**31, 2**31 - 2] (a loop's counter steps one past its last value).
    Checking every node, not only the final addresses, bounds each intermediate value the kernel computes."""
    lo, hi = -2 ** 31, 2 ** 31 - 2
    for u in uops:
        if isinstance(u.dtype, PtrDType) or u.dtype.scalar() != dtypes.index: continue
        if not lo <= u.vmin <= u.vmax <= hi: return False
        if u.op is Ops.MULACC:
            products = [x * y for x in u.src[0]._min_max for y in u.src[1]._min_max]
            if not lo <= min(products) <= max(products) <= hi: return False
    return True

def _index_as_int32(uops: list[UOp]) -> list[UOp]:
    """The kernel with each index-typed node an int32 one (its sources replaced the same way)."""
    new: dict[UOp, UOp] = {}
    for u in uops:
        dt = u.dtype
        if not isinstance(dt, PtrDType) and dt.scalar() == dtypes.index: dt = dtypes.int32.vec(dt.count) \
            if dt.count > 1 else dtypes.int32
        src = tuple(new.get(x, x) for x in u.src)
        new[u] = u if dt == u.dtype and all(a is b for a, b in zip(src, u.src)) else u.replace(dtype=dt, src=src)
    return [new[u] for u in uops]

def _half_bits(v: float) -> int:
    """The bits of float `v` rounded to half (to nearest even; past the largest half, inf)."""
    try: return struct.unpack("<H", struct.pack("<e", v))[0]
    except OverflowError: return 0xfc00 if v < 0 else 0x7c00

# *** tensor cores (sm_80 and later): mma.sync on a warp's registers, lanes laid out as the PTX ISA says ***
# A lane's groupID is its bits 2-4 (lane // 4), its threadID_in_group bits 0-1 (lane % 4)
_GROUP_ID, _IN_GROUP = (0, 0, 1, 2, 4), (1, 2, 0, 0, 0)
_TWICE_IN_GROUP = (2, 4, 0, 0, 0)
# m16n8k16 (half and bfloat16 in): A a0..a7 at (groupID + 8 (i // 2 % 2), 2 threadID_in_group + i % 2 + 8 (i // 4)),
# B b0..b3 at (2 threadID_in_group + j % 2 + 8 (j // 2), groupID), C c0..c3 at (groupID + 8 (e // 2), 2
# threadID_in_group + e % 2)
_C_16x8 = (_GROUP_ID, _TWICE_IN_GROUP, tuple((8 * (e // 2), e % 2) for e in range(4)))
_LAYOUT_K16 = ((_GROUP_ID, _TWICE_IN_GROUP, tuple((8 * (i // 2 % 2), i % 2 + 8 * (i // 4)) for i in range(8))),
               (_TWICE_IN_GROUP, _GROUP_ID, tuple((j % 2 + 8 * (j // 2), 0) for j in range(4))), _C_16x8)
# m16n8k8 (tf32 in): A a0..a3 at (groupID + 8 (i % 2), threadID_in_group + 4 (i // 2)), B b0, b1 at
# (threadID_in_group + 4 j, groupID)
_LAYOUT_K8 = ((_GROUP_ID, _IN_GROUP, tuple((8 * (i % 2), 4 * (i // 2)) for i in range(4))),
              (_IN_GROUP, _GROUP_ID, tuple((4 * j, 0) for j in range(2))), _C_16x8)
CUDA_TENSOR_CORES = [
    TensorCore("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", (16, 8, 16), dtypes.float16, dtypes.float32,
               "CUDA", _LAYOUT_K16),
    TensorCore("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", (16, 8, 16), dtypes.bfloat16, dtypes.float32,
               "CUDA", _LAYOUT_K16)]
CUDA_TF32_TENSOR_CORES = [
    TensorCore("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", (16, 8, 8), dtypes.float32, dtypes.float32,
               "CUDA", _LAYOUT_K8)]

# *** ldmatrix (sm_75 on): a warp loads a tensor-core fragment of 16-bit elements from shared memory in one
# instruction, each lane giving the address of one row of 8 elements (16 bytes) of one of up to four 8x8 matrices, and
# receiving, of each matrix j, 32-bit register j: its two elements at (row lane // 4, columns 2 (lane % 4) and one
# after), with .trans at (rows 2 (lane % 4) and one after, column lane // 4), the lower-indexed in the low half ***

def _c_div(a: int, b: int) -> int: return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
_LANE_OPS = {Ops.ADD: operator.add, Ops.MUL: operator.mul, Ops.IDIV: _c_div,
             Ops.MOD: lambda a, b: a - _c_div(a, b) * b, Ops.SHL: operator.lshift, Ops.SHR: operator.rshift,
             Ops.AND: operator.and_}

def _lane_value(x: UOp, lane: UOp, v: int) -> int:
    """The value of index expression `x` of the lane id only (`lane`) where the lane id is `v`."""
    if x is lane: return v
    if x.op is Ops.CONST: return x.arg
    return _LANE_OPS[x.op](*[_lane_value(s, lane, v) for s in x.src])

def _terms(x: UOp) -> list[UOp]: return _terms(x.src[0]) + _terms(x.src[1]) if x.op is Ops.ADD else [x]

def _lane_split(off: UOp, lane: UOp) -> tuple[Counter, list[int]] | None:
    """Index expression `off` as its terms that don't depend on the lane id (summed: a count of each) and the sum of
    the others, each a function of the lane id alone, for each of the 32 lanes; None if a term depends on the lane id
    and anything else (or through an op `_lane_value` doesn't evaluate)."""
    free: Counter = Counter()
    numbers = [0] * 32
    for t in _terms(off):
        if lane not in (topo := t.toposort()):
            if t.op is Ops.CONST: numbers = [n + t.arg for n in numbers]
            else: free[t] += 1
            continue
        if any(x is not lane and x.op is not Ops.CONST and x.op not in _LANE_OPS for x in topo): return None
        numbers = [n + _lane_value(t, lane, v) for n, v in zip(numbers, range(32))]
    return free, numbers

def _multiple_of(x: UOp, n: int) -> bool:
    """Whether index expression `x` is a multiple of `n` whatever its variables are."""
    if x.op is Ops.CONST: return x.arg % n == 0
    if x.op is Ops.MUL: return _multiple_of(x.src[0], n) or _multiple_of(x.src[1], n)
    if x.op in (Ops.ADD, Ops.SUB): return _multiple_of(x.src[0], n) and _multiple_of(x.src[1], n)
    return False

def _element(x: UOp) -> tuple[UOp, int] | None:
    """(the INDEX into local memory, the element of it) that fragment element `x` is a plain load of, or None."""
    ld, at = (x.src[0], x.arg) if x.op is Ops.GEP and isinstance(x.arg, int) else (x, 0)
    if ld.op is not Ops.LOAD or len(ld.src) != 1 or (idx := ld.src[0]).op is not Ops.INDEX or len(idx.src) != 2:
        return None
    buf = idx.src[0]
    while buf.op is Ops.BARRIER: buf = buf.src[0]
    return (idx, at) if buf.op is Ops.DEFINE_LOCAL else None

class LdMatrix(NamedTuple):
    """A fragment loaded by ldmatrix: from `buf` (a local buffer, its element type 16 bits), each lane at the sum of
    the index terms `free` and of (lane % 8) rows[0] + (lane // 8 % 2) rows[1] + (lane // 16) rows[2] + rows[3];
    `matrices` 8x8 matrices (x4: an A fragment of 8 elements, x2: a B fragment of 4), transposed or not."""
    buf: UOp
    free: tuple[UOp, ...]
    rows: tuple[int, int, int, int]
    matrices: int
    trans: bool

def ldmatrix_plan(frag: UOp, lane: UOp) -> LdMatrix | None:
    """How ldmatrix loads tensor-core fragment `frag` (a VECTORIZE of 16-bit loads from local memory; element 2j and
    2j + 1 are register j of the mma, as `_wmma_fn` packs them) where it loads exactly the elements each lane's loads
    would, or None. `lane` is the lane id (lidx0, 32 lanes). Each element's address is split into terms free of the
    lane id, the same for all the elements, and a number per lane; the rows the lanes address are read off the
    elements that ldmatrix puts at column 0, then what ldmatrix delivers from them is compared with every element of
    every lane, and each row must start at 16 bytes (the terms free of the lane a multiple of 8 elements)."""
    if frag.op is not Ops.VECTORIZE or frag.dtype.scalar().itemsize != 2 or frag.dtype.count not in (4, 8): return None
    elements = [_element(x) for x in frag.src]
    if any(e is None for e in elements) or len({e[0].src[0] for e in elements}) != 1: return None
    splits = [_lane_split(idx.src[1], lane) for idx, _ in elements]
    if any(sp is None for sp in splits) or any(sp[0] != splits[0][0] for sp in splits): return None
    free = splits[0][0]
    at = [[n + e[1] for n in sp[1]] for e, sp in zip(elements, splits)]   # element i of lane l: free terms + at[i][l]
    matrices = frag.dtype.count // 2
    for trans in (False, True):
        # the row each lane gives: row r of matrix j (lanes 16-31 of x2 repeat lanes 0-15: their rows aren't read)
        rows = [at[2 * (lane_ // 8 % matrices) + lane_ % 8 % 2][lane_ % 8 // 2] if trans else
                at[2 * (lane_ // 8 % matrices)][4 * (lane_ % 8)] for lane_ in range(32)]
        if not all((rows[8 * j + 2 * (ln % 4) + s] + ln // 4 if trans else rows[8 * j + ln // 4] + 2 * (ln % 4) + s)
                   == at[2 * j + s][ln] for ln in range(32) for j in range(matrices) for s in (0, 1)): continue
        d = rows[0]
        coef = (rows[1] - d, rows[8] - d, rows[16] - d, d)
        if any(rows[ln] != (ln % 8) * coef[0] + (ln // 8 % 2) * coef[1] + (ln // 16) * coef[2] + d for ln in range(32)):
            continue
        if any(r % 8 for r in rows) or not all(_multiple_of(t, 8) for t in free): continue
        return LdMatrix(elements[0][0].src[0], tuple(free.elements()), coef, matrices, trans)
    return None

def lane_id(uops: list[UOp]) -> UOp | None:
    """The lane id of a kernel's warps: lidx0, of 32 work-items (a tensor-core kernel's)."""
    return next((u for u in uops if u.op is Ops.SPECIAL and u.arg == "lidx0" and u.src[0].op is Ops.CONST and
                 u.src[0].arg == 32), None)

def ldmatrix_loads(uops: list[UOp]) -> tuple[dict[UOp, LdMatrix], dict[UOp, UOp]]:
    """The tensor-core fragments of a kernel that ldmatrix loads, each with its plan, and the pairs loaded by one x4:
    two fragments of two matrices each (B's) one after the other, with no loop starting or ending between them, where
    ldmatrix gives both from its rows (the first -> the second; the first's plan is the pair's)."""
    plans: dict[UOp, LdMatrix] = {}
    pairs: dict[UOp, UOp] = {}
    if (lane := lane_id(uops)) is None: return plans, pairs
    for u in uops:
        if u.op is not Ops.WMMA: continue
        for frag in u.src[:2]:
            if frag not in plans and (plan := ldmatrix_plan(frag, lane)) is not None: plans[frag] = plan
    first = None
    for u in uops:
        if u.op in (Ops.RANGE, Ops.END): first = None
        if (plan := plans.get(u)) is None or plan.matrices != 2: continue
        both = UOp(Ops.VECTORIZE, u.dtype.scalar().vec(8), first.src + u.src) if first is not None else None
        if both is not None and (plan := ldmatrix_plan(both, lane)) is not None:
            plans[first], pairs[first], first = plan, u, None
        else: first = u
    return plans, pairs

class CUDARenderer(CStyleLanguage):
    """CUDA C for a GPU of compute capability `arch` (sm_80: A100, sm_90: H100). The limits default to what those
    GPUs have: 1024 threads per block (1024, 1024 and 64 along x, y, z), 2**31-1 blocks along x and 65535 along y and z,
    48 KiB of shared memory per block (the device gives its opt-in limit, above 48 KiB dynamic shared memory)."""
    half_as_bits = True   # (16-bit floats are integers in memory and registers, computed in float)
    float_of_bits, bits_of_float = "__uint_as_float({})", "__float_as_uint({})"
    slow_float64 = True   # (an H100's float64 runs at half its float32 rate, and libdevice's exp2 is ~20 operations)
    device = "CUDA"
    kernel_prefix = 'extern "C" __global__ void'
    buffer_suffix = " __restrict__"
    supports_float4 = False
    simd_bytes = 0
    _dynamic_shared = 0   # bytes of dynamic shared memory of the kernel being rendered (`_shared_layout`)
    _int_index = False    # whether the kernel being rendered computes its indices as int (`_render`)
    _ldm: dict[UOp, LdMatrix] = {}   # its fragments loaded by ldmatrix, and the loads that they replace
    _ldm_skip: frozenset[UOp] | set[UOp] = frozenset()
    _ldm_pair: dict[UOp, UOp] = {}   # a fragment -> the one loaded with it (its plan's matrices 2 and 3)
    vector_dtypes = ()
    has_fma = True
    has_threads = False
    # CUDA's exp2, log2 and sin (within 2, 1 and 2 ulp for float, 1, 1 and 2 for double, without fast math) instead of
    # the code generator's polynomials (codegen/transcendental.py)
    native_math = frozenset((op, dt) for op in (Ops.EXP2, Ops.LOG2, Ops.SIN) for dt in (dtypes.float32, dtypes.float64))
    unique_symbols = True
    # GPU-style kernels
    has_local = True
    global_space = ""
    local_space = "__shared__ __align__(16) "   # (vectors of up to 16 bytes load from it)
    barrier = "__syncthreads();"

    def __init__(self, arch: str = "sm_80", max_workgroup: int = 1024, local_max: tuple[int, ...] = (1024, 1024, 64),
                 global_max: tuple[int, ...] = (2 ** 31 - 1, 65535, 65535), local_bytes: int = 48 * 1024,
                 fast_local_memory: bool = True, index32: bool | None = None, ldmatrix: bool = True) -> None:
        if not re.fullmatch(r"sm_\d+[a-z]?", arch): raise ValueError(f"CUDA architecture {arch!r}: expected sm_XY")
        self.arch, self.index32, self.ldmatrix = arch, index32, ldmatrix
        self.max_workgroup, self.local_max, self.global_max = max_workgroup, tuple(local_max), tuple(global_max)
        self.local_bytes, self.fast_local_memory = local_bytes, fast_local_memory

    @property
    def tensor_cores(self) -> list[TensorCore]:   # type: ignore[override]
        """mma.sync of half and bfloat16 from sm_80 on; of tf32 too with ALLOW_TF32=1."""
        if int(re.sub(r"\D", "", self.arch)) < 80: return []
        return CUDA_TENSOR_CORES + (CUDA_TF32_TENSOR_CORES if ALLOW_TF32 else [])

    def id_expr(self, kind: str, dim: int) -> str:
        return f"({'int' if self._int_index else 'long'}){'blockIdx' if kind == 'group' else 'threadIdx'}.{'xyz'[dim]}"

    # *** vectors: only the fragments and accumulators of tensor cores (WMMA) are vectors here; NVRTC has no GCC
    # vector extensions, so a vector is a struct of an array ***

    def vector_type(self, dt: DType) -> str:
        name = f"fg_{_SHORT[dt.scalar()]}x{dt.count}"
        # (aligned to its size up to 16 bytes: a vector loaded from local memory, a staged tensor core operand's pair
        # of halves, is one load)
        align = f"__align__({n}) " if (n := dt.itemsize) & (n - 1) == 0 and n <= 16 else ""
        return self._need(name, f"typedef struct {align}{{ {self.dtype_name(dt.scalar())} v[{dt.count}]; }} {name};")

    def vector_literal(self, dt: DType, lanes: list[str]) -> str:
        return f"{self.dtype_name(dt)}{{{{{', '.join(lanes)}}}}}"
    def vector_zero(self, dt: DType) -> str: return f"{self.dtype_name(dt)}{{}}"
    def vector_splat(self, dt: DType, x: str) -> str: return self.vector_literal(dt, [x] * dt.count)
    def lane(self, x: str, i: int | str) -> str: return f"{x}.v[{i}]"

    def _wmma_fn(self, tc: TensorCore) -> str:
        """The device function doing `tc`'s mma.sync: fragments packed into the 32-bit registers PTX takes (16-bit
        values two to a register, the lower index in the low half; tf32 rounded from float by cvt.rna)."""
        a_t, b_t, c_t = (self.dtype_name(dt.vec(tc.elements(w)))
                         for dt, w in ((tc.dtype_in, "A"), (tc.dtype_in, "B"), (tc.dtype_out, "C")))
        name = "fg_" + re.sub(r"\W", "_", tc.name.removeprefix("mma.sync.aligned."))
        lines, regs = [], {"a": [], "b": []}
        for x, which in (("a", "A"), ("b", "B")):
            n = tc.elements(which)
            if tc.dtype_in.itemsize == 2:
                for j in range(0, n, 2):
                    lines.append(f"  unsigned {x}{j // 2} = (unsigned){x}.v[{j}] | ((unsigned){x}.v[{j + 1}] << 16);")
                    regs[x].append(f"{x}{j // 2}")
            elif tc.dtype_in == dtypes.float32:
                for j in range(n):
                    cvt = f'asm("cvt.rna.tf32.f32 %0, %1;" : "=r"({x}{j}) : "f"({x}.v[{j}]));'
                    lines.append(f"  unsigned {x}{j}; {cvt}")
                    regs[x].append(f"{x}{j}")
            else: raise NotImplementedError(f"tensor core {tc.name}: no packing of {tc.dtype_in}")
        nc, na, nb = tc.elements("C"), len(regs["a"]), len(regs["b"])
        ops = lambda lo, n: "{" + ",".join(f"%{i}" for i in range(lo, lo + n)) + "}"
        asm = f"{tc.name} {ops(0, nc)}, {ops(nc, na)}, {ops(nc + na, nb)}, {ops(0, nc)};"
        outs = ", ".join(f'"+f"(c.v[{i}])' for i in range(nc))
        ins = ", ".join(f'"r"({r})' for r in regs["a"] + regs["b"])
        body = "\n".join(lines + [f'  asm volatile("{asm}" : {outs} : {ins});', "  return c;"])
        return self._need(name, f"static inline {c_t} {name}({a_t} a, {b_t} b, {c_t} c) {{\n{body}\n}}")

    def _wmma(self, k: KernelText, u: UOp) -> None:
        tc = TensorCore.from_wmma_arg(u.arg)
        if tc.device != "CUDA" or tc not in CUDA_TENSOR_CORES + CUDA_TF32_TENSOR_CORES:
            raise ValueError(f"WMMA of {tc.name} on {tc.device}: not a CUDA tensor core")
        k.assign(u, f"{self._wmma_fn(tc)}({', '.join(k.r[s] for s in u.src)})", "wmma")

    # *** 16-bit floats: float in registers, 16-bit integers in memory ***

    def _half(self) -> None:
        self._need("fg_half", "typedef unsigned short fg_half;  /* half bits */")
        self._need("fg_f16_to_f32", "static inline float fg_f16_to_f32(fg_half h) {\n"
                   "  float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h)); return f;\n}")
        self._need("fg_f32_to_f16", "static inline fg_half fg_f32_to_f16(float f) {  /* round to nearest even */\n"
                   "  fg_half h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)); return h;\n}")


    # *** literals, conversions ***

    def render_const(self, v, dt: DType) -> str:
        if dt.count == 1 and dt == dtypes.float16:
            self._half()
            return f"((fg_half)0x{_half_bits(float(v)):04x})"
        if dt.count == 1 and dt in (dtypes.float32, dtypes.float64) and not math.isfinite(v):
            # (CUDA has no __builtin_nan/__builtin_inf in device code: the bits, as the C renderer's values)
            if dt == dtypes.float32:
                bits = 0x7fc00000 if math.isnan(v) else 0x7f800000 if v > 0 else 0xff800000
                return f"__uint_as_float(0x{bits:08x}u)"
            bits = 0x7ff8000000000000 if math.isnan(v) else 0x7ff0000000000000 if v > 0 else 0xfff0000000000000
            return f"__longlong_as_double((long long)0x{bits:016x}ull)"
        return super().render_const(v, dt)

    def f64_to_f16(self, x: str) -> str:
        self._half()
        name = self._need("fg_f64_to_f16", "static inline fg_half fg_f64_to_f16(double d) {\n"
                          "  fg_half h; asm(\"cvt.rn.f16.f64 %0, %1;\" : \"=h\"(h) : \"d\"(d)); return h;\n}")
        return f"{name}({x})"

    def render_bitcast(self, x: str, src: DType, dst: DType) -> str:
        if dst.count > 1 or src.count > 1: raise NotImplementedError(f"no vector bitcast on CUDA: {src} to {dst}")
        if src.itemsize != dst.itemsize: raise ValueError(f"bitcast of {src} to {dst}: not the same size")
        # through the unsigned integer of that size (half and bfloat16 are their bits already)
        ut = _UINT[src.itemsize]
        if src == dtypes.float32: bits = f"__float_as_uint({x})"
        elif src == dtypes.float64: bits = f"(({ut})__double_as_longlong({x}))"
        else: bits = f"(({ut})({x}))"
        if dst == dtypes.float32: return f"__uint_as_float({bits})"
        if dst == dtypes.float64: return f"__longlong_as_double((long long){bits})"
        return f"(({self.dtype_name(dst)}){bits})"

    def _threefry(self) -> str:
        name = super()._threefry()
        # (a rotation table in the function: a static one would be a global variable of the device)
        self._helpers[name] = self._helpers[name].replace("static const int rot", "const int rot")
        return name

    # *** the kernel ***

    def _define_var(self, k: KernelText, u: UOp) -> None:
        CStyleLanguage._define_var(self, k, u)
        # a narrowing C cast of a 16-bit float Variable would convert the value to the integer that holds its bits
        if u.dtype in _LOWP: k.r[u] = self.from_float(f"(float){u.arg[0]}", u.dtype)

    def _load(self, k: KernelText, u: UOp) -> None:
        if u in self._ldm_skip: return   # (read only by fragments ldmatrix loads)
        idx = u.src[0]
        n = u.dtype.itemsize
        if not (idx.op is Ops.INDEX and idx.dtype.vcount > 1 and idx.src[0].op is Ops.DEFINE_GLOBAL and len(u.src) == 1
                and n & (n - 1) == 0 and n <= 16) or u in k.gathered:
            return CStyleLanguage._load(self, k, u)
        # a vector of a global buffer (a staged operand's copy): one load where its address is aligned to its size,
        # as the vector type declares (a buffer's view may start at any element), else one load per element; the
        # check is uniform across a warp wherever the views and row lengths are aligned
        ptr = k.new_var("ptr")
        k.line(f"const {self.dtype_name(u.dtype.scalar())}* {ptr} = {k.r[idx.src[0]]}+{k.r[idx.src[1]]};")
        if u in self._async_loads:
            k.r[u] = ptr   # (its store copies it: `_store`)
            return
        lanes = self.vector_literal(u.dtype, [f"{ptr}[{i}]" for i in range(u.dtype.count)])
        val = f"((((unsigned long long){ptr})&{n - 1})==0?(*((const {self.dtype_name(u.dtype)}*){ptr})):{lanes})"
        if len(idx.src) > 2: val = f"({k.r[idx.src[2]]}?{val}:{self.vector_zero(u.dtype)})"
        k.assign(u, val, "val")

    def _store(self, k: KernelText, u: UOp) -> None:
        if u not in self._async_stores: return CStyleLanguage._store(self, k, u)
        # a 16-byte copy from global to shared memory: asynchronous (cp.async, bypassing L1) where the global address
        # is aligned, else loaded element by element and stored; every barrier of the kernel waits for the copies
        # first (`_barrier`), so they are done where a barrier would have found the plain copy done
        dest, ptr, dt = u.src[0], k.r[u.src[1]], u.src[1].dtype
        dst = f"{k.r[dest.src[0]]}+{k.r[dest.src[1]]}"
        lanes = self.vector_literal(dt, [f"{ptr}[{i}]" for i in range(dt.count)])
        shared = f'asm("{{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }}" : "=r"(s) : "l"({dst}));'
        copy = f'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"({ptr}) : "memory");'
        body = f"if ((((unsigned long long){ptr})&15)==0) {{ unsigned s; {shared} {copy} }} " \
               f"else {self.vector_store(dst, lanes, dt)}"
        k.line(f"if ({k.r[dest.src[2]]}) {{ {body} }}" if len(dest.src) > 2 else f"{{ {body} }}")

    def _define_local(self, k: KernelText, u: UOp) -> None:
        if not (k.gpu and self._dynamic_shared): return CStyleLanguage._define_local(self, k, u)
        # (above the static 48 KiB: a part of the block's dynamic shared memory, `_shared_layout`)
        k.r[u] = f"local{u.arg}"
        if k.top == 0 or not k.body[0].startswith("  extern __shared__"):
            k.body.insert(0, "  extern __shared__ __align__(16) unsigned char fg_shared[];")
            k.top += 1
        t = self.dtype_name(u.dtype.base)
        k.body.insert(k.top, f"  {t}* {k.r[u]} = ({t}*)(fg_shared+{self._shared_at[u]});")
        k.top += 1

    def _shared_layout(self, uops: list[UOp]) -> None:
        """Where each local buffer starts in the block's shared memory (aligned to 16 bytes), and whether they take
        more than the 48 KiB a block declares statically: then the kernel declares them in dynamic shared memory,
        whose size the variable DYNAMIC_SHARED_SYMBOL gives (one kernel to a module: runtime/ops_cuda.py reads it from
        the cubin and asks the driver for that much at each launch, up to the GPU's opt-in limit: an H100's
        227 KiB)."""
        self._shared_at, total = {}, 0
        for u in uops:
            if u.op is Ops.DEFINE_LOCAL:
                self._shared_at[u] = total
                total += -(-u.dtype.size * u.dtype.base.itemsize // 16) * 16
        self._dynamic_shared = total if total > STATIC_SHARED_BYTES else 0

    def _barrier(self, k: KernelText, u: UOp) -> None:
        if u.arg != ORDER_ONLY:
            if self._async_stores: k.line('asm volatile("cp.async.wait_all;" ::: "memory");')
            k.line(self.barrier)
        # (a BARRIER that only orders: its buffer, after its sources)
        k.r[u] = k.r[u.src[0]]

    def _ldmatrix_fragments(self, uops: list[UOp]) -> None:
        """The tensor-core fragments that ldmatrix loads (`ldmatrix_loads`), and the loads (and their lanes' picks)
        that nothing else reads, which aren't rendered."""
        self._ldm, self._ldm_pair, self._ldm_skip = {}, {}, set()
        if not self.ldmatrix or int(re.sub(r"\D", "", self.arch)) < 75: return
        self._ldm, self._ldm_pair = ldmatrix_loads(uops)
        self._ldm_lane = lane_id(uops)
        users: dict[UOp, list[UOp]] = {}
        for u in uops:
            for x in u.src: users.setdefault(x, []).append(u)
        for x in (x for frag in self._ldm for x in frag.src if x.op is Ops.GEP):
            if all(y in self._ldm for y in users[x]): self._ldm_skip.add(x)
        for ld in {x.src[0] if x.op is Ops.GEP else x for frag in self._ldm for x in frag.src}:
            if all(y in self._ldm or y in self._ldm_skip for y in users[ld]): self._ldm_skip.add(ld)

    def _async_copies(self, uops: list[UOp]) -> None:
        """The 16-byte copies from global to shared memory that `_store` makes asynchronous (sm_80 and later): a
        store to a local buffer of a vector load of a global buffer used by nothing else, under the same gate or
        none."""
        self._async_stores, self._async_loads = set(), set()
        if int(re.sub(r"\D", "", self.arch)) < 80: return
        uses: dict[UOp, int] = {}
        for u in uops:
            for x in u.src: uses[x] = uses.get(x, 0) + 1
        for u in uops:
            if u.op is not Ops.STORE or (v := u.src[1]).op is not Ops.LOAD or len(v.src) != 1 or uses[v] != 1 or \
                    v.dtype.itemsize != 16 or (dest := u.src[0]).op is not Ops.INDEX or \
                    dest.dtype.vcount != v.dtype.count: continue
            buf = dest.src[0]
            while buf.op is Ops.BARRIER: buf = buf.src[0]
            src = v.src[0]
            if buf.op is Ops.DEFINE_LOCAL and src.op is Ops.INDEX and src.src[0].op is Ops.DEFINE_GLOBAL and \
                    src.src[2:] in ((), dest.src[2:]):
                self._async_stores.add(u)
                self._async_loads.add(v)

    def _gep(self, k: KernelText, u: UOp) -> None:
        if u not in self._ldm_skip: CStyleLanguage._gep(self, k, u)

    def _vectorize(self, k: KernelText, u: UOp) -> None:
        if (plan := self._ldm.get(u)) is None: return CStyleLanguage._vectorize(self, k, u)
        if u in self._ldm_pair.values(): return   # (loaded with the fragment before it)
        # a tensor-core fragment loaded by ldmatrix (`ldmatrix_plan`): each lane gives its row's address
        lane = k.r[self._ldm_lane]
        terms = [k.r[t] for t in plan.free] + [f"({e}*{c})" for e, c in zip((f"({lane}%8)", f"({lane}/8%2)",
                                                                            f"({lane}/16)"), plan.rows) if c]
        if plan.rows[3] or not terms: terms.append(str(plan.rows[3]))
        regs = [k.new_var("frag") for _ in range(plan.matrices)]
        outs = ", ".join(f'"=r"({r})' for r in regs)
        op = f"ldmatrix.sync.aligned.m8n8.x{plan.matrices}{'.trans' if plan.trans else ''}.shared.b16"
        operands = "{" + ",".join(f"%{i}" for i in range(plan.matrices)) + "}"
        # (the buffer's shared-memory address, converted from the generic one once: the compiler reuses it, and each
        # fragment's is a 32-bit add to it)
        shared = f'asm("{{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }}" : "=r"(s) : ' \
                 f'"l"({k.r[plan.buf]}));'
        at = f"s+(unsigned)({'+'.join(terms)})*{u.dtype.scalar().itemsize}"
        k.line(f"unsigned {', '.join(regs)};")
        k.line(f'{{ unsigned s; {shared} asm volatile("{op} {operands}, [%{plan.matrices}];" : {outs} : "r"({at}) : '
               '"memory"); }')
        t = self.dtype_name(u.dtype.scalar())
        for frag, its in ((u, regs[:u.dtype.count // 2]), (self._ldm_pair.get(u), regs[u.dtype.count // 2:])):
            if frag is not None:
                k.assign(frag, self.vector_literal(frag.dtype, [f"({t})({r}{sh})" for r in its for sh in ("", ">>16")]),
                         "vec")

    def _range(self, k: KernelText, u: UOp) -> None:
        CStyleLanguage._range(self, k, u)
        # (a loop of a kernel whose indices are int counts in int; a CPU-style kernel's parallel loop stays long, as
        # its grid-stride step may pass the last index)
        if self._int_index and u.arg[1] != "global": k.body[-1] = k.body[-1].replace("for (long ", "for (int ", 1)

    op_renderers = {**CStyleLanguage.op_renderers, Ops.DEFINE_VAR: _define_var, Ops.WMMA: _wmma, Ops.LOAD: _load,
                    Ops.STORE: _store, Ops.BARRIER: _barrier, Ops.DEFINE_LOCAL: _define_local, Ops.RANGE: _range,
                    Ops.GEP: _gep, Ops.VECTORIZE: _vectorize}

    def _render(self, uops: list[UOp], name: str) -> str:
        # (on the copy `render` makes) the block size, for __launch_bounds__
        gpu_style = any(u.op is Ops.SPECIAL for u in uops)
        threads = 1 if gpu_style else CPU_STYLE_BLOCK
        for u in uops:
            if u.op is Ops.SPECIAL and u.arg.startswith("lidx"):
                size = u.src[0]
                threads *= size.arg if size.op is Ops.CONST else self.max_workgroup
        self._threads = min(threads, self.max_workgroup)
        # indices in 32 bits where all of them provably fit: fewer instructions (64-bit integer multiplies and adds
        # are several 32-bit ones); pointers stay 64-bit, an int offset sign-extended where it is added to one. By
        # default (index32 None) only in tensor-core kernels: on an H200 a 4096 half matmul 236.7 -> 241.1 TFLOP/s,
        # the im2col matmuls of ResNet-50's 14x14 and 7x7 convolutions 0.076 -> 0.067 and 0.132 -> 0.121 ms, its 7x7
        # convolution read in place 0.643 -> 0.552 ms; but the float32 matmul's registers went 128 -> 205 (ptxas
        # keeps 32 loop-invariant offsets live), one block per SM instead of two, 27.2 -> 24.8 TFLOP/s; softmax,
        # layernorm and the copies the same
        self._int_index = False
        narrow = self.index32 if self.index32 is not None else any(u.op is Ops.WMMA for u in uops)
        if narrow and index_fits_int32(uops):
            narrowed = _index_as_int32(uops)
            # (an int32 node equal to one the kernel had already would make two nodes one: not narrowed then; a
            # constant may be, written where each is used)
            ops = [u for u in narrowed if u.op is not Ops.CONST]
            if len(set(ops)) == len(ops): uops, self._int_index = narrowed, True
        self._ldmatrix_fragments(uops)
        self._async_copies(uops)
        self._shared_layout(uops)
        return super()._render(uops, name)

    def render_kernel(self, name: str, params: list[str], body: list[str], prelude: list[str] | None = None) -> str:
        lines = []
        for line in body:
            # a CPU-style kernel's parallel loop: each thread of the grid takes every (grid size)-th iteration
            if m := _GLOBAL_LOOP.match(line):
                i = m.group(2)
                line = f"{m.group(1)}for (long {i} = core_lo + (long)blockIdx.x * blockDim.x + threadIdx.x; " \
                       f"{i} < core_hi; {i} += (long)gridDim.x * blockDim.x) {{"
            lines.append(line)
        self.kernel_prefix = f'extern "C" __global__ void __launch_bounds__({getattr(self, "_threads", 1)})'
        # helpers are device functions; C++ has no _Bool (the C renderer's casts to bool name it)
        self._helpers = {n: re.sub(r"^static inline\b", "static __device__ __forceinline__", code)
                         for n, code in self._helpers.items()}
        pre = ["#ifndef _Bool", "#define _Bool bool", "#endif"] + list(prelude or [])
        if self._dynamic_shared:
            pre.append(f'extern "C" __device__ const unsigned {DYNAMIC_SHARED_SYMBOL} = {self._dynamic_shared};')
        src = super().render_kernel(name, params, lines, pre)
        return _BUILTINS.sub(lambda m: f"{m.group(1)}{m.group(2)}(", src)
