"""Symbolic simplification of integer and boolean expressions, as PatternMatchers.

`symbolic_simple` folds constants, identities, boolean logic, WHERE, and anything range analysis decides.
`symbolic` (what `UOp.simplify()` uses) adds canonical ordering, combining like terms, div/mod folding and comparison
rewriting on top.

Semantics are the target's: IDIV and MOD truncate toward zero as in C, fixed-width ints wrap around, dtypes.index is a
plain (non-wrapping) integer. Rules that reorder or combine sums are exact in wrap-around arithmetic (it is a ring), but
rules that divide, compare or take MAX need the *true* integer value of a sum; those check `_exact` first, which trusts
range analysis to return the full dtype range whenever something in a sum could have wrapped. Float expressions only get
rewrites that are exact in IEEE arithmetic (constant folding, x*1, constants moved right).
"""
from __future__ import annotations
import math
from collections.abc import Iterable
from typing import Any
from fusegrad.dtype import DType, PtrDType, dtypes
from fusegrad.uop.ops import GroupOp, Ops, UOp, exec_alu, python_alu
from fusegrad.uop.pattern import PatternMatcher, UPat, graph_rewrite

# *** helpers ***

# dtype classes as sets: these checks run for every node visited, and set lookups are much cheaper than dtypes.is_int
_INTS = frozenset(dtypes.ints + (dtypes.index,))
_INTBOOL = _INTS | {dtypes.bool}
_SIGNED = frozenset(dtypes.sints + (dtypes.index,))
# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the passes over every
# node of a kernel compare against module-level names)
_ADD, _AND, _CMPLT, _CONST, _IDIV, _INDEX, _LOAD, _MOD, _MUL, _RANGE, _SINK, _WHERE = Ops.ADD, Ops.AND, Ops.CMPLT, \
    Ops.CONST, Ops.IDIV, Ops.INDEX, Ops.LOAD, Ops.MOD, Ops.MUL, Ops.RANGE, Ops.SINK, Ops.WHERE
def _is_int(u: UOp) -> bool: return u.dtype.scalar() in _INTS  # any integer width, index included; not bool
def _is_intbool(u: UOp) -> bool: return u.dtype.scalar() in _INTBOOL
def _is_signed(u: UOp) -> bool: return u.dtype.scalar() in _SIGNED

# (min, max) of each fixed-width integer dtype; dtypes.index has no bounds (it doesn't wrap)
_BOUNDS: dict[DType, tuple[int, int]] = {dt: (int(dtypes.min(dt)), int(dtypes.max(dt))) for dt in dtypes.ints}

def _exact(u: UOp) -> bool:
    """True when the computed value of `u` is the true integer value of its sum/product tree (nothing wrapped).
    index never wraps; a signed fixed-width value is exact when range analysis found bounds narrower than the dtype
    (a possible wrap anywhere below makes the range the full dtype range). Unsigned values are not trusted."""
    dt = u.dtype.scalar()
    if dt == dtypes.index: return True
    if dt not in _SIGNED: return False
    return u._min_max != _BOUNDS[dt]

def _fits(v: int, dt: DType) -> bool:
    """Whether `v` is representable (without wrapping) in integer dtype `dt`."""
    b = _BOUNDS.get(dt.scalar())
    return b is None or b[0] <= v <= b[1]

def _arg_key(a: Any) -> tuple:
    # a total, deterministic order over the args UOps carry (never depends on id() or hash randomization)
    if a is None: return (0,)
    if isinstance(a, (bool, int, float)): return (1, a)
    if isinstance(a, str): return (2, a)
    if isinstance(a, tuple): return (3,) + tuple(_arg_key(x) for x in a)
    return (4, repr(a))

def _dtype_key(dt: DType) -> tuple: return (dt.priority, dt.count, dt.name, isinstance(dt, PtrDType))

def _make_key(x: UOp) -> tuple:
    return (x.op is Ops.CONST, x.op.value, _dtype_key(x.dtype), _arg_key(x.arg),
            tuple(s.__dict__["_skey"] for s in x.src))

def sort_key(u: UOp) -> tuple:
    """The deterministic order of canonical forms: structural (op, dtype, arg, sources), constants last.
    Variables therefore sort by name. Cached on the node like vmin/vmax."""
    d = u.__dict__
    if "_skey" in d: return d["_skey"]
    if all("_skey" in s.__dict__ for s in u.src): d["_skey"] = _make_key(u)  # the common case: only this node is new
    else:
        for x in u.toposort(gate=lambda x: "_skey" not in x.__dict__):
            if "_skey" not in x.__dict__: x.__dict__["_skey"] = _make_key(x)
    return d["_skey"]

def _wrap(v: int, dt: DType) -> int: return v if dt.scalar() == dtypes.index else dtypes.as_const(v, dt)

# *** sums: flatten to {base: coefficient} + constant, and rebuild canonically ***

