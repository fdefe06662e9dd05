"""Neural-network functions (convolution, pooling, resizing, padding modes, losses, attention, einsum, normalization)
compared with torch.nn.functional on random inputs: forward value, shape and dtype, and the gradient of every float
input. Each case realizes its output and all its gradients together, so their kernels compile as one batch."""
from __future__ import annotations
from typing import Callable
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Tensor, dtypes
from fusegrad.dtype import to_torch_dtype

torch.set_num_threads(1)

def _rand(*shape: int, seed: int = 0, low: float = -2.0, high: float = 2.0) -> np.ndarray:
    rng = np.random.default_rng(seed + 31 * len(shape) + sum(shape))
    return rng.uniform(low, high, size=shape).astype(np.float32)

def _np(x: Tensor | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor): return x.detach().float().numpy() if x.dtype == torch.bfloat16 else \
        x.detach().numpy()
    return (x.float() if x.dtype == dtypes.bfloat16 else x).numpy()

def check(fg_fn: Callable, th_fn: Callable, *inputs: np.ndarray, grad: bool = True, atol: float = 1e-5,
          rtol: float = 1e-4, dtype: str | None = None, nograd: tuple[int, ...] = ()) -> None:
    """Run fg_fn on fusegrad tensors and th_fn on torch tensors made from the same arrays; compare the output (value,
    shape, dtype) and, with grad, the gradient of sum(out * g) for a random g with respect to every float input."""
    tdt = getattr(torch, dtype) if dtype else None
    ts = [torch.tensor(a, dtype=tdt if a.dtype.kind == "f" and tdt else None) for a in inputs]
    fs = [Tensor(a) if not (a.dtype.kind == "f" and dtype) else Tensor(a).cast(dtype) for a in inputs]
    diff = [i for i, a in enumerate(inputs) if a.dtype.kind == "f" and i not in nograd] if grad else []
    for i in diff: ts[i].requires_grad_(True)
    ref = th_fn(*ts)
    out = fg_fn(*fs)
    outs = [out]
    if diff:
        g = _rand(*ref.shape, seed=99)
        (ref.float() * torch.tensor(g)).sum().backward()
        outs += (out.float() * Tensor(g)).sum().gradient(*[fs[i] for i in diff])
    Tensor.realize(*outs)
    assert out.shape == tuple(ref.shape), f"shape {out.shape} != {tuple(ref.shape)}"
    assert to_torch_dtype(out.dtype) == ref.dtype, f"dtype {out.dtype} != {ref.dtype}"
    np.testing.assert_allclose(_np(out), _np(ref), atol=atol, rtol=rtol, equal_nan=True)
    for i, gr in zip(diff, outs[1:]):
        assert gr.shape == inputs[i].shape
        np.testing.assert_allclose(_np(gr), _np(ts[i].grad), atol=atol * 10, rtol=rtol * 10,
                                   err_msg=f"gradient of input {i}")

# *** convolution ***

@pytest.mark.parametrize("xs,ws,kw", [
    ((2, 4, 7, 6), (6, 2, 3, 2), dict(groups=2, stride=(2, 1), dilation=(1, 2), padding=(1, 0))),
    ((1, 3, 5, 5), (4, 3, 3, 3), dict(padding=1)),
    ((2, 2, 9), (3, 2, 3), dict(stride=2, dilation=2, padding=2)),
    ((1, 2, 4, 5, 3), (2, 1, 2, 3, 2), dict(groups=2, padding=(1, 0, 1))),
    ((2, 3, 6, 5), (3, 1, 2, 2), dict(groups=3, stride=3)),
], ids=["2d-groups-stride-dil", "2d-same", "1d", "3d", "depthwise-stride>k"])
def test_conv(xs, ws, kw):
    check(lambda x, w, b: x.conv2d(w, b, **kw), lambda x, w, b: F.conv2d(x, w, b, **kw) if len(xs) == 4 else
          (F.conv1d if len(xs) == 3 else F.conv3d)(x, w, b, **kw), _rand(*xs), _rand(*ws, seed=1),
          _rand(ws[0], seed=2))

def test_conv_per_side_padding():
    # tinygrad's 2*dims form is the flat torch pad order (left, right, top, bottom)
    check(lambda x, w: x.conv2d(w, padding=(1, 2, 0, 1)), lambda x, w: F.conv2d(F.pad(x, (1, 2, 0, 1)), w),
          _rand(1, 2, 5, 4), _rand(3, 2, 2, 3, seed=1))

def test_conv_noncontiguous_input_and_no_bias():
    check(lambda x, w: x.permute(0, 1, 3, 2).flip(2).conv2d(w, stride=2),
          lambda x, w: F.conv2d(x.permute(0, 1, 3, 2).flip(2), w, stride=2), _rand(2, 2, 6, 7), _rand(3, 2, 3, 3))

def test_conv_half_and_dtype():
    check(lambda x, w: x.conv2d(w, padding=1), lambda x, w: F.conv2d(x, w, padding=1), _rand(1, 2, 4, 4),
          _rand(2, 2, 3, 3, seed=1), dtype="float16", atol=1e-2, rtol=1e-2, grad=False)
    out = Tensor(_rand(1, 2, 4, 4)).conv2d(Tensor(_rand(2, 2, 3, 3)), dtype=dtypes.float64)
    assert out.dtype == dtypes.float64

def test_conv_empty_batch():
    out = Tensor.zeros(0, 2, 5, 5).conv2d(Tensor.ones(3, 2, 3, 3), padding=1)
    assert out.shape == (0, 3, 5, 5) and out.numpy().shape == (0, 3, 5, 5)

