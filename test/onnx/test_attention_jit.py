"""com.microsoft's GroupQueryAttention in a decode loop under TinyJit (OnnxRunner.jit()), with seqlens_k computed on
the device from an attention mask as exported decoders do: the replays follow each step's lengths, against
onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402

B, HEADS, KV_HEADS, HS, CACHE = 2, 4, 2, 16, 8


def _decoder(rotary: bool, growing: bool = False):
    """One decode step with a static cache of CACHE positions (or, `growing`, a cache of `past` positions and a mask of
    `total`, named dims): seqlens_k = sum(mask) - 1 (a ReduceSum on the device), total_sequence_length = the mask's
    length (a Shape); outputs the attention and the present cache."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("ReduceSum", ["mask", "one"], ["n"], keepdims=0),
             helper.make_node("Sub", ["n", "one"], ["n1"]),
             helper.make_node("Cast", ["n1"], ["seqlens_k"], to=TensorProto.INT32),
             helper.make_node("Shape", ["mask"], ["shape"]),
             helper.make_node("Gather", ["shape", "idx"], ["len64"], axis=0),   # (a scalar index: a scalar)
             helper.make_node("Cast", ["len64"], ["total"], to=TensorProto.INT32)]
    ins = ["q", "k", "v", "pk", "pv", "seqlens_k", "total"]
    attrs = {}
    inits = [numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "idx")]
    if rotary:
        ang = np.arange(16, dtype=np.float32)[:, None] * (10000.0 ** (-np.arange(HS // 2) / (HS // 2)))[None, :]
        inits += [numpy_helper.from_array(np.cos(ang).astype(np.float32), "cos"),
                  numpy_helper.from_array(np.sin(ang).astype(np.float32), "sin")]
        ins += ["cos", "sin"]
        attrs = {"do_rotary": 1}
    nodes.append(helper.make_node("GroupQueryAttention", ins, ["y", "pko", "pvo"], domain="com.microsoft",
                                  num_heads=HEADS, kv_num_heads=KV_HEADS, **attrs))
    inputs = [helper.make_tensor_value_info("q", f, [B, 1, HEADS * HS]),
              helper.make_tensor_value_info("k", f, [B, 1, KV_HEADS * HS]),
              helper.make_tensor_value_info("v", f, [B, 1, KV_HEADS * HS]),
              helper.make_tensor_value_info("pk", f, [B, KV_HEADS, "past" if growing else CACHE, HS]),
              helper.make_tensor_value_info("pv", f, [B, KV_HEADS, "past" if growing else CACHE, HS]),
              helper.make_tensor_value_info("mask", TensorProto.INT64, [B, "total" if growing else CACHE])]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "pko", "pvo")]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _token(rng) -> dict[str, np.ndarray]:
    """A new token's q, k and v."""
    return {"q": rng.standard_normal((B, 1, HEADS * HS)).astype(np.float32),
            "k": rng.standard_normal((B, 1, KV_HEADS * HS)).astype(np.float32),
            "v": rng.standard_normal((B, 1, KV_HEADS * HS)).astype(np.float32)}


def _step(sess, jitted, rng, mask, ours, theirs, step):
    """One decode step with a new token's q, k and v: the jitted model on cache `ours`, onnxruntime on `theirs`; their
    outputs must agree. Returns (ours, onnxruntime's)."""
    feed = _token(rng) | {"mask": mask}
    want = sess.run(None, feed | {"pk": theirs[0], "pv": theirs[1]})
    got = jitted(feed | {"pk": ours[0], "pv": ours[1]})
    for name, w in zip(("y", "pko", "pvo"), want):
        np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-4, err_msg=f"step {step}: {name}")
    return got, want


