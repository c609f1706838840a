"""Loop restructuring: ``while`` loops with a static bound become bounded masked ``scan`` s.

On a GPU, XLA runs a while loop whose trip count it cannot see by copying the predicate to the
host and waiting for it every iteration (and does not capture the loop into a command buffer).
MJX's constraint solver is such a loop (``solver_niter < opt.iterations`` plus a tolerance exit)
in every physics substep of hopper, walker2d, halfcheetah, swimmer, humanoidstandup... The loop
has a static bound (:mod:`rose_jax.jaxpr.bounds`), so it can run as a ``scan`` of ``bound``
steps that applies the body only where the loop's own condition still holds:

* ``variant="where"``: ``x = select(cond(x), body(x), x)``: no control flow at all (the body
  always runs ``bound`` times; its result is dropped once the condition fails);
* ``variant="cond"``: ``x = lax.cond(cond(x), body, identity, x)``: the body runs only while
  needed (a device-side conditional where XLA can capture one).

Both compute bitwise the same carry as the while loop: while the condition holds they apply
the same body to the same values, and once it fails the carry never changes again (the loop
would have stopped there). A vmapped while keeps a batched predicate, and the ``while``
primitive itself runs ``select(pred, body(x), x)`` per element while any element holds: the
rewrite does the same per element. ``unroll`` unrolls the bounded scan (``True``: no loop).
"Bitwise" holds for the operations; the compiler may still contract ``a*b+c`` into an FMA in one
fusion and not in another, and the where variant fuses the select into the body: jax 0.12.1's
XLA:CPU does so and differs in the last bit (1 ulp; none when built without FMA instructions,
``--xla_cpu_max_isa=AVX``). The search checks every candidate, so such a rewrite is refused as
unequal there; on the H200 (jax 0.11.2) MJX's solver loops were bitwise equal.

Legality (per loop, with the reason when refused): a static bound exists and is at most
``max_bound``; nothing in the loop has effects, calls back to the host or draws from stateful
RNG (a masked scan runs the body more often than the loop, so such a body would be observed
more often); for ``"where"``, every while loop inside the body is rewritten too (a body run on
a finished state must not reach an unbounded inner loop).

    step = bound_while_loops("where").apply(env_step)    # fn -> fn; jit / vmap / grad compose
    loop_candidates(tree)                                 # the variants legal for a LoopTree
    candidates(ctx)                                       # the search's, with predicted gains
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from rose_jax.jaxpr import bounds as B
from rose_jax.jaxpr import compat as C
from rose_jax.optimize import interpret as I
from rose_jax.optimize.base import EXACT, FUSION_TOLERANCE, Transform
from rose_jax.optimize.predict import (
    LOOP_OVERHEAD_S,
    Candidate,
    CandidateContext,
    idle_for,
    outer_trips,
    where_of,
)
from rose_jax.optimize.where import Where, matcher

VARIANTS = ("where", "cond")
# Larger static bounds are refused by default: a masked scan of thousands of steps runs the body
# thousands of times where the loop may stop after a few.
MAX_BOUND = 1024
# Largest while-loop bound the search turns into a masked scan (bound_while_loops' own default,
# MAX_BOUND, is wider for direct use). A masked scan runs its body ``bound`` times where a
# loop with a tolerance exit may stop after a few: on the H200 (benchmarks/results/loops/,
# 2026-12-04) the MJX swimmer's solver loop (bound 100, MuJoCo's default iterations) ran 0.036x as
# a masked scan and took ~80 s per variant to compile and time, while bound 4 (hopper, walker2d,
# halfcheetah) ran 1.01-1.05x and bound 8 (humanoidstandup) 0.96x. Above this bound the candidate
# is refused with the reason, without compiling it.
SEARCH_MAX_BOUND = 16
# Primitives whose extra executions would be observable: host callbacks and stateful RNG.
_IMPURE = C.CALLBACK_PRIMITIVES | frozenset({"rng_uniform", "debug_print"})


class LoopPlan(NamedTuple):
    """What :func:`bound_while_loops` does with one while loop.

    ``path``: enclosing components and the body's function name (``"rollout/body"``);
    ``bound``: the loop's :class:`rose_jax.jaxpr.bounds.LoopBound`; ``ok``: rewritten;
    ``reason``: why (or why not).
    """

    path: str
    bound: B.LoopBound
    ok: bool
    reason: str
    eqn: Any = None


def effects_reason(eqn: Any) -> str | None:
    """Why a while equation's body must not run more often than the loop runs it, else None."""
    effects = getattr(eqn, "effects", None)
    if effects:
        return f"its body has effects ({', '.join(sorted(str(e) for e in effects))})"
    for e in _nested_eqns(eqn):
        if e.primitive.name in _IMPURE:
            return f"its body calls {e.primitive.name} (a host callback or stateful RNG)"
        if getattr(e, "effects", None):
            return f"its body has effects ({', '.join(sorted(str(x) for x in e.effects))})"
    return None


