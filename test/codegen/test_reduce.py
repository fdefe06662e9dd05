"""Kernels with reductions (sums, max, products, matmul, nested and multiple reduces), optimized and not, checked
against numpy."""
import sys
import numpy as np
import pytest
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.dtype import DType, dtypes, to_np_dtype
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import RENDERER, call, glob, matmul_ast, reduce, rng, run

RS = np.random.RandomState(0)

def reduce_2d_ast(M: int, N: int, axis: int | None, op: Ops, dt: DType) -> UOp:
    """out = reduce(op) of an (M, N) array over `axis` (None: everything)."""
    if axis is None:
        r0, r1 = rng(M, 0, "reduce"), rng(N, 1, "reduce")
        val = reduce(glob(1, dt, M * N).index(r0 * N + r1).load(), r0, r1, op=op)
        return UOp.sink_of(glob(0, dt, 1).index(UOp.const(dtypes.index, 0)).store(val))
    out_n = N if axis == 0 else M
    ro, rr = rng(out_n, 0), rng(M if axis == 0 else N, 1, "reduce")
    idx = rr * N + ro if axis == 0 else ro * N + rr
    return UOp.sink_of(glob(0, dt, out_n).index(ro).store(reduce(glob(1, dt, M * N).index(idx).load(), rr, op=op)))

NP_REDUCE = {Ops.ADD: np.sum, Ops.MAX: np.max, Ops.MUL: np.prod}

@pytest.mark.parametrize("op", [Ops.ADD, Ops.MAX, Ops.MUL], ids=lambda o: o.name)
@pytest.mark.parametrize("axis", [0, 1, None])
@pytest.mark.parametrize("shape", [(32, 64), (7, 45)])
def test_reduce_float32(op: Ops, axis, shape):
    M, N = shape
    a = RS.uniform(0.95, 1.05, (M, N)).astype(np.float32)   # products stay normal floats
    for noopt in (False, True):
        out = np.zeros(1 if axis is None else (N if axis == 0 else M), np.float32)
        run(reduce_2d_ast(M, N, axis, op, dtypes.float32), [out, a], noopt=noopt)
        np.testing.assert_allclose(out.reshape(()) if axis is None else out, NP_REDUCE[op](a, axis=axis), rtol=2e-5)

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.uint8, dtypes.int64, dtypes.float64, dtypes.float16])
@pytest.mark.parametrize("op", [Ops.ADD, Ops.MAX], ids=lambda o: o.name)
def test_reduce_dtypes(dt: DType, op: Ops):
    M, N = 24, 48
    # small integers: every sum is exact in every dtype (uint8 wraps the same way in C and numpy)
    a = RS.randint(0, 5 if dt == dtypes.float16 else 100, (M, N)).astype(to_np_dtype(dt))
    out = np.zeros(M, to_np_dtype(dt))
    run(reduce_2d_ast(M, N, 1, op, dt), [out, a])
    want = NP_REDUCE[op](a, axis=1).astype(to_np_dtype(dt)) if dt != dtypes.uint8 else \
        NP_REDUCE[op](a.astype(np.int64), axis=1).astype(np.uint8)
    np.testing.assert_array_equal(out, want)

def test_max_reduce_nan_and_inf():
    M, N = 4, 64
    a = RS.randn(M, N).astype(np.float32)
    a[0, 17] = np.nan                # nan anywhere wins, as in torch.max
    a[1, :] = -np.inf                # all -inf stays -inf
    a[2, 63] = np.nan
    a[3, 5] = np.inf
    for axis in (1, 0):
        out = np.zeros(M if axis == 1 else N, np.float32)
        run(reduce_2d_ast(M, N, axis, Ops.MAX, dtypes.float32), [out, a])
        np.testing.assert_array_equal(out, np.max(a, axis=axis))
    out = np.zeros(1, np.float32)
    run(reduce_2d_ast(M, N, None, Ops.MAX, dtypes.float32), [out, a])
    assert np.isnan(out[0])

