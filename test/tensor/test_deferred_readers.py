"""A lazy tensor that reads a buffer a realize overwrites keeps the value it had when it was built. When computing it
then would cost far more than copying what it reads (the gradient into a model's input, which nobody may read), it
stays lazy over copies taken before the write: checked against torch and NumPy at the values before the write."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, TinyJit, nn
from fusegrad.device import GlobalCounters
from fusegrad.uop.ops import Ops

def _torch_mlp(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, list[np.ndarray]]:
    """The loss, the gradient into x and the weights' gradients of the 2-layer MLP, by torch."""
    tx = torch.tensor(x, requires_grad=True)
    tw = [torch.tensor(w, requires_grad=True) for w in weights]
    h = torch.relu(tx @ tw[0].T + tw[1])
    loss = torch.nn.functional.cross_entropy(h @ tw[2].T + tw[3], torch.tensor(y).long())
    loss.backward()
    return loss.item(), tx.grad.numpy(), [w.grad.numpy() for w in tw]

def _mlp(seed: int) -> tuple[list[Tensor], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    l1, l2 = nn.Linear(96, 64), nn.Linear(64, 10)
    x, y = rng.standard_normal((48, 96)).astype(np.float32), rng.integers(0, 10, 48).astype(np.int32)
    return [l1.weight, l1.bias, l2.weight, l2.bias], x, y

def _forward(params: list[Tensor], x: Tensor) -> Tensor:
    return ((x @ params[0].T + params[1]).relu() @ params[2].T + params[3])

def _linear_forward(params: list[Tensor], x: Tensor) -> Tensor:
    """_forward by nn.Linear's function: each layer one COMPOSITE node (tensor/composite.py), its gradients too."""
    from fusegrad.tensor.nn import linear_layer
    return linear_layer(linear_layer(x, params[0], params[1]).relu(), params[2], params[3])

@pytest.fixture(params=["ops", "linear"])
def forward(request, monkeypatch):
    """The MLP's forward by tensor operations, or by Linear layers (composites: made in a process that shards no
    tensor)."""
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    return _forward if request.param == "ops" else _linear_forward

def _jitted_step(params: list[Tensor], opt: nn.optim.Optimizer) -> TinyJit:
    """One optimizer step on the MLP's cross-entropy, TinyJit-ed: step(x, y) -> loss."""
    @TinyJit
    @Tensor.train()
    def step(x: Tensor, y: Tensor) -> Tensor:
        opt.zero_grad()
        loss = _forward(params, x).sparse_categorical_crossentropy(y)
        loss.backward()
        opt.step()
        return loss
    return step

def _torch_step(tparams: list[torch.Tensor], topt: torch.optim.Optimizer, x: np.ndarray, y: np.ndarray) -> float:
    """torch's optimizer step on the same MLP (its weights `tparams`): the loss before it."""
    topt.zero_grad()
    h = torch.relu(torch.tensor(x) @ tparams[0].T + tparams[1])
    loss = torch.nn.functional.cross_entropy(h @ tparams[2].T + tparams[3], torch.tensor(y).long())
    loss.backward()
    topt.step()
    return loss.item()

def test_input_gradient_read_after_the_step_is_the_one_before_it(forward):
    params, xs, ys = _mlp(0)
    opt = nn.optim.SGD(params, lr=0.5)
    for step in range(3):   # (the later steps replay the first one's schedule)
        before = [p.numpy().copy() for p in params]
        x, y = Tensor(xs), Tensor(ys)
        with Tensor.train():
            opt.zero_grad()
            loss = forward(params, x).sparse_categorical_crossentropy(y)
            loss.backward()
            opt.step()
        t_loss, t_dx, t_grads = _torch_mlp(before, xs, ys)
        # the input's gradient was not computed with the step: it is still a graph (over copies of the weights)
        assert x.grad.uop.base.op is not Ops.BUFFER, f"step {step}"
        np.testing.assert_allclose(loss.numpy(), t_loss, rtol=1e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(x.grad.numpy(), t_dx, rtol=1e-4, atol=1e-7, err_msg=f"step {step}")
        for p, b, g in zip(params, before, t_grads):
            np.testing.assert_allclose(p.numpy(), b - 0.5 * g, rtol=1e-4, atol=1e-6, err_msg=f"step {step}")

def test_the_step_runs_fewer_operations_without_the_input_gradient(forward):
    params, xs, ys = _mlp(1)
    opt = nn.optim.SGD(params, lr=0.1)
    x, y = Tensor(xs), Tensor(ys)
    with Tensor.train():
        opt.zero_grad()
        forward(params, x).sparse_categorical_crossentropy(y).backward()
        ops0 = GlobalCounters.global_ops
        opt.step()
        step_ops = GlobalCounters.global_ops - ops0
    # the product into x (2 * 48 * 64 * 96 operations) is not part of the step
    ops1 = GlobalCounters.global_ops
    dx = x.grad.numpy()
    assert GlobalCounters.global_ops - ops1 >= 2 * 48 * 64 * 96
    assert step_ops < 2 * (2 * 48 * 64 * 96) + 2 * 48 * 96 * 64, step_ops
    assert dx.shape == (48, 96)

def test_reader_of_a_computed_value_that_depends_on_the_overwritten_buffer():
    rng = np.random.default_rng(2)
    xs, ws, ms = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))
    x, w, m = Tensor(xs).realize(), Tensor(ws).realize(), Tensor(ms).realize()
    a = (x @ w).relu()                          # read by the update and by the reader
    reader = a @ m                              # its own part: a product over `a`, computed before the write
    w.assign(w - 0.01 * (a.T @ x)).realize()
    a_np = np.maximum(xs @ ws, 0)
    np.testing.assert_allclose(w.numpy(), ws - 0.01 * (a_np.T @ xs), rtol=1e-4, atol=1e-4)
    assert reader.uop.base.op is not Ops.BUFFER
    w.assign(w * 0).realize()                   # a second write: the reader holds its own copies
    np.testing.assert_allclose(reader.numpy(), a_np @ ms, rtol=1e-4, atol=1e-3)

