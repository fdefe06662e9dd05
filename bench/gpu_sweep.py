"""Times the GPU heuristic's choices on a real GPU: each key kernel of bench_gpu.py built with the heuristic's
constants (codegen/opt/heuristic_gpu.py) set to several values, or with given opts, and timed alone (the device's
events, best of 5 after a warm-up), so a constant is chosen by measurement. Prints one line per variant, with the
registers per thread ptxas gave the kernel (and its stack frame where it has one: spilled registers).

Run on a machine with an NVIDIA GPU: python bench/gpu_sweep.py [--only matmul] [--device CUDA]
Without one, `--dry sm_90` renders and compiles each kernel (registers, no times); `--index32` renders a kernel's
indices in 32 bits where they all fit (the CUDA renderer's index32=True; by default only tensor-core kernels' are,
`--index64` none), and `--no-ldmatrix` loads tensor-core fragments element by element (ldmatrix=False)."""
from __future__ import annotations
import argparse
import contextlib
import itertools
import math
from typing import Iterator
import pathlib
import sys
from fusegrad import Device, Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.codegen.opt import heuristic_gpu, tc
from fusegrad.device import Buffer
from fusegrad.engine.realize import CompiledRunner
from fusegrad.runtime.ops_cuda import KernelResources, kernel_resources
from fusegrad.uop.ops import Ops, UOp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

@contextlib.contextmanager
def constants(**values) -> Iterator[None]:
    """The heuristic's constants (codegen/opt/heuristic_gpu.py) and the tensor cores' staging (codegen/opt/tc.py:
    VECTOR_COPY_BYTES, DOUBLE_BUFFER) set to `values` inside the block."""
    mods = {k: tc if hasattr(tc, k) and not hasattr(heuristic_gpu, k) else heuristic_gpu for k in values}
    old = {k: getattr(mods[k], k) for k in values}
    for k, v in values.items(): setattr(mods[k], k, v)
    try: yield
    finally:
        for k, v in old.items(): setattr(mods[k], k, v)

# (in channels, out channels, kernel, image side, stride) of ResNet-50's convolutions (bench_gpu.py's rows)
RESNET50_CONVS = ((64, 64, 3, 56, 1), (64, 256, 1, 56, 1), (256, 64, 1, 56, 1), (128, 128, 3, 28, 1),
                  (256, 256, 3, 14, 1), (512, 512, 3, 7, 1), (128, 128, 3, 56, 2))

def kernel_ast(t: Tensor) -> UOp:
    return [si.ast for si in t.schedule() if si.ast.op is Ops.SINK][-1]

# --dry: no GPU; each kernel rendered for CUDARenderer(DRY_ARCH) and compiled by NVRTC, not run
DRY_ARCH = ""
INDEX32: bool | None = None   # --index32 / --index64: the CUDA renderer's indices in 32 bits where they all fit
                              # in every kernel / none (default: in tensor-core kernels)
LDMATRIX = True  # --no-ldmatrix sets it False: tensor-core fragments loaded element by element

def resources(prog, lib: bytes) -> KernelResources | None:
    """The registers and stack frame of a CUDA program's kernel (None for another device's)."""
    return kernel_resources(lib).get(prog.function_name) if lib.startswith(b"\x7fELF") else None

def time_kernel(dev: str, ast: UOp, opts: list[Opt] | None = None) -> tuple[float, str, tuple, KernelResources | None]:
    """Best of 5 device-timed runs of the kernel (on fresh buffers of its globals' sizes), its name, opts, and its
    registers and stack frame where the device is CUDA."""
    if DRY_ARCH:
        from fusegrad.renderer.cuda import CUDARenderer
        from fusegrad.runtime.ops_cuda import CUDACompiler
        prog = get_program(ast, CUDARenderer(DRY_ARCH, local_bytes=227 * 1024, index32=INDEX32,
                                             ldmatrix=LDMATRIX), opts=opts)
        return math.nan, prog.name, tuple(prog.applied_opts), resources(prog, CUDACompiler(DRY_ARCH).compile(prog.src))
    prog = get_program(ast, Device[dev].renderer, opts=opts)
    sizes = {u.arg: u.dtype for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL}
    bufs = [Buffer(dev, sizes[i].size, sizes[i].base).ensure_allocated() for i in sorted(sizes)]
    r = CompiledRunner(prog)
    r(bufs, {}, wait=True)
    secs = min(r(bufs, {}, wait=True) or math.inf for _ in range(5))
    return secs, prog.name, tuple(prog.applied_opts), resources(prog, r.lib)

