"""bfloat16 products as bfloat16 dot products (renderer/cpu_dot.py: two multiply-add steps of a register-tiled matmul
as one AVX512_BF16 vdpbf16ps where the CPU has it), against float64 NumPy and torch's bfloat16 ops: matmuls (odd K,
K not a multiple of the unroll, batched, a transposed operand whose pairs aren't adjacent), a bfloat16 linear layer's
forward and backward, a convolution; and the instruction's semantics (order of the two products, denormals) against
values worked out by hand."""
import copy
import ctypes
import os
import subprocess
import tempfile
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.device import Device, find_cc
from fusegrad.hostcpu import amx_usable, cpu
from fusegrad.renderer.cstyle import ClangRenderer

DOT = "fg_dot2_bf16x16("

def bf16(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> tuple[torch.Tensor, Tensor]:
    """The same bfloat16 values as a torch tensor and a fusegrad one."""
    t = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()
    return t, Tensor(t.float().numpy()).cast(dtypes.bfloat16).realize()

def f64(t: torch.Tensor) -> np.ndarray: return t.double().numpy()

def assert_within(got: np.ndarray, ref: np.ndarray, mags: np.ndarray, k: int, rounded: tuple = ()) -> None:
    """`got` (bfloat16 results) equals the exact `ref` up to its rounding to bfloat16 (half an ulp: 2^-8 relative),
    that of the intermediate values `rounded` to bfloat16 before it, and the float32 sum of k terms (k * 2^-24 of the
    sum of the terms' magnitudes `mags`, with a factor of 2 to spare)."""
    err = np.abs(got - ref)
    bound = 2.0 ** -8 * (np.abs(ref) + sum(np.abs(r) for r in rounded)) + k * 2.0 ** -23 * mags + 1e-30
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"at {worst}: got {got[worst]}, exact {ref[worst]}, bound {bound[worst]}"

def ren_has(flag: str) -> bool: return bool(getattr(Device["CPU"].renderer, flag, False))

@pytest.fixture
def amx(monkeypatch) -> bool:
    """The CPU renderer with AMX kernels on where this process may run them (as by default); whether it has them.
    (The shapes of the tests using it are their own: no kernel of theirs was compiled without it.)"""
    monkeypatch.setattr(Device["CPU"].renderer, "amx", amx_usable())
    return amx_usable()

# (batch, m, k, n), the path its product takes: "amx" (a whole bfloat16 matmul: every size a multiple of 32, K at most
# 4096; on AMX tiles, else as dot products of pairs in a template of its own), "dot" (a register-tiled matmul's steps
# paired into bfloat16 dot products: an even K; Tensor.dot keeps A in bfloat16 for a long K too where the renderer has
# them), or None (neither)
SHAPES = [((), 64, 128, 64, "amx"), ((), 96, 64, 160, "amx"), ((), 64, 100, 64, "dot"), ((4,), 64, 96, 48, "dot"),
          ((), 24, 34, 160, "dot"), ((), 64, 512, 96, "amx"), ((), 40, 300, 48, "dot"),
          ((), 64, 127, 64, None), ((), 33, 129, 48, None), ((2,), 40, 300, 32, None),
          ((), 8, 2, 16, None)]

WHOLE_DOT = "fg_dot_pairs_x16("

def assert_path(path: str | None, sources: list[str]) -> None:
    """The kernels compiled took `path` where the CPU has it (a CPU without AMX computes a whole matmul's products as
    dot products of pairs, in the template of its own)."""
    if path == "amx" and ren_has("amx"): assert any("tdpbf16ps" in src for src in sources)
    elif path == "amx" and ren_has("bf16_dot"): assert any(WHOLE_DOT in src for src in sources)
    elif path is not None and ren_has("bf16_dot"): assert any(DOT in src for src in sources)

@pytest.mark.parametrize("batch,m,k,n,path", SHAPES)
def test_matmul(batch, m, k, n, path, compiled_sources, amx):
    (ta, fa), (tb, fb) = bf16((*batch, m, k), 1), bf16((*batch, k, n), 2)
    out = (fa @ fb).realize()   # (alone: not with the conversion to float32 below)
    assert out.dtype == dtypes.bfloat16
    got = out.float().numpy()
    ref, mags = f64(ta) @ f64(tb), np.abs(f64(ta)) @ np.abs(f64(tb))
    assert_within(got, ref, mags, k)
    assert_within(torch.matmul(ta, tb).double().numpy(), ref, mags, k)   # (the bound holds for torch's too)
    assert_path(path, compiled_sources)

@pytest.mark.parametrize("m,k,n", [(64, 4096, 32), (128, 256, 96)])
def test_matmul_float32_out(m, k, n, compiled_sources, amx):
    # bfloat16 operands, the float32 sum stored as it is (no rounding to bfloat16)
    (ta, fa), (tb, fb) = bf16((m, k), 11), bf16((k, n), 12)
    out = fa.dot(fb, dtype=dtypes.float32)
    assert out.dtype == dtypes.float32
    ref, mags = f64(ta) @ f64(tb), np.abs(f64(ta)) @ np.abs(f64(tb))
    err = np.abs(out.numpy() - ref)
    assert np.all(err <= k * 2.0 ** -23 * mags + 1e-30), err.max()
    assert_path("amx", compiled_sources)

def test_matmul_of_views(compiled_sources, amx):
    # operands read at an offset and with a row stride of their own (slices of wider matrices)
    (ta, fa), (tb, fb) = bf16((80, 200), 13), bf16((150, 112), 14)
    got = (fa[16:80, 40:168] @ fb[5:133, 48:112]).realize().float().numpy()
    a, b = f64(ta)[16:80, 40:168], f64(tb)[5:133, 48:112]
    assert_within(got, a @ b, np.abs(a) @ np.abs(b), 128)
    assert_path("amx", compiled_sources)

def test_matmul_with_a_transposed_weight(compiled_sources, amx):
    # x @ w.T, w stored (out features, in features): B contiguous along K, its pairs packed from each column
    (tx, fx), (tw, fw) = bf16((96, 160), 22), bf16((64, 160), 23)
    got = (fx @ fw.T).realize().float().numpy()
    x, w = f64(tx), f64(tw)
    assert_within(got, x @ w.T, np.abs(x) @ np.abs(w).T, 160)
    assert_path("amx", compiled_sources)

def test_no_amx_with_more_than_the_product(compiled_sources, amx):
    # a matmul with an elementwise epilogue fused (relu, a bias) is more than the tiles compute: the usual kernel
    (ta, fa), (tb, fb), (tc, fc) = bf16((32, 96), 17), bf16((96, 64), 18), bf16((32, 64), 19)
    got = ((fa @ fb).relu() + fc).realize().float().numpy()
    xw = f64(ta) @ f64(tb)
    assert_within(got, np.maximum(xw, 0) + f64(tc), np.abs(f64(ta)) @ np.abs(f64(tb)), 96, rounded=(xw,))
    assert not any("tdpbf16ps" in src for src in compiled_sources)

def test_unpaired_where_the_scalars_are_not_adjacent(compiled_sources):
    # A read transposed: A[m, k] and A[m, k+1] lie a row apart, so no pair is one 32-bit word
    (ta, fa), (tb, fb) = bf16((96, 64), 3), bf16((96, 64), 4)
    got = (fa.T @ fb).float().numpy()
    assert_within(got, f64(ta).T @ f64(tb), np.abs(f64(ta)).T @ np.abs(f64(tb)), 96)
    assert not any(DOT in src or "tdpbf16ps" in src for src in compiled_sources)

def test_linear_forward_backward():
    (tx, fx), (tw, fw), (tb, fb) = bf16((32, 96), 5), bf16((48, 96), 6, 0.1), bf16((48,), 7)
    tg = torch.randn(32, 48, generator=torch.Generator().manual_seed(8))
    fx.requires_grad, fw.requires_grad, fb.requires_grad = True, True, True
    y = fx @ fw.T + fb
    (y.cast(dtypes.float32) * Tensor(tg.numpy())).sum().backward()
    x, w, b, g = f64(tx), f64(tw), f64(tb), f64(tg.bfloat16())   # (y's gradient arrives rounded to bfloat16)
    # (y = x @ w.T rounded to bfloat16, plus b, rounded again)
    assert_within(y.float().numpy(), x @ w.T + b, np.abs(x) @ np.abs(w).T, 96, rounded=(x @ w.T,))
    assert_within(fx.grad.float().numpy(), g @ w, np.abs(g) @ np.abs(w), 48)
    assert_within(fw.grad.float().numpy(), g.T @ x, np.abs(g).T @ np.abs(x), 32)
    assert_within(fb.grad.float().numpy(), g.sum(0), np.abs(g).sum(0), 32)

def test_conv2d():
    (tx, fx), (tw, fw) = bf16((2, 8, 10, 10), 9), bf16((16, 8, 3, 3), 10)
    got = fx.conv2d(fw, padding=1).float().numpy()
    conv = lambda a, b: torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(b), padding=1).numpy()
    assert_within(got, conv(f64(tx), f64(tw)), conv(np.abs(f64(tx)), np.abs(f64(tw))), 72)

