"""SharedSubstitution and BuffersBelow: one walk over many roots gives what a walk per root gives (substitute_map, a
toposort's buffers), and re-pointing many overlapping lazy tensors after a realize keeps every value right."""
import numpy as np
from fusegrad import Tensor, dtypes
from fusegrad.uop.graph import BuffersBelow, SharedSubstitution, substitute_map
from fusegrad.uop.ops import Ops, UOp

def _graphs():
    rng = np.random.default_rng(0)
    a, b = Tensor(rng.standard_normal((4, 5)).astype(np.float32)), Tensor(rng.standard_normal(5).astype(np.float32))
    x, outs = a, []
    for i in range(12):
        x = (x * 1.5 + b).relu() if i % 3 else x.sum(1, keepdim=True).expand(4, 5) + x
        outs.append(x)
    return a, b, outs

def test_shared_substitution_is_substitute_map_per_root():
    a, b, outs = _graphs()
    # replace a node in the middle of the chain and one of the leaves
    stand_in = UOp(Ops.BUFFER, dtypes.float32, a.uop.base.src, (10**9, 20)).reshape((4, 5))
    dvars = {outs[4].uop: stand_in, b.uop: b.uop * 2}
    sub = SharedSubstitution(dvars)
    for t in reversed(outs):   # (the roots in any order: the walk of a later root reuses what an earlier one walked)
        assert sub(t.uop) is substitute_map(t.uop, dvars)[t.uop]
    assert sub(outs[1].uop) is not outs[1].uop and sub(outs[0].uop) is outs[0].uop and sub(a.uop) is a.uop
    assert sub(outs[4].uop) is stand_in

def test_buffers_below_many_roots():
    a, b, outs = _graphs()
    among = {a.uop.base, b.uop.base}
    below = BuffersBelow(among)
    below.walk(outs[0].uop)
    assert below.found == {x for x in outs[0].uop.toposort() if x in among}
    for t in outs: below.walk(t.uop)
    assert below.found == among

def test_realize_one_of_a_kept_chain_keeps_every_value():
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal((6, 7)).astype(np.float32)
    x, kept, want, w = Tensor(x0), [], [], x0
    for i in range(40):
        x = (x * 1.01 + 0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(6, 7) * 0.001 + x
        w = np.maximum(w * np.float32(1.01) + np.float32(0.5), 0) if i % 3 else \
            w.sum(1, keepdims=True) * np.float32(0.001) + w
        kept.append(x)
        want.append(w)
    kept[-1].realize()
    for t, v in zip(kept, want): np.testing.assert_allclose(t.numpy(), v, rtol=1e-5)
    # the chain again, realized from its middle first: the tensors above it are re-pointed over its buffer
    x, kept2 = Tensor(x0), []
    for i in range(40):
        x = (x * 1.01 + 0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(6, 7) * 0.001 + x
        kept2.append(x)
    kept2[20].realize()
    assert kept2[20].uop.base.op is Ops.BUFFER
    for t, v in zip(kept2[::-1], want[::-1]): np.testing.assert_allclose(t.numpy(), v, rtol=1e-5)
