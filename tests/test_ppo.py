"""algos.ppo (and algos.normalize, algos.driver): hand-computed math, structure, determinism, learning."""

from __future__ import annotations

import dataclasses
import math
import time

import chex
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import algos
import envs
from algos import checkpoint, normalize, ppo

# A tiny config whose iteration compiles in a few seconds: used by every non-learning test.
TINY = dict(
    num_envs=8,
    unroll_length=8,
    num_minibatches=2,
    num_epochs=2,
    policy_hidden_sizes=(16,),
    value_hidden_sizes=(16,),
)


def tiny_config(**kw) -> ppo.PPOConfig:
    return ppo.PPOConfig(**{**TINY, **kw})


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------
# Hand-computed numbers


def test_gae_matches_hand_computed_example():
    # Three envs (columns), T = 3, gamma = lambda = 0.5, the same rewards and values:
    #   env 0 never ends; env 1 terminates at t=1 and is truncated at t=2; env 2 is truncated at t=1.
    reward = jnp.array([[1.0] * 3, [2.0] * 3, [3.0] * 3])
    value = jnp.array([[0.5] * 3, [1.0] * 3, [1.5] * 3])
    bootstrap = jnp.array([2.0] * 3)
    done = jnp.array([[0, 0, 0], [0, 1, 1], [0, 1, 0]], jnp.float32)
    truncated = jnp.array([[0, 0, 0], [0, 0, 1], [0, 1, 0]], jnp.float32)
    target, advantage = ppo.compute_gae(reward, value, bootstrap, done, truncated, 0.5, 0.5)
    # env 0: deltas (1 + .5*1 - .5, 2 + .5*1.5 - 1, 3 + .5*2 - 1.5) = (1, 1.75, 2.5);
    #        A_2 = 2.5, A_1 = 1.75 + .25 * 2.5 = 2.375, A_0 = 1 + .25 * 2.375 = 1.59375
    # env 1: t=2 truncated -> A=0; t=1 terminal -> delta = 2 - 1 = 1, no carry; A_0 = 1 + .25 * 1
    # env 2: t=2 -> 2.5; t=1 truncated -> 0 and cuts the carry; t=0 bootstraps from V(obs_1): A_0 = 1
    want_adv = np.array([[1.59375, 1.25, 1.0], [2.375, 1.0, 0.0], [2.5, 0.0, 2.5]])
    np.testing.assert_allclose(advantage, want_adv, rtol=1e-6)
    np.testing.assert_allclose(target, want_adv + np.asarray(value), rtol=1e-6)


def test_clipped_loss_matches_hand_computed_numbers():
    cfg = tiny_config(clipping_epsilon=0.2, value_cost=0.5, entropy_cost=0.01, normalize_advantage=False)
    ratio = np.array([1.5, 0.5, 0.5, 1.0])
    adv = jnp.array([1.0, 1.0, -1.0, 3.0])
    value, target, entropy = (
        jnp.array([1.0, 2.0, 3.0, 4.0]),
        jnp.full(4, 2.0),
        jnp.array([1.0, 2.0, 3.0, 2.0]),
    )
    total, m = ppo.loss_from_outputs(cfg, jnp.log(ratio), jnp.zeros(4), adv, value, target, entropy)
    # min(r A, clip(r, .8, 1.2) A) = (min(1.5, 1.2), min(.5, .8), min(-.5, -.8), 3) = (1.2, .5, -.8, 3)
    policy_loss = -(1.2 + 0.5 - 0.8 + 3.0) / 4
    value_loss = 0.5 * 0.5 * (1 + 0 + 1 + 4) / 4
    entropy_loss = -0.01 * 2.0
    approx_kl = np.mean((ratio - 1) - np.log(ratio))
    np.testing.assert_allclose(m.policy_loss, policy_loss, rtol=1e-6)
    np.testing.assert_allclose(m.value_loss, value_loss, rtol=1e-6)
    np.testing.assert_allclose(m.entropy_loss, entropy_loss, rtol=1e-6)
    np.testing.assert_allclose(total, policy_loss + value_loss + entropy_loss, rtol=1e-6)
    np.testing.assert_allclose(m.approx_kl, approx_kl, rtol=1e-5)
    np.testing.assert_allclose(m.clip_fraction, 0.75)

    # With advantage normalisation: A -> (0, 0, -sqrt 2, sqrt 2); only the last two count:
    # min(.5 * -s, .8 * -s) = -.8 s and 1 * s  ->  policy loss = -(0.2 s) / 4.
    cfg = tiny_config(clipping_epsilon=0.2, normalize_advantage=True)
    _, m = ppo.loss_from_outputs(cfg, jnp.log(ratio), jnp.zeros(4), adv, value, target, entropy)
    np.testing.assert_allclose(m.policy_loss, -0.2 * math.sqrt(2) / 4, rtol=1e-5)


