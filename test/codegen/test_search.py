"""BEAM search: results equal NumPy's, candidates are compiled and timed, the choice is cached on disk (a second process
doesn't search), bad cache entries are ignored, and without BEAM the heuristic stays the default."""
import json
import os
import subprocess
import sys
import textwrap
import time
import numpy as np
import pytest
from fusegrad import Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import Kernel, KernelOptError, Opt, OptOps
from fusegrad.device import Device
from fusegrad.codegen.opt import search  # imported before any Context names its knobs
from fusegrad.engine.realize import CODEGEN_KNOBS, CompiledRunner, get_runner, run_schedule
from fusegrad.helpers import Context

# small and quick searches: one timed run per candidate, one round after the heuristic's variants
KNOBS = dict(BEAM_RUNS=1, BEAM_ROUNDS=1, BEAM_TIMEOUT_S=2.0)
# a time budget that never ends a search: which candidates it compiles then depends on the kernel only, not on how
# busy the machine is (the tests bound their cost with BEAM_ROUNDS instead)
UNLIMITED = 600.0
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

def rand(*shape, seed=0) -> np.ndarray: return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

def kernel_asts(t: Tensor) -> list:
    return [si.ast for si in t.schedule() if si.ast.op.name == "SINK"]

def compile_seconds(ast) -> float:
    """How long the compiler takes now for the heuristic's kernel of `ast` (not through the caches)."""
    src = get_program(ast, Device["CPU"].renderer).src
    st = time.perf_counter()
    Device["CPU"].compiler.compile(src)
    return time.perf_counter() - st

def run_beam(fn, *arrays, amt=2, rounds=1, budget=UNLIMITED):
    """fn on Tensors of `arrays` realized under BEAM=amt (`rounds` rounds after the heuristic's variants, `budget`
    seconds, None: a dozen compiles); returns (numpy result, stats delta, the kernel ASTs)."""
    before = dict(search.beam_stats)
    ts = [Tensor(a).realize() for a in arrays]
    if budget is None:  # a dozen compiles at the speed the compiler has now (a fixed 2 s held two on a loaded machine)
        budget = max(KNOBS["BEAM_TIMEOUT_S"], 12 * max(compile_seconds(ast) for ast in kernel_asts(fn(*ts))))
    with Context(BEAM=amt, **{**KNOBS, "BEAM_ROUNDS": rounds, "BEAM_TIMEOUT_S": budget}):
        out = fn(*ts)
        sched = out.schedule()
        run_schedule(sched)
        res = out.numpy()
    asts = [si.ast for si in sched if si.ast.op.name == "SINK"]
    return res, {k: search.beam_stats[k] - before[k] for k in before}, asts

def check_choice(ast, amt=2):
    """The cached choice for `ast` applies, and the runner BEAM made uses it."""
    path = search.beam_cache_path(ast, "CPU", amt, CODEGEN_KNOBS)
    assert os.path.exists(path)
    with open(path) as f: opts = search.opts_from_json(json.load(f)["opts"])
    p = get_program(ast, Device["CPU"].renderer, opts=opts)
    assert list(p.applied_opts) == opts
    with Context(BEAM=amt): assert list(get_runner("CPU", ast).p.applied_opts) == opts
    return opts

def every_candidate_timed(stats) -> bool:
    # each compiled candidate but the unoptimized kernel (the reference) matched it and was timed
    assert stats["rejected"] == 0, search.beam_rejections[-stats["rejected"]:]
    return stats["timed"] == stats["compiled"] - 1

def test_matmul():
    # (the heuristic's variants only: a round of extensions of a matmul compiles some 40 candidates)
    a, b = rand(64, 96), rand(96, 80, seed=1)
    res, stats, asts = run_beam(lambda x, y: x @ y, a, b, rounds=0)
    np.testing.assert_allclose(res, a @ b, rtol=1e-4, atol=1e-4)
    assert stats["searches"] == 1 and stats["compiled"] > 5 and every_candidate_timed(stats)
    check_choice(asts[0])

def test_row_reduction():
    x = rand(256, 300)
    res, stats, asts = run_beam(lambda t: t.sum(1), x)
    np.testing.assert_allclose(res, x.sum(1), rtol=1e-4, atol=1e-4)
    assert stats["searches"] == 1 and stats["compiled"] > 10 and every_candidate_timed(stats)
    check_choice(asts[0])

def test_fused_elementwise():
    a, b, c = rand(40, 70), rand(40, 70, seed=1), rand(40, 70, seed=2)
    res, stats, asts = run_beam(lambda x, y, z: (x * y + z).relu() - x.exp() * 0.5, a, b, c)
    np.testing.assert_allclose(res, np.maximum(a * b + c, 0) - np.exp(a) * 0.5, rtol=1e-5, atol=1e-5)
    assert len(asts) == 1 and stats["searches"] == 1 and stats["compiled"] > 3 and every_candidate_timed(stats)
    check_choice(asts[0])

