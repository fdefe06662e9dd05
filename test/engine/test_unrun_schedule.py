"""A schedule returned by Tensor.schedule() and not run yet: the tensors point at buffers no kernel has written, so
reading one (numpy, tolist, item, data, a copy to another device, a kernel of a later realize) raises
UnrunScheduleError naming the remedy; once the items that write a buffer have run (run_schedule, ExecItem.run, in
part or whole, once or twice) its values are NumPy's."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.engine.realize import UnrunScheduleError, run_schedule

# the message names what happened and both ways out
UNRUN = r"Tensor\.schedule\(\).*has not run yet: run that schedule first with .*run_schedule.*or call \.realize\(\)"

def _inputs() -> tuple[Tensor, Tensor, np.ndarray, np.ndarray]:
    a_np = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    b_np = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)
    return Tensor(a_np).realize(), Tensor(b_np).realize(), a_np, b_np

def test_reading_an_unrun_output_raises_naming_the_remedy():
    a, b, a_np, b_np = _inputs()
    out = (a @ b).abs().sqrt()
    sched = out.schedule()
    assert sched
    for read in (out.numpy, out.tolist, out.data, lambda: out.sum().item(), lambda: out[0, 0].item()):
        with pytest.raises(UnrunScheduleError, match=UNRUN):
            read()
    run_schedule(sched)
    np.testing.assert_allclose(out.numpy(), np.sqrt(np.abs(a_np @ b_np)), rtol=1e-5, atol=1e-5)
    assert out.tolist() == out.numpy().tolist()

def test_scalar_output_item_raises_until_run():
    a, _, a_np, _ = _inputs()
    total = (a * 2).sum()
    sched = total.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        total.item()
    for ei in sched: ei.run()
    assert total.item() == pytest.approx(float((a_np * 2).sum(dtype=np.float64)), rel=1e-5, abs=1e-4)

def test_copy_to_another_device_raises_until_run():
    a, _, a_np, _ = _inputs()
    out = a + 1
    sched = out.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        out.to("PYTHON").numpy()
    run_schedule(sched)
    np.testing.assert_allclose(out.to("PYTHON").numpy(), a_np + 1, rtol=1e-6)

def test_shared_intermediate_read_by_another_tensor_raises_then_works():
    a, b, a_np, b_np = _inputs()
    c = (a @ b).contiguous()
    out, other = c.abs().sqrt(), c + 1   # `other` shares c, which the schedule of `out` makes a buffer
    sched = out.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        other.numpy()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        other.realize()
    run_schedule(sched)
    # the failed realizes left `other` lazy: realized now, it reads what the schedule wrote
    other.realize()
    ref = a_np @ b_np
    np.testing.assert_allclose(other.numpy(), ref + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.numpy(), np.sqrt(np.abs(ref)), rtol=1e-5, atol=1e-5)

def test_realize_of_a_dependent_tensor_after_the_schedule_ran():
    a, b, a_np, b_np = _inputs()
    out = (a @ b).relu()
    sched = out.schedule()
    run_schedule(sched)
    dep = (out * 3 - 1).realize()
    np.testing.assert_allclose(dep.numpy(), np.maximum(a_np @ b_np, 0) * 3 - 1, rtol=1e-5, atol=1e-5)
    # the same op again (a realize the schedule cache replays) reads the buffer as well
    again = (out * 3 - 1).realize()
    np.testing.assert_allclose(again.numpy(), dep.numpy())

def test_dependent_op_built_before_the_run_is_realized_after():
    a, b, a_np, b_np = _inputs()
    out = (a @ b).relu()
    sched = out.schedule()
    dep = out.sum(axis=0)
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        dep.realize()
    run_schedule(sched)
    np.testing.assert_allclose(dep.numpy(), np.maximum(a_np @ b_np, 0).sum(axis=0), rtol=1e-4, atol=1e-4)

def test_partial_runs():
    a, b, a_np, b_np = _inputs()
    mid = (a @ b).contiguous()
    out = mid.softmax(axis=1)
    sched = out.schedule()
    assert len(sched) >= 2
    # the last item alone reads what the first writes: it raises and runs nothing
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        run_schedule(sched[-1:])
    run_schedule(sched[:1])
    np.testing.assert_allclose(mid.numpy(), a_np @ b_np, rtol=1e-5, atol=1e-5)
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        out.numpy()
    run_schedule(sched[1:])
    ref = np.exp(a_np @ b_np - (a_np @ b_np).max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), ref / ref.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)

def test_items_run_one_by_one():
    a, b, a_np, b_np = _inputs()
    out = (a @ b).softmax(axis=1)
    sched = out.schedule()
    for ei in sched: ei.run()
    ref = np.exp(a_np @ b_np - (a_np @ b_np).max(axis=1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), ref / ref.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)

def test_multi_output_schedule():
    a, b, a_np, b_np = _inputs()
    x, y = (a @ b).relu(), (a @ b).sum(axis=1)
    sched = x.schedule(y)
    for t in (x, y):
        with pytest.raises(UnrunScheduleError, match=UNRUN):
            t.numpy()
    run_schedule(sched)
    np.testing.assert_allclose(x.numpy(), np.maximum(a_np @ b_np, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y.numpy(), (a_np @ b_np).sum(axis=1), rtol=1e-4, atol=1e-4)

def test_running_twice_gives_the_same_values():
    a, b, a_np, b_np = _inputs()
    out = (a @ b) * 2
    sched = out.schedule()
    run_schedule(sched)
    first = out.numpy()
    run_schedule(sched)
    np.testing.assert_allclose(first, (a_np @ b_np) * 2, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.numpy(), first)

def test_assign_target_raises_until_run():
    w_np = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = Tensor(w_np).realize()
    w.assign(w * 2 + 1)
    sched = w.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        w.numpy()
    run_schedule(sched)
    np.testing.assert_array_equal(w.numpy(), w_np * 2 + 1)

def test_same_structure_scheduled_again():
    # the second schedule of the same graph structure comes from the schedule cache: its buffers are marked too
    a, b, a_np, b_np = _inputs()
    outs, scheds = [], []
    for k in (1.0, 2.0):
        outs.append((a @ b) + k)
        scheds.append(outs[-1].schedule())
        with pytest.raises(UnrunScheduleError, match=UNRUN):
            outs[-1].numpy()
    for s in reversed(scheds): run_schedule(s)
    for k, out in zip((1.0, 2.0), outs):
        np.testing.assert_allclose(out.numpy(), a_np @ b_np + k, rtol=1e-5, atol=1e-5)

def test_schedule_with_vars_of_a_symbolic_shape():
    from fusegrad import Variable
    x_np = np.arange(10, dtype=np.float32)
    x = Tensor(x_np).realize()
    v = Variable("n", 1, 10)
    out = (x[:v.bind(6)] * 3).contiguous()
    sched, var_vals = out.schedule_with_vars()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        out.numpy()
    run_schedule(sched, var_vals)
    np.testing.assert_array_equal(out.numpy(), x_np[:6] * 3)

def test_eager_ops_after_an_unrun_schedule_is_dropped_still_work():
    # a schedule dropped unrun leaves its tensor unreadable; other tensors' realizes give their values
    a, b, a_np, b_np = _inputs()
    lost = (a @ b) - 5
    lost.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        lost.numpy()
    for _ in range(3):
        np.testing.assert_allclose((a + b.T[:16, :8]).numpy(), a_np + b_np.T[:16, :8], rtol=1e-6)

@pytest.mark.parametrize("one_by_one", [False, True])
def test_reader_of_an_assign_target_in_the_same_schedule_reads_the_old_values(one_by_one):
    # `y` reads w before the assign: the schedule computes it first, from w's old values, then writes w
    w_np = np.arange(12, dtype=np.float32).reshape(3, 4)
    w = Tensor(w_np).realize()
    y = w * 2
    w.assign(w + 1)
    sched = w.schedule()
    for t in (w, y):
        with pytest.raises(UnrunScheduleError, match=UNRUN):
            t.numpy()
    if one_by_one:
        for ei in sched: ei.run()
    else: run_schedule(sched)
    np.testing.assert_array_equal(y.numpy(), w_np * 2)
    np.testing.assert_array_equal(w.numpy(), w_np + 1)

def test_optimizer_step_scheduled_then_run():
    # a step's schedule reads the weights (forward, backward) before the items that write them
    from fusegrad import nn
    x_np = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    w_np = np.random.default_rng(3).standard_normal((6, 3)).astype(np.float32)
    w = Tensor(w_np, requires_grad=True)
    opt = nn.optim.SGD([w], lr=0.1)
    with Tensor.train():
        opt.zero_grad()
        (Tensor(x_np) @ w).sum().backward()
        sched = Tensor.schedule(*opt.schedule_step())
        with pytest.raises(UnrunScheduleError, match=UNRUN):
            w.numpy()
        run_schedule(sched)
    # d/dw sum(x @ w) = x^T @ ones
    np.testing.assert_allclose(w.numpy(), w_np - 0.1 * x_np.T @ np.ones((4, 3), np.float32), rtol=1e-5, atol=1e-5)


def test_tinyjit_replay_of_an_unrun_input_raises_until_run():
    from fusegrad import TinyJit
    a, b, a_np, b_np = _inputs()
    step = TinyJit(lambda x: (x * 2 + 1).realize())
    for _ in range(3): step(Tensor(a_np @ b_np).realize())   # plain, capture, replay
    x = a @ b
    sched = x.schedule()
    with pytest.raises(UnrunScheduleError, match=UNRUN):
        step(x)
    run_schedule(sched)
    np.testing.assert_allclose(step(x).numpy(), (a_np @ b_np) * 2 + 1, rtol=1e-5, atol=1e-5)
