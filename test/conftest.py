import os
# every graph is checked against its stage's spec in tests
os.environ.setdefault("SPEC", "1")

import faulthandler  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import pytest  # noqa: E402

# A test worker that dies of a fatal signal (a crash in C) prints its Python stacks to stderr, which pytest-xdist
# doesn't show: the run only says the worker crashed. Each worker writes them to a file of its own instead, and the
# run's summary prints every file that isn't empty.
_CRASH_LOGS = "PYTEST_FUSEGRAD_CRASH_LOGS"

# A worker can also end without a signal: C code calling exit() (LLVM's fatal errors do, after writing their reason
# to stderr, which pytest captures into a temporary file during a test). A C atexit handler, armed while the tests
# run, appends to the same file the test that was running and what the test had written to stderr so far.
_EXIT_HOOK_C = r'''
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
static char log_path[4096], running[4096];
static volatile int armed;
static pid_t worker;
static void report(void) {
  if (!armed || getpid() != worker) return;   /* (a child forked by a test inherits the handler) */
  int out = open(log_path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (out < 0) return;
  dprintf(out, "the worker called exit() (not a signal) while running %s; the test's stderr:\n", running);
  struct stat st;
  int in = open("/proc/self/fd/2", O_RDONLY);
  if (in >= 0 && fstat(in, &st) == 0 && S_ISREG(st.st_mode)) {   /* (pytest's capture file; never a pipe) */
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0) if (write(out, buf, n) != n) break;
  }
  if (in >= 0) close(in);
  close(out);
}
void fg_arm(const char *path) {
  strncpy(log_path, path, sizeof log_path - 1);
  worker = getpid();
  armed = 1;
  atexit(report);
}
void fg_running(const char *test) { strncpy(running, test, sizeof running - 1); }
void fg_disarm(void) { armed = 0; }
'''

_armed: list = [None]   # (the worker's armed handler library)

def _exit_hook(log: pathlib.Path):
    """The armed handler's library (fg_running, fg_disarm), or None where no C compiler builds it."""
    import ctypes
    import subprocess
    folder = pathlib.Path(tempfile.mkdtemp(prefix="fusegrad-exit-hook-"))
    try:
        (folder / "hook.c").write_text(_EXIT_HOOK_C)
        built = subprocess.run([shutil.which("cc") or "cc", "-shared", "-fPIC", "-O1", str(folder / "hook.c"), "-o",
                                str(folder / "hook.so")], capture_output=True, timeout=60)
        if built.returncode != 0: return None
        lib = ctypes.CDLL(str(folder / "hook.so"))
    except (OSError, subprocess.SubprocessError): return None
    finally: shutil.rmtree(folder, ignore_errors=True)   # (loaded: the file isn't needed any more)
    lib.fg_arm(str(log).encode())
    return lib

@pytest.hookimpl(trylast=True)   # (after pytest's own faulthandler set-up, which this replaces in a worker)
def pytest_configure(config) -> None:
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) is None:
        config._fusegrad_crash_logs = os.environ[_CRASH_LOGS] = tempfile.mkdtemp(prefix="fusegrad-test-crashes-")
        return
    if (folder := os.environ.get(_CRASH_LOGS)) is None: return
    log = pathlib.Path(folder) / f"{worker}-{os.getpid()}.log"
    # (left open until the process ends: faulthandler writes to it from the signal handler)
    config._fusegrad_crash_log = open(log, "w")
    faulthandler.enable(file=config._fusegrad_crash_log, all_threads=True)
    _armed[0] = _exit_hook(log)

def pytest_runtest_logstart(nodeid, location) -> None:
    if _armed[0] is not None: _armed[0].fg_running(nodeid.encode())

def pytest_terminal_summary(terminalreporter) -> None:
    if (folder := getattr(terminalreporter.config, "_fusegrad_crash_logs", None)) is None: return
    for log in sorted(pathlib.Path(folder).glob("*.log")):
        if text := log.read_text().strip():
            terminalreporter.write_sep("=", f"worker {log.stem} died (a fatal signal, or exit() from C): its report")
            terminalreporter.write_line(text)

def pytest_unconfigure(config) -> None:
    if _armed[0] is not None: _armed[0].fg_disarm()   # (a normal exit)
    if (folder := getattr(config, "_fusegrad_crash_logs", None)) is not None: shutil.rmtree(folder, ignore_errors=True)

@pytest.fixture
def compiled_sources(monkeypatch) -> list[str]:
    """The source of every program compiled for a runner from now on (a kernel the method cache already holds is not
    compiled again: a test reading the C uses shapes no other test does)."""
    from fusegrad.engine import realize
    seen: list[str] = []
    init = realize.CompiledRunner.__init__
    def recording(self, p, *args, **kwargs):
        seen.append(p.src)
        init(self, p, *args, **kwargs)
    monkeypatch.setattr(realize.CompiledRunner, "__init__", recording)
    return seen

@pytest.fixture(autouse=True)
def _seeded_random_tensors():
    """Every test starts from the same random stream (Tensor's default seed is the time: a weight initialised from it
    differs run to run, and a test against torch could pass or fail by the clock)."""
    from fusegrad import Tensor
    Tensor.manual_seed(0)
    yield
