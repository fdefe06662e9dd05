"""Executing schedules: realize.py (ExecItem, run_schedule, GlobalCounters), jit.py, search.py."""
