"""A scalar select of floats on loaded data is rendered as bit operations (`ClangRenderer._bit_select`), not as C's
`c ? a : b`, which gcc compiled to a branch that random data mispredicts half the time. The same bits as numpy's
where, for nan, infinities and signed zeros, in float32 and float64, in scalar reductions and elementwise kernels."""
from __future__ import annotations
import re
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import get_program
from fusegrad.uop.ops import Ops
from test.codegen.helpers import RENDERER

RS = np.random.default_rng(0)
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1.5]

def with_specials(shape: tuple[int, ...], dt) -> np.ndarray:
    x = RS.standard_normal(shape).astype(dt).reshape(-1)
    x[:len(SPECIAL)] = SPECIAL
    return x.reshape(shape)

def sources(make) -> list[str]:
    return [get_program(ei.ast, RENDERER).src for ei in make().schedule() if ei.ast.op is Ops.SINK]

@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_relu_gradient_sum_over_5x5_images(dt):
    """A batch norm's weight gradient shape: sum over (batch, 5x5 pixels) of g where x > 0 (scalar code: 25 pixels
    make no whole vectors), by channel; nan and infinities in x and in g."""
    x, g = with_specials((4, 8, 5, 5), dt), with_specials((4, 8, 5, 5), dt)[::-1].copy()
    xt, gt = Tensor(x).realize(), Tensor(g).realize()
    make = lambda: (xt > 0).where(gt, 0).sum((0, 2, 3))
    (src,) = sources(make)
    assert "fg_bitsel_" in src and not re.search(r"\?\s*val", src)
    want = np.where(x > 0, g, 0).sum((0, 2, 3))
    np.testing.assert_allclose(make().numpy(), want, rtol=1e-5 if dt == np.float32 else 1e-12, atol=1e-5)

@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_elementwise_select_same_bits(dt):
    """`c.where(a, b)` of loaded values, elementwise (a loop gcc vectorizes): the same bits as numpy, signed zeros
    and nan payloads included."""
    c, a, b = (with_specials((1000,), dt) for _ in range(3))
    b[::3] = -0.0
    got = (Tensor(c) < 0.5).where(Tensor(a), Tensor(b)).numpy()
    want = np.where(c < 0.5, a, b)
    assert got.dtype == want.dtype and np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))

def test_index_select_keeps_the_conditional():
    """A select on the loop indices alone (a padding mask: predictable) keeps C's conditional expression."""
    x = Tensor(RS.standard_normal((5, 5)).astype(np.float32)).realize()
    assert all("fg_bitsel_" not in s for s in sources(lambda: x.pad(((1, 1), (1, 1))).contiguous()))

@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_loaded_mask_in_a_reduction_selects_in_a_vector_register(dt):
    """A reduction whose condition is a loaded bool (a relu mask the forward stored) selects in a vector register
    (`_bit_select(in_vector=True)`), where an elementwise kernel keeps the bit operations: the same values as numpy,
    nan, infinities and signed zeros in both operands."""
    m = RS.random((4, 8, 5, 5)) > 0.5
    a, b = with_specials((4, 8, 5, 5), dt), with_specials((4, 8, 5, 5), dt)[::-1].copy()
    mt, at, bt = Tensor(m).realize(), Tensor(a).realize(), Tensor(b).realize()
    make = lambda: mt.where(at, bt).sum((0, 2, 3))
    (src,) = sources(make)
    assert "fg_vsel1_" in src and not re.search(r"\?\s*val", src)
    want = np.where(m, a, b).sum((0, 2, 3))
    np.testing.assert_allclose(make().numpy(), want, rtol=1e-5 if dt == np.float32 else 1e-12, atol=1e-5)
    # elementwise, the bit operations, and the same bits as numpy
    (ew,) = sources(lambda: mt.where(at, bt))
    assert "fg_vsel1_" not in ew
    got = mt.where(at, bt).numpy()
    assert np.array_equal(got.view(f"u{got.itemsize}"), np.where(m, a, b).view(f"u{got.itemsize}"))
