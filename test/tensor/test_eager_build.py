"""The fast paths that build common operations' nodes directly make the very nodes of the general path (UOps are
hash-consed, so the same graph is the same object), and compute what torch does."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fusegrad import Tensor, dtypes
from fusegrad.gradient import clamped
from fusegrad.schedule.simplify import const_view
from fusegrad.tensor import _plain_broadcast
from fusegrad.uop.ops import GroupOp, Ops, UOp, _compute_shape, plain_node

def _t(*shape: int, dtype=np.float32, seed: int = 0) -> Tensor:
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))

def _bcast(u: UOp, shape: tuple[int, ...]) -> UOp:
    """u broadcast to shape by hand: ones prepended, then expanded (numpy's rule)."""
    if len(u.shape) < len(shape): u = u.reshape((1,) * (len(shape) - len(u.shape)) + u.shape)
    return u.expand(shape) if u.shape != shape else u

def _const(v, dt, shape) -> UOp: return const_view(v, dt, UOp(Ops.DEVICE, arg="CPU"), shape)

@pytest.mark.parametrize("xs,ys", [((4, 5), (5,)), ((4, 1), (1, 5)), ((3,), (2, 3)), ((2, 3), (2, 3)), ((), (4,))])
def test_broadcast_arithmetic_nodes(xs, ys):
    a, b = _t(*xs), _t(*ys, seed=1)
    shape = np.broadcast_shapes(xs, ys)
    au, bu = _bcast(a.uop, shape), _bcast(b.uop, shape)
    assert (a + b).uop is UOp(Ops.ADD, dtypes.float32, (au, bu))
    assert (a * b).uop is UOp(Ops.MUL, dtypes.float32, (au, bu))
    assert (b - a).uop is UOp(Ops.ADD, dtypes.float32, (bu, UOp(Ops.NEG, dtypes.float32, (au,))))
    assert (a / b).uop is UOp(Ops.FDIV, dtypes.float32, (au, bu))
    assert (a < b).uop is UOp(Ops.CMPLT, dtypes.bool, (au, bu))
    np.testing.assert_allclose((b - a).numpy(), torch.tensor(b.numpy()) - torch.tensor(a.numpy()), rtol=1e-6)

_SHAPE_PAIRS = [((4, 5), (5,)), ((5,), (4, 5)), ((), ()), ((), (3,)), ((3,), ()), ((2, 3), (2, 3)), ((4, 1), (1, 5)),
                ((0, 5), (5,)), ((2, 0), (0,)), ((2, 0), (1,)), ((1, 0), (3, 1)), ((4, 5), (4,)), ((2, 3), (3, 3)),
                ((7, 1, 5), (6, 5)), ((6, 5), (2, 6, 5))]

@pytest.mark.parametrize("xs,ys", _SHAPE_PAIRS, ids=str)
def test_plain_broadcast_is_numpys(xs, ys):
    try: want = np.broadcast_shapes(xs, ys)
    except ValueError: want = None
    assert _plain_broadcast(xs, ys) == want
    if want is not None:
        a, b = _t(*xs), _t(*ys, seed=1)
        np.testing.assert_allclose((a + b).numpy(), a.numpy() + b.numpy(), rtol=1e-6)
        assert (a + b).uop is UOp(Ops.ADD, dtypes.float32, (_bcast(a.uop, want), _bcast(b.uop, want)))

def test_plain_node_is_the_hash_consed_node():
    a = _t(3, 4).uop
    for op, src, arg in [(Ops.NEG, (a,), None), (Ops.RESHAPE, (a,), (4, 3)), (Ops.ADD, (a, a), None)]:
        made = plain_node(op, dtypes.float32, src, arg)
        assert made is UOp(op, dtypes.float32, src, arg) and plain_node(op, dtypes.float32, src, arg) is made
    fresh = plain_node(Ops.EXPAND, dtypes.float32, (a.reshape((1, 3, 4)),), (2, 3, 4))
    assert UOp(Ops.EXPAND, dtypes.float32, (a.reshape((1, 3, 4)),), (2, 3, 4)) is fresh and fresh.shape == (2, 3, 4)

def test_scalar_operand_nodes():
    a = _t(3, 4)
    two = _const(2.0, dtypes.float32, (3, 4))
    assert (a * 2.0).uop is UOp(Ops.MUL, dtypes.float32, (a.uop, two))
    assert (2 * a).uop is UOp(Ops.MUL, dtypes.float32, (two, a.uop))   # (an int becomes the float dtype's 2.0)
    assert (1 - a).uop is UOp(Ops.ADD, dtypes.float32, (_const(1.0, dtypes.float32, (3, 4)),
                                                        UOp(Ops.NEG, dtypes.float32, (a.uop,))))
    assert (a / 4).uop is UOp(Ops.FDIV, dtypes.float32, (a.uop, _const(4.0, dtypes.float32, (3, 4))))
    i = Tensor([1, 2, 3], dtype=dtypes.int8)
    # a float next to ints takes the general path's promotion
    assert (i * 0.5).dtype == dtypes.float32
    assert (i * 0.5).tolist() == [0.5, 1.0, 1.5]

def test_relu_nodes_are_clamps():
    # (relu of a float is one COMPOSITE node whose graph is the clamp's)
    a = _t(4, 5)
    r = a.relu().uop
    assert r.op is Ops.COMPOSITE and r.src == (a.uop,)
    assert r.arg.expand(r.src) is clamped(a, 0, None, closed=False, nan_passes=True).uop
    h = a.half()
    r = h.relu().uop
    assert r.arg.expand(r.src) is clamped(h, 0, None, closed=False, nan_passes=True).uop
    i = Tensor([-2, 0, 3], dtype=dtypes.int32)
    assert i.relu().uop.op is not Ops.COMPOSITE and i.relu().tolist() == [0, 0, 3]
    x = Tensor([-1.0, 0.0, 2.0, float("nan")], requires_grad=True)
    x.relu().sum().backward()
    tx = torch.tensor([-1.0, 0.0, 2.0, float("nan")], requires_grad=True)
    tx.relu().sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())

