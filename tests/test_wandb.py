"""Optional Weights & Biases logging (algos.tb.WandbLogger via runs.train(wandb_project=...) and
``rose-jax train --wandb [PROJECT]``): the same tags and steps as the TensorBoard events; without
wandb a one-line error naming the fix, before any run directory is made.

wandb is not a dependency, so the logging tests inject a MOCK ``wandb`` module (it says so in its
docstring) that records ``init`` / ``log`` / ``finish``; the real package is never imported here.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

from algos import runs, tb
from rose_jax import cli

TINY_PPO = dict(
    env_kwargs={"episode_length": 20},
    num_timesteps=512,
    num_envs=8,
    batch_size=8,
    num_minibatches=2,
    unroll_length=8,
    num_updates_per_batch=1,
    num_evals=2,
    num_eval_envs=4,
    policy_hidden_sizes=(8,),
    value_hidden_sizes=(8,),
    eval_envs=4,
)


@pytest.fixture
def no_wandb(monkeypatch):
    """wandb absent, whether or not it is installed (find_spec returns None for a None entry)."""
    monkeypatch.setitem(sys.modules, "wandb", None)


class FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step=None):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    """A MOCK of the ``wandb`` package in sys.modules; returns its list of recorded calls."""
    calls: list = []
    mod = types.ModuleType("wandb", "MOCK wandb for tests (records init/log/finish); not the real package")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun(calls)

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    assert "MOCK" in sys.modules["wandb"].__doc__
    return calls


def _check_logged_like_tensorboard(calls, run_dir, project):
    assert calls[0][0] == "init" and calls[-1] == ("finish",)
    init = calls[0][1]
    assert init["project"] == project and init["dir"] == str(run_dir) and init["name"] == run_dir.name
    assert init["config"]["algo"] == "ppo" and init["config"]["env"] == "pendulum"
    logs = [c for c in calls if c[0] == "log"]
    assert logs and all(isinstance(step, int) for _, _, step in logs)
    # the same tags at the same steps as the TensorBoard event files
    want: dict[str, list[tuple[int, float]]] = {}
    for _, data, step in logs:
        for tag, value in data.items():
            want.setdefault(tag, []).append((step, value))
    got = tb.read_scalars(run_dir / runs.TB_DIR)
    assert set(want) == set(got) and "eval/episode_reward" in want and "training/sps" in want
    for tag in want:
        assert [s for s, _ in want[tag]] == [s for s, _ in got[tag]], tag
        # TensorBoard stores float32
        assert [v for _, v in want[tag]] == pytest.approx([v for _, v in got[tag]], rel=1e-6), tag
    assert [s for s, _ in want["eval/episode_reward"]] == [0, 512]


def test_runs_train_without_wandb_is_one_line_error_before_the_run_dir(no_wandb, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="pip install wandb") as e:
        runs.train("ppo", "pendulum", run_dir, wandb_project="proj", **TINY_PPO)
    assert "\n" not in str(e.value)
    assert not run_dir.exists()


def test_cli_wandb_without_wandb_is_one_line_error_before_the_run_dir(no_wandb, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--env", "pendulum", "--run-dir", str(run_dir), "--wandb"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "pip install wandb" in err and "--wandb" in err and "\n" not in err, err
    assert not run_dir.exists()


def test_bad_project_name_is_one_line_error(fake_wandb, tmp_path):
    with pytest.raises(ValueError, match="non-empty") as e:
        runs.train("ppo", "pendulum", tmp_path / "run", wandb_project=" ", **TINY_PPO)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists() and fake_wandb == []


def test_runs_train_logs_tensorboard_tags_to_wandb(fake_wandb, tmp_path):
    run_dir = tmp_path / "run"
    runs.train("ppo", "pendulum", run_dir, wandb_project="proj", **TINY_PPO)
    _check_logged_like_tensorboard(fake_wandb, run_dir, "proj")
    assert json.loads((run_dir / "run.json").read_text()) == fake_wandb[0][1]["config"]


def test_cli_wandb_logs_tensorboard_tags(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # left to wandb itself: not overridden by rose-jax
    run_dir = tmp_path / "run"
    keys = [k for k in TINY_PPO if k not in ("env_kwargs", "eval_envs", "num_timesteps")]
    argv = ["train", "--env", "pendulum", "--env-arg", "episode_length=20", "--steps", "512"]
    argv += ["--run-dir", str(run_dir), "--no-compile-cache", "--wandb", "my-project"]
    for key in keys:
        argv += ["--set", f"{key}={TINY_PPO[key]}".replace(" ", "")]
    assert cli.main(argv) == 0
    _check_logged_like_tensorboard(fake_wandb, run_dir, "my-project")
    assert "mode" not in fake_wandb[0][1]
