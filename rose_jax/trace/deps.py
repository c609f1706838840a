"""Are two nodes of a LoopTree independent (may they be reordered or overlapped)?

Two nodes at one jaxpr level are independent iff
  1. no value flows from one to the other (through the level's equations, transitively);
  2. neither's ``writes`` meets the other's ``reads`` or ``writes``;
  3. inside a loop body, neither produces the next value of a carry slot that the other reads
     (a loop-carried dependency: ``a`` writes slot k in iteration t, ``b`` reads it in t+1).
Nodes at different levels are compared through their ancestors that are siblings (this needs the
tree): the two branches of a cond never both run (independent), a while's condition and body run
in turn (dependent). A node and its descendant are never independent.
"""

from __future__ import annotations

from rose_jax.jaxpr import dataflow
from rose_jax.trace.tree import LoopTree, Node


def _same_level(a: Node, b: Node) -> list[str]:
    level = a.level
    reasons: list[str] = []
    a_eqns, b_eqns = frozenset(a.eqn_indices), frozenset(b.eqn_indices)
    a_first = min(a.eqn_indices, default=0)
    b_first = min(b.eqn_indices, default=0)
    reach_a = dataflow.forward(level.eqns, a.out_vars, a_first, b_eqns)
    reach_b = dataflow.forward(level.eqns, b.out_vars, b_first, a_eqns)
    if reach_a & b.in_vars:
        reasons.append(f"dataflow: {a.label()} produces values {b.label()} consumes")
    if reach_b & a.in_vars:
        reasons.append(f"dataflow: {b.label()} produces values {a.label()} consumes")
    ab = a.writes & (b.reads | b.writes)
    ba = b.writes & (a.reads | a.writes)
    if ab:
        reasons.append(f"{a.label()} writes {_few(ab)} that {b.label()} reads or writes")
    if ba:
        reasons.append(f"{b.label()} writes {_few(ba)} that {a.label()} reads or writes")
    if level.carry:
        needs_a = dataflow.backward(level.eqns, a.in_vars, max(a.eqn_indices, default=0) + 1)
        needs_b = dataflow.backward(level.eqns, b.in_vars, max(b.eqn_indices, default=0) + 1)
        for x, y, reach_x, needs_y in ((a, b, reach_a, needs_b), (b, a, reach_b, needs_a)):
            slots = [k for k, (cin, cout) in enumerate(level.carry) if cout in reach_x and cin in needs_y]
            if slots:
                direct = any(level.carry[k][0] in y.in_vars for k in slots)
                how = "reads" if direct else "depends on (through other equations)"
                reasons.append(f"loop-carried: {x.label()} writes carry slot(s) {_few(slots, 4)} that "
                               f"{y.label()} {how} in the next iteration")
    return reasons


def _few(items, n: int = 3) -> str:
    items = sorted(items)
    more = f" +{len(items) - n} more" if len(items) > n else ""
    return ", ".join(str(x) for x in items[:n]) + more


def dependency(a: Node, b: Node, tree: LoopTree | None = None) -> str | None:
    """Why ``a`` and ``b`` are not independent (``None`` when they are)."""
    if a is b:
        return "a node depends on itself"
    if any(x is b for x in a.walk()):
        return f"{a.label()} contains {b.label()}"
    if any(x is a for x in b.walk()):
        return f"{b.label()} contains {a.label()}"
    n = min(len(a.index), len(b.index))
    if a.level is not None and a.level is b.level:
        reasons = _same_level(a, b)
        return "; ".join(reasons) if reasons else None
    if tree is None:
        raise ValueError("dependency: nodes at different jaxpr levels need the tree (pass tree=...)")
    common = 0
    while common < n and a.index[common] == b.index[common]:
        common += 1
    lca = tree.node_at(a.index[:common])
    a_top = tree.node_at(a.index[: common + 1])
    b_top = tree.node_at(b.index[: common + 1])
    if a_top.level is not None and a_top.level is b_top.level:
        reasons = _same_level(a_top, b_top)
        if reasons:
            return f"via {a_top.label()} / {b_top.label()}: " + "; ".join(reasons)
        return None
    if lca.kind == "cond" and a_top.part != b_top.part:
        return None  # different branches: at most one of them runs
    if lca.kind == "while":
        return f"{lca.label()}: its condition and body run one after the other"
    return f"{a.label()} and {b.label()} live in different sub-jaxprs of {lca.label()}"


def independent(a: Node, b: Node, tree: LoopTree | None = None) -> bool:
    """True iff ``a`` and ``b`` may be reordered or overlapped (see the module docstring)."""
    return dependency(a, b, tree) is None
