"""The CL device (OpenCL, here through PoCL on the CPU): programs against NumPy and PyTorch (elementwise ops with
broadcasting, reductions, matmuls, conv2d, softmax, every dtype, an MLP's forward and backward pass, TinyJit, a
symbolic shape), copies between CL and CPU and between two OpenCL devices, the disk cache, DEBUG=2 timings and the
errors: no OpenCL platform, no pyopencl, a source the OpenCL compiler rejects.

PoCL builds a program in about half a second whatever its number of kernels, and turns each kernel into machine code
at its first launch, so the tests realize many results at once (one schedule: one build)."""
from __future__ import annotations
import os
import subprocess
import sys
import numpy as np
import pytest
import torch

cl = pytest.importorskip("pyopencl")

from fusegrad import Tensor, TinyJit, Variable, dtypes  # noqa: E402
from fusegrad.device import Buffer, CompileError, Device, GlobalCounters  # noqa: E402
from fusegrad.dtype import to_np_dtype  # noqa: E402
from fusegrad.codegen import get_program  # noqa: E402
from fusegrad.engine.realize import sym_infer  # noqa: E402
from fusegrad.helpers import Context  # noqa: E402
from fusegrad.renderer.opencl import OpenCLRenderer, UnsupportedDType  # noqa: E402
from fusegrad.runtime.ops_cl import unpack  # noqa: E402
from fusegrad.uop.ops import Ops, UOp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
rng = np.random.default_rng(0)

def f32(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)

def realized(*ts: Tensor) -> list[np.ndarray]:
    """The values of `ts`, computed in one schedule (new kernels are built as one program)."""
    ts[0].realize(*ts[1:])
    for t in ts: assert t.device == "CL", t.device
    return [t.numpy() for t in ts]

def run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})

def test_elementwise_and_broadcasting():
    a, b, c = f32(3, 4), f32(1, 4), f32(3, 1)
    ta, tb, tc = (Tensor(x, device="CL") for x in (a, b, c))
    outs = realized(ta + tb * tc, (ta - tb).relu(), ta.exp(), ta.abs().log(), ta.abs().sqrt(), ta.sin(),
                    (ta < tb).where(ta, tc), ta.maximum(tb), ta / tc)
    want = [a + b * c, np.maximum(a - b, 0), np.exp(a), np.log(np.abs(a)), np.sqrt(np.abs(a)), np.sin(a),
            np.where(a < b, a, c), np.maximum(a, b), a / c]
    for got, w in zip(outs, want):
        assert got.shape == w.shape
        np.testing.assert_allclose(got, w, rtol=2e-6, atol=1e-6)
    # (bit for bit where IEEE fixes the result)
    np.testing.assert_array_equal(outs[0], a + b * c)
    np.testing.assert_array_equal(outs[8], a / c)
    np.testing.assert_array_equal(ta.bitcast(dtypes.int32).numpy(), a.view(np.int32))

def glob(i: int, dt, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)

