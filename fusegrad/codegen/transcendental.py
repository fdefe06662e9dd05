"""Transcendental functions as plain arithmetic: EXP2, LOG2 and SIN of float16, bfloat16, float32 and float64 become
range reductions and polynomials made of MUL/ADD/MULACC, comparisons, WHERE, casts, bitcasts and integer ops, so a
vectorized kernel stays vectorized through them instead of calling libm once per element.

Accuracy (checked by test/codegen/test_transcendental.py against mpmath and the C library) is within 2 ulp over the
whole domain of each dtype, including nan, infinities, signed zeros, denormal inputs and outputs, overflow and sin of
arguments up to the largest finite value:
- exp2: x = n + r with n = rint(x) and |r| <= 1/2 (exact), 2^r by a polynomial, 2^n applied as two factors so that
  denormal results are rounded once. float32 is computed in float32 (and `exp`'s float64 argument, CAST(EXP2(double))
  in float32 after an exact float64 reduction).
- log2: x = 2^e * m with m in [sqrt(1/2), sqrt(2)) read from the bits (denormals scaled first), then
  log(m) = f - (f^2/2 - s (f^2/2 + R(s^2))), f = m - 1, s = f / (2 + f). float64 adds e and multiplies by 1/ln 2 in
  double-double; float32 is computed in float64 and rounded once.
- sin: |x| < pi/4 is its own reduced argument; larger |x| is reduced exactly with a Payne-Hanek reduction: the
  integer significand times the bits of 2/pi that matter for x's exponent (64-bit words of a table made at import,
  picked by a barrel shifter of integer selects), multiplied in 32-bit limbs with 64-bit integer products, gives the
  quadrant and a fraction good to 2^-70 (float32), 2^-102 (float64 arguments with 24-bit significands: float32 cos and
  tan) or 2^-137 (float64) of a quadrant, far below the closest any float comes to a multiple of pi/2. sin or cos of
  the remainder (a double-double for float64) by polynomials, as the quadrant says. float32 is computed in float64 and
  rounded once.
float16 and bfloat16 are computed in float32 and rounded once.

The polynomial coefficients were fitted with `python -m fusegrad.codegen.transcendental` (Chebyshev fits with mpmath of
each function's reduced form over its interval, which prints them); TRANSCENDENTAL=0 turns the pass off (libm calls)."""
from __future__ import annotations
import math
from typing import Any
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import TRANSCENDENTAL
from fusegrad.uop.ops import Ops, UOp
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# *** coefficients, lowest degree first ***

# 2^r = 1 + r * Q(r) on [-1/2, 1/2]
EXP2_F32 = [0.6931471824645996, 0.24022650718688965, 0.05550410971045494, 0.009618056938052177, 0.0013333501992747188,
            0.00015461444854736328, 1.529732435301412e-05]
EXP2_F64 = [0.6931471805599453, 0.24022650695910072, 0.055504108664821625, 0.00961812910762848, 0.001333355814640647,
            0.00015403530393370734, 1.5252733841556773e-05, 1.3215486808705563e-06, 1.0178057087733941e-07,
            7.0548973041554995e-09, 4.4558179083360645e-10, 2.5729324177362305e-11]
# log(1+f) = 2 atanh(s) = 2s + s^3 P(s^2), s = f/(2+f), s^2 in [0, (3 - 2 sqrt 2)^2]
LOG_F32 = [0.6666666655449709, 0.40000121839806124, 0.28550820815960665, 0.23330467216303835]
LOG_F64 = [0.6666666666666666, 0.4000000000000088, 0.28571428570803614, 0.22222222391713917, 0.18181795640132906,
           0.15386239702814658, 0.13268773138656886, 0.13086626147840102]
# sin r = r + r^3 S(r^2), cos r = 1 - r^2/2 + r^4 C(r^2), |r| <= pi/4
SIN_F32 = [-0.1666666666385529, 0.008333331874710208, -0.00019840086735384846, 2.724992580305979e-06]
COS_F32 = [0.0416666666643212, -0.001388888767201679, 2.480060037715673e-05, -2.730095920390147e-07]
SIN_F64 = [-0.16666666666666666, 0.008333333333333331, -0.00019841269841265065, 2.7557319219339167e-06,
           -2.5052106232447578e-08, 1.6058531618986147e-10, -7.586697117706918e-13]
