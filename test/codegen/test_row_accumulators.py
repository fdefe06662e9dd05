"""How many vector accumulators each reduction of a row keeps, as the heuristic chooses them for AVX2 and AVX-512:
several independent ones for a cheap reduction along a long row (a max or a sum: with one, each step waits on the one
before), one for a reduction whose elements take a transcendental function (softmax's exp). The values these kernels
compute are checked against torch in test/tensor/test_row_reductions.py."""
import math
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX2, AVX512, renderer_like

def kernel_ast(t: Tensor) -> UOp:
    (ast,) = [ei.ast for ei in t.schedule() if ei.ast.op is Ops.SINK]
    return ast

def accumulators(ast: UOp, facts: tuple[int, int]) -> list[tuple[Ops, bool, int]]:
    """Each reduction of the optimized kernel: (its op, whether it computes a transcendental function, its lanes: the
    product of its upcast loops)."""
    k = Kernel(ast, renderer_like(facts))
    hand_coded_optimizations(k)
    out = []
    for red in (u for u in k.ast.toposort() if u.op is Ops.REDUCE):
        costly = any(u.op in (Ops.EXP2, Ops.LOG2) for u in red.src[0].toposort())
        out.append((red.arg, costly, math.prod(range_size(r) for r in red.src[1:] if r in k.expanded)))
    return out

def row(cols: int) -> Tensor: return Tensor(np.ones((4, cols), np.float32)).realize()

@pytest.mark.parametrize("facts,lanes", [(AVX2, 8), (AVX512, 16)])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layernorm", "argmax"])
def test_cheap_reductions_of_a_long_row_keep_four_vectors(facts: tuple[int, int], lanes: int, op: str):
    reds = accumulators(kernel_ast(getattr(row(4096), op)(-1)), facts)
    assert len(reds) >= 2
    for red_op, costly, n in reds:
        # (softmax's sum of exp stays one vector: its arithmetic, not the chain of adds, bounds it)
        assert n == (lanes if costly else 4 * lanes), (op, red_op, costly, n)

@pytest.mark.parametrize("facts,lanes", [(AVX2, 8), (AVX512, 16)])
def test_padded_rows_keep_four_vectors(facts: tuple[int, int], lanes: int):
    """A vocabulary of 50257 (prime to any vector width) is padded to whole groups of four vectors, with one
    reduction per row or several."""
    for t in (row(50257).max(axis=1), row(50257).argmax(axis=1)):
        reds = accumulators(kernel_ast(t), facts)
        assert reds and all(n == 4 * lanes for _, _, n in reds), reds

def test_short_rows_keep_one_vector():
    """A row of fewer than 16 vectors keeps one accumulator per reduction: the combination after the loop would
    cost more than the chain."""
    for _, _, n in accumulators(kernel_ast(row(64).argmax(axis=1)), AVX2):
        assert n == 8
