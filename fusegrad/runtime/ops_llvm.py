"""The LLVM device: the host CPU, with kernels rendered to LLVM IR (LLVMRenderer) and compiled in process by llvmlite
into object code, which is loaded into memory by LLVM's MCJIT and called through ctypes. It shares host memory with
the CPU device (copies between the two are plain host copies) and splits kernels across cores the same way.

Compiling a kernel takes milliseconds (no compiler process to start), which matters for programs with many kernels."""
from __future__ import annotations
import ctypes
import ctypes.util
import functools
import struct
import threading
import weakref
from typing import Any
from fusegrad.device import CompileError, Compiler, numbered
from fusegrad.helpers import getenv
from fusegrad.runtime.cpu_memory import CPUAllocator
from fusegrad.runtime.cpu_program import CPUProgram
from fusegrad.runtime.elf import ET_REL, elf_is_whole
from fusegrad.runtime.ops_cpu import CPUDevice

MISSING = "the LLVM device needs llvmlite: pip install 'fusegrad[llvm]'"

def _llvm() -> Any:
    """llvmlite.binding, initialized for the host (once)."""
    try: import llvmlite.binding as llvm
    except ImportError as e: raise ImportError(MISSING) from e
    return _init(llvm)

@functools.cache
def _init(llvm: Any) -> Any:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    # kernels call libm (exp2f, sinf, ...; LLVM lowers its math intrinsics to them) and, for some half conversions
    # without a CPU instruction, the compiler runtime (__truncdfhf2): the JIT resolves symbols in these
    for lib in ("m", "gcc_s"):
        if (path := ctypes.util.find_library(lib)) is not None:
            try: llvm.load_library_permanently(path)
            except RuntimeError: pass
    return llvm

@functools.cache
def _host() -> tuple[str, str, str]:
    """(target triple, CPU name, CPU features) of this machine."""
    llvm = _llvm()
    return llvm.get_process_triple(), llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()

def _target_machine(opt: int, jit: bool = False) -> Any:
    llvm = _llvm()
    triple, cpu, features = _host()
    return llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=opt, reloc="pic",
                                                                 codemodel="jitdefault" if jit else "default",
                                                                 jit=jit)

# llvmlite's global state (the context modules are parsed into, pass builders) isn't safe to use from several threads.
# Every use holds this lock, and so does every disposal: an object freed by the garbage collector on another thread
# would otherwise delete from the global context while a compile thread parses into it. Reentrant, because a collection
# can run a finalizer on a thread that already holds it (between two llvmlite calls, where that is safe).
_lock = threading.RLock()

def _close_locked(lock: Any, obj: Any) -> None:
    """Dispose of a llvmlite object under `lock` (a finalizer's: given everything it uses, since this module's globals
    may be gone when it runs)."""
    with lock: obj.close()

