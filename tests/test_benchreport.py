"""rose_jax.benchreport: a benchmark report over run directories.

Every test but the last builds run directories SYNTHETICALLY: records written with the real
``rose_jax.rundir.RunDir`` API (write_run, restart_record, append, finish) holding made-up rows
with known scores and timestamps, not training. The last test trains two seeds of a tiny PPO on
cartpole through ``algos.sweep.train_many`` and reports them.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest

from rose_jax import benchreport as br
from rose_jax.rundir import SUMMARY, RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, scores, *, algo="ppo", env="cartpole", seed=0, config=None, status="finished",
             error=None, key="eval_episode_return", t0=1000.0, dt=1.0, timed=True):
    """A synthetic run directory: one row per score at env steps 100, 200, ...; row i at
    ``wall_s = dt * (i + 1)`` and (``timed``) unix ``time = t0 + wall_s``."""
    run = RunDir(os.fspath(path))
    run.write_run({"algo": algo, "env": env, "env_kwargs": {},
                   "config": {"seed": seed, "learning_rate": 3e-4, "num_envs": 4, **(config or {})}})
    run.restart_record([])
    for i, score in enumerate(scores):
        row = {"env_steps": 100 * (i + 1), "wall_s": dt * (i + 1), key: score, "episodes": i}
        if timed:
            row["time"] = t0 + dt * (i + 1)
        run.append(row)
    run.finish(status, "synthetic", {"error": error} if error else None)
    return os.fspath(path)


def _one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """cartpole/ppo: 8 finished seeds whose final scores are 1..7 and 100, a failed seed (its
    record's score 1000 must not count) and a finished seed with no finite score (NaN -> null);
    pendulum/sac: 2 seeds timed later (the benchmark's end); a run that failed before it started
    (a summary, no run.json: as a sweep records a broken env factory). Shared by the module's tests, which
    only read it."""
    root = tmp_path_factory.mktemp("bench")
    finals = [1, 2, 3, 4, 5, 6, 7, 100]
    for s, final in enumerate(finals):
        make_run(root / "cartpole" / f"seed-{s}", [0.0, final / 2, final], seed=s)
    make_run(root / "cartpole" / "seed-8", [0.0, 1000.0], seed=8, status="failed",
             error="RuntimeError: out of memory | while compiling")
    make_run(root / "cartpole" / "seed-9", [math.nan, math.nan, math.nan], seed=9, key="episode_return")
    make_run(root / "pendulum" / "seed-0", [-900.0, -500.0, -200.0], algo="sac", env="pendulum", seed=0,
             t0=1010.0, dt=2.0)
    make_run(root / "pendulum" / "seed-1", [-1000.0, -600.0, -300.0], algo="sac", env="pendulum", seed=1,
             t0=1011.0, dt=2.0)
    RunDir(os.fspath(root / "broken")).finish("failed", "synthetic", {"error": "RuntimeError: broken env"})
    return root


def test_collect_reads_runs_and_failed_runs_have_no_score(bench):
    runs = br.collect(bench)
    assert len(runs) == 13 and [r.path for r in runs] == sorted(r.path for r in runs)
    by_seed = {r.seed: r for r in runs if r.env == "cartpole"}
    ok = by_seed[7]
    assert (ok.algo, ok.status, ok.score, ok.score_key, ok.env_steps, ok.wall_s) == (
        "ppo", "finished", 100.0, "eval_episode_return", 300, 3.0)
    assert ok.curve_steps == (100.0, 200.0, 300.0) and ok.curve_scores == (0.0, 50.0, 100.0)
    assert ok.counted and ok.settings == ""  # seeds alone differ: one task
    failed = by_seed[8]
    assert failed.status == "failed" and math.isnan(failed.score) and not failed.counted
    assert failed.error == "RuntimeError: out of memory | while compiling"
    unscored = by_seed[9]
    assert unscored.status == "finished" and unscored.score_key is None and math.isnan(unscored.score)
    assert "no finite score" in unscored.reason
    # a run directory given directly, and twice (with its root): read once
    assert len(br.collect([bench / "cartpole" / "seed-0", bench])) == 13
    (broken,) = [r for r in runs if r.path.endswith("broken")]  # no run.json: kept, with its error
    assert (broken.algo, broken.env, broken.status) == ("?", "?", "failed")
    assert broken.error == "RuntimeError: broken env"
    assert (broken.env_steps, broken.curve_steps, broken.counted) == (0, (), False)


def test_iqm_mean_median_on_known_scores(bench):
    stats = {t.env: t for t in br.aggregate(br.collect(bench))}
    t = stats["cartpole"]
    assert (t.n, len(t.runs)) == (8, 10)  # the failed and the unscored seeds are not counted
    assert t.mean == pytest.approx(128 / 8)  # 1 + ... + 7 + 100
    assert t.iqm == pytest.approx(4.5)  # the middle 50%: 3, 4, 5, 6
    assert t.median == pytest.approx(4.5)
    assert t.env_steps == (300, 300) and t.wall_s == pytest.approx(3.0)
    assert t.mean_ci[0] <= t.mean <= t.mean_ci[1] and t.iqm_ci[0] <= t.iqm <= t.iqm_ci[1]
    assert t.iqm_ci[1] - t.iqm_ci[0] < t.mean_ci[1] - t.mean_ci[0]  # the IQM resists the outlier
    # fewer than 4 runs: nothing is trimmed (rliable's trim_mean(x, 0.25)), the IQM is the mean
    assert br.iqm([1.0, 2.0, 10.0]) == pytest.approx(13 / 3)
    assert br.iqm([1.0, 2.0, 3.0, 4.0, 100.0]) == pytest.approx(3.0)  # floor(5/4) = 1 cut at each end
    assert stats["pendulum"].mean == pytest.approx(-250.0)


def test_bootstrap_ci_contains_the_mean_narrows_with_runs_and_is_reproducible():
    base = np.random.default_rng(0).normal(10.0, 3.0, size=4)
    widths = []
    for copies in (1, 4, 16):  # the same spread of scores seen in 4, 16, 64 runs
        x = np.tile(base, copies)
        lo, hi = br.bootstrap_ci(x)
        assert lo <= x.mean() <= hi
        lo_i, hi_i = br.bootstrap_ci(x, br.iqm)
        assert lo_i <= br.iqm(x) <= hi_i
        assert br.bootstrap_ci(x) == (lo, hi)  # a fixed seed: the same interval every time
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2]
    assert br.bootstrap_ci([5.0]) == (5.0, 5.0)  # one run: no spread was sampled
    assert all(math.isnan(v) for v in br.bootstrap_ci([]))
    with pytest.raises(ValueError, match="resamples"):
        br.bootstrap_ci([1.0, 2.0], resamples=0)


def test_settings_that_differ_make_tasks(tmp_path):
    for s in (0, 1):
        make_run(tmp_path / f"lr-small-{s}", [1.0, 2.0], seed=s, config={"learning_rate": 1e-3})
        make_run(tmp_path / f"lr-big-{s}", [1.0, 3.0], seed=s, config={"learning_rate": 1e-2})
    stats = br.aggregate(br.collect(tmp_path))
    assert [(t.settings, t.n, t.mean) for t in stats] == [
        ("learning_rate=0.001", 2, 2.0), ("learning_rate=0.01", 2, 3.0)]
    assert stats[0].label == "ppo on cartpole (learning_rate=0.001)"


def test_report_files(bench, tmp_path):
    out = tmp_path / "report"
    paths = br.write_report(bench, out, title="synthetic bench")
    assert set(paths) == {"report", "scores", "curves"}
    assert sorted(os.listdir(out)) == ["curves.png", "report.md", "scores.json"]  # no temporary left

    md = open(paths["report"], encoding="utf-8").read()
    assert md.startswith("# synthetic bench\n")
    cart = next(line for line in md.splitlines() if line.startswith("| ppo on cartpole"))
    assert "| 8/2 |" in cart and "| 300 |" in cart and "| 16.0 [" in cart and "| 4.5 [" in cart
    failed_table = md.split("## Runs not counted")[1]
    assert "seed-8" in failed_table and "RuntimeError: out of memory \\| while compiling" in failed_table
    assert "seed-9" in failed_table and "no finite score" in failed_table
    assert "| ? on ? | — | failed | RuntimeError: broken env |" in failed_table
    assert "seed-7" not in failed_table
    # the benchmark's wall-clock: first start 1000 (cartpole rows' time - wall_s) to last end
    # 1011 + 3 * 2 = 1017 (pendulum seed 1's last row)
    assert "Benchmark wall-clock: 17.0 s" in md

    text = open(paths["scores"], encoding="utf-8").read()

    def no_constants(name):
        raise AssertionError(f"not strict JSON: {name}")

    matrix = json.loads(text, parse_constant=no_constants)
    assert matrix["benchmark"]["wall_s"] == pytest.approx(17.0)
    cart = next(t for t in matrix["tasks"] if t["env"] == "cartpole")
    assert cart["n"] == 8 and cart["iqm"] == pytest.approx(4.5) and len(cart["iqm_ci"]) == 2
    by_seed = {r["seed"]: r for r in cart["runs"]}
    assert by_seed[9]["score"] is None and not by_seed[9]["counted"]  # NaN -> null
    assert by_seed[8]["score"] is None and by_seed[8]["status"] == "failed"
    assert by_seed[8]["error"].startswith("RuntimeError")
    assert by_seed[3]["score"] == 4.0 and by_seed[3]["path"].endswith("seed-3")
    assert cart["scores"].count(None) == 2

    assert open(paths["curves"], "rb").read(8) == PNG_MAGIC


def test_curves_have_one_panel_per_env(bench, tmp_path):
    runs = br.collect(bench)
    two = br.plot_curves(runs, tmp_path / "two.png")
    one = br.plot_curves([r for r in runs if r.env == "cartpole"], tmp_path / "one.png")
    assert two == ["cartpole", "pendulum"] and one == ["cartpole"]
    (w2, h2), (w1, h1) = _png_size(tmp_path / "two.png"), _png_size(tmp_path / "one.png")
    assert w2 > 1.6 * w1 and h2 == pytest.approx(h1, rel=0.2)  # two panels side by side
    # the mean curve of the counted cartpole seeds: same env steps, no interpolation needed
    steps, mean, low, high = br.mean_curve([r for r in runs if r.env == "cartpole"])
    assert steps.tolist() == [100.0, 200.0, 300.0] and mean[-1] == pytest.approx(16.0)
    assert np.all(low <= mean) and np.all(mean <= high)
    # no counted run at all: a placeholder panel, no env
    assert br.plot_curves([r for r in runs if not r.counted], tmp_path / "none.png") == []
    assert open(tmp_path / "none.png", "rb").read(8) == PNG_MAGIC


def test_curves_of_seeds_with_different_steps_are_interpolated(tmp_path):
    make_run(tmp_path / "a", [0.0, 10.0, 20.0, 30.0], seed=0)  # env steps 100..400
    make_run(tmp_path / "b", [0.0, 20.0], seed=1)  # env steps 100..200
    steps, mean, _, _ = br.mean_curve(br.collect(tmp_path))
    assert steps[0] == 100.0 and steps[-1] == 200.0 and len(steps) == br.GRID_POINTS  # the overlap
    assert mean[-1] == pytest.approx(15.0)  # (10 + 20) / 2 at 200 steps


def test_run_span_without_row_times_uses_the_summary_time(tmp_path):
    path = make_run(tmp_path / "untimed", [1.0, 2.0], timed=False, dt=5.0)  # as `rose-jax train` rows
    os.utime(os.path.join(path, SUMMARY), (2000.0, 2000.0))
    assert br.run_span(path) == (1990.0, 2000.0)  # the end minus the last row's wall_s (10 s)


def test_paths_without_runs_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no run directory") as e:
        br.collect(tmp_path / "empty")
    _one_line_error(e)
    with pytest.raises(ValueError, match="does not exist") as e:
        br.write_report(tmp_path / "missing", tmp_path / "out")
    _one_line_error(e)
    assert not (tmp_path / "out").exists()
    assert br.main([str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no run directory" in err


def test_main_prints_the_table_and_writes_the_files(bench, tmp_path, capsys):
    assert br.main([str(bench), "--out", str(tmp_path / "r"), "--title", "cli"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# cli\n") and "| ppo on cartpole | 8/2 |" in out
    assert sorted(os.listdir(tmp_path / "r")) == ["curves.png", "report.md", "scores.json"]


def test_report_of_a_real_two_seed_sweep(tmp_path):
    """Two seeds of a tiny PPO on cartpole (10-step episodes, so episodes finish), trained as one
    vmapped program by algos.sweep.train_many into <root>/seed-<s>: both are aggregated."""
    from algos import ppo, sweep

    config = ppo.PPOConfig(num_timesteps=16 * 4, num_envs=4, unroll_length=4, num_minibatches=1,
                           num_epochs=1, policy_hidden_sizes=(8,), value_hidden_sizes=(8,))
    root = tmp_path / "sweep"
    sweep.train_many(config, "cartpole", (0, 1), run_dirs=sweep.seed_dirs(root, (0, 1)),
                     env_kwargs={"episode_length": 10}, checkpoints=False)
    paths = br.write_report(root, root)
    runs = br.collect(root)
    assert [(r.seed, r.status, r.algo, r.env, r.env_steps) for r in runs] == [
        (0, "finished", "ppo", "cartpole", 64), (1, "finished", "ppo", "cartpole", 64)]
    assert all(r.score_key == "episode_return" and math.isfinite(r.score) for r in runs)
    assert all(r.start_time < r.end_time for r in runs)
    (task,) = br.aggregate(runs)
    assert task.n == 2 and task.settings == "" and math.isfinite(task.iqm)
    assert task.mean == pytest.approx(np.mean([r.score for r in runs]))
    matrix = json.load(open(paths["scores"], encoding="utf-8"))
    assert [r["seed"] for r in matrix["tasks"][0]["runs"]] == [0, 1]
    assert "| ppo on cartpole | 2/0 | 64 |" in open(paths["report"], encoding="utf-8").read()
