"""Tensor-core operands staged through local memory (LTILE of a TC kernel's K loop, tc.py `stage_operands`): kernels
laid out for CUDA's mma.sync run on the PYTHON device, whose work-group emulation executes each WMMA for a whole warp
and checks every phase between barriers for races on local memory, against NumPy in float32: half, bfloat16 and TF32,
several warps per group and tiles per warp, a padded matmul, a batched one, a transposed operand, an unrolled K loop
and a convolution. The CUDA source of such kernels is compiled with NVRTC in test/renderer/test_cuda_render.py."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.codegen.opt import heuristic_gpu
from fusegrad.codegen.opt import tc
from fusegrad.codegen.opt.tc import ORDER_ONLY, tc_loops
from fusegrad.helpers import Context
from fusegrad.renderer import ProgramSpec
from fusegrad.runtime.ops_python import PythonProgram
from fusegrad.uop.ops import Ops, UOp
from test.codegen import test_tensor_cores
from test.codegen.test_tensor_cores import TC, _close, _data

# the PYTHON device as a GPU with CUDA's tensor cores (a fixture)
tc_python = test_tensor_cores.tc_python

def _ast(t: Tensor) -> UOp: return [si.ast for si in t.schedule() if si.ast.op is Ops.SINK][-1]

def _staged(p: ProgramSpec) -> bool:
    """Whether every fragment element of the kernel's WMMAs is read from local memory (one buffer holding both staged
    copies: filled between two barriers, or double-buffered, one barrier per block and the fragments' loads ordered
    after the next block's copies)."""
    wmmas = [u for u in p.uops if u.op is Ops.WMMA]
    # (an element is a load, or a lane of a load of a pair of neighbours)
    frags = [e.src[0] if e.op is Ops.GEP else e for w in wmmas for v in w.src[:2] for e in v.src]
    barriers = sorted(str(u.arg) for u in p.uops if u.op is Ops.BARRIER)
    return bool(wmmas) and all(e.op is Ops.LOAD and e.src[0].src[0].op is Ops.BARRIER for e in frags) and \
        sum(u.op is Ops.DEFINE_LOCAL for u in p.uops) == 1 and \
        barriers in ([["None", ORDER_ONLY], ["None", "None"]] if tc.DOUBLE_BUFFER else [["None", "None"]])

def _double_buffered(p: ProgramSpec) -> bool:
    return any(u.op is Ops.BARRIER and u.arg == ORDER_ONLY for u in p.uops)

def _pair_loads(p: ProgramSpec) -> list[int]:
    """How many elements each load of the kernel's fragments reads (2: a pair of neighbours along K)."""
    frags = [e for w in p.uops if w.op is Ops.WMMA for v in w.src[:2] for e in v.src]
    return sorted({(e.src[0] if e.op is Ops.GEP else e).dtype.count for e in frags})

def _run(p: ProgramSpec, out_shape: tuple[int, ...], *inputs: Tensor) -> np.ndarray:
    """The kernel run on the PYTHON device's emulation, its float32 output."""
    bufs = [memoryview(bytearray(4 * int(np.prod(out_shape))))]
    # (bfloat16 has no NumPy dtype: its bits)
    bufs += [memoryview(bytearray((t.bitcast(dtypes.uint16) if t.dtype.itemsize == 2 else t).numpy().tobytes()))
             for t in inputs]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims),
                                                   local_dims=tuple(p.local_dims))
    return np.frombuffer(bufs[0], np.float32).reshape(out_shape)

