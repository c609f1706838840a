"""Brax's published configurations run by Brax's own trainers and by rose-jax, in one call.

    python -m benchmarks.experiments.brax_parity                      # H200: ant PPO, hopper SAC
    python -m benchmarks.experiments.brax_parity --ppo-steps 50000000 # longer, if time allows
    python -m benchmarks.experiments.brax_parity --smoke              # a CPU smoke run (plumbing)

Each configuration is Brax's published one (its training notebook's ``ppo.train`` for ant,
``sac.train`` for hopper), passed unchanged as keywords to Brax's ``train`` and to rose-jax's
drop-in (:mod:`algos.brax_compat`, which runs Brax's data layout and schedule), with the same
seed and the same Brax environment object. Only ``num_timesteps`` (and, if asked, ``num_evals``)
is shortened (arguments).

Per run: ``runner``, ``algo``, ``env``, ``env_steps``, ``eval_return`` (the last
``eval/episode_reward``), ``wall_s`` (the whole ``train`` call), ``compile_s`` (wall time to the
first training report minus one steady epoch: the compile and first-dispatch overhead, the
same estimate for both runners), and the learning curve (env steps, eval return, seconds
since the call started). Results: ``benchmarks/results/brax_parity/`` (``results.json``,
``results.md``, ``learning_curves.png``), written atomically, with machine, versions and
command. A failing run is recorded with its error; the others still run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

from rose_jax.io import atomic_write_json, atomic_write_text

from algos import presets
from benchmarks import common

OUT_DIR = os.path.join(common.RESULTS_DIR, "brax_parity")

# Brax's training notebook's configurations (algos.presets.PUBLISHED), unchanged but for num_timesteps.
ANT_PPO = presets.published("ppo", "ant")
HOPPER_SAC = presets.published("sac", "hopper")
# --smoke: the same keywords, shrunk, on a tiny Brax env (plumbing only, minutes on a CPU)
SMOKE_PPO = dict(
    ANT_PPO,
    num_timesteps=2_000,
    num_evals=3,
    episode_length=20,
    num_envs=8,
    batch_size=4,
    num_minibatches=4,
    unroll_length=5,
    num_updates_per_batch=1,
    num_eval_envs=4,
)
SMOKE_SAC = dict(
    HOPPER_SAC,
    num_timesteps=600,
    num_evals=3,
    episode_length=20,
    num_envs=4,
    batch_size=16,
    grad_updates_per_step=2,
    max_replay_size=1024,
    min_replay_size=32,
    num_eval_envs=4,
)


def _smoke_env():
    """A Brax env whose state is a 2-vector: compiles in seconds on a CPU."""
    import jax
    import jax.numpy as jnp
    from brax.envs.base import Env, State

    class Smoke(Env):
        def reset(self, rng):
            obs = jax.random.uniform(rng, (2,), minval=-1, maxval=1)
            zero = jnp.zeros(())
            return State(pipeline_state=obs, obs=obs, reward=zero, done=zero, metrics={}, info={})

        def step(self, state, action):
            obs = jnp.clip(state.obs + 0.1 * jnp.concatenate([action, -action]), -2, 2)
            return state.replace(pipeline_state=obs, obs=obs, reward=-jnp.sum(obs**2), done=jnp.zeros(()))

        @property
        def observation_size(self):
            return 2

        @property
        def action_size(self):
            return 1

        @property
        def backend(self):
            return "none"

    return Smoke()


def _brax_env(name: str, backend: str, smoke: bool):
    if smoke:
        return _smoke_env()
    import brax.envs

    return brax.envs.get_environment(name, backend=backend)


def _network_factory(algo: str, smoke: bool):
    """Brax's default networks, or tiny ones for --smoke (same factory on both sides)."""
    if not smoke:
        return None
    import functools

    if algo == "ppo":
        from brax.training.agents.ppo import networks

        return functools.partial(
            networks.make_ppo_networks, policy_hidden_layer_sizes=(8,), value_hidden_layer_sizes=(8,)
        )
    from brax.training.agents.sac import networks

    return functools.partial(networks.make_sac_networks, hidden_layer_sizes=(8,))


