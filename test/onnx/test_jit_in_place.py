"""OnnxRunner.jit() on the CPU reads a C-contiguous array aligned as the device's allocations in place, while the call
runs, instead of copying it into the input's memory; any other array (misaligned, strided, of another layout, smaller
than IN_PLACE_MIN_BYTES) is copied in. Results against NumPy and onnxruntime over calls that mix both, arrays changed
after a call leave its results alone, and a replay that declines (a verified one) copies the arrays in after all. (The
small model's tests read its small inputs in place with the least size set to 0.)"""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad import Context, Device  # noqa: E402
from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.onnx import runner as runner_module  # noqa: E402
from test.engine.test_jit_replay_wait import _aligned as _placed  # noqa: E402

pytestmark = pytest.mark.skipif(Device.DEFAULT != "CPU", reason="arrays are read in place on the CPU device")
W = np.random.default_rng(12).standard_normal((3, 4)).astype(np.float32)


def _model():
    """y = Relu(x @ W) and z = Reshape(x * 2 + b, (-1,)) for an x of (2, 3) and a b of (3,)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"]),
             helper.make_node("Add", ["x", "x"], ["d"]), helper.make_node("Add", ["d", "b"], ["e"]),
             helper.make_node("Reshape", ["e", "flat"], ["z"])]
    inits = [numpy_helper.from_array(W, "w"), helper.make_tensor("flat", TensorProto.INT64, [1], [-1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _kinds(a: np.ndarray) -> dict[str, np.ndarray]:
    readonly = _placed(a)
    readonly.flags.writeable = False
    return {"aligned": _placed(a), "misaligned": _placed(a, 4), "readonly": readonly,
            "strided": np.asfortranarray(a), "plain": a.copy()}


def test_in_place_and_copied_arrays_match_numpy(monkeypatch):
    monkeypatch.setattr(runner_module, "IN_PLACE_MIN_BYTES", 0)
    run = OnnxRunner(_model()).jit()
    rng = np.random.default_rng(13)
    results, checked = [], 0
    for i in range(14):
        xv, bv = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
        kind = ["aligned", "misaligned", "readonly", "strided", "plain"][i % 5]
        x, b = _kinds(xv)[kind], _kinds(bv)[["aligned", "misaligned"][i % 2]]
        got = run({"x": x, "b": b})
        results.append((got, xv, bv))
        if x.flags.writeable: x[...] = 7   # (changed after the call)
        b[...] = -3
        call = next(iter(run._replays.values()), None)
        if call is not None and call.in_place is not None and kind == "aligned" and i >= 5:
            # (read in place: the input's kept memory doesn't hold this call's values)
            assert not np.array_equal(call.ins[0], xv)
            checked += 1
        if kind == "misaligned" and call is not None and i >= 5:
            np.testing.assert_array_equal(call.ins[0], xv)   # (copied in)
            checked += 1
    assert checked == 4
    for got, xv, bv in results:
        np.testing.assert_allclose(got["y"], np.maximum(xv @ W, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["z"], (xv + xv + bv).reshape(-1), rtol=1e-6, atol=1e-6)


def test_declined_replays_copy_the_arrays_in(monkeypatch):
    """Every second replay is verified (JIT_VERIFY=2), which replay_kept declines: the call copies the arrays it
    would have read in place into the inputs' memory and replays the ordinary way."""
    monkeypatch.setattr(runner_module, "IN_PLACE_MIN_BYTES", 0)
    run = OnnxRunner(_model()).jit()
    rng = np.random.default_rng(14)
    with Context(JIT_VERIFY=2):
        for _ in range(8):
            xv, bv = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
            got = run({"x": _placed(xv), "b": _placed(bv)})
            np.testing.assert_allclose(got["y"], np.maximum(xv @ W, 0), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got["z"], (xv + xv + bv).reshape(-1), rtol=1e-6, atol=1e-6)


def test_resnet_batch16_in_place_against_onnxruntime(tmp_path):
    """The ResNet-style CNN at batch 16 (its kernels queued across threads, the replay waiting for its own), arrays
    read in place and copied in turn, against onnxruntime; one thread too."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from test.onnx.models import export
    path = str(tmp_path / "resnet16.onnx")
    export("resnet", path, 16)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    run = OnnxRunner(path).jit()
    rng = np.random.default_rng(15)
    for i in range(8):
        xv = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
        x = _placed(xv, 0 if i % 2 else 4)
        with Context(CPU_THREADS=1 if i >= 6 else 0):
            got = run({"x": x})
        want = sess.run(None, {"x": xv})[0]
        np.testing.assert_allclose(list(got.values())[0], want, rtol=1e-4, atol=1e-4)
    call = next(iter(run._replays.values()))
    assert call.in_place is not None and call.in_place[0] is not None


def test_small_inputs_are_copied_in():
    """Inputs smaller than IN_PLACE_MIN_BYTES are copied in even when aligned (the copy costs less)."""
    run = OnnxRunner(_model()).jit()
    rng = np.random.default_rng(16)
    for _ in range(6):
        xv, bv = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
        got = run({"x": _placed(xv), "b": _placed(bv)})
        np.testing.assert_allclose(got["y"], np.maximum(xv @ W, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["z"], (xv + xv + bv).reshape(-1), rtol=1e-6, atol=1e-6)
    call = next(iter(run._replays.values()))
    assert call.in_place is None
    np.testing.assert_array_equal(call.ins[0], xv)
