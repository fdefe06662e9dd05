"""Specs between stages: which ops, dtypes and shapes may appear in a graph when it leaves a stage. With SPEC=1 the
scheduler and code generator check every graph they produce; a violation raises SpecError naming the node."""
from __future__ import annotations
from typing import Callable
from fusegrad.dtype import PtrDType, dtypes
from fusegrad.uop.ops import GroupOp, Ops, UOp
from fusegrad.uop.pattern import UPat

class SpecError(RuntimeError):
    """A graph broke the contract of the stage that produced it."""

Rule = tuple[UPat, Callable[..., bool]]

def _same_shape_srcs(x: UOp) -> bool:
    shapes = {s.shape for s in x.src if s.op not in (Ops.DEVICE,)}
    return len(shapes) <= 1

tensor_spec: list[Rule] = [
    (UPat(Ops.SINK, name="x"), lambda x: True),
    (UPat(Ops.DEVICE, name="x"), lambda x: isinstance(x.arg, str)),
    (UPat(Ops.BUFFER, name="x"), lambda x: len(x.src) == 1 and x.src[0].op is Ops.DEVICE and x.arg[1] >= 0),
    (UPat(Ops.CONST, name="x"), lambda x: len(x.src) == 1 and x.src[0].op is Ops.DEVICE),
    (UPat(Ops.RANGE, name="x"), lambda x: len(x.src) == 1 and x.src[0].op is Ops.DEVICE and dtypes.is_int(x.dtype)),
    (UPat(Ops.DEFINE_VAR, name="x"), lambda x: len(x.src) == 1 and x.src[0].op is Ops.DEVICE),
    (UPat(GroupOp.Movement, name="x"), lambda x: x.dtype == x.src[0].dtype and x.shape is not None),
    (UPat(Ops.REDUCE_AXIS, name="x"), lambda x: x.arg[0] in (Ops.ADD, Ops.MAX, Ops.MUL) and
     all(0 <= a < len(x.src[0].shape) for a in x.arg[1])),
    (UPat(GroupOp.Comparison, name="x"), lambda x: x.dtype == dtypes.bool and x.src[0].dtype == x.src[1].dtype and
     _same_shape_srcs(x)),
    (UPat(Ops.WHERE, name="x"), lambda x: x.src[0].dtype == dtypes.bool and x.src[1].dtype == x.src[2].dtype == x.dtype
     and _same_shape_srcs(x)),
    (UPat(GroupOp.ALU, name="x"), lambda x: all(s.dtype == x.dtype for s in x.src) and _same_shape_srcs(x)),
    (UPat((Ops.CAST, Ops.BITCAST, Ops.CONTIGUOUS, Ops.DETACH, Ops.CONTIGUOUS_BACKWARD, Ops.CUSTOM_GRAD,
           Ops.COPY), name="x"),
     lambda x: True),
    (UPat(Ops.ASSIGN, name="x"), lambda x: len(x.src) == 2 and (x.src[1].op is Ops.KERNEL or
                                                               x.src[0].shape == x.src[1].shape)),
    (UPat(Ops.KERNEL, name="x"), lambda x: x.arg.op in (Ops.SINK, Ops.COPY)),
    # SCATTER(target, positions, values): the target with values[j] combined into flat position positions[j]
    (UPat(Ops.SCATTER, name="x"), lambda x: len(x.src) == 3 and x.src[1].shape == x.src[2].shape and
     dtypes.is_int(x.src[1].dtype) and x.src[0].dtype == x.src[2].dtype == x.dtype and
     x.arg in (None, "add", "mul", "max", "min")),
]

