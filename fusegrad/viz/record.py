"""The recorder behind VIZ and PROFILE. It sits at the bottom of the package (it imports nothing from fusegrad but the
helpers), so the pattern rewriter, the scheduler and the engine can all call into it. Each of their hooks is one test
of a module-level flag (`VIZ`, `PROFILE`, `TIMED`): with both knobs unset, nothing else runs.

What is recorded is plain data (strings, numbers, lists): the nodes of a graph are rows of a table
(op, dtype, arg, source rows), so a trace holds no reference to a graph and is written as JSON as it is."""
from __future__ import annotations
import atexit
import json
import linecache
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable
from fusegrad.helpers import getenv

FORMAT, VERSION = "fusegrad-viz", 1

# VIZ: record graph rewrites, schedules and kernels; 1 also serves the page at exit, 2 only saves the trace
VIZ: bool = bool(getenv("VIZ", 0))
# PROFILE: record a timeline (Chrome trace events) of kernel runs, copies, compiles, realizes and TinyJit
PROFILE: bool = bool(getenv("PROFILE", 0))
# either of them: kernels are waited for, so their run times are known (as DEBUG=2 does)
TIMED: bool = VIZ or PROFILE

# an arg longer than this is cut in the trace: a graph's labels only need to tell nodes apart
ARG_CHARS = 80

def _arg_text(arg: Any) -> str:
    """A short label for a node's arg. A UOp in an arg (a KERNEL's AST) is named, not printed whole."""
    if arg is None: return ""
    if hasattr(arg, "op") and hasattr(arg, "src"): return f"<{arg.op.name}>"
    if isinstance(arg, tuple) and any(hasattr(a, "op") and hasattr(a, "src") for a in arg):
        return "(" + ", ".join(_arg_text(a) for a in arg) + ")"
    s = repr(arg)
    return s if len(s) <= ARG_CHARS else s[:ARG_CHARS - 3] + "..."

class NodeTable:
    """Rows of (op, dtype, arg, [source rows]) for the nodes of graphs; a node gets one row however often it is met."""
    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.index: dict[Any, int] = {}

    def add(self, root: Any) -> int:
        """The row of `root`, adding it and every source not in the table yet (sources get lower rows)."""
        if (i := self.index.get(root)) is not None: return i
        stack = [(root, False)]
        while stack:
            u, ready = stack.pop()
            if u in self.index: continue
            if not ready:
                stack.append((u, True))
                stack.extend((s, False) for s in u.src if s not in self.index)
                continue
            self.index[u] = len(self.rows)
            self.rows.append([u.op.name, str(u.dtype), _arg_text(u.arg), [self.index[s] for s in u.src]])
        return self.index[root]

def _where(fxn: Callable) -> str:
    code = getattr(fxn, "__code__", None)
    if code is None: return getattr(fxn, "__qualname__", repr(fxn))
    return f"{_short_path(code.co_filename)}:{code.co_firstlineno}"

def _short_path(path: str) -> str:
    # paths inside the package are shown from the package root, others as they are
    marker = os.sep + "fusegrad" + os.sep
    return "fusegrad/" + path.rsplit(marker, 1)[1].replace(os.sep, "/") if marker in path else path

