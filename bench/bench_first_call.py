"""First calls: how long a fresh process with an empty program cache takes for its first call of

- ResNet-18's forward (batch 8, 64x64 images, eval mode, the parameters realized beforehand),
- an Adam step of the 784-512-10 MLP on cross-entropy (batch 128, the parameters realized beforehand),
- the 200-op graph of elementwise ops and row reductions of bench/bench_core.py (its first-run row).

Each run is its own process with a new, empty cache folder (XDG_CACHE_HOME), so every kernel is generated and
compiled; the time is from the call to its result being on the host, import and model construction excluded. On a
shared machine the wall time depends on the load, so the CPU time the call took is printed beside it: the process's
own (Python: scheduling, code generation), its compiler processes' and the calling thread's (time.thread_time: the
Python of the call without the compiler threads beside it). Every
row is run several times (the machine is shared: the least and the median are printed), and with --profile one run
of each prints where the time went (code generation against compiling, kernels, compiler runs); with --rewrites one
run of each counts the work of every rewrite pass; with --bytecodes one run of each (and of the --against-tree
checkout) counts the Python bytecodes the calling thread executes in scheduling, code generation and the rest: a figure
the machine's load doesn't change (hash seed fixed, garbage collector off), for before/after comparisons on a busy
machine. Before the runs the bytecode caches of the checkouts' fusegrad are brought up to date (as an installed package
has them): with PYTHONDONTWRITEBYTECODE set, a module edited since its cache was written would otherwise be compiled
from source in every run, inside the call for the modules a first call imports (code generation: ~0.2 s).

Run: .venv/bin/python bench/bench_first_call.py [--runs N] [--profile] [--only resnet,mlp,g200] [--against VAR=VALUE]
     [--against-tree PATH] [--rewrites] [--bytecodes]      (--runs 0: no timed runs)
"""
from __future__ import annotations
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