def test_conv_errors():
    x, w = Tensor.ones(1, 4, 5, 5), Tensor.ones(6, 2, 3, 3)
    with pytest.raises(ValueError, match="channels"): x.conv2d(Tensor.ones(6, 3, 3, 3))
    with pytest.raises(ValueError, match="groups"): x.conv2d(Tensor.ones(5, 2, 3, 3), groups=2)
    with pytest.raises(ValueError, match="bias"): x.conv2d(w, Tensor.ones(5), groups=2)
    with pytest.raises(ValueError, match="dims"): x.conv2d(Tensor.ones(6, 4, 3))
    with pytest.raises(ValueError, match="padding"): x.conv2d(w, groups=2, padding=(1, 1, 1))
    with pytest.raises(ValueError, match="larger"): x.conv2d(Tensor.ones(6, 2, 7, 7), groups=2)
    with pytest.raises(ValueError, match="stride"): x.conv2d(w, groups=2, stride=0)

@pytest.mark.parametrize("xs,ws,kw", [
    ((2, 4, 3, 4), (4, 3, 3, 2), dict(groups=2, stride=2, padding=1, output_padding=1)),
    ((1, 2, 5), (2, 3, 3), dict(stride=3, dilation=2, padding=2, output_padding=2)),
    ((1, 2, 3, 3), (2, 2, 2, 2), dict()),
    # strided: one stride-1 convolution per output phase, interleaved
    ((2, 3, 5, 4), (3, 2, 2, 3), dict(stride=3)),                                  # phases without taps
    ((1, 2, 6), (2, 3, 3), dict(stride=2, dilation=2, padding=1)),                 # dilation shares the stride's factor
    ((1, 2, 5), (2, 2, 5), dict(stride=4, dilation=3, padding=3, output_padding=2)),
    ((1, 2, 4, 3), (2, 2, 3, 3), dict(stride=(2, 1), padding=(1, 0))),             # strided along one dim only
    ((1, 2, 3, 2, 3), (2, 2, 2, 3, 2), dict(stride=2, padding=1, output_padding=1)),
], ids=["2d-groups", "1d-dilated", "plain", "stride3-empty-phases", "dilation-gcd", "1d-s4-d3", "2d-mixed-stride",
        "3d"])
def test_conv_transpose(xs, ws, kw):
    th = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}[len(xs)]
    check(lambda x, w, b: x.conv_transpose2d(w, b, **kw), lambda x, w, b: th(x, w, b, **kw), _rand(*xs),
          _rand(*ws, seed=1), _rand(ws[1] * kw.get("groups", 1), seed=2))

def test_conv_transpose_errors():
    with pytest.raises(ValueError, match="output_padding"):
        Tensor.ones(1, 2, 3, 3).conv_transpose2d(Tensor.ones(2, 2, 2, 2), stride=2, output_padding=2)
    with pytest.raises(ValueError, match="channels"): Tensor.ones(1, 3, 3, 3).conv_transpose2d(Tensor.ones(2, 2, 2, 2))

# *** pooling ***

POOL_CASES = [
    dict(kernel_size=(2, 2)),
    dict(kernel_size=(3, 3), stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0)),
    dict(kernel_size=(2, 3), stride=2, ceil_mode=True),
]

@pytest.mark.parametrize("kw", POOL_CASES, ids=str)
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool2d(kw, count_include_pad):
    th = dict(kw, kernel_size=kw["kernel_size"])
    check(lambda x: x.avg_pool2d(**kw, count_include_pad=count_include_pad),
          lambda x: F.avg_pool2d(x, **th, count_include_pad=count_include_pad), _rand(2, 3, 7, 6))

def test_avg_pool_1d_3d_noncontiguous():
    check(lambda x: x.flip(-1).avg_pool2d((3,), stride=2, padding=1), lambda x: F.avg_pool1d(x.flip(-1), 3, 2, 1),
          _rand(2, 3, 8))
    check(lambda x: x.permute(0, 1, 4, 3, 2).avg_pool2d((2, 2, 2)), lambda x: F.avg_pool3d(x.permute(0, 1, 4, 3, 2), 2),
          _rand(1, 2, 4, 5, 4))

@pytest.mark.parametrize("kw", POOL_CASES + [dict(kernel_size=(3, 3), stride=1, dilation=2, padding=1)], ids=str)
def test_max_pool2d(kw):
    x = np.random.default_rng(3).permutation(2 * 3 * 7 * 6).reshape(2, 3, 7, 6).astype(np.float32) / 10  # no ties
    check(lambda x: x.max_pool2d(**kw), lambda x: F.max_pool2d(x, **kw), x)
    out, ind = Tensor(x).max_pool2d(**kw, return_indices=True)
    rout, rind = F.max_pool2d(torch.tensor(x), **kw, return_indices=True)
    Tensor.realize(out, ind)
    assert ind.dtype == dtypes.int32
    np.testing.assert_array_equal(ind.numpy(), rind.numpy())
    np.testing.assert_array_equal(out.numpy(), rout.numpy())

@pytest.mark.parametrize("kw", POOL_CASES + [dict(kernel_size=(3, 3), stride=1, dilation=2, padding=1)], ids=str)
def test_max_pool2d_ties_go_to_the_first_maximum(kw):
    # values from {0, 1, 2}: most windows hold tied maxima, whose gradient torch gives to the first in window order
    x = np.random.default_rng(4).integers(0, 3, (2, 3, 7, 6)).astype(np.float32)
    x[0, 0, 0, 0] = np.nan
    check(lambda x: x.max_pool2d(**kw), lambda x: F.max_pool2d(x, **kw), x)

@pytest.mark.parametrize("h,kw", [(3, dict(kernel_size=(3, 1), dilation=2, ceil_mode=True)),
                                  (2, dict(kernel_size=(2, 2), stride=2, dilation=(2, 1), ceil_mode=True))], ids=str)
