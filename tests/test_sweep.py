"""algos.sweep: K seeds as one vmapped program, K runs as K processes (CPU).

Tolerance of "vmapped equals solo" on a CPU: every leaf of each seed's TrainState and every
metric of each step within ``rtol=1e-5, atol=1e-6`` of the solo run's. It is not bitwise: XLA's
batched matmuls (the vmapped gradients) sum in another order than the unbatched ones, which
moves parameters by an ulp or so per iteration (measured: <= 3e-8 after one PPO iteration).

The process tests run real child processes (``python -m algos.sweep --child``) on a tiny PPO
pendulum config; they share one persistent XLA compilation cache so that the program compiles
once. The MPS daemon there is the MOCK ``nvidia-cuda-mps-control`` of ``tests/test_mps.py``
(not NVIDIA's program; CPU JAX ignores the client variables): it checks that the quota reaches
each process's birth environment and that the daemon outlives a killed client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

import envs
from algos import checkpoint, driver, ppo, sweep

RTOL, ATOL = 1e-5, 1e-6
TINY = dict(num_envs=4, unroll_length=4, num_minibatches=1, num_epochs=1,
            policy_hidden_sizes=(8,), value_hidden_sizes=(8,))
ENV = envs.make("pendulum", episode_length=20)  # one object: the jitted programs are cached per env


def make_broken_env(**_):
    """An env factory that raises (a user's broken env): the run that uses it fails at start."""
    raise RuntimeError("broken env factory (test)")


def make_gated_pendulum(gate: str):
    """The pendulum, built once the file ``gate`` exists: orders a test's events (the run that
    uses it starts training only when the test says so, e.g. after another run is mid-run)."""
    deadline = time.monotonic() + 150
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {gate} never opened")
        time.sleep(0.05)
    return envs.make("pendulum")


@pytest.fixture(scope="module")
def xla_cache():
    d = tempfile.mkdtemp(prefix="rose-test-sweep-xla-")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _assert_close_trees(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        g, w, where = np.asarray(g), np.asarray(w), f"{what}{jax.tree_util.keystr(path)}"
        if g.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)


def _assert_close_rows(got, want, what):
    assert len(got) == len(want), what
    for g, w in zip(got, want, strict=True):
        for name, value in w.items():
            if isinstance(value, float) and math.isnan(value):
                # in memory NaN; in a run directory's record null (strict JSON, rose_jax.rundir)
                assert g[name] is None or math.isnan(g[name]), (what, name)
            elif isinstance(value, (int, float)):
                assert g[name] == pytest.approx(value, rel=RTOL, abs=ATOL), (what, name)


@pytest.mark.slow
def test_vmapped_ppo_seeds_equal_solo_runs_and_checkpoints_are_per_seed(tmp_path):
    env, config, seeds = ENV, ppo.PPOConfig(num_timesteps=16 * 6, **TINY), (3, 0, 7)
    dirs = sweep.seed_dirs(tmp_path, seeds)
    result = sweep.train_many(config, env, seeds, run_dirs=dirs, checkpoint_every=6)
    assert jax.tree.leaves(result.state)[0].shape[0] == 3
    for i, seed in enumerate(seeds):
        solo_state, solo_rows = ppo.train_with_config(dataclasses.replace(config, seed=seed), env)
        _assert_close_trees(result.seed_state(i), solo_state, f"seed {seed} state")
        _assert_close_rows(result.metrics[i], solo_rows, f"seed {seed} metrics")
        # the run directory: its own record, summary and checkpoints (slices of the vmapped state)
        rows = sweep.read_metrics(dirs[i])
        assert [r["env_steps"] for r in rows] == [16 * (j + 1) for j in range(6)]
        _assert_close_rows(rows, solo_rows, f"seed {seed} record")
        assert sweep.read_summary(dirs[i])["status"] == "finished"
        assert json.loads(Path(dirs[i], "run.json").read_text())["config"]["seed"] == seed
        ckpt = os.path.join(dirs[i], "checkpoints")
        assert checkpoint.all_steps(ckpt) == [96]
        restored, _ = checkpoint.restore(ckpt, solo_state)
        _assert_close_trees(restored, solo_state, f"seed {seed} checkpoint")
    # distinct seeds learn differently (the test would pass trivially if all slices were one seed)
    p = [jax.tree.leaves(result.seed_state(i).params)[0] for i in range(3)]
    assert not np.allclose(p[0], p[1])


@pytest.mark.slow
def test_vmapped_ppo_with_evaluations_equals_solo_runs(tmp_path):
    """num_evals set (Brax's run shape): the group's step is the epoch of iterations then the
    evaluation, batched over the runs; each run equals its solo ``train_with_config`` (whose
    step-0 evaluation a sweep does not run: its rows are compared from the first epoch)."""
    env, seeds = ENV, (0, 5)
    config = ppo.PPOConfig(num_timesteps=16 * 6, num_evals=4, num_eval_envs=2, **TINY)
    dirs = sweep.seed_dirs(tmp_path, seeds)
    result = sweep.train_many(config, env, seeds, run_dirs=dirs)
    for i, seed in enumerate(seeds):
        solo_state, solo_rows = ppo.train_with_config(dataclasses.replace(config, seed=seed), env)
        _assert_close_trees(result.seed_state(i), solo_state, f"seed {seed} state")
        rows = sweep.read_metrics(dirs[i])
        solo_epochs = [r for r in solo_rows if r["env_steps"] > 0]
        assert [r["env_steps"] for r in rows] == [r["env_steps"] for r in solo_epochs] == [32, 64, 96]
        for mine, theirs in zip(rows, solo_epochs, strict=True):
            assert np.isfinite(mine["eval_episode_return"])
            np.testing.assert_allclose(mine["eval_episode_return"], theirs["eval_episode_return"], rtol=RTOL,
                                       atol=ATOL)
    assert result.metrics[0][-1]["eval_episode_return"] != result.metrics[1][-1]["eval_episode_return"]


@pytest.mark.slow
def test_settings_group_with_evaluations_equals_solo_runs(tmp_path):
    """Data settings (learning rates as traced values) and Brax's evaluation epoch together: the
    evaluator's cache key holds no traced value, and each run equals its solo run."""
    env, seeds = ENV, (0, 0)
    config = ppo.PPOConfig(num_timesteps=16 * 6, num_evals=4, num_eval_envs=2, **TINY)
    settings = [{"learning_rate": 1e-3}, {"learning_rate": 3e-4}]
    result = sweep.train_many(config, env, seeds, settings=settings)
    for i, one in enumerate(settings):
        solo_state, solo_rows = ppo.train_with_config(dataclasses.replace(config, seed=0, **one), env)
        _assert_close_trees(result.seed_state(i), solo_state, f"run {i} state")
        solo_epochs = [r for r in solo_rows if r["env_steps"] > 0]
        np.testing.assert_allclose([r["eval_episode_return"] for r in result.metrics[i]],
                                   [r["eval_episode_return"] for r in solo_epochs], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("with_settings", [False, True])
def test_option_trial_in_a_group_equals_the_plain_group_and_is_recorded(tmp_path, with_settings):
    """xla_options: the group's step runs under the fastest of XLA's defaults and the given sets
    (here a set with no options: the same program, so a CPU can run the trial; on a GPU the
    CONCURRENT sets); the runs are the plain group's, bitwise, and run.json says what was kept."""
    env, seeds = ENV, (0, 1)
    config = ppo.PPOConfig(num_timesteps=16 * 8, **TINY)
    settings = [{"learning_rate": 1e-3}, {"learning_rate": 3e-4}] if with_settings else None
    plain = sweep.train_many(config, env, seeds, settings=settings)
    lines = []
    dirs = sweep.seed_dirs(tmp_path, seeds)
    tried = sweep.train_many(config, env, seeds, settings=settings, run_dirs=dirs, checkpoints=False,
                             xla_options={"same_program": {}}, log=lines.append)
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(tried.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(lines) == 1 and "XLA options:" in lines[0]
    for d in dirs:
        xo = json.loads(Path(d, "run.json").read_text())["xla_options"]
        assert xo["tried"] == ["default", "same_program"] and xo["chosen"] in ("default", "same_program")
        assert set(xo["median_ms"]) == {"default", "same_program"}


def test_vmapped_resume_continues_every_seed(tmp_path):
    env, config, seeds = ENV, ppo.PPOConfig(num_timesteps=16 * 6, **TINY), (0, 1, 2)
    dirs = sweep.seed_dirs(tmp_path, seeds)
    full = sweep.train_many(config, env, seeds)  # the program of the test above (3 seeds): no compile

    def stop_at_48(env_steps, rows):  # as a Ctrl-C: stop after the step in flight, with checkpoints
        if env_steps == 48:
            raise driver.StopTraining

    stopped = sweep.train_many(config, env, seeds, run_dirs=dirs, progress_fn=stop_at_48)
    assert stopped.stopped and all(sweep.read_summary(d)["status"] == "interrupted" for d in dirs)
    assert all(checkpoint.latest_step(os.path.join(d, "checkpoints")) == 64 for d in dirs)
    with pytest.raises(ValueError, match="already holds"):
        sweep.train_many(config, env, seeds, run_dirs=dirs)
    resumed = sweep.train_many(config, env, seeds, run_dirs=dirs, resume=True)
    _assert_close_trees(resumed.state, full.state, "resumed")
    for d in dirs:  # one record covering the whole run
        assert [r["env_steps"] for r in sweep.read_metrics(d)] == [16 * (j + 1) for j in range(6)]


def test_bad_input_is_one_line():
    env, config = ENV, ppo.PPOConfig(**TINY)
    for seeds, match in (((), "non-empty"), ((1, 1), "distinct"), ((-1,), "non-negative")):
        with pytest.raises(ValueError, match=match):
            sweep.train_many(config, env, seeds)
    with pytest.raises(ValueError, match="PPOConfig, SACConfig"):
        sweep.train_many(object(), env, (0,))
    with pytest.raises(ValueError, match="2 distinct directories"):
        sweep.train_many(config, env, (0, 1), run_dirs=["a"])
    with pytest.raises(ValueError, match="num_minibatches"):
        sweep.RunSpec("r", "ppo", "pendulum", {**TINY, "num_minibatches": 3})
    with pytest.raises(ValueError, match="name"):
        sweep.RunSpec("a b", "ppo", "pendulum")
    with pytest.raises(ValueError, match="seeds="):
        sweep.RunSpec("r", "ppo", "pendulum", {"seed": 3})
    with pytest.raises(ValueError, match="unique"):
        sweep.ProcessSweep([sweep.RunSpec("r", "ppo", "pendulum")] * 2, "x")


def _mock_mps_binary(tmp_path) -> str:
    from test_mps import FAKE_CONTROL, FAKE_SERVER

    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_CONTROL), ("nvidia-cuda-mps-server", FAKE_SERVER)):
        (bindir / name).write_text(text.format(python=sys.executable))
        (bindir / name).chmod(0o755)
    return str(bindir / "nvidia-cuda-mps-control")


def _wait_for(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_a_raise_and_a_sigkill_leave_the_daemon_and_the_other_run_going(tmp_path, xla_cache, monkeypatch):
    """Three processes under one (mock) MPS daemon with quotas: ``broken`` raises (its env factory),
    ``victim`` is SIGKILLed mid-run, ``survivor`` (gated: it starts training once the victim is
    mid-run) trains through the kill and finishes its whole run; both failures are reported;
    the daemon still answers. Nothing is left: no child process, and no shared memory (the
    processes map no /dev/shm segment while they run, and no entry named after one remains)."""
    from rose_jax.mps import MPSDaemon

    from test_mps import _mock_processes

    monkeypatch.setenv("FAKE_MPS_MODE", "ok")
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    n_survivor, gate = 2000, str(tmp_path / "gate")
    runs = [
        sweep.RunSpec("survivor", "ppo", "tests.test_sweep:make_gated_pendulum",
                      {**TINY, "num_timesteps": 16 * n_survivor}, (0,), {"gate": gate}),
        sweep.RunSpec("victim", "ppo", "pendulum", {**TINY, "num_timesteps": 16 * 10**6}, (1,)),
        sweep.RunSpec("broken", "ppo", "tests.test_sweep:make_broken_env", TINY, (2,)),
    ]
    root = tmp_path / "sweep"
    mps_dir = tempfile.mkdtemp(prefix="rsw", dir="/tmp")
    logs: list[str] = []
    try:
        with MPSDaemon(os.path.join(mps_dir, "d"), binary=_mock_mps_binary(tmp_path)) as daemon:
            with sweep.ProcessSweep(runs, root, daemon=daemon, quotas=(40, 30, 30),
                                    compile_cache_dir=xla_cache, log=logs.append) as s:
                _wait_for(lambda: len(sweep.read_metrics(root / "victim")) >= 3, 150, "the victim mid-run")
                Path(gate).touch()
                _wait_for(lambda: len(sweep.read_metrics(root / "survivor")) >= 1, 150, "the survivor")
                assert sweep.read_summary(root / "survivor") is None, "the survivor ended too early"
                maps = {n: Path(f"/proc/{pid}/maps").read_text() for n, pid in s.pids.items()
                        if n != "broken" and psutil.pid_exists(pid)}
                assert maps.keys() == {"survivor", "victim"}
                assert not [n for n, m in maps.items() if "/dev/shm/" in m], "a sweep process maps /dev/shm"
                kill_time = time.time()
                os.kill(s.pids["victim"], signal.SIGKILL)
                result = s.wait(timeout=150)
            assert daemon.healthy(), "the daemon must outlive a killed client"
            daemon_dir = daemon.run_dir
        assert not _mock_processes(daemon_dir)
    finally:
        import shutil

        shutil.rmtree(mps_dir, ignore_errors=True)

    by = {o.name: o for o in result.outcomes}
    assert by["survivor"].status == "finished", logs
    assert by["victim"].status == "killed" and by["victim"].signal == "SIGKILL"
    assert by["broken"].status == "failed" and "broken env factory" in by["broken"].error
    assert not result.ok
    rows = sweep.read_metrics(root / "survivor")
    assert [r["env_steps"] for r in rows] == [16 * (j + 1) for j in range(n_survivor)]
    assert rows[-1]["time"] > kill_time  # it kept training after the kill
    assert sweep.read_summary(root / "victim")["status"] == "killed"
    assert len(sweep.read_metrics(root / "victim")) >= 3  # its record up to the kill survives
    assert sweep.read_summary(root / "broken")["status"] == "failed"
    assert sweep.read_summary(root / "survivor")["status"] == "finished"
    born = json.loads((root / "survivor" / "process.json").read_text())["birth_env"]
    assert born == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                    "CUDA_MPS_PIPE_DIRECTORY": str(daemon_dir / "pipe")}
    assert json.loads((root / "sweep.json").read_text())["quotas"] == [40, 30, 30]
    assert any("broken: failed" in line for line in logs) and any("victim: killed" in line for line in logs)
    _wait_for(lambda: not ({p.pid for p in me.children(recursive=True)} - children_before), 10,
              "no child process left")
    pids = [str(p) for p in s.pids.values()]
    assert not [n for n in os.listdir("/dev/shm") if any(p in n for p in pids)]


class _FakeDaemon:
    """Stands in for an MPS daemon's client variables only (no process): quota decisions need no GPU."""

    pipe_dir = "/tmp/nowhere/pipe"

    def client_env(self):
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir}