def _kernel(ast: UOp, ren, *after_tc: tuple[OptOps, int, int], first: Opt = TC) -> Kernel:
    """A kernel with `first` (TC) and then each (op, which TC loop: 0 M, 1 N, 2 K, amount) applied."""
    k = Kernel(ast, ren)
    k.apply_opt(first)
    for op, which, amt in after_tc:
        r = tc_loops(k)[which]
        assert r is not None
        k.apply_opt(Opt(op, k.loops.index(r), amt))
    return k

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_warps_and_tiles_read_staged_operands(tc_python, dt):
    """2x2 warps per group, 2 tiles per warp along M and 2 along N, K in blocks of 2 tiles (32): the group's 64 rows of
    A and 32 columns of B are copied per block and read by all four warps."""
    a, ta = _data((128, 96), dt, 0)
    b, tb = _data((96, 64), dt, 1)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    k = _kernel(ast, tc_python, (OptOps.UPCAST, 0, 2), (OptOps.UPCAST, 1, 2), (OptOps.LOCAL, 0, 2),
                (OptOps.LOCAL, 1, 2), (OptOps.LTILE, 2, 2))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert _staged(p) and p.local_dims == (32, 2, 2), p.local_dims
    # (both copies 16 bytes a load, along the rows of A and B in global memory; in local memory A's rows along K stay
    # innermost, m16n8k16's pairs along K one load, B's rows along N read an element at a time)
    assert _copy_loads(p) == [8] and _pair_loads(p) == [1, 2]
    _close(_run(p, (128, 64), ta, tb), a @ b, 1e-6)

def _copy_loads(p: ProgramSpec) -> list[int]:
    """How many elements each load of a global buffer reads (the staged copies' loads)."""
    return sorted({u.dtype.count for u in p.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and
                   u.src[0].src[0].op is Ops.DEFINE_GLOBAL})

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16])
def test_vector_copies_of_unaligned_views(tc_python, dt):
    """Views of A and B starting at odd elements, rows of odd lengths: the copies still read 8 elements a load (the
    CUDA renderer checks each address's alignment and falls back to one load per element) and land where the
    fragments read them."""
    big_a, _ = _data((130, 101), dt, 30)
    big_b, _ = _data((99, 75), dt, 31)
    ta = Tensor(big_a, device="PYTHON").cast(dt).realize()[1:129, 3:99]
    tb = Tensor(big_b, device="PYTHON").cast(dt).realize()[1:97, 5:69]
    a, b = big_a[1:129, 3:99], big_b[1:97, 5:69]
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    k = _kernel(ast, tc_python, (OptOps.UPCAST, 0, 2), (OptOps.LOCAL, 0, 2), (OptOps.LOCAL, 1, 2),
                (OptOps.LTILE, 2, 2))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert _staged(p) and _copy_loads(p) == [8], _copy_loads(p)
    got = np.zeros((128, 64), np.float32)
    bufs = [memoryview(bytearray(4 * got.size))]
    bufs += [memoryview(bytearray(Tensor(x, device="PYTHON").cast(dt).bitcast(dtypes.uint16).numpy().tobytes()))
             for x in (big_a, big_b)]
    PythonProgram(p.function_name, p.src.encode())(*bufs, global_dims=tuple(p.global_dims),
                                                   local_dims=tuple(p.local_dims))
    _close(np.frombuffer(bufs[0], np.float32).reshape(128, 64), a @ b, 1e-6)
    _close((ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)).numpy(), a @ b, 1e-6)

def test_vector_copies_give_the_bits_of_pairs(tc_python, monkeypatch):
    """VECTOR_COPY_BYTES=0 copies element by element, B in pairs along K (read as pairs): the same WMMAs in the same
    order as the vector copies, so the same bits."""
    a, ta = _data((64, 128), dtypes.float16, 32)
    b, tb = _data((128, 96), dtypes.float16, 33)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    opts = _kernel(ast, tc_python, (OptOps.UPCAST, 1, 2), (OptOps.LOCAL, 0, 2), (OptOps.LTILE, 2, 4)).applied_opts
    vec = get_program(ast, tc_python, opts=opts)
    monkeypatch.setattr(tc, "VECTOR_COPY_BYTES", 0)
    pairs = get_program(ast, tc_python, opts=opts)
    assert _copy_loads(vec) == [8] and _pair_loads(vec) == [1, 2]
    assert _copy_loads(pairs) == [1] and _pair_loads(pairs) == [2]
    got_vec, got_pairs = _run(vec, (64, 96), ta, tb), _run(pairs, (64, 96), ta, tb)
    _close(got_vec, a @ b, 1e-6)
    np.testing.assert_array_equal(got_vec, got_pairs)

