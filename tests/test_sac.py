"""Tests of algos.sac: hand-computed target / Polyak numbers, config errors, structure, learning."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from algos import sac

# Small, fast-compiling settings for the structural tests.
TINY = dict(
    num_timesteps=1200,
    num_envs=8,
    grad_updates_per_step=2,
    batch_size=32,
    min_replay_size=64,
    policy_hidden_sizes=(16,),
    q_hidden_sizes=(16,),
    num_evals=4,
    num_eval_envs=0,
)


@pytest.fixture(scope="module")
def pendulum():
    return envs.make("pendulum")


@pytest.fixture(scope="module")
def tiny_step(pendulum):
    """The jitted TINY iteration (not donating), shared by the tests that compare runs."""
    return jax.jit(sac.iteration(sac.SACConfig(**TINY), pendulum))


# ---------------------------------------------------------------------------------- math


def test_critic_target_by_hand():
    reward = jnp.array([1.0, -2.0, 0.5])
    discount = jnp.array([1.0, 1.0, 0.0])  # the last one is terminal: no bootstrap
    next_q = jnp.array([[3.0, 4.0], [-1.0, -5.0], [10.0, 10.0]])
    next_log_prob = jnp.array([-1.0, 2.0, 0.3])
    alpha, scale, gamma = 0.2, 2.0, 0.9
    got = sac.critic_target(reward, discount, next_q, next_log_prob, alpha, scale, gamma)
    # r*s + gamma*d*(min(q) - alpha*logp)
    want = [1.0 * 2 + 0.9 * (3.0 + 0.2), -2.0 * 2 + 0.9 * (-5.0 - 0.4), 0.5 * 2]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_polyak_by_hand():
    target = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(10.0)}
    online = {"w": jnp.array([3.0, -2.0]), "b": jnp.array(0.0)}
    got = sac.target_update(target, online, 0.25)
    np.testing.assert_allclose(got["w"], [1.5, 1.0])
    np.testing.assert_allclose(got["b"], 7.5)
    chex.assert_trees_all_equal(sac.target_update(target, online, 1.0), online)


def _losses_setup(pendulum, **overrides):
    config = sac.SACConfig(**{**TINY, **overrides})
    state = sac.init(config, pendulum, jax.random.PRNGKey(1), prefill=False)
    net = sac.make(config, pendulum)
    batch = sac.Transition(
        obs=jax.random.normal(jax.random.PRNGKey(2), (5, 3)),
        action=jnp.tanh(jax.random.normal(jax.random.PRNGKey(3), (5, 1))),
        reward=jnp.arange(5.0) - 2.0,
        discount=jnp.array([1.0, 0.0, 1.0, 1.0, 0.0]),
        next_obs=jax.random.normal(jax.random.PRNGKey(4), (5, 3)),
        truncation=jnp.array([0.0, 0.0, 1.0, 0.0, 0.0]),
    )
    return config, state, net, batch


def test_critic_loss_matches_hand_assembled_target(pendulum):
    config, state, net, batch = _losses_setup(pendulum, reward_scaling=3.0, discounting=0.8)
    key = jax.random.PRNGKey(5)
    log_alpha = jnp.log(0.3)
    loss = sac.critic_loss(
        net,
        state.critic_params,
        state.target_critic_params,
        state.actor_params,
        log_alpha,
        state.normalizer,
        batch,
        key,
    )
    # Assemble the same quantity step by step from the networks.
    dist = sac.policy_distribution(net, state.actor_params, state.normalizer, batch.next_obs)
    raw = dist.loc + dist.scale * jax.random.normal(key, dist.loc.shape)
    logp = np.asarray(sac.networks.log_prob(dist, raw))
    q_next = np.asarray(net.critic.apply(state.target_critic_params, batch.next_obs, jnp.tanh(raw)))
    q = np.asarray(net.critic.apply(state.critic_params, batch.obs, batch.action))
    r, d, tr = map(np.asarray, (batch.reward, batch.discount, batch.truncation))
    y = r * 3.0 + d * 0.8 * (q_next.min(axis=1) - 0.3 * logp)
    err = (q - y[:, None]) * (1 - tr)[:, None]  # the truncated transition does not count
    np.testing.assert_allclose(loss, 0.5 * np.mean(err**2), rtol=1e-5)


def test_each_update_moves_its_parameters(pendulum):
    config, state, net, batch = _losses_setup(pendulum)
    key = jax.random.PRNGKey(6)
    critic, critic_opt, _ = jax.jit(functools.partial(sac.critic_update, net))(
        state.critic_params,
        state.critic_opt_state,
        state.target_critic_params,
        state.actor_params,
        state.log_alpha,
        state.normalizer,
        batch,
        key,
    )
    actor, actor_opt, _ = jax.jit(functools.partial(sac.actor_update, net))(
        state.actor_params,
        state.actor_opt_state,
        state.critic_params,
        state.log_alpha,
        state.normalizer,
        batch.obs,
        key,
    )
    log_alpha, _, _ = jax.jit(functools.partial(sac.alpha_update, net))(
        state.log_alpha, state.alpha_opt_state, state.actor_params, state.normalizer, batch.obs, key
    )
    chex.assert_trees_all_equal_structs(critic, state.critic_params)
    chex.assert_trees_all_equal_structs(actor, state.actor_params)
    for new, old in ((critic, state.critic_params), (actor, state.actor_params)):
        diffs = [
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True)
        ]
        assert max(diffs) > 0  # every update moved its parameters
    # Adam's first step moves a parameter by about lr (|m / sqrt(v)| = 1 at step one).
    assert abs(float(log_alpha - state.log_alpha)) == pytest.approx(config.alpha_learning_rate, rel=1e-3)


# ---------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_envs", 0),
        ("batch_size", -1),
        ("grad_updates_per_step", 1.5),
        ("steps_per_iteration", 0),
        ("learning_rate", 0.0),
        ("learning_rate", math.nan),
        ("critic_learning_rate", -1.0),
        ("alpha_learning_rate", math.inf),
        ("discounting", 1.5),
        ("tau", 0.0),
        ("tau", 2.0),
        ("reward_scaling", math.inf),
        ("policy_hidden_sizes", (64, 0)),
        ("q_hidden_sizes", "64"),
        ("activation", "no_such_fn"),
        ("init_alpha", -0.1),
        ("target_entropy", math.nan),
        ("max_replay_size", 0),
        ("min_replay_size", 5000),
        ("num_evals", 0),
        ("seed", -1),
        ("normalize_observations", "yes"),
    ],
)
def test_bad_hyperparameter_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SACConfig.{field} ") as info:
        sac.SACConfig(**{**TINY, field: value})
    assert "\n" not in str(info.value)


def test_min_replay_must_fit_the_buffer():
    with pytest.raises(ValueError, match="min_replay_size .*replay capacity"):
        sac.SACConfig(**{**TINY, "max_replay_size": 32})


def test_train_rejects_unknown_hyperparameters():
    with pytest.raises(TypeError, match="'learning_rat'"):
        sac.train("pendulum", num_timesteps=1000, learning_rat=1e-3)


def test_config_is_frozen_and_hashable():
    config = sac.SACConfig(**TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tau = 0.1
    assert hash(config) == hash(sac.SACConfig(**TINY))


# ---------------------------------------------------------------------------------- structure


def test_iteration_traces_once_and_counts(pendulum):
    config = sac.SACConfig(**{**TINY, "normalize_observations": True})
    state = sac.init(config, pendulum, jax.random.PRNGKey(0))
    assert int(state.replay.size) == 64 and int(state.env_steps) == 64
    assert int(state.normalizer.count) == 64  # prefill feeds the normalizer too
    step = jax.jit(chex.assert_max_traces(sac.iteration(config, pendulum), n=1), donate_argnums=0)
    for _ in range(3):
        state, metrics = step(state)
    assert int(state.env_steps) == 64 + 3 * 8
    assert int(state.grad_steps) == 3 * 2
    assert int(state.iteration) == 3 and int(metrics.iteration) == 3
    assert int(metrics.buffer_size) == 64 + 3 * 8 and int(metrics.env_steps) == 64 + 3 * 8
    assert int(state.normalizer.count) == 64 + 3 * 8
    for name in ("critic_loss", "actor_loss", "alpha_loss", "alpha", "reward"):
        assert np.isfinite(float(getattr(metrics, name))), name


def _component_names(closed_jaxpr):
    import jax.extend as jex

    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.update(
                p[len("rose:") :] for p in str(eqn.source_info.name_stack).split("/") if p.startswith("rose:")
            )
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


def test_iteration_is_made_of_the_named_components(pendulum):
    config = sac.SACConfig(**{**TINY, "normalize_observations": True})
    state = sac.init(config, pendulum, jax.random.PRNGKey(0), prefill=False)
    names = _component_names(jax.make_jaxpr(sac.iteration(config, pendulum))(state))
    assert names >= {
        "collect",
        "policy",
        "sim",
        "normalizer",
        "replay_insert",
        "train_steps",
        "replay_sample",
        "critic_update",
        "actor_update",
        "alpha_update",
        "target_update",
    }
    assert "prefill" in _component_names(jax.make_jaxpr(sac.prefill_fn(config, pendulum))(state))


def test_scanned_env_steps_equal_separate_iterations(pendulum, tiny_step):
    one = sac.SACConfig(**TINY)
    two = dataclasses.replace(one, steps_per_iteration=2)
    state = sac.init(one, pendulum, jax.random.PRNGKey(3))
    a, _ = tiny_step(tiny_step(state)[0])
    b, _ = jax.jit(sac.iteration(two, pendulum))(state)
    assert int(a.iteration) == 2 and int(b.iteration) == 1
    b = b.replace(iteration=a.iteration)
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- driver


@pytest.fixture(scope="module")
def uninterrupted(pendulum):
    return sac.train(pendulum, **TINY)


def test_same_seed_same_params_other_seed_differs(uninterrupted, pendulum):
    a, history = uninterrupted
    b, _ = sac.train("pendulum", **TINY)  # a fresh env object: compiled anew
    chex.assert_trees_all_equal(a.actor_params, b.actor_params)
    chex.assert_trees_all_equal(a.critic_params, b.critic_params)
    chex.assert_trees_all_equal(a.replay, b.replay)
    assert len(history) == TINY["num_evals"]
    assert history[-1]["env_steps"] >= TINY["num_timesteps"]
    assert [m["iteration"] for m in history] == [
        sac.iterations_per_epoch(sac.SACConfig(**TINY)) * (i + 1) for i in range(TINY["num_evals"])
    ]
    c, _ = sac.train(pendulum, seed=1, **TINY)  # shares the compiled epoch: the seed is only data
    for x, y in zip(jax.tree.leaves(a.actor_params), jax.tree.leaves(c.actor_params), strict=True):
        assert not np.allclose(x, y)


class _Interrupt(Exception):
    pass


def test_resume_equals_uninterrupted(uninterrupted, pendulum, tmp_path):
    from algos import checkpoint

    reference, _ = uninterrupted
    seen = []

    def stop_at_the_second_report(step, metrics):
        seen.append(step)
        if len(seen) == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        sac.train(
            pendulum,
            checkpoint_dir=str(tmp_path),
            checkpoint_every=1,
            progress_fn=stop_at_the_second_report,
            **TINY,
        )
    done = seen.index(checkpoint.latest_step(tmp_path)) + 1  # epochs in the latest checkpoint
    assert 1 <= done < TINY["num_evals"]
    resumed, history = sac.train(pendulum, checkpoint_dir=str(tmp_path), resume=True, **TINY)
    assert len(history) == TINY["num_evals"] - done  # only the missing epochs ran
    chex.assert_trees_all_equal(resumed, reference)


def test_driver_argument_errors():
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        sac.train("pendulum", resume=True, **TINY)
    with pytest.raises(ValueError, match="checkpoint_every"):
        sac.train("pendulum", checkpoint_dir="/tmp/x", checkpoint_every=0, **TINY)


# ---------------------------------------------------------------------------------- learning


@pytest.mark.slow
def test_sac_learns_pendulum():
    # A random policy scores about -1200 per 200-step episode; solved is above about -200. 4 seeds,
    # one after another (the epoch is compiled once, ~10 s of CPU; each seed then costs ~2.3 s; a
    # vmapped algos.train_many of 4 seeds cost 2.6x one seed here (10k steps): no gain on 2 cores).
    pendulum = envs.make("pendulum")  # one Env object: the seeds share the compiled programs
    first, final, alpha = [], [], []
    for seed in range(4):
        _, history = sac.train(
            pendulum,
            num_timesteps=8_000,
            seed=seed,
            num_envs=16,
            grad_updates_per_step=16,
            batch_size=128,
            min_replay_size=512,
            policy_hidden_sizes=(64, 64),
            q_hidden_sizes=(64, 64),
            learning_rate=1e-3,
            num_evals=4,
            num_eval_envs=128,
        )
        returns = [m["eval_episode_return"] for m in history]
        print(f"\nseed {seed}: eval returns {np.round(returns, 1)}, alpha {history[-1]['alpha']:.3f}")
        first.append(returns[0])
        final.append(returns[-1])
        alpha.append(history[-1]["alpha"])
    # Thresholds on the median of 4 seeds. Measured 2026-12-04 on the 2-core x86 CPU (jax 0.12),
    # this config, seeds 0-15:
    #   first (after 2k steps) -1080.9 -1163.1 -1033.5 -1158.8 -1134.6 -946.6 -1169.6 -1061.1 -994.8
    #         -1112.3 -1080.8 -1002.0 -1156.0 -922.1 -1102.9 -1018.0 (median -1080.9, max -922.1)
    #   final (8k steps) -143.4 -150.5 -152.6 -136.4 -140.2 -147.6 -148.8 -150.7 -144.5 -218.6 -157.1
    #         -148.1 -333.9 -170.7 -532.8 -156.8 (median -150.6); alpha 0.25-0.30
    # SAC's evaluations swing (seeds at -400 to -600 one epoch, -150 the next), so one seed can end
    # low: here 1 of 16 ended below -400. Another CPU re-draws each seed's run from the same
    # distribution; the median of 4 (the mean of the middle two) falls below -400 only if two seeds
    # end below it, the better of them near -650: of the 1820 sets of 4 of these 16 seeds, the
    # worst median is -276.
    # (At 6k steps, 2 of 16 ended below -400, too many for a median of 4.) Other x86 instruction sets
    # (XLA_FLAGS=--xla_cpu_max_isa=AVX, SSE4_2) re-drew seeds 0-3: final -142.1 -150.8 -152.1 -135.8
    # and -141.4 -151.4 -153.0 -136.9.
    assert np.median(first) < -600, first  # it starts out bad (after 2k steps)
    assert np.median(final) >= -400, final
    assert np.median(alpha) < 0.5, alpha  # the temperature was tuned down


# slow (45 s on the 2-core CI machine): the default run keeps PPO's vmapped-seeds equality
# (tests/test_sweep.py); this SAC one runs in the full suite
@pytest.mark.slow
def test_vmap_over_seeds_equals_separate_runs(pendulum, tiny_step):
    config = sac.SACConfig(**TINY)
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    stacked = jax.vmap(lambda k: sac.init(config, pendulum, k))(keys)
    batched, _ = jax.jit(jax.vmap(sac.iteration(config, pendulum)))(stacked)
    single, _ = tiny_step(sac.init(config, pendulum, keys[1]))
    chex.assert_trees_all_close(jax.tree.map(lambda x: x[1], batched), single, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: jax.default_backend() is not 'gpu'")
def test_sac_learns_pendulum_on_gpu_with_brax_sized_networks():
    state, history = sac.train(
        "pendulum",
        num_timesteps=20_000,
        seed=0,
        num_envs=128,
        grad_updates_per_step=32,
        batch_size=256,
        min_replay_size=1024,
        learning_rate=1e-3,
        num_evals=4,
        num_eval_envs=128,
    )  # (256, 256) relu networks, as Brax's defaults
    assert history[-1]["eval_episode_return"] >= -400, [m["eval_episode_return"] for m in history]


# ----------------------------------------------------------------------------- the search's unit


def test_search_unit_is_the_epoch_with_a_shorter_scan(pendulum, monkeypatch):
    """A long epoch is searched on the same epoch program with fewer iterations and its evaluation
    shortened by the same factor (the same state pytree and metrics); a short one is searched as it
    is."""
    import algos
    from rose_jax.jaxpr import compat as C
    from rose_jax.optimize import interpret as I

    config = sac.SACConfig(**{**TINY, "num_eval_envs": 2})
    full = sac.iterations_per_epoch(config)
    assert full * config.grad_updates_per_step <= sac.SEARCH_UNIT_GRAD_STEPS
    assert algos.get("sac").search_unit(config, pendulum) is None
    monkeypatch.setattr(sac, "SEARCH_UNIT_GRAD_STEPS", 16)  # a knob of the module, not a mock
    unit = algos.get("sac").search_unit(config, pendulum)
    assert (unit.iterations, unit.of) == (16 // config.grad_updates_per_step, full) and unit.iterations < full
    state = sac.init(config, pendulum, jax.random.PRNGKey(0))
    s_short, m_short = jax.jit(unit.fn)(state)
    s_full, m_full = jax.jit(sac.epoch(config, pendulum))(state)
    chex.assert_trees_all_equal_shapes_and_dtypes(s_short, s_full)
    assert set(m_short) == set(m_full) and "eval_episode_return" in m_short
    assert int(s_short.iteration) - int(state.iteration) == unit.iterations
    assert int(s_full.iteration) - int(state.iteration) == full
    # its evaluation scaled down alike: ceil(episode_length * iterations / full) of its steps, the
    # same evaluator (what the unit reports is that evaluator's return on the unit's end state)
    assert unit.eval_of == pendulum.episode_length
    assert unit.eval_steps == -(-pendulum.episode_length * unit.iterations // full) < pendulum.episode_length
    assert unit.describe() == (f"{unit.iterations} of the unit's {full} iterations and {unit.eval_steps} "
                               f"of its evaluation's {pendulum.episode_length} steps")
    eval_key = jax.random.fold_in(jax.random.fold_in(s_short.key, sac._EVAL_SALT), s_short.iteration)
    scaled = sac.make_evaluator(config, pendulum, steps=unit.eval_steps)
    assert m_short["eval_episode_return"] == scaled(s_short.actor_params, s_short.normalizer, eval_key)
    scans = [C.scan_params(site.eqn.params).length for site in I.sites(jax.make_jaxpr(unit.fn)(state),
                                                                         kinds=("scan",))]
    assert unit.eval_steps in scans and pendulum.episode_length not in scans


def test_a_short_search_unit_keeps_enough_evaluation_steps_for_its_candidates(pendulum, monkeypatch):
    """Scaled to 1 step (2 of 9,000/8-step iterations), the unit's evaluation would lose the scan
    candidates the epoch's has (unrolls of up to 8, hoists): it keeps SEARCH_UNIT_MIN_EVAL_STEPS, and
    the same evaluation-loop candidates are generated on the unit as on the epoch."""
    from rose_jax import trace as rtrace
    from rose_jax.optimize.candidates import generate_candidates

    monkeypatch.setattr(sac, "SEARCH_UNIT_GRAD_STEPS", 2)
    config = sac.SACConfig(**{**TINY, "num_eval_envs": 2, "num_timesteps": 9000})
    unit = sac.search_unit(config, pendulum)
    assert -(-pendulum.episode_length * unit.iterations // unit.of) < sac.SEARCH_UNIT_MIN_EVAL_STEPS
    assert unit.eval_steps == sac.SEARCH_UNIT_MIN_EVAL_STEPS < unit.eval_of == pendulum.episode_length
    state = sac.init(config, pendulum, jax.random.PRNGKey(0))

    def evaluation_candidates(fn):
        tree = rtrace.trace(fn, state, arg_names=["state"])
        return {c.transform.label for c in generate_candidates(tree, None, 1.0)
                if "evaluate" in str(dict(c.transform.params).get("where"))}

    on_unit = evaluation_candidates(unit.fn)
    assert on_unit and on_unit == evaluation_candidates(sac.epoch(config, pendulum))


def test_make_evaluator_accepts_an_env_s_numpy_int_length(pendulum):
    """The default length is the env's own episode_length as it is (a numpy int too): only a given
    ``steps`` is validated."""
    import numpy as np

    env = pendulum._replace(episode_length=np.int64(20))
    config = sac.SACConfig(**{**TINY, "num_eval_envs": 2})
    state = sac.init(config, env, jax.random.PRNGKey(0))
    args = (state.actor_params, state.normalizer, jax.random.PRNGKey(1))
    got, want = sac.make_evaluator(config, env)(*args), sac.make_evaluator(config, env, steps=20)(*args)
    assert got == want and np.isfinite(float(got))


def test_make_evaluator_steps(pendulum):
    """steps: the evaluation's length, an episode by default (the same function as steps=episode_length);
    a bad value is a one-line error naming it."""
    config = sac.SACConfig(**{**TINY, "num_eval_envs": 2})
    state = sac.init(config, pendulum, jax.random.PRNGKey(0))
    key = jax.random.PRNGKey(3)
    args = (state.actor_params, state.normalizer, key)
    whole = sac.make_evaluator(config, pendulum)(*args)
    assert whole == sac.make_evaluator(config, pendulum, steps=pendulum.episode_length)(*args)
    assert whole != sac.make_evaluator(config, pendulum, steps=3)(*args)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            sac.make_evaluator(config, pendulum, steps=bad)


# slow (53 s on the 2-core CI machine): the default run keeps the same path end to end through
# the CLI (tests/test_cli.py::test_train_optimize_searches_a_long_sac_epoch_on_a_shorter_one)
@pytest.mark.slow
def test_a_plan_found_on_the_search_unit_runs_the_whole_epoch(pendulum, monkeypatch):
    """``optimize.plan_of``: a plan as a search on the shorter unit reports it (its transforms by
    name, its XLA options; written here, not searched) applied to the whole epoch: the transform
    addresses the same loops in both units, really applies there (its scans unrolled, compiled
    under the plan's options) and keeps the epoch's result within its tolerance."""
    from rose_jax import optimize as O
    from rose_jax.jaxpr import compat as C
    from rose_jax.optimize import interpret as I
    from rose_jax.optimize.report import PlanReport

    config = sac.SACConfig(**{**TINY, "num_eval_envs": 2})
    monkeypatch.setattr(sac, "SEARCH_UNIT_GRAD_STEPS", 16)
    unit = sac.search_unit(config, pendulum)
    whole = sac.epoch(config, pendulum)
    state = sac.init(config, pendulum, jax.random.PRNGKey(1))
    t = O.unroll_scans(2)
    report = PlanReport("epoch", "fp", "key", "cpu", jax.__version__, 1, 1, "stepwise")
    report.plan = [t.to_json()]
    report.base_options = {"name": "o1", "options": {"xla_backend_optimization_level": 1}}
    step = O.plan_of(whole, report)
    got = step(state)
    # the transformed epoch under the plan's options, and within the transform's stated tolerance of
    # the epoch as it was
    options = report.base_options["options"]
    chex.assert_trees_all_equal(got, jax.jit(t.apply(whole), compiler_options=options)(state))
    tol = dict(rtol=t.tolerance.rtol, atol=max(t.tolerance.atol, 1e-6))
    chex.assert_trees_all_close(got, jax.jit(whole)(state), **tol)
    unrolls = [C.scan_params(s.eqn.params).unroll
               for s in I.sites(jax.make_jaxpr(t.apply(whole))(state), kinds=("scan",))]
    assert unrolls and all(u > 1 for u in unrolls)
    assert [C.scan_params(s.eqn.params).unroll for s in I.sites(step.trace(state).jaxpr, kinds=("scan",))
            ] == unrolls  # the step plan_of built is the transformed epoch, not the epoch as it was
    def loops(fn):
        return [(site.name, C.scan_params(site.eqn.params).unroll)
                for site in I.sites(jax.make_jaxpr(t.apply(fn))(state), kinds=("scan",))]

    assert loops(unit.fn) == loops(whole)  # the same loops, rewritten alike, at either length
