"""Indexing beyond basic slices: tensor and list indices, setitem, gather and scatter, masks, triangles."""
from __future__ import annotations

class IndexingMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
