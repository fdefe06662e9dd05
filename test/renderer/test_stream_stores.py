"""Outputs of at least STREAM_BYTES written in whole 64-byte vectors bypass the caches (non-temporal stores, with a
fence before the kernel returns): results against NumPy, where the stores stream and where they don't (a smaller
output), and the store helper at every alignment (an address not aligned to 64 bytes takes an ordinary store)."""
import copy
import ctypes
import os
import subprocess
import tempfile
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.device import Device, find_cc
from fusegrad.renderer.cstyle import STREAM_BYTES, ClangRenderer

def streams() -> bool: return bool(getattr(Device["CPU"].renderer, "stream_stores", False))

def softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

def test_big_softmax_streams(compiled_sources):
    rows = STREAM_BYTES // (4 * 1024)   # (an output of exactly STREAM_BYTES)
    x = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32) * 4
    got = Tensor(x).softmax(-1).numpy()
    np.testing.assert_allclose(got, softmax64(x), rtol=1e-5, atol=1e-7)
    src = "".join(compiled_sources)
    assert ("fg_stream_f32x16(" in src and "__builtin_ia32_sfence();" in src) == streams()

def test_small_output_keeps_its_stores(compiled_sources):
    x = np.random.default_rng(1).standard_normal((64, 1000), dtype=np.float32)
    np.testing.assert_allclose(Tensor(x).softmax(-1).numpy(), softmax64(x), rtol=1e-5, atol=1e-7)
    assert not any("fg_stream" in src for src in compiled_sources)

def test_stream_helper_at_any_alignment():
    # the helper writes a vector at an address aligned to 64 bytes past the caches and at any other one as usual
    # (the instruction faults there): each offset from 0 to 16 floats, the rest of the buffer untouched
    ren = copy.copy(ClangRenderer())
    ren._helpers = {}
    if not ren.stream_stores: pytest.skip("no AVX-512 streaming stores on this CPU")
    name = ren._stream(dtypes.float32.vec(16))
    src = ren.render_kernel("put", ["float* p", "const float* v"],
                            [f"  f32x16 x; __builtin_memcpy(&x, v, 64); {name}(p, x); __builtin_ia32_sfence();"])
    src = "typedef float f32x16 __attribute__((vector_size(64), aligned(4)));\n" + src
    with tempfile.TemporaryDirectory(prefix="fusegrad_stream_") as folder:   # (loaded, the file isn't needed)
        so = os.path.join(folder, "put.so")
        subprocess.run([*find_cc(), *ClangRenderer.compile_flags, "-shared", "-fPIC", "-x", "c", "-", "-o", so],
                       input=src.encode(), check=True, capture_output=True)
        put = ctypes.CDLL(so).put
    raw = np.zeros(128, np.float32)
    base = (-raw.ctypes.data % 64) // 4   # (the first element at a 64-byte boundary)
    v = np.arange(1, 17, dtype=np.float32)
    for off in range(17):
        buf = raw[base:base + 64]
        buf[:] = -1
        put(ctypes.c_void_p(buf[off:].ctypes.data), ctypes.c_void_p(v.ctypes.data))
        np.testing.assert_array_equal(buf[off:off + 16], v)
        assert (np.delete(buf, range(off, off + 16)) == -1).all()
