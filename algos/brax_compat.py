"""Brax's training entry points, run by rose-jax: change one import line of a Brax script.

    # from brax.training.agents.ppo import train as ppo
    from algos.brax_compat import ppo

    make_inference_fn, params, metrics = ppo.train(environment=env, num_timesteps=..., ...)
    inference_fn = make_inference_fn(params, deterministic=True)
    action, _ = inference_fn(obs, key)

``ppo.train`` / ``sac.train`` take Brax's keywords with Brax's defaults (the ``"brax"`` preset of
:mod:`algos.presets`), accept a Brax env object (``brax.envs.get_environment(...)``), a rose-jax
``Env`` or a registry name, and return Brax's triple: ``make_inference_fn(params,
deterministic=False) -> policy(obs, key) -> (action, extras)``, ``params = (normalizer,
policy_params, value_or_critic_params)`` (rose-jax's pytrees) and the last progress metrics
(``eval/episode_reward`` ...). ``network_factory`` is accepted when it is a
``functools.partial`` of Brax's ``make_ppo_networks`` / ``make_sac_networks``: its hidden sizes
and activation are used. Keywords rose-jax does not implement raise a one-line TypeError;
``docs/COMING_FROM_BRAX.md`` lists them and every remaining difference.

Fast by default, as ``rose-jax train``: on a GPU the training unit is compiled under XLA's
defaults and the command-buffer option sets, tried on the run's first units and the fastest kept
(one line; the decision cached for the next run of the same program:
:func:`rose_jax.optimize.xla_options.trial_maker`). One rose-jax keyword besides Brax's:
``xla_options="auto"`` (that), ``"default"`` (XLA's defaults, no trial) or option set names.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable

import jax.numpy as jnp

from algos import networks, normalize

# Brax keywords that mean nothing here (one device; host-side options with no effect on results)
_IGNORED = {
    "max_devices_per_host",
    "wrap_env",
    "use_pmap_on_reset",
    "log_training_metrics",
    "training_metrics_steps",
}
_RENAMED_PPO = {"vf_loss_coefficient": "value_cost", "save_checkpoint_path": None}


def _network_overrides(factory: Any, algo: str) -> dict[str, Any]:
    """Hidden sizes and activation from a ``functools.partial`` of Brax's network factory."""
    if factory is None:
        return {}
    keywords = getattr(factory, "keywords", None)
    if keywords is None:
        raise TypeError(
            f"{algo}.train: network_factory must be a functools.partial of Brax's network factory"
        )
    out: dict[str, Any] = {}
    activation = keywords.get("activation")
    if activation is not None:
        out["activation"] = getattr(activation, "__name__", str(activation))
    if algo == "ppo":
        if "policy_hidden_layer_sizes" in keywords:
            out["policy_hidden_sizes"] = tuple(keywords["policy_hidden_layer_sizes"])
        if "value_hidden_layer_sizes" in keywords:
            out["value_hidden_sizes"] = tuple(keywords["value_hidden_layer_sizes"])
    elif "hidden_layer_sizes" in keywords:
        out["policy_hidden_sizes"] = out["q_hidden_sizes"] = tuple(keywords["hidden_layer_sizes"])
    unknown = sorted(
        set(keywords)
        - {"activation", "policy_hidden_layer_sizes", "value_hidden_layer_sizes", "hidden_layer_sizes"}
    )
    if unknown:
        raise TypeError(f"{algo}.train: network_factory keywords {unknown} are not supported by rose-jax")
    return out


def make_inference_fn(config: Any, action_size: int) -> Callable[..., Callable]:
    """Brax's ``make_inference_fn``: ``(params, deterministic=False) -> policy(obs, key)``, the
    policy returning ``(action, extras)``."""
    module = networks.MLP(config.policy_hidden_sizes, 2 * action_size, config.activation)

    def make_policy(params, deterministic: bool = False):
        normalizer, policy_params = params[0], params[1]

        def policy(obs, key):
            x = normalize.apply(normalizer, obs) if config.normalize_observations else obs
            dist = networks.tanh_gaussian(module.apply(policy_params, x))
            if deterministic:
                return networks.mode(dist), {}
            raw = networks.sample_raw(dist, key)
            return jnp.tanh(raw), {"raw_action": raw, "log_prob": networks.log_prob(dist, raw)}

        return policy

    return make_policy