def _caller() -> str:
    """Where the graph_rewrite being recorded was called from: the first frame outside the rewriter and this file."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.endswith(os.sep + "pattern.py") or
                             f.f_code.co_filename == __file__):
        f = f.f_back
    if f is None: return "?"
    return f"{_short_path(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"

class _Rewrite:
    """One graph_rewrite call being recorded: its input graph and every step (node before, node after, rule)."""
    def __init__(self, sink: Any, pm: Any, name: str | None, caller: str):
        self.sink, self.pm, self.name, self.caller = sink, pm, name, caller
        self.matcher = (pm.name or "PatternMatcher") if pm is not None else ""
        self.steps: list[tuple[Any, Any, Callable]] = []
        self.st = time.perf_counter()

class Recorder:
    """Everything recorded since the last reset, as plain data."""
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.rewrites: list[dict[str, Any]] = []
        self.schedules: list[dict[str, Any]] = []
        self.kernels: list[dict[str, Any]] = []
        self.kernel_of_ast: dict[Any, int] = {}
        self.rules: list[list[str]] = []
        self.rule_index: dict[Any, int] = {}
        self.events: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.active: list[_Rewrite] = []
        self.buffer_ids: dict[int, int] = {}
        self.buffers_kept: list[Any] = []   # the Buffers numbered, kept so an id is never reused for another one

    # *** graph rewrites ***

    def rule(self, fxn: Callable) -> int:
        if (i := self.rule_index.get(fxn)) is not None: return i
        where = _where(fxn)
        code = getattr(fxn, "__code__", None)
        line = linecache.getline(code.co_filename, code.co_firstlineno).strip() if code is not None else ""
        self.rule_index[fxn] = len(self.rules)
        self.rules.append([where, line])
        return self.rule_index[fxn]

    def finish_rewrite(self, rw: _Rewrite, result: Any) -> None:
        table = NodeTable()
        entry: dict[str, Any] = {"matcher": rw.matcher, "name": rw.name or "", "caller": rw.caller,
                                 "ms": (time.perf_counter() - rw.st) * 1e3, "steps": [], "nodes": [], "sink": 0,
                                 "result": 0}
        if rw.steps:
            entry["sink"] = table.add(rw.sink)
            for before, after, fxn in rw.steps:
                entry["steps"].append([table.add(before), table.add(after), self.rule(fxn)])
            entry["result"] = table.add(result)
            entry["nodes"] = table.rows
        else: entry["size"] = _count(rw.sink)
        self.rewrites.append(entry)

    # *** schedules and kernels ***

    def kernel(self, ast: Any) -> int:
        """The number of the kernel of `ast` (a kernel is known by its AST before and after it is compiled)."""
        if (i := self.kernel_of_ast.get(ast)) is not None: return i
        self.kernel_of_ast[ast] = len(self.kernels)
        op = ast.op.name
        self.kernels.append({"name": op.lower() if op != "SINK" else f"kernel {len(self.kernels)}", "kind": op,
                             "ast": None, "runs": [], "device": "", "src": "", "opts": [], "uops": [],
                             "codegen_ms": None, "compile_ms": None, "ops": None, "mem": None})
        return self.kernel_of_ast[ast]

    def buffer(self, b: Any) -> int:
        if (i := self.buffer_ids.get(id(b))) is not None: return i
        self.buffer_ids[id(b)] = len(self.buffer_ids)
        self.buffers_kept.append(b)
        return self.buffer_ids[id(b)]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "schedules": self.schedules, "rewrites": self.rewrites,
                "kernels": self.kernels, "rules": self.rules, "findings": self.findings,
                "profile": {"traceEvents": _metadata(self.events) + self.events, "displayTimeUnit": "ms"}}

def _count(root: Any) -> int:
    seen, stack = {root}, [root]
    while stack:
        for s in stack.pop().src:
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return len(seen)

recorder = Recorder()

# set by the Tensor front end (tensor/explain.py), which can explain and estimate a graph: `schedule_notes(graph,
# items)` gives what a recorded schedule shows besides its kernels (why each kernel is cut, the estimate)
schedule_notes: Callable[[Any, list[Any]], dict[str, Any]] | None = None

# *** the hooks ***

def record_rewrite(run: Callable[[], Any], sink: Any, pm: Any, name: str | None) -> Any:
    """`run()` (the graph rewrite of `sink` by `pm`), its steps recorded; the graph it returns is recorded too."""
    rw = _Rewrite(sink, pm, name, _caller())
    recorder.active.append(rw)
    try: ret = run()
    finally: recorder.active.pop()
    recorder.finish_rewrite(rw, ret if hasattr(ret, "op") else sink)
    return ret

def record_pass(name: str, root: Any, mapping: dict[Any, Any], rule: Callable, what: str = "", depth: int = 1) -> None:
    """A pass that is not a graph_rewrite (kernelization, kernel merging) made `mapping` (old -> new for the nodes of
    `root`), recorded as a rewrite: each node the pass itself changed is a step (the node rebuilt over its sources'
    replacements -> what the pass made of it, by `rule`), so the page replays it as it replays the rewriter's.
    (`depth`: the frame of the pass's function, above this one)"""
    f = sys._getframe(depth)
    rw = _Rewrite(root, None, what, f"{_short_path(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})")
    rw.matcher = name
    done: dict[Any, Any] = {}
    for u in _toposort(root):
        src = tuple(done[s] for s in u.src)
        rebuilt = u if all(a is b for a, b in zip(src, u.src)) else u.replace(src=src)
        done[u] = new = mapping.get(u, rebuilt)
        if new is not rebuilt: rw.steps.append((rebuilt, new, rule))
    recorder.finish_rewrite(rw, done[root])

def record_kernelize(sink: Any, kernels: dict[Any, Any], root: Any, merged: dict[Any, Any], build: Callable,
                     merge: Callable) -> None:
    """Kernelization's two passes (schedule/kernelize.py kernelize_map): the realized nodes of `sink` made kernels
    (`kernels`: old -> new, by `build`), then the kernels under `root` merged (`merged`, by `merge`)."""
    record_pass("kernelize", sink, kernels, build, "realized nodes -> kernels", depth=2)
    record_pass("merge_kernels", root, merged, merge, "kernels with several outputs", depth=2)

def _toposort(root: Any) -> list[Any]:
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        u, ready = stack.pop()
        if ready:
            order.append(u)
            continue
        if u in seen: continue
        seen.add(u)
        stack.append((u, True))
        stack.extend((s, False) for s in reversed(u.src) if s not in seen)
    return order

def record_step(before: Any, after: Any, fxn: Callable) -> None:
    """A rule (`fxn`) replaced `before` by `after` inside the graph_rewrite being recorded."""
    if recorder.active: recorder.active[-1].steps.append((before, after, fxn))

def record_schedule(graph: Any, replaced: dict[Any, Any], items: list[Any]) -> None:
    """A schedule: the tensor graph (a SINK), what kernelization replaced each of its nodes by (empty for a schedule
    replayed from its plan) and the ScheduleItems (ast, bufs, fixedvars) in run order."""
    table = NodeTable()
    sink = table.add(graph)
    # which kernels compute each tensor node: a realized node's own kernel, and every kernel a node is fused into
    # (a node is recomputed in each kernel that reads it without a buffer between)
    owner: dict[int, list[int]] = {}
    for u, row in table.index.items():
        k = _kernel_of(replaced.get(u))
        if k is not None: owner[row] = [recorder.kernel(k.arg)]
    realized = set(owner)
    # (a node's readers have higher rows than it: walking down the rows hands each node its readers' kernels)
    for row in range(len(table.rows) - 1, -1, -1):
        for s in table.rows[row][3]:
            if s in realized or not _fused(table.rows[s]): continue
            for kid in owner.get(row, []):
                if kid not in owner.setdefault(s, []): owner[s].append(kid)
    entry = {"sink": sink, "nodes": table.rows, "replayed": not replaced, **_notes(graph, items),
             "owner": {str(r): ks for r, ks in owner.items() if ks},
             "items": [{"kernel": recorder.kernel(si.ast),
                        "bufs": [None if b is None else [recorder.buffer(b), str(b.dtype), b.size, b.device]
                                 for b in si.bufs],
                        "fixedvars": {k: repr(v) for k, v in si.fixedvars.items()}} for si in items]}
    with recorder.lock: recorder.schedules.append(entry)

def _notes(graph: Any, items: list[Any]) -> dict[str, Any]:
    """The schedule's explanation and estimate (see schedule_notes), worked out with recording off: explaining
    kernelizes the graph again, and those rewrites are not the program's."""
    global VIZ
    if schedule_notes is None: return {}
    VIZ = False
    try: return schedule_notes(graph, items)
    except Exception as e:  # (the page shows it: a program recorded by VIZ must not stop for its explanation)
        return {"notes_error": f"{type(e).__name__}: {e}"}
    finally: VIZ = True

def record_finding(kind: str, message: str) -> None:
    """A check found a problem (kind: "JIT_VERIFY" a replay that differs from the eager call, "DEBUG_NANS" the first
    operation making a NaN or Inf): kept with the trace and marked on the timeline, before the error is raised."""
    ts = _us(time.perf_counter())
    with recorder.lock: recorder.findings.append({"kind": kind, "message": message, "ts": ts})
    if PROFILE: _event({"name": kind, "cat": "finding", "ph": "i", "s": "g", "ts": ts, "pid": "python",
                        "tid": threading.current_thread().name, "args": {"message": message}})

def _kernel_of(u: Any) -> Any:
    """The KERNEL node that computes `u` (an ASSIGN of a kernel, or a view of one), if it is one."""
    for _ in range(8):
        if u is None or not u.src: return None
        if u.op.name == "ASSIGN" and len(u.src) > 1 and u.src[1].op.name == "KERNEL": return u.src[1]
        u = u.src[0]
    return None

def _fused(row: list[Any]) -> bool:
    # buffers, devices and constants are read by a kernel, not computed in it
    return row[0] not in ("BUFFER", "DEVICE", "CONST", "UNIQUE", "DEFINE_VAR", "BIND")

def record_kernel(ast: Any, p: Any, codegen_s: float | None) -> None:
    """A kernel's program was generated (`p`: its ProgramSpec), in `codegen_s` seconds."""
    k = recorder.kernels[recorder.kernel(ast)]
    k.update({"name": p.name, "device": p.device, "src": p.src, "opts": [str(o) for o in p.applied_opts],
              "uops": [f"{u.op.name} {u.dtype} {_arg_text(u.arg)}".rstrip() for u in p.uops],
              "codegen_ms": None if codegen_s is None else codegen_s * 1e3, "ops": _num(p.estimates.ops),
              "mem": _num(p.estimates.mem)})
    if k["ast"] is None:
        table = NodeTable()
        k["ast"] = {"sink": table.add(ast), "nodes": table.rows}

def record_compile(asts: list[Any], st: float, device: str) -> None:
    """The kernels of `asts` were compiled together, from `st` (time.perf_counter()) until now."""
    et = time.perf_counter()
    for ast in asts: recorder.kernels[recorder.kernel(ast)]["compile_ms"] = (et - st) * 1e3 / max(1, len(asts))
    if PROFILE: _span(f"compile {len(asts)} kernel{'s' if len(asts) != 1 else ''}", "compile", st, et, device)

# a profiled kernel call's chunks, noted by the CPU program on the calling thread until its run is recorded
_chunks = threading.local()

def note_chunks(program: Any, st: float, et: float, chunks: list[tuple[int, int, int, float, float]]) -> None:
    """The CPU program `program` ran from `st` to `et` (time.perf_counter()) in `chunks`: (thread, lo, hi, start,
    end) each, the thread being the C pool's worker k as k and the calling thread as 0. The run's record_run (next, on
    this thread) puts them on the timeline."""
    _chunks.noted = (program, st, et, chunks)

def _chunk_events(name: str, device: str, chunks: list[tuple[int, int, int, float, float]]) -> None:
    """One event per chunk, on a lane per thread of the device's process."""
    caller = f"{threading.current_thread().name} (caller)"
    for i, (lane, lo, hi, cst, cet) in enumerate(chunks):
        ts = _us(cst)
        _event({"name": name, "cat": "chunk", "ph": "X", "ts": ts, "dur": max(0.0, _us(cet) - ts), "pid": device,
                "tid": f"worker {lane}" if lane else caller,
                "args": {"chunk": i, "of": len(chunks), "range": [lo, hi]}})

def record_run(prg: Any, ast: Any, var_vals: dict[str, Any], et: float | None, device: str) -> None:
    """An ExecItem ran: its runner `prg` (a kernel, a copy, a view or a collective) took `et` seconds."""
    noted = getattr(_chunks, "noted", None)
    if noted is not None: _chunks.noted = None
    if et is None: return
    end = time.perf_counter()
    work = prg._work(var_vals) if hasattr(prg, "_work") else (0, 0)
    name = getattr(getattr(prg, "p", None), "name", None) or _plain(prg.display_name)
    kind = "kernel" if hasattr(prg, "p") else name.split(" ", 1)[0]
    if VIZ:
        k = recorder.kernels[recorder.kernel(ast)]
        # (a kernel compiled before recording started is described from its runner)
        if hasattr(prg, "p") and not k["src"]: record_kernel(ast, prg.p, None)
        k["name"], k["device"] = name, device
        k["runs"].append(et * 1e6)
    if PROFILE:
        args = {"ops": work[0], "bytes": work[1]}
        if hasattr(prg, "threads"): args["threads"] = prg.threads(var_vals, work)
        cat = {"kernel": "kernel", "copy": "copy", "view": "view", "mpi": "collective"}.get(kind, kind)
        ts, tid = max(0.0, _us(end) - et * 1e6), "kernels"
        if noted is not None and noted[0] is getattr(prg, "_prg", None):
            # the kernel's bar where its chunks say it ran (ending here would shift it by the time since it returned)
            ts = _us(noted[1])
            _chunk_events(name, device, noted[3])
        if (collective := getattr(prg, "profile_args", None)) is not None:
            # an MPI collective: its kind, size and rank on a lane of its own
            name, tid = collective["kind"], "collectives"
            args = collective
        _event({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": et * 1e6, "pid": device, "tid": tid,
                "args": args})

def record_realize(t0: float, t1: float, t2: float, items: int) -> None:
    """A realize: scheduling from `t0` to `t1`, running its `items` from `t1` to `t2`."""
    args = {"items": items}
    _span("realize", "realize", t0, t2, "python", args)
    _span("schedule", "schedule", t0, t1, "python", args)
    _span("run", "run", t1, t2, "python", args)

def profiled(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, recorded as a span of Python time (a TinyJit capture or replay)."""
    st = time.perf_counter()
    try: return fn(*args)
    finally: _span(name, "jit", st, time.perf_counter(), "python")

def _span(name: str, cat: str, st: float, et: float, pid: str, args: dict[str, Any] | None = None) -> None:
    # (start and end rounded alike, so a span that ends where its parent ends doesn't pass it by a rounding error)
    ts = _us(st)
    _event({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(0.0, _us(et) - ts), "pid": pid,
            "tid": threading.current_thread().name, **({"args": args} if args else {})})

def _event(e: dict[str, Any]) -> None:
    with recorder.lock: recorder.events.append(e)

def _us(t: float) -> float: return round((t - recorder.t0) * 1e6, 3)
def _num(x: Any) -> int | str: return x if isinstance(x, int) else str(x)
def _plain(s: str) -> str:
    # a display name may carry terminal colours
    import re
    return re.sub(r"\x1b\[[0-9;]*m", "", s).strip()

def _metadata(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name events for the processes and threads, so a viewer labels each track."""
    meta: list[dict[str, Any]] = []
    for pid, tid in dict.fromkeys((e["pid"], e["tid"]) for e in events):
        meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": tid}})
    for pid in dict.fromkeys(e["pid"] for e in events):
        meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0, "args": {"name": pid}})
    return meta

