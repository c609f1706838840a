"""`rose-jax train` as a newcomer meets it, in real CLI processes (issue 29).

- MJX-backed envs train to completion (an MJCF model, Brax's MJX backend, a Playground env; PPO
  and SAC): final checkpoint, metrics.json, curve, summary, and a policy that ``load_policy`` and
  ``rose-jax play`` load in fresh processes. (MJX Data holds zero-size arrays, which orbax refuses
  to write: every such run used to die at its last checkpoint.)
- A run directory belongs to one process: a second one is refused in one line naming the holder,
  and the first's files stay intact.
- Ctrl-C with stdout and stderr piped into a reader that died with the same Ctrl-C (``| tee``)
  still ends in a checkpoint and exit status 130.
- ``--resume`` falls back past a truncated newest checkpoint to the previous one, and TensorBoard
  shows no step twice.
- Sizes that cannot fit are refused before any directory is made; the record is strict JSON.

Only one thing is injected, and only where the test says so: a sleep after each metrics row
(``ROSE_TEST_SLOW``), so that a signal or a second process lands while the run is going.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers_children import FAST_COMPILE_XLA_FLAGS, run_together
from rose_jax import rundir

REPO = Path(__file__).resolve().parents[1]

# rose_jax.cli.main, with an optional sleep after each metrics row (seconds in $ROSE_TEST_SLOW)
SLOW_CLI = r"""
import os, sys, time
from rose_jax import cli, rundir
slow = float(os.environ.get("ROSE_TEST_SLOW") or 0)
if slow:
    append = rundir.RunDir.append
    def slow_append(self, row):
        append(self, row)
        time.sleep(slow)
    rundir.RunDir.append = slow_append
