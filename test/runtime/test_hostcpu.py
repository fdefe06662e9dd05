"""The host CPU's facts (fusegrad/hostcpu.py) against what the machine says itself."""
import os
import platform
import pytest
from fusegrad import hostcpu
from fusegrad.device import Device
from fusegrad.dtype import dtypes

def cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError: return None

def test_cores_are_this_process_cores():
    n = hostcpu.host_cpu_count()
    assert 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"): assert n == len(os.sched_getaffinity(0))

def test_features_are_the_cpuinfo_flags():
    flags = cpuinfo_flags()
    if flags is None: pytest.skip("no /proc/cpuinfo")
    assert hostcpu.cpu().features == flags
    assert hostcpu.cpu().machine == platform.machine()

def test_vector_facts_are_sane():
    host, flags = hostcpu.cpu(), cpuinfo_flags() or set()
    assert host.simd_bytes in (16, 32, 64) and host.vector_registers in (16, 32)
    assert dtypes.float32 in host.vector_dtypes and dtypes.bfloat16 in host.vector_dtypes
    if host.x86:
        assert host.simd_bytes == (64 if "avx512f" in flags else 32 if "avx" in flags or "avx2" in flags else 16)
        assert host.has_fma == ("fma" in flags)
        assert (host.f16_lanes > 0) == ("f16c" in flags) == (dtypes.float16 in host.vector_dtypes)

def test_fingerprint_is_stable_and_short():
    assert hostcpu.fingerprint() == hostcpu.fingerprint()
    assert len(hostcpu.fingerprint()) == 16 and int(hostcpu.fingerprint(), 16) >= 0

def test_host_renderers_declare_the_host_facts():
    from fusegrad.renderer.python import PythonRenderer
    host = hostcpu.cpu()
    for ren in (Device["CPU"].renderer, PythonRenderer(simd=True)):
        assert (ren.simd_bytes, ren.vector_registers, ren.has_fma) == (host.simd_bytes, host.vector_registers,
                                                                       host.has_fma)
        assert tuple(ren.vector_dtypes) == host.vector_dtypes
    assert PythonRenderer(simd=False).simd_bytes == 0

@pytest.mark.parametrize("vendor,family,flags,full", [
    ("AuthenticAMD", 26, "fma avx2 avx512f", True),     # Zen 5
    ("AuthenticAMD", 25, "fma avx2 avx512f", False),    # Zen 4: 512-bit FMAs in two halves
    ("AuthenticAMD", 26, "fma avx2", False),            # no AVX-512 (as a VM may hide it)
    ("GenuineIntel", 6, "fma avx2 avx512f", False),     # Intel: not told apart, counted as split
])
def test_full_rate_512_from_vendor_and_family(monkeypatch: pytest.MonkeyPatch, vendor, family, flags, full):
    """`full_rate_512` (512-bit FMAs at the 256-bit rate) from /proc/cpuinfo's vendor, family and flags."""
    lines = [f"vendor_id\t: {vendor}", f"cpu family\t: {family}", "model\t\t: 2", f"flags\t\t: {flags}"]
    monkeypatch.setattr(hostcpu, "_cpuinfo", lambda: lines)
    monkeypatch.setattr(hostcpu.platform, "machine", lambda: "x86_64")
    assert hostcpu.cpu.__wrapped__().full_rate_512 is full

def test_renderers_declare_full_rate_512():
    from fusegrad.renderer.python import PythonRenderer
    assert Device["CPU"].renderer.full_rate_512 == hostcpu.cpu().full_rate_512
    assert PythonRenderer(like=Device["CPU"].renderer).full_rate_512 == hostcpu.cpu().full_rate_512
