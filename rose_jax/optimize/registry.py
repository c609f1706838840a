"""Transformations by name: ``transform_by_name(name, params)`` rebuilds a :class:`Transform`.

Cached plans and worker processes name transformations as ``(name, JSON params)``. Each name
maps to its factory as a ``"package.module:function"`` string, imported on first use: this
module imports no transformation module, so any of them (and the worker entry points) can use
it without an import circle. A new transformation family is one module plus one line below (or
a :func:`register_transform` call).
"""

from __future__ import annotations

import importlib
from typing import Callable

from rose_jax.optimize.base import Transform

_FACTORIES: dict[str, str | Callable[..., Transform]] = {
    "unroll_scans": "rose_jax.optimize.scans:unroll_scans",
    "hoist_invariants": "rose_jax.optimize.scans:hoist_invariants",
    "overlap_independent": "rose_jax.optimize.fuse:overlap_independent",
    "group_rollout": "rose_jax.optimize.group_rollout:group_rollout",
    "offload_component": "rose_jax.optimize.offload:offload_component",
    "bound_while_loops": "rose_jax.optimize.loops:bound_while_loops",
    "stream_overlap": "rose_jax.optimize.streams:stream_overlap",
    "split_compile": "rose_jax.optimize.streams:split_compile",
}


def register_transform(name: str, factory: str | Callable[..., Transform]) -> None:
    """Make ``transform_by_name(name, params)`` call ``factory(**params)``.

    ``factory``: a callable, or ``"package.module:function"`` (imported on first use).
    """
    if not name or not (callable(factory) or (isinstance(factory, str) and ":" in factory)):
        raise ValueError(
            "register_transform: need a name and a callable or 'module:function' factory, "
            f"got {name!r}, {factory!r}"
        )
    _FACTORIES[name] = factory


def known_transforms() -> list[str]:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


def factory(name: str) -> Callable[..., Transform]:
    """The factory registered as ``name`` (imported now if given as a string)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown transform {name!r}; known: {', '.join(known_transforms())}")
    target = _FACTORIES[name]
    if isinstance(target, str):
        module, attr = target.split(":")
        target = getattr(importlib.import_module(module), attr)
    return target


def transform_by_name(name: str, params: dict) -> Transform:
    """Rebuild a transform from its ``name`` and JSON params (plan cache, worker processes)."""
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}
    return factory(name)(**params)
