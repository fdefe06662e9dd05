"""Matmul register tiles and loop orders of the CPU heuristic, against NumPy: the 6-row x 2-vector tile of targets
with 16 vector registers (AVX2; rows padded to whole tiles, the reduce loop not unrolled) beside AVX-512's 8-row one,
odd and empty sizes, transposed operands, a kernel split across cores, and a weight gradient fused with an update of
buffers shaped like it (an optimizer's state), whose row tiles go outermost."""
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, Opt, OptOps
from fusegrad.codegen.opt.heuristic import ROWS_OUTER_MIN_OUTPUTS, hand_coded_optimizations
from fusegrad.device import Device
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import UOp
from test.codegen.helpers import AVX2, AVX512, call, glob, reduce, renderer_like, rng

RS = np.random.default_rng(5)

def mm_ast(m: int, n: int, k: int, ta: bool = False, tb: bool = False, epilogue: bool = False) -> UOp:
    """out (m, n) = A @ B over k, A stored (k, m) if `ta`, B stored (n, k) if `tb`; with `epilogue`, out -= A @ B: the
    output is read after the reduction and updated in place (as an optimizer updates a weight)."""
    out, a, b = glob(0, dtypes.float32, m * n), glob(1, dtypes.float32, m * k), glob(2, dtypes.float32, k * n)
    r0, r1, r2 = rng(m, 0), rng(n, 1), rng(k, 2, "reduce")
    a_at, b_at = (r2 * m + r0 if ta else r0 * k + r2), (r1 * k + r2 if tb else r2 * n + r1)
    acc = reduce(a.index(a_at).load() * b.index(b_at).load(), r2)
    at = out.index(r0 * n + r1)
    return UOp.sink_of(at.store(at.load() - acc if epilogue else acc))

def operands(m: int, n: int, k: int, ta: bool, tb: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A (m, k) and B (k, n) as stored (transposed where asked) and their float64 product."""
    a, b = RS.standard_normal((m, k)).astype(np.float32), RS.standard_normal((k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    return (np.ascontiguousarray(a.T) if ta else a), (np.ascontiguousarray(b.T) if tb else b), ref

def opts_for(ast: UOp, facts: tuple[int, int]) -> list[Opt]:
    k = Kernel(ast, renderer_like(facts))
    hand_coded_optimizations(k)
    return list(k.applied_opts)

def avx2_runs_here() -> bool:
    """Whether this machine runs code rendered for AVX2 (32-byte vectors with fused multiply-adds)."""
    return getattr(Device["CPU"].renderer, "simd_bytes", 0) >= 32

# (m, n, k, A transposed, B transposed): contractions of 1, 3, 127 and 785; rows and columns that no tile or vector
# divides; the MLP's shapes (128 rows padded to 132)
SHAPES = [(1, 1, 1, False, False), (13, 37, 1, False, False), (6, 16, 3, False, False), (37, 24, 127, False, True),
          (130, 40, 785, True, False), (7, 9, 785, True, True), (128, 512, 784, False, True),
          (128, 784, 512, False, False), (66, 48, 128, True, False)]

@pytest.mark.parametrize("m,n,k,ta,tb", SHAPES)
def test_matmul_shapes(m: int, n: int, k: int, ta: bool, tb: bool):
    """Through the tensor API, with the tiles this machine's heuristic picks."""
    a, b, ref = operands(m, n, k, ta, tb)
    ours = (Tensor(a).T if ta else Tensor(a)) @ (Tensor(b).T if tb else Tensor(b))
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-4, atol=1e-4 * np.sqrt(k))

