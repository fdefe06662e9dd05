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
