"""The learning-equivalence rule of tolerance-kept plans (issue 32): Welch's test and the 5 % mean
rule on final returns, its refusals, and the real check training both sides as vmapped programs."""

from __future__ import annotations

import pytest

import helpers_optimize as H
from rose_jax.optimize.learning import compare_returns


def test_identical_returns_learn_alike():
    c = compare_returns([10, 12, 11, 13, 9], [10, 12, 11, 13, 9])
    assert c.passed and c.p_value == pytest.approx(1.0) and c.relative_difference == 0.0
    assert "learns alike" in c.reason and c.to_json()["seeds"] == 5


def test_different_returns_are_refused_with_the_reason():
    c = compare_returns([100, 101, 99, 100, 102], [80, 81, 79, 80, 82])
    assert not c.passed and c.p_value < 0.05
    assert "Welch" in c.reason and "differ by" in c.reason


def test_means_beyond_five_percent_fail_even_when_not_significant():
    ref = [100, 60, 140, 90, 110]
    cand = [x + 10 for x in ref]  # p ~ 0.6, means 10 % apart
    c = compare_returns(ref, cand)
    assert c.p_value > 0.05 and not c.passed and "differ by" in c.reason


def test_near_zero_mean_is_scaled_by_the_spread():
    c = compare_returns([-1.0, 1.0, -0.5, 0.5, 0.0], [-1.0, 1.0, -0.5, 0.5, 0.01])
    assert c.passed, c.reason


@pytest.mark.parametrize(
    "ref,cand,match",
    [([1, 2, 3, 4], [1, 2, 3, 4, 5], "at least 5 seeds"), ([1, 2, 3, 4, float("nan")], [1] * 5, "finite")],
)
def test_bad_input_is_one_line_error(ref, cand, match):
    with pytest.raises(ValueError, match=match):
        compare_returns(ref, cand)


@pytest.mark.slow
def test_real_check_trains_both_sides_on_the_same_seeds():
    import envs
    from algos import equivalence
    from rose_jax.optimize import hoist_independent

    cfg = H.tiny_ppo_config(num_envs=8, unroll_length=8, num_timesteps=8 * 8 * 12)
    c = equivalence.learning_check(cfg, envs.make("cartpole"), hoist_independent())
    assert len(c.reference) == len(c.candidate) == 5
    assert len(set(c.reference)) > 1  # the seeds really differ
    assert c.passed, c.reason


def _fast_inexact_transform(needs_check: bool = False):
    """A stand-in transform (not a real family): much faster than the heavy baseline below and
    within its stated rtol, but not bitwise equal, so the search must ask for a learning check."""
    import jax.numpy as jnp

    from rose_jax.optimize.base import Tolerance, Transform

    def apply(fn):
        return lambda x: (x * jnp.float32(1.0 + 2**-20), jnp.float32(0.0))

    return Transform(
        "test_inexact",
        (),
        Tolerance(1e-3, 0.0, "test: last-bit change", learning_check=needs_check),
        "fn",
        lambda tree: (True, "test"),
        apply,
    )


def _heavy(x):
    import jax
    import jax.numpy as jnp

    w = jnp.ones((192, 192), jnp.float32) / 192.0

    def body(h, _):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, jnp.ones((192, 192), jnp.float32), None, length=60)
    return x + 0.0 * h[0, 0], jnp.float32(0.0)


@pytest.mark.parametrize("passes", [True, False])
def test_search_keeps_a_tolerance_plan_only_if_it_learns_alike(passes):
    """The learning check here is a stand-in returning fixed returns (the real one trains both
    sides: test_real_check_trains_both_sides_on_the_same_seeds)."""
    import jax.numpy as jnp

    from rose_jax.optimize import optimize

    asked = []

    def check(t):
        asked.append(t.name)
        ref = [10.0, 11.0, 12.0, 13.0, 14.0]
        return compare_returns(ref, ref if passes else [x + 20 for x in ref])

    x = jnp.ones((64,), jnp.float32)
    _, report = optimize(
        _heavy,
        x,
        candidates=[_fast_inexact_transform()],
        learning_check=check,
        isolate=False,
        n_iters=2,
        repeats=3,
        combine=False,
    )
    rec = report.candidates[0]
    assert asked == ["test_inexact"], rec.reason
    assert rec.learning_check["passed"] is passes
    assert rec.kept is passes
    if not passes:
        assert "learning check failed" in rec.reason and not report.plan


def test_cli_learning_check_steps():
    """`rose-jax train --learning-check-steps N` hands the search a checker of N-step runs; a
    negative N is a one-line error."""
    from rose_jax import cli

    job = cli.train_job(["--env", "cartpole", "--algo", "ppo", "--steps", "4096"])
    assert cli._learning_check_kw(job, 0) == {}
    kw = cli._learning_check_kw(job, 2048)
    assert callable(kw["learning_check"])
    with pytest.raises(cli.UsageError, match="--learning-check-steps must be >= 0"):
        cli._learning_check_kw(job, -1)


def test_a_reassociation_plan_without_a_learning_check_is_not_kept():
    import jax.numpy as jnp

    from rose_jax.optimize import optimize
    from rose_jax.optimize.stream_overlap import stream_overlap

    loose = stream_overlap("a", "b", reassociate=True)
    assert loose.tolerance.learning_check and dict(loose.params)["reassociate"] is True
    assert "reassociate" not in dict(stream_overlap("a", "b").params)
    _, report = optimize(
        _heavy,
        jnp.ones((64,), jnp.float32),
        candidates=[_fast_inexact_transform(True)],
        isolate=False,
        n_iters=2,
        repeats=3,
        combine=False,
    )
    rec = report.candidates[0]
    assert not rec.kept and not report.plan
    assert "none was given" in rec.reason and rec.stage == "legality", rec.reason
