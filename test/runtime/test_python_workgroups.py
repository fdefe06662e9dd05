"""The PYTHON device's emulation of GPU-style kernels (work-groups, SPECIAL ids, local memory, barriers): hand-built
linearized kernels rendered by PythonRenderer and run by PythonProgram, against numpy; and the errors it raises for
kernels that would race or hang on a GPU (missing or divergent barriers), for out-of-bounds local accesses and for
launch dims that don't match the kernel."""
from __future__ import annotations
import math
import threading
import numpy as np
import pytest
from fusegrad.dtype import DType, dtypes, to_np_dtype
from fusegrad.helpers import getenv
from fusegrad.renderer import Renderer
from fusegrad.renderer.python import PythonRenderer
from fusegrad.runtime.ops_python import PythonProgram
from fusegrad.uop.ops import Ops, UOp

# *** building linearized kernels by hand ***

class Kernel:
    """A linearized kernel: UOps appended in execution order, each after its sources (a source not yet in the list
    goes in just before its first user, so values computed from a loop's RANGE land inside that loop)."""
    def __init__(self) -> None:
        self.uops: list[UOp] = []
        self.seen: set[UOp] = set()

    def add(self, *us: UOp) -> None:
        for u in us:
            if u in self.seen: continue
            self.add(*u.src)
            self.seen.add(u)
            self.uops.append(u)

    def loop(self, r: UOp, *body: UOp) -> UOp:
        """Appends `r`, `body` and the END closing `r`; returns the END."""
        end = UOp(Ops.END, dtypes.void, (r,))
        self.add(r, *body, end)
        return end

    def program(self, name: str = "k") -> PythonProgram:
        return PythonProgram(name, PythonRenderer(gpu=True).render(self.uops, name).encode())

def glob(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_GLOBAL, dt.ptr(size), arg=i)
def local(i: int, dt: DType, size: int) -> UOp: return UOp(Ops.DEFINE_LOCAL, dt.ptr(size, "local"), arg=i)
def idx(v: int) -> UOp: return UOp.const(dtypes.index, v)
def special(name: str, size: int | UOp) -> UOp:
    return UOp(Ops.SPECIAL, dtypes.index, (size if isinstance(size, UOp) else idx(size),), arg=name)
def barrier(buf: UOp, *deps: UOp) -> UOp: return UOp(Ops.BARRIER, buf.dtype, (buf, *deps))

def launch(prg: PythonProgram, arrays: list[np.ndarray], global_dims: tuple, local_dims: tuple,
           vals: tuple = ()) -> None:
    prg(*[memoryview(a).cast("B") for a in arrays], vals=vals, global_dims=global_dims, local_dims=local_dims)

# *** elementwise kernels ***

def test_elementwise_1d_gated():
    # 7 groups of 32 work-items over 200 elements: the last group's last 24 work-items are gated off
    n, L = 200, 32
    out, a, b = glob(0, dtypes.float32, n), glob(1, dtypes.float32, n), glob(2, dtypes.float32, n)
    i = special("gidx0", 7) * L + special("lidx0", L)
    ok = i < n
    k = Kernel()
    k.add(out.index(i, ok).store(a.index(i, ok).load() * 3.0 + b.index(i, ok).load()))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    got = np.full(n, np.nan, np.float32)
    launch(k.program(), [got, x, y], (7,), (L,))
    np.testing.assert_array_equal(got, x * np.float32(3) + y)

def test_elementwise_2d_launch():
    # a 10x13 int32 array over groups of 4x2 work-items: dim 0 runs along columns, dim 1 along rows
    R, C = 10, 13
    out, a = glob(0, dtypes.int32, R * C), glob(1, dtypes.int32, R * C)
    col = special("gidx0", 4) * 4 + special("lidx0", 4)
    row = special("gidx1", 5) * 2 + special("lidx1", 2)
    ok = (col < C) & (row < R)
    pos = row * C + col
    k = Kernel()
    k.add(out.index(pos, ok).store(a.index(pos, ok).load() * 2 + (row * 100 - col).cast(dtypes.int32)))
    x = np.random.default_rng(1).integers(-1000, 1000, (R, C)).astype(np.int32)
    got = np.full((R, C), -7, np.int32)
    launch(k.program(), [got, x], (4, 5), (4, 2))
    rows, cols = np.indices((R, C))
    np.testing.assert_array_equal(got, x * 2 + rows * 100 - cols)

