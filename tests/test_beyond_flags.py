"""benchmarks/experiments/beyond_flags.py without a GPU: its variants name real transforms, bad
variants are one-line argparse errors, and its files are written from hand-made rows."""

from __future__ import annotations

import json
import os

import pytest

import helpers_optimize as H
from benchmarks.experiments import beyond_flags as B


def test_variants_name_the_library_transforms():
    assert B.transform_of("flags_only") is None and B.transform_of("set:cublaslt") is None
    assert B.transform_of("hoist").name == "hoist_independent"
    assert B.transform_of("inplace:collect").name == "update_in_place"
    t = B.transform_of("twins:train_steps/_grad_step")
    assert t.name == "batch_twins" and dict(t.params)["where"] == "train_steps/_grad_step"
    t = B.transform_of("unroll:4")
    assert t.name == "unroll_scans" and dict(t.params)["factor"] == 4
    t = B.transform_of("stack")
    assert t.name == "stack_carries" and dict(t.params)["where"] is None
    t = B.transform_of("stack:collect/sim/_fun")
    assert t.name == "stack_carries" and dict(t.params)["where"] == "collect/sim/_fun"


@pytest.mark.parametrize("bad", ["nonsense", "set:no_such_set", "unroll:1", "unroll:x", "twins:", "stack:"])
def test_bad_variant_is_an_argparse_error(bad, capsys):
    with pytest.raises(SystemExit):
        B.main(["--variants", f"flags_only,{bad}", "--out", "/nonexistent"])
    assert "unknown variant" in capsys.readouterr().err


def test_files_from_rows(tmp_path):
    rows = [
        {
            "workload": "sac-hopper",
            "variant": "flags_only",
            "env_steps_per_s": 9600.0,
            "spread_env_steps_per_s": [9500.0, 9700.0],
            "speedup_vs_flags_only": 1.0,
            "compile_s": 30.0,
        },
        {
            "workload": "sac-hopper",
            "variant": "hoist",
            "env_steps_per_s": 9800.0,
            "spread_env_steps_per_s": [9700.0, 9900.0],
            "speedup_vs_flags_only": 1.02,
            "compile_s": 31.0,
            "equal": False,
            "within_tolerance": True,
            "max_abs_diff": 1e-7,
            "legal": "moved",
        },
        {
            "workload": "sac-hopper",
            "variant": "twins",
            "env_steps_per_s": 9900.0,
            "spread_env_steps_per_s": [9800.0, 10000.0],
            "speedup_vs_flags_only": 1.03,
            "equal": False,
            "within_tolerance": True,
            "learning_check": {
                "passed": True,
                "p_value": 0.41,
                "mean_reference": -180.2,
                "mean_candidate": -178.9,
            },
        },
    ]
    B.write(str(tmp_path), rows, "python -m benchmarks.experiments.beyond_flags")
    data = json.load(open(tmp_path / "results.json"))
    assert data["rows"] == rows and "machine" in data and data["command"].startswith("python -m")
    md = open(tmp_path / "results.md").read()
    assert "| sac-hopper | - | hoist | 9,800 (9,700-9,900) | 1.020 |" in md
    assert "passed: p=0.41, means -180.2 vs -178.9" in md
    assert os.path.exists(tmp_path / "results.png")


def test_learning_check_only_where_the_tolerance_asks_and_failures_are_rows_notes(monkeypatch):
    """A stand-in checker (this unit test's mock; the real check trains in
    tests/test_learning_check.py): twins (reassociation tolerance) is checked for the steps
    asked, hoist (fusion tolerance) and flags_only are not, and a checker that raises
    becomes the row's note."""
    import types

    from algos import equivalence
    from rose_jax.optimize.learning import LearningCheck

    seen = []

    def checker(config, env, steps=None):
        def check(t):
            seen.append((t.name, steps))
            return LearningCheck((1.0,) * 5, (1.0,) * 5, 1.0, 1.0, 1.0, 0.0, True, "learns alike")

        return check

    monkeypatch.setattr(equivalence, "checker", checker)
    job = types.SimpleNamespace(config=H.tiny_ppo_config(), env=None)
    assert B.learning_check_fields(job, B.transform_of("twins"), 4096)["learning_check"]["passed"] is True
    assert B.learning_check_fields(job, B.transform_of("hoist"), 4096) == {}
    assert B.learning_check_fields(job, None, 4096) == {}
    assert seen == [("batch_twins", 4096)]

    def broken(config, env, steps=None):
        raise RuntimeError("no seeds")

    monkeypatch.setattr(equivalence, "checker", broken)
    note = B.learning_check_fields(job, B.transform_of("twins"), 4096)["learning_check"]
    assert note["passed"] is None and "RuntimeError: no seeds" in note["reason"]


def _run(rate, rc=0, **kw):
    return {"steady_env_steps_per_s": rate, "returncode": rc, "interval_rates": [rate] * 3, **kw}


def test_acceptance_row_against_the_faster_peer_with_the_plans_tolerance_and_check(tmp_path):
    check = {"passed": True, "p_value": 0.4, "mean_reference": 10.0, "mean_candidate": 10.2}
    kept = {"label": "batch_twins(where=None)", "kept": True, "learning_check": check}
    entry = {
        "plan": [
            {"name": "split_compile", "label": "split_compile()", "tolerance": {"rtol": 0.0, "atol": 0.0}},
            {"name": "batch_twins", "label": "batch_twins()", "tolerance": {"rtol": 1e-2, "atol": 0.0}},
        ],
        "report": {"equal": True, "max_abs_diff": 1e-5, "search_time_s": 150.0, "candidates": [kept]},
    }
    runs = {
        "peer_default": _run(6800.0),
        "peer_flags": _run(9600.0),
        "flags_only": _run(9500.0, plan_cache=[]),
        "rose": _run(15000.0, plan_cache=[entry]),
    }
    row = B.acceptance_row("sac-hopper", "sac", 100_000, runs)
    assert row["speedup_vs_informed_peer"] == pytest.approx(15000 / 9600, abs=1e-3)  # the faster peer
    assert row["speedup_vs_flags_only"] == pytest.approx(15000 / 9500, abs=1e-3)
    assert row["target"] == 1.5 and row["target_met"] is True
    assert row["tolerance"]["rtol"] == 1e-2  # the loosest of the plan's transforms
    assert row["learning_check"]["passed"] is True and row["equal"] is True
    # a failed peer run does not count as the informed peer; a miss is a miss
    runs["peer_flags"] = _run(20000.0, rc=1, error="boom")
    runs["rose"] = _run(9700.0, plan_cache=[])
    row = B.acceptance_row("sac-hopper", "sac", 100_000, runs)
    assert row["peer_flags_env_steps_per_s"] is None and row["errors"] == {"peer_flags": "boom"}
    assert row["speedup_vs_informed_peer"] == pytest.approx(9700 / 6800, abs=1e-3)
    assert row["target_met"] is False
    assert row["plan"] == ["baseline (no candidate kept)"] and row["equal"] is True
    assert row["tolerance"]["rtol"] == 0.0
    # faster than the one peer that ran: not "met" until both ran; a run cut short has no plan
    runs["rose"] = _run(30000.0, rc=None, error="timed out after 520s", plan_cache=[])
    cut = B.acceptance_row("sac-hopper", "sac", 100_000, {"peer_flags": _run(9600.0), "rose": _run(20000.0)})
    assert cut["speedup_vs_informed_peer"] > 1.5 and cut["target_met"] is None
    cut = B.acceptance_row("sac-hopper", "sac", 100_000, {"peer_flags": _run(9600.0), "rose": runs["rose"]})
    assert cut["plan"] == ["not known: the run did not finish"] and cut["equal"] is None
    assert cut["tolerance"] is None and cut["rose_env_steps_per_s"] is None
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in row.items() if k != "_plan"}], jax_devices=False)
    md = open(os.path.join(tmp_path, "results.md")).read()
    assert "no (miss)" in md and "Issue 32's table" in md
    written = json.load(open(os.path.join(tmp_path, "results.json")))
    assert written["acceptance"][0]["workload"] == "sac-hopper"


