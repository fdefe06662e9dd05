"""Kernel shapes the heuristic recognizes: a concatenation or stack along a small axis (its loop is unrolled, so
each lane loads only its own branch, and the loop left is vectorized), tiles laid out as image rows (the loop is
upcast by the tile's width, so each lane's loads are affine; a longer period splits the loop instead), and a
batched matmul (its batch loop stays outermost, so each batch's column panel is reused by that batch's row tiles).
Results against numpy and torch, and the opts chosen; and the row tile of a matmul whose rows 8 does not divide."""
import os
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen import get_program, optimize
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.device import Device
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX2, AVX512, renderer_like

RS = np.random.RandomState(11)

def opts_of(t: Tensor, facts: tuple[int, int] | None = None) -> list[Opt]:
    """The opts of the last kernel that computes `t` (which then points at buffers nothing has filled), on this
    machine or on one with the vector `facts` (helpers.AVX512, AVX2)."""
    si = [si for si in t.schedule() if si.ast.op is Ops.SINK][-1]
    if facts is not None: return list(optimize(si.ast, renderer_like(facts))[1])
    return get_program(si.ast, Device["CPU"].renderer).applied_opts

def this_machine() -> tuple[int, int]:
    ren = Device["CPU"].renderer
    return (ren.simd_bytes, ren.vector_registers)

def stacked(x: Tensor) -> Tensor:
    return Tensor.stack(x[:, 0::4] * 2 + x[:, 1::4], x[:, 1::4] - x[:, 2::4], x[:, 2::4] + x[:, 3::4],
                        x[:, 3::4] * 3, dim=1)

def test_stack_of_slices_unrolls_its_branches():
    X = RS.randn(8, 256, 64).astype(np.float32)
    # the stack's axis (4 branches) is unrolled whole, then the innermost loop the store moves along is vectorized
    opts = opts_of(stacked(Tensor(X)))
    assert opts[0] == Opt(OptOps.UPCAST, 1, 0) and opts[1].op is OptOps.UPCAST and opts[1].arg > 1, opts
    xt = torch.tensor(X)
    ref = torch.stack([xt[:, 0::4] * 2 + xt[:, 1::4], xt[:, 1::4] - xt[:, 2::4], xt[:, 2::4] + xt[:, 3::4],
                       xt[:, 3::4] * 3], dim=1).numpy()
    np.testing.assert_allclose(stacked(Tensor(X)).numpy(), ref, rtol=1e-6, atol=1e-6)

def test_unrolled_branches_are_decided_in_the_source():
    # in each lane of the unrolled stack axis the concatenation's position checks are constants: the lane's select
    # is its own branch and the other branches' loads are gone, so no select on a constant reaches the compiler
    import re
    X = RS.randn(8, 256, 64).astype(np.float32)
    si = [si for si in stacked(Tensor(X)).schedule() if si.ast.op is Ops.SINK][-1]
    src = get_program(si.ast, Device["CPU"].renderer).src
    assert not re.search(r"\((0|1|alu\d+)\?", src), src
    xt = torch.tensor(X)
    ref = torch.stack([xt[:, 0::4] * 2 + xt[:, 1::4], xt[:, 1::4] - xt[:, 2::4], xt[:, 2::4] + xt[:, 3::4],
                       xt[:, 3::4] * 3], dim=1).numpy()
    np.testing.assert_allclose(stacked(Tensor(X)).numpy(), ref, rtol=1e-6, atol=1e-6)

@pytest.mark.parametrize("tile,tw", [(4, 8), (2, 16), (3, 5), (5, 3)])
def test_tiles_laid_out_as_rows(tile: int, tw: int):
    # (tile, tile, c, b, th, tw) -> (b, c, th*tile, tw*tile): the pixel x*tile + j of a row is position j of tile x,
    # so the row loop is upcast by the tile width (the lanes' loads are then contiguous along x), and the rows' loop
    # by the tile height (within 16 lanes: `_upcast_remainder_rows`; 5x5 tiles keep their rows' loop)
    X, bias = RS.randn(tile, tile, 8, 2, 3, tw).astype(np.float32), RS.randn(8).astype(np.float32)
    def rows(t: Tensor, b: Tensor) -> Tensor:
        return t.permute(3, 2, 4, 0, 5, 1).reshape(2, 8, 3 * tile, tw * tile) + b.reshape(1, 8, 1, 1)
    opts = opts_of(rows(Tensor(X), Tensor(bias)))
    assert list(opts) == [Opt(OptOps.UPCAST, 3, tile)] + ([Opt(OptOps.UPCAST, 2, tile)] if tile * tile <= 16 else []), \
        opts
    ref = X.transpose(3, 2, 4, 0, 5, 1).reshape(2, 8, 3 * tile, tw * tile) + bias.reshape(1, 8, 1, 1)
    np.testing.assert_array_equal(rows(Tensor(X), Tensor(bias)).numpy(), ref)

