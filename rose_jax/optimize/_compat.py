"""All decoding of jaxpr equation parameters for the optimizer, in one place.

JAX changed the layout of control-flow parameters between releases:

* scan, up to JAX 0.11: ``jaxpr`` is a ``ClosedJaxpr``; ``num_consts`` / ``num_carry`` count
  the leading const and carry operands (plus ``linear``, ``_split_transpose``);
* scan, JAX 0.12: ``jaxpr`` is a (closed) ``Jaxpr`` and the operand split is a flat tree
  ``ft_in = (consts, carry, xs)`` whose parts have ``len`` = number of leaves;
* JAX 0.12 merged ``ClosedJaxpr`` into ``Jaxpr`` (a ``Jaxpr`` carries its ``consts``; its
  ``.jaxpr`` is itself); earlier a ``ClosedJaxpr`` wraps an open ``Jaxpr`` and its ``consts``.

Nothing here constructs new parameter dictionaries: rewrites re-bind through the public
``jax.lax`` API (``scan``, ``while_loop``, ``switch``) so that a transformed program never
depends on the private layout. Never imports ``jax._src``.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import jax.extend.core as jex

CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
_JAXPR_TYPES = tuple({jex.Jaxpr, getattr(jex, "ClosedJaxpr", jex.Jaxpr)})
SCAN, WHILE, COND = "scan", "while", "cond"


def is_jaxpr(value: Any) -> bool:
    """True for a ``Jaxpr`` or a ``ClosedJaxpr`` (whatever the JAX version)."""
    return isinstance(value, _JAXPR_TYPES)


def open_and_consts(value: Any) -> tuple[Any, Sequence[Any]]:
    """``(open jaxpr, consts)`` of a ``ClosedJaxpr`` (<= 0.11) or a ``Jaxpr`` (0.12, carries consts)."""
    inner = getattr(value, "jaxpr", None)
    if inner is not None and inner is not value:  # ClosedJaxpr (<= 0.11)
        return inner, tuple(value.consts)
    return value, tuple(getattr(value, "consts", ()) or ())


def in_vars(jaxpr: Any) -> tuple[list[Any], list[Any]]:
    """``(constvars, invars)`` of an open jaxpr."""
    return list(jaxpr.constvars), list(jaxpr.invars)


class ScanParams(NamedTuple):
    """The parts of a scan equation the optimizer needs.

    The body's operands are ``[*consts, *carry, *xs]`` (``num_consts`` + ``num_carry`` +
    ``len(xs)``); its results are ``[*carry, *ys]``. ``body`` is open; ``body_consts`` are the
    values of its ``constvars`` (closed-over constants).
    """

    length: int
    reverse: bool
    unroll: int | bool
    num_consts: int
    num_carry: int
    body: Any
    body_consts: tuple[Any, ...]


def scan_params(params: dict) -> ScanParams:
    """Decode a scan equation's ``params`` (JAX 0.10 / 0.11 / 0.12 layouts)."""
    body, body_consts = open_and_consts(params["jaxpr"])
    if "num_consts" in params:
        num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
    elif "ft_in" in params:
        ft_in = params["ft_in"]
        parts = ft_in.unpack() if hasattr(ft_in, "unpack") else ft_in.elts
        consts_part, carry_part, _ = parts
        num_consts, num_carry = len(consts_part), len(carry_part)
    else:
        raise ValueError(f"unknown scan parameter layout: {sorted(params)}")
    return ScanParams(
        length=int(params["length"]),
        reverse=bool(params["reverse"]),
        unroll=params.get("unroll", 1),
        num_consts=num_consts,
        num_carry=num_carry,
        body=body,
        body_consts=body_consts,
    )


class WhileParams(NamedTuple):
    """A while equation: operands ``[*cond_consts, *body_consts, *carry]``."""

    cond_nconsts: int
    body_nconsts: int
    cond: Any
    cond_consts: tuple[Any, ...]
    body: Any
    body_consts: tuple[Any, ...]


def while_params(params: dict) -> WhileParams:
    cond, cond_consts = open_and_consts(params["cond_jaxpr"])
    body, body_consts = open_and_consts(params["body_jaxpr"])
    return WhileParams(
        int(params["cond_nconsts"]), int(params["body_nconsts"]), cond, cond_consts, body, body_consts
    )


def cond_branches(params: dict) -> list[tuple[Any, tuple[Any, ...]]]:
    """``[(open branch jaxpr, consts)]`` of a cond equation; operands are ``[index, *ops]``."""
    return [open_and_consts(b) for b in params["branches"]]


def call_jaxpr(params: dict) -> tuple[Any, tuple[Any, ...]]:
    """``(open jaxpr, consts)`` of a jit / pjit / closed_call equation."""
    return open_and_consts(params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"])


def sub_jaxprs(params: dict) -> list[Any]:
    """Every sub-jaxpr (open) of an equation's params, for walks that only need structure."""
    out = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if is_jaxpr(v):
                out.append(open_and_consts(v)[0])
    return out


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Re-bind an equation unchanged on ``invals`` (what ``jax.core.eval_jaxpr`` does)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        subfuns, bind_params = got  # JAX <= 0.11
    else:
        subfuns, bind_params = (), got
    out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def read_atom(env: dict, atom: Any) -> Any:
    return atom.val if isinstance(atom, jex.Literal) else env[atom]


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jex.Literal)


def is_dropvar(var: Any) -> bool:
    return isinstance(var, jex.DropVar)


def scope_names(eqn: Any) -> list[str]:
    """The named scopes on an equation's name stack (transform markers like ``jvp`` dropped)."""
    stack = getattr(eqn.source_info.name_stack, "stack", None)
    if stack is None:
        text = str(eqn.source_info.name_stack)
        return [s for s in text.split("/") if s and "(" not in s and ")" not in s]
    return [s.name for s in stack if type(s).__name__ == "Scope"]


def eqn_context(eqn: Any):
    """The equation's context manager (compute type, xla metadata), or a null context."""
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    return manager if manager is not None else contextlib.nullcontext()


def func_name(jaxpr: Any, default: str) -> str:
    """The Python function a (sub-)jaxpr was traced from (e.g. ``'minibatch_step'``), else ``default``."""
    info = getattr(jaxpr, "debug_info", None)
    name = getattr(info, "func_name", None) if info is not None else None
    if not name:
        src = getattr(info, "func_src_info", None)
        name = src.split(" ")[0] if isinstance(src, str) and src else None
    if not name or name in ("<unknown>", "unknown", "<lambda>"):
        return default
    return str(name)


def has_effects(eqn: Any) -> bool:
    return bool(getattr(eqn, "effects", None))
