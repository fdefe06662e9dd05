"""The GPU benchmark: fusegrad's CUDA device against PyTorch on the same GPU, in one process.

Workloads (`--only NAME` runs those whose name contains NAME):
- matmul 4096^3 in half and bfloat16 (tensor cores on both sides) and float32 with TF32 off (both sides): TFLOP/s;
- a fused elementwise chain over 2^26 floats (fusegrad: one kernel; torch eager: one per op) in GB/s of the chain's
  own reads and writes, against the copy bandwidth measured on the same GPU (torch's device-to-device copy);
- softmax and layernorm over 8192x8192 float32 (the last axis);
- convolutions of ResNet-50's shapes in half at batch 32 (3x3 and 1x1, 56x56 down to 7x7), each its own row;
- GPT-2 124M decoding one token per call with its KV cache (random weights): fusegrad under TinyJit against torch
  eager, tokens per second.

Each side runs in blocks (fusegrad block, torch block, fusegrad block, torch block), each block several calls and one
synchronization at its end; the steady figure is the best block's time per call. The first call of each side is
reported on its own ("first": fusegrad compiles its kernels there, from an empty disk cache). Before anything is
timed, the two sides' results are compared (a row whose results differ is marked DIFFERS). The ratio is fusegrad's
time over torch's (below 1: fusegrad faster); the issue's targets are printed beside it.

Run on a machine with an NVIDIA GPU: python bench/bench_gpu.py [--only softmax] [--quick]
`--device CPU --quick` runs the same rows small on the CPU against torch's CPU (a check of the script itself)."""
from __future__ import annotations
import argparse
import atexit
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Callable

# every first call compiles its kernels
os.environ["XDG_CACHE_HOME"] = CACHE = tempfile.mkdtemp(prefix="bench-gpu-cache-")
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fusegrad import Device, GlobalCounters, Tensor, dtypes  # noqa: E402
from fusegrad.dtype import DType  # noqa: E402
from gpu_sweep import RESNET50_CONVS  # noqa: E402

BLOCK_S = 0.25  # seconds a block of calls lasts (about; at least 2 calls)

class Row:
    """One workload: fusegrad's and torch's calls, what one call moves or computes, and the target ratio."""
    def __init__(self, name: str, ours: Callable[[], object], theirs: Callable[[], object], target: str,
                 flops: float = 0.0, nbytes: float = 0.0, tol: float = 1e-3, per: str = "call"):
        self.name, self.ours, self.theirs, self.target = name, ours, theirs, target
        self.flops, self.nbytes, self.tol, self.per = flops, nbytes, tol, per

def _sync_ours() -> None: Device[Device.DEFAULT].synchronize()

def _sync_theirs() -> None:
    if torch.cuda.is_available(): torch.cuda.synchronize()

def _as_numpy(r: object) -> np.ndarray:
    if isinstance(r, Tensor): return r.cast(dtypes.float32).numpy() if r.dtype != dtypes.float32 else r.numpy()
    if isinstance(r, torch.Tensor): return r.detach().float().cpu().numpy()
    return np.asarray(r)

def _block(fn: Callable[[], object], sync: Callable[[], None], calls: int) -> float:
    st = time.perf_counter()
    for _ in range(calls): fn()
    sync()
    return (time.perf_counter() - st) / calls

def measure(row: Row) -> dict:
    """First call, agreement, and steady seconds per call of each side (blocks A B A B)."""
    res: dict = {}
    for side, fn, sync in (("ours", row.ours, _sync_ours), ("torch", row.theirs, _sync_theirs)):
        GlobalCounters.reset()
        st = time.perf_counter()
        out = _as_numpy(fn())
        res[side + "_first"] = time.perf_counter() - st
        if side == "ours": res["kernels"] = GlobalCounters.kernel_count
        res[side + "_out"] = out
        t1 = _block(fn, sync, 1)  # warm, and an estimate of one call for the block's length
        res[side + "_calls"] = max(2, min(200, int(BLOCK_S / max(t1, 1e-6))))
    a, b = res["ours_out"].astype(np.float64), res["torch_out"].astype(np.float64)
    res["err"] = float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b))))) if a.shape == b.shape else math.inf
    best = {"ours": math.inf, "torch": math.inf}
    for _ in range(2):
        for side, fn, sync in (("ours", row.ours, _sync_ours), ("torch", row.theirs, _sync_theirs)):
            best[side] = min(best[side], _block(fn, sync, res[side + "_calls"]))
    res["ours"], res["torch"] = best["ours"], best["torch"]
    return res

