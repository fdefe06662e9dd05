"""Tensor creation, conversion and properties; laziness, realize/schedule/kernelize and assign.

References are Python itself, numpy and torch (for bfloat16 rounding)."""
from __future__ import annotations
import math
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.uop.ops import Ops, UOp
from fusegrad.engine.realize import ExecItem, run_schedule

from fusegrad import GlobalCounters

def kernels() -> int: return GlobalCounters.kernel_count

NP_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
             "float64"]

# ---------------------------------------------------------------------------------------------------------------------
# construction

@pytest.mark.parametrize("val,dtype,npdt,pytype", [(3.0, dtypes.float32, "float32", float),
                                                   (3, dtypes.int32, "int32", int), (True, dtypes.bool, "bool", bool),
                                                   (-2.5, dtypes.float32, "float32", float)])
def test_from_python_scalar(val, dtype, npdt, pytype):
    t = Tensor(val)
    assert t.shape == () and t.ndim == 0 and t.numel() == 1
    assert t.dtype == dtype
    item = t.item()
    assert type(item) is pytype and item == val
    assert t.numpy().shape == () and t.numpy().dtype == np.dtype(npdt)
    assert t.tolist() == val

@pytest.mark.parametrize("data,npdt,shape", [
    ([1, 2, 3], "int32", (3,)), ([[1, 2], [3, 4]], "int32", (2, 2)), ([1.5, 2], "float32", (2,)),
    ([True, False], "bool", (2,)), ([True, 2], "int32", (2,)), ([[[1.0]], [[2.0]]], "float32", (2, 1, 1)),
    ((1, 2, 3), "int32", (3,)), ([[1, 2.5], [3, 4]], "float32", (2, 2)), ([[-7, 0]], "int32", (1, 2)),
])
def test_from_nested_list(data, npdt, shape):
    # torch's inference (float > int > bool) with tinygrad's default int32/float32
    t = Tensor(data)
    assert t.shape == shape and t.dtype == getattr(dtypes, npdt)
    out = t.numpy()
    assert out.dtype == np.dtype(npdt)
    expected = np.array(data, dtype=npdt)
    np.testing.assert_array_equal(out, expected)
    assert t.tolist() == expected.tolist()

@pytest.mark.parametrize("npdt", NP_DTYPES)
def test_from_numpy_every_dtype(npdt):
    rng = np.random.default_rng(0)
    if npdt == "bool": x = rng.integers(0, 2, (3, 4)).astype(bool)
    elif np.dtype(npdt).kind in "iu":
        info = np.iinfo(npdt)
        x = np.array([[info.min, info.max, 0, 1], [2, 3, info.max - 1, info.min + 1], [5, 6, 7, 8]], dtype=npdt)
    else: x = rng.uniform(-100, 100, (3, 4)).astype(npdt)
    t = Tensor(x)
    assert t.dtype == getattr(dtypes, npdt)
    assert t.shape == (3, 4)
    out = t.numpy()
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, x)
    # tolist gives Python scalars of the matching kind
    lst = t.tolist()
    assert lst == x.tolist()
    assert type(lst[0][0]) is type(x.tolist()[0][0])

def test_from_numpy_non_contiguous():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.testing.assert_array_equal(Tensor(x.T).numpy(), x.T)
    np.testing.assert_array_equal(Tensor(x[::2, 1::3]).numpy(), x[::2, 1::3])
    np.testing.assert_array_equal(Tensor(x[:, ::-1]).numpy(), x[:, ::-1])

def test_from_numpy_zero_dim_and_empty():
    assert Tensor(np.array(2.5, dtype=np.float32)).item() == 2.5
    assert Tensor(np.array(7, dtype=np.int64)).dtype == dtypes.int64
    e = Tensor(np.zeros((0, 3), dtype=np.int16))
    assert e.shape == (0, 3) and e.dtype == dtypes.int16 and e.numpy().shape == (0, 3)

