"""Device registry: the default device, name canonicalization, plugins and errors."""
import os
import subprocess
import sys
import pytest
from fusegrad.device import Compiled, Device

def test_default_is_cpu():
    assert Device.DEFAULT == "CPU"

@pytest.mark.parametrize("name,expected", [("cpu", "CPU"), ("CPU", "CPU"), ("CPU:0", "CPU"), ("cpu:0", "CPU"),
                                           ("cpu:1", "CPU:1"), ("Cpu:2", "CPU:2")])
def test_canonicalize(name, expected):
    assert Device.canonicalize(name) == expected

def test_canonicalize_none_is_default():
    assert Device.canonicalize(None) == Device.DEFAULT

def test_getitem_is_cached_per_name():
    d = Device["CPU"]
    assert isinstance(d, Compiled) and d.device == "CPU"
    assert Device["cpu"] is d and Device["CPU:0"] is d
    assert Device["CPU:1"] is not d and Device["CPU:1"].device == "CPU:1"

def test_cpu_device_parts():
    d = Device["CPU"]
    assert d.allocator is not None and d.compiler is not None and callable(d.runtime)
    assert d.max_threads >= 1
    d.synchronize()

def test_unknown_device():
    with pytest.raises(ValueError) as e: Device["NOPE"]
    assert "NOPE" in str(e.value) and "CPU" in str(e.value)
    assert "CPU" in Device.available

def test_default_assignment():
    old = Device.DEFAULT
    try:
        Device.DEFAULT = "cpu"
        assert Device.DEFAULT == "CPU"
        with pytest.raises(ValueError): Device.DEFAULT = "NOPE"
        assert Device.DEFAULT == "CPU"
    finally: Device.DEFAULT = old

def _default_in_subprocess(**env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("DEV", "CPU")} | env
    code = "from fusegrad.device import Device; print(Device.DEFAULT)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=60)

@pytest.mark.parametrize("env", [{"DEV": "cpu"}, {"CPU": "1"}, {}])
def test_default_from_env(env):
    r = _default_in_subprocess(**env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "CPU"

def test_unknown_default_from_env():
    r = _default_in_subprocess(DEV="FOO")
    assert r.returncode != 0 and "FOO" in r.stderr and "CPU" in r.stderr

def test_default_without_a_c_compiler_is_llvm():
    # no cc, gcc or clang on PATH: the host device compiles through llvmlite instead
    pytest.importorskip("llvmlite")
    prog = "from fusegrad import Device, Tensor; print(Device.DEFAULT, (Tensor([1.0, 2.0]) * 3).tolist())"
    env = {k: v for k, v in os.environ.items() if k not in ("DEV", "CC", "CPU", "LLVM", "PYTHON")}
    res = subprocess.run([sys.executable, "-c", prog], env={**env, "PATH": "/nonexistent"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["LLVM", "[3.0,", "6.0]"]
