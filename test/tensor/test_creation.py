"""Random numbers, initializers and constructors against torch, numpy and statistics.

The statistical tests use fixed seeds, so they are deterministic; each threshold is set so that a correct generator
with any other seed would fail it with probability about 1e-4 (KS and chi-square tests at alpha = 1e-4, moment checks
at 4-5 standard errors)."""
from __future__ import annotations
import ctypes, math
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes

torch.set_num_threads(1)

ALPHA_Z = 3.719  # the standard normal quantile of 1 - 1e-4

def ks_limit(n: int, alpha: float = 1e-4) -> float:
    """The asymptotic Kolmogorov-Smirnov critical distance at level alpha for n samples."""
    return math.sqrt(-0.5 * math.log(alpha / 2)) / math.sqrt(n)

def ks_distance(samples: np.ndarray, cdf) -> float:
    x = np.sort(samples.astype(np.float64).ravel())
    n = len(x)
    f = cdf(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))

def chi2_limit(df: int) -> float:
    """The 1 - 1e-4 quantile of chi-square with df degrees of freedom (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3

def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())

def normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))

@pytest.fixture(autouse=True)
def _restore_training():
    prev = Tensor.training
    yield
    Tensor.training = prev

# ---------------------------------------------------------------------------------------------------------------------
# the generator

# Threefry-2x32-20 known-answer vectors of the Random123 library: (counter words, key words) -> output words
THREEFRY_KAT = [((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6b200159, 0x99ba4efe)),
                ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
                ((0x243f6a88, 0x85a308d3), (0x13198a2e, 0x03707344), (0xc4923a9c, 0x483df7a0))]

def test_threefry_known_answers():
    xs = Tensor([c[0] | c[1] << 32 for c, _, _ in THREEFRY_KAT], dtype=dtypes.uint64)
    ks = Tensor([k[0] | k[1] << 32 for _, k, _ in THREEFRY_KAT], dtype=dtypes.uint64)
    got = xs.threefry(ks)
    assert got.dtype == dtypes.uint64 and got.shape == (3,)
    assert got.tolist() == [o[0] | o[1] << 32 for _, _, o in THREEFRY_KAT]
    # a Python int key broadcasts
    assert Tensor([0], dtype=dtypes.uint64).threefry(0).tolist() == [0x99ba4efe6b200159]
    with pytest.raises(TypeError, match="uint64"): Tensor([1, 2]).threefry(0)
    with pytest.raises(TypeError, match="seed"): xs.threefry(1.5)
    with pytest.raises(TypeError, match="uint64"): xs.threefry(Tensor([1, 2, 3]))

def threefry_ref(x: int, key: int) -> int:
    """Threefry-2x32-20 written from the Random123 specification (x, key: two 32-bit words each, low word first)."""
    m = 0xFFFFFFFF
    rot = (13, 15, 26, 6, 17, 29, 16, 24)
    k = (key & m, key >> 32, (key & m) ^ (key >> 32) ^ 0x1BD11BDA)
    x0, x1 = ((x & m) + k[0]) & m, ((x >> 32) + k[1]) & m
    for r in range(20):
        x0 = (x0 + x1) & m
        x1 = ((x1 << rot[r % 8]) | (x1 >> (32 - rot[r % 8]))) & m ^ x0
        if r % 4 == 3:
            s = r // 4 + 1
            x0, x1 = (x0 + k[s % 3]) & m, (x1 + k[(s + 1) % 3] + s) & m
    return x1 << 32 | x0

def test_threefry_reference_matches_known_answers():
    for c, k, o in THREEFRY_KAT: assert threefry_ref(c[0] | c[1] << 32, k[0] | k[1] << 32) == o[0] | o[1] << 32

def test_one_kernel_per_call_and_no_recompiles():
    from fusegrad.engine.realize import method_cache
    assert len(Tensor.rand(10).schedule()) == 1
    # (randn's cosine is weighed as a float64 sine by the scheduler's kernel size bound, which may split it in two)
    assert len(Tensor.randn(3, 4).schedule()) <= 2
    assert len((Tensor.rand(4, contiguous=False) * 2 + 1).schedule()) == 1
    Tensor.randn(24).realize()
    Tensor.randn(24).realize()  # the call counter is a kernel argument: later calls compile nothing
    n = len(method_cache)
    for _ in range(3): Tensor.randn(24).realize()
    assert len(method_cache) == n

def test_seed_reproducible_and_calls_independent():
    Tensor.manual_seed(1234)
    a, b, c = Tensor.rand(64), Tensor.rand(64), Tensor.randn(8, 8)
    Tensor.realize(a, b, c)
    Tensor.manual_seed(1234)
    a2, b2, c2 = Tensor.rand(64), Tensor.rand(64), Tensor.randn(8, 8)
    Tensor.manual_seed(1235)
    d = Tensor.rand(64)
    Tensor.realize(a2, b2, c2, d)
    na, nb, nd = a.numpy(), b.numpy(), d.numpy()
    np.testing.assert_array_equal(na, a2.numpy())
    np.testing.assert_array_equal(nb, b2.numpy())
    np.testing.assert_array_equal(c.numpy(), c2.numpy())
    assert not np.any(na == nb) and not np.any(na == nd)
    # values of one call don't depend on the shape they are drawn into (the same elements, reshaped)
    Tensor.manual_seed(1234)
    np.testing.assert_array_equal(Tensor.rand(8, 8).numpy().ravel(), na)

def test_manual_seed_extremes_and_errors():
    outs = []
    for s in (2**64 - 1, -2**63 + 1, 0, 2**64 - 1, -2**63, 2**32):
        Tensor.manual_seed(s)
        outs.append(Tensor.rand(16).numpy())
    np.testing.assert_array_equal(outs[0], outs[3])
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    # as tinygrad's (a uint32 tensor of the seed), the generator keeps the seed's low 32 bits
    np.testing.assert_array_equal(outs[4], outs[2])
    np.testing.assert_array_equal(outs[5], outs[2])
    with pytest.raises(ValueError, match="seed"): Tensor.manual_seed(2**64)
    with pytest.raises(TypeError, match="seed"): Tensor.manual_seed(1.5)
    assert isinstance(Tensor._seed, int)

def test_lazy_random_is_stable_when_recomputed():
    # the same lazy random tensor used by two kernels gives the same values in both (counter-based, not stateful)
    Tensor.manual_seed(7)
    r = Tensor.rand(32, contiguous=False)
    x, y = r + 1, r * 2
    Tensor.realize(x, y)
    np.testing.assert_allclose(x.numpy() - 1, y.numpy() / 2, rtol=0, atol=1.2e-7)  # x rounds r + 1 to float32

# ---------------------------------------------------------------------------------------------------------------------
# distributions

def test_rand_randn_uniform_normal_distributions():
    Tensor.manual_seed(42)
    n = 20000
    u, z, un, nm = Tensor.rand(n), Tensor.randn(n), Tensor.uniform(n, low=-3.0, high=5.0), \
        Tensor.normal(n, mean=2.0, std=0.5)
    Tensor.realize(u, z, un, nm)
    u, z, un, nm = u.numpy(), z.numpy(), un.numpy(), nm.numpy()
    assert u.min() >= 0 and u.max() < 1
    assert ks_distance(u, lambda x: np.clip(x, 0, 1)) < ks_limit(n)
    assert ks_distance(z, normal_cdf) < ks_limit(n)
    assert ks_distance(un, lambda x: np.clip((x + 3) / 8, 0, 1)) < ks_limit(n)
    assert ks_distance(nm, lambda x: normal_cdf((x - 2.0) / 0.5)) < ks_limit(n)
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se and abs(z.std() - 1) < 5 * se
    assert abs(nm.mean() - 2.0) < 5 * 0.5 * se and abs(nm.std() - 0.5) < 5 * 0.5 * se
    assert abs(u.mean() - 0.5) < 5 * se * math.sqrt(1 / 12) and abs(u.var() - 1 / 12) < 0.01
    assert un.min() >= -3 and un.max() <= 5

@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64])
def test_random_float_dtypes(dt):
    Tensor.manual_seed(3)
    u, z, un = Tensor.rand(4000, dtype=dt), Tensor.randn(4000, dtype=dt), Tensor.uniform(50, low=2, high=3, dtype=dt)
    Tensor.realize(u, z, un)
    assert u.dtype == dt and z.dtype == dt and un.dtype == dt
    fu, fz = u.float().numpy(), z.float().numpy()
    assert fu.min() >= 0 and fu.max() < 1 and len(np.unique(fu)) > 100
    assert abs(fz.mean()) < 0.1 and abs(fz.std() - 1) < 0.1 and np.isfinite(fz).all()
    assert ks_distance(fz, normal_cdf) < ks_limit(4000) + 0.01  # + the rounding of 8-bit significands
    assert 2 <= un.float().numpy().min() and un.float().numpy().max() <= 3

def test_shapes_devices_kwargs():
    for shape, expect in [((), ()), ((0, 3), (0, 3)), ((2, 3), (2, 3)), (((2, 3),), (2, 3)), (([4],), (4,))]:
        assert Tensor.rand(*shape).shape == expect
        assert Tensor.randn(*shape).shape == expect
    r = Tensor.rand(2, 3, dtype="float16", device="CPU")
    assert r.dtype == dtypes.float16 and r.device == Tensor.zeros(1).device
    assert Tensor.rand(0, 3).numpy().shape == (0, 3) and Tensor.randint(0).numpy().shape == (0,)
    assert Tensor.rand(3).dtype == dtypes.float32 and Tensor.randn(2).dtype == dtypes.float32
    assert Tensor.rand(5, contiguous=False).shape == (5,)
    with pytest.raises(ValueError, match="negative"): Tensor.rand(-1, 2)
    with pytest.raises(TypeError, match="shape"): Tensor.randn(2.5)
    with pytest.raises(TypeError, match="floating"): Tensor.rand(3, dtype=dtypes.int32)
    with pytest.raises(TypeError, match="floating"): Tensor.randn(3, dtype=dtypes.int64)
    with pytest.raises(TypeError, match="unexpected"): Tensor.randn(3, colour="red")
    with pytest.raises(ValueError, match="std"): Tensor.normal(3, std=-1.0)
    with pytest.raises(ValueError, match="low <= high"): Tensor.uniform(3, low=2.0, high=1.0)

def test_reparametrization_gradients():
    # x = mu + sigma * eps: d sum(x^2) / d mu = 2 x, d / d sigma = 2 x eps, compared with torch on the same eps
    Tensor.manual_seed(11)
    mu, sigma = Tensor([0.5, -1.0, 2.0], requires_grad=True), Tensor([1.0, 0.3, 2.0], requires_grad=True)
    eps = Tensor.randn(4, 3)
    x = mu + sigma * eps
    gmu, gsig = (x * x).sum().gradient(mu, sigma)
    Tensor.realize(eps, gmu, gsig)
    tm, ts = torch.tensor([0.5, -1.0, 2.0], requires_grad=True), torch.tensor([1.0, 0.3, 2.0], requires_grad=True)
    tx = tm + ts * torch.tensor(eps.numpy())
    (tx * tx).sum().backward()
    np.testing.assert_allclose(gmu.numpy(), tm.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gsig.numpy(), ts.grad.numpy(), rtol=1e-5, atol=1e-6)
    # a random leaf that requires grad
    w = Tensor.uniform(3, 2, low=-1, high=1, requires_grad=True)
    (w * 3).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full((3, 2), 3.0, np.float32))

# ---------------------------------------------------------------------------------------------------------------------
# integers, permutations, categories

def test_randint_range_dtype_and_frequencies():
    Tensor.manual_seed(5)
    a = Tensor.randint(30000, low=-3, high=4)
    b = Tensor.randint(2, 5, low=10, high=12, dtype=dtypes.int64)
    c = Tensor.randint(1000, low=-2**63, high=2**63 - 1, dtype=dtypes.int64)
    d = Tensor.randint(100, low=0, high=256, dtype=dtypes.uint8)
    e = Tensor.randint(100, low=-5, high=5, dtype=dtypes.float32)
    Tensor.realize(a, b, c, d, e)
    assert a.dtype == dtypes.int32 and b.dtype == dtypes.int64 and b.shape == (2, 5) and d.dtype == dtypes.uint8
    na = a.numpy()
    assert na.min() == -3 and na.max() == 3
    counts = np.bincount(na + 3, minlength=7)
    assert chi2_stat(counts, np.full(7, 1 / 7)) < chi2_limit(6)
    assert set(b.numpy().ravel()) <= {10, 11}
    nc = c.numpy()
    assert (nc < 0).sum() > 400 and (nc > 0).sum() > 400
    assert e.dtype == dtypes.float32 and set(e.numpy()) <= set(float(v) for v in range(-5, 5))
    with pytest.raises(ValueError, match="low < high"): Tensor.randint(3, low=5, high=5)
    with pytest.raises(TypeError, match="int"): Tensor.randint(3, low=0.5, high=2)
    with pytest.raises(ValueError, match="fit"): Tensor.randint(3, low=0, high=300, dtype=dtypes.uint8)
    with pytest.raises(TypeError, match="dtype"): Tensor.randint(3, dtype=dtypes.bool)

def test_randperm():
    Tensor.manual_seed(9)
    ps = [Tensor.randperm(n) for n in (0, 1, 2, 100)] + [Tensor.randperm(50, dtype=dtypes.int64)]
    Tensor.realize(*ps)
    for p, n in zip(ps, (0, 1, 2, 100, 50)):
        assert p.shape == (n,) and sorted(p.tolist()) == list(range(n))
    assert ps[0].dtype == dtypes.int32 and ps[4].dtype == dtypes.int64
    assert ps[3].tolist() != list(range(100))
    with pytest.raises(ValueError, match="n >= 0"): Tensor.randperm(-1)
    with pytest.raises(TypeError, match="int"): Tensor.randperm(2.0)
    with pytest.raises(ValueError, match="fit"): Tensor.randperm(300, dtype=dtypes.int8)

def test_randperm_uniform_over_permutations():
    # 600 permutations of 3: each of the 6 orders is equally likely
    Tensor.manual_seed(10)
    counts: dict[tuple, int] = {}
    for _ in range(600):
        t = tuple(Tensor.randperm(3).tolist())
        counts[t] = counts.get(t, 0) + 1
    assert len(counts) == 6
    assert chi2_stat(np.array(list(counts.values()), np.float64), np.full(6, 1 / 6)) < chi2_limit(5)

def test_multinomial_with_replacement():
    Tensor.manual_seed(21)
    p = np.array([0.1, 0.0, 0.5, 0.15, 0.25], np.float32)
    w = Tensor(p * 4)  # unnormalized weights
    s1 = w.multinomial(20000, replacement=True)
    # 2-D: one row per distribution; the weights given transposed and flipped (non-contiguous)
    w2 = Tensor(np.array([[1, 0], [0, 0], [0, 0], [0, 1]], np.float32)).flip(0).T
    s2 = w2.multinomial(10, replacement=True)
    Tensor.realize(s1, s2)
    assert s1.shape == (20000,) and s1.dtype == dtypes.int32 and s2.shape == (2, 10)
    counts = np.bincount(s1.numpy(), minlength=5)
    assert counts[1] == 0
    nz = p > 0
    assert chi2_stat(counts[nz].astype(np.float64), p[nz] / p.sum()) < chi2_limit(int(nz.sum()) - 1)
    assert (s2.numpy()[0] == 3).all() and (s2.numpy()[1] == 0).all()
    # huge and tiny weights (half precision too) keep their proportions
    big = Tensor([3e38, 1e38], dtype=dtypes.float32).multinomial(4000, replacement=True).numpy()
    tiny = Tensor([1e-4, 3e-4], dtype=dtypes.float16).multinomial(4000, replacement=True).numpy()
    for s, q in ((big, 0.75), (tiny, 0.25)):
        assert abs((s == 0).mean() - q) < ALPHA_Z * math.sqrt(q * (1 - q) / 4000)

def test_multinomial_without_replacement():
    Tensor.manual_seed(22)
    p = np.array([0.5, 0.3, 0.2], np.float64)
    rows = 6000
    w = Tensor(np.tile(p.astype(np.float32), (rows, 1)))
    s = w.multinomial(2)
    full = Tensor([3.0, 1.0, 0.5, 2.0]).multinomial(4)
    Tensor.realize(s, full)
    assert s.shape == (rows, 2) and s.dtype == dtypes.int32
    ns = s.numpy()
    assert (ns[:, 0] != ns[:, 1]).all()
    assert sorted(full.tolist()) == [0, 1, 2, 3]
    assert Tensor.ones(0, 3).multinomial(2).numpy().shape == (0, 2)
    # first draw ~ p; second draw j: sum over i != j of p_i p_j / (1 - p_i)
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in range(3) if i != j) for j in range(3)])
    assert chi2_stat(np.bincount(ns[:, 0], minlength=3).astype(np.float64), p) < chi2_limit(2)
    assert chi2_stat(np.bincount(ns[:, 1], minlength=3).astype(np.float64), second) < chi2_limit(2)

def test_multinomial_errors():
    w = Tensor([0.2, 0.8])
    with pytest.raises(ValueError, match="without replacement"): w.multinomial(3)
    with pytest.raises(ValueError, match="num_samples"): w.multinomial(0)
    with pytest.raises(ValueError, match="1-D or 2-D"): Tensor.ones(2, 2, 2).multinomial()
    with pytest.raises(ValueError, match="1-D or 2-D"): Tensor(1.0).multinomial()
    with pytest.raises(TypeError, match="floating"): Tensor([1, 2]).multinomial()
    with pytest.raises(ValueError, match="category"): Tensor.ones(0).multinomial(1, replacement=True)

# ---------------------------------------------------------------------------------------------------------------------
# dropout

def test_dropout_not_training_is_identity():
    Tensor.training = False
    x = Tensor([1.0, 2.0])
    assert x.dropout(0.9) is x
    Tensor.training = True
    assert x.dropout(0.0) is x
    with pytest.raises(ValueError, match="probability"): x.dropout(1.5)
    with pytest.raises(ValueError, match="probability"): x.dropout(-0.1)

def test_dropout_rate_scale_and_gradient():
    Tensor.training = True
    Tensor.manual_seed(31)
    xn = np.random.default_rng(0).uniform(1, 2, (100, 80)).astype(np.float32)
    x = Tensor(xn.T.copy(), requires_grad=True)
    xt = x.T  # non-contiguous input
    y = xt.dropout(0.3)
    (g,) = (y * 2).sum().gradient(x)
    y1 = Tensor(xn).dropout(1.0)
    yh = Tensor(xn).half().dropout(0.5)
    Tensor.realize(y, g, y1, yh)
    ny = y.numpy()
    kept = ny != 0
    n = kept.size
    assert abs((1 - kept.mean()) - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)
    np.testing.assert_allclose(ny[kept], xn[kept] / 0.7, rtol=1e-6)
    # the gradient is the mask scaled like the values (torch: grad = mask / (1 - p) * upstream)
    np.testing.assert_allclose(g.numpy().T, np.where(kept, 2 / 0.7, 0).astype(np.float32), rtol=1e-6)
    assert (y1.numpy() == 0).all()
    # nan and inf propagate through dropped elements as in torch (x * mask)
    special = Tensor([float("nan"), float("inf"), 1.0] * 200).dropout(0.5).numpy().reshape(200, 3)
    assert np.isnan(special[:, 0]).all() and (np.isnan(special[:, 1]) | np.isinf(special[:, 1])).all()
    assert set(np.unique(special[:, 2])) == {0.0, 2.0}
    assert yh.dtype == dtypes.float16 and abs((yh.numpy() == 0).mean() - 0.5) < 0.03
    with pytest.raises(TypeError, match="floating"): Tensor([1, 2]).dropout(0.5)
    assert Tensor.ones(0, 3).dropout(0.5).shape == (0, 3)

# ---------------------------------------------------------------------------------------------------------------------
# initializers, against torch.nn.init's formulas

@pytest.mark.parametrize("shape", [(256, 128), (64, 16, 3, 3)])
def test_initializers(shape):
    # tinygrad's bounds: fan_in = prod(shape[1:]) (torch.nn.init's), and glorot's fans shape[0] + prod(shape[1:])
    # (torch's for 2-D shapes; torch multiplies both by the receptive field)
    Tensor.manual_seed(4)
    fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    a = 0.01
    gain = torch.nn.init.calculate_gain("leaky_relu", a)
    glorot_b = math.sqrt(6 / (shape[0] + math.prod(shape[1:])))
    if len(shape) == 2: assert glorot_b == pytest.approx(math.sqrt(6 / (fan_in + fan_out)))
    kaiming_b = gain * math.sqrt(3 / fan_in)
    kaiming_std = gain / math.sqrt(fan_in)
    scaled_b = math.prod(shape) ** -0.5
    g, ku, kn, su = Tensor.glorot_uniform(*shape), Tensor.kaiming_uniform(*shape, a=a), \
        Tensor.kaiming_normal(shape, a=a), Tensor.scaled_uniform(*shape)
    Tensor.realize(g, ku, kn, su)
    for t, b in ((g, glorot_b), (ku, kaiming_b), (su, scaled_b)):
        v = t.numpy()
        assert t.shape == shape and t.dtype == dtypes.float32
        assert np.abs(v).max() <= b * (1 + 1e-6) and np.abs(v).max() > 0.99 * b
        assert abs(v.std() - b / math.sqrt(3)) < 0.02 * b
    v = kn.numpy()
    assert abs(v.std() - kaiming_std) < 0.02 * kaiming_std and abs(v.mean()) < 0.02 * kaiming_std
    assert Tensor.kaiming_uniform(4, 3, dtype=dtypes.float16).dtype == dtypes.float16

def test_initializer_shapes_and_errors():
    # as tinygrad: fewer than 2 dimensions have fan_in 1
    assert np.abs(Tensor.kaiming_uniform(5).numpy()).max() <= (6 / (1 + 0.01 ** 2)) ** 0.5
    assert np.abs(Tensor.glorot_uniform(5).numpy()).max() <= (6 / 6) ** 0.5
    with pytest.raises(ValueError, match="fan_in"): Tensor.kaiming_normal(5, 0)
    with pytest.raises(ValueError, match="fan_in"): Tensor.kaiming_uniform(3, 0, 2)
    with pytest.raises(ValueError, match="fans"): Tensor.glorot_uniform()
    with pytest.raises(ValueError, match="nonempty"): Tensor.scaled_uniform(0, 3)

# ---------------------------------------------------------------------------------------------------------------------
# *_like

def test_like_constructors():
    x = Tensor.ones(3, 2, dtype=dtypes.float16)
    outs = [x.rand_like(), x.randn_like(), x.rand_like(dtype=dtypes.float64), x.randn_like(dtype="float32"),
            x.zeros_like(), x.ones_like(dtype=dtypes.int32), x.full_like(7), x.full_like(2.5, dtype=dtypes.float32),
            x.zeros_like(dtype=dtypes.bool)]
    Tensor.realize(*outs)
    expect = [dtypes.float16, dtypes.float16, dtypes.float64, dtypes.float32, dtypes.float16, dtypes.int32,
              dtypes.float16, dtypes.float32, dtypes.bool]
    for o, dt in zip(outs, expect):
        assert o.shape == (3, 2) and o.dtype == dt and o.device == x.device
    assert outs[5].tolist() == [[1, 1]] * 3 and outs[6].tolist() == [[7.0, 7.0]] * 3 and not outs[8].numpy().any()
    e = x.empty_like()
    c = x.const_like(3)
    assert c.dtype == dtypes.float16 and c.tolist() == [[3.0, 3.0]] * 3
    assert x.const_like(1, dtypes.int8).dtype == dtypes.int8
    assert e.shape == (3, 2) and e.dtype == dtypes.float16 and x.empty_like(dtype=dtypes.int8).dtype == dtypes.int8
    with pytest.raises(TypeError, match="floating"): Tensor([1, 2]).rand_like()
    assert Tensor([1, 2]).rand_like(dtype=dtypes.float32).dtype == dtypes.float32

# ---------------------------------------------------------------------------------------------------------------------
# linspace, meshgrid

LINSPACE_CASES = [(0, 1, 5, None), (-3.5, 7.25, 11, None), (1, 0, 4, None), (0, 10, 4, dtypes.int64),
                  (-5, 5, 7, dtypes.int32), (0, 1, 1, None), (2, 3, 0, None), (0, 1, 100, dtypes.float16),
                  (-1e30, 1e30, 9, None), (1, 2, 17, dtypes.float64), (0, 1, 9, dtypes.bfloat16), (5, 5, 3, None)]

def test_linspace_against_torch():
    from fusegrad.dtype import to_torch_dtype
    outs = [Tensor.linspace(a, b, n, dtype=dt) for a, b, n, dt in LINSPACE_CASES]
    Tensor.realize(*outs)
    for out, (a, b, n, dt) in zip(outs, LINSPACE_CASES):
        ref = torch.linspace(a, b, n, dtype=to_torch_dtype(dt) if dt is not None else None)
        assert out.shape == tuple(ref.shape) and out.dtype == (dt or dtypes.float32)
        # torch steps in the output dtype; the values here are rounded once, so half types differ by an ulp or so
        tol = {dtypes.float16: 2e-3, dtypes.bfloat16: 1.6e-2}.get(dt, 1e-6)
        np.testing.assert_allclose(out.float().numpy(), ref.float().numpy(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="steps"): Tensor.linspace(0, 1, -1)
    with pytest.raises(TypeError, match="steps"): Tensor.linspace(0, 1, 2.0)

@pytest.mark.parametrize("indexing", ["ij", "xy"])
def test_meshgrid_against_torch(indexing):
    an, bn, cn = np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0, 5.0], np.float32), np.array(7.0, np.float32)
    a, b, c = Tensor(an, requires_grad=True), Tensor(bn[::-1].copy()).flip(0), Tensor(cn)
    outs = a.meshgrid(b, c, indexing=indexing)
    ta, tb, tc = torch.tensor(an, requires_grad=True), torch.tensor(bn), torch.tensor(cn)
    refs = torch.meshgrid(ta, tb, tc, indexing=indexing)
    weights = np.random.default_rng(1).uniform(-1, 1, refs[0].shape).astype(np.float32)
    (ga,) = (outs[0] * Tensor(weights)).sum().gradient(a)
    (refs[0] * torch.tensor(weights)).sum().backward()
    two = a.meshgrid(b, indexing=indexing)
    two_ref = torch.meshgrid(ta, tb, indexing=indexing)
    Tensor.realize(*outs, *two, ga)
    for o, r in zip(outs + two, refs + two_ref):
        assert o.shape == tuple(r.shape)
        np.testing.assert_array_equal(o.numpy(), r.detach().numpy())
    np.testing.assert_allclose(ga.numpy(), ta.grad.numpy(), rtol=1e-5)
    (single,) = a.meshgrid()
    np.testing.assert_array_equal(single.numpy(), an)

def test_meshgrid_errors():
    a = Tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="indexing"): a.meshgrid(a, indexing="ji")
    with pytest.raises(ValueError, match="1-D"): a.meshgrid(Tensor.ones(2, 2))
    with pytest.raises(TypeError, match="dtype"): a.meshgrid(Tensor([1, 2]))
    with pytest.raises(TypeError, match="tensors"): a.meshgrid([1, 2])

# ---------------------------------------------------------------------------------------------------------------------
# from_blob

def test_from_blob_copies():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_blob(arr.ctypes.data, (3, 4), dtype=dtypes.float32)
    arr[:] = -1  # the caller owns the memory: changing it afterwards doesn't change the tensor
    np.testing.assert_array_equal(t.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4))
    raw = (ctypes.c_int16 * 4)(1, -2, 3, -4)
    t16 = Tensor.from_blob(ctypes.addressof(raw), (2, 2), dtype=dtypes.int16)
    assert t16.dtype == dtypes.int16 and t16.tolist() == [[1, -2], [3, -4]]
    assert Tensor.from_blob(0, (0,)).shape == (0,)
    with pytest.raises(ValueError, match="null"): Tensor.from_blob(0, (2,))
    with pytest.raises(TypeError, match="ptr"): Tensor.from_blob("0x10", (2,))
    with pytest.raises(TypeError, match="unexpected"): Tensor.from_blob(arr.ctypes.data, (2,), colour=1)
    with pytest.raises(ValueError, match="negative"): Tensor.from_blob(arr.ctypes.data, (-2,))

# ---------------------------------------------------------------------------------------------------------------------
# devices

@pytest.mark.parametrize("dev", ["LLVM", "PYTHON"])
def test_same_stream_on_every_device(dev):
    """The generator is the same function on every backend: the values match the CPU's bit for bit."""
    def draw(device: str) -> list[np.ndarray]:
        Tensor.manual_seed(3)
        outs = [Tensor.rand(5, device=device), Tensor.randn(3, device=device, dtype=dtypes.float64),
                Tensor.randint(4, low=-5, high=5, device=device)]
        Tensor.realize(*outs)
        assert all(o.device == outs[0].device for o in outs)
        return [o.numpy() for o in outs]
    try: other = draw(dev)
    except (ImportError, ModuleNotFoundError, RuntimeError) as e: pytest.skip(f"{dev} unavailable: {e}")
    for a, b in zip(draw("CPU"), other): np.testing.assert_array_equal(a, b)

@pytest.mark.slow
def test_large_samples_higher_moments():
    Tensor.manual_seed(99)
    n = 2_000_000
    z, u = Tensor.randn(n, dtype=dtypes.float64), Tensor.rand(n)
    p = Tensor.randperm(3000)
    Tensor.realize(z, u, p)
    z, u = z.numpy(), u.numpy()
    se = 1 / math.sqrt(n)
    assert abs(z.mean()) < 5 * se and abs(z.var() - 1) < 5 * math.sqrt(2) * se
    assert abs((z ** 3).mean()) < 5 * math.sqrt(15) * se and abs((z ** 4).mean() - 3) < 5 * math.sqrt(96) * se
    assert ks_distance(z, normal_cdf) < ks_limit(n) and ks_distance(u, lambda x: np.clip(x, 0, 1)) < ks_limit(n)
    assert sorted(p.tolist()) == list(range(3000))
