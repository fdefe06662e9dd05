"""Half and bfloat16 in our vectorizer: vectors of them are converted to float vectors with explicit conversion
instructions (F16C/AVX-512 builtins for half, integer vector ops for bfloat16), computed in float and rounded back
after every op. Results must be bit for bit those of torch (rounding to nearest even at every cast) and of the PYTHON
device, which interprets the same UOps."""
import ctypes
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.device import Device
from fusegrad.renderer.cstyle import ClangRenderer
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import compile_program, glob, rng

HAS_F16 = dtypes.float16 in Device["CPU"].renderer.vector_dtypes
LOWP = [pytest.param(dtypes.float16, torch.float16, marks=pytest.mark.skipif(not HAS_F16, reason="no F16C")),
        (dtypes.bfloat16, torch.bfloat16)]

def edge_values(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).uniform(-3, 3, n).astype(np.float32)
    # overflow to inf, ties, the largest finite half, subnormals of half and bfloat16, nan, signed zero
    x[:12] = [1e5, -1e5, 2049.0, 2051.0, 65519.0, 65520.0, 1e-7, -3e-8, np.nan, -0.0, 1 / 3, 1e-40]
    return x

def lowp_np(t: torch.Tensor) -> np.ndarray: return t.float().numpy()
def fg_np(t: Tensor) -> np.ndarray: return t.cast(dtypes.float32).numpy()

@pytest.mark.parametrize("dt,tdt", LOWP)
def test_elementwise_bit_exact(dt, tdt):
    xa, ya = edge_values(512, 0), edge_values(512, 1)[::-1].copy()
    tx, ty = torch.from_numpy(xa).to(tdt), torch.from_numpy(ya).to(tdt)
    x, y = Tensor(xa).cast(dt).realize(), Tensor(ya).cast(dt).realize()
    cases = [(x + y, tx + ty), (x * y, tx * ty), (x - y, tx - ty), (x / y, tx / ty), (x.reciprocal(), tx.reciprocal()),
             (x.maximum(y), torch.maximum(tx, ty)), ((x < y).where(x, y * 3), torch.where(tx < ty, tx, ty * 3)),
             (-x, -tx), (x.cast(dtypes.int32).cast(dt), tx.to(torch.int32).to(tdt)), (x.abs().sqrt(), tx.abs().sqrt())]
    for i, (got, want) in enumerate(cases):
        g, w = fg_np(got), lowp_np(want)
        if i == 8: g, w = g[~np.isnan(xa)], w[~np.isnan(xa)]   # nan -> int is undefined
        np.testing.assert_array_equal(g, w, err_msg=f"case {i}")

@pytest.mark.parametrize("dt,tdt", LOWP)
def test_casts_bit_exact(dt, tdt):
    xa = edge_values(1024, 2) * 3000
    np.testing.assert_array_equal(fg_np(Tensor(xa).cast(dt)), lowp_np(torch.from_numpy(xa).to(tdt)))
    ints = np.random.default_rng(3).integers(-70000, 70000, 256).astype(np.int32)
    np.testing.assert_array_equal(fg_np(Tensor(ints).cast(dt)), lowp_np(torch.from_numpy(ints).to(tdt)))
    # float64 is rounded to half once (numpy), not through float32
    d = np.random.default_rng(4).uniform(-3, 3, 256)
    d[:2] = [1 + 2 ** -11 + 2 ** -40, 2049.0000001]
    if dt == dtypes.float16:
        np.testing.assert_array_equal(Tensor(d).cast(dt).numpy(), d.astype(np.float16))
    h = torch.from_numpy(xa).to(tdt)
    np.testing.assert_array_equal(Tensor(xa).cast(dt).cast(dtypes.float64).numpy(), h.double().numpy())

def _cpu_and_python(fn, *arrays: np.ndarray, dt) -> tuple[np.ndarray, np.ndarray]:
    outs = [fg_np(fn(*[Tensor(a, device=dev).cast(dt) for a in arrays])) for dev in ("CPU", "PYTHON")]
    return outs[0], outs[1]

@pytest.mark.parametrize("dt,tdt", LOWP)
def test_reductions_and_matmul(dt, tdt):
    rs = np.random.default_rng(5)
    a, b = rs.uniform(-2, 2, (32, 64)).astype(np.float32), rs.uniform(-2, 2, (64, 48)).astype(np.float32)
    ta, tb = torch.from_numpy(a).to(tdt).float(), torch.from_numpy(b).to(tdt).float()
    # a matmul's products are exact float32 products of the low precision values, summed in float32 (in another
    # order than torch's) and rounded once, as BLAS does
    prods = ta[:, :, None] * tb[None, :, :]
    for fn, want in [(lambda x, y: x @ y, prods.sum(1).to(tdt)), (lambda x, y: x.sum(1), ta.sum(1).to(tdt)),
                     (lambda x, y: x.sum(), ta.sum().to(tdt)), (lambda x, y: x.max(0), ta.max(0).values.to(tdt)),
                     (lambda x, y: (x * x).sum(0), (ta * ta).to(tdt).float().sum(0).to(tdt))]:
        cpu, py = _cpu_and_python(fn, a, b, dt=dt)
        np.testing.assert_array_equal(cpu, py)   # the same UOps, the same rounding
        np.testing.assert_allclose(cpu, lowp_np(want), rtol=1e-2 if dt == dtypes.bfloat16 else 2e-3, atol=1e-2)

