"""Elementwise math: activations, trigonometric and hyperbolic functions, rounding, special values."""
from __future__ import annotations
import math
from typing import TYPE_CHECKING, Any, Callable
from fusegrad.dtype import dtypes, least_upper_float, truncate_float
from fusegrad.gradient import UnaryGradient, clamped, with_gradient
from fusegrad.tensor.composite import composite
from fusegrad.uop.ops import Ops

if TYPE_CHECKING: from fusegrad.tensor import Tensor

_LN2 = math.log(2)
# above this magnitude x*x would lose the +-1 of asinh/acosh (and overflow float32 soon after): use log(2|x|)
_BIG = 2.0 ** 28

def _poly(x: Tensor, coeffs: list[float]) -> Tensor:
    """coeffs[0] + coeffs[1]*x + ... by Horner's rule (one fused expression)."""
    ret = x * coeffs[-1]
    for c in reversed(coeffs[1:-1]): ret = (ret + c) * x
    return ret + coeffs[0]

def _odd(x: Tensor, mag: Tensor) -> Tensor:
    """An odd function's value from its value `mag` at |x|: sign of x restored, and x itself kept at +-0."""
    return (x < 0).where(-mag, (x == 0).where(x, mag))

def _with_grad(value: Tensor, *pairs: tuple[Tensor, Callable[[Tensor], Tensor]]) -> Tensor:
    """`value` (computed without autodiff) whose derivative with respect to each x of `pairs` is deriv(x), deriv a
    function built from differentiable ops. The value comes out exactly, -0.0 included: each term subtracted is a
    zero y * deriv(xd + y/2), y = x - xd (xd is x detached: y is +0.0 with derivative 1), written so that its zero is
    +0.0 (v - (+0.0) is v for every v). Its first derivative is deriv(x) and its second deriv'(x), so a gradient of
    a gradient is exact (higher orders are approximate). Where x or deriv isn't finite the term is skipped and the
    gradient there is 0."""
    ret = value.detach()
    for x, deriv in pairs:
        xd = x.detach()
        dd = deriv(xd + (x - xd) * 0.5)
        d0 = dd.detach()
        term = _signbit(d0).where((x - xd) * -dd, (xd - x) * dd)
        ret = ret - (xd.isfinite() & d0.isfinite()).where(term, 0.0)
    return ret

def _log1p(y: Tensor) -> Tensor:
    """log(1+y) accurate for small y: 2*atanh(z) with z = y/(2+y) as a series where |z| <= 1/5."""
    z = y / (y + 2.0)
    z2 = z * z
    series = 2.0 * z * _poly(z2, [1.0 / (2 * k + 1) for k in range(13)])
    return ((y > -1 / 3) & (y < 0.5)).where(series, (y + 1.0).log())

# float64 exp: ln2 as a high part with trailing zero bits (so n * high is exact) and the rest; |x| beyond which exp is
# inf or 0; the int dtype of the same width, its exponent bias and mantissa bits
_EXP_CONSTS = (0.693147180369123816490, 1.90821492927058770002e-10, 750.0, dtypes.int64, 1023, 52)

def _exp_value(x: Tensor) -> Tensor:
    hi, lo, lim, it, bias, mant = _EXP_CONSTS
    xc = x.maximum(-lim).minimum(lim)  # (nan stays nan)
    n = (xc * (1 / _LN2) + 0.5).floor()
    r = (xc - n * hi) - n * lo
    # 2**n as two factors 2**n1 * 2**n2, each a normal number built from its exponent bits
    n1 = (n * 0.5).floor()
    def pow2(k: Tensor) -> Tensor: return ((k.detach().cast(it) + bias) << mant).bitcast(x.dtype)
    return (r * (1 / _LN2))._alu(Ops.EXP2) * pow2(n1) * pow2(n - n1)

def _expm1(x: Tensor) -> Tensor:
    """exp(x) - 1 accurate for small x: its series where |x| < 0.5."""
    s = x.maximum(-0.5).minimum(0.5)
    series = s * _poly(s, [1.0 / math.factorial(k + 1) for k in range(16)])
    return (x.abs() < 0.5).where(series, x.exp() - 1)