def test_ceil_mode_window_longer_than_the_input(h, kw):
    # (fuzz_torch seeds 137, 238) the dilated kernel spans more rows than the input has: with ceil_mode torch still
    # makes one window, reaching past the end; fusegrad refused the shape
    x = np.random.default_rng(5).permutation(2 * 3 * h * 7).reshape(2, 3, h, 7).astype(np.float32) / 10
    check(lambda x: x.max_pool2d(**kw), lambda x: F.max_pool2d(x, **kw), x)
    for cip in (True, False):
        check(lambda x: x.avg_pool2d((h + 1, 1), ceil_mode=True, count_include_pad=cip),
              lambda x: F.avg_pool2d(x, (h + 1, 1), ceil_mode=True, count_include_pad=cip), x)
    # without ceil_mode there is no window, as torch's "output size is too small"
    with pytest.raises(ValueError, match="larger than the padded input"):
        Tensor(x).max_pool2d(**dict(kw, ceil_mode=False))

def test_clamps_pass_the_gradient_of_nan_as_torch():
    x = np.array([np.nan, -2.0, -0.5, 0.0, 0.5, 2.0, 7.0], np.float32)
    check(lambda x: x.relu(), lambda x: F.relu(x), x)
    check(lambda x: x.hardtanh(), lambda x: F.hardtanh(x), x)
    check(lambda x: x.relu6(), lambda x: F.relu6(x), x)
    check(lambda x: x.hardsigmoid(), lambda x: F.hardsigmoid(x), x)
    check(lambda x: x.clip(-1, 1), lambda x: x.clamp(-1, 1), x)

def test_max_pool_window_unrolled():
    # a max pool of relu(batch norm) and its backward (which counts the taps equal to the max) vectorize nothing: the
    # 2x2 window is unrolled instead, on this machine and on AVX-512 and AVX2 ones (whose quarter vector, two lanes,
    # would take a row of the window whole). Values and gradients against torch, ties included (relu makes zeros).
    from fusegrad.codegen import optimize
    from fusegrad.engine.realize import lower_schedule_item
    from test.codegen.helpers import AVX2, AVX512, renderer_like
    x, w = _rand(4, 8, 8, 8, seed=5), _rand(1, 8, 1, 1, seed=6)
    check(lambda x, w: (x * w).relu().max_pool2d(2), lambda x, w: F.max_pool2d((x * w).relu(), 2), x, w)
    tx = Tensor(x, requires_grad=True)
    items = (tx * Tensor(w)).relu().max_pool2d(2).sum().gradient(tx)[0].schedule()
    def unrolled(opts: list) -> bool:
        return any(o and all(op.op.name == "UNROLL" and op.arg == 0 for op in o) for o in opts)
    opts = [lower_schedule_item(si).prg.p.applied_opts for si in items if si.ast.op.name == "SINK"]
    assert unrolled(opts), opts
    for facts in (AVX512, AVX2):
        opts = [optimize(si.ast, renderer_like(facts))[1] for si in items if si.ast.op.name == "SINK"]
        assert unrolled(opts), (facts, opts)

def test_strided_max_pool_backward_vectorized():
    # ResNet's stem pool (3x3, stride 2, padding 1) in training: the backward's first maximum (a max, then a max over
    # the positions of the taps equal to it, both over gated windows) takes its output row as a vector with each
    # window's row unrolled, and the gradient (each input pixel summing the gated windows of its phase) unrolls the
    # window and upcasts its row; both were scalar loops (4.3 and 4.1 ms at 16x64x32x32, now 0.6 and 2.1). Values and
    # gradients against torch, ties included (relu makes zeros); the opts on this machine and AVX-512 and AVX2 ones.
    from fusegrad.codegen import optimize
    from fusegrad.engine.realize import lower_schedule_item
    from test.codegen.helpers import AVX2, AVX512, renderer_like
    x, w = _rand(2, 4, 16, 16, seed=7), _rand(1, 4, 1, 1, seed=8)
    check(lambda x, w: (x * w).relu().max_pool2d(3, 2, padding=1),
          lambda x, w: F.max_pool2d((x * w).relu(), 3, 2, 1), x, w)
    tx = Tensor(x, requires_grad=True)
    items = [si for si in (tx * Tensor(w)).relu().max_pool2d(3, 2, padding=1).sum().gradient(tx)[0].schedule()
             if si.ast.op.name == "SINK"]
    def reductions(si) -> list[str]: return [u.arg.name for u in si.ast.toposort() if u.op.name == "REDUCE"]
    first_max = next(si for si in items if reductions(si) == ["MAX", "MAX"])
    gradient = next(si for si in items if reductions(si) == ["ADD"])
    def vector_and_unrolled(opts: list) -> bool:
        return any(o.op.name == "UPCAST" and o.arg >= 4 for o in opts) and any(o.op.name == "UNROLL" for o in opts)
    for si in (first_max, gradient):
        assert vector_and_unrolled(lower_schedule_item(si).prg.p.applied_opts)
        for facts in (AVX512, AVX2):
            assert vector_and_unrolled(optimize(si.ast, renderer_like(facts))[1]), facts

def test_max_pool_inf_nan_int_1d():
    x = _rand(1, 2, 8)
    x[0, 0, 2], x[0, 1, 5], x[0, 1, 0] = np.inf, -np.inf, np.nan
    out, ind = Tensor(x).max_pool2d((3,), stride=2, padding=1, return_indices=True)
    rout, rind = F.max_pool1d(torch.tensor(x), 3, 2, 1, return_indices=True)
    Tensor.realize(out, ind)
    np.testing.assert_array_equal(out.numpy(), rout.numpy())
    np.testing.assert_array_equal(ind.numpy(), rind.numpy())
    xi = np.arange(-20, 20, dtype=np.int32).reshape(1, 1, 5, 8)
    out = Tensor(xi).max_pool2d((2, 2))
    assert out.dtype == dtypes.int32 and (out.numpy() == F.max_pool2d(torch.tensor(xi).float(), 2).int().numpy()).all()