def test_odd_matmul():
    # a big kernel under the usual time budget: how many candidates fit depends on the machine, but the unoptimized
    # and the heuristic's kernels are always compiled, and the heuristic's is timed
    a, b = rand(8, 1023), rand(1023, 1023, seed=1)
    res, stats, _ = run_beam(lambda x, y: x @ y, a, b, budget=None)
    np.testing.assert_allclose(res, a @ b, rtol=1e-3, atol=1e-3)
    assert stats["searches"] == 1 and stats["compiled"] >= 2 and stats["timed"] >= 1
    assert stats["rejected"] == 0, search.beam_rejections[-stats["rejected"]:]

def test_softmax():
    x = rand(32, 1000) * 4
    res, stats, _ = run_beam(lambda t: t.softmax(-1), x, rounds=0)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(res, e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-6)
    assert stats["searches"] == 1 and stats["compiled"] > 5 and every_candidate_timed(stats)

def test_in_place_kernel_runs_once():
    # the search runs the kernel many times, on scratch buffers: the real buffer is updated once
    x = Tensor(np.arange(96, dtype=np.float32)).realize()
    with Context(BEAM=1, **KNOBS):
        x.assign(x * 2 + 1).realize()
    np.testing.assert_array_equal(x.numpy(), np.arange(96, dtype=np.float32) * 2 + 1)

def test_differing_outputs_are_rejected():
    # a "candidate" computing something else than the reference kernel is rejected on its first run
    ref_ast = kernel_asts(Tensor.empty(64) * 2)[0]
    other_ast = kernel_asts(Tensor.empty(64).sqrt())[0]
    ren, dev = Device["CPU"].renderer, Device["CPU"]
    scratch = search._Scratch(ref_ast, "CPU")
    timer = search._Timer(scratch, 2, float("inf"))
    ref, good = search._kernel(ref_ast, ren, ()), search._kernel(ref_ast, ren, (Opt(OptOps.UPCAST, 0, 4),))
    bad = search._kernel(other_ast, ren, ())
    for c, ast in ((ref, ref_ast), (good, ref_ast), (bad, other_ast)): c.p = get_program(ast, ren, opts=list(c.opts))
    search._compile([ref, good, bad], dev, CompiledRunner)
    before = search.beam_stats["rejected"]
    assert timer.reference(ref)
    timer.time(good)
    timer.time(bad)
    assert not good.bad and len(good.times) >= 2 and bad.bad and bad.time == float("inf")
    assert search.beam_stats["rejected"] == before + 1
    # why: the first element that differs (sqrt(0.5..1) where the reference doubled it), seen again on a second run
    assert "elements differ, the first [0]" in search.beam_rejections[-1]
    assert search.beam_rejections[-1].endswith("differs again")

@pytest.mark.parametrize("numpy", [True, False])
def test_output_check_tolerance(numpy, monkeypatch):
    from fusegrad.dtype import dtypes
    if not numpy: monkeypatch.setattr(search, "_np", lambda: None)
    def matches(out: np.ndarray, ref: np.ndarray, dt=dtypes.float32) -> bool:
        return search._Reference({0: memoryview(ref.tobytes())}, {0: dt}).matches(0, memoryview(out.tobytes()))
    ref = np.linspace(-50, 50, 1000, dtype=np.float32)
    assert matches(ref * np.float32(1 + 1e-6), ref) and matches(ref, ref)
    wrong = ref.copy(); wrong[-1] += 1
    assert not matches(wrong, ref)
    special = ref.copy(); special[3], special[5], special[7] = np.nan, np.inf, -np.inf
    assert matches(special, special)
    assert not matches(ref, special) and not matches(special, ref)
    assert matches(ref.astype(np.float16), ref.astype(np.float16) * np.float16(1.001), dtypes.float16)
    assert not matches(np.arange(4, dtype=np.int32), np.zeros(4, np.int32), dtypes.int32)
    assert matches(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), dtypes.int32)

def test_upcast_after_pack_is_refused():
    # a PACK copy's layout has no room for lanes of the loop it is made in: expanding that loop later must not apply
    # (it gave wrong results; BEAM's output check found it)
    ast = kernel_asts(Tensor.empty(64, 96) @ Tensor.empty(96, 48))[0]
    k = Kernel(ast, Device["CPU"].renderer)
    for o in [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 0, 8), Opt(OptOps.SWAP, 0, 1), Opt(OptOps.PACK, 0, 2)]:
        k.apply_opt(o)
    with pytest.raises(KernelOptError): k.apply_opt(Opt(OptOps.UPCAST, 0, 2))
    k.apply_opt(Opt(OptOps.UNROLL, 2, 4))  # other loops still can

