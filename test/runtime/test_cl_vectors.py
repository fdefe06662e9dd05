"""Vector kernels and native math on the CL device (PoCL): results of kernels the code generator vectorizes (float,
double and integer vectors, masks, casts, gated loads on padded edges, vector accumulators of reductions, local memory)
against the CPU device, bit for bit where the CPU's are fixed by IEEE or integer arithmetic; the same kernels written
with vload/vstore (the spelling for GPUs) built and run on PoCL; OpenCL's exp2, log2, sin and exp within a few ulp of
float64 references over their whole range."""
from __future__ import annotations
import copy
import re
import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from fusegrad import Tensor, dtypes  # noqa: E402
from fusegrad.codegen import get_program  # noqa: E402
from fusegrad.device import Buffer, Device  # noqa: E402
from fusegrad.dtype import from_np_dtype  # noqa: E402
from fusegrad.engine.realize import CompiledRunner  # noqa: E402
from fusegrad.uop.ops import Ops  # noqa: E402

rng = np.random.default_rng(0)
def f32(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)
def ints(lo: int, hi: int, dt) -> np.ndarray: return rng.integers(lo, hi, (64, 128)).astype(dt)
DATA = {"a": f32(64, 128), "b": f32(1, 128), "c": f32(64, 1), "i": ints(-1000, 1000, np.int32),
        "j": ints(-50, 50, np.int32), "c8": ints(-128, 128, np.int8), "u8": ints(0, 256, np.uint8),
        "d": rng.standard_normal((64, 128)), "l": ints(-2 ** 40, 2 ** 40, np.int64), "m": f32(128, 32),
        "bo": rng.random((64, 128)) > 0.5, "x4": f32(2, 8, 16, 16), "w": f32(16, 8, 3, 3)}
DATA["a"][3, :8] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40]

# bit for bit: IEEE (+, -, *, / correctly rounded, comparisons, max with nan, selects, exact casts) and integers
EXACT = ["a + b * c", "(a - b).maximum(0)", "a / c", "(a < b).where(a, c)", "a.maximum(b)", "b.maximum(a)",
         "i * j + i", "i // (j + 100)", "i % 7", "i >> 2", "i << 3", "(i < 5) & (i > -5)", "c8 + c8", "u8 // 3",
         "i.cast(dtypes.float32) * a", "(a * 100).cast(dtypes.int32)", "a.cast(dtypes.float64) * 2", "d * d + 1",
         "d.cast(dtypes.float32)", "l * 3 + l", "a.bitcast(dtypes.int32) + 1", "(a > 0).cast(dtypes.int32) + i",
         "(i > 0).where(i, j * 2)", "((a > 0) & (b < 0)).where(a, 1.0)", "(c8 > 0).where(c8, -c8)",
         "a.pad(((0, 0), (1, 3))) + 1", "a.cat(a * 2, dim=1)", "i.sum(1)", "i.max(1)", "a.max(0)", "a.argmax(1)",
         "bo.where(a, b)", "bo & (a > 0)", "a.floor()", "a.sqrt()", "a.reciprocal()", "a.cast(dtypes.float16)",
         "u8.cast(dtypes.int32) - 100", "i.cast(dtypes.int16) * 300"]
# float sums in another order (within a few ulp of the sum of magnitudes)
SUMS = ["a.sum(1)", "a @ m", "x4.conv2d(w, padding=1)", "x4.avg_pool2d()"]
# transcendentals (OpenCL's builtins here, within a few ulp)
MATH = ["a.softmax(-1)", "a.exp()", "a.sin()", "a.abs().log()", "a.sigmoid()", "d.exp()"]

def compute(dev: str, exprs: list[str]) -> list[np.ndarray]:
    env = {k: Tensor(v, device=dev) for k, v in DATA.items()} | {"dtypes": dtypes}
    outs = [eval(e, env) for e in exprs]
    outs[0].realize(*outs[1:])
    return [t.numpy() for t in outs]

