"""Convolutions on small padded images (the digits CNN's 4x4, and 2x2 to 14x14): the CPU heuristic's loop shapes for
them (the padded row unrolled, the weight gradient along its output channels) and their values against torch; and a
vector square root in a kernel with gated loads."""
from __future__ import annotations
import math
import platform
import subprocess
import numpy as np
import pytest
import fusegrad.codegen as codegen
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import UOp
from test.codegen.helpers import AVX2, AVX512, RENDERER, captured_asts, conv_grads, renderer_like

RS = np.random.default_rng(0)

# (batch, input channels, output channels, image side, padding, stride): the digits CNN's second layer at a smaller
# batch, odd channel counts (24 output channels: a vector and a half; 5 input channels), 2x2 to 14x14 images
SHAPES = [(8, 32, 64, 4, 1, 1), (3, 5, 24, 4, 1, 1), (4, 16, 32, 6, 1, 1), (2, 32, 32, 12, 1, 1),
          (2, 16, 32, 14, 1, 1), (2, 24, 40, 2, 1, 1), (4, 32, 64, 8, 1, 2), (2, 8, 16, 7, 0, 1)]

@pytest.mark.parametrize("shape", SHAPES)
def test_small_image_conv_values(shape):
    """Forward, input gradient and weight gradient of 3x3 convolutions on small images, against torch."""
    n, ci, co, side, pad, stride = shape
    x = RS.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (RS.standard_normal((co, ci, 3, 3)) * 0.2).astype(np.float32)
    ours, ref = conv_grads(x, w, stride, pad, RS)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)

def test_digits_conv_opts(monkeypatch: pytest.MonkeyPatch):
    """The digits CNN's 32 -> 64 channel 3x3 convolution on 4x4 images (batch 64): its forward and input gradient,
    vectorized along their output channels with a tile spanning the image row, have the window's padded row (kw)
    unrolled; its weight gradient is vectorized along its output channels (the output gradient packed), kw upcast
    whole, and the image row it sums over unrolled. Values against torch."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((64, 32, 4, 4)).astype(np.float32)
    w = (RS.standard_normal((64, 32, 3, 3)) * 0.1).astype(np.float32)
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for a, b in zip(ours, ref): np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    def stores(ast: UOp, size: int) -> bool: return any(st.src[0].src[0].dtype.size == size for st in ast.src)
    convs = [a for a in asts if any(stores(a, s) for s in (64 * 64 * 16, 64 * 32 * 16)) and
             sum(1 for u in a.toposort() if u.op.name == "REDUCE") == 1]
    grads = [a for a in asts if stores(a, w.size)]
    assert len(convs) >= 2 and grads, "the convolution kernels weren't found"
    for facts, lanes in ((AVX2, 8), (AVX512, 16)):
        for ast in convs:
            k = Kernel(codegen.collapse_gathers(ast), renderer_like(facts))
            hand_coded_optimizations(k)
            assert any(o.op is OptOps.UNROLL and o.arg == 0 for o in k.applied_opts), k.applied_opts
        k = Kernel(codegen.collapse_gathers(grads[0]), renderer_like(facts))
        hand_coded_optimizations(k)
        ups = [o for o in k.applied_opts if o.op is OptOps.UPCAST]
        # the output channels (loop 0) are the vector; no reduce loop is upcast to a vector (each upcast, replayed,
        # is of an output loop when it is applied)
        assert ups[0].axis == 0 and ups[0].arg == lanes, k.applied_opts
        replay = Kernel(codegen.collapse_gathers(grads[0]), renderer_like(facts))
        for o in k.applied_opts:
            assert o.op is not OptOps.UPCAST or o.axis < replay.first_reduce, k.applied_opts
            replay.apply_opt(o)
        assert any(o.op is OptOps.PACK for o in k.applied_opts), k.applied_opts
        assert any(o.op is OptOps.UNROLL and o.arg == 0 for o in k.applied_opts), k.applied_opts

def test_long_rows_keep_the_reduction_vector(monkeypatch: pytest.MonkeyPatch):
    """A weight gradient over rows of 28 pixels (8 x 28 x 28 terms per output) keeps its reduction vectorized along
    the rows: the output gradient of a channel tile is too big to pack, and along the output channels it would be
    gathered lane by lane. Values against torch."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((2, 8, 28, 28)).astype(np.float32)
    w = (RS.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32)
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for a, b in zip(ours, ref): np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    grads = [a for a in asts if any(st.src[0].src[0].dtype.size == w.size for st in a.src)]
    assert grads
    k = Kernel(codegen.collapse_gathers(grads[0]), renderer_like(AVX2))
    hand_coded_optimizations(k)
    assert any(o.op is OptOps.UPCAST and o.axis >= k.first_reduce for o in k.applied_opts), k.applied_opts

