"""More constructors: random numbers (a counter-based generator computed in kernels), initializers, ranges.

Random numbers are tinygrad 0.14's, from Threefry-2x32 (20 rounds): a device's generator key is the seed's low 32 bits
above the low 32 bits of sha256 of the device's number (in the order of first use since manual_seed); a call that
takes `num` 32-bit words gets the stream key threefry(c, key), c the words drawn before it, and its words are the low
halves of threefry(i | (i + h) << 32) for i < h = ceil(num / 2), then their high halves. Pure functions computed
inside the kernel that uses them: reproducible under `Tensor.manual_seed`, recomputing a random tensor gives the same
values, and no Python code loops over elements. The count c reaches the kernel as a parameter from the first call
(`helpers.rng_counter_const`), so later calls reuse the compiled kernels and a TinyJit replay moves it on by the words
drawn since the capture (`Tensor._rng_counter` counts words). Differences from tinygrad: one count for all devices
(tinygrad keeps one per device), 32 bits of it (past 2**32 words the streams differ), and a call's numbers are fixed
when it is made (tinygrad's lazy random tensor reads its device's counter when it is realized).
"""
from __future__ import annotations
import ctypes, hashlib, math, time
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

def _finish(t: Tensor, contiguous: bool, requires_grad: bool | None) -> Tensor:
    if contiguous: t = t.contiguous()
    if requires_grad is not None: t.requires_grad_(requires_grad)
    return t

def _fan_in(shape: tuple[int, ...], name: str) -> int:
    """tinygrad's fan_in: the product of all dimensions but the first (1 for shapes of fewer than 2 dimensions)."""
    if prod(shape[1:]) == 0: raise ValueError(f"{name} needs a shape with a nonzero fan_in, got {shape}")
    return prod(shape[1:])

def _mul_add(x: Tensor, a: float, b: float) -> Tensor:
    """x * a + b rounded once (as tinygrad's fused multiply-add gives it) where x is float32: in float64, where the
    product of two float32 values is exact."""
    if x.dtype != dtypes.float32: return x * a + b
    return (x.cast(dtypes.float64) * ctypes.c_float(a).value + ctypes.c_float(b).value).cast(dtypes.float32)

