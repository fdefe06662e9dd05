"""Elementwise functions of many operations (gelu, tanh, erf, sigmoid...) built as one node.

`x.gelu()` is some hundred nodes (its tanh is a polynomial and a formula, each exact to an ulp): ~200 us of Python
to build, and again to walk at every realize. Built by a method decorated with `@composite`, it is one node,
COMPOSITE(x), whose arg names the method and its settings; the node's graph is the method's, made from it when the
scheduler meets the node (schedule/simplify.py, on a schedule cache miss only) or autodiff differentiates it (its
gradient is one node per operand too: COMPOSITE(x, grad) of `_derivative`). Expanded, the graph is the very one the
method builds (hash-consing makes the same nodes), so kernels and values are the same as without the node.

A method qualifies when its graph depends on nothing but its operands' dtypes, device and shape and its settings,
and it keeps the shape. Its operands are `self` and the Tensors its call begins with (`a._float_pow(b)`, broadcast
before), the rest are settings: strings, bools or None only (a number, which a loop may change every step, is
passed as an operand, a constant of the graph that the schedule cache can make a kernel parameter). The node is made
for a float `self` only (an int's result dtype follows the default float, which may change before the node is
scheduled), and not while sources are tracked (each operation notes its own line) or tensors are sharded
(schedule/multi.py rewrites operations, not this node)."""
from __future__ import annotations
import functools, sys
from typing import Any, Callable
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import prod
from fusegrad.uop.ops import Ops, UOp, _arg_key, note_shape, plain_node

class Composite:
    """The arg of a COMPOSITE node: `build(*operands, *args, **kwargs)` with the node's sources as Tensors; `shape`:
    the result's, where it isn't the first operand's (a reduction)."""
    __slots__ = ("build", "args", "kwargs", "shape", "_key", "_hash")
    # (its graph is a function of the node's structure alone: gradient and schedule caches may key on it)
    pure = True

    def __init__(self, build: Callable[..., Any], args: tuple, kwargs: tuple[tuple[str, Any], ...] = (),
                 shape: tuple[int, ...] | None = None):
        self.build, self.args, self.kwargs, self.shape = build, args, kwargs, shape
        # (0.0 and -0.0 are different settings: compared through their cache keys)
        self._key = (build, _arg_key(args), _arg_key(kwargs), shape)
        # (hashed with every node made of it: once)
        self._hash = hash(self._key)

    def __eq__(self, other: object) -> bool: return type(other) is Composite and other._key == self._key
    def __hash__(self) -> int: return self._hash
    # (pickled by name: the class attribute is the decorated method, which pickle would refuse as not the same object)
    def __reduce__(self) -> tuple:
        return (_named_composite, (self.build.__module__, self.build.__qualname__, self.args, self.kwargs, self.shape))
    def __repr__(self) -> str:
        settings = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs]
        return f"{self.build.__qualname__}({', '.join(settings)})"

    @property
    def name(self) -> str:
        """What the node computes, for explanations: its function's name ("gelu", "linear"), or "gradient of" it."""
        if self.build is _derivative: return f"gradient of {self.args[0].name}"
        name = self.build.__name__.lstrip("_")
        return name[:-len("_node")] if name.endswith("_node") else name

    def expand(self, srcs: tuple[UOp, ...]) -> UOp:
        """The node's graph over its sources `srcs`."""
        from fusegrad.tensor import Tensor
        return self.build(*[Tensor(s) for s in srcs], *self.args, **dict(self.kwargs)).uop

    def autodiff(self, srcs: tuple[UOp, ...], grad: UOp) -> dict[UOp, UOp]:
        """The gradients of the node's sources by autodiff of its graph, given its result's gradient `grad`. (It
        stops at the sources, one of which may lie below another, as the incoming gradient may lie below x: the
        autodiff this is part of takes each source's gradient on down, once.)"""
        from fusegrad.gradient import compute_gradients
        return compute_gradients({self.expand(srcs): grad}, set(srcs), leaves=frozenset(srcs))

    def gradients(self, grad: UOp, srcs: tuple[UOp, ...]) -> tuple[UOp | None, ...]:
        """The gradient of each source of COMPOSITE(*srcs) given the node's gradient `grad`: the node
        COMPOSITE(*srcs, grad) of `_derivative` for each source (a node that is two sources once: its whole
        gradient); a derivative's own derivative is autodiff of its graph."""
        # (an int or bool result, argmax's or isinf's, passes no gradient, as its operations wouldn't)
        if not dtypes.is_float(grad.dtype): return (None,) * len(srcs)
        if self.build is _derivative:
            got = self.autodiff(srcs, grad)
            return tuple(got.get(s) if s not in srcs[:i] else None for i, s in enumerate(srcs))
        return tuple(UOp(Ops.COMPOSITE, x.dtype, (*srcs, grad),
                         Composite(_derivative, (self, i), shape=x.shape if i and x.shape != srcs[0].shape else None))
                     if x not in srcs[:i] else None for i, x in enumerate(srcs))

# (the node's arg and its sources' shapes) -> composite_work of such a node
_work_known: dict[tuple, int | None] = {}

