"""The autodiff part of the Tensor API: gradient(), backward(), requires_grad_() and the no-grad switch.

`requires_grad` is tri-state, as in tinygrad: True and None (not decided; an optimizer given the tensor turns it to
True) let backward() fill `.grad` of a floating-point tensor; False (PyTorch's habit) excludes a tensor. `gradient()`
differentiates with respect to whatever targets it is given, whatever their flag."""
from __future__ import annotations
import contextlib
import itertools
from typing import TYPE_CHECKING, ClassVar, Container, Iterator
from fusegrad.dtype import dtypes
from fusegrad.schedule.multi import shards_of
from fusegrad.gradient import compute_gradient, compute_gradients
from fusegrad.helpers import TRAINING
from fusegrad.schedule.simplify import const_view
from fusegrad.uop.graph import StructureWalk, new_buffer
from fusegrad.uop.ops import Ops, UOp

if TYPE_CHECKING:
    from fusegrad.tensor import Tensor

def _gradients(root: UOp, seed: UOp, targets: list[UOp], walk: StructureWalk | None = None) \
        -> dict[UOp, UOp | None]:
    """compute_gradient, with sharded roots and targets taken shard by shard. (`walk`: the StructureWalk of [root,
    seed] of an unsharded root, if the caller made it.)"""
    if root.op is not _MULTI and not any(t.op is _MULTI for t in targets):
        return compute_gradient(root, seed, set(targets), walk)  # type: ignore[return-value]
    from fusegrad.schedule.multi import gradient_of, gradient_seeds, gradient_targets
    shards = frozenset(s for t in targets if t.op is Ops.MULTI for s in t.src)
    grads = compute_gradients(gradient_seeds(root, seed), gradient_targets(targets), shards)
    return {t: gradient_of(t, grads) for t in targets}

