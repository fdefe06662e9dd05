"""BEAM on a machine with an NVIDIA GPU (run by test/gpu/check.sh): a float32 matmul, a half matmul (tensor cores
among the candidates) and a softmax searched with BEAM=2 on CUDA, each result checked against numpy, and the kernel's
device time with the heuristic's opts and with BEAM's printed (not checked: BEAM keeps the heuristic's choice unless
a candidate is faster)."""
from __future__ import annotations
import sys
import numpy as np
from fusegrad import Device, Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import search
from fusegrad.device import Buffer
from fusegrad.engine.realize import CompiledRunner
from fusegrad.helpers import Context
from fusegrad.uop.ops import Ops

DEV = sys.argv[1] if len(sys.argv) > 1 else "CUDA"   # (another GPU-style device, e.g. CL, to try the script)
failed = 0
rng = np.random.default_rng(0)

def device_time(ast, opts=None) -> tuple[float, tuple]:
    prog = get_program(ast, Device[DEV].renderer, opts=opts)
    sizes = {u.arg: u.dtype for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL}
    bufs = [Buffer(DEV, sizes[i].size, sizes[i].base).ensure_allocated() for i in sorted(sizes)]
    r = CompiledRunner(prog)
    r(bufs, {}, wait=True)
    return min(r(bufs, {}, wait=True) or 0.0 for _ in range(5)), tuple(prog.applied_opts)

chosen: list = []   # the opts each BEAM search returned
_beam_opts = search.beam_opts

def _recorded(*args, **kwargs):
    opts = _beam_opts(*args, **kwargs)
    chosen.append(list(opts))
    return opts

search.beam_opts = _recorded

def names(opts) -> list: return [(o.op.name, o.axis, o.arg) for o in opts]

cases = [("float32 matmul 512", lambda a, b: a @ b, (512, 512), dtypes.float32, 1e-4),
         ("half matmul 512", lambda a, b: a @ b, (512, 512), dtypes.half, 2e-2),
         ("softmax 1024x1024", lambda a, b: a.softmax(-1), (1024, 1024), dtypes.float32, 1e-5)]
for name, fn, shape, dt, tol in cases:
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    ts = [Tensor(x, device=DEV).cast(dt).realize() for x in xs]
    # (on the CPU: on a machine with a GPU the default device is CUDA, which would check a kernel against itself)
    want = fn(*[Tensor(x, device="CPU").cast(dt) for x in xs]).cast(dtypes.float32).numpy()
    # (scheduling a tensor takes its kernels: the AST comes from a copy of the expression)
    ast = [si.ast for si in fn(*ts).schedule() if si.ast.op is Ops.SINK][-1]
    chosen.clear()
    with Context(BEAM=2, BEAM_TIMEOUT_S=20): got = fn(*ts).cast(dtypes.float32).numpy()
    err = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
    ok = err <= tol and len(chosen) >= 1
    failed += not ok
    heuristic, hopts = device_time(ast)
    beam, bopts = device_time(ast, chosen[-1]) if chosen else (0.0, ())
    print(f"{'ok  ' if ok else 'FAIL'} {name}: BEAM=2 result against numpy {err:.1e} ({len(chosen)} searches); "
          f"heuristic {heuristic * 1e6:.1f} us {names(hopts)}, BEAM {beam * 1e6:.1f} us {names(bopts)}", flush=True)
print("check_beam:", "FAILED" if failed else "passed")
sys.exit(1 if failed else 0)