def test_variables_of_every_kind():
    """Kernel arguments: an int8 Variable that wraps, float32/half/bfloat16/float64 ones narrowed inside the kernel,
    a symbolic loop bound."""
    # out[i] = in[i + off] * scale + (h + b) + d
    n, off = UOp.variable("n", 1, 64), UOp.variable("off", 0, 100, dtypes.int8)
    scale = UOp.variable("scale", -100, 100, dtypes.float32)
    h, b = UOp.variable("h", -100, 100, dtypes.float16), UOp.variable("b", -100, 100, dtypes.bfloat16)
    d = UOp.variable("d", -100, 100, dtypes.float64)
    r = UOp.range(n, 0)
    x = glob(1, dtypes.float32, 200).index(r + off.cast(dtypes.index)).load()
    val = x * scale + (h.cast(dtypes.float32) + b.cast(dtypes.float32)) + d.cast(dtypes.float32)
    ast = UOp.sink_of(glob(0, dtypes.float32, 64).index(r).store(val))
    dev = Device["CL"]
    p = get_program(ast, dev.renderer)
    assert [v.arg[0] for v in p.vars] == ["b", "d", "h", "n", "off", "scale"]
    prg = dev.runtime(p.function_name, dev.compiler.compile_cached(p.src))
    inp = np.arange(200, dtype=np.float32) / 7
    src = Buffer("CL", 200, dtypes.float32).copyin(memoryview(inp))
    for nv, ov, sv, hv, bv, dv in [(10, 3, 2.5, 1.0009765625, 1.00390625, 0.25), (64, 300, -1.1, 0.1, 3.3, 1e300)]:
        out = Buffer("CL", 64, dtypes.float32).copyin(memoryview(np.zeros(64, np.float32)))
        vals = {"b": bv, "d": dv, "h": hv, "n": nv, "off": ov, "scale": sv}
        # (launched as the engine launches it: a GPU-style kernel over its grid, with its symbolic dims evaluated)
        grid = dict(global_dims=tuple(sym_infer(g, vals) for g in p.global_dims), local_dims=p.local_dims) \
            if p.global_dims else dict(global_size=sym_infer(p.global_size, vals))
        prg(out._buf, src._buf, vals=tuple(vals[v.arg[0]] for v in p.vars), **grid)
        o = np.int8(np.int64(ov).astype(np.int8))
        with np.errstate(over="ignore"):
            add = np.float32(np.float16(hv)) + np.float32(torch.tensor(np.float32(bv)).bfloat16().float().item())
            want = inp[o:o + nv] * np.float32(sv) + add + np.float32(dv)
        got = out.numpy()
        np.testing.assert_array_equal(got[:nv], want)
        assert not got[nv:].any()

def test_renderer_without_doubles():
    """For a device without cl_khr_fp64 a float Variable is passed as float, and a float64 kernel is refused by
    name (rendered only: PoCL has doubles)."""
    ren = OpenCLRenderer(has_fp64=False, device_name="CL (no doubles)")
    scale, r = UOp.variable("scale", -100, 100, dtypes.float32), UOp.range(16, 0)
    ast = UOp.sink_of(glob(0, dtypes.float32, 16).index(r).store(glob(1, dtypes.float32, 16).index(r).load() * scale))
    src = get_program(ast, ren).src
    assert "float scale" in src and "double" not in src
    ast = UOp.sink_of(glob(0, dtypes.float64, 16).index(r).store(glob(1, dtypes.float64, 16).index(r).load() * 2.0))
    with pytest.raises(UnsupportedDType, match=r"float64.*CL \(no doubles\)"): get_program(ast, ren)

INTS = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32, dtypes.int64,
        dtypes.uint64]

