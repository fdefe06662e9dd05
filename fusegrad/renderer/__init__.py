"""The interface between code generation and devices: a Renderer turns linearized UOps into source text for one
device family, and a ProgramSpec carries that source with everything a runtime needs to call it."""
from __future__ import annotations
import itertools
from dataclasses import dataclass, field
from fusegrad.dtype import DType
from fusegrad.helpers import ContextVar
from fusegrad.uop.ops import UOp

# 1: float32 matmuls may run on tensor cores as TF32 (inputs rounded to 10 bits of significand), as torch's and
# tinygrad's knob of the same name
ALLOW_TF32 = ContextVar("ALLOW_TF32", 0)

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
    read_only: list[int] = field(default_factory=list) # which it surely doesn't write (used only by loads' addresses)
    vars: list[UOp] = field(default_factory=list)      # DEFINE_VARs passed after the buffers
    global_size: int = 1                               # extent of the parallel (outermost) loop
    estimates: Estimates = field(default_factory=Estimates)
    applied_opts: tuple = ()                           # optimizations applied, for DEBUG=3 and BEAM
    ast: UOp | None = None
    function_name: str = ""                            # the symbol in the binary, when it isn't `name`
    global_dims: tuple = ()                            # GPU-style: work-groups per launch dimension (dim 0 first)
    local_dims: tuple = ()                             # GPU-style: work-items per group along each dimension
    quick: bool = False                                # a first run's program that rolled loops (get_program)

    def __post_init__(self) -> None:
        if not self.function_name: self.function_name = self.name

@dataclass(frozen=True)
class TensorCore:
    """A warp-level matrix multiply-accumulate instruction D = A @ B + C (A: M x K, B: K x N, C and D: M x N) as
    data: what the TC opt needs to lay a kernel's loops out for it, the renderer to write it and the PYTHON device to
    emulate it. `threads` lanes execute it together, each holding some elements of every operand in registers.

    `layout` says which element each lane holds, for A, B and C (D as C), each as (row weights, col weights,
    elements): lane l's element i is at row `sum(w for bit b of l set) + elements[i][0]` and col likewise with the
    col weights and elements[i][1] (every tensor core we know lays its lanes out along bit fields of the lane id)."""
    name: str                       # the instruction (CUDA: the PTX mma.sync it renders)
    dims: tuple[int, int, int]      # (M, N, K)
    dtype_in: DType                 # A's and B's
    dtype_out: DType                # C's and D's
    device: str
    layout: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]], ...]
    threads: int = 32

    def __post_init__(self) -> None:
        m, n, k = self.dims
        if len(self.layout) != 3: raise ValueError(f"tensor core {self.name}: a layout for A, B and C, got "
                                                   f"{len(self.layout)}")
        bits = self.threads.bit_length() - 1
        if self.threads != 1 << bits: raise ValueError(f"tensor core {self.name}: {self.threads} threads")
        for which, (rows, cols), lay in zip("ABC", ((m, k), (k, n), (m, n)), self.layout):
            if len(lay[0]) != bits or len(lay[1]) != bits:
                raise ValueError(f"tensor core {self.name}: {which}'s lane weights need one per bit of the lane id")
            held = sorted(self.coords(which, lane, i) for lane in range(self.threads) for i in range(len(lay[2])))
            if held != list(itertools.product(range(rows), range(cols))):
                raise ValueError(f"tensor core {self.name}: the lanes' {which} elements aren't each of its "
                                 f"{rows}x{cols} elements once")

    def elements(self, which: str) -> int:
        """How many elements of operand `which` ("A", "B" or "C") each lane holds."""
        return len(self.layout["ABC".index(which)][2])

    def coords(self, which: str, lane: int, i: int) -> tuple[int, int]:
        """(row, col) of element `i` of operand `which` ("A", "B" or "C") that lane `lane` holds."""
        rows, cols, elems = self.layout["ABC".index(which)]
        r = sum(w for b, w in enumerate(rows) if lane >> b & 1) + elems[i][0]
        return r, sum(w for b, w in enumerate(cols) if lane >> b & 1) + elems[i][1]

    @property
    def wmma_arg(self) -> tuple:
        """The arg of the WMMA UOp of this instruction: plain literals (the PYTHON listing parses them back)."""
        return (self.name, self.dims, self.dtype_in.name, self.dtype_out.name, self.device, self.threads, self.layout)

    @staticmethod
    def from_wmma_arg(arg: tuple) -> TensorCore:
        from fusegrad.dtype import DTYPES_DICT
        by_name = {dt.name: dt for dt in DTYPES_DICT.values()}
        name, dims, din, dout, device, threads, layout = arg
        return TensorCore(name, tuple(dims), by_name[din], by_name[dout], device, layout, threads)

def transpose_network(w: int) -> list[list[tuple[int, int, int, list[int]]]]:
    """The transpose in registers of a w x w block held as w row vectors (w a power of two): log2(w) steps of
    two-vector shuffles, each step a list of (row it makes, its first and second vector's rows, the lanes it takes:
    the second vector's numbered after the first's). The step of size b swaps, in every 2b x 2b block, the top-right
    and bottom-left b x b blocks; after the last the rows are the columns."""
    steps = []
    b = w // 2
    while b:
        step = []
        for r in range(w):
            if r & b: continue
            step.append((r, r, r + b, [j if not j & b else w + j - b for j in range(w)]))
            step.append((r + b, r, r + b, [j + b if not j & b else w + j for j in range(w)]))
        steps.append(step)
        b //= 2
    return steps

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
    supports_prefetch: bool = False  # renders PREFETCH (codegen/prefetch.py)
    transposed_copy: bool = False   # renders TRANSPOSED_COPY of blocks of its vectors' width (a PACK that transposes)
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
    slow_float64: bool = False      # float64 is far slower than float32 (a GPU's): exp of float32 is float32 math
    tensor_cores: list[TensorCore] = []  # warp matrix instructions the TC opt may use (see TensorCore)
    def render(self, uops: list[UOp], name: str) -> str: raise NotImplementedError
