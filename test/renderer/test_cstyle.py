"""The C the CPU renderer writes around and inside a kernel: names, signature, ProgramSpec fields, compile flags,
gated loads, operands pinned to registers."""
import subprocess
import numpy as np
from fusegrad.codegen import get_program
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX2, AVX512, RENDERER, compile_program, glob, matmul_ast, reduce, renderer_like, \
    rng, run

def add_ast(M=4, N=8) -> UOp:
    r0, r1 = rng(M, 0), rng(N, 1)
    idx = r0 * N + r1
    val = glob(1, dtypes.float32, M * N).index(idx).load() + glob(2, dtypes.float32, M * N).index(idx).load()
    return UOp.sink_of(glob(0, dtypes.float32, M * N).index(idx).store(val))

def test_render_smoke():
    # (16 columns: whole vectors, so the loops aren't merged)
    p = get_program(add_ast(4, 16), RENDERER)
    assert p.name == "E_4_16" and p.device == "CPU"
    # a kernel of the same name with another body gets another symbol, so both can live in one shared object
    doubled = add_ast(4, 16).substitute({add_ast(4, 16).src[0].src[1]: add_ast(4, 16).src[0].src[1] * 2.0})
    q = get_program(doubled, RENDERER)
    assert q.name == "E_4_16" and p.function_name.startswith("E_4_16_") and q.function_name != p.function_name
    assert f"void {p.function_name}(float* restrict data0, const float* restrict data1, const float* restrict data2, " \
           "long core_lo, long core_hi)" in p.src
    assert "#include" not in p.src
    assert "for (long ridx0 = core_lo; ridx0 < core_hi; ridx0++)" in p.src
    assert (p.globals, p.outs, p.ins, p.vars, p.global_size) == ([0, 1, 2], [0], [1, 2], [], 4)
    assert p.estimates.ops == 64 and p.estimates.mem == 3 * 64 * 4
    compile_program(p)  # compiles without warnings turning into errors

def test_read_only_names_only_buffers_the_kernel_never_writes():
    # (host reads of a buffer in `read_only` don't wait for the queued kernel: one it writes must never be there)
    assert get_program(add_ast(4, 16), RENDERER).read_only == [1, 2]
    r0, g0, g1 = rng(64, 0), glob(0, dtypes.float32, 64), glob(1, dtypes.float32, 64)
    in_place = UOp.sink_of(g0.index(r0).store(g0.index(r0).load() + g1.index(r0).load()))
    p = get_program(in_place, RENDERER)
    assert (p.ins, p.outs, p.read_only) == ([0, 1], [0], [1])
    # a product whose weight is packed by transposing copies (TRANSPOSED_COPY reads it): both operands read-only
    from fusegrad import Tensor
    x, w = Tensor.rand(128, 784).realize(), Tensor.rand(512, 784).realize()
    (si,) = (x @ w.T).schedule()
    for ren in (RENDERER, renderer_like(AVX512), renderer_like(AVX2)):
        p = get_program(si.ast, ren)
        assert any(u.op is Ops.TRANSPOSED_COPY for u in p.uops)
        assert (p.outs, p.read_only) == ([0], [1, 2])

def test_render_compiles_warning_free():
    p = get_program(matmul_ast(32, 32, 32), RENDERER)
    res = subprocess.run(["cc", "-O1", "-march=native", "-Wall", "-Wextra", "-fsyntax-only", "-x", "c", "-"],
                         input=p.src, capture_output=True, text=True)
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr

def test_vars_in_signature_sorted_by_name():
    b, a = UOp.variable("b", 0, 10), UOp.variable("a", 1, 10)
    r = rng(a, 0)
    ast = UOp.sink_of(glob(0, dtypes.int32, 32).index(r + b).store(r.cast(dtypes.int32)))
    p = get_program(ast, RENDERER)
    assert [v.arg[0] for v in p.vars] == ["a", "b"]
    assert "long a, long b, long core_lo, long core_hi)" in p.src
    assert p.global_size is a   # a loop of symbolic length is split across cores once its length is known
    out = np.full(32, -1, np.int32)
    run(ast, [out], var_vals={"a": 5, "b": 3})
    assert out.tolist() == [-1] * 3 + list(range(5)) + [-1] * 24
    out[:] = -1
    run(ast, [out], var_vals={"a": 5, "b": 3}, splits=[(2, 5)])
    assert out.tolist() == [-1] * 5 + [2, 3, 4] + [-1] * 24

def test_scalar_output_kernel():
    r = rng(10, 0, "reduce")
    ast = UOp.sink_of(glob(0, dtypes.int32, 1).index(UOp.const(dtypes.index, 0)).store(reduce(r.cast(dtypes.int32), r)))
    out = np.zeros(1, np.int32)
    p = run(ast, [out])
    assert p.global_size == 1 and out[0] == 45

def test_compile_flags_declared():
    flags = RENDERER.compile_flags
    assert "-ffp-contract=off" in flags and "-fwrapv" in flags and not any("fast-math" in f for f in flags)

def _source_of(t) -> str:
    from fusegrad.device import Device
    si = [si for si in t.schedule() if si.ast.op is Ops.SINK][-1]
    return get_program(si.ast, Device["CPU"].renderer).src