def test_acceptance_bad_peer_variant_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        B.main(["--acceptance", "--peer-variants", "peer_other", "--out", "/nonexistent"])
    assert "unknown peer variant" in capsys.readouterr().err


def test_acceptance_writes_the_row_after_each_run(tmp_path, monkeypatch):
    """Stand-in runs (this unit test's mock of the child processes; the CPU smoke of the real ones
    is `beyond_flags --acceptance --smoke`): after each run the row so far is on disk, marked
    partial, and a run that raises leaves the earlier runs' numbers written and no temporary cache."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    seen = []

    def peer(name, v, steps, smoke, timeout, log_path):
        return {"steady_env_steps_per_s": 1000.0, "returncode": 0}

    made = []

    def rose(name, variant, steps, smoke, caches, timeout, extra, log_path):
        seen.append(json.load(open(tmp_path / "results.json"))["acceptance"][-1])
        made.extend(caches.values())
        assert all(os.path.isdir(d) for d in caches.values())
        if variant == "rose_optimize_first":
            raise RuntimeError("the call ended")
        return {"steady_env_steps_per_s": 1100.0, "returncode": 0}

    monkeypatch.setattr(ip, "peer_run", peer)
    monkeypatch.setattr(ip, "rose_run", rose)
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=["peer_flags"],
                              rose_variants=["flags_only", "rose"], run_timeout_s=10.0, optimize_argv=[],
                              profile=False, out=str(tmp_path))
    assert B.run_acceptance(args, ["smoke"], [], [], "cmd") == 0
    assert seen[0]["partial"] and seen[0]["peer_flags_env_steps_per_s"] == 1000.0
    assert seen[1]["flags_only_env_steps_per_s"] == 1100.0
    final = json.load(open(tmp_path / "results.json"))["acceptance"]
    assert len(final) == 1 and "the call ended" in final[0]["error"]
    assert final[0]["flags_only_env_steps_per_s"] == 1100.0  # what was measured stays
    # the runs' temporary caches are gone, the raising run's too
    assert len(made) == 4 and not any(os.path.exists(d) for d in made)
    # a first --optimize run is on disk before the cached run starts (a call cut in the cached
    # run keeps the first run's wall time and search)
    seen.clear()

    def rose2(name, variant, steps, smoke, caches, timeout, extra, log_path):
        written = json.load(open(tmp_path / "results.json"))["acceptance"]
        seen.append(written[-1] if written else None)
        if variant == "rose_optimize_cached":
            raise RuntimeError("the call ended")
        return {"steady_env_steps_per_s": None, "returncode": None, "end_to_end_s": 340.0}

    monkeypatch.setattr(ip, "rose_run", rose2)
    args.rose_variants, args.peer_variants = ["rose", "rose_cached"], []
    os.remove(tmp_path / "results.json")
    B.write(str(tmp_path), [], "cmd", [], jax_devices=False)
    assert B.run_acceptance(args, ["smoke"], [], [], "cmd") == 0
    assert seen[0] is None and seen[-1]["partial"] and seen[-1]["end_to_end_s"]["rose"] == 340.0


def test_acceptance_runs_only_the_rose_variants_asked_for(tmp_path, monkeypatch):
    """Stand-in runs (mock children, as above): ``--rose-variants rose`` runs the --optimize run
    alone, each run told where to stream its log; a bad name is an argparse error."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    ran = []
    monkeypatch.setattr(ip, "peer_run", lambda *a: ran.append(("peer", a[1], a[-1])) or {"returncode": 0})
    monkeypatch.setattr(ip, "rose_run", lambda *a: ran.append(("rose", a[1], a[-1])) or {"returncode": 0})
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=["peer_flags"],
                              rose_variants=["rose"], run_timeout_s=10.0, optimize_argv=[], profile=False,
                              out=str(tmp_path))
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    assert [(k, v) for k, v, _ in ran] == [("peer", "peer_flags"), ("rose", "rose_optimize_first")]
    assert ran[1][2] == os.path.join(str(tmp_path), "logs", "smoke-rose.log")
    with pytest.raises(SystemExit):
        B.main(["--acceptance", "--rose-variants", "fast", "--out", "/nonexistent"])


def test_cached_run_row_takes_its_rate_and_the_first_runs_wall_time(tmp_path, capsys):
    """``rose_cached`` (the same --optimize command on the plan an earlier call's search left): its
    rate is the rose column, and the first run's whole wall time is folded in from the newest earlier
    row with the same plan; a different plan or a cut first run is not folded."""
    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 300.0, "candidates": [],
                        "base_options": {"name": "concurrent_no_loops"}}}
    runs = {"peer_default": _run(200.0), "peer_flags": _run(240.0),
            "rose_cached": _run(300.0, plan_cache=[entry], end_to_end_s=90.0)}
    row = B.acceptance_row("ppo-ant", "ppo", 4_000_000, runs)
    assert row["rose_env_steps_per_s"] == 300.0 and row["rose_run"] == "rose_cached"
    assert row["base_options"] == "concurrent_no_loops"  # the set the search's baseline ran under
    assert row["plan"] == ["offload_component()"] and row["target_met"] is True
    first = {"workload": "ppo-ant", "num_timesteps": 4_000_000, "plan": ["offload_component()"],
             "end_to_end_s": {"rose": 400.0}, "date": "d1", "search_s": 300.0, "command": {"rose": "c"}}
    other = {**first, "plan": ["baseline (no candidate kept)"], "end_to_end_s": {"rose": 10.0}, "date": "d2"}
    cut = {**first, "end_to_end_s": {"rose": 520.0}, "errors": {"rose": "timed out"}, "date": "d3"}
    folded = B.fold_first_run(row, [first, other, cut])
    assert folded["end_to_end_s"]["rose"] == 400.0 and folded["end_to_end_s"]["rose_cached"] == 90.0
    assert folded["first_run"]["date"] == "d1" and folded["first_run"]["search_s"] == 300.0
    assert B.fold_first_run(row, [other, cut]) is row
    # a later cached run folds in the same first run, not the cached run before it
    again = B.fold_first_run(row, [first, {**folded, "date": "d4"}])
    assert again["first_run"]["date"] == "d1" and again["end_to_end_s"]["rose"] == 400.0
    assert "rose_cached 90" in B.end_to_end_cell(folded) and "rose 400" in B.end_to_end_cell(folded)
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in folded.items() if k != "_plan"}], jax_devices=False)
    assert "the rose column is the cached run" in open(os.path.join(tmp_path, "results.md")).read()
    with pytest.raises(SystemExit):  # a cached run needs a plan cache to read
        B.main(["--acceptance", "--rose-variants", "rose_cached", "--out", str(tmp_path)])
    assert "needs --plan-cache" in capsys.readouterr().err


