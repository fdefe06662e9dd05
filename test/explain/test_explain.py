"""Tensor.explain: every kernel boundary comes with the scheduler's reason, over a set of programs; source lines
are recorded only while asked for."""
from __future__ import annotations
import pytest
from fusegrad import Context, Tensor, track_sources
from fusegrad.engine import explain as ex
from fusegrad.nn import Conv2d, Linear
from fusegrad.nn.optim import Adam
from fusegrad.schedule.kernelize import find_realized
from fusegrad.uop.ops import Ops, UOp

def _mlp_step() -> list[Tensor]:
    l1, l2 = Linear(16, 32), Linear(32, 4)
    opt = Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    x, y = Tensor.randn(8, 16), Tensor([0, 1, 2, 3, 0, 1, 2, 3])
    with Tensor.train():
        opt.zero_grad()
        loss = l2(l1(x).relu()).sparse_categorical_crossentropy(y)
        loss.backward()
        return [loss, *opt.schedule_step()]

def _conv_net() -> list[Tensor]:
    c1, c2 = Conv2d(3, 8, 3), Conv2d(8, 8, 3)
    x = Tensor.randn(2, 3, 12, 12)
    return [c2(c1(x).relu()).relu().max_pool2d().mean((2, 3))]

def _softmax() -> list[Tensor]: return [Tensor.randn(6, 10).softmax(-1)]

def _attention() -> list[Tensor]:
    q, k, v = Tensor.randn(2, 4, 8, 16), Tensor.randn(2, 4, 8, 16), Tensor.randn(2, 4, 8, 16)
    return [q.scaled_dot_product_attention(k, v, is_causal=True)]

def _sharded() -> list[Tensor]:
    a = Tensor.randn(4, 8).realize().shard(("CPU", "CPU:1"), axis=0)
    return [(a * 2).sum(0)]

def _assign() -> list[Tensor]:
    w = Tensor.ones(4, 4).contiguous().realize()
    return [w.assign(w * 2 + w.sum(0))]

def _padded_and_long() -> list[Tensor]:
    a, b = Tensor.randn(64, 512), Tensor.randn(512, 64)
    return [(a @ b).sum(1).pad((1, 1)) + 1, Tensor.randn(4, 4).sin().contiguous() * 2]

PROGRAMS = [_mlp_step, _conv_net, _softmax, _attention, _sharded, _assign, _padded_and_long]

@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.__name__.strip("_"))
def test_every_boundary_has_a_reason(program):
    with track_sources():
        outs = program()
    text = outs[0].explain(*outs[1:])
    roots = [u for t in outs for u in _shards(t)]
    explained = ex.explain(roots)
    assert explained.kernels, "the program has kernels to explain"
    for k in explained.kernels:
        assert k.outputs, f"kernel {k.index} ({k.kind}) has no reason:\n{text}"
        for desc, reason, fix, _ in k.outputs: assert reason and fix, desc
    assert text.count("cut: ") >= len(explained.kernels)

@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.__name__.strip("_"))
def test_the_decision_records_a_reason_for_each_node(program):
    parts = ex._schedule([u for t in program() for u in _shards(t)])
    why: dict = {}
    realized = find_realized(parts.ssink, why)
    assert realized, "something is realized"
    assert realized <= set(why), [u.op for u in realized - set(why)]
    for w in why.values(): ex.reason_text(w)  # each rule's reason has its text

def _shards(t: Tensor) -> list[UOp]:
    from fusegrad.tensor import _shards as shards
    return shards([t])

def test_reasons_name_the_rule_and_the_line():
    with track_sources():
        x = Tensor.randn(4, 8)
        y = (x @ Tensor.randn(8, 8)).sum()  # the matmul's reduction inside the sum's loop
        z = x.contiguous() + 1
    text = y.explain(z)
    assert "reduce of a reduce" in text and "__matmul__ at test_explain.py" in text
    assert "realized by you" in text
    assert "you asked for it with .contiguous()" in text and "contiguous at test_explain.py" in text

def test_broadcast_reason():
    with track_sources():
        a = Tensor.randn(16, 1).exp()
        out = a.expand(16, 64).T + Tensor.randn(64, 16)  # read by 64 elements each, not along a trailing axis
    assert "recompute would cost 64x" in out.explain()