def test_pool_errors():
    x = Tensor.ones(1, 1, 4, 4)
    with pytest.raises(ValueError, match="at most half"): x.max_pool2d((2, 2), padding=2)
    with pytest.raises(ValueError, match="larger"): x.avg_pool2d((5, 5))
    with pytest.raises(ValueError, match="stride"): x.max_pool2d((2, 2), stride=(1, 2, 3))
    with pytest.raises(ValueError, match="dims"): Tensor.ones(3).max_pool2d((2, 2))

def test_max_unpool2d():
    x = np.random.default_rng(4).permutation(2 * 2 * 6 * 4).reshape(2, 2, 6, 4).astype(np.float32)
    pooled, ind = F.max_pool2d(torch.tensor(x), 2, return_indices=True)
    pv = pooled.numpy()
    check(lambda p: p.max_unpool2d(Tensor(ind.numpy()), (2, 2)), lambda p: F.max_unpool2d(p, ind, 2), pv)
    x = np.random.default_rng(4).permutation(2 * 2 * 6 * 5).reshape(2, 2, 6, 5).astype(np.float32)
    pooled, ind = F.max_pool2d(torch.tensor(x), 2, return_indices=True)
    pv = pooled.numpy()
    check(lambda p: p.max_unpool2d(Tensor(ind.numpy()), (2, 2), output_size=(2, 2, 6, 5)),
          lambda p: F.max_unpool2d(p, ind, 2, output_size=(6, 5)), pv)
    with pytest.raises(ValueError, match="shape"): Tensor(pv).max_unpool2d(Tensor(ind.numpy())[:, :1])

# *** padding modes, unfold, interpolate ***

@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_pad_modes(mode):
    check(lambda x: x.pad((1, 2, 2, 1), mode=mode), lambda x: F.pad(x, (1, 2, 2, 1), mode=mode), _rand(2, 3, 4, 5))
    # the per-dim (before, after) form, a non-contiguous input and a negative (cropping) amount
    check(lambda x: x.permute(0, 2, 1).pad((None, (0, -1), (3, 0)), mode=mode),
          lambda x: F.pad(x.permute(0, 2, 1), (3, 0, 0, -1), mode=mode), _rand(2, 4, 5))

def test_pad_constant_value_and_errors():
    check(lambda x: x.pad((1, 1), value=-2.5), lambda x: F.pad(x, (1, 1), value=-2.5), _rand(3, 2))
    x = Tensor.ones(2, 3)
    with pytest.raises(ValueError, match="mode"): x.pad((1, 1), mode="wrap")
    with pytest.raises(ValueError, match="reflect"): x.pad((3, 0), mode="reflect")
    with pytest.raises(ValueError, match="circular"): x.pad((4, 0), mode="circular")
    with pytest.raises(ValueError, match="even"): x.pad((1, 1, 1))
    with pytest.raises(ValueError, match="value"): x.pad((1, 1), mode="reflect", value=1.0)

@pytest.mark.parametrize("dim,size,step", [(0, 2, 1), (-1, 3, 2), (1, 4, 4), (1, 0, 1)])
def test_unfold(dim, size, step):
    check(lambda x: x.unfold(dim, size, step), lambda x: x.unfold(dim, size, step), _rand(5, 7, 3),
          grad=size > 0)

def test_unfold_errors():
    with pytest.raises(ValueError, match="size"): Tensor.ones(3, 4).unfold(1, 5, 1)
    with pytest.raises(ValueError, match="step"): Tensor.ones(3, 4).unfold(1, 2, 0)
    with pytest.raises(IndexError): Tensor.ones(3, 4).unfold(2, 2, 1)

@pytest.mark.parametrize("mode,align", [("nearest", False), ("nearest-exact", False), ("linear", False),
                                        ("linear", True)])
@pytest.mark.parametrize("size", [(10, 4), (3, 9), (12, 20), (2, 1)], ids=str)
def test_interpolate_2d(mode, align, size):
    tm = "bilinear" if mode == "linear" else mode
    check(lambda x: x.interpolate(size, mode=mode, align_corners=align),
          lambda x: F.interpolate(x, size, mode=tm, align_corners=align if mode == "linear" else None),
          _rand(2, 3, 6, 5))

@pytest.mark.parametrize("shape,size", [((2, 3, 6, 5), (12, 10)), ((1, 2, 4, 4), (16, 32)), ((1, 1, 1, 3), (2, 24)),
                                        ((2, 2, 7, 3), (14, 7)), ((1, 2, 5), (40,)), ((1, 1, 2, 3, 4), (4, 6, 8))],
                         ids=str)