def test_normalizer_is_welford_over_any_batching():
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 10, 3)) * jnp.array([1.0, 5.0, 0.1]) + 3.0
    state = normalize.init(3)
    chex.assert_trees_all_close(normalize.apply(state, x), x)  # identity before any data
    whole = normalize.update(state, x)  # leading axes (6, 10)
    halves = normalize.update(normalize.update(state, x[:2]), x[2:].reshape(-1, 3))
    flat = np.asarray(x).reshape(-1, 3)
    for s in (whole, halves):
        assert int(s.count) == 60
        np.testing.assert_allclose(s.mean, flat.mean(0), rtol=1e-5)
        np.testing.assert_allclose(s.std, flat.std(0), rtol=1e-4)
    z = normalize.apply(whole, flat)
    np.testing.assert_allclose(np.mean(z, 0), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.std(z, 0), 1.0, rtol=1e-4)
    assert float(jnp.max(jnp.abs(normalize.apply(whole, flat, max_abs_value=0.5)))) <= 0.5
    with pytest.raises(ValueError, match=r"expected \(\.\.\., 3\)") as e:
        normalize.update(state, jnp.zeros((4, 2)))
    one_line(e)


# ---------------------------------------------------------------------------------------------
# Structure, validation, determinism


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_timesteps=-5), "num_timesteps must be a positive int, got -5"),
        (dict(num_envs=0), "num_envs must be a positive int, got 0"),
        (dict(unroll_length=2.5), "unroll_length must be a positive int"),
        (dict(num_envs=6, unroll_length=5, num_minibatches=4), "30 is not divisible by num_minibatches = 4"),
        (dict(learning_rate=-1e-3), "learning_rate must be a positive number"),
        (dict(discounting=1.5), r"discounting must be a number in \[0, 1\]"),
        (dict(max_grad_norm=0.0), "max_grad_norm must be None or a positive number"),
        (dict(policy_hidden_sizes=(64, -1)), "policy_hidden_sizes must be a sequence of positive ints"),
        (dict(activation="nope"), "activation must be a flax.linen activation name"),
    ],
)
def test_bad_hyperparameters_give_one_line_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        ppo.train(envs.make("pendulum"), **kwargs)
    one_line(e)


def test_bad_driver_arguments_and_env_give_value_errors(tmp_path):
    env = envs.make("pendulum")
    with pytest.raises(ValueError, match="checkpoint_dir is None") as e:
        ppo.train(env, num_timesteps=64, checkpoint_every=1, **TINY)
    one_line(e)
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        ppo.train(env, num_timesteps=64, resume=True, **TINY)
    with pytest.raises(ValueError, match="must be an envs.core.Env") as e:
        ppo.train(42, num_timesteps=64)
    one_line(e)