def test_heuristic_stages_half_and_bfloat16(tc_python, monkeypatch):
    """The heuristic stages where K holds two blocks of TC_BLOCK_K; TC_STAGE=0 turns it off (the same result)."""
    a, ta = _data((32, 128), dtypes.bfloat16, 2)
    b, tb = _data((128, 48), dtypes.bfloat16, 3)
    out = lambda: ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)
    assert _staged(get_program(_ast(out()), tc_python))
    _close(out().numpy(), a @ b, 1e-6)
    h = lambda t: t.cast(dtypes.half)
    _close(h(ta).matmul(h(tb)).cast(dtypes.float32).numpy(), (a @ b).astype(np.float16).astype(np.float32), 1e-2)
    monkeypatch.setattr(heuristic_gpu, "TC_STAGE", 0)
    p = get_program(_ast(out()), tc_python)
    assert any(u.op is Ops.WMMA for u in p.uops) and not _staged(p)

def test_tf32_staged(tc_python):
    """TF32's m16n8k8: K in blocks of 4 tiles (32 floats), float32 rows padded by 4."""
    a, ta = _data((32, 64), dtypes.float32, 4)
    b, tb = _data((64, 32), dtypes.float32, 5)
    with Context(ALLOW_TF32=1):
        ast = _ast(ta @ tb)
        p = get_program(ast, tc_python)
        assert _staged(p) and any(o.op is OptOps.LTILE and o.arg == 4 for o in p.applied_opts), p.applied_opts
        assert _pair_loads(p) == [1]   # (m16n8k8's tf32 elements are 4 apart along K)
        _close(_run(p, (32, 32), ta, tb), a @ b, 2e-3)

def test_padded_matmul_staged(tc_python):
    """TC pads M 60 -> 64, N 30 -> 32, K 60 -> 64; the copies read the padding's zeros through its gates."""
    a, ta = _data((60, 60), dtypes.float16, 6)
    b, tb = _data((60, 30), dtypes.float16, 7)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    k = _kernel(ast, tc_python, (OptOps.LOCAL, 1, 2), (OptOps.LTILE, 2, 2), first=Opt(OptOps.TC, 0, (-1, 2, 1)))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert _staged(p)
    _close(_run(p, (60, 30), ta, tb), a @ b, 1e-6)

def test_batched_transposed_and_unrolled(tc_python):
    """A batched matmul whose A is read transposed (its copy contiguous along M), with K unrolled inside the block;
    the batch is a loop of work-items too (LOCAL), so the copies hold both matrices."""
    a, ta = _data((2, 128, 32), dtypes.float16, 8)
    b, tb = _data((2, 128, 16), dtypes.float16, 9)
    ast = _ast(ta.cast(dtypes.float32).transpose(1, 2) @ tb.cast(dtypes.float32))
    k = Kernel(ast, tc_python)
    k.apply_opt(TC)
    k.apply_opt(Opt(OptOps.LOCAL, 0, 2))   # (the batch)
    for op, which, amt in ((OptOps.UNROLL, 2, 2), (OptOps.LTILE, 2, 2)):
        k.apply_opt(Opt(op, k.loops.index(tc_loops(k)[which]), amt))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert _staged(p) and p.local_dims == (32, 2)
    # (A, read along M, isn't copied in vectors (its fragments' pairs stay along K), so neither is B: both copied
    # element by element, in pairs along K, single-buffered)
    assert _copy_loads(p) == [1] and _pair_loads(p) == [2] and not _double_buffered(p)
    _close(_run(p, (2, 32, 16), ta, tb), a.transpose(0, 2, 1) @ b, 1e-6)

