"""Software prefetch of streamed short rows (codegen/prefetch.py): which kernels ask for their next rows, that what
they ask for is the next parallel iteration's rows, and that the values are NumPy's, with the last iteration's
prefetch past the end of a buffer followed by an inaccessible page."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Device, Tensor
from fusegrad.codegen import get_program
from fusegrad.dtype import dtypes
from fusegrad.renderer import ProgramSpec
from fusegrad.uop.affine import range_kind
from fusegrad.uop.ops import Ops, UOp
from test.codegen.helpers import AVX512, RENDERER, captured_asts, renderer_like

RS = np.random.default_rng(0)

def _programs(monkeypatch: pytest.MonkeyPatch, fn) -> list[ProgramSpec]:
    asts = captured_asts(monkeypatch)
    fn()
    return [get_program(ast, RENDERER) for ast in asts]

def _at(expr: UOp, values: dict[UOp, int]) -> int:
    return expr.substitute({r: UOp.const(dtypes.index, v) for r, v in values.items()}).simplify().arg

def _matvec(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x, w = RS.standard_normal((1, cols)).astype(np.float32), RS.standard_normal((rows, cols)).astype(np.float32)
    return (Tensor(x) @ Tensor(w).T).numpy(), x, w

def test_matvec_over_short_rows_prefetches_the_next_iterations_rows(monkeypatch: pytest.MonkeyPatch):
    """A decoding step's projection (768 -> 3072, rows of 3 KB): every load of the weight has a prefetch, and the
    addresses prefetched in iteration (i, j) are the ones the weight's loads read in (i + 1, j)."""
    out: list = []
    (p,) = _programs(monkeypatch, lambda: out.append(_matvec(3072, 768)))
    got, x, w = out[0]
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    prefetches = [u for u in p.uops if u.op is Ops.PREFETCH]
    weight = next(u for u in p.uops if u.op is Ops.DEFINE_GLOBAL and u.dtype.size == w.size)
    loads = [u for u in p.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and u.src[0].src[0] is weight]
    assert len(prefetches) == len(loads) >= 1
    assert "__builtin_prefetch" in p.src
    outer, inner = sorted([u for u in p.uops if u.op is Ops.RANGE], key=lambda r: range_kind(r) != "global")
    for i, j in [(0, 0), (5, 17), (100, 3)]:
        asked = sorted(_at(f.src[0].src[1], {outer: i, inner: j}) for f in prefetches)
        read_next = sorted(_at(ld.src[0].src[1], {outer: i + 1, inner: j}) for ld in loads)
        assert asked == read_next

@pytest.mark.parametrize("case", ["long_rows", "small_weight", "matmul"])
def test_no_prefetch_where_the_rows_stay_in_cache_or_the_hardware_follows(monkeypatch: pytest.MonkeyPatch, case: str):
    """Rows of 12 KB (3072 floats: the hardware's prefetcher follows them), a weight under 2 MB (in cache), a matmul of
    64 rows (its weight rows are read again by other rows): no prefetch."""
    x_rows, rows, cols = {"long_rows": (1, 768, 3072), "small_weight": (1, 256, 768), "matmul": (64, 3072, 768)}[case]
    x, w = RS.standard_normal((x_rows, cols)).astype(np.float32), RS.standard_normal((rows, cols)).astype(np.float32)
    out: list = []
    programs = _programs(monkeypatch, lambda: out.append((Tensor(x) @ Tensor(w).T).numpy()))
    np.testing.assert_allclose(out[0], x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-3)
    assert programs and not any(u.op is Ops.PREFETCH for p in programs for u in p.uops)

def test_prefetch_past_the_end_of_a_guarded_buffer(monkeypatch: pytest.MonkeyPatch):
    """GUARD_PAGES=1 puts an inaccessible page right after each buffer: the last rows' prefetch asks for addresses
    there, which a prefetch may (a load would stop the process)."""
    import fusegrad.runtime.cpu_memory as cpu_memory
    monkeypatch.setattr(cpu_memory, "GUARD_PAGES", 1)
    got, x, w = _matvec(2732, 768)   # (a size no earlier test allocated: the buffers are new, guarded ones)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)