def _atan_value(x: Tensor) -> Tensor:
    a = x.abs()
    inv = a > 1
    t = inv.where(1.0 / a.maximum(1.0), a)
    # atan(t) = 2*atan(t / (1 + sqrt(1 + t^2))): twice brings t from [0, 1] to [0, 0.2], where the series is short
    for _ in range(2): t = t / ((t * t + 1.0).sqrt() + 1.0)
    r = 4.0 * t * _poly(t * t, [(-1.0) ** k / (2 * k + 1) for k in range(13)])
    return _odd(x, inv.where(math.pi / 2 - r, r))

_ERF_TAYLOR = [2 / math.sqrt(math.pi) * (-1.0) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(50)]

def _erf_value(x: Tensor) -> Tensor:
    """erf in float64: its Taylor series for |x| < 3, 1 - erfc by a continued fraction beyond."""
    a = x.abs()
    small = a.minimum(3.0)
    taylor = small * _poly(small * small, _ERF_TAYLOR)
    # erfc(a) = exp(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/(a + ...)))), evaluated from the tail
    big = a.maximum(3.0)
    cf = big
    for k in range(60, 0, -1): cf = big + (k / 2) / cf
    erfc = (-(big * big)).exp() / (math.sqrt(math.pi) * cf)
    return _odd(x, (a < 3).where(taylor, 1.0 - erfc))

# fits (least squares on Chebyshev nodes, float64) accurate to 3.5e-13 relative: plenty for float32 results, at a
# fraction of the series' work (the Taylor series and the continued fraction above take ~110 ops with 60 divisions)
_ERF_SMALL = [1.1283791670954941, -0.37612638902814893, 0.11283791658715804, -0.026866169067607932,
              0.00522396728047238, -0.0008547936235667149, 0.00012046303516247271, -1.4795447911006568e-05,
              1.5308588747326618e-06, -1.0474023102366854e-07]   # erf(x) = x * P(x^2) for |x| <= 1
_ERFCX_BIG = [0.3059529922707548, 0.14335640814127174, -0.02424301011917729, 0.002308148143231282,
              0.0004613222755943769, -0.000348830648357386, 0.00012040770382718524, -2.642657117259531e-05,
              1.3694813564527627e-06, 2.131525697554266e-06, -1.391356779387478e-06, 6.492824243459819e-07,
              -2.0209177517040078e-07, -2.060673411547985e-08, 2.8726446509422282e-08]
# (exp(x^2) erfc(x) = Q((1/x - 0.625) / 0.375) for 1 <= x <= 4; beyond 4 erf rounds to 1 in float32)

def _erf_taylor(c: float, terms: int) -> list[float]:
    """a_k with erf(c + d) = erf(c) + d * sum a_k d^k: erf's k-th derivative is 2/sqrt(pi) (-1)^(k-1) H_(k-1)(c)
    e^(-c^2), H the physicists' Hermite polynomials (H_(k+1) = 2c H_k - 2k H_(k-1))."""
    h = [1.0, 2 * c]
    for k in range(1, terms): h.append(2 * c * h[k] - 2 * k * h[k - 1])
    g = 2 / math.sqrt(math.pi) * math.exp(-c * c)
    return [g * (-1) ** k * h[k] / math.factorial(k + 1) for k in range(terms)]

# erf on [1/2, 1] around 3/4: 10 terms leave 3e-10 of the result; erf(3/4) as a float32 and the rest
_ERF_MID = 0.75
_ERF_MID_TAYLOR = _erf_taylor(_ERF_MID, 10)
_ERF_MID_HI = truncate_float(math.erf(_ERF_MID), dtypes.float32)
_ERF_MID_LO = math.erf(_ERF_MID) - _ERF_MID_HI

def _erf_value_narrow(x: Tensor) -> Tensor:
    """erf for a float32 (or narrower) result, in float32: a polynomial below 1, erfc by exp(-x^2) times a polynomial
    in 1/x up to 4, 1 beyond; within 1 ulp."""
    a = x.abs()
    # each piece ends in one addition whose rounding dominates (as x P(x^2) up to 1 the polynomial's roundings came to
    # 2.4 ulp): below 1/2 x + x (P(x^2) - 1), whose second term is at most 0.13 of the result; up to 1 erf(3/4) (two
    # floats) + d S(d) with d = x - 3/4 exact, at most 0.3 of it
    small = a.minimum(0.5)
    below = small + small * _poly(small * small, [_ERF_SMALL[0] - 1.0, *_ERF_SMALL[1:]])
    d = a.maximum(0.5).minimum(1.0) - _ERF_MID
    mid = _ERF_MID_HI + (_ERF_MID_LO + d * _poly(d, _ERF_MID_TAYLOR))
    big = a.maximum(1.0).minimum(4.0)
    above = 1.0 - (-(big * big)).exp() * _poly((1.0 / big - 0.625) * (1 / 0.375), _ERFCX_BIG)
    # (a nan goes through `above`, which is nan)
    return _odd(x, (a <= 0.5).where(below, (a <= 1).where(mid, (a >= 4).where(1.0, above))))

