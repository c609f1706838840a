"""Tests of envs/: the classics, the registry, the Brax adapter and the plain-MJX adapter.

Brax/MJX compiles are slow on a small CPU, so each Brax or MJX env is compiled once in a
module-scoped fixture that runs reset + a short rollout in one jitted function.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import core

CLASSICS = ["pendulum", "cartpole", "point_mass"]
BRAX_NAMES = [
    "ant",
    "halfcheetah",
    "hopper",
    "humanoid",
    "humanoidstandup",
    "inverted_pendulum",
    "reacher",
    "walker2d",
]


def rollout(env: core.Env, keys: jax.Array, actions: jax.Array):
    """Reset ``len(keys)`` envs and step them with ``actions`` (T, N, act); returns (first, states)."""

    def body(state, action):
        state = jax.vmap(env.step)(state, action)
        return state, state

    first = jax.vmap(env.reset)(keys)
    return first, jax.lax.scan(body, first, actions)[1]


def paths(tree) -> set[str]:
    return {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


# --------------------------------------------------------------------------- registry


def test_registry_lists_required_names():
    for name in CLASSICS + BRAX_NAMES + ["mjcf", "mjx_cartpole", "mjx_swimmer"]:
        assert name in envs.names()


def test_every_registry_target_resolves_to_a_callable():
    import importlib

    for name, target in envs._REGISTRY.items():
        module_name, factory_name = target.split(":")
        assert callable(getattr(importlib.import_module(module_name), factory_name)), name


def test_unknown_env_lists_known_names():
    with pytest.raises(ValueError, match="unknown env 'nope'.*pendulum.*") as e:
        envs.make("nope")
    assert "ant" in str(e.value) and "mjx_cartpole" in str(e.value)


def test_bad_keyword_names_the_env():
    with pytest.raises(ValueError, match="env 'pendulum': bad arguments"):
        envs.make("pendulum", no_such_option=1)


def test_register_rejects_bad_target():
    with pytest.raises(ValueError, match="module:factory"):
        envs.register("x", "no_colon")


def test_ensure_registered_adds_an_unknown_name_and_keeps_known_ones(monkeypatch):
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))  # undone after the test
    envs.ensure_registered("rose_test_swing", "envs.classic:make_pendulum")
    assert envs.factory_path("rose_test_swing") == "envs.classic:make_pendulum"
    assert envs.make("rose_test_swing", episode_length=5).observation_size == 3
    # a known name (the package's, or one registered earlier) keeps its factory
    envs.ensure_registered("pendulum", "envs.classic:make_cartpole")
    envs.ensure_registered("rose_test_swing", "envs.classic:make_cartpole")
    assert envs.factory_path("pendulum") == "envs.classic:make_pendulum"
    assert envs.factory_path("rose_test_swing") == "envs.classic:make_pendulum"
    envs.ensure_registered("playground:CartpoleBalance", "envs.classic:make_cartpole")  # a prefix name
    assert envs.factory_path("playground:CartpoleBalance") == ""
    envs.ensure_registered("rose_test_none", None)  # the package's envs store no factory
    assert envs.factory_path("rose_test_none") == ""
    with pytest.raises(ValueError, match="module:factory") as e:
        envs.ensure_registered("rose_test_bad", "no_colon")
    assert "\n" not in str(e.value)
    # register() is what runs record: factory_path gives it back
    envs.register("rose_test_user", "rose_no_such_module:make_it")
    assert envs.factory_path("rose_test_user") == "rose_no_such_module:make_it"


def test_unimportable_factory_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(envs, "_REGISTRY", dict(envs._REGISTRY))
    envs.ensure_registered("rose_test_gone", "rose_no_such_module:make_it")
    with pytest.raises(ValueError, match="cannot import 'rose_no_such_module'.*PYTHONPATH") as e:
        envs.make("rose_test_gone")
    assert "\n" not in str(e.value)
    envs.ensure_registered("rose_test_nofn", "envs.classic:make_no_such_env")
    with pytest.raises(ValueError, match="no function 'make_no_such_env'"):
        envs.make("rose_test_nofn")


def test_no_warp_notice_from_rose_jax_envs_or_an_mjx_env(tmp_path):
    """MJX prints "Failed to import warp: ..." when it is first imported without Warp (which
    rose-jax does not use): `rose-jax envs` and envs.make of MJX / Brax envs must not show it, and
    other output printed during those imports must still come through."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("warp") is not None:
        pytest.skip("warp is installed: MJX prints no notice to hide")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (
        "import envs\n"
        "from envs.mjcf import quiet_warp_notice\n"
        "with quiet_warp_notice():\n"
        "    print('kept before')\n"
        "    from mujoco import mjx\n"
        "    print('kept after')\n"
        "print(envs.make('mjx_cartpole').name, envs.make('ant').name)\n"
    )
    cli = [os.path.join(os.path.dirname(sys.executable), "rose-jax"), "envs"]
    if not os.path.exists(cli[0]):
        cli = [sys.executable, "-c", "import sys; from rose_jax.cli import main; sys.exit(main())", "envs"]
    procs = [
        subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv in ([sys.executable, "-c", script], cli)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "Failed to import" not in out, out
    make_out, envs_out = outs
    assert "kept before\nkept after\n" in make_out and "mjx_cartpole ant" in make_out
    assert "mjx_cartpole" in envs_out.splitlines() and "pendulum" in envs_out.splitlines()
    # the notice is real: without the filter the same import prints it
    raw = subprocess.run([sys.executable, "-c", "from mujoco import mjx"], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert "Failed to import warp: No module named 'warp'" in raw.stdout


# --------------------------------------------------------------------------- classics


@pytest.mark.parametrize("name", CLASSICS)
def test_classic_shapes_dtypes_under_jit_vmap(name):
    env = envs.make(name)
    n = 3
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    state = jax.jit(jax.vmap(env.reset))(keys)
    state = jax.jit(jax.vmap(env.step))(state, jnp.zeros((n, env.action_size)))
    assert state.obs.shape == (n, env.observation_size) and state.obs.dtype == jnp.float32
    for leaf in (state.reward, state.done, state.truncated, state.episode_return):
        assert leaf.shape == (n,) and leaf.dtype == jnp.float32
    assert state.steps.dtype == jnp.int32 and np.all(state.steps == 1)
    assert np.all(np.isfinite(state.obs))


@pytest.mark.parametrize("name", CLASSICS)
def test_classic_is_deterministic_given_key(name):
    env = envs.make(name)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    actions = 0.7 * jnp.ones((6, 2, env.action_size))
    run = jax.jit(functools.partial(rollout, env))
    _, a = run(keys, actions)
    _, b = run(keys, actions)
    chex.assert_trees_all_equal(a, b)
    _, c = run(jax.random.split(jax.random.PRNGKey(2), 2), actions)
    assert not np.allclose(a.obs, c.obs)


@pytest.mark.parametrize("reset_mode", ["first", "sample"])
def test_classic_time_limit_and_auto_reset_bookkeeping(reset_mode):
    env = envs.make("pendulum", episode_length=4, reset_mode=reset_mode)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    first, traj = jax.jit(functools.partial(rollout, env))(keys, jnp.full((9, 2, 1), 0.5))
    np.testing.assert_array_equal(traj.steps[:, 0], [1, 2, 3, 0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(traj.done[:, 0], [0, 0, 0, 1, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(traj.truncated[:, 0], traj.done[:, 0])  # pendulum never terminates
    np.testing.assert_array_equal(traj.episodes[:, 0], [0, 0, 0, 1, 1, 1, 1, 2, 2])
    np.testing.assert_allclose(traj.last_episode_return[3], traj.reward[:4].sum(0), rtol=1e-5)
    np.testing.assert_allclose(traj.last_episode_return[7], traj.reward[4:8].sum(0), rtol=1e-5)
    np.testing.assert_array_equal(traj.episode_return[3], 0.0)
    np.testing.assert_allclose(traj.episode_return[5], traj.reward[4:6].sum(0), rtol=1e-5)
    assert np.all(traj.reward <= 0.0)  # pendulum reward is a cost
    if reset_mode == "first":  # after a reset the env is back in its first state
        np.testing.assert_array_equal(traj.obs[3], first.obs)
        np.testing.assert_array_equal(traj.pipeline_state[7], first.pipeline_state)
    else:  # a fresh initial state: not the first one, and different in the next episode
        assert not np.allclose(traj.obs[3], first.obs)
        assert not np.allclose(traj.obs[3], traj.obs[7])


def test_classic_termination_is_done_but_not_truncated():
    env = envs.make("cartpole", episode_length=500)
    _, traj = jax.jit(functools.partial(rollout, env))(
        jax.random.split(jax.random.PRNGKey(4), 1), jnp.ones((100, 1, 1))
    )
    ends = np.flatnonzero(traj.done[:, 0])
    assert len(ends) >= 1, "pushing the cart one way must drop the pole within 100 steps"
    t = ends[0]
    assert traj.truncated[t, 0] == 0 and traj.steps[t, 0] == 0 and traj.episodes[t, 0] == 1
    np.testing.assert_allclose(traj.last_episode_return[t, 0], t + 1)  # reward 1 per step
    assert np.all(np.abs(traj.obs[t, 0]) <= 0.05)  # reset to a near-upright start


@pytest.mark.parametrize("bad", [(2,), (), (1, 1)])
def test_bad_action_shape_is_a_clear_error(bad):
    env = envs.make("pendulum")
    state = env.reset(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"env 'pendulum': action has shape .* expected \(1,\)"):
        env.step(state, jnp.zeros(bad))


def test_bad_build_arguments():
    with pytest.raises(ValueError, match="episode_length must be > 0"):
        envs.make("pendulum", episode_length=0)
    with pytest.raises(ValueError, match="reset_mode must be"):
        envs.make("pendulum", reset_mode="never")
    with pytest.raises(ValueError, match="dim must be > 0"):
        envs.make("point_mass", dim=0)


# --------------------------------------------------------------------------- Brax adapter

EPISODE = 3  # short time limit so a 5-step rollout crosses one auto-reset
N_ENVS, T = 4, 5


def _actions(action_size: int) -> jax.Array:
    return 0.5 * jax.random.uniform(jax.random.PRNGKey(7), (T, N_ENVS, action_size), minval=-1.0, maxval=1.0)


def _brax_fixture(backend: str):
    env = envs.make("ant", backend=backend, episode_length=EPISODE)
    keys = jax.random.split(jax.random.PRNGKey(0), N_ENVS)
    first, traj = jax.jit(functools.partial(rollout, env))(keys, _actions(env.action_size))
    return env, keys, first, traj


@pytest.fixture(scope="module")
def ant_mjx():
    return _brax_fixture("mjx")


@pytest.fixture(scope="module")
def ant_generalized():
    return _brax_fixture("generalized")


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["ant_mjx", "ant_generalized"])
def test_brax_ant_steps_under_jit_vmap(fixture, request):
    env, _, first, traj = request.getfixturevalue(fixture)
    assert (env.observation_size, env.action_size) == (27, 8)  # Brax ant: 13 qpos (no x, y) + 14 qvel
    assert traj.obs.shape == (T, N_ENVS, 27) and traj.reward.shape == (T, N_ENVS)
    assert np.all(np.isfinite(traj.obs)) and np.all(np.isfinite(traj.reward))
    # physics data is the pipeline_state itself: pytree paths pipeline_state.q / .qd exist
    p = paths(traj)
    assert ".pipeline_state.q" in p and ".pipeline_state.qd" in p
    assert traj.pipeline_state.q.shape == (T, N_ENVS, 15)
    # the torso moves: consecutive observations differ
    assert not np.allclose(traj.obs[0], traj.obs[1])


@pytest.mark.slow
def test_brax_mjx_pipeline_state_is_mjx_data(ant_mjx):
    from mujoco import mjx

    _, _, first, _ = ant_mjx
    assert isinstance(first.pipeline_state, mjx.Data)
    assert ".pipeline_state.qpos" in paths(first) and ".pipeline_state.qvel" in paths(first)
    chex.assert_trees_all_equal(first.pipeline_state.qpos, first.pipeline_state.q)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["ant_mjx", "ant_generalized"])
def test_brax_auto_reset_fires_at_episode_length(fixture, request):
    _, _, first, traj = request.getfixturevalue(fixture)
    np.testing.assert_array_equal(traj.steps[:, 0], [1, 2, 0, 1, 2])
    np.testing.assert_array_equal(traj.done, np.array([0, 0, 1, 0, 0])[:, None] * np.ones(N_ENVS))
    np.testing.assert_array_equal(traj.truncated[EPISODE - 1], 1.0)
    np.testing.assert_array_equal(traj.episodes[-1], 1)
    np.testing.assert_array_equal(traj.obs[EPISODE - 1], first.obs)  # reset to the first state
    np.testing.assert_array_equal(traj.pipeline_state.q[EPISODE - 1], first.pipeline_state.q)
    np.testing.assert_allclose(traj.last_episode_return[EPISODE - 1], traj.reward[:EPISODE].sum(0), rtol=1e-5)


@pytest.mark.slow
def test_brax_mjx_matches_brax_training_wrappers(ant_mjx):
    """Same keys and actions -> the same obs/reward/done as Brax's own wrap() stack."""
    import brax.envs
    from brax.envs.wrappers import training

    env, keys, _, traj = ant_mjx
    benv = training.wrap(brax.envs.get_environment("ant", backend="mjx"), episode_length=EPISODE)

    @jax.jit
    def brax_rollout(keys, actions):
        def body(s, a):
            s = benv.step(s, a)
            return s, (s.obs, s.reward, s.done)

        # envs.core.build hands the env the first half of a split key
        s = benv.reset(jax.vmap(lambda k: jax.random.split(k)[0])(keys))
        return jax.lax.scan(body, s, actions)[1]

    obs, reward, done = brax_rollout(keys, _actions(env.action_size))
    np.testing.assert_allclose(traj.obs, obs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj.reward, reward, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(traj.done, done)


def test_brax_env_with_info_between_steps_gets_a_carry():
    """A Brax env that counts its steps in ``info``: the count must survive steps and resets."""
    import brax.envs

    from envs.brax_envs import BraxCarry, make_brax

    class Counter(brax.envs.Env):
        def __init__(self, backend="mjx"):
            self._backend = backend

        def reset(self, rng):
            zero = jnp.zeros(())
            return brax.envs.State(jnp.zeros(1), jnp.zeros(2), zero, zero, {}, {"count": zero})

        def step(self, state, action):
            count = state.info["count"] + 1.0
            obs = jnp.stack([count, action[0]])
            return state.replace(obs=obs, reward=count, info={"count": count})

        observation_size = property(lambda self: 2)
        action_size = property(lambda self: 1)
        backend = property(lambda self: self._backend)

    brax.envs.register_environment("rose_test_counter", Counter)
    env = make_brax("rose_test_counter", episode_length=3)
    _, traj = jax.jit(functools.partial(rollout, env))(jax.random.PRNGKey(0)[None], jnp.ones((5, 1, 1)))
    assert isinstance(traj.pipeline_state, BraxCarry)
    np.testing.assert_array_equal(traj.reward[:, 0], [1, 2, 3, 1, 2])
    np.testing.assert_array_equal(traj.pipeline_state.info["count"][:, 0], [1, 2, 0, 1, 2])
    # without the carry the env's step cannot find its info at all
    plain = make_brax("rose_test_counter", episode_length=3, carry_info=False)
    with pytest.raises(KeyError, match="count"):
        jax.eval_shape(plain.step, jax.eval_shape(plain.reset, jax.random.PRNGKey(0)), jnp.ones(1))


def test_brax_unknown_backend_names_valid_ones():
    with pytest.raises(
        ValueError, match="unknown backend 'warp'; valid backends: mjx, generalized, positional, spring"
    ):
        envs.make("ant", backend="warp")


def test_brax_unknown_env_lists_brax_names():
    from envs.brax_envs import make_brax

    with pytest.raises(ValueError, match="unknown Brax env 'antt'.*halfcheetah"):
        make_brax("antt")


def test_brax_sizes_without_compiling():
    # observation_size comes from an abstract trace of reset (no compile); hand-checked sizes
    hopper = envs.make("hopper", backend="generalized")
    assert (hopper.observation_size, hopper.action_size) == (11, 3)
    assert envs.make("inverted_pendulum", backend="generalized").action_size == 1


# --------------------------------------------------------------------------- plain MJX (MJCF)


@pytest.fixture(scope="module")
def cartpole_pushed():
    """mjx_cartpole from one initial state, pushed with a = +1, -1 and 0 for 25 steps (0.5 s)."""
    env = envs.make("mjx_cartpole", episode_length=1000)
    keys = jnp.stack([jax.random.PRNGKey(0)] * 3)
    actions = jnp.broadcast_to(jnp.array([[1.0], [-1.0], [0.0]]), (25, 3, 1))
    first, traj = jax.jit(functools.partial(rollout, env))(keys, actions)
    return env, first, traj


@pytest.mark.slow
def test_mjcf_cartpole_runs_and_reward_responds_to_actions(cartpole_pushed):
    from mujoco import mjx

    env, first, traj = cartpole_pushed
    assert (env.observation_size, env.action_size) == (4, 1)
    assert isinstance(first.pipeline_state, mjx.Data) and ".pipeline_state.qpos" in paths(traj)
    assert np.all(np.isfinite(traj.obs))
    x_end = traj.pipeline_state.qpos[-1, :, 0]
    assert x_end[0] > first.pipeline_state.qpos[0, 0] + 0.2  # pushed right -> moved right
    assert x_end[1] < first.pipeline_state.qpos[1, 0] - 0.2  # pushed left -> moved left
    ret = traj.reward.sum(0)
    assert ret[2] > ret[0] + 1.0 and ret[2] > ret[1] + 1.0  # pushing knocks the pole over
    assert np.all((traj.reward >= 0.0) & (traj.reward <= 1.0))
    assert traj.reward[0, 2] > 0.9  # balanced, centred and still: close to the maximum 1
    # time advances by n_substeps * timestep = 2 * 0.01 s per env step
    np.testing.assert_allclose(traj.pipeline_state.time[:, 2], 0.02 * np.arange(1, 26), rtol=1e-4)


def test_mjcf_substep_loop_is_visible_to_the_tracer():
    env = envs.make("mjx_swimmer")
    state = jax.eval_shape(env.reset, jax.random.PRNGKey(0))  # abstract: traces, runs nothing
    jaxpr = jax.make_jaxpr(env.step)(state, jnp.zeros(env.action_size))
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in loops] == [4]  # the 4 physics substeps, at top level
    assert (env.observation_size, env.action_size) == (8, 2)


SLIDER_XML = """
<mujoco model="slider">
  <option timestep="0.01"/>
  <worldbody>
    <body name="block">
      <joint name="x" type="slide" axis="1 0 0"/>
      <geom type="box" size="0.1 0.1 0.1" mass="1" contype="0" conaffinity="0"/>
    </body>
  </worldbody>
  <actuator><motor joint="x" gear="2" ctrlrange="-1 1"/></actuator>
</mujoco>
"""


def test_mjcf_custom_reward_and_termination():
    """A 1 kg block pushed by 2 N: x(t) = t^2 from rest; terminate once x > 0.1 m."""
    from envs.mjcf import make_mjcf

    env = make_mjcf(  # envs.make("mjcf", xml=...) works too, but make()'s own `name` takes name=
        SLIDER_XML,
        name="slider",
        reward=lambda model, before, after, action: after.qpos[0] - before.qpos[0],
        terminate=lambda model, data: data.qpos[0] > 0.1,
        n_substeps=10,
        reset_noise=0.0,
        episode_length=100,
    )
    assert (env.observation_size, env.action_size) == (2, 1)
    first, traj = jax.jit(functools.partial(rollout, env))(jax.random.PRNGKey(0)[None], jnp.ones((6, 1, 1)))
    x = np.asarray(traj.pipeline_state.qpos[:, 0, 0])
    # semi-implicit Euler from rest: x after k substeps = a dt^2 k (k + 1) / 2 with a = 2 m/s^2
    k = 10 * np.arange(1, 6)
    np.testing.assert_allclose(x[:3], 2 * 0.01**2 * k[:3] * (k[:3] + 1) / 2, rtol=1e-4)
    t_end = np.flatnonzero(traj.done[:, 0])[0]
    assert t_end == 3  # x(0.3 s) = 0.09 < 0.1 < x(0.4 s) = 0.164
    assert traj.truncated[t_end, 0] == 0 and traj.episodes[t_end, 0] == 1
    np.testing.assert_allclose(traj.last_episode_return[t_end, 0], 2 * 0.01**2 * 40 * 41 / 2, rtol=1e-4)
    np.testing.assert_array_equal(traj.obs[t_end, 0], [0.0, 0.0])  # back at rest at the origin


def test_mjcf_bad_inputs_are_clear_errors(tmp_path):
    from envs.mjcf import make_mjcf

    with pytest.raises(ValueError, match="env 'mjcf': cannot load MJCF"):
        make_mjcf("<mujoco><worldbody><body><joint type='bogus'/></body></worldbody></mujoco>")
    with pytest.raises(ValueError, match="no such file"):
        make_mjcf(tmp_path / "missing.xml")
    with pytest.raises(ValueError, match="no actuators"):
        make_mjcf(
            "<mujoco><worldbody><body><joint type='slide'/><geom size='.1'/></body></worldbody></mujoco>"
        )
    with pytest.raises(ValueError, match="unknown reward 'upright'"):
        make_mjcf(SLIDER_XML, reward="upright")
    with pytest.raises(ValueError, match=r"reward must return a scalar per env, got shape \(1,\)"):
        make_mjcf(SLIDER_XML, reward=lambda model, before, after, action: after.qpos)
    with pytest.raises(ValueError, match="terminate must return a scalar"):
        make_mjcf(SLIDER_XML, terminate=lambda model, data: data.qpos > 0)
    with pytest.raises(ValueError, match="n_substeps must be an int >= 1"):
        make_mjcf(SLIDER_XML, n_substeps=0)
    with pytest.raises(ValueError, match=r"init_qpos must have shape \(1,\)"):
        make_mjcf(SLIDER_XML, init_qpos=[0.0, 1.0])
    path = tmp_path / "slider.xml"
    path.write_text(SLIDER_XML)
    assert make_mjcf(path).observation_size == 2  # a path works as well as a string
    assert make_mjcf(str(path), skip_qpos=1).observation_size == 1
