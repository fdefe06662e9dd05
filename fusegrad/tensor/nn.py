"""Neural-network functions: convolution, pooling, resizing, padding modes, losses, attention.

Windows (convolution, pooling, unfold) are views built from movement ops only (pad/reshape/expand/shrink/permute), so
the reduction over a window fuses with whatever produced the input: no im2col buffer is ever written."""
from __future__ import annotations
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence
from fusegrad.dtype import ConstType, DType, dtypes, least_upper_dtype, least_upper_float, sum_acc_dtype, to_dtype
from fusegrad.device import Device
from fusegrad.helpers import IM2COL, WINO, pads_cheaply, prod
from fusegrad.uop.ops import GroupOp, Ops, UOp, is_symbolic, ssimplify, with_src
from fusegrad.tensor.composite import composite
from fusegrad.tensor.creation import check_size

if TYPE_CHECKING:
    from fusegrad.tensor import Tensor

_REDUCTIONS = ("none", "mean", "sum")

# An operation whose graph is a function of its operands' shapes, dtypes and device and of its settings (a loss, a
# linear layer) builds the same graph over new operands at every training step. So it is built once over placeholders
# (fresh BUFFERs, standing for the operands) and made again over each call's operands: the same nodes the tensor
# operations would make (hash-consing), for operands whose own op no construction looks into (not a view but a
# buffer's reshape, a constant or sharded). Making a template costs about two builds, so a key gets one when it comes
# back: an operation seen once (a new shape each call) is built as it is.
_templates: dict[tuple, tuple[tuple[UOp, ...], UOp, list[UOp]] | bool | None] = {}
TEMPLATES_SIZE = 256

def _from_template(build: Callable[..., Tensor], operands: tuple[Tensor, ...], settings: tuple = ()) -> Tensor | None:
    """build(*operands, *settings) from its template (made on the second call of its key), or None where the operands
    don't fit one or the key is new (the caller builds the graph itself). `build`'s graph may depend on nothing but
    its operands' shapes, dtypes and device, the default dtypes and `settings`."""
    from fusegrad.tensor import _plain_init, _sharding_used
    from fusegrad.uop.graph import new_buffer
    Tensor = _tensor_cls()
    # (while sources are tracked, each operation is built, so each notes its line)
    if _sharding_used or Tensor.__init__ is not _plain_init: return None
    uops = tuple(t.uop for t in operands)
    if type(dev := uops[0].device) is not str: return None
    for u in uops:
        if _opaque(u) or u.device != dev or not all(type(n) is int for n in u.shape): return None
    key = (build, *[(u.shape, u.dtype) for u in uops], dev, dtypes.default_float, dtypes.default_int, *settings)
    # (the key's entry: None where it can't have a template, False where it was seen once)
    try: made = _templates.get(key, True)
    except TypeError: return None   # (a setting that isn't hashable: a list, a Tensor)
    if made is True:
        if len(_templates) >= TEMPLATES_SIZE: _templates.clear()
        _templates[key] = False
        return None
    if made is False:
        device = UOp(Ops.DEVICE, arg=dev)
        bufs = tuple(new_buffer(device, prod(u.shape), u.dtype) for u in uops)
        holders = tuple(b if b.shape == u.shape else b.reshape(u.shape) for b, u in zip(bufs, uops))
        root = build(*[Tensor(h) for h in holders], *settings).uop
        # the nodes over a placeholder, sources first (made again per call). A construction that looked through a
        # holder to its BUFFER (a reshape folded into it) reads the placeholder itself: then no template
        reached, over, sound = set(holders), [], True
        for w in root.toposort(gate=lambda w: w not in holders):
            if w in reached: continue
            if w in bufs: sound = False
            if any(s in reached for s in w.src):
                reached.add(w)
                over.append(w)
        for w in over: w.shape   # (computed once: a node made again takes its template node's shape)
        root.device   # (and the result its device)
        made = _templates[key] = (holders, root, over) if sound else None
    if made is None: return None
    holders, root, over = made
    new = dict(zip(holders, uops))
    get = new.get
    for w in over:
        n = new[w] = with_src(w, tuple(map(get, w.src, w.src)))
        # (the result's shape is asked at once, by backward's seed or the next operation: without this it was
        # computed node by node)
        if "_shape" not in (d := n.__dict__): d["_shape"] = w.__dict__["_shape"]
    if (result := new.get(root, root)) is not root:
        if "_device" not in (d := result.__dict__): d["_device"] = root.__dict__["_device"]
        # (what a realize of the result needs to find its graph's walk without walking it: tensor/__init__.py
        # _template_walk. The nodes below the result only: with itself in the list, the node would be a reference
        # cycle, its graph and the buffers it reads freed only by the garbage collector)
        d["_template"] = (made, uops, [n for w in over if (n := new[w]) is not result])
    return Tensor(result)

def templated(build: Callable[..., Tensor], operands: tuple[Tensor, ...], settings: tuple = ()) -> Tensor:
    """build(*operands, *settings), from its template where the operands fit one (_from_template)."""
    made = _from_template(build, operands, settings)
    return made if made is not None else build(*operands, *settings)

def linear_layer(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T + bias: a Linear layer's forward (one COMPOSITE node where it can be: tensor/composite.py)."""
    return _linear_node(x, weight) if bias is None else _linear_node(x, weight, bias)

@composite(shaped=True)
def _linear_node(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    # (expanded from its template: a schedule cache miss or a derivative makes the graph again over new operands)
    return templated(_linear_graph, (x, weight) if bias is None else (x, weight, bias))

def _linear_graph(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.linear(weight.transpose(), bias)

def _conv_graph_with_bias(x: Tensor, weight: Tensor, bias: Tensor, *settings) -> Tensor:
    return x._conv_graph(weight, bias, *settings)

def _conv_graph_without_bias(x: Tensor, weight: Tensor, *settings) -> Tensor:
    return x._conv_graph(weight, None, *settings)

# operands a construction may look into (fold a reshape into, compute with a constant's value): no template for them,
# but for a realized tensor's reshape of its buffer, which is what a placeholder's holder is
_OPAQUE = frozenset(GroupOp.Movement) | {Ops.CONST, Ops.MULTI}
_RESHAPE, _BUFFER = Ops.RESHAPE, Ops.BUFFER
def _opaque(u: UOp) -> bool: return (op := u.op) in _OPAQUE and not (op is _RESHAPE and u.src[0].op is _BUFFER)

def _tensor_cls() -> type[Tensor]:
    from fusegrad.tensor import Tensor
    return Tensor

def _int_tuple(x: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    """An int broadcast to n dims, or a sequence of exactly n ints."""
    t = (x,) * n if isinstance(x, int) else tuple(x)
    if len(t) != n or any(not isinstance(v, int) or isinstance(v, bool) for v in t):
        raise ValueError(f"{name} must be an int or a sequence of {n} ints, got {x!r}")
    return t

def _flat_pads(padding: int | Sequence[int], n: int) -> list[int]:
    """Padding of the last n dims in torch's flat form (left, right of the last dim, then the dim before...): from an
    int, one int per dim (symmetric), or already 2*n ints per side."""
    if isinstance(padding, int): return [padding] * (2 * n)
    p = list(padding)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in p) or len(p) not in (n, 2 * n):
        raise ValueError(f"padding must be an int or a sequence of {n} or {2 * n} ints, got {padding!r}")
    return p if len(p) == 2 * n else [v for v in p for _ in range(2)][::-1]

def _side_pairs(flat: list[int]) -> list[tuple[int, int]]:
    """Flat torch padding -> (before, after) per dim in dim order."""
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)][::-1]

def _first_max(win: Tensor, out: Tensor, n: int, position: Tensor) -> Tensor:
    """`position` (of win's shape, at most some big value) of each window's first maximum in row-major window order
    (over win's last n axes; a nan counts as the maximum)."""
    hit = win == out.reshape(out.shape + (1,) * n)
    if dtypes.is_float(win.dtype): hit = hit | win.isnan()
    return hit.where(position, dtypes.max(dtypes.int32)).min(tuple(range(-n, 0)))

@dataclass(frozen=True)
class _MaxPoolGradient:
    """max_pool2d's gradient rule (ins: the input): each window's gradient goes to its first maximum in row-major
    window order, as torch's (a max reduction's own rule would share it among tied maxima)."""
    pure: ClassVar[bool] = True
    geo: tuple   # _pool_setup's geometry

    def __call__(self, grad: UOp, ins: tuple[UOp]) -> tuple[UOp | None]:
        from fusegrad.gradient import compute_gradient
        T = _tensor_cls()
        x, n = T(ins[0]), len(self.geo[0])
        low = float("-inf") if dtypes.is_float(x.dtype) else dtypes.min(x.dtype)
        win = x._windows(*self.geo, value=low)
        kernel = self.geo[0]
        local = T.arange(prod(kernel), dtype=dtypes.int32, device=x.device).reshape(kernel)
        first = _first_max(win, win.max(tuple(range(-n, 0))), n, local)
        picked = (local == first.reshape(first.shape + (1,) * n)).where(T(grad).reshape(grad.shape + (1,) * n), 0.0)
        # (computed into a buffer: a batch norm's gradient reads it in several reductions, each of which would
        # recompute the windows and their first maxima)
        g = compute_gradient(win.uop, picked.cast(x.dtype).uop, {ins[0]}).get(ins[0])
        return (None if g is None else T(g).contiguous().uop,)

@dataclass(frozen=True)
class _ConvGradient:
    """conv2d's gradient rule. The input's gradient is a transposed convolution, i.e. a convolution of the same fast
    kind as the forward (differentiating the overlapping-window view instead gives index math that doesn't vectorize:
    80x slower); the weight's is the sum over the windows of the input times the output gradient. Compared by value,
    so a training step's graph is the same every step (the schedule cache keys on it). `pure`: the gradients depend
    on nothing but the arguments, so the gradient cache may serve them again."""
    pure: ClassVar[bool] = True
    groups: int
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...]   # flat, torch's order

    def __call__(self, grad: UOp, ins: tuple[UOp, ...]) -> tuple[UOp, UOp]:
        T = _tensor_cls()
        g, x, w = T(grad), T(ins[0]), T(ins[1])
        n, bs, (cout, cin), hw = len(self.stride), x.shape[0], w.shape[:2], w.shape[2:]
        i_, o_, pairs = x.shape[2:], g.shape[2:], _side_pairs(list(self.padding))
        # the extra input rows the forward's windows never reached (output_padding) get a zero gradient
        out_pad = [i - ((o - 1) * s + d * (k - 1) + 1 - b - a)
                   for i, o, s, d, k, (b, a) in zip(i_, o_, self.stride, self.dilation, hw, pairs)]
        gx = g.conv_transpose2d(w, groups=self.groups, stride=self.stride, dilation=self.dilation,
                                padding=list(self.padding), output_padding=out_pad)
        rcout = cout // self.groups
        if any(s > 1 for s in self.stride) and all(d == 1 for d in self.dilation) and \
                all(isinstance(v, int) for v in i_ + hw):
            xw = _phase_windows(x.pad(list(self.padding)), self.stride, hw, o_)
        else: xw = x.pad(list(self.padding))._pool(hw, self.stride, self.dilation)  # (bs, cin_, *out, *hw)
        xw = xw.reshape((bs, self.groups, 1, cin) + o_ + hw)
        gr = g.reshape((bs, self.groups, rcout, 1) + o_ + (1,) * n)
        gw = (xw.cast(g.dtype) * gr).sum((0,) + tuple(range(4, 4 + n))).reshape(w.shape)
        return gx.cast(x.dtype).uop, gw.cast(w.dtype).uop

