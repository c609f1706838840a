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


# --------------------------------------------------------------------------- rendering


def test_play_in_a_fresh_process_prints_no_noise(run_dir, tmp_path):
    """`rose-jax play RUN --out v.mp4` prints the returns and the file written, nothing else:
    no os.fork() deadlock warning (imageio-ffmpeg's preexec_fn), no "Failed to import warp", no
    OSMesa context error at exit; and the video is not nearly black."""
    video = str(tmp_path / "quiet.mp4")
    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from rose_jax.cli import main; sys.exit(main())",
         "play", run_dir, "--out", video, "--max-steps", "5", "--width", "64", "--height", "48"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("episode 1/1: return") and lines[1].startswith("mean return"), lines
    assert lines[2] == f"wrote {video} (6 frames, 30 fps)" and len(lines) == 3, lines
    for noise in ("os.fork()", "Failed to import", "Exception ignored", "Traceback"):
        assert noise not in out.stderr and noise not in out.stdout, out.stderr[-3000:]
    from algos import play

    assert play.read_frames(video).mean() > 30


BARE_MJCF = """<mujoco><worldbody><body name="box" pos="0 0 0.5"><joint name="x" type="slide" axis="1 0 0"/>
  <geom type="box" size=".2 .2 .2" rgba=".8 .3 .3 1"/></body></worldbody>
  <actuator><motor joint="x" ctrlrange="-1 1"/></actuator></mujoco>"""


@pytest.mark.parametrize(
    "name, kwargs", [("mjx_cartpole", {}), ("mjx_swimmer", {}), ("mjcf", {"xml": BARE_MJCF}), ("ant", {})]
)
def test_rendered_frame_is_not_nearly_black(name, kwargs):
    """A bare MJCF (no light, no floor, no sky) used to render as a dim object on black (mean
    pixel 0.24/255 for mjx_cartpole); with_scenery adds what it lacks, Brax's ant has its own."""
    from algos import play

    model = play.mj_model_for(name, kwargs)
    renderer = play.Renderer(model, 96, 72)
    try:
        frame = renderer.frame(model.qpos0.copy())
    finally:
        renderer.close()
    assert frame.shape == (72, 96, 3)
    assert frame.mean() > 30 and frame.std() > 10, (frame.mean(), frame.std())


def test_with_scenery_adds_only_what_is_missing_and_keeps_the_kinematics():
    import mujoco

    from algos import play
    from envs import mjcf

    bare = mjcf.load_model(mjcf.ASSETS / "cartpole.xml")
    dressed = play.with_scenery(mjcf.load_spec(mjcf.ASSETS / "cartpole.xml"))
    assert (dressed.nq, dressed.nv, dressed.nbody, dressed.nu) == (bare.nq, bare.nv, bare.nbody, bare.nu)
    assert (bare.nlight, dressed.nlight) == (0, 1)
    assert dressed.ngeom == bare.ngeom + 1
    plane = mujoco.mjtGeom.mjGEOM_PLANE
    assert plane not in list(bare.geom_type) and list(dressed.geom_type).count(plane) == 1
    floor = list(dressed.geom_type).index(plane)
    assert dressed.geom_bodyid[floor] == 0  # on the world body: no body, joint or dof added
    assert dressed.geom_contype[floor] == 0 and dressed.geom_conaffinity[floor] == 0  # visual only
    assert dressed.geom_pos[floor][2] < 0  # below the cart (z = 1) and the hanging pole (z >= 0)
    assert mujoco.mjtTexture.mjTEXTURE_SKYBOX in list(dressed.tex_type)
    # a model with a sky, a floor and a light of its own is left as it is
    full = BARE_MJCF.replace(
        "<worldbody>",
        '<asset><texture name="sky" type="skybox" builtin="flat" rgb1="1 1 1" width="8" height="8"/></asset>'
        '<worldbody><light pos="0 0 3"/><geom type="plane" size="5 5 .1"/>',
    )
    model = play.with_scenery(mjcf.load_spec(full))
    assert (model.ngeom, model.nlight, model.ntex) == (2, 1, 1)


def test_can_render_tells_which_envs_have_a_model():
    import envs
    from algos import play

    for name in ("mjx_cartpole", "mjx_swimmer", "mjcf", "ant", "walker2d", "playground:CartpoleBalance"):
        assert play.can_render(name), name
        assert play.suggest_play("runs/x", name) == "rose-jax play runs/x --out video.mp4"
    for name in ("pendulum", "cartpole", "point_mass", "gymnax:CartPole-v1", "nope"):
        assert not play.can_render(name), name
        assert play.suggest_play("runs/x", name) == "rose-jax play runs/x --episodes 3"
    assert play.can_render(envs.make("pendulum")) is False  # an Env, by its name
    assert play.suggest_play("my runs/x", "ant") == "rose-jax play 'my runs/x' --out video.mp4"