@pytest.mark.parametrize("dtname", ["float16", "int8", "uint8", "int64", "float64", "bool", "uint32"])
def test_dtype_argument(dtname):
    dt = getattr(dtypes, dtname)
    for arg in (dt, dtname):  # a DType or its name
        t = Tensor([0, 1, 2, 3], dtype=arg)
        assert t.dtype == dt
        np.testing.assert_array_equal(t.numpy(), np.array([0, 1, 2, 3], dtype=dtname))

def test_dtype_argument_converts_numpy():
    t = Tensor(np.array([1.5, 2.5], dtype=np.float64), dtype=dtypes.float32)
    assert t.dtype == dtypes.float32 and t.numpy().dtype == np.float32
    assert t.tolist() == [1.5, 2.5]

def test_float16_from_list_rounds():
    vals = [1.0, 0.1, 1 / 3, 65504.0, -2.5e-5]
    t = Tensor(vals, dtype=dtypes.float16)
    np.testing.assert_array_equal(t.numpy(), np.array(vals, dtype=np.float16))

def test_bfloat16_from_list():
    vals = [1.0, 2.5, -3.0, 1.00390625, 0.1, 3.14159, 1e30, -1e-20]
    t = Tensor(vals, dtype=dtypes.bfloat16)
    assert t.dtype == dtypes.bfloat16
    f = t.float()
    assert f.dtype == dtypes.float32
    np.testing.assert_array_equal(f.numpy(), torch.tensor(vals, dtype=torch.bfloat16).float().numpy())
    assert t.cast(dtypes.float32).tolist() == torch.tensor(vals, dtype=torch.bfloat16).float().tolist()

def test_large_ints_roundtrip():
    vals64 = [2 ** 62 + 3, -(2 ** 62) - 7, 2 ** 40]
    assert Tensor(vals64, dtype=dtypes.int64).tolist() == vals64
    assert Tensor([2 ** 63 + 5, 2 ** 64 - 1], dtype=dtypes.uint64).tolist() == [2 ** 63 + 5, 2 ** 64 - 1]
    assert Tensor([4_000_000_000], dtype=dtypes.uint32).tolist() == [4_000_000_000]

def test_float64_precision_kept():
    x = np.array([1 / 3, math.pi, 1e-300], dtype=np.float64)
    out = Tensor(x).numpy()
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal((Tensor(x) * 3).numpy(), x * 3)

def test_device():
    from fusegrad import Device
    t = Tensor([1, 2, 3])
    assert t.device == Device.DEFAULT
    c = Tensor([1, 2, 3], device="CPU")
    assert c.device == "CPU"
    assert (c + 1).device == "CPU"
    assert c.tolist() == [1, 2, 3]

# ---------------------------------------------------------------------------------------------------------------------
# properties

def test_properties():
    t = Tensor.zeros(2, 3, 4)
    assert t.shape == (2, 3, 4) and isinstance(t.shape, tuple)
    assert t.ndim == 3 and t.numel() == 24 and len(t) == 2
    assert t.dtype == dtypes.float32
    assert len(Tensor([5, 6, 7])) == 3
    assert Tensor.zeros(0, 4).numel() == 0

def test_repr():
    r = repr(Tensor([1.0, 2.0]))
    assert "Tensor" in r
    assert isinstance(str(Tensor([1])), str)

