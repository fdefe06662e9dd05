"""UOp.substitute_each walks only the nodes a substitution can change: the same nodes as one substitute per dict."""
import random
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import UOp

def random_graph(rng: random.Random, leaves: list[UOp], n: int) -> UOp:
    nodes = list(leaves)
    for _ in range(n):
        a, b = rng.choice(nodes), rng.choice(nodes)
        nodes.append(rng.choice([a + b, a * b, a // 3 + b, (a < b).where(a, b), a % 7]))
    return UOp.sink(*nodes[-4:])

def test_same_as_substitute():
    rng = random.Random(0)
    for trial in range(30):
        ranges = [UOp.range(rng.randint(2, 9), i, "loop") for i in range(3)]
        leaves = ranges + [UOp.const(dtypes.index, c) for c in (1, 2, 5)]
        g = random_graph(rng, leaves, 40)
        lane_axis, other = ranges[trial % 3], ranges[(trial + 1) % 3]
        # the lanes of one axis, and (every third trial) substitutions of different keys
        subs = [{lane_axis: UOp.const(dtypes.index, k)} for k in range(4)]
        if trial % 3 == 0: subs += [{other: UOp.const(dtypes.index, 3)}, {}, {lane_axis: other, other: lane_axis}]
        assert g.substitute_each(subs) == [g.substitute(d) for d in subs]

def test_untouched_graph_is_itself():
    r = UOp.range(8, 0, "loop")
    g = (UOp.range(4, 1, "loop") * 2 + 1).sink()
    assert g.substitute_each([{r: UOp.const(dtypes.index, 1)}] * 3) == [g] * 3