def test_interpolate_linear_by_powers_of_two(shape, size):
    # upsampling by 2, 4, 8 along a dim takes views and multiply-adds (no weight matrix): values and gradients
    # against torch, including single elements (both neighbours are the element itself) and mixed factors
    tm = {3: "linear", 4: "bilinear", 5: "trilinear"}[len(shape)]
    check(lambda x: x.interpolate(size, mode="linear"), lambda x: F.interpolate(x, size, mode=tm), _rand(*shape))
    if all(o % i == 0 and (o // i) & (o // i - 1) == 0 for i, o in zip(shape[2:], size)):
        kernels = [si.ast for si in Tensor(_rand(*shape)).interpolate(size).schedule() if si.ast.op.name == "SINK"]
        assert not any(u.op.name == "REDUCE" for k in kernels for u in k.toposort()), "a matmul with a weight matrix"

def test_interpolate_1d_3d_half():
    check(lambda x: x.interpolate((7,), align_corners=True), lambda x: F.interpolate(x, 7, mode="linear",
          align_corners=True), _rand(1, 2, 4))
    check(lambda x: x.interpolate((3, 4, 5), mode="trilinear"), lambda x: F.interpolate(x, (3, 4, 5),
          mode="trilinear"), _rand(1, 2, 2, 3, 4))
    check(lambda x: x.interpolate((8, 8), mode="nearest"), lambda x: F.interpolate(x, (8, 8)), _rand(1, 1, 3, 4),
          dtype="float16", atol=1e-3, grad=False)
    with pytest.raises(ValueError, match="mode"): Tensor.ones(1, 1, 2, 2).interpolate((3, 3), mode="cubic")
    with pytest.raises(ValueError, match="align_corners"):
        Tensor.ones(1, 1, 2, 2).interpolate((3, 3), mode="nearest", align_corners=True)
    # integer images interpolate in their own dtype (tinygrad's and torch's uint8 images)
    img = np.array([[[3, 200, 17]]], dtype=np.uint8)
    got = Tensor(img).interpolate((7,), mode="nearest")
    assert got.dtype == dtypes.uint8
    np.testing.assert_array_equal(got.numpy(), F.interpolate(torch.tensor(img), 7, mode="nearest").numpy())

# *** losses ***

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_indices(reduction, smoothing):
    y = np.array([[0, 2, 1], [3, 1, 0]], dtype=np.int64)
    check(lambda x, y: x.cross_entropy(y, reduction=reduction, label_smoothing=smoothing),
          lambda x, y: F.cross_entropy(x, y, reduction=reduction, label_smoothing=smoothing), _rand(2, 4, 3), y)

def test_cross_entropy_probs_ignore_index_1d():
    p = np.random.default_rng(5).dirichlet(np.ones(5), size=4).astype(np.float32)
    check(lambda x, y: x.cross_entropy(y, label_smoothing=0.1), lambda x, y: F.cross_entropy(x, y,
          label_smoothing=0.1), _rand(4, 5), p)
    p3 = np.random.default_rng(6).dirichlet(np.ones(3), size=(2, 4)).astype(np.float32).transpose(0, 2, 1).copy()
    check(lambda x, y: x.cross_entropy(y, "none"), lambda x, y: F.cross_entropy(x, y, reduction="none"),
          _rand(2, 3, 4), p3)
    y = np.array([1, -100, 4, 0], dtype=np.int64)
    check(lambda x, y: x.cross_entropy(y), lambda x, y: F.cross_entropy(x, y), _rand(4, 5), y)
    check(lambda x, y: x.cross_entropy(y), lambda x, y: F.cross_entropy(x, y), _rand(5), np.array(3))
    with pytest.raises(ValueError, match="target shape"): Tensor.ones(4, 5).cross_entropy(Tensor([1, 2]))
    with pytest.raises(ValueError, match="reduction"): Tensor.ones(4, 5).cross_entropy(Tensor([1, 2, 3, 4]), "avg")

def test_sparse_categorical_crossentropy():
    y = np.array([[1, -1, 3], [0, 2, 2]], dtype=np.int32)
    for red in ("mean", "sum", "none"):
        check(lambda x, y: x.sparse_categorical_crossentropy(y, label_smoothing=0.1, reduction=red),
              lambda x, y: F.cross_entropy(x.permute(0, 2, 1), y.long(), ignore_index=-1, label_smoothing=0.1,
                                           reduction=red), _rand(2, 3, 4), y)
    with pytest.raises(TypeError, match="integers"): Tensor.ones(2, 3).sparse_categorical_crossentropy(Tensor.ones(2))

@pytest.mark.parametrize("ignore_index", [-1, 2, 7])
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
def test_sparse_categorical_crossentropy_without_smoothing(ignore_index: int, red: str):
    # (the mean with an ignored label outside the classes is one sum over every row and class: values and gradients
    # must still be torch's, with ignored rows in the batch and an ignore_index that is a class)
    y = np.array([[1, -1, 3], [0, 2, 2], [7, 3, 1]], dtype=np.int32)
    y = np.where(y == 7, ignore_index, y).astype(np.int32)
    check(lambda x, y: x.sparse_categorical_crossentropy(y, ignore_index=ignore_index, reduction=red),
          lambda x, y: F.cross_entropy(x.permute(0, 2, 1), y.long(), ignore_index=ignore_index, reduction=red),
          _rand(3, 3, 4), np.where(y == -1, ignore_index, y).astype(np.int32) if ignore_index != -1 else y)

def test_sparse_categorical_crossentropy_masked_logit():
    # a class ruled out with a -inf logit: without label smoothing its log-probability (-inf) only meets the one-hot
    # select, so the loss stays finite, as torch's
    x = np.array([[0.0, -np.inf, 1.0], [2.0, 1.0, 0.5]], dtype=np.float32)
    y = np.array([0, 2], dtype=np.int32)
    got = Tensor(x).sparse_categorical_crossentropy(Tensor(y)).numpy()
    np.testing.assert_allclose(got, F.cross_entropy(torch.tensor(x), torch.tensor(y).long()).numpy(), rtol=1e-6)

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss(reduction):
    y = np.array([[0, 2], [1, 1], [2, 0]], dtype=np.int64)
    w = np.array([0.5, 2.0, 1.5], dtype=np.float32)
    check(lambda x, y, w: x.nll_loss(y, w, ignore_index=1, reduction=reduction),
          lambda x, y, w: F.nll_loss(x, y, w, ignore_index=1, reduction=reduction), _rand(3, 3, 2), y, w,
          nograd=(2,))
    check(lambda x, y: x.nll_loss(y, reduction=reduction), lambda x, y: F.nll_loss(x, y, reduction=reduction),
          _rand(4, 3), y[:, 0].repeat(2)[:4].copy())
    with pytest.raises(ValueError, match="weight"): Tensor.ones(3, 3).nll_loss(Tensor([0, 1, 2]), Tensor.ones(2))

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_crossentropy(reduction):
    p = _rand(3, 4, low=0.05, high=0.95)
    p[0, 0], p[0, 1] = 0.0, 1.0  # log(0) is clamped to -100 as in torch
    y = _rand(3, 4, seed=1, low=0.0, high=1.0)
    check(lambda p, y: p.binary_crossentropy(y, reduction), lambda p, y: F.binary_cross_entropy(p, y,
          reduction=reduction), p, y, grad=False, atol=1e-4)
    check(lambda p, y: p.binary_crossentropy(y, reduction), lambda p, y: F.binary_cross_entropy(p, y,
          reduction=reduction), p[1:], y[1:], atol=1e-4)

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_crossentropy_logits(reduction):
    x = _rand(3, 4) * 10
    x[0, 0], x[0, 1] = 200.0, -200.0  # large logits stay finite
    y, pw = _rand(3, 4, seed=1, low=0.0, high=1.0), _rand(4, seed=2, low=0.5, high=3.0)
    check(lambda x, y, pw: x.binary_crossentropy_logits(y, reduction, pos_weight=pw),
          lambda x, y, pw: F.binary_cross_entropy_with_logits(x, y, reduction=reduction, pos_weight=pw), x, y, pw,
          atol=1e-4, nograd=(2,))
    with pytest.raises(ValueError, match="shape"): Tensor.ones(3).binary_crossentropy_logits(Tensor.ones(2))

# *** attention ***

@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask", "gqa"])
def test_scaled_dot_product_attention(variant):
    q, k, v = _rand(2, 4, 3, 8), _rand(2, 4, 5, 8, seed=1), _rand(2, 4, 5, 6, seed=2)
    kw: dict = {}
    if variant == "causal": kw, k, v = dict(is_causal=True), k[:, :, :3], v[:, :, :3]
    if variant == "gqa": kw, k, v = dict(enable_gqa=True), k[:, :2], v[:, :2]
    if variant == "bool_mask":
        m = np.random.default_rng(1).random((3, 5)) > 0.3
        m[:, 0] = True
        check(lambda q, k, v: q.scaled_dot_product_attention(k, v, attn_mask=Tensor(m)),
              lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(m)), q, k, v)
        return
    if variant == "float_mask":
        check(lambda q, k, v, m: q.scaled_dot_product_attention(k, v, attn_mask=m),
              lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, _rand(3, 5, seed=3))
        return
    check(lambda q, k, v: q.scaled_dot_product_attention(k, v, **kw),
          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), q, k, v)

