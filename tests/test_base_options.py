"""The search's baseline under its best XLA option set (``OptimizeOptions.option_sets``).

``optimize`` times the untransformed iteration under XLA's defaults and each option set in turns,
keeps the fastest (by a margin) as the baseline, compiles and times every candidate under it,
returns a step that runs under it and caches the choice with the plan. On a CPU the shipped
sets (GPU command-buffer options) are not tried; these tests give CPU-valid or invalid options.
Where a test needs the set to win, a stand-in slows the default build's timed runs (it says so);
the real timing of the same path runs in ``test_real_option_trial_keeps_the_results``.
"""

from __future__ import annotations

import time

import chex
import jax
import jax.numpy as jnp
import pytest

import helpers_optimize as H
import rose_jax
from rose_jax import optimize as O
from rose_jax.optimize import base as T
from rose_jax.optimize import measure, predict, search, split_compile
from rose_jax.optimize import report as plan_report

O1 = {"xla_backend_optimization_level": 1}


def iteration(state):
    new, metrics = H.core(state)
    with rose_jax.component("extra"):
        w = new["w"] + 0.0 * jnp.sin(new["w"])
    return {"w": w, "n": new["n"]}, metrics


EXAMPLE = H.example_state()


def identity_transform(name="toy_same"):
    """A candidate computing the same function (so it is timed and checked like any other)."""
    return T.Transform(name, (), T.FUSION_TOLERANCE, "fn", lambda tree: (True, "synthetic"), lambda fn: fn)


def _slow_default_in_the_trial(monkeypatch):
    """Stand-in: in the option trial (the first ``time_alternating`` of the search, the default
    build first) the default build sleeps 30 ms per call, so the set wins; later timings are real."""
    real = measure.time_alternating
    calls = []

    def patched(steps, state, n_iters, repeats, warmup=True):
        calls.append(len(steps))
        if len(calls) == 1:
            default = steps[0]

            def slowed(s):
                time.sleep(0.03)
                return default(s)

            steps = [slowed, *steps[1:]]
        return real(steps, state, n_iters, repeats, warmup)

    monkeypatch.setattr(measure, "time_alternating", patched)
    return calls


def _spy_compiles(monkeypatch):
    """Records the compiler options of every ``compile_step`` call of the search."""
    seen = []
    real = search.compile_step

    def spy(target, host=False, compiler_options=None):
        seen.append(compiler_options)
        return real(target, host=host, compiler_options=compiler_options)

    monkeypatch.setattr(search, "compile_step", spy)
    return seen


def test_the_faster_set_becomes_the_baseline_of_every_candidate_and_of_the_cached_plan(monkeypatch, tmp_path):
    calls = _slow_default_in_the_trial(monkeypatch)
    seen = _spy_compiles(monkeypatch)
    lines = []
    step, report = O.optimize(
        iteration, EXAMPLE, candidates=[identity_transform()], option_sets={"o1": O1}, n_iters=1, repeats=2,
        cache_dir=str(tmp_path), log=lines.append,
    )
    assert calls[0] == 2  # the default build and o1, timed in turns
    b = report.base_options
    assert b["name"] == "o1" and b["options"] == O1 and b["speedup_vs_default"] > 1.0
    assert set(b["ms_per_iter"]) == {"default", "o1"} and b["refused"] == {}
    assert any("XLA options of the baseline: o1 kept" in line for line in lines)
    # the candidate was compiled under o1 for its timing (its equality build on a CPU is the same)
    (rec,) = report.candidates
    assert rec.speedup is not None
    assert seen.count(O1) >= 3  # the set's build, the candidate's, the returned step
    assert seen[-1] == O1  # the returned step
    chex.assert_trees_all_equal(step(EXAMPLE), jax.jit(iteration)(EXAMPLE))
    assert "XLA options of the baseline and every candidate: o1" in O.format_report(report)
    assert plan_report.PlanReport.from_json(report.to_json()).base_options == b
    # a second call finds the plan and its option set in the cache and measures nothing
    seen.clear()
    step2, again = O.optimize(
        iteration, EXAMPLE, candidates=[identity_transform()], option_sets={"o1": O1}, n_iters=1, repeats=2,
        cache_dir=str(tmp_path),
    )
    assert again.cache_hit and again.measurements == 0 and again.base_options["name"] == "o1"
    assert seen == [O1]
    chex.assert_trees_all_equal(step2(EXAMPLE), jax.jit(iteration)(EXAMPLE))
    # other option sets are another search: not the cached plan
    _, other = O.optimize(iteration, EXAMPLE, candidates=[], option_sets=None, n_iters=1, repeats=2,
                          cache_dir=str(tmp_path))
    assert not other.cache_hit and other.base_options is None


def test_a_set_that_fails_to_compile_is_refused_and_the_search_goes_on():
    step, report = O.optimize(
        iteration, EXAMPLE, candidates=[identity_transform()], n_iters=1, repeats=2,
        option_sets={"broken": {"xla_this_flag_does_not_exist": True}},
    )
    b = report.base_options
    assert b["name"] == "default" and b["options"] == {} and b["speedup_vs_default"] == 1.0
    assert "xla_this_flag_does_not_exist" in b["refused"]["broken"] and "\n" not in b["refused"]["broken"]
    assert set(b["ms_per_iter"]) == {"default"}
    assert report.candidates[0].speedup is not None  # the search went on under XLA's defaults
    assert "broken refused" in O.format_report(report)
    chex.assert_trees_all_equal(step(EXAMPLE), jax.jit(iteration)(EXAMPLE))