def test_state_of_another_env_is_rejected():
    cfg = tiny_config()
    pendulum_state = ppo.init(cfg, envs.make("pendulum"), jax.random.PRNGKey(0))  # obs 3, act 1
    with pytest.raises(ValueError, match="observation_size=4") as e:
        jax.jit(ppo.iteration(cfg, envs.make("cartpole")))(pendulum_state)
    one_line(e)
    cartpole_state = ppo.init(cfg, envs.make("cartpole"), jax.random.PRNGKey(0))  # obs 4, act 1
    with pytest.raises(ValueError, match="state.params.policy has shapes .* action_size=2") as e:
        jax.jit(ppo.iteration(cfg, envs.make("point_mass")))(cartpole_state)  # obs 4, act 2
    one_line(e)
    with pytest.raises(ValueError, match=r"expected \(16, 3\) \(num_envs=16"):
        ppo.iteration(tiny_config(num_envs=16, num_minibatches=4), envs.make("pendulum"))(pendulum_state)


def _component_paths(closed_jaxpr) -> set[str]:
    """Full name stacks of every equation, nested through scan/jit/cond bodies."""
    paths: set[str] = set()

    def walk(jaxpr, prefix):
        for eqn in jaxpr.eqns:
            here = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
            paths.add(here)
            for sub in jex.jaxprs_in_params(eqn.params):
                walk(sub, here)

    walk(closed_jaxpr.jaxpr, "")
    return paths


def test_iteration_is_made_of_named_components():
    env, cfg = envs.make("pendulum"), tiny_config()
    state = ppo.init(cfg, env, jax.random.PRNGKey(0))
    paths = _component_paths(jax.make_jaxpr(ppo.iteration(cfg, env))(state))

    def has(*names):
        return any(all(f"rose:{n}" in p for n in names) and _ordered(p, names) for p in paths)

    for nested in [
        ("rollout", "policy"),
        ("rollout", "sim"),
        ("normalizer",),
        ("advantage",),
        ("update", "loss"),
        ("update", "optimizer"),
    ]:
        assert has(*nested), (nested, sorted(p for p in paths if "rose:" in p))
    assert not has("update", "sim") and not has("rollout", "loss")  # the test can fail


def _ordered(path: str, names) -> bool:
    positions = [path.find(f"rose:{n}") for n in names]
    return positions == sorted(positions)


def test_iteration_traces_once_over_several_calls():
    env, cfg = envs.make("pendulum"), tiny_config()
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(ppo.iteration(cfg, env), n=1))
    state = ppo.init(cfg, env, jax.random.PRNGKey(0))
    for _ in range(3):
        state, metrics = step(state)
    assert int(state.iteration) == 3 and int(state.env_steps) == 3 * 64
    assert int(metrics.iteration) == 3
    assert all(np.isfinite(float(getattr(metrics, f))) for f in ("total_loss", "approx_kl", "entropy"))
    assert float(metrics.reward) < 0  # pendulum rewards are costs


def test_iteration_vmaps_over_seeds():
    env, cfg = envs.make("pendulum"), tiny_config()
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    states = jax.vmap(lambda k: ppo.init(cfg, env, k))(keys)
    stacked, metrics = jax.jit(jax.vmap(ppo.iteration(cfg, env)))(states)
    assert metrics.total_loss.shape == (2,)
    single = ppo.jitted_iteration(cfg, env)
    for i in range(2):
        alone, _ = single(ppo.init(cfg, env, keys[i]))
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, i=i: x[i], stacked.params), alone.params, atol=1e-5, rtol=1e-5
        )


def test_same_seed_same_parameters_and_other_seed_differs():
    env = envs.make("cartpole")
    run = dict(num_timesteps=3 * 64, **TINY)
    a, ha = ppo.train(env, seed=3, **run)
    b, hb = ppo.train(env, seed=3, **run)
    c, _ = ppo.train(env, seed=4, **run)
    chex.assert_trees_all_equal(a, b)
    assert ha == hb or all(_same_metrics(x, y) for x, y in zip(ha, hb, strict=True))
    assert [m["iteration"] for m in ha] == [1, 2, 3]
    with pytest.raises(AssertionError):
        chex.assert_trees_all_equal(a.params, c.params)


