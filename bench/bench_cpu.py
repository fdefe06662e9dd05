"""CPU benchmark: fusegrad against PyTorch (2 threads), NumPy and hand-written C (OpenMP, 2 threads) in one process.

Run: .venv/bin/python bench/bench_cpu.py  [--quick] [--only NAME] [--no-amx]

  --quick      fewer and shorter timing blocks, and no ResNet-18
  --only NAME  run only the cases whose name contains NAME (case-insensitive; repeatable)
  --no-amx     bfloat16 matmuls without AMX tiles (on by default where the CPU has them)

Cases: float32 matmuls (square, odd sizes, the MLP's first layer and a 50257-word vocabulary projection), float16 and
bfloat16 matmuls (against torch in that dtype and in float32; bfloat16 also with a float32 result), the fused
elementwise max(a*b+c, 0) on 2^24 floats, a transposing copy of a 1024x4096 matrix, row sums, the full sum, softmax
and layernorm of a 4096x4096 float32 matrix, a 3x3 conv2d (forward, and forward plus input and weight gradients),
ResNet-18 forward (batch 8, 224px, TinyJit against torch eval mode under no_grad), the 784-512-10 MLP Adam step at
batch 128 (eager and TinyJit; the step code is bench_train.py's) and the 200-op mixed
graph of bench_core.py (its first run in a fresh process with an empty compile cache, then warm in this process).

The "C" rows are plain C loops (bench/bench_cpu_ref.c) compiled at start with gcc -O3 -march=native
-mprefer-vector-width=512 -fopenmp into a shared library and called through ctypes on the same numpy arrays, writing
into an output allocated once: for the memory-bound cases they are the memory-bandwidth bound to aim for. fusegrad,
torch and numpy allocate a fresh output on every run, as a user's code does.

How it is timed: each implementation runs once (the "first" column: for fusegrad that includes scheduling and compiling;
the process starts with an empty fusegrad disk cache) and twice more (TinyJit captures on its second call), then its
output is checked once against a float64 NumPy or a torch reference; an implementation that fails the check is reported
WRONG and not timed. Then each implementation runs in blocks of repetitions, alternating whole blocks (fusegrad, torch,
numpy, C, fusegrad, torch, ...; never call by call, since a BLAS's idle threads spin after each call and would land in
the next call's time), each block after a 0.2 s pause in which the previous block's idle threads stop spinning; a case
whose blocks take over 30 s stops after 3 rounds. fusegrad runs realize a fresh lazy graph over inputs realized
beforehand (graph building and schedule-cache lookups are included, as a user pays them) and synchronize the device.

Columns:
  first ms     the first run, with empty caches
  steady ms    the median over the blocks of the mean time per run in a block
  spread       (slowest block - fastest block) / steady: the noise of this machine
  throughput   GFLOPS (multiply-adds count 2), GB/s (the bytes the operation must read and write at least) or img/s
  fg/ref       fusegrad's time / this implementation's time, steady: < 1 means fusegrad is faster, > 1 slower
  first fg/ref the same for the first runs
"""
from __future__ import annotations
import argparse
import atexit
import ctypes
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable
import numpy as np
import torch
import torch.nn.functional as F

from torch_cpu import setup as torch_setup  # noqa: E402  (bench/ is the script's folder)

torch_setup()
# fusegrad starts with an empty disk cache, so each first run includes compiling its kernels
CACHE = tempfile.mkdtemp(prefix="bench-cpu-cache-")
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
os.environ["XDG_CACHE_HOME"] = CACHE

from fusegrad import Device, Tensor, TinyJit, nn  # noqa: E402  (the cache and torch threads are set first)
from fusegrad.nn.state import get_state_dict  # noqa: E402
from fusegrad.engine.realize import optimized_kernels  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "examples")]
from bench_core import G200_PROGRAM  # noqa: E402
from bench_train import adam_steps  # noqa: E402
import resnet  # noqa: E402