def test_sum_propagates_nan_and_inf():
    a = np.ones((2, 64), np.float32)
    a[0, 3], a[1, 9] = np.nan, np.inf
    out = np.zeros(2, np.float32)
    run(reduce_2d_ast(2, 64, 1, Ops.ADD, dtypes.float32), [out, a])
    assert np.isnan(out[0]) and out[1] == np.inf

def test_reduce_inside_elementwise():
    # out[i, j] = relu(sum_k a[i, k]) + b[i, j]
    M, N, K = 6, 32, 20
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(M, N).astype(np.float32)
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    s = reduce(glob(1, dtypes.float32, M * K).index(r0 * K + r2).load(), r2)
    val = s.maximum(0.0) + glob(2, dtypes.float32, M * N).index(r0 * N + r1).load()
    ast = UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(val))
    for noopt in (False, True):
        out = np.zeros((M, N), np.float32)
        run(ast, [out, a, b], noopt=noopt)
        np.testing.assert_allclose(out, np.maximum(a.sum(1, keepdims=True), 0) + b, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("shared_range", [False, True])
def test_two_reduces(shared_range: bool):
    # out[i] = sum_k a[i, k] * max_k a[i, k]; with shared_range both REDUCEs use the very same RANGE
    M, K = 9, 48
    a = RS.randn(M, K).astype(np.float32)
    r0, rs, rm = rng(M, 0), rng(K, 1, "reduce"), rng(K, 2, "reduce")
    if shared_range: rm = rs
    g1 = glob(1, dtypes.float32, M * K)
    val = reduce(g1.index(r0 * K + rs).load(), rs) * reduce(g1.index(r0 * K + rm).load(), rm, op=Ops.MAX)
    ast = UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(val))
    for noopt in (False, True):
        out = np.zeros(M, np.float32)
        run(ast, [out, a], noopt=noopt)
        # (a row sum can cancel to near 0, where float32 rounding of its 48 terms is all that's left: the bound is
        # a few ulps of the terms' magnitude times the max, not of the result)
        bound = 1e-6 * np.abs(a).sum(1) * np.abs(a.max(1))
        np.testing.assert_allclose(out, a.sum(1) * a.max(1), rtol=1e-5, atol=float(bound.max()))

@pytest.mark.parametrize("shared_range", [False, True])
def test_nested_reduce(shared_range: bool):
    # softmax denominator: out[i] = sum_j exp2(a[i, j] - max_k a[i, k]); the inner REDUCE sits inside the outer one
    M, K = 5, 40
    a = RS.randn(M, K).astype(np.float32)
    r0, rj, rk = rng(M, 0), rng(K, 1, "reduce"), rng(K, 2, "reduce")
    if shared_range: rk = rj
    g1 = glob(1, dtypes.float32, M * K)
    mx = reduce(g1.index(r0 * K + rk).load(), rk, op=Ops.MAX)
    val = reduce((g1.index(r0 * K + rj).load() - mx).alu(Ops.EXP2), rj)
    ast = UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(val))
    want = np.exp2(a - a.max(1, keepdims=True)).sum(1)
    for noopt in (False, True):
        out = np.zeros(M, np.float32)
        run(ast, [out, a], noopt=noopt)
        np.testing.assert_allclose(out, want, rtol=1e-5)

def test_nested_reduce_depending_on_outer_range():
    # out[i] = sum_j (sum_k a[i, k] * [k <= j]): the inner reduce varies with the outer reduce's range j
    M, K = 4, 12
    a = RS.randn(M, K).astype(np.float32)
    r0, rj, rk = rng(M, 0), rng(K, 1, "reduce"), rng(K, 2, "reduce")
    g1 = glob(1, dtypes.float32, M * K)
    inner = reduce((rj < rk).where(0.0, g1.index(r0 * K + rk).load()), rk)
    ast = UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(reduce(inner, rj)))
    want = np.cumsum(a, axis=1).sum(1)
    for noopt in (False, True):
        out = np.zeros(M, np.float32)
        run(ast, [out, a], noopt=noopt)
        np.testing.assert_allclose(out, want, rtol=1e-5)

