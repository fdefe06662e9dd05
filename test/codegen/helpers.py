"""Test helpers: build kernel ASTs by hand and run their C with ctypes on numpy arrays."""
from __future__ import annotations
import atexit
import copy
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import numpy as np
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import Context
from fusegrad.renderer import ProgramSpec
from fusegrad.renderer.cstyle import ClangRenderer
from fusegrad.uop.ops import Ops, UOp

RENDERER = ClangRenderer()
_CACHE_DIR = tempfile.mkdtemp(prefix="fusegrad_codegen_test_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
_libs: dict[str, ctypes.CDLL] = {}

# the vector facts of the two x86 machines the heuristics are tuned for: (SIMD register bytes, vector registers)
AVX512, AVX2 = (64, 32), (32, 16)

def renderer_like(facts: tuple[int, int]) -> ClangRenderer:
    """The CPU renderer as it is on a machine with these vector facts (`AVX512`, `AVX2`), for the opts the heuristics
    choose there: its kernels are rendered, never compiled here."""
    ren = copy.copy(RENDERER)
    ren.simd_bytes, ren.vector_registers = facts
    return ren

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)
def rng(end: int | UOp, axis: int, kind: str = "loop") -> UOp: return UOp.range(end, axis, kind)
def reduce(src: UOp, *rngs: UOp, op: Ops = Ops.ADD) -> UOp: return UOp(Ops.REDUCE, src.dtype, (src, *rngs), op)

def compile_src(src: str, name: str) -> ctypes.CDLL:
    key = hashlib.sha256(src.encode()).hexdigest()[:20]
    if key in _libs: return _libs[key]
    c_path, so_path = os.path.join(_CACHE_DIR, f"{key}.c"), os.path.join(_CACHE_DIR, f"{key}.so")
    with open(c_path, "w") as f: f.write(src)
    # the runtime's flags, at -O2 to keep the tests fast
    flags = [f if f != "-O3" else "-O2" for f in RENDERER.compile_flags]
    subprocess.run(["cc", *flags, "-shared", "-fPIC", "-o", so_path, c_path, "-lm"], check=True, capture_output=True,
                   text=True)
    _libs[key] = ctypes.CDLL(so_path)
    return _libs[key]

def compile_program(p: ProgramSpec):
    return getattr(compile_src(p.src, p.name), p.function_name)

def call(p: ProgramSpec, bufs: list[np.ndarray], var_vals: dict[str, int] | None = None,
         splits: list[tuple[int, int]] | None = None) -> None:
    """Run program `p` on `bufs` (indexed by DEFINE_GLOBAL arg) once per [lo, hi) of `splits` (default: all)."""
    fn = compile_program(p)
    args = [ctypes.c_void_p(bufs[i].ctypes.data) for i in p.globals]
    args += [ctypes.c_long((var_vals or {})[v.arg[0]]) for v in p.vars]
    gs = p.global_size if isinstance(p.global_size, int) else \
        int(p.global_size.substitute({v: v.const_like((var_vals or {})[v.arg[0]]) for v in p.vars}))
    for lo, hi in (splits or [(0, gs)]): fn(*args, ctypes.c_long(lo), ctypes.c_long(hi))

def run(ast: UOp, bufs: list[np.ndarray], var_vals: dict[str, int] | None = None, opts: list[Opt] | None = None,
        noopt: bool = False, splits: list[tuple[int, int]] | None = None) -> ProgramSpec:
    """Compile `ast` (optimized unless `noopt`, or with explicit `opts`) and run it in place on `bufs`."""
    with Context(NOOPT=int(noopt)): p = get_program(ast, RENDERER, opts=opts)
    call(p, bufs, var_vals, splits)
    return p

def matmul_ast(M: int, N: int, K: int, dt: DType = dtypes.float32) -> UOp:
    g0, g1, g2 = glob(0, dt, M * N), glob(1, dt, M * K), glob(2, dt, K * N)
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    acc = reduce(g1.index(r0 * K + r2).load() * g2.index(r2 * N + r1).load(), r2)
    return UOp.sink_of(g0.index(r0 * N + r1).store(acc))

def captured_asts(monkeypatch) -> list[UOp]:
    """The ASTs of the kernels compiled from now on (in the order code generation gets them)."""
    import fusegrad.codegen as codegen
    seen: list[UOp] = []
    plain = codegen.get_program
    def record(ast, renderer, name=None, opts=None, quick=False):
        seen.append(ast)
        return plain(ast, renderer, name, opts, quick)
    monkeypatch.setattr(codegen, "get_program", record)
    return seen

def register_tile(ast: UOp, facts: tuple[int, int]) -> tuple[int, int | None]:
    """(the register tile's lanes: the product of the upcast amounts, the SIMD axis's lanes) of the CPU heuristic's
    kernel for `ast` on a target of `facts` (AVX2, AVX512)."""
    from fusegrad.codegen.lower import choose_vector_axis
    from fusegrad.codegen.opt import Kernel
    from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
    ren = renderer_like(facts)
    k = Kernel(ast, ren)
    hand_coded_optimizations(k)
    vec = choose_vector_axis(k.get_optimized_ast(), ren)
    lanes = 1
    for r in k.expanded:
        if r.arg[1] == "upcast": lanes *= r.src[0].arg
    return lanes, (vec.src[0].arg if vec is not None else None)

def conv_grads(x: np.ndarray, w: np.ndarray, stride: int, padding: int, rng: np.random.Generator) \
        -> tuple[list[np.ndarray], list[np.ndarray]]:
    """conv2d(x, w), and the gradients into x and w of sum(conv2d(x, w) * g) for a random g (from `rng`): fusegrad's
    and torch's."""
    import torch
    from fusegrad import Tensor
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tout = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=padding)
    g = rng.standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(g)).sum().backward()
    assert tx.grad is not None and tw.grad is not None
    fx, fw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    fout = fx.conv2d(fw, stride=stride, padding=padding)
    (fout * Tensor(g)).sum().backward()
    assert fx.grad is not None and fw.grad is not None
    return [fout.numpy(), fx.grad.numpy(), fw.grad.numpy()], [tout.detach().numpy(), tx.grad.numpy(), tw.grad.numpy()]
