"""A realize of a graph structure seen before runs straight from the schedule cache's replay plan (tensor/__init__.py
_realize_replayed): these check that it computes what NumPy computes whenever anything the plan doesn't hold changes
(shape, dtype, device, constants, Variables, the buffers read and their memory), and that it is the path taken."""
import numpy as np
import pytest
import fusegrad.tensor as tensor_module
from fusegrad import Context, Device, GlobalCounters, Tensor, TinyJit, Variable, dtypes
from fusegrad.schedule.kernelize import schedule_cache_stats
from fusegrad.uop.graph import StructureWalk, structure_key
from fusegrad.uop.ops import Ops, UOp

rng = np.random.default_rng(7)

def rand(*shape, dtype=np.float32):
    if np.issubdtype(dtype, np.integer): return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)

@pytest.fixture
def general_path_calls(monkeypatch):
    """How many realizes took the general path (run_schedule) since the fixture was made."""
    calls = [0]
    real = tensor_module.run_schedule
    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(tensor_module, "run_schedule", counted)
    return calls

def test_repeated_realize_replays_and_matches_numpy(general_path_calls):
    a_np, b_np = rand(64, 64), rand(64, 64)
    a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
    for _ in range(3): (a + b).realize()  # a miss, then a hit that lowers the plan's kernels
    general, hits, kernels = general_path_calls[0], schedule_cache_stats["hits"], GlobalCounters.kernel_count
    outs = [(a + b).realize() for _ in range(5)]
    assert general_path_calls[0] == general, "a structure seen three times still took the general path"
    assert schedule_cache_stats["hits"] == hits + 5 and GlobalCounters.kernel_count == kernels + 5
    for out in outs:
        assert out.uop.base.op is Ops.BUFFER
        np.testing.assert_array_equal(out.numpy(), a_np + b_np)
    # every result has a buffer of its own
    assert len({id(o.uop.buffer) for o in outs}) == len(outs)

def _repeat(make, reference, times=4):
    for _ in range(times): np.testing.assert_allclose(make().realize().numpy(), reference, rtol=1e-5, atol=1e-6)

def test_changed_shape_and_dtype_never_replay_another_program():
    for shape in [(64, 64), (32, 64), (64, 32), (4096,), (8, 8, 64)]:
        for dt in (np.float32, np.float64, np.int32):
            x, y = rand(*shape, dtype=dt), rand(*shape, dtype=dt)
            tx, ty = Tensor(x).realize(), Tensor(y).realize()
            _repeat(lambda: tx * ty + tx, x * y + x)

def test_changed_device_never_replays_another_program():
    x, y = rand(16, 16), rand(16, 16)
    for dev in ("CPU", "CPU:1", "CPU", "CPU:1"):
        tx, ty = Tensor(x, device=dev).realize(), Tensor(y, device=dev).realize()
        for _ in range(4):
            out = (tx - ty).realize()
            assert out.device == Device.canonicalize(dev)
            np.testing.assert_array_equal(out.numpy(), x - y)

def test_same_buffer_twice_is_another_structure():
    x, y = rand(32, 32), rand(32, 32)
    tx, ty = Tensor(x).realize(), Tensor(y).realize()
    for _ in range(4):
        np.testing.assert_array_equal((tx + ty).realize().numpy(), x + y)
        np.testing.assert_array_equal((tx + tx).realize().numpy(), x + x)
        np.testing.assert_array_equal((ty + tx).realize().numpy(), y + x)

def test_changing_constants_are_bound_per_call():
    # a Python number that changes every call becomes a kernel parameter: each replay must use its own value
    x = rand(128)
    tx = Tensor(x).realize()
    for i in range(8):
        c = 0.5 + i
        np.testing.assert_allclose((tx * c + 1.0).realize().numpy(), x * np.float32(c) + 1, rtol=1e-6)

def test_variable_values_are_not_replayed():
    n = Variable("n", 1, 64)
    x = rand(64)
    tx = Tensor(x).realize()
    for v in (5, 9, 5, 64, 1, 9):
        out = (tx.shrink(((0, n.bind(v)),)) * 2).contiguous().realize()
        np.testing.assert_allclose(out.numpy()[:v], x[:v] * 2)

def test_new_inputs_and_reused_memory_every_call():
    # the inputs are new tensors every call, and the memory of the ones freed before is handed out again
    for _ in range(12):
        x, y = rand(48, 48), rand(48, 48)
        out = (Tensor(x) * Tensor(y) - 3.0).realize()
        np.testing.assert_allclose(out.numpy(), x * y - 3, rtol=1e-6)

