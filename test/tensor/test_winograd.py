"""conv2d by Winograd's F(4x4, 3x3) (tensor/nn.py): values and gradients against torch's convolution in float64 for
paddings 0-2 (asymmetric too), outputs that aren't whole tiles, bias; and which convolutions take it (WINO, the
size gate, the cases it doesn't cover)."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Context, Tensor
from fusegrad.tensor import nn as fnn

torch.set_num_threads(1)

@pytest.fixture
def small_gate(monkeypatch):
    """Winograd for every eligible convolution, however small (the gate's sizes are about speed, not correctness)."""
    monkeypatch.setattr(fnn, "WINO_MIN_CHANNELS", 1)
    monkeypatch.setattr(fnn, "WINO_MIN_TILES", 1)
    monkeypatch.setattr(fnn, "WINO_MIN_FLOPS", 0)

def _uses_winograd(xs: tuple, ws: tuple, dtype=np.float32, **kw) -> bool:
    """Whether conv2d of inputs of these shapes (fresh buffers) schedules a kernel that reads the input transform's
    matrix. (Scheduling points a graph at buffers it doesn't fill, so the probe has its own inputs.)"""
    x, w = Tensor(np.zeros(xs, dtype)), Tensor(np.zeros(ws, dtype))
    matrix = fnn._wino_matrices(x.device)[0]._buffer()
    return any(any(b is matrix for b in si.bufs) for si in x.conv2d(w, **kw).schedule())

CASES = [
    ((2, 5, 8, 8), 7, 1),            # whole tiles
    ((1, 3, 9, 6), 4, 1),            # 9x6: partial tiles along both dims
    ((2, 4, 5, 5), 3, 0),            # valid convolution: a 3x3 output, one partial tile
    ((1, 2, 4, 7), 5, 2),            # padding 2: a 6x9 output
    ((1, 3, 7, 10), 2, (1, 2)),      # padding 1 on the rows, 2 on the columns
    ((1, 2, 6, 6), 3, [1, 0, 2, 1]), # flat (left, right, top, bottom)
    ((1, 2, 1, 1), 3, 1),            # a single pixel
    ((1, 2, 3, 54), 3, 1),           # 14 tiles a row, padded to 16
]

def _torch_conv(X, W, B, padding):
    xt = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    bt = None if B is None else torch.tensor(B, dtype=torch.float64, requires_grad=True)
    if isinstance(padding, list): out = torch.nn.functional.conv2d(torch.nn.functional.pad(xt, padding), wt, bt)
    else: out = torch.nn.functional.conv2d(xt, wt, bt, padding=padding)
    return xt, wt, bt, out

@pytest.mark.parametrize("xs,cout,padding", CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_values_and_gradients_match_torch(small_gate, xs, cout, padding, bias, training):
    # (in training the output is copied from tiles into image rows, and the gradients' convolutions are too)
    rng = np.random.default_rng(sum(xs) + cout)
    X = rng.standard_normal(xs).astype(np.float32)
    W = rng.standard_normal((cout, xs[1], 3, 3)).astype(np.float32)
    B = rng.standard_normal(cout).astype(np.float32) if bias else None
    x, w = Tensor(X, requires_grad=True), Tensor(W, requires_grad=True)
    b = Tensor(B, requires_grad=True) if bias else None
    assert _uses_winograd(xs, W.shape, padding=padding)
    xt, wt, bt, ref = _torch_conv(X, W, B, padding)
    G = rng.standard_normal(ref.shape).astype(np.float32)
    with Tensor.train(training):
        out = x.conv2d(w, b, padding=padding)
        assert out.shape == tuple(ref.shape)
        (out * Tensor(G)).sum().backward()
    (ref * torch.tensor(G, dtype=torch.float64)).sum().backward()
    # (float32 transforms: sums of up to 25 terms with coefficients up to 25, so a few ulps of the largest term)
    expect = ref.detach().numpy()
    np.testing.assert_allclose(out.numpy(), expect, rtol=0, atol=2e-5 * (np.abs(expect).max() + 1))
    for mine, theirs in ((x, xt), (w, wt)) + (((b, bt),) if bias else ()):
        g = theirs.grad.numpy()
        np.testing.assert_allclose(mine.grad.numpy(), g, rtol=0, atol=2e-5 * (np.abs(g).max() + 1))

def test_training_copies_the_tiles_into_rows(small_gate):
    # in training, what reads the output are reductions (a batch norm's statistics), which load image rows as
    # vectors: the output is a buffer of rows, so a mean over it takes one copy kernel more than in inference,
    # where the mean reads the tiles.
    # The two forms of the same shapes are distinct templates: each mode gets its own, however they alternate.
    rng = np.random.default_rng(3)
    X, W = rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    ref = torch.nn.functional.conv2d(torch.tensor(X, dtype=torch.float64), torch.tensor(W, dtype=torch.float64),
                                     padding=1).numpy()
    x, w = Tensor(X), Tensor(W)
    counts = {}
    for training in (False, True, False, True):
        with Tensor.train(training):
            # (a schedule handed out isn't run: the count is of a probe over buffers of its own)
            probe = Tensor(X).conv2d(Tensor(W), padding=1).mean(axis=(0, 2, 3))
            counts.setdefault(training, set()).add(len(probe.schedule()))
            out = x.conv2d(w, padding=1)
            # the statistics a batch norm takes in training, and the values, whichever form computed them
            np.testing.assert_allclose(out.mean(axis=(0, 2, 3)).numpy(), ref.mean(axis=(0, 2, 3)), rtol=0, atol=1e-5)
            np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert len(counts[False]) == len(counts[True]) == 1
    assert counts[True].pop() == counts[False].pop() + 1

def test_matches_the_direct_convolution_at_the_gated_size():
    # the default gate: 16x64x32x32 (bench_cpu's convolution) takes Winograd; WINO=0 computes it directly
    rng = np.random.default_rng(1)
    X = rng.standard_normal((16, 64, 32, 32)).astype(np.float32)
    W = (rng.standard_normal((64, 64, 3, 3)) / 24).astype(np.float32)
    x, w = Tensor(X), Tensor(W)
    assert _uses_winograd(X.shape, W.shape, padding=1)
    with Context(WINO=0):
        assert not _uses_winograd(X.shape, W.shape, padding=1)
        direct = x.conv2d(w, padding=1).numpy()
    ref = torch.nn.functional.conv2d(torch.tensor(X, dtype=torch.float64), torch.tensor(W, dtype=torch.float64),
                                     padding=1).numpy()
    wino = x.conv2d(w, padding=1).numpy()
    np.testing.assert_allclose(direct, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_allclose(wino, ref, rtol=0, atol=2e-5 * np.abs(ref).max())

@pytest.mark.parametrize("kw,why", [
    (dict(stride=2, padding=1), "stride"), (dict(dilation=2, padding=2), "dilation"),
    (dict(padding=3), "padding over 2"), (dict(padding=-1), "a crop"), (dict(groups=2, padding=1), "groups"),
])
def test_other_convolutions_stay_direct(small_gate, kw, why):
    rng = np.random.default_rng(2)
    X = rng.standard_normal((1, 4, 12, 12)).astype(np.float32)
    W = rng.standard_normal((4, 4 // kw.get("groups", 1), 3, 3)).astype(np.float32)
    assert not _uses_winograd(X.shape, W.shape, **kw), why
    out = Tensor(X).conv2d(Tensor(W), **kw)
    pad = kw.pop("padding")
    xt = torch.tensor(X) if pad >= 0 else torch.tensor(X)[:, :, -pad:pad, -pad:pad]   # (torch doesn't crop)
    ref = torch.nn.functional.conv2d(xt, torch.tensor(W), padding=max(pad, 0), **kw).numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_other_dtypes_stay_direct(small_gate, dtype):
    assert not _uses_winograd((1, 4, 8, 8), (4, 4, 3, 3), np.dtype(dtype), padding=1)

def test_small_convolutions_stay_direct():
    # the default gate: few channels, few tiles or little work compute directly (Winograd's fixed cost would dominate)
    # (32 tiles: ResNet-18's 128 channels of 8x8 at batch 8, its last layers at 224px)
    for xs, cout in (((8, 32, 16, 16), 32), ((2, 512, 7, 7), 512), ((1, 64, 14, 14), 64), ((4, 128, 8, 8), 128),
                     ((8, 128, 8, 8), 128), ((8, 512, 7, 7), 512)):
        assert not _uses_winograd(xs, (cout, xs[1], 3, 3), padding=1), xs
    # and where it pays: 64 tiles of 512 channels (training's batch of 16), one 56x56 image of 64 channels
    for xs, cout in (((16, 512, 7, 7), 512), ((1, 64, 56, 56), 64), ((16, 64, 16, 16), 64), ((16, 128, 8, 8), 128)):
        assert _uses_winograd(xs, (cout, xs[1], 3, 3), padding=1), xs

def test_too_small_input_raises_conv2d_error(small_gate):
    with pytest.raises(ValueError, match="larger than the input"):
        Tensor.ones(1, 2, 1, 1).conv2d(Tensor.ones(2, 2, 3, 3))

@pytest.mark.parametrize("device", ["LLVM", "PYTHON"])
def test_other_backends(small_gate, device: str):
    # the transforms are ordinary nodes and the matrices buffers on the convolution's device
    if device == "LLVM": pytest.importorskip("llvmlite")
    rng = np.random.default_rng(6)
    X, W = rng.standard_normal((1, 3, 6, 7)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    out = Tensor(X, device=device).conv2d(Tensor(W, device=device), padding=1)
    assert out.device == device
    ref = torch.nn.functional.conv2d(torch.tensor(X, dtype=torch.float64), torch.tensor(W, dtype=torch.float64),
                                     padding=1).numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
