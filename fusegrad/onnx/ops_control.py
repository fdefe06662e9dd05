"""Control flow: If, Loop and Scan, whose bodies are subgraphs run by the runner's Graph.

The branch that If takes and the number of iterations of a Loop are read on the host: a condition computed by the
model is a device read, so a call with such a node can't be captured whole by TinyJit (a constant condition or trip
count is read from its host copy). Each iteration of a Loop adds its body to the lazy graph, which is fine for the
short loops that exported models use (a fixed trip count, a loop over a sequence's length)."""
from __future__ import annotations

from typing import Any

import numpy as np

from fusegrad import Tensor
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.narrow import common_type, narrow_type, retag
from fusegrad.onnx.ops import Context, ints, op, scalar, with_host


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
    # (stacking makes a new tensor: values of an 8-, 6-, 4- or 2-bit type keep it)
    return state + [retag(Tensor.stack(*acc, dim=0), common_type(acc)) for acc in scans]


def _slice_at(x: Tensor, axis: int, i: int) -> Tensor:
    """x at index i of `axis`, without that axis."""
    return x.shrink(tuple((i, i + 1) if d == axis else None for d in range(x.ndim))).reshape(
        x.shape[:axis] + x.shape[axis + 1:])


def _scan(body: Any, states: list[Tensor], scans: list[Tensor], in_axes: list[int], in_dirs: list[int],
          out_axes: list[int], out_dirs: list[int], ctx: Context) -> list[Tensor]:
    """One Scan: the body runs once per index of the scan inputs' axes, carrying the states; the scan outputs stack
    each run's values along their axes (in reverse order where their direction is 1)."""
    if not scans: raise ValueError("Scan needs at least one scan input")
    axes = [a % max(x.ndim, 1) for a, x in zip(in_axes, scans)]
    n = scans[0].shape[axes[0]]
    if any(x.shape[a] != n for x, a in zip(scans, axes)):
        raise ValueError(f"the scan inputs have different lengths along their axes: "
                         f"{[x.shape[a] for x, a in zip(scans, axes)]}")
    per_step: list[list[Tensor]] = []
    for t in range(n):
        xs = [retag(_slice_at(x, a, n - 1 - t if d else t), narrow_type(x)) for x, a, d in zip(scans, axes, in_dirs)]
        outs = _run_body(body, states + xs, ctx)
        states, step = outs[:len(states)], outs[len(states):]
        per_step.append(step)
    n_out = len(body.output_names) - len(states)
    if n == 0 and n_out: raise Unsupported("a Scan of length 0 with scan outputs (their shape comes from the body)")
    stacked = []
    for j in range(n_out):
        vals = [s[j] for s in per_step]
        if out_dirs[j]: vals = vals[::-1]
        a = out_axes[j] % (vals[0].ndim + 1)
        stacked.append(retag(Tensor.stack(*vals, dim=a), common_type(vals)))
    return states + stacked


@op("Scan")
def scan(*inputs: Tensor | None, body: Any, num_scan_inputs: int, scan_input_axes: Any = None,
         scan_input_directions: Any = None, scan_output_axes: Any = None, scan_output_directions: Any = None,
         directions: Any = None, ctx: Context) -> list[Tensor]:
    m = num_scan_inputs
    n_out = len(body.output_names)
    if ctx.opset >= 9:
        states, scans = list(inputs[:len(inputs) - m]), list(inputs[len(inputs) - m:])
        k = n_out - len(states)
        return _scan(body, states, scans, list(scan_input_axes or [0] * m), list(scan_input_directions or [0] * m),
                     list(scan_output_axes or [0] * k), list(scan_output_directions or [0] * k), ctx)
    # opset 8: an optional sequence_lens first, then inputs with a batch dim 0 (the scan axis is 1): one Scan per batch
    seq_lens, rest = inputs[0], list(inputs[1:])
    states, scans = rest[:len(rest) - m], rest[len(rest) - m:]
    batch, length = scans[0].shape[0], scans[0].shape[1]
    if seq_lens is not None and any(v != length for v in ints(seq_lens)):
        raise Unsupported("Scan (opset 8) sequence_lens shorter than the sequence")
    k = n_out - len(states)
    per_batch = [_scan(body, [retag(s[b], narrow_type(s)) for s in states],
                       [retag(x[b], narrow_type(x)) for x in scans], [0] * m, list(directions or [0] * m),
                       [0] * k, [0] * k, ctx) for b in range(batch)]
    return [retag(Tensor.stack(*(vals := [res[j] for res in per_batch]), dim=0), common_type(vals))
            for j in range(n_out)]
