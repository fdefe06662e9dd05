"""fusegrad: a deep-learning framework that is a small compiler."""
from fusegrad.dtype import dtypes
from fusegrad.helpers import Context, getenv, DEBUG, fetch, tune_gc
from fusegrad.uop.ops import UOp, Ops, Variable
from fusegrad.tensor import Tensor
from fusegrad.device import Device
from fusegrad.engine.realize import GlobalCounters
from fusegrad.engine.jit import TinyJit
from fusegrad import nn
from fusegrad.function import function
from fusegrad.tensor.explain import track_sources

tune_gc()

__all__ = ["Tensor", "dtypes", "Device", "Variable", "Context", "getenv", "GlobalCounters", "TinyJit", "nn",
           "UOp", "Ops", "DEBUG", "fetch", "function", "track_sources"]
