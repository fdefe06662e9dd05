"""Convolutions and large 16-bit copies on a machine with an NVIDIA GPU (run by test/gpu/check.sh):

1. half and bfloat16 convolutions (3x3, 1x1, 5x5 and 7x7; stride, padding, dilation, bias) against torch's float32
   convolution of the same values on the GPU, both as im2col (small images, IM2COL=1: the windows copied into a
   matrix, a tensor-core matmul, the layout copy) and read in place (IM2COL=0), and their input gradients;
2. a large elementwise kernel of 16-bit values, several outputs per work-item (heuristic_gpu ITEMS), against numpy.
Prints one line per check and "check_convolutions: passed" or FAILED."""
from __future__ import annotations
import sys
import numpy as np
import torch
from fusegrad import Context, Tensor, dtypes

failed = 0
def check(name: str, ok: bool, detail: str = "") -> None:
    global failed
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)

rng = np.random.default_rng(0)
shapes = [(2, 16, 16, 3, 6, 1, 1, 1, False), (3, 32, 64, 1, 5, 1, 0, 1, True), (2, 8, 24, 3, 7, 2, 1, 1, True),
          (1, 16, 16, 1, 6, 2, 0, 1, False), (1, 8, 16, 3, 9, 1, 2, 2, True), (4, 64, 128, 3, 14, 1, 1, 1, False),
          (5, 3, 64, 7, 33, 2, 3, 1, False), (2, 128, 64, 3, 10, 2, 1, 1, True), (2, 32, 32, 5, 12, 1, 2, 1, False),
          (32, 256, 256, 3, 14, 1, 1, 1, False), (2, 16, 16, 3, 30, 1, 1, 1, True)]
for bs, cin, cout, k, side, stride, pad, dil, bias in shapes:
    for dt, tdt in ((dtypes.half, torch.float16), (dtypes.bfloat16, torch.bfloat16)):
        xn = rng.standard_normal((bs, cin, side, side)).astype(np.float32)
        wn = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        bn = rng.standard_normal(cout).astype(np.float32)
        # (the reference computes in float32 from the values rounded to dt, as ours: products exact, sums in float32)
        tx, tw, tb = (torch.tensor(a).to(tdt).float().cuda().requires_grad_() for a in (xn, wn, bn))
        ref = torch.nn.functional.conv2d(tx, tw, tb if bias else None, stride=stride, padding=pad, dilation=dil)
        ref.square().sum().backward()
        want, want_grad = ref.detach().cpu().numpy(), tx.grad.cpu().numpy()
        for im2col in (1, 0):
            with Context(IM2COL=im2col):
                x = Tensor(xn, device="CUDA").cast(dt).realize().requires_grad_()
                w, b = (Tensor(a, device="CUDA").cast(dt).realize() for a in (wn, bn))
                out = x.conv2d(w, b if bias else None, stride=stride, padding=pad, dilation=dil)
                out.float().square().sum().backward()
                got, grad = out.float().numpy(), x.grad.float().numpy()
            err = np.abs(got - want).max() / np.abs(want).max() if got.shape == want.shape else np.inf
            gerr = np.abs(grad - want_grad).max() / np.abs(want_grad).max()
            check(f"conv {bs}x{cin}x{side}x{side} -> {cout} k{k} s{stride} p{pad} d{dil} bias={bias} {dt.name} "
                  f"IM2COL={im2col}", bool(err < 1e-2 and gerr < 2e-2), f"{err:.1e} (gradient {gerr:.1e})")

# a 16-bit elementwise kernel of 2^22 outputs: a padded permute, ITEMS outputs per work-item
a = rng.standard_normal((16, 256, 30, 30)).astype(np.float16)
got = (Tensor(a, device="CUDA").pad(((0, 0), (0, 0), (1, 1), (1, 1))).permute(1, 0, 2, 3) * 2).numpy()
check("16-bit padded permute, 4.2M outputs", bool(np.array_equal(got, np.pad(a, ((0, 0), (0, 0), (1, 1), (1, 1)))
                                                                    .transpose(1, 0, 2, 3) * 2)))
print("check_convolutions:", "FAILED" if failed else "passed")
sys.exit(1 if failed else 0)
