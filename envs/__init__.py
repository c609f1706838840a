"""rose-jax environments: one protocol (:mod:`envs.core`), one registry (:func:`make`).

Adding an environment: write ``envs/<name>.py`` with a ``make(**kw) -> Env`` factory (usually
``core.build(name, Dynamics(...))``) and add one line to ``_REGISTRY`` below.  Factories are
imported lazily, so ``import envs`` stays cheap (Brax and MuJoCo load only when asked for).
"""

from __future__ import annotations

import importlib

from envs.core import Dynamics, Env, EnvState, build

# name -> "module:factory"; keyword arguments of make() go to the factory.
_REGISTRY: dict[str, str] = {
    # pure-JAX classics (fast on CPU, used by the tests)
    "pendulum": "envs.classic:make_pendulum",
    "cartpole": "envs.classic:make_cartpole",
    "point_mass": "envs.classic:make_point_mass",
    # Brax environments (envs/brax_envs.py); each takes backend="mjx"|"generalized"|"positional"|"spring"
    "ant": "envs.brax_envs:make_ant",
    "halfcheetah": "envs.brax_envs:make_halfcheetah",
    "hopper": "envs.brax_envs:make_hopper",
    "humanoid": "envs.brax_envs:make_humanoid",
    "humanoidstandup": "envs.brax_envs:make_humanoidstandup",
    "inverted_pendulum": "envs.brax_envs:make_inverted_pendulum",
    "reacher": "envs.brax_envs:make_reacher",
    "walker2d": "envs.brax_envs:make_walker2d",
    # plain MJX from MJCF (envs/mjcf.py): any model (xml=...), and the shipped envs/assets/ models
    "mjcf": "envs.mjcf:make_mjcf",
    "mjx_cartpole": "envs.mjcf:make_mjx_cartpole",
    "mjx_swimmer": "envs.mjcf:make_mjx_swimmer",
}

# "prefix:name" -> factory(name, **kw): other packages' envs (optional extras; see each module)
_PREFIXES: dict[str, str] = {
    "playground": "envs.playground:make_playground",
    "gymnax": "envs.gymnax_envs:make_gymnax",
}


def names() -> list[str]:
    """All registered environment names, sorted."""
    return sorted(_REGISTRY)


def external_names() -> list[str]:
    """``playground:<Name>`` / ``gymnax:<id>`` names of the installed optional packages, sorted."""
    from envs import gymnax_envs, playground

    return playground.names() + gymnax_envs.names()


def factory_path(name: str) -> str:
    """The ``"module:function"`` factory of a registered env name ("" when it is not registered)."""
    return _REGISTRY.get(name, "")


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:factory"`` (for environments living outside this package)."""
    if ":" not in target:
        raise ValueError(f"register({name!r}, {target!r}): target must look like 'package.module:factory'")
    _REGISTRY[name] = target


def make(name: str, /, **kwargs) -> Env:
    """Build the environment registered as ``name``; keyword arguments go to its factory.

    ``"playground:<Name>"`` and ``"gymnax:<id>"`` build MuJoCo Playground / gymnax envs.
    """
    prefix, sep, rest = name.partition(":")
    if sep and prefix in _PREFIXES and name not in _REGISTRY:
        module_name, factory_name = _PREFIXES[prefix].split(":")
        factory = getattr(importlib.import_module(module_name), factory_name)
        try:
            return factory(rest, **kwargs)
        except TypeError as e:
            raise ValueError(f"env {name!r}: bad arguments {sorted(kwargs)}: {e}") from None
    if name not in _REGISTRY:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(names())}")
    module_name, factory_name = _REGISTRY[name].split(":")
    factory = getattr(importlib.import_module(module_name), factory_name)
    try:
        return factory(**kwargs)
    except TypeError as e:  # an unexpected keyword: say which env and which keyword
        raise ValueError(f"env {name!r}: bad arguments {sorted(kwargs)}: {e}") from None


__all__ = ["Dynamics", "Env", "EnvState", "build", "external_names", "make", "names", "register"]
