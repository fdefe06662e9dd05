"""The default domain's Attention (opset 23 on): scaled dot-product attention of Q, K and V given as (batch, heads,
seq, head_size) or as (batch, seq, hidden) with the head counts as attributes, with a key/value cache (past and
present), grouped-query heads, a boolean or additive mask, causal and sliding-window masks, softcap and the
optional output of the scores; and RotaryEmbedding. The com.microsoft attention ops (ops_contrib.py) share `attend` and
`rotary`."""
from __future__ import annotations

import math

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import onnx_dtype
from fusegrad.onnx.ops import Context, gather, op

NEG_INF = -math.inf


def to_heads(x: Tensor, heads: int, what: str) -> Tensor:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    b, s, hidden = x.shape
    if hidden % heads: raise ValueError(f"{what}'s hidden size {hidden} isn't divisible by {heads} heads")
    return x.reshape(b, s, heads, hidden // heads).permute(0, 2, 1, 3)


def from_heads(x: Tensor) -> Tensor:
    """(batch, heads, seq, size) -> (batch, seq, heads * size)."""
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, s, h * d)


def repeat_kv(k: Tensor, q_heads: int) -> Tensor:
    """Grouped-query attention: each key/value head serves q_heads / kv_heads consecutive query heads."""
    kv_heads = k.shape[1]
    if kv_heads == q_heads: return k
    if q_heads % kv_heads: raise ValueError(f"{q_heads} query heads aren't a multiple of {kv_heads} key/value heads")
    return k.repeat_interleave(q_heads // kv_heads, 1)


def allowed_to_bias(allowed: Tensor, dt: DType) -> Tensor:
    """A boolean mask (True: attend) as an additive bias of 0 and -inf."""
    return allowed.where(Tensor(0.0, dtype=dt), Tensor(NEG_INF, dtype=dt))


def causal_allowed(q_len: int, kv_len: int, offset: int | Tensor) -> Tensor:
    """Query i (of a block that follows `offset` keys) may attend key j iff j <= i + offset; an offset per batch (a
    (batch,) tensor) gives a (batch, 1, q, kv) mask."""
    i = Tensor.arange(q_len, dtype=dtypes.int32).reshape(q_len, 1)
    j = Tensor.arange(kv_len, dtype=dtypes.int32).reshape(1, kv_len)
    if isinstance(offset, Tensor): return (j <= i + offset.cast(dtypes.int32).reshape(-1, 1, 1, 1))
    return j <= i + offset


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, scale: float | None, softcap: float = 0.0,
           softmax_dtype: DType | None = None, split_scale: bool = True,
           sink: Tensor | None = None) -> tuple[Tensor, ...]:
    """softmax(q k^T * scale + bias) v for (batch, heads, seq, size) inputs (key/value heads repeated to the query's).
    A row whose bias is -inf everywhere attends nothing (its output is 0). `sink` (heads,) is one more logit per head
    that takes part in the softmax but attends no value. Returns the output, the scores before the bias, the scores
    with it and the probabilities."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if split_scale:
        # ONNX's definition scales q and k each by the square root (as its function body does, in q's dtype)
        r = Tensor(math.sqrt(sc), dtype=q.dtype)
        scores = (q * r) @ (k * r).transpose(-1, -2)
    else: scores = (q @ k.transpose(-1, -2)) * sc
    if softcap > 0: scores = (scores / softcap).tanh() * softcap
    biased = scores + bias if bias is not None else scores
    sm = biased.cast(softmax_dtype) if softmax_dtype is not None else biased
    if sink is None: probs = sm.softmax(-1)
    else:
        col = sink.cast(sm.dtype).reshape(1, -1, 1, 1).expand(*sm.shape[:-1], 1)
        probs = sm.cat(col, dim=-1).softmax(-1)[..., :-1]
    if bias is not None:
        masked_row = bias.max(-1, keepdim=True) == NEG_INF
        probs = masked_row.where(0.0, probs)
    probs = probs.cast(q.dtype)
    return probs @ v, scores, biased, probs


@op("Attention")
def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, past_key: Tensor | None = None,
              past_value: Tensor | None = None, nonpad_kv_seqlen: Tensor | None = None, *, is_causal: int = 0,
              kv_num_heads: int | None = None, q_num_heads: int | None = None, qk_matmul_output_mode: int = 0,
              scale: float | None = None, softcap: float = 0.0, softmax_precision: int | None = None,
              left_window_size: int = -1, right_window_size: int = -1, ctx: Context) -> tuple[Tensor, ...]:
    if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
        raise ValueError(f"Q, K and V must all be 3-D or all 4-D, got ranks {q.ndim}, {k.ndim}, {v.ndim}")
    if (past_key is None) != (past_value is None): raise ValueError("past_key and past_value go together")
    if nonpad_kv_seqlen is not None and past_key is not None:
        raise ValueError("nonpad_kv_seqlen can't be combined with past_key and past_value")
    if qk_matmul_output_mode not in (0, 1, 2, 3):
        raise Unsupported(f"qk_matmul_output_mode={qk_matmul_output_mode} (supported: 0, 1, 2, 3)")
    rank3 = q.ndim == 3
    if rank3:
        if q_num_heads is None or kv_num_heads is None:
            raise ValueError("3-D Q, K and V need the attributes q_num_heads and kv_num_heads")
        q, k, v = to_heads(q, q_num_heads, "Q"), to_heads(k, kv_num_heads, "K"), to_heads(v, kv_num_heads, "V")
    present_k = past_key.cat(k, dim=2) if past_key is not None else k
    present_v = past_value.cat(v, dim=2) if past_value is not None else v
    q_len, total = q.shape[2], present_k.shape[2]
    dt = q.dtype
    bias: Tensor | None = None
    if attn_mask is not None:
        pad = total - attn_mask.shape[-1]
        if pad < 0: raise ValueError(f"attn_mask's last dim {attn_mask.shape[-1]} is longer than the {total} keys")
        if attn_mask.dtype == dtypes.bool:
            bias = allowed_to_bias(attn_mask.pad(((0, 0),) * (attn_mask.ndim - 1) + ((0, pad),), value=False), dt)
        else: bias = attn_mask.cast(dt).pad(((0, 0),) * (attn_mask.ndim - 1) + ((0, pad),), value=NEG_INF)
    # where the query block starts among the keys: after the cache, or (an external cache) before its valid length end
    offset: int | Tensor = past_key.shape[2] if past_key is not None else 0
    if past_key is None and nonpad_kv_seqlen is not None: offset = nonpad_kv_seqlen - q_len
    extra: list[Tensor] = []
    if is_causal: extra.append(causal_allowed(q_len, total, offset))
    if left_window_size >= 0 or right_window_size >= 0:
        i = Tensor.arange(q_len, dtype=dtypes.int32).reshape(q_len, 1)
        j = Tensor.arange(total, dtype=dtypes.int32).reshape(1, total)
        pos = i + offset.cast(dtypes.int32).reshape(-1, 1, 1, 1) if isinstance(offset, Tensor) else i + offset
        diff = pos - j
        if left_window_size >= 0: extra.append(diff <= left_window_size)
        if right_window_size >= 0: extra.append(-diff <= right_window_size)
    if nonpad_kv_seqlen is not None:
        valid = Tensor.arange(total, dtype=dtypes.int32).reshape(1, total) < \
            nonpad_kv_seqlen.cast(dtypes.int32).reshape(-1, 1)
        extra.append(valid.reshape(-1, 1, 1, total))
    for allowed in extra:
        b = allowed_to_bias(allowed, dt)
        bias = b if bias is None else bias + b
    if bias is not None and bias.ndim < 2: bias = bias + Tensor.zeros(q_len, total, dtype=dt)
    sm_dt = onnx_dtype(softmax_precision) if softmax_precision else None
    out, scores, biased, probs = attend(q, present_k, present_v, bias, scale, softcap, sm_dt)
    qk = {0: scores, 1: scores, 2: biased, 3: probs}[qk_matmul_output_mode].cast(dt)
    return (from_heads(out) if rank3 else out), present_k, present_v, qk


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary position embedding of x (batch, seq, heads, head_size) by angles whose cosines and sines are
    (batch, seq, rotary_dim / 2): the first rotary_dim values of each head turn in pairs, (i, i + rotary_dim / 2), or
    (2i, 2i + 1) where interleaved; the rest are kept."""
    half = cos.shape[-1]
    rot, keep = x[..., :2 * half], x[..., 2 * half:]
    c, s = cos.unsqueeze(2).cast(x.dtype), sin.unsqueeze(2).cast(x.dtype)
    if interleaved:
        pairs = rot.reshape(*rot.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
    else: x1, x2 = rot[..., :half], rot[..., half:]
    real, imag = c * x1 - s * x2, s * x1 + c * x2
    out = Tensor.stack(real, imag, dim=-1).reshape(rot.shape) if interleaved else real.cat(imag, dim=-1)
    return out.cat(keep, dim=-1) if keep.shape[-1] else out


def rotary_angles(cos_cache: Tensor, sin_cache: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The rows of the caches (max_position, rotary_dim / 2) at positions (batch, seq)."""
    return gather(cos_cache, positions, axis=0), gather(sin_cache, positions, axis=0)


@op("RotaryEmbedding")
def rotary_embedding(x: Tensor, cos_cache: Tensor, sin_cache: Tensor, position_ids: Tensor | None = None, *,
                     interleaved: int = 0, num_heads: int = 0, rotary_embedding_dim: int = 0) -> Tensor:
    # x is (batch, heads, seq, head_size), or (batch, seq, hidden) with num_heads; without position_ids the caches are
    # already (batch, seq, rotary_dim / 2)
    if x.ndim == 4: xs = x.permute(0, 2, 1, 3)
    elif x.ndim == 3:
        if not num_heads: raise ValueError("a 3-D input needs the attribute num_heads")
        xs = x.reshape(x.shape[0], x.shape[1], num_heads, x.shape[2] // num_heads)
    else: raise ValueError(f"the input must be 3-D or 4-D, got shape {tuple(x.shape)}")
    cos, sin = rotary_angles(cos_cache, sin_cache, position_ids) if position_ids is not None else (cos_cache, sin_cache)
    half = (rotary_embedding_dim or xs.shape[-1]) // 2
    if cos.shape[-1] != half or sin.shape[-1] != half:
        raise ValueError(f"the caches' last dim {cos.shape[-1]} isn't rotary_embedding_dim / 2 = {half}")
    out = rotary(xs, cos, sin, bool(interleaved))
    return out.permute(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)