def matmul_nodes(a: UOp, b: UOp, acc: DType | None = None) -> UOp:
    """a @ b for tensor-level nodes of int shapes (..., n, k) and (..., k, m) with the same batch dims and one dtype
    (no checks): the broadcast multiply and sum that Tensor.dot makes, as nodes directly. `acc`: the dtype the
    products and their sum are formed in, where it isn't the operands' own (half types: float32); the sum is then
    converted back."""
    (*batch, n, k), m = a.shape, b.shape[-1]
    nb, full, dt = len(batch), (*batch, n, m, k), a.dtype
    au = a.reshape((*batch, n, 1, k))
    bu = b.permute(tuple(range(nb)) + (nb + 1, nb)).reshape((*batch, 1, m, k))
    if acc is not None and acc != dt: au, bu = UOp(Ops.CAST, acc, (au,)), UOp(Ops.CAST, acc, (bu,))
    out = UOp(Ops.MUL, au.dtype, (au.expand(full), bu.expand(full))).r(Ops.ADD, (nb + 2,)).reshape((*batch, n, m))
    return out if out.dtype == dt else UOp(Ops.CAST, dt, (out,))

def renderer_says(device: str | tuple[str, ...], attr: str) -> bool:
    """Whether the renderer of `device` (of a sharded tensor's first device) has `attr` set: "has_local" for
    GPU-style kernels, "tensor_cores" for matrix instructions."""
    return bool(getattr(Device[device if isinstance(device, str) else device[0]].renderer, attr, None))

def _conv_result(ret: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, groups: int, stride, dilation,
                 flat: list[int], out_dt: DType) -> Tensor:
    """A convolution's output `ret` with conv2d's gradient rule attached (float outputs) and the bias added."""
    n = weight.ndim - 2
    if dtypes.is_float(out_dt):
        rule = _ConvGradient(groups, _int_tuple(stride, n, "stride"), _int_tuple(dilation, n, "dilation"), tuple(flat))
        ret = _tensor_cls()(UOp(Ops.CUSTOM_GRAD, ret.dtype, (ret.detach().uop, x.uop, weight.uop), rule))
    return ret if bias is None else ret + bias.cast(out_dt).reshape((1, weight.shape[0]) + (1,) * n)

# Winograd's F(4x4, 3x3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015, with the points
# 0, 1, -1, 2, -2 and infinity): a 4x4 tile of a 3x3 convolution's output is AT (G w G^T * BT d B) A, where d is the
# 6x6 input tile, w the 3x3 kernel and * is elementwise. Over channels, the elementwise products become 36 matmuls
# (one per tile position): 36 multiply-adds per tile and channel pair instead of 144.
_WINO_BT = ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
            (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1))
_WINO_G = ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
           (1 / 24, -1 / 12, 1 / 6), (0, 0, 1))
_WINO_AT = ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))
# Winograd pays where the 36 matmuls dominate: enough channels for the transforms (linear in them) to be small next
# to the products (quadratic), enough tiles for the weights' transform (36 x cin x cout, made every call) to be
# reused, and enough work for its four kernels' fixed cost. The bounds come from timing 3x3 convolutions both ways
# (DESIGN.md, "Winograd convolutions").
WINO_MIN_CHANNELS, WINO_MIN_TILES, WINO_MIN_FLOPS = 64, 64, 1 << 27
# In training the output is copied into image rows. What reads it there are reductions: a batch norm's statistics
# and its backward's sums over (batch, pixels) per channel, and the next layers' gradients, which come out of
# Winograd convolutions too. Read through the tile order they loaded scalars across 16 planes 16-64K floats apart
# (about 4 GB/s), where rows load vectors; the copy costs one pass. In inference the readers are elementwise (a
# folded batch norm, relu, a residual add), which read tiles as fast as rows and save the pass. Measured on ResNet-18
# (bench_train, old and new alternated): SGD step b16 64px 120-121.5 -> 103.8-104.8 ms, 224px 1356 -> 1175 ms;
# forward b8 64px with rows 565 -> 450 img/s, so inference keeps tiles. (Storing rows from the output transform
# itself: 105 ms at 64px, but 1486 at 224px.)
WINO_ROWS_IN_TRAINING = True

