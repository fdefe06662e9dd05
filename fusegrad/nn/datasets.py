"""Data sets: MNIST from its IDX files and the handwritten digits that scikit-learn ships."""
from __future__ import annotations
