"""Loop bounds from gates (codegen/bounds.py): a sum's loop runs only over the iterations its padding gate lets
through. The products a padded convolution computes, its loads, and values against torch and NumPy: forward and
gradients, strides, paddings, pools that count only the image, and non-finite weights at taps that read only
padding."""
from __future__ import annotations
import itertools
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.bounds import bound_sum_loops
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import RENDERER, call, captured_asts, conv_grads, glob, reduce, rng, run

RS = np.random.default_rng(0)

def _window_sum_ast(n: int, k: int, pad: int, flipped: bool) -> UOp:
    """out[o] = sum over r < k of x[o + r - pad] * w[r] (x[o - r + pad] when `flipped`, as an input gradient reads
    its output gradient), 0 outside x: the gate written as the padding's clauses."""
    g0, g1, g2 = glob(0, dtypes.float32, n), glob(1, dtypes.float32, n), glob(2, dtypes.float32, k)
    o, r = rng(n, 0), rng(k, 1, "reduce")
    pos = (o - r + pad) if flipped else (o + r - pad)
    gate = (pos < n) & (UOp.const(dtypes.index, -1) < pos)
    acc = reduce(g1.index(pos, valid=gate).load() * g2.index(r).load(), r)
    return UOp.sink_of(g0.index(o).store(acc))

def _window_sum_ref(x: np.ndarray, w: np.ndarray, pad: int, flipped: bool) -> np.ndarray:
    out = np.zeros_like(x)
    for o, r in itertools.product(range(len(x)), range(len(w))):
        p = o - r + pad if flipped else o + r - pad
        if 0 <= p < len(x): out[o] += x[p] * w[r]
    return out

@pytest.mark.parametrize("n, k, pad, flipped", [(2, 3, 1, False), (7, 3, 1, True), (5, 5, 2, False),
                                                (1, 3, 1, True), (9, 7, 3, True), (3, 5, 1, False)])
def test_window_sum_loop_is_bounded(n: int, k: int, pad: int, flipped: bool):
    """The window loop of a hand-written padded 1-d convolution (its position with coefficient 1 or -1) loses its
    gate: no gated load is left, and the loop's trip count is the number of taps inside x. Values against a loop in
    Python."""
    ast = _window_sum_ast(n, k, pad, flipped)
    bounded = bound_sum_loops(ast)
    assert not any(u.op is Ops.INDEX and len(u.src) > 2 for u in bounded.toposort())
    (red,) = [u for u in bounded.toposort() if u.op is Ops.REDUCE]
    trips = red.src[1].src[0]
    for o in range(n):
        want = sum(0 <= (o - r + pad if flipped else o + r - pad) < n for r in range(k))
        got = trips.substitute({u: u.const_like(o) for u in trips.toposort() if u.op is Ops.RANGE}).simplify()
        assert got.op is Ops.CONST and got.arg == want, (o, got)
    x, w = RS.standard_normal(n).astype(np.float32), RS.standard_normal(k).astype(np.float32)
    out = np.zeros(n, np.float32)
    for opts in (None, []):
        run(ast, [out, x, w], opts=opts, noopt=opts is None)
        np.testing.assert_allclose(out, _window_sum_ref(x, w, pad, flipped), rtol=1e-5, atol=1e-6)

def test_sums_that_arent_zero_outside_keep_their_loops():
    """A gate the term isn't zero outside of (a sum of where(gate, x, 1)) and a MAX reduction keep their loops."""
    n, k = 6, 3
    g0, g1 = glob(0, dtypes.float32, n), glob(1, dtypes.float32, n)
    o, r = rng(n, 0), rng(k, 1, "reduce")
    pos = o + r - 1
    gate = (pos < n) & (UOp.const(dtypes.index, -1) < pos)
    val = gate.where(g1.index(pos, valid=gate).load(), UOp.const(dtypes.float32, 1.0))
    for op in (Ops.ADD, Ops.MAX):
        ast = UOp.sink_of(g0.index(o).store(reduce(val, r, op=op)))
        assert bound_sum_loops(ast) is ast
    mx = reduce(g1.index(pos, valid=gate).load(), r, op=Ops.MAX)
    ast = UOp.sink_of(g0.index(o).store(mx))
    assert bound_sum_loops(ast) is ast