def test_cached_run_takes_both_peers_from_the_same_warm_machines_earlier_call(tmp_path):
    """A call with our run alone (the three runs overrun one call) takes both peers from the newest
    earlier call of the same workload and length on the same GPU within the machine's hold: the ratio
    and the target are against the faster peer; another GPU, an older call, a call with one peer
    only, or a row that ran a peer itself are left as they are."""
    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 300.0, "candidates": []}}
    cached = {"rose_cached": _run(300.0, plan_cache=[entry], end_to_end_s=90.0, command="rose-cmd")}
    row = {**B.acceptance_row("ppo-ant", "ppo", 4_000_000, cached), "date": "2026-12-06 19:30 UTC",
           "gpu_uuid": "GPU-a"}
    assert row["target_met"] is None and row["speedup_vs_informed_peer"] is None
    peers = {"peer_default": _run(200.0, end_to_end_s=300.0, command="d"),
             "peer_flags": _run(250.0, end_to_end_s=260.0, command="f")}
    earlier = {**B.acceptance_row("ppo-ant", "ppo", 4_000_000, peers), "date": "2026-12-06 19:21 UTC",
               "gpu_uuid": "GPU-a", "call_command": "peers-call"}
    folded = B.fold_peers(row, [earlier])
    assert folded["peer_default_env_steps_per_s"] == 200.0 and folded["peer_flags_env_steps_per_s"] == 250.0
    assert folded["speedup_vs_informed_peer"] == 1.2 and folded["target_met"] is True
    assert folded["end_to_end_s"] == {"rose_cached": 90.0, "peer_default": 300.0, "peer_flags": 260.0}
    assert folded["command"]["rose_cached"] == "rose-cmd" and folded["command"]["peer_flags"] == "f"
    assert folded["peers_from"] == {"date": "2026-12-06 19:21 UTC", "gpu_uuid": "GPU-a",
                                    "call_command": "peers-call"}
    slow = B.fold_peers({**row, "rose_env_steps_per_s": 260.0}, [earlier])
    assert slow["speedup_vs_informed_peer"] == 1.04 and slow["target_met"] is False  # a miss is a miss
    other_gpu = {**earlier, "gpu_uuid": "GPU-b"}
    too_old = {**earlier, "date": "2026-12-06 18:55 UTC"}  # 35 min: another hold
    later = {**earlier, "date": "2026-12-06 19:40 UTC"}  # after this call
    one_peer = {**earlier, "peer_default_env_steps_per_s": None}
    other_len = {**earlier, "num_timesteps": 8_000_000}
    for e in (other_gpu, too_old, later, one_peer, other_len):
        assert B.fold_peers(row, [e]) is row
    ran_both = {**row, "peer_default_env_steps_per_s": 210.0, "peer_flags_env_steps_per_s": 240.0}
    assert B.fold_peers(ran_both, [earlier]) is ran_both
    # a row that ran one peer takes the other one from the same machine's earlier call
    ran_one = {**row, "peer_flags_env_steps_per_s": 240.0}
    one = B.fold_peers(ran_one, [earlier])
    assert one["peer_default_env_steps_per_s"] == 200.0 and one["peer_flags_env_steps_per_s"] == 240.0
    assert one["speedup_vs_informed_peer"] == 1.25  # against this call's faster Brax + flag
    assert one["peers_from"]["peers"] == {"peer_default": "2026-12-06 19:21 UTC"}
    assert one["command"]["peer_default"] == "d" and "peer_flags" not in one["command"]  # only the folded one
    # each peer from its own call (SAC on an H100: one of Brax's runs fills a call); not found: as is
    only_d = {**earlier, "date": "2026-12-06 19:10 UTC", "peer_flags_env_steps_per_s": None}
    only_f = {**earlier, "date": "2026-12-06 19:20 UTC", "peer_default_env_steps_per_s": None,
              "call_command": "flags-call"}
    split = B.fold_peers(row, [only_d, only_f])
    assert split["peer_default_env_steps_per_s"] == 200.0 and split["peer_flags_env_steps_per_s"] == 250.0
    assert split["speedup_vs_informed_peer"] == 1.2
    assert split["peers_from"]["peers"] == {"peer_default": "2026-12-06 19:10 UTC",
                                            "peer_flags": "2026-12-06 19:20 UTC"}
    assert split["peers_from"]["call_command"] == ["peers-call", "flags-call"]
    assert B.fold_peers(row, [only_f]) is row
    # a call that ran both is preferred to a newer one that ran one
    newer_f = {**only_f, "date": "2026-12-06 19:25 UTC"}
    assert B.fold_peers(row, [earlier, newer_f])["peers_from"]["date"] == "2026-12-06 19:21 UTC"
    # a row that took its peers from another call is not a source: that call may be outside this hold
    relay = {**folded, "date": "2026-12-06 19:45 UTC"}
    late = {**row, "date": "2026-12-06 19:55 UTC"}  # 34 min after the peers' call, 10 after relay's
    assert B.fold_peers(late, [earlier, relay]) is late
    part = {**one, "date": "2026-12-06 19:45 UTC"}  # ran peer_flags itself, took peer_default
    assert B.fold_peers(late, [part]) is late  # its peer_default is borrowed: not taken
    late_d = {**late, "peer_default_env_steps_per_s": 205.0}
    got = B.fold_peers(late_d, [part])  # its own peer_flags is
    assert got["peer_flags_env_steps_per_s"] == 240.0
    assert got["peers_from"]["peers"] == {"peer_flags": "2026-12-06 19:45 UTC"}
    assert B.fold_peers({**row, "date": "-"}, [earlier])["speedup_vs_informed_peer"] is None
    # the newest matching call is taken
    newer = {**earlier, "date": "2026-12-06 19:25 UTC", "peer_flags_env_steps_per_s": 240.0}
    assert B.fold_peers(row, [earlier, newer])["peer_flags_env_steps_per_s"] == 240.0
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in folded.items() if k != "_plan"}], jax_devices=False)
    md = open(os.path.join(tmp_path, "results.md")).read()
    assert "both peers ran in the call of 2026-12-06 19:21 UTC" in md
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in split.items() if k != "_plan"}], jax_devices=False)
    md = open(os.path.join(tmp_path, "results.md")).read()
    assert ("Brax as shipped ran in the call of 2026-12-06 19:10 UTC; Brax + flag ran in the call of "
            "2026-12-06 19:20 UTC on the same warm machine") in md


