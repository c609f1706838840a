"""Many runs on one GPU, end to end: a benchmark through `rose-jax bench` against the same runs one
after another through `rose-jax train`, compile and start-up included on both sides.

    python -m benchmarks.experiments.many_runs --workloads ppo-ant-4 --modes vmapped --repeats 2
    python -m benchmarks.experiments.many_runs --workloads mixed --modes mixed,mps_plain --steps-scale 0.1
    python -m benchmarks.experiments.many_runs --smoke        # CPU: tiny runs of every step

Per workload (its runs: ``rose-jax bench``'s request, expanded by :func:`algos.bench.expand`):

- ``sequential``: each run alone, ``python -m rose_jax.cli train <the run's argv>``, one after
  another, as a user would run them: one persistent compile cache, empty at the first run (the
  first compiles, later ones of the same program hit the cache). ``sequential_s`` = their sum.
- packed, one per ``--modes``: ``python -m rose_jax.cli bench <request> <mode flags>`` on a fresh
  compile cache: ``vmapped`` (runs of one shape as one vmapped program), ``mixed`` (the planner's
  choice, ``--mode auto``), ``mps_quotas`` / ``mps_plain`` (one process per run under MPS with
  slack-aware quotas / without quotas; plain processes where MPS is unavailable).
  ``end_to_end_s`` = that process's wall-clock.

Also per packed run: where its time went (process start to the first progress row of the first
run: imports, compile, option trial; the rows' span; after the last row: checkpoints, report), and
whether each run's final return lies within the spread of the solo runs of its task (the
sequential runs are those solo runs). Writes ``results.json``, ``results.md``, ``results.png`` into
``--out`` (default ``benchmarks/results/many_runs``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import common
from rose_jax.io import atomic_write_json

OUT_DIR = os.path.join(common.RESULTS_DIR, "many_runs")
TINY = [
    "num_envs=4",
    "unroll_length=4",
    "num_minibatches=1",
    "num_epochs=1",
    "policy_hidden_sizes=[8]",
    "value_hidden_sizes=[8]",
]
MODES = {
    "vmapped": [],
    "mixed": ["--mode", "auto"],
    "mps_quotas": ["--max-group", "1", "--mode", "processes", "--quotas", "auto"],
    "mps_plain": ["--max-group", "1", "--mode", "processes", "--quotas", "none"],
}
WORKLOADS: dict[str, dict[str, Any]] = {
    "ppo-ant-4": dict(
        request=["--runs", "ppo/ant", "--preset", "published", "--seeds", "4"],
        what="4 seeds of PPO ant, Brax's published config (4096 envs; 50M env steps each)",
    ),
    "ppo-ant-8": dict(
        request=["--runs", "ppo/ant", "--preset", "published", "--seeds", "8"],
        what="8 seeds of PPO ant, Brax's published config (4096 envs; 50M env steps each)",
    ),
    "mixed": dict(
        request=[
            "--runs",
            "ppo/ant,sac/hopper,ppo/humanoid",
            "--preset",
            "published",
            "--seeds",
            "1",
            "--set",
            "sac.num_timesteps=500000",
        ],
        what="three programs: PPO ant 4096 envs (50M), SAC hopper high-update 128 envs (500k), "
        "PPO humanoid 2048 envs (50M), Brax's published configs",
    ),
    "smoke": dict(
        request=[
            "--runs",
            "ppo/pendulum,ppo/cartpole",
            "--seeds",
            "2",
            "--steps",
            "256",
            *sum((["--set", s] for s in TINY), []),
        ],
        what="CPU smoke: tiny PPO on pendulum and cartpole, 2 seeds each",
    ),
}


def _bench_args(argv: list[str]):
    from algos import bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def expand(workload: str, steps_scale: float) -> tuple[list[str], list[Any]]:
    """(the bench request's argv, its runs) with every run's length scaled by ``steps_scale``."""
    from algos import bench

    argv = list(WORKLOADS[workload]["request"])
    req = bench.request_of(_bench_args(argv))
    runs = bench.expand(
        req["env"],
        req["algo"],
        req["seeds"],
        req["set"],
        req["grid"],
        req["steps"],
        req["preset"],
        req["env_kwargs"],
        [tuple(p) for p in req["pairs"]] if req.get("pairs") else None,
    )
    if steps_scale != 1.0:
        scaled = []
        import dataclasses

        for r in runs:
            over = dict(r.overrides)
            from algos import registry

            n = over.get("num_timesteps") or registry.get(r.algo).make_config().num_timesteps
            over["num_timesteps"] = max(1, int(n * steps_scale))
            scaled.append(dataclasses.replace(r, overrides=tuple(sorted(over.items()))))
        runs = scaled
        # the bench request gets the same lengths, per algorithm (one length per algo in our workloads)
        for algo in dict.fromkeys(r.algo for r in runs):
            n = next(dict(r.overrides)["num_timesteps"] for r in runs if r.algo == algo)
            argv += ["--set", f"{algo}.num_timesteps={n}"]
    return argv, runs


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, err = p.returncode, (p.stderr or p.stdout)
    except subprocess.TimeoutExpired:
        rc, err = None, f"timed out after {timeout_s:.0f}s"
    return rc, err, time.perf_counter() - t0


def _final_return(run_dir: str) -> float | None:
    """The run's final score by the benchmark report's rule (:mod:`rose_jax.benchreport`); None
    when the run has none (or no directory)."""
    from rose_jax import benchreport

    if not os.path.isdir(run_dir):
        return None
    score = benchreport.collect([run_dir])[0].score
    return None if math.isnan(score) else float(score)


def sequential(workload: str, runs: list[Any], timeout_s: float, tmp: str) -> dict[str, Any]:
    """Each run alone through ``rose-jax train``, one after another, one compile cache."""
    env = {
        **os.environ,
        "ROSE_JAX_COMPILE_CACHE": os.path.join(tmp, "seq-cache"),
        "ROSE_JAX_PLAN_CACHE": os.path.join(tmp, "seq-plans"),
    }
    walls, returns, errors = [], {}, []
    for i, r in enumerate(runs):
        run_dir = os.path.join(tmp, "seq", f"{i}")
        rc, err, wall = _run(
            [
                sys.executable,
                "-m",
                "rose_jax.cli",
                "train",
                *r.train_argv(),
                "--run-dir",
                run_dir,
                "--no-tensorboard",
            ],
            env,
            timeout_s,
        )
        walls.append(round(wall, 2))
        task = f"{r.algo}/{r.env}"
        returns.setdefault(task, []).append(_final_return(run_dir))
        if rc != 0:
            errors.append(
                f"run {i} ({task} seed {r.seed}): rc={rc} {(err.strip().splitlines() or ['?'])[-1][:200]}"
            )
        common.log(
            f"{workload} sequential run {i + 1}/{len(runs)} ({task} seed {r.seed}): {wall:.1f}s rc={rc}"
        )
    return {
        "sequential_s": round(sum(walls), 2),
        "run_walls": walls,
        "solo_returns": returns,
        "errors": errors,
        "ok": not errors,
    }


def packed(
    workload: str, mode: str, argv: list[str], runs: list[Any], timeout_s: float, tmp: str
) -> dict[str, Any]:
    from rose_jax.rundir import RunDir

    root = os.path.join(tmp, f"bench-{mode}")
    env = {
        **os.environ,
        "ROSE_JAX_COMPILE_CACHE": os.path.join(tmp, f"cache-{mode}"),
        "ROSE_JAX_PLAN_CACHE": os.path.join(tmp, f"plans-{mode}"),
    }
    started = time.time()
    rc, err, wall = _run(
        [sys.executable, "-m", "rose_jax.cli", "bench", *argv, *MODES[mode], "--run-dir", root],
        env,
        timeout_s,
    )
    ended = time.time()
    plan = {}
    if os.path.exists(os.path.join(root, "bench.json")):
        with open(os.path.join(root, "bench.json")) as f:
            plan = json.load(f)
    firsts, lasts, returns = [], [], {}
    for r in runs:
        rows = RunDir(r.run_dir(root)).rows()
        if rows:
            firsts.append(rows[0]["time"])
            lasts.append(rows[-1]["time"])
        returns.setdefault(f"{r.algo}/{r.env}", []).append(_final_return(r.run_dir(root)))
    profile = None
    if firsts:
        profile = {
            "to_first_row_s": round(min(firsts) - started, 2),
            "rows_span_s": round(max(lasts) - min(firsts), 2),
            "after_last_row_s": round(ended - max(lasts), 2),
        }
    common.log(
        f"{workload} {mode}: {wall:.1f}s rc={rc} ({plan.get('mode')}: {plan.get('why')}) profile {profile}"
    )
    return {
        "end_to_end_s": round(wall, 2),
        "returncode": rc,
        "bench_mode": plan.get("mode"),
        "why": plan.get("why"),
        "groups": [{"name": g["name"], "runs": len(g["runs"])} for g in plan.get("groups", [])],
        "statuses": plan.get("statuses"),
        "profile": profile,
        "returns": returns,
        "error": None if rc == 0 else (err.strip().splitlines() or ["?"])[-1][:300],
    }


def _within(returns: dict[str, list], solo: dict[str, list]) -> bool | None:
    """Every packed run's final return within [min, max] of the solo runs of its task (None: unknown)."""
    verdicts = []
    for task, values in returns.items():
        ref = [v for v in solo.get(task, []) if v is not None]
        if len(ref) < 2 or any(v is None for v in values):
            return None
        lo, hi = min(ref), max(ref)
        verdicts += [lo <= v <= hi for v in values]
    return all(verdicts) if verdicts else None


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        seqs = [r for r in records if r["workload"] == workload and r["kind"] == "sequential" and r["ok"]]
        seq = [r["sequential_s"] for r in seqs]
        solo: dict[str, list] = {}
        for r in seqs:
            for task, vals in r["solo_returns"].items():
                solo.setdefault(task, []).extend(vals)
        for mode in dict.fromkeys(
            r["mode"] for r in records if r["workload"] == workload and r["kind"] == "packed"
        ):
            packs = [
                r
                for r in records
                if r["workload"] == workload
                and r["kind"] == "packed"
                and r["mode"] == mode
                and r["returncode"] == 0
            ]
            e2e = [r["end_to_end_s"] for r in packs]
            first = next((r for r in records if r["workload"] == workload), {})
            row = {
                "workload": workload,
                "what": WORKLOADS[workload]["what"],
                "runs": first.get("runs"),
                "env_steps_per_run": first.get("env_steps_per_run"),
                "mode": mode,
                "sequential_s": statistics.median(seq) if seq else None,
                "end_to_end_s": statistics.median(e2e) if e2e else None,
                "speedup_end_to_end": round(statistics.median(seq) / statistics.median(e2e), 3)
                if seq and e2e
                else None,
                "repeats": {"sequential": len(seq), "packed": len(e2e)},
                "spread": {
                    "sequential": [min(seq), max(seq)] if seq else None,
                    "packed": [min(e2e), max(e2e)] if e2e else None,
                },
                "planner": sorted({f"{r['bench_mode']}: {r['why']}" for r in packs}),
                "profile": [r["profile"] for r in packs],
                "returns_within_solo_spread": _within(
                    {k: v for r in packs for k, v in r["returns"].items()}, solo
                ),
                "command": first.get("command"),
                "date": first.get("call"),
            }
            rows.append(row)
    return rows


TARGETS = (
    "4 seeds of PPO ant >= 2.0x end to end; 8 seeds >= 3.0x; mixed (>= 3 programs) >= 1.3x and faster than "
    "the same programs as plain concurrent processes (mps_plain)"
)


def write(out: str, records: list[dict[str, Any]], command: str) -> None:
    os.makedirs(out, exist_ok=True)
    summary = summarize(records)
    machine = {**common.machine_info(), "command": command}
    atomic_write_json(
        os.path.join(out, "results.json"),
        {"machine": machine, "targets": TARGETS, "summary": summary, "runs": records},
    )
    lines = [
        "# Many runs on one GPU, end to end",
        "",
        f"{machine.get('date')} on {machine.get('gpu') or machine.get('backend')}; command: `{command}`. "
        "Generated by `benchmarks/experiments/many_runs.py`.",
        "",
        "sequential = the same runs one after another through `rose-jax train` (one compile cache, "
        "empty at the "
        "first run); packed = one `rose-jax bench` process (fresh compile cache). Both are whole processes, "
        "compile and start-up included. s: median (min-max).",
        "",
        f"Targets: {TARGETS}.",
        "",
    ]
    body = []
    for r in summary:
        sp, pk = r["spread"]["sequential"], r["spread"]["packed"]
        body.append(
            [
                r["workload"],
                r["runs"],
                f"{r['env_steps_per_run']:,}" if r["env_steps_per_run"] else "-",
                r["mode"],
                f"{common.fmt(r['sequential_s'])} ({common.fmt(sp and sp[0])}-{common.fmt(sp and sp[1])})",
                f"{common.fmt(r['end_to_end_s'])} ({common.fmt(pk and pk[0])}-{common.fmt(pk and pk[1])})",
                common.fmt(r["speedup_end_to_end"], ".2f"),
                f"{r['repeats']['sequential']}/{r['repeats']['packed']}",
                r["returns_within_solo_spread"],
                "; ".join(r["planner"]),
            ]
        )
    lines.append(
        common.markdown_table(
            [
                "workload",
                "runs",
                "env steps per run",
                "mode",
                "sequential s",
                "end to end s",
                "speedup end to end",
                "repeats (seq/packed)",
                "returns within solo spread",
                "planner",
            ],
            body,
        )
    )
    lines += [
        "",
        "Where the packed runs' time went (process start to the first row: imports, compile, option "
        "trial; the rows' span; after the last row: final checkpoints, report):",
        "",
    ]
    lines.append(
        common.markdown_table(
            ["workload", "mode", "to first row s", "rows span s", "after last row s"],
            [
                [
                    r["workload"],
                    r["mode"],
                    common.fmt(p.get("to_first_row_s")),
                    common.fmt(p.get("rows_span_s")),
                    common.fmt(p.get("after_last_row_s")),
                ]
                for r in summary
                for p in r["profile"]
                if p
            ],
        )
    )
    common.write_markdown_and_plot(out, lines, plot, summary)


def plot(summary: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(summary)), 3.6))
    labels = [f"{r['workload']}\n{r['mode']}" for r in summary]
    xs = range(len(summary))
    ax.bar([x - 0.2 for x in xs], [r["sequential_s"] or 0 for r in summary], 0.4, label="one after another")
    ax.bar([x + 0.2 for x in xs], [r["end_to_end_s"] or 0 for r in summary], 0.4, label="rose-jax bench")
    for x, r in zip(xs, summary, strict=True):
        if r["speedup_end_to_end"]:
            ax.annotate(
                f"{r['speedup_end_to_end']:.2f}x",
                (x + 0.2, r["end_to_end_s"] or 0),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("whole benchmark s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    common.save_plot(fig, path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="ppo-ant-4", help=f"comma-separated of {', '.join(WORKLOADS)}")
    p.add_argument("--modes", default="vmapped", help=f"packed modes: {', '.join(MODES)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--steps-scale", type=float, default=1.0, help="scale every run's length (e.g. 0.2 of 50M)"
    )
    p.add_argument(
        "--no-sequential", action="store_true", help="packed runs only (sequential from an earlier call)"
    )
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--run-timeout-s", type=float, default=540.0)
    p.add_argument("--out", default=OUT_DIR)
    p.add_argument("--merge", action="store_true", help="add to the records already in --out/results.json")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke workload, one repeat")
    args = p.parse_args(argv)
    names = ["smoke"] if args.smoke else [w.strip() for w in args.workloads.split(",") if w.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.smoke and args.modes == "vmapped":
        modes = ["vmapped", "mps_plain"]
    for n in names:
        if n not in WORKLOADS:
            p.error(f"unknown workload {n!r}; known: {', '.join(WORKLOADS)}")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    command = "python -m benchmarks.experiments.many_runs " + " ".join(argv)
    records: list[dict[str, Any]] = []
    results = os.path.join(args.out, "results.json")
    if args.merge and os.path.exists(results):
        with open(results) as f:
            records = json.load(f).get("runs", [])
    date = common.machine_info(jax_devices=False).get("date")
    for repeat in range(1, (1 if args.smoke else args.repeats) + 1):
        for name in names:
            bench_argv, runs = expand(name, args.steps_scale)
            steps = sorted({dict(r.overrides).get("num_timesteps") for r in runs})
            base = {
                "workload": name,
                "repeat": repeat,
                "call": date,
                "runs": len(runs),
                "env_steps_per_run": steps[0] if len(steps) == 1 else None,
                "steps": steps,
                "command": "python -m rose_jax.cli bench " + " ".join(bench_argv),
            }
            tmp = tempfile.mkdtemp(prefix=f"many-runs-{name}-")
            try:
                if not args.no_sequential and common.elapsed() < args.budget_s:
                    records.append(
                        {**base, "kind": "sequential", **sequential(name, runs, args.run_timeout_s, tmp)}
                    )
                    write(args.out, records, command)
                for mode in modes:
                    if common.elapsed() > args.budget_s:
                        common.log(f"budget spent: {name} {mode} #{repeat} not run")
                        continue
                    records.append(
                        {
                            **base,
                            "kind": "packed",
                            "mode": mode,
                            **packed(name, mode, bench_argv, runs, args.run_timeout_s, tmp),
                        }
                    )
                    write(args.out, records, command)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    write(args.out, records, command)
    print(open(os.path.join(args.out, "results.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
