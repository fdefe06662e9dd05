"""Tensors sharded over several devices of one process (CPU, CPU:1, CPU:2) give the results, and the gradients, that
the same program gives on one device."""
import numpy as np
import pytest
from fusegrad import GlobalCounters, Tensor, dtypes, nn
from fusegrad.schedule.multi import shard_bounds
from fusegrad.nn.state import get_parameters, get_state_dict

D2 = ("CPU", "CPU:1")
D3 = ("CPU", "CPU:1", "CPU:2")
rng = np.random.default_rng(0)

def _inputs(shapes):
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]

def check(fn, shapes, axes, devices=D2, grad=True, atol=1e-5):
    """fn over tensors sharded along `axes` (None: replicated) equals fn on one device, forward and backward; each
    input's gradient is laid out like the input."""
    arrays = _inputs(shapes)
    single = [Tensor(a, requires_grad=True) for a in arrays]
    sharded = [Tensor(a).shard(devices, ax).realize().requires_grad_() for a, ax in zip(arrays, axes)]
    want, got = fn(*single), fn(*sharded)
    assert got.shape == want.shape
    assert isinstance(got.device, tuple) and got.device == devices
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=atol, rtol=1e-5)
    if not grad: return
    weight = rng.standard_normal(want.shape).astype(np.float32)
    (fn(*single) * Tensor(weight)).sum().backward()
    (fn(*sharded) * Tensor(weight).shard(devices)).sum().backward()
    for s, m, ax in zip(single, sharded, axes):
        assert m.grad.device == devices and m.grad.uop.arg == ax
        np.testing.assert_allclose(m.grad.numpy(), s.grad.numpy(), atol=atol, rtol=1e-5)

def test_shard_bounds():
    assert shard_bounds(6, 2) == ((0, 3), (3, 6))
    assert shard_bounds(5, 2) == ((0, 3), (3, 5))
    assert shard_bounds(7, 3) == ((0, 3), (3, 6), (6, 7))
    assert shard_bounds(4, 3) == ((0, 2), (2, 4), (4, 4))  # the last shard is empty

@pytest.mark.parametrize("devices,n", [(D2, 6), (D2, 5), (D3, 7), (D3, 4)])
def test_shard_roundtrip(devices, n):
    a = _inputs([(n, 3)])[0]
    for axis in (0, 1, None, -1):
        t = Tensor(a).shard(devices, axis)
        assert t.device == devices and t.shape == (n, 3)
        np.testing.assert_array_equal(t.numpy(), a)
        np.testing.assert_array_equal(t.to("CPU:1").numpy(), a)
        assert t.to("CPU:1").device == "CPU:1"
        ax = axis % 2 if axis is not None else None
        sizes = [s.shape[ax] if ax is not None else s.shape for s in t.uop.src]
        if ax is not None: assert sizes == [hi - lo for lo, hi in shard_bounds(a.shape[ax], len(devices))]

ELEMENTWISE = [
    ("mul_add", lambda x: x * 2 + 1),
    ("exp", lambda x: x.exp()),
    ("tanh", lambda x: x.tanh()),
    ("relu_where", lambda x: (x > 0).where(x, x * 0.1)),
    ("cast", lambda x: x.cast(dtypes.float16).cast(dtypes.float32)),
]

@pytest.mark.parametrize("name,fn", ELEMENTWISE, ids=[n for n, _ in ELEMENTWISE])
@pytest.mark.parametrize("devices", [D2, D3], ids=["2dev", "3dev"])
@pytest.mark.parametrize("axis", [0, 1, None])
def test_elementwise(name, fn, devices, axis):
    check(fn, [(5, 7)], [axis], devices)

@pytest.mark.parametrize("axes", [(0, 0), (0, None), (None, 1), (0, 1), (1, 0)])
def test_binary_mixed_layouts(axes):
    check(lambda x, y: x * y + y, [(5, 6), (5, 6)], axes, D3)

