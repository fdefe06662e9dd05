"""Finds, on a Hopper GPU (sm_90), how `wgmma.mma_async` reads its operands: one 64x64x16 half product per layout
variant, its result against numpy. A step toward tensor cores through wgmma (the H100/H200's matrix instruction, which
cuBLAS uses: mma.sync, what the CUDA renderer emits, reaches about a third of its rate), run in a GPU session's first
call before the renderer and the PYTHON emulation are written to the layouts it confirms.

The kernel is hand-written here, not rendered: a warpgroup (4 warps, 128 threads) computes D = A @ B, A (64x16) from
registers, B (16x64) from shared memory through a matrix descriptor. What each variant assumes, and the probe checks:
- A's registers: warp w holds rows 16w..16w+15 in mma.sync m16n8k16's A layout (lane l: rows l/4 and l/4 + 8, columns
  2(l%4) + {0, 1} and those + 8, two halves per 32-bit register);
- D: warp w's rows 16w + l/4 + 8 * (i/2 % 2), columns 8 * (i/4) + 2(l%4) + i%2 for its i-th float (mma.sync's C
  layout repeated along N);
- B in shared memory without swizzling: 8x8 core matrices of 16 bytes a row, each 128 contiguous bytes; K-major
  (trans-b 0: a core matrix's rows are 8 columns n of B, each 8 elements along K) or MN-major (trans-b 1: its rows
  are 8 rows k, each 8 elements along N); the descriptor's two byte offsets (bits 16-29 and 32-45, in units of 16
  bytes) are the strides between neighbouring core matrices along K and along N, in one order or the other.
The variant whose result matches numpy (to half-precision products summed in float32) names the layout.

Run on a machine with an H100 or H200: python bench/wgmma_probe.py  (NVRTC compiles for sm_90a: wgmma is not in
plain sm_90). Without a GPU, `--dry` only compiles each variant."""
from __future__ import annotations
import argparse
import itertools
import numpy as np

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(128) probe(float* __restrict__ out, const unsigned int* __restrict__ a,
                                                       const unsigned short* __restrict__ b) {
  // (16 KiB, zeros past B's image: a variant whose offsets the hardware reads otherwise stays inside it)
  __shared__ __align__(128) unsigned short sb[8192];
  for (int i = threadIdx.x; i < 8192; i += 128) sb[i] = i < %(B_ELEMS)d ? b[i] : 0;
  // (the tensor cores read shared memory through the async proxy: stores made by threads are fenced for it)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  unsigned int ra[4];
  for (int i = 0; i < 4; i++) ra[i] = a[threadIdx.x * 4 + i];
  float d[32];
  for (int i = 0; i < 32; i++) d[i] = 0.0f;
  unsigned long long addr = (unsigned long long)__cvta_generic_to_shared(sb);
  unsigned long long desc = ((addr & 0x3FFFFull) >> 4) | ((unsigned long long)(%(LBO)d >> 4) << 16) |
                            ((unsigned long long)(%(SBO)d >> 4) << 32);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("{\n"
    "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
    "{%%0,%%1,%%2,%%3,%%4,%%5,%%6,%%7,%%8,%%9,%%10,%%11,%%12,%%13,%%14,%%15,"
    "%%16,%%17,%%18,%%19,%%20,%%21,%%22,%%23,%%24,%%25,%%26,%%27,%%28,%%29,%%30,%%31}, "
    "{%%32,%%33,%%34,%%35}, %%36, 1, 1, 1, %(TRANS_B)d;\n}\n"
    : "+f"(d[0]),"+f"(d[1]),"+f"(d[2]),"+f"(d[3]),"+f"(d[4]),"+f"(d[5]),"+f"(d[6]),"+f"(d[7]),
      "+f"(d[8]),"+f"(d[9]),"+f"(d[10]),"+f"(d[11]),"+f"(d[12]),"+f"(d[13]),"+f"(d[14]),"+f"(d[15]),
      "+f"(d[16]),"+f"(d[17]),"+f"(d[18]),"+f"(d[19]),"+f"(d[20]),"+f"(d[21]),"+f"(d[22]),"+f"(d[23]),
      "+f"(d[24]),"+f"(d[25]),"+f"(d[26]),"+f"(d[27]),"+f"(d[28]),"+f"(d[29]),"+f"(d[30]),"+f"(d[31])
    : "r"(ra[0]),"r"(ra[1]),"r"(ra[2]),"r"(ra[3]),"l"(desc));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int i = 0; i < 32; i++) out[threadIdx.x * 32 + i] = d[i];
}
"""
M, N, K = 64, 64, 16

def a_registers(a: np.ndarray) -> np.ndarray:
    """A (64x16 half) as each thread's 4 registers of two halves (the lower index in the low half)."""
    regs = np.zeros((128, 8), np.float16)
    for t in range(128):
        w, lane = divmod(t, 32)
        r, c = 16 * w + lane // 4, 2 * (lane % 4)
        regs[t] = [a[r, c], a[r, c + 1], a[r + 8, c], a[r + 8, c + 1],
                   a[r, c + 8], a[r, c + 9], a[r + 8, c + 8], a[r + 8, c + 9]]
    return regs.view(np.uint32)