def test_gated_vector_sqrt(monkeypatch: pytest.MonkeyPatch):
    """A square root of vectors in a kernel with gated loads (compiled without gcc's loop vectorizer) is one vector
    instruction on x86, not a loop of scalar square roots; values against NumPy."""
    asts = captured_asts(monkeypatch)
    a = RS.standard_normal((16, 61)).astype(np.float32)
    out = Tensor(a).pad(((0, 0), (1, 2))).abs().sqrt().numpy()
    np.testing.assert_allclose(out, np.sqrt(np.abs(np.pad(a, ((0, 0), (1, 2))))), rtol=1e-6)
    srcs = [codegen.get_program(ast, RENDERER).src for ast in list(asts)]
    src = next(s for s in srcs if "sqrt" in s)
    assert "no-tree-loop-vectorize" in src and "for (int i" not in src
    if platform.machine() in ("x86_64", "AMD64") and "-march=native" in RENDERER.compile_flags:
        asm = subprocess.run(["cc", *RENDERER.compile_flags, "-S", "-x", "c", "-", "-o", "-"], input=src,
                             capture_output=True, text=True, check=True).stdout
        assert "sqrtps" in asm and "sqrtss" not in asm

@pytest.mark.parametrize("n, c, side", [(16, 512, 2), (16, 256, 4)])
def test_last_stage_convs_take_one_channel_vector(monkeypatch: pytest.MonkeyPatch, n: int, c: int, side: int):
    """ResNet-18's last stages at 64 pixels: 3x3 convolutions of 512 and 256 channels over 2x2 and 4x4 images, a
    reduction of 4608 and 2304 per output. On AVX-512 the forward takes one vector of output channels (the weights'
    panel of a block then fits L1) and a tile of at most SMALL_IMAGE_TILE images (2x2) or of an image row of 4 and
    as many images as CHANNEL_TILE allows (4x4); on AVX2 two vectors, whose panel fits already. Values against torch,
    forward and both gradients."""
    from fusegrad.codegen.opt.heuristic import CHANNEL_TILE, SMALL_IMAGE_TILE
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((n, c, side, side)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.02).astype(np.float32)
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3, err_msg=name)
    # (the forward: the kernel storing the output whose reduction reads x and w)
    forward = [a for a in asts if any(st.src[0].src[0].dtype.size == n * c * side * side for st in a.src) and
               sum(1 for u in a.toposort() if u.op.name == "REDUCE") == 1]
    assert forward, "the forward kernel wasn't found"
    for facts, lanes, vectors in ((AVX512, 16, 1), (AVX2, 8, 2)):
        k = Kernel(codegen.collapse_gathers(forward[0]), renderer_like(facts))
        hand_coded_optimizations(k)
        ups = [o for o in k.applied_opts if o.op is OptOps.UPCAST]
        assert ups[0].arg == lanes, k.applied_opts
        channel_ups = [o.arg for o in ups if o.axis == ups[0].axis]
        assert channel_ups == [lanes] + ([vectors] if vectors > 1 else []), k.applied_opts
        if vectors == 1:
            assert math.prod(o.arg for o in ups[1:]) == (SMALL_IMAGE_TILE if side == 2 else CHANNEL_TILE), \
                k.applied_opts

@pytest.mark.parametrize("n", [1, 2])
def test_few_image_conv_takes_a_vector_of_output_channels(n: int):
    """A 3x3 convolution of 256 channels over 2x2 images at batch 1 or 2 (ResNet-18's last stage at 64 px, inference
    of one or two images): its weights, strided along the output channels, are reused by only 4 or 8 output pixels,
    fewer than a packed copy is made for, but with no other vector the output channels still take one on AVX-512 (the
    kernel was scalar there, 4-10 times slower; AVX2's 8 lanes take the image row of 2 first). Values against torch."""
    x = RS.standard_normal((n, 256, 2, 2)).astype(np.float32)
    w = (RS.standard_normal((256, 256, 3, 3)) * 0.02).astype(np.float32)
    (si,) = Tensor(x).conv2d(Tensor(w), padding=1).schedule()
    k = Kernel(codegen.collapse_gathers(si.ast), renderer_like(AVX512))
    hand_coded_optimizations(k)
    ups = [o for o in k.applied_opts if o.op is OptOps.UPCAST]
    assert ups and ups[0].arg == 16, k.applied_opts
    ours, ref = conv_grads(x, w, 1, 1, RS)
    for name, a, b in zip(("forward", "input gradient", "weight gradient"), ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3, err_msg=name)
