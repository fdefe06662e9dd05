"""Quick programs (codegen.get_program's `quick`, engine QUICK_CODEGEN): a model's first call runs kernels whose
register tiles and unrolled loops stay loops. They must compute every output element with the same bits as the full
program, over the same split of the outermost loop (a call may run some chunks of one and the rest of the other),
and a kernel that runs again gets its full program."""
import ctypes
import uuid
import numpy as np
import pytest
import torch
import fusegrad.codegen as codegen
from fusegrad import Device, Tensor, TinyJit, dtypes, nn
from fusegrad.codegen import get_program, quick_codegen_ok
from fusegrad.engine import realize
from fusegrad.engine.realize import CompiledRunner
from fusegrad.helpers import Context
from fusegrad.runtime.cpu_compiler import quick_source
from fusegrad.schedule.kernelize import schedule_cache

REN = Device["CPU"].renderer
RNG = np.random.default_rng(7)

def _t(*shape: int, dtype=np.float32) -> Tensor:
    return Tensor(RNG.standard_normal(shape).astype(dtype))

def _workloads() -> dict[str, tuple]:
    """name -> (a function making the output tensor, its torch float64 reference)"""
    x, w = RNG.standard_normal((96, 200)).astype(np.float32), RNG.standard_normal((200, 72)).astype(np.float32)
    lin_x, lin_w = RNG.standard_normal((64, 300)).astype(np.float32), RNG.standard_normal((128, 300)).astype(np.float32)
    big_a = RNG.standard_normal((64, 2048)).astype(np.float32)
    big_b = RNG.standard_normal((2048, 96)).astype(np.float32)
    img = RNG.standard_normal((2, 8, 14, 14)).astype(np.float32)
    k = RNG.standard_normal((16, 8, 3, 3)).astype(np.float32)
    ints = RNG.integers(-1000, 1000, (64, 300)).astype(np.int32)
    idx = RNG.integers(0, 50, (40,)).astype(np.int32)
    table = RNG.standard_normal((50, 48)).astype(np.float32)
    d = RNG.standard_normal((33, 129))
    T = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return {
        "matmul": (lambda: Tensor(x) @ Tensor(w), lambda: T(x) @ T(w)),
        "matmul_relu_bias": (lambda: (Tensor(x) @ Tensor(w) + 0.5).relu(), lambda: (T(x) @ T(w) + 0.5).relu()),
        # (a Linear layer's x @ W.T: W's panel copied in transposed blocks, TRANSPOSED_COPY, with a K that leaves a
        # remainder gathered)
        "x_at_w_t": (lambda: Tensor(lin_x) @ Tensor(lin_w).T, lambda: T(lin_x) @ T(lin_w).T),
        # (a reduction long enough to be summed in blocks, and blocked through the output)
        "long_matmul": (lambda: Tensor(big_a) @ Tensor(big_b), lambda: T(big_a) @ T(big_b)),
        "long_row_sum": (lambda: Tensor(big_a).sum(1), lambda: T(big_a).sum(1)),
        "column_mean": (lambda: Tensor(x).mean(0), lambda: T(x).mean(0)),
        "conv": (lambda: Tensor(img).conv2d(Tensor(k), padding=1),
                 lambda: torch.nn.functional.conv2d(T(img), T(k), padding=1)),
        "conv_stride2": (lambda: Tensor(img).conv2d(Tensor(k), stride=2),
                         lambda: torch.nn.functional.conv2d(T(img), T(k), stride=2)),
        "max_pool": (lambda: Tensor(img).max_pool2d(2), lambda: torch.nn.functional.max_pool2d(T(img), 2)),
        "softmax": (lambda: Tensor(x).softmax(1), lambda: T(x).softmax(1)),
        "layernorm": (lambda: Tensor(x).layernorm(), lambda: torch.nn.functional.layer_norm(T(x), (200,), eps=1e-5)),
        "argmax": (lambda: Tensor(x).argmax(1), lambda: T(x).argmax(1)),
        "cumsum": (lambda: Tensor(x[:, :40]).cumsum(1), lambda: T(x[:, :40]).cumsum(1)),
        "int_sum": (lambda: Tensor(ints).sum(1), lambda: torch.tensor(ints, dtype=torch.int64).sum(1)),
        "int_max": (lambda: Tensor(ints).max(0), lambda: torch.tensor(ints).max(0).values),
        "float64_matmul": (lambda: Tensor(d) @ Tensor(d.T.copy()), lambda: T(d) @ T(d.T.copy())),
        "gather": (lambda: Tensor(table)[Tensor(idx)] * 2, lambda: T(table)[torch.tensor(idx, dtype=torch.long)] * 2),
        "transpose": (lambda: Tensor(x).T.contiguous() * 3, lambda: T(x).T * 3),
        "exp_log": (lambda: (Tensor(x).exp() + 1).log() * Tensor(x).sin(),
                    lambda: (T(x).exp() + 1).log() * T(x).sin()),
    }

