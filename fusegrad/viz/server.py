"""The VIZ page's server: reads a trace file (see record.py) and serves the page (static/) and the trace's parts as
JSON, on localhost only. It reads no file but the trace it was given and the page's own files."""
from __future__ import annotations
import gc
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
HOST = "127.0.0.1"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}

class TraceError(ValueError):
    """A file that is not a trace this page can show: what is wrong with it, and where."""

# *** reading and checking a trace ***

def load_trace(path: str) -> dict[str, Any]:
    """The trace in `path` (VIZ's format, or a Chrome trace event file as PROFILE writes it), checked; TraceError
    says what is wrong with a file that isn't one."""
    try:
        with open(path, "rb") as f: raw = f.read()
    except OSError as e: raise TraceError(f"{path}: cannot read it: {e.strerror}") from None
    if not raw.strip(): raise TraceError(f"{path}: the file is empty (was the program stopped before it saved it?)")
    # (a big trace is millions of small lists: the collector, run every few thousand of them, would take most of the
    # parse's time, and the parsed data holds no cycles)
    collecting = gc.isenabled()
    gc.disable()
    try: data = json.loads(raw)
    except UnicodeDecodeError: raise TraceError(f"{path}: not a trace: the file is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        if e.pos >= len(raw.rstrip()):
            raise TraceError(f"{path}: the trace is truncated: its JSON ends early (line {e.lineno}, column "
                             f"{e.colno}); was the program stopped while it was writing it?") from None
        raise TraceError(f"{path}: not a trace: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    finally:
        if collecting: gc.enable()
    return check_trace(data, path)

def check_trace(data: Any, where: str = "trace") -> dict[str, Any]:
    """`data` as a full trace: a Chrome trace (a list of events, or an object with traceEvents) becomes a trace with
    only a profile. Raises TraceError naming the first part that has the wrong shape."""
    if isinstance(data, list) or (isinstance(data, dict) and "traceEvents" in data and "format" not in data):
        data = {"format": "fusegrad-viz", "version": 1, "schedules": [], "rewrites": [], "kernels": [], "rules": [],
                "profile": data if isinstance(data, dict) else {"traceEvents": data}}
    if not isinstance(data, dict) or data.get("format") != "fusegrad-viz":
        raise TraceError(f"{where}: not a trace: expected a JSON object with \"format\": \"fusegrad-viz\" (written by "
                         "VIZ=1) or a Chrome trace event file (written by PROFILE=1)")
    if data.get("version") != 1: raise TraceError(f"{where}: trace version {data.get('version')!r}; this page reads 1")
    for key, kind in (("schedules", list), ("rewrites", list), ("kernels", list), ("rules", list), ("profile", dict)):
        if not isinstance(data.get(key), kind):
            raise TraceError(f"{where}: the trace's {key!r} is missing or not a {kind.__name__}")
    if not isinstance(data["profile"].get("traceEvents"), list):
        raise TraceError(f"{where}: the trace's profile has no list of traceEvents")
    for i, e in enumerate(data["profile"]["traceEvents"]):
        if not isinstance(e, dict) or any(k not in e for k in ("ph", "ts", "pid", "tid")):
            raise TraceError(f"{where}: profile event {i} lacks one of ph, ts, pid, tid: {str(e)[:100]}")
    for i, r in enumerate(data["rewrites"]):
        if not isinstance(r, dict) or not isinstance(r.get("steps"), list) or not isinstance(r.get("nodes"), list):
            raise TraceError(f"{where}: rewrite {i} has no list of steps and nodes")
        n = len(r["nodes"])
        for row in r["nodes"]:
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[3], list) and
                    all(isinstance(s, int) and 0 <= s < n for s in row[3])):
                raise TraceError(f"{where}: rewrite {i} has a malformed node {str(row)[:100]}")
        for st in r["steps"]:
            if not (isinstance(st, list) and len(st) == 3 and all(isinstance(x, int) for x in st) and
                    0 <= st[0] < n and 0 <= st[1] < n and 0 <= st[2] < len(data["rules"])):
                raise TraceError(f"{where}: rewrite {i} has a malformed step {str(st)[:100]}")
    if not isinstance(data.get("findings", []), list) or \
            not all(isinstance(f, dict) and isinstance(f.get("message"), str) for f in data.get("findings", [])):
        raise TraceError(f"{where}: the trace's 'findings' is not a list of objects with a message")
    for i, k in enumerate(data["kernels"]):
        if not isinstance(k, dict) or not isinstance(k.get("name"), str) or not isinstance(k.get("runs"), list):
            raise TraceError(f"{where}: kernel {i} has no name or runs")
    return data

