"""Scheduler tests: kernel boundaries (fusion), the kernelize contract, the schedule cache and memory planning."""
import numpy as np
import pytest
from fusegrad import Tensor, dtypes
from fusegrad.uop.ops import Ops
from fusegrad.schedule.kernelize import schedule_cache_stats
from fusegrad.uop.ops import device_buffer

N = 64
rng = np.random.default_rng(0)
A, B, C = (rng.standard_normal((N, N)).astype(np.float32) for _ in range(3))
V = rng.standard_normal(N).astype(np.float32)

def inputs():
    a, b, c, v = Tensor(A), Tensor(B), Tensor(C), Tensor(V)
    return a, b, c, v

def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)

def _shared(x):
    for _ in range(6): x = x * x * 0.5 + x * 0.25
    return x

# (program, most kernels allowed (tinygrad 0.14 on the same programs), numpy reference)
KERNEL_COUNTS = {
    "a*b+c": (lambda a, b, c, v: a * b + c, 1, lambda: A * B + C),
    "(a*b).sum()": (lambda a, b, c, v: (a * b).sum(), 1, lambda: (A * B).sum()),
    "(a*b).sum(1)+v": (lambda a, b, c, v: (a * b).sum(1) + v, 1, lambda: (A * B).sum(1) + V),
    "a@b": (lambda a, b, c, v: a @ b, 1, lambda: A @ B),
    "(a@b).relu()+c": (lambda a, b, c, v: (a @ b).relu() + c, 1, lambda: np.maximum(A @ B, 0) + C),
    # row reductions broadcast back along their row are computed inside the consumer: one kernel
    "a.softmax(1)": (lambda a, b, c, v: a.softmax(1), 1, lambda: _softmax(A, 1)),
    "a.log_softmax(1)": (lambda a, b, c, v: a.log_softmax(1), 1, lambda: np.log(_softmax(A, 1))),
    "a.logsumexp(1)": (lambda a, b, c, v: a.logsumexp(1), 1, lambda: np.log(np.exp(A).sum(1))),
    "a.layernorm(1)": (lambda a, b, c, v: a.layernorm(1), 1,
                       lambda: (A - A.mean(1, keepdims=True)) / np.sqrt(A.var(1, keepdims=True) + 1e-5)),
    "rmsnorm": (lambda a, b, c, v: a * (a.square().mean(1, keepdim=True) + 1e-6).rsqrt(), 1,
                lambda: A / np.sqrt((A * A).mean(1, keepdims=True) + 1e-6)),
    "var": (lambda a, b, c, v: (a - a.mean(1, keepdim=True)).square().mean(1), 1,
            lambda: ((A - A.mean(1, keepdims=True)) ** 2).mean(1)),
    "softmax of a 3-d tensor": (lambda a, b, c, v: a.reshape(8, 8, 64).softmax(-1), 1,
                                lambda: _softmax(A.reshape(8, 8, 64), -1)),
    # a single short row too (a decoding step's layernorm of one token)
    "v[None].softmax(1)": (lambda a, b, c, v: v.reshape(1, N).softmax(1), 1, lambda: _softmax(V.reshape(1, N), 1)),
    "v[None].layernorm(1)": (lambda a, b, c, v: v.reshape(1, N).layernorm(1), 1,
                             lambda: ((V - V.mean()) / np.sqrt(V.var() + 1e-5)).reshape(1, N)),
    # the row's statistics computed inside the kernel of the layernorm's output, which the matmul reads
    "v[None].layernorm(1) @ b": (lambda a, b, c, v: v.reshape(1, N).layernorm(1) @ b, 2,
                                 lambda: (((V - V.mean()) / np.sqrt(V.var() + 1e-5)) @ B).reshape(1, N)),
    # a row value of an expression that reuses its parts: counted by its distinct ops (12), not by paths (126)
    "row mean of a shared expression": (lambda a, b, c, v: _shared(a) - _shared(a).mean(1, keepdim=True), 1,
                                        lambda: _shared(A) - _shared(A).mean(1, keepdims=True)),
    # over a leading axis the rows are not innermost: the reductions get their own kernels
    "a.softmax(0)": (lambda a, b, c, v: a.softmax(0), 3, lambda: _softmax(A, 0)),
    "a.T.contiguous()": (lambda a, b, c, v: a.T.contiguous(), 1, lambda: A.T),
    "a.pad(((1,1),(1,1))).sum()": (lambda a, b, c, v: a.pad(((1, 1), (1, 1))).sum(), 1, lambda: A.sum()),
    "a.max(1)": (lambda a, b, c, v: a.max(1), 1, lambda: A.max(1)),
    "a[::2,1:5]+1": (lambda a, b, c, v: a[::2, 1:5] + 1, 1, lambda: A[::2, 1:5] + 1),
}

