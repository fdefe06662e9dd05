"""What the host CPU offers, read once from /proc/cpuinfo and the platform: its instruction set extensions, the SIMD
width and registers the C compiler targets with -march=native, the cores this process may run on, and a fingerprint
for caches whose contents only hold on this kind of CPU (-march=native binaries, kernel timings).

The code generators (renderer/cstyle.py, renderer/llvmir.py, renderer/python.py) read their vector facts here, so the
optimizer shapes the same kernels for every host device."""
from __future__ import annotations
import ctypes
import functools
import hashlib
import os
import platform
import sys
from dataclasses import dataclass, field
from fusegrad.dtype import DType, dtypes

X86_MACHINES = ("x86_64", "AMD64", "i386", "i686")

@functools.cache
def _cpuinfo() -> list[str] | None:
    """The lines of /proc/cpuinfo (None where there is none: not Linux, or not readable)."""
    try:
        with open("/proc/cpuinfo") as f: return f.read().splitlines()
    except OSError: return None

@dataclass(frozen=True)
class CPUFacts:
    """The host CPU as the code generators see it."""
    machine: str                     # platform.machine(): x86_64, aarch64, ...
    features: frozenset[str] = field(repr=False)  # instruction set extensions of the first core (cpuinfo "flags")
    simd_bytes: int                  # width of a SIMD register: 64 with AVX-512, 32 with AVX, else 16 (SSE, NEON)
    vector_registers: int            # SIMD registers: 32 with AVX-512 and on other architectures, 16 on x86 without
    has_fma: bool                    # fused multiply-add instructions (every non-x86 CPU we target has them)
    f16_lanes: int                   # lanes of the widest float->half vector conversion (F16C: 8, AVX-512: 16; 0: none)
    vector_dtypes: tuple[DType, ...]  # dtypes compiled code holds in SIMD vectors
    bf16_dot: bool = False           # AVX512_BF16's dot product of bfloat16 pairs (vdpbf16ps) on 512-bit vectors
    amx_bf16: bool = False           # AMX tiles with bfloat16 tile products (TDPBF16PS); see `amx_usable`
    # 512-bit FMAs at the rate of 256-bit ones, twice the lanes a cycle (AMD's Zen 5: family 26). Zen 4 (and Intel's
    # client cores) split them in two halves: the same lanes a cycle as 256 bits. Unknown CPUs count as split.
    full_rate_512: bool = False

    @property
    def x86(self) -> bool: return self.machine in X86_MACHINES

# the dtypes every host CPU's vectors hold (half is added where the CPU converts it, bfloat16 goes through integers)
_VECTOR_DTYPES = (dtypes.float32, dtypes.float64, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16,
                  dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64)

@functools.cache
def cpu() -> CPUFacts:
    """The host CPU's facts (read once per process)."""
    flags = next((frozenset(ln.split(":", 1)[1].split()) for ln in _cpuinfo() or () if ln.startswith("flags")),
                 frozenset())
    machine = platform.machine()
    x86 = machine in X86_MACHINES
    avx512 = x86 and "avx512f" in flags
    f16_lanes = (16 if avx512 else 8) if x86 and "f16c" in flags else 0
    def field_of(name: str) -> str: return next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() or ()
                                                 if ln.split(":", 1)[0].strip() == name), "")
    family = int(f) if (f := field_of("cpu family")).isdigit() else 0
    return CPUFacts(machine=machine, features=flags,
                    simd_bytes=(64 if avx512 else 32 if "avx2" in flags or "avx" in flags else 16) if x86 else 16,
                    vector_registers=32 if avx512 or not x86 else 16, has_fma="fma" in flags if x86 else True,
                    f16_lanes=f16_lanes, bf16_dot=avx512 and "avx512_bf16" in flags,
                    amx_bf16=x86 and {"amx_tile", "amx_bf16"} <= flags,
                    full_rate_512=avx512 and field_of("vendor_id") == "AuthenticAMD" and family >= 26,
                    vector_dtypes=_VECTOR_DTYPES + ((dtypes.float16,) if f16_lanes else ()) + (dtypes.bfloat16,))

ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158   # Linux x86-64

@functools.cache
def amx_usable() -> bool:
    """Whether this process may run AMX tile instructions: the CPU has them and Linux granted the process the tile
    data state (asked once per process: a process that never asked gets SIGILL on its first tile instruction; the
    permission covers all its threads and is inherited by forked children)."""
    if not (cpu().amx_bf16 and platform.machine() == "x86_64" and sys.platform.startswith("linux")): return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError): return False

@functools.cache
def fingerprint() -> str:
    """A digest of the CPU's model and features: code compiled with -march=native runs only on this kind of CPU, and
    timings only hold on it, so caches shared between machines tell them apart by it."""
    keep = ("model name", "flags", "Features", "CPU part")
    lines = [ln for ln in _cpuinfo() or () if ln.startswith(keep)]
    info = "\n".join(dict.fromkeys(lines)) or platform.processor()
    return hashlib.sha256(info.encode()).hexdigest()[:16]

def host_cpu_count() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

# The optimizer cuts a tiled matmul's outermost loop into this many pieces per core, and a CPU kernel split across
# threads runs such pieces as chunks that whichever thread is free claims (runtime/cpu_program.py _chunks). The calling
# thread runs Python between kernels and joins a kernel late: with one chunk per thread, the worker that finished its
# own then waited at the kernel's end for the caller's (the MLP Adam step under TinyJit: the worker idle ~240 us of a
# ~970 us step, ~65 us with four)
CHUNKS_PER_THREAD = 4
