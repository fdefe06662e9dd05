"""Constants that change between calls become kernel parameters: the schedule cache hits, no kernel is recompiled, and
the values are exact for every dtype."""
from __future__ import annotations
import math
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.device import Device
from fusegrad.engine.realize import method_cache
from fusegrad.schedule.kernelize import schedule_cache_stats
from fusegrad.uop.ops import Ops

def kernel_params(t: Tensor) -> list[list[str]]:
    """The parameter names of each kernel that computes `t`."""
    return [sorted(u.arg[0] for u in si.ast.toposort() if u.op is Ops.DEFINE_VAR) for si in t.schedule()]

def test_changing_constant_hits_the_caches():
    x = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)).realize()
    step = lambda i: ((x * 1.5 + 1).relu().sum(1) + (i + 10))
    # first sighting: the constant is baked into the kernel
    assert kernel_params(step(0)) == [[]]
    # another value at the same place: lifted into a kernel parameter, once
    (params,) = kernel_params(step(1))
    assert len(params) == 1 and params[0] == "_p0"
    want = (np.arange(12).reshape(3, 4) * 1.5 + 1).sum(1)
    np.testing.assert_allclose(step(2).realize().numpy(), want + 12, rtol=1e-6)
    misses, kernels, compiles = schedule_cache_stats["misses"], len(method_cache), Device["CPU"].compiler.compiles
    for i in range(3, 40): np.testing.assert_allclose(step(i).realize().numpy(), want + i + 10, rtol=1e-6)
    assert schedule_cache_stats["misses"] == misses
    assert len(method_cache) == kernels and Device["CPU"].compiler.compiles == compiles

def test_constants_that_never_change_stay_in_the_code():
    x = Tensor(np.ones(8, np.float32)).realize()
    for lr in (0.1, 0.01, 0.001):
        (x * 0.5 + lr).realize()
    # only the changing one is a parameter (the kernel's first, _p0); 0.5 is still folded into the code
    (si,) = (x * 0.5 + 0.0001).schedule()
    consts = {u.arg for u in si.ast.toposort() if u.op is Ops.CONST and u.dtype == dtypes.float32}
    assert 0.5 in consts and [u.arg[0] for u in si.ast.toposort() if u.op is Ops.DEFINE_VAR] == ["_p0"]

DTYPES = [(dtypes.float32, np.float32), (dtypes.float64, np.float64), (dtypes.int8, np.int8),
          (dtypes.int32, np.int32), (dtypes.int64, np.int64), (dtypes.uint8, np.uint8), (dtypes.uint32, np.uint32),
          (dtypes.uint64, np.uint64)]

@pytest.mark.parametrize("dt,npdt", DTYPES, ids=lambda d: str(d))
def test_lifted_values_are_exact(dt, npdt):
    base = np.arange(-3, 5).astype(npdt)
    x = Tensor(base).realize()
    info = np.iinfo(npdt) if np.issubdtype(npdt, np.integer) else np.finfo(npdt)
    # values at the edges of the dtype (and, for floats, ones that don't fit in float32)
    values = [1, 7, int(info.max), int(info.min), 0] if np.issubdtype(npdt, np.integer) else \
        [1.0, 0.1, 1e-30, -2.5e38 if npdt == np.float32 else 1e300, 3.0000001]
    for v in values:
        got = (x * 2 + v).numpy()
        with np.errstate(over="ignore"): want = base * npdt(2) + npdt(v)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype

@pytest.mark.parametrize("dt,tdt", [(dtypes.float16, torch.float16), (dtypes.bfloat16, torch.bfloat16)])
def test_lifted_half_values_are_exact(dt, tdt):
    base = np.linspace(-4, 4, 16, dtype=np.float32)
    x = Tensor(base).cast(dt).realize()
    for v in (0.1, 3.14159, 65504.0, -1e-5, 0.333):
        got = (x * v).float().numpy()
        want = (torch.from_numpy(base).to(tdt) * torch.tensor(v, dtype=tdt)).float().numpy()
        np.testing.assert_array_equal(got, want)

def test_signed_zero_and_nan_are_values_of_their_own():
    x = Tensor(np.array([1.0, -1.0, 0.0], np.float32)).realize()
    for c in (0.0, -0.0, math.nan, math.inf, -0.0, 0.0, 2.0):
        with np.errstate(invalid="ignore"): want = np.array([1.0, -1.0, 0.0], np.float32) * np.float32(c)
        np.testing.assert_array_equal((x * c).numpy(), want)

