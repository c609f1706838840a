"""The fused-scan rewrite: :func:`fuse_scans` (two sibling scans of equal length as one loop).

Shared by the families that need one loop where the program has two: ``overlap_independent``
(:mod:`rose_jax.optimize.fuse`: loop fusion across components) and ``stream_overlap``'s zipped
loops (:mod:`rose_jax.optimize.stream_overlap`: each step of each loop then on its own stream).
Legality is the caller's; the rewrite itself refuses a second scan that depends on the first.
Built on the rewriting interpreter (:mod:`rose_jax.optimize.interpret`), like every fn-level
transformation.
"""

from __future__ import annotations

from typing import Callable

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.jaxpr import dataflow
from rose_jax.optimize import interpret as I
from rose_jax.optimize.where import Where, site_select


class _FusingInterpreter(I.Interpreter):
    """An interpreter that fuses two sibling scans (chosen by ``pick_a`` / ``pick_b``)."""

    def __init__(self, pick_a, pick_b):
        super().__init__(lambda site: False, None)
        self.pick_a, self.pick_b = pick_a, pick_b
        self.fused = 0

    def contains_target(self, jaxpr, ctx):
        key = (id(jaxpr), ctx.address)
        if key not in self._contains:
            self._contains[key] = self._pair_at(jaxpr, ctx) is not None or any(
                self.contains_target(s, c)
                for i, eqn in enumerate(jaxpr.eqns)
                for s, c in I.subs_with_ctx(ctx, i, eqn)
            )
        return self._contains[key]

    def _pair_at(self, jaxpr, ctx):
        ia = ib = None
        for i, eqn in enumerate(jaxpr.eqns):
            if eqn.primitive.name != C.SCAN:
                continue
            site = I.site_of(ctx, i, eqn)
            if ia is None and self.pick_a(site):
                ia = i
            elif ib is None and self.pick_b(site):
                ib = i
        if ia is None or ib is None:
            return None
        return (ia, ib) if ia < ib else (ib, ia)

    def schedule(self, jaxpr, ctx):
        """Program order, except that the pair's first scan waits for the second and both run as
        one item ``("fused", first, second)``; the equations between them that the second scan
        depends on move before it."""
        pair = self._pair_at(jaxpr, ctx)
        if pair is None:
            return super().schedule(jaxpr, ctx)
        first, second = pair
        eqns = jaxpr.eqns
        if first in dataflow.needed_eqns(eqns, eqns[second].invars, second, start=first):
            raise ValueError("the second scan depends on the first: they cannot be fused")
        needed = dataflow.needed_eqns(eqns, eqns[second].invars, second, start=first + 1)
        return (
            list(range(first))
            + needed
            + [("fused", first, second)]
            + [i for i in range(first + 1, second) if i not in set(needed)]
            + list(range(second + 1, len(eqns)))
        )

    def eval_item(self, jaxpr, item, env, ctx):
        if not isinstance(item, tuple):
            return super().eval_item(jaxpr, item, env, ctx)
        _, ia, ib = item
        ea, eb = jaxpr.eqns[ia], jaxpr.eqns[ib]
        outs_a, outs_b = self._fused_scan(ia, ea, ib, eb, env, ctx)
        I.bind_results(env, ea.outvars, outs_a)
        I.bind_results(env, eb.outvars, outs_b)

    def _fused_scan(self, ia, ea, ib, eb, env, ctx):
        sa, sb = C.scan_params(ea.params), C.scan_params(eb.params)
        if sa.length != sb.length or sa.reverse != sb.reverse:
            raise ValueError("fused scans need equal lengths and directions")
        site_a, site_b = I.site_of(ctx, ia, ea), I.site_of(ctx, ib, eb)
        va = [C.read_atom(env, a) for a in ea.invars]
        vb = [C.read_atom(env, a) for a in eb.invars]

        def parts(s, vals):
            return (
                vals[: s.num_consts],
                vals[s.num_consts : s.num_consts + s.num_carry],
                vals[s.num_consts + s.num_carry :],
            )

        ca, ia_, xa = parts(sa, va)
        cb, ib_, xb = parts(sb, vb)

        def step(carry, x):
            carry_a, carry_b = carry
            x_a, x_b = x
            with I.scopes_of(ea):
                out_a = self.eval(sa.body, sa.body_consts, [*ca, *carry_a, *x_a], site_a.body_ctx)
            with I.scopes_of(eb):
                out_b = self.eval(sb.body, sb.body_consts, [*cb, *carry_b, *x_b], site_b.body_ctx)
            return (out_a[: sa.num_carry], out_b[: sb.num_carry]), (
                out_a[sa.num_carry :],
                out_b[sb.num_carry :],
            )

        I.named(step, f"{site_a.name}+{site_b.name}")
        unroll = max(int(sa.unroll), int(sb.unroll))
        (fa, fb), (ya, yb) = jax.lax.scan(
            step,
            (list(ia_), list(ib_)),
            (list(xa), list(xb)),
            length=sa.length,
            reverse=sa.reverse,
            unroll=unroll,
        )
        self.fused += 1
        return [*fa, *ya], [*fb, *yb]


def fuse_scans(fn: Callable, a: Where, b: Where) -> Callable:
    """``fn`` with the sibling scans matching ``a`` and ``b`` fused into one loop: one ``scan``
    whose body runs both bodies; the equations between them that the second needs move before it.

    See :func:`rose_jax.optimize.fuse.overlap_independent` (``mode="fused"``)."""
    pick_a, pick_b = site_select(a), site_select(b)

    def check(interp):
        if interp.fused == 0:
            raise ValueError(f"overlap_independent: found no sibling scans matching {a!r} and {b!r} to fuse")

    return I.rewriting(fn, lambda: _FusingInterpreter(pick_a, pick_b), check)
