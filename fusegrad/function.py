"""`@function`: marks a function of tensors (a model's `__call__`, a loss) as one unit, as tinygrad's decorator does.

fusegrad's graph is lazy already and its schedule cache serves a repeated call's kernels without compiling again, so
the decorator does not change how the function's graph is built or run. What it keeps of tinygrad's contract is what
a program can observe: the function returns a Tensor or a tuple of Tensors, and with `allow_implicit=False` (the
default) it reads no realized tensor that did not reach it through its arguments (a tensor captured from a closure or
a global would be frozen into a precompiled call on tinygrad), which raises RuntimeError naming those buffers.
`precompile` and `precompile_backward` are accepted for compatibility and change nothing here."""
from __future__ import annotations
import functools
import time
from typing import Any, Callable, Generic, TypeVar, overload
from fusegrad.helpers import DEBUG
from fusegrad.nn.state import get_state_dict
from fusegrad.tensor import Tensor
from fusegrad.uop.ops import Ops, UOp

ReturnType = TypeVar("ReturnType")

def _implicit_buffers(outputs: list[UOp], inputs: set[UOp]) -> list[UOp]:
    """The BUFFER nodes the outputs' graphs reach without passing through one of the input nodes."""
    found: dict[UOp, None] = {}
    for out in outputs:
        for u in out.toposort(gate=lambda u: u not in inputs):
            if u.op is Ops.BUFFER and u not in inputs: found[u] = None
    return list(found)

class _function(Generic[ReturnType]):
    def __init__(self, fxn: Callable[..., ReturnType], *, precompile: bool, precompile_backward: bool,
                 allow_implicit: bool, grad_fxn: Callable | None):
        if grad_fxn is not None:
            raise NotImplementedError("function(grad_fxn=...): a gradient rule for a whole function is not supported; "
                                      "its result is differentiated op by op (Tensor.custom_kernel takes a grad_fxn)")
        self.fxn, self.precompile, self.precompile_backward = fxn, precompile, precompile_backward
        self.allow_implicit = allow_implicit
        functools.update_wrapper(self, fxn)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return functools.partial(self.__call__, obj) if obj is not None else self

    def __call__(self, *args: Any, **kwargs: Any) -> ReturnType:
        st = time.perf_counter()
        ret = self.fxn(*args, **kwargs)
        outs = [ret] if isinstance(ret, Tensor) else list(ret) if isinstance(ret, tuple) else None
        name = getattr(self.fxn, "__qualname__", None) or type(self.fxn).__qualname__
        if outs is None or not all(isinstance(t, Tensor) for t in outs):
            raise RuntimeError(f"function {name} returned {type(ret).__name__}: a function must return a Tensor or a "
                               "tuple of Tensors")
        if not self.allow_implicit:
            inputs = {t.uop for t in get_state_dict((args, kwargs)).values()}
            implicit = _implicit_buffers([t.uop for t in outs], inputs)
            if implicit:
                listed = "\n  ".join(f"{i}: dtype={b.dtype}, size={b.arg[1]}, "
                                     f"device={b.device}" for i, b in enumerate(implicit))
                raise RuntimeError(f"function {name} reads {len(implicit)} tensor(s) that are not among its arguments "
                                   f"(implicit buffers), but allow_implicit=False; pass them as arguments or use "
                                   f"@function(allow_implicit=True)\n  {listed}")
        if DEBUG >= 2: print(f"function in {(time.perf_counter() - st) * 1000:8.2f} ms: {name}")
        return ret

@overload
def function(fxn: Callable[..., ReturnType], *, precompile: bool = False, precompile_backward: bool = False,
             allow_implicit: bool = False, grad_fxn: Callable | None = None) -> _function[ReturnType]: ...
@overload
def function(fxn: None = None, *, precompile: bool = False, precompile_backward: bool = False,
             allow_implicit: bool = False, grad_fxn: Callable | None = None) \
        -> Callable[[Callable[..., ReturnType]], _function[ReturnType]]: ...
def function(fxn: Callable[..., ReturnType] | None = None, *, precompile: bool = False,
             precompile_backward: bool = False, allow_implicit: bool = False, grad_fxn: Callable | None = None) -> Any:
    """Decorate a function of tensors, as `@function` or `@function(allow_implicit=True)` (see the module doc)."""
    def make(f: Callable[..., ReturnType]) -> _function[ReturnType]:
        return _function(f, precompile=precompile, precompile_backward=precompile_backward,
                         allow_implicit=allow_implicit, grad_fxn=grad_fxn)
    return make if fxn is None else make(fxn)
