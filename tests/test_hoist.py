"""hoist_independent: a scan's carry-independent work moved ahead of the loop computes the same
function (random inputs, reverse scans, effects kept in order, real PPO and SAC iterations), and
loops whose work all reads the carry, or whose batched values would not fit, are refused with the
reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import helpers_optimize as H
from rose_jax import trace as rtrace
from rose_jax.compare import compare_trees
from rose_jax.optimize import hoist
from rose_jax.optimize.predict import CandidateContext


def learner(params, xs, key, reverse=False):
    """A toy learner: a key chain and a counter (independent recurrences), noisy inputs
    (independent per-iteration work) and an update that reads the carried parameters."""

    def body(carry, x):
        p, k, n = carry
        k, sub = jax.random.split(k)
        xn = jnp.tanh(2.0 * x + jax.random.normal(sub, x.shape))  # reads no carried parameter
        y = jnp.sin(xn @ p)  # reads p
        p = p - 0.01 * jnp.outer(xn, y) * (n + 1)
        return (p, k, n + 1), (y.sum(), xn.mean(), k)

    return jax.lax.scan(body, (params, key, jnp.int32(0)), xs, reverse=reverse)


def only_dependent(c, xs):
    def body(h, x):
        h = jnp.tanh(h * x + h)
        return h, h.sum()

    return jax.lax.scan(body, c, xs)


def _inputs(seed, t=7):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return jax.random.normal(k1, (4, 4)), jax.random.normal(k2, (t, 4)), k3


def test_split_finds_the_recurrences_and_the_batched_work():
    split = hoist.split_scan(H.first_scan(learner, *_inputs(0)))
    assert split.moves, split.why
    assert split.recur == (1, 2)  # the key and the counter; the parameters stay in the loop
    assert split.b_eqns and split.r_eqns
    assert not set(split.b_eqns) & set(split.m_eqns) and not set(split.r_eqns) & set(split.m_eqns)


@pytest.mark.parametrize("reverse", [False, True])
def test_same_function_on_random_inputs(reverse):
    t = hoist.hoist_independent()
    ref_fn = jax.jit(lambda p, xs, k: learner(p, xs, k, reverse))
    new_fn = jax.jit(t.apply(lambda p, xs, k: learner(p, xs, k, reverse)))
    for seed in range(3):
        args = _inputs(seed)
        ref, out = ref_fn(*args), new_fn(*args)
        cmp = compare_trees(out, ref, rtol=t.tolerance.rtol)
        assert cmp.equal, cmp
        # the key chain and the counter are the same bits: they run the same ops in a scan
        np.testing.assert_array_equal(jax.random.key_data(out[0][1]), jax.random.key_data(ref[0][1]))
        assert int(out[0][2]) == int(ref[0][2]) == 7
    # the rewritten program has the recurrence scan ahead of the main loop
    scans = [
        e for e in jax.make_jaxpr(t.apply(learner))(*_inputs(0)).jaxpr.eqns if e.primitive.name == "scan"
    ]
    assert len(scans) == 2


def test_refused_when_every_equation_reads_the_carry():
    c, xs = jnp.ones(3), jnp.ones((5, 3))
    ok, why = hoist.hoist_independent().legal(rtrace.trace(only_dependent, c, xs))
    assert not ok and "reads what the loop writes" in why


def test_refused_when_the_batched_values_would_not_fit(monkeypatch):
    monkeypatch.setattr(hoist, "MAX_HOIST_BYTES", 16)
    ok, why = hoist.hoist_independent().legal(rtrace.trace(learner, *_inputs(0)))
    assert not ok and "MiB limit" in why


def test_effects_stay_in_the_loop_in_order():
    seen = []

    def record(x):
        seen.append(float(x))
        return np.float32(x)

    def fn(c, xs):
        def body(h, x):
            z = jnp.exp(x).sum()  # independent
            z = io_callback(record, jax.ShapeDtypeStruct((), jnp.float32), z, ordered=True)
            return h * 0.5 + z, z

        return jax.lax.scan(body, c, xs)

    c, xs = jnp.float32(1.0), jax.random.normal(jax.random.PRNGKey(0), (4, 3))
    split = hoist.split_scan(H.first_scan(fn, c, xs))
    cb = [i for i, e in enumerate(split_body(fn, c, xs).eqns) if "callback" in e.primitive.name]
    assert cb and set(cb) <= set(split.m_eqns)
    ref = jax.jit(fn)(c, xs)
    first = list(seen)
    seen.clear()
    out = jax.jit(hoist.hoist_independent().apply(fn))(c, xs)
    assert seen == first and len(seen) == 4
    assert compare_trees(out, ref, rtol=1e-6).equal


def split_body(fn, *args):
    return H.first_scan(fn, *args).body


@pytest.mark.slow
@pytest.mark.parametrize("name,loop", [("sac", "_grad_step"), ("ppo", "epoch_step")])
def test_real_iterations_same_state(name, loop):
    it, state = H.real_iteration(name)
    t = hoist.hoist_independent()
    tree = rtrace.trace(it, state)
    ok, why = t.legal(tree)
    assert ok and loop in why, why
    if name == "sac":  # the family's generator offers the gradient-step loop, with its model
        cands = hoist.candidates(CandidateContext(tree=tree, program=None, baseline_s=1e-3))
        assert [c.window for c in cands] == ["train_steps/_grad_step"]
        assert cands[0].predicted > 0 and "carry-independent" in cands[0].model
    H.assert_same_state(t, it, state)


def test_the_search_generates_measures_and_checks_hoist_on_a_real_program():
    """rose_jax.optimize.optimize with its default candidate generation (restricted to this family)
    offers hoist_independent per loop of PPO's Program, and the one it measures is legal, timed end
    to end and equal to the baseline (stepwise)."""
    import envs
    from algos import ppo
    from rose_jax.optimize import optimize

    cfg = H.tiny_ppo_config(num_epochs=2)
    env = envs.make("cartpole")
    _, report = optimize(
        ppo.program(cfg, env),
        ppo.init(cfg, env, jax.random.PRNGKey(0)),
        families=("hoist_independent",),
        isolate=False,
        n_iters=1,
        repeats=2,
        combine=False,
        quotas="off",
        max_candidates=1,
        local=False,  # straight to the end-to-end trial: a timed local check may drop it (flaky)
    )
    wheres = [c.label for c in report.candidates]
    assert any("update/epoch_step" in w for w in wheres) and any("rollout/step" in w for w in wheres), wheres
    measured = [c for c in report.candidates if c.stage == "e2e"]
    assert len(measured) == 1 and measured[0].legal and measured[0].equal is True, measured
