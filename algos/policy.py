"""A trained policy in a run directory: :func:`save` after training, :func:`load_policy` anywhere.

Layout added to ``<run dir>/`` (next to ``rose_jax.rundir``'s files)::

    policy.json        what the policy is: algorithm, env name and kwargs, sizes, network shape,
                       the full config, env steps, the final evaluation (return, key, envs)
    policy/<steps>/    the policy parameters and the observation normalizer (orbax, atomic)

PPO's policy and SAC's actor are the same kind of network (an MLP giving a tanh-Gaussian's loc
and scale, on normalised observations), so one loader serves both::

    act = algos.load_policy("runs/ant-ppo")
    action = act(obs)                      # deterministic: tanh(loc); obs (..., observation_size)
    action = act(obs, key)                 # sampled
    env = act.make_env()                   # the env it was trained on (from the registry)

Loading needs no environment and no training code: it rebuilds the network from
``policy.json`` and reads the arrays with orbax.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp

from algos import networks, normalize

POLICY_JSON = "policy.json"
POLICY_DIR = "policy"
FINAL_EVAL_SEED = 12345  # the final evaluation's key: PRNGKey(FINAL_EVAL_SEED)


def _policy_params(state: Any) -> Any:
    """PPO: ``state.params.policy``; SAC: ``state.actor_params``."""
    if hasattr(state, "actor_params"):
        return state.actor_params
    return state.params.policy


def _normalizer_dict(n: normalize.NormalizerState) -> dict[str, Any]:
    return {"count": n.count, "mean": n.mean, "summed_variance": n.summed_variance, "std": n.std}


class Policy:
    """``act(obs, key=None) -> action`` of a saved policy (jitted; obs ``(..., observation_size)``).

    Attributes: ``meta`` (``policy.json`` as a dict), ``params``, ``normalizer``, and
    :meth:`make_env` to rebuild the environment it was trained on.
    """

    def __init__(self, meta: dict[str, Any], params: Any, normalizer: normalize.NormalizerState):
        self.meta = meta
        self.params = params
        self.normalizer = normalizer
        module = networks.MLP(tuple(meta["policy_hidden_sizes"]), 2 * meta["action_size"], meta["activation"])
        norm_obs = bool(meta["normalize_observations"])

        def dist(params, normalizer, obs):
            x = normalize.apply(normalizer, obs) if norm_obs else obs
            return networks.tanh_gaussian(module.apply(params, x))

        self._mode = jax.jit(lambda p, n, obs: networks.mode(dist(p, n, obs)))
        self._sample = jax.jit(lambda p, n, obs, key: jnp.tanh(networks.sample_raw(dist(p, n, obs), key)))

    @property
    def observation_size(self) -> int:
        return int(self.meta["observation_size"])

    @property
    def action_size(self) -> int:
        return int(self.meta["action_size"])

    def __call__(self, obs: jax.Array, key: jax.Array | None = None) -> jax.Array:
        obs = jnp.asarray(obs, jnp.float32)
        if obs.shape[-1:] != (self.observation_size,):
            raise ValueError(
                f"policy: obs has shape {obs.shape}, expected (..., {self.observation_size}) "
                f"(env {self.meta['env']!r})"
            )
        if key is None:
            return self._mode(self.params, self.normalizer, obs)
        return self._sample(self.params, self.normalizer, obs, key)

    def make_env(self, **overrides: Any):
        """The env the policy was trained on, rebuilt from the registry (``overrides`` replace
        its stored keyword arguments), with the run's ``action_repeat``."""
        import envs

        envs.ensure_registered(self.meta["env"], self.meta.get("env_factory"))
        env = envs.make(self.meta["env"], **{**self.meta.get("env_kwargs", {}), **overrides})
        repeat = int(self.meta.get("action_repeat", 1))
        if repeat > 1:
            from algos import ppo_brax

            env = ppo_brax.with_action_repeat(env, repeat)
        return env


