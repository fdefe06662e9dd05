"""A seeded fuzzer of TinyJit replays: each random program of test_fuzz_programs becomes a `@TinyJit` function of its
inputs, called several times with new input data (same shapes), and every call's outputs are compared with NumPy's
reference (`Ref`) for that call's data. Calls 1 and 2 run the function (plainly, then captured); the later ones are
replays, where a wrongly re-pointed buffer, a view kept from the capture, an output aliased to an input, a baked-in
value or a skipped kernel gives wrong numbers.

Each seed also draws how the function is called (`Case`):
- the targets of the program's `assign`s are tensors the function closes over (state carried across calls, like an
  optimizer step: the reference carries the NumPy state the same way) or arguments (each call writes its own);
- some read-only inputs are closed over and rewritten outside the function between calls (the replay must read the
  buffer's new contents);
- some inputs are passed as windows of a bigger buffer at an offset given by a bound `Variable`, another offset each
  call (the rest of the buffer holds NaN or a sentinel, so a read outside the window shows);
- some inputs are the maximum over the rows of a stack argument whose number of rows is a bound `Variable`, another
  value each call (a symbolic shape: the rows past it hold NaN or a sentinel);
- the same argument tensors in every call, their data written in place (assign) before it, or new tensors;
- TinyJit's prune=True or verify=2 now and then; a copy of an argument is returned too, the first output is
  returned twice, a Python scalar argument scales an extra output, and the results of every call are kept and checked
  again after the last call (a replay must not overwrite an earlier call's results) or dropped at once (the next
  replay may reuse their memory).
Outputs that are views of an argument are not returned by the main function: fusegrad refuses them (tinygrad 0.14
hands back the capture call's tensor). Such misuse is checked separately: returning an argument, the same tensor
passed as two arguments, a Python scalar argument that changes (tinygrad replays the captured value silently) must
each raise a JitError that names the problem, and the TinyJit must keep working after the error.

Replay a failure with `python -m test.test_fuzz_jit SEED`."""
from __future__ import annotations
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable
import numpy as np
import pytest
from fusegrad import GlobalCounters, Tensor, TinyJit, Variable
from fusegrad.engine.jit import JitError
from test.test_fuzz_programs import (CONSTS, FG_ENV, REF_ENV, RERUN_SALT, Generator, Program, Ref, Reject,
                                     compare, generate, input_array)

CALLS = (5, 6)          # calls per case: 2 that build the capture, the rest replays
SALT_TRIES = 6          # new data for a call is drawn again this often when it makes a line ill-conditioned
SENTINEL_INT = 77       # what an integer window's buffer holds outside the window (NaN for floats)

# ---------------------------------------------------------------------------------------------------------------------
# cases

@dataclass
class Case:
    prog: Program
    calls: int
    inputs: list[tuple[str, tuple[int, ...], str, int]]   # (name, shape, dtype, data seed) of every program input
    targets: dict[str, str]          # assign target -> the variable holding the assign's value
    state: set[str]                  # inputs closed over, updated by the function's assigns (state)
    outside: set[str]                # read-only inputs closed over and rewritten before each call
    windows: dict[str, int] = field(default_factory=dict)   # input -> rows of the bigger buffer it is a window of
    # input -> the most rows of the stack it is the maximum of: the argument is a stack of a symbolic number of rows
    # (a bound Variable, another value each call) and the function reduces it to the input
    stacks: dict[str, int] = field(default_factory=dict)
    realize_args: bool = False       # the assigns to arguments are realized inside (and checked after each call)
    copy: str | None = None          # an argument (read-only) whose copy is returned too
    twice: bool = False              # the first output is returned twice
    scalar: float | None = None      # a Python scalar argument multiplying an extra output
    keep: bool = False               # keep every call's results and check them again at the end
    reuse: bool = False              # the same argument tensors every call, their data written in place before it
    prune: bool = False              # TinyJit(prune=True): kernels computing the same values every call run once
    verify: int | None = None        # TinyJit(verify=n): replays 1, n, 2n... also run eagerly and compare

    @property
    def args(self) -> list[str]:
        """The inputs passed as arguments, in order."""
        return [n for n, *_ in self.inputs if n not in self.state and n not in self.outside]

    def describe(self) -> str:
        return (f"calls={self.calls} state={sorted(self.state)} args={self.args} outside={sorted(self.outside)} "
                f"windows={self.windows} stacks={self.stacks} realize_args={self.realize_args} copy={self.copy} "
                f"twice={self.twice} scalar={self.scalar} keep={self.keep} prune={self.prune} verify={self.verify} "
                f"reuse={self.reuse}")

