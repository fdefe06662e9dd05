"""The ResNet-style CNN exported once per test session (an export takes seconds), for the tests that need a real
exported model but not a fresh one."""
from __future__ import annotations

import logging
import warnings

import pytest


@pytest.fixture(scope="session")
def resnet_path(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from test.onnx.models import export
    path = str(tmp_path_factory.mktemp("onnx") / "resnet.onnx")
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            export("resnet", path, 2)
    finally: logging.disable(logging.NOTSET)
    return path