@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_decode_loop_under_jit_follows_each_steps_lengths(rotary):
    """Six decode steps, the two batches at different lengths (one starts with 2 cached positions, the other with
    none), the present fed back as the next step's cache; the jitted model replays one capture from the third step on
    and must agree with onnxruntime at every step (a length frozen at the capture would put the new key in the wrong
    slot and mask the wrong keys)."""
    model = _decoder(rotary)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted = OnnxRunner(model).jit()
    rng = np.random.default_rng(1)
    cache_ours = cache_ort = tuple(np.concatenate([rng.standard_normal((B, KV_HEADS, 2, HS)).astype(np.float32),
                                                   np.zeros((B, KV_HEADS, CACHE - 2, HS), np.float32)], 2)
                                   for _ in range(2))
    lengths = np.array([2, 0])   # cached positions per batch
    for step in range(6):
        lengths = lengths + 1
        mask = (np.arange(CACHE)[None, :] < lengths[:, None]).astype(np.int64)
        got, want = _step(sess, jitted, rng, mask, cache_ours, cache_ort, step)
        cache_ours, cache_ort = (got["pko"], got["pvo"]), (want[1], want[2])
    assert len(jitted.captured) > 0


def _device_total(model, growing: bool = False):
    """The decoder with total_sequence_length computed on the device: the longest of the mask's row sums (a static
    cache: the present is the cache) or the cache's length plus one (`growing`: the present grows by one)."""
    graph = model.graph
    i = next(k for k, n in enumerate(graph.node) if n.output[0] == "len64")
    graph.node[i].CopyFrom(helper.make_node("ReduceMax", ["n"], ["len64"], keepdims=0))
    for n in graph.node:
        if n.op_type == "GroupQueryAttention": n.name = "gqa"
    return model