def _nested_eqns(eqn: Any):
    """Every equation inside ``eqn``'s sub-jaxprs (condition and body), at any depth; each
    sub-jaxpr is visited once."""
    stack, seen = list(C.sub_jaxprs(eqn.params)), set()
    while stack:
        jx = stack.pop()
        if id(jx) in seen:
            continue
        seen.add(id(jx))
        for e in jx.eqns:
            yield e
            stack.extend(C.sub_jaxprs(e.params))


def _inner_whiles(eqn: Any) -> list:
    """While equations anywhere inside a while equation's condition and body."""
    return [e for e in _nested_eqns(eqn) if e.primitive.name == C.WHILE]


def plan_loops(
    closed_jaxpr: Any, where: Where = None, variant: str = "where", max_bound: int = MAX_BOUND
) -> list[LoopPlan]:
    """One :class:`LoopPlan` per while loop of a traced program that ``where`` matches, in
    pre-order (loops the rewriting interpreter cannot reach, e.g. inside a custom_vjp, are not
    listed: they stay as they are)."""
    match = matcher(where)
    bounds = B.while_loop_bounds(closed_jaxpr)
    sites = [s for s in I.sites(closed_jaxpr, kinds=(C.WHILE,)) if match(s.component_path, s.name, s)]
    plans: dict[int, LoopPlan] = {}
    # inner loops first: a "where" rewrite needs every inner while rewritten
    for site in reversed(sites):
        eqn = site.eqn
        b = B.bound_of(eqn, bounds)
        reason = None
        if b.bound is None:
            reason = b.reason
        elif b.bound > max_bound:
            reason = (
                f"bound {b.bound} exceeds max_bound={max_bound} (a masked scan runs its body {b.bound} times)"
            )
        else:
            reason = effects_reason(eqn)
            if reason is None and variant == "where":
                bad = [e for e in _inner_whiles(eqn) if not (id(e) in plans and plans[id(e)].ok)]
                if bad:
                    reason = (
                        f"its body holds {len(bad)} while loop(s) that are not rewritten: the 'where' "
                        "variant would run them on finished states (use variant='cond')"
                    )
        path = site.path_str()
        if reason is None:
            plans[id(eqn)] = LoopPlan(
                path, b, True, f"{path}: {b.reason} -> masked scan of {b.bound} steps", eqn
            )
        else:
            plans[id(eqn)] = LoopPlan(path, b, False, f"{path}: {reason}", eqn)
    return [plans[id(s.eqn)] for s in sites]


def masked_scan(parts: I.WhileParts, bound: int, variant: str = "where", unroll: int | bool = 1) -> list:
    """The while loop ``parts`` as a scan of ``bound`` steps that applies the body only where
    the loop's condition holds (see the module docstring); returns the final carry."""

    def step(carry, _):
        pred = parts.cond(carry)
        if variant == "where":
            return I.select_carry(pred, parts.body(carry), carry), None
        if not parts.pred_shape:
            return list(jax.lax.cond(pred, parts.body, list, carry)), None

        def run(c, p):
            return I.select_carry(p, parts.body(c), c)

        return list(jax.lax.cond(jnp.any(pred), run, lambda c, p: list(c), carry, pred)), None

    I.named(step, getattr(parts.body, "__name__", C.WHILE))
    carry, _ = jax.lax.scan(step, list(parts.init), None, length=bound, unroll=unroll)
    return list(carry)


