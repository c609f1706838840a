"""PPO in Brax's layout (algos.ppo_brax), and SAC, against brax 0.14.2's own code on the same data.

GAE and the loss are compared with ``brax.training.agents.ppo.losses`` on random data and fixed
parameters; the update pass with Brax's ``sgd_step`` logic (permutation, minibatch keys) driving
Brax's loss; the schedule (env steps at every progress report) with Brax's ``ppo.train`` on a
tiny Brax env. SAC: its three losses and their gradients against ``brax.training.agents.sac.losses``,
its schedule against Brax's ``sac.train``.
"""

from __future__ import annotations

import dataclasses
import functools

import chex

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import envs
from algos import normalize, ppo, ppo_brax

brax_losses = pytest.importorskip("brax.training.agents.ppo.losses")
from brax.training import types as brax_types  # noqa: E402
from brax.training.acme import running_statistics  # noqa: E402
from brax.training.agents.ppo import networks as brax_ppo_networks  # noqa: E402
from brax.training.agents.sac import networks as brax_sac_networks  # noqa: E402

OBS, ACT, T, B = 5, 3, 6, 8


def _random_episode_flags(key, shape):
    k1, k2 = jax.random.split(key)
    done = (jax.random.uniform(k1, shape) < 0.2).astype(jnp.float32)
    truncated = done * (jax.random.uniform(k2, shape) < 0.5).astype(jnp.float32)
    return done, truncated


def test_gae_equals_brax_compute_gae():
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    done, truncated = _random_episode_flags(keys[0], (T, B))
    termination = done * (1 - truncated)
    rewards = jax.random.normal(keys[1], (T, B))
    values = jax.random.normal(keys[2], (T, B))
    bootstrap = jax.random.normal(keys[3], (B,))
    want = brax_losses.compute_gae(truncated, termination, rewards, values, bootstrap, 0.9, 0.97)
    got = ppo_brax.compute_gae(truncated, termination, rewards, values, bootstrap, 0.9, 0.97)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    # Brax's advantage is not vs - v when lambda < 1: the test data must show the difference
    assert not np.allclose(got[1], got[0] - values, atol=1e-3)


def _config(**kw):
    base = dict(
        num_envs=4,
        unroll_length=T,
        batch_size=4,
        num_minibatches=2,
        num_updates_per_batch=2,
        policy_hidden_sizes=(16, 16),
        value_hidden_sizes=(16,),
        activation="swish",
        reward_scaling=3.0,
        discounting=0.97,
        gae_lambda=0.9,
        clipping_epsilon=0.3,
        entropy_cost=0.01,
        value_cost=0.5,
        max_grad_norm=None,
    )
    return ppo.PPOConfig(**{**base, **kw})


def _brax_setup(config):
    """Brax's PPO networks with the same sizes, their params, and ours converted from them."""
    nets = brax_ppo_networks.make_ppo_networks(
        OBS,
        ACT,
        preprocess_observations_fn=running_statistics.normalize,
        policy_hidden_layer_sizes=config.policy_hidden_sizes,
        value_hidden_layer_sizes=config.value_hidden_sizes,
        activation=jax.nn.swish,
    )
    kp, kv = jax.random.split(jax.random.PRNGKey(7))
    brax_params = brax_losses.PPONetworkParams(
        policy=nets.policy_network.init(kp), value=nets.value_network.init(kv)
    )

    ours = _ours(brax_params)
    return nets, brax_params, ours


def _random_segments(key, n_seg, normalizer):
    """Raw data for ``n_seg`` segments in Brax's Transition layout and ours."""
    ks = jax.random.split(key, 6)
    obs = jax.random.normal(ks[0], (n_seg, T + 1, OBS)) * 2 + 1
    raw = jax.random.normal(ks[1], (n_seg, T, ACT))
    logp = jax.random.normal(ks[2], (n_seg, T)) - 2
    reward = jax.random.normal(ks[3], (n_seg, T))
    done, truncated = _random_episode_flags(ks[4], (n_seg, T))
    brax_data = brax_types.Transition(
        observation=obs[:, :-1],
        action=jnp.tanh(raw),
        reward=reward,
        discount=1 - done,
        next_observation=obs[:, 1:],
        extras={
            "policy_extras": {
                "raw_action": raw,
                "log_prob": logp,
                "distribution_params": jax.random.normal(ks[5], (n_seg, T, 2 * ACT)),
            },
            "state_extras": {"truncation": truncated},
        },
    )
    seg = ppo_brax.Segments(
        obs=normalize.apply(normalizer, obs[:, :-1]),
        raw_action=raw,
        log_prob=logp,
        reward=reward,
        done=done,
        truncated=truncated,
        next_obs=normalize.apply(normalizer, obs[:, -1]),
    )
    return brax_data, seg