@pytest.mark.parametrize("shape", [(64, 64, 64), (17, 33, 65), (1, 1, 1), (3, 48, 5), (32, 16, 128), (40, 96, 7)])
def test_matmul(shape):
    M, N, K = shape
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    for noopt in (False, True):
        out = np.zeros((M, N), np.float32)
        p = run(matmul_ast(M, N, K), [out, a, b], noopt=noopt)
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
        # (padded loops are counted for the fraction of their iterations that is real work)
        assert abs(p.estimates.ops - 2 * M * N * K) <= 0.001 * 2 * M * N * K

def test_matmul_long_reduce_blocked_through_output():
    M, N, K = 16, 64, 768
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    out = np.full((M, N), np.nan, np.float32)   # the first block must not read what was there before
    p = run(matmul_ast(M, N, K), [out, a, b], splits=[(0, 1), (1, 2)])
    assert OptOps.KBLOCK in {o.op for o in p.applied_opts} and p.global_size == 2
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)

def test_kblock_refuses_unsafe_kernels():
    from fusegrad.codegen.opt import Kernel, KernelOptError
    # out = out_old + sum(...): the output is also read, so it can't hold partial sums
    r0, r1 = rng(4, 0), rng(64, 1, "reduce")
    g0 = glob(0, dtypes.float32, 4)
    val = reduce(glob(1, dtypes.float32, 256).index(r0 * 64 + r1).load(), r1) + g0.index(r0).load()
    k = Kernel(UOp.sink_of(g0.index(r0).store(val)), RENDERER)
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.KBLOCK, 1, 16))
    k = Kernel(matmul_ast(4, 4, 64, dtypes.float32), RENDERER)
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.KBLOCK, 2, 48))   # doesn't divide
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.KBLOCK, 0, 2))    # not a reduce axis

def test_matmul_is_register_tiled():
    p = get_program(matmul_ast(64, 64, 64), RENDERER)
    assert OptOps.UPCAST in {o.op for o in p.applied_opts}
    assert sum(1 for u in p.uops if u.op is Ops.DEFINE_REG) >= 8   # several accumulators in registers
    assert any(u.dtype.count > 1 for u in p.uops if u.op is Ops.DEFINE_REG)   # ... that are vectors

@pytest.mark.parametrize("N", [48 * 3, 16 * 49])
def test_matmul_odd_vector_count_pads_to_pairs(N):
    # a row of an odd number of vectors (784 = 49 x 16) is padded to pairs of vectors (the register tile's two
    # columns), the padded columns never stored; a column sum (no operand broadcast over the columns) is left alone
    M, K = 24, 64
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    out = np.full((M, N + 32), np.nan, np.float32)   # columns past N in a wider buffer: must stay untouched
    flat = out.reshape(-1)[:M * N].reshape(M, N)
    p = run(matmul_ast(M, N, K), [flat, a, b])
    if RENDERER.simd_bytes >= 64:
        assert OptOps.PADTO in {o.op for o in p.applied_opts}
        assert [o.arg for o in p.applied_opts if o.op is OptOps.UPCAST][:2] == [16, 2]
    np.testing.assert_allclose(flat, a @ b, rtol=1e-4, atol=1e-4)
    assert np.isnan(out.reshape(-1)[M * N:]).all()
    r0, r1 = rng(N, 0), rng(M, 1, "reduce")
    col_sum = UOp.sink_of(glob(0, dtypes.float32, N).index(r0).store(reduce(glob(1, dtypes.float32, M * N).index(
        r1 * N + r0).load(), r1)))
    assert OptOps.PADTO not in {o.op for o in get_program(col_sum, RENDERER).applied_opts}

def matmul_bt_ast(M: int, N: int, K: int) -> UOp:
    """out = a @ b.T with b stored (N, K), as a linear layer's weight is."""
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    acc = reduce(glob(1, dtypes.float32, M * K).index(r0 * K + r2).load() *
                 glob(2, dtypes.float32, N * K).index(r1 * K + r2).load(), r2)
    return UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(acc))