def _fmt_rate(row: Row, s: float) -> str:
    if row.flops: return f"{row.flops / s / 1e12:7.1f} TFLOP/s"
    if row.nbytes: return f"{row.nbytes / s / 1e9:7.0f} GB/s"
    return ""

# *** the workloads ***

def _pair(shape: tuple[int, ...], dt: DType, tdt: torch.dtype, dev: str, tdev: str, rng: np.random.Generator,
          scale: float = 1.0) -> tuple[Tensor, torch.Tensor]:
    """The same random values on both sides, in dt (bfloat16 from float32 values rounded by each side alike)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    t = torch.from_numpy(x).to(tdev, tdt)
    ours = Tensor(x, device=dev).cast(dt).contiguous().realize() if dt != dtypes.float32 else Tensor(x, device=dev)
    return ours.realize(), t

def matmul_rows(dev: str, tdev: str, n: int) -> list[Row]:
    rows = []
    for dt, tdt, name, target in ((dtypes.half, torch.float16, "half", "<= 1.5x"),
                                  (dtypes.bfloat16, torch.bfloat16, "bfloat16", "<= 1.5x"),
                                  (dtypes.float32, torch.float32, "float32 (TF32 off)", "<= 1.5x")):
        rng = np.random.default_rng(0)
        (a, ta), (b, tb) = _pair((n, n), dt, tdt, dev, tdev, rng), _pair((n, n), dt, tdt, dev, tdev, rng)
        rows.append(Row(f"matmul {n}^3 {name}", lambda a=a, b=b: (a @ b).realize(), lambda ta=ta, tb=tb: ta @ tb,
                        target, flops=2.0 * n ** 3, tol=2e-2 if dt != dtypes.float32 else 1e-3))
    return rows

def chain_row(dev: str, tdev: str, n: int) -> Row:
    rng = np.random.default_rng(1)
    (a, ta), (b, tb), (c, tc) = (_pair((n,), dtypes.float32, torch.float32, dev, tdev, rng) for _ in range(3))
    def ours(): return ((a * b + c).relu() * 0.5 - (a * 0.1).exp() * 0.1 + (b - c).abs().sqrt()).realize()
    def theirs(): return (ta * tb + tc).relu() * 0.5 - (ta * 0.1).exp() * 0.1 + (tb - tc).abs().sqrt()
    return Row(f"elementwise chain 2^{int(math.log2(n))} floats", ours, theirs, "<= 0.7x", nbytes=4.0 * n * 4)

def copy_bandwidth(tdev: str, n: int) -> float:
    """Bytes per second of torch's device-to-device copy of n floats (read and write counted), best of 5."""
    src, dst = torch.empty(n, device=tdev), torch.empty(n, device=tdev)
    dst.copy_(src)
    _sync_theirs()
    best = math.inf
    for _ in range(5):
        best = min(best, _block(lambda: dst.copy_(src), _sync_theirs, 10))
    return 8.0 * n / best

def norm_rows(dev: str, tdev: str, n: int) -> list[Row]:
    rng = np.random.default_rng(2)
    x, tx = _pair((n, n), dtypes.float32, torch.float32, dev, tdev, rng)
    w, tw = _pair((n,), dtypes.float32, torch.float32, dev, tdev, rng)
    bias, tb = _pair((n,), dtypes.float32, torch.float32, dev, tdev, rng)
    return [Row(f"softmax {n}x{n}", lambda: x.softmax(-1).realize(), lambda: tx.softmax(-1), "<= 1.0x",
                nbytes=8.0 * n * n),
            Row(f"layernorm {n}x{n}", lambda: (x.layernorm(-1, 1e-5) * w + bias).realize(),
                lambda: F.layer_norm(tx, (n,), tw, tb, 1e-5), "<= 1.0x", nbytes=8.0 * n * n)]

