"""An elementwise kernel that also stores a per-row value (a batch norm's inverse deviation beside its normalized
rows: one kernel with two outputs) is shaped by its rows' store: tiles read as image rows get their remainder loops
upcast as they do alone (`heuristic._store_loop`, then `_upcast_remainder_rows`). The opts for an AVX-512 machine,
and the values against NumPy."""
from __future__ import annotations
import numpy as np
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, Opt, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX512, renderer_like

RS = np.random.default_rng(5)

def _tiles_as_rows(t: Tensor, v: Tensor, n: int, c: int) -> tuple[Tensor, Tensor]:
    """Winograd's output tiles (4, 4, channels, batch, 4, 4) read as 16x16 image rows, normalized by the inverse
    deviation from `v` and relu'd; and that inverse deviation."""
    inv = (v + 1e-5).rsqrt()
    rows = t.permute(3, 2, 4, 0, 5, 1).reshape(n, c, 16, 16)
    return (rows * inv.reshape(1, c, 1, 1)).relu(), inv

def test_rows_and_their_statistic_in_one_kernel():
    n, c = 8, 64
    t_np = RS.standard_normal((4, 4, c, n, 4, 4)).astype(np.float32)
    v_np = RS.random(c).astype(np.float32)
    y, inv = _tiles_as_rows(Tensor(t_np).realize(), Tensor(v_np).realize(), n, c)
    (ast,) = [si.ast for si in Tensor.schedule(y, inv) if si.ast.op is Ops.SINK]
    assert len(ast.src) == 2, "one kernel stores both"
    assert hand_coded_optimizations(Kernel(ast, renderer_like(AVX512))) == [Opt(OptOps.UPCAST, 3, 4),
                                                                         Opt(OptOps.UPCAST, 2, 4)]
    y, inv = _tiles_as_rows(Tensor(t_np), Tensor(v_np), n, c)
    Tensor.realize(y, inv)
    want_inv = 1 / np.sqrt(v_np.astype(np.float64) + 1e-5)
    rows = t_np.transpose(3, 2, 4, 0, 5, 1).reshape(n, c, 16, 16)
    np.testing.assert_allclose(inv.numpy(), want_inv, rtol=1e-5)
    np.testing.assert_allclose(y.numpy(), np.maximum(rows * want_inv.reshape(1, c, 1, 1), 0), rtol=1e-5, atol=1e-6)
