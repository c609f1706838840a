"""rose_jax.optimize.xla_options: option sets tried on a run's first units, kept only if faster.

On a CPU the shipped sets (GPU command-buffer options) are not tried; these tests give TrialStep
CPU-valid or invalid options instead, and, where a test says so, a stand-in slowdown.
"""

from __future__ import annotations

import time

import chex
import jax
import jax.numpy as jnp
import pytest

from rose_jax.optimize import xla_options


def unit(state):
    x = jnp.tanh(state["x"] @ state["w"]) + 0.01 * state["x"]
    return {"x": x, "w": state["w"]}, {"norm": jnp.linalg.norm(x)}


def start():
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    return {"x": jax.random.normal(k1, (64, 64)), "w": jax.random.normal(k2, (64, 64)) / 8}


def run(step, n=8):
    state, out = start(), []
    for _ in range(n):
        state, metrics = step(state)
        out.append(float(metrics["norm"]))
    return state, out


def test_refused_set_falls_back_to_the_default_build_with_one_line():
    lines = []
    step = xla_options.TrialStep(unit, {"broken": {"xla_this_flag_does_not_exist": True}}, log=lines.append)
    state, norms = run(step)
    ref_state, ref_norms = run(jax.jit(unit))
    chex.assert_trees_all_equal(state, ref_state)  # the run continues, same results
    assert norms == ref_norms
    assert step.chosen == "default" and len(lines) == 1 and "\n" not in lines[0]
    assert "default build kept" in lines[0] and "broken refused" in lines[0]
    assert "xla_this_flag_does_not_exist" in step.describe()["refused"]["broken"]


def test_slower_set_is_not_kept(monkeypatch):
    lines = []
    step = xla_options.TrialStep(unit, {"slow": {"xla_backend_optimization_level": 3}}, rounds=2,
                                 log=lines.append)
    step.prepare(start(), wait=True)
    fast = step.builds["slow"]

    def slowed(state):  # stand-in: this build made 20 ms slower per unit
        time.sleep(0.02)
        return fast(state)

    step.builds["slow"] = slowed
    state, _ = run(step)
    assert step.chosen == "default" and "not faster" in lines[0], lines
    record = step.describe()
    assert record["median_ms"]["slow"] > record["median_ms"]["default"] + 15
    assert list(step.builds) == ["default"]  # the other build freed


def test_faster_set_is_kept_and_recorded():
    lines = []
    step = xla_options.TrialStep(unit, {"fast": {}}, rounds=2, log=lines.append)
    step.prepare(start(), wait=True)
    default = step.builds["default"]

    def slowed(state):  # stand-in: the default build made 20 ms slower per unit
        time.sleep(0.02)
        return default(state)

    step.builds["default"] = slowed
    run(step)
    assert step.chosen == "fast" and "fast kept" in lines[0]
    assert step.describe()["chosen"] == "fast"


def test_a_cached_decision_skips_the_trial_on_the_same_program_only(tmp_path):
    """The first run's decision is stored in the plan cache; a second run of the same program
    compiles only the kept build (no trial, one line saying so) and computes the same; another
    program (another shape) runs its own trial."""
    lines = []
    first = xla_options.TrialStep(unit, {"fast": {}}, rounds=2, log=lines.append, cache_dir=str(tmp_path))
    first.prepare(start(), wait=True)
    default = first.builds["default"]

    def slowed(state):  # stand-in: the default build made 20 ms slower per unit
        time.sleep(0.02)
        return default(state)

    first.builds["default"] = slowed
    state1, norms1 = run(first)
    assert first.chosen == "fast" and not first.describe()["cached"]
    second = xla_options.TrialStep(unit, {"fast": {}}, rounds=2, log=lines.append, cache_dir=str(tmp_path))
    state2, norms2 = run(second)
    assert second.chosen == "fast" and list(second.builds) == ["fast"]  # one compile, no trial
    assert "cached" in lines[-1] and "no trial" in lines[-1] and len(lines) == 2
    record = second.describe()
    assert record["cached"] and record["median_ms"] == {} and record["cached_decision"]["speedup"] > 1
    chex.assert_trees_all_equal(state1, state2)
    assert norms1 == norms2

    def other_unit(state):  # another program: its own key, its own trial
        return unit(state)[0], {"norm": jnp.sum(state["x"])}

    third = xla_options.TrialStep(other_unit, {"fast": {}}, rounds=1, log=lines.append,
                                  cache_dir=str(tmp_path))
    run(third, n=3)
    assert not third.describe()["cached"] and set(third.describe()["median_ms"]) == {"default", "fast"}


def test_specs():
    assert xla_options.sets_from_spec("default") == {}
    if jax.default_backend() != "gpu":
        assert xla_options.sets_from_spec("auto") == {}  # GPU options: nothing to try on a CPU
    with pytest.raises(ValueError, match="--xla-options must be"):
        xla_options.sets_from_spec("nonsense")
    with pytest.raises(ValueError, match="rounds"):
        xla_options.TrialStep(unit, {}, rounds=0)


def test_every_named_set_is_spelled_as_this_jaxlib_parses_it():
    """XLA parses debug options on any backend: a misspelled flag or enum value in SETS would be
    refused everywhere ("is not a valid enum value"); on a CPU the GPU options are then unused."""
    lowered = jax.jit(unit).lower(start())
    for opts in xla_options.SETS.values():
        lowered.compile(compiler_options=opts or None)  # raises on a bad name or value
    with pytest.raises(Exception, match="not a valid enum value"):
        lowered.compile(compiler_options={"xla_gpu_command_buffer_scheduling_mode": "CONCURRENTLY"})