# *** the helper's semantics, compiled with and without the instruction ***

def _helper_lib(flags: list[str], helper: str) -> ctypes.CDLL:
    """dot2(acc, a, lo, hi, out) through the register-tiled kernels' helper (`pairs`: B's rows as float32 vectors) or
    the whole-matmul template's (`packed`: B's rows packed as pairs, A's pair one 32-bit word)."""
    ren = copy.copy(ClangRenderer())
    ren._helpers = {}
    body = ["  f32x16 A, L, H;",
            "  __builtin_memcpy(&A, acc, 64); __builtin_memcpy(&L, lo, 64); __builtin_memcpy(&H, hi, 64);"]
    if helper == "pairs": body.append(f"  f32x16 R = {ren.bf16_dot_helper()}(A, a, L, H);")
    else: body += ["  unsigned int p; __builtin_memcpy(&p, a, 4);",
                   "  u32x16 B = ((u32x16)H & 0xffff0000u) | ((u32x16)L >> 16);",
                   f"  f32x16 R = {ren._dot_of_pairs()}(A, p, B);"]
    body.append("  __builtin_memcpy(out, &R, 64);")
    src = "typedef unsigned short bf16;\ntypedef float f32x16 __attribute__((vector_size(64), aligned(4)));\n" \
          "typedef unsigned int u32x16 __attribute__((vector_size(64), aligned(4)));\n" + \
          ren.render_kernel("dot2", ["const float* acc", "const bf16* a", "const float* lo", "const float* hi",
                                     "float* out"], body)
    with tempfile.TemporaryDirectory(prefix="fusegrad_bf16dot_") as folder:   # (loaded, the file isn't needed)
        so = os.path.join(folder, "dot2.so")
        subprocess.run([*find_cc(), *ClangRenderer.compile_flags, *flags, "-shared", "-fPIC", "-x", "c", "-", "-o", so],
                       input=src.encode(), check=True, capture_output=True)
        return ctypes.CDLL(so)

