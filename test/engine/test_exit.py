"""Interpreter shutdown is silent: finalizers of compiled programs don't depend on module globals, which teardown may
already have cleared, whatever order Python tears the modules down in."""
from __future__ import annotations
import gc
import os
import subprocess
import sys
import textwrap
from fusegrad.runtime import cpu_compiler, cpu_program

ALIAS_PROGRAM = textwrap.dedent("""
    import importlib, importlib.abc, importlib.machinery, importlib.util, sys

    class AliasLoader(importlib.abc.Loader):
        def __init__(self, real): self.real = real
        def create_module(self, spec): return importlib.import_module(self.real)
        def exec_module(self, module): pass

    class AliasFinder(importlib.abc.MetaPathFinder):
        # tinygrad.X is fusegrad.X: the same module objects reachable under a second package name
        def find_spec(self, name, path, target=None):
            if name != "tinygrad" and not name.startswith("tinygrad."): return None
            real = "fusegrad" + name[len("tinygrad"):]
            if importlib.util.find_spec(real) is None: return None
            return importlib.machinery.ModuleSpec(name, AliasLoader(real), is_package=True)

    sys.meta_path.insert(0, AliasFinder())
    from tinygrad import Tensor
    import tinygrad.runtime.ops_cpu, tinygrad.engine.realize, tinygrad.device, tinygrad.uop.ops
    outs = []
    # hundreds of distinct kernels, compiled in a few batches, most still alive at exit
    for n in range(1, 201):
        outs.append((Tensor.ones(3, n).contiguous() * (n % 7 + 2)).sum(1))
        if n % 100 == 0: Tensor.realize(*outs[-100:])
    assert outs[4].tolist() == [5 * 7.0] * 3
    print("done")
""")

def test_exit_is_silent_with_an_import_alias(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}  # an empty program cache: every kernel is compiled
    res = subprocess.run([sys.executable, "-c", ALIAS_PROGRAM], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"
    assert res.stderr == ""

def test_program_finalizer_needs_no_module_globals(monkeypatch):
    # what teardown does to a module: its globals become None. Dropping a program afterwards must not raise.
    lib = cpu_compiler.CPUCompiler().compile_cached("void k(float* restrict d, long lo, long hi) { d[0] = 1.0f; }")
    prg = cpu_program.CPUProgram("k", lib)
    raised: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: raised.append(u))
    for module in (cpu_compiler, cpu_program):
        for name in ("_ctypes", "ctypes", "weakref", "os"):
            if hasattr(module, name): monkeypatch.setattr(module, name, None)
    del prg
    gc.collect()
    assert raised == []
