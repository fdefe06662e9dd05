"""Tensor cores on a machine with an NVIDIA GPU of sm_80 or later (run by test/gpu/check.sh):

1. half, bfloat16 and TF32 (ALLOW_TF32=1) matmuls, a batched one, and a padded half convolution with a bias and relu,
   run on the CUDA device through the TC opt (each kernel checked to hold WMMAs), against numpy in float32 and
   against the PYTHON device's emulation of the same kernels (the lane layouts: a layout that the emulation and the
   code generator share but the hardware doesn't would show here first);
2. kernels whose operands the heuristic stages through shared memory (LTILE after TC: half, bfloat16, TF32, a batched
   matmul with a transposed operand, a padded convolution, views starting at odd elements, whose 16-byte copies fall
   back to one load per element, a group of 8 warps whose double-buffered copies take 57 KiB of dynamic shared
   memory) against numpy and against the same kernels unstaged (TC_STAGE=0), single-buffered (DOUBLE_BUFFER=0) and
   copied element by element (VECTOR_COPY_BYTES=0), which must all give the same bits (the same WMMAs in the same
   order), and to the same kernels rendered with fragments loaded element by element rather than by ldmatrix
   (the CUDA renderer's ldmatrix=False) and with 32- and 64-bit indices (index32=True, False); the 16-bit staged
   kernels checked to load their fragments by ldmatrix;
3. the time of a 4096 half matmul with tensor cores, staged and not, staged without ldmatrix and with 64-bit
   indices, and without tensor cores (the heuristic's opts without TC: its float32-style tiles), printed in TFLOP/s
   with each kernel's registers, not checked."""
from __future__ import annotations
import copy
import sys
import numpy as np
from fusegrad import Device, Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import OptOps, heuristic_gpu, tc
from fusegrad.device import Buffer
from fusegrad.dtype import DType
from fusegrad.engine import realize
from fusegrad.engine.realize import CompiledRunner
from fusegrad.helpers import Context
from fusegrad.renderer.cuda import CUDARenderer
from fusegrad.renderer.python import PythonRenderer
from fusegrad.uop.ops import Ops

failed = 0

def check(name: str, ok: bool, detail: str = "") -> None:
    global failed
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    failed += not ok

