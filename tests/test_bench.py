"""``rose-jax bench`` (algos/bench.py): expansion, packing, the mode decision, failure containment,
resume and the report, on tiny CPU configs (real training, real run directories)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from algos import bench

TINY = [
    "num_envs=4",
    "unroll_length=4",
    "num_minibatches=1",
    "num_epochs=1",
    "policy_hidden_sizes=[8]",
    "value_hidden_sizes=[8]",
]
REPO = Path(__file__).resolve().parent.parent


def _env(tmp_path) -> dict:
    """The CLI's environment: its persistent compile cache in the test's directory, and XLA's fast
    compile (these children test plumbing, not numerics, and spend their time compiling). Imported
    here: the children import this module (``make_broken_env``) without the tests' helpers on
    their path."""
    from helpers_children import FAST_COMPILE_XLA_FLAGS

    return {
        **os.environ,
        "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS,
        "ROSE_JAX_COMPILE_CACHE": str(tmp_path / "xla-cache"),
        "ROSE_JAX_PLAN_CACHE": str(tmp_path / "plan-cache"),
    }


def make_broken_env(**_):
    """An env factory that raises (a user's broken env): its group fails when it starts."""
    raise RuntimeError("broken env factory (test)")


def test_expand_and_plan_pack_data_settings_into_one_program():
    runs = bench.expand(
        ["pendulum", "cartpole"],
        ["ppo"],
        [0, 1],
        sets=TINY,
        grid=["learning_rate=1e-3,3e-4", "entropy_cost=0.0,0.01"],
        steps=64,
    )
    assert len(runs) == 2 * 4 * 2
    assert len({r.run_dir("/r") for r in runs}) == len(runs)
    groups = bench.plan(runs)
    # learning_rate and entropy_cost are data: one program per env, 8 runs each
    assert [len(g.runs) for g in groups] == [8, 8] and {g.env for g in groups} == {"pendulum", "cartpole"}
    g = groups[0]
    assert sorted(dict(g.settings[0])) == ["entropy_cost", "learning_rate"]
    assert len({(r.seed, s) for r, s in zip(g.runs, g.settings, strict=True)}) == 8
    # a shape field in the grid splits programs
    runs = bench.expand(["pendulum"], ["ppo"], [0], sets=TINY[1:], grid=["num_envs=4,8"], steps=64)
    assert [len(g.runs) for g in bench.plan(runs)] == [1, 1]
    # --max-group splits a large group in order
    runs = bench.expand(["pendulum"], ["ppo"], [0, 1, 2, 3, 4], sets=TINY, steps=64)
    assert [len(g.runs) for g in bench.plan(runs, max_group=2)] == [2, 2, 1]


def test_scoped_settings_and_bad_requests_are_one_line():
    runs = bench.expand(
        ["pendulum"], ["ppo", "sac"], [0], sets=["ppo.num_envs=4", "learning_rate=1e-3"], steps=64
    )
    ppo_run = next(r for r in runs if r.algo == "ppo")
    sac_run = next(r for r in runs if r.algo == "sac")
    assert dict(ppo_run.overrides)["num_envs"] == 4 and "num_envs" not in dict(sac_run.overrides)
    with pytest.raises(ValueError, match="not a sac config field.*sac.unroll_length|unroll_length"):
        bench.expand(["pendulum"], ["ppo", "sac"], [0], sets=["unroll_length=4"])
    with pytest.raises(ValueError, match="distinct"):
        bench.expand(["pendulum"], ["ppo"], [1, 1])
    with pytest.raises(ValueError, match="max-group"):
        bench.plan(runs, max_group=0)


def test_runs_that_would_share_a_directory_are_refused_and_long_labels_stay_apart():
    with pytest.raises(ValueError, match="share the directory"):
        bench.expand(["pendulum"], ["ppo"], [0], grid=["learning_rate=1e-3,0.001"])
    a, b = bench._safe("x" * 90 + "a"), bench._safe("x" * 90 + "b")
    assert a != b and len(a) == len(b) == 80


def test_choose_mode_follows_the_measured_probe():
    # two programs that slow each other down little: side by side wins
    mode, why = bench.choose_mode([0.010, 0.020], [0.012, 0.024], [100, 100])
    assert mode == "processes" and "side by side" in why
    # a GPU already full: together each takes twice as long -> one after another
    mode, _ = bench.choose_mode([0.010, 0.010], [0.020, 0.021], [100, 100])
    assert mode == "sequential"


def _parse(argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_cli_bad_input_is_one_line_and_makes_nothing(tmp_path, capsys):
    for argv, match in (
        (["--algo", "ppo"], "--env is required"),
        (["--env", "pendulum", "--algo", "nope"], "nope"),
        (["--env", "pendulum", "--seeds", "1,1"], "distinct"),
        (["--env", "pendulum", "--set", "nosuch=1"], "nosuch"),
        (["--env", "pendulum", "--steps", "0"], "> 0"),
    ):
        assert bench.main_bench(_parse([*argv, "--run-dir", str(tmp_path / "b")])) == 2, argv
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "b").exists()
    assert bench.main_bench(_parse(["--resume", "--run-dir", str(tmp_path / "b")])) == 2
    assert "holds no benchmark" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_trains_every_run_contains_a_failure_resumes_and_reports(tmp_path):
    """Two programs (pendulum: 2 seeds x 2 learning rates vmapped; a broken env's group) one after
    another; the broken group is reported failed, the other finishes; the report aggregates the
    four runs; --resume redoes nothing that finished."""
    root = tmp_path / "b"
    broken = "tests.test_bench:make_broken_env"
    argv = [
        "--env",
        f"pendulum,{broken}",
        "--algo",
        "ppo",
        "--seeds",
        "2",
        "--steps",
        "64",
        "--grid",
        "learning_rate=1e-3,3e-4",
        "--run-dir",
        str(root),
        *sum((["--set", s] for s in TINY), []),
    ]
    r = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "bench", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    plan = json.loads((root / "bench.json").read_text())
    assert plan["mode"] == "sequential" and "cpu backend" in plan["why"]
    assert len(plan["groups"]) == 2 and [len(g["runs"]) for g in plan["groups"]] == [4, 4]
    ok = [v for k, v in plan["statuses"].items() if k.startswith("pendulum")]
    bad = [v for k, v in plan["statuses"].items() if not k.startswith("pendulum")]
    assert ok == ["finished"] and bad[0].startswith("failed") and "broken env factory" in bad[0]
    pendulum_runs = sorted(p.parent for p in (root / "pendulum").rglob("summary.json"))
    assert len(pendulum_runs) == 4
    for d in pendulum_runs:  # each run directory holds that run's own config
        info = json.loads((d / "run.json").read_text())
        lr = float(d.parent.name.split("=")[1])
        assert info["config"]["learning_rate"] == pytest.approx(lr)
        assert info["config"]["seed"] == int(d.name.split("-")[1])
        assert json.loads((d / "summary.json").read_text())["status"] == "finished"
    report = (root / "report" / "report.md").read_text()
    assert "learning_rate=0.001" in report and "learning_rate=0.0003" in report
    assert "## Packing" in report and "one vmapped program" in report and "cpu backend" in report
    assert "broken env factory" in report  # the failed runs, listed with their error
    scores = json.loads((root / "report" / "scores.json").read_text())
    assert scores and (root / "report" / "curves.png").stat().st_size > 1000
    before = {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in pendulum_runs}
    r2 = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "bench", "--resume", "--run-dir", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert r2.returncode == 1, r2.stderr[-2000:]  # the broken group fails again; nothing else is redone
    plan2 = json.loads((root / "bench.json").read_text())
    assert [v for k, v in plan2["statuses"].items() if k.startswith("pendulum")] == ["finished (already)"]
    assert before == {d: (d / "metrics.jsonl").stat().st_mtime_ns for d in pendulum_runs}
    assert os.path.exists(root / "report" / "report.md")


@pytest.mark.slow
def test_ctrl_c_stops_with_checkpoints_and_resume_finishes(tmp_path):
    """Ctrl-C during a benchmark: the group in flight stops after its step with checkpoints, later
    groups do not start, the report is written; --resume finishes every run from there."""
    import signal
    import time

    root = tmp_path / "b"
    argv = [
        "--runs",
        "ppo/pendulum,ppo/cartpole",
        "--seeds",
        "2",
        "--steps",
        str(16 * 1500),
        "--run-dir",
        str(root),
        "--checkpoint-every",
        "5",
        *sum((["--set", s] for s in TINY), []),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rose_jax.cli", "bench", *argv],
        cwd=REPO,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    record = root / "pendulum" / "ppo" / "seed-0" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (record.exists() and len(record.read_text().splitlines()) >= 10):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    plan = json.loads((root / "bench.json").read_text())
    first, second = (plan["statuses"][g["name"]] for g in plan["groups"])
    assert first.startswith("interrupted") and second == "not started (interrupted)"
    assert (root / "report" / "report.md").exists(), out[-3000:] + err[-3000:]
    ckpts = [
        int(p.name)
        for p in (root / "pendulum" / "ppo" / "seed-1" / "checkpoints").iterdir()
        if p.name.isdigit()
    ]
    assert ckpts and max(ckpts) < 16 * 1500
    r2 = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "bench", "--resume", "--run-dir", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    for env in ("pendulum", "cartpole"):
        for s in (0, 1):
            d = root / env / "ppo" / f"seed-{s}"
            assert json.loads((d / "summary.json").read_text())["status"] == "finished"
            steps = [json.loads(line)["env_steps"] for line in (d / "metrics.jsonl").read_text().splitlines()]
            assert steps == sorted(set(steps)) and steps[-1] == 16 * 1500  # one record, no step twice


@pytest.mark.slow
def test_processes_mode_runs_each_program_in_its_own_process(tmp_path):
    """--mode processes: one child process per program (plain processes on a CPU, MPS with quotas on a
    GPU), each run in the benchmark's layout, a settings group vmapped inside its process."""
    root = tmp_path / "b"
    argv = [
        "--runs",
        "ppo/pendulum,ppo/cartpole",
        "--seeds",
        "1",
        "--steps",
        "64",
        "--mode",
        "processes",
        "--grid",
        "ppo.learning_rate=1e-3,3e-4",
        "--run-dir",
        str(root),
        *sum((["--set", s] for s in TINY), []),
    ]
    r = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "bench", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = json.loads((root / "bench.json").read_text())
    assert plan["mode"] == "processes" and plan["why"] == "--mode processes"
    assert sorted(plan["statuses"].values()) == ["finished", "finished"]
    for env in ("pendulum", "cartpole"):
        for lr in ("0.001", "0.0003"):
            d = root / env / "ppo" / f"learning_rate={lr}" / "seed-0"
            assert json.loads((d / "summary.json").read_text())["status"] == "finished", d
            assert json.loads((d / "run.json").read_text())["config"]["learning_rate"] == pytest.approx(
                float(lr)
            )
    assert len(list((root / "processes").glob("*/log.txt"))) == 2  # one process per program
    assert "cartpole" in (root / "report" / "report.md").read_text()
    # --resume in processes mode: a group left unfinished (its summaries gone) is resumed from its
    # checkpoints in its process, the finished one is kept as it is
    for d in (root / "pendulum").rglob("summary.json"):
        d.unlink()
    r2 = subprocess.run(
        [sys.executable, "-m", "rose_jax.cli", "bench", "--resume", "--run-dir", str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(tmp_path),
    )
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    plan = json.loads((root / "bench.json").read_text())
    by = {k.split("-")[0]: v for k, v in plan["statuses"].items()}
    assert by == {"pendulum": "finished", "cartpole": "finished (already)"}


@pytest.mark.slow
def test_probe_times_each_program_alone_and_together(tmp_path, monkeypatch):
    """The GPU planner's measurement, run here on a CPU: each program's step alone, then all at
    once as processes (real child processes), positive seconds per unit for each."""
    from helpers_children import FAST_COMPILE_XLA_FLAGS

    monkeypatch.setenv("ROSE_JAX_COMPILE_CACHE", str(tmp_path / "xla-cache"))
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE_XLA_FLAGS)  # the probe's children: timing plumbing
    runs = bench.expand(["pendulum", "cartpole"], ["ppo"], [0, 1], sets=TINY, steps=64)
    groups = bench.plan(runs)
    lines = []
    solo, together = bench.probe(groups, steps=2, log=lines.append)
    assert len(solo) == len(together) == 2 and all(t > 0 for t in solo + together)
    assert any("probe alone" in ln for ln in lines) and any("probe together" in ln for ln in lines)
    mode, why = bench.choose_mode(solo, together, [bench._num_units(g) for g in groups])
    assert mode in ("sequential", "processes") and "probe" in why