def _bits(x: float) -> int:
    """The bfloat16 bits of a float32 value that bfloat16 holds exactly."""
    u = int(np.float32(x).view(np.uint32))
    assert u & 0xffff == 0
    return u >> 16

def _run(lib: ctypes.CDLL, acc, a: tuple[int, int], lo, hi) -> np.ndarray:
    acc, lo, hi = (np.broadcast_to(np.asarray(v, np.float32), (16,)).copy() for v in (acc, lo, hi))
    pair, out = np.array(a, np.uint16), np.zeros(16, np.float32)
    ptr = lambda x: ctypes.c_void_p(x.ctypes.data)
    lib.dot2(ptr(acc), ptr(pair), ptr(lo), ptr(hi), ptr(out))
    return out

@pytest.mark.parametrize("helper", ["pairs", "packed"])
@pytest.mark.parametrize("instruction", [True, False])
def test_helper_semantics(instruction, helper):
    version = subprocess.run([*find_cc(), "--version"], capture_output=True, text=True).stdout
    if instruction and not (cpu().bf16_dot and "Free Software Foundation" in version and "clang" not in version):
        pytest.skip("the helper uses the instruction with GCC on a CPU with AVX512_BF16")
    lib = _helper_lib([] if instruction else ["-mno-avx512bf16"], helper)
    rng = np.random.default_rng(0)
    # random lanes: acc + a[1] * hi, then + a[0] * lo, each product exact in float32 and each sum rounded once
    for a0, a1 in ((1.0, 1.0), (3.0, -0.5), (0.0078125, 96.0)):
        acc = rng.standard_normal(16).astype(np.float32)
        lo, hi = (torch.from_numpy(rng.standard_normal(16).astype(np.float32)).bfloat16().float().numpy()
                  for _ in range(2))
        exp = (acc + np.float32(a1) * hi) + np.float32(a0) * lo
        np.testing.assert_array_equal(_run(lib, acc, (_bits(a0), _bits(a1)), lo, hi), exp)
    # the order: 1 + 1 * -1 = 0 first, then + 2^-30 (the other order rounds 1 + 2^-30 to 1 and gives 0)
    assert _run(lib, 1.0, (_bits(2.0 ** -30), _bits(1.0)), 1.0, -1.0)[0] == 2.0 ** -30
    # a bfloat16 denormal (2^-133) times 2^100, and a product of 2^-140 (a float32 denormal): the instruction reads
    # the one as zero and flushes the other to zero; IEEE arithmetic gives both
    denormal = _run(lib, 0.0, (1, 0), 2.0 ** 100, 0.0)[0]
    tiny = _run(lib, 0.0, (_bits(2.0 ** -70), 0), 2.0 ** -70, 0.0)[0]
    assert (denormal, tiny) == ((0.0, 0.0) if instruction else (2.0 ** -33, np.float32(2.0 ** -140)))

