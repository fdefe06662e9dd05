"""TinyJit.replay_kept: a replay into output memory the JIT keeps, for callers that copy the results out. Its
results equal NumPy's on changing data, it reuses its Buffers call after call, never touches tensors handed out by
ordinary calls, and hands back None (running nothing) wherever an ordinary call is needed."""
from __future__ import annotations
import numpy as np
from fusegrad import Context, Tensor, TinyJit
from fusegrad.device import Buffer
from fusegrad.uop.ops import device_buffer

rng = np.random.default_rng(3)

def _arr(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)

def _fill(t: Tensor, a: np.ndarray) -> None:
    device_buffer(t.uop).copyin(memoryview(np.ascontiguousarray(a)).cast("B"))

def _read(b: Buffer, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, np.float32)
    b.copyout(memoryview(out).cast("B"))
    return out

def _step(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return (x @ w).relu(), (x * 2 + 1).sum(1).reshape(2, 2)

def _warm(jit: TinyJit, x: Tensor, w: Tensor) -> None:
    for _ in range(3): jit(x, w)   # (plain call, capture, then a checked replay the kept one starts from)

def test_kept_replay_matches_numpy_and_reuses_its_buffers():
    jit = TinyJit(_step)
    x, w = Tensor(_arr(4, 3)).realize(), Tensor(_arr(3, 5)).realize()
    assert jit.replay_kept(x, w) is None   # (nothing captured yet)
    _warm(jit, x, w)
    first = None
    for _ in range(4):
        a, b = _arr(4, 3), _arr(3, 5)
        _fill(x, a)
        _fill(w, b)
        got = jit.replay_kept(x, w)
        assert got is not None and len(got) == 2
        np.testing.assert_allclose(_read(got[0], (4, 5)), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_read(got[1], (2, 2)), (a * 2 + 1).sum(1).reshape(2, 2), rtol=1e-5, atol=1e-5)
        if first is None: first = got
        assert all(g is f for g, f in zip(got, first))

def test_kept_replay_leaves_returned_tensors_alone():
    jit = TinyJit(_step)
    x, w = Tensor(_arr(4, 3)).realize(), Tensor(_arr(3, 5)).realize()
    _warm(jit, x, w)
    a, b = _arr(4, 3), _arr(3, 5)
    _fill(x, a)
    _fill(w, b)
    out, _ = jit(x, w)   # (an ordinary replay: a tensor of fresh memory)
    _fill(x, _arr(4, 3))
    assert jit.replay_kept(x, w) is not None
    np.testing.assert_allclose(out.numpy(), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-5)

def test_kept_replay_declines_what_needs_a_call():
    jit = TinyJit(_step)
    x, w = Tensor(_arr(4, 3)).realize(), Tensor(_arr(3, 5)).realize()
    _warm(jit, x, w)
    other = Tensor(_arr(4, 3)).realize()
    assert jit.replay_kept(other, w) is None     # (another tensor: its inputs weren't checked)
    assert jit.replay_kept(x) is None            # (another number of arguments)
    assert jit.replay_kept(x, w) is not None
    with Context(DEBUG=2): assert jit.replay_kept(x, w) is None
    with Context(JIT=0): assert jit.replay_kept(x, w) is None

    with_number = TinyJit(lambda x, w: ((x @ w).relu(), 3))
    _warm(with_number, x, w)
    assert with_number.replay_kept(x, w) is None   # (a result that is no tensor has no buffer)

def test_kept_replay_leaves_verified_replays_to_calls():
    jit = TinyJit(_step, verify=2)
    x, w = Tensor(_arr(4, 3)).realize(), Tensor(_arr(3, 5)).realize()
    for _ in range(2): jit(x, w)
    jit(x, w)   # (replay 1, verified)
    # replay 2 is due to be verified: replay_kept declines it and the call verifies; replay 3 is kept
    assert jit.replay_kept(x, w) is None
    jit(x, w)
    assert jit.replay_kept(x, w) is not None
    assert jit._replays == 3

def test_kept_replay_follows_a_launch_knob_change():
    jit = TinyJit(_step)
    x, w = Tensor(_arr(4, 3)).realize(), Tensor(_arr(3, 5)).realize()
    _warm(jit, x, w)
    assert jit.replay_kept(x, w) is not None
    for threads in (1, 2, 1):
        a, b = _arr(4, 3), _arr(3, 5)
        _fill(x, a)
        _fill(w, b)
        with Context(CPU_THREADS=threads): got = jit.replay_kept(x, w)
        assert got is not None
        np.testing.assert_allclose(_read(got[0], (4, 5)), np.maximum(a @ b, 0), rtol=1e-5, atol=1e-5)
