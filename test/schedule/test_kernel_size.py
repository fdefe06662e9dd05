"""Kernels stay small enough to compile: deep nests of loops are flattened, deep chains of ops are cut into kernels of
bounded size, and the values stay those of NumPy."""
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.codegen.opt import MAX_OUTPUT_LOOPS, Kernel
from fusegrad.device import Device
from fusegrad.engine.realize import run_schedule
from fusegrad.schedule.merge import KERNEL_OPS_LIMIT, kernel_weight, op_weight

def _kernels(t: Tensor) -> list:
    sched = t.schedule()
    run_schedule(sched)
    return [si.ast for si in sched]

def _same(out: np.ndarray, ref: np.ndarray, **tol) -> None:
    # (flat: numpy prints a failing 20-d array for minutes)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out.reshape(-1), ref.reshape(-1), **tol)

def _output_loops(ast) -> int:
    k = Kernel(ast, Device["CPU"].renderer)
    return k.first_reduce

# *** deep nests of loops ***

def test_rank24_elementwise_is_one_loop():
    t = Tensor.ones(*[2] * 24) + 1
    (ast,) = _kernels(t)
    assert _output_loops(ast) == 1
    out = t.numpy()
    assert out.shape == (2,) * 24
    assert (float(out.min()), float(out.max())) == (2.0, 2.0)

def test_rank20_load_is_one_loop():
    x = np.random.default_rng(0).standard_normal(2 ** 20).astype(np.float32).reshape([2] * 20)
    t = Tensor(x) * 3 + 1
    (ast,) = _kernels(t)
    assert _output_loops(ast) == 1
    _same(t.numpy(), x.astype(np.float64) * 3 + 1, rtol=1e-6, atol=1e-6)

def test_rank20_permuted_copy_is_flattened():
    # no two loops are contiguous in both the load and the store: they are merged anyway, dividing the index back
    x = np.arange(2 ** 20, dtype=np.float32).reshape([2] * 20)
    order = tuple(reversed(range(20)))
    t = Tensor(x).permute(*order) + 0.5
    (ast,) = _kernels(t)
    assert _output_loops(ast) <= MAX_OUTPUT_LOOPS
    _same(t.numpy(), x.transpose(order) + np.float32(0.5), rtol=0)

def test_rank20_mixed_permutation_and_pad():
    x = np.arange(2 ** 18, dtype=np.float32).reshape([2] * 18)
    order = (1, 0) + tuple(range(2, 16)) + (17, 16)
    t = Tensor(x).permute(*order).pad(((0, 1),) + ((0, 0),) * 17, value=-1.0) * 2
    (ast,) = _kernels(t)
    assert _output_loops(ast) <= MAX_OUTPUT_LOOPS
    ref = np.pad(x.transpose(order), ((0, 1),) + ((0, 0),) * 17, constant_values=-1.0) * 2
    _same(t.numpy(), ref, rtol=0)

def test_rank20_reduction_over_half_the_axes():
    x = (np.arange(2 ** 20) % 7).astype(np.float32).reshape([2] * 20)
    t = Tensor(x).sum(axis=tuple(range(10, 20))) - 1
    _kernels(t)
    _same(t.numpy(), x.astype(np.float64).sum(axis=tuple(range(10, 20))) - 1, rtol=0)

def test_rank20_with_iota_keeps_values():
    # a loop a value uses (an arange broadcast over the deep shape) is merged too once the nest is too deep
    shape = (2,) * 20
    t = Tensor.arange(2).reshape(2, *(1,) * 19).expand(*shape).float() + Tensor.ones(*shape)
    (ast,) = _kernels(t)
    assert _output_loops(ast) <= MAX_OUTPUT_LOOPS
    ref = np.broadcast_to(np.arange(2, dtype=np.float32).reshape(2, *(1,) * 19), shape) + 1
    _same(t.numpy(), ref, rtol=0)

def test_shallow_kernels_keep_their_loops():
    # an ordinary 2-d elementwise kernel is not flattened (its rows stay the heuristics' business)
    (ast,) = [si.ast for si in (Tensor.empty(64, 48) + 1).schedule()]
    assert _output_loops(ast) == 2

# *** deep chains of ops ***

def _bounded(asts: list) -> None:
    # a kernel's weight beyond its single heaviest op is within the limit (an op can't be split)
    over = [kernel_weight(a) - max(op_weight(u) for u in a.toposort()) for a in asts]
    assert all(w <= KERNEL_OPS_LIMIT for w in over), over

def test_sin_chain_is_split_into_bounded_kernels():
    xn = np.linspace(-3, 3, 999).astype(np.float32)
    t = Tensor(xn)
    for _ in range(200): t = t.sin()
    asts = _kernels(t)
    _bounded(asts)
    assert len(asts) > 1
    # the pieces of one chain are the same kernel, so it is compiled once
    assert len(set(asts)) <= 2
    ref = xn.astype(np.float64)
    for _ in range(200): ref = np.sin(ref)
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5, atol=1e-6)

