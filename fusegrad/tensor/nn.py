"""Neural-network functions: convolution, pooling, resizing, padding modes, losses, attention."""
from __future__ import annotations

class NNMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