def _normalizers():
    norm = normalize.update(normalize.init(OBS), jax.random.normal(jax.random.PRNGKey(1), (64, OBS)) * 2 + 1)
    return norm, running_statistics.NestedMeanStd(mean=norm.mean, std=norm.std)


def _brax_loss_fn(config, nets):
    return functools.partial(
        brax_losses.compute_ppo_loss,
        ppo_network=nets,
        entropy_cost=config.entropy_cost,
        discounting=config.discounting,
        reward_scaling=config.reward_scaling,
        gae_lambda=config.gae_lambda,
        clipping_epsilon=config.clipping_epsilon,
        normalize_advantage=config.normalize_advantage,
        vf_coefficient=config.value_cost,
    )


@pytest.mark.slow
@pytest.mark.parametrize("normalize_advantage", [True, False])
def test_loss_and_gradients_equal_brax_compute_ppo_loss(normalize_advantage):
    config = _config(normalize_advantage=normalize_advantage)
    nets, brax_params, ours = _brax_setup(config)
    norm, brax_norm = _normalizers()
    brax_data, seg = _random_segments(jax.random.PRNGKey(11), B, norm)
    key = jax.random.PRNGKey(5)

    brax_fn = _brax_loss_fn(config, nets)
    (want, want_m), want_g = jax.value_and_grad(brax_fn, has_aux=True)(brax_params, brax_norm, brax_data, key)
    our_nets = ppo.make_networks(config, envs.core.Env("x", OBS, ACT, 10, None, None))
    loss = functools.partial(ppo_brax.segment_loss, our_nets, config)
    (got, got_m), got_g = jax.value_and_grad(loss, has_aux=True)(ours, seg, key)

    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_m.policy_loss, want_m["policy_loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_m.value_loss, want_m["v_loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_m.entropy_loss, want_m["entropy_loss"], rtol=1e-6, atol=1e-6)
    want_ours = _ours(want_g)
    for w, g in zip(jax.tree.leaves(want_ours), jax.tree.leaves(got_g), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _ours(brax_tree):
    """Brax's PPONetworkParams (params or grads) as our PPOParams (last layer named ``out``)."""

    def convert(p):
        layers = p["params"]
        names = sorted(layers, key=lambda n: int(n.split("_")[1]))
        out = {f"hidden_{i}": layers[n] for i, n in enumerate(names[:-1])}
        out["out"] = layers[names[-1]]
        return {"params": out}

    return ppo.PPOParams(policy=convert(brax_tree.policy), value=convert(brax_tree.value))


def test_update_equals_brax_sgd_steps():
    """num_updates_per_batch passes of Brax's sgd_step (its code, with its loss) give our params."""
    config = _config()
    nets, brax_params, ours = _brax_setup(config)
    norm, brax_norm = _normalizers()
    n_seg = config.batch_size * config.num_minibatches
    brax_data, seg = _random_segments(jax.random.PRNGKey(12), n_seg, norm)
    key = jax.random.PRNGKey(9)
    optimizer = optax.adam(config.learning_rate)
    loss_and_grad = jax.value_and_grad(_brax_loss_fn(config, nets), has_aux=True)

    # Brax 0.14.2 train.py's sgd_step / minibatch_step, single device, no pixels, no adaptive KL
    def minibatch_step(carry, data):
        opt_state, params, key = carry
        key, key_loss = jax.random.split(key)
        (_, _), grads = loss_and_grad(params, brax_norm, data, key_loss)
        updates, opt_state = optimizer.update(grads, opt_state)
        return (opt_state, optax.apply_updates(params, updates), key), None

    def sgd_step(carry, _):
        opt_state, params, key = carry
        key, key_perm, key_grad = jax.random.split(key, 3)

        def convert_data(x):
            x = jax.random.permutation(key_perm, x)
            return jnp.reshape(x, (config.num_minibatches, -1) + x.shape[1:])

        shuffled = jax.tree.map(convert_data, brax_data)
        (opt_state, params, _), _ = jax.lax.scan(minibatch_step, (opt_state, params, key_grad), shuffled)
        return (opt_state, params, key), None

    (_, want_params, _), _ = jax.lax.scan(
        sgd_step, (optimizer.init(brax_params), brax_params, key), None, length=config.num_epochs
    )
    our_nets = ppo.make_networks(config, envs.core.Env("x", OBS, ACT, 10, None, None))
    got_params, _, _, _ = ppo_brax.update(
        our_nets, config, ours, ppo.make_optimizer(config).init(ours), seg, key
    )
    want_ours = _ours(want_params)
    moved = False
    for w, g, start in zip(
        jax.tree.leaves(want_ours), jax.tree.leaves(got_params), jax.tree.leaves(ours), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        moved |= not np.allclose(g, start)
    assert moved


def test_segments_layout_is_brax_swap_and_reshape():
    """Rollout data (U, T, N) becomes segments s = u * N + n of T consecutive steps of env n."""
    config = _config(num_envs=4, batch_size=6, num_minibatches=2, normalize_observations=False)
    U, N = ppo_brax.unrolls_per_iteration(config), config.num_envs
    assert U == 3
    u, t, n = np.meshgrid(np.arange(U), np.arange(T), np.arange(N), indexing="ij")
    code = (u * 1000 + t * 10 + n).astype(np.float32)
    data = ppo.Transition(*(jnp.asarray(code) for _ in range(6)))
    data = data._replace(obs=jnp.asarray(code)[..., None], raw_action=jnp.asarray(code)[..., None])
    next_obs = jnp.asarray((np.arange(U)[:, None] * 1000 + np.arange(N)[None]).astype(np.float32))[..., None]
    seg = ppo_brax.to_segments(config, normalize.init(1), data, next_obs)
    assert (
        seg.reward.shape == (U * N, T) and seg.obs.shape == (U * N, T, 1) and seg.next_obs.shape == (U * N, 1)
    )
    for s in range(U * N):
        uu, nn = divmod(s, N)
        np.testing.assert_array_equal(seg.reward[s], uu * 1000 + np.arange(T) * 10 + nn)
        assert seg.next_obs[s, 0] == uu * 1000 + nn


def test_iteration_shapes_and_env_steps():
    config = _config(num_envs=4, batch_size=6, num_minibatches=2, unroll_length=5)
    env = envs.make("pendulum")
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    step = jax.jit(ppo.iteration(config, env))
    state, metrics = step(state)
    assert config.steps_per_iteration == 6 * 2 * 5 and int(state.env_steps) == 60
    assert int(metrics.iteration) == 1 and np.isfinite(float(metrics.total_loss))
    # rose-jax's layout is untouched when batch_size is not given
    assert not ppo.PPOConfig().brax_layout


def test_brax_keyword_errors_are_one_line():
    with pytest.raises(ValueError, match="divisible by num_envs") as e:
        ppo.PPOConfig(num_envs=8, batch_size=3, num_minibatches=2)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="action_repeat"):
        ppo.PPOConfig(action_repeat=0)
    assert ppo.PPOConfig(num_updates_per_batch=7).num_epochs == 7
    with pytest.raises(ValueError, match="disagree"):  # e.g. --preset brax with --set num_epochs=8
        dataclasses.replace(ppo.PPOConfig(num_updates_per_batch=2), num_epochs=8)


def test_action_repeat_sums_rewards_and_counts_physics_steps():
    env = envs.make("pendulum", episode_length=10)
    rep = ppo_brax.with_action_repeat(env, 3)
    assert rep.episode_length == 4
    s0 = env.reset(jax.random.PRNGKey(0))
    a = jnp.array([0.3])
    s, total = s0, 0.0
    for _ in range(3):
        s = env.step(s, a)
        total += float(s.reward)
    r = rep.step(s0, a)
    np.testing.assert_allclose(float(r.reward), total, rtol=1e-6)
    np.testing.assert_allclose(r.obs, s.obs)
    config = _config(num_envs=4, batch_size=4, num_minibatches=2, action_repeat=3)
    assert config.env_steps_per_iteration == 3 * config.steps_per_iteration


# ------------------------------------------------------------------------------------------
# Schedule: Brax's ppo.train and ours report progress at the same env steps


def _tiny_brax_env():
    """A Brax env whose state is a 2-vector (cheap to compile)."""
    from brax.envs.base import Env as BraxEnv
    from brax.envs.base import State

    class Tiny(BraxEnv):
        def reset(self, rng):
            obs = jax.random.uniform(rng, (2,), minval=-1, maxval=1)
            zero = jnp.zeros(())
            return State(pipeline_state=obs, obs=obs, reward=zero, done=zero, metrics={}, info={})

        def step(self, state, action):
            obs = state.obs + 0.1 * jnp.concatenate([action, -action])
            reward = -jnp.sum(jnp.square(obs))
            return state.replace(pipeline_state=obs, obs=obs, reward=reward, done=jnp.zeros(()))

        @property
        def observation_size(self):
            return 2

        @property
        def action_size(self):
            return 1

        @property
        def backend(self):
            return "none"

    return Tiny()


# Brax's ppo.train keywords of a tiny run with evaluations (Brax's schedule on both sides)
TINY_BRAX_KW = dict(
    num_timesteps=1000,
    num_evals=3,
    episode_length=20,
    num_envs=4,
    batch_size=2,
    num_minibatches=4,
    unroll_length=5,
    num_updates_per_batch=1,
    num_eval_envs=2,
)


def _brax_device_put_replicated(monkeypatch):
    if not hasattr(jax, "device_put_replicated"):  # removed from JAX; Brax 0.14.2 still calls it

        def device_put_replicated(x, devices):  # its old meaning: a leading axis, one copy per device
            return jax.tree.map(
                lambda a: jnp.broadcast_to(jnp.asarray(a)[None], (len(devices),) + jnp.shape(a)), x
            )

        monkeypatch.setattr(jax, "device_put_replicated", device_put_replicated, raising=False)


@pytest.mark.slow
def test_schedule_equals_brax_ppo_train(monkeypatch):
    _brax_device_put_replicated(monkeypatch)
    from brax.training.agents.ppo import train as brax_ppo

    kw = dict(TINY_BRAX_KW)
    brax_steps = []
    brax_ppo.train(
        _tiny_brax_env(),
        **kw,
        network_factory=functools.partial(
            brax_ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=(4,), value_hidden_layer_sizes=(4,)
        ),
        progress_fn=lambda step, m: brax_steps.append(step),
    )
    # the same call through the one-line drop-in (Brax's defaults, Brax's return value)
    from algos.brax_compat import ppo as compat_ppo

    ours = []
    make_inference_fn, params, metrics = compat_ppo.train(
        environment=_tiny_brax_env(),
        **kw,
        network_factory=functools.partial(
            brax_ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=(4,), value_hidden_layer_sizes=(4,)
        ),
        progress_fn=lambda step, m: ours.append((step, m)),
    )
    assert [s for s, _ in ours] == brax_steps == [0, 520, 1040]
    assert all(np.isfinite(m["eval/episode_reward"]) for _, m in ours)
    assert metrics is ours[-1][1]
    action, extras = make_inference_fn(params)(jnp.zeros((3, 2)), jax.random.PRNGKey(0))
    assert action.shape == (3, 1) and extras["log_prob"].shape == (3,)
    deterministic, _ = make_inference_fn(params, deterministic=True)(jnp.zeros((3, 2)), None)
    assert np.all(np.abs(deterministic) <= 1)


def test_brax_compat_rejects_unimplemented_keywords_in_one_line():
    from algos.brax_compat import ppo as compat_ppo

    with pytest.raises(TypeError, match="use_distributional_critic") as e:
        compat_ppo.train(environment="pendulum", num_timesteps=10, use_distributional_critic=True)
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "sac"])
def test_drop_in_tries_option_sets_by_default_and_trains_the_same(algo, monkeypatch, tmp_path, capsys):
    """The drop-in is fast by default like `rose-jax train`: the unit is tried under the option sets
    (here a CPU-valid stand-in set through $ROSE_JAX_XLA_OPTION_SETS; 7 epochs: enough units for one
    round of each build, a shorter run gets XLA's defaults and no trial), one line says what was kept,
    and the run equals xla_options="default" (no trial); a bad xla_options is one line."""
    from algos import brax_compat

    monkeypatch.setenv("ROSE_JAX_PLAN_CACHE", str(tmp_path))
    monkeypatch.setenv("ROSE_JAX_XLA_OPTION_SETS", '{"same_program": {}}')
    trainer = getattr(brax_compat, algo).train
    if algo == "ppo":
        kw = dict(TINY_BRAX_KW, num_evals=8, network_factory=functools.partial(
            brax_ppo_networks.make_ppo_networks, policy_hidden_layer_sizes=(4,),
            value_hidden_layer_sizes=(4,)))
    else:
        kw = dict(num_timesteps=256, num_envs=4, batch_size=8, num_evals=8, num_eval_envs=2,
                  episode_length=20,
                  min_replay_size=16, max_replay_size=256, grad_updates_per_step=2)
        kw["network_factory"] = functools.partial(brax_sac_networks.make_sac_networks,
                                                  hidden_layer_sizes=(4,))
    _, tried, _ = trainer(environment="pendulum", **kw)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "XLA options" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"{algo}.train: XLA options:"), lines
    _, plain, _ = trainer(environment="pendulum", xla_options="default", **kw)
    assert "XLA options" not in capsys.readouterr().out
    chex.assert_trees_all_equal(tried, plain)
    with pytest.raises(ValueError, match="--xla-options must be") as e:
        trainer(environment="pendulum", xla_options="fastest", **kw)
    assert "\n" not in str(e.value)


