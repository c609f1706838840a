"""gymnax environments behind the rose-jax protocol: ``envs.make("gymnax:Pendulum-v1")``.

gymnax (optional: ``pip install gymnax``; it pins ``jax<0.12`` but runs on 0.12, so ``pip install
--no-deps gymnax gymnasium seaborn six`` works there) provides ``reset_env(key, params)`` and
``step_env(key, state, action, params)`` without auto-reset; :func:`make_gymnax` wraps them as a
:class:`envs.core.Dynamics` (time limit ``params.max_steps_in_episode``, gymnax's terminal flag
as termination) and :func:`envs.core.build` adds the episode bookkeeping.

Actions: rose-jax policies act in ``[-1, 1]^action_size``. A ``Box`` action space is rescaled
linearly to ``[low, high]``; a ``Discrete(n)`` space gets ``action_size = n`` and takes the
argmax (a continuous policy over n scores; fine for learning tests, not an exact categorical
policy). Observations are flattened to one float32 vector.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from envs.core import Dynamics, Env, build

PREFIX = "gymnax"


def _gymnax():
    try:
        import gymnax
    except ImportError:
        raise ValueError(
            "gymnax envs need gymnax: pip install gymnax "
            "(or pip install --no-deps gymnax gymnasium seaborn six)"
        ) from None
    return gymnax


def names() -> list[str]:
    """``gymnax:<id>`` for every registered gymnax env ([] if gymnax is not installed)."""
    try:
        gymnax = _gymnax()
    except ValueError:
        return []
    return sorted(f"{PREFIX}:{n}" for n in gymnax.registered_envs)


def make_gymnax(env_id: str, *, episode_length: int | None = None, **env_kwargs) -> Env:
    """``gymnax:<env_id>`` as a rose-jax Env; ``episode_length`` defaults to gymnax's time limit."""
    gymnax = _gymnax()
    if env_id not in gymnax.registered_envs:
        known = ", ".join(sorted(gymnax.registered_envs))
        raise ValueError(f"unknown gymnax env {env_id!r}; gymnax envs: {known}")
    env, params = gymnax.make(env_id, **env_kwargs)
    obs_shape = env.observation_space(params).shape
    obs_size = int(math.prod(obs_shape))
    space = env.action_space(params)
    discrete = hasattr(space, "n") and not hasattr(space, "low")
    if discrete:
        act_size = int(space.n)

        def to_env_action(a):
            return jnp.argmax(a).astype(jnp.int32)

    else:
        act_shape = tuple(space.shape)
        act_size = int(math.prod(act_shape))
        low = jnp.broadcast_to(jnp.asarray(space.low, jnp.float32), act_shape)
        high = jnp.broadcast_to(jnp.asarray(space.high, jnp.float32), act_shape)

        def to_env_action(a):
            a = jnp.clip(a, -1.0, 1.0).reshape(act_shape)
            return low + (a + 1.0) * 0.5 * (high - low)

    def init(key):
        reset_key, key = jax.random.split(key)
        obs, state = env.reset_env(reset_key, params)
        return (state, key), jnp.asarray(obs, jnp.float32).reshape(obs_size)

    def transition(carry, action):
        state, key = carry
        step_key, key = jax.random.split(key)
        obs, state, reward, terminal, _ = env.step_env(step_key, state, to_env_action(action), params)
        obs = jnp.asarray(obs, jnp.float32).reshape(obs_size)
        reward = jnp.asarray(reward, jnp.float32).reshape(())
        return (state, key), obs, reward, jnp.asarray(terminal).reshape(())

    length = int(params.max_steps_in_episode) if episode_length is None else episode_length
    return build(f"{PREFIX}:{env_id}", Dynamics(obs_size, act_size, init, transition), length, "sample")


__all__ = ["make_gymnax", "names"]
