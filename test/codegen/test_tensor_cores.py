"""Tensor cores (the TC opt, the WMMA UOp): matmuls and a convolution laid out for CUDA's mma.sync and run on the
PYTHON device, whose work-group emulation executes a WMMA for a whole warp (its lanes' fragments gathered per the
instruction's layout), against NumPy in float32: half, bfloat16 and TF32 (ALLOW_TF32=1), a batched matmul, a
convolution, a padded matmul. The lane layouts themselves are checked against the PTX ISA's fragment tables, written
out here independently (the emulation and the code generator share the layout, so only that catches a wrong one).
The CUDA source of these kernels is compiled with NVRTC in test/renderer/test_cuda_render.py."""
from __future__ import annotations
import math
from typing import Callable
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Device, Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.codegen.opt.search import candidate_actions, opts_from_json, opts_to_json
from fusegrad.dtype import DType
from fusegrad.engine import realize
from fusegrad.helpers import Context
from fusegrad.renderer import ProgramSpec, TensorCore
from fusegrad.renderer.cuda import CUDA_TENSOR_CORES, CUDA_TF32_TENSOR_CORES, CUDARenderer
from fusegrad.renderer.python import PythonRenderer
from fusegrad.uop.ops import Ops, UOp

TC = Opt(OptOps.TC, 0, (-1, 0, 1))

@pytest.fixture
def tc_python(monkeypatch) -> PythonRenderer:
    """The PYTHON device as a GPU with the CUDA renderer's tensor cores (and its kernels compiled afresh)."""
    ren = PythonRenderer(like=CUDARenderer("sm_80"))
    monkeypatch.setattr(Device["PYTHON"], "renderer", ren)
    monkeypatch.setattr(realize, "method_cache", {})
    return ren

def _data(shape: tuple[int, ...], dt: DType, seed: int) -> tuple[np.ndarray, Tensor]:
    """Values exact in `dt` (as float32 for NumPy) and a PYTHON Tensor of them."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    t = Tensor(x, device="PYTHON").cast(dt).realize()
    return t.cast(dtypes.float32).numpy(), t

def _programs(t: Tensor, ren) -> list[ProgramSpec]:
    return [get_program(si.ast, ren) for si in t.schedule() if si.ast.op is Ops.SINK]

def _wmmas(p: ProgramSpec) -> list[UOp]: return [u for u in p.uops if u.op is Ops.WMMA]

def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Equal within `rtol` of the largest value (a sum's rounding errors scale with its terms, not its result)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())

def _check_tc(make: Callable[[], Tensor], want: np.ndarray, ren, instr: str, rtol: float) -> None:
    """The Tensor that `make` makes is computed by a kernel with `instr` WMMAs, equal to `want` within rtol of its
    largest value."""
    _close(make().cast(dtypes.float32).numpy(), want, rtol)
    progs = _programs(make(), ren)
    tc = [p for p in progs if _wmmas(p)]
    assert len(tc) == 1 and all(u.arg[0] == instr for u in _wmmas(tc[0])), [p.applied_opts for p in progs]
    assert tc[0].applied_opts[0].op is OptOps.TC and tc[0].local_dims[0] % 32 == 0

# *** through the heuristic, on the emulated warp ***

@pytest.mark.parametrize("dt,instr", [(dtypes.float16, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"),
                                      (dtypes.bfloat16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")])
def test_16bit_matmul(tc_python, dt, instr):
    """A 32x48 @ 48x32 matmul: 2x2 tiles per warp, the K loop unrolled; the sum of exact products in float32, then
    rounded to the output dtype."""
    a, ta = _data((32, 48), dt, 0)
    b, tb = _data((48, 32), dt, 1)
    _check_tc(lambda: ta @ tb, a @ b, tc_python, instr, 1e-2)
    _check_tc(lambda: ta.cast(dtypes.float32) @ tb.cast(dtypes.float32), a @ b, tc_python, instr, 1e-6)

def test_tf32_matmul_only_when_allowed(tc_python):
    a, ta = _data((16, 32), dtypes.float32, 2)
    b, tb = _data((32, 16), dtypes.float32, 3)
    assert not any(_wmmas(p) for p in _programs(ta @ tb, tc_python))
    with Context(ALLOW_TF32=1):
        # (TF32 keeps 10 bits of each input's significand)
        _check_tc(lambda: ta @ tb, a @ b, tc_python, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", 2e-3)

def test_batched_matmul_with_an_epilogue(tc_python):
    """Two matmuls of a batch, each with a bias along N and a relu after the sum."""
    a, ta = _data((2, 16, 32), dtypes.float16, 4)
    b, tb = _data((2, 32, 24), dtypes.float16, 5)
    bias, tbias = _data((24,), dtypes.float32, 6)
    out = lambda: ((ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)) + tbias).relu()
    _check_tc(out, np.maximum(a @ b + bias, 0), tc_python, CUDA_TENSOR_CORES[0].name, 1e-6)

def test_convolution(tc_python):
    """A padded 3x3 half convolution with a bias and relu: M its output pixels, N its output channels, K its input
    channels; the padding's gated loads give the tensor core zeros."""
    x, tx = _data((1, 16, 16, 16), dtypes.float16, 7)
    w, tw = _data((8, 16, 3, 3), dtypes.float16, 8)
    bias, tbias = _data((8,), dtypes.float32, 15)
    out = lambda: tx.cast(dtypes.float32).conv2d(tw.cast(dtypes.float32), tbias, padding=1).relu()
    want = Tensor(x).conv2d(Tensor(w), Tensor(bias), padding=1).relu().numpy()
    _check_tc(out, want, tc_python, CUDA_TENSOR_CORES[0].name, 1e-6)

