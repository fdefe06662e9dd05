"""The eager replay's cache key (uop/graph.py StructureWalk, schedule/kernelize.py cached_entry): graphs that differ in
anything the compiled kernels depend on must not share a replay. Each test alternates two graphs that differ in one
such thing, several times each (a structure replays straight from its plan from its third realize on), against
NumPy."""
import numpy as np
import pytest
from fusegrad import Context, Tensor, Variable, dtypes

rng = np.random.default_rng(11)

def rand(*shape, dtype=np.float32) -> np.ndarray:
    if np.issubdtype(dtype, np.integer): return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)

def alternate(cases, rounds: int = 4) -> None:
    """cases: (make a tensor, its NumPy value); each realized `rounds` times, interleaved."""
    for _ in range(rounds):
        for make, ref in cases:
            out = make().realize().numpy()
            assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
            np.testing.assert_array_equal(out, ref)
            np.testing.assert_array_equal(np.signbit(out), np.signbit(ref))   # -0.0 is not 0.0

def test_constant_values_zero_signs_nan_inf():
    x = rand(33)
    tx = Tensor(x).realize()
    alternate([(lambda c=c: tx * c, x * np.float32(c))
               for c in (0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 2.0)])

def test_constant_dtypes():
    # the same Python number as a constant of other dtypes: never the other dtype's kernel
    x = rng.integers(0, 100, 24)
    cases = []
    for npdt, dt in ((np.int32, dtypes.int32), (np.int64, dtypes.int64), (np.uint8, dtypes.uint8),
                     (np.float32, dtypes.float32), (np.float16, dtypes.float16), (np.float64, dtypes.float64)):
        t = Tensor(x.astype(npdt)).realize()
        cases.append((lambda t=t: t + 3, x.astype(npdt) + npdt(3)))
        cases.append((lambda t=t, dt=dt: t * Tensor(5, dtype=dt), x.astype(npdt) * npdt(5)))
    alternate(cases)

def test_bool_and_integer_constants():
    xi = rand(20, dtype=np.int32)
    ti = Tensor(xi).realize()
    cases = [(lambda d=d: ti // d, xi // d) for d in (3, 4, 7)] + \
            [(lambda d=d: ti % d, xi % d) for d in (3, 5)] + \
            [(lambda b=b: (ti > 0).where(ti, b), np.where(xi > 0, xi, b).astype(np.int32)) for b in (-1, 9)] + \
            [(lambda b=b: (ti > 0) & b, (xi > 0) & b) for b in (True, False)]
    alternate(cases)

def test_view_offsets_strides_and_masks():
    x = rand(8, 12)
    t = Tensor(x).realize()
    alternate([
        (lambda: t[:, ::2] + 1, x[:, ::2] + 1), (lambda: t[:, 1::2] + 1, x[:, 1::2] + 1),
        (lambda: t[1:5] * 2, x[1:5] * 2), (lambda: t[3:7] * 2, x[3:7] * 2), (lambda: t[4:8] * 2, x[4:8] * 2),
        (lambda: t.flip(1) - 1, x[:, ::-1] - 1), (lambda: t.flip(0) - 1, x[::-1] - 1), (lambda: t - 1, x - 1),
        (lambda: t.pad(((1, 0), (0, 2))) + 1, np.pad(x, ((1, 0), (0, 2))) + 1),
        (lambda: t.pad(((0, 1), (2, 0))) + 1, np.pad(x, ((0, 1), (2, 0))) + 1),
        (lambda: t.reshape(12, 8).T + 0.5, x.reshape(12, 8).T + 0.5), (lambda: t.T.reshape(12, 8) + 0.5,
                                                                         x.T.reshape(12, 8) + 0.5),
        (lambda: t[:, 2:6].expand(2, 8, 4) * 3, np.broadcast_to(x[:, 2:6], (2, 8, 4)) * 3),
        (lambda: t[:, 6:10].expand(2, 8, 4) * 3, np.broadcast_to(x[:, 6:10], (2, 8, 4)) * 3),
    ])

def test_variable_bounds():
    # one Variable's name and value with different bounds (the memory a kernel may touch is sized by them)
    x = rand(64)
    tx = Tensor(x).realize()
    for _ in range(3):
        for hi in (16, 64, 32):
            n = Variable("n", 1, hi).bind(9)
            out = (tx.shrink(((0, n),)) * 2).contiguous().realize()
            np.testing.assert_array_equal(out.numpy()[:9], x[:9] * 2)

def test_buffer_dtypes_of_one_size():
    # buffers of one byte size and element count, of different dtypes
    xf, xi = rand(16), rand(16, dtype=np.int32)
    tf, ti = Tensor(xf).realize(), Tensor(xi).realize()
    alternate([(lambda: tf + tf, xf + xf), (lambda: ti + ti, xi + xi),
               (lambda: tf.bitcast(dtypes.int32) + 1, xf.view(np.int32) + 1)])

def test_assign_targets():
    # one structure assigned into one buffer or the other, or into one slice of a buffer or another
    x, y = rand(10), rand(10)
    tx, ty = Tensor(x.copy()).realize(), Tensor(y.copy()).realize()
    for i in range(4):
        tx.assign(tx + ty).realize()
        x = x + y
        ty.assign(tx + ty).realize()
        y = x + y
        np.testing.assert_array_equal(tx.numpy(), x)
        np.testing.assert_array_equal(ty.numpy(), y)
    z = np.zeros(12, np.float32)
    tz = Tensor(z.copy()).realize()
    for i in range(4):
        for lo in (0, 4, 8):
            tz[lo:lo + 4].assign(tz[lo:lo + 4] + (lo + i)).realize()
            z[lo:lo + 4] += lo + i
            np.testing.assert_array_equal(tz.numpy(), z)

def test_codegen_and_launch_knobs():
    x = rand(256, 512)
    tx = Tensor(x).realize()
    for knobs in ({}, {"NOOPT": 1}, {}, {"TRANSCENDENTAL": 2}, {"CPU_THREADS": 1}, {}, {"CPU_THREADS": 1}, {}):
        with Context(**knobs):
            for _ in range(3):
                np.testing.assert_allclose((tx * 3 + 1).realize().numpy(), x * 3 + 1, rtol=1e-6)
                np.testing.assert_allclose((tx.exp()).realize().numpy(), np.exp(x), rtol=2e-6)

@pytest.mark.parametrize("dev", ["CPU", "CPU:1"])
def test_device_of_each_buffer(dev):
    # one input on another device, copied over: a copy, not the plain kernel of two same-device buffers
    x, y = rand(16), rand(16)
    tx, ty = Tensor(x).realize(), Tensor(y, device=dev).realize()
    alternate([(lambda: tx + ty.to("CPU"), x + y), (lambda: tx + tx, x + x)])
