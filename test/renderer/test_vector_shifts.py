"""Shifts of integer vectors in C kernels are GCC vector operators (shift instructions), with a count of the lanes'
width or more giving 0 as the scalar form does: the values of exp in a softmax (its 2^k scaling shifts vectors of
int32) and of integer shifts by per-element counts, against NumPy."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.device import Device
from fusegrad.uop.ops import Ops


def _sources(t: Tensor) -> list[str]:
    return [get_program(si.ast, Device["CPU"].renderer).src for si in t.schedule() if si.ast.op is Ops.SINK]


def test_softmax_exp_values_with_vector_shifts():
    # rows of scores over a wide range: exp underflows to 0 and its 2^k factor is split in two shifted halves
    rs = np.random.default_rng(2)
    x = (rs.standard_normal((4, 64, 128)) * np.array([1, 30, 90, 200])[:, None, None]).astype(np.float32)
    srcs = _sources(Tensor(x).softmax(-1))
    # (the kernels' own vectors: the exp's shifts are written with the vector operator, one instruction each)
    assert any("fg_vshr_i32x" in s and "(a >> (b & 31))" in s for s in srcs), srcs
    want = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(Tensor(x).softmax(-1).numpy(), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dt,np_dt", [(dtypes.int32, np.int32), (dtypes.uint32, np.uint32), (dtypes.int8, np.int8)])
def test_shifts_by_counts_values(dt, np_dt):
    # counts in range, of the width and beyond (0), on values of both signs; a reduction of the shifted values keeps
    # the kernel on the code generator's own vectors
    rs = np.random.default_rng(3)
    bits = 8 * np.dtype(np_dt).itemsize
    a = rs.integers(np.iinfo(np_dt).min, np.iinfo(np_dt).max, (16, 64), endpoint=True).astype(np_dt)
    c = rs.integers(0, bits + 4, (16, 64)).astype(np_dt)
    def ref(op) -> np.ndarray:
        out = op(a.astype(np.int64) if np_dt != np.uint32 else a.astype(np.uint64), np.minimum(c, 63).astype(np.int64)
                 if np_dt != np.uint32 else np.minimum(c, 63).astype(np.uint64))
        out = np.where(c < bits, out, 0)
        return out.astype(np_dt)
    left, right = ref(np.left_shift), ref(np.right_shift)
    np.testing.assert_array_equal((Tensor(a) << Tensor(c)).numpy(), left)
    np.testing.assert_array_equal((Tensor(a) >> Tensor(c)).numpy(), right)
    np.testing.assert_array_equal((Tensor(a) >> Tensor(c)).max(-1).numpy(), right.max(-1))
