"""Host memory for the CPU devices: 64-byte aligned allocations (2 MiB aligned and advised for huge pages when big),
held as ctypes arrays that kernels take directly and that host access reaches once the queued kernels using them
have run."""
from __future__ import annotations
import ctypes
import functools
import sys
import weakref
from typing import Any
from fusegrad.device import LRUAllocator
from fusegrad.helpers import getenv
from fusegrad.runtime.cpu_pool import c_pool, has_host_view, wait_for

ALIGN = 64  # bytes: a cache line, and enough for any SIMD load the renderer emits

def _libc_allocator() -> tuple[Any, Any, Any] | None:
    try:
        libc = ctypes.CDLL(None)
        alloc, free = libc.aligned_alloc, libc.free
    except (OSError, AttributeError): return None
    alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]
    free.restype, free.argtypes = None, [ctypes.c_void_p]
    madvise = getattr(libc, "madvise", None)
    if madvise is not None:
        madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return alloc, free, madvise

# big allocations are aligned to and advised for 2 MiB pages (MADV_HUGEPAGE, Linux; where transparent huge pages are
# off it changes nothing): 512 times fewer TLB entries and first-touch page faults for a kernel streaming through tens
# of megabytes (a fused elementwise kernel over 2^24 floats: about 8% faster)
HUGE_PAGE, HUGE_MIN, MADV_HUGEPAGE = 1 << 21, 1 << 22, 14

_LIBC = _libc_allocator()

# GUARD_PAGES=1: every allocation ends where an inaccessible page begins, so a kernel that reads or writes past the end
# of a buffer stops at once with SIGSEGV (a debugging mode for code generation: an access out of bounds otherwise
# reads a neighbour's values or corrupts the heap, and shows up, if ever, far from the kernel). The end is exact up to
# ALIGN bytes (GUARD_PAGES=2: to the byte, the start then unaligned, which the kernels' loads and stores allow on x86);
# before the start, an access stops once it passes the rest of the buffer's first page. Each allocation
# is a mapping of its own of at least three pages (a debugging mode: slower, and bounded by the OS's map count).
GUARD_PAGES = getenv("GUARD_PAGES", 0)
PAGE = 4096
PROT_NONE, PROT_RW, MAP_PRIVATE_ANONYMOUS = 0, 3, 0x22

@functools.cache
def _guarded_allocator() -> tuple[Any, Any, Any] | None:
    try:
        libc = ctypes.CDLL(None)
        mmap, mprotect, munmap = libc.mmap, libc.mprotect, libc.munmap
    except (OSError, AttributeError): return None
    mmap.restype = ctypes.c_void_p
    mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mprotect.restype, mprotect.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    munmap.restype, munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    return mmap, mprotect, munmap

