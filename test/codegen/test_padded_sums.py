"""A float sum among several reductions of a row (a cross-entropy's sum of exp over a vocabulary of 50257) padded to
whole vectors where each lane still adds more than lowering's blocked length: its lanes as the heuristic chooses them,
and its values against torch, with infinite and nan rows."""
from __future__ import annotations
import math
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.lower import SUM_BLOCKED_OVER
from fusegrad.codegen.opt import Kernel
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX2, AVX512, renderer_like

RS = np.random.default_rng(0)

def sum_of_exp_lanes(cols: int, facts: tuple[int, int]) -> list[int]:
    """The lanes of each float sum of exp in log_softmax's kernel over rows of `cols`."""
    t = Tensor(np.ones((4, cols), np.float32)).realize().log_softmax(-1)
    (ast,) = [ei.ast for ei in t.schedule() if ei.ast.op is Ops.SINK]
    k = Kernel(ast, renderer_like(facts))
    hand_coded_optimizations(k)
    return [math.prod(range_size(r) for r in red.src[1:] if r in k.expanded) for red in k.ast.toposort()
            if red.op is Ops.REDUCE and red.arg is Ops.ADD and any(u.op is Ops.EXP2 for u in red.src[0].toposort())]

@pytest.mark.parametrize("cols,facts,lanes", [(50257, AVX2, 8), (50257, AVX512, 8), (32771, AVX2, 4),
                                              (32771, AVX512, 4), (40009, AVX2, 8), (8191, AVX2, 1)])
def test_sum_of_exp_lanes(cols: int, facts: tuple[int, int], lanes: int):
    """Padded to the widest of a full, half or quarter vector whose every lane keeps over SUM_BLOCKED_OVER terms, so
    lowering blocks each lane's sum (50257 / 8, not / 16; 32771 / 4, not / 8, which is just under); scalar where even a
    quarter vector's lanes would keep fewer (8191 / 2)."""
    width = facts[0] // 4
    if lanes > 1:
        assert cols // lanes > SUM_BLOCKED_OVER and (lanes == width or cols // (2 * lanes) <= SUM_BLOCKED_OVER)
    else: assert cols // max(2, width // 4) <= SUM_BLOCKED_OVER
    assert sum_of_exp_lanes(cols, facts) == [lanes]

def _rows(cols: int) -> np.ndarray:
    x = (RS.standard_normal((5, cols)) * 3).astype(np.float32)
    x[1, 17] = np.inf
    x[2, :] = -np.inf
    x[3, cols - 1] = np.nan
    x[4, 5], x[4, cols // 2] = -np.inf, 80.0
    return x

@pytest.mark.parametrize("cols", [50257, 40009])
def test_log_softmax_and_cross_entropy_of_long_rows(cols: int):
    """log_softmax and cross-entropy (per row) over long rows of odd length with +inf, all -inf, nan and huge entries:
    the same nans and infinities as torch, the rest within float32 rounding of a blocked sum."""
    x = _rows(cols)
    y = RS.integers(0, cols, 5).astype(np.int32)
    np.testing.assert_allclose(Tensor(x).log_softmax(-1).numpy(),
                               torch.log_softmax(torch.tensor(x, dtype=torch.float64), -1).numpy(), rtol=1e-5,
                               atol=1e-5)
    ours = Tensor(x).sparse_categorical_crossentropy(Tensor(y), reduction="none").numpy()
    ref = torch.nn.functional.cross_entropy(torch.tensor(x, dtype=torch.float64), torch.tensor(y).long(),
                                            reduction="none").numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)

def test_sum_of_exp_of_equal_logits_is_exact_enough():
    """softmax of 50257 equal logits: every probability 1/50257 to float32 rounding (the sum's rounding doesn't grow
    with the row)."""
    out = Tensor(np.full((2, 50257), 0.1, np.float32)).softmax(-1).numpy()
    np.testing.assert_allclose(out, 1 / 50257, rtol=2e-6)
