"""Square roots of float vectors in C kernels are the CPU's vector square root (one instruction at every
optimization level, the quick tier's -Og included): the same correctly rounded value as NumPy's sqrt for every
kind of input (negative -> nan, -0.0, inf, subnormals), and the builtins each register width names compile."""
from __future__ import annotations
import platform
import subprocess
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.device import Device, find_cc
from fusegrad.dtype import DType
from fusegrad.uop.ops import Ops

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector builtins")


def _sources(t: Tensor) -> list[str]:
    return [get_program(si.ast, Device["CPU"].renderer).src for si in t.schedule() if si.ast.op is Ops.SINK]


def _values(np_dt) -> np.ndarray:
    """Every kind of square root input: ordinary, huge, subnormal, zeros of both signs, inf, nan and negative."""
    info = np.finfo(np_dt)
    rs = np.random.default_rng(5)
    return np.concatenate([rs.random(200) * 1e3, rs.random(20) * info.max / 4, rs.random(20) * info.smallest_normal,
                           [0.0, -0.0, np.inf, np.nan, -1.0, -np.inf, -info.smallest_subnormal,
                            info.smallest_subnormal], rs.random(8)]).astype(np_dt)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint64 if a.dtype == np.float64 else np.uint32)


@x86
@pytest.mark.parametrize("dt,np_dt", [(dtypes.float32, np.float32), (dtypes.float64, np.float64)])
def test_sqrt_of_matmul_outputs_matches_numpy(dt, np_dt):
    # a product's output vectors go through the square root in the matmul's kernel, as vectors: each row of `pick`
    # picks the values' row exactly (1 * v + 0 * 0)
    x = np.stack([_values(np_dt), np.zeros(256, np_dt)])
    pick = np.zeros((16, 2), np_dt)
    pick[:, 0] = 1
    def roots() -> Tensor: return (Tensor(pick, dtype=dt) @ Tensor(x, dtype=dt)).sqrt()
    assert any("__builtin_ia32_sqrtp" in s for s in _sources(roots()))
    got = roots().numpy()
    with np.errstate(invalid="ignore"): want = np.sqrt(pick @ x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan])


def test_adam_update_fused_into_its_gradient():
    # Adam's update of a weight whose gradient is a product: the update's square roots are of whole vectors
    a, b = Tensor.randn(64, 32).realize(), Tensor.randn(32, 256).realize()
    w, m, v = Tensor.randn(64, 256).realize(), Tensor.randn(64, 256).realize(), Tensor.rand(64, 256).realize()
    def update() -> Tensor:
        g = a @ b
        m2, v2 = m * 0.9 + g * 0.1, v * 0.999 + g * g * 0.001
        return w - 0.001 * m2 / (v2.sqrt() + 1e-8)
    if platform.machine() in ("x86_64", "AMD64"):
        srcs = _sources(update())
        assert any("__builtin_ia32_sqrtps" in s for s in srcs), srcs
        assert not any("__builtin_sqrtf(a[0])" in s for s in srcs), srcs
    an, bn, wn, mn, vn = (t.numpy().astype(np.float64) for t in (a, b, w, m, v))
    gn = an @ bn
    want = wn - 0.001 * (mn * 0.9 + gn * 0.1) / (np.sqrt(vn * 0.999 + gn * gn * 0.001) + 1e-8)
    np.testing.assert_allclose(update().numpy(), want, rtol=1e-5, atol=1e-5)


@x86
@pytest.mark.parametrize("dt", [dtypes.float32.vec(4), dtypes.float32.vec(8), dtypes.float32.vec(16),
                                dtypes.float64.vec(2), dtypes.float64.vec(4), dtypes.float64.vec(8)])
def test_every_width_compiles_to_one_instruction(dt: DType, tmp_path):
    from fusegrad import hostcpu
    r = type(Device["CPU"].renderer)()
    r._helpers = {}
    vt = r.dtype_name(dt)   # (the vector type's typedef, among the helpers)
    sqrt = r._native_sqrt(dt)
    flags = hostcpu.cpu().features
    bits = dt.count * dt.scalar().itemsize * 8
    if bits == 512 and "avx512f" not in flags or bits == 256 and "avx" not in flags:
        assert sqrt is None
        return
    assert sqrt is not None
    src = "\n".join(r._helpers.values()) + f"\n{vt} f({vt} x) {{ return {sqrt}(x); }}\n"
    (tmp_path / "k.c").write_text(src)
    subprocess.run([*find_cc(), "-O0", "-march=native", "-S", "-o", str(tmp_path / "k.s"), str(tmp_path / "k.c")],
                   check=True, capture_output=True)
    asm = (tmp_path / "k.s").read_text()
    assert f"sqrtp{'s' if dt.scalar() == dtypes.float32 else 'd'}" in asm, asm
