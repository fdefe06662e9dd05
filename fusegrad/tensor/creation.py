"""More constructors: random numbers (a counter-based generator computed in kernels), initializers, ranges.

Random numbers come from Threefry-2x32 (20 rounds), a counter-based generator: the value at element `i` of the `c`-th
random call since `manual_seed(s)` (c = 0, 1, ...) is `threefry(((c + 1) << 32) | i, key=s)`, a pure function computed
inside the kernel that uses it. So results are reproducible under `Tensor.manual_seed`, calls are independent (each
takes the next counter), recomputing a random tensor gives the same values, and no Python code ever loops over
elements. The call counter reaches the kernel as a parameter from the first call (`helpers.rng_counter_const`), so
later calls reuse the compiled kernels and a TinyJit replay can move it on.
"""
from __future__ import annotations
import ctypes, math, time
from typing import TYPE_CHECKING, Any, ClassVar
from fusegrad.dtype import DType, dtypes, to_dtype
from fusegrad.helpers import argfix, prod, rng_counter_const
from fusegrad.uop.ops import Ops

if TYPE_CHECKING:
    from fusegrad.tensor import Tensor

_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF

def _T() -> type[Tensor]:
    from fusegrad.tensor import Tensor
    return Tensor

def _shape_of(shape: tuple) -> tuple[int, ...]:
    """The shape of a `*shape` argument: ints or one sequence of ints, each nonnegative."""
    shp = argfix(*shape)
    for s in shp:
        if not isinstance(s, int) or isinstance(s, bool): raise TypeError(f"shape entries must be ints, got {shp!r}")
        if s < 0: raise ValueError(f"negative dimension in shape {shp}")
    return tuple(shp)

def _float_dtype(dtype: DType | str | None, name: str) -> DType:
    dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
    if not dtypes.is_float(dt): raise TypeError(f"{name} needs a floating point dtype, got {dt}")
    return dt

def _compute_dtype(dt: DType) -> DType:
    """Random floats are made in float32 (float64 for float64) and rounded to the requested dtype at the end."""
    return dtypes.float64 if dt == dtypes.float64 else dtypes.float32

def _finish(t: Tensor, contiguous: bool, requires_grad: bool | None) -> Tensor:
    if contiguous: t = t.contiguous()
    if requires_grad is not None: t.requires_grad_(requires_grad)
    return t

def _fan_in_out(shape: tuple[int, ...], name: str) -> tuple[int, int]:
    """torch.nn.init's fans: fan_in = shape[1] * receptive field, fan_out = shape[0] * receptive field."""
    if len(shape) < 2: raise ValueError(f"{name} needs a shape of at least 2 dimensions to define fans, got {shape}")
    rf = prod(shape[2:])
    return shape[1] * rf, shape[0] * rf

def _ranks(keys: Tensor, descending: bool) -> Tensor:
    """The position of each element of the last axis in a stable sort of `keys` (int32).

    Every pair is compared, in one reduction kernel: O(n^2) work but no Python loop and no data-dependent control."""
    n = keys.shape[-1]
    ki, kj = keys.unsqueeze(-1), keys.unsqueeze(-2)  # [..., i, j]
    T = _T()
    i, j = T._iota(n, keys.device).reshape(n, 1), T._iota(n, keys.device).reshape(1, n)
    before = (kj > ki) if descending else (kj < ki)
    before = before | ((kj == ki) & (j < i))
    return before.cast(dtypes.int32).sum(-1)

def _gather_by_rank(ranks: Tensor, count: int) -> Tensor:
    """For each position p < count, the index whose rank is p (ranks of each row are a permutation; int32)."""
    n = ranks.shape[-1]
    T = _T()
    p = T._iota(count, ranks.device).reshape(count, 1)
    i = T._iota(n, ranks.device).reshape(1, n)
    hit = ranks.unsqueeze(-2) == p  # [..., p, i]
    return hit.where(i, 0).sum(-1, dtype=dtypes.int32)


class CreationMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
    # the seed of the generator (tinygrad's name) and the number of random calls made since it was set
    _seed: ClassVar[int] = int(time.time())
    _rng_counter: ClassVar[int] = 0

    # *** the generator ***

    @staticmethod
    def manual_seed(seed: int = 0) -> None:
        """Seed the generator: the random calls that follow give the same values after every manual_seed(seed)."""
        if not isinstance(seed, int) or isinstance(seed, bool): raise TypeError(f"seed must be an int, got {seed!r}")
        if not -2**63 <= seed < 2**64: raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
        T = _T()
        T._seed, T._rng_counter = seed, 0

    def threefry(self: Tensor, seed: Any) -> Tensor:
        """Threefry-2x32 (20 rounds) of each uint64 element (two 32-bit words, low first) keyed by uint64 `seed`."""
        T = _T()
        if self.dtype != dtypes.uint64: raise TypeError(f"threefry needs a uint64 tensor, got {self.dtype}")
        if not isinstance(seed, T):
            if not isinstance(seed, int) or isinstance(seed, bool): raise TypeError(f"threefry seed must be an int or "
                                                                                    f"a uint64 tensor, got {seed!r}")
            seed = T(seed & _M64, dtype=dtypes.uint64, device=self.device)
        if seed.dtype != dtypes.uint64: raise TypeError(f"threefry seed must be uint64, got {seed.dtype}")
        x, k = self._broadcasted(seed)
        return x._alu(Ops.THREEFRY, k)

    @staticmethod
    def random_bits(key: Tensor, counter: Tensor, num: int) -> Tensor:
        """`num` random uint32 words: the words (low first) of threefry((counter << 32) | i, key) for i = 0, 1, ..."""
        T = _T()
        if not isinstance(num, int) or isinstance(num, bool) or num < 0:
            raise ValueError(f"random_bits needs a nonnegative int num, got {num!r}")
        for name, t in (("key", key), ("counter", counter)):
            if not isinstance(t, T) or t.numel() != 1 or not dtypes.is_int(t.dtype):
                raise TypeError(f"random_bits {name} must be an integer tensor of one element")
        if num == 0: return T.zeros(0, dtype=dtypes.uint32, device=key.device)
        blocks = (num + 1) // 2
        k = key.reshape(()).cast(dtypes.uint64)
        c = (counter.reshape(()).cast(dtypes.uint64) & _M32) << 32
        words = (T._iota(blocks, key.device).cast(dtypes.uint64) + c).threefry(k)
        lo, hi = (words & _M32).cast(dtypes.uint32), (words >> 32).cast(dtypes.uint32)
        return T.stack(lo, hi, dim=1).reshape(2 * blocks)[:num]

    @staticmethod
    def _random_u64(shape: tuple[int, ...], device: str | None) -> Tensor:
        """64 random bits per element (uint64), from the next counter of the global generator."""
        T = _T()
        n = prod(shape)
        if n >= 2**31: raise ValueError(f"random tensors are limited to 2**31 - 1 elements, got shape {shape}")
        counter = T._rng_counter & _M32
        T._rng_counter += 1
        if n == 0: return T.zeros(shape, dtype=dtypes.uint64, device=device)
        idx = T._iota(n, device).cast(dtypes.uint64) + rng_counter_const(counter)
        return idx.threefry(T._seed & _M64).reshape(shape)

    @staticmethod
    def _unit_uniform(shape: tuple[int, ...], dt: DType, device: str | None) -> Tensor:
        """Uniform floats in [0, 1) with as many random bits as `dt` has significand bits (so rounding to `dt` can't
        reach 1), in the compute dtype of `dt`."""
        nbits = dtypes.finfo(dt)[1] + 1
        bits = CreationMixin._random_u64(shape, device) >> (64 - nbits)
        return bits.cast(_compute_dtype(dt)) * (2.0 ** -nbits)

    @staticmethod
    def _std_normal(shape: tuple[int, ...], dt: DType, device: str | None) -> Tensor:
        """Standard normal values by Box-Muller, in the compute dtype of `dt`."""
        cdt = _compute_dtype(dt)
        if cdt == dtypes.float64:
            u1, u2 = CreationMixin._unit_uniform(shape, dt, device), CreationMixin._unit_uniform(shape, dt, device)
        else:
            # the two halves of one 64-bit draw give the two uniforms: 24 bits each, exact in float32
            bits = CreationMixin._random_u64(shape, device)
            u1 = (bits >> 40).cast(cdt) * 2.0 ** -24
            u2 = (bits & 0xFFFFFF).cast(cdt) * 2.0 ** -24
        # 1 - u1 is in (0, 1], so the log is finite
        return (-2.0 * (1.0 - u1).log()).sqrt() * (u2 * (2 * math.pi)).cos()

    # *** random tensors ***

    @staticmethod
    def rand(*shape: Any, device: str | None = None, dtype: DType | str | None = None, contiguous: bool = True,
             requires_grad: bool | None = None) -> Tensor:
        """Uniform random values in [0, 1)."""
        shp, dt = _shape_of(shape), _float_dtype(dtype, "rand")
        return _finish(CreationMixin._unit_uniform(shp, dt, device).cast(dt), contiguous, requires_grad)

    @staticmethod
    def randn(*shape: Any, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
        """Standard normal random values (mean 0, std 1)."""
        shp, dt = _shape_of(shape), _float_dtype(dtype, "randn")
        device, contiguous, requires_grad = _kwargs(kwargs, "randn")
        return _finish(CreationMixin._std_normal(shp, dt, device).cast(dt), contiguous, requires_grad)

    @staticmethod
    def normal(*shape: Any, mean: float = 0.0, std: float = 1.0, **kwargs: Any) -> Tensor:
        """Normal random values with the given mean and standard deviation."""
        if not std >= 0: raise ValueError(f"normal needs std >= 0, got {std}")
        shp, dt = _shape_of(shape), _float_dtype(kwargs.pop("dtype", None), "normal")
        device, contiguous, requires_grad = _kwargs(kwargs, "normal")
        x = CreationMixin._std_normal(shp, dt, device) * std + mean
        return _finish(x.cast(dt), contiguous, requires_grad)

    @staticmethod
    def uniform(*shape: Any, low: float = 0.0, high: float = 1.0, dtype: DType | str | None = None,
                **kwargs: Any) -> Tensor:
        """Uniform random values in [low, high)."""
        if not low <= high: raise ValueError(f"uniform needs low <= high, got low={low}, high={high}")
        shp, dt = _shape_of(shape), _float_dtype(dtype, "uniform")
        device, contiguous, requires_grad = _kwargs(kwargs, "uniform")
        x = CreationMixin._unit_uniform(shp, dt, device) * (high - low) + low
        return _finish(x.cast(dt), contiguous, requires_grad)

    @staticmethod
    def scaled_uniform(*shape: Any, **kwargs: Any) -> Tensor:
        """Uniform in [-1, 1) scaled by 1/sqrt(number of elements)."""
        shp = _shape_of(shape)
        bound = max(prod(shp), 1) ** -0.5
        return CreationMixin.uniform(*shp, low=-bound, high=bound, **kwargs)

    @staticmethod
    def glorot_uniform(*shape: Any, **kwargs: Any) -> Tensor:
        """Glorot/Xavier uniform init: U(-b, b) with b = sqrt(6 / (fan_in + fan_out)) (torch.nn.init's fans)."""
        shp = _shape_of(shape)
        fan_in, fan_out = _fan_in_out(shp, "glorot_uniform")
        bound = math.sqrt(6.0 / max(fan_in + fan_out, 1))
        return CreationMixin.uniform(*shp, low=-bound, high=bound, **kwargs)

    @staticmethod
    def kaiming_uniform(*shape: Any, a: float = 0.01, **kwargs: Any) -> Tensor:
        """Kaiming/He uniform init for leaky_relu(a): U(-b, b) with b = sqrt(6 / ((1 + a^2) fan_in))."""
        shp = _shape_of(shape)
        fan_in, _ = _fan_in_out(shp, "kaiming_uniform")
        bound = math.sqrt(3.0) * math.sqrt(2.0 / (1 + a * a)) / math.sqrt(max(fan_in, 1))
        return CreationMixin.uniform(*shp, low=-bound, high=bound, **kwargs)

    @staticmethod
    def kaiming_normal(*shape: Any, a: float = 0.01, **kwargs: Any) -> Tensor:
        """Kaiming/He normal init for leaky_relu(a): N(0, std^2) with std = sqrt(2 / ((1 + a^2) fan_in))."""
        shp = _shape_of(shape)
        fan_in, _ = _fan_in_out(shp, "kaiming_normal")
        std = math.sqrt(2.0 / (1 + a * a)) / math.sqrt(max(fan_in, 1))
        return CreationMixin.normal(*shp, mean=0.0, std=std, **kwargs)

    @staticmethod
    def randint(*shape: Any, low: int = 0, high: int = 10, dtype: DType | str = dtypes.int, **kwargs: Any) -> Tensor:
        """Uniform random integers in [low, high)."""
        for name, v in (("low", low), ("high", high)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"randint {name} must be an int, got {v!r}")
        if low >= high: raise ValueError(f"randint needs low < high, got low={low}, high={high}")
        shp, dt = _shape_of(shape), to_dtype(dtype)
        if dt == dtypes.bool or not (dtypes.is_int(dt) or dtypes.is_float(dt)):
            raise TypeError(f"randint needs an integer or float dtype, got {dt}")
        if dtypes.is_int(dt) and (low < dtypes.min(dt) or high - 1 > dtypes.max(dt)):
            raise ValueError(f"randint range [{low}, {high}) doesn't fit in {dt}")
        if high - low > 2**64: raise ValueError(f"randint range [{low}, {high}) is wider than 2**64")
        device, contiguous, requires_grad = _kwargs(kwargs, "randint")
        # bits mod range, shifted by low with wrap-around in 64 bits: the bias is at most range / 2**64
        x = CreationMixin._random_u64(shp, device)
        if high - low < 2**64: x = x % (high - low)
        x = (x + (low & _M64)).cast(dtypes.int64) if dtypes.is_float(dt) else x + (low & _M64)
        return _finish(x.cast(dt), contiguous, requires_grad)

    @staticmethod
    def randperm(n: int, device: str | None = None, dtype: DType | str = dtypes.int, **kwargs: Any) -> Tensor:
        """A random permutation of 0, ..., n-1: the ranks of n random 64-bit keys (one kernel of O(n^2) work)."""
        if not isinstance(n, int) or isinstance(n, bool): raise TypeError(f"randperm n must be an int, got {n!r}")
        if n < 0: raise ValueError(f"randperm needs n >= 0, got {n}")
        dt = to_dtype(dtype)
        if dt == dtypes.bool or not (dtypes.is_int(dt) or dtypes.is_float(dt)):
            raise TypeError(f"randperm needs an integer or float dtype, got {dt}")
        if dtypes.is_int(dt) and n - 1 > dtypes.max(dt): raise ValueError(f"randperm({n}) doesn't fit in {dt}")
        _, contiguous, requires_grad = _kwargs({**kwargs, "device": device}, "randperm")
        keys = CreationMixin._random_u64((n,), device)
        if n == 0: return _finish(keys.cast(dt), contiguous, requires_grad)
        # the ranks of i.i.d. keys are a uniformly random permutation; the keys are realized once since the ranking
        # reads each of them n times
        return _finish(_ranks(keys.contiguous(), False).cast(dt), contiguous, requires_grad)

    def multinomial(self: Tensor, num_samples: int = 1, replacement: bool = False) -> Tensor:
        """Indices (dtypes.default_int, as tinygrad) drawn from the categories weighted by the last axis of this 1-D or
        2-D tensor."""
        if not 1 <= self.ndim <= 2:
            raise ValueError(f"multinomial needs a 1-D or 2-D tensor of weights, got shape {self.shape}")
        if not dtypes.is_float(self.dtype):
            raise TypeError(f"multinomial needs floating point weights, got {self.dtype}")
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples <= 0:
            raise ValueError(f"multinomial needs a positive int num_samples, got {num_samples!r}")
        n = self.shape[-1]
        if n == 0: raise ValueError("multinomial needs at least one category")
        if not replacement and num_samples > n:
            raise ValueError(f"multinomial can't draw {num_samples} samples without replacement from {n} categories")
        w = (self if self.ndim == 2 else self.reshape(1, n)).cast(_compute_dtype(self.dtype))
        # scaled to a maximum of 1 so that w / E below can't overflow (E is at least about 3e-8)
        w = w / w.max(-1, keepdim=True)
        rows = w.shape[0]
        # exponential races: category i wins with probability w_i / sum(w) when it has the largest w_i / E_i,
        # E_i ~ Exp(1) independent; u is in (0, 1) so E_i > 0
        def exp1(shape: tuple[int, ...]) -> Tensor:
            u = (CreationMixin._random_u64(shape, self.device) >> 40).cast(w.dtype) * 2.0 ** -24 + 2.0 ** -25
            return -u.log()
        if replacement:
            out = (w.unsqueeze(1) / exp1((rows, num_samples, n))).argmax(-1)
        else:
            # the order of a race without replacement is the order of the keys, largest first
            out = _gather_by_rank(_ranks((w / exp1((rows, n))).contiguous(), True).contiguous(), num_samples)
        out = out.cast(dtypes.default_int)
        return out if self.ndim == 2 else out.reshape(num_samples)

    def dropout(self: Tensor, p: float = 0.5) -> Tensor:
        """In training, zero each element with probability p and scale the rest by 1/(1-p); otherwise the identity."""
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise ValueError(f"dropout probability must be in [0, 1], got {p!r}")
        if not _T().training or p == 0: return self
        if not dtypes.is_float(self.dtype): raise TypeError(f"dropout needs a floating point tensor, got {self.dtype}")
        if p == 1: return self * 0
        keep = CreationMixin._unit_uniform(self.shape, dtypes.float32, self.device) >= p
        # a multiplication (not a select) so that nan and inf propagate as in torch
        return self * (keep.cast(self.dtype) * (1.0 / (1.0 - p)))

    # *** tensors like another ***

    def rand_like(self: Tensor, **kwargs: Any) -> Tensor:
        """rand with this tensor's shape, dtype and device (dtype= and device= override)."""
        dtype, device = kwargs.pop("dtype", self.dtype), kwargs.pop("device", self.device)
        return CreationMixin.rand(*self.shape, dtype=dtype, device=device, **kwargs)

    def randn_like(self: Tensor, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
        """randn with this tensor's shape, dtype and device (dtype= and device= override)."""
        device = kwargs.pop("device", self.device)
        return CreationMixin.randn(*self.shape, dtype=dtype or self.dtype, device=device, **kwargs)

    def const_like(self: Tensor, b: Any, dtype: DType | None = None) -> Tensor:
        """A tensor of the constant `b` with this tensor's shape and device (and dtype unless given)."""
        return self.full_like(b, dtype)

    def empty_like(self: Tensor, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        """An uninitialized tensor with this tensor's shape, dtype and device."""
        return _T().empty(self.shape, dtype=dtype or self.dtype, device=device or self.device)

    def full_like(self: Tensor, fill_value: Any, dtype: DType | str | None = None, device: str | None = None) -> Tensor:
        """A tensor of `fill_value` with this tensor's shape, dtype and device."""
        return _T().full(self.shape, fill_value, dtype=dtype or self.dtype, device=device or self.device)

    def zeros_like(self: Tensor, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
        """Zeros with this tensor's shape, dtype and device (dtype= and device= override)."""
        return self.full_like(0, dtype, **kwargs)

    def ones_like(self: Tensor, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
        """Ones with this tensor's shape, dtype and device (dtype= and device= override)."""
        return self.full_like(1, dtype, **kwargs)

    # *** ranges and grids ***

    @staticmethod
    def linspace(start: int | float, stop: int | float, steps: int, dtype: DType | str | None = None,
                 device: str | None = None) -> Tensor:
        """`steps` evenly spaced values from start to stop, both included."""
        T = _T()
        if not isinstance(steps, int) or isinstance(steps, bool): raise TypeError(f"linspace steps must be an int, "
                                                                                  f"got {steps!r}")
        if steps < 0: raise ValueError(f"linspace needs steps >= 0, got {steps}")
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        if steps == 0: return T.zeros(0, dtype=dt, device=device)
        if steps == 1: return T.full((1,), start, dtype=dt, device=device)
        cdt = dtypes.float32 if dt in (dtypes.float16, dtypes.bfloat16, dtypes.float32) else dtypes.float64
        step = (stop - start) / (steps - 1)
        i = T._iota(steps, device).cast(cdt)
        # the first half counts up from start and the second half down from stop, so both ends are exact
        x = (i < steps // 2).where(i * step + start, stop - (steps - 1 - i) * step)
        return x.cast(dt)

    def meshgrid(self: Tensor, *args: Tensor, indexing: str = "ij") -> tuple[Tensor, ...]:
        """Coordinate grids of 1-D tensors: output k varies along dimension k ("ij"; "xy" swaps the first two)."""
        T = _T()
        if indexing not in ("ij", "xy"): raise ValueError(f"meshgrid indexing must be 'ij' or 'xy', got {indexing!r}")
        ts = (self,) + args
        for t in ts:
            if not isinstance(t, T): raise TypeError(f"meshgrid needs tensors, got {type(t).__name__}")
            if t.ndim > 1: raise ValueError(f"meshgrid needs 0-D or 1-D tensors, got shape {t.shape}")
            if t.dtype != self.dtype:
                raise TypeError(f"meshgrid needs tensors of one dtype, got {self.dtype} and {t.dtype}")
            if t.device != self.device: raise ValueError(f"meshgrid needs tensors on one device, got {self.device} and "
                                                         f"{t.device}")
        order = list(range(len(ts)))
        if indexing == "xy" and len(ts) > 1: order[0], order[1] = 1, 0
        shape = tuple(ts[k].numel() for k in order)
        outs = []
        for k, t in enumerate(ts):
            view = [1] * len(ts)
            view[order.index(k)] = t.numel()
            outs.append(t.reshape(view).expand(shape))
        return tuple(outs)

    @staticmethod
    def from_blob(ptr: int, shape: tuple[int, ...], **kwargs: Any) -> Tensor:
        """A tensor of `shape` (dtype= and device= keywords) with the bytes at host address `ptr`.

        The bytes are copied when called: the caller keeps ownership of the memory and may free or change it as soon as
        from_blob returns."""
        T = _T()
        dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
        if kwargs: raise TypeError(f"from_blob got unexpected keyword arguments {sorted(kwargs)}")
        if not isinstance(ptr, int) or isinstance(ptr, bool):
            raise TypeError(f"from_blob ptr must be an int address, got {ptr!r}")
        shp = _shape_of((shape,))
        dt = to_dtype(dtype) if dtype is not None else dtypes.default_float
        nbytes = prod(shp) * dt.itemsize
        if nbytes and ptr == 0: raise ValueError("from_blob got a null pointer")
        raw = ctypes.string_at(ptr, nbytes) if nbytes else b""
        return T(T._from_bytes(raw, shp, dt, _canonical(device)))

# tensors up to this many bytes are never compared with a device's memory (no device has less): the check below costs
# a multiplication for them
_ALWAYS_FITS = 1 << 30
# the most bytes a 64-bit address space maps (48-bit virtual addresses): no device holds a tensor larger than this
_ADDRESSABLE = 1 << 48

def check_size(shape: tuple, dtype: DType, device: Any, memory: bool = False) -> None:
    """MemoryError if no device could hold a tensor of `shape` and `dtype`: a kernel computing it would run for as many
    steps as it has elements (Tensor.ones(2**63).sum()), so it is refused when made, not when run. A view of a
    constant or of the index (full, arange, expand, pad) takes no memory, and only a part of it may ever be computed
    (Tensor.arange(2**32 + 5)[i]): it may describe more than `device` has, up to what an address space maps. A tensor
    with `memory` of its own (empty) must fit the device's memory, as every buffer allocated does (Buffer.allocate).
    Symbolic shapes pass."""
    n = dtype.itemsize
    for s in shape: n *= s  # (a loop, not prod(): cheaper for the few dims of a shape)
    if type(n) is not int or n <= _ALWAYS_FITS: return
    from fusegrad.device import Device
    devs = device if isinstance(device, tuple) else (device,)
    limit = sum(Device[d].memory_size for d in devs)
    if n <= (limit if memory else max(limit, _ADDRESSABLE)): return
    what = f"a tensor of shape {tuple(shape)} and dtype {dtype!r} needs {n} bytes ({n / 2**30:.4g} GiB)"
    mem = f"{limit} bytes ({limit / 2**30:.4g} GiB) of memory of device {device if len(devs) > 1 else devs[0]}"
    if memory: raise MemoryError(f"{what}, more than the {mem}")
    raise MemoryError(f"{what}, more than any device holds (2**48 bytes of addresses; the {mem})")

def _canonical(device: str | None) -> str:
    from fusegrad.tensor import _canonical_device
    return _canonical_device(device)

def _kwargs(kwargs: dict[str, Any], name: str) -> tuple[str | None, bool, bool | None]:
    """device, contiguous and requires_grad from the keyword arguments of a random constructor; others are errors."""
    device, contiguous = kwargs.pop("device", None), kwargs.pop("contiguous", True)
    requires_grad = kwargs.pop("requires_grad", None)
    if kwargs: raise TypeError(f"{name} got unexpected keyword arguments {sorted(kwargs)}")
    return device, contiguous, requires_grad

