"""A seeded differential fuzzer of small random ONNX graphs: OnnxRunner against onnxruntime (CPU).

A graph is 2-8 default-domain nodes built with `onnx.helper` over the ops the runner implements (elementwise and
comparison ops with broadcasting, reductions, convolutions and pools with their padding attributes, MatMul / Gemm,
movement ops, gathers and scatters, Pad, CumSum, TopK, normalizations, Resize, Einsum, ...), at an opset drawn between
13 and the newest onnxruntime runs. Each node's output shapes come from onnx's shape inference, which the next node's
builder reads. The model runs in onnxruntime and in OnnxRunner on the same random inputs, then three times through
`OnnxRunner.jit()` (a plain call, the capture, a replay) with new inputs, each compared with onnxruntime.

The generator keeps only models that onnxruntime runs and that are well conditioned: run again on inputs perturbed by
a relative 1e-5, onnxruntime's float outputs move by less than a tenth of the tolerance and its integer and bool
outputs not at all (so a comparison, a Floor or an ArgMax never sits on a rounding boundary), without NaNs. Otherwise
it draws the next model from the same seed's generator.

Replay a failure with `python -m test.onnx.test_fuzz_onnx SEED [--save PATH]`; `python -m test.onnx.test_fuzz_onnx
A-B` surveys seeds A..B-1 and prints the failing ones."""
from __future__ import annotations

import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(4)   # (models it refuses are drawn again: no log of them)
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusegrad.onnx import OnnxRunner  # noqa: E402
from fusegrad.onnx import layout  # noqa: E402

OPSETS = (13, 14, 15, 17, 18, 19, 21, 23)
IR_VERSION = 9
FLOAT, INT64, INT32, BOOL, DOUBLE = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL, \
    TensorProto.DOUBLE
NP = {FLOAT: np.float32, DOUBLE: np.float64, INT64: np.int64, INT32: np.int32, BOOL: np.bool_}
FLOATS = (FLOAT, DOUBLE)
INTS = (INT64, INT32)
# (rtol, atol relative to the output's largest magnitude) per element type; integers and bools compare exactly
TOL = {FLOAT: 2e-4, DOUBLE: 1e-9}
PERTURB = 1e-5
MAX_NUMEL = 4096


class Reject(Exception):
    """The builder can't make this node (no suitable value, or onnx rejects it): the generator tries another."""


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: int


@dataclass
class InputSpec:
    """How a graph input's data is drawn: floats, ints in [lo, hi), bools, or `unique` indices in [0, hi) that don't
    repeat along `axis` (a scatter's, whose result would otherwise depend on the order of its writes)."""
    name: str
    shape: tuple[int, ...]
    dtype: int
    lo: int = -3
    hi: int = 4
    unique_axis: int | None = None

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        if self.dtype in FLOATS: return rng.uniform(-2.0, 2.0, self.shape).astype(NP[self.dtype])
        if self.dtype == BOOL: return rng.random(self.shape) < 0.5
        if self.unique_axis is not None:
            ax = self.unique_axis
            keys = rng.random(self.shape[:ax] + (self.hi,) + self.shape[ax + 1:])
            return np.argsort(keys, axis=ax).take(range(self.shape[ax]), axis=ax).astype(NP[self.dtype])
        return rng.integers(self.lo, self.hi, self.shape).astype(NP[self.dtype])


@dataclass
class Case:
    seed: int
    opset: int
    model: Any
    inputs: list[InputSpec]
    small_regions: bool   # channels-last regions from convolutions of any size (layout's threshold lowered)
    symbolic: bool        # the first dim of the float inputs named, so the runner binds it as a Variable
    tries: int = 0