def test_cached_run_takes_flags_only_from_the_same_warm_machines_earlier_call(tmp_path):
    """A call without a flags-only run takes it from the newest earlier call of the same workload
    and length on the same GPU within the machine's hold (SAC's published epochs fill a call per
    run): the ratio over flags only is then against it; another GPU, a later call, or a row that
    ran flags only itself are left as they are."""
    cached = {"rose_cached": _run(300.0, end_to_end_s=90.0, command="rose-cmd")}
    row = {**B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, cached), "date": "2026-12-08 10:40 UTC",
           "gpu_uuid": "GPU-a"}
    assert row["speedup_vs_flags_only"] is None
    flags = {"flags_only": _run(250.0, end_to_end_s=120.0, command="f")}
    earlier = {**B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, flags), "date": "2026-12-08 10:30 UTC",
               "gpu_uuid": "GPU-a", "call_command": "flags-call"}
    folded = B.fold_flags_only(row, [earlier])
    assert folded["flags_only_env_steps_per_s"] == 250.0 and folded["speedup_vs_flags_only"] == 1.2
    assert folded["end_to_end_s"] == {"rose_cached": 90.0, "flags_only": 120.0}
    assert folded["command"]["flags_only"] == "f" and folded["flags_only_run"] == "flags_only"
    assert folded["flags_only_from"] == {"date": "2026-12-08 10:30 UTC", "gpu_uuid": "GPU-a",
                                         "call_command": "flags-call"}
    for e in ({**earlier, "gpu_uuid": "GPU-b"}, {**earlier, "date": "2026-12-08 10:45 UTC"},
              {**earlier, "date": "2026-12-08 09:55 UTC"}, {**earlier, "flags_only_env_steps_per_s": None}):
        assert B.fold_flags_only(row, [e]) is row
    ran_it = {**row, "flags_only_env_steps_per_s": 280.0}
    assert B.fold_flags_only(ran_it, [earlier]) is ran_it
    relay = {**folded, "date": "2026-12-08 10:50 UTC"}  # took its flags-only run from another call
    late = {**row, "date": "2026-12-08 11:05 UTC"}  # 35 min after that call, 15 after relay's
    assert B.fold_flags_only(late, [earlier, relay]) is late
    # peers and flags only from two earlier calls of the same hold, folded in the order main() does
    peers = {"peer_default": _run(200.0, end_to_end_s=300.0), "peer_flags": _run(240.0, end_to_end_s=260.0)}
    peer_row = {**B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, peers), "date": "2026-12-08 10:20 UTC",
                "gpu_uuid": "GPU-a"}
    both = B.fold_flags_only(B.fold_peers(row, [peer_row, earlier]), [peer_row, earlier])
    assert both["speedup_vs_informed_peer"] == 1.25 and both["speedup_vs_flags_only"] == 1.2
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in both.items() if k != "_plan"}], jax_devices=False)
    assert "the flags-only column ran in the call of 2026-12-08 10:30 UTC" in open(
        os.path.join(tmp_path, "results.md")).read()


def test_plan_only_search_gives_the_row_its_plan_and_the_split_first_run(tmp_path, capsys):
    """``rose_plan`` (`rose-jax train --optimize --plan-only`: the search alone) gives a row its plan
    and search time but no rate; with ``rose_cached`` after it (this call or a later one) the first
    run's wall time is the search's plus the cached run's, marked as split; a cut search is not
    folded, and rose_plan without --plan-cache is refused."""
    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 280.0, "candidates": [],
                        "base_options": {"name": "concurrent_scheduling"}}}
    plan_only = _run(None, plan_cache=[entry], end_to_end_s=300.0)
    alone = B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, {"rose_plan": plan_only})
    assert alone["rose_run"] == "rose_plan" and alone["rose_env_steps_per_s"] is None
    assert alone["plan"] == ["offload_component()"] and alone["search_s"] == 280.0 and alone["equal"] is True
    assert B.fold_first_run(alone, []) is alone  # nothing cached ran: no first run to fold
    cached = _run(6000.0, plan_cache=[entry], end_to_end_s=420.0)
    runs = {"rose_plan": plan_only, "rose_cached": cached}
    both = B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, runs)
    assert both["rose_run"] == "rose_cached" and both["rose_env_steps_per_s"] == 6000.0
    folded = B.fold_first_run(both, [])
    assert folded["end_to_end_s"]["rose"] == 720.0 and "rose_plan, 300.0 s" in folded["first_run"]["split"]
    later = B.acceptance_row("sac-hopper-5ep", "sac", 1_731_072, {"rose_cached": cached})
    assert B.fold_first_run(later, [alone])["end_to_end_s"]["rose"] == 720.0
    cut = {**alone, "errors": {"rose_plan": "timed out"}}
    assert B.fold_first_run(later, [cut]) is later
    # the same plan label from another search (another machine, an older unit: another search_s) is
    # not this cached run's first run, even when it is the newest (2026-12-07 10:17)
    older = {**alone, "search_s": 509.7, "end_to_end_s": {"rose_plan": 537.5}, "date": "d0"}
    assert B.fold_first_run(later, [older]) is later
    assert B.fold_first_run(later, [alone, older])["first_run"]["end_to_end_s"] == 720.0
    B.write(str(tmp_path), [], "cmd", [{k: v for k, v in folded.items() if k != "_plan"}], jax_devices=False)
    assert "split in two: the search alone" in open(os.path.join(tmp_path, "results.md")).read()
    with pytest.raises(SystemExit):
        B.main(["--acceptance", "--rose-variants", "rose_plan", "--out", str(tmp_path)])
    assert "needs --plan-cache" in capsys.readouterr().err


def test_a_split_first_run_in_one_call_names_that_calls_date(tmp_path, monkeypatch):
    """Stand-in runs (mock children, as in the tests above): rose_plan then rose_cached in one call
    fold into a first run named by the call's own date and device (the row is stamped before the
    fold; it once read "the first run of None on -")."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 280.0, "candidates": [],
                        "base_options": {"name": "concurrent_scheduling"}}}
    runs = {"rose_optimize_plan": _run(None, plan_cache=[entry], end_to_end_s=300.0),
            "rose_optimize_cached": _run(6000.0, plan_cache=[entry], end_to_end_s=100.0)}
    monkeypatch.setattr(ip, "rose_run", lambda name, variant, *a, **k: runs[variant])
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=[],
                              plan_cache=str(tmp_path / "p"), rose_variants=["rose_plan", "rose_cached"],
                              run_timeout_s=10.0, optimize_argv=[], profile=False, out=str(tmp_path / "out"))
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    row = json.load(open(tmp_path / "out" / "results.json"))["acceptance"][-1]
    assert row["end_to_end_s"]["rose"] == 400.0
    assert row["first_run"]["date"] == row["date"] and row["date"] and row["first_run"]["device"]
    assert "first run of None" not in open(tmp_path / "out" / "results.md").read()


def test_acceptance_plan_cache_is_shared_by_the_rose_runs_and_kept(tmp_path, monkeypatch):
    """Stand-in runs (mock children, as in the tests above): with --plan-cache the rose and
    rose_cached runs are pointed at DIR (flags_only keeps a fresh one), and DIR outlives the call."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    plans = str(tmp_path / "plans")
    seen = {}

    argvs = {}

    def rose(name, variant, steps, smoke, caches, timeout, extra, log_path):
        seen[variant], argvs[variant] = caches["plans"], list(extra)
        return {"returncode": 0}

    monkeypatch.setattr(ip, "rose_run", rose)
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=[], plan_cache=plans,
                              rose_variants=["flags_only", "rose_cached", "rose_plan", "rose"],
                              run_timeout_s=10.0, optimize_argv=["--optimize-budget", "1"], profile=False,
                              cached_argv=["--optimize-budget", "none"], out=str(tmp_path / "out"))
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    # --cached-argv: the cached run's own flags (a plain hit after a search with a budget)
    assert argvs["rose_optimize_plan"] == argvs["rose_optimize_first"] == ["--optimize-budget", "1"]
    assert argvs["rose_optimize_cached"] == ["--optimize-budget", "none"] and argvs["rose_first"] == []
    args.cached_argv = []  # --cached-argv '': no extra flags for the cached run, not --optimize-argv's
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    assert argvs["rose_optimize_cached"] == []
    assert seen["rose_optimize_first"] == plans and seen["rose_optimize_cached"] == plans
    assert seen["rose_optimize_plan"] == plans  # the search alone writes where the cached run reads
    # in RUN_ORDER whatever order they were given in: the plan-only search before the cached run
    assert list(seen) == ["rose_first", "rose_optimize_plan", "rose_optimize_first", "rose_optimize_cached"]
    assert seen["rose_first"] != plans and os.path.isdir(plans)


