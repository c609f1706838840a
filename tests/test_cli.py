"""The rose-jax command line, run for real in-process on tiny settings."""

import json

import pytest

from rose_jax import cli


def test_train_writes_metrics_and_curve(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = cli.main(
        [
            "train",
            "--env",
            "cartpole",
            "--algo",
            "ppo",
            "--steps",
            "8192",
            "--run-dir",
            str(run_dir),
            "--set",
            "num_envs=16",
            "--set",
            "unroll_length=32",
            "--set",
            "num_minibatches=4",
        ]
    )
    assert rc == 0
    history = json.loads((run_dir / "metrics.json").read_text())
    assert history and history[-1]["env_steps"] >= 8192
    assert all("episode_return" in row for row in history)
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert "done:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--env", "nope"], "unknown env 'nope'"),
        (["train", "--env", "cartpole", "--steps", "-5"], "--steps must be > 0"),
        (["train", "--env", "cartpole", "--set", "num_minibatches=7", "--steps", "1000"], "num_minibatches"),
        (["train", "--env", "cartpole", "--set", "bogus=1", "--steps", "1000"], "bogus"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--run-dir", str(tmp_path / "r")])
    text = str(e.value)
    assert message in text and "\n" not in text


def test_inspect_prints_the_loop_tree(tmp_path, capsys):
    out = tmp_path / "tree.json"
    rc = cli.main(
        [
            "inspect",
            "--env",
            "pendulum",
            "--algo",
            "ppo",
            "--set",
            "num_envs=8",
            "--set",
            "unroll_length=4",
            "--set",
            "num_minibatches=2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("rollout", "policy", "sim", "advantage", "update", "loss", "optimizer"):
        assert name in text
    assert "x4" in text  # the rollout scan's trip count = unroll_length
    assert json.loads(out.read_text())["root"]["kind"] == "root"


def test_profile_says_no_gpu_on_cpu():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU message")
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", "--env", "pendulum", "--algo", "ppo"])
    assert "GPU" in str(e.value) or "NVML" in str(e.value)


def test_envs_lists_registry(capsys):
    assert cli.main(["envs"]) == 0
    names = capsys.readouterr().out.split()
    assert {"cartpole", "pendulum", "point_mass", "ant"} <= set(names)


@pytest.mark.slow
def test_train_optimize_searches_once_then_uses_the_cached_plan(tmp_path, capsys, monkeypatch):
    """`train --optimize` runs the real plan search (baseline vs candidates, equality checked), caches
    the plan, and a second run applies the cached plan without measuring; both train the same."""
    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path / "plans"))
    argv = ["train", "--env", "pendulum", "--algo", "ppo", "--optimize", "--steps", "2048",
            "--set", "num_envs=16", "--set", "unroll_length=8", "--set", "num_minibatches=2"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "a")]) == 0
    first = capsys.readouterr().out
    assert "CACHE HIT" not in first and "candidate" in first
    assert (tmp_path / "plans" / "plans.json").exists()
    assert cli.main([*argv, "--run-dir", str(tmp_path / "b")]) == 0
    second = capsys.readouterr().out
    assert "CACHE HIT" in second
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert [r["env_steps"] for r in a] == [r["env_steps"] for r in b]
    assert a[-1]["policy_loss"] == b[-1]["policy_loss"]
