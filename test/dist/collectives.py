"""Run by test/test_distributed.py under `mpirun -n 2`: every collective against NumPy, then the errors for bad input.

Each rank's input is a function of (rank, case) only, so every rank can compute every other rank's input and the
expected result with NumPy. Any failed check raises, which aborts all ranks (the test sees mpirun fail)."""
import numpy as np
from fusegrad import Tensor, TinyJit, dtypes
import fusegrad.distributed as dist

def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even), kept as float32."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)

# name -> (fusegrad dtype, numpy dtype of the values, make(rng, shape))
DTYPES = {
    "float32": (dtypes.float32, np.float32, lambda g, s: g.standard_normal(s).astype(np.float32)),
    "float64": (dtypes.float64, np.float64, lambda g, s: g.standard_normal(s)),
    "int32": (dtypes.int32, np.int32, lambda g, s: g.integers(-1000, 1000, s).astype(np.int32)),
    "int64": (dtypes.int64, np.int64, lambda g, s: g.integers(-2**40, 2**40, s)),
    "uint8": (dtypes.uint8, np.uint8, lambda g, s: g.integers(0, 100, s).astype(np.uint8)),
    "int8": (dtypes.int8, np.int8, lambda g, s: g.integers(-60, 60, s).astype(np.int8)),
    "float16": (dtypes.float16, np.float16, lambda g, s: g.standard_normal(s).astype(np.float16)),
    # multiples of 1/8 below 16 in magnitude: bfloat16 holds them and the sum of two exactly
    "bfloat16": (dtypes.bfloat16, np.float32, lambda g, s: (g.integers(-100, 100, s) / 8).astype(np.float32)),
    "bool": (dtypes.bool, np.bool_, lambda g, s: g.integers(0, 2, s).astype(bool)),
}
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3)]

def data(r: int, name: str, shape: tuple, case: int) -> np.ndarray:
    rng = np.random.default_rng([r, case, len(shape), *shape, list(DTYPES).index(name)])
    return np.asarray(DTYPES[name][2](rng, shape))

def tensor(a: np.ndarray, name: str) -> Tensor:
    dt = DTYPES[name][0]
    return Tensor(a).cast(dt) if name == "bfloat16" else Tensor(a, dtype=dt)

