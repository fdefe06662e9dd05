"""The com.microsoft ops that exporters and onnxruntime's transformer optimizer emit: fused activations (Gelu,
FastGelu, BiasGelu), FusedMatMul, the fused layer norms (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
SimplifiedLayerNormalization) and the attention ops (Attention with a past state, MultiHeadAttention,
GroupQueryAttention, RotaryEmbedding). Each is the composition of Tensor ops that onnxruntime's kernel fuses;
fusegrad's scheduler does the fusing."""
from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import numpy as np

from fusegrad import Tensor, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import np_name
from fusegrad.engine.realize import capturing
from fusegrad.onnx.ops import Context, axis_of, device_check, host_value, known_value, op, scalar
from fusegrad.uop.ops import sym_value
# (importing ops_attention also registers the default domain's Attention)
from fusegrad.onnx.ops_attention import (allowed_to_bias, attend, causal_allowed, from_heads, rotary, rotary_angles,
                                         to_heads)

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


def _mask_bias(mask: Tensor, b: int, s: int, total: int, fill: float, dt: DType) -> Tensor:
    """onnxruntime's mask_index as an additive bias of 0 (attend) and `fill` (masked), broadcastable to (batch, heads,
    seq, total): key lengths (batch,), ends and starts (2 * batch,), 0/1 keys (batch, total) or 0/1 per query
    (batch, seq, total). (onnxruntime's CPU kernel has no (batch, 1, max, max) masks either.)"""
    j = Tensor.arange(total, dtype=dtypes.int32).reshape(1, total)
    shape = tuple(mask.shape)
    if shape == (b,): keep = (j < mask.cast(dtypes.int32).reshape(b, 1)).reshape(b, 1, 1, total)
    elif shape == (2 * b,):
        m = mask.cast(dtypes.int32)
        keep = ((j < m[:b].reshape(b, 1)) & (j >= m[b:].reshape(b, 1))).reshape(b, 1, 1, total)
    elif shape == (b, total): keep = (mask != 0).reshape(b, 1, 1, total)
    elif shape == (b, s, total): keep = (mask != 0).reshape(b, 1, s, total)
    else: raise Unsupported(f"mask_index of shape {shape} (supported: (batch,), (2*batch,), (batch, total), "
                            f"(batch, seq, total) with batch {b}, seq {s}, total {total})")
    return keep.where(Tensor(0.0, dtype=dt), Tensor(fill, dtype=dt))


def _causal_bias(s: int, total: int, past: int, fill: float, dt: DType) -> Tensor:
    return causal_allowed(s, total, past).where(Tensor(0.0, dtype=dt), Tensor(fill, dtype=dt))


@op("Attention", domain=MS)
def attention(x: Tensor, weights: Tensor, bias: Tensor | None = None, mask_index: Tensor | None = None,
              past: Tensor | None = None, attention_bias: Tensor | None = None,
              past_sequence_length: Tensor | None = None, *, num_heads: int, unidirectional: int = 0,
              scale: float | None = None, mask_filter_value: float = -10000.0,
              qkv_hidden_sizes: Sequence[int] | None = None, do_rotary: int = 0,
              past_present_share_buffer: int = 0, rotary_embedding_dim: int = 0) -> tuple[Tensor, Tensor]:
    """Multi-head self-attention of x (batch, seq, hidden) with the packed q, k, v projection `weights`; `past`
    (2, batch, heads, past_seq, head_size) holds the keys and values of earlier positions, and the second output,
    `present`, them followed by this block's."""
    if past_sequence_length is not None or past_present_share_buffer:
        raise Unsupported("Attention with a shared past/present buffer (past_sequence_length, "
                          "past_present_share_buffer)")
    if do_rotary or rotary_embedding_dim: raise Unsupported("Attention with rotary embeddings")
    qkv = x @ weights
    if bias is not None: qkv = qkv + bias
    return packed_attention(qkv, mask_index, past, attention_bias, num_heads=num_heads, unidirectional=unidirectional,
                            scale=scale, mask_filter_value=mask_filter_value, qkv_hidden_sizes=qkv_hidden_sizes,
                            dtype=x.dtype)


