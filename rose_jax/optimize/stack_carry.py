"""stack_carries: a scan's small carried values of one dtype and shape carried as one stacked array.

Why: XLA writes a loop's carried values in place, and where the body reads an old value beside
writing new ones that other writes depend on (a simultaneous update: each new value reads several
old ones), its copy insertion copies the old values at the top of every step, one copy per value.
MuJoCo MJX's constraint-solver line search is such a loop: a 50-step ``lax.scan`` of
``lax.cond(flag, iterate, no-op)`` steps, which ``vmap`` turns into ``select(flag, new, old)`` on
every carried value, so every step copies each of its eight ``f32[envs]`` line-search scalars
(``benchmarks/results/sac_floor``: 8 copies per step, 1,889-6,773 copies per environment step of
Brax's MJX hopper at 128 environments, by the solver's 1-4 iterations; the SAC hopper miss's kernel
trace shows 7,633 physics kernels per iteration, 5.7 ms of them ``memcpy32_post`` copies, H100).
Each copy is a kernel of its own, about a microsecond of a latency-bound loop.

What: the carried values of a scan that the body writes (not passed through unchanged), of rank
at most ``max_rank`` (1: a scalar per environment under ``vmap``) and at most ``max_elements``
elements each, booleans left out (a loop's flags stay carries of their own, for
:func:`~rose_jax.optimize.exit_idle_loops`), grouped by dtype and shape; each group of two or more
is carried as one array stacked on a new leading axis (``jnp.stack`` before the loop and at the end
of each step; indexing at the start of each step and after the loop). The body computes the same
operations on the same values; only how the values are held between steps changes, so XLA copies a
group once (or not at all) where it copied each member.

Measured (H100, 2026-12-07 21:42, ``benchmarks/results/beyond_flags``, SAC hopper's iteration in
one process): the physics went from 7,900 to 5,874 kernels and from 12.1 to 7.5 ms of kernel time,
bitwise equal, and **the iteration ran 0.95x** (within the timing spread; stacking every scan, the
gradient step's small values too, 0.92x). The copies it removes run side by side at the top of a
step, beside its chain of dependent kernels, which keeps one level of copies either way; so the
candidate model saves nothing (:data:`PARALLEL_COPY_SHARE`) and the search does not offer it.

Legality: a scan at ``where`` with such a group, whose body has no effects; others are refused with
the reason. Tolerance: the same operations in the same order; XLA fuses the body around the
stacking differently, hence :data:`~rose_jax.optimize.base.FUSION_TOLERANCE` (the equality check
shows bitwise per program).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rose_jax.jaxpr import compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.predict import COPY_S, Candidate, CandidateContext, scans_legal, split_scans
from rose_jax.optimize.where import Where, scan_transform, where_label

# The share of a removed copy's time that the iteration saves. The copies at the top of a step run
# side by side (each reads one carried value), so the step's chain of dependent kernels keeps one
# level of copies whether XLA copies one stacked group or each member. Measured (H100, 2026-12-07
# 21:42, benchmarks/results/beyond_flags): on Brax's MJX hopper line search in the SAC iteration,
# stacking took the physics from 7,900 to 5,874 kernels and 12.1 to 7.5 ms of kernel time, bitwise
# equal, and the iteration ran 0.95x (stacking every scan, the gradient step's too: 0.92x). So the
# model saves nothing, and the search offers no candidate until a measurement says otherwise.
PARALLEL_COPY_SHARE = 0.0
# Carried values larger than this, or of a higher rank, are left alone: stacking copies them once
# per step, which pays for the scalars per environment of a line search (rank 1 under vmap), not
# for a network's weights; and stacking the arrays of MJX's state in its substep scan changes how
# XLA fuses the physics (on the CPU, Brax's MJX hopper state moved by up to 1.5e-4 over 3 steps
# where stacking the line search alone left it bitwise equal; benchmarks/results/sac_floor).
DEFAULT_MAX_ELEMENTS = 1 << 14
DEFAULT_MAX_RANK = 1


def carry_groups(
    scan: C.ScanParams, max_elements: int = DEFAULT_MAX_ELEMENTS, max_rank: int = DEFAULT_MAX_RANK
) -> list[list[int]]:
    """Groups (carry indices, two or more each) of the carried values the body writes, of at most
    ``max_elements`` elements and rank ``max_rank``, by dtype and shape, in carry order. Boolean
    values are left out: a loop's flags stay carries of their own, which
    :func:`~rose_jax.optimize.exit_idle_loops` reads (stacked first, the line search could no longer
    stop early)."""
    ins = scan.body.invars[scan.num_consts : scan.num_consts + scan.num_carry]
    outs = scan.body.outvars[: scan.num_carry]
    groups: dict[tuple, list[int]] = {}
    for k, (v, o) in enumerate(zip(ins, outs, strict=True)):
        if C.is_var(o) and o is v:  # passed through unchanged: never written, never copied
            continue
        aval = v.aval
        if aval.dtype == np.bool_:  # flags stay their own carries: exit_idle_loops stops on one
            continue
        if len(aval.shape) > max_rank or int(np.prod(aval.shape, dtype=np.int64)) > max_elements:
            continue
        groups.setdefault((np.dtype(aval.dtype).str, tuple(aval.shape)), []).append(k)
    return [g for g in groups.values() if len(g) >= 2]


class _Split:
    """``scans_legal``'s view of one scan: moves when it has a group to stack."""

    def __init__(self, scan: C.ScanParams, max_elements: int = DEFAULT_MAX_ELEMENTS,
                 max_rank: int = DEFAULT_MAX_RANK):
        if any(C.has_effects(e) for e in scan.body.eqns):
            self.groups, self.why = [], "its body has effects"
        else:
            self.groups = carry_groups(scan, max_elements, max_rank)
            self.why = "" if self.groups else (
                f"no two written carried values of one dtype and shape (of rank <= {max_rank} and at most "
                f"{max_elements} elements)")
        self.moves = bool(self.groups)


