"""Pure-JAX classic control environments, small and fast enough for CPU tests.

Each is a :class:`envs.core.Dynamics` wrapped by :func:`envs.core.build`. Actions are in [-1, 1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from envs.core import Dynamics, Env, build


def make_pendulum(episode_length: int = 200, reset_mode: str = "sample") -> Env:
    """Gym's Pendulum-v1 swing-up: obs (cos th, sin th, th_dot), torque in [-2, 2], reward <= 0.

    A random policy scores about -1200 per 200-step episode; a good one above -200.
    """
    g, m, l, dt, max_speed, max_torque = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0

    def obs_of(s):
        th, thdot = s[0], s[1]
        return jnp.stack([jnp.cos(th), jnp.sin(th), thdot]).astype(jnp.float32)

    def init(key):
        s = jax.random.uniform(key, (2,), minval=jnp.array([-jnp.pi, -1.0]), maxval=jnp.array([jnp.pi, 1.0]))
        return s, obs_of(s)

    def transition(s, action):
        th, thdot = s[0], s[1]
        u = jnp.clip(action[0], -1.0, 1.0) * max_torque
        th_norm = ((th + jnp.pi) % (2 * jnp.pi)) - jnp.pi
        cost = th_norm**2 + 0.1 * thdot**2 + 0.001 * u**2
        thdot = jnp.clip(thdot + (3 * g / (2 * l) * jnp.sin(th) + 3.0 / (m * l**2) * u) * dt, -max_speed, max_speed)
        s = jnp.stack([th + thdot * dt, thdot])
        return s, obs_of(s), -cost, jnp.zeros((), jnp.bool_)

    return build("pendulum", Dynamics(3, 1, init, transition), episode_length, reset_mode)
