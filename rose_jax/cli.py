"""The ``rose-jax`` command line: ``train``, ``inspect``, ``profile``.

    rose-jax                              # the default job: PPO on cartpole (CPU) or MJX ant (GPU)
    rose-jax train --env pendulum --algo sac --steps 60000
    rose-jax train --env ant --algo ppo --set num_envs=2048 --set unroll_length=10 --optimize
    rose-jax inspect --env ant --algo ppo --json tree.json --png tree.png
    rose-jax profile --env ant --algo ppo --num-envs 1024

This is the impure host layer: files, progress bars, processes. The algorithms stay pure.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from typing import Any, Sequence

# Defaults of the no-argument job, per platform: small enough to finish in < 2 minutes on a 2-core CPU
# and visibly learn; on a GPU a real MJX task.
CPU_DEFAULT = dict(
    env="cartpole",
    algo="ppo",
    steps=400_000,
    overrides=dict(num_envs=64, unroll_length=32, num_minibatches=8, num_epochs=4),
)
GPU_DEFAULT = dict(
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
)


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"rose-jax: --set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _make_env(name: str, backend: str | None):
    import envs

    kwargs = {"backend": backend} if backend else {}
    try:
        return envs.make(name, **kwargs)
    except ValueError as e:
        raise SystemExit(f"rose-jax: {e}") from None


def _run_dir(base: str | None, env: str, algo: str) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base or os.path.join("runs", f"{algo}-{env}-{stamp}")
    os.makedirs(path, exist_ok=True)
    return path


def _plot_curve(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rose_jax.io import atomic_write_bytes

    steps = [h["env_steps"] for h in history if "episode_return" in h]
    returns = [h["episode_return"] for h in history if "episode_return" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, returns, color="tab:red")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean episode return")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _scalar_metrics(metrics: Any) -> dict[str, float]:
    import numpy as np

    items = metrics._asdict().items() if hasattr(metrics, "_asdict") else dict(metrics).items()
    return {k: float(np.asarray(v)) for k, v in items if np.ndim(v) == 0}


def cmd_train(args) -> int:
    import algos
    from rose_jax.io import atomic_write_text

    gpu = _on_gpu()
    default = GPU_DEFAULT if gpu else CPU_DEFAULT
    env_name = args.env or default["env"]
    algo_name = args.algo or (default["algo"] if env_name == default["env"] else "ppo")
    steps = args.steps if args.steps is not None else default["steps"]
    if steps <= 0:
        raise SystemExit(f"rose-jax: --steps must be > 0, got {steps}")
    overrides = (
        dict(default["overrides"]) if (env_name, algo_name) == (default["env"], default["algo"]) else {}
    )
    overrides.update(_parse_overrides(args.set))
    env = _make_env(env_name, args.backend)
    try:
        algo = algos.get(algo_name)
    except ValueError as e:
        raise SystemExit(f"rose-jax: {e}") from None
    run_dir = _run_dir(args.run_dir, env_name, algo_name)
    print(f"rose-jax train: {algo_name} on {env_name} for {steps:,} env steps -> {run_dir}", flush=True)

    from tqdm import tqdm

    history: list[dict] = []
    bar = tqdm(
        total=steps,
        unit="step",
        unit_scale=True,
        dynamic_ncols=True,
        file=sys.stdout,
        mininterval=1.0 if sys.stdout.isatty() else 10.0,
    )
    t0 = time.perf_counter()

    def progress(env_steps: int, metrics) -> None:
        row = {"env_steps": int(env_steps), "wall_s": time.perf_counter() - t0, **_scalar_metrics(metrics)}
        history.append(row)
        bar.set_postfix(ret=f"{row.get('episode_return', float('nan')):.1f}", refresh=False)
        bar.update(max(0, min(int(env_steps), steps) - bar.n))  # redraws at most once per mininterval

    try:
        if args.optimize:
            _train_optimized(algo_name, env, env_name, steps, args, overrides, progress)
        else:
            train_kwargs = dict(num_timesteps=steps, seed=args.seed, progress_fn=progress, **overrides)
            if args.checkpoint_every:
                train_kwargs.update(checkpoint_dir=os.path.join(os.path.abspath(run_dir), "checkpoints"),
                                    checkpoint_every=args.checkpoint_every, resume=args.resume)
            algo.train(env, **train_kwargs)
    except (ValueError, TypeError) as e:
        bar.close()
        raise SystemExit(f"rose-jax: {e}") from None
    bar.close()
    atomic_write_text(os.path.join(run_dir, "metrics.json"), json.dumps(history, indent=1) + "\n")
    _plot_curve(history, os.path.join(run_dir, "learning_curve.png"), f"{algo_name} on {env_name}")
    last = history[-1] if history else {}
    print(
        f"done: {int(last.get('env_steps', 0)):,} env steps in {time.perf_counter() - t0:.1f}s, "
        f"mean episode return {last.get('episode_return', float('nan')):.1f}; "
        f"wrote {run_dir}/metrics.json and learning_curve.png"
    )
    return 0


def plan_cache_dir() -> str:
    """Where searched plans are cached: ``$ROSE_JAX_PLAN_CACHE`` or ``~/.cache/rose-jax/plans``."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "rose-jax", "plans")
    return os.environ.get("ROSE_JAX_PLAN_CACHE") or default