def test_quotas_even_for_identical_runs_and_searched_for_different_ones(tmp_path, monkeypatch):
    """Identical runs get the even split without probes. Runs of different lengths get the slack-aware
    search; its probe measurement is MOCKED here (seconds per step = 0.01 + 1 / quota, no process):
    the run with 3x the iterations must get more SMs, and the search is kept in the result."""
    short = sweep.RunSpec("short", "ppo", "pendulum", {**TINY, "num_timesteps": 16 * 100})
    long = sweep.RunSpec("long", "ppo", "pendulum", {**TINY, "num_timesteps": 16 * 300})
    probed = []

    def fake_probe(runs, sweep_obj, quota, steps):
        probed.append((tuple(r.name for r in runs), quota))
        env = sweep_obj.child_env("probe", quota)
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(quota)  # each probe is born with its quota
        return [0.01 + 1.0 / quota for _ in runs]

    monkeypatch.setattr(sweep, "probe_runs", fake_probe)
    same = sweep.ProcessSweep([short, dataclasses.replace(short, name="short2")], tmp_path,
                              daemon=_FakeDaemon(), log=lambda m: None)
    same._setup_cache(), same._setup_mps()
    quotas, why = same._resolve_quotas()
    assert quotas == (50, 50) and "identical" in why and not probed
    diff = sweep.ProcessSweep([short, long], tmp_path, daemon=_FakeDaemon(), log=lambda m: None)
    diff._setup_cache(), diff._setup_mps()
    diff.quotas, diff.quota_reason = diff._resolve_quotas()
    assert probed and diff.quotas[1] > diff.quotas[0] and sum(diff.quotas) <= 100, diff.quotas
    assert "slack-aware search" in diff.quota_reason and diff.result().quota_search["points"]
    for bad in ((50,), (0, 50), "most"):
        with pytest.raises(ValueError, match="quotas must be"):
            sweep.ProcessSweep([short, long], tmp_path, quotas=bad)