# *** turning it on and off, saving ***

def enable(viz: bool | None = None, profile: bool | None = None) -> None:
    """Turn recording on or off from code (the VIZ and PROFILE knobs do it from the environment)."""
    global VIZ, PROFILE, TIMED
    if viz is not None: VIZ = viz
    if profile is not None: PROFILE = profile
    TIMED = VIZ or PROFILE

def trace() -> dict[str, Any]:
    """What was recorded so far, as the trace file's JSON object."""
    with recorder.lock: return recorder.to_json()

def save(path: str) -> str:
    """Write the trace (VIZ's file format, its `profile` a Chrome trace) to `path`; returns the path."""
    data = json.dumps(trace(), separators=(",", ":"))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f: f.write(data)
    os.replace(tmp, path)
    return path

def save_profile(path: str) -> str:
    """Write the timeline alone as a Chrome trace event file (opens in Perfetto and chrome://tracing)."""
    with open(path, "w") as f: json.dump(trace()["profile"], f, separators=(",", ":"))
    return path

def default_path(kind: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"fusegrad-{kind}-{os.getpid()}.json")

def _at_exit() -> None:
    if PROFILE:
        path = save_profile(getenv("PROFILE_FILE", "") or default_path("profile"))
        print(f"PROFILE: Chrome trace saved to {path} (open it in Perfetto or chrome://tracing)", file=sys.stderr)
    if VIZ:
        path = save(getenv("VIZ_FILE", "") or default_path("viz"))
        print(f"VIZ: trace saved to {path}; look at it with: python -m fusegrad.viz {path}", file=sys.stderr)
        if getenv("VIZ", 0) == 1:
            from fusegrad.viz.server import serve_file
            serve_file(path, getenv("VIZ_PORT", 8000))

if TIMED: atexit.register(_at_exit)
