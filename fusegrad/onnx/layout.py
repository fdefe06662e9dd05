"""Channels-last regions: a strided 2-D convolution and the pooling and elementwise ops after it computed with their
results stored as (N, H, W, C) instead of ONNX's (N, C, H, W).

Why: a strided convolution is vectorized along its output channels (along an output row each vector would gather
every other pixel). Stored channel-first, each vector of results is written as scattered scalars, and a max pool after
it (a ResNet stem) again gathers every other pixel of a row. Stored channels-last, the convolution writes whole
vectors and the pool reads and writes whole vectors of channels. Where the region ends, ops read the channels-last
data through a channel-first view (an elementwise op, a depthwise convolution, a mean), except a dense convolution and
a graph output, which get a copy into ONNX's layout: a convolution reading the data in place can get another kernel
built for it, several times slower for some sizes (a 32-channel 3x3 one over 32x32 images).

The values are the same: each op computes on a channel-first view of the channels-last data, only the order in which
the results are stored changes. The graph walk (`Graph.run`) keeps, beside each value, its channels-last form where
it has one (`Region`)."""
from __future__ import annotations

from typing import Any

from fusegrad import Tensor, dtypes

# ops that keep a channels-last value (their first input) in the region: per element, or per channel with the other
# inputs' values (a batch norm's statistics, a clip's bounds)
ELEMENTWISE = frozenset({"Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Elu", "Selu", "Celu",
                         "Tanh", "Softplus", "Identity", "BatchNormalization"})
POOLS = frozenset({"MaxPool", "AveragePool"})


def to_last(t: Tensor) -> Tensor: return t.permute(0, 2, 3, 1)


def to_first(t: Tensor) -> Tensor: return t.permute(0, 3, 1, 2)


def _plain_image(t: Any) -> bool:
    """A float32 (N, C, H, W) Tensor of int sizes."""
    return type(t) is Tensor and t.dtype == dtypes.float32 and t.ndim == 4 and \
        all(type(d) is int for d in t.shape) and isinstance(t.device, str)


# the fewest results (N * C * H * W, as if unpadded) of a convolution that begins a region: below, the copy into ONNX's
# layout where the region ends costs about what the layout saves (the ResNet-style CNN at batch 1, 16x16x16 results)
MIN_RESULTS = 16384


def starts_region(op_type: str, args: list[Any], attrs: dict[str, Any], min_results: int = MIN_RESULTS) -> bool:
    """Whether a node begins a channels-last region: a 2-D convolution with a stride above 1, a window larger than one
    pixel (a strided 1x1 convolution is a stride-1 one of the pixels it reads), one group and whole vectors of output
    channels, of float32 images of int sizes, with at least `min_results` results (none where it reads a value of a
    region: it then needs no copy)."""
    if op_type != "Conv" or len(args) < 2 or not _plain_image(args[0]) or not _plain_image(args[1]): return False
    (n, _, h, w), (cout, _, kh, kw) = args[0].shape, args[1].shape
    strides = tuple(attrs.get("strides") or (1, 1))
    if len(strides) != 2 or max(strides) == 1 or (kh, kw) == (1, 1) or cout % 8 or attrs.get("group", 1) != 1:
        return False
    return n * cout * -(-h // strides[0]) * -(-w // strides[1]) >= min_results


# ops that read an image with a dense window (every input channel): these get a copy in ONNX's layout (a kernel built
# for it), where reading channels-last data in place could make another, slower one
DENSE_WINDOWS = frozenset({"Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "DeformConv"})


def copied_names(nodes: list[Any], outputs: list[str]) -> set[str]:
    """The values that, stored channels-last, are also copied into ONNX's layout where the region ends: a graph output,
    and what a dense convolution reads (one that begins a region reads the channels-last data and leaves the copy
    unused, so unmade). Other ops read the channels-last data in place, through a channel-first view."""
    out = set(outputs)
    for n in nodes:
        if n.op_type in DENSE_WINDOWS and n.attrs.get("group", 1) == 1 and n.inputs: out.add(n.inputs[0])
    return out


class Region:
    """The channels-last forms of a graph's values, by name, while `Graph.run` walks its nodes. `copied`: the names
    whose value is copied into ONNX's layout for the ops that read it (`copied_names`)."""

    def __init__(self, copied: set[str]) -> None:
        self.last: dict[str, Tensor] = {}
        self.copied = copied

    def inputs(self, op_type: str, names: list[str], args: list[Any], attrs: dict[str, Any]) -> list[Any] | None:
        """The node's arguments when it computes in the region (its first input read from the channels-last data, as a
        channel-first view), None where it computes as usual."""
        if not names or names[0] not in self.last:
            return list(args) if starts_region(op_type, args, attrs) else None
        if op_type not in ELEMENTWISE and op_type not in POOLS and not starts_region(op_type, args, attrs, 0):
            return None
        # (a window op reads the data stored channels-last; an elementwise op fuses into whatever reads it)
        src = self.last[names[0]]
        first = to_first(src) if op_type in ELEMENTWISE else to_first(src.contiguous())
        return [first] + list(args[1:])

    def output(self, name: str, out: Any) -> Any:
        """Record a region node's result; returns the value ops outside the region read: a channel-first view of the
        data stored channels-last, or a copy of it in ONNX's layout (made only if read)."""
        if not _plain_image(out): return out
        self.last[name] = to_last(out)
        view = to_first(self.last[name].contiguous())
        return view.contiguous() if name in self.copied else view


def weight_channels_last(w: Tensor) -> Tensor | None:
    """A float32 (Cout, Cin, kh, kw) convolution weight copied with its output channels innermost, as a (Cout, Cin,
    kh, kw) view of the copy; None for other tensors. A convolution vectorized along its output channels (small
    images, strided ones) then loads its weights as contiguous vectors, where stored as ONNX lays them out they were
    copied (packed) in every call, or gathered lane by lane. The copy is lazy, made from the weight as it is in each
    call (an initializer may change between calls): under `OnnxRunner.jit()` it depends on the initializers alone,
    so TinyJit's prune makes it once, as onnxruntime lays a model's weights out once when it loads it."""
    if not _plain_image(w): return None
    return w.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
