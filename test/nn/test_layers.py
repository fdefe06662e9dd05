"""Every nn layer against its torch.nn equivalent holding the same weights: forward output, the gradient of the input
and of every parameter, in training and evaluation mode where they differ, and the running statistics of BatchNorm."""
from __future__ import annotations
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes, nn

torch.set_num_threads(1)

def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(-2, 2, size=shape).astype(np.float32)

def _params(layer) -> dict[str, Tensor]:
    return {k: v for k, v in vars(layer).items() if isinstance(v, Tensor)}

def _sync(layer, module: torch.nn.Module) -> None:
    """Copy the fusegrad layer's tensors into the torch module (every torch state entry must exist here)."""
    ours = _params(layer)
    with torch.no_grad():
        for name, ref in module.state_dict().items():
            assert name in ours, f"state-dict key {name} missing from {type(layer).__name__}"
            assert ours[name].shape == tuple(ref.shape), f"{name}: {ours[name].shape} vs {tuple(ref.shape)}"
            ref.copy_(torch.from_numpy(ours[name].numpy()))

def _compare(layer, module, x: np.ndarray, train: bool, atol=1e-4, rtol=1e-4, int_input=False) -> None:
    _sync(layer, module)
    module.train(train)
    xt = torch.tensor(x)
    if not int_input: xt.requires_grad_(True)
    ref = module(xt)
    g = _rand(*ref.shape, seed=7)
    (ref * torch.tensor(g)).sum().backward()
    xf = Tensor(x)
    trainable = {k: v for k, v in _params(layer).items() if dtypes.is_float(v.dtype) and
                 k not in ("running_mean", "running_var")}
    for v in trainable.values(): v.requires_grad_(True)
    if not int_input: xf.requires_grad_(True)
    with Tensor.train(train):
        out = layer(xf)
        (out * Tensor(g)).sum().backward()
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol)
    if not int_input: np.testing.assert_allclose(xf.grad.numpy(), xt.grad.numpy(), atol=atol, rtol=rtol)
    tparams = dict(module.named_parameters())
    for k, v in trainable.items():
        np.testing.assert_allclose(v.grad.numpy(), tparams[k].grad.numpy(), atol=atol, rtol=rtol, err_msg=k)
    for k, ref_buf in module.named_buffers():
        np.testing.assert_allclose(getattr(layer, k).numpy(), ref_buf.numpy(), atol=atol, rtol=rtol, err_msg=k)

@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias):
    _compare(nn.Linear(5, 3, bias=bias), torch.nn.Linear(5, 3, bias=bias), _rand(2, 4, 5), train=True)

@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1), dict(padding="same", dilation=2),
                                dict(groups=2, padding=(1, 0), bias=False)], ids=str)
def test_conv2d(kw):
    _compare(nn.Conv2d(4, 6, 3, **kw), torch.nn.Conv2d(4, 6, 3, **kw), _rand(2, 4, 7, 6), train=True)

def test_conv1d():
    _compare(nn.Conv1d(3, 4, 3, stride=2, padding=1), torch.nn.Conv1d(3, 4, 3, stride=2, padding=1), _rand(2, 3, 9),
             train=True)

@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1, output_padding=1), dict(groups=2, bias=False)],
                         ids=str)
def test_conv_transpose2d(kw):
    _compare(nn.ConvTranspose2d(4, 6, 3, **kw), torch.nn.ConvTranspose2d(4, 6, 3, **kw), _rand(2, 4, 5, 4),
             train=True)

def test_conv_transpose1d():
    _compare(nn.ConvTranspose1d(3, 2, 4, stride=2), torch.nn.ConvTranspose1d(3, 2, 4, stride=2), _rand(2, 3, 6),
             train=True)

def test_batchnorm_training_then_eval():
    ours, ref = nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
    for step in range(3):  # running statistics follow torch's over several training steps
        _compare(ours, ref, _rand(4, 3, 5, 5, seed=step), train=True)
        for v in _params(ours).values(): v.grad = None
        ref.zero_grad()
    assert int(ours.num_batches_tracked.item()) == 3
    _compare(ours, ref, _rand(2, 3, 5, 5, seed=9), train=False)

@pytest.mark.parametrize("cls,shape", [(nn.BatchNorm, (6, 4)), (nn.BatchNorm3d, (2, 4, 3, 2, 2))])
def test_batchnorm_other_ranks(cls, shape):
    tcls = torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm3d
    _compare(cls(4), tcls(4), _rand(*shape), train=True)

