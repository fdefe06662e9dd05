"""Run by test/test_distributed.py under `mpirun -n 2` (or as one process): the collectives of a short program with
PROFILE on, each rank's Chrome trace saved as <dir>/rank<r>.json for the test to read."""
import os
import sys
import numpy as np
from fusegrad import Tensor, TinyJit
import fusegrad.distributed as dist
from fusegrad.viz import record

out_dir = sys.argv[1]
r, n = dist.rank(), dist.world_size()
record.recorder.reset()
record.enable(profile=True)
x = Tensor(np.arange(1000, dtype=np.float32) + r)
want = sum(np.arange(1000, dtype=np.float32) + k for k in range(n))
np.testing.assert_array_equal(dist.all_reduce(x).numpy(), want)
np.testing.assert_array_equal(dist.all_reduce(x, "max").numpy(), np.arange(1000, dtype=np.float32) + n - 1)
np.testing.assert_array_equal(dist.broadcast(Tensor(np.full(10, r, dtype=np.int32)), root=n - 1).numpy(), n - 1)
np.testing.assert_array_equal(dist.all_gather(Tensor([float(r)] * 3)).numpy(), np.repeat(np.arange(n), 3))
dist.barrier()
y = Tensor(np.ones(64, dtype=np.float64) * (r + 1)).contiguous().realize()
dist.all_reduce_(y)
np.testing.assert_array_equal(y.numpy(), n * (n + 1) / 2)

@TinyJit
def step(t: Tensor) -> Tensor: return dist.all_reduce(t * 2)
for i in range(3): np.testing.assert_array_equal(step(Tensor([1.0, float(i)])).numpy(), [2.0 * n, 2.0 * i * n])
record.enable(profile=False)
record.save_profile(os.path.join(out_dir, f"rank{r}.json"))
print(f"rank {r}/{n}: profile saved", flush=True)
