"""benchmarks.experiments.brax_parity --smoke: both trainers run Brax's keywords end to end and the
results (json, md, png) are written, so the H200 run's plumbing is known to work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers_children import FAST_COMPILE_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# plumbing, not numerics: XLA's fast compile for the children (Brax's trainers compile twice)
FAST_COMPILE = {
    **os.environ,
    "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS,
}


@pytest.mark.slow
def test_brax_parity_smoke(tmp_path):
    out = tmp_path / "parity"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.brax_parity", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=FAST_COMPILE,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert [(r["runner"], r["algo"]) for r in runs] == [
        ("brax", "ppo"),
        ("rose-jax", "ppo"),
        ("brax", "sac"),
        ("rose-jax", "sac"),
    ]
    for r in runs:
        assert {"runner", "env_steps", "eval_return", "wall_s", "compile_s", "curve"} <= set(r)
        assert r["eval_return"] is not None and r["env_steps"] > 0, r
    ppo_brax, ppo_ours = runs[0], runs[1]
    # the same schedule: progress reports at the same env steps
    assert [c[0] for c in ppo_brax["curve"]] == [c[0] for c in ppo_ours["curve"]]
    assert "machine" in results and results["machine"]["command"]
    assert (out / "results.md").read_text().startswith("# Brax's published configurations")
    assert (out / "learning_curves.png").stat().st_size > 1000

    # a long run split over device calls: one runner, a later seed, merged into the same files
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.experiments.brax_parity",
            "--smoke",
            "--out",
            str(out),
            "--algos",
            "ppo",
            "--runners",
            "rose-jax",
            "--first-seed",
            "1",
            "--merge",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=FAST_COMPILE,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    merged = json.loads((out / "results.json").read_text())["runs"]
    seed = runs[1]["config"]["seed"]
    assert [(r["runner"], r["algo"], r["config"]["seed"]) for r in merged] == [
        ("brax", "ppo", seed),
        ("rose-jax", "ppo", seed),
        ("brax", "sac", runs[2]["config"]["seed"]),
        ("rose-jax", "sac", runs[3]["config"]["seed"]),
        ("rose-jax", "ppo", seed + 1),
    ]
    assert "--runners rose-jax" in merged[-1]["command"] and "--merge" not in merged[0]["command"]
    assert "Commands (each run's own, oldest first):" in (out / "results.md").read_text()


def test_merge_replaces_the_same_run_and_summary_keeps_lengths_apart():
    from benchmarks.experiments import brax_parity as P

    def run(runner, seed, steps, ret):
        return {
            "runner": runner,
            "algo": "ppo",
            "env": "ant",
            "config": {"seed": seed, "num_timesteps": steps},
            "eval_return": ret,
            "curve": [[steps, ret, 10.0]],
        }

    old = [run("brax", 1, 10, 470.0), run("rose-jax", 1, 10, 456.0), run("brax", 1, 50, 1.0)]
    new = [run("brax", 1, 50, 2000.0), run("rose-jax", 1, 50, 2100.0)]
    merged = P.merge_runs(old, new)
    assert [(r["runner"], r["config"]["num_timesteps"], r["eval_return"]) for r in merged] == [
        ("brax", 10, 470.0),
        ("rose-jax", 10, 456.0),
        ("brax", 50, 2000.0),
        ("rose-jax", 50, 2100.0),
    ]
    summary = P.summarize(merged)
    assert [(s["num_timesteps"], s["brax_return"], s["rose_jax_return"]) for s in summary] == [
        (10, 470.0, 456.0),
        (50, 2000.0, 2100.0),
    ]
    assert [s["within_brax_spread_or_above"] for s in summary] == [False, True]
    # the median time is over the runs that reached Brax's mean final return, and says how many did
    assert [(s["brax_reached"], s["rose_jax_reached"]) for s in summary] == [("1/1", "0/1"), ("1/1", "1/1")]
    assert summary[0]["rose_jax_s_to_brax_final"] is None and summary[1]["rose_jax_s_to_brax_final"] == 10.0
