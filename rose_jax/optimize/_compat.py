"""The optimizer's names for :mod:`rose_jax.trace.compat`, the one module that decodes
``eqn.params`` and jaxpr layouts across JAX versions; nothing is decoded here.

The optimizer never constructs new parameter dictionaries: rewrites re-bind through the public
``jax.lax`` API (``scan``, ``while_loop``, ``switch``) so that a transformed program never
depends on the private layout. Never imports ``jax._src``.
"""

from __future__ import annotations

from typing import Any

from rose_jax.trace import compat as _compat
from rose_jax.trace.compat import (  # noqa: F401 - re-exported for the optimizer's modules
    COND,
    SCAN,
    WHILE,
    ScanParams,
    WhileParams,
    bind_eqn,
    call_jaxpr,
    cond_branches,
    eqn_context,
    has_effects,
    in_vars,
    is_dropvar,
    is_jaxpr,
    is_literal,
    open_and_consts,
    read_atom,
    scan_params,
    scope_names,
    sub_jaxprs,
    while_params,
)

# Calls the interpreter inlines (their body runs as is): jit / pjit / closed_call / core_call.
CALL_PRIMITIVES = _compat.PLAIN_CALL_PRIMITIVES


def func_name(jaxpr: Any, default: str) -> str:
    """The Python function a (sub-)jaxpr was traced from (e.g. ``'minibatch_step'``), else
    ``default`` (also for ``<lambda>``: a rebuilt loop body keeps a meaningful name)."""
    return _compat.func_name(jaxpr, default, lambda_is_anonymous=True)
