"""Hand-coded optimization heuristics for CPUs: vectorize a contiguous axis, register-tile matmul-like kernels and
block them for the caches, split long reductions into partial accumulators."""
from __future__ import annotations
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fusegrad.codegen.bounds import clauses
from fusegrad.codegen.lower import SUM_BLOCKED_OVER
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import pads_cheaply
from fusegrad.hostcpu import CHUNKS_PER_THREAD
from fusegrad.renderer.cpu_dot import DOT_LANES, whole_matmul_plan
from fusegrad.uop.affine import coeff, range_kind, range_size
from fusegrad.uop.ops import GroupOp, Ops, UOp

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_ADD, _AND, _CAST, _CONST, _DEFINE_GLOBAL, _EXP2 = Ops.ADD, Ops.AND, Ops.CAST, Ops.CONST, Ops.DEFINE_GLOBAL, Ops.EXP2
_IDIV = Ops.IDIV
_LOAD, _LOG2, _MAX, _MOD, _RANGE, _REDUCE, _SIN = Ops.LOAD, Ops.LOG2, Ops.MAX, Ops.MOD, Ops.RANGE, Ops.REDUCE, Ops.SIN

def _largest_divisor(n: int, choices: tuple[int, ...]) -> int:
    return next((c for c in choices if n % c == 0), 1)

def _vector_lanes(renderer, dt: DType) -> int:
    """Lanes of one SIMD register of `dt` on the renderer's target; 0 where it has no vectors of `dt`."""
    return getattr(renderer, "simd_bytes", 0) // dt.itemsize if dt in getattr(renderer, "vector_dtypes", ()) else 0

