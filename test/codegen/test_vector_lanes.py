"""The vectorizer's shortcuts give what the plain rewrite gives: the lanes of index expressions made once per kernel
(VecCtx.lanes, lane_zero) against UOp.substitute, and vectorize (which skips the nodes its rules leave alone) against
its two passes run over every node with no memo."""
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import optimize
from fusegrad.codegen.expand import VecCtx, pm_vector_memory, pm_vectorize, vectorize
from fusegrad.codegen.lower import lower_kernel
from fusegrad.codegen.opt.tc import fuse_wmma
from fusegrad.codegen.transcendental import rewrite_transcendental
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import graph_rewrite
from test.codegen.helpers import RENDERER, rng

def _const(v: int) -> UOp: return UOp.const(dtypes.index, v)

def test_lanes_match_substitute_in_any_order():
    vec, r1, r2 = rng(8, 5, "upcast"), rng(16, 1), rng(3, 2, "reduce")
    shared = vec * 4 + r1 * 32
    exprs = [shared + r2, (shared + 1) // 3, (vec + r2 * 8) % 5, shared * 2 + (vec < 4).where(r1, r2), r1 * 7]
    for order in (exprs, exprs[::-1]):
        ctx = VecCtx(vec, 8, (dtypes.float32,))
        for e in order:
            want = [e.substitute({vec: _const(k)}) for k in range(8)]
            assert ctx.lanes(e) == want
            assert ctx.lane_zero(e) is want[0]
            # a lane has no vector axis left: the memory pass takes it as rewritten
            assert all(ctx.rewritten[w] is w and vec not in w.toposort() for w in want)

def _plain_vectorize(sink: UOp, vec: UOp, width: int, vec_dtypes: tuple) -> UOp:
    ctx = VecCtx(vec, width, vec_dtypes)
    sink = graph_rewrite(sink, pm_vector_memory, ctx=ctx)
    return graph_rewrite(sink, pm_vectorize, ctx=ctx, bottom_up=True)

def _kernels(out: Tensor) -> list[UOp]:
    return [si.ast for si in out.schedule() if si.ast.op is Ops.SINK]

def _programs() -> list[Tensor]:
    rs = np.random.default_rng(0)
    def randn(*shape: int) -> Tensor: return Tensor(rs.standard_normal(shape).astype(np.float32))
    x, w, a, b = randn(2, 8, 12, 12), randn(16, 8, 3, 3), randn(24, 40), randn(40, 32)
    return [x.conv2d(w, padding=1).relu(),                   # padded: gated vector loads, loads per lane
            x.conv2d(w, stride=2),                           # strided: loads per lane
            a @ b, (a @ b).softmax(-1),                      # reductions vectorized along their own axis
            randn(2, 3, 32, 32).conv2d(randn(16, 3, 7, 7), stride=2, padding=3),   # ResNet's stem
            x.conv2d(randn(8, 1, 3, 3), groups=8, padding=1)]                      # depthwise

@pytest.mark.parametrize("case", range(6))
def test_vectorize_matches_the_plain_rewrite(case: int):
    vectorized = 0
    for ast in _kernels(_programs()[case]):
        sink, ctx = lower_kernel(optimize(ast, RENDERER)[0], RENDERER, use_fma=True)
        sink = rewrite_transcendental(fuse_wmma(sink), RENDERER)
        for vec in ctx.vecs:
            args = (vec, range_size(vec), tuple(RENDERER.vector_dtypes))
            want = _plain_vectorize(sink, *args)
            sink = vectorize(sink, *args)
            assert sink is want
            vectorized += 1
    assert vectorized > 0