kernel_spec: list[Rule] = [
    (UPat(Ops.SINK, name="x"), lambda x: all(s.op is Ops.STORE for s in x.src)),
    (UPat(Ops.DEFINE_GLOBAL, name="x"), lambda x: isinstance(x.dtype, PtrDType) and isinstance(x.arg, int)),
    (UPat(Ops.DEFINE_VAR, name="x"), lambda x: not x.src and (dtypes.is_int(x.dtype) or dtypes.is_float(x.dtype))),
    (UPat(Ops.RANGE, name="x"), lambda x: x.dtype == dtypes.index and x.arg[1] in ("loop", "reduce")),
    (UPat(Ops.INDEX, name="x"), lambda x: x.src[0].op is Ops.DEFINE_GLOBAL and dtypes.is_int(x.src[1].dtype) and
     (len(x.src) == 2 or x.src[2].dtype == dtypes.bool)),
    (UPat(Ops.LOAD, name="x"), lambda x: x.src[0].op is Ops.INDEX and x.dtype == x.src[0].dtype.base),
    (UPat(Ops.STORE, name="x"), lambda x: x.src[0].op is Ops.INDEX and x.src[1].dtype == x.src[0].dtype.base),
    (UPat(Ops.REDUCE, name="x"), lambda x: x.arg in (Ops.ADD, Ops.MAX, Ops.MUL) and
     all(r.op is Ops.RANGE for r in x.src[1:])),
    (UPat(Ops.CONST, name="x"), lambda x: not x.src),
    (UPat(GroupOp.Comparison, name="x"), lambda x: x.dtype.scalar() == dtypes.bool),
    (UPat(Ops.WHERE, name="x"), lambda x: x.src[0].dtype.scalar() == dtypes.bool and x.src[1].dtype == x.src[2].dtype),
    (UPat((Ops.SHL, Ops.SHR), name="x"), lambda x: dtypes.is_int(x.dtype) or x.dtype == dtypes.bool),
    (UPat(GroupOp.ALU, name="x"), lambda x: all(s.dtype == x.dtype for s in x.src)),
    (UPat((Ops.CAST, Ops.BITCAST), name="x"), lambda x: True),
]

def _wmma_ok(x: UOp) -> bool:
    """WMMA(A, B, C) of the instruction its arg describes (renderer/__init__.py TensorCore.wmma_arg): A and B vectors
    of its input dtype, C and the result of its output dtype, as many lanes as each lane holds elements."""
    if not (isinstance(x.arg, tuple) and len(x.arg) == 7 and len(x.src) == 3 and len(x.arg[6]) == 3): return False
    din, dout, layout = x.arg[2], x.arg[3], x.arg[6]
    want = ((din, len(layout[0][2])), (din, len(layout[1][2])), (dout, len(layout[2][2])))
    got = tuple((s.dtype.scalar().name, s.dtype.count) for s in x.src)
    return got == want and (x.dtype.scalar().name, x.dtype.count) == want[2]

# what a kernel's AST may hold after the TC opt (codegen/opt/tc.py), besides kernel_spec's nodes: the fragments as
# vectors of the lanes' elements, the WMMA, the lanes of its result
tensor_core_spec: list[Rule] = [
    (UPat(Ops.WMMA, name="x"), _wmma_ok),
    (UPat(Ops.RANGE, name="x"), lambda x: x.dtype == dtypes.index and x.arg[1] in ("loop", "reduce", "local")),
    (UPat(Ops.VECTORIZE, name="x"), lambda x: x.dtype.count == len(x.src) and
     all(s.dtype == x.dtype.scalar() for s in x.src)),
    (UPat(Ops.GEP, name="x"), lambda x: len(x.src) == 1 and isinstance(x.arg, int) and 0 <= x.arg < x.src[0].dtype.count
     and x.dtype == x.src[0].dtype.scalar()),
]

def verify(sink: UOp, spec: list[Rule], stage: str) -> None:
    """Check every node of `sink` against `spec`: the first rule whose pattern matches decides; no match is an error."""
    for u in sink.toposort():
        for pat, ok in spec:
            if (m := pat.match(u, {})):
                if not ok(**m[0]): raise SpecError(f"{stage}: {u.op} node breaks the spec:\n{u}")
                break
        else: raise SpecError(f"{stage}: {u.op} may not appear here:\n{u}")