def data(shape: tuple[int, ...], dt: DType, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return Tensor(x, device="CPU").cast(dt).cast(dtypes.float32).numpy()   # (values exact in dt)

def run(fn, arrays: list[np.ndarray], dts: list[DType], device: str) -> tuple[np.ndarray, list]:
    ts = [Tensor(a, device=device).cast(dt).realize() for a, dt in zip(arrays, dts)]
    out = fn(*ts).cast(dtypes.float32).numpy()
    progs = [get_program(si.ast, Device[device].renderer) for si in fn(*ts).schedule() if si.ast.op is Ops.SINK]
    return out, progs

cuda = Device["CUDA"]
print("CUDA", cuda.arch, "tensor cores:", [tc.name for tc in cuda.renderer.tensor_cores])
Device["PYTHON"].renderer = PythonRenderer(like=cuda.renderer)
f32 = lambda t: t.cast(dtypes.float32)
cases = [
    ("half matmul 32x64 @ 64x64", lambda a, b: a @ b, [(32, 64), (64, 64)], [dtypes.half] * 2, 1e-2, False),
    ("bfloat16 matmul 64x32 @ 32x32", lambda a, b: a @ b, [(64, 32), (32, 32)], [dtypes.bfloat16] * 2, 1e-2, False),
    ("half matmul, float32 out, 16x256 @ 256x32", lambda a, b: f32(a) @ f32(b), [(16, 256), (256, 32)],
     [dtypes.half] * 2, 1e-5, False),
    ("batched half matmul 3x32x48 @ 3x48x16", lambda a, b: f32(a) @ f32(b), [(3, 32, 48), (3, 48, 16)],
     [dtypes.half] * 2, 1e-5, False),
    ("padded half convolution with bias and relu",
     lambda x, w, b: f32(x).conv2d(f32(w), b, padding=1).relu(), [(1, 16, 16, 16), (8, 16, 3, 3), (8,)],
     [dtypes.half, dtypes.half, dtypes.float32], 1e-5, False),
    ("TF32 matmul 32x64 @ 64x32", lambda a, b: a @ b, [(32, 64), (64, 32)], [dtypes.float32] * 2, 3e-3, True),
]
for i, (name, fn, shapes, dts, rtol, tf32) in enumerate(cases):
    arrays = [data(s, dt, 10 * i + j) for j, (s, dt) in enumerate(zip(shapes, dts))]
    with Context(ALLOW_TF32=int(tf32)):
        got, progs = run(fn, arrays, dts, "CUDA")
        emulated, _ = run(fn, arrays, dts, "PYTHON")
    # (the reference on the CPU: the default device of a machine with a GPU is CUDA)
    want = fn(*[Tensor(a, device="CPU") for a in arrays]).numpy()
    scale = float(np.abs(want).max())
    wmma = [p for p in progs if any(u.op is Ops.WMMA for u in p.uops)]
    check(name + ": WMMA kernel", len(wmma) == 1, str([p.applied_opts[:1] for p in progs]))
    check(name + ": against numpy", bool(np.abs(got - want).max() <= rtol * scale),
          f"max error {np.abs(got - want).max() / scale:.2e} of the largest value")
    check(name + ": against the PYTHON emulation", bool(np.abs(got - emulated).max() <= rtol * scale),
          f"max difference {np.abs(got - emulated).max() / scale:.2e}")

# *** operands staged through shared memory (LTILE after TC): against numpy, and equal to the same kernel unstaged
# (TC_STAGE=0: the same WMMAs in the same order) ***
staged_cases = [
    ("half matmul 256x512 @ 512x192", lambda a, b: a @ b, [(256, 512), (512, 192)], [dtypes.half] * 2, 1e-2, False),
    ("bfloat16 matmul, float32 out, 128x1024 @ 1024x256", lambda a, b: f32(a) @ f32(b), [(128, 1024), (1024, 256)],
     [dtypes.bfloat16] * 2, 1e-5, False),
    ("batched half matmul, A transposed, 4x256x128 @ 4x256x64",
     lambda a, b: f32(a).transpose(1, 2) @ f32(b), [(4, 256, 128), (4, 256, 64)], [dtypes.half] * 2, 1e-5, False),
    ("padded half convolution 64->32 channels with bias and relu",
     lambda x, w, b: f32(x).conv2d(f32(w), b, padding=1).relu(), [(2, 64, 16, 16), (32, 64, 3, 3), (32,)],
     [dtypes.half, dtypes.half, dtypes.float32], 1e-5, False),
    ("TF32 matmul 256x256 @ 256x128", lambda a, b: a @ b, [(256, 256), (256, 128)], [dtypes.float32] * 2, 3e-3, True),
    # (views starting at odd elements, rows of odd lengths: the 16-byte copies fall back to one load per element)
    ("half matmul of unaligned views 256x512 @ 512x192", lambda a, b: a[1:257, 3:515] @ b[1:513, 5:197],
     [(258, 519), (515, 203)], [dtypes.half] * 2, 1e-2, False),
    ("TF32 matmul of unaligned views 128x256 @ 256x128", lambda a, b: a[1:129, 1:257] @ b[2:258, 3:131],
     [(130, 259), (260, 133)], [dtypes.float32] * 2, 3e-3, True),
    # (4x2 warps of 4x8 tiles, double-buffered: 57 KiB of dynamic shared memory)
    ("half matmul 512x256 @ 256x256 in dynamic shared memory", lambda a, b: a @ b, [(512, 256), (256, 256)],
     [dtypes.half] * 2, 1e-2, False),
]

def variant(fn, arrays, dts, **values) -> tuple[np.ndarray, list]:
    """`run` on CUDA with the heuristic's or the staging's constants set to `values` (the kernels compiled afresh)."""
    old = {k: getattr(tc if hasattr(tc, k) else heuristic_gpu, k) for k in values}
    for k, v in values.items(): setattr(tc if hasattr(tc, k) else heuristic_gpu, k, v)
    realize.method_cache.clear()
    try: return run(fn, arrays, dts, "CUDA")
    finally:
        for k, v in old.items(): setattr(tc if hasattr(tc, k) else heuristic_gpu, k, v)
        realize.method_cache.clear()

def rendered(fn, arrays, dts, **attrs) -> tuple[np.ndarray, list]:
    """`run` on CUDA with the CUDA renderer's attributes set to `attrs` (the kernels compiled afresh)."""
    old = {k: getattr(cuda.renderer, k) for k in attrs}
    for k, v in attrs.items(): setattr(cuda.renderer, k, v)
    realize.method_cache.clear()
    try: return run(fn, arrays, dts, "CUDA")
    finally:
        for k, v in old.items(): setattr(cuda.renderer, k, v)
        realize.method_cache.clear()

for i, (name, fn, shapes, dts, rtol, tf32) in enumerate(staged_cases):
    arrays = [data(s, dt, 100 + 10 * i + j) for j, (s, dt) in enumerate(zip(shapes, dts))]
    big = dict(TC_WARPS=(4, 2), TC_MIN_GROUPS=1, TC_MIN_WARPS=1) if "dynamic" in name else {}
    with Context(ALLOW_TF32=int(tf32)):
        got, progs = variant(fn, arrays, dts, **big)
        unstaged, plain = variant(fn, arrays, dts, TC_STAGE=0, **big)
        # (copies element by element and single-buffered: the same WMMAs in the same order)
        for values in (dict(DOUBLE_BUFFER=0), dict(VECTOR_COPY_BYTES=0)):
            other, _ = variant(fn, arrays, dts, **values, **big)
            check(f"{name}: the same with {values}", bool(np.array_equal(got, other)),
                  f"max difference {np.abs(got - other).max():.2e}")
        # (fragments loaded element by element, indices in 32 or 64 bits: the same loads, the same WMMAs)
        for attrs in (dict(ldmatrix=False), dict(index32=True), dict(index32=False)):
            other, _ = rendered(fn, arrays, dts, **attrs)
            check(f"{name}: the same with the renderer's {attrs}", bool(np.array_equal(got, other)),
                  f"max difference {np.abs(got - other).max():.2e}")
    if not tf32: check(name + ": fragments loaded by ldmatrix", any("ldmatrix.sync" in p.src for p in progs))
    if big: check(name + ": dynamic shared memory", any("extern __shared__" in p.src for p in progs))
    want = fn(*[Tensor(a, device="CPU") for a in arrays]).numpy()
    scale = float(np.abs(want).max())
    staged = [p for p in progs if any(u.op is Ops.WMMA for u in p.uops) and
              any(o.op is OptOps.LTILE for o in p.applied_opts)]
    check(name + ": staged WMMA kernel", len(staged) == 1, str([p.applied_opts for p in progs]))
    check(name + ": unstaged with TC_STAGE=0", not any(o.op is OptOps.LTILE for p in plain for o in p.applied_opts))
    check(name + ": against numpy", bool(np.abs(got - want).max() <= rtol * scale),
          f"max error {np.abs(got - want).max() / scale:.2e} of the largest value")
    check(name + ": the same as unstaged", bool(np.array_equal(got, unstaged)),
          f"max difference {np.abs(got - unstaged).max() / scale:.2e}")

# *** speed (printed) ***
n = 4096
a = Tensor.rand(n, n, device="CUDA").cast(dtypes.half).realize()
b = Tensor.rand(n, n, device="CUDA").cast(dtypes.half).realize()
ast = [si.ast for si in (a @ b).schedule() if si.ast.op is Ops.SINK][-1]
class WithoutTensorCores(CUDARenderer):
    tensor_cores: list = []   # (the heuristic's choice where there are none)

bufs = [Buffer("CUDA", n * n, dtypes.half).ensure_allocated() for _ in range(3)]
def renderer_with(**attrs) -> CUDARenderer:
    ren = copy.copy(cuda.renderer)
    for k, v in attrs.items(): setattr(ren, k, v)
    return ren

for label, ren, stage in (("with tensor cores, staged", cuda.renderer, 1), ("with tensor cores", cuda.renderer, 0),
                          ("with tensor cores, staged, without ldmatrix",
                           renderer_with(ldmatrix=False), 1),
                          ("with tensor cores, staged, 64-bit indices",
                           renderer_with(index32=False), 1),
                          ("without", WithoutTensorCores(cuda.arch), 1)):
    heuristic_gpu.TC_STAGE = stage
    try: prog = get_program(ast, ren)
    finally: heuristic_gpu.TC_STAGE = 1
    assert any(o.op is OptOps.TC for o in prog.applied_opts) == label.startswith("with "), prog.applied_opts
    if label.startswith("with "):
        assert any(o.op is OptOps.LTILE for o in prog.applied_opts) == bool(stage), prog.applied_opts
    r = CompiledRunner(prog)
    r(bufs, {}, wait=True)
    times = [r(bufs, {}, wait=True) or 0.0 for _ in range(5)]
    regs = r._prg.resources.registers if getattr(r._prg, "resources", None) else "?"
    print(f"{label}: {min(times) * 1e3:.2f} ms, {2 * n ** 3 / min(times) / 1e12:.1f} TFLOP/s, {regs} registers "
          f"({prog.name})")
print("check_tensor_cores:", "FAILED" if failed else "passed")
sys.exit(1 if failed else 0)