def test_candidate_actions():
    ast = kernel_asts(Tensor.empty(64, 96) @ Tensor.empty(96, 80))[0]
    k = Kernel(ast, Device["CPU"].renderer)
    acts = search.candidate_actions(k)
    ops = {a.op for a in acts}
    assert {OptOps.UPCAST, OptOps.UNROLL, OptOps.SWAP, OptOps.PACK, OptOps.KBLOCK, OptOps.SPLIT} <= ops
    assert len(acts) == len(set(acts))
    assert all(a.axis < len(k.loops) for a in acts)

def test_opts_json_roundtrip_and_validation():
    opts = [Opt(OptOps.PADTO, 1, 32), Opt(OptOps.UPCAST, 0, 8), Opt(OptOps.KBLOCK, 2, 256)]
    assert search.opts_from_json(json.loads(json.dumps(search.opts_to_json(opts)))) == opts
    for bad in ("x", [["NOPE", 0, 1]], [["UPCAST", 0]], [["UPCAST", "0", 1]], [["UPCAST", 0, 1.5]], {"a": 1}):
        with pytest.raises(ValueError): search.opts_from_json(bad)

def test_bad_cache_entries_are_ignored():
    ast = kernel_asts(Tensor.empty(48, 64) + 1)[0]
    path = search.beam_cache_path(ast, "CPU", 2, CODEGEN_KNOBS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    good_key = None
    entries = [b"\x00garbage{", b'{"key": "another kernel", "opts": []}', None, b"[1, 2]"]
    for entry in entries:
        if entry is None:  # the right key, opts that don't apply to this kernel (stale)
            entry = json.dumps({"key": good_key, "opts": [["UPCAST", 7, 4]]}).encode()
        with open(path, "wb") as f: f.write(entry)
        before = dict(search.beam_stats)
        with Context(**KNOBS): opts = search.beam_opts(ast, "CPU", 2, CompiledRunner, CODEGEN_KNOBS)
        assert search.beam_stats["searches"] == before["searches"] + 1
        assert search.beam_stats["cache_hits"] == before["cache_hits"]
        with open(path) as f: data = json.load(f)
        good_key = data["key"]
        assert search.opts_from_json(data["opts"]) == opts
    before = dict(search.beam_stats)
    # now the entry is good: a hit, no search
    assert search.beam_opts(ast, "CPU", 2, CompiledRunner, CODEGEN_KNOBS) == opts
    assert search.beam_stats["searches"] == before["searches"]
    assert search.beam_stats["cache_hits"] == before["cache_hits"] + 1

def test_cachelevel_0_doesnt_touch_the_disk(tmp_path):
    ast = kernel_asts(Tensor.empty(32, 16) * 3)[0]
    with Context(CACHELEVEL=0, **KNOBS): search.beam_opts(ast, "CPU", 1, CompiledRunner, CODEGEN_KNOBS)
    assert not os.path.exists(os.path.join(str(tmp_path), "fusegrad", "beam"))

def test_heuristic_is_default_and_second_process_uses_the_cache(tmp_path):
    a, b = rand(48, 96), rand(96, 80, seed=1)  # (a kernel no other test makes: it isn't in the method cache)
    np.save(tmp_path / "a.npy", a); np.save(tmp_path / "b.npy", b)
    res, stats, asts = run_beam(lambda x, y: x @ y, a, b, rounds=0)
    assert stats["searches"] == 1
    chosen = check_choice(asts[0])
    # a fresh process: without BEAM nothing of the search is imported and the heuristic's opts are used; with BEAM=2
    # the kernel's opts come from the cache this process wrote, without a search
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from fusegrad import Tensor
        from fusegrad.codegen import optimize
        from fusegrad.engine.realize import get_runner
        from fusegrad.helpers import Context
        a, b = [Tensor(np.load(f"{str(tmp_path)}/{{n}}.npy")).realize() for n in "ab"]
        plain = (a @ b).numpy()
        ast = [si.ast for si in (a @ b).schedule() if si.ast.op.name == "SINK"][0]
        runner = get_runner("CPU", ast)
        heur = list(runner.p.applied_opts) == list(optimize(ast, runner.dev.renderer)[1])
        imported = "fusegrad.codegen.opt.search" in sys.modules
        with Context(BEAM=2, DEBUG=2):
            res = (a @ b).numpy()
            opts = [[o.op.name, o.axis, o.arg] for o in get_runner("CPU", ast).p.applied_opts]
        from fusegrad.codegen.opt.search import beam_stats
        print("RESULT", json.dumps(dict(heur=heur, imported=imported, stats=beam_stats, opts=opts,
                                        ok=bool(np.allclose(res, plain, rtol=1e-4, atol=1e-4)))))
    """)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": REPO}
    env.pop("BEAM", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got["heur"] and not got["imported"] and got["ok"]
    assert got["stats"]["searches"] == 0 and got["stats"]["cache_hits"] == 1 and got["stats"]["compiled"] == 0
    assert got["opts"] == search.opts_to_json(chosen)
    assert "BEAM cache hit" in out.stdout