def _sinh_small(x: Tensor) -> Tensor:
    """sinh by its series, for |x| <= 0.5."""
    return x * _poly(x * x, [1.0 / math.factorial(2 * k + 1) for k in range(8)])

def _sin_v(x: Tensor) -> Tensor: return x._alu(Ops.SIN)
def _cos_v(x: Tensor) -> Tensor:
    s = (x * 0.5)._alu(Ops.SIN)
    return 1.0 - 2.0 * s * s

def _sinh_v(x: Tensor) -> Tensor:
    a = x.abs()
    # exp(a - ln2) = e^a / 2 overflows only where sinh itself does
    big = (a - _LN2).exp() - 0.5 / a.exp()
    return _odd(x, (a < 0.5).where(_sinh_small(a.minimum(0.5)), big))
def _cosh_v(x: Tensor) -> Tensor:
    a = x.abs()
    return (a - _LN2).exp() + 0.5 / a.exp()
def _tanh_taylor(terms: int) -> list[float]:
    """Coefficients c_k of tanh(x) = x * sum c_k x^(2k): 2^(2m) (2^(2m) - 1) B_2m / (2m)! with m = k + 1."""
    from fractions import Fraction
    bern = [Fraction(1)]  # Bernoulli numbers B_0..B_2terms+2 by their recurrence
    for m in range(1, 2 * terms + 3):
        bern.append(-sum(math.comb(m + 1, j) * bern[j] for j in range(m)) / (m + 1))
    return [float(4 ** m * (4 ** m - 1) * bern[2 * m] / math.factorial(2 * m)) for m in range(1, terms + 1)]

# |x| < 0.55: the series' terms shrink by about (2x/pi)^2 < 0.13 each
_TANH_SERIES = {4: _tanh_taylor(9), 8: _tanh_taylor(19)}

def _tanh_v(x: Tensor) -> Tensor:
    a = x.abs()
    s = x.maximum(-0.55).minimum(0.55)
    small = s * _poly(s * s, _TANH_SERIES[x.dtype.itemsize])  # odd: keeps -0.0
    big = 1 - 2 / ((2 * a).exp() + 1)
    return (a < 0.55).where(small, (x < 0).where(-big, big))

def _signbit(x: Tensor) -> Tensor:
    """True where the sign bit is set (also for -0.0 and negative nan); false for ints >= 0."""
    if not dtypes.is_float(x.dtype): return x < 0 if not dtypes.is_unsigned(x.dtype) and x.dtype != dtypes.bool \
        else x.zeros_like(dtypes.bool)
    ints = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}
    return x.bitcast(ints[x.dtype.itemsize]) < 0

