"""Loop-level rewrites of scans: :func:`unroll_scans` and :func:`hoist_invariants`, and their
:func:`candidates`.

Both are ``level="fn"`` transformations (jaxpr rewrites through
:mod:`rose_jax.optimize.interpret`) that keep the order of operations; XLA may fuse the rewritten
loop differently, so results are equal up to :data:`~rose_jax.optimize.base.FUSION_TOLERANCE`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rose_jax.jaxpr import compat as C
from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    Candidate,
    CandidateContext,
    candidate_scans,
    moved_out_gain,
    outer_trips,
    scan_of,
    scans_legal,
)
from rose_jax.optimize.where import Where, scan_transform, tree_loops, where_label


def unroll_scans(factor: int | bool, where: Where = None) -> Transform:
    """Rebuild the chosen scans with ``unroll=factor`` (``True``: fully unrolled).

    Cross-loop-level restructuring: ``factor`` steps of the loop run in one iteration of the
    compiled while loop, so XLA pays the per-iteration loop overhead (on GPU: a device-to-host
    copy of the loop predicate per iteration unless XLA converts the loop) ``factor`` times less
    often and can fuse across those steps. Legal for every scan (unrolling keeps the order of
    operations); results equal up to :data:`FUSION_TOLERANCE`.
    """
    if isinstance(factor, bool):
        if not factor:
            raise ValueError("unroll_scans: factor=False unrolls nothing; use an int >= 2 or True")
    elif not isinstance(factor, int) or factor < 2:
        raise ValueError(f"unroll_scans: factor must be an int >= 2 or True, got {factor!r}")

    def legal(tree):
        loops = tree_loops(tree, where)
        if not loops:
            return False, f"no scan matches {where_label(where)}"
        longer = [n for n in loops if n.trip_count is None or factor is True or n.trip_count > 1]
        if not longer:
            return False, "every matching scan has a single iteration: nothing to unroll"
        names = ", ".join(sorted({"/".join(n.component_path + (n.name,)) for n in loops}))
        return True, f"unrolling keeps the order of operations; {len(loops)} scan(s): {names}"

    def on_scan(site, scan, invals, interp):
        unroll = factor if factor is True else min(int(factor), max(scan.length, 1))
        return interp.rebuild_scan(scan, invals, site.body_ctx, unroll=unroll)

    return scan_transform(
        "unroll_scans",
        (("factor", factor), ("where", where)),
        FUSION_TOLERANCE,
        where,
        legal,
        on_scan,
        summary=f"unroll the scan(s) at {where_label(where)} by {factor}",
    )


# -------------------------------------------------------------------------- hoist_invariants

# Shape-only equations: hoisting them would only materialise (e.g. broadcast) arrays that XLA
# fuses into their consumers anyway, so they stay in the loop unless a hoisted equation needs them.
_CHEAP = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "convert_element_type",
        "squeeze",
        "expand_dims",
        "iota",
        "copy",
        "copy_p",
        "transpose",
        "rev",
        "slice",
        "pjit_identity",
    }
)


class _Invariants(NamedTuple):
    """A scan's loop-invariant equations, for :func:`~rose_jax.optimize.predict.scans_legal`."""

    eqns: frozenset[int]

    @property
    def moves(self) -> bool:
        return bool(self.eqns)

    @property
    def why(self) -> str:
        return "" if self.eqns else "no loop-invariant equations: nothing to hoist"

    @classmethod
    def of(cls, scan: C.ScanParams) -> _Invariants:
        return cls(invariant_eqns(scan))


