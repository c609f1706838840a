"""Cutting a jaxpr at component boundaries: effective component paths, call inlining, the
straight-line program of a slice of equations, and :func:`split_component` (one component out of
a function, with the values that cross the cut).

The phase timer (:mod:`rose_jax.profile.phases`) cuts an iteration into component segments;
the optimizer's ``offload_component`` cuts one component out of an epoch. Every read of
``eqn.params`` and of jaxpr internals is in :mod:`rose_jax.jaxpr.compat`.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Sequence

import jax

from rose_jax.jaxpr import compat


def path_string(path: Sequence[str]) -> str:
    """``("rollout", "sim") -> "rollout/sim"``."""
    return "/".join(path)


def substitute(eqn, subst: dict):
    """``eqn`` reading ``subst[v]`` instead of each operand ``v`` in ``subst``."""
    if not subst:
        return eqn
    new_in = [subst.get(v, v) if compat.is_var(v) else v for v in eqn.invars]
    return eqn.replace(invars=new_in)


# -- effective component paths ----------------------------------------------------------------
def lcp(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The longest common prefix of ``paths``."""
    if not paths:
        return ()
    first = paths[0]
    n = len(first)
    for p in paths[1:]:
        n = min(n, len(p))
        for i in range(n):
            if p[i] != first[i]:
                n = i
                break
    return first[:n]


# id(jaxpr) -> (weak reference, result): holds no jaxpr (nor its consts) alive.
_EFFECTIVE_CACHE: dict[int, tuple[Any, tuple[tuple[str, ...], int]]] = {}


def _inner_relative(j) -> tuple[tuple[str, ...], int]:
    """(LCP of effective paths of j's eqns relative to j, max depth) -- cached by jaxpr identity."""
    key = id(j)
    hit = _EFFECTIVE_CACHE.get(key)
    if hit is not None and hit[0]() is j:
        return hit[1]
    paths, depth = [], 0
    for e in j.eqns:
        p, d = effective(e)
        paths.append(p)
        depth = max(depth, d)
    result = (lcp(paths) if paths else (), depth)
    try:
        if len(_EFFECTIVE_CACHE) > 100_000:
            _EFFECTIVE_CACHE.clear()
        _EFFECTIVE_CACHE[key] = (weakref.ref(j), result)
    except TypeError:  # not weak-referenceable: just do not cache
        pass
    return result


def effective(eqn) -> tuple[tuple[str, ...], int]:
    """(effective path, deepest path length) of an equation.

    The effective path is the eqn's own path extended by the longest common path of everything
    inside its sub-jaxprs (a jit whose body is all ``rollout`` counts as ``rollout``); the depth
    is the longest component path found anywhere inside it.
    """
    own = compat.component_path(eqn)
    subs = compat.sub_jaxprs(eqn.params)
    if not subs:
        return own, len(own)
    rels, depth = [], len(own)
    for j in subs:
        rel, d = _inner_relative(j)
        if j.eqns:
            rels.append(rel)
        depth = max(depth, len(own) + d)
    return own + lcp(rels), depth


def flatten_calls(eqns: Sequence, depth: int) -> tuple[list, dict, dict]:
    """Inline call equations (jit/pjit/closed_call/core_call) whose contents span several components at
    ``depth`` (path prefix length) or hold components below the call's own effective path,
    recursively, so that segments can split them apart.

    Inlined equations get the call's name stack prepended. Returns ``(eqns, alias, consts)``:
    ``alias`` sends the replaced call outputs to the atoms that now define them (apply it to the
    enclosing jaxpr's outvars with :func:`resolve`), ``consts`` maps inlined constvars to values
    (seed them into the evaluation environment).
    """
    out: list = []
    alias: dict = {}
    consts: dict = {}
    _flatten_into(list(eqns), depth, out, alias, consts)
    return out, alias, consts


def resolve(atom, alias: dict):
    """The atom that now defines ``atom`` after :func:`flatten_calls` (``alias`` from it)."""
    return alias.get(atom, atom) if compat.is_var(atom) else atom


def _keys_at(eqns, depth) -> set:
    return {effective(e)[0][:depth] for e in eqns}


def _flatten_into(eqns, depth, out, alias, consts) -> None:
    for e in eqns:
        e = substitute(e, alias)
        if e.primitive.name in compat.PLAIN_CALL_PRIMITIVES:
            ij, ij_consts = compat.call_jaxpr(e.params)
            inner_eqns = [compat.prefixed(q, e) for q in ij.eqns]
            path, deepest = effective(e)
            # Inline when the call spans several components at this depth, or hides components
            # below its own path (which a later split or loop timing must see).
            if deepest > len(path) or len(_keys_at(inner_eqns, depth)) > 1:
                local: dict = {}
                for v, c in zip(ij.constvars, ij_consts, strict=True):
                    consts[v] = c
                for v, a in zip(ij.invars, e.invars, strict=True):
                    local[v] = a
                _flatten_into(inner_eqns, depth, out, local, consts)
                for outer_v, inner_a in zip(e.outvars, ij.outvars, strict=True):
                    if compat.is_var(outer_v):
                        alias[outer_v] = resolve(inner_a, local)
                continue
        out.append(e)