@pytest.mark.parametrize("which", ["tensors", "scalar y", "scalar x"])
def test_where_nodes(which):
    c, x, y = _t(4, 1) > 0, _t(5, seed=1), _t(4, 5, seed=2)
    shape = (4, 5)
    if which == "tensors":
        got, xu, yu = c.where(x, y), _bcast(x.uop, shape), y.uop
    elif which == "scalar y":
        got, xu, yu = c.where(x, 0.5), _bcast(x.uop, shape), _bcast(_const(0.5, dtypes.float32, (5,)), shape)
    else:
        got, xu, yu = c.where(0.5, y), _const(0.5, dtypes.float32, shape), y.uop
    assert got.uop is UOp(Ops.WHERE, dtypes.float32, (_bcast(c.uop, shape), xu, yu))
    cond = np.broadcast_to(c.numpy(), shape)
    ref = np.where(cond, *(np.broadcast_to(v.numpy() if isinstance(v, Tensor) else v, shape) for v in
                           ((x, y) if which == "tensors" else (x, 0.5) if which == "scalar y" else (0.5, y))))
    np.testing.assert_array_equal(got.numpy(), ref)

@pytest.mark.parametrize("axis,keepdim", [(-1, True), (-1, False), (0, False), ((0, 1), True), (None, False)])
def test_reduction_nodes(axis, keepdim):
    a = _t(3, 4)
    axes = (0, 1) if axis is None else tuple(sorted(d % 2 for d in (axis if isinstance(axis, tuple) else (axis,))))
    r = a.uop.r(Ops.ADD, axes)
    if not keepdim: r = r.reshape(tuple(s for i, s in enumerate((3, 4)) if i not in axes))
    assert a.sum(axis, keepdim=keepdim).uop is r
    ref = torch.tensor(a.numpy()).sum(dim=axis if axis is not None else (0, 1), keepdim=keepdim)
    np.testing.assert_allclose(a.sum(axis, keepdim=keepdim).numpy(), ref.numpy(), rtol=1e-5)
    np.testing.assert_allclose(a.max(axis, keepdim=keepdim).numpy(),
                               torch.amax(torch.tensor(a.numpy()), dim=axis if axis is not None else (0, 1),
                                          keepdim=keepdim).numpy())

