"""A PACK copy that transposes (`x @ W.T`: W's panel copied contiguous along the output's vector) reads W row by row
where the rows its vector lanes gather from would evict one another from one L1 set (rows a multiple of 4 KB apart),
and a vector of lanes at a time otherwise: the copy's loops, and the kernel's values against NumPy either way."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen.opt import Kernel, Opt, OptOps
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import UOp
from test.codegen.helpers import RENDERER, glob, reduce, rng, run

RS = np.random.default_rng(0)

def x_at_w_t(M: int, N: int, K: int) -> UOp:
    """out[m, n] = sum over k of x[m, k] * w[n, k] (w stored (N, K): read transposed along the output's columns)."""
    out, x, w = glob(0, dtypes.float32, M * N), glob(1, dtypes.float32, M * K), glob(2, dtypes.float32, N * K)
    m, n, k = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    return UOp.sink_of(out.index(m * N + n).store(reduce(x.index(m * K + k).load() * w.index(n * K + k).load(), k)))

# the columns in vectors of 16 lanes and outermost, W's panel (16 of its rows by all of K) packed once per 16 columns
OPTS = [Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.PACK, 0, 2)]

@pytest.mark.parametrize("K, by_rows", [(1024, True), (3072, True), (2048 + 16, False), (1000, False), (768, False),
                                        (8, False)])
def test_transposing_copy_reads_rows_where_they_alias(K: int, by_rows: bool):
    """Rows of 1024 or 3072 floats (4 KB and 12 KB apart) put the 16 lanes' lines on one L1 set: the lanes become
    loops of the copy, which walks each row contiguously. Rows of 2064 floats or 1000 (a line per set) or 768 (4 per
    set) keep the gathering copy, one vector of lanes per element of K; so do rows of 8 floats, too short to walk.
    The product is right either way."""
    M, N = 24, 32
    ast = x_at_w_t(M, N, K)
    k = Kernel(ast, RENDERER)
    for o in OPTS: k.apply_opt(o)
    # (the copy's loops: K alone where it gathers; the lanes' 16 too where it reads by rows)
    assert sorted(r.src[0].arg for r in k.copies) == (sorted([16, K]) if by_rows else [K]), k.copies
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    run(ast, [out, x, w], opts=OPTS)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))

@pytest.mark.parametrize("M, K, N", [(512, 3072, 768), (37, 1024, 80), (1, 4096, 33)])
def test_x_at_w_t_values(M: int, K: int, N: int):
    """`x @ W.T` as a Linear layer computes it, through the heuristic's own opts, at sizes whose rows alias in L1
    (GPT-2's 3072-wide projection, odd row and column counts, a single row), against NumPy in float64."""
    x = RS.standard_normal((M, K)).astype(np.float32)
    w = RS.standard_normal((N, K)).astype(np.float32)
    ours = (Tensor(x) @ Tensor(w).T).numpy()
    np.testing.assert_allclose(ours, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4 * np.sqrt(K))