@pytest.mark.parametrize("dt,tdt", LOWP)
def test_kernels_are_vectorized(dt, tdt):
    x = Tensor(np.ones(4096, np.float32)).cast(dt).realize()
    # (elementwise bfloat16 is left to gcc's vectorizer: its conversions are integer operations)
    m = x.reshape(64, 64)
    for t in ((x + x,) if dt == dtypes.float16 else ()) + (m.sum(1), m @ m):
        renderer = Device["CPU"].renderer
        # conversions go a SIMD register of float32 lanes at a time (16 with AVX-512, 8 with AVX2)
        lanes = renderer.simd_bytes // 4 if dt == dtypes.bfloat16 or renderer.f16_chunk else 0
        src = get_program(t.schedule()[-1].ast, renderer).src
        if dt == dtypes.bfloat16 and (renderer.amx or renderer.bf16_dot) and t.shape == (64, 64):
            # (a whole bfloat16 matmul on AMX tiles or dot products of pairs: no float32 conversions; test_bf16_dot
            # checks its values)
            assert ("tdpbf16ps" if renderer.amx else "fg_dot_pairs_x16(") in src, src
            continue
        if lanes: assert f"fg_{'f16' if dt == dtypes.float16 else 'bf16'}x{lanes}_to_f32(" in src, src
        # the workaround of gcc's miscompile stays: no AVX512-FP16, no conversions of gcc's own making
        if dt == dtypes.float16: assert "no-avx512fp16" in src

@pytest.mark.skipif(not HAS_F16, reason="no F16C")
@pytest.mark.parametrize("chunk", [16, 8, 0])
@pytest.mark.parametrize("width", [2, 4, 8, 16, 32])
def test_conversion_widths(chunk: int, width: int):
    # out[i] = half(a[i] * 3.0) + half(b[i]) with the vector axis `width` lanes, conversions `chunk` lanes at a time
    ren = ClangRenderer()
    if chunk > ren.f16_chunk: pytest.skip(f"this CPU converts at most {ren.f16_chunk} halves at a time")
    ren.f16_chunk = chunk
    n = 64
    r = rng(n, 0)
    a, b = glob(1, dtypes.float32, n).index(r).load(), glob(2, dtypes.float16, n).index(r).load()
    val = (a * 3.0).cast(dtypes.float16) + b
    ast = UOp.sink_of(glob(0, dtypes.float16, n).index(r).store(val))
    p = get_program(ast, ren, opts=[Opt(OptOps.UPCAST, 0, width)])
    assert any(u.op is Ops.STORE and u.src[0].dtype.vcount == width for u in p.uops)
    with np.errstate(over="ignore"): xa, xb = edge_values(n, 6) * 1000, edge_values(n, 7).astype(np.float16)
    out = np.zeros(n, np.float16)
    compile_program(p)(*[ctypes.c_void_p(arr.ctypes.data) for arr in (out, xa, xb)], ctypes.c_long(0),
                       ctypes.c_long(p.global_size))
    want = (torch.from_numpy(xa) * 3.0).half() + torch.from_numpy(xb)
    np.testing.assert_array_equal(out, want.numpy())

def test_bfloat16_vector_rounding():
    # out[i] = bf16(a[i] * 3.0) * b[i] as bfloat16 vectors of 16 lanes: ties to even, overflow, nan, subnormals
    n, r = 64, rng(64, 0)
    a, b = glob(1, dtypes.float32, n).index(r).load(), glob(2, dtypes.bfloat16, n).index(r).load()
    ast = UOp.sink_of(glob(0, dtypes.bfloat16, n).index(r).store((a * 3.0).cast(dtypes.bfloat16) * b))
    p = get_program(ast, ClangRenderer(), opts=[Opt(OptOps.UPCAST, 0, 16)])
    assert "fg_f32x16_to_bf16(" in p.src
    xa = edge_values(n, 8)
    xa[12:16] = [3e38, np.float32(1 + 2 ** -8) / 3, np.float32(1 + 3 * 2 ** -8) / 3, -np.nan]
    tb = torch.from_numpy(edge_values(n, 9)[::-1].copy()).bfloat16()
    out = np.zeros(n, np.uint16)
    compile_program(p)(*[ctypes.c_void_p(arr.ctypes.data) for arr in (out, xa, tb.view(torch.int16).numpy())],
                       ctypes.c_long(0), ctypes.c_long(p.global_size))
    want = ((torch.from_numpy(xa) * 3.0).bfloat16() * tb).float().numpy()
    np.testing.assert_array_equal(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).float().numpy(), want)