def test_one_hot_nodes_and_loss():
    y = Tensor(np.array([3, 0, 9, 4], np.int32))
    ref = y.unsqueeze(-1).cast(dtypes.int32) == Tensor.arange(10, dtype=dtypes.int32)
    assert y._one_hot_of(10).uop is ref.uop
    lg = _t(4, 10)
    np.testing.assert_allclose(lg.sparse_categorical_crossentropy(y).numpy(),
                               F.cross_entropy(torch.tensor(lg.numpy()), torch.tensor(y.numpy()).long()).numpy(),
                               rtol=1e-5)
    with pytest.raises(IndexError, match="target 10 is out of bounds"):
        lg.sparse_categorical_crossentropy(Tensor(np.array([3, 0, 10, 4], np.int32)))
    # an ignored label is allowed where it is out of range
    got = lg.sparse_categorical_crossentropy(Tensor(np.array([3, -100, 9, 4], np.int32)), ignore_index=-100)
    ref_loss = F.cross_entropy(torch.tensor(lg.numpy()), torch.tensor([3, -100, 9, 4]), ignore_index=-100)
    np.testing.assert_allclose(got.numpy(), ref_loss.numpy(), rtol=1e-5)

@pytest.mark.parametrize("shape,ignore,smoothing,reduction,dt", [
    ((16, 7), -1, 0.0, "mean", dtypes.float32), ((16, 7), 3, 0.0, "mean", dtypes.float32),
    ((16, 7), -100, 0.1, "sum", dtypes.float32), ((16, 7), 2, 0.2, "none", dtypes.float32),
    ((16, 7), -1, 0.0, "mean", dtypes.half), ((2, 8, 5), -1, 0.0, "mean", dtypes.float32)])
def test_loss_from_template_is_the_built_graph(shape, ignore, smoothing, reduction, dt, monkeypatch):
    # the loss over lazy or realized logits comes from a template built over placeholders (made again from it on
    # later calls): the very nodes the tensor operations make, and torch's values; logits that are views of lazy
    # graphs (a slice of a matmul) build directly. Without smoothing the loss is one COMPOSITE node
    # (tensor/composite.py) whose graph, made when it is scheduled, is the template's
    import fusegrad.tensor
    from fusegrad.tensor import nn as tnn
    # (a process that sharded a tensor before builds every loss directly: these operands are on one device)
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    rng = np.random.default_rng(5)
    tnn._templates.clear()
    seen = False   # (a key's first call builds directly: its template is made when it comes back)
    for call in range(2):
        a, w, b = _t(*shape[:-1], 6, seed=call), _t(6, shape[-1], seed=2), _t(shape[-1], seed=3)
        wider = _t(6, shape[-1] + 1, seed=4)
        # (a matmul is one node, a COMPOSITE, which no construction looks into, until a realize over it makes the
        # tensor hold its graph; a slice of one is a view, and so is the reshape of a 3-d @ 2-d product)
        for logits, templated in (((a @ w + b).cast(dt), True), ((a @ w).cast(dt), None),
                                  ((a @ wider)[..., 1:].cast(dt), dt != a.dtype),
                                  ((a @ w + b).cast(dt).realize(), True)):
            if templated is None:   # (a view of a lazy graph, not of a buffer, builds directly)
                u = logits.uop
                templated = not (u.op in GroupOp.Movement and u.src[0].op is not Ops.BUFFER)
            labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
            labels[0] = min(ignore, 0) if ignore < 0 else labels[0]
            y = Tensor(labels)
            got = logits.sparse_categorical_crossentropy(y, ignore, smoothing, reduction)
            assert (got.uop.op is Ops.COMPOSITE) == (smoothing == 0)
            graph = got.uop.arg.expand(got.uop.src) if smoothing == 0 else got.uop
            # a templated loss's nodes come with their template nodes' shapes: each the shape computed from its
            # sources
            assert (templated and seen) <= ("_shape" in graph.__dict__ and graph.__dict__["_device"] == "CPU")
            seen = seen or templated
            for n in graph.toposort():
                if "_shape" in n.__dict__: assert n.__dict__["_shape"] == _compute_shape(n), n.op
            assert graph is logits._sparse_ce_graph(y, ignore, smoothing, reduction).uop
            # (the template was used, a fallback to the direct build would pass the line above too; a bare matmul's
            # reshape, a view of a lazy graph, builds directly)
            settings = (ignore, smoothing, reduction)
            assert (tnn._from_template(Tensor._sparse_ce_graph, (logits, y), settings) is not None) == templated
            ref = F.cross_entropy(torch.tensor(logits.numpy().astype(np.float32)).reshape(-1, shape[-1]),
                                  torch.tensor(labels.reshape(-1)).long(), ignore_index=ignore,
                                  label_smoothing=smoothing, reduction=reduction)
            np.testing.assert_allclose(got.numpy().reshape(-1), ref.numpy().reshape(-1), rtol=2e-3 if dt == dtypes.half
                                       else 1e-5, atol=1e-6)
    assert [k for k, v in tnn._templates.items() if v is not None and k[1] == (shape, dt)]

