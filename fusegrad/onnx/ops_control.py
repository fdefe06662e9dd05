"""Control flow: If and Loop, whose bodies are subgraphs run by the runner's Graph.

The branch that If takes and the number of iterations of a Loop are read on the host: a condition computed by the
model is a device read, so a call with such a node can't be captured whole by TinyJit (a constant condition or trip
count is read from its host copy). Each iteration of a Loop adds its body to the lazy graph, which is fine for the
short loops that exported models use (a fixed trip count, a loop over a sequence's length)."""
from __future__ import annotations

from typing import Any

import numpy as np

from fusegrad import Tensor
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import Context, op, scalar, with_host


def _run_body(graph: Any, inputs: list[Tensor], ctx: Context) -> list[Tensor]:
    names = graph.input_names
    if len(names) != len(inputs):
        raise ValueError(f"the body graph {graph.proto.name!r} takes {len(names)} inputs, the node gives {len(inputs)}")
    # the body sees every value of the enclosing graphs, and its own inputs over them
    values = {**dict(ctx.env), **dict(zip(names, inputs))}
    out = graph.run(values, ctx.runner)
    return [out[n] for n in graph.output_names]


@op("If")
def if_(cond: Tensor, *, then_branch: Any, else_branch: Any, ctx: Context) -> list[Tensor]:
    branch = then_branch if bool(scalar(cond)) else else_branch
    outs = _run_body(branch, [], ctx)
    if len(outs) != ctx.n_outputs:
        raise ValueError(f"the branch gives {len(outs)} outputs, the node has {ctx.n_outputs}")
    return outs


def _int64(v: int) -> Tensor:
    arr = np.array(v, dtype=np.int64)
    return with_host(Tensor(arr), arr)


def _bool(v: bool) -> Tensor:
    arr = np.array(v, dtype=np.bool_)
    return with_host(Tensor(arr), arr)


@op("Loop")
def loop(trip_count: Tensor | None, cond: Tensor | None, *carried: Tensor, body: Any, ctx: Context) -> list[Tensor]:
    n = int(scalar(trip_count)) if trip_count is not None else None
    keep_going = bool(scalar(cond)) if cond is not None else True
    if n is None and cond is None: raise Unsupported("a Loop with neither a trip count nor a condition never ends")
    state = list(carried)
    scans: list[list[Tensor]] = []
    i = 0
    while keep_going and (n is None or i < n):
        outs = _run_body(body, [_int64(i), _bool(keep_going)] + state, ctx)
        if len(outs) < 1 + len(state):
            raise ValueError(f"the body gives {len(outs)} outputs, it needs the condition and {len(state)} values")
        state, new_scans = outs[1:1 + len(state)], outs[1 + len(state):]
        if not scans: scans = [[] for _ in new_scans]
        for acc, v in zip(scans, new_scans): acc.append(v)
        # (a condition computed by the body is read back; one passed through unchanged keeps its host copy)
        keep_going = bool(scalar(outs[0]))
        i += 1
    n_scan = ctx.n_outputs - len(state)
    if not scans and n_scan:
        raise Unsupported("a Loop that runs no iteration with scan outputs (their shape comes from the body)")
    return state + [Tensor.stack(*acc, dim=0) for acc in scans]