@pytest.mark.parametrize("name", list(KERNEL_COUNTS))
def test_kernel_count(name):
    fn, most, ref = KERNEL_COUNTS[name]
    out = fn(*inputs())
    sched = out.schedule()
    assert len(sched) <= most, f"{name}: {len(sched)} kernels, expected at most {most}"
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    np.testing.assert_allclose(out.numpy(), ref(), rtol=1e-4, atol=1e-4)

def test_kernelize_contract():
    a, b, c, _ = inputs()
    out = (a * b + c).kernelize()
    assert out.uop.op is Ops.ASSIGN
    buf, kernel = out.uop.src
    assert buf.op is Ops.BUFFER and kernel.op is Ops.KERNEL
    ast = kernel.arg
    assert ast.op is Ops.SINK and ast.src[0].op is Ops.STORE
    loads = [u for u in ast.toposort() if u.op is Ops.LOAD]
    assert len(loads) == 3
    # a child read element for element: one kernel with two outputs, the product computed once and stored for both
    from fusegrad.engine.realize import run_schedule
    child = out + 2
    sched = child.schedule()
    assert len(sched) == 1 and len(sched[0].ast.src) == 2
    assert sum(u.op is Ops.MUL and u.dtype == dtypes.float32 for u in sched[0].ast.toposort()) == 1
    run_schedule(sched)
    np.testing.assert_allclose(child.numpy(), A * B + C + 2, rtol=1e-6)
    np.testing.assert_allclose(out.numpy(), A * B + C, rtol=1e-6)
    # a child that reads a kernelized tensor elsewhere (a flip) loads its buffer instead of fusing it again
    out2 = (b * a + c).kernelize()
    flipped = out2 + out2.flip(0)
    sched = flipped.schedule()
    assert len(sched) == 2 and len(sched[1].ast.src) == 1
    assert not any(u.op is Ops.MUL and u.dtype == dtypes.float32 for u in sched[1].ast.toposort())
    run_schedule(sched)
    np.testing.assert_allclose(flipped.numpy(), (A * B + C) + (A * B + C)[::-1], rtol=1e-5)

def test_realize_replaces_graph_by_buffer():
    a, b, c, _ = inputs()
    out = (a * b + c).realize()
    assert out.uop.base.op is Ops.BUFFER

def test_lazy_until_needed():
    from fusegrad import GlobalCounters
    a, b, c, _ = inputs()
    GlobalCounters.reset()
    out = (a * b).sum(1).exp() + 1
    assert GlobalCounters.kernel_count == 0
    out.numpy()
    assert GlobalCounters.kernel_count == 1

def test_long_elementwise_chain_is_one_kernel():
    a = Tensor(V)
    x = a
    ref = V.astype(np.float64)
    for i in range(600):   # (900 ops: within the kernel size bound)
        x = x * 1.0001 + 0.001 if i % 2 == 0 else x - 0.0005
        ref = ref * 1.0001 + 0.001 if i % 2 == 0 else ref - 0.0005
    sched = x.schedule()
    assert len(sched) == 1
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    np.testing.assert_allclose(x.numpy(), ref, rtol=1e-3, atol=1e-3)