def test_convolution_pads_its_row_of_pixels(tc_python):
    """A 3x3 convolution over rows of 14 pixels: the tile's 16 rows are a row of pixels padded to 16 (its padded
    pixels read and store nothing), not the batch's images."""
    x, tx = _data((16, 16, 14, 14), dtypes.float16, 9)
    w, tw = _data((8, 16, 3, 3), dtypes.float16, 10)
    out = lambda: tx.cast(dtypes.float32).conv2d(tw.cast(dtypes.float32), padding=1)
    _check_tc(out, Tensor(x).conv2d(Tensor(w), padding=1).numpy(), tc_python, CUDA_TENSOR_CORES[0].name, 1e-6)
    tc = next(p for p in _programs(out(), tc_python) if _wmmas(p))
    assert any(o.op is OptOps.TC and o.arg[1] == 2 for o in tc.applied_opts), tc.applied_opts

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("bs,cin,cout,k,side,stride,pad,dil,bias", [
    (2, 16, 16, 3, 6, 1, 1, 1, False), (2, 16, 32, 1, 6, 1, 0, 1, True), (2, 8, 16, 3, 7, 2, 1, 1, True),
    (1, 16, 16, 3, 8, 1, 2, 2, False), (8, 3, 16, 5, 9, 2, 2, 1, False)])
def test_small_image_convolution_as_a_matmul(tc_python, dt, bs, cin, cout, k, side, stride, pad, dil, bias):
    """A 16-bit convolution of small images (IM2COL): its windows copied into a (cin * k * k) x (bs * pixels)
    matrix, the weights times it on the tensor cores, the result laid out as (bs, cout, *pixels): torch's values,
    every padding, stride and dilation; IM2COL=0 computes it in one kernel reading the windows in place."""
    x, tx = _data((bs, cin, side, side), dt, 20)
    w, tw = _data((cout, cin, k, k), dt, 21)
    b, tb = _data((cout,), dt, 22)
    want = F.conv2d(torch.tensor(x), torch.tensor(w), torch.tensor(b) if bias else None, stride=stride, padding=pad,
                    dilation=dil).numpy()
    out = lambda: tx.conv2d(tw, tb if bias else None, stride=stride, padding=pad, dilation=dil)
    for im2col, kernels in ((1, 3), (0, 1)):
        with Context(IM2COL=im2col):
            _close(out().cast(dtypes.float32).numpy(), want, 1e-2)
            progs = _programs(out(), tc_python)
            assert len(progs) == kernels, [p.name for p in progs]
            assert not im2col or len([p for p in progs if _wmmas(p)]) == 1, [p.name for p in progs]