def _parse_input(expr: str) -> tuple[tuple[int, ...], str, int]:
    shape, dt, seed = eval(expr, {"make_input": lambda s, d, seed: (tuple(s), d, seed)})
    return shape, dt, seed

def make_case(seed: int) -> Case:
    prog = generate(seed)
    rs = random.Random(seed * 7919 + 17)
    inputs = [(n, *_parse_input(e)) for n, e in prog.lines if e.startswith("make_input(")]
    targets = {}
    for v, e in prog.lines:
        for n, *_ in inputs:
            if e.startswith((f"{n}.assign(", f"assign_view({n},")): targets[n] = v
    state = {n for n in targets if rs.random() < 0.6}
    free = [n for n, shape, _, _ in inputs if n not in targets]
    outside = {n for n in free if rs.random() < 0.15}
    # keep at least one argument: a function without tensor arguments has nothing to re-point
    if len(state) + len(outside) == len(inputs): outside = set()
    if len(state) == len(inputs): state.discard(sorted(state)[0])
    windows = {n: rs.randint(1, 4) for n, shape, _, _ in inputs
               if n in free and n not in outside and len(shape) >= 1 and rs.random() < 0.25}
    stacks = {n: rs.randint(2, 5) for n, shape, _, _ in inputs
              if n in free and n not in outside and n not in windows and rs.random() < 0.2}
    copies = [n for n, shape, _, _ in inputs if n in free and n not in outside and len(shape) >= 1 and shape[0] > 1]
    first_float = bool(_float_outputs(prog))
    return Case(prog, rs.choice(CALLS), inputs, targets, state, outside, windows, stacks,
                realize_args=rs.random() < 0.6, copy=rs.choice(copies) if copies and rs.random() < 0.3 else None,
                twice=rs.random() < 0.25,
                scalar=rs.choice(CONSTS) if first_float and rs.random() < 0.3 else None, keep=rs.random() < 0.5,
                # (prune assumes what the kept kernels don't read as inputs never changes: no input rewritten outside)
                prune=not outside and rs.random() < 0.2, verify=2 if rs.random() < 0.15 else None,
                reuse=rs.random() < 0.25)

def _float_outputs(prog: Program) -> list[str]:
    env: dict[str, Any] = dict(REF_ENV)
    for v, e in prog.lines: env[v] = eval(e, env)
    return [o for o in prog.outputs if env[o].dt == "float32"]

def _scaled(case: Case) -> str | None:
    """The output that the scalar argument multiplies (the first float one)."""
    return None if case.scalar is None else _float_outputs(case.prog)[0]

# ---------------------------------------------------------------------------------------------------------------------
# the function and its calls

def make_function(case: Case, closed: dict[str, Tensor], outputs: list[str],
                  lazy: list[Any] | None = None) -> Callable[..., tuple]:
    """The program as a function of its argument inputs (and the scalar), reading `closed` for the others. `lazy`
    gets the returned tensors' base nodes before they are realized."""
    body = [(v, e) for v, e in case.prog.lines if not e.startswith("make_input(")]
    names, scaled = case.args, _scaled(case)
    def fn(*args: Any) -> tuple:
        env: dict[str, Any] = dict(FG_ENV, **closed)
        env.update(zip(names, args))
        for n in case.stacks: env[n] = env[n].max(axis=0)
        for v, e in body: env[v] = eval(e, env)
        outs = [env[o] for o in outputs]
        # (a flipped copy: the contiguous() of a contiguous tensor is that tensor, in tinygrad too)
        if case.copy is not None: outs.append(env[case.copy].flip(0).contiguous())
        if scaled is not None: outs.append(env[scaled] * args[len(names)])
        if case.twice and outs: outs.append(outs[0])
        if lazy is not None: lazy.extend(t.uop.base for t in outs[:len(outputs)])
        # the state's assigns are realized inside, as an optimizer step does: a capture records only the kernels that
        # run during the call (in tinygrad too), and nothing else realizes a closed-over tensor
        done = [*outs, *(closed[n] for n in case.state),
                *(env[n] for n in case.targets if n not in case.state and case.realize_args)]
        if done: Tensor.realize(*done)
        return tuple(outs)
    return fn

