"""Train into a run directory: config, metrics, TensorBoard events and the final policy.

    state, history = algos.runs.train("ppo", "pendulum", "runs/pendulum", preset=None,
                                      num_timesteps=200_000, num_evals=5)
    act = algos.load_policy("runs/pendulum")

What ``<run_dir>/`` holds afterwards: ``run.json`` (algorithm, env, full config),
``metrics.jsonl`` / ``metrics.json`` / ``learning_curve.png`` / ``summary.json``
(:mod:`rose_jax.rundir`), ``tb/`` (TensorBoard events, Brax's tag names: :mod:`algos.tb`; with
``wandb_project=`` also a Weights & Biases run with the same tags, its local files in ``wandb/``),
``policy.json`` + ``policy/`` (:mod:`algos.policy`). ``rose-jax play RUN_DIR`` renders it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from algos.tb import TB_DIR


def train(
    algo: str,
    env: Any,
    run_dir: str | os.PathLike,
    *,
    preset: str | None = None,
    config: Any = None,
    env_kwargs: dict[str, Any] | None = None,
    tensorboard: bool = True,
    wandb_project: str | None = None,
    progress_fn: Any = None,
    eval_envs: int = 16,
    **overrides: Any,
) -> tuple[Any, list[dict[str, Any]]]:
    """Train ``algo`` (``'ppo'``/``'sac'``) on ``env`` (a registry name, or an Env whose ``name``
    is one) and record the run in ``run_dir`` (which must not hold a run yet).

    ``preset`` (e.g. ``"brax"``: :mod:`algos.presets`) sets the defaults, ``overrides`` (config
    field names) win over them. ``wandb_project`` also logs to that Weights & Biases project
    (``WANDB_MODE=offline`` keeps it local); without wandb installed that is a one-line ValueError
    before anything is written. Returns what the algorithm's ``train_with_config`` returns.
    """
    import envs
    from algos import policy, presets, registry, tb
    from rose_jax import rundir

    if wandb_project is not None:
        tb.check_wandb(wandb_project)
    record = registry.get(algo)
    env_kwargs = dict(env_kwargs or {})
    env_name = env if isinstance(env, str) else env.name
    env_obj = envs.make(env, **env_kwargs) if isinstance(env, str) else env
    cfg = presets.make_config(algo, preset, env_obj, config, **overrides)
    if getattr(cfg, "episode_length", None) is not None and isinstance(env, str):
        env_kwargs.setdefault("episode_length", cfg.episode_length)
        env_obj = envs.make(env, **env_kwargs)

    run_dir = os.fspath(run_dir)
    run = rundir.RunDir(run_dir)
    if run.read_run() is not None:
        raise ValueError(f"runs.train: {run_dir!r} already holds a run; choose another directory")
    rundir.check_writable(run_dir)
    info = {
        "algo": algo,
        "env": env_name,
        "env_factory": envs.user_factory(env_name),
        "env_kwargs": json.loads(json.dumps(env_kwargs, default=str)),
        "preset": preset,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg), default=str)),
    }
    run.write_run(info)
    run.restart_record([])
    logger = tb.open_loggers(run_dir, tensorboard=tensorboard, wandb_project=wandb_project, config=info)
    t0 = time.perf_counter()

    def progress(env_steps: int, metrics: dict[str, Any]) -> None:
        row = {"env_steps": int(env_steps), "wall_s": time.perf_counter() - t0}
        row.update({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "env_steps"})
        run.append(row)
        logger.log(env_steps, metrics)
        if progress_fn is not None:
            progress_fn(env_steps, metrics)

    try:
        state, history = record.train_with_config(cfg, env_obj, progress_fn=progress)
    finally:
        logger.close()
    run.finish("finished", f"{algo} {env_name}", extra={"algo": algo, "env": env_name})
    policy.save(run_dir, algo, cfg, state, _with_repeat(cfg, env_obj),
                env_name=env_name, env_kwargs=env_kwargs, eval_envs=eval_envs)
    return state, history


def _with_repeat(cfg: Any, env: Any) -> Any:
    """The env the policy acts in: ``env`` with the config's action repeat (PPO's), if any."""
    repeat = int(getattr(cfg, "action_repeat", 1) or 1)
    if repeat == 1:
        return env
    from algos import ppo_brax

    return ppo_brax.with_action_repeat(env, repeat)


__all__ = ["TB_DIR", "train"]
