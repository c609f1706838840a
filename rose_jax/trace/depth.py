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
    c.longest_kernels             # the operations on that path that are a kernel of their own

``kernels`` / ``longest_kernels`` count the operations XLA's GPU compiler does not fuse into the
kernel of the operation they feed (:data:`KERNEL_OPS`: matrix products, reductions, scatters,
sorts, cumulative sums, linear algebra): each ends a fusion, and the elementwise work around it
fuses into it or into the next one, so the kernels one after another on a path are about
``longest_kernels`` (an estimate from XLA's fusion rules, which can merge sibling reductions or
split an operation in two; the matrix-product count stays the floor).

Nested calls (``pjit``, custom derivatives, remat) count as their equations inline; a nested loop
as its body's chain times its trip count (its iterations run one after another); a ``cond`` as its
longest branch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rose_jax.jaxpr import compat as C

MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
# Operations that end a fusion in XLA's GPU compiler (a kernel of their own, with elementwise
# producers fused in): the matrix products and the primitives below.
KERNEL_OPS = MATMULS | frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
    "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
    "sort", "top_k", "scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
    "select_and_scatter_add", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "reduce_window",
    "cholesky", "triangular_solve", "lu", "qr", "eigh", "svd", "householder_product", "fft",
})
_LOOPS = frozenset({"scan", "while"})


class Chain(NamedTuple):
    """One execution of a jaxpr: ``ops`` equations (nested ones counted inline, a loop's body once
    per trip) of which ``matmuls`` matrix products and ``kernels`` kernels of their own
    (:data:`KERNEL_OPS`), and the most equations (``longest_ops``), matrix products
    (``longest_matmuls``) and kernels (``longest_kernels``) on one dependency path through it (each
    counted on its own longest path)."""

    ops: int
    matmuls: int
    longest_ops: int
    longest_matmuls: int
    kernels: int = 0
    longest_kernels: int = 0

    def describe(self) -> str:
        """``'a chain of 88 of its 718 operations, 12 of its 48 matrix products and 30 of its 140
        kernels in series'``."""
        return (f"a chain of {self.longest_ops} of its {self.ops} operations, {self.longest_matmuls} of its "
                f"{self.matmuls} matrix products and {self.longest_kernels} of its {self.kernels} kernels "
                "in series")


def _trips(eqn: Any) -> int:
    if eqn.primitive.name == "scan":
        return int(C.scan_params(eqn.params).length)
    from rose_jax.trace.build import while_trip_count

    return while_trip_count(eqn) or 1


_TOTALS = ("ops", "matmuls", "kernels")
_LONGEST = ("longest_ops", "longest_matmuls", "longest_kernels")


def _in_series(chains: list[Chain]) -> Chain:
    """Jaxprs run one after another (a loop's condition and body): every count adds up."""
    return Chain(*(sum(c[i] for c in chains) for i in range(len(Chain._fields))))


def _scaled(c: Chain, k: int) -> Chain:
    return Chain(*(v * k for v in c))


def _eqn(eqn: Any) -> Chain:
    """The chain one equation adds where its operands are ready."""
    name = eqn.primitive.name
    subs = C.sub_jaxprs(eqn.params)
    if not subs:
        mm, kn = int(name in MATMULS), int(name in KERNEL_OPS)
        return Chain(1, mm, 1, mm, kn, kn)
    inner = [chain(j) for j in subs]
    if name in _LOOPS:  # the body (and a while's condition) once per trip, one trip after another
        return _scaled(_in_series(inner), _trips(eqn))
    if name == "cond":  # one branch runs: the longest
        return Chain(**{f: max(getattr(c, f) for c in inner) for f in Chain._fields})
    # a call (pjit, custom_jvp_call, custom_vjp_call, remat, ...): its equations inline; its
    # outputs are taken to wait for its longest path (an upper bound where they do not all)
    return Chain(**{f: sum(getattr(c, f) for c in inner) for f in _TOTALS},
                 **{f: max(getattr(c, f) for c in inner) for f in _LONGEST})


def chain(jaxpr: Any) -> Chain:
    """The :class:`Chain` of a (closed or open) jaxpr: each equation starts when the latest of its
    operands is ready (counted in equations, matrix products and kernels, each separately)."""
    j = C.open_jaxpr(jaxpr)
    ready: dict[Any, tuple[int, ...]] = {}  # var -> its longest path so far, per measure of _LONGEST
    totals = [0] * len(_TOTALS)
    best = [0] * len(_LONGEST)
    for eqn in j.eqns:
        own = _eqn(eqn)
        ins = [ready.get(v, (0,) * len(_LONGEST)) for v in eqn.invars if C.is_var(v)]
        end = tuple(max((r[i] for r in ins), default=0) + getattr(own, f) for i, f in enumerate(_LONGEST))
        for v in eqn.outvars:
            ready[v] = end
        totals = [t + getattr(own, f) for t, f in zip(totals, _TOTALS, strict=True)]
        best = [max(b, e) for b, e in zip(best, end, strict=True)]
    return Chain(**dict(zip(_TOTALS, totals, strict=True)), **dict(zip(_LONGEST, best, strict=True)))


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