def packed_attention(qkv: Tensor, mask_index: Tensor | None, past: Tensor | None, attention_bias: Tensor | None, *,
                     num_heads: int, unidirectional: int, scale: float | None, mask_filter_value: float,
                     qkv_hidden_sizes: Sequence[int] | None, dtype: DType) -> tuple[Tensor, Tensor]:
    """Attention and QAttention after their projection: qkv is (batch, seq, q + k + v hidden sizes)."""
    b, s, _ = qkv.shape
    sizes = list(qkv_hidden_sizes) if qkv_hidden_sizes else [qkv.shape[-1] // 3] * 3
    if sum(sizes) != qkv.shape[-1]: raise ValueError(f"qkv_hidden_sizes {sizes} don't add up to {qkv.shape[-1]}")
    if past is not None and sizes[1] != sizes[2]: raise ValueError("a past state needs equal key and value sizes")
    q, k, v = (to_heads(t, num_heads, what) for t, what in zip(qkv.split(sizes, -1), ("Q", "K", "V")))
    past_len = 0
    if past is not None:
        if past.ndim != 5 or past.shape[0] != 2 or tuple(past.shape[1:3]) != (b, num_heads) or \
                past.shape[4] != k.shape[3]:
            raise ValueError(f"past must have shape (2, {b}, {num_heads}, past_seq, {k.shape[3]}), got "
                             f"{tuple(past.shape)}")
        past_len = past.shape[3]
        k, v = past[0].cat(k, dim=2), past[1].cat(v, dim=2)
    total = k.shape[2]
    dt = q.dtype
    mask: Tensor | None = None
    if mask_index is not None: mask = _mask_bias(mask_index, b, s, total, mask_filter_value, dt)
    if attention_bias is not None: mask = attention_bias if mask is None else mask + attention_bias
    if unidirectional:
        c = _causal_bias(s, total, past_len, mask_filter_value, dt)
        mask = c if mask is None else mask + c
    out = attend(q, k, v, mask, scale or None, split_scale=False)[0]
    return from_heads(out).cast(dtype), Tensor.stack(k, v, dim=0)

def _kv_heads(t: Tensor, heads: int, what: str) -> Tensor:
    """A key or value given as (batch, seq, hidden) or already as (batch, heads, seq, head_size)."""
    if t.ndim == 3: return to_heads(t, heads, what)
    if t.ndim == 4 and t.shape[1] == heads: return t
    raise ValueError(f"{what} must be (batch, seq, hidden) or (batch, {heads}, seq, head_size), got {tuple(t.shape)}")


def _unpack(packed: Tensor, parts: int, heads: int, what: str) -> tuple[Tensor, ...]:
    """(batch, seq, heads, parts, head_size) -> `parts` tensors of (batch, seq, heads * head_size)."""
    b, s, n, p, h = packed.shape
    if n != heads or p != parts:
        raise ValueError(f"{what} must have shape (batch, seq, {heads}, {parts}, head_size) for {heads} heads, got "
                         f"{tuple(packed.shape)}")
    return tuple(packed[:, :, :, i].reshape(b, s, n * h) for i in range(parts))


@op("MultiHeadAttention", domain=MS)
def multi_head_attention(query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                         bias: Tensor | None = None, key_padding_mask: Tensor | None = None,
                         attention_bias: Tensor | None = None, past_key: Tensor | None = None,
                         past_value: Tensor | None = None, past_sequence_length: Tensor | None = None,
                         cache_indirection: Tensor | None = None, *, num_heads: int,
                         mask_filter_value: float = -10000.0, scale: float | None = None,
                         unidirectional: int = 0, ctx: Context | None = None) -> tuple[Tensor, ...]:
    """Attention of projected queries to keys and values (self- or cross-attention): q, k, v as (batch, seq, hidden)
    with an optional packed bias, k and v also as (batch, heads, seq, head_size), or packed: q, k and v in one query
    of (batch, seq, heads, 3, head_size), or k and v in one key of (batch, kv_seq, heads, 2, head_size); past_key and
    past_value are (batch, heads, past_seq, head_size) and the present outputs them followed by this block's; the
    fourth output is the softmax's input.

    With past_sequence_length (one value, read on the device), past_key and past_value are buffers shared with the
    present: their first past_sequence_length positions are valid, the new keys and values are written after them, and
    the presents are the buffers so written (decoder masked attention). cache_indirection (batch, beam, max_seq) then
    says for each past position which beam's buffer row holds a row's key and value (beam search; rows are batch-major:
    row r is batch r // beam, beam r % beam). The past length and the beam indices must fit the buffers; they are
    checked where they can be read (on the host, or outside a TinyJit capture). The fourth output, the scores, is
    then (batch, heads, seq, past length + seq) as onnxruntime's: a shape that depends on the past length, read on the
    host, so a capture refuses it unless the past length is known there."""
    if cache_indirection is not None and past_sequence_length is None:
        raise ValueError("cache_indirection needs past_sequence_length (and the shared past buffers)")
    if query.ndim == 5:
        if key is not None or value is not None: raise ValueError("a packed QKV query takes no key or value")
        query, key, value = _unpack(query, 3, num_heads, "the packed QKV query")
    elif key is not None and key.ndim == 5:
        if value is not None: raise ValueError("a packed KV key takes no value")
        key, value = _unpack(key, 2, num_heads, "the packed KV key")
    if key is None or value is None: raise ValueError("MultiHeadAttention needs a key and a value")
    if bias is not None:
        if key.ndim != 3 or value.ndim != 3:
            raise Unsupported("MultiHeadAttention bias with keys and values given per head")
        bq, bk, bv = bias.split([query.shape[2], key.shape[2], value.shape[2]])
        query, key, value = query + bq, key + bk, value + bv
    q = to_heads(query, num_heads, "the query")
    k, v = _kv_heads(key, num_heads, "the key"), _kv_heads(value, num_heads, "the value")
    b, _, s, _ = q.shape
    if past_sequence_length is not None:
        return _mha_shared_buffer(q, k, v, past_key, past_value, past_sequence_length, cache_indirection,
                                  key_padding_mask, attention_bias, mask_filter_value=mask_filter_value, scale=scale,
                                  unidirectional=unidirectional, out_dtype=query.dtype,
                                  scores=ctx is None or ctx.n_outputs > 3, ctx=ctx)
    past_len = 0
    if past_key is not None or past_value is not None:
        if past_key is None or past_value is None: raise ValueError("past_key and past_value go together")
        past_len = past_key.shape[2]
        k, v = past_key.cat(k, dim=2), past_value.cat(v, dim=2)
    total = k.shape[2]
    dt = q.dtype
    mask: Tensor | None = None
    if key_padding_mask is not None:
        mask = _mask_bias(key_padding_mask, b, s, total, mask_filter_value, dt)
    if attention_bias is not None: mask = attention_bias if mask is None else mask + attention_bias
    if unidirectional:
        c = _causal_bias(s, total, past_len, mask_filter_value, dt)
        mask = c if mask is None else mask + c
    # the qk output: the scaled scores with the masks and attention_bias added (the softmax's input)
    out, _, biased, _ = attend(q, k, v, mask, scale or None, split_scale=False)
    return from_heads(out).cast(query.dtype), k, v, biased


def _mha_shared_buffer(q: Tensor, k: Tensor, v: Tensor, past_key: Tensor | None, past_value: Tensor | None,
                       past_sequence_length: Tensor, cache_indirection: Tensor | None, key_padding_mask: Tensor | None,
                       attention_bias: Tensor | None, *, mask_filter_value: float, scale: float | None,
                       unidirectional: int, out_dtype: DType, scores: bool,
                       ctx: Context | None = None) -> tuple[Tensor, ...]:
    """MultiHeadAttention over past buffers shared with the presents (see multi_head_attention); the past length is
    a device value, so a TinyJit capture follows every call's. Its range, and the beam indices of cache_indirection,
    are checked on the host where they are known or can be read, and after every call of `OnnxRunner.jit()`
    (`device_check`), whose replays run no Python of the op."""
    if past_key is None or past_value is None:
        raise ValueError("past_sequence_length needs past_key and past_value (the buffers shared with the presents)")
    if past_sequence_length.numel() != 1:
        raise ValueError(f"past_sequence_length must be one value, got shape {tuple(past_sequence_length.shape)}")
    b, heads, s, _ = q.shape
    if past_key.ndim != 4 or tuple(past_key.shape[:2]) != (b, k.shape[1]) or past_key.shape[3] != k.shape[3] or \
            past_value.shape != past_key.shape:
        raise ValueError(f"past_key and past_value must be buffers of shape ({b}, {k.shape[1]}, max_seq, "
                         f"{k.shape[3]}), got {tuple(past_key.shape)} and {tuple(past_value.shape)}")
    buf = past_key.shape[2]
    # (a past length or beam index out of range would drop new keys or read another batch's rows: checked where the
    # values can be read without freezing them into a capture's replays, and by `jit()` after each call)
    def past_error(n: int) -> str | None:
        if 0 <= n <= buf - s: return None
        return f"past_sequence_length {n} with {s} new positions doesn't fit the past buffers of {buf} positions " \
            f"(0 <= past_sequence_length <= {buf - s})"
    known = _readable(past_sequence_length)
    past_len = None if known is None else int(known.reshape(-1)[0])
    if past_len is not None and (msg := past_error(past_len)) is not None: raise ValueError(msg)
    plen = past_sequence_length.reshape(1).cast(dtypes.int32)
    if known_value(past_sequence_length) is None:
        device_check(ctx, [plen], lambda p: past_error(int(p[0])))
    pasts = plen.expand(b)
    # the presents: the buffers with the new positions written at [past length, past length + s); the rest as it was
    j4 = Tensor.arange(buf, dtype=dtypes.int32).reshape(1, 1, buf, 1)
    start = plen.reshape(1, 1, 1, 1)
    in_new = (j4 >= start) & (j4 < start + s)
    idx4 = (j4 - start).maximum(0).minimum(s - 1).expand(b, k.shape[1], buf, k.shape[3])
    present_k, present_v = (in_new.where(new.gather(2, idx4), pst) for pst, new in ((past_key, k), (past_value, v)))
    keys, vals = present_k, present_v
    if cache_indirection is not None:
        if cache_indirection.ndim != 3 or cache_indirection.shape[2] != buf or \
                cache_indirection.shape[0] * cache_indirection.shape[1] != b:
            raise ValueError(f"cache_indirection must be (batch, beam, {buf}) with batch * beam = {b}, got "
                             f"{tuple(cache_indirection.shape)}")
        beam = cache_indirection.shape[1]

        def beam_error(ci: np.ndarray, n: int) -> str | None:
            used = ci[:, :, :max(n, 0)]
            if not used.size or 0 <= used.min() and used.max() < beam: return None
            bad = np.argwhere((used < 0) | (used >= beam))[0]
            return f"cache_indirection holds beam indices in [0, {beam}); at {tuple(bad.tolist())} (batch, beam, " \
                f"position) it holds {used[tuple(bad)]}"
        if past_len is not None and (ci := _readable(cache_indirection)) is not None and \
                (msg := beam_error(ci, past_len)) is not None:
            raise ValueError(msg)
        if known_value(past_sequence_length) is None or known_value(cache_indirection) is None:
            device_check(ctx, [plen, cache_indirection.cast(dtypes.int32)], lambda p, ci: beam_error(ci, int(p[0])))
        # the buffer row of each row's past position t: its batch's row of beam cache_indirection[batch, beam, t]
        base = (Tensor.arange(b, dtype=dtypes.int32) // beam * beam).reshape(b, 1)
        rows = base + cache_indirection.reshape(b, buf).cast(dtypes.int32)
        j = Tensor.arange(buf, dtype=dtypes.int32).reshape(1, buf)
        # (new positions, and those past the valid ones, are the row's own)
        rows = (j < plen.reshape(1, 1)).where(rows, Tensor.arange(b, dtype=dtypes.int32).reshape(b, 1))
        idx = rows.reshape(b, 1, buf, 1).expand(b, k.shape[1], buf, k.shape[3])
        keys = present_k.gather(0, idx)
        vals = present_v.gather(0, idx)
    dt = q.dtype
    allowed = causal_allowed(s, buf, pasts) if unidirectional else \
        Tensor.arange(buf, dtype=dtypes.int32).reshape(1, 1, 1, buf) < (plen + s).reshape(1, 1, 1, 1)
    bias = allowed_to_bias(allowed, dt)
    # masks as long as the valid keys (past length + S, onnxruntime's shape) reach the buffer's length: the positions
    # after the valid ones are masked already
    for name, m in (("key_padding_mask", key_padding_mask), ("attention_bias", attention_bias)):
        if m is not None and m.ndim >= 2 and past_len is not None and m.shape[-1] not in (past_len + s, buf):
            raise ValueError(f"{name}'s last dim {m.shape[-1]} is neither past_sequence_length + sequence length "
                             f"({past_len + s}) nor the buffer's length ({buf})")
    if key_padding_mask is not None:
        if key_padding_mask.ndim >= 2 and key_padding_mask.shape[-1] < buf:
            key_padding_mask = key_padding_mask.pad(((0, 0),) * (key_padding_mask.ndim - 1) +
                                                    ((0, buf - key_padding_mask.shape[-1]),), value=1)
        bias = bias + _mask_bias(key_padding_mask, b, s, buf, mask_filter_value, dt)
    if attention_bias is not None:
        if attention_bias.shape[-1] < buf:
            attention_bias = attention_bias.pad(((0, 0),) * (attention_bias.ndim - 1) +
                                                ((0, buf - attention_bias.shape[-1]),))
        bias = bias + attention_bias
    out, _, biased, _ = attend(q, keys, vals, bias, scale or None, split_scale=False)
    outs = (from_heads(out).cast(out_dtype), present_k, present_v)
    if not scores: return outs
    if past_len is None:
        raise Unsupported("MultiHeadAttention's scores output with past_sequence_length computed on the device under "
                          "TinyJit: its length, past_sequence_length + sequence length, is a shape, which a capture "
                          "can't read")
    total = past_len + s
    # (positions the causal mask hides are float's lowest value in onnxruntime's scores, not -inf)
    lowest = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dt == dtypes.bfloat16 else np_name(dt)).min)
    qk = allowed.where(biased, lowest) if unidirectional else biased
    return *outs, qk[..., :total]