def _expanded(t: Tensor) -> UOp:
    """The graph of a COMPOSITE node (a Linear layer's forward)."""
    assert t.uop.op is Ops.COMPOSITE
    return t.uop.arg.expand(t.uop.src)

@pytest.mark.parametrize("xs,bias,dt", [((16, 6), True, dtypes.float32), ((16, 6), False, dtypes.float32),
                                         ((2, 8, 6), True, dtypes.float32), ((16, 6), True, dtypes.half)])
def test_linear_from_template_is_the_built_graph(xs, bias, dt, monkeypatch):
    # a Linear layer's forward is one COMPOSITE node (tensor/composite.py) whose graph comes from a template over
    # placeholders: the very nodes x.linear(w.T, b) makes, and torch's values, for lazy and realized inputs; a view
    # of a realized tensor (a slice) builds directly
    import fusegrad.tensor
    from fusegrad import nn
    from fusegrad.tensor import nn as tnn
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    tnn._templates.clear()
    layer = nn.Linear(6, 5, bias=bias)
    layer.weight, layer.bias = layer.weight.cast(dt).realize(), layer.bias.cast(dt).realize() if bias else None
    for call in range(3):
        x0 = _t(*xs[:-1], 8, seed=call).cast(dt)
        for x, templated in ((x0[..., :6].contiguous() * 2, True), (x0[..., :6].contiguous().realize(), True),
                             (x0.realize()[..., 1:7], False)):
            out = layer(x)
            direct = x.linear(layer.weight.transpose(), layer.bias)
            assert _expanded(out) is direct.uop
            assert (tnn._from_template(tnn._linear_graph, (x, layer.weight) + ((layer.bias,) if bias else ()))
                    is not None) == templated
            for n in _expanded(out).toposort():
                if "_shape" in n.__dict__: assert n.__dict__["_shape"] == _compute_shape(n), n.op
            tw = torch.tensor(layer.weight.numpy().astype(np.float32))
            ref = F.linear(torch.tensor(x.numpy().astype(np.float32)), tw,
                           torch.tensor(layer.bias.numpy().astype(np.float32)) if bias else None)
            np.testing.assert_allclose(out.numpy().astype(np.float32), ref.numpy(), rtol=2e-2 if dt == dtypes.half
                                       else 1e-5, atol=1e-2 if dt == dtypes.half else 1e-6)
    # another shape, dtype or device is another template, never this one
    assert len([v for v in tnn._templates.values() if v is not None]) == 1
    x = _t(3, 6).cast(dt)
    out = layer(x)
    assert out.shape == (3, 5) and _expanded(out) is x.linear(layer.weight.transpose(), layer.bias).uop
    assert len([v for v in tnn._templates.values() if v is not None]) == 2
    moved = nn.Linear(6, 5, bias=bias)
    moved.weight = layer.weight.to("CPU:1").realize()
    moved.bias = layer.bias.to("CPU:1").realize() if bias else None
    x = x.to("CPU:1")
    out = moved(x)
    assert out.device == "CPU:1" and _expanded(out) is x.linear(moved.weight.transpose(), moved.bias).uop
    assert len([v for v in tnn._templates.values() if v is not None]) == 3
    np.testing.assert_allclose(out.numpy().astype(np.float32), layer(x.to("CPU")).numpy().astype(np.float32),
                               rtol=1e-6)

def test_linear_over_a_symbolic_batch_builds_directly():
    # a symbolic size is no template's: each bound value computes its own rows (the layer is called again and again)
    from fusegrad import Variable, nn
    from fusegrad.tensor import nn as tnn
    layer = nn.Linear(6, 3)
    x = np.random.default_rng(4).standard_normal((16, 6)).astype(np.float32)
    tx = Tensor(x).realize()
    n = Variable("n", 1, 16)
    w, b = layer.weight.numpy(), layer.bias.numpy()
    for v in (4, 9, 4, 16, 1):
        rows = tx.shrink(((0, n.bind(v)), (0, 6))) * 2   # (a lazy operand, not a view: refused for its size alone)
        assert tnn._from_template(tnn._linear_graph, (rows, layer.weight, layer.bias)) is None
        out = layer(rows).contiguous().realize().numpy()[:v]
        np.testing.assert_allclose(out, (2 * x[:v]) @ w.T + b, rtol=1e-5, atol=1e-5)

