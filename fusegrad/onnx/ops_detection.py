"""The ops of detection models: NonMaxSuppression, RoiAlign and DeformConv.

NonMaxSuppression's output length depends on the scores, so it runs on the host: it reads its boxes and scores (known
there, or read back from the device) and makes a host tensor. Under TinyJit a read would freeze the capture's values,
so there it takes only boxes and scores known on the host. RoiAlign runs on the device: its bilinear samples are
weights over the rows and the columns of the feature map."""
from __future__ import annotations

from typing import Sequence

import numpy as np

import fusegrad.engine.realize as _realize
from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import Context, host_value, is_float, known_value, op, with_host


def _read(t: Tensor, what: str) -> np.ndarray:
    """A tensor's values on the host; under a TinyJit capture only those known there (a read would be frozen)."""
    known = known_value(t)
    if known is not None: return known
    if _realize.capturing:
        raise Unsupported(f"{what} computed on the device under TinyJit: the output's length depends on its values, "
                          "which a capture can't replay (call the runner without TinyJit)")
    return host_value(t)


def _corners(b: np.ndarray, center_point_box: int) -> tuple[np.ndarray, ...]:
    """(y_min, x_min, y_max, x_max) of boxes (..., 4) given as corners in either order or as centers and sizes."""
    if center_point_box:
        xc, yc, w, h = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
        return yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2
    y1, x1, y2, x2 = b[..., 0], b[..., 1], b[..., 2], b[..., 3]
    return np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)


