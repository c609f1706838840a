"""benchmarks.experiments.brax_parity --smoke: both trainers run Brax's keywords end to end and the
results (json, md, png) are written, so the H200 run's plumbing is known to work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_brax_parity_smoke(tmp_path):
    out = tmp_path / "parity"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.brax_parity", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
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