def test_cheap_reader_is_computed_with_the_write():
    xs = np.arange(40, dtype=np.float32)
    t = Tensor(xs).realize()
    before = t + 10                             # an elementwise reader: cheaper than a copy of t
    t.assign(t * 3).realize()
    assert before.uop.base.op is Ops.BUFFER
    np.testing.assert_allclose(before.numpy(), xs + 10)
    np.testing.assert_allclose(t.numpy(), xs * 3)

def test_reader_through_views_of_the_overwritten_buffer():
    rng = np.random.default_rng(3)
    ws, vs = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((48, 32)).astype(np.float32)
    w, v = Tensor(ws).realize(), Tensor(vs).realize()
    reader = (w.T[::2] @ w.T[1::2].T).sum(1) + v.sum()   # strided, transposed views of w
    w.assign(w + 1).realize()
    np.testing.assert_allclose(reader.numpy(), (ws.T[::2] @ ws.T[1::2].T).sum(1) + vs.sum(), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(w.numpy(), ws + 1)

def test_jitted_step_matches_torch():
    params, xs, ys = _mlp(4)
    opt = nn.optim.Adam(params, lr=1e-2)
    tparams = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    topt = torch.optim.Adam(tparams, lr=1e-2)
    step = _jitted_step(params, opt)
    for i in range(3):
        xi = np.roll(xs, i, axis=0)
        loss = step(Tensor(xi), Tensor(ys)).numpy()
        np.testing.assert_allclose(loss, _torch_step(tparams, topt, xi, ys), rtol=1e-4, err_msg=f"call {i}")
    for p, tp in zip(params, tparams):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-3, atol=1e-5)

def test_gradient_accumulated_into_a_kept_input_stays_bounded():
    # the same input every step: its .grad accumulates (lazily) over the steps, and is read at the end. Each deferred
    # gradient over copies is computed at the next step instead of growing by a step's graph and copies every step
    params, xs, ys = _mlp(5)
    opt = nn.optim.SGD(params, lr=0.1)
    x, y = Tensor(xs), Tensor(ys)
    total = np.zeros_like(xs, dtype=np.float64)
    sizes = []
    for _ in range(6):
        before = [p.numpy().copy() for p in params]
        with Tensor.train():
            opt.zero_grad()
            _forward(params, x).sparse_categorical_crossentropy(y).backward()
            opt.step()
        total += _torch_mlp(before, xs, ys)[1]
        sizes.append(len(x.grad.uop.toposort()))
    assert max(sizes) <= 2 * sizes[0], sizes   # (grown by a step each time, the sixth would be 5 steps more)
    np.testing.assert_allclose(x.grad.numpy(), total, rtol=1e-4, atol=1e-7)

