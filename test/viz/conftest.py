import pytest
from fusegrad.viz import record

@pytest.fixture
def recording():
    """VIZ and PROFILE on for one test, with an empty recorder; both off again afterwards."""
    record.recorder.reset()
    record.enable(viz=True, profile=True)
    try: yield record
    finally:
        record.enable(viz=False, profile=False)
        record.recorder.reset()
