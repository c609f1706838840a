"""Other packages' environments behind the Env protocol: gymnax and MuJoCo Playground (optional).

Each is skipped with a reason when its package is not installed (scripts/setup.sh installs both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from algos import ppo


def _learn(env, num_timesteps: int, **kw):
    cfg = ppo.PPOConfig(num_timesteps=num_timesteps, **kw)
    before = ppo.evaluate(
        cfg, env, ppo.init(cfg, env, jax.random.PRNGKey(0)), jax.random.PRNGKey(99), num_envs=16
    )
    state, _ = ppo.train_with_config(cfg, env)
    after = ppo.evaluate(cfg, env, state, jax.random.PRNGKey(99), num_envs=16)
    return before, after


def test_gymnax_pendulum_env_follows_the_protocol():
    pytest.importorskip("gymnax", reason="gymnax is not installed (optional: pip install gymnax)")
    env = envs.make("gymnax:Pendulum-v1")
    assert (env.observation_size, env.action_size, env.episode_length) == (3, 1, 200)
    states = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), 4))
    step = jax.jit(jax.vmap(env.step))
    for _ in range(200):
        states = step(states, jnp.ones((4, 1)))
    # the time limit ends every episode (a truncation, not a termination), and auto-resets
    assert np.all(np.asarray(states.episodes) == 1) and np.all(np.asarray(states.truncated) == 1)
    assert np.all(np.asarray(states.last_episode_return) < 0)  # pendulum costs are negative
    assert "gymnax:Pendulum-v1" in envs.external_names()


def test_gymnax_cartpole_learns():
    pytest.importorskip("gymnax", reason="gymnax is not installed (optional: pip install gymnax)")
    before, after = _learn(envs.make("gymnax:CartPole-v1"), 200_000)
    assert before < 100  # the untrained policy drops the pole within 100 steps
    assert after >= 200, (before, after)  # threshold: 200 of the 500 possible steps balanced


def test_unknown_external_env_is_a_one_line_error():
    pytest.importorskip("gymnax", reason="gymnax is not installed")
    with pytest.raises(ValueError, match="unknown gymnax env") as e:
        envs.make("gymnax:NoSuchEnv-v0")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_playground_cartpole_balance_learns():
    pytest.importorskip(
        "mujoco_playground", reason="MuJoCo Playground is not installed (pip install playground)"
    )
    env = envs.make("playground:CartpoleBalance", episode_length=200)
    assert (env.observation_size, env.action_size, env.episode_length) == (5, 1, 200)
    before, after = _learn(env, 200_000, reward_scaling=1.0)
    # reward in [0, 1] per step; the untrained policy lets the pole fall (measured: 98.7 of 200);
    # 200k steps reached 150.9 (about 45 s of CPU time)
    assert before < 110
    assert after >= 130, (before, after)


def test_unknown_playground_env_is_a_one_line_error():
    pytest.importorskip(
        "mujoco_playground", reason="MuJoCo Playground is not installed (pip install playground)"
    )
    with pytest.raises(ValueError, match="unknown Playground env") as e:
        envs.make("playground:NoSuchEnv")
    assert "\n" not in str(e.value)