def test_every_dtype():
    """Integer arithmetic (wrapping, truncating division, shifts), float16/32/64 arithmetic rounded per op, bool
    logic, and bfloat16 (computed in float) against torch: one kernel per dtype (the results stacked), one schedule."""
    # (signed: negative operands, floor division and modulo as NumPy's; every type: x // 0 and x % 0 give 0)
    xi, yi = rng.integers(0, 100, 24), np.append(rng.integers(1, 20, 23), 0)
    xs, ys = rng.integers(-50, 50, 24), np.append(rng.integers(-9, 10, 23), 0)
    xf, yf = rng.standard_normal(24) * 10, rng.standard_normal(24)
    outs, wants = [], []
    for dt in INTS:
        npdt = to_np_dtype(dt)
        a, b = (xi.astype(npdt), yi.astype(npdt)) if dtypes.is_unsigned(dt) else (xs.astype(npdt), ys.astype(npdt))
        ta, tb = Tensor(a, device="CL"), Tensor(b, device="CL")
        outs.append(Tensor.stack(ta * tb + ta, ta // tb, ta % tb, (ta < tb).cast(dt), ta.maximum(tb), ta << 2,
                                 ta - tb * 9))
        with np.errstate(over="ignore", divide="ignore"):
            wants.append(np.stack([a * b + a, a // b, a % b, (a < b).astype(npdt), np.maximum(a, b),
                                   a << npdt.type(2), a - b * npdt.type(9)]))
    for dt in (dtypes.float16, dtypes.float32, dtypes.float64):
        npdt = to_np_dtype(dt)
        a, b = xf.astype(npdt), yf.astype(npdt)
        ta, tb = Tensor(a, device="CL"), Tensor(b, device="CL")
        outs.append(Tensor.stack(ta * tb + ta, ta / tb, (ta < tb).cast(dt), ta.maximum(tb),
                                 ta.cast(dtypes.int32).cast(dt), tb.abs().sqrt()))
        wants.append(np.stack([a * b + a, a / b, (a < b).astype(npdt), np.maximum(a, b),
                               a.astype(np.int32).astype(npdt), np.sqrt(np.abs(b))]))
    ba, bb = xi % 3 == 0, yi % 2 == 0
    tba, tbb = Tensor(ba, device="CL"), Tensor(bb, device="CL")
    outs.append(Tensor.stack(tba & tbb, tba | tbb, tba ^ tbb, tba.logical_not()))
    wants.append(np.stack([ba & bb, ba | bb, ba ^ bb, ~ba]))
    # bfloat16: computed in float32 and rounded after each op, as torch does on the CPU
    ta, tb = (Tensor(v.astype(np.float32), device="CL").cast(dtypes.bfloat16) for v in (xf, yf))
    outs.append(Tensor.stack(ta * tb + ta, ta.exp()).cast(dtypes.float32))
    tta, ttb = (torch.tensor(v, dtype=torch.float32).bfloat16() for v in (xf, yf))
    got = realized(*outs)
    for g, w, t in zip(got, wants, outs):
        assert g.dtype == w.dtype, t.dtype
        np.testing.assert_array_equal(g, w, err_msg=str(t.dtype))
    np.testing.assert_array_equal(got[-1][0], (tta * ttb + tta).float().numpy())
    # exp in bfloat16: within the rounding of a bfloat16 result
    np.testing.assert_allclose(got[-1][1], np.exp(tta.float().numpy()), rtol=2 ** -8)

def test_mlp_forward_and_backward():
    x, w1, b1, w2 = f32(8, 12), f32(12, 16) * 0.3, f32(16), f32(16, 5) * 0.3
    tx = Tensor(x, device="CL")
    tw1, tb1, tw2 = (Tensor(a, device="CL", requires_grad=True) for a in (w1, b1, w2))
    loss = (tx @ tw1 + tb1).relu().matmul(tw2).log_softmax(-1).mean()
    loss.backward()
    got = realized(loss, tw1.grad, tb1.grad, tw2.grad)
    rx = torch.tensor(x)
    rw1, rb1, rw2 = (torch.tensor(a, requires_grad=True) for a in (w1, b1, w2))
    ref = (rx @ rw1 + rb1).relu().matmul(rw2).log_softmax(-1).mean()
    ref.backward()
    for g, r in zip(got, [ref, rw1.grad, rb1.grad, rw2.grad]):
        np.testing.assert_allclose(g, r.detach().numpy(), rtol=1e-5, atol=1e-6)

def test_tinyjit_replays_on_cl():
    w = Tensor(f32(6, 3), device="CL").realize()
    @TinyJit
    def step(x: Tensor) -> Tensor: return (x @ w).relu().realize()
    for i in range(4):
        x = f32(4, 6)
        got = step(Tensor(x, device="CL")).numpy()
        np.testing.assert_allclose(got, np.maximum(x @ w.numpy(), 0), rtol=1e-5, atol=1e-6, err_msg=f"call {i}")

def test_symbolic_shape():
    a = f32(10, 4)
    ta = Tensor(a, device="CL").realize()
    n = Variable("n", 1, 10)
    for v in (3, 10, 1):
        got = (ta[:n.bind(v)] * 2).sum(0).numpy()
        np.testing.assert_allclose(got, (a[:v] * 2).sum(0), rtol=1e-6, atol=1e-6, err_msg=f"n={v}")

def test_copies_between_cl_and_cpu():
    x = f32(5, 7)
    t = Tensor(x, device="CL")
    back = (t.to("CPU") + 1).numpy()
    np.testing.assert_array_equal(back, x + 1)
    there = (Tensor(x).to("CL") * 2)
    assert there.device == "CL"
    np.testing.assert_array_equal(there.numpy(), x * 2)
    # an empty tensor and a buffer's raw bytes
    assert Tensor.empty(0, device="CL").numpy().shape == (0,)
    buf = Buffer("CL", 6, dtypes.int16).copyin(memoryview(np.arange(6, dtype=np.int16)))
    np.testing.assert_array_equal(buf.numpy(), np.arange(6, dtype=np.int16))

