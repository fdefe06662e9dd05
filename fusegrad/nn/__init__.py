"""Neural-network layers with tinygrad's constructor parameters and PyTorch's initialisation and state-dict names.

A layer is a plain object: its parameters are Tensor attributes (`weight`, `bias`, ...), found by
`nn.state.get_parameters`/`get_state_dict`, and calling it applies the layer. Weights start with PyTorch's defaults
(U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear and convolutions), so a model built here and one built with torch.nn
are statistically alike and exchange state dicts key for key."""
from __future__ import annotations
import math
from typing import Sequence
from fusegrad.dtype import dtypes
from fusegrad.helpers import prod
from fusegrad.tensor import Tensor
from fusegrad.tensor.indexing import _check_index_values
from fusegrad.tensor.nn import linear_layer, templated

__all__ = ["Linear", "Conv1d", "Conv2d", "ConvTranspose1d", "ConvTranspose2d", "BatchNorm", "BatchNorm2d",
           "BatchNorm3d", "LayerNorm", "LayerNorm2d", "RMSNorm", "GroupNorm", "InstanceNorm", "Embedding", "LSTMCell"]

def _fan_in_bound(fan_in: int) -> float: return 1.0 / math.sqrt(max(fan_in, 1))

def _uniform(shape: tuple[int, ...], bound: float) -> Tensor: return Tensor.uniform(*shape, low=-bound, high=bound)

def _owned(t: Tensor, requires_grad: bool | None = None) -> Tensor:
    """`t` with a buffer of its own: constants are hash-consed, so two layers' `ones(4)` would otherwise be one node
    and one buffer, and updating one would update the other."""
    t._own_storage()
    t.requires_grad = requires_grad
    return t

def _positive(name: str, **vals: int) -> None:
    for k, v in vals.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}: {k} must be a positive int, got {v!r}")

class Linear:
    """y = x @ weight.T + bias, weight of shape (out_features, in_features) as in PyTorch."""
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        _positive("Linear", in_features=in_features, out_features=out_features)
        bound = _fan_in_bound(in_features)
        self.weight = _uniform((out_features, in_features), bound)
        self.bias = _uniform((out_features,), bound) if bias else None

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != self.weight.shape[1:]:
            raise ValueError(f"Linear expects inputs with last dim {self.weight.shape[1]}, got shape {x.shape}")
        return linear_layer(x, self.weight, self.bias)

def _ntuple(v: int | Sequence[int], n: int, what: str) -> tuple[int, ...]:
    t = (v,) * n if isinstance(v, int) else tuple(v)
    if len(t) != n: raise ValueError(f"{what} must be an int or a tuple of {n} ints, got {v!r}")
    return t

