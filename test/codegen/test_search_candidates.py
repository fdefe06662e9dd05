"""Every candidate BEAM tries for a kernel computes the kernel's values: the heuristic's opts, its variants and each of
those extended by one of `candidate_actions`, compiled and run on the search's scratch inputs, against NumPy in float64.
The bound is what a float32 sum of the same terms in any order can be off by (n * eps of the terms' magnitudes), so a
reduction reordered by an opt passes and a wrong index, lane or block fails. (The search itself compares candidates
only with the unoptimized kernel; this checks them all, deterministically, whatever the search's timings pick.)"""
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import get_program, optimize
from fusegrad.codegen.opt import Opt, OptOps, search
from fusegrad.device import Device
from fusegrad.engine.realize import CompiledRunner

EPS32 = float(np.finfo(np.float32).eps)

def sum_bound(n: int) -> float:
    """gamma_n: the relative bound (to the sum of the terms' magnitudes) of a float32 sum of n terms, in any order."""
    return n * EPS32 / (1 - n * EPS32)

def conv3x3(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A 3x3 convolution with padding 1 (NCHW, OIHW) in float64."""
    h, wd = x.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    taps = [np.einsum("nchw,oc->nohw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j]) for i in range(3) for j in range(3)]
    return np.sum(taps, axis=0)

def candidates(ast, extend: int | None = None, start: tuple = ()) -> list:
    """The unoptimized kernel, the heuristic's, its variants (or, given `start` opts, the kernel with those) and each
    of those (or of the first `extend` of them) with one more action, rendered and deduplicated by source."""
    ren = Device["CPU"].renderer
    heur = tuple(optimize(ast, ren)[1])
    if start: base = [search._kernel(ast, ren, start)]
    else:
        base = [search._kernel(ast, ren, ()), search._kernel(ast, ren, heur)]
        base += [c for o in search._variants(ast, ren, heur) if (c := search._kernel(ast, ren, o, lenient=True))]
    cands = list(base)
    cands += [c for b in base[:extend] for a in search.candidate_actions(b.k) if (c := search._extend(b, a))]
    out, seen = [], set()
    for c in cands:
        try: c.p = get_program(ast, ren, opts=list(c.opts))
        except Exception: continue   # (one that doesn't render isn't tried by the search either)
        if c.p.src not in seen:
            seen.add(c.p.src)
            out.append(c)
    return out

def check_candidates(t: Tensor, reference, extend: int | None = None, start: tuple = ()) -> int:
    """Run every candidate for the last kernel of `t`'s schedule on the search's scratch buffers; `reference(inputs)`
    gives (float64 result, allowed absolute error per element) from the float64 inputs by buffer size. Returns how
    many candidates were checked."""
    ast = [si.ast for si in t.schedule() if si.ast.op.name == "SINK"][-1]
    scratch = search._Scratch(ast, "CPU")
    (out,) = scratch.stored
    inputs = {b.size: np.frombuffer(b.as_buffer(), np.float32).astype(np.float64)
              for i, b in enumerate(scratch.bufs) if b is not None and i != out}
    want, bound = reference(inputs)
    cands = candidates(ast, extend, start)
    for i in range(0, len(cands), 32): search._compile(cands[i:i + 32], Device["CPU"], CompiledRunner)
    wrong = []
    for c in cands:
        assert c.runner is not None, f"{list(c.opts)} didn't compile"
        scratch.reset()
        c.runner(scratch.bufs, scratch.var_vals, wait=True)
        got = np.frombuffer(scratch.bufs[out].as_buffer(), np.float32).astype(np.float64).reshape(want.shape)
        if not (np.abs(got - want) <= bound).all():
            wrong.append((list(c.opts), float(np.abs(got - want).max())))
    assert not wrong, f"candidates computing wrong values (opts, max error): {wrong}"
    return len(cands)

def test_row_sum_candidates():
    def ref(x):
        a = x[64 * 40].reshape(64, 40)
        return a.sum(1), sum_bound(40) * np.abs(a).sum(1) + EPS32 * np.abs(a.sum(1))
    assert check_candidates(Tensor.empty(64, 40).sum(1), ref, extend=2) > 10

def test_softmax_candidates():
    def ref(x):
        a = x[16 * 200].reshape(16, 200)
        e = np.exp(a - a.max(1, keepdims=True))
        y = e / e.sum(1, keepdims=True)
        return y, (sum_bound(200) + 1e-6) * y   # (a positive sum: relative error; exp's own error is about 1e-7)
    assert check_candidates(Tensor.empty(16, 200).softmax(-1), ref, extend=0) > 5

def test_kblock_candidates():
    # KBLOCK's blocks each add to the partial sum the block before stored: its block loop upcast computed wrong values
    def ref(x):
        a, b = x[8 * 256].reshape(8, 256), x[256 * 16].reshape(256, 16)
        return a @ b, sum_bound(256) * (np.abs(a) @ np.abs(b)) + EPS32 * np.abs(a @ b)
    t = Tensor.empty(8, 256) @ Tensor.empty(256, 16)
    assert check_candidates(t, ref, start=(Opt(OptOps.KBLOCK, 2, 64),)) > 20

def test_broadcast_reduction_candidates():
    # (a row times a broadcast vector, summed, plus a bias: the variant with 16-float vectors on an 8-float machine
    # once didn't compile)
    def ref(x):
        a, v, b = x[48 * 64].reshape(48, 64), x[64], x[48]
        return (a * v).sum(1) + b, sum_bound(65) * ((np.abs(a) * np.abs(v)).sum(1) + np.abs(b))
    t = (Tensor.empty(48, 64) * Tensor.empty(64)).sum(1) + Tensor.empty(48)
    assert check_candidates(t, ref, extend=0) > 5

@pytest.mark.slow
@pytest.mark.parametrize("name", ["softmax", "log_softmax", "matmul", "row_sum", "conv", "max_pool", "layernorm"])
def test_candidates_of_searched_kernels(name):
    # the kernels of test_search.py at their sizes and a few more, every one-action extension of the search's first
    # candidates
    def softmax(x):
        a = x[32 * 1000].reshape(32, 1000)
        e = np.exp(a - a.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True), (sum_bound(1000) + 1e-6) * e / e.sum(1, keepdims=True)
    def log_softmax(x):
        a = x[32 * 1000].reshape(32, 1000)
        m = a - a.max(1, keepdims=True)
        y = m - np.log(np.exp(m).sum(1, keepdims=True))
        return y, (sum_bound(1000) + 1e-6) * (np.abs(m) + 1)
    def matmul(x):
        a, b = x[64 * 96].reshape(64, 96), x[96 * 80].reshape(96, 80)
        return a @ b, sum_bound(96) * (np.abs(a) @ np.abs(b)) + EPS32 * np.abs(a @ b)
    def row_sum(x):
        a = x[256 * 300].reshape(256, 300)
        return a.sum(1), sum_bound(300) * np.abs(a).sum(1) + EPS32 * np.abs(a.sum(1))
    def conv(x):
        a, w = x[2 * 8 * 12 * 12].reshape(2, 8, 12, 12), x[16 * 8 * 9].reshape(16, 8, 3, 3)
        y = conv3x3(a, w)
        return y, sum_bound(72) * conv3x3(np.abs(a), np.abs(w)) + EPS32 * np.abs(y)
    def max_pool(x): return x[2 * 4 * 16 * 16].reshape(2, 4, 8, 2, 8, 2).max((3, 5)), 0.0
    def layernorm(x):
        a = x[32 * 200].reshape(32, 200)
        m, sd = a.mean(1, keepdims=True), np.sqrt(a.var(1, keepdims=True) + 1e-5)
        # (the mean's and the variance's sums both round: each moves the result by about n * eps of its magnitude)
        return (a - m) / sd, (4 * sum_bound(200) + 1e-6) * (np.abs(a - m) + np.abs(m)) / sd + 1e-6
    kernels = {"softmax": (Tensor.empty(32, 1000).softmax(-1), softmax),
               "conv": (Tensor.empty(2, 8, 12, 12).conv2d(Tensor.empty(16, 8, 3, 3), padding=1), conv),
               "max_pool": (Tensor.empty(2, 4, 16, 16).max_pool2d(2), max_pool),
               "layernorm": (Tensor.empty(32, 200).layernorm(), layernorm),
               "log_softmax": (Tensor.empty(32, 1000).log_softmax(-1), log_softmax),
               "matmul": (Tensor.empty(64, 96) @ Tensor.empty(96, 80), matmul),
               "row_sum": (Tensor.empty(256, 300).sum(1), row_sum)}
    t, ref = kernels[name]
    assert check_candidates(t, ref) > 20