def test_jitted_step_replays_no_copy_for_the_capture_calls_input_gradient():
    # the capture call's input gradient is deferred over a copy of the first layer's weights; replays make no input
    # gradient, so they don't take that copy again (the capture call's gradient, read before any replay, is right)
    from fusegrad.engine.realize import BufferCopy
    params, xs, ys = _mlp(6)
    opt = nn.optim.SGD(params, lr=0.1)
    step = _jitted_step(params, opt)
    xs_of = [np.roll(xs, i, axis=0) for i in range(5)]
    step(Tensor(xs_of[0]), Tensor(ys))
    before = [p.numpy().copy() for p in params]
    captured_x = Tensor(xs_of[1])
    step(captured_x, Tensor(ys))
    assert not any(isinstance(ei.prg, BufferCopy) for ei in step.captured)
    np.testing.assert_allclose(captured_x.grad.numpy(), _torch_mlp(before, xs_of[1], ys)[1], rtol=1e-4, atol=1e-7)
    tparams = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    topt = torch.optim.SGD(tparams, lr=0.1)
    for xi in xs_of[2:]:
        loss = step(Tensor(xi), Tensor(ys)).numpy()
        np.testing.assert_allclose(loss, _torch_step(tparams, topt, xi, ys), rtol=1e-4)
    for p, tp in zip(params, tparams): np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-3, atol=1e-5)

def test_reads_of_targets_asked_in_any_order():
    # which nodes read an overwritten buffer is worked out on demand (tensor/__init__.py _Reads): the same answer as
    # the plain definition (a target, or a node with a source that reads one), whatever order the nodes are asked in
    from fusegrad.tensor import _Reads
    from fusegrad.uop.ops import UOp
    rng = np.random.default_rng(5)
    for trial in range(6):
        bufs = [Tensor(rng.standard_normal(6).astype(np.float32)).realize() for _ in range(4)]
        nodes = list(bufs)
        for _ in range(40):
            a, b = nodes[rng.integers(len(nodes))], nodes[rng.integers(len(nodes))]
            nodes.append(a * b if rng.integers(2) else (a + 1.5).exp())
        targets = {bufs[i].uop.base for i in rng.choice(4, 1 + trial % 3, replace=False)}
        topo = list(UOp.sink_of(*[t.uop for t in nodes]).toposort())[:-1]
        expected: dict[UOp, bool] = {}
        for u in topo: expected[u] = u in targets or any(expected[s] for s in u.src)
        reads = _Reads(targets)
        for i in rng.permutation(len(topo)): assert (topo[i] in reads) == expected[topo[i]]
        assert any(expected.values()) and not all(expected.values())

def _takes_memory(ei) -> bool:
    from fusegrad.schedule.merge import TAKES_MEMORY
    return ei.ast.op is Ops.COPY and ei.ast.arg[-1] == TAKES_MEMORY