@pytest.mark.parametrize("shape", [(32, 64, 768), (24, 48, 40), (64, 32, 1024)])
def test_matmul_transposed_b(shape):
    M, N, K = shape
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(N, K).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    p = run(matmul_bt_ast(M, N, K), [out, a, b])
    if M >= 32:   # enough row tiles to reuse a copy: b's block is transposed into a contiguous local buffer
        assert OptOps.PACK in {o.op for o in p.applied_opts}
        assert any(u.op is Ops.DEFINE_LOCAL for u in p.uops)
    np.testing.assert_allclose(out, a @ b.T, rtol=1e-4, atol=1e-4)

def test_pack_explicit():
    M, N, K = 16, 64, 96
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    U, PK = (lambda ax, n: Opt(OptOps.UPCAST, ax, n)), (lambda ax, buf: Opt(OptOps.PACK, ax, buf))
    tiled = [U(1, 16), U(1, 2), U(0, 4), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.KBLOCK, 2, 32), PK(1, 2),
             Opt(OptOps.UNROLL, 3, 4)]
    # (PK(0, 2): b varies with the column loop inside the row loop, so the copy is a tile of all its columns)
    for opts in ([PK(1, 2)], [PK(0, 1)], [U(1, 4), PK(0, 1)], tiled, [PK(0, 2)], [U(1, 4), PK(0, 2)]):
        out = np.zeros((M, N), np.float32)
        p = run(matmul_ast(M, N, K), [out, a, b], opts=opts)
        assert list(p.applied_opts) == opts
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
    from fusegrad.codegen.opt import Kernel, KernelOptError
    # (a copy over Kernel.MAX_LOCAL_BYTES, 512 KB: 96 x 2048 floats)
    with pytest.raises(KernelOptError): Kernel(matmul_ast(M, 2048, K), RENDERER).apply_opt(PK(0, 2))
    with pytest.raises(KernelOptError): Kernel(matmul_ast(M, N, K), RENDERER).apply_opt(PK(0, 0))  # the output

@pytest.mark.parametrize("dt", [dtypes.int32, dtypes.float64])
def test_matmul_dtypes(dt: DType):
    M, N, K = 12, 32, 24
    a, b = RS.randint(-9, 9, (M, K)).astype(to_np_dtype(dt)), RS.randint(-9, 9, (K, N)).astype(to_np_dtype(dt))
    out = np.zeros((M, N), to_np_dtype(dt))
    run(matmul_ast(M, N, K, dt), [out, a, b])
    np.testing.assert_array_equal(out, a @ b)

def test_matvec():
    M, K = 24, 256
    a, x = RS.randn(M, K).astype(np.float32), RS.randn(K).astype(np.float32)
    r0, r1 = rng(M, 0), rng(K, 1, "reduce")
    prod = glob(1, dtypes.float32, M * K).index(r0 * K + r1).load() * glob(2, dtypes.float32, K).index(r1).load()
    val = reduce(prod, r1)
    out = np.zeros(M, np.float32)
    run(UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(val)), [out, a, x])
    np.testing.assert_allclose(out, a @ x, rtol=1e-4, atol=1e-4)