def _trainer(runner: str, algo: str) -> Callable[..., Any]:
    if runner == "brax":
        if algo == "ppo":
            from brax.training.agents.ppo import train
        else:
            from brax.training.agents.sac import train
        return train.train
    from algos.brax_compat import ppo, sac

    return (ppo if algo == "ppo" else sac).train


def _compile_estimate(curve: list[list[float]]) -> float | None:
    """Seconds from the call's start to its first training report, minus one steady epoch (the
    median gap between later reports): compile time plus first-evaluation overhead."""
    train_points = [c for c in curve if c[0] > 0]
    if not train_points:
        return None
    gaps = [b[2] - a[2] for a, b in zip(train_points, train_points[1:], strict=False)]
    steady = statistics.median(gaps) if gaps else 0.0
    return max(train_points[0][2] - steady, 0.0)


def run_one(runner: str, algo: str, env_name: str, config: dict, args) -> dict:
    """One ``train`` call; returns the run's record (or its error)."""
    row: dict[str, Any] = {"runner": runner, "algo": algo, "env": env_name, "config": dict(config)}
    curve: list[list[float]] = []
    t0 = time.perf_counter()

    def progress(step, metrics):
        ret = metrics.get("eval/episode_reward")
        if "time/compile_s" in metrics:
            row["compile_s_reported"] = float(metrics["time/compile_s"])
        curve.append([int(step), None if ret is None else float(ret), time.perf_counter() - t0])
        common.log(f"{runner} {algo} {env_name}: {int(step):,} steps, eval return {common.fmt(ret)}")

    try:
        env = _brax_env(env_name, args.backend, args.smoke)
        factory = _network_factory(algo, args.smoke)
        kwargs = dict(config, progress_fn=progress)
        if factory is not None:
            kwargs["network_factory"] = factory
        _trainer(runner, algo)(environment=env, **kwargs)
    except Exception as e:  # one failing run is reported; the others still run
        row["error"] = f"{type(e).__name__}: {e}"
        row["traceback"] = traceback.format_exc(limit=8)
        common.log(f"{runner} {algo} {env_name}: FAILED {row['error']}")
    row["wall_s"] = time.perf_counter() - t0
    row["curve"] = curve
    scored = [c for c in curve if c[1] is not None]
    row["env_steps"] = curve[-1][0] if curve else 0
    row["eval_return"] = scored[-1][1] if scored else None
    row["compile_s"] = _compile_estimate(curve)
    return row


def time_to_return(curve: list[list[float]], target: float | None) -> float | None:
    """Seconds until the eval return first reaches ``target`` (None if never)."""
    if target is None:
        return None
    for step, ret, t in curve:
        if ret is not None and step > 0 and ret >= target:
            return t
    return None


NOTES = "notes.md"