@pytest.mark.parametrize("m,n,k,ta,tb", SHAPES)
def test_avx2_tiles(m: int, n: int, k: int, ta: bool, tb: bool):
    """The kernel as rendered for AVX2, run whole and in two chunks (as two cores run it)."""
    ast = mm_ast(m, n, k, ta, tb)
    ren = renderer_like(AVX2) if avx2_runs_here() else Device["CPU"].renderer
    p = get_program(ast, ren)
    a, b, ref = operands(m, n, k, ta, tb)
    gs = p.global_size
    for splits in ([(0, gs)], [(0, gs // 2), (gs // 2, gs)]):
        out = np.full((m, n), np.nan, np.float32)
        call(p, [out, a, b], splits=splits)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=str(p.applied_opts))

@pytest.mark.parametrize("shape", [(0, 5, 8), (4, 0, 8), (4, 5, 0)])
def test_empty_matmuls(shape: tuple[int, int, int]):
    m, k, n = shape
    a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
    ours = (Tensor(a) @ Tensor(b)).numpy()
    assert ours.shape == (m, n)
    np.testing.assert_array_equal(ours, np.zeros((m, n), np.float32))

def test_row_tile_by_target():
    """128 x 784 @ 784 x 512: 6-row tiles (128 rows padded to 132) without an unrolled reduce loop on AVX2, 8-row
    tiles with it unrolled by 4 on AVX-512; both blocked (KBLOCK) and packed."""
    ast = mm_ast(128, 512, 784)
    avx2, avx512 = opts_for(ast, AVX2), opts_for(ast, AVX512)
    assert Opt(OptOps.PADTO, 0, 6) in avx2 and Opt(OptOps.UPCAST, 0, 6) in avx2, avx2
    assert not any(o.op is OptOps.UNROLL for o in avx2), avx2
    assert Opt(OptOps.UPCAST, 0, 8) in avx512 and any(o.op is OptOps.UNROLL for o in avx512), avx512
    for opts in (avx2, avx512):
        assert any(o.op is OptOps.KBLOCK for o in opts) and any(o.op is OptOps.PACK for o in opts), opts

def test_rows_outermost_with_an_update():
    """A 512 x 784 weight gradient over a batch of 128 (its output gradient read transposed) that updates its output
    in place walks its row tiles outermost (no SWAP of the columns outside them) and packs the transposed operand per
    row tile; the same product without the update keeps its column panels outermost."""
    m, n, k = 512, 784, 128
    assert m * n >= ROWS_OUTER_MIN_OUTPUTS
    for facts in (AVX2, AVX512):
        fused = opts_for(mm_ast(m, n, k, ta=True, epilogue=True), facts)
        plain = opts_for(mm_ast(m, n, k, ta=True), facts)
        assert not any(o.op is OptOps.SWAP for o in fused), fused
        assert [o.arg for o in fused if o.op is OptOps.PACK] == [1], fused   # buffer 1: the output gradient
        assert any(o.op is OptOps.SWAP for o in plain), plain
    # a small one (buffers that stay in the caches) keeps its column panels, and so does a product read by a sum with
    # another buffer (a convolution's residual) rather than updating its output
    residual = UOp.sink_of(glob(0, dtypes.float32, m * n).index(rng(m, 0) * n + rng(n, 1)).store(
        glob(3, dtypes.float32, m * n).index(rng(m, 0) * n + rng(n, 1)).load() +
        mm_ast(m, n, k, ta=True).src[0].src[1]))
    assert any(o.op is OptOps.SWAP for o in opts_for(residual, AVX2))
    assert any(o.op is OptOps.SWAP for o in opts_for(mm_ast(16, 512, 128, ta=True, epilogue=True), AVX2))

@pytest.mark.parametrize("m,n,k", [(512, 784, 128), (130, 520, 96)])
def test_rows_outermost_against_numpy(m: int, n: int, k: int):
    """The fused update's kernel (AVX2's tiles) run whole and in two chunks, against NumPy."""
    ast = mm_ast(m, n, k, ta=True, epilogue=True)
    p = get_program(ast, renderer_like(AVX2) if avx2_runs_here() else Device["CPU"].renderer)
    a, b, ref = operands(m, n, k, True, False)
    c = RS.standard_normal((m, n)).astype(np.float32)
    gs = p.global_size
    for splits in ([(0, gs)], [(0, gs // 2), (gs // 2, gs)]):
        out = c.copy()
        call(p, [out, a, b], splits=splits)
        np.testing.assert_allclose(out, c - ref, rtol=1e-4, atol=1e-3, err_msg=str(p.applied_opts))

def test_weight_update_through_tensors():
    """An SGD-like update of a 512 x 784 weight by x.T @ dy, assigned in place, against NumPy."""
    x = RS.standard_normal((128, 512)).astype(np.float32)
    dy = RS.standard_normal((128, 784)).astype(np.float32)
    w0 = RS.standard_normal((512, 784)).astype(np.float32)
    w = Tensor(w0.copy()).realize()
    w.assign(w - 0.01 * (Tensor(x).T @ Tensor(dy))).realize()
    ref = w0.astype(np.float64) - 0.01 * (x.T.astype(np.float64) @ dy.astype(np.float64))
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-4, atol=1e-4)

def test_kblock_blocks_stay_in_order():
    """KBLOCK's block loop (each block adds to the partial sum the block before it stored) can't become lanes or be
    padded: those opts are refused, while the same opts on the loops beside it still apply and compute the product."""
    from fusegrad.codegen.opt import KernelOptError
    from test.codegen.helpers import RENDERER
    m, n, k = 33, 48, 785
    base = [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 1, 2), Opt(OptOps.UPCAST, 0, 3), Opt(OptOps.SWAP, 0, 1),
            Opt(OptOps.KBLOCK, 2, 157)]
    kern = Kernel(mm_ast(m, n, k), RENDERER)
    for o in base: kern.apply_opt(o)
    block = 1   # (KBLOCK puts its block loop second: the columns, the blocks, the rows)
    for bad in (Opt(OptOps.UPCAST, block, 0), Opt(OptOps.UPCAST, block, 5), Opt(OptOps.PADTO, block, 2)):
        with pytest.raises(KernelOptError): kern.apply_opt(bad)
    a, b, ref = operands(m, n, k, False, False)
    for extra in ([], [Opt(OptOps.UPCAST, 2, 0)]):   # (the rows loop left, upcast whole)
        p = get_program(mm_ast(m, n, k), RENDERER, opts=base + extra)
        out = np.full((m, n), np.nan, np.float32)
        call(p, [out, a, b])
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-3, err_msg=str(p.applied_opts))