class LLVMCompiler(Compiler):
    """LLVM IR text -> object file bytes (ELF for the host), for the host CPU's features (AVX2, AVX-512 where present).

    `opt` (LLVMOPT, default 2): 2 and 3 run LLVM's standard -O2/-O3 pipelines (which also vectorize and unroll loops
    themselves); 1 runs a short pipeline of the passes our kernels need (promoting accumulators to registers, folding,
    CSE, CFG cleanup: the optimizer has already vectorized, unrolled and hoisted) with full machine code optimization,
    about twice as fast to compile; 0 runs the short pipeline and the fast instruction selector (slow code)."""
    def __init__(self, opt: int | None = None):
        llvm = _llvm()
        self.opt = int(getenv("LLVMOPT", 2) if opt is None else opt)
        if self.opt not in (0, 1, 2, 3): raise ValueError(f"LLVM optimization level must be 0..3, got {self.opt}")
        import llvmlite
        triple, cpu, features = _host()
        self.tm = _target_machine(max(self.opt, 2) if self.opt else 0)
        super().__init__(f"llvmlite {llvmlite.__version__} LLVM {'.'.join(map(str, llvm.llvm_version_info))}|"
                         f"{triple}|{cpu}|{features}|O{self.opt}")

    def _optimize(self, llvm: Any, mod: Any) -> None:
        """Run the pass pipeline of this level on `mod` (under the lock; its objects are freed before it returns)."""
        tuning = llvm.create_pipeline_tuning_options(speed_level=max(self.opt, 1))
        pb = llvm.create_pass_builder(self.tm, tuning)
        mpm = pb.getModulePassManager() if self.opt >= 2 else llvm.create_new_module_pass_manager()
        try:
            if self.opt < 2:
                for add in (mpm.add_always_inliner_pass, mpm.add_sroa_pass, mpm.add_instruction_combine_pass,
                            mpm.add_simplify_cfg_pass, mpm.add_new_gvn_pass, mpm.add_instruction_combine_pass,
                            mpm.add_loop_rotate_pass, mpm.add_simplify_cfg_pass): add()
            mpm.run(mod, pb)
        finally:
            for obj in (mpm, pb, tuning): obj.close()

    def compile(self, src: str) -> bytes:
        llvm = _llvm()
        with _lock:
            try:
                mod = llvm.parse_assembly(src)
                mod.verify()
            except RuntimeError as e:
                raise CompileError(f"invalid LLVM IR: {e}\n--- source ---\n{numbered(src)}") from e
            try:
                mod.triple, mod.data_layout = _host()[0], str(self.tm.target_data)
                self._optimize(llvm, mod)
                return bytes(self.tm.emit_object(mod))
            finally: mod.close()   # (here, under the lock: left to the collector it would be freed after the lock)

    def validate(self, lib: bytes) -> bool: return elf_is_whole(lib, ET_REL)

def undefined_symbols(obj: bytes) -> list[str]:
    """The names an ELF64 little-endian relocatable object needs from outside (its undefined symbols)."""
    if obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1: raise ValueError("not an ELF64 little-endian object")
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for sec in sections:
        if sec[1] != 2: continue   # SHT_SYMTAB
        stroff = sections[sec[6]][4]
        for k in range(sec[5] // 24):
            st_name, _, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", obj, sec[4] + k * 24)
            if shndx == 0 and st_name:
                end = obj.index(b"\0", stroff + st_name)
                out.append(obj[stroff + st_name:end].decode())
    return out

class LLVMProgram(CPUProgram):
    """A kernel loaded from object bytes into its own MCJIT engine; called (and split across threads) as CPUProgram.
    The engine, which owns the code's memory, is freed when the program is dropped."""
    def _load(self, name: str, lib: bytes) -> Any:
        llvm = _llvm()
        with _lock:
            # MCJIT aborts the process on a symbol it can't resolve, so check them first and raise instead
            if missing := [s for s in undefined_symbols(lib) if not llvm.address_of_symbol(s)]:
                raise RuntimeError(f"kernel {name} needs symbols this process doesn't have: {', '.join(missing)}")
            host = llvm.parse_assembly("")
            host.triple = _host()[0]
            engine = llvm.create_mcjit_compiler(host, _target_machine(2, jit=True))   # owns the target machine
            engine.add_object_file(llvm.ObjectFileRef.from_data(lib))
            engine.finalize_object()
            addr = engine.get_function_address(name)
        # the engine is closed under the lock (see _lock) when this program is dropped; at exit the OS takes the memory
        # back, so the finalizer doesn't run then
        weakref.finalize(self, _close_locked, _lock, engine).atexit = False
        if not addr: raise RuntimeError(f"the object code has no function {name!r}")
        self._engine = engine
        return ctypes.CFUNCTYPE(None)(addr)

class LLVMDevice(CPUDevice):
    """The host CPU, compiling LLVM IR in process."""
    def __init__(self, device: str = "LLVM"):
        _llvm()   # fail here, with a clear message, when llvmlite is missing
        super(CPUDevice, self).__init__(device, CPUAllocator(), None, None, LLVMProgram)

    @functools.cached_property
    def renderer(self) -> Any:
        from fusegrad.renderer.llvmir import LLVMRenderer
        return LLVMRenderer()

    @functools.cached_property
    def compiler(self) -> LLVMCompiler: return LLVMCompiler()   # type: ignore[override]