def test_bad_operands_still_refused():
    a = _t(3, 4)
    with pytest.raises(ValueError, match="can't be broadcast"): a + _t(5)
    with pytest.raises(OverflowError): Tensor([1, 2], dtype=dtypes.uint8) + 300
    with pytest.raises(TypeError, match="unsupported operand type"): a + "x"

_W, _B = _t(6, 4, 3, 3, seed=1).realize(), _t(6, seed=2).realize()
_NN_OPS = {
    "conv2d": (lambda x: x.conv2d(_W, padding=1), lambda t: F.conv2d(t, torch.tensor(_W.numpy()), padding=1)),
    "conv2d bias stride": (lambda x: x.conv2d(_W, _B, stride=2, padding=(0, 1)),
                           lambda t: F.conv2d(t, torch.tensor(_W.numpy()), torch.tensor(_B.numpy()), stride=2,
                                              padding=(0, 1))),
    "conv2d dilation": (lambda x: x.conv2d(_W, dilation=2), lambda t: F.conv2d(t, torch.tensor(_W.numpy()),
                                                                                 dilation=2)),
    "layernorm": (lambda x: x.layernorm(-1, 1e-3), lambda t: F.layer_norm(t, t.shape[-1:], eps=1e-3)),
    "layernorm axes": (lambda x: x.layernorm((2, 3)), lambda t: F.layer_norm(t, t.shape[-2:])),
    "softmax": (lambda x: x.softmax(1), lambda t: t.softmax(1)),
    "log_softmax": (lambda x: x.log_softmax(-1), lambda t: t.log_softmax(-1)),
}

@pytest.mark.parametrize("name", list(_NN_OPS))
def test_nn_ops_from_template_are_the_built_graph(name, monkeypatch):
    # convolutions, layernorm and softmax come from templates from a key's second call on: the very nodes the direct
    # build makes (the first call builds directly), torch's values and gradients, for lazy and realized inputs
    import fusegrad.tensor
    from fusegrad.tensor import nn as tnn
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    ours, theirs = _NN_OPS[name]
    tnn._templates.clear()
    for call in range(3):
        base = _t(2, 4, 7, 7, seed=call)
        for x in (base * 2, base.realize()):
            n_made = sum(isinstance(v, tuple) for v in tnn._templates.values())
            out = ours(x)
            # (a template is made at the second call of its key and serves the calls after it)
            assert sum(isinstance(v, tuple) for v in tnn._templates.values()) == n_made + (call == 0 and x is base)
            with monkeypatch.context() as m:
                m.setattr(tnn, "_from_template", lambda *a, **k: None)
                assert ours(x).uop is out.uop
            np.testing.assert_allclose(out.numpy(), theirs(torch.tensor(x.numpy())).numpy(), rtol=1e-4, atol=1e-5)
    # gradients through a templated graph
    x, tx = _t(2, 4, 7, 7, seed=9).requires_grad_(), torch.tensor(_t(2, 4, 7, 7, seed=9).numpy(), requires_grad=True)
    (ours(x) * ours(x).detach()).sum().backward()
    (theirs(tx) * theirs(tx).detach()).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-4)

def test_template_made_when_a_key_comes_back(monkeypatch):
    # a key seen once builds directly and makes no template (an operation on a new shape every call pays one build)
    import fusegrad.tensor
    from fusegrad.tensor import nn as tnn
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    tnn._templates.clear()
    for n in range(3, 9): _t(4, n).softmax(-1)
    assert not any(isinstance(v, tuple) for v in tnn._templates.values()) and len(tnn._templates) == 6
    _t(4, 5, seed=1).softmax(-1)
    assert sum(isinstance(v, tuple) for v in tnn._templates.values()) == 1
    # settings that can't be a key (a list) build directly
    x = _t(2, 3, 5, 5)
    for _ in range(2):
        np.testing.assert_allclose(x.layernorm([2, 3]).numpy(), F.layer_norm(torch.tensor(x.numpy()), (5, 5)).numpy(),
                                   rtol=1e-4, atol=1e-5)
    assert sum(isinstance(v, tuple) for v in tnn._templates.values()) == 1

