"""The trace VIZ and PROFILE record, and its server, without a browser."""
import contextlib
import io
import gc
import json
import re
import urllib.error
import urllib.request
import threading
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad import Context
from fusegrad.viz import record
from fusegrad.viz.__main__ import main as viz_main
from fusegrad.viz.server import RewriteStates, TraceError, Viewer, check_trace, load_trace, make_server
from test.viz.programs import symbolic_rewrite, tensor_program

def test_recording_off_records_nothing():
    record.recorder.reset()
    assert not record.VIZ and not record.PROFILE
    symbolic_rewrite()
    tensor_program()
    t = record.trace()
    assert t["rewrites"] == [] and t["kernels"] == [] and t["schedules"] == [] and t["profile"]["traceEvents"] == []

def test_rewrite_steps_replay_to_the_result(recording):
    expr, result = symbolic_rewrite()
    # a kernel no other test compiles, so its code generation's rewrites run here
    x = Tensor([[float(i * j % 5) for j in range(7)] for i in range(5)])
    assert (x.exp() * 3).sum(1).tolist() == pytest.approx((np.exp(x.numpy()) * 3).sum(1), rel=1e-5)
    t = record.trace()
    known = [r for r in t["rewrites"] if r["name"] == "known"]
    assert len(known) == 1 and known[0]["matcher"] == "symbolic" and known[0]["steps"]
    assert re.search(r"test/viz/programs.py:\d+ \(symbolic_rewrite\)$", known[0]["caller"])
    rs = RewriteStates(known[0])
    assert len(rs.reachable(rs.state(0)[0])) == len(expr.toposort())
    assert len(rs.reachable(rs.state(len(known[0]["steps"]))[0])) == len(result.toposort())
    # every recorded rewrite of the program, replayed step by step, ends at the graph the rewriter returned
    changed = [r for r in t["rewrites"] if r["steps"]]
    assert len(changed) >= 4
    for r in changed:
        rs = RewriteStates(r)
        assert rs.state(len(r["steps"]))[0] == r["result"], (r["matcher"], r["caller"])
    for where, line in t["rules"]: assert re.fullmatch(r"fusegrad/.+\.py:\d+", where) and line

def test_schedules_and_kernels(recording):
    ran = tensor_program(n=6)
    t = record.trace()
    ran_kernels = [k for k in t["kernels"] if k["runs"]]
    assert sum(len(k["runs"]) for k in ran_kernels) == ran
    for k in ran_kernels:
        assert k["kind"] == "SINK" and k["src"].count("void ") >= 1 and k["uops"] and k["ast"]["nodes"]
        assert all(us >= 0 for us in k["runs"]) and isinstance(k["ops"], int) and isinstance(k["mem"], int)
    assert len(t["schedules"]) == 2 and t["schedules"][1]["replayed"]
    first = t["schedules"][0]
    assert {it["kernel"] for it in first["items"]} == set(range(len(t["kernels"])))
    # every node of the tensor graph that a kernel computes names it, and every kernel computes some node
    assert {k for ks in first["owner"].values() for k in ks} == {it["kernel"] for it in first["items"]}

def _check_events(events):
    """The trace event format's rules: every event has ph, ts, pid, tid; durations are >= 0; complete events on one
    thread nest (each one ends before the one that contains it does)."""
    tracks = {}
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in tracks.values():
        open_ends = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3: open_ends.pop()
            if open_ends: assert e["ts"] + e["dur"] <= open_ends[-1] + 1e-3, e
            open_ends.append(e["ts"] + e["dur"])
    return tracks

def test_profile_is_a_valid_chrome_trace_and_agrees_with_debug2(recording, tmp_path):
    tensor_program()  # compiled and warm
    record.recorder.reset()
    out = io.StringIO()
    with Context(DEBUG=2), contextlib.redirect_stdout(out): ran = tensor_program()
    printed = [float(m.group(1)) * (1e3 if m.group(2) == "ms" else 1.0)
               for m in re.finditer(r"^\*\*\* CPU .* tm +([\d.]+)(us|ms)", out.getvalue(), re.M)]
    path = record.save_profile(str(tmp_path / "profile.json"))
    events = json.load(open(path))["traceEvents"]
    _check_events(events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) == ran == len(printed)
    for e, us in zip(kernels, printed): assert e["dur"] == pytest.approx(us, abs=0.006)
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"realize", "schedule", "run"} <= names
    # the page's loader takes a PROFILE file as it is
    assert len(load_trace(path)["profile"]["traceEvents"]) == len(events)