def test_tolist_nested_types():
    assert Tensor([[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
    lst = Tensor([[1.5], [2.0]]).tolist()
    assert lst == [[1.5], [2.0]] and type(lst[0][0]) is float
    b = Tensor([True, False]).tolist()
    assert b == [True, False] and type(b[0]) is bool
    assert Tensor.zeros(2, 0).tolist() == [[], []]

def test_item():
    assert Tensor([[7]]).item() == 7 and type(Tensor([[7]]).item()) is int
    assert Tensor([2.5]).item() == 2.5
    assert Tensor([1, 2, 3]).sum().item() == 6
    assert Tensor([True]).item() is True

# ---------------------------------------------------------------------------------------------------------------------
# creation functions

@pytest.mark.parametrize("fn,npfn", [("zeros", np.zeros), ("ones", np.ones)])
def test_zeros_ones(fn, npfn):
    f = getattr(Tensor, fn)
    for shape_args, shape in (((2, 3), (2, 3)), (((2, 3),), (2, 3)), (([4],), (4,)), ((5,), (5,)), (((),), ())):
        t = f(*shape_args)
        assert t.shape == shape and t.dtype == dtypes.float32
        np.testing.assert_array_equal(t.numpy(), npfn(shape, dtype=np.float32))
    for dt in (dtypes.int8, dtypes.bool, dtypes.float16, dtypes.uint32, dtypes.int64):
        t = f(3, 2, dtype=dt)
        assert t.dtype == dt
        np.testing.assert_array_equal(t.numpy(), npfn((3, 2), dtype=t.numpy().dtype))
        assert t.numpy().dtype == np.dtype({dtypes.int8: "int8", dtypes.bool: "bool", dtypes.float16: "float16",
                                            dtypes.uint32: "uint32", dtypes.int64: "int64"}[dt])

@pytest.mark.parametrize("shape,fill,dtype", [((2, 3), 7, dtypes.int32), ((2, 3), 7.5, dtypes.float32),
                                              ((4,), True, dtypes.bool), ((), -1.25, dtypes.float32),
                                              ((2, 2), 0.5, None)])
def test_full(shape, fill, dtype):
    t = Tensor.full(shape, fill)
    assert t.shape == shape
    if dtype is not None: assert t.dtype == dtype
    np.testing.assert_array_equal(t.numpy(), np.full(shape, fill))
    t16 = Tensor.full(shape, fill, dtype=dtypes.float16)
    assert t16.dtype == dtypes.float16
    np.testing.assert_array_equal(t16.numpy(), np.full(shape, fill, dtype=np.float16))

def test_empty():
    t = Tensor.empty(3, 4)
    assert t.shape == (3, 4) and t.dtype == dtypes.float32
    assert t.numpy().shape == (3, 4)
    t2 = Tensor.empty(2, dtype=dtypes.int16)
    assert t2.dtype == dtypes.int16 and t2.numpy().shape == (2,)
    # an empty tensor can be written with assign and read back
    e = Tensor.empty(4).realize()
    e.assign(Tensor([1.0, 2.0, 3.0, 4.0])).realize()
    assert e.tolist() == [1.0, 2.0, 3.0, 4.0]

@pytest.mark.parametrize("args", [(5,), (2, 8), (0, 10, 3), (5, 0, -1), (10, 2, -3), (0, 1, 0.25), (-1.5, 1.5, 0.5),
                                  (3, 3), (5, 2), (0, 1, 0.1)], ids=str)
def test_arange(args):
    # numpy for values (torch raises for an empty range like arange(5, 2)); torch's dtype rule with tinygrad's defaults
    t = Tensor.arange(*args)
    ref = np.arange(*args)
    assert t.shape == ref.shape
    assert t.dtype == (dtypes.float32 if any(isinstance(a, float) for a in args) else dtypes.int32)
    np.testing.assert_allclose(t.numpy(), ref, atol=1e-6, rtol=1e-6)

def test_arange_dtype_and_kwargs():
    t = Tensor.arange(4, dtype=dtypes.float32)
    assert t.dtype == dtypes.float32 and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert Tensor.arange(1, 10, step=4).tolist() == [1, 5, 9]
    assert Tensor.arange(3, dtype=dtypes.int64).dtype == dtypes.int64

@pytest.mark.parametrize("n,m", [(3, None), (2, 4), (4, 2), (1, None)])
def test_eye(n, m):
    t = Tensor.eye(n) if m is None else Tensor.eye(n, m)
    ref = np.eye(n, m, dtype=np.float32)
    assert t.dtype == dtypes.float32
    np.testing.assert_array_equal(t.numpy(), ref)
    ti = Tensor.eye(n, m, dtype=dtypes.int32)
    assert ti.dtype == dtypes.int32
    np.testing.assert_array_equal(ti.numpy(), ref.astype(np.int32))

def test_like_functions():
    src = Tensor([[1, 2, 3], [4, 5, 6]], dtype=dtypes.int16)
    for t, fill in ((Tensor.zeros_like(src), 0), (Tensor.ones_like(src), 1), (Tensor.full_like(src, 9), 9)):
        assert t.shape == (2, 3) and t.dtype == dtypes.int16
        np.testing.assert_array_equal(t.numpy(), np.full((2, 3), fill, dtype=np.int16))
    t = Tensor.ones_like(src, dtype=dtypes.float32)
    assert t.dtype == dtypes.float32 and t.tolist() == [[1.0] * 3] * 2
    t = Tensor.full_like(Tensor.zeros(4), 2.5)
    assert t.dtype == dtypes.float32 and t.tolist() == [2.5] * 4

# ---------------------------------------------------------------------------------------------------------------------
# laziness, realize, schedule, kernelize

def test_building_is_lazy():
    a, b, c = Tensor([1.0, 2.0]).realize(), Tensor([3.0, 4.0]).realize(), Tensor([5.0, 6.0]).realize()
    k0 = kernels()
    out = ((a * b + c).relu() * 0.5).exp().sum()
    assert kernels() == k0, "building an expression must not run anything"
    _ = out.shape, out.dtype, out.ndim, out.numel()  # properties do not realize either
    assert kernels() == k0
    assert out.item() == pytest.approx(math.exp(4.0) + math.exp(7.0), rel=1e-6)
    assert kernels() > k0

def test_elementwise_chain_fuses_to_one_kernel():
    x, y, z = [Tensor(np.full((64,), v, dtype=np.float32)).realize() for v in (1.0, 2.0, 3.0)]
    k0 = kernels()
    out = ((x * y + z).relu() * 0.5).realize()
    assert kernels() - k0 == 1
    assert out.tolist() == [2.5] * 64

def test_realize_returns_self_and_is_idempotent():
    a = Tensor([1, 2, 3]) + 1
    assert a.realize() is a
    k0 = kernels()
    a.realize()
    assert kernels() == k0, "realizing a realized tensor runs nothing"
    assert a.tolist() == [2, 3, 4]
    k1 = kernels()
    a.numpy()
    assert kernels() == k1

def test_realize_many():
    a = Tensor([1.0, 2.0]).realize()
    b, c = a + 1, a * 3
    Tensor.realize(b, c)
    k0 = kernels()
    assert b.tolist() == [2.0, 3.0] and c.tolist() == [3.0, 6.0]
    assert kernels() == k0, "both were realized by the one call"

def test_schedule_returns_exec_items():
    a = Tensor([1.0, 2.0, 3.0]).realize()
    out = (a * 2 + 1).sum()
    k0 = kernels()
    sched = out.schedule()
    assert isinstance(sched, list) and len(sched) >= 1
    assert kernels() == k0, "scheduling runs nothing"
    sched2 = Tensor.schedule(a * 5)
    assert isinstance(sched2, list) and len(sched2) >= 1

def test_schedule_many_tensors():
    a = Tensor([1.0, 2.0]).realize()
    b, c = (a + 1).exp(), (a * 2).sum()
    sched = Tensor.schedule(b, c)
    assert isinstance(sched, list) and len(sched) >= 2  # two independent outputs need two stores
    assert all(isinstance(ei, ExecItem) for ei in sched)
    run_schedule(sched)  # a schedule is only a plan: the caller runs it
    assert b.tolist() == pytest.approx([math.exp(2.0), math.exp(3.0)], rel=1e-6)
    assert c.item() == 6.0

def test_kernelize_runs_nothing_then_realize():
    a = Tensor([1.0, 2.0, 3.0]).realize()
    out = (a + 1) * 2
    k0 = kernels()
    ret = out.kernelize()
    assert ret is out
    assert kernels() == k0
    assert out.tolist() == [4.0, 6.0, 8.0]
    x, y = a - 1, a * a
    k1 = kernels()
    Tensor.kernelize(x, y)
    assert kernels() == k1
    assert x.tolist() == [0.0, 1.0, 2.0] and y.tolist() == [1.0, 4.0, 9.0]

def test_uop_and_lazydata():
    a, b = Tensor([1.0, 2.0]).realize(), Tensor([3.0, 4.0]).realize()
    c = a + b
    assert isinstance(c.uop, UOp)
    assert c.lazydata is c.uop
    from fusegrad.uop.ops import Ops
    assert c.uop.op is Ops.ADD
    assert c.uop.dtype == dtypes.float32
    c.realize()
    assert Ops.ADD not in {u.op for u in c.uop.toposort()}, "after realize the graph is replaced by the buffer"
    assert Ops.BUFFER in {u.op for u in c.uop.toposort()}

def test_shared_subexpression_computed_once_values():
    a = Tensor([1.0, 2.0]).realize()
    s = a * 3
    u, v = s + 1, s - 1
    Tensor.realize(u, v)
    assert u.tolist() == [4.0, 7.0] and v.tolist() == [2.0, 5.0]
    assert s.tolist() == [3.0, 6.0]

def test_same_graph_on_new_inputs_uses_new_data():
    # the schedule and program caches must bind the current buffers and constants, not the ones first seen
    f = lambda a, b: ((a * b) + 1).sum(axis=0)
    x1, y1 = Tensor([[1.0, 2.0], [3.0, 4.0]]).realize(), Tensor([[1.0, 1.0], [2.0, 2.0]]).realize()
    x2, y2 = Tensor([[5.0, 6.0], [7.0, 8.0]]).realize(), Tensor([[0.5, 0.5], [1.0, 0.0]]).realize()
    assert f(x1, y1).tolist() == [9.0, 12.0]
    assert f(x2, y2).tolist() == [11.5, 5.0]
    assert f(x1, y1).tolist() == [9.0, 12.0]
    assert (x1 + 1).tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert (x1 + 2).tolist() == [[3.0, 4.0], [5.0, 6.0]]
    assert (x1.cast(dtypes.int32) + 2).tolist() == [[3, 4], [5, 6]]

def test_numpy_input_is_copied():
    # like torch.tensor: later changes to the source array do not leak into the tensor
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    t = Tensor(a)
    u = Tensor(a) * 2
    a[0] = 100.0
    assert t.tolist() == [1.0, 2.0, 3.0]
    assert u.tolist() == [2.0, 4.0, 6.0]

def test_numpy_output_survives_later_work():
    t = Tensor([1.0, 2.0, 3.0]).realize()
    out = t.numpy()
    t.assign(t * 10).realize()
    assert out.tolist() == [1.0, 2.0, 3.0], "numpy() hands out a copy, not a view into a buffer that changes"

# ---------------------------------------------------------------------------------------------------------------------
# assign

def test_assign_updates_in_place():
    a = Tensor([1.0, 2.0, 3.0]).realize()
    a.assign(a + 1).realize()
    assert a.tolist() == [2.0, 3.0, 4.0]
    a.assign(a * a).realize()
    assert a.tolist() == [4.0, 9.0, 16.0]

def test_assign_repeated_step_like_optimizer():
    w = Tensor.zeros(4).realize()
    g = Tensor([1.0, 2.0, 3.0, 4.0]).realize()
    for _ in range(3):
        w.assign(w - 0.5 * g).realize()
    assert w.tolist() == [-1.5, -3.0, -4.5, -6.0]

def test_assign_keeps_buffer_readers_consistent():
    a = Tensor([1, 2, 3]).realize()
    b = (a * 10).realize()  # computed from the old value
    a.assign(Tensor([7, 8, 9])).realize()
    assert a.tolist() == [7, 8, 9]
    assert b.tolist() == [10, 20, 30]
    assert (a + b).tolist() == [17, 28, 39]

def test_assign_int_and_broadcast_value():
    a = Tensor.zeros(2, 3, dtype=dtypes.int32).realize()
    a.assign(a + Tensor([1, 2, 3])).realize()
    assert a.tolist() == [[1, 2, 3], [1, 2, 3]]

SELF_READS = [("transpose", lambda t: t.T, lambda x: x.T), ("flip", lambda t: t.flip(0), lambda x: x[::-1]),
              ("flip_plus_self", lambda t: t.flip(0) + t, lambda x: x[::-1] + x),
              ("shift_down", lambda t: t.pad(((1, 0), (0, 0)))[:3], lambda x: np.vstack([np.zeros((1, 3)), x[:2]])),
              ("shift_up", lambda t: t.pad(((0, 1), (0, 0)))[1:], lambda x: np.vstack([x[1:], np.zeros((1, 3))]))]

@pytest.mark.parametrize("name,fxn,npfxn", SELF_READS, ids=[r[0] for r in SELF_READS])
def test_assign_reading_self_through_a_view(name, fxn, npfxn):
    # the new value reads other elements of the buffer being written: a correct in-place update must not observe
    # its own partial writes (numpy computes the value first, as assign's semantics say)
    a = Tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).realize()
    ref = npfxn(np.array(a.tolist()))
    a.assign(fxn(a)).realize()
    np.testing.assert_array_equal(a.numpy(), ref)

def test_assign_reading_self_through_a_reduce():
    a = Tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 8.0]]).realize()
    a.assign(a - a.mean(axis=1, keepdim=True)).realize()
    assert a.tolist() == [[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0]]
    b = Tensor([1.0, 2.0, 3.0, 4.0]).realize()
    b.assign(b / b.sum()).realize()
    assert b.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4], rel=1e-6)

