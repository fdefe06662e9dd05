"""Optimizers: SGD, Adam, AdamW, LAMB, LARS, Muon and OptimizerGroup.

The learning rate and every piece of optimizer state (momentum buffers, Adam's moments and its bias-correction
powers) live in device buffers updated with `assign`, so a training step is one lazy graph: `step()` realizes the
new parameters and state in a single schedule, and changing the learning rate between steps only rewrites a buffer
(no new kernel, no new schedule)."""
from __future__ import annotations
import math
import struct
from typing import Any
from fusegrad.dtype import dtypes
from fusegrad.tensor import Tensor
from fusegrad.uop.graph import new_buffer
from fusegrad.uop.ops import Ops, UOp, device_buffer, with_src

__all__ = ["Optimizer", "OptimizerGroup", "SGD", "LARS", "LAMB", "Adam", "AdamW", "Muon"]

def _state_buffer(value: float, shape: tuple[int, ...] = (1,), device: Any = None,
                  like: Tensor | None = None) -> Tensor:
    """A float32 buffer of its own (constants are hash-consed, so two `zeros(3)` would be one node): of `shape` on
    `device`, or laid out like the parameter `like` (a sharded parameter's state is split like it)."""
    if like is None: t = Tensor.full(shape, value, dtype=dtypes.float32, device=device)
    else: t = Tensor.full(like.shape, value, dtype=dtypes.float32, device=like.device).shard_like(like)
    t._own_storage()
    t.requires_grad = False
    return t

