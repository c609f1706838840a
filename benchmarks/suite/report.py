"""Suite results -> Markdown, bar chart and the README's headline table (from the JSON only).

    python -m benchmarks.suite.report --suite quick    # rewrite results.md / results.png from results.json
    python -m benchmarks.suite.report --readme         # README: full (all parts) or quick, then epoch
    python -m benchmarks.suite.report --readme --suite tiny --readme-path /tmp/README.md

Files of suite ``S`` live in ``benchmarks/results/suite/S/``: ``results.json`` (every number),
``results.md`` (tables), ``results.png`` (bars); a ``--part i/n`` run writes
``part-i-of-n.json`` and :func:`merge_parts` combines the parts into ``results.*``. The README
block sits between ``<!-- RESULTS -->`` and ``<!-- /RESULTS -->``; only that block is replaced.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
from typing import Any, Sequence

from rose_jax.io import atomic_write_json, atomic_write_text

from benchmarks import common
from benchmarks.suite.workloads import (
    BASELINES,
    INFORMED_PEERS,
    LABELS,
    PEER_OPTION_SET,
    PEER_XLA_FLAGS,
    VARIANTS,
)

SUITE_DIR = os.path.join(common.RESULTS_DIR, "suite")
README = os.path.join(common.REPO_DIR, "README.md")
START, END = "<!-- RESULTS -->", "<!-- /RESULTS -->"
SHORT = {
    "brax": "(a) Brax",
    "brax_flags": "(a') Brax + flag",
    "single_jit": "(b) single-jit",
    "single_jit_flags": "(b') single-jit + options",
    "hand_pipelined": "(c) hand pipeline",
    "rose_jax": "(d) rose-jax",
}


# ------------------------------------------------------------------------------ numbers


def rate(row: dict, variant: str) -> float | None:
    """A variant's env-steps/s, or None when it did not run to completion."""
    rec = row.get("variants", {}).get(variant)
    if not rec or rec.get("status") != "ok":
        return None
    value = rec.get("env_steps_per_s")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def peer_pair(row: dict, peer: str) -> dict:
    """(d) against one peer (``"brax"`` or ``"single_jit"``) as the measurement standard asks: against
    the faster of the peer as shipped and the peer with the best global XLA flags
    (:data:`benchmarks.suite.workloads.INFORMED_PEERS`).

    Returns ``{"best", "env_steps_per_s", "ratio", "measured", "informed"}``: the faster measured
    variant of the pair, its rate, (d) / it, the pair's measured variants, and ``informed``: both
    were measured (the ratio is then to the informed peer; otherwise to what ran, or None).
    """
    pair = (peer, INFORMED_PEERS[peer])
    measured = {v: rate(row, v) for v in pair if rate(row, v) is not None}
    best = max(measured, key=measured.get) if measured else None
    d = rate(row, "rose_jax")
    return {
        "best": best,
        "env_steps_per_s": measured[best] if best else None,
        "ratio": d / measured[best] if (d is not None and best) else None,
        "measured": [v for v in pair if v in measured],
        "informed": len(measured) == len(pair),
    }


def peer_fields(row: dict) -> dict:
    """The keys :func:`peer_cells` reads, for a suite row: ``rose_env_steps_per_s`` ((d)'s rate) and
    ``informed_peer_env_steps_per_s``: the fastest peer whose pair ((a)/(a'), (b)/(b')) was measured
    in full, with ``informed_peer`` naming that variant; None where no pair was (rows measured
    before the informed-peer method then read "not measured"). The suite times no whole runs of
    equal length, so ``end_to_end_s`` / ``peer_end_to_end_s`` stay absent."""
    pairs = [peer_pair(row, p) for p in INFORMED_PEERS]
    informed = [p for p in pairs if p["informed"]]
    best = max(informed, key=lambda p: p["env_steps_per_s"]) if informed else None
    return {
        "rose_env_steps_per_s": rate(row, "rose_jax"),
        "informed_peer": best["best"] if best else None,
        "informed_peer_env_steps_per_s": best["env_steps_per_s"] if best else None,
    }


def summarize(row: dict) -> dict:
    """The row's derived numbers: best baseline of (a)-(c) (each peer as shipped and flagged), ratio
    (d) / best, (d) against each peer's pair, overhead, break-even.

    Returns ``{"best_baseline", "best_baseline_env_steps_per_s", "ratio", "search_overhead_s",
    "breakeven_env_steps", "baselines_measured", "vs_brax", "vs_single_jit", "ratio_vs_brax",
    "ratio_vs_single_jit"}`` and :func:`peer_fields`'s keys; values are None where a number is missing.
    ``vs_<peer>`` is :func:`peer_pair`: (d) / the faster of the peer as shipped and with the flag.
    ``breakeven_env_steps``: env steps after which (d) including its search overhead has caught
    up with the best baseline (None unless (d) is faster).
    """
    measured = {v: rate(row, v) for v in BASELINES if rate(row, v) is not None}
    best = max(measured, key=measured.get) if measured else None
    best_rate = measured[best] if best else None
    d = rate(row, "rose_jax")
    ratio = d / best_rate if (d is not None and best_rate) else None
    rec = row.get("variants", {}).get("rose_jax") or {}
    overhead = rec.get("search_overhead_s")
    breakeven = None
    if ratio is not None and ratio > 1.0 and isinstance(overhead, (int, float)):
        breakeven = overhead / (1.0 / best_rate - 1.0 / d)
    pairs = {p: peer_pair(row, p) for p in INFORMED_PEERS}
    return {
        "best_baseline": best,
        "best_baseline_env_steps_per_s": best_rate,
        "ratio": ratio,
        "search_overhead_s": overhead,
        "breakeven_env_steps": breakeven,
        "baselines_measured": sorted(measured),
        **{f"vs_{p}": pair for p, pair in pairs.items()},
        **{f"ratio_vs_{p}": pair["ratio"] for p, pair in pairs.items()},
        **peer_fields(row),
    }


def with_peer_fields(row: dict) -> dict:
    """``row`` (a suite row, as stored) with :func:`peer_fields`'s keys at its top level, where
    :func:`peer_cells` reads them."""
    return {**row, **peer_fields(row)}


