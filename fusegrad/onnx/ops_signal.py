"""The signal ops of audio front ends: DFT, STFT, the window functions (HannWindow, HammingWindow, BlackmanWindow) and
MelWeightMatrix.

A transform's length is known when the graph is built, so a DFT is a matmul with cosine and sine matrices computed on
the host (O(n^2) work, which is what the short frames of audio models need, and it fuses with what is around it)."""
from __future__ import annotations

from typing import Any

import numpy as np

from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.onnx_dtypes import np_name, onnx_dtype
from fusegrad.onnx.ops import Context, axis_of, host_value, is_float, op, scalar


def _length(t: Tensor | None, what: str) -> int | None:
    if t is None: return None
    v = scalar(t)
    if not isinstance(v, (int, np.integer)): raise Unsupported(f"{what} must be a known integer, got {v!r}")
    return int(v)


def _fit(x: Tensor, n: int) -> Tensor:
    """x with its last dim cut or zero-padded to n."""
    have = x.shape[-1]
    if have == n: return x
    if have > n: return x[..., :n]
    return x.pad([(0, 0)] * (x.ndim - 1) + [(0, n - have)])


def _matrices(n_in: int, n_out: int, length: int, inverse: bool, half: bool, dtype: Any) -> tuple[Tensor, Tensor]:
    """(C, S) with the transform out = (xr + i xi) @ (C + i S) over the last dim: n_in inputs to n_out outputs.
    `half` is the real inverse of a one-sided spectrum (each inner bin stands for itself and its mirror)."""
    n = np.arange(n_in, dtype=np.float64)[:, None]
    k = np.arange(n_out, dtype=np.float64)[None, :]
    theta = 2 * np.pi * ((n * k) % length) / length
    c, s = np.cos(theta), np.sin(theta)
    if not inverse: return Tensor(c.astype(dtype)), Tensor((-s).astype(dtype))
    if half:
        w = np.where((n == 0) | (2 * n == length), 1.0, 2.0)
        c, s = c * w, s * w
    return Tensor((c / length).astype(dtype)), Tensor((s / length).astype(dtype))


