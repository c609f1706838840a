"""Named sets of default hyperparameters: ``preset="brax"`` gives Brax's own defaults.

    config = presets.make_config("ppo", "brax", env, num_timesteps=1_000_000, num_envs=2048)

A preset replaces the config class's defaults; keywords given by the caller still win. Values
that depend on the environment (SAC's target entropy ``-0.5 * action_size``) are functions of
the env, resolved by :func:`overrides`.

``"brax"`` is ``brax.training.agents.{ppo,sac}.train``'s defaults (brax 0.14.2) and its default
networks (``make_ppo_networks``: policy 4 x 32, value 5 x 256, swish; ``make_sac_networks``:
2 x 256 relu), so that a Brax user's keywords mean what they meant in Brax. The remaining
differences are listed in ``docs/COMING_FROM_BRAX.md``.
"""

from __future__ import annotations

from typing import Any

# The defaults that brax.training.agents.ppo.train and sac.train have in common.
_BRAX_SHARED: dict[str, Any] = dict(
    num_envs=1,
    learning_rate=1e-4,
    discounting=0.9,
    normalize_observations=False,
    reward_scaling=1.0,
    num_evals=1,
    num_eval_envs=128,
    deterministic_eval=False,
    seed=0,
)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "ppo": {
        "brax": dict(
            _BRAX_SHARED,
            entropy_cost=1e-4,
            unroll_length=10,
            batch_size=32,
            num_minibatches=16,
            num_updates_per_batch=2,
            clipping_epsilon=0.3,
            gae_lambda=0.95,
            max_grad_norm=None,
            normalize_advantage=True,
            value_cost=0.5,
            policy_hidden_sizes=(32, 32, 32, 32),
            value_hidden_sizes=(256, 256, 256, 256, 256),
            activation="swish",
            action_repeat=1,
        ),
    },
    "sac": {
        "brax": dict(
            _BRAX_SHARED,
            alpha_learning_rate=3e-4,
            batch_size=256,
            tau=0.005,
            min_replay_size=0,
            max_replay_size=None,
            grad_updates_per_step=1,
            policy_hidden_sizes=(256, 256),
            q_hidden_sizes=(256, 256),
            activation="relu",
            target_entropy=lambda env: -0.5 * env.action_size,
            prefill_with_policy=True,
            initial_eval=True,
        ),
    },
}


# Brax's published configurations (the training notebook, brax/training/learner colab), as the
# keywords a Brax user passes to ``ppo.train`` / ``sac.train``; rose-jax's drop-in accepts them as is.
PUBLISHED: dict[tuple[str, str], dict[str, Any]] = {
    ("ppo", "ant"): dict(
        num_timesteps=50_000_000,
        num_evals=10,
        reward_scaling=10,
        episode_length=1000,
        normalize_observations=True,
        action_repeat=1,
        unroll_length=5,
        num_minibatches=32,
        num_updates_per_batch=4,
        discounting=0.97,
        learning_rate=3e-4,
        entropy_cost=1e-2,
        num_envs=4096,
        batch_size=2048,
        seed=1,
    ),
    ("ppo", "humanoid"): dict(
        num_timesteps=50_000_000,
        num_evals=10,
        reward_scaling=0.1,
        episode_length=1000,
        normalize_observations=True,
        action_repeat=1,
        unroll_length=10,
        num_minibatches=32,
        num_updates_per_batch=8,
        discounting=0.97,
        learning_rate=3e-4,
        entropy_cost=1e-3,
        num_envs=2048,
        batch_size=1024,
        seed=1,
    ),
    ("ppo", "halfcheetah"): dict(
        num_timesteps=50_000_000,
        num_evals=20,
        reward_scaling=1,
        episode_length=1000,
        normalize_observations=True,
        action_repeat=1,
        unroll_length=20,
        num_minibatches=32,
        num_updates_per_batch=8,
        discounting=0.95,
        learning_rate=3e-4,
        entropy_cost=1e-3,
        num_envs=2048,
        batch_size=512,
        seed=3,
    ),
    ("ppo", "reacher"): dict(
        num_timesteps=50_000_000,
        num_evals=20,
        reward_scaling=5,
        episode_length=1000,
        normalize_observations=True,
        action_repeat=4,
        unroll_length=50,
        num_minibatches=32,
        num_updates_per_batch=8,
        discounting=0.95,
        learning_rate=3e-4,
        entropy_cost=1e-3,
        num_envs=2048,
        batch_size=256,
        max_devices_per_host=8,
        seed=1,
    ),
    ("sac", "hopper"): dict(
        num_timesteps=6_553_600,
        num_evals=20,
        reward_scaling=30,
        episode_length=1000,
        normalize_observations=True,
        action_repeat=1,
        discounting=0.997,
        learning_rate=6e-4,
        num_envs=128,
        batch_size=512,
        grad_updates_per_step=64,
        max_devices_per_host=1,
        max_replay_size=1048576,
        min_replay_size=8192,
        seed=1,
    ),
}