@pytest.mark.parametrize("xs,ws,kw", [((4, 16, 20), (16, 16, 3), dict(padding=1)),
                                      ((2, 8, 9), (16, 8, 3), dict(stride=2, dilation=2)),
                                      ((2, 8, 4, 5, 6), (16, 8, 3, 3, 3), dict(padding=1))])
def test_im2col_convolutions_of_one_and_three_dims(tc_python, xs, ws, kw):
    """conv2d's windows copied into a matrix for any number of spatial dims: torch's conv1d and conv3d."""
    x, tx = _data(xs, dtypes.float16, 27)
    w, tw = _data(ws, dtypes.float16, 28)
    want = (F.conv1d if len(xs) == 3 else F.conv3d)(torch.tensor(x), torch.tensor(w), **kw).numpy()
    with Context(IM2COL=1):
        _close(tx.conv2d(tw, **kw).cast(dtypes.float32).numpy(), want, 1e-2)
        assert len(_programs(tx.conv2d(tw, **kw), tc_python)) == 3

def test_large_image_convolution_reads_windows_in_place(tc_python):
    """Past IM2COL_MAX_PIXELS output pixels an image (a row of them fills a tensor-core tile) and in float32 a
    convolution stays one kernel."""
    from fusegrad.tensor.nn import IM2COL_MAX_PIXELS
    side = math.isqrt(IM2COL_MAX_PIXELS) + 1
    _, tx = _data((1, 8, side, side), dtypes.float16, 23)
    _, tw = _data((16, 8, 3, 3), dtypes.float16, 24)
    assert len(_programs(tx[:, :, :side - 1, :side - 1].conv2d(tw, padding=1), tc_python)) == 3  # (at the bound)
    assert len(_programs(tx.conv2d(tw, padding=1), tc_python)) == 1
    assert len(_programs(tx[:, :, :8, :8].cast(dtypes.float32).conv2d(tw.cast(dtypes.float32)), tc_python)) == 1

def test_cast_of_a_contiguous_copy_is_read_where_it_is_used(tc_python):
    """A conversion of a value that gets a buffer anyway (a contiguous copy) costs no more to compute where a
    broadcast reads it than a conversion of any buffer: the half copy is what a matmul's tensor cores read, not a
    float32 copy of it."""
    _, ta = _data((4, 16, 4, 4), dtypes.float16, 25)
    _, tw = _data((8, 16), dtypes.float16, 26)
    out = ta.permute(0, 2, 3, 1).contiguous().reshape(64, 16) @ tw.T
    sched = [si for si in out.schedule() if si.ast.op is Ops.SINK]
    assert len(sched) == 2 and all(b.dtype == dtypes.float16 for si in sched for b in si.bufs), sched

def test_long_half_matmul_keeps_its_half_inputs(tc_python):
    """A half matmul with K >= 256 converts an input to float32 first where there are no tensor cores (a CPU reads
    it converted once); on a device with tensor cores it stays one kernel that gives them the half values."""
    a, ta = _data((16, 256), dtypes.float16, 13)
    b, tb = _data((256, 16), dtypes.float16, 14)
    # (x converted, then the product; the other input, a copy, is converted as it is loaded)
    assert len([si for si in (ta.to("CPU") @ tb.to("CPU")).schedule() if si.ast.op is Ops.SINK]) == 2
    assert len([si for si in (ta @ tb).schedule() if si.ast.op is Ops.SINK]) == 1
    _check_tc(lambda: ta @ tb, a @ b, tc_python, CUDA_TENSOR_CORES[0].name, 1e-2)