def test_small_batch_linear_is_a_dot_product():
    # a classifier at batch 8 (x @ W.T + b, W's rows contiguous along the reduction): copying W to read it once
    # doesn't pay, and without the copy a vector along the outputs would load W lane by lane; the reduction is the
    # vector instead (dot products, 4x4 at a time), with no copy
    from fusegrad import Tensor
    x, w = RS.randn(8, 512).astype(np.float32), RS.randn(1000, 512).astype(np.float32)
    b = RS.randn(1000).astype(np.float32)
    t = Tensor(x).linear(Tensor(w).T, Tensor(b))
    (si,) = [si for si in t.schedule() if si.ast.op is Ops.SINK]
    opts = get_program(si.ast, RENDERER).applied_opts
    lanes = getattr(RENDERER, "simd_bytes", 0) // 4
    if lanes >= 8: assert opts[0] == Opt(OptOps.UPCAST, 2, lanes) and all(o.op is not OptOps.PACK for o in opts), opts
    np.testing.assert_allclose(Tensor(x).linear(Tensor(w).T, Tensor(b)).numpy(), x @ w.T + b, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("noopt", [False, True])
def test_conv1d_with_padding_in_reduce(noopt: bool):
    # out[i] = sum_k w[k] * xpad[i + k], x padded by 1 on both sides: the valid mask depends on a reduce range
    N, KW = 64, 3
    x, w = RS.randn(N).astype(np.float32), RS.randn(KW).astype(np.float32)
    r0, rk = rng(N, 0), rng(KW, 1, "reduce")
    pos = r0 + rk - 1
    xv = glob(1, dtypes.float32, N).index(pos, valid=(pos < 0).logical_not() & (pos < N)).load()
    val = reduce(xv * glob(2, dtypes.float32, KW).index(rk).load(), rk)
    ast = UOp.sink_of(glob(0, dtypes.float32, N).index(r0).store(val))
    out = np.zeros(N, np.float32)
    run(ast, [out, x, w], noopt=noopt)
    xp = np.pad(x, 1)
    np.testing.assert_allclose(out, [sum(w[k] * xp[i + k] for k in range(KW)) for i in range(N)], rtol=1e-5, atol=1e-6)

def test_parallel_split_halves():
    M, N, K = 48, 32, 16
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    p = get_program(matmul_ast(M, N, K), RENDERER)
    assert p.global_size > 1
    h = p.global_size // 2
    out = np.zeros((M, N), np.float32)
    call(p, [out, a, b], splits=[(0, h)])
    # the first half of the parallel loop writes half of the outputs (which half depends on the loop order the
    # optimizer chose for this machine's vector width) and leaves the rest untouched
    written = out != 0
    assert written.sum() == M * N // 2
    np.testing.assert_allclose(out[written], (a @ b)[written], rtol=1e-4, atol=1e-4)
    call(p, [out, a, b], splits=[(h, p.global_size)])
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)

def test_column_sum_with_a_broadcast_splits_evenly_across_the_cores(monkeypatch: pytest.MonkeyPatch):
    """A layernorm weight's gradient, the sum over tokens of g * (x - mean) * rstd for 768 columns (each token's mean
    and rstd broadcast to the lanes): the lanes that share that broadcast stop short of leaving the cores' loop an
    uneven count (768 as 3 iterations of 256 kept one of two cores idle a third of the time). Values against NumPy."""
    import fusegrad.codegen.opt.heuristic as heuristic
    from fusegrad import Tensor
    from test.codegen.helpers import AVX512, captured_asts, renderer_like
    monkeypatch.setattr(heuristic.os, "cpu_count", lambda: 2)
    asts = captured_asts(monkeypatch)
    x, g = RS.randn(4, 128, 768).astype(np.float32), RS.randn(4, 128, 768).astype(np.float32)
    m, r = RS.randn(4, 128, 1).astype(np.float32), RS.rand(4, 128, 1).astype(np.float32)
    got = ((Tensor(x) - Tensor(m)) * Tensor(r) * Tensor(g)).sum((0, 1)).numpy()
    ref = ((x.astype(np.float64) - m) * r * g).sum((0, 1))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    p = get_program(asts[-1], renderer_like(AVX512))
    assert p.global_size % 2 == 0, p.applied_opts

def test_noopt_equals_opt():
    M, N, K = 32, 48, 64
    a, b = RS.randint(-3, 4, (M, K)).astype(np.float32), RS.randint(-3, 4, (K, N)).astype(np.float32)
    for ast, bufs in [(matmul_ast(M, N, K), [a, b]), (reduce_2d_ast(M, K, 1, Ops.ADD, dtypes.float32), [a]),
                      (reduce_2d_ast(M, K, 0, Ops.MAX, dtypes.float32), [a]),
                      (reduce_2d_ast(M, K, None, Ops.ADD, dtypes.float32), [a])]:
        outs = []
        for noopt in (False, True):
            n_out = ast.src[0].src[0].src[0].dtype.size
            outs.append(np.zeros(n_out, np.float32))
            p = run(ast, [outs[-1], *bufs], noopt=noopt)
            assert bool(p.applied_opts) != noopt
        # integer-valued data: every summation order gives exactly the same result
        np.testing.assert_array_equal(outs[0], outs[1])