def _words(j: Tensor, num: int, key: Tensor) -> Tensor:
    """Word j (a uint64 tensor of indices) of the `num` random 32-bit words of a call with stream key `key`: with
    h = ceil(num / 2), the low words of threefry(i | (i + h) << 32, key) for i < h, then their high words."""
    h = -(-num // 2)
    low = j < h
    i = low.where(j, j - h)
    r = (i | (i + h) << 32).threefry(key)
    return low.where(r & _M32, r >> 32).cast(dtypes.uint32)

class CreationMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()
    # the seed of the generator (tinygrad's name), the number of 32-bit random words drawn since it was set, and the
    # devices drawn on since then (each device's number is part of its generator key)
    _seed: ClassVar[int] = int(time.time())
    _rng_counter: ClassVar[int] = 0
    _rng_devices: ClassVar[dict[Any, int]] = {}

    # *** the generator ***

    @staticmethod
    def manual_seed(seed: int = 0) -> None:
        """Seed the generator: the random calls that follow give the same values after every manual_seed(seed)."""
        if not isinstance(seed, int) or isinstance(seed, bool): raise TypeError(f"seed must be an int, got {seed!r}")
        if not -2**63 <= seed < 2**64: raise ValueError(f"seed must be in [-2**63, 2**64), got {seed}")
        T = _T()
        T._seed, T._rng_counter, T._rng_devices = seed, 0, {}

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
        """`num` random uint32 words: the words of a random call whose generator key is `key` and whose counter (the
        words drawn before it) is `counter`, each given as two 32-bit words (low first)."""
        T = _T()
        if not isinstance(num, int) or isinstance(num, bool) or num < 0:
            raise ValueError(f"random_bits needs a nonnegative int num, got {num!r}")
        for name, t in (("key", key), ("counter", counter)):
            if not isinstance(t, T) or t.shape != (2,) or not dtypes.is_int(t.dtype):
                raise TypeError(f"random_bits {name} must be an integer tensor of two 32-bit words (low first), got "
                                f"{t.shape if isinstance(t, T) else type(t).__name__}")
        if num > _M32: raise ValueError(f"random_bits draws at most 2**32 - 1 words, got {num}")
        if num == 0: return T.zeros(0, dtype=dtypes.uint32, device=key.device)
        def u64(t: Tensor) -> Tensor:
            w = t.cast(dtypes.uint64) & _M32
            return w[0] | (w[1] << 32)
        return _words(T._iota(num, key.device).cast(dtypes.uint64), num, u64(counter).threefry(u64(key)))

    @staticmethod
    def _draw(num: int, device: Any) -> Tensor:
        """The stream key of a random call taking the next `num` 32-bit words on `device` (see _words): a uint64 scalar
        computed in the kernel from the call's counter, which reaches it as a parameter (helpers.rng_counter_const)."""
        T = _T()
        if num > _M32: raise ValueError(f"a random call draws at most 2**32 - 1 words of 32 bits, got {num}")
        # a device's generator key: the seed's low word above the low word of the sha256 of the device's number (in
        # the order of first use since the seed; 4 bytes, big-endian)
        index = T._rng_devices.setdefault(device if isinstance(device, tuple) else _canonical(device),
                                          len(T._rng_devices))
        key = (T._seed & _M32) << 32 | int.from_bytes(hashlib.sha256(index.to_bytes(4, "big")).digest(), "big") & _M32
        counter = T.full((), rng_counter_const(T._rng_counter), dtype=dtypes.uint64, device=device)
        T._rng_counter += num
        # the call's stream key is the generator key's threefry of the words drawn before the call
        return ((counter >> 32) - 1).threefry(key)

    @staticmethod
    def _unit_uniform(shape: tuple[int, ...], dt: DType, device: Any) -> Tensor:
        """rand's values in [0, 1) of float dtype `dt`: element e takes the e-th `dt`-sized piece of the call's words
        (little-endian) and keeps its top (significand bits) bits b: b * 2**-(significand bits), which is exact."""
        T = _T()
        n, size = prod(shape), dt.itemsize
        if n >= 2**31: raise ValueError(f"random tensors are limited to 2**31 - 1 elements, got shape {shape}")
        num = -(-n * size // 4)
        k = CreationMixin._draw(num, device)
        if n == 0: return T.zeros(shape, dtype=dt, device=device)
        e = T._iota(n, device).cast(dtypes.uint64)
        if size == 8:
            bits = _words(2 * e, num, k).cast(dtypes.uint64) | _words(2 * e + 1, num, k).cast(dtypes.uint64) << 32
        elif size == 4: bits = _words(e, num, k)
        else:
            per = 4 // size
            bits = (_words(e // per, num, k) >> ((e % per) * (8 * size)).cast(dtypes.uint32)) & ((1 << 8 * size) - 1)
        nmant = dtypes.finfo(dt)[1]
        return ((bits >> (8 * size - nmant)).cast(dt) * 2.0 ** -nmant).reshape(shape)

    @staticmethod
    def _std_normal(shape: tuple[int, ...], device: Any) -> Tensor:
        """Standard normal float32 values by Box-Muller over rand((2, *shape)): u of the first half, v of the second,
        cos(2 pi u) * sqrt(-2 log(1 - v))."""
        T = _T()
        n = prod(shape)
        if n >= 2**31: raise ValueError(f"random tensors are limited to 2**31 - 1 elements, got shape {shape}")
        k = CreationMixin._draw(2 * n, device)
        if n == 0: return T.zeros(shape, dtype=dtypes.float32, device=device)
        # words e and n + e of the 2n words are the two halves of one threefry output
        e = T._iota(n, device).cast(dtypes.uint64)
        r = (e | (e + n) << 32).threefry(k).reshape(shape)
        u = ((r & _M32) >> 9).cast(dtypes.float32) * 2.0 ** -23
        v = (r >> 41).cast(dtypes.float32) * 2.0 ** -23
        # (the product in this order: the other order's graph is split into two kernels by the scheduler)
        return (-2.0 * (1.0 - v).log()).sqrt() * (u * (2 * math.pi)).cos()

    # *** random tensors ***

    @staticmethod
    def rand(*shape: Any, device: str | None = None, dtype: DType | str | None = None, contiguous: bool = True,
             requires_grad: bool | None = None) -> Tensor:
        """Uniform random values in [0, 1)."""
        shp, dt = _shape_of(shape), _float_dtype(dtype, "rand")
        return _finish(CreationMixin._unit_uniform(shp, dt, device), contiguous, requires_grad)

    @staticmethod
    def randn(*shape: Any, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
        """Standard normal random values (mean 0, std 1), made in float32 and cast to `dtype`."""
        shp, dt = _shape_of(shape), _float_dtype(dtype, "randn")
        device, contiguous, requires_grad = _kwargs(kwargs, "randn")
        return _finish(CreationMixin._std_normal(shp, device).cast(dt), contiguous, requires_grad)

    @staticmethod
    def normal(*shape: Any, mean: float = 0.0, std: float = 1.0, **kwargs: Any) -> Tensor:
        """Normal random values with the given mean and standard deviation: std * randn + mean."""
        if not std >= 0: raise ValueError(f"normal needs std >= 0, got {std}")
        shp, dt = _shape_of(shape), _float_dtype(kwargs.pop("dtype", None), "normal")
        device, contiguous, requires_grad = _kwargs(kwargs, "normal")
        return _finish(_mul_add(CreationMixin._std_normal(shp, device).cast(dt), std, mean), contiguous, requires_grad)

    @staticmethod
    def uniform(*shape: Any, low: float = 0.0, high: float = 1.0, dtype: DType | str | None = None,
                **kwargs: Any) -> Tensor:
        """Uniform random values in [low, high): (high - low) * rand (of the default float) in `dtype`, plus low."""
        if not low <= high: raise ValueError(f"uniform needs low <= high, got low={low}, high={high}")
        shp, dt = _shape_of(shape), _float_dtype(dtype, "uniform")
        device, contiguous, requires_grad = _kwargs(kwargs, "uniform")
        u = CreationMixin._unit_uniform(shp, dtypes.default_float, device)
        x = _mul_add(u, high - low, low) if dt == u.dtype else (u * (high - low)).cast(dt) + low
        return _finish(x, contiguous, requires_grad)

    @staticmethod
    def scaled_uniform(*shape: Any, **kwargs: Any) -> Tensor:
        """Uniform in [-1, 1) scaled by 1/sqrt(number of elements)."""
        shp = _shape_of(shape)
        if prod(shp) == 0: raise ValueError(f"scaled_uniform needs a nonempty shape, got {shp}")
        return CreationMixin.uniform(*shp, low=-1.0, high=1.0, **kwargs) * prod(shp) ** -0.5

    @staticmethod
    def glorot_uniform(*shape: Any, **kwargs: Any) -> Tensor:
        """Glorot/Xavier uniform init: U(-b, b) with b = sqrt(6 / (shape[0] + prod(shape[1:]))) (tinygrad's fans:
        torch's for 2-D shapes)."""
        shp = _shape_of(shape)
        if not shp or shp[0] + prod(shp[1:]) == 0:
            raise ValueError(f"glorot_uniform needs a shape with fans, got {shp}")
        bound = (6 / (shp[0] + prod(shp[1:]))) ** 0.5
        return CreationMixin.uniform(*shp, low=-bound, high=bound, **kwargs)

    @staticmethod
    def kaiming_uniform(*shape: Any, a: float = 0.01, **kwargs: Any) -> Tensor:
        """Kaiming/He uniform init for leaky_relu(a): U(-b, b) with b = sqrt(6 / (1 + a^2) / fan_in), fan_in =
        prod(shape[1:])."""
        shp = _shape_of(shape)
        bound = (6 / (1 + a ** 2) / _fan_in(shp, "kaiming_uniform")) ** 0.5
        return CreationMixin.uniform(*shp, low=-bound, high=bound, **kwargs)

    @staticmethod
    def kaiming_normal(*shape: Any, a: float = 0.01, **kwargs: Any) -> Tensor:
        """Kaiming/He normal init for leaky_relu(a): N(0, std^2) with std = sqrt(2 / (1 + a^2) / fan_in), fan_in =
        prod(shape[1:])."""
        shp = _shape_of(shape)
        std = (2 / (1 + a ** 2) / _fan_in(shp, "kaiming_normal")) ** 0.5
        return CreationMixin.normal(*shp, mean=0.0, std=std, **kwargs)

    @staticmethod
    def randint(*shape: Any, low: int = 0, high: int = 10, dtype: DType | str = dtypes.int, **kwargs: Any) -> Tensor:
        """Uniform random integers in [low, high): (high - low) * rand, truncated, plus low."""
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
        u = CreationMixin._unit_uniform(shp, dtypes.default_float, device)
        # in 64 bits with wrap-around, so ranges beyond int64 work; the float product rounds up to high - low itself
        # for ranges beyond the float's significand: kept below it
        x = (u * (high - low)).cast(dtypes.uint64).minimum(high - low - 1) + (low & _M64)
        if dtypes.is_float(dt): x = x.cast(dtypes.int64)
        return _finish(x.cast(dt), contiguous, requires_grad)

    @staticmethod
    def randperm(n: int, device: str | None = None, dtype: DType | str = dtypes.int, **kwargs: Any) -> Tensor:
        """A random permutation of 0, ..., n-1: the stable argsort of rand(n)."""
        if not isinstance(n, int) or isinstance(n, bool): raise TypeError(f"randperm n must be an int, got {n!r}")
        if n < 0: raise ValueError(f"randperm needs n >= 0, got {n}")
        dt = to_dtype(dtype)
        if dt == dtypes.bool or not (dtypes.is_int(dt) or dtypes.is_float(dt)):
            raise TypeError(f"randperm needs an integer or float dtype, got {dt}")
        if dtypes.is_int(dt) and n - 1 > dtypes.max(dt): raise ValueError(f"randperm({n}) doesn't fit in {dt}")
        _, contiguous, requires_grad = _kwargs({**kwargs, "device": device}, "randperm")
        keys = CreationMixin._unit_uniform((n,), dtypes.default_float, device)
        if n == 0: return _finish(keys.cast(dt), contiguous, requires_grad)
        # the keys are realized once since sorting reads each of them many times
        return _finish(keys.contiguous().argsort().cast(dt), contiguous, requires_grad)

    def multinomial(self: Tensor, num_samples: int = 1, replacement: bool = False) -> Tensor:
        """Indices (dtypes.default_int, as tinygrad) drawn from the categories weighted by the last axis of this 1-D or
        2-D tensor."""
        T = _T()
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
        w = self if self.ndim == 2 else self.reshape(1, n)
        rows = w.shape[0]
        if replacement or num_samples == 1:
            # inverse transform: a sample is the number of entries of the normalized cumulative weights at or below
            # a uniform value (drawn on the default device, as tinygrad). The weights are first divided by the power
            # of two at or below their maximum: exact, so the cdf is unchanged, but sums of huge weights can't overflow
            ebits, mbits = dtypes.finfo(w.dtype)
            it = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}[w.dtype.itemsize]
            top = (w.max(-1, keepdim=True).bitcast(it) & (((1 << ebits) - 1) << mbits)).bitcast(w.dtype)
            cw = (w / (top == 0).where(1.0, top)).cumsum(1).cast(dtypes.float32)
            cdf = cw / cw[:, -1:]
            u = T.rand(num_samples, rows, 1).to(self.device)
            out = (u >= cdf).sum(2, dtype=dtypes.int32).permute(1, 0)
        else:
            # Efraimidis-Spirakis: the samples are the num_samples largest log2(u) / w
            u = T.rand(rows, n, device=self.device)
            out = (u.log2() / w).topk(num_samples, dim=1)[1]
        out = out.cast(dtypes.default_int)
        return out if self.ndim == 2 else out.reshape(num_samples)

    def dropout(self: Tensor, p: float = 0.5) -> Tensor:
        """In training, zero each element where rand (of the default float) < p and scale the rest by 1/(1-p);
        otherwise the identity."""
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 <= p <= 1:
            raise ValueError(f"dropout probability must be in [0, 1], got {p!r}")
        if not _T().training or p == 0: return self
        if not dtypes.is_float(self.dtype): raise TypeError(f"dropout needs a floating point tensor, got {self.dtype}")
        if p == 1: return self * 0
        keep = CreationMixin._unit_uniform(self.shape, dtypes.default_float, self.device) >= p
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