def test_layernorm_layer_from_template_is_the_built_graph(monkeypatch):
    # nn.LayerNorm's normalization and affine part come from one template: the nodes of the direct build, torch's
    # values; without an affine part it is Tensor.layernorm
    import fusegrad.tensor
    from fusegrad import nn
    from fusegrad.tensor import nn as tnn
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    tnn._templates.clear()
    ln = nn.LayerNorm(7, eps=1e-3)
    ln.weight, ln.bias = _t(7, seed=3).realize(), _t(7, seed=4).realize()
    for call in range(3):
        x = _t(2, 5, 7, seed=call)
        out = ln(x)
        with monkeypatch.context() as m:
            m.setattr(tnn, "_from_template", lambda *a, **k: None)
            assert ln(x).uop is out.uop
        want = F.layer_norm(torch.tensor(x.numpy()), (7,), torch.tensor(ln.weight.numpy()),
                            torch.tensor(ln.bias.numpy()), eps=1e-3)
        np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)
    assert any(isinstance(v, tuple) and k[0] is nn._affine_layernorm for k, v in tnn._templates.items())
    plain = nn.LayerNorm(7, elementwise_affine=False)
    x = _t(3, 7, seed=9)
    np.testing.assert_allclose(plain(x).numpy(), F.layer_norm(torch.tensor(x.numpy()), (7,)).numpy(), rtol=1e-4,
                               atol=1e-5)

WINDOWS = [0, -1, 3, slice(None), slice(1, 3), slice(-2, None), slice(None, -1), slice(3, 1), slice(10, 20),
           slice(-10, 2), slice(None, 100), (1, 2), (slice(None), 2), (0, slice(1, 4), -1),
           (slice(1, 2), slice(None), slice(2, 6)), (), (slice(None),) * 3, (1, 1, 1), slice(1, 3, 1)]

@pytest.mark.parametrize("index", WINDOWS, ids=str)
def test_window_index_nodes(index, monkeypatch):
    # ints and slices of step 1 are made directly: the very nodes of the general indexing path, numpy's values
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    x = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 5, 6)
    t = Tensor(x).realize()
    fast = t._window_index(index)
    assert fast is not None and fast.uop is t._getitem(t._parse_indices(index)).uop
    np.testing.assert_array_equal(t[index].numpy(), x[index])

def test_other_indices_take_the_general_path():
    t = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    for index in (slice(None, None, 2), None, Ellipsis, (0, None), True, [0, 2], np.int64(1), (slice(0, 2.0),)):
        assert t._window_index(index) is None
    with pytest.raises(IndexError, match="out of bounds"): t[3]
    with pytest.raises(IndexError, match="too many indices"): t[0, 0, 0]
    np.testing.assert_array_equal(t[::2, 1].numpy(), np.arange(12, dtype=np.float32).reshape(3, 4)[::2, 1])

def test_noted_shapes_are_the_computed_ones():
    # (the fast paths note a new node's shape and device at once: they must be what the properties work out)
    a, b, bias = _t(4, 5), _t(4, 5, seed=1), _t(5, seed=2)
    x = (a * 1.5 + bias).relu() - b / 2
    x = (x < a).where(x, b).cast(dtypes.float16).float().gelu()
    x = x.sum(1, keepdim=True).expand(4, 5) * 0.25 + x.exp()
    nodes = [u for u in x.uop.toposort() if "_shape" in u.__dict__]
    assert len(nodes) > 15
    for u in nodes:
        assert u.__dict__["_shape"] == _compute_shape(u), u.op
        if u.op is not Ops.DEVICE: assert u.__dict__.get("_device", "CPU") == "CPU", u.op
    want = torch.tensor(a.numpy()) * 1.5 + torch.tensor(bias.numpy())
    want = want.relu() - torch.tensor(b.numpy()) / 2
    want = torch.where(want < torch.tensor(a.numpy()), want, torch.tensor(b.numpy())).half().float()
    want = F.gelu(want, approximate="tanh")
    want = want.sum(1, keepdim=True).expand(4, 5) * 0.25 + want.exp()
    np.testing.assert_allclose(x.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
