"""A reduction left in scalar code (its loads strided along every loop) sums several outputs side by side
(`heuristic._independent_sums`): the opts, and the values against NumPy for sums and maxes over strided views, channel
counts that 4 doesn't divide, and reductions too short to upcast for."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, Opt, OptOps
from fusegrad.codegen.opt import heuristic
from fusegrad.codegen.opt.heuristic import INDEPENDENT_SUMS, hand_coded_optimizations
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX512, renderer_like

RS = np.random.default_rng(3)

def _opts(t: Tensor) -> list:
    ast = [si.ast for si in t.schedule() if si.ast.op is Ops.SINK][-1]
    return hand_coded_optimizations(Kernel(ast, renderer_like(AVX512)))

@pytest.mark.parametrize("channels,lanes", [(128, INDEPENDENT_SUMS), (18, 2), (7, 1), (6, 1)])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_strided_reduction_sums_channels_side_by_side(monkeypatch: pytest.MonkeyPatch, channels: int, lanes: int,
                                                       op: str):
    """A sum (max) over every other pixel of 16 images of 16x16: nothing is contiguous, so each channel's chain of
    64 x 16 additions is scalar; the channels are upcast by 4, by 2 where 4 doesn't divide them (18: 9 pairs, enough
    for 2 cores to split), not at all for 7, nor for 6 (3 pairs or 2 quads would keep one of 2 cores idle a third
    of the time)."""
    monkeypatch.setattr(heuristic.os, "cpu_count", lambda: 2)
    x = RS.standard_normal((16, channels, 16, 16)).astype(np.float32)
    view = lambda t: t[:, :, ::2, ::2]  # noqa: E731
    got = getattr(view(Tensor(x)), op)((0, 2, 3))
    opts = _opts(getattr(view(Tensor(x).realize()), op)((0, 2, 3)))
    upcasts = [o for o in opts if o.op is OptOps.UPCAST]
    assert upcasts == ([] if lanes == 1 else [Opt(OptOps.UPCAST, 0, lanes)]), opts
    want = getattr(view(x).astype(np.float64), op)((0, 2, 3))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)

def test_short_reductions_keep_one_sum():
    """Two images' 2x2 every-other pixels (8 steps): too short a chain to upcast for."""
    x = RS.standard_normal((2, 64, 4, 4)).astype(np.float32)
    opts = _opts(Tensor(x).realize()[:, :, ::2, ::2].sum((0, 2, 3)))
    assert not any(o.op is OptOps.UPCAST for o in opts), opts
    np.testing.assert_allclose(Tensor(x)[:, :, ::2, ::2].sum((0, 2, 3)).numpy(),
                               x[:, :, ::2, ::2].astype(np.float64).sum((0, 2, 3)), rtol=1e-5, atol=1e-5)
