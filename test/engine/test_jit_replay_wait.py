"""TinyJit.replay_kept(wait=True) returns once its kernels have run, and with `inputs` reads other memory in place of
an input's for that call (a caller's array, without a copy into the input's memory): results against NumPy, the
input's own memory untouched, for replays run on the calling thread (little work) and queued across threads (a
matmul); inputs the captured kernels write, or given without `wait`, are refused."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fusegrad import Context, Device, Tensor, TinyJit
from fusegrad.runtime import cpu_pool
from test.engine.test_jit_replay_kept import _fill, _read

rng = np.random.default_rng(11)
pytestmark = pytest.mark.skipif(Device.DEFAULT != "CPU", reason="in-place inputs are ctypes allocations of the CPU")


def _arr(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)


def _aligned(a: np.ndarray, misalign: int = 0) -> np.ndarray:
    """A copy of `a` at an address 64-byte aligned (plus `misalign` bytes)."""
    raw = np.empty(a.nbytes + 128, np.uint8)
    off = -raw.ctypes.data % 64 + misalign
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _alloc(a: np.ndarray) -> ctypes.Array:
    return (ctypes.c_uint8 * a.nbytes).from_buffer(a)


def _small(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return (x @ w).relu(), (x * 2 + 1).sum(1).reshape(2, 2)


def _big(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return (x @ w).relu(), (x * 2 + 1).sum(1)


@pytest.mark.parametrize("case", ["small", "big", "big one thread"])
def test_wait_and_inputs_in_place_match_numpy(case: str):
    fn, (m, k, n) = (_small, (4, 3, 5)) if case == "small" else (_big, (256, 192, 160))
    ref = (lambda a, b: (np.maximum(a @ b, 0), (a * 2 + 1).sum(1).reshape(2, 2))) if case == "small" else \
        (lambda a, b: (np.maximum(a.astype(np.float64) @ b, 0), (a.astype(np.float64) * 2 + 1).sum(1)))
    pool = cpu_pool.c_pool()
    with Context(CPU_THREADS=1 if case == "big one thread" else 0):
        jit = TinyJit(fn)
        x, w = Tensor(_arr(m, k)).realize(), Tensor(_arr(k, n)).realize()
        for _ in range(3): jit(x, w)
        assert jit.reads_in_place() == [True, True]
        for i in range(4):
            a, b = _arr(m, k), _arr(k, n)
            _fill(x, a)
            _fill(w, b)
            if i % 2:   # (x read from another array, in place; w from its own memory)
                other = _aligned(_arr(m, k))
                got = jit.replay_kept(x, w, wait=True, inputs=[_alloc(other), None])
                want = ref(other, b)
            else:
                got = jit.replay_kept(x, w, wait=True)
                want = ref(a, b)
            assert got is not None
            if pool is not None: assert pool.done(pool.submitted)   # (nothing left running)
            if case != "small": assert jit._kept.joins   # (the graph waited for its own kernels)
            np.testing.assert_allclose(_read(got[0], want[0].shape), want[0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(_read(got[1], want[1].shape), want[1], rtol=1e-4, atol=1e-3)
            np.testing.assert_array_equal(x.numpy(), a)   # (the input's own memory keeps its values)


def test_inputs_in_place_refused_where_a_kernel_writes_the_input():
    def update(x: Tensor, y: Tensor) -> Tensor:
        x.assign(x + y).realize()
        return (x * 3).contiguous()
    jit = TinyJit(update)
    x, y = Tensor(_arr(8)).realize(), Tensor(_arr(8)).realize()
    for _ in range(3): jit(x, y)
    assert jit.reads_in_place() == [False, True]
    with pytest.raises(ValueError):
        jit.replay_kept(x, y, wait=True, inputs=[_alloc(_aligned(_arr(8))), None])
    start = x.numpy()
    other = _aligned(_arr(8))
    got = jit.replay_kept(x, y, wait=True, inputs=[None, _alloc(other)])
    assert got is not None
    np.testing.assert_allclose(x.numpy(), start + other, rtol=1e-6)
    np.testing.assert_allclose(_read(got[0], (8,)), (start + other) * 3, rtol=1e-6)
    with pytest.raises(ValueError):   # (in place only while the call runs: with wait)
        jit.replay_kept(x, y, inputs=[None, _alloc(other)])