class Optimizer:
    """Base class: holds the parameters (requires_grad None becomes True), the learning rate tensor and the step."""
    def __init__(self, params: list[Tensor], lr: float, device=None, fused: bool = False):
        params = list(params)
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer parameters must be Tensors, got {type(p).__name__}")
        params = list(dict.fromkeys(params))  # a parameter listed twice would be updated twice
        if not params: raise ValueError("optimizer got an empty parameter list")
        for p in params:
            if p.requires_grad is None: p.requires_grad_(True)
        self.params = [p for p in params if p.requires_grad]
        # tensors that don't take gradients (e.g. batchnorm running stats) are realized with each step
        self.buffers = [p for p in params if not p.requires_grad]
        if not self.params: raise ValueError("optimizer got no parameter with requires_grad")
        self.device = device if device is not None else self.params[0].device
        self._devices = [p.device for p in self.params]  # the state is made for these
        self.fused = fused
        self._lr = _state_buffer(lr, device=self.device)

    def _realize_state(self, *state: Tensor) -> None:
        """Give the parameters, the learning rate and the optimizer state their memory in one realize (assign needs
        it), instead of one schedule per tensor at the first step."""
        Tensor.realize(self._lr, *self.params, *self.buffers, *state)

    @property
    def lr(self) -> Tensor:
        """The learning rate, a (1,) float32 tensor; setting a number or tensor writes into the same buffer."""
        return self._lr

    @lr.setter
    def lr(self, value: float | Tensor) -> None:
        if isinstance(value, Tensor):
            if value is not self._lr: self._lr.assign(value.reshape(1).cast(dtypes.float32)).realize()
            return
        # a number is written straight into the buffer: no kernel, so no compile even for the first new value
        raw = memoryview(struct.pack("f", float(value)))
        from fusegrad.schedule.multi import shards_of
        for shard in shards_of(self._lr.realize().uop): device_buffer(shard.base).copyin(raw)

    def zero_grad(self) -> None:
        """Forget the gradients of every parameter."""
        for p in self.params: p.grad = None

    def schedule_step(self) -> list[Tensor]:
        """The tensors one step updates (parameters, optimizer state, buffers), lazily: realize them together."""
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            p = self.params[missing[0]]
            raise RuntimeError(f"parameter {missing[0]} (shape {p.shape}) has no gradient: call backward() on a loss "
                               "that depends on every parameter before step()")
        for i, (p, was) in enumerate(zip(self.params, self._devices)):
            if p.device != was:
                raise RuntimeError(f"parameter {i} is on {p.device}, but the optimizer was made when it was on {was}: "
                                   "move or shard the parameters before making the optimizer")
        grads = [p.grad for p in self.params]
        return self._step_graph(grads) + self.params + self.buffers

    # A step's graph is the same every step but for the gradients (the parameters and the state are the same buffers,
    # the settings the same numbers): it is built once over placeholders standing for the gradients, and each step
    # substitutes its own gradients into it. Building it through tensor operations cost ~0.7 ms per step for the
    # 784-512-10 MLP's Adam, the substitution ~0.1 ms.
    def _step_graph(self, grads: list[Tensor]) -> list[Tensor]:
        """Make the state tensors (parameters, optimizer state) this step's lazy updates; returns the state tensors
        `_step` returns."""
        state = self._state_tensors()
        key = (self._settings(), tuple(t.uop for t in state), tuple((g.shape, g.dtype, g.device) for g in grads))
        cached = getattr(self, "_step_cache", None)
        if cached is None or cached[0] != key:
            if not all(isinstance(g.device, str) and all(type(s) is int for s in g.shape) for g in grads):
                return self._step(self.params, grads)   # (sharded or symbolic: built every step)
            holders = [new_buffer(UOp(Ops.DEVICE, arg=g.device), math.prod(g.shape), g.dtype).reshape(g.shape)
                       for g in grads]
            # (no tensor may keep a graph over the placeholders: where _step fails, or returns tensors that aren't
            # state it holds, the state is put back; the latter is then built every step)
            def put_back() -> None:
                for t, u in zip(state, key[1]): t.uop = u
            try: returned = self._step(self.params, [Tensor(h) for h in holders])
            except BaseException:
                put_back()
                raise
            if not all(any(r is t for t in state) for r in returned):
                put_back()
                return self._step(self.params, grads)
            # (a lazy target that assign realized here is a buffer next step: the graph is built once more then)
            template = [t.uop for t in state]
            cached = self._step_cache = (key, holders, template, returned, _over(holders, template))
        _, holders, template, returned, over = cached
        # the nodes over the placeholders made again over this step's gradients, sources first (the others, the
        # parameters' and the state's buffers and what only they reach, are the same nodes every step)
        new = dict(zip(holders, [g.uop for g in grads]))
        get = new.get
        for u in over: new[u] = with_src(u, tuple(map(get, u.src, u.src)))
        for t, u in zip(state, template):
            if (v := new.get(u, u)) is not t.uop: t.uop = v
        return returned

    def _state_tensors(self) -> list[Tensor]:
        """The tensors a step may update: the parameters and every tensor the optimizer holds but the buffers (a batch
        norm's running statistics, which the forward pass updates: a new graph every step)."""
        out: dict[int, Tensor] = {id(t): t for t in self.params}
        skip = {id(t) for t in self.buffers}
        for v in vars(self).values():
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, Tensor) and id(t) not in skip: out.setdefault(id(t), t)
        return list(out.values())

    def _settings(self) -> tuple:
        """The optimizer's plain settings (numbers, flags, tuples of numbers): its step's graph depends on them."""
        plain = (int, float, bool, str, type(None))
        return tuple((k, v) for k, v in vars(self).items() if isinstance(v, plain) or
                     (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)))

    def step(self) -> None:
        """Apply one update to every parameter (one realize of the parameters and the optimizer state)."""
        Tensor.realize(*self.schedule_step())

    def _step(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]: raise NotImplementedError

def _over(holders: list[UOp], roots: list[UOp]) -> list[UOp]:
    """The nodes under `roots` that reach one of `holders` (not the holders themselves), sources before users."""
    reach = set(holders)
    over = []
    for u in UOp.sink_of(*roots).toposort():
        if u not in reach and u.op is not Ops.SINK and any(s in reach for s in u.src):
            reach.add(u)
            over.append(u)
    return over

class OptimizerGroup(Optimizer):
    """Several optimizers stepped as one (e.g. Muon for matrices and AdamW for the rest)."""
    def __init__(self, *optimizers: Optimizer):
        if not optimizers: raise ValueError("OptimizerGroup needs at least one optimizer")
        self.optimizers = list(optimizers)
        self.params = [p for o in self.optimizers for p in o.params]
        self.buffers = [b for o in self.optimizers for b in o.buffers]

    def __getitem__(self, i: int) -> Optimizer: return self.optimizers[i]
    def zero_grad(self) -> None: [o.zero_grad() for o in self.optimizers]
    def schedule_step(self) -> list[Tensor]: return [t for o in self.optimizers for t in o.schedule_step()]