def test_llvm_renders_the_prefetch(monkeypatch: pytest.MonkeyPatch):
    x, w = RS.standard_normal((1, 768)).astype(np.float32), RS.standard_normal((3072, 768)).astype(np.float32)
    asts = captured_asts(monkeypatch)
    got = (Tensor(x, device="LLVM") @ Tensor(w, device="LLVM").T).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)
    src = get_program(asts[-1], Device["LLVM"].renderer).src
    assert "@llvm.prefetch.p0" in src

def _input_gradient(n: int, c: int, hw: int) -> tuple[np.ndarray, np.ndarray]:
    """The input gradient of sum(conv2d(x, w, padding=1) * g) for c -> c channels over hw x hw images: fusegrad's and
    torch's."""
    import torch
    x = RS.standard_normal((n, c, hw, hw)).astype(np.float32)
    w = (RS.standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32)
    g = RS.standard_normal((n, c, hw, hw)).astype(np.float32)
    xt = Tensor(x, requires_grad=True)
    (xt.conv2d(Tensor(w), padding=1) * Tensor(g)).sum().backward()
    tx = torch.tensor(x, requires_grad=True)
    (torch.nn.functional.conv2d(tx, torch.tensor(w), padding=1) * torch.tensor(g)).sum().backward()
    assert xt.grad is not None and tx.grad is not None
    return xt.grad.numpy(), tx.grad.numpy()

def test_copy_of_rows_far_apart_prefetches_rows_ahead(monkeypatch: pytest.MonkeyPatch):
    """A convolution's input gradient over 2x2 images (256 channels: 2.4 MB of weights) packs its weight panel a row
    of 16 channels x 9 taps per input channel, rows 9 KB apart: each load of the copy has a prefetch, in the row
    loop's body (outside the copy's inner loops), of what that load reads COPY_AHEAD rows later at the inner loops'
    start. The kernel as shaped for AVX-512 (the host's shapes may differ); values against torch on this machine."""
    from fusegrad.codegen.prefetch import COPY_AHEAD
    asts = captured_asts(monkeypatch)
    ours, ref = _input_gradient(4, 256, 2)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
    programs = [get_program(ast, renderer_like(AVX512)) for ast in asts]
    p = next(p for p in programs if any(u.op is Ops.RANGE and range_kind(u) == "copy" for u in p.uops))
    copies = [u for u in p.uops if u.op is Ops.RANGE and range_kind(u) == "copy"]
    fetches = [u for u in p.uops if u.op is Ops.PREFETCH]
    assert fetches and "__builtin_prefetch" in p.src
    row = copies[0]
    # (the loops outside the copy at their second iteration, the copy's inner loops at their first)
    fixed = {r: 1 for r in p.uops if r.op is Ops.RANGE and r not in copies} | {r: 0 for r in copies[1:]}
    loads = [u for u in p.uops if u.op is Ops.LOAD and u.src[0].op is Ops.INDEX and
             u.src[0].src[0].op is Ops.DEFINE_GLOBAL and row in u.src[0].src[1].toposort()]
    for f in fetches:
        assert row in f.src[0].src[1].toposort() and not any(r in f.src[0].src[1].toposort() for r in copies[1:])
    for i in (0, 3):
        asked = sorted(_at(f.src[0].src[1], {**fixed, row: i}) for f in fetches)
        read_later = sorted({_at(ld.src[0].src[1], {**fixed, row: i + COPY_AHEAD}) for ld in loads})
        assert asked == read_later

def test_copy_of_a_small_weight_has_no_prefetch(monkeypatch: pytest.MonkeyPatch):
    """64 channels (147 KB of weights, in cache): no prefetch."""
    out: list = []
    programs = _programs(monkeypatch, lambda: out.append(_input_gradient(4, 64, 2)))
    np.testing.assert_allclose(out[0][0], out[0][1], rtol=1e-4, atol=1e-4)
    assert programs and not any(u.op is Ops.PREFETCH for p in programs for u in p.uops)