def _quick_binary(p) -> bytes:
    """The quick program's binary as a first call builds it: its quick source at the quick tier's flags."""
    tiered = Device["CPU"].tiered
    return tiered.quick.compile(quick_source(p.src, tiered.quick.flags))

def _snapshot(bufs) -> list[bytes]:
    Device["CPU"].synchronize()
    return [bytes(b.as_buffer()) for b in bufs]

def _restore(bufs, data: list[bytes]) -> None:
    Device["CPU"].synchronize()
    for b, d in zip(bufs, data): b.copyin(memoryview(bytearray(d)))

def _run_split(parts: list[tuple[CompiledRunner, int, int]], bufs: list) -> None:
    """Each runner of `parts` over its [lo, hi) of the kernel's outermost loop, on this thread, one after the other."""
    Device["CPU"].synchronize()
    for r, lo, hi in parts:
        fxn = r._prg.fxn
        fxn.argtypes = [ctypes.c_void_p] * len(bufs) + [ctypes.c_long] * 2
        fxn(*[ctypes.addressof(b._buf) for b in bufs], lo, hi)

@pytest.mark.parametrize("name", list(_workloads()))
def test_quick_program_gives_the_full_programs_bits_chunk_by_chunk(name):
    make, ref = _workloads()[name]
    out = make()
    items = [ei for ei in out.schedule() if ei.ast.op.name == "SINK"]
    assert items
    checked = 0
    for ei in realize.exec_items(items):
        full_p, quick_p = get_program(ei.ast, REN), get_program(ei.ast, REN, quick=True)
        assert (quick_p.global_size, quick_p.globals, quick_p.vars) == (full_p.global_size, full_p.globals, full_p.vars)
        full = CompiledRunner(full_p)
        if not quick_codegen_ok(ei.ast, REN) or quick_p.vars:
            ei.run()
            continue
        quick = CompiledRunner(quick_p, precompiled=_quick_binary(quick_p))
        bufs = [ei.bufs[i] for i in full_p.globals]
        for b in bufs: b.ensure_allocated()
        outs = [ei.bufs[i] for i in full_p.outs]
        for b in outs: b.written()   # (the kernels below write them, outside run_schedule)
        before = _snapshot(outs)
        gs = full_p.global_size
        _run_split([(full, 0, gs)], bufs)
        want = _snapshot(outs)
        for parts in ([(quick, 0, gs)], [(quick, 0, gs // 2), (full, gs // 2, gs)],
                      [(full, 0, gs // 2), (quick, gs // 2, gs)]):
            _restore(outs, before)
            _run_split(parts, bufs)
            assert _snapshot(outs) == want, f"{name}: {full_p.name} split {[(lo, hi) for _, lo, hi in parts]}"
        _restore(outs, want)
        checked += 1
    assert checked
    got, expected = out.numpy(), ref().numpy()
    if np.issubdtype(got.dtype, np.integer): np.testing.assert_array_equal(got, expected)
    else: np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

def test_quick_programs_are_less_code():
    # a register-tiled matmul: its full program unrolls the tile, the quick one loops over it
    a, b = _t(128, 784), _t(784, 512)
    ast = [ei for ei in (a @ b).relu().schedule() if ei.ast.op.name == "SINK"][-1].ast
    full, quick = get_program(ast, REN), get_program(ast, REN, quick=True)
    assert full.applied_opts == quick.applied_opts and full.name == quick.name
    assert len(quick.src) * 2 < len(full.src) and len(quick.uops) * 2 < len(full.uops)

def test_half_and_bfloat16_kernels_get_no_quick_program():
    for dt in (dtypes.half, dtypes.bfloat16):
        ast = [ei for ei in (_t(32, 64).cast(dt) @ _t(64, 32).cast(dt)).schedule() if ei.ast.op.name == "SINK"][-1].ast
        assert not quick_codegen_ok(ast, REN)
    assert quick_codegen_ok([ei for ei in (_t(32, 64) @ _t(64, 32)).schedule()][-1].ast, REN)

def _mlp_steps(steps: int, jit: bool, hidden: int) -> tuple[list[np.ndarray], list[CompiledRunner]]:
    """Losses and final parameters of `steps` Adam steps of a small MLP (its sizes new to this process, so its
    kernels are compiled here), and the runners its first step made with a quick program."""
    rng = np.random.default_rng(11)
    l1, l2 = nn.Linear(200, hidden), nn.Linear(hidden, 10)
    params = [l1.weight, l1.bias, l2.weight, l2.bias]
    for p in params: p.assign(Tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.1))
    Tensor.realize(*params)
    opt = nn.optim.Adam(params, lr=1e-2)
    xb = Tensor(rng.standard_normal((64, 200)).astype(np.float32)).realize()
    yb = Tensor(rng.integers(0, 10, 64).astype(np.int32)).realize()
    def step() -> Tensor:
        with Tensor.train():
            opt.zero_grad()
            loss = l2(l1(xb).relu()).sparse_categorical_crossentropy(yb)
            loss.backward()
            opt.step()
        return loss.realize()
    fn = TinyJit(step) if jit else step
    before = set(map(id, realize.method_cache.values()))
    losses = [fn().numpy().copy()]
    # (the runners made by the first step that run a quick program)
    runners = [r for r in realize.method_cache.values() if id(r) not in before and r.p.quick]
    losses += [fn().numpy().copy() for _ in range(steps - 1)]
    return losses + [p.numpy().copy() for p in params], runners

@pytest.mark.parametrize("jit", [False, True])
def test_a_training_loop_gives_the_same_bits_with_quick_programs(jit, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 2)
    hidden = 96 + uuid.uuid4().int % 64   # (sizes new to this process: kernels compiled here)
    with Context(QUICK_CODEGEN=0): want, _ = _mlp_steps(6, jit, hidden)
    # (the same kernels again, made anew)
    monkeypatch.setattr(realize, "method_cache", {})
    schedule_cache.clear()
    with Context(QUICK_CODEGEN=1):
        got, runners = _mlp_steps(6, jit, hidden)
        realize.optimized_kernels()
        # every kernel that ran again got its full program, compiled optimized, in place of the quick one
        assert runners and all(r.quick_realize is None and not r.p.quick and r._prg._kept for r in runners)
        again, _ = _mlp_steps(2, jit, hidden)
    for a, b in zip(got, want): np.testing.assert_array_equal(a, b)
    for a, b in zip(again, want[:2]): np.testing.assert_array_equal(a, b)

def test_a_kernel_run_once_keeps_its_quick_program(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 2)
    salt = 1 + uuid.uuid4().int % 1000 / 1000
    a, b = _t(40, 64), _t(64, 24)
    outs = [(a @ b) * salt, (a * salt).sum(1)]
    generated = []
    plain = codegen.get_program
    def counting(ast, renderer, name=None, opts=None, quick=False):
        generated.append(quick)
        return plain(ast, renderer, name, opts, quick)
    monkeypatch.setattr(codegen, "get_program", counting)
    with Context(QUICK_CODEGEN=1):
        Tensor.realize(*outs)
        runners = [r for r in realize.method_cache.values() if r.quick_realize is not None]
        # (the matmul's tile was rolled; the row sum's quick lowering rolled nothing, so its program is the full one
        # and nothing waits for a second)
        assert generated == [True, True] and runners and all(r.p.quick for r in runners)
        # (another realize that doesn't use them leaves them as they are)
        (Tensor.ones(3).contiguous() * salt).realize()
        assert all(r.quick_realize is not None for r in runners) and generated.count(False) <= 1
        np.testing.assert_allclose(outs[0].numpy(), (a.numpy() @ b.numpy()) * salt, rtol=1e-5, atol=1e-5)

# *** the differential fuzzers' programs, with every schedule on quick programs against every one on full ones ***

def _bits(x):
    if x is None: return None
    if isinstance(x, tuple): return tuple(_bits(y) for y in x)
    if isinstance(x, dict): return {k: _bits(v) for k, v in x.items()}
    return np.ascontiguousarray(x).tobytes()

def _quick_against_full(module: str, seeds: range, monkeypatch) -> list[int]:
    """The seeds of the fuzzer `module` whose programs (outputs, and gradients where it takes them) differ in any bit
    between quick programs (every schedule's, QUICK_MIN_KERNELS=1) and full ones, each from freshly made kernels."""
    import importlib
    fuzzer = importlib.import_module(module)
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 1)
    monkeypatch.setattr(realize, "method_cache", {})
    bad, quick_runners = [], 0
    for seed in seeds:
        prog, results = fuzzer.generate(seed), []
        for quick in (0, 1):
            realize.method_cache.clear()
            schedule_cache.clear()
            try:
                with Context(QUICK_CODEGEN=quick): results.append(_bits(fuzzer.run_fusegrad(prog)))
            except Exception as e: results.append((type(e).__name__, str(e)))
            if quick: quick_runners += sum(r.p.quick for r in realize.method_cache.values())
        if results[0] != results[1]: bad.append(seed)
    assert quick_runners > 0   # (quick programs ran: most of these programs are elementwise, with nothing to roll)
    return bad

@pytest.mark.parametrize("module, seeds", [("test.test_fuzz_programs", range(0, 25)),
                                           ("test.test_fuzz_torch", range(0, 12))])
def test_fuzzed_programs_give_the_same_bits_on_quick_programs(module, seeds, monkeypatch):
    assert _quick_against_full(module, seeds, monkeypatch) == []

@pytest.mark.slow
@pytest.mark.parametrize("module, seeds", [("test.test_fuzz_programs", range(25, 600)),
                                           ("test.test_fuzz_torch", range(12, 400))])
def test_fuzzed_programs_give_the_same_bits_on_quick_programs_many(module, seeds, monkeypatch):
    assert _quick_against_full(module, seeds, monkeypatch) == []

def test_viz_shows_the_program_a_kernel_runs(monkeypatch, tmp_path):
    # a kernel recorded with its quick program is shown with its full one once a later realize upgraded it
    from fusegrad.viz import record
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(realize, "QUICK_MIN_KERNELS", 2)
    salt = 1 + uuid.uuid4().int % 1000 / 1000
    a, b = _t(48, 64), _t(64, 32)
    record.recorder.reset()
    record.enable(viz=True)
    try:
        with Context(QUICK_CODEGEN=1):
            for _ in range(2):
                outs = [(a @ b) * salt, (a * salt).sum(1)]
                Tensor.realize(*outs)
            realize.optimized_kernels()
        shown = {k["name"]: k["src"] for k in record.trace()["kernels"] if k.get("src")}
    finally:
        record.enable(viz=False)
        record.recorder.reset()
    runners = [r for r in realize.method_cache.values() if r.p.name in shown and not r.p.quick and r._prg._kept]
    assert runners and all(shown[r.p.name] == r.p.src for r in runners)

@pytest.mark.parametrize("batch", [1, 4])
def test_every_kernel_of_a_resnet_training_step_has_a_quick_program(batch):
    # ResNet-18's SGD step at 224px: sums blocked with a remainder share their unrolled axis, and each gets loops of
    # its own when rolled (one loop can't sit inside two reductions' loops: such kernels failed to linearize)
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import resnet
    from fusegrad.nn.state import get_parameters
    Tensor.manual_seed(1)
    m = resnet.ResNet(18)
    opt = nn.optim.SGD(get_parameters(m), lr=0.01)
    x = Tensor(RNG.standard_normal((batch, 3, 224, 224)).astype(np.float32))
    y = Tensor(RNG.integers(0, 1000, batch).astype(np.int32))
    with Tensor.train():
        opt.zero_grad()
        m(x).sparse_categorical_crossentropy(y).backward()
        kernels = [ei.ast for ei in Tensor.schedule(*opt.schedule_step()) if ei.ast.op.name == "SINK"]
    # (the full programs too: at batch 1 the heuristic's padding of an output vector was refused in a kernel that
    # updates a parameter in place beside a reduction, and the refusal escaped as a KernelOptError from the realize)
    full = [get_program(ast, REN) for ast in kernels]
    quick = [get_program(ast, REN, quick=True) for ast in kernels if quick_codegen_ok(ast, REN)]
    assert len(quick) > 50 and sum(len(p.src) for p in quick) < sum(len(p.src) for p in full)