C_THREADS = 2
C_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared"]
MAX_BLOCKS_S = 30.0
# a pause before each timed block: OpenBLAS's idle threads spin (with sched_yield) for about 0.1 s after a call and
# an OpenMP runtime's for a while too; without it they take a core from the first ~100 ms of the next block
SETTLE_S = 0.2

@dataclass
class Impl:
    """One implementation of a case: `fn` runs it once and returns its (materialized) result."""
    name: str
    fn: Callable[[], Any]
    first: float | None = None
    blocks: list[float] = field(default_factory=list)   # mean seconds per run of each block
    out: Any = None
    problem: str = ""   # why it has no numbers: an exception or a wrong result

    @property
    def steady(self) -> float | None: return statistics.median(self.blocks) if self.blocks else None

@dataclass
class Case:
    name: str
    impls: list[Impl]                       # the first one is fusegrad's: every ratio is against it
    check: Callable[[str, Any], None]       # raises AssertionError when an implementation's result is wrong
    unit: str = ""                          # of the throughput column
    work: float = 0.0                       # FLOPs, bytes or images per run, divided by `scale` for the column
    scale: float = 1e9
    notes: list[str] = field(default_factory=list)
    cold: Callable[[], float] | None = None  # measures fusegrad's first run elsewhere (a fresh process), in seconds

# *** helpers ***

def realized(a: np.ndarray) -> Tensor: return Tensor(a).realize()

def done(*ts: Tensor) -> Any:
    """Realize fusegrad tensors (together) and wait for the device: the result of a timed fusegrad run."""
    ts[0].realize(*ts[1:])
    Device[ts[0].device].synchronize()
    return ts[0] if len(ts) == 1 else ts

def settle() -> None:
    """Wait for fusegrad's queued kernels (CPU kernels run asynchronously): a timing ends when the work has run."""
    Device[Device.DEFAULT].synchronize()

def to_np(x: Any) -> Any:
    if isinstance(x, (tuple, list)): return [to_np(v) for v in x]
    if isinstance(x, Tensor): return x.numpy()
    if isinstance(x, torch.Tensor): return x.detach().float().numpy()
    return np.asarray(x)

def against(expect: Any, rtol: float = 1e-4, atol_rel: float = 1e-5) -> Callable[[str, Any], None]:
    """A check comparing a result (or a tuple of results) with `expect`; atol is atol_rel * max |expect|."""
    exps = expect if isinstance(expect, (tuple, list)) else [expect]
    def check(_name: str, out: Any) -> None:
        outs = to_np(out)
        outs = outs if isinstance(outs, list) else [outs]
        assert len(outs) == len(exps), f"{len(outs)} results, expected {len(exps)}"
        for got, exp in zip(outs, exps):
            np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol_rel * float(np.max(np.abs(exp))))
    return check

def load_c_reference() -> tuple[ctypes.CDLL | None, str]:
    """bench_cpu_ref.c compiled with gcc into a shared library and loaded, or None and the reason it isn't."""
    src = BENCH / "bench_cpu_ref.c"
    so = pathlib.Path(CACHE) / "bench_cpu_ref.so"
    try:
        res = subprocess.run(["gcc", *C_FLAGS, str(src), "-o", str(so), "-lm"], capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0: return None, f"gcc failed (exit {res.returncode}): {res.stderr.strip()[:300]}"
        lib = ctypes.CDLL(str(so))
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"can't build {src}: {type(e).__name__}: {e}"
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    for name, args in (("ref_matmul", [p, p, p, i64, i64, i64, i32]), ("ref_fma_relu", [p, p, p, p, i64, i32]),
                       ("ref_transpose", [p, p, i64, i64, i32]), ("ref_rowsum", [p, p, i64, i64, i32]),
                       ("ref_sum", [p, i64, i32]),
                       ("ref_softmax", [p, p, i64, i64, i32]), ("ref_layernorm", [p, p, i64, i64, f32, i32])):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_double if name == "ref_sum" else None
    return lib, ""

def ptr(a: np.ndarray) -> int:
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return a.ctypes.data

CLIB: ctypes.CDLL | None = None

def c_impl(call: Callable[[ctypes.CDLL], Any]) -> list[Impl]:
    """The C implementation of a case (none when the library couldn't be built)."""
    return [] if CLIB is None else [Impl("C", lambda: call(CLIB))]

# *** cases ***

def case_matmul(m: int, k: int, n: int) -> Case:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    fa, fb, ta, tb = realized(a), realized(b), torch.from_numpy(a), torch.from_numpy(b)
    out = np.empty((m, n), np.float32)
    def c_matmul(lib):
        lib.ref_matmul(ptr(a), ptr(b), ptr(out), m, n, k, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done(fa @ fb)), Impl("torch", lambda: ta @ tb), Impl("numpy", lambda: a @ b),
             *c_impl(c_matmul)]
    return Case(f"matmul {m}x{k} @ {k}x{n} f32", impls, against(a.astype(np.float64) @ b, 1e-4, 1e-5), "GFLOPS",
                2.0 * m * n * k)

