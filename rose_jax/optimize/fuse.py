"""Loop fusion across components: :func:`overlap_independent`, and its :func:`candidates`.

Two independent sibling scans of equal length become one scan whose body runs both bodies: one
loop instead of two, and XLA sees both bodies' work in one kernel schedule. Independence is
decided on the LoopTree (``rose_jax.trace.deps``: dataflow, read/write sets, loop-carried
dependencies); the rewrite is :func:`rose_jax.optimize.fusion.fuse_scans`.
"""

from __future__ import annotations

from typing import Sequence

from rose_jax.jaxpr import compat as C
from rose_jax.optimize.base import EXACT, FUSION_TOLERANCE, Transform
from rose_jax.optimize.fusion import fuse_scans
from rose_jax.optimize.predict import Candidate, CandidateContext, outer_trips, where_of
from rose_jax.optimize.where import find_one
from rose_jax.trace import deps


def overlap_independent(a: str | Sequence[str], b: str | Sequence[str], mode: str = "fused") -> Transform:
    """Run two independent sibling nodes ``a`` and ``b`` side by side.

    ``mode="fused"``: ``a`` and ``b`` are sibling scans with equal trip counts; they become ONE
    scan whose body runs both bodies (loop fusion across components): one loop instead of two,
    and XLA sees both bodies' work in one kernel schedule. Equations that ``b`` needs and that
    sit between the two loops move before the fused loop. ``mode="processes"`` (``b`` in a
    worker process while ``a`` runs here) has its legality check but no implementation: cutting
    ``fn`` at two nodes and shipping one part needs ``jax.export`` serialization of an arbitrary
    cut, which :func:`rose_jax.optimize.offload.offload_component` does for a metrics-only
    component; applying it raises ``ValueError``.

    Legal only when ``rose_jax.trace.deps.independent(a, b)`` (no path from one's writes to the
    other's reads, transitively through the siblings between them) and, for ``fused``, both
    are scans of the same length and direction under the same parent.
    """
    if mode not in ("fused", "processes"):
        raise ValueError(f"overlap_independent: mode must be 'fused' or 'processes', got {mode!r}")
    kinds = ("scan",) if mode == "fused" else ("scan", "while", "component", "call", "cond")

    def legal(tree):
        na, nb = find_one(tree, a, kinds), find_one(tree, b, kinds)
        if na is nb:
            return False, f"{a!r} and {b!r} are the same node"
        same_level = na.level is not None and na.level is nb.level
        if not same_level and (mode == "fused" or na.index[:-1] != nb.index[:-1]):
            return (
                False,
                f"{a!r} and {b!r} are not at the same loop level (not siblings): move one level first",
            )
        why = deps.dependency(na, nb, tree)
        if why is not None:
            return False, f"{a!r} and {b!r} are dependent: {why}"
        why = "no dataflow, disjoint read/write sets, no loop-carried dependency"
        if mode == "fused":
            if na.trip_count is None or na.trip_count != nb.trip_count:
                return (
                    False,
                    f"trip counts differ ({na.trip_count} vs {nb.trip_count}): fusing needs equal lengths",
                )
            ea, eb = na.eqns(), nb.eqns()
            if len(ea) != 1 or len(eb) != 1:
                return False, "fused mode needs each node to be a single scan equation"
            ra, rb = C.scan_params(ea[0].params).reverse, C.scan_params(eb[0].params).reverse
            if ra != rb:
                return False, "one scan runs in reverse and the other does not"
        return True, f"independent ({why})"

    def apply(fn):
        if mode == "processes":
            raise ValueError(
                "overlap_independent(mode='processes') is not implemented (legality is): use mode='fused', "
                "or group_rollout(G, 'processes') for multi-process rollouts"
            )
        return fuse_scans(fn, a, b)

    fused = mode == "fused"
    return Transform(
        "overlap_independent",
        (("a", a), ("b", b), ("mode", mode)),
        FUSION_TOLERANCE if fused else EXACT,
        "fn" if fused else "host",
        legal,
        apply,
        summary=f"fuse the independent scans {a!r} and {b!r} into one loop"
        if fused
        else f"run {b!r} in a worker process while {a!r} runs here",
        wraps_iteration=not fused,  # (processes: a host step around the whole function)
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Every pair of scans of equal length (at least two steps) at the same jaxpr level, fused
    (:func:`overlap_independent`; its legality then checks independence). Model: one loop's
    overhead per loop iteration saved (:data:`rose_jax.optimize.predict.LOOP_OVERHEAD_S`)."""
    tree, overhead = ctx.tree, ctx.loop_overhead_s
    by_level: dict[int, list] = {}
    for n in tree.walk():
        if n.kind == "scan" and n.level is not None and (n.trip_count or 0) >= 2:
            by_level.setdefault(id(n.level), []).append(n)
    out: list[Candidate] = []
    for kids in by_level.values():
        for i, a in enumerate(kids):
            for b in kids[i + 1 :]:
                if a.trip_count == b.trip_count and where_of(a) != where_of(b):
                    gain = a.trip_count * outer_trips(tree, a) * overhead
                    label = f"{where_of(a)}+{where_of(b)}"
                    fuse = overlap_independent(where_of(a), where_of(b))
                    out.append(Candidate(fuse, label, gain, "one loop's overhead per iteration"))
    return out