class Conv2d:
    """Convolution over N spatial dims (N from the kernel size: 2 for an int), weight (out, in/groups, *kernel)."""
    _dims = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...], stride=1,
                 padding: int | tuple[int, ...] | str = 0, dilation=1, groups=1, bias=True):
        _positive(type(self).__name__, in_channels=in_channels, out_channels=out_channels, groups=groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{type(self).__name__}: in_channels {in_channels} and out_channels {out_channels} must "
                             f"be divisible by groups {groups}")
        self.kernel_size = _ntuple(kernel_size, self._dims, "kernel_size") if isinstance(kernel_size, int) \
            else tuple(kernel_size)
        self.stride, self.dilation, self.groups = stride, dilation, groups
        n = len(self.kernel_size)
        if isinstance(padding, str):
            if padding == "valid": padding = 0
            elif padding == "same":
                if any(s != 1 for s in _ntuple(stride, n, "stride")):
                    raise ValueError("padding='same' needs stride 1")
                # torch pads the extra element of an odd total on the right
                pads = []
                for d, k in zip(reversed(_ntuple(dilation, n, "dilation")), reversed(self.kernel_size)):
                    total = d * (k - 1)
                    pads += [total // 2, total - total // 2]
                padding = tuple(pads)
            else: raise ValueError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
        self.padding = padding
        bound = _fan_in_bound(in_channels // groups * prod(self.kernel_size))
        self.weight = _uniform((out_channels, in_channels // groups) + self.kernel_size, bound)
        self.bias = _uniform((out_channels,), bound) if bias else None

    def __call__(self, x: Tensor) -> Tensor:
        return x.conv2d(self.weight, self.bias, groups=self.groups, stride=self.stride, dilation=self.dilation,
                        padding=self.padding)

class Conv1d(Conv2d):
    """Convolution over one spatial dim: input (N, C, L)."""
    _dims = 1

class ConvTranspose2d:
    """Transposed convolution, weight (in, out/groups, *kernel) as in PyTorch."""
    _dims = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, ...], stride=1, padding=0,
                 output_padding=0, dilation=1, groups=1, bias=True):
        _positive(type(self).__name__, in_channels=in_channels, out_channels=out_channels, groups=groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{type(self).__name__}: in_channels {in_channels} and out_channels {out_channels} must "
                             f"be divisible by groups {groups}")
        self.kernel_size = _ntuple(kernel_size, self._dims, "kernel_size") if isinstance(kernel_size, int) \
            else tuple(kernel_size)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.dilation, self.groups = dilation, groups
        # torch computes the fan-in of this weight from its dim 1 (out/groups) and the kernel
        bound = _fan_in_bound(out_channels // groups * prod(self.kernel_size))
        self.weight = _uniform((in_channels, out_channels // groups) + self.kernel_size, bound)
        self.bias = _uniform((out_channels,), bound) if bias else None

    def __call__(self, x: Tensor) -> Tensor:
        return x.conv_transpose2d(self.weight, self.bias, groups=self.groups, stride=self.stride,
                                  dilation=self.dilation, padding=self.padding, output_padding=self.output_padding)

class ConvTranspose1d(ConvTranspose2d):
    """Transposed convolution over one spatial dim."""
    _dims = 1

class BatchNorm:
    """Batch normalization over the channel dim 1 of (N, C, *) inputs.

    In training (`Tensor.training`) it normalizes with the batch's statistics and moves the running statistics
    toward them by `momentum` (the running variance takes the unbiased batch variance, as PyTorch does); in
    evaluation it uses the running statistics. With track_running_stats=False it always uses the batch's."""
    def __init__(self, sz: int, eps=1e-5, affine=True, track_running_stats=True, momentum=0.1):
        _positive("BatchNorm", sz=sz)
        self.eps, self.track_running_stats, self.momentum = eps, track_running_stats, momentum
        self.weight: Tensor | None = _owned(Tensor.ones(sz)) if affine else None
        self.bias: Tensor | None = _owned(Tensor.zeros(sz)) if affine else None
        if track_running_stats:
            self.running_mean = _owned(Tensor.zeros(sz), requires_grad=False)
            self.running_var = _owned(Tensor.ones(sz), requires_grad=False)
            self.num_batches_tracked = _owned(Tensor.zeros((), dtype=dtypes.long), requires_grad=False)

    def calc_stats(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The batch mean and biased variance per channel."""
        axes = (0,) + tuple(range(2, x.ndim))
        mean = x.mean(axis=axes)
        var = (x - mean.reshape((1, -1) + (1,) * (x.ndim - 2))).square().mean(axis=axes)
        return mean, var

    def __call__(self, x: Tensor) -> Tensor:
        sz = (self.weight if self.weight is not None else getattr(self, "running_mean", None))
        if x.ndim < 2 or (sz is not None and x.shape[1] != sz.shape[0]):
            raise ValueError(f"BatchNorm expects input (N, {sz.shape[0] if sz is not None else 'C'}, ...), got "
                             f"shape {x.shape}")
        if Tensor.training or not self.track_running_stats:
            mean, var = self.calc_stats(x)
            if Tensor.training and self.track_running_stats:
                n = x.numel() // x.shape[1]
                unbiased = var.detach() * (n / max(n - 1, 1))
                self.running_mean.assign((1 - self.momentum) * self.running_mean + self.momentum * mean.detach())
                self.running_var.assign((1 - self.momentum) * self.running_var + self.momentum * unbiased)
                self.num_batches_tracked.assign(self.num_batches_tracked + 1)
        else: mean, var = self.running_mean, self.running_var
        return x.batchnorm(self.weight, self.bias, mean, (var + self.eps).rsqrt())

BatchNorm2d = BatchNorm3d = BatchNorm

class LayerNorm:
    """Normalization over the last len(normalized_shape) dims, with an elementwise affine part."""
    def __init__(self, normalized_shape: int | tuple[int, ...], eps: float = 1e-5, elementwise_affine: bool = True):
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.axis, self.eps = tuple(-1 - i for i in range(len(self.normalized_shape))), eps
        self.weight = _owned(Tensor.ones(*self.normalized_shape)) if elementwise_affine else None
        self.bias = _owned(Tensor.zeros(*self.normalized_shape)) if elementwise_affine else None

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-len(self.normalized_shape):] != self.normalized_shape:
            raise ValueError(f"LayerNorm over {self.normalized_shape} got input of shape {x.shape}")
        if self.weight is None: return x.layernorm(eps=self.eps, axis=self.axis)
        return templated(_affine_layernorm, (x, self.weight, self.bias), (self.axis, self.eps))

def _affine_layernorm(x: Tensor, weight: Tensor, bias: Tensor, axis: tuple[int, ...], eps: float) -> Tensor:
    return x.layernorm(eps=eps, axis=axis) * weight + bias

class LayerNorm2d(LayerNorm):
    """LayerNorm over the channels of an (N, C, H, W) input."""
    def __call__(self, x: Tensor) -> Tensor: return super().__call__(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

class RMSNorm:
    """x / sqrt(mean(x^2) + eps) over the last dim, times a learned weight."""
    def __init__(self, dim: int, eps=1e-6, elementwise_affine=True):
        _positive("RMSNorm", dim=dim)
        self.eps, self.weight = eps, _owned(Tensor.ones(dim)) if elementwise_affine else None

    def _norm(self, x: Tensor) -> Tensor: return x * (x.square().mean(-1, keepdim=True) + self.eps).rsqrt()

    def __call__(self, x: Tensor) -> Tensor:
        x = self._norm(x.float()).cast(x.dtype)
        return x if self.weight is None else x * self.weight

class GroupNorm:
    """Normalization over groups of channels of (N, C, *) inputs, with a per-channel affine part."""
    def __init__(self, num_groups: int, num_channels: int, eps=1e-5, affine=True):
        _positive("GroupNorm", num_groups=num_groups, num_channels=num_channels)
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels {num_channels} must be divisible by num_groups {num_groups}")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = _owned(Tensor.ones(num_channels)) if affine else None
        self.bias = _owned(Tensor.zeros(num_channels)) if affine else None

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"GroupNorm expects input (N, {self.num_channels}, ...), got shape {x.shape}")
        y = x.reshape(x.shape[0], self.num_groups, -1).layernorm(eps=self.eps).reshape(x.shape)
        if self.weight is None: return y
        cshape = (1, -1) + (1,) * (x.ndim - 2)
        return y * self.weight.reshape(cshape) + self.bias.reshape(cshape)

class InstanceNorm(GroupNorm):
    """Normalization of each channel of each sample over its spatial dims (GroupNorm with one channel per group)."""
    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True):
        _positive("InstanceNorm", num_features=num_features)
        super().__init__(num_features, num_features, eps, affine)
        self.num_features = num_features

    def __call__(self, x: Tensor) -> Tensor:
        if x.ndim < 3: raise ValueError(f"InstanceNorm expects input (N, {self.num_features}, *spatial), got {x.shape}")
        return super().__call__(x)

class Embedding:
    """A lookup table: idx (any int dtype and shape) -> rows of weight (vocab_size, embed_size). An index outside
    [0, vocab_size) is an IndexError, as in PyTorch, where CHECK_OOB reads it (an index tensor in memory, by default;
    see fusegrad/tensor/indexing.py); a lazy one that isn't read counts negatives from the end and reads zeros past
    it."""
    def __init__(self, vocab_size: int, embed_size: int):
        _positive("Embedding", vocab_size=vocab_size, embed_size=embed_size)
        self.vocab_sz, self.embed_sz = vocab_size, embed_size
        self.weight = Tensor.glorot_uniform(vocab_size, embed_size)

    def __call__(self, idx: Tensor) -> Tensor:
        if not isinstance(idx, Tensor): idx = Tensor(idx)
        if not dtypes.is_int(idx.dtype): raise TypeError(f"Embedding indices must be integers, got {idx.dtype}")
        if idx.numel() == 0: return Tensor.zeros(*idx.shape, self.embed_sz, dtype=self.weight.dtype)
        _check_index_values(idx, self.vocab_sz, 0, False, "Embedding: index")
        return self.weight._getitem([("adv", idx), slice(None)])  # (self.weight[idx] without a second check)

class LSTMCell:
    """One LSTM step: (x, (h, c)) -> (h', c'), gates ordered input, forget, cell, output as in PyTorch."""
    def __init__(self, input_size: int, hidden_size: int, bias: bool = True):
        _positive("LSTMCell", input_size=input_size, hidden_size=hidden_size)
        bound = _fan_in_bound(hidden_size)
        self.weight_ih = _uniform((hidden_size * 4, input_size), bound)
        self.weight_hh = _uniform((hidden_size * 4, hidden_size), bound)
        self.bias_ih = _uniform((hidden_size * 4,), bound) if bias else None
        self.bias_hh = _uniform((hidden_size * 4,), bound) if bias else None

    def __call__(self, x: Tensor, hc: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if hc is None: hc = (Tensor.zeros(*x.shape[:-1], self.weight_hh.shape[1], dtype=x.dtype),) * 2
        gates = x.linear(self.weight_ih.T, self.bias_ih) + hc[0].linear(self.weight_hh.T, self.bias_hh)
        i, f, g, o = gates.chunk(4, dim=-1)
        c = f.sigmoid() * hc[1] + i.sigmoid() * g.tanh()
        return o.sigmoid() * c.tanh(), c

# the submodules are imported last so `from fusegrad import nn; nn.optim.SGD` works
from fusegrad.nn import optim, state, datasets  # noqa: E402,F401
