"""Neural-network layers with tinygrad's constructor parameters and PyTorch's initialisation."""
from __future__ import annotations

# layers go above this line; the submodules are imported last so `from fusegrad import nn; nn.optim.SGD` works
from fusegrad.nn import optim, state, datasets  # noqa: E402,F401
