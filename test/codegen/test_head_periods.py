"""Matmuls whose operand is read from an attention layout (batch, heads, tokens, head size): along the heads' columns
and the batch's tokens its index divides and takes modulo the head size and the sequence length. The CPU heuristic's
register tile and K blocks divide those periods; values against NumPy, and the opts."""
from __future__ import annotations
import numpy as np
import pytest
import fusegrad.codegen as codegen
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from test.codegen.helpers import AVX2, captured_asts, renderer_like

RS = np.random.default_rng(0)


def _heads_weight_grad(b: int, h: int, t: int, d: int, o: int) -> tuple[np.ndarray, np.ndarray]:
    """g.T @ x with x (b, h, t, d) seen as (b * t, h * d), as a Linear's weight gradient after attention: ours and
    NumPy's in float64."""
    x4 = RS.standard_normal((b, h, t, d)).astype(np.float32)
    g = RS.standard_normal((b * t, o)).astype(np.float32)
    x = Tensor(x4).permute(0, 2, 1, 3).reshape(b * t, h * d)
    ours = (Tensor(g).T @ x).numpy()
    ref = g.T.astype(np.float64) @ x4.transpose(0, 2, 1, 3).reshape(b * t, h * d)
    return ours, ref


@pytest.mark.parametrize("shape", [(4, 2, 128, 64, 96), (3, 3, 160, 32, 40), (2, 1, 200, 48, 17), (5, 2, 96, 24, 7)])
def test_heads_weight_grad_values(shape):
    """Head sizes of 64, 32, 48 and 24, sequences that 128 doesn't divide, rows that no vector or tile divides."""
    ours, ref = _heads_weight_grad(*shape)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.sqrt(shape[0] * shape[2]))


def test_heads_weight_grad_opts(monkeypatch: pytest.MonkeyPatch):
    """4 sequences of 144 tokens, 2 heads of 64, 48 output rows (a shape no other test compiles): on AVX2 the tile
    along the heads' columns is 4 (6 would straddle two heads), the K loop is blocked by a sequence (144, where the
    largest block of 128 to 512 would be 288) and not unrolled."""
    asts = captured_asts(monkeypatch)
    ours, ref = _heads_weight_grad(4, 2, 144, 64, 48)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-3)
    (ast,) = [a for a in asts if any(st.src[0].src[0].dtype.size == 48 * 128 for st in a.src)]
    k = Kernel(codegen.collapse_gathers(ast), renderer_like(AVX2))
    opts = hand_coded_optimizations(k)
    assert [o.arg for o in opts if o.op is OptOps.KBLOCK] == [144], opts
    assert not any(o.op is OptOps.UNROLL for o in opts), opts
    upcasts = [o.arg for o in opts if o.op is OptOps.UPCAST]
    assert 4 in upcasts and 6 not in upcasts, opts