def test_jit_capture_and_replay_are_on_the_timeline(recording):
    from fusegrad import Tensor, TinyJit
    @TinyJit
    def f(x: Tensor) -> Tensor: return (x * 2 + 1).sum()
    for i in range(4): assert f(Tensor([1.0, 2.0, float(i)])).item() == 9 + 2 * i
    events = record.trace()["profile"]["traceEvents"]
    _check_events(events)
    jit = [e["name"] for e in events if e.get("cat") == "jit"]
    assert jit == ["TinyJit capture", "TinyJit replay", "TinyJit replay"]

# *** the server ***

@pytest.fixture
def served(recording, tmp_path):
    symbolic_rewrite()
    tensor_program()
    path = record.save(str(tmp_path / "trace.json"))
    server = make_server(Viewer(load_trace(path)), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try: yield server, record.trace()
    finally:
        server.shutdown()
        server.server_close()

def _get(server, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e: return e.code, e.read()

def test_server_serves_the_page_and_the_trace(served):
    server, t = served
    assert server.server_address[0] == "127.0.0.1"
    status, body = _get(server, "/")
    assert status == 200 and b"/static/app.js" in body
    assert _get(server, "/static/app.js")[0] == 200 and _get(server, "/static/style.css")[0] == 200
    summary = json.loads(_get(server, "/api/summary")[1])
    assert len(summary["kernels"]) == len(t["kernels"]) and "src" not in summary["kernels"][0]
    kernel = json.loads(_get(server, "/api/kernel/0")[1])
    assert kernel["src"] == t["kernels"][0]["src"]
    i = next(i for i, r in enumerate(t["rewrites"]) if r["name"] == "known")
    step = json.loads(_get(server, f"/api/rewrite/{i}/0")[1])
    assert step["in_graph"] and step["before"]["marked"] and len(step["before"]["nodes"]) == 8

@pytest.mark.parametrize("path", ["/static/../server.py", "/static/..%2fserver.py", "/static/%2e%2e%2frecord.py",
                                  "/../../../../etc/passwd", "/static/..%2f..%2f..%2fhelpers.py", "/static/",
                                  "/static/index.html/../../server.py", "/api/kernel/..%2f1", "/api/kernel/999",
                                  "/api/rewrite/0/99999", "/api/nothing", "//etc/passwd"])
def test_server_reads_nothing_outside_its_data(served, path):
    status, body = _get(served[0], path)
    assert status == 404 and b"import" not in body and b"root:" not in body

def test_malformed_and_truncated_traces(tmp_path, capsys):
    good = {"format": "fusegrad-viz", "version": 1, "schedules": [], "rewrites": [], "kernels": [], "rules": [],
            "profile": {"traceEvents": []}}
    text = json.dumps(good)
    cases = {"truncated": (text[:len(text) // 2], "truncated"), "empty": ("", "empty"),
             "garbage": ("{not json", "malformed JSON at line 1"), "other": ("[1, 2]", "lacks one of ph, ts, pid, tid"),
             "object": ('{"a": 1}', "not a trace"), "binary": (b"\xff\xfe\x00", "not UTF-8"),
             "kernels": (json.dumps({**good, "kernels": 3}), "'kernels' is missing or not a list"),
             "step": (json.dumps({**good, "rewrites": [{"steps": [[0, 5, 0]], "nodes": [["CONST", "", "", []]]}]}),
                      "malformed step")}
    for name, (content, message) in cases.items():
        p = tmp_path / name
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(TraceError, match=re.escape(message)): load_trace(str(p))
        assert viz_main([str(p), "--port", "0"]) == 2
        assert message in capsys.readouterr().err
    assert viz_main([str(tmp_path / "missing.json")]) == 2 and "cannot read it" in capsys.readouterr().err
    assert check_trace(good)["kernels"] == []

def test_schedules_hold_their_explanation_and_estimate(recording):
    from fusegrad.tensor.explain import cached_roofline
    a = Tensor([[float(i + 2 * j) for j in range(9)] for i in range(3)])
    b = (a.exp() * 2).sum(0)
    out = (a / b).sum(1).contiguous()   # (b read inside out's reduction: a kernel each)
    from fusegrad.engine.explain import estimate
    from fusegrad.tensor import _shards
    roof = cached_roofline("CPU")
    # (the peak counts the memory allocated when each is made: earlier tests' buffers in reference cycles are freed
    # first, and not by a collection between the two)
    gc.collect()
    gc.disable()
    try:
        want_explain, want_est = out.explain(), out.estimate(predict=False)
        want_predicted = None if roof is None else estimate(_shards([out]), [], 0, roof).predicted_s
        record.recorder.reset()  # (explain's own rewrites were recorded)
        out.realize()
    finally: gc.enable()
    s = record.trace()["schedules"][-1]
    # the reasons Tensor.explain gives, one explained kernel per item in run order
    kernels = s["explain"]["kernels"]
    assert len(kernels) == len(s["items"]) == want_est.kernels == 2
    for k in kernels:
        for desc, reason, fix, _ in k["outputs"]:
            assert f"  {desc} (made by " in want_explain and f"cut: {reason}" in want_explain and f"to fuse: {fix}" in \
                want_explain
    assert {o[1] for k in kernels for o in k["outputs"]} == \
        set(re.findall(r"cut: (.*)", want_explain))
    est = s["estimate"]
    assert (est["kernels"], est["flops"], est["bytes"]) == (want_est.kernels, want_est.flops, want_est.bytes)
    assert est["peak_memory"] == want_est.peak_memory
    if roof is None: assert est["predicted_s"] is None
    else: assert est["predicted_s"] == pytest.approx(want_predicted)
    # explaining ran with recording off: the trace holds the program's rewrites only (explain simplifies the graph
    # itself, from engine/explain.py, before kernelizing it)
    assert not [r for r in record.trace()["rewrites"] if r["caller"].startswith("fusegrad/engine/explain.py")]
    record.recorder.reset()
    (a * 3).explain()
    assert [r for r in record.trace()["rewrites"] if r["caller"].startswith("fusegrad/engine/explain.py")]

def test_findings_of_jit_verify_and_debug_nans(recording):
    from test.viz.programs import jit_mismatch, nan_program
    jit_msg, nan_msg = jit_mismatch(), nan_program()
    t = record.trace()
    assert [(f["kind"], f["message"]) for f in t["findings"]] == [("JIT_VERIFY", jit_msg), ("DEBUG_NANS", nan_msg)]
    assert "a Python value frozen at capture" in jit_msg and "LOG2 produced NaN" in nan_msg
    marks = [e for e in t["profile"]["traceEvents"] if e["ph"] == "i"]
    assert [(m["name"], m["args"]["message"]) for m in marks] == [("JIT_VERIFY", jit_msg), ("DEBUG_NANS", nan_msg)]
    _check_events(t["profile"]["traceEvents"])
    summary = Viewer(t).get("/api/summary")
    assert json.loads(summary[2])["findings"] == t["findings"]

def test_kernelize_passes_are_rewrites(recording):
    from fusegrad.schedule.kernelize import kernelize_map
    from fusegrad.nn.optim import Adam
    # an Adam update: kernels made from the realized nodes, then elementwise kernels merged into their readers
    w = Tensor([[float(i - j) for j in range(11)] for i in range(3)], requires_grad=True)
    opt = Adam([w], lr=0.25)
    with Tensor.train():
        (w * w).sum().backward()
        opt.step()
    t = record.trace()
    passes = {r["matcher"]: r for r in t["rewrites"] if r["matcher"] in ("kernelize", "merge_kernels")}
    assert set(passes) == {"kernelize", "merge_kernels"}
    for r in passes.values():
        assert r["steps"] and r["caller"].startswith("fusegrad/schedule/kernelize.py:")
        assert RewriteStates(r).state(len(r["steps"]))[0] == r["result"]
    kernelized = passes["kernelize"]
    assert {t["rules"][st[2]][0] for st in kernelized["steps"]} == \
        {f"fusegrad/schedule/kernelize.py:{kernelize_map.__globals__['build_kernel'].__code__.co_firstlineno}"}
    # a step replaces a realized node by ASSIGN(BUFFER, KERNEL)
    for before, after, _ in kernelized["steps"]:
        assert kernelized["nodes"][after][0] == "ASSIGN" or kernelized["nodes"][after][0] in ("RESHAPE", "SHRINK",
                                                                                               "PERMUTE", "EXPAND")
    assert [st for st in passes["merge_kernels"]["steps"]
            if passes["merge_kernels"]["nodes"][st[1]][0] == "KERNEL"], "no kernel was merged"