def test_symbolic_group_count():
    # the number of groups is a variable: gidx0's size is an expression of it, evaluated at launch
    nv = UOp.variable("n", 1, 64)
    out = glob(0, dtypes.int32, 64)
    groups = (nv + 7) // 8
    i = special("gidx0", groups) * 8 + special("lidx0", 8)
    k = Kernel()
    k.add(nv, out.index(i, i < nv).store((i * 3).cast(dtypes.int32)))
    got = np.full(64, -1, np.int32)
    launch(k.program(), [got], (3,), (8,), vals=(20,))
    np.testing.assert_array_equal(got, np.where(np.arange(64) < 20, np.arange(64) * 3, -1))
    with pytest.raises(RuntimeError, match=r"uop \d+ \(SPECIAL.*gidx0.*its size 3 doesn't match .* = 4"):
        launch(k.program(), [got], (4,), (8,), vals=(20,))

# *** work-group reductions ***

def identity(op: Ops, dt: DType) -> float | int:
    if op is Ops.ADD: return 0
    return -math.inf if dtypes.is_float(dt) else dtypes.min(dt)

def reduce_kernel(rows: int, n: int, L: int, op: Ops, dt: DType, use_barrier: bool = True,
                  first_stores: bool = False) -> Kernel:
    """out[row] = op over a[row, :n]: one group per row; work-item l folds a[row, l::L] into a register and stores it
    to local memory; after a barrier, every work-item folds the local array and stores the total (or only
    work-item 0, with a gated store)."""
    out, a, part = glob(0, dt, rows), glob(1, dt, rows * n), local(0, dt, L)
    row, lid = special("gidx0", rows), special("lidx0", L)
    acc, acc2 = UOp(Ops.DEFINE_REG, dt, arg=0), UOp(Ops.DEFINE_REG, dt, arg=1)
    ident = UOp.const(dt, identity(op, dt))
    k = Kernel()
    k.add(out, a, part, row, lid, acc, acc2)
    init = acc.store(ident)
    k.add(init)
    r = UOp.range((n + L - 1) // L, 0, "reduce")
    col = r * L + lid
    v = (col < n).where(a.index(row * n + col, col < n).load(), ident)
    end = k.loop(r, acc.store(acc.load(init, r).alu(op, v)))
    wrote = part.index(lid).store(acc.load(end))
    k.add(wrote)
    parts = barrier(part, wrote) if use_barrier else part
    init2 = acc2.store(ident)
    k.add(parts, init2)
    j = UOp.range(L, 1, "reduce")
    end2 = k.loop(j, acc2.store(acc2.load(init2, j).alu(op, parts.index(j).load())))
    k.add(out.index(row, lid.eq(0)).store(acc2.load(end2)) if first_stores else out.index(row).store(acc2.load(end2)))
    return k

def reference(x: np.ndarray, L: int, op: Ops) -> np.ndarray:
    """The kernel's order of operations in numpy: strided partials, then the partials in order."""
    f = np.add if op is Ops.ADD else np.maximum
    rows, n = x.shape
    ident = x.dtype.type(identity(op, dtypes.float32 if x.dtype.kind == "f" else dtypes.int32))
    out = np.empty(rows, x.dtype)
    with np.errstate(over="ignore"):
        for i in range(rows):
            parts = [ident] * L
            for l in range(L):
                for c in range(l, n, L): parts[l] = f(parts[l], x[i, c])
            total = ident
            for p in parts: total = f(total, p)
            out[i] = total
    return out

CASES = [(n, L, op, dt, first) for n, L in [(1, 16), (7, 32), (255, 16), (257, 32)]
         for op in (Ops.ADD, Ops.MAX) for dt, first in [(dtypes.float32, n % 2 == 1), (dtypes.int32, n < 100)]]

@pytest.mark.parametrize("n,L,op,dt,first", CASES, ids=lambda c: str(c))
def test_workgroup_reduction(n: int, L: int, op: Ops, dt: DType, first: bool):
    rows = 3
    rng = np.random.default_rng(n + L)
    if dtypes.is_float(dt): x = (rng.standard_normal((rows, n)) * 100).astype(np.float32)
    else: x = rng.integers(-2**31, 2**31 - 1, (rows, n), endpoint=True).astype(np.int32)   # sums wrap around
    got = np.zeros(rows, to_np_dtype(dt))
    launch(reduce_kernel(rows, n, L, op, dt, first_stores=first).program(), [got, x], (rows,), (L,))
    np.testing.assert_array_equal(got, reference(x, L, op))
    if op is Ops.MAX: np.testing.assert_array_equal(got, x.max(1))
    elif dtypes.is_float(dt): np.testing.assert_allclose(got, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-2)
    else: np.testing.assert_array_equal(got, (x.astype(np.int64).sum(1) + 2**31) % 2**32 - 2**31)

def tree_kernel(L: int, barrier_in_loop: bool = True) -> Kernel:
    """out[g] = sum of a[g, :L] by halving: log2(L) steps, each followed by a barrier (uniform trip count)."""
    out, a, s = glob(0, dtypes.float32, 4), glob(1, dtypes.float32, 4 * L), local(0, dtypes.float32, L)
    g, lid = special("gidx0", 4), special("lidx0", L)
    k = Kernel()
    k.add(out, a, s, g, lid)
    first = s.index(lid).store(a.index(g * L + lid).load())
    k.add(first)
    ready = barrier(s, first)
    k.add(ready)
    r = UOp.range(L.bit_length() - 1, 0)
    stride = idx(L // 2) >> r
    active = lid < stride
    step = ready.index(lid, active).store(ready.index(lid, active).load() + ready.index(lid + stride, active).load())
    k.add(r, step)
    if barrier_in_loop: k.add(barrier(s, step))
    end = UOp(Ops.END, dtypes.void, (r,))
    k.add(end)
    k.add(out.index(g, lid.eq(0)).store(barrier(s, end).index(idx(0)).load()))
    return k

def test_tree_reduction_with_barriers_in_a_loop():
    L = 16
    x = np.random.default_rng(2).integers(-50, 50, (4, L)).astype(np.float32)   # exact sums in any order
    got = np.zeros(4, np.float32)
    launch(tree_kernel(L).program(), [got, x], (4,), (L,))
    np.testing.assert_array_equal(got, x.sum(1))

# *** errors ***

def test_missing_barrier():
    # the reduction without its barrier: work-item 0 folds the local array before the others wrote their parts, then
    # work-item 1 overwrites an element work-item 0 read in the same phase
    x = np.ones((2, 40), np.float32)
    prg = reduce_kernel(2, 40, 16, Ops.ADD, dtypes.float32, use_barrier=False).program()
    with pytest.raises(RuntimeError, match=r"uop \d+ \(STORE.*local0: missing barrier: work-item lidx \(1,\) of group "
                                           r"gidx \(1,\) writes element 1, which work-item lidx \(0,\) read"):
        launch(prg, [np.zeros(2, np.float32), x], (2,), (16,))
    # the tree reduction without the barrier in its loop: work-item 0 runs all its steps, reading elements that the
    # other work-items then overwrite in their first step
    with pytest.raises(RuntimeError, match=r"missing barrier: work-item lidx \(1,\) .* writes element 1, which "
                                           r"work-item lidx \(0,\) read"):
        launch(tree_kernel(8, barrier_in_loop=False).program(), [np.zeros(4, np.float32), np.ones((4, 8), np.float32)],
               (4,), (8,))

def test_write_after_read_without_barrier():
    # each work-item reads its neighbour's element, then overwrites its own without waiting: a write after a read
    L = 8
    out, s, lid = glob(0, dtypes.int32, L), local(0, dtypes.int32, L), special("lidx0", L)
    k = Kernel()
    w1 = s.index(lid).store(lid.cast(dtypes.int32))
    k.add(out, s, lid, w1)
    ready = barrier(s, w1)
    nb = ready.index((lid + 1) % L).load()
    k.add(out.index(lid).store(nb), s.index(lid).store(nb * 2))
    with pytest.raises(RuntimeError, match=r"uop \d+ \(STORE.*missing barrier: work-item lidx \(1,\) of group gidx "
                                           r"\(0,\) writes element 1, which work-item lidx \(0,\) read"):
        launch(k.program(), [np.zeros(L, np.int32)], (1,), (L,))

def test_local_out_of_bounds():
    L = 8
    out, s, lid = glob(0, dtypes.float32, L), local(0, dtypes.float32, L), special("lidx0", L)
    k = Kernel()
    k.add(out, s, lid, s.index(lid + 1).store(UOp.const(dtypes.float32, 1.0)))
    with pytest.raises(RuntimeError, match=r"uop \d+ \(STORE.*k local0: access to elements \[8, 9\) of 8"):
        launch(k.program(), [np.zeros(L, np.float32)], (1,), (L,))

def divergent_kernel(two_barriers: bool) -> Kernel:
    # a loop whose trip count depends on lidx0 holds a barrier: lidx0 + 1 trips, or lidx0 trips and a second
    # barrier after the loop
    L = 4
    out, s, lid = glob(0, dtypes.float32, L), local(0, dtypes.float32, L), special("lidx0", L)
    k = Kernel()
    k.add(out, s, lid)
    r = UOp.range(lid if two_barriers else lid + 1, 0)
    w = s.index(lid).store(r.cast(dtypes.float32))
    end = k.loop(r, w, barrier(s, w))
    last = barrier(s, end) if two_barriers else s
    k.add(out.index(lid).store(last.index(lid).load()))
    return k

def test_divergent_barriers():
    with pytest.raises(RuntimeError, match=r"uop \d+ \(BARRIER.*divergent barrier: 3 of 4 work-items wait here "
                                           r"\(work-item lidx \(1,\) .*\) while work-item lidx \(0,\) .* finished"):
        launch(divergent_kernel(False).program(), [np.zeros(4, np.float32)], (1,), (4,))
    with pytest.raises(RuntimeError, match=r"divergent barrier: 3 of 4 .* while work-item lidx \(0,\) of group gidx "
                                           r"\(0,\) waits at the BARRIER uop \d+"):
        launch(divergent_kernel(True).program(), [np.zeros(4, np.float32)], (1,), (4,))

def test_failed_launch_leaves_no_threads():
    # an error in one work-item (an out-of-bounds global read) ends the launch; the group's other threads unwind
    before = threading.active_count()
    out, s, lid = glob(0, dtypes.float32, 4), local(0, dtypes.float32, 4), special("lidx0", 4)
    k = Kernel()
    w = s.index(lid).store(out.index(lid * 2).load())
    k.add(out, s, lid, w, out.index(lid).store(barrier(s, w).index(lid).load()))
    with pytest.raises(RuntimeError, match=r"k data0: access to elements \[4, 5\) of 4"):
        launch(k.program(), [np.zeros(4, np.float32)], (1,), (4,))
    assert threading.active_count() == before

def test_launch_dims_must_match():
    x = np.zeros(200, np.float32)
    out = glob(0, dtypes.float32, 200)
    i = special("gidx0", 7) * 32 + special("lidx0", 32)
    k = Kernel()
    k.add(out.index(i, i < 200).store(UOp.const(dtypes.float32, 1.0)))
    prg = k.program()
    with pytest.raises(RuntimeError, match=r"SPECIAL.*lidx0.*size 32 doesn't match the launch's local_dims\[0\] = 16"):
        launch(prg, [x], (7,), (16,))
    with pytest.raises(RuntimeError, match=r"global_dims\[0\] = 8"): launch(prg, [x], (8,), (32,))
    with pytest.raises(RuntimeError, match=r"launched with local_dims\[1\] = 2, but the kernel has no lidx1"):
        launch(prg, [x], (7, 1), (32, 2))
    with pytest.raises(RuntimeError, match="GPU-style .* needs global_dims and local_dims"):
        prg(memoryview(x).cast("B"))
    with pytest.raises(RuntimeError, match="must have the same length"): launch(prg, [x], (7,), (32, 1))
    with pytest.raises(RuntimeError, match="positive ints"): launch(prg, [x], (7,), (0,))
    assert not x.any()   # nothing ran
    launch(prg, [x], (7, 1, 1), (32, 1, 1))
    assert (x == 1).all()
    # a kernel using gidx1 needs a launch with two dims
    k2 = Kernel()
    k2.add(glob(0, dtypes.float32, 4).index(special("gidx1", 4)).store(UOp.const(dtypes.float32, 1.0)))
    with pytest.raises(RuntimeError, match=r"SPECIAL.*gidx1.*the launch has no global_dims\[1\]"):
        launch(k2.program(), [np.zeros(4, np.float32)], (1,), (1,))

@pytest.mark.parametrize("names,error", [(("gidx3",), "malformed SPECIAL name 'gidx3'"),
                                         (("tid",), "malformed SPECIAL name 'tid'"),
                                         (("lidx0", "lidx0"), "SPECIAL lidx0 repeated")])
def test_bad_special_names(names: tuple[str, ...], error: str):
    out = glob(0, dtypes.int32, 64)
    uops = [out, idx(8)] + [UOp(Ops.SPECIAL, dtypes.index, (idx(8),), arg=f"{n}") for n in names]
    src = PythonRenderer(gpu=True).render(uops, "bad")
    # a repeated name is one interned UOp: make the second a distinct line of the listing
    if len(names) == 2: src += f"{len(uops)} | SPECIAL | dtypes.index | 1 | 'lidx0'\n"
    with pytest.raises(RuntimeError, match=rf"PYTHON kernel bad: uop \d+ \(SPECIAL.*{error}"):
        PythonProgram("bad", src.encode())

# *** the renderer's attributes ***

def test_renderer_declares_gpu_attributes(monkeypatch):
    gpu = PythonRenderer(gpu=True)
    assert gpu.has_local and gpu.global_max == (2**31 - 1, 65535, 65535) and gpu.local_max == (1024, 1024, 64)
    assert gpu.max_workgroup == 1024 and gpu.local_bytes == 48 * 1024
    assert gpu.vector_dtypes == () and gpu.simd_bytes == 0 and not gpu.has_threads
    # PYTHON_GPU=1 makes the default renderer a GPU's (getenv caches what it read: cleared around each setting)
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setenv("PYTHON_GPU", env)
        getenv.cache_clear()
        assert PythonRenderer().has_local is want
    getenv.cache_clear()
    monkeypatch.undo()
    cpu = PythonRenderer()
    assert not cpu.has_local and cpu.max_workgroup == 1 and cpu.has_threads

    class Fake(Renderer):
        has_local, global_max, local_max, max_workgroup, local_bytes = True, (100, 10), (64, 8), 256, 1024
        has_threads, simd_bytes, vector_dtypes = False, 0, ()
    like = PythonRenderer(like=Fake())
    assert (like.has_local, like.global_max, like.local_max, like.max_workgroup, like.local_bytes, like.has_threads) \
        == (True, (100, 10), (64, 8), 256, 1024, False)
    assert not PythonRenderer(like=cpu).has_local

def test_special_inside_a_loop():
    out, r = glob(0, dtypes.int32, 8), UOp.range(2, 0)
    k = Kernel()
    k.loop(r, out.index(special("lidx0", 4) * 2 + r).store(r.cast(dtypes.int32)))
    with pytest.raises(RuntimeError, match=r"uop \d+ \(SPECIAL.*a SPECIAL inside a loop"): k.program()