def conv_rows(dev: str, tdev: str, batch: int, shapes=RESNET50_CONVS) -> list[Row]:
    rows = []
    for cin, cout, k, side, stride in shapes:
        rng = np.random.default_rng(3)
        x, tx = _pair((batch, cin, side, side), dtypes.half, torch.float16, dev, tdev, rng)
        w, tw = _pair((cout, cin, k, k), dtypes.half, torch.float16, dev, tdev, rng, scale=1 / math.sqrt(cin * k * k))
        pad = k // 2
        out_side = (side + 2 * pad - k) // stride + 1
        name = f"conv2d half b{batch} {cin}->{cout} {k}x{k} {side}x{side}" + (f" s{stride}" if stride > 1 else "")
        rows.append(Row(name,
                        lambda x=x, w=w, s=stride, p=pad: x.conv2d(w, stride=s, padding=p).realize(),
                        lambda tx=tx, tw=tw, s=stride, p=pad: F.conv2d(tx, tw, stride=s, padding=p), "<= 2.0x",
                        flops=2.0 * batch * cout * out_side * out_side * cin * k * k, tol=2e-2))
    return rows

def gpt2_row(dev: str, tdev: str, layers: int) -> Row:
    """Greedy decoding of one token per call with a KV cache, positions cycling over 64 rows after a 5-token prompt;
    fusegrad under TinyJit (the example's model), torch eager with the same weights (bench_train's torch GPT-2)."""
    import gpt2
    from bench_train import _torch_gpt2_block, _torch_gpt2_head
    from fusegrad.nn.state import get_state_dict
    cfg = gpt2.Config(n_layer=layers)
    Tensor.manual_seed(0)
    model = gpt2.GPT2(cfg)
    sd = {k: torch.from_numpy(v.numpy()).to(tdev) for k, v in get_state_dict(model).items() if "cache" not in k}
    prompt, span = [464, 3616, 286, 1204, 318], 64
    ours_state = {"tok": int(model(Tensor([prompt]), 0).numpy()[0, -1].argmax()), "n": 0}
    def ours() -> np.ndarray:
        out = model(Tensor([[ours_state["tok"]]]), len(prompt) + ours_state["n"] % span).numpy()[0, -1]
        ours_state["tok"], ours_state["n"] = int(out.argmax()), ours_state["n"] + 1
        return out
    hd = cfg.dim // cfg.n_head
    kcache = [torch.zeros(1, cfg.n_head, cfg.max_context, hd, device=tdev) for _ in range(cfg.n_layer)]
    vcache = [torch.zeros(1, cfg.n_head, cfg.max_context, hd, device=tdev) for _ in range(cfg.n_layer)]
    @torch.no_grad()
    def forward(tokens: list[int], p: int) -> torch.Tensor:
        x = sd["wte.weight"][torch.tensor(tokens, device=tdev)].reshape(1, len(tokens), -1) + \
            sd["wpe.weight"][p:p + len(tokens)]
        for i in range(cfg.n_layer):
            def attend(q, k, v, i=i):
                kcache[i][:, :, p:p + len(tokens)], vcache[i][:, :, p:p + len(tokens)] = k, v
                return F.scaled_dot_product_attention(q, kcache[i][:, :, :p + len(tokens)],
                                                      vcache[i][:, :, :p + len(tokens)], is_causal=len(tokens) > 1)
            x = _torch_gpt2_block(sd, cfg, i, x, attend)
        return _torch_gpt2_head(sd, cfg, x[:, -1])[0]
    torch_state = {"tok": int(forward(prompt, 0).argmax().item()), "n": 0}
    def theirs() -> np.ndarray:
        out = forward([torch_state["tok"]], len(prompt) + torch_state["n"] % span).cpu().numpy()
        torch_state["tok"], torch_state["n"] = int(out.argmax()), torch_state["n"] + 1
        return out
    return Row(f"GPT-2 124M decode ({layers} layers), TinyJit vs eager", ours, theirs, ">= 1.0x tok/s",
               tol=1e-2, per="token")

