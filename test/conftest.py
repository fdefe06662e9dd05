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

@pytest.hookimpl(trylast=True)   # (after pytest's own faulthandler set-up, which this replaces in a worker)
def pytest_configure(config) -> None:
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) is None:
        config._fusegrad_crash_logs = os.environ[_CRASH_LOGS] = tempfile.mkdtemp(prefix="fusegrad-test-crashes-")
        return
    if (folder := os.environ.get(_CRASH_LOGS)) is None: return
    # (left open until the process ends: faulthandler writes to it from the signal handler)
    config._fusegrad_crash_log = open(pathlib.Path(folder) / f"{worker}-{os.getpid()}.log", "w")
    faulthandler.enable(file=config._fusegrad_crash_log, all_threads=True)

def pytest_terminal_summary(terminalreporter) -> None:
    if (folder := getattr(terminalreporter.config, "_fusegrad_crash_logs", None)) is None: return
    for log in sorted(pathlib.Path(folder).glob("*.log")):
        if text := log.read_text().strip():
            terminalreporter.write_sep("=", f"worker {log.stem} died of a fatal error; its stacks")
            terminalreporter.write_line(text)

def pytest_unconfigure(config) -> None:
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
