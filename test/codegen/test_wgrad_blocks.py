"""Weight gradients vectorized along the image rows they sum over, with inputs bigger than the caches: the batch is
blocked through the output (KBLOCK), a block of images at a time. Values against torch (padding, stride 2, dilation,
batch 1, channel counts that no tile divides) and the opts."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import WGRAD_BLOCK_BYTES, hand_coded_optimizations
from test.codegen.helpers import AVX2, captured_asts, renderer_like

RS = np.random.default_rng(0)


def _weight_grad(x: np.ndarray, w: np.ndarray, stride: int, padding: int, dilation: int):
    """The gradient into w of sum(conv2d(x, w) * g) for a random g: ours and torch's."""
    tx, tw = torch.tensor(x), torch.tensor(w, requires_grad=True)
    tout = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=padding, dilation=dilation)
    g = RS.standard_normal(tuple(tout.shape)).astype(np.float32)
    (tout * torch.tensor(g)).sum().backward()
    assert tw.grad is not None
    fw = Tensor(w, requires_grad=True)
    (Tensor(x).conv2d(fw, stride=stride, padding=padding, dilation=dilation) * Tensor(g)).sum().backward()
    assert fw.grad is not None
    return fw.grad.numpy(), tw.grad.numpy()


def _opts_of_kernel_storing(asts: list, size: int) -> list:
    """The heuristic's opts (for an AVX2 target) of the one captured kernel that stores `size` elements."""
    (ast,) = [a for a in asts if any(st.src[0].src[0].dtype.size == size for st in a.src)]
    return hand_coded_optimizations(Kernel(ast, renderer_like(AVX2)))


# (batch, input channels, output channels, image side, stride, padding, dilation): each input over a megabyte
SHAPES = [(4, 16, 16, 64, 1, 1, 1), (3, 12, 20, 72, 1, 1, 1), (8, 16, 8, 64, 2, 1, 1), (4, 16, 16, 64, 1, 2, 2),
          (1, 64, 16, 72, 1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_blocked_weight_gradient_values(shape):
    n, ci, co, side, stride, pad, dil = shape
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = _weight_grad(x, w, stride, pad, dil)
    # (sums of about 16k products: compared relative to their size)
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))


def test_blocked_weight_gradient_opts(monkeypatch: pytest.MonkeyPatch):
    """4 images of 8 channels at 64x64 to 16 channels (1.5 MB of image and output gradient): the weight gradient's
    batch is KBLOCKed in blocks of 2 images (under a megabyte of the two inputs), its sum vectorized along the image
    rows. (A shape no other test here compiles: a kernel compiled before isn't generated again.)"""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((4, 8, 64, 64)).astype(np.float32)
    w = (RS.standard_normal((16, 8, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = _weight_grad(x, w, 1, 1, 1)
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
    opts = _opts_of_kernel_storing(asts, w.size)
    blocks = [o for o in opts if o.op is OptOps.KBLOCK]
    assert len(blocks) == 1 and blocks[0].arg == 2
    assert 3 * x.nbytes > WGRAD_BLOCK_BYTES >= 3 * x.nbytes // 2


@pytest.mark.parametrize("n", [4, 3])
def test_narrow_weight_gradient_unrolls_its_batch(monkeypatch: pytest.MonkeyPatch, n: int):
    """Rows of 12 pixels summed in 4-lane vectors on AVX2 (half its vectors; padded to 16 they'd be a quarter
    padding, and 16 registers take no window tile): not blocked, the batch unrolled by 2 where 2 divides it (an odd
    batch keeps its loop). Values against torch on this machine."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, 8, 12, 12)).astype(np.float32)
    w = (RS.standard_normal((12, 8, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = _weight_grad(x, w, 1, 1, 1)
    np.testing.assert_allclose(ours, ref, rtol=1e-3, atol=1e-3 * float(np.abs(ref).max()))
    opts = _opts_of_kernel_storing(asts, w.size)
    assert not any(o.op in (OptOps.KBLOCK, OptOps.PADTO) for o in opts), opts
    assert any(o.op is OptOps.UPCAST and o.arg == 4 for o in opts), opts
    unrolls = [o for o in opts if o.op is OptOps.UNROLL]
    assert unrolls == ([] if n % 2 else [unrolls[0]]) and (n % 2 or unrolls[0].arg == 2), opts


@pytest.mark.parametrize("rows", [5, 3])
def test_few_rows_times_a_big_matrix_is_no_weight_gradient(monkeypatch: pytest.MonkeyPatch, rows: int):
    """A prompt's few tokens times a big transposed matrix (5 x 768 @ 768 x 12000): its small row loop isn't a window
    (a row steps over the whole contraction), so its contraction is neither blocked nor unrolled as a weight
    gradient's batch. Values against NumPy."""
    asts = captured_asts(monkeypatch)
    h = RS.standard_normal((rows, 768)).astype(np.float32)
    w = RS.standard_normal((12000, 768)).astype(np.float32)
    out = (Tensor(h) @ Tensor(w).T).numpy()
    np.testing.assert_allclose(out, h.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)
    opts = _opts_of_kernel_storing(asts, out.size)
    assert not any(o.op in (OptOps.KBLOCK, OptOps.UNROLL) for o in opts), opts
