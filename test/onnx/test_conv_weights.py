"""Convolution weights held by initializers are laid out with their output channels innermost (layout.py
`weight_channels_last`, `Graph._weight_laid_out`): the values of convolutions on small images (vectorized along their
output channels) against onnxruntime, at batch 1 and 16, run plainly and under `OnnxRunner.jit()`, and after their
initializer changed."""
from __future__ import annotations

import numpy as np
import pytest
torch = pytest.importorskip("torch")

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.onnx.layout import weight_channels_last  # noqa: E402

RNG = np.random.default_rng(11)


def _model(batch: int) -> onnx.ModelProto:
    """A residual block of 16 -> 16 channels on 8x8 images, a strided 16 -> 32 convolution to 4x4, a 32 -> 32 one
    with a bias, a grouped convolution (left as ONNX lays it out) and a 1x1 one; one weight read by two convolutions
    and, as a value, by an Add."""
    f32 = np.float32
    def w(*shape: int) -> np.ndarray: return (RNG.standard_normal(shape) * 0.2).astype(f32)
    inits = [numpy_helper.from_array(a, n) for n, a in
             (("w1", w(16, 16, 3, 3)), ("w2", w(16, 16, 3, 3)), ("w3", w(32, 16, 3, 3)), ("w4", w(32, 32, 3, 3)),
              ("b4", w(32)), ("wg", w(32, 16, 3, 3)), ("w5", w(8, 32, 1, 1)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "x"], ["s2"]),
             helper.make_node("Relu", ["s2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w1"], ["again"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["w1", "w2"], ["wsum"]),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c3", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c4", "wg"], ["grouped"], pads=[1, 1, 1, 1], group=2),
             helper.make_node("Conv", ["c4", "w5"], ["c5"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 16, 8, 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("again", "wsum", "grouped", "c5")]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [1, 16])
def test_laid_out_weights_match_onnxruntime(batch: int):
    model = _model(batch)
    sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((batch, 16, 8, 8)).astype(np.float32)
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    runner = OnnxRunner(model)
    got = {k: v.numpy() for k, v in runner({"x": Tensor(x)}).items()}
    jitted = runner.jit()
    for _ in range(3): replayed = jitted({"x": x})
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(replayed[name], ref, rtol=1e-4, atol=1e-4, err_msg=f"{name} (jit)")


def test_weight_channels_last_is_a_view_of_a_copy():
    w = RNG.standard_normal((32, 16, 3, 3)).astype(np.float32)
    t = Tensor(w).realize()
    laid = weight_channels_last(t)
    assert laid is not None and laid.shape == w.shape
    np.testing.assert_array_equal(laid.numpy(), w)
    # (the copy itself, read back in its own order: the output channels vary fastest)
    np.testing.assert_array_equal(laid.permute(1, 2, 3, 0).contiguous().numpy().reshape(-1),
                                  w.transpose(1, 2, 3, 0).reshape(-1))
    assert weight_channels_last(Tensor(w[:, :, :, 0])) is None            # not a 2-D convolution's weight
    assert weight_channels_last(Tensor(w.astype(np.float16))) is None     # not float32


@pytest.mark.parametrize("how", ["assign", "replace", "jit"])
def test_laid_out_weights_follow_their_initializer(how: str):
    """An initializer changed between calls (written in place, replaced, or under `jit(prune=False)`) is what the next
    call's convolution reads: its laid-out copy is made from it in each call."""
    w0, w1 = (RNG.standard_normal((16, 16, 3, 3)).astype(np.float32) for _ in range(2))
    x = RNG.standard_normal((1, 16, 8, 8)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])],
                              initializer=[numpy_helper.from_array(w0, "w")])
    runner = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    jitted = runner.jit(prune=False)
    def call() -> np.ndarray:
        if how == "jit": return jitted({"x": x})["y"]
        return runner({"x": Tensor(x)})["y"].numpy()
    def want(w: np.ndarray) -> np.ndarray:
        return torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1).numpy()
    for _ in range(3): np.testing.assert_allclose(call(), want(w0), rtol=1e-4, atol=1e-4)
    if how == "replace": runner.graph.initializers["w"] = Tensor(w1)
    else: runner.graph.initializers["w"].assign(Tensor(w1)).realize()
    for _ in range(3): np.testing.assert_allclose(call(), want(w1), rtol=1e-4, atol=1e-4)
