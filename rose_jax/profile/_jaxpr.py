"""Jaxpr helpers for the phase timer: component paths, call inlining, loop decoding, and
building/evaluating sub-jaxprs. All version-dependent parameter decoding (JAX 0.11 / 0.12)
lives here. Public JAX API only (``jax.extend.core``); no ``jax._src`` imports.
"""

from __future__ import annotations

import re
import weakref
from typing import Any, Sequence

import jax
import jax.extend.core as jcore

from rose_jax.program import COMPONENT_PREFIX

_COMPONENT_RE = re.compile(re.escape(COMPONENT_PREFIX) + r"([^/():]+)")
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
LOOP_PRIMITIVES = frozenset({"scan", "while"})


def component_path(eqn) -> tuple[str, ...]:
    """Component names in ``eqn.source_info.name_stack`` (outermost first), e.g. ``('rollout', 'sim')``."""
    return tuple(_COMPONENT_RE.findall(str(eqn.source_info.name_stack)))


def path_string(path: Sequence[str]) -> str:
    return "/".join(path)


# -- jaxpr object compatibility -----------------------------------------------------------------
def open_jaxpr(j):
    """The open jaxpr (eqns, invars, constvars) of a ClosedJaxpr or Jaxpr."""
    inner = getattr(j, "jaxpr", None)
    return j if inner is None else inner


def jaxpr_consts(j) -> list:
    return list(getattr(j, "consts", ()) or ())


def sub_jaxprs(eqn) -> list:
    return list(jcore.jaxprs_in_params(eqn.params))


_DROPVAR = getattr(jcore, "DropVar", None)


def is_var(a) -> bool:
    """A real variable (not a Literal, not a dropped output)."""
    if not isinstance(a, jcore.Var):
        return False
    return not (isinstance(a, _DROPVAR) if _DROPVAR is not None else type(a).__name__ == "DropVar")


def prefixed(eqn, outer_eqn):
    """``eqn`` with ``outer_eqn``'s name stack prepended (so paths and HLO metadata stay full)."""
    outer = outer_eqn.source_info.name_stack
    if not str(outer):
        return eqn
    si = eqn.source_info.replace(name_stack=outer + eqn.source_info.name_stack)
    return eqn.replace(source_info=si)


def substitute(eqn, subst: dict):
    if not subst:
        return eqn
    new_in = [subst.get(v, v) if is_var(v) else v for v in eqn.invars]
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
    for e in open_jaxpr(j).eqns:
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
    own = component_path(eqn)
    subs = sub_jaxprs(eqn)
    if not subs:
        return own, len(own)
    rels, depth = [], len(own)
    for j in subs:
        rel, d = _inner_relative(j)
        if open_jaxpr(j).eqns:
            rels.append(rel)
        depth = max(depth, len(own) + d)
    return own + _lcp(rels), depth


