"""Code generation: kernel AST -> optimized, lowered, linearized UOps -> source (`get_program`)."""
from __future__ import annotations
import hashlib
from fusegrad.codegen.bounds import bound_sum_loops
from fusegrad.codegen.expand import vectorize
from fusegrad.codegen.gather import collapse_gathers
from fusegrad.codegen.gpu import launch_dims, launch_grid
from fusegrad.codegen.linearize import linearize
from fusegrad.codegen.lower import lower_kernel
from fusegrad.codegen.opt import Kernel, Opt, kernel_name
from fusegrad.codegen.opt.heuristic import hand_coded_optimizations
from fusegrad.codegen.opt.heuristic_gpu import gpu_optimizations
from fusegrad.codegen.opt.tc import fuse_wmma
from fusegrad.codegen.prefetch import prefetch_copied_rows, prefetch_streams
from fusegrad.codegen.reuse import store_once
from fusegrad.codegen.store_order import order_lane_stores
from fusegrad.codegen.transcendental import rewrite_transcendental
from fusegrad.dtype import PtrDType, dtypes
from fusegrad.helpers import NOOPT
from fusegrad.renderer import Estimates, ProgramSpec, Renderer
from fusegrad.uop.affine import range_size
from fusegrad.uop.ops import GroupOp, Ops, UOp, toposort_memo

from fusegrad.uop.symbolic import simplify_indexing

def optimize(ast: UOp, renderer: Renderer, opts: list[Opt] | None = None) -> tuple[UOp, tuple[Opt, ...], float]:
    """The AST with loops shaped by `opts` (default: the heuristics, none with NOOPT=1), the opts applied, and the
    fraction of its loop iterations that do useful work (less than 1 where loops were padded)."""
    k = Kernel(collapse_gathers(ast), renderer)
    if opts is not None:
        for o in opts: k.apply_opt(o)
    elif not NOOPT and not k.in_order: gpu_optimizations(k) if k.gpu else hand_coded_optimizations(k)
    return k.get_optimized_ast(), tuple(k.applied_opts), k.useful

def lower(opt_ast: UOp, renderer: Renderer, use_fma: bool = True, quick: bool = False) -> UOp:
    """An optimized AST lowered: expanded axes unrolled, reductions in registers, the vector axis as SIMD lanes
    (`quick`: only the vector axes and partial accumulators expanded, see lower_kernel)."""
    return _lower(opt_ast, renderer, use_fma, quick)[0]

def _lower(opt_ast: UOp, renderer: Renderer, use_fma: bool, quick: bool) -> tuple[UOp, bool]:
    """`lower`, and whether `quick` rolled anything into loops (else the program is the full one)."""
    sink, ctx = lower_kernel(bound_sum_loops(store_once(opt_ast, renderer)), renderer, use_fma=use_fma, quick=quick)
    # (a WMMA comes only from the TC opt, which only a renderer with tensor cores takes: the others skip the walk)
    if renderer.tensor_cores: sink = fuse_wmma(sink)
    if getattr(renderer, "has_local", False): sink = launch_grid(sink, tuple(getattr(renderer, "global_max", ())))
    sink = rewrite_transcendental(sink, renderer)
    for vec in ctx.vecs: sink = vectorize(sink, vec, range_size(vec), tuple(renderer.vector_dtypes))
    sink = simplify_indexing(prefetch_copied_rows(prefetch_streams(sink, renderer), renderer))
    return order_lane_stores(sink, renderer), ctx.rolled

def full_rewrite(ast: UOp, renderer: Renderer, opts: list[Opt] | None = None) -> list[UOp]:
    """The linearized UOps of a kernel AST."""
    opt_ast, applied, _ = optimize(ast, renderer, opts)
    return linearize(lower(opt_ast, renderer, use_fma=bool(applied)))

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the passes over every uop
# compare against module-level names)
_SPECIAL, _RANGE, _END, _WMMA, _DEFINE_GLOBAL, _DEFINE_VAR, _INDEX, _STORE, _MULACC = Ops.SPECIAL, Ops.RANGE, Ops.END, \
    Ops.WMMA, Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR, Ops.INDEX, Ops.STORE, Ops.MULACC
_LOOP_INDICES = (Ops.RANGE, Ops.SPECIAL)
_LOAD, _TRANSPOSED_COPY = Ops.LOAD, Ops.TRANSPOSED_COPY

def estimate(uops: list[UOp], useful: float = 1.0) -> Estimates:
    """ALU ops (vector ops count every lane, index math not at all) times loop trip counts and, in a GPU-style
    kernel, the work-items launched, scaled by the `useful` fraction of the iterations (padded loops); bytes of every
    buffer."""
    ops, mult, stack, mem = 0, 1, [], 0
    for u in uops:
        if u.op is _SPECIAL: mult = mult * range_size(u)
    alu, index = GroupOp.ALU, dtypes.index
    for u in uops:
        # (ALU ops first: most of the nodes)
        if (op := u.op) in alu:
            if u.dtype.scalar() is not index: ops += mult * u.dtype.count * (2 if op is _MULACC else 1)
        elif op is _RANGE:
            n = range_size(u)
            # (a loop bounded per iteration of the loops around it, codegen/bounds.py: counted at its most)
            if isinstance(n, UOp) and any(x.op in _LOOP_INDICES for x in n.toposort()): n = int(n.vmax)
            stack.append(mult)
            mult = mult * n  # a symbolic trip count keeps the estimate symbolic (evaluated with the Variables' values)
        elif op is _END: mult = stack.pop()
        # (a tensor core's multiply-adds of its tile, shared by the lanes of the warp)
        elif op is _WMMA: ops += mult * 2 * u.arg[1][0] * u.arg[1][1] * u.arg[1][2] // u.arg[5]
        elif op is _DEFINE_GLOBAL and isinstance(u.dtype, PtrDType) and u.dtype.size > 0:
            mem += u.dtype.size * u.dtype.base.itemsize
    if isinstance(ops, UOp): ops = ops.simplify()
    return Estimates(ops=round(ops * useful) if isinstance(ops, int) else ops, mem=mem)