def test_attention_errors():
    with pytest.raises(ValueError, match="mismatch"):
        Tensor.ones(2, 3, 4).scaled_dot_product_attention(Tensor.ones(2, 5, 3), Tensor.ones(2, 5, 4))
    with pytest.raises(ValueError, match="either"):
        Tensor.ones(3, 4).scaled_dot_product_attention(Tensor.ones(3, 4), Tensor.ones(3, 4),
                                                       attn_mask=Tensor.ones(3, 3), is_causal=True)

# *** einsum ***

@pytest.mark.parametrize("formula,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("ij,jk", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ii->i", [(4, 4)]), ("ii", [(4, 4)]), ("i,i->", [(5,), (5,)]), ("i,j->ij", [(3,), (4,)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]),
    ("bij,bjk->bik", [(1, 3, 4), (2, 4, 2)]), ("ijk->kji", [(2, 3, 4)]), ("bii->b", [(2, 3, 3)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]), ("i j , j -> i", [(3, 4), (4,)]),
])
def test_einsum(formula, shapes):
    arrs = [_rand(*s, seed=i) for i, s in enumerate(shapes)]
    check(lambda *xs: Tensor.einsum(formula, *xs), lambda *xs: torch.einsum(formula.replace(" ", ""), *xs), *arrs)

def test_einsum_list_dtype_errors():
    a, b = _rand(2, 3), _rand(3, 2, seed=1)
    out = Tensor.einsum("ij,jk->ik", [Tensor(a), Tensor(b)])
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-5)
    assert Tensor.einsum("ij->ji", Tensor([[1, 2]])).dtype == dtypes.int32
    assert Tensor.einsum("ij->ji", Tensor(a), dtype=dtypes.float64).dtype == dtypes.float64
    with pytest.raises(ValueError, match="operands"): Tensor.einsum("ij,jk->ik", Tensor(a))
    with pytest.raises(ValueError, match="sizes"): Tensor.einsum("ij,jk->ik", Tensor(a), Tensor(a))
    with pytest.raises(ValueError, match="labels"): Tensor.einsum("ijk->i", Tensor(a))
    with pytest.raises(ValueError, match="doesn't appear"): Tensor.einsum("ij->iz", Tensor(a))

# *** normalization and composition ***

@pytest.mark.parametrize("p,dim", [(2.0, 1), (1.0, -1), (3.0, 0), (float("inf"), 1)])
def test_normalize(p, dim):
    x = _rand(3, 4)
    x[1] = 0.0  # a zero row divides by eps
    check(lambda x: x.normalize(p, dim), lambda x: F.normalize(x, p, dim), x, grad=p != 1.0 or dim != -1)

