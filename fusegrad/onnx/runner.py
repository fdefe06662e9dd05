"""OnnxRunner: parse a model with the `onnx` package and evaluate its graph node by node with Tensor ops.

The graph is not compiled ahead: each call builds the lazy Tensor graph of the whole model, and fusegrad's scheduler
fuses it into kernels when the outputs are realized. Everything that does not change between calls (parsed
attributes, the op of each node, the initializers as realized Tensors) is prepared once in the constructor."""
from __future__ import annotations

import ctypes
import os
import re
from collections import ChainMap
from typing import Any, Mapping, Sequence

import numpy as np

import fusegrad.engine.realize as _realize
from fusegrad import Device, Tensor, Variable, dtypes
from fusegrad.dtype import DType
from fusegrad.onnx.layout import Region, copied_names, weight_channels_last
from fusegrad.onnx.errors import (OnnxError, OnnxInputError, OnnxLoadError, OnnxNodeError, OnnxUnsupportedError,
                                  Unsupported)
from fusegrad.onnx.onnx_dtypes import np_name, onnx_dtype
from fusegrad.onnx import (ops_contrib, ops_control, ops_loss, ops_quant,  # noqa: F401 - they register ops
                           ops_detection, ops_image, ops_random, ops_resize, ops_sequence, ops_signal, ops_string)
from fusegrad.onnx.ops_string import CAST_STRINGS, STRING_OPS, equal_strings, is_strings, strings
from fusegrad.onnx.narrow import (CONTROL_OPS, NARROW, NARROW_OPS, PASS_THROUGH, NarrowTensor, from_narrow_numpy,
                                  inexact, narrow_type, round_to, to_narrow_numpy)
from fusegrad.onnx.narrow import plain as plain_tensor
from fusegrad.onnx.ops import OPS, Context, DeviceCheck, OpDef, known_value, with_host
from fusegrad.onnx.symbolic import concretize, fold, has_symbolic, variables_of
from fusegrad.runtime.cpu_memory import ALIGN, CPUAllocator
from fusegrad.uop.ops import Ops, device_buffer, is_symbolic, sym_eq

try:
    import onnx
    from onnx import numpy_helper
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fusegrad.onnx needs the onnx package: pip install 'fusegrad[onnx]'") from e

DEFAULT_DOMAINS = ("", "ai.onnx")
# the largest value of a symbolic input dim that shares compiled kernels, where `max_dims` doesn't name the dim: an
# input's memory is sized for its dims' maxima, so a large default would cost memory on every call
DEFAULT_MAX_DIM = 64


def array_to_tensor(arr: np.ndarray, dtype: DType | None = None, realize: bool = True) -> Tensor:
    """A realized Tensor holding a NumPy array (dtypes NumPy lacks, bfloat16, come as float32 and are cast).
    `realize=False` leaves a cast lazy: the runner then copies the array itself."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous: arr = arr.copy(order="C")
    if arr.dtype == object or arr.dtype.kind in "USO": raise Unsupported(f"arrays of {arr.dtype} are not supported")
    if arr.dtype.name == "bfloat16": arr, dtype = arr.astype(np.float32), dtypes.bfloat16
    t = Tensor(arr)
    if dtype is not None and t.dtype != dtype: t = t.cast(dtype)
    return with_host(t.realize() if realize else t, arr)


def _prod(shape: Sequence[Any]) -> Any:
    out: Any = 1
    for s in shape: out = out * s
    return out


def tensor_proto_to_tensor(tp: onnx.TensorProto, base_dir: str | None = None) -> Any:
    """A TensorProto's value: a Tensor, or for strings a NumPy array of str (string tensors stay on the host)."""
    if tp.data_type == onnx.TensorProto.STRING: return strings(numpy_helper.to_array(tp), f"tensor {tp.name!r}")
    dtype = onnx_dtype(tp.data_type) if tp.data_type not in NARROW else NARROW[tp.data_type].wide
    if onnx.external_data_helper.uses_external_data(tp):
        if base_dir is None: raise Unsupported(f"tensor {tp.name!r} has external data but the model has no folder")
        onnx.external_data_helper.load_external_data_for_tensor(tp, base_dir)
    arr = numpy_helper.to_array(tp)
    # (an 8-, 6-, 4- or 2-bit type: onnx unpacks it to ml_dtypes' type, held in a wider dtype)
    if tp.data_type in NARROW: return NarrowTensor(array_to_tensor(from_narrow_numpy(arr, tp.data_type)), tp.data_type)
    return array_to_tensor(arr, dtype)


def supported_ops() -> list[str]:
    """The op types this runner implements, as `domain::OpType` for domains other than the default one."""
    return sorted(op if dom == "" else f"{dom}::{op}" for dom, op in OPS)


def _attr_value(attr: onnx.AttributeProto, base_dir: str | None) -> Any:
    v = onnx.helper.get_attribute_value(attr)
    if attr.type == onnx.AttributeProto.TENSOR: return tensor_proto_to_tensor(v, base_dir)
    if attr.type == onnx.AttributeProto.STRING: return v.decode()
    if attr.type == onnx.AttributeProto.STRINGS: return tuple(s.decode() for s in v)
    if attr.type == onnx.AttributeProto.GRAPH: return Graph(v, None, base_dir)
    if attr.type in (onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS): return tuple(v)
    if attr.type == onnx.AttributeProto.TENSORS: return tuple(tensor_proto_to_tensor(t, base_dir) for t in v)
    if attr.type == onnx.AttributeProto.SPARSE_TENSOR: raise Unsupported(f"sparse tensor attribute {attr.name!r}")
    return v


class Node:
    """One node with its op and parsed attributes, ready to run."""

    def __init__(self, proto: onnx.NodeProto, index: int, opsets: Mapping[str, int], base_dir: str | None):
        self.proto, self.op_type = proto, proto.op_type
        self.domain = "" if proto.domain in DEFAULT_DOMAINS else proto.domain
        self.name = proto.name or f"#{index} {proto.op_type} -> {', '.join(proto.output)}"
        self.inputs, self.outputs = list(proto.input), list(proto.output)
        self.opset = opsets.get(self.domain, 0)
        op: OpDef | None = OPS.get((self.domain, self.op_type))
        if op is None:
            where = f" of domain {self.domain!r}" if self.domain else ""
            raise OnnxUnsupportedError(self.name, self.op_type, f"op {self.op_type}{where} is not supported")
        self.op = op
        self.attrs: dict[str, Any] = {}
        for a in proto.attribute:
            if a.ref_attr_name: raise OnnxUnsupportedError(self.name, self.op_type, "attribute references (functions)")
            if a.name not in op.attrs:
                raise OnnxUnsupportedError(self.name, self.op_type, f"attribute {a.name!r} is not supported "
                                           f"(supported: {', '.join(sorted(op.attrs)) or 'none'})")
            try: self.attrs[a.name] = _attr_value(a, base_dir)
            except Unsupported as e: raise OnnxUnsupportedError(self.name, self.op_type, str(e)) from None
            if isinstance(self.attrs[a.name], Graph): self.attrs[a.name].opsets = opsets

    def error(self, e: Exception) -> OnnxNodeError:
        cls = OnnxUnsupportedError if isinstance(e, (Unsupported, NotImplementedError)) else OnnxNodeError
        return cls(self.name, self.op_type, f"{type(e).__name__}: {e}" if not isinstance(e, Unsupported) else str(e))