class LARS(Optimizer):
    """Momentum SGD with layer-wise trust ratios (LARS; tcoef=0 gives plain SGD) and an optional Newton-Schulz
    orthogonalization of the update (ns_steps > 0).

    classic=True applies the learning rate before the momentum buffer (classic momentum); classic=False after it,
    which is PyTorch's SGD. pre_wd=True adds weight decay to the gradient; pre_wd=False decays the weights directly."""
    def __init__(self, params: list[Tensor], lr=0.001, momentum=0.9, weight_decay=1e-4, ns_steps=0,
                 ns_coefficients=None, nesterov=False, classic=True, pre_wd=True, tcoef=0.001, device=None,
                 fused: bool = False):
        super().__init__(params, lr, device, fused)
        if momentum < 0: raise ValueError(f"momentum must be >= 0, got {momentum}")
        if nesterov and momentum == 0: raise ValueError("nesterov momentum needs momentum > 0")
        self.momentum, self.wd, self.ns_steps, self.ns_coefficients = momentum, weight_decay, ns_steps, ns_coefficients
        self.nesterov, self.classic, self.pre_wd, self.tcoef = nesterov, classic, pre_wd, tcoef
        self.b = [_state_buffer(0.0, like=p) for p in self.params] if momentum else []
        self._realize_state(*self.b)

    def _step(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        for i, (t, g) in enumerate(zip(params, grads)):
            g = g.float()
            if self.pre_wd and self.wd: g = g + self.wd * t.detach().float()
            r: Tensor | float = 1.0
            if self.tcoef != 0:
                r1, r2 = t.detach().float().square().sum().sqrt(), g.square().sum().sqrt()
                r = ((r1 > 0) & (r2 > 0)).where(self.tcoef * r1 / r2, 1.0)
            if self.classic: g = g * r * self.lr
            if self.momentum:
                self.b[i].assign(self.momentum * self.b[i] + g)
                g = g + self.momentum * self.b[i] if self.nesterov else self.b[i]
            if self.ns_steps:
                shape = g.shape
                g = g.reshape(shape[0], -1).newton_schulz(self.ns_steps, self.ns_coefficients).reshape(shape)
            if not self.classic: g = g * r * self.lr
            new = t.detach().float()
            if not self.pre_wd and self.wd: new = new * (1.0 - self.wd * self.lr)
            t.assign((new - g).cast(t.dtype))
        return self.b

def SGD(params: list[Tensor], lr=0.001, momentum=0.0, weight_decay=0.0, nesterov=False, classic=False, device=None,
        fused: bool = False) -> LARS:
    """Stochastic gradient descent with optional (Nesterov) momentum and weight decay; classic=False is PyTorch's."""
    return LARS(params, lr, momentum, weight_decay, 0, None, nesterov, classic=classic, pre_wd=True, tcoef=0.0,
                device=device, fused=fused)

class Muon(Optimizer):
    """Momentum orthogonalized by Newton-Schulz (PyTorch's Muon): buf = m*buf + (1-m)*g, the update (Nesterov:
    lerp(g, buf, m)) orthogonalized and scaled by sqrt(max(1, rows/cols)), decoupled weight decay. Parameters of more
    than 2 dims are treated as (shape[0], -1) matrices."""
    def __init__(self, params: list[Tensor], lr=0.001, momentum=0.95, weight_decay=0.1, ns_steps=5,
                 ns_coefficients=(3.4445, -4.775, 2.0315), nesterov=True, device=None, fused: bool = False):
        super().__init__(params, lr, device, fused)
        for p in self.params:
            if p.ndim < 2: raise ValueError(f"Muon only takes parameters of 2 or more dims, got shape {p.shape}")
        self.momentum, self.wd, self.ns_steps, self.ns_coefficients = momentum, weight_decay, ns_steps, ns_coefficients
        self.nesterov, self.eps = nesterov, 1e-7
        self.b = [_state_buffer(0.0, like=p) for p in self.params]
        self._realize_state(*self.b)

    def _step(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        for t, g, b in zip(params, grads, self.b):
            g = g.float()
            b.assign(self.momentum * b + (1 - self.momentum) * g)
            update = g + self.momentum * (b - g) if self.nesterov else b
            rows, cols = t.shape[0], math.prod(t.shape[1:])
            update = update.reshape(rows, cols).newton_schulz(self.ns_steps, self.ns_coefficients, self.eps)
            scale = math.sqrt(max(1.0, rows / cols))
            new = t.detach().float() * (1.0 - self.lr * self.wd) - (self.lr * scale) * update.reshape(t.shape)
            t.assign(new.cast(t.dtype))
        return self.b

class LAMB(Optimizer):
    """Adam moments with a layer-wise trust ratio ||w|| / ||update|| (LAMB); adam=True drops the trust ratio."""
    def __init__(self, params: list[Tensor], lr=0.001, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0, adam=False,
                 device=None, fused: bool = False):
        super().__init__(params, lr, device, fused)
        for name, v in (("b1", b1), ("b2", b2)):
            if not 0.0 <= v < 1.0: raise ValueError(f"{name} must be in [0, 1), got {v}")
        self.b1, self.b2, self.eps, self.wd, self.adam = b1, b2, eps, weight_decay, adam
        # b1^t and b2^t for the bias correction, kept on the device so the step number is not a Python constant
        self.b1_t, self.b2_t = (_state_buffer(1.0, device=self.device) for _ in range(2))
        self.m = [_state_buffer(0.0, like=p) for p in self.params]
        self.v = [_state_buffer(0.0, like=p) for p in self.params]
        self._realize_state(self.b1_t, self.b2_t, *self.m, *self.v)

    def _step(self, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        self.b1_t.assign(self.b1_t * self.b1)
        self.b2_t.assign(self.b2_t * self.b2)
        # the bias corrections are the same (1,) tensors for every parameter: built once
        c1, c2 = 1.0 - self.b1_t, 1.0 - self.b2_t
        # plain Adam (no weight decay, no trust ratio) folds them into the step as PyTorch does: lr / c1 times
        # m / (sqrt(v) / sqrt(c2) + eps). The (1,) factors are made once per step, negated and inverted there, so each
        # parameter's update takes four tensor operations fewer than dividing m and v
        folded = self.adam and not self.wd
        if folded: neg_step, inv_c2_sqrt = -(self.lr / c1), c2.sqrt().reciprocal()
        for t, g, m, v in zip(params, grads, self.m, self.v):
            g = g.float()
            m.assign(self.b1 * m + (1.0 - self.b1) * g)
            v.assign(self.b2 * v + (1.0 - self.b2) * g.square())
            if folded:
                t.assign((t.detach().float() + neg_step * (m / (v.sqrt() * inv_c2_sqrt + self.eps))).cast(t.dtype))
                continue
            up = (m / c1) / ((v / c2).sqrt() + self.eps)
            if self.wd: up = up + self.wd * t.detach().float()
            r: Tensor | float = 1.0
            if not self.adam:
                r1, r2 = t.detach().float().square().sum().sqrt(), up.square().sum().sqrt()
                r = ((r1 > 0) & (r2 > 0)).where(r1 / r2, 1.0)
            t.assign((t.detach().float() - self.lr * r * up).cast(t.dtype))
        return [self.b1_t, self.b2_t] + self.m + self.v

def Adam(params: list[Tensor], lr=0.001, b1=0.9, b2=0.999, eps=1e-8, device=None, fused: bool = False) -> LAMB:
    """Adam (PyTorch's update with bias correction)."""
    return LAMB(params, lr, b1, b2, eps, 0.0, adam=True, device=device, fused=fused)

def AdamW(params: list[Tensor], lr=0.001, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, device=None,
          fused: bool = False) -> LAMB:
    """Adam with decoupled weight decay (PyTorch's AdamW)."""
    return LAMB(params, lr, b1, b2, eps, weight_decay, adam=True, device=device, fused=fused)
