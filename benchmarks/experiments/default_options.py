"""Whole `rose-jax train` runs through the user's own path: XLA's defaults, the informed user's
global flag, and rose-jax's default (option sets tried on the first units, the fastest kept).

    python -m benchmarks.experiments.default_options --workloads ppo-ant --repeats 2
    python -m benchmarks.experiments.default_options --smoke          # CPU: tiny runs, any machine

Each run is a fresh process of ``python -m rose_jax.cli train`` with the persistent compile cache
off (every run compiles, as a first run does), in three variants:

- ``xla_defaults``: ``--xla-options default`` (what ``rose-jax train`` did before options were
  tried by default; XLA's defaults);
- ``peer_flags``: the same with ``XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``,
  the flag any JAX user can set (the informed peer of this single-jit loop);
- ``rose_default``: ``rose-jax train`` as shipped (``--xla-options auto``).

Per run: the whole process's wall-clock (start to exit, compile included), the time to the first
metrics row, the steady env-steps/s (median of the per-row rates after the first third of the
rows: compile and the option trial excluded), the run's final status, checkpoint and saved policy,
and the ``XLA options`` line. Writes ``results.json``, ``results.md`` and ``results.png`` into
``--out`` (default ``benchmarks/results/default_options``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import common
from rose_jax.io import atomic_write_json

PEER_FLAGS = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"

# name -> (train argv after `train`, what it is)
WORKLOADS: dict[str, tuple[list[str], str]] = {
    "ppo-ant": ([], "the README's default GPU job: PPO on MJX ant, 4096 envs, unroll 10, 20M env steps"),
    "sac-hopper": (
        ["--env", "hopper", "--algo", "sac", "--preset", "brax", "--steps", "300000",
         "--set", "num_envs=128", "--set", "batch_size=512", "--set", "grad_updates_per_step=64",
         "--set", "min_replay_size=8192", "--set", "max_replay_size=1048576", "--set", "num_evals=4",
         "--set", "reward_scaling=30", "--set", "discounting=0.997", "--set", "learning_rate=6e-4"],
        "SAC hopper, Brax's published high-update config (128 envs, batch 512, 64 updates per env "
        "step, replay 1M, min replay 8192), 300k env steps of the published 6.5M",
    ),
    "smoke": (
        ["--env", "pendulum", "--steps", "4096", "--set", "num_envs=16", "--set", "unroll_length=8",
         "--set", "num_minibatches=2"],
        "CPU smoke run: PPO pendulum, 32 iterations",
    ),
}
VARIANTS = ("xla_defaults", "peer_flags", "rose_default")


def variant_command(variant: str) -> tuple[list[str], dict[str, str]]:
    if variant == "xla_defaults":
        return ["--xla-options", "default"], {}
    if variant == "peer_flags":
        flags = f"{os.environ.get('XLA_FLAGS', '')} {PEER_FLAGS}".strip()
        return ["--xla-options", "default"], {"XLA_FLAGS": flags}
    if variant == "rose_default":
        return [], {}
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def steady_rate(rows: list[dict[str, Any]]) -> float | None:
    """Median env-steps/s between consecutive rows after the first third (compile, trial)."""
    rates = []
    for a, b in zip(rows, rows[1:], strict=False):
        dt = (b.get("wall_s") or 0) - (a.get("wall_s") or 0)
        if dt > 0:
            rates.append((b["env_steps"] - a["env_steps"]) / dt)
    tail = rates[len(rates) // 3:]
    return statistics.median(tail) if len(tail) >= 3 else None


def one_run(workload: str, variant: str, repeat: int, timeout_s: float) -> dict[str, Any]:
    argv, _ = WORKLOADS[workload]
    extra, env_extra = variant_command(variant)
    run_dir = tempfile.mkdtemp(prefix=f"rose-{workload}-{variant}-")
    os.rmdir(run_dir)
    cmd = [sys.executable, "-m", "rose_jax.cli", "train", *argv, *extra, "--no-compile-cache",
           "--run-dir", run_dir]
    env = {**os.environ, **env_extra}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, str(e.stdout or ""), f"timed out after {timeout_s:.0f}s"
    wall = time.perf_counter() - t0
    from rose_jax import rundir

    run = rundir.RunDir(run_dir)
    rows = run.rows()
    info = run.read_run() or {}
    summary = run.read_summary() or {}
    from algos import checkpoint

    record = {
        "workload": workload,
        "variant": variant,
        "repeat": repeat,
        "xla_flags": env_extra.get("XLA_FLAGS", ""),
        "returncode": rc,
        "end_to_end_s": round(wall, 2),
        "first_row_s": round(rows[0]["wall_s"], 2) if rows else None,
        "env_steps": summary.get("env_steps"),
        "steady_env_steps_per_s": steady_rate(rows),
        "rows": len(rows),
        "finished": summary.get("status") == "finished",
        "checkpoint": checkpoint.latest_step(run.checkpoint_dir),
        "policy_saved": os.path.exists(os.path.join(run_dir, "policy.json")),
        "final_episode_return": (rows[-1].get("eval_episode_return") or rows[-1].get("episode_return"))
        if rows else None,
        "xla_options": info.get("xla_options"),
        "xla_options_line": next((ln.strip() for ln in out.splitlines() if "XLA options" in ln), None),
        "command": " ".join(["python", "-m", "rose_jax.cli", "train", *argv, *extra, "--no-compile-cache"]),
        "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1][:300],
    }
    common.log(f"{workload} {variant} #{repeat}: rc={rc} {wall:.1f}s, steady "
               f"{common.fmt(record['steady_env_steps_per_s'], ',.0f')} env-steps/s, "
               f"{record['xla_options_line'] or ''}")
    return record


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        entry: dict[str, Any] = {"workload": workload, "what": WORKLOADS[workload][1]}
        for variant in VARIANTS:
            runs = [r for r in records if r["workload"] == workload and r["variant"] == variant
                    and r["returncode"] == 0]
            walls = [r["end_to_end_s"] for r in runs]
            rates = [r["steady_env_steps_per_s"] for r in runs if r["steady_env_steps_per_s"]]
            entry[variant] = {
                "repeats": len(runs),
                "end_to_end_s": statistics.median(walls) if walls else None,
                "end_to_end_spread": [min(walls), max(walls)] if walls else None,
                "steady_env_steps_per_s": statistics.median(rates) if rates else None,
                "steady_spread": [min(rates), max(rates)] if rates else None,
                "kept": sorted({(r.get("xla_options") or {}).get("chosen") or "-" for r in runs}),
            }
        peer = [entry[v]["steady_env_steps_per_s"] for v in ("xla_defaults", "peer_flags")]
        rose = entry["rose_default"]["steady_env_steps_per_s"]
        best_peer = max((p for p in peer if p), default=None)
        entry["speedup_vs_informed_peer"] = rose / best_peer if rose and best_peer else None
        walls = [entry[v]["end_to_end_s"] for v in ("xla_defaults", "peer_flags")]
        best_wall = min((w for w in walls if w), default=None)
        rose_wall = entry["rose_default"]["end_to_end_s"]
        entry["end_to_end_vs_informed_peer"] = best_wall / rose_wall if best_wall and rose_wall else None
        rows.append(entry)
    return rows


def write(out: str, records: list[dict[str, Any]], command: str) -> None:
    os.makedirs(out, exist_ok=True)
    summary = summarize(records)
    machine = {**common.machine_info(), "command": command}
    atomic_write_json(os.path.join(out, "results.json"),
                      {"machine": machine, "summary": summary, "runs": records})
    lines = [
        "# `rose-jax train` as shipped vs XLA's defaults and the informed user's flag",
        "",
        f"{machine.get('date')} on {machine.get('gpu') or machine.get('backend')}; command: `{command}`.",
        "Whole runs, each a fresh process with the compile cache off (compile included); steady "
        "env-steps/s = median per-row rate after the first third of the rows. peer_flags = "
        f"`XLA_FLAGS={PEER_FLAGS}`. Generated by `benchmarks/experiments/default_options.py`.",
        "",
    ]
    headers = ["workload", "variant", "repeats", "end to end s (median, min-max)",
               "steady env-steps/s (median, min-max)", "kept"]
    table = []
    for e in summary:
        for v in VARIANTS:
            s = e[v]
            spread_w = s["end_to_end_spread"] or [None, None]
            spread_r = s["steady_spread"] or [None, None]
            wall = f"{common.fmt(s['end_to_end_s'])} ({common.fmt(spread_w[0])}-{common.fmt(spread_w[1])})"
            table.append([e["workload"], v, s["repeats"], wall,
                          f"{common.fmt(s['steady_env_steps_per_s'], ',.0f')} "
                          f"({common.fmt(spread_r[0], ',.0f')}-{common.fmt(spread_r[1], ',.0f')})",
                          ", ".join(s["kept"])])
    lines.append(common.markdown_table(headers, table))
    lines.append("")
    for e in summary:
        lines.append(f"- {e['workload']} ({e['what']}): steady rate vs the faster peer variant "
                     f"{common.fmt(e['speedup_vs_informed_peer'], '.3f')}x; end to end (faster peer wall "
                     f"over rose-jax's) {common.fmt(e['end_to_end_vs_informed_peer'], '.3f')}x")
    lines.append("")
    lines.append("Runs (each process):")
    lines.append("")
    lines.append(common.markdown_table(
        ["workload", "variant", "#", "rc", "end to end s", "first row s", "steady env-steps/s", "finished",
         "checkpoint", "policy", "XLA options line"],
        [[r["workload"], r["variant"], r["repeat"], r["returncode"], r["end_to_end_s"], r["first_row_s"],
          common.fmt(r["steady_env_steps_per_s"], ",.0f"), r["finished"], r["checkpoint"], r["policy_saved"],
          r["xla_options_line"] or r["error"] or ""] for r in records]))
    common.write_markdown_and_plot(out, lines, plot, summary)


def plot(summary: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [k + i * width for k in range(len(summary))]
        axes[0].bar(xs, [(e[v]["steady_env_steps_per_s"] or 0) for e in summary], width, label=v)
        axes[1].bar(xs, [(e[v]["end_to_end_s"] or 0) for e in summary], width, label=v)
    for ax, title in zip(axes, ("steady env-steps/s", "whole run s (compile included)"), strict=True):
        ax.set_xticks([k + width for k in range(len(summary))], [e["workload"] for e in summary])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="ppo-ant", help=f"comma-separated of {', '.join(WORKLOADS)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds")
    p.add_argument("--run-timeout-s", type=float, default=400.0)
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "default_options"))
    p.add_argument("--merge", action="store_true", help="add to the runs already in --out/results.json")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke workload, one repeat")
    args = p.parse_args(argv)
    workloads = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for v in variants:
        variant_command(v)
    command = "python -m benchmarks.experiments.default_options " + " ".join(argv or sys.argv[1:])
    records: list[dict[str, Any]] = []
    if args.merge and os.path.exists(os.path.join(args.out, "results.json")):
        with open(os.path.join(args.out, "results.json")) as f:
            old = json.load(f)
        stamp = {"call": (old.get("machine") or {}).get("date")}
        records = [{**stamp, **r} for r in old.get("runs", [])]
    date = common.machine_info(jax_devices=False).get("date")
    for repeat in range(1, (1 if args.smoke else args.repeats) + 1):
        for w in workloads:
            for v in variants:  # interleaved: each repeat runs every variant once
                if common.elapsed() > args.budget_s:
                    common.log(f"budget spent: {w} {v} #{repeat} not run")
                    continue
                records.append({"call": date, **one_run(w, v, repeat, args.run_timeout_s)})
                write(args.out, records, command)
    write(args.out, records, command)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