class Graph:
    """A graph (the model's, or the body of an If/Loop/Scan) with its nodes prepared."""

    def __init__(self, proto: onnx.GraphProto, opsets: Mapping[str, int] | None, base_dir: str | None):
        self.proto, self.base_dir = proto, base_dir
        self._opsets = opsets
        self._nodes: list[Node] | None = None
        self._copied: set[str] | None = None
        self.initializers: dict[str, Tensor] = {}
        for init in proto.initializer:
            try: self.initializers[init.name] = tensor_proto_to_tensor(init, base_dir)
            except Unsupported as e: raise OnnxLoadError(f"initializer {init.name!r}: {e}") from None
        self.input_names = [i.name for i in proto.input if i.name not in self.initializers]
        self.output_names = [o.name for o in proto.output]
        if opsets is not None: self.nodes  # noqa: B018 - the model graph's nodes are checked when it is loaded

    @property
    def opsets(self) -> Mapping[str, int] | None: return self._opsets

    @opsets.setter
    def opsets(self, v: Mapping[str, int]) -> None:
        self._opsets = v
        self.nodes  # noqa: B018 - subgraphs are checked with the model

    @property
    def copied(self) -> set[str]:
        """The values of channels-last regions that are copied into ONNX's layout where they end (layout.py)."""
        if self._copied is None: self._copied = copied_names(self.nodes, self.output_names)
        return self._copied

    @property
    def nodes(self) -> list[Node]:
        if self._nodes is None:
            assert self._opsets is not None
            self._nodes = [Node(n, i, self._opsets, self.base_dir) for i, n in enumerate(self.proto.node)]
        return self._nodes

    def _weight_laid_out(self, node: Node) -> Tensor | None:
        """A dense 2-D convolution's weight held by an initializer, copied with its output channels innermost
        and read through a (Cout, Cin, kh, kw) view of the copy (see layout.py, `weight_channels_last`); None for other
        convolutions."""
        w = self.initializers.get(node.inputs[1])
        return weight_channels_last(w) if w is not None and node.attrs.get("group", 1) == 1 else None

    def run(self, values: Mapping[str, Tensor], ctx_runner: OnnxRunner) -> dict[str, Tensor]:
        """Evaluate the nodes in order; `values` holds the inputs and every name visible from an outer graph."""
        env: ChainMap[str, Tensor] = ChainMap({}, dict(self.initializers), values)  # type: ignore[arg-type]
        region = Region(self.copied)
        for node in self.nodes:
            args: list[Any] = []
            for name in node.inputs:
                if name == "": args.append(None)
                elif name in env: args.append(env[name])
                else: raise OnnxNodeError(node.name, node.op_type, f"input {name!r} is produced by no earlier node")
            ctx = Context(node.name, node.op_type, node.opset, len(node.outputs), env, ctx_runner)
            tensors = all(a is None or isinstance(a, Tensor) for a in args)  # (not sequences)
            narrow = _narrow_in(node, args) if node.domain != "" or \
                node.op_type not in NARROW_OPS and node.op_type not in CONTROL_OPS else None
            out = fold(node.op_type, args, node.attrs) if node.domain == "" and tensors else None
            if out is None and any(is_strings(a) for a in args): out = _string_node(node, args, ctx)
            if node.op_type == "Conv" and len(args) > 1 and (w := self._weight_laid_out(node)) is not None: args[1] = w
            laid_out = region.inputs(node.op_type, node.inputs, args, node.attrs) \
                if out is None and narrow is None and node.domain == "" and len(node.outputs) == 1 else None
            if laid_out is not None: out = region.output(node.outputs[0], _run_node(node, laid_out, ctx))
            if out is None: out = _run_node(node, args, ctx)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if narrow is not None: outs = _narrow_outputs(narrow, outs)
            wanted = [i for i, name in enumerate(node.outputs) if name != ""]
            if wanted and max(wanted) >= len(outs):
                raise OnnxUnsupportedError(node.name, node.op_type, f"output {max(wanted)} is not computed")
            for i in wanted: env[node.outputs[i]] = outs[i]
        missing = [o for o in self.output_names if o not in env]
        if missing: raise OnnxLoadError(f"graph {self.proto.name!r}: outputs {missing} are produced by no node")
        return {o: env[o] for o in self.output_names}


def _string_node(node: Node, args: list[Any], ctx: Context) -> Any:
    """A node with string inputs (NumPy arrays of str): only the string ops take them."""
    if (node.domain, node.op_type) not in STRING_OPS:
        raise OnnxUnsupportedError(node.name, node.op_type, f"string inputs: string tensors stay on the host, where "
                                   f"only {', '.join(sorted(op for _, op in STRING_OPS))} take them")
    if node.op_type != "Equal": return _run_node(node, args, ctx)
    try: return equal_strings(*args)
    except OnnxError: raise
    except Exception as e: raise node.error(e) from e


def _narrow_in(node: Node, args: list[Any]) -> int | None:
    """The narrow element type of the inputs of an op that doesn't know these types (None if there is none): only ops
    that move values may have such inputs."""
    tensors = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, Tensor)]
    types = {narrow_type(t) for t in tensors} - {None}
    if not types: return None
    names = ", ".join(sorted(NARROW[t].name for t in types))
    if node.domain != "" or node.op_type not in PASS_THROUGH:
        raise OnnxUnsupportedError(node.name, node.op_type, f"inputs of element type {names}: these are read only by "
                                   f"{', '.join(sorted(NARROW_OPS))}, by ops that move values and by control flow")
    if len(types) > 1: raise OnnxNodeError(node.name, node.op_type, f"inputs of different element types ({names})")
    t = types.pop()
    # (a plain tensor of the holder's dtype beside a narrow one would be taken for the narrow type)
    if any(x.dtype == NARROW[t].wide and narrow_type(x) is None for x in tensors):
        raise OnnxNodeError(node.name, node.op_type, f"inputs of element type {names} and of {NARROW[t].wide.name} "
                           f"together")
    return t