def _data(shape: tuple[int, ...], dt: str, seed: int) -> np.ndarray: return input_array(shape, dt, seed)

def _window(case: Case, name: str, data: np.ndarray, offset: int) -> np.ndarray:
    """The bigger buffer that `data` is a window of, at row `offset`; the rest is NaN (floats) or a sentinel."""
    rows = data.shape[0] + case.windows[name]
    big = np.full((rows,) + data.shape[1:], np.nan if data.dtype == np.float32 else SENTINEL_INT, dtype=data.dtype)
    big[offset:offset + data.shape[0]] = data
    return big

@dataclass
class CallData:
    salt: int
    data: dict[str, np.ndarray]      # input name -> this call's data (state: its value before the call)
    ref: dict[str, Ref]              # every program variable on the reference
    offsets: dict[str, int]          # window input -> its offset in this call
    lengths: dict[str, int]          # stack input -> its rows in this call
    stacks: dict[str, np.ndarray]    # stack input -> the whole stack (rows past the length: NaN or a sentinel)

def _stack(case: Case, name: str, shape: tuple[int, ...], dt: str, seed: int, rows: int) -> np.ndarray:
    st = _data((case.stacks[name],) + shape, dt, seed)
    st[rows:] = np.nan if dt == "float32" else SENTINEL_INT
    return st

def _input_data(case: Case, name: str, shape: tuple[int, ...], dt: str, seed: int, lengths: dict[str, int]) -> Any:
    if name not in case.stacks: return _data(shape, dt, seed)
    return _stack(case, name, shape, dt, seed, lengths[name])[:lengths[name]].max(axis=0)

def reference_call(case: Case, salt: int, state: dict[str, Ref], lengths: dict[str, int]) -> dict[str, Ref] | None:
    """The program's variables on NumPy for this call's data (state inputs: their carried values)."""
    env: dict[str, Any] = dict(REF_ENV)
    try:
        for v, e in case.prog.lines:
            if e.startswith("make_input("):
                shape, dt, seed = _parse_input(e)
                env[v] = state[v] if v in state else Ref(_input_data(case, v, shape, dt, seed + salt, lengths))
            else:
                env[v] = eval(e, env)
                Generator._check(env[v])
    except (Reject, ValueError, IndexError): return None
    return env

def plan_calls(case: Case) -> list[CallData]:
    """Each call's data and reference, the state carried from call to call; stops at a call no data makes
    well-conditioned (the first call's data is the generator's, which it vetted, unless an input is the maximum of
    a stack)."""
    rs = random.Random(case.prog.seed + 99)
    state = {n: Ref(_data(shape, dt, seed)) for n, shape, dt, seed in case.inputs if n in case.state}
    calls: list[CallData] = []
    for k in range(case.calls):
        for j in range(SALT_TRIES if k or case.stacks else 1):
            salt = (k * SALT_TRIES + j) * RERUN_SALT
            lengths = {n: rs.randint(1, rows) for n, rows in case.stacks.items()}
            ref = reference_call(case, salt, state, lengths)
            if ref is not None: break
        else: break
        data = {n: (state[n].v.astype(np.float32 if dt == "float32" else dt) if n in case.state else
                    _input_data(case, n, shape, dt, seed + salt, lengths)) for n, shape, dt, seed in case.inputs}
        offsets = {n: rs.randint(0, extra) for n, extra in case.windows.items()}
        stacks = {n: _stack(case, n, shape, dt, seed + salt, lengths[n]) for n, shape, dt, seed in case.inputs
                  if n in case.stacks}
        calls.append(CallData(salt, data, ref, offsets, lengths, stacks))
        state = {n: ref[case.targets[n]] for n in case.state}
    return calls