def test_padded_matmul(tc_python):
    """PADTO first: 24 rows are padded to 32 for the tile of 16 (the padded rows are neither read nor stored)."""
    a, ta = _data((24, 16), dtypes.float16, 9)
    b, tb = _data((16, 8), dtypes.float16, 10)
    out = ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)
    ast = [si.ast for si in out.schedule() if si.ast.op is Ops.SINK][-1]
    with pytest.raises(KernelOptError, match="multiples of the tile"): get_program(ast, tc_python, opts=[TC])
    p = get_program(ast, tc_python, opts=[Opt(OptOps.PADTO, 0, 16), TC])
    assert _wmmas(p)
    from fusegrad.runtime.ops_python import PythonProgram
    bufs = [memoryview(bytearray(24 * 8 * 4)), memoryview(bytearray(ta.numpy().tobytes())),
            memoryview(bytearray(tb.numpy().tobytes()))]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims),
                                                   local_dims=tuple(p.local_dims))
    _close(np.frombuffer(bufs[0], np.float32).reshape(24, 8), a @ b, 1e-6)

def test_tc_pads_what_the_tile_does_not_divide(tc_python):
    """TC with tc_opt 2 pads M 60 -> 64, N 30 -> 32 and K 40 -> 48 (the padded K contributes zeros); the heuristic
    doesn't (K's padding would waste more than an eighth), BEAM may."""
    a, ta = _data((60, 40), dtypes.float16, 16)
    b, tb = _data((40, 30), dtypes.float16, 17)
    out = ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)
    ast = [si.ast for si in out.schedule() if si.ast.op is Ops.SINK][-1]
    assert not _wmmas(get_program(ast, tc_python))
    k = Kernel(ast, tc_python)
    assert Opt(OptOps.TC, 0, (-1, 2, 1)) in candidate_actions(k)
    k.apply_opt(Opt(OptOps.TC, 0, (-1, 2, 1)))
    assert k.useful == pytest.approx(60 * 30 * 40 / (64 * 32 * 48))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    from fusegrad.runtime.ops_python import PythonProgram
    bufs = [memoryview(bytearray(60 * 30 * 4)), memoryview(bytearray(ta.numpy().tobytes())),
            memoryview(bytearray(tb.numpy().tobytes()))]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims),
                                                   local_dims=tuple(p.local_dims))
    _close(np.frombuffer(bufs[0], np.float32).reshape(60, 30), a @ b, 1e-6)

def test_warps_of_a_group_and_unrolled_k(tc_python):
    """Opts after TC: 2 warps per group along N (LOCAL), 2 tiles per warp along M (UPCAST), K unrolled by 2: each
    warp's WMMAs use its own lanes."""
    a, ta = _data((32, 64), dtypes.float16, 11)
    b, tb = _data((64, 16), dtypes.float16, 12)
    out = ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)
    ast = [si.ast for si in out.schedule() if si.ast.op is Ops.SINK][-1]
    k = Kernel(ast, tc_python)
    k.apply_opt(TC)
    from fusegrad.codegen.opt.tc import tc_loops
    rm, rn, rk = tc_loops(k)
    assert rm is not None and rn is not None and rk is not None
    k.apply_opt(Opt(OptOps.LOCAL, k.loops.index(rn), 2))
    k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(tc_loops(k)[0]), 2))
    k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(tc_loops(k)[2]), 2))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert p.local_dims == (32, 2) and len(_wmmas(p)) == 4
    from fusegrad.runtime.ops_python import PythonProgram
    bufs = [memoryview(bytearray(32 * 16 * 4)), memoryview(bytearray(ta.numpy().tobytes())),
            memoryview(bytearray(tb.numpy().tobytes()))]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims),
                                                   local_dims=tuple(p.local_dims))
    _close(np.frombuffer(bufs[0], np.float32).reshape(32, 16), a @ b, 1e-6)

# *** where TC doesn't apply ***

def _half_matmul_ast(m: int, k: int, n: int) -> UOp:
    a = Tensor.rand(m, k).realize().half().realize()
    b = Tensor.rand(k, n).realize().half().realize()
    return [si.ast for si in (a.cast(dtypes.float32) @ b.cast(dtypes.float32)).schedule() if si.ast.op is Ops.SINK][-1]