@pytest.mark.parametrize("case", ["repeat", "heads"])
def test_rows_split_where_loads_wrap(case: str):
    # the store's row index modulo (or divided by) a long constant: the loop is split into blocks of it, each block
    # contiguous in the loads (a repeated tensor; attention heads moved next to the batch, then merged)
    X = RS.randn(8, 16, 4, 32).astype(np.float32)
    def f(x: Tensor) -> Tensor:
        return x.reshape(64, 256).repeat(2, 3) if case == "repeat" else x.permute(0, 2, 1, 3).reshape(8, 4, 512)
    opts = opts_of(f(Tensor(X)))
    assert any(o.op is OptOps.SPLIT for o in opts), opts
    xt = torch.tensor(X)
    ref = xt.reshape(64, 256).repeat(2, 3) if case == "repeat" else xt.permute(0, 2, 1, 3).reshape(8, 4, 512)
    np.testing.assert_array_equal(f(Tensor(X)).numpy(), ref.numpy())

def test_reduction_stored_as_tiled_rows():
    # a small matmul whose (4, 4) rows are a tile's pixels, stored as image rows: no loop is vectorizable, so each
    # tile's 16 outputs get scalar registers (both pixel loops upcast by 4), the values read in their memory order
    A, M = RS.randn(16, 36).astype(np.float32), RS.randn(36, 8 * 2 * 3 * 4).astype(np.float32)
    def rows(a: Tensor, m: Tensor) -> Tensor:
        return (a @ m).reshape(4, 4, 8, 2, 3, 4).permute(3, 2, 4, 0, 5, 1).reshape(2, 8, 12, 16)
    opts = opts_of(rows(Tensor(A), Tensor(M)))
    assert [o.arg for o in opts if o.op is OptOps.UPCAST] == [4, 4] and any(o.op is OptOps.SWAP for o in opts), opts
    ref = (A.astype(np.float64) @ M).reshape(4, 4, 8, 2, 3, 4).transpose(3, 2, 4, 0, 5, 1).reshape(2, 8, 12, 16)
    np.testing.assert_allclose(rows(Tensor(A), Tensor(M)).numpy(), ref, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("n,dim,size", [(6, 1, (5, 1, 7)), (3, 0, (1, 33)), (8, 2, (2, 3, 1)), (2, 1, (4, 1, 16))])
def test_cat_along_a_small_axis(n: int, dim: int, size: tuple):
    parts = [RS.randn(*size).astype(np.float32) for _ in range(n)]
    got = Tensor.cat(*[Tensor(p) * (i + 1) - i for i, p in enumerate(parts)], dim=dim).numpy()
    np.testing.assert_array_equal(got, np.concatenate([p * np.float32(i + 1) - np.float32(i)
                                                       for i, p in enumerate(parts)], axis=dim))

@pytest.mark.parametrize("facts,expected", [
    # no vector of 16 lanes or its half divides the 12 columns: padded to one vector
    (AVX512, [Opt(OptOps.PADTO, 2, 16), Opt(OptOps.UPCAST, 2, 16)]),
    # a half vector (4 lanes) divides them: three of those, nothing padded
    (AVX2, [Opt(OptOps.UPCAST, 2, 4)])])
def test_padding_alone_is_not_a_selector(facts: tuple[int, int], expected: list[Opt]):
    # a padded copy gates its load on sums of loops (the pixel's position), not on a loop by itself: no loop is
    # unrolled whole; its rows (12 columns) are vectorized instead (gated loads: no gcc vectors)
    X = RS.randn(4, 8, 8).astype(np.float32)
    def padded() -> Tensor: return Tensor(X).pad(((0, 0), (1, 1), (2, 2))) * 2
    assert opts_of(padded(), facts) == expected
    opts = opts_of(padded())
    assert all(o.arg != 0 for o in opts if o.op is OptOps.UPCAST), opts
    if this_machine() == facts: assert list(opts) == expected, opts
    np.testing.assert_array_equal(padded().numpy(), np.pad(X, ((0, 0), (1, 1), (2, 2))) * 2)

@pytest.mark.parametrize("b,m,k,n", [(36, 64, 64, 1024), (4, 128, 96, 256), (3, 64, 32, 512)])
def test_batched_matmul_keeps_the_batch_outermost(b: int, m: int, k: int, n: int):
    A, B = RS.randn(b, m, k).astype(np.float32), RS.randn(b, k, n).astype(np.float32)
    opts = opts_of(Tensor(A) @ Tensor(B))
    # the loops are (batch, rows, columns): the columns move inside the batch, never around it, when the batches
    # split evenly across the cores (the outermost loop is theirs); else the columns go outermost
    cores = os.cpu_count() or 2
    swap = Opt(OptOps.SWAP, 1, 2) if b % cores == 0 else Opt(OptOps.SWAP, 0, 2)
    assert swap in opts and all(o == swap for o in opts if o.op is OptOps.SWAP), opts
    np.testing.assert_allclose((Tensor(A) @ Tensor(B)).numpy(), A @ B, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64, np.bool_])
