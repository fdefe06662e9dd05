"""Software prefetch of streamed rows: a reduction over short rows of a big operand asks for the next rows early, and
a PACK copy of chunks far apart asks for the chunks a few rows ahead.

A matrix-vector product (a decoding step's every matmul) reads each weight once, several rows at a time: with rows
of 768 floats, each of the 4 rows a loop iteration reads is 3 KB, so the hardware's stream prefetcher, which follows
accesses within a 4 KB page, meets a new short stream every few hundred nanoseconds and each row starts with a wait
for memory. A kernel of this shape loads, along with each vector of this iteration's rows, the same vector of the
next iteration's rows into the cache (a prefetch instruction: no register, no fault past the buffer's end), so the
next rows are in flight while these are summed. Measured on the 2-core machine here, 40 weights of 3072x768 float32
read by both cores: 27.3 -> 32.4 GB/s; rows of 3072 floats (12 KB, long enough for the hardware): no change, so
they aren't prefetched.
"""
from __future__ import annotations
from fusegrad.dtype import PtrDType, dtypes
from fusegrad.uop.affine import coeff, live_ranges, range_kind, range_size
from fusegrad.uop.ops import Ops, UOp

# an operand smaller than this (one core's L2 cache here) is read from a cache already
STREAMED_MIN_BYTES = 1 << 21
# a row longer than a page is followed by the hardware's prefetcher
SHORT_ROW_MAX_BYTES = 4096

def prefetch_streams(sink: UOp, renderer) -> UOp:
    """`sink` (a lowered kernel) with a PREFETCH of the next parallel iteration's address beside every load of a
    streamed operand over short rows, for a renderer that writes prefetches; `sink` itself where there is none.

    A kernel qualifies when its loops are the parallel loop and one reduction inside it, and a load's index varies
    with both (each element is read once, by one iteration: nothing else brings it into the cache) from a buffer of at
    least STREAMED_MIN_BYTES whose row, what the reduction reads of it per iteration, is at most a page."""
    if not getattr(renderer, "supports_prefetch", False) or sink.op is not Ops.SINK: return sink
    topo = sink.toposort()
    loops = [u for u in topo if u.op is Ops.RANGE]
    if len(loops) != 2 or sorted(range_kind(r) for r in loops) != ["global", "reduce"]: return sink
    outer, inner = sorted(loops, key=lambda r: range_kind(r) != "global")
    if not isinstance(trips := range_size(inner), int): return sink
    memo: dict = {}
    prefetches = []
    for u in topo:
        if u.op is not Ops.LOAD or len(u.src) != 1 or (idx := u.src[0]).op is not Ops.INDEX or len(idx.src) != 2:
            continue
        buf = idx.src[0]
        if buf.op is not Ops.DEFINE_GLOBAL or not isinstance(buf.dtype, PtrDType): continue
        if buf.dtype.size * buf.dtype.base.itemsize < STREAMED_MIN_BYTES: continue
        if trips * u.dtype.itemsize > SHORT_ROW_MAX_BYTES or live_ranges(idx.src[1], memo) != {outer, inner}: continue
        ahead = idx.src[1].substitute({outer: outer + 1})
        prefetches.append(UOp(Ops.PREFETCH, dtypes.void, (UOp(Ops.INDEX, idx.dtype, (buf, ahead)),)))
    return sink.replace(src=sink.src + tuple(prefetches)) if prefetches else sink

# rows of a copy prefetched ahead of the one being copied: a row of a few cache lines takes ~100 ns to copy here, about
# a memory latency
COPY_AHEAD = 4
PAGE_BYTES = 4096

def prefetch_copied_rows(sink: UOp, renderer) -> UOp:
    """`sink` (a lowered kernel) with a PREFETCH, COPY_AHEAD rows ahead, of each load of a PACK copy (loops of kind
    "copy") whose rows lie a page or more apart in a buffer of at least STREAMED_MIN_BYTES, one per load at its row's
    first copied element; `sink` itself where there is none.

    A convolution's weight panel packed along its output channels copies, per input channel, a row of 16 channels x 9
    taps (576 bytes) from 18 KB further on: the hardware's prefetcher, which follows accesses within a page, meets a
    new short run each row, and a layer's 9.4 MB of weights came from memory a latency at a time. ResNet-18's 2x2
    input gradient (512 channels, one core, caches flushed first) 4.9 -> 1.4 ms; 1.5-2.4 -> 1.4 ms with the weights in
    the caches."""
    if not getattr(renderer, "supports_prefetch", False) or sink.op is not Ops.SINK: return sink
    topo = sink.toposort()
    copies = [u for u in topo if u.op is Ops.RANGE and range_kind(u) == "copy"]
    if not copies: return sink
    prefetches: dict[UOp, dict[UOp, None]] = {}   # the copy's row loop -> its prefetches
    for u in topo:
        if u.op is not Ops.LOAD or len(u.src) != 1 or (idx := u.src[0]).op is not Ops.INDEX or len(idx.src) != 2:
            continue
        buf, addr = idx.src[0], idx.src[1]
        if buf.op is not Ops.DEFINE_GLOBAL or not isinstance(buf.dtype, PtrDType) or \
                buf.dtype.size * buf.dtype.base.itemsize < STREAMED_MIN_BYTES:
            continue
        steps = {r: c for r in copies if (c := coeff(addr, r)) not in (0, None)}
        if not steps: continue
        row = max(steps, key=lambda r: abs(steps[r]))
        size = range_size(row)
        if abs(steps[row]) * u.dtype.itemsize < PAGE_BYTES or not isinstance(size, int) or size < 2 * COPY_AHEAD:
            continue
        # (the row's element at the copy's inner loops' start; the lanes' loads name the rest of the row)
        ahead = addr.substitute({r: UOp.const(r.dtype, 0) for r in steps if r is not row}) \
            .substitute({row: row + COPY_AHEAD})
        fetch = UOp(Ops.PREFETCH, dtypes.void, (UOp(Ops.INDEX, idx.dtype, (buf, ahead)),))
        prefetches.setdefault(row, {})[fetch] = None
    if not prefetches: return sink
    # (grouped with the copy's store inside the END that closes the row loop: a node outside every END would depend
    # on a loop that other loops don't nest in; the linearizer places each prefetch in the row loop's body)
    ends: dict[UOp, UOp] = {}
    for e in topo:
        if e.op is not Ops.END: continue
        for r in e.src[1:]:
            if r not in prefetches: continue
            ends[e] = UOp(Ops.END, e.dtype, (UOp(Ops.NOOP, dtypes.void, (e.src[0], *prefetches[r])), *e.src[1:]))
            break
    return sink.substitute(ends)
