"""The CPU device: C rendered by ClangRenderer, compiled by the system C compiler into a shared object, loaded with
ctypes and called on host memory. Kernels are queued on a thread pool written in C and run while Python goes on (host
access to a buffer waits for the kernels using it); one kernel can be split across cores by running disjoint ranges
of its outermost loop on several threads.

Its parts: cpu_memory.py (the allocator), cpu_compiler.py (C -> shared objects), cpu_pool.py and cpu_pool.c (the
thread pools), cpu_program.py (a loaded kernel and its calls)."""
from __future__ import annotations
import ctypes
import functools
from typing import Any
from fusegrad.device import Compiled
from fusegrad.helpers import CPU_THREADS, DEBUG
from fusegrad.hostcpu import host_cpu_count
from fusegrad.runtime.cpu_compiler import CPUCompiler, TieredCompiler
from fusegrad.runtime.cpu_memory import CPUAllocator
from fusegrad.runtime.cpu_pool import build_pool_in_background, c_pool
from fusegrad.runtime.cpu_program import CPUProgram

class TieredCPUProgram(CPUProgram):
    """A CPUProgram whose code can be replaced by an optimized build of the same kernel (`upgrade`)."""
    def upgrade(self, lib: bytes, name: str | None = None) -> None:
        """Run the kernel from the shared object `lib` from now on: the same source compiled with other flags, or
        (`name`: its function) the kernel's full program where this one is its quick program, which computes the same
        bits over the same split of its outermost loop (codegen/lower.py lower_kernel). A quick binary's entry point
        forwards to the new one (cpu_compiler.forwarding), for callers that kept its address; every binary stays
        loaded as long as this program, since a queued job may still run any of them."""
        old_dll, old_fxn, old_entry, old_name = self._dll, self.fxn, self._entry, self.name
        kept = getattr(self, "_kept", [])
        try: fxn = self._load(name or old_name, lib)   # (sets _dll and _entry to the new binary's)
        except Exception:
            self._dll, self._entry = old_dll, old_entry
            raise
        fxn.restype, fxn.argtypes = None, old_fxn.argtypes
        if old_entry is not None and self._entry is not None:
            try: ctypes.c_void_p.in_dll(old_dll, f"{old_name}_next").value = self._entry
            except ValueError: pass   # (a binary without forwarding: its callers go on running it)
        self._kept = [*kept, old_dll]
        self.fxn, self.name = fxn, name or old_name

class CPUDevice(Compiled):
    """The host CPU."""
    def __init__(self, device: str = "CPU"):
        super().__init__(device, CPUAllocator(), None, None, TieredCPUProgram)
        build_pool_in_background(self)

    @functools.cached_property
    def tiered(self) -> TieredCompiler:
        """New kernels compiled quickly first, then optimized in the background (see TieredCompiler)."""
        return TieredCompiler(self.compiler)

    @functools.cached_property
    def renderer(self) -> Any:
        # imported on first use: the renderer depends on codegen, which shouldn't load just to allocate memory
        from fusegrad.renderer.cstyle import ClangRenderer
        return ClangRenderer()

    @functools.cached_property
    def compiler(self) -> CPUCompiler:
        try: flags = getattr(self.renderer, "compile_flags", None)
        except ImportError:
            if DEBUG >= 1: print("CPU: no ClangRenderer yet, compiling with the default flags")
            flags = None
        return CPUCompiler(flags)

    def synchronize(self) -> None:
        """Wait until every kernel queued so far (on any CPU device: they share one queue) has run."""
        if (pool := c_pool()) is not None: pool.wait()

    @property
    def max_threads(self) -> int:
        return int(CPU_THREADS.value) if CPU_THREADS.value > 0 else self._ncpu

    @functools.cached_property
    def _ncpu(self) -> int: return host_cpu_count()
