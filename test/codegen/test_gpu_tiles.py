"""Matmuls tiled through local memory (LTILE): the work-items of a group copy the blocks of A and B that they share
between two barriers and read the copies. Run on CL (PoCL, told that its local memory is fast, which a GPU's is) and
on the PYTHON device's work-group emulation, which fails on a missing or misplaced barrier; against numpy."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Device, Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import OptOps
from fusegrad.renderer.python import PythonRenderer
from fusegrad.uop.ops import Ops

def _matmul(device: str, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, list]:
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    ta, tb = Tensor(a, device=device).realize(), Tensor(b, device=device).realize()
    got = (ta @ tb).numpy()
    progs = [get_program(si.ast, Device[device].renderer) for si in (ta @ tb).schedule() if si.ast.op is Ops.SINK]
    return got, a.astype(np.float64) @ b.astype(np.float64), progs

@pytest.fixture
def cl_fast_local(monkeypatch):
    monkeypatch.setattr(Device["CL"].renderer, "fast_local_memory", True)

@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (17, 33, 65), (96, 80, 112)])
def test_cl_matmul_tiled_through_local_memory(cl_fast_local, m, k, n):
    got, want, progs = _matmul("CL", m, k, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    if m * n >= 4096:   # (fewer outputs have their reduction split across a group instead)
        p = progs[-1]
        assert any(o.op is OptOps.LTILE for o in p.applied_opts), p.applied_opts
        assert sum(u.op is Ops.BARRIER for u in p.uops) >= 2 and any(u.op is Ops.DEFINE_LOCAL for u in p.uops)

@pytest.mark.slow
@pytest.mark.parametrize("m,k,n", [(1000, 1000, 1000), (1023, 1023, 1023)])
def test_cl_big_matmul_tiled_through_local_memory(cl_fast_local, m, k, n):
    got, want, progs = _matmul("CL", m, k, n)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert any(o.op is OptOps.LTILE for o in progs[-1].applied_opts)

def test_python_emulation_checks_the_tile_barriers(monkeypatch):
    """The PYTHON device as a GPU runs the tiled kernel with its race checks on (a read of a block another work-item
    is still copying, or a copy over a block another is still reading, raises)."""
    monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(gpu=True))
    got, want, progs = _matmul("PYTHON", 64, 48, 64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert any(o.op is OptOps.LTILE for o in progs[-1].applied_opts)

def test_ltile_is_refused_where_it_does_not_apply():
    """No LTILE on a CPU renderer, on an output loop, or by an amount that doesn't divide the loop."""
    from fusegrad.codegen.opt import Kernel, KernelOptError, Opt
    a, b = Tensor.rand(32, 64).realize(), Tensor.rand(64, 32).realize()
    ast = [si.ast for si in (a @ b).schedule() if si.ast.op is Ops.SINK][-1]
    cpu = Kernel(ast, Device["CPU"].renderer)
    with pytest.raises(KernelOptError, match="GPU-style"): cpu.apply_opt(Opt(OptOps.LTILE, 2, 16))
    k = Kernel(ast, PythonRenderer(gpu=True))
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.LTILE, 0, 16))
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.LTILE, 2, 7))

@pytest.mark.parametrize("device", ["CL", "PYTHON"])
def test_convolution_tiled_through_local_memory(device, cl_fast_local, monkeypatch):
    """A 3x3 convolution stages its input channels in blocks (the window's loops run inside each block); on PYTHON
    with the race checks on."""
    if device == "PYTHON": monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(gpu=True))
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 32, 4, 4)).astype(np.float32), rng.standard_normal((16, 32, 3, 3)).astype(np.float32)
    tx, tw = Tensor(x, device=device).realize(), Tensor(w, device=device).realize()
    got = tx.conv2d(tw, padding=1).numpy()
    want = Tensor(x).conv2d(Tensor(w), padding=1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    p = [get_program(si.ast, Device[device].renderer) for si in tx.conv2d(tw, padding=1).schedule()
         if si.ast.op is Ops.SINK][-1]
    assert any(o.op is OptOps.LTILE for o in p.applied_opts), p.applied_opts

@pytest.mark.parametrize("m,k,n", [(64, 48, 64), (96, 80, 112), (128, 64, 96)])
def test_staged_blocks_share_one_buffer_of_the_size_counted(m, k, n):
    """A matmul's staged blocks of A and B share one local buffer, each region starting at a multiple of 16 bytes, and
    the optimizer's count of local memory (what it checks against the renderer's limit) is that buffer's size."""
    from fusegrad.codegen.opt import Kernel
    from fusegrad.codegen.opt.heuristic_gpu import gpu_optimizations
    ren = PythonRenderer(gpu=True)
    a, b = Tensor.empty(m, k), Tensor.empty(k, n)
    ast = [si.ast for si in (a @ b).schedule() if si.ast.op is Ops.SINK][-1]
    kern = Kernel(ast, ren)
    gpu_optimizations(kern)
    assert any(o.op is OptOps.LTILE for o in kern.applied_opts), kern.applied_opts
    locals_ = [u for u in kern.get_optimized_ast().toposort() if u.op is Ops.DEFINE_LOCAL]
    assert len(locals_) == 1
    assert locals_[0].dtype.size * locals_[0].dtype.base.itemsize == kern.local_memory()
