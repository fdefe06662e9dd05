"""The PYTHON device's renderer: linearized UOps -> a text listing, one UOp per line, that the PYTHON runtime parses
back and interprets.

The listing is the "source" of a PYTHON kernel (printed with DEBUG=4):
    <index> | <Op name> | <dtype repr> | <source indices, _ for a source outside the list> | <arg repr>
Sources outside the list are ordering-only dependencies (the END(store, *loops) a LOAD of an accumulator waits for).

By default the renderer declares what the CPU's C renderer declares (vector dtypes, SIMD width, registers, FMA), so
the optimizer shapes the very same kernels for both devices and PYTHON can cross-check CPU uop for uop. With
PYTHON_SIMD=0 it declares no SIMD and no FMA: the optimizer then emits plain scalar code.

`PythonRenderer(like=r)` declares what renderer `r` declares, GPU attributes included: given a GPU renderer, the code
generator makes GPU-style kernels (SPECIAL ids, local memory, barriers), and the PYTHON runtime emulates their
work-groups, so they can be cross-checked on the CPU. With PYTHON_GPU=1 (or `gpu=True`) the PYTHON device itself acts
as a GPU without another renderer: has_local, a CUDA-like launch grid (global_max (2**31-1, 65535, 65535),
local_max (1024, 1024, 64), max_workgroup 1024, local_bytes 48 KiB), no SIMD, no FMA and no threads.

Tensor cores: `like`'s (the CUDA renderer's mma.sync, for one), or with PYTHON_GPU=1 and PYTHON_TC=1 (or
`tensor_cores=True`) the CUDA renderer's; the PYTHON runtime emulates the WMMA of a warp's lanes, so tensor-core
kernels run (slowly) on any machine."""
from __future__ import annotations
import ast
import math
import re
from fusegrad import hostcpu
from fusegrad.dtype import DTYPES_DICT, DType
from fusegrad.helpers import getenv
from fusegrad.renderer import Renderer
from fusegrad.uop.ops import Ops, UOp

# what the optimizer and lowerer read from a renderer; copied from the renderer being mimicked
_OPT_ATTRS = ("has_threads", "supports_float4", "max_upcast", "simd_bytes", "vector_registers", "vector_dtypes",
              "has_fma", "has_local", "global_max", "local_max", "max_workgroup", "local_bytes", "fast_local_memory",
              "slow_float64", "full_rate_512")
# the GPU attributes' values for a renderer that declares none (a CPU renderer)
_GPU_DEFAULTS = {"has_local": False, "global_max": (), "local_max": (), "max_workgroup": 1, "local_bytes": 0,
                 "fast_local_memory": False, "slow_float64": False, "full_rate_512": False}
# what PYTHON_GPU=1 declares
_AS_GPU = {"has_local": True, "global_max": (2**31 - 1, 65535, 65535), "local_max": (1024, 1024, 64),
           "max_workgroup": 1024, "local_bytes": 48 * 1024, "fast_local_memory": True, "slow_float64": True,
           "vector_dtypes": (), "simd_bytes": 0, "has_fma": False,
           "has_threads": False}