def test_parameters_on_the_python_device():
    x = Tensor(np.arange(6, dtype=np.float32), device="PYTHON").realize()
    for v in (0.25, 0.5, 1.75):
        np.testing.assert_array_equal((x * 3 + v).numpy(), np.arange(6, dtype=np.float32) * 3 + np.float32(v))
    xi = Tensor(np.arange(6, dtype=np.int32), device="PYTHON").realize()
    for v in (1, -7, 2**31 - 1):
        np.testing.assert_array_equal((xi + v).numpy(), np.arange(6, dtype=np.int32) + np.int32(v))

def test_equal_constants_merge_into_another_structure():
    # when the changing value equals another constant of the graph, hash-consing makes it one node: another
    # structure, still correct
    x = Tensor(np.arange(4, dtype=np.float32)).realize()
    for v in (3.0, 2.0, 5.0, 2.0):
        np.testing.assert_array_equal((x * 2.0 + v).numpy(), np.arange(4, dtype=np.float32) * 2 + v)

def test_recomputation_is_bounded():
    # x = f(x, sum(x)) in a loop: every value is used by two kernels; recomputing it in each would make kernel k
    # recompute the whole history (quadratic work and code)
    xn = np.ones((7, 7), np.float32)
    x = Tensor(xn).realize()
    for i in range(60):
        if i % 3:
            x, xn = (x * 1.01 + 0.5).relu(), np.maximum(xn * np.float32(1.01) + np.float32(0.5), 0)
        else:
            x = x.sum(1, keepdim=True).expand(7, 7) * 0.001 + x
            xn = np.broadcast_to(xn.sum(1, keepdims=True), (7, 7)) * np.float32(0.001) + xn
    sched = x.schedule()
    biggest = max(sum(1 for u in si.ast.toposort() if u.op in (Ops.ADD, Ops.MUL, Ops.MAX)) for si in sched)
    assert biggest <= 80, f"a kernel recomputes {biggest} ops"
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    np.testing.assert_allclose(x.numpy(), xn, rtol=1e-5)

def test_index_only_gates_are_simplified():
    # the input gradient of a padded convolution masks values computed in the kernel (not loads) with padding gates;
    # those gates are index arithmetic and must simplify like load indices do (they were 500 leftover div/mod)
    rng = np.random.default_rng(1)
    xn, wn = rng.standard_normal((2, 4, 9, 9), dtype=np.float32), rng.standard_normal((5, 4, 3, 3), dtype=np.float32)
    x, w = Tensor(xn).realize(), Tensor(wn).realize()
    g, = x.conv2d(w, padding=1).sum().gradient(x)
    (si,) = g.schedule()
    divmods = sum(1 for u in si.ast.toposort() if u.op in (Ops.IDIV, Ops.MOD))
    assert divmods <= 12, f"{divmods} div/mod left in the kernel"
    tx = torch.from_numpy(xn).requires_grad_()
    torch.nn.functional.conv2d(tx, torch.from_numpy(wn), padding=1).sum().backward()
    from fusegrad.engine.realize import run_schedule
    run_schedule([si])
    np.testing.assert_allclose(g.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)

def test_recent_constant_views_keep_values_apart():
    # the constant views made last are kept for reuse, keyed so that values `==` conflates stay apart: 0.0 and -0.0,
    # 1 and 1.0 and True, and nan (which equals nothing, itself included)
    from fusegrad.schedule.simplify import const_view
    x = Tensor.ones(3, 2)
    for _ in range(2):  # the second round finds the first round's views
        got = [(x * v).numpy() for v in (0.0, -0.0, math.nan)]
        np.testing.assert_array_equal(np.signbit(got[0]), np.zeros((3, 2), bool))
        np.testing.assert_array_equal(np.signbit(got[1]), np.ones((3, 2), bool))
        assert np.isnan(got[2]).all()
        assert (Tensor.full((2,), 1).dtype, Tensor.full((2,), 1.0).dtype, Tensor.full((2,), True).dtype) == \
            (dtypes.int32, dtypes.float32, dtypes.bool)
        assert Tensor.full((2,), True).tolist() == [True, True] and Tensor.full((2,), 1).tolist() == [1, 1]
    device = Tensor.ones(1).uop.base.src[0]  # (a constant's DEVICE node)
    assert const_view(-0.0, dtypes.float32, device, (2,)) is not const_view(0.0, dtypes.float32, device, (2,))
    assert const_view(math.nan, dtypes.float32, device, (2,)) is const_view(math.nan, dtypes.float32, device, (2,))
