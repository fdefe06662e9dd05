"""VIZ and PROFILE: what the compiler did (graph rewrites, schedules, kernels) and when things ran (a timeline), saved
as a trace file and shown in a local web page (`python -m fusegrad.viz FILE`). The recorder (`record.py`) sits at
the bottom of the package; the server (`server.py`) and the page (`static/`) only read trace files."""
from fusegrad.viz.record import enable, save, save_profile, trace

__all__ = ["enable", "save", "save_profile", "trace"]
