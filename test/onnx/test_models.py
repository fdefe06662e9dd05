"""Models built here in PyTorch with random weights, exported by torch.onnx.export, run by OnnxRunner and compared with
onnxruntime on the same file, at two batch sizes. The ResNet-style CNN runs by default; the rest with -m slow."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

onnxruntime = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from fusegrad.onnx import OnnxRunner  # noqa: E402
from test.onnx.models import export  # noqa: E402

TOL = {"resnet": 1e-4, "encoder": 2e-4, "recurrent": 1e-4, "mobilenet": 1e-4}


def _check(name: str, batch: int, tmp_path) -> None:
    path = str(tmp_path / f"{name}_{batch}.onnx")
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (x,) = export(name, path, batch)
    finally: logging.disable(logging.NOTSET)
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.numpy()}
    want = sess.run(None, feed)
    got = OnnxRunner(path)(feed)
    assert list(got) == [o.name for o in sess.get_outputs()]
    for (oname, g), w in zip(got.items(), want):
        g = g.numpy()
        assert g.shape == w.shape, oname
        np.testing.assert_allclose(g, w, rtol=TOL[name], atol=TOL[name], err_msg=oname)
    # the outputs depend on the input: a different input gives different outputs (the weights aren't all that counts)
    if x.dtype.is_floating_point:
        other = OnnxRunner(path)({sess.get_inputs()[0].name: (x * 0.5).numpy()})
        assert not np.allclose(next(iter(other.values())).numpy(), want[0])


@pytest.mark.parametrize("batch", [1, 3])
def test_resnet_style(batch, tmp_path):
    _check("resnet", batch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["encoder", "recurrent", "mobilenet"])
@pytest.mark.parametrize("batch", [1, 3])
def test_exported_model(name, batch, tmp_path):
    _check(name, batch, tmp_path)
