"""fusegrad.onnx against onnxruntime (CPU execution provider) on models exported with torch.onnx.export: the
ResNet-style CNN at batch 1 and 16, the BERT-style encoder at sequence 128, the MobileNet-style model. Both run in
this process on the same inputs, in alternating blocks (A B A B), onnxruntime with as many threads as there are cores;
fusegrad's call is `OnnxRunner.jit()`: NumPy arrays in and out as onnxruntime's `run`, the kernels replayed by
TinyJit with prune=True (the model's initializers don't change between calls, so what is computed from them alone, a
strided convolution's weight layout, runs once). Each side's median and best run are reported, the first run of each
(fusegrad's includes compiling) apart, and the kernels a replay runs.

    .venv/bin/python bench/bench_onnx.py [--quick] [--only resnet1,resnet16,encoder,mobilenet]"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from fusegrad.onnx import OnnxRunner  # noqa: E402
from test.onnx.models import export  # noqa: E402

CASES = {"resnet1": ("resnet", 1, None), "resnet16": ("resnet", 16, None), "encoder": ("encoder", 1, 128),
         "mobilenet": ("mobilenet", 1, None)}


def bench(name: str, model: str, batch: int, seq: int | None, blocks: int, per_block: int, tmp: str) -> None:
    import onnxruntime as ort
    path = os.path.join(tmp, f"{name}.onnx")
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (x,) = export(model, path, batch, seq)
    logging.disable(logging.NOTSET)
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
    times: dict[str, list[float]] = {"fusegrad": [], "onnxruntime": []}
    for _ in range(blocks):
        for label, fn in (("fusegrad", run_fg), ("onnxruntime", run_ort)):
            for _ in range(per_block):
                t0 = time.perf_counter(); fn(); times[label].append(time.perf_counter() - t0)
    fg, ox = np.median(times["fusegrad"]) * 1e3, np.median(times["onnxruntime"]) * 1e3
    # (the best run too: on a machine shared with other work the median moves with the load, the best much less)
    bfg, box = min(times["fusegrad"]) * 1e3, min(times["onnxruntime"]) * 1e3
    print(f"{name:10s} first run: fusegrad {first_fg * 1e3:9.1f} ms, onnxruntime {first_ort * 1e3:7.1f} ms | median: "
          f"fusegrad {fg:8.3f} ms, onnxruntime {ox:8.3f} ms, ratio {fg / ox:5.2f}x | best: fusegrad {bfg:8.3f} ms, "
          f"onnxruntime {box:8.3f} ms, ratio {bfg / box:5.2f}x | max error {err:.2g} | "
          f"{len(jitted.captured)} kernels | outputs {outs}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer timed runs")
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    args = ap.parse_args()
    blocks, per_block = (2, 3) if args.quick else (4, 10)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            if name not in CASES: raise SystemExit(f"unknown case {name!r}: {', '.join(CASES)}")
            bench(name, *CASES[name], blocks, per_block, tmp)


if __name__ == "__main__":
    main()