_ACCESSES = {Ops.LOAD, Ops.STORE}

def get_program(ast: UOp, renderer: Renderer, name: str | None = None, opts: list[Opt] | None = None,
                quick: bool = False) -> ProgramSpec:
    """Optimize, lower, linearize and render one kernel AST. `quick`: the program of a first run, less code for
    the same results (see lower_kernel), where `quick_codegen_ok` says its bits are the full program's."""
    # (the passes walk the kernel's graphs again and again: each walk is made once per kernel)
    with toposort_memo(): return _get_program(ast, renderer, name, opts, quick)

# a kernel that loads or computes these may be written with the renderer's dot-product instructions (two bfloat16
# products per lane, renderer/cpu_dot.py), whose rounding its rolled loops wouldn't repeat
_DOT_DTYPES = (dtypes.bfloat16, dtypes.half)

def quick_codegen_ok(ast: UOp, renderer: Renderer) -> bool:
    """Whether `get_program(ast, renderer, quick=True)` computes the same bits as the full program: a CPU-style
    renderer, and no half or bfloat16 value in the kernel."""
    if getattr(renderer, "has_local", False) or renderer.tensor_cores: return False
    return not any(u.dtype.scalar() in _DOT_DTYPES or (isinstance(u.dtype, PtrDType) and u.dtype.base in _DOT_DTYPES)
                   for u in ast.toposort())

def _get_program(ast: UOp, renderer: Renderer, name: str | None, opts: list[Opt] | None, quick: bool) -> ProgramSpec:
    opt_ast, applied, useful = optimize(ast, renderer, opts)
    sink, rolled = _lower(opt_ast, renderer, bool(applied), quick)
    uops = linearize(sink)
    name = name or kernel_name(opt_ast)
    # the kernel's buffers, the ones it stores to and loads from, its variables and global loops, in one pass
    gl, glob, dvars, stored, loaded = [], [], [], set(), set()
    # (and the buffers used otherwise than through an INDEX that is only read from: the address of a LOAD, the source
    # of a TRANSPOSED_COPY. Any other use, a STORE or one this pass doesn't know, counts as a write, so `read_only`
    # never names a buffer the kernel may write)
    not_read_only: set[int] = set()
    for u in uops:
        for s in u.src:
            if (sop := s.op) is _DEFINE_GLOBAL:
                if u.op is not _INDEX: not_read_only.add(s.arg)
            elif sop is _INDEX and s.src[0].op is _DEFINE_GLOBAL and not \
                    ((u.op is _LOAD and u.src[0] is s) or (u.op is _TRANSPOSED_COPY and u.src[1] is s)):
                not_read_only.add(s.src[0].arg)
        if (op := u.op) in _ACCESSES:
            if (idx := u.src[0]).op is _INDEX and idx.src[0].op is _DEFINE_GLOBAL:
                (stored if op is _STORE else loaded).add(idx.src[0].arg)
        elif op is _DEFINE_GLOBAL: gl.append(u)
        elif op is _RANGE and u.arg[1] == "global": glob.append(u)
        elif op is _DEFINE_VAR: dvars.append(u)
    gl.sort(key=lambda u: u.arg)
    global_dims, local_dims = launch_dims(uops) if getattr(renderer, "has_local", False) else ((), ())
    src, function_name = renderer.render(uops, name), name
    if renderer.unique_symbols:
        # same-named kernels (E_77_77 with different bodies) get different symbols, so they can share a binary
        function_name = f"{name}_{hashlib.sha256(src.encode()).hexdigest()[:10]}"
        # (the definition, and the call in its `_entry` wrapper if the renderer writes one)
        assert src.count(f" {name}(") == 1 + getattr(renderer, "entry_point", False), \
            f"kernel name {name} appears more than once in its source"
        src = src.replace(f" {name}(", f" {function_name}(").replace(f" {name}_entry(", f" {function_name}_entry(")
    return ProgramSpec(name=name, src=src, device=renderer.device, uops=uops, function_name=function_name,
                       globals=[u.arg for u in gl], outs=sorted(stored), ins=sorted(loaded),
                       read_only=[u.arg for u in gl if u.arg not in stored and u.arg not in not_read_only],
                       vars=sorted(dvars, key=lambda v: v.arg[0]),
                       global_size=range_size(glob[0]) if glob else 1, estimates=estimate(uops, useful),
                       applied_opts=applied, ast=ast, global_dims=global_dims, local_dims=local_dims,
                       # (a quick program that rolled nothing is the full program: it needs no second one)
                       quick=rolled)
