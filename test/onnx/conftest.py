"""The ResNet-style CNN exported once per test run (an export takes seconds), for the tests that need a real exported
model but not a fresh one. Parallel workers share the file: the first one to take the lock exports it."""
from __future__ import annotations

import fcntl
import os

import pytest


@pytest.fixture(scope="session")
def resnet_path(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from test.onnx.models import export
    # with xdist every worker has its own base folder below a shared one
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "onnx_models"
    folder.mkdir(exist_ok=True)
    path = folder / "resnet.onnx"
    with open(folder / "resnet.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = str(folder / f"resnet.{os.getpid()}.onnx")
            export("resnet", tmp, 2)
            os.replace(tmp, path)
    return str(path)


@pytest.fixture
def region_outputs(monkeypatch) -> list[str]:
    """The names of the ONNX nodes whose results the channels-last region records (layout.Region.output), in order."""
    pytest.importorskip("onnx")
    from fusegrad.onnx import layout
    recorded: list[str] = []
    original = layout.Region.output
    def spy(self, name, out):
        recorded.append(name)
        return original(self, name, out)
    monkeypatch.setattr(layout.Region, "output", spy)
    return recorded
