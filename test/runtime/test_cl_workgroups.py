"""GPU-style kernels on the CL device (PoCL): linearized UOp lists built by hand with the contract's ops (SPECIAL ids,
DEFINE_LOCAL memory of a work-group, BARRIERs, gated stores), rendered by OpenCLRenderer, built and launched over a
grid of work-groups by the CL runtime, checked against NumPy. Also the launches the runtime refuses (a work-group
larger than the device takes, more local memory than it has) and the messages of a failed build and of a missing
OpenCL platform.

The kernels of a test are built as one program (PoCL takes about as long to build one kernel as ten)."""
from __future__ import annotations
import math
import numpy as np
import pytest

cl = pytest.importorskip("pyopencl")

from fusegrad.device import Buffer, CompileError, Device  # noqa: E402
from fusegrad.dtype import DType, dtypes, to_np_dtype  # noqa: E402
from fusegrad.renderer.opencl import OpenCLRenderer  # noqa: E402
from fusegrad.runtime import ops_cl  # noqa: E402
from fusegrad.runtime.ops_cl import CLProgram, check_group, launch_dims  # noqa: E402
from fusegrad.uop.ops import Ops, UOp  # noqa: E402

rng = np.random.default_rng(0)

# *** building linearized kernels ***

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)
def local(i: int, dt: DType, n: int) -> UOp: return UOp(Ops.DEFINE_LOCAL, dt.ptr(n, "local"), arg=i)
def special(name: str, size: int) -> UOp: return UOp(Ops.SPECIAL, dtypes.index, (UOp.const(dtypes.index, size),), name)
def idx(v: int) -> UOp: return UOp.const(dtypes.index, v)

def linear(*stmts: UOp) -> list[UOp]:
    """The nodes of `stmts` in order, each statement after the nodes it needs (what a linearizer gives; a node first
    needed inside a loop must not be needed after it: list it before the loop)."""
    seen: dict[UOp, None] = {}
    for s in stmts: seen = s.toposort(known=seen)
    return list(seen)

def build(ren: OpenCLRenderer, kernels: dict[str, list[UOp]]) -> dict[str, CLProgram]:
    """Render each kernel, build them as one program, load each."""
    dev = Device["CL"]
    srcs = {name: ren.render(uops, name) for name, uops in kernels.items()}
    lib = dev.compiler.compile_cached("\n".join(srcs.values()))
    return {name: CLProgram(dev, name, lib) for name in srcs}

def cl_buf(a: np.ndarray, dt: DType) -> Buffer: return Buffer("CL", a.size, dt).copyin(memoryview(a.reshape(-1)))

# *** elementwise over work-groups ***

def test_renders_the_contract():
    """The OpenCL of a GPU-style kernel: ids, a __local array at the kernel's scope, the barrier where it is in the
    list, a gated store, and no core_lo/core_hi."""
    out, g, l = glob(0, dtypes.float32, 64), special("gidx0", 4), special("lidx0", 16)
    loc = local(0, dtypes.float32, 16)
    st = loc.index(l).store(l.cast(dtypes.float32))
    bar = UOp(Ops.BARRIER, loc.dtype, (loc, st))
    last = out.index(g, valid=l.eq(0)).store(bar.index(idx(15) - l).load())
    src = OpenCLRenderer().render(linear(out, g, l, loc, st, bar, last), "k")
    lines = [x.strip() for x in src.splitlines()]
    assert "__kernel void k(__global float* restrict data0) {" in lines
    body = lines[lines.index("__kernel void k(__global float* restrict data0) {") + 1:]
    assert body[:3] == ["__local float local0[16];", "long gidx0 = (long)get_group_id(0);",
                        "long lidx0 = (long)get_local_id(0);"]
    assert body.index("barrier(CLK_LOCAL_MEM_FENCE);") == body.index("local0[lidx0] = ((float)(lidx0));") + 1
    assert "core_lo" not in src and "get_global_id" not in src
    assert any(x.startswith("if (") and "data0[gidx0] =" in x for x in body)

def test_elementwise_with_gated_tail():
    """out[i] = a[i] * b[i] + i over groups x work-items, where only i < n stores (n a Variable)."""
    L, G, cap = 32, 5, 160
    out, a, b = glob(0, dtypes.float32, cap), glob(1, dtypes.float32, cap), glob(2, dtypes.float32, cap)
    n = UOp.variable("n", 0, cap)
    g, lid = special("gidx0", G), special("lidx0", L)
    i = g * L + lid
    ok = i < n
    val = a.index(i, valid=ok).load() * b.index(i, valid=ok).load() + i.cast(dtypes.float32)
    st = out.index(i, valid=ok).store(val)
    prg = build(OpenCLRenderer(), {"ew_tail": linear(out, a, b, n, g, lid, st)})["ew_tail"]
    x, y = rng.standard_normal(cap).astype(np.float32), rng.standard_normal(cap).astype(np.float32)
    bx, by = cl_buf(x, dtypes.float32), cl_buf(y, dtypes.float32)
    for nv in (cap, 133, 1, 0):
        bo = cl_buf(np.full(cap, -7, np.float32), dtypes.float32)
        prg(bo._buf, bx._buf, by._buf, vals=(nv,), global_dims=(G,), local_dims=(L,), wait=True)
        want = np.full(cap, -7, np.float32)
        want[:nv] = x[:nv] * y[:nv] + np.arange(nv, dtype=np.float32)
        np.testing.assert_array_equal(bo.numpy(), want, err_msg=f"n={nv}")