def _narrow_outputs(t: int, outs: list[Any]) -> list[Any]:
    """The outputs of an op that moved values of narrow type t: those of the holder's dtype have that type."""
    wide = NARROW[t].wide
    def one(o: Any) -> Any:
        if isinstance(o, list): return [one(x) for x in o]
        if not isinstance(o, Tensor): return o
        return NarrowTensor(o, t) if o.dtype == wide else plain_tensor(o)
    return [one(o) for o in outs]


def _symbolic_in(t: Any) -> list[Any]:
    """The symbolic entries of a node input's shape and host copy."""
    if not isinstance(t, Tensor): return []
    known = known_value(t)
    out = [d for d in t.shape if is_symbolic(d)]
    if known is not None and has_symbolic(known): out += [v for v in known.reshape(-1) if is_symbolic(v)]
    return out


# ops whose kernels fusegrad doesn't build for symbolic sizes: their inputs get this call's values (convolutions and
# pooling take a symbolic batch; any other op that fails on a symbolic size falls back the same way)
CONCRETE_OPS = frozenset({"ConvInteger", "QLinearConv", "LpPool", "MaxUnpool", "MaxRoiPool", "RoiAlign", "DeformConv",
                          "Col2Im", "Resize", "Upsample"})


def _run_node(node: Node, args: list[Any], ctx: Context) -> Any:
    def call(xs: list[Any]) -> Any:
        return node.op.fn(*xs, **node.attrs, ctx=ctx) if node.op.wants_ctx else node.op.fn(*xs, **node.attrs)

    def concrete(why: str) -> Any:
        symbolic = [v for a in args for v in _symbolic_in(a)]
        if _realize.capturing:
            # kernels for this call's values would be replayed for every other value
            raise OnnxUnsupportedError(node.name, node.op_type, f"needs the values of the symbolic dims "
                                       f"({', '.join(variables_of(symbolic))}), which a TinyJit capture can't replay "
                                       f"({why}); run the model with OnnxRunner(..., symbolic_dims=False)")
        try: return call([concretize(a) if isinstance(a, Tensor) else a for a in args])
        except OnnxError: raise
        except Exception as e: raise node.error(e) from e

    if node.op_type in CONCRETE_OPS and any(_symbolic_in(a) for a in args): return concrete("no symbolic kernels")
    try: return call(args)
    except OnnxError: raise
    except Exception as e:
        if not any(_symbolic_in(a) for a in args): raise node.error(e) from e
        # this op can't work on symbolic sizes: it runs with this call's values (kernels compiled for them)
        return concrete(f"{type(e).__name__}: {e}")