def summarize(runs: list[dict]) -> list[dict]:
    """Per algo and run length (``num_timesteps``), over seeds: both runners' final returns (each
    seed's, their mean and spread), whether rose-jax's mean lies within Brax's seed spread or above
    it, and each runner's median time to the mean of Brax's final returns."""
    out = []
    lengths = sorted(
        {(r["algo"], r["config"].get("num_timesteps")) for r in runs}, key=lambda k: (k[0], k[1] or 0)
    )
    for algo, length in lengths:
        by = {
            runner: [
                r
                for r in runs
                if r["algo"] == algo
                and r["config"].get("num_timesteps") == length
                and r["runner"] == runner
                and not r.get("error")
            ]
            for runner in ("brax", "rose-jax")
        }
        if not by["brax"] or not by["rose-jax"]:
            continue
        finals = {k: [r["eval_return"] for r in v if r.get("eval_return") is not None] for k, v in by.items()}
        if not finals["brax"] or not finals["rose-jax"]:
            continue
        target = statistics.mean(finals["brax"])
        ours_mean = statistics.mean(finals["rose-jax"])

        # each runner's times to the target, of the runs that reached it (the median is over these)
        reached = {
            k: [t for t in (time_to_return(r["curve"], target) for r in v) if t is not None]
            for k, v in by.items()
        }
        median = {k: statistics.median(v) if v else None for k, v in reached.items()}

        out.append(
            {
                "algo": algo,
                "env": by["brax"][0]["env"],
                "num_timesteps": length,
                "runs": f"{len(finals['brax'])}/{len(finals['rose-jax'])}",
                "brax_seeds": sorted({r["config"]["seed"] for r in by["brax"]}),
                "brax_returns": finals["brax"],
                "rose_jax_returns": finals["rose-jax"],
                "brax_return": target,
                "rose_jax_return": ours_mean,
                "within_brax_spread_or_above": ours_mean >= min(finals["brax"]),
                "brax_s_to_brax_final": median["brax"],
                "rose_jax_s_to_brax_final": median["rose-jax"],
                "brax_reached": f"{len(reached['brax'])}/{len(by['brax'])}",
                "rose_jax_reached": f"{len(reached['rose-jax'])}/{len(by['rose-jax'])}",
            }
        )
    return out


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ("ppo", "sac") if any(r["algo"] == a for r in runs)]
    fig, axes = plt.subplots(len(algos), 2, figsize=(11, 3.6 * len(algos)), squeeze=False)
    for i, algo in enumerate(algos):
        for r in runs:
            if r["algo"] != algo:
                continue
            pts = [c for c in r["curve"] if c[1] is not None]
            if not pts:
                continue
            lengths = {x["config"].get("num_timesteps") for x in runs if x["algo"] == algo}
            steps = r["config"].get("num_timesteps")
            label = r["runner"] if len(lengths) == 1 else f"{r['runner']} ({steps:,} steps)"
            axes[i][0].plot([c[0] for c in pts], [c[1] for c in pts], marker="o", label=label)
            axes[i][1].plot([c[2] for c in pts], [c[1] for c in pts], marker="o", label=label)
        env = next(r["env"] for r in runs if r["algo"] == algo)
        axes[i][0].set(title=f"{algo.upper()} {env}", xlabel="env steps", ylabel="eval/episode_reward")
        axes[i][1].set(title=f"{algo.upper()} {env}: wall-clock", xlabel="seconds since train() started")
        for ax in axes[i]:
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    common.save_plot(fig, path)


def _commands(runs: list[dict]) -> list[str]:
    """One line per distinct command of ``runs`` (date, command, which runs)."""
    by: dict[tuple, list[str]] = {}
    for r in runs:
        key = (r.get("date") or "", r.get("command") or "?")
        by.setdefault(key, []).append(f"{r['runner']} {r['algo']} seed {r['config'].get('seed')}")
    return [f"- {d}: `{c}`: {', '.join(rs)}" for (d, c), rs in sorted(by.items())]


