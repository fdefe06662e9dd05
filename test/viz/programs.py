"""The known programs the VIZ tests record, with what they must show."""
import numpy as np
from fusegrad import Tensor
from fusegrad.device import GlobalCounters
from fusegrad.uop.ops import UOp
from fusegrad.uop.pattern import graph_rewrite
from fusegrad.uop.symbolic import symbolic

def symbolic_rewrite() -> tuple[UOp, UOp]:
    """A graph_rewrite of (x*1 + 0) * (y + 0) by the symbolic rules: (input, result)."""
    x, y = UOp.variable("x", 0, 10), UOp.variable("y", 0, 10)
    expr = (x * 1 + 0) * (y + 0)
    return expr, graph_rewrite(expr, symbolic, name="known")

def tensor_program(n: int = 4) -> int:
    """A matmul, relu and sum on fixed data (n x 8 by 8 x n), run twice; returns the number of kernels it ran. (A size
    no other test uses gives a schedule that is not replayed from the process's schedule cache.)"""
    k0 = GlobalCounters.kernel_count
    an = np.array([[float(i + j) for j in range(8)] for i in range(n)])
    bn = np.array([[float(i - j) for j in range(n)] for i in range(8)])
    for _ in range(2):
        assert (Tensor(an) @ Tensor(bn)).relu().sum().item() == np.maximum(an @ bn, 0).sum()
    return GlobalCounters.kernel_count - k0

def jit_mismatch() -> str:
    """A TinyJit with verify=1 whose function reads a Python value changed after the capture; returns the message of
    the JitVerifyError it raises."""
    from fusegrad import TinyJit
    from fusegrad.engine.jit_verify import JitVerifyError
    scale = {"v": 0.5}
    jit = TinyJit(lambda x: (x * scale["v"]).contiguous(), verify=1)
    for i in range(4):
        if i == 2: scale["v"] = 2.0
        try: jit(Tensor([1.0, 2.0, 3.0]).contiguous().realize())
        except JitVerifyError as e: return str(e)
    raise AssertionError("the frozen value was not caught")

def nan_program() -> str:
    """log of a negative number under DEBUG_NANS=1; returns the message of the FloatingPointError it raises."""
    from fusegrad import Context
    try:
        with Context(DEBUG_NANS=1): (Tensor([1.0, -2.0, 3.0]).log() * 2).realize()
    except FloatingPointError as e: return str(e)
    raise AssertionError("the NaN was not caught")

def synthetic_trace(kernels: int = 1500, steps: int = 3, graph_nodes: int = 20000, seed: int = 0) -> dict:
    """A trace the size of a ResNet-50 training step's (about 1500 kernels, each compiled through ten graph rewrites,
    four of which change a graph of ~100 nodes in ~8 steps; a tensor graph of 20000 nodes; `steps` steps of kernel
    runs on the timeline), with the shapes record.py writes. Sizes per kernel follow a recorded MLP step's."""
    import random
    rnd = random.Random(seed)
    ops = ["ADD", "MUL", "LOAD", "STORE", "INDEX", "RANGE", "CONST", "REDUCE", "WHERE", "CAST", "DEFINE_GLOBAL"]
    def table(n: int) -> list:
        return [[rnd.choice(ops), "dtypes.float", str(i % 7) if i % 3 else "",
                 sorted({rnd.randrange(i) for _ in range(min(i, rnd.randint(1, 3)))})] for i in range(n)]
    rules = [[f"fusegrad/codegen/rules.py:{i}", f"lambda x: x  # rule {i}"] for i in range(200)]
    rewrites = []
    for k in range(kernels):
        for j in range(10):
            if j % 10 < 4:
                nodes = table(100)
                st = [[rnd.randrange(50, 100), rnd.randrange(100), rnd.randrange(200)] for _ in range(8)]
                rewrites.append({"matcher": f"pass{j}", "name": "", "caller": "fusegrad/codegen/__init__.py:40 (f)",
                                 "ms": 0.3, "steps": st, "nodes": nodes, "sink": 99, "result": 99})
            else:
                rewrites.append({"matcher": f"pass{j}", "name": "", "caller": "fusegrad/codegen/__init__.py:40 (f)",
                                 "ms": 0.1, "steps": [], "nodes": [], "sink": 0, "result": 0, "size": 80})
    src = "void k(float* restrict a, float* restrict b) {\n" + "  a[i] = b[i] * 2.0f + 1.0f;\n" * 100 + "}\n"
    ks = [{"name": f"r_{k}_64_3", "kind": "SINK", "ast": {"sink": 79, "nodes": table(80)}, "runs": [12.5] * steps,
           "device": "CPU", "src": src, "opts": ["UPCAST 0 4"], "uops": [f"ADD dtypes.float {i}" for i in range(150)],
           "codegen_ms": 3.0, "compile_ms": 40.0, "ops": 1 << 20, "mem": 1 << 18} for k in range(kernels)]
    items = [{"kernel": k, "bufs": [[k * 3 + b, "dtypes.float", 4096, "CPU"] for b in range(4)], "fixedvars": {}}
             for k in range(kernels)]
    why = [{"kind": "reduce", "merged": False,
            "outputs": [["REDUCE_AXIS 8x64x56x56 float", "reduce of a reduce", "a hard boundary", None]]}
           for _ in range(kernels)]
    schedule = {"sink": graph_nodes - 1, "nodes": table(graph_nodes), "replayed": False,
                "owner": {str(i): [i % kernels] for i in range(graph_nodes)}, "items": items,
                "explain": {"tracked": False, "kernels": why},
                "estimate": {"kernels": kernels, "flops": 1 << 36, "bytes": 1 << 32, "new_memory": 1 << 30,
                             "peak_memory": 1 << 31, "predicted_s": 2.5, "live_at_peak": [[1 << 20, "x"]] * 10,
                             "per_kernel": [["reduce", 1 << 20, 1 << 18, 1e-3]] * kernels}}
    events, ts = [], 0.0
    for _ in range(steps):
        events.append({"name": "realize", "cat": "realize", "ph": "X", "ts": ts, "dur": kernels * 20.0,
                       "pid": "python", "tid": "MainThread"})
        for k in range(kernels):
            events.append({"name": f"r_{k}_64_3", "cat": "kernel", "ph": "X", "ts": ts + k * 20.0, "dur": 12.5,
                           "pid": "CPU", "tid": "kernels", "args": {"ops": 1 << 20, "bytes": 1 << 18}})
        ts += kernels * 20.0 + 100
    return {"format": "fusegrad-viz", "version": 1, "schedules": [schedule], "rewrites": rewrites, "kernels": ks,
            "rules": rules, "findings": [], "profile": {"traceEvents": events, "displayTimeUnit": "ms"}}