def test_snapshot_of_the_weights_takes_their_memory():
    # the copy of the first layer's weights that the input's gradient keeps takes their memory, and the optimizer's
    # kernel writes the new weights into the copy's fresh memory, reading the old ones from the copy (schedule/merge.py
    # _snapshot_by_exchange): nothing is copied or stored twice in the step
    from fusegrad.uop.ops import device_buffer
    params, xs, ys = _mlp(7)
    opt = nn.optim.Adam(params, lr=1e-2)
    tparams = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    topt = torch.optim.Adam(tparams, lr=1e-2)
    for step in range(3):
        before = [p.numpy().copy() for p in params]
        memory = device_buffer(params[0].uop)._buf
        xi = np.roll(xs, step, axis=0)
        x, y = Tensor(xi), Tensor(ys)
        with Tensor.train():
            opt.zero_grad()
            _forward(params, x).sparse_categorical_crossentropy(y).backward()
            items = Tensor.schedule(*opt.schedule_step())
        for ei in items: ei.run()
        copies = [ei for ei in items if ei.ast.op is Ops.COPY]
        assert [ei.bufs[1] for ei in copies] == [device_buffer(params[0].uop)], f"step {step}"
        assert _takes_memory(copies[0]) and device_buffer(params[0].uop)._buf is not memory, f"step {step}"
        # (the kernel updating the weights stores their gradient, which .grad keeps, the weights and their two
        # moments: no snapshot)
        update = [ei for ei in items if ei.ast.op is Ops.SINK and device_buffer(params[0].uop) in ei.outputs()]
        assert len(update) == 1 and len(update[0].outputs()) == 4, f"step {step}"
        _torch_step(tparams, topt, xi, ys)
        np.testing.assert_allclose(x.grad.numpy(), _torch_mlp(before, xi, ys)[1], rtol=1e-4, atol=1e-7,
                                   err_msg=f"step {step}")
        for p, tp in zip(params, tparams):
            np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-3, atol=1e-5, err_msg=f"step {step}")

def test_snapshot_keeps_the_memory_that_a_host_view_reads():
    # a live host view of the weights' memory (a zero-copy memoryview) expects the new values there after the write:
    # the snapshot copies instead of taking the memory, and the values are the same
    from fusegrad.uop.ops import device_buffer
    rng = np.random.default_rng(12)
    ws, ms = rng.standard_normal((40, 24)).astype(np.float32), rng.standard_normal((24, 40)).astype(np.float32)
    w, m = Tensor(ws).realize(), Tensor(ms).realize()
    buf = device_buffer(w.uop)
    memory = buf._buf
    view = buf.as_buffer(allow_zero_copy=True)
    reader = w @ m                                   # deferred over a snapshot of w
    w.assign(w * 3 - 1).realize()
    assert device_buffer(w.uop)._buf is memory
    np.testing.assert_allclose(np.frombuffer(view, np.float32).reshape(40, 24), ws * 3 - 1, rtol=1e-6)
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)
    del view

