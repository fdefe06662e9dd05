"""Resize and Upsample, CenterCropPad, AffineGrid and GridSample.

Resizing is separable: each resized axis is one product with an (input size, output size) weight matrix whose
columns hold the interpolation weights of one output position. The matrices are computed on the host in float64
from the static sizes, so every mode (nearest with its four rounding rules, linear, cubic, with or without
antialiasing) and every coordinate transformation is the same device work: a matmul per axis."""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import Context, axis_of, host_value, ints, op

COORD_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
               "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coords(mode: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """The input coordinate that each output index samples, as ONNX's coordinate_transformation_mode defines it."""
    y = np.arange(n_out, dtype=np.float64)
    out_f = scale * n_in  # the output length before it was made an integer
    if mode == "half_pixel": return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        # half_pixel, with the grid centred where rounding the output size down moved it
        return n_in / 2 * (1 - n_out / out_f) + (y + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel": return (y + 0.5) / scale - 0.5 if n_out > 1 else np.zeros(n_out)
    if mode == "align_corners": return y * (n_in - 1) / (n_out - 1) if n_out > 1 else np.zeros(n_out)
    if mode == "asymmetric": return y / scale
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        if out_f == 1: return np.full(n_out, (hi - lo) * (n_in - 1) / 2 + lo * (n_in - 1))
        return y * (hi - lo) * (n_in - 1) / (out_f - 1) + lo * (n_in - 1)
    raise Unsupported(f"coordinate_transformation_mode {mode!r} (supported: {', '.join(COORD_MODES)})")


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def weight_matrix(x: np.ndarray, n_in: int, mode: str, nearest_mode: str, cubic_a: float, antialias: bool,
                  exclude_outside: bool, scale: float) -> np.ndarray:
    """(n_in, n_out) weights: column j interpolates at input coordinate x[j]; neighbours beyond the edges take the edge
    value (or, with exclude_outside, no weight, the others renormalized)."""
    n_out = len(x)
    m = np.zeros((n_in, n_out), dtype=np.float64)
    cols = np.arange(n_out)
    if mode == "nearest":
        if nearest_mode == "round_prefer_floor": idx = np.ceil(x - 0.5)
        elif nearest_mode == "round_prefer_ceil": idx = np.floor(x + 0.5)
        elif nearest_mode == "floor": idx = np.floor(x)
        elif nearest_mode == "ceil": idx = np.ceil(x)
        else: raise Unsupported(f"nearest_mode {nearest_mode!r} (supported: {', '.join(NEAREST_MODES)})")
        m[np.clip(idx, 0, n_in - 1).astype(np.int64), cols] = 1.0
        return m
    if mode not in ("linear", "cubic"): raise Unsupported(f"Resize mode {mode!r} (supported: nearest, linear, cubic)")
    # antialiasing widens the filter by 1/scale when shrinking, and then the weights are normalized to sum to one
    s = min(scale, 1.0) if antialias else 1.0
    support = (1.0 if mode == "linear" else 2.0) / s
    base = np.floor(x).astype(np.int64)
    reach = int(math.ceil(support)) + 1
    offs = np.arange(-reach, reach + 1)
    idx = base[:, None] + offs[None, :]  # (n_out, taps)
    d = (idx - x[:, None]) * s
    w = np.clip(1 - np.abs(d), 0, None) if mode == "linear" else _cubic(d, cubic_a)
    if exclude_outside: w = np.where((idx < 0) | (idx >= n_in), 0.0, w)
    if antialias or exclude_outside:
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    np.add.at(m, (np.clip(idx, 0, n_in - 1), np.broadcast_to(cols[:, None], idx.shape)), w)
    return m


def _resize_axis(x: Tensor, axis: int, m: np.ndarray, outside: np.ndarray | None, fill: float) -> Tensor:
    n_in, n_out = m.shape
    picks = m.argmax(0)
    if np.array_equal(m, np.eye(n_in)): out = x
    elif np.all(m.max(0) == 1.0) and n_out % n_in == 0 and np.array_equal(picks, np.repeat(np.arange(n_in),
                                                                                            n_out // n_in)):
        # nearest by a whole factor: each input repeated, a view
        k = n_out // n_in
        sh = x.shape
        out = x.unsqueeze(axis + 1).expand(sh[:axis + 1] + (k,) + sh[axis + 1:]).flatten(axis, axis + 1)
    else:
        w = Tensor(m.astype(np.float32))
        out = (x.transpose(axis, -1) @ w).transpose(axis, -1)
    if outside is not None and outside.any():
        mask = Tensor(outside.reshape((-1,) + (1,) * (x.ndim - axis - 1)))
        out = mask.where(fill, out)
    return out


def resize_nd(x: Tensor, sizes: Sequence[int], scales: Sequence[float], roi: Sequence[float] | None, mode: str,
              coord_mode: str, nearest_mode: str, cubic_a: float, antialias: bool, exclude_outside: bool,
              extrapolation: float) -> Tensor:
    """Resize every axis of x to sizes[axis], sampling with scales[axis] (the full rank of x for both)."""
    if coord_mode not in COORD_MODES:
        raise Unsupported(f"coordinate_transformation_mode {coord_mode!r} (supported: {', '.join(COORD_MODES)})")
    r = x.ndim
    # (a scale that floors an axis to 0, as 0.5 of 1: the output has no elements, as in onnxruntime)
    if any(int(n) == 0 for n in sizes): return Tensor.empty(*[int(n) for n in sizes], dtype=x.dtype, device=x.device)
    is_int = not dtypes.is_float(x.dtype)
    out = x.cast(dtypes.float32) if is_int or x.dtype != dtypes.float64 else x
    for a in range(r):
        n_in, n_out, sc = x.shape[a], int(sizes[a]), float(scales[a])
        lohi = (float(roi[a]), float(roi[a + r])) if roi is not None else (0.0, 1.0)
        if n_out == n_in and math.isclose(sc, 1.0) and (coord_mode != "tf_crop_and_resize" or lohi == (0.0, 1.0)):
            continue
        xs = source_coords(coord_mode, n_in, n_out, sc, lohi)
        m = weight_matrix(xs, n_in, mode, nearest_mode, cubic_a, antialias, exclude_outside, sc)
        outside = (xs < 0) | (xs > n_in - 1) if coord_mode == "tf_crop_and_resize" else None
        out = _resize_axis(out, a, m, outside, extrapolation)
    if is_int:
        lo, hi = dtypes.min(x.dtype), dtypes.max(x.dtype)
        return out.round().maximum(lo).minimum(hi).cast(x.dtype)
    return out.cast(x.dtype)


def _floats(t: Tensor | None) -> list[float]:
    return [] if t is None else [float(v) for v in host_value(t).reshape(-1)]


@op("Resize")
def resize(x: Tensor, roi_in: Tensor | None = None, scales_in: Tensor | None = None, sizes_in: Tensor | None = None, *,
           antialias: int = 0, axes: Sequence[int] | None = None, coordinate_transformation_mode: str = "half_pixel",
           cubic_coeff_a: float = -0.75, exclude_outside: int = 0, extrapolation_value: float = 0.0,
           keep_aspect_ratio_policy: str = "stretch", mode: str = "nearest", nearest_mode: str = "round_prefer_floor",
           ctx: Context) -> Tensor:
    r = x.ndim
    if ctx.opset < 11:
        # Resize-10 took (X, scales) and sampled as Upsample does
        return upsample(x, roi_in, mode=mode)
    ax = [axis_of(a, r) for a in axes] if axes is not None else list(range(r))
    roi_v, scales_v, sizes_v = _floats(roi_in), _floats(scales_in), [int(v) for v in ints(sizes_in)]
    if scales_v and sizes_v: raise ValueError("only one of scales and sizes may be given")
    if not scales_v and not sizes_v: raise ValueError("one of scales and sizes must be given")
    full_roi: list[float] | None = None
    if roi_v:
        if len(roi_v) != 2 * len(ax): raise ValueError(f"roi {roi_v} must have 2 values for each of the axes {ax}")
        full_roi = [0.0] * r + [1.0] * r
        for i, a in enumerate(ax): full_roi[a], full_roi[a + r] = roi_v[i], roi_v[i + len(ax)]
    shape = list(x.shape)
    scales_full, sizes_full = [1.0] * r, list(shape)
    if scales_v:
        if len(scales_v) != len(ax):
            raise ValueError(f"scales {scales_v} must have one value for each of the axes {ax}")
        for a, s in zip(ax, scales_v):
            if s <= 0: raise ValueError(f"scales must be positive, got {scales_v}")
            scales_full[a], sizes_full[a] = s, int(s * shape[a])
    else:
        if len(sizes_v) != len(ax): raise ValueError(f"sizes {sizes_v} must have one value for each of the axes {ax}")
        ratios = [sz / shape[a] for a, sz in zip(ax, sizes_v)]
        if keep_aspect_ratio_policy == "stretch":
            for a, sz, q in zip(ax, sizes_v, ratios): scales_full[a], sizes_full[a] = q, sz
        elif keep_aspect_ratio_policy in ("not_larger", "not_smaller"):
            q = min(ratios) if keep_aspect_ratio_policy == "not_larger" else max(ratios)
            for a in ax: scales_full[a], sizes_full[a] = q, int(q * shape[a] + 0.5)
        else: raise Unsupported(f"keep_aspect_ratio_policy {keep_aspect_ratio_policy!r}")
    if antialias and mode == "nearest": raise Unsupported("antialias with mode nearest")
    return resize_nd(x, sizes_full, scales_full, full_roi, mode, coordinate_transformation_mode, nearest_mode,
                     cubic_coeff_a, bool(antialias), bool(exclude_outside), extrapolation_value)


@op("Upsample")
def upsample(x: Tensor, scales_in: Tensor | None = None, *, mode: str = "nearest",
             scales: Sequence[float] | None = None) -> Tensor:
    # nearest picks floor(i / scale) and linear is asymmetric, with edges repeated
    sc = _floats(scales_in) if scales_in is not None else list(scales or [])
    if len(sc) != x.ndim: raise ValueError(f"scales {sc} must have one value per dim of {tuple(x.shape)}")
    if mode not in ("nearest", "linear", "bilinear"): raise Unsupported(f"Upsample mode {mode!r}")
    sizes = [int(s * n) for s, n in zip(sc, x.shape)]
    return resize_nd(x, sizes, sc, None, "linear" if mode == "bilinear" else mode, "asymmetric", "floor", -0.75, False,
                     False, 0.0)


@op("CenterCropPad")
def center_crop_pad(x: Tensor, shape: Tensor, *, axes: Sequence[int] | None = None) -> Tensor:
    """Each listed axis cropped or zero-padded to its new size about its centre (an odd difference leaves the extra
    position at the end)."""
    sizes = ints(shape)
    picked = [axis_of(a, x.ndim) for a in axes] if axes is not None else list(range(x.ndim))
    if len(sizes) != len(picked):
        raise ValueError(f"shape has {len(sizes)} sizes for {len(picked)} axes")
    if len(set(picked)) != len(picked): raise ValueError(f"axes {list(axes or [])} repeat an axis")
    crop: list[tuple[int, int] | None] = [None] * x.ndim
    pad = [(0, 0)] * x.ndim
    for a, n in zip(picked, sizes):
        if n < 0: raise ValueError(f"size {n} for axis {a} is negative")
        dim = x.shape[a]
        if n < dim: crop[a] = ((dim - n) // 2, (dim - n) // 2 + n)
        elif n > dim: pad[a] = ((n - dim) // 2, n - dim - (n - dim) // 2)
    out = x.shrink(tuple(crop)) if any(c is not None for c in crop) else x
    return out.pad(tuple(pad)) if any(p != (0, 0) for p in pad) else out


@op("AffineGrid")
def affine_grid(theta: Tensor, size: Tensor, *, align_corners: int = 0) -> Tensor:
    """The sampling grid of GridSample for affine matrices theta (N, 2, 3) or (N, 3, 4): each output position's
    normalized coordinates (x along the last dim, then y, then z, from -1 to 1) transformed by its batch's matrix."""
    dims = ints(size)
    spatial = dims[2:]
    k = len(spatial)
    if k not in (2, 3) or len(dims) != k + 2:
        raise ValueError(f"size must be (N, C, H, W) or (N, C, D, H, W), got {dims}")
    if tuple(theta.shape) != (dims[0], k, k + 1):
        raise ValueError(f"theta must have shape ({dims[0]}, {k}, {k + 1}) for size {dims}, got {tuple(theta.shape)}")
    axes = []
    for n in spatial:
        # positions of the pixel centres, or of the corner pixels at -1 and 1 with align_corners
        if align_corners: axes.append(np.linspace(-1.0, 1.0, n) if n > 1 else np.full(1, -1.0))
        else: axes.append((np.arange(n) * 2.0 + 1.0) / n - 1.0)
    mesh = np.meshgrid(*axes, indexing="ij")
    # homogeneous coordinates in the order x, y(, z), 1: the spatial dims reversed
    base = np.stack([*reversed(mesh), np.ones(tuple(spatial))], -1).reshape(-1, k + 1)
    grid = Tensor(base.astype(np.float32)).cast(theta.dtype) @ theta.transpose(1, 2)
    return grid.reshape(dims[0], *spatial, k)


def _reflect(x: Tensor, lo: float, hi: float) -> Tensor:
    """x folded back into [lo, hi] by reflecting at the borders as often as needed."""
    span = hi - lo
    below, above = lo - x, x - hi
    out = x
    for dist, near, far, inside in ((below, lo, hi, x >= lo), (above, hi, lo, x <= hi)):
        n = (dist / span).trunc() if span > 0 else dist * 0
        r = dist - n * span
        even = (n - (n / 2).trunc() * 2) == 0
        # an even number of whole spans lands at the near border plus the rest, an odd one at the far border
        sign = 1.0 if near == lo else -1.0
        folded = even.where(near + sign * r, far - sign * r)
        out = inside.where(out, folded)
    return out


def _cubic_coeffs(t: Tensor) -> list[Tensor]:
    """Keys' cubic convolution weights (a = -0.75) of the taps at -1, 0, 1 and 2 for a fraction t."""
    a = -0.75
    def far(d: Tensor) -> Tensor: return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    def near(d: Tensor) -> Tensor: return ((a + 2) * d - (a + 3)) * d * d + 1
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


GRID_MODES = {"linear": "linear", "bilinear": "linear", "nearest": "nearest", "cubic": "cubic", "bicubic": "cubic"}


@op("GridSample")
def grid_sample(x: Tensor, grid: Tensor, *, align_corners: int = 0, mode: str = "linear",
                padding_mode: str = "zeros") -> Tensor:
    """x (N, C, *spatial) sampled at grid (N, *out, k), normalized coordinates from -1 to 1 in the order x, y(, z):
    each output takes its taps (1 nearest, 2 linear or 4 cubic per dim) by index from x, weighted."""
    if mode not in GRID_MODES: raise Unsupported(f"GridSample mode {mode!r} (supported: {', '.join(GRID_MODES)})")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise Unsupported(f"GridSample padding_mode {padding_mode!r} (supported: zeros, border, reflection)")
    kind = GRID_MODES[mode]
    spatial = tuple(x.shape[2:])
    k = len(spatial)
    if grid.ndim != k + 2 or grid.shape[-1] != k or grid.shape[0] != x.shape[0]:
        raise ValueError(f"grid must be (N, *out, {k}) for an input of shape {tuple(x.shape)}, got "
                         f"{tuple(grid.shape)}")
    n, c = x.shape[:2]
    out = tuple(grid.shape[1:-1])
    q = math.prod(out)
    g = grid.cast(dtypes.float32).reshape(n, q, k)
    coords, bounds = [], []
    for i, size in enumerate(spatial):
        v = g[:, :, k - 1 - i]   # the grid's last component is the first spatial dim's
        pos = (v + 1) / 2 * (size - 1) if align_corners else ((v + 1) * size - 1) / 2
        if kind == "nearest": pos = pos.round()
        lo, hi = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
        # (border: only positions beyond the borders move, to the nearest pixel: a cubic tap of one between the
        # border and that pixel still weighs its neighbours)
        if padding_mode == "border": pos = ((pos < lo) | (pos > hi)).where(pos.maximum(0).minimum(size - 1), pos)
        elif padding_mode == "reflection": pos = _reflect(pos, lo, hi)
        coords.append(pos)
        bounds.append((lo, hi))
    # per dim: the taps' indices and weights
    taps: list[list[tuple[Tensor, Tensor | None]]] = []
    for pos in coords:
        if kind == "nearest":
            taps.append([(pos.trunc(), None)])
            continue
        base = pos.floor()
        t = pos - base
        weights = [1 - t, t] if kind == "linear" else _cubic_coeffs(t)
        offsets = [0, 1] if kind == "linear" else [-1, 0, 1, 2]
        taps.append([(base + o, w) for o, w in zip(offsets, weights)])
    flat = x.reshape(n, c, math.prod(spatial))
    strides = [math.prod(spatial[i + 1:]) for i in range(k)]
    total: Tensor | None = None
    for combo in itertools.product(*taps):
        lin: Tensor | None = None
        valid: Tensor | None = None
        weight: Tensor | None = None
        for i, (idx, w) in enumerate(combo):
            size = spatial[i]
            if padding_mode == "zeros":
                ok = (idx >= 0) & (idx <= size - 1)
                valid = ok if valid is None else valid & ok
                idx = idx.maximum(0).minimum(size - 1)
            elif padding_mode == "border": idx = idx.maximum(0).minimum(size - 1)
            else: idx = _reflect(idx, *bounds[i]).trunc().maximum(0).minimum(size - 1)
            part = idx.cast(dtypes.int32) * strides[i]
            lin = part if lin is None else lin + part
            if w is not None: weight = w if weight is None else weight * w
        assert lin is not None
        val = flat.gather(2, lin.reshape(n, 1, q).expand(n, c, q))
        if weight is not None: val = val * weight.reshape(n, 1, q).cast(x.dtype)
        if valid is not None: val = valid.reshape(n, 1, q).where(val, 0)
        total = val if total is None else total + val
    assert total is not None
    return total.reshape(n, c, *out).cast(x.dtype)
