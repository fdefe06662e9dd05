"""DEBUG_NANS=1: the first operation that made a NaN or Inf is named with its inputs and the user's line."""
from __future__ import annotations
import math
import pytest
from fusegrad import Context, Tensor, dtypes, track_sources

def _raised(fn) -> str:
    with Context(DEBUG_NANS=1), track_sources(), pytest.raises(FloatingPointError) as e: fn()
    return str(e.value)

def test_log_of_a_negative():
    x = Tensor([1.0, -2.0, 3.0])
    msg = _raised(lambda: (x.log() * 2 + 1).realize())
    assert "LOG2 produced NaN at element (1,)" in msg and "inputs -2.0" in msg
    assert "log at test_nans.py" in msg

def test_zero_over_zero_in_a_fused_softmax():
    x = Tensor([[-math.inf, -math.inf, -math.inf], [1.0, 2.0, 3.0]])
    msg = _raised(lambda: x.softmax(-1).realize())
    assert "produced NaN at element (0, 0)" in msg and "softmax at test_nans.py" in msg
    assert "-inf" in msg

def test_float16_overflow():
    h = Tensor([60000.0, 1.0], dtype=dtypes.float16)
    msg = _raised(lambda: (h * 2 + 1).realize())
    assert "MUL produced Inf at element (0,)" in msg and "60000.0, 2.0" in msg and "float16" in msg

def test_nan_from_a_gradient():
    w = Tensor([0.0, 4.0], requires_grad=True)
    def step():
        (w.sqrt() * 0).sum().backward()
        w.grad.realize()
    msg = _raised(step)
    assert "at element (0,)" in msg and "backward at test_nans.py" in msg and "inputs 0.0" in msg

def test_finite_results_and_off_by_default():
    x = Tensor([1.0, -2.0])
    with Context(DEBUG_NANS=1): assert (x.abs().log()).numpy().tolist()[0] == 0.0
    assert math.isnan(x.log().numpy()[1])  # without the knob a NaN is a value like any other
