"""rose-jax algorithms: PPO and SAC as pure functions over explicit pytree state.

Each algorithm module has ``<Name>Config`` (a frozen dataclass), ``init(config, env, key)``,
``iteration(config, env)`` and a ``train(env, **hyperparameters)`` driver.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

_ALGOS = {"ppo": ("algos.ppo", "PPOConfig"), "sac": ("algos.sac", "SACConfig")}


def names() -> list[str]:
    return sorted(_ALGOS)


def get(name: str) -> ModuleType:
    """The algorithm module registered as ``name`` (``'ppo'`` or ``'sac'``)."""
    if name not in _ALGOS:
        raise ValueError(f"unknown algo {name!r}; known algos: {', '.join(names())}")
    return importlib.import_module(_ALGOS[name][0])


def make_config(name: str, **overrides):
    """The algorithm's config dataclass with ``overrides``; unknown fields give a clear error."""
    module = get(name)
    cls = getattr(module, _ALGOS[name][1])
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {unknown}; known: {sorted(fields)}")
    return cls(**overrides)