def test_cli_rejects_bad_arguments_in_one_line_before_any_directory(tmp_path, capsys):
    import argparse

    import algos

    p = argparse.ArgumentParser()
    sweep.add_arguments(p)
    for argv, match in ((["--seeds", "1,1"], "distinct"), (["--set", "nosuch=1"], "unknown key 'nosuch'"),
                        (["--steps", "0"], "must be > 0"), (["--quotas", "x"], "--quotas"),
                        (["--grid", "learning_rate"], "--grid"), (["--env", "nosuch"], "unknown env"),
                        (["--grid", "num_minibatches=3"], "num_minibatches"),
                        (["--set", "normalize_observations=maybe"], "true or false")):
        assert sweep.main_sweep(p.parse_args([*argv, "--run-dir", str(tmp_path / "r")])) == 2, argv
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "r").exists()
    assert sweep.parse_seeds("3") == (0, 1, 2) and sweep.parse_seeds("5,2") == (5, 2)
    grid = sweep.parse_grid(algos.get("ppo"), ["learning_rate=1e-3,3e-4", "normalize_observations=false"])
    assert grid == [{"learning_rate": 1e-3, "normalize_observations": False},
                    {"learning_rate": 3e-4, "normalize_observations": False}]


@pytest.mark.slow
def test_benchmark_smoke_runs_every_phase_on_a_cpu(tmp_path, xla_cache):
    """``python -m benchmarks.experiments.sweep --smoke``: sequential, vmapped, processes and kill
    phases on the tiny pendulum config (the program of the process test above: compiled once)."""
    import subprocess

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "benchmarks.experiments.sweep", "--smoke", "--out", str(out),
                        "--compile-cache", xla_cache], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "sweep.json").read_text())
    assert (out / "sweep.md").read_text().startswith("# Many runs") and (out / "sweep.png").stat().st_size > 0
    phases = res["phases"]
    assert not [n for n, p in phases.items() if "failed" in p or "skipped" in p], phases.keys()
    for name in ("sequential", "vmapped", "mps"):
        assert phases[name]["aggregate"]["rate"] > 0, name
        assert len(phases[name]["records"]) == 2 and all(len(rows) == 12 for rows in phases[name]["records"])
    assert all(c["max_abs_dparams"] <= ATOL for c in phases["vmapped"]["param_check"])
    # the processes run the solo program: the same records as the runs one after another
    assert all(c["identical"] for c in res["summary"]["mps_vs_sequential_learning"])
    kill = phases["kill"]
    assert kill["ok"], kill
    assert {o["status"] for o in kill["sweep"]["outcomes"]} == {"finished", "killed"}
    if not res["mps"]["available"]:  # a CPU machine: plain processes, and the reason is said
        assert res["mps"]["reason"].startswith("MPS unavailable") and "MPS unavailable" in r.stdout
    assert "vmapped (one program)" in r.stdout and "kill: " in r.stdout  # the table printed last


def test_leftover_check_counts_only_its_own_sweep_children(tmp_path):
    """The benchmark's kill phase asks which sweep children are still alive after its sweep: a sweep
    child of another sweep on the machine (under pytest-xdist, a test in the other worker) is not
    one of its leftovers; one started under its root is, whatever its pid."""
    from benchmarks.experiments.sweep import _our_leftovers

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    sleep = "import time; time.sleep(60)"
    procs = {
        name: psutil.Popen([sys.executable, "-c", sleep, "algos.sweep", "--child", str(root / "r/job.json")])
        for name, root in (("ours", ours), ("theirs", theirs))
    }
    try:
        found = _our_leftovers(set(), set(), (), ours)["sweep_processes"]
        assert [int(line.split()[0]) for line in found] == [procs["ours"].pid], found
        everyone = _our_leftovers(set(), set())["sweep_processes"]  # no root: every sweep child
        assert {procs["ours"].pid, procs["theirs"].pid} <= {int(line.split()[0]) for line in everyone}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
