"""An expensive value a reduction and a store both compute, written once per row and read back (codegen/reuse.py):
softmax's exponentials. Checked against torch (values, special values, dtypes, the gradient, the loss built on
log_softmax) and against the same kernel compiled without the rewrite (bit for bit: the same arithmetic)."""
import numpy as np
import pytest
import torch
import fusegrad.codegen as cg
from fusegrad import Tensor
from fusegrad.codegen import get_program, optimize
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.codegen.reuse import store_once
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import RENDERER, call, glob, reduce, rng

RS = np.random.RandomState(0)

def softmax_ast(M: int, N: int, flip: bool = False) -> UOp:
    """out[i, j] = exp2(x[i, j] - max_k x[i, k]) / sum_k exp2(x[i, k] - max_k x[i, k]) (flip: the store reads the row
    backwards, x[i, N-1-j])."""
    r0, r1, rk, rn = rng(M, 0), rng(N, 1), rng(N, 2, "reduce"), rng(N, 3, "reduce")
    g1 = glob(1, dtypes.float32, M * N)
    ld = lambda r: g1.index(r0 * N + r).load()
    mx = reduce(ld(rk), rk, op=Ops.MAX)
    den = reduce((ld(rn) - mx).alu(Ops.EXP2), rn)
    val = (ld((N - 1) - r1 if flip else r1) - mx).alu(Ops.EXP2) * den.alu(Ops.RECIP)
    return UOp.sink_of(glob(0, dtypes.float32, M * N).index(r0 * N + r1).store(val))

def n_exp2(ast: UOp) -> int: return sum(u.op is Ops.EXP2 for u in ast.toposort())

@pytest.mark.parametrize("N", [4096, 1000, 100, 37, 8])
def test_kernel_computes_exp_once(N: int):
    # vectorized rows, rows padded to the vector width (100: a gated store), rows of a prime length (scalar)
    opt, _, _ = optimize(softmax_ast(4, N), RENDERER)
    assert n_exp2(opt) == 2
    new = store_once(opt, RENDERER)
    assert n_exp2(new) == 1 and sum(u.op is Ops.DEFINE_LOCAL for u in new.toposort()) == 1

def test_flipped_row_is_not_rewritten():
    opt, _, _ = optimize(softmax_ast(4, 64, flip=True), RENDERER)
    assert store_once(opt, RENDERER) is opt

# the array written in the reduction's loop (its lanes are the vector's), or in a loop of its own where the reduction
# has lanes of other kinds (an unrolled chain, upcast accumulators)
IN_LOOP = None
OWN_LOOP = [[Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 3, 8), Opt(OptOps.UNROLL, 3, 4)],
            [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 3, 8), Opt(OptOps.UPCAST, 3, 2)]]

@pytest.mark.parametrize("N,flip,opts", [(4096, False, IN_LOOP), (1000, False, IN_LOOP), (100, False, IN_LOOP),
                                         (37, False, IN_LOOP), (64, True, IN_LOOP), (256, False, OWN_LOOP[0]),
                                         (256, False, OWN_LOOP[1])])
def test_same_bits_as_without(N: int, flip: bool, opts, monkeypatch):
    x = (RS.randn(5, N) * 4).astype(np.float32)
    x[1, 3] = np.inf
    x[2, :] = -np.inf
    x[3, 5] = np.nan
    outs = []
    for on in (True, False):
        if not on: monkeypatch.setattr(cg, "store_once", lambda ast, renderer: ast)
        p = get_program(softmax_ast(5, N, flip), RENDERER, opts=opts)
        assert (sum(u.op is Ops.DEFINE_LOCAL for u in p.uops) == 1) == (on and not flip)
        assert any(u.op is Ops.RANGE and u.arg[1] == "copy" for u in p.uops) == (on and opts is not IN_LOOP)
        out = np.zeros((5, N), np.float32)
        call(p, [out, x])
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    with np.errstate(invalid="ignore"):
        e = np.exp2(x.astype(np.float64) - x.max(1, keepdims=True))
        ref = e / e.sum(1, keepdims=True)
        if flip: ref = np.exp2(x[:, ::-1].astype(np.float64) - x.max(1, keepdims=True)) / e.sum(1, keepdims=True)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-5, atol=1e-7)

