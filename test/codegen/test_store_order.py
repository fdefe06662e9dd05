"""Lane stores in address order (codegen/store_order.py): vectors stored lane by lane into neighbouring addresses are
stored together, in address order, runs of neighbours as vector stores; the values are PyTorch's."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.store_order import order_lane_stores
from fusegrad.dtype import dtypes
from fusegrad.uop.affine import base_and_offset
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX512, glob, renderer_like, rng

def _lane_groups(base: UOp, buf: UOp, values: list[UOp], stride: int, starts: list[int]) -> list[UOp]:
    """One NOOP per vector: its lanes stored `stride` apart from `base` + start (what the vectorizer makes of a vector
    stored lane by lane)."""
    groups = []
    for v, start in zip(values, starts):
        stores = [UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, buf.dtype, (buf, base + (start + lane * stride))),
                                              UOp(Ops.GEP, dtypes.float32, (v,), lane)))
                  for lane in range(v.dtype.count)]
        groups.append(UOp(Ops.NOOP, dtypes.void, tuple(stores)))
    return groups

def _stores(sink: UOp) -> list[UOp]:
    return [u for u in sink.toposort() if u.op is Ops.STORE]

def _vectors(n: int, lanes: int) -> list[UOp]:
    return [UOp(Ops.VECTORIZE, dtypes.float32.vec(lanes), tuple(UOp.const(dtypes.float32, 100.0 * i + j)
                                                                 for j in range(lanes))) for i in range(n)]

def _written(sink: UOp, base: UOp) -> dict[int, float]:
    """Offset from `base` -> the constant value each store of `sink` leaves there."""
    out = {}
    for st in _stores(sink):
        _, off = base_and_offset(st.src[0].src[1].simplify())
        v = st.src[1]
        lanes = v.src if v.op is Ops.VECTORIZE else (v,)
        for k, lane in enumerate(lanes):
            assert lane.op is Ops.GEP and lane.src[0].op is Ops.VECTORIZE
            out[off + k] = lane.src[0].src[lane.arg].arg
    return out

def test_interleaved_vectors_are_stored_as_address_ordered_runs():
    """8 vectors of 16 channels, one per pixel of a row (stride 1024 between lanes, neighbouring pixels 1 apart):
    16 stores of 8 neighbours each, in address order, writing what the 128 lane stores wrote."""
    out = glob(0, dtypes.float32, 1 << 16)
    base = rng(16, 0, "global") * 8
    vals = _vectors(8, 16)
    sink = UOp(Ops.SINK, dtypes.void, tuple(_lane_groups(base, out, vals, 1024, list(range(8)))))
    ordered = order_lane_stores(sink, renderer_like(AVX512))
    stores = _stores(ordered)
    assert len(stores) == 16 and all(st.src[1].dtype == dtypes.float32.vec(8) for st in stores)
    groups = [u for u in ordered.src if u.op is Ops.NOOP]
    assert len(groups) == 1
    offsets = [base_and_offset(st.src[0].src[1])[1] for st in groups[0].src]
    assert offsets == sorted(offsets) == [1024 * c for c in range(16)]
    assert _written(ordered, base) == _written(sink, base)

def test_runs_are_cut_into_power_of_two_vectors_no_wider_than_a_register():
    """Rows of 7 pixels: each run of 7 is stored as 4 + 2 + 1 lanes; with 16-byte registers runs of 16 pixels are 4
    stores of 4 lanes."""
    out = glob(0, dtypes.float32, 1 << 16)
    base = rng(4, 0, "global") * 64
    sink = UOp(Ops.SINK, dtypes.void, tuple(_lane_groups(base, out, _vectors(7, 4), 512, list(range(7)))))
    ordered = order_lane_stores(sink, renderer_like(AVX512))
    assert [st.src[1].dtype.count for st in _stores(ordered)].count(4) == 4
    assert sorted(st.src[1].dtype.count for st in _stores(ordered)) == [1] * 4 + [2] * 4 + [4] * 4
    assert _written(ordered, base) == _written(sink, base)
    narrow = renderer_like((16, 16))
    sink16 = UOp(Ops.SINK, dtypes.void, tuple(_lane_groups(base, out, _vectors(16, 4), 512, list(range(16)))))
    assert [st.src[1].dtype.count for st in _stores(order_lane_stores(sink16, narrow))] == [4] * 16

@pytest.mark.parametrize("case", ["apart", "loaded", "same_address", "one_vector", "stored_elsewhere"])
def test_stores_keep_their_order(case: str):
    """Vectors whose lanes share no neighbours (apart), into a buffer the kernel also loads, storing twice to one
    address, a single vector, or beside another store into the buffer (a lane moved past it could land after it):
    the kernel is left as it is."""
    out = glob(0, dtypes.float32, 1 << 16)
    base = rng(16, 0, "global") * 8
    n, starts = {"apart": (4, [0, 4, 8, 12]), "loaded": (4, [0, 1, 2, 3]), "same_address": (2, [0, 1024]),
                 "one_vector": (1, [0]), "stored_elsewhere": (4, [0, 1, 2, 3])}[case]
    srcs = _lane_groups(base, out, _vectors(n, 16), 1024, starts)
    if case == "loaded":
        other = glob(1, dtypes.float32, 16)
        read = UOp(Ops.LOAD, dtypes.float32, (UOp(Ops.INDEX, out.dtype, (out, base)),))
        srcs.append(UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, other.dtype, (other, rng(16, 0, "global"))), read)))
    if case == "stored_elsewhere":
        srcs.insert(2, UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, out.dtype, (out, base + 1025)),
                                                    UOp.const(dtypes.float32, -1.0))))
    sink = UOp(Ops.SINK, dtypes.void, tuple(srcs))
    assert order_lane_stores(sink, renderer_like(AVX512)) is sink

# (batch, input channels, image side, output channels, kernel, stride, padding): ResNet's stem on 64px images (its
# 32x32 planes are 4 KB apart: every channel's line in one L1 set), odd sides whose rows end mid-vector, a 1x1
# convolution and one output channel count that isn't a multiple of 16
@pytest.mark.parametrize("n,ci,side,co,k,stride,pad", [(8, 3, 64, 64, 7, 2, 3), (2, 5, 13, 32, 3, 1, 1),
                                                       (1, 16, 9, 24, 1, 1, 0), (3, 3, 37, 64, 7, 2, 3)])
def test_convolutions_against_torch(n, ci, side, co, k, stride, pad):
    rng_ = np.random.default_rng(side * 100 + co)
    x = rng_.standard_normal((n, ci, side, side)).astype(np.float32)
    w = (rng_.standard_normal((co, ci, k, k)) * 0.1).astype(np.float32)
    got = Tensor(x, device="CPU").conv2d(Tensor(w, device="CPU"), stride=stride, padding=pad).numpy()
    want = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), stride=stride, padding=pad).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

def test_resnet_stem_stores_its_channels_in_address_order():
    """ResNet-18's stem convolution on 64px images, as the heuristic shapes it for an AVX-512 machine: no scatter,
    every store of the output a vector of one channel's neighbouring pixels, each channel's stores after the one
    before it."""
    x = Tensor.empty(8, 3, 64, 64, device="CPU")
    w = Tensor.empty(64, 3, 7, 7, device="CPU")
    ast = max((si.ast for si in x.conv2d(w, stride=2, padding=3).schedule() if si.ast.op is Ops.SINK),
              key=lambda a: len(a.toposort()))
    p = get_program(ast, renderer_like(AVX512))
    assert "fg_scatter" not in p.src
    out = next(u for u in p.uops if u.op is Ops.DEFINE_GLOBAL and u.arg == 0)
    stores = [u for u in p.uops if u.op is Ops.STORE and u.src[0].op is Ops.INDEX and u.src[0].src[0] is out]
    assert stores and all(st.src[1].dtype.count >= 4 for st in stores)
    offsets = [base_and_offset(st.src[0].src[1])[1] for st in stores]
    assert offsets == sorted(offsets)

@pytest.mark.parametrize("dt,tol", [(dtypes.float64, 1e-9), (dtypes.float16, 2e-3), (dtypes.bfloat16, 2e-2)])
def test_stem_in_other_dtypes_against_torch(dt, tol: float):
    """The stem's shape in float64 (8-lane vectors) and the half types (their vectors stored through conversions),
    against torch in float64 on the same rounded inputs."""
    rng_ = np.random.default_rng(11)
    x = Tensor(rng_.standard_normal((2, 3, 64, 64)).astype(np.float32)).cast(dt)
    w = Tensor((rng_.standard_normal((64, 3, 7, 7)) * 0.05).astype(np.float32)).cast(dt)
    got = x.conv2d(w, stride=2, padding=3).cast(dtypes.float64).numpy()
    want = torch.nn.functional.conv2d(torch.tensor(x.cast(dtypes.float64).numpy()),
                                      torch.tensor(w.cast(dtypes.float64).numpy()), stride=2, padding=3).numpy()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