# (the growing cache has symbolic dims, whose kernels take long to build: slow)
@pytest.mark.parametrize("growing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_total_length_computed_on_the_device_under_jit(growing):
    """total_sequence_length sets the present's length, a shape: computed on the device (a ReduceMax of the mask's row
    sums), a plain call reads it and the capture takes the length the warm-up call found (as the same difference to the
    cache's length); the replays then follow each step's lengths, against onnxruntime."""
    model = _device_total(_decoder(False, growing=growing))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted = OnnxRunner(model).jit()
    rng = np.random.default_rng(2)
    cache = 4 if growing else CACHE
    ours = theirs = tuple(rng.standard_normal((B, KV_HEADS, cache, HS)).astype(np.float32) for _ in range(2))
    lengths = np.array([2, 0]) if not growing else np.array([cache, cache])
    for step in range(5):
        lengths = lengths + 1
        width = cache + 1 if growing else CACHE
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        got, want = _step(sess, jitted, rng, mask, ours, theirs, step)
        if not growing: ours, theirs = (got["pko"], got["pvo"]), (want[1], want[2])
    assert len(jitted.captured) > 0


def test_total_length_computed_on_the_device_without_a_plain_call_is_refused():
    """A capture that no plain call of the same shapes came before can't know the present's length, and says so."""
    from fusegrad import TinyJit
    from fusegrad.onnx import OnnxUnsupportedError
    runner = OnnxRunner(_device_total(_decoder(False)))
    rng = np.random.default_rng(3)
    feed = _token(rng) | {"pk": np.zeros((B, KV_HEADS, CACHE, HS), np.float32),
                          "pv": np.zeros((B, KV_HEADS, CACHE, HS), np.float32), "mask": np.ones((B, CACHE), np.int64)}
    other = OnnxRunner(_device_total(_decoder(False)))
    calls = []

    def step(*tensors):
        # the warm-up call runs `runner`, the capture `other`, which has seen no plain call
        calls.append(None)
        use = runner if len(calls) == 1 else other
        return [v.realize() for v in use(dict(zip(use.input_names, tensors))).values()]
    bound = runner.bind_inputs(feed)
    jit = TinyJit(step)
    jit(*[bound[n] for n in runner.input_names])
    with pytest.raises(OnnxUnsupportedError, match=r"'gqa' \(GroupQueryAttention\).*total_sequence_length "
                                                   r"computed on the device"):
        jit(*[bound[n] for n in runner.input_names])


@pytest.mark.slow
def test_gqa_decode_loop_with_a_growing_cache_replays_one_capture():
    """The cache grows by one position a step (named dims `past` and `total`): the present's length is the symbolic
    total, and one capture replays for every length, equal to onnxruntime at each step."""
    from fusegrad.engine.realize import method_cache
    model = _decoder(False, growing=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted = OnnxRunner(model).jit()
    rng = np.random.default_rng(4)
    ours = theirs = tuple(rng.standard_normal((B, KV_HEADS, 2, HS)).astype(np.float32) for _ in range(2))
    for step in range(5):
        feed = _token(rng) | {"mask": np.ones((B, ours[0].shape[2] + 1), np.int64)}
        if step == 3: kernels = len(method_cache)
        want = sess.run(None, feed | {"pk": theirs[0], "pv": theirs[1]})
        got = jitted(feed | {"pk": ours[0], "pv": ours[1]})
        for name, w in zip(("y", "pko", "pvo"), want):
            np.testing.assert_allclose(got[name], w, rtol=1e-4, atol=1e-4, err_msg=f"step {step}: {name}")
        ours, theirs = (got["pko"], got["pvo"]), (want[1], want[2])
    assert ours[0].shape == (B, KV_HEADS, 7, HS)
    assert len(method_cache) == kernels, "a new length compiled new kernels"


@pytest.mark.parametrize("lengths,match", [([4, 9], "says the cache holds more than its 8 positions"),
                                           ([0, 3, 1], r"seqlens_k must have one value per batch \(2\)")])
def test_bad_lengths_name_the_node(lengths, match):
    """Lengths read in a plain call are checked against the cache (under jit() after every call: see below)."""
    from fusegrad.onnx import OnnxNodeError
    model = _decoder(False)
    graph = model.graph
    graph.node[-1].name = "gqa"
    graph.node[2].CopyFrom(helper.make_node("Identity", ["lens"], ["seqlens_k"]))
    graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT32, [len(lengths)]))
    feed = {"q": np.zeros((B, 1, HEADS * HS), np.float32), "k": np.zeros((B, 1, KV_HEADS * HS), np.float32),
            "v": np.zeros((B, 1, KV_HEADS * HS), np.float32), "pk": np.zeros((B, KV_HEADS, CACHE, HS), np.float32),
            "pv": np.zeros((B, KV_HEADS, CACHE, HS), np.float32), "mask": np.ones((B, CACHE), np.int64),
            "lens": np.array(lengths, np.int32)}
    with pytest.raises(OnnxNodeError, match=rf"'gqa' \(GroupQueryAttention\).*{match}"):
        OnnxRunner(model)(feed)


def _feed_of(rng, mask):
    return {"q": rng.standard_normal((B, 1, HEADS * HS)).astype(np.float32),
            "k": rng.standard_normal((B, 1, KV_HEADS * HS)).astype(np.float32),
            "v": rng.standard_normal((B, 1, KV_HEADS * HS)).astype(np.float32),
            "pk": rng.standard_normal((B, KV_HEADS, CACHE, HS)).astype(np.float32),
            "pv": rng.standard_normal((B, KV_HEADS, CACHE, HS)).astype(np.float32), "mask": mask}