def test_flags_only_cached_runs_on_flags_onlys_caches_and_fills_the_column(tmp_path, monkeypatch, capsys):
    """Stand-in runs (mock children, as in the tests above): ``flags_only_cached`` is the user's
    second ``rose-jax train`` on the very compile and plan caches ``flags_only`` left (the option
    trial's decision cached there); its rate fills the flags-only column when the first run has
    none, and it needs ``flags_only`` in the same call."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    seen = []

    def rose(name, variant, steps, smoke, caches, timeout, extra, log_path):
        seen.append((variant, dict(caches), log_path))
        first = len(seen) == 1
        return {"returncode": 0, "steady_env_steps_per_s": None if first else 1234.0}

    monkeypatch.setattr(ip, "rose_run", rose)
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=[], plan_cache=None,
                              rose_variants=["flags_only", "flags_only_cached"], run_timeout_s=10.0,
                              optimize_argv=[], profile=False, out=str(tmp_path))
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    assert [v for v, _, _ in seen] == ["rose_first", "rose_cached"]
    assert seen[1][1] == seen[0][1]  # the same caches: a second run, not a first one
    assert seen[1][2].endswith("smoke-flags_only_cached.log")
    row = json.load(open(tmp_path / "results.json"))["acceptance"][-1]
    assert row["flags_only_env_steps_per_s"] == 1234.0 and row["flags_only_run"] == "flags_only_cached"
    # the first run's own rate wins when it has one
    both = {"flags_only": _run(900.0), "flags_only_cached": _run(1000.0)}
    both = B.acceptance_row("ppo-ant", "ppo", 1, both)
    assert both["flags_only_env_steps_per_s"] == 900.0 and both["flags_only_run"] == "flags_only"
    with pytest.raises(SystemExit):
        B.main(["--acceptance", "--rose-variants", "flags_only_cached", "--out", str(tmp_path)])
    assert "give flags_only too" in capsys.readouterr().err


def test_a_ratio_over_one_peer_says_so():
    """A call that ran one of Brax's two variants shows its ratio as over that one only: the other,
    measured elsewhere, may be the informed peer."""
    both = {"speedup_vs_informed_peer": 1.2, "peer_default_env_steps_per_s": 1.0,
            "peer_flags_env_steps_per_s": 2.0}
    assert B.vs_peer_cell(both) == "1.200"
    assert B.vs_peer_cell({**both, "peer_flags_env_steps_per_s": None}) == "1.200 (vs Brax as shipped only)"
    flag_only = {**both, "peer_default_env_steps_per_s": None}
    assert B.vs_peer_cell(flag_only, unit="x") == "1.200x (vs Brax + flag only)"
    assert B.vs_peer_cell({"speedup_vs_informed_peer": None}) == "-"


def test_peer_call_takes_our_run_from_the_same_warm_machines_earlier_call(tmp_path):
    """Where our run had to come first in a hold (SAC on an H100, 2026-12-07 10:12-10:32: the plan's
    search, the cached run, then Brax + flag, then Brax as shipped, each in its own call), the last
    call's row carries every column: our rate, plan and first run from the cached run's call
    (fold_rose), the other peer from its own call (fold_peers), through main()'s fold_all; another
    GPU, a later call, a row with our rate or no peer of its own, and a call whose rose was itself
    folded are left as they are."""
    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 192.9, "candidates": [],
                        "base_options": {"name": "concurrent_scheduling"}}}
    n, steps, gpu = "sac-hopper-5ep", 1_731_072, "GPU-a"

    def call(date, runs, accepted):
        row = {**B.acceptance_row(n, "sac", steps, runs), "date": date, "gpu_uuid": gpu,
               "call_command": f"call {date}"}
        row = {k: v for k, v in row.items() if k != "_plan"}
        return B.fold_all(row, accepted, accepted)

    rows: list[dict] = []
    for date, runs in (
        ("2026-12-07 10:12 UTC", {"rose_plan": _run(None, plan_cache=[entry], end_to_end_s=230.5)}),
        ("2026-12-07 10:17 UTC", {"rose_cached": _run(8950.0, plan_cache=[entry], end_to_end_s=297.5,
                                                      command="rose-cmd")}),
        ("2026-12-07 10:24 UTC", {"peer_flags": _run(7559.0, end_to_end_s=379.4, command="f")}),
        ("2026-12-07 10:32 UTC", {"peer_default": _run(5471.0, end_to_end_s=478.3, command="d")}),
    ):
        rows.append(call(date, runs, list(rows)))
    cached, flag_row, last = rows[1], rows[2], rows[3]
    assert cached["end_to_end_s"]["rose"] == 528.0  # the split first run: 230.5 + 297.5
    # the peer_flags call already takes our run (a miss against Brax + flag alone)
    assert flag_row["rose_env_steps_per_s"] == 8950.0 and flag_row["target_met"] is False
    assert last["rose_env_steps_per_s"] == 8950.0 and last["rose_run"] == "rose_cached"
    assert last["peer_default_env_steps_per_s"] == 5471.0 and last["peer_flags_env_steps_per_s"] == 7559.0
    assert last["speedup_vs_informed_peer"] == round(8950 / 7559, 3) and last["target_met"] is False
    assert last["plan"] == ["offload_component()"] and last["search_s"] == 192.9 and last["equal"] is True
    assert last["base_options"] == "concurrent_scheduling"
    assert last["first_run"]["date"] == "2026-12-07 10:12 UTC"
    assert last["end_to_end_s"] == {"peer_default": 478.3, "rose_cached": 297.5, "rose": 528.0,
                                    "peer_flags": 379.4}
    assert last["command"]["rose_cached"] == "rose-cmd" and last["command"]["peer_flags"] == "f"
    assert last["rose_from"]["date"] == "2026-12-07 10:17 UTC"
    assert last["peers_from"]["peers"] == {"peer_flags": "2026-12-07 10:24 UTC"}
    peer_only = {k: v for k, v in B.acceptance_row(n, "sac", steps, {"peer_default": _run(5471.0)}).items()
                 if k != "_plan"}
    base = {**peer_only, "date": "2026-12-07 10:32 UTC", "gpu_uuid": gpu}
    src = rows[1]
    for e in ({**src, "gpu_uuid": "GPU-b"}, {**src, "date": "2026-12-07 10:40 UTC"},
              {**src, "date": "2026-12-07 09:55 UTC"}, {**src, "rose_from": {"date": "x"}}):
        assert B.fold_rose(base, [e]) is base
    assert B.fold_rose(last, [src]) is last  # has our rate already
    plan_only = {**base, "peer_default_env_steps_per_s": None}
    assert B.fold_rose(plan_only, [src]) is plan_only  # ran no peer itself
    B.write(str(tmp_path), [], "cmd", rows, jax_devices=False)
    md = open(os.path.join(tmp_path, "results.md")).read()
    assert "the rose column (our `--optimize` run) ran in the call of 2026-12-07 10:17 UTC" in md


def test_plan_profile_keeps_the_transforms_legal_on_one_iteration_and_names_the_rest():
    """The row's profile traces one iteration with the plan's transforms that apply to it: a SAC
    unit's offloaded evaluation is not in a training iteration (2026-12-07 10:17: the profile
    failed on it instead of profiling the iteration), so it is left out with the reason; on a
    function that has the component it is kept."""
    import jax
    import jax.numpy as jnp

    import rose_jax
    from rose_jax.optimize import offload_component, unroll_scans

    def train_only(state):
        w = jax.lax.scan(lambda w, x: (w * 0.9 + x, None), state["w"], jnp.ones(4))[0]
        return {"w": w}, {"w": w}

    def with_eval(state):
        new, m = train_only(state)
        with rose_jax.component("evaluate"):
            ev = jnp.sum(jnp.sin(state["w"]))
        return new, {**m, "eval": ev}

    state = {"w": jnp.float32(1.0)}
    plan = [offload_component("evaluate").to_json(), unroll_scans(factor=2).to_json()]
    from rose_jax import trace as rtrace

    traced = lambda fn: rtrace.trace(fn, state, arg_names=["state"])  # noqa: E731
    apply, skipped = B.plan_on(traced(train_only), plan)
    assert [t.name for t in apply] == ["unroll_scans"]
    assert len(skipped) == 1 and skipped[0].startswith("offload_component(") and "evaluate" in skipped[0]
    apply, skipped = B.plan_on(traced(with_eval), plan)
    assert [t.name for t in apply] == ["offload_component", "unroll_scans"] and skipped == []


def test_standing_counts_each_run_of_ours_once_per_workload_gpu_and_plan():
    """The summary above the table: complete rows (both peers) grouped by workload, length, GPU
    model and plan; rows that fold the same run of ours count once (the newest); the ratios'
    median and range and the verdict (met in n of n / missed in k of n); a group without a complete
    row shows its ratios against one peer as not established."""
    def row(date, rose, d=None, f=None, gpu="NVIDIA H100 80GB HBM3", plan=("p",), rose_from=None, **kw):
        peers = {"peer_default": d, "peer_flags": f}
        speedup, met = B._verdict(rose, peers, 1.15)
        return {"workload": "ppo-ant", "num_timesteps": 10, "device": gpu, "date": date, "target": 1.15,
                "plan": list(plan), "rose_env_steps_per_s": rose, "peer_default_env_steps_per_s": d,
                "peer_flags_env_steps_per_s": f, "speedup_vs_informed_peer": speedup, "target_met": met,
                "end_to_end_s": {"peer_default": 100.0, "peer_flags": 90.0, "rose_cached": 60.0},
                **({"rose_from": {"date": rose_from}} if rose_from else {}), **kw}

    acc = [
        row("d1", 150.0, d=100.0),  # one peer: partial
        row("d2", 150.0, d=100.0, f=110.0, rose_from="d1"),  # the same run of ours, now complete
        row("d3", 120.0, d=100.0, f=110.0),  # a second run: 1.091, a miss
        row("d4", 200.0, d=100.0, f=110.0, gpu="NVIDIA H200"),  # another GPU
        row("d5", 130.0, f=100.0, plan=("q",)),  # another plan, one peer only
        row("d6", 900.0, d=1.0, f=1.0, partial=True),  # a call cut before its end: left out
    ]
    st = {(x["device"], x["plan"]): x for x in B.standing(acc)}
    h100 = st[("H100", "p")]
    assert h100["runs"] == 2 and h100["ratios"] == [round(150 / 110, 3), round(120 / 110, 3)]
    assert h100["met"] == 1 and h100["dates"] == ["d2", "d3"]
    assert h100["peer_s"] == [90.0, 90.0]  # the faster peer's (Brax + flag) wall time
    assert st[("H200", "p")]["runs"] == 1 and st[("H200", "p")]["met"] == 1
    assert st[("H100", "q")]["runs"] == 0 and st[("H100", "q")]["partial"] == [1.3]
    # a miss against one peer is a miss; two calls in the same minute on two GPUs are two runs
    slow = row("d7", 105.0, f=100.0, plan=("r",))
    twin = [row("d8", 150.0, d=100.0, f=110.0, plan=("s",), gpu_uuid="A"),
            row("d8", 160.0, d=100.0, f=110.0, plan=("s",), gpu_uuid="B")]
    st2 = {x["plan"]: x for x in B.standing([slow, *twin])}
    assert st2["s"]["runs"] == 2 and st2["r"]["partial_misses"] == 1
    md2 = "\n".join(B.standing_lines([slow]))
    assert "missed in 1 of 1 (1 against one peer only: 1.050)" in md2
    md = "\n".join(B.standing_lines(acc))
    median = (round(150 / 110, 3) + round(120 / 110, 3)) / 2  # of the rows' rounded ratios
    assert f"| 2 | {median:.3f} (1.091-1.364) | missed in 1 of 2 |" in md
    assert "met in 1 of 1" in md and "not established (vs one peer only: 1.300)" in md
    assert B.standing_lines([]) == []


def test_floor_names_the_busy_share_or_the_hottest_loops_chain():
    """A trace where the GPU is busy most of the iteration names kernel time; otherwise launches
    and gaps, with the hottest loop's dependency chain (rose_jax.trace.depth) where the profile
    has it; an untraced profile says why."""
    prof = {"available": True, "ms_per_iteration": 10.0, "busy_ms_per_iteration": 9.0,
            "kernels_per_iteration": 100, "median_kernel_us": 2.0, "median_gap_us": 3.0,
            "top_kernels_ms_per_iteration": {"gemm": 5.0}}
    assert B.floor_of(prof).startswith("kernel time: the GPU is busy 9.0 of 10.0 ms")
    chain = {"loop": "train_steps/_grad_step", "trips": 64,
             "describe": "a chain of 76 of its 868 operations, 12 of its 48 matrix products in series"}
    idle = {**prof, "busy_ms_per_iteration": 5.0, "chains": [chain]}
    floor = B.floor_of(idle)
    assert floor.startswith("launches and gaps: the GPU is busy 5.0 of 10.0 ms")
    assert ("the hottest loop (train_steps/_grad_step x64) runs a chain of 76 of its 868 operations, "
            "12 of its 48 matrix products in series per trip") in floor
    assert "hottest loop" not in B.floor_of({**idle, "chains": []})
    assert B.floor_of({"available": False, "reason": "no GPU"}) == "not traced (no GPU)"


def test_hottest_chains_of_the_sac_iteration_start_with_its_gradient_step():
    """plan_profile's chains on a real (tiny) SAC iteration: the gradient-step loop first."""
    import jax

    import envs
    from algos import sac

    env = envs.make("pendulum")
    config = sac.SACConfig(num_timesteps=1200, num_envs=8, grad_updates_per_step=3, batch_size=32,
                           min_replay_size=64, policy_hidden_sizes=(16, 16), q_hidden_sizes=(16, 16),
                           num_evals=4, num_eval_envs=0)
    state = sac.init(config, env, jax.random.PRNGKey(0))
    from rose_jax import trace as rtrace

    chains = B.hottest_chains(rtrace.trace(sac.iteration(config, env), state, arg_names=["state"]))
    assert chains[0]["loop"].endswith("_grad_step") and chains[0]["trips"] == 3
    assert 0 < chains[0]["longest_matmuls"] < chains[0]["matmuls"]
    assert "matrix products and" in chains[0]["describe"] and "kernels in series" in chains[0]["describe"]


