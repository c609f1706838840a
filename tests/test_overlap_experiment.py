"""benchmarks.experiments.overlap's report plumbing on the CPU: the time split, --brax-only, targets."""

from __future__ import annotations

import json
import types

import pytest

from benchmarks.experiments import overlap


def _sac_row():
    return next(r for r in overlap.rows_for(smoke=True) if r.kind == "sac")


@pytest.mark.slow
def test_time_split_times_collect_and_learn_of_the_real_program():
    import chex
    import jax

    from algos import sac

    row = _sac_row()
    config, env, _, state, _ = overlap.build(row)
    before = jax.tree.map(lambda x: x.copy(), state)
    split = overlap.time_split(row, config, env, state, {}, calls=2)
    assert split["collect_ms"] > 0 and split["learn_ms"] > 0 and split["iteration_ms"] > 0
    assert 0.0 < split["collect_share"] < 1.0 and split["options"] == "default"
    # the split is timed from copies: the caller's state is untouched (nothing donated)
    chex.assert_trees_all_equal(before, state)
    # and the two halves it times are the program the experiment's baseline runs
    prog = sac.program(config, env)
    chex.assert_trees_all_equal(jax.jit(prog.iteration())(state), jax.jit(sac.iteration(config, env))(state))


def test_brax_only_needs_measured_rows(tmp_path):
    rows_all = overlap.rows_for(smoke=False)
    with pytest.raises(SystemExit, match="no .*results.json; run the rows first"):
        overlap._measured_rows(rows_all, str(tmp_path))
    measured = {"single_jit_env_steps_per_s": 10.0, "rose_env_steps_per_s": 12.0}
    rows = [
        {"workload": "sac-ant-128", **measured},
        {"workload": "sac-hopper-128", "single_jit_env_steps_per_s": 10.0},  # incomplete
        {"workload": "ppo-ant-4096", "error": "boom", **measured},
        {"workload": overlap.MICRO, **measured},  # no Brax trainer for the micro row
    ]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    got = overlap._measured_rows(rows_all, str(tmp_path))
    assert [r["workload"] for r in got] == ["sac-ant-128"]
    config, env = got[0]["_config_env"]
    assert type(config).__name__ == "SACConfig" and config.num_envs == 128 and env is None


def test_brax_only_refuses_brax_off():
    with pytest.raises(SystemExit):
        overlap.parse_args(["--brax-only", "--brax", "off"])
    assert overlap.parse_args(["--brax-only"]).merge is True


def test_markdown_states_target_verdict_and_time_split():
    row = {
        "workload": "sac-hopper-128",
        "baseline_env_steps_per_s": 100.0,
        "rose_env_steps_per_s": 130.0,
        "speedup": 1.3,
        "equal": True,
        "bitwise": True,
        "max_abs_diff": 0.0,
        "plan": "options(concurrent)",
        "search_s": 1.0,
        "measured": {"date": "2026-12-04 03:39 UTC", "command": "python -m benchmarks.experiments.overlap"},
        "time_split": {
            "options": "default",
            "collect_ms": 3.0,
            "learn_ms": 1.0,
            "iteration_ms": 3.5,
            "collect_share": 0.75,
            "sum_over_whole": 4.0 / 3.5,
            "calls": 5,
        },
    }
    machine = {"date": "d", "gpu": "g", "jax": "j", "command": "c"}
    md = overlap.markdown([row], machine, types.SimpleNamespace(budget_s=1.0))
    assert "target >= 1.40x over the best baseline: missed (1.300x)" in md
    assert "collect (policy + physics) 3.00 ms" in md and "= 75% / 25%" in md
    assert "measured 2026-12-04 03:39 UTC" in md