def composite_work(c: UOp) -> int | None:
    """The elements the reductions of COMPOSITE node `c`'s graph read (its sources' graphs not counted): what
    computing it costs, for the choices that weigh a graph's work (a reader kept lazy, a result computed whole); None
    where a size is symbolic."""
    key = (c.arg, tuple(s.shape for s in c.src))
    if (work := _work_known.get(key, -1)) != -1: return work
    srcs, work = set(c.src), 0
    for n in c.arg.expand(c.src).toposort(gate=lambda n: n not in srcs):
        if n in srcs: continue
        if not isinstance(n_work := reduction_work(n), int):
            work = None
            break
        work += n_work
    if len(_work_known) >= KNOWN_SIZE: _work_known.clear()
    _work_known[key] = work
    return work

def reduction_work(n: UOp) -> int | None:
    """The elements node `n` itself reduces: a REDUCE_AXIS's input, a COMPOSITE's composite_work, else 0; None (or
    a symbolic size) where a size is symbolic."""
    if n.op is Ops.REDUCE_AXIS: return prod(n.src[0].shape)
    return composite_work(n) if n.op is Ops.COMPOSITE else 0

def _named_composite(module: str, qualname: str, args: tuple, kwargs: tuple, shape: tuple | None) -> Composite:
    build: Any = sys.modules[module]
    for name in qualname.split("."): build = getattr(build, name)
    return Composite(getattr(build, "__wrapped__", build), args, kwargs, shape)

def _derivative(*args: Any) -> Any:
    """_derivative(*operands, grad, of, at): the gradient at operand `at` of the composite `of` over `operands`,
    given its result's gradient `grad` (Composite.autodiff)."""
    *tensors, of, at = args
    *xs, grad = tensors
    us = tuple(x.uop for x in xs)
    got = of.autodiff(us, grad.uop).get(us[at])
    return type(grad)(got) if got is not None else xs[at].zeros_like()

# (method, operand dtypes and device (and shapes, for a `shaped` method), settings) -> (result dtype, the node's arg):
# known once the method built it
_known: dict[tuple, tuple[DType, Composite]] = {}
KNOWN_SIZE = 4096   # (a shaped method's entries are per shape: a decoder's growing sequence makes one per step)
# the settings a node may have in its arg (gelu's approximate="none"): not numbers
_STRUCTURAL = (str, bool, type(None))

def _structural(v: Any, shaped: bool) -> bool:
    """Whether `v` may be a setting in a node's arg: a str, bool or None; for a shaped method also an axis (an int,
    or a tuple of them)."""
    t = type(v)
    return t in _STRUCTURAL or shaped and (t is int or t is tuple and all(type(a) is int for a in v))

def composite(method: Callable[..., Any] | None = None, *, shaped: bool = False) -> Any:
    """Decorate a Tensor method (see the module's docstring) to build it as one COMPOSITE node. Its operands are
    `self` and the Tensors its call begins with. An elementwise method's operands are of one shape (broadcast before
    the call), which is its result's; with `shaped`, operands and result may have any (int) shapes (a reduction, a
    concatenation) and its settings may be axes: the shapes are part of the key, and the result's is in the arg."""
    if method is None: return functools.partial(composite, shaped=shaped)
    @functools.wraps(method)
    def as_one_node(self: Any, *args: Any, **kwargs: Any) -> Any:
        u = self._uop
        tensor = sys.modules["fusegrad.tensor"]
        if not dtypes.is_float(dt := u.dtype) or tensor._sharding_used or type(self).__init__ is not tensor._plain_init:
            return method(self, *args, **kwargs)
        srcs, key = (u,), (method, dt, u.device)
        if shaped:
            if not all(type(d) is int for d in u.shape): return method(self, *args, **kwargs)
            key += (u.shape,)
        if args or kwargs:
            n = 0
            while n < len(args) and isinstance(args[n], tensor.Tensor): n += 1
            if n:
                srcs = (u, *(t._uop for t in args[:n]))
                for o in srcs[1:]:
                    fits = all(type(d) is int for d in o.shape) if shaped else o.shape == u.shape
                    if not fits or o.device != u.device: return method(self, *args, **kwargs)
                key += tuple((o.dtype, o.shape) if shaped else o.dtype for o in srcs[1:])
            settings, kw = args[n:], tuple(kwargs.items())
            # (a number is a setting a loop may change every step: in a graph of ops it is a constant, which the
            # schedule cache makes a kernel parameter once it changes; in the arg, each value would be a new kernel)
            if not all(_structural(a, shaped) for a in settings) or not all(_structural(v, shaped) for _, v in kw):
                return method(self, *args, **kwargs)
            key += (settings, kw)
        else: settings, kw = (), ()
        known = _known.get(key)
        if known is None:
            # the first call: built as usual, which checks the settings and tells the result's dtype and shape
            ret = method(self, *args, **kwargs)
            if ret.shape != self.shape and not shaped: raise RuntimeError(f"{method.__qualname__} is not elementwise")
            if len(_known) >= KNOWN_SIZE: _known.clear()
            arg = Composite(method, settings, kw, ret.shape if ret.shape != u.shape else None)
            known = _known[key] = (ret.dtype, arg)
        return tensor.Tensor._of(note_shape(plain_node(Ops.COMPOSITE, known[0], srcs, known[1]), u, known[1].shape))
    # (named as the method in tracebacks and in the sources explain notes: the first frame in the package, below the
    # user's line, names the operation)
    code = as_one_node.__code__
    as_one_node.__code__ = code.replace(co_name=method.__name__, co_qualname=method.__qualname__)
    return as_one_node