def evaluate(act: Callable[..., jax.Array], env: Any, num_envs: int, key: jax.Array) -> float:
    """Mean first-episode return of ``act`` (deterministic, ``act(obs)``) over ``num_envs`` fresh
    envs run for ``env.episode_length`` steps from ``jax.vmap(env.reset)(split(key, num_envs))``."""

    @jax.jit
    def run(key):
        state = jax.vmap(env.reset)(jax.random.split(key, num_envs))

        def step(carry, _):
            state, ret, alive = carry
            state = jax.vmap(env.step)(state, act(state.obs))
            ret = ret + alive * state.reward
            return (state, ret, alive * (1.0 - state.done)), None

        zeros = jnp.zeros((num_envs,), jnp.float32)
        (_, ret, _), _ = jax.lax.scan(step, (state, zeros, zeros + 1.0), length=env.episode_length)
        return jnp.mean(ret)

    return float(run(key))


def save(
    run_dir: str | os.PathLike,
    algo: str,
    config: Any,
    state: Any,
    env: Any,
    *,
    env_name: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
    eval_envs: int = 16,
) -> dict[str, Any]:
    """Write ``policy.json`` and ``policy/<env steps>/`` into ``run_dir``; returns the metadata.

    ``env`` is the ``Env`` trained on (used for sizes and the final evaluation); ``env_name`` /
    ``env_kwargs`` (default ``env.name`` / ``{}``) must rebuild it through ``envs.make``. The
    final evaluation (``eval_envs`` envs, deterministic, key ``PRNGKey(FINAL_EVAL_SEED)``) is
    stored as ``final_eval_return``; ``eval_envs=0`` skips it.
    """
    import envs
    from algos import checkpoint
    from rose_jax.io import atomic_write_json

    run_dir = os.fspath(run_dir)
    params = jax.device_get(_policy_params(state))
    normalizer = jax.device_get(state.normalizer)
    env_steps = int(jax.device_get(state.env_steps))
    tree = {"policy": params, "normalizer": _normalizer_dict(normalizer)}
    checkpoint.save(os.path.join(run_dir, POLICY_DIR), tree, env_steps, keep=1)
    fields = dataclasses.asdict(config)
    meta = {
        "algo": algo,
        "env": env_name or env.name,
        "env_kwargs": dict(env_kwargs or {}),
        "env_factory": envs.user_factory(env_name or env.name),
        "observation_size": int(env.observation_size),
        "action_size": int(env.action_size),
        "policy_hidden_sizes": list(config.policy_hidden_sizes),
        "activation": config.activation,
        "normalize_observations": bool(config.normalize_observations),
        "action_repeat": int(fields.get("action_repeat", 1) or 1),
        "env_steps": env_steps,
        "config": json.loads(json.dumps(fields, default=str)),
    }
    if eval_envs:
        loaded = Policy(meta, params, normalizer)
        meta["final_eval_return"] = evaluate(loaded, env, eval_envs, jax.random.PRNGKey(FINAL_EVAL_SEED))
        meta["final_eval_envs"] = int(eval_envs)
        meta["final_eval_seed"] = FINAL_EVAL_SEED
    atomic_write_json(os.path.join(run_dir, POLICY_JSON), meta)
    return meta


def load_policy(run_dir: str | os.PathLike) -> Policy:
    """The policy saved in ``run_dir`` by :func:`save` (a rose-jax run directory).

    Raises a one-line ValueError when ``run_dir`` holds no saved policy.
    """
    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, POLICY_JSON)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"load_policy: {run_dir!r} holds no trained policy (no {POLICY_JSON})") from None
    except ValueError as e:
        raise ValueError(f"load_policy: {path} is not valid JSON: {e}") from None
    from algos import checkpoint

    directory = os.path.join(run_dir, POLICY_DIR)
    step = checkpoint.latest_step(directory)
    if step is None:
        raise ValueError(f"load_policy: {run_dir!r} has {POLICY_JSON} but no parameters in {POLICY_DIR}/")
    tree, _ = checkpoint.read(directory, step)
    tree = jax.tree.map(jnp.asarray, tree)
    n = tree["normalizer"]
    normalizer = normalize.NormalizerState(
        count=n["count"].astype(jnp.int32), mean=n["mean"], summed_variance=n["summed_variance"], std=n["std"]
    )
    return Policy(meta, tree["policy"], normalizer)


__all__ = ["FINAL_EVAL_SEED", "Policy", "evaluate", "load_policy", "save"]