def _winograd_fits(x: Tensor, weight: Tensor, groups: int, s_: tuple[int, ...], d_: tuple[int, ...], flat: list[int],
                   out_dt: DType) -> bool:
    """Whether conv2d computes this convolution by Winograd's F(4x4, 3x3): WINO set, one device, float32, 2-D, 3x3,
    stride and dilation 1 (`s_`, `d_`: one int per spatial dim), one group, padding of 0 to 2 (no crop), int sizes,
    and a size where it pays (see above)."""
    if x.dtype != dtypes.float32 or weight.dtype != dtypes.float32 or out_dt != dtypes.float32: return False
    if not WINO or weight.ndim != 4 or weight.shape[2:] != (3, 3) or groups != 1: return False
    if not isinstance(x.device, str) or x.device != weight.device: return False   # (sharded: the direct form)
    if s_ != (1, 1) or d_ != (1, 1): return False
    if not all(0 <= p <= 2 for p in flat) or not all(type(v) is int for v in x.shape + weight.shape): return False
    (bs, cin, h, w), cout = x.shape, weight.shape[0]
    ho, wo = h + flat[2] + flat[3] - 2, w + flat[0] + flat[1] - 2
    # (an output too small for a window is conv2d's error to raise)
    if ho < 1 or wo < 1: return False
    tiles = bs * -(-ho // 4) * -(-wo // 4)
    return min(cin, cout) >= WINO_MIN_CHANNELS and tiles >= WINO_MIN_TILES and \
        2 * bs * ho * wo * cin * cout * 9 >= WINO_MIN_FLOPS

# A convolution of small images on a GPU's tensor cores runs as a matmul of two plain matrices: the weights as
# (cout, cin * kernel) times its windows copied into a (cin * kernel) x (batch * output pixels) matrix (im2col; the
# copy reads each input pixel once per kernel tap, along the image rows). Both operands are then read contiguously
# along the reduction, which the tensor-core kernels stage into shared memory 16 bytes a copy, double-buffered. Read in
# place, a window's loads go through the padding's gates and cross rows, and the tensor-core tile takes an image row
# (a 7x7 image's row of 7 pixels padded to 8) or a few images. On an H200 (ResNet-50's convolutions in half, batch 32,
# every kernel of the convolution timed: bench/gpu_sweep.py --only im2col): 3x3 at 28x28 0.34 -> 0.12 ms, 14x14 0.40
# -> 0.11, 7x7 0.64 -> 0.16, 56x56 at stride 2 0.36 -> 0.12, 1x1 at 7x7 0.17 -> 0.09 (at 14x14 the same); but 3x3 at
# 56x56 0.15 -> 0.31 and 1x1 at 56x56 0.08 -> 0.15-0.22 (a row of 56 pixels fills the tile, and the copy costs more
# than the matmul saves). So: outputs of at most IM2COL_MAX_PIXELS pixels an image, and a copy of at most
# IM2COL_MAX_BYTES.
IM2COL_MAX_PIXELS = 28 * 28
IM2COL_MAX_BYTES = 1 << 30

def _im2col_fits(x: Tensor, weight: Tensor, groups: int, s_: tuple[int, ...], d_: tuple[int, ...], flat: list[int],
                 out_dt: DType) -> bool:
    """Whether conv2d copies its windows into a matrix (IM2COL, above): one device whose renderer has local memory
    and tensor cores taking the inputs' dtype, a 16-bit float convolution of one group with int sizes, outputs of at
    most IM2COL_MAX_PIXELS an image and a copy of at most IM2COL_MAX_BYTES."""
    if not IM2COL or groups != 1 or not isinstance(x.device, str) or x.device != weight.device: return False
    if not (x.dtype == weight.dtype == out_dt and out_dt in (dtypes.half, dtypes.bfloat16)): return False
    if not all(type(v) is int for v in x.shape + weight.shape): return False
    outs = [(i + a + b - d * (k - 1) - 1) // s + 1 for i, (a, b), k, s, d in
            zip(x.shape[2:], _side_pairs(flat), weight.shape[2:], s_, d_)]
    # (an output too small for a window is conv2d's error to raise)
    if not (all(o >= 1 for o in outs) and prod(outs) <= IM2COL_MAX_PIXELS and
            x.shape[0] * prod(outs) * prod(weight.shape[1:]) * x.dtype.itemsize <= IM2COL_MAX_BYTES): return False
    return out_dt in _gpu_16bit_tensor_core_dtypes(x.device)

_TC_DTYPES: weakref.WeakKeyDictionary[Any, frozenset[DType]] = weakref.WeakKeyDictionary()
def _gpu_16bit_tensor_core_dtypes(device: str) -> frozenset[DType]:
    """The 16-bit input dtypes of the tensor cores of `device`'s renderer where it is GPU-style (has local memory), kept
    per renderer (a convolution asks on every call)."""
    ren = Device[device].renderer
    if (got := _TC_DTYPES.get(ren)) is None:
        tcs = ren.tensor_cores if getattr(ren, "has_local", False) else []
        got = _TC_DTYPES[ren] = frozenset(tc.dtype_in for tc in tcs if tc.dtype_in.itemsize == 2)
    return got

def _winograd_conv2d(x: Tensor, weight: Tensor, pairs: list[tuple[int, int]], rows: bool) -> Tensor:
    """A 3x3 stride-1 convolution (see _winograd_fits) by Winograd's F(4x4, 3x3), in four kernels: the input tiles
    transformed (36, cin, tiles), the weights transformed (36, cout, cin), their 36 matmuls and the output transform;
    whatever reads the result lays its 4x4 tiles out as image rows (a following batch norm or relu as it loads them,
    or a copy) and crops it when the output isn't a multiple of 4. With `rows`, a fifth kernel copies the tiles into
    image rows (in training: see WINO_ROWS_IN_TRAINING). Each transform is one small matmul with its
    matrix over a whole tile (36 positions): a few nodes to build, where applying the 6x6 matrices row by row as
    slices takes hundreds (a graph that took longer to build and schedule than its kernels ran)."""
    (bs, cin, h, w), cout = x.shape, weight.shape[0]
    (top, bottom), (left, right) = pairs
    ho, wo = h + top + bottom - 2, w + left + right - 2
    th, tw = -(-ho // 4), -(-wo // 4)
    # a row of tiles padded to a multiple of 8 when that adds at most an eighth: the tile index then splits into
    # its row and column with shifts where the input transform gathers its tiles (56x56 images: 14 tiles a row
    # become 16)
    if tw % 8 and pads_cheaply(tw, 8): tw += -tw % 8
    # the input padded to whole tiles: (4 th + 2) x (4 tw + 2), the tiles overlapping by 2
    xp = _views_of(x).pad(((0, 0), (0, 0), (top, 4 * th + 2 - h - top), (left, 4 * tw + 2 - w - left)))
    d = _tensor_of(xp)._pool((6, 6), 4).uop                               # (bs, cin, th, tw, 6, 6)
    kb, kg, ka = (t.uop for t in _wino_matrices(x.device))
    tiles = bs * th * tw
    # (nodes made directly: every size follows from the checked input and weight)
    def contiguous(u: UOp) -> UOp: return UOp(Ops.CONTIGUOUS, u.dtype, (u,))
    v = matmul_nodes(kb, d.permute((4, 5, 1, 0, 2, 3)).reshape((36, cin * tiles))).reshape((36, cin, tiles))
    u = matmul_nodes(weight.uop.reshape((cout * cin, 9)), kg).permute((1, 0)).reshape((36, cout, cin))
    m = matmul_nodes(contiguous(u), v).reshape((36, cout * tiles))
    # the output's 4x4 tiles laid out as image rows by whatever reads them (an elementwise consumer, or a copy)
    y = contiguous(matmul_nodes(ka, m)).reshape((4, 4, cout, bs, th, tw)).permute((3, 2, 4, 0, 5, 1))
    y = y.reshape((bs, cout, 4 * th, 4 * tw))
    if (ho, wo) != (4 * th, 4 * tw): y = y.shrink(((0, bs), (0, cout), (0, ho), (0, wo)))
    return _tensor_cls()(contiguous(y) if rows else y)

_wino_matrix_cache: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

def _wino_matrices(device: str) -> tuple[Tensor, Tensor, Tensor]:
    """The transforms as matrices over a whole tile, float32 tensors on `device` (buffers made from the values, once):
    BT (x) BT (36, 36), (G (x) G) transposed (9, 36) and AT (x) AT (16, 36)."""
    if (hit := _wino_matrix_cache.get(device)) is None:
        def kron(a, b) -> list[list[float]]: return [[x * y for x in ra for y in rb] for ra in a for rb in b]
        T = _tensor_cls()
        kgt = [list(col) for col in zip(*kron(_WINO_G, _WINO_G))]
        hit = _wino_matrix_cache[device] = tuple(T(m, dtype=dtypes.float32, device=device) for m in
                                                 (kron(_WINO_BT, _WINO_BT), kgt, kron(_WINO_AT, _WINO_AT)))
    return hit

def _phase_windows(xp: Tensor, s_: tuple[int, ...], hw: tuple[int, ...], o_: tuple[int, ...]) -> Tensor:
    """The windows (bs, c, *o_, *hw) of a stride-s_ (dilation 1) convolution over the padded input `xp`, read from a
    copy of it split into its phases (the pixels s*a + p, for each p): a window's tap s*q + p at output o is pixel
    o + q of phase p, so along the output row the loads are contiguous (from `xp` itself they step by the stride, and
    the weight gradient's reduction along that row can't be vectorized)."""
    n, pre, ip = len(s_), xp.shape[:2], xp.shape[2:]
    q_ = [-(-k // s) for k, s in zip(hw, s_)]
    a_ = [max(-(-i // s), o + q - 1) for i, s, o, q in zip(ip, s_, o_, q_)]
    xp = xp.pad(((0, 0), (0, 0)) + tuple((0, a * s - i) for a, s, i in zip(a_, s_, ip)))
    xp = xp.reshape(pre + tuple(v for a, s in zip(a_, s_) for v in (a, s)))
    phases = xp.permute((0, 1) + tuple(3 + 2 * j for j in range(n)) + tuple(2 + 2 * j for j in range(n))).contiguous()
    w = phases._pool(tuple(q_), 1)    # (bs, c, *s_, *(a - q + 1), *q_)
    w = w.shrink(tuple((0, v) for v in w.shape[:2 + n]) + tuple((0, o) for o in o_) + tuple((0, q) for q in q_))
    # (bs, c, *o_, q1, s1, q2, s2, ...): the tap index q*s + p, cut to the kernel's size
    taps = tuple(v for j in range(n) for v in (2 + 2 * n + j, 2 + j))
    w = w.permute((0, 1) + tuple(2 + n + j for j in range(n)) + taps)
    w = w.reshape(pre + tuple(o_) + tuple(q * s for q, s in zip(q_, s_)))
    return w.shrink(tuple((0, v) for v in w.shape[:2 + n]) + tuple((0, k) for k in hw))

def _subpixel_transpose(x: Tensor, w: Tensor, groups: int, s_: tuple[int, ...], d_: tuple[int, ...],
                        pads: list[tuple[int, int]]) -> Tensor:
    """A strided transposed convolution as one stride-1 convolution per output phase (sub-pixel convolution): the
    outputs s*q + r along a dim only meet the kernel taps t with r + t*d - left = 0 (mod s), so each phase convolves
    the input itself with those taps, and the phases are interleaved. The stride-1 convolution of the input spread
    out by the stride would multiply by its zeros too: s^n times the work, behind masked loads. `w` is the flipped,
    channel-swapped kernel and `pads` the (left, right) padding of that stride-1 convolution, per dim."""
    T = _tensor_cls()
    n, i_, hw = len(s_), x.shape[2:], w.shape[2:]
    outs = [(i - 1) * s + 1 + lp + rp - (k - 1) * d for i, s, k, d, (lp, rp) in zip(i_, s_, hw, d_, pads)]
    qs = [-(-o // s) for o, s in zip(outs, s_)]
    def phase_dim(j: int, r: int) -> tuple[slice, int, tuple[int, int]] | None:
        """Along dim j, phase r: (the taps, the dilation between them, the input padding), None without taps."""
        i, k, s, d, (lp, _) = i_[j], hw[j], s_[j], d_[j], pads[j]
        taps = [t for t in range(k) if (r + t * d - lp) % s == 0]
        q_r = -(-(outs[j] - r) // s)
        if not taps or q_r <= 0: return None
        step = taps[1] - taps[0] if len(taps) > 1 else 1
        dil, off = (step * d // s if len(taps) > 1 else 1), (r + taps[0] * d - lp) // s
        left = -off
        return slice(taps[0], taps[-1] + 1, step), dil, (left, q_r - i - left + (len(taps) - 1) * dil)
    phases = []
    for rs in itertools.product(*[range(s) for s in s_]):
        dims = [phase_dim(j, r) for j, r in enumerate(rs)]
        if any(p is None for p in dims):
            phases.append(T.zeros(x.shape[0], w.shape[0], *qs, dtype=least_upper_dtype(x.dtype, w.dtype),
                                  device=x.device))
            continue
        wr = w[(slice(None), slice(None)) + tuple(p[0] for p in dims)]
        flat = [v for p in dims[::-1] for v in p[2]]
        y = x.conv2d(wr, groups=groups, dilation=tuple(p[1] for p in dims), padding=flat)
        phases.append(y.pad(((0, 0), (0, 0)) + tuple((0, q - yq) for q, yq in zip(qs, y.shape[2:]))))
    # (n, c, q1.., r1..) -> (n, c, q1, r1, q2, r2, ...) -> the interleaved output
    st = T.stack(*phases, dim=-1).reshape(phases[0].shape + tuple(s_))
    order = (0, 1) + tuple(v for j in range(n) for v in (2 + j, 2 + n + j))
    full = st.permute(order).reshape(st.shape[:2] + tuple(q * s for q, s in zip(qs, s_)))
    return full.shrink(((0, full.shape[0]), (0, full.shape[1])) + tuple((0, o) for o in outs))

def _upsample_linear(x: Tensor, d: int, f: int) -> Tensor:
    """Linear upsampling of dim d by a power of two f (align_corners False), as views and multiply-adds: output f*q + r
    reads source q + c_r with c_r = (r + 0.5)/f - 0.5, so it mixes element q with its neighbour before (c_r < 0) or
    after, with the weights torch computes (exact in binary for these f). At the ends torch's clamped index reads
    the end element alone: there the neighbour's weight is 0 (the shifted views are zero-padded) and the element's 1.
    The f outputs of each q are interleaved by zero-padding each along a new axis and adding them. The dense (in,
    out) weight matrix this replaces did i multiplies per output for 2."""
    T = _tensor_cls()
    i, nd = x.shape[d], x.ndim
    def along(pairs: tuple[int, int], t: Tensor, n: int, at: int = d) -> Tensor:
        return t.pad(tuple(pairs if a == at else (0, 0) for a in range(n)))
    def shrunk(t: Tensor, lo: int, hi: int) -> Tensor:
        return t.shrink(tuple((lo, hi) if a == d else None for a in range(nd)))
    before, after = shrunk(along((1, 0), x, nd), 0, i), shrunk(along((0, 1), x, nd), 1, i + 1)
    q = T.arange(i, device=x.device).reshape(tuple(i if a == d else 1 for a in range(nd)))
    first, last = q == 0, q == i - 1
    lanes = []
    for r in range(f):
        c = (r + 0.5) / f - 0.5
        if c < 0: lane = before * first.where(0.0, -c) + x * first.where(1.0, 1 + c)
        else: lane = x * last.where(1.0, 1 - c) + after * last.where(0.0, c)
        lanes.append(along((r, f - 1 - r), lane.unsqueeze(d + 1), nd + 1, d + 1))
    out = lanes[0]
    for lane in lanes[1:]: out = out + lane
    return out.reshape(x.shape[:d] + (i * f,) + x.shape[d + 1:])

def _need_tensors(name: str, **args: object) -> None:
    """A clear TypeError when an argument that must be a Tensor (or None, for optional ones) isn't."""
    Tensor = _tensor_cls()
    for k, v in args.items():
        if v is not None and not isinstance(v, Tensor): raise TypeError(f"{name}: {k} must be a Tensor, got "
                                                                        f"{type(v).__name__}")

def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS: raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")

def _reduce_loss(loss: Tensor, reduction: str) -> Tensor:
    return loss if reduction == "none" else loss.sum() if reduction == "sum" else loss.mean()

class _Views:
    """Movement ops on a node with int sizes, made as Tensor's would make them (no node for a no-op, negative padding
    crops) but without checking their arguments: for chains built from sizes already checked."""
    __slots__ = ("uop",)
    def __init__(self, x: Any): self.uop = x.uop
    def _then(self, u: UOp) -> _Views:
        out = object.__new__(_Views)
        out.uop = u
        return out
    @property
    def shape(self) -> tuple[int, ...]: return self.uop.shape
    def reshape(self, shape: tuple[int, ...]) -> _Views:
        return self if shape == self.shape else self._then(self.uop.reshape(shape))
    def expand(self, shape: tuple[int, ...]) -> _Views:
        return self if shape == self.shape else self._then(self.uop.expand(shape))
    def shrink(self, arg: tuple[tuple[int, int], ...]) -> _Views:
        if all(b == 0 and e == s for (b, e), s in zip(arg, self.shape)): return self
        return self._then(self.uop.shrink(arg))
    def pad(self, arg: tuple[tuple[int, int], ...]) -> _Views:
        x = self
        if any(b < 0 or e < 0 for b, e in arg):
            x = x.shrink(tuple((-min(b, 0), s + min(e, 0)) for (b, e), s in zip(arg, x.shape)))
            arg = tuple((max(b, 0), max(e, 0)) for b, e in arg)
        return x if all(b == 0 and e == 0 for b, e in arg) else x._then(x.uop.pad(arg))
    def permute(self, order: tuple[int, ...]) -> _Views: return self._then(self.uop.permute(order))

def _views_of(x: Tensor) -> Any:
    """`x` as unchecked _Views when its sizes are ints (symbolic ones keep the checked Tensor ops)."""
    return _Views(x) if all(type(v) is int for v in x.shape) else x

def _tensor_of(x: Any) -> Tensor:
    return x if isinstance(x, (T := _tensor_cls())) else T(x.uop)

class NNMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()

    # *** padding ***

    def pad(self: Tensor, padding: Sequence, mode: str = "constant", value: ConstType = 0.0) -> Tensor:
        """Pad with mode constant (`value`), reflect, replicate or circular: ((before, after) or None per dim), or
        torch's flat (left, right, top, bottom, ...) form for the last dims. Negative amounts crop."""
        if mode not in ("constant", "reflect", "replicate", "circular"):
            raise ValueError(f"pad mode must be constant, reflect, replicate or circular, got {mode!r}")
        if mode != "constant" and value != 0: raise ValueError(f"pad value {value} only applies to mode 'constant'")
        if padding and all(isinstance(p, int) for p in padding):
            if len(padding) % 2 or len(padding) // 2 > self.ndim:
                raise ValueError(f"flat padding {padding} needs an even length of at most 2*ndim={2*self.ndim}")
            pairs = _side_pairs(list(padding))
            arg = [(0, 0)] * (self.ndim - len(pairs)) + pairs
        else:
            if len(padding) != self.ndim: raise ValueError(f"padding {padding} needs one entry per dim ({self.ndim})")
            arg = [(0, 0) if p is None else tuple(p) for p in padding]
            if any(len(p) != 2 for p in arg): raise ValueError(f"each padding entry must be (before, after): {padding}")
        def is_amount(v: Any) -> bool: return is_symbolic(v) or isinstance(v, int) and not isinstance(v, bool)
        if any(not is_amount(b) or not is_amount(e) for b, e in arg):
            raise TypeError(f"padding amounts must be ints: {padding}")
        if mode != "constant" and (any(is_symbolic(v) for p in arg for v in p) or
                                   any(is_symbolic(s) and p != (0, 0) for p, s in zip(arg, self.shape))):
            raise ValueError(f"pad mode {mode!r} needs int amounts and sizes, got {padding} for shape {self.shape}")
        arg = [(ssimplify(b), ssimplify(e)) for b, e in arg]
        if any(is_symbolic(v) and v.vmin < 0 for p in arg for v in p):
            raise ValueError(f"a symbolic padding amount must be >= 0 for every value of its Variables: {padding}")
        # negative padding crops
        x = self
        if any(isinstance(v, int) and v < 0 for p in arg for v in p):
            if any(-min(b, 0) - min(e, 0) > s for (b, e), s in zip(arg, x.shape)):
                raise ValueError(f"negative padding {padding} crops more than the size of shape {self.shape}")
            x = x.shrink(tuple((-min(b, 0), s + min(e, 0)) for (b, e), s in zip(arg, x.shape)))
            arg = [(max(b, 0), max(e, 0)) for b, e in arg]
        if all(isinstance(b, int) and b == 0 and isinstance(e, int) and e == 0 for b, e in arg): return x
        check_size(tuple(s + b + e for s, (b, e) in zip(x.shape, arg)), x.dtype, x.device)
        if mode == "constant":
            Tensor = _tensor_cls()
            padded = Tensor(x.uop.pad(tuple(arg)))
            if value == 0: return padded
            inside = Tensor(x.ones_like(dtypes.bool).uop.pad(tuple(arg)))
            return inside.where(padded, value)
        for d, (b, e) in enumerate(arg):
            if b == 0 and e == 0: continue
            n = x.shape[d]
            if mode == "reflect" and (b >= n or e >= n):
                raise ValueError(f"reflect padding ({b}, {e}) must be smaller than the size {n} of dim {d}")
            if mode == "circular" and (b > n or e > n):
                raise ValueError(f"circular padding ({b}, {e}) can't be larger than the size {n} of dim {d}")
            if mode == "replicate" and n == 0: raise ValueError(f"replicate padding of the empty dim {d}")
            def part(lo: int, hi: int) -> Tensor: return x.shrink(tuple((lo, hi) if i == d else None
                                                                          for i in range(x.ndim)))
            if mode == "reflect": left, right = part(1, b + 1).flip(d), part(n - 1 - e, n - 1).flip(d)
            elif mode == "circular": left, right = part(n - b, n), part(0, e)
            else:
                left = part(0, 1).expand(tuple(b if i == d else s for i, s in enumerate(x.shape)))
                right = part(n - 1, n).expand(tuple(e if i == d else s for i, s in enumerate(x.shape)))
            x = left.cat(x, right, dim=d)
        return x

    # *** windows ***

    def _pool(self: Tensor, k_: tuple[int, ...], stride: int | Sequence[int] = 1,
              dilation: int | Sequence[int] = 1) -> Tensor:
        """Sliding windows over the last len(k_) dims: shape (..., *out, *k_), movement ops only."""
        n = len(k_)
        if self.ndim < n: raise ValueError(f"a window of {n} dims needs a tensor of at least {n} dims: {self.shape}")
        s_, d_ = _int_tuple(stride, n, "stride"), _int_tuple(dilation, n, "dilation")
        if any(k <= 0 for k in k_): raise ValueError(f"kernel size must be positive, got {k_}")
        if any(s <= 0 for s in s_): raise ValueError(f"stride must be positive, got {s_}")
        if any(d <= 0 for d in d_): raise ValueError(f"dilation must be positive, got {d_}")
        pre, i_ = self.shape[:-n], self.shape[-n:]
        o_ = tuple((i - d * (k - 1) - 1) // s + 1 for i, d, k, s in zip(i_, d_, k_, s_))
        if any(o <= 0 for o in o_):
            raise ValueError(f"window {k_} (dilation {d_}) is larger than the input's spatial size {i_}")
        keep = tuple((0, p) for p in pre)
        # with int sizes the views below are valid by construction: they are made as nodes directly, without a
        # checked tensor operation each (a convolution's graph took ~400 us to build, mostly here)
        x = _views_of(self)
        if all(k <= s for k, s in zip(k_, s_)) and all(d == 1 for d in d_):
            # windows don't overlap: cut each dim into o blocks of s and keep the first k of each block
            x = x.pad(tuple((0, 0) for _ in pre) + tuple((0, o * s - i) for o, s, i in zip(o_, s_, i_)))
            x = x.reshape(pre + tuple(v for o, s in zip(o_, s_) for v in (o, s)))
            x = x.shrink(keep + tuple(v for o, k in zip(o_, k_) for v in ((0, o), (0, k))))
            ko = tuple(v for o, k in zip(o_, k_) for v in (o, k))
            x = x.reshape(pre + ko)
            npre = len(pre)
            return _tensor_of(x.permute(tuple(range(npre)) + tuple(npre + 2 * j for j in range(n)) +
                                        tuple(npre + 2 * j + 1 for j in range(n))))
        # overlapping windows: repeat each dim e times and view the repeats as rows of length i+d, so row j starts
        # j*d further into the input; window o of row j is then column o*s
        e_ = tuple(math.ceil(k * (i + d) / i) for k, i, d in zip(k_, i_, d_))
        x = x.reshape(pre + tuple(v for i in i_ for v in (1, i)))
        x = x.expand(pre + tuple(v for e, i in zip(e_, i_) for v in (e, i)))
        x = x.reshape(pre + tuple(e * i for e, i in zip(e_, i_)))
        x = x.shrink(keep + tuple((0, k * (i + d)) for k, i, d in zip(k_, i_, d_)))
        x = x.reshape(pre + tuple(v for k, i, d in zip(k_, i_, d_) for v in (k, i + d)))
        x = x.pad(tuple((0, 0) for _ in pre) + tuple(v for o, s, i, d in zip(o_, s_, i_, d_)
                                                      for v in ((0, 0), (0, o * s - (i + d)))))
        x = x.reshape(pre + tuple(v for k, o, s in zip(k_, o_, s_) for v in (k, o, s)))
        x = x.shrink(keep + tuple(v for k, o in zip(k_, o_) for v in ((0, k), (0, o), (0, 1))))
        x = x.reshape(pre + tuple(v for k, o in zip(k_, o_) for v in (k, o)))
        npre = len(pre)
        return _tensor_of(x.permute(tuple(range(npre)) + tuple(npre + 2 * j + 1 for j in range(n)) +
                                    tuple(npre + 2 * j for j in range(n))))

    def unfold(self: Tensor, dim: int, size: int, step: int) -> Tensor:
        """Windows of `size` elements every `step` along `dim`, as a new last dim (torch.Tensor.unfold)."""
        from fusegrad.tensor import _resolve_axis
        if self.ndim == 0:
            if dim not in (0, -1) or size not in (0, 1): raise ValueError(f"unfold of a 0-d tensor: bad dim {dim} or "
                                                                          f"size {size}")
            return self.reshape(1).shrink(((0, size),))
        d = _resolve_axis(dim, self.ndim)
        if not isinstance(size, int) or size < 0 or size > self.shape[d]:
            raise ValueError(f"unfold size {size} must be between 0 and the size {self.shape[d]} of dim {dim}")
        if not isinstance(step, int) or step <= 0: raise ValueError(f"unfold step must be positive, got {step}")
        order = tuple(i for i in range(self.ndim) if i != d) + (d,)
        if size == 0:
            x = self.permute(order)
            w = x.shrink(tuple((0, v) for v in x.shape[:-1]) + ((0, 0),)).unsqueeze(-2)
            w = w.expand(x.shape[:-1] + (self.shape[d] // step + 1, 0))
        else: w = self.permute(order)._pool((size,), step)  # (..., o, size)
        back = tuple(range(d)) + (self.ndim - 1,) + tuple(range(d, self.ndim - 1)) + (self.ndim,)
        return w.permute(back)

    # *** convolution ***

    def conv2d(self: Tensor, weight: Tensor, bias: Tensor | None = None, groups: int = 1,
               stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, dtype: DType | str | None = None) -> Tensor:
        """Convolution (cross-correlation, as torch) over any number of spatial dims: input (N, Cin, *spatial),
        weight (Cout, Cin/groups, *kernel)."""
        _need_tensors("conv2d", weight=weight, bias=bias)
        if self.ndim < 3: raise ValueError(f"conv2d input needs shape (N, C, *spatial), got {self.shape}")
        if weight.ndim != self.ndim:
            raise ValueError(f"conv2d weight {weight.shape} must have as many dims as the input {self.shape}")
        if not isinstance(groups, int) or groups <= 0: raise ValueError(f"groups must be a positive int, got {groups}")
        cin_, (cout, cin), hw = self.shape[1], weight.shape[:2], weight.shape[2:]
        n = len(hw)
        if cin * groups != cin_:
            raise ValueError(f"conv2d input has {cin_} channels but weight {weight.shape} with groups={groups} "
                             f"expects {cin * groups}")
        if cout % groups: raise ValueError(f"conv2d out channels {cout} are not divisible by groups={groups}")
        if bias is not None and bias.shape != (cout,):
            raise ValueError(f"conv2d bias must have shape ({cout},), got {bias.shape}")
        flat = _flat_pads(padding, n)
        out_dt = to_dtype(dtype) if dtype is not None else least_upper_dtype(self.dtype, weight.dtype)
        s_, d_ = _int_tuple(stride, n, "stride"), _int_tuple(dilation, n, "dilation")
        # the graph's choices of form are settings of its template: they depend on knobs and the device's renderer
        # as well as on the shapes
        wino = _winograd_fits(self, weight, groups, s_, d_, flat, out_dt)
        wino_rows = wino and WINO_ROWS_IN_TRAINING and bool(_tensor_cls().training)
        settings = (groups, s_, d_, tuple(flat), out_dt, wino, wino_rows,
                    _im2col_fits(self, weight, groups, s_, d_, flat, out_dt))
        if bias is None: return templated(_conv_graph_without_bias, (self, weight), settings)
        return templated(_conv_graph_with_bias, (self, weight, bias), settings)

    def _conv_graph(self: Tensor, weight: Tensor, bias: Tensor | None, groups: int, s_: tuple[int, ...],
                    d_: tuple[int, ...], flat: tuple[int, ...], out_dt: DType, wino: bool, wino_rows: bool,
                    im2col: bool) -> Tensor:
        """conv2d's graph, its arguments checked; `wino`: by Winograd's F(4x4, 3x3) (_winograd_fits), its output
        copied into image rows with `wino_rows` (WINO_ROWS_IN_TRAINING), `im2col`: as a matmul of the windows copied
        into rows (_im2col_fits)."""
        bs, (cout, cin), hw = self.shape[0], weight.shape[:2], weight.shape[2:]
        n, flat = len(hw), list(flat)
        if all(k == 1 for k in hw) and any(s > 1 for s in s_) and all(type(v) is int for v in self.shape):
            # a strided 1x1 convolution reads every s-th pixel: the same 1x1 convolution of those pixels (a view)
            # at stride 1, which is vectorized along the pixels as a matmul would be, where a strided one would be
            # vectorized along the output channels (ResNet's downsampling)
            picked = self.pad(flat)._pool((1,) * n, s_)
            picked = picked.reshape(picked.shape[:2 + n])
            return picked.conv2d(weight, bias, groups, 1, 1, 0, out_dt)
        if wino:
            ret = _winograd_conv2d(self, weight, _side_pairs(flat), wino_rows)
            return _conv_result(ret, self, weight, bias, groups, s_, d_, flat, out_dt)
        x = self.pad(flat)._pool(hw, s_, d_)  # (bs, cin_, *out, *hw)
        rcout, oyx = cout // groups, x.shape[2:2 + n]
        acc_dt = sum_acc_dtype(out_dt) if dtypes.is_float(out_dt) else out_dt
        if im2col:
            # the windows as a (cin * kernel) x (bs * out) matrix, whose copy reads and writes along the image rows;
            # the weights times it is a plain matmul (the tensor-core kernels' fastest form: stored with its own
            # layout, (cout, bs, *out), then copied as (bs, cout, *out), took 0.17 against 0.30 ms where the matmul
            # stored the permuted layout itself, its loops then split by the batch)
            k, cols = cin * prod(hw), bs * prod(oyx)
            win = x.permute((1,) + tuple(range(2 + n, 2 + 2 * n)) + (0,) + tuple(range(2, 2 + n))).contiguous()
            win = win.reshape((k, cols)).permute((1, 0)).reshape((1, cols, k))
            ret = (weight.reshape((cout, 1, k)).cast(acc_dt) * win.cast(acc_dt)).sum(-1)
            ret = ret.cast(out_dt).contiguous().reshape((cout, bs) + oyx).permute((1, 0) + tuple(range(2, 2 + n)))
            return _conv_result(ret, self, weight, bias, groups, s_, d_, flat, out_dt)
        x = _views_of(x)
        x = x.reshape((bs, groups, cin, 1) + oyx + hw).expand((bs, groups, cin, rcout) + oyx + hw)
        x = _tensor_of(x.permute((0, 1, 3) + tuple(range(4, 4 + n)) + (2,) + tuple(range(4 + n, 4 + 2 * n))))
        w = weight.reshape((1, groups, rcout) + (1,) * n + (cin,) + hw)
        # products in the accumulation dtype (half and bfloat16 inputs: exact float32 products summed in float32 and
        # rounded once, as a matmul's: what torch computes, and the form a tensor core takes)
        ret = (x.cast(acc_dt) * w.cast(acc_dt)).sum(tuple(range(-1 - n, 0)))
        ret = (ret.cast(out_dt) if dtypes.is_float(out_dt) else ret).reshape((bs, cout) + oyx)
        return _conv_result(ret, self, weight, bias, groups, s_, d_, flat, out_dt)

    def conv_transpose2d(self: Tensor, weight: Tensor, bias: Tensor | None = None, groups: int = 1,
                         stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
                         padding: int | Sequence[int] = 0, output_padding: int | Sequence[int] = 0) -> Tensor:
        """Transposed convolution over any number of spatial dims: weight (Cin, Cout/groups, *kernel)."""
        _need_tensors("conv_transpose2d", weight=weight, bias=bias)
        if self.ndim < 3: raise ValueError(f"conv_transpose2d input needs shape (N, C, *spatial), got {self.shape}")
        if weight.ndim != self.ndim:
            raise ValueError(f"conv_transpose2d weight {weight.shape} must have as many dims as the input {self.shape}")
        if not isinstance(groups, int) or groups <= 0: raise ValueError(f"groups must be a positive int, got {groups}")
        hw, n = weight.shape[2:], weight.ndim - 2
        cin, rcout = weight.shape[:2]
        if cin != self.shape[1]:
            raise ValueError(f"conv_transpose2d input has {self.shape[1]} channels, weight {weight.shape} wants {cin}")
        if cin % groups: raise ValueError(f"conv_transpose2d in channels {cin} are not divisible by groups={groups}")
        s_, d_ = _int_tuple(stride, n, "stride"), _int_tuple(dilation, n, "dilation")
        op_ = _int_tuple(output_padding, n, "output_padding")
        if any(o < 0 or o >= max(s, d) for o, s, d in zip(op_, s_, d_)):
            raise ValueError(f"output_padding {op_} must be smaller than either stride {s_} or dilation {d_}")
        # the transpose is a stride-1 convolution of the input spread out by the stride, with the kernel flipped and
        # its in/out channels swapped within each group
        w = weight.reshape((groups, cin // groups, rcout) + hw).permute((0, 2, 1) + tuple(range(3, 3 + n)))
        w = w.flip(tuple(range(3, 3 + n))).reshape((groups * rcout, cin // groups) + hw)
        x, i_ = self, self.shape[2:]
        pairs = _side_pairs(_flat_pads(padding, n))
        new_pairs = [((k - 1) * d - b, (k - 1) * d - a + o) for k, d, (b, a), o in zip(hw, d_, pairs, op_)]
        if any(s > 1 for s in s_) and all(isinstance(v, int) for v in i_ + hw):
            ret = _subpixel_transpose(x, w, groups, s_, d_, new_pairs)
            return ret if bias is None else ret + bias.cast(ret.dtype).reshape((1, -1) + (1,) * n)
        if any(s > 1 for s in s_):
            pre = x.shape[:2]
            x = x.reshape(pre + tuple(v for i in i_ for v in (i, 1)))
            x = x.pad(((0, 0), (0, 0)) + tuple(v for s in s_ for v in ((0, 0), (0, s - 1))))
            x = x.reshape(pre + tuple(i * s for i, s in zip(i_, s_)))
            x = x.shrink(((0, pre[0]), (0, pre[1])) + tuple((0, (i - 1) * s + 1) for i, s in zip(i_, s_)))
        flat = [v for p in new_pairs[::-1] for v in p]
        return x.conv2d(w, bias, groups=groups, dilation=d_, padding=flat)

    # *** pooling ***

    def _pool_setup(self: Tensor, kernel_size: int | tuple[int, ...], stride: int | Sequence[int] | None,
                    dilation: int | Sequence[int], padding: int | Sequence[int], ceil_mode: bool, name: str):
        """The window geometry of a pooling op: kernel, stride, dilation, (before, after) pads per spatial dim, the
        extra right padding that ceil_mode needs, and the output sizes."""
        k_ = (kernel_size,) * 2 if isinstance(kernel_size, int) else tuple(kernel_size)
        n = len(k_)
        if self.ndim < n: raise ValueError(f"{name} with kernel {k_} needs at least {n} dims, got shape {self.shape}")
        s_ = k_ if stride is None else _int_tuple(stride, n, "stride")
        d_ = _int_tuple(dilation, n, "dilation")
        pairs = _side_pairs(_flat_pads(padding, n))
        if any(k <= 0 for k in k_) or any(s <= 0 for s in s_) or any(d <= 0 for d in d_):
            raise ValueError(f"{name}: kernel {k_}, stride {s_} and dilation {d_} must be positive")
        # (as torch: so that every window holds at least one input element)
        if any(max(b, a) > (d * (k - 1) + 1) // 2 or min(b, a) < 0 for k, d, (b, a) in zip(k_, d_, pairs)):
            raise ValueError(f"{name}: padding {padding} must be at most half the (dilated) kernel size {k_}")
        i_ = self.shape[-n:]
        o_, extra = [], []
        for i, k, s, d, (b, a) in zip(i_, k_, s_, d_, pairs):
            span = i + b + a - d * (k - 1) - 1
            o = (-(-span // s) if ceil_mode else span // s) + 1
            # the last window must start inside the input or the left padding
            if ceil_mode and (o - 1) * s >= i + b: o -= 1
            # (with ceil_mode, as torch, one window may reach past the end of an input shorter than the kernel)
            if o < 1: raise ValueError(f"{name}: kernel {k_} is larger than the padded input {i_}")
            o_.append(o)
            extra.append(max(0, (o - 1) * s + d * (k - 1) + 1 - (i + b + a)))
        return k_, s_, d_, pairs, extra, tuple(o_)

    def _windows(self: Tensor, k_, s_, d_, pairs, extra, o_, value: ConstType) -> Tensor:
        """The pooling windows (..., *out, *kernel) of this tensor padded with `value`, from _pool_setup's geometry."""
        n = len(k_)
        x = self.pad(tuple((0, 0) for _ in self.shape[:-n]) + tuple((b, a + e) for (b, a), e in zip(pairs, extra)),
                     value=value)._pool(k_, s_, d_)
        pre = x.shape[:-2 * n]
        return x.shrink(tuple((0, p) for p in pre) + tuple((0, o) for o in o_) + tuple((0, k) for k in k_))

    def avg_pool2d(self: Tensor, kernel_size: tuple[int, ...] = (2, 2), stride: int | Sequence[int] | None = None,
                   dilation: int | Sequence[int] = 1, padding: int | Sequence[int] = 0, ceil_mode: bool = False,
                   count_include_pad: bool = True) -> Tensor:
        """Average over windows of the last len(kernel_size) dims (torch.nn.functional.avg_pool2d semantics)."""
        geo = self._pool_setup(kernel_size, stride, dilation, padding, ceil_mode, "avg_pool2d")
        k_, s_, d_, pairs, extra, o_ = geo
        n = len(k_)
        x = self.cast(least_upper_float(self.dtype))
        total = x._windows(*geo, value=0.0).sum(tuple(range(-n, 0)))
        # the divisor counts the window positions inside the input (and the padding, with count_include_pad)
        Tensor = _tensor_cls()
        ones = Tensor.ones(self.shape[-n:], dtype=dtypes.float32, device=self.device)
        if count_include_pad:
            ones = ones.pad(tuple(pairs), value=1.0)
            cnt = ones._windows(k_, s_, d_, [(0, 0)] * n, extra, o_, 0.0)
        else: cnt = ones._windows(*geo, value=0.0)
        return (total / cnt.sum(tuple(range(-n, 0))).cast(total.dtype)).cast(x.dtype)

    def max_pool2d(self: Tensor, kernel_size: tuple[int, ...] = (2, 2), stride: int | Sequence[int] | None = None,
                   dilation: int | Sequence[int] = 1, padding: int | Sequence[int] = 0, ceil_mode: bool = False,
                   return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Maximum over windows of the last len(kernel_size) dims; with return_indices also the index of each maximum in
        its flattened spatial plane (as torch's, in tinygrad's dtype: dtypes.default_int)."""
        geo = self._pool_setup(kernel_size, stride, dilation, padding, ceil_mode, "max_pool2d")
        n = len(geo[0])
        if self.dtype == dtypes.bool: raise TypeError("max_pool2d of a bool tensor is not supported")
        low = float("-inf") if dtypes.is_float(self.dtype) else dtypes.min(self.dtype)
        win = self._windows(*geo, value=low)
        axes = tuple(range(-n, 0))
        # one max reduction (it fuses), whose gradient goes to each window's first maximum, as torch's
        from fusegrad.gradient import with_gradient
        plain = win.max(axes)
        # (a rule runs shard by shard, on windows cut at the shards' edges: over shards, the max's own derivative,
        # which shares the gradient among tied maxima)
        out = plain if isinstance(self.device, tuple) else \
            with_gradient(plain, (self,), _MaxPoolGradient(tuple(tuple(g) for g in geo)))
        if not return_indices: return out
        Tensor = _tensor_cls()
        spatial = self.shape[-n:]
        idx = Tensor.arange(prod(spatial), dtype=dtypes.int32, device=self.device).reshape(spatial)
        return out, _first_max(win, plain, n, idx._windows(*geo, value=prod(spatial))).cast(dtypes.default_int)

    def max_unpool2d(self: Tensor, indices: Tensor, kernel_size: tuple[int, ...] = (2, 2),
                     stride: int | Sequence[int] | None = None, dilation: int | Sequence[int] = 1,
                     padding: int | Sequence[int] = 0, output_size: Sequence[int] | None = None) -> Tensor:
        """Inverse of max_pool2d: each value goes to its index in a zero output plane (torch's max_unpool)."""
        _need_tensors("max_unpool2d", indices=indices)
        k_ = (kernel_size,) * 2 if isinstance(kernel_size, int) else tuple(kernel_size)
        n = len(k_)
        if indices.shape != self.shape:
            raise ValueError(f"max_unpool2d indices shape {indices.shape} must equal the input shape {self.shape}")
        if dtypes.is_float(indices.dtype) or indices.dtype == dtypes.bool:
            raise TypeError(f"max_unpool2d indices must be integers, got {indices.dtype}")
        if self.ndim < n: raise ValueError(f"max_unpool2d with kernel {k_} needs at least {n} dims, got {self.shape}")
        s_ = k_ if stride is None else _int_tuple(stride, n, "stride")
        d_ = _int_tuple(dilation, n, "dilation")
        pairs = _side_pairs(_flat_pads(padding, n))
        i_ = self.shape[-n:]
        if output_size is None:
            out_sp = tuple((i - 1) * s - b - a + d * (k - 1) + 1 for i, s, (b, a), d, k in zip(i_, s_, pairs, d_, k_))
        else: out_sp = tuple(output_size)[-n:]
        pre = self.shape[:-n]
        n_in, n_out = prod(i_), prod(out_sp)
        Tensor = _tensor_cls()
        hit = indices.reshape(pre + (n_in, 1)).cast(dtypes.int32) == \
            Tensor.arange(n_out, dtype=dtypes.int32, device=self.device)
        return hit.where(self.reshape(pre + (n_in, 1)), 0).sum(-2).cast(self.dtype).reshape(pre + out_sp)

    # *** resizing ***

    def interpolate(self: Tensor, size: tuple[int, ...], mode: str = "linear", align_corners: bool = False) -> Tensor:
        """Resize the last len(size) dims with mode nearest, nearest-exact or linear (bilinear, trilinear: the same,
        one dim at a time), as torch.nn.functional.interpolate with `size`. Integer images (uint8) come out in their
        dtype: as torch's, linear modes round to nearest after each dim's pass, the last dim first."""
        Tensor = _tensor_cls()
        size = tuple(size)
        if mode in ("bilinear", "trilinear"): mode = "linear"
        if mode not in ("linear", "nearest", "nearest-exact"):
            raise ValueError(f"interpolate mode must be nearest, nearest-exact, linear, bilinear or trilinear, "
                             f"got {mode!r}")
        if mode != "linear" and align_corners: raise ValueError("align_corners only applies to linear modes")
        if len(size) > self.ndim or any(not isinstance(s, int) or s <= 0 for s in size):
            raise ValueError(f"interpolate size {size} must be positive ints for at most {self.ndim} dims")
        if self.dtype == dtypes.bool: raise TypeError("interpolate of a bool tensor is not supported")
        is_int = not dtypes.is_float(self.dtype)
        # each dim is a matrix product with an (in, out) weight matrix built from index arithmetic in float32
        x = self.float()
        for j, o in reversed(list(enumerate(size))) if is_int else enumerate(size):
            d = self.ndim - len(size) + j
            i = x.shape[d]
            if i == o: continue  # every mode maps each index to itself
            up, down = o // i if o % i == 0 else 0, i // o if i % o == 0 else 0
            if mode != "linear" and (up and up & (up - 1) == 0 or down):
                # exact factors (up by a power of two, down by an integer) need no index arithmetic: torch's float32
                # source index is exact there, so nearest is a pure view (repeat, or every down-th element)
                sh = x.shape
                if up: x = x.unsqueeze(d + 1).expand(sh[:d + 1] + (up,) + sh[d + 1:]).flatten(d, d + 1)
                else:
                    pick = down // 2 if mode == "nearest-exact" else 0
                    x = x.reshape(sh[:d] + (o, down) + sh[d + 1:])
                    x = x.shrink(tuple((pick, pick + 1) if a == d + 1 else None for a in range(x.ndim)))
                    x = x.reshape(sh[:d] + (o,) + sh[d + 1:])
                continue
            if mode == "linear" and not align_corners and up > 1 and up & (up - 1) == 0 and isinstance(i, int):
                x = _upsample_linear(x, d, up)
                continue
            dst = Tensor.arange(o, dtype=dtypes.float32, device=self.device)
            src_i = Tensor.arange(i, dtype=dtypes.int32, device=self.device).reshape(i, 1)
            if mode == "linear":
                if align_corners: src = dst * ((i - 1) / (o - 1) if o > 1 else 0.0)
                else: src = ((dst + 0.5) * (i / o) - 0.5).maximum(0.0)
                lo = src.floor().cast(dtypes.int32).minimum(i - 1)
                hi = (lo + 1).minimum(i - 1)
                lam = src - lo.float()
                m = (src_i == lo).where(1 - lam, 0.0) + (src_i == hi).where(lam, 0.0)
            else:
                src = (dst + 0.5) * (i / o) if mode == "nearest-exact" else dst * (i / o)
                m = (src_i == src.floor().cast(dtypes.int32).minimum(i - 1)).float()
            x = x.transpose(d, -1).matmul(m).transpose(d, -1)
            # (an int pass's weighted sum of values >= 0 rounds half up; a sum of nearest picks is already whole)
            if is_int and mode == "linear": x = (x + 0.5).floor()
        return x.cast(self.dtype)

    # *** losses ***

    def binary_crossentropy(self: Tensor, Y: Tensor, reduction: str = "mean") -> Tensor:
        """Binary cross-entropy of probabilities `self` against targets Y (logs clamped at -100, as torch)."""
        _need_tensors("binary_crossentropy", Y=Y)
        _check_reduction(reduction)
        if Y.shape != self.shape: raise ValueError(f"binary_crossentropy target shape {Y.shape} != input {self.shape}")
        loss = -(Y * self.log().maximum(-100) + (1 - Y) * (1 - self).log().maximum(-100))
        return _reduce_loss(loss, reduction)

    def binary_crossentropy_logits(self: Tensor, Y: Tensor, reduction: str = "mean",
                                   pos_weight: Tensor | None = None) -> Tensor:
        """Binary cross-entropy of logits `self` against targets Y, computed stably (torch's BCEWithLogits)."""
        _need_tensors("binary_crossentropy_logits", Y=Y, pos_weight=pos_weight)
        _check_reduction(reduction)
        if Y.shape != self.shape:
            raise ValueError(f"binary_crossentropy_logits target shape {Y.shape} != input {self.shape}")
        # log(1 + exp(-|x|)) + max(-x, 0) is -log(sigmoid(x)) without overflow
        log_sig_neg = (1 + (-self.abs()).exp()).log() + (-self).maximum(0)
        coef = 1 if pos_weight is None else 1 + (pos_weight - 1) * Y
        return _reduce_loss((1 - Y) * self + coef * log_sig_neg, reduction)

    def _one_hot_of(self: Tensor, num_classes: int) -> Tensor:
        Tensor = _tensor_cls()
        u, d = self.uop, self.device
        if type(d) is str and type(num_classes) is int and 0 < num_classes <= 2**31 and \
                all(type(s) is int for s in u.shape):
            # (the nodes of the general expression below, made without its checks: a training step asks every time)
            check_size((num_classes,), dtypes.int32, d)
            classes = Tensor(UOp(Ops.RANGE, dtypes.int32, (UOp(Ops.DEVICE, arg=d),), num_classes))
            return Tensor(u.reshape(u.shape + (1,))).cast(dtypes.int32) == classes
        return self.unsqueeze(-1).cast(dtypes.int32) == Tensor.arange(num_classes, dtype=dtypes.int32,
                                                                       device=self.device)

    def sparse_categorical_crossentropy(self: Tensor, Y: Tensor, ignore_index: int = -1, label_smoothing: float = 0.0,
                                        reduction: str = "mean") -> Tensor:
        """Cross-entropy of logits (..., C) against integer labels (...); labels equal to ignore_index don't count."""
        _need_tensors("sparse_categorical_crossentropy", Y=Y)
        _check_reduction(reduction)
        if self.ndim == 0 or Y.shape != self.shape[:-1]:
            raise ValueError(f"sparse_categorical_crossentropy labels shape {Y.shape} must be the logits shape "
                             f"{self.shape} without its last dim")
        if dtypes.is_float(Y.dtype) or Y.dtype == dtypes.bool:
            raise TypeError(f"sparse_categorical_crossentropy labels must be integers, got {Y.dtype}")
        if not 0.0 <= label_smoothing <= 1.0: raise ValueError(f"label_smoothing must be in [0, 1]: {label_smoothing}")
        from fusegrad.tensor.indexing import _check_index_values
        _check_index_values(Y, self.shape[-1], self.ndim - 1, negatives=False, name="target", ignore=ignore_index)
        # (without smoothing, one COMPOSITE node: a smoothing factor is a number a loop may change, so it's built)
        if label_smoothing == 0: return self._sparse_cross_entropy_node(Y, ignore_index, reduction)
        return templated(_tensor_cls()._sparse_ce_graph, (self, Y), (ignore_index, label_smoothing, reduction))

    @composite(shaped=True)
    def _sparse_cross_entropy_node(self: Tensor, Y: Tensor, ignore_index: int, reduction: str) -> Tensor:
        return templated(_tensor_cls()._sparse_ce_graph, (self, Y), (ignore_index, 0.0, reduction))

    def _sparse_ce_graph(self: Tensor, Y: Tensor, ignore_index: int, label_smoothing: float,
                         reduction: str) -> Tensor:
        """sparse_categorical_crossentropy's graph, its arguments checked."""
        logp = self.log_softmax(-1)
        mask = Y != ignore_index
        picked = Y._one_hot_of(self.shape[-1]).where(logp, 0.0)
        if label_smoothing == 0 and reduction == "mean" and not 0 <= ignore_index < self.shape[-1]:
            # an ignored label matches no class, so its row picks nothing: the mean is one sum over every row and
            # class (fewer operations to build and to differentiate on every training step)
            return -picked.sum() / mask.sum().cast(picked.dtype)
        nll = -picked.sum(-1)
        # (without smoothing the mean of logp isn't computed at all: 0 times an infinite mean would be nan)
        per = nll if label_smoothing == 0 else (1 - label_smoothing) * nll + label_smoothing * -logp.mean(-1)
        loss = mask.where(per, 0.0)
        if reduction == "mean": return loss.sum() / mask.sum().cast(loss.dtype)
        return _reduce_loss(loss, reduction)

    def cross_entropy(self: Tensor, Y: Tensor, reduction: str = "mean", label_smoothing: float = 0.0,
                      ignore_index: int = -100) -> Tensor:
        """Cross-entropy of logits (class dim 1, or 0 for 1-d input) against class indices or class probabilities."""
        _need_tensors("cross_entropy", Y=Y)
        _check_reduction(reduction)
        if self.ndim == 0: raise ValueError("cross_entropy input needs at least 1 dim (the classes)")
        if not 0.0 <= label_smoothing <= 1.0: raise ValueError(f"label_smoothing must be in [0, 1]: {label_smoothing}")
        cdim = 1 if self.ndim >= 2 else 0
        x = self.transpose(cdim, -1) if self.ndim > 2 else self
        if Y.shape == self.shape and dtypes.is_float(Y.dtype):
            logp = x.log_softmax(-1)
            nc = self.shape[cdim]
            y = (Y.transpose(cdim, -1) if self.ndim > 2 else Y) * (1 - label_smoothing) + label_smoothing / nc
            return _reduce_loss(-(y * logp).sum(-1), reduction)
        expected = self.shape[:cdim] + self.shape[cdim + 1:]
        if Y.shape != expected:
            raise ValueError(f"cross_entropy target shape {Y.shape} must be {expected} (class indices) or {self.shape} "
                             f"(probabilities)")
        return x.sparse_categorical_crossentropy(Y, ignore_index, label_smoothing, reduction)

    def nll_loss(self: Tensor, Y: Tensor, weight: Tensor | None = None, ignore_index: int | None = None,
                 reduction: str = "mean") -> Tensor:
        """Negative log likelihood of log-probabilities (class dim 1, or 0 for 1-d input) at integer labels Y."""
        _need_tensors("nll_loss", Y=Y, weight=weight)
        _check_reduction(reduction)
        if self.ndim == 0: raise ValueError("nll_loss input needs at least 1 dim (the classes)")
        cdim = 1 if self.ndim >= 2 else 0
        nc = self.shape[cdim]
        expected = self.shape[:cdim] + self.shape[cdim + 1:]
        if Y.shape != expected: raise ValueError(f"nll_loss target shape {Y.shape} must be {expected}")
        if dtypes.is_float(Y.dtype) or Y.dtype == dtypes.bool:
            raise TypeError(f"nll_loss target must be integers, got {Y.dtype}")
        if weight is not None and weight.shape != (nc,):
            raise ValueError(f"nll_loss weight must have shape ({nc},), got {weight.shape}")
        from fusegrad.tensor.indexing import _check_index_values
        _check_index_values(Y, nc, cdim, negatives=False, name="target", ignore=ignore_index)
        x = self.transpose(cdim, -1) if self.ndim > 2 else self
        oh = Y._one_hot_of(nc)
        w = oh.where(weight if weight is not None else 1.0, 0.0)
        if ignore_index is not None: w = (Y != ignore_index).unsqueeze(-1).where(w, 0.0)
        loss = -(w * x).sum(-1)
        if reduction == "mean": return loss.sum() / w.sum().cast(loss.dtype)
        return _reduce_loss(loss, reduction)

    # *** attention ***

    def scaled_dot_product_attention(self: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                     dropout_p: float = 0.0, is_causal: bool = False,
                                     enable_gqa: bool = False) -> Tensor:
        """softmax(q k^T / sqrt(E) + mask) v over (..., L, E) queries and (..., S, E) keys/values; dropout applies
        only while Tensor.training."""
        _need_tensors("scaled_dot_product_attention", key=key, value=value, attn_mask=attn_mask)
        Tensor = _tensor_cls()
        q, k, v = self, key, value
        if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
            raise ValueError(f"scaled_dot_product_attention needs tensors of at least 2 dims, got {q.shape}, "
                             f"{k.shape}, {v.shape}")
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"scaled_dot_product_attention shape mismatch: query {q.shape}, key {k.shape}, "
                             f"value {v.shape}")
        if is_causal and attn_mask is not None: raise ValueError("give either attn_mask or is_causal, not both")
        if not 0.0 <= dropout_p <= 1.0: raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
        if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
            if q.shape[-3] % k.shape[-3]:
                raise ValueError(f"enable_gqa: {q.shape[-3]} query heads aren't a multiple of {k.shape[-3]} key heads")
            r = q.shape[-3] // k.shape[-3]
            def rep(t: Tensor) -> Tensor:
                return t.unsqueeze(-3).expand(t.shape[:-2] + (r,) + t.shape[-2:]).flatten(-4, -3)
            k, v = rep(k), rep(v)
        scores = q.matmul(k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
        L, S = q.shape[-2], k.shape[-2]
        if is_causal:
            attn_mask = Tensor.arange(L, device=q.device).reshape(L, 1) >= Tensor.arange(S, device=q.device)
        if attn_mask is not None:
            if attn_mask.dtype == dtypes.bool: scores = attn_mask.where(scores, float("-inf"))
            else: scores = scores + attn_mask
        w = scores.softmax(-1)
        if dropout_p and Tensor.training:
            w = w.dropout(dropout_p)
        return w.cast(v.dtype).matmul(v)

    # *** normalization ***

    def normalize(self: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
        """Divide by the p-norm along `dim` (at least eps), as torch.nn.functional.normalize."""
        if p == float("inf"): norm = self.abs().max(dim, keepdim=True)
        elif p == 1: norm = self.abs().sum(dim, keepdim=True)
        else:
            # integer powers multiply (no log of 0), and a zero norm takes no root, so a zero vector's gradient stays
            # finite as in torch
            s = self.abs().pow(int(p) if float(p).is_integer() and 0 < p <= 8 else p).sum(dim, keepdim=True)
            zero = s == 0
            norm = zero.where(0.0, zero.where(1.0, s).pow(1 / p))
        return self / norm.maximum(eps)

    def layernorm(self: Tensor, axis: int | tuple[int, ...] = -1, eps: float = 1e-5) -> Tensor:
        """(x - mean) / sqrt(var + eps) over `axis`, with the biased variance (no affine part)."""
        return templated(_tensor_cls()._layernorm_graph, (self,), (axis, eps))

    def _layernorm_graph(self: Tensor, axis: int | tuple[int, ...], eps: float) -> Tensor:
        y = self - self.mean(axis, keepdim=True)
        return y * (y.square().mean(axis, keepdim=True) + eps).rsqrt()

    def batchnorm(self: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor,
                  axis: int | tuple[int, ...] = 1) -> Tensor:
        """(x - mean) * invstd * weight + bias, where the statistics run along `axis` (the channels)."""
        from fusegrad.tensor import _resolve_axis
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        axes = tuple(_resolve_axis(a, self.ndim) for a in axes)
        shape = tuple(s if i in axes else 1 for i, s in enumerate(self.shape))
        def fit(t: Tensor, name: str) -> Tensor:
            if t.numel() != prod(shape):
                raise ValueError(f"batchnorm {name} of shape {t.shape} doesn't match the channels {shape} of "
                                 f"input {self.shape}")
            return t.reshape(shape)
        x = self - fit(mean, "mean")
        if weight is not None: x = x * fit(weight, "weight")
        ret = x * fit(invstd, "invstd")
        return ret + fit(bias, "bias") if bias is not None else ret

    # *** composition ***

    def linear(self: Tensor, weight: Tensor, bias: Tensor | None = None, dtype: DType | str | None = None) -> Tensor:
        """self @ weight + bias (a 1-d weight multiplies elementwise), optionally computed in `dtype`."""
        x = self.cast(dtype) if dtype is not None else self
        w = weight.cast(dtype) if dtype is not None else weight
        out = x.mul(w) if w.ndim == 1 else x.dot(w)
        return out.add(bias.cast(out.dtype) if dtype is not None else bias) if bias is not None else out

    def newton_schulz(self: Tensor, steps: int, params: tuple[float, ...], eps: float = 1e-7) -> Tensor:
        """The Newton-Schulz iteration toward the orthogonal factor of the last two dims (Muon's update):
        X <- sum_i params[i] * (X X^T)^i X, starting from X / (||X||_F + eps), on the wide orientation."""
        if self.ndim < 2: raise ValueError(f"newton_schulz needs at least 2 dims, got shape {self.shape}")
        if not isinstance(steps, int) or steps < 0: raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        if len(params) == 0: raise ValueError("newton_schulz needs at least one coefficient in params")
        if self.shape[-2] > self.shape[-1]:
            return self.transpose(-2, -1).newton_schulz(steps, params, eps).transpose(-2, -1)
        x = self / (self.square().sum(axis=(-2, -1), keepdim=True).sqrt() + eps)
        for _ in range(steps):
            gram, term, acc = x @ x.transpose(-2, -1), x, x * params[0]
            for p in params[1:]:
                term = gram @ term
                acc = acc + p * term
            x = acc
        return x

    def sequential(self: Tensor, ll: list[Callable[[Tensor], Tensor]]) -> Tensor:
        """Apply each callable in turn."""
        x = self
        for f in ll: x = f(x)
        return x

    @staticmethod
    def einsum(formula: str, *operands: Tensor | Sequence[Tensor], dtype: DType | str | None = None) -> Tensor:
        """Einstein summation ('ij,jk->ik', '...' broadcasting, repeated letters in an operand take its diagonal)."""
        return _einsum(formula, *operands, dtype=dtype)

def _einsum(formula: str, *operands: Tensor | Sequence[Tensor], dtype: DType | str | None = None) -> Tensor:
    ops = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else list(operands)
    if not ops: raise ValueError("einsum needs at least one operand")
    formula = formula.replace(" ", "")
    lhs, out = formula.split("->") if "->" in formula else (formula, None)
    specs = lhs.split(",")
    if len(specs) != len(ops): raise ValueError(f"einsum formula {formula!r} has {len(specs)} operands, "
                                                f"got {len(ops)} tensors")
    # '...' becomes private labels, aligned to the right like broadcasting
    n_ell = 0
    for sp, t in zip(specs, ops):
        if "..." in sp: n_ell = max(n_ell, t.ndim - (len(sp) - 3))
    ell = [chr(0x4e00 + j) for j in range(n_ell)]
    labels: list[list[str]] = []
    for sp, t in zip(specs, ops):
        if sp.count("...") > 1: raise ValueError(f"einsum operand {sp!r} has more than one '...'")
        if "..." in sp:
            a, b = sp.split("...")
            m = t.ndim - len(a) - len(b)
            if m < 0: raise ValueError(f"einsum operand {sp!r} has more labels than the {t.ndim} dims of its tensor")
            lab = list(a) + ell[n_ell - m:] + list(b)
        else: lab = list(sp)
        if any(not (c.isalpha() and c.isascii()) for c in lab if c not in ell):
            raise ValueError(f"einsum labels must be letters, got {sp!r}")
        if len(lab) != t.ndim:
            raise ValueError(f"einsum operand {sp!r} has {len(lab)} labels for a tensor of {t.ndim} dims {t.shape}")
        labels.append(lab)
    if out is None:
        counts: dict[str, int] = {}
        for lab in labels:
            for c in lab: counts[c] = counts.get(c, 0) + 1
        out_l = ell + sorted(c for c, v in counts.items() if v == 1 and c not in ell)
    else:
        if out.count("...") > 1: raise ValueError(f"einsum output {out!r} has more than one '...'")
        out_l = list(out.replace("...", "\0")) if "..." in out else list(out)
        if "\0" in out_l:
            i = out_l.index("\0")
            out_l = out_l[:i] + ell + out_l[i + 1:]
        elif ell: raise ValueError(f"einsum output {out!r} must contain '...' when the operands do")
        if len(set(out_l)) != len(out_l): raise ValueError(f"einsum output {out!r} repeats a label")
        every = {c for lab in labels for c in lab}
        for c in out_l:
            if c not in every: raise ValueError(f"einsum output label {c!r} doesn't appear in any operand")
    summed = sorted({c for lab in labels for c in lab} - set(out_l))
    order = out_l + summed
    sizes: dict[str, int] = {}
    aligned = []
    for lab, t in zip(labels, ops):
        # a label repeated within an operand takes the diagonal
        while len(set(lab)) != len(lab):
            c = next(c for c in lab if lab.count(c) > 1)
            i, j = [p for p, x in enumerate(lab) if x == c][:2]
            if t.shape[i] != t.shape[j]:
                raise ValueError(f"einsum label {c!r} repeated in one operand with sizes {t.shape[i]} and {t.shape[j]}")
            rest = [p for p in range(t.ndim) if p not in (i, j)]
            t = t.permute(rest + [i, j])
            n = t.shape[-1]
            t = t.reshape(t.shape[:-2] + (n * n,)).pad(tuple((0, 0) for _ in rest) + ((0, n),))
            t = t.reshape(t.shape[:-1] + (n, n + 1))
            t = t.shrink(tuple((0, s) for s in t.shape[:-2]) + ((0, n), (0, 1)))
            t = t.reshape(t.shape[:-2] + (n,))
            lab = [lab[p] for p in rest] + [c]
        for c, s in zip(lab, t.shape):
            if s != 1 and sizes.get(c, 1) not in (1, s):
                raise ValueError(f"einsum label {c!r} has sizes {sizes[c]} and {s} in different operands")
            if s != 1 or c not in sizes: sizes[c] = s
        t = t.permute([lab.index(c) for c in order if c in lab])
        aligned.append(t.reshape(tuple(t.shape[[c for c in order if c in lab].index(c)] if c in lab else 1
                                       for c in order)))
    out_dt = to_dtype(dtype) if dtype is not None else least_upper_dtype(*(t.dtype for t in aligned))
    full = tuple(sizes[c] for c in order)
    prodt = aligned[0].cast(out_dt).expand(full)
    for t in aligned[1:]: prodt = prodt * t.cast(out_dt).expand(full)
    ret = prodt.sum(tuple(range(len(out_l), len(order)))) if summed else prodt
    return ret.cast(out_dt)