def _argument(case: Case, call: CallData, name: str) -> Any:
    data = call.data[name]
    if name in case.stacks:
        st = Tensor(call.stacks[name].copy()).realize()
        n = Variable(f"rows_{name}", 1, case.stacks[name]).bind(call.lengths[name])
        return st.shrink(((0, n),) + tuple((0, s) for s in data.shape))
    if name not in case.windows: return Tensor(data.copy()).realize()
    offset = call.offsets[name]
    big = Tensor(_window(case, name, data, offset)).realize()
    v = Variable(f"off_{name}", 0, case.windows[name]).bind(offset)
    return big.shrink(((v, v + data.shape[0]),) + tuple((0, s) for s in data.shape[1:]))

def _views_of(t: Tensor, bases: list[Any]) -> bool: return any(t.uop.base is b for b in bases)

def views_of_arguments(case: Case, call: CallData) -> tuple[list[str], list[str], int]:
    """The program's outputs that are (views of) an argument, before or after the realize, those that are both, and
    how many kernels the function runs without them: found by running the function eagerly. (A view of an argument
    can realize as a view of a constant, a pad that crops the whole argument away, or not, depending on the schedule
    cache: then TinyJit may or may not take it for the argument.)"""
    lazy: list[Any] = []
    def run(outputs: list[str]) -> tuple[list[Any], list[Tensor], int]:
        closed = {n: Tensor(call.data[n].copy()).realize() for n in case.state | case.outside}
        args = [_argument(case, call, n) for n in case.args]
        # (the buffers before the call: realizing a view of a Variable-bounded window inside makes the window a copy,
        # and the argument tensor then holds the copy)
        bases = [a.uop.base for a in args]
        k0 = GlobalCounters.kernel_count
        fn = make_function(case, closed, outputs, lazy)
        outs = fn(*args, *([case.scalar] if case.scalar is not None else []))
        return bases, outs, GlobalCounters.kernel_count - k0
    bases, outs, _ = run(case.prog.outputs)
    after = [o for o, t in zip(case.prog.outputs, outs) if _views_of(t, bases)]
    before = [o for o, u in zip(case.prog.outputs, lazy) if any(u is b for b in bases)]
    views = [o for o in case.prog.outputs if o in after or o in before]
    return views, [o for o in views if o in after and o in before], \
        run([o for o in case.prog.outputs if o not in views])[2]

@dataclass
class Outcome:
    case: Case
    ok: bool
    message: str = ""
    replays: int = 0

def _expected(case: Case, outputs: list[str], ref: dict[str, Ref]) -> tuple[list[str], dict[str, Ref]]:
    """The names and references of the returned tuple's entries."""
    names, exp = list(outputs), {o: ref[o] for o in outputs}
    if case.copy is not None:
        names.append(f"{case.copy}.flip(0)")
        exp[names[-1]] = ref[case.copy].flip(0)
    scaled = _scaled(case)
    if scaled is not None:
        names.append("scaled")
        exp["scaled"] = ref[scaled] * case.scalar
    if case.twice and names: names.append(names[0] + "(again)"); exp[names[-1]] = exp[names[0]]
    return names, exp

def _check(case: Case, names: list[str], got: tuple, exp: dict[str, Ref], tag: str) -> list[str]:
    view = Program(case.prog.seed, outputs=names)
    return [f"{tag} {p}" for p in compare(view, {n: t.numpy() for n, t in zip(names, got)}, exp)]

