"""GPU-style kernels side by side with the CPU's: the same workloads on CPU and on CL, each kernel's launch shape
(global_dims x local_dims on CL, the parallel loop's size on the CPU) and device time, the kernel counts, and that the
two devices' results agree.

Run: .venv/bin/python bench/bench_cl.py  [--device CL] [--steady 5]

Workloads: float32 matmuls of 512 and 1024, a fused elementwise chain over 2^22 floats, a softmax of 4096x1024, a 3x3
conv2d (32x64x32x32 -> 64 channels) and the 784-512-10 MLP's Adam step at batch 128 (bench_train.py's).

For each device the workload runs once from an empty compile cache (the "first" time: scheduling, compiling, running)
and then `--steady` more times (the median is "steady"); the kernels of the last steady run are listed with the time
the device measured for each (what DEBUG=2 prints, from the OpenCL queue's profiling events on CL). Device times on CL
are taken with every kernel waited for, so the steady wall time is the synchronous one.

On PoCL (OpenCL on this machine's CPU) the CL figures say nothing about GPUs: a work-group is a loop on one core.
The script is meant for a real GPU's OpenCL device later (`--device CL` picks the first OpenCL device, GPUs first)."""
from __future__ import annotations
import argparse
import atexit
import contextlib
import io
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

# every first run compiles its kernels
os.environ["XDG_CACHE_HOME"] = CACHE = tempfile.mkdtemp(prefix="bench-gpu-cache-")
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from fusegrad import Tensor, nn  # noqa: E402
from fusegrad.device import Device  # noqa: E402
from fusegrad.engine import realize  # noqa: E402
from fusegrad.helpers import Context  # noqa: E402
from bench_train import adam_step  # noqa: E402

# (kernel name, launch shape, seconds) of each kernel run while recording
RECORD: list[tuple[str, str, float]] | None = None
_update_stats = realize._update_stats

def _recording_update_stats(prg, var_vals, et, device) -> None:
    if RECORD is not None and isinstance(prg, realize.CompiledRunner) and et is not None:
        p = prg.p
        shape = f"{'x'.join(map(str, p.global_dims))} x {'x'.join(map(str, p.local_dims))}" if p.global_dims else \
            f"gs={realize.sym_infer(p.global_size, var_vals)}"
        RECORD.append((p.name, shape, et))
    with Context(DEBUG=0): _update_stats(prg, var_vals, et, device)

realize._update_stats = _recording_update_stats

def workloads(dev: str) -> dict[str, Callable[[], Callable[[], Tensor]]]:
    """name -> a setup on `dev` returning the function one run calls (it returns the result, realized)."""
    rng = np.random.default_rng(0)
    def t(*shape: int) -> Tensor: return Tensor(rng.standard_normal(shape).astype(np.float32), device=dev).realize()
    def matmul(n: int):
        a, b = t(n, n), t(n, n)
        return lambda: (a @ b).realize()
    def chain():
        a, b, c = t(1 << 22), t(1 << 22), t(1 << 22)
        return lambda: ((a * b + c).relu() * 0.5 - a.exp2() * 0.1 + (b - c).abs().sqrt()).realize()
    def softmax():
        x = t(4096, 1024)
        return lambda: x.softmax(-1).realize()
    def conv():
        x, w = t(32, 64, 32, 32), t(64, 64, 3, 3) * 0.05
        return lambda: x.conv2d(w, padding=1).realize()
    def mlp():
        Tensor.manual_seed(0)
        l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
        for p in (l1.weight, l1.bias, l2.weight, l2.bias): p.replace(p.to(dev)).realize()
        step = adam_step([l1.weight, l1.bias, l2.weight, l2.bias], lambda xb: l2(l1(xb).relu()), 1e-3, False)
        x = rng.standard_normal((128, 784)).astype(np.float32)
        y = rng.integers(0, 10, 128).astype(np.int32)
        return lambda: step(Tensor(x, device=dev), Tensor(y, device=dev)).realize()
    return {"matmul 512": lambda: matmul(512), "matmul 1024": lambda: matmul(1024), "elementwise chain": chain,
            "softmax 4096x1024": softmax, "conv2d 3x3 32x64x32x32": conv, "MLP Adam step": mlp}

def measure(dev: str, setup: Callable[[], Callable[[], Tensor]], steady: int) -> dict:
    global RECORD
    fn = setup()
    st = time.perf_counter()
    first_out = fn().numpy()
    first = time.perf_counter() - st
    times = []
    for _ in range(steady):
        RECORD = []
        st = time.perf_counter()
        # (DEBUG=2 waits for each kernel and times it; its summary lines are not printed)
        with Context(DEBUG=2), contextlib.redirect_stdout(io.StringIO()): fn()
        Device[dev].synchronize()
        times.append(time.perf_counter() - st)
    kernels, RECORD = RECORD or [], None
    return {"first": first, "steady": statistics.median(times), "kernels": kernels, "out": first_out}

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="CL", help="the GPU-style device to compare with the CPU (default CL)")
    ap.add_argument("--steady", type=int, default=5, help="steady runs after the first (default 5)")
    ap.add_argument("--only", action="append", default=[], help="run only workloads whose name contains this")
    args = ap.parse_args()
    gpu = args.device
    print(f"CPU vs {gpu} ({getattr(Device[gpu], 'cl_device', None) and Device[gpu].cl_device.name})")
    names = [n for n in workloads("CPU") if not args.only or any(o.lower() in n.lower() for o in args.only)]
    for name in names:
        res = {dev: measure(dev, workloads(dev)[name], args.steady) for dev in ("CPU", gpu)}
        a, b = res["CPU"]["out"].astype(np.float64), res[gpu]["out"].astype(np.float64)
        err = float(np.abs(a - b).max() / max(1.0, float(np.abs(a).max())))
        print(f"\n== {name}: results {'agree' if err < 1e-3 else 'DIFFER'} (max relative difference {err:.1e})")
        for dev in ("CPU", gpu):
            r = res[dev]
            ktime = sum(k[2] for k in r["kernels"])
            print(f"  {dev:4s} first {r['first'] * 1e3:9.1f} ms   steady {r['steady'] * 1e3:9.2f} ms   "
                  f"{len(r['kernels'])} kernels, {ktime * 1e3:.2f} ms in kernels")
            for kname, shape, et in r["kernels"]:
                print(f"      {kname:40s} {shape:28s} {et * 1e6:10.1f} us")

if __name__ == "__main__":
    main()