def rewrite_loops(
    fn: Callable,
    variant: str = "where",
    where: Where = None,
    unroll: int | bool = 1,
    max_bound: int = MAX_BOUND,
) -> Callable:
    """``fn`` with each while loop that :func:`plan_loops` accepts run as a :func:`masked_scan`.

    ``fn`` takes and returns pytrees of arrays; the result traces ``fn`` at every call (once per
    input signature under ``jax.jit``) and composes with ``jax.jit`` / ``vmap`` / ``grad``.
    """

    def rewritten(*args, **kwargs):
        closed, out_shape = I.trace(fn, *args, **kwargs)
        chosen = {id(p.eqn): p for p in plan_loops(closed, where, variant, max_bound) if p.ok}
        if not chosen:
            return fn(*args, **kwargs)

        def select(site):
            return site.primitive == C.WHILE and id(site.eqn) in chosen

        def on_scan(site, scan, invals, interp):  # no scan is selected
            raise AssertionError("rewrite_loops selects no scan")

        def on_while(site, parts, interp):
            return masked_scan(parts, chosen[id(site.eqn)].bound.bound, variant, unroll)

        jx, consts = C.open_and_consts(closed)
        outs = I.Interpreter(select, on_scan, on_while).eval(jx, consts, jax.tree.leaves((args, kwargs)))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    rewritten.__name__ = getattr(fn, "__name__", "rewritten")
    rewritten.__wrapped__ = fn
    return rewritten


def _where_text(where: Where) -> str:
    return "every while loop" if where is None else f"the while loops at where={where!r}"


def bound_while_loops(
    variant: str = "where", where: Where = None, unroll: int | bool = 1, max_bound: int = MAX_BOUND
) -> Transform:
    """Run every while loop with a static bound (matching ``where``) as a bounded masked scan.

    Args:
      variant: ``"where"`` (select, no control flow) or ``"cond"`` (``lax.cond`` per step).
      where: which loops (see :mod:`rose_jax.optimize.where`; the loop name is its body's
        function name, e.g. MJX's solver loop is ``"body"`` under the physics step).
      unroll: ``unroll`` of the bounded scan (``True``: fully unrolled, no loop left).
      max_bound: loops with a larger bound are refused.

    Legal when at least one matching loop can be rewritten (see :func:`plan_loops`); the reason
    lists every matching loop and what happens to it. Tolerance: exact (bitwise equal) for
    ``unroll=1``, checked by the search (see the module docstring on FMA contraction); unrolled,
    XLA may fuse across steps (:data:`FUSION_TOLERANCE`).
    """
    if variant not in VARIANTS:
        raise ValueError(f"bound_while_loops: variant must be one of {VARIANTS}, got {variant!r}")
    if not (unroll is True or (isinstance(unroll, int) and not isinstance(unroll, bool) and unroll >= 1)):
        raise ValueError(f"bound_while_loops: unroll must be an int >= 1 or True, got {unroll!r}")
    if not isinstance(max_bound, int) or isinstance(max_bound, bool) or max_bound < 1:
        raise ValueError(f"bound_while_loops: max_bound must be an int >= 1, got {max_bound!r}")

    def legal(tree):
        jaxpr = getattr(tree, "jaxpr", None)
        if jaxpr is None:  # a ProgramTree: its collect's LoopTree
            jaxpr = getattr(getattr(tree, "tree", None), "jaxpr", None)
        if jaxpr is None:
            return False, "the LoopTree carries no jaxpr (trace it with rose_jax.trace.trace)"
        plans = plan_loops(jaxpr, where, variant, max_bound)
        if not plans:
            return False, f"no while loop matches {_where_text(where)}"
        ok = [p for p in plans if p.ok]
        refused = [p for p in plans if not p.ok]
        if not ok:
            return False, "no while loop can be bounded: " + "; ".join(_dedup(p.reason for p in refused))
        text = f"{len(ok)} while loop(s) become masked scans ({variant}): " + "; ".join(
            _dedup(p.reason for p in ok)
        )
        if refused:
            text += f"; {len(refused)} left as they are: " + "; ".join(_dedup(p.reason for p in refused))
        return True, text

    def apply(fn):
        return rewrite_loops(fn, variant, where, unroll, max_bound)

    tolerance = FUSION_TOLERANCE if unroll is True or unroll > 1 else EXACT
    return Transform(
        "bound_while_loops",
        (("variant", variant), ("where", where), ("unroll", unroll), ("max_bound", max_bound)),
        tolerance,
        "fn",
        legal,
        apply,
        summary=f"run {_where_text(where)} with a static bound as a masked scan ({variant}, unroll={unroll})",
    )