def test_zero_dim_numpy_array_keeps_its_shape():
    for arr in (np.array(3, dtype=np.int32), np.array(2.5, dtype=np.float32), np.float64(1.5)):
        t = Tensor(arr)
        assert t.shape == () and t.numpy().shape == ()
        assert t.item() == arr.item()

def test_copy_between_devices():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    a = Tensor(x)
    b = a.to("PYTHON")
    assert b.device == "PYTHON" and a.to("CPU") is a
    np.testing.assert_array_equal((b * 2).numpy(), x * 2)
    # a view is made contiguous before it crosses devices
    c = (b.T + 1).to("CPU")
    assert c.device == "CPU"
    np.testing.assert_array_equal(c.numpy(), x.T + 1)
    with pytest.raises(ValueError, match="device"):
        a + b

def test_realize_keeps_buffers_other_lazy_tensors_read():
    # realizing `a` alone must not hand memory that lazy `b` still reads to a later intermediate of a's schedule
    a, b = Tensor([3.0, 1.0, 2.0]), Tensor([0, 1, 2], dtype=dtypes.int32)
    an, bn = np.array([3.0, 1.0, 2.0], np.float32), np.array([0, 1, 2], np.int32)
    for _ in range(4):
        a, b = (a + 1).contiguous(), (b + (a > 2).cast(dtypes.int32)).contiguous()
        an, bn = an + 1, bn + (an > 2).astype(np.int32)
    a.realize()
    np.testing.assert_array_equal(b.numpy(), bn)
    np.testing.assert_array_equal(a.numpy(), an)

