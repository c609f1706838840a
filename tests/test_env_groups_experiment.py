"""benchmarks.experiments.env_groups: its output when a row failed (issue 18).

On the H200 a row raised (the workers' UnexpectedTracerError) and ``table()`` then raised
``KeyError: 'fused_ms'`` on the failed row's record, so nothing was printed. A failed row is
now reported as FAILED with its error and the measured rows keep their tables.
"""

from __future__ import annotations

import pytest

from benchmarks.experiments import env_groups as E


def _groups_row(name: str, policy: str) -> dict:
    return {
        "name": name,
        "kind": "groups",
        "policy": policy,
        "fused_ms": 45.4,
        "processes_ms": 60.5,
        "speedup": 45.4 / 60.5,
        "driver_overhead_ms": 1.25,
        "exchange_overhead_ms": 0.5,
        "worker_rollout_ms": 30.0,
        "learn_ms": 20.0,
        "driver_compiles_after_first": 0,
        "worker_compiles_after_first": 0,
        "equal": True,
        "envs_differing": 0,
        "equal_to_sequential_groups": True,
        "envs_differing_sequential": 0,
        "envs_differing_inline": 0,
    }


def _rows() -> list[dict]:
    tracer = E.failed_row(
        "groups_3x1024", "groups", RuntimeError("UnexpectedTracerError: Encountered an unexpected tracer")
    )
    return [
        _groups_row("groups_4x32", "4x32"),
        tracer,
        E.failed_row("exchange", "exchange", OSError("no CUDA IPC")),
        {"name": "offload_2048", "kind": "offload", "skipped": "time budget (440s spent, ~200s needed)"},
        E.failed_row("search_4x32", "search", ValueError("Program cannot be compiled")),
    ]


def test_table_reports_a_failed_row_and_keeps_the_others():
    text = E.table(_rows())
    lines = text.splitlines()
    # the measured groups row keeps its table; the failed one is not in it
    (row,) = [ln for ln in lines if ln.startswith("|") and "groups_" in ln]
    assert "groups_4x32" in row and "0.750x" in row and "0/0" in row
    assert (
        "groups_3x1024: FAILED: RuntimeError: UnexpectedTracerError: Encountered an unexpected tracer"
        in lines
    )
    assert "exchange: FAILED: OSError: no CUDA IPC" in lines
    assert "search_4x32: FAILED: ValueError: Program cannot be compiled" in lines
    assert "offload_2048: skipped: time budget (440s spent, ~200s needed)" in lines
    assert "exchange (" not in text and "search over" not in text  # no table of a failed kind


def test_only_failed_rows():
    rows = [E.failed_row("groups_4x32", "groups", KeyError("fused_ms"))]
    assert E.table(rows).strip() == "groups_4x32: FAILED: KeyError: 'fused_ms'"
    assert E.measured(rows, "groups") == []


def test_plot_skips_failed_rows(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "env_groups.png"
    E.plot(_rows(), str(path))
    assert path.exists() and path.stat().st_size > 0
    empty = tmp_path / "none.png"
    E.plot(_rows()[1:], str(empty))  # nothing measured: no plot
    assert not empty.exists()


def test_merge_keeps_measured_rows_and_takes_this_runs_measurements():
    """--merge: a skipped or failed row of this run never replaces a measured row of an earlier run;
    a measured row replaces the old one of its name; new names are appended; each keeps its command."""
    old = [
        {**_groups_row("groups_4x32", "4x32"), "command": "run 1"},
        {"name": "offload_2048", "kind": "offload", "skipped": "time budget", "command": "run 1"},
        {"name": "exchange", "kind": "exchange", "round_trips": [], "command": "run 1"},
    ]
    new = [
        {"name": "groups_4x32", "kind": "groups", "skipped": "time budget", "command": "run 2"},
        {**_groups_row("offload_2048", "x"), "kind": "offload", "command": "run 2"},
        E.failed_row("exchange", "exchange", OSError("no CUDA IPC")) | {"command": "run 2"},
        {"name": "offload_8192", "kind": "offload", "skipped": "time budget", "command": "run 2"},
    ]
    merged = E.merged_rows(old, new)
    assert [(r["name"], r["command"]) for r in merged] == [
        ("groups_4x32", "run 1"),
        ("offload_2048", "run 2"),
        ("exchange", "run 1"),
        ("offload_8192", "run 2"),
    ]
    assert "skipped" not in merged[0] and "skipped" not in merged[2]


def test_offload_estimate_grows_with_the_envs():
    assert E.estimate_s("offload_2048", "offload") == E.ESTIMATE_S["offload"]
    assert E.estimate_s("offload_8192", "offload") == E.ESTIMATE_S["offload"] + 3 * E.OFFLOAD_S_PER_2048_ENVS
    assert E.estimate_s("groups_4x32", "groups") == E.ESTIMATE_S["groups"]
