"""The interface between code generation and devices: a Renderer turns linearized UOps into source text for one
device family, and a ProgramSpec carries that source with everything a runtime needs to call it."""
from __future__ import annotations
from dataclasses import dataclass, field
from fusegrad.uop.ops import UOp

@dataclass(frozen=True)
class Estimates:
    """Work of one kernel run: floating/integer ALU ops, bytes read+written."""
    ops: int = 0
    mem: int = 0

@dataclass
class ProgramSpec:
    """A rendered kernel.

    The entry point is `void <function_name>(<one pointer per buffer, in `globals` order>, <one parameter per var in
    `vars`: `double` for a float var, `long` for an integer one>, long core_lo, long core_hi)`. When `global_size` > 1
    the kernel's outermost loop runs over [core_lo, core_hi) instead of [0, global_size), so a runtime may split
    [0, global_size) across threads; with global_size == 1 the runtime passes (0, 1). `name` is the kernel's display
    name (E_4_8: elementwise over 4x8), `function_name` its symbol (the same unless the renderer makes it unique).

    A GPU-style kernel (non-empty `global_dims`) has no parallel loop and no core_lo/core_hi: it is launched as
    prod(global_dims) work-groups of prod(local_dims) work-items, which find their place through SPECIAL ids."""
    name: str
    src: str
    device: str
    uops: list[UOp] = field(default_factory=list)
    globals: list[int] = field(default_factory=list)   # DEFINE_GLOBAL args (buffer indices into ExecItem.bufs)
    outs: list[int] = field(default_factory=list)      # which of those are written
    ins: list[int] = field(default_factory=list)       # which are read
    vars: list[UOp] = field(default_factory=list)      # DEFINE_VARs passed after the buffers
    global_size: int = 1                               # extent of the parallel (outermost) loop
    estimates: Estimates = field(default_factory=Estimates)
    applied_opts: tuple = ()                           # optimizations applied, for DEBUG=3 and BEAM
    ast: UOp | None = None
    function_name: str = ""                            # the symbol in the binary, when it isn't `name`
    global_dims: tuple = ()                            # GPU-style: work-groups per launch dimension (dim 0 first)
    local_dims: tuple = ()                             # GPU-style: work-items per group along each dimension

    def __post_init__(self) -> None:
        if not self.function_name: self.function_name = self.name

class Renderer:
    """What a device's code generator declares and how it prints a program."""
    device: str = ""
    has_threads: bool = True        # the runtime can split the outermost loop across cores
    supports_float4: bool = True
    max_upcast: int = 16            # product of upcast/unroll sizes kept in registers
    simd_bytes: int = 0             # width of one SIMD register (0: don't vectorize explicitly)
    vector_registers: int = 16      # SIMD registers, bounds how many accumulators a kernel keeps
    vector_dtypes: tuple = ()       # dtypes the renderer can hold in vectors
    has_fma: bool = False           # reductions of products may use fused multiply-add
    compile_flags: list[str] = []   # flags for the device's compiler (read by the runtime)
    unique_symbols: bool = False    # name each function after its source, so many kernels can share one binary
    # GPU-style kernels (docs/architecture.md, "GPU-style kernels"): a launch grid of work-groups whose work-items
    # share local memory and synchronise with barriers
    has_local: bool = False         # kernels are GPU-style: SPECIAL ids, local memory, barriers
    global_max: tuple[int, ...] = ()  # the most work-groups per launch dimension (dim 0 first)
    local_max: tuple[int, ...] = ()   # the most work-items per group along each dimension
    max_workgroup: int = 1          # the most work-items in one group
    local_bytes: int = 0            # local memory one group may use, in bytes
    fast_local_memory: bool = False  # local memory is faster than global memory (a GPU's; not a CPU OpenCL's)
    def render(self, uops: list[UOp], name: str) -> str: raise NotImplementedError
