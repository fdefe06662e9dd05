"""A pytest plugin (`-p test.renderer.cuda_kernels_plugin`) that writes the CUDA source of every kernel the tests
compile to the file named by $FG_CUDA_KERNELS_OUT, for test_cuda_render.py to compile with NVRTC. The tests run as
usual on their device; each kernel AST they compile is also rendered with `CUDARenderer` when the session ends."""
from __future__ import annotations
import os
import fusegrad.codegen
from fusegrad.uop.ops import UOp

_asts: dict[UOp, None] = {}
_get_program = fusegrad.codegen.get_program

def _recording(ast, renderer, *args, **kwargs):
    _asts[ast] = None
    return _get_program(ast, renderer, *args, **kwargs)

def pytest_configure(config) -> None:
    fusegrad.codegen.get_program = _recording

def pytest_sessionfinish(session, exitstatus) -> None:
    from fusegrad.renderer.cuda import CUDARenderer
    ren = CUDARenderer()
    srcs = dict.fromkeys(_get_program(ast, ren).src for ast in _asts)
    with open(os.environ["FG_CUDA_KERNELS_OUT"], "w") as f: f.write("\n// ---- kernel ----\n".join(srcs))