def test_cat_keeps_negative_zero():
    got = Tensor([-0.0, 0.0]).cat(Tensor([-0.0]), Tensor([[-0.0]]).reshape(1)).numpy()
    want = torch.cat([torch.tensor([-0.0, 0.0]), torch.tensor([-0.0]), torch.tensor([-0.0])]).numpy()
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))

def test_small_api_names_against_torch():
    rng = np.random.default_rng(4)
    xn = rng.standard_normal((2, 6, 3)).astype(np.float32)
    x, tx = Tensor(xn), torch.from_numpy(xn)
    np.testing.assert_array_equal(x.unflatten(1, (2, -1)).numpy(), tx.unflatten(1, (2, -1)).numpy())
    np.testing.assert_array_equal(x.unflatten(-1, (3, 1)).numpy(), tx.unflatten(-1, (3, 1)).numpy())
    assert x.short().dtype == dtypes.int16 and x.bfloat16().dtype == dtypes.bfloat16
    np.testing.assert_array_equal(x.short().numpy(), tx.short().numpy())
    np.testing.assert_array_equal(x.bfloat16().float().numpy(), tx.bfloat16().float().numpy())
    np.testing.assert_array_equal(x.shrink_to(1, None, 2).numpy(), xn[:1, :, :2])
    np.testing.assert_array_equal(x.pad_to(3, 6, 5, value=1.5).numpy(), np.pad(xn, ((0, 1), (0, 0), (0, 2)),
                                                                               constant_values=1.5))
    with pytest.raises(ValueError, match="shrink_to"): x.shrink_to(3, 6, 3)
    with pytest.raises(ValueError, match="pad_to"): x.pad_to(1, 6, 3)
    with pytest.raises(ValueError, match="dims"): x.pad_to(2, 6)
    a = np.array([1.0, 1.0 + 1e-6, 2.0, np.inf, -np.inf, np.nan, np.nan, 0.0], np.float32)
    b = np.array([1.0, 1.0, 2.1, np.inf, np.inf, np.nan, 1.0, 1e-9], np.float32)
    for equal_nan in (False, True):
        want = torch.isclose(torch.from_numpy(a), torch.from_numpy(b), equal_nan=equal_nan).numpy()
        np.testing.assert_array_equal(Tensor(a).isclose(Tensor(b), equal_nan=equal_nan).numpy(), want)
        assert Tensor(a).allclose(Tensor(b), equal_nan=equal_nan).item() == \
            torch.allclose(torch.from_numpy(a), torch.from_numpy(b), equal_nan=equal_nan)
    assert Tensor(a[:2]).allclose(Tensor(b[:2])).item() is True
    t = Tensor([1.0, 2.0], device="CPU")
    assert t.to_("PYTHON") is t and t.device == "PYTHON" and t.tolist() == [1.0, 2.0]