@dataclass
class OptContext:
    """What the steps of `hand_coded_optimizations` for a reduction (or a half elementwise kernel) share: the kernel,
    the target's vector facts, the loops as the steps found them, and the output vector once step 1 chose one."""
    k: Kernel
    outs: list[UOp]             # the output loops (a padded vector loop replaced by its padded range)
    reds: list[UOp]             # the reduce loops
    acc_dt: DType               # the dtype of the accumulators (float32 without a reduction)
    width: int                  # lanes of a full vector of acc_dt; the output vector's lanes once chosen
    min_lanes: int              # a reduction's vector narrower than this only along a longer loop
    registers: int              # vector registers of the target
    budget: int                 # accumulators kept in registers
    cores: int
    vec_out: UOp | None = None  # the output loop vectorized (step 1)
    pad: bool = False           # vec_out is padded to whole vectors
    switched: bool = False      # vec_out is a convolution's output channels, taken over its image rows

    @staticmethod
    def of(k: Kernel) -> OptContext:
        acc_dt = k.reduceops[-1].dtype if k.reduceops else dtypes.float32
        registers = getattr(k.renderer, "vector_registers", 16)
        # a reduction's vector is narrower than 16 bytes (an SSE or NEON register; AVX2's quarter vector) only along a
        # longer loop: a pooling's 2-wide window taken whole as one such vector ran slower than the window unrolled by
        # step 4, while two lanes along a long row still pay
        return OptContext(k, [k.loops[i] for i in k.output_axes()], [k.loops[i] for i in k.reduce_axes()], acc_dt,
                          _vector_lanes(k.renderer, acc_dt), max(16 // acc_dt.itemsize, 2), registers,
                          max(registers // 2, 4), os.cpu_count() or 2)

    def split(self, op: OptOps, r: UOp, amt: int) -> tuple[UOp | None, UOp | None]:
        """Apply op to loop r: (the remaining outer loop or None, the new inner range or None if it didn't apply)."""
        idx, n = self.k.loops.index(r), len(self.k.loops)
        try: inner = self.k.apply_opt(Opt(op, idx, amt))
        except KernelOptError: return r, None
        return (self.k.loops[idx] if len(self.k.loops) == n else None), inner

    def strides(self, r: UOp) -> list[tuple[int | None, bool]]:
        """The coefficient of loop r in every access, with whether the access is a store."""
        return [(coeff(idx.src[1], r), is_store) for idx, is_store in self.k.accesses()]

    def loads(self) -> list[UOp]: return [idx for idx, is_store in self.k.accesses() if not is_store]

def hand_coded_optimizations(k: Kernel) -> list[Opt]:
    """Choose and apply opts to `k`; returns them (also in k.applied_opts)."""
    # a kernel that is only a bfloat16 matmul, on a CPU with AMX tiles or bfloat16 dot products: the C renderer writes
    # its whole loop nest as tile products or dot products (renderer/cpu_dot.py), from the loops as they are
    if whole_matmul_plan(k.renderer, list(k.ast.toposort())) is not None: return []
    if not k.reduceops and (opts := _shape_elementwise(k)) is not None: return opts
    ctx = OptContext.of(k)
    _choose_output_vector(ctx)
    if ctx.vec_out is not None:
        _tile_output_vector(ctx)
        return k.applied_opts
    if _vectorize_reduction(ctx): return k.applied_opts
    if _vectorize_gathering_output(ctx): return k.applied_opts
    if _vectorize_strided_window(ctx): return k.applied_opts
    _unroll_small_window(ctx)
    _upcast_remainder_lanes(ctx)
    _upcast_output_windows(ctx)
    _unroll_reduce_remainders(ctx)
    _independent_sums(ctx)
    return k.applied_opts

def _shape_elementwise(k: Kernel) -> list[Opt] | None:
    """The opts of an elementwise kernel, or None where it is left to the steps for reductions (half buffers).

    A plain contiguous inner loop is what gcc vectorizes best, except with half buffers (computed in float): the C
    renderer has gcc vectorize no half conversions (it miscompiles them), so those get our vector code, with explicit
    conversions, float32 vectors wide. (gcc vectorizes bfloat16's integer conversions well by itself.)"""
    # (a concatenation's vector is as many lanes as a float32 one, whatever the dtype: as for half above)
    lanes = _vector_lanes(k.renderer, dtypes.float32)
    if _tile_transpose(k) or _unroll_selectors(k, lanes): return k.applied_opts
    if (remainders := _upcast_remainders(k)) or _split_at_remainders(k):
        # (the loop left after the remainder's lanes, vectorized when gcc's vectorizer isn't given the kernel)
        if not _vectorize_gated(k, lanes, strided=remainders) and remainders: _upcast_remainder_rows(k)
        return k.applied_opts
    if _vectorize_gated(k, lanes): return k.applied_opts
    halves = dtypes.float16 in getattr(k.renderer, "vector_dtypes", ())
    if not any(idx.src[0].dtype.base == dtypes.float16 and halves for idx, _ in k.accesses()): return []
    return None

def _choose_output_vector(ctx: OptContext) -> None:
    """Step 1: the output loop to vectorize and its lanes (ctx.vec_out, ctx.width), padded to whole vectors where
    that pays (ctx.pad). The innermost loop that is contiguous in the output and contiguous or broadcast in every
    load, or (a @ b.T) strided in a load that doesn't vary with another output axis: that load gets copied to a
    contiguous local block (PACK) reused across that axis. Unless a long reduction's output is better served by a
    vector with a store per lane, or a convolution on small images by its output channels."""
    if ctx.width < 2: return
    # innermost first, among the axes the output is contiguous along
    cands = [(r, *_output_vector_width(ctx, range_size(r))) for r in reversed(ctx.outs)]
    best = next(((r, w, p) for r, w, p in cands if w is not None and _fits_vector(ctx, r, False)), None)
    best = _prefer_per_lane_vector(ctx, cands, best)
    contiguous = best
    best = _prefer_channel_vector(ctx, cands, best)
    if best is None or _prefer_reduction_vector(ctx, best, contiguous): return
    ctx.vec_out, ctx.width, ctx.pad = best
    _pad_output_vector(ctx)

def _packable(ctx: OptContext, idx: UOp, r: UOp, min_rows: int = 16) -> bool:
    """Whether load `idx`, strided along r, is worth copying (PACK) to a contiguous block: the output loops that don't
    move it give it more rows than one register tile to reuse it.

    (A classifier at batch 8 would copy its weights to read them once, and without the copy its vector loads would
    be per lane. A dot product along the reduction, step 3, is better then: it runs about twice as fast and compiles
    many times faster.)"""
    # (no such loop: a product of 1)
    rows = math.prod(sz if isinstance(sz := range_size(o), int) else 16 for o in ctx.outs
                     if o is not r and coeff(idx.src[1], o) == 0)
    return bool(ctx.reds) and rows >= min_rows

def _output_vector_width(ctx: OptContext, sz: int | UOp) -> tuple[int | None, bool]:
    """The widest vector that divides the loop, or, in a reduction's output loop (whose stores are few next to its
    loads), that its padding to whole vectors wastes at most an eighth of: 56 columns take 16 lanes (padded to
    64) rather than 8, 1023 or 50257 columns get vectors at all, a 7x7 image takes 8. (width, padded)"""
    if not isinstance(sz, int): return None, False
    for cand in (c for c in (ctx.width, ctx.width // 2, ctx.width // 4) if c >= 2):
        if sz % cand == 0: return cand, False
        if ctx.k.reduceops and pads_cheaply(sz, cand): return cand, True
    return None, False

def _fits_vector(ctx: OptContext, r: UOp, per_lane: bool, min_rows: int = 16) -> bool:
    """Whether r can be the vector axis: contiguous, broadcast or packable in the loads and contiguous in the
    store, or, with `per_lane`, also strided where an access runs once per output (the store, and loads outside
    the reduction such as a residual): gathered lane by lane, few next to the reduction's loads. And r varies
    in some load."""
    st = [(coeff(idx.src[1], r), is_store, idx) for idx, is_store in ctx.k.accesses()]
    def load_fits(c: int | None, idx: UOp) -> bool:
        return c in (0, 1) or _packable(ctx, idx, r, min_rows) or \
            (per_lane and c is not None and all(coeff(idx.src[1], q) == 0 for q in ctx.reds))
    # (a store that doesn't vary along r, a row's statistic beside the row, is made once outside the vector)
    return all(c in (0, 1) or (per_lane and c is not None) for c, is_store, _ in st if is_store) and \
        all(load_fits(c, idx) for c, is_store, idx in st if not is_store) and \
        any(c != 0 for c, is_store, _ in st if not is_store)

VectorChoice = tuple[UOp, int, bool]  # (output loop, lanes, padded)

def _gathered(ctx: OptContext, r: UOp) -> int:
    """The size of the biggest buffer that a vector along r would gather lane by lane."""
    return max((idx.src[0].dtype.size for idx in ctx.loads() if coeff(idx.src[1], r) not in (0, 1)), default=0)

BLOCK_ROWS = 512
PER_LANE_MIN_ROWS, PER_LANE_MIN_OUTPUTS = 4, 1024

def _prefer_per_lane_vector(ctx: OptContext, cands: list[tuple[UOp, int | None, bool]],
                            best: VectorChoice | None) -> VectorChoice | None:
    """A long reduction's output (a convolution's channels) takes a full vector with a store per lane (few next to the
    reduction's loads) where the contiguous choice is a quarter vector or none (a 4x4 image gives a quarter-width
    vector, a 2x2 or 1x1 one none), or gathers a big buffer.

    With no output vector at all, a reduction contiguous in its loads (a weight gradient's image rows) is vectorized
    itself by step 3 instead: far fewer stores and no strided loads. A vector whose lanes gather a big buffer (a
    stride-2 convolution's image along its row) gives way to one gathering a smaller one (the weights, along the output
    channels, packed per tile of pixels that reuses them): ResNet-18's 7x7 stride-2 stem at 64px 1.44 -> 0.33 ms at
    batch 8 (weights a tenth of the image), 0.18 -> 0.048 ms at batch 1 (three quarters).

    A reduction vector narrower than a full one (a weight gradient's rows of 4, 12 or 14 pixels) counts as none where
    the output vector's strided load can be packed per block of the reduction: where the reduce loops inside the
    outermost (which KBLOCK blocks) have at most BLOCK_ROWS iterations. The output channels' full vectors then share
    each broadcast pixel, where each pixel's narrow vector fed one dot product (14x14 images about 20 times as fast).
    Rows of 28 pixels and more keep the reduction's vector: the gradient, not packed, would be gathered lane by lane."""
    width, outs, reds = ctx.width, ctx.outs, ctx.reds
    red_len = math.prod(s for s in (range_size(r) for r in reds) if isinstance(s, int))
    blockable = _trip_product(reds[1:]) <= BLOCK_ROWS
    no_reduce_vector = not any((w := _reduce_vector_width(ctx, r)) and (w == width or not blockable) for r in reds)
    if not ((best[1] <= width // 4 or _gathered(ctx, best[0]) > 0 if best is not None else no_reduce_vector) and
            reds and (red_len >= 64 or (best is not None and _gathered(ctx, best[0]) > 0))):
        return best
    # (a plain matmul's transposed operand (a @ b.T: the logits of a tied embedding, 512 x 768 @ 768 x 50257) is
    # packed per column panel, contiguous along the reduction, not gathered per lane: the output stays contiguous,
    # where a vector along the other operand's rows stored every lane on a row of its own)
    if best is not None and best[1] == width and len(reds) == 1 and not _sliding_windows(ctx.k) and \
            all(_packable(ctx, idx, best[0]) and coeff(idx.src[1], reds[0]) == 1 for idx in ctx.loads()
                if coeff(idx.src[1], best[0]) not in (0, 1)):
        return best
    # of several, the one whose strided load (packed per tile) varies with the fewest output loops: the others then
    # reuse its copy (a weight gradient on 7x7 images: along the output channels the gradient is packed once per
    # channel tile; along the input channels the image would be gathered, an order of magnitude slower)
    def copy_loops(r: UOp) -> int:
        return max((sum(1 for o in outs if o in idx.src[1].toposort()) for idx in ctx.loads()
                    if coeff(idx.src[1], r) not in (0, 1)), default=0)
    # (with no vector at all otherwise, a convolution's strided load reused by as few as PER_LANE_MIN_ROWS rows still
    # takes one where the kernel has PER_LANE_MIN_OUTPUTS outputs: a 3x3 convolution of 2x2 images at batch 1 or 2,
    # whose scalar code ran 4-10 times slower. Fewer outputs (the digits CNN's first weight gradient, 288) keep their
    # form, and so does a kernel without sliding windows: the MLP's cross-entropy over 128 rows of 10 classes, which
    # ran no faster and took the C compiler 0.4 s more)
    rows = PER_LANE_MIN_ROWS if best is None and _trip_product(outs) >= PER_LANE_MIN_OUTPUTS and \
        _sliding_windows(ctx.k) else 16
    ok = [c for c in cands if c[1] == width and not c[2] and _fits_vector(ctx, c[0], True, rows) and
          (best is None or best[1] <= width // 4 or _gathered(ctx, c[0]) < _gathered(ctx, best[0]))]
    return min(ok, key=lambda c: (copy_loops(c[0]), ok.index(c))) if ok else best

def _prefer_channel_vector(ctx: OptContext, cands: list[tuple[UOp, int | None, bool]],
                           best: VectorChoice | None) -> VectorChoice | None:
    """A convolution over image rows shorter than two vectors (7, 14 or 28 pixels: padded or narrow vectors) is
    vectorized along its output channels instead (ctx.switched), as an implicit matmul: full vectors of weights
    (packed per block of input channels, the blocks added up through the output) times broadcast pixels, 7 pixels of
    a row at a time: no padded lanes, and each weight vector loaded once serves 7 pixels.

    A 1x1 convolution on rows narrower than a vector (7x7, 14x14) is the same implicit matmul when the weight block it
    packs is reused by enough row tiles (batch x image rows); a plain matmul with 7 columns would pack its whole left
    operand for one tile, which costs more than the vectors win."""
    k, width = ctx.k, ctx.width
    if best is None or not isinstance(rsz := range_size(best[0]), int) or rsz >= 2 * width or not _blockable(k):
        return best
    windows = bool(_sliding_windows(k, best[0]))
    # (at least two vectors of channels: the register tile's two columns; 16 channels stay on the rows)
    wide = next(((r, w, p) for r, w, p in cands if w == width and not p and _fits_vector(ctx, r, True) and
                 (range_size(r) >= 2 * width or _one_vector_of_channels(ctx, r, best[0])) and
                 not _sliding_windows(k, r)), None)
    if wide is not None and not windows:
        others = math.prod(s if isinstance(s := range_size(o), int) else 1 for o in ctx.outs
                           if o is not best[0] and o is not wide[0])
        if rsz >= width or others < 16: wide = None
    if wide is None: return best
    ctx.switched = True
    return wide

ONE_VECTOR_MIN_ROWS = 64

def _one_vector_of_channels(ctx: OptContext, r: UOp, row: UOp) -> bool:
    """Whether a convolution with one full vector of output channels (16 on AVX-512) takes them as its vector over an
    image row shorter than a vector (8 pixels: half vectors): on a target of more than 16 registers, where the tile
    still holds 16 accumulators (the row by another loop), and its weights are contiguous along the channels (laid
    out so: the ONNX runner's) or the output loops outside the row give their copy (made once per core:
    `_pack_whole_panel`) at least ONE_VECTOR_MIN_ROWS rows to reuse it."""
    if ctx.registers <= 16 or range_size(r) != ctx.width or not isinstance(rsz := range_size(row), int) or \
            2 * rsz > ctx.width:
        return False
    # (no copy at all where the loads inside the reduction are contiguous along them: weights laid out so)
    if all(coeff(idx.src[1], r) in (0, 1) for idx in ctx.loads() if any(coeff(idx.src[1], q) != 0 for q in ctx.reds)):
        return True
    others = math.prod(s if isinstance(s := range_size(o), int) else 1 for o in ctx.outs if o is not r and o is not row)
    return others >= ONE_VECTOR_MIN_ROWS

LONG_REDUCTION = 4096

def _prefer_reduction_vector(ctx: OptContext, best: VectorChoice, contiguous: VectorChoice | None) -> bool:
    """Whether a reduction over at least LONG_REDUCTION elements per output, contiguous in every load along one of
    its loops for a full vector, is better vectorized itself (step 3) than along the output vector chosen, when that
    vector is padded (a 7-wide window padded to 8) or was taken over image rows shorter than a vector (a
    convolution's channels): a convolution's weight gradient, whose few outputs each sum over batch x image. Its
    loads are then contiguous vectors along the image rows, shared across a tile of output channels x input
    channels, where the output vector gathered the output gradient lane by lane, one cache line per lane (the 7x7
    stem's weight gradient ran more than twenty times faster)."""
    if len(ctx.k.reduceops) != 1 or not (best[2] or best is not contiguous): return False
    red_len = math.prod(s if isinstance(s := range_size(r), int) else 0 for r in ctx.reds)
    return red_len >= LONG_REDUCTION and any(_reduce_vector_width(ctx, r) == ctx.width for r in ctx.reds)

def _pad_output_vector(ctx: OptContext) -> None:
    """The output vector's loop padded to whole vectors (PADTO) where step 1 chose padding, or where a plain matmul's
    row holds an odd number of vectors (784 = 49 x 16) that the register tile can't pair: padded to an even number
    when that wastes at most an eighth: the tile then holds two vectors per row, and few padded lanes compute."""
    k, vec_out, width = ctx.k, ctx.vec_out, ctx.width
    assert vec_out is not None
    if not ctx.pad and len(ctx.reds) == 1 and isinstance(sz := range_size(vec_out), int) and (sz // width) % 2 and \
            sz // width >= 3 and pads_cheaply(sz, 2 * width) and \
            any(coeff(idx.src[1], vec_out) == 0 and coeff(idx.src[1], ctx.reds[0]) != 0 for idx in ctx.loads()):
        ctx.pad = True
    if not ctx.pad: return
    # to two vectors' multiple when that also wastes at most an eighth (1000 -> 1024, not 1008): the register tile
    # then holds two vectors per row
    to = 2 * width if pads_cheaply(range_size(vec_out), 2 * width) else width
    axis, at = k.loops.index(vec_out), ctx.outs.index(vec_out)
    try: k.apply_opt(Opt(OptOps.PADTO, axis, to))
    except KernelOptError:
        # (a loop whose iterations read what earlier ones stored, an in-place update merged beside a reduction, is not
        # padded: its vector stays where it holds whole vectors, else there is none)
        ctx.pad = False
        if not (isinstance(sz := range_size(vec_out), int) and sz % width == 0): ctx.vec_out = None
        return
    ctx.vec_out = ctx.outs[at] = k.loops[axis]

def _trip_product(loops: Sequence[UOp]) -> int:
    """The product of the loops' sizes, a symbolic size counted as 2^30 (more than any threshold it is held against)."""
    return math.prod(s if isinstance(s := range_size(r), int) else 1 << 30 for r in loops)

# the widest image row (output pixels) for which a convolution along its channels takes a single vector of them,
# where its reduction is longer than SMALL_IMAGE_REDUCTION (see _tile_output_vector)
SMALL_IMAGE_ROW, SMALL_IMAGE_REDUCTION, SMALL_IMAGE_TILE = 4, 1024, 8

def _tile_output_vector(ctx: OptContext) -> None:
    """Step 2: the output vector upcast, then (in a reduction) register tiling: another output axis whose lanes share
    a vector load (a load that doesn't depend on it) upcast, 8 rows x 2 vectors of accumulators, blocked for the
    caches; without such rows, lanes that share a broadcast load, and the reductions' own vectors."""
    k = ctx.k
    assert ctx.vec_out is not None
    # a convolution, and one vectorized along its output channels (the vector loads don't slide with the window)
    conv = bool(_sliding_windows(k))
    channels = (conv and not _sliding_windows(k, ctx.vec_out)) or ctx.switched
    rest, inner = ctx.split(OptOps.UPCAST, ctx.vec_out, ctx.width)
    if inner is None or not k.reduceops: return
    # (a load inside the reduction: one after it, layernorm's weight, is read once per row anyway)
    reuse = [r for r in k.loops[:k.first_reduce] if r is not rest and isinstance(range_size(r), int) and
             any(coeff(idx.src[1], r) == 0 and coeff(idx.src[1], inner) != 0 and
                 any(coeff(idx.src[1], q) != 0 for q in ctx.reds) for idx in ctx.loads())]
    # (at most two where every element takes a transcendental function, some 30 operations once it is lowered:
    # softmax's 16 vectors of exp per row step compiled more than twice as long as two, and ran no faster)
    costly = any(u.op in (_EXP2, _LOG2, _SIN) for u in k.ast.toposort())
    # a convolution along its channels over images at most SMALL_IMAGE_ROW pixels wide (ResNet's last stages at 64
    # pixels: 4x4 and 2x2), with a reduction over more than SMALL_IMAGE_REDUCTION elements (256 channels of a 3x3
    # window), takes one vector of channels where two are wider than a cache line (AVX-512): its tile's rows are then
    # the batch, at most SMALL_IMAGE_TILE of it, and the weights' panel of a block (input channels x window x the
    # vector's channels) stays in L1 (288 x 64 bytes), where two vectors' (36 KB) didn't. 512 channels over 2x2
    # images, batch 8: 2.0 -> 1.26-1.43 ms, batch 16: 2.96 -> 2.03 ms (a tile of 16 rows: 2.39); over 4x4, batch 8:
    # 4.2-4.6 -> 3.6 ms, batch 16: 7.3 -> 6.8 ms. (The digits CNN's input gradient over 4x4 images, a reduction of
    # 576, ran 7% slower so; two AVX2 vectors' panel fits L1 already)
    small_image = conv and channels and bool(reuse) and isinstance(row := range_size(reuse[-1]), int) and \
        row <= SMALL_IMAGE_ROW and 2 * ctx.width * ctx.acc_dt.itemsize > 64 and \
        _trip_product(ctx.reds) > SMALL_IMAGE_REDUCTION
    rest, n_vec = _upcast_vectors(ctx, rest, inner, ((1,) if small_image else (2,)) if reuse or costly else
                                  tuple(c for c in (8, 4, 2) if c <= ctx.budget))
    if reuse:
        _tile_rows(ctx, reuse, rest, inner, n_vec, conv, channels, SMALL_IMAGE_TILE if small_image else 1 << 30)
        return
    # no vector load to share across rows, but a broadcast one (a depthwise convolution's weight, the same for every
    # pixel): another output loop that it doesn't move with is upcast, so its lanes share that load and each keeps
    # an accumulator of its own, where one accumulator waited on every multiply-add of a short window (a depthwise
    # 3x3 input gradient runs about three times as fast)
    if not costly and (shared := _broadcast_sharing(k, inner)) is not None:
        fits = tuple(a for a in range(ctx.budget // n_vec, 1, -1) if _leaves_cores_even(ctx, shared, a))
        if (amt := _largest_divisor(range_size(shared), fits)) > 1: ctx.split(OptOps.UPCAST, shared, amt)
    elif not costly and n_vec == 1: _chain_windows(ctx, inner)
    # (a reduction the output vector doesn't vary, computed once for the vector's lanes, is vectorized by itself)
    if len(k.reduceops) == 1 and any(inner in u.src[0].toposort() for u in k.ast.toposort() if u.op is _REDUCE):
        _block_strided_reduce(ctx)
        _unroll_reduce(ctx)  # fewer loop iterations for the short bodies
        return
    _vectorize_reductions(ctx)

def _leaves_cores_even(ctx: OptContext, r: UOp, amt: int) -> bool:
    """Whether output loop r upcast by amt still splits evenly across the cores where it is the loop they split (the
    outermost): a multiple of their count, or enough iterations that the odd one out is a small share. (The gradient
    of a layernorm's weight over 768 columns, 6 iterations of 128 upcast to 3 of 256, kept one of two cores idle a
    third of the time.)"""
    if r is not ctx.k.loops[0] or not isinstance(sz := range_size(r), int): return True
    return (sz // amt) % ctx.cores == 0 or sz // amt >= 4 * ctx.cores

WINDOW_CHAINS, WINDOW_CHAIN_TAPS = 4, 16

def _chain_windows(ctx: OptContext, inner: UOp) -> None:
    """A pool's small window (at most WINDOW_CHAIN_TAPS taps) reduced into a single vector of accumulators (a max pool
    over channels-last data, the channels the vector): the innermost other output loop is upcast by up to
    WINDOW_CHAINS, so that many windows' chains of maxes (a compare, a nan check and a blend each) run side by side,
    where each waited on the one before."""
    k = ctx.k
    if len(k.reduceops) != 1 or len(k.expanded) != 1: return
    taps = [range_size(r) for r in ctx.reds]
    if not taps or not all(isinstance(n, int) for n in taps) or not 1 < math.prod(taps) <= WINDOW_CHAIN_TAPS: return
    r = next((r for r in reversed(k.loops[:k.first_reduce]) if r is not inner and isinstance(range_size(r), int) and
              range_size(r) > 1), None)
    if r is not None and (amt := _largest_divisor(range_size(r), (WINDOW_CHAINS, 2))) > 1:
        ctx.split(OptOps.UPCAST, r, amt)

def _blocked_lanes(ctx: OptContext, r: UOp) -> int | None:
    """The widest of a full, half or quarter vector along reduce loop r whose every lane adds more than
    SUM_BLOCKED_OVER terms (lowering then blocks each lane's sum), or None."""
    if not isinstance(sz := range_size(r), int): return None
    return next((w for w in (ctx.width, ctx.width // 2, ctx.width // 4) if w >= 2 and sz // w > SUM_BLOCKED_OVER), None)

def _vectorize_reductions(ctx: OptContext) -> bool:
    """Several reductions per output row (softmax, layernorm, a channel's mean and variance): each one in vector
    partial accumulators, its loop padded to whole vectors where no vector width divides it (a vocabulary of 50257,
    whose argmax or softmax's max would otherwise reduce in scalar code). A padded float sum's vector is the widest
    whose every lane still adds more than SUM_BLOCKED_OVER terms (a cross-entropy's sum of exp over 50257 logits: 8
    lanes of 6283, on AVX-512 as on AVX2), without further accumulators, so lowering still blocks every lane's sum
    and its rounding doesn't grow with the row; a shorter one stays scalar. Returns whether one was."""
    applied = False
    for r in [ctx.k.loops[i] for i in ctx.k.reduce_axes()]:
        blocked = False
        if not (w := _reduce_vector_width(ctx, r)):
            # (a shorter float sum is left to lowering's blocking as it was, each sum in one loop nest: fewer terms
            # per lane would fall under it)
            lanes = _blocked_lanes(ctx, r) if (blocked := _float_sum(ctx, r)) else ctx.width
            if lanes is None or (padded := _pad_reduce(ctx, r, lanes)) is None: continue
            r, w = padded, lanes
        rem, inner = ctx.split(OptOps.UPCAST, r, w)
        if inner is None: continue
        applied = True
        if rem is not None and not blocked: _add_accumulators(ctx, rem)
    return applied

SEVERAL_ACCUMULATORS_MIN_STEPS = 16

def _add_accumulators(ctx: OptContext, rem: UOp) -> None:
    """The vector loop `rem` left of a reduction vectorized by itself (one of several per row: softmax's max,
    layernorm's sums, argmax's two) upcast by 4 (or 2), so its vectors are independent accumulators, combined after
    the loop: with one, each max or add waited on the one before, and a long row ran at a fraction of the loads'
    speed. Only a cheap reduction over a row of at least SEVERAL_ACCUMULATORS_MIN_STEPS vectors: one whose every
    element takes a transcendental function (softmax's exp) is bound by that arithmetic, not by the chain, and its
    body would be compiled four times."""
    if not isinstance(rs := range_size(rem), int) or rs < SEVERAL_ACCUMULATORS_MIN_STEPS: return
    reds = [u for u in ctx.k.ast.toposort() if u.op is _REDUCE and rem in u.src[1:]]
    if not reds or any(u.op in (_EXP2, _LOG2, _SIN) for red in reds for u in red.src[0].toposort()): return
    if (extra := _largest_divisor(rs, (4, 2))) > 1: ctx.split(OptOps.UPCAST, rem, extra)

def _upcast_vectors(ctx: OptContext, rest: UOp | None, inner: UOp, choices: tuple[int, ...]) -> tuple[UOp | None, int]:
    """Several vectors (the largest of `choices` that divides it) along the output vector's loop, so each row of the
    reduction is read in longer contiguous runs: (the loop left, how many vectors)."""
    # (a load strided along the vector axis needs a loop of columns left to be packed in)
    strided = any(coeff(idx.src[1], inner) not in (0, 1) for idx in ctx.loads())
    if rest is None or not isinstance(sz := range_size(rest), int) or (strided and sz < 4): return rest, 1
    n_vec = _largest_divisor(sz, choices)
    if n_vec > 1:
        rest, inner2 = ctx.split(OptOps.UPCAST, rest, n_vec)
        if inner2 is None: n_vec = 1
    return rest, n_vec

CHANNEL_TILE = 16

def _tile_rows(ctx: OptContext, reuse: list[UOp], rest: UOp | None, inner: UOp, n_vec: int, conv: bool,
               channels: bool, row_budget: int = 1 << 30) -> None:
    """The register tile's rows: an output loop of `reuse` (those whose lanes share the vector loads) upcast by up to
    8 rows within the accumulator budget (and `row_budget`), padded to a whole tile where that is cheap; then the
    window unrolled, the tile blocked for the caches, and a plain matmul's reduce loop unrolled."""
    k = ctx.k
    # a plain matmul's tile on a target of 16 vector registers (AVX2) is 6 rows x 2 vectors: 12 accumulators, the
    # row's two vectors and a broadcast fit the 16 registers, and each vector load feeds 6 multiply-adds where a 4-row
    # tile's fed 4 (its loads, not the multiply-adds, were the bottleneck). Its reduce loop is not unrolled: the
    # unrolled steps' vectors no longer fit, and gcc then read every vector from memory once per multiply-add.
    wide = n_vec == 2 and ctx.registers <= 16 and not conv and not channels and len(ctx.reds) == 1
    budget = 12 if wide else min(ctx.budget, row_budget)
    # (a convolution along its channels takes image rows of 7 whole: padding them to 8 would compute an eighth more)
    choices = tuple(c for c in ((16, 8, 7, 6, 4, 3, 2) if channels else (8, 6, 4, 3, 2)) if c * n_vec <= budget)
    # the innermost axis (its loads are the closest together), unless it only takes a tile of 2 or less and another
    # takes a bigger one (a convolution over a 2x2 image with its channels vectorized: the batch)
    r = reuse[-1]
    if _largest_divisor(range_size(r), choices) < 3:
        r = max(reversed(reuse), key=lambda x: _largest_divisor(range_size(x), choices))
    # (rows that a load's index divides or takes modulo m, as the columns of attention heads of 64 read from a (batch,
    # heads, tokens, 64) layout, take a tile that divides m: a tile's rows then stay in one head and are read from
    # one address, where a 6-row tile straddled two heads and addressed each of its rows on its own)
    periods = _remainder_divisors(k, r)
    fit = tuple(c for c in choices if all(m % c == 0 for m in periods))
    if (narrowed := bool(periods) and _largest_divisor(range_size(r), fit) >= 4): choices = fit
    amt = _largest_divisor(rsz := range_size(r), choices)
    # rows that only a small tile divides (1023 = 3 x 341) are padded to the full tile if that wastes at most an
    # eighth: the padded rows are never stored, and the tile is what reuses each vector load. A tile of 6 reuses the
    # loads almost as well, so it only gives way to padding that wastes under a sixteenth (the 36 rows of Winograd's
    # input transform ran faster in 6-row tiles than padded to 40 for 8-row tiles)
    if choices and amt < choices[0] and not (channels and amt == 7) and isinstance(rsz, int) and \
            pads_cheaply(rsz, choices[0]) and (amt < 6 or 16 * (-rsz % choices[0]) < rsz):
        axis = k.loops.index(r)
        k.apply_opt(Opt(OptOps.PADTO, axis, choices[0]))
        r, amt = k.loops[axis], choices[0]
    # a convolution along its output channels whose tile is a whole image row of 4 or 8 pixels, with at most 8
    # accumulators, on a target of 16 vector registers: another output loop (the batch, else the output rows) joins
    # the tile, up to CHANNEL_TILE accumulators, so each weight vector loaded feeds that many multiply-adds (8 were
    # bound by the loads and the multiply-adds' latency). A row as wide as a vector is tiled by half of it: 8 pixels
    # would win the lowering's choice of the SIMD axis over the 8 channels, and its taps' loads are gated per lane
    # (only where the loops left outside the tile still reuse the packed weights 4 times: `_block_matmul`'s PACK)
    # (a 3-wide window: the 2x2 phases of a strided convolution's input gradient measured no faster)
    grow = channels and conv and amt in (4, 8) and amt == rsz and r is reuse[-1] and \
        n_vec * amt < CHANNEL_TILE and range_size(ctx.reds[-1]) == 3
    split_row = grow and amt == ctx.width and n_vec == 1
    c = CHANNEL_TILE // (n_vec * amt // (2 if split_row else 1))
    others = [o for o in reuse if o is not r and isinstance(range_size(o), int)]
    o = next((o for o in others if range_size(o) % c == 0 and
              math.prod(range_size(x) for x in others) // c >= 4), None) if grow else None
    if o is None: split_row = False
    if split_row: amt //= 2
    if amt > 1: ctx.split(OptOps.UPCAST, r, amt)
    if o is not None: ctx.split(OptOps.UPCAST, o, c)
    # a tile of a whole loop of 3 along the channels (a weight gradient's kw) takes 2 of another reuse loop (its input
    # channels): 6 rows x 2 vectors, the matmul's tile, where 3 rows fed each vector load to 3 multiply-adds (the
    # digits CNN's weight gradient about 1.2x as fast with 16 vector registers; with 32, ResNet-18's over 8x8 and
    # 4x4 images at 64px 0.79 -> 0.58 and 0.68 -> 0.46 ms; 4 input channels, 24 sums, measured slower)
    if channels and amt == 3 and rsz == 3 and n_vec == 2 and \
            (pair := next((o for o in reversed(reuse) if o is not r and o in k.loops and
                           isinstance(osz := range_size(o), int) and osz % 2 == 0 and osz > 2), None)) is not None:
        ctx.split(OptOps.UPCAST, pair, 2)
        amt = 6
    # (a window along the channel vector's loads isn't unrolled: each tap would hold its own weight vectors; but a
    # short padded row is, when the tile leaves registers for its taps)
    if not channels:
        _unroll_windows(k, n_vec * max(amt, 1), ctx.registers)
        _upcast_padded_window_row(ctx, n_vec * max(amt, 1))
    if rest is None and channels and conv: _pack_whole_panel(k, inner, ctx.cores)
    _block_matmul(k, rest, inner, ctx.width * n_vec * ctx.acc_dt.itemsize, ctx.cores, conv)
    # (after the blocking, which sizes its blocks by the reduce loops' iterations)
    if channels and n_vec * max(amt, 1) <= max(ctx.budget, 12 if ctx.registers <= 16 else 0):
        _unroll_gated_row(k, split_row)
    # a plain matmul's reduce loop unrolled by 4: the loop overhead and the address arithmetic of the row loads are
    # shared by four steps, faster on big and small matmuls alike. (12-row tiles measured no better once unrolled,
    # and worse where rows must be padded to 12.)
    # (Not a tile narrowed to the periods above on AVX2: as a 4-row tile there, gcc ran out of registers for the
    # unrolled steps' vectors and read them from memory once per multiply-add)
    if len(ctx.reds) == 1 and n_vec > 1 and max(amt, 1) * n_vec <= ctx.budget and not (wide and narrowed):
        _unroll_reduce(ctx)
    _pair_bf16_steps(ctx)

def _vectorize_reduction(ctx: OptContext) -> bool:
    """Step 3: no vectorizable output axis: the reduction itself vectorized with partial accumulators, along the
    innermost reduce loop contiguous in every load that depends on it (narrower vectors when its length isn't a
    multiple of the full width); dot products tiled over output loops that share its vector loads, or else a few
    vectors to hide the adds' latency. Returns whether it applied."""
    k = ctx.k
    if ctx.width < 2: return False
    if len(k.reduceops) != 1: return _vectorize_reductions(ctx)
    for r in reversed(ctx.reds):
        if (w := _reduce_vector_width(ctx, r)) is None or w < ctx.width:
            # (a loop a narrower vector divides is padded only when short: `_pad_short_reduce`)
            padded = _pad_reduce(ctx, r, ctx.width) if w is None else None
            if padded is None: padded = _pad_short_reduce(ctx, r, w)
            if padded is not None:
                r, w = padded, ctx.width
            elif w is None: continue
        rem, inner = ctx.split(OptOps.UPCAST, r, w)
        if inner is None: continue
        tiled = _tile_dot_products(ctx, inner)
        # else a few vector accumulators hide the latency of the adds
        if tiled < 4 and rem is not None and isinstance(rs := range_size(rem), int):
            if (extra := _largest_divisor(rs, (4, 2))) > 1 and rs >= 2 * extra: ctx.split(OptOps.UPCAST, rem, extra)
        _block_weight_gradient(ctx, tiled)
        _pack_aliased_lanes(ctx)
        return True
    return False

ALIAS_BYTES, ALIASED_LANES, ALIAS_MIN_REUSE = 4096, 4, 16

def _pack_aliased_lanes(ctx: OptContext) -> None:
    """A vectorized reduction's load whose upcast output lanes (a tile's channels) lie a multiple of 4 KB apart, at
    least ALIASED_LANES of them, is copied to a contiguous block (PACK) at the outermost output loop it moves with,
    where the output loops inside that it doesn't move with read the block ALIAS_MIN_REUSE times or more. Each step
    of the reduction otherwise loads one vector from each of those planes, all at one offset within a page: the
    64px ResNet-18 stem's weight gradient (planes of 32x32 floats, 4 channels of the output gradient per step) 1.45
    -> 1.05 ms on warm scratch buffers."""
    k = ctx.k
    outs = k.loops[:k.first_reduce]
    for idx in ctx.loads():
        if idx.src[0].op is not _DEFINE_GLOBAL or len(idx.src) > 2: continue
        item = idx.src[0].dtype.base.itemsize
        if not any(range_size(o) >= ALIASED_LANES and (c := coeff(idx.src[1], o)) not in (0, None) and
                   (c * item) % ALIAS_BYTES == 0 for o in k.expanded):
            continue
        moving = [i for i, o in enumerate(outs) if coeff(idx.src[1], o) != 0]
        if not moving: continue
        reuse = _trip_product([o for o in outs[moving[0] + 1:] if coeff(idx.src[1], o) == 0])
        if reuse < ALIAS_MIN_REUSE: continue
        try: k.apply_opt(Opt(OptOps.PACK, moving[0], idx.src[0].arg))
        except KernelOptError: continue
        return

GATHER_VECTORS = 2

def _vectorize_gathering_output(ctx: OptContext) -> bool:
    """Step 3b: a reduction that neither an output loop nor a reduce loop is contiguous along in all its loads: the
    innermost output loop its stores are contiguous along is vectorized all the same, where some load inside the
    reduction is contiguous along it too, and the loads strided along it are gathered lane by lane (as many scalar
    loads as the scalar code made, where each contiguous load is one vector). A layernorm's weight gradient whose
    input arrives transposed (the embeddings GPT-2's first residual adds), fused with AdamW: the output gradient is
    read along the features, the input across them. GATHER_VECTORS vectors per step: each step of the reduction then
    reads a whole cache line of the contiguous loads. Returns whether it applied."""
    k, width = ctx.k, ctx.width
    if len(k.reduceops) != 1 or width < 4 or (r := _store_loop(k)) is None or \
            not isinstance(sz := range_size(r), int) or sz % width:
        return False
    inside = [idx for idx in ctx.loads() if any(coeff(idx.src[1], q) != 0 for q in ctx.reds)]
    steps = [coeff(idx.src[1], r) for idx in inside]
    if 1 not in steps or any(c is None for c in steps) or \
            any(coeff(idx.src[1], r) not in (0, 1) for idx, st in k.accesses() if st):
        return False
    rest, inner = ctx.split(OptOps.UPCAST, r, width)
    if inner is None: return False
    if rest is not None and isinstance(rs := range_size(rest), int) and rs % GATHER_VECTORS == 0:
        ctx.split(OptOps.UPCAST, rest, GATHER_VECTORS)
    return True

WGRAD_BLOCK_BYTES, NARROW_WGRAD_UNROLL = 1 << 20, 2

def _block_weight_gradient(ctx: OptContext, tiled: int) -> None:
    """A convolution's weight gradient vectorized along the image rows it sums over in full vectors (rows of 56),
    whose inputs are bigger than WGRAD_BLOCK_BYTES and whose output is smaller (64x64x3x3 over 16 images of 56x56:
    12.8 MB of image and of output gradient for 147 KB of weights): the outermost reduce loop (the batch) is blocked
    through the output (KBLOCK) in blocks whose slices of the inputs fit WGRAD_BLOCK_BYTES (one image at least), so
    the output tiles read a block from the caches where each streamed both inputs whole from memory."""
    k = ctx.k
    if not (reds := k.reduce_axes()) or not isinstance(osz := range_size(outer := k.loops[reds[0]]), int) or osz < 2:
        return
    # (the window's taps kh, kw are output loops: one load (the image) moves with them, another (the output
    # gradient) doesn't; in the image a tap slides as a summed pixel loop does, or a stride of up to 4 times less
    # (oh * stride + kh). A matmul's few rows (a prompt's 5 tokens times the vocabulary) are no window: their row
    # steps over the whole contraction)
    loads = [idx for idx in ctx.loads() if idx.src[0].op is _DEFINE_GLOBAL]
    def slides(idx: UOp, w: UOp) -> bool:
        c = coeff(idx.src[1], w)
        return c not in (0, None) and any(coeff(idx.src[1], k.loops[i]) in (c, 2 * c, 3 * c, 4 * c) for i in reds)
    if not any(slides(idx, w) for w in _output_windows(k) for idx in loads): return
    # (only with full vectors: rows of 28 in 4-lane vectors are bound by their short loops, and measured no faster
    # blocked. Their batch is unrolled by 2 instead: each step of the row's 7-vector loop then holds two images'
    # multiply-adds, where it held one's behind the row's gates and loop overhead; BEAM's choice, about 1.25x)
    summed = {r for u in k.ast.toposort() if u.op is _REDUCE for r in u.src[1:]}
    if not any(r.arg[1] == "upcast" and range_size(r) == ctx.width and r in summed for r in k.expanded):
        # (not a tile of more than 16 accumulators, a sliding window's: unrolled, 16x64x56x56 15.4 -> 23 ms)
        if NARROW_WGRAD_UNROLL > 1 and osz % NARROW_WGRAD_UNROLL == 0 and tiled <= 16:
            k.apply_opt(Opt(OptOps.UNROLL, reds[0], NARROW_WGRAD_UNROLL))
        return
    sizes = [idx.src[0].dtype.size * idx.src[0].dtype.base.itemsize for idx in loads]
    stored = [idx.src[0].dtype.size * idx.src[0].dtype.base.itemsize for idx, st in k.accesses() if st]
    if not all(isinstance(n, int) for n in sizes + stored) or sum(sizes) <= WGRAD_BLOCK_BYTES or \
            sum(stored) > WGRAD_BLOCK_BYTES:
        return
    # (every load moves with the batch: a block of b images reads b / osz of each input)
    if any(coeff(idx.src[1], outer) in (0, None) for idx in loads): return
    blk = max((b for b in range(1, osz) if osz % b == 0 and sum(sizes) * b // osz <= WGRAD_BLOCK_BYTES), default=1)
    try: k.apply_opt(Opt(OptOps.KBLOCK, reds[0], blk))
    except KernelOptError: pass

def _tile_dot_products(ctx: OptContext, inner: UOp) -> int:
    """Output loops that some vector load of the reduction doesn't depend on share that load across their lanes
    (matrix-vector, a @ b.T): up to two of them upcast, 4x4 dot products at a time; then loops of 3 while the tile
    stays within 16 (a depthwise weight gradient's 3x3 taps, several times faster; before the others, they took 36
    accumulators where 16 ran faster). With 32 vector registers, a window that slides along the vector (a weight
    gradient's column taps: each tap's image vector is the row shifted by one, the output gradient's vector serves
    every tap) is upcast whole first and the tile may hold 24: its taps x 4 output channels (what the image doesn't
    move with) x 2 input channels, 16x64x56x56 26.5 -> 15.4 ms, where 4x4 channels loaded 8 vectors per 16 products.
    Returns the tile's size."""
    k, tiled, budget = ctx.k, 1, 16
    loads = ctx.loads()
    def shares(o: UOp) -> bool: return any(coeff(idx.src[1], o) == 0 and coeff(idx.src[1], inner) == 1 for idx in loads)
    outs = list(reversed([o for o in ctx.outs if o in k.loops]))
    window = next((o for o in outs if isinstance(sz := range_size(o), int) and 1 < sz <= 4 and shares(o) and
                   _slides_along(loads, o, inner)), None) if ctx.registers >= 32 else None
    if window is not None:
        if ctx.split(OptOps.UPCAST, window, range_size(window))[1] is not None:
            tiled, budget = range_size(window), ctx.registers * 3 // 4
            # (the loops the sliding load doesn't move with first: their shared vectors are the unshifted ones)
            sliding = [idx for idx in loads if coeff(idx.src[1], window) == 1 and coeff(idx.src[1], inner) == 1]
            outs = sorted([o for o in outs if o in k.loops],
                          key=lambda o: any(coeff(i.src[1], o) != 0 for i in sliding))
    for choices in ((4, 2), (3,)):
        for o in [o for o in outs if o in k.loops]:
            if isinstance(osz := range_size(o), int) and shares(o):
                amt = _largest_divisor(osz, tuple(c for c in choices if tiled * c <= budget))
                if amt > 1 and ctx.split(OptOps.UPCAST, o, amt)[1] is not None: tiled *= amt
    return tiled

def _slides_along(loads: list[UOp], window: UOp, inner: UOp) -> bool:
    """Whether some load moves by one element with output loop `window` as with the vector loop `inner`."""
    return any(coeff(idx.src[1], window) == 1 and coeff(idx.src[1], inner) == 1 for idx in loads)

POOL_STRIDES = (2, 3, 4)

def _strided_window(k: Kernel, r: UOp) -> bool:
    """Whether output loop `r` is a strided pool's output row: every load that moves with r moves by a pool stride
    (2 to 4). (The lowering takes such an upcast loop of a max as the vector axis: `lower.choose_vector_axis`.)"""
    accesses = k.accesses()
    steps = [coeff(idx.src[1], r) for idx, is_store in accesses if not is_store]
    return any(c != 0 for c in steps) and all(c == 0 or c in POOL_STRIDES for c in steps)

def _vectorize_strided_window(ctx: OptContext) -> bool:
    """Step 4a: a max pool whose window reads every second (third, fourth) pixel of a row (a 3x3 stride-2 pool) has
    no loop contiguous in its loads, so nothing above vectorized it, and a padded one is kept from gcc's loop
    vectorizer by its gated loads. Its output row is upcast to a vector all the same (each lane's taps are gathered
    one by one, the maxes are vector ones) and the window's row kw unrolled: in each copy the padding's comparisons of
    the row are constants per lane. Returns whether it applied."""
    k = ctx.k
    if k.applied_opts or not k.reduceops or any(red.arg is not _MAX for red in k.reduceops) or ctx.width < 4:
        return False
    # (each max's own window: a pool's first maximum is a second max, over the positions of the taps equal to it.
    # Where step 4 unrolls both windows whole, a 2x2 pool's, its scalar code is faster: 0.14 against 0.94 ms for
    # 16x32x32x32; a 3x3 one's, left to loops, 4.3 against 0.6 ms)
    windows = [[r for r in ctx.reds if r in red.src[1:]] for red in k.reduceops]
    for window in windows:
        taps = [range_size(r) for r in window]
        if not taps or not all(isinstance(n, int) for n in taps) or not 1 < math.prod(taps) <= 16: return False
    if len(windows) > 1 and math.prod(range_size(r) for r in ctx.reds) <= 16: return False
    if (r := _store_loop(k)) is None or not isinstance(sz := range_size(r), int): return False
    if not _strided_window(k, r): return False
    amt = _largest_divisor(sz, tuple(w for w in (ctx.width, ctx.width // 2) if w >= 4))
    if amt == 1: return False
    k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), amt))
    for window in windows:
        if range_size(window[-1]) > 1: k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(window[-1]), 0))
    # (another output loop's windows side by side: each vector's maxes wait on one another, as in `_chain_windows`)
    o = next((o for o in reversed(k.loops[:k.first_reduce]) if isinstance(range_size(o), int) and range_size(o) > 1),
             None)
    if o is not None and (chains := _largest_divisor(range_size(o), (WINDOW_CHAINS, 2))) > 1:
        k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(o), chains))
    return True

def _unroll_small_window(ctx: OptContext) -> None:
    """Step 4: with nothing vectorized, a small window (a pooling's 2x2 or 3x3) has its loops unrolled, so the compiler
    schedules the taps' loads and arithmetic together (max pool's backward, counting the taps equal to the max, runs
    twice as fast). Where its loads are gated (a strided pool's gradient: each input pixel takes the windows of its
    phase), the row the store is contiguous along is then upcast as `_vectorize_gated` does an elementwise kernel's."""
    k = ctx.k
    taps = [range_size(r) for r in ctx.reds]
    if not k.applied_opts and taps and all(isinstance(n, int) for n in taps) and 0 < math.prod(taps) <= 16:
        for r, n in zip(ctx.reds, taps):
            if n > 1: k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(r), 0))
        if not k.reduceops or any(red.arg is not Ops.ADD for red in k.reduceops): return
        # (and, as a strided pool's own windows, the next output loop's windows side by side: their rows share the
        # pooled gradient's rows and their sums don't wait on one another; ResNet-18's 3x3 stride-2 pool's gradient
        # over 16x64x32x32, warm, 0.82 -> 0.49 ms)
        row = _store_loop(k)
        o = next((o for o in reversed(k.loops[:k.first_reduce]) if o is not row and isinstance(range_size(o), int)
                  and range_size(o) > 1), None)
        if _vectorize_gated(k, ctx.width) and o in k.loops and \
                (chains := _largest_divisor(range_size(o), (WINDOW_CHAINS, 2))) > 1:
            k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(o), chains))

def _upcast_remainder_lanes(ctx: OptContext) -> None:
    """Step 5: still nothing applied: output loops that the loads divide by small constants, upcast so that each lane's
    loads are affine (scalar register tiles), then walked in memory order."""
    if not ctx.k.applied_opts and _upcast_remainders(ctx.k, ctx.budget * 2, innermost_only=False):
        _walk_in_memory_order(ctx.k)

def _upcast_output_windows(ctx: OptContext) -> None:
    """Step 6: still nothing applied: small output loops that a load doesn't move with (a depthwise weight gradient's
    kh, kw: each output is one tap) are upcast whole, so their accumulators share that load (the output gradient's)
    and add up independently, where one accumulator waited on every addition (several times faster)."""
    k = ctx.k
    if k.applied_opts: return
    for r in _output_windows(k):
        if math.prod(range_size(o) for o in k.expanded) * range_size(r) <= ctx.budget:
            # (refused where the loop's iterations read what the ones before stored: they must run in order)
            try: k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), 0))
            except KernelOptError: pass

REDUCE_REMAINDER_LANES = 16

def _unroll_reduce_remainders(ctx: OptContext) -> None:
    """Step 7: still nothing applied: reduce loops that the loads divide by small constants c (a batch norm's gradient
    summed over a strided convolution's input gradient, gathered from its phases) are unrolled by c, innermost first
    while the unrolled lanes stay under REDUCE_REMAINDER_LANES: in each lane the remainder is a constant, so its loads
    are affine and the selects between the phases fold, where every iteration computed and compared them all."""
    k = ctx.k
    if k.applied_opts: return
    lanes = 1
    for r in reversed([k.loops[i] for i in k.reduce_axes()]):
        if not isinstance(sz := range_size(r), int): continue
        c = max((c for c in _remainder_divisors(k, r) if 1 < c and lanes * c <= REDUCE_REMAINDER_LANES and
                 sz % c == 0), default=None)
        if c is None: continue
        k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(r), 0 if c == sz else c))
        lanes *= c

INDEPENDENT_SUMS, INDEPENDENT_SUMS_MIN_STEPS = 4, 16

def _independent_sums(ctx: OptContext) -> None:
    """Step 8: a reduction left in scalar code (nothing upcast along an output loop: its loads are strided along every
    loop, a batch norm's gradient gathered from a strided convolution's phases) has its innermost output loop upcast
    by INDEPENDENT_SUMS, so that many outputs' sums run side by side where each addition waited on the one before:
    ResNet-18's 128 channels over 16x8x8 (4 phases added per step) 0.10 -> 0.043 ms. Only over reductions of at
    least INDEPENDENT_SUMS_MIN_STEPS steps (a short one is no chain), and where the cores still split evenly."""
    k = ctx.k
    # (one reduction: several per row, a cross-entropy's max and sum over 10 classes, are short chains each)
    if len(k.reduceops) != 1 or any(range_kind(o) == "upcast" for o in k.expanded): return
    if _trip_product([k.loops[i] for i in k.reduce_axes()]) < INDEPENDENT_SUMS_MIN_STEPS: return
    for r in reversed(k.loops[:k.first_reduce]):
        if not isinstance(sz := range_size(r), int) or sz < 2: continue
        amt = _largest_divisor(sz, tuple(a for a in (INDEPENDENT_SUMS, 2) if _leaves_cores_even(ctx, r, a)))
        if amt > 1:
            try: k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), amt))
            except KernelOptError: pass
        return

def _broadcast_sharing(k: Kernel, vec: UOp) -> UOp | None:
    """The innermost output loop (other than the vector's) of at least 2 iterations that some load moves with neither
    along nor along the vector: a value broadcast to the vector's lanes, which that loop's lanes would share."""
    loads = [idx for idx, is_store in k.accesses() if not is_store]
    for r in reversed(k.loops[:k.first_reduce]):
        if r is vec or not isinstance(sz := range_size(r), int) or sz < 2: continue
        if any(coeff(idx.src[1], r) == 0 and coeff(idx.src[1], vec) == 0 and
               any(coeff(idx.src[1], q) != 0 for q in k.loops[k.first_reduce:]) for idx in loads): return r
    return None

def _output_windows(k: Kernel) -> list[UOp]:
    """Small output loops (up to 7 iterations) that some load doesn't move with, innermost first: a convolution's
    weight gradient's kh, kw, whose taps all read each value of the output gradient."""
    loads = [idx for idx, is_store in k.accesses() if not is_store]
    return [r for r in reversed(k.loops[:k.first_reduce]) if isinstance(sz := range_size(r), int) and 1 < sz <= 7
            and any(r not in idx.src[1].toposort() for idx in loads)]

def _walk_in_memory_order(k: Kernel) -> None:
    """The output loops reordered (outermost first) by their stride in the biggest buffer read, largest first, so
    that buffer is read in runs as long as its layout allows (_upcast_remainders' tiles stored as rows, from
    (36, channels, batch, tiles) values: channels outside the batch, as that buffer is laid out)."""
    loads = [idx for idx, is_store in k.accesses() if not is_store and isinstance(idx.src[0].dtype.size, int)]
    if not loads: return
    big = max(loads, key=lambda idx: idx.src[0].dtype.size)
    def stride(j: int) -> int:
        c = coeff(big.src[1], k.loops[j])
        return c if isinstance(c, int) else -1
    # (SWAP only reorders the loops: `big`'s index keeps naming them)
    for i in range(k.first_reduce):
        j = max(range(i, k.first_reduce), key=lambda j: (stride(j), -j))
        if stride(j) > stride(i): k.apply_opt(Opt(OptOps.SWAP, i, j))

def _unroll_reduce(ctx: OptContext) -> None:
    """Unroll the first reduce loop that 4 divides (of at least 8 iterations) by 4."""
    for r in [ctx.k.loops[i] for i in ctx.k.reduce_axes()]:
        if isinstance(sz := range_size(r), int) and sz % 4 == 0 and sz >= 8:
            ctx.split(OptOps.UNROLL, r, 4)
            return

def _pair_bf16_steps(ctx: OptContext) -> None:
    """A register-tiled product of bfloat16 operands, on a CPU whose C renderer computes two steps of its reduction
    as one bfloat16 dot product (renderer/cpu_dot.py: consecutive elements of the broadcast operand, A[m, k] and
    A[m, k + 1]): its reduce loop unrolled by 2 where the tile left it rolled (a tile of one vector per row), so
    that each pass holds a pair of steps."""
    k = ctx.k
    reds = [k.loops[i] for i in k.reduce_axes()]
    if not getattr(k.renderer, "bf16_dot", False) or len(reds) != 1 or \
            any(range_kind(x) == "unroll" for x in k.expanded) or \
            not isinstance(sz := range_size(r := reds[0]), int) or sz % 2 or sz < 4:
        return
    # (the broadcast operand: a bfloat16 load contiguous along the reduction and the same for every lane)
    vec = next((v for v in k.expanded if range_kind(v) == "upcast" and range_size(v) == DOT_LANES), None)
    if vec is None or not any(idx.src[0].dtype.base == dtypes.bfloat16 and coeff(idx.src[1], r) == 1 and
                              coeff(idx.src[1], vec) == 0 for idx in ctx.loads()):
        return
    ctx.split(OptOps.UNROLL, r, 2)

def _reduce_vector_width(ctx: OptContext, r: UOp) -> int | None:
    """The vector width reduce loop `r` can be vectorized with (partial accumulators as lanes): the widest of a full,
    half or quarter vector (of ctx.width) that divides it (one under ctx.min_lanes only if the loop is longer), if it
    is contiguous or broadcast in every access; else None."""
    sz, width = range_size(r), ctx.width
    if not isinstance(sz, int) or not all(c in (0, 1) for c, _ in ctx.strides(r)): return None
    return next((w for w in (width, width // 2, width // 4) if w >= 2 and sz % w == 0 and
                 (w >= ctx.min_lanes or sz > w)), None)

PAD_REDUCE_VECTORS = 4

def _lanes_per_cycle(ctx: OptContext, lanes: int) -> int:
    """The lanes a vector of `lanes` FMAs a cycle: two such instructions, one where they are 512 bits and the CPU
    splits them in halves (Zen 4: `full_rate_512` false)."""
    wide = lanes * ctx.acc_dt.itemsize > 32 and not getattr(ctx.k.renderer, "full_rate_512", False)
    return lanes if wide else 2 * lanes

PAD_SHORT_REDUCE_GAIN = 1.5

def _pad_short_reduce(ctx: OptContext, r: UOp, w: int | None) -> UOp | None:
    """Reduce loop r, contiguous or broadcast in every access, padded to whole full vectors (PADTO) where that wastes
    at most an eighth and its useful lanes go PAD_SHORT_REDUCE_GAIN times faster than the widest vector dividing it
    (`w`, None: none) would: a weight gradient over 28x28 images sums its rows of 28 in two vectors of 16 (4 padded
    lanes) rather than seven of 4, 26.7 -> 15.6 ms for 16x128x28x28, and 14 pixels in one of 16. Rows of 56 keep
    seven vectors of 8 where a 512-bit FMA runs at half rate (Zen 4); at full rate (Zen 5) they are four of 16.
    Returns the padded loop, or None."""
    sz, width = range_size(r), ctx.width
    if width < 2 or not isinstance(sz, int) or sz % width == 0 or not pads_cheaply(sz, width) or \
            not all(c in (0, 1) for c, _ in ctx.strides(r)):
        return None
    padded_rate = _lanes_per_cycle(ctx, width) * sz / (sz + -sz % width)
    if padded_rate < PAD_SHORT_REDUCE_GAIN * _lanes_per_cycle(ctx, w or 1): return None
    axis = ctx.k.loops.index(r)
    try: ctx.k.apply_opt(Opt(OptOps.PADTO, axis, width))
    except KernelOptError: return None
    padded = ctx.k.loops[axis]
    ctx.reds = [padded if q is r else q for q in ctx.reds]
    return padded

def _float_sum(ctx: OptContext, r: UOp) -> bool:
    """Whether a float sum reduces over loop r."""
    return any(u.op is _REDUCE and u.arg is _ADD and dtypes.is_float(u.dtype) and r in u.src[1:]
               for u in ctx.k.ast.toposort())

def _pad_reduce(ctx: OptContext, r: UOp, width: int) -> UOp | None:
    """Reduce loop r, contiguous or broadcast in every access but of a length no vector divides (a vocabulary of
    50257), padded to whole vectors of `width` lanes (PADTO: the padded iterations load nothing and add the
    reduction's identity) when it is at least 8 vectors long: then it is vectorized like any other, where it ran as
    scalar code. Returns the padded loop, or None."""
    sz = range_size(r)
    if width < 2 or not isinstance(sz, int) or sz < 8 * width or sz % width == 0 or \
            not all(c in (0, 1) for c, _ in ctx.strides(r)):
        return None
    axis = ctx.k.loops.index(r)
    # (to whole groups of PAD_REDUCE_VECTORS vectors where that wastes little: the vectors left are then split into
    # that many independent accumulators, where a loop of a prime count of vectors kept one. Not a float sum: fewer
    # terms per accumulator can bring it under the length that lowering blocks (SUM_BLOCKED_OVER), and its rounding
    # error would then grow with the row: 64 sums of 65537 tenths, each padded to 32 lanes, were off by 1.6e-5)
    group = width * PAD_REDUCE_VECTORS
    if not pads_cheaply(sz, group) or _float_sum(ctx, r): group = width
    try: ctx.k.apply_opt(Opt(OptOps.PADTO, axis, group))
    except KernelOptError: return None
    padded = ctx.k.loops[axis]
    ctx.reds = [padded if q is r else q for q in ctx.reds]
    return padded

GATED_ROW_UNROLL = 4

def _unroll_gated_row(k: Kernel, split_row: bool = False) -> None:
    """The innermost reduce loop, when short (up to GATED_ROW_UNROLL iterations) and compared in the gate of a load (a
    padded image's row: a convolution's kw, or the output pixels of a row that its weight gradient sums over), is
    unrolled whole: in each copy the padding's comparisons with it are constants, where every iteration of the loop
    computed them and selected the loads (the digits CNN's 32 -> 64 channels on 4x4 images: its forward and input
    gradient along their channels, and its weight gradient, each two to three times as fast)."""
    reds = [k.loops[i] for i in k.reduce_axes()]
    if not reds or not isinstance(sz := range_size(r := reds[-1]), int) or not 1 < sz <= GATED_ROW_UNROLL: return
    # only where those comparisons then fold: they compare r with nothing that is still a loop (the tile spans the
    # output row whole). A row tiled in parts left each copy its comparisons, and 12-pixel rows in tiles of 4 ran
    # slower; but an 8-pixel row in two halves (`split_row`, a 16-accumulator tile) ran faster unrolled
    def folds(gate: UOp) -> bool:
        cl = _clauses_with(clauses(gate), r)
        return bool(cl) and (split_row or _vary_with_no_other_loop(k, cl, r))
    if any(not st and len(idx.src) > 2 and folds(idx.src[2]) for idx, st in k.accesses()):
        k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(r), 0))

def _clauses_with(cl: list[UOp], r: UOp) -> list[UOp]:
    """The clauses of `cl` that vary with loop r."""
    return [c for c in cl if r in c.toposort()]

def _vary_with_no_other_loop(k: Kernel, cl: list[UOp], r: UOp) -> bool:
    """Whether every clause of `cl` varies with no loop of k but r: once r is expanded, each is a constant per lane."""
    loops = set(k.loops)
    return all(not any(u.op is _RANGE and u is not r and u in loops for u in c.toposort()) for c in cl)

def _upcast_padded_window_row(ctx: OptContext, accumulators: int) -> None:
    """A weight gradient over images no bigger than its window (3x3 over 2x2, padding 1: ResNet-18's last stage at
    64 px), its tile a window row kw and its image loops unrolled by `_unroll_windows`, still multiplied 20 of its 36
    tap and pixel pairs in padding: the window's other loop kh picked the gate per iteration. Upcast as well (where
    the tile's accumulators stay within three quarters of the registers), every gate is a constant per lane and the
    lowering drops the lanes in padding (512 channels, batch 16: 2.4 -> 1.45 ms; BEAM's choice is alike)."""
    k = ctx.k
    gates = [c for idx, st in k.accesses() if not st and len(idx.src) > 2 for c in clauses(idx.src[2])]
    for r in _output_windows(k):
        if not isinstance(sz := range_size(r), int) or accumulators * sz > ctx.registers * 3 // 4: continue
        # (a clause of some gate varies with r, and every clause that does with no other loop)
        if (cl := _clauses_with(gates, r)) and _vary_with_no_other_loop(k, cl, r):
            ctx.split(OptOps.UPCAST, r, sz)
            return

WINDOW_UNROLL_MIN_CHANNELS = 16

def _unroll_windows(k: Kernel, accumulators: int, registers: int) -> None:
    """A convolution's small window (kh, kw of at most 3: reduce loops whose index in a load moves as an output
    loop's does, as in oh + kh, or along the row, as kw) is unrolled, and the output loop its rows slide with upcast
    by 2 when the accumulators fit the registers: the two output rows then share most of their input rows, loaded
    once. With input channels around the window, only its rows are unrolled (kw stays a loop: the whole window's
    accumulators and taps don't fit the registers), and nothing under WINDOW_UNROLL_MIN_CHANNELS channels (an RGB
    image's 3: the loops are cheaper than the registers the unrolled taps take); a single channel's window is
    unrolled whole (few accumulators: the digits CNN's first layer runs almost twice as fast as with the rows
    alone). (A 7x7 window made code that compiled slowly and ran slower.)"""
    loads = [idx for idx, is_store in k.accesses() if not is_store]
    reds = [k.loops[i] for i in k.reduce_axes()]
    small = [r for r in reds if isinstance(sz := range_size(r), int) and sz <= 3]
    rows = [r for r in _sliding_windows(k) if r in small]
    windows = [r for r in small if r in rows or any(coeff(idx.src[1], r) == 1 for idx in loads)]
    channels = _trip_product([r for r in reds if r not in windows])
    if channels > 1: windows = rows if channels >= WINDOW_UNROLL_MIN_CHANNELS else []
    if not windows: return
    slides = [o for o in k.loops[:k.first_reduce] if isinstance(range_size(o), int) and range_size(o) % 2 == 0 and
              any((c := coeff(idx.src[1], o)) not in (0, None) and any(coeff(idx.src[1], w) == c for w in windows)
                  for idx in loads)]
    for w in windows: k.apply_opt(Opt(OptOps.UNROLL, k.loops.index(w), 0))
    if slides and 2 * accumulators <= registers: k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(slides[-1]), 2))