def test_snapshot_keeps_the_memory_of_a_viewed_buffer():
    # a Buffer view took the weights' address when allocated: the snapshot copies, and the view reads the new values
    from fusegrad.uop.ops import device_buffer
    rng = np.random.default_rng(13)
    ws, ms = rng.standard_normal((32, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    w, m = Tensor(ws).realize(), Tensor(ms).realize()
    part = device_buffer(w.uop).view(16, w.dtype, 64).ensure_allocated()   # (elements 16..31)
    reader = w @ m
    w.assign(w + 2).realize()
    out = np.empty(16, np.float32)
    part.copyout(memoryview(out).cast("B"))
    np.testing.assert_allclose(out, ws.reshape(-1)[16:32] + 2, rtol=1e-6)
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)

def test_readers_of_the_old_values_in_the_same_schedule_read_the_snapshot():
    # a cheap reader of the old weights computed with the write (their row sums) and the deferred product both see
    # the values before the write, though the weights' memory went to the snapshot
    rng = np.random.default_rng(14)
    ws, ms = rng.standard_normal((48, 32)).astype(np.float32), rng.standard_normal((32, 48)).astype(np.float32)
    w, m = Tensor(ws).realize(), Tensor(ms).realize()
    sums = w.sum(axis=1)
    reader = w @ m
    w.assign(w * 0.5 + 1)
    items = Tensor.schedule(w, sums)
    for ei in items: ei.run()
    assert any(_takes_memory(ei) for ei in items)
    np.testing.assert_allclose(sums.numpy(), ws.sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.numpy(), ws * 0.5 + 1, rtol=1e-6)

def test_jitted_function_reads_weights_whose_memory_an_eager_step_moved():
    # a TinyJit captured over the weights, replayed after eager steps that moved their memory to snapshots, reads
    # the weights' current memory (its prepared launches are made again when a buffer's memory changed)
    from fusegrad.uop.ops import device_buffer
    params, xs, ys = _mlp(15)
    opt = nn.optim.SGD(params, lr=0.1)
    predict = TinyJit(lambda x: _forward(params, x).realize())
    xt = Tensor(xs).realize()
    for _ in range(3): predict(xt)
    tparams = [torch.tensor(p.numpy(), requires_grad=True) for p in params]
    topt = torch.optim.SGD(tparams, lr=0.1)
    for step in range(3):
        memory = device_buffer(params[0].uop)._buf
        xi = np.roll(xs, step, axis=0)
        with Tensor.train():
            opt.zero_grad()
            x = Tensor(xi)
            _forward(params, x).sparse_categorical_crossentropy(Tensor(ys)).backward()
            opt.step()
        assert device_buffer(params[0].uop)._buf is not memory
        _torch_step(tparams, topt, xi, ys)
        with torch.no_grad():
            want = (torch.relu(torch.tensor(xs) @ tparams[0].T + tparams[1]) @ tparams[2].T + tparams[3]).numpy()
        np.testing.assert_allclose(predict(xt).numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")

def test_buffer_exchange_memory():
    # two Buffers trade memory only where nothing else holds either address: not views, host views, memory passed
    # in, another size
    import ctypes
    from fusegrad.device import Buffer
    from fusegrad.dtype import dtypes
    def filled(n: int, v: float) -> Buffer:
        b = Buffer("CPU", n, dtypes.float32).ensure_allocated()
        b.copyin(memoryview(np.full(n, v, np.float32)).cast("B"))
        return b
    def values(b: Buffer) -> np.ndarray:
        out = np.empty(b.size, np.float32)
        b.copyout(memoryview(out).cast("B"))
        return out
    a, b = filled(8, 1.0), filled(8, 2.0)
    assert a.exchange_memory(b)
    assert (values(a) == 2).all() and (values(b) == 1).all()
    assert not a.exchange_memory(filled(4, 3.0))                   # another size
    viewed = filled(8, 4.0)
    viewed.view(2, dtypes.float32, 0)
    assert not a.exchange_memory(viewed) and not viewed.exchange_memory(a)
    exported = filled(8, 5.0)
    host = exported.as_buffer(allow_zero_copy=True)
    assert not a.exchange_memory(exported)
    del host
    assert a.exchange_memory(exported) and (values(a) == 5).all()
    raw = np.full(8, 6.0, np.float32)
    given = Buffer("CPU", 8, dtypes.float32, opaque=(ctypes.c_uint8 * 32).from_buffer(raw))
    assert not a.exchange_memory(given) and (values(a) == 5).all()
    assert not a.exchange_memory(Buffer("CPU", 8, dtypes.float32))   # not allocated: no memory to trade

def _snapshot_merges(monkeypatch) -> list[bool]:
    """Whether each snapshot merge.py was asked to take the memory of the buffer it copies (the kernel overwriting it
    then reads the old values from the snapshot) could."""
    import fusegrad.schedule.merge as M
    made: list[bool] = []
    plain = M._snapshot_by_exchange
    def recording(copy, writer, copied):
        k = plain(copy, writer, copied)
        made.append(k is not None)
        return k
    monkeypatch.setattr(M, "_snapshot_by_exchange", recording)
    return made

def test_snapshot_of_a_buffer_written_in_part_keeps_every_element(monkeypatch):
    # a write into half of the buffer loads only that half's old values: the snapshot is a copy of its own, and the
    # reader sees the other half too as it was
    merges = _snapshot_merges(monkeypatch)
    rng = np.random.default_rng(8)
    ws, ms = rng.standard_normal((32, 48)).astype(np.float32), rng.standard_normal((48, 40)).astype(np.float32)
    w, m = Tensor(ws).realize(), Tensor(ms).realize()
    reader = w @ m                                  # deferred over a snapshot of w
    part = w[:16]
    part.assign(part * 2 + 1).realize()
    assert merges == [False]
    w.assign(w - 1).realize()                       # a second write, of every element
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.numpy(), np.concatenate([ws[:16] * 2 + 1, ws[16:]]) - 1, rtol=1e-6)

def test_whole_buffer_indexes():
    # the stores a snapshot may be taken from: every index of the buffer once, in any order of the loops
    from fusegrad.schedule.indexing import flat_index
    from fusegrad.schedule.merge import _whole
    from fusegrad.uop.ops import UOp
    a, b, c = UOp.range(4, 0, "loop"), UOp.range(6, 1, "loop"), UOp.range(5, 2, "loop")
    assert _whole(flat_index((a, b, c), (4, 6, 5)), 120)
    assert _whole(flat_index((c, a, b), (5, 4, 6)), 120)       # a permuted view's store: loops in another order
    assert not _whole(flat_index((a, b, c), (4, 6, 5)), 240)   # half of a bigger buffer
    assert not _whole(flat_index((a, b, c), (4, 6, 5)) + 120, 240)   # its other half
    assert not _whole(flat_index((a, b), (4, 6)) * 2, 48)       # every other element
    assert not _whole(a * 6 + b * 2, 24)                       # overlapping: some elements twice, some never

@pytest.mark.parametrize("host_copy_kernel", [True, False])
def test_snapshot_of_a_buffer_overwritten_without_reading_it_is_a_copy(monkeypatch: pytest.MonkeyPatch,
                                                                     host_copy_kernel: bool):
    # a write that doesn't load the old values has none to store: the snapshot stays a copy of its own. Its schedule,
    # handed out and run item by item, copies a buffer that its last item overwrites: as a queued kernel, and through
    # the host (devices without the CPU's host-copy kernel: LLVM), where the copy reads it unchecked (its schedule
    # checked its reads) instead of raising UnrunScheduleError
    import fusegrad.engine.realize as realize
    if not host_copy_kernel: monkeypatch.setattr(realize, "_host_copy_program", lambda dest, src: None)
    rng = np.random.default_rng(9)
    ws, ms, vs = (rng.standard_normal((48, 48)).astype(np.float32) for _ in range(3))
    w, m, v = Tensor(ws).realize(), Tensor(ms).realize(), Tensor(vs).realize()
    reader = w @ m
    w.assign(v.exp())
    items = Tensor.schedule(w)
    assert any(ei.ast.op is Ops.COPY for ei in items)
    for ei in items: ei.run()
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.numpy(), np.exp(vs), rtol=1e-5)

