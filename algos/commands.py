"""The CLI's Brax/Playground-user features, kept out of ``rose_jax/cli.py`` (which only wires them):

- ``rose-jax train`` options ``--preset brax``, ``--no-compile-cache``, ``--matmul-precision``,
  ``--no-tensorboard``, ``--wandb [PROJECT]`` (:func:`add_train_args`); :class:`TrainExtras`
  applies them around a run (compile cache and precision before anything compiles, TensorBoard
  events and the W&B run while it runs, the final policy and "time to jit / time to train" after
  it);
- ``rose-jax play RUN_DIR --episodes K --out video.mp4`` (:func:`add_play_parser`);
- the optional packages' env names for ``rose-jax envs`` (:func:`external_env_lines`).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from rose_jax import startup


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The train command's options for fast starts, presets and TensorBoard."""
    p.add_argument("--preset", choices=["brax"], help="defaults of another trainer: 'brax' = Brax's "
                   "ppo.train/sac.train defaults (--set values still win); see docs/COMING_FROM_BRAX.md")
    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"do not use JAX's persistent compilation cache (default: on, in "
                        f"{startup.default_cache_dir()}; ${startup.ENV_CACHE_DIR} moves it)")
    p.add_argument("--matmul-precision", choices=sorted(startup.PRECISIONS), default="default",
                   help="float32 matmul precision: tf32 (fast on Ampere/Hopper, the GPU default), highest "
                        "(reproducible), bf16, default (the backend's) (default: %(default)s)")
    p.add_argument("--no-tensorboard", action="store_true",
                   help="do not write TensorBoard events to RUN_DIR/tb (default: write them)")
    p.add_argument("--wandb", nargs="?", const=DEFAULT_WANDB_PROJECT, metavar="PROJECT",
                   action=_WandbAction,
                   help=f"also log to Weights & Biases, same tags as TensorBoard (project default: "
                        f"{DEFAULT_WANDB_PROJECT}; needs `pip install wandb`; WANDB_MODE=offline keeps it "
                        f"local)")


DEFAULT_WANDB_PROJECT = "rose-jax"


class _WandbAction(argparse.Action):
    """``--wandb [PROJECT]``, checked while the command line is parsed, so a missing wandb is a
    one-line error before any run directory is made."""

    def __call__(self, parser, namespace, values, option_string=None):
        from algos import tb

        try:
            tb.check_wandb(values)
        except ValueError as e:
            parser.error(f"{option_string}: {e}")
        setattr(namespace, self.dest, values)


def preset_overrides(algo: str, preset: str | None, make_env: Callable[[], Any]) -> dict[str, Any]:
    """The preset's config fields (``{}`` for None); ``make_env()`` is called only when a value
    depends on the env (SAC's target entropy)."""
    from algos import presets

    if preset is None:
        return {}
    needs_env = any(callable(v) for v in presets.PRESETS.get(algo, {}).get(preset, {}).values())
    return presets.overrides(algo, preset, make_env() if needs_env else None)


class TrainExtras:
    """What ``rose-jax train`` does around ``train_with_config`` for these options.

    Construct it before anything is compiled (it sets the compile cache and matmul precision),
    call :meth:`progress` from the progress callback, :meth:`finish` after training.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        run_path: str,
        print_fn: Callable[[str], None] = print,
        purge_step: int | None = None,
    ):
        """``purge_step``: a resumed run's first env step after its checkpoint (TensorBoard hides
        what an earlier, crashed process logged from there on; :class:`algos.tb.Logger`)."""
        self.print = print_fn
        self.cache_dir = None
        if not getattr(args, "no_compile_cache", False):
            try:
                self.cache_dir = startup.enable_compile_cache()
            except ValueError as e:  # an unwritable cache must not stop training
                print_fn(f"rose-jax train: {e}; continuing without the compile cache")
        startup.set_matmul_precision(getattr(args, "matmul_precision", "default") or "default")
        from algos import tb
        from rose_jax import rundir

        project = getattr(args, "wandb", None)
        self.logger = tb.open_loggers(
            run_path,
            tensorboard=not getattr(args, "no_tensorboard", False),
            wandb_project=project,
            config=rundir.RunDir(run_path).read_run() if project is not None else None,
            purge_step=purge_step,
        )
        self.run_path = run_path
        self.clock = startup.PhaseClock()

    def progress(self, env_steps: int, metrics: dict[str, Any]) -> None:
        self.clock.progress()
        self.logger.log(env_steps, metrics)

    def finish(self, job: Any, state: Any) -> None:
        """Close the event files, save the final policy (``policy.json`` + ``policy/``), print times."""
        self.logger.close()
        line = self.clock.line()
        try:
            from algos import policy

            env = job.env
            repeat = int(getattr(job.config, "action_repeat", 1) or 1)
            if repeat > 1:
                from algos import ppo_brax

                env = ppo_brax.with_action_repeat(env, repeat)
            meta = policy.save(self.run_path, job.algo.name, job.config, state, env,
                               env_name=job.env_name, env_kwargs=dict(job.env_kwargs or {}))
            from algos import play

            ret = meta.get("final_eval_return")
            saved = f"; policy saved (final deterministic eval return {ret:.2f}): " if ret is not None else ""
            line += saved + play.suggest_play(self.run_path, job.env_name)
        except Exception as e:  # the run's record is complete; say why the policy is missing
            line += f"; policy not saved: {type(e).__name__}: {e}"
        cache = f"; compile cache {self.cache_dir}" if self.cache_dir else ""
        self.print(line + cache)


def add_play_parser(sub: Any) -> None:
    """``rose-jax play RUN_DIR [--episodes K] [--out video.mp4] ...``."""
    p = sub.add_parser("play", help="roll out a trained policy, print returns, render a video",
                       description="Roll out the policy saved in RUN_DIR (deterministic) for K episodes, "
                                   "print each return, and with --out render an mp4 headless (EGL on a GPU "
                                   "machine, OSMesa on a CPU; MUJOCO_GL overrides).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by `rose-jax train`")
    p.add_argument("--episodes", type=int, default=1, help="episodes to roll out (default: %(default)s)")
    p.add_argument("--out", help="mp4 file to write (default: no video)")
    p.add_argument("--width", type=int, default=320, help="video width in pixels (default: %(default)s)")
    p.add_argument("--height", type=int, default=240, help="video height in pixels (default: %(default)s)")
    p.add_argument("--fps", type=int, default=30, help="video frame rate (default: %(default)s)")
    p.add_argument("--max-steps", type=int, help="steps per episode at most (default: the episode length)")
    p.add_argument("--seed", type=int, default=0, help="reset key seed (default: %(default)s)")
    p.set_defaults(func=cmd_play)


def cmd_play(args: argparse.Namespace) -> int:
    from algos import play

    try:
        play.play(args.run_dir, episodes=args.episodes, out=args.out, width=args.width, height=args.height,
                  fps=args.fps, max_steps=args.max_steps, seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"rose-jax play: {e}") from None
    return 0


def external_env_lines() -> list[str]:
    """``rose-jax envs`` lines for the installed optional packages' envs (none when absent)."""
    import envs

    names = envs.external_names()
    if not names:
        return ["# optional: pip install playground / gymnax for playground:<Name> and gymnax:<id> envs"]
    return names


__all__ = ["TrainExtras", "add_play_parser", "add_train_args", "cmd_play", "external_env_lines",
           "preset_overrides"]
