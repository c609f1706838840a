"""Dataflow over the equations of one jaxpr level, written once for the tracer, profiler and optimizer.

Every analysis here looks at one straight-line list of equations (a jaxpr's ``eqns``, or a
slice of them) and treats an equation as a unit: if any operand is reached, all its results
are (:func:`forward`); if any result is needed, all its operands are (:func:`backward`). That
is conservative for calls and loops (their whole operand list), which is what every caller
wants: a legality check may reject too much, never too little.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from rose_jax.jaxpr import compat


def forward(eqns: Sequence, start_vars: Iterable, start: int = 0, skip: Iterable[int] = ()) -> set:
    """Vars reachable from ``start_vars`` through ``eqns[start:]``, equations at ``skip`` excluded.

    The result includes ``start_vars``.
    """
    reached = set(start_vars)
    skip = frozenset(skip)
    for j in range(start, len(eqns)):
        if j in skip:
            continue
        eqn = eqns[j]
        if any(not compat.is_literal(v) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    return reached


def _walk_back(eqns: Sequence, end_vars: Iterable, start: int, stop: int | None, effects_live: bool):
    needed = {v for v in end_vars if not compat.is_literal(v)}
    live: list[int] = []
    stop = len(eqns) if stop is None else min(stop, len(eqns))
    for j in range(stop - 1, start - 1, -1):
        eqn = eqns[j]
        if (effects_live and compat.has_effects(eqn)) or any(
            not compat.is_dropvar(v) and v in needed for v in eqn.outvars
        ):
            live.append(j)
            needed.update(a for a in eqn.invars if not compat.is_literal(a))
    return needed, live[::-1]


def backward(
    eqns: Sequence, end_vars: Iterable, stop: int | None = None, *, start: int = 0, effects_live: bool = False
) -> set:
    """Vars that ``end_vars`` depend on through ``eqns[start:stop]`` (a reverse walk).

    ``effects_live``: equations with side effects are live whatever they produce (liveness for
    dead-code questions); otherwise only data dependencies count. The result includes ``end_vars``.
    """
    return _walk_back(eqns, end_vars, start, stop, effects_live)[0]


def needed_eqns(
    eqns: Sequence, end_vars: Iterable, stop: int | None = None, *, start: int = 0, effects_live: bool = False
) -> list[int]:
    """Indices (ascending) of the equations in ``eqns[start:stop]`` that ``end_vars`` depend on."""
    return _walk_back(eqns, end_vars, start, stop, effects_live)[1]


def live_inputs(closed: Any, roots: Sequence[int]) -> list[bool]:
    """Which inputs of ``closed`` (a closed jaxpr) the outputs at positions ``roots`` depend on.

    Equations with effects are live. An output that is an input directly makes that input live.
    """
    jx, _ = compat.open_and_consts(closed)
    live = backward(jx.eqns, [jx.outvars[i] for i in roots], effects_live=True)
    return [v in live for v in jx.invars]


def tainted_outputs(closed: Any, tainted_inputs: Sequence[bool]) -> list[bool]:
    """Which outputs of ``closed`` depend on the inputs flagged in ``tainted_inputs``."""
    jx, _ = compat.open_and_consts(closed)
    reached = forward(jx.eqns, [v for v, t in zip(jx.invars, tainted_inputs, strict=True) if t])
    return [(not compat.is_literal(v)) and v in reached for v in jx.outvars]


def read_set(eqns: Sequence, is_value: Callable[[Any], bool] = compat.is_var) -> list:
    """Vars read by ``eqns`` that they do not define, in first-use order.

    ``is_value``: which operands are values (default: jaxpr Vars; a flattened body
    (:mod:`rose_jax.jaxpr.regions`) passes its own, whose values are ``(instance, var)`` keys).
    """
    defined, seen, order = set(), set(), []
    for e in eqns:
        for v in e.invars:
            if is_value(v) and v not in defined and v not in seen:
                seen.add(v)
                order.append(v)
        for v in e.outvars:
            if is_value(v):
                defined.add(v)
    return order


def defined_vars(eqns: Sequence, is_value: Callable[[Any], bool] = compat.is_var) -> list:
    """Vars ``eqns`` define, in order (``is_value`` as in :func:`read_set`)."""
    return [v for e in eqns for v in e.outvars if is_value(v)]


def liveness(
    pieces: Sequence[Sequence], live_out: Iterable, droppable: Sequence[bool] | None = None
) -> list[tuple[list, list] | None]:
    """Inputs and needed outputs of consecutive pieces of one straight-line program.

    ``pieces``: equation lists in program order; ``live_out``: the vars needed after the last
    piece. Returns per piece ``(read vars, the vars it defines that later pieces or live_out
    need)``, or None for a piece flagged in ``droppable`` whose results nobody needs (its reads
    then do not count).
    """
    live = {v for v in live_out if compat.is_var(v)}
    droppable = droppable or [False] * len(pieces)
    out: list[tuple[list, list] | None] = [None] * len(pieces)
    for k in range(len(pieces) - 1, -1, -1):
        defined = defined_vars(pieces[k])
        outs = [v for v in defined if v in live]
        if droppable[k] and not outs:
            continue
        reads = read_set(pieces[k])
        out[k] = (reads, outs)
        live = (live - set(defined)) | set(reads)
    return out