def test_convolution_staged(tc_python):
    """A padded 3x3 convolution on tensor cores (K its 64 input channels, in blocks of 32), with a bias and relu: the
    copies hold each block's window of the image, the padding's gated loads giving zeros."""
    x, tx = _data((1, 64, 8, 8), dtypes.float16, 10)
    w, tw = _data((16, 64, 3, 3), dtypes.float16, 11)
    bias, tbias = _data((16,), dtypes.float32, 12)
    out = lambda: tx.cast(dtypes.float32).conv2d(tw.cast(dtypes.float32), tbias, padding=1).relu()
    want = Tensor(x).conv2d(Tensor(w), Tensor(bias), padding=1).relu().numpy()
    p = get_program(_ast(out()), tc_python)
    assert _staged(p), p.applied_opts
    _close(out().numpy(), want, 1e-6)

def test_ltile_after_tc_is_refused_where_it_cannot_stage(tc_python):
    """LTILE after TC stages TC's K loop once; a PADTO of an output loop after it is refused, and LTILE after such a
    PADTO (its gates are the AST's, the copy's coordinates don't have them)."""
    a, ta = _data((48, 64), dtypes.float16, 13)
    b, tb = _data((64, 32), dtypes.float16, 14)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    k = _kernel(ast, tc_python)
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.LTILE, k.loops.index(tc_loops(k)[2]), 1))
    k.apply_opt(Opt(OptOps.LTILE, k.loops.index(tc_loops(k)[2]), 2))
    with pytest.raises(KernelOptError, match="PADTO after the LTILE"): k.apply_opt(Opt(OptOps.PADTO, 0, 4))
    k = _kernel(ast, tc_python, (OptOps.LTILE, 2, 2))
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.LTILE, k.first_reduce + 1, 2))
    k = _kernel(ast, tc_python)
    k.apply_opt(Opt(OptOps.PADTO, k.loops.index(tc_loops(k)[0]), 2))
    with pytest.raises(KernelOptError, match="not after a PADTO"):
        k.apply_opt(Opt(OptOps.LTILE, k.loops.index(tc_loops(k)[2]), 2))

def test_beam_offers_staging_after_tc(tc_python):
    """BEAM's actions after TC include LTILE of its K loop (blocks of 2, 4 and 8 tiles that K divides), once."""
    from fusegrad.codegen.opt.search import candidate_actions
    _, ta = _data((32, 128), dtypes.float16, 15)
    _, tb = _data((128, 32), dtypes.float16, 16)
    k = _kernel(_ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32)), tc_python)
    kloop = k.loops.index(tc_loops(k)[2])
    assert [a for a in candidate_actions(k) if a.op is OptOps.LTILE] == [Opt(OptOps.LTILE, kloop, 2),
                                                                           Opt(OptOps.LTILE, kloop, 4)]
    k.apply_opt(Opt(OptOps.LTILE, kloop, 4))
    assert not any(a.op is OptOps.LTILE for a in candidate_actions(k))

def test_more_work_items_than_elements_to_copy(tc_python):
    """8 warps along M share one tile of B's columns: the block of B holds 128 pairs for 256 work-items, so half of
    them copy nothing (their loads and stores gated off)."""
    a, ta = _data((128, 64), dtypes.float16, 17)
    b, tb = _data((64, 8), dtypes.float16, 18)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    k = _kernel(ast, tc_python, (OptOps.LOCAL, 0, 8), (OptOps.LTILE, 2, 2))
    p = get_program(ast, tc_python, opts=k.applied_opts)
    assert _staged(p) and p.local_dims == (32, 8), p.local_dims
    _close(_run(p, (128, 8), ta, tb), a @ b, 1e-6)