def _load(model: str | os.PathLike | bytes | onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    if isinstance(model, onnx.ModelProto): return model, None
    if isinstance(model, (bytes, bytearray)):
        try: return onnx.load_from_string(bytes(model)), None
        except Exception as e: raise OnnxLoadError(f"the bytes given are not an ONNX model: {e}") from None
    path = os.fspath(model)
    if not os.path.isfile(path): raise OnnxLoadError(f"no such model file: {path!r}")
    try: proto = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise OnnxLoadError(f"{path!r} is not a readable ONNX model (truncated or corrupt?): {type(e).__name__}: {e}") \
            from None
    return proto, os.path.dirname(os.path.abspath(path))


class OnnxRunner:
    """Runs an ONNX model: `OnnxRunner(path_or_model)(inputs)` maps input names to Tensors or NumPy arrays and returns
    a dict of output names to (lazy) Tensors."""

    def __init__(self, model: str | os.PathLike | bytes | onnx.ModelProto, *, max_dims: Mapping[str, int] | None = None,
                 symbolic_dims: bool = True, cast_strings: str = "onnx"):
        """`symbolic_dims`: each named input dim (`dim_param`) is a Variable bound to the call's value, from 1 to
        `max_dims[name]` (default DEFAULT_MAX_DIM), so one set of compiled kernels serves every value; a value above
        the maximum, or `symbolic_dims=False`, runs with concrete shapes (new values compile new kernels).
        `cast_strings`: how Cast and CastLike write numbers as strings, "onnx" (the reference's text: "0.1", "3.0",
        "inf", "True") or "onnxruntime" (its "%.8g"-style text: "0.1", "3", "INF", "1")."""
        if cast_strings not in CAST_STRINGS:
            raise ValueError(f"cast_strings must be one of {', '.join(map(repr, CAST_STRINGS))}, got {cast_strings!r}")
        self.cast_strings = cast_strings
        proto, base_dir = _load(model)
        if not proto.HasField("graph") or len(proto.graph.output) == 0:
            raise OnnxLoadError("the model has no graph, or a graph without outputs (truncated or corrupt file?)")
        self.model = proto
        self.opsets: dict[str, int] = {}
        for imp in proto.opset_import:
            self.opsets["" if imp.domain in DEFAULT_DOMAINS else imp.domain] = imp.version
        if "" not in self.opsets: self.opsets[""] = 1
        self.graph = Graph(proto.graph, self.opsets, base_dir)
        # the declared inputs: dtype and dims (ints, or names of symbolic dims) of each
        self.input_specs: dict[str, tuple[DType | None, tuple[int | str | None, ...] | None]] = {}
        # inputs of sequence or optional type: a list of arrays or Tensors, and None for an empty optional
        self.sequence_inputs: dict[str, str] = {}
        # inputs of an 8-, 6-, 4- or 2-bit element type: their ONNX type (input_specs has the holder's dtype)
        self.narrow_inputs: dict[str, int] = {}
        # string inputs: NumPy arrays of str, kept on the host
        self.string_inputs: set[str] = set()
        for vi in proto.graph.input:
            if vi.name in self.graph.initializers: continue
            tt = vi.type.tensor_type
            if vi.type.WhichOneof("value") in ("sequence_type", "optional_type"):
                self.sequence_inputs[vi.name] = vi.type.WhichOneof("value")
                self.input_specs[vi.name] = (None, None)
                if (et := _element_type(vi.type)) in NARROW: self.narrow_inputs[vi.name] = et
                continue
            if not vi.type.HasField("tensor_type"):
                raise OnnxLoadError(f"graph input {vi.name!r} is not a tensor, a sequence or an optional")
            if tt.elem_type in NARROW: self.narrow_inputs[vi.name] = tt.elem_type
            if tt.elem_type == onnx.TensorProto.STRING:
                self.string_inputs.add(vi.name)
                self.input_specs[vi.name] = (None, None)
                continue
            try: dt = (NARROW[tt.elem_type].wide if tt.elem_type in NARROW else onnx_dtype(tt.elem_type)) \
                if tt.elem_type else None
            except Unsupported as e: raise OnnxLoadError(f"graph input {vi.name!r}: {e}") from None
            dims = None if not tt.HasField("shape") else tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
            self.input_specs[vi.name] = (dt, dims)
        self.symbolic_dims = symbolic_dims
        # while `jit()` runs the graph: where ops put the checks of device values (ops.device_check)
        self.device_checks: list[DeviceCheck] | None = None
        # GroupQueryAttention's total_sequence_length computed on the device: per node and batch and new positions,
        # its difference to the past buffer's length, found by a plain call for a TinyJit capture
        self.total_offsets: dict[Any, int] = {}
        self.max_dims: dict[str, int] = {}
        self.variables: dict[str, Variable] = {}
        names = sorted({d for _, dims in self.input_specs.values() for d in dims or () if isinstance(d, str)})
        for k, v in dict(max_dims or {}).items():
            if k not in names:
                raise ValueError(f"max_dims names {k!r}, which is no symbolic input dim (those are {names})")
            if not isinstance(v, int) or v < 1: raise ValueError(f"max_dims[{k!r}] must be an int >= 1, got {v!r}")
        used: set[str] = set()
        for d in names:
            # a Variable's name is a parameter of the generated kernels: an identifier
            var = re.sub(r"\W", "_", d) if re.match(r"[A-Za-z_]", d) else "d_" + re.sub(r"\W", "_", d)
            while var in used: var += "_"
            used.add(var)
            self.max_dims[d] = dict(max_dims or {}).get(d, DEFAULT_MAX_DIM)
            self.variables[d] = Variable(var, 1, self.max_dims[d])

    @property
    def input_names(self) -> list[str]: return list(self.input_specs)

    @property
    def output_names(self) -> list[str]: return list(self.graph.output_names)

    def _check_inputs(self, inputs: Mapping[str, Any], held: bool = False, exact: bool = False) -> dict[str, Tensor]:
        """The inputs checked and made Tensors. An input of a narrow type is an array of ml_dtypes' type (with `held`,
        already the holder's array, checked to hold values of the type unless `exact` says they came from ml_dtypes'
        type) or a Tensor holding it, and becomes a NarrowTensor."""
        unknown = [k for k in inputs if k not in self.input_specs]
        if unknown: raise OnnxInputError(f"unknown input names {unknown}: the model's inputs are {self.input_names}")
        missing = [k for k in self.input_specs if k not in inputs]
        if missing: raise OnnxInputError(f"missing inputs {missing}: the model's inputs are {self.input_names}")
        out: dict[str, Tensor] = {}
        sizes: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        for name, (dt, dims) in self.input_specs.items():
            v = inputs[name]
            if name in self.sequence_inputs:
                out[name] = _sequence_input(name, v, self.sequence_inputs[name], self.narrow_inputs.get(name), held)
                continue
            if name in self.string_inputs:
                try: out[name] = strings(v, f"input {name!r}")  # type: ignore[assignment]
                except ValueError as e: raise OnnxInputError(str(e)) from None
                continue
            if isinstance(v, Tensor):
                t = v
                if name in self.narrow_inputs and narrow_type(v) not in (None, self.narrow_inputs[name]):
                    raise OnnxInputError(f"input {name!r} must have element type "
                                         f"{NARROW[self.narrow_inputs[name]].name}, got a tensor of "
                                         f"{NARROW[narrow_type(v)].name}")  # type: ignore[index]
                t = plain_tensor(t)
            else:
                arr = np.asarray(v)
                if name in self.narrow_inputs and not held:
                    try: arr = from_narrow_numpy(arr, self.narrow_inputs[name])
                    except Unsupported as e: raise OnnxInputError(f"input {name!r}: {e}") from None
                if dt is not None and dt != dtypes.bfloat16 and arr.dtype != np.dtype(np_name(dt)):
                    raise OnnxInputError(f"input {name!r} must have dtype {dt.name}, got a NumPy array of {arr.dtype}")
                try: t = array_to_tensor(arr, dt, realize=not self._symbolic_spec(dims, arr.shape))
                except Unsupported as e: raise OnnxInputError(f"input {name!r}: {e}") from None
                arrays[name] = arr
            if dt is not None and t.dtype != dt:
                raise OnnxInputError(f"input {name!r} must have dtype {dt.name}, got {t.dtype.name}")
            if name in self.narrow_inputs and not isinstance(v, NarrowTensor) and \
                    (held and not exact or isinstance(v, Tensor)):
                t = self._exact_narrow(name, t, arrays.get(name))
            if dims is not None:
                if len(dims) != len(t.shape):
                    raise OnnxInputError(f"input {name!r} must have {len(dims)} dims {_fmt_dims(dims)}, got shape "
                                         f"{tuple(t.shape)}")
                for i, (d, s) in enumerate(zip(dims, t.shape)):
                    if isinstance(d, int) and d > 0 and d != s:
                        raise OnnxInputError(f"input {name!r} must have shape {_fmt_dims(dims)}, got {tuple(t.shape)} "
                                             f"(dim {i} is {s}, not {d})")
                    if is_symbolic(s) and not isinstance(d, str):
                        raise OnnxInputError(f"input {name!r}: dim {i} is symbolic ({s!r}), but the model declares "
                                             f"it {'unnamed' if d is None else d}: only named dims may be symbolic")
                    if isinstance(d, str):
                        if not sym_eq(sizes.setdefault(d, s), s):
                            raise OnnxInputError(f"input {name!r}: dim {i} ({d!r}) is {s!r}, but another input gave "
                                                 f"{d!r} = {sizes[d]!r}")
            out[name] = t
        for name, t in out.items():
            dims = self.input_specs[name][1]
            if name not in self.sequence_inputs and name not in self.string_inputs and \
                    self._symbolic_spec(dims, t.shape):
                out[name] = self._bind(name, t, arrays.get(name))
        return self._tagged(out)

    def _exact_narrow(self, name: str, t: Tensor, arr: np.ndarray | None) -> Tensor:
        return _exact_narrow(f"input {name!r}", self.narrow_inputs[name], t, arr)

    def _tagged(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The graph's input values with those of an 8-, 6-, 4- or 2-bit type as NarrowTensors."""
        return {n: NarrowTensor(v, self.narrow_inputs[n]) if n in self.narrow_inputs and isinstance(v, Tensor)
                and not isinstance(v, NarrowTensor) else v for n, v in values.items()}

    def _symbolic_spec(self, dims: Sequence[int | str | None] | None, shape: Sequence[Any]) -> bool:
        """Whether an input of this concrete shape gets bound Variables for its named dims."""
        if not self.symbolic_dims or dims is None or len(dims) != len(shape) or has_symbolic(shape): return False
        named = [(d, s) for d, s in zip(dims, shape) if isinstance(d, str)]
        return bool(named) and all(1 <= s <= self.max_dims[d] for d, s in named)

    def _bind(self, name: str, t: Tensor, arr: np.ndarray | None) -> Tensor:
        """The input in memory sized for its dims' maxima, as a view whose named dims are bound Variables: every
        value then has the same kernels (a kernel's code depends on the sizes of the buffers it reads)."""
        dims = self.input_specs[name][1]
        assert dims is not None
        shape = [self.variables[d].bind(s) if isinstance(d, str) else s for d, s in zip(dims, t.shape)]
        full = int(np.prod([self.max_dims[d] if isinstance(d, str) else s for d, s in zip(dims, t.shape)]))
        if t.dtype == dtypes.bfloat16: return t  # (NumPy has no bfloat16 to copy from)
        if arr is None:
            if _realize.capturing: return t  # (its data can't be read during a capture: concrete shapes)
            arr = np.asarray(t.numpy())
        big = Tensor.empty(full, dtype=t.dtype, device=t.device).realize()
        buf = device_buffer(big.uop).ensure_allocated()
        # the elements row-major at the start, which is the layout of a reshape of the prefix to the symbolic shape
        host = np.ascontiguousarray(arr if arr.dtype == np.dtype(np_name(t.dtype)) else arr.astype(np_name(t.dtype)))
        if host.size: buf.view(host.size, t.dtype, 0).copyin(memoryview(host.reshape(-1).view(np.uint8)))
        out = big.shrink(((0, _prod(shape)),)).reshape(tuple(shape))
        return with_host(out, arr) if known_value(t) is not None else out

    def bind_inputs(self, inputs: Mapping[str, Any] | None = None, *, held: bool = False,
                    **kwargs: Any) -> dict[str, Tensor]:
        """The inputs as the runner passes them to the graph: checked, with the named dims bound Variables. Pass these
        to a TinyJit function that calls the runner, so its capture serves every batch size. `held`: arrays for inputs
        of 8-, 6-, 4- or 2-bit types are already in the holder's dtype."""
        return self._check_inputs(dict(inputs or {}, **kwargs), held)

    def __call__(self, inputs: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Tensor]:
        bound = self._check_inputs(dict(inputs or {}, **kwargs))
        outs = self.graph.run(bound, self)
        # an output that is an input (an Identity from input to output, or a view of one) is a copy, as onnxruntime
        # returns: under TinyJit a replay then hands back fresh memory, not the memory of the capture's input
        bases = _input_bases(bound.values())
        return {n: _keep_narrow(v, _copied_if_in(v, bases)) for n, v in outs.items()} if bases else outs

    def jit(self, prune: bool = True) -> JitRunner:
        """This model as a function of NumPy arrays (or Tensors) returning NumPy arrays, as onnxruntime's `run`: its
        kernels are captured by TinyJit and replayed (see JitRunner). `prune`: what is computed from the initializers
        alone runs once (TinyJit's prune; the initializers must not change between calls)."""
        return JitRunner(self, prune)


class JitRunner:
    """`OnnxRunner.jit()`: calls the model under TinyJit, one capture per set of input shapes and dtypes. An array for
    an input of static shape is copied straight into memory kept for that input, so each replay is passed the same
    tensors and the kernels read the new values there (no Tensor is made per call); the kernels write the outputs into
    memory the TinyJit keeps (`TinyJit.replay_kept`), copied out into new NumPy arrays, so no output Tensor is made per
    call either. Inputs with symbolic dims, and Tensors, go through
    `bind_inputs` on every call. The first call with new shapes checks them as a plain call does."""

    def __init__(self, runner: OnnxRunner, prune: bool = True):
        self.runner, self.prune = runner, prune
        self._jits: dict[tuple, Any] = {}
        # per set of input shapes and dtypes: the realized tensors, in input order, whose memory takes the arrays
        self._kept: dict[tuple, list[Tensor]] = {}
        # per set of input shapes: the kept inputs' Buffers, and each output's shape and NumPy dtype (None: an output
        # that takes the general path), found on the first replay
        self._bufs: dict[tuple, list[Any]] = {}
        self._out_plans: dict[tuple, list[tuple[tuple[int, ...], np.dtype] | None]] = {}
        # per set of input shapes, from the first replay: how a call with such arrays is replayed
        self._replays: dict[tuple, _KeptCall] = {}
        # per set of array shapes with named (symbolic) dims: the TinyJit, the inputs as views with bound Variables of
        # memory kept per input (sized for its dims' maxima, shared by every set), and that memory's first elements
        # as Buffers the arrays are copied into
        self._symbolic: dict[tuple, tuple[Any, list[Tensor], list[Any]]] = {}
        self._memory: dict[tuple, Tensor] = {}
        # the sets of input shapes whose outputs all have no elements (run plainly: a capture would run no kernel)
        self._no_elements: set[tuple] = set()
        self._last: Any = None
        # per TinyJit (by id): the checks of device values its graph registered, whose values follow the outputs
        self._checks: dict[int, list[DeviceCheck]] = {}
        # the 8-, 6-, 4- or 2-bit ONNX type of each output (None for others), found when a capture runs the graph
        self._out_types: list[int | None] = []
        self._narrow_out = False   # (whether any of them is)
        # (the model's input and output names, looked up on every call)
        self._in_names, self._out_names = runner.input_names, runner.output_names

    def __call__(self, inputs: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        if self.runner.string_inputs:
            raise OnnxInputError(f"inputs {sorted(self.runner.string_inputs)} are string tensors, which stay on the "
                                 f"host: a TinyJit capture can't take them (call the runner itself)")
        given = dict(inputs or {}, **kwargs)
        # (arrays of ml_dtypes' narrow types as arrays of their holders' dtypes, which replays copy in)
        for name, t in self.runner.narrow_inputs.items():
            if type(v := given.get(name)) is np.ndarray:
                try: given[name] = from_narrow_numpy(v, t)
                except Unsupported as e: raise OnnxInputError(f"input {name!r}: {e}") from None
        names = self._in_names
        arrays = [given.get(n) for n in names]
        # (the common call: exactly the model's inputs, each a NumPy array)
        plain = len(given) == len(names) and not [a for a in arrays if type(a) is not np.ndarray]
        key = tuple([(a.shape, a.dtype) for a in arrays]) if plain else None   # type: ignore[union-attr]
        if key is not None and (fast := self._replays.get(key)) is not None:
            self._last = fast.step
            return self._outputs(fast(arrays))
        if key is not None and (any(a.size == 0 for a in arrays) or key in self._no_elements):  # type: ignore
            # (an empty input, or outputs without elements: nothing to compute, and TinyJit captures no function that
            # runs no kernel)
            return {n: _narrow_numpy(_to_numpy(_realized(v)), _narrow_types(v)) for n, v in self.runner(given).items()}
        if key is not None and (sym := self._symbolic.get(key)) is not None:
            step, views, bufs = sym
            self._last = step
            for b, arr in zip(bufs, arrays): b.copyin(_bytes(arr))
            return self._numpy(step(*views))
        if key is not None and key in self._jits:
            step = self._last = self._jits[key]
            kept = self._kept[key]
            if (bufs := self._bufs.get(key)) is None: bufs = self._bufs[key] = [device_buffer(t.uop) for t in kept]
            for b, arr in zip(bufs, arrays):
                b.copyin(_bytes(arr))
            outs = step(*kept)
            if (plan := self._out_plans.get(key)) is None:
                plan = self._out_plans[key] = [_out_plan(o) for o in outs]
                kept_plans = plan if all(p is not None and _reshaped_buffer(o) for o, p in zip(outs, plan)) else None
                self._replays[key] = _KeptCall(step, kept, bufs, kept_plans, [(a.shape, a.dtype) for a in arrays])
            return self._outputs([_to_numpy(o) if p is None else _copy_out(o, *p) for o, p in zip(outs, plan)])
        from fusegrad import TinyJit
        bound = self.runner._check_inputs(given, held=True, exact=True)   # (checks names, dtypes and shapes)
        if key is not None and all(not has_symbolic(t.shape) and t.dtype != dtypes.bfloat16 for t in bound.values()):
            # static shapes: memory kept per input, filled from the arrays from now on
            kept = self._kept[key] = [plain_tensor(bound[n]).contiguous().realize() for n in names]
            step = self._last = self._jits[key] = TinyJit(self._graph, prune=self.prune)
            outs = step(*kept)
            if all(isinstance(o, Tensor) and o.numel() == 0 for o in outs[:len(self._out_names)]):
                # (every output is empty, as a Slice past the end makes it: these shapes are run plainly from now on)
                self._no_elements.add(key)
                del self._jits[key], self._kept[key]
            return self._numpy(outs)
        # (a symbolic dim is left out of the key: one capture replays for each of its values)
        sig = tuple((n, tuple(d if isinstance(d, int) else None for d in t.shape), t.dtype) for n, t in bound.items())
        if (step := self._jits.get(sig)) is None: step = self._jits[sig] = TinyJit(self._graph, prune=self.prune)
        self._last = step
        plain_bound = [plain_tensor(bound[n]) for n in names]
        if key is None or any(t.dtype == dtypes.bfloat16 for t in plain_bound):
            return self._numpy(step(*plain_bound))
        # arrays with named dims: from now on copied into memory kept per input, read through views made once per set
        # of shapes (binding a new array's dims is a symbolic shrink and reshape, ~1 ms a call)
        views, bufs = [], []
        for n, arr, t in zip(names, arrays, plain_bound):
            dims = self.runner.input_specs[n][1] or ()
            full = int(np.prod([self.runner.max_dims[d] if isinstance(d, str) else s
                                for d, s in zip(dims, arr.shape)])) if has_symbolic(t.shape) else arr.size
            if (mem := self._memory.get((n, t.dtype, full))) is None:
                mem = self._memory[(n, t.dtype, full)] = Tensor.empty(full, dtype=t.dtype, device=t.device).realize()
            views.append(mem.shrink(((0, _prod(t.shape)),)).reshape(t.shape))
            bufs.append(device_buffer(mem.uop).ensure_allocated().view(arr.size, t.dtype, 0))
            bufs[-1].copyin(_bytes(arr))   # type: ignore[arg-type]
        self._symbolic[key] = (step, views, bufs)
        return self._numpy(step(*views))

    @property
    def captured(self) -> list[Any]:
        """The kernels (ExecItems) a replay runs, of the capture for the shapes of the last call."""
        return self._last.captured if self._last is not None else []

    def _graph(self, *tensors: Tensor) -> list[Any]:
        # (ops register the checks of device values they can't read here: their values are extra outputs, read and
        # checked after every call, replays included)
        checks: list[DeviceCheck] = []
        self.runner.device_checks = checks
        try: outs = self.runner.graph.run(self.runner._tagged(dict(zip(self.runner.input_names, tensors))), self.runner)
        finally: self.runner.device_checks = None
        self._out_types = [_narrow_types(outs[n]) for n in self.runner.output_names]
        self._narrow_out = any(self._out_types)
        self._checks[id(self._last)] = checks
        # (an output that is an input is copied, as in OnnxRunner.__call__, and so is any other whose memory no kernel
        # of the call writes: an initializer or a view of one, a value the ops computed on the host, as Cast of a
        # Shape. A capture whose outputs all were would run no kernel, which TinyJit refuses, and a replay returned
        # such an output's memory unwritten, or reused for other values)
        bases = _input_bases(tensors)
        # (checked again once realized: a reduction over one element, a sum of a 0-d input, realizes as a view of it)
        return [_realized(_copied_if_in(_realized(_copied_if_realized(plain_tensor(v))), bases))
                for v in [outs[n] for n in self.runner.output_names] + [t for c in checks for t in c.values]]

    def _numpy(self, outs: list[Any]) -> dict[str, Any]:
        return self._outputs([_to_numpy(o) for o in outs])

    def _outputs(self, outs: list[Any]) -> dict[str, Any]:
        """The model's outputs by name, from a call's NumPy outputs; the values of the device checks after them are
        checked (an error names the node whose check failed)."""
        names = self._out_names
        if len(outs) > (n := len(names)):
            at = n
            for c in self._checks.get(id(self._last), ()):
                values, at = outs[at:at + len(c.values)], at + len(c.values)
                if (msg := c.check(*values)) is not None: raise OnnxNodeError(c.node, c.op_type, f"ValueError: {msg}")
        return self._narrowed(dict(zip(names, outs))) if self._narrow_out else dict(zip(names, outs))

    def _narrowed(self, outs: dict[str, Any]) -> dict[str, Any]:
        """The NumPy outputs with those of 8-, 6-, 4- or 2-bit types in ml_dtypes' types."""
        if not any(self._out_types): return outs
        return {n: _narrow_numpy(v, t) for (n, v), t in zip(outs.items(), self._out_types)}


# the smallest input read in place rather than copied in: below, the copy costs less than the bookkeeping of reading
# in place (the ResNet-style CNN at batch 1, a 12 KiB image: 18.0 -> 19.5 us a call in place)
IN_PLACE_MIN_BYTES = 1 << 16


class _KeptCall:
    """JitRunner's call for one set of input shapes, from its first replay on: the arrays are copied into the kept
    inputs' memory, the TinyJit replays (`replay_kept` where each output is a tensor of static shape), and the outputs
    are copied out into new arrays. Where the memory is the host's (the CPU device), the copies go through NumPy views
    of it made once (of the inputs' memory, and of the output Buffers `replay_kept` gave last), after waiting for the
    device's queue: no memoryview, Buffer check or wait per array.

    On the CPU device the replay returns once its kernels have run (`replay_kept(wait=True)`), so they may read an
    array in place of the kept memory, without the copy in, while the call runs: one that is C-contiguous, aligned as
    the device's allocations are, of the input's size (at least IN_PLACE_MIN_BYTES), for an input no kernel writes
    (`reads_in_place`). Nothing reads the array once the call has returned."""

    def __init__(self, step: Any, kept: list[Tensor], bufs: list[Any], plans: list[Any] | None,
                 specs: list[tuple[tuple[int, ...], np.dtype]]):
        self.step, self.kept, self.bufs, self.plans = step, kept, bufs, plans
        self.device = Device[bufs[0].device] if bufs else None
        self.host = bool(bufs) and all(_host_memory(b) for b in bufs)
        # (views made after the queue is drained: as_buffer waits for the kernels using the memory)
        if self.host and self.device is not None: self.device.synchronize()
        self.ins = [_host_view(b, shape, dt) for b, (shape, dt) in zip(bufs, specs)] if self.host else None
        self.got: list[Any] | None = None          # the output Buffers of the last replay_kept, and views of them
        self.outs: list[np.ndarray] | None = None
        # per input, the ctypes type of an allocation of its memory's size where an array may be read in place (None
        # where it may not); None where none may
        self.in_place: list[Any] | None = None
        if self.host and plans is not None and all(isinstance(b.allocator, CPUAllocator) for b in bufs):
            allowed = step.reads_in_place()
            types = [ctypes.c_uint8 * b.nbytes if ok and b.nbytes == int(np.prod(shape)) * np.dtype(dt).itemsize
                     and b.nbytes >= IN_PLACE_MIN_BYTES else None for b, ok, (shape, dt) in zip(bufs, allowed, specs)]
            if any(t is not None for t in types): self.in_place = types

    def _places(self, arrays: list[Any]) -> list[Any] | None:
        """Per array, an allocation of its own memory to read it in place (or None: copied in); None where none is."""
        places, found = [], False
        for t, arr in zip(self.in_place, arrays):  # type: ignore[arg-type]
            a = None
            if t is not None and arr.flags.c_contiguous:
                try: a = t.from_buffer(arr)
                except TypeError: a = t.from_address(arr.ctypes.data)   # (a read-only array)
                if ctypes.addressof(a) % ALIGN: a = None
                else: found = True
            places.append(a)
        return places if found else None

    def __call__(self, arrays: list[Any]) -> list[Any]:
        step, kept, plans = self.step, self.kept, self.plans
        places = self._places(arrays) if self.in_place is not None else None
        if self.ins is not None:
            # (the last call waited for its kernels; other work queued since may not have run yet)
            if places is None:
                self.device.synchronize()  # type: ignore[union-attr]
                for view, arr in zip(self.ins, arrays): np.copyto(view, arr)
            elif None in places:
                self.device.synchronize()  # type: ignore[union-attr]
                for view, arr, a in zip(self.ins, arrays, places):
                    if a is None: np.copyto(view, arr)
        else:
            for b, arr in zip(self.bufs, arrays): b.copyin(_bytes(arr))
        # (the outputs' memory is the JIT's own, copied out here: no output tensor is made)
        got = None if plans is None else step.replay_kept(*kept, wait=self.host, inputs=places)
        if got is None:
            if places is not None:   # (declined, nothing run: the arrays read in place are copied in after all)
                self.device.synchronize()  # type: ignore[union-attr]
                for view, arr, a in zip(self.ins, arrays, places):  # type: ignore[arg-type]
                    if a is not None: np.copyto(view, arr)
            return [_to_numpy(o) for o in step(*kept)]
        if got is not self.got:
            self.got = got
            self.outs = [_host_view(b, *p) for b, p in zip(got, plans)] \
                if self.host and all(_host_memory(b) for b in got) else None
        if self.outs is None: return [_copy_buffer(b, *p) for b, p in zip(got, plans)]
        # (replay_kept waited for its kernels)
        return [v.copy() for v in self.outs]


def _bytes(arr: np.ndarray) -> memoryview:
    """An array's elements in C order as bytes (a memoryview can't cast an array with a zero in its shape)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def _host_memory(buf: Any) -> bool:
    """Whether a Buffer's memory is the host's, which `as_buffer` gives without a copy."""
    return hasattr(buf.allocator, "_as_buffer")


def _host_view(buf: Any, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
    """A NumPy view of the first elements of a Buffer in host memory, as many as `shape` holds."""
    n = int(np.prod(shape))
    return np.frombuffer(buf.ensure_allocated().as_buffer(), dt, n).reshape(shape)


def _narrow_types(v: Any) -> Any:
    """The 8-, 6-, 4- or 2-bit type of an output (None for others; a list of them for a sequence)."""
    return [narrow_type(x) for x in v] if isinstance(v, list) else narrow_type(v)


def _narrow_numpy(v: Any, t: Any) -> Any:
    """A NumPy output (or a list of them) of the holder's dtype in ml_dtypes' type, as `_narrow_types` says."""
    if isinstance(t, list) and isinstance(v, list): return [_narrow_numpy(x, tx) for x, tx in zip(v, t)]
    return to_narrow_numpy(v, t) if isinstance(t, int) and isinstance(v, np.ndarray) else v


def _keep_narrow(old: Any, new: Any) -> Any:
    """`new` (a copy of `old`) with the 8-, 6-, 4- or 2-bit type of `old` (elementwise for sequences)."""
    if isinstance(old, list) and isinstance(new, list): return [_keep_narrow(o, n) for o, n in zip(old, new)]
    t = narrow_type(old)
    return NarrowTensor(new, t) if t is not None and not isinstance(new, NarrowTensor) else new


def _realized(v: Any) -> Any:
    """An output with its tensors realized (a sequence output is a list of them, an empty optional None)."""
    if isinstance(v, Tensor): return v.realize()
    if isinstance(v, list): return [_realized(x) for x in v]
    return v


def _input_bases(values: Any) -> set[int]:
    """The ids of the base nodes of the input tensors (those inside sequence inputs too)."""
    out: set[int] = set()
    for v in values:
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, Tensor): out.add(id(t.uop.base))
    return out


def _empty_symbolic(v: Tensor) -> bool:
    """Whether a tensor of a symbolic shape has no elements: where outputs are copied, such a one is a new empty
    tensor instead (Tensor.empty can't size memory for that shape)."""
    return 0 in v.shape and any(is_symbolic(d) for d in v.shape)


def _copy(v: Tensor) -> Tensor:
    """`v` in new memory, written by a kernel (an assign into new memory) that a TinyJit capture keeps."""
    if _empty_symbolic(v): return Tensor.zeros(*v.shape, dtype=v.dtype, device=v.device)
    return Tensor.empty(*v.shape, dtype=v.dtype, device=v.device).assign(v)


def _copied_if_realized(v: Any) -> Any:
    """An output with each tensor that is (a view of) memory that exists already made a copy."""
    if isinstance(v, Tensor) and v.uop.base.op is Ops.BUFFER: return _copy(v)
    if isinstance(v, list): return [_copied_if_realized(x) for x in v]
    return v


def _copied_if_in(v: Any, bases: set[int]) -> Any:
    """An output with each tensor that is a view of one of `bases` (ids of input buffer nodes) made a copy."""
    if isinstance(v, Tensor) and id(v.uop.base) in bases: return _copy(v)
    if isinstance(v, list): return [_copied_if_in(x, bases) for x in v]
    return v


def _out_plan(v: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """An output's shape and NumPy dtype when it can be copied straight out of its buffer on every replay."""
    if not isinstance(v, Tensor) or v.dtype == dtypes.bfloat16 or has_symbolic(v.shape): return None
    return tuple(v.shape), np.dtype(np_name(v.dtype))


def _reshaped_buffer(v: Tensor) -> bool:
    """Whether a tensor is a buffer or reshapes of one."""
    u = v.uop
    while u.op is Ops.RESHAPE: u = u.src[0]
    return u.op is Ops.BUFFER


def _copy_out(v: Tensor, shape: tuple[int, ...], dt: np.dtype) -> Any:
    """A replay's output of a static shape as NumPy, copied out of its buffer (Tensor.numpy when it is no buffer)."""
    u = v.uop
    while u.op is Ops.RESHAPE: u = u.src[0]
    if u.op is not Ops.BUFFER: return v.numpy()
    return _copy_buffer(device_buffer(u), shape, dt)


def _copy_buffer(buf: Any, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
    """The first elements of a Buffer, as many as `shape` holds, copied into a new array."""
    out = np.empty(shape, dt)
    if out.size == 0: return out
    if out.size != buf.size: buf = buf.ensure_allocated().view(out.size, buf.dtype, 0)
    buf.copyout(memoryview(out).cast("B"))
    return out


def _to_numpy(v: Any) -> Any:
    """An output as NumPy: a tensor that is its buffer (a replay's output) is copied out of that memory directly,
    anything else through Tensor.numpy."""
    if isinstance(v, list): return [_to_numpy(x) for x in v]
    if not isinstance(v, Tensor): return v
    plan = _out_plan(v)
    return v.numpy() if plan is None else _copy_out(v, *plan)


def _exact_narrow(what: str, nt: int, t: Tensor, arr: np.ndarray | None) -> Tensor:
    """A value of an 8-, 6-, 4- or 2-bit type given in its holder's dtype (a plain Tensor, or an array with `held`):
    every value must be one of the type's, since the holder's values are read as they are. onnxruntime refuses a
    tensor of another element type; so does this check, where the values can be read: on the host, or read back
    outside a TinyJit capture. Inside a capture they are rounded into the type on the device (as a saturating Cast),
    which leaves the type's values as they are."""
    host = arr if arr is not None else known_value(t)
    if host is None:
        if _realize.capturing: return plain_tensor(round_to(t, nt))
        host = np.asarray(t.numpy())
    bad = inexact(host, nt)
    if bad.any():
        n = NARROW[nt]
        raise OnnxInputError(f"{what} has element type {n.name}, but {int(bad.sum())} of the values given (as "
                             f"{t.dtype.name}) are not values of {n.name}, e.g. {host[bad][:4].tolist()}: give an "
                             f"array of ml_dtypes.{n.np_type.__name__}, or round the values into the type")
    return t


def _element_type(tp: onnx.TypeProto) -> int | None:
    """The tensor element type inside a sequence or optional type (None where it isn't declared)."""
    while True:
        kind = tp.WhichOneof("value")
        if kind == "tensor_type": return tp.tensor_type.elem_type
        if kind not in ("sequence_type", "optional_type"): return None
        tp = getattr(tp, kind).elem_type


def _sequence_input(name: str, v: Any, kind: str, nt: int | None = None, held: bool = False) -> Any:
    """A sequence input as a list of Tensors; an optional one as None (empty), a Tensor or such a list. `nt`: the
    8-, 6-, 4- or 2-bit element type of its tensors (given as arrays of ml_dtypes' type or as held values)."""
    def tensor(x: Any) -> Tensor:
        if nt is not None: return _narrow_element(x)
        if isinstance(x, Tensor): return x
        try: return array_to_tensor(np.asarray(x))
        except Unsupported as e: raise OnnxInputError(f"input {name!r}: {e}") from None

    def _narrow_element(x: Any) -> Tensor:
        assert nt is not None
        what = f"a tensor of input {name!r}"
        if isinstance(x, NarrowTensor):
            if x.onnx_type != nt:
                raise OnnxInputError(f"{what} must have element type {NARROW[nt].name}, got {NARROW[x.onnx_type].name}")
            return x
        arr = None
        if not isinstance(x, Tensor):
            arr = np.asarray(x)
            if not held or arr.dtype == np.dtype(NARROW[nt].np_type):
                try: arr = from_narrow_numpy(arr, nt)
                except Unsupported as e: raise OnnxInputError(f"{what}: {e}") from None
            x = array_to_tensor(arr)
        if x.dtype != NARROW[nt].wide:
            raise OnnxInputError(f"{what} must be held in {NARROW[nt].wide.name}, got {x.dtype.name}")
        return NarrowTensor(_exact_narrow(what, nt, x, arr), nt)
    if v is None:
        if kind == "optional_type": return None
        raise OnnxInputError(f"input {name!r} is a sequence: give a list of arrays, not None")
    if isinstance(v, (list, tuple)): return [tensor(x) for x in v]
    if kind == "sequence_type": raise OnnxInputError(f"input {name!r} is a sequence: give a list of arrays")
    return tensor(v)


def _fmt_dims(dims: Sequence[int | str | None]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"