def test_tc_is_refused_where_it_does_not_apply():
    ast = _half_matmul_ast(32, 32, 16)
    with pytest.raises(KernelOptError, match="GPU-style"): Kernel(ast, Device["CPU"].renderer).apply_opt(TC)
    with pytest.raises(KernelOptError, match="no matmul-shaped"):   # (no tensor core of float32 without TF32)
        Kernel([si.ast for si in (Tensor.rand(32, 32) @ Tensor.rand(32, 16)).schedule()][-1],
               CUDARenderer()).apply_opt(TC)
    assert not CUDARenderer("sm_75").tensor_cores and not PythonRenderer(gpu=True).tensor_cores
    k = Kernel(ast, CUDARenderer())
    for bad in (Opt(OptOps.TC, 0, 1), Opt(OptOps.TC, 0, (-1, 0)), Opt(OptOps.TC, 0, (-1, 0, 2)),
                Opt(OptOps.TC, 0, (-1, 3, 1)),
                Opt(OptOps.TC, 0, (5, 0, 1)), Opt(OptOps.TC, 9, (-1, 0, 1)), Opt(OptOps.UPCAST, 0, (2,))):
        with pytest.raises(KernelOptError): k.apply_opt(bad)
    k.apply_opt(Opt(OptOps.UPCAST, 0, 2))
    with pytest.raises(KernelOptError, match="comes first"): k.apply_opt(TC)
    k = Kernel(ast, CUDARenderer())
    k.apply_opt(TC)
    assert k.applied_opts == [TC] and k.tc is not None
    with pytest.raises(KernelOptError, match="comes first"): k.apply_opt(TC)
    reduce_axis = k.first_reduce
    for bad in (Opt(OptOps.GROUP, reduce_axis, 2), Opt(OptOps.LTILE, reduce_axis, 1),
                Opt(OptOps.UPCAST, reduce_axis, 2)):
        with pytest.raises(KernelOptError): k.apply_opt(bad)
    assert k.applied_opts == [TC]
    # a sum that isn't of products of two loads: the sum of squares of a row
    x = Tensor.rand(32, 32).realize().half().realize().cast(dtypes.float32)
    ast = [si.ast for si in (x * x).sum(1).schedule() if si.ast.op is Ops.SINK][-1]
    with pytest.raises(KernelOptError, match="no matmul-shaped"): Kernel(ast, CUDARenderer()).apply_opt(TC)

def test_tc_ast_meets_the_spec():
    """With SPEC=1 the AST after TC is checked; a WMMA whose fragments aren't what its instruction takes breaks it."""
    from fusegrad.uop.spec import SpecError, kernel_spec, tensor_core_spec, verify
    k = Kernel(_half_matmul_ast(32, 32, 16), CUDARenderer())
    with Context(SPEC=1): k.apply_opt(TC)
    wmma = next(u for u in k.ast.toposort() if u.op is Ops.WMMA)
    a, b, c = wmma.src
    for bad in (wmma.replace(src=(b, a, c)), wmma.replace(src=(a, b)), wmma.replace(dtype=dtypes.float16.vec(4))):
        with pytest.raises(SpecError, match="WMMA"):
            verify(k.ast.substitute({wmma: bad}), tensor_core_spec + kernel_spec, "test")

def test_beam_actions_include_tc():
    """BEAM offers TC once per way it fits (here the product and its transpose), first only; its JSON round-trips."""
    k = Kernel(_half_matmul_ast(32, 32, 16), CUDARenderer())
    tcs = [a for a in candidate_actions(k) if a.op is OptOps.TC]
    assert tcs == [Opt(OptOps.TC, 0, (-1, 0, 1)), Opt(OptOps.TC, 1, (-1, 0, 1))]
    assert opts_from_json(opts_to_json(tcs)) == tcs
    with pytest.raises(ValueError): opts_from_json([["UPCAST", 0, [1, 2]]])
    k.apply_opt(tcs[1])
    assert not any(a.op is OptOps.TC for a in candidate_actions(k))

# *** the lane layouts, against the PTX ISA's fragment tables ***

def _ptx_m16n8k16(which: str, lane: int, i: int) -> tuple[int, int]:
    """The PTX ISA's "matrix fragments for mma.m16n8k16 with floating point type" (f16 and bf16)."""
    group, tig = lane >> 2, lane % 4
    if which == "A":   # a0..a7
        row = group if i in (0, 1, 4, 5) else group + 8
        return row, tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    if which == "B":   # b0..b3
        return tig * 2 + (i & 1) + (8 if i >= 2 else 0), group
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)   # c0..c3