def test_explicit_opts():
    M, N, K = 16, 32, 8
    a, b = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32)
    U = lambda axis, amt: Opt(OptOps.UPCAST, axis, amt)
    for opts in ([U(1, 8)], [Opt(OptOps.UNROLL, 2, 0)], [U(0, 4), Opt(OptOps.SWAP, 0, 1)],
                 [U(2, 4)], [U(2, 2), Opt(OptOps.UNROLL, 2, 2), U(1, 2)],
                 [Opt(OptOps.KBLOCK, 2, 2), Opt(OptOps.UPCAST, 2, 0)]):
        out = np.zeros((M, N), np.float32)
        p = run(matmul_ast(M, N, K), [out, a, b], opts=opts)
        assert list(p.applied_opts) == opts
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-5)

def test_softmax_one_kernel():
    # out[i, j] = exp2(x[i, j] - max_k x[i, k]) / sum_k exp2(x[i, k] - max_m x[i, m]): nested and multiple REDUCEs
    # next to a vectorizable output axis
    M, N = 6, 48
    x = RS.randn(M, N).astype(np.float32) * 3
    r0, r1, rk, rm, rn = rng(M, 0), rng(N, 1), rng(N, 2, "reduce"), rng(N, 3, "reduce"), rng(N, 4, "reduce")
    g1 = glob(1, dtypes.float32, M * N)
    ld = lambda r: g1.index(r0 * N + r).load()
    mx1, mx2 = reduce(ld(rk), rk, op=Ops.MAX), reduce(ld(rm), rm, op=Ops.MAX)
    den = reduce((ld(rn) - mx2).alu(Ops.EXP2), rn)
    val = (ld(r1) - mx1).alu(Ops.EXP2) * den.alu(Ops.RECIP)
    ast = UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(val))
    e = np.exp2(x - x.max(1, keepdims=True))
    for noopt in (False, True):
        out = np.zeros((M, N), np.float32)
        run(ast, [out, x], noopt=noopt)
        np.testing.assert_allclose(out, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)

def test_matmul_with_epilogue():
    # out = relu(a @ b) + bias[j]
    M, N, K = 16, 64, 512
    a, b, bias = RS.randn(M, K).astype(np.float32), RS.randn(K, N).astype(np.float32), RS.randn(N).astype(np.float32)
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    mm = reduce(glob(1, dtypes.float32, M * K).index(r0 * K + r2).load() * glob(2, dtypes.float32, K * N).index(
        r2 * N + r1).load(), r2)
    val = mm.maximum(0.0) + glob(3, dtypes.float32, N).index(r1).load()
    out = np.zeros((M, N), np.float32)
    run(UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(val)), [out, a, b, bias])
    np.testing.assert_allclose(out, np.maximum(a @ b, 0) + bias, rtol=1e-4, atol=1e-4)

def test_conv2d_padded():
    # out[co, y, x] = sum_{ci, ky, kx} w[co, ci, ky, kx] * in[ci, y + ky - 1, x + kx - 1] (zero padding 1)
    CO, CI, H, W = 4, 3, 9, 32
    inp, w = RS.randn(CI, H, W).astype(np.float32), RS.randn(CO, CI, 3, 3).astype(np.float32)
    co, y, x = rng(CO, 0), rng(H, 1), rng(W, 2)
    ci, ky, kx = rng(CI, 3, "reduce"), rng(3, 4, "reduce"), rng(3, 5, "reduce")
    iy, ix = y + ky - 1, x + kx - 1
    valid = (iy < 0).logical_not() & (iy < H) & (ix < 0).logical_not() & (ix < W)
    xv = glob(1, dtypes.float32, CI * H * W).index(ci * (H * W) + iy * W + ix, valid=valid).load()
    wv = glob(2, dtypes.float32, CO * CI * 9).index(co * (CI * 9) + ci * 9 + ky * 3 + kx).load()
    out_idx = glob(0, dtypes.float32, CO * H * W).index(co * (H * W) + y * W + x)
    ast = UOp.sink_of(out_idx.store(reduce(xv * wv, ci, ky, kx)))
    pad = np.pad(inp, ((0, 0), (1, 1), (1, 1)))
    want = np.zeros((CO, H, W), np.float32)
    for dy in range(3):
        for dx in range(3): want += np.einsum("oc,chw->ohw", w[:, :, dy, dx], pad[:, dy:dy + H, dx:dx + W])
    for noopt in (False, True):
        out = np.zeros((CO, H, W), np.float32)
        run(ast, [out, inp, w], noopt=noopt)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)

