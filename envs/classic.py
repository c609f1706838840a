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
    g, m, length, dt, max_speed, max_torque = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0

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
        thdot = jnp.clip(
            thdot + (3 * g / (2 * length) * jnp.sin(th) + 3.0 / (m * length**2) * u) * dt,
            -max_speed,
            max_speed,
        )
        s = jnp.stack([th + thdot * dt, thdot])
        return s, obs_of(s), -cost, jnp.zeros((), jnp.bool_)

    return build("pendulum", Dynamics(3, 1, init, transition), episode_length, reset_mode)


def make_cartpole(episode_length: int = 500, reset_mode: str = "sample") -> Env:
    """Cart-pole balancing (Barto et al. 1983, gym's CartPole-v1 physics) with a continuous force.

    obs (x, x_dot, theta, theta_dot); force = 10 N * action; reward 1 per step while the pole is
    within 12 degrees and the cart within 2.4 m, else the episode terminates. A random policy lasts
    about 20 steps; a perfect one collects ``episode_length``.
    """
    gravity, m_cart, m_pole, half_len, force_mag, dt = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass, pole_ml = m_cart + m_pole, m_pole * half_len
    theta_limit, x_limit = 12 * 2 * jnp.pi / 360, 2.4

    def init(key):
        s = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
        return s, s.astype(jnp.float32)

    def transition(s, action):
        x, x_dot, theta, theta_dot = s[0], s[1], s[2], s[3]
        force = force_mag * jnp.clip(action[0], -1.0, 1.0)
        cos, sin = jnp.cos(theta), jnp.sin(theta)
        temp = (force + pole_ml * theta_dot**2 * sin) / total_mass
        theta_acc = (gravity * sin - cos * temp) / (half_len * (4.0 / 3.0 - m_pole * cos**2 / total_mass))
        x_acc = temp - pole_ml * theta_acc * cos / total_mass
        s = jnp.stack(
            [x + dt * x_dot, x_dot + dt * x_acc, theta + dt * theta_dot, theta_dot + dt * theta_acc]
        )
        terminal = (jnp.abs(s[0]) > x_limit) | (jnp.abs(s[2]) > theta_limit)
        return s, s.astype(jnp.float32), jnp.ones((), jnp.float32), terminal

    return build("cartpole", Dynamics(4, 1, init, transition), episode_length, reset_mode)


def make_point_mass(episode_length: int = 100, reset_mode: str = "sample", dim: int = 2) -> Env:
    """A point mass pushed towards the origin: obs (position, velocity) in R^(2*dim), action a force.

    reward = -|position|; double-integrator dynamics with damping, dt 0.05. The simplest
    continuous-control sanity check (solved by a linear policy).
    """
    if dim <= 0:
        raise ValueError(f"env 'point_mass': dim must be > 0, got {dim}")
    dt, damping = 0.05, 0.1

    def init(key):
        s = jax.random.uniform(key, (2 * dim,), minval=-1.0, maxval=1.0)
        return s, s.astype(jnp.float32)

    def transition(s, action):
        pos, vel = s[:dim], s[dim:]
        vel = vel + dt * (jnp.clip(action, -1.0, 1.0) - damping * vel)
        pos = pos + dt * vel
        s = jnp.concatenate([pos, vel])
        return s, s.astype(jnp.float32), -jnp.linalg.norm(pos), jnp.zeros((), jnp.bool_)

    return build("point_mass", Dynamics(2 * dim, dim, init, transition), episode_length, reset_mode)