def _blockable(k: Kernel) -> bool:
    """Whether the outermost reduce loop can be blocked through the output (KBLOCK)."""
    try: k.kblock_reduce(k.reduce_axes()[0])
    except (KernelOptError, IndexError): return False
    return True

def _sliding_windows(k: Kernel, along: UOp | None = None) -> list[UOp]:
    """A convolution's window loops: small reduce loops (kernels up to 11 wide) that move the index of a load as an
    output loop does, or a stride of up to 4 times less (as in oh * stride + kh). With `along`, only those of the
    loads that vary along that loop."""
    outs, reds = k.loops[:k.first_reduce], [k.loops[i] for i in k.reduce_axes()]
    loads = [idx for idx, is_store in k.accesses() if not is_store and
             (along is None or coeff(idx.src[1], along) not in (0, None))]
    def slides(idx: UOp, r: UOp, sz: int) -> bool:
        # (an output loop that steps over all of r is an outer dim, not a slide: the batch over 3 input channels)
        c = coeff(idx.src[1], r)
        return c not in (0, None) and any((co := coeff(idx.src[1], o)) in (c, 2 * c, 3 * c, 4 * c) and co != sz * c
                                          for o in outs)
    return [r for r in reds if isinstance(sz := range_size(r), int) and sz <= 11 and
            any(slides(i, r, sz) for i in loads)]