def _describe(groups: list[list[int]], scan: C.ScanParams) -> str:
    ins = scan.body.invars[scan.num_consts :]
    return ", ".join(f"{len(g)} x {ins[g[0]].aval.str_short()}" for g in groups)


def stack_carries(
    where: Where = None, max_elements: int = DEFAULT_MAX_ELEMENTS, max_rank: int = DEFAULT_MAX_RANK
) -> Transform:
    """Transform: each scan at ``where`` carries its written values of one dtype and shape (at most
    ``max_elements`` elements and rank ``max_rank`` each) stacked as one array. See the module
    docstring."""
    if not isinstance(max_elements, int) or isinstance(max_elements, bool) or max_elements < 1:
        raise ValueError(f"stack_carries: max_elements must be an int >= 1, got {max_elements!r}")
    if not isinstance(max_rank, int) or isinstance(max_rank, bool) or max_rank < 0:
        raise ValueError(f"stack_carries: max_rank must be an int >= 0, got {max_rank!r}")

    def legal(tree) -> tuple[bool, str]:
        return scans_legal(
            tree,
            where,
            lambda scan: _Split(scan, max_elements, max_rank),
            lambda s, scan: f"carried stacked: {_describe(s.groups, scan)}",
            "the body's operations unchanged, its values held stacked between steps; ",
        )

    def on_scan(site, scan, invals, interp):
        groups = _Split(scan, max_elements, max_rank).groups
        if not groups:
            return interp.rebuild_scan(scan, invals, site.body_ctx)
        nc, ncarry = scan.num_consts, scan.num_carry
        consts, init, xs = invals[:nc], list(invals[nc : nc + ncarry]), invals[nc + ncarry :]
        grouped = {k for g in groups for k in g}
        rest = [k for k in range(ncarry) if k not in grouped]

        def pack(carry):
            return [jnp.stack([carry[k] for k in g]) for g in groups], [carry[k] for k in rest]

        def unpack(stacked, others):
            carry: list[Any] = [None] * ncarry
            for g, s in zip(groups, stacked, strict=True):
                for j, k in enumerate(g):
                    carry[k] = s[j]
            for k, v in zip(rest, others, strict=True):
                carry[k] = v
            return carry

        def step(packed, x):
            outs = interp.eval(scan.body, scan.body_consts, [*consts, *unpack(*packed), *x], site.body_ctx)
            return pack(outs[:ncarry]), outs[ncarry:]

        I.named(step, I.body_name(scan.body, C.SCAN))
        packed, ys = jax.lax.scan(step, pack(init), list(xs), length=scan.length, reverse=scan.reverse,
                                  unroll=scan.unroll)
        return [*unpack(*packed), *ys]

    return scan_transform(
        "stack_carries",
        (("where", where), ("max_elements", max_elements), ("max_rank", max_rank)),
        FUSION_TOLERANCE,
        where,
        legal,
        on_scan,
        summary=f"carry the written small values of the scan(s) at {where_label(where)} stacked by dtype "
        "and shape",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan with a group to stack (most expensive first): :func:`stack_carries` there.

    Model (seconds per iteration): per step, the copies of a group's members but one saved, less
    one stacking kernel per group, each worth :data:`PARALLEL_COPY_SHARE` of a copy's time,
    ``trips x sum(len(group) - 2) x`` :data:`COPY_S` ``x`` :data:`PARALLEL_COPY_SHARE`; offered where
    that is positive (none at the measured share: the copies removed ran beside the step's chain)."""
    out: list[Candidate] = []
    per_copy = COPY_S.get(ctx.platform, COPY_S["gpu"]) * PARALLEL_COPY_SHARE
    for _, where, split, trips in split_scans(ctx, _Split):
        saved = sum(len(g) - 2 for g in split.groups)
        if saved <= 0 or per_copy <= 0:
            continue
        out.append(
            Candidate(
                stack_carries(where),
                where,
                trips * saved * per_copy,
                f"{trips} steps x {saved} copies saved ({', '.join(str(len(g)) for g in split.groups)} "
                f"values stacked, one copy and one stacking kernel left per group) x "
                f"{per_copy * 1e6:.1f}us per copy",
            )
        )
    return out