def test_real_option_trial_keeps_the_results():
    """The same path with real timings: whichever build is kept, the report holds both timings
    and the returned step computes what the untransformed iteration computes."""
    step, report = O.optimize(iteration, EXAMPLE, candidates=[identity_transform()], n_iters=2, repeats=2,
                              option_sets={"o1": O1})
    b = report.base_options
    assert b["name"] in ("default", "o1") and set(b["ms_per_iter"]) == {"default", "o1"}
    assert all(ms > 0 for ms in b["ms_per_iter"].values())
    if b["name"] == "default":  # kept only when faster than the default build by the margin
        assert b["ms_per_iter"]["o1"] >= b["ms_per_iter"]["default"] * (1 - 0.02)
    state = EXAMPLE
    ref = EXAMPLE
    for _ in range(3):
        state, _ = step(state)
        ref, _ = jax.jit(iteration)(ref)
    chex.assert_trees_all_equal(state, ref)


def test_no_sets_is_the_default_build_only():
    _, report = O.optimize(iteration, EXAMPLE, candidates=[], option_sets=None, n_iters=1, repeats=2)
    assert report.base_options is None and report.measurements == 4  # the baseline timed twice
    if jax.default_backend() != "gpu":  # "auto" tries nothing on a CPU
        _, auto = O.optimize(iteration, EXAMPLE, candidates=[], n_iters=1, repeats=2)
        assert auto.base_options is None


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"o1": "fast"}, "option_sets must be 'auto', None or"),
        ("concurrent", "option_sets must be 'auto', None or"),
        ({"default": {}}, "must not name 'default'"),
    ],
)
def test_bad_option_sets_are_one_line_errors(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        O.optimize(iteration, EXAMPLE, candidates=[], option_sets=bad)
    assert "\n" not in str(e.value)


def test_a_transform_that_chooses_its_own_options_is_not_given_the_base_set(monkeypatch):
    """split_compile measures its stages' options itself: ``plan_step`` compiles its plan
    without the search's set, every other plan under it."""
    seen = _spy_compiles(monkeypatch)
    own = split_compile.split_compile((), options=("default",))
    assert own.chooses_options and not identity_transform().chooses_options
    step = search.plan_step(search.apply_plan(iteration, [own]), [own], O1)
    assert seen == [None]
    chex.assert_trees_all_equal(step(EXAMPLE), jax.jit(iteration)(EXAMPLE))
    search.plan_step(search.apply_plan(iteration, [identity_transform()]), [identity_transform()], O1)
    assert seen[-1] == O1


def test_split_compile_candidates_know_the_baseline_already_runs_under_a_set():
    """With a set kept, split_compile(()) (the whole iteration under one measured set) is the
    baseline itself and is not generated; per-stage sets are predicted what the model leaves."""
    from rose_jax import trace as rtrace

    tree = rtrace.trace(iteration, EXAMPLE)
    plain = predict.CandidateContext(tree, None, 1.0, platform="gpu")
    labels = {c.transform.label: c.predicted for c in split_compile.candidates(plain)}
    assert len(labels) == 2 and any("boundaries=()" in lb for lb in labels)
    ctx = predict.CandidateContext(tree, None, 0.9, platform="gpu", base_options="o1", options_saved_s=0.1)
    (per_stage,) = split_compile.candidates(ctx)
    assert "boundaries=()" not in per_stage.transform.label
    share = split_compile.SPLIT_COMPILE_SHARE["gpu"]
    assert per_stage.predicted == pytest.approx(max(0.0, 1.0 * share - 0.1))
    assert "already saves" in per_stage.model


EQ = {"xla_llvm_disable_expensive_passes": True}  # a CPU-valid stand-in for deterministic ops


def test_the_equality_reference_is_compiled_beside_the_option_trials_builds(monkeypatch):
    """The baseline's build under the equality options is compiled (and run once) in the option
    trial's pool, before anything is timed; the reference then starts from it instead of
    compiling it after the first candidate's timing. It is not an option set: not timed, not in
    the report's option trial, and equality is checked as before."""
    seen = _spy_compiles(monkeypatch)
    lines = []
    step, report = O.optimize(
        iteration, EXAMPLE, candidates=[identity_transform()], option_sets={"o1": O1}, n_iters=1, repeats=2,
        equality_options=EQ, check_slower=True, log=lines.append,
    )
    trial = next(i for i, line in enumerate(lines) if "XLA options of the baseline" in line)
    assert EQ in seen[: seen.index(O1) + 2]  # compiled with the option sets, not after
    assert any("compiled beside the option trial's builds" in line for line in lines[trial:])
    assert not any("the baseline compiled and run once under" in line for line in lines)
    b = report.base_options
    assert set(b["ms_per_iter"]) == {"default", "o1"} and b["refused"] == {}
    assert report.baseline_reproducible is True
    (rec,) = report.candidates
    assert rec.equal is True  # the identity candidate, checked against the prebuilt reference
    chex.assert_trees_all_equal(step(EXAMPLE), jax.jit(iteration)(EXAMPLE))


def test_equality_options_that_do_not_compile_are_refused_by_the_reference_as_before():
    """Equality options this compiler rejects fail in the option trial's pool silently (not an
    option set) and then in the reference, which refuses every checked candidate with the reason."""
    lines = []
    _, report = O.optimize(
        iteration, EXAMPLE, candidates=[identity_transform()], option_sets={"o1": O1}, n_iters=1, repeats=2,
        equality_options={"xla_this_flag_does_not_exist": True}, check_slower=True, log=lines.append,
    )
    assert "(equality reference)" not in report.base_options["refused"]
    (rec,) = report.candidates
    assert rec.equal is not True and "xla_this_flag_does_not_exist" in (rec.reason or "")
