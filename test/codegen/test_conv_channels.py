"""Convolutions over small images as implicit matmuls along their output channels, KBLOCK with an epilogue, and the
scheduler giving a long contraction a kernel of its own. Values are checked against torch and numpy."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Device, GlobalCounters, Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.dtype import dtypes
from fusegrad.helpers import Context
from fusegrad.uop.ops import UOp
from test.codegen.helpers import RENDERER, glob, reduce, rng, run

RS = np.random.RandomState(7)
# float32 lanes of this machine's vectors (16 with AVX-512, 8 with AVX2): the kernel shapes the heuristic picks
# depend on it, so the checks of kernel shapes are stated in lanes
LANES = getattr(Device["CPU"].renderer, "simd_bytes", 0) // 4

def shaped(ok: bool, info: object) -> None:
    """A check of the kernel's shape (its opts, its vectors): made where vectors have 8 lanes or more."""
    if LANES >= 8: assert ok, info

def _kernels(t: Tensor) -> list:
    """The kernels that compute t (scheduling replaces t's graph by buffers it doesn't compute: use a fresh graph
    for t's values)."""
    return [si for si in t.schedule() if si.ast.op.name == "SINK"]

def _opts(si) -> tuple[Opt, ...]:
    return get_program(si.ast, Device["CPU"].renderer).applied_opts

# *** KBLOCK with an epilogue ***

def _matmul_epilogue_ast(M: int, N: int, K: int):
    """relu(a @ b * scale[n] + c[m, n]): a reduction and an epilogue reading two more buffers."""
    f32 = dtypes.float32
    out, a, b, scale, c = glob(0, f32, M * N), glob(1, f32, M * K), glob(2, f32, K * N), glob(3, f32, N), \
        glob(4, f32, M * N)
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    acc = reduce(a.index(r0 * K + r2).load() * b.index(r2 * N + r1).load(), r2)
    val = acc * scale.index(r1).load() + c.index(r0 * N + r1).load()
    return UOp.sink_of(out.index(r0 * N + r1).store(val.maximum(val.const_like(0.0))))

@pytest.mark.parametrize("blk", [16, 64])
def test_kblock_applies_the_epilogue_once(blk):
    # the blocks add partial sums through the output; only the last one scales, adds and clamps: the epilogue
    # applied to a partial sum, or twice, would give other values
    M, N, K = 8, 32, 128
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    scale, c = RS.randn(N).astype(np.float32), RS.randn(M, N).astype(np.float32)
    out = np.full((M, N), np.nan, np.float32)
    p = run(_matmul_epilogue_ast(M, N, K), [out, a, b, scale, c], opts=[Opt(OptOps.KBLOCK, 2, blk)])
    assert OptOps.KBLOCK in {o.op for o in p.applied_opts}
    np.testing.assert_allclose(out, np.maximum((a.astype(np.float64) @ b) * scale + c, 0), rtol=1e-4, atol=1e-4)

def test_kblock_refuses_an_epilogue_with_another_reduction():
    # a second reduction in the epilogue would be computed again by every block
    f32 = dtypes.float32
    out, a, b = glob(0, f32, 4), glob(1, f32, 4 * 64), glob(2, f32, 4 * 8)
    r0, r1, r2 = rng(4, 0), rng(64, 1, "reduce"), rng(8, 2, "reduce")
    val = reduce(a.index(r0 * 64 + r1).load(), r1) + reduce(b.index(r0 * 8 + r2).load(), r2)
    k = Kernel(UOp.sink_of(out.index(r0).store(val)), RENDERER)
    with pytest.raises(KernelOptError, match="other reductions"): k.apply_opt(Opt(OptOps.KBLOCK, 1, 16))

def test_linear_layer_blocks_its_reduction():
    # a long matmul with a bias and relu after it is blocked through the output like a bare one
    x, w, bias = Tensor(RS.randn(64, 1024).astype(np.float32)), Tensor(RS.randn(256, 1024).astype(np.float32)), \
        Tensor(RS.randn(256).astype(np.float32))
    (si,) = _kernels(x.linear(w.T, bias).relu())
    shaped(OptOps.KBLOCK in {o.op for o in _opts(si)}, None)
    want = np.maximum(x.numpy().astype(np.float64) @ w.numpy().T + bias.numpy(), 0)
    np.testing.assert_allclose(x.linear(w.T, bias).relu().numpy(), want, rtol=1e-4, atol=1e-3)

# *** convolutions along their output channels ***

def _torch(x: Tensor) -> torch.Tensor: return torch.tensor(x.numpy())

