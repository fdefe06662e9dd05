"""python -m fusegrad.onnx model.onnx [--input NAME=FILE.npy] [--dim NAME=SIZE] [--validate] [--bench N]

Runs a model on given inputs (.npy files) or random ones, prints each output's shape and a few values; --validate
compares with onnxruntime on the same inputs, --bench times runs and counts the kernels of one."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from fusegrad import GlobalCounters, Tensor, dtypes
from fusegrad.onnx.errors import OnnxError
from fusegrad.onnx.onnx_dtypes import np_name
from fusegrad.onnx.runner import OnnxRunner


def random_inputs(runner: OnnxRunner, dims: dict[str, int], seed: int, int_high: int) -> dict[str, np.ndarray]:
    """Random inputs of the declared dtypes and shapes: normal floats, ints in [0, int_high), random bools. A symbolic
    dim takes its size from `dims` (1 where not given)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (dt, shape) in runner.input_specs.items():
        if shape is None: raise SystemExit(f"input {name!r} has no declared shape: give it with --input")
        size = tuple(d if isinstance(d, int) and d > 0 else dims.get(str(d), 1) for d in shape)
        dt = dt or dtypes.float32
        if dt == dtypes.bool: out[name] = rng.random(size) < 0.5
        elif dtypes.is_float(dt):
            out[name] = rng.standard_normal(size).astype(np.float32 if dt == dtypes.bfloat16 else np_name(dt))
        else: out[name] = rng.integers(0, int_high, size).astype(np_name(dt))
    return out


def _parse_pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it: raise SystemExit(f"{what} must be NAME=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusegrad.onnx", description=__doc__.split("\n\n")[1])
    ap.add_argument("model", help="path of the .onnx file")
    ap.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input from a .npy file")
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=SIZE", help="size of a symbolic input dim")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--int-high", type=int, default=10, help="random int inputs are in [0, INT_HIGH)")
    ap.add_argument("--validate", action="store_true", help="compare the outputs with onnxruntime's")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--bench", type=int, default=0, metavar="N", help="time N runs after a first one")
    args = ap.parse_args(argv)
    try:
        runner = OnnxRunner(args.model)
        dims = {k: int(v) for k, v in _parse_pairs(args.dim, "--dim").items()}
        feed = random_inputs(runner, dims, args.seed, args.int_high) if runner.input_specs else {}
        for k, path in _parse_pairs(args.input, "--input").items(): feed[k] = np.load(path)
        t0 = time.perf_counter()
        GlobalCounters.reset()
        out = {k: v.numpy() for k, v in runner(feed).items()}
        first = time.perf_counter() - t0
        kernels = GlobalCounters.kernel_count
    except OnnxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, v in out.items():
        print(f"{k}: {v.dtype} {v.shape} {np.array2string(v.reshape(-1)[:6], precision=5)}")
    print(f"first run: {first * 1e3:.1f} ms (compiling included), {kernels} kernels")
    if args.bench:
        times = []
        for _ in range(args.bench):
            t0 = time.perf_counter()
            GlobalCounters.reset()
            res = runner(feed)
            Tensor.realize(*res.values())
            for v in res.values(): v.numpy()
            times.append(time.perf_counter() - t0)
        print(f"bench: {args.bench} runs, median {np.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms, "
              f"{GlobalCounters.kernel_count} kernels per run")
    if args.validate:
        import onnxruntime as ort
        sess = ort.InferenceSession(args.model, providers=["CPUExecutionProvider"])
        ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
        bad = 0
        for k, want in ref.items():
            got = out[k]
            if got.shape != want.shape:
                print(f"validate {k}: shape {got.shape} != onnxruntime's {want.shape}")
                bad += 1
                continue
            g, w = got.astype(np.float64), np.asarray(want).astype(np.float64)
            err = float(np.max(np.abs(g - w), initial=0.0))
            ok = np.allclose(g, w, rtol=args.rtol, atol=args.atol, equal_nan=True)
            bad += not ok
            print(f"validate {k}: max abs error {err:.3g} {'ok' if ok else 'MISMATCH'}")
        if bad: return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