def merge_runs(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` runs (an earlier results.json, ``--merge``) with ``new`` ones: a new run replaces the
    old run of the same runner, algo, seed and length, unless the new one failed and the old one
    did not (a failure never replaces a measurement); the others are kept, old ones first."""
    return common.merge_records(
        old,
        new,
        key=lambda r: (r["runner"], r["algo"], r["config"].get("seed"), r["config"].get("num_timesteps")),
        measured=lambda r: not r.get("error"),
    )


def markdown(runs: list[dict], summary: list[dict], info: dict, args) -> str:
    lines = [
        "# Brax's published configurations: Brax's trainers vs rose-jax",
        "",
        *(
            [f"Command: `{info.get('command', ' '.join(sys.argv))}`  "]
            if len({r.get("command") for r in runs} - {None}) <= 1
            else ["Commands (each run's own, oldest first):", "", *_commands(runs), ""]
        ),
        f"Machine: {info.get('gpu') or info.get('platform')}; jax {info.get('jax', '?')}, "
        f"brax {info.get('brax', '?')}; {info.get('date', '')}",
        "",
        "Same keywords, same seed, same Brax env object on both sides; rose-jax runs them through "
        "`algos.brax_compat` (Brax's data layout and schedule). `compile_s`: time to the first "
        "training report minus one steady epoch (same estimate for both).",
        "",
        common.markdown_table(
            ["runner", "algo", "env", "env steps", "eval return", "wall s", "compile s", "error"],
            [
                [
                    r["runner"],
                    r["algo"],
                    r["env"],
                    f"{r['env_steps']:,}",
                    common.fmt(r["eval_return"]),
                    common.fmt(r["wall_s"]),
                    common.fmt(r["compile_s"]),
                    r.get("error", ""),
                ]
                for r in runs
            ],
        ),
        "",
    ]
    if summary:
        lines += [
            "Final evaluation returns over seeds, and the median time to the mean of Brax's final "
            "returns over the runs that reached it (seconds since `train()` started; in brackets how "
            "many runs reached it; '-' = none):",
            "",
            common.markdown_table(
                ["algo", "env", "num_timesteps", "runs (Brax/rose-jax)", "Brax final (mean; each)",
                 "rose-jax final (mean; each)",
                 "within Brax's spread or above", "Brax s", "rose-jax s"],
                [
                    [
                        s["algo"],
                        s["env"],
                        common.fmt(s.get("num_timesteps"), ","),
                        s["runs"],
                        f"{common.fmt(s['brax_return'])}; "
                        + ", ".join(common.fmt(x) for x in s["brax_returns"]),
                        f"{common.fmt(s['rose_jax_return'])}; "
                        + ", ".join(common.fmt(x) for x in s["rose_jax_returns"]),
                        s["within_brax_spread_or_above"],
                        f"{common.fmt(s['brax_s_to_brax_final'])} ({s.get('brax_reached', '?')})",
                        f"{common.fmt(s['rose_jax_s_to_brax_final'])} "
                        f"({s.get('rose_jax_reached', '?')})",
                    ]
                    for s in summary
                ],
            ),
            "",
            "A few seeds per runner at most (device time): a difference of a few hundred on ant is "
            "inside the seed spread Brax's own runs show; run more seeds (`--seeds`) before reading "
            "more into it.",
            "",
        ]
    lines.append("![learning curves](learning_curves.png)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ppo-steps", type=int, default=20_000_000, help="num_timesteps of the ant PPO runs")
    p.add_argument("--sac-steps", type=int, default=300_000, help="num_timesteps of the hopper SAC runs")
    p.add_argument(
        "--ppo-evals", type=int, default=None, help="num_evals of the PPO runs (default: the published 10)"
    )
    p.add_argument(
        "--sac-evals",
        type=int,
        default=None,
        help="num_evals of the SAC runs (default: the published 20; a shortened run may want fewer: "
        "hopper's 128-env evaluation costs seconds each)",
    )
    p.add_argument("--backend", default="mjx", help="Brax physics backend of both runners' envs")
    p.add_argument("--algos", default="ppo,sac", help="comma-separated subset of ppo,sac")
    p.add_argument("--seeds", type=int, default=1, help="seeds per runner (seed, seed+1, ...)")
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="offset of the first seed from the published one (a long run split over calls)",
    )
    p.add_argument(
        "--runners",
        default="brax,rose-jax",
        help="comma-separated subset of brax,rose-jax (a long run split over calls)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs of an existing results.json in --out (a rerun of the same runner, algo, "
        "seed and length replaces its old record)",
    )
    p.add_argument("--sac-seeds", type=int, default=None, help="seeds per runner for SAC (default --seeds)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run on a toy Brax env (plumbing only)")
    p.add_argument("--out", default=None, help=f"output directory (default {OUT_DIR}, smoke: <it>_smoke)")
    args = p.parse_args(argv)

    from benchmarks.suite import brax_shim

    brax_shim.install()  # Brax 0.14.2 calls jax.device_put_replicated, gone from recent JAX
    out = args.out or (OUT_DIR + "_smoke" if args.smoke else OUT_DIR)
    os.makedirs(out, exist_ok=True)
    info = common.machine_info()
    if argv is not None:
        info["command"] = "python -m benchmarks.experiments.brax_parity " + " ".join(argv)

    plans = []
    for algo in [a.strip() for a in args.algos.split(",") if a.strip()]:
        if algo == "ppo":
            base = dict(
                SMOKE_PPO if args.smoke else ANT_PPO,
                num_timesteps=SMOKE_PPO["num_timesteps"] if args.smoke else args.ppo_steps,
            )
            if args.ppo_evals is not None:
                base["num_evals"] = args.ppo_evals
            plans.append(("ppo", "ant", base))
        elif algo == "sac":
            base = dict(
                SMOKE_SAC if args.smoke else HOPPER_SAC,
                num_timesteps=SMOKE_SAC["num_timesteps"] if args.smoke else args.sac_steps,
            )
            if args.sac_evals is not None:
                base["num_evals"] = args.sac_evals
            plans.append(("sac", "hopper", base))
        else:
            p.error(f"unknown algo {algo!r} in --algos (use ppo, sac)")
    runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    bad = sorted(set(runners) - {"brax", "rose-jax"})
    if bad or not runners:
        p.error(f"unknown runner(s) {', '.join(bad) or '(none)'} in --runners (use brax, rose-jax)")
    old = common.previous_records(os.path.join(out, "results.json"), "runs") if args.merge else []
    runs: list[dict] = []
    for algo, env_name, base in plans:
        for k in range(args.sac_seeds if algo == "sac" and args.sac_seeds is not None else args.seeds):
            config = dict(base, seed=base["seed"] + args.first_seed + k)
            for runner in runners:
                label = "smoke" if args.smoke else env_name
                row = run_one(runner, algo, label, config, args)
                runs.append({"command": info.get("command"), "date": info.get("date"), **row})
                # after every run: a later failure keeps what is done
                write(out, merge_runs(old, runs), info, args)
    new_runs, runs = runs, merge_runs(old, runs)
    summary = write(out, runs, info, args)
    print()
    print(
        common.markdown_table(
            ["runner", "algo", "env", "env steps", "eval return", "wall s", "compile s"],
            [
                [
                    r["runner"],
                    r["algo"],
                    r["env"],
                    f"{r['env_steps']:,}",
                    common.fmt(r["eval_return"]),
                    common.fmt(r["wall_s"]),
                    common.fmt(r["compile_s"]),
                ]
                for r in runs
            ],
        )
    )
    for s in summary:
        brax_s, ours_s = common.fmt(s["brax_s_to_brax_final"]), common.fmt(s["rose_jax_s_to_brax_final"])
        print(
            f"{s['algo']} {s['env']}: to Brax's final return {common.fmt(s['brax_return'])}: "
            f"Brax {brax_s} s, rose-jax {ours_s} s"
        )
    return 0 if all("error" not in r for r in new_runs) else 1


def write(out: str, runs: list[dict], info: dict, args) -> list[dict]:
    summary = summarize(runs)
    atomic_write_json(
        os.path.join(out, "results.json"),
        {
            "machine": info,
            "args": vars(args),
            "runs": runs,
            "summary": summary,
        },
    )
    text = markdown(runs, summary, info, args)
    if os.path.exists(os.path.join(out, NOTES)):  # written by hand after runs; kept across reruns
        text += f"\nWhat the runs show, written after them: [{NOTES}]({NOTES}).\n"
    atomic_write_text(os.path.join(out, "results.md"), text)
    try:
        plot(runs, os.path.join(out, "learning_curves.png"))
    except Exception as e:  # a plotting failure must not lose the numbers
        common.log(f"plot failed: {type(e).__name__}: {e}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