def test_broadcast_operand():
    check(lambda x, b: x + b, [(5, 6), (6,)], [0, None], D2)
    check(lambda x, b: x * b, [(5, 6), (5, 1)], [0, 0], D2)

REDUCTIONS = [
    ("sum0", lambda x: x.sum(0)), ("sum1", lambda x: x.sum(1)), ("sum", lambda x: x.sum()),
    ("max0", lambda x: x.max(0)), ("max1", lambda x: x.max(1, keepdim=True)), ("mean", lambda x: x.mean()),
    ("softmax0", lambda x: x.softmax(0)), ("softmax1", lambda x: x.softmax(1)),
    ("logsumexp0", lambda x: x.logsumexp(0)), ("var1", lambda x: x.var(1)),
]

@pytest.mark.parametrize("name,fn", REDUCTIONS, ids=[n for n, _ in REDUCTIONS])
@pytest.mark.parametrize("devices", [D2, D3], ids=["2dev", "3dev"])
@pytest.mark.parametrize("axis", [0, 1])
def test_reductions(name, fn, devices, axis):
    check(fn, [(7, 5)], [axis], devices)

def test_big_reduction_uses_the_ring():
    # a partial result of 2^15 elements per device goes round the ring; the result must still be exact replicas
    check(lambda x: x.sum(0), [(6, 1 << 15)], [0], D3)
    a = _inputs([(3, 1 << 15)])[0]
    out = Tensor(a).shard(D3, 0).sum(0).realize()
    shards = [Tensor(s).numpy() for s in out.uop.src]
    for s in shards[1:]: np.testing.assert_array_equal(s, shards[0])  # bitwise equal replicas

def test_argmax_over_split_axis():
    a = _inputs([(9, 4)])[0]
    np.testing.assert_array_equal(Tensor(a).shard(D3, 0).argmax(0).numpy(), a.argmax(0))
    np.testing.assert_array_equal(Tensor(a).shard(D3, 1).argmax(1).numpy(), a.argmax(1))

MOVEMENT = [
    ("reshape_keep", lambda x: x.reshape(6, 2, 5)), ("reshape_merge", lambda x: x.reshape(60)),
    ("reshape_cross", lambda x: x.reshape(5, 12)), ("permute", lambda x: x.permute(1, 0)),
    ("slice_split_axis", lambda x: x[1:5]), ("slice_other_axis", lambda x: x[:, 2:7]),
    ("pad_split_axis", lambda x: x.pad(((2, 1), (0, 3)))), ("flip", lambda x: x.flip(0)),
    ("expand", lambda x: x.reshape(6, 1, 10).expand(6, 3, 10)), ("strided", lambda x: x[::2, 1::3]),
    ("cat", lambda x: x.cat(x * 2, dim=0)), ("transpose_matmul", lambda x: x.T @ x),
    ("cumsum", lambda x: x.cumsum(0)),
]

@pytest.mark.parametrize("name,fn", MOVEMENT, ids=[n for n, _ in MOVEMENT])
@pytest.mark.parametrize("axis", [0, 1])
def test_movement(name, fn, axis):
    check(fn, [(6, 10)], [axis], D3)

@pytest.mark.parametrize("axes", [(0, None), (None, 1), (1, 0), (None, 0), (0, 1)],
                         ids=["data_parallel", "column_parallel", "row_parallel", "k_split_weight", "both"])
@pytest.mark.parametrize("devices", [D2, D3], ids=["2dev", "3dev"])
def test_matmul(axes, devices):
    check(lambda x, w: x @ w, [(7, 9), (9, 5)], axes, devices, atol=1e-4)

def test_batched_matmul():
    check(lambda x, w: x @ w, [(3, 4, 6), (6, 5)], [0, None], D2, atol=1e-4)