def case_matmul_half(n: int = 1024) -> Case:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32).astype(np.float16) for _ in range(2))
    fa, fb = realized(a), realized(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ta32, tb32 = ta.float(), tb.float()
    impls = [Impl("fusegrad f16", lambda: done(fa @ fb)), Impl("torch f16", lambda: ta @ tb),
             Impl("torch f32", lambda: ta32 @ tb32)]
    case = Case(f"matmul {n}^3 f16", impls, against(a.astype(np.float64) @ b, 1e-2, 1e-2), "GFLOPS", 2.0 * n ** 3)
    case.notes.append("same float16 inputs for all; torch f32 multiplies them converted to float32 beforehand; "
                      "numpy is left out (its float16 matmul has no BLAS: ~5 s here)")
    return case

def case_matmul_bf16(n: int = 1024) -> Case:
    from fusegrad import dtypes
    tgen = torch.Generator().manual_seed(0)
    ta, tb = (torch.randn(n, n, generator=tgen).bfloat16() for _ in range(2))
    fa, fb = (Tensor(t.float().numpy()).cast(dtypes.bfloat16).realize() for t in (ta, tb))
    ta32, tb32 = ta.float(), tb.float()
    impls = [Impl("fusegrad bf16", lambda: done(fa @ fb)), Impl("torch bf16", lambda: ta @ tb),
             Impl("torch f32", lambda: ta32 @ tb32)]
    # (the products are exact in float32 and summed there; the result is rounded to bfloat16 once: 2^-8 relative)
    case = Case(f"matmul {n}^3 bf16", impls, against(ta32.double().numpy() @ tb32.double().numpy(), 1e-2, 1e-2),
                "GFLOPS", 2.0 * n ** 3)
    case.notes.append("same bfloat16 inputs for all; torch f32 multiplies them converted to float32 beforehand")
    return case

def case_matmul_bf16_f32_out(n: int = 1024) -> Case:
    from fusegrad import dtypes
    tgen = torch.Generator().manual_seed(0)
    ta, tb = (torch.randn(n, n, generator=tgen).bfloat16() for _ in range(2))
    fa, fb = (Tensor(t.float().numpy()).cast(dtypes.bfloat16).realize() for t in (ta, tb))
    impls = [Impl("fusegrad", lambda: done(fa.dot(fb, dtype=dtypes.float32))), Impl("torch bf16", lambda: ta @ tb)]
    case = Case(f"matmul {n}^3 bf16 -> f32", impls, against(ta.double().numpy() @ tb.double().numpy(), 1e-2, 1e-2),
                "GFLOPS", 2.0 * n ** 3)
    case.notes.append("bfloat16 inputs, fusegrad's float32 sum stored as it is (one kernel: on AMX tiles where the "
                      "CPU has them); torch's rounded to bfloat16")
    return case

def case_elementwise(n: int = 1 << 24) -> Case:
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    fa, fb, fc = realized(a), realized(b), realized(c)
    ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
    out = np.empty(n, np.float32)
    def c_ew(lib):
        lib.ref_fma_relu(ptr(a), ptr(b), ptr(c), ptr(out), n, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done((fa * fb + fc).relu())), Impl("torch", lambda: (ta * tb + tc).relu()),
             Impl("numpy", lambda: np.maximum(a * b + c, 0)), *c_impl(c_ew)]
    exp = np.maximum(a.astype(np.float64) * b + c, 0)
    return Case("(a*b+c).relu() 2^24 f32", impls, against(exp, 1e-5, 1e-6), "GB/s", 4.0 * 4 * n)

