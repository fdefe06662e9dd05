"""Channels-last regions: a strided 2-D convolution and the pooling and elementwise ops after it computed with their
results stored as (N, H, W, C) instead of ONNX's (N, C, H, W).

Why: a strided convolution is vectorized along its output channels (along an output row each vector would gather
every other pixel). Stored channel-first, each vector of results is written as scattered scalars, and a max pool after
it (a ResNet stem) again gathers every other pixel of a row. Stored channels-last, the convolution writes whole
vectors and the pool reads and writes whole vectors of channels. Where the region ends, ops read the channels-last
data through a channel-first view (an elementwise op, a depthwise convolution, a mean), except a dense convolution and
a graph output, which get a copy into ONNX's layout: a convolution reading the data in place can get another kernel
built for it, several times slower for some sizes (a 32-channel 3x3 one over 32x32 images). A dense convolution on
short rows (`continues_region`) and a binary op whose image inputs are all the region's (a residual add) continue the
region instead.

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
# ops of several inputs, each broadcast to the result's shape, that keep the region when two or more of their inputs are
# its values (a residual join) and the others broadcast along the image (`Region._binary_inputs`)
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "PRelu"})


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


# the widest output row of a stride-1 convolution that continues a region: the code generator vectorizes a
# convolution on rows shorter than two AVX-512 vectors along its output channels either way, and stored channel-first
# each vector of results is written as scattered scalars. (On wider rows, channel-first data gets its vectors along
# the row; read and stored channels-last, 40 channels over 2x24x30x30 ran twice as long.)
CONTINUE_MAX_ROW = 32
# output channels of a convolution that continues a region: whole AVX-512 vectors (24 or 40 channels channels-last
# took half-vectors and ran up to twice as long)
CONTINUE_CHANNELS = 16


def continues_region(op_type: str, args: list[Any], attrs: dict[str, Any]) -> bool:
    """Whether a node reading a region's value (its first input) computes in the region: an elementwise op or a pool,
    a strided convolution that could begin one (`starts_region`), or a dense 2-D convolution of float32 images with
    whole vectors of output channels (`CONTINUE_CHANNELS`) over output rows narrower than `CONTINUE_MAX_ROW`, unless
    conv2d takes Winograd's algorithm for it (a 3x3 stride-1 window over 64 channels or more: its input transform
    gathers lane by lane from channels-last data). Read and stored channels-last, the convolution writes whole vectors
    of channels, and the copy into ONNX's layout before it is not made (the ResNet-style CNN at batch 16: its
    stride-1 convolutions 6-12% faster, a 6 us copy kernel gone)."""
    if op_type in ELEMENTWISE or op_type in POOLS or starts_region(op_type, args, attrs, 0): return True
    if op_type != "Conv" or len(args) < 2 or not _plain_image(args[0]) or not _plain_image(args[1]): return False
    (_, cin, _, w), (cout, _, kh, kw) = args[0].shape, args[1].shape
    strides, pads = tuple(attrs.get("strides") or (1, 1)), tuple(attrs.get("pads") or (0, 0, 0, 0))
    dilations = tuple(attrs.get("dilations") or (1, 1))
    if attrs.get("group", 1) != 1 or cout % CONTINUE_CHANNELS or len(strides) != 2 or len(pads) != 4 or \
            len(dilations) != 2 or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return False
    from fusegrad.tensor.nn import WINO_MIN_CHANNELS
    if (kh, kw) == (3, 3) and strides == (1, 1) and dilations == (1, 1) and min(cin, cout) >= WINO_MIN_CHANNELS:
        return False
    row = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    return 0 < row < CONTINUE_MAX_ROW


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
        self.views: dict[str, Tensor] = {}  # channel-first views of the data stored channels-last
        self.copied = copied

    def inputs(self, op_type: str, names: list[str], args: list[Any], attrs: dict[str, Any]) -> list[Any] | None:
        """The node's arguments when it computes in the region (its first input read from the channels-last data, as a
        channel-first view), None where it computes as usual."""
        if op_type in BINARY: return self._binary_inputs(names, args)
        if not names or names[0] not in self.last:
            return list(args) if starts_region(op_type, args, attrs) else None
        if not continues_region(op_type, args, attrs): return None
        # (a window op reads the data stored channels-last; an elementwise op fuses into whatever reads it)
        src = self.last[names[0]]
        first = to_first(src) if op_type in ELEMENTWISE else to_first(src.contiguous())
        return [first] + list(args[1:])

    def _binary_inputs(self, names: list[str], args: list[Any]) -> list[Any] | None:
        """A binary op's arguments when it computes in the region: two or more of its inputs are the region's values
        (a residual join) and the others broadcast along the image (a per-channel scale). Each is read from the
        data stored channels-last through a channel-first view, and the op's kernel stores channels-last. None
        otherwise: an op with one of the region's values computes as usual, reading it in place."""
        if len(names) != len(args) or sum(n in self.last for n in names) < 2 or \
                not all(isinstance(a, Tensor) and a.ndim <= 4 for a in args):
            return None
        out = []
        for name, a in zip(names, args):
            if name in self.last: out.append(self.views[name])
            # (an input that varies along the image but isn't the region's would be read transposed)
            elif (1, 1, *a.shape)[-2:] != (1, 1): return None
            else: out.append(a)
        return out

    def output(self, name: str, out: Any) -> Any:
        """Record a region node's result; returns the value ops outside the region read: a channel-first view of the
        data stored channels-last, or a copy of it in ONNX's layout (made only if read)."""
        if not _plain_image(out): return out
        self.last[name] = to_last(out)
        view = self.views[name] = to_first(self.last[name].contiguous())
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