def test_layernorm_batchnorm():
    check(lambda x: x.layernorm(), lambda x: F.layer_norm(x, (5,)), _rand(2, 3, 5))
    check(lambda x: x.layernorm((1, 2), eps=1e-3), lambda x: F.layer_norm(x, (3, 5), eps=1e-3), _rand(2, 3, 5))
    mean, var = _rand(3, seed=1), _rand(3, seed=2, low=0.5, high=2.0)
    check(lambda x, w, b, m, v: x.batchnorm(w, b, m, (v + 1e-5).rsqrt()),
          lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, training=False, eps=1e-5), _rand(2, 3, 4),
          _rand(3, seed=3), _rand(3, seed=4), mean, var, nograd=(3, 4))
    # torch can't differentiate batch_norm's statistics: check those gradients against the formula in torch
    check(lambda x, m, s: x.batchnorm(None, None, m, s, axis=-1), lambda x, m, s: (x - m) * s, _rand(2, 3, 4),
          mean[:1].repeat(4), var[:1].repeat(4))
    out = Tensor(_rand(2, 3, 4)).batchnorm(None, None, Tensor(mean), Tensor(var))
    np.testing.assert_allclose(out.numpy(), (_rand(2, 3, 4) - mean[:, None]) * var[:, None], rtol=1e-5)
    with pytest.raises(ValueError, match="mean"):
        Tensor.ones(2, 3).batchnorm(None, None, Tensor.ones(4), Tensor.ones(3))

def test_linear_sequential():
    check(lambda x, w, b: x.linear(w, b), lambda x, w, b: x @ w + b, _rand(2, 3), _rand(3, 4, seed=1),
          _rand(4, seed=2))
    out = Tensor(_rand(2, 3)).linear(Tensor(_rand(3, 4)), dtype=dtypes.float16)
    assert out.dtype == dtypes.float16
    check(lambda x: x.sequential([lambda t: t * 2, lambda t: t.relu()]), lambda x: (x * 2).relu(), _rand(3, 3))

# *** dtypes and edge cases ***

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    tol = dict(atol=2e-2, rtol=2e-2, grad=False, dtype=dtype)
    check(lambda x, w, b: x.conv2d(w, b, padding=1), lambda x, w, b: F.conv2d(x, w, b, padding=1), _rand(1, 2, 4, 4),
          _rand(3, 2, 3, 3, seed=1), _rand(3, seed=2), **tol)
    check(lambda x: x.avg_pool2d((2, 2)), lambda x: F.avg_pool2d(x, 2), _rand(1, 2, 4, 4), **tol)
    check(lambda x: x.max_pool2d((2, 2), padding=1), lambda x: F.max_pool2d(x, 2, padding=1), _rand(1, 2, 4, 4), **tol)
    check(lambda x, y: x.cross_entropy(y), lambda x, y: F.cross_entropy(x, y), _rand(3, 5), np.array([0, 4, 2]), **tol)
    check(lambda x: x.layernorm(), lambda x: F.layer_norm(x, (6,)), _rand(2, 6), **tol)
    check(lambda x: x.pad((1, 1), mode="reflect"), lambda x: F.pad(x, (1, 1), mode="reflect"), _rand(2, 3), **tol)
    check(lambda q, k: q.scaled_dot_product_attention(k, k, is_causal=True), lambda q, k:
          F.scaled_dot_product_attention(q, k, k, is_causal=True), _rand(2, 3, 4), _rand(2, 3, 4, seed=1), **tol)
    check(lambda x: x.interpolate((5, 3)), lambda x: F.interpolate(x, (5, 3), mode="bilinear"), _rand(1, 1, 3, 4),
          **tol)

def test_cross_entropy_large_logits_and_empty():
    x = _rand(3, 4) * 1e4
    check(lambda x, y: x.cross_entropy(y), lambda x, y: F.cross_entropy(x, y), x, np.array([0, 3, 1]), atol=1e-2)
    check(lambda x, y: x.cross_entropy(y, reduction="sum"), lambda x, y: F.cross_entropy(x, y, reduction="sum"),
          _rand(0, 4), np.zeros(0, dtype=np.int64), grad=False)
    check(lambda x, y: x.cross_entropy(y), lambda x, y: F.cross_entropy(x, y), _rand(0, 4),
          np.zeros(0, dtype=np.int64), grad=False)  # the mean of nothing is nan

def test_losses_nan_inf():
    x = _rand(2, 3)
    x[0, 1] = np.nan
    check(lambda x, y: x.cross_entropy(y, reduction="none"), lambda x, y: F.cross_entropy(x, y, reduction="none"),
          x, np.array([0, 2]), grad=False)
    x = _rand(2, 3)
    x[1, 2] = np.inf
    check(lambda x, y: x.binary_crossentropy_logits(y, "none"), lambda x, y: F.binary_cross_entropy_with_logits(x, y,
          reduction="none"), x, _rand(2, 3, low=0.0, high=1.0, seed=1), grad=False)

def test_attention_eval_dropout_and_0d_unfold():
    q = _rand(3, 4)
    assert not Tensor.training
    check(lambda q: q.scaled_dot_product_attention(q, q, dropout_p=0.5), lambda q: F.scaled_dot_product_attention(
          q, q, q), q)
    with pytest.raises(ValueError, match="dropout_p"): Tensor(q).scaled_dot_product_attention(Tensor(q), Tensor(q),
                                                                                            dropout_p=1.5)
    check(lambda x: x.unfold(0, 1, 1), lambda x: x.unfold(0, 1, 1), np.array(2.5, dtype=np.float32))

def test_pool_conv_broadcast_pieces():
    # a batch of one broadcast by expand, and an input that is itself a computed expression (fused into the window)
    check(lambda x, w: (x.expand(3, 2, 5, 5) * 2 + 1).conv2d(w), lambda x, w: F.conv2d(x.expand(3, 2, 5, 5) * 2 + 1, w),
          _rand(1, 2, 5, 5), _rand(4, 2, 3, 3, seed=1))