def test_inputs_overwritten_in_place_between_calls():
    x = rand(40)
    tx = Tensor(x).realize()
    ref = x.copy()
    for _ in range(6):
        tx.assign(tx * 2 + 1).realize()
        ref = ref * 2 + 1
        np.testing.assert_allclose(tx.numpy(), ref, rtol=1e-6)

def test_readers_of_an_overwritten_buffer_keep_the_old_values():
    x = rand(40)
    tx = Tensor(x).realize()
    for step in range(5):
        before = tx + 10          # lazy: reads tx as it is now
        tx.assign(tx * 3).realize()
        np.testing.assert_allclose(before.numpy(), x * 3 ** step + 10, rtol=1e-5)
        np.testing.assert_allclose(tx.numpy(), x * 3 ** (step + 1), rtol=1e-5)

def test_intermediates_held_by_other_tensors_get_their_buffers():
    # two kernels (the product, then its sum); a lazy tensor holding the product sees the computed buffer
    a_np, b_np = rand(16, 24), rand(24, 8)
    a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
    for _ in range(5):
        m = a @ b
        s = m.sum()
        s.realize()
        np.testing.assert_allclose(s.numpy(), (a_np @ b_np).sum(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(m.numpy(), a_np @ b_np, rtol=1e-5, atol=1e-5)
        later = (m + 1).realize()   # reads the product's buffer
        np.testing.assert_allclose(later.numpy(), a_np @ b_np + 1, rtol=1e-5, atol=1e-5)

def test_views_of_inputs_held_by_other_tensors_stay_views():
    # a sum over an axis of size 1 is a view of its input: scheduling its max re-points a tensor holding the sum to
    # that view on every step, the replayed ones too, so an expand of it later needs no kernel of its own
    for step in range(5):
        x_np = rng.integers(-50, 50, (3, 1, 6)).astype(np.int32)
        x = Tensor(x_np)
        s = x.sum(axis=1)
        m = s.max(axis=1, keepdim=True).realize()
        kernels = GlobalCounters.kernel_count
        wide = s.reshape(1, 3, 6).expand(4, 3, 6)
        wide.realize()
        assert GlobalCounters.kernel_count == kernels, f"step {step}: the view of the input got a kernel"
        np.testing.assert_array_equal(m.numpy(), x_np.sum(1).max(1, keepdims=True))
        np.testing.assert_array_equal(wide.numpy(), np.broadcast_to(x_np.sum(1)[None], (4, 3, 6)))

def test_several_tensors_in_one_realize():
    x, y = rand(32), rand(32)
    tx, ty = Tensor(x).realize(), Tensor(y).realize()
    for _ in range(5):
        p, q, r = tx + ty, tx * ty, (tx + ty).exp()
        Tensor.realize(p, q, r)
        np.testing.assert_allclose(p.numpy(), x + y, rtol=1e-6)
        np.testing.assert_allclose(q.numpy(), x * y, rtol=1e-6)
        np.testing.assert_allclose(r.numpy(), np.exp(x + y), rtol=1e-5)

def test_knob_change_takes_its_own_kernels(general_path_calls):
    x = rand(64)
    tx = Tensor(x).realize()
    for _ in range(4): (tx * 2).realize()
    before = general_path_calls[0]
    with Context(NOOPT=1):
        for _ in range(4): np.testing.assert_allclose((tx * 2).realize().numpy(), x * 2)
    assert general_path_calls[0] > before  # the NOOPT kernels are lowered through the general path first
    np.testing.assert_allclose((tx * 2).realize().numpy(), x * 2)

def test_tinyjit_capture_sees_the_kernels():
    x = rand(16, 16)
    @TinyJit
    def f(t: Tensor) -> Tensor: return (t * 2 + 1).realize()
    tx = Tensor(x).realize()
    for _ in range(4): (tx * 2 + 1).realize()   # the structure replays before the function is captured
    for i in range(4):
        xi = x + i
        np.testing.assert_allclose(f(Tensor(xi).realize()).numpy(), xi * 2 + 1, rtol=1e-6)
    assert f.jit_cache, "the capture recorded no kernel"

def _random_graph(seed: int) -> list[UOp]:
    """Roots of a random tensor graph with shared nodes, repeated buffers and constants."""
    r = np.random.default_rng(seed)
    bufs = [Tensor(rand(8)).realize() for _ in range(3)]
    nodes = [b for b in bufs] + [Tensor(rand(8)).realize()]
    for _ in range(12):
        a, b = nodes[r.integers(len(nodes))], nodes[r.integers(len(nodes))]
        op = r.integers(4)
        nodes.append(a + b if op == 0 else a * b if op == 1 else a * float(r.integers(3)) if op == 2 else (a - b).exp())
    return [nodes[i].uop for i in r.choice(len(nodes), 3)]

@pytest.mark.parametrize("seed", range(6))
def test_structure_walk_is_the_toposort_and_structure_key(seed):
    roots = _random_graph(seed)
    walk = StructureWalk().walk(roots[:2])
    sink = UOp.sink_of(*roots[:2])
    assert list(walk.position) == list(sink.toposort())[:-1]
    assert walk.key() == structure_key(list(sink.toposort()))[0]
    assert walk.consts == structure_key(list(sink.toposort()))[1]
    # walked on: as toposort(known=...) of the bigger sink
    walk.walk(roots[2:])
    known = sink.toposort()
    known.popitem()
    sink3 = UOp.sink_of(*roots)
    topo3 = list(sink3.toposort(known=known))
    assert list(walk.position) == topo3[:-1]
    assert walk.key() == structure_key(topo3)[0]

def _reference_parts(topo: list[UOp]) -> list[tuple]:
    """The structure key's parts written out plainly from a toposort (the reference for StructureWalk)."""
    at = {u: i for i, u in enumerate(topo)}
    def arg(u: UOp):
        if u.op is Ops.BUFFER: return ("param", u.arg[1])
        if u.op is Ops.CONST and u.src and u.dtype not in (dtypes.bool, dtypes.index): return "_c"
        return u._ukey[3]
    return [(u.op, u.dtype, tuple(at[s] for s in u.src), arg(u)) for u in topo]

@pytest.mark.parametrize("depth", [10, 5000])
def test_structure_walk_of_a_deep_graph(depth):
    # deeper than the recursion limit: the walk goes on without recursion, and gives the same toposort and key
    import sys
    assert depth < sys.getrecursionlimit() or depth > 2 * sys.getrecursionlimit()
    x, y = Tensor(rand(4)).realize(), Tensor(rand(4)).realize()
    shallow = (x * 2.0 + y).uop
    deep = x
    for i in range(depth): deep = (deep + y) * 0.5 if i % 2 else deep - x
    roots = [shallow, deep.uop, (deep * 3.0).uop]
    walk = StructureWalk().walk(roots[:2]).walk(roots[2:])
    topo = list(UOp.sink_of(*roots).toposort())[:-1]
    assert list(walk.position) == topo and [walk.position[u] for u in topo] == list(range(len(topo)))
    assert walk.parts == _reference_parts(topo)
    assert walk.consts == [u for u in topo if u.op is Ops.CONST and u.src and u.dtype is dtypes.float32]
    assert walk.roots == roots

@pytest.mark.parametrize("dt", [np.float32, np.float64, np.int32, np.uint8])
def test_elementwise_fast_path_builds_the_general_graph(dt):
    # add, sub and mul of tensors of one kind make their node directly: the very node (hash-consed) the general path
    # makes, so kernels and the schedule cache see no difference
    x, y = Tensor(rand(5, 3).astype(dt)), Tensor(rand(5, 3).astype(dt))
    u, v = x.uop, y.uop
    assert (x + y).uop is UOp(Ops.ADD, u.dtype, (u, v)) and y.add(x, reverse=True).uop is (x + y).uop
    assert (x * y).uop is UOp(Ops.MUL, u.dtype, (u, v)) and y.mul(x, reverse=True).uop is (x * y).uop
    assert (x - y).uop is UOp(Ops.ADD, u.dtype, (u, UOp(Ops.NEG, u.dtype, (v,))))
    assert y.sub(x, reverse=True).uop is (x - y).uop
    xb, yb = x > 0, y > 0   # bool: add and mul are OR and AND
    assert (xb + yb).uop.op is Ops.OR and (xb * yb).uop.op is Ops.AND
    np.testing.assert_array_equal((x - y).numpy(), x.numpy() - y.numpy())

def test_fast_built_ops_note_their_source():
    # the op building paths that skip the constructor's checks still go through it while sources are tracked
    from fusegrad import track_sources
    from fusegrad.engine import explain as ex
    x, y = Tensor(rand(4, 4)), Tensor(rand(4, 4))
    with track_sources():
        s, p, m = x + y, x * y, x @ y
    for t, api in ((s, "__add__"), (p, "__mul__"), (m, "__matmul__")):
        src = ex.sources.get(t.uop)
        assert src is not None and src.api == api and src.filename.endswith("test_eager_replay.py"), (api, src)

@pytest.fixture
def template_walks(monkeypatch):
    """How many realizes found their graph's walk in tensor/__init__.py _template_walks."""
    found = [0]
    real = tensor_module._template_walk
    def counted(u, made):
        if (got := real(u, made)) is not None: found[0] += 1
        return got
    monkeypatch.setattr(tensor_module, "_template_walk", counted)
    monkeypatch.setattr(tensor_module, "_sharding_used", False)
    return found

def _conv_ref(x, w, b=None, padding=0, stride=1):
    import torch
    return torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), None if b is None else torch.tensor(b),
                                      padding=padding, stride=stride).numpy()