def _same_metrics(x: dict, y: dict) -> bool:
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k], equal_nan=True) for k in x)


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path):
    env = envs.make("pendulum")
    run = dict(num_timesteps=4 * 64, seed=5, **TINY)
    straight, straight_metrics = ppo.train(env, **run)

    class Crash(Exception):
        pass

    def crash_at_iteration_3(step, metrics):
        if metrics["iteration"] == 3:
            raise Crash

    with pytest.raises(Crash):
        ppo.train(
            env, checkpoint_dir=str(tmp_path), checkpoint_every=2, progress_fn=crash_at_iteration_3, **run
        )
    assert checkpoint.latest_step(tmp_path) == 2 * 64

    seen = []
    resumed, resumed_metrics = ppo.train(
        env,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=2,
        resume=True,
        progress_fn=lambda step, m: seen.append(step),
        **run,
    )
    assert seen == [3 * 64, 4 * 64]
    chex.assert_trees_all_equal(resumed, straight)
    assert all(_same_metrics(x, y) for x, y in zip(resumed_metrics, straight_metrics[2:], strict=True))
    assert checkpoint.latest_step(tmp_path) == 4 * 64
    restored, _ = checkpoint.restore(tmp_path, straight)
    chex.assert_trees_all_equal(restored, straight)
    with pytest.raises(ValueError, match="already holds checkpoints .* pass resume=True") as e:
        ppo.train(env, checkpoint_dir=str(tmp_path), **run)
    one_line(e)
    with pytest.raises(ValueError, match="expects") as e:  # resuming with another num_envs
        ppo.train(env, checkpoint_dir=str(tmp_path), resume=True, **{**run, "num_envs": 4})
    one_line(e)
    # resuming a finished run does nothing
    again, metrics = ppo.train(env, checkpoint_dir=str(tmp_path), resume=True, **run)
    assert metrics == []
    chex.assert_trees_all_equal(again, straight)


def test_inference_fn_and_registry():
    env, cfg = envs.make("point_mass"), tiny_config()
    state = ppo.init(cfg, env, jax.random.PRNGKey(0))
    act = ppo.make_inference_fn(cfg, env)
    obs = jax.random.normal(jax.random.PRNGKey(1), (5, env.observation_size)) * 10
    a = act(state.params, state.normalizer, obs)
    assert a.shape == (5, env.action_size) and float(jnp.max(jnp.abs(a))) <= 1.0
    chex.assert_trees_all_equal(a, act(state.params, state.normalizer, obs))
    s1 = act(state.params, state.normalizer, obs, jax.random.PRNGKey(2), deterministic=False)
    s2 = act(state.params, state.normalizer, obs, jax.random.PRNGKey(3), deterministic=False)
    assert not np.allclose(s1, s2)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        act(state.params, state.normalizer, obs, deterministic=False)
    assert algos.get("ppo").module is ppo and algos.get("ppo").iteration is ppo.iteration
    with pytest.raises(ValueError, match="unknown algo 'nope'"):
        algos.get("nope")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: checks buffer donation there")
def test_train_donates_the_state_on_gpu():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would fail this
        state, history = ppo.train(envs.make("pendulum"), num_timesteps=3 * 64, **TINY)
    assert int(state.iteration) == 3 and len(history) == 3
    assert all(math.isfinite(m["total_loss"]) for m in history)


# ---------------------------------------------------------------------------------------------
# Learning: each threshold is on the median over several seeds (measured over 16 seeds, below)