def _train(algo: str, environment: Any, kwargs: dict[str, Any]):
    from algos import ppo as ppo_module
    from algos import ppo_brax, presets, registry

    from rose_jax.optimize import cache, xla_options

    record = registry.get(algo)
    kwargs = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    user_progress = kwargs.pop("progress_fn", None)
    sets = xla_options.sets_from_spec(kwargs.pop("xla_options", "auto"))  # one-line ValueError

    def make_step(config: Any, env: Any):
        if not sets:
            return None
        return xla_options.trial_maker(record.unit_fn(config, env), record.num_units(config), sets,
                                       log=lambda m: print(f"{algo}.train: {m}", flush=True),
                                       cache_dir=cache.default_dir())

    def progress_fn(step: int, metrics: dict) -> None:
        # Brax's names next to rose-jax's (SAC's epochs report eval_episode_return, critic_loss, ...)
        if "eval_episode_return" in metrics:
            metrics.setdefault("eval/episode_reward", metrics["eval_episode_return"])
        for key in ("actor_loss", "critic_loss", "alpha_loss", "alpha"):
            if key in metrics:
                metrics.setdefault(f"training/{key}", metrics[key])
        if user_progress is not None:
            user_progress(step, metrics)

    overrides = _network_overrides(kwargs.pop("network_factory", None), algo)
    if algo == "ppo":
        for theirs, ours in _RENAMED_PPO.items():
            if theirs in kwargs:
                value = kwargs.pop(theirs)
                if ours is not None:
                    kwargs[ours] = value
    valid = set(record.keys()) | ({"episode_length", "action_repeat"} if algo == "sac" else set())
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise TypeError(
            f"{algo}.train: Brax keyword(s) {unknown} are not implemented by rose-jax "
            f"(see docs/COMING_FROM_BRAX.md)"
        )
    overrides.update(kwargs)
    if algo == "ppo":
        config = presets.make_config(algo, "brax", None, **overrides)
        # the env at Brax's episode_length; ppo.train_with_config adds the action repeat
        env = ppo_brax.resolve_env(dataclasses.replace(config, action_repeat=1), environment)
        state, history = ppo_module.train_with_config(config, env, progress_fn=progress_fn,
                                                      make_step=make_step(config, env))
        value_params, policy_params = state.params.value, state.params.policy
    else:
        wrap = ppo_module.PPOConfig(
            episode_length=overrides.pop("episode_length"), action_repeat=overrides.pop("action_repeat", 1)
        )
        env = ppo_brax.resolve_env(wrap, environment)
        config = presets.make_config(algo, "brax", env, **overrides)
        state, history = record.train_with_config(config, env, progress_fn=progress_fn,
                                                  make_step=make_step(config, env))
        value_params, policy_params = state.critic_params, state.actor_params
    params = (state.normalizer, policy_params, value_params)
    metrics = history[-1] if history else {}
    return make_inference_fn(config, env.action_size), params, metrics


def ppo_train(environment: Any, num_timesteps: int, **kwargs: Any):
    """Brax's ``ppo.train(environment, num_timesteps, ...)`` run by rose-jax (Brax's layout)."""
    return _train("ppo", environment, {"num_timesteps": num_timesteps, **kwargs})


def sac_train(environment: Any, num_timesteps: int, episode_length: int = 1000, **kwargs: Any):
    """Brax's ``sac.train(environment, num_timesteps, episode_length, ...)`` run by rose-jax."""
    return _train(
        "sac", environment, {"num_timesteps": num_timesteps, "episode_length": episode_length, **kwargs}
    )


ppo = types.SimpleNamespace(train=ppo_train)
sac = types.SimpleNamespace(train=sac_train)

__all__ = ["make_inference_fn", "ppo", "ppo_train", "sac", "sac_train"]
