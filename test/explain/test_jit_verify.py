"""TinyJit(fn, verify=n) and JIT_VERIFY=n catch replays that don't compute what the function means, naming the
likely cause."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Context, Tensor, TinyJit
from fusegrad.engine.jit_verify import JitVerifyError

def _calls(jit, n: int, change_at: int, change) -> str | None:
    for i in range(n):
        if i == change_at: change()
        try: jit(Tensor.rand(4).realize())
        except JitVerifyError as e: return str(e)
    return None

def test_frozen_python_value():
    scale = {"v": 0.5}
    jit = TinyJit(lambda x: (x * scale["v"]).contiguous(), verify=1)
    msg = _calls(jit, 4, 2, lambda: scale.update(v=2.0))
    assert msg is not None and "output 0 differs" in msg and "a Python value frozen at capture" in msg
    assert "[2.0] now but [0.5]" in msg

def test_branch_taken_differently():
    flag = {"on": True}
    jit = TinyJit(lambda x: (x + 1 if flag["on"] else x.exp()).contiguous(), verify=1)
    msg = _calls(jit, 4, 2, lambda: flag.update(on=False))
    assert msg is not None and "a branch taken differently" in msg

def test_tensor_from_outside_the_arguments():
    state = {"w": Tensor.ones(4).contiguous().realize()}
    jit = TinyJit(lambda x: (x * state["w"]).contiguous(), verify=1)
    msg = _calls(jit, 4, 2, lambda: state.update(w=Tensor.full((4,), 3.0).contiguous().realize()))
    assert msg is not None and "a tensor read from outside the arguments changed" in msg

def test_every_nth_call_and_the_knob():
    seen = []
    def f(x):
        seen.append(1)
        return (x * 2).contiguous()
    jit = TinyJit(f, verify=3)
    for _ in range(8): jit(Tensor.rand(4).realize())
    # calls 1 and 2 run it; replays 1, 3 and 6 run it again eagerly
    assert len(seen) == 5
    with Context(JIT_VERIFY=1):
        seen.clear()
        jit2 = TinyJit(f)
        for _ in range(4): jit2(Tensor.rand(4).realize())
        assert len(seen) == 4

def test_a_verified_training_step_updates_state_once():
    w = Tensor.ones(4).contiguous().realize()
    jit = TinyJit(lambda x: w.assign(w + x).realize(), verify=1)
    for _ in range(4): jit(Tensor.ones(4).contiguous().realize())
    np.testing.assert_allclose(w.numpy(), np.full(4, 5.0))

def test_bad_verify_argument():
    with pytest.raises(ValueError, match="verify"): TinyJit(lambda x: x, verify=-1)