def _ptx_m16n8k8_tf32(which: str, lane: int, i: int) -> tuple[int, int]:
    """The PTX ISA's "matrix fragments for mma.m16n8k8" with .tf32 A and B."""
    group, tig = lane >> 2, lane % 4
    if which == "A": return (group if i in (0, 2) else group + 8), (tig if i < 2 else tig + 4)
    if which == "B": return (tig if i == 0 else tig + 4), group
    return (group if i < 2 else group + 8), tig * 2 + (i & 1)

@pytest.mark.parametrize("tc", CUDA_TENSOR_CORES + CUDA_TF32_TENSOR_CORES, ids=lambda tc: tc.name)
def test_cuda_layouts_are_the_ptx_isa_tables(tc: TensorCore):
    ref = _ptx_m16n8k8_tf32 if tc.dims[2] == 8 else _ptx_m16n8k16
    for which, n in (("A", 8 if tc.dims[2] == 16 else 4), ("B", 4 if tc.dims[2] == 16 else 2), ("C", 4)):
        assert tc.elements(which) == n
        assert [tc.coords(which, lane, i) for lane in range(32) for i in range(n)] == \
            [ref(which, lane, i) for lane in range(32) for i in range(n)], which
    assert TensorCore.from_wmma_arg(tc.wmma_arg) == tc

def test_tensor_core_layouts_are_checked():
    """A layout that doesn't hold each element of an operand exactly once is refused."""
    good = CUDA_TENSOR_CORES[0]
    a, b, c = good.layout
    with pytest.raises(ValueError, match="A elements"):
        twice = (a[0], a[1], a[2][:-1] + (a[2][0],))   # (element 0 twice, element 7 never)
        TensorCore("x", (16, 8, 16), dtypes.float16, dtypes.float32, "CUDA", (twice, b, c))
    with pytest.raises(ValueError, match="one per bit"):
        TensorCore("x", (16, 8, 16), dtypes.float16, dtypes.float32, "CUDA", ((a[0][:4], a[1], a[2]), b, c))
    with pytest.raises(ValueError, match="for A, B and C"):
        TensorCore("x", (16, 8, 16), dtypes.float16, dtypes.float32, "CUDA", (a, b))

def test_python_renderer_declares_cuda_tensor_cores():
    """PythonRenderer(gpu=True, tensor_cores=True) (PYTHON_GPU=1 PYTHON_TC=1) declares CUDA's tensor cores, TF32's
    only while ALLOW_TF32 is set."""
    ren = PythonRenderer(gpu=True, tensor_cores=True)
    assert ren.has_local and ren.tensor_cores == CUDA_TENSOR_CORES
    with Context(ALLOW_TF32=1): assert ren.tensor_cores == CUDA_TENSOR_CORES + CUDA_TF32_TENSOR_CORES
    assert PythonRenderer(gpu=False, tensor_cores=True).tensor_cores == []

def test_emulated_wmma_needs_whole_warps(tc_python):
    """A WMMA in a group that isn't whole warps (its listing edited to a group of 16 work-items) is an error, not a
    wrong result."""
    p = get_program(_half_matmul_ast(16, 16, 8), tc_python, opts=[TC])
    from fusegrad.runtime.ops_python import PythonProgram
    bufs = [memoryview(bytearray(16 * 8 * 4)), memoryview(bytearray(16 * 16 * 2)), memoryview(bytearray(16 * 8 * 2))]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims), local_dims=(32,))
    lines = p.src.splitlines()
    special = next(ln for ln in lines if "| SPECIAL |" in ln and "'lidx0'" in ln)
    size = int(special.split(" | ")[3]) + 1   # (the listing's first line is its name)
    assert lines[size].endswith("| 32")
    lines[size] = lines[size][:-2] + "16"
    with pytest.raises(RuntimeError, match="whole warps of 32 work-items; the group has 16"):
        PythonProgram(p.function_name, "\n".join(lines).encode())(*bufs, global_dims=tuple(p.global_dims),
                                                                  local_dims=(16,))
