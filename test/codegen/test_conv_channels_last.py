"""Convolutions read and stored channels-last ((N, H, W, C) data through channel-first views, as the ONNX runner's
regions compute them: fusegrad/onnx/layout.py): forward and both gradients against PyTorch, on the shapes whose
kernels the regions give whole vectors of output channels over short rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusegrad import Tensor


@pytest.mark.parametrize("n,cin,hw,cout,k,stride,pad", [
    (16, 16, 8, 16, 3, 1, 1),     # the ResNet-style CNN's first block
    (4, 32, 4, 32, 3, 1, 1),      # its second block
    (4, 16, 8, 32, 3, 2, 1),      # its strided convolution
    (4, 16, 8, 32, 1, 2, 0),      # its projection
    (2, 16, 13, 16, 3, 1, 1),     # odd rows
])
def test_channels_last_conv_matches_torch(n, cin, hw, cout, k, stride, pad):
    rng = np.random.default_rng(n * cin + hw)
    xn = rng.standard_normal((n, hw, hw, cin)).astype(np.float32)
    wn = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    res = rng.standard_normal((n, cout, (hw + 2 * pad - k) // stride + 1, (hw + 2 * pad - k) // stride + 1))
    res = res.astype(np.float32)
    # (the weights laid out with the output channels innermost, as the runner reads initializers)
    x, w = Tensor(xn, requires_grad=True), Tensor(wn.transpose(1, 2, 3, 0).copy(), requires_grad=True)
    r = Tensor(res.transpose(0, 2, 3, 1).copy())
    y = (x.permute(0, 3, 1, 2).conv2d(w.permute(3, 0, 1, 2), stride=stride, padding=pad) + r.permute(0, 3, 1, 2))
    out = y.relu().permute(0, 2, 3, 1).contiguous()
    (out * out).sum().backward()

    tx, tw = torch.tensor(xn, requires_grad=True), torch.tensor(wn, requires_grad=True)
    ty = torch.nn.functional.conv2d(tx.permute(0, 3, 1, 2), tw, stride=stride, padding=pad) + torch.tensor(res)
    tout = ty.relu().permute(0, 2, 3, 1)
    (tout * tout).sum().backward()
    np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.permute(1, 2, 3, 0).numpy(), rtol=1e-3, atol=1e-3)
