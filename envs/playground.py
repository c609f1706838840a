"""MuJoCo Playground environments (and any Brax-style env object) behind the rose-jax protocol.

``envs.make("playground:CartpoleBalance")`` loads ``mujoco_playground.registry.load(name,
config_overrides={"impl": "jax", ...})`` (MJX's JAX implementation, which rose-jax can trace;
Playground's default, MuJoCo Warp, is an opaque custom call) and wraps it with
:func:`from_brax_like`. The package is optional: ``pip install playground`` (its
``warp-lang`` requirement is only needed for ``impl="warp"``: ``pip install --no-deps
playground ml-collections lxml mediapy`` is enough for ``impl="jax"``). Its dm_control suite envs
ship their MJCF; its locomotion and manipulation envs download a model repository when first
loaded, so they need a network connection once.

:func:`from_brax_like` wraps any object with Brax's env interface (``reset(key) -> State``,
``step(State, action) -> State`` with ``obs``/``reward``/``done`` fields, ``observation_size``,
``action_size``): a ``brax.envs.Env`` or a Playground ``MjxEnv``. The whole ``State`` is the
rose-jax ``pipeline_state``; :func:`envs.core.build` adds the time limit and auto-reset.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from envs.core import Dynamics, Env, build

PREFIX = "playground"


def from_brax_like(
    env: Any,
    *,
    name: str | None = None,
    episode_length: int = 1000,
    reset_mode: str = "first",
    obs_key: str = "state",
) -> Env:
    """A Brax-style env object as a rose-jax :class:`envs.core.Env`.

    Args:
      env: has ``reset(key)``, ``step(state, action)`` (states with ``obs``, ``reward``, ``done``),
        ``observation_size`` and ``action_size``; actions in [-1, 1].
      name: the Env's name (default: the object's class name).
      episode_length: time limit in env steps (Brax's / Playground's ``EpisodeWrapper``).
      reset_mode: ``'first'`` restores the episode's first state on reset (Brax's and
        Playground's default auto-reset; here ``info`` is restored too), ``'sample'`` resets
        afresh (Playground's ``full_reset=True``).
      obs_key: for dict observations, the entry used (Playground's convention: ``'state'``).
    """
    name = name or type(env).__name__
    shape = jax.eval_shape(env.reset, jax.random.PRNGKey(0))
    obs_shape = shape.obs[obs_key] if isinstance(shape.obs, dict) else shape.obs
    if isinstance(shape.obs, dict) and obs_key not in shape.obs:
        raise ValueError(f"env {name!r}: dict observation without {obs_key!r} (keys {sorted(shape.obs)})")
    if not hasattr(obs_shape, "shape") or len(obs_shape.shape) != 1:
        raise ValueError(f"env {name!r}: only flat observations are supported, got {obs_shape}")
    obs_size, act_size = int(obs_shape.shape[0]), int(env.action_size)

    def flat_obs(obs):
        return jnp.asarray(obs[obs_key] if isinstance(obs, dict) else obs, jnp.float32)

    def init(key):
        state = env.reset(key)
        return state, flat_obs(state.obs)

    def transition(state, action):
        state = env.step(state, action)
        return state, flat_obs(state.obs), state.reward, state.done

    return build(name, Dynamics(obs_size, act_size, init, transition), episode_length, reset_mode)


def names() -> list[str]:
    """``playground:<Name>`` for every dm_control suite env of the installed Playground ([] if none)."""
    from envs.mjcf import quiet_warp_notice

    try:
        with quiet_warp_notice():
            from mujoco_playground import registry
    except ImportError:
        return []
    return sorted(f"{PREFIX}:{n}" for n in registry.dm_control_suite.ALL_ENVS)


def make_playground(
    env_name: str,
    *,
    episode_length: int | None = None,
    impl: str = "jax",
    reset_mode: str = "first",
    config_overrides: dict | None = None,
) -> Env:
    """``playground:<env_name>``: a MuJoCo Playground env with MJX's ``impl`` (default ``"jax"``).

    ``episode_length`` defaults to the env config's own (1000 for the dm_control suite).
    """
    from envs.mjcf import quiet_warp_notice

    try:
        with quiet_warp_notice():
            from mujoco_playground import registry
    except ImportError:
        raise ValueError(
            f"env 'playground:{env_name}' needs MuJoCo Playground: pip install playground "
            "(or rose-jax[playground])"
        ) from None
    if env_name not in registry.ALL_ENVS:
        known = ", ".join(sorted(registry.dm_control_suite.ALL_ENVS))
        raise ValueError(f"unknown Playground env {env_name!r}; its dm_control suite envs: {known}")
    overrides = {"impl": impl, **(config_overrides or {})}
    env = registry.load(env_name, config_overrides=overrides)
    config = registry.get_default_config(env_name)
    length = episode_length if episode_length is not None else int(config.get("episode_length", 1000))
    return from_brax_like(env, name=f"{PREFIX}:{env_name}", episode_length=length, reset_mode=reset_mode)


__all__ = ["from_brax_like", "make_playground", "names"]
