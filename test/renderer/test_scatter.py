"""A vector's lanes stored at offsets a constant apart (a convolution's output vectorized along its channels, each
channel a plane apart) are one AVX-512 scatter on machines that have it, unless other vectors' lanes are their
neighbours (pixels of a row upcast: those are stored in address order instead, codegen/store_order.py), and a vector
of lanes loaded at offsets a constant apart (its weights packed along the output channels) one gather: the values
against PyTorch, and the C written with a scatter and a gather where the CPU has AVX-512, and no store of a single
lane left where it scatters."""
import re
import numpy as np
import pytest
import torch
from fusegrad import Device, Tensor
from fusegrad.hostcpu import cpu

# (batch, input channels, output channels, image side): outputs of 32 and 48 channels whose 16-lane vectors run
# along the channels; (a shape no other test here uses: its kernel is generated, not taken from the method cache).
# The weights' rows (input channels x 3 x 3) are copied transposed in blocks of 16 where a row has 16 elements or more
# (codegen/opt PACK), and gathered where it has fewer (one input channel: 9). Sides of 7 have pixels of a row upcast
# (their lanes are neighbours: stored in address order, 4 + 2 + 1 of each channel's 7), sides of 5 one pixel (scattered)
@pytest.mark.parametrize("n,ci,co,side,gathers,scatters", [(2, 16, 32, 7, False, False), (1, 16, 48, 5, False, True),
                                                           (2, 1, 32, 7, True, False)])
def test_conv_output_along_channels(compiled_sources, n, ci, co, side, gathers, scatters):
    rng = np.random.default_rng(ci + co + side)
    x, w = rng.standard_normal((n, ci, side, side)).astype(np.float32), rng.standard_normal((co, ci, 3, 3))
    w = w.astype(np.float32)
    # (on the CPU device: its C is what the assertions read, whatever the default device)
    got = Tensor(x, device="CPU").conv2d(Tensor(w, device="CPU"), padding=1).relu().numpy()
    want = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).relu().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    src = "\n".join(compiled_sources)
    if "avx512f" in cpu().features and Device["CPU"].renderer.simd_bytes == 64:
        assert ("fg_scatter_f32x16(data0" in src) == scatters and ("fg_gather_f32x16(data" in src) == gathers, src
        assert ("fg_transpose_f32x16(" in src) != gathers, src
        if scatters: assert not re.search(r"\] = \w+\[\d+\];", src), src
        else: assert re.search(r"\(\*\(\(f32x4\*\)\(data0\+.*= \(\(f32x4\)\{\w+\[0\], ", src), src

def test_other_dialects_access_lanes_one_by_one():
    from fusegrad.renderer.opencl import OpenCLRenderer
    from fusegrad.renderer.cuda import CUDARenderer
    from fusegrad.dtype import dtypes
    for renderer in (OpenCLRenderer, CUDARenderer):
        r = renderer.__new__(renderer)
        assert not r.strided_lanes
        assert r._scatter(dtypes.float32.vec(16)) is None and r._gather(dtypes.float32.vec(16)) is None

def _lane_stores(read_between: bool) -> str:
    """The C of a kernel storing the 16 lanes of a vector 4 elements apart, lane by lane (a NOOP groups the stores),
    with or without a load of the same buffer between the fifth and sixth stores."""
    from fusegrad.dtype import dtypes
    from fusegrad.renderer.cstyle import ClangRenderer
    from fusegrad.uop.ops import Ops, UOp
    out, other = UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(64), arg=0), UOp(Ops.DEFINE_GLOBAL, dtypes.float32.ptr(4),
                                                                             arg=1)
    n = UOp.const(dtypes.index, 4)
    r = UOp(Ops.RANGE, dtypes.index, (n,), (0, "global"))
    lanes = [UOp.const(dtypes.float32, float(i)) for i in range(16)]
    v = UOp(Ops.VECTORIZE, dtypes.float32.vec(16), tuple(lanes))
    uops, stores = [out, other, n, *lanes, r, v], []
    for i in range(16):
        off = r if i == 0 else UOp(Ops.ADD, dtypes.index, (r, UOp.const(dtypes.index, 4 * i)))
        idx = UOp(Ops.INDEX, dtypes.float32.ptr(64), (out, off))
        gep = UOp(Ops.GEP, dtypes.float32, (v,), i)
        stores.append(UOp(Ops.STORE, dtypes.void, (idx, gep)))
        uops += ([] if i == 0 else [off.src[1], off]) + [idx, gep, stores[-1]]
        if read_between and i == 5:
            ld = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, dtypes.float32.ptr(64), (out, r)),))
            uops += [ld.src[0], ld, UOp(Ops.INDEX, dtypes.float32.ptr(4), (other, r))]
            uops.append(UOp(Ops.STORE, dtypes.void, (uops[-1], ld)))
    uops += [UOp(Ops.NOOP, dtypes.void, tuple(stores)), UOp(Ops.END, dtypes.void, (r,))]
    return ClangRenderer().render(uops, "lanes")

def test_lane_stores_stay_apart_where_a_load_of_the_buffer_comes_between():
    from fusegrad.renderer.cstyle import ClangRenderer
    apart = _lane_stores(read_between=True)
    assert "fg_scatter" not in apart and apart.count("data0[") == 17, apart   # (16 stores and the load)
    together = _lane_stores(read_between=False)
    if ClangRenderer().strided_lanes:
        assert "fg_scatter_f32x16(data0+ridx0, ((i32x16){0, 4, 8, 12, " in together, together
        assert "data0[" not in together, together
    else: assert together.count("data0[") == 16, together
