"""benchmarks/experiments/many_runs.py: what it runs and the rules of its table (the whole path
runs with ``--smoke`` in about a minute on a 2-core CPU; the measurements are the H200's)."""

from __future__ import annotations

import json

import pytest

from benchmarks.experiments import many_runs as mr


def test_workloads_expand_to_brax_published_runs_and_scale():
    argv, runs = mr.expand("mixed", 1.0)
    assert [(r.algo, r.env) for r in runs] == [("ppo", "ant"), ("sac", "hopper"), ("ppo", "humanoid")]
    steps = {(r.algo, r.env): dict(r.overrides)["num_timesteps"] for r in runs}
    assert steps == {("ppo", "ant"): 50_000_000, ("sac", "hopper"): 500_000, ("ppo", "humanoid"): 50_000_000}
    assert dict(runs[0].overrides)["num_envs"] == 4096 and dict(runs[2].overrides)["num_envs"] == 2048
    assert dict(runs[1].overrides)["grad_updates_per_step"] == 64
    _, runs4 = mr.expand("ppo-ant-4", 1.0)
    assert [r.seed for r in runs4] == [0, 1, 2, 3]
    argv, scaled = mr.expand("ppo-ant-4", 0.1)
    assert {dict(r.overrides)["num_timesteps"] for r in scaled} == {5_000_000}
    assert "ppo.num_timesteps=5000000" in argv  # the bench request runs the same lengths
    # each run alone through `rose-jax train` resolves to the same config
    from rose_jax import cli

    job = cli.train_job(scaled[1].train_argv())
    assert job.config.seed == 1 and job.config.num_timesteps >= 5_000_000 and job.config.num_envs == 4096


def _rec(kind, wall, repeat=1, mode=None, returns=None, **kw):
    base = {
        "workload": "ppo-ant-4",
        "repeat": repeat,
        "call": "c",
        "runs": 4,
        "env_steps_per_run": 100,
        "command": "cmd",
        "kind": kind,
    }
    if kind == "sequential":
        return {**base, "sequential_s": wall, "ok": True, "solo_returns": returns or {"ppo/ant": [1.0, 3.0]}}
    return {
        **base,
        "mode": mode,
        "end_to_end_s": wall,
        "returncode": 0,
        "bench_mode": "sequential",
        "why": "w",
        "profile": {"to_first_row_s": 1.0, "rows_span_s": 2.0, "after_last_row_s": 0.5},
        "returns": returns or {"ppo/ant": [2.0]},
        **kw,
    }


def test_summary_speedup_spread_and_return_check(tmp_path):
    recs = [
        _rec("sequential", 100.0),
        _rec("sequential", 110.0, 2),
        _rec("packed", 50.0, mode="vmapped"),
        _rec("packed", 60.0, 2, mode="vmapped", returns={"ppo/ant": [2.5]}),
        {**_rec("packed", 5.0, mode="mps_plain"), "returncode": 1},
    ]
    rows = mr.summarize(recs)
    vm = next(r for r in rows if r["mode"] == "vmapped")
    assert vm["sequential_s"] == 105.0 and vm["end_to_end_s"] == 55.0
    assert vm["speedup_end_to_end"] == pytest.approx(105 / 55, abs=1e-3)
    assert vm["spread"] == {"sequential": [100.0, 110.0], "packed": [50.0, 60.0]}
    assert vm["repeats"] == {"sequential": 2, "packed": 2}
    assert vm["returns_within_solo_spread"] is True
    plain = next(r for r in rows if r["mode"] == "mps_plain")
    assert plain["end_to_end_s"] is None and plain["repeats"]["packed"] == 0  # a failed run is not timed
    recs[3]["returns"] = {"ppo/ant": [9.0]}  # outside the solo runs' [1, 3]
    assert (
        next(r for r in mr.summarize(recs) if r["mode"] == "vmapped")["returns_within_solo_spread"] is False
    )
    mr.write(str(tmp_path), recs, "test")
    data = json.loads((tmp_path / "results.json").read_text())
    for field in (
        "workload",
        "runs",
        "env_steps_per_run",
        "mode",
        "sequential_s",
        "end_to_end_s",
        "speedup_end_to_end",
        "repeats",
        "spread",
        "command",
        "date",
    ):
        assert field in data["summary"][0], field
    assert "| ppo-ant-4 | 4 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 1000