def test_row_reduce_narrow_vectors():
    # 100 isn't a multiple of the full vector width: narrower vectors of partial accumulators
    M, N = 6, 100
    a = RS.randn(M, N).astype(np.float32)
    a[2, 50] = np.nan
    for op, ref in ((Ops.ADD, np.sum), (Ops.MAX, np.max)):
        out = np.zeros(M, np.float32)
        p = run(reduce_2d_ast(M, N, 1, op, dtypes.float32), [out, a])
        assert p.applied_opts
        np.testing.assert_allclose(out, ref(a, axis=1), rtol=1e-5)

@pytest.mark.parametrize("n", [256, 200, 64])
def test_half_matmul_accumulates_exact_products(n):
    # half inputs: float32 products summed in float32 and rounded once, as BLAS does, so the result equals numpy's
    # float32 matmul of the same values rounded to half; the packed block of b is converted once (a float local)
    from fusegrad import Tensor
    from fusegrad.codegen import get_program
    a, b = RS.rand(n, n).astype(np.float16), RS.rand(n, n).astype(np.float16)
    out = Tensor(a) @ Tensor(b)
    items = out.schedule()
    si = next(si for si in items if any(u.op is Ops.REDUCE for u in si.ast.toposort()))
    p = get_program(si.ast, RENDERER)
    if OptOps.PACK in {o.op for o in p.applied_opts}:
        assert all(u.dtype.base == dtypes.float32 for u in p.uops if u.op is Ops.DEFINE_LOCAL)
    from fusegrad.engine.realize import run_schedule
    run_schedule(items)
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    # within one half ulp: the float32 sums may be ordered differently and land on the other side of a rounding tie
    np.testing.assert_allclose(out.numpy().astype(np.float32), want.astype(np.float32), rtol=2 ** -10, atol=0)

# *** long float sums: blocks of partial sums ***

def _sum_error(out: np.ndarray, a: np.ndarray, axis) -> float:
    """The error of a float32 sum relative to the sum of |a| (the scale of its rounding errors), against float64."""
    a64 = a.astype(np.float64)
    return float(np.max(np.abs(out.astype(np.float64).reshape(-1) - np.reshape(a64.sum(axis), -1)) /
                        np.reshape(np.abs(a64).sum(axis), -1)))

U, UR = (lambda axis, amt: Opt(OptOps.UPCAST, axis, amt)), (lambda axis, amt: Opt(OptOps.UNROLL, axis, amt))

# (a sum of 0.1s in one float32 accumulator is off by about 1% after 10^6 terms, and by 3e-5 after 4096)
@pytest.mark.parametrize("shape,axis,opts", [
    ((3, 320032), 1, None), ((3, 320032), 1, []), ((3, 320032), 1, [UR(1, 4)]), ((3, 320032), 1, [U(1, 8)]),
    ((3, 320032), 1, [U(1, 8), UR(1, 4)]), ((320032, 3), 0, None), ((320032, 3), 0, [UR(1, 2)]),
    ((1000, 1001), None, None), ((1000, 1001), None, []), ((7, 100003), None, [])])
def test_long_sum_is_blocked(shape, axis, opts):
    a = np.full(shape, 0.1, np.float32)
    a[:, ::7] = 0.3
    out = np.zeros(1 if axis is None else shape[1 - axis], np.float32)
    p = run(reduce_2d_ast(*shape, axis, Ops.ADD, dtypes.float32), [out, a], opts=opts or None, noopt=opts == [])
    if opts: assert list(p.applied_opts) == opts
    assert _sum_error(out, a, axis) < 1e-5