# (batch, input channels, output channels, image side, kernel, padding, stride)
SHAPES = [(8, 64, 64, 2, 3, 1, 1), (4, 32, 48, 4, 3, 1, 1), (2, 16, 16, 3, 5, 2, 1), (3, 8, 24, 5, 3, 1, 2),
          (2, 16, 32, 7, 7, 3, 2), (2, 5, 7, 1, 3, 1, 1), (4, 128, 128, 2, 3, 2, 1)]

@pytest.mark.parametrize("shape", SHAPES)
def test_padded_conv_values(shape):
    """Forward, input gradient and weight gradient of padded convolutions whose window loops get bounded, against
    torch."""
    n, ci, co, side, k, pad, stride = shape
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci, k, k)) * 0.1).astype(np.float32)
    ours, ref = conv_grads(x, w, stride, pad, RS)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)

def _products_inside(side: int, k: int, pad: int) -> int:
    """The (output position, tap) pairs of a stride-1 k x k convolution over side x side images whose input is
    inside the image."""
    out = side + 2 * pad - k + 1
    row = sum(0 <= o + t - pad < side for o in range(out) for t in range(k))
    return row * row

def _padded_conv_kernel(monkeypatch: pytest.MonkeyPatch, n: int, c: int, side: int) -> UOp:
    """The AST of the kernel of a c -> c channel 3x3 convolution with padding 1 over n side x side images, its values
    checked against torch."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, c, side, side)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    out = Tensor(x).conv2d(Tensor(w), padding=1).numpy()
    ref = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    (ast,) = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    return ast

def test_small_image_conv_multiplies_only_the_image(monkeypatch: pytest.MonkeyPatch):
    """ResNet's last stage at 64 pixels, on fewer channels: a 3x3 convolution over 2x2 images with padding 1 reads 4
    of its 9 taps inside the image. Its kernel loads the input without a gate and its multiply-adds are exactly the
    products with the image (4 of 9 per output); values against torch."""
    n, c = 8, 80   # (a shape no other test compiles: its kernel is compiled here)
    ast = _padded_conv_kernel(monkeypatch, n, c, 2)
    p = get_program(ast, RENDERER)
    x_loads = [u for u in p.uops if u.op is Ops.INDEX and u.src[0].op is Ops.DEFINE_GLOBAL and
               u.src[0].dtype.size == n * c * 4]
    assert x_loads and all(len(u.src) == 2 for u in x_loads), "the input is still read under a gate"
    # (besides the multiply-adds, the adds of the blocks' partial sums into the output)
    products = 2 * n * c * c * _products_inside(2, 3, 1)
    assert products <= p.estimates.ops < 1.05 * products, (p.estimates.ops, products)

def test_small_image_weight_gradient_multiplies_only_the_image(monkeypatch: pytest.MonkeyPatch):
    """The weight gradient of a 3x3 convolution over 2x2 images with padding 1 (ResNet's last stage at 64 pixels):
    its image loops are unrolled and both window loops upcast, so every lane's gate is a constant and its multiply-adds
    are exactly the (tap, pixel) pairs inside the image (16 of 36 per image and channel pair). Values of the
    forward and both gradients against torch."""
    n, c = 16, 96   # (a shape no other test compiles: its kernels are compiled here)
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, c, 2, 2)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for a, b in zip(ours, ref): np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    (ast,) = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort()) and
              any(st.src[0].src[0].dtype.size == c * c * 9 for st in a.src)]
    p = get_program(ast, RENDERER)
    products = 2 * n * c * c * _products_inside(2, 3, 1)
    assert products <= p.estimates.ops < 1.05 * products, (p.estimates.ops, products, p.applied_opts)

@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [((3, 3), 2, 1, True), ((3, 3), 1, 1, False),
                                                                ((5, 5), 2, 2, False), ((2, 3), 1, 1, True)])
def test_avg_pool_counting_only_the_image(kernel, stride, padding, ceil_mode):
    """Average pools with count_include_pad=False: the count of image pixels of each window is a sum whose terms
    don't vary with the output position, only its bounded loops do (the accumulator is reset per output). Values and
    the input gradient against torch."""
    x = RS.standard_normal((2, 3, 9, 8)).astype(np.float32)
    kw = dict(stride=stride, padding=padding, ceil_mode=ceil_mode, count_include_pad=False)
    tx = torch.tensor(x, requires_grad=True)
    tout = torch.nn.functional.avg_pool2d(tx, kernel, **kw)
    tout.sum().backward()
    fx = Tensor(x, requires_grad=True)
    fout = fx.avg_pool2d(kernel, **kw)
    fout.sum().backward()
    np.testing.assert_allclose(fout.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fx.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)

def test_non_finite_weights_at_padding_taps():
    """A weight of inf at tap (0, 0) and of nan at tap (2, 2) (one input channel each) in a convolution whose window
    loops are both bounded (2x2 images, as above): an output whose window reads padding there doesn't multiply it
    (no 0 * inf = NaN), as a sum over the image's pixels only. Against NumPy's sum over the pixels inside the image,
    where the outputs of the first row and column are inf-free and those of the last row and column nan-free. (Where
    a window loop's gate varies with an upcast output lane, its padding is multiplied: NaN there, as PyTorch's
    small convolutions give.)"""
    n, c, side = 8, 64, 2
    x = np.abs(RS.standard_normal((n, c, side, side))).astype(np.float32) + 0.5
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    w[:, 0, 0, 0], w[:, 1, 2, 2] = np.inf, np.nan
    out = Tensor(x).conv2d(Tensor(w), padding=1).numpy()
    ref = np.zeros((n, c, side, side), np.float32)
    with np.errstate(invalid="ignore"):
        for oy, ox, ky, kx in itertools.product(range(side), range(side), range(3), range(3)):
            iy, ix = oy + ky - 1, ox + kx - 1
            if 0 <= iy < side and 0 <= ix < side: ref[:, :, oy, ox] += x[:, :, iy, ix] @ w[:, :, ky, kx].T
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, equal_nan=True)
    assert np.isfinite(out[:, :, 0, 1]).all() and np.isfinite(out[:, :, 1, 0]).all()
    assert np.isnan(out[:, :, 0, 0]).all() and np.isposinf(out[:, :, 1, 1]).all()

def _is_zero(u: UOp) -> bool:
    """A constant 0, or a vector of them."""
    if u.op is Ops.CONST: return u.arg == 0
    return u.op is Ops.VECTORIZE and all(_is_zero(s) for s in u.src)

def test_unrolled_window_multiplies_only_the_image(monkeypatch: pytest.MonkeyPatch):
    """A 3x3 convolution over 4x4 images whose window row (kw) is unrolled against a register tile of the image row
    (the digits CNN's and ResNet's 4x4 layers): the unrolled terms that fall in padding (kw = 0 for the row's first
    output, kw = 2 for its last) are not multiply-adds of zeros; no multiply-add in the kernel has a zero operand.
    Values against torch."""
    ast = _padded_conv_kernel(monkeypatch, 8, 96, 4)   # (a shape no other test compiles)
    p = get_program(ast, RENDERER)
    assert any(o.op.name == "UNROLL" for o in p.applied_opts), p.applied_opts
    products = [u for u in p.uops if u.op is Ops.MULACC]
    assert products and not any(_is_zero(s) for u in products for s in u.src[:2])

def test_quick_program_skips_the_same_padding(monkeypatch: pytest.MonkeyPatch):
    """The quick program of a first run makes loops of the unrolled window lanes and of the image row's tile, whose
    lanes in padding the full program drops: it selects the weight to 0 there (the product adds +0 * 0). With an inf
    weight at a tap that the row's first outputs read only in padding, its bits are the full program's, NaN and inf
    included; and the padding-free outputs are finite."""
    asts = captured_asts(monkeypatch)
    n, c = 8, 112   # (a shape no other test compiles)
    x = np.abs(RS.standard_normal((n, c, 4, 4))).astype(np.float32) + 0.5
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    Tensor(x).conv2d(Tensor(w), padding=1).realize()
    (ast,) = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    w[:, 0, :, 0] = np.inf   # (the window's first column: padding for the outputs of column 0)
    # (the kernel's buffers: 0 the output, then the input and the weights, told apart by their sizes)
    sizes = sorted((g.arg, g.dtype.size) for g in ast.toposort() if g.op is Ops.DEFINE_GLOBAL)
    assert [a for a, _ in sizes] == [0, 1, 2] and {sz for _, sz in sizes[1:]} == {x.size, w.size}
    outs = []
    for quick in (False, True):
        bufs = [np.zeros(x.size, np.float32)] + [(x if sz == x.size else w).reshape(-1).copy() for _, sz in sizes[1:]]
        p = get_program(ast, RENDERER, quick=quick)
        assert p.quick == quick, "the quick program rolled nothing"
        call(p, bufs)
        outs.append(bufs[0].reshape(n, c, 4, 4))
    np.testing.assert_array_equal(outs[0].view(np.int32), outs[1].view(np.int32))
    assert np.isfinite(outs[0][:, :, :, 0]).all() and np.isposinf(outs[0][:, :, :, 1:]).all()

@pytest.mark.parametrize("n, c, side", [(16, 64, 2), (8, 32, 4)])
def test_quick_programs_of_padded_conv_training(monkeypatch: pytest.MonkeyPatch, n: int, c: int, side: int):
    """Every kernel of a padded convolution's forward and both gradients (ResNet's last stage at 64 px: 2x2 and 4x4
    images, the weight gradient's window upcast against its unrolled image rows) has a quick program, and it
    computes the full program's bits on random inputs, some inf: outputs compared bit for bit."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, c, side, side)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for a, b in zip(ours, ref): np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)
    kernels = [a for a in asts if any(u.op is Ops.REDUCE for u in a.toposort())]
    assert len(kernels) >= 3
    rolled = 0
    for ast in kernels:
        globs = sorted((g for g in ast.toposort() if g.op is Ops.DEFINE_GLOBAL), key=lambda g: g.arg)
        if any(g.dtype.base != dtypes.float32 for g in globs) or any(u.op is Ops.DEFINE_VAR for u in ast.toposort()):
            continue
        rs = np.random.default_rng(1)
        inputs = [rs.standard_normal(g.dtype.size).astype(np.float32) for g in globs]
        inputs[-1][::97] = np.inf
        outs = []
        for quick in (False, True):
            bufs = [a.copy() for a in inputs]
            p = get_program(ast, RENDERER, quick=quick)
            rolled += p.quick
            call(p, bufs)
            outs.append(bufs)
        for a, b in zip(*outs): np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32))
    assert rolled, "no quick program rolled anything"