# *** the graph of a rewrite at each step ***

class RewriteStates:
    """Replays a recorded graph_rewrite: the graph before step k is the input graph as the rewriter sees it after the
    steps before k. Each step replaces a node by another; every node above a replaced one (and every source of a
    replacement) is rebuilt over the replacements, as the rewriter rebuilds them from its memo. Rebuilt nodes are
    hash-consed as UOps are, so a later step's node, recorded as the rewriter built it, is found in the replay."""
    def __init__(self, rewrite: dict[str, Any]):
        self.rows: list[list[Any]] = [list(r) for r in rewrite["nodes"]]
        self.key: dict[tuple, int] = {}
        for i, r in enumerate(self.rows): self.key.setdefault(_row_key(r), i)
        self.steps: list[list[int]] = rewrite["steps"]
        self.input_root = rewrite.get("sink", 0)

    def state(self, k: int) -> tuple[int, dict[int, int]]:
        """The root of the graph before step k (k = the number of steps: the result), and what each node met became."""
        replace: dict[int, int] = {}
        for before, after, _ in self.steps[:k]: replace[before] = after
        done: dict[int, int] = {}
        pending: set[int] = set()
        stack: list[tuple[int, ...]] = [(self.input_root, 0)]
        while stack:
            n, stage, *rest = stack.pop()
            if stage == 0:
                if n in done: continue
                if n in replace and n not in pending:
                    # (a replacement that contains the node it replaces sees the node itself there)
                    pending.add(n)
                    stack += [(n, 2), (replace[n], 0)]
                    continue
                stack.append((n, 1))
                stack.extend((s, 0) for s in self.rows[n][3] if s not in done)
            elif stage == 1:
                if n in done: continue
                src = [done.get(s, s) for s in self.rows[n][3]]
                rebuilt = n if src == self.rows[n][3] else self._node([*self.rows[n][:3], src])
                if rebuilt in replace and rebuilt not in pending:
                    # the node rebuilt over its sources' replacements is what a rule replaced next
                    pending.add(rebuilt)
                    stack += [(n, 3, rebuilt), (replace[rebuilt], 0)]
                else: done[n] = rebuilt
            elif stage == 2:
                done[n] = done[replace[n]]
                pending.discard(n)
            else:
                rebuilt = rest[0]
                done[n] = done[rebuilt] = done[replace[rebuilt]]
                pending.discard(rebuilt)
        return done[self.input_root], done

    def _node(self, row: list[Any]) -> int:
        if (hit := self.key.get(_row_key(row))) is None:
            hit = self.key[_row_key(row)] = len(self.rows)
            self.rows.append(row)
        return hit

    def reachable(self, root: int) -> list[int]:
        """The rows of the graph of `root`, sources first."""
        seen, order, stack = set(), [], [(root, False)]
        while stack:
            n, ready = stack.pop()
            if ready:
                order.append(n)
                continue
            if n in seen: continue
            seen.add(n)
            stack.append((n, True))
            stack.extend((s, False) for s in reversed(self.rows[n][3]) if s not in seen)
        return order

    def graph(self, root: int, marked: set[int]) -> dict[str, Any]:
        rows = self.reachable(root)
        return {"root": root, "marked": sorted(marked & set(rows)),
                "nodes": [[i, *self.rows[i]] for i in rows]}

    def step(self, k: int) -> dict[str, Any]:
        """The graphs before and after step k: in the first the node replaced is marked, in the second the nodes
        that are new."""
        before_root, seen = self.state(k)
        before_rows = set(self.reachable(before_root))
        old, _, rule = self.steps[k]
        replaced = {seen[old]} if old in seen else set()
        after_root, _ = self.state(k + 1)
        after_rows = self.reachable(after_root)
        return {"step": k, "steps": len(self.steps), "rule": rule, "in_graph": bool(replaced & before_rows),
                "before": self.graph(before_root, replaced),
                "after": self.graph(after_root, {r for r in after_rows if r not in before_rows})}