def _terms(u: UOp) -> tuple[dict[UOp, int], int]:
    """`u` as sum(coef * base) + const, flattening ADD chains and constant factors. Constants are distributed into a
    sum only for dtypes.index (index math wants (x+1)*4 as x*4+4; data math would pay an extra multiply)."""
    dt = u.dtype
    distribute = dt.scalar() == dtypes.index
    terms: dict[UOp, int] = {}
    k = 0
    stack = [(u, 1)]
    while stack:
        x, c = stack.pop()
        op = x.op
        if op is _ADD:
            stack.append((x.src[1], c)); stack.append((x.src[0], c))
            continue
        if op is _CONST:
            k += c * x.arg
            continue
        if op is _MUL:
            s0, s1 = x.src
            b, m = (s0, s1.arg) if s1.op is _CONST else (s1, s0.arg) if s0.op is _CONST else (None, 0)
            if b is not None:
                if distribute or b.op is not _ADD: stack.append((b, c * m))
                else: terms[b] = terms.get(b, 0) + c * m  # the sum stays whole, as a term with a coefficient
                continue
        terms[x] = terms.get(x, 0) + c
    return terms, k

def _build_sum(terms: dict[UOp, int], k: int, dt: DType) -> UOp:
    """The canonical sum: terms sorted by base, base*coef (coef != 1), left-associated, the constant last."""
    parts = [b if c == 1 else UOp(Ops.MUL, dt, (b, UOp.const(dt, c)))
             for b, c in sorted(terms.items(), key=lambda t: sort_key(t[0])) if c != 0]
    if k != 0 or not parts: parts.append(UOp.const(dt, k))
    ret = parts[0]
    for p in parts[1:]: ret = UOp(Ops.ADD, dt, (ret, p))
    return ret

def _combine_divmod(terms: dict[UOp, int], dt: DType) -> bool:
    """Merge, in place, k*(x//c)*c + k*(x%c) into k*x and k*((x//a)%b)*a + k*(x%a) into k*(x%(a*b)).
    Both hold for every sign under C semantics (and modulo 2^n), so they need no range checks."""
    for m, coef in list(terms.items()):
        if m.op is not Ops.MOD or m.src[1].op is not Ops.CONST or coef == 0: continue
        x, cu = m.src
        c = cu.arg
        if c <= 0: continue
        for other, oc in terms.items():
            if oc != _wrap(coef * c, dt) or other.op not in (Ops.IDIV, Ops.MOD) or other.src[1].op is not Ops.CONST:
                continue
            if other.op is Ops.IDIV and other.src[0] is x and other.src[1] is cu: new = x
            elif other.op is Ops.MOD and other.src[0].op is Ops.IDIV and other.src[0].src[0] is x and \
                    other.src[0].src[1] is cu and other.src[1].arg > 0 and _fits(c * other.src[1].arg, dt):
                new = UOp(Ops.MOD, dt, (x, UOp.const(dt, c * other.src[1].arg)))
            else: continue
            del terms[m], terms[other]
            terms[new] = _wrap(terms.get(new, 0) + coef, dt)
            return True
    return False

def _mark_canonical(u: UOp) -> None:
    # every prefix of a canonical chain is canonical too (still sorted, nothing to combine, no constant), so top-down
    # rewriting can skip re-normalizing each of them: that would make long chains quadratic
    while u.op is Ops.ADD and not u.__dict__.get("_canon"):
        u.__dict__["_canon"] = True
        u = u.src[0]

def normalize_add(a: UOp) -> UOp | None:
    """Integer sums in canonical form: like terms combined, terms sorted, constant last, left-associated."""
    if a.__dict__.get("_canon"): return None
    dt = a.dtype
    terms, k = _terms(a)
    terms = {b: w for b, c in terms.items() if (w := _wrap(c, dt)) != 0}
    while _combine_divmod(terms, dt): terms = {b: c for b, c in terms.items() if c != 0}
    ret = _build_sum(terms, _wrap(k, dt), dt)
    # a sum kept whole as a term (int32 (a+b)*2 + (a+b)*-1) is flattened by the next pass: not canonical yet
    if all(b.op is not Ops.ADD for b in terms): _mark_canonical(ret)
    return None if ret is a else ret

def normalize_mul(m: UOp) -> UOp | None:
    """Integer products in canonical form: constants multiplied into one, placed last; other factors sorted.
    For dtypes.index a constant times a sum is distributed."""
    dt = m.dtype
    factors: list[UOp] = []
    k = 1
    stack = [m]
    while stack:
        x = stack.pop()
        if x.op is Ops.MUL: stack.append(x.src[1]); stack.append(x.src[0])
        elif x.op is Ops.CONST: k = _wrap(k * x.arg, dt)
        else: factors.append(x)
    if k == 0 or not factors: return m.const_like(k)
    if dt.scalar() == dtypes.index and len(factors) == 1 and factors[0].op is Ops.ADD and k != 1:
        terms, c = _terms(factors[0])
        return _build_sum({b: v * k for b, v in terms.items()}, c * k, dt)
    factors.sort(key=sort_key)
    ret = factors[0]
    for f in factors[1:]: ret = UOp(Ops.MUL, dt, (ret, f))
    if k != 1: ret = UOp(Ops.MUL, dt, (ret, UOp.const(dt, k)))
    return None if ret is m else ret

# *** folding: constants, x op x, ranges ***

