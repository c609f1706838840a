"""After training: the run directory (config, metrics, TensorBoard events, policy), load_policy in
a fresh process, and play's mp4 of an MJX env rendered headless on the CPU (OSMesa)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from algos import policy, runs, tb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPISODE = 30


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny PPO run on MJX cart-pole with evaluations (Brax's layout), recorded by runs.train."""
    path = str(tmp_path_factory.mktemp("run") / "cartpole")
    runs.train(
        "ppo",
        "mjx_cartpole",
        path,
        env_kwargs={"episode_length": EPISODE},
        num_timesteps=1024,
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
    return path


def test_run_dir_holds_config_policy_and_tensorboard_events(run_dir):
    names = set(os.listdir(run_dir))
    assert {"run.json", "metrics.jsonl", "summary.json", "policy.json", "policy", "tb"} <= names
    run = json.load(open(os.path.join(run_dir, "run.json")))
    assert run["algo"] == "ppo" and run["env"] == "mjx_cartpole" and run["config"]["batch_size"] == 8
    meta = json.load(open(os.path.join(run_dir, "policy.json")))
    assert meta["env_steps"] == 1024 and np.isfinite(meta["final_eval_return"])
    scalars = tb.read_scalars(os.path.join(run_dir, runs.TB_DIR))
    for tag in ("eval/episode_reward", "training/total_loss", "training/v_loss", "training/sps"):
        assert tag in scalars, sorted(scalars)
    steps = [s for s, _ in scalars["eval/episode_reward"]]
    assert steps == [0, 1024]  # Brax's schedule: an evaluation at step 0, then after the one epoch


def test_load_policy_in_fresh_process_and_play_mp4(run_dir, tmp_path):
    video = str(tmp_path / "cartpole.mp4")
    script = textwrap.dedent(
        f"""
        import json, jax
        import algos.play as play
        from algos import policy
        act = policy.load_policy({run_dir!r})
        meta = act.meta
        ret = policy.evaluate(act, act.make_env(), meta["final_eval_envs"],
                              jax.random.PRNGKey(meta["final_eval_seed"]))
        result = play.play({run_dir!r}, episodes=2, out={video!r}, width=64, height=48, max_steps=10)
        print(json.dumps({{"eval": ret, "frames": result.frames, "returns": result.returns}}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    meta = json.load(open(os.path.join(run_dir, "policy.json")))
    np.testing.assert_allclose(got["eval"], meta["final_eval_return"], rtol=1e-6)
    assert "mean return" in out.stdout
    # 2 episodes of at most 10 steps: a frame for each reset and each step
    assert got["frames"] == 2 * 11
    from algos import play

    frames = play.read_frames(video)
    assert frames.shape == (22, 48, 64, 3)
    assert frames.max() > 0  # something was drawn


def test_policy_acts_and_rejects_bad_observations(run_dir):
    import jax

    act = policy.load_policy(run_dir)
    obs = np.zeros((3, act.observation_size), np.float32)
    a = np.asarray(act(obs))
    assert a.shape == (3, act.action_size) and np.all(np.abs(a) <= 1)
    b = np.asarray(act(obs, jax.random.PRNGKey(0)))
    assert b.shape == a.shape and not np.allclose(a, b)
    with pytest.raises(ValueError, match="expected") as e:
        act(np.zeros((3, act.observation_size + 1)))
    assert "\n" not in str(e.value)


def test_load_policy_of_a_directory_without_one_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="holds no trained policy") as e:
        policy.load_policy(str(tmp_path))
    assert "\n" not in str(e.value)


def test_tensorboard_tags_are_brax_names():
    tags = tb.tags(
        {
            "eval_episode_return": 1.0,
            "episode_return": 2.0,
            "env_steps": 5,
            "value_loss": 3.0,
            "training/sps": 9.0,
            "bad": float("nan"),
        }
    )
    assert tags == {
        "eval/episode_reward": 1.0,
        "training/episode_reward": 2.0,
        "training/value_loss": 3.0,
        "training/sps": 9.0,
    }