def test_templated_op_walks_from_its_template(template_walks, general_path_calls):
    # an eager op made from its template (a convolution, a softmax) over the same operands finds its graph's walk kept
    # by the template: numpy's and torch's values every call, a fresh buffer each; a Linear layer, one COMPOSITE node
    # (tensor/composite.py), replays from its own short walk
    from fusegrad import nn
    x_np, w_np, b_np = rand(2, 3, 9, 9), rand(4, 3, 3, 3), rand(4)
    x, w, b = Tensor(x_np).realize(), Tensor(w_np).realize(), Tensor(b_np).realize()
    layer = nn.Linear(9, 5)
    lw, lb = layer.weight.numpy(), layer.bias.numpy()
    cases = [(lambda: x.conv2d(w, b, padding=1), _conv_ref(x_np, w_np, b_np, padding=1)),
             (lambda: x.softmax(-1), np.exp(x_np) / np.exp(x_np).sum(-1, keepdims=True)),
             (lambda: layer(x), x_np @ lw.T + lb)]
    for make, want in cases:
        for _ in range(3): make().realize()   # (a new key, its template, the walk kept)
        found, general = template_walks[0], general_path_calls[0]
        outs = [make().realize() for _ in range(4)]
        assert template_walks[0] == found + (4 if make is not cases[-1][0] else 0) and general_path_calls[0] == general
        for out in outs: np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
        assert len({id(o.uop.buffer) for o in outs}) == len(outs)