@pytest.mark.parametrize("ndim", [2, 3])
def test_multi_dim_launch(ndim: int):
    """Ids along each launch dimension: out[z, y, x] = inp[x, y, z] + 1000 x + 100 y + z, the grid covering the
    output once (groups and work-items of different counts along each dimension, so a mixed-up dimension shows)."""
    gd, ld = ((3, 5, 2), (4, 2, 3))
    gd, ld = gd[:ndim], ld[:ndim]
    ext = [g * n for g, n in zip(gd, ld)] + [1] * (3 - ndim)   # x, y, z extents
    X, Y, Z = ext
    out, inp = glob(0, dtypes.int32, X * Y * Z), glob(1, dtypes.int32, X * Y * Z)
    ids = [(special(f"gidx{d}", gd[d]), special(f"lidx{d}", ld[d])) for d in range(ndim)]
    pos = [g * ld[d] + lid for d, (g, lid) in enumerate(ids)] + [idx(0)] * (3 - ndim)
    x, y, z = pos
    val = inp.index((x * Y + y) * Z + z).load() + (x * 1000 + y * 100 + z).cast(dtypes.int32)
    st = out.index((z * Y + y) * X + x).store(val)
    prg = build(OpenCLRenderer(), {f"grid{ndim}": linear(out, inp, *[s for p in ids for s in p], st)})[f"grid{ndim}"]
    src = rng.integers(-50, 50, (X, Y, Z)).astype(np.int32)
    bo, bi = cl_buf(np.zeros(X * Y * Z, np.int32), dtypes.int32), cl_buf(src, dtypes.int32)
    prg(bo._buf, bi._buf, global_dims=gd, local_dims=ld, wait=True)
    xs, ys, zs = np.meshgrid(np.arange(X), np.arange(Y), np.arange(Z), indexing="ij")
    want = (src + xs * 1000 + ys * 100 + zs).transpose(2, 1, 0)
    np.testing.assert_array_equal(bo.numpy().reshape(Z, Y, X), want)

# *** a reduction across a work-group through local memory ***

def _identity(op: Ops, dt: DType):
    if op is Ops.ADD: return 0
    return -math.inf if dtypes.is_float(dt) else dtypes.min(dt)

