"""The op suite on the CL device (OpenCL through PoCL), whose kernels are GPU-style (work-groups, local memory,
barriers): a subset of test/tensor/test_ops.py and of the convolution, pooling and indexing tests run by pytest in a
subprocess with `DEV=CL` (CL the default device, so every tensor those tests make is on CL), and one forward and
backward pass over cumsum, softmax, matmul, gathers and pooling against torch here.

The subset, one or a few cases of each kind: elementwise ops with broadcasting (scalars too), a comparison, where,
unary math, softmax and log_softmax, sum/max/min/mean over one, several and all axes (keepdim too), an integer
reduction's identity, a float16 sum, matmuls (batched, odd sizes, a vector times a matrix), casts across dtype classes
(float64, float16, int8/uint8), the float16, bfloat16 and wrapping-integer classes, basic indexing, a sum and a
softmax over rows longer than a work-group, argmax, cat/stack, then conv2d with groups, stride and dilation (forward
and gradients), max and average pooling (gradients too) and a setitem's gradient. PoCL spends about half a second on
each new kernel (its build, then machine code at its first launch) and most tests make a few, so about 20 tests per
half is what fits in about a minute each on two cores. The whole of test_ops.py under DEV=CL (329 tests) took 13 min
on the loaded 2-core machine (5 min of CPU): it is the slow test at the end. (test_reductions.py's cases are realized
by one module fixture of several hundred kernels: cumsum is checked here instead.)"""
from __future__ import annotations
import os
import re
import subprocess
import sys
import numpy as np
import pytest
import torch

cl = pytest.importorskip("pyopencl")

from fusegrad import Tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS, NN, IDX = "test/tensor/test_ops.py", "test/tensor/test_nn_functions.py", "test/tensor/test_indexing.py"

# two halves of about the same run time (pytest-xdist gives them a core each)
SUBSET = [
    [f"{OPS}::{t}" for t in (
        "test_binary_broadcast[add-((3, 1), (1, 4))]", "test_binary_broadcast[div-((4,), (3, 4))]",
        "test_binary_broadcast[mul-((), (2, 3))]", "test_comparisons[lt]", "test_where", "test_unary[exp]",
        "test_unary[log]", "test_unary[sin]", "test_unary[sqrt]", "test_softmax[-1]", "test_log_softmax[0]",
        "test_reduce[sum-(0, 2)-False]", "test_reduce[max-1-True]", "test_reduce[min-None-False]",
        "test_reduce[mean--1-False]", "test_int_reduce_identity_extremes[int32]",
        "test_sum_float16_accumulates_in_float32", "test_matmul[((2, 3, 4), (4, 5))]",
        "test_matmul[((33, 65), (65, 17))]", "test_matmul_odd_sizes[((1, 513), (513, 129))]")],
    [f"{OPS}::{t}" for t in (
        "test_cast[float32-int32-vals0]", "test_cast[int32-float16-vals7]", "test_cast[uint8-int8-vals5]",
        "test_cast[float64-float32-vals11]", "test_float16_ops[sum-<lambda>--2-2]",
        "test_float16_ops[exp-<lambda>--4-4]", "test_bfloat16_ops[add-<lambda>]", "test_bfloat16_ops[max-<lambda>]",
        "test_int_overflow_wraps[int8-a1-b1-mul]", "test_int_overflow_wraps[uint32-a7-b7-sub]",
        "test_basic_indexing[[1:-1]]", "test_basic_indexing[[..., None]]", "test_big_sum_odd_size[1]",
        "test_big_softmax", "test_argmax_argmin[1-False]", "test_cat_and_stack")]
    + [f"{NN}::{t}" for t in ("test_conv[2d-groups-stride-dil]", "test_max_pool2d[{'kernel_size': (2, 2)}]",
                              "test_avg_pool2d[False-{'kernel_size': (3, 2), 'stride': (2, 1), 'padding': (1, 0)}]")]
    + [f"{IDX}::test_setitem_gradient"],
]

def run_on_cl(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "DEV": "CL", "PYTEST_XDIST_AUTO_NUM_WORKERS": "1"})

def check_all_passed(res: subprocess.CompletedProcess) -> int:
    """The number of tests that passed; fails unless every selected test passed (none skipped)."""
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert re.fullmatch(r"\d+ passed(, \d+ deselected)? in .*", tail), tail
    return int(tail.split()[0])

@pytest.mark.parametrize("half", [0, 1])
def test_op_subset_on_cl(half: int):
    assert check_all_passed(run_on_cl(SUBSET[half], timeout=600)) == len(SUBSET[half])

def test_cumsum_softmax_matmul_gather_pool_backward_on_cl():
    """One forward and backward pass on CL against torch: cumsum (its long rows blocked), softmax, matmul, a gather,
    a max pool."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((6, 300)).astype(np.float32), rng.standard_normal((300, 8)).astype(np.float32)
    img, idx = rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.integers(0, 300, (6, 4))
    tx, tw, timg = (Tensor(a, device="CL", requires_grad=True) for a in (x, w, img))
    cs = tx.cumsum(1)
    loss = (cs * 0.01).softmax(1).matmul(tw).sum() + tx.gather(1, Tensor(idx, device="CL")).square().sum() + \
        timg.max_pool2d(2).relu().sum()
    loss.backward()
    got = [t.numpy() for t in (cs, loss, tx.grad, tw.grad, timg.grad)]
    assert all(t.device == "CL" for t in (cs, loss, tx.grad))
    rx, rw, rimg = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, img))
    rcs = rx.cumsum(1)
    rloss = ((rcs * 0.01).softmax(1) @ rw).sum() + rx.gather(1, torch.tensor(idx)).square().sum() + \
        torch.nn.functional.max_pool2d(rimg, 2).relu().sum()
    rloss.backward()
    for g, r, name in zip(got, [rcs, rloss, rx.grad, rw.grad, rimg.grad], ["cumsum", "loss", "dx", "dw", "dimg"]):
        r = r.detach().numpy()
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(r).max())), err_msg=name)

@pytest.mark.slow
def test_all_of_test_ops_on_cl():
    """The whole of test_ops.py with CL as the default device."""
    check_all_passed(run_on_cl([OPS, "-m", "slow or not slow"], timeout=3000))