def _evals_config(**kw):
    from algos import ppo

    base = dict(TINY_BRAX_KW, policy_hidden_sizes=(4,), value_hidden_sizes=(4,))
    base.update(kw)
    return ppo.PPOConfig(**base)


@pytest.mark.slow
def test_train_with_evals_runs_make_step_of_the_eval_epoch_and_trains_the_same():
    """With num_evals set, make_step replaces the jitted epoch (iterations + evaluation): built once,
    from the starting state, and a step computing the same epoch trains and evaluates the same."""
    import algos
    from algos import ppo

    config = _evals_config()
    built = []

    def make_step(state):
        built.append(int(state.iteration))
        return jax.jit(algos.get("ppo").unit_program(config, "pendulum"))

    s1, m1 = ppo.train_with_config(config, "pendulum", make_step=make_step)
    s2, m2 = ppo.train_with_config(config, "pendulum")
    assert built == [0]
    assert [m["env_steps"] for m in m1] == [m["env_steps"] for m in m2] and len(m1) == 2
    assert [m["eval/episode_reward"] for m in m1] == [m["eval/episode_reward"] for m in m2]
    chex.assert_trees_all_equal(s1.params, s2.params)


def test_unit_program_with_evals_is_the_epoch_with_an_evaluate_component():
    import algos
    import rose_jax.trace as rtrace
    from algos import ppo

    config = _evals_config()
    unit = algos.get("ppo").unit_program(config, "pendulum")
    state = ppo.init(config, ppo.ppo_brax.resolve_env(config, "pendulum"), jax.random.PRNGKey(0))
    tree = rtrace.trace(unit, state, arg_names=["state"])
    assert "evaluate" in {n.name for n in tree.walk()}
    after, metrics = jax.jit(unit)(state)
    assert int(after.iteration) == config.iterations_per_eval and "eval/episode_reward" in metrics
    # without num_evals the unit stays the iteration program
    no_evals = _evals_config(num_evals=None, batch_size=None)
    plain = algos.get("ppo").unit_program(no_evals, "pendulum")
    assert type(plain).__name__ == "Program"
    with pytest.raises(ValueError, match="num_evals is None"):
        ppo.ppo_brax.eval_epoch(_evals_config(num_evals=None), envs.make("pendulum"), None)