class ElementwiseMixin:
    """Tensor methods of this family (mixed into Tensor; `self` is a Tensor)."""
    __slots__ = ()

    def _cmp_beyond(self: Tensor, op: Ops, x: int, reverse: bool) -> Tensor:
        """A comparison with a Python int that this tensor's dtype can't hold, decided by its value as NumPy 2 does
        (the int is above every element, or below every one) rather than with the int wrapped."""
        from fusegrad.tensor import Tensor
        above = x > 0
        if op is Ops.CMPLT: value = above != reverse  # self < x, or x < self when reversed
        elif op in (Ops.CMPEQ, Ops.CMPNE): value = op is Ops.CMPNE
        else: raise ValueError(f"no comparison {op}")
        return Tensor.full(self.shape, value, dtype=dtypes.bool, device=self.device)

    def _math(self: Any, value: Callable[[Tensor], Tensor], deriv: Callable[[Tensor], Tensor] | None = None,
              wide: bool = False) -> Tensor:
        """A float function computed in float32 (float64 if `wide` or the input is double) and returned in the input's
        float dtype. Its gradient comes from autodiff through `value`, or is `deriv` when given (see _with_grad)."""
        out = least_upper_float(self.dtype)
        x = self.cast(out)
        work = dtypes.float64 if wide else (out if out.itemsize >= 4 else dtypes.float32)
        if deriv is None: return value(x.cast(work)).cast(out)
        return _with_grad(value(x.detach().cast(work)).cast(out), (x, lambda m: deriv(m.cast(work)).cast(out)))


    # *** activations ***

    @composite
    def gelu(self: Any, approximate: str = "tanh") -> Tensor:
        """Gaussian error linear unit: exact with approximate='none', tanh approximation with 'tanh'."""
        if approximate == "tanh":
            x = self.cast(least_upper_float(self.dtype))
            return 0.5 * x * (1 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
        if approximate == "none":
            x = self.cast(least_upper_float(self.dtype))
            return 0.5 * x * (1 + (x * (1 / math.sqrt(2))).erf())
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', not {approximate!r}")
    @composite
    def quick_gelu(self: Any) -> Tensor:
        """x * sigmoid(1.702 x)."""
        return self * (self * 1.702).sigmoid()
    @composite
    def erf(self: Any) -> Tensor:
        """The error function."""
        deriv = lambda x: (2 / math.sqrt(math.pi)) * (-(x * x)).exp()  # noqa: E731
        if least_upper_float(self.dtype) == dtypes.float64: return self._math(_erf_value, deriv, wide=True)
        return self._math(_erf_value_narrow, deriv)
    @composite
    def elu(self: Any, alpha: float = 1.0) -> Tensor:
        """x for x > 0, alpha * (exp(x) - 1) otherwise."""
        return (self > 0).where(self, alpha * _expm1(self))
    @composite
    def celu(self: Any, alpha: float = 1.0) -> Tensor:
        """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
        return (self > 0).where(self, alpha * _expm1(self / alpha))
    @composite
    def selu(self: Any, alpha: float = 1.67326, gamma: float = 1.0507) -> Tensor:
        """gamma * (x for x > 0, alpha * (exp(x) - 1) otherwise)."""
        return gamma * (self > 0).where(self, alpha * _expm1(self))
    @composite
    def softplus(self: Any, beta: float = 1.0) -> Tensor:
        """log(1 + exp(beta x)) / beta, linear above beta x > 20 as torch."""
        x = self.cast(least_upper_float(self.dtype))
        bx = x * beta
        # log1p(exp(-|bx|)) + max(bx, 0) can't overflow
        soft = ((-bx.abs()).exp()._log1p() + bx.maximum(0)) * (1 / beta)
        return (bx > 20).where(x, soft)
    @composite
    def softsign(self: Any) -> Tensor:
        """x / (1 + |x|)."""
        return self / (1 + self.abs())
    @composite
    def mish(self: Any) -> Tensor:
        """x * tanh(softplus(x))."""
        return self * self.softplus().tanh()
    @composite
    def hardswish(self: Any) -> Tensor:
        """x * relu6(x + 3) / 6."""
        return self * (self + 3).relu6() * (1 / 6)
    @composite
    def hardsigmoid(self: Any, alpha: float = 1 / 6, beta: float = 0.5) -> Tensor:
        """clip(alpha * x + beta, 0, 1)."""
        return clamped(alpha * self + beta, 0, 1, closed=False)
    @composite
    def hardtanh(self: Any, min_val: float = -1, max_val: float = 1) -> Tensor:
        """clip(x, min_val, max_val)."""
        if min_val > max_val: raise ValueError(f"hardtanh needs min_val <= max_val, got {min_val} > {max_val}")
        return clamped(self, min_val, max_val, closed=False, nan_passes=True)
    @composite
    def relu6(self: Any) -> Tensor:
        """min(max(x, 0), 6)."""
        return clamped(self, 0, 6, closed=False, nan_passes=True)
    @composite
    def logsigmoid(self: Any) -> Tensor:
        """log(sigmoid(x)) = -softplus(-x)."""
        return -(-self).softplus()

    # *** exponentials and logarithms ***

    def _log1p(self: Any) -> Tensor: return _log1p(self)
    @composite
    def exp(self: Any) -> Tensor:
        """e**x to about an ulp. exp2(x*log2(e)) loses log2(|x|) bits of x in the multiply: float32 and half do it in
        float64 (four ops, so it fuses like before); float64 splits x = n*ln2 + r first."""
        out = least_upper_float(self.dtype)
        if out.itemsize == 8: return _exp_value(self.cast(out))
        # (its gradient is g * exp(x), the value itself: the derivative of the float64 formula recomputed 2^y in
        # float64, a polynomial twice as long on half the lanes, in every backward pass through an exp)
        value = (self.cast(dtypes.float64) * (1 / _LN2))._alu(Ops.EXP2).cast(out)
        return with_gradient(value, (self,), UnaryGradient("exp"))
    @composite
    def log10(self: Any) -> Tensor:
        """Base-10 logarithm."""
        return self.log2() * math.log10(2)
    def logaddexp(self: Any, other: Any) -> Tensor:
        """log(exp(self) + exp(other)) without overflow."""
        a, b = self._broadcasted(other)
        ft = least_upper_float(a.dtype)
        return a.cast(ft)._logaddexp(b.cast(ft))
    @composite
    def _logaddexp(a: Any, b: Tensor) -> Tensor:
        """logaddexp of float tensors of one shape and dtype."""
        m = a.maximum(b)
        ret = m + (-(a - b).abs()).exp()._log1p()
        # equal infinities: the difference would be nan
        return ((a == b) & a.isinf()).where(a, ret)

    # *** trigonometric and hyperbolic ***

    @composite
    def sin(self: Any) -> Tensor:
        """Sine (libm's, with its exact range reduction)."""
        return self._math(_sin_v)
    @composite
    def cos(self: Any) -> Tensor:
        """Cosine as 1 - 2 sin^2(x/2): no rounding of x (sin(pi/2 - x) would lose large arguments)."""
        return self._math(_cos_v, wide=True)
    @composite
    def tan(self: Any) -> Tensor:
        """Tangent."""
        return self._math(lambda x: _sin_v(x) / _cos_v(x), wide=True)
    @composite
    def asin(self: Any) -> Tensor:
        """Inverse sine (nan outside [-1, 1])."""
        return self._math(lambda x: _atan_value(x / ((1 - x) * (1 + x)).sqrt()),
                          lambda x: ((1 - x) * (1 + x)).rsqrt())
    @composite
    def acos(self: Any) -> Tensor:
        """Inverse cosine (nan outside [-1, 1])."""
        return self._math(lambda x: 2.0 * _atan_value(((1 - x) / (1 + x)).sqrt()),
                          lambda x: -((1 - x) * (1 + x)).rsqrt())
    @composite
    def atan(self: Any) -> Tensor:
        """Inverse tangent."""
        return self._math(_atan_value)
    @composite
    def sinh(self: Any) -> Tensor:
        """Hyperbolic sine."""
        return self._math(_sinh_v, wide=True)
    @composite
    def cosh(self: Any) -> Tensor:
        """Hyperbolic cosine."""
        return self._math(_cosh_v, wide=True)
    @composite
    def tanh(self: Any) -> Tensor:
        """Hyperbolic tangent."""
        x = self.cast(least_upper_float(self.dtype))
        return with_gradient(x._math(_tanh_v), (x,), UnaryGradient("tanh"))
    @composite
    def asinh(self: Any) -> Tensor:
        """Inverse hyperbolic sine."""
        def value(x: Tensor) -> Tensor:
            a = x.abs()
            m = a.minimum(_BIG)
            mid = _log1p(m + m * m / (1 + (m * m + 1).sqrt()))
            return _odd(x, (a > _BIG).where(a.log() + _LN2, mid))
        return self._math(value, lambda x: (x * x + 1).rsqrt())
    @composite
    def acosh(self: Any) -> Tensor:
        """Inverse hyperbolic cosine (nan below 1)."""
        def value(x: Tensor) -> Tensor:
            m = x.minimum(_BIG)
            mid = _log1p((m - 1) + ((m - 1) * (m + 1)).sqrt())
            return (x < 1).where(float("nan"), (x > _BIG).where(x.log() + _LN2, mid))
        return self._math(value, lambda x: ((x - 1) * (x + 1)).rsqrt())
    @composite
    def atanh(self: Any) -> Tensor:
        """Inverse hyperbolic tangent (+-inf at +-1, nan beyond)."""
        def value(x: Tensor) -> Tensor:
            a = x.abs()
            return _odd(x, 0.5 * _log1p(2 * a / (1 - a)))
        return self._math(value, lambda x: 1 / ((1 - x) * (1 + x)))

    # *** rounding and special values ***

    @composite
    def round(self: Any) -> Tensor:
        """Round to the nearest integer, halves to even (as torch.round)."""
        if not dtypes.is_float(self.dtype): return self
        f = self.floor()
        d = self - f  # exact: floor(x) and x share their exponent range
        f_even = (f - (f * 0.5).floor() * 2) == 0
        r = (d > 0.5).where(f + 1, (d < 0.5).where(f, f_even.where(f, f + 1)))
        # a result of zero keeps the sign of the input (-0.4 -> -0.0)
        return (r == 0).where(self * 0, r)
    @composite
    def isinf(self: Any, detect_positive: bool = True, detect_negative: bool = True) -> Tensor:
        """True where the value is +inf (if detect_positive) or -inf (if detect_negative)."""
        if not dtypes.is_float(self.dtype): return self.zeros_like(dtypes.bool)
        ret = self.zeros_like(dtypes.bool)
        if detect_positive: ret = ret | (self == float("inf"))
        if detect_negative: ret = ret | (self == float("-inf"))
        return ret
    @composite
    def isfinite(self: Any) -> Tensor:
        """True where the value is neither inf nor nan."""
        if not dtypes.is_float(self.dtype): return self.ones_like(dtypes.bool)
        return (self - self) == 0
    def isclose(self: Any, other: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Tensor:
        """True where |self - other| <= atol + rtol * |other| (infinities equal themselves; nan only if equal_nan)."""
        a, b = self._broadcasted(other)
        close = (a == b) | ((a - b).abs() <= atol + rtol * b.abs())
        if dtypes.is_float(a.dtype): close = (a == b) | (close & a.isfinite() & b.isfinite())
        return close | (a.isnan() & b.isnan()) if equal_nan and dtypes.is_float(a.dtype) else close
    def allclose(self: Any, other: Any, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Tensor:
        """Whether every element is close (a bool scalar tensor; see isclose)."""
        return self.isclose(other, rtol, atol, equal_nan).all()
    def copysign(self: Any, other: Any) -> Tensor:
        """|self| with the sign of other (including the sign of -0.0 and of nan)."""
        a, b = self._broadcasted(other)
        ft = least_upper_float(a.dtype)
        a, b = a.cast(ft), b.cast(ft)
        it = {2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}[ft.itemsize]
        sign = 1 << (8 * ft.itemsize - 1)
        # the sign bit of b over the other bits of a, as bits: exact for zeros, infinities and nan
        bits = (a.detach().bitcast(it) & ~(-sign)) | (b.detach().bitcast(it) & -sign)
        flips = _signbit(a.detach()) != _signbit(b.detach())
        sign = (a.detach() == 0).where(0.0, flips.where(-1.0, 1.0)).cast(ft)
        return _with_grad(bits.bitcast(ft), (a, lambda _: sign))
    def lerp(self: Any, end: Any, weight: Any) -> Tensor:
        """self + weight * (end - self), computed from the nearer end for accuracy (as torch)."""
        from fusegrad.tensor import Tensor
        if not isinstance(end, Tensor): raise TypeError(f"lerp end must be a Tensor, got {type(end).__name__}")
        if not dtypes.is_float(self.dtype): raise TypeError(f"lerp needs a float tensor, got {self.dtype}")
        a, b = self._broadcasted(end)
        w = weight if isinstance(weight, Tensor) else a._const_like_operand(weight)
        diff = b - a
        return (w.abs() < 0.5).where(a + w * diff, b - diff * (1 - w))
    def fmod(self: Any, x: Any) -> Tensor:
        """C's fmod: the remainder of truncated division, with the sign of self."""
        a, b = self._broadcasted(x)
        if a.dtype == dtypes.bool: raise TypeError("fmod of bool tensors is not supported")
        r = a._alu(Ops.MOD, b)
        if not dtypes.is_float(a.dtype): return r
        # d/da = 1, d/db = -trunc(a/b); the value stays libm's exact fmod
        q = ((a - r) / b).detach().round()
        return _with_grad(r, (a, lambda _: a.ones_like().detach()), (b, lambda _: -q))
    def lshift(self: Any, x: Any, reverse: bool = False) -> Tensor:
        """self << x (integers)."""
        return self._int_op(Ops.SHL, x, reverse)
    def rshift(self: Any, x: Any, reverse: bool = False) -> Tensor:
        """self >> x (integers; arithmetic for signed)."""
        return self._int_op(Ops.SHR, x, reverse)

__all__ = ["ElementwiseMixin"]