class AutogradMixin:
    """Reverse-mode differentiation for Tensor; the gradient graphs are lazy like any other."""
    __slots__ = ()
    no_grad: ClassVar[bool] = False

    @staticmethod
    @contextlib.contextmanager
    def inference_mode(mode: bool = True) -> Iterator[None]:
        """`with Tensor.inference_mode():` sets Tensor.no_grad inside the block, so backward() fills no grads."""
        from fusegrad.tensor import Tensor
        prev, Tensor.no_grad = Tensor.no_grad, mode
        try: yield
        finally: Tensor.no_grad = prev

    class train(contextlib.ContextDecorator):
        """`with Tensor.train():` (or as a decorator) sets Tensor.training inside: dropout drops and batchnorm uses
        and updates batch statistics. `Tensor.train(False)` switches training off inside."""
        def __init__(self, mode: bool = True): self.mode = mode
        def __enter__(self) -> None:
            from fusegrad.tensor import Tensor
            self.prev = Tensor.training
            TRAINING.set(int(self.mode))
        def __exit__(self, *exc: object) -> None:
            TRAINING.set(int(self.prev))

    class test(train):
        """`with Tensor.test():` evaluation mode inside (Tensor.training False)."""
        def __init__(self, mode: bool = True): super().__init__(not mode)

    def requires_grad_(self: Tensor, requires_grad: bool | None = True) -> Tensor:
        """Set requires_grad in place (True, False or None) and return this tensor."""
        if requires_grad not in (True, False, None): raise TypeError(f"requires_grad must be a bool or None, "
                                                                     f"got {requires_grad!r}")
        self.requires_grad = requires_grad
        if requires_grad: self._own_storage()
        return self

    def _own_storage(self: Tensor) -> None:
        """Give a tensor that is only a constant (zeros, ones, full) a buffer of its own, lazily: constants are
        hash-consed, so two such parameters would otherwise be one node of the graph and share their gradients."""
        if self.uop.op is Ops.MULTI:  # each shard its own buffer
            from fusegrad.tensor import Tensor
            shards = [Tensor(s) for s in self.uop.src]
            for t in shards: t._own_storage()
            self.uop = UOp(Ops.MULTI, self.dtype, tuple(t.uop for t in shards), self.uop.arg)
            return
        if any(u.op is Ops.BUFFER for u in self.uop.toposort()): return
        buf = new_buffer(UOp(Ops.DEVICE, arg=self.device), self.numel(), self.dtype)
        view = buf.reshape(self.shape) if self.shape != (self.numel(),) else buf
        self.uop = UOp(Ops.ASSIGN, self.dtype, (view, self.uop))

    def gradient(self: Tensor, *targets: Tensor, gradient: Tensor | None = None) -> list[Tensor]:
        """The gradients of this tensor with respect to `targets` (lazy tensors; nothing is stored in `.grad`).
        Without `gradient` this tensor must be a scalar (the seed is 1); a target it doesn't depend on (or only through
        detach and non-differentiable ops) gets zeros, as in tinygrad."""
        from fusegrad.tensor import Tensor
        for t in targets:
            if not isinstance(t, Tensor): raise TypeError(f"gradient targets must be Tensors, got {type(t).__name__}")
        seed = self._grad_seed(gradient)
        for t in (self,) + targets:
            if not dtypes.is_float(t.dtype): raise RuntimeError(f"only float tensors have gradients, got {t.dtype}")
        grads = _gradients(self.uop, seed, [t.uop for t in targets])
        ret = []
        for t in targets:
            g = grads.get(t.uop)
            ret.append(Tensor(g if g is not None else const_view(0, t.dtype, UOp(Ops.DEVICE, arg=t.device), t.shape)))
        return ret

    def backward(self: Tensor, gradient: Tensor | None = None) -> Tensor:
        """Add the gradient of this tensor to `.grad` of every live floating-point tensor it was computed from, as
        tinygrad does (leaves and the intermediate tensors a program still holds), except those with
        requires_grad=False; zeros where it depends on one only through non-differentiable ops. Returns this tensor."""
        from fusegrad.tensor import Tensor, _is_realized_view, live_tensors
        seed = self._grad_seed(gradient)
        if Tensor.no_grad: return self
        walk: StructureWalk | None = None
        if (root := self.uop).op is Ops.MULTI: topo: Container[UOp] = UOp.sink_of(*shards_of(root)).toposort()
        else:
            # the walk the gradient cache makes of the root, then the seed: its nodes up to the root's position are
            # the root's graph (placed first, in order), and it is handed on, so the graph is walked once
            walk = StructureWalk().walk([root, seed])
            at, end = walk.position, walk.position[root]
            topo = set(itertools.islice(at, end + 1)) if len(at) > end + 1 else at
        # (a sharded tensor is a target only when asked for: the shards of a sharded target are each a variable of
        # their own, so a gradient would stop at an intermediate one instead of reaching the tensors it came from)
        need = [t for t in live_tensors() if t is not self and t.requires_grad is not False and
                (t.requires_grad is True or dtypes.is_float(t.dtype) and t.uop.op is not _MULTI) and
                any(u in topo for u in shards_of(t.uop))]
        if not need:
            # silently filling nothing would hide a graph cut by realize() (which replaces a tensor's graph by its
            # buffer)
            raise RuntimeError("backward(): no tensor this one was computed from is alive to take a gradient (was it "
                               "realized before backward()? realize() replaces the graph by its buffer)")
        for t in need:
            if not dtypes.is_float(t.dtype): raise RuntimeError(f"only float tensors have gradients, got {t.dtype}")
        grads = _gradients(root, seed, [t.uop for t in need], walk)
        for t in need:
            g = Tensor(grads[t.uop] if grads.get(t.uop) is not None else
                       const_view(0, t.dtype, UOp(Ops.DEVICE, arg=t.device), t.shape))
            if t.grad is None: t.grad = g
            elif _is_realized_view(t.grad.uop): t.grad.assign(t.grad + g)  # update realized grads in place
            else: t.grad = t.grad + g
        return self

    def _grad_seed(self: Tensor, gradient: Tensor | None) -> UOp:
        from fusegrad.tensor import Tensor
        if gradient is None:
            if self.shape != ():
                raise RuntimeError(f"grad can be implicitly created only for scalar outputs: this tensor has shape "
                                   f"{self.shape}; pass gradient= of that shape")
            return const_view(1.0, self.dtype, UOp(Ops.DEVICE, arg=self.device), ())
        if not isinstance(gradient, Tensor):
            raise TypeError(f"gradient must be a Tensor, got {type(gradient).__name__}")
        if gradient.shape != self.shape:
            raise ValueError(f"gradient has shape {gradient.shape}, but the tensor has shape {self.shape}")
        if gradient.device != self.device:
            raise ValueError(f"gradient is on {gradient.device}, but the tensor is on {self.device}")
        return gradient.cast(self.dtype).uop

_MULTI = Ops.MULTI   # (a module name: an Ops.X lookup costs ~0.1 us, here once per live tensor)