def run_case(case: Case) -> Outcome:
    calls = plan_calls(case)
    if not calls: return Outcome(case, True, "no data of the stacks' rows makes the program well-conditioned")
    try: arg_views, sure_views, kernels = views_of_arguments(case, calls[0])
    except Exception: return Outcome(case, False, f"the eager run raised:\n{traceback.format_exc()}")
    outputs = [o for o in case.prog.outputs if o not in arg_views]
    if not outputs and case.scalar is None and case.copy is None:
        return Outcome(case, True, "every output is a view of an argument")
    problems: list[str] = []
    closed = {n: Tensor(calls[0].data[n].copy()).realize() for n in case.state | case.outside}
    jit = TinyJit(make_function(case, closed, outputs), prune=case.prune, verify=case.verify)
    scalar = [case.scalar] if case.scalar is not None else []
    if kernels == 0:   # every result is a view of a tensor closed over (fusegrad realizes no kernel for a view)
        def two_calls() -> None:
            for c in calls[:2]: jit(*[_argument(case, c, n) for n in case.args], *scalar)
        p = _raises(two_calls, "ran no kernels")
        return Outcome(case, p is None, f"[a function that runs no kernel] {p}" if p else "")
    kept: list[tuple[int, list[str], tuple, dict[str, Ref]]] = []
    persistent: dict[str, Tensor] = {}
    for k, call in enumerate(calls):
        tag = f"[call {k + 1}, input seeds + {call.salt}]"
        for n in case.outside:   # rewritten in place: the replay reads the buffer it captured
            closed[n].assign(Tensor(call.data[n].copy())).realize()
        if k > 0:
            for n in case.state:   # the state must be what the reference carried
                got_state = closed[n].numpy()
                problems += [f"{tag} state {p}" for p in compare(Program(0, outputs=[n]), {n: got_state},
                                                                  {n: calls[k - 1].ref[case.targets[n]]})]
        if case.reuse and k > 0:   # (windows and stacks are made anew: their views differ per call)
            for n, t in persistent.items(): t.assign(Tensor(call.data[n].copy())).realize()
        args = [persistent[n] if n in persistent else _argument(case, call, n) for n in case.args]
        if case.reuse and k == 0:
            persistent = {n: a for n, a in zip(case.args, args) if n not in case.windows and n not in case.stacks}
        try: got = jit(*args, *scalar)
        except Exception: return Outcome(case, False, f"{tag} fusegrad raised:\n{traceback.format_exc()}", k - 2)
        names, exp = _expected(case, outputs, call.ref)
        if len(got) != len(names): problems.append(f"{tag} {len(got)} results, expected {len(names)}")
        problems += _check(case, names, got, exp, tag)
        if case.twice and got[-1] is not got[0] and not np.array_equal(got[-1].numpy(), got[0].numpy()):
            problems.append(f"{tag} the output returned twice differs")
        if case.realize_args:   # an argument assigned to holds the assigned value
            for n in case.targets.keys() - case.state:
                problems += _check(case, [n], (args[case.args.index(n)],), {n: call.ref[case.targets[n]]},
                                   f"{tag} argument")
        if case.keep: kept.append((k, names, got, exp))
        del got, args
        if problems: return Outcome(case, False, "\n".join(problems), k - 1)
    # results kept from earlier calls: a later replay must not have written into them (views of the closed-over
    # tensors are returned as they are, and see their new contents)
    closed_bases = [t.uop.base for t in closed.values()]
    for k, names, got, exp in kept:
        fresh = [(n, t) for n, t in zip(names, got) if not _views_of(t, closed_bases)]
        if fresh:
            problems += _check(case, [n for n, _ in fresh], tuple(t for _, t in fresh), exp,
                               f"[result of call {k + 1}, read after call {len(calls)}]")
    if not problems: problems += misuse(case, jit, calls, arg_views, sure_views)
    return Outcome(case, not problems, "\n".join(problems), max(0, len(calls) - 2))

def _raises(fn: Callable[[], Any], words: str) -> str | None:
    """None when fn raises a JitError whose message contains `words`, else what happened."""
    try: fn()
    except JitError as e:
        return None if words in str(e) else f"JitError without {words!r}: {e}"
    except Exception: return f"raised something else than a JitError:\n{traceback.format_exc()}"
    return f"no JitError (expected one saying {words!r})"

