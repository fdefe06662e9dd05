"""Training on the CL device (OpenCL through PoCL; GPU-style kernels): examples/train_digits.py's CNN (conv, batch
norm, max pool, Adam, TinyJit) trained with the same seed on CL and on the CPU reaches the same test accuracy within
two points. Each run is a subprocess with DEV selecting the default device (the example makes its tensors there).

The default run trains 4 epochs of 22 steps; the slow test trains 10 epochs (220 steps)."""
from __future__ import annotations
import os
import subprocess
import sys
import pytest

pytest.importorskip("pyopencl")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = """
import sys
sys.path.insert(0, "examples")
from fusegrad import Device
from train_digits import train
acc = train(epochs={epochs}, quiet=True, seed=0)
print("ACC", Device.DEFAULT, acc)
"""

def accuracy(device: str, epochs: int) -> float:
    res = subprocess.run([sys.executable, "-c", CODE.format(epochs=epochs)], capture_output=True, text=True, cwd=ROOT,
                         timeout=900, env={**os.environ, "DEV": device})
    assert res.returncode == 0, res.stderr[-4000:]
    tag, dev, acc = res.stdout.split()[-3:]
    assert (tag, dev) == ("ACC", device), res.stdout
    return float(acc)

def check_same_accuracy(epochs: int, at_least: float) -> None:
    gpu_style, cpu = accuracy("CL", epochs), accuracy("CPU", epochs)
    assert cpu >= at_least, cpu
    assert abs(gpu_style - cpu) <= 0.02, (cpu, gpu_style)

def test_digits_cnn_trains_on_cl_as_on_cpu():
    check_same_accuracy(4, 0.9)

@pytest.mark.slow
def test_digits_cnn_trains_on_cl_as_on_cpu_220_steps():
    check_same_accuracy(10, 0.95)