_MATRIX: dict[int, np.ndarray] = {}
def matrix(n: int = 4096) -> np.ndarray:
    if n not in _MATRIX: _MATRIX[n] = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    return _MATRIX[n]

def case_transpose(rows: int = 1024, cols: int = 4096) -> Case:
    x = np.random.default_rng(3).standard_normal((rows, cols), dtype=np.float32)
    fx, tx, out = realized(x), torch.from_numpy(x), np.empty((cols, rows), np.float32)
    def c_transpose(lib):
        lib.ref_transpose(ptr(x), ptr(out), rows, cols, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done(fx.T.contiguous())), Impl("torch", lambda: tx.T.contiguous()),
             Impl("numpy", lambda: np.ascontiguousarray(x.T)), *c_impl(c_transpose)]
    return Case(f"x.T.contiguous() {rows}x{cols} f32", impls, against(x.T, 0, 0), "GB/s", 2 * 4.0 * rows * cols)

def case_rowsum(n: int = 4096) -> Case:
    x = matrix(n)
    fx, tx, out = realized(x), torch.from_numpy(x), np.empty(n, np.float32)
    def c_rowsum(lib):
        lib.ref_rowsum(ptr(x), ptr(out), n, n, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done(fx.sum(1))), Impl("torch", lambda: tx.sum(1)),
             Impl("numpy", lambda: x.sum(1)), *c_impl(c_rowsum)]
    return Case(f"x.sum(1) {n}x{n} f32", impls, against(x.astype(np.float64).sum(1), 1e-4, 1e-5), "GB/s", 4.0 * n * n)

def case_sum(n: int = 4096) -> Case:
    x = matrix(n)
    fx, tx = realized(x), torch.from_numpy(x)
    impls = [Impl("fusegrad", lambda: done(fx.sum())), Impl("torch", lambda: tx.sum()), Impl("numpy", lambda: x.sum()),
             *c_impl(lambda lib: lib.ref_sum(ptr(x), n * n, C_THREADS))]
    exp = x.astype(np.float64).sum()
    # the sum of 2^24 normal numbers is near 0: the tolerance is relative to the sum of magnitudes instead
    tol = 1e-5 * float(np.abs(x).astype(np.float64).sum())
    def check(_name: str, out: Any) -> None: np.testing.assert_allclose(to_np(out), exp, rtol=0, atol=tol)
    return Case(f"x.sum() {n}x{n} f32", impls, check, "GB/s", 4.0 * n * n)

def case_softmax(n: int = 4096) -> Case:
    x = matrix(n)
    fx, tx, out = realized(x), torch.from_numpy(x), np.empty_like(x)
    def np_softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - v.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    def c_softmax(lib):
        lib.ref_softmax(ptr(x), ptr(out), n, n, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done(fx.softmax(-1))), Impl("torch", lambda: tx.softmax(-1)),
             Impl("numpy", lambda: np_softmax(x)), *c_impl(c_softmax)]
    return Case(f"x.softmax(-1) {n}x{n} f32", impls, against(np_softmax(x.astype(np.float64)), 1e-4, 1e-5), "GB/s",
                2 * 4.0 * n * n)

