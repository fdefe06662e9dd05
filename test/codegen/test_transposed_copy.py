"""A PACK copy that transposes (`x @ W.T`: W's panel copied contiguous along the output's vector) copies a block of a
vector's count of W's elements at a time, which lowering makes contiguous loads of W's rows and a transpose in
registers (codegen/transpose.py), the elements past the last whole block gathered: the network's lanes, the loads the
kernel makes, the C it renders and the values against NumPy."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import full_rewrite, get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.codegen.transpose import transposed
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import RENDERER, glob, reduce, rng, run

RS = np.random.default_rng(0)

@pytest.mark.parametrize("w", [2, 4, 8, 16])
def test_transposed_network_lanes(w: int):
    """Lane i of output j of the shuffle network is lane j of row i, followed back through every shuffle."""
    rows = [UOp(Ops.DEFINE_VAR, dtypes.float32.vec(w), arg=(f"row{i}",)) for i in range(w)]
    def source(u: UOp, lane: int) -> tuple[int, int]:
        while u.op is Ops.VECTORIZE:
            g = u.src[lane]
            assert g.op is Ops.GEP and g.src[0].dtype == u.dtype
            u, lane = g.src[0], g.arg
        return rows.index(u), lane
    out = transposed(rows)
    assert len(out) == w
    for j, col in enumerate(out):
        # (each step's vector takes its lanes from two vectors at most: one shuffle)
        assert [source(col, i) for i in range(w)] == [(i, j) for i in range(w)]
    steps = [u for u in UOp.sink_of(*out).toposort() if u.op is Ops.VECTORIZE]
    assert len(steps) == w * (w.bit_length() - 1)
    assert all(len({g.src[0] for g in u.src}) <= 2 for u in steps)

def x_at_w_t(M: int, N: int, K: int) -> UOp:
    """out[m, n] = sum over k of x[m, k] * w[n, k] (w stored (N, K): read transposed along the output's columns)."""
    out, x, w = glob(0, dtypes.float32, M * N), glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, N * K)
    m, n, k = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    return UOp.sink_of(out.index(m * N + n).store(reduce(x.index(m * K + k).load() * w.index(n * K + k).load(), k)))

# the columns in vectors of 16 lanes and outermost, W's panel (16 of its rows by all of K) packed once per 16 columns
OPTS = [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.PACK, 0, 2)]

def w_loads(ast: UOp) -> tuple[list[UOp], list[UOp]]:
    """The kernel's vector loads and scalar loads of W (buffer 2) with OPTS."""
    loads = [u for u in full_rewrite(ast, RENDERER, OPTS) if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and
             u.src[0].src[0].op is Ops.DEFINE_GLOBAL and u.src[0].src[0].arg == 2]
    return [u for u in loads if u.dtype.count > 1], [u for u in loads if u.dtype.count == 1]

@pytest.mark.parametrize("K", [1024, 3072, 784, 1000, 24, 8])
def test_transposing_copy_loads_rows(K: int, monkeypatch: pytest.MonkeyPatch):
    """The copy of W's 16 rows loads each block of 16 elements of them as 16 vectors (one per row, contiguous) and
    stores the block's 16 columns; the K % 16 elements past the last block (1000 = 62 x 16 + 8, 24 = 16 + 8) are
    gathered one vector of lanes each, as is a K under 16. The product is right either way. (Any kernel size here:
    the rule's least work lowered to 0.)"""
    import fusegrad.codegen.opt as opt
    monkeypatch.setattr(opt, "TRANSPOSED_COPY_MIN_WORK", 0)
    M, N = 24, 32
    ast = x_at_w_t(M, N, K)
    rows, lanes = w_loads(ast)
    assert [u.dtype.count for u in rows] == ([16] * 16 if K >= 16 else []), [u.dtype for u in rows]
    assert len(lanes) == (16 if K % 16 else 0), [u.dtype for u in lanes]
    p = get_program(ast, RENDERER, opts=OPTS)
    # (the C of the rows' transpose: one shuffle helper per step's pattern, 64 calls for 16 rows)
    assert (p.src.count("fg_shuffle_f32x16_") > 64) == (K >= 16)
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    run(ast, [out, x, w], opts=OPTS)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

def test_small_transposing_copy_gathers():
    """A kernel under TRANSPOSED_COPY_MIN_WORK multiply-adds (its code would take longer to generate than the copy
    saves in a first call) keeps the copy that gathers a vector of lanes per element of K."""
    import fusegrad.codegen.opt as opt
    M, N, K = 24, 32, 1024
    assert M * N * K < opt.TRANSPOSED_COPY_MIN_WORK
    rows, lanes = w_loads(x_at_w_t(M, N, K))
    assert rows == [] and len(lanes) == 16, (rows, lanes)

@pytest.mark.parametrize("M, K, N", [(512, 3072, 768), (128, 784, 512), (37, 1000, 80), (1, 4096, 33), (5, 17, 3)])
def test_x_at_w_t_values(M: int, K: int, N: int):
    """`x @ W.T` as a Linear layer computes it, through the heuristic's own opts (GPT-2's 3072-wide projection, the
    MLP's first layer, odd counts, a single row, a K just over a vector), against NumPy in float64."""
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    ours = (Tensor(x) @ Tensor(w).T).numpy()
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_x_at_w_t_other_dtypes(dtype):
    """The same for float64 (8 lanes to a register on AVX-512) and float16 (its copy converts to float32), against
    NumPy in float64."""
    x = RS.standard_normal((64, 528)).astype(dtype)
    w = RS.standard_normal((96, 528)).astype(dtype)
    ours = (Tensor(x) @ Tensor(w).T).numpy().astype(np.float64)
    tol = 1e-9 if dtype == np.float64 else 2e-2
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T.astype(np.float64), rtol=tol, atol=tol * 30)