def test_templated_op_walk_follows_its_operands(template_walks):
    # other operands (new inputs each call, freed ones whose ids come back), another template (other settings, the
    # templates cleared) are walked afresh: never another graph's walk
    from fusegrad.tensor import nn as tnn
    w_np = rand(4, 3, 3, 3)
    w = Tensor(w_np).realize()
    for i in range(12):
        x_np = rand(2, 3, 8, 8)
        x = Tensor(x_np).realize()
        pad, stride = (1, 1) if i % 3 else (0, 2)
        if i == 7: tnn._templates.clear()
        for _ in range(2):
            got = x.conv2d(w, padding=pad, stride=stride).realize()
            np.testing.assert_allclose(got.numpy(), _conv_ref(x_np, w_np, padding=pad, stride=stride), rtol=1e-5,
                                       atol=1e-5)
        del x, got
    assert template_walks[0] > 0
    # an operand overwritten in place between calls: the same graph, the new values
    x_np = rand(2, 3, 8, 8)
    x = Tensor(x_np).realize()
    for i in range(4):
        np.testing.assert_allclose(x.conv2d(w, padding=1).realize().numpy(), _conv_ref(x_np, w_np, padding=1),
                                   rtol=1e-5, atol=1e-5)
        x_np = x_np + 1
        x.assign(Tensor(x_np)).realize()

def test_templated_result_is_freed_without_the_garbage_collector(template_walks):
    # a result made from a template carries the nodes below it, never itself: no reference cycle keeps its graph (and
    # the buffers that graph reads) alive until a collection
    import gc
    import weakref
    x, w = Tensor(rand(2, 3, 8, 8)).realize(), Tensor(rand(4, 3, 3, 3)).realize()
    gc.disable()
    try:
        for _ in range(4):
            out = x.conv2d(w, padding=1)
            assert "_template" in out.uop.__dict__ or _ == 0
            root = weakref.ref(out.uop)
            del out
            assert root() is None
    finally: gc.enable()