def _block_matmul(k: Kernel, rest: UOp | None, vec: UOp, row_bytes: int, cores: int, conv: bool = False) -> None:
    """Cache blocking of a register-tiled matmul-like kernel. The columns (the vectorized axis) go outermost, in one
    chunk per core (or the rows, where the kernel updates buffers shaped like its output: `_rows_outermost`); long
    reductions are blocked through the output (KBLOCK); the block of the input that is broadcast across rows is
    copied to a contiguous local buffer (PACK) that every row tile then reads from L1. (`conv`: the kernel is a
    convolution.)"""
    if rest is None or rest not in k.loops or not isinstance(osz := range_size(rest), int) or osz < 2: return
    # (not for a convolution whose core's share of a contiguous output row would be under 4 cache lines: both cores
    # then write the lines at the chunks' edges, and an image row of 56 floats isn't even line-aligned. Its outer
    # loop, the batch, goes to the cores instead.)
    narrow = osz // cores * row_bytes < 256 and conv and \
        all(coeff(idx.src[1], vec) == 1 for idx, st in k.accesses() if st)
    rows_outer, at = False, 0
    if not narrow:
        # a batched matmul's batch loops (leading output loops that every load moves with) stay outermost: each
        # batch is a matmul of its own whose column panels are reused by its row tiles. (With the columns outside
        # the batch, a panel is left for 35 other batches' before the next row tile reads it, and Winograd's 36
        # matmuls ran at less than half the speed.)
        # (only when the outermost batch loop splits evenly across the cores: it is the loop they share)
        loads = [idx for idx, st in k.accesses() if not st]
        at = 0
        while at < k.first_reduce and k.loops[at] is not rest and \
                all(coeff(idx.src[1], k.loops[at]) != 0 for idx in loads):
            at += 1
        if at and not (isinstance(bsz := range_size(k.loops[0]), int) and bsz % cores == 0): at = 0
        # (a contraction of a few rows has no panel worth keeping: its biggest input is read once instead, in
        # memory order, each block of it used by all the output loops it doesn't move with, as in Winograd's weight
        # transform, 9 taps to 36 positions of each channel pair)
        red_rows = _trip_product([k.loops[i] for i in k.reduce_axes()])
        if red_rows < 16: _walk_in_memory_order(k)
        elif _rows_outermost(k, vec, red_rows, conv or at > 0): rows_outer = True
        elif k.loops.index(rest) != at: k.apply_opt(Opt(OptOps.SWAP, at, k.loops.index(rest)))
        osz = range_size(k.loops[0])
        if k.first_reduce >= 2 and isinstance(osz, int) and osz > cores and osz % cores == 0:
            # (in CHUNKS_PER_THREAD pieces per core where they divide it: a core that finishes early takes another;
            # in as few as `_rows_inside_columns` can take, where it will stream a big operand once per chunk)
            pieces = (CHUNKS_PER_THREAD, 2, 1) if rows_outer or conv or at or \
                (fewest := _fewest_column_chunks(k, vec, row_bytes, osz // cores)) is None else (fewest, 2, 1)
            k.apply_opt(Opt(OptOps.SPLIT, 0, next(cores * m for m in pieces
                                                  if osz % (cores * m) == 0 and osz > cores * m)))
    red = [k.loops[i] for i in k.reduce_axes()]
    if not red or not isinstance(rsz := range_size(red[0]), int): return
    # the outermost reduce loop (a convolution's input channels, its window inside) is blocked so that a block's
    # panel has 128 to 512 rows: the largest such block that divides it (784 = 2 x 392, 1000 = 2 x 500; 512 channels
    # of a 3x3 window: 32 x 9)
    inner = _trip_product(red[1:])
    # (of those, one that divides the periods a load's index divides the loop by or takes it modulo (512 tokens read
    # as 4 sequences of 128 from a (batch, heads, tokens, 64) layout): within a block the index is then affine, where
    # a block of 256 divided and took every step modulo 128)
    periods = _remainder_divisors(k, red[0])
    def block_fits(b: int) -> bool:
        return rsz % b == 0 and 128 <= b * inner <= 512 and b * inner * row_bytes <= k.MAX_LOCAL_BYTES
    blk = next((b for b in range(rsz - 1, 0, -1) if block_fits(b) and all(m % b == 0 for m in periods)), None)
    if blk is None and periods: blk = next((b for b in range(rsz - 1, 0, -1) if block_fits(b)), None)
    # (a loop of a length that no such block divides, a vocabulary of 50257, is padded to whole blocks when that wastes
    # little: its padded iterations load nothing and add zero. Unblocked, the panel is the whole reduction and isn't
    # packed)
    if blk is None and inner == 1 and rsz > 512:
        blk = next((b for b in (512, 384, 256) if 16 * (-rsz % b) <= rsz), None)
        if blk is not None:
            try:
                k.kblock_reduce(k.loops.index(red[0]))
                k.apply_opt(Opt(OptOps.PADTO, k.loops.index(red[0]), blk))
            except KernelOptError: blk = None
            red = [k.loops[i] for i in k.reduce_axes()]
    # a convolution that stores its output vector strided (its channels a plane apart: the NCHW images of a late
    # layer, a few pixels each) keeps its reduction whole where the whole panel fits a copy: blocked, each block's
    # partial sums went out and back through gathers and scatters (512 channels x 3 x 3 over 2x2 images: 16 blocks),
    # while unblocked the panel's vectors, each shared by a register tile's rows, stream from L2 at no cost
    if conv and blk is not None and rsz * inner * row_bytes <= k.MAX_LOCAL_BYTES and \
            any(coeff(idx.src[1], vec) not in (0, 1) for idx, st in k.accesses() if st):
        blk = None
    if blk is not None and rsz * inner > 384:
        try: k.apply_opt(Opt(OptOps.KBLOCK, k.loops.index(red[0]), blk))
        except KernelOptError: pass
    if not rows_outer and not conv and at == 0: _rows_inside_columns(k, vec, row_bytes)
    # pack the vector load that is strided along the reduction or the vector lanes, inside the last output loop it
    # depends on
    red = [k.loops[i] for i in k.reduce_axes()]
    outs = k.loops[:k.first_reduce]
    for idx, is_store in k.accesses():
        if is_store or idx.src[0].op is not _DEFINE_GLOBAL or coeff(idx.src[1], vec) == 0: continue
        if coeff(idx.src[1], red[0]) in (0, 1) and coeff(idx.src[1], vec) == 1: continue
        deps = [i for i, o in enumerate(outs) if o in idx.toposort()]
        if not deps or deps[-1] == len(outs) - 1: continue
        reuse = 1
        for o in outs[deps[-1] + 1:]: reuse *= range_size(o) if isinstance(range_size(o), int) else 1
        if reuse < 4: continue
        try: k.apply_opt(Opt(OptOps.PACK, deps[-1], idx.src[0].arg))
        except KernelOptError: pass
        break
    # with the rows outermost, the rows' block of the operand broadcast along the vector (strided along the reduction:
    # a weight gradient's output gradient, read transposed) is the one every column tile reuses
    for idx, is_store in k.accesses() if rows_outer else ():
        if is_store or idx.src[0].op is not _DEFINE_GLOBAL or coeff(idx.src[1], vec) != 0 or \
                coeff(idx.src[1], red[0]) in (0, 1, None):
            continue
        deps = [i for i, o in enumerate(outs) if o in idx.toposort()]
        if not deps or deps[-1] == len(outs) - 1: continue
        if math.prod(s if isinstance(s := range_size(o), int) else 1 for o in outs[deps[-1] + 1:]) < 4: continue
        try: k.apply_opt(Opt(OptOps.PACK, deps[-1], idx.src[0].arg))
        except KernelOptError: pass
        break

def _pack_whole_panel(k: Kernel, vec: UOp, cores: int) -> None:
    """A convolution whose output vector takes its channels whole (no column loop left: 16 channels on AVX-512) and
    whose weights are strided along them: the outermost loop is split into one chunk per core and the weights copied
    (PACK) once per chunk, contiguous along the channels, where the loops inside reuse them at least 4 times."""
    outs = k.loops[:k.first_reduce]
    if not outs or not isinstance(osz := range_size(outs[0]), int): return
    idx = next((idx for idx, st in k.accesses() if not st and idx.src[0].op is _DEFINE_GLOBAL and
                coeff(idx.src[1], vec) not in (0, 1) and not any(o in idx.src[1].toposort() for o in outs)), None)
    if idx is None: return
    if osz > cores and osz % cores == 0: k.apply_opt(Opt(OptOps.SPLIT, 0, cores))
    if math.prod(s if isinstance(s := range_size(o), int) else 1 for o in k.loops[1:k.first_reduce]) < 4: return
    try: k.apply_opt(Opt(OptOps.PACK, 0, idx.src[0].arg))
    except KernelOptError: pass

TRANSPOSED_PANEL_BYTES, COLUMN_BLOCK_BYTES = 1 << 20, 1 << 19

def _broadcast_operand(k: Kernel, vec: UOp, red: UOp) -> UOp | None:
    """The INDEX of the global load broadcast along the vector that moves with reduce loop `red` (a matmul's left
    operand), with its size in bytes over TRANSPOSED_PANEL_BYTES; None if there is none or it is smaller."""
    idx = next((idx for idx, st in k.accesses() if not st and idx.src[0].op is _DEFINE_GLOBAL and
                coeff(idx.src[1], vec) == 0 and coeff(idx.src[1], red) not in (0, None)), None)
    if idx is None or not isinstance(n := idx.src[0].dtype.size, int) or \
            n * idx.src[0].dtype.base.itemsize <= TRANSPOSED_PANEL_BYTES:
        return None
    return idx

def _fewest_column_chunks(k: Kernel, vec: UOp, row_bytes: int, panels: int) -> int | None:
    """For a matmul whose operand broadcast along the vector is over TRANSPOSED_PANEL_BYTES (`_rows_inside_columns`
    streams it once per chunk of columns): the fewest chunks per core (1, 2 or CHUNKS_PER_THREAD) whose column
    block, by a block of the reduction of up to 512, fits COLUMN_BLOCK_BYTES; None for other kernels. (GPT-2's tied
    embedding gradient, 50257 x 768 over 512 tokens: 185 GFLOPS in 4 chunks per core, 263 in 2, its 103 MB operand
    streamed half as often.)"""
    reds = [k.loops[i] for i in k.reduce_axes()]
    if not reds or not isinstance(rsz := range_size(reds[0]), int) or _broadcast_operand(k, vec, reds[0]) is None:
        return None
    return next((m for m in (1, 2) if panels // m * row_bytes * min(rsz, 512) <= COLUMN_BLOCK_BYTES), CHUNKS_PER_THREAD)

def _rows_inside_columns(k: Kernel, vec: UOp, row_bytes: int) -> None:
    """A matmul whose operand broadcast along the vector is bigger than TRANSPOSED_PANEL_BYTES has its row tiles
    outside its column tiles, where the other operand's block (a core's columns by a block of the reduction) fits
    COLUMN_BLOCK_BYTES (L2). With the column tiles outside, every column tile streamed the whole broadcast operand
    again from memory; now each row tile's block stays in L1 while all the column tiles use it, and the column
    block is read from L2:
    - read transposed (strided along the reduction, contiguous along the rows: a weight gradient's output gradient,
      the tied embedding's logits gradient), that operand's row tile is packed (PACK) once per row tile: each row
      tile touched one cache line per step of the reduction (as many streams as the block is long, which the
      prefetchers don't follow), now its lines are read once and copied contiguously;
    - read along the reduction (a plain matmul's left operand), the other operand's column block is packed once per
      block of the reduction (PACK of the loop outside the columns) in panel order, so the column tiles read it in
      one stream.
    (`row_bytes`: the bytes of a column tile's row.)"""
    outs, reds = k.loops[:k.first_reduce], [k.loops[i] for i in k.reduce_axes()]
    if not reds or (idx := _broadcast_operand(k, vec, reds[0])) is None: return
    deps = [i for i, o in enumerate(outs) if o in idx.src[1].toposort()]
    # (the rows: the innermost output loop it moves with, right inside a column loop it doesn't move with)
    if not deps or (rows := deps[-1]) == 0 or rows - 1 in deps: return
    cols = outs[rows - 1]
    if not isinstance(csz := range_size(cols), int) or not isinstance(kb := range_size(reds[0]), int) or \
            csz < 2 or csz * row_bytes * kb > COLUMN_BLOCK_BYTES:
        return
    transposed = coeff(idx.src[1], reds[0]) != 1
    # (the column operand: the load inside the reduction that moves with the columns and the vector; not an
    # epilogue's, a bias or a residual)
    panel = next((i for i, st in k.accesses() if not st and i.src[0].op is _DEFINE_GLOBAL and
                  coeff(i.src[1], vec) == 1 and coeff(i.src[1], reds[0]) not in (0, None) and
                  cols in i.src[1].toposort()), None)
    if not transposed and (panel is None or rows < 2): return
    try:
        k.apply_opt(Opt(OptOps.SWAP, rows - 1, rows))
        if transposed:
            _pack_whole_lines(k, rows - 1, idx)
            k.apply_opt(Opt(OptOps.PACK, rows - 1, idx.src[0].arg))
    except KernelOptError: return
    if panel is not None and rows >= 2:
        try: k.apply_opt(Opt(OptOps.PACK, rows - 2, panel.src[0].arg))
        except KernelOptError: pass

CACHE_LINE = 64

def _pack_whole_lines(k: Kernel, axis: int, idx: UOp) -> None:
    """The loop of row tiles at `axis`, whose tile of the transposed operand `idx` is packed per tile, split so that
    one copy takes as many tiles as fill a cache line per step of the reduction (2 of 8 float rows): each tile's copy
    read half of every line, the same lines again for the next tile, one strided miss per step. (A weight gradient's
    3072 x 768 over 512 tokens: 269-276 -> 286-291 GFLOPS; without the copy at all the kernel ran 300-314.)"""
    tile = math.prod(range_size(u) for u in k.expanded if range_kind(u) == "upcast" and coeff(idx.src[1], u) == 1)
    per_line = CACHE_LINE // (tile * idx.src[0].dtype.base.itemsize)
    if per_line < 2 or not isinstance(sz := range_size(k.loops[axis]), int) or sz <= per_line: return
    try:
        # (a count of tiles the copies don't divide is padded, where that is a small share: the tied embedding's
        # 50257 rows are 6283 tiles of 8, padded to 6284; the padded tile's rows are gated, never read or stored)
        if sz % per_line:
            if sz < 16 * per_line: return
            k.apply_opt(Opt(OptOps.PADTO, axis, per_line))
            sz = range_size(k.loops[axis])
        k.apply_opt(Opt(OptOps.SPLIT, axis, sz // per_line))
    except KernelOptError: pass

ROWS_OUTER_MIN_OUTPUTS = 1 << 16

def _rows_outermost(k: Kernel, vec: UOp, red_rows: int, excluded: bool) -> bool:
    """Whether a matmul's row tiles go outermost instead of its column panels: where, after a short reduction (one
    KBLOCK leaves whole), it updates buffers shaped like its output in place (a weight and an optimizer's state,
    updated with the gradient the kernel computes). Column panels walk those buffers down their rows, a cache line
    per row and buffer; row tiles walk them along the rows, while the reduction's other operand, short, is read by
    every row tile from the caches. (An MLP's 784x512 weight gradient with Adam's update: about 1.5x as fast; a 10x512
    one, whose buffers stay in the caches either way, keeps its column panels.)"""
    sizes = [idx.src[0].dtype.size for idx, st in k.accesses() if st]
    if excluded or red_rows > 384 or not any(isinstance(n, int) and n >= ROWS_OUTER_MIN_OUTPUTS for n in sizes):
        return False
    reds = {k.loops[i] for i in k.reduce_axes()}
    outs = [o for o in k.loops[:k.first_reduce] if o is not vec]
    # buffers read and written back in place (k.accesses() lists such an access once, as a store). Not a buffer only
    # read after the reduction: a convolution's residual measured no faster with its rows outermost
    stored = {idx for idx, st in k.accesses() if st}
    updated = {u.src[0] for u in k.ast.toposort() if u.op is _LOAD and u.src[0] in stored}
    return any(not (reds & set(idx.toposort())) and coeff(idx.src[1], vec) not in (0, None) and
               any(coeff(idx.src[1], o) not in (0, None) for o in outs) for idx in updated)

def _block_strided_reduce(ctx: OptContext) -> None:
    """A reduction over a strided axis with no reuse (a column sum): rows are read in blocks, each block added to the
    output, so every row is read once, contiguously, by the core that owns its columns."""
    k, cores = ctx.k, ctx.cores
    red = [k.loops[i] for i in k.reduce_axes()]
    if len(red) != 1 or not isinstance(rsz := range_size(red[0]), int) or rsz < 64 or rsz % 8: return
    if any(c in (0, 1) for c, st in ctx.strides(red[0]) if not st): return
    if k.first_reduce == 1 and isinstance(osz := range_size(k.loops[0]), int):
        chunks = next((t for t in (cores, 2 * cores, 4 * cores) if osz % t == 0 and osz > t), None)
        if chunks is not None: k.apply_opt(Opt(OptOps.SPLIT, 0, chunks))
    if k.first_reduce >= 2:
        try: k.apply_opt(Opt(OptOps.KBLOCK, k.loops.index(red[0]), _largest_divisor(rsz, (32, 16, 8))))
        except KernelOptError: pass

SELECTOR_LANES = 64

def _unroll_selectors(k: Kernel, width: int) -> bool:
    """An elementwise kernel whose small output loops choose between gated loads (a concatenation or stack along
    them) has those loops unrolled: in each lane the gates are constants, so only its own branch is loaded and
    computed, where every element evaluated the gated loads of all branches (a 6x6 tile built as rows of sums of
    slices: about a hundred times faster). The compiler doesn't vectorize the unrolled body, so the innermost loop
    left that the store moves along is vectorized here. Returns whether it applied."""
    def compared(gate: UOp) -> set[UOp]:
        """The loops that a clause of the gate compares by themselves with a constant (as in `i < 2`; a padding's
        clauses compare sums of loops)."""
        if gate.op is _AND: return compared(gate.src[0]) | compared(gate.src[1])
        if gate.op in GroupOp.Comparison and {s.op for s in gate.src} == {_RANGE, _CONST}:
            return {s for s in gate.src if s.op is _RANGE}
        return set()
    gates = [compared(idx.src[2]) for idx, is_store in k.accesses() if not is_store and len(idx.src) > 2]
    selectors = [r for r in k.loops[:k.first_reduce] if isinstance(sz := range_size(r), int) and 1 < sz <= 8 and
                 sum(1 for g in gates if r in g) >= 2]
    if not selectors or math.prod(range_size(r) for r in selectors) > SELECTOR_LANES: return False
    for r in selectors: k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), 0))
    stores = [idx for idx, is_store in k.accesses() if is_store]
    for r in reversed(k.loops[:k.first_reduce]):
        if not isinstance(sz := range_size(r), int) or all(coeff(idx.src[1], r) == 0 for idx in stores): continue
        if (amt := _largest_divisor(sz, tuple(w for w in (width, width // 2, width // 4) if w >= 2))) > 1:
            k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), amt))
        break
    return True

TRANSPOSE_TILE = 32

def _tile_transpose(k: Kernel) -> bool:
    """An elementwise kernel that reads a buffer transposed (contiguous along output loop i, strided along the loop j
    the output is contiguous along) runs in 32x32 tiles, each copied to L1 (PACK) with contiguous reads and written
    out from there: both sides of the copy then touch whole cache lines, and power-of-two strides stop evicting
    each other (a large transpose runs an order of magnitude faster). Returns whether it applied."""
    t = TRANSPOSE_TILE
    accesses = k.accesses()
    stores = [idx for idx, is_store in accesses if is_store]
    outs = k.loops[:k.first_reduce]
    j = next((r for r in reversed(outs) if all(coeff(idx.src[1], r) == 1 for idx in stores)), None)
    if j is None: return False
    for idx, is_store in accesses:
        if is_store or coeff(idx.src[1], j) in (0, 1): continue
        # (the tile copy is what makes the tiles pay, and it can only copy a buffer the kernel reads in one place)
        if sum(1 for other, _ in accesses if other.src[0] is idx.src[0]) > 1: continue
        i = next((r for r in outs if r is not j and coeff(idx.src[1], r) == 1), None)
        if i is None: continue
        sizes = (range_size(i), range_size(j))
        # (a slice that small fits L1 as a whole: tiling it gains nothing)
        if not all(isinstance(sz, int) and sz % t == 0 and sz >= 2 * t for sz in sizes): continue
        # split both loops into tiles and move the tile loops inside: ..., i/t, ..., j/t, i%t, j%t
        if (ai := k.loops.index(i)) > k.loops.index(j): continue
        w = _register_transpose_width(k, idx)
        k.apply_opt(Opt(OptOps.SPLIT, ai, sizes[0] // t))
        k.apply_opt(Opt(OptOps.SPLIT, aj := k.loops.index(j), sizes[1] // t))
        k.apply_opt(Opt(OptOps.SWAP, ai + 1, aj))
        if w > 1 and t % w == 0:
            k.apply_opt(Opt(OptOps.UPCAST, len(k.loops) - 1, w))
        k.apply_opt(Opt(OptOps.PACK, len(k.loops) - 3, idx.src[0].arg))
        return True
    return False

def _register_transpose_width(k: Kernel, idx: UOp) -> int:
    """The vector count whose blocks the tile copy of load `idx` can transpose in registers (its PACK with the
    output's inner loop upcast that far: a TRANSPOSED_COPY), or 1. Each 16x16 block is 16 loads, 64 shuffles and 16
    stores where the element-by-element copy took 256 of each: a Winograd transform's 2304x512 transpose (b8, 64px
    ResNet-18) 0.20 -> 0.07 ms on warm buffers."""
    dt = idx.dtype.base
    if not getattr(k.renderer, "transposed_copy", False) or dt not in getattr(k.renderer, "vector_dtypes", ()) or \
            len(idx.src) > 2:
        return 1
    # (a load only ever converted is packed converted, element by element)
    topo = k.ast.toposort()
    loads = {u for u in topo if u.op is _LOAD and u.src[0] is idx}
    if all(u.op is _CAST for u in topo if any(x in loads for x in u.src)): return 1
    return max(getattr(k.renderer, "simd_bytes", 0) // dt.itemsize, 1)

REMAINDER_LANES = 8

REMAINDER_TILE_LANES = 16

def _upcast_remainder_rows(k: Kernel) -> None:
    """After the store loop's remainder (`_upcast_remainders`), the output loops outside it that the loads also take
    divided and modulo a small constant c (the rows of Winograd's 4x4 output tiles read as an image), innermost
    first, upcast by c while the lanes stay within REMAINDER_TILE_LANES: each lane's loads are affine in every loop
    left, where the row's remainder was computed and its loads addressed per row (ResNet-18's 64px forward, its
    batch norm over the tiles of 16x16 images, warm: 0.031 -> 0.022 ms)."""
    # (the store loop's remainder, upcast already, no longer divides: what is left of it steps by c)
    applied = math.prod(range_size(o) for o in k.expanded if range_kind(o) == "upcast")
    _upcast_remainders(k, REMAINDER_TILE_LANES // applied, innermost_only=False)

def _remainder_divisors(k: Kernel, r: UOp) -> set[int]:
    """The constants that a load's index divides output loop r by or takes it modulo (r with coefficient 1)."""
    return {u.src[1].arg for idx, is_store in k.accesses() if not is_store for u in idx.src[1].toposort()
            if u.op in (_IDIV, _MOD) and u.src[1].op is _CONST and coeff(u.src[0], r) == 1}

def _store_loop(k: Kernel, strided: bool = False) -> UOp | None:
    """The innermost output loop that every store is contiguous along (with `strided`: moves along, by any step), or
    doesn't move with at all (a per-row statistic stored beside the rows, a batch norm's inverse deviation: made
    once outside the loop), some store moving."""
    stores = [idx for idx, is_store in k.accesses() if is_store]
    def fits(c: int | None) -> bool: return c not in (0, None) if strided else c == 1
    def moves(r: UOp) -> bool:
        steps = [coeff(idx.src[1], r) for idx in stores]
        return all(c == 0 or fits(c) for c in steps) and any(fits(c) for c in steps)
    return next((r for r in reversed(k.loops[:k.first_reduce]) if moves(r)), None)

def _vectorize_gated(k: Kernel, width: int, strided: bool = False) -> bool:
    """An elementwise kernel with gated loads (a padded copy, a reflecting pad, a concatenation along the rows),
    which gcc's loop vectorizer isn't given (see the C renderer: it miscompiles their masks), has the innermost loop
    the store is contiguous along upcast to our own vectors, whose gated loads are masked vector loads: padded to
    whole vectors when no vector width divides it, the padding never stored (zero and reflecting pads run several
    times faster). With `strided`, the loop left once a remainder's lanes were upcast, which the store moves along by
    their count (linear upsampling by 2), as far as a vector divides it. Returns whether it applied."""
    if width < 2 or not any(len(idx.src) > 2 for idx, is_store in k.accesses() if not is_store): return False
    if (r := _store_loop(k, strided)) is None or not isinstance(sz := range_size(r), int) or sz < 4: return False
    divisor = _largest_divisor(sz, tuple(w for w in (width, width // 2, width // 4) if w >= 4))
    # (full vectors over the padded loop rather than quarter ones that divide it, unless the padding wastes more
    # than a quarter: a reflecting pad's 68 columns ran faster as 5 vectors of 16 than as 17 of 4)
    pad = not strided and sz % width != 0 and sz % (width // 2) != 0 and 4 * (-sz % width) <= sz + (-sz % width)
    amt = width if pad else divisor
    if amt == 1: return False
    axis = k.loops.index(r)
    try:
        if pad: k.apply_opt(Opt(OptOps.PADTO, axis, width))
        k.apply_opt(Opt(OptOps.UPCAST, axis, amt))
    except KernelOptError: return False
    return True

def _split_at_remainders(k: Kernel) -> bool:
    """An elementwise kernel whose loads take the innermost loop the store moves along modulo (or divided by) a
    constant c too big to upcast, that c divides (a tensor repeated along its rows: x.repeat(2, 2)), has that loop
    split into blocks of c: within a block the loads are contiguous again, and the compiler vectorizes the block's
    loop. Returns whether it applied."""
    if (r := _store_loop(k)) is None or not isinstance(sz := range_size(r), int): return False
    c = max((c for c in _remainder_divisors(k, r) if c > REMAINDER_LANES and sz % c == 0 and sz > c), default=None)
    if c is None: return False
    try: k.apply_opt(Opt(OptOps.SPLIT, k.loops.index(r), sz // c))
    except KernelOptError: return False
    return True

def _upcast_remainders(k: Kernel, lanes: int = REMAINDER_LANES, innermost_only: bool = True) -> bool:
    """An output loop whose loads take it divided and modulo a small constant c (tiles laid out as image rows: the
    pixel 4*tx + j read from tile tx, position j) is upcast by c: in each lane the remainder is a constant, so the
    loads are affine again in the loop left. In an elementwise kernel, the innermost loop the store moves along,
    which the compiler then vectorizes (Winograd's output tiles to NCHW, nearest upsampling, a pixel shuffle); in a
    reduction with nothing vectorized (a small matmul whose 4x4 tiles are stored as image rows, as Winograd's output
    transform would be if it wrote NCHW itself), every such loop from the innermost while the lanes (accumulators)
    fit `lanes`: a tile's 4x4 outputs share each load of its transformed values. Returns whether it applied."""
    if innermost_only: cands = [r] if (r := _store_loop(k)) is not None else []
    else: cands = list(reversed(k.loops[:k.first_reduce]))
    applied = 1
    for r in cands:
        if not isinstance(sz := range_size(r), int): continue
        c = max((c for c in _remainder_divisors(k, r) if 1 < c <= lanes // applied and sz % c == 0 and sz > c),
                default=None)
        if c is None: continue
        k.apply_opt(Opt(OptOps.UPCAST, k.loops.index(r), c))
        applied *= c
    return applied > 1
