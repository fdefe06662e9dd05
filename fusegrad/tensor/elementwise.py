"""Elementwise math: activations, trigonometric and hyperbolic functions, rounding, special values."""
from __future__ import annotations

class ElementwiseMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