def values(t: Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == dtypes.bfloat16 else t.numpy()

def expect(got: Tensor, want: np.ndarray, dtype, what: str) -> None:
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    g = values(got)
    assert g.shape == want.shape, f"{what}: shape {g.shape}, expected {want.shape}"
    if np.issubdtype(want.dtype, np.floating):
        np.testing.assert_allclose(g.astype(np.float64), want.astype(np.float64), rtol=1e-6, atol=0, err_msg=what)
    else: np.testing.assert_array_equal(g, want, err_msg=what)

def check_collectives(me: int, n: int) -> int:
    checks = 0
    for name, (dt, npdt, _) in DTYPES.items():
        for case, shape in enumerate(SHAPES):
            ins = [data(r, name, shape, case) for r in range(n)]
            mine = ins[me]
            wide = name in ("float16", "bfloat16")
            acc = np.float32 if wide else npdt
            stack = np.stack([a.astype(acc) for a in ins])
            def narrow(x: np.ndarray) -> np.ndarray:
                # half precision is reduced in float32, then rounded once
                return x.astype(np.float16) if name == "float16" else bf16_round(x) if name == "bfloat16" else x
            what = f"{name} {shape}"
            if name != "bool":
                expect(dist.all_reduce(tensor(mine, name), "sum"), narrow(stack.sum(0, dtype=acc)), dt, f"sum {what}")
                mean_dt = dt if dtypes.is_float(dt) else dtypes.float32
                mean = stack.sum(0, dtype=acc).astype(np.float32 if mean_dt == dtypes.float32 else acc) / np.array(n)
                mean = narrow(mean.astype(np.float32 if mean_dt == dtypes.float32 else acc))
                expect(dist.all_reduce(tensor(mine, name), "mean"), mean, mean_dt, f"mean {what}")
                inplace = tensor(mine, name).contiguous().realize()
                assert dist.all_reduce_(inplace, "sum") is inplace
                expect(inplace, narrow(stack.sum(0, dtype=acc)), dt, f"in-place sum {what}")
                checks += 3
            want_max = narrow(stack.max(0)) if stack.size else stack.reshape(shape)
            expect(dist.all_reduce(tensor(mine, name), "max"), want_max.astype(npdt), dt, f"max {what}")
            for root in range(n):
                expect(dist.broadcast(tensor(mine, name), root), ins[root], dt, f"broadcast from {root} {what}")
                inplace = tensor(mine, name).contiguous().realize()
                assert dist.broadcast_(inplace, root) is inplace
                expect(inplace, ins[root], dt, f"in-place broadcast from {root} {what}")
            gathered = np.stack(ins) if shape == () else np.concatenate(ins, axis=0)
            expect(dist.all_gather(tensor(mine, name)), gathered, dt, f"all_gather {what}")
            checks += 2 + 2 * n
    # inputs that are lazy views (a transpose, a slice): realized into a buffer of their own first
    base = [np.arange(12, dtype=np.float32).reshape(3, 4) * (r + 1) for r in range(n)]
    expect(dist.all_reduce(Tensor(base[me]).T[1:], "sum"), sum(base).T[1:], dtypes.float32, "sum of a view")
    expect(dist.all_gather(Tensor(base[me])[:, ::2]), np.concatenate([b[:, ::2] for b in base]), dtypes.float32,
           "all_gather of a view")
    # an in-place reduce of a lazy tensor realizes it first
    lazy = Tensor(base[me]) * 2
    expect(dist.all_reduce_(lazy, "mean"), sum(base) * 2 / n, dtypes.float32, "in-place mean of a lazy tensor")
    # without the cross-rank argument check
    expect(dist.all_reduce(Tensor(base[me]), "max", check=False), np.maximum.reduce(base), dtypes.float32,
           "max, check=False")
    expect(dist.all_gather(Tensor(base[me]), check=False), np.concatenate(base), dtypes.float32,
           "all_gather, check=False")
    expect(dist.broadcast(Tensor(base[me]), n - 1, check=False), base[n - 1], dtypes.float32, "broadcast, check=False")
    dist.barrier()
    return checks + 7

def check_jit(me: int, n: int) -> int:
    """Collectives inside TinyJit are replayed with its kernels: every call gives this call's result."""
    @TinyJit
    def step(x: Tensor) -> tuple[Tensor, Tensor]:
        dist.barrier()
        return dist.all_reduce(x * 2, "sum") + 1, dist.all_gather(x)

    for i in range(5):
        ins = [np.full((2, 3), 10 * i + r, dtype=np.float32) + np.arange(6, dtype=np.float32).reshape(2, 3)
               for r in range(n)]
        total, gathered = step(Tensor(ins[me]))
        expect(total, sum(2 * a for a in ins) + 1, dtypes.float32, f"jitted all_reduce call {i}")
        expect(gathered, np.concatenate(ins), dtypes.float32, f"jitted all_gather call {i}")
    assert len(step.captured) >= 3, "the capture should hold the MPI steps as well as the kernels"
    return 10

def raises(exc: type, fragments: list[str], fn, *args, **kwargs) -> None:
    try: fn(*args, **kwargs)
    except exc as e:
        for f in fragments: assert f in str(e), f"message {str(e)!r} lacks {f!r}"
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")

def check_errors(me: int, n: int) -> int:
    x = Tensor([1.0, 2.0])
    raises(ValueError, ["unknown reduction 'prod'", "sum, mean, max"], dist.all_reduce, x, "prod")
    raises(ValueError, ["unknown reduction"], dist.all_reduce_, x.contiguous().realize(), "min")
    raises(TypeError, ["bool", "cast it to an integer"], dist.all_reduce, Tensor([True, False]), "sum")
    raises(TypeError, ["takes a Tensor", "list"], dist.all_reduce, [1.0, 2.0])
    raises(TypeError, ["can't hold the quotient"], dist.all_reduce_, Tensor([1, 2]).contiguous().realize(), "mean")
    raises(ValueError, ["root must be a rank in 0..", "got 5"], dist.broadcast, x, 5)
    raises(ValueError, ["got -1"], dist.broadcast_, x, -1)
    # arguments that differ between ranks: every rank raises, naming each rank's shapes
    raises(ValueError, ["the ranks' arguments differ", "rank 0:", "(3,)", "(4,)"], dist.all_reduce,
           Tensor.ones(3 + me), "sum")
    raises(ValueError, ["rank 1:", "float", "int"], dist.all_gather, Tensor.ones(2, dtype=dtypes.int32 if me else
                                                                                  dtypes.float32))
    raises(ValueError, ["the ranks' arguments differ"], dist.broadcast, x, me)
    raises(ValueError, ["the ranks' arguments differ"], dist.all_reduce, x, "sum" if me else "max")
    # the ranks are still in step after all that
    expect(dist.all_reduce(Tensor([float(me)]), "sum"), np.array([sum(range(n))], np.float32), dtypes.float32,
           "after the errors")
    return 12

if __name__ == "__main__":
    dist.init()
    me, n = dist.rank(), dist.world_size()
    assert n >= 2, "run under mpirun -n 2"
    count = check_collectives(me, n) + check_jit(me, n) + check_errors(me, n)
    print(f"rank {me}/{n}: {count} checks passed", flush=True)