def published(algo: str, env: str) -> dict[str, Any]:
    """A copy of Brax's published keywords for ``algo`` on ``env`` (one-line error if unknown)."""
    if (algo, env) not in PUBLISHED:
        known = ", ".join(f"{a}/{e}" for a, e in PUBLISHED)
        raise ValueError(f"no published Brax configuration for {algo}/{env}; known: {known}")
    return dict(PUBLISHED[(algo, env)])

# Brax keywords of a published configuration that are not rose-jax config fields: the device count
# (rose-jax trains on one device) and, for SAC, the env's time limit (an env argument there).
_NOT_CONFIG = ("max_devices_per_host",)


def published_run(algo: str, env: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Brax's published configuration of ``algo`` on ``env`` as (rose-jax config fields, env
    arguments) (:func:`brax_run`). One-line ValueError if none is published."""
    return brax_run(algo, published(algo, env))


def brax_run(algo: str, keywords: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Brax ``train`` keywords as (rose-jax config fields, env arguments): ``episode_length``
    becomes the env's time limit (and stays a PPO config field, as Brax's PPO keeps it), the device
    count is dropped. Apply over the ``"brax"`` preset (Brax's keywords change Brax's defaults).
    A keyword that is no config field of ``algo`` is a one-line ValueError."""
    from algos import registry

    kw = dict(keywords)
    env_kwargs = {"episode_length": kw.get("episode_length", 1000)}
    for key in _NOT_CONFIG:
        kw.pop(key, None)
    if algo == "sac":
        kw.pop("episode_length", None)
        if kw.pop("action_repeat", 1) != 1:
            raise ValueError("sac with Brax's action_repeat != 1 is not supported")
    unknown = sorted(set(kw) - set(registry.get(algo).keys()))
    if unknown:
        raise ValueError(f"{algo}: Brax keyword(s) {unknown} are not rose-jax config fields")
    return kw, env_kwargs


# The CLI's no-argument job (``rose-jax`` alone), per platform: on a CPU small enough to finish in
# < 2 minutes on 2 cores and visibly learn; on a GPU a real MJX task.
DEFAULT_JOBS: dict[str, dict[str, Any]] = {
    "cpu": dict(
        env="cartpole",
        algo="ppo",
        steps=400_000,
        overrides=dict(num_envs=64, unroll_length=32, num_minibatches=8, num_epochs=4),
    ),
    "gpu": dict(
        env="ant",
        algo="ppo",
        steps=20_000_000,
        overrides=dict(
            num_envs=4096,
            unroll_length=10,
            num_minibatches=16,
            num_epochs=4,
            reward_scaling=10.0,
            entropy_cost=1e-2,
            discounting=0.97,
        ),
    ),
}

def names(algo: str) -> list[str]:
    """The presets of ``algo`` (``'ppo'`` or ``'sac'``)."""
    return sorted(PRESETS.get(algo, {}))


def overrides(algo: str, preset: str | None, env: Any = None) -> dict[str, Any]:
    """The preset's field values for ``env`` (``{}`` for ``preset=None``).

    Raises a one-line ValueError for an unknown preset, or when a value needs ``env`` and none
    was given.
    """
    if preset is None:
        return {}
    table = PRESETS.get(algo, {})
    if preset not in table:
        raise ValueError(f"unknown {algo} preset {preset!r}; presets: {', '.join(names(algo)) or 'none'}")
    out = {}
    for key, value in table[preset].items():
        if callable(value):
            if env is None or isinstance(env, str):
                raise ValueError(f"{algo} preset {preset!r}: {key} depends on the env; pass an Env object")
            value = value(env)
        out[key] = value
    return out


def make_config(algo: str, preset: str | None, env: Any = None, config: Any = None, **given: Any) -> Any:
    """``algo``'s config: the preset's values (or ``config``'s), then ``given`` on top, validated."""
    from algos import registry

    record = registry.get(algo)
    base = {} if config is not None else overrides(algo, preset, env)
    if config is not None and preset is not None:
        raise ValueError(f"{algo}: give a config or a preset, not both")
    return record.make_config(config, **{**base, **given})


__all__ = ["PRESETS", "PUBLISHED", "brax_run", "make_config", "names", "overrides", "published",
           "published_run"]