def test_run_plan_entry_is_the_one_the_run_used_not_the_last_key():
    """The plan cache holds several programs' entries, written with sorted keys: a row takes the
    entry its run names (run.json's optimize.cache_key), else the one its search wrote or changed,
    else the only one, never the last key (2026-12-07 08:54: ppo-ant-6ep took the H200 ppo-ant
    search's record, whose key sorts last)."""
    ant = {"plan": ["a"], "report": {"search_time_s": 397.0}}
    h200 = {"plan": ["a"], "report": {"search_time_s": 401.7}}
    before = {"57e1|ant|4096|H100": ant, "623b|ant|4096|H200": h200}
    assert B.run_plan_entry(before, before, {"cache_key": "57e1|ant|4096|H100"}) == [ant]
    searched = {**before, "11aa|hopper|128|H100": {"plan": ["b"], "report": {"search_time_s": 190.0}}}
    assert B.run_plan_entry(before, searched, None) == [searched["11aa|hopper|128|H100"]]
    resumed = {**before, "57e1|ant|4096|H100": {**ant, "report": {"search_time_s": 500.0}}}
    assert B.run_plan_entry(before, resumed, {}) == [resumed["57e1|ant|4096|H100"]]
    assert B.run_plan_entry(before, before, {}) == []  # a cache hit that names no key: not guessed
    assert B.run_plan_entry({}, {"k": ant}, None) == [ant]  # written by this run
    assert B.run_plan_entry({"k": ant}, {"k": ant}, None) == []  # carried in, maybe another program's


