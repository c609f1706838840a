"""Carried state updated in place: a scan body's reads of its old carry ordered before the
elementwise updates that overwrite it (:func:`update_in_place`, and its :func:`candidates`).

A gradient step reads the parameters as they were before the step in several places (SAC: the
alpha, critic and actor losses all read the old actor and critic parameters; PPO: the policy and
value losses) and ends with elementwise work that writes the new ones over the old (Adam's
moments and ``p + u``, Polyak averaging, counters). XLA's while loop keeps one buffer per carried
leaf and writes the new value into it in place, but only when every other read of the old value
is known to happen first. The data dependencies do not say so (the actor loss's read of the old
critic does not precede the critic's update), so XLA's copy insertion copies every such leaf at
the top of each iteration: on the H200, SAC hopper's high-update loop spent 4.5 ms of a 16.4 ms
iteration in ``memcpy32_post`` copy kernels, one per carried parameter leaf per gradient step.

:func:`split_tail` partitions a scan body into

* **T, the update tail**: working backwards from the carried outputs, every pure elementwise
  equation (or shape-only one, or a jit call made of them) whose results only go to the carry or
  to other tail equations: the optimizer's moment and parameter updates, Polyak averaging,
  counters;
* **A**: the rest (losses, gradients, sampling, anything with effects).

The rebuilt body runs A, then one ``jax.lax.optimization_barrier``, then T, which reads the old
carried values back through the barrier. The barrier holds those old values and the first
results XLA materialises of A's reads of them (following elementwise work, which XLA would fuse
into its consumers, to the dots, reductions and gathers it feeds): every read of an old value is
now an ancestor of the barrier and every in-place write a descendant, so the order XLA's copy
insertion needs is in the data, while T's other inputs stay fusible with their producers.
(``mode="tail"`` puts every value of A that T reads through the barrier instead: simpler, but
on the H100 it cost more fused kernels than the copies it saved in Brax hopper's physics loop.)

Legality: A never reads T (by construction T's results go only to T and to the carry), so
running A first is the same computation. Refused with the reason when no carried output ends in
elementwise work or when no old carried value is read outside the tail (nothing is copied).
Tolerance: the same operations on the same values in an order the data allowed already; XLA may
fuse T's work with A's producers differently (the barrier forbids fusing across it), which can
move an FMA contraction: :data:`rose_jax.optimize.base.FUSION_TOLERANCE`. The equality check
shows bitwise equality per program where it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from rose_jax.jaxpr import compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import FUSION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    COPY_S,
    Candidate,
    CandidateContext,
    split_scan_transform,
    split_scans,
)
from rose_jax.optimize.where import Where, where_label

# Pure elementwise primitives (and shape-only ones, which XLA fuses into them): what an optimizer's
# update tail is made of. Anything else (dots, reductions, gathers, RNG, loops) stays in A.
ELEMENTWISE = frozenset(
    {
        "abs", "add", "add_any", "and", "atan2", "ceil", "clamp", "convert_element_type", "copy",
        "copy_p", "cos", "div", "eq", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
        "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
        "nextafter", "not", "or", "pow", "rem", "round", "rsqrt", "select_n", "sign", "sin",
        "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
        # shape-only: fused into their elementwise consumers
        "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "pjit_identity",
    }
)  # fmt: skip

# What each read result held by the barrier costs, as a share of one copy: the fusions XLA can no
# longer make across the barrier. Calibrated on the H100 (benchmarks/results/beyond_flags,
# 2026-12-05): with it, none of the measured loops is predicted to gain, as none did: SAC
# hopper's gradient step (30 copies saved, 78 read results held: 1.02x, within the spread),
# Brax hopper's physics loop (8 and 49: memcpy kernels -6 ms, other fusions +7 ms: 0.90x), MJX
# ant PPO's rollout step (0.75x).
BARRIER_VALUE_SHARE = 0.4


def _tail_eqn(eqn: Any) -> bool:
    """Pure elementwise work (or a jit call of only such work)."""
    if C.has_effects(eqn):
        return False
    name = eqn.primitive.name
    if name in ELEMENTWISE:
        return True
    if name in C.PLAIN_CALL_PRIMITIVES:
        return all(_tail_eqn(e) for e in C.call_jaxpr(eqn.params)[0].eqns)
    return False


@dataclasses.dataclass(frozen=True)
class TailSplit:
    """How :func:`split_tail` partitions one scan body (indices into ``scan.body.eqns``).

    ``a_eqns`` / ``t_eqns``: the equations run before / after the barrier; ``in_place``: the
    carry positions whose old value A reads and T overwrites (what XLA copied); ``barrier``: the
    barrier's operands, body variables: for ``mode="reads"`` the old values of ``in_place`` (T
    reads them back through the barrier) and the first materialised results of A's reads of them
    (``reads``); for ``mode="tail"`` every value of A that T reads or the body returns;
    ``why``: a sentence when there is nothing to order."""

    a_eqns: tuple[int, ...]
    t_eqns: tuple[int, ...]
    barrier: tuple[Any, ...]
    in_place: tuple[int, ...]
    mode: str = "reads"
    why: str = ""

    @property
    def moves(self) -> bool:
        return not self.why


MODES = ("reads", "tail")


def split_tail(scan: C.ScanParams, mode: str = "reads") -> TailSplit:
    """Partition ``scan``'s body into A and the update tail T (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"update_in_place: mode must be one of {MODES}, got {mode!r}")
    body = scan.body
    nc, nk = scan.num_consts, scan.num_carry
    carry_in = list(body.invars[nc : nc + nk])
    carry_out = body.outvars[:nk]
    ys_out = body.outvars[nk:]
    carry_out_vars = {v for v in carry_out if C.is_var(v)}
    ys_vars = {v for v in ys_out if C.is_var(v)}
    readers: dict[Any, set[int]] = {}
    for i, eqn in enumerate(body.eqns):
        for a in eqn.invars:
            if C.is_var(a):
                readers.setdefault(a, set()).add(i)

    tail: set[int] = set()
    for i in range(len(body.eqns) - 1, -1, -1):
        eqn = body.eqns[i]
        if not _tail_eqn(eqn):
            continue
        outs = [v for v in eqn.outvars if C.is_var(v) and not C.is_dropvar(v)]
        if not outs:
            continue
        if all(
            v not in ys_vars and (v in carry_out_vars or readers.get(v)) and readers.get(v, set()) <= tail
            for v in outs
        ):
            tail.add(i)

    a_eqns = tuple(i for i in range(len(body.eqns)) if i not in tail)
    t_eqns = tuple(sorted(tail))
    a_defined = {v for i in a_eqns for v in body.eqns[i].outvars if C.is_var(v)}
    t_defined = {v for i in t_eqns for v in body.eqns[i].outvars if C.is_var(v)}
    in_place = tuple(
        k
        for k in range(nk)
        if C.is_var(carry_out[k])
        and carry_out[k] in t_defined
        and any(r not in tail for r in readers.get(carry_in[k], ()))
    )
    if not t_eqns or not in_place:  # nothing to order: no barrier to build
        why = (
            "no carried output is computed by elementwise work at the end of the body: no update tail"
            if not t_eqns
            else "no old carried value is read outside the update tail: XLA already updates the carry "
            "in place, nothing to order"
        )
        return TailSplit(a_eqns, t_eqns, (), in_place, mode, why)
    wanted: list[Any] = []
    if mode == "tail":
        for i in t_eqns:
            wanted.extend(a for a in body.eqns[i].invars if C.is_var(a) and a in a_defined)
        wanted.extend(v for v in body.outvars if C.is_var(v) and v in a_defined)
    else:
        # the old values, then what A's reads of them produce, followed past elementwise and
        # shape-only work (which XLA fuses into its consumers) to the first results XLA
        # materialises anyway (dots, reductions, gathers, loops), so the barrier keeps fusions
        wanted.extend(carry_in[k] for k in in_place)
        # frontier of each A equation, in reverse order (its readers come later in the body)
        front: dict[int, tuple[Any, ...]] = {}
        for i in range(len(body.eqns) - 1, -1, -1):
            if i in tail:
                continue
            eqn = body.eqns[i]
            outs = [v for v in eqn.outvars if C.is_var(v) and not C.is_dropvar(v)]
            nxt = sorted({r for v in outs for r in readers.get(v, ())})
            returned = any(v in ys_vars or v in carry_out_vars for v in outs)
            if _tail_eqn(eqn) and nxt and not returned:
                f = [u for r in nxt if r not in tail for u in front[r]]
                if any(r in tail for r in nxt):
                    f = outs + f
                front[i] = tuple(dict.fromkeys(f))
            else:
                front[i] = tuple(outs) if (nxt or returned) else ()
        for k in in_place:
            for r in sorted(readers.get(carry_in[k], ())):
                if r not in tail:
                    wanted.extend(front[r])
    return TailSplit(a_eqns, t_eqns, tuple(dict.fromkeys(wanted)), in_place, mode)  # each once, ordered