@pytest.mark.parametrize("hw,cin,cout", [(7, 64, 64), (14, 48, 32), (5, 64, 48), (8, 64, 32), (16, 48, 32)])
def test_small_image_conv_is_vectorized_along_channels(hw, cin, cout):
    if LANES and hw >= 2 * LANES: hw -= LANES   # a row shorter than two vectors (16 pixels with 16 lanes, 8 with 8)
    # image rows of 5 to 16 pixels would fill padded or narrow vectors: the output channels are the vector, the
    # weights are packed, and the reduction is kept whole (the panel of 64 channels x 3 x 3 fits a copy: blocked, each
    # block's partial sums would go out and back through the strided output)
    x = Tensor(RS.randn(2, cin, hw, hw).astype(np.float32))
    w = Tensor(RS.randn(cout, cin, 3, 3).astype(np.float32))
    (si,) = _kernels(x.conv2d(w, padding=1))
    p = get_program(si.ast, Device["CPU"].renderer)
    opts = p.applied_opts
    ops = [o.op for o in opts]
    shaped(opts[0] == Opt(OptOps.UPCAST, 1, LANES), opts)   # the channel axis, a whole vector
    # (the window isn't unrolled, each tap would hold its own weight vectors; but where the register tile spans the
    # image row, its row kw is: in each copy the padding's comparisons are constants)
    spans_row = Opt(OptOps.UPCAST, 3, hw) in opts
    shaped(OptOps.KBLOCK not in ops and OptOps.PACK in ops and (OptOps.UNROLL not in ops or spans_row), opts)
    # ... and the lowering keeps them as the vector (an 8-pixel row tile is a power of two too)
    shaped({u.dtype.count for u in p.uops if u.op.name == "DEFINE_REG"} == {LANES}, None)
    np.testing.assert_allclose(x.conv2d(w, padding=1).numpy(), F.conv2d(_torch(x), _torch(w), padding=1).numpy(),
                               rtol=1e-4, atol=1e-3)

@pytest.mark.parametrize("cin", [64, 512])
def test_conv_with_batch_norm_and_residual_epilogue(cin: int):
    # a residual block's second convolution: scale and shift per channel, the block's input added, relu; all in the
    # convolution's kernel, applied after the whole reduction (64 input channels) or by its last block (512: the
    # panel of two vectors of channels by 512 x 3 x 3 is over the copy's limit, so the reduction is blocked)
    x = Tensor(RS.randn(2, cin, 7, 7).astype(np.float32))
    w = Tensor((RS.randn(64, cin, 3, 3) / np.sqrt(cin / 64)).astype(np.float32))
    s, t = Tensor(RS.randn(1, 64, 1, 1).astype(np.float32)), Tensor(RS.randn(1, 64, 1, 1).astype(np.float32))
    skip = x if cin == 64 else x[:, :64]
    def block() -> Tensor: return (x.conv2d(w, padding=1) * s + t + skip).relu()
    (si,) = _kernels(block())
    shaped((OptOps.KBLOCK in {o.op for o in _opts(si)}) == (cin == 512), None)
    want = torch.relu(F.conv2d(_torch(x), _torch(w), padding=1) * _torch(s) + _torch(t) + _torch(skip))
    np.testing.assert_allclose(block().numpy(), want.numpy(), rtol=1e-4, atol=1e-3)

def test_few_channels_stay_on_the_image_rows():
    # a single vector of output channels, no register tile of two: the image row stays the vector axis
    x = Tensor(RS.randn(2, 16, 7, 7).astype(np.float32))
    w = Tensor(RS.randn(max(LANES, 4), 16, 3, 3).astype(np.float32))
    (si,) = _kernels(x.conv2d(w, padding=1))
    shaped(OptOps.UNROLL in {o.op for o in _opts(si)}, None)   # the window, unrolled along the image row
    np.testing.assert_allclose(x.conv2d(w, padding=1).numpy(), F.conv2d(_torch(x), _torch(w), padding=1).numpy(),
                               rtol=1e-4, atol=1e-3)

def test_wide_rows_go_to_the_cores_by_batch():
    # 56-pixel rows: a core's half of a row would be two cache lines, and the rows aren't line-aligned; the batch is
    # split across the cores, not the row
    # (the direct convolution's kernel: Winograd would take this size)
    x, w = Tensor(RS.randn(2, 64, 56, 56).astype(np.float32)), Tensor(RS.randn(64, 64, 3, 3).astype(np.float32))
    with Context(WINO=0): (si,) = _kernels(x.conv2d(w, padding=1))
    shaped(OptOps.SWAP not in {o.op for o in _opts(si)}, None)
    np.testing.assert_allclose(x.conv2d(w, padding=1).numpy(), F.conv2d(_torch(x), _torch(w), padding=1).numpy(),
                               rtol=1e-4, atol=1e-3)

# *** one long contraction per kernel ***