def test_train_suggests_a_play_command_that_works(tmp_path, capsys):
    """After `rose-jax train` on an env without a MuJoCo model (pendulum) the suggested command
    has no --out (which would fail there) and runs as printed."""
    import shlex

    from rose_jax import cli

    path = str(tmp_path / "pendulum run")
    rc = cli.main(["train", "--env", "pendulum", "--algo", "ppo", "--steps", "1024", "--run-dir", path,
                   "--no-tensorboard", "--set", "num_envs=8", "--set", "unroll_length=8",
                   "--set", "num_minibatches=2", "--set", "batch_size=8"])
    assert rc == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "policy saved" in x)
    suggested = line.split("): ", 1)[1].split(";")[0]
    assert suggested == f"rose-jax play {shlex.quote(path)} --episodes 3", line
    argv = shlex.split(suggested)
    assert argv[0] == "rose-jax"
    assert cli.main(argv[1:]) == 0
    played = capsys.readouterr().out
    assert played.count("episode ") == 3 and "mean return" in played
    with pytest.raises(SystemExit, match="has no MuJoCo model to render"):  # what --out would have done
        cli.main(["play", path, "--out", str(tmp_path / "v.mp4")])


# --------------------------------------------------------------------------- envs.register


DRIFT_MODULE = '''
"""A user's env outside the package, added with envs.register (the README's recipe)."""
import jax
import jax.numpy as jnp

from envs.core import Dynamics, build


def make_drift(episode_length: int = 20, reset_mode: str = "sample"):
    def init(key):
        x = jax.random.uniform(key, (1,), minval=-1.0, maxval=1.0)
        return x, x

    def transition(x, action):
        x = x + 0.1 * jnp.clip(action, -1.0, 1.0)
        return x, x, -jnp.sum(jnp.square(x)), jnp.zeros((), jnp.bool_)

    return build("drift", Dynamics(1, 1, init, transition), episode_length, reset_mode)
'''


def _cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from rose_jax.cli import main; sys.exit(main())", *args]


def test_env_registered_from_a_user_module_plays_back_in_a_fresh_process(tmp_path, monkeypatch):
    """run.json / policy.json record the factory of an env added with envs.register, so a fresh
    process (with the user's module importable, as when it trained) can play and load it."""
    import envs

    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "rose_user_drift.py").write_text(DRIFT_MODULE)
    monkeypatch.syspath_prepend(str(user_dir))
    package_registry = dict(envs._REGISTRY)
    monkeypatch.setattr(envs, "_REGISTRY", dict(package_registry))
    envs.register("rose_drift", "rose_user_drift:make_drift")

    path = str(tmp_path / "drift")
    runs.train("ppo", "rose_drift", path, env_kwargs={"episode_length": 20}, num_timesteps=512, num_envs=8,
               batch_size=8, num_minibatches=2, unroll_length=8, num_updates_per_batch=1, num_evals=2,
               num_eval_envs=4, policy_hidden_sizes=(8,), value_hidden_sizes=(8,), eval_envs=4)
    meta = json.load(open(os.path.join(path, "policy.json")))
    assert meta["env"] == "rose_drift" and meta["env_factory"] == "rose_user_drift:make_drift"
    assert json.load(open(os.path.join(path, "run.json")))["env_factory"] == "rose_user_drift:make_drift"

    load = textwrap.dedent(
        f"""
        import json, jax
        from algos import policy
        act = policy.load_policy({path!r})
        env = act.make_env()
        key = jax.random.PRNGKey(act.meta["final_eval_seed"])
        ret = policy.evaluate(act, env, act.meta["final_eval_envs"], key)
        print(json.dumps({{"name": env.name, "obs": env.observation_size, "length": env.episode_length,
                          "eval": ret}}))
        """
    )
    with_module = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(user_dir),
                                                                           os.environ.get("PYTHONPATH")]))}
    runs_ = [
        (_cli_argv("play", path, "--episodes", "1"), with_module),
        ([sys.executable, "-c", load], with_module),
        (_cli_argv("play", path, "--episodes", "1"), dict(os.environ)),  # the module is not importable
    ]
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv, env in runs_
    ]
    (play_out, play_err), (load_out, load_err), (_, miss_err) = [p.communicate(timeout=600) for p in procs]
    assert procs[0].returncode == 0, play_err[-3000:]
    assert "episode 1/1: return" in play_out and "over 20 steps" in play_out, play_out
    assert procs[1].returncode == 0, load_err[-3000:]
    got = json.loads(load_out.strip().splitlines()[-1])
    assert (got["name"], got["obs"], got["length"]) == ("drift", 1, 20)
    np.testing.assert_allclose(got["eval"], meta["final_eval_return"], rtol=1e-6)
    assert procs[2].returncode != 0
    assert miss_err.strip().splitlines() == [
        "rose-jax play: env 'rose_drift': cannot import 'rose_user_drift' for its factory "
        "'rose_user_drift:make_drift' (put the module's directory on PYTHONPATH, as when the env was "
        "registered)"
    ], miss_err[-3000:]

    # in this process too: a registry without the name (as in a new session) gets it from policy.json
    monkeypatch.setattr(envs, "_REGISTRY", dict(package_registry))
    assert policy.load_policy(path).make_env().name == "drift"
    assert envs.factory_path("rose_drift") == "rose_user_drift:make_drift"
