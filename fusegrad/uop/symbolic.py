"""Symbolic integer and boolean simplification (placeholder: constant folding only, replaced by the full rules)."""
from fusegrad.uop.ops import GroupOp, Ops, UOp, exec_alu
from fusegrad.uop.pattern import PatternMatcher, UPat

def _fold(a: UOp) -> UOp | None:
    if all(s.op is Ops.CONST for s in a.src): return UOp.const(a.dtype, exec_alu(a.op, a.dtype, tuple(s.arg for s in a.src)))
    return None

symbolic = PatternMatcher([(UPat(GroupOp.ALU, name="a"), _fold)], name="symbolic")
