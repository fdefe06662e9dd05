"""A PACK copy that transposes (`x @ W.T`: W's panel copied contiguous along the output's vector) copies whole blocks
of a vector's count of W's rows by as many of its elements as one TRANSPOSED_COPY each (the C renderer: the rows loaded
as vectors and transposed in registers), the elements past the last whole block gathered: the shuffle network's lanes,
the C helper in both of its forms, the kernels' nodes and C, and the values against NumPy."""
from __future__ import annotations
import copy
import ctypes
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import full_rewrite, get_program
from fusegrad.codegen.opt import KernelOptError, Opt, OptOps
from fusegrad.dtype import dtypes
from fusegrad.renderer import transpose_network
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX2, RENDERER, call, compile_src, glob, reduce, renderer_like, rng, run

RS = np.random.default_rng(0)

@pytest.mark.parametrize("w", [2, 4, 8, 16, 32])
def test_transpose_network_lanes(w: int):
    """The network applied to rows of (row, column) labels ends with the columns: each step makes every row once from
    two of the rows before it, log2(w) steps."""
    rows = [[(i, j) for j in range(w)] for i in range(w)]
    steps = transpose_network(w)
    assert len(steps) == w.bit_length() - 1
    for step in steps:
        assert sorted(r for r, *_ in step) == list(range(w))
        rows = [[(rows[x] + rows[y])[k] for k in lanes] for _, x, y, lanes in sorted(step)]
    assert rows == [[(i, j) for i in range(w)] for j in range(w)]

def _transposer(dt, w: int, shuffles: bool):
    """The renderer's transpose helper for w x w blocks of `dt`, compiled (with __builtin_shufflevector, or as the
    compiler without it compiles it) behind an extern function."""
    ren = copy.copy(RENDERER)
    ren._helpers = {}   # (what render() starts from: the helpers it needs, in the order needed)
    name = ren._transpose_helper(dt, w)
    st = ren.dtype_name(dt)
    prelude = "" if shuffles else "#define __has_builtin(x) 0\n"
    src = prelude + "\n".join(ren._helpers.values()) + \
        f"\nvoid call_{name}({st}* d, long ds, const {st}* s, long ss) {{ {name}(d, ds, s, ss); }}\n"
    return getattr(compile_src(src, name), f"call_{name}")

@pytest.mark.parametrize("shuffles", [True, False])
@pytest.mark.parametrize("dt, npdt", [(dtypes.float32, np.float32), (dtypes.float64, np.float64),
                                      (dtypes.int32, np.int32)])
def test_transpose_helper(dt, npdt, shuffles: bool):
    """The C helper copies a block at any element of rows of any length (here 37, so no row is aligned) into rows of
    another length, transposed, and writes nothing else: in registers and in its element-by-element form."""
    w = RENDERER.simd_bytes // dt.itemsize if RENDERER.simd_bytes else 4
    fn = _transposer(dt, w, shuffles)
    src = (np.arange(w * 37 + 3) * 7 % 101).astype(npdt)
    dst = np.full(w * 40 + 5, -1, npdt)
    fn(ctypes.c_void_p(dst.ctypes.data + 2 * dst.itemsize), ctypes.c_long(40),
       ctypes.c_void_p(src.ctypes.data + 3 * src.itemsize), ctypes.c_long(37))
    want = np.full_like(dst, -1)
    for i in range(w):
        for j in range(w): want[2 + j * 40 + i] = src[3 + i * 37 + j]
    np.testing.assert_array_equal(dst, want)

def x_at_w_t(M: int, N: int, K: int) -> UOp:
    """out[m, n] = sum over k of x[m, k] * w[n, k] (w stored (N, K): read transposed along the output's columns)."""
    out, x, w = glob(0, dtypes.float32, M * N), glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, N * K)
    m, n, k = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    return UOp.sink_of(out.index(m * N + n).store(reduce(x.index(m * K + k).load() * w.index(n * K + k).load(), k)))

# the columns in vectors of 16 lanes and outermost, W's panel (16 of its rows by all of K) packed once per 16 columns
OPTS = [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.PACK, 0, 2)]

def w_reads(ast: UOp, renderer=RENDERER) -> tuple[list[UOp], list[UOp]]:
    """The kernel's TRANSPOSED_COPY nodes and its scalar loads of W (buffer 2) with OPTS."""
    uops = full_rewrite(ast, renderer, OPTS)
    loads = [u for u in uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and
             u.src[0].src[0].op is Ops.DEFINE_GLOBAL and u.src[0].src[0].arg == 2]
    assert all(u.dtype.count == 1 for u in loads), [u.dtype for u in loads]
    return [u for u in uops if u.op is Ops.TRANSPOSED_COPY], loads