def _learn(name: str, config: ppo.PPOConfig, seeds):
    """Per seed: the deterministic policy's evaluation return (64 envs) before and after training,
    and the CPU time of it all. The seeds run one after another on programs compiled once (the seed
    only enters through the init key): a further seed costs only its steps, ~1 s of CPU here
    (``algos.train_many``'s vmapped programs compile anew, and the 2-core CPU gains nothing by
    vmapping)."""
    env = envs.make(name)
    before, after = [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    for seed in seeds:
        cfg = dataclasses.replace(config, seed=seed)
        init = ppo.init(cfg, env, jax.random.PRNGKey(seed))
        before.append(ppo.evaluate(cfg, env, init, jax.random.PRNGKey(99)))
        state, _ = ppo.train_with_config(cfg, env)
        after.append(ppo.evaluate(cfg, env, state, jax.random.PRNGKey(99)))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    print(
        f"\n{name}: {len(before)} seeds of {int(state.env_steps)} steps, {seconds:.1f} s wall, "
        f"{cpu_seconds:.1f} s CPU (incl. compile): eval return {np.round(before, 1)} -> {np.round(after, 1)}"
    )
    return np.asarray(before), np.asarray(after), cpu_seconds


@pytest.mark.slow
def test_ppo_learns_cartpole():
    before, after, cpu_seconds = _learn("cartpole", ppo.PPOConfig(num_timesteps=100_000), range(4))
    # Default hyperparameters. Measured 2026-12-04 on the 2-core x86 CPU (jax 0.12), seeds 0-15:
    #   before 44.5 23.8 52.8 37.4 41.3 20.4 49.7 18.1 113.6 83.9 62.1 93.5 51.5 79.4 44.8 99.6
    #          (median 50.6, max 113.6)
    #   after 100k steps: 500 for 14 seeds, 487.2 and 486.0 (250k steps: 500 but 441.9 and 494.7)
    # Another CPU rounds differently, which re-draws each seed's run from the same distribution: the
    # median of 4 falls below 250 only if two seeds do (the worst seed of 16 reached 486; the
    # worst seen in any run, 50k-250k steps, vmapped or not, 278). The untrained median is 50.6.
    # Other x86 instruction sets (XLA_FLAGS=--xla_cpu_max_isa=AVX, SSE4_2) re-drew seeds 0-3: after
    # 500 472.4 500 500 and 500 500 500 500.
    assert np.median(before) < 100, before  # the untrained deterministic policy falls quickly
    assert np.median(after) >= 250, (before, after)  # half of the 500 possible steps balanced
    assert cpu_seconds < 60  # CPU time (both cores), so a busy machine does not fail it


@pytest.mark.slow
def test_ppo_learns_pendulum():
    # 8 epochs of 8 minibatches per iteration (defaults otherwise) learn in 100k steps what the
    # defaults (4 x 4) learn in 800k (16 seeds each: 100k -> median -216.8; defaults, 800k -> -187.6,
    # 400k -> -226.9 with a seed at -495.9): several seeds for the CPU time of one.
    config = ppo.PPOConfig(num_timesteps=100_000, num_epochs=8, num_minibatches=8)
    before, after, cpu_seconds = _learn("pendulum", config, range(4))
    # Measured 2026-12-04 on the 2-core x86 CPU (jax 0.12), this config, seeds 0-15:
    #   before -1332.4 -1658.6 -1277.0 -1736.3 -1251.7 -1210.2 -1414.7 -1801.3 -1537.7 -1201.7
    #          -1592.2 -1733.4 -1638.9 -1480.6 -1442.3 -1154.4 (median -1461.4, max -1154.4)
    #   after  -210.9 -180.8 -222.8 -240.7 -208.5 -201.7 -195.8 -381.2 -206.6 -202.7 -243.4 -233.9
    #          -242.1 -265.4 -262.3 -199.7 (median -216.8, min -381.2)
    # Another CPU re-draws each seed's run from the same distribution: the median of 4 falls below
    # -400 only if two seeds do, and no seed of 16 did. The untrained median is -1461.4. Other x86
    # instruction sets (XLA_FLAGS=--xla_cpu_max_isa=AVX, SSE4_2) re-drew seeds 0-3: after -237.7
    # -203.8 -224.0 -276.8 and -210.7 -225.2 -205.2 -361.1.
    assert np.median(before) < -800, before
    assert np.median(after) >= -400, (before, after)
    assert cpu_seconds < 90