def describe(split: TailSplit, scan: C.ScanParams) -> str:
    return (
        f"{len(split.in_place)} of {scan.num_carry} carried values written in place after their "
        f"reads ({len(split.t_eqns)} tail equations behind a barrier of {len(split.barrier)} values)"
    )


def _run_ordered(scan: C.ScanParams, split: TailSplit, invals: list, site: I.Site, interp: I.Interpreter):
    body, ctx = scan.body, site.body_ctx
    nc, nk = scan.num_consts, scan.num_carry
    consts = invals[:nc]
    init = invals[nc : nc + nk]
    xs = invals[nc + nk :]

    def step(carry, x):
        env = dict(zip(body.constvars, scan.body_consts, strict=True))
        env.update(zip(body.invars, [*consts, *carry, *x], strict=True))
        interp.run(body, split.a_eqns, env, ctx)
        if split.barrier:
            held = jax.lax.optimization_barrier([env[v] for v in split.barrier])
            env.update(zip(split.barrier, held, strict=True))
        interp.run(body, split.t_eqns, env, ctx)
        outs = [C.read_atom(env, v) for v in body.outvars]
        return outs[:nk], outs[nk:]

    I.named(step, I.body_name(body, C.SCAN))
    carry, ys = jax.lax.scan(
        step, list(init), list(xs), length=scan.length, reverse=scan.reverse, unroll=scan.unroll
    )
    return [*carry, *ys]


