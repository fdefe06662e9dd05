"""Run by test/test_distributed.py under `mpirun -n 2`: the ranks call collectives that don't match (sizes, dtypes,
ops, roots, kinds; with and without check, eagerly and from a TinyJit replay). Each must raise ValueError on both
ranks, naming what each rank called, before any data moves: no crash, no hang, no mix of the two ranks' data. The
ranks stay in step, so each case runs after the last."""
import numpy as np
from fusegrad import Tensor, TinyJit, dtypes
import fusegrad.distributed as dist

def raises(fragments: list[str], fn, *args, **kwargs) -> None:
    try: got = fn(*args, **kwargs)
    except ValueError as e:
        for f in fragments: assert f in str(e), f"message {str(e)!r} lacks {f!r}"
        return
    raise AssertionError(f"{fn.__name__}{args} returned {got.numpy() if isinstance(got, Tensor) else got} "
                         "instead of raising ValueError")

def ones(n: int) -> Tensor: return Tensor(np.arange(1, n + 1, dtype=np.float32))

def check_sizes(me: int) -> int:
    # without the argument check the element counts are still compared: 4 vs 5 used to return a mix of both ranks'
    # data, 1000 vs 100000 to write past the smaller buffer's end
    for small, big in ((4, 5), (1000, 100000)):
        n = big if me else small
        raises(["all_reduce", "the ranks' arguments differ", f"rank 0: all_reduce(op=sum, shape=({small},)",
                f"rank 1: all_reduce(op=sum, shape=({big},)"], dist.all_reduce, ones(n), check=False)
        mine = ones(n).contiguous().realize()
        raises([f"shape=({small},)", f"shape=({big},)"], dist.all_reduce_, mine, check=False)
        np.testing.assert_array_equal(mine.numpy(), np.arange(1, n + 1, dtype=np.float32),
                                      err_msg="all_reduce_ wrote its tensor despite the size mismatch")
        raises(["broadcast", f"shape=({small},)", f"shape=({big},)"], dist.broadcast, ones(n), 0, check=False)
        raises(["broadcast", f"shape=({small},)"], dist.broadcast_, ones(n).contiguous().realize(), 1, check=False)
        raises(["all_gather", f"shape=({small},)", f"shape=({big},)"], dist.all_gather, ones(n), check=False)
    # an empty tensor against a full one (the empty side used to skip MPI altogether, leaving the other waiting)
    raises(["shape=(0,)", "shape=(3,)"], dist.all_reduce, ones(3 * me), check=False)
    raises(["shape=(0,)", "shape=(3,)"], dist.broadcast, ones(3 * me), check=False)
    # the same size with another dtype, op or root: each would silently give wrong values
    raises(["dtype=dtypes.float32", "dtype=dtypes.int32"], dist.all_reduce,
           Tensor([1, 2], dtype=dtypes.int32 if me else dtypes.float32), check=False)
    raises(["op=sum", "op=max"], dist.all_reduce, ones(3), "max" if me else "sum", check=False)
    raises(["root=0", "root=1"], dist.broadcast, ones(3), me, check=False)
    raises(["dtype=dtypes.float16", "dtype=dtypes.bfloat16"], dist.all_reduce,
           ones(2).cast(dtypes.bfloat16 if me else dtypes.half), check=False)
    return 20

def check_kinds(me: int) -> int:
    # a barrier against an all_reduce, a broadcast against an all_reduce...: each used to hang
    both = ["the ranks called different collectives"]
    raises(both + ["rank 0: barrier()", "rank 1: all_reduce(op=sum, shape=(2,), dtype=dtypes.float32)"],
           *((dist.all_reduce, ones(2)) if me else (dist.barrier,)))
    raises(both + ["rank 0: all_reduce(", "rank 1: barrier()"],
           *((dist.barrier,) if me else (dist.all_reduce, ones(2))))
    raises(both + ["rank 0: broadcast(root=0", "rank 1: all_reduce("],
           *((dist.all_reduce, ones(2)) if me else (dist.broadcast, ones(2))))
    raises(both + ["all_gather(", "broadcast("], *((dist.all_gather, ones(2)) if me else (dist.broadcast_, ones(2))),
           check=False)
    raises(both + ["barrier()", "all_gather("], *((dist.barrier,) if me else (dist.all_gather, ones(2))))
    return 5

def check_shapes(me: int) -> int:
    a = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(6, 12, dtype=np.float32).reshape(3, 2)]
    # checked: the shapes must agree
    raises(["shape=(2, 3)", "shape=(3, 2)"], dist.all_reduce, Tensor(a[me]))
    # unchecked: the same number of elements in other shapes is allowed, element by element in row-major order
    got = dist.all_reduce(Tensor(a[me]), check=False).numpy()
    np.testing.assert_array_equal(got, (a[0].ravel() + a[1].ravel()).reshape(a[me].shape))
    # one rank checking and the other not, with equal arguments, agree
    got = dist.all_reduce(Tensor(a[0]), check=bool(me)).numpy()
    np.testing.assert_array_equal(got, 2 * a[0])
    return 3

def check_replay(me: int) -> int:
    # a TinyJit replay compares its collectives with the other ranks too, unchecked ones included
    @TinyJit
    def step(x: Tensor) -> Tensor: return dist.all_reduce(x * 2, check=False)
    for i in range(3):
        np.testing.assert_array_equal(step(ones(4).contiguous().realize()).numpy(), 4 * np.arange(1, 5), f"call {i}")
    if me: raises(["shape=(4,)", "shape=(5,)"], dist.all_reduce, ones(5), check=False)
    else: raises(["shape=(4,)", "shape=(5,)"], step, ones(4).contiguous().realize())
    return 2

if __name__ == "__main__":
    dist.init()
    me, n = dist.rank(), dist.world_size()
    assert n == 2, "run under mpirun -n 2"
    count = check_sizes(me) + check_kinds(me) + check_shapes(me) + check_replay(me)
    # still in step after every error
    np.testing.assert_array_equal(dist.all_reduce(Tensor([float(me)])).numpy(), [1.0])
    print(f"rank {me}/{n}: {count + 1} mismatch checks passed", flush=True)
