"""Shared by the ONNX tests (and bench_onnx): `quiet`, around an export or a quantization."""
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Without the log lines and warnings that torch's ONNX exporter and onnxruntime's quantization tools print."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally: logging.disable(logging.NOTSET)