def _train_optimized(algo_name: str, env, env_name: str, steps: int, args, overrides: dict, progress) -> None:
    """``train --optimize``: search (or load the cached) rose-jax plan, then train with it.

    The plan search measures the untransformed iteration and each candidate end to end and keeps a
    candidate only if it is faster and computes the same result (``rose_jax.optimize.optimize``);
    plans are cached per (program, env, batch, GPU, jax version), so a second run skips the search.
    """
    import jax

    import algos
    from algos import driver
    from rose_jax import optimize as rj_optimize

    if args.checkpoint_every or args.resume:
        raise ValueError("--optimize does not checkpoint yet; drop --checkpoint-every/--resume")
    config = algos.make_config(algo_name, num_timesteps=steps, seed=args.seed, **overrides)
    make_program = rj_optimize.ppo_program if algo_name == "ppo" else rj_optimize.sac_program
    env_kwargs = (("backend", args.backend),) if args.backend else ()
    program = make_program(config, env, env_name=env_name, env_kwargs=env_kwargs)
    module = algos.get(algo_name)
    state = module.init(config, env, jax.random.PRNGKey(config.seed))
    step, report = rj_optimize.optimize(program, state, cache_dir=plan_cache_dir(), env_name=env_name,
                                        batch_size=config.num_envs, log=lambda m: print(m, flush=True))
    print(rj_optimize.format_report(report), flush=True)
    num_iterations = -(-steps // _env_steps_per_iteration(algo_name, config))
    driver.run(step, state, num_iterations=num_iterations, iteration_of=lambda s: s.iteration,
               env_steps_of=lambda s: s.env_steps, progress_fn=progress)


def _env_steps_per_iteration(algo_name: str, config) -> int:
    if algo_name == "ppo":
        return config.num_envs * config.unroll_length
    return config.num_envs * config.steps_per_iteration


def _example_iteration(algo_name: str, env, overrides: dict):
    """(iteration fn, example TrainState) for an algorithm at the given config overrides."""
    import jax

    import algos

    algo = algos.get(algo_name)
    config = algos.make_config(algo_name, **overrides)
    state = jax.eval_shape(lambda k: algo.init(config, env, k), jax.random.PRNGKey(0))
    return algo.iteration(config, env), state


def cmd_inspect(args) -> int:
    from rose_jax import trace as rtrace

    env = _make_env(args.env, args.backend)
    overrides = _parse_overrides(args.set)
    fn, state = _example_iteration(args.algo, env, overrides)
    t0 = time.perf_counter()
    tree = rtrace.trace(fn, state, arg_names=("train_state",))
    dt = time.perf_counter() - t0
    print(rtrace.format_tree(tree, max_depth=args.depth))
    print(f"(traced in {dt:.2f}s)")
    if args.json:
        rtrace.save_json(tree, args.json)
        print(f"wrote {args.json}")
    if args.png:
        rtrace.plot_tree(tree, args.png)
        print(f"wrote {args.png}")
    return 0


def cmd_profile(args) -> int:
    import jax

    from rose_jax import profile as rprofile

    ok, reason = rprofile.available()
    if not ok:
        raise SystemExit(f"rose-jax profile: {reason}")
    env = _make_env(args.env, args.backend)
    overrides = _parse_overrides(args.set)
    if args.num_envs:
        overrides["num_envs"] = args.num_envs
    import algos

    algo = algos.get(args.algo)
    config = algos.make_config(args.algo, **overrides)
    state = algo.init(config, env, jax.random.PRNGKey(0))
    fn = algo.iteration(config, env)
    timeline = rprofile.profile(fn, state)
    windows = rprofile.find_windows(timeline)
    print(rprofile.format_windows(windows))
    out = args.out or f"profile-{args.algo}-{args.env}"
    timeline.save(out + ".json")
    rprofile.plot_timeline(timeline, out + ".png", title=f"{args.algo} on {args.env}")
    print(f"wrote {out}.json and {out}.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rose-jax", description="GPU-resident RL training, traced and overlapped."
    )
    sub = p.add_subparsers(dest="command")

    t = sub.add_parser("train", help="train an agent (the default command)")
    t.add_argument("--env", help="environment name (see `rose-jax envs`)")
    t.add_argument("--algo", choices=["ppo", "sac"])
    t.add_argument("--backend", help="physics backend for Brax envs (mjx, generalized, ...)")
    t.add_argument("--steps", type=int, help="total environment steps")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a hyperparameter")
    t.add_argument("--run-dir", help="where metrics.json and learning_curve.png go (default runs/...)")
    t.add_argument("--checkpoint-every", type=int, help="save a checkpoint every N iterations")
    t.add_argument("--resume", action="store_true", help="resume from the run dir's latest checkpoint")
    t.add_argument("--optimize", action="store_true", help="apply (or search for) a rose-jax plan")
    t.set_defaults(func=cmd_train)

    for name, func, helptext in (
        ("inspect", cmd_inspect, "print the traced loop tree of one iteration"),
        ("profile", cmd_profile, "profile one iteration on the GPU"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--env", required=True)
        s.add_argument("--algo", choices=["ppo", "sac"], default="ppo")
        s.add_argument("--backend")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
        s.set_defaults(func=func)
    sub.choices["inspect"].add_argument("--json", help="write the tree as JSON")
    sub.choices["inspect"].add_argument("--png", help="write the tree as a picture")
    sub.choices["inspect"].add_argument("--depth", type=int, default=None, help="max depth printed")
    sub.choices["profile"].add_argument("--num-envs", type=int)
    sub.choices["profile"].add_argument("--out", help="output prefix for .json/.png")

    e = sub.add_parser("envs", help="list the registered environments")
    e.set_defaults(func=lambda args: print("\n".join(__import__("envs").names())) or 0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv or ["train"])
    if args.command is None:
        args = parser.parse_args(["train", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
