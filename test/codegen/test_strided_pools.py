"""Max pools whose window reads every second (third, fourth) pixel of a row: the CPU heuristic upcasts their output
row to a vector (the lowering keeps it as the SIMD axis though every load gathers along it) and unrolls the window's
row. Values against torch: padding, strides 2 to 4, dilation, odd sizes, batch 1, channel counts that no vector
divides, and NaN propagation."""
from __future__ import annotations
import sys
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from test.codegen.helpers import captured_asts

lower = sys.modules["fusegrad.codegen.lower"]
RS = np.random.default_rng(0)

# (shape, kernel, stride, padding, dilation)
CASES = [((16, 16, 16, 16), 3, 2, 1, 1),     # the ResNet-style CNN's stem pool
         ((1, 5, 33, 35), 3, 2, 1, 1),       # batch 1, odd sizes, 5 channels
         ((2, 3, 24, 24), 3, 3, 0, 1),       # stride 3
         ((2, 7, 32, 32), 2, 4, 1, 1),       # stride 4, a 2x2 window
         ((2, 4, 20, 36), 3, 2, 1, 2),       # dilation 2
         ((3, 2, 15, 17), (3, 2), (2, 3), (1, 0), 1),
         ((1, 64, 112, 112), 3, 2, 1, 1)]    # ResNet-18's stem pool at 224 px


def _pool(x: np.ndarray, kernel, stride, padding, dilation) -> tuple[np.ndarray, np.ndarray]:
    ours = Tensor(x).max_pool2d(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation).numpy()
    ref = torch.nn.functional.max_pool2d(torch.tensor(x), kernel, stride, padding, dilation).numpy()
    return ours, ref


@pytest.mark.parametrize("case", CASES)
def test_strided_max_pool_values(case):
    shape, kernel, stride, padding, dilation = case
    x = RS.standard_normal(shape).astype(np.float32)
    ours, ref = _pool(x, kernel, stride, padding, dilation)
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


def test_strided_max_pool_negative_and_nan():
    """All-negative inputs (a padded tap must not win as 0) and NaNs, which propagate to every window they are in."""
    x = -np.abs(RS.standard_normal((2, 3, 17, 18)).astype(np.float32)) - 1
    x[0, 1, 4, 5] = np.nan
    x[1, 2, 0, 0] = np.nan
    x[1, 0, 16, 17] = np.nan
    ours, ref = _pool(x, 3, 2, 1, 1)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    assert np.isnan(ref).sum() >= 3
    np.testing.assert_array_equal(ours[~np.isnan(ref)], ref[~np.isnan(ref)])


def test_strided_max_pool_is_vectorized(monkeypatch: pytest.MonkeyPatch):
    """The 3x3 stride-2 pool's kernel: its output row upcast by a vector's lanes, the window's row unrolled, and the
    lowering takes the row as the vector axis."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((4, 8, 32, 32)).astype(np.float32)
    ours, ref = _pool(x, 3, 2, 1, 1)
    np.testing.assert_array_equal(ours, ref)
    pools = [a for a in asts if any(u.op.name == "REDUCE" and u.arg.name == "MAX" for u in a.toposort())]
    assert len(pools) == 1
    from fusegrad.device import Device
    ren = Device["CPU"].renderer
    k = Kernel(pools[0], ren)
    opts = hand_coded_optimizations(k)
    width = ren.simd_bytes // 4
    assert opts[0].op is OptOps.UPCAST and opts[0].arg in (width, width // 2)
    assert any(o.op is OptOps.UNROLL for o in opts)
    vec = lower.choose_vector_axis(k.get_optimized_ast(), ren)
    assert vec is not None and vec.arg[1] == "upcast"


# (shapes no other test takes: the kernels are compiled here, not taken from the method cache)
@pytest.mark.parametrize("shape", [(12, 64, 32, 32), (2, 5, 33, 35), (1, 3, 18, 20)])
def test_strided_max_pool_gradient(monkeypatch: pytest.MonkeyPatch, shape):
    """The 3x3 stride-2 pool's input gradient (a sum over the windows each pixel is in, their loads gated by the
    pool's phase): values against torch, and on the kernel that stores it, the window unrolled, the row vectorized
    and another output loop's windows side by side (upcast by 4 or 2 where that divides it)."""
    x = RS.standard_normal(shape).astype(np.float32)
    g = RS.standard_normal((shape[0], shape[1], (shape[2] + 1) // 2, (shape[3] + 1) // 2)).astype(np.float32)
    tx = torch.tensor(x, requires_grad=True)
    (torch.nn.functional.max_pool2d(tx, 3, 2, 1) * torch.tensor(g)).sum().backward()
    asts = captured_asts(monkeypatch)
    fx = Tensor(x, requires_grad=True)
    (fx.max_pool2d(kernel_size=3, stride=2, padding=1) * Tensor(g)).sum().backward()
    assert fx.grad is not None and tx.grad is not None
    np.testing.assert_allclose(fx.grad.numpy(), tx.grad.numpy(), rtol=1e-6, atol=1e-6)
    from fusegrad.device import Device
    ren = Device["CPU"].renderer
    stored = [a for a in asts if any(st.src[0].src[0].dtype.size == x.size for st in a.src)]
    assert stored
    opts = hand_coded_optimizations(Kernel(stored[-1], ren))
    if shape == (12, 64, 32, 32) and ren.simd_bytes >= 32:
        ups = [o for o in opts if o.op is OptOps.UPCAST]
        assert any(o.op is OptOps.UNROLL for o in opts) and len(ups) == 2 and ups[1].arg == 4, opts
