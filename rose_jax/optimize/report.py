"""The search's log: :class:`CandidateRecord` per candidate, :class:`PlanReport` per search,
:func:`format_report` as a table. ``PlanReport.to_json()`` is plain JSON (the plan cache stores it).
"""

from __future__ import annotations

import dataclasses
import math

from rose_jax.optimize import measure

# transforms whose legality reason says what overlapped with what and where (format_report lists it)
DESCRIBED = ("stream_overlap", "split_compile", "bound_while_loops")


@dataclasses.dataclass
class CandidateRecord:
    """One candidate's log line (all times in seconds per iteration)."""

    label: str
    transform: dict
    window: str
    predicted_gain_s: float | None = None
    prediction: str = ""
    legal: bool | None = False  # None: not analysed (the budget or max_candidates came first)
    legal_reason: str = ""
    stage: str = "legality"  # the last stage reached: legality | isolate | local | e2e | combine
    local_baseline_s: float | None = None
    local_time_s: float | None = None
    e2e_time_s: float | None = None
    speedup: float | None = None
    equal: bool | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    kept: bool = False
    reason: str = ""
    equality: str = ""  # how ``equal`` was decided: "stepwise" | "trajectory" ("" not reached)
    e2e_baseline_s: float | None = None  # the baseline timed in turns with this candidate
    isolation: str = ""  # the child process's verdict on the first compile ("" not isolated)
    learning_check: dict | None = None  # tolerance-kept candidates: LearningCheck.to_json()
    # wall seconds of the trial's steps: "isolate" (the child's compile and call), "local" (the
    # affected piece timed alone), "time" (compile and warm-up here, then the turns with the
    # baseline), "equality" (reference and comparison)
    phase_s: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PlanReport:
    """The search's log and result; ``to_json()`` is plain JSON."""

    program: str
    fingerprint: str
    cache_key: str
    device: str
    jax_version: str
    n_iters: int
    repeats: int
    equality: str = "stepwise"  # "stepwise" | "trajectory" (see the module docstring)
    baseline_s: float | None = None
    baseline_spread_s: float | None = None
    # the baseline against itself, in the equality mode's way (bitwise: rtol = atol = 0)
    baseline_reproducible: bool | None = None
    baseline_max_abs_diff: float | None = None
    baseline_max_rel_diff: float | None = None
    baseline_repro_reason: str = ""
    candidates: list[CandidateRecord] = dataclasses.field(default_factory=list)
    plan: list[dict] = dataclasses.field(default_factory=list)
    optimized_s: float | None = None
    speedup: float | None = None
    # the plan's equality with the baseline; None: not checked (no plan was kept, so nothing was
    # compared: the plan is the baseline itself)
    equal: bool | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cache_hit: bool = False
    cache_path: str | None = None
    search_time_s: float = 0.0
    measurements: int = 0  # timed runs done by this call (0 on a cache hit)
    notes: list[str] = dataclasses.field(default_factory=list)
    # the quota step per multi-process transform of the plan (rose_jax.optimize.quotas.QuotaRecord)
    quotas: list[dict] = dataclasses.field(default_factory=list)
    windows: dict = dataclasses.field(default_factory=dict)  # where the search's windows came from
    # the XLA option set the baseline and every candidate ran under (OptimizeOptions.option_sets):
    # name, options, ms/iter of each set timed in turns, speedup vs XLA's defaults, refused sets;
    # None: no set was tried (XLA's defaults)
    base_options: dict | None = None
    # why no search ran (the run's share for it is under MIN_SEARCH_UNITS units); None: it ran
    skipped: str | None = None

    def to_json(self) -> dict:
        return _clean(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, data: dict) -> "PlanReport":
        data = dict(data)
        data["candidates"] = [CandidateRecord(**c) for c in data.get("candidates", [])]
        return cls(**data)


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def fmt_turns(t: measure.Timing) -> str:
    """Per-iteration ms of each timed turn, e.g. ``45.1, 291.8``."""
    return ", ".join(f"{x * 1e3:.1f}" for x in t.per_iter_s)


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x * 1e3:.3f}ms" if abs(x) < 1 else f"{x:.3f}s"


