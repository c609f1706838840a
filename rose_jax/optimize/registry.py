"""The transformation families and transformations by name.

A family is one module under ``rose_jax/optimize/`` and one line of :data:`_FAMILIES`: the
module's import path and the names of the transforms it makes, each the module's factory
function of that name (``Transform`` s built on :mod:`rose_jax.optimize.base`), plus the module's
``candidates(ctx) -> list[Candidate]`` (:mod:`rose_jax.optimize.predict`), which
:func:`rose_jax.optimize.candidates.generate_candidates` calls for the search, family by family
in this order.

Cached plans and worker processes name transformations as ``(name, JSON params)``:
``transform_by_name(name, params)`` rebuilds one. Everything is named by strings and imported on
first use: this module imports no transformation module, so any of them (and the worker entry
points) can use it without an import circle. :func:`register_transform` adds a transform
without candidates (e.g. a test's), :func:`register_family` a family.
"""

from __future__ import annotations

import importlib
from typing import Callable

from rose_jax.optimize.base import Transform

# family module -> the transforms it makes (its functions of these names), in generation order
_FAMILIES: dict[str, tuple[str, ...]] = {
    "rose_jax.optimize.scans": ("unroll_scans", "hoist_invariants"),
    "rose_jax.optimize.hoist": ("hoist_independent",),
    "rose_jax.optimize.early_exit": ("exit_idle_loops",),
    "rose_jax.optimize.stack_carry": ("stack_carries",),
    "rose_jax.optimize.inplace": ("update_in_place",),
    "rose_jax.optimize.twins": ("batch_twins",),
    "rose_jax.optimize.dense_chains": ("fuse_dense_chains",),
    "rose_jax.optimize.fuse": ("overlap_independent",),
    "rose_jax.optimize.offload": ("offload_component",),
    "rose_jax.optimize.group_rollout": ("group_rollout",),
    "rose_jax.optimize.split_compile": ("split_compile",),
    "rose_jax.optimize.stream_overlap": ("stream_overlap",),
    "rose_jax.optimize.loops": ("bound_while_loops",),
}

_FACTORIES: dict[str, str | Callable[..., Transform]] = {
    name: f"{module}:{name}" for module, names in _FAMILIES.items() for name in names
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


def register_family(module: str, names: tuple[str, ...]) -> None:
    """Add the family ``module`` (an import path): its functions ``names`` make transforms of
    those names, its ``candidates(ctx)`` generates them for the search (after the others)."""
    if not module or isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"register_family: need a module path and transform names, got {module!r}, {names!r}"
        )
    _FAMILIES[module] = tuple(names)
    for name in names:
        _FACTORIES[name] = f"{module}:{name}"


def known_transforms() -> list[str]:
    """The registered names, sorted."""
    return sorted(_FACTORIES)


def families() -> dict[str, tuple[str, ...]]:
    """``{family module: the transform names it makes}``, in generation order."""
    return dict(_FAMILIES)


def family_candidates(module: str) -> Callable:
    """The family's ``candidates(ctx) -> list[Candidate]`` (its module imported now)."""
    if module not in _FAMILIES:
        raise ValueError(f"unknown family {module!r}; known: {', '.join(_FAMILIES)}")
    return importlib.import_module(module).candidates


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
