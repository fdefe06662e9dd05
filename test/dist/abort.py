"""Run by test/test_distributed.py under `mpirun -n 2`: rank 1 dies of an exception while rank 0 waits for it in a
collective. The excepthook that `init()` installs must abort both (mpirun exits non-zero) instead of rank 0 hanging."""
from fusegrad import Tensor
import fusegrad.distributed as dist

if __name__ == "__main__":
    dist.init()
    if dist.rank() == 1: raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(Tensor([1.0]))  # would wait forever for rank 1
    print("rank 0 was not stopped", flush=True)
