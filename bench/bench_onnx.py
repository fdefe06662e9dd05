"""fusegrad.onnx against onnxruntime (CPU execution provider) on models exported with torch.onnx.export: the
ResNet-style CNN at batch 1 and 16, the BERT-style encoder at sequence 128, the MobileNet-style model. Both run in
this process on the same inputs, in alternating blocks (A B A B), onnxruntime with as many threads as there are cores;
fusegrad's call is `OnnxRunner.jit()`: NumPy arrays in and out as onnxruntime's `run`, the kernels replayed by
TinyJit with prune=True (the model's initializers don't change between calls, so what is computed from them alone, a
strided convolution's weight layout, runs once). Each side's median and best run are reported, the first run of each
(fusegrad's includes compiling) apart, and the kernels a replay runs. The timed runs start once the optimized builds
of the kernels the first run compiled quickly have taken over (they compile in the background). Each block starts
after a pause (PAUSE_S): onnxruntime's worker threads spin for ~25 ms after a run (measured here: the process's CPU
time while it sleeps), so without one they held the second core through the whole fusegrad block that followed, and
fusegrad's two-thread kernels ran on one (batch 16: every chunk on the calling thread, 0.147 against 0.103 ms best).

--profile adds where fusegrad's call goes: the call against its replay alone (the kept launches and the wait for
them, without the runner's copies in and out), each kernel of a replay timed alone, as the replay launches it (split
across the threads its work gets) and on one thread, their sums against the best call, and the main thread's CPU time
per call (what the kernels run on the calling thread adds to the Python of the replay, the copies in and out), and
the chunk timeline of the fastest of 20 calls (which thread ran each kernel's chunks, when: cpu_pool's timeline). A
replay of little work in all runs its kernels whole on the calling thread (LaunchGraph's inline graphs): for those the
one-thread column is what the call pays; a kernel split across threads pays a worker's wake-up when timed alone.

    .venv/bin/python bench/bench_onnx.py [--quick] [--profile] [--only resnet1,resnet16,encoder,mobilenet]"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fusegrad.helpers import Context  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.engine.realize import optimized_kernels  # noqa: E402
from test.onnx.models import export  # noqa: E402

# (seconds between timed blocks: longer than onnxruntime's threads spin after a run, ~25 ms)
PAUSE_S = 0.1

CASES = {"resnet1": ("resnet", 1, None), "resnet16": ("resnet", 16, None), "encoder": ("encoder", 1, 128),
         "mobilenet": ("mobilenet", 1, None)}


def _kernel_time(ei: Any, runs: int = 20) -> float:
    """The best of `runs` timed runs of a captured kernel alone, in seconds (its inputs hold the last call's values)."""
    return min(ei.prg(ei.bufs, ei.fixedvars, wait=True) for _ in range(runs))


def _replay_alone(jitted: Any) -> Any:
    """A function running what `jitted`'s call replays, without the runner around it: the kept launches and the wait
    for them (no copy in or out); None where the call doesn't take the kept replay."""
    calls = list(jitted._replays.values())
    if len(calls) != 1: return None
    call = calls[0]
    from fusegrad import Device
    sync = Device[call.bufs[0].device].synchronize if call.bufs else (lambda: None)

    def run() -> None:
        # (as the call replays: waiting for its kernels itself, the calling thread claiming their chunks at once)
        if call.step.replay_kept(*call.kept, wait=True) is None: raise RuntimeError("the kept replay declined")
        sync()
    return run


def profile(name: str, run_fg: Any, kernels: list[Any], best_s: float, jitted: Any = None) -> None:
    """Print each kernel's time alone (as launched, and on one thread), their sums against the best call, the replay
    without the runner's copies and dictionaries, and the main thread's CPU time per call."""
    cpu = []
    for _ in range(200):
        t0 = time.thread_time(); run_fg(); cpu.append(time.thread_time() - t0)
    if jitted is not None and (replay := _replay_alone(jitted)) is not None:
        # (call and replay alternated, so both see the same load)
        calls, replays = [], []
        for _ in range(100):
            t0 = time.perf_counter(); run_fg(); calls.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); replay(); replays.append(time.perf_counter() - t0)
        print(f"  {name} call vs its replay alone (alternated, best / median): call {min(calls) * 1e6:7.1f} / "
              f"{np.median(calls) * 1e6:7.1f} us, replay {min(replays) * 1e6:7.1f} / "
              f"{np.median(replays) * 1e6:7.1f} us")
    rows = []
    for ei in kernels:
        launched = _kernel_time(ei)
        with Context(CPU_THREADS=1): one = _kernel_time(ei)
        ops = ei.prg._work(ei.fixedvars)[0]
        rows.append((ei.prg.p.name, launched, one, ops))
    launched_s, one_s = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"  {name} profile: best call {best_s * 1e6:7.1f} us | kernels alone: as launched {launched_s * 1e6:7.1f} "
          f"us, one thread {one_s * 1e6:7.1f} us | main thread CPU per call: min "
          f"{min(cpu) * 1e6:7.1f} us, median {np.median(cpu) * 1e6:7.1f} us")
    for i, (kname, launched, one, ops) in enumerate(rows):
        print(f"    {i:3d} {kname:36s} {launched * 1e6:8.1f} us launched {one * 1e6:8.1f} us one thread "
              f"{ops / one * 1e-9:7.1f} GFLOP/s")
    timeline(name, run_fg, [r[0] for r in rows])


