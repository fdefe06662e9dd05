"""A value that gets a buffer only to be read through a widening cast (bfloat16 or half read as float32) is stored
narrow, and its readers cast it as they load: half the memory, and a bfloat16 matmul in a backward pass keeps
bfloat16 operands."""
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.engine.realize import run_schedule
from fusegrad.schedule.kernelize import widens_exactly

FLOATS = {dtypes.float16: torch.float16, dtypes.bfloat16: torch.bfloat16, dtypes.float32: torch.float32,
          dtypes.float64: torch.float64}
INTS = {dtypes.int8: np.int8, dtypes.uint8: np.uint8, dtypes.int16: np.int16, dtypes.uint16: np.uint16,
        dtypes.int32: np.int32, dtypes.uint32: np.uint32, dtypes.int64: np.int64, dtypes.uint64: np.uint64}

def _float_samples(dt) -> torch.Tensor:
    """Every value of a 16-bit float (its 65536 bit patterns), else a million random bit patterns; finite ones."""
    if dt.itemsize == 2: bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    else:
        g = torch.Generator().manual_seed(0)
        bits = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
        if dt.itemsize == 8:
            bits = bits.to(torch.int64) * (2 ** 32) + torch.randint(0, 2 ** 32, bits.shape, generator=g)
    vals = bits.view(FLOATS[dt])
    return vals[torch.isfinite(vals)]

@pytest.mark.parametrize("src", list(FLOATS), ids=str)
@pytest.mark.parametrize("dst", list(FLOATS), ids=str)
def test_widening_float_casts_are_the_exact_ones(src, dst):
    vals = _float_samples(src)
    back = vals.to(FLOATS[dst]).to(FLOATS[src])
    exact = bool(torch.equal(back, vals)) and dst.itemsize > src.itemsize
    assert widens_exactly(src, dst) == exact
    # (a claimed exact widening keeps every value; a narrowing one never counts)
    if widens_exactly(src, dst): assert torch.equal(vals.to(FLOATS[dst]).to(torch.float64), vals.to(torch.float64))

@pytest.mark.parametrize("src", list(INTS), ids=str)
@pytest.mark.parametrize("dst", list(INTS), ids=str)
def test_widening_int_casts_are_the_exact_ones(src, dst):
    s, d = np.iinfo(INTS[src]), np.iinfo(INTS[dst])
    holds = d.min <= s.min and s.max <= d.max and dst.itemsize > src.itemsize
    assert widens_exactly(src, dst) == holds
    assert not widens_exactly(src, dtypes.float32) and not widens_exactly(dtypes.float32, src)

def _buffers(*ts: Tensor) -> list[list[tuple]]:
    """The (dtype, size) of each buffer of each kernel that computes `ts` (then run: a scheduled node's buffer may be
    shared with another tensor's graph)."""
    sched = Tensor.schedule(*ts)
    out = [[(b.dtype, b.size) for b in ei.bufs] for ei in sched]
    run_schedule(sched)
    return out

@pytest.mark.parametrize("narrow", [dtypes.bfloat16, dtypes.float16], ids=str)
def test_a_broadcast_narrow_value_gets_a_narrow_buffer(narrow):
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)
    def make():
        a, b = Tensor(a_np), Tensor(b_np)
        v = (a * 1.5).exp().cast(narrow)
        # the float32 value of v, broadcast along a new axis: computed once into a buffer, which holds v itself
        return (v.float().reshape(64, 1, 64).expand(64, 64, 64) * b.reshape(1, 64, 64)).sum(2)
    bufs = _buffers(make())
    assert len(bufs) == 2 and bufs[0][0] == (narrow, 4096) and bufs[1][0] == (dtypes.float32, 4096)
    tv = (torch.tensor(a_np) * 1.5).exp().to(FLOATS[narrow]).float()
    want = (tv.reshape(64, 1, 64) * torch.tensor(b_np).reshape(1, 64, 64)).sum(2)
    np.testing.assert_allclose(make().numpy(), want.numpy(), rtol=1e-5, atol=1e-4)

def test_an_output_cast_keeps_its_own_dtype():
    # a widening cast asked for by the user is the buffer they get
    def make(): return (Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)) * 2).cast(dtypes.bfloat16).float()
    assert _buffers(make())[-1][0] == (dtypes.float32, 12)
    np.testing.assert_array_equal(make().numpy(), np.arange(12, dtype=np.float32).reshape(3, 4) * 2)

def test_a_copy_source_keeps_its_dtype():
    # a copy to another device reads its source's buffer as it is: the widened value is the one copied
    a = Tensor(np.arange(8, dtype=np.float32), device="CPU")
    out = (a * 3).cast(dtypes.float16).float().to("PYTHON")
    assert out.dtype == dtypes.float32
    np.testing.assert_array_equal(out.numpy(), np.arange(8, dtype=np.float32) * 3)

def test_a_bfloat16_layers_gradients_read_bfloat16():
    # h = relu(x @ w.T) in bfloat16 and a float32 loss: the gradient that reaches the two matmuls of the backward
    # pass arrives through a cast to float32 of a bfloat16 value, stored as bfloat16
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((64, 96)).astype(np.float32)
    w_np = (rng.standard_normal((128, 96)) * 0.1).astype(np.float32)
    def grads():
        x = Tensor(x_np).cast(dtypes.bfloat16).realize().requires_grad_()
        w = Tensor(w_np).cast(dtypes.bfloat16).realize().requires_grad_()
        (x.linear(w.T).relu().float() ** 2).mean().backward()
        return x.grad, w.grad
    # no float32 buffer the size of the gradient of h (64 x 128)
    assert (dtypes.float32, 64 * 128) not in [b for bufs in _buffers(*grads()) for b in bufs]
    tx = torch.tensor(x_np).to(torch.bfloat16).requires_grad_()
    tw = torch.tensor(w_np).to(torch.bfloat16).requires_grad_()
    (torch.relu(tx @ tw.T).float() ** 2).mean().backward()
    for got, want in zip(grads(), (tx.grad, tw.grad)):
        assert got.dtype == dtypes.bfloat16
        np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), rtol=2e-2, atol=2e-4)

def test_a_chain_of_widening_casts_stores_the_narrowest():
    # half -> float32 -> float64 and half -> float32, each broadcast: one half buffer holds the value for both,
    # whichever cast the rules meet first
    rng = np.random.default_rng(4)
    a_np = rng.standard_normal((24, 41)).astype(np.float32)   # (read through a shrink: its own size isn't v's)
    b64, b32 = rng.standard_normal((16, 40)), rng.standard_normal((16, 40)).astype(np.float32)
    def make():
        v = (Tensor(a_np)[:, :40] * 3).half()
        r64 = (v.float().double().reshape(24, 1, 40).expand(24, 16, 40) * Tensor(b64).reshape(1, 16, 40)).sum(2)
        r32 = (v.float().reshape(24, 1, 40).expand(24, 16, 40) * Tensor(b32).reshape(1, 16, 40)).sum(2)
        return r64, r32
    held = [b for k in _buffers(*make()) for b in k if b[1] == 24 * 40]
    assert held and all(dt == dtypes.float16 for dt, _ in held), held
    v = (torch.tensor(a_np)[:, :40] * 3).half()
    r64, r32 = make()
    np.testing.assert_allclose(r64.numpy(), (v.double()[:, None] * torch.tensor(b64)[None]).sum(2).numpy(), rtol=1e-9)
    np.testing.assert_allclose(r32.numpy(), (v.float()[:, None] * torch.tensor(b32)[None]).sum(2).numpy(), rtol=1e-5,
                               atol=1e-5)