def test_jit_checks_device_lengths_after_every_replay():
    """seqlens_k computed on the device is checked after each jit() call, replays included, with the plain call's
    error; a valid call after it agrees with onnxruntime again."""
    from fusegrad.onnx import OnnxNodeError
    model = _decoder(False)
    model.graph.node[-1].name = "gqa"
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted = OnnxRunner(model).jit()
    rng = np.random.default_rng(5)
    for n in (3, 4, 5):   # (plain, capture, replay)
        feed = _feed_of(rng, (np.arange(CACHE)[None, :] < np.array([[n], [n - 2]])).astype(np.int64))
        np.testing.assert_allclose(jitted(feed)["y"], sess.run(["y"], feed)[0], rtol=1e-4, atol=1e-4)
    feed = _feed_of(rng, np.stack([np.ones(CACHE), np.zeros(CACHE)]).astype(np.int64))   # (a batch of length 0)
    with pytest.raises(OnnxNodeError, match=r"'gqa' \(GroupQueryAttention\).*seqlens_k \[7, -1\] is shorter than "
                                            r"the 1 new positions"):
        jitted(feed)
    feed = _feed_of(rng, np.ones((B, CACHE), np.int64))
    np.testing.assert_allclose(jitted(feed)["y"], sess.run(["y"], feed)[0], rtol=1e-4, atol=1e-4)


def test_jit_refuses_a_device_total_that_asks_for_another_present_length():
    """total_sequence_length computed on the device (the longest row of the mask plus 2): while it is at most the
    cache's length the present is the cache's length and replays agree with onnxruntime; a replay whose total asks for
    a longer present is an error, where a plain call gives that present."""
    from fusegrad.onnx import OnnxNodeError
    model = _device_total(_decoder(False))
    graph = model.graph
    i = next(k for k, n in enumerate(graph.node) if n.output[0] == "len64")
    graph.node[i].output[0] = "longest"
    graph.node.insert(i + 1, helper.make_node("Add", ["longest", "two"], ["len64"]))
    graph.initializer.append(numpy_helper.from_array(np.array(2, np.int64), "two"))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    jitted, plain = OnnxRunner(model).jit(), OnnxRunner(model)
    rng = np.random.default_rng(6)
    for n in (3, 4, 6, 5):   # totals 5, 6, 8, 7: a present of CACHE positions
        feed = _feed_of(rng, (np.arange(CACHE)[None, :] < np.array([[n], [1]])).astype(np.int64))
        np.testing.assert_allclose(jitted(feed)["pko"], sess.run(["pko"], feed)[0], rtol=1e-4, atol=1e-4)
    feed = _feed_of(rng, (np.arange(CACHE)[None, :] < np.array([[7], [1]])).astype(np.int64))   # total 9
    assert plain(feed)["pko"].shape[2] == sess.run(["pko"], feed)[0].shape[2] == 9
    with pytest.raises(OnnxNodeError, match=r"'gqa' \(GroupQueryAttention\).*total_sequence_length 9, where this "
                                            r"jit\(\) capture was made for 5 \(a present of 8 positions\)"):
        jitted(feed)


def test_device_checks_under_a_tinyjit_of_the_users_are_refused():
    """seqlens_k computed on the device is checked after every call by OnnxRunner.jit(); a TinyJit around a function
    that calls the runner can't check it in its replays (they run no Python of the ops), so its capture is an error
    that names jit(), where the plain first call checks the values it reads."""
    from fusegrad import TinyJit
    from fusegrad.onnx import OnnxUnsupportedError
    runner = OnnxRunner(_decoder(False))
    rng = np.random.default_rng(4)
    feed = _token(rng) | {"pk": np.zeros((B, KV_HEADS, CACHE, HS), np.float32),
                          "pv": np.zeros((B, KV_HEADS, CACHE, HS), np.float32), "mask": np.ones((B, CACHE), np.int64)}
    jit = TinyJit(lambda *tensors: [v.realize() for v in runner(dict(zip(runner.input_names, tensors))).values()])
    bound = runner.bind_inputs(feed)
    jit(*[bound[n] for n in runner.input_names])   # (plain: the values are read and checked)
    with pytest.raises(OnnxUnsupportedError, match=r"GroupQueryAttention checks values computed on the device.*"
                                                   r"OnnxRunner\.jit\(\)"):
        jit(*[bound[n] for n in runner.input_names])
    # (the runner's own jit() captures the same model, and replays it)
    jitted = runner.jit()
    for _ in range(3): jitted(feed)
    assert len(jitted.captured) > 0