def report(label: str, secs: float, name: str, opts: tuple, res: KernelResources | None = None, flops: float = 0,
           nbytes: float = 0) -> None:
    rate = f"{flops / secs / 1e12:7.1f} TFLOP/s" if flops else f"{nbytes / secs / 1e9:7.0f} GB/s"
    # (registers per thread, machine instructions, and a stack frame's bytes where the kernel has one: spills)
    regs = "" if res is None else f" {res.registers:3d} regs {res.instructions:5d} instrs" + \
        (f" {res.frame_bytes}B frame" if res.frame_bytes else "")
    print(f"  {label:44s} {secs * 1e3:8.3f} ms {rate}{regs}  {name} {[(o.op.name, o.axis, o.arg) for o in opts]}",
          flush=True)

def sweep_key(dev: str, n: int) -> None:
    """The heuristic's kernel of each row of bench_gpu.py: matmuls in half, bfloat16 and float32, softmax and
    layernorm, ResNet-50's convolutions in half at batch 32."""
    print("key kernels (the heuristic's choices)")
    for dt in (dtypes.half, dtypes.bfloat16, dtypes.float32):
        ast = kernel_ast(Tensor.empty(n, n, dtype=dt, device=dev) @ Tensor.empty(n, n, dtype=dt, device=dev))
        report(f"matmul {n}^3 {dt.name}", *time_kernel(dev, ast), flops=2 * n ** 3)
    rows = 8192 if n >= 4096 else n
    x, w, b = Tensor.empty(rows, rows, device=dev), Tensor.empty(rows, device=dev), Tensor.empty(rows, device=dev)
    for name, t in (("softmax", x.softmax(-1)), ("layernorm", x.layernorm(-1) * w + b)):
        report(f"{name} {rows}x{rows}", *time_kernel(dev, kernel_ast(t)), nbytes=8.0 * rows * rows)
    for cin, cout, k, side, stride in RESNET50_CONVS:
        x = Tensor.empty(32, cin, side, side, dtype=dtypes.half, device=dev)
        w = Tensor.empty(cout, cin, k, k, dtype=dtypes.half, device=dev)
        out = (side + 2 * (k // 2) - k) // stride + 1
        report(f"conv2d b32 {cin}->{cout} {k}x{k} {side}x{side} s{stride}",
               *time_kernel(dev, kernel_ast(x.conv2d(w, stride=stride, padding=k // 2))),
               flops=2.0 * 32 * cout * out * out * cin * k * k)

def sweep_matmuls(dev: str, n: int, dts: tuple = (dtypes.half, dtypes.float32)) -> None:
    for dt in dts:
        ast = kernel_ast(Tensor.empty(n, n, dtype=dt, device=dev) @ Tensor.empty(n, n, dtype=dt, device=dev))
        print(f"matmul {n}^3 {dt.name}")
        if dt == dtypes.half:
            grid = itertools.product(((4, 4), (4, 8), (8, 4), (8, 8)), ((2, 2), (4, 2), (2, 4)), (1,))
            for tiles, warps, unroll in grid:
                with constants(TC_TILES=tiles, TC_WARPS=warps, TC_UNROLL=unroll):
                    try: report(f"TC_TILES={tiles} TC_WARPS={warps} TC_UNROLL={unroll}", *time_kernel(dev, ast),
                                flops=2 * n ** 3)
                    except Exception as e: print(f"  {tiles} {warps} {unroll}: {type(e).__name__}: {str(e)[:200]}")
        else:
            for inner, locs, block, unroll in itertools.product((0, 4), (8, 16), (16, 32), (4, 8)):
                with constants(TILE_INNER=inner, TILE_LOCALS=locs, LTILE_BLOCK=block, UNROLL_BY=unroll):
                    label = f"TILE_INNER={inner} TILE_LOCALS={locs} LTILE_BLOCK={block} UNROLL_BY={unroll}"
                    try: report(label, *time_kernel(dev, ast), flops=2 * n ** 3)
                    except Exception as e: print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")

def sweep_tc_unroll(dev: str) -> None:
    """TC_UNROLL on half matmuls of several sizes (the heuristic's tiles otherwise)."""
    for n in (512, 1024, 2048, 4096):
        ast = kernel_ast(Tensor.empty(n, n, dtype=dtypes.half, device=dev) @ Tensor.empty(n, n, dtype=dtypes.half,
                                                                                           device=dev))
        print(f"matmul {n}^3 half")
        for unroll in (1, 2, 4, 8):
            with constants(TC_UNROLL=unroll):
                try: report(f"TC_UNROLL={unroll}", *time_kernel(dev, ast), flops=2 * n ** 3)
                except Exception as e: print(f"  {unroll}: {type(e).__name__}: {str(e)[:200]}")

def sweep_rows(dev: str, n: int) -> None:
    x, w, b = Tensor.empty(n, n, device=dev), Tensor.empty(n, device=dev), Tensor.empty(n, device=dev)
    for name, t in (("softmax", x.softmax(-1)), ("layernorm", x.layernorm(-1) * w + b), ("row sum", x.sum(-1))):
        ast = kernel_ast(t)
        print(f"{name} {n}x{n}")
        report("heuristic", *time_kernel(dev, ast), nbytes=8.0 * n * n)
        red = next(o for o in time_kernel(dev, ast)[2] if o.op is OptOps.GROUP).axis
        for g, rows in itertools.product((32, 64, 128, 256), (1, 2, 4)):
            if g * rows > 1024: continue
            opts = [Opt(OptOps.GROUP, red, g)] + ([Opt(OptOps.LOCAL, 0, rows)] if rows > 1 else [])
            try: report(f"GROUP {g} x {rows} rows", *time_kernel(dev, ast, opts), nbytes=8.0 * n * n)
            except Exception as e: print(f"  GROUP {g} x {rows}: {type(e).__name__}: {str(e)[:200]}")

def sweep_convs(dev: str) -> None:
    """The product kernel of each of ResNet-50's convolutions (half, batch 32; the matmul where it is an im2col) with
    TC_TILES x TC_WARPS, without the heuristic's minimum of groups and warps (TC_MIN_GROUPS, TC_MIN_WARPS)."""
    for cin, cout, k, side, stride in RESNET50_CONVS:
        x = Tensor.empty(32, cin, side, side, dtype=dtypes.half, device=dev)
        w = Tensor.empty(cout, cin, k, k, dtype=dtypes.half, device=dev)
        out = (side + 2 * (k // 2) - k) // stride + 1
        asts = [si.ast for si in x.conv2d(w, stride=stride, padding=k // 2).schedule() if si.ast.op is Ops.SINK]
        ast = next(a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort()))
        print(f"conv2d half b32 {cin}->{cout} {k}x{k} {side}x{side} s{stride}: its product kernel")
        flops = 2.0 * 32 * cout * out * out * cin * k * k
        report("heuristic", *time_kernel(dev, ast), flops=flops)
        for tiles, warps in itertools.product(((4, 8), (4, 4), (2, 4), (2, 2), (8, 4)), ((2, 2), (4, 2), (2, 4))):
            label = f"TC_TILES={tiles} TC_WARPS={warps}"
            with constants(TC_TILES=tiles, TC_WARPS=warps, TC_MIN_GROUPS=0, TC_MIN_WARPS=0):
                try: report(label, *time_kernel(dev, ast), flops=flops)
                except Exception as e: print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")

def sweep_tc(dev: str, n: int) -> None:
    """Tensor-core kernels with their operands staged through local memory or not (TC_STAGE), copied 16 bytes a load
    or element by element (VECTOR_COPY_BYTES), double-buffered or not (DOUBLE_BUFFER), the block of K staged at a time
    (TC_BLOCK_K, bytes of a row), the tiles per warp (TC_TILES) and the warps per group (TC_WARPS): half and bfloat16
    n^3 matmuls and a ResNet-50 3x3 convolution (batch 32, 256 channels, 14x14) in half."""
    x = Tensor.empty(32, 256, 14, 14, dtype=dtypes.half, device=dev)
    w = Tensor.empty(256, 256, 3, 3, dtype=dtypes.half, device=dev)
    shapes = [(f"matmul {n}^3 {dt.name}", Tensor.empty(n, n, dtype=dt, device=dev) @ Tensor.empty(n, n, dtype=dt,
                                                                                                  device=dev),
               2.0 * n ** 3) for dt in (dtypes.half, dtypes.bfloat16)]
    shapes.append(("conv2d half b32 256->256 3x3 14x14", x.conv2d(w, padding=1), 2.0 * 32 * 256 * 14 * 14 * 256 * 9))
    layouts = (((4, 8), (2, 2)), ((4, 4), (2, 2)), ((4, 8), (4, 2)), ((8, 4), (2, 4)), ((2, 4), (2, 2)),
               ((4, 4), (4, 2)), ((8, 4), (2, 2)))
    for name, t, flops in shapes:
        ast = kernel_ast(t)
        print(name)
        # (the kernels before 16-byte copies and double buffering, then each step alone)
        settings: list[dict] = [dict(TC_STAGE=0), dict(VECTOR_COPY_BYTES=0, DOUBLE_BUFFER=0),
                                dict(VECTOR_COPY_BYTES=16, DOUBLE_BUFFER=0), dict(VECTOR_COPY_BYTES=0, DOUBLE_BUFFER=1)]
        # (every layout on half matmuls, a few on the others: a sweep fits a few minutes of a GPU)
        grid, blocks = (layouts, ((64, 1), (128, 1), (128, 0))) if "half" in name and name.startswith("matmul") \
            else (layouts[:3], ((64, 1), (128, 1))) if name.startswith("matmul") else (layouts[:3], ((64, 1), (128, 1)))
        settings += [dict(TC_TILES=tiles, TC_WARPS=warps, TC_BLOCK_K=block, DOUBLE_BUFFER=double)
                     for tiles, warps in grid for block, double in blocks]
        for values in settings:
            label = " ".join(f"{k}={v}" for k, v in values.items())
            with constants(**values):
                try: report(label, *time_kernel(dev, ast), flops=flops)
                except Exception as e: print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")

def sweep_im2col(dev: str) -> None:
    """Every kernel of ResNet-50's convolutions (half, batch 32) timed: read in place (IM2COL=0), and as im2col with
    ITEMS (elements an elementwise kernel computes per work-item) of 1 to 8, with 64- and 32-bit indices."""
    from fusegrad.helpers import Context
    shapes = RESNET50_CONVS + ((256, 1024, 1, 14, 1), (2048, 512, 1, 7, 1))
    ren = Device[dev].renderer
    def kernels(t: Tensor) -> list[UOp]: return [si.ast for si in t.schedule() if si.ast.op is Ops.SINK]
    def line(label: str, asts: list[UOp]) -> None:
        times = [time_kernel(dev, a) for a in asts]
        print(f"  {label:24s} total {sum(t[0] for t in times) * 1e3:7.3f} ms  " +
              "  ".join(f"{t[1][:28]} {t[0] * 1e3:.3f}" for t in times), flush=True)
    for cin, cout, k, side, stride in shapes:
        x = Tensor.empty(32, cin, side, side, dtype=dtypes.half, device=dev)
        w = Tensor.empty(cout, cin, k, k, dtype=dtypes.half, device=dev)
        print(f"conv2d half b32 {cin}->{cout} {k}x{k} {side}x{side} s{stride}")
        with Context(IM2COL=0): line("IM2COL=0", kernels(x.conv2d(w, stride=stride, padding=k // 2)))
        with Context(IM2COL=1):
            for items, i32 in itertools.product((1, 2, 4, 8), (False, True)):
                old, ren.index32 = getattr(ren, "index32", None), i32
                try:
                    with constants(ITEMS=items): line(f"ITEMS={items} index32={int(i32)}",
                                                      kernels(x.conv2d(w, stride=stride, padding=k // 2)))
                finally: ren.index32 = old

def profile_gpt2(dev: str, tokens: int = 60) -> None:
    """GPT-2 124M decoding (bench_gpu.py's row, TinyJit after its first calls): seconds per token in the model's call
    and in reading the logits back, and the Python functions that take the most time over `tokens` tokens."""
    import cProfile
    import pstats
    import time
    from bench_gpu import gpt2_row
    Device.DEFAULT = dev
    row = gpt2_row(dev, "cuda" if dev.startswith("CUDA") else "cpu", 12)
    for _ in range(5): row.ours()
    Device[dev].synchronize()
    st = time.perf_counter()
    for _ in range(tokens): row.ours()
    print(f"GPT-2 decode: {(time.perf_counter() - st) / tokens * 1e3:.3f} ms per token")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(tokens): row.ours()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="CUDA")
    ap.add_argument("--only", default="", help="key (the heuristic's kernel of each bench_gpu.py row), matmul "
                                               "(matmul32: float32 only), rows, "
                                               "conv, unroll (TC_UNROLL on half matmuls), tc (staged tensor-core "
                                               "operands), im2col (convolutions' kernels read in place or as "
                                               "im2col) or gpt2 (a profile of its decoding)")
    ap.add_argument("--n", type=int, default=4096, help="matmul size (default 4096)")
    ap.add_argument("--tokens", type=int, default=60, help="tokens GPT-2's profile decodes (default 60)")
    ap.add_argument("--dry", default="", metavar="ARCH", help="without a GPU: render each kernel for CUDA sm_XY and "
                                                              "compile it with NVRTC (its time is nan)")
    ap.add_argument("--index32", action="store_true", help="CUDA kernels' indices in 32 bits where they all fit "
                                                           "(the default: in tensor-core kernels only)")
    ap.add_argument("--index64", action="store_true", help="CUDA kernels' indices in 64 bits, tensor-core ones too")
    ap.add_argument("--no-ldmatrix", action="store_true", help="CUDA tensor-core fragments loaded element by element "
                                                               "from shared memory (as before ldmatrix)")
    args = ap.parse_args()
    dev = Device.canonicalize(args.device)
    global INDEX32, LDMATRIX
    INDEX32, LDMATRIX = True if args.index32 else False if args.index64 else None, not args.no_ldmatrix
    if not args.dry: Device[dev].renderer.index32, Device[dev].renderer.ldmatrix = INDEX32, LDMATRIX
    if args.dry:
        from fusegrad.renderer.cuda import CUDARenderer
        from fusegrad.renderer.python import PythonRenderer
        global DRY_ARCH
        # (the kernels scheduled for the PYTHON device declaring the CUDA renderer's tensor cores)
        DRY_ARCH, dev = args.dry, "PYTHON"
        # (as an H100's: up to 227 KiB of shared memory per block, dynamic above 48 KiB)
        Device[dev].renderer = PythonRenderer(like=CUDARenderer(args.dry, local_bytes=227 * 1024))
    for name, fn in (("key", lambda: sweep_key(dev, args.n)),
                     ("rows", lambda: sweep_rows(dev, 8192 if args.n >= 4096 else args.n)),
                     ("matmul", lambda: sweep_matmuls(dev, args.n)),
                     ("matmul32", lambda: sweep_matmuls(dev, args.n, (dtypes.float32,))),
                     ("conv", lambda: sweep_convs(dev)),
                     ("unroll", lambda: sweep_tc_unroll(dev)), ("tc", lambda: sweep_tc(dev, args.n)),
                     ("im2col", lambda: sweep_im2col(dev)),
                     ("gpt2", lambda: profile_gpt2(dev, args.tokens))):
        if args.only == name or (not args.only and name not in ("gpt2", "unroll", "tc", "im2col", "matmul32")): fn()

if __name__ == "__main__":
    main()
