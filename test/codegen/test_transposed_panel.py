"""Matmuls whose operand broadcast along the vector is read transposed (a weight gradient's output gradient, the tied
embedding's logits gradient): the CPU heuristic's loop order for them, and their values against NumPy and torch."""
from __future__ import annotations
import numpy as np
import pytest
import torch
import fusegrad.codegen as codegen
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, Opt, OptOps
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.uop.ops import Ops
from test.codegen.helpers import AVX2, AVX512, captured_asts, renderer_like

RS = np.random.default_rng(0)

@pytest.mark.parametrize("k, m, n", [(512, 1031, 384), (300, 2053, 40), (3, 127, 1), (1, 1, 3), (128, 3, 127)])
def test_transposed_operand_matmul(k: int, m: int, n: int):
    """a.T @ b with a stored (k, m), rows of odd counts (tiles of 6 with a remainder), columns that no vector divides
    or a single one, against NumPy in float64."""
    a = RS.standard_normal((k, m)).astype(np.float32)
    b = RS.standard_normal((k, n)).astype(np.float32)
    ours = (Tensor(a).T @ Tensor(b)).numpy()
    np.testing.assert_allclose(ours, a.T.astype(np.float64) @ b.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(k))

def test_big_broadcast_operand_puts_its_row_tiles_outside(monkeypatch: pytest.MonkeyPatch):
    """An operand broadcast along the vector over a megabyte (1039 x 512 floats) has its row tiles outside the column
    tiles, where the other operand's block per core fits L2, and that block packed once per block of the reduction;
    read transposed, its own row tiles are packed too, as many at once as fill a cache line. Under a megabyte
    (1039 x 128) the column panels stay outside, the other operand packed per panel. A core's chunk of 3 column panels
    (96 columns on 2 cores: a GPT-2 weight gradient's 768 in 8 chunks) is enough: each packed row tile is used by all
    three. The column chunks are as few as fit L2, the big operand being streamed once per chunk."""
    import fusegrad.codegen.opt.heuristic as heuristic
    monkeypatch.setattr(heuristic.os, "cpu_count", lambda: 2)
    asts = captured_asts(monkeypatch)
    a = RS.standard_normal((512, 1039)).astype(np.float32)
    b = RS.standard_normal((512, 320)).astype(np.float32)
    small = a[:128]
    np.testing.assert_allclose((Tensor(a).T @ Tensor(b[:, :96])).numpy(), a.T.astype(np.float64) @ b[:, :96],
                               rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose((Tensor(a).T @ Tensor(b)).numpy(), a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose((Tensor(a.T.copy()) @ Tensor(b)).numpy(), a.T.astype(np.float64) @ b, rtol=1e-4,
                               atol=1e-3)
    np.testing.assert_allclose((Tensor(small.T.copy()) @ Tensor(b[:128])).numpy(),
                               small.T.astype(np.float64) @ b[:128], rtol=1e-4, atol=1e-3)
    assert len(asts) == 4, asts
    narrow, asts = asts[0], asts[1:]
    k = Kernel(codegen.collapse_gathers(narrow), renderer_like(AVX2))
    hand_coded_optimizations(k)
    globs = {u.arg: u.dtype.size for u in narrow.toposort() if u.op is Ops.DEFINE_GLOBAL}
    assert [globs[o.arg] for o in k.applied_opts if o.op is OptOps.PACK] == [a.size, 512 * 96], k.applied_opts
    assert len([o for o in k.applied_opts if o.op is OptOps.SWAP]) == 2, k.applied_opts
    for ast, (transposed, big) in zip(asts, ((True, True), (False, True), (False, False))):
        k = Kernel(codegen.collapse_gathers(ast), renderer_like(AVX2))
        hand_coded_optimizations(k)
        globs = {u.arg: u.dtype.size for u in ast.toposort() if u.op is Ops.DEFINE_GLOBAL}
        packs = [o for o in k.applied_opts if o.op is OptOps.PACK]
        assert [globs[o.arg] for o in packs] == ([a.size] if transposed else []) + [b.size if big else 128 * 320], \
            k.applied_opts
        # (the first SWAP takes the columns outermost; a second puts the row tiles outside them)
        swaps = [o for o in k.applied_opts if o.op is OptOps.SWAP]
        assert len(swaps) == 1 + big, k.applied_opts
        if big: assert packs[-1].axis == swaps[-1].axis - 1, k.applied_opts  # the column block's copy: outside both
        # (the big operand is streamed once per chunk of columns: one chunk per core where the block fits L2, 20
        # panels of 16 columns on AVX2; otherwise CHUNKS_PER_THREAD chunks where they divide the panels, here 2)
        # read transposed, two row tiles (1039 rows padded to 174 tiles of 6) are copied at once, a cache line of
        # their rows per step of the reduction: the row loop split in 87 x 2, the copy in the outer one
        splits = [o for o in k.applied_opts if o.op is OptOps.SPLIT]
        assert [o.arg for o in splits] == [2 if big else 4] + ([87] if transposed else []), k.applied_opts
        if transposed: assert packs[0].axis == splits[-1].axis, k.applied_opts

def test_odd_count_of_row_tiles_is_padded_for_whole_line_copies(monkeypatch: pytest.MonkeyPatch):
    """A transposed operand of 1048 rows is 131 row tiles of 8 on AVX-512: padded to 132 so that each copy takes two
    tiles (a cache line of rows per step of K); the padded tile reads and stores nothing. Values against NumPy."""
    import fusegrad.codegen.opt.heuristic as heuristic
    monkeypatch.setattr(heuristic.os, "cpu_count", lambda: 2)
    asts = captured_asts(monkeypatch)
    a = RS.standard_normal((512, 1048)).astype(np.float32)
    b = RS.standard_normal((512, 320)).astype(np.float32)
    np.testing.assert_allclose((Tensor(a).T @ Tensor(b)).numpy(), a.T.astype(np.float64) @ b, rtol=1e-4, atol=1e-3)
    k = Kernel(codegen.collapse_gathers(asts[-1]), renderer_like(AVX512))
    hand_coded_optimizations(k)
    opts = list(k.applied_opts)
    pack = next(o for o in opts if o.op is OptOps.PACK)
    assert Opt(OptOps.PADTO, pack.axis, 2) in opts and Opt(OptOps.SPLIT, pack.axis, 66) in opts, opts

def test_linear_on_batched_rows_is_one_matmul(monkeypatch: pytest.MonkeyPatch):
    """x (batch, seq, in) @ w.T: the weight's gradient is one sum over batch x seq (no kernel stores a partial gradient
    per batch), and the output and both gradients match torch. Also once a tensor was sharded in the process, as
    here (that had turned the single matmul off, so this test failed after a sharding test in the same worker)."""
    Tensor.ones(4).shard(("CPU:0", "CPU:1"), axis=0).realize()
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((3, 5, 7)).astype(np.float32)
    w = RS.standard_normal((11, 7)).astype(np.float32)
    g = RS.standard_normal((3, 5, 11)).astype(np.float32)
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    out = xt @ wt.T
    (out * Tensor(g)).sum().backward()
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tout = tx @ tw.T
    (tout * torch.tensor(g)).sum().backward()
    assert xt.grad is not None and wt.grad is not None and tx.grad is not None and tw.grad is not None
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(wt.grad.numpy(), tw.grad.numpy(), rtol=1e-5, atol=1e-5)
    stored = [st.src[0].src[0].dtype.size for ast in asts for st in ast.src if st.op is Ops.STORE]
    assert 3 * w.size not in stored, stored

def test_logits_of_a_tied_embedding_store_along_the_vocabulary(monkeypatch: pytest.MonkeyPatch):
    """x @ w.T with w (vocabulary, features) 16 times bigger than x: the vector runs along the vocabulary (contiguous
    stores, padded to whole vectors), w's panel packed, not along x's rows with a store per lane; values against
    NumPy."""
    asts = captured_asts(monkeypatch)
    x = RS.standard_normal((64, 96)).astype(np.float32)
    w = RS.standard_normal((2053, 96)).astype(np.float32)
    np.testing.assert_allclose((Tensor(x) @ Tensor(w).T).numpy(), x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    assert len(asts) == 1, asts
    k = Kernel(codegen.collapse_gathers(asts[0]), renderer_like(AVX2))
    vocab = next(r for r in k.loops if r.src[0].arg == 2053)
    vocab_axis = k.loops.index(vocab)
    hand_coded_optimizations(k)
    globs = {u.arg: u.dtype.size for u in asts[0].toposort() if u.op is Ops.DEFINE_GLOBAL}
    pad, upcast = k.applied_opts[:2]
    assert (pad.op, pad.axis, upcast.op, upcast.axis) == (OptOps.PADTO, vocab_axis, OptOps.UPCAST, vocab_axis), \
        k.applied_opts
    assert [globs[o.arg] for o in k.applied_opts if o.op is OptOps.PACK] == [w.size], k.applied_opts

def test_padded_reduction_matmul_with_infinities(monkeypatch: pytest.MonkeyPatch):
    """A contraction of a length no block divides (8191, padded to blocks of 512: the padded steps add zero times
    zero) with infinities and a nan among its terms: the same infs and nans as NumPy, the other entries close."""
    asts = captured_asts(monkeypatch)
    a = RS.standard_normal((12, 8191)).astype(np.float32)
    b = RS.standard_normal((8191, 32)).astype(np.float32)
    a[2, 100], a[5, 8190], b[7, 3] = np.inf, -np.inf, np.nan
    ours = (Tensor(a) @ Tensor(b)).numpy()
    ref = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-3)
    k = Kernel(codegen.collapse_gathers(asts[0]), renderer_like(AVX2))
    hand_coded_optimizations(k)
    assert [(o.op, o.arg) for o in k.applied_opts if o.axis is not None and o.arg == 512] == \
        [(OptOps.PADTO, 512), (OptOps.KBLOCK, 512)], k.applied_opts