def invariant_eqns(scan: C.ScanParams) -> frozenset[int]:
    """Indices of body equations that depend only on the loop's constants (and are worth hoisting).

    An equation is invariant when it has no effects and every operand is a literal, a body
    const, one of the scan's ``num_consts`` constant operands, or an invariant equation's
    result. Invariant shape-only equations (:data:`_CHEAP`) whose results feed only the loop
    stay in it.
    """
    body = scan.body
    inv = set(body.constvars) | set(body.invars[: scan.num_consts])
    hoist: list[int] = []
    for i, eqn in enumerate(body.eqns):
        if C.has_effects(eqn):
            continue
        if all(C.is_literal(a) or a in inv for a in eqn.invars):
            hoist.append(i)
            inv.update(v for v in eqn.outvars if not C.is_dropvar(v))
    chosen = set(hoist)
    readers: dict[Any, set[int]] = {}
    for i, eqn in enumerate(body.eqns):
        for a in eqn.invars:
            if not C.is_literal(a):
                readers.setdefault(a, set()).add(i)
    for i in reversed(hoist):
        eqn = body.eqns[i]
        if eqn.primitive.name not in _CHEAP:
            continue
        needed_outside = any(r in chosen for v in eqn.outvars for r in readers.get(v, ()))
        if not needed_outside:
            chosen.discard(i)
    return frozenset(chosen)


def hoist_invariants(where: Where = None) -> Transform:
    """Move loop-invariant equations (pure, reading only the scan's constants) out of scans.

    Cross-loop-level move: the equations run once before the loop instead of every iteration;
    the loop reads their results as constants. Legal when such equations exist (they are pure
    and read no carry and no per-iteration input, by construction). Note that XLA's own
    while-loop invariant code motion already hoists much of this at compile time, so the gain is
    often zero: measured numbers decide.
    """

    def legal(tree):
        return scans_legal(
            tree,
            where,
            _Invariants.of,
            lambda inv, scan: f"{len(inv.eqns)} loop-invariant equations",
            "pure equations reading only loop constants; ",
        )

    def on_scan(site, scan, invals, interp):
        chosen = invariant_eqns(scan)
        if not chosen:
            return interp.rebuild_scan(scan, invals, site.body_ctx)
        body = scan.body
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars[: scan.num_consts], invals[: scan.num_consts], strict=True))
        interp.run(body, sorted(chosen), env, site.body_ctx)  # evaluated here, outside the loop
        hoisted = {v: env[v] for i in chosen for v in body.eqns[i].outvars if not C.is_dropvar(v)}
        return interp.rebuild_scan(scan, invals, site.body_ctx, hoisted=hoisted, skip=chosen)

    return scan_transform(
        "hoist_invariants",
        (("where", where),),
        FUSION_TOLERANCE,
        where,
        legal,
        on_scan,
        summary=f"hoist loop-invariant equations out of the scan(s) at {where_label(where)}",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan of at least two steps (those in a profiled window; without windows every one),
    most expensive first: :func:`unroll_scans` by each of ``ctx.unroll_factors`` and, where its
    body has invariant equations, :func:`hoist_invariants`.

    Models (seconds per iteration): unrolling saves ``trips * (1 - 1/f) * loop overhead``
    (:data:`rose_jax.optimize.predict.LOOP_OVERHEAD_S`); hoisting saves the invariant share of
    the loop's time.
    """
    tree, overhead = ctx.tree, ctx.loop_overhead_s
    out: list[Candidate] = []
    for node, where in candidate_scans(ctx):
        trips = node.trip_count * outer_trips(tree, node)
        for f in ctx.unroll_factors:
            if f >= 2 and f <= node.trip_count:
                gain = trips * (1.0 - 1.0 / f) * overhead
                out.append(
                    Candidate(
                        unroll_scans(f, where),
                        where,
                        gain,
                        f"{trips} loop iterations x (1-1/{f}) x {overhead * 1e6:.0f}us loop overhead",
                    )
                )
        scan = scan_of(node)
        if scan is not None:
            n_inv = len(invariant_eqns(scan))
            if n_inv:
                gain = moved_out_gain(ctx, node, n_inv, len(scan.body.eqns))
                out.append(
                    Candidate(
                        hoist_invariants(where),
                        where,
                        gain,
                        f"{n_inv}/{len(scan.body.eqns)} body equations invariant x loop time",
                    )
                )
    return out