def test_unit_program_with_evals_and_action_repeat_is_the_epoch_train_runs():
    """The env is resolved once (resolve_env wraps action_repeat each time it runs): the unit the
    optimizer searches is the epoch train_with_evals compiles, evaluation included."""
    import algos

    config = _evals_config(action_repeat=2)
    env = ppo.ppo_brax.resolve_env(config, "pendulum")
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    unit = algos.get("ppo").unit_program(config, "pendulum")
    reference = ppo.ppo_brax.epoch(config, env, ppo.iteration(config, env), config.iterations_per_eval)
    chex.assert_trees_all_equal(jax.jit(unit)(state), jax.jit(reference)(state))


@pytest.mark.slow
def test_unit_program_without_evals_runs_on_the_env_train_resolves():
    """Without num_evals the unit is the iteration program, built on the env train runs on: a
    registry name built and action_repeat wrapped once (it used to be searched on the unwrapped
    env, so a plan for action_repeat=2 stepped the physics half as often as train)."""
    import algos

    config = _evals_config(num_evals=None, batch_size=None, action_repeat=2)
    env = ppo.resolve_env(config, "pendulum")
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    reference = jax.jit(ppo.iteration(config, env))(state)  # compiled once, compared three times
    for given in ("pendulum", envs.make("pendulum", episode_length=config.episode_length)):
        unit = algos.get("ppo").unit_program(config, given)
        chex.assert_trees_all_equal(jax.jit(unit.iteration())(state), reference)
    # the unwrapped env's iteration is a different function: the comparison above can fail
    plain = ppo.iteration(config, envs.make("pendulum", episode_length=config.episode_length))
    a, b = jax.jit(plain)(state)[0], reference[0]
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    assert not all(bool(jnp.array_equal(x, y)) for x, y in pairs)