def _dedup(items) -> list[str]:
    out: list[str] = []
    for x in items:
        if x not in out:
            out.append(x)
    return out


def loop_candidates(tree: Any, max_bound: int = MAX_BOUND) -> list[Transform]:
    """The :func:`bound_while_loops` variants legal for ``tree`` (a LoopTree with its jaxpr):
    ``where``, ``cond`` and ``where`` fully unrolled; empty when no while loop has a bound."""
    out = []
    for t in (
        bound_while_loops("where", max_bound=max_bound),
        bound_while_loops("cond", max_bound=max_bound),
        bound_while_loops("where", unroll=True, max_bound=max_bound),
    ):
        if t.legal(tree)[0]:
            out.append(t)
    return out


def bounded_loop_candidates(
    tree, baseline_s: float, by_path: dict[str, float], platform: str
) -> list[Candidate]:
    """:func:`loop_candidates` (while loops with a static bound as masked scans) with predicted
    gains, for the search; where the tree holds while loops but none has a bound (or every bound
    exceeds :data:`SEARCH_MAX_BOUND`), the ``"where"`` variant is still returned, so the search
    logs why it is refused. ``by_path``: profiled idle SM-seconds by component path.

    Model: each iteration of a while loop on a GPU waits for its predicate on the host
    (:data:`rose_jax.optimize.predict.LOOP_OVERHEAD_S`); a masked scan of ``bound`` steps saves
    that wait per iteration run (at most ``bound`` per execution, times the loops around it).
    """
    whiles = [n for n in tree.walk() if n.kind == "while"]
    if not whiles:
        return []
    made = loop_candidates(tree, max_bound=SEARCH_MAX_BOUND)
    window = "/".join(sorted({where_of(n) for n in whiles}))
    if not made:  # listed so the search says why, ranked last: it rewrites nothing
        # (it was ranked second on PPO reacher, 3.60 s of a 7.07 s unit, for loops of bound 100)
        t = bound_while_loops("where", max_bound=SEARCH_MAX_BOUND)
        why = f"no while loop has a bound <= {SEARCH_MAX_BOUND}: nothing to rewrite"
        return [Candidate(t, window, 0.0, why)]
    # only the loops the rewrite bounds save their round trips
    bounded = [n for n in whiles if n.bound is not None and n.bound <= SEARCH_MAX_BOUND]
    overhead = LOOP_OVERHEAD_S.get(platform, LOOP_OVERHEAD_S["gpu"])
    trips = sum(n.bound * outer_trips(tree, n) for n in bounded)
    by_idle = [v for v in (idle_for(n, by_path) for n in bounded) if v is not None]
    out = []
    for t in made:
        gain = trips * overhead
        model = f"{trips} while-loop iterations x {overhead * 1e6:.0f}us host round trip"
        if by_idle:
            gain, model = min(gain, sum(by_idle)), f"{model}, at most the profiled idle SM-seconds"
        out.append(Candidate(t, window, gain, model))
    return out


def candidates(ctx: CandidateContext) -> list[Candidate]:
    """The search's candidates of this family: :func:`bounded_loop_candidates`."""
    return bounded_loop_candidates(ctx.tree, ctx.baseline_s, ctx.by_path, ctx.platform)


def describe_loops(
    fn: Callable, *args, variant: str = "where", max_bound: int = MAX_BOUND, **kwargs
) -> list[LoopPlan]:
    """:func:`plan_loops` of ``fn(*args, **kwargs)`` (traced, not run): every while loop, its bound
    and whether :func:`bound_while_loops` rewrites it."""
    closed, _ = I.trace(fn, *args, **kwargs)
    return plan_loops(closed, None, variant, max_bound)


__all__ = [
    "MAX_BOUND",
    "SEARCH_MAX_BOUND",
    "VARIANTS",
    "LoopPlan",
    "bound_while_loops",
    "bounded_loop_candidates",
    "candidates",
    "describe_loops",
    "effects_reason",
    "loop_candidates",
    "masked_scan",
    "plan_loops",
    "rewrite_loops",
]