def test_assign_to_empty_tensor():
    t = Tensor.zeros(2, 0, 3).contiguous().realize()
    assert t.assign(Tensor.ones(2, 0, 3)).realize() is t
    assert t.numpy().shape == (2, 0, 3)
    with pytest.raises(ValueError, match="shape mismatch"): t.assign(Tensor.ones(2, 1, 3))

def test_realize_walks_only_lazy_tensors():
    # a realize re-points the lazy tensors only: realized ones leave the lazy set, and graphs built before a realize
    # (over nodes it computes, or over a buffer it overwrites) still give the values numpy computes
    from fusegrad.tensor import lazy_tensors
    params = [Tensor(np.full((3,), float(i), np.float32)).realize() for i in range(50)]
    a = Tensor(np.arange(6, dtype=np.float32)).reshape(2, 3)
    b = a * 2                      # shares a's graph
    c = (b + 1).sum(1)             # lazy, over b
    b.realize()
    ids = {id(t) for t in lazy_tensors()}
    assert id(b) not in ids and not any(id(p) in ids for p in params) and id(c) in ids
    np.testing.assert_equal(c.numpy(), (np.arange(6, dtype=np.float32).reshape(2, 3) * 2 + 1).sum(1))
    w = params[3]
    old_reader = w * 10            # reads w before it is overwritten
    w.assign(w + 1)
    assert id(w) in {id(t) for t in lazy_tensors()}
    w.realize()
    np.testing.assert_equal(old_reader.numpy(), np.full((3,), 30.0, np.float32))
    np.testing.assert_equal(w.numpy(), np.full((3,), 4.0, np.float32))