COS_F64 = [0.041666666666666664, -0.0013888888888887398, 2.480158729876569e-05, -2.7557317271729793e-07,
           2.08761462684032e-09, -1.1382632425521717e-11]

INV_LN2_HI, INV_LN2_LO = 1.4426950408889634, 2.0355273740931033e-17   # 1/ln 2 as a double-double
PIO2_HI, PIO2_LO = 1.5707963267948966, 6.123233995736766e-17          # pi/2 as a double-double
PIO4 = 0.7853981633974483

# *** the bits of 2/pi ***

def _two_over_pi(nbits: int) -> int:
    """floor(2/pi * 2^nbits), from pi by Machin's formula in integer arithmetic with 64 guard bits."""
    prec = nbits + 64
    def atan_inv(x: int) -> int:   # atan(1/x) * 2^prec, by its alternating series
        total = term = (1 << prec) // x
        k, sign = 1, 1
        while term:
            term //= x * x
            k, sign = k + 2, -sign
            total += sign * (term // k)
        return total
    pi = 16 * atan_inv(5) - 4 * atan_inv(239)
    return (2 << (prec + nbits)) // pi

# The bits of 2/pi after 64 zero bits, as 64-bit words (the zeros let a window start before the binary point).
# float64 needs 20 words: windows start at most at bit 1033 and span 4 words.
_ZERO_BITS = 64
TWO_OVER_PI_WORDS = [(_two_over_pi(20 * 64 - _ZERO_BITS) >> (64 * (19 - i))) & (2 ** 64 - 1) for i in range(20)]

# *** building blocks ***

FLOATS = (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
_M32 = 0xFFFFFFFF

class _Float:
    """What the bit manipulations need to know about float32 or float64: the int of the same width, the stored
    significand bits and the exponent bias."""
    def __init__(self, dt: DType):
        self.dt, self.int = dt, dtypes.int32 if dt == dtypes.float32 else dtypes.int64
        self.mant, self.bias = (23, 127) if dt == dtypes.float32 else (52, 1023)

def _c(like: UOp, v: Any, dt: DType | None = None) -> UOp: return UOp.const(dt or like.dtype, v)
def _sub(a: UOp, b: UOp | float) -> UOp: return a.alu(Ops.SUB, b if isinstance(b, UOp) else _c(a, b))
def _fma(a: UOp, b: UOp | float, c: UOp | float) -> UOp:
    return a.alu(Ops.MULACC, b if isinstance(b, UOp) else _c(a, b), c if isinstance(c, UOp) else _c(a, c))
def _eq(a: UOp, b: UOp | float) -> UOp: return a.alu(Ops.CMPEQ, b if isinstance(b, UOp) else _c(a, b))
def _neg(a: UOp) -> UOp: return a.alu(Ops.NEG)
def _bit(x: UOp, b: int) -> UOp: return ((x >> b) & 1).ne(0)

def _poly(x: UOp, coeffs: list[float], fma: bool) -> UOp:
    """coeffs[0] + coeffs[1] x + ... by Horner's rule (fused multiply-adds when the target has them)."""
    acc = _c(x, coeffs[-1])
    for c in reversed(coeffs[:-1]): acc = _fma(acc, x, c) if fma else acc * x + c
    return acc

def _rint(x: UOp, f: _Float) -> UOp:
    """x rounded to the nearest integer (ties to even) for |x| < 2^(mant-1): 1.5 * 2^mant + x has no fraction bits."""
    magic = _c(x, 1.5 * 2.0 ** f.mant)
    return _sub(x + magic, magic)

def _pow2(n: UOp, f: _Float) -> UOp:
    """2^n as a float from its exponent bits, for integer n of f's int dtype in the normal range."""
    return ((n + f.bias) << f.mant).bitcast(f.dt)

def _ldexp(p: UOp, n: UOp, f: _Float) -> UOp:
    """p * 2^n as two factors, each a normal number: the first product is exact, so a denormal result rounds once."""
    n1 = n >> 1
    return p * _pow2(n1, f) * _pow2(_sub(n, n1), f)

def _two_sum(a: UOp, b: UOp) -> tuple[UOp, UOp]:
    """s + e == a + b exactly, s = fl(a + b)."""
    s = a + b
    bb = _sub(s, a)
    return s, _sub(a, _sub(s, bb)) + _sub(b, bb)

# *** exp2 ***

def _exp2(x: UOp, fma: bool) -> UOp:
    """2^x of float32 (in float32) or float64."""
    f = _Float(x.dtype)
    # beyond these 2^x is 0 (below half the smallest denormal) or inf; nan stays nan (comparisons with it are false)
    lo, hi = (-151.0, 129.0) if f.dt == dtypes.float32 else (-1076.0, 1025.0)
    low = x < lo
    x = low.where(_c(x, lo), x)
    x = (_c(x, hi) < x).where(_c(x, hi), x)
    n = _rint(x, f)
    p = _poly(_sub(x, n), [1.0] + (EXP2_F32 if f.dt == dtypes.float32 else EXP2_F64), fma)
    return _ldexp(_zero_below(low, p), n.cast(f.int), f)

def _zero_below(low: UOp, p: UOp) -> UOp:
    """p, and 0 where 2^x is 0: the scaling then multiplies 0 rather than rounding a product below the smallest
    denormal to 0, an underflow that x86 cores finish in microcode (a causal softmax's masked -inf lanes: 36x
    slower)."""
    return low.where(_c(p, 0.0), p)

def _exp2_double_to_float(y: UOp, fma: bool) -> UOp:
    """float32 exp2 of a float64 argument: n and r = y - n exact in float64, the rest in float32 (twice the lanes),
    the range checks too: beyond [-151, 129] n alone decides (0 or inf), and +-inf gives r = nan there."""
    n = _rint(y, _Float(dtypes.float64))
    r, n = _sub(y, n).cast(dtypes.float32), n.cast(dtypes.float32)
    low, high = n < -151.0, _c(n, 129.0) < n
    n = low.where(_c(n, -151.0), high.where(_c(n, 129.0), n))
    p = _poly((low | high).where(_c(r, 0.0), r), [1.0] + EXP2_F32, fma)
    return _ldexp(_zero_below(low, p), n.cast(dtypes.int32), _Float(dtypes.float32))

# e^x of float32 in float32: x = n ln2 + r with ln2 split in two (n ln2_hi is exact for |n| < 2^8), then e^r by its
# Taylor series to degree 7 (|r| <= ln2/2: the first term left out is below 6e-9 of the result) and 2^n
LN2_HI, LN2_LO = 0.693145751953125, 1.4286068203094173e-06
EXP_TAYLOR = [1.0 / math.factorial(k) for k in range(8)]

def _exp_f32(x: UOp, fma: bool) -> UOp:
    f = _Float(dtypes.float32)
    n = _rint(x * _c(x, 1 / math.log(2)), f)
    # beyond [-151, 129] n alone decides (0 or inf); +-inf gives r = nan there, so r is zeroed
    low, high = n < -151.0, _c(n, 129.0) < n
    n = low.where(_c(n, -151.0), high.where(_c(n, 129.0), n))
    r = _fma(_neg(n), LN2_LO, _fma(_neg(n), LN2_HI, x)) if fma else _sub(_sub(x, n * LN2_HI), n * LN2_LO)
    p = _poly((low | high).where(_c(r, 0.0), r), EXP_TAYLOR, fma)
    return _ldexp(_zero_below(low, p), n.cast(dtypes.int32), f)

def _exp_of_float(c: UOp, e: UOp, fma: bool) -> UOp:
    """CAST(EXP2(y)) with y a float64 argument: e^x in float32 when y is a float32, half or bfloat16 x times 1/ln 2,
    else the exact float64 reduction of _exp2_double_to_float."""
    y = e.src[0]
    if y.op is Ops.MUL:
        for a, k in (y.src, y.src[::-1]):
            if k.op is Ops.CONST and k.arg == 1 / math.log(2) and a.op is Ops.CAST and \
                    a.src[0].dtype in (dtypes.float32, dtypes.float16, dtypes.bfloat16):
                # (a half or bfloat16 x is exact in float32)
                return _exp_f32(a.src[0].cast(dtypes.float32), fma).cast(c.dtype)
    return _exp2_double_to_float(y, fma).cast(c.dtype)

# *** log2 ***

def _log_parts(x: UOp, fma: bool, coeffs: list[float]) -> tuple[UOp, UOp, UOp]:
    """(e, f, c) for a positive normal float64 x: x = 2^e (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)), and
    log(1 + f) = f - c (c is small next to f, so its rounding errors hardly count)."""
    f64 = _Float(dtypes.float64)
    b = x.bitcast(dtypes.int64)
    # subtracting the bits of sqrt(1/2) carries into the exponent field exactly when the mantissa is >= sqrt(2)
    e = _sub(b, _c(b, 0x3FE6A09E667F3BCD)) >> f64.mant
    f = _sub(_sub(b, e << f64.mant).bitcast(dtypes.float64), 1.0)
    s = f.alu(Ops.FDIV, f + 2.0)
    z = s * s
    r = z * _poly(z, coeffs, fma)
    hf = f * f * 0.5
    return e, f, _sub(hf, s * (hf + r))

def _log2_specials(x: UOp, ret: UOp) -> UOp:
    ret = (x < float("inf")).where(ret, x + float("inf"))   # inf stays inf, nan stays nan
    ret = _eq(x, 0.0).where(_c(ret, float("-inf")), ret)
    return (x < 0.0).where(_c(ret, float("nan")), ret)

def _log2_f64(x: UOp, fma: bool) -> UOp:
    # denormals scaled into the normal range first
    tiny = x < 2.0 ** -1022
    e, f, c = _log_parts(tiny.where(x * 2.0 ** 54, x), fma, LOG_F64)
    e = tiny.where(_sub(e, _c(e, 54)), e).cast(dtypes.float64)
    # e + (f - c) / ln 2 in double-double: f * (1/ln 2) split exactly, e added with its rounding error kept
    ph = f * INV_LN2_HI
    pl = _fma(f, INV_LN2_HI, _neg(ph))
    sh, sl = _two_sum(e, ph)
    tail = sl + (pl + _sub(f * INV_LN2_LO, c * INV_LN2_HI))
    return _log2_specials(x, sh + tail)

def _log2_f32(x: UOp, fma: bool) -> UOp:
    # in float64 every float32 (denormals too) is normal, and float64 rounding errors are far below float32's ulp
    xd = x.cast(dtypes.float64)
    e, f, c = _log_parts(xd, fma, LOG_F32)
    return _log2_specials(xd, e.cast(dtypes.float64) + _sub(f, c) * INV_LN2_HI).cast(dtypes.float32)

# *** sin ***

def _select_words(table: list[int], j: UOp, count: int) -> list[UOp]:
    """[table[j], ..., table[j + count - 1]] (uint64) for 0 <= j <= len(table) - count, by a barrel shifter on the bits
    of j (highest first): about count * log2(len) + len selects instead of count * len. A select is integer masking,
    b ^ ((a ^ b) & -bit) (a ^ b of constants folds), rather than WHERE: C compilers turn chains of ?: over constants
    into lookup tables, which don't vectorize."""
    nbits = (len(table) - count).bit_length()
    cur = [UOp.const(dtypes.uint64, w) for w in table]
    for b in reversed(range(nbits)):
        step, need = 1 << b, count + (1 << b) - 1
        mask = _sub(_c(j, 0, dtypes.uint64), ((j >> b) & 1).cast(dtypes.uint64))
        def sel(hi: UOp, lo: UOp) -> UOp:   # hi where the bit is set
            if hi is lo: return hi
            diff = UOp.const(dtypes.uint64, hi.arg ^ lo.arg) if hi.op is Ops.CONST and lo.op is Ops.CONST else hi ^ lo
            return lo ^ (diff & mask)
        cur = [cur[i] if i + step >= len(cur) else sel(cur[i + step], cur[i]) for i in range(min(need, len(cur)))]
    return cur[:count]

def _mul_limbs(m: list[UOp], w: list[UOp]) -> list[UOp]:
    """(m * w) mod 2^(32 len(w)) in 32-bit limbs; every list is least significant limb first, limbs < 2^32 in uint64.
    Products of two limbs fit in 64 bits and column sums of a few 32-bit halves too; carries are propagated last."""
    cols: list[list[UOp]] = [[] for _ in w]
    for a, ma in enumerate(m):
        for c in range(len(w) - a):
            p = ma * w[c]
            cols[a + c].append(p & _M32)
            if a + c + 1 < len(w): cols[a + c + 1].append(p >> 32)
    out: list[UOp] = []
    carry = None
    for col in cols:
        v = col[0]
        for t in col[1:] + ([carry] if carry is not None else []): v = v + t
        out.append(v & _M32)
        carry = v >> 32
    return out

def _payne_hanek(x: UOp, mant: int, max_e: int, nlimbs: int) -> tuple[UOp, list[UOp]]:
    """For float64 x with pi/4 <= |x| < inf, a significand of at most `mant` bits (24 or 53) and |x| = m 2^e,
    e <= max_e (m the integer significand): |x| * 2/pi = k + g with k the nearest integer, as (k mod 4 in uint64, the
    terms of g in quadrants: exact float64 values, largest first, g = their sum). The product takes N = 32 nlimbs bits
    of 2/pi, so g is off by less than m 2^(2-N)."""
    u64 = dtypes.uint64
    bits = x.bitcast(u64)
    drop = 53 - mant   # zero bits at the end of the significand
    m = ((bits & ((1 << 52) - 1)) | (1 << 52)) >> drop
    # x*2/pi mod 4 = (m * W mod 2^N) * 2^(2-N), W = the N bits of 2/pi from bit e-1 on (1: the first after the point):
    # bits before it are worth multiples of 4. start is bit e-1's index among the zero-prefixed table's bits
    start = ((bits >> 52) & 0x7FF).cast(dtypes.int64) + (_ZERO_BITS - 2 - 1075 + drop)
    nwords = (nlimbs + 1) // 2
    j, sh = start >> 6, (start & 63).cast(u64)
    table = TWO_OVER_PI_WORDS[:((max_e + _ZERO_BITS - 2) >> 6) + nwords + 1]
    assert len(table) <= len(TWO_OVER_PI_WORDS), f"no table of 2/pi for exponents up to {max_e}"
    words = _select_words(table, j, nwords + 1)
    # the window's 64-bit words: shifted left by sh, topped up from the next word (a shift by 64 gives 0)
    win = [(words[i] << sh) | (words[i + 1] >> _sub(_c(sh, 64), sh)) for i in range(nwords)]
    limbs = [lw for w64 in win for lw in (w64 >> 32, w64 & _M32)][:nlimbs][::-1]
    q = _mul_limbs([m] if mant <= 32 else [m & _M32, m >> 32], limbs)
    # round to the nearest quadrant: add half a quadrant, the top two bits are k, the rest g + 1/2
    top = (q[-1] + (1 << 29)) & _M32
    k = top >> 30
    g_hi = _sub((top & ((1 << 30) - 1)).cast(dtypes.int64), _c(top, 1 << 29, dtypes.int64))
    terms = [g_hi.cast(dtypes.float64) * 2.0 ** -30]
    return k, terms + [q[-2 - i].cast(dtypes.float64) * 2.0 ** (-62 - 32 * i) for i in range(min(nlimbs - 1, 3))]

def _sin_cos_poly(k: UOp, rh: UOp, rl: UOp | None, fma: bool, wide: bool) -> UOp:
    """sin(r) for even k, cos(r) for odd k, negated for k mod 4 in (2, 3); r = rh + rl (rl None: 0), |r| <= pi/4."""
    z = rh * rh
    if wide:
        assert rl is not None
        # sin: the r^3 term and the correction for rl are small next to rh
        s = rh + (rh * z * _poly(z, SIN_F64, fma) + _sub(rl, rl * z * 0.5))
        # cos: 1 - z/2 rounded, its rounding error and z's recovered exactly, and the small terms added
        zl = _fma(rh, rh, _neg(z))
        hz = z * 0.5
        w = _sub(_c(z, 1.0), hz)
        c = w + (_sub(_sub(_sub(_c(w, 1.0), w), hz), zl * 0.5) + _sub(z * z * _poly(z, COS_F64, fma), rh * rl))
    else:
        s = rh + rh * z * _poly(z, SIN_F32, fma)
        c = _sub(_c(z, 1.0), z * 0.5) + z * z * _poly(z, COS_F32, fma)
    v = _bit(k, 0).where(c, s)
    return _bit(k, 1).where(_neg(v), v)

def _sin(xd: UOp, fma: bool, mant: int, max_e: int, wide: bool) -> UOp:
    """sin of the float64 xd (significand of `mant` bits at most, exponent at most max_e, as for _payne_hanek), to
    float64 accuracy if `wide` (the remainder as a double-double), else to float32's."""
    neg = xd < 0.0
    ax = neg.where(_neg(xd), xd)
    # g to 2^-70 of a quadrant (float32 results), or 2^-102 / 2^-137 (24 / 53-bit arguments, float64 results)
    k, terms = _payne_hanek(xd, mant, max_e, (4 if mant <= 24 else 6) if wide else 3)
    if wide:
        # g as a double-double, then r = g * pi/2 as a double-double
        s1, e1 = _two_sum(terms[0], terms[1])
        gh, e2 = _two_sum(s1, terms[2])
        gl = e1 + e2 + terms[3]
        rh = gh * PIO2_HI
        rl = _fma(gh, PIO2_HI, _neg(rh)) + (gh * PIO2_LO + gl * PIO2_HI)
    else:
        rh, rl = (terms[0] + terms[1] + terms[2]) * PIO2_HI, None
    small = ax < PIO4
    # sin(-x) = -sin(x): the reduction of |x| with its remainder and quadrant negated
    rh = small.where(xd, neg.where(_neg(rh), rh))
    if rl is not None: rl = small.where(_c(rl, 0.0), neg.where(_neg(rl), rl))
    k = small.where(_c(k, 0), neg.where(_sub(_c(k, 0), k) & 3, k))
    ret = _sin_cos_poly(k, rh, rl, fma, wide)
    # sin(+-0) keeps its sign; inf and nan give nan
    ret = _eq(xd, 0.0).where(xd, ret)
    return (ax < float("inf")).where(ret, _c(ret, float("nan")))

def _narrow(y: UOp) -> int | None:
    """The largest exponent e (of |y| = m 2^e, m an integer) when the float64 y is a float32, half or bfloat16 value
    times a power of two, so its significand has 24 bits at most: float32 cos and tan are float64 SIN of such values,
    and a reduction for 24-bit significands needs a third of the work."""
    scale = 0
    if y.op is Ops.MUL and (c := next((s for s in y.src if s.op is Ops.CONST), None)) is not None:
        frac, exp = math.frexp(abs(c.arg)) if math.isfinite(c.arg) else (0.0, 0)
        if frac != 0.5 or not -64 <= exp <= 64: return None
        y, scale = next(s for s in y.src if s is not c), exp - 1
    if y.op is not Ops.CAST or y.src[0].dtype not in (dtypes.float32, dtypes.float16, dtypes.bfloat16): return None
    return 104 + scale   # float32's largest: (2 - 2^-23) 2^127 = (2^24 - 1) 2^104

def _sin_any(x: UOp, fma: bool) -> UOp:
    """sin of float32 (in float64, to float32 accuracy) or float64."""
    if x.dtype == dtypes.float32: return _sin(x.cast(dtypes.float64), fma, 24, 104, False).cast(dtypes.float32)
    if (max_e := _narrow(x)) is not None: return _sin(x, fma, 24, max_e, True)
    return _sin(x, fma, 53, 971, True)

# *** the pass ***

def _log2(x: UOp, fma: bool) -> UOp: return _log2_f64(x, fma) if x.dtype == dtypes.float64 else _log2_f32(x, fma)

_IMPL = {Ops.EXP2: _exp2, Ops.LOG2: _log2, Ops.SIN: _sin_any}

def _native(ctx: Any, x: UOp) -> bool:
    """Whether the renderer computes `x` itself: (op, dtype) is in its `native_math` (accurate builtins)."""
    return (x.op, x.dtype.scalar()) in getattr(ctx, "native_math", ())

def _expand(ctx: Any, x: UOp) -> UOp | None:
    if _native(ctx, x): return None
    fma = bool(getattr(ctx, "has_fma", False))
    src = x.src[0]
    if x.dtype in (dtypes.float16, dtypes.bfloat16):   # computed in float32, rounded once
        return _IMPL[x.op](src.cast(dtypes.float32), fma).cast(x.dtype)
    return _IMPL[x.op](src, fma)

pm_transcendental = PatternMatcher([
    # exp of float32 and half is exp2 of a float64 argument rounded to float32 (or less): float32 math will do, also
    # where the renderer has a float64 exp2 but its float64 is slow (a GPU's: ~20 float64 operations per element)
    (UPat(Ops.CAST, dtype=(dtypes.float32, dtypes.float16, dtypes.bfloat16), src=(UPat(Ops.EXP2, dtypes.float64,
                                                                                      name="e"),), name="c"),
     lambda ctx, c, e: None if _native(ctx, e) and not getattr(ctx, "slow_float64", False) else
     _exp_of_float(c, e, bool(getattr(ctx, "has_fma", False)))),
    (UPat((Ops.EXP2, Ops.LOG2, Ops.SIN), dtype=FLOATS, name="x"), _expand),
], name="transcendental")
pm_transcendental.__doc__ = "no float EXP2, LOG2 or SIN remains: each became arithmetic within 2 ulp of the exact value"

def rewrite_transcendental(sink: UOp, renderer: Any) -> UOp:
    """`sink` with EXP2/LOG2/SIN expanded by `pm_transcendental` (unless TRANSCENDENTAL=0)."""
    return graph_rewrite(sink, pm_transcendental, ctx=renderer, name="transcendental") if TRANSCENDENTAL else sink

# *** fitting the coefficients (needs mpmath) ***

def _fit() -> None:
    import mpmath as mp
    mp.mp.prec = 200
    def cheb(fn, a, b, deg: int, f32: bool = False) -> list[float]:
        import struct
        rnd = (lambda v: struct.unpack("f", struct.pack("f", float(v)))[0]) if f32 else float
        return [rnd(c) for c in reversed(mp.chebyfit(fn, [a, b], deg + 1))]
    sq = mp.sqrt
    zlog = ((sq(2) - 1) / (sq(2) + 1)) ** 2
    zpi = (mp.pi / 4) ** 2
    q_exp2 = lambda r: (mp.power(2, r) - 1) / r if r else mp.log(2)
    p_log = lambda z: (2 * mp.atanh(sq(z)) / sq(z) - 2) / z if z else mp.mpf(2) / 3
    s_sin = lambda z: (mp.sin(sq(z)) - sq(z)) / (z * sq(z)) if z else -mp.mpf(1) / 6
    c_cos = lambda z: (mp.cos(sq(z)) - 1 + z / 2) / (z * z) if z else mp.mpf(1) / 24
    print("EXP2_F32 =", cheb(q_exp2, -0.5, 0.5, 6, f32=True))
    print("EXP2_F64 =", cheb(q_exp2, -0.5, 0.5, 11))
    print("LOG_F32 =", cheb(p_log, 0, zlog, 3))
    print("LOG_F64 =", cheb(p_log, 0, zlog, 7))
    print("SIN_F32 =", cheb(s_sin, 0, zpi, 3))
    print("COS_F32 =", cheb(c_cos, 0, zpi, 3))
    print("SIN_F64 =", cheb(s_sin, 0, zpi, 6))
    print("COS_F64 =", cheb(c_cos, 0, zpi, 5))
    print("INV_LN2 =", float(1 / mp.log(2)), float(1 / mp.log(2) - mp.mpf(float(1 / mp.log(2)))))
    print("PIO2 =", float(mp.pi / 2), float(mp.pi / 2 - mp.mpf(float(mp.pi / 2))))

if __name__ == "__main__": _fit()