def test_window_sum_of_a_symbolic_length():
    """The padded 1-d window sum over x of a length given by a Variable (its gate `pos < n`): the bound is made of
    the variable, and the values are right for several lengths (against a loop in Python)."""
    k, pad, cap = 3, 1, 12
    nv = UOp.variable("n", 1, cap)
    g0, g1, g2 = glob(0, dtypes.float32, cap), glob(1, dtypes.float32, cap), glob(2, dtypes.float32, k)
    o, r = rng(nv, 0), rng(k, 1, "reduce")
    pos = o + r - pad
    gate = (pos < nv) & (UOp.const(dtypes.index, -1) < pos)
    ast = UOp.sink_of(g0.index(o).store(reduce(g1.index(pos, valid=gate).load() * g2.index(r).load(), r)))
    assert not any(u.op is Ops.INDEX and len(u.src) > 2 for u in bound_sum_loops(ast).toposort())
    w = RS.standard_normal(k).astype(np.float32)
    for n in (1, 2, 5, 12):
        x = RS.standard_normal(cap).astype(np.float32)
        out = np.zeros(cap, np.float32)
        run(ast, [out, x, w], var_vals={"n": n})
        np.testing.assert_allclose(out[:n], _window_sum_ref(x[:n], w, pad, False), rtol=1e-5, atol=1e-6)