class PythonRenderer(Renderer):
    """Serializes linearized UOps; declares the optimizer attributes of `like` (default: the host CPU's, as the CPU's
    ClangRenderer declares them; `gpu`: a GPU's, see the module docstring)."""
    device = "PYTHON"

    def __init__(self, like: Renderer | None = None, simd: bool | None = None, gpu: bool | None = None,
                 tensor_cores: bool | None = None) -> None:
        for attr, v in _GPU_DEFAULTS.items(): setattr(self, attr, v)
        self._tc_of: Renderer | None = like
        if like is None and (gpu if gpu is not None else getenv("PYTHON_GPU", 0)) and \
                (tensor_cores if tensor_cores is not None else getenv("PYTHON_TC", 0)):
            from fusegrad.renderer.cuda import CUDARenderer
            self._tc_of = CUDARenderer("sm_80")
        if like is not None:
            for attr in _OPT_ATTRS: setattr(self, attr, getattr(like, attr, _GPU_DEFAULTS.get(attr)))
        elif gpu if gpu is not None else getenv("PYTHON_GPU", 0):
            for attr, v in _AS_GPU.items(): setattr(self, attr, v)
        elif simd if simd is not None else getenv("PYTHON_SIMD", 1):
            # the host CPU's SIMD facts, as the C renderer has them (without: the base class's, no SIMD and no FMA)
            host = hostcpu.cpu()
            self.simd_bytes, self.vector_registers, self.has_fma = host.simd_bytes, host.vector_registers, host.has_fma
            self.vector_dtypes, self.full_rate_512 = host.vector_dtypes, host.full_rate_512

    @property
    def tensor_cores(self) -> list:   # type: ignore[override]
        # (read when asked: a renderer's tensor cores may depend on ALLOW_TF32)
        return list(getattr(self._tc_of, "tensor_cores", [])) if self._tc_of is not None else []

    def render(self, uops: list[UOp], name: str) -> str:
        pos = {u: i for i, u in enumerate(uops)}
        lines = [f"# PYTHON kernel {name}"]
        for i, u in enumerate(uops):
            srcs = ",".join(str(pos[s]) if s in pos else "_" for s in u.src)
            lines.append(f"{i} | {u.op.name} | {u.dtype!r} | {srcs} | {u.arg!r}")
        return "\n".join(lines) + "\n"

# *** parsing the listing back ***

_SCALARS: dict[str, DType] = {f"dtypes.{k}": v for k, v in DTYPES_DICT.items()}
_DTYPE_RE = re.compile(r"(dtypes\.\w+)(?:\.vec\((\d+)\))?(?:\.ptr\((-?\d+)(?:, '(\w+)')?\)(?:\.vec\((\d+)\))?)?")

def parse_dtype(s: str) -> DType:
    """The DType whose repr is `s` (scalar, vector, pointer, vector pointer)."""
    m = _DTYPE_RE.fullmatch(s.strip())
    if m is None or m.group(1) not in _SCALARS: raise ValueError(f"not a dtype: {s!r}")
    dt = _SCALARS[m.group(1)]
    if m.group(2): dt = dt.vec(int(m.group(2)))
    if m.group(3) is not None:
        dt = dt.ptr(int(m.group(3)), m.group(4) or "global")
        if m.group(5): dt = dt.vec(int(m.group(5)))
    return dt

_NAMES = {"nan": math.nan, "inf": math.inf, "True": True, "False": False, "None": None}

def parse_arg(s: str):
    """A UOp arg from its repr: numbers (nan and inf too), strings, None, booleans and tuples of those. Only literals
    are accepted, so a listing can't run code."""
    def ev(n: ast.AST):
        if isinstance(n, ast.Constant): return n.value
        if isinstance(n, ast.Tuple): return tuple(ev(e) for e in n.elts)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else +v
        if isinstance(n, ast.Name) and n.id in _NAMES: return _NAMES[n.id]
        raise ValueError(f"unsupported arg in listing: {s!r}")
    return ev(ast.parse(s.strip(), mode="eval").body)

def parse_listing(src: str) -> tuple[str, list[tuple[Ops, DType, tuple[int | None, ...], object]]]:
    """(kernel name, [(op, dtype, source indices (None: outside the list), arg)]) of a PythonRenderer listing."""
    lines = [ln for ln in src.splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("# PYTHON kernel "): raise ValueError("not a PYTHON kernel listing")
    name = lines[0][len("# PYTHON kernel "):].strip()
    out = []
    for ln in lines[1:]:
        idx, op, dt, srcs, arg = ln.split(" | ", 4)
        if int(idx) != len(out): raise ValueError(f"listing out of order at line {ln!r}")
        src_idx = tuple(None if s == "_" else int(s) for s in srcs.split(",")) if srcs else ()
        out.append((Ops[op], parse_dtype(dt), src_idx, parse_arg(arg)))
    return name, out