def test_batchnorm_no_affine_no_running_stats():
    _compare(nn.BatchNorm2d(3, affine=False, track_running_stats=False),
             torch.nn.BatchNorm2d(3, affine=False, track_running_stats=False), _rand(2, 3, 4, 4), train=False)

@pytest.mark.parametrize("affine", [True, False])
def test_layernorm(affine):
    _compare(nn.LayerNorm((4, 5), elementwise_affine=affine), torch.nn.LayerNorm((4, 5), elementwise_affine=affine),
             _rand(3, 4, 5), train=True)

def test_layernorm2d():
    ours = nn.LayerNorm2d(3)
    x = _rand(2, 3, 4, 4)
    ref = torch.nn.functional.layer_norm(torch.tensor(x).permute(0, 2, 3, 1), (3,)).permute(0, 3, 1, 2)
    np.testing.assert_allclose(ours(Tensor(x)).numpy(), ref.numpy(), atol=1e-5)

def test_rmsnorm():
    _compare(nn.RMSNorm(6, eps=1e-6), torch.nn.RMSNorm(6, eps=1e-6), _rand(3, 6), train=True)

@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm(affine):
    _compare(nn.GroupNorm(2, 4, affine=affine), torch.nn.GroupNorm(2, 4, affine=affine), _rand(3, 4, 3, 3),
             train=True)

def test_instancenorm():
    _compare(nn.InstanceNorm(3), torch.nn.InstanceNorm2d(3, affine=True), _rand(2, 3, 4, 5), train=False)

@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_embedding(dtype):
    ours, ref = nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
    idx = np.array([[1, 9, 0], [3, 3, 7]], dtype=dtype)
    _sync(ours, ref)
    ours.weight.requires_grad_(True)
    out = ours(Tensor(idx))
    g = _rand(2, 3, 4)
    (out * Tensor(g)).sum().backward()
    r = ref(torch.tensor(idx))
    (r * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(out.numpy(), r.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(ours.weight.grad.numpy(), ref.weight.grad.numpy(), atol=1e-5)

def test_lstmcell():
    ours, ref = nn.LSTMCell(3, 5), torch.nn.LSTMCell(3, 5)
    _sync(ours, ref)
    x, h, c = _rand(2, 3), _rand(2, 5, seed=1), _rand(2, 5, seed=2)
    h1, c1 = ours(Tensor(x), (Tensor(h), Tensor(c)))
    rh, rc = ref(torch.tensor(x), (torch.tensor(h), torch.tensor(c)))
    np.testing.assert_allclose(h1.numpy(), rh.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(c1.numpy(), rc.detach().numpy(), atol=1e-5)
    h0, c0 = ours(Tensor(x))
    rh0, rc0 = ref(torch.tensor(x))
    np.testing.assert_allclose(h0.numpy(), rh0.detach().numpy(), atol=1e-5)
    # backward through the cell into its weights
    ours.weight_ih.requires_grad_(True)
    (h1.sum() + c1.sum()).backward()
    (rh.sum() + rc.sum()).backward()
    np.testing.assert_allclose(ours.weight_ih.grad.numpy(), ref.weight_ih.grad.numpy(), atol=1e-4)

def test_init_statistics():
    """PyTorch's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear and Conv weights."""
    w = nn.Linear(400, 300).weight.numpy()
    bound = 1 / np.sqrt(400)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert abs(w.std() - bound / np.sqrt(3)) < 0.02 * bound
    c = nn.Conv2d(8, 16, 3).weight.numpy()
    assert np.abs(c).max() <= 1 / np.sqrt(72)

def test_layers_get_their_own_buffers():
    a, b = nn.LayerNorm(4), nn.LayerNorm(4)
    a.weight.assign(Tensor.full((4,), 3.0)).realize()
    assert b.weight.tolist() == [1.0] * 4

def test_errors():
    with pytest.raises(ValueError, match="last dim 5"): nn.Linear(5, 3)(Tensor.zeros(2, 4))
    with pytest.raises(ValueError, match="divisible by groups"): nn.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="positive"): nn.Linear(0, 3)
    with pytest.raises(ValueError, match="num_groups"): nn.GroupNorm(3, 4)
    with pytest.raises(ValueError, match=r"\(N, 3"): nn.BatchNorm2d(3)(Tensor.zeros(2, 4, 2, 2))
    with pytest.raises(TypeError, match="integers"): nn.Embedding(4, 2)(Tensor([1.0]))
    with pytest.raises(ValueError, match="padding"): nn.Conv2d(3, 4, 3, padding="full")
