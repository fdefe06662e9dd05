"""Transposing copies run in tiles copied through L1 (a PACK of the strided load): results against numpy, and the
kernel's structure (which shapes are tiled, which aren't)."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import OptOps
from fusegrad.device import Device
from fusegrad.dtype import to_np_dtype
from fusegrad.uop.ops import Ops

RS = np.random.RandomState(7)

def kernel_of(t: Tensor):
    """The compiled program of the last kernel that computes `t` (which then points at buffers nothing has filled)."""
    (si,) = [si for si in t.schedule() if si.ast.op is Ops.SINK][-1:]
    return get_program(si.ast, Device["CPU"].renderer)

def values(shape: tuple[int, ...], dt) -> np.ndarray:
    if dt == dtypes.bool: return RS.rand(*shape) > 0.5
    if dtypes.is_float(dt): return RS.randn(*shape).astype(to_np_dtype(dt))
    return RS.randint(-100, 100, shape).astype(to_np_dtype(dt))

@pytest.mark.parametrize("shape,perm", [
    ((64, 64), (1, 0)), ((96, 160), (1, 0)), ((256, 64), (1, 0)),
    ((3, 64, 96), (0, 2, 1)),          # a batch of transposes
    ((2, 64, 3, 96), (0, 3, 2, 1)),    # a loop between the two transposed ones
    ((64, 5, 96), (2, 1, 0)),
    ((2, 12, 128, 64), (0, 1, 3, 2)),  # attention's k.transpose(-1, -2)
])
def test_transposed_copy(shape, perm):
    x = values(shape, dtypes.float32)
    np.testing.assert_array_equal(Tensor(x).permute(perm).contiguous().numpy(), x.transpose(perm))

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float64, dtypes.int8, dtypes.uint16,
                                dtypes.int64, dtypes.bool])
def test_transposed_copy_dtypes(dt):
    if dt == dtypes.bfloat16:
        # (numpy has no bfloat16: values that bfloat16 holds exactly, per torch, go in as float32 and are cast)
        x = torch.from_numpy(values((96, 64), dtypes.float32)).bfloat16().float().numpy()
        np.testing.assert_array_equal(Tensor(x).cast(dt).T.contiguous().float().numpy(), x.T)
        return
    x = values((96, 64), dt)
    np.testing.assert_array_equal(Tensor(x).T.contiguous().numpy(), x.T)

def test_transpose_fused_with_elementwise():
    # a transposed operand next to a contiguous one, with a cast: only the transposed load goes through the tile
    a, b = values((128, 96), dtypes.float16), values((96, 128), dtypes.float32)
    got = (Tensor(a).T.float() * 2 + Tensor(b)).numpy()
    np.testing.assert_allclose(got, a.T.astype(np.float32) * 2 + b, rtol=1e-6)
    # one buffer read both ways (the tile copy can't take it: the plain loop stays)
    c = values((96, 96), dtypes.float32)
    np.testing.assert_array_equal((Tensor(c) + Tensor(c).T).numpy(), c + c.T)

def test_transpose_of_uneven_sizes_is_still_right():
    # sizes that 32 doesn't divide keep the plain loop
    x = values((100, 70), dtypes.float32)
    assert OptOps.PACK not in {o.op for o in kernel_of(Tensor(x).T.contiguous()).applied_opts}
    np.testing.assert_array_equal(Tensor(x).T.contiguous().numpy(), x.T)

def test_big_transpose_is_tiled_through_a_local_copy():
    t = Tensor(values((256, 128), dtypes.float32)).realize().T.contiguous()
    p = kernel_of(t)
    assert OptOps.PACK in {o.op for o in p.applied_opts}, p.applied_opts
    local = [u for u in p.uops if u.op is Ops.DEFINE_LOCAL]
    assert len(local) == 1 and local[0].dtype.size == 32 * 32, "one 32x32 tile"

def test_small_or_contiguous_copies_are_not_tiled():
    # a slice of 32 columns fits L1 whole; a contiguous copy reads nothing strided
    for t in (Tensor(values((32, 256), dtypes.float32)).realize().T.contiguous(),
              (Tensor(values((256, 256), dtypes.float32)).realize() + 1)):
        assert OptOps.PACK not in {o.op for o in kernel_of(t).applied_opts}

def test_transpose_of_views():
    # gated loads (padding), offsets (a slice) and reversed strides (flip) go through the tile copy as they are
    x = values((96, 128), dtypes.float32)
    t = Tensor(x)
    for got, ref in ((t.pad(((16, 16), (0, 0))).T, np.pad(x, ((16, 16), (0, 0))).T),
                     (t.T.pad(((0, 0), (16, 16))), np.pad(x.T, ((0, 0), (16, 16)))),
                     (t[:64, 32:].T, x[:64, 32:].T), (t.flip(0).T, x[::-1].T), (t.flip(1).T * 2, x[:, ::-1].T * 2)):
        np.testing.assert_array_equal(got.contiguous().numpy(), ref)

def test_window_taps_merge_into_a_tiled_transpose():
    """3x3 convolution weights copied with the output channels innermost (512 x 256 x 3 x 3 ->
    (256 x 3 x 3) x 512): the input channels and both taps are one loop of 2304 (found in two merges: the taps alone
    make 9, no whole vectors), so the copy is a transpose in tiles. Values against numpy."""
    w = RS.randn(512, 256, 3, 3).astype(np.float32)
    t = Tensor(w).realize()
    p = kernel_of(t.permute(1, 2, 3, 0).contiguous())
    assert any(o.op is OptOps.PACK for o in p.applied_opts), (p.name, p.applied_opts)
    np.testing.assert_array_equal(t.permute(1, 2, 3, 0).contiguous().numpy(), w.transpose(1, 2, 3, 0))

@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.float64, dtypes.uint16, dtypes.float16])
def test_tile_copy_transposes_whole_vectors_in_registers(dt):
    """Where the renderer transposes blocks in registers, each 32x32 tile is copied as blocks of a vector's count
    (the output's inner loop upcast that far: TRANSPOSED_COPY), what fills a register: 16 float32s on AVX-512 and 8
    on AVX2, 32 uint16s only where they fit (AVX-512). Values against numpy."""
    x = values((256, 192), dt)
    p = kernel_of(Tensor(x).realize().T.contiguous())
    ren = Device["CPU"].renderer
    w = ren.simd_bytes // dt.itemsize if ren.transposed_copy and dt in ren.vector_dtypes else 1
    copies = [u for u in p.uops if u.op is Ops.TRANSPOSED_COPY]
    if 1 < w and 32 % w == 0: assert copies and all(u.arg[0] == w for u in copies), (p.name, p.applied_opts)
    else: assert not copies, (p.name, p.applied_opts)
    np.testing.assert_array_equal(Tensor(x).T.contiguous().numpy(), x.T)