def test_conv2d_batch_sharded():
    check(lambda x, w: x.conv2d(w, padding=1).relu(), [(5, 3, 8, 8), (4, 3, 3, 3)], [0, None], D2, atol=1e-4)
    check(lambda x, w: x.conv2d(w, stride=2), [(4, 2, 7, 7), (3, 2, 3, 3)], [0, None], D3, atol=1e-4)

def test_creation_on_several_devices():
    z = Tensor.zeros(4, 3, device=D2)
    assert z.device == D2
    np.testing.assert_array_equal(z.numpy(), np.zeros((4, 3), np.float32))
    t = Tensor([[1, 2], [3, 4]], device=D3)
    assert t.device == D3 and t.tolist() == [[1, 2], [3, 4]]
    np.testing.assert_array_equal(Tensor.arange(5, device=D2).numpy(), np.arange(5))
    r = Tensor.rand(6, 4, device=D2).realize()
    shards = [Tensor(s).numpy() for s in r.uop.src]
    np.testing.assert_array_equal(shards[0], shards[1])  # random replicas agree
    e = Tensor.empty(3, device=D2)
    assert e.device == D2 and e.shape == (3,)

def test_shard_like_and_to():
    a, b = _inputs([(6, 4), (6, 4)])
    x = Tensor(a).shard(D3, 1)
    y = Tensor(b).shard_like(x)
    assert y.device == D3 and y.uop.arg == 1
    np.testing.assert_array_equal(y.numpy(), b)
    moved = x.to(D2)
    assert moved.device == D2 and moved.uop.arg == 1
    np.testing.assert_array_equal(moved.numpy(), a)
    s = Tensor(a)
    s.shard_(D2, 0)
    assert s.device == D2 and s.uop.arg == 0
    np.testing.assert_array_equal(s.numpy(), a)

def test_assign_to_sharded():
    a, b = _inputs([(5, 4), (5, 4)])
    t = Tensor(a).shard(D2, 0).realize()
    t.assign(Tensor(b).shard(D2, 0) * 2).realize()
    np.testing.assert_allclose(t.numpy(), b * 2)
    t.assign(Tensor(a).shard(D2)).realize()  # a replicated value is shrunk to the target's shards
    np.testing.assert_allclose(t.numpy(), a)
    assert t.uop.arg == 0

def test_errors():
    x = Tensor.ones(4, 4)
    with pytest.raises(TypeError, match="tuple of device names"): x.shard("CPU")
    with pytest.raises(ValueError, match="appears twice"): x.shard(("CPU", "CPU:0"))
    with pytest.raises(IndexError, match="out of range"): x.shard(D2, 2)
    with pytest.raises(ValueError, match="unknown device"): x.shard(("CPU", "NOPE:1"))
    with pytest.raises(ValueError, match="different devices"): x.shard(D2, 0) + Tensor.ones(4, 4, device="CPU:1")
    with pytest.raises(ValueError, match="different devices"): x.shard(D2, 0) + x.shard(D3, 0)
    with pytest.raises(IndexError): Tensor(3.0).shard(D2, 0)

def test_allreduce_counts_copies():
    a = _inputs([(4, 64)])[0]
    GlobalCounters.reset()
    Tensor(a).shard(D3, 0).realize()
    kernels = GlobalCounters.kernel_count
    out = Tensor(a).shard(D3, 0).sum(0).realize()
    np.testing.assert_allclose(out.numpy(), a.sum(0), rtol=1e-5, atol=1e-5)
    assert GlobalCounters.kernel_count > kernels  # the partial sums and their combination are kernels

class TwoLayer:
    def __init__(self):
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)
    def __call__(self, x: Tensor) -> Tensor: return self.l2(self.l1(x).relu())

def _two_layer_on(devices):
    """The same seeded TwoLayer, its parameters replicated over `devices` (or on one device for None)."""
    Tensor.manual_seed(1)
    model = TwoLayer()
    params = get_parameters(model)
    if devices is not None:
        for p in params: p.shard_(devices).realize()
    return model, params

