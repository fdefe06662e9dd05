"""Step 4 of scheduling: give a kernel its AST. Walking down from the value a kernel stores, every movement op becomes
index arithmetic on RANGE loop variables, every realized input becomes a LOAD from a DEFINE_GLOBAL, and every fused
REDUCE_AXIS becomes a REDUCE over new reduce ranges."""
from __future__ import annotations
from dataclasses import dataclass, field
from fusegrad.dtype import dtypes
from fusegrad.uop.ops import GroupOp, Ops, UOp, buffer_node

# (Python 3.11's Enum metaclass has a __getattr__, which makes every `Ops.X` lookup slow: the loops over every
# node compare against module-level names)
_CONST, _DEFINE_GLOBAL, _DEFINE_VAR, _EXPAND, _FLIP = Ops.CONST, Ops.DEFINE_GLOBAL, Ops.DEFINE_VAR, Ops.EXPAND, Ops.FLIP
_LOAD, _PAD, _PERMUTE, _RANGE, _REDUCE = Ops.LOAD, Ops.PAD, Ops.PERMUTE, Ops.RANGE, Ops.REDUCE
_REDUCE_AXIS, _RESHAPE, _SHRINK = Ops.REDUCE_AXIS, Ops.RESHAPE, Ops.SHRINK

def _idx(v: int) -> UOp: return UOp.const(dtypes.index, v)

def flat_index(idxs: tuple[UOp, ...], shape: tuple[int, ...]) -> UOp:
    """The row-major offset of position `idxs` in `shape`."""
    terms, stride = [], 1
    for i, s in reversed(list(zip(idxs, shape))):
        if s != 1: terms.append(i * stride if stride != 1 else i)
        stride *= s
    if not terms: return _idx(0)
    ret = terms[-1]
    for t in reversed(terms[:-1]): ret = ret + t
    return ret

