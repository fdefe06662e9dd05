"""Run by test/test_distributed.py under `mpirun -n 2` with a mode: rank 1 leaves in that way while rank 0 waits for
it in a collective (or reaches one later). The job must end within seconds with a non-zero status instead of rank 0
waiting forever. Rank 1 prints the time it leaves, so the test can tell how long the job took to end after that.

The modes "end0" and "end3" are jobs that finish normally (rank 1 calls sys.exit after the last collective): they must
end with status 0 and 3."""
import os
import signal
import sys
import time
from fusegrad import Tensor
import fusegrad.distributed as dist

def leave(mode: str) -> None:
    print(f"rank 1 leaves ({mode}) at {time.time():.3f}", flush=True)
    if mode in ("exit0", "late"): sys.exit(0)
    if mode == "exit3": sys.exit(3)
    if mode == "os_exit": os._exit(0)
    if mode == "sigterm": os.kill(os.getpid(), signal.SIGTERM)
    if mode == "sigkill": os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(f"unknown mode {mode}")

if __name__ == "__main__":
    mode = sys.argv[1]
    dist.init()
    me = dist.rank()
    assert dist.all_reduce(Tensor([1.0])).tolist() == [2.0]
    if mode.startswith("end"):
        print(f"rank {me} finished", flush=True)
        if me == 1: sys.exit(int(mode[3:]))
        sys.exit(0)
    if me == 1:
        time.sleep(0.5)  # rank 0 is waiting in its all_reduce by now
        leave(mode)
    if mode == "late":
        time.sleep(1.0)  # rank 1 is gone before this rank's next collective
        dist.barrier()
    else: dist.all_reduce(Tensor([1.0]))
    print("rank 0 was not stopped", flush=True)