@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_data_parallel_training_matches_one_device(opt_name):
    """Parameters replicated over 2 devices, the batch split: 20 steps give the parameters of one device."""
    X = rng.standard_normal((64, 8)).astype(np.float32)
    Y = rng.integers(0, 3, 64)
    results = []
    for devices in (None, D2):
        model, params = _two_layer_on(devices)
        opt = nn.optim.SGD(params, lr=0.1, momentum=0.9) if opt_name == "SGD" else nn.optim.Adam(params, lr=0.01)
        with Tensor.train():
            for i in range(20):
                idx = slice((i % 4) * 16, (i % 4 + 1) * 16)
                x, y = Tensor(X[idx]), Tensor(Y[idx])
                if devices is not None: x, y = x.shard(devices, 0), y.shard(devices, 0)
                opt.zero_grad()
                loss = model(x).sparse_categorical_crossentropy(y)
                loss.backward()
                opt.step()
        if devices is not None:
            for p in params: assert p.device == D2 and p.grad.device == D2
        results.append({k: v.numpy() for k, v in get_state_dict(model).items()})
    for k in results[0]: np.testing.assert_allclose(results[1][k], results[0][k], atol=1e-5, rtol=1e-4, err_msg=k)

def test_tensor_parallel_linear_training():
    """A weight split over its output features (tensor parallelism) trains like one device."""
    X = rng.standard_normal((16, 6)).astype(np.float32)
    W0 = rng.standard_normal((6, 9)).astype(np.float32)
    out = []
    for devices in (None, D3):
        w = Tensor(W0) if devices is None else Tensor(W0).shard(devices, 1)
        w.realize().requires_grad_()
        x = Tensor(X) if devices is None else Tensor(X).shard(devices)
        opt = nn.optim.SGD([w], lr=0.05)
        for _ in range(5):
            opt.zero_grad()
            ((x @ w).tanh() ** 2).mean().backward()
            opt.step()
        out.append(w.numpy())
    np.testing.assert_allclose(out[1], out[0], atol=1e-5)

def test_state_dict_gathers_sharded_parameters(tmp_path):
    from fusegrad.nn.state import safe_load, safe_save
    model = TwoLayer()
    want = {k: v.numpy() for k, v in get_state_dict(model).items()}
    model.l1.weight.shard_(D2, 0)
    model.l2.weight.shard_(D3, 1)
    model.l1.bias.shard_(D2)
    safe_save(get_state_dict(model), str(tmp_path / "m.safetensors"))
    loaded = safe_load(str(tmp_path / "m.safetensors"))
    for k, v in want.items(): np.testing.assert_array_equal(loaded[k].numpy(), v)

def test_data_parallel_training_under_tinyjit():
    """The same data-parallel step captured by TinyJit: replays (with the shards of new batches) match one device."""
    from fusegrad import TinyJit
    X = rng.standard_normal((64, 8)).astype(np.float32)
    Y = rng.integers(0, 3, 64)
    results = []
    for devices in (None, D2):
        model, params = _two_layer_on(devices)
        opt = nn.optim.Adam(params, lr=0.01)

        @TinyJit
        @Tensor.train()
        def step(x: Tensor, y: Tensor) -> Tensor:
            opt.zero_grad()
            loss = model(x).sparse_categorical_crossentropy(y)
            loss.backward()
            opt.step()
            return loss.realize()
        losses = []
        for i in range(8):
            x, y = Tensor(X[(i % 4) * 16:(i % 4 + 1) * 16]), Tensor(Y[(i % 4) * 16:(i % 4 + 1) * 16])
            if devices is not None: x, y = x.shard(devices, 0), y.shard(devices, 0)
            losses.append(step(x, y).item())
        assert step.cnt == 2 and step.captured
        results.append((losses, model.l1.weight.numpy()))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-5)

