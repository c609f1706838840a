"""A run directory is a durable record: resume, Ctrl-C, SIGKILL at any moment, bad run directories.

The CLI runs for real, in subprocesses (PPO on pendulum, 24 tiny iterations, a persistent XLA
compilation cache shared by the subprocesses so that each one compiles nothing after the first).
Kill points are injected by a small harness around ``rose_jax.cli.main``: it SIGKILLs its own
process inside a chosen write (a torn metrics line, a checkpoint written but not renamed, a
checkpoint half pruned, an atomic file written but not renamed) or after a random delay.
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

from rose_jax import cli, rundir

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 24
STEPS_PER_ITERATION = 64
TINY = [
    "train", "--env", "pendulum", "--algo", "ppo", "--steps", str(ITERATIONS * STEPS_PER_ITERATION),
    "--set", "num_envs=8", "--set", "unroll_length=8", "--set", "num_minibatches=2", "--set", "num_epochs=2",
    "--checkpoint-every", "3", "--keep-checkpoints", "2",
]

# Runs rose_jax.cli.main(argv) after installing the kill point described by $ROSE_TEST_KILL (JSON):
#   {"mode": "append", "n": k}        die halfway through writing the k-th metrics row (a torn line)
#   {"mode": "ckpt", "n": k}          die after the k-th checkpoint is written, before its rename
#   {"mode": "prune", "n": k}         die in the k-th retention delete, after its rename, before rmtree
#   {"mode": "replace", "file": f}    die in an atomic write of f, temp file written, before the rename
#   {"mode": "timer", "delay": s}     die s seconds after the first metrics row
# and, with {"slow": s}, sleeps s seconds per metrics row (so that a signal lands mid-run).
HARNESS = r"""
import json, os, signal, sys, threading, time
spec = json.loads(os.environ.get("ROSE_TEST_KILL") or "{}")
from rose_jax import cli, rundir
from algos import checkpoint

def die():
    os.kill(os.getpid(), signal.SIGKILL)