def test_vector_kernels_against_cpu():
    assert dtypes.float32 in Device["CL"].renderer.vector_dtypes
    got, want = compute("CL", EXACT + SUMS + MATH), compute("CPU", EXACT + SUMS + MATH)
    for e, g, w in zip(EXACT + SUMS + MATH, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, e
        if e in EXACT: np.testing.assert_array_equal(g, w, err_msg=e)
        elif e in SUMS: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=e)
        else: np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7, err_msg=e)

def run_programs(items: list[tuple]) -> list[np.ndarray]:
    """Each program run on CL over copies of its arrays (element 0 the output); the outputs."""
    outs = []
    for p, arrays in items:
        bufs = [Buffer("CL", a.size, from_np_dtype(a.dtype)).copyin(memoryview(np.ascontiguousarray(a).reshape(-1)))
                for a in arrays]
        CompiledRunner(p)(bufs, {}, wait=True)
        outs.append(bufs[0].numpy().reshape(arrays[0].shape))
    return outs

def test_vload_spelling_runs():
    """The GPU spelling (vload4/vstore4) of elementwise kernels, a padded edge, integer and double vectors and a
    grouped reduction whose float4 partial sums go through local memory, built and run on PoCL."""
    ren = copy.copy(Device["CL"].renderer)
    ren.vload = True
    exprs = ["a + b * c", "a.pad(((0, 0), (1, 3))) * 2", "(c8 > 0).where(c8, -c8)", "d * d + 1", "a.cast(dtypes.int32)",
             "(a.T @ a)"]
    env = {k: Tensor(v, device="CL") for k, v in DATA.items()} | {"dtypes": dtypes}
    items, want = [], compute("CPU", exprs)
    for e, w in zip(exprs, want):
        (ei,) = [x for x in eval(e, env).schedule() if x.ast.op is Ops.SINK]
        p = get_program(ei.ast, ren)
        # (float4 vectors; a matmul's register tiles of 8 are float8)
        assert re.search(r"vload[48]\(0, ", p.src) and re.search(r"vstore[48]\(", p.src), e
        ins = {u.src[0].src[0].arg for u in p.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and
               u.src[0].src[0].op is Ops.DEFINE_GLOBAL}
        arrays = [np.zeros_like(w)] + [ei.bufs[k].numpy() if k in ins else None for k in range(1, len(ei.bufs))]
        items.append((p, [x if x is not None else np.zeros(1, np.float32) for x in arrays]))
    for e, g, w in zip(exprs, run_programs(items), want):
        if e == "(a.T @ a)": np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=e)
        else: np.testing.assert_array_equal(g, w, err_msg=e)

def ulps(got: np.ndarray, want: np.ndarray, dt) -> float:
    """The largest error of `got` in units of the last place of `dt` at the float64 reference `want` (the specials
    exactly)."""
    special = ~np.isfinite(want) | (np.abs(want) > np.finfo(dt).max)
    with np.errstate(over="ignore"):
        rounded = want.astype(dt)
    np.testing.assert_array_equal(got[special], rounded[special])
    spacing = np.spacing(np.abs(rounded[~special])).astype(np.float64)
    return float(np.max(np.abs(got[~special].astype(np.float64) - want[~special]) / spacing))

def test_native_math_accuracy():
    specials = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1e-45, 88.7, -103.9, 127.9, -149.5, 1e30, -3e38]
    x = np.concatenate([rng.standard_normal(20000) * 10, rng.uniform(-200, 200, 20000),
                        np.exp(rng.uniform(-87, 88, 20000)), specials]).astype(np.float32)
    t = Tensor(x, device="CL")
    outs = [t.exp(), t.exp2(), t.log2(), t.log(), t.sin()]
    outs[0].realize(*outs[1:])
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        refs = [np.exp(x64), np.exp2(x64), np.log2(x64), np.log(x64), np.sin(x64)]
    # OpenCL's full profile: exp, exp2, log2, log within 3 ulp, sin within 4 (log is log2 times ln 2 here: one more
    # rounding)
    for name, o, r, bound in zip(["exp", "exp2", "log2", "log", "sin"], outs, refs, [3, 3, 3, 4, 4]):
        assert ulps(o.numpy(), r, np.float32) <= bound, name
    src = get_program([x for x in t.sin().schedule() if x.ast.op is Ops.SINK][0].ast, Device["CL"].renderer).src
    assert "sin(" in src