def _self_op(a: UOp, x: UOp) -> UOp | None:
    """x op x for integers and booleans."""
    op = a.op
    if op is Ops.AND or op is Ops.OR or op is Ops.MAX: return x
    if op in (Ops.XOR, Ops.CMPNE, Ops.CMPLT, Ops.MOD): return a.const_like(0)
    if op is Ops.CMPEQ: return a.const_like(True)
    if op is Ops.IDIV and (x.vmin > 0 or x.vmax < 0): return a.const_like(1)
    return None

def fold(a: UOp) -> UOp | None:
    """ALU ops on constants are computed with the target's semantics for the dtype (exec_alu); for integers and
    booleans, x op x is folded and a node whose range is a single value becomes that constant."""
    src = a.src
    if all(s.op is Ops.CONST for s in src):
        if a.op not in python_alu or isinstance(a.dtype, PtrDType): return None
        return UOp.const(a.dtype, exec_alu(a.op, a.dtype, tuple(s.arg for s in src)))
    if a.dtype.scalar() not in _INTBOOL: return None
    # x op x: only for integer/bool operands (a float x may be NaN, and NaN != NaN)
    if len(src) == 2 and src[0] is src[1] and src[0].dtype.scalar() in _INTBOOL and \
            (ret := _self_op(a, src[0])) is not None: return ret
    lo, hi = a._min_max
    return a.const_like(lo) if lo == hi else None

def _fold_cast(a: UOp) -> UOp | None:
    x = a.src[0]
    if x.dtype == a.dtype: return x
    if isinstance(a.dtype, PtrDType): return None
    if x.op is Ops.CONST: return UOp.const(a.dtype, x.arg)
    if a.dtype.scalar() not in _INTBOOL: return None
    lo, hi = a._min_max
    return a.const_like(lo) if lo == hi else None

def _swap_commutative(a: UOp) -> UOp | None:
    """Two-source commutative ops: constants go right; for int/bool, sources are sorted by sort_key."""
    s0, s1 = a.src
    if not _is_intbool(s0):
        # floats: only moving a constant right is exact for every op (MAX with a NaN isn't symmetric in C)
        return a.replace(src=(s1, s0)) if a.op is not Ops.MAX and s0.op is Ops.CONST and s1.op is not Ops.CONST \
            else None
    if a.op in (Ops.ADD, Ops.MUL) and s0.dtype.scalar() in _INTS: return None  # normalize_add/mul order whole chains
    return a.replace(src=(s1, s0)) if sort_key(s1) < sort_key(s0) else None

# *** identities ***

def _all_ones(c: UOp) -> bool:
    # -1 in two's complement; unsigned constants are stored wrapped, as the dtype's max
    return c.arg == -1 or (dtypes.is_unsigned(c.dtype) and c.arg == dtypes.max(c.dtype))

def _and_const(x: UOp, c: UOp) -> UOp | None:
    if x.dtype.scalar() == dtypes.bool: return x if c.arg else c
    if _is_int(x): return c if c.arg == 0 else x if _all_ones(c) else None
    return None

def _or_const(x: UOp, c: UOp) -> UOp | None:
    if x.dtype.scalar() == dtypes.bool: return c if c.arg else x
    if _is_int(x): return x if c.arg == 0 else c if _all_ones(c) else None
    return None

def _xor_const(x: UOp, c: UOp) -> UOp | None:
    if not _is_intbool(x): return None
    if not c.arg: return x
    return x.ne(True) if x.dtype.scalar() == dtypes.bool else None

def _max_by_range(x: UOp, y: UOp) -> UOp | None:
    """MAX decided by ranges (ints and bools)."""
    if not _is_intbool(x): return None
    if x.vmin >= y.vmax: return x
    if y.vmin >= x.vmax: return y
    return None

def _where_bool(c: UOp, t: UOp, f: UOp) -> UOp | None:
    if t.dtype.scalar() != dtypes.bool: return None
    if t.arg is True and f.arg is False: return c
    if t.arg is False and f.arg is True: return c.ne(True)
    return None

