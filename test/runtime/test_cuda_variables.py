"""Prepared CUDA launches and graphs of kernels with Variables, against the stand-in driver (fake_libcuda.c: launches
recorded, not run): a launch takes each call's values and grid (set_values), a graph updates a node only when its
values or grid changed since the last call, and a call where one has no threads runs the launches one by one."""
from __future__ import annotations
import json
import os
import subprocess
import sys
from fusegrad.runtime.ops_cuda import CUDADevice, CUDAProgram
from test.runtime.test_cuda import (ELF, JIT_PREAMBLE, ROOT, _calls, _count, _exec_node, _last_launch, _launches, fake,
                                     fake_lib)

__all__ = ["fake", "fake_lib"]   # (the stand-in's fixtures)

def _values(vals: tuple, global_size: int, global_dims: tuple | None = None) -> dict:
    """What CompiledRunner.launch_args gives a CUDA launch (the CPU's keys mean nothing there)."""
    out = {"vals": vals, "global_size": global_size, "threads": 1, "helpable": True, "join": False}
    if global_dims is not None: out["global_dims"] = global_dims
    return out

def test_prepared_launch_takes_other_values(fake):
    dev = CUDADevice("CUDA")
    w, out = dev.allocator.alloc(256), dev.allocator.alloc(256)
    fake.fake_record(5)
    launch = CUDAProgram(dev, "kv", ELF).prepare(None, w, vals=(3,), global_size=300, varying=(0,))
    launch(out)
    assert _last_launch(fake, 5) == ([3, 1, 1], [128, 1, 1], [out.ptr, w.ptr, 3, 0, 300])
    launch.set_values(_values((9,), 20))
    launch(out)
    assert _last_launch(fake, 5) == ([1, 1, 1], [20, 1, 1], [out.ptr, w.ptr, 9, 0, 20])
    before = _launches(fake)
    launch.set_values(_values((0,), 0))   # (no threads: nothing launched)
    launch(out)
    assert _launches(fake) == before

def test_graph_updates_a_node_when_its_values_change(fake):
    dev = CUDADevice("CUDA")
    w, out, out2 = (dev.allocator.alloc(256) for _ in range(3))
    fake.fake_params(b"kv", 5, 2)   # (out, w, pos, lo, hi)
    fake.fake_params(b"kg", 3, 2)   # (out2, w, pos) of a GPU-style kernel whose grid follows pos
    fake.fake_params(b"kf", 4, 2)
    kv = CUDAProgram(dev, "kv", ELF).prepare(None, w, vals=(3,), global_size=300, varying=(0,))
    kg = CUDAProgram(dev, "kg", ELF).prepare(None, w, vals=(3,), global_dims=(3,), local_dims=(32,), varying=(0,))
    kf = CUDAProgram(dev, "kf", ELF).prepare(None, w, global_size=64, varying=(0,))
    kv.set_values(_values((3,), 300))
    kg.set_values(_values((3,), 1, (3,)))
    graph = kv.graph([(kv, (0,)), (kg, (1,)), (kf, (1,))], (0, 0))
    graph([out, out2])
    assert _exec_node(fake, 0, 0, 5)[:3] == ("kv", [3, 1, 1, 128, 1, 1, 0], [out.ptr, w.ptr, 3, 0, 300])
    assert _exec_node(fake, 0, 1, 3)[:3] == ("kg", [3, 1, 1, 32, 1, 1, 0], [out2.ptr, w.ptr, 3])
    # the same values: launched as it is
    fake.fake_log_clear()
    graph([out, out2])
    assert _calls(fake) == ["cuGraphLaunch@0"]
    # other values: the two nodes with Variables are updated, once each; values set again to the same ones too
    kv.set_values(_values((7,), 20))
    kg.set_values(_values((7,), 1, (7,)))
    fake.fake_log_clear()
    graph([out, out2])
    assert _calls(fake) == ["v2@0", "cuGraphExecKernelNodeSetParams@0"] * 2 + ["cuGraphLaunch@0"]
    assert _exec_node(fake, 0, 0, 5)[1:3] == ([1, 1, 1, 20, 1, 1, 0], [out.ptr, w.ptr, 7, 0, 20])
    assert _exec_node(fake, 0, 1, 3)[1:3] == ([7, 1, 1, 32, 1, 1, 0], [out2.ptr, w.ptr, 7])
    assert _exec_node(fake, 0, 2, 4)[2] == [out2.ptr, w.ptr, 0, 64]
    # a value that leaves a launch no threads: the launches run one by one (that one not at all), the graph as it was
    kv.set_values(_values((0,), 0))
    l0, g0, u0 = _launches(fake), _count(fake, "graph_launches"), _count(fake, "node_updates")
    graph([out, out2])
    assert _launches(fake) == l0 + 2 and _count(fake, "graph_launches") == g0 and _count(fake, "node_updates") == u0
    # back to threads: the node takes the values it has now
    kv.set_values(_values((5,), 300))
    graph([out, out2])
    assert _count(fake, "node_updates") == u0 + 1 and _count(fake, "graph_launches") == g0 + 1
    assert _exec_node(fake, 0, 0, 5)[1:3] == ([3, 1, 1, 128, 1, 1, 0], [out.ptr, w.ptr, 5, 0, 300])
    assert fake.fake_execs() == 1