def test_program_spec_rebuilds_the_action_repeat_env_train_runs_on():
    """A worker process rebuilds the program from its spec (by env name): with action_repeat > 1
    it must step the same wrapped env as the driver's program, not the bare registry env."""
    from rose_jax.optimize.process_worker import build_program

    config = _evals_config(num_evals=None, batch_size=None, action_repeat=2)
    env = ppo.resolve_env(config, "pendulum")
    state = ppo.init(config, env, jax.random.PRNGKey(0))
    kwargs = (("episode_length", config.episode_length),)
    parent = ppo.program(config, env, env_name="pendulum", env_kwargs=kwargs)
    rebuilt = build_program(parent.spec)
    chex.assert_trees_all_equal(jax.jit(rebuilt.iteration())(state), jax.jit(parent.iteration())(state))
    assert parent.spec.env[0] == "algos.ppo:make_env"
    # without action_repeat the spec stays the plain registry build
    plain = _evals_config(num_evals=None, batch_size=None)
    plain_program = ppo.program(plain, ppo.resolve_env(plain, "pendulum"), env_name="pendulum")
    assert plain_program.spec.env[0] == "envs:make"


def test_step0_report_is_the_initial_policys_evaluation():
    """train_with_evals' step-0 report is the evaluator's return on the initial state (computed
    here the plain way), before any training; then one report per epoch at Brax's env steps."""
    from algos import ppo, ppo_brax, ppo_core

    config = _evals_config()
    env = ppo_brax.resolve_env(config, "pendulum")
    reports = []
    ppo_brax.train_with_evals(
        config, env, ppo.iteration(config, env), progress_fn=lambda s, m: reports.append((s, m))
    )
    state = ppo_core.init(config, env, jax.random.PRNGKey(config.seed))
    evaluate = ppo_brax.make_evaluator(
        ppo_core.program_key(config), env, config.num_eval_envs, config.deterministic_eval
    )
    expected = evaluate(state.params, state.normalizer, ppo_core.eval_key(state))
    assert [s for s, _ in reports] == [0, 520, 1040]
    assert reports[0][1]["eval/episode_reward"] == float(expected["eval/episode_reward"])
    assert reports[0][1]["time/compile_s"] > 0