def misuse(case: Case, jit: TinyJit, calls: list[CallData], arg_views: list[str], sure_views: list[str]) -> list[str]:
    """Misuses must raise a JitError that names the problem; a TinyJit stays usable after one."""
    if len(calls) < 3: return []
    problems: list[str] = []
    call = calls[-1]
    args = lambda: [_argument(case, call, n) for n in case.args]  # noqa: E731
    scalar = [case.scalar] if case.scalar is not None else []
    if case.scalar is not None:
        other = case.scalar + 1.0
        if (p := _raises(lambda: jit(*args(), other), "changed from")) is not None:
            problems.append(f"[a changed scalar argument] {p}")
    same = [(i, j) for i, a in enumerate(case.args) for j, b in enumerate(case.args) if i < j and
            not {a, b} & (case.windows.keys() | case.stacks.keys()) and call.data[a].shape == call.data[b].shape and
            call.data[a].dtype == call.data[b].dtype]
    if same:
        i, j = same[0]
        # the same tensor twice, or (with a first axis to flip) a second view of its buffer
        flip = call.data[case.args[i]].ndim > 0 and case.prog.seed % 2 == 1
        def aliased() -> Any:
            a = args()
            a[j] = a[i].flip(0) if flip else a[i]
            return jit(*a, *scalar)
        if (p := _raises(aliased, "same tensor")) is not None:
            problems.append(f"[one {'buffer viewed' if flip else 'tensor passed'} as two arguments] {p}")
    outputs = [o for o in case.prog.outputs if o not in arg_views]
    if sure_views and outputs:   # (with kernels to capture: a function that runs none is another error)
        jit2 = TinyJit(make_function(case, {n: Tensor(call.data[n].copy()).realize()
                                             for n in case.state | case.outside}, outputs + sure_views))
        def returns_input() -> None:
            for _ in range(3): jit2(*args(), *scalar)
        if (p := _raises(returns_input, "returns its input")) is not None:
            problems.append(f"[an argument returned] {p}")
    # after the errors the TinyJit replays as before (with state, its last call's result is the state: checked by
    # comparing a stateless case only)
    if not case.state and (case.scalar is not None or same):
        got = jit(*args(), *scalar)
        names, exp = _expected(case, outputs, call.ref)
        problems += _check(case, names, got, exp, "[a replay after the misuse]")
    return problems

def report(out: Outcome) -> str:
    return (f"fuzz jit seed={out.case.prog.seed} failed after {out.replays} replays (replay: python -m "
            f"test.test_fuzz_jit {out.case.prog.seed})\n{out.case.describe()}\n{out.case.prog.source()}\n"
            f"--- {out.message}")

def replay(seed: int, verbose: bool = True) -> Outcome:
    """Regenerate and run case `seed`, printing the program, how it is called and the comparison."""
    out = run_case(make_case(seed))
    if verbose:
        print(out.case.prog.source())
        print(out.case.describe())
        print(f"--- {'ok' if out.ok else 'FAILED'} ({out.replays} replays)")
        if out.message: print(out.message)
    return out

# ---------------------------------------------------------------------------------------------------------------------
# the fuzz tests

N_FAST = 80

@pytest.mark.parametrize("seed", range(N_FAST))
def test_fuzz_jit(seed: int):
    out = run_case(make_case(seed))
    assert out.ok, report(out)

@pytest.mark.slow
def test_fuzz_jit_many():
    fails = [o for o in (run_case(make_case(s)) for s in range(20_000, 20_600)) if not o.ok]
    assert not fails, f"{len(fails)} of 600 cases failed, seeds {[o.case.prog.seed for o in fails]}\n" + \
        "\n\n".join(report(o) for o in fails[:5])

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "--range":
        for s in sys.argv[1:]: replay(int(s))
    else:   # survey: `--range START STOP` runs those seeds and prints the failing ones
        lo, hi = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (0, 200)
        st, failing = time.perf_counter(), []
        for s in range(lo, hi):
            try: out = run_case(make_case(s))
            except Exception: out = Outcome(make_case(s), False, f"the fuzzer raised:\n{traceback.format_exc()}")
            if not out.ok:
                failing.append(s)
                print(report(out)[:3000], flush=True)
        print(f"{hi - lo} cases in {time.perf_counter() - st:.1f}s, failing seeds: {failing}", flush=True)