# the program each run executes; it prints "<first call ms> <kernels>" and, with PROFILE=1, a profile
PROGRAM = r"""
import os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "examples"))
import numpy as np
from fusegrad import Device, GlobalCounters, Tensor, nn
from fusegrad.nn.state import get_parameters
row = sys.argv[1]
profile = os.getenv("PROFILE") == "1"
bytecodes = os.getenv("BYTECODES") == "1"
if bytecodes:
    # bytecodes the calling thread executes, by phase (sys.settrace's opcode events; the compiler threads untraced)
    import fusegrad.tensor as tensor_mod
    from fusegrad import codegen
    counts, phase = {"schedule": 0, "codegen": 0, "rest": 0}, ["rest"]
    def in_phase(mod, name, label):
        real = getattr(mod, name)
        def wrapper(*a, **k):
            prev, phase[0] = phase[0], label
            try: return real(*a, **k)
            finally: phase[0] = prev
        setattr(mod, name, wrapper)
    in_phase(tensor_mod, "create_schedule_with_vars", "schedule")
    in_phase(codegen, "get_program", "codegen")
    def count_opcodes(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode": counts[phase[0]] += 1
        return count_opcodes
if profile:
    # the calling thread's time by phase (the schedule, code generation, waiting for compiles and for the C pool's
    # build), and each compiler run of the call: its tier, kernels and source size
    import threading
    import fusegrad.engine.realize as realize
    import fusegrad.tensor as tensor_mod
    import fusegrad.runtime.cpu_program as cpu_program
    from fusegrad import codegen
    from fusegrad.runtime.cpu_compiler import CPUCompiler
    phases, batches, in_call = {"schedule": 0.0, "codegen": 0.0, "compile+codegen": 0.0, "pool": 0.0}, [], [False]
    def timed(mod, name, phase):
        real = getattr(mod, name)
        def wrapper(*a, **k):
            st = time.perf_counter()
            try: return real(*a, **k)
            finally:
                if in_call[0] and threading.current_thread() is threading.main_thread():
                    phases[phase] += time.perf_counter() - st
        setattr(mod, name, wrapper)
    timed(tensor_mod, "create_schedule_with_vars", "schedule")
    timed(codegen, "get_program", "codegen")
    timed(realize, "compile_kernels", "compile+codegen")
    timed(cpu_program, "c_pool", "pool")
    real_compile = CPUCompiler.compile
    def timed_compile(self, src):
        st = time.perf_counter()
        try: return real_compile(self, src)
        finally:
            if in_call[0]:
                tier = "background" if self.background else "quick" if "-Og" in self.flags else "optimized"
                batches.append((time.perf_counter() - st, tier, src.count("_entry(void"), len(src)))
    CPUCompiler.compile = timed_compile
rewrites = os.getenv("REWRITES") == "1"
if rewrites:
    # per rewrite pass (the matcher's name): graph_rewrite runs, nodes they rewrote (or found rewritten), rule tries
    import fusegrad.uop.pattern as pattern
    passes, current = {}, [None]
    real_run, real_try = pattern.RewriteContext.rewrite, pattern.PatternMatcher.rewrite
    def counted_run(self, root):
        prev, current[0] = current[0], self.pm.name
        before = len(self.replace)
        try: return real_run(self, root)
        finally:
            if in_call[0]:
                p = passes.setdefault(self.pm.name, [0, 0, 0])
                p[0] += 1; p[1] += len(self.replace) - before
            current[0] = prev
    def counted_try(self, uop, ctx=None):
        if in_call[0]: passes.setdefault(current[0], [0, 0, 0])[2] += 1
        return real_try(self, uop, ctx)
    pattern.RewriteContext.rewrite, pattern.PatternMatcher.rewrite = counted_run, counted_try
    if not profile: in_call = [False]
if row == "resnet":
    import resnet
    model = resnet.ResNet(18)
    Tensor.realize(*get_parameters(model))
    x = Tensor(np.random.default_rng(0).standard_normal((8, 3, 64, 64)).astype(np.float32)).realize()
    def call():
        with Tensor.test(): return model(x).realize()
elif row == "mlp":
    rng = np.random.default_rng(0)
    l1, l2 = nn.Linear(784, 512), nn.Linear(512, 10)
    params = [l1.weight, l1.bias, l2.weight, l2.bias]
    Tensor.realize(*params)
    opt = nn.optim.Adam(params, lr=1e-3)
    xb = Tensor(rng.standard_normal((128, 784)).astype(np.float32)).realize()
    yb = Tensor(rng.integers(0, 10, 128).astype(np.int32)).realize()
    def call():
        with Tensor.train():
            opt.zero_grad()
            loss = l2(l1(xb).relu()).sparse_categorical_crossentropy(yb)
            loss.backward()
            opt.step()
        return loss.realize()
else:
    def call():
        x = Tensor.ones(77, 77).contiguous().realize()
        for i in range(200): x = (x*1.01+0.5).relu() if i % 3 else x.sum(1, keepdim=True).expand(77, 77)*0.001 + x
        return x.realize()
Device["CPU"].synchronize()
k0 = GlobalCounters.kernel_count
st, c0, t0 = time.perf_counter(), os.times(), time.thread_time()
if profile or rewrites: in_call[0] = True
if bytecodes:
    import gc
    gc.disable()   # (a collection would run at a point that depends on what ran before, and its finalizers count)
    sys.settrace(count_opcodes)
out = call()
out.numpy()
if bytecodes: sys.settrace(None)
ms, c1, thread = (time.perf_counter() - st) * 1e3, os.times(), (time.thread_time() - t0) * 1e3
if profile or rewrites: in_call[0] = False
own = (c1.user + c1.system - c0.user - c0.system) * 1e3
cc = (c1.children_user + c1.children_system - c0.children_user - c0.children_system) * 1e3
print(f"{ms:.1f} {GlobalCounters.kernel_count - k0} {own:.0f} {cc:.0f} {thread:.0f}")
if bytecodes:
    print(f"  bytecodes executed: scheduling {counts['schedule']}, code generation {counts['codegen']}, the rest "
          f"{counts['rest']}")
if rewrites:
    for name, (runs, nodes, tries) in sorted(passes.items(), key=lambda kv: -kv[1][2]):
        print(f"  rewrite pass {name}: {runs} runs, {nodes} nodes rewritten, {tries} nodes offered to the rules")
if profile:
    compile_wait = phases["compile+codegen"] - phases["codegen"]
    other = ms / 1e3 - phases["schedule"] - phases["compile+codegen"] - phases["pool"]
    ph = {k: f"{v * 1e3:.0f} ms" for k, v in phases.items()}
    print(f"  calling thread: schedule {ph['schedule']}, code generation {ph['codegen']}, waiting for compiles "
          f"{compile_wait * 1e3:.0f} ms, for the C pool's build {ph['pool']}, the rest (running kernels, Python) "
          f"{other * 1e3:.0f} ms")
    for tier in ("quick", "optimized", "background"):
        runs = [b for b in batches if b[1] == tier]
        if runs: print(f"  {tier} compiler runs: {len(runs)}, {sum(b[0] for b in runs) * 1e3:.0f} ms together, "
                       f"{sum(b[2] for b in runs)} kernels, {sum(b[3] for b in runs) / 1e3:.0f} kB of C; longest "
                       + ", ".join(f"{b[0] * 1e3:.0f} ms ({b[2]} kernels, {b[3] / 1e3:.1f} kB)"
                                   for b in sorted(runs, reverse=True)[:3]))
"""