needs_avx512 = pytest.mark.skipif(RENDERER.simd_bytes < 64, reason="the opts here make 16-lane float vectors")

@needs_avx512
@pytest.mark.parametrize("K", [1024, 3072, 784, 1000, 24, 8])
def test_transposing_copy_copies_blocks(K: int):
    """The copy of W's 16 rows is one TRANSPOSED_COPY per block of 16 elements of them (in a loop over the blocks),
    from W's rows K apart into the panel's rows 16 apart; the K % 16 elements past the last block (1000 = 62 x 16 + 8,
    24 = 16 + 8) are gathered one element of each row at a time, as is a K under 16. The product is right either way."""
    M, N = 24, 32
    ast = x_at_w_t(M, N, K)
    blocks, lanes = w_reads(ast)
    assert [u.arg for u in blocks] == ([(16, 16, K)] if K >= 16 else [])
    assert len(lanes) == (16 if K % 16 else 0)
    p = get_program(ast, RENDERER, opts=OPTS)
    assert ("fg_transpose_f32x16(" in p.src) == (K >= 16)
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    run(ast, [out, x, w], opts=OPTS)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

def test_transposing_copy_on_avx2():
    """With the vector facts of an AVX2 machine (8 float lanes) the heuristic's copy is blocks of 8 x 8 (the helper's
    three steps), compiled and run here, against NumPy in float64."""
    M, N, K = 37, 80, 1000
    ast = x_at_w_t(M, N, K)
    p = get_program(ast, renderer_like(AVX2))
    assert {u.arg[0] for u in p.uops if u.op is Ops.TRANSPOSED_COPY} == {8} and "fg_transpose_f32x8(" in p.src
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    call(p, [out, x, w])
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

@needs_avx512
def test_renderer_without_transposed_copy_gathers():
    """A renderer that doesn't render TRANSPOSED_COPY (a GPU's, the PYTHON device's) gets the copy that gathers one
    element of each of the 16 rows at a time, with the same opts."""
    plain = copy.copy(RENDERER)
    plain.transposed_copy = False
    blocks, lanes = w_reads(x_at_w_t(24, 32, 1024), plain)
    assert blocks == [] and len(lanes) == 16

@pytest.mark.parametrize("lanes", [4, 8, 16])
@pytest.mark.parametrize("split, rows, swap", [(None, None, False), (2, None, True), (None, 4, True), (2, 2, False)])
def test_transposing_copy_under_other_opts(lanes: int, split, rows, swap: bool):
    """The copy under other tiles than the heuristic's (vectors of 4, 8 or 16 lanes, two of them per row, rows of
    the tile, either loop outermost), W packed or x: every kernel the opts make is right against NumPy."""
    M, N, K = 16, 64, 100
    ast = x_at_w_t(M, N, K)
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    made = 0
    for pack in ((0, 2), (1, 2), (0, 1)):
        opts = [Opt(OptOps.UPCAST, 1, lanes)] + ([Opt(OptOps.UPCAST, 1, split)] if split else []) + \
            ([Opt(OptOps.UPCAST, 0, rows)] if rows else []) + ([Opt(OptOps.SWAP, 0, 1)] if swap else []) + \
            [Opt(OptOps.PACK, *pack)]
        try: p = get_program(ast, RENDERER, opts=opts)
        except KernelOptError: continue
        out = np.zeros((M, N), np.float32)
        call(p, [out, x, w])
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3, err_msg=str(opts))
        made += 1
    assert made

@pytest.mark.parametrize("M, K, N", [(512, 3072, 768), (128, 784, 512), (37, 1000, 80), (1, 4096, 33), (5, 17, 3),
                                     (24, 32, 1024)])
def test_x_at_w_t_values(M: int, K: int, N: int):
    """`x @ W.T` as a Linear layer computes it, through the heuristic's own opts (GPT-2's 3072-wide projection, the
    MLP's first layer, odd counts, a single row, a K just over a vector, a short K), against NumPy in float64."""
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    ours = (Tensor(x) @ Tensor(w).T).numpy()
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