def _fmt_equal(x: bool | None) -> str:
    return "not checked" if x is None else str(x)


def _fmt_base_options(b: dict | None) -> str:
    """The report's line on the baseline's XLA option set ("" where none was tried)."""
    if not b:
        return ""
    times = ", ".join(f"{name} {_fmt_s(ms / 1e3)}" for name, ms in b.get("ms_per_iter", {}).items())
    refused = "".join(f"; {name} refused: {why}" for name, why in (b.get("refused") or {}).items())
    return (
        f"\nXLA options of the baseline and every candidate: {b['name']} "
        f"({b['speedup_vs_default']:.3f}x vs XLA's defaults; in turns: {times}{refused})"
    )


def format_report(report: PlanReport) -> str:
    """A human-readable table of the report."""
    head = (
        f"plan for {report.program} on {report.device} (jax {report.jax_version}); "
        f"{'CACHE HIT' if report.cache_hit else f'search {report.search_time_s:.1f}s'}\n"
        f"baseline {_fmt_s(report.baseline_s)}/iter (spread {_fmt_s(report.baseline_spread_s)}), "
        f"optimized {_fmt_s(report.optimized_s)}/iter, speedup "
        f"{'-' if report.speedup is None else f'{report.speedup:.3f}x'}, equal={_fmt_equal(report.equal)} "
        f"({report.equality}; baseline reproducible={report.baseline_reproducible}, max|d| "
        f"{'-' if report.baseline_max_abs_diff is None else f'{report.baseline_max_abs_diff:.2g}'})\n"
        f"plan: {', '.join(t['label'] for t in report.plan) or '(none: baseline kept)'}"
        f"{_fmt_base_options(report.base_options)}"
    )
    rows = [("candidate", "window", "pred", "local", "e2e", "speedup", "max|d|", "kept", "reason")]
    for c in report.candidates:
        rows.append(
            (
                c.label,
                c.window,
                _fmt_s(c.predicted_gain_s),
                f"{_fmt_s(c.local_baseline_s)}->{_fmt_s(c.local_time_s)}"
                if c.local_time_s is not None
                else "-",
                _fmt_s(c.e2e_time_s),
                "-" if c.speedup is None else f"{c.speedup:.3f}x",
                "-" if c.max_abs_diff is None else f"{c.max_abs_diff:.2g}",
                "yes" if c.kept else "no",
                c.reason if c.kept or not c.legal else c.reason,
            )
        )
    widths = [min(max(len(str(r[i])) for r in rows), 48) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        cells = [str(r[i])[:48].ljust(widths[i]) for i in range(len(widths))]
        lines.append("  ".join(cells) + "  " + str(r[-1]))
    for c in report.candidates:  # what the new families do: which work on which stream / stage
        if c.legal and c.transform.get("name") in DESCRIBED:
            lines.append(f"{c.label}: {c.legal_reason}")
    for q in report.quotas:
        lines.append(f"quotas for {q['transform']}: {q['status']}: {q['reason']}")
        for b, name in enumerate(q.get("branches") or []):
            pts = sorted((p["quota"], p["seconds"]) for p in q.get("points") or [] if p["branch"] == b)
            if pts:
                tried = ", ".join(f"{qq}%: {_fmt_s(sec)}" for qq, sec in pts)
                chosen = q["quotas"][b] if q.get("quotas") else "-"
                lines.append(f"  {name}: alone at {tried}; chosen {chosen}%")
    if report.windows:
        lines.append(f"windows: {report.windows.get('source')}: {report.windows.get('reason')}")
    return head + "\n" + "\n".join(lines) + ("\nnotes: " + "; ".join(report.notes) if report.notes else "")
