"""A tiny RL-shaped :class:`~rose_jax.program.Program` for the optimizer's tests.

Each env is a 3-vector ``x`` with linear-tanh dynamics; the policy is ``tanh(x @ W) + noise``;
learn takes one gradient step on ``W``. It has the pieces the optimizer cares about: a rollout
``lax.scan`` with ``policy`` and ``sim`` components, per-step noise drawn for the whole batch
from one key (as ``algos.ppo`` does), a normalizer, and a learn step that mixes envs.

``variant`` builds deliberately broken programs for the legality tests:
``"normalizer_in_collect"`` updates the running mean inside the rollout (a reduction over envs
into shared state); ``"mixing"`` centres observations by the batch mean inside the sim (mixes
envs but writes nothing shared: only comparing results reveals it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

import rose_jax
from rose_jax.program import Program, ProgramSpec, RolloutParts, attr_lens

OBS = 3


@struct.dataclass
class ToyState:
    w: jax.Array  # (OBS, OBS) policy weights
    mean: jax.Array  # (OBS,) running observation mean (the "normalizer")
    x: jax.Array  # (N, OBS) env states
    key: jax.Array  # raw uint32[2]
    steps: jax.Array  # () int32


def init(num_envs: int, seed: int = 0) -> ToyState:
    kw, kx, key = jax.random.split(jax.random.PRNGKey(seed), 3)
    return ToyState(
        w=0.3 * jax.random.normal(kw, (OBS, OBS)),
        mean=jnp.zeros((OBS,)),
        x=jax.random.normal(kx, (num_envs, OBS)),
        key=key,
        steps=jnp.zeros((), jnp.int32),
    )


def toy_program(num_envs: int = 8, unroll_length: int = 5, variant: str = "ok") -> Program:
    """The toy program (see the module docstring).

    ``variant``: ``"ok"`` | ``"normalizer_in_collect"`` | ``"mixing"``."""
    if variant not in ("ok", "normalizer_in_collect", "mixing"):
        raise ValueError(f"toy_program: unknown variant {variant!r}")
    T = unroll_length

    shared_mean = variant == "normalizer_in_collect"  # the rollout carries (and updates) the mean

    def start(state):
        rollout_key, _ = jax.random.split(state.key)
        carry = (state.x, state.mean) if shared_mean else state.x
        return (state.w, state.mean), carry, jax.random.split(rollout_key, T)

    def step(consts, carry, step_key, g, groups):
        w, mean = consts
        x, mean = carry if shared_mean else (carry, mean)
        n = x.shape[0]
        with rose_jax.component("policy"):
            noise = jax.random.normal(step_key, (n * groups, OBS))[g * n : (g + 1) * n]
            action = jnp.tanh((x - mean) @ w) + 0.1 * noise
        with rose_jax.component("sim"):
            x_next = 0.9 * jnp.tanh(x + 0.5 * action)
            if variant == "mixing":
                x_next = x_next - jnp.mean(x_next, axis=0)
        if shared_mean:
            with rose_jax.component("normalizer"):
                mean = 0.9 * mean + 0.1 * jnp.mean(x_next, axis=0)
            return (x_next, mean), (x, action)
        return x_next, (x, action)

    def finish(state, carry, ys):
        x, mean = carry if shared_mean else (carry, state.mean)
        return state.replace(x=x, mean=mean), ys  # ys: (obs (T, N, OBS), action (T, N, OBS))

    def collect(state):
        consts, carry, xs = start(state)

        def rollout_step(c, k):
            return step(consts, c, k, 0, 1)

        carry, ys = jax.lax.scan(rollout_step, carry, xs)
        return finish(state, carry, ys)

    def learn(state, data):
        obs, action = data
        _, key = jax.random.split(state.key)
        mean = state.mean
        if variant != "normalizer_in_collect":
            with rose_jax.component("normalizer"):
                mean = 0.9 * state.mean + 0.1 * jnp.mean(obs, axis=(0, 1))

        def loss(w):
            return jnp.mean((jnp.tanh((obs - mean) @ w) - 0.5 * action) ** 2)

        with rose_jax.component("update"):
            value, grad = jax.value_and_grad(loss)(state.w)
            w = state.w - 0.1 * grad
        return state.replace(w=w, mean=mean, key=key, steps=state.steps + 1), {"loss": value}

    def rollout_collect(state):
        with rose_jax.component("rollout"):
            return collect(state)

    # workers import this module by name: pytest puts tests/ on sys.path and spawned workers
    # inherit the driver's sys.path
    spec = ProgramSpec(
        "toy_program:toy_program",
        (("num_envs", num_envs), ("unroll_length", unroll_length), ("variant", variant)),
    )
    return Program(
        name=f"toy_{variant}",
        num_envs=num_envs,
        collect=rollout_collect,
        learn=learn,
        env=attr_lens("x"),
        data_env_axis=1,  # obs and action are (T, N, OBS)
        rollout=None if shared_mean else RolloutParts(T, start, step, finish),
        spec=spec,
        env_name="toy",
    )