def timeline(name: str, run_fg: Any, names: list[str], calls: int = 20) -> None:
    """The chunks of the fastest of `calls` calls as the C pool's timeline recorded them: when each kernel's chunks
    ran (from the call's start) and on which thread (0: the calling thread, k: worker k)."""
    from fusegrad.runtime.cpu_pool import c_pool
    if (pool := c_pool()) is None: return
    spans: list[tuple[float, float]] = []
    def run() -> None:
        for _ in range(calls):
            t0 = time.perf_counter(); run_fg(); spans.append((t0, time.perf_counter()))
    rows = pool.timeline(run)
    t0, t1 = min(spans, key=lambda s: s[1] - s[0])
    mine = sorted([r for r in rows if t0 <= r[3] <= t1], key=lambda r: r[3])
    if not mine:
        print(f"  {name} timeline: no chunk claimed (the replay runs its kernels whole on the calling thread)")
        return
    first = mine[0][0]
    busy: dict[int, float] = {}
    for r in mine: busy[r[2]] = busy.get(r[2], 0.0) + r[4] - r[3]
    print(f"  {name} timeline of the fastest of {calls} calls: {(t1 - t0) * 1e6:.1f} us, first chunk at "
          f"{(mine[0][3] - t0) * 1e6:.1f} us, last ends at {(max(r[4] for r in mine) - t0) * 1e6:.1f} us; busy per "
          f"thread: " + ", ".join(f"{lane}: {b * 1e6:.1f} us" for lane, b in sorted(busy.items())))
    for job in sorted({r[0] for r in mine}):
        chunks = [r for r in mine if r[0] == job]
        k = job - first
        kname = names[k] if 0 <= k < len(names) else "?"
        print(f"    {k:3d} {kname:36s} " + "  ".join(f"[{c[1]}] thread {c[2]} {(c[3] - t0) * 1e6:6.1f}-"
                                                      f"{(c[4] - t0) * 1e6:6.1f} us" for c in chunks))


def bench(name: str, model: str, batch: int, seq: int | None, blocks: int, per_block: int, tmp: str,
          prof: bool = False) -> None:
    import onnxruntime as ort
    path = os.path.join(tmp, f"{name}.onnx")
    (x,) = export(model, path, batch, seq)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    feed = {in_name: x.numpy()}
    runner = OnnxRunner(path)
    outs = runner.output_names
    jitted = runner.jit()

    def run_fg() -> None: jitted(feed)
    def run_ort() -> None: sess.run(None, feed)
    t0 = time.perf_counter(); run_fg(); first_fg = time.perf_counter() - t0
    t0 = time.perf_counter(); run_ort(); first_ort = time.perf_counter() - t0
    for _ in range(2): run_fg()  # TinyJit captures on the second call
    got = list(jitted(feed).values())
    want = sess.run(None, feed)
    err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    # (the steady figures are of the kernels that stay: the optimized builds of those the first call compiled quickly)
    optimized_kernels()
    times: dict[str, list[float]] = {"fusegrad": [], "onnxruntime": []}
    for _ in range(blocks):
        for label, fn in (("fusegrad", run_fg), ("onnxruntime", run_ort)):
            time.sleep(PAUSE_S)
            for _ in range(per_block):
                t0 = time.perf_counter(); fn(); times[label].append(time.perf_counter() - t0)
    fg, ox = np.median(times["fusegrad"]) * 1e3, np.median(times["onnxruntime"]) * 1e3
    # (the best run too: on a machine shared with other work the median moves with the load, the best much less)
    bfg, box = min(times["fusegrad"]) * 1e3, min(times["onnxruntime"]) * 1e3
    print(f"{name:10s} first run: fusegrad {first_fg * 1e3:9.1f} ms, onnxruntime {first_ort * 1e3:7.1f} ms | median: "
          f"fusegrad {fg:8.3f} ms, onnxruntime {ox:8.3f} ms, ratio {fg / ox:5.2f}x | best: fusegrad {bfg:8.3f} ms, "
          f"onnxruntime {box:8.3f} ms, ratio {bfg / box:5.2f}x | max error {err:.2g} | "
          f"{len(jitted.captured)} kernels | outputs {outs}")
    if prof: profile(name, run_fg, jitted.captured, min(times["fusegrad"]), jitted)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer timed runs")
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    ap.add_argument("--profile", action="store_true", help="each kernel's time alone, against the call's")
    args = ap.parse_args()
    blocks, per_block = (2, 3) if args.quick else (4, 10)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            if name not in CASES: raise SystemExit(f"unknown case {name!r}: {', '.join(CASES)}")
            bench(name, *CASES[name], blocks, per_block, tmp, args.profile)


if __name__ == "__main__":
    main()
