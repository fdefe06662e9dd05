"""More constructors: random numbers (a counter-based generator computed in kernels), initializers, ranges."""
from __future__ import annotations

class CreationMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