def test_avg_pool_dilation_and_type_errors():
    # torch's avg_pool2d has no dilation: a dilated window average is a depthwise convolution with 1/k weights
    check(lambda x: x.avg_pool2d((2, 3), stride=1, dilation=2),
          lambda x: F.conv2d(x.reshape(6, 1, 7, 8), torch.full((1, 1, 2, 3), 1 / 6), dilation=2).reshape(2, 3, 5, 4),
          _rand(2, 3, 7, 8))
    check(lambda x, y: x.nll_loss(y), lambda x, y: F.nll_loss(x, y), _rand(4), np.array(2))
    with pytest.raises(TypeError, match="weight"): Tensor.ones(1, 1, 3, 3).conv2d(np.ones((1, 1, 2, 2)))
    with pytest.raises(TypeError, match="Y"): Tensor.ones(2, 3).cross_entropy([0, 1])
    with pytest.raises(TypeError, match="key"): Tensor.ones(2, 3).scaled_dot_product_attention(1.0, Tensor.ones(2, 3))

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_conv_pool_random_configs(seed):
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 4))
    groups, k = int(rng.integers(1, 3)), tuple(int(v) for v in rng.integers(1, 4, nd))
    stride, dil = tuple(int(v) for v in rng.integers(1, 3, nd)), tuple(int(v) for v in rng.integers(1, 3, nd))
    pad = tuple(int(v) for v in rng.integers(0, 2, nd))
    xs = (2, 2 * groups) + tuple(int(v) for v in rng.integers(5, 8, nd))
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    check(lambda x, w: x.conv2d(w, groups=groups, stride=stride, dilation=dil, padding=pad),
          lambda x, w: conv(x, w, groups=groups, stride=stride, dilation=dil, padding=pad), _rand(*xs, seed=seed),
          _rand(3 * groups, 2, *k, seed=seed + 1))
    pk = tuple(max(2, v) for v in k)
    ppad = tuple(min(p, v // 2) for p, v in zip(pad, pk))
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    x = rng.permutation(int(np.prod(xs))).reshape(xs).astype(np.float32)
    check(lambda x: x.max_pool2d(pk, stride, dil, ppad, ceil_mode=bool(seed % 2)),
          lambda x: pool(x, pk, stride, ppad, dil, ceil_mode=bool(seed % 2)), x)
    if nd < 3:
        avg = (F.avg_pool1d, F.avg_pool2d)[nd - 1]
        check(lambda x: x.avg_pool2d(pk, stride, 1, ppad, ceil_mode=bool(seed % 2), count_include_pad=seed % 3 == 0),
              lambda x: avg(x, pk, stride, ppad, ceil_mode=bool(seed % 2), count_include_pad=seed % 3 == 0), x)

def test_sdpa_dropout_in_training():
    # with v the identity, the output is the dropped attention matrix: each weight is zeroed or scaled by 1/(1-p)
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((4, 64, 16), dtype=np.float32), rng.standard_normal((4, 64, 16), dtype=np.float32)
    v = np.broadcast_to(np.eye(64, dtype=np.float32), (4, 64, 64)).copy()
    want = torch.softmax(torch.from_numpy(q) @ torch.from_numpy(k).transpose(-1, -2) / 4.0, -1).numpy()
    old = Tensor.training
    try:
        Tensor.training = True
        Tensor.manual_seed(3)
        got = Tensor(q).scaled_dot_product_attention(Tensor(k), Tensor(v), dropout_p=0.5).numpy()
        Tensor.manual_seed(3)
        again = Tensor(q).scaled_dot_product_attention(Tensor(k), Tensor(v), dropout_p=0.5).numpy()
    finally: Tensor.training = old
    np.testing.assert_array_equal(got, again)
    kept = got != 0
    np.testing.assert_allclose(got[kept], 2 * want[kept], rtol=1e-5)
    # 16384 independent keep/drop draws at p = 0.5: the kept fraction is within 5 sigma (0.02) of one half
    assert abs(kept.mean() - 0.5) < 0.02

def test_conv_transpose_dtype_does_not_depend_on_the_stride():
    x, w, b = Tensor(_rand(1, 2, 4, 4)).half(), Tensor(_rand(2, 3, 3, 3, seed=1)).half(), Tensor(_rand(3, seed=2))
    for stride in (1, 2):
        out = x.conv_transpose2d(w, b, stride=stride)
        ref = F.conv_transpose2d(torch.tensor(x.numpy()).float(), torch.tensor(w.numpy()).float(),
                                 torch.tensor(b.numpy()).half().float(), stride=stride)
        assert out.dtype == dtypes.float16
        np.testing.assert_allclose(out.numpy().astype(np.float32), ref.numpy(), rtol=1e-2, atol=1e-2)

@pytest.mark.parametrize("shape,k,s,d", [((2, 3, 9, 9), (3, 3), 1, 1), ((2, 3, 9, 9), (3, 3), 2, 1),
                                         ((2, 3, 10, 11), (2, 2), 2, 1), ((1, 2, 13), (5,), 3, 2),
                                         ((2, 3, 8, 8, 8), (3, 3, 3), 1, 1), ((2, 4, 6, 6), (3, 3), 3, 1)])
def test_pool_views_match_checked_tensor_ops(shape, k, s, d, monkeypatch):
    # _pool and conv2d build their chains of views as nodes directly: the graph is the very one the checked Tensor
    # ops make
    import fusegrad.tensor.nn as nn_module
    x = Tensor(np.random.rand(*shape).astype(np.float32))
    w = Tensor(np.random.rand(2, shape[1], *k).astype(np.float32))
    fast, fast_conv = x._pool(k, s, d).uop, x.conv2d(w, stride=s, dilation=d).uop
    monkeypatch.setattr(nn_module, "_views_of", lambda t: t)
    assert x._pool(k, s, d).uop is fast
    assert x.conv2d(w, stride=s, dilation=d).uop is fast_conv