def test_two_cl_devices():
    """CL:0 <-> CL:1 (PoCL's CPU device listed twice), a kernel on each."""
    code = """
import numpy as np
from fusegrad import Tensor
x = np.arange(12, dtype=np.float32).reshape(3, 4)
a = Tensor(x, device="CL") * 2
b = a.to("CL:1") + 1
c = b.to("CL") - 3
assert b.device == "CL:1" and c.device == "CL", (b.device, c.device)
np.testing.assert_array_equal(b.numpy(), x * 2 + 1)
np.testing.assert_array_equal(c.numpy(), x * 2 - 2)
np.testing.assert_array_equal((b.to("CPU") * 0.5).numpy(), (x * 2 + 1) * 0.5)
from fusegrad.runtime.ops_cl import cl_devices
n = len(cl_devices())
try: Tensor([1.0], device=f"CL:{n}").numpy()
except RuntimeError as e: print("ERR", n, e)
print("OK")
"""
    res = run(code, {"POCL_DEVICES": "pthread pthread"})
    assert res.returncode == 0, res.stderr
    assert "OK" in res.stdout
    n = res.stdout.split()[1]
    assert f"CL:{n} is OpenCL device {n}, but there are {n}" in res.stdout

def test_default_device_is_cpu_and_dev_cl_selects_cl():
    res = run("from fusegrad import Tensor; from fusegrad.device import Device; t = Tensor([1.5]) * 2; "
              "print(Device.DEFAULT, t.device, t.numpy()[0])", {"DEV": "CL"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["CL", "CL", "3.0"]
    assert Device.DEFAULT == "CPU" or os.getenv("DEV")

def test_no_platform_error():
    """Where the ICD loader finds no OpenCL implementation: an error naming what to install, not a crash."""
    code = "from fusegrad import Tensor\ntry: Tensor([1.0], device='CL').numpy()\nexcept RuntimeError as e: print(e)"
    res = run(code, {"OCL_ICD_VENDORS": "/nonexistent-opencl-vendors"})
    assert res.returncode == 0, res.stderr
    assert "no OpenCL platform" in res.stdout and "pip install 'fusegrad[opencl]'" in res.stdout

def test_no_pyopencl_error():
    code = "import sys; sys.modules['pyopencl'] = None\nfrom fusegrad import Tensor\n" \
           "try: Tensor([1.0], device='CL').numpy()\nexcept ImportError as e: print(e)"
    res = run(code)
    assert res.returncode == 0, res.stderr
    assert "needs pyopencl" in res.stdout and "pip install 'fusegrad[opencl]'" in res.stdout

def test_build_error_names_line_and_message():
    src = "__kernel void broken(__global float* a) {\n  long i = get_global_id(0);\n  a[i] = undeclared_x * 2;\n}\n"
    with pytest.raises(CompileError) as e: Device["CL"].compiler.compile(src)
    msg = str(e.value)
    assert "OpenCL build failed on CL" in msg
    assert "line 3:" in msg and "undeclared_x" in msg and "a[i] = undeclared_x * 2;" in msg

def test_build_error_for_a_cpu_the_compiler_does_not_know():
    """PoCL's log when its LLVM has no name for the host CPU (the PoCL in pyopencl's wheel on AMD's Zen 5): the
    message says so and what to do."""
    from fusegrad.runtime.ops_cl import build_error
    msg = build_error("CL", "error: unknown target CPU 'generic'\nDevice pthread failed to build the program", "x")
    assert "doesn't know this CPU" in msg and "pocl-opencl-icd" in msg and "unknown target CPU 'generic'" in msg

def test_disk_cache_and_timings(tmp_path, monkeypatch):
    """A binary compiled once is read back from the disk cache (keyed by the device and driver); DEBUG=2 times
    kernels with the queue's events."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    comp = Device["CL"].compiler
    src = "__kernel void cached_k(__global float* a) { a[get_global_id(0)] += 1.0f; }\n"
    lib = comp.compile_cached(src)
    assert os.path.exists(comp.cache_path(src)) and str(tmp_path) in comp.cache_path(src)
    comp.mem_cache.clear()
    hits, compiles = comp.disk_hits, comp.compiles
    assert comp.compile_cached(src) == lib and (comp.disk_hits, comp.compiles) == (hits + 1, compiles)
    assert Device["CL"].cl_device.driver_version in comp.cachekey
    # an entry that isn't a program (a truncated file here) is compiled again, not loaded
    path = comp.cache_path(src)
    with open(path, "r+b") as f: f.truncate(os.path.getsize(path) - 8)
    comp.mem_cache.clear()
    assert comp.compile_cached(src) == lib and comp.compiles == compiles + 1
    assert unpack(lib[:12]) is None and unpack(b"ELF" + lib[3:]) is None and unpack(lib)[0] == src
    x = f32(64)
    GlobalCounters.reset()
    with Context(DEBUG=2): got = (Tensor(x, device="CL") * 3).numpy()
    np.testing.assert_array_equal(got, x * 3)
    assert GlobalCounters.time_sum_s > 0

def _half_edges() -> np.ndarray:
    """float64 values around every float16: each one, the midpoints between neighbours (ties, rounded to even) and a
    float32 step either side of them, overflow's edge (65504, 65520), zeros, infinities, nans of both signs."""
    h = np.arange(0x7c00, dtype=np.uint16).view(np.float16).astype(np.float64)   # every finite positive half
    mid = (h[:-1] + h[1:]) / 2
    step = np.abs(mid) * 2.0 ** -23 + 2.0 ** -149
    pos = np.concatenate([h, mid, mid + step, mid - step, [65504.0, 65519.0, 65520.0, 65536.0, 1e6, 2.0 ** -25,
                                                          2.0 ** -26, 2.0 ** -140]])
    return np.concatenate([pos, -pos, [np.inf, -np.inf, np.nan, -np.nan]])

def test_half_conversions_round_to_nearest_even():
    """float32 and float64 -> half rounded once to nearest even, half -> float32 exact, over every half, every tie
    between two halves and the values beside the ties: bit for bit as NumPy, nans as nans of the same sign."""
    x64 = _half_edges()
    x32 = x64.astype(np.float32)
    every_half = np.arange(0x10000, dtype=np.uint16).view(np.float16)
    t32, t64, th = Tensor(x32, device="CL"), Tensor(x64, device="CL"), Tensor(every_half, device="CL")
    got = realized(t32.cast(dtypes.float16), t64.cast(dtypes.float16), th.cast(dtypes.float32))
    with np.errstate(over="ignore"): want = [x32.astype(np.float16), x64.astype(np.float16)]
    for g, w in zip(got, want + [every_half.astype(np.float32)]):
        nan = np.isnan(w)
        np.testing.assert_array_equal(np.isnan(g), nan)
        np.testing.assert_array_equal(np.signbit(g), np.signbit(w))
        ut = np.uint16 if g.dtype == np.float16 else np.uint32
        np.testing.assert_array_equal(g[~nan].view(ut), w[~nan].view(ut))

def test_program_binary_path(monkeypatch):
    """The lib of a device whose program binary is kept (every OpenCL device but PoCL, whose lib is the source alone):
    the binary is loaded and runs."""
    dev = Device["CL"]
    src = "__kernel void binary_k(__global float* a) { a[get_global_id(0)] *= 3.0f; }\n"
    pocl = "Portable Computing Language" in dev.cl_device.platform.name
    assert (unpack(dev.compiler.compile(src))[1] == b"") == pocl
    monkeypatch.setattr(dev.compiler, "keep_binary", True)
    lib = dev.compiler.compile(src)
    assert unpack(lib)[0] == src and len(unpack(lib)[1]) > 0
    buf = Buffer("CL", 4, dtypes.float32).copyin(memoryview(np.arange(4, dtype=np.float32)))
    dev.runtime("binary_k", lib)(buf._buf, global_size=4, wait=True)
    np.testing.assert_array_equal(buf.numpy(), np.arange(4, dtype=np.float32) * 3)