def _suppresses(boxes: np.ndarray, center_point_box: int, iou_threshold: float) -> np.ndarray:
    """(N, N) bool: box i suppresses box j (their IoU is above the threshold; empty boxes suppress nothing)."""
    y0, x0, y1, x1 = _corners(boxes, center_point_box)
    iy = np.minimum(y1[:, None], y1[None, :]) - np.maximum(y0[:, None], y0[None, :])
    ix = np.minimum(x1[:, None], x1[None, :]) - np.maximum(x0[:, None], x0[None, :])
    inter = np.where((iy > 0) & (ix > 0), iy * ix, 0)
    area = (x1 - x0) * (y1 - y0)
    union = area[:, None] + area[None, :] - inter
    ok = (inter > 0) & (area[:, None] > 0) & (area[None, :] > 0) & (union > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return ok & (np.where(ok, inter / np.where(ok, union, 1), 0) > iou_threshold)


@op("NonMaxSuppression")
def non_max_suppression(boxes: Tensor, scores: Tensor, max_output_boxes_per_class: Tensor | None = None,
                        iou_threshold: Tensor | None = None, score_threshold: Tensor | None = None, *,
                        center_point_box: int = 0) -> Tensor:
    """(selected, 3) int64 rows of (batch, class, box): per batch and class, the boxes by descending score (ties: the
    lower index first), each kept unless a kept one overlaps it by an IoU above the threshold."""
    if center_point_box not in (0, 1): raise ValueError(f"center_point_box must be 0 or 1, got {center_point_box}")
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise ValueError(f"boxes must be (batches, boxes, 4), got shape {tuple(boxes.shape)}")
    if scores.ndim != 3 or scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
        raise ValueError(f"scores must be (batches, classes, boxes) = ({boxes.shape[0]}, C, {boxes.shape[1]}), got "
                         f"shape {tuple(scores.shape)}")
    def one(t: Tensor, what: str) -> float:
        v = _read(t, what).reshape(-1)
        if v.size != 1: raise ValueError(f"{what} must hold one value, got shape {tuple(t.shape)}")
        return v[0].item()
    limit = max(int(one(max_output_boxes_per_class, "max_output_boxes_per_class")), 0) \
        if max_output_boxes_per_class is not None else 0
    iou = float(one(iou_threshold, "iou_threshold")) if iou_threshold is not None else 0.0
    if not 0.0 <= iou <= 1.0: raise ValueError(f"iou_threshold must be in [0, 1], got {iou}")
    min_score = float(one(score_threshold, "score_threshold")) if score_threshold is not None else None
    rows: list[tuple[int, int, int]] = []
    if limit > 0 and boxes.shape[1] > 0:
        b_all, s_all = _read(boxes, "boxes"), _read(scores, "scores")
        for b in range(b_all.shape[0]):
            suppress = _suppresses(b_all[b], center_point_box, iou)
            for c in range(s_all.shape[1]):
                s = s_all[b, c]
                # descending score, the lower index first among equal scores (a stable sort of the negated scores)
                order = np.argsort(-s, kind="stable")
                if min_score is not None: order = order[s[order] > min_score]
                kept: list[int] = []
                for i in order:
                    if len(kept) >= limit: break
                    if not kept or not suppress[kept, i].any(): kept.append(int(i))
                rows.extend((b, c, i) for i in kept)
    out = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return with_host(Tensor(out), out)


def _axis_weights(start: Tensor, bin_size: Tensor, grid: Tensor, n_bins: int, n_grid: int, size: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The samples along one axis of every roi: (R, n_bins, n_grid) low and high indices, their weights (0 where a
    sample lies outside the map), and (R, 1, n_grid) whether a sample is in the roi's own grid (grids adapt to rois)."""
    p = Tensor.arange(n_bins).reshape(1, -1, 1).cast(start.dtype)
    i = Tensor.arange(n_grid).reshape(1, 1, -1).cast(start.dtype)
    start, bin_size, grid = start.reshape(-1, 1, 1), bin_size.reshape(-1, 1, 1), grid.reshape(-1, 1, 1)
    pos = start + p * bin_size + (i + 0.5) * bin_size / grid.maximum(1).cast(start.dtype)
    inside = (pos >= -1.0) & (pos <= size)
    pos = pos.maximum(0)
    low = pos.floor().cast(dtypes.int32)
    at_end = low >= size - 1
    low = at_end.where(size - 1, low)
    high = at_end.where(size - 1, low + 1)
    pos = at_end.where(low.cast(pos.dtype), pos)
    frac = pos - low.cast(pos.dtype)
    return low, high, inside.where(1 - frac, 0), inside.where(frac, 0), i < grid.cast(i.dtype)


@op("RoiAlign")
def roi_align(x: Tensor, rois: Tensor, batch_indices: Tensor, *, ctx: Context,
              coordinate_transformation_mode: str | None = None, mode: str = "avg", output_height: int = 1,
              output_width: int = 1, sampling_ratio: int = 0, spatial_scale: float = 1.0) -> Tensor:
    """(R, C, output_height, output_width): each roi's bins, the average (or maximum) of bilinear samples on a grid of
    sampling_ratio^2 per bin (0: ceil(roi size / bins) per axis)."""
    # opset 10 had no attribute and its rois' pixels are not shifted by half a pixel
    ctm = coordinate_transformation_mode or ("half_pixel" if ctx.opset >= 16 else "output_half_pixel")
    if ctm not in ("half_pixel", "output_half_pixel"):
        raise ValueError(f"coordinate_transformation_mode must be half_pixel or output_half_pixel, got {ctm!r}")
    if mode not in ("avg", "max"): raise ValueError(f"mode must be avg or max, got {mode!r}")
    if output_height < 1 or output_width < 1 or sampling_ratio < 0:
        raise ValueError(f"output_height {output_height} and output_width {output_width} must be positive and "
                         f"sampling_ratio {sampling_ratio} not negative")
    if x.ndim != 4 or not is_float(x): raise ValueError(f"X must be a float (N, C, H, W), got {x.dtype} {x.shape}")
    if rois.ndim != 2 or rois.shape[1] != 4: raise ValueError(f"rois must be (R, 4), got shape {tuple(rois.shape)}")
    if tuple(batch_indices.shape) != (rois.shape[0],):
        raise ValueError(f"batch_indices must be ({rois.shape[0]},), got shape {tuple(batch_indices.shape)}")
    h, w = x.shape[2], x.shape[3]
    work = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    r = rois.cast(work) * spatial_scale - (0.5 if ctm == "half_pixel" else 0.0)
    y0, x0 = r[:, 1], r[:, 0]
    rh, rw = r[:, 3] - y0, r[:, 2] - x0
    if ctm == "output_half_pixel": rh, rw = rh.maximum(1.0), rw.maximum(1.0)
    bh, bw = rh / output_height, rw / output_width
    if sampling_ratio > 0:
        gh = gw = Tensor.full((rois.shape[0],), sampling_ratio, dtype=dtypes.int32)
        nh = nw = sampling_ratio
    else:
        gh, gw = bh.ceil().maximum(0).cast(dtypes.int32), bw.ceil().maximum(0).cast(dtypes.int32)
        # the grid adapts to each roi: its largest size sets the static shape of the samples
        grids = _read(Tensor.stack(gh, gw), "rois (with sampling_ratio 0)") if rois.shape[0] else np.zeros((2, 1))
        nh, nw = max(int(grids[0].max(initial=0)), 1), max(int(grids[1].max(initial=0)), 1)
    ylo, yhi, wylo, wyhi, ym = _axis_weights(y0, bh, gh, output_height, nh, h)
    xlo, xhi, wxlo, wxhi, xm = _axis_weights(x0, bw, gw, output_width, nw, w)
    feats = x.cast(work)[batch_indices.cast(dtypes.int32)]  # (R, C, H, W)

    def onehot(idx: Tensor, n: int) -> Tensor: return (idx.unsqueeze(-1) == Tensor.arange(n)).cast(work)
    if mode == "avg":
        # a sample's value is separable: sum over rows and columns of (row weights) x (column weights) x X
        ay = (onehot(ylo, h) * wylo.unsqueeze(-1) + onehot(yhi, h) * wyhi.unsqueeze(-1))
        ay = (ay * ym.unsqueeze(-1)).sum(2)  # (R, oh, H)
        ax = (onehot(xlo, w) * wxlo.unsqueeze(-1) + onehot(xhi, w) * wxhi.unsqueeze(-1))
        ax = (ax * xm.unsqueeze(-1)).sum(2)  # (R, ow, W)
        out = ay.unsqueeze(1) @ feats @ ax.unsqueeze(1).transpose(-1, -2)
        count = (gh * gw).maximum(1).cast(work).reshape(-1, 1, 1, 1)
        return (out / count).cast(x.dtype)
    # max: the largest of a sample's four weighted corners, then the largest over the bin's samples
    best = None
    for yi, wy in ((ylo, wylo), (yhi, wyhi)):
        rows = onehot(yi, h).flatten(1, 2).unsqueeze(1) @ feats  # (R, C, oh * nh, W)
        for xi, wx in ((xlo, wxlo), (xhi, wxhi)):
            v = rows @ onehot(xi, w).flatten(1, 2).unsqueeze(1).transpose(-1, -2)  # (R, C, oh * nh, ow * nw)
            v = v.reshape(v.shape[0], v.shape[1], output_height, nh, output_width, nw)
            v = v * wy.reshape(-1, 1, output_height, nh, 1, 1) * wx.reshape(-1, 1, 1, 1, output_width, nw)
            best = v if best is None else best.maximum(v)
    assert best is not None
    valid = ym.reshape(-1, 1, 1, nh, 1, 1) & xm.reshape(-1, 1, 1, 1, 1, nw)
    out = valid.where(best, -float("inf")).max((3, 5))
    return (out == -float("inf")).where(0, out).cast(x.dtype)


@op("DeformConv")
def deform_conv(x: Tensor, w: Tensor, offset: Tensor, b: Tensor | None = None, mask: Tensor | None = None, *,
                dilations: Sequence[int] | None = None, group: int = 1, kernel_shape: Sequence[int] | None = None,
                offset_group: int = 1, pads: Sequence[int] | None = None,
                strides: Sequence[int] | None = None) -> Tensor:
    """A 2-D convolution whose every kernel tap reads the input at its place moved by `offset` (bilinear, 0 outside
    the input) and weighted by `mask`: the taps are gathered into columns, then one matmul per group."""
    if x.ndim != 4: raise Unsupported(f"DeformConv of {x.ndim - 2}-D inputs (2-D only)")
    n, c, h, wd = x.shape
    oc = w.shape[0]
    kh, kw = tuple(kernel_shape) if kernel_shape is not None else tuple(w.shape[2:])
    dh, dw = tuple(dilations) if dilations is not None else (1, 1)
    sh, sw = tuple(strides) if strides is not None else (1, 1)
    pt, pl = (tuple(pads) if pads is not None else (0, 0, 0, 0))[:2]
    if group < 1 or offset_group < 1 or c != w.shape[1] * group or oc % group or c % offset_group:
        raise ValueError(f"channels {c}, weight shape {tuple(w.shape)}, group {group} and offset_group "
                         f"{offset_group} don't fit")
    g = offset_group
    oh, ow = offset.shape[2], offset.shape[3]
    if offset.ndim != 4 or offset.shape[:2] != (n, g * kh * kw * 2):
        raise ValueError(f"offset must be ({n}, {g * kh * kw * 2}, out_h, out_w), got shape {tuple(offset.shape)}")
    f32 = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
    off = offset.cast(f32).reshape(n, g, kh, kw, 2, oh, ow)
    ys = (Tensor.arange(oh) * sh - pt).reshape(1, 1, 1, 1, oh, 1).cast(f32) + \
        (Tensor.arange(kh) * dh).reshape(1, 1, kh, 1, 1, 1).cast(f32) + off[:, :, :, :, 0]
    xs = (Tensor.arange(ow) * sw - pl).reshape(1, 1, 1, 1, 1, ow).cast(f32) + \
        (Tensor.arange(kw) * dw).reshape(1, 1, 1, kw, 1, 1).cast(f32) + off[:, :, :, :, 1]
    m = mask.cast(f32).reshape(n, g, kh, kw, oh, ow) if mask is not None else None
    y0, x0 = ys.floor(), xs.floor()
    fy, fx = ys - y0, xs - x0
    p = kh * kw * oh * ow
    src = x.cast(f32).reshape(n, g, c // g, h * wd)
    cols: Tensor | None = None
    for cy, wy in ((y0, 1 - fy), (y0 + 1, fy)):
        for cx, wx in ((x0, 1 - fx), (x0 + 1, fx)):
            inside = (cy >= 0) & (cy <= h - 1) & (cx >= 0) & (cx <= wd - 1)
            weight = inside.where(wy * wx, 0.0)
            if m is not None: weight = weight * m
            idx = (cy.clip(0, h - 1) * wd + cx.clip(0, wd - 1)).cast(dtypes.int32).reshape(n, g, 1, p)
            v = src.gather(3, idx.expand(n, g, c // g, p)) * weight.reshape(n, g, 1, p)
            cols = v if cols is None else cols + v
    assert cols is not None
    cols = cols.reshape(n, group, (c // group) * kh * kw, oh * ow)
    out = w.cast(f32).reshape(1, group, oc // group, (c // group) * kh * kw) @ cols
    out = out.reshape(n, oc, oh, ow)
    if b is not None: out = out + b.cast(f32).reshape(1, oc, 1, 1)
    return out.cast(x.dtype)