def test_long_sums_of_one_loop_share_its_blocks():
    # out0[i] = sum_k a[i, k] * b[k] and out1[i] = sum_k a[i, k] over the same loop
    M, K = 2, 250007
    a, b = RS.uniform(0, 1, (M, K)).astype(np.float32), RS.uniform(0, 1, K).astype(np.float32)
    r0, rk = rng(M, 0), rng(K, 1, "reduce")
    ld = glob(2, dtypes.float32, M * K).index(r0 * K + rk).load()
    dot = reduce(ld * glob(3, dtypes.float32, K).index(rk).load(), rk)
    ast = UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(dot),
                      glob(1, dtypes.float32, M).index(r0).store(reduce(ld, rk)))
    outs = [np.zeros(M, np.float32) for _ in range(2)]
    p = run(ast, [*outs, a, b])
    assert _sum_error(outs[0], a * b, 1) < 1e-5 and _sum_error(outs[1], a, 1) < 1e-5
    # one loop nest reads the data for both (blocks, blocks of blocks, the remainder; both sums in vectors of 8 on
    # AVX2, whose remainder is blocked too): not one nest per sum, which would make at least 7 loops
    assert p.src.count("for (long ridx") <= 6

def test_short_sums_are_not_blocked(monkeypatch):
    # sums of at most 4096 terms per accumulator (a matmul's K, a softmax row), max and integer sums compile as
    # before: the C source is the same with the blocking turned off
    lower_mod = sys.modules["fusegrad.codegen.lower"]   # (fusegrad.codegen.lower is also a function's name)
    f32 = dtypes.float32
    asts = [matmul_ast(64, 64, 4096), reduce_2d_ast(64, 4096, 1, Ops.ADD, f32),
            reduce_2d_ast(8, 4096 * 16, 1, Ops.ADD, f32), reduce_2d_ast(4096, 64, 0, Ops.ADD, f32),
            reduce_2d_ast(3, 100003, 1, Ops.MAX, f32), reduce_2d_ast(3, 100003, 1, Ops.ADD, dtypes.int32)]
    long_sum = reduce_2d_ast(3, 100003, 1, Ops.ADD, f32)
    srcs = [get_program(ast, RENDERER).src for ast in asts + [long_sum]]
    monkeypatch.setattr(lower_mod, "SUM_BLOCKED_OVER", 1 << 62)
    unblocked = [get_program(ast, RENDERER).src for ast in asts + [long_sum]]
    assert srcs[:-1] == unblocked[:-1]
    # (a long float sum does change: its blocks are loops)
    assert srcs[-1].count("for (long ridx") > unblocked[-1].count("for (long ridx")

@pytest.mark.parametrize("noopt", [False, True])
def test_long_sum_over_a_row_statistic_computes_the_statistic_once(noopt):
    # out[i] = sum_k exp(a[i, k] - max_j a[i, j]) (a softmax denominator over a vocabulary): the blocked sum's
    # remainder loop reads the same row max; the max is not computed again for it
    M, K = 3, 50257
    a = RS.standard_normal((M, K)).astype(np.float32) * 4
    r0, rk, rj = rng(M, 0), rng(K, 1, "reduce"), rng(K, 2, "reduce")
    row = glob(1, dtypes.float32, M * K)
    mx = UOp(Ops.REDUCE, dtypes.float32, (row.index(r0 * K + rj).load(), rj), Ops.MAX)
    term = (row.index(r0 * K + rk).load() - mx).alu(Ops.EXP2)
    ast = UOp.sink_of(glob(0, dtypes.float32, M).index(r0).store(reduce(term, rk)))
    out = np.zeros(M, np.float32)
    p = run(ast, [out, a], noopt=noopt)
    a64 = a.astype(np.float64)
    np.testing.assert_allclose(out, np.exp2(a64 - a64.max(1, keepdims=True)).sum(1), rtol=1e-5)
    if noopt:   # one loop over the whole row: the max's (the sum's are its blocks and their remainders)
        assert p.src.count(f"< {K};") == 1, p.src
