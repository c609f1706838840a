"""Jaxpr helpers for the phase timer: effective component paths, call inlining, read/defined
sets. Every read of ``eqn.params`` and of jaxpr internals (JAX 0.11 / 0.12 layouts) is in
:mod:`rose_jax.trace.compat`; this module only walks equations through it.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax

from rose_jax.trace import compat


def path_string(path: Sequence[str]) -> str:
    return "/".join(path)


def substitute(eqn, subst: dict):
    if not subst:
        return eqn
    new_in = [subst.get(v, v) if compat.is_var(v) else v for v in eqn.invars]
    return eqn.replace(invars=new_in)


# -- effective component paths ----------------------------------------------------------------
def _lcp(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
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
    result = (_lcp(paths) if paths else (), depth)
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
    return own + _lcp(rels), depth


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


def read_set(eqns: Sequence) -> list:
    """Vars read by ``eqns`` that they do not define, in first-use order."""
    defined, seen, order = set(), set(), []
    for e in eqns:
        for v in e.invars:
            if compat.is_var(v) and v not in defined and v not in seen:
                seen.add(v)
                order.append(v)
        for v in e.outvars:
            if compat.is_var(v):
                defined.add(v)
    return order


def defined_vars(eqns: Sequence) -> list:
    return [v for e in eqns for v in e.outvars if compat.is_var(v)]


def count_eqns(eqns: Sequence) -> int:
    n = 0
    for e in eqns:
        n += 1
        for j in compat.sub_jaxprs(e.params):
            n += count_eqns(j.eqns)
    return n


def contains_loop(eqns: Sequence) -> bool:
    for e in eqns:
        if e.primitive.name in compat.LOOP_PRIMITIVES:
            return True
        if any(contains_loop(j.eqns) for j in compat.sub_jaxprs(e.params)):
            return True
    return False