def rows_for(dev: str, tdev: str, quick: bool) -> list[tuple[str, Callable[[], list[Row]]]]:
    """Builders of the rows (built one at a time, so each row's buffers are freed before the next), each with the
    words of its rows' names (a builder none of whose rows `--only` can pick isn't run)."""
    n_mm, n_chain, n_norm, batch = (256, 1 << 16, 256, 2) if quick else (4096, 1 << 26, 8192, 32)
    convs = RESNET50_CONVS[:2] if quick else RESNET50_CONVS
    return [("matmul half bfloat16 float32 (tf32 off)", lambda: matmul_rows(dev, tdev, n_mm)),
            ("elementwise chain floats", lambda: [chain_row(dev, tdev, n_chain)]),
            ("softmax layernorm", lambda: norm_rows(dev, tdev, n_norm)),
            ("conv2d half", lambda: conv_rows(dev, tdev, batch, convs)),
            ("gpt-2 124m decode layers tinyjit vs eager", lambda: [gpt2_row(dev, tdev, 2 if quick else 12)])]

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="CUDA", help="fusegrad's device (default CUDA; torch runs on cuda beside it, "
                                                       "or on its CPU when fusegrad's device is the CPU)")
    ap.add_argument("--only", action="append", default=[], help="run only rows whose name contains this")
    ap.add_argument("--quick", action="store_true", help="small sizes (a check of the script)")
    args = ap.parse_args()
    dev = Device.canonicalize(args.device)
    Device.DEFAULT = dev
    tdev = "cuda" if dev.startswith("CUDA") else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if tdev == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"{torch.cuda.get_device_name(0)}: {props.multi_processor_count} SMs; fusegrad {dev} "
              f"({getattr(Device[dev], 'arch', '?')}), torch {torch.__version__}")
    else:
        torch.set_num_threads(os.cpu_count() or 1)
        print(f"fusegrad {dev} against torch {torch.__version__} on the CPU")
    copy_bw = copy_bandwidth(tdev, (1 << 26) if not args.quick else (1 << 20))
    print(f"copy bandwidth (torch device-to-device, read + write): {copy_bw / 1e9:.0f} GB/s\n")
    print(f"{'row':52s} {'fusegrad':>10s} {'torch':>10s} {'ratio':>7s} {'target':>14s}  {'first (fg / torch)':>20s}"
          f"  kernels  rate (fusegrad / torch)")
    for words, build in rows_for(dev, tdev, args.quick):
        if args.only and not any(w in o.lower() or o.lower() in words for o in args.only for w in words.split()):
            continue
        try: rows = build()
        except Exception as e:  # a row that can't be built is reported, and the others still run
            print(f"  (a row failed to build: {type(e).__name__}: {e})")
            continue
        for row in rows:
            if args.only and not any(o.lower() in row.name.lower() for o in args.only): continue
            try: r = measure(row)
            except Exception as e:
                print(f"{row.name:52s} FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            flag = "" if r["err"] <= row.tol else f"  DIFFERS (max relative difference {r['err']:.1e})"
            rate = f"{_fmt_rate(row, r['ours'])} / {_fmt_rate(row, r['torch'])}" if row.flops or row.nbytes else \
                f"{1 / r['ours']:.0f} / {1 / r['torch']:.0f} {row.per}s/s"
            if row.nbytes and not row.flops: rate += f" ({row.nbytes / r['ours'] / copy_bw:.0%} of copy)"
            print(f"{row.name:52s} {r['ours'] * 1e3:8.3f}ms {r['torch'] * 1e3:8.3f}ms {r['ours'] / r['torch']:6.2f}x "
                  f"{row.target:>14s}  {r['ours_first']:8.2f}s / {r['torch_first']:6.2f}s  {r['kernels']:7d}  {rate}"
                  f"{flag}", flush=True)
        del rows

if __name__ == "__main__":
    main()
