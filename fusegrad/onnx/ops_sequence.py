"""Sequence and optional values: SequenceEmpty, SequenceConstruct, SequenceInsert, SequenceAt, SequenceErase,
SequenceLength, SplitToSequence, ConcatFromSequence, SequenceMap, Optional, OptionalHasElement, OptionalGetElement.

A sequence is a Python list of Tensors and an optional value is its element or None (the empty optional), in the
runner's environment, at the graph's inputs and at its outputs. An op hands the runner a tuple of its outputs, so a
list that is one sequence is never taken for several outputs. Ops never change a list they are given: a value can be
read by several nodes (and by every iteration of a Loop)."""
from __future__ import annotations

from typing import Any

import numpy as np

from fusegrad import Tensor
from fusegrad.onnx.ops import Context, axis_of, ints, op, scalar, with_host


def _seq(v: Any, what: str) -> list[Tensor]:
    if not isinstance(v, list): raise TypeError(f"{what} must be a sequence, got {type(v).__name__}")
    return v


def _tensor(v: Any, what: str) -> Tensor:
    if not isinstance(v, Tensor): raise TypeError(f"{what} must be a tensor, got {type(v).__name__}")
    return v


def _position(pos: Tensor | None, n: int, default: int, inserting: bool) -> int:
    """A position in a sequence of n values (negative counts from the end); an insert may also go at n."""
    if pos is None: return default
    p = int(scalar(_tensor(pos, "the position")))
    hi = n if inserting else n - 1
    if not -n <= p <= hi: raise IndexError(f"position {p} is out of range for a sequence of {n} values")
    return p + n if p < 0 else p


def _int64(v: int) -> Tensor:
    arr = np.array(v, dtype=np.int64)
    return with_host(Tensor(arr), arr)


@op("Identity")
def identity(x: Any) -> tuple[Any]:
    # (registered over ops.py's Identity: it passes sequences and optionals as well as tensors)
    return (x,)


@op("SequenceEmpty")
def sequence_empty(*, dtype: int = 1) -> tuple[list[Tensor]]: return ([],)


@op("SequenceConstruct")
def sequence_construct(*xs: Tensor) -> tuple[list[Tensor]]:
    if not xs: raise ValueError("SequenceConstruct needs at least one input")
    dts = {_tensor(x, "an input").dtype for x in xs}
    if len(dts) > 1: raise TypeError(f"the inputs have different dtypes: {sorted(d.name for d in dts)}")
    return (list(xs),)


@op("SequenceInsert")
def sequence_insert(seq: list[Tensor], x: Tensor, pos: Tensor | None = None) -> tuple[list[Tensor]]:
    s = _seq(seq, "the first input")
    _tensor(x, "the value inserted")
    if s and s[0].dtype != x.dtype:
        raise TypeError(f"the value inserted has dtype {x.dtype.name}, the sequence's values {s[0].dtype.name}")
    p = _position(pos, len(s), len(s), inserting=True)
    return (s[:p] + [x] + s[p:],)


@op("SequenceAt")
def sequence_at(seq: list[Tensor], pos: Tensor) -> Tensor:
    s = _seq(seq, "the first input")
    return s[_position(pos, len(s), 0, inserting=False)]


@op("SequenceErase")
def sequence_erase(seq: list[Tensor], pos: Tensor | None = None) -> tuple[list[Tensor]]:
    s = _seq(seq, "the first input")
    if not s: raise IndexError("can't erase from an empty sequence")
    p = _position(pos, len(s), len(s) - 1, inserting=False)
    return (s[:p] + s[p + 1:],)


@op("SequenceLength")
def sequence_length(seq: list[Tensor]) -> Tensor: return _int64(len(_seq(seq, "the input")))


@op("SplitToSequence")
def split_to_sequence(x: Tensor, split: Tensor | None = None, *, axis: int = 0,
                      keepdims: int = 1) -> tuple[list[Tensor]]:
    a = axis_of(axis, x.ndim)
    n = x.shape[a]
    if split is None:
        # pieces of one: the axis is kept or removed as keepdims says
        parts = [x.shrink(tuple((i, i + 1) if d == a else None for d in range(x.ndim))) for i in range(n)]
        return ([p if keepdims else p.reshape(x.shape[:a] + x.shape[a + 1:]) for p in parts],)
    sizes = ints(split)
    if split.ndim == 0:
        # pieces of that size, the last one smaller where it doesn't divide
        if sizes[0] <= 0: raise ValueError(f"split must be positive, got {sizes[0]}")
        sizes = [min(sizes[0], n - i) for i in range(0, n, sizes[0])]
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"split sizes {sizes} don't add up to dim {a} of {tuple(x.shape)}")
    return (list(x.split(sizes, a)),)


@op("ConcatFromSequence")
def concat_from_sequence(seq: list[Tensor], *, axis: int, new_axis: int = 0) -> Tensor:
    s = _seq(seq, "the input")
    if not s: raise ValueError("can't concatenate an empty sequence")
    if new_axis:
        a = axis_of(axis, s[0].ndim + 1)
        return Tensor.stack(*s, dim=a)
    a = axis_of(axis, s[0].ndim)
    return s[0].cat(*s[1:], dim=a)


@op("SequenceMap")
def sequence_map(seq: list[Tensor], *more: Any, body: Any, ctx: Context) -> tuple[list[Tensor], ...]:
    """The body run once per position of the sequences; a tensor input is given whole to every run."""
    inputs = [_seq(seq, "the first input")] + list(more)
    n = len(inputs[0])
    for i, v in enumerate(inputs):
        if isinstance(v, list) and len(v) != n:
            raise ValueError(f"input {i} is a sequence of {len(v)} values, the first one of {n}")
    names = body.input_names
    if len(names) != len(inputs):
        raise ValueError(f"the body takes {len(names)} inputs, the node gives {len(inputs)}")
    outs: list[list[Tensor]] = [[] for _ in body.output_names]
    for j in range(n):
        values = {**dict(ctx.env), **{name: v[j] if isinstance(v, list) else v for name, v in zip(names, inputs)}}
        res = body.run(values, ctx.runner)
        for acc, name in zip(outs, body.output_names): acc.append(res[name])
    return tuple(outs)


@op("Optional")
def optional(x: Any = None, *, type: Any = None) -> tuple[Any]:  # noqa: A002 - ONNX's attribute name
    # an empty optional (no input) is None; its `type` only declares what it could hold
    if x is None and type is None: raise ValueError("an empty Optional needs the `type` attribute")
    return (x,)


@op("OptionalHasElement")
def optional_has_element(x: Any = None) -> Tensor:
    arr = np.array(x is not None, dtype=np.bool_)
    return with_host(Tensor(arr), arr)


@op("OptionalGetElement")
def optional_get_element(x: Any) -> tuple[Any]:
    if x is None: raise ValueError("the optional is empty")
    return (x,)

