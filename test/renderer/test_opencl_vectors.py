"""The OpenCL C the CL renderer writes for vector kernels (rendering only, no OpenCL device needed): OpenCL's own vector
types, constructors, lanes, conversions and selects, and none of the GCC vector extensions the C renderer uses; lane
counts OpenCL C lacks are refused by name; exp2, log2 and sin left to OpenCL's builtins."""
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Opt, OptOps
from fusegrad.renderer.opencl import OpenCLRenderer
from fusegrad.uop.ops import Ops

# spellings of the C renderer's vectors (GCC extensions, C initializers, subscripts) that OpenCL C doesn't have
GCC_ONLY = ("__builtin_convertvector", "__builtin_shufflevector", "vector_size", "__builtin_memcpy", "[i]", "){0}",
            "__builtin_ia32", "FG_KEEP")

def asts(*exprs: str) -> list:
    """The kernel ASTs of the expressions over CPU tensors (the kernels are the same on every device)."""
    rng = np.random.default_rng(0)
    env = {"a": Tensor(rng.standard_normal((64, 128)).astype(np.float32)), "b": Tensor(np.ones((1, 128), np.float32)),
           "i": Tensor(rng.integers(-9, 9, (64, 128)).astype(np.int32)), "d": Tensor(np.ones((64, 128))),
           "c": Tensor(rng.integers(-9, 9, (64, 128)).astype(np.int8)), "dtypes": dtypes}
    return [ei.ast for e in exprs for ei in eval(e, env).schedule() if ei.ast.op is Ops.SINK]

def sources(ren: OpenCLRenderer, *exprs: str) -> list[str]: return [get_program(x, ren).src for x in asts(*exprs)]

@pytest.mark.parametrize("vload", [False, True])
def test_vector_kernels_use_opencl_vectors(vload: bool):
    ren = OpenCLRenderer(vload=vload)
    srcs = sources(ren, "a + b * a", "(a < b).where(a, b * 2)", "a.maximum(b)", "i * i + i // 3",
                   "(i > 0).where(i, -i)", "a.cast(dtypes.int32) + i", "i.cast(dtypes.float32) * a", "c + c",
                   "(a > 0) & (i < 3)",
                   "a.bitcast(dtypes.int32) >> 3", "d * d + 1", "a.pad(((0, 0), (1, 3))) * 2", "i % 5")
    for src in srcs:
        assert not any(g in src for g in GCC_ONLY), src
    text = "\n".join(srcs)
    for spelling in ("float4 ", "int4 ", "char4 ", "double4 ", "((float4)(", ".s0", ".s3", "convert_int4(",
                     "convert_float4(", "as_int4(", "select("):
        assert spelling in text, spelling
    assert ("vload4(0, " in text and "vstore4(" in text) == vload
    # element by element otherwise: a vector of the four elements, and four element stores
    assert ("((float4)((data1+" in text and "(data0+" in text) != vload

def test_lane_counts():
    ren = OpenCLRenderer()
    ast = asts("a * 2 + 1")[0]
    for n in (2, 8, 16):
        assert f"float{n} " in get_program(ast, ren, opts=[Opt(OptOps.UPCAST, 0, n)]).src
    with pytest.raises(ValueError, match="OpenCL C has no vector type for dtypes.float32.vec\\(32\\)"):
        get_program(ast, ren, opts=[Opt(OptOps.UPCAST, 0, 32)])

def test_half_and_bfloat16_not_vectorized():
    ren = OpenCLRenderer()
    assert dtypes.float16 not in ren.vector_dtypes and dtypes.bfloat16 not in ren.vector_dtypes
    assert dtypes.float64 in ren.vector_dtypes and dtypes.float64 not in OpenCLRenderer(has_fp64=False).vector_dtypes

def test_native_math():
    """exp2, log2 and sin are OpenCL's builtins (no polynomial: its constants are gone); a float32 exp is OpenCL's float
    exp with no float64 work where the device has doubles (it is exp2 of a float64 argument), else the code
    generator's float32 exp."""
    for ren in (OpenCLRenderer(), OpenCLRenderer(has_fp64=False)):
        src = sources(ren, "a.exp2() + a.abs().log2() + a.sin()")[0]
        for fn in ("exp2(", "log2(", "sin("): assert fn in src, fn
        assert "double" not in src and "12582912" not in src, src   # (12582912 = 1.5 * 2^23: the polynomial's rint)
    exp = sources(OpenCLRenderer(), "a.exp() * 2")[0]
    assert "exp(val0)" in exp and "double" not in exp, exp
    exp = sources(OpenCLRenderer(has_fp64=False), "a.exp() * 2")[0]
    assert "exp(" not in exp and "double" not in exp, exp
    # float64 too where the device has doubles
    assert (Ops.SIN, dtypes.float64) in OpenCLRenderer().native_math
    assert (Ops.SIN, dtypes.float64) not in OpenCLRenderer(has_fp64=False).native_math
    assert "sin(" in sources(OpenCLRenderer(), "d.sin()")[0]
