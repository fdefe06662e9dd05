"""Optimizers: SGD, Adam, AdamW, LAMB, LARS, Muon and OptimizerGroup, with the learning rate held in a tensor."""
from __future__ import annotations
