"""GUARD_PAGES=1: every CPU allocation ends at an inaccessible page (and its mapping starts with another), so an
access past the end of a buffer stops the process with SIGSEGV instead of touching a neighbour's memory; values
computed in that mode are NumPy's."""
from __future__ import annotations
import os
import signal
import subprocess
import sys
import textwrap
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap/mprotect guard pages (Linux)")

PRELUDE = """
import ctypes
import numpy as np
from fusegrad import Tensor
from fusegrad.device import Buffer
from fusegrad.dtype import dtypes
from fusegrad.runtime.cpu_memory import ALIGN, address
"""

def _run(body: str, mode: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "GUARD_PAGES": str(mode)}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env, capture_output=True,
                          text=True, timeout=120)

def test_values_match_numpy_with_guard_pages():
    r = _run("""
        rs = np.random.default_rng(0)
        a, b = rs.standard_normal((33, 70)).astype(np.float32), rs.standard_normal((70, 17)).astype(np.float32)
        out = (Tensor(a) @ Tensor(b)).relu().sum(0).numpy()
        np.testing.assert_allclose(out, np.maximum(a @ b, 0).sum(0), rtol=1e-4, atol=1e-4)
        x = rs.standard_normal(1001).astype(np.float32)
        np.testing.assert_allclose(Tensor(x).softmax().numpy(), np.exp(x - x.max()) / np.exp(x - x.max()).sum(),
                                   rtol=1e-5, atol=1e-7)
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("size", [4, 100, 4096, 5000])
def test_every_byte_is_usable_and_the_next_aligned_block_faults(size):
    # the buffer's bytes read and write; ALIGN bytes on from the end of its last aligned block is the guard page
    r = _run(f"""
        b = Buffer("CPU", {size}, dtypes.uint8).ensure_allocated()
        p = address(b._buf)
        assert p % ALIGN == 0
        ctypes.memset(p, 7, {size})
        assert bytes(b.as_buffer()) == bytes([7]) * {size}
        print("written", flush=True)
        end = p + -(-{size} // ALIGN) * ALIGN
        ctypes.memset(end, 1, 1)
        print("not stopped", flush=True)
    """)
    assert r.stdout.split() == ["written"], (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGSEGV


def test_a_read_before_the_start_faults():
    r = _run("""
        b = Buffer("CPU", 64, dtypes.float32).ensure_allocated()
        p = address(b._buf)
        print("start", flush=True)
        ctypes.c_uint8.from_address(p - 4096 - 1).value
        print("not stopped", flush=True)
    """)
    assert r.stdout.split() == ["start"], (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGSEGV


@pytest.mark.parametrize("size", [4, 100, 5001])
def test_exact_mode_faults_on_the_first_byte_past_the_end(size):
    r = _run(f"""
        b = Buffer("CPU", {size}, dtypes.uint8).ensure_allocated()
        p = address(b._buf)
        ctypes.memset(p, 7, {size})
        assert bytes(b.as_buffer()) == bytes([7]) * {size}
        x = np.frombuffer(b.as_buffer(), dtype=np.uint8)
        assert int(x.sum()) == 7 * {size}
        print("written", flush=True)
        ctypes.c_uint8.from_address(p + {size}).value
        print("not stopped", flush=True)
    """, mode=2)
    assert r.stdout.split() == ["written"], (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGSEGV


def test_a_gather_through_a_concatenated_index_reads_inside_its_buffers():
    # 30 outputs padded to two vectors of 16: the gather's index loads of the padded lanes are gated too (the
    # concatenation's last piece was read one past its end there), so nothing stops under the exact guard
    r = _run("""
        rs = np.random.default_rng(0)
        a, b, c = [rs.integers(-5, 5, 10).astype(np.int32) for _ in range(3)]
        x = rs.standard_normal(5).astype(np.float32)
        got = Tensor(x)[Tensor(a).cat(Tensor(b), Tensor(c))].numpy()
        np.testing.assert_array_equal(got, x[np.concatenate([a, b, c])])
        print("ok")
    """, mode=2)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
