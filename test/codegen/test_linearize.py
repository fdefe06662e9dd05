"""The linearized form of a kernel and the program's name and estimates: loops nest, loop-invariant code is hoisted."""
import numpy as np
from fusegrad.codegen import full_rewrite, get_program
from fusegrad.dtype import dtypes
from fusegrad.helpers import Context
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import RENDERER, glob, matmul_ast, reduce, rng, run

def test_reduce_kernel_name_and_estimates():
    with Context(NOOPT=1): p = get_program(matmul_ast(16, 8, 4), RENDERER)
    assert p.name == "r_16_8_4" and p.applied_opts == ()
    assert p.estimates.ops == 2 * 16 * 8 * 4
    assert p.estimates.mem == (16 * 8 + 16 * 4 + 4 * 8) * 4
    assert "__attribute__((vector_size" not in p.src   # NOOPT: plain scalar loops

def test_linearized_structure():
    uops = full_rewrite(matmul_ast(32, 32, 32), RENDERER)
    assert all(isinstance(u, UOp) for u in uops)
    depth = 0
    for u in uops:
        if u.op is Ops.RANGE: depth += 1
        if u.op is Ops.END: depth -= 1
        assert depth >= 0
    assert depth == 0
    first = [u.op for u in uops[:3]]
    assert first == [Ops.DEFINE_GLOBAL] * 3
    assert uops.index(next(u for u in uops if u.op is Ops.DEFINE_REG)) < uops.index(next(u for u in uops
                                                                                          if u.op is Ops.RANGE))
    assert any(u.op is Ops.STORE for u in uops)

def test_loop_invariant_code_is_hoisted():
    # the reduce over k doesn't depend on j: it is computed once per i, outside the j loop
    M, N, K = 4, 8, 16
    r0, r1, r2 = rng(M, 0), rng(N, 1), rng(K, 2, "reduce")
    s = reduce(glob(1, dtypes.float32, M * K).index(r0 * K + r2).load(), r2)
    ast = UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(s + r1.cast(dtypes.float32)))
    with Context(NOOPT=1): uops = full_rewrite(ast, RENDERER)
    rngs = [u for u in uops if u.op is Ops.RANGE]
    j_loop, k_loop = next(r for r in rngs if r.src[0].arg == N), next(r for r in rngs if r.src[0].arg == K)
    end_k = next(i for i, u in enumerate(uops) if u.op is Ops.END and u.src[0] is k_loop)
    assert end_k < uops.index(j_loop)
    a = np.random.RandomState(0).randn(M, K).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    run(ast, [out, a])
    np.testing.assert_allclose(out, a.sum(1, keepdims=True) + np.arange(N), rtol=1e-5, atol=1e-5)