# ------------------------------------------------------------------------------------------- SAC


def _sac_params_ours(brax_policy, brax_q):
    """Brax's SAC policy / twin-Q params (or grads) in rose-jax's layout: the last layer of each MLP
    is named ``out``, the Q-networks ``MLP_i`` are ``q_i``."""

    def mlp(layers):
        names = sorted(layers, key=lambda n: int(n.split("_")[1]))
        return {**{f"hidden_{i}": layers[n] for i, n in enumerate(names[:-1])}, "out": layers[names[-1]]}

    q = brax_q["params"]
    twin = {f"q_{i}": mlp(q[f"MLP_{i}"]) for i in range(2)}
    return {"params": mlp(brax_policy["params"])}, {"params": twin}


def test_sac_losses_and_gradients_equal_brax_sac_losses():
    """alpha, critic and actor losses of algos.sac equal brax 0.14.2's ``sac.losses.make_losses``
    (values and gradients) on the same transitions, parameters, normalizer and keys."""
    from brax.training.agents.sac import losses as brax_sac_losses
    from brax.training.agents.sac import networks as brax_sac_networks

    from algos import presets, sac

    env = envs.core.Env("x", OBS, ACT, 10, None, None)
    config = presets.make_config(
        "sac", "brax", env, policy_hidden_sizes=(8, 8), q_hidden_sizes=(8, 8), normalize_observations=True,
        reward_scaling=3.0, discounting=0.97,
    )
    nets = brax_sac_networks.make_sac_networks(
        OBS, ACT, preprocess_observations_fn=running_statistics.normalize, hidden_layer_sizes=(8, 8)
    )
    alpha_loss, critic_loss, actor_loss = brax_sac_losses.make_losses(nets, 3.0, 0.97, ACT)
    k = jax.random.split(jax.random.PRNGKey(3), 10)
    policy, q = nets.policy_network.init(k[0]), nets.q_network.init(k[1])
    target_q = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(k[2], x.shape), q)
    norm, brax_norm = _normalizers()
    n = 64  # transitions: enough that some are terminal and some truncated (checked below)
    done, truncation = _random_episode_flags(k[3], (n,))
    assert 0 < truncation.sum() < (done - truncation).sum()
    data = brax_types.Transition(
        observation=jax.random.normal(k[4], (n, OBS)) * 2 + 1,
        action=jnp.tanh(jax.random.normal(k[5], (n, ACT))),
        reward=jax.random.normal(k[6], (n,)),
        discount=1.0 - done * (1.0 - truncation),
        next_observation=jax.random.normal(k[7], (n, OBS)) * 2 + 1,
        extras={"state_extras": {"truncation": truncation}, "policy_extras": {}},
    )
    batch = sac.Transition(
        obs=data.observation, action=data.action, reward=data.reward, discount=data.discount,
        next_obs=data.next_observation, truncation=truncation,
    )
    ours = sac.make(config, env)
    assert ours.target_entropy == -0.5 * ACT  # the one Brax hard-codes
    actor, critic = _sac_params_ours(policy, q)
    _, target = _sac_params_ours(policy, target_q)
    log_alpha, key = jnp.asarray(-0.3), k[8]

    def check(want_fn, got_fn, want_args, got_args, to_ours):
        want, want_g = jax.value_and_grad(want_fn)(*want_args)
        got, got_g = jax.value_and_grad(got_fn)(*got_args)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        for w, g in zip(jax.tree.leaves(to_ours(want_g)), jax.tree.leaves(got_g), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    alpha = jnp.exp(log_alpha)
    check(
        alpha_loss, functools.partial(sac.alpha_loss, ours),
        (log_alpha, policy, brax_norm, data, key), (log_alpha, actor, norm, batch.obs, key), lambda g: g,
    )
    check(
        critic_loss, functools.partial(sac.critic_loss, ours),
        (q, policy, brax_norm, target_q, alpha, data, key),
        (critic, target, actor, log_alpha, norm, batch, key), lambda g: _sac_params_ours(policy, g)[1],
    )
    check(
        actor_loss, lambda p, *a: sac.actor_loss(ours, p, *a),
        (policy, brax_norm, q, alpha, data, key), (actor, critic, log_alpha, norm, batch.obs, key),
        lambda g: _sac_params_ours(g, q)[0],
    )


# Brax's sac.train keywords of a tiny run: prefill 8 steps of 4 envs, then 2 epochs of 71 steps
TINY_BRAX_SAC_KW = dict(
    num_timesteps=600,
    num_evals=3,
    episode_length=20,
    num_envs=4,
    batch_size=16,
    grad_updates_per_step=2,
    min_replay_size=32,
    max_replay_size=1024,
    num_eval_envs=2,
)


@pytest.mark.slow
def test_sac_schedule_and_step0_report_equal_brax_sac_train(monkeypatch):
    """The drop-in's SAC reports at Brax's env steps (an evaluation at step 0, then one per epoch
    after the prefill); its step-0 report is the initial policy's evaluation, computed plainly."""
    _brax_device_put_replicated(monkeypatch)
    from brax.training.agents.sac import networks as brax_sac_networks
    from brax.training.agents.sac import train as brax_sac

    from algos import presets, sac
    from algos.brax_compat import sac as compat_sac

    factory = functools.partial(brax_sac_networks.make_sac_networks, hidden_layer_sizes=(4,))
    brax_steps, ours = [], []
    brax_sac.train(
        _tiny_brax_env(), **TINY_BRAX_SAC_KW, network_factory=factory,
        progress_fn=lambda step, m: brax_steps.append(step),
    )
    compat_sac.train(
        environment=_tiny_brax_env(), **TINY_BRAX_SAC_KW, network_factory=factory,
        progress_fn=lambda step, m: ours.append((step, m)),
    )
    assert [s for s, _ in ours] == brax_steps == [0, 32 + 71 * 4 * 1, 600]
    env = ppo_brax.resolve_env(ppo.PPOConfig(episode_length=20), _tiny_brax_env())
    config = presets.make_config(
        "sac", "brax", env, **{k: v for k, v in TINY_BRAX_SAC_KW.items() if k != "episode_length"},
        policy_hidden_sizes=(4,), q_hidden_sizes=(4,),
    )
    assert config.initial_eval and config.num_epochs == 2 and sac.iterations_per_epoch(config) == 71
    state = sac.init(config, env, jax.random.PRNGKey(config.seed))
    assert ours[0][1]["eval/episode_reward"] == sac.initial_evaluation(config, env, state)
    assert all(np.isfinite(m["eval/episode_reward"]) for _, m in ours)


def test_ppo_search_unit_is_the_epoch_with_fewer_iterations_and_a_scaled_evaluation(monkeypatch):
    """In Brax's run shape a long PPO epoch (the published ant config's 17 iterations and an
    evaluation of 1,000 steps) is searched on the same epoch program with k of its iterations and
    its evaluation shortened by the same factor: the same state pytree and metrics, k iterations
    run, the evaluator at the scaled length, and the same loop and component names (so the plan
    found on it applies to the epoch); a short epoch, or no num_evals, is searched as it is."""
    import algos
    import rose_jax.trace as rtrace
    from algos import ppo, registry

    config = _evals_config()
    full = config.iterations_per_eval
    assert full * config.env_steps_per_iteration <= ppo.SEARCH_UNIT_ENV_STEPS
    assert algos.get("ppo").search_unit(config, "pendulum") is None
    assert algos.get("ppo").search_unit(_evals_config(num_evals=None, batch_size=None), "pendulum") is None
    # a knob of the module, not a mock
    monkeypatch.setattr(ppo, "SEARCH_UNIT_ENV_STEPS", 3 * config.env_steps_per_iteration)
    unit = algos.get("ppo").search_unit(config, "pendulum")
    episode = ppo.ppo_brax.resolve_env(config, "pendulum").episode_length
    assert (unit.iterations, unit.of) == (3, full) and unit.eval_of == episode
    assert unit.eval_steps == registry.scaled_eval_steps(episode, 3, full) == max(8, -(-episode * 3 // full))
    assert unit.eval_steps < episode
    resolved = ppo.ppo_brax.resolve_env(config, "pendulum")
    state = ppo.init(config, resolved, jax.random.PRNGKey(0))
    whole = algos.get("ppo").unit_program(config, "pendulum")
    s_short, m_short = jax.jit(unit.fn)(state)
    s_full, m_full = jax.jit(whole)(state)
    chex.assert_trees_all_equal_shapes_and_dtypes(s_short, s_full)
    assert set(m_short) == set(m_full) and "eval/episode_reward" in m_short
    assert int(s_short.iteration) == 3 and int(s_full.iteration) == full
    # the evaluation is the epoch's evaluator at the scaled length, on the unit's end state
    scaled = ppo.ppo_brax.make_evaluator(ppo.ppo_core.evaluator_key(config), resolved, config.num_eval_envs,
                                         config.deterministic_eval, unit.eval_steps)
    got = scaled(s_short.params, s_short.normalizer, ppo.ppo_core.eval_key(s_short))
    assert got["eval/episode_reward"] == m_short["eval/episode_reward"]
    names = lambda fn: {n.name for n in rtrace.trace(fn, state, arg_names=["state"]).walk()}  # noqa: E731
    assert names(unit.fn) == names(whole) and "evaluate" in names(unit.fn)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        ppo.ppo_brax.make_evaluator(config, resolved, 2, True, steps=0)
    # never fewer than 2 iterations (a 1-trip scan is not the epoch's loop); no evaluation to scale
    # where num_evals is 0
    monkeypatch.setattr(ppo, "SEARCH_UNIT_ENV_STEPS", 1)
    fewest = algos.get("ppo").search_unit(config, "pendulum")
    assert fewest.iterations == registry.SEARCH_UNIT_MIN_ITERATIONS == 2
    quiet = algos.get("ppo").search_unit(_evals_config(num_evals=0), "pendulum")
    assert quiet.eval_steps is None and quiet.eval_of is None and "evaluation" not in quiet.describe()