def pair_cell(row: dict, peer: str) -> str:
    """(d) against a peer's pair: ``1.23x ((a') Brax + flag)``; with one of the pair missing, the
    ratio to the one that ran and what the other's status was; "—" where the row has no such peer."""
    pair = (peer, INFORMED_PEERS[peer])
    recs = row.get("variants", {})
    if not any(v in recs for v in pair):
        return "—"
    p = peer_pair(row, peer)
    missing = [
        f"{SHORT[v].split()[0]} {(recs.get(v) or {}).get('status') or NOT_MEASURED}"
        for v in pair
        if v not in p["measured"]
    ]
    if p["ratio"] is None:
        return "; ".join(missing) if not p["measured"] else "—"
    text = f"{p['ratio']:.2f}x ({SHORT[p['best']]}"
    return text + (f" only; {', '.join(missing)})" if missing else ")")


# ------------------------------------------------------------------------------ formatting


def _fmt_rate(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def cell(row: dict, variant: str) -> str:
    """A variant's table cell: its env-steps/s, or its status (skipped, error) when it has none."""
    rec = row.get("variants", {}).get(variant)
    if rec is None:
        return "—"
    status = rec.get("status")
    if status == "ok":
        return _fmt_rate(rate(row, variant))
    return status or "?"


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def _sm(row: dict, variant: str | None) -> float | None:
    """A variant's mean SM activity (%), or None where it was not measured."""
    rec = (row.get("variants", {}).get(variant) or {}) if variant else {}
    value = (rec.get("sm_activity") or {}).get("mean_sm_util")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _sm_gain(row: dict, best: str | None) -> str:
    """SM activity of the best baseline -> (d), in %, for the headline (the gain the plan bought)."""
    a, d = _sm(row, best), _sm(row, "rose_jax")
    return "n/a" if a is None or d is None else f"{a:.0f} -> {d:.0f}"


def _activity(row: dict) -> str:
    parts = [f"{SHORT[v].split()[0]} {_sm(row, v):.0f}" for v in VARIANTS if _sm(row, v) is not None]
    return ", ".join(parts) if parts else "n/a"


def _plan(row: dict) -> str:
    rec = row.get("variants", {}).get("rose_jax") or {}
    plan = rec.get("plan")
    if plan is None:
        return "—"
    labels = [p.get("label") or p.get("name", "?") for p in plan]
    return " + ".join(labels) if labels else "baseline (nothing kept)"


def _setting(results: dict) -> str:
    m = results.get("machine", {})
    where = m.get("gpu") or ", ".join(m.get("devices", [])) or m.get("backend", "?")
    part = results.get("part")
    part_s = ""
    if isinstance(part, list) and part:
        part_s = f", parts {', '.join(map(str, part))}" + (
            "" if results.get("complete", True) else " (incomplete)"
        )
    elif isinstance(part, str):
        part_s = f", part {part}"
    return (
        f"{m.get('date', '?')} on {where} (backend {m.get('backend', '?')}); jax {m.get('jax', '?')}, "
        f"brax {m.get('brax', '?')}, mujoco {m.get('mujoco', '?')}{part_s}"
    )


def markdown(results: dict) -> str:
    """The suite's full Markdown: setting, main table, per-row details."""
    rows = results.get("rows", [])
    headers = [
        "workload",
        *[SHORT[v] for v in VARIANTS],
        "d / best (a-c)",
        *PAIR_COLUMNS,
        "search s",
        "SM % (a b c d)",
        "plan",
    ]
    body = []
    for row in rows:
        s = row.get("summary") or summarize(row)
        body.append(
            [
                row["name"],
                *[cell(row, v) for v in VARIANTS],
                "—" if s["ratio"] is None else f"{s['ratio']:.3f}",
                *[pair_cell(row, p) for p in INFORMED_PEERS],
                _fmt(s["search_overhead_s"]),
                _activity(row),
                _plan(row),
            ]
        )
    lines = [
        f"# Benchmark suite `{results.get('suite', '?')}`",
        "",
        _setting(results) + ".",
        f"Command: `{results.get('command') or results.get('machine', {}).get('command', '?')}`",
        "",
        *_activity_note(results),
        "Env-steps/s after warm-up (median over timed blocks; compilation excluded). "
        "(a) Brax's own trainer (`training/sps`), (b) our algorithm K iterations per jitted `lax.scan`, "
        "(c) (b) with a hand-written 2-group staggered rollout, (d) `rose_jax.optimize`'s plan run like (b) "
        "(its search time is listed separately). Each peer also runs with the best global XLA flags we "
        "know, in the same device call: (a') Brax's trainer in a child process with "
        f"`XLA_FLAGS={PEER_XLA_FLAGS}`, (b') (b)'s program compiled with the option set "
        f"`{PEER_OPTION_SET}` (on a CPU: no options). Ratio = (d) / best of (a)-(c) including (a') and "
        "(b'); the pair columns give (d) against the faster of (a)/(a') and of (b)/(b'). "
        "Rows named `...-epoch` time Brax's train loop instead: a call is several epochs, each K training "
        "iterations then an evaluation episode of the deterministic policy; env-steps/s counts training "
        "steps over the whole wall time, evaluation included, for (a) too (its time between progress "
        "reports); work a plan runs behind the next epoch is waited for at the end of each call. "
        "`skipped`/`error`: see details. "
        "Max abs Δparams vs (b): parameters after each variant's first call from the same state, both "
        "compiled with XLA's default ops, whose GPU atomics make (b) itself not repeatable (on the H200 "
        "one SAC iteration from one state differed by up to 1.75 between two runs), so on a GPU it is not "
        "an equality test; the optimizer's equality check (its candidates table) recompiles both "
        "programs under `xla_gpu_deterministic_ops` and compares the state.",
        "",
        common.markdown_table(headers, body) if body else "(no rows)",
        "",
    ]
    for row in rows:
        lines += _details(row)
    return "\n".join(lines).rstrip() + "\n"


def _activity_note(results: dict) -> list[str]:
    act = (results.get("settings") or {}).get("sm_activity") or {}
    if act.get("available") is False:
        return [f"SM activity: not measured ({act.get('reason', 'no GPU')}).", ""]
    return []


def _details(row: dict) -> list[str]:
    w = row.get("workload", {})
    out = [
        f"## {row['name']}",
        "",
        f"{w.get('algo', '?')} on `{w.get('env', '?')}`"
        + (f" ({w['backend']})" if w.get("backend") else "")
        + f", {w.get('num_envs')} envs, policy {w.get('policy_hidden_sizes')}, "
        f"{row.get('env_steps_per_iteration')} env steps per iteration, "
        + (
            f"one call = {w.get('epochs_per_block')} epochs of K={w.get('iterations_per_block')} training "
            f"iterations + an evaluation of {w.get('eval_envs')} envs x {w.get('episode_length')} steps; "
            f"{w.get('blocks')} timed calls."
            if w.get("unit") == "epoch"
            else f"K={w.get('iterations_per_block')} iterations x {w.get('blocks')} timed blocks."
        ),
        "",
    ]
    headers = [
        "variant",
        "status",
        "env-steps/s",
        "blocks",
        "warm-up s",
        "max abs Δparams vs (b)",
        "SM %",
        "time to threshold s",
        "note",
    ]
    body = []
    for v in VARIANTS:
        rec = row.get("variants", {}).get(v)
        if rec is None:
            continue
        act = rec.get("sm_activity") or {}
        ttt = rec.get("time_to_threshold") or {}
        ttt_s = "—"
        if ttt.get("reached") is True:
            ttt_s = _fmt(ttt.get("seconds"))
        elif ttt.get("reached") is False:
            ttt_s = f"> {_fmt(ttt.get('seconds'))}"
        note = rec.get("error") or rec.get("reason") or rec.get("note") or ""
        body.append(
            [
                LABELS[v],
                rec.get("status", "?"),
                _fmt_rate(rate(row, v)),
                ", ".join(f"{b:,.0f}" for b in rec.get("blocks", [])) or "—",
                _fmt(rec.get("warmup_s")),
                _fmt(rec.get("max_abs_diff_vs_single_jit")),
                _fmt(act.get("mean_sm_util")) if "mean_sm_util" in act else "n/a",
                ttt_s,
                str(note).replace("|", "/")[:160],
            ]
        )
    out += [common.markdown_table(headers, body), ""]
    rec = row.get("variants", {}).get("rose_jax") or {}
    cands = (rec.get("report") or {}).get("candidates") or []
    if cands:
        out += ["Optimizer candidates:", ""]
        out += [
            common.markdown_table(
                ["candidate", "stage", "speedup", "equal", "kept", "reason"],
                [
                    [
                        c.get("label"),
                        c.get("stage"),
                        _fmt(c.get("speedup")),
                        common.fmt_equal(c.get("equal")),
                        c.get("kept"),
                        str(c.get("reason", "")).replace("|", "/")[:120],
                    ]
                    for c in cands
                ],
            ),
            "",
        ]
    return out


def _not_measured(row: dict) -> str:
    """The row's baselines (a)-(c) that it lists but did not measure, with why (e.g. the time budget):
    its ratio is then against the best of those that ran."""
    out = []
    for v in BASELINES:
        rec = row.get("variants", {}).get(v)
        if rec is not None and rec.get("status") != "ok":
            why = str(rec.get("reason") or rec.get("status"))
            out.append(f"{SHORT[v]} {rec.get('status')}" + (" (time budget)" if "budget" in why else ""))
    return ", ".join(out) or "—"


NOT_MEASURED = "not measured"
PEER_COLUMNS = ["informed peer env-steps/s (rose-jax vs it)", "end to end s (rose-jax vs peer)"]


def peer_cells(row: dict) -> list[str]:
    """The informed-peer and end-to-end cells of a speedup table's row: from the row's
    ``informed_peer_env_steps_per_s`` (the peer run with the best global XLA flags) and
    ``end_to_end_s`` / ``peer_end_to_end_s`` (whole runs, compile included) where the row has them,
    else "not measured" (rows measured before the informed-peer method, issue 30)."""
    rose = row.get("rose_env_steps_per_s")
    peer = row.get("informed_peer_env_steps_per_s")
    a = NOT_MEASURED if not peer else (
        f"{_fmt_rate(peer)}" + (f" ({rose / peer:.2f}x)" if rose else ""))
    e2e, peer_e2e = row.get("end_to_end_s"), row.get("peer_end_to_end_s")
    b = NOT_MEASURED if not (e2e and peer_e2e) else f"{e2e:.0f} vs {peer_e2e:.0f} ({peer_e2e / e2e:.2f}x)"
    return [a, b]


PAIR_COLUMNS = ["d / faster of (a), (a')", "d / faster of (b), (b')"]


def headline(results: dict, source: str) -> str:
    """The README block: one line of setting and a short table (workload, best baseline, rose-jax, ratio,
    rose-jax against each peer's pair, the informed-peer columns)."""
    rows = results.get("rows", [])
    body = []
    for row in rows:
        s = row.get("summary") or summarize(row)
        best = s["best_baseline"]
        body.append(
            [
                row["name"],
                "—" if best is None else f"{_fmt_rate(s['best_baseline_env_steps_per_s'])} {SHORT[best]}",
                cell(row, "rose_jax"),
                "—" if s["ratio"] is None else f"{s['ratio']:.2f}x",
                *[pair_cell(row, p) for p in INFORMED_PEERS],
                _sm_gain(row, best),
                _fmt(s["search_overhead_s"]),
                _plan(row),
                _not_measured(row),
                *peer_cells(with_peer_fields(row)),
            ]
        )
    table = common.markdown_table(
        [
            "workload", "best baseline env-steps/s", "rose-jax env-steps/s", "ratio", *PAIR_COLUMNS,
            "SM % best -> rose-jax", "search s", "plan", "baselines not measured", *PEER_COLUMNS,
        ],
        body,
    )
    epoch = any((row.get("workload") or {}).get("unit") == "epoch" for row in rows)
    flagged = any(
        p in (row.get("variants") or {}) for row in rows for p in ("brax_flags", "single_jit_flags")
    )
    peers = (
        "each peer (Brax's trainer, our single-jit loop) as shipped and with the best "
        f"global XLA flags we know (`{PEER_XLA_FLAGS}`), in the same device call; the informed peer is the "
        "fastest peer measured both ways. "
        if flagged
        else "each peer as shipped only: these rows were measured before the suite ran the peers with "
        f"the informed flag (`{PEER_XLA_FLAGS}`), so every informed-peer column says not measured. "
    )
    return (
        f"Suite `{results.get('suite')}`: {_setting(results)}. Env-steps/s after warm-up; "
        "the best baseline is the fastest of Brax's own trainer, our single-jit loop and a hand-written "
        "env-group pipeline, "
        + peers
        + (
            "Epoch rows time Brax's train loop (training iterations, then an evaluation episode, per "
            "epoch): env-steps/s counts training steps over the whole wall time, evaluation included. "
            if epoch
            else ""
        )
        + f"Generated from `{source}` by `python -m benchmarks.suite.report --readme`; details in "
        f"`{os.path.splitext(source)[0]}.md`.\n\n{table}\n"
    )


# ------------------------------------------------------------------------------ files


def suite_dir(suite: str, root: str | None = None) -> str:
    return os.path.join(root or SUITE_DIR, suite)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def merge_parts(directory: str) -> dict | None:
    """Combine the ``part-i-of-n.json`` files of the largest complete-or-not ``n`` (rows in part order).

    Returns the merged results (``part`` lists the parts present), or None when there are no parts.
    """
    found: dict[int, dict[int, str]] = {}
    for path in glob.glob(os.path.join(directory, "part-*-of-*.json")):
        m = re.fullmatch(r"part-(\d+)-of-(\d+)\.json", os.path.basename(path))
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
    if not found:
        return None
    n = max(found, key=lambda k: (len(found[k]), k))
    parts = [load(found[n][i]) for i in sorted(found[n])]
    merged = dict(parts[-1])
    merged["rows"] = [row for p in parts for row in p.get("rows", [])]
    merged["part"] = [f"{i}/{n}" for i in sorted(found[n])]
    merged["complete"] = len(found[n]) == n
    merged["machines"] = [p.get("machine") for p in parts]
    merged["command"] = "; ".join(dict.fromkeys(p.get("command", "") for p in parts))
    return merged


def plot(results: dict, path: str) -> None:
    """Grouped bars of env-steps/s per workload and variant (log scale), ratio above (d)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("rows", [])
    colors = {
        "brax": "tab:gray",
        "brax_flags": "dimgray",
        "single_jit": "tab:blue",
        "single_jit_flags": "tab:cyan",
        "hand_pipelined": "tab:green",
        "rose_jax": "tab:red",
    }
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows) + 2.0), 3.8))
    width = 0.8 / len(VARIANTS)
    for j, v in enumerate(VARIANTS):
        xs, ys = [], []
        for i, row in enumerate(rows):
            r = rate(row, v)
            if r is not None:
                xs.append(i + (j - (len(VARIANTS) - 1) / 2) * width)
                ys.append(r)
        ax.bar(xs, ys, width=width, color=colors[v], label=LABELS[v])
        if v == "rose_jax":
            for x, y, row in zip(xs, ys, [r for r in rows if rate(r, v) is not None], strict=True):
                ratio = (row.get("summary") or summarize(row))["ratio"]
                if ratio is not None:
                    ax.text(x, y, f"{ratio:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"] for r in rows], rotation=20, ha="right", fontsize=8)
    if any(rate(r, v) for r in rows for v in VARIANTS):
        ax.set_yscale("log")
    ax.set_ylabel("env-steps/s (after warm-up)")
    machine = results.get("machine", {})
    ax.set_title(
        f"suite {results.get('suite')}: {machine.get('gpu') or machine.get('backend', '')}"[:90],
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="best")
    ax.grid(axis="y", alpha=0.3)
    command = results.get("command") or machine.get("command", "")
    fig.text(0.01, -0.12, f"{_setting(results)}\n{command}"[:400], fontsize=6, ha="left", va="top", wrap=True)
    common.save_plot(fig, path)


def write_outputs(results: dict, directory: str, stem: str = "results", png: bool = True) -> list[str]:
    """Write ``<stem>.json`` (with summaries), ``<stem>.md`` and (``png``) ``<stem>.png``; returns paths."""
    for row in results.get("rows", []):
        row["summary"] = summarize(row)
        row.update(peer_fields(row))
    base = os.path.join(directory, stem)
    atomic_write_json(base + ".json", results)
    atomic_write_text(base + ".md", markdown(results))
    paths = [base + ".json", base + ".md"]
    if png:
        plot(results, base + ".png")
        paths.append(base + ".png")
    return paths


def regenerate(suite: str, root: str | None = None) -> list[str]:
    """Rewrite a suite's ``results.*`` from its JSON (merging parts when there are any)."""
    directory = suite_dir(suite, root)
    merged = merge_parts(directory)
    if merged is not None:
        return write_outputs(merged, directory)
    path = os.path.join(directory, "results.json")
    if not os.path.exists(path):
        raise ValueError(
            f"no results for suite {suite!r}: {path} does not exist "
            f"(run python -m benchmarks.suite.run --suite {suite})"
        )
    return write_outputs(load(path), directory)


# ------------------------------------------------------------------------------ README


def replace_block(text: str, block: str) -> str:
    """``text`` with everything between the RESULTS markers replaced by ``block``.

    Only the marked block changes. If the closing marker is missing it is added right after the
    block (whatever followed the opening marker is kept after it). No opening marker: ValueError.
    """
    i = text.find(START)
    if i < 0:
        raise ValueError(
            f"README has no {START} marker: add '{START}' and '{END}' where the results table goes"
        )
    head_end = i + len(START)
    j = text.find(END, head_end)
    body = "\n" + block.strip("\n") + "\n"
    if j < 0:
        rest = text[head_end:]
        return text[:head_end] + body + END + ("\n" if not rest.startswith("\n") else "") + rest
    return text[:head_end] + body + text[j:]


def _suite_headline(name: str, root: str | None, complete_only: bool = False) -> str | None:
    """``name``'s headline block, or None when it has no rows (parts are merged first) or, with
    ``complete_only``, when some of its parts are missing."""
    directory = suite_dir(name, root)
    path = os.path.join(directory, "results.json")
    results = merge_parts(directory) or (load(path) if os.path.exists(path) else None)
    if not (results and results.get("rows")):
        return None
    if complete_only and results.get("complete") is False:
        return None
    return headline(results, os.path.relpath(path, os.path.dirname(README)))


# Experiments whose results.json rows share the fields workload / baseline_env_steps_per_s /
# rose_env_steps_per_s / speedup / equal / plan (issues' acceptance schema): folder, title.
EXPERIMENTS = (
    ("overlap", "Overlap inside one program (`python -m benchmarks.experiments.overlap`); baseline = the "
     "faster of our single-jit loop and Brax's own trainer as shipped (XLA's default flags, timed in "
     "separate `--brax-only` calls)"),
    ("loops", "MJX's solver while loop: bounded masked scan vs XLA command-buffer options, plan = the "
     "fastest equal variant (`python -m benchmarks.experiments.loops`)"),
)


def experiment_headline(name: str, title: str, root: str | None = None) -> str | None:
    """A short README table for ``benchmarks/results/<name>/results.json`` (None if absent/empty)."""
    path = os.path.join(root or common.RESULTS_DIR, name, "results.json")
    if not os.path.exists(path):
        return None
    doc = load(path)
    rows = [r for r in doc.get("rows", []) if r.get("baseline_env_steps_per_s") is not None]
    if not rows:
        return None
    machine = doc.get("machine") or {}
    body = [
        [
            r["workload"],
            _fmt_rate(r["baseline_env_steps_per_s"])
            + (" (Brax)" if r.get("baseline") == "Brax train" else ""),
            _fmt_rate(r.get("rose_env_steps_per_s")),
            "—" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
            common.fmt_equal(r.get("equal")),
            r.get("plan") or "none",
        ]
        for r in rows
    ]
    header = ["workload", "baseline env-steps/s", "rose-jax env-steps/s", "speedup", "equal", "plan"]
    if any(r.get("brax_env_steps_per_s") for r in rows):
        # rows that also timed Brax's own trainer on the same workload (loops --brax)
        header.append("Brax's trainer as shipped, env-steps/s (rose-jax vs it)")
        for line, r in zip(body, rows, strict=True):
            brax = r.get("brax_env_steps_per_s")
            line.append(
                f"{_fmt_rate(brax)} ({r['rose_env_steps_per_s'] / brax:.2f}x)"
                if brax and r.get("rose_env_steps_per_s")
                else ""
            )
    header += PEER_COLUMNS
    for line, r in zip(body, rows, strict=True):
        line += peer_cells(r)
    table = common.markdown_table(header, body)
    gpu = machine.get("gpu") or machine.get("platform", "?")
    when = f"{doc.get('date') or machine.get('date', '?')} on {gpu}"
    source = os.path.relpath(path, os.path.dirname(README))
    return (
        f"{title}: {when}; jax {machine.get('jax', '?')}. Generated from `{source}`; details in "
        f"`{os.path.splitext(source)[0]}.md`.\n\n{table}\n"
    )


def _reached(seconds, reached: str | None) -> str:
    """A median time to a return, with how many runs reached it (``"2/3"``) where recorded."""
    return common.fmt(seconds, ".0f") + (f" ({reached})" if reached else "")


def parity_headline(root: str | None = None) -> str | None:
    """The Brax parity summary (benchmarks/results/brax_parity) as a short README table."""
    path = os.path.join(root or common.RESULTS_DIR, "brax_parity", "results.json")
    if not os.path.exists(path):
        return None
    doc = load(path)
    summary = doc.get("summary") or []
    if not summary:
        return None
    machine = doc.get("machine") or {}
    body = [
        [
            f"{s['algo']} {s['env']}",
            "—" if s.get("num_timesteps") is None else f"{s['num_timesteps']:,}",
            s.get("runs", "1/1"),
            common.fmt(s.get("brax_return"), ".0f"),
            common.fmt(s.get("rose_jax_return"), ".0f"),
            _reached(s.get("brax_s_to_brax_final"), s.get("brax_reached")),
            _reached(s.get("rose_jax_s_to_brax_final"), s.get("rose_jax_reached")),
        ]
        for s in summary
    ]
    table = common.markdown_table(
        [
            "Brax config",
            "num_timesteps",
            "runs (Brax/rose-jax)",
            "Brax eval return",
            "rose-jax eval return",
            "Brax s to it",
            "rose-jax s to it",
        ],
        body,
    )
    source = os.path.relpath(path, os.path.dirname(README))
    return (
        f"Brax's published configs, Brax's `train` vs rose-jax's drop-in "
        f"(`python -m benchmarks.experiments.brax_parity`): {machine.get('date', '?')} on "
        f"{machine.get('gpu') or machine.get('platform', '?')}; jax {machine.get('jax', '?')}. "
        f"\"s to it\": median seconds from `train()` to the mean of Brax's final returns, over the runs "
        f"that reached it (in brackets: runs that reached it / runs). Generated from "
        f"`{source}`; details in `{os.path.splitext(source)[0]}.md`.\n\n{table}\n"
    )


def _summary_rows(name: str, root: str | None) -> tuple[str, dict, list] | None:
    """(path, document, its ``summary`` rows) of ``benchmarks/results/<name>/results.json``; None
    when the file is absent or holds no rows."""
    path = os.path.join(root or common.RESULTS_DIR, name, "results.json")
    if not os.path.exists(path):
        return None
    doc = load(path)
    rows = doc.get("summary") or []
    return (path, doc, rows) if rows else None


def informed_peer_headline(root: str | None = None) -> str | None:
    """``benchmarks/results/informed_peer`` (Brax's trainers as shipped and with the best flag vs
    ``rose-jax train`` first and cached, whole runs) as the README's first table."""
    found = _summary_rows("informed_peer", root)
    if found is None:
        return None
    path, doc, rows = found

    def e2e(r, v):
        m, sp = (r.get("end_to_end_s") or {}).get(v), (r.get("spread") or {}).get(v)
        n = (r.get("repeats") or {}).get(v, 0)
        return "—" if m is None else f"{m:.0f} ({sp[0]:.0f}-{sp[1]:.0f}, n={n})"

    body = [[r["workload"], f"{r['num_timesteps']:,}" if r.get("num_timesteps") else "—",
             _fmt_rate(r.get("peer_default_env_steps_per_s")), _fmt_rate(r.get("peer_flags_env_steps_per_s")),
             _fmt_rate(r.get("rose_env_steps_per_s")),
             "—" if r.get("speedup_vs_informed_peer") is None else f"{r['speedup_vs_informed_peer']:.2f}x",
             e2e(r, "peer_default"), e2e(r, "peer_flags"), e2e(r, "rose_first"), e2e(r, "rose_cached"),
             r.get("plan") or "—", common.fmt_equal(r.get("equal"))] for r in rows]
    table = common.markdown_table(
        ["workload", "env steps", "Brax as shipped", "Brax + flag", "rose-jax", "vs informed peer",
         "Brax s", "Brax + flag s", "rose-jax first s", "rose-jax cached s", "plan", "equal"], body)
    machine = doc.get("machine") or {}
    source = os.path.relpath(path, os.path.dirname(README))
    has_notes = os.path.exists(os.path.join(os.path.dirname(path), "notes.md"))
    notes = os.path.join(os.path.dirname(source), "notes.md") if has_notes else ""
    return (
        "Against the informed peer, end to end (`python -m benchmarks.experiments.informed_peer`): "
        f"{machine.get('date', '?')} on {machine.get('gpu') or machine.get('backend', '?')}; jax "
        f"{machine.get('jax', '?')}, brax {machine.get('brax', '?')}. Brax's own trainer with Brax's "
        "published "
        "keywords as shipped and with `XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`, vs "
        "`rose-jax train` with the same keywords (first run on empty caches, then cached); steady "
        "env-steps/s (the rate between progress reports, evaluation included) "
        "and whole runs in their own processes (s: median, min-max, n repeats). Generated from "
        f"`{source}`; details in `{os.path.splitext(source)[0]}.md`"
        + (f" and `{notes}` (what was not measured)" if notes else "")
        + f".\n\n{table}\n"
    )


def beyond_flags_headline(root: str | None = None) -> str | None:
    """``benchmarks/results/beyond_flags``'s acceptance rows (issue 32: Brax's trainer as shipped /
    with the flag vs ``rose-jax train`` and ``rose-jax train --optimize``, each row from one device
    call) as a README table; None until a row was measured."""
    path = os.path.join(root or common.RESULTS_DIR, "beyond_flags", "results.json")
    if not os.path.exists(path):
        return None
    rates = ("peer_default_env_steps_per_s", "peer_flags_env_steps_per_s", "flags_only_env_steps_per_s",
             "rose_env_steps_per_s")
    # rows that measured something (a call cut before any run finished is in the results file only)
    rows = [r for r in load(path).get("acceptance") or []
            if "error" not in r and any(r.get(k) for k in rates)]
    if not rows:
        return None

    from benchmarks.experiments import beyond_flags as bf  # its cell rules, one copy

    def target(r):
        met = r.get("target_met")
        return f"{r.get('target')}x: " + ("not established" if met is None else ("met" if met else "missed"))

    def x(v):
        return "—" if v is None else f"{v:.3f}x"

    body = [[r["workload"] + (" (partial)" if r.get("partial") else ""),
             f"{r.get('date', '?')} ({(r.get('device') or '?').split(',')[0]})",
             f"{r['num_timesteps']:,}" if r.get("num_timesteps") else "—",
             _fmt_rate(r.get("peer_default_env_steps_per_s")), _fmt_rate(r.get("peer_flags_env_steps_per_s")),
             _fmt_rate(r.get("flags_only_env_steps_per_s")), _fmt_rate(r.get("rose_env_steps_per_s")),
             bf.vs_peer_cell(r, unit="x", missing="—"),
             x(r.get("speedup_vs_flags_only")),
             target(r),
             "; ".join(r.get("plan") or []) or "—", common.fmt_equal(r.get("equal")),
             bf.end_to_end_cell(r)] for r in rows]
    table = common.markdown_table(
        ["workload", "measured", "env steps", "Brax as shipped", "Brax + flag", "rose-jax (flags only)",
         "rose-jax --optimize", "vs informed peer", "vs flags only", "target", "plan", "equal",
         "end to end s"], body)
    source = os.path.relpath(path, os.path.dirname(README))
    return (
        "Beyond the flag, issue 32's table (`python -m benchmarks.experiments.beyond_flags --acceptance`): "
        "per row, in one device call (or folded from earlier calls on the same warm machine, as the "
        "results file's notes name them), Brax's own trainer with the flag (and as shipped where measured), "
        "`rose-jax train` (its option trial: the best options alone) and `rose-jax train --optimize` on "
        "empty caches (the plan the search finds with default candidate generation); steady env-steps/s "
        "between progress reports, whole runs in their own processes. Generated from "
        f"`{source}`; the floor of each missed row in `{os.path.splitext(source)[0]}.md`, details in "
        f"`{os.path.join(os.path.dirname(source), 'notes.md')}`.\n\n"
        + "\n".join(bf.standing_lines(rows)[2:])  # the standing (its heading is the results file's)
        + f"\nEvery call:\n\n{table}\n"
        + "".join(f"\n- {r['workload']}, {r.get('date', '?')}: {r['note']}" for r in rows if r.get("note"))
        + ("\n" if any(r.get("note") for r in rows) else "")
    )


def default_options_headline(root: str | None = None) -> str | None:
    """``benchmarks/results/default_options`` (``rose-jax train`` as shipped vs XLA's defaults and
    the informed user's flag on the same loop, whole runs) as a README table."""
    found = _summary_rows("default_options", root)
    if found is None:
        return None
    path, doc, rows = found

    def cell(e, v):
        x = e.get(v) or {}
        m, sp = x.get("end_to_end_s"), x.get("end_to_end_spread")
        return "—" if m is None else f"{m:.1f} ({sp[0]:.1f}-{sp[1]:.1f}, n={x.get('repeats')})"

    body = []
    for e in rows:
        rates = {v: (e.get(v) or {}).get("steady_env_steps_per_s") for v in ("xla_defaults", "peer_flags",
                                                                               "rose_default")}
        sp, ee = e.get("speedup_vs_informed_peer"), e.get("end_to_end_vs_informed_peer")
        body.append([e["workload"], _fmt_rate(rates["xla_defaults"]), _fmt_rate(rates["peer_flags"]),
                     _fmt_rate(rates["rose_default"]), "—" if sp is None else f"{sp:.2f}x",
                     cell(e, "xla_defaults"), cell(e, "peer_flags"), cell(e, "rose_default"),
                     "—" if ee is None else f"{ee:.2f}x"])
    table = common.markdown_table(
        ["workload", "XLA defaults env-steps/s", "informed peer (flag) env-steps/s", "rose-jax env-steps/s",
         "vs informed peer", "XLA defaults s", "informed peer s", "rose-jax s",
         "end to end vs informed peer"],
        body)
    machine = doc.get("machine") or {}
    source = os.path.relpath(path, os.path.dirname(README))
    return (
        "`rose-jax train` as shipped vs the same loop under XLA's defaults and under the informed user's "
        "flag (`python -m benchmarks.experiments.default_options`): "
        f"{machine.get('date', '?')} on {machine.get('gpu') or machine.get('backend', '?')}; jax "
        f"{machine.get('jax', '?')}. Whole runs in their own processes, compile cache off (s: median, "
        f"min-max, n repeats). Generated from `{source}`; details in `{os.path.splitext(source)[0]}.md`."
        f"\n\n{table}\n"
    )


def multiprocess_headline(root: str | None = None) -> str | None:
    """Several processes on one GPU (benchmarks/results/multiprocess: ``sweep.json`` and
    ``env_groups.json``) as a short README table: aggregate env-steps/s of K seeds vmapped / as MPS
    processes vs one after another, env groups in processes vs the fused iteration, the offloaded
    evaluation with and without its SM quota."""
    base = os.path.join(root or common.RESULTS_DIR, "multiprocess")
    body, sources, when, run_note = [], [], None, ""
    sweep_path = os.path.join(base, "sweep.json")
    if os.path.exists(sweep_path):
        doc = load(sweep_path)
        s, w = doc.get("summary") or {}, doc.get("workload") or {}
        what = (
            f"{w.get('seeds', '?')} seeds of {w.get('algo', '?').upper()} {w.get('env', '?')} "
            f"{w.get('config', {}).get('num_envs', '?')} envs"
        )
        seq = s.get("sequential_rate")
        # end to end: all env steps over the phase's whole wall time (process start and compilation
        # included), beside the timed window (compilation excluded) the summary's rates are
        phases = doc.get("phases") or {}
        seq_e2e = (phases.get("sequential") or {}).get("end_to_end_rate")
        for label, key in (
            ("vmapped (one program)", "vmapped"),
            ("MPS processes, slack-aware quotas", "mps"),
            ("MPS processes, no quotas", "mps_no_quota"),
        ):
            quotas = ((phases.get(key) or {}).get("sweep") or {}).get("quotas") or []
            if key == "mps" and quotas and None not in quotas:
                label += f" ({'/'.join(map(str, quotas))} %)"
            if s.get(f"{key}_rate") is not None:
                body.append(
                    [
                        f"{what}: {label}, timed",
                        _fmt_rate(seq),
                        _fmt_rate(s[f"{key}_rate"]),
                        "—" if s.get(f"{key}_speedup") is None else f"{s[f'{key}_speedup']:.2f}x",
                    ]
                )
            e2e = (phases.get(key) or {}).get("end_to_end_rate")
            if e2e and seq_e2e:
                body.append(
                    [
                        f"{what}: {label}, end to end",
                        _fmt_rate(seq_e2e),
                        _fmt_rate(e2e),
                        f"{e2e / seq_e2e:.2f}x",
                    ]
                )
        iters, spi = w.get("iterations_per_run"), w.get("env_steps_per_iteration")
        run_note = f"; each run {iters} iterations ({iters * spi:,} env steps)" if iters and spi else ""
        sources.append(os.path.relpath(sweep_path, os.path.dirname(README)))
        when = (doc.get("machine") or {}, doc.get("machine", {}).get("date"))
    groups_path = os.path.join(base, "env_groups.json")
    if os.path.exists(groups_path):
        doc = load(groups_path)
        for r in doc.get("rows", []):
            if "skipped" in r:
                continue
            if r.get("kind") == "groups":
                body.append(
                    [
                        f"PPO ant {r['num_envs']} envs, policy {r['policy']}: {r['groups']} env groups "
                        "in processes",
                        f"{r['fused_ms']:.1f} ms/iter (fused)",
                        f"{r['processes_ms']:.1f} ms/iter",
                        f"{r['speedup']:.2f}x",
                    ]
                )
            elif r.get("kind") == "offload" and r.get("speedup_quota") is not None:
                what = f"PPO ant {r['num_envs']} envs, Brax's train-loop epoch: evaluation offloaded" + (
                    ""
                    if (r.get("epochs_per_timed_run") or 1) > 1
                    else " (one epoch per timed run: no overlap with a next epoch possible)"
                )
                status = r.get("quota_status") or "?"
                if r.get("speedup_no_quota") is not None:
                    body.append(
                        [
                            f"{what}, no quotas",
                            f"{r['baseline_s']:.2f} s/epoch",
                            f"{r['offload_s']:.2f} s/epoch",
                            f"{r['speedup_no_quota']:.2f}x",
                        ]
                    )
                body.append(
                    [
                        f"{what}, slack-aware quotas {r.get('quotas')} (driver, worker): {status}",
                        f"{r['baseline_s']:.2f} s/epoch",
                        f"{r['offload_quota_s']:.2f} s/epoch",
                        f"{r['speedup_quota']:.2f}x",
                    ]
                )
        sources.append(os.path.relpath(groups_path, os.path.dirname(README)))
        when = when or (doc.get("machine") or {}, doc.get("machine", {}).get("date"))
    if not body:
        return None
    machine, date = when
    for line in body:  # the sweep's end-to-end rows are their own rows; no informed peer ran here
        label = line[0]
        line += [NOT_MEASURED, "this row" if label.endswith("end to end") else
                 "the next row" if label.endswith(", timed") else NOT_MEASURED]
    table = common.markdown_table(["workload", "baseline", "rose-jax", "speedup", *PEER_COLUMNS], body)
    return (
        "Several processes on one GPU (`python -m benchmarks.experiments.sweep`, "
        f"`python -m benchmarks.experiments.env_groups --mps-client`): {date} on "
        f"{machine.get('gpu') or machine.get('platform', '?')}; jax {machine.get('jax', '?')}. Sweep rows: "
        "aggregate env-steps/s vs the same runs one after another, timed (compilation and process start "
        f"excluded) and end to end (all env steps over the whole wall time, both included){run_note}. "
        "Generated from "
        + ", ".join(f"`{p}`" for p in sources)
        + f".\n\n{table}\n"
    )


def readme_block(suite: str = "auto", root: str | None = None) -> str:
    """The README block for ``suite``.

    ``auto``: the training-iteration suite (``full`` once all its parts are in, else ``quick``: a
    few parts of the full grid do not replace the quick table), then the ``epoch`` suite (Brax's
    train loop) when it has rows, then the experiments with committed results (overlap, loops,
    Brax parity); each with its own setting line and table. ``root``: the suites' folder (the
    experiments are looked up beside it).
    """
    if suite != "auto":
        block = _suite_headline(suite, root)
        if block is None:
            raise ValueError(f"no results for suite {suite!r} under {suite_dir(suite, root)}")
        return block
    main = _suite_headline("full", root, complete_only=True) or _suite_headline("quick", root)
    results_root = None if root is None else os.path.dirname(root)
    blocks = [
        b
        for b in (
            informed_peer_headline(results_root),
            beyond_flags_headline(results_root),
            default_options_headline(results_root),
        )
        if b
    ]
    blocks += [b for b in (main, _suite_headline("epoch", root)) if b]
    blocks += [b for b in (experiment_headline(n, t, results_root) for n, t in EXPERIMENTS) if b]
    blocks += [b for b in (multiprocess_headline(results_root), parity_headline(results_root)) if b]
    if blocks:
        return "\n".join(blocks)
    return (
        "No GPU benchmark results yet. On a GPU machine run `python -m benchmarks.suite.run --suite quick`, "
        "then `python -m benchmarks.suite.report --readme`.\n"
    )


def update_readme(path: str = README, suite: str = "auto", root: str | None = None) -> str:
    """Regenerate the README's RESULTS block from the suite JSON; returns the new block."""
    with open(path) as f:
        text = f.read()
    block = readme_block(suite, root)
    new = replace_block(text, block)
    if new != text:
        atomic_write_text(path, new)
    return block


# ------------------------------------------------------------------------------ results files

BENCHMARKS_README = os.path.join(common.BENCHMARKS_DIR, "README.md")
_BRACES = re.compile(r"\{([^{}]*)\}")


def committed_results(results_dir: str | None = None) -> list[str]:
    """Every committed file under ``results_dir`` (default benchmarks/results), spelled as
    benchmarks/README.md spells them (``results/...``), sorted: git's tracked files that exist; outside
    a git checkout (or with nothing tracked there), every file."""
    results_dir = os.path.abspath(results_dir or common.RESULTS_DIR)
    base, name = os.path.split(results_dir)
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", name], cwd=base, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    files = [f for f in out.split("\0") if f and os.path.isfile(os.path.join(base, f))]
    if not files:
        files = [
            os.path.relpath(os.path.join(d, f), base) for d, _, names in os.walk(results_dir) for f in names
        ]
    return sorted(f.replace(os.sep, "/") for f in files)


def recorded_command(path: str) -> str | None:
    """The command line a results file records: a JSON's ``command`` (or ``machine.command``, or
    ``argv``), a Markdown or text file's first ``command: `...` `` (any case); None where there is none
    (images, most logs: benchmarks/README.md names the command of those)."""
    if path.endswith(".json"):
        try:
            doc = load(path)
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict):
            return None
        machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
        cmd = doc.get("command") or machine.get("command") or doc.get("argv")
    elif path.endswith((".md", ".txt", ".log")):
        with open(path, errors="replace") as f:
            m = re.search(r"command:?\s*`([^`]+)`", f.read(200_000), flags=re.I)
        cmd = m.group(1) if m else None
    else:
        return None
    if isinstance(cmd, list):
        cmd = " ".join(map(str, cmd))
    return cmd or None