def test_gated_loads_in_selects():
    # gated loads keep gcc's loop vectorizer away, so these kernels get our own vectors along their rows. A reflecting
    # pad picks one of nine gated loads per element: each lane's loads are written inside its select (only the
    # taken one runs); a concatenation along the rows (gates constant along the innermost loop) selects between
    # vector loads; one along the columns keeps its two vector loads apart (masked at the edge). Values against numpy.
    import re
    from fusegrad import Tensor
    from fusegrad.codegen.opt import OptOps
    rs = np.random.default_rng(3)
    X, Y = rs.standard_normal((2, 3, 8, 8)).astype(np.float32), rs.standard_normal((64, 64)).astype(np.float32)
    def named_loads(src: str) -> int: return len(re.findall(r"float val\d+ =", src))
    def vector_loads(src: str) -> int: return len(re.findall(r"f32x\d+ val\d+ =", src))
    # (each built twice: scheduling for the source leaves a tensor over buffers nothing filled)
    def pad() -> Tensor: return Tensor(X).pad((2, 2, 2, 2), mode="reflect")
    def rows() -> Tensor: return Tensor(Y[:32]).cat(Tensor(Y[32:]) * 2, dim=0)
    def cols() -> Tensor: return Tensor(Y[:, :32]).cat(Tensor(Y[:, 32:]) * 2, dim=1)
    def last_kernel(t: Tensor) -> UOp: return [si for si in t.schedule() if si.ast.op is Ops.SINK][-1].ast
    def source(t: Tensor, ren) -> str: return get_program(last_kernel(t), ren).src
    # the reflecting pad's 12 columns: one 16-lane vector padded from them, or three 4-lane ones (a half vector of
    # AVX2's 8 lanes divides them); on this machine, a vector of 4 lanes or more where it has 8 or more
    machines = [(renderer_like(AVX512), 16), (renderer_like(AVX2), 4)]
    if RENDERER.simd_bytes >= 32: machines.append((RENDERER, None))
    for ren, vec in machines:
        p = get_program(last_kernel(pad()), ren)
        assert any(o.op is OptOps.UPCAST and (o.arg == vec if vec else o.arg >= 4) for o in p.applied_opts), \
            (ren.simd_bytes, p.applied_opts)
        assert named_loads(p.src) == 0 and "?data1[" in p.src, p.src
        assert named_loads(source(rows(), ren)) == 0 and vector_loads(source(cols(), ren)) == 2
    np.testing.assert_array_equal(pad().numpy(), np.pad(X, ((0, 0), (0, 0), (2, 2), (2, 2)), mode="reflect"))
    np.testing.assert_array_equal(rows().numpy(), np.concatenate([Y[:32], Y[32:] * 2], 0))
    np.testing.assert_array_equal(cols().numpy(), np.concatenate([Y[:, :32], Y[:, 32:] * 2], 1))

def test_always_valid_access_is_not_gated():
    # a strided slice's load has a valid that folds to true: it is dropped, so the kernel isn't compiled as one with
    # conditional accesses (those go without gcc's loop vectorizer)
    from fusegrad import Tensor
    X = np.random.default_rng(4).standard_normal((4, 64, 64)).astype(np.float32)
    def sliced() -> Tensor: return Tensor(X)[:, ::2, 1::2].contiguous()
    src = _source_of(sliced())
    assert "?data1[" not in src and "no-tree-loop-vectorize" not in src, src
    np.testing.assert_array_equal(sliced().numpy(), X[:, ::2, 1::2])

def test_shared_operands_of_vector_reductions_pinned():
    # a weight gradient is a reduction vectorized along image rows whose register tile shares each loaded vector
    # between several accumulators: those loads are pinned to registers (FG_KEEP; GCC otherwise re-reads them as
    # memory operands of each FMA). A 1x1 convolution vectorized along its output channels has nothing pinned.
    # (image rows one float32 vector long: 8 floats with AVX, 16 with AVX-512)
    import torch
    from fusegrad import Tensor, hostcpu
    side = hostcpu.cpu().simd_bytes // 4
    rs = np.random.default_rng(4)
    x, g = (rs.standard_normal((8, 16, side, side)).astype(np.float32) for _ in range(2))
    w = rs.standard_normal((16, 16, 3, 3)).astype(np.float32)
    def weight_grad() -> Tensor:
        W = Tensor(w, requires_grad=True)
        (Tensor(x).conv2d(W, padding=1) * Tensor(g)).sum().backward()
        return W.grad
    srcs = [get_program(si.ast, RENDERER).src for si in weight_grad().schedule() if si.ast.op is Ops.SINK]
    assert any("FG_KEEP(val" in s for s in srcs), srcs
    assert "FG_KEEP(val" not in _source_of(Tensor(x).conv2d(Tensor(w[:, :, :1, :1])))
    tw = torch.tensor(w, requires_grad=True)
    (torch.nn.functional.conv2d(torch.tensor(x), tw, padding=1) * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(weight_grad().numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-4)

def test_op_renderers_cover_the_linearized_ops():
    # every op a linearized kernel holds is rendered through the table, which the OpenCL dialect inherits (with its own
    # EXP2: a float32 exp is OpenCL's float exp)
    from fusegrad.renderer.cstyle import CStyleLanguage
    from fusegrad.renderer.opencl import OpenCLRenderer
    from fusegrad.uop.ops import GroupOp
    structural = {Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR, Ops.DEFINE_LOCAL, Ops.DEFINE_REG, Ops.CONST, Ops.RANGE, Ops.END,
                  Ops.INDEX, Ops.LOAD, Ops.STORE, Ops.VECTORIZE, Ops.GEP, Ops.CAST, Ops.BITCAST, Ops.BIND, Ops.BARRIER,
                  Ops.NOOP}
    assert structural | set(GroupOp.ALU) <= set(CStyleLanguage.op_renderers)
    assert {op: f for op, f in OpenCLRenderer.op_renderers.items() if op is not Ops.EXP2} == \
        {op: f for op, f in CStyleLanguage.op_renderers.items() if op is not Ops.EXP2}
    assert OpenCLRenderer.op_renderers[Ops.EXP2] is OpenCLRenderer._exp2