def flatten_calls(eqns: Sequence, depth: int) -> tuple[list, dict, dict]:
    """Inline call equations (jit/pjit/closed_call) whose contents span several components at
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
    return alias.get(atom, atom) if is_var(atom) else atom


def _keys_at(eqns, depth) -> set:
    return {effective(e)[0][:depth] for e in eqns}


def _flatten_into(eqns, depth, out, alias, consts) -> None:
    for e in eqns:
        e = substitute(e, alias)
        if e.primitive.name in CALL_PRIMITIVES and "jaxpr" in e.params:
            inner = e.params["jaxpr"]
            ij = open_jaxpr(inner)
            inner_eqns = [prefixed(q, e) for q in ij.eqns]
            path, deepest = effective(e)
            # Inline when the call spans several components at this depth, or hides components
            # below its own path (which a later split or loop timing must see).
            if deepest > len(path) or len(_keys_at(inner_eqns, depth)) > 1:
                local: dict = {}
                for v, c in zip(ij.constvars, jaxpr_consts(inner), strict=True):
                    consts[v] = c
                for v, a in zip(ij.invars, e.invars, strict=True):
                    local[v] = a
                _flatten_into(inner_eqns, depth, out, local, consts)
                for outer_v, inner_a in zip(e.outvars, ij.outvars, strict=True):
                    if is_var(outer_v):
                        alias[outer_v] = resolve(inner_a, local)
                continue
        out.append(e)


# -- loops ------------------------------------------------------------------------------------
def scan_partition(eqn) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Index lists (consts, carry, xs) into eqn.invars and (carry, ys) into eqn.outvars."""
    p = eqn.params
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if "num_consts" in p:  # JAX <= 0.11 style
        nc, nk = int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = list(range(nc)), list(range(nc, nc + nk)), list(range(nc + nk, n_in))
        return consts, carry, xs, list(range(nk)), list(range(nk, n_out))
    if "ft_in" in p:  # JAX 0.12: flat-tree descriptions of (consts, carry, xs) / (carry, ys)
        consts, carry, xs = (list(part) for part in p["ft_in"].update(list(range(n_in))).unpack())
        carry_out, ys = (list(part) for part in p["ft_out"].update(list(range(n_out))).unpack())
        return consts, carry, xs, carry_out, ys
    raise NotImplementedError(
        f"unknown scan parameters {sorted(p)}; teach rose_jax.profile._jaxpr about them"
    )


def while_partition(eqn) -> tuple[int, int]:
    p = eqn.params
    return int(p["cond_nconsts"]), int(p["body_nconsts"])


# -- building and evaluating sub-jaxprs -----------------------------------------------------
def _effects(eqns) -> frozenset:
    eff: set = set()
    for e in eqns:
        eff |= set(e.effects)
    return frozenset(eff)


def make_closed(invars: Sequence, outvars: Sequence, eqns: Sequence):
    """A closed jaxpr (no consts) of ``eqns`` taking ``invars`` and returning ``outvars``."""
    invars, outvars, eqns = list(invars), list(outvars), list(eqns)
    try:
        dbg = jcore.DebugInfo(
            "rose_jax.profile",
            "segment",
            tuple(f"in{i}" for i in range(len(invars))),
            tuple(f"out{i}" for i in range(len(outvars))),
        )
    except Exception:  # noqa: BLE001 - DebugInfo's signature moved between versions
        dbg = None
    try:
        j = jcore.Jaxpr([], invars, outvars, eqns, _effects(eqns), dbg)
    except (TypeError, AssertionError):
        j = jcore.Jaxpr([], invars, outvars, eqns, _effects(eqns), None)
    return jcore.ClosedJaxpr(j, [])


def as_fun(closed):
    """A Python callable evaluating a closed jaxpr (name stacks propagate into lowering)."""
    return jcore.jaxpr_as_fun(closed)


def jit_eqns(invars: Sequence, outvars: Sequence, eqns: Sequence):
    """``jax.jit`` of the straight-line program ``eqns`` (args: invars, results: outvars list)."""
    return jax.jit(as_fun(make_closed(invars, outvars, eqns)))


def read_set(eqns: Sequence) -> list:
    """Vars read by ``eqns`` that they do not define, in first-use order."""
    defined, seen, order = set(), set(), []
    for e in eqns:
        for v in e.invars:
            if is_var(v) and v not in defined and v not in seen:
                seen.add(v)
                order.append(v)
        for v in e.outvars:
            if is_var(v):
                defined.add(v)
    return order


def defined_vars(eqns: Sequence) -> list:
    return [v for e in eqns for v in e.outvars if is_var(v)]


def count_eqns(eqns: Sequence) -> int:
    n = 0
    for e in eqns:
        n += 1
        for j in sub_jaxprs(e):
            n += count_eqns(open_jaxpr(j).eqns)
    return n


def contains_loop(eqns: Sequence) -> bool:
    for e in eqns:
        if e.primitive.name in LOOP_PRIMITIVES:
            return True
        if any(contains_loop(open_jaxpr(j).eqns) for j in sub_jaxprs(e)):
            return True
    return False
