"""The random ops: RandomNormal, RandomUniform, their Like forms, Bernoulli and Multinomial.

Values come from fusegrad's generator, so they can't equal another runtime's: what is specified is the shape, the
dtype and the distribution. A `seed` attribute reseeds fusegrad's generator, so a seeded node gives the same values
on every run."""
from __future__ import annotations

from typing import Sequence

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import onnx_dtype
from fusegrad.onnx.ops import op


def _float_dtype(dtype: int | None, like: Tensor | None = None) -> DType:
    dt = onnx_dtype(dtype) if dtype is not None else (like.dtype if like is not None else dtypes.float32)
    if not dtypes.is_float(dt): raise Unsupported(f"random values of dtype {dt.name} (a float type is needed)")
    return dt


def _seed(seed: float | None) -> None:
    if seed is not None: Tensor.manual_seed(int(seed))


def _normal(shape: Sequence[int], dt: DType, mean: float, scale: float, seed: float | None) -> Tensor:
    _seed(seed)
    return (Tensor.randn(*shape, dtype=dtypes.float32) * scale + mean).cast(dt)


def _uniform(shape: Sequence[int], dt: DType, low: float, high: float, seed: float | None) -> Tensor:
    _seed(seed)
    return (Tensor.rand(*shape, dtype=dtypes.float32) * (high - low) + low).cast(dt)


@op("RandomNormal")
def random_normal(*, dtype: int = 1, mean: float = 0.0, scale: float = 1.0, seed: float | None = None,
                  shape: Sequence[int]) -> Tensor:
    return _normal(shape, _float_dtype(dtype), mean, scale, seed)


@op("RandomUniform")
def random_uniform(*, dtype: int = 1, high: float = 1.0, low: float = 0.0, seed: float | None = None,
                   shape: Sequence[int]) -> Tensor:
    return _uniform(shape, _float_dtype(dtype), low, high, seed)


@op("RandomNormalLike")
def random_normal_like(x: Tensor, *, dtype: int | None = None, mean: float = 0.0, scale: float = 1.0,
                       seed: float | None = None) -> Tensor:
    return _normal(x.shape, _float_dtype(dtype, x), mean, scale, seed)


@op("RandomUniformLike")
def random_uniform_like(x: Tensor, *, dtype: int | None = None, high: float = 1.0, low: float = 0.0,
                        seed: float | None = None) -> Tensor:
    return _uniform(x.shape, _float_dtype(dtype, x), low, high, seed)


@op("Bernoulli")
def bernoulli(p: Tensor, *, dtype: int | None = None, seed: float | None = None) -> Tensor:
    # each output is 1 with the probability given at its position
    _seed(seed)
    return (Tensor.rand(*p.shape, dtype=dtypes.float32) < p.cast(dtypes.float32)).cast(
        onnx_dtype(dtype) if dtype is not None else p.dtype)


@op("Multinomial")
def multinomial(logits: Tensor, *, dtype: int = 6, sample_size: int = 1, seed: float | None = None) -> Tensor:
    # the input holds unnormalized log-probabilities, one row per batch entry; draws are with replacement
    if logits.ndim != 2: raise ValueError(f"the input must be 2-D (batch, classes), got shape {tuple(logits.shape)}")
    dt = onnx_dtype(dtype)
    if dt not in (dtypes.int32, dtypes.int64): raise Unsupported(f"Multinomial dtype {dt.name} (int32 or int64)")
    _seed(seed)
    probs = logits.cast(dtypes.float32).softmax(-1)
    return probs.multinomial(sample_size, replacement=True).cast(dt)
