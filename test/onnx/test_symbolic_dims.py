"""Named input dims (`dim_param`) as bound Variables: models exported with a dynamic batch, run at several batch sizes,
match onnxruntime and compile kernels for the first size only; the shape arithmetic of the export (Shape -> Gather ->
Concat -> Reshape) stays symbolic; TinyJit captures once and replays for every batch size."""
from __future__ import annotations


import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor, TinyJit  # noqa: E402
from fusegrad.engine.realize import method_cache  # noqa: E402
from fusegrad.onnx import OnnxError, OnnxRunner  # noqa: E402
from test.onnx import quiet  # noqa: E402


class Mlp(torch.nn.Module):
    """Flattens with x.reshape(x.shape[0], -1), which the exporter writes as Shape -> Gather -> Unsqueeze -> Concat ->
    Reshape on the batch dim, and reshapes the batch again in the middle."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 16), torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x.reshape(x.shape[0], -1)))
        return self.b(h.reshape(x.shape[0], 4, 4).softmax(-1).reshape(x.shape[0], -1))


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("symbolic") / "mlp.onnx")
    with quiet():
        torch.onnx.export(Mlp().eval(), (torch.randn(2, 3, 4),), path, dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return path


def _compiled(fn):
    before = len(method_cache)
    out = fn()
    return out, len(method_cache) - before


def test_exported_model_compiles_for_the_first_batch_only(mlp_path):
    ops = {n.op_type for n in onnx.load(mlp_path).graph.node}
    assert {"Shape", "Gather", "Concat", "Reshape"} <= ops   # the arithmetic on the batch dim is in the graph
    sess, runner = ort.InferenceSession(mlp_path), OnnxRunner(mlp_path)
    rng = np.random.default_rng(0)
    compiled = []
    for b in (2, 3, 5):
        x = rng.standard_normal((b, 3, 4)).astype(np.float32)
        y, n = _compiled(lambda: runner({"x": x})["y"].numpy())
        np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
        compiled.append(n)
    assert compiled[0] > 0 and compiled[1:] == [0, 0], compiled
    # the same model with concrete shapes compiles again for a new batch size (what the Variables save)
    plain = OnnxRunner(mlp_path, symbolic_dims=False)
    x = rng.standard_normal((4, 3, 4)).astype(np.float32)
    y, n = _compiled(lambda: plain({"x": x})["y"].numpy())
    np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert n > 0


def test_tinyjit_captures_once_and_replays_for_every_batch(mlp_path, monkeypatch):
    sess, runner = ort.InferenceSession(mlp_path), OnnxRunner(mlp_path, max_dims={"batch": 8})
    step = TinyJit(lambda x: runner({"x": x})["y"].realize())
    scheduled = []
    orig = Tensor.schedule_with_vars
    monkeypatch.setattr(Tensor, "schedule_with_vars", lambda t, *lst: scheduled.append(1) or orig(t, *lst))
    rng = np.random.default_rng(1)
    for i, b in enumerate((2, 3, 2, 5, 8, 1)):
        x = rng.standard_normal((b, 3, 4)).astype(np.float32)
        inputs = runner.bind_inputs(x=x)
        before = len(scheduled)
        y, n = _compiled(lambda: step(**inputs).numpy())
        np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6, err_msg=f"batch {b}")
        # (a replay schedules nothing, or the one copy of an input: a trace would schedule the runner's graph again)
        if i >= 2: assert n == 0 and len(scheduled) <= before + 1, f"batch {b}: {n} kernels compiled, re-traced"


def test_batch_above_the_maximum_runs_with_concrete_shapes(mlp_path):
    sess, runner = ort.InferenceSession(mlp_path), OnnxRunner(mlp_path, max_dims={"batch": 4})
    x = np.random.default_rng(2).standard_normal((6, 3, 4)).astype(np.float32)
    assert runner.bind_inputs(x=x)["x"].shape == (6, 3, 4)
    np.testing.assert_allclose(runner({"x": x})["y"].numpy(), sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_dims names 'seq'"): OnnxRunner(mlp_path, max_dims={"seq": 4})
    with pytest.raises(ValueError, match="int >= 1"): OnnxRunner(mlp_path, max_dims={"batch": 0})


def _shape_model() -> onnx.ModelProto:
    """y = reshape(x, [n * 2, -1]) + range(n * 2)[:, None] with n = shape(x)[0] and an even split of the batch read
    through Div and Equal: shape arithmetic on a symbolic dim, written by hand."""
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Mul", ["n", "two"], ["n2"]),
        helper.make_node("Unsqueeze", ["n2", "axes0"], ["n2v"]),
        helper.make_node("Concat", ["n2v", "minus1"], ["shp"], axis=0),
        helper.make_node("Reshape", ["x", "shp"], ["r"]),
        helper.make_node("Range", ["zero", "n2", "one"], ["ar"]),
        helper.make_node("Cast", ["ar"], ["arf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["arf", "axes1"], ["col"]),
        helper.make_node("Add", ["r", "col"], ["y0"]),
        helper.make_node("Div", ["n2", "two"], ["half"]),          # == n
        helper.make_node("Equal", ["half", "n"], ["same"]),
        helper.make_node("Cast", ["same"], ["samef"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["y0", "samef"], ["y"]),
    ]
    inits = [i64("zero", 0), i64("one", 1), i64("two", 2), i64("axes0", [0]), i64("axes1", [1]), i64("minus1", [-1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_arithmetic_on_the_batch_dim_stays_symbolic():
    model = _shape_model()
    sess, runner = ort.InferenceSession(model.SerializeToString()), OnnxRunner(model)
    rng = np.random.default_rng(3)
    compiled = []
    for b in (2, 3, 5, 4):
        x = rng.standard_normal((b, 6)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        y, n = _compiled(lambda: runner({"x": x})["y"].numpy())
        np.testing.assert_allclose(y, want, rtol=1e-6)
        compiled.append(n)
    assert compiled[1:] == [0, 0, 0], compiled


def test_convolutions_and_pooling_keep_the_batch_symbolic():
    """A padded Conv, MaxPool and AveragePool over a symbolic batch: kernels compiled for the first batch only, equal
    to onnxruntime at every batch, and TinyJit replays them for other batches."""
    rng = np.random.default_rng(4)
    w = numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"),
             helper.make_node("AveragePool", ["p"], ["y"], kernel_shape=[2, 2], strides=[2, 2], name="avg")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess, runner = ort.InferenceSession(model.SerializeToString()), OnnxRunner(model)
    for i, b in enumerate((2, 3, 5)):
        x = rng.standard_normal((b, 1, 6, 6)).astype(np.float32)
        y, n = _compiled(lambda: runner({"x": x})["y"].numpy())
        np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
        if i: assert n == 0, f"batch {b}: {n} kernels compiled"
    step = TinyJit(lambda x: (runner({"x": x})["y"] * 2).realize())
    for b in (2, 3, 2, 4):
        x = rng.standard_normal((b, 1, 6, 6)).astype(np.float32)
        np.testing.assert_allclose(step(**runner.bind_inputs(x=x)).numpy(), 2 * sess.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)

def test_an_op_without_symbolic_kernels_takes_the_call_values_and_says_so_under_tinyjit():
    """LpPool has no kernels for a symbolic batch: it runs with the call's values (right at every batch), and inside a
    TinyJit capture, where those values would be replayed for others, it raises naming the node and the dims."""
    graph = helper.make_graph([helper.make_node("LpPool", ["x"], ["y"], kernel_shape=[2, 2], p=2, name="lp")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    sess, runner = ort.InferenceSession(model.SerializeToString()), OnnxRunner(model)
    for b in (2, 3):
        x = np.random.default_rng(b).standard_normal((b, 1, 4, 4)).astype(np.float32)
        np.testing.assert_allclose(runner({"x": x})["y"].numpy(), sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
    step = TinyJit(lambda x: (runner({"x": x})["y"] * 2).realize())
    x = np.zeros((1, 1, 4, 4), np.float32)
    step(**runner.bind_inputs(x=x))
    with pytest.raises(OnnxError, match="lp.*symbolic dims \\(batch\\).*TinyJit"): step(**runner.bind_inputs(x=x))


def test_jit_with_a_named_batch_copies_repeated_sizes_into_kept_memory():
    """Under jit() an array whose named dim was seen before is copied into memory kept per input (shared by every
    size) and read through the view made for that size: results equal NumPy's for alternating sizes, a Tensor given
    between them takes the checked path, and no result is overwritten by a later call."""
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              initializer=[numpy_helper.from_array(w, "w")])
    f = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), max_dims={"N": 8}).jit()
    rng = np.random.default_rng(9)
    kept = []
    for i, n in enumerate([3, 5, 3, 5, 3, 8, 5, 1, 3, 1, 8]):
        x = rng.standard_normal((n, 4)).astype(np.float32)
        got = f({"x": Tensor(x) if i == 6 else x})["y"]
        np.testing.assert_allclose(got, np.maximum(x @ w, 0), rtol=1e-6, atol=1e-6, err_msg=f"call {i}, N={n}")
        kept.append((x, got))
    for x, y in kept: np.testing.assert_allclose(y, np.maximum(x @ w, 0), rtol=1e-6, atol=1e-6)
    assert len(f._memory) == 1 and len(f._symbolic) == 4


@pytest.mark.parametrize("n", [1, 3])
def test_squeeze_without_axes_of_a_named_dim(n):
    # Squeeze with no axes drops every dim of 1: a named batch is dropped where the call's value is 1 (the result's
    # rank then depends on the call, so it runs with the call's values), kept otherwise
    nodes = [helper.make_node("Squeeze", ["x"], ["s"]), helper.make_node("Shape", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    runner = OnnxRunner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    got = runner({"x": np.ones((n, 1, 3), np.float32)})["y"].numpy()
    np.testing.assert_array_equal(got, np.squeeze(np.ones((n, 1, 3))).shape)