@dataclass
class Gen:
    rng: random.Random
    opset: int
    values: list[Value] = field(default_factory=list)
    nodes: list[Any] = field(default_factory=list)
    inits: list[Any] = field(default_factory=list)
    inputs: list[InputSpec] = field(default_factory=list)
    n: int = 0

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    # -- operands ------------------------------------------------------------------------------------------------------
    def pick(self, ok: Callable[[Value], bool] = lambda v: True, dtypes: tuple[int, ...] = FLOATS) -> Value:
        """An existing value (later ones more likely, so nodes chain) of one of `dtypes` passing `ok`."""
        cands = [v for v in self.values if v.dtype in dtypes and ok(v)]
        if not cands: raise Reject("no operand")
        weights = [1 + 2 * i for i in range(len(cands))]
        return self.rng.choices(cands, weights)[0]

    def data(self, shape: tuple[int, ...], dtype: int = FLOAT, lo: int = -3, hi: int = 4,
             unique_axis: int | None = None, init: bool | None = None) -> str:
        """A new operand of random values: an initializer or a graph input (drawn per call)."""
        if init is None: init = self.rng.random() < 0.5
        spec = InputSpec(self.name("in" if not init else "w"), tuple(shape), dtype, lo, hi, unique_axis)
        if init:
            arr = spec.draw(np.random.default_rng(self.rng.randrange(1 << 30)))
            self.inits.append(numpy_helper.from_array(np.asarray(arr), spec.name))
        else: self.inputs.append(spec)
        return spec.name

    def const(self, arr: Any, dtype: Any = np.int64) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr, dtype=dtype), name))
        return name

    def ints_operand(self, vals: list[int], attr: str, since: int, attrs: dict[str, Any], inputs: list[str]) -> None:
        """A list of ints given as an input from opset `since` on, as the attribute `attr` before."""
        if self.opset >= since: inputs.append(self.const(vals))
        else: attrs[attr] = vals

    # -- nodes ---------------------------------------------------------------------------------------------------------
    def add(self, op: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> list[Value]:
        """Append a node; its outputs' shapes and types come from onnx's shape inference (Reject where it fails, or a
        shape is not fully known)."""
        outs = [self.name("v") for _ in range(n_out)]
        node = helper.make_node(op, inputs, outs, **{k: v for k, v in attrs.items() if v is not None})
        # (the graph's output is a value of a known type: the checker refuses an output without one)
        first = self.values[0]
        graph = helper.make_graph(self.nodes + [node], "g", [_vi(s.name, s.dtype, s.shape) for s in self.inputs],
                                  [_vi(first.name, first.dtype, first.shape)], initializer=self.inits)
        model = _model(graph, self.opset)
        try:
            onnx.checker.check_model(model)
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as e: raise Reject(f"{op}: {e}") from None
        known = {vi.name: vi.type.tensor_type for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
        made = []
        for o in outs:
            tt = known.get(o)
            if tt is None or not tt.elem_type or not tt.HasField("shape") or \
                    any(not d.HasField("dim_value") for d in tt.shape.dim):
                raise Reject(f"{op}: output shape unknown")
            shape = tuple(d.dim_value for d in tt.shape.dim)
            if tt.elem_type not in NP or int(np.prod(shape)) > MAX_NUMEL: raise Reject(f"{op}: {shape} {tt.elem_type}")
            made.append(Value(o, shape, tt.elem_type))
        self.nodes.append(node)
        self.values.extend(made)
        return made


def _vi(name: str, dtype: int, shape: tuple[Any, ...] | None) -> Any:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(graph: Any, opset: int) -> Any:
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


# ---------------------------------------------------------------------------------------------------------------------
# helpers for shapes

def bcast_partner(g: Gen, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape`: a suffix of it with some dims 1, sometimes with a dim of 1 in `shape`
    made larger (both sides broadcast) or leading dims added."""
    r = g.rng
    k = r.randint(0, len(shape))
    out = [d if r.random() < 0.6 else 1 for d in shape[len(shape) - k:]]
    for i, d in enumerate(out):
        if shape[len(shape) - k + i] == 1 and r.random() < 0.3: out[i] = r.randint(2, 3)
    if r.random() < 0.15 and len(shape) < 4: out = [r.randint(1, 3)] + [d for d in shape] if k == len(shape) else out
    return tuple(out)


def rand_axes(g: Gen, rank: int, min_n: int = 1) -> list[int]:
    n = g.rng.randint(min(min_n, rank), rank)
    axes = g.rng.sample(range(rank), n)
    return [a - rank if g.rng.random() < 0.4 else a for a in axes]


def any_axis(g: Gen, rank: int) -> int:
    a = g.rng.randrange(rank)
    return a - rank if g.rng.random() < 0.4 else a


def numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape))


# ---------------------------------------------------------------------------------------------------------------------
# op builders: each adds one node (or a few) or raises Reject

UNARY = ["Abs", "Neg", "Relu", "Sigmoid", "Tanh", "Exp", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "Erf",
         "Softplus", "Softsign", "Selu", "HardSwish", "Mish", "Atan", "Asinh", "Identity"]
POSITIVE = ["Sqrt", "Log", "Reciprocal", "Acosh"]   # fed from |x| + 1, inside their domain


def b_unary(g: Gen) -> None:
    x = g.pick()
    op = g.rng.choice(UNARY + ["Elu", "LeakyRelu", "HardSigmoid", "Celu", "ThresholdedRelu", "Gelu", "Shrink"])
    attrs: dict[str, Any] = {}
    if op in ("Elu", "LeakyRelu", "Celu"): attrs["alpha"] = g.rng.choice([0.1, 0.5, 1.0, 2.0])
    if op == "HardSigmoid": attrs.update(alpha=g.rng.choice([0.2, 0.5]), beta=g.rng.choice([0.5, 0.3]))
    if op == "ThresholdedRelu": attrs["alpha"] = g.rng.choice([0.0, 0.5, 1.0])
    if op == "Shrink": attrs.update(lambd=g.rng.choice([0.0, 0.5, 1.5]), bias=g.rng.choice([0.0, 0.5]))
    if op == "Gelu":
        if g.opset < 20: raise Reject("Gelu")
        attrs["approximate"] = g.rng.choice(["none", "tanh"])
    if op == "Celu" and x.dtype != FLOAT: raise Reject("Celu is float32 only")
    g.add(op, [x.name], **attrs)


def b_positive(g: Gen) -> None:
    x = g.pick()
    (a,) = g.add("Abs", [x.name])
    one = g.const(np.array(1.0), NP[x.dtype])
    (p,) = g.add("Add", [a.name, one])
    g.add(g.rng.choice(POSITIVE), [p.name])


def b_clip(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS)
    ins = [x.name]
    lo, hi = g.rng.choice([(-1, 1), (None, 0.5), (0, None), (-0.5, 2)])
    ins.append(g.const(np.array(lo), NP[x.dtype]) if lo is not None else "")
    if hi is not None: ins.append(g.const(np.array(hi), NP[x.dtype]))
    g.add("Clip", ins)


BINARY = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Mean", "Sum", "Pow", "PRelu"]
COMPARE = ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]


def _partner(g: Gen, x: Value, dtype: int) -> str:
    """Another operand broadcasting with x: an existing value of a compatible shape, or new data."""
    def compatible(v: Value) -> bool:
        try: np.broadcast_shapes(v.shape, x.shape)
        except ValueError: return False
        return v.name != x.name and numel(np.broadcast_shapes(v.shape, x.shape)) <= MAX_NUMEL
    if g.rng.random() < 0.4:
        try: return g.pick(compatible, (dtype,)).name
        except Reject: pass
    return g.data(bcast_partner(g, x.shape), dtype, lo=1 if dtype in INTS else -3)


def b_binary(g: Gen) -> None:
    op = g.rng.choice(BINARY)
    x = g.pick(dtypes=FLOATS + INTS if op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Sum") else FLOATS)
    if op == "Pow":
        (a,) = g.add("Abs", [x.name])
        (base,) = g.add("Add", [a.name, g.const(np.array(0.5), NP[x.dtype])])
        g.add("Pow", [base.name, g.data(bcast_partner(g, x.shape), g.rng.choice([x.dtype, INT64]), lo=-2, hi=3)])
        return
    if op == "PRelu":   # the slope broadcasts to x (unidirectionally)
        shape = tuple(d if g.rng.random() < 0.5 else 1 for d in x.shape[g.rng.randint(0, len(x.shape)):])
        g.add("PRelu", [x.name, g.data(shape, x.dtype)])
        return
    if op == "Div" and x.dtype in INTS:   # a divisor that is never 0 (integer division truncates in both)
        g.add("Div", [x.name, g.data(bcast_partner(g, x.shape), x.dtype, lo=1, hi=4)])
        return
    if op == "Div":   # a divisor away from 0
        (a,) = g.add("Abs", [_partner(g, x, x.dtype)])
        (d,) = g.add("Add", [a.name, g.const(np.array(0.25), NP[x.dtype])])
        ins = [x.name, d.name]
    elif op in ("Mean", "Sum", "Max", "Min") and g.rng.random() < 0.3:
        ins = [x.name] + [_partner(g, x, x.dtype) for _ in range(g.rng.randint(0, 2))]
    else: ins = [x.name, _partner(g, x, x.dtype)]
    if g.rng.random() < 0.5: ins = ins[::-1]
    g.add(op, ins)


def b_compare(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS)
    (c,) = g.add(g.rng.choice(COMPARE), [x.name, _partner(g, x, x.dtype)])
    r = g.rng.random()
    if r < 0.4:   # logic on the result, or a Where choosing by it
        g.add(g.rng.choice(["And", "Or", "Xor"]), [c.name, g.data(bcast_partner(g, c.shape), BOOL)])
    elif r < 0.5: g.add("Not", [c.name])
    elif r < 0.8:
        y = g.pick(dtypes=FLOATS + INTS)
        try: np.broadcast_shapes(c.shape, y.shape)
        except ValueError: y = x
        g.add("Where", [c.name, y.name, _partner(g, y, y.dtype)])
    else: g.add("Cast", [c.name], to=g.rng.choice([FLOAT, INT64, INT32]))


def b_mod(g: Gen) -> None:
    if g.rng.random() < 0.5:
        x = g.pick(dtypes=INTS)
        g.add("Mod", [x.name, g.data(bcast_partner(g, x.shape), x.dtype, lo=1, hi=5)], fmod=g.rng.choice([0, 1]))
        return
    x = g.pick(dtypes=FLOATS)
    (a,) = g.add("Abs", [_partner(g, x, x.dtype)])
    (d,) = g.add("Add", [a.name, g.const(np.array(0.5), NP[x.dtype])])
    g.add("Mod", [x.name, d.name], fmod=1)


def b_cast(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS + (BOOL,))
    to = g.rng.choice([FLOAT, DOUBLE, INT64, INT32, BOOL])
    if x.dtype in FLOATS and to in INTS:   # (a float far from an integer boundary: Round first)
        (x,) = g.add("Round", [x.name])
    g.add("Cast", [x.name], to=to)


REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare",
          "ReduceLogSumExp"]


def b_reduce(g: Gen) -> None:
    op = g.rng.choice(REDUCE + ["ReduceLogSum"])
    x = g.pick(dtypes=FLOATS + INTS if op in ("ReduceSum", "ReduceMax", "ReduceMin") else FLOATS)
    if op == "ReduceLogSum":
        (a,) = g.add("Abs", [x.name])
        (x,) = g.add("Add", [a.name, g.const(np.array(0.5), NP[x.dtype])])
    # (the mean of nothing is undefined in the spec: onnxruntime gives 0, the runner NaN, as NumPy)
    if op == "ReduceMean" and 0 in x.shape: raise Reject("ReduceMean of an empty tensor")
    attrs: dict[str, Any] = {"keepdims": g.rng.choice([0, 1])}
    ins = [x.name]
    since = 13 if op == "ReduceSum" else 18
    r = g.rng.random()
    if r < 0.15 and x.shape:   # no axes: every axis, or none with noop_with_empty_axes
        if g.opset >= since and g.rng.random() < 0.5:
            attrs["noop_with_empty_axes"] = 1
            if g.rng.random() < 0.5: ins.append(g.const(np.zeros(0)))
    elif x.shape: g.ints_operand(rand_axes(g, len(x.shape)), "axes", since, attrs, ins)
    g.add(op, ins, **attrs)


def b_argmax(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS)
    g.add(g.rng.choice(["ArgMax", "ArgMin"]), [x.name], axis=any_axis(g, len(x.shape)),
          keepdims=g.rng.choice([0, 1]), select_last_index=g.rng.choice([0, 1]))


def b_topk(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS)
    axis = any_axis(g, len(x.shape))
    k = g.rng.randint(0, x.shape[axis])
    attrs = {"axis": axis}
    if g.rng.random() < 0.5: attrs["largest"] = g.rng.choice([0, 1])
    vals, idx = g.add("TopK", [x.name, g.const([k])], 2, **attrs)
    if g.rng.random() < 0.3:   # the indices feed a gather
        g.add("GatherElements", [x.name, idx.name], axis=axis)


def b_softmax(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0)
    op = g.rng.choice(["Softmax", "LogSoftmax", "Hardmax"])
    g.add(op, [x.name], axis=any_axis(g, len(x.shape)) if g.rng.random() < 0.8 else None)


def b_cumsum(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS)
    axis = any_axis(g, len(x.shape))
    g.add("CumSum", [x.name, g.const(np.array(axis), g.rng.choice([np.int64, np.int32]))],
          exclusive=g.rng.choice([0, 1]), reverse=g.rng.choice([0, 1]))


def _image(g: Gen, spatial: int | None = None) -> Value:
    """An (N, C, spatial...) float value: an existing one, or a new input."""
    def ok(v: Value) -> bool:
        return len(v.shape) in ((3, 4) if spatial is None else (spatial + 2,)) and min(v.shape) > 0 and \
            v.dtype == FLOAT
    if g.rng.random() < 0.85:
        try: return g.pick(ok, (FLOAT,))
        except Reject: pass
    sp = spatial or g.rng.choice([1, 2, 2])
    shape = (g.rng.randint(1, 2), g.rng.randint(1, 6)) + tuple(g.rng.randint(3, 9) for _ in range(sp))
    name = g.data(shape, FLOAT, init=False)
    return Value(name, shape, FLOAT)


def _window_attrs(g: Gen, spatial: tuple[int, ...], kernel: list[int], dil: bool = True) -> dict[str, Any]:
    n = len(spatial)
    attrs: dict[str, Any] = {}
    if g.rng.random() < 0.6: attrs["strides"] = [g.rng.choice([1, 1, 2, 3]) for _ in range(n)]
    if dil and g.rng.random() < 0.4: attrs["dilations"] = [g.rng.choice([1, 2]) for _ in range(n)]
    r = g.rng.random()
    # (no dilations with SAME padding: onnxruntime refuses them in Conv, and its MaxPool makes another output size than
    # the spec's ceil(input / stride), as does onnx's reference: (2, 2, 8, 4) with a 1x2 window dilated (1, 2) and
    # strides (3, 1) gives (3, 4) in the spec, (3, 3) in onnxruntime and (2, 4) in the reference)
    if r < 0.3 and "dilations" in attrs: attrs["auto_pad"] = "VALID"
    elif r < 0.3: attrs["auto_pad"] = g.rng.choice(["SAME_UPPER", "SAME_LOWER", "VALID"])
    elif r < 0.7: attrs["pads"] = [g.rng.randint(0, k - 1) for k in kernel] + [g.rng.randint(0, k - 1) for k in kernel]
    return attrs


def b_conv(g: Gen) -> None:
    x = _image(g)
    n, c, *sp = x.shape
    group = g.rng.choice([d for d in (1, 1, 2, 3, c) if c % d == 0])
    cout = group * g.rng.randint(1, 3) if g.rng.random() < 0.7 else g.rng.choice([8, 16])
    if cout % group: cout = group
    kernel = [g.rng.randint(1, min(3, s)) for s in sp]
    attrs = _window_attrs(g, tuple(sp), kernel)
    if group > 1: attrs["group"] = group
    if len(sp) == 2 and g.rng.random() < 0.6:
        # a strided dense convolution with whole vectors of output channels: one that begins a channels-last region
        # (layout.starts_region), where the threshold on its size allows
        group, cout, kernel = 1, g.rng.choice([8, 16]), [min(g.rng.choice([2, 3]), d) for d in sp]
        attrs = {"strides": [2, 2], "pads": [g.rng.randint(0, k - 1) for k in kernel * 2]}
    if g.rng.random() < 0.5: attrs["kernel_shape"] = kernel
    ins = [x.name, g.data((cout, c // group, *kernel), FLOAT, init=g.rng.random() < 0.8)]
    if g.rng.random() < 0.5: ins.append(g.data((cout,), FLOAT))
    g.add("Conv", ins, **attrs)


def b_conv_transpose(g: Gen) -> None:
    x = _image(g)
    n, c, *sp = x.shape
    group = g.rng.choice([d for d in (1, 1, 2, c) if c % d == 0])
    cout = g.rng.randint(1, 3)
    kernel = [g.rng.randint(1, 3) for _ in sp]
    attrs = _window_attrs(g, tuple(sp), kernel)
    # (no SAME padding, and no output_shape: onnxruntime's output is one shorter than the spec's in * stride with SAME
    # where the kernel is shorter than the stride (2 inputs, stride 2, kernel 1: 3 against 4, as onnx's reference
    # and the runner give), and it adds an output_shape longer than the full transpose at the end where the spec
    # pads both sides)
    if attrs.get("auto_pad") in ("SAME_UPPER", "SAME_LOWER"): attrs.pop("auto_pad")
    if group > 1: attrs["group"] = group
    strides = attrs.get("strides", [1] * len(sp))
    dils = attrs.get("dilations", [1] * len(sp))
    if g.rng.random() < 0.4: attrs["output_padding"] = [g.rng.randint(0, max(s, d) - 1) for s, d in zip(strides, dils)]
    ins = [x.name, g.data((c, cout, *kernel), FLOAT)]
    if g.rng.random() < 0.5: ins.append(g.data((cout * group,), FLOAT))
    g.add("ConvTranspose", ins, **attrs)


def b_pool(g: Gen) -> None:
    op = g.rng.choice(["MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
    x = _image(g)
    if op.startswith("Global"):
        g.add(op, [x.name], **({"p": g.rng.choice([1, 2, 3])} if op == "GlobalLpPool" else {}))
        return
    sp = x.shape[2:]
    kernel = [g.rng.randint(1, min(3, s)) for s in sp]
    # (dilations: MaxPool from 10, AveragePool from 19, LpPool from 18)
    attrs = _window_attrs(g, sp, kernel, dil=op == "MaxPool" or (op == "AveragePool" and g.opset >= 19)
                          or (op == "LpPool" and g.opset >= 18))
    attrs["kernel_shape"] = kernel
    if "pads" in attrs: attrs["pads"] = [min(p, k - 1) for p, k in zip(attrs["pads"], kernel + kernel)]
    # (ceil_mode only with explicit pads: onnxruntime aborts the process, a failed std::clamp assertion, on MaxPool
    # with auto_pad VALID, ceil_mode 1, a 2x3 window and strides 3 over some images)
    if (op != "LpPool" or g.opset >= 18) and "auto_pad" not in attrs:
        if g.rng.random() < 0.4: attrs["ceil_mode"] = 1
    # (onnxruntime pools one window where the dilated kernel is longer than the padded input without ceil_mode; the
    # spec's floor((in + pads - span) / stride) + 1 is 0 there, as onnx's reference gives: a MaxPool of a 1x4x3x6
    # image with a 3x1 window dilated (2, 1), VALID, gives 1x4x1x2 in onnxruntime, 1x4x0x2 in the spec)
    pads = attrs.get("pads", [0] * (2 * len(sp)))
    spans = [(kk - 1) * dd + 1 for kk, dd in zip(kernel, attrs.get("dilations", [1] * len(sp)))]
    if attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID") and not attrs.get("ceil_mode") and \
            any(i + a + b < span for i, a, b, span in zip(sp, pads, pads[len(sp):], spans)):
        raise Reject("a window longer than the padded input")
    if op == "AveragePool" and g.rng.random() < 0.5: attrs["count_include_pad"] = 1
    if op == "LpPool": attrs["p"] = g.rng.choice([1, 2, 3])
    n_out = 2 if op == "MaxPool" and g.rng.random() < 0.2 else 1
    if n_out == 2 and "pads" in attrs:   # (the runner refuses indices with pads beyond half the window: Unsupported)
        half = [((kk - 1) * dd + 1) // 2 for kk, dd in zip(kernel, attrs.get("dilations", [1] * len(sp)))]
        attrs["pads"] = [min(p, h) for p, h in zip(attrs["pads"], half + half)]
    g.add(op, [x.name], n_out, **attrs)


def b_matmul(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0 and min(v.shape) > 0)
    k = x.shape[-1]
    m = g.rng.randint(1, 5)
    if len(x.shape) == 1: shape: tuple[int, ...] = (k,) if g.rng.random() < 0.3 else (k, m)
    else:
        batch = x.shape[:-2]
        batch = tuple(d if g.rng.random() < 0.6 else 1 for d in batch[g.rng.randint(0, len(batch)):])
        shape = batch + (k, m) if g.rng.random() < 0.85 else (k,)
    w = g.data(shape, x.dtype, init=g.rng.random() < 0.7)
    g.add("MatMul", [x.name, w])


def b_gemm(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) == 2 and min(v.shape) > 0)
    ta, tb = g.rng.choice([0, 1]), g.rng.choice([0, 1])
    m, k = x.shape[::-1] if ta else x.shape
    n = g.rng.randint(1, 5)
    attrs = {"transA": ta, "transB": tb}
    if g.rng.random() < 0.5: attrs.update(alpha=g.rng.choice([0.5, 2.0]), beta=g.rng.choice([0.0, 0.5, 1.5]))
    ins = [x.name, g.data((n, k) if tb else (k, n), x.dtype)]
    if g.rng.random() < 0.7: ins.append(g.data(g.rng.choice([(), (n,), (1, n), (m, 1), (m, n), (1,)]), x.dtype))
    g.add("Gemm", ins, **attrs)


def b_flatten(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS)
    r = len(x.shape)
    g.add("Flatten", [x.name], axis=g.rng.randint(-r, r) if r else 0)


def b_reshape(g: Gen) -> None:
    x = g.pick(lambda v: 0 < numel(v.shape), FLOATS + INTS + (BOOL,))
    total = numel(x.shape)
    # a random factorization of total, then some dims as 0 (copy) or one -1
    dims: list[int] = []
    rest = total
    for _ in range(g.rng.randint(0, 3)):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = g.rng.choice(divs)
        dims.append(d)
        rest //= d
    dims.append(rest)
    g.rng.shuffle(dims)
    spec = list(dims)
    for i, d in enumerate(dims):
        if i < len(x.shape) and x.shape[i] == d and g.rng.random() < 0.4: spec[i] = 0
    if g.rng.random() < 0.5:
        spec[g.rng.randrange(len(spec))] = -1
    g.add("Reshape", [x.name, g.const(spec)])


def b_transpose(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 1, FLOATS + INTS + (BOOL,))
    perm = list(range(len(x.shape)))
    g.rng.shuffle(perm)
    g.add("Transpose", [x.name], perm=perm if g.rng.random() < 0.85 else None)


def b_squeeze(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS + (BOOL,))
    r = len(x.shape)
    attrs: dict[str, Any] = {}
    ins = [x.name]
    if g.rng.random() < 0.5 and r < 5:
        n = g.rng.randint(1, 2)
        axes = g.rng.sample(range(r + n), n)
        g.ints_operand([a - (r + n) if g.rng.random() < 0.4 else a for a in axes], "axes", 13, attrs, ins)
        g.add("Unsqueeze", ins, **attrs)
        return
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    if ones and g.rng.random() < 0.7:
        g.ints_operand([a - r if g.rng.random() < 0.4 else a for a in g.rng.sample(ones, g.rng.randint(1, len(ones)))],
                       "axes", 13, attrs, ins)
    g.add("Squeeze", ins, **attrs)


def b_slice(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS + (BOOL,))
    r = len(x.shape)
    axes = rand_axes(g, r)
    starts, ends, steps = [], [], []
    for a in axes:
        d = x.shape[a]
        step = g.rng.choice([1, 1, 2, -1, -2, 3])
        pool = [0, 1, d - 1, d, -1, -d, d + 5, -d - 5, 2**62, -(2**62)]
        starts.append(g.rng.choice(pool))
        ends.append(g.rng.choice(pool))
        steps.append(step)
    ins = [x.name, g.const(starts), g.const(ends)]
    if g.rng.random() < 0.8 or any(s != 1 for s in steps):
        ins.append(g.const(axes))
        if any(s != 1 for s in steps) or g.rng.random() < 0.5: ins.append(g.const(steps))
    g.add("Slice", ins)


def b_gather(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0 and min(v.shape) > 0, FLOATS + INTS)
    axis = any_axis(g, len(x.shape))
    d = x.shape[axis]
    op = g.rng.choice(["Gather", "GatherElements", "GatherND"])
    if op == "Gather":
        shape = tuple(g.rng.randint(1, 3) for _ in range(g.rng.randint(0, 2)))
        idx = g.data(shape, g.rng.choice(INTS), lo=-d, hi=d)
        g.add("Gather", [x.name, idx], axis=axis)
    elif op == "GatherElements":
        shape = tuple(g.rng.randint(1, s) if i != (axis % len(x.shape)) else g.rng.randint(1, 4)
                      for i, s in enumerate(x.shape))
        g.add("GatherElements", [x.name, g.data(shape, INT64, lo=-d, hi=d)], axis=axis)
    else:
        b = g.rng.randint(0, len(x.shape) - 1)
        k = g.rng.randint(1, len(x.shape) - b)
        # indices (batch dims of x, some rows, k): each column in range of its dim, so drawn per column
        rows = g.rng.randint(1, 3)
        cols = [g.data(x.shape[:b] + (rows, 1), INT64, lo=-x.shape[b + j], hi=x.shape[b + j]) for j in range(k)]
        (idx,) = g.add("Concat", cols, axis=-1) if k > 1 else (Value(cols[0], (), INT64),)
        g.add("GatherND", [x.name, idx.name], batch_dims=b or None)


def b_scatter(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0 and min(v.shape) > 0, FLOATS + INTS)
    r = len(x.shape)
    red = g.rng.choice(["none", "none", "add", "mul", "max", "min"])
    if red in ("max", "min") and g.opset < 18 or red != "none" and g.opset < 16: red = "none"
    attrs = {"reduction": red} if red != "none" else {}
    if g.rng.random() < 0.6:
        axis = any_axis(g, r)
        a = axis % r
        shape = tuple(g.rng.randint(1, s) for s in x.shape)
        idx = g.data(shape, INT64, hi=x.shape[a], unique_axis=a if red == "none" else None, lo=0)
        if g.rng.random() < 0.3:   # negative indices: idx - dim
            (idx_v,) = g.add("Sub", [idx, g.const(np.array(x.shape[a]))])
            idx = idx_v.name
        upd = g.data(shape, x.dtype)
        g.add("ScatterElements", [x.name, idx, upd], axis=axis, **attrs)
        return
    k = g.rng.randint(1, r)
    # distinct index tuples: positions drawn without repeats from the first k dims
    m = g.rng.randint(1, min(4, numel(x.shape[:k])))
    flat = g.rng.sample(range(numel(x.shape[:k])), m)
    idx = np.array(np.unravel_index(flat, x.shape[:k])).T.reshape(m, k)
    g.add("ScatterND", [x.name, g.const(idx), g.data((m,) + x.shape[k:], x.dtype)], **attrs)


def b_concat_split(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS)
    axis = any_axis(g, len(x.shape))
    a = axis % len(x.shape)
    if g.rng.random() < 0.5:
        others = [g.data(x.shape[:a] + (g.rng.randint(0, 3),) + x.shape[a + 1:], x.dtype)
                  for _ in range(g.rng.randint(1, 2))]
        ins = [x.name] + others
        g.rng.shuffle(ins)
        g.add("Concat", ins, axis=axis)
        return
    d = x.shape[a]
    n = g.rng.randint(1, 3)
    if g.rng.random() < 0.5 or g.opset < 18:
        cuts = sorted(g.rng.randint(0, d) for _ in range(n - 1))
        sizes = [b - c for c, b in zip([0] + cuts, cuts + [d])]
        g.add("Split", [x.name, g.const(sizes)] if g.opset >= 13 else [x.name], n, axis=axis)
    else:
        if d < n: raise Reject("split")
        g.add("Split", [x.name], n, axis=axis, num_outputs=n)


def b_pad(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) > 0 and min(v.shape) > 0, FLOATS + INTS)
    r = len(x.shape)
    mode = g.rng.choice(["constant", "reflect", "edge"] + (["wrap"] if g.opset >= 19 else []))
    axes = rand_axes(g, r) if g.opset >= 18 and g.rng.random() < 0.5 else None
    ax = [a % r for a in axes] if axes is not None else list(range(r))
    def one(d: int) -> int:
        lo = -(d - 1) if mode == "constant" or g.rng.random() < 0.5 else 0
        hi = d - 1 if mode == "reflect" else (d if mode == "wrap" else 3)
        return g.rng.randint(max(lo, -(d - 1)), max(0, hi)) if g.rng.random() < 0.7 else 0
    pads = [one(x.shape[a]) for a in ax] + [one(x.shape[a]) for a in ax]
    if mode != "constant":   # (onnxruntime refuses cropping with reflect / edge / wrap on some axes)
        pads = [max(p, 0) for p in pads]
    ins = [x.name, g.const(pads)]
    if mode == "constant" and g.rng.random() < 0.5: ins.append(g.const(np.array(1.5), NP[x.dtype]))
    elif axes is not None: ins.append("")
    if axes is not None: ins.append(g.const(axes))
    g.add("Pad", ins, mode=mode)


def b_expand_tile(g: Gen) -> None:
    x = g.pick(dtypes=FLOATS + INTS + (BOOL,))
    if g.rng.random() < 0.5:
        target = list(x.shape)
        target = [g.rng.randint(2, 3) if d == 1 and g.rng.random() < 0.6 else
                  (1 if g.rng.random() < 0.2 else d) for d in target]
        target = [g.rng.randint(1, 2) for _ in range(g.rng.randint(0, 1))] + target
        g.add("Expand", [x.name, g.const(target)])
    else:
        g.add("Tile", [x.name, g.const([g.rng.randint(1, 2) if g.rng.random() < 0.7 else 0 if g.rng.random() < 0.1
                                         else 3 for _ in x.shape])])


def b_norm(g: Gen) -> None:
    op = g.rng.choice(["BatchNormalization", "InstanceNormalization", "LayerNormalization", "GroupNormalization",
                       "LpNormalization", "MeanVarianceNormalization"])
    if op in ("BatchNormalization", "InstanceNormalization", "GroupNormalization"):
        x = g.pick(lambda v: len(v.shape) >= 2 + (op != "BatchNormalization") and min(v.shape) > 0, (FLOAT,))
        c = x.shape[1]
        if op == "BatchNormalization":
            var = g.name("w")
            g.inits.append(numpy_helper.from_array(np.random.default_rng(g.n).uniform(0.5, 2, c).astype(np.float32),
                                                   var))
            g.add(op, [x.name, g.data((c,)), g.data((c,)), g.data((c,)), var], epsilon=g.rng.choice([1e-5, 0.1]))
        elif op == "InstanceNormalization": g.add(op, [x.name, g.data((c,)), g.data((c,))])
        else:
            if g.opset < 21: raise Reject("GroupNormalization before 21 (scale per group) is deprecated")
            ng = g.rng.choice([d for d in range(1, c + 1) if c % d == 0])
            g.add(op, [x.name, g.data((c,)), g.data((c,))], num_groups=ng)
    elif op == "LayerNormalization":
        x = g.pick(lambda v: len(v.shape) > 0 and min(v.shape) > 0, (FLOAT, DOUBLE))
        axis = any_axis(g, len(x.shape))
        shape = x.shape[axis % len(x.shape):]
        ins = [x.name, g.data(shape, x.dtype)]
        if g.rng.random() < 0.5: ins.append(g.data(shape, x.dtype))
        g.add(op, ins, axis=axis, epsilon=g.rng.choice([1e-5, 0.1]))
    elif op == "LpNormalization":
        x = g.pick(lambda v: len(v.shape) > 0)
        g.add(op, [x.name], axis=any_axis(g, len(x.shape)), p=g.rng.choice([1, 2]))
    else:
        x = g.pick(lambda v: len(v.shape) >= 2 and min(v.shape) > 1, (FLOAT,))
        g.add(op, [x.name], axes=sorted(g.rng.sample(range(len(x.shape)), g.rng.randint(1, len(x.shape)))))


def b_resize(g: Gen) -> None:
    x = g.pick(lambda v: 2 <= len(v.shape) <= 4 and min(v.shape) > 0, (FLOAT,))
    r = len(x.shape)
    mode = g.rng.choice(["nearest", "linear", "cubic"])
    ctm = g.rng.choice(["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"] +
                       (["half_pixel_symmetric"] if g.opset >= 19 else []))
    attrs: dict[str, Any] = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = g.rng.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
    if mode == "cubic" and g.rng.random() < 0.5: attrs["cubic_coeff_a"] = -0.5
    if mode != "nearest" and g.opset >= 18 and g.rng.random() < 0.3: attrs["antialias"] = 1
    # the last two axes resized (onnxruntime's linear and cubic modes resize at most those, or the outer two of 4)
    axes = list(range(r - 2, r))
    # (axes without negative ones: onnxruntime resizes nothing for axes=[2, -1] and sizes, and onnx's reference raises)
    if g.opset >= 18 and g.rng.random() < 0.4: attrs["axes"] = axes
    full = "axes" not in attrs
    if g.rng.random() < 0.5:
        scales = [g.rng.choice([0.5, 0.75, 1.0, 1.5, 2.0, 3.0]) for _ in axes]
        if full: scales = [1.0] * (r - 2) + scales
        ins = [x.name, "", g.const(np.array(scales, np.float32), np.float32)]
    else:
        sizes = [g.rng.randint(1, 2 * x.shape[a] + 1) for a in axes]
        if full: sizes = list(x.shape[:r - 2]) + sizes
        if g.opset >= 18 and g.rng.random() < 0.3 and len(axes) > 1:
            attrs["keep_aspect_ratio_policy"] = g.rng.choice(["not_larger", "not_smaller"])
        ins = [x.name, "", "", g.const(sizes)]
    g.add("Resize", ins, **attrs)


EINSUM = ["ij,jk->ik", "ij->ji", "bij,bjk->bik", "ii->i", "ij->", "i,i->", "ij,ij->ij", "ij->j", "i,j->ij",
          "bij,bkj->bik", "...ij,...jk->...ik", "ijk->kji"]


def b_einsum(g: Gen) -> None:
    eq = g.rng.choice(EINSUM)
    lhs = eq.split("->")[0].split(",")
    sizes = {c: g.rng.randint(1, 4) for c in "ijkb"}
    ins = []
    for term in lhs:
        if term.startswith("..."): shape = (2,) + tuple(sizes[c] for c in term[3:])
        else: shape = tuple(sizes[c] for c in term)
        cand = [v for v in g.values if v.shape == shape and v.dtype == FLOAT]
        ins.append(g.rng.choice(cand).name if cand and g.rng.random() < 0.8 else g.data(shape))
    g.add("Einsum", ins, equation=eq)


def b_depth_space(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) == 4 and min(v.shape) > 0, (FLOAT,))
    b = g.rng.choice([2, 3])
    if g.rng.random() < 0.5:
        if x.shape[2] % b or x.shape[3] % b: raise Reject("SpaceToDepth")
        g.add("SpaceToDepth", [x.name], blocksize=b)
    else:
        if x.shape[1] % (b * b): raise Reject("DepthToSpace")
        g.add("DepthToSpace", [x.name], blocksize=b, mode=g.rng.choice(["DCR", "CRD"]))


def b_trilu(g: Gen) -> None:
    x = g.pick(lambda v: len(v.shape) >= 2, FLOATS + INTS)
    ins = [x.name]
    if g.rng.random() < 0.6: ins.append(g.const(np.array(g.rng.randint(-3, 3))))
    g.add("Trilu", ins, upper=g.rng.choice([0, 1]))


def b_shape(g: Gen) -> None:
    """Shape chains, as models exported with dynamic shapes have them: Expand or ConstantOfShape to the Shape of a
    value, a Reshape to its leading dims with the rest flattened (Shape, Slice or Gather, Concat), or its Size."""
    x = g.pick(lambda v: len(v.shape) > 0, FLOATS + INTS)
    r = g.rng.random()
    if r < 0.3:
        (sh,) = g.add("Shape", [x.name])
        g.add("Expand", [_partner(g, x, g.rng.choice([FLOAT, x.dtype])), sh.name])
    elif r < 0.45:
        (sh,) = g.add("Shape", [x.name])
        value = helper.make_tensor("value", g.rng.choice([FLOAT, INT64]), [1], [g.rng.choice([0, 2])])
        g.add("ConstantOfShape", [sh.name], value=value if g.rng.random() < 0.7 else None)
    elif r < 0.85:
        k = g.rng.randint(0, len(x.shape) - 1)
        if g.opset >= 15 and g.rng.random() < 0.5: (lead,) = g.add("Shape", [x.name], end=k)
        else:
            (sh,) = g.add("Shape", [x.name])
            if g.rng.random() < 0.5: (lead,) = g.add("Slice", [sh.name, g.const([0]), g.const([k])])
            else: (lead,) = g.add("Gather", [sh.name, g.const(list(range(k)))], axis=0)
        (spec,) = g.add("Concat", [lead.name, g.const([-1])], axis=0)
        g.add("Reshape", [x.name, spec.name])
    else:
        (n,) = g.add("Size", [x.name])
        (f,) = g.add("Cast", [n.name], to=x.dtype)
        g.add("Mul", [x.name, f.name])


def b_onehot_range(g: Gen) -> None:
    """OneHot of int indices (negative ones count from the end) with a depth and values, or a Range of constants."""
    if g.rng.random() < 0.5:
        x = g.pick(lambda v: len(v.shape) < 4, INTS)
        depth = g.rng.randint(1, 5)
        values = g.const(np.array([g.rng.choice([0, -1]), g.rng.choice([1, 3])]), g.rng.choice([np.float32, np.int64]))
        g.add("OneHot", [x.name, g.const(np.array(depth)), values], axis=any_axis(g, len(x.shape) + 1))
        return
    dtype = g.rng.choice([np.float32, np.int64, np.int32])
    start, limit, delta = g.rng.randint(-3, 3), g.rng.randint(-5, 6), g.rng.choice([1, 2, -1, 3])
    (r,) = g.add("Range", [g.const(np.array(start), dtype), g.const(np.array(limit), dtype),
                           g.const(np.array(delta), dtype)])
    if r.shape[0] and g.rng.random() < 0.7:   # used with a value that broadcasts with it
        x = g.pick(lambda v: len(v.shape) > 0 and v.shape[-1] in (1, r.shape[0]), (NP_TYPE[dtype],))
        g.add(g.rng.choice(["Add", "Mul", "Max"]), [x.name, r.name])


NP_TYPE = {np.float32: FLOAT, np.int64: INT64, np.int32: INT32}


# builders and their weights
BUILDERS: list[tuple[Callable[[Gen], None], int]] = [
    (b_unary, 6), (b_positive, 2), (b_clip, 2), (b_binary, 8), (b_compare, 3), (b_mod, 1), (b_cast, 2),
    (b_reduce, 5), (b_argmax, 2), (b_topk, 2), (b_softmax, 2), (b_cumsum, 2), (b_conv, 8), (b_conv_transpose, 2),
    (b_pool, 4), (b_matmul, 3), (b_gemm, 2), (b_flatten, 1), (b_reshape, 3), (b_transpose, 3), (b_squeeze, 2),
    (b_slice, 3), (b_gather, 3), (b_scatter, 2), (b_concat_split, 3), (b_pad, 3), (b_expand_tile, 2), (b_norm, 3),
    (b_resize, 2), (b_einsum, 1), (b_depth_space, 1), (b_trilu, 1), (b_shape, 3), (b_onehot_range, 2)]


# ---------------------------------------------------------------------------------------------------------------------
# generation

def _draft(rng: random.Random, seed: int) -> Case:
    opset = rng.choice(OPSETS)
    g = Gen(rng, opset)
    # the first inputs: an image (for convolutions and pools), or a tensor of rank 0-4, float or int
    n_inputs = rng.randint(1, 2)
    for _ in range(n_inputs):
        r = rng.random()
        if r < 0.4: shape = (rng.randint(1, 2), rng.randint(1, 8)) + tuple(rng.randint(3, 9) for _ in range(2))
        elif r < 0.5: shape = (rng.randint(1, 2), rng.randint(1, 4), rng.randint(16, 33), 32)
        else: shape = tuple(rng.randint(0 if rng.random() < 0.05 else 1, 5) for _ in range(rng.randint(0, 4)))
        dtype = rng.choices([FLOAT, DOUBLE, INT64, INT32], [8, 1, 1, 1])[0]
        if numel(shape) > MAX_NUMEL: dtype = FLOAT
        name = g.data(shape, dtype, init=False)
        g.values.append(Value(name, shape, dtype))
    target = rng.randint(2, 8)
    attempts = 0
    while len(g.nodes) < target and attempts < 60:
        attempts += 1
        builder = rng.choices([b for b, _ in BUILDERS], [w for _, w in BUILDERS])[0]
        saved = (len(g.nodes), len(g.values), len(g.inits), len(g.inputs))
        try: builder(g)
        except Reject:
            # (a builder that added some nodes before its last was rejected leaves none of them)
            del g.nodes[saved[0]:], g.values[saved[1]:], g.inits[saved[2]:], g.inputs[saved[3]:]
    if len(g.nodes) < 2: raise Reject("too few nodes")
    # outputs: the values no node reads (so every node counts), and sometimes one that a node reads too
    made = [v for v in g.values if any(v.name in nd.output for nd in g.nodes)]
    read = {i for nd in g.nodes for i in nd.input}
    outs = [v for v in made if v.name not in read]
    extra = [v for v in made if v.name in read]
    if extra and rng.random() < 0.3: outs.append(rng.choice(extra))
    # (named first dims: each input its own name, since the inputs' first dims needn't agree)
    symbolic = rng.random() < 0.2
    def in_vi(s: InputSpec) -> Any:
        dims: list[Any] = list(s.shape)
        if symbolic and s.dtype in FLOATS and dims: dims[0] = f"N_{s.name}"
        return _vi(s.name, s.dtype, dims)
    graph = helper.make_graph(g.nodes, f"fuzz{seed}", [in_vi(s) for s in g.inputs],
                              [_vi(v.name, v.dtype, v.shape) for v in outs], initializer=g.inits)
    model = _model(graph, opset)
    onnx.checker.check_model(model, full_check=True)
    return Case(seed, opset, model, g.inputs, rng.random() < 0.5, symbolic)


def feeds(case: Case, k: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([case.seed, k])
    return {s.name: s.draw(rng) for s in case.inputs}


def ort_run(model: Any, feed: dict[str, np.ndarray], sess: Any = None) -> list[np.ndarray]:
    if sess is None: sess = ort_session(model)
    return sess.run(None, feed)


def ort_session(model: Any) -> Any:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _tol(ref: np.ndarray) -> float:
    return TOL[_type(ref)] * max(1.0, float(np.abs(ref).max())) if ref.size else 0.0


def _type(a: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(a.dtype)


def stable(case: Case, sess: Any) -> bool:
    """Whether onnxruntime's outputs are NaN-free and move by less than a tenth of the tolerance (floats) or not at all
    (integers, bools) when the float inputs move by a relative PERTURB."""
    for k in range(4):   # (the inputs of the plain call and of the three jit calls)
        feed = feeds(case, k)
        base = sess.run(None, feed)
        if any(a.dtype.kind == "f" and np.isnan(a).any() for a in base): return False
        for j in range(2):
            prng = np.random.default_rng([case.seed, k, j, 7])
            moved = {n: np.asarray(a * (1 + PERTURB * prng.uniform(-1, 1, a.shape)).astype(a.dtype))
                     if a.dtype.kind == "f" else a for n, a in feed.items()}
            for a, b in zip(base, sess.run(None, moved)):
                if a.dtype.kind == "f":
                    if np.isnan(b).any() or not np.all(np.isinf(a) == np.isinf(b)): return False
                    fin = ~np.isinf(a)
                    if fin.any() and np.abs(a[fin] - b[fin]).max() > _tol(a[fin]) / 10: return False
                elif not np.array_equal(a, b): return False
    return True


def generate(seed: int) -> Case:
    """The seed's model: the first draft that onnx checks, onnxruntime runs and that is well conditioned."""
    rng = random.Random(seed)
    for tries in range(200):
        try:
            case = _draft(rng, seed)
            case.tries = tries
            if stable(case, ort_session(case.model)): return case
        except Exception: continue
    raise RuntimeError(f"seed {seed}: no model onnxruntime runs")


# ---------------------------------------------------------------------------------------------------------------------
# running and comparing

def compare(what: str, got: Any, ref: np.ndarray) -> str | None:
    got = np.asarray(got)
    if got.shape != ref.shape: return f"{what}: shape {got.shape}, onnxruntime {ref.shape}"
    if got.dtype != ref.dtype: return f"{what}: dtype {got.dtype}, onnxruntime {ref.dtype}"
    if ref.dtype.kind != "f":
        if not np.array_equal(got, ref):
            bad = np.argwhere(got != ref)[:3].tolist()
            return f"{what}: mismatch at {bad}: {got[tuple(np.array(bad).T)]} vs {ref[tuple(np.array(bad).T)]}"
        return None
    tol = _tol(ref[np.isfinite(ref)]) if np.isfinite(ref).any() else 0.0
    if not np.allclose(got, ref, rtol=TOL[_type(ref)], atol=tol, equal_nan=True):
        got, ref = got.reshape(-1), ref.reshape(-1)   # (a 0-d array's difference would be a scalar)
        err = np.abs(got.astype(np.float64) - ref)
        err[np.isnan(err) & (np.isnan(got) == np.isnan(ref))] = 0
        i = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), ref.shape)
        return f"{what}: max error {err[i]:.3g} at {list(i)}: {got[i]} vs {ref[i]} (atol {tol:.3g})"
    return None


def check(case: Case) -> list[str]:
    """Runs the case; the differences from onnxruntime (an empty list when it passes)."""
    sess = ort_session(case.model)
    names = [o.name for o in case.model.graph.output]
    problems: list[str] = []
    saved = layout.starts_region.__defaults__
    if case.small_regions: layout.starts_region.__defaults__ = (1,)
    try:
        runner = OnnxRunner(case.model)
        feed = feeds(case, 0)
        try:
            got = runner(feed)
            outs = {n: got[n].numpy() for n in names}
        except Exception: return [f"OnnxRunner raised:\n{traceback.format_exc(limit=-4)}"]
        for n, ref in zip(names, sess.run(None, feed)):
            if (p := compare(f"call {n}", outs[n], ref)): problems.append(p)
        jit = OnnxRunner(case.model).jit()
        for k in (1, 2, 3):   # a plain call, the capture, a replay
            feed = feeds(case, k)
            try: got = jit(feed)
            except Exception as e:
                # (a shape that holds for this call's values only, as a named dim concatenated with a static one:
                # a capture would replay it for other values, so the runner refuses it, as DESIGN.md says)
                if case.symbolic and "needs the values of the symbolic dims" in str(e): break
                return problems + [f"jit call {k} raised:\n{traceback.format_exc(limit=-4)}"]
            for n, ref in zip(names, sess.run(None, feed)):
                if (p := compare(f"jit call {k} {n}", got[n], ref)): problems.append(p)
    finally: layout.starts_region.__defaults__ = saved
    return problems


def describe(case: Case) -> str:
    lines = [f"seed {case.seed}: opset {case.opset}, small regions {case.small_regions}, symbolic {case.symbolic}"]
    for s in case.inputs: lines.append(f"  input {s.name} {s.shape} {TensorProto.DataType.Name(s.dtype)}")
    for nd in case.model.graph.node:
        attrs = ", ".join(f"{a.name}={helper.get_attribute_value(a)!r}" for a in nd.attribute)
        lines.append(f"  {list(nd.output)} = {nd.op_type}({', '.join(nd.input)}){' ' + attrs if attrs else ''}")
    consts = {i.name: numpy_helper.to_array(i) for i in case.model.graph.initializer}
    small = {k: v.tolist() for k, v in consts.items() if k.startswith("c")}
    if small: lines.append(f"  constants {small}")
    lines.append(f"  outputs {[o.name for o in case.model.graph.output]}")
    return "\n".join(lines)


def replay(seed: int, save: str | None = None) -> bool:
    case = generate(seed)
    print(describe(case))
    if save:
        onnx.save(case.model, save)
        print(f"saved to {save}")
    problems = check(case)
    print("\n".join(problems) if problems else "ok")
    return not problems


SEEDS = 60


@pytest.mark.parametrize("seed", range(SEEDS))
def test_fuzz_onnx(seed):
    case = generate(seed)
    problems = check(case)
    assert not problems, f"{describe(case)}\n" + "\n".join(problems) + \
        f"\nreplay: python -m test.onnx.test_fuzz_onnx {seed} [--save model.onnx]"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SEEDS, 600))
def test_fuzz_onnx_slow(seed):
    test_fuzz_onnx(seed)


if __name__ == "__main__":
    args = sys.argv[1:]
    save = None
    if "--save" in args:
        i = args.index("--save")
        save = args[i + 1]
        del args[i:i + 2]
    for arg in args or ["0-50"]:
        if "-" in arg:
            lo, hi = map(int, arg.split("-"))
            st, failing = time.perf_counter(), []
            for s in range(lo, hi):
                try:
                    case = generate(s)
                    problems = check(case)
                except Exception: case, problems = None, [f"fuzzer raised:\n{traceback.format_exc(limit=-3)}"]
                if problems:
                    failing.append(s)
                    print((describe(case) if case else f"seed {s}") + "\n" + "\n".join(problems) + "\n", flush=True)
            print(f"{hi - lo} models in {time.perf_counter() - st:.1f}s, failing seeds: {failing}", flush=True)
        else: sys.exit(0 if replay(int(arg), save) else 1)