def dft(x: Tensor, length: int | None, axis: int, inverse: bool, onesided: bool) -> Tensor:
    """ONNX's DFT of x (..., 1 for real or 2 for complex) along `axis` (an axis of x, not the last)."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ValueError(f"the signal must end in a dim of 1 (real) or 2 (complex), got shape {tuple(x.shape)}")
    if not is_float(x): raise ValueError(f"the signal must be float, got {x.dtype}")
    if axis == x.ndim - 1: raise ValueError(f"axis {axis} is the real/imaginary dim, not a signal axis")
    n_have = x.shape[axis]
    if length is None: length = 2 * (n_have - 1) if inverse and onesided else n_have
    if length < 1: raise ValueError(f"dft_length must be positive, got {length}")
    half = inverse and onesided
    if onesided and not inverse and x.shape[-1] == 2:
        raise ValueError("a one-sided transform needs a real signal (last dim 1)")
    work = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    xc = x.cast(work) if x.dtype != work else x
    # the transformed axis goes last, where the matmul contracts it
    xr = xc[..., 0].transpose(axis, -1)
    xi = xc[..., 1].transpose(axis, -1) if x.shape[-1] == 2 else None
    n_in = length // 2 + 1 if half else length
    n_out = length // 2 + 1 if onesided and not inverse else length
    c, s = _matrices(n_in, n_out, length, inverse, half, np_name(work))
    xr = _fit(xr, n_in)
    re = xr @ c
    if xi is not None: re = re - _fit(xi, n_in) @ s
    if half: return re.transpose(axis, -1).unsqueeze(-1).cast(x.dtype)
    im = xr @ s
    if xi is not None: im = im + _fit(xi, n_in) @ c
    return Tensor.stack(re.transpose(axis, -1), im.transpose(axis, -1), dim=-1).cast(x.dtype)


@op("DFT")
def dft_op(x: Tensor, dft_length: Tensor | None = None, axis_in: Tensor | None = None, *, ctx: Context,
           axis: int | None = None, inverse: int = 0, onesided: int = 0) -> Tensor:
    # opset 17 has the axis as an attribute (default 1), opset 20 as an input (default -2); both count x's last dim
    if ctx.opset >= 20:
        if axis is not None: raise ValueError("from opset 20 on the axis is an input, not an attribute")
        a = _length(axis_in, "axis") if axis_in is not None else -2
    else:
        if axis_in is not None: raise ValueError("before opset 20 the axis is an attribute, not an input")
        a = 1 if axis is None else axis
    return dft(x, _length(dft_length, "dft_length"), axis_of(a, x.ndim), bool(inverse), bool(onesided))


@op("STFT")
def stft(signal: Tensor, frame_step: Tensor, window: Tensor | None = None, frame_length: Tensor | None = None, *,
         onesided: int = 1) -> Tensor:
    """(batch, frames, bins, 2): the DFT of each frame of frame_length samples every frame_step, times the window."""
    if signal.ndim != 3 or signal.shape[-1] not in (1, 2):
        raise ValueError(f"the signal must be (batch, length, 1 or 2), got shape {tuple(signal.shape)}")
    step = _length(frame_step, "frame_step")
    n = _length(frame_length, "frame_length")
    if window is not None:
        if window.ndim != 1: raise ValueError(f"the window must be 1-D, got shape {tuple(window.shape)}")
        if n is not None and n != window.shape[0]:
            raise ValueError(f"the window has {window.shape[0]} values but frame_length is {n}")
        n = window.shape[0]
    if n is None: n = signal.shape[1]
    if step is None or step < 1: raise ValueError(f"frame_step must be positive, got {step}")
    if not 1 <= n <= signal.shape[1]:
        raise ValueError(f"frame_length {n} must be between 1 and the signal length {signal.shape[1]}")
    frames = 1 + (signal.shape[1] - n) // step
    # every frame's samples, gathered at once: (batch, frames * n, 1 or 2)
    idx = (np.arange(frames)[:, None] * step + np.arange(n)[None, :]).reshape(-1)
    index = Tensor(idx.astype(np.int32)).reshape(1, -1, 1).expand(signal.shape[0], -1, signal.shape[-1])
    x = signal.gather(1, index).reshape(signal.shape[0], frames, n, signal.shape[-1])
    if window is not None: x = x * window.cast(x.dtype).reshape(1, 1, n, 1)
    return dft(x, n, 2, False, bool(onesided))


def _window(size: Tensor, output_datatype: int, periodic: int, fn: Any) -> Tensor:
    n = _length(size, "size")
    if n is None or n < 0: raise ValueError(f"the window size must be a non-negative integer, got {n}")
    if periodic not in (0, 1): raise ValueError(f"periodic must be 0 or 1, got {periodic}")
    dt = onnx_dtype(output_datatype)
    # the symmetric window spans n - 1 steps, the periodic one n (a window of size 1 is a single 1)
    span = n if periodic else n - 1
    w = fn(2 * np.pi * np.arange(n, dtype=np.float64) / span) if span > 0 else np.ones(n)
    return Tensor(w.astype(np.float32)).cast(dt) if dt != dtypes.float64 else Tensor(w)


@op("HannWindow")
def hann_window(size: Tensor, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    return _window(size, output_datatype, periodic, lambda t: np.sin(t / 2) ** 2)


@op("HammingWindow")
def hamming_window(size: Tensor, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    return _window(size, output_datatype, periodic, lambda t: 25 / 46 - (1 - 25 / 46) * np.cos(t))


@op("BlackmanWindow")
def blackman_window(size: Tensor, *, output_datatype: int = 1, periodic: int = 1) -> Tensor:
    return _window(size, output_datatype, periodic, lambda t: 0.42 - 0.5 * np.cos(t) + 0.08 * np.cos(2 * t))



@op("MelWeightMatrix")
def mel_weight_matrix(num_mel_bins: Tensor, dft_length: Tensor, sample_rate: Tensor, lower_edge_hertz: Tensor,
                      upper_edge_hertz: Tensor, *, output_datatype: int = 1) -> Tensor:
    """(dft_length // 2 + 1, num_mel_bins): triangular filters spaced evenly on the mel scale, each rising from its
    left neighbour's centre to its own and falling to its right neighbour's (computed on the host: all inputs are
    scalars)."""
    bins, n_fft = _length(num_mel_bins, "num_mel_bins"), _length(dft_length, "dft_length")
    assert bins is not None and n_fft is not None
    if bins < 1 or n_fft < 1: raise ValueError(f"num_mel_bins {bins} and dft_length {n_fft} must be positive")
    rate = host_value(sample_rate).reshape(())
    lo, hi = host_value(lower_edge_hertz).reshape(()), host_value(upper_edge_hertz).reshape(())
    if not 0 <= lo < hi or rate <= 0:
        raise ValueError(f"the edges must satisfy 0 <= lower ({lo}) < upper ({hi}) and the sample rate ({rate}) be "
                         "positive")
    # bins + 2 edges, evenly spaced in mel = 2595 log10(1 + f / 700) (the step divides by the count of edges, as in
    # ONNX's reference), then rounded down to DFT bins
    mel_lo, mel_hi = 2595 * np.log1p(lo / 700) / np.log(10), 2595 * np.log1p(hi / 700) / np.log(10)
    mel = np.arange(bins + 2) * ((mel_hi - mel_lo) / (bins + 2)) + mel_lo
    edges = (((n_fft + 1) * (700 * np.expm1(mel / 2595 * np.log(10)))) // rate).astype(int)
    n_spec = n_fft // 2 + 1
    if edges.max() >= n_spec:
        raise ValueError(f"the upper edge {hi} Hz lies past the last DFT bin ({n_spec} bins at {rate} Hz)")
    out = np.zeros((n_spec, bins))
    j = np.arange(n_spec)
    for i in range(bins):
        left, mid, right = edges[i], edges[i + 1], edges[i + 2]
        if mid == left: out[mid, i] = 1
        else: out[:, i] = np.where((j >= left) & (j <= mid), (j - left) / max(mid - left, 1), 0)
        if right > mid: out[:, i] = np.where((j >= mid) & (j < right), (right - j) / (right - mid), out[:, i])
    dt = onnx_dtype(output_datatype)
    return Tensor(out.astype(np_name(dt)) if dt != dtypes.bfloat16 else out.astype(np.float32)).cast(dt)