sys.exit(cli.main(sys.argv[1:]))
"""

PENDULUM = [
    "train", "--env", "pendulum", "--algo", "ppo", "--steps", str(24 * 64), "--set", "num_envs=8",
    "--set", "unroll_length=8", "--set", "num_minibatches=2", "--set", "num_epochs=2",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile-cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "ROSE_JAX_COMPILE_CACHE": str(cache),
        "ROSE_JAX_PLAN_CACHE": str(tmp_path_factory.mktemp("plan-cache")),
        "PYTHONPATH": str(REPO),
        "MUJOCO_GL": os.environ.get("MUJOCO_GL", "osmesa"),
    }


def cli(argv, env, slow: float = 0.0, **popen):
    return subprocess.Popen([sys.executable, "-c", SLOW_CLI, *argv], cwd=REPO,
                            env={**env, "ROSE_TEST_SLOW": str(slow)}, **popen)


def run_cli(argv, env, timeout=300):
    proc = cli(argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_rows(run_dir: Path, n: int, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(rundir.RunDir(str(run_dir)).rows()) < n:
        assert proc.poll() is None, f"exited {proc.returncode} before {n} rows"
        assert time.monotonic() < deadline, f"fewer than {n} rows after {timeout}s"
        time.sleep(0.05)


def strict_json(text: str):
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------ MJX envs to completion


MJX_RUNS = {
    # name: argv after `train`
    # episode_length=100 (the envs' default is 1000): the final policy evaluation and SAC's evaluations
    # run that many steps
    "mjcf-ppo": ["--env", "mjx_cartpole", "--env-arg", "episode_length=100", "--algo", "ppo",
                 "--steps", "512", "--set", "num_envs=8", "--set", "unroll_length=8",
                 "--set", "num_minibatches=4", "--set", "num_epochs=1"],
    "brax-mjx-sac": ["--env", "inverted_pendulum", "--backend", "mjx", "--env-arg", "episode_length=100",
                     "--algo", "sac", "--steps", "384",
                     "--set", "num_envs=8", "--set", "batch_size=32", "--set", "min_replay_size=64",
                     "--set", "num_evals=2", "--set", "num_eval_envs=4"],
    "playground-ppo": ["--env", "playground:CartpoleBalance", "--env-arg", "episode_length=100",
                       "--algo", "ppo", "--steps", "512", "--set", "num_envs=8", "--set", "unroll_length=8",
                       "--set", "num_minibatches=4", "--set", "num_epochs=1"],
}


@pytest.mark.slow
def test_mjx_envs_train_to_completion_and_play_back(env, tmp_path):
    pytest.importorskip("mujoco.mjx", reason="mujoco-mjx is not installed")
    runs = dict(MJX_RUNS)
    try:
        import mujoco_playground  # noqa: F401
    except ImportError:
        runs.pop("playground-ppo")  # optional package (scripts/setup.sh installs it)
    dirs = {name: tmp_path / name for name in runs}
    # plumbing, not numerics: XLA's fast compile (MJX's compiles are most of this test's time)
    env = {**env, "XLA_FLAGS": FAST_COMPILE_XLA_FLAGS}
    done = run_together(
        {name: ([sys.executable, "-c", SLOW_CLI, "train", *argv, "--run-dir", str(dirs[name])], env)
         for name, argv in runs.items()},
        cwd=str(REPO), timeout=600,
    )
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-3000:])
        run_dir = dirs[name]
        for f in ("run.json", "metrics.jsonl", "metrics.json", "learning_curve.png", "summary.json",
                  "policy.json"):
            assert (run_dir / f).is_file(), (name, f)
        summary = strict_json((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished", name
        steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        assert steps and steps[-1] == summary["env_steps"], (name, steps)  # the final checkpoint
        strict_json((run_dir / "metrics.json").read_text())
        assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")], name

    # the policies load in a fresh process (one for all runs: its start and JAX import were most
    # of three processes' time): load_policy + make_env + act, then the `rose-jax play` command
    load_and_play = (
        "import sys, jax, jax.numpy as jnp, algos\n"
        "from rose_jax import cli\n"
        "for run_dir in sys.argv[1:]:\n"
        "    act = algos.load_policy(run_dir); env = act.make_env()\n"
        "    state = env.reset(jax.random.PRNGKey(0)); a = act(state.obs)\n"
        "    assert a.shape == (env.action_size,) and bool(jnp.all(jnp.abs(a) <= 1)), a\n"
        "    print('loaded', run_dir, act.meta['env'], act.meta['final_eval_return'], flush=True)\n"
        "    rc = cli.main(['play', run_dir, '--episodes', '1', '--max-steps', '20'])\n"
        "    print('played', run_dir, rc, flush=True)\n"
        "    assert rc == 0, (run_dir, rc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", load_and_play, *(str(dirs[name]) for name in runs)],
        cwd=str(REPO), env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in runs:
        after = proc.stdout.split(f"loaded {dirs[name]} ", 1)
        assert len(after) == 2 and "return" in after[1].split("played", 1)[0], (name, proc.stdout)
        assert f"played {dirs[name]} 0" in proc.stdout, (name, proc.stdout)


# ------------------------------------------------------------------ one run directory, one process


@pytest.mark.slow
def test_lock_ctrl_c_through_dead_pipes_and_resume_past_a_truncated_checkpoint(env, tmp_path):
    from algos import checkpoint, tb

    run_dir = tmp_path / "run"
    argv = [*PENDULUM, "--run-dir", str(run_dir), "--checkpoint-every", "2", "--keep-checkpoints", "0"]
    first = cli(argv, env, slow=1.0, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_rows(run_dir, 1, first)
        run_json = (run_dir / "run.json").read_bytes()

        # a second and a third process on the same directory: refused in one line, nothing written
        done = run_together({
            "resume": ([sys.executable, "-c", SLOW_CLI, *argv, "--resume"], env),
            "fresh": ([sys.executable, "-c", SLOW_CLI, *argv], env),
        }, cwd=str(REPO), timeout=300)
        busy = done["resume"]
        assert busy.returncode == 1, busy.stderr[-3000:]
        line = busy.stderr.strip().splitlines()[-1]
        assert f"is in use by pid {first.pid}" in line and "Traceback" not in busy.stderr, busy.stderr
        assert done["fresh"].returncode == 1 and "already holds a run" in done["fresh"].stderr
        assert first.poll() is None  # the first run goes on
        assert (run_dir / "run.json").read_bytes() == run_json

        # Ctrl-C as `rose-jax train ... 2>&1 | tee log` gets it: the reader of both pipes is gone
        wait_rows(run_dir, 5, first)
        first.stdout.close()
        first.stderr.close()
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=120) == 130
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    rows = rundir.RunDir(str(run_dir)).rows()
    assert 5 <= len(rows) < 24
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))  # the first's record, whole
    assert (run_dir / "run.json").read_bytes() == run_json
    steps = checkpoint.all_steps(run_dir / "checkpoints")
    assert steps[-1] == rows[-1]["env_steps"] and len(steps) >= 3  # saved at the stop, and every 2
    assert strict_json((run_dir / "summary.json").read_text())["status"] == "interrupted"

    # the newest checkpoint truncated (a disk that filled up): --resume takes the previous one
    newest, previous = steps[-1], steps[-2]
    for f in (run_dir / "checkpoints" / str(newest)).rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and f.name != "rose_jax_meta.json":
            with open(f, "r+b") as fh:
                fh.truncate(16)
    proc = run_cli([*argv, "--resume"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {newest} does not restore" in proc.stdout, proc.stdout
    assert f"resuming at {previous:,} env steps" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = rundir.RunDir(str(run_dir)).rows()
    assert [r["iteration"] for r in rows] == list(range(1, 25))
    # strict JSON: before any episode ends the mean return is NaN, written as null
    text = (run_dir / "metrics.json").read_text()
    record = strict_json(text)
    assert "NaN" not in text and record[0]["episode_return"] is None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        strict_json(line)
    # TensorBoard: the rows after the previous checkpoint were logged twice; none shows twice
    scalars = tb.read_scalars(run_dir / "tb")
    for tag, values in scalars.items():
        logged = [s for s, _ in values]
        assert len(logged) == len(set(logged)), (tag, logged)
    assert sorted(s for s, _ in scalars["training/policy_loss"]) == [r["env_steps"] for r in rows]


# ------------------------------------------------------------------ sizes refused before any work


def test_sizes_that_cannot_fit_are_refused_before_any_directory(env, tmp_path):
    cases = {
        "envs-1e12": ["--set", "num_envs=1e12"],
        # fits the int32 step counter, not any machine's memory (about 1 TB)
        "envs-2e9": ["--set", "num_envs=2e9", "--set", "unroll_length=1", "--set", "num_minibatches=1"],
        "seed-1e30": ["--set", "seed=1e30"],
        "steps-1e30": ["--steps", "1e30"],
    }
    done = run_together(
        {name: ([sys.executable, "-m", "rose_jax.cli", "train", "--env", "cartpole", *extra,
                 "--run-dir", str(tmp_path / name)], env) for name, extra in cases.items()},
        cwd=str(REPO), timeout=300,
    )
    for name, proc in done.items():
        assert proc.returncode == 1, (name, proc.stderr[-2000:])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert lines and lines[-1].startswith("rose-jax train: "), (name, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (name, proc.stderr[-2000:])
        assert not (tmp_path / name).exists(), name
    assert "GiB" in done["envs-2e9"].stderr and "num_envs=2000000000" in done["envs-2e9"].stderr
    assert "int32" in done["envs-1e12"].stderr and "int32" in done["steps-1e30"].stderr
    assert "2**32 - 1" in done["seed-1e30"].stderr


def test_run_dir_under_a_file_is_a_one_line_error(env, tmp_path):
    (tmp_path / "file").write_text("x")
    proc = run_cli([*PENDULUM, "--run-dir", str(tmp_path / "file" / "run")], env)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "is a file, not a directory" in lines[-1] and "Traceback" not in proc.stderr
    assert not (tmp_path / "file").is_dir()


# ------------------------------------------------------------------ XLA options by default


@pytest.mark.slow
def test_a_second_run_reuses_the_option_decision_without_a_trial(env, tmp_path):
    """The option trial's decision is cached per (program, candidates, GPU model, jax version): a
    second run of the same program compiles only the kept build, runs no trial, says so in one
    line and records it (a CPU-valid set stands in for the GPU sets)."""
    run_env = {**env, "ROSE_JAX_XLA_OPTION_SETS": '{"same_program": {}}',
               "ROSE_JAX_PLAN_CACHE": str(tmp_path / "plans")}
    records, outs = [], []
    for name in ("first", "second"):
        proc = run_cli([*PENDULUM, "--run-dir", str(tmp_path / name)], run_env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append([line for line in proc.stdout.splitlines() if "XLA options" in line])
        records.append(json.loads((tmp_path / name / "run.json").read_text())["xla_options"])
    assert not records[0]["cached"] and set(records[0]["median_ms"]) == {"default", "same_program"}
    assert records[1]["cached"] and records[1]["median_ms"] == {}
    assert records[1]["chosen"] == records[0]["chosen"]
    assert len(outs[1]) == 1 and "no trial" in outs[1][0]


@pytest.mark.slow
def test_option_sets_refused_fall_back_to_the_default_build(env, tmp_path):
    """Without --optimize, train tries XLA option sets on its first iterations (GPU: CONCURRENT
    command buffers). A set that does not compile is refused in one line, the run continues on
    the default build, equal to a run that tried nothing, and run.json records the decision.
    (On a CPU the shipped sets are GPU options: the refused set is given through the variable.)"""
    broken = '{"broken": {"xla_this_flag_does_not_exist": true}}'
    done = run_together({
        "tried": ([sys.executable, "-m", "rose_jax.cli", *PENDULUM, "--run-dir", str(tmp_path / "tried")],
                  {**env, "ROSE_JAX_XLA_OPTION_SETS": broken}),
        "plain": ([sys.executable, "-m", "rose_jax.cli", *PENDULUM, "--xla-options", "default",
                   "--run-dir", str(tmp_path / "plain")], env),
        "bad": ([sys.executable, "-m", "rose_jax.cli", *PENDULUM, "--xla-options", "fastest",
                 "--run-dir", str(tmp_path / "bad")], env),
    }, cwd=str(REPO), timeout=300)
    tried = done["tried"]
    assert tried.returncode == 0, tried.stderr[-3000:]
    lines = [line for line in tried.stdout.splitlines() if "XLA options" in line]
    assert len(lines) == 1 and "default build kept" in lines[0] and "broken refused" in lines[0], lines
    record = json.loads((tmp_path / "tried" / "run.json").read_text())["xla_options"]
    assert record["chosen"] == "default" and "broken" in record["refused"]
    assert done["plain"].returncode == 0 and "XLA options" not in done["plain"].stdout
    assert "xla_options" not in json.loads((tmp_path / "plain" / "run.json").read_text())

    def rows(name):
        record = rundir.RunDir(str(tmp_path / name)).rows()
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in record]

    assert rows("tried") == rows("plain") and len(rows("plain")) == 24
    assert done["bad"].returncode == 1 and "--xla-options must be" in done["bad"].stderr
    assert not (tmp_path / "bad").exists()