def d_matrix(out: np.ndarray) -> np.ndarray:
    """D (64x64 float32) from each thread's 32 floats."""
    d = np.full((M, N), np.nan, np.float32)
    for t, i in itertools.product(range(128), range(32)):
        w, lane = divmod(t, 32)
        d[16 * w + lane // 4 + 8 * (i // 2 % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2] = out[t * 32 + i]
    return d

def b_image(b: np.ndarray, trans_b: int, stride_k: int, stride_n: int) -> np.ndarray:
    """B (16x64 half) laid out in shared memory as 8x8 core matrices (128 bytes each), the core matrix of rows k0 and
    columns n0 at byte (k0 / 8) * stride_k + (n0 / 8) * stride_n."""
    img = np.zeros(max(stride_k * (K // 8 - 1) + stride_n * (N // 8 - 1) + 128, 128) // 2, np.float16)
    for k, n in itertools.product(range(K), range(N)):
        core = (k // 8) * stride_k + (n // 8) * stride_n
        inner = (n % 8) * 16 + (k % 8) * 2 if trans_b == 0 else (k % 8) * 16 + (n % 8) * 2
        img[(core + inner) // 2] = b[k, n]
    return img

def variants() -> list[tuple[str, int, int, int, int, int]]:
    """(label, trans_b, stride along K, stride along N, the descriptor's first offset, its second)."""
    out = []
    for trans_b, (sk, sn) in itertools.product((0, 1), ((128, 256), (1024, 128))):
        for first, second, order in ((sk, sn, "K then N"), (sn, sk, "N then K")):
            out.append((f"trans_b={trans_b} core strides K {sk} N {sn}, offsets {order}", trans_b, sk, sn,
                        first, second))
    return out

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="compile each variant for sm_90a (no GPU), don't run")
    args = ap.parse_args()
    from fusegrad.runtime.ops_cuda import CUDACompiler
    rng = np.random.default_rng(0)
    a = rng.standard_normal((M, K)).astype(np.float16)
    b = rng.standard_normal((K, N)).astype(np.float16)
    want = a.astype(np.float32) @ b.astype(np.float32)
    compiler = CUDACompiler("sm_90a")
    if not args.dry:
        from fusegrad import Device
        if (arch := Device["CUDA"].arch) != "sm_90":
            print(f"a {arch} GPU has no wgmma: nothing to probe")
            return
    for label, trans_b, sk, sn, lbo, sbo in variants():
        img = b_image(b, trans_b, sk, sn)
        src = KERNEL % dict(B_ELEMS=len(img), LBO=lbo, SBO=sbo, TRANS_B=trans_b)
        lib = compiler.compile(src)
        if args.dry:
            print(f"{label:60s} compiled ({len(lib)} bytes)")
            continue
        from fusegrad import dtypes
        from fusegrad.device import Buffer
        from fusegrad.runtime.ops_cuda import CUDAProgram
        dev = Device["CUDA"]
        prog = CUDAProgram(dev, "probe", lib)
        bufs = [Buffer("CUDA", 128 * 32, dtypes.float32).ensure_allocated(),
                Buffer("CUDA", 128 * 4, dtypes.uint32).ensure_allocated(),
                Buffer("CUDA", len(img), dtypes.uint16).ensure_allocated()]
        bufs[0].copyin(memoryview(np.full(128 * 32, np.nan, np.float32).tobytes()))
        bufs[1].copyin(memoryview(a_registers(a).tobytes()))
        bufs[2].copyin(memoryview(img.view(np.uint16).tobytes()))
        prog(*[x._buf for x in bufs], global_dims=(1,), local_dims=(128,), wait=True)
        got = d_matrix(np.frombuffer(bufs[0].as_buffer(), np.float32))
        err = float(np.nanmax(np.abs(got - want)) / np.abs(want).max()) if not np.isnan(got).all() else float("nan")
        same_values = np.allclose(np.sort(got, axis=None), np.sort(want, axis=None), rtol=1e-3, atol=1e-3)
        print(f"{label:60s} {'MATCH' if err < 1e-3 else 'differs':8s} max error {err:.2e}"
              f"{' (the right values, elsewhere: D or A layout)' if err >= 1e-3 and same_values else ''}")

if __name__ == "__main__":
    main()
