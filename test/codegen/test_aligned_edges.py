"""A padded edge that the vector lanes align with (every lane of a vector in, or every lane out) is one vector access
under one gate, not a store per lane or a masked load: what the values are, against NumPy, on edges that align and
edges that don't (whose lanes keep their own gates)."""
import re
import numpy as np
import pytest
from fusegrad import Device, Tensor

# (rows of the product, its inner size, its columns): 112 and 784 are a whole number of 16-lane vectors but not of
# the 32 a tile of two vectors covers (the last tile's second vector is all out); 100 and 200 end inside a vector
@pytest.mark.parametrize("m,k,n", [(16, 112, 48), (8, 80, 24), (64, 200, 48), (32, 100, 40), (128, 784, 64)])
def test_update_of_a_transposed_product(compiled_sources, m, k, n):
    rng = np.random.default_rng(m + k + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = (Tensor(w) - 0.1 * (Tensor(b).T @ Tensor(a))).numpy()
    np.testing.assert_allclose(got, w - 0.1 * (b.T.astype(np.float64) @ a), rtol=1e-4, atol=1e-4)

def test_aligned_edge_is_one_gated_vector_store(compiled_sources):
    rng = np.random.default_rng(1)
    # (shapes no other test here uses: the kernel is generated in this test, not taken from the method cache)
    a, b = rng.standard_normal((8, 144)).astype(np.float32), rng.standard_normal((8, 40)).astype(np.float32)
    w = rng.standard_normal((40, 144)).astype(np.float32)
    # (on the CPU device: its C is what the assertions read, whatever the default device)
    got = (Tensor(w, device="CPU") - 0.1 * (Tensor(b, device="CPU").T @ Tensor(a, device="CPU"))).numpy()
    np.testing.assert_allclose(got, w - 0.1 * (b.T.astype(np.float64) @ a), rtol=1e-4, atol=1e-4)
    src = "\n".join(compiled_sources)
    if Device["CPU"].renderer.simd_bytes == 64:   # (16-lane vectors: the heuristic tiles this product as above)
        # the vector of the gated edge is stored whole, no lane on its own
        assert re.search(r"if \(\w+\) \(\*\(\(f32x16\*\)", src), src
        assert not re.search(r"\] = \w+\[\d+\];", src), src
