"""The environment protocol every rose-jax environment follows.

An environment author writes a :class:`Dynamics`: two pure functions over a physics pytree
(``init(key) -> (pipeline_state, obs)`` and ``transition(pipeline_state, action) ->
(pipeline_state, obs, reward, terminal)``) for ONE environment. :func:`build` turns it into an
:class:`Env`, whose ``step`` adds the time limit, episode bookkeeping and auto-reset, so that a
rollout over a batch of environments is one ``jax.vmap`` inside one ``jax.lax.scan``.

Conventions (the same as Brax's):
  * actions are in ``[-1, 1]^action_size``; the dynamics rescale them;
  * ``reset`` and ``step`` act on one environment; algorithms ``jax.vmap`` them;
  * after a step that ends an episode, ``obs`` and ``pipeline_state`` already belong to the
    next episode's first state, while ``reward``/``done``/``truncated`` describe the finished
    transition (``done`` = terminal or time limit, ``truncated`` = time limit only).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

PRNGKey = jax.Array


@struct.dataclass
class EnvState:
    """State of one environment (batch it with ``jax.vmap``).

    Shapes are for one environment; every leaf gets a leading batch axis under vmap.
    """

    pipeline_state: Any  # physics state (MJX ``Data``, Brax ``State``, or a small array)
    obs: jax.Array  # (observation_size,) float32
    reward: jax.Array  # () float32, reward of the last transition
    done: jax.Array  # () float32, 1.0 if the last transition ended the episode
    truncated: jax.Array  # () float32, 1.0 if it ended by the time limit
    steps: jax.Array  # () int32, steps taken in the current episode
    episode_return: jax.Array  # () float32, return so far of the current episode
    last_episode_return: jax.Array  # () float32, return of the last finished episode
    episodes: jax.Array  # () int32, number of finished episodes
    key: jax.Array  # PRNG key used for the next reset (``reset_mode='sample'``)
    first: Any = None  # (pipeline_state, obs) restored on reset (``reset_mode='first'``), else None


class Dynamics(NamedTuple):
    """What an environment file provides: the physics of one environment, no bookkeeping."""

    observation_size: int
    action_size: int
    init: Callable[[PRNGKey], tuple[Any, jax.Array]]
    transition: Callable[[Any, jax.Array], tuple[Any, jax.Array, jax.Array, jax.Array]]


class Env(NamedTuple):
    """A pure-function environment: ``reset(key) -> EnvState``, ``step(state, action) -> EnvState``."""

    name: str
    observation_size: int
    action_size: int
    episode_length: int
    reset: Callable[[PRNGKey], EnvState]
    step: Callable[[EnvState, jax.Array], EnvState]


def _check_action(name: str, action_size: int, action: jax.Array) -> None:
    shape = jnp.shape(action)
    if shape != (action_size,):
        raise ValueError(
            f"env {name!r}: action has shape {shape}, expected ({action_size},) for one environment "
            f"(vmap env.step over a batch; action_size={action_size})"
        )


def build(name: str, dynamics: Dynamics, episode_length: int = 1000, reset_mode: str = "sample") -> Env:
    """Wrap ``dynamics`` with a time limit, episode bookkeeping and auto-reset.

    Args:
      name: registry name, used in error messages.
      dynamics: the environment's physics.
      episode_length: steps after which an episode is truncated (> 0).
      reset_mode: ``'sample'`` draws a fresh initial state from the state's key at every reset;
        ``'first'`` restores the episode's first state (Brax's AutoResetWrapper; cheaper when
        ``init`` is expensive, e.g. an MJX forward pass).
    """
    if episode_length <= 0:
        raise ValueError(f"env {name!r}: episode_length must be > 0, got {episode_length}")
    if reset_mode not in ("sample", "first"):
        raise ValueError(f"env {name!r}: reset_mode must be 'sample' or 'first', got {reset_mode!r}")
    obs_size, act_size = dynamics.observation_size, dynamics.action_size

    def reset(key: PRNGKey) -> EnvState:
        init_key, next_key = jax.random.split(key)
        pipeline_state, obs = dynamics.init(init_key)
        zero = jnp.zeros((), jnp.float32)
        return EnvState(
            pipeline_state=pipeline_state,
            obs=obs,
            reward=zero,
            done=zero,
            truncated=zero,
            steps=jnp.zeros((), jnp.int32),
            episode_return=zero,
            last_episode_return=zero,
            episodes=jnp.zeros((), jnp.int32),
            key=next_key,
            first=(pipeline_state, obs) if reset_mode == "first" else None,
        )

    def step(state: EnvState, action: jax.Array) -> EnvState:
        _check_action(name, act_size, action)
        pipeline_state, obs, reward, terminal = dynamics.transition(state.pipeline_state, action)
        reward = jnp.asarray(reward, jnp.float32)
        steps = state.steps + 1
        truncated = jnp.logical_and(steps >= episode_length, jnp.logical_not(terminal > 0))
        done = jnp.logical_or(terminal > 0, truncated)
        episode_return = state.episode_return + reward

        if reset_mode == "first":
            reset_ps, reset_obs = state.first
            key = state.key
        else:
            reset_key, key = jax.random.split(state.key)
            reset_ps, reset_obs = dynamics.init(reset_key)

        def pick(fresh, current):
            return jnp.where(done, fresh, current)

        return state.replace(
            pipeline_state=jax.tree.map(pick, reset_ps, pipeline_state),
            obs=pick(reset_obs, obs),
            reward=reward,
            done=done.astype(jnp.float32),
            truncated=truncated.astype(jnp.float32),
            steps=jnp.where(done, 0, steps),
            episode_return=jnp.where(done, 0.0, episode_return),
            last_episode_return=jnp.where(done, episode_return, state.last_episode_return),
            episodes=state.episodes + done.astype(jnp.int32),
            key=key,
        )

    return Env(name, obs_size, act_size, episode_length, reset, step)


def check_obs_size(env: Env, obs: jax.Array) -> None:
    """Raise a clear error when an observation batch does not match ``env.observation_size``."""
    if jnp.shape(obs)[-1] != env.observation_size:
        raise ValueError(
            f"env {env.name!r}: observation has last dimension {jnp.shape(obs)[-1]}, "
            f"expected {env.observation_size}"
        )


def mean_finished_return(env_state: EnvState) -> jax.Array:
    """Mean ``last_episode_return`` over the envs of a batch that finished an episode; NaN if none."""
    finished = env_state.episodes > 0
    count = jnp.sum(finished)
    total = jnp.sum(jnp.where(finished, env_state.last_episode_return, 0.0))
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)