def test_downsample_beside_a_long_convolution_gets_its_own_kernel():
    # a residual block with a 1x1 downsample: the 3x3 convolution (576 products per output) keeps its kernel to
    # itself, with the downsample's result read in its epilogue
    x = Tensor(RS.randn(2, 64, 7, 7).astype(np.float32))
    w, wd = Tensor(RS.randn(64, 64, 3, 3).astype(np.float32)), Tensor(RS.randn(64, 64, 1, 1).astype(np.float32))
    def block() -> Tensor: return (x.conv2d(w, padding=1) + x.conv2d(wd)).relu()
    assert len(_kernels(block())) == 2
    x.realize(), w.realize(), wd.realize()
    GlobalCounters.reset()
    got = block().numpy()
    assert GlobalCounters.kernel_count == 2
    want = torch.relu(F.conv2d(_torch(x), _torch(w), padding=1) + F.conv2d(_torch(x), _torch(wd)))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-3)

def test_short_contractions_share_a_kernel():
    # an LSTM cell's two small products (x @ W_ih + h @ W_hh) stay in one kernel
    x, h = Tensor(RS.randn(4, 8).astype(np.float32)), Tensor(RS.randn(4, 16).astype(np.float32))
    wi, wh = Tensor(RS.randn(8, 32).astype(np.float32)), Tensor(RS.randn(16, 32).astype(np.float32))
    assert len(_kernels((x @ wi + h @ wh).tanh())) == 1
    want = np.tanh(x.numpy() @ wi.numpy() + h.numpy() @ wh.numpy())
    np.testing.assert_allclose((x @ wi + h @ wh).tanh().numpy(), want, rtol=1e-5, atol=1e-5)

def test_pointwise_conv_on_small_images_goes_along_channels():
    # a 1x1 convolution on 7x7 images: its packed weight block is reused by batch x image rows (28 row tiles)
    x, w = Tensor(RS.randn(4, 64, 7, 7).astype(np.float32)), Tensor(RS.randn(64, 64, 1, 1).astype(np.float32))
    (si,) = _kernels(x.conv2d(w))
    opts = _opts(si)
    shaped(opts[0] == Opt(OptOps.UPCAST, 1, LANES) and OptOps.PACK in {o.op for o in opts}, opts)
    np.testing.assert_allclose(x.conv2d(w).numpy(), F.conv2d(_torch(x), _torch(w)).numpy(), rtol=1e-4, atol=1e-3)

def test_narrow_matmul_keeps_its_columns_as_the_vector():
    # 7 columns: along the rows the whole left operand would be packed for a single tile of 7 columns
    a, b = Tensor(RS.randn(256, 512).astype(np.float32)), Tensor(RS.randn(512, 7).astype(np.float32))
    (si,) = _kernels(a @ b)
    shaped(next(o for o in _opts(si) if o.op is OptOps.UPCAST).axis == 1, None)
    np.testing.assert_allclose((a @ b).numpy(), a.numpy() @ b.numpy(), rtol=1e-4, atol=1e-3)

def test_small_image_weight_gradient_goes_along_output_channels():
    # the weight gradient of a 7x7 convolution: no vector fits the image rows, and of the full-width axes the output
    # channels pack the output gradient once per tile (the input channels would gather the image: 12x slower)
    x = Tensor(RS.randn(2, 64, 7, 7).astype(np.float32), requires_grad=True)
    w = Tensor(RS.randn(64, 64, 3, 3).astype(np.float32), requires_grad=True)
    g = Tensor(RS.randn(2, 64, 7, 7).astype(np.float32))
    def weight_grad() -> Tensor: return (x.conv2d(w, padding=1) * g).sum().gradient(w)[0]
    (si,) = _kernels(weight_grad())[-1:]
    opts = _opts(si)
    shaped(opts[0] == Opt(OptOps.UPCAST, 0, LANES) and OptOps.PACK in {o.op for o in opts}, opts)
    want = torch.nn.grad.conv2d_weight(_torch(x), (64, 64, 3, 3), _torch(g), padding=1)
    np.testing.assert_allclose(weight_grad().numpy(), want.numpy(), rtol=1e-4, atol=1e-3)

@pytest.mark.parametrize("hw", [2, 4])
def test_tiny_image_conv_with_a_residual_buffer_goes_along_channels(hw):
    # 2x2 and 4x4 images (ResNet-18's last blocks at 64px): no vector fits the rows, and the residual, read from its
    # own buffer strided along the channels, is gathered once per output like the store, not a reason to stay scalar
    x = Tensor(RS.randn(4, 64, hw, hw).astype(np.float32))
    w = Tensor(RS.randn(64, 64, 3, 3).astype(np.float32))
    r = Tensor(RS.randn(4, 64, hw, hw).astype(np.float32)).realize()
    def block() -> Tensor: return (x.conv2d(w, padding=1) + r).relu()
    (si,) = _kernels(block())
    shaped(_opts(si)[0] == Opt(OptOps.UPCAST, 1, LANES), _opts(si))
    want = torch.relu(F.conv2d(_torch(x), _torch(w), padding=1) + _torch(r))
    np.testing.assert_allclose(block().numpy(), want.numpy(), rtol=1e-4, atol=1e-3)

