"""OnnxRunner.jit() replays through TinyJit.replay_kept once its capture is checked: the arrays it returns equal
NumPy's over many calls with changing inputs, and arrays returned earlier keep their values."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402

W = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)


def _model(n: int | None = 2):
    """y = Relu(x @ W), z = Reshape(x * 2, (-1,)), for an x of (n, 3)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"]),
             helper.make_node("Add", ["x", "x"], ["d"]), helper.make_node("Reshape", ["d", "flat"], ["z"])]
    inits = [numpy_helper.from_array(W, "w"), helper.make_tensor("flat", TensorProto.INT64, [1], [-1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_jit_replays_into_kept_memory_and_copies_out():
    run = OnnxRunner(_model()).jit()
    rng = np.random.default_rng(6)
    kept = []
    for _ in range(7):
        x = rng.standard_normal((2, 3)).astype(np.float32)
        got = run({"x": x})
        assert set(got) == {"y", "z"} and got["z"].shape == (6,)
        kept.append((got, x))
    assert run._last._kept is not None   # (the later calls took the kept replay)
    for got, x in kept:   # (each call's arrays are its own)
        np.testing.assert_allclose(got["y"], np.maximum(x @ W, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["z"], (x + x).reshape(-1))


def test_jit_copies_strided_arrays_in_and_follows_new_output_memory():
    """Arrays that aren't C-contiguous are copied into the kept input memory as their values; when the TinyJit makes
    its kept replay again (a thread knob changed: new output memory), the arrays copied out are the new ones'."""
    from fusegrad.helpers import Context
    run = OnnxRunner(_model()).jit()
    rng = np.random.default_rng(7)
    memory: list = []   # (the Buffers themselves: an id could be reused once one is freed)
    for i in range(8):
        x = rng.standard_normal((3, 2)).astype(np.float32).T if i % 2 else \
            np.asfortranarray(rng.standard_normal((2, 3)).astype(np.float32))
        assert not x.flags.c_contiguous
        with Context(CPU_THREADS=1 if i >= 5 else 0):
            got = run({"x": x})
        np.testing.assert_allclose(got["y"], np.maximum(x @ W, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["z"], (x + x).reshape(-1))
        assert got["y"].flags.owndata and got["z"].flags.owndata   # (copies, not views of the JIT's memory)
        if run._last._kept is not None and not any(b is run._last._kept.outputs[0] for b in memory):
            memory.append(run._last._kept.outputs[0])
    assert len(memory) == 2   # (the kept replay was made again with the knob)


def test_jit_with_empty_inputs_between_replays():
    """An input with no elements is run plainly (there is nothing to capture), before and between replays of the
    other shape, and returns empty results of the right shapes; the replays stay right."""
    run = OnnxRunner(_model(n=None)).jit()
    rng = np.random.default_rng(8)
    for i in range(7):
        x = rng.standard_normal((0 if i % 3 == 0 else 2, 3)).astype(np.float32)
        got = run({"x": x})
        np.testing.assert_allclose(got["y"], np.maximum(x @ W, 0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["z"], (x + x).reshape(-1))
        assert got["y"].shape == (x.shape[0], 4)