mode, n, calls, rows = spec.get("mode"), spec.get("n", 1), [0], [0]
append = rundir.RunDir.append
def patched_append(self, row):
    rows[0] += 1
    if mode == "append" and rows[0] == n:
        line = json.dumps(row)
        self._record.write(line[: len(line) // 2])
        self._record.flush()
        die()
    append(self, row)
    if mode == "timer" and rows[0] == 1:
        threading.Timer(spec["delay"], die).start()
    if spec.get("slow"):
        time.sleep(spec["slow"])
rundir.RunDir.append = patched_append

if mode == "ckpt":
    write = checkpoint._write
    def patched_write(path, state):
        write(path, state)
        calls[0] += 1
        if calls[0] == n:
            die()
    checkpoint._write = patched_write

rename, replace = os.rename, os.replace
def patched_rename(src, dst, *a, **k):
    rename(src, dst, *a, **k)
    if mode == "prune" and "-del-" in os.path.basename(str(dst)):
        calls[0] += 1
        if calls[0] == n:
            die()
def patched_replace(src, dst, *a, **k):
    if mode == "replace" and os.path.basename(str(dst)) == spec["file"]:
        die()
    replace(src, dst, *a, **k)
os.rename, os.replace = patched_rename, patched_replace
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla-cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "PYTHONPATH": str(REPO),
    }


def run(argv, env, kill=None, timeout=240):
    e = {**env, "ROSE_TEST_KILL": json.dumps(kill or {})}
    return subprocess.run([sys.executable, "-c", HARNESS, *argv], env=e, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def record(run_dir: Path) -> list[dict]:
    return rundir.RunDir(str(run_dir)).rows()


def without_time(rows):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def same_rows(a, b) -> bool:
    """Rows equal (NaN == NaN), wall-clock time aside."""
    return json.dumps(without_time(a)) == json.dumps(without_time(b))


def assert_no_holes(rows):
    assert [r["iteration"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["env_steps"] for r in rows] == [STEPS_PER_ITERATION * (i + 1) for i in range(len(rows))]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """The record of an uninterrupted run (also fills the compilation cache)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run([*TINY, "--run-dir", str(run_dir)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = record(run_dir)
    assert len(rows) == ITERATIONS
    assert_no_holes(rows)
    return run_dir, rows


def test_resuming_a_finished_run_changes_nothing(reference, env):
    run_dir, _ = reference
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = run([*TINY, "--run-dir", str(run_dir), "--resume"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished" in proc.stdout and "nothing to do" in proc.stdout
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before  # metrics.json byte-identical, and every other file too
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    assert json.loads((run_dir / "metrics.json").read_text()) == json.loads(json.dumps(record(run_dir)))


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_resume_completes_the_same_record(reference, env, tmp_path):
    _, want = reference
    run_dir = tmp_path / "run"
    e = {**env, "ROSE_TEST_KILL": json.dumps({"slow": 0.1})}
    proc = subprocess.Popen([sys.executable, "-c", HARNESS, *TINY, "--run-dir", str(run_dir)], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 180
    while len(record(run_dir)) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Ctrl-C" in err
    assert "stopped at" in out and "--resume" in out
    rows = record(run_dir)
    assert 4 <= len(rows) < ITERATIONS
    assert_no_holes(rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["env_steps"] == rows[-1]["env_steps"]
    from algos import checkpoint

    assert checkpoint.latest_step(run_dir / "checkpoints") == rows[-1]["env_steps"]  # saved at the stop

    proc = run([*TINY, "--run-dir", str(run_dir), "--resume"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming at {rows[-1]['env_steps']:,} env steps" in proc.stdout
    rows = record(run_dir)
    assert same_rows(rows, want)  # one record of the whole run, equal to the uninterrupted one
    assert same_rows(json.loads((run_dir / "metrics.json").read_text()), want)
    walls = [r["wall_s"] for r in rows]
    assert walls == sorted(walls)  # the resumed part continues the clock


KILLS = [
    {"mode": "append", "n": 2},  # torn line before any checkpoint
    {"mode": "ckpt", "n": 1},  # first checkpoint written, never renamed
    {"mode": "append", "n": 5},
    {"mode": "replace", "file": "metrics.jsonl"},  # while cutting the record back on resume
    {"mode": "prune", "n": 1},  # mid retention delete
    {"mode": "timer", "delay": 0.15, "slow": 0.03},
    {"mode": "ckpt", "n": 2},
    {"mode": "timer", "delay": 0.05, "slow": 0.03},
    {"mode": "replace", "file": "metrics.json"},  # the final metrics.json write
    {"mode": "replace", "file": "summary.json"},
]


@pytest.mark.slow
def test_sigkill_at_any_moment_never_loses_the_run(reference, env, tmp_path):
    from algos import checkpoint

    _, want = reference
    run_dir = tmp_path / "run"
    killed = 0
    for kill in KILLS:
        proc = run([*TINY, "--run-dir", str(run_dir), "--resume"], env, kill=kill)
        assert proc.returncode in (-signal.SIGKILL, 0), (kill, proc.stderr[-3000:])
        killed += proc.returncode == -signal.SIGKILL
        rows = record(run_dir)
        assert_no_holes(rows)  # on disk, whatever the moment of death
        latest = checkpoint.latest_step(run_dir / "checkpoints")
        assert latest is None or latest <= rows[-1]["env_steps"], (kill, latest, len(rows))
    assert killed >= 8
    proc = run([*TINY, "--run-dir", str(run_dir), "--resume"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_rows(record(run_dir), want)
    assert same_rows(json.loads((run_dir / "metrics.json").read_text()), want)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    leftovers = [p for d in (run_dir, run_dir / "checkpoints") for p in d.iterdir()
                 if p.name.startswith(".") and p.name != rundir.LOCK]  # .lock: the lock's file, documented
    assert not leftovers
    assert len(checkpoint.all_steps(run_dir / "checkpoints")) <= 3  # keep 2 + the best


# ------------------------------------------------------------------ bad run directories, in-process

SMALL = ["train", "--env", "pendulum", "--steps", "256", "--set", "num_envs=8", "--set", "unroll_length=8",
         "--set", "num_minibatches=2"]


def one_line_exit(argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    text = str(e.value)
    assert "\n" not in text.strip(), text
    return text


def test_run_dir_that_is_a_file_fails_before_training(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    text = one_line_exit([*SMALL, "--run-dir", str(f)])
    assert "is a file" in text
    assert "rose-jax train:" not in capsys.readouterr().out  # no start line, no bar


def _unwritable_dir(tmp_path) -> str:
    if os.geteuid() != 0:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return str(d)
    for d in ("/sys", "/proc/self"):  # root ignores permission bits; these refuse even root
        try:
            open(os.path.join(d, ".tmp-rose-probe"), "wb").close()
        except OSError:
            return d
    pytest.skip("no directory here refuses writes (running as root)")


def test_read_only_run_dir_fails_before_training(tmp_path, capsys):
    d = _unwritable_dir(tmp_path)
    text = one_line_exit([*SMALL, "--run-dir", d])
    assert "not writable" in text or "cannot create" in text
    assert "rose-jax train:" not in capsys.readouterr().out


def test_check_writable_creates_and_probes(tmp_path):
    target = tmp_path / "a" / "b"
    rundir.check_writable(str(target))
    assert target.is_dir() and not list(target.iterdir())  # the probe is gone
    with pytest.raises(ValueError, match="is a file"):
        (tmp_path / "f").write_text("")
        rundir.check_writable(str(tmp_path / "f"))


def test_torn_last_line_is_ignored_and_cut(tmp_path):
    run = rundir.RunDir(str(tmp_path))
    run.restart_record([{"env_steps": 1, "iteration": 1}])
    run.append({"env_steps": 2, "iteration": 2})
    run.close()
    with open(tmp_path / rundir.RECORD, "a") as f:
        f.write('{"env_steps": 3, "itera')
    assert [r["iteration"] for r in run.rows()] == [1, 2]
    run.restart_record(run.rows())
    run.append({"env_steps": 3, "iteration": 3})
    run.close()
    assert [r["iteration"] for r in run.rows()] == [1, 2, 3]


def test_resume_with_nothing_to_resume_says_so(tmp_path, capsys):
    assert cli.main([*SMALL, "--run-dir", str(tmp_path / "new"), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "holds no run" in out and "starting afresh" in out
    assert len(rundir.RunDir(str(tmp_path / "new")).rows()) == 4
    text = one_line_exit([*SMALL, "--resume"])
    assert "--resume needs --run-dir" in text


def test_existing_run_needs_resume_and_same_options(tmp_path):
    run_dir = str(tmp_path / "r")
    assert cli.main([*SMALL, "--run-dir", run_dir]) == 0
    assert "pass --resume" in one_line_exit([*SMALL, "--run-dir", run_dir])
    text = one_line_exit([*SMALL, "--run-dir", run_dir, "--resume", "--set", "num_envs=4"])
    assert "num_envs=4 (the run has 8)" in text
    assert cli.main(["train", "--run-dir", run_dir, "--resume"]) == 0  # options from run.json