def case_layernorm(n: int = 4096) -> Case:
    x = matrix(n)
    fx, tx, out = realized(x), torch.from_numpy(x), np.empty_like(x)
    def np_layernorm(v: np.ndarray) -> np.ndarray:
        y = v - v.mean(-1, keepdims=True)
        return y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5)
    def c_layernorm(lib):
        lib.ref_layernorm(ptr(x), ptr(out), n, n, 1e-5, C_THREADS)
        return out
    impls = [Impl("fusegrad", lambda: done(fx.layernorm(-1))), Impl("torch", lambda: F.layer_norm(tx, (n,))),
             Impl("numpy", lambda: np_layernorm(x)), *c_impl(c_layernorm)]
    return Case(f"x.layernorm(-1) {n}x{n} f32", impls, against(np_layernorm(x.astype(np.float64)), 1e-4, 1e-5),
                "GB/s", 2 * 4.0 * n * n)

def conv_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Input 16x64x32x32, weight 64x64x3x3 and an upstream gradient for the 64x32x32 output."""
    rng = np.random.default_rng(3)
    x, g = (rng.standard_normal((16, 64, 32, 32), dtype=np.float32) for _ in range(2))
    return x, rng.standard_normal((64, 64, 3, 3), dtype=np.float32) / 24, g

CONV_FLOPS = 2.0 * 16 * 64 * 32 * 32 * 64 * 9

def case_conv_forward() -> Case:
    x, w, _ = conv_data()
    fx, fw, tx, tw = realized(x), realized(w), torch.from_numpy(x), torch.from_numpy(w)
    exp = F.conv2d(tx.double(), tw.double(), padding=1).numpy()
    impls = [Impl("fusegrad", lambda: done(fx.conv2d(fw, padding=1))),
             Impl("torch", lambda: F.conv2d(tx, tw, padding=1))]
    return Case("conv2d 16x64x32x32 k3 p1 forward", impls, against(exp, 1e-4, 1e-5), "GFLOPS", CONV_FLOPS)

def case_conv_backward() -> Case:
    x, w, g = conv_data()
    fx, fw, fg = realized(x), realized(w), realized(g)
    tx, tw, tg = (torch.from_numpy(v).requires_grad_() for v in (x, w, g))
    def ours():
        return done(*fx.conv2d(fw, padding=1).gradient(fx, fw, gradient=fg))
    def theirs():
        return torch.autograd.grad(F.conv2d(tx, tw, padding=1), (tx, tw), tg)
    x64, w64 = (torch.from_numpy(v).double().requires_grad_() for v in (x, w))
    exp = [v.numpy() for v in torch.autograd.grad(F.conv2d(x64, w64, padding=1), (x64, w64), tg.double())]
    case = Case("conv2d 16x64x32x32 k3 p1 fwd+bwd", [Impl("fusegrad", ours), Impl("torch", theirs)],
                against(exp, 1e-4, 1e-5), "GFLOPS", 3 * CONV_FLOPS)
    case.notes.append("input and weight gradients for a given output gradient (3x the forward FLOPs)")
    return case

class TorchBasicBlock(torch.nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(cin, width, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.conv2, self.bn2 = torch.nn.Conv2d(width, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width)
        self.downsample = torch.nn.Sequential(torch.nn.Conv2d(cin, width, 1, stride, bias=False),
                                              torch.nn.BatchNorm2d(width)) if stride != 1 or cin != width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))

class TorchResNet18(torch.nn.Module):
    """torchvision's ResNet-18 layout and parameter names (torchvision isn't a dependency)."""
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64)
        cin = 64
        for i in range(4):
            width = 64 * 2 ** i
            setattr(self, f"layer{i + 1}", torch.nn.Sequential(TorchBasicBlock(cin, width, 2 if i else 1),
                                                               TorchBasicBlock(width, width, 1)))
            cin = width
        self.fc = torch.nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for i in range(1, 5): x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean((2, 3)))

def case_resnet(batch: int = 8, size: int = 224) -> Case:
    x = np.random.default_rng(4).standard_normal((batch, 3, size, size), dtype=np.float32)
    model = resnet.ResNet(18)
    tm = TorchResNet18()
    tm.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in get_state_dict(model).items()})
    tm.eval()
    @TinyJit
    def forward(img: Tensor) -> Tensor:
        with Tensor.test(): return model(img)
    fx, tx = realized(x), torch.from_numpy(x)
    def theirs():
        with torch.no_grad(): return tm(tx)
    with torch.no_grad(): exp = tm(tx).numpy()   # same weights: torch's logits are the reference
    case = Case(f"ResNet-18 forward b{batch} {size}px", [Impl("fusegrad", lambda: done(forward(fx))),
                                                         Impl("torch", theirs)], against(exp, 1e-3, 1e-3), "img/s",
                batch, 1.0)
    case.notes.append("fusegrad under TinyJit in test mode; torch eval mode under no_grad; same random weights")
    return case

def case_mlp(jit: bool) -> Case:
    """bench_train.py's Adam step on the 784-512-10 MLP, both sides starting from the same weights."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    tm = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ours_params = [l1.weight, l1.bias, l2.weight, l2.bias]
    theirs_params = [tm[0].weight, tm[0].bias, tm[2].weight, tm[2].bias]
    with torch.no_grad():
        for t, o in zip(theirs_params, ours_params): t.copy_(torch.from_numpy(o.numpy()))
    ours, theirs = adam_steps(ours_params, lambda xb: l2(l1(xb).relu()), 1e-3, jit, tm, x, y)
    def check(name: str, _out: Any) -> None:
        # called after each side made the same few steps: its parameters must agree with torch's. Adam moves a weight
        # by about the learning rate whatever the size of its gradient, so where rounding puts a pre-activation on the
        # other side of the relu (one hidden unit, one sample), that unit's whole row of weights parts from torch's by
        # a step. Such rows are few; a wrong gradient moves most weights. So: at most 1% of each parameter's elements
        # may differ by more than a tenth of a step
        if name == "torch": return
        for o, t in zip(ours_params, theirs_params):
            a, b = o.numpy().astype(np.float64), t.detach().numpy().astype(np.float64)
            parted = float(np.mean(np.abs(a - b) > 1e-4))
            if parted > 0.01: raise AssertionError(f"{parted:.1%} of a parameter's elements differ from torch's")
    return Case(f"MLP 784-512-10 Adam step b128, {'TinyJit' if jit else 'eager'}",
                [Impl("fusegrad", ours), Impl("torch", theirs)], check)