def test_fold_rose_leaves_rows_that_ran_ours_and_keeps_borrowed_failures():
    """fold_rose only fills a row whose call ran none of our runs: a row whose own search or
    --optimize run failed keeps that (it does not take an earlier call's rate and plan); a borrowed
    search that was cut stays cut, so no split first run is built from it; a first run found in a
    row that borrowed it names the call that ran it."""
    gpu, n, steps = "GPU-a", "sac-hopper-5ep", 1_731_072
    entry = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 192.9, "candidates": []}}

    def row(date, runs):
        r = {**B.acceptance_row(n, "sac", steps, runs), "date": date, "gpu_uuid": gpu}
        return {k: v for k, v in r.items() if k != "_plan"}

    cut_search = _run(None, rc=None, plan_cache=[entry], end_to_end_s=420.0, error="timed out")
    src = row("2026-12-07 10:00 UTC", {"rose_plan": cut_search,
                                       "rose_cached": _run(9000.0, plan_cache=[entry], end_to_end_s=600.0)})
    assert "rose_plan" in src["errors"] and B.fold_first_run(src, []) is src  # refused in its own call
    peer = row("2026-12-07 10:10 UTC", {"peer_flags": _run(7500.0, end_to_end_s=380.0)})
    got = B.fold_all(peer, [src], [src])
    assert got["rose_env_steps_per_s"] == 9000.0 and got["errors"]["rose_plan"] == "timed out"
    assert "rose" not in got["end_to_end_s"] and "first_run" not in got  # no 420 + 600 s first run
    # a call whose own --optimize run failed is not filled from another call
    failed = row("2026-12-07 10:12 UTC", {"peer_flags": _run(7500.0),
                                          "rose": _run(None, rc=1, end_to_end_s=50.0, error="OOM")})
    assert B.fold_rose(failed, [src]) is failed
    searched = row("2026-12-07 10:12 UTC", {"peer_flags": _run(7500.0),
                                            "rose_plan": _run(None, plan_cache=[entry], end_to_end_s=450.0)})
    assert B.fold_rose(searched, [src]) is searched
    # a first run borrowed by a peer-only row is named by the call that ran it
    first = row("2026-12-07 10:00 UTC", {"rose": _run(9000.0, plan_cache=[entry], end_to_end_s=700.0)})
    relay = B.fold_rose(row("2026-12-07 10:10 UTC", {"peer_flags": _run(7500.0)}), [first])
    later = row("2026-12-07 10:20 UTC", {"rose_cached": _run(9100.0, plan_cache=[entry], end_to_end_s=300.0)})
    assert B.fold_first_run(later, [first, relay])["first_run"]["date"] == "2026-12-07 10:00 UTC"


def test_same_hold_needs_the_same_machine_where_rows_name_it():
    a = {"workload": "w", "num_timesteps": 1, "gpu_uuid": "G", "date": "2026-12-07 10:00 UTC", "host": "m1"}
    b = {**a, "date": "2026-12-07 10:10 UTC"}
    assert B._same_hold(b, a)
    assert not B._same_hold({**b, "host": "m2"}, a)  # a fresh machine on the same GPU
    assert B._same_hold({**b, "host": None}, a)  # older rows name no machine


def test_acceptance_reads_the_runs_own_entry_and_profiles_under_its_option_set(tmp_path, monkeypatch):
    """Stand-in runs (mock children: the plan search is not what is tested): with several programs'
    entries in the carried plan cache, the row's plan columns come from the entry the run names
    (run.json's optimize.cache_key), and --profile traces the plan under the option set that
    entry's search kept, not --options."""
    import argparse

    from benchmarks.experiments import informed_peer as ip

    plans = tmp_path / "plans"
    plans.mkdir()
    mine = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
            "report": {"equal": True, "search_time_s": 397.0, "candidates": [],
                       "base_options": {"name": "concurrent_no_loops"}}}
    other = {"plan": [{"name": "offload_component", "label": "offload_component()", "tolerance": {}}],
             "report": {"equal": True, "search_time_s": 401.7, "candidates": [],
                        "base_options": {"name": "concurrent_scheduling"}}}
    (plans / "plans.json").write_text(json.dumps({"11aa|ant|4096|H100": mine, "ffzz|ant|4096|H200": other}))

    def rose(name, variant, steps, smoke, caches, timeout, extra, log_path):
        return {"returncode": 0, "steady_env_steps_per_s": 100.0, "interval_rates": [100] * 3,
                "end_to_end_s": 10.0, "optimize": {"cache_key": "11aa|ant|4096|H100"}}

    profiled = []

    def profile(name, args, plan, base_options=None, memo=None):
        profiled.append((name, base_options, [t["name"] for t in plan]))
        return {"available": False, "reason": "stand-in"}

    monkeypatch.setattr(ip, "rose_run", rose)
    monkeypatch.setattr(B, "plan_profile", profile)
    args = argparse.Namespace(smoke=True, acceptance_steps=None, peer_variants=[], plan_cache=str(plans),
                              rose_variants=["rose_cached"], run_timeout_s=10.0, optimize_argv=[],
                              cached_argv=None, profile=True, options="concurrent_scheduling",
                              out=str(tmp_path / "out"))
    B.run_acceptance(args, ["smoke"], [], [], "cmd")
    (row,) = json.load(open(tmp_path / "out" / "results.json"))["acceptance"]
    assert row["search_s"] == 397.0 and row["base_options"] == "concurrent_no_loops"  # not the last key's
    assert profiled == [("smoke", "concurrent_no_loops", ["offload_component"])]