def _guarded_alloc(size: int) -> ctypes.Array:
    """`size` bytes between two inaccessible pages, ending ALIGN-rounded at the second (see GUARD_PAGES)."""
    if (fns := _guarded_allocator()) is None:
        raise RuntimeError("GUARD_PAGES needs mmap and mprotect from the C library")
    mmap, mprotect, munmap = fns
    body = -(-max(size, 1) // PAGE) * PAGE
    total = body + 2 * PAGE
    base = mmap(None, total, PROT_RW, MAP_PRIVATE_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value): raise MemoryError(f"can't map {total} bytes of guarded host memory")
    if mprotect(base, PAGE, PROT_NONE) != 0 or mprotect(base + PAGE + body, PAGE, PROT_NONE) != 0:
        munmap(base, total)
        raise MemoryError("can't protect the guard pages of an allocation")
    start = base + PAGE + body - (size if GUARD_PAGES >= 2 else -(-size // ALIGN) * ALIGN)
    ret = (ctypes.c_uint8 * size).from_address(start)
    ret._finalizer = weakref.finalize(ret, munmap, base, total)
    ret._finalizer.atexit = False
    return ret

class CPUAllocator(LRUAllocator):
    """64-byte aligned host memory. An allocation is a ctypes byte array (so it can be passed straight to a kernel);
    it is freed when it and every view of it are garbage collected."""
    def _alloc(self, size: int, options: Any) -> ctypes.Array:
        if GUARD_PAGES: return _guarded_alloc(size)
        if _LIBC is None:
            # no libc: over-allocate a ctypes array (zero-filled, so slower) and take the aligned part
            raw = (ctypes.c_uint8 * (size + ALIGN - 1))()
            return (ctypes.c_uint8 * size).from_buffer(raw, -ctypes.addressof(raw) % ALIGN)
        # malloc'd memory isn't zero-filled and reuses freed heap pages, which is much cheaper than fresh zero pages
        huge = size >= HUGE_MIN and _LIBC[2] is not None and sys.platform.startswith("linux")
        align = HUGE_PAGE if huge else ALIGN
        ptr = _LIBC[0](align, max(align, -(-size // align) * align))
        if not ptr: raise MemoryError(f"can't allocate {size} bytes of host memory")
        if huge: _LIBC[2](ptr, -(-size // align) * align, MADV_HUGEPAGE)  # a hint: failure changes nothing
        ret = (ctypes.c_uint8 * size).from_address(ptr)
        # the memory is freed when the array object is collected. When it dies in a reference cycle, the garbage
        # collector runs this finalizer before the owning Buffer's __del__ hands the array back to the LRU cache,
        # so _reusable checks that the finalizer hasn't run (reusing the array then would be a use after free)
        ret._finalizer = weakref.finalize(ret, _LIBC[1], ptr)
        ret._finalizer.atexit = False  # at exit the OS takes the memory back anyway
        return ret

    # (kernels take an allocation's address per launch, a TinyJit's prepared launches check it per replay)
    exchanges_memory = True
    # (the C pool runs its jobs one after another in submission order; without it kernels run synchronously)
    queue_ordered = True
    def _exchangeable(self, opaque: ctypes.Array) -> bool:
        return "_root" not in opaque.__dict__ and not has_host_view(opaque)

    def _offset(self, opaque: ctypes.Array, size: int, offset: int) -> ctypes.Array:
        view = (ctypes.c_uint8 * size).from_buffer(opaque, offset)
        view._root = getattr(opaque, "_root", opaque)  # exports are tracked on the allocation itself
        return view

    def _as_buffer(self, opaque: ctypes.Array) -> memoryview:
        wait_for(opaque)
        # a separate ctypes object per export, so free() can see (via weakrefs) whether a memoryview still uses it
        exp = (ctypes.c_uint8 * len(opaque)).from_buffer(opaque)
        root = getattr(opaque, "_root", opaque)
        exports = root.__dict__.setdefault("_exports", [])
        exports[:] = [r for r in exports if r() is not None] + [weakref.ref(exp)]
        return memoryview(exp).cast("B")

    def _reusable(self, opaque: ctypes.Array) -> bool:
        # memory a live memoryview (e.g. a numpy array) still reads must not be handed to another Buffer
        # ((has_host_view and the finalizer's state read from the array's own dict: an eager loop frees a buffer
        # per op)
        d = opaque.__dict__
        if d.get("_exports") and has_host_view(opaque): return False
        fin = d.get("_finalizer")
        return fin is None or fin.alive

    def _idle(self, opaque: ctypes.Array) -> bool:
        # (allocation_root inline: an eager loop takes an allocation per op)
        count = getattr(opaque.__dict__.get("_root", opaque), "_fg_job", 0)
        return not count or (pool := c_pool()) is None or pool._finished.value >= count   # (pool.done)

    # (host access waits for the queued kernels that use the memory: see CPool)
    def _copyin(self, dest: ctypes.Array, src: memoryview) -> None:
        wait_for(dest)
        memoryview(dest).cast("B")[:] = src
    def _copyout(self, dest: memoryview, src: ctypes.Array) -> None:
        wait_for(src, reading=True)   # (kernels still reading it may run on meanwhile)
        dest[:] = memoryview(src).cast("B")

def address(opaque: ctypes.Array) -> int:
    """The address of a CPU allocation, for passing to C code."""
    return ctypes.addressof(opaque)