# *** pointwise convolutions: merged pixels, strides as views ***

@pytest.mark.parametrize("hw,merged", [(28, True), (56, True), (7, False), (14, False)])
def test_pointwise_conv_pixels_merge_into_whole_vectors(hw: int, merged: bool):
    # a 1x1 convolution addresses its (oh, ow) pixels as one run: the loops merge where their product is whole
    # vectors and a row isn't (28x28 -> 784 = 49 x 16); 7x7 images keep their rows (the channels are the vector)
    x, w = Tensor(RS.randn(2, 16, hw, hw).astype(np.float32)), Tensor(RS.randn(32, 16, 1, 1).astype(np.float32))
    (si,) = _kernels(x.conv2d(w))
    sizes = [int(r.src[0].arg) for r in Kernel(si.ast, Device["CPU"].renderer).loops]
    shaped(LANES != 16 or (hw * hw in sizes) == merged, sizes)
    np.testing.assert_allclose(x.conv2d(w).numpy(), F.conv2d(_torch(x), _torch(w)).numpy(), rtol=1e-4, atol=1e-4)

def test_loops_stay_apart_where_a_gate_or_value_uses_one():
    # a padded copy checks its rows in the gates, an iota uses its positions as values: no merging for either
    sizes = lambda t: [int(r.src[0].arg) for r in Kernel(_kernels(t)[-1].ast, Device["CPU"].renderer).loops]
    x = Tensor(RS.randn(4, 6, 24).astype(np.float32))
    shaped(24 in sizes(x.pad(((0, 0), (1, 1), (0, 0))) * 2), None)
    shaped(24 in sizes(Tensor.arange(6 * 24).reshape(6, 24) * 1 + x), None)
    np.testing.assert_array_equal((x.pad(((0, 0), (1, 1), (0, 0))) * 2).numpy(),
                                  np.pad(x.numpy(), ((0, 0), (1, 1), (0, 0))) * 2)
    np.testing.assert_array_equal((Tensor.arange(6 * 24).reshape(6, 24) * 1 + x).numpy(),
                                  np.arange(6 * 24, dtype=np.float32).reshape(6, 24) + x.numpy())

@pytest.mark.parametrize("stride,padding,hw", [(2, 0, 14), (2, 0, 15), (3, 1, 15), ((2, 3), 0, 9), (2, (1, 0), 8)])
def test_strided_pointwise_conv_reads_the_picked_pixels(stride, padding, hw: int):
    # a strided 1x1 convolution is the stride-1 one of every s-th pixel (a view): one kernel, no copy of the weights
    X, W, B = (RS.randn(2, 8, hw, hw).astype(np.float32), RS.randn(16, 8, 1, 1).astype(np.float32),
               RS.randn(16).astype(np.float32))
    def run_conv() -> Tensor: return Tensor(X).conv2d(Tensor(W), Tensor(B), stride=stride, padding=padding)
    assert len(_kernels(run_conv())) == 1
    x, w, b = Tensor(X), Tensor(W), Tensor(B)
    out = x.conv2d(w, b, stride=stride, padding=padding)
    G = RS.randn(*out.shape).astype(np.float32)
    grads = out.gradient(x, w, b, gradient=Tensor(G))
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (X, W, B))
    tout = F.conv2d(tx, tw, tb, stride=stride, padding=padding)
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(tout, (tx, tw, tb), torch.tensor(G))):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("cin,unrolled", [(1, 2), (3, 0), (32, 1)])
def test_window_unrolled_by_its_channels(cin: int, unrolled: int):
    # a 3x3 window over one channel is unrolled whole; over an RGB image's 3 channels not at all (the loops are
    # cheaper than the registers the taps would take); over more channels only its rows (kw stays a loop)
    X, W = RS.randn(4, cin, 16, 32).astype(np.float32), RS.randn(16, cin, 3, 3).astype(np.float32)
    def conv() -> Tensor: return Tensor(X).conv2d(Tensor(W), padding=1)
    with Context(WINO=0): (si,) = _kernels(conv())
    shaped(sum(1 for o in _opts(si) if o.op is OptOps.UNROLL and o.arg == 0) == unrolled, _opts(si))
    with Context(WINO=0): got = conv().numpy()
    np.testing.assert_allclose(got, F.conv2d(torch.tensor(X), torch.tensor(W), padding=1).numpy(), rtol=1e-4,
                               atol=1e-4)