def test_missed_rows_to_profile_take_their_plan_from_the_cache_of_their_gpu_model(tmp_path):
    """--profile-missed: the missed rows without an available profile, of the asked workloads and
    this GPU model, grouped by plan and option set (one trace each, newest first); a baseline row
    needs no entry; a row whose plan no entry of its GPU model holds, a row of another GPU, a met
    row and a row already traced are left as they were."""
    h100 = "NVIDIA H100 80GB HBM3, 580.1, 81559 MiB"
    off = {"label": "offload_component(component='evaluate', quota=None)", "name": "offload_component",
           "params": {"component": "evaluate", "quota": None}}
    ext = {"label": "exit_idle_loops(where=None, check_every=5)", "name": "exit_idle_loops",
           "params": {"where": None, "check_every": 5}}
    os.makedirs(tmp_path / "cache")
    with open(tmp_path / "cache" / "plans.json", "w") as f:
        json.dump({"c4ea|hopper|128|NVIDIA H100 80GB HBM3|0.11.2": {"plan": [off]},
                   "623b|hopper|128|NVIDIA H200|0.11.2": {"plan": [ext]}}, f)
    with open(tmp_path / "copy.json", "w") as f:
        json.dump({"2e07|reacher|2048|NVIDIA H100 80GB HBM3|0.11.2": {"plan": [ext]}}, f)
    with open(tmp_path / "broken.json", "w") as f:
        f.write("{")
    entries = B.plan_entries(str(tmp_path / "cache"), str(tmp_path))
    assert len(entries) == 3

    def row(date, w, plan, met=False, device=h100, **kw):
        return {"date": date, "workload": w, "plan": plan, "target_met": met, "device": device,
                "base_options": "concurrent_scheduling", **kw}

    acc = [
        row("d1", "ppo-ant", ["baseline (no candidate kept)"], base_options=None),
        row("d2", "sac-hopper-5ep", [off["label"]]),
        row("d3", "sac-hopper-5ep", [off["label"]], profile={"available": False, "reason": "x"}),
        row("d4", "ppo-reacher", [ext["label"]]),
        row("d5", "ppo-reacher", [off["label"]]),  # no H100 reacher entry with the offload
        row("d6", "sac-hopper-5ep", [off["label"]], device="NVIDIA H200, 580.1"),
        row("d7", "sac-hopper-5ep", [off["label"]], met=True),
        row("d8", "sac-hopper-5ep", [off["label"]], profile={"available": True}),
        row("d9", "sac-ant-5ep", [off["label"]]),  # not asked for
    ]
    names = ["ppo-ant", "sac-hopper-5ep", "ppo-reacher"]
    todo, skipped = B.missed_to_profile(acc, names, "NVIDIA H100 80GB HBM3", entries)
    assert [(w, base, idx) for w, _, base, idx in todo] == [
        ("ppo-reacher", "concurrent_scheduling", [3]),
        ("sac-hopper-5ep", "concurrent_scheduling", [2, 1]),
        ("ppo-ant", None, [0]),
    ]
    assert todo[1][1] == [off] and todo[2][1] == []
    assert len(skipped) == 2
    assert skipped[0].startswith("d6 sac-hopper-5ep: measured on NVIDIA H200, not this NVIDIA H100")
    assert skipped[1].startswith("d5 ppo-reacher: no plan-cache entry of its GPU model has its plan")
    # on a CPU (no GPU model) nothing is traced: every candidate row is named as skipped
    todo, skipped = B.missed_to_profile(acc, names, "", entries)
    assert todo == [] and len(skipped) == 6


def test_profile_missed_on_a_cpu_leaves_the_rows_and_needs_an_earlier_call(tmp_path, capsys):
    """``--profile-missed`` runs nothing: without ``--acceptance --merge`` it is a one-line usage
    error; on a CPU it traces no row (their GPU model is not this machine's), names each one it
    left, and leaves the results file as it was."""
    with pytest.raises(SystemExit):
        B.main(["--profile-missed", "--out", str(tmp_path)])
    assert "--profile-missed traces the rows of an earlier --acceptance call" in capsys.readouterr().err
    acc = [{"date": "2026-12-07 10:32 UTC", "workload": "sac-hopper-5ep", "target_met": False,
            "device": "NVIDIA H100 80GB HBM3, 580.1", "plan": ["baseline (no candidate kept)"]}]
    B.write(str(tmp_path), [], "cmd", acc, jax_devices=False)
    assert B.main(["--acceptance", "--merge", "--profile-missed", "--workloads", "sac-hopper-5ep",
                   "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["acceptance"] == acc
    out = capsys.readouterr().out
    assert "not profiled: 2026-12-07 10:32 UTC sac-hopper-5ep: measured on NVIDIA H100" in out


def test_plan_profile_traces_a_program_once_for_two_plans_that_leave_it(monkeypatch):
    """--profile-missed's memo: a plan whose only transform is not on one iteration (the offloaded
    evaluation) and no plan at all leave the same program, so the second is not compiled and traced
    again; each keeps its own description. A plan with a transform that applies is its own trace.
    (``build`` is replaced by a tiny scan program here, a stand-in for a workload; the compile,
    timing and CPU profile path are the real ones.)"""
    import argparse

    import jax
    import jax.numpy as jnp

    from rose_jax.optimize import offload_component, unroll_scans

    def fn(state):
        w = jax.lax.scan(lambda w, x: (jnp.tanh(w * 0.9 + x), None), state["w"], jnp.ones(4))[0]
        return {"w": w}, {"w": w}

    monkeypatch.setattr(B, "build", lambda name, smoke: (None, fn, {"w": jnp.float32(0.5)}, 8, []))
    compiles = []
    real = B._compile
    monkeypatch.setattr(B, "_compile", lambda *a, **k: compiles.append(1) or real(*a, **k))
    args = argparse.Namespace(blocks=3, calls=1, profile_calls=1, smoke=True, options="concurrent_scheduling")
    memo: dict = {}
    cs = "concurrent_scheduling"
    off = B.plan_profile("w", args, [offload_component("evaluate").to_json()], cs, memo)
    base = B.plan_profile("w", args, [], cs, memo)
    assert len(compiles) == 1 and len(memo) == 1
    assert "not on one iteration: offload_component(" in off["program"]
    assert base["program"] == "one iteration under concurrent_scheduling"
    assert base["ms_per_iteration"] == off["ms_per_iteration"]
    unrolled = B.plan_profile("w", args, [unroll_scans(factor=2).to_json()], cs, memo)
    assert len(memo) == 2 and unrolled["program"].startswith("one iteration with the plan (unroll_scans(")
    other = B.plan_profile("w", args, [], "default", memo)  # another option set: its own trace
    assert len(compiles) == 2 and len(memo) == 3 and other["program"] == "one iteration under default"


@pytest.mark.parametrize(
    "spec,env,message",
    [
        ("bogus:sac-hopper", {"OUT": "OUTDIR"}, "unknown step 'bogus'"),
        ("first", {"OUT": "OUTDIR"}, "names no workloads"),
        ("first:sac-hopper", {}, "set OUT to the output folder"),
        ("first:sac-hopper", {"OUT": "OUTDIR", "BASE": "OUTDIR/missing.json"}, "no such results file"),
    ],
)
def test_the_device_call_script_refuses_a_bad_spec_in_one_line_before_any_work(spec, env, message, tmp_path):
    """benchmarks/acceptance_call.sh checks its steps and OUT before installing wheels or running
    anything: nothing is written under OUT."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(B.__file__)))
    env = {k: v.replace("OUTDIR", str(tmp_path)) for k, v in env.items()}
    r = subprocess.run(["bash", "benchmarks/acceptance_call.sh", spec], cwd=os.path.dirname(root),
                       env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(tmp_path.iterdir())