@op("GroupQueryAttention", domain=MS)
def group_query_attention(query: Tensor, key: Tensor | None, value: Tensor | None, past_key: Tensor | None,
                          past_value: Tensor | None, seqlens_k: Tensor, total_sequence_length: Tensor,
                          cos_cache: Tensor | None = None, sin_cache: Tensor | None = None,
                          position_ids: Tensor | None = None, attention_bias: Tensor | None = None,
                          head_sink: Tensor | None = None, *, do_rotary: int = 0, kv_num_heads: int,
                          local_window_size: int = -1, num_heads: int, qk_output: int = 0,
                          rotary_interleaved: int = 0, scale: float | None = None, smooth_softmax: int = 0,
                          softcap: float = 0.0, ctx: Context | None = None) -> tuple[Tensor, ...]:
    """Causal grouped-query attention with a key/value cache: `seqlens_k[b] + 1` keys are valid for batch b (the
    cache's past ones, then this block's S); the present outputs hold the past's valid keys followed by the new ones
    (as long as the longer of total_sequence_length and the past buffer; positions past a batch's length are 0).

    seqlens_k is used on the device (it is often computed there, from an attention mask): each batch's past length
    places the new keys, the causal mask and the rotary positions, so kernels captured by TinyJit follow every call's
    lengths. total_sequence_length sets the present's length (a shape) and is read on the host: a constant, or a size
    from a Shape (a symbolic value where the dim is symbolic). Computed on the device, it is read in a plain call; a
    TinyJit capture, which can't read it, takes the present's length that the warm-up call (TinyJit's first, plain)
    found for the same batch and new positions, as the same difference to the past buffer's length (or to the new
    positions without a past): the length a capture's replays give is fixed, as every shape of theirs is."""
    if do_rotary and (cos_cache is None or sin_cache is None):
        raise ValueError("do_rotary needs cos_cache and sin_cache")
    if qk_output not in (0, 1, 2): raise ValueError(f"qk_output must be 0, 1 or 2, got {qk_output}")
    if key is None:
        # q, k and v packed along the hidden dim
        kv_hidden = (query.shape[2] // (num_heads + 2 * kv_num_heads)) * kv_num_heads
        query, key, value = query.split([query.shape[2] - 2 * kv_hidden, kv_hidden, kv_hidden], -1)
    if value is None: raise ValueError("GroupQueryAttention needs a value with a key")
    if (past_key is None) != (past_value is None): raise ValueError("past_key and past_value go together")
    b, s = query.shape[:2]
    if tuple(seqlens_k.shape) not in ((b,), (b, 1)):
        raise ValueError(f"seqlens_k must have one value per batch ({b}), got shape {tuple(seqlens_k.shape)}")
    if total_sequence_length.numel() != 1:
        raise ValueError(f"total_sequence_length must be one value, got shape {tuple(total_sequence_length.shape)}")
    buf = past_key.shape[2] if past_key is not None else 0
    # a device-computed total: its difference to the past buffer's length (to the new positions without a past), as the
    # warm-up call found it, for a capture
    learned: dict[Any, int] = ctx.runner.total_offsets if ctx is not None else {}
    memo = (ctx.node_name if ctx is not None else "", b, s, past_key is not None)
    base = buf if past_key is not None else s
    if known_value(total_sequence_length) is None and capturing:
        if memo not in learned:
            raise Unsupported("total_sequence_length computed on the device under TinyJit with no plain call of the "
                              "same shapes before: it sets the present's length (a shape), which a capture can't read")
        total = base + learned[memo]
    else:
        total = scalar(total_sequence_length)
        if known_value(total_sequence_length) is None: learned[memo] = int(total) - sym_value(base)
    # the present is as long as the longer of the two; a symbolic total (from a Shape of a named dim) is taken to count
    # the past too, as in a cache that grows by each step's positions
    length = max(total, buf) if isinstance(total, int) and isinstance(buf, int) else total
    if known_value(total_sequence_length) is None and isinstance(buf, int) and isinstance(base, int):
        # (a replay gives the present the length of the capture: a total that asks for another is an error; so is
        # any other total where the total itself shapes a result, attention_bias's padding and the scores)
        exact = attention_bias is not None or (ctx is not None and ctx.n_outputs > 3)

        def total_error(t: np.ndarray, want: int = int(total), n: int = int(length)) -> str | None:
            got = int(t.reshape(-1)[0])
            if max(got, buf) == n and (got == want or not exact): return None
            return f"total_sequence_length {got}, where this jit() capture was made for {want} (a present of {n} " \
                f"positions): a replay's shapes are the capture's; call the runner itself for such totals"
        device_check(ctx, [total_sequence_length.cast(dtypes.int64)], total_error)
    _check_seqlens(seqlens_k, s, buf, length, past_key is not None, ctx)
    # each batch's number of past positions, on the device
    pasts = seqlens_k.reshape(b).cast(dtypes.int32) + (1 - s)
    if do_rotary:
        # the new positions follow each batch's past ones, unless position_ids says where they are
        pos = position_ids if position_ids is not None else \
            pasts.reshape(b, 1) + Tensor.arange(s, dtype=dtypes.int32).reshape(1, s)
        cos, sin = rotary_angles(cos_cache, sin_cache, pos)  # type: ignore[arg-type]
        query = rotary(query.reshape(b, s, num_heads, -1), cos, sin, bool(rotary_interleaved)).reshape(query.shape)
        key = rotary(key.reshape(b, s, kv_num_heads, -1), cos, sin, bool(rotary_interleaved)).reshape(key.shape)
    q = to_heads(query, num_heads, "the query")
    k, v = to_heads(key, kv_num_heads, "the key"), to_heads(value, kv_num_heads, "the value")
    present_k, present_v = (_place_new(pst, new, pasts, length) for pst, new in ((past_key, k), (past_value, v)))
    allowed = causal_allowed(s, length, pasts)  # (batch, 1, s, length): also keeps keys past the batch's length out
    if local_window_size >= 0:
        # a window of local_window_size keys that ends at the query's own position (as onnxruntime's kernel)
        i_ = Tensor.arange(s, dtype=dtypes.int32).reshape(s, 1) + pasts.reshape(-1, 1, 1, 1)
        allowed = allowed & (i_ - Tensor.arange(length, dtype=dtypes.int32).reshape(1, length) < local_window_size)
    bias = allowed_to_bias(allowed, q.dtype)
    if attention_bias is not None: bias = bias + attention_bias.pad(((0, 0),) * 3 + ((0, length - total),))
    # smooth_softmax: a logit of 0 joins each row's softmax; head_sink: a logit per head instead
    sink = head_sink if head_sink is not None else Tensor.zeros(num_heads, dtype=q.dtype) if smooth_softmax else None
    out, _, biased, probs = attend(q, present_k, present_v, bias, scale or None, softcap, split_scale=False, sink=sink)
    outs = (from_heads(out).cast(query.dtype), present_k, present_v)
    if not qk_output: return outs
    # qk_output 1: the scaled (and softcapped) scores with attention_bias, 0 where the masks hide a key; 2: the
    # probabilities (onnxruntime's)
    qk = allowed.where(biased, 0.0) if qk_output == 1 else probs
    return *outs, qk[..., :total] if isinstance(total, int) and isinstance(length, int) and total < length else qk


def _readable(t: Tensor) -> np.ndarray | None:
    """A tensor's values where reading them freezes nothing: its host copy, or read back outside a TinyJit capture."""
    known = known_value(t)
    if known is not None or capturing: return known
    return host_value(t)


def _check_seqlens(seqlens_k: Tensor, s: int, buf: Any, length: Any, has_past: bool, ctx: Context | None) -> None:
    """The checks of seqlens_k against the cache, where its values can be read (known on the host, or outside a TinyJit
    capture: inside one, reading them would freeze this call's values into the replays), and by `jit()` after every
    call (`device_check`)."""
    def error(values: np.ndarray) -> str | None:
        lens = [int(n) + 1 for n in values.reshape(-1)]
        if any(n < s for n in lens): return f"seqlens_k {[n - 1 for n in lens]} is shorter than the {s} new positions"
        if not has_past and any(n > s for n in lens): return "seqlens_k counts past positions but there is no past_key"
        if has_past and isinstance(buf, int) and any(n - s > buf for n in lens):
            return f"seqlens_k {[n - 1 for n in lens]} says the cache holds more than its {buf} positions"
        if isinstance(length, int) and any(n > length for n in lens):
            return f"seqlens_k {[n - 1 for n in lens]} says a present holds more than its {length} positions"
        return None
    known = known_value(seqlens_k)
    if known is None: device_check(ctx, [seqlens_k.cast(dtypes.int32)], error)
    if known is None and capturing: return
    if (msg := error(known if known is not None else host_value(seqlens_k))) is not None: raise ValueError(msg)


def _place_new(past: Tensor | None, new: Tensor, pasts: Tensor, length: Any) -> Tensor:
    """A batch's present: its `pasts[b]` valid past positions, the S new ones, then zeros up to `length`; positions
    chosen on the device (per-batch offsets known only there)."""
    b, h, s, d = new.shape
    j = Tensor.arange(length, dtype=dtypes.int32).reshape(1, 1, length, 1)
    start = pasts.reshape(b, 1, 1, 1)
    # the new position each present position would take (clamped where it takes none)
    idx = (j - start).maximum(0).minimum(s - 1).expand(b, h, length, d)
    placed = new.gather(2, idx)
    in_new = (j >= start) & (j < start + s)
    rest = Tensor.zeros(b, h, length, d, dtype=new.dtype)
    if past is not None:
        buf = past.shape[2]
        if isinstance(length, int) and isinstance(buf, int):
            old = past.pad(((0, 0), (0, 0), (0, length - buf), (0, 0))) if length > buf else past
        else:
            # symbolic lengths: the cache read at clamped positions (a pad by their difference would need its sign)
            old = past.gather(2, j.minimum(buf - 1).expand(b, h, length, d))
        rest = (j < start).where(old, rest)
    return in_new.where(placed, rest)


@op("RotaryEmbedding", domain=MS)
def ms_rotary_embedding(x: Tensor, position_ids: Tensor, cos_cache: Tensor, sin_cache: Tensor, *, interleaved: int = 0,
                        is_packed_batching: int = 0, num_heads: int = 0, rotary_embedding_dim: int = 0,
                        scale: float = 1.0) -> Tensor:
    """onnxruntime's rotary embedding of x (batch, seq, hidden) or (batch, heads, seq, head_size): position_ids is
    (batch, seq), or one value, the position of the first of the seq positions of every batch."""
    if is_packed_batching: raise Unsupported("RotaryEmbedding is_packed_batching=1")
    if scale != 1.0: raise Unsupported(f"RotaryEmbedding scale={scale}")
    rot = 2 * cos_cache.shape[-1]
    if rotary_embedding_dim and rotary_embedding_dim != rot:
        raise ValueError(f"rotary_embedding_dim {rotary_embedding_dim} isn't twice the caches' last dim {rot // 2}")
    if x.ndim == 4: xs = x.permute(0, 2, 1, 3)
    elif x.ndim == 3:
        heads = num_heads or x.shape[2] // rot
        xs = x.reshape(x.shape[0], x.shape[1], heads, x.shape[2] // heads)
    else: raise ValueError(f"the input must be 3-D or 4-D, got shape {tuple(x.shape)}")
    b, s = xs.shape[:2]
    pos = position_ids
    if pos.numel() == 1:
        pos = (pos.reshape(1, 1).cast(dtypes.int64) + Tensor.arange(s, dtype=dtypes.int64)).expand(b, s)
    cos, sin = rotary_angles(cos_cache, sin_cache, pos)
    out = rotary(xs, cos, sin, bool(interleaved))
    return out.permute(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)