def test_graph_built_while_a_launch_has_no_threads(fake):
    # the first call has no threads in a launch with Variables: no graph yet; the next call builds it with every node
    dev = CUDADevice("CUDA")
    w, out = dev.allocator.alloc(256), dev.allocator.alloc(256)
    fake.fake_params(b"kv", 5, 2)
    kv = CUDAProgram(dev, "kv", ELF).prepare(None, w, vals=(0,), global_size=0, varying=(0,))
    kf = CUDAProgram(dev, "kf", ELF).prepare(None, w, global_size=64, varying=(0,))
    kv.set_values(_values((0,), 0))
    graph = kv.graph([(kv, (0,)), (kf, (0,))], (0, 0))
    graph([out])
    assert fake.fake_execs() == 0
    kv.set_values(_values((2,), 2))
    graph([out])
    assert fake.fake_execs() == 1 and fake.fake_exec_nodes(0) == 2
    assert _exec_node(fake, 0, 0, 5)[1:3] == ([1, 1, 1, 2, 1, 1, 0], [out.ptr, w.ptr, 2, 0, 2])

JIT_RUN = JIT_PREAMBLE + """
cache = Tensor(rng.random((16, 8), dtype=np.float32), device="CUDA").realize()
pos = Variable("pos", 0, 16)
@TinyJit
def f(x, p):
    rows = cache[0:p]
    scores = (rows * x).sum(1)
    pooled = (rows * 0.5).sum(0)
    return scores * 3, (pooled * 2 + x).relu()
xs = [Tensor(rng.random(8, dtype=np.float32), device="CUDA").realize() for _ in range(6)]
f(xs[0], pos.bind(5)), f(xs[1], pos.bind(3))
kernels = [ei for ei in f.captured if isinstance(ei.prg, CompiledRunner)]
for ei in kernels:
    nbufs = len(ei.prg._gidx) if ei.prg._gidx else len(ei.bufs)
    fake.fake_params(ei.prg.p.function_name.encode(), nbufs + len(ei.prg._vnames) + 2, nbufs)
with_vars = [i for i, ei in enumerate(kernels) if ei.prg._vnames]
replays = []
for n in (7, 7, 12, 1):   # (one input: what changes between replays is the value alone)
    x = xs[2]
    k0, g0, u0, e0 = count("launches"), count("graph_launches"), count("node_updates"), fake.fake_execs()
    f(x, pos.bind(n))
    e = fake.fake_execs() - 1
    params, grids = [], []
    for i in with_vars:
        ei = kernels[i]
        nbufs = len(ei.prg._gidx) if ei.prg._gidx else len(ei.bufs)
        params.append(fake.fake_exec_param(e, i, nbufs))
        launch = ei.prg._launch({"pos": n})
        geometry = ei.prg._prg._geometry(ei.prg._prg.device, launch["global_size"], launch.get("global_dims"),
                                         launch.get("local_dims"))
        grids.append([fake.fake_exec_dim(e, i, d) for d in range(6)] == list(geometry[1] + geometry[2]))
    replays.append(dict(kernels=count("launches") - k0, graphs=count("graph_launches") - g0,
                        updates=count("node_updates") - u0, made=fake.fake_execs() - e0, nodes=fake.fake_exec_nodes(e),
                        params=params, grids=grids, value=n))
print(json.dumps(dict(n=len(kernels), with_vars=len(with_vars), replays=replays)))
"""

def test_tinyjit_with_a_variable_replays_through_one_cuda_graph(fake_lib):
    """TinyJit on CUDA (kernels compiled by NVRTC, not run) with a bound Variable: every replay is one cuGraphLaunch
    of a graph holding every kernel; a replay with another value updates the nodes of the kernels with the Variable
    (their value and grid), one with the same value updates none."""
    r = subprocess.run([sys.executable, "-c", JIT_RUN, fake_lib], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CACHELEVEL": "0"})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["with_vars"] >= 2, got
    for i, rep in enumerate(got["replays"]):
        assert rep["kernels"] == 0 and rep["graphs"] == 1 and rep["nodes"] == got["n"], (i, rep)
        assert rep["params"] == [rep["value"]] * got["with_vars"] and all(rep["grids"]), (i, rep)
        assert rep["made"] == (1 if i == 0 else 0), (i, rep)
    # (7 again: nothing to update; 12 and 1: the nodes with the Variable, once each)
    assert [rep["updates"] for rep in got["replays"][1:]] == [0, got["with_vars"], got["with_vars"]], got
