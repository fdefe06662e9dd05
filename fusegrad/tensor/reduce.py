"""Reductions beyond sum/max/mean: statistics, scans, sorting and selection."""
from __future__ import annotations

class ReduceMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