def update_in_place(where: Where = None, mode: str = "reads") -> Transform:
    """Order every read of the chosen scans' old carried values before the elementwise updates
    that overwrite them (an optimization barrier between the body's work and its update tail), so
    that XLA updates the carry in place instead of copying it every step. See the module
    docstring for legality and tolerance.

    ``mode="reads"`` (default): the barrier holds the old values and the first materialised
    results of their reads, and the tail reads the old values back through it (the tail's other
    inputs stay fusible with their producers); ``mode="tail"``: the barrier holds everything the
    tail reads from the rest of the body (simpler, but no fusion across it)."""
    if mode not in MODES:
        raise ValueError(f"update_in_place: mode must be one of {MODES}, got {mode!r}")

    return split_scan_transform(
        "update_in_place",
        (("where", where), ("mode", mode)),
        FUSION_TOLERANCE,
        where,
        lambda scan: split_tail(scan, mode),
        describe,
        "the tail reads nothing the rest of the body computes after it; ",
        lambda split, scan, invals, site, interp: _run_ordered(scan, split, invals, site, interp),
        f"update the carry of the scan(s) at {where_label(where)} in place, after its reads",
    )


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """Per scan of at least two steps whose old carried values are read outside the update tail
    (those in a profiled window; without windows every one), most expensive first.

    Model (seconds per iteration): one copy kernel saved per such carried value per step, less
    the fusions lost to each read result the barrier holds, ``trips x (copied - held x``
    :data:`BARRIER_VALUE_SHARE` ``) x`` :data:`COPY_S`; offered only where that is positive (a
    loop that copies many values each read in few places).
    """
    out: list[Candidate] = []
    per_copy = COPY_S.get(ctx.platform, COPY_S["gpu"])
    for _, where, split, trips in split_scans(ctx, split_tail):
        copied, held = len(split.in_place), len(split.barrier) - len(split.in_place)
        gain = trips * (copied - held * BARRIER_VALUE_SHARE) * per_copy
        if gain <= 0:
            continue
        out.append(
            Candidate(
                update_in_place(where),
                where,
                gain,
                f"{trips} steps x ({copied} carried values not copied - {held} read results held x "
                f"{BARRIER_VALUE_SHARE}) x {per_copy * 1e6:.1f}us per copy",
            )
        )
    return out