def results_files_table(results_dir: str | None = None) -> str:
    """Markdown: every committed results file and the command it records ('-': none; see
    benchmarks/README.md), to write and check that README's list from."""
    results_dir = os.path.abspath(results_dir or common.RESULTS_DIR)
    base = os.path.dirname(results_dir)
    rows = [
        [f"`{f}`", (recorded_command(os.path.join(base, f)) or "-").replace("|", "/")]
        for f in committed_results(results_dir)
    ]
    return common.markdown_table(["file", "command it records"], rows)


def expand_braces(pattern: str) -> list[str]:
    """``a.{json,md}`` -> ``["a.json", "a.md"]`` (several groups: every combination, in order)."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    return [
        p
        for alt in m.group(1).split(",")
        for p in expand_braces(pattern[: m.start()] + alt.strip() + pattern[m.end() :])
    ]


def listed_results(text: str) -> set[str]:
    """The files a benchmarks/README.md text lists under ``## Results``: the backticked ``results/...``
    paths in the first cell of each table row, brace groups expanded."""
    section = next((s for s in re.split(r"^## ", text, flags=re.M) if s.startswith("Results")), "")
    out: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| "):
            for token in re.findall(r"`(results/[^`]+)`", line.split(" | ")[0]):
                out.update(expand_braces(token))
    return out


def results_listing_gaps(
    readme: str = BENCHMARKS_README, results_dir: str | None = None
) -> tuple[list[str], list[str]]:
    """(committed results files ``readme`` does not list, files it lists that are not committed)."""
    with open(readme) as f:
        listed = listed_results(f.read())
    files = set(committed_results(results_dir))
    return sorted(files - listed), sorted(listed - files)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Regenerate suite tables/plots and the README results block from JSON."
    )
    p.add_argument("--suite", default=None, help="suite name (default: every suite found; README: auto)")
    p.add_argument(
        "--readme", action="store_true", help="rewrite the README block between the RESULTS markers"
    )
    p.add_argument("--readme-path", default=README, help="the README to update (default: the repo's)")
    p.add_argument("--results-dir", default=None, help=f"suite results root (default {SUITE_DIR})")
    p.add_argument(
        "--results-files",
        action="store_true",
        help="print every committed file under benchmarks/results with the command it records, and those "
        "benchmarks/README.md does not list",
    )
    args = p.parse_args(argv)
    if args.results_files:
        print(results_files_table())
        missing, stale = results_listing_gaps()
        print(f"\nnot listed in benchmarks/README.md: {missing or 'none'}; listed, absent: {stale or 'none'}")
        return 1 if missing or stale else 0
    try:
        if args.readme:
            block = update_readme(args.readme_path, args.suite or "auto", args.results_dir)
            print(f"updated {args.readme_path}:\n{block}")
            return 0
        root = args.results_dir or SUITE_DIR
        names = (
            [args.suite]
            if args.suite
            else sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
            if os.path.isdir(root)
            else []
        )
        if not names:
            raise ValueError(f"no suite results under {root}")
        for name in names:
            for path in regenerate(name, args.results_dir):
                print(f"wrote {path}")
    except ValueError as e:
        raise SystemExit(f"benchmarks.suite.report: {e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