def test_tensor_registries_drop_dead_tensors():
    # tensors made and dropped without any realize or backward still leave the registries bounded
    import fusegrad.tensor as tensor_module
    x = Tensor([1.0, 2.0])
    for _ in range(100_000): x + 1
    assert len(tensor_module._all_refs) <= 50_000 and len(tensor_module._lazy_refs) <= 50_000
    np.testing.assert_equal((x + 1).numpy(), [2.0, 3.0])

def _matmul_graph(t: Tensor) -> UOp:
    """The graph of a matmul's result: a float product is one COMPOSITE node (tensor/composite.py), an int one the
    graph itself."""
    u = t.uop
    assert (u.op is Ops.COMPOSITE) == dtypes.is_float(u.dtype)
    return u.arg.expand(u.src) if u.op is Ops.COMPOSITE else u

@pytest.mark.parametrize("a,b", [((128, 784), (784, 512)), ((3, 5, 7), (3, 7, 2)), ((2, 1), (1, 3)),
                                 ((2, 3, 4, 5), (2, 3, 5, 6))])
@pytest.mark.parametrize("dt", [np.float32, np.float64, np.int32, np.int64])
def test_matmul_fast_path_builds_the_broadcast_graph(a, b, dt, monkeypatch):
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)   # (composites are made in this process)
    # the common matmul is made as nodes directly: it must be the very graph (hash-consed: the same node) that the
    # broadcast multiply and sum make, so kernels and the schedule cache see no difference
    from fusegrad.dtype import sum_acc_dtype
    va, vb = (np.arange(np.prod(s)).reshape(s) % 7 - 3 for s in (a, b))   # (small: exact in every dtype)
    x, y = Tensor(va.astype(dt)), Tensor(vb.astype(dt))
    xb = x.reshape(a[:-2] + (a[-2], 1, a[-1]))
    yb = y.transpose(-1, -2).reshape(b[:-2] + (1, b[-1], b[-2]))
    assert _matmul_graph(x @ y) is (xb * yb).sum(-1, dtype=sum_acc_dtype(x.dtype)).uop
    np.testing.assert_array_equal((x @ y).numpy(), va @ vb)