def test_schedule_cache_hit_on_identical_graph():
    def step(a, b):
        return ((a @ b).relu() * 0.5 + a).sum(1)
    a, b, _, _ = inputs()
    step(a, b).schedule()
    hits = schedule_cache_stats["hits"]
    a2, b2 = Tensor(B), Tensor(A)  # different buffers, same graph
    out = step(a2, b2)
    sched = out.schedule()
    assert schedule_cache_stats["hits"] == hits + 1
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    np.testing.assert_allclose(out.numpy(), (np.maximum(B @ A, 0) * 0.5 + B).sum(1), rtol=1e-4, atol=1e-3)

def test_schedule_cache_key_tells_shared_buffers_apart():
    # the key names buffers by their place in the graph: a + b over two buffers and a + a over one are different
    # structures, and a hit maps every node of the new graph to the cached kernels by that place
    a, b, _, _ = inputs()
    np.testing.assert_allclose(((a + b) * 2).numpy(), (A + B) * 2, rtol=1e-6)
    hits, misses = schedule_cache_stats["hits"], schedule_cache_stats["misses"]
    a2 = Tensor(C)
    np.testing.assert_allclose(((a2 + a2) * 2).numpy(), (C + C) * 2, rtol=1e-6)
    assert schedule_cache_stats["misses"] == misses + 1
    a3, b3 = Tensor(B), Tensor(C)
    lazy = a3 + b3  # a live tensor over a node the cached kernels compute: it is pointed at their output too
    out = lazy * 2
    np.testing.assert_allclose(out.numpy(), (B + C) * 2, rtol=1e-6)
    assert schedule_cache_stats["hits"] >= hits + 1
    np.testing.assert_allclose(lazy.numpy(), B + C, rtol=1e-6)

def test_realized_tensors_schedule_nothing():
    # a realized tensor is its buffer, or a reshape of it (a scalar loss): realizing it again schedules nothing
    a, _, _, v = inputs()
    s = (a * 2).sum().realize()
    assert s.uop.op is Ops.RESHAPE and s.uop.src[0].op is Ops.BUFFER
    assert s.schedule() == [] and a.schedule() == [] and Tensor.schedule(a, v, s) == []
    np.testing.assert_allclose(s.numpy(), (A * 2).sum(), rtol=1e-4)

def test_memory_planner_reuses_dead_buffers():
    def chain(a):
        # each stage is read inside the next one's reduction loop, so each is its own kernel; stage i's buffer is
        # dead after stage i+1. No tensor holds the intermediates, so their storage is free to share.
        x = (a + 1).sum(0, keepdim=True)
        for _ in range(3): x = (a * x).sum(1).reshape(1, -1)
        return (a * x).sum(1)
    out = chain(Tensor(A))
    sched = out.schedule()
    assert len(sched) == 5
    bases = [b._base if getattr(b, "_base", None) is not None else b for ei in sched for b in ei.bufs[:1]]
    assert len({id(b) for b in bases}) < 5, "intermediate buffers with disjoint lifetimes should share storage"
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    r1 = (A + 1).sum(0, keepdims=True); r2 = (A * r1).sum(1)[None]; r3 = (A * r2).sum(1)[None]
    r4 = (A * r3).sum(1)[None]
    np.testing.assert_allclose(out.numpy(), (A * r4).sum(1), rtol=1e-3)

def test_replayed_schedule_shares_storage_like_the_first(monkeypatch):
    # the replay plan keeps the memory plan of its structure: the same intermediates share storage every step, none
    # that a tensor holds afterwards (here the second stage, kept by the caller), and every step computes its values
    def chain(a):
        # (each stage read inside the next one's reduction loop: a kernel each)
        x = (a + 1).sum(0, keepdim=True)
        held = x = (a * x).sum(1).reshape(1, -1)
        for _ in range(2): x = (a * x).sum(1).reshape(1, -1)
        return (a * x).sum(1), held
    from fusegrad.engine.realize import run_schedule
    def bases(sched): return [b.base for ei in sched for b in ei.bufs[:1]]
    first = None
    for i in range(4):
        if i == 3: _no_kernelize(monkeypatch)
        an = A * (1 + 0.1 * i)
        out, held = chain(Tensor(an))
        sched = Tensor.schedule(out, held)
        ids = [id(b) for b in bases(sched)]
        shape = [ids.index(x) for x in ids]  # which kernels write the same storage
        first = first or shape
        assert shape == first and len(set(ids)) < 5, (shape, first)
        assert sum(b is device_buffer(held.uop.base) for b in bases(sched)) == 1  # its storage is its own
        run_schedule(sched)
        r = (an + 1).sum(0, keepdims=True); h = (an * r).sum(1)[None]; r = h
        for _ in range(2): r = (an * r).sum(1)[None]
        np.testing.assert_allclose(out.numpy(), (an * r).sum(1), rtol=1e-3)
        np.testing.assert_allclose(held.numpy(), h, rtol=1e-4, atol=1e-3)

