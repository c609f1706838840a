"""rose-jax algorithms: PPO and SAC as pure functions over explicit pytree state.

Each algorithm module has ``<Name>Config`` (a frozen dataclass), ``init(config, env, key)``,
``iteration(config, env)``, ``epoch``, ``evaluate`` and a ``train(env, config=None, **overrides)``
driver; :func:`get` returns its :class:`~algos.registry.Algo` record.
"""

from __future__ import annotations

from algos.registry import Algo, get, make_config, names, register


def train_many(*args, **kwargs):
    """K seeds of one config as one vmapped program: :func:`algos.sweep.train_many`."""
    from algos import sweep

    return sweep.train_many(*args, **kwargs)


def load_policy(run_dir):
    """``act(obs, key=None)`` of the policy saved in ``run_dir``: :func:`algos.policy.load_policy`."""
    from algos import policy

    return policy.load_policy(run_dir)


__all__ = ["Algo", "get", "load_policy", "make_config", "names", "register", "train_many"]
