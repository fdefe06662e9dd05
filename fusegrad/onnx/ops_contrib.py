"""The com.microsoft ops that exporters and onnxruntime's transformer optimizer emit: fused activations (Gelu,
FastGelu, BiasGelu), FusedMatMul, the fused layer norms (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization) and Attention. Each is the composition of Tensor ops that onnxruntime's kernel fuses;
fusegrad's scheduler does the fusing."""
from __future__ import annotations

import math
from typing import Sequence

from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import Context, axis_of, op
from fusegrad.onnx.ops_attention import attend  # noqa: F401 - it also registers the default domain's Attention

MS = "com.microsoft"


@op("Gelu", domain=MS)
def gelu(x: Tensor) -> Tensor: return x.gelu("none").cast(x.dtype)


@op("FastGelu", domain=MS)
def fast_gelu(x: Tensor, bias: Tensor | None = None) -> Tensor:
    v = x if bias is None else x + bias
    return v.gelu("tanh").cast(x.dtype)


@op("BiasGelu", domain=MS)
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor: return (x + bias).gelu("none").cast(x.dtype)


@op("FusedMatMul", domain=MS)
def fused_matmul(a: Tensor, b: Tensor, *, alpha: float = 1.0, transA: int = 0, transB: int = 0,
                 transBatchA: int = 0, transBatchB: int = 0) -> Tensor:
    if transBatchA or transBatchB: raise Unsupported("FusedMatMul transBatchA or transBatchB")
    if transA: a = a.transpose(-1, -2) if a.ndim > 1 else a
    if transB: b = b.transpose(-1, -2) if b.ndim > 1 else b
    out = a @ b
    return out * alpha if alpha != 1.0 else out


def _norm(x: Tensor, gamma: Tensor, beta: Tensor | None, eps: float, axes: tuple[int, ...], rms: bool,
          ) -> tuple[Tensor, Tensor, Tensor]:
    xf = x.cast(dtypes.float32) if x.dtype != dtypes.float64 else x
    mean = xf.mean(axes, keepdim=True) if not rms else xf.sum(axes, keepdim=True) * 0
    centered = xf - mean if not rms else xf
    inv = (centered * centered).mean(axes, keepdim=True).add(eps).rsqrt()
    y = (centered * inv).cast(x.dtype) * gamma
    if beta is not None: y = y + beta
    return y, mean, inv


@op("SkipLayerNormalization", domain=MS)
def skip_layer_norm(x: Tensor, skip: Tensor, gamma: Tensor, beta: Tensor | None = None, bias: Tensor | None = None, *,
                    epsilon: float = 1e-12) -> tuple[Tensor, ...]:
    # outputs: the normalized sum, its mean and inverse standard deviation, and the sum itself
    s = x + skip
    if bias is not None: s = s + bias
    y, mean, inv = _norm(s, gamma, beta, epsilon, (-1,), rms=False)
    return y, mean, inv, s


@op("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(x: Tensor, skip: Tensor, gamma: Tensor, bias: Tensor | None = None, *,
                               epsilon: float = 1e-12) -> tuple[Tensor, ...]:
    s = x + skip
    if bias is not None: s = s + bias
    y, mean, inv = _norm(s, gamma, None, epsilon, (-1,), rms=True)
    return y, mean, inv, s


@op("SimplifiedLayerNormalization")
def simplified_layer_norm(x: Tensor, gamma: Tensor, *, axis: int = -1, epsilon: float = 1e-5,
                          stash_type: int = 1) -> tuple[Tensor, Tensor]:
    # onnxruntime's RMS norm, which its optimizer writes in the default domain (no mean is subtracted)
    axes = tuple(range(axis_of(axis, x.ndim), x.ndim))
    y, _, inv = _norm(x, gamma, None, epsilon, axes, rms=True)
    return y, inv


@op("Attention", domain=MS)
def attention(x: Tensor, weights: Tensor, bias: Tensor | None = None, mask_index: Tensor | None = None,
              past: Tensor | None = None, attention_bias: Tensor | None = None,
              past_sequence_length: Tensor | None = None, *, num_heads: int, unidirectional: int = 0,
              scale: float | None = None, mask_filter_value: float = -10000.0,
              qkv_hidden_sizes: Sequence[int] | None = None, do_rotary: int = 0,
              past_present_share_buffer: int = 0, rotary_embedding_dim: int = 0, ctx: Context) -> Tensor:
    """Multi-head self-attention of x (batch, seq, hidden) with the packed q, k, v projection `weights`."""
    if past is not None or past_sequence_length is not None or past_present_share_buffer:
        raise Unsupported("Attention with a past state (past, past_sequence_length)")
    if do_rotary or rotary_embedding_dim: raise Unsupported("Attention with rotary embeddings")
    if ctx.n_outputs > 1: raise Unsupported("Attention's present output")
    b, s, _ = x.shape
    qkv = x @ weights
    if bias is not None: qkv = qkv + bias
    sizes = list(qkv_hidden_sizes) if qkv_hidden_sizes else [qkv.shape[-1] // 3] * 3
    if sum(sizes) != qkv.shape[-1]: raise ValueError(f"qkv_hidden_sizes {sizes} don't add up to {qkv.shape[-1]}")
    q, k, v = qkv.split(sizes, -1)
    if any(n % num_heads for n in sizes):
        raise ValueError(f"hidden sizes {sizes} aren't divisible by {num_heads} heads")
    heads = [t.reshape(b, s, num_heads, n // num_heads).permute(0, 2, 1, 3) for t, n in zip((q, k, v), sizes)]
    q, k, v = heads
    sc = scale if scale else 1.0 / math.sqrt(sizes[0] // num_heads)
    scores = (q @ k.transpose(-1, -2)) * sc  # (b, heads, s, s)
    if mask_index is not None:
        if mask_index.ndim == 2 and tuple(mask_index.shape) == (b, s):
            # 1 keeps a key position, 0 masks it
            keep = mask_index.reshape(b, 1, 1, s) != 0
        elif mask_index.ndim == 3 and tuple(mask_index.shape) == (b, s, s):
            keep = mask_index.reshape(b, 1, s, s) != 0
        else: raise Unsupported(f"Attention mask_index of shape {tuple(mask_index.shape)} (supported: (batch, seq), "
                                f"(batch, seq, seq))")
        scores = keep.where(scores, scores + mask_filter_value)
    if attention_bias is not None: scores = scores + attention_bias
    if unidirectional:
        causal = Tensor.ones(s, s, dtype=dtypes.bool).tril()
        scores = causal.where(scores, scores + mask_filter_value)
    probs = scores.softmax(-1)
    out = probs @ v  # (b, heads, s, head_v)
    return out.permute(0, 2, 1, 3).reshape(b, s, sizes[2]).cast(x.dtype)
