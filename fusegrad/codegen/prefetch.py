"""Software prefetch of streamed rows: a reduction over short rows of a big operand asks for the next rows early.

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
from fusegrad.uop.affine import live_ranges, range_kind, range_size
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