@pytest.mark.parametrize("view", ["rows_flipped", "k_flipped", "sliced"])
def test_x_at_w_t_of_views(view: str):
    """W read through a view: its rows in reverse order (the blocks' rows a negative step apart), K reversed (no
    block: its elements run backwards), a slice of rows and of K (rows at an offset); against NumPy in float64."""
    x = RS.standard_normal((64, 300)).astype(np.float32)
    w = RS.standard_normal((128, 300)).astype(np.float32)
    fx, fw = {"rows_flipped": (lambda t: t, lambda t: t.flip(0)),
              "k_flipped": (lambda t: t.flip(1), lambda t: t.flip(1)),
              "sliced": (lambda t: t[:, 10:290], lambda t: t[3:120, 10:290])}[view]
    nx, nw = {"rows_flipped": (x, w[::-1]), "k_flipped": (x[:, ::-1], w[:, ::-1]),
              "sliced": (x[:, 10:290], w[3:120, 10:290])}[view]
    ours = (fx(Tensor(x)) @ fw(Tensor(w)).T).numpy()
    np.testing.assert_allclose(ours, nx.astype(np.float64) @ nw.T.astype(np.float64), rtol=1e-4, atol=1e-3)

@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_x_at_w_t_other_dtypes(dtype):
    """The same for float64 (8 lanes to a register on AVX-512), float16 (its copy converts to float32: gathered) and
    int32 (exact), against NumPy in float64."""
    x = (RS.standard_normal((64, 528)) * (10 if dtype == np.int32 else 1)).astype(dtype)
    w = (RS.standard_normal((96, 528)) * (10 if dtype == np.int32 else 1)).astype(dtype)
    ours = (Tensor(x) @ Tensor(w).T).numpy().astype(np.float64)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    if dtype == np.int32: np.testing.assert_array_equal(ours, want)
    else:
        tol = 1e-9 if dtype == np.float64 else 2e-2
        np.testing.assert_allclose(ours, want, rtol=tol, atol=tol * 30)

def x_at_w_t_windows(M: int, N: int, C: int, KH: int, KW: int) -> UOp:
    """out[m, n] = sum over c, kh, kw of x[m, c, kh, kw] * w[n, c, kh, kw]: a convolution's product, each of W's rows
    walked by three loops (input channels, window rows, window columns) that together run over it contiguously."""
    K = C * KH * KW
    out, x, w = glob(0, dtypes.float32, M * N), glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, N * K)
    m, n = rng(M, 0), rng(N, 1)
    c, kh, kw = rng(C, 2, "reduce"), rng(KH, 3, "reduce"), rng(KW, 4, "reduce")
    k = c * (KH * KW) + kh * KW + kw
    return UOp.sink_of(out.index(m * N + n).store(reduce(x.index(m * K + k).load() * w.index(n * K + k).load(),
                                                         c, kh, kw)))

@needs_avx512
@pytest.mark.parametrize("C, KH, KW", [(32, 3, 3), (5, 3, 3), (3, 7, 7), (64, 2, 2), (1, 3, 3), (4, 1, 5)])
def test_transposing_copy_of_several_loops(C: int, KH: int, KW: int):
    """The loops that walk W's rows contiguously (a 3x3 window and its input channels: 9 x C elements a row) are
    copied as one run of blocks of 16 (C = 32: 18 blocks), the run's elements past the last whole block gathered
    (5 x 9 = 45: 2 blocks and 13; a 7x7 window over RGB 147: 9 and 3), none under 16 elements (1 x 3 x 3); the
    product is right either way, against NumPy in float64."""
    M, N, K = 24, 32, C * KH * KW
    ast = x_at_w_t_windows(M, N, C, KH, KW)
    blocks, lanes = w_reads(ast)
    assert [u.arg for u in blocks] == ([(16, 16, K)] if K >= 16 else [])
    assert len(lanes) == (16 if K % 16 else 0)
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    run(ast, [out, x, w], opts=OPTS)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

@pytest.mark.parametrize("n, cin, cout, size, k", [(8, 512, 512, 2, 3), (8, 64, 64, 8, 3), (2, 5, 48, 6, 3),
                                                   (4, 3, 32, 16, 7), (2, 16, 20, 5, 1)])
def test_convolution_values(n: int, cin: int, cout: int, size: int, k: int):
    """Convolutions whose weights the heuristic packs along the output channels, their window and input channels
    walked as one run (ResNet-18's last 3x3 over 2x2 images, a 3x3 over 8x8, odd channel counts, its 7x7 stem, a 1x1),
    against torch."""
    import torch
    x = RS.standard_normal((n, cin, size, size)).astype(np.float32)
    w = (RS.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    ours = Tensor(x).conv2d(Tensor(w), padding=k // 2).numpy()
    want = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64),
                                      padding=k // 2).numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)
