"""PyTorch on the CPU as the benchmarks compare against it: two threads (this machine's cores), and its allocations
in the state a long-running process has them in.

glibc's malloc serves a block above its mmap threshold (128 KiB at start) with a fresh mmap, whose pages fault in on
first touch and are unmapped on free; the first free of such a block raises the threshold to that block's size, and
from then on blocks up to it are reused from the heap. So torch's time for a step that allocates megabyte tensors
depended on what the process had freed before: the 784-512-10 MLP's Adam step took 3.3-3.5 ms in a fresh process and
2.3-2.4 ms after one 16 MiB tensor had been freed (the same step, its 1.6 MB gradients and Adam temporaries mapped and
faulted in every step or not). `setup()` frees one such tensor first, so every row meets torch at its faster
figure, whichever rows ran before it."""
from __future__ import annotations
import time
import torch

def setup() -> None:
    torch.set_num_threads(2)
    warm = torch.ones(4 << 20)   # 16 MiB, freed at once: raises malloc's mmap threshold to its size
    del warm

# torch's OpenMP worker keeps spinning on its core for a while after torch's last parallel call: on this machine ~4-6 ms
# of its CPU time after a block of MLP steps (fusegrad's pool spins ~0.3 ms). A block of the other side started at
# once shares the machine with that spin (the MLP TinyJit step: ~1.12 ms against ~1.0 ms alone), so each timed block
# starts after this pause, as either side would run in a process of its own
QUIESCE_S = 0.015

def quiesce() -> None:
    """Wait until the other side's idle threads have stopped spinning (see QUIESCE_S)."""
    time.sleep(QUIESCE_S)
