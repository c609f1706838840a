"""benchmarks.suite (workloads, baselines, run, report): rows, the tiny suite end to end, README block.

The end-to-end test runs ``python -m benchmarks.suite.run --suite tiny`` in a subprocess (it turns on
JAX's persistent compilation cache, which must not leak into other tests) and checks the JSON:
every variant has numbers, the hand-pipelined baseline and rose-jax's plan give (b)'s parameters,
and the ratio is rose-jax over the best baseline.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import pytest

ON_GPU = jax.default_backend() == "gpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `benchmarks` is a top-level directory, not an installed package
    sys.path.insert(0, ROOT)

from benchmarks.suite import report  # noqa: E402
from benchmarks.suite import workloads as S  # noqa: E402
from helpers_children import FAST_COMPILE_XLA_FLAGS  # noqa: E402


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------------------------------
# Suite definitions


def test_quick_suite_has_the_headline_rows_and_fits_its_budget_model():
    quick = S.get("quick")
    names = [w.name for w in quick.workloads]
    assert names == [
        "ppo-ant-2048-4x32",
        "sac-ant-1024-4x32",
        "ppo-mjx_swimmer-2048-4x32",
        "ppo-humanoid-2048-4x32",
    ]
    ant = quick.workloads[0]
    assert set(ant.variants) == set(S.VARIANTS) and ant.backend == "mjx" and ant.brax_env == "ant"
    assert quick.workloads[2].brax_env is None and "brax" not in quick.workloads[2].variants  # plain MJCF
    assert quick.budget_s is not None and quick.budget_s < 8 * 60
    assert not quick.measure_threshold


def test_budget_scale_is_per_variant_and_brax_is_not_scaled_by_searches():
    from benchmarks.suite import run  # noqa: PLC0415 - imports JAX lazily inside functions only

    ctx = run.Context("q", 100.0, True, (False, ""), False, None, lambda s: None)
    assert ctx.scale("rose_jax") == 1.0 and ctx.scale("brax") == 1.0
    ctx.observed += [("rose_jax", 87.0, 43.75), ("rose_jax", 141.0, 75.0)]  # searches ~2x their model
    assert ctx.scale("rose_jax") == pytest.approx((87.0 / 43.75 + 141.0 / 75.0) / 2)
    assert ctx.scale("hand_pipelined") == ctx.scale("rose_jax")  # unseen variant: all of them
    assert ctx.scale("brax") == 1.0  # Brax's train() shares nothing with a search
    ctx.observed.append(("brax", 60.0, 58.8))
    assert ctx.scale("brax") == pytest.approx(60.0 / 58.8)
    ctx.observed.append(("rose_jax", 1000.0, 1.0))
    assert ctx.scale("rose_jax") == pytest.approx(87.0 / 43.75) and ctx.scale("brax") < 1.1  # median; clamp
    w = S.get("quick").workloads[1]
    assert ctx.estimate(w, "brax") == pytest.approx(S.estimate_s(w, "brax") * 60.0 / 58.8)


def test_quick_search_skips_equality_compiles_of_slower_candidates_in_its_model():
    ant = S.get("quick").workloads[0]
    assert ant.optimizer.check_slower is False and ant.optimizer.to_json()["check_slower"] is False
    checked = dataclasses.replace(ant, optimizer=dataclasses.replace(ant.optimizer, check_slower=True))
    # each measured candidate's compile + the deterministic recompiles of baseline and candidates
    n = ant.optimizer.max_candidates
    assert n == len(ant.optimizer.candidates) == 1
    assert S.compile_s(checked, "rose_jax") == pytest.approx(
        S.compile_s(ant, "rose_jax") + (1 + n) * S.EQUALITY_COMPILES * S.COMPILE_S["ant"]
    )
    assert S.compile_s(checked, "rose_jax", gpu=False) == S.compile_s(ant, "rose_jax", gpu=False)


def test_epoch_rows_validate_and_name_themselves():
    w = S.ppo_row("ant", 2048, (32,) * 4, unit="epoch", iterations_per_block=50)
    assert w.name == "ppo-ant-2048-4x32-epoch" and "hand_pipelined" not in w.variants
    assert w.return_threshold is None and w.env_steps_per_call == 2048 * 10 * 50 * w.epochs_per_block
    with pytest.raises(ValueError, match="hand_pipelined"):
        S.Workload(algo="ppo", env="cartpole", num_envs=8, policy_hidden_sizes=(8,), unit="epoch",
                   variants=("single_jit", "hand_pipelined"))
    with pytest.raises(ValueError, match="unit"):
        S.Workload(algo="ppo", env="cartpole", num_envs=8, policy_hidden_sizes=(8,), unit="episode",
                   variants=("single_jit",))
    # the epoch suite: one row per part, each part within one device call (10 min). With the informed
    # peers (b') and (a') a row no longer fits one call whole: everything but its Brax pair does, and
    # the Brax runs go last, so the budget cuts (and records as skipped) only those
    epoch = S.get("epoch")
    assert S.parts_needed(epoch) == len(epoch.workloads) and epoch.budget_s < 600
    assert all(S.estimate_s(w) - S.brax_s(w) <= epoch.budget_s for w in epoch.workloads)
    assert all({"brax_flags", "single_jit_flags"} <= set(w.variants) for w in epoch.workloads)
    assert all(w.optimizer.candidates[0][0] == "offload_component" for w in epoch.workloads)


def test_quick_plan_runs_brax_last_with_sac_last_of_all_and_fits_in_three_parts():
    rows = S.get("quick").workloads
    assert S.brax_order(rows) == ["ppo-ant-2048-4x32", "sac-ant-1024-4x32"]  # the budget cuts SAC's first
    plan = S.plan_s(rows, gpu=True, workers=4)
    assert set(plan["rows"]) == {w.name for w in rows}
    # compiling ahead in parallel is modelled as cheaper than one after the other, never below the slowest row
    assert (
        max(r["precompile"] for r in plan["rows"].values()) < plan["precompile"] < plan["precompile_serial"]
    )
    assert plan["total"] < S.plan_s(rows, gpu=True, workers=1)["total"]
    # the split_compile searches do not fit two calls (2026-12-04: part 2 with ant and humanoid would
    # have taken ~640 s; humanoid's (d) was cut), and with the informed peers (a') and (b') (issue 30)
    # not three: four parts, each within the suite's budget, and every row in exactly one of them
    quick = S.get("quick")
    assert S.parts_needed(quick, quick.budget_s) == 4 and quick.budget_s < 8 * 60
    parts = [S.split(rows, i, 4) for i in (1, 2, 3, 4)]
    assert sorted(w.name for p in parts for w in p) == sorted(w.name for w in rows)
    assert all(S.plan_s(p, gpu=True, workers=4)["total"] < quick.budget_s for p in parts)
    # that run's measured part (SAC ant 1024 + swimmer: 420 s in process) is not underestimated
    sac_swimmer = tuple(w for w in rows if w.name in ("sac-ant-1024-4x32", "ppo-mjx_swimmer-2048-4x32"))
    assert S.plan_s(sac_swimmer, gpu=True, workers=4)["total"] >= 420
    # precompiled (b)/(c) leave only their runs; (d) and Brax keep their compile estimate
    ant = rows[0]
    assert S.estimate_s(ant, "single_jit", precompiled=True) < S.estimate_s(ant, "single_jit")
    assert S.estimate_s(ant, "rose_jax", precompiled=True) == S.estimate_s(ant, "rose_jax")


def test_list_prints_phases_and_brax_order(capsys):
    from benchmarks.suite import run

    assert run.main(["--suite", "quick", "--list", "--compile-workers", "4"]) == 0
    out = capsys.readouterr().out
    assert "precompile" in out and "Brax runs last" in out and "sac-ant-1024-4x32" in out
    with pytest.raises(SystemExit, match="--compile-workers"):
        run.main(["--suite", "tiny", "--list", "--compile-workers", "0"])


def test_full_suite_is_every_combination_once():
    full = S.get("full")
    combos = {(w.algo, w.env, w.policy_hidden_sizes, w.num_envs) for w in full.workloads}
    assert len(combos) == len(full.workloads) == 2 * 4 * 2 * 2
    assert {w.env for w in full.workloads} == {"ant", "humanoid", "halfcheetah", "mjx_swimmer"}
    assert {w.policy_hidden_sizes for w in full.workloads} == {(32,) * 4, (256,) * 4}
    for algo in ("ppo", "sac"):
        assert len({w.num_envs for w in full.workloads if w.algo == algo}) == 2


@pytest.mark.parametrize("parts", [1, 3, 7, 32])
def test_parts_partition_the_rows(parts):
    rows = S.get("full").workloads
    chosen = [w.name for i in range(1, parts + 1) for w in S.split(rows, i, parts)]
    assert sorted(chosen) == sorted(w.name for w in rows)  # every row exactly once
    loads = [sum(S.estimate_s(w) for w in S.split(rows, i, parts)) for i in range(1, parts + 1)]
    assert max(loads) <= max(S.estimate_s(w) for w in rows) + sum(loads) / parts  # greedy balance bound


def test_bad_workloads_and_parts_give_one_line_errors():
    with pytest.raises(ValueError, match="algo") as e:
        S.Workload(algo="dqn", env="cartpole", num_envs=8, policy_hidden_sizes=(8,))
    one_line(e)
    with pytest.raises(ValueError, match="brax_env") as e:
        S.Workload(algo="ppo", env="cartpole", num_envs=8, policy_hidden_sizes=(8,), variants=("brax",))
    one_line(e)
    with pytest.raises(ValueError, match="divisible") as e:
        S.Workload(algo="ppo", env="cartpole", num_envs=9, policy_hidden_sizes=(8,), variants=("single_jit",))
    with pytest.raises(ValueError, match="part"):
        S.split(S.get("full").workloads, 0, 3)
    with pytest.raises(ValueError, match="unknown suite"):
        S.get("huge")
    with pytest.raises(SystemExit, match="--part"):
        from benchmarks.suite import run

        run.main(["--suite", "tiny", "--part", "4/3", "--list"])


def test_workload_config_matches_brax_conventions():
    # SAC uses one hidden size for policy and Q (as Brax) and Brax's target entropy -0.5 * |A|.
    class FakeEnv:
        action_size = 8

    w = S.sac_row("ant", 1024, (32,) * 4)
    config = w.config(FakeEnv())
    assert config.q_hidden_sizes == config.policy_hidden_sizes == (32,) * 4
    assert config.target_entropy == -4.0 and config.num_envs == 1024
    assert config.replay_capacity >= w.total_timed_env_steps
    p = S.ppo_row("ant", 2048, (32,) * 4).config(FakeEnv())
    assert p.num_envs % p.num_minibatches == 0  # Brax: batch_size * num_minibatches == num_envs
    assert p.value_hidden_sizes == (256,) * 5 and p.activation == "swish" and p.reward_scaling == 10.0


# ---------------------------------------------------------------------------------------------
# Derived numbers


def _row(**rates):
    return {
        "name": "r",
        "variants": {
            v: ({"status": "ok", "env_steps_per_s": r} if isinstance(r, (int, float)) else {"status": r})
            for v, r in rates.items()
        },
    }


def test_ratio_is_against_the_best_measured_baseline():
    row = _row(brax=100.0, single_jit=300.0, hand_pipelined=250.0, rose_jax=450.0)
    row["variants"]["rose_jax"]["search_overhead_s"] = 10.0
    s = report.summarize(row)
    assert s["best_baseline"] == "single_jit" and s["ratio"] == pytest.approx(1.5)
    # break-even: 10 s = steps * (1/300 - 1/450)  ->  steps = 10 / (1/900) = 9000
    assert s["breakeven_env_steps"] == pytest.approx(9000.0)
    # skipped / failed baselines do not count; a slower rose-jax has no break-even point
    s = report.summarize(_row(brax="skipped", single_jit=200.0, hand_pipelined="error", rose_jax=100.0))
    assert s["baselines_measured"] == ["single_jit"] and s["ratio"] == pytest.approx(0.5)
    assert s["breakeven_env_steps"] is None
    assert report.summarize(_row(single_jit=200.0, rose_jax="error"))["ratio"] is None


def test_headline_names_the_baselines_a_row_did_not_measure():
    row = _row(brax="skipped", single_jit=200.0, hand_pipelined="error", rose_jax=190.0)
    row["variants"]["brax"]["reason"] = "time budget: 447s elapsed + ~114s estimated > 470s"
    text = report.headline({"suite": "q", "rows": [row]}, "x.json")
    line = next(ln for ln in text.splitlines() if ln.startswith("| r |"))
    assert "(a) Brax skipped (time budget)" in line and "(c) hand pipeline error" in line
    assert "0.95x" in line and "(b) single-jit" in line
    full = _row(brax=100.0, single_jit=200.0, rose_jax=190.0)
    lines = report.headline({"rows": [full]}, "x.json").splitlines()
    assert next(ln for ln in lines if ln.startswith("| r |")).endswith("| — | not measured | not measured |")


def test_every_speedup_table_has_the_informed_peer_and_end_to_end_columns(tmp_path):
    """Rows measured with the informed-peer method fill the two columns; older rows say so."""
    assert report.peer_cells({}) == ["not measured", "not measured"]
    cells = report.peer_cells({"rose_env_steps_per_s": 1100.0, "informed_peer_env_steps_per_s": 1000.0,
                               "end_to_end_s": 50.0, "peer_end_to_end_s": 100.0})
    assert cells == ["1,000 (1.10x)", "50 vs 100 (2.00x)"]
    from benchmarks.experiments import informed_peer as ip

    recs = [{"workload": "ppo-ant", "variant": v, "repeat": r, "call": "c", "num_timesteps": 1000,
             "returncode": 0,
             "end_to_end_s": wall + r, "steady_env_steps_per_s": rate, "command": "cmd"}
            for r in (1, 2) for v, wall, rate in (("peer_default", 100, 900.0), ("peer_flags", 90, 1000.0),
                                                   ("rose_first", 60, 1100.0), ("rose_cached", 40, 1100.0))]
    ip.write(str(tmp_path / "informed_peer"), recs, {}, "test")
    block = report.informed_peer_headline(str(tmp_path))
    assert "Against the informed peer" in block
    assert "| ppo-ant | 1,000 | 900 | 1,000 | 1,100 | 1.10x |" in block
    assert "42 (41-42, n=2)" in block  # rose_cached: median 41.5, min-max, repeats
    assert report.informed_peer_headline(str(tmp_path / "none")) is None
    # issue 32's table: beyond_flags --acceptance rows, written by its own writer
    from benchmarks.experiments import beyond_flags as bf

    runs = {"peer_flags": {"steady_env_steps_per_s": 9600.0, "returncode": 0},
            "flags_only": {"steady_env_steps_per_s": 9500.0, "returncode": 0},
            "rose": {"steady_env_steps_per_s": 9700.0, "returncode": 0, "plan_cache": []}}
    row = {k: v for k, v in bf.acceptance_row("sac-hopper", "sac", 100_000, runs).items() if k != "_plan"}
    row.update(date="2026-12-05 12:00 UTC", device="NVIDIA H200, 580, 143771 MiB")
    bf.write(str(tmp_path / "beyond_flags"), [], "test", [row], jax_devices=False)
    block = report.beyond_flags_headline(str(tmp_path))
    assert "| sac-hopper | 2026-12-05 12:00 UTC (NVIDIA H200) | 100,000 | — | 9,600 | 9,500 | 9,700 | " \
        "1.010x" in block
    assert "1.5x: missed" in block
    assert report.beyond_flags_headline(str(tmp_path / "none")) is None
    # faster than the one peer that ran: not established; its note under the table; a row that
    # measured nothing stays out
    fast = {"steady_env_steps_per_s": 20000.0, "returncode": 0, "plan_cache": []}
    one = bf.acceptance_row("sac-hopper", "sac", 100_000, {"peer_flags": runs["peer_flags"], "rose": fast})
    one = {k: v for k, v in one.items() if k != "_plan"}
    one["note"] = "one run per side"
    empty = {"workload": "ppo-ant", "num_timesteps": 1, "errors": {"rose": "timed out"}}
    bf.write(str(tmp_path / "beyond_flags"), [], "test", [one, empty], jax_devices=False)
    block = report.beyond_flags_headline(str(tmp_path))
    assert "1.5x: not established" in block and "- sac-hopper, ?: one run per side" in block
    # the end-to-end column: each finished run's whole wall time, in run order
    e2e = {"rose": 395.06, "peer_flags": 144.15}
    assert bf.end_to_end_cell({"end_to_end_s": e2e}) == "peer_flags 144 / rose 395"
    assert bf.end_to_end_cell({"end_to_end_s": e2e, "errors": {"rose": "timed out"}}) == "peer_flags 144"
    assert bf.end_to_end_cell({}) == "-"
    assert "ppo-ant" not in block


def test_every_peer_runs_as_shipped_and_with_the_best_flags_in_every_row():
    """Issue 30: each peer (Brax's trainer, our single-jit loop) runs with its informed partner."""
    assert S.with_informed_peers(("single_jit", "rose_jax", "brax")) == (
        "single_jit", "single_jit_flags", "rose_jax", "brax", "brax_flags")
    for suite in S.SUITES.values():
        for w in suite.workloads:
            for peer, flagged in S.INFORMED_PEERS.items():
                assert (peer in w.variants) == (flagged in w.variants), (suite.name, w.name)
    assert set(S.RUN_ORDER) == set(S.VARIANTS) and "single_jit_flags" in S.PRECOMPILED
    with pytest.raises(ValueError, match="brax_flags"):
        S.Workload(algo="ppo", env="cartpole", num_envs=8, policy_hidden_sizes=(8,), variants=("brax_flags",))
    # (a') is estimated like (a), plus its child process's start; the plan counts both as Brax runs
    ant = S.get("quick").workloads[0]
    assert S.estimate_s(ant, "brax_flags") == pytest.approx(S.estimate_s(ant, "brax") + S.BRAX_CHILD_START_S)
    assert S.plan_s((ant,))["rows"][ant.name]["brax"] == pytest.approx(S.brax_s(ant))
    assert S.estimate_s(ant, "single_jit_flags", precompiled=True) == S.estimate_s(
        ant, "single_jit", precompiled=True)
    from benchmarks.suite import run

    ctx = run.Context("q", 100.0, True, (False, ""), False, None, lambda s: None)
    ctx.observed += [("brax", 120.0, 60.0), ("rose_jax", 10.0, 40.0)]
    assert ctx.scale("brax_flags") == pytest.approx(2.0)  # like (a) until it has runs of its own
    ctx.observed.append(("brax_flags", 50.0, 50.0))
    assert ctx.scale("brax_flags") == pytest.approx(1.0)
    assert run.peer_options(gpu=False) == {}
    assert run.peer_options(gpu=True) == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert S.PEER_XLA_FLAGS == "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


def test_ratios_are_to_the_faster_of_each_peer_pair():
    row = _row(brax=100.0, brax_flags=150.0, single_jit=330.0, single_jit_flags=300.0, hand_pipelined=250.0,
               rose_jax=450.0)
    s = report.summarize(row)
    assert s["best_baseline"] == "single_jit" and s["ratio"] == pytest.approx(450 / 330)
    assert s["vs_brax"]["best"] == "brax_flags" and s["ratio_vs_brax"] == pytest.approx(3.0)
    assert s["vs_single_jit"]["best"] == "single_jit" and s["ratio_vs_single_jit"] == pytest.approx(450 / 330)
    assert s["informed_peer"] == "single_jit" and s["informed_peer_env_steps_per_s"] == 330.0
    assert report.pair_cell(row, "brax") == "3.00x ((a') Brax + flag)"
    assert report.peer_cells(report.with_peer_fields(row)) == ["330 (1.36x)", "not measured"]
    text = report.headline({"rows": [row]}, "x.json")
    line = next(ln for ln in text.splitlines() if ln.startswith("| r |"))
    assert "| 1.36x | 3.00x ((a') Brax + flag) | 1.36x ((b) single-jit) |" in line
    assert line.endswith("| 330 (1.36x) | not measured |")
    # the flagged single-jit faster: every ratio against it; a failed (a') leaves (a) alone, said so,
    # and that pair is not the informed peer
    row = _row(brax=100.0, brax_flags="error", single_jit=300.0, single_jit_flags=400.0, rose_jax=420.0)
    s = report.summarize(row)
    assert s["ratio"] == pytest.approx(420 / 400) and s["ratio_vs_single_jit"] == pytest.approx(420 / 400)
    assert s["ratio_vs_brax"] == pytest.approx(4.2) and s["vs_brax"]["informed"] is False
    assert report.pair_cell(row, "brax") == "4.20x ((a) Brax only; (a') error)"
    assert s["informed_peer"] == "single_jit_flags"
    # rows measured before the informed-peer method: no pair in full, so "not measured"
    old = _row(brax=100.0, single_jit=200.0, rose_jax=190.0)
    assert report.peer_fields(old)["informed_peer_env_steps_per_s"] is None
    assert report.peer_cells(report.with_peer_fields(old)) == ["not measured", "not measured"]
    assert report.pair_cell(old, "single_jit") == "0.95x ((b) single-jit only; (b') not measured)"
    assert report.pair_cell(_row(single_jit=1.0), "brax") == "—"
    md = report.markdown({"rows": [row, old]})
    assert "(a') Brax + flag" in md and "4.20x ((a) Brax only; (a') error)" in md


def test_brax_flags_child_failure_or_timeout_is_an_error_record():
    """(a')'s child process: a row it cannot find (it exits 1 with its error) and a timeout (killed)
    are the variant's error records, never an exception of the suite."""
    from benchmarks.suite import run

    lines = []
    ctx = run.Context("tiny", None, False, (False, ""), False, None, lines.append)
    w = dataclasses.replace(S.get("tiny").workloads[2], num_envs=32)  # not a row of the tiny suite
    rec = run.run_brax_flags(run.Row(w, None, None, None, None), ctx, timeout_s=60)
    assert rec["status"] == "error" and "no row named 'ppo-fast-32-2x16'" in rec["error"], rec
    assert rec["returncode"] == 1 and S.PEER_XLA_FLAGS in rec["xla_flags"]
    assert "--child-brax" in rec["command"]
    rec = run.run_brax_flags(run.Row(w, None, None, None, None), ctx, timeout_s=0.01)
    assert rec["status"] == "error" and "timed out" in rec["error"] and rec["returncode"] is None


# ---------------------------------------------------------------------------------------------
# README block


def test_replace_block_touches_only_the_marked_block():
    text = "# T\n\nintro\n<!-- RESULTS -->\nold table\n<!-- /RESULTS -->\n\n## After\nkeep me\n"
    new = report.replace_block(text, "NEW TABLE")
    assert new == "# T\n\nintro\n<!-- RESULTS -->\nNEW TABLE\n<!-- /RESULTS -->\n\n## After\nkeep me\n"
    assert report.replace_block(new, "NEW TABLE") == new  # idempotent


def test_replace_block_adds_a_missing_closing_marker_and_keeps_what_follows():
    assert (
        report.replace_block("head\n<!-- RESULTS -->", "T")
        == "head\n<!-- RESULTS -->\nT\n<!-- /RESULTS -->\n"
    )
    out = report.replace_block("a\n<!-- RESULTS -->\n## Next\ntext\n", "T")
    assert out == "a\n<!-- RESULTS -->\nT\n<!-- /RESULTS -->\n## Next\ntext\n"
    with pytest.raises(ValueError, match="RESULTS") as e:
        report.replace_block("no markers here\n", "T")
    one_line(e)


def test_readme_without_gpu_results_says_so(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- RESULTS -->\n")
    block = report.update_readme(str(readme), "auto", str(tmp_path / "none"))
    assert "No GPU benchmark results yet" in block
    assert readme.read_text() == f"x\n<!-- RESULTS -->\n{block}<!-- /RESULTS -->\n"


def test_merge_parts_keeps_rows_in_part_order(tmp_path):
    for i, names in ((2, ["c"]), (1, ["a", "b"])):
        (tmp_path / f"part-{i}-of-3.json").write_text(
            json.dumps(
                {
                    "suite": "full",
                    "machine": {"backend": "gpu"},
                    "command": f"run {i}",
                    "rows": [{"name": n, "variants": {}} for n in names],
                }
            )
        )
    merged = report.merge_parts(str(tmp_path))
    assert [r["name"] for r in merged["rows"]] == ["a", "b", "c"]
    assert merged["part"] == ["1/3", "2/3"] and merged["complete"] is False


# ---------------------------------------------------------------------------------------------
# The tiny suite end to end (CPU)


def run_suite(args: list[str], timeout: int, **env_overrides) -> str:
    """``python -m benchmarks.suite.run ARGS`` in a subprocess (its compilation cache stays there); stdout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_overrides)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite.run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_mps_client_reruns_the_suite_under_a_daemon_and_stops_it(tmp_path):
    """--mps-client with the MOCK control binary on PATH (the real daemon: device call I on the
    H200): the child runs as the daemon's client (here: --list), the daemon is gone afterwards."""
    from test_mps import FAKE_CONTROL, FAKE_SERVER

    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nvidia-cuda-mps-control", FAKE_CONTROL), ("nvidia-cuda-mps-server", FAKE_SERVER)):
        (bindir / name).write_text(text.format(python=sys.executable))
        (bindir / name).chmod(0o755)
    path = str(bindir) + os.pathsep + os.environ["PATH"]
    out = run_suite(["--suite", "tiny", "--list", "--mps-client"], timeout=120, PATH=path, FAKE_MPS_MODE="ok")
    assert "[mps] daemon up" in out and "suite tiny" in out  # parent started it; the child listed
    pipe = out.split("[mps] daemon up (", 1)[1].split(")", 1)[0]
    assert not os.path.exists(pipe)  # stopped and removed when the child exited
    # without a control binary: one clear line, no traceback
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite.run", "--suite", "tiny", "--list", "--mps-client"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PATH=os.path.dirname(sys.executable), PYTHONPATH=ROOT),
    )
    assert proc.returncode != 0 and "--mps-client" in proc.stderr and "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    # plumbing, not performance: XLA's fast compile (the tiny rows are compile-bound: 87 -> 76 s)
    stdout = run_suite(
        ["--suite", "tiny", "--out", str(out), "--compile-workers", "2"],
        timeout=600,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=FAST_COMPILE_XLA_FLAGS,
    )
    directory = out / "tiny"
    with open(directory / "results.json") as f:
        return json.load(f), directory, stdout


@pytest.mark.slow
def test_tiny_suite_measures_every_variant(tiny_results):
    results, directory, stdout = tiny_results
    assert results["suite"] == "tiny" and results["machine"]["backend"] == "cpu"
    assert "jax" in results["machine"] and "benchmarks.suite.run" in results["command"]
    want = {w.name: w.variants for w in S.get("tiny").workloads}
    assert [r["name"] for r in results["rows"]] == list(want)
    for row in results["rows"]:
        assert set(row["variants"]) == set(want[row["name"]])
        for v, rec in row["variants"].items():
            assert rec["status"] == "ok", (row["name"], v, rec)
            assert rec["env_steps_per_s"] > 0 and len(rec["blocks"]) == row["workload"]["blocks"]
            assert all(b > 0 for b in rec["blocks"])
            assert rec["sm_activity"]["status"] == "unavailable" and "cpu" in rec["sm_activity"]["reason"]
        # Brax's own trainer ran (tiny Brax env), with its training/sps per epoch, as shipped and (a')
        # in a child process with the peer's XLA flag
        for v in ("brax", "brax_flags"):
            if v in row["variants"]:
                assert len(row["variants"][v]["all_epochs_sps"]) == 2 + row["workload"]["blocks"]
        if "brax_flags" in row["variants"]:
            rec = row["variants"]["brax_flags"]
            assert rec["returncode"] == 0 and rec["backend"] == "cpu", rec
            assert S.PEER_XLA_FLAGS in rec["child_xla_flags"] and "--child-brax" in rec["command"]
        # (b'): (b)'s program, on a CPU with no options (and so the same parameters)
        sj = row["variants"]["single_jit_flags"]
        assert sj["options"] == {} and sj["option_set"] == S.PEER_OPTION_SET
        assert sj["max_abs_diff_vs_single_jit"] == 0.0 and sj["precompile_s"] > 0
        # same results as the single-jit loop: the hand pipeline up to per-group float rounding
        for v in ("hand_pipelined", "rose_jax"):
            if v in row["variants"]:
                assert row["variants"][v]["max_abs_diff_vs_single_jit"] <= 1e-5, (row["name"], v)
        # (b) and (c) were compiled ahead of time (2 rows at a time), their compile in warmup_s
        for v in ("single_jit", "hand_pipelined"):
            if v in row["variants"]:
                rec = row["variants"][v]
                assert "precompile_error" not in rec, rec
                assert 0 < rec["precompile_s"] <= rec["warmup_s"], (row["name"], v, rec)
        rj = row["variants"]["rose_jax"]
        assert rj["search_overhead_s"] > 0 and isinstance(rj["plan"], list) and rj["report"]["candidates"]
        if row["workload"]["unit"] == "epoch":
            w = row["workload"]
            # a call is epochs_per_block epochs of K iterations (training steps only)
            per_call = row["env_steps_per_iteration"] * w["iterations_per_block"] * w["epochs_per_block"]
            assert row["variants"]["single_jit"]["env_steps_per_block"] == per_call
            # (d) searched over the epoch: the offload candidate was cut out of its jaxpr and timed
            (cand,) = rj["report"]["candidates"]
            assert cand["label"].startswith("offload_component") and cand["legal"] and cand["speedup"] > 0
            if "brax" in row["variants"]:  # Brax's train() evaluated, and its time counts
                brax = row["variants"]["brax"]
                assert "evaluation of 4 envs" in brax["note"] and len(brax["blocks"]) == w["blocks"]
    assert "ratio" in stdout and "| workload |" in stdout  # the short table printed last


@pytest.mark.slow
def test_tiny_suite_ratio_is_rose_jax_over_best_baseline(tiny_results):
    results, _, _ = tiny_results
    for row in results["rows"]:
        baselines = {v: row["variants"][v]["env_steps_per_s"] for v in S.BASELINES if v in row["variants"]}
        best = max(baselines, key=baselines.get)
        s = row["summary"]
        assert s["best_baseline"] == best
        assert s["ratio"] == pytest.approx(row["variants"]["rose_jax"]["env_steps_per_s"] / baselines[best])
        for peer, flagged in S.INFORMED_PEERS.items():  # each peer: the faster of its pair
            if peer in row["variants"]:
                pair = max(baselines[peer], baselines[flagged])
                assert s[f"ratio_vs_{peer}"] == pytest.approx(row["rose_env_steps_per_s"] / pair)
        assert row["informed_peer_env_steps_per_s"] == s["informed_peer_env_steps_per_s"] is not None
    # the cartpole row defines a return threshold and the tiny suite measures it
    ttt = results["rows"][0]["variants"]["single_jit"]["time_to_threshold"]
    assert ttt["threshold"] == 90.0 and ttt["seconds"] >= 0 and isinstance(ttt["reached"], bool)


@pytest.mark.slow
def test_tiny_suite_writes_table_plot_and_readme_block(tiny_results, tmp_path):
    results, directory, _ = tiny_results
    md = (directory / "results.md").read_text()
    for row in results["rows"]:
        assert row["name"] in md
        assert f"{row['summary']['ratio']:.3f}" in md
    png = (directory / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    # README regeneration on a temp copy of the real README: only the marked block changes
    with open(report.README) as f:
        original = f.read()
    copy = tmp_path / "README.md"
    copy.write_text(original + "\n## Appendix\nuntouched\n")
    block = report.update_readme(str(copy), "tiny", str(directory.parent))
    new = copy.read_text()
    start = original.index(report.START) + len(report.START)
    assert new.startswith(original[:start])  # everything before the opening marker is unchanged
    assert new.endswith("\n## Appendix\nuntouched\n") and new.count(report.END) == 1
    inside = new[start : new.index(report.END)]
    assert inside.strip() == block.strip()
    for row in results["rows"]:
        assert row["name"] in inside and f"{row['summary']['ratio']:.2f}x" in inside
    assert "results.json" in inside and "benchmarks.suite.report --readme" in inside
    # regenerating from the JSON gives the same block (nothing typed by hand)
    assert report.update_readme(str(copy), "tiny", str(directory.parent)) == block and copy.read_text() == new
    with open(report.README) as f:
        assert f.read() == original  # the real README is not touched


@pytest.mark.slow
def test_readme_auto_shows_the_iteration_suite_then_the_epoch_suite(tiny_results, tmp_path):
    results, _, _ = tiny_results
    is_epoch = [(r.get("workload") or {}).get("unit") == "epoch" for r in results["rows"]]
    assert any(is_epoch) and not all(is_epoch)
    root = tmp_path / "suites"
    for name, rows in (
        ("quick", [r for r, e in zip(results["rows"], is_epoch, strict=True) if not e]),
        ("epoch", [r for r, e in zip(results["rows"], is_epoch, strict=True) if e]),
    ):
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(json.dumps({**results, "suite": name, "rows": rows}))
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{report.START}\nold\n{report.END}\n")
    block = report.update_readme(str(readme), "auto", str(root))
    quick_at, epoch_at = block.index("Suite `quick`"), block.index("Suite `epoch`")
    assert quick_at < epoch_at and "old" not in readme.read_text()
    for row, e in zip(results["rows"], is_epoch, strict=True):
        assert (block.index(f"| {row['name']} |") > epoch_at) == e
    assert "evaluation included" in block[epoch_at:] and "evaluation included" not in block[:epoch_at]
    assert "SM % best -> rose-jax" in block
    # a part of the full grid does not replace the quick table; all parts of it do
    (root / "full").mkdir()
    full = {**results, "suite": "full", "rows": results["rows"][:1]}
    (root / "full" / "part-1-of-2.json").write_text(json.dumps(full))
    assert report.readme_block("auto", str(root)) == block
    (root / "full" / "part-2-of-2.json").write_text(json.dumps({**full, "rows": results["rows"][1:2]}))
    both = report.readme_block("auto", str(root))
    assert both.startswith("Suite `full`") and "Suite `quick`" not in both and "Suite `epoch`" in both
    shutil.rmtree(root / "full")
    # with only the epoch suite, auto still shows it; a named suite without rows is an error
    (root / "quick" / "results.json").unlink()
    assert report.readme_block("auto", str(root)).startswith("Suite `epoch`")
    with pytest.raises(ValueError, match="quick"):
        report.readme_block("quick", str(root))


# ---------------------------------------------------------------------------------------------
# Experiments: their CPU smoke runs (--tiny / --dry-run) end to end


@pytest.mark.slow
def test_activity_profile_runs_tiny_on_cpu(tmp_path):
    """benchmarks.experiments.activity_profile end to end with --tiny (PPO on pendulum): files and table."""
    from benchmarks.experiments import activity_profile
    from rose_jax import profile as rp

    rows = activity_profile.main(["--tiny", "--algos", "ppo", "--out", str(tmp_path), "--compile-cache", ""])
    (row,) = rows
    assert row["name"] == "ppo_pendulum_8" and row["outputs_match"] is True, row
    for suffix in (".timeline.json", ".windows.md", ".windows.json", ".png"):
        assert os.path.getsize(tmp_path / f"ppo_pendulum_8{suffix}") > 0
    assert "ppo_pendulum_8" in (tmp_path / "summary.md").read_text()
    tl = rp.load(tmp_path / "ppo_pendulum_8.timeline.json")
    assert {"rollout/sim", "rollout/policy", "update/loss"} <= set(tl.paths(level=2))
    if not ON_GPU:
        assert row["mean_sm_util"] is None and tl.activity is None


def test_sampler_overhead_on_cpu(tmp_path):
    """sampler_overhead: iterations per block follow --overhead-block-s, files written under --name;
    on a CPU the sampler reports why it has no numbers (timing off/on is then not compared)."""
    from benchmarks.experiments import sampler_overhead

    argv = ["--tiny", "--algos", "sac", "--out", str(tmp_path), "--compile-cache", "", "--name", "s1"]
    (row,) = sampler_overhead.main(argv + ["--overhead-block-s", "1.0", "--overhead-rounds", "1"])
    assert row["name"] == "sac_pendulum_8" and row["rounds"] == 1
    # the block-length rule raised the iterations above --tiny's 3 to cover ~1 s at the calibrated
    # iteration time (a block this long keeps the rule visible on a loaded 2-core machine, where one
    # iteration took over 50 ms). Checked against the calibration the rule used, not the timed
    # blocks' rate: that moves with the machine's load between the two (0.75 s off under xdist)
    calib_ms = row["calibration_iteration_ms"]
    assert row["iterations_per_block"] > 3
    assert row["iterations_per_block"] == max(3, math.ceil(1.0 / (calib_ms * 1e-3))), row
    assert row["iteration_ms_sampler_off"] > 0
    assert "sac_pendulum_8" in (tmp_path / "s1.md").read_text()
    assert json.loads((tmp_path / "s1.json").read_text())["rows"][0]["name"] == "sac_pendulum_8"
    if not ON_GPU:
        assert row["sampler_overhead_pct"] is None and "NVML" in row["reason"]


@pytest.mark.slow
def test_optimizer_speedup_runs_tiny_on_cpu(tmp_path):
    """optimizer_speedup --tiny (SAC on pendulum, one unroll candidate): a row with a plan decision,
    equal results, and the JSON / Markdown / PNG written."""
    from benchmarks.experiments import optimizer_speedup

    argv = ["--tiny", "--algos", "sac", "--sac-candidates", "unroll:train_steps:2", "--out", str(tmp_path)]
    (row,) = optimizer_speedup.main(argv + ["--compile-cache", ""])
    assert row["name"] == "sac_pendulum_8" and row["equal"] is True, row
    assert row["baseline_steps_per_s"] > 0 and row["optimized_steps_per_s"] > 0
    assert row["report"]["candidates"] and isinstance(row["plan"], list)
    assert json.loads((tmp_path / "optimize.json").read_text())["rows"][0]["name"] == "sac_pendulum_8"
    assert "sac_pendulum_8" in (tmp_path / "optimize.md").read_text()
    assert (tmp_path / "optimize.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_iteration_levers_runs_tiny_on_cpu(tmp_path):
    """iteration_levers --tiny: each variant timed against the baseline, and unrolling the physics
    scans gives the baseline's state (one iteration, up to float rounding)."""
    from benchmarks.experiments import iteration_levers

    rows = iteration_levers.main(["--tiny", "--variants", "base", "unroll_sim", "--out", str(tmp_path)])
    assert [(r["algo"], r["variant"]) for r in rows] == [
        ("ppo", "base"), ("ppo", "unroll_sim"), ("sac", "base"), ("sac", "unroll_sim")
    ]
    assert all(r["env_steps_per_s"] > 0 and r["max_abs_diff"] <= 1e-5 for r in rows), rows
    assert "unroll_sim" in (tmp_path / "levers.md").read_text()


def test_kernels_from_trace_writes_the_kernel_report(tmp_path):
    """kernels_from_trace on a stored H200 trace (tests/data): the report under the config's name."""
    from test_profile import FIXTURE, _xspace_from_fixture

    from benchmarks.experiments import kernels_from_trace

    trace = tmp_path / "traces" / "ppo_ant_1024" / "plugins" / "profile" / "run" / "vm.xplane.pb"
    trace.parent.mkdir(parents=True)
    with open(FIXTURE) as f:
        trace.write_bytes(_xspace_from_fixture(json.load(f)))
    kt = kernels_from_trace.main([str(trace), "--out", str(tmp_path / "k.md"), "--trace-label", "t.pb"])
    text = (tmp_path / "k.md").read_text()
    assert kt.available and kt.events
    assert text.startswith("# ppo_ant_1024: kernel busy time per component\n\ntrace: t.pb\n")
    assert "rollout/sim" in text and "## longest gaps between kernels" in text
    with pytest.raises(ValueError, match="xplane.pb"):
        kernels_from_trace.main([str(tmp_path / "k.md"), "--out", str(tmp_path / "x.md")])


@pytest.mark.slow
def test_mps_experiment_dry_run_on_cpu(tmp_path):
    """python -m benchmarks.experiments.mps --dry-run (CPU workers, no MPS): every phase runs and
    is written; the phases' Markdown sections and the summary are there."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.mps", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
        env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "mps_gpu_dry_run.json").read_text())
    assert res["errors"] == {} and res["dry_run"] and not res["mps"]["used"]
    assert res["rates"]["tflops"]["q30"] > 0 and res["rates"]["overlap_s"] > 0
    assert all(v["shm"]["equal"] for v in res["transfer"]["sizes"].values())
    assert res["search"]["measured_join_s"]["chosen"] > 0 and len(res["search"]["validated_quotas"]) == 2
    md = (tmp_path / "mps_gpu_dry_run.md").read_text()
    assert "## Two workers under MPS" in md and "## Round trip" in md and "## Slack-aware" in md
    assert "summary:" in proc.stdout and "round trip 1 KB shm" in proc.stdout


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.slow
def test_quick_mjcf_row_on_gpu_reports_sm_activity(tmp_path):
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip(
            "needs a GPU (runs one quick-suite row on the H200: python -m benchmarks.suite.run --suite quick)"
        )
    run_suite(
        ["--suite", "quick", "--only", "mjx_swimmer", "--out", str(tmp_path), "--no-budget"], timeout=600
    )
    with open(tmp_path / "quick" / "results.json") as f:
        row = json.load(f)["rows"][0]
    for v in ("single_jit", "rose_jax"):
        rec = row["variants"][v]
        assert rec["status"] == "ok" and rec["env_steps_per_s"] > 0
        act = rec["sm_activity"]
        assert act["status"] == "ok" or "NVML" in act.get("reason", "") or "GPM" in act.get("reason", "")
        if act["status"] == "ok":
            assert 0.0 <= act["mean_sm_util"] <= 100.0
    assert math.isfinite(row["summary"]["ratio"])


def test_readme_block_lists_experiment_results(tmp_path):
    """Synthetic results files (hand-written numbers, not measurements) in the experiments' schema:
    the README block gains one table per experiment, with the speedup, equality and plan."""
    import json

    (tmp_path / "overlap").mkdir()
    (tmp_path / "overlap" / "results.json").write_text(json.dumps({
        "date": "2026-01-01", "machine": {"gpu": "GPU X", "jax": "0.11.2"},
        "rows": [{"workload": "sac-ant-128", "baseline_env_steps_per_s": 100.0, "rose_env_steps_per_s": 150.0,
                  "speedup": 1.5, "equal": True, "plan": "options(concurrent)", "baseline": "Brax train"},
                 {"workload": "ppo-ant-2048", "skipped": "budget"}],
    }))
    (tmp_path / "brax_parity").mkdir()
    (tmp_path / "brax_parity" / "results.json").write_text(json.dumps({
        "machine": {"gpu": "GPU X", "jax": "0.11.2", "date": "2026-01-01"},
        "summary": [{"algo": "ppo", "env": "ant", "num_timesteps": 50_000_000, "runs": "2/1",
                     "brax_return": 1500.4, "rose_jax_return": 2300.0,
                     "brax_s_to_brax_final": 140.0, "rose_jax_s_to_brax_final": None}],
    }))
    (tmp_path / "loops").mkdir()
    (tmp_path / "loops" / "results.json").write_text(json.dumps({
        "date": "2026-01-01", "machine": {"gpu": "GPU X", "jax": "0.11.2"},
        "rows": [{"workload": "physics/hopper", "baseline_env_steps_per_s": 100.0,
                  "rose_env_steps_per_s": 130.0, "speedup": 1.3, "equal": True, "plan": "options_no_loops"},
                 {"workload": "ppo_iteration/hopper", "baseline_env_steps_per_s": 100.0,
                  "rose_env_steps_per_s": 130.0, "speedup": 1.3, "equal": True, "plan": "options_no_loops",
                  "brax_env_steps_per_s": 104.0},
                 # nothing kept: nothing compared, equal null ("not checked")
                 {"workload": "ppo_eval/hopper", "baseline_env_steps_per_s": 100.0,
                  "rose_env_steps_per_s": 100.0, "speedup": 1.0, "equal": None, "plan": "none"}],
    }))
    block = report.readme_block("auto", str(tmp_path / "suite"))
    assert "| sac-ant-128 | 100 (Brax) | 150 | 1.50x | True | options(concurrent) |" in block
    # Brax's own trainer beside the loops rows that timed it, blank where it was not timed
    assert "| ppo_iteration/hopper | 100 | 130 | 1.30x | True | options_no_loops | 104 (1.25x) |" in block
    assert "| physics/hopper | 100 | 130 | 1.30x | True | options_no_loops |  |" in block
    assert "| ppo_eval/hopper | 100 | 100 | 1.00x | not checked | none |  |" in block
    assert "ppo-ant-2048" not in block  # a skipped row has no numbers to show
    assert "| ppo ant | 50,000,000 | 2/1 | 1500 | 2300 | 140 | - |" in block


def test_multiprocess_headline_reports_sweep_groups_and_offload_and_skips_unmeasured_rows(tmp_path):
    """The README's several-processes table is generated from the results files: the sweep's modes
    against one after another, measured env-group and offload rows; skipped rows leave no line."""
    import json

    from benchmarks.suite import report

    base = tmp_path / "multiprocess"
    base.mkdir()
    machine = {"date": "2026-12-04 08:23 UTC", "gpu": "NVIDIA H200", "jax": "0.11.2"}
    sweep = {
        "machine": machine,
        "workload": {"algo": "ppo", "env": "ant", "seeds": 4, "config": {"num_envs": 2048}},
        "summary": {"sequential_rate": 500_000.0, "vmapped_rate": 1_150_000.0, "vmapped_speedup": 2.3},
    }
    groups = {
        "machine": machine,
        "rows": [
            {"name": "groups_4x32", "kind": "groups", "num_envs": 2048, "policy": "4x32", "groups": 2,
             "fused_ms": 44.7, "processes_ms": 74.8, "speedup": 44.7 / 74.8},
            {"name": "offload_2048", "kind": "offload", "num_envs": 2048, "epochs_per_timed_run": 3,
             "baseline_s": 2.62, "offload_s": 2.11, "offload_quota_s": 2.14, "speedup_no_quota": 2.62 / 2.11,
             "speedup_quota": 2.62 / 2.14, "quotas": [30, 70], "quota_status": "not applied"},
            {"name": "offload_8192", "kind": "offload", "skipped": "time budget"},
        ],
    }
    (base / "sweep.json").write_text(json.dumps(sweep))
    (base / "env_groups.json").write_text(json.dumps(groups))
    text = report.multiprocess_headline(str(tmp_path))
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "workload" not in ln]
    assert len(lines) == 4
    assert "vmapped" in lines[0] and "500,000" in lines[0] and "1,150,000" in lines[0] and "2.30x" in lines[0]
    assert "2 env groups in processes" in lines[1] and "0.60x" in lines[1]
    # the offload row without quotas and the quota split with whether the plan applied it
    assert "offloaded, no quotas | 2.62 s/epoch | 2.11 s/epoch | 1.24x" in lines[2]
    assert "quotas [30, 70] (driver, worker): not applied" in lines[3] and "1.22x" in lines[3]
    assert "2026-12-04 08:23 UTC on NVIDIA H200" in text and "8192" not in text
    assert report.multiprocess_headline(str(tmp_path / "none")) is None


# ---------------------------------------------------------------------------------------------
# benchmarks/README.md lists every committed results file


def test_benchmarks_readme_lists_every_committed_results_file():
    """Every file under benchmarks/results (git's tracked files) is in a row of benchmarks/README.md's
    '## Results' table, with the command that wrote it; a listed file that is gone fails too.
    `python -m benchmarks.suite.report --results-files` prints each file with the command it records."""
    missing, stale = report.results_listing_gaps()
    assert not missing, f"benchmarks/README.md '## Results' does not list: {missing}"
    assert not stale, f"benchmarks/README.md '## Results' lists files that are not committed: {stale}"


def test_results_listing_expands_braces_and_reads_recorded_commands(tmp_path):
    import json

    results = tmp_path / "results"
    (results / "exp" / "logs").mkdir(parents=True)
    (results / "exp" / "results.json").write_text(json.dumps({"machine": {"command": "python -m x --a"}}))
    (results / "exp" / "results.md").write_text("# t\n\nCommand: `python -m x --a`\n")
    (results / "exp" / "results.png").write_bytes(b"\x89PNG")
    (results / "exp" / "logs" / "run.log").write_text("[0.1s] start\n")
    (results / "other.json").write_text(json.dumps({"argv": ["python", "y.py", "--b"]}))
    readme = tmp_path / "README.md"
    readme.write_text(
        "## Commands\n\n| `results/not-a-listing.json` | x |\n\n"
        "## Results\n\n| results | command |\n|---|---|\n"
        "| `results/exp/results.{json,md,png}`, `results/gone.json` | `python -m x` (`results/other.json`)\n"
    )
    assert report.expand_braces("a/{b,c}.{json,md}") == ["a/b.json", "a/b.md", "a/c.json", "a/c.md"]
    missing, stale = report.results_listing_gaps(str(readme), str(results))
    assert missing == ["results/exp/logs/run.log", "results/other.json"]  # only a row's first cell lists
    assert stale == ["results/gone.json"]
    assert report.recorded_command(str(results / "exp" / "results.json")) == "python -m x --a"
    assert report.recorded_command(str(results / "exp" / "results.md")) == "python -m x --a"
    assert report.recorded_command(str(results / "other.json")) == "python y.py --b"
    assert report.recorded_command(str(results / "exp" / "logs" / "run.log")) is None
    table = report.results_files_table(str(results))
    assert "| `results/exp/results.json` | python -m x --a |" in table
    assert "| `results/exp/results.png` | - |" in table


def test_multiprocess_headline_puts_end_to_end_beside_the_timed_window(tmp_path):
    """The sweep's rows say which rate they are: the timed window (compilation excluded) and, where the
    phases recorded it, end to end (all env steps over the whole wall time) against the same for the
    runs one after another. Synthetic numbers."""
    import json

    base = tmp_path / "multiprocess"
    base.mkdir()
    (base / "sweep.json").write_text(json.dumps({
        "machine": {"date": "2026-01-01 00:00 UTC", "gpu": "GPU X", "jax": "0.11.2"},
        "workload": {"algo": "ppo", "env": "ant", "seeds": 4, "config": {"num_envs": 2048},
                     "iterations_per_run": 150, "env_steps_per_iteration": 20480},
        "summary": {"sequential_rate": 500.0, "vmapped_rate": 1000.0, "vmapped_speedup": 2.0,
                    "mps_rate": 900.0, "mps_speedup": 1.8},
        "phases": {"sequential": {"end_to_end_rate": 200.0}, "vmapped": {"end_to_end_rate": 230.0},
                   "mps": {"end_to_end_rate": 170.0, "sweep": {"quotas": [25, 25, 25, 25]}}},
    }))
    text = report.multiprocess_headline(str(tmp_path))
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "workload" not in ln]
    what, mps = "| 4 seeds of PPO ant 2048 envs:", "MPS processes, slack-aware quotas (25/25/25/25 %)"
    assert lines == [
        f"{what} vmapped (one program), timed | 500 | 1,000 | 2.00x | not measured | the next row |",
        f"{what} vmapped (one program), end to end | 200 | 230 | 1.15x | not measured | this row |",
        f"{what} {mps}, timed | 500 | 900 | 1.80x | not measured | the next row |",
        f"{what} {mps}, end to end | 200 | 170 | 0.85x | not measured | this row |",
    ]
    assert "each run 150 iterations (3,072,000 env steps)" in text


def test_machine_info_names_the_physical_gpu(tmp_path, monkeypatch):
    """``machine_info`` records the GPU's UUID beside its name (rows of separate calls on one warm
    machine then show they shared it). A stand-in `nvidia-smi` script on PATH plays the GPU on this
    CPU machine; without one (the CPU's own case) neither field is written."""
    from benchmarks import common

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text('#!/bin/sh\ncase "$1" in\n  --query-gpu=uuid) echo GPU-1234 ;;\n'
                      '  *) echo "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB" ;;\nesac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    info = common.machine_info(jax_devices=False)
    assert info["gpu"].startswith("NVIDIA H100") and info["gpu_uuid"] == "GPU-1234"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    info = common.machine_info(jax_devices=False)
    assert "gpu" not in info and "gpu_uuid" not in info
