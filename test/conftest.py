import os
# every graph is checked against its stage's spec in tests
os.environ.setdefault("SPEC", "1")

import pytest  # noqa: E402

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