def test_snapshot_taken_by_a_transposed_write(monkeypatch):
    # an update written through a transposed view stores every element once: the snapshot takes the buffer's memory
    # and the update reads the old values from it, in the buffer's own order (the assign to a view is realized at
    # once)
    merges = _snapshot_merges(monkeypatch)
    rng = np.random.default_rng(10)
    ws, ms = rng.standard_normal((40, 24)).astype(np.float32), rng.standard_normal((24, 40)).astype(np.float32)
    w, m = Tensor(ws).realize(), Tensor(ms).realize()
    reader = w @ m
    w.T.assign(w.T * 3 - 1)
    assert merges == [True]
    np.testing.assert_allclose(reader.numpy(), ws @ ms, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w.numpy(), ws * 3 - 1, rtol=1e-6)

def test_snapshots_inside_a_jitted_function_stay_copies(monkeypatch):
    # inside a TinyJit's function (its first call and its capture) a snapshot is an unmarked copy, which replays drop:
    # merged into the optimizer's kernel it would be stored in every replay, and the first call would compile a
    # variant of that kernel the capture doesn't use. A plain eager step marks it, to be stored by that kernel
    import fusegrad.tensor as T
    from fusegrad.schedule.merge import SNAPSHOT
    made: list = []
    plain = T._snapshot
    def recording(buf):
        u = plain(buf)
        made.append(u.arg)
        return u
    monkeypatch.setattr(T, "_snapshot", recording)
    params, xs, ys = _mlp(11)
    opt = nn.optim.SGD(params, lr=0.1)
    step = _jitted_step(params, opt)
    for i in range(2): step(Tensor(np.roll(xs, i, axis=0)), Tensor(ys))
    assert made and all(a is None for a in made), made
    made.clear()
    with Tensor.train():
        opt.zero_grad()
        x = Tensor(xs)
        _forward(params, x).sparse_categorical_crossentropy(Tensor(ys)).backward()
        opt.step()
    assert made and all(a == SNAPSHOT for a in made), made
