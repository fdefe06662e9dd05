"""Model state: parameters and state dicts, safetensors, PyTorch checkpoints, GGUF, zip and tar archives."""
from __future__ import annotations