def reduce_kernel(op: Ops, dt: DType, acc_dt: DType, L: int, rows: int, cap: int) -> list[UOp]:
    """out[r] = op over inp[r * n : r * n + n] (n a Variable): one work-group per row; work-item l combines the
    elements l, l + L, ... in a register, then the group combines its L values in local memory in log2(L) steps of
    halving, a barrier after each; work-item 0 stores the row's result."""
    out, inp, n = glob(0, dt, rows), glob(1, dt, cap), UOp.variable("n", 1, cap // rows)
    g, lid = special("gidx0", rows), special("lidx0", L)
    loc, acc = local(0, acc_dt, L), UOp(Ops.DEFINE_REG, acc_dt, arg=0)
    ident = UOp.const(acc_dt, _identity(op, acc_dt))
    row = g * n
    init = acc.store(ident)
    j = UOp.range((n + (L - 1)) // L, 1, "reduce")
    i = j * L + lid
    ok = i < n
    x = ok.where(inp.index(row + i, valid=ok).load().cast(acc_dt), ident)
    step = acc.store(acc.load(init, j).alu(op, x))
    done = UOp(Ops.END, dtypes.void, (step, j))
    to_local = loc.index(lid).store(acc.load(done))
    stmts = [out, inp, n, g, lid, loc, acc, row, init, j, step, done, to_local]
    bar = UOp(Ops.BARRIER, loc.dtype, (loc, to_local))
    s = L // 2
    while s >= 1:
        half = lid < s
        combined = bar.index(lid).load().alu(op, bar.index(lid + s, valid=half).load())
        st = loc.index(lid, valid=half).store(combined)
        stmts += [bar, st]
        bar = UOp(Ops.BARRIER, loc.dtype, (loc, st))
        s //= 2
    stmts += [bar, out.index(g, valid=lid.eq(0)).store(bar.index(idx(0)).load().cast(dt))]
    return linear(*stmts)

ROW_LENGTHS = (1, 7, 255, 257, 4097)
ALL_CASES = [(op, dt, L) for op in (Ops.ADD, Ops.MAX) for dt in (dtypes.float32, dtypes.float16, dtypes.int32)
             for L in (16, 64, 256)]
# (each kernel with barriers takes PoCL seconds to build: the default run has one of each dtype, op and group size)
SOME_CASES = [(Ops.ADD, dtypes.float32, 64), (Ops.MAX, dtypes.float16, 16), (Ops.ADD, dtypes.int32, 256),
              (Ops.MAX, dtypes.int32, 16)]

def check_reductions(cases: list[tuple[Ops, DType, int]]) -> None:
    """Sum and max of rows of lengths 1 to 4097 with groups of L work-items, in float32, float16 (its sum accumulated
    in float32, its max in half: a __local array of 16-bit floats) and int32. Sums are of integers, so every order of
    adding them gives the exact value NumPy does."""
    rows, cap = 3, 3 * max(ROW_LENGTHS)
    kernels = {}
    for op, dt, L in cases:
        acc_dt = dtypes.float32 if (op is Ops.ADD and dt == dtypes.float16) else dt
        kernels[f"red_{op.name.lower()}_{dt.name}_{L}"] = reduce_kernel(op, dt, acc_dt, L, rows, cap)
    prgs = build(OpenCLRenderer(), kernels)
    for name, p in prgs.items():
        body = p.source.split(f"void {name}(")[1].split("\n}\n")[0]
        assert ("__local fg_half local0[" if "max_half" in name else "__local ") in body
        assert body.count("barrier(CLK_LOCAL_MEM_FENCE);") == int(name.split("_")[-1]).bit_length()
    for dt in {dt for _, dt, _ in cases}:
        npdt = to_np_dtype(dt)
        for nv in ROW_LENGTHS:
            ints = rng.integers(-8, 9, (rows, nv))
            data = {Ops.ADD: ints.astype(npdt), Ops.MAX: rng.standard_normal((rows, nv)).astype(npdt) if
                    dtypes.is_float(dt) else rng.integers(-2 ** 31, 2 ** 31, (rows, nv)).astype(npdt)}
            bufs = {op: cl_buf(np.pad(a.reshape(-1), (0, cap - a.size)), dt) for op, a in data.items()}
            for op, _, L in [c for c in cases if c[1] == dt]:
                bo = cl_buf(np.zeros(rows, npdt), dt)
                prgs[f"red_{op.name.lower()}_{dt.name}_{L}"](bo._buf, bufs[op]._buf, vals=(nv,), global_dims=(rows,),
                                                            local_dims=(L,), wait=True)
                want = ints.sum(1).astype(npdt) if op is Ops.ADD else data[op].max(1)
                np.testing.assert_array_equal(bo.numpy(), want, err_msg=f"{op} {dt} n={nv} L={L}")

def test_workgroup_reductions(): check_reductions(SOME_CASES)

@pytest.mark.slow
def test_workgroup_reductions_all(): check_reductions(ALL_CASES)

# *** launches refused ***

def test_group_larger_than_the_device_takes_is_refused():
    d = Device["CL"].cl_device
    most = int(d.max_work_group_size)
    out, g, l0, l1 = glob(0, dtypes.int32, 1), special("gidx0", 1), special("lidx0", 64), special("lidx1", most)
    st = out.index(idx(0), valid=(l0 + l1).eq(0)).store(UOp.const(dtypes.int32, 5))
    prg = build(OpenCLRenderer(), {"too_wide": linear(out, g, l0, l1, st)})["too_wide"]
    bo = cl_buf(np.zeros(1, np.int32), dtypes.int32)
    with pytest.raises(RuntimeError, match=rf"kernel too_wide on CL: a work-group of {64 * most} work-items "
                                           rf"\(local_dims \(64, {most}\)\); the most it takes is {most}"):
        prg(bo._buf, global_dims=(1, 1), local_dims=(64, most), wait=True)
    assert bo.numpy()[0] == 0   # (never launched)
    prg(bo._buf, global_dims=(1, 1), local_dims=(1, 1), wait=True)
    assert bo.numpy()[0] == 5

def test_local_memory_beyond_the_device_is_refused():
    dev = Device["CL"]
    have = int(dev.cl_device.local_mem_size)
    assert dev.renderer.local_bytes == have and dev.renderer.max_workgroup == dev.cl_device.max_work_group_size
    n = have // 4 + 1024   # floats: 4 KiB more than the device has
    out, g, lid, loc = glob(0, dtypes.float32, 1), special("gidx0", 1), special("lidx0", 1), local(0, dtypes.float32, n)
    st = loc.index(lid).store(UOp.const(dtypes.float32, 2.0))
    bar = UOp(Ops.BARRIER, loc.dtype, (loc, st))
    last = out.index(lid).store(bar.index(lid).load())
    prg = build(OpenCLRenderer(), {"too_much_local": linear(out, g, lid, loc, st, bar, last)})["too_much_local"]
    bo = cl_buf(np.zeros(1, np.float32), dtypes.float32)
    with pytest.raises(RuntimeError, match=rf"kernel too_much_local on CL: {4 * n} bytes of local memory per "
                                           rf"work-group; the device has {have}"):
        prg(bo._buf, global_dims=(1,), local_dims=(1,), wait=True)
    assert bo.numpy()[0] == 0

def test_group_limits_checked_per_dimension():
    """The limits along each dimension (PoCL's equal its total: checked here with another device's)."""
    limits = dict(max_items=1024, max_sizes=(1024, 1024, 64), local_mem=48 * 1024)
    check_group("k", "GPU", (1, 8, 64), 48 * 1024, **limits)   # at every limit: fine
    with pytest.raises(RuntimeError, match=r"kernel k on GPU: 128 work-items along dimension 2 \(local_dims "
                                           r"\(1, 1, 128\)\); the most is 64"):
        check_group("k", "GPU", (1, 1, 128), 0, **limits)
    with pytest.raises(RuntimeError, match=r"a work-group of 2048 work-items .* the most it takes is 1024"):
        check_group("k", "GPU", (32, 64), 0, **limits)
    with pytest.raises(RuntimeError, match=r"49153 bytes of local memory per work-group; the device has 49152"):
        check_group("k", "GPU", (256,), 48 * 1024 + 1, **limits)
    assert launch_dims("k", (4, np.int64(2)), (8, 1)) == ((4, 2), (8, 1))
    with pytest.raises(ValueError, match=r"kernel k: global_dims \(4, 2\) and local_dims \(8,\) must have the same"):
        launch_dims("k", (4, 2), (8,))
    with pytest.raises(ValueError, match=r"kernel k: a launch with global_dims needs local_dims"):
        launch_dims("k", (4,), None)
    with pytest.raises(ValueError, match=r"local_dims \(0,\) >= 1"): launch_dims("k", (4,), (0,))

def test_renderer_limits_and_dialect_errors():
    ren = OpenCLRenderer()
    assert (ren.has_local, ren.max_workgroup, ren.local_max, ren.local_bytes) == (True, 256, (256, 256, 256), 32768)
    assert ren.global_max == (2 ** 31 - 1,) * 3
    out = glob(0, dtypes.int32, 4)
    with pytest.raises(ValueError, match=r"SPECIAL 'tidx0': the ids are named gidx0-2"):
        ren.render(linear(out, s := special("tidx0", 4), out.index(s).store(s.cast(dtypes.int32))), "k")
    g, r = special("gidx0", 2), UOp.range(2, 0, "global")
    with pytest.raises(ValueError, match=r"loop ridx0 is a parallel \(global\) loop in a kernel with work-group ids"):
        ren.render(linear(out, g, r, out.index(g * 2 + r).store(r.cast(dtypes.int32))), "k")

# *** messages ***

def test_build_error_shows_the_line_and_message():
    """A __local array inside a block (OpenCL allows them only at a kernel's outermost scope): the error names the
    line, shows it and the compiler's message, and lists the numbered source."""
    src = ("__kernel void bad_local(__global float* restrict data0) {\n  long lidx0 = (long)get_local_id(0);\n"
           "  if (lidx0 == 0) {\n    __local float tmp[4];\n    tmp[0] = 1.0f;\n    data0[0] = tmp[0];\n  }\n}\n")
    with pytest.raises(CompileError) as e: Device["CL"].compiler.compile(src)
    msg = str(e.value)
    assert "OpenCL build failed on CL:\nline 4: " in msg and "local" in msg.split("line 4: ")[1].split("\n")[0]
    assert "\n    __local float tmp[4];\n" in msg   # the offending line under its message
    assert "   4     __local float tmp[4];" in msg   # the numbered source

@pytest.mark.parametrize("platforms", ["raises", "none"])
def test_no_opencl_platform(monkeypatch, platforms: str):
    """Where pyopencl finds no platform (its get_platforms raising, as with no ICD, or giving none): a clear error
    naming what to install."""
    def get_platforms():
        if platforms == "raises": raise cl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")
        return []
    monkeypatch.setattr(cl, "get_platforms", get_platforms)
    ops_cl.cl_devices.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"the CL device found no OpenCL platform.*pip install "
                                               r"'fusegrad\[opencl\]' \(pyopencl, and PoCL"):
            ops_cl.CLDevice("CL:0")
    finally:
        ops_cl.cl_devices.cache_clear()
