"""float32 erf is computed in float32 and stays within 1 ulp of the exact value where its
polynomials take over from each other (below 1/2, on [1/2, 1] around 3/4): checked against math.erf on a dense set of
float32 values there, the pieces' boundaries, tails, infinities, nan and signed zeros; float64 erf keeps its series."""
from __future__ import annotations

import math

import numpy as np

from fusegrad import Tensor


def _ulps(x: np.ndarray) -> np.ndarray:
    got = Tensor(x).erf().numpy().astype(np.float64)
    exact = np.array([math.erf(float(v)) for v in x])
    return np.abs(got - exact) / np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)


def test_float32_erf_below_one_within_1_ulp():
    # every 4096th float32 in [2^-30, 1], every float32 next to the boundaries 1/2 and 1, and their negatives
    lo, hi = np.float32(2.0 ** -30).view(np.int32), np.float32(1.0).view(np.int32)
    near = [np.arange(b - 2000, b + 2000, dtype=np.int32) for b in (np.float32(0.5).view(np.int32), hi)]
    bits = np.concatenate([np.arange(lo, hi, 4096, dtype=np.int32), *near])
    x = bits.view(np.float32)
    x = np.concatenate([x, -x])
    assert _ulps(x).max() <= 1


def test_float32_erf_tails_and_specials():
    x = np.array([1e-45, 1e-40, 1e-38, 3.9, 4.0, 4.1, 10.0, 1e30, 3.4e38], np.float32)
    assert _ulps(np.concatenate([x, -x])).max() <= 1
    got = Tensor(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)).erf().numpy()
    assert np.isnan(got[0]) and got[1] == 1 and got[2] == -1
    assert got[3] == 0 and not np.signbit(got[3]) and got[4] == 0 and np.signbit(got[4])


def test_float64_erf_unchanged():
    x = np.concatenate([np.linspace(-6, 6, 2001), [1e-300, -1e-300, 0.5, 0.75, 1.0]])
    np.testing.assert_allclose(Tensor(x).erf().numpy(), [math.erf(v) for v in x], rtol=1e-13, atol=1e-16)