def graph200(x: Any, relu: Callable[[Any], Any], rowsum: Callable[[Any], Any]) -> Any:
    """bench_core.py's G200_PROGRAM graph: 200 elementwise ops and row sums broadcast back."""
    for i in range(200): x = relu(x * 1.01 + 0.5) if i % 3 else rowsum(x) * 0.001 + x
    return x

def g200_fresh_process(cache: str) -> tuple[float, str]:
    """Runs bench_core's G200_PROGRAM in a fresh process with the disk cache at `cache`: (seconds of its graph run,
    the rest of what it printed)."""
    res = subprocess.run([sys.executable, "-c", G200_PROGRAM], env={**os.environ, "XDG_CACHE_HOME": cache},
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0: raise RuntimeError(res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "?")
    run_ms, import_ms, kernels = res.stdout.split()
    return float(run_ms) / 1e3, f"import {import_ms} ms, {kernels} kernels"

def case_graph200() -> Case:
    x = np.ones((77, 77), np.float32)
    fx, tx = Tensor.ones(77, 77).contiguous().realize(), torch.from_numpy(x)
    impls = [Impl("fusegrad", lambda: done(graph200(fx, Tensor.relu, lambda v: v.sum(1, keepdim=True).expand(77, 77)))),
             Impl("torch", lambda: graph200(tx, torch.relu, lambda v: v.sum(1, keepdim=True))),
             Impl("numpy", lambda: graph200(x, lambda v: np.maximum(v, 0), lambda v: v.sum(1, keepdims=True)))]
    exp = graph200(x.astype(np.float64), lambda v: np.maximum(v, 0), lambda v: v.sum(1, keepdims=True))
    case = Case("200-op graph 77x77 (bench_core)", impls, against(exp, 1e-4, 1e-5))
    def cold() -> float:
        with tempfile.TemporaryDirectory(prefix="bench-cpu-g200-") as cache:
            t_cold, info = g200_fresh_process(cache)
            t_warm, _ = g200_fresh_process(cache)
        case.notes.append(f"fusegrad first = its run in a fresh process with an empty compile cache ({info}); "
                          f"another fresh process with that cache filled: {t_warm * 1e3:.0f} ms")
        return t_cold
    case.cold = cold
    return case

CASES: list[tuple[str, Callable[[], Case]]] = [
    ("matmul 1024x1024 @ 1024x1024 f32", lambda: case_matmul(1024, 1024, 1024)),
    ("matmul 2048x2048 @ 2048x2048 f32", lambda: case_matmul(2048, 2048, 2048)),
    ("matmul 1000x1000 @ 1000x1000 f32", lambda: case_matmul(1000, 1000, 1000)),
    ("matmul 1023x1023 @ 1023x1023 f32", lambda: case_matmul(1023, 1023, 1023)),
    ("matmul 128x784 @ 784x512 f32", lambda: case_matmul(128, 784, 512)),
    ("matmul 1024^3 f16", case_matmul_half),
    ("matmul 1024^3 bf16", case_matmul_bf16),
    ("matmul 1024^3 bf16 -> f32", case_matmul_bf16_f32_out),
    ("matmul 128x768 @ 768x50257 f32", lambda: case_matmul(128, 768, 50257)),
    ("(a*b+c).relu() 2^24 f32", case_elementwise),
    ("x.T.contiguous() 1024x4096 f32", case_transpose),
    ("x.sum(1) 4096x4096 f32", case_rowsum),
    ("x.sum() 4096x4096 f32", case_sum),
    ("x.softmax(-1) 4096x4096 f32", case_softmax),
    ("x.layernorm(-1) 4096x4096 f32", case_layernorm),
    ("conv2d 16x64x32x32 k3 p1 forward", case_conv_forward),
    ("conv2d 16x64x32x32 k3 p1 fwd+bwd", case_conv_backward),
    ("ResNet-18 forward b8 224px", case_resnet),
    ("MLP 784-512-10 Adam step b128, eager", lambda: case_mlp(False)),
    ("MLP 784-512-10 Adam step b128, TinyJit", lambda: case_mlp(True)),
    ("200-op graph 77x77 (bench_core)", case_graph200),
]

# *** timing ***

def error_text(e: BaseException) -> str:
    """One line about an exception: its first line, and the first line saying "error" after it (a compiler's)."""
    lines = str(e).strip().splitlines() or [""]
    detail = next((line.strip() for line in lines[1:] if "error" in line.lower()), "")
    return f"{type(e).__name__}: {lines[0][:200]}" + (f" ... {detail[:200]}" if detail else "")

def measure(case: Case, nblocks: int, block_s: float, verbose: bool) -> None:
    """First run, warm-up and check of every implementation, then `nblocks` rounds of alternating timed blocks."""
    per_run: dict[str, float] = {}
    for impl in case.impls:
        try:
            if impl is case.impls[0] and case.cold is not None:
                impl.first = case.cold()
            else:
                t0 = time.perf_counter()
                impl.fn()
                settle()
                impl.first = time.perf_counter() - t0
        except Exception as e:
            impl.problem = f"failed: {error_text(e)}"
            if verbose: traceback.print_exc()
    for impl in case.impls:
        if impl.problem: continue
        try:
            impl.fn()   # a TinyJit captures here
            t0 = time.perf_counter()
            impl.out = impl.fn()
            settle()
            per_run[impl.name] = time.perf_counter() - t0
        except Exception as e:
            impl.problem = f"failed: {error_text(e)}"
            if verbose: traceback.print_exc()
    for impl in case.impls:
        if impl.problem: continue
        try: case.check(impl.name, impl.out)
        except AssertionError as e:
            impl.problem = "WRONG RESULT (not timed): " + " ".join(str(e).split())[:300]
        impl.out = None   # the outputs of the big cases take memory
    live = [impl for impl in case.impls if not impl.problem]
    # (the blocks time the kernels that stay: the optimized builds of those a first run compiled quickly)
    optimized_kernels()
    reps = {impl.name: max(1, min(1000, round(block_s / max(per_run[impl.name], 1e-7)))) for impl in live}
    t_blocks = time.perf_counter()
    for i in range(nblocks):
        # a case whose runs take seconds (ResNet when fusegrad is slow) stops after 3 rounds
        if i >= 3 and time.perf_counter() - t_blocks > MAX_BLOCKS_S: break
        for impl in live:
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            for _ in range(reps[impl.name]): impl.fn()
            settle()
            impl.blocks.append((time.perf_counter() - t0) / reps[impl.name])

# *** the table ***

HEADER = (f"{'case':40s} {'impl':12s} {'first ms':>10s} {'steady ms':>10s} {'spread':>6s} {'throughput':>16s} "
          f"{'fg/ref':>8s} {'first fg/ref':>12s}")

def fmt_ratio(a: float | None, b: float | None, width: int) -> str:
    return f"{a / b:{width - 1}.2f}x" if a is not None and b is not None and b > 0 else " " * width

def print_case(case: Case) -> None:
    fg = case.impls[0]
    for i, impl in enumerate(case.impls):
        name = case.name if i == 0 else ""
        if impl.problem:
            print(f"{name:40s} {impl.name:12s} {impl.problem}")
            continue
        steady = impl.steady
        spread = (max(impl.blocks) - min(impl.blocks)) / steady if steady else 0.0
        tp = f"{case.work / steady / case.scale:9.1f} {case.unit:6s}" if case.unit and steady else ""
        ratios = "" if i == 0 else f"{fmt_ratio(fg.steady, steady, 8)} {fmt_ratio(fg.first, impl.first, 12)}"
        first = f"{impl.first * 1e3:10.2f}" if impl.first is not None else f"{'-':>10s}"
        print(f"{name:40s} {impl.name:12s} {first} {steady * 1e3:10.3f} {spread:5.0%} {tp:>16s} {ratios}".rstrip())
    for note in case.notes: print(f"{'':40s} note: {note}")
    sys.stdout.flush()

def main() -> None:
    global CLIB
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and shorter blocks, and no ResNet-18")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="cases whose name contains NAME")
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    ap.add_argument("--no-amx", action="store_true", help="bfloat16 matmuls without AMX tiles (fusegrad uses them "
                                                          "where the CPU has them: DESIGN.md, bfloat16 products)")
    args = ap.parse_args()
    if args.no_amx: Device[Device.DEFAULT].renderer.amx = False
    nblocks, block_s = (3, 0.15) if args.quick else (5, 0.4)
    t_start = time.perf_counter()
    cases = [(n, make) for n, make in CASES if not (args.quick and n.startswith("ResNet"))
             and (not args.only or any(o.lower() in n.lower() for o in args.only))]
    print(f"bench_cpu: fusegrad on {Device.DEFAULT}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"numpy {np.__version__}, C: gcc {' '.join(C_FLAGS[:4])} on {C_THREADS} threads"
          f"{' [quick]' if args.quick else ''}")
    print(f"{nblocks} blocks of ~{block_s:.2f} s per implementation; steady = median block; "
          "fg/ref = fusegrad time / reference time (< 1: fusegrad faster, > 1: fusegrad slower)\n")
    CLIB, c_problem = load_c_reference()
    if CLIB is None: print(f"no C reference: {c_problem}\n")
    print(HEADER)
    print("-" * len(HEADER))
    for name, make in cases:
        try:
            case = make()
            measure(case, nblocks, block_s, args.verbose)
        except Exception as e:   # one broken case must not hide the others
            print(f"{name:40s} failed: {error_text(e)}")
            if args.verbose: traceback.print_exc()
            continue
        print_case(case)
    print(f"\ntotal bench time {time.perf_counter() - t_start:.1f} s")

if __name__ == "__main__":
    main()