def _row_key(row: list[Any]) -> tuple:
    return (row[0], row[1], row[2], tuple(row[3]))

# *** the page's view of a trace ***

def summary(trace: dict[str, Any]) -> dict[str, Any]:
    """What the page shows first: every list without the big parts (sources, graphs), which it asks for on a click."""
    return {
        "kernels": [{k: v for k, v in kern.items() if k not in ("src", "uops", "ast")} |
                    {"n_uops": len(kern.get("uops") or [])} for kern in trace["kernels"]],
        "schedules": [{"items": s.get("items", []), "replayed": s.get("replayed", False),
                       "size": len(s.get("nodes", [])), "estimate": _brief(s.get("estimate"))}
                      for s in trace["schedules"]],
        "rewrites": [{"matcher": r.get("matcher", ""), "name": r.get("name", ""), "caller": r.get("caller", ""),
                      "ms": r.get("ms", 0.0), "steps": len(r["steps"]), "size": r.get("size", len(r["nodes"]))}
                     for r in trace["rewrites"]],
        "rules": trace["rules"],
        "findings": trace.get("findings", []),
        "profile": trace["profile"]["traceEvents"],
    }

def _brief(est: Any) -> Any:
    # the schedule list shows the totals; what is live at the peak and each kernel's share come with the schedule
    return {k: v for k, v in est.items() if k not in ("live_at_peak", "per_kernel")} if isinstance(est, dict) else None

class Viewer:
    """A loaded trace and the answers to the page's requests: (status, content type, body) per path."""
    def __init__(self, trace: dict[str, Any]):
        self.trace = check_trace(trace)
        self.states: dict[int, RewriteStates] = {}
        self.static = {name for name in os.listdir(STATIC) if os.path.splitext(name)[1] in _TYPES}

    def get(self, path: str) -> tuple[int, str, bytes]:
        parts = [unquote(p) for p in urlsplit(path).path.split("/") if p]
        try:
            if not parts: return self._static("index.html")
            if parts[0] == "static" and len(parts) == 2: return self._static(parts[1])
            if parts[0] == "api": return 200, "application/json", json.dumps(self._api(parts[1:])).encode()
        except (IndexError, ValueError, KeyError): pass
        return 404, "text/plain; charset=utf-8", f"not found: {path[:200]}".encode()

    def _static(self, name: str) -> tuple[int, str, bytes]:
        # only the page's own files, by name: nothing else on disk can be named
        if name not in self.static: raise KeyError(name)
        with open(os.path.join(STATIC, name), "rb") as f: return 200, _TYPES[os.path.splitext(name)[1]], f.read()

    def _api(self, parts: list[str]) -> Any:
        t = self.trace
        what, idx = parts[0], [_index(p) for p in parts[1:]]
        if what == "summary" and not idx: return summary(t)
        if what == "kernel" and len(idx) == 1: return t["kernels"][idx[0]]
        if what == "schedule" and len(idx) == 1: return t["schedules"][idx[0]]
        if what == "rewrite" and len(idx) == 2:
            r = t["rewrites"][idx[0]]
            if idx[1] >= len(r["steps"]): raise IndexError(idx[1])
            states = self.states.setdefault(idx[0], RewriteStates(r))
            return states.step(idx[1])
        raise KeyError(what)

def _index(s: str) -> int:
    if not s.isdigit(): raise ValueError(s)
    return int(s)

def make_server(viewer: Viewer, port: int) -> ThreadingHTTPServer:
    """An HTTP server for `viewer` on localhost:`port` (0: any free port), not yet serving."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            status, ctype, body = viewer.get(self.path)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, format: str, *args: Any) -> None: pass  # noqa: A002 (http.server's signature)
    return ThreadingHTTPServer((HOST, port), Handler)

def serve_file(path: str, port: int = 8000) -> None:
    """Serve the trace in `path` at http://127.0.0.1:`port`/ until interrupted."""
    server = make_server(Viewer(load_trace(path)), port)
    print(f"VIZ: serving {path} at http://{HOST}:{server.server_address[1]}/ (Ctrl-C stops)", file=sys.stderr)
    try: server.serve_forever()
    except KeyboardInterrupt: pass
    finally: server.server_close()