def test_size_zero_needs_no_kernel():
    x = Tensor.ones(3, 0) * 2 + 1
    assert len(x.schedule()) == 0
    assert x.numpy().shape == (3, 0)

def test_constant_folding():
    x = Tensor.full((4, 4), 2.0) * 3 + 1
    sched = x.schedule()
    assert len(sched) == 1
    ast = sched[0].ast
    assert not any(u.op in (Ops.MUL, Ops.ADD, Ops.LOAD) and u.dtype == dtypes.float32 for u in ast.toposort())

def test_assign_in_place():
    a = Tensor(A).realize()
    buf = a.uop.base
    a.assign(a * 2 + 1).realize()
    assert a.uop.base is buf
    np.testing.assert_allclose(a.numpy(), A * 2 + 1, rtol=1e-6)

def test_reader_runs_before_in_place_writer():
    a = Tensor(A).realize()
    b = a * 3
    a.assign(a + 1)
    Tensor.realize(b, a)
    np.testing.assert_allclose(b.numpy(), A * 3, rtol=1e-6)
    np.testing.assert_allclose(a.numpy(), A + 1, rtol=1e-6)

def test_big_full_reduction_runs_on_every_core():
    # a sum of 2^18+ elements to one number: partial sums of 64 chunks (an output loop the cores split), then their sum
    from fusegrad.codegen import get_program
    from fusegrad.device import Device
    xn = rng.standard_normal((512, 1024)).astype(np.float32)
    x = Tensor(xn, requires_grad=True)
    s = x.sum()
    sched = s.schedule()
    assert len(sched) == 2
    assert get_program(sched[0].ast, Device["CPU"].renderer).global_size > 1
    from fusegrad.engine.realize import run_schedule
    run_schedule(sched)
    np.testing.assert_allclose(s.numpy(), xn.astype(np.float64).sum(), rtol=1e-4)
    np.testing.assert_allclose(x.max().numpy(), xn.max())
    np.testing.assert_allclose(x.mean(keepdim=True).numpy(), xn.mean(keepdims=True), rtol=1e-4, atol=1e-6)
    x.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), np.ones_like(xn))

# *** the replay plan: a structure scheduled before gets its kernels and buffers without kernelizing again ***

def _no_kernelize(monkeypatch):
    import fusegrad.tensor as tensor_module
    def fail(*a, **k): raise AssertionError("a replayed schedule should not kernelize")
    monkeypatch.setattr(tensor_module, "kernelize_map_cached", fail)