def test_no_sources_recorded_unless_asked():
    ex.sources.clear()
    x = Tensor.randn(4, 4)
    y = (x + 1).sum()
    assert len(ex.sources) == 0
    text = y.explain()
    assert "TRACK_SOURCES=1" in text
    with Context(TRACK_SOURCES=1): z = x * 3
    assert z.uop in ex.sources and ex.sources[z.uop].filename.endswith("test_explain.py")
    n = len(ex.sources)
    x * 5
    assert len(ex.sources) == n

def test_explain_runs_nothing():
    from fusegrad import GlobalCounters
    x = Tensor.randn(32, 32)
    y = (x @ x).relu().sum()
    k0 = GlobalCounters.kernel_count
    y.explain()
    y.estimate(predict=False)
    assert GlobalCounters.kernel_count == k0
    assert y.uop.base.op is not Ops.BUFFER  # still lazy: explaining re-points no tensor

def test_snapshot_reason(monkeypatch):
    # the input's gradient is kept lazy over snapshots of the first layer's weights and bias, which take their memory
    # (the optimizer's kernels write the new values into the snapshots' fresh memory): the explanation says so, on
    # those copies. (Linear layers as one node each, made in a process that shards no tensor: the bias is an operand
    # of the input's gradient then)
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    from fusegrad.tensor.explain import _roots
    l1, l2 = Linear(16, 32), Linear(32, 4)
    opt = Adam([l1.weight, l1.bias, l2.weight, l2.bias], lr=1e-3)
    x, y = Tensor.randn(64, 16), Tensor([0, 1, 2, 3] * 16)
    with Tensor.train():
        opt.zero_grad()
        l2(l1(x).relu()).sparse_categorical_crossentropy(y).backward()
        outs = opt.schedule_step()
    text = outs[0].explain(*outs[1:])
    assert "a copy of the old values a lazy tensor reads" in text, text
    explained = ex.explain(_roots(tuple(outs)))
    holders = [k for k in explained.kernels
               if any(r.startswith("a copy of the old values") for _, r, _, _ in k.outputs)]
    assert sorted(len(k.outputs) for k in holders) == [1, 1], text
    assert all(k.kind.startswith("copy, which takes the memory") for k in holders), text
    assert sorted(k.outputs[0][0] for k in holders) == [f"COPY {l1.bias.numel()} float",
                                                        f"COPY {l1.weight.numel()} float"], text
    assert x.grad is not None

def test_a_function_built_as_one_node_is_named_by_its_function(monkeypatch):
    # a Linear layer, gelu and the cross-entropy are each one COMPOSITE node (tensor/composite.py), their gradients
    # too: a kernel boundary at one names the function (its gradient), not the node's kind
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    l1 = Linear(16, 32)
    x, y = Tensor.randn(8, 16), Tensor([0, 1, 2, 3, 0, 1, 2, 3])
    h = l1(x).gelu()
    loss = h.sparse_categorical_crossentropy(y)
    loss.backward()
    assert h.uop.op is Ops.COMPOSITE and l1.weight.grad.uop.op is Ops.COMPOSITE
    text = Tensor.explain(h, l1.weight.grad)
    assert "gelu 8x32 float (made by gelu)" in text, text
    assert "gradient of linear 32x16 float (made by gradient of linear)" in text, text
    assert "COMPOSITE" not in text
    ce = ex.explain([loss.uop])
    assert [d for k in ce.kernels for d, *_ in k.outputs][-1] == "sparse_cross_entropy scalar float"

def test_a_boundary_inside_a_function_built_as_one_node_names_the_function(monkeypatch):
    # the product inside a Linear layer's node is a kernel boundary when its result is read twice (by the relu's
    # value and by the backward's mask): named with the function whose graph made it, not only by its kind
    import fusegrad.tensor
    monkeypatch.setattr(fusegrad.tensor, "_sharding_used", False)
    l1, l2 = Linear(16, 32), Linear(32, 4)
    x, y = Tensor.randn(64, 16), Tensor([0, 1, 2, 3] * 16)
    l2(l1(x).relu()).sparse_categorical_crossentropy(y).backward()
    assert l1.weight.grad is not None
    explained = ex.explain([l1.weight.grad.uop, l2.weight.grad.uop])
    descs = [d for k in explained.kernels for d, *_ in k.outputs]
    # (the first layer's product, 64 rows by 32 columns summed over 16: a reduction inside "linear")
    assert "REDUCE_AXIS 64x32x1 float inside linear" in descs, descs
    assert all("COMPOSITE" not in d for d in descs)
    text = str(explained)
    assert "REDUCE_AXIS 64x32x1 float inside linear (made by linear)" in text, text