def test_amx_calls_split_anywhere():
    # one kernel run as three calls over rows [0, 17), [17, 50), [50, 96) (the cores' parts of a split): each rounds
    # its bounds down to blocks of 32 rows, so together they still compute every row once. (Without AMX the parallel
    # loop isn't the rows: the calls split its own count in the same proportions, never past its end.)
    from fusegrad.codegen import get_program
    from fusegrad.uop.ops import UOp
    from test.codegen.helpers import RENDERER, call, glob, reduce, rng
    ren = copy.copy(RENDERER)
    ren.amx = amx_usable()
    m, n, k = 96, 64, 64
    out, a, b = glob(0, dtypes.float32, m * n), glob(1, dtypes.bfloat16, m * k), glob(2, dtypes.bfloat16, k * n)
    r0, r1, r2 = rng(m, 0), rng(n, 1), rng(k, 2, "reduce")
    prod = a.index(r0 * k + r2).load().cast(dtypes.float32) * b.index(r2 * n + r1).load().cast(dtypes.float32)
    p = get_program(UOp.sink_of(out.index(r0 * n + r1).store(reduce(prod, r2))), ren)
    assert ("tdpbf16ps" in p.src) == ren.amx
    ta, tb = bf16((m, k), 15)[0], bf16((k, n), 16)[0]
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).copy()
    got = np.full(m * n, np.nan, np.float32)
    gs = p.global_size
    assert not ren.amx or gs == m
    cuts = [0, gs * 17 // m, gs * 50 // m, gs]
    call(p, [got, bits(ta), bits(tb)], splits=list(zip(cuts, cuts[1:])))
    ref, mags = f64(ta) @ f64(tb), np.abs(f64(ta)) @ np.abs(f64(tb))
    assert np.all(np.abs(got.reshape(m, n) - ref) <= k * 2.0 ** -23 * mags + 1e-30)

def test_amx_bfloat16_result_is_the_float32_one_rounded(amx, compiled_sources):
    # the same tile sums stored as float32 and rounded to bfloat16 in the kernel: equal to torch's rounding (to nearest
    # even) of the float32 result, bit for bit
    fa, fb = bf16((64, 192), 20, 30.0)[1], bf16((192, 96), 21)[1]
    f32 = fa.dot(fb, dtype=dtypes.float32).numpy()
    got = (fa @ fb).realize().float().numpy()
    np.testing.assert_array_equal(got, torch.from_numpy(f32).bfloat16().float().numpy())
    if amx: assert sum("tdpbf16ps" in src for src in compiled_sources) == 2