def test_replay_gives_each_step_its_own_values(monkeypatch):
    # an optimizer-like step: in-place updates of two parameters, a loss over a reshape, a lazy intermediate and a
    # constant that changes every step (it is lifted to a kernel parameter, then replayed with each new value)
    def step(w, m, x, lr):
        h = (x @ w).relu()                       # held by the caller: rewritten over the kernel outputs
        loss = h.sum().reshape(1)
        g = x.T @ (h > 0).float()
        m.assign(m * 0.9 + g)
        w.assign(w - lr * m)
        Tensor.realize(loss, w, m)
        return h, loss
    rng_ = np.random.default_rng(1)
    W, M = rng_.standard_normal((N, N)).astype(np.float32) / 8, np.zeros((N, N), np.float32)
    w, m = Tensor(W).realize(), Tensor(M).realize()
    for i in range(4):
        if i == 3: _no_kernelize(monkeypatch)  # by now the plan is recorded (step 2 lifted lr)
        X = rng_.standard_normal((N, N)).astype(np.float32)
        lr = 0.01 * (i + 1)
        h, loss = step(w, m, Tensor(X), lr)
        Hn = np.maximum(X @ W, 0)
        M = M * 0.9 + X.T @ (Hn > 0).astype(np.float32)
        W = W - lr * M
        np.testing.assert_allclose(loss.numpy(), [Hn.sum()], rtol=1e-4)
        np.testing.assert_allclose(h.numpy(), Hn, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(m.numpy(), M, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(w.numpy(), W, rtol=1e-4, atol=1e-5)

def test_replay_keeps_views_and_shared_nodes_lazy(monkeypatch):
    # tensors over a realized node (an expand of it, an op on it) stay lazy and are rewritten over its new buffer
    def build(a):
        s = a.sum(1, keepdim=True)
        return s, s.expand(N, 4), (s * 3 + a).max(1)
    for i in range(3):
        if i == 2: _no_kernelize(monkeypatch)
        an = A + i
        s, view, other = build(Tensor(an))
        s.realize()
        assert s.uop.base.op is Ops.BUFFER
        np.testing.assert_allclose(view.numpy(), np.broadcast_to(an.sum(1, keepdims=True), (N, 4)), rtol=1e-4)
        np.testing.assert_allclose(other.numpy(), (an.sum(1, keepdims=True) * 3 + an).max(1), rtol=1e-4)

def test_replay_of_a_graph_with_an_empty_output(monkeypatch):
    for i in range(3):
        if i == 2: _no_kernelize(monkeypatch)
        a = Tensor(V + i)
        e, full = Tensor.ones(0, 3) * (a.sum() + 1), a * 2
        Tensor.realize(e, full)
        assert e.numpy().shape == (0, 3)
        np.testing.assert_allclose(full.numpy(), (V + i) * 2, rtol=1e-6)

def test_replay_runs_the_kernels_of_the_current_codegen_knobs(monkeypatch):
    # the plan keeps each kernel's runner per value of the knobs that change generated code: a replay under
    # TRANSCENDENTAL=0 runs the C library's exp, one under the default the polynomial, whichever was recorded first
    import re
    from fusegrad import Context
    from fusegrad.engine.realize import lower_schedule_item, run_schedule
    libm = re.compile(r"\bexp2f?\(|__builtin_exp2f?\(")
    x = np.linspace(-20, 20, 512, dtype=np.float32)
    a = Tensor(x).realize()
    for i, knob in enumerate((1, 1, 0, 0, 1, 0)):
        if i == 2: _no_kernelize(monkeypatch)   # (a replay from here on, under either value)
        with Context(TRANSCENDENTAL=knob):
            out = (a * 0.5).exp()
            items = [lower_schedule_item(ei) for ei in out.schedule()]
            assert len(items) == 1 and bool(libm.search(items[0].prg.p.src)) == (knob == 0)
            run_schedule(items)
        np.testing.assert_allclose(out.numpy(), np.exp(x.astype(np.float64) * 0.5), rtol=2e-6)

# (the PYTHON device interprets every lane: small rows only)
@pytest.mark.parametrize("device, n", [(d, n) for d in ("CPU", "CL") for n in (1, 1000, 16384, 16385, 70000)] +
                         [("PYTHON", 1), ("PYTHON", 1000)])
def test_single_row_softmax_and_layernorm(device, n):
    """A single row up to SINGLE_ROW_FUSED elements is one kernel (its reductions computed inside the consumer, on a
    GPU-style device by one group); a longer one keeps its reductions in kernels of their own."""
    from fusegrad.engine.realize import run_schedule
    from fusegrad.schedule.kernelize import SINGLE_ROW_FUSED
    x = rng.standard_normal((1, n)).astype(np.float32)
    for fn, ref, kernels in ((lambda t: t.softmax(1), _softmax(x, 1), (1, 3)),
                             (lambda t: t.layernorm(1), (x - x.mean()) / np.sqrt(x.var() + 1e-5), (1, 3))):
        out = fn(Tensor(x, device=device).realize())
        sched = out.schedule()
        assert len(sched) == kernels[n > SINGLE_ROW_FUSED]
        run_schedule(sched)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)
