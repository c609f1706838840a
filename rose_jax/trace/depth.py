"""How much of a loop body must run one operation after another: its longest dependency chain.

A latency-bound loop (SAC's high-update gradient step: ~200 us for ~1-2 GFLOP) is paced by the
chain of kernels each waiting for the one before, not by its arithmetic. Fusing, batching or
overlapping its independent work cannot make it shorter than that chain. ``chain(jaxpr)`` counts
it on the jaxpr, before XLA: the equations and matrix products of the body, and the most of each
on one path from its inputs to its outputs (XLA fuses elementwise equations into their neighbours,
so the kernels on the path are fewer than its equations, but each matrix product stays a kernel of
its own, so ``longest_matmuls`` is a floor on the kernels in series)::

    c = rose_jax.trace.depth.chain(jax.make_jaxpr(step)(state))
    c.longest_matmuls, c.matmuls  # e.g. 12 of 48 for Brax's SAC hopper gradient step

Nested calls (``pjit``, custom derivatives, remat) count as their equations inline; a nested loop
as its body's chain times its trip count (its iterations run one after another); a ``cond`` as its
longest branch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rose_jax.jaxpr import compat as C

MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
_LOOPS = frozenset({"scan", "while"})


class Chain(NamedTuple):
    """One execution of a jaxpr: ``ops`` equations (nested ones counted inline, a loop's body once
    per trip) of which ``matmuls`` matrix products, and the most equations (``longest_ops``) and
    matrix products (``longest_matmuls``) on one dependency path through it."""

    ops: int
    matmuls: int
    longest_ops: int
    longest_matmuls: int

    def describe(self) -> str:
        """``'a chain of 88 of its 718 operations, 12 of its 48 matrix products in series'``."""
        return (f"a chain of {self.longest_ops} of its {self.ops} operations, {self.longest_matmuls} of its "
                f"{self.matmuls} matrix products in series")


def _trips(eqn: Any) -> int:
    if eqn.primitive.name == "scan":
        return int(C.scan_params(eqn.params).length)
    from rose_jax.trace.build import while_trip_count

    return while_trip_count(eqn) or 1


def _in_series(chains: list[Chain]) -> Chain:
    """Jaxprs run one after another (a loop's condition and body): every count adds up."""
    return Chain(*(sum(c[i] for c in chains) for i in range(4)))


def _eqn(eqn: Any) -> Chain:
    """The chain one equation adds where its operands are ready."""
    name = eqn.primitive.name
    subs = C.sub_jaxprs(eqn.params)
    if not subs:
        mm = int(name in MATMULS)
        return Chain(1, mm, 1, mm)
    inner = [chain(j) for j in subs]
    if name in _LOOPS:  # the body (and a while's condition) once per trip, one trip after another
        k = _trips(eqn)
        total = _in_series(inner)
        return Chain(total.ops * k, total.matmuls * k, total.longest_ops * k, total.longest_matmuls * k)
    if name == "cond":  # one branch runs: the longest
        return Chain(max(c.ops for c in inner), max(c.matmuls for c in inner),
                     max(c.longest_ops for c in inner), max(c.longest_matmuls for c in inner))
    # a call (pjit, custom_jvp_call, custom_vjp_call, remat, ...): its equations inline; its
    # outputs are taken to wait for its longest path (an upper bound where they do not all)
    return Chain(sum(c.ops for c in inner), sum(c.matmuls for c in inner),
                 max(c.longest_ops for c in inner), max(c.longest_matmuls for c in inner))


def chain(jaxpr: Any) -> Chain:
    """The :class:`Chain` of a (closed or open) jaxpr: each equation starts when the latest of its
    operands is ready (counted in equations and in matrix products, each separately)."""
    j = C.open_jaxpr(jaxpr)
    ready_ops: dict[Any, int] = {}
    ready_mm: dict[Any, int] = {}
    ops = mms = best_ops = best_mm = 0
    for eqn in j.eqns:
        own = _eqn(eqn)
        ins = [v for v in eqn.invars if C.is_var(v)]
        start_ops = max((ready_ops.get(v, 0) for v in ins), default=0)
        start_mm = max((ready_mm.get(v, 0) for v in ins), default=0)
        end_ops, end_mm = start_ops + own.longest_ops, start_mm + own.longest_matmuls
        for v in eqn.outvars:
            ready_ops[v], ready_mm[v] = end_ops, end_mm
        ops, mms = ops + own.ops, mms + own.matmuls
        best_ops, best_mm = max(best_ops, end_ops), max(best_mm, end_mm)
    return Chain(ops, mms, best_ops, best_mm)


def loop_chains(tree: Any) -> list[tuple[str, int | None, Chain]]:
    """``(loop path, trip count, its body's chain for one trip)`` of every loop of a
    :class:`~rose_jax.trace.LoopTree` (``rose_jax.trace.trace``), hottest first (by the loop's
    flops per execution of the traced function)."""
    found = []
    for node, path in _loops(tree.root, ()):
        bodies = [lv.jaxpr for lv in node.bodies]
        if not bodies:
            continue
        body = _in_series([chain(b) for b in bodies])
        found.append((node.cost.flops, "/".join(path), node.trip_count, body))
    found.sort(key=lambda x: -x[0])
    return [(p, k, c) for _, p, k, c in found]


def _loops(node: Any, path: tuple[str, ...]):
    for child in node.children:
        here = path + (child.name,)
        if child.is_loop:
            yield child, here
        yield from _loops(child, here)