def test_exp_log_chain_schedule_is_bounded():
    t = Tensor.empty(1024)
    for i in range(1000): t = t.exp() if i % 2 == 0 else t.log()
    asts = [si.ast for si in t.schedule()]
    _bounded(asts)
    assert len(set(asts)) <= 4

def _exp_log_chain(steps: int) -> tuple[Tensor, np.ndarray]:
    """exp and log alternating `steps` times, and the same in float64 numpy."""
    xn = np.linspace(0.5, 2, 1000).astype(np.float32)
    t, ref = Tensor(xn), xn.astype(np.float64)
    for i in range(steps):
        t = t.exp() if i % 2 == 0 else t.log()
        ref = np.exp(ref) if i % 2 == 0 else np.log(ref)
    return t, ref

@pytest.mark.slow
def test_exp_log_chain_values():
    t, ref = _exp_log_chain(1000)
    asts = _kernels(t)
    _bounded(asts)
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5)

def test_exp_log_chain_short_values():
    t, ref = _exp_log_chain(60)
    asts = _kernels(t)
    _bounded(asts)
    assert len(asts) > 1
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5)

def test_float64_sines_one_per_kernel():
    # a float64 sine weighs more than the limit: a kernel holds it and what is cheap around it
    xn = np.linspace(-2, 2, 100)
    t = Tensor(xn, dtype=dtypes.float64)
    for _ in range(4): t = t.sin()
    asts = _kernels(t)
    _bounded(asts)
    assert len(asts) == 4
    np.testing.assert_allclose(t.numpy(), np.sin(np.sin(np.sin(np.sin(xn)))), rtol=1e-14)

def test_shared_subexpressions_are_counted_once():
    # x = x*x + x: each step uses x twice, so its size counted per path doubles every step; counted per node it
    # grows by a few ops, and the 180 steps fit one kernel
    xn = np.linspace(-0.5, 0.5, 257).astype(np.float32)
    t, ref = Tensor(xn), xn.astype(np.float64)
    for _ in range(180):
        t = t * t * 0.5 + t * 0.25
        ref = ref * ref * 0.5 + ref * 0.25
    asts = _kernels(t)
    assert len(asts) == 1
    _bounded(asts)
    np.testing.assert_allclose(t.numpy(), ref, rtol=1e-5, atol=1e-30)

def test_sines_feeding_a_sum_and_a_sum_of_sines():
    xn = np.linspace(-1, 1, 4096).astype(np.float32).reshape(64, 64)
    t, ref = Tensor(xn), xn.astype(np.float64)
    for i in range(12):
        t, ref = t.sin() * 1.5, np.sin(ref) * 1.5
    s = t.sum(1) + Tensor(xn).sin().sum(1)
    asts = _kernels(s)
    _bounded(asts)
    np.testing.assert_allclose(s.numpy(), ref.sum(1) + np.sin(xn.astype(np.float64)).sum(1), rtol=1e-4, atol=1e-4)

def test_wide_sum_of_sines():
    # many independent sines added together: the adds' operands are computed into buffers in groups
    xs = [np.linspace(-1, 1, 128).astype(np.float32) + i for i in range(12)]
    t = Tensor(xs[0]).sin()
    for x in xs[1:]: t = t + Tensor(x).sin()
    asts = _kernels(t)
    _bounded(asts)
    assert len(asts) > 1
    np.testing.assert_allclose(t.numpy(), sum(np.sin(x.astype(np.float64)) for x in xs), rtol=1e-5, atol=1e-5)

def test_long_cheap_chain_stays_one_kernel():
    # 900 plain ops: within the limit, one kernel (1500 are two)
    t = Tensor.empty(1024)
    for i in range(600): t = t * 1.0001 + 0.001 if i % 2 == 0 else t - 0.0005
    assert len([si.ast for si in t.schedule()]) == 1
    t = Tensor.empty(1024)
    for i in range(1000): t = t * 1.0001 + 0.001 if i % 2 == 0 else t - 0.0005
    asts = [si.ast for si in t.schedule()]
    _bounded(asts)
    assert len(asts) == 2

def test_one_heavy_op_with_a_little_around_it_stays_one_kernel():
    # randn: a float64-wide cosine, a log, the generator's arithmetic: one kernel, as before the bound
    assert len([si for si in Tensor.randn(1000).schedule() if si.ast.op.name == "SINK"]) == 1
    def make() -> Tensor: return (Tensor(np.linspace(-3, 3, 64).astype(np.float32)).cos() * 2 + 1).log()
    assert len(make().schedule()) == 1   # (a scheduled tensor is left over buffers nothing filled: made again below)
    np.testing.assert_allclose(make().numpy(), np.log(np.cos(np.linspace(-3, 3, 64)) * 2 + 1).astype(np.float32),
                               rtol=1e-5, atol=1e-6)