_fold_rules: list = [
    (UPat(GroupOp.ALU, name="a"), fold),
    (UPat(Ops.CAST, name="a"), _fold_cast),
]
# identities that normalize_add/normalize_mul and divmod_rules subsume in `symbolic`
_arith_identities: list = [
    (UPat.var("x") + 0, lambda x: x if _is_int(x) else None),
    (UPat.var("x") * 0, lambda x: x.const_like(0) if _is_int(x) else None),
    (UPat.var("x") // 1, lambda x: x if _is_int(x) else None),
    (UPat.var("x") % 1, lambda x: x.const_like(0) if _is_int(x) else None),
    (UPat((Ops.IDIV, Ops.MOD), src=(UPat.const(None, 0), UPat.var("x")), name="a"),
     lambda a, x: a.src[0] if _is_int(x) else None),
]
_logic_rules: list = [
    (UPat.var("x") * 1, lambda x: x),  # exact for floats too
    (UPat(Ops.MAX, src=(UPat.var("x"), UPat.var("y"))), _max_by_range),
    # boolean logic
    (UPat.var("x") & UPat.cvar("c"), _and_const),
    (UPat.var("x") | UPat.cvar("c"), _or_const),
    (UPat.var("x") ^ UPat.cvar("c"), _xor_const),
    (UPat.var("x", dtypes.bool) & UPat.var("x").ne(True), lambda x: x.const_like(False)),
    (UPat.var("x", dtypes.bool) | UPat.var("x").ne(True), lambda x: x.const_like(True)),
    (UPat.var("x", dtypes.bool).ne(True).ne(True), lambda x: x),
    (UPat.var("x", dtypes.bool).ne(False), lambda x: x),
    (UPat(Ops.CMPEQ, src=[UPat.var("x", dtypes.bool), UPat.cvar("c", dtypes.bool)]),
     lambda x, c: x if c.arg else x.ne(True)),
    (UPat(Ops.NOT, src=(UPat(Ops.NOT, src=(UPat.var("x"),)),)), lambda x: x),
    # WHERE
    (UPat(Ops.WHERE, src=(UPat.cvar("c"), UPat.var("t"), UPat.var("f"))), lambda c, t, f: t if c.arg else f),
    (UPat(Ops.WHERE, src=(UPat.var(), UPat.var("x"), UPat.var("x"))), lambda x: x),
    (UPat(Ops.WHERE, src=(UPat.var("c", dtypes.bool), UPat.cvar("t"), UPat.cvar("f"))), _where_bool),
    (UPat(Ops.WHERE, src=(UPat.var("c", dtypes.bool).ne(True), UPat.var("t"), UPat.var("f"))),
     lambda c, t, f: c.where(f, t)),
    # a nested WHERE on the same condition takes the same branch
    (UPat.var("c").where(UPat.var("c").where(UPat.var("t"), UPat.var()), UPat.var("f")), lambda c, t, f: c.where(t, f)),
    (UPat.var("c").where(UPat.var("t"), UPat.var("c").where(UPat.var(), UPat.var("f"))), lambda c, t, f: c.where(t, f)),
]

symbolic_simple = PatternMatcher(_fold_rules + _arith_identities + _logic_rules, name="symbolic_simple")
"""Constant folding, identities (x+0, x*1, x*0, x//1, x%1, x op x), boolean and WHERE folding, and folding of any
integer/boolean node that range analysis pins to one value. Exact for every dtype."""

# *** canonical forms ***

def _sub_to_add(x: UOp, y: UOp) -> UOp | None: return x + y * -1 if _is_int(x) else None
def _neg_to_mul(x: UOp) -> UOp | None: return x * -1 if _is_int(x) else None

# *** division and modulo ***

def _neg_divisor(a: UOp, x: UOp, c: UOp) -> UOp | None:
    """x//-c -> -(x//c) and x%-c -> x%c: C truncation is odd in the divisor, the remainder follows the dividend."""
    if c.arg >= 0 or not _is_signed(x) or not _fits(-c.arg, x.dtype): return None
    nc = c.const_like(-c.arg)
    return (x // nc) * -1 if a.op is Ops.IDIV else x % nc

def _divmod_by_const(a: UOp, x: UOp, c: UOp) -> UOp | None:
    """x//c and x%c for a constant c > 1, with x = c*Q + R split term by term.

    A common factor g of c and every coefficient cancels for any sign: (g*A)//(g*C) = A//C, (g*A)%(g*C) = (A%C)*g.
    Otherwise truncation agrees with the floor identities only when x and R have the same sign, so the split is done
    with remainders in [0, c) when x >= 0 (or x is one term k*b, k > 0) and in (-c, 0] when x <= 0; when R also stays
    inside (-c, c), x//c is Q and x%c is R."""
    cv, dt, is_mod = c.arg, a.dtype, a.op is Ops.MOD
    # a lone term with coefficient 1 can't be split (what range analysis decides is folded elsewhere)
    if cv <= 1 or x.op not in (Ops.ADD, Ops.MUL) or not _is_signed(x) or not _exact(x): return None
    terms, k = _terms(x)
    terms = {b: v for b, v in terms.items() if v != 0}
    g = math.gcd(cv, k, *terms.values())
    if g > 1:
        if is_mod and g == cv: return a.const_like(0)
        inner = _build_sum({b: v // g for b, v in terms.items()}, k // g, dt)
        return (inner % (cv // g)) * g if is_mod else inner // (cv // g)
    lo, hi = x.vmin, x.vmax
    # a factor g of c and of every coefficient but not of the constant, for x >= 0: x = g*Y + kr with 0 <= kr < g, so
    # x//c = Y//(c/g) and x%c = (Y%(c/g))*g + kr (the lanes of an upcast loop: (8*r+1)//64 -> r//8)
    if lo >= 0 and (g := math.gcd(cv, *terms.values())) > 1:
        kq, kr = divmod(k, g)
        inner = _build_sum({b: v // g for b, v in terms.items()}, kq, dt)
        return (inner % (cv // g)) * g + kr if is_mod else inner // (cv // g)
    # a single term k*b (k > 0) and its remainder r*b (0 <= r < c) have the same sign at every point, whatever b's range
    monomial = k == 0 and len(terms) == 1 and next(iter(terms.values())) > 0
    if lo >= 0 or monomial: rem = lambda v: v % cv
    elif hi <= 0: rem = lambda v: -((-v) % cv)
    else: return None
    rterms: dict[UOp, int] = {}
    qterms: dict[UOp, int] = {}
    removed = False  # a term divides out entirely, so it leaves the division
    rmin = rmax = rk = rem(k)
    for b, v in terms.items():
        r = rem(v)
        if r:
            rterms[b] = r
            rmin += min(r * b.vmin, r * b.vmax); rmax += max(r * b.vmin, r * b.vmax)
        if q := (v - r) // cv:
            qterms[b] = q
            removed |= not r
    if (lo >= 0 and rmin < 0) or (hi <= 0 and rmax > 0) or not (_fits(rmin, dt) and _fits(rmax, dt)): return None
    fits = -cv < rmin and rmax < cv
    if is_mod:
        if fits: return _build_sum(rterms, rk, dt)
        if rterms == terms and rk == k: return None
        return _build_sum(rterms, rk, dt) % c
    if fits: return _build_sum(qterms, (k - rk) // cv, dt)
    if not removed: return None
    return _build_sum(qterms, (k - rk) // cv, dt) + _build_sum(rterms, rk, dt) // c

def _div_div(x: UOp, a: UOp, b: UOp) -> UOp | None:
    """(x//a)//b -> x//(a*b) for a, b > 0: nested truncations compose, for either sign of x."""
    if a.arg <= 0 or b.arg <= 0 or not _is_int(x) or not _fits(a.arg * b.arg, x.dtype): return None
    return x // (a.arg * b.arg)

def _mod_mod(x: UOp, m: UOp, a: UOp) -> UOp | None:
    """(x%m)%a -> x%a when a divides m (a, m > 0): holds for either sign since both remainders follow x's sign."""
    if a.arg <= 0 or m.arg <= 0 or m.arg % a.arg != 0 or not _is_int(x): return None
    return x % a

def _mod_div(x: UOp, m: UOp, a: UOp) -> UOp | None:
    """(x%m)//a -> (x//a)%(m//a) when a divides m (a, m > 0); valid for either sign of x."""
    if a.arg <= 0 or m.arg <= 0 or m.arg % a.arg != 0 or not _is_int(x): return None
    return (x // a) % (m.arg // a.arg)

def _mod_small(x: UOp, y: UOp) -> UOp | None:
    """x%y -> x when |x| < |y| for every value (C keeps x then, whatever the signs)."""
    if not _is_int(x) or (y.vmin <= 0 <= y.vmax): return None
    return x if max(abs(x.vmin), abs(x.vmax)) < min(abs(y.vmin), abs(y.vmax)) else None

def _below(x: UOp, y: UOp) -> bool:
    """x < y for every value: a loop index running to y, or by range analysis of y - x."""
    return (x.op is Ops.RANGE and x.src[0] is y) or (y - x).simplify().vmin >= 1

def _divmod_by_symbol(a: UOp, x: UOp, y: UOp) -> UOp | None:
    """x//y and x%y for a symbolic y > 0 and x >= 0 (where C's truncation is floor): the terms of x that are
    multiples of y go to the quotient, e.g. (i + j*n)//n -> j and (i + j*n)%n -> i for a loop index i < n."""
    if y.vmin <= 0 or x.vmin < 0 or y.dtype.scalar() != dtypes.index: return None
    terms, k = _terms(x)
    # x = (qk + sum(c * b for b, c in quotient)) * y + rest
    qk, quotient, rest = 0, dict[UOp, int](), dict[UOp, int]()
    for base, coef in terms.items():
        if base is y: qk += coef
        elif base.op is Ops.MUL and y in base.src:
            other = base.src[1] if base.src[0] is y else base.src[0]
            quotient[other] = quotient.get(other, 0) + coef
        else: rest[base] = coef
    r = _build_sum(rest, k, x.dtype).simplify()
    if r.vmin < 0 or qk < 0 or any(b.vmin < 0 or c < 0 for b, c in quotient.items()): return None
    small, whole = _below(r, y), bool(quotient) or qk != 0
    if not whole and not small: return None
    if a.op is Ops.MOD: return r if small else r % y
    q = _build_sum(quotient, qk, x.dtype)
    return q if small else q + r // y

def _mul_div_self(a: UOp, m: UOp, y: UOp) -> UOp | None:
    """(x*y)//y -> x and (x*y)%y -> 0, when y is never 0 and x*y did not wrap."""
    if not _is_int(y) or y.vmin <= 0 <= y.vmax or not _exact(m): return None
    x = m.src[1] if m.src[0] is y else m.src[0]
    return x if a.op is Ops.IDIV else a.const_like(0)

# *** comparisons ***

def _ceildiv(a: int, b: int) -> int: return -((-a) // b)

def _cmp_bound_of_div(c: int, d: int) -> int:
    """B such that (x//d < c) == (x < B) for d > 0 under C truncation."""
    return c * d if c > 0 else d * (c - 1) + 1

def _one_wrap(e: UOp, m: int) -> int | None:
    """q when e (never negative, exact) takes values on both sides of q*m and of no other multiple of m, else None."""
    if m <= 0 or not _exact(e): return None
    lo, hi = e.vmin, e.vmax
    if not isinstance(lo, int) or not isinstance(hi, int) or lo < 0 or hi - lo >= m: return None
    q = hi // m
    return q if lo // m == q - 1 else None

def _lt_mod(x: UOp, c: int) -> UOp | None:
    """e % m < c -> q*m <= e where e's range crosses exactly one multiple q*m of m and c splits the two pieces: the
    values from e >= q*m are 0..hi-q*m (all below c), those from e < q*m are lo-(q-1)*m..m-1 (none below c). A pooling
    gradient's window positions over a padded axis give such gates: decided by the loop alone, they fold."""
    e, mu = x.src
    if mu.op is not Ops.CONST or (q := _one_wrap(e, mu.arg)) is None: return None
    m = mu.arg
    if not (e.vmax - q * m < c <= e.vmin - (q - 1) * m) or not _fits(q * m - 1, e.dtype): return None
    return e.const_like(q * m - 1) < e

def _lt_const(a: UOp) -> UOp | None:
    """x < c and c < x with x an integer sum or x//d: constants move to the constant side, a common factor of the
    coefficients divides out, an all-negative sum is negated; x//d < c becomes x < B."""
    s0, s1 = a.src
    on_left = s1.op is Ops.CONST
    x, c = (s0, s1.arg) if on_left else (s1, s0.arg)
    if x.op is Ops.CONST or not _is_signed(x): return None
    dt = x.dtype
    if x.op is Ops.MOD and on_left and (ret := _lt_mod(x, c)) is not None: return ret
    if x.op is Ops.IDIV and x.src[1].op is Ops.CONST and x.src[1].arg > 0:
        d = x.src[1].arg
        if on_left: bound, ok = _cmp_bound_of_div(c, d), True
        else: bound, ok = _cmp_bound_of_div(c + 1, d) - 1, _fits(c + 1, dt)
        if not ok or not _fits(bound, dt): return None
        return x.src[0] < bound if on_left else x.src[0].const_like(bound) < x.src[0]
    if x.op not in (Ops.ADD, Ops.MUL) or not _exact(x): return None
    terms, k = _terms(x)
    terms = {b: v for b, v in terms.items() if v != 0}
    if not terms: return None
    # S = x - k is compared with c - k as true integers, so the rebuilt S must not wrap: x's range says where S lies
    # (x itself being exact doesn't imply it when x isn't in canonical order, e.g. int8 (b1-20)+b2)
    lo, hi = x.vmin - k, x.vmax - k
    if not (_fits(lo, dt) and _fits(hi, dt)): return None
    c2 = c - k
    flip = all(v < 0 for v in terms.values())
    if flip:
        if not (_fits(-lo, dt) and _fits(-hi, dt)): return None
        terms, c2, on_left = {b: -v for b, v in terms.items()}, -c2, not on_left
    g = math.gcd(*terms.values())
    if g == 1 and k == 0 and not flip: return None
    bound = _ceildiv(c2, g) if on_left else c2 // g
    if not _fits(bound, dt): return None
    s = _build_sum({b: v // g for b, v in terms.items()}, 0, dt)
    return s < bound if on_left else s.const_like(bound) < s

def _ne_const(a: UOp, x: UOp, c: UOp) -> UOp | None:
    """x != c / x == c with x an integer sum S + k. Moving k across and negating both sides are exact modulo 2^n.
    When x doesn't wrap, a common factor g of S's coefficients divides out: x == c means S == c-k as true integers,
    never true if g doesn't divide c-k; and S/g == (c-k)/g modulo 2^n means x == c modulo g*2^n, so x == c."""
    if not _is_int(x) or x.op not in (Ops.ADD, Ops.MUL): return None
    dt, is_ne = x.dtype, a.op is Ops.CMPNE
    terms, k = _terms(x)
    terms = {b: v for b, v in terms.items() if v != 0}
    if not terms: return None
    g = math.gcd(*terms.values())
    if g > 1 and _exact(x):
        if (c.arg - k) % g != 0: return a.const_like(is_ne)
        terms, c2 = {b: v // g for b, v in terms.items()}, _wrap((c.arg - k) // g, dt)
    else: c2 = _wrap(c.arg - k, dt)
    if all(v < 0 for v in terms.values()) and _is_signed(x):
        terms, c2 = {b: -v for b, v in terms.items()}, _wrap(-c2, dt)
    s = _build_sum(terms, 0, dt)
    if s is x and c2 == c.arg: return None
    return s.ne(c2) if is_ne else s.alu(Ops.CMPEQ, s.const_like(c2))

def _not_lt(x: UOp, c: UOp, c_left: bool) -> UOp | None:
    """!(x < c) -> (c-1) < x and !(c < x) -> x < (c+1), for integers."""
    if not _is_int(x): return None
    if not c_left: return c.const_like(c.arg - 1) < x if _fits(c.arg - 1, x.dtype) else None
    return x < c.arg + 1 if _fits(c.arg + 1, x.dtype) else None

def divmod_rules(a: UOp) -> UOp | None:
    """Every rule for x//y and x%y on integers, tried in order (one dispatch instead of a pattern per rule)."""
    x, y = a.src
    if x.dtype.scalar() not in _INTS: return None
    is_mod = a.op is Ops.MOD
    if x.op is Ops.CONST and x.arg == 0: return x  # 0//y and 0%y (y == 0 folds to 0 as well)
    if y.op is not Ops.CONST:
        if x.op is Ops.MUL and (x.src[0] is y or x.src[1] is y) and (ret := _mul_div_self(a, x, y)) is not None:
            return ret
        if (ret := _divmod_by_symbol(a, x, y)) is not None: return ret
        return _mod_small(x, y) if is_mod else None
    c = y.arg
    if c == 1 or (c == -1 and is_mod): return x.const_like(0) if is_mod else x
    if c < 0: return _neg_divisor(a, x, y)
    if c == 0: return None
    if x.op in (Ops.IDIV, Ops.MOD) and x.src[1].op is Ops.CONST:
        inner = x.src[0], x.src[1]
        ret = (_mod_div(*inner, y) if x.op is Ops.MOD else _div_div(*inner, y)) if not is_mod else \
            (_mod_mod(*inner, y) if x.op is Ops.MOD else None)
        if ret is not None: return ret
    if is_mod and (ret := _mod_small(x, y)) is not None: return ret
    return _divmod_by_const(a, x, y)

def _int_only(fxn):
    # restrict a rule on a node to integer results; cheap guard in front of the heavier callbacks
    return lambda a: fxn(a) if a.dtype.scalar() in _INTS else None

symbolic = PatternMatcher(_fold_rules + [
    # canonical sums and products (these also do x+0, x*0, x*1, x-x)
    (UPat(Ops.ADD, name="a"), _int_only(normalize_add)),
    (UPat(Ops.MUL, name="a"), _int_only(normalize_mul)),
    (UPat(GroupOp.Commutative, src=(UPat.var(), UPat.var()), name="a"), _swap_commutative),
    (UPat(Ops.SUB, src=(UPat.var("x"), UPat.var("y"))), _sub_to_add),
    (UPat(Ops.NEG, src=(UPat.var("x"),)), _neg_to_mul),
    (UPat(Ops.MULACC, src=(UPat.var("x"), UPat.var("y"), UPat.var("z"))),
     lambda x, y, z: x * y + z if _is_int(x) else None),
    # division and modulo
    (UPat((Ops.IDIV, Ops.MOD), name="a"), divmod_rules),
    # comparisons
    (UPat(Ops.CMPLT, src=[UPat.var(), UPat.cvar()], name="a"), _lt_const),
    (UPat((Ops.CMPNE, Ops.CMPEQ), src=(UPat.var("x"), UPat.cvar("c")), name="a"), _ne_const),
    (UPat(Ops.CMPLT, src=(UPat.var("x"), UPat.cvar("c"))).ne(True), lambda x, c: _not_lt(x, c, False)),
    (UPat(Ops.CMPLT, src=(UPat.cvar("c"), UPat.var("x"))).ne(True), lambda x, c: _not_lt(x, c, True)),
] + _logic_rules, name="symbolic")
"""symbolic_simple plus canonical order (constants right, variables sorted, so x+y and y+x are one UOp), combining like
terms (x*2+x*3 -> x*5, x-x -> 0), div/mod folding with ranges and C semantics, and linear comparison rewriting."""

# Index expressions repeat: the accesses of one kernel share most of their terms, and kernels of one shape (the blocks
# of a ResNet stage) share whole expressions, loops included (a kernel's RANGEs are numbered from 0). The symbolic rules
# depend on the node alone, so what one rewrite found holds in every later one: code generation keeps one memo for
# them. It keeps nodes alive, so it is emptied when it reaches INDEX_MEMO_SIZE entries.
INDEX_MEMO_SIZE = 1 << 17
_index_memo: dict[UOp, UOp] = {}

def simplify_index(x: UOp) -> UOp:
    """`x` (an index, a valid, or a SINK of several) simplified by `symbolic`, with the memo of every earlier call."""
    # (most calls ask for an expression simplified before: answered without starting a rewrite)
    if (done := _index_memo.get(x)) is not None: return done
    if len(_index_memo) > INDEX_MEMO_SIZE: _index_memo.clear()
    return graph_rewrite(x, symbolic, name="simplify_index", memo=_index_memo)

def _index_arithmetic(topo: Iterable[UOp]) -> set[UOp]:
    """The nodes of `topo` (a toposort) that are integer arithmetic on ranges and constants alone: a WHERE gate among
    them (a padding mask, or a concatenation's position compared with its pieces' offsets) is decided by symbolic
    where the loops' values are known. (One pass: a walk per gate was quadratic in a deep kernel.)"""
    out: set[UOp] = set()
    for u in topo:
        if u.dtype.scalar() in _INTBOOL and u.op is not _LOAD and out.issuperset(u.src): out.add(u)
    return out

def _gate_bounds(gate: UOp) -> dict[UOp, tuple[float, float]]:
    """The bounds on sums (keyed by their terms without the constant) that each clause of an AND chain states."""
    out: dict[UOp, tuple[float, float]] = {}
    stack = [gate]
    while stack:
        g = stack.pop()
        if g.op is _AND and g.dtype == dtypes.bool: stack.extend(g.src); continue
        if g.op is not _CMPLT: continue
        a, b = g.src
        if (a.op is _CONST) == (b.op is _CONST): continue
        s = b if a.op is _CONST else a
        if s.dtype.count != 1 or not _is_signed(s) or not _exact(s): continue
        terms, k = _terms(s)
        base = _build_sum(terms, 0, a.dtype)
        lo, hi = out.get(base, (-math.inf, math.inf))
        out[base] = (max(lo, a.arg + 1 - k), hi) if a.op is _CONST else (lo, min(hi, b.arg - 1 - k))
    return out

def _decided(d: UOp, bounds: dict[UOp, tuple[float, float]]) -> UOp | None:
    """e//m or e%m (m > 0, e never negative) where the gate's bounds keep e between two multiples of m."""
    e, mu = d.src
    terms, k = _terms(e)
    if (b := bounds.get(_build_sum(terms, 0, e.dtype))) is None: return None
    lo, hi = max(e.vmin, b[0] + k), min(e.vmax, b[1] + k)
    if lo < 0 or lo > hi or lo // mu.arg != hi // mu.arg: return None
    q = int(lo // mu.arg)
    return e.const_like(q) if d.op is _IDIV else e + e.const_like(-q * mu.arg)

def _refine_under_gates(sink: UOp, topo: list[UOp]) -> UOp:
    """Each e//m and e%m that a gate decides (its valid, for a load's index; its condition, for a select's true branch)
    rewritten there as q and e-q*m: a pooling gradient's window position over a padded axis wraps once around m, and
    the gate that keeps it inside the image says on which side. Inner gates first, so outer ones see their results."""
    cands = {u for u in topo if u.op in (_IDIV, _MOD) and u.src[1].op is _CONST and
             _is_signed(u) and _one_wrap(u.src[0], u.src[1].arg) is not None}
    if not cands: return sink
    replaced: dict[UOp, UOp] = {}
    for u in topo:
        src = tuple([replaced.get(s, s) for s in u.src])
        gate = src[2] if u.op is _INDEX and len(src) > 2 else src[0] if u.op is _WHERE else None
        # the guarded source is the index of a load and the true branch of a select: src[1] of both
        if gate is not None and gate.dtype == dtypes.bool and src[1].dtype.count == 1 and \
                (bounds := _gate_bounds(gate)):
            sub = {c: r for c in src[1].toposort() if c in cands and (r := _decided(c, bounds)) is not None}
            if sub: src = (src[0], src[1].substitute(sub)) + src[2:]
        if src != u.src: replaced[u] = u.replace(src=src)
    return replaced.get(sink, sink)

def simplify_indexing(sink: UOp, refine: bool = True) -> UOp:
    """`sink` with every index and valid expression, and every WHERE gate made of integer arithmetic alone (a padding
    mask computed in the value, not in a load), simplified by symbolic; values are left alone, except where a gate
    became a constant: a select is then its branch and a load that is never valid its zero. One rewrite for all of
    them: a kernel's hundreds of accesses share most of their terms, which a rewrite per access redid each time (the
    biggest convolution kernel of ResNet-18: 578 rewrites, 0.28 s)."""
    topo = sink.toposort()
    exprs = dict.fromkeys(s for u in topo if u.op is _INDEX for s in u.src[1:])
    arith = _index_arithmetic(topo)
    exprs.update(dict.fromkeys(u.src[0] for u in topo if u.op is _WHERE and u.src[0] in arith))
    # integer arithmetic that feeds a value (an argmax's position compared with a loaded index, cast to int32): the
    # unrolled lanes' constants fold there too, which the C compiler leaves to run in the innermost loop
    exprs.update(dict.fromkeys(s for u in topo if u not in arith and u.op is not _INDEX for s in u.src
                               if s in arith and s.op not in (_CONST, _RANGE) and s.dtype.count == 1))
    if not exprs: return sink
    keys = list(exprs)
    done = simplify_index(UOp(_SINK, dtypes.void, tuple(keys)))
    changed = {k: v for k, v in zip(keys, done.src) if k is not v}
    if not changed: return _refine_again(sink) if refine else sink
    # a gate that folded to a constant decides its node here (the lanes of an unrolled concatenation axis each take
    # one piece: the others' selects and loads would be compiled only for the C compiler to drop them again). An
    # access whose valid became always true loses it (a kernel with gated accesses is compiled without the loop
    # vectorizer: a stride-2 slice's load whose padding check folded to true stayed scalar)
    replaced: dict[UOp, UOp] = {}
    get = replaced.get
    for u in topo:
        if u in changed: replaced[u] = changed[u]; continue
        src = tuple(map(get, u.src, u.src))
        if u.op is _WHERE and src[0].op is _CONST: replaced[u] = src[1] if src[0].arg else src[2]
        elif u.op is _INDEX and len(src) > 2 and src[2].op is _CONST and src[2].arg is True:
            replaced[u] = UOp(_INDEX, u.dtype, src[:2], u.arg)
        elif u.op is _LOAD and len(src) == 1 and src[0].op is _INDEX and len(src[0].src) > 2 and \
                src[0].src[2].op is _CONST and src[0].src[2].arg is False and u.dtype.count == 1:
            replaced[u] = u.const_like(0)
        elif src != u.src: replaced[u] = UOp(u.op, u.dtype, src, u.arg)
    ret = replaced.get(sink, sink)
    return _refine_again(ret) if refine else ret

def _refine_again(sink: UOp) -> UOp:
    ret = _refine_under_gates(sink, sink.toposort())
    return ret if ret is sink else simplify_indexing(ret, refine=False)

