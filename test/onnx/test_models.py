"""Models built here in PyTorch with random weights, exported by torch.onnx.export, run by OnnxRunner and compared with
onnxruntime on the same file, at two batch sizes (with -m slow: each export takes seconds). By default the
ResNet-style CNN runs at batch 2, under TinyJit and through the command line."""
from __future__ import annotations


import numpy as np
import pytest

onnxruntime = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from fusegrad.onnx import OnnxRunner  # noqa: E402
from test.onnx.models import export  # noqa: E402

TOL = {"resnet": 1e-4, "encoder": 2e-4, "recurrent": 1e-4, "mobilenet": 1e-4}


def _check(name: str, batch: int, tmp_path) -> None:
    path = str(tmp_path / f"{name}_{batch}.onnx")
    (x,) = export(name, path, batch)
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "encoder", "recurrent", "mobilenet"])
@pytest.mark.parametrize("batch", [1, 3])
def test_exported_model(name, batch, tmp_path):
    _check(name, batch, tmp_path)


def test_tinyjit_and_cli(resnet_path, capsys):
    """TinyJit captures a runner's call (the exported CNN reads its axes from initializers, not the device) and replays
    it with new inputs; the command line validates the same file against onnxruntime."""
    from fusegrad import Tensor, TinyJit
    from fusegrad.onnx.__main__ import main
    path = resnet_path
    runner = OnnxRunner(path)
    name = runner.input_names[0]
    out_name = runner.output_names[0]
    step = TinyJit(lambda x: runner({name: x})[out_name].realize())
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for _ in range(4):
        x = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
        np.testing.assert_allclose(step(Tensor(x).realize()).numpy(), sess.run(None, {name: x})[0], rtol=1e-4,
                                   atol=1e-4)
    assert main([path, "--validate", "--bench", "2"]) == 0
    printed = capsys.readouterr().out
    assert "ok" in printed and "kernels per run" in printed


def test_jit_runner_takes_and_returns_arrays_like_onnxruntime(resnet_path):
    """OnnxRunner.jit(): NumPy in and out, kernels replayed from the third call (the arrays copied into kept memory),
    the same results as onnxruntime for each call's values; new shapes are checked as a plain call checks them."""
    from fusegrad.onnx import OnnxInputError
    runner = OnnxRunner(resnet_path)
    name = runner.input_names[0]
    f = runner.jit()
    sess = onnxruntime.InferenceSession(resnet_path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    kept = []
    for _ in range(5):
        x = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
        got = f({name: x})
        assert list(got) == runner.output_names and isinstance(got[runner.output_names[0]], np.ndarray)
        kept.append((got, sess.run(None, {name: x})))
    for got, want in kept:   # results of earlier calls are theirs, not the last call's
        np.testing.assert_allclose(list(got.values())[0], want[0], rtol=1e-4, atol=1e-4)
    assert 0 < len(f.captured) < len(runner.graph.nodes)
    with pytest.raises(OnnxInputError, match="must have shape"): f({name: np.zeros((3, 3, 32, 32), np.float32)})
    with pytest.raises(OnnxInputError, match="must have dtype float, got a NumPy array of float64"):
        f({name: np.zeros((2, 3, 32, 32), np.float64)})


def test_jit_runner_with_a_symbolic_dim_and_tensor_inputs():
    """A named input dim: each call's batch replays the one capture; a Tensor input takes the checked path. Without
    symbolic dims each batch size has a capture (and input memory) of its own, also when the sizes alternate."""
    from onnx import TensorProto, helper, numpy_helper
    from fusegrad import Tensor
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"]),
         helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(3)
    for f, sizes in ((OnnxRunner(model).jit(), [2, 5, 1, 7, 3, 4]),
                     (OnnxRunner(model, symbolic_dims=False).jit(), [2, 5, 2, 5, 2, 5, 2])):
        for i, n in enumerate(sizes):
            x = rng.standard_normal((n, 4)).astype(np.float32)
            got = f(x=x if i % 3 else Tensor(x))
            y = np.maximum(x @ w, 0)
            np.testing.assert_allclose(got["y"], y, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got["s"], y.sum(), rtol=1e-5)
        assert f.captured
