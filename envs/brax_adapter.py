"""A rose-jax :class:`envs.core.Env` as a Brax env object, so Brax's own trainers can run it.

``to_brax(envs.make("pendulum", episode_length=10**6))`` is a ``brax.envs.base.Env`` that
``brax.training.agents.ppo.train.train`` (and rose-jax's :mod:`algos.brax_compat`, which turns
it back into an ``Env`` with :func:`envs.playground.from_brax_like`) accepts. Brax's trainers add
their own ``EpisodeWrapper`` / ``AutoResetWrapper`` (time limit ``episode_length``, reset to the
episode's first state), so both trainers see the same episodes. The wrapped ``Env`` keeps its own
time limit and auto-reset: build it with an ``episode_length`` longer than the trainers' so that
only theirs acts (an env's own termination still ends the episode, and the trainers' reset then
replaces the state, as for any Brax env).

``import brax`` is slow, so it happens inside :func:`to_brax`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from envs.core import Env


def to_brax(env: Env) -> Any:
    """``env`` behind Brax's env interface (``reset(rng)``, ``step(state, action)``, sizes).

    The Brax ``State.pipeline_state`` is the rose-jax ``EnvState``; ``obs``/``reward``/``done``
    are its fields (``done`` as float32, as Brax's are).
    """
    if not isinstance(env, Env):
        raise TypeError(f"to_brax: expected an envs.core.Env, got {type(env).__name__}")
    from envs.mjcf import quiet_warp_notice

    with quiet_warp_notice():
        from brax.envs.base import Env as BraxEnv
        from brax.envs.base import State

    def brax_state(s, metrics, info) -> Any:
        return State(
            pipeline_state=s,
            obs=s.obs,
            reward=jnp.asarray(s.reward, jnp.float32),
            done=jnp.asarray(s.done, jnp.float32),
            metrics=metrics,
            info=info,
        )

    class Adapted(BraxEnv):
        __doc__ = f"rose-jax env {env.name!r} as a Brax env (envs.brax_adapter.to_brax)."

        def reset(self, rng):
            return brax_state(env.reset(rng), {}, {})

        def step(self, state, action):
            return brax_state(env.step(state.pipeline_state, action), state.metrics, state.info)

        @property
        def observation_size(self) -> int:
            return env.observation_size

        @property
        def action_size(self) -> int:
            return env.action_size

        @property
        def backend(self) -> str:
            return "rose-jax"

    Adapted.__name__ = Adapted.__qualname__ = f"Brax_{env.name}"
    return Adapted()


__all__ = ["to_brax"]