# -- straight-line programs -------------------------------------------------------------------
def jit_eqns(invars: Sequence, outvars: Sequence, eqns: Sequence):
    """``jax.jit`` of the straight-line program ``eqns`` (args: invars, results: outvars list)."""
    return jax.jit(compat.as_fun(compat.make_closed(invars, outvars, eqns)))


def count_eqns(eqns: Sequence) -> int:
    """Equations in ``eqns``, those inside sub-jaxprs included."""
    n = 0
    for e in eqns:
        n += 1
        for j in compat.sub_jaxprs(e.params):
            n += count_eqns(j.eqns)
    return n


def contains_loop(eqns: Sequence) -> bool:
    """Whether ``eqns`` hold a scan or while loop (at any depth)."""
    for e in eqns:
        if e.primitive.name in compat.LOOP_PRIMITIVES:
            return True
        if any(contains_loop(j.eqns) for j in compat.sub_jaxprs(e.params)):
            return True
    return False


# -- one component out of a function ------------------------------------------------------------


class Split(NamedTuple):
    """The two halves of a function cut at one component (:func:`split_component`).

    ``kept``: flat inputs -> (the outputs the component does not produce, in order) + cut inputs.
    ``part``: cut inputs -> the component's outputs, which fill flat output ``positions``.
    """

    kept: Any
    part: Any
    positions: tuple[int, ...]
    n_outputs: int
    reason: str


def component_eqns(jaxpr: Any, component: str) -> list[int]:
    """Indices of the top-level equations of ``jaxpr`` inside ``rose_jax.component(component)``."""
    return [i for i, e in enumerate(jaxpr.eqns) if component in compat.component_path(e)]


def split_component(closed: Any, component: str, n_state: int) -> Split:
    """Cut ``closed`` (the jaxpr of ``state -> (state, metrics)``) at ``component``.

    ``n_state``: how many leading flat outputs are the carried state. The cut is legal when the
    component's equations sit at the top level (not inside a loop or a jit), none has side
    effects, no equation outside reads a value it produces, its outputs reach only the metrics
    (never the first ``n_state`` outputs) and at least one is used; otherwise ``ValueError``
    says which condition failed. ``kept`` returns the values the component reads (its cut
    inputs) after the other outputs; ``part`` bakes the arrays it closes over in as constants.
    """
    jx, consts = compat.open_and_consts(closed)
    constvars, invars = compat.in_vars(jx)
    eqns = list(jx.eqns)
    inside = component_eqns(jx, component)
    if not inside:
        raise ValueError(
            f"no top-level equation belongs to component {component!r} (it must be called at the top "
            "level of the function, not inside a loop or a nested jit)"
        )
    in_set = set(inside)
    effects = sorted({eqns[i].primitive.name for i in inside if compat.has_effects(eqns[i])})
    if effects:
        raise ValueError(f"component {component!r} has side effects ({', '.join(effects)}): cannot move it")
    produced = {v for i in inside for v in eqns[i].outvars if compat.is_var(v)}
    for i, e in enumerate(eqns):
        if i not in in_set and any(compat.is_var(a) and a in produced for a in e.invars):
            raise ValueError(
                f"equation {i} ({e.primitive.name}) outside component {component!r} reads its result: "
                "the rest of the function depends on it"
            )
    positions = tuple(k for k, v in enumerate(jx.outvars) if compat.is_var(v) and v in produced)
    if not positions:
        raise ValueError(f"component {component!r} produces no output (dead code): nothing to overlap")
    carried = [k for k in positions if k < n_state]
    if carried:
        raise ValueError(
            f"component {component!r} writes the carried state (flat outputs {carried}): the next call "
            "reads it, so it cannot run behind the next call"
        )
    const_of = dict(zip(constvars, consts, strict=True))
    cut, part_constvars, part_consts, seen = [], [], [], set()
    for i in inside:
        for a in eqns[i].invars:
            if not compat.is_var(a) or a in produced or a in seen:
                continue
            seen.add(a)
            if a in const_of:
                part_constvars.append(a)
                part_consts.append(const_of[a])
            else:
                cut.append(a)
    pos_set = set(positions)
    kept_out = [v for k, v in enumerate(jx.outvars) if k not in pos_set] + cut
    kept = compat.make_closed(
        invars, kept_out, [e for i, e in enumerate(eqns) if i not in in_set], constvars, consts
    )
    part = compat.make_closed(
        cut, [jx.outvars[k] for k in positions], [eqns[i] for i in inside], part_constvars, part_consts
    )
    reason = (
        f"component {component!r}: {len(inside)} top-level equation(s), pure, read by nothing else, "
        f"outputs only metrics ({len(positions)} leaf/leaves); {len(cut)} value(s) cross the cut"
    )
    return Split(kept, part, positions, len(jx.outvars), reason)
