"""Channels-last regions: a strided 2-D convolution and the pooling and elementwise ops after it computed with their
results stored as (N, H, W, C) instead of ONNX's (N, C, H, W).

Why: a strided convolution is vectorized along its output channels (along an output row each vector would gather
every other pixel). Stored channel-first, each vector of results is written as scattered scalars, and a max pool after
it (a ResNet stem) again gathers every other pixel of a row. Stored channels-last, the convolution writes whole
vectors and the pool reads and writes whole vectors of channels. Where the region ends (a consumer that is not one of
these ops, or a graph output) its value is copied once into ONNX's layout, which other kernels read as they always do.

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


def starts_region(op_type: str, args: list[Any], attrs: dict[str, Any]) -> bool:
    """Whether a node begins a channels-last region: a 2-D convolution with a stride above 1, a window larger than one
    pixel (a strided 1x1 convolution is a stride-1 one of the pixels it reads), one group and whole vectors of output
    channels, of float32 images of int sizes."""
    if op_type != "Conv" or len(args) < 2 or not _plain_image(args[0]) or not _plain_image(args[1]): return False
    cout, kernel = args[1].shape[0], tuple(args[1].shape[2:])
    return attrs.get("group", 1) == 1 and any(s > 1 for s in attrs.get("strides") or ()) and kernel != (1, 1) and \
        cout % 8 == 0


class Region:
    """The channels-last forms of a graph's values, by name, while `Graph.run` walks its nodes."""

    def __init__(self) -> None:
        self.last: dict[str, Tensor] = {}

    def inputs(self, op_type: str, names: list[str], args: list[Any], attrs: dict[str, Any]) -> list[Any] | None:
        """The node's arguments when it computes in the region (its first input read from the channels-last data, as a
        channel-first view), None where it computes as usual."""
        if not names or names[0] not in self.last:
            return list(args) if starts_region(op_type, args, attrs) else None
        if op_type not in ELEMENTWISE and op_type not in POOLS and not starts_region(op_type, args, attrs): return None
        # (a window op reads the data stored channels-last; an elementwise op fuses into whatever reads it)
        src = self.last[names[0]]
        first = to_first(src) if op_type in ELEMENTWISE else to_first(src.contiguous())
        return [first] + list(args[1:])

    def output(self, name: str, out: Any) -> Any:
        """Record a region node's result; the value other ops read: its copy in ONNX's layout (made only if read)."""
        if not _plain_image(out): return out
        self.last[name] = to_last(out)
        return to_first(self.last[name].contiguous()).contiguous()