@pytest.mark.parametrize("a,b", [((4, 8), (8, 5)), ((3, 5, 7), (3, 7, 2)), ((64, 512), (512, 64)),
                                 ((2, 3, 300), (2, 300, 20))])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_half_matmul_fast_path_builds_the_broadcast_graph(a, b, dt, monkeypatch):
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)   # (composites are made in this process)
    # half types are multiplied and summed in float32, then rounded: the nodes made directly are the graph of the
    # broadcast form, and a long product (K >= 256, M >= 16) that runs as a float32 one (its x converted and copied
    # first, where no instruction takes the half values) is left to the general path
    from fusegrad import Device
    dtype = getattr(dtypes, dt)
    va, vb = (np.arange(np.prod(s)).reshape(s) % 7 - 3 for s in (a, b))
    x, y = (Tensor(v.astype(np.float32)).cast(dtype) for v in (va, vb))
    xb = x.reshape(a[:-2] + (a[-2], 1, a[-1])).cast(dtypes.float32)
    yb = y.transpose(-1, -2).reshape(b[:-2] + (1, b[-1], b[-2])).cast(dtypes.float32)
    broadcast = (xb * yb).sum(-1, dtype=dtypes.float32).cast(dtype)
    # (the rule as DESIGN.md states it for a CPU: K >= 256 and M >= 16, unless bfloat16 has a dot-product instruction)
    long_half = a[-1] >= 256 and b[-1] >= 16 and not (dt == "bfloat16" and Device[x.device].renderer.bf16_dot)
    got = (x @ y).uop
    # (the direct nodes are one COMPOSITE node, tensor/composite.py, whose graph is the broadcast form's)
    assert (got.op is Ops.COMPOSITE) != long_half
    if long_half: assert any(u.op is Ops.CONTIGUOUS for u in got.toposort())
    else: assert got.arg.expand(got.src) is broadcast.uop
    # (small integers: every product and sum exact in float32, then rounded once to the half type, as torch rounds)
    want = torch.tensor(va @ vb, dtype=torch.float32).to(getattr(torch, dt)).float().numpy()
    np.testing.assert_array_equal((x @ y).float().numpy(), want)
