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
    """The ``"module:function"`` factory of a registered env name, the package's own and those of
    :func:`register` alike ("" when it is not registered)."""
    return _REGISTRY.get(name, "")


def user_factory(name: str) -> str | None:
    """The ``"module:function"`` of an env registered from outside the package (:func:`register`),
    which a run records so that a fresh process can rebuild it (:func:`ensure_registered`); None
    for the package's own envs and unknown names."""
    factory = factory_path(name)
    return factory if factory and not factory.startswith("envs.") else None


def _check_target(name: str, target: object, what: str) -> None:
    module_name, sep, function_name = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (sep and module_name and function_name and ":" not in function_name):
        raise ValueError(f"{what}({name!r}, {target!r}): target must look like 'package.module:factory'")


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``"module:factory"`` (for environments living outside this package).

    Runs record the factory (``envs.factory_path(name)``) next to the name, so that a later
    process (``rose-jax play``, ``algos.load_policy(run).make_env()``) can register it again with
    :func:`ensure_registered`; the factory's module must then be importable there too.
    """
    _check_target(name, target, "register")
    _REGISTRY[name] = target


def known(name: str) -> bool:
    """Whether :func:`make` knows ``name`` (registered, or ``playground:``/``gymnax:`` + a name)."""
    prefix, sep, _ = name.partition(":")
    return name in _REGISTRY or bool(sep and prefix in _PREFIXES)


def ensure_registered(name: str, factory: str | None) -> None:
    """Register ``name`` -> ``factory`` when ``name`` is not known yet (a run's env that was added
    with :func:`register` in the process that trained it).

    A known name keeps its registration, whatever ``factory`` says; ``factory=None`` (the
    package's own envs) does nothing. A malformed ``factory`` for an unknown name is a ValueError.
    """
    if not factory or known(name):
        return
    _check_target(name, factory, "ensure_registered")
    _REGISTRY[name] = factory


def _load_factory(name: str, target: str):
    """The callable behind ``"module:function"``; a one-line ValueError when the module or the
    function is missing (e.g. a user module that is not on ``sys.path`` in this process)."""
    module_name, factory_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the module exists but one of its own imports is missing: keep that error
        raise ValueError(
            f"env {name!r}: cannot import {module_name!r} for its factory {target!r} "
            f"(put the module's directory on PYTHONPATH, as when the env was registered)"
        ) from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"env {name!r}: module {module_name!r} has no function {factory_name!r} "
                         f"(factory {target!r})")
    return factory


def make(name: str, /, **kwargs) -> Env:
    """Build the environment registered as ``name``; keyword arguments go to its factory.

    ``"playground:<Name>"`` and ``"gymnax:<id>"`` build MuJoCo Playground / gymnax envs.
    """
    prefix, sep, rest = name.partition(":")
    if sep and prefix in _PREFIXES and name not in _REGISTRY:
        factory = _load_factory(name, _PREFIXES[prefix])
        try:
            return factory(rest, **kwargs)
        except TypeError as e:
            raise ValueError(f"env {name!r}: bad arguments {sorted(kwargs)}: {e}") from None
    if name not in _REGISTRY:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(names())}")
    factory = _load_factory(name, _REGISTRY[name])
    try:
        return factory(**kwargs)
    except TypeError as e:  # an unexpected keyword: say which env and which keyword
        raise ValueError(f"env {name!r}: bad arguments {sorted(kwargs)}: {e}") from None


__all__ = [
    "Dynamics",
    "Env",
    "EnvState",
    "build",
    "ensure_registered",
    "external_names",
    "factory_path",
    "known",
    "make",
    "names",
    "register",
    "user_factory",
]