@pytest.mark.parametrize("device", ["CPU", "LLVM"])
def test_stack_in_every_dtype(dt, device: str):
    # the unrolled branches and the vector along the loop left, in every dtype and on both compiled backends
    if device == "LLVM": pytest.importorskip("llvmlite")
    X = (RS.randn(3, 40, 24) * 20).astype(dt) if dt is not np.bool_ else RS.rand(3, 40, 24) > 0.5
    x = Tensor(X, device=device)
    parts = [x[:, i::4] for i in range(4)]
    np.testing.assert_array_equal(Tensor.stack(*parts, dim=1).numpy(), np.stack([X[:, i::4] for i in range(4)], 1))
    got = Tensor.cat(x[:, :, :8], x[:, :, 16:], x[:, :, 8:16], dim=1).numpy()
    np.testing.assert_array_equal(got, np.concatenate([X[:, :, :8], X[:, :, 16:], X[:, :, 8:16]], 1))

# rows, then (tile, padded) with AVX-512's 32 registers and with AVX2's 16
ROW_TILES = [(36, (6, False), (6, False)), (30, (6, False), (6, False)), (1023, (8, True), (6, True)),
             (54, (8, True), (6, False)), (100, (8, True), (6, True)), (1000, (8, False), (6, True))]

@pytest.mark.parametrize("m,avx512,avx2", ROW_TILES)
def test_matmul_row_tile(m: int, avx512: tuple[int, bool], avx2: tuple[int, bool]):
    # the register tile is rows x 2 vectors of accumulators: 8 rows in half of 32 registers, 6 rows (12 accumulators)
    # with 16, where the other 4 hold the row's two vectors and the broadcast row value (the reduce loop isn't
    # unrolled there). Rows that the full tile doesn't divide take a 6-row tile where padding to 8 would waste a
    # sixteenth or more (36 rows, Winograd's transforms), else are padded to the full tile when that wastes at most an
    # eighth (1023, 54, 100; and with 6-row tiles 1023, 100 and 1000)
    A, B = RS.randn(m, 64).astype(np.float32), RS.randn(64, 256).astype(np.float32)
    for facts, (tile, padded) in ((AVX512, avx512), (AVX2, avx2)):
        for opts in [opts_of(Tensor(A) @ Tensor(B), facts)] + \
                ([opts_of(Tensor(A) @ Tensor(B))] if this_machine() == facts else []):
            rows = [o for o in opts if o.axis == 0 and o.op in (OptOps.UPCAST, OptOps.PADTO)]
            assert (Opt(OptOps.PADTO, 0, tile) in rows) == padded and Opt(OptOps.UPCAST, 0, tile) in rows, (facts, opts)
            # (the 12 accumulators with 16 registers leave none for an unrolled reduce loop's vectors)
            assert any(o.op is OptOps.UNROLL for o in opts) == (facts == AVX512), (facts, opts)
    np.testing.assert_allclose((Tensor(A) @ Tensor(B)).numpy(), A @ B, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("hw,stride", [(14, 1), (28, 1), (28, 2)])
def test_depthwise_convolution_shares_its_loads(hw: int, stride: int):
    # a depthwise convolution's weight is the same for every pixel of a channel: the rows of the image are upcast so
    # their accumulators share each broadcast weight; its weight gradient upcasts its 3x3 taps, which all read each
    # value of the output gradient (as scalar accumulators on 14x14, as vector ones along the rows on 28x28)
    X, W = RS.randn(2, 32, hw, hw).astype(np.float32), RS.randn(32, 1, 3, 3).astype(np.float32)
    G = RS.randn(2, 32, hw // stride, hw // stride).astype(np.float32)
    def run() -> tuple[Tensor, Tensor, Tensor]:
        x, w = Tensor(X), Tensor(W)
        out = x.conv2d(w, stride=stride, padding=1, groups=32)
        return (out, *out.gradient(x, w, gradient=Tensor(G)))
    if stride == 1:
        opts = opts_of(run()[0])
        assert sum(1 for o in opts if o.op is OptOps.UPCAST) >= 2, opts   # the vector, and the rows sharing weights
    else:   # (no copy of the weights to vectorize the output channels: a group has one)
        assert len([si for si in run()[0].schedule() if si.ast.op is Ops.SINK]) == 1
    wopts = opts_of(run()[2])
    assert sum(1 for o in wopts if o.op is OptOps.UPCAST and o.arg in (0, 3)) == 2, wopts
    out, gx, gw = run()
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    tout = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=1, groups=32)
    tgx, tgw = torch.autograd.grad(tout, (tx, tw), torch.tensor(G))
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx.numpy(), tgx.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw.numpy(), tgw.numpy(), rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("dt", [np.float32, np.float16, np.float64, np.int8, np.int32, np.uint8, np.bool_])
@pytest.mark.parametrize("width", [7, 12, 66, 200])
@pytest.mark.parametrize("device", ["CPU", "LLVM"])
def test_padded_copies_take_vectors(dt, width: int, device: str):
    # pads and concatenations gate their loads, which keeps gcc's loop vectorizer away: their rows get our vectors
    # (masked loads at the edges, rows padded to whole vectors where no vector divides them), in every dtype
    if device == "LLVM": pytest.importorskip("llvmlite")
    X = (RS.randn(3, 5, width) * 20).astype(dt) if dt is not np.bool_ else RS.rand(3, 5, width) > 0.5
    x = Tensor(X, device=device)
    np.testing.assert_array_equal(x.pad(((0, 0), (1, 2), (1, 1))).numpy(), np.pad(X, ((0, 0), (1, 2), (1, 1))))
    for mode in ("reflect", "replicate", "circular"):
        np_mode = {"replicate": "edge", "circular": "wrap"}.get(mode, mode)
        np.testing.assert_array_equal(x.pad((2, 3, 1, 1), mode=mode).numpy(),
                                      np.pad(X, ((0, 0), (1, 1), (2, 3)), mode=np_mode))
    np.testing.assert_array_equal(x.cat(x[:, :, :3], dim=2).numpy(), np.concatenate([X, X[:, :, :3]], 2))

def test_padded_copy_is_vectorized_along_its_rows():
    # a 1-pixel zero pad of 64-pixel rows: 66 columns, padded to whole vectors (no gcc vectors for gated loads)
    lanes = Device["CPU"].renderer.simd_bytes // 4
    X = RS.randn(2, 3, 64, 64).astype(np.float32)
    opts = opts_of(Tensor(X).pad((1, 1, 1, 1)).contiguous())
    if lanes >= 8: assert list(opts) == [Opt(OptOps.PADTO, 3, lanes), Opt(OptOps.UPCAST, 3, lanes)], opts
    np.testing.assert_array_equal(Tensor(X).pad((1, 1, 1, 1)).contiguous().numpy(),
                                  np.pad(X, ((0, 0), (0, 0), (1, 1), (1, 1))))

def test_linear_upsampling_vectorizes_past_its_remainder():
    # 2x linear upsampling: each output column reads its source column q = col//2 and a zero-padded neighbour
    # (gated loads: no gcc vectors). The column loop is upcast by its remainder 2, then the loop left by a vector
    lanes = Device["CPU"].renderer.simd_bytes // 4
    X = RS.randn(2, 3, 16, 64).astype(np.float32)
    opts = opts_of(Tensor(X).interpolate((32, 128)))
    if lanes >= 8: assert list(opts) == [Opt(OptOps.UPCAST, 3, 2), Opt(OptOps.UPCAST, 3, lanes)], opts
    ref = torch.nn.functional.interpolate(torch.tensor(X), (32, 128), mode="bilinear", align_corners=False)
    np.testing.assert_allclose(Tensor(X).interpolate((32, 128)).numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)