def _torch(x: np.ndarray, fn: str, axis: int) -> np.ndarray:
    return getattr(torch.from_numpy(x), fn)(axis).numpy()

@pytest.mark.parametrize("shape,axis", [((6, 4096), -1), ((9, 1000), -1), ((16, 100), -1), ((33, 10), -1),
                                        ((5, 37), -1), ((3, 1001), -1), ((64, 24), 0), ((4, 48, 8), 1)])
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_against_torch(shape, axis, fn):
    x = (RS.randn(*shape) * 3).astype(np.float32)
    np.testing.assert_allclose(getattr(Tensor(x), fn)(axis).numpy(), _torch(x, fn, axis), rtol=1e-5, atol=1e-7)

@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
@pytest.mark.parametrize("N", [256, 37])
def test_special_values_against_torch(fn, N):
    x = RS.randn(6, N).astype(np.float32)
    x[0, 7] = np.inf                  # one inf: nan where torch has it
    x[1, :] = -np.inf                 # a row of -inf: nan
    x[2, 3] = np.nan
    x[3, ::2] = -np.inf               # -inf beside finite values: 0 (log: -inf)
    x[4, 1], x[4, 2] = np.inf, np.inf
    np.testing.assert_allclose(getattr(Tensor(x), fn)(-1).numpy(), _torch(x, fn, -1), rtol=1e-5, atol=1e-7)

@pytest.mark.parametrize("dt,tol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_types_against_torch(dt, tol):
    x = RS.randn(7, 1024).astype(np.float32) * 3
    tx = torch.from_numpy(x).to(getattr(torch, dt))
    got = Tensor(tx.float().numpy()).cast(dt).softmax(-1).cast("float32").numpy()
    np.testing.assert_allclose(got, tx.softmax(-1).float().numpy(), rtol=tol, atol=tol * 1e-2)
    got = Tensor(tx.float().numpy()).cast(dt).softmax(-1, dtype="float32").numpy()
    np.testing.assert_allclose(got, tx.float().softmax(-1).numpy(), rtol=1e-5, atol=1e-7)

def test_zero_dim_and_empty():
    assert Tensor(3.0).softmax().item() == 1.0
    assert Tensor(3.0).log_softmax().item() == 0.0
    for shape in [(0, 5), (4, 0)]:
        for fn in ("softmax", "log_softmax"):
            got = getattr(Tensor.empty(*shape), fn)(-1)
            assert got.shape == shape and got.dtype == dtypes.float32 and got.numpy().shape == shape

@pytest.mark.parametrize("N", [512, 37])
def test_gradient_against_torch(N):
    x, g = RS.randn(6, N).astype(np.float32), RS.randn(6, N).astype(np.float32)
    tx = torch.tensor(x, requires_grad=True)
    tx.softmax(-1).backward(torch.from_numpy(g))
    fx = Tensor(x, requires_grad=True)
    fx.softmax(-1).backward(Tensor(g))
    np.testing.assert_allclose(fx.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-6)

def test_sparse_categorical_crossentropy_against_torch():
    x, y = RS.randn(32, 1000).astype(np.float32), RS.randint(0, 1000, 32)
    tx = torch.tensor(x, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(tx, torch.from_numpy(y))
    loss.backward()
    fx = Tensor(x, requires_grad=True)
    fl = fx.sparse_categorical_crossentropy(Tensor(y.astype(np.int32)))
    fl.backward()
    np.testing.assert_allclose(fl.item(), loss.item(), rtol=1e-5)
    np.testing.assert_allclose(fx.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-7)