ROWS = {"resnet": "ResNet-18 forward, b8 64px", "mlp": "MLP 784-512-10 Adam step", "g200": "200-op elementwise graph"}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def run_once(row: str, profile: bool = False, extra_env: dict[str, str] | None = None, tree: str = REPO,
             rewrites: bool = False, bytecodes: bool = False) -> tuple[tuple[float, float, float, float], int, str]:
    """One fresh process with an empty cache, importing fusegrad from checkout `tree`: ((first call ms, the process's
    CPU ms, its compilers' CPU ms, the calling thread's CPU ms), kernels it ran, the profile lines)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "PROFILE": "1" if profile else "0",
               "REWRITES": "1" if rewrites else "0", "BYTECODES": "1" if bytecodes else "0",
               **({"PYTHONHASHSEED": "0"} if bytecodes else {}), **(extra_env or {})}
        res = subprocess.run([sys.executable, "-c", PROGRAM, row], env=env, capture_output=True, text=True, cwd=tree)
    if res.returncode != 0: raise RuntimeError(f"{row} failed:\n{res.stderr}")
    first, *rest = res.stdout.splitlines()
    ms, kernels, own, cc, thread = first.split()
    return (float(ms), float(own), float(cc), float(thread)), int(kernels), "\n".join(rest)

def summary(label: str, runs: list[tuple[float, float, float, float]], kernels: int) -> str:
    wall, own, cc, thread = ([r[i] for r in runs] for i in range(4))
    return (f"{label:40s} first call: min {min(wall):6.0f} ms, median {statistics.median(wall):6.0f} ms "
            f"({kernels} kernels; runs {' '.join(f'{t:.0f}' for t in wall)}); CPU (median): Python "
            f"{statistics.median(own):.0f} ms, compilers {statistics.median(cc):.0f} ms; the calling thread's CPU "
            f"(time.thread_time): min {min(thread):.0f} ms, median {statistics.median(thread):.0f} ms")

def refresh_bytecode(tree: str) -> None:
    """Write the bytecode caches of `tree`'s fusegrad package that are missing or older than their source (where it
    can: a folder it can't write leaves the runs as they were)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(tree, "fusegrad")], env=env, check=False,
                   stdout=subprocess.DEVNULL)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--against", metavar="VAR=VALUE", action="append", default=[],
                    help="also run each row with these environment variables set, alternating run by run with the "
                         "plain runs (a before/after on a machine whose load changes)")
    ap.add_argument("--rewrites", action="store_true",
                    help="one more run of each row counting, per rewrite pass, its runs, the nodes they rewrote and "
                         "the nodes offered to its rules")
    ap.add_argument("--bytecodes", action="store_true",
                    help="one more run of each row (and of the --against-tree checkout) counting the Python bytecodes "
                         "of its scheduling, code generation and the rest")
    ap.add_argument("--against-tree", metavar="PATH",
                    help="also run each row with the fusegrad of another checkout (a git worktree of an earlier "
                         "commit), alternating run by run with this one's")
    args = ap.parse_args()
    against = dict(a.split("=", 1) for a in args.against)
    other = os.path.abspath(args.against_tree) if args.against_tree else REPO
    for tree in dict.fromkeys((REPO, other)): refresh_bytecode(tree)
    for row in args.only.split(","):
        runs: dict[str, list] = {"": [], "against": []}
        kernels = {"": 0, "against": 0}
        for _ in range(args.runs):
            for which in (("", "against") if against or args.against_tree else ("",)):
                ms, kernels[which], _ = run_once(row, extra_env=against if which else None,
                                                 tree=other if which else REPO)
                runs[which].append(ms)
        if (against or args.against_tree) and args.runs > 0:
            label = " ".join(args.against + ([args.against_tree] if args.against_tree else []))
            print(summary(f"{ROWS[row]} ({label})", runs["against"], kernels["against"]), flush=True)
        if args.runs > 0: print(summary(ROWS[row], runs[""], kernels[""]), flush=True)
        else: print(ROWS[row], flush=True)
        if args.profile: print(run_once(row, profile=True)[2], flush=True)
        if args.rewrites: print(run_once(row, rewrites=True)[2], flush=True)
        if args.bytecodes:
            for tree in ([other] if args.against_tree else []) + [REPO]:
                print(f"  ({tree})" + run_once(row, tree=tree, bytecodes=True)[2], flush=True)

if __name__ == "__main__":
    main()