def unflatten_index(flat: UOp, shape: tuple[int, ...]) -> tuple[UOp, ...]:
    """Position in `shape` of the row-major offset `flat` (inverse of flat_index). The outermost position takes no
    modulo: `flat` is below the size wherever the element is read (an index outside a padded tensor's data is gated),
    and without the modulo the index stays affine, so loads along it vectorize."""
    out, stride = [], 1
    outer = next((i for i, s in enumerate(shape) if s != 1), len(shape))
    for i, s in reversed(list(enumerate(shape))):
        if s == 1: out.append(_idx(0))
        elif i == outer: out.append(flat // stride if stride != 1 else flat)
        else: out.append((flat // stride) % s if stride != 1 else flat % s)
        stride *= s
    return tuple(reversed(out))

def _reshape_groups(old: tuple, new: tuple) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """The runs of dims that a reshape regroups: pairs of (old dims, new dims) index ranges with equal products, as
    small as possible (a reshape that adds or drops 1s, or splits one dim, touches only its own dims). None for
    symbolic shapes."""
    if not all(isinstance(s, int) for s in old + new): return None
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj, pa, pb = i, j, 1, 1
        if i < len(old): pa, i = old[i], i + 1
        if j < len(new): pb, j = new[j], j + 1
        while pa != pb:
            if pa < pb and i < len(old): pa, i = pa * old[i], i + 1
            elif pb < pa and j < len(new): pb, j = pb * new[j], j + 1
            else: return None
        groups.append(((gi, i), (gj, j)))
    return groups

def reshape_index(idxs: tuple[UOp, ...], new: tuple, old: tuple) -> tuple[UOp, ...]:
    """Position in the source shape `old` of element `idxs` of its reshape to `new`, computed within each group of
    regrouped dims: a dim that the reshape leaves alone keeps its index unchanged (so an offset from padding next to
    it stays in that dim instead of spreading into div/mod of the whole flat index)."""
    groups = _reshape_groups(tuple(old), tuple(new))
    if groups is None: return unflatten_index(flat_index(idxs, new), old)
    out: list[UOp] = []
    for (oa, ob), (na, nb) in groups:
        out.extend(unflatten_index(flat_index(idxs[na:nb], new[na:nb]), old[oa:ob]))
    return tuple(out)

def _and(a: UOp | None, b: UOp | None) -> UOp | None:
    if a is None: return b
    if b is None: return a
    return a & b

def movement_index(m: UOp, idxs: tuple[UOp, ...]) -> tuple[tuple[UOp, ...], UOp | None]:
    """For movement op `m` read at `idxs`: the position in `m.src[0]` to read and a validity condition (PAD)."""
    src_shape, arg = m.src[0].shape, m.arg
    if m.op is _RESHAPE: return reshape_index(idxs, m.shape, src_shape), None
    if m.op is _PERMUTE:
        out: list[UOp] = [_idx(0)] * len(arg)
        for i, axis in enumerate(arg): out[axis] = idxs[i]
        return tuple(out), None
    if m.op is _EXPAND:
        return tuple(_idx(0) if s == 1 and n != 1 else i for i, s, n in zip(idxs, src_shape, arg)), None
    if m.op is _SHRINK: return tuple(i + b if b != 0 else i for i, (b, _) in zip(idxs, arg)), None
    if m.op is _FLIP: return tuple((i * -1 + (s - 1)) if f else i for i, f, s in zip(idxs, arg, src_shape)), None
    if m.op is _PAD:
        valid: UOp | None = None
        new = []
        for i, (b, e), s in zip(idxs, arg, src_shape):
            if b == 0 and e == 0: new.append(i); continue
            if b != 0: valid = _and(valid, (i < b).logical_not())
            if e != 0: valid = _and(valid, i < b + s)
            new.append(i - b if b != 0 else i)
        return tuple(new), valid
    raise RuntimeError(f"{m.op} is not a movement op")

@dataclass
class KernelBuilder:
    """Builds the AST of one kernel. `is_input(u)` says where the kernel stops and loads from a buffer instead."""
    is_input: object  # Callable[[UOp], bool]
    globals: list[UOp] = field(default_factory=list)        # tensor-level buffer nodes, in DEFINE_GLOBAL order
    slots: dict[UOp, int] = field(default_factory=dict)     # BUFFER -> its DEFINE_GLOBAL number
    next_axis: int = 0
    memo: dict = field(default_factory=dict)
    params: list[UOp] = field(default_factory=list)          # tensor-level parameters, in kernel parameter order

    def param(self, u: UOp) -> UOp:
        """The kernel parameter for tensor-level parameter `u` (a lifted constant), named by its place among this
        kernel's parameters, so the kernel's AST doesn't depend on the graph around it. Kernels take float parameters
        as double and integers as 64-bit, so a half or bfloat16 one arrives as float32 (exact: its value is a half)."""
        if u not in self.params: self.params.append(u)
        name = (f"_p{self.params.index(u)}", u.arg[1], u.arg[2])
        if u.dtype not in (dtypes.float16, dtypes.bfloat16): return UOp(_DEFINE_VAR, u.dtype, (), name)
        return UOp(_DEFINE_VAR, dtypes.float32, (), name).cast(u.dtype)

    def new_range(self, end: int, kind: str) -> UOp:
        r = UOp.range(end, self.next_axis, kind)
        self.next_axis += 1
        return r

    def define_global(self, buf: UOp) -> UOp:
        """The kernel argument for realized node `buf`: one per memory, so a buffer and a pending kernel's output in
        it are the same argument. The first one defined is argument 0, the output."""
        mem = buffer_node(buf)
        if mem is None: raise RuntimeError(f"{buf.op} is not held in a buffer")
        if mem not in self.slots:
            self.slots[mem] = len(self.globals)
            self.globals.append(buf)
        return UOp(_DEFINE_GLOBAL, buf.dtype.ptr(mem.arg[1]), arg=self.slots[mem])

    def address(self, view: UOp, idxs: tuple[UOp, ...]) -> tuple[UOp, UOp, UOp | None]:
        """(DEFINE_GLOBAL, flat index, valid) of element `idxs` of `view`: movement ops over a realized buffer."""
        valid: UOp | None = None
        while not self.is_input(view):
            if view.op not in GroupOp.Movement: raise RuntimeError(f"can't address {view.op} as a buffer view")
            idxs, v = movement_index(view, idxs)
            valid = _and(valid, v)
            view = view.src[0]
        return self.define_global(view), flat_index(idxs, view.shape), valid

    def value(self, root: UOp, idxs: tuple[UOp, ...]) -> UOp:
        """The kernel-level expression for element `idxs` of tensor node `root`."""
        # an explicit stack instead of recursion: long elementwise chains are thousands of nodes deep
        result: dict[tuple, UOp] = self.memo
        # (node, its index, its valid, its children once they are pushed: found once, as they make index nodes)
        stack: list[tuple[UOp, tuple[UOp, ...], UOp | None, list[tuple] | None]] = [(root, idxs, None, None)]
        while stack:
            u, ix, valid, children = stack.pop()
            key = (u, ix, valid)
            if key in result: continue
            if self.is_input(u):
                g, flat, v = self.address(u, ix)
                full_valid = _and(valid, v)
                ind = g.index(flat, valid=full_valid) if full_valid is not None else g.index(flat)
                result[key] = UOp(_LOAD, u.dtype, (ind,))
                continue
            if u.op is _CONST:
                result[key] = UOp.const(u.dtype, u.arg)
                continue
            if u.op is _RANGE:  # a tensor-level iota: element i is i
                result[key] = ix[0].cast(u.dtype)
                continue
            if u.op is _DEFINE_VAR:  # a lifted constant or a Variable: a kernel parameter
                result[key] = self.param(u) if u.src else u
                continue
            if children is None:
                children = self._children(u, ix, valid)
                stack.append((u, ix, valid, children))
                for c in reversed(children):
                    if (c[0], c[1], c[2]) not in result: stack.append((c[0], c[1], c[2], None))
                continue
            srcs = [result[(c[0], c[1], c[2])] for c in children]
            result[key] = self._combine(u, ix, srcs)
        return result[(root, idxs, None)]

    def _children(self, u: UOp, ix: tuple[UOp, ...], valid: UOp | None) -> list[tuple]:
        if u.op in GroupOp.Movement:
            new_ix, v = movement_index(u, ix)
            if u.op is _PAD: self.memo[("pad", u, ix)] = v
            return [(u.src[0], new_ix, _and(valid, v))]
        if u.op is _REDUCE_AXIS:
            rix = self._reduce_ranges(u, ix)
            return [(u.src[0], rix, valid)]
        # (CONTIGUOUS, ASSIGN, COPY and SCATTER are always realized, so they are never fused into a consumer)
        if u.op in GroupOp.Elementwise: return [(s, ix, valid) for s in u.src]
        raise RuntimeError(f"can't fuse {u.op} into a kernel")

    def _reduce_ranges(self, u: UOp, ix: tuple[UOp, ...]) -> tuple[UOp, ...]:
        # one set of reduce ranges per (reduce node, output position), so a reduce reached twice is one loop
        key = ("reduce", u, ix)
        if key not in self.memo:
            in_shape = u.src[0].shape
            self.memo[key] = tuple((self.new_range(in_shape[a], "reduce") if in_shape[a] != 1 else _idx(0))
                                   if a in u.arg[1] else i for a, i in enumerate(ix))
        return self.memo[key]

    def _combine(self, u: UOp, ix: tuple[UOp, ...], srcs: list[UOp]) -> UOp:
        if u.op in GroupOp.Movement:
            if u.op is _PAD:
                v = self.memo[("pad", u, ix)]
                inner = srcs[0]
                # a gated LOAD already reads 0 outside the pad; anything else (constants, exp, ...) needs the gate
                if v is None or inner.op is _LOAD: return inner
                return v.where(inner, inner.const_like(0))
            return srcs[0]
        if u.op is _REDUCE_AXIS:
            rix = self.memo[("reduce", u, ix)]
            ranges = tuple(r for r in rix if r.op is _RANGE and r.arg[1] == "reduce" and r not in ix)
            return UOp(_REDUCE, u.dtype, (srcs[0],) + ranges, u.arg[0]) if ranges else srcs[0]
        return UOp(u.op, u.dtype, tuple(srcs), u.arg)