NN_OPS = [
    ("layernorm", lambda x: x.layernorm()), ("max_pool", lambda x: x.reshape(6, 1, 2, 5).max_pool2d((2, 1))),
    ("avg_pool", lambda x: x.reshape(6, 1, 2, 5).avg_pool2d((1, 5))),
    ("gather_rows", lambda x: x[Tensor([4, 0, 2], device=x.device)]),
    ("gelu_logsoftmax", lambda x: x.gelu().log_softmax(1)), ("sort_free_topk", lambda x: x.max(1) - x.min(1)),
    ("batchnorm_stats", lambda x: (x - x.mean(0)) / (x.var(0) + 1e-5).sqrt()),
]

@pytest.mark.parametrize("name,fn", NN_OPS, ids=[n for n, _ in NN_OPS])
@pytest.mark.parametrize("axis", [0, 1])
def test_nn_functions(name, fn, axis):
    check(fn, [(6, 10)], [axis], D2, atol=1e-4)

def test_batchnorm_layer_with_batch_split():
    a = _inputs([(6, 3, 4, 4)])[0]
    outs = []
    for devices in (None, D3):
        bn = nn.BatchNorm2d(3)
        x = Tensor(a) if devices is None else Tensor(a).shard(devices, 0)
        if devices is not None:
            for p in get_parameters(bn): p.shard_(devices).realize()
        with Tensor.train(): y = bn(x).realize()
        outs.append((y.numpy(), bn.running_mean.numpy(), bn.running_var.numpy()))
    for got, want in zip(outs[1], outs[0]): np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

def test_python_devices():
    a = _inputs([(5, 3)])[0]
    x = Tensor(a, device="PYTHON").shard(("PYTHON", "PYTHON:1"), 0)
    assert x.device == ("PYTHON", "PYTHON:1")
    np.testing.assert_allclose((x * 2).sum(0).numpy(), (a * 2).sum(0), rtol=1e-6)
    mixed = Tensor(a).shard(("CPU", "PYTHON:1"), 1)
    np.testing.assert_allclose((mixed.exp() + 1).sum().numpy(), (np.exp(a) + 1).sum(), rtol=1e-5)

def test_debug2_reports_the_allreduce(capsys):
    from fusegrad import Context
    x = Tensor(_inputs([(4, 8)])[0]).shard(D2, 0).realize()
    with Context(DEBUG=2): x.sum(0).realize()
    out = capsys.readouterr().out
    assert "copy" in out and "CPU:1" in out

def test_optimizer_state_is_split_like_its_parameter():
    w = Tensor(_inputs([(6, 4)])[0]).shard(D2, 0).realize().requires_grad_()
    opt = nn.optim.Adam([w], lr=0.1)
    for m in opt.m + opt.v: assert m.device == D2 and m.uop.arg == 0
    (w * w).sum().backward()
    opt.step()
    opt.lr = 0.5  # written into every replica of the learning rate
    assert opt.lr.device == D2 and [Tensor(s).item() for s in opt.lr.uop.src] == [0.5, 0.5]

def test_optimizer_made_before_sharding_is_an_error():
    w = Tensor(_inputs([(6, 4)])[0]).realize().requires_grad_()
    opt = nn.optim.SGD([w], lr=0.1)
    w.shard_(D2, 0).realize()
    (w * w).sum().backward()
    with pytest.raises(RuntimeError, match="before making the optimizer"): opt.step()

@pytest.mark.parametrize("rows,cols,kernels", [((2, 3), (1, 4), 0), ((1, 3), (0, 6), 0), ((3, 4), (5, 6), 0),
                                               ((0, 4), (2, 5), 1)])
def test_copy_reads_a_run_in_place(rows, cols, kernels):
    """A copy of consecutive elements of a buffer needs no kernel first; any other view does."""
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = Tensor(a).realize()
    GlobalCounters.reset()
    c = t[rows[0]:rows[1], cols[0]:cols[1]].to("CPU:1").realize()
    assert GlobalCounters.kernel_count == kernels
    np.testing.assert_array_equal(c.numpy(), a[rows[0]:rows[1], cols[0]:cols[1]])