@pytest.mark.parametrize("shape, warps_m", [((64, 96, 48), 1), ((128, 160, 8), 8)])
def test_double_buffered_copies(tc_python, monkeypatch, shape, warps_m):
    """DOUBLE_BUFFER: two buffers of the copies in one local array, block 0 copied before the loop, one barrier per
    block, block i+1 copied (its loads and stores gated off in the last iteration) before the fragments of block i are
    read (ordered, not waited for); an odd number of blocks (3, 5), and 8 warps sharing one tile of B (half the
    work-items copying nothing). On the emulation, which checks every phase between barriers for races, equal to
    NumPy and to the single-buffered kernel's bits (the same WMMAs in the same order)."""
    m, kk, n = shape
    a, ta = _data((m, kk), dtypes.float16, 34)
    b, tb = _data((kk, n), dtypes.float16, 35)
    ast = _ast(ta.cast(dtypes.float32) @ tb.cast(dtypes.float32))
    opts = _kernel(ast, tc_python, (OptOps.LOCAL, 0, warps_m), (OptOps.LTILE, 2, 2)).applied_opts
    double = get_program(ast, tc_python, opts=opts)
    monkeypatch.setattr(tc, "DOUBLE_BUFFER", 0)
    single = get_program(ast, tc_python, opts=opts)
    monkeypatch.setattr(tc, "DOUBLE_BUFFER", 1)
    sizes = [u.dtype.size for p in (double, single) for u in p.uops if u.op is Ops.DEFINE_LOCAL]
    assert sizes[0] == 2 * sizes[1], sizes
    order = next(u for u in double.uops if u.op is Ops.BARRIER and u.arg == ORDER_ONLY)
    # (the next block's copies, gated by the block loop's bound, before the fragments' loads)
    ahead = [u for u in double.uops if u.op is Ops.STORE and u in order.toposort()
             and u.src[0].src[0] is not order and len(u.src[0].src) > 2]
    assert ahead and double.uops.index(order) > max(double.uops.index(u) for u in ahead)
    assert _staged(double) and [u.op for u in single.uops].count(Ops.BARRIER) == 2
    got = _run(double, (m, n), ta, tb)
    _close(got, a @ b, 1e-6)
    np.testing.assert_array_equal(got, _run(single, (m, n), ta, tb))

def _local_bytes(p: ProgramSpec) -> int:
    return sum(u.dtype.size * u.dtype.base.itemsize for u in p.uops if u.op is Ops.DEFINE_LOCAL)

def test_heuristic_blocks_and_buffers_by_the_copies(tc_python):
    """With a GPU's opt-in shared memory (227 KiB), the heuristic stages a half matmul's operands, copied 16 bytes a
    load, in blocks of TC_BLOCK_K bytes (64 halves), double-buffered above the static 48 KiB; a ResNet 3x3
    convolution, whose image is read through its padding's gates (copied element by element), stays within
    TC_STATIC_LOCAL, single-buffered, or unstaged."""
    from fusegrad.renderer.cuda import CUDARenderer
    big = CUDARenderer("sm_90", local_bytes=227 * 1024)
    h = lambda *shape: Tensor.empty(*shape, dtype=dtypes.half, device="PYTHON")
    mm = get_program(_ast(h(1024, 1024) @ h(1024, 1024)), big)
    ltile = next(o for o in mm.applied_opts if o.op is OptOps.LTILE)
    assert ltile.arg * 16 * 2 == heuristic_gpu.TC_BLOCK_K and _double_buffered(mm), mm.applied_opts
    assert _local_bytes(mm) > 48 * 1024 and _copy_loads(mm) == [8]
    with Context(IM2COL=0):   # (read in place: the form this checks)
        conv = get_program(_ast(h(32, 256, 14, 14).conv2d(h(256, 256, 3, 3), padding=1)), big)
    assert any(o.op is OptOps.TC for o in conv.applied_opts) and not _double_buffered(conv)
    assert _local_bytes(conv) <= heuristic_gpu.TC_STATIC_LOCAL, (conv.applied_opts, _local_bytes(conv))
    # (within 48 KiB the matmul's blocks are halved until two buffers fit)
    small = get_program(_ast(h(1024, 1024) @ h(1024, 1024)), CUDARenderer("sm_90"))
    assert _double_buffered(small) and _local_bytes(small) <= 48 * 1024
    assert next(o for o in small.applied_opts if o.op is OptOps.LTILE).arg == ltile.arg // 2
